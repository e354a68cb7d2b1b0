//! The SDK against real services (started in-process by the e2e harness),
//! the real broker (127.0.0.1:9092) and PostgreSQL (127.0.0.1:5432). Each
//! test has its own topics, schemas and consumer groups.

// Test-only crate: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cancel;
mod heartbeat;
mod local_limits;
mod producer;
mod redelivery;
mod refresh;
mod shutdown;
mod trace;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use sluice_client::{ClientOptions, StopReason, Worker, WorkerStatus};
use sluice_e2e::Stack;
use sluice_proto::v1 as pb;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Where the SDK finds the test's stack.
pub fn client_options(stack: &Stack) -> ClientOptions {
    let config = &stack.config;
    ClientOptions {
        brokers: config.kafka.brokers.clone(),
        topic_prefix: config.kafka.topic_prefix.clone(),
        requested_topic: config.topics.requested.clone(),
        admitted_topic_prefix: config.topics.admitted_prefix.clone(),
        refresh_tasks_topic: config.topics.refresh_tasks.clone(),
        admission_endpoint: stack.admissions[0].endpoint.clone(),
        refresh_endpoint: stack.refresh_dispatchers[0].endpoint.clone(),
        group_id: "workers".to_string(),
        fetch_wait_max_ms: 25,
        linger_ms: 1,
        ..Default::default()
    }
    // Rebalances among test workers in seconds, not the default 45 s.
    .consumer_property("session.timeout.ms", "6000")
    .consumer_property("heartbeat.interval.ms", "500")
}

pub fn now_ms() -> i64 {
    i64::try_from(SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis()).unwrap()
}

/// One handler run, as the test handler recorded it (wall clock, ms).
#[derive(Clone, Debug)]
pub struct Run {
    pub worker: String,
    pub job_id: String,
    pub attempt: u32,
    pub task_type: String,
    pub payload: String,
    pub enqueued_at_ms: i64,
    /// When admission admitted this attempt (its clock).
    pub admitted_at_ms: i64,
    pub started_ms: i64,
    /// When the handler returned or was dropped.
    pub ended_ms: i64,
    /// Why it was asked to stop, if it was.
    pub stop_reason: Option<StopReason>,
    /// Dropped before it returned.
    pub dropped: bool,
}

#[derive(Clone, Debug, Default)]
pub struct Runs(Arc<Mutex<Vec<Run>>>);

impl Runs {
    pub fn all(&self) -> Vec<Run> {
        self.0.lock().unwrap().clone()
    }

    pub fn of_job(&self, job_id: &str) -> Vec<Run> {
        self.all().into_iter().filter(|run| run.job_id == job_id).collect()
    }

    pub fn of_worker(&self, worker: &str) -> Vec<Run> {
        self.all().into_iter().filter(|run| run.worker == worker).collect()
    }

    fn push(&self, run: Run) {
        self.0.lock().unwrap().push(run);
    }
}

/// Records a run when dropped: when the handler returns, and also when the
/// worker drops a handler that did not stop.
pub struct RunGuard {
    runs: Runs,
    run: Option<Run>,
    job: sluice_client::Job,
}

impl RunGuard {
    pub fn start(runs: &Runs, worker: &str, job: &sluice_client::Job) -> Self {
        RunGuard {
            runs: runs.clone(),
            run: Some(Run {
                worker: worker.to_string(),
                job_id: job.job_id().to_string(),
                attempt: job.attempt(),
                task_type: job.task_type().to_string(),
                payload: String::from_utf8_lossy(job.payload()).to_string(),
                enqueued_at_ms: job.admitted().enqueued_at_ms,
                admitted_at_ms: job.admitted().admitted_at_ms,
                started_ms: now_ms(),
                ended_ms: 0,
                stop_reason: None,
                dropped: true,
            }),
            job: job.clone(),
        }
    }

    pub fn finished(mut self) {
        if let Some(run) = self.run.as_mut() {
            run.dropped = false;
        }
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        if let Some(mut run) = self.run.take() {
            run.ended_ms = now_ms();
            run.stop_reason = self.job.stop_reason();
            self.runs.push(run);
        }
    }
}

/// The largest number of runs overlapping at any instant.
pub fn max_overlap(runs: &[Run]) -> usize {
    let mut edges: Vec<(i64, i32)> = Vec::new();
    for run in runs {
        edges.push((run.started_ms, 1));
        edges.push((run.ended_ms, -1));
    }
    // Ends first at equal instants: touching runs do not overlap.
    edges.sort();
    let mut current = 0i32;
    let mut peak = 0i32;
    for (_, delta) in edges {
        current += delta;
        peak = peak.max(current);
    }
    usize::try_from(peak).unwrap_or(0)
}

/// A worker running in the background until its token is cancelled.
pub struct RunningWorker {
    pub status: WorkerStatus,
    pub shutdown: CancellationToken,
    pub handle: JoinHandle<sluice_client::Result<()>>,
}

impl RunningWorker {
    pub fn start(worker: Worker) -> Self {
        let status = worker.status();
        let shutdown = CancellationToken::new();
        let handle = tokio::spawn(worker.run(shutdown.clone()));
        RunningWorker {
            status,
            shutdown,
            handle,
        }
    }

    /// Graceful stop; returns how long the drain took.
    pub async fn stop(self) -> Duration {
        let began = Instant::now();
        self.shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(60), self.handle)
            .await
            .expect("worker stops within 60 s")
            .expect("worker task")
            .expect("worker run");
        began.elapsed()
    }
}

/// Wait until `workers` together own every one of `partitions` admitted
/// partitions and each owns at least one.
pub async fn wait_assigned(workers: &[&RunningWorker], partitions: usize) -> anyhow::Result<()> {
    sluice_e2e::eventually(
        Duration::from_secs(60),
        "workers own the admitted partitions",
        || async {
            let snapshots: Vec<_> = workers.iter().map(|worker| worker.status.snapshot()).collect();
            let total: usize = snapshots.iter().map(|snapshot| snapshot.assigned.len()).sum();
            Ok(total == partitions && snapshots.iter().all(|snapshot| !snapshot.assigned.is_empty()))
        },
    )
    .await
}

/// Job ids whose first attempt admission's producer (keyed by
/// `<job id>/<attempt>`) puts on `partition`.
pub fn job_ids_on_partition(prefix: &str, partition: i32, partitions: i32, count: usize) -> Vec<String> {
    (0..)
        .map(|index| format!("{prefix}-{index}"))
        .filter(|job_id| {
            let key = sluice_admission::effects::admitted_key(job_id, 1, 0);
            sluice_e2e::keyed_partition(key.as_bytes(), partitions) == partition
        })
        .take(count)
        .collect()
}

/// The job as GetJob shows it.
pub async fn job_view(stack: &Stack, job_id: &str) -> anyhow::Result<pb::JobView> {
    sluice_e2e::job_view(&stack.admission_client().await?, job_id).await
}

/// Wait until every job has `status`.
pub async fn wait_all_status(
    stack: &Stack,
    job_ids: &[String],
    status: pb::JobStatus,
    timeout: Duration,
) -> anyhow::Result<()> {
    let client = stack.admission_client().await?;
    for job_id in job_ids {
        sluice_e2e::wait_status(&client, job_id, status, timeout).await?;
    }
    Ok(())
}

/// Milliseconds as the payload of a test job.
pub fn millis_of(payload: &[u8]) -> u64 {
    String::from_utf8_lossy(payload)
        .rsplit('/')
        .next()
        .and_then(|text| text.parse().ok())
        .unwrap_or(0)
}
