//! The console in a real headless Chromium, driven over WebDriver
//! (chromedriver, both from Debian: `scripts/dev-env.sh browser`). Each test
//! saves screenshots of the pages it visits under
//! `$SLUICE_ARTIFACTS_DIR` (default `$CARGO_TARGET_DIR/tmp/console-screenshots`).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

use crate::support::*;
use crate::webdriver::Session;

/// A headless Chromium behind a chromedriver of the test's own.
struct Browser {
    client: Session,
    driver: Child,
}

fn artefacts_dir() -> PathBuf {
    std::env::var_os("SLUICE_ARTIFACTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_TARGET_TMPDIR")))
        .join("console-screenshots")
}

fn chromium_binary() -> String {
    if let Ok(binary) = std::env::var("SLUICE_CHROMIUM") {
        return binary;
    }
    // Debian's /usr/bin/chromium is a wrapper script; the binary is here.
    let debian = "/usr/lib/chromium/chromium";
    if std::path::Path::new(debian).exists() {
        debian.to_string()
    } else {
        "chromium".to_string()
    }
}

impl Browser {
    async fn start() -> anyhow::Result<Browser> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let chromedriver = std::env::var("SLUICE_CHROMEDRIVER").unwrap_or_else(|_| "chromedriver".to_string());
        let driver = Command::new(&chromedriver)
            .arg(format!("--port={port}"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| {
                format!("starting {chromedriver}: install Chromium and chromedriver with `scripts/dev-env.sh browser`")
            })?;
        let address = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(&address).await.is_err() {
            anyhow::ensure!(Instant::now() < deadline, "chromedriver did not listen on {address}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let capabilities = serde_json::json!({
            "goog:chromeOptions": {
                "binary": chromium_binary(),
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--disable-extensions",
                    "--no-first-run",
                    "--window-size=1280,1000",
                ],
            },
        });
        let client = Session::start(&format!("http://{address}"), capabilities)
            .await
            .context("a WebDriver session with headless Chromium")?;
        Ok(Browser { client, driver })
    }

    async fn screenshot(&self, name: &str) -> anyhow::Result<PathBuf> {
        let directory = artefacts_dir();
        std::fs::create_dir_all(&directory)?;
        let path = directory.join(format!("{name}.png"));
        std::fs::write(&path, self.client.screenshot().await?)?;
        Ok(path)
    }

    /// Evaluate `script` (a function body returning JSON) in the page.
    async fn eval(&self, script: &str) -> anyhow::Result<serde_json::Value> {
        self.client.execute(script, vec![]).await
    }

    /// Wait until `script` returns `expected`; the last value on timeout.
    async fn wait_for(&self, what: &str, script: &str, expected: serde_json::Value) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let value = self.eval(script).await?;
            if value == expected {
                return Ok(());
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "waiting for {what}: last saw {value}, want {expected}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The rendered text of the element `css` selects, once it exists (read
    /// in one step: the live part may be replaced between two).
    async fn text(&self, css: &str) -> anyhow::Result<String> {
        self.client.wait_for_element(css, Duration::from_secs(30)).await?;
        let value = self
            .client
            .execute(
                "const found = document.querySelector(arguments[0]); return found === null ? null : found.innerText.trim();",
                vec![serde_json::json!(css)],
            )
            .await?;
        value
            .as_str()
            .map(str::to_string)
            .with_context(|| format!("no {css} on the page"))
    }

    async fn close(mut self) -> anyhow::Result<()> {
        let closed = self.client.close().await;
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        closed?;
        Ok(())
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

const HOLDER_IDS: &str =
    "return Array.from(document.querySelectorAll('#holders tr[data-job-id]')).map(row => row.dataset.jobId);";
const WAITER_IDS: &str =
    "return Array.from(document.querySelectorAll('#waiters tr[data-job-id]')).map(row => row.dataset.jobId);";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_key_page_lists_the_holders_and_waiters_and_follows_them_live() -> anyhow::Result<()> {
    let console = ConsoleStack::start("browserkey").await?;
    let prefix = console.stack.config.kafka.topic_prefix.clone();
    let key = "reports";
    let first = format!("{prefix}first");
    let (low, high) = (format!("{prefix}low-priority"), format!("{prefix}high-priority"));
    console.enqueue(&first, key, 1, 10).await?;
    console.wait_key(key, &[&first], &[]).await?;
    console.enqueue(&low, key, 1, 60).await?;
    console.enqueue(&high, key, 1, 3).await?;
    console.wait_key(key, &[&first], &[&high, &low]).await?;

    let browser = Browser::start().await?;
    let page = format!(
        "{}{}",
        console.url,
        sluice_console::html::key_link(&console.tenant, key)
    );
    browser.client.goto(&page).await?;
    assert_eq!(browser.eval(HOLDER_IDS).await?, serde_json::json!([first]));
    assert_eq!(
        browser.eval(WAITER_IDS).await?,
        serde_json::json!([high, low]),
        "grant order: priority first"
    );
    assert_eq!(browser.text("#effective-max").await?, "1");
    assert_eq!(browser.text("#waiting-count").await?, "2");
    let positions = browser
        .eval("return Array.from(document.querySelectorAll('#waiters tbody tr')).map(row => row.cells[0].textContent + ' ' + row.cells[3].textContent);")
        .await?;
    assert_eq!(positions, serde_json::json!(["1 3", "2 60"]), "position and priority");
    browser.screenshot("key-page").await?;

    // The holder finishes: the page follows without being reloaded.
    browser.eval("window.notReloaded = true; return true;").await?;
    let admission = console.stack.admission_client().await?;
    assert_eq!(
        claim_one(&admission, "browser-worker", &first, 1).await?,
        pb::ClaimOutcome::Claimed as i32
    );
    complete_one(
        &admission,
        "browser-worker",
        &first,
        1,
        pb::completion::Outcome::Success(pb::Success {}),
    )
    .await?;
    browser
        .wait_for("the next holder on the page", HOLDER_IDS, serde_json::json!([high]))
        .await?;
    assert_eq!(browser.eval(WAITER_IDS).await?, serde_json::json!([low]));
    assert_eq!(
        browser.eval("return window.notReloaded === true;").await?,
        serde_json::json!(true)
    );
    browser
        .wait_for(
            "a few samples on the chart",
            "return Number(document.getElementById('key-chart').dataset.samples) >= 3;",
            serde_json::json!(true),
        )
        .await?;
    browser.screenshot("key-page-live").await?;
    browser.close().await?;
    console.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_override_set_from_the_key_page_changes_the_max() -> anyhow::Result<()> {
    let console = ConsoleStack::start("browseroverride").await?;
    let prefix = console.stack.config.kafka.topic_prefix.clone();
    let key = "exports";
    let jobs: Vec<String> = (0..3).map(|index| format!("{prefix}export-{index}")).collect();
    console.enqueue(&jobs[0], key, 1, 10).await?;
    console.wait_key(key, &[&jobs[0]], &[]).await?;
    console.enqueue(&jobs[1], key, 1, 10).await?;
    console.enqueue(&jobs[2], key, 1, 10).await?;
    console.wait_key(key, &[&jobs[0]], &[&jobs[1], &jobs[2]]).await?;

    let browser = Browser::start().await?;
    let page = format!(
        "{}{}",
        console.url,
        sluice_console::html::key_link(&console.tenant, key)
    );
    browser.client.goto(&page).await?;
    assert_eq!(browser.text("#effective-max").await?, "1");
    let field = browser.client.find("#set-override input[name=max]").await?;
    field.clear().await?;
    field.send_keys("3").await?;
    browser
        .client
        .find("#set-override button[type=submit]")
        .await?
        .click()
        .await?;
    // The confirmation step: nothing changed yet.
    let asked = browser.text("#confirm-what").await?;
    assert!(
        asked.contains("Set the override of key \"exports\"") && asked.contains("to 3"),
        "{asked}"
    );
    assert_eq!(
        console.key_state(key).await?.override_max,
        None,
        "not before it is confirmed"
    );
    browser.screenshot("confirm-page").await?;
    browser.client.find("#confirm-button").await?.click().await?;

    // Back on the key page: the max is the override, and it granted both
    // waiters. The click returns before the browser has followed the
    // redirect: wait for the key page's address first.
    browser
        .wait_for(
            "the key page after the confirmation",
            "return location.pathname;",
            serde_json::json!("/key"),
        )
        .await?;
    let landed = browser.client.current_url().await?;
    let (path, query) = landed
        .strip_prefix(&console.url)
        .and_then(|rest| rest.split_once('?'))
        .with_context(|| format!("a console page with a query, not {landed}"))?;
    assert_eq!(path, "/key");
    assert!(query.ends_with("done=override-set"), "{landed}");
    assert_eq!(browser.text("#effective-max").await?, "3");
    assert_eq!(browser.text("#max-origin").await?, "runtime override");
    assert_eq!(console.key_state(key).await?.override_max, Some(3));
    browser
        .wait_for(
            "three holders on the page",
            "return document.querySelectorAll('#holders tr[data-job-id]').length;",
            serde_json::json!(3),
        )
        .await?;
    console.wait_key(key, &[&jobs[0], &jobs[1], &jobs[2]], &[]).await?;
    browser.screenshot("key-page-after-override").await?;
    browser.close().await?;
    console.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browser_job_page_explains_a_wait_and_every_page_renders() -> anyhow::Result<()> {
    let console = ConsoleStack::start("browserjob").await?;
    let prefix = console.stack.config.kafka.topic_prefix.clone();
    let (holder, waiter) = (format!("{prefix}holder"), format!("{prefix}waiter"));
    console.enqueue(&holder, "warehouse", 1, 10).await?;
    console.wait_key("warehouse", &[&holder], &[]).await?;
    console.enqueue(&waiter, "warehouse", 1, 10).await?;
    console.wait_key("warehouse", &[&holder], &[&waiter]).await?;

    let browser = Browser::start().await?;
    browser
        .client
        .goto(&format!("{}{}", console.url, sluice_console::html::job_link(&waiter)))
        .await?;
    assert_eq!(browser.text("#job-status").await?, "waiting");
    assert_eq!(browser.text("#wait-holders").await?, "1 of 1 held");
    assert_eq!(browser.text("#wait-position").await?, "1 of 1 waiting (0 ahead)");
    let reason = browser.text("#job-reason").await?;
    assert!(
        reason.contains("warehouse") && reason.contains("1 of 1 held"),
        "{reason}"
    );
    let acquiring = browser
        .eval(
            "return Array.from(document.querySelectorAll('#chain tr.acquiring')).map(row => row.cells[2].textContent);",
        )
        .await?;
    assert_eq!(acquiring, serde_json::json!(["warehouse"]));
    browser.screenshot("job-page").await?;

    // Every other page renders in the browser; each gets a screenshot.
    let mut rates = console.stack.rates_client().await?;
    rates
        .put_rate_limit(pb::PutRateLimitRequest {
            resource: Some(pb::RateLimitResource {
                tenant: console.tenant.clone(),
                resource_key: "stripe".to_string(),
                max_count: 100,
                window_seconds: 60,
            }),
        })
        .await?;
    browser.client.goto(&format!("{}/", console.url)).await?;
    browser
        .wait_for(
            "the tenant on the overview",
            &format!(
                "return document.querySelector('#tenants tr[data-tenant=\"{}\"]') !== null;",
                console.tenant
            ),
            serde_json::json!(true),
        )
        .await?;
    browser.screenshot("overview").await?;
    browser
        .client
        .goto(&format!(
            "{}{}",
            console.url,
            sluice_console::html::link("/keys", &[("tenant", &console.tenant)])
        ))
        .await?;
    assert_eq!(
        browser
            .eval("return Array.from(document.querySelectorAll('#keys tr[data-key]')).map(row => row.dataset.key);")
            .await?,
        serde_json::json!(["warehouse"])
    );
    browser.screenshot("keys").await?;
    browser
        .client
        .goto(&format!(
            "{}{}",
            console.url,
            sluice_console::html::link("/rate-limits", &[("tenant", &console.tenant)])
        ))
        .await?;
    assert_eq!(
        browser
            .eval("return Array.from(document.querySelectorAll('#rate-limits tr[data-resource-key]')).map(row => row.dataset.resourceKey);")
            .await?,
        serde_json::json!(["stripe"])
    );
    browser.screenshot("rate-limits").await?;
    let producer = RequestProducer::new(&console.stack.config)?;
    producer
        .send_messages(vec![RawRequest {
            payload: serde_json::to_vec(&serde_json::json!({"tenant": console.tenant, "task_group": "nope"}))?,
            headers: vec![("content-type".to_string(), b"application/json".to_vec())],
            ..Default::default()
        }])
        .await?;
    browser.client.goto(&format!("{}/dead-letters", console.url)).await?;
    browser
        .wait_for(
            "the dead letter, live",
            "return document.querySelectorAll('#recent-dead-letters tbody tr').length > 0;",
            serde_json::json!(true),
        )
        .await?;
    browser.screenshot("dead-letters").await?;
    browser.close().await?;
    console.stop().await
}
