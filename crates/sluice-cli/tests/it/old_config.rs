//! An upgrade keeps a working configuration: `sluice dev` started with the
//! configuration file of Sluice 0.1.0 (`tests/fixtures/sluice-0.1.0.toml`,
//! which sets the grants topic 0.2.0 removed) serves and admits a job, and
//! its log names each removed setting in a warning.

use std::time::Duration;

use sluice_e2e::*;
use sluice_proto::v1 as pb;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::{repo_root, LOW_CONNECTIONS};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configuration_file_of_0_1_0_starts_and_its_removed_settings_are_named() -> anyhow::Result<()> {
    init_logging();
    let config = test_config("oldconfig", LOW_CONNECTIONS)?;
    let pool = admin_pool(&config).await?;
    let fixture = repo_root().join("crates/sluice-cli/tests/fixtures/sluice-0.1.0.toml");
    // The file as it is; the environment only says where this test's broker,
    // topics and schemas are, and binds every listener to a free port.
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .arg("--config")
        .arg(&fixture)
        .arg("dev")
        .env("SLUICE__KAFKA__BROKERS", &config.kafka.brokers)
        .env("SLUICE__KAFKA__TOPIC_PREFIX", &config.kafka.topic_prefix)
        .env("SLUICE__POSTGRES__SCHEMA_PREFIX", &config.postgres.schema_prefix)
        .env("SLUICE__POSTGRES__MAX_CONNECTIONS", "4")
        .env("SLUICE__ADMISSION__LISTEN", "127.0.0.1:0")
        .env("SLUICE__LIMIT_GRANT__LISTEN", "127.0.0.1:0")
        .env("SLUICE__RATE_WINDOW__LISTEN", "127.0.0.1:0")
        .env("SLUICE__REFRESH_DISPATCHER__LISTEN", "127.0.0.1:0")
        .env("SLUICE__CONSOLE__LISTEN", "127.0.0.1:0")
        .env("SLUICE__TELEMETRY__METRICS_LISTEN", "")
        .env("RUST_LOG", "warn")
        .env("NO_COLOR", "1")
        .env_remove("SLUICE_CONFIG")
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    // Its warnings, then the endpoints it prints once every partition is owned.
    let mut lines = BufReader::new(child.stdout.take().expect("piped stdout")).lines();
    let mut warnings = Vec::new();
    let mut endpoints = std::collections::HashMap::new();
    loop {
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await??
            .ok_or_else(|| anyhow::anyhow!("sluice dev ended before printing its endpoints: {warnings:#?}"))?;
        if line.contains(" WARN ") {
            warnings.push(line.clone());
        }
        let words: Vec<&str> = line.split_whitespace().collect();
        if let [name, address] = words[..] {
            if let Some(address) = address.strip_prefix("grpc://") {
                endpoints.insert(name.to_string(), format!("http://{address}"));
            }
        }
        if line == "press ctrl-c to stop" {
            break;
        }
    }
    // The rest of its output is read (and dropped) so it never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    for setting in ["kafka.partitions.grants", "topics.grants"] {
        let warning = warnings
            .iter()
            .find(|line| line.contains(&format!("ignoring {setting}, a setting removed in 0.2.0")))
            .ok_or_else(|| anyhow::anyhow!("no warning names {setting}: {warnings:#?}"))?;
        assert!(
            warning.contains("sluice-0.1.0.toml") && warning.contains("link streams"),
            "the warning says where it was set and what replaced it: {warning}"
        );
        eprintln!("{warning}");
    }

    // The banner comes once every partition is owned; a service's health
    // also follows its links and consumers, which may still be settling.
    for endpoint in endpoints.values() {
        wait_serving(endpoint, Duration::from_secs(30)).await?;
    }
    let admission = pb::admission_client::AdmissionClient::new(connect(&endpoints["admission"]).await?);
    enqueue_with_id(
        &admission,
        "old-config-job",
        concurrency_job("acme", "old-config", 1, 0, "x"),
    )
    .await?;
    eventually(Duration::from_secs(60), "the job admitted", || {
        let admission = admission.clone();
        async move { Ok(job_view(&admission, "old-config-job").await?.status >= pb::JobStatus::Admitted as i32) }
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
