//! Every `sluice` command against a running stack, checking what it prints
//! as tables and with `--output json`, and that failures exit non-zero with
//! the service, the gRPC status code and its message.

use std::time::Duration;

use serde_json::Value;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

use crate::support::{sluice, sluice_fails, sluice_ok, LOW_CONNECTIONS};

async fn admitted_and_claimed(stack: &Stack, job_id: &str, request: pb::JobRequest) -> anyhow::Result<()> {
    let admission = stack.admission_client().await?;
    enqueue_with_id(&admission, job_id, request).await?;
    wait_status(&admission, job_id, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    let outcome = claim_one(&admission, "cli-test-worker", job_id, 1).await?;
    anyhow::ensure!(
        outcome == pb::ClaimOutcome::Claimed as i32,
        "claim of {job_id}: {outcome}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_and_keys_commands_show_waits_and_steer_keys() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("clijobs", LOW_CONNECTIONS)?, 1).await?;
    let admission = stack.admission_client().await?;
    admitted_and_claimed(&stack, "running-1", concurrency_job("acme", "cli-key", 1, 10, "a")).await?;
    enqueue_with_id(&admission, "waiting-1", concurrency_job("acme", "cli-key", 1, 10, "b")).await?;
    wait_status(&admission, "waiting-1", pb::JobStatus::Waiting, Duration::from_secs(30)).await?;
    eventually(Duration::from_secs(10), "waiting-1 queued at the owner", || async {
        Ok(key_state(&stack, "acme", "cli-key").await?.waiting == 1)
    })
    .await?;

    // jobs get: why the job waits.
    let table = sluice_ok(&stack, &["jobs", "get", "waiting-1"]).await?;
    assert_eq!(table.field("job").as_deref(), Some("waiting-1"), "{table}");
    assert_eq!(table.field("status").as_deref(), Some("waiting"), "{table}");
    assert_eq!(
        table.field("reason").as_deref(),
        Some("waiting on concurrency key \"cli-key\" (tenant \"acme\"): 1 of 1 held, 0 ahead of this job among 1 waiting"),
        "{table}"
    );
    assert_eq!(table.field("attempt").as_deref(), Some("1 of 1"), "{table}");
    assert_eq!(table.field("step").as_deref(), Some("1 of 1"), "{table}");
    assert!(
        table
            .field("waiting since")
            .is_some_and(|since| since.ends_with(" ago)")),
        "{table}"
    );
    for expected in [
        "acquisition order",
        "  STEP  KIND         TENANT  KEY      MAX  ORIGIN  STATE",
        "  1     concurrency  acme    cli-key  1    job     acquiring",
    ] {
        assert!(table.stdout.contains(expected), "missing {expected:?} in\n{table}");
    }
    let view = sluice_ok(&stack, &["jobs", "get", "waiting-1", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(view["job_id"], "waiting-1");
    assert_eq!(view["status"], "waiting");
    assert_eq!(view["priority"], 10);
    assert_eq!(view["step"], 0);
    assert_eq!(view["limits"][0]["concurrency"]["key"], "cli-key");
    assert_eq!(view["limits"][0]["concurrency"]["max_concurrency"], 1);
    assert_eq!(view["acquisition_order"][0]["kind"], "concurrency");
    assert_eq!(view["acquisition_order"][0]["origin"], "job");
    assert_eq!(view["waiting"]["key"], "cli-key");
    assert_eq!(view["waiting"]["holders"], 1);
    assert_eq!(view["waiting"]["max"], 1);
    assert_eq!(view["waiting"]["position"], 0);
    assert_eq!(view["claimed_by"], Value::Null);
    let running = sluice_ok(&stack, &["jobs", "get", "running-1", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(running["status"], "running");
    assert_eq!(running["claimed_by"], "cli-test-worker");
    assert!(
        running["lease_expires_at_ms"].as_i64().unwrap_or_default() > 0,
        "{running}"
    );

    // keys list and describe.
    let listed = sluice_ok(&stack, &["keys", "list", "--tenant", "acme"]).await?;
    assert!(
        listed
            .stdout
            .contains("TENANT  KEY      KIND         HOLDERS  WAITING  OVERRIDE  FLOATING MAX"),
        "{listed}"
    );
    assert!(
        listed
            .stdout
            .contains("acme    cli-key  concurrency  1        1        -         -"),
        "{listed}"
    );
    let listed = sluice_ok(&stack, &["keys", "list", "-t", "acme", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(
        listed,
        serde_json::json!({"keys": [{"tenant": "acme", "key": "cli-key", "kind": "concurrency", "holders": 1,
            "waiting": 1, "override_max": null, "floating_max": null, "adaptive_max": null}], "next_page_token": null})
    );
    let described = sluice_ok(&stack, &["keys", "describe", "-t", "acme", "cli-key"]).await?;
    assert_eq!(
        described.field("key").as_deref(),
        Some("cli-key (tenant acme)"),
        "{described}"
    );
    assert_eq!(
        described.field("max").as_deref(),
        Some("1 (the jobs' own max)"),
        "{described}"
    );
    assert_eq!(described.field("holders").as_deref(), Some("1 of 1"), "{described}");
    assert_eq!(described.field("waiting").as_deref(), Some("1"), "{described}");
    assert!(
        described
            .stdout
            .contains("\nholders\n  JOB        ATTEMPT  STEP  GRANTED\n  running-1  1        1     "),
        "{described}"
    );
    assert!(
        described.stdout.contains(
            "\nfirst waiters\n  #  JOB        ATTEMPT  PRIORITY  JOB MAX  WAITING SINCE\n  0  waiting-1  1        10        1        "
        ),
        "{described}"
    );
    let described = sluice_ok(&stack, &["keys", "describe", "-t", "acme", "cli-key", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(described["holders"], 1);
    assert_eq!(described["waiting"], 1);
    assert_eq!(described["effective_max"], 1);
    assert_eq!(described["paused"], false);
    assert_eq!(described["holder_tickets"][0]["job_id"], "running-1");
    assert_eq!(described["first_waiters"][0]["job_id"], "waiting-1");
    assert_eq!(described["first_waiters"][0]["priority"], 10);

    // set-limit raises the max: the waiter is granted at once.
    let raised = sluice_ok(&stack, &["keys", "set-limit", "-t", "acme", "cli-key", "2"]).await?;
    assert_eq!(
        raised.stdout, "set cli-key (tenant acme): max 2 (override)\n",
        "{raised}"
    );
    wait_status(
        &admission,
        "waiting-1",
        pb::JobStatus::Admitted,
        Duration::from_secs(10),
    )
    .await?;

    // pause: a new job waits, and says why; set-limit resumes at a given max.
    let paused = sluice_ok(&stack, &["keys", "pause", "-t", "acme", "cli-key", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(paused["change"], "paused");
    assert_eq!(paused["state"]["override_max"], 0);
    assert_eq!(paused["state"]["paused"], true);
    enqueue_with_id(&admission, "waiting-2", concurrency_job("acme", "cli-key", 1, 10, "c")).await?;
    eventually(Duration::from_secs(10), "waiting-2 waits on the paused key", || async {
        let shown = sluice_ok(&stack, &["jobs", "get", "waiting-2"]).await?;
        Ok(shown.stdout.contains("the key is paused (override 0)"))
    })
    .await?;
    let resumed_at = sluice_ok(
        &stack,
        &["keys", "set-limit", "-t", "acme", "cli-key", "3", "-o", "json"],
    )
    .await?
    .json()?;
    assert_eq!(resumed_at["change"], "set");
    assert_eq!(resumed_at["state"]["override_max"], 3);
    wait_status(
        &admission,
        "waiting-2",
        pb::JobStatus::Admitted,
        Duration::from_secs(10),
    )
    .await?;
    let cleared = sluice_ok(
        &stack,
        &["keys", "set-limit", "-t", "acme", "cli-key", "--clear", "-o", "json"],
    )
    .await?
    .json()?;
    assert_eq!(cleared["change"], "cleared");
    assert_eq!(cleared["state"]["override_max"], Value::Null);

    // pause then resume (clears the override): the waiter goes at once.
    sluice_ok(&stack, &["keys", "pause", "-t", "acme", "cli-pause"]).await?;
    enqueue_with_id(
        &admission,
        "paused-job",
        concurrency_job("acme", "cli-pause", 5, 50, "d"),
    )
    .await?;
    wait_status(
        &admission,
        "paused-job",
        pb::JobStatus::Waiting,
        Duration::from_secs(10),
    )
    .await?;
    let resumed = sluice_ok(&stack, &["keys", "resume", "-t", "acme", "cli-pause"]).await?;
    assert!(
        resumed.stdout.starts_with("resumed cli-pause (tenant acme): max "),
        "{resumed}"
    );
    wait_status(
        &admission,
        "paused-job",
        pb::JobStatus::Admitted,
        Duration::from_secs(10),
    )
    .await?;

    // cancel: an admitted job ends at once; a running one is cancelling.
    let cancelled = sluice_ok(&stack, &["jobs", "cancel", "waiting-2", "--reason", "not needed"]).await?;
    assert_eq!(cancelled.stdout, "job waiting-2: cancelled\n", "{cancelled}");
    let cancelling = sluice_ok(&stack, &["jobs", "cancel", "running-1", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(
        cancelling,
        serde_json::json!({"job_id": "running-1", "status": "cancelling"})
    );
    let history = sluice_ok(&stack, &["jobs", "get", "waiting-2", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(history["status"], "cancelled");
    assert_eq!(history["history"][0]["outcome"], "cancelled");
    assert_eq!(history["history"][0]["detail"], "not needed");

    // An unknown job: NOT_FOUND from admission, exit non-zero.
    let missing = sluice_fails(&stack, &["jobs", "get", "no-such-job"]).await?;
    assert_eq!(missing.stdout, "");
    assert!(
        missing.stderr.starts_with(&format!(
            "error: admission at {} answered NOT_FOUND: job no-such-job not found",
            stack.admissions[0].endpoint
        )),
        "{missing}"
    );
    let missing = sluice_fails(&stack, &["jobs", "get", "no-such-job", "-o", "json"]).await?;
    let error: Value = serde_json::from_str(missing.stderr.trim())?;
    assert_eq!(error["error"]["code"], "NOT_FOUND");
    assert_eq!(error["error"]["service"], "admission");
    assert_eq!(error["error"]["message"], "job no-such-job not found");
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_and_floating_commands_manage_resources_and_show_refresh_state() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("clirates", LOW_CONNECTIONS)?, 1).await?;
    let admission = stack.admission_client().await?;

    let created = sluice_ok(
        &stack,
        &[
            "rate-limits",
            "put",
            "-t",
            "acme",
            "api",
            "--max-count",
            "1",
            "--window",
            "1h",
        ],
    )
    .await?;
    assert_eq!(
        created.stdout, "created rate limit api (tenant acme): 1 per 3600s\n",
        "{created}"
    );
    let updated = sluice_ok(
        &stack,
        &[
            "rate-limits",
            "put",
            "-t",
            "acme",
            "api",
            "--max-count",
            "1",
            "--window",
            "2h",
            "-o",
            "json",
        ],
    )
    .await?
    .json()?;
    assert_eq!(
        updated,
        serde_json::json!({"created": false, "rate_limit": {"tenant": "acme", "resource_key": "api",
            "max_count": 1, "window_seconds": 7200}})
    );
    sluice_ok(
        &stack,
        &[
            "rate-limits",
            "put",
            "-t",
            "acme",
            "batch",
            "--max-count",
            "10",
            "--window",
            "60s",
        ],
    )
    .await?;
    let listed = sluice_ok(&stack, &["rate-limits", "list", "-t", "acme"]).await?;
    assert_eq!(
        listed.stdout,
        "TENANT  KEY    MAX COUNT  WINDOW\nacme    api    1          7200s\nacme    batch  10         60s\n",
        "{listed}"
    );
    let listed = sluice_ok(&stack, &["rate-limits", "list", "-t", "acme", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(listed["rate_limits"].as_array().map(Vec::len), Some(2));
    assert_eq!(listed["rate_limits"][1]["resource_key"], "batch");
    assert_eq!(listed["next_page_token"], Value::Null);

    // Two jobs on the stored limit of 1 per 2h: one waits; deleting the
    // resource releases it.
    let rated = |payload: &str| pb::JobRequest {
        tenant: "acme".to_string(),
        task_group: "default".to_string(),
        payload: payload.as_bytes().to_vec(),
        limits: vec![pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::RateLimitKey("api".to_string())),
            })),
        }],
        ..Default::default()
    };
    enqueue_with_id(&admission, "rated-1", rated("1")).await?;
    wait_status(&admission, "rated-1", pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    enqueue_with_id(&admission, "rated-2", rated("2")).await?;
    eventually(Duration::from_secs(30), "rated-2 waits for its slot", || async {
        let view = sluice_ok(&stack, &["jobs", "get", "rated-2", "-o", "json"])
            .await?
            .json()?;
        Ok(view["waiting"]["retry_at_ms"].as_i64().is_some())
    })
    .await?;
    let deleted = sluice_ok(&stack, &["rate-limits", "delete", "-t", "acme", "api", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(
        deleted,
        serde_json::json!({"tenant": "acme", "resource_key": "api", "deleted": true, "released_waiters": 1})
    );
    wait_status(&admission, "rated-2", pb::JobStatus::Admitted, Duration::from_secs(10)).await?;
    let again = sluice_ok(&stack, &["rate-limits", "delete", "-t", "acme", "api"]).await?;
    assert_eq!(again.stdout, "no rate limit api (tenant acme): nothing deleted\n");

    // Floating key, default max 1, two jobs: a refresh becomes due and its
    // task stays in flight (no refresh worker here).
    for index in 0..2 {
        enqueue_with_id(
            &admission,
            &format!("floating-{index}"),
            floating_job("acme", "gpu", 1, 60_000, "f"),
        )
        .await?;
    }
    eventually(Duration::from_secs(30), "a refresh task in flight", || async {
        let shown = crate::support::run({
            let mut command = sluice(&stack);
            command.args(["floating", "describe", "-t", "acme", "gpu", "-o", "json"]);
            command
        })
        .await?;
        Ok(shown.status.success() && shown.json()?["in_flight_task_id"].is_string())
    })
    .await?;
    let floating = sluice_ok(&stack, &["floating", "describe", "-t", "acme", "gpu", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(floating["current_max"], 1);
    assert_eq!(floating["default_max"], 1);
    assert_eq!(floating["refresh_interval_ms"], 60_000);
    assert_eq!(floating["metadata"], serde_json::json!({"pool": "gpu"}));
    assert_eq!(floating["last_refresh"], Value::Null);
    assert_eq!(floating["retry_count"], 0);
    let table = sluice_ok(&stack, &["floating", "describe", "-t", "acme", "gpu"]).await?;
    assert_eq!(table.field("current max").as_deref(), Some("1"), "{table}");
    assert_eq!(
        table.field("metadata").as_deref(),
        Some("{\"pool\": \"gpu\"}"),
        "{table}"
    );
    assert_eq!(table.field("last refresh").as_deref(), Some("never"), "{table}");
    assert!(
        table.field("in flight").is_some_and(|task| task.starts_with("task ")),
        "{table}"
    );
    let key = sluice_ok(&stack, &["keys", "describe", "-t", "acme", "gpu", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(key["kind"], "floating");
    assert_eq!(key["floating_max"], 1);
    assert_eq!(key["floating"]["default_max"], 1);
    let listed = sluice_ok(&stack, &["keys", "list", "-t", "acme"]).await?;
    assert!(
        listed
            .stdout
            .contains("acme    gpu  floating  1        1        -         1"),
        "{listed}"
    );

    let deleted = sluice_ok(&stack, &["floating", "delete", "-t", "acme", "gpu", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(
        deleted,
        serde_json::json!({"tenant": "acme", "key": "gpu", "deleted": true})
    );
    let gone = sluice_fails(&stack, &["floating", "describe", "-t", "acme", "gpu"]).await?;
    assert!(
        gone.stderr.contains("refresh-dispatcher at ")
            && gone.stderr.contains("answered NOT_FOUND: no refresh has been due"),
        "{gone}"
    );
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_topics_migrate_try_and_errors() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("clihealth", LOW_CONNECTIONS)?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();

    let health = sluice_ok(&stack, &["health"]).await?;
    assert!(health.stdout.starts_with("SERVICE             ENDPOINT"), "{health}");
    assert_eq!(health.stdout.matches("SERVING").count(), 4, "{health}");
    let health = sluice_ok(&stack, &["health", "-o", "json"]).await?.json()?;
    let services: Vec<(String, String)> = health["services"]
        .as_array()
        .unwrap()
        .iter()
        .map(|check| {
            (
                check["service"].as_str().unwrap_or_default().to_string(),
                check["status"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect();
    assert_eq!(
        services,
        ["admission", "limit-grant", "rate-window", "refresh-dispatcher"]
            .iter()
            .map(|name| (name.to_string(), "SERVING".to_string()))
            .collect::<Vec<_>>()
    );
    // One service of one endpoint. What is checked is that the CLI asks the
    // named service and shows its answer; the answer itself follows the
    // instance's readiness, which may dip for a moment on a loaded machine
    // (a partition rebuilt after a rebalance), and the exit code says which.
    let mut command = sluice(&stack);
    command.args([
        "health",
        "--endpoint",
        &stack.admissions[0].endpoint,
        "--service",
        "sluice.v1.Admission",
        "-o",
        "json",
    ]);
    let one = crate::support::run(command).await?;
    let answer: Value = serde_json::from_str(&one.stdout).map_err(|error| anyhow::anyhow!("{error}: {one}"))?;
    let status = answer["services"][0]["status"].as_str().unwrap_or_default().to_string();
    assert!(["SERVING", "NOT_SERVING"].contains(&status.as_str()), "{one}");
    assert_eq!(one.status.success(), status == "SERVING", "{one}");
    let down = sluice_fails(&stack, &["health", "--endpoint", "127.0.0.1:1", "-o", "json"])
        .await?
        .json()?;
    assert_eq!(down["services"][0]["status"], "UNREACHABLE");

    let topics = sluice_ok(&stack, &["topics", "ensure"]).await?;
    assert!(topics.stdout.contains(&format!("{prefix}jobs.requested")), "{topics}");
    let topics = sluice_ok(&stack, &["topics", "ensure", "-o", "json"]).await?.json()?;
    let requested = topics["topics"]
        .as_array()
        .unwrap()
        .iter()
        .find(|topic| topic["name"] == format!("{prefix}jobs.requested"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(requested["partitions"], stack.config.kafka.partitions.requested);

    let migrated = sluice_ok(&stack, &["migrate", "-o", "json"]).await?.json()?;
    let schema_prefix = &stack.config.postgres.schema_prefix;
    assert_eq!(
        migrated["schemas"],
        serde_json::json!([
            format!("{schema_prefix}admission"),
            format!("{schema_prefix}limit_grant"),
            format!("{schema_prefix}rate_window"),
            format!("{schema_prefix}refresh_dispatcher")
        ])
    );
    // A command's stdout is its answer: its logs (every one, at debug) go
    // to stderr, so a slow-statement warning never corrupts the JSON.
    for args in [&["migrate", "-o", "json"][..], &["topics", "ensure", "-o", "json"][..]] {
        let mut command = sluice(&stack);
        command.args(args).env("RUST_LOG", "debug");
        let ran = crate::support::run(command).await?;
        assert!(ran.status.success(), "sluice {}: {ran}", args.join(" "));
        ran.json()?;
        assert!(
            ran.stderr.contains("DEBUG"),
            "sluice {} logged nothing at debug: {ran}",
            args.join(" ")
        );
    }

    let tried = sluice_ok(
        &stack,
        &[
            "try", "--jobs", "6", "--limit", "2", "--hold", "400ms", "--key", "try-key", "--tenant", "cli",
        ],
    )
    .await?;
    assert!(tried.stdout.contains("enqueued 6 jobs on key \"try-key\""), "{tried}");
    assert!(tried.stdout.contains("all 6 jobs done"), "{tried}");
    // Two at once is the rule; on a loaded machine the second grant can
    // arrive after the first job is done, so 1 is possible, never above 2.
    let at_most: usize = tried
        .stdout
        .split("; at most ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|number| number.parse().ok())
        .unwrap_or(usize::MAX);
    assert!((1..=2).contains(&at_most), "{tried}");
    assert!(tried.stdout.contains("ran at once (limit 2)"), "{tried}");

    // Errors: the service, the endpoint, the gRPC code and message.
    let invalid = sluice_fails(&stack, &["keys", "describe", "--tenant", "", "k"]).await?;
    assert!(
        invalid.stderr.contains("limit-grant at ")
            && invalid
                .stderr
                .contains("answered INVALID_ARGUMENT: key.tenant: must not be empty"),
        "{invalid}"
    );
    let unreachable = sluice_fails(&stack, &["--admission", "127.0.0.1:1", "jobs", "get", "x"]).await?;
    assert!(
        unreachable
            .stderr
            .starts_with("error: admission at http://127.0.0.1:1 answered UNAVAILABLE:"),
        "{unreachable}"
    );
    assert!(
        unreachable.stderr.contains("hint: is the stack running"),
        "{unreachable}"
    );
    let unreachable = sluice_fails(
        &stack,
        &["--admission", "127.0.0.1:1", "-o", "json", "jobs", "cancel", "x"],
    )
    .await?;
    let error: Value = serde_json::from_str(unreachable.stderr.trim())?;
    assert_eq!(error["error"]["code"], "UNAVAILABLE");
    assert_eq!(error["error"]["endpoint"], "http://127.0.0.1:1");
    let usage = sluice_fails(&stack, &["keys", "set-limit", "-t", "acme", "k"]).await?;
    assert_eq!(usage.status.code(), Some(2), "a usage error: {usage}");
    stack.stop().await;
    Ok(())
}

/// A plain HTTP/1.1 GET; the whole answer, head and body.
async fn http_get(address: &str, path: &str) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").as_bytes())
        .await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await??;
    Ok(String::from_utf8_lossy(&answer).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_runs_all_four_services_and_the_console_until_sigterm() -> anyhow::Result<()> {
    use tokio::io::{AsyncBufReadExt, BufReader};

    init_logging();
    let config = test_config("clidev", LOW_CONNECTIONS)?;
    let pool = admin_pool(&config).await?;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("dev")
        .env("SLUICE__KAFKA__TOPIC_PREFIX", &config.kafka.topic_prefix)
        .env("SLUICE__POSTGRES__SCHEMA_PREFIX", &config.postgres.schema_prefix)
        .env("SLUICE__KAFKA__FETCH_WAIT_MAX_MS", "25")
        .env("SLUICE__POSTGRES__MAX_CONNECTIONS", "4")
        // Configured on all interfaces: dev has no authentication, so it
        // binds them to loopback.
        .env("SLUICE__ADMISSION__LISTEN", "0.0.0.0:0")
        .env("SLUICE__LIMIT_GRANT__LISTEN", "127.0.0.1:0")
        .env("SLUICE__RATE_WINDOW__LISTEN", "127.0.0.1:0")
        .env("SLUICE__REFRESH_DISPATCHER__LISTEN", "0.0.0.0:0")
        .env("SLUICE__CONSOLE__LISTEN", "0.0.0.0:0")
        .env("SLUICE__TELEMETRY__METRICS_LISTEN", "0.0.0.0:0")
        .env("SLUICE__KAFKA__PARTITIONS__LIMIT_COMMANDS", "2")
        .env("SLUICE__KAFKA__PARTITIONS__RATE_COMMANDS", "2")
        .env("SLUICE__KAFKA__PARTITIONS__JOBS", "2")
        // Info: its log lines (text) come out before the endpoints it prints.
        .env("RUST_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut endpoints = std::collections::HashMap::new();
    let mut console = None;
    let mut metrics = None;
    let mut auth_off_said = false;
    let mut log_lines = 0;
    while endpoints.len() < 4 || console.is_none() || metrics.is_none() {
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await??
            .unwrap_or_default();
        auth_off_said |= line.contains("authentication is off");
        log_lines += usize::from(line.contains("INFO"));
        assert!(
            !line.contains('\u{1b}'),
            "logs written to a pipe carry no colour codes: {line:?}"
        );
        let words: Vec<&str> = line.split_whitespace().collect();
        if let ["metrics", address] = words[..] {
            metrics = Some(address.to_string());
        }
        if let [name, address] = words[..] {
            if let Some(address) = address.strip_prefix("grpc://") {
                endpoints.insert(name.to_string(), format!("http://{address}"));
            }
            if name == "console" {
                console = address
                    .strip_prefix("http://")
                    .map(|address| address.trim_end_matches('/').to_string());
            }
        }
    }
    assert!(auth_off_said, "sluice dev says authentication is off");
    assert!(log_lines > 0, "text log lines came out on stdout");
    for address in endpoints.values().chain(&console).chain(&metrics) {
        assert!(
            address.contains("//127.0.0.1:") || address.starts_with("127.0.0.1:"),
            "every listener on loopback, {address} is not: {endpoints:?} {console:?} {metrics:?}"
        );
    }
    // The console answers at the address printed.
    let console = console.unwrap_or_default();
    let overview = http_get(&console, "/").await?;
    assert!(
        overview.starts_with("HTTP/1.1 200") && overview.contains("<h1>Tenants</h1>"),
        "{overview}"
    );
    let mut health = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
    health
        .arg("health")
        .env("SLUICE_ADMISSION_ENDPOINT", &endpoints["admission"])
        .env("SLUICE_LIMIT_GRANT_ENDPOINT", &endpoints["limit-grant"])
        .env("SLUICE_RATE_WINDOW_ENDPOINT", &endpoints["rate-window"])
        .env("SLUICE_REFRESH_DISPATCHER_ENDPOINT", &endpoints["refresh-dispatcher"]);
    let health = std::sync::Arc::new(std::sync::Mutex::new(health));
    eventually(Duration::from_secs(60), "sluice dev serving", || {
        let health = health.clone();
        async move {
            let ran = tokio::task::spawn_blocking(move || health.lock().unwrap().output()).await??;
            Ok(ran.status.success())
        }
    })
    .await?;
    let pid = child.id().unwrap_or_default().to_string();
    let killed = tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await?;
    assert!(killed.success());
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait()).await??;
    assert!(status.success(), "sluice dev exited with {status} after SIGTERM");
    cleanup(&config, &pool).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_producers_and_workers_and_reports_each_key_within_its_limit() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("clidemo", LOW_CONNECTIONS)?, 1).await?;
    let common = [
        "demo",
        "--keys",
        "2",
        "--limit",
        "2",
        "--jobs",
        "16",
        "--rate",
        "100",
        "--min-work",
        "200ms",
        "--max-work",
        "300ms",
        "--timeout",
        "60s",
    ];

    let mut plain_args = common.to_vec();
    plain_args.push("--plain");
    let plain = sluice_ok(&stack, &plain_args).await?;
    let first_line = plain.stdout.lines().next().unwrap_or_default();
    assert!(
        first_line.starts_with("demo ")
            && first_line.ends_with(": 16 jobs on 2 keys (max 2 each), 100/s from 2 producers, 2 workers x 8"),
        "{plain}"
    );
    for key in ["demo-1", "demo-2"] {
        assert!(
            plain
                .stdout
                .lines()
                .any(|line| line.contains(&format!("s  {key}   holders ")) && line.contains("/2  waiting ")),
            "a status line for {key}: {plain}"
        );
    }
    assert!(plain.stdout.contains(": 16 of 16 jobs done in "), "{plain}");
    assert!(
        plain
            .stdout
            .contains("KEY     MAX  PRODUCED  DONE  PEAK RUNNING  PEAK HOLDERS"),
        "{plain}"
    );
    assert!(
        plain.stdout.contains("no key ever had more holders than its max"),
        "{plain}"
    );

    // JSON requests this time, and the summary as JSON.
    let mut json_args = common.to_vec();
    json_args.extend(["--json", "-o", "json"]);
    let summary = sluice_ok(&stack, &json_args).await?.json()?;
    assert_eq!(summary["produced"], 16, "{summary}");
    assert_eq!(summary["done"], 16, "{summary}");
    assert_eq!(summary["overruns"], serde_json::json!([]), "{summary}");
    let keys = summary["keys"].as_array().unwrap();
    assert_eq!(keys.len(), 2, "{summary}");
    for key in keys {
        assert_eq!(key["max"], 2, "{summary}");
        assert_eq!(key["produced"], 8, "{summary}");
        assert_eq!(key["done"], 8, "{summary}");
        // 8 jobs of 200-300 ms produced within 0.1 s: the key is full.
        assert_eq!(key["peak_running"], 2, "{summary}");
        assert!(key["peak_holders"].as_u64().unwrap_or(99) <= 2, "{summary}");
    }
    stack.stop().await;
    Ok(())
}

/// `sluice` reaches a TLS server when it trusts the server's CA
/// (`--tls-ca-file`), and not without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_over_tls_needs_the_ca_file() -> anyhow::Result<()> {
    use sluice_e2e::pki::{folder, health_over_tls_server, new_pki, server_tls, write_pki};

    init_logging();
    let folder = folder("cli")?;
    let pki = new_pki("cli")?;
    let (cert, key, ca) = write_pki(&folder, &pki)?;
    let stop = sluice_common::Shutdown::new();
    let endpoint = health_over_tls_server(&server_tls(&cert, &key, "", Duration::from_secs(10)), &stop).await?;
    let health = |ca_file: Option<&str>| {
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"));
        command.args(["health", "--endpoint", &endpoint]);
        if let Some(ca_file) = ca_file {
            command.args(["--tls-ca-file", ca_file]);
        }
        command.env_remove("SLUICE_TLS_CA_FILE");
        command.output()
    };
    let trusted = tokio::task::block_in_place(|| health(Some(&ca)))?;
    assert!(
        trusted.status.success(),
        "{}{}",
        String::from_utf8_lossy(&trusted.stdout),
        String::from_utf8_lossy(&trusted.stderr)
    );
    let untrusted = tokio::task::block_in_place(|| health(None))?;
    assert!(!untrusted.status.success(), "answered without trusting the CA");
    stop.trigger();
    std::fs::remove_dir_all(folder)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_quotas_are_managed_with_a_token_and_hold_at_once() -> anyhow::Result<()> {
    let folder = sluice_e2e::pki::folder("clitenants")?;
    let issuer = sluice_e2e::tokens::TokenIssuer::new()?;
    let auth = sluice_e2e::tokens::auth_settings(&folder, &issuer)?;
    let mut settings: Vec<(&str, &str)> = LOW_CONNECTIONS.to_vec();
    settings.extend(auth.iter().map(|(key, value)| (*key, value.as_str())));
    settings.push(("kafka.partitions.jobs", "1"));
    let stack = Stack::start(test_config("clitenants", &settings)?, 1).await?;
    let token_file = |name: &str, token: String| -> anyhow::Result<String> {
        let path = folder.join(name);
        std::fs::write(&path, token)?;
        Ok(path.to_string_lossy().into_owned())
    };
    let admin = token_file("admin.jwt", issuer.token("platform", &[], &["admin"])?)?;
    let operator = token_file("operator.jwt", issuer.token("ops-acme", &["acme"], &["operator"])?)?;

    // Without a token the services refuse the command, and it says why.
    let refused = sluice_fails(&stack, &["tenants", "list"]).await?;
    assert!(refused.stderr.contains("UNAUTHENTICATED"), "{refused}");
    // A tenant's operator may not set quotas.
    let denied = sluice_fails(
        &stack,
        &[
            "--token-file",
            &operator,
            "tenants",
            "quota",
            "set",
            "-t",
            "acme",
            "--max-waiting",
            "1",
        ],
    )
    .await?;
    assert!(denied.stderr.contains("PERMISSION_DENIED"), "{denied}");
    let set = sluice_ok(
        &stack,
        &[
            "--token-file",
            &admin,
            "tenants",
            "quota",
            "set",
            "-t",
            "acme",
            "--max-waiting",
            "1",
        ],
    )
    .await?;
    assert_eq!(
        set.stdout, "tenant acme: max_waiting 1, max_enqueues_per_second unlimited\n",
        "{set}"
    );
    let listed = sluice_ok(&stack, &["--token-file", &admin, "tenants", "list"]).await?;
    assert_eq!(
        listed.stdout,
        "TENANT     MAX WAITING  MAX ENQUEUES/S  OVERRIDE\n(default)  unlimited    unlimited       -\nacme       1            unlimited       yes\n",
        "{listed}"
    );
    // The operator reads its own tenant's quota.
    let own = sluice_ok(
        &stack,
        &["--token-file", &operator, "tenants", "list", "-t", "acme", "-o", "json"],
    )
    .await?
    .json()?;
    assert_eq!(own["quotas"][0]["max_waiting"], 1);

    // The quota holds at once.
    let producer = issuer.token("producer-acme", &["acme"], &["producer"])?;
    let mut admission = stack.admission_client().await?;
    let enqueue = |payload: &str| {
        sluice_e2e::tokens::with_token(
            pb::EnqueueRequest {
                job: Some(concurrency_job("acme", "k", 1, 0, payload)),
            },
            &producer,
        )
    };
    admission.enqueue(enqueue("first")).await?;
    let over = admission.enqueue(enqueue("second")).await.expect_err("over the quota");
    assert_eq!(over.code(), tonic::Code::ResourceExhausted, "{over:?}");
    sluice_ok(
        &stack,
        &["--token-file", &admin, "tenants", "quota", "clear", "-t", "acme"],
    )
    .await?;
    admission.enqueue(enqueue("second")).await?;
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_port_in_use_stops_the_process_naming_the_setting_and_the_address() -> anyhow::Result<()> {
    let config = test_config("climetrics", LOW_CONNECTIONS)?;
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let address = taken.local_addr()?.to_string();
    let ran = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
            .arg("dev")
            .env("SLUICE__KAFKA__TOPIC_PREFIX", &config.kafka.topic_prefix)
            .env("SLUICE__POSTGRES__SCHEMA_PREFIX", &config.postgres.schema_prefix)
            .env("SLUICE__POSTGRES__MAX_CONNECTIONS", "4")
            .env("SLUICE__ADMISSION__LISTEN", "127.0.0.1:0")
            .env("SLUICE__LIMIT_GRANT__LISTEN", "127.0.0.1:0")
            .env("SLUICE__RATE_WINDOW__LISTEN", "127.0.0.1:0")
            .env("SLUICE__REFRESH_DISPATCHER__LISTEN", "127.0.0.1:0")
            .env("SLUICE__CONSOLE__LISTEN", "127.0.0.1:0")
            .env("SLUICE__TELEMETRY__METRICS_LISTEN", &address)
            .env("RUST_LOG", "warn")
            .kill_on_drop(true)
            .output(),
    )
    .await??;
    let stderr = String::from_utf8_lossy(&ran.stderr);
    assert!(!ran.status.success(), "started on a taken metrics port: {stderr}");
    assert!(
        stderr.contains("telemetry.metrics_listen") && stderr.contains(&address),
        "the error names the setting and the address: {stderr}"
    );
    drop(taken);
    Ok(())
}
