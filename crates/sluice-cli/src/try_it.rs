//! `sluice try`: a copy-paste example against a running stack. Enqueues jobs
//! on one concurrency key, runs a worker that claims each admitted job, holds
//! it for a moment and completes it, and shows them going through at most
//! `limit` at a time.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use prost::Message as _;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::Message;
use sluice_common::auth::Channel;
use sluice_common::kafka::client_config;
use sluice_common::SluiceConfig;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;

pub struct TryOptions {
    pub endpoint: String,
    pub jobs: usize,
    pub limit: u32,
    pub key: String,
    pub tenant: String,
    pub hold: Duration,
}

pub async fn run(config: &SluiceConfig, options: TryOptions) -> anyhow::Result<()> {
    let channel = sluice_common::tls::endpoint(&options.endpoint)?
        .connect()
        .await
        .with_context(|| {
            format!(
                "cannot reach admission at {} (is `make run` running?)",
                options.endpoint
            )
        })?;
    let mut admission = AdmissionClient::new(sluice_common::auth::with_credentials(channel));
    let consumer = admitted_consumer(config)?;

    let started = Instant::now();
    let enqueued = admission
        .enqueue_batch(pb::EnqueueBatchRequest {
            jobs: job_requests(&options),
        })
        .await?
        .into_inner();
    let mut ours: HashSet<String> = enqueued.results.into_iter().map(|result| result.job_id).collect();
    println!(
        "enqueued {} jobs on key {:?} (tenant {:?}) with max_concurrency {}",
        ours.len(),
        options.key,
        options.tenant,
        options.limit
    );

    let progress = Arc::new(Progress {
        running: AtomicUsize::new(0),
        peak: AtomicUsize::new(0),
        done: AtomicUsize::new(0),
        started,
        total: options.jobs,
    });
    let mut tasks = tokio::task::JoinSet::new();
    while !ours.is_empty() {
        let message = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
            .await
            .context("no admitted job for 60s")??;
        let admitted = pb::AdmittedJob::decode(message.payload().unwrap_or_default())?;
        if !ours.remove(&admitted.job_id) {
            continue;
        }
        tasks.spawn(work(admission.clone(), admitted, options.hold, progress.clone()));
    }
    while let Some(joined) = tasks.join_next().await {
        joined??;
    }
    println!(
        "all {} jobs done in {:.1}s; at most {} ran at once (limit {})",
        options.jobs,
        started.elapsed().as_secs_f64(),
        progress.peak.load(Ordering::SeqCst),
        options.limit
    );
    Ok(())
}

/// A consumer of the default task group's admitted topic, reading every
/// partition from its end as of now.
fn admitted_consumer(config: &SluiceConfig) -> anyhow::Result<StreamConsumer> {
    let mut settings = client_config(&config.kafka);
    settings
        .set("group.id", format!("sluice-try-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", config.kafka.fetch_wait_max_ms.to_string());
    let consumer: StreamConsumer = settings.create()?;
    let topic = config.admitted_topic("default");
    // Read every partition from its end as of now, taken before enqueueing:
    // an offset reset to "latest" is resolved only at the first fetch, and a
    // job admitted before that would wait for the claim timeout's re-send.
    let metadata = consumer
        .fetch_metadata(Some(&topic), Duration::from_secs(10))
        .with_context(|| format!("reading the metadata of {topic}"))?;
    let mut assignment = rdkafka::TopicPartitionList::new();
    for partition in metadata
        .topics()
        .first()
        .map(|topic| topic.partitions())
        .unwrap_or_default()
    {
        let (_, high) = consumer.fetch_watermarks(&topic, partition.id(), Duration::from_secs(10))?;
        assignment.add_partition_offset(&topic, partition.id(), rdkafka::Offset::Offset(high))?;
    }
    anyhow::ensure!(assignment.count() > 0, "topic {topic} has no partitions");
    consumer.assign(&assignment)?;
    Ok(consumer)
}

fn job_requests(options: &TryOptions) -> Vec<pb::JobRequest> {
    (0..options.jobs)
        .map(|index| pb::JobRequest {
            tenant: options.tenant.clone(),
            task_group: "default".to_string(),
            payload: format!("try job {index}").into_bytes(),
            limits: vec![pb::Limit {
                kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                    key: options.key.clone(),
                    max_concurrency: options.limit,
                    shadow: false,
                })),
            }],
            ..Default::default()
        })
        .collect()
}

/// The worker's counts, shared by the jobs it runs.
struct Progress {
    running: AtomicUsize,
    peak: AtomicUsize,
    done: AtomicUsize,
    started: Instant,
    total: usize,
}

/// Claims one admitted job, holds it for `hold` and completes it.
async fn work(
    mut admission: AdmissionClient<Channel>,
    admitted: pb::AdmittedJob,
    hold: Duration,
    progress: Arc<Progress>,
) -> anyhow::Result<()> {
    let claim = admission
        .claim(pb::ClaimRequest {
            worker_id: "sluice-try".to_string(),
            jobs: vec![pb::JobAttempt {
                job_id: admitted.job_id.clone(),
                attempt: admitted.attempt,
            }],
        })
        .await?
        .into_inner();
    if claim.results.first().map(|result| result.outcome) != Some(pb::ClaimOutcome::Claimed as i32) {
        return anyhow::Ok(());
    }
    let now_running = progress.running.fetch_add(1, Ordering::SeqCst) + 1;
    progress.peak.fetch_max(now_running, Ordering::SeqCst);
    println!(
        "{:>7.2}s  start   {}  running now: {now_running}",
        progress.started.elapsed().as_secs_f64(),
        admitted.job_id
    );
    tokio::time::sleep(hold).await;
    let left = progress.running.fetch_sub(1, Ordering::SeqCst) - 1;
    admission
        .complete(pb::CompleteRequest {
            worker_id: "sluice-try".to_string(),
            completions: vec![pb::Completion {
                job_id: admitted.job_id.clone(),
                attempt: admitted.attempt,
                outcome: Some(pb::completion::Outcome::Success(pb::Success {})),
            }],
        })
        .await?;
    let finished = progress.done.fetch_add(1, Ordering::SeqCst) + 1;
    println!(
        "{:>7.2}s  done    {}  running now: {left}  ({finished}/{})",
        progress.started.elapsed().as_secs_f64(),
        admitted.job_id,
        progress.total
    );
    anyhow::Ok(())
}
