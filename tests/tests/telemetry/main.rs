//! Telemetry: the Prometheus scrape endpoint serves per-key series for a key
//! a test used, and with no OTLP endpoint configured no exporter starts.
//! Its own test binary: telemetry is initialised once per process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use sluice_common::telemetry;
use sluice_common::Shutdown;
use sluice_e2e::*;
use sluice_proto::v1 as pb;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn scrape(address: std::net::SocketAddr) -> anyhow::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(address).await?;
    stream
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    anyhow::ensure!(response.starts_with("HTTP/1.1 200"), "scrape failed: {response:.200}");
    Ok(response)
}

fn series<'a>(text: &'a str, name: &str, must_contain: &[&str]) -> Vec<&'a str> {
    text.lines()
        .filter(|line| line.starts_with(name) && must_contain.iter().all(|part| line.contains(part)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_scrape_endpoint_has_per_key_utilisation_and_wait_times() -> anyhow::Result<()> {
    std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
    let config = test_config(
        "metrics",
        &[
            ("telemetry.metrics_listen", "127.0.0.1:0"),
            ("telemetry.key_metrics_top_n", "0"),
            ("telemetry.key_metrics_patterns", "acme/metric-*, acme/inline:metric-*"),
        ],
    )?;
    let guard = telemetry::init(&config.telemetry, "sluice-test")?;
    let shutdown = Shutdown::new();
    let address = telemetry::spawn_metrics_endpoint(&config.telemetry, &guard, shutdown.clone())
        .await?
        .expect("an address");
    let stack = Stack::start(config, 1).await?;
    let stop = Shutdown::new();
    let recorder = Arc::new(Recorder::default());
    tokio::spawn(run_worker(
        stack.config.clone(),
        stack.admissions[0].endpoint.clone(),
        WorkerOptions {
            worker_id: "w".to_string(),
            task_group: "default".to_string(),
            group: format!("{}workers", stack.config.kafka.topic_prefix),
            concurrency: 4,
            min_run: Duration::from_millis(50),
            max_run: Duration::from_millis(100),
        },
        recorder.clone(),
        stop.clone(),
    ));
    // Jobs that take a rate limit, then wait on a concurrency key. The 20
    // arrive together at a rate of 10 per 5 s, so the rate defers 10 of them
    // however slowly the machine runs (behind the key, at 5 per second, they
    // arrived too slowly to be deferred on a loaded machine).
    let requests: Vec<pb::JobRequest> = (0..20)
        .map(|index| {
            let mut request = rate_job("acme", "metric-rate", 10, 5000, &format!("m/{index}"));
            request
                .limits
                .extend(concurrency_job("acme", "metric-key", 2, 0, "").limits);
            request
        })
        .collect();
    let producer = RequestProducer::new(&stack.config)?;
    producer.send(&requests).await?;
    // One malformed request: dead-lettered and counted by reason. Then 100
    // JSON requests, each with an unknown field of its own name: the metric's
    // reason label stays in its fixed set (the field is in the dead letter's
    // header, not in a label).
    let mut malformed = vec![RawRequest {
        partition: None,
        key: None,
        payload: b"not a job".to_vec(),
        headers: Vec::new(),
    }];
    for index in 0..100 {
        malformed.push(RawRequest {
            partition: None,
            key: None,
            payload: format!(r#"{{"tenant": "acme", "task_group": "default", "junk_{index}_é": 1}}"#).into_bytes(),
            headers: vec![("content-type".to_string(), b"application/json".to_vec())],
        });
    }
    producer.send_messages(malformed).await?;
    // Scrape while the key is busy: per-key gauges come from live owners.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let busy_scrape = loop {
        let text = scrape(address).await?;
        if !series(&text, "sluice_key_utilization", &["key=\"metric-key\""]).is_empty() {
            break text;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no per-key utilisation of the used key:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    eventually(Duration::from_secs(60), "20 completions", || async {
        Ok(recorder.completed() == 20)
    })
    .await?;
    let text = scrape(address).await?;

    let utilisation = series(
        &busy_scrape,
        "sluice_key_utilization",
        &["tenant=\"acme\"", "key=\"metric-key\""],
    );
    assert!(!utilisation.is_empty(), "no utilisation series:\n{busy_scrape}");
    assert!(
        series(&busy_scrape, "sluice_key_waiting", &["key=\"metric-key\""]).len() == 1,
        "queue depth series for the key"
    );
    let key_waits = series(
        &text,
        "sluice_key_wait_time_seconds_count",
        &["key=\"metric-key\"", "kind=\"concurrency\""],
    );
    assert_eq!(key_waits.len(), 1, "per-key wait-time histogram:\n{text}");
    let count: f64 = key_waits[0].rsplit(' ').next().unwrap().parse()?;
    assert!(
        (count - 20.0).abs() < 0.5,
        "one wait recorded per grant: {}",
        key_waits[0]
    );
    assert!(
        !series(
            &text,
            "sluice_key_wait_time_seconds_count",
            &["key=\"inline:metric-rate:\"", "kind=\"rate\""]
        )
        .is_empty(),
        "rate waits per key"
    );
    assert!(!series(&text, "sluice_wait_time_seconds_bucket", &["kind=\"concurrency\""]).is_empty());
    assert!(
        !series(
            &text,
            "sluice_rate_deferrals",
            &["key=\"inline:metric-rate:\"", "tenant=\"acme\""]
        )
        .is_empty(),
        "rate deferrals counted per selected key:\n{text}"
    );
    eventually(Duration::from_secs(30), "the dead letter counted", || async {
        Ok(!series(
            &scrape(address).await?,
            "sluice_dead_letters_total",
            &["reason=\"undecodable\""],
        )
        .is_empty())
    })
    .await?;
    eventually(Duration::from_secs(30), "the 100 junk requests counted", || async {
        let text = scrape(address).await?;
        Ok(series(&text, "sluice_dead_letters_total", &["reason=\"invalid\""])
            .iter()
            .any(|line| line.ends_with(" 100")))
    })
    .await?;
    let text = scrape(address).await?;
    let reasons: std::collections::BTreeSet<&str> = series(&text, "sluice_dead_letters_total", &[])
        .iter()
        .filter_map(|line| line.split("reason=\"").nth(1)?.split('"').next())
        .collect();
    assert!(
        reasons
            .iter()
            .all(|reason| ["undecodable", "invalid", "conflict", "storage", "internal"].contains(reason)),
        "dead-letter reasons are a fixed set: {reasons:?}"
    );
    assert!(!text.contains("junk_"), "no label carries producer input");
    assert!(!series(&text, "sluice_kafka_consumed_messages", &[]).is_empty());
    assert!(!series(
        &text,
        "sluice_commit_duration_seconds_bucket",
        &["service=\"limit-grant\""]
    )
    .is_empty());
    // Cardinality stays bounded: keys outside the patterns (top-N is 0) get no series.
    assert!(series(&text, "sluice_key_utilization", &["key=\"other\""]).is_empty());

    stop.trigger();
    stack.stop().await;
    shutdown.trigger();
    drop(guard);
    Ok(())
}

/// Idle connections (more than the endpoint takes at once) cannot stop the
/// scrape endpoint: they are closed, or time out, and scrapes are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_cannot_stop_the_scrape_endpoint() -> anyhow::Result<()> {
    std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
    let config = test_config("idlescrape", &[("telemetry.metrics_listen", "127.0.0.1:0")])?;
    let guard = telemetry::init(&config.telemetry, "sluice-test")?;
    let shutdown = Shutdown::new();
    let address = telemetry::spawn_metrics_endpoint(&config.telemetry, &guard, shutdown.clone())
        .await?
        .expect("an address");
    // Connections that send nothing, or half a request, and stay open.
    let mut idle = Vec::new();
    for index in 0..200 {
        let mut stream = tokio::net::TcpStream::connect(address).await?;
        if index % 2 == 0 {
            stream.write_all(b"GET /metr").await?;
        }
        idle.push(stream);
    }
    eventually(
        Duration::from_secs(30),
        "a scrape answered beside 200 idle connections",
        || async {
            Ok(tokio::time::timeout(Duration::from_secs(2), scrape(address))
                .await
                .is_ok_and(|scraped| scraped.is_ok()))
        },
    )
    .await?;
    // An idle connection is closed by the endpoint, not held for ever.
    let mut first = idle.swap_remove(0);
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(15), first.read_to_end(&mut rest)).await;
    assert!(matches!(read, Ok(Ok(_))), "the idle connection was closed: {read:?}");
    drop(idle);
    shutdown.trigger();
    drop(guard);
    Ok(())
}

#[tokio::test]
async fn with_no_endpoint_no_exporter_is_started() -> anyhow::Result<()> {
    std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
    let config = test_config("noexporter", &[("telemetry.otlp_endpoint", "")])?;
    assert_eq!(telemetry::otlp_endpoint(&config.telemetry), None);
    let guard = telemetry::init(&config.telemetry, "sluice-test")?;
    assert!(!guard.exporting(), "no trace exporter without an endpoint");
    assert!(!guard.exporting_metrics(), "no metric exporter without an endpoint");
    // Propagation still works without an exporter: a span recorded under a
    // remote parent hands the parent on unchanged, at no cost.
    let parent = pb::TraceContext {
        traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
        tracestate: String::new(),
    };
    let now = std::time::SystemTime::now();
    let child = telemetry::record_span("sluice-test", "noop", &parent, now, now, Vec::new);
    assert_eq!(child, parent);
    Ok(())
}
