//! The console's pages and actions over HTTP, against a real stack.

use std::time::Duration;

use sluice_e2e::*;
use sluice_proto::v1 as pb;

use crate::support::*;

/// Hostile on purpose: every page must show it as text.
const HOSTILE_KEY: &str = "<b>\"hot\" & key</b>";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_and_job_pages_show_holders_waiters_and_why_escaping_everything() -> anyhow::Result<()> {
    let console = ConsoleStack::start("consolekeypage").await?;
    let prefix = console.stack.config.kafka.topic_prefix.clone();
    let holder = format!("{prefix}<img src=x onerror=alert(1)>");
    let (late, urgent, urgent_too) = (
        format!("{prefix}late"),
        format!("{prefix}urgent"),
        format!("{prefix}urgent-too"),
    );
    console.enqueue(&holder, HOSTILE_KEY, 1, 10).await?;
    console.wait_key(HOSTILE_KEY, &[&holder], &[]).await?;
    console.enqueue(&late, HOSTILE_KEY, 1, 50).await?;
    console.enqueue(&urgent, HOSTILE_KEY, 1, 5).await?;
    console.enqueue(&urgent_too, HOSTILE_KEY, 1, 5).await?;
    let grant_order = [urgent.as_str(), urgent_too.as_str(), late.as_str()];
    console.wait_key(HOSTILE_KEY, &[&holder], &grant_order).await?;

    let http = console.http();
    let path = sluice_console::html::key_link(&console.tenant, HOSTILE_KEY);
    let page = http.get(&path).await?;
    assert_eq!(page.status, 200, "{}", page.body);
    assert!(page.content_type.starts_with("text/html"), "{}", page.content_type);
    assert!(!page.body.contains(HOSTILE_KEY), "the key is escaped");
    assert!(!page.body.contains("<img src=x"), "the job id is escaped");
    assert!(page.body.contains(&escaped(HOSTILE_KEY)));
    let holders = element(&page.body, "holders", "</table>").expect("a holders table");
    assert_eq!(attribute_values(holders, "data-job-id"), vec![holder.clone()]);
    let waiters = element(&page.body, "waiters", "</table>").expect("a waiters table");
    assert_eq!(attribute_values(waiters, "data-job-id"), grant_order.to_vec());
    let max = element(&page.body, "effective-max", "</dd>").expect("the effective max");
    assert!(max.contains(">1<"), "{max}");
    let origin = element(&page.body, "max-origin", "</dd>").expect("the max's origin");
    assert!(origin.contains("job max (carried by the head waiter)"), "{origin}");
    assert!(page.body.contains("id=\"key-chart\""), "a chart");

    // The live part alone, as the page's script fetches it.
    let live = http.get_live(&path).await?;
    assert_eq!(live.status, 200);
    assert!(!live.body.contains("<html"), "only the live part");
    let waiters = element(&live.body, "waiters", "</table>").expect("waiters in the live part");
    assert_eq!(attribute_values(waiters, "data-job-id"), grant_order.to_vec());

    // The job page explains the wait: the key, holders against max, position.
    let job = http.get(&sluice_console::html::job_link(&urgent_too)).await?;
    assert_eq!(job.status, 200, "{}", job.body);
    let status = element(&job.body, "job-status", "</dd>").expect("a status");
    assert!(status.contains(">waiting<"), "{status}");
    let wait_holders = element(&job.body, "wait-holders", "</dd>").expect("holders against max");
    assert!(wait_holders.contains("1 of 1 held"), "{wait_holders}");
    let position = element(&job.body, "wait-position", "</dd>").expect("a position");
    assert!(position.contains("2 of 3 waiting"), "{position}");
    let reason = element(&job.body, "job-reason", "</p>").expect("admission's reason");
    assert!(
        reason.contains("1 of 1 held, 1 ahead of this job among 3 waiting"),
        "{reason}"
    );
    let chain = element(&job.body, "chain", "</table>").expect("the chain");
    assert!(
        chain.contains(&escaped(HOSTILE_KEY)) && chain.contains("acquiring"),
        "{chain}"
    );
    let trace = attribute_values(element(&job.body, "trace-link", "</a>").expect("a trace link"), "href");
    assert_eq!(
        trace,
        vec![format!(
            "http://traces.example/search?job={}&tenant={}",
            sluice_console::html::encode(&urgent_too),
            sluice_console::html::encode(&console.tenant)
        )]
    );
    let holder_page = http.get(&sluice_console::html::job_link(&holder)).await?;
    assert!(
        !holder_page.body.contains("<img src=x"),
        "the job id is escaped on its own page"
    );

    // Unknown things answer 404 with a page that says so.
    let missing = http.get("/job?id=no-such-job").await?;
    assert_eq!(missing.status, 404, "{}", missing.body);
    assert_eq!(http.get("/no-such-page").await?.status, 404);
    assert_eq!(http.get("/key?tenant=&key=").await?.status, 400);
    console.stop().await
}

