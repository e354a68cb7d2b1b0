//! A job that waits in a worker's queue for a slot and comes again (admission
//! re-sends an attempt nobody claimed within its claim timeout; a rebalance
//! delivers a message again) is queued once and runs once.

use std::sync::Arc;
use std::time::Duration;

use sluice_client::{JobBuilder, Producer, Worker};
use sluice_e2e::{test_config, Stack};
use sluice_proto::v1 as pb;
use tokio::sync::Notify;

use crate::*;

fn job(job_id: &str) -> sluice_client::Result<pb::JobRequest> {
    JobBuilder::new("acme", "default")
        .job_id(job_id)
        .payload(job_id.to_string())
        .concurrency("redelivered", 4)
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queued_job_sent_again_is_queued_once_and_runs_once() -> anyhow::Result<()> {
    // Admission re-sends an unclaimed attempt every second.
    let stack = Stack::start(test_config("sdk_redelivery", &[("admission.claim_timeout", "1s")])?, 1).await?;
    let runs = Runs::default();
    let release = Arc::new(Notify::new());
    let handler = {
        let runs = runs.clone();
        let release = release.clone();
        move |job: sluice_client::Job| {
            let runs = runs.clone();
            let release = release.clone();
            async move {
                let guard = RunGuard::start(&runs, "only", &job);
                if job.job_id() == "blocker" {
                    release.notified().await;
                }
                guard.finished();
                Ok(())
            }
        }
    };
    // One slot; the only worker of the group owns every partition, so a
    // job without a slot stays queued here (nobody to hand it off to).
    let worker = RunningWorker::start(
        Worker::builder(client_options(&stack), handler)
            .task_group("default")
            .worker_id("only")
            .concurrency(1)
            .prefetch(4)
            .build()?,
    );
    wait_assigned(&[&worker], usize::try_from(stack.config.kafka.partitions.admitted)?).await?;
    let producer = Producer::new(&client_options(&stack))?;
    let admission = stack.admission_client().await?;

    producer.enqueue(job("blocker")?).await?;
    sluice_e2e::wait_status(&admission, "blocker", pb::JobStatus::Running, Duration::from_secs(30)).await?;
    producer.enqueue(job("queued")?).await?;
    // The blocker's message, the queued job's, and at least one re-send of it.
    sluice_e2e::eventually(Duration::from_secs(30), "the queued job sent again", || async {
        Ok(worker.status.snapshot().delivered >= 3)
    })
    .await?;
    let snapshot = worker.status.snapshot();
    assert_eq!(snapshot.pending, 1, "one job waits for the slot, once: {snapshot:?}");
    assert_eq!(snapshot.running, 1, "{snapshot:?}");

    release.notify_waiters();
    sluice_e2e::wait_status(&admission, "queued", pb::JobStatus::Succeeded, Duration::from_secs(30)).await?;
    let queued = job_view(&stack, "queued").await?;
    assert_eq!(queued.attempt, 1, "{queued:?}");
    assert_eq!(runs.of_job("queued").len(), 1, "{:?}", runs.all());
    worker.stop().await;
    assert_eq!(stack.tickets_left().await?, 0);
    stack.stop().await;
    Ok(())
}
