//! Automatic heartbeats keep a long job's lease, and so its ticket.

use std::time::Duration;

use sluice_client::{JobBuilder, Producer, Worker};
use sluice_e2e::{key_state, test_config, Stack};
use sluice_proto::v1 as pb;

use crate::*;

const LEASE_MS: i64 = 1_000;
const LONG_MS: u64 = 5_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeats_keep_a_job_running_past_three_leases_holding_its_ticket() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("sdk_heartbeat", &[("task_groups.default.lease", "1s")])?, 1).await?;
    let runs = Runs::default();
    let handler = {
        let runs = runs.clone();
        move |job: sluice_client::Job| {
            let runs = runs.clone();
            async move {
                let guard = RunGuard::start(&runs, "worker", &job);
                tokio::time::sleep(Duration::from_millis(millis_of(job.payload()))).await;
                guard.finished();
                Ok(())
            }
        }
    };
    let worker = RunningWorker::start(
        Worker::builder(client_options(&stack), handler)
            .task_group("default")
            .worker_id("heartbeat-worker")
            .concurrency(2)
            .build()?,
    );
    wait_assigned(&[&worker], usize::try_from(stack.config.kafka.partitions.admitted)?).await?;
    let producer = Producer::new(&client_options(&stack))?;

    // One key, max 1: the long job holds the only ticket; the follower waits.
    let long = producer
        .enqueue(
            JobBuilder::new("acme", "default")
                .job_id("long")
                .payload(format!("long/{LONG_MS}"))
                .concurrency("hb", 1)
                .build()?,
        )
        .await?;
    let admission = stack.admission_client().await?;
    sluice_e2e::wait_status(
        &admission,
        &long.job_id,
        pb::JobStatus::Running,
        Duration::from_secs(30),
    )
    .await?;
    let follower = producer
        .enqueue(
            JobBuilder::new("acme", "default")
                .job_id("follower")
                .payload("follower/50")
                .concurrency("hb", 1)
                .build()?,
        )
        .await?;

    // Through more than three leases the long job keeps running, attempt 1,
    // holding the key's only ticket while the follower waits; its lease is
    // always in the future.
    let mut samples = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let view = job_view(&stack, &long.job_id).await?;
        if view.status != pb::JobStatus::Running as i32 {
            break;
        }
        let state = key_state(&stack, "acme", "hb").await?;
        let sampled_at = now_ms();
        let lease_left = view.lease_expires_at_ms.unwrap_or_default() - sampled_at;
        samples.push((sampled_at, state.holders.len(), state.waiting, lease_left));
        assert_eq!(view.attempt, 1, "the long job lost its attempt: {view:?}");
        assert_eq!(state.holders.len(), 1, "the long job's ticket: {state:?}");
        assert!(lease_left > 0 && lease_left <= LEASE_MS, "lease left {lease_left} ms");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let first_sample = samples.first().map_or(0, |sample| sample.0);
    let last_sample = samples.last().map_or(0, |sample| sample.0);
    println!(
        "samples (ms since the first, holders, waiting, lease left ms): {:?}",
        samples
            .iter()
            .map(|(at, holders, waiting, left)| (at - first_sample, holders, waiting, left))
            .collect::<Vec<_>>()
    );
    assert!(samples.len() >= 3, "too few samples: {samples:?}");

    let job_ids = vec![long.job_id.clone(), follower.job_id.clone()];
    wait_all_status(&stack, &job_ids, pb::JobStatus::Succeeded, Duration::from_secs(30)).await?;
    let long_view = job_view(&stack, &long.job_id).await?;
    let long_runs = runs.of_job(&long.job_id);
    let follower_runs = runs.of_job(&follower.job_id);
    println!(
        "long ran {} ms; follower started {} ms after the long job ended; history {:?}",
        long_runs[0].ended_ms - long_runs[0].started_ms,
        follower_runs[0].started_ms - long_runs[0].ended_ms,
        long_view.history
    );
    assert_eq!(long_runs.len(), 1, "the long job ran once: {long_runs:?}");
    assert_eq!(long_view.attempt, 1);
    assert!(
        long_view.history.iter().all(|record| record.outcome != "lease_expired"),
        "{:?}",
        long_view.history
    );
    assert!(long_runs[0].ended_ms - long_runs[0].started_ms >= 3 * LEASE_MS);
    // Seen running, attempt 1, holding the ticket, more than three leases
    // after its handler started.
    assert!(
        last_sample - long_runs[0].started_ms > 3 * LEASE_MS,
        "last seen running {} ms after it started",
        last_sample - long_runs[0].started_ms
    );
    // The ticket was never released early: the follower started only after.
    assert_eq!(follower_runs.len(), 1);
    assert!(
        follower_runs[0].started_ms >= long_runs[0].ended_ms,
        "{follower_runs:?} vs {long_runs:?}"
    );
    assert_eq!(worker.status.snapshot().lease_lost, 0);

    worker.stop().await;
    sluice_e2e::eventually(Duration::from_secs(10), "no tickets left", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    stack.stop().await;
    Ok(())
}