/// POST an action, then confirm it with the token of the confirmation page.
async fn confirmed(http: &Http, fields: &[(&str, &str)]) -> anyhow::Result<Answer> {
    let asked = http.post_form("/actions", fields, None).await?;
    anyhow::ensure!(asked.status == 200, "the confirmation page: {asked:?}");
    let token = confirmation_token(&asked.body).ok_or_else(|| anyhow::anyhow!("no token: {}", asked.body))?;
    let mut confirm: Vec<(&str, &str)> = fields.to_vec();
    confirm.push(("confirmed", "yes"));
    confirm.push(("token", &token));
    http.post_form("/actions", &confirm, None).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn actions_apply_only_after_their_own_confirmation() -> anyhow::Result<()> {
    let console = ConsoleStack::start("consoleactions").await?;
    let prefix = console.stack.config.kafka.topic_prefix.clone();
    let key = "steered";
    let jobs: Vec<String> = (0..3).map(|index| format!("{prefix}job-{index}")).collect();
    console.enqueue(&jobs[0], key, 1, 10).await?;
    console.wait_key(key, &[&jobs[0]], &[]).await?;
    console.enqueue(&jobs[1], key, 1, 10).await?;
    console.enqueue(&jobs[2], key, 1, 10).await?;
    console.wait_key(key, &[&jobs[0]], &[&jobs[1], &jobs[2]]).await?;
    let http = console.http();
    let tenant = console.tenant.clone();
    let set = [
        ("action", "set-override"),
        ("tenant", tenant.as_str()),
        ("key", key),
        ("max", "3"),
    ];

    // Asking shows what would happen and changes nothing.
    let asked = http.post_form("/actions", &set, None).await?;
    assert_eq!(asked.status, 200);
    assert!(asked.body.contains("Set the override of key"), "{}", asked.body);
    let token = confirmation_token(&asked.body).expect("a token");
    assert_eq!(console.key_state(key).await?.override_max, None);

    // A made-up token, another action's token, another site: refused.
    let mut forged: Vec<(&str, &str)> = set.to_vec();
    forged.extend([("confirmed", "yes"), ("token", "00")]);
    assert_eq!(http.post_form("/actions", &forged, None).await?.status, 403);
    let other = [
        ("action", "set-override"),
        ("tenant", tenant.as_str()),
        ("key", key),
        ("max", "4"),
        ("confirmed", "yes"),
        ("token", token.as_str()),
    ];
    assert_eq!(http.post_form("/actions", &other, None).await?.status, 403);
    let mut genuine: Vec<(&str, &str)> = set.to_vec();
    genuine.extend([("confirmed", "yes"), ("token", token.as_str())]);
    let cross_site = http
        .post_form("/actions", &genuine, Some("https://evil.example"))
        .await?;
    assert_eq!(cross_site.status, 403);
    assert_eq!(
        console.key_state(key).await?.override_max,
        None,
        "nothing refused applied"
    );
    let bad = http
        .post_form(
            "/actions",
            &[
                ("action", "set-override"),
                ("tenant", tenant.as_str()),
                ("key", key),
                ("max", "lots"),
            ],
            None,
        )
        .await?;
    assert_eq!(bad.status, 400);
    assert!(bad.body.contains("max:"), "{}", bad.body);

    // Confirmed: applied, and back to the key page saying so.
    let applied = http.post_form("/actions", &genuine, None).await?;
    assert_eq!(applied.status, 303, "{applied:?}");
    let location = applied.location.clone().unwrap_or_default();
    assert!(
        location.starts_with("/key?") && location.ends_with("&done=override-set"),
        "{location}"
    );
    assert_eq!(console.key_state(key).await?.override_max, Some(3));
    // Raising the max granted both waiters.
    console.wait_key(key, &[&jobs[0], &jobs[1], &jobs[2]], &[]).await?;
    let page = http.get(&location).await?;
    assert!(page.body.contains("Override set."), "{}", page.body);
    let origin = element(&page.body, "max-origin", "</dd>").expect("origin");
    assert!(origin.contains("runtime override"), "{origin}");

    // Pause, then resume.
    let pause = [("action", "pause"), ("tenant", tenant.as_str()), ("key", key)];
    assert_eq!(confirmed(&http, &pause).await?.status, 303);
    let paused = console.key_state(key).await?;
    assert!(paused.paused && paused.override_max == Some(0), "{paused:?}");
    let resume = [("action", "resume"), ("tenant", tenant.as_str()), ("key", key)];
    assert_eq!(confirmed(&http, &resume).await?.status, 303);
    assert_eq!(console.key_state(key).await?.override_max, None);

    // Cancel a waiting job.
    let blocked = format!("{prefix}blocked");
    let blocker = format!("{prefix}blocker");
    console.enqueue(&blocker, "cancel-key", 1, 10).await?;
    console.wait_key("cancel-key", &[&blocker], &[]).await?;
    console.enqueue(&blocked, "cancel-key", 1, 10).await?;
    console.wait_key("cancel-key", &[&blocker], &[&blocked]).await?;
    let cancel = [
        ("action", "cancel-job"),
        ("job_id", blocked.as_str()),
        ("reason", "not needed"),
    ];
    let cancelled = confirmed(&http, &cancel).await?;
    assert_eq!(cancelled.status, 303);
    assert!(cancelled
        .location
        .unwrap_or_default()
        .ends_with("&done=cancel-requested"));
    let admission = console.stack.admission_client().await?;
    wait_status(&admission, &blocked, pb::JobStatus::Cancelled, Duration::from_secs(30)).await?;
    console.wait_key("cancel-key", &[&blocker], &[]).await?;

    // Put a rate limit, see it listed with its window, delete it.
    let put = [
        ("action", "put-rate-limit"),
        ("tenant", tenant.as_str()),
        ("resource_key", "stripe"),
        ("max_count", "7"),
        ("window_seconds", "60"),
    ];
    assert_eq!(confirmed(&http, &put).await?.status, 303);
    let mut rates = console.stack.rates_client().await?;
    let listed = rates
        .list_rate_limits(pb::ListRateLimitsRequest {
            tenant: tenant.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(listed.resources.len(), 1);
    assert_eq!(
        (listed.resources[0].max_count, listed.resources[0].window_seconds),
        (7, 60)
    );
    let page = http
        .get(&sluice_console::html::link("/rate-limits", &[("tenant", &tenant)]))
        .await?;
    let table = element(&page.body, "rate-limits", "</table>").expect("the rate limits");
    assert_eq!(attribute_values(table, "data-resource-key"), vec!["stripe"]);
    assert!(table.contains("0 / 7"), "nothing used yet: {table}");
    // Use the whole window: the page shows it full, and when a unit frees up.
    let taken = rates
        .try_acquire(pb::TryAcquireRequest {
            tenant: tenant.clone(),
            limit: Some(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::RateLimitKey("stripe".to_string())),
            }),
            cost: 7,
        })
        .await?
        .into_inner();
    assert!(taken.allowed, "{taken:?}");
    let window = http
        .get(&sluice_console::html::link(
            "/rate-limits",
            &[("tenant", &tenant), ("window", "resource:stripe")],
        ))
        .await?;
    let used = element(&window.body, "window-used", "</dd>").expect("the window's use");
    assert!(used.contains("7 / 7"), "{used}");
    let next = element(&window.body, "window-next", "</dd>").expect("the next free slot");
    // Nobody waits, so the owner keeps no timer: the bound it knows.
    assert!(next.contains("full; a unit frees up within 1 min"), "{next}");
    // A job waiting on the full window: its page says when its slot opens,
    // and the window now has an exact next slot.
    let throttled = format!("{prefix}throttled");
    let request = pb::JobRequest {
        job_id: Some(throttled.clone()),
        tenant: tenant.clone(),
        task_group: "default".to_string(),
        limits: vec![pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::RateLimitKey("stripe".to_string())),
            })),
        }],
        ..Default::default()
    };
    let mut admission = console.stack.admission_client().await?;
    admission.enqueue(pb::EnqueueRequest { job: Some(request) }).await?;
    eventually(Duration::from_secs(60), "the job waiting on the window", || async {
        let job = http.get_live(&sluice_console::html::job_link(&throttled)).await?;
        Ok(element(&job.body, "wait-retry", "</dd>").is_some_and(|retry| retry.contains(">in ")))
    })
    .await?;
    let window = http
        .get(&sluice_console::html::link(
            "/rate-limits",
            &[("tenant", &tenant), ("window", "resource:stripe")],
        ))
        .await?;
    let next = element(&window.body, "window-next", "</dd>").expect("the next free slot");
    assert!(next.contains(">in "), "the head waiter's slot: {next}");
    let delete = [
        ("action", "delete-rate-limit"),
        ("tenant", tenant.as_str()),
        ("resource_key", "stripe"),
    ];
    assert_eq!(confirmed(&http, &delete).await?.status, 303);
    let listed = rates
        .list_rate_limits(pb::ListRateLimitsRequest {
            tenant: tenant.clone(),
            ..Default::default()
        })
        .await?
        .into_inner();
    assert!(listed.resources.is_empty());
    console.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overview_keys_list_and_dead_letters_follow_the_stack() -> anyhow::Result<()> {
    let console = ConsoleStack::start("consoleoverview").await?;
    let prefix = console.stack.config.kafka.topic_prefix.clone();
    let tenant = console.tenant.clone();
    let http = console.http();

    // A busy key: one holder, two waiters.
    for index in 0..3 {
        console.enqueue(&format!("{prefix}busy-{index}"), "busy", 1, 10).await?;
    }
    eventually(Duration::from_secs(60), "busy has 1 holder, 2 waiters", || async {
        let state = console.key_state("busy").await?;
        Ok(state.holders.len() == 1 && state.waiting == 2)
    })
    .await?;
    // Admitted jobs are counted from jobs.admitted.*: keep admitting jobs
    // (each on a key of its own) until the overview shows a rate.
    let mut admitted = 0;
    eventually(Duration::from_secs(60), "the overview to show admitted jobs", || {
        admitted += 1;
        let job_id = format!("{prefix}free-{admitted}");
        let key = format!("free-{admitted}");
        let console = &console;
        let http = &http;
        let tenant = tenant.clone();
        async move {
            console.enqueue(&job_id, &key, 1, 10).await?;
            let page = http.get("/").await?;
            anyhow::ensure!(page.status == 200, "{page:?}");
            let Some(row) = element(&page.body, "tenants", "</table>") else {
                return Ok(false);
            };
            let Some(start) = row.find(&format!("data-tenant=\"{}\"", escaped(&tenant))) else {
                return Ok(false);
            };
            let row = &row[start..];
            let row = &row[..row.find("</tr>").unwrap_or(row.len())];
            let busy_listed = row.contains(">busy</a>") && row.contains("2 waiting, 1/1");
            let admitted_shown = row
                .split("class=\"admitted\">")
                .nth(1)
                .is_some_and(|cell| !cell.starts_with("0.0/s"));
            Ok(busy_listed && admitted_shown)
        }
    })
    .await?;

    // 100k keys page on the server: 5 keys, 2 a page.
    let mut limits = console.stack.limits_client().await?;
    for index in 0..5 {
        limits
            .set_limit(pb::SetLimitRequest {
                key: Some(pb::KeyRef {
                    tenant: tenant.clone(),
                    key: format!("paged-{index}"),
                }),
                change: Some(pb::set_limit_request::Change::Max(5)),
            })
            .await?;
    }
    let mut path = sluice_console::html::link(
        "/keys",
        &[("tenant", &tenant), ("prefix", "paged-"), ("page_size", "2")],
    );
    let mut pages = Vec::new();
    loop {
        let page = http.get(&path).await?;
        assert_eq!(page.status, 200, "{}", page.body);
        let table = element(&page.body, "keys", "</table>").expect("a keys table");
        pages.push(attribute_values(table, "data-key"));
        match element(&page.body, "next-page", "</a>") {
            Some(next) => path = attribute_values(next, "href").remove(0),
            None => break,
        }
        assert!(pages.len() < 10, "paging does not end: {pages:?}");
    }
    assert_eq!(
        pages,
        vec![vec!["paged-0", "paged-1"], vec!["paged-2", "paged-3"], vec!["paged-4"]]
    );

    // A producer's typo is dead-lettered; the console counts it by reason.
    let producer = RequestProducer::new(&console.stack.config)?;
    let typo = serde_json::json!({
        "tenant": tenant,
        "task_group": "default",
        "limits": [{"concurrency": {"key": "x", "max_concurency": 2}}],
    });
    producer
        .send_messages(vec![RawRequest {
            payload: serde_json::to_vec(&typo)?,
            headers: vec![("content-type".to_string(), b"application/json".to_vec())],
            ..Default::default()
        }])
        .await?;
    eventually(Duration::from_secs(60), "the dead letter on its page", || async {
        let page = http.get_live("/dead-letters").await?;
        let Some(reasons) = element(&page.body, "reasons", "</table>") else {
            return Ok(false);
        };
        let recent = element(&page.body, "recent-dead-letters", "</table>").unwrap_or_default();
        Ok(reasons.contains("max_concurency") && recent.contains(&escaped(&tenant)) && recent.contains("invalid"))
    })
    .await?;
    console.stop().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floating_key_page_shows_the_floating_max_and_the_refreshes_seen() -> anyhow::Result<()> {
    let console = ConsoleStack::start("consolefloating").await?;
    let stop = sluice_common::Shutdown::new();
    let records = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let dispatcher: DispatcherAddress = std::sync::Arc::new(std::sync::Mutex::new(
        console.stack.refresh_dispatchers[0].endpoint.clone(),
    ));
    tokio::spawn(run_refresh_worker(
        console.stack.config.clone(),
        dispatcher,
        std::sync::Arc::new(|_task: &pb::RefreshTask| Ok(3)),
        records.clone(),
        stop.clone(),
    ));
    let http = console.http();
    let path = sluice_console::html::key_link(&console.tenant, "gpu");
    // Opened before the key exists: the console watches it from now on.
    assert_eq!(http.get(&path).await?.status, 200);
    let mut admission = console.stack.admission_client().await?;
    for index in 0..3 {
        let mut request = floating_job(&console.tenant, "gpu", 1, 100, &format!("gpu-{index}"));
        request.job_id = Some(format!("{}gpu-{index}", console.stack.config.kafka.topic_prefix));
        admission.enqueue(pb::EnqueueRequest { job: Some(request) }).await?;
    }
    // The first waiter makes a refresh due; the worker answers 3, which
    // admits all three.
    eventually(Duration::from_secs(60), "the refreshed max on the key page", || async {
        let page = http.get_live(&path).await?;
        let max = element(&page.body, "effective-max", "</dd>")
            .unwrap_or_default()
            .to_string();
        let origin = element(&page.body, "max-origin", "</dd>")
            .unwrap_or_default()
            .to_string();
        let refreshes = element(&page.body, "refreshes", "</table>")
            .unwrap_or_default()
            .to_string();
        Ok(max.contains(">3<")
            && origin.contains("floating value")
            && refreshes.contains("<td>3</td><td>succeeded</td>")
            && element(&page.body, "holders", "</table>")
                .is_some_and(|holders| attribute_values(holders, "data-job-id").len() == 3))
    })
    .await?;
    let page = http.get(&path).await?;
    let floating = element(&page.body, "floating", "</section>").expect("the floating section");
    assert!(floating.contains("pool=gpu"), "the key's metadata: {floating}");
    assert!(!records
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .is_empty());
    stop.trigger();
    console.stop().await
}

/// The services speak only TLS: the console reads them over `https://`,
/// trusting `tls.ca_file`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_reads_services_that_speak_only_tls() -> anyhow::Result<()> {
    use sluice_e2e::pki::{folder, new_pki, write_pki};

    let folder = folder("console")?;
    let pki = new_pki("console")?;
    let (cert, key, ca) = write_pki(&folder, &pki)?;
    let console = ConsoleStack::start_with(
        "consoletls",
        &[
            ("tls.cert_file", cert.as_str()),
            ("tls.key_file", key.as_str()),
            ("tls.ca_file", ca.as_str()),
        ],
    )
    .await?;
    assert!(console.stack.admissions[0].endpoint.starts_with("https://"));
    let holder = format!("{}tls-holder", console.stack.config.kafka.topic_prefix);
    console.enqueue(&holder, "tls-key", 1, 10).await?;
    console.wait_key("tls-key", &[&holder], &[]).await?;
    let page = console
        .http()
        .get(&sluice_console::html::key_link(&console.tenant, "tls-key"))
        .await?;
    assert_eq!(page.status, 200, "{}", page.body);
    let holders = element(&page.body, "holders", "</table>").expect("a holders table");
    assert_eq!(attribute_values(holders, "data-job-id"), vec![holder]);
    console.stop().await?;
    std::fs::remove_dir_all(folder)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_auth_on_the_console_needs_an_admins_token() -> anyhow::Result<()> {
    let folder = sluice_e2e::pki::folder("consoleauth")?;
    let issuer = sluice_e2e::tokens::TokenIssuer::new()?;
    let auth = sluice_e2e::tokens::auth_settings(&folder, &issuer)?;
    let settings: Vec<(&str, &str)> = auth.iter().map(|(key, value)| (*key, value.as_str())).collect();
    let console = ConsoleStack::start_with("consoleauth", &settings).await?;
    let http = console.http();

    let anonymous = http.get("/").await?;
    assert_eq!(anonymous.status, 401, "{}", anonymous.body);
    let reader = issuer.token("reader", &[console.tenant.as_str()], &["reader", "operator"])?;
    let forbidden = http.get_as("/", &reader).await?;
    assert_eq!(forbidden.status, 403, "{}", forbidden.body);
    assert!(forbidden.body.contains("admin role"), "{}", forbidden.body);
    let expired = issuer.sign(serde_json::json!({
        "sub": "late", "iss": sluice_e2e::tokens::ISSUER, "aud": sluice_e2e::tokens::AUDIENCE,
        "exp": sluice_e2e::tokens::TokenIssuer::now_s() - 3600, "sluice_roles": ["admin"],
    }))?;
    assert_eq!(http.get_as("/", &expired).await?.status, 401);

    // An admin sees the pages, which the console fills by calling the
    // services with the internal token.
    let admin = issuer.token("platform", &[], &["admin"])?;
    let holder = format!("{}auth-holder", console.stack.config.kafka.topic_prefix);
    let mut request = concurrency_job(&console.tenant, "auth-key", 1, 10, &holder);
    request.job_id = Some(holder.clone());
    console
        .stack
        .admission_client()
        .await?
        .enqueue(sluice_e2e::tokens::with_token(
            pb::EnqueueRequest { job: Some(request) },
            &admin,
        ))
        .await?;
    let link = sluice_console::html::key_link(&console.tenant, "auth-key");
    eventually(Duration::from_secs(60), "the holder on the key page", || async {
        let page = http.get_as(&link, &admin).await?;
        anyhow::ensure!(page.status == 200, "{}", page.body);
        let holders = element(&page.body, "holders", "</table>").unwrap_or_default();
        Ok(attribute_values(holders, "data-job-id") == vec![holder.clone()])
    })
    .await?;
    // Probes and assets stay open.
    assert_eq!(http.get("/healthz").await?.status, 200);
    assert_eq!(http.get("/assets/console.css").await?.status, 200);
    console.stop().await?;
    Ok(())
}
