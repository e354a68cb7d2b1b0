//! A cancel reaches the running handler through the heartbeat answer; the
//! worker stops it (cooperatively, or by dropping it after `stop_grace`),
//! confirms, and the job's ticket returns long before the lease would end.

use std::time::{Duration, Instant};

use sluice_client::{JobBuilder, Producer, StopReason, Worker};
use sluice_e2e::{key_state, test_config, Stack};
use sluice_proto::v1 as pb;

use crate::*;

const LEASE_MS: i64 = 6_000;
const STOP_GRACE_MS: u64 = 500;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cancel_stops_the_running_handler_and_its_ticket_returns() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("sdk_cancel", &[("task_groups.default.lease", "6s")])?, 1).await?;
    let runs = Runs::default();
    // "polite" returns when asked to stop; "stubborn" ignores the token.
    let handler = {
        let runs = runs.clone();
        move |job: sluice_client::Job| {
            let runs = runs.clone();
            async move {
                let guard = RunGuard::start(&runs, "worker", &job);
                let run_for = Duration::from_millis(millis_of(job.payload()));
                if job.payload().starts_with(b"polite") {
                    tokio::select! {
                        _ = job.cancelled() => {}
                        _ = tokio::time::sleep(run_for) => {}
                    }
                } else {
                    tokio::time::sleep(run_for).await;
                }
                guard.finished();
                Ok(())
            }
        }
    };
    let worker = RunningWorker::start(
        Worker::builder(client_options(&stack), handler)
            .task_group("default")
            .worker_id("cancel-worker")
            .concurrency(4)
            .stop_grace(Duration::from_millis(STOP_GRACE_MS))
            .build()?,
    );
    wait_assigned(&[&worker], usize::try_from(stack.config.kafka.partitions.admitted)?).await?;
    let producer = Producer::new(&client_options(&stack))?;
    let admission = stack.admission_client().await?;

    let job = |job_id: &str, payload: &str, key: &str| {
        JobBuilder::new("acme", "default")
            .job_id(job_id)
            .payload(payload.to_string())
            .concurrency(key, 1)
            .build()
    };
    producer.enqueue(job("polite", "polite/60000", "polite-key")?).await?;
    producer
        .enqueue(job("stubborn", "stubborn/60000", "stubborn-key")?)
        .await?;
    for job_id in ["polite", "stubborn"] {
        sluice_e2e::wait_status(&admission, job_id, pb::JobStatus::Running, Duration::from_secs(30)).await?;
    }
    // Each key's next job waits for the ticket.
    producer.enqueue(job("polite-next", "next/10", "polite-key")?).await?;
    producer
        .enqueue(job("stubborn-next", "next/10", "stubborn-key")?)
        .await?;

    let cancelled_at = now_ms();
    let began = Instant::now();
    for job_id in ["polite", "stubborn"] {
        let status = producer.cancel_job(job_id, "test cancel").await?;
        assert_eq!(
            status,
            pb::JobStatus::Cancelling,
            "{job_id} is running, so it is cancelling"
        );
    }
    wait_all_status(
        &stack,
        &["polite".to_string(), "stubborn".to_string()],
        pb::JobStatus::Cancelled,
        Duration::from_secs(20),
    )
    .await?;
    let confirmed_after = began.elapsed();
    // The tickets returned: the next jobs of both keys run to success.
    wait_all_status(
        &stack,
        &["polite-next".to_string(), "stubborn-next".to_string()],
        pb::JobStatus::Succeeded,
        Duration::from_secs(20),
    )
    .await?;

    let polite = runs.of_job("polite");
    let stubborn = runs.of_job("stubborn");
    let polite_next = runs.of_job("polite-next");
    let stubborn_next = runs.of_job("stubborn-next");
    println!(
        "cancel confirmed after {confirmed_after:?}; polite stopped {} ms after the cancel, stubborn dropped {} ms after; next jobs started {} / {} ms after the cancel",
        polite[0].ended_ms - cancelled_at,
        stubborn[0].ended_ms - cancelled_at,
        polite_next[0].started_ms - cancelled_at,
        stubborn_next[0].started_ms - cancelled_at,
    );
    // The polite handler saw the cancel and returned.
    assert_eq!(polite.len(), 1);
    assert_eq!(polite[0].stop_reason, Some(StopReason::Cancelled));
    assert!(!polite[0].dropped, "{polite:?}");
    // The stubborn one was dropped after the stop grace.
    assert_eq!(stubborn.len(), 1);
    assert_eq!(stubborn[0].stop_reason, Some(StopReason::Cancelled));
    assert!(stubborn[0].dropped, "{stubborn:?}");
    // Heartbeats every lease/3 (2 s): stopped within one interval plus the grace.
    let heartbeat_ms = LEASE_MS / 3;
    assert!(polite[0].ended_ms - cancelled_at <= heartbeat_ms + 1_000, "{polite:?}");
    assert!(
        stubborn[0].ended_ms - cancelled_at <= heartbeat_ms + i64::try_from(STOP_GRACE_MS)? + 1_000,
        "{stubborn:?}"
    );
    // Confirmed by the worker, not by the lease running out.
    assert!(
        confirmed_after < Duration::from_millis(u64::try_from(LEASE_MS)?),
        "confirmed after {confirmed_after:?}"
    );
    for job_id in ["polite", "stubborn"] {
        let view = job_view(&stack, job_id).await?;
        // The record of the worker's confirmation (a lapsed lease would say
        // "no heartbeat within the lease").
        assert!(
            view.history
                .iter()
                .any(|record| record.outcome == "cancelled" && record.detail.contains("cancel requested")),
            "{job_id}: {:?}",
            view.history
        );
    }
    assert!(polite_next[0].started_ms >= polite[0].ended_ms);
    assert!(stubborn_next[0].started_ms >= stubborn[0].ended_ms);
    assert_eq!(worker.status.snapshot().cancelled, 2);
    sluice_e2e::eventually(Duration::from_secs(10), "the keys' tickets released", || async {
        Ok(key_state(&stack, "acme", "polite-key").await?.holders.is_empty()
            && key_state(&stack, "acme", "stubborn-key").await?.holders.is_empty())
    })
    .await?;

    worker.stop().await;
    assert_eq!(stack.tickets_left().await?, 0);
    stack.stop().await;
    Ok(())
}
