//! A job that waits in a worker's queue for a slot and comes again (admission
//! re-sends an attempt nobody claimed within its claim timeout; a rebalance
//! delivers a message again) is queued once and runs once.

use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use sluice_client::{JobBuilder, Producer, Worker};
use sluice_e2e::{test_config, Stack};
use sluice_proto::v1 as pb;
use tokio::sync::Notify;

use crate::*;

fn admitted_jobs(messages: &[Vec<u8>]) -> impl Iterator<Item = pb::AdmittedJob> + '_ {
    messages
        .iter()
        .filter_map(|payload| pb::AdmittedJob::decode(payload.as_slice()).ok())
}

/// Waits until the worker dropped `copies` deliveries of attempts it
/// already holds.
async fn duplicates_at_least(worker: &RunningWorker, copies: usize) -> anyhow::Result<()> {
    let copies = u64::try_from(copies)?;
    sluice_e2e::eventually(Duration::from_secs(30), "the copies dropped", || async {
        Ok(worker.status.snapshot().duplicates >= copies)
    })
    .await
}

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
    // A copy of the attempt that runs (admission re-sends an attempt whose
    // claim is slow to reach it) is dropped on arrival: it takes no place
    // in the queue.
    let admitted_topic = stack.config.admitted_topic("default");
    let written = sluice_e2e::read_topic(&stack.config, &admitted_topic, Duration::from_secs(30), |messages| {
        admitted_jobs(messages).any(|job| job.job_id == "blocker")
    })
    .await?;
    let blocker = admitted_jobs(&written)
        .find(|job| job.job_id == "blocker")
        .expect("the blocker's message");
    sluice_e2e::publish_raw(
        &stack.config,
        vec![sluice_common::kafka::OutMsg {
            topic: Arc::from(admitted_topic.as_str()),
            partition: None,
            key: Some(b"blocker/1/9".to_vec()),
            payload: blocker.encode_to_vec(),
            headers: Vec::new(),
        }],
    )
    .await?;
    duplicates_at_least(&worker, 1).await?;
    let snapshot = worker.status.snapshot();
    assert_eq!(
        snapshot.pending, 0,
        "the running job's copy is not queued: {snapshot:?}"
    );
    assert_eq!(snapshot.running, 1, "{snapshot:?}");

    producer.enqueue(job("queued")?).await?;
    // The queued job's message and at least one re-send of it, read from
    // the topic; admission sends no more of the blocker, which runs. Once
    // the worker dropped as many copies as the topic holds, it dropped at
    // least one of the queued job's.
    let written = sluice_e2e::read_topic(&stack.config, &admitted_topic, Duration::from_secs(30), |messages| {
        admitted_jobs(messages).filter(|job| job.job_id == "queued").count() >= 2
    })
    .await?;
    let copies = admitted_jobs(&written).filter(|job| job.job_id == "blocker").count() - 1
        + admitted_jobs(&written).filter(|job| job.job_id == "queued").count()
        - 1;
    duplicates_at_least(&worker, copies).await?;
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
