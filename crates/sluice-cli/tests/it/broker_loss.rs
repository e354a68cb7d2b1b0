//! `sluice dev` as a process on a broker of its own that loses its log (a
//! memory-storage tansu killed and started again empty) or goes away for
//! good.
//!
//! - After the broker comes back empty, jobs sent afterwards are admitted:
//!   topics are created again, and owners whose saved applied offsets lie far
//!   beyond the new log adopt it instead of skipping every new message. When
//!   the process does not survive the loss (librdkafka 2.12 can crash on
//!   tansu's answers about vanished topics), it is restarted the way
//!   Kubernetes would, and the restarted one must recover the same way.
//! - With the broker gone, SIGTERM still ends the process within
//!   `process.drain_timeout`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sluice_e2e::*;
use sluice_proto::v1 as pb;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::LOW_CONNECTIONS;

struct Dev {
    child: tokio::process::Child,
    endpoints: HashMap<String, String>,
    /// Its log lines (stderr).
    log: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

/// Start `sluice dev` on `broker` with the test's prefixes; wait for its
/// endpoints. Its log (on stdout, as JSON) is kept.
async fn start_dev(config: &sluice_common::SluiceConfig, broker: &str, drain_timeout: &str) -> anyhow::Result<Dev> {
    // One message per produce batch: tansu cannot resume a consumer inside a
    // batch (a restarted process resumes where the crashed one committed).
    let file = std::env::temp_dir().join(format!("{}dev.toml", config.kafka.topic_prefix));
    std::fs::write(&file, "[kafka.producer_properties]\n\"batch.num.messages\" = \"1\"\n")?;
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("--config")
        .arg(&file)
        .arg("dev")
        .env("SLUICE__KAFKA__BROKERS", broker)
        .env("SLUICE__KAFKA__TOPIC_PREFIX", &config.kafka.topic_prefix)
        .env("SLUICE__KAFKA__TOPIC_CHECK_INTERVAL", "1s")
        .env("SLUICE__KAFKA__SESSION_TIMEOUT_MS", "6000")
        .env("SLUICE__POSTGRES__SCHEMA_PREFIX", &config.postgres.schema_prefix)
        .env("SLUICE__KAFKA__FETCH_WAIT_MAX_MS", "25")
        .env("SLUICE__POSTGRES__MAX_CONNECTIONS", "4")
        .env("SLUICE__ADMISSION__LISTEN", "127.0.0.1:0")
        // Re-sends must not hide a skipped message: only adoption helps here.
        .env("SLUICE__ADMISSION__RESEND_WAITING_AFTER", "10m")
        .env("SLUICE__ADMISSION__STAND_BEHIND_INTERVAL", "10s")
        .env("SLUICE__LIMIT_GRANT__TICKET_GRACE", "10m")
        .env("SLUICE__LIMIT_GRANT__LISTEN", "127.0.0.1:0")
        .env("SLUICE__RATE_WINDOW__LISTEN", "127.0.0.1:0")
        .env("SLUICE__REFRESH_DISPATCHER__LISTEN", "127.0.0.1:0")
        .env("SLUICE__CONSOLE__LISTEN", "127.0.0.1:0")
        .env("SLUICE__TELEMETRY__METRICS_LISTEN", "")
        .env("SLUICE__KAFKA__PARTITIONS__LIMIT_COMMANDS", "2")
        .env("SLUICE__KAFKA__PARTITIONS__RATE_COMMANDS", "2")
        .env("SLUICE__KAFKA__PARTITIONS__JOBS", "2")
        .env("SLUICE__PROCESS__DRAIN_TIMEOUT", drain_timeout)
        .env("RUST_LOG", "info,librdkafka=warn,rdkafka=warn,sqlx=warn")
        .env("SLUICE__TELEMETRY__LOG_FORMAT", "json")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    // Read its output to the end, whatever bytes it holds (a line that is
    // not UTF-8 must not stop the reading: the process would block on a full
    // pipe), keeping the lines.
    let log = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let mut output = BufReader::new(child.stdout.take().expect("piped stdout"));
    let lines_read = log.clone();
    tokio::spawn(async move {
        let mut line = Vec::new();
        loop {
            line.clear();
            match output.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => lines_read
                    .lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&line).trim_end().to_string()),
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut endpoints = HashMap::new();
    while endpoints.len() < 4 {
        anyhow::ensure!(Instant::now() < deadline, "sluice dev printed no endpoints");
        for line in log.lock().unwrap().iter() {
            let words: Vec<&str> = line.split_whitespace().collect();
            if let [name, address] = words[..] {
                if let Some(address) = address.strip_prefix("grpc://") {
                    endpoints.insert(name.to_string(), format!("http://{address}"));
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Dev { child, endpoints, log })
}

async fn serving(dev: &Dev) -> bool {
    for endpoint in dev.endpoints.values() {
        if !health_serving(endpoint).await.unwrap_or(false) {
            return false;
        }
    }
    true
}

async fn admitted(dev: &Dev, job_ids: &[String]) -> anyhow::Result<bool> {
    let admission = pb::admission_client::AdmissionClient::new(connect(&dev.endpoints["admission"]).await?);
    for job_id in job_ids {
        if job_view(&admission, job_id).await?.status < pb::JobStatus::Admitted as i32 {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Each job's status and reason, as GetJob shows them (failure reports).
async fn job_statuses(dev: &Dev, job_ids: &[String]) -> Vec<(String, String)> {
    let Ok(channel) = connect(&dev.endpoints["admission"]).await else {
        return Vec::new();
    };
    let admission = pb::admission_client::AdmissionClient::new(channel);
    let mut statuses = Vec::new();
    for job_id in job_ids {
        let status = match job_view(&admission, job_id).await {
            Ok(view) => format!(
                "{:?} step {} attempt {}: {}",
                pb::JobStatus::try_from(view.status).unwrap_or_default(),
                view.step,
                view.attempt,
                view.reason
            ),
            Err(error) => format!("unknown: {error}"),
        };
        statuses.push((job_id.clone(), status));
    }
    statuses
}

async fn enqueue_all(dev: &Dev, job_ids: &[String], key: &str) -> anyhow::Result<()> {
    let admission = pb::admission_client::AdmissionClient::new(connect(&dev.endpoints["admission"]).await?);
    for job_id in job_ids {
        enqueue_with_id(&admission, job_id, concurrency_job("acme", key, 100, 0, "x")).await?;
    }
    Ok(())
}

/// Jobs on one floating key of max 1 that nobody runs: each one enqueued
/// while others wait makes limit-grant send a refresh-due event (interval
/// 1 ms) over Kafka to the refresh-dispatcher, whose saved applied offset
/// then lies past 0. (Acquires and grants travel on links, not Kafka.)
async fn enqueue_floating(dev: &Dev, job_ids: &[String]) -> anyhow::Result<()> {
    let admission = pb::admission_client::AdmissionClient::new(connect(&dev.endpoints["admission"]).await?);
    for job_id in job_ids {
        enqueue_with_id(&admission, job_id, floating_job("acme", "reset-gpu", 1, 1, "x")).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_sent_after_the_broker_lost_its_log_are_admitted() -> anyhow::Result<()> {
    init_logging();
    let mut broker = PrivateBroker::start().await?;
    let config = test_config("clireset", LOW_CONNECTIONS)?;
    let pool = admin_pool(&config).await?;
    let mut dev = start_dev(&config, &broker.address, "30s").await?;
    eventually(Duration::from_secs(60), "sluice dev serving", || async {
        Ok(serving(&dev).await)
    })
    .await?;
    // Enough traffic that every owner saves applied offsets well past 0.
    let before: Vec<String> = (0..60).map(|index| format!("before-{index}")).collect();
    enqueue_all(&dev, &before, "reset-key").await?;
    eventually(Duration::from_secs(60), "the jobs before the loss admitted", || {
        admitted(&dev, &before)
    })
    .await?;
    let floating_before: Vec<String> = (0..20).map(|index| format!("floating-before-{index}")).collect();
    enqueue_floating(&dev, &floating_before).await?;
    eventually(Duration::from_secs(60), "the floating key's first job admitted", || {
        admitted(&dev, &floating_before[..1])
    })
    .await?;

    broker.restart_empty().await?;

    let after: Vec<String> = (0..10).map(|index| format!("after-{index}")).collect();
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut restarts = 0;
    let mut sent = false;
    loop {
        if Instant::now() >= deadline {
            let log = dev.log.lock().unwrap().join("\n");
            let statuses = job_statuses(&dev, &after).await;
            anyhow::bail!(
                "the jobs after the loss were not admitted (restarts: {restarts}; statuses {statuses:?}); the log:\n{log}"
            );
        }
        if let Some(status) = dev.child.try_wait()? {
            // What Kubernetes does with a process that died.
            restarts += 1;
            tracing::warn!(%status, restarts, "sluice dev exited after the broker lost its log; starting it again");
            dev = start_dev(&config, &broker.address, "30s").await?;
            // Enqueue again: a job saved before the crash answers as a
            // duplicate and re-sends its pending acquire (re-sends on a timer
            // are off in this test, so that only adoption can help).
            sent = false;
            continue;
        }
        if !sent {
            // More refresh-due events, now on the new log at offsets the
            // dispatcher had already applied on the old one.
            let floating_after: Vec<String> = (0..3).map(|index| format!("floating-after-{index}")).collect();
            sent = enqueue_all(&dev, &after, "reset-key").await.is_ok()
                && enqueue_floating(&dev, &floating_after).await.is_ok();
        } else if admitted(&dev, &after).await.unwrap_or(false) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    eventually(Duration::from_secs(60), "sluice dev serving again", || async {
        Ok(serving(&dev).await)
    })
    .await
    .map_err(|error| anyhow::anyhow!("{error}; the log:\n{}", dev.log.lock().unwrap().join("\n")))?;
    eventually(
        Duration::from_secs(60),
        "an owner says it adopted the new log",
        || async {
            Ok(dev
                .log
                .lock()
                .unwrap()
                .iter()
                .any(|line| line.contains("adopting the new log")))
        },
    )
    .await
    .map_err(|error| anyhow::anyhow!("{error}; the log:\n{}", dev.log.lock().unwrap().join("\n")))?;
    let pid = dev.child.id().unwrap_or_default().to_string();
    tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await?;
    tokio::time::timeout(Duration::from_secs(60), dev.child.wait()).await??;
    cleanup(&config, &pool).await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_sluice_dev_within_the_drain_timeout_when_the_broker_is_gone() -> anyhow::Result<()> {
    init_logging();
    let broker = PrivateBroker::start().await?;
    let config = test_config("clidrain", LOW_CONNECTIONS)?;
    let pool = admin_pool(&config).await?;
    let mut dev = start_dev(&config, &broker.address, "5s").await?;
    eventually(Duration::from_secs(60), "sluice dev serving", || async {
        Ok(serving(&dev).await)
    })
    .await?;
    enqueue_all(&dev, &["in-flight".to_string()], "drain-key").await?;
    drop(broker);
    let pid = dev.child.id().unwrap_or_default().to_string();
    let asked = Instant::now();
    tokio::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .await?;
    let waited = tokio::time::timeout(Duration::from_secs(20), dev.child.wait()).await;
    let took = asked.elapsed();
    let status = waited.map_err(|_| anyhow::anyhow!("sluice dev still running {took:?} after SIGTERM"))??;
    // Drained in time, or cut off by the drain timeout (status 1): bounded either way.
    assert!(status.success() || status.code() == Some(1), "{status}");
    assert!(took <= Duration::from_secs(15), "stopped after {took:?}");
    cleanup(&config, &pool).await;
    Ok(())
}
