//! Adaptive limits end to end: SDK stream workers in front of a simulated
//! downstream whose latency climbs above six jobs at once. The key's max,
//! computed by limit-grant from the run times admission measures (claim to
//! completion), rises from 1, shrinks when the mean run passes the target,
//! and ends near the downstream's capacity.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sluice_e2e::*;
use sluice_proto::v1 as pb;

/// The downstream serves `CAPACITY` jobs at once in `BASE_MS`; a job that
/// starts with `running` in flight takes `BASE × (1 + 2 × (running − CAPACITY) / CAPACITY)`.
const CAPACITY: u32 = 6;
const BASE_MS: u64 = 100;

fn run_ms(running: u32) -> u64 {
    let over = u64::from(running.saturating_sub(CAPACITY));
    BASE_MS + 2 * BASE_MS * over / u64::from(CAPACITY)
}

fn adaptive_job(key: &str, payload: &str) -> pb::JobRequest {
    pb::JobRequest {
        tenant: "acme".to_string(),
        task_group: "default".to_string(),
        payload: payload.as_bytes().to_vec(),
        limits: vec![pb::Limit {
            kind: Some(pb::limit::Kind::Adaptive(pb::AdaptiveConcurrencyLimit {
                key: key.to_string(),
                min: 1,
                max: 50,
                target_latency_ms: 130,
                ..Default::default()
            })),
        }],
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adaptive_key_finds_the_downstreams_capacity() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("adaptive", &[])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let key = "api:slow-downstream";

    let running = Arc::new(AtomicU32::new(0));
    let in_flight = running.clone();
    let handler = move |_job: sluice_client::Job| {
        let in_flight = in_flight.clone();
        async move {
            let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            tokio::time::sleep(Duration::from_millis(run_ms(now))).await;
            in_flight.fetch_sub(1, Ordering::SeqCst);
            Ok(())
        }
    };
    let options = sluice_client::ClientOptions {
        brokers: String::new(),
        admission_endpoint: stack.admissions[0].endpoint.clone(),
        ..sluice_client::ClientOptions::default()
    };
    let worker = sluice_client::Worker::builder(options, handler)
        .task_group("default")
        .concurrency(32)
        .transport(sluice_client::Transport::Stream)
        .build()?;
    let token = sluice_client::CancellationToken::new();
    tokio::spawn(worker.run(token.clone()));

    let ids: Vec<String> = (0..240).map(|index| format!("{prefix}adaptive-{index}")).collect();
    for id in &ids {
        enqueue_with_id(&admission, id, adaptive_job(key, id)).await?;
    }
    for id in &ids {
        wait_status(&admission, id, pb::JobStatus::Succeeded, Duration::from_secs(120)).await?;
    }
    token.cancel();

    let state = key_state(&stack, "acme", key).await?;
    assert_eq!(state.kind, pb::LimitKind::Adaptive as i32);
    let adaptive = state.adaptive.expect("an adaptive key describes its max");
    // Every job succeeded, so only a window over the latency target can
    // have shrunk the max, and only a shrink ends slow start.
    assert!(!adaptive.slow_start, "it shrank on latency: {adaptive:?}");
    assert!(adaptive.changes >= 4, "it grew from 1 and shrank: {adaptive:?}");
    // Measured claim to completion: at least the downstream's base time.
    assert!(
        adaptive.window_mean_run_ms.unwrap_or_default() >= BASE_MS as f64,
        "{adaptive:?}"
    );
    // Near the capacity: the target, 130 ms, is reached at 7 jobs in the
    // downstream. The key counts a slot from its grant to its release, and
    // part of that time the job is not in the downstream yet (dispatch) or
    // any more (completion): on a loaded machine that part grows and the
    // key settles higher (9 seen with two test suites at once, with mean
    // runs of 121 and 129 ms: the downstream saw 6 to 7). The ±20 % of the algorithm itself is
    // shown on an explicit clock (limit-grant's state tests); here, the
    // loop closes in real time: it grew from 1, shrank on latency, and
    // stays in the downstream's range, far below the key's bound of 50.
    assert!(
        (CAPACITY - 1..=2 * CAPACITY).contains(&adaptive.current_max),
        "computed max {} for a downstream of {CAPACITY}: {adaptive:?}",
        adaptive.current_max
    );
    assert_eq!(adaptive.settings.unwrap_or_default().target_latency_ms, 130);
    stack.stop().await;
    Ok(())
}
