//! `make bench-backlog` (`sluice-chaos backlog`): a backlog of a million
//! jobs against the four services as separate processes (issue 30, item 3).
//!
//! 1. Producers enqueue every job as fast as they can (gRPC `EnqueueBatch`,
//!    through admission's address), each on one of the concurrency keys,
//!    with no worker running: every job waits. A refused or unanswered
//!    (30 s) batch is sent again (`enqueue_retries`,
//!    `enqueue_calls_unanswered`): its jobs have ids, so nothing doubles.
//! 2. Until limit-grant holds every job (the keys' holders and waiters
//!    add up to the jobs, read with `DescribeKey`), the resident memory
//!    (VmRSS from /proc) of every service process is sampled; a service's
//!    figure is its instances' peak sum minus their sum before the
//!    enqueue (the stack up and idle), divided by the waiting jobs.
//! 3. Stream worker processes (`stream_worker`, handlers that return at
//!    once) drain the backlog. When `BACKLOG_KILL_AT` jobs still wait,
//!    every admission and limit-grant instance is killed with SIGKILL and
//!    started again at once. Serving again: the first job pushed to a
//!    worker after the restart (`serve_again_s`), and the first `Enqueue`
//!    answered (`enqueue_again_s`, the first job enqueued again: an
//!    idempotent request, so no job is added), both from the kill.
//! 4. Every job must have exactly one attempt whose success was ACCEPTED
//!    (the workers' event logs) and be SUCCEEDED in admission's tables;
//!    otherwise the run fails (exit 1) and says how.
//!
//! Progress lines go to stderr; one JSON line to stdout at the end:
//! `enqueue_jobs_per_s`; `drain_jobs_per_s` (jobs completed from the first
//! push to the kill, per second), `drain_jobs_per_s_overall` (every job,
//! first push to last completion, the restart included) and
//! `drain_after_restart_jobs_per_s`; `resident_bytes_per_waiting_job` per
//! service and `total` (and `resident_mb` before and at the peak);
//! `resident_bytes_per_waiting_job_after_restart` (the restarted services'
//! peak until the end, over the jobs waiting at the kill); the kill's
//! figures; `jobs`, `keys`, `limit`, `instances`, `elapsed_s`; `failed`.
//!
//! Environment: BACKLOG_JOBS (1000000), BACKLOG_KEYS (10000), BACKLOG_LIMIT
//! (5), BACKLOG_INSTANCES (2 of each service), BACKLOG_PRODUCERS (4
//! concurrent producers), BACKLOG_BATCH (1000 jobs per `EnqueueBatch`),
//! BACKLOG_MAX_ATTEMPTS (100: a job's attempts; an attempt the kill costs
//! is retried, counted in `jobs_run_more_than_once` and
//! `stale_completions`), BACKLOG_WORKERS (2 worker processes), BACKLOG_SLOTS (2000 jobs at once
//! per worker process), BACKLOG_KILL_AT (jobs still waiting when the kill
//! comes: half the jobs; 0: no kill), BACKLOG_SETTLE_S (600: at most this
//! long for limit-grant to hold every job), BACKLOG_DEADLINE_S (3600: the
//! drain at most), BACKLOG_SINGLE_BATCHES (1: the services produce one
//! message per batch, as in `make chaos`: tansu hands a consumer that
//! resumes inside a batch nothing of its rest, so with kills larger batches
//! lose messages to the broker, not to Sluice; 0: production batching, as
//! `make bench`), BACKLOG_CLEAN (1: drop the run's schemas and the
//! workers' event logs at the end), CHAOS_SERVICE_LOG (the services'
//! RUST_LOG, `warn`). Every instance's log is in the directory the first
//! line names.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use futures::StreamExt;
use sluice_e2e::{admin_pool, cleanup, concurrency_job, connect, test_config};
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;

use crate::cluster::{resident_bytes, Addresses, Cluster, ConfigFile, SERVICES};
use crate::env_number;
use crate::events::{now_ms, Event, Tail};
use crate::run::WorkerPool;
use crate::worker::{self, admission_client};
use crate::workload::job_id;

const TENANT: &str = "backlog";
/// How often memory is sampled and the workers' logs read.
const TICK: Duration = Duration::from_millis(500);
/// An `EnqueueBatch` not answered within this is sent again.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How often a progress line is printed.
const PROGRESS_EVERY_MS: i64 = 5_000;

struct Spec {
    jobs: usize,
    keys: usize,
    limit: u32,
    instances: usize,
    producers: usize,
    batch: usize,
    workers: usize,
    slots: usize,
    kill_at: usize,
    settle: Duration,
    deadline: Duration,
    single_batches: bool,
    clean: bool,
    max_attempts: u32,
}

impl Spec {
    fn from_env() -> Self {
        let jobs: usize = env_number("BACKLOG_JOBS", 1_000_000);
        Spec {
            jobs,
            keys: env_number::<usize>("BACKLOG_KEYS", 10_000).max(1),
            limit: env_number("BACKLOG_LIMIT", 5),
            instances: env_number::<usize>("BACKLOG_INSTANCES", 2).max(1),
            producers: env_number::<usize>("BACKLOG_PRODUCERS", 4).max(1),
            batch: env_number::<usize>("BACKLOG_BATCH", 1000).max(1),
            workers: env_number::<usize>("BACKLOG_WORKERS", 2).max(1),
            slots: env_number::<usize>("BACKLOG_SLOTS", 2000).max(2),
            kill_at: env_number("BACKLOG_KILL_AT", jobs / 2),
            settle: Duration::from_secs(env_number("BACKLOG_SETTLE_S", 600)),
            deadline: Duration::from_secs(env_number("BACKLOG_DEADLINE_S", 3600)),
            single_batches: env_number::<u32>("BACKLOG_SINGLE_BATCHES", 1) > 0,
            clean: env_number::<u32>("BACKLOG_CLEAN", 1) > 0,
            max_attempts: env_number::<u32>("BACKLOG_MAX_ATTEMPTS", 100).max(1),
        }
    }

    fn request(&self, job: usize) -> pb::JobRequest {
        let mut request = concurrency_job(TENANT, &format!("k{}", job % self.keys), self.limit, 0, "");
        request.job_id = Some(job_id(job));
        // An attempt the kill costs (a lease that expires: see
        // `stale_completions`) is retried, as in `make chaos`.
        request.retry = Some(pb::RetryPolicy {
            max_attempts: self.max_attempts,
            initial_backoff: "100ms".to_string(),
            max_backoff: "1s".to_string(),
            ..pb::RetryPolicy::default()
        });
        request
    }
}

/// Resident bytes of each service (its instances summed), in `SERVICES`'
/// order.
type Resident = [u64; SERVICES.len()];

fn resident(cluster: &Cluster) -> Resident {
    let mut sums = [0; SERVICES.len()];
    for instance in &cluster.instances {
        let pid = instance.child.as_ref().and_then(tokio::process::Child::id);
        if let (Some(pid), Some(index)) = (pid, SERVICES.iter().position(|service| *service == instance.service)) {
            sums[index] += resident_bytes(pid);
        }
    }
    sums
}

fn peak(into: &mut Resident, sample: &Resident) {
    for (peak, now) in into.iter_mut().zip(sample) {
        *peak = (*peak).max(*now);
    }
}

fn megabytes(resident: &Resident) -> String {
    SERVICES
        .iter()
        .zip(resident)
        .map(|(service, bytes)| format!("{service} {:.0}", *bytes as f64 / 1e6))
        .collect::<Vec<_>>()
        .join(", ")
}

fn per_job(peak: &Resident, baseline: &Resident, jobs: usize, services: &[&str]) -> serde_json::Value {
    let mut figures = serde_json::Map::new();
    let mut total = 0.0;
    for (index, service) in SERVICES.iter().enumerate() {
        if !services.contains(service) {
            continue;
        }
        let bytes = peak[index].saturating_sub(baseline[index]) as f64 / jobs.max(1) as f64;
        total += bytes;
        figures.insert((*service).to_string(), bytes.round().into());
    }
    figures.insert("total".to_string(), total.round().into());
    serde_json::Value::Object(figures)
}

fn seconds(ms: i64) -> f64 {
    (ms as f64 / 1000.0 * 1000.0).round() / 1000.0
}

/// What the workers' logs said so far.
struct Drained {
    /// Per job: the attempt whose success was ACCEPTED (0: none yet).
    accepted: Vec<u32>,
    completed: usize,
    /// A job's second attempt ACCEPTED (the job ran to success twice).
    accepted_twice: Vec<usize>,
    /// The same attempt's success answered ACCEPTED again (a completion
    /// sent again because its answer was lost; the same success).
    accepted_again: usize,
    /// Success completions answered STALE: the attempt was no longer the
    /// worker's (with handlers that return at once, an attempt the kill
    /// disturbed).
    stale: usize,
    /// Handler starts per job.
    starts: Vec<u16>,
    unknown_jobs: usize,
    first_push_ms: Option<i64>,
    last_accept_ms: i64,
    /// Completions ACCEPTED at or before `accepted_by`'s time (lines are
    /// read a tick late).
    accepted_by: Option<(i64, usize)>,
    /// The first push at or after this time, once there is one.
    push_after: Option<(i64, Option<i64>)>,
}

impl Drained {
    fn new(jobs: usize) -> Self {
        Drained {
            accepted: vec![0; jobs],
            completed: 0,
            accepted_twice: Vec::new(),
            accepted_again: 0,
            stale: 0,
            starts: vec![0; jobs],
            unknown_jobs: 0,
            first_push_ms: None,
            last_accept_ms: 0,
            accepted_by: None,
            push_after: None,
        }
    }

    fn read(&mut self, tails: &mut [Tail]) {
        for tail in tails {
            for line in tail.read_new() {
                if line.job >= self.accepted.len() {
                    self.unknown_jobs += 1;
                    continue;
                }
                match &line.event {
                    Event::Got { .. } => {
                        self.first_push_ms = Some(self.first_push_ms.map_or(line.at_ms, |at| at.min(line.at_ms)));
                        if let Some((after, first)) = &mut self.push_after {
                            if line.at_ms >= *after {
                                *first = Some(first.map_or(line.at_ms, |at| at.min(line.at_ms)));
                            }
                        }
                    }
                    Event::Start => self.starts[line.job] = self.starts[line.job].saturating_add(1),
                    Event::Complete { answer, .. } if answer == "STALE" => self.stale += 1,
                    Event::Complete { answer, .. } if answer == "ACCEPTED" => {
                        let accepted = &mut self.accepted[line.job];
                        if *accepted == 0 {
                            *accepted = line.attempt;
                            self.completed += 1;
                            self.last_accept_ms = self.last_accept_ms.max(line.at_ms);
                            if let Some((by, count)) = &mut self.accepted_by {
                                if line.at_ms <= *by {
                                    *count += 1;
                                }
                            }
                        } else if *accepted == line.attempt {
                            self.accepted_again += 1;
                        } else {
                            self.accepted_twice.push(line.job);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Jobs limit-grant holds (holders and waiters on every key), or why not
/// read.
async fn held_by_limit_grant(limit_grant: &str, spec: &Spec) -> anyhow::Result<u64> {
    let channel = connect(limit_grant).await?;
    let client = sluice_proto::v1::limits_client::LimitsClient::new(channel);
    let counts: Vec<anyhow::Result<u64>> = futures::stream::iter(0..spec.keys)
        .map(|key| {
            let mut client = client.clone();
            async move {
                let state = client
                    .describe_key(pb::DescribeKeyRequest {
                        key: Some(pb::KeyRef {
                            tenant: TENANT.to_string(),
                            key: format!("k{key}"),
                        }),
                        ticket: None,
                        first_waiters: 0,
                    })
                    .await?
                    .into_inner()
                    .state
                    .unwrap_or_default();
                anyhow::Ok(u64::from(state.waiting) + u64::try_from(state.holders.len())?)
            }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    counts.into_iter().sum()
}

/// Job statuses in admission's tables: every job, and those SUCCEEDED.
async fn stored_statuses(base: &sluice_common::SluiceConfig, pool: &sqlx::PgPool) -> anyhow::Result<(i64, i64)> {
    let schema = base.schema("admission");
    let query = format!(
        "SELECT count(*), count(*) FILTER (WHERE o.status = $1) FROM \"{schema}\".jobs j
         LEFT JOIN \"{schema}\".job_outcomes o USING (job_id)"
    );
    let succeeded = i16::try_from(pb::JobStatus::Succeeded as i32)?;
    Ok(sqlx::query_as(sqlx::AssertSqlSafe(query))
        .bind(succeeded)
        .fetch_one(pool)
        .await?)
}

/// The first `Enqueue` answered from now on, as a wall-clock time.
async fn first_enqueue_answered(address: String, request: pb::JobRequest) -> i64 {
    loop {
        if let Ok(mut client) = admission_client(&address) {
            let call = client.enqueue(pb::EnqueueRequest {
                job: Some(request.clone()),
            });
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), call).await {
                return now_ms();
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What admission and limit-grant say of jobs that never completed (on
/// stderr): where a stall is.
async fn describe_stuck(
    client: &AdmissionClient<tonic::transport::Channel>,
    limit_grant: &str,
    spec: &Spec,
    jobs: &[usize],
) {
    let limits = match connect(limit_grant).await {
        Ok(channel) => Some(sluice_proto::v1::limits_client::LimitsClient::new(channel)),
        Err(error) => {
            eprintln!("backlog: limit-grant unreachable: {error:#}");
            None
        }
    };
    for job in jobs {
        let view = tokio::time::timeout(CALL_TIMEOUT, sluice_e2e::job_view(client, &job_id(*job))).await;
        match view.unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {CALL_TIMEOUT:?}"))) {
            Ok(view) => eprintln!(
                "backlog: {} never completed: {:?}, attempt {}, claimed by {:?}, lease until {:?}, waiting {:?}, reason {:?}, history {:?}",
                view.job_id,
                view.status(),
                view.attempt,
                view.claimed_by,
                view.lease_expires_at_ms,
                view.waiting,
                view.reason,
                view.history
            ),
            Err(error) => eprintln!("backlog: {} never completed; GetJob: {error:#}", job_id(*job)),
        }
        let Some(mut limits) = limits.clone() else { continue };
        let key = format!("k{}", job % spec.keys);
        let call = limits.describe_key(pb::DescribeKeyRequest {
            key: Some(pb::KeyRef {
                tenant: TENANT.to_string(),
                key: key.clone(),
            }),
            ticket: None,
            first_waiters: 3,
        });
        let state = tokio::time::timeout(CALL_TIMEOUT, call)
            .await
            .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("no answer")));
        match state.map(|response| response.into_inner().state.unwrap_or_default()) {
            Ok(state) => eprintln!(
                "backlog:   key {key}: {} waiting, holders {:?}, first waiters {:?}",
                state.waiting, state.holders, state.first_waiters
            ),
            Err(status) => eprintln!("backlog:   key {key}: DescribeKey: {status}"),
        }
    }
}

struct Progress {
    started_ms: i64,
    last_ms: i64,
    last_count: usize,
}

impl Progress {
    fn say(&mut self, phase: &str, count: usize, waiting: usize, memory: &Resident) {
        let now = now_ms();
        if now - self.last_ms < PROGRESS_EVERY_MS {
            return;
        }
        let rate = (count.saturating_sub(self.last_count)) as f64 / seconds((now - self.last_ms).max(1));
        eprintln!(
            "backlog: {:>6.1}s {phase}: {count} ({rate:.0}/s), {waiting} waiting; resident MB: {}",
            seconds(now - self.started_ms),
            megabytes(memory),
        );
        self.last_ms = now;
        self.last_count = count;
    }

    fn restart(&mut self, count: usize) {
        self.last_ms = now_ms();
        self.last_count = count;
    }
}

pub async fn main() -> anyhow::Result<()> {
    let spec = Spec::from_env();
    let started_ms = now_ms();
    let base = test_config("backlog", &[])?;
    let exe = std::env::current_exe()?;
    let binaries = exe.parent().context("the binary's directory")?.to_path_buf();
    let work = std::env::temp_dir().join(format!("sluice-backlog-{}", base.kafka.topic_prefix));
    std::fs::create_dir_all(&work)?;
    eprintln!(
        "backlog: {} jobs over {} keys of limit {}, {} instances of each service: logs in {}",
        spec.jobs,
        spec.keys,
        spec.limit,
        spec.instances,
        work.display()
    );

    // `make bench`'s partitions and timers, so the drain compares with its
    // admitted jobs per second.
    let addresses = Addresses::start().await?;
    let config_file = work.join("sluice.toml");
    let mut config = ConfigFile::new(&base, base.postgres.url.expose(), &addresses);
    config
        .set("kafka.partitions", "requested", "4".to_string())
        .set("kafka.partitions", "admitted", "4".to_string())
        .set("kafka.partitions", "limit_commands", "8".to_string())
        .set("kafka.partitions", "jobs", "8".to_string())
        .set("postgres", "max_connections", "16".to_string())
        .set("admission", "resend_waiting_after", "\"60s\"".to_string())
        .set("admission", "claim_timeout", "\"120s\"".to_string())
        .set("admission", "stand_behind_interval", "\"20s\"".to_string())
        .set("limit_grant", "ticket_grace", "\"60s\"".to_string());
    if spec.single_batches {
        config.set(
            "kafka.producer_properties",
            "\"batch.num.messages\"",
            "\"1\"".to_string(),
        );
    }
    std::fs::write(&config_file, config.text())?;
    let mut cluster = Cluster::start(binaries, config_file.clone(), work.clone(), &addresses, spec.instances).await?;
    let client = AdmissionClient::new(connect(&addresses.admission.endpoint).await?);
    // Settled: every admission instance owns job partitions.
    let settled = async {
        loop {
            let listed = client
                .clone()
                .instances(pb::InstancesRequest {})
                .await
                .map_or(0, |response| response.into_inner().endpoints.len());
            if listed >= spec.instances {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    if tokio::time::timeout(Duration::from_secs(60), settled).await.is_err() {
        eprintln!("backlog: not every admission instance owns job partitions after 60s; going on");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let baseline = resident(&cluster);
    eprintln!("backlog: idle, resident MB: {}", megabytes(&baseline));
    let mut progress = Progress {
        started_ms,
        last_ms: now_ms(),
        last_count: 0,
    };

    // 1. The enqueue: each producer takes the next batch until none is left.
    let enqueue_started_ms = now_ms();
    let next = Arc::new(AtomicUsize::new(0));
    let enqueued = Arc::new(AtomicUsize::new(0));
    let retries = Arc::new(AtomicUsize::new(0));
    let unanswered = Arc::new(AtomicUsize::new(0));
    let spec = Arc::new(spec);
    let mut producers = Vec::new();
    for _ in 0..spec.producers {
        let (next, enqueued, spec, client) = (next.clone(), enqueued.clone(), spec.clone(), client.clone());
        let (retries, unanswered) = (retries.clone(), unanswered.clone());
        producers.push(tokio::spawn(async move {
            loop {
                let from = next.fetch_add(spec.batch, Ordering::Relaxed);
                if from >= spec.jobs {
                    return;
                }
                let jobs: Vec<pb::JobRequest> = (from..(from + spec.batch).min(spec.jobs))
                    .map(|job| spec.request(job))
                    .collect();
                let count = jobs.len();
                // The same batch again until it is answered: its jobs have
                // ids, so what was saved before an error is not saved twice.
                let mut failures = 0u32;
                loop {
                    let mut caller = client.clone();
                    let call = caller.enqueue_batch(pb::EnqueueBatchRequest { jobs: jobs.clone() });
                    // A call left unanswered is given up on and sent again.
                    let error = match tokio::time::timeout(CALL_TIMEOUT, call).await {
                        Ok(Ok(_)) => break,
                        Ok(Err(status)) => status.to_string(),
                        Err(_) => {
                            unanswered.fetch_add(1, Ordering::Relaxed);
                            format!("no answer within {CALL_TIMEOUT:?}")
                        }
                    };
                    failures += 1;
                    retries.fetch_add(1, Ordering::Relaxed);
                    if failures == 1 || failures.is_multiple_of(50) {
                        eprintln!("backlog: EnqueueBatch failed ({failures}x), again: {error}");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                enqueued.fetch_add(count, Ordering::Relaxed);
            }
        }));
    }
    let mut before_drain = baseline;
    while producers.iter().any(|producer| !producer.is_finished()) {
        tokio::time::sleep(TICK).await;
        let sample = resident(&cluster);
        peak(&mut before_drain, &sample);
        let count = enqueued.load(Ordering::Relaxed);
        progress.say("enqueued", count, count, &sample);
    }
    for producer in producers {
        producer.await?;
    }
    let enqueue_ms = (now_ms() - enqueue_started_ms).max(1);
    let enqueue_jobs_per_s = spec.jobs as f64 / seconds(enqueue_ms);
    eprintln!(
        "backlog: {} jobs enqueued in {:.1}s: {enqueue_jobs_per_s:.0} jobs/s",
        spec.jobs,
        seconds(enqueue_ms)
    );

    // 2. Until limit-grant holds every job (sampling memory meanwhile).
    let settle_until = now_ms() + i64::try_from(spec.settle.as_millis())?;
    let mut held = 0;
    loop {
        let sweep = tokio::spawn({
            let (address, spec) = (addresses.limit_grant.endpoint.clone(), spec.clone());
            async move { held_by_limit_grant(&address, &spec).await }
        });
        while !sweep.is_finished() {
            tokio::time::sleep(TICK).await;
            let sample = resident(&cluster);
            peak(&mut before_drain, &sample);
            progress.say("held by limit-grant", held, spec.jobs, &sample);
        }
        match sweep.await? {
            Ok(count) => held = usize::try_from(count)?,
            Err(error) => eprintln!("backlog: reading limit-grant's keys: {error:#}"),
        }
        if held >= spec.jobs {
            break;
        }
        if now_ms() > settle_until {
            eprintln!(
                "backlog: limit-grant holds {held} of {} jobs after {:?}; measuring anyway",
                spec.jobs, spec.settle
            );
            break;
        }
    }
    let sample = resident(&cluster);
    peak(&mut before_drain, &sample);
    eprintln!(
        "backlog: limit-grant holds {held} jobs; resident MB now: {}; at the peak: {}",
        megabytes(&sample),
        megabytes(&before_drain)
    );

    // 3. The drain, with the kill when `kill_at` jobs still wait.
    let mut pool = WorkerPool::new(
        exe,
        work.clone(),
        worker::Settings {
            kind: "stream".to_string(),
            worker_id: String::new(),
            log: PathBuf::new(),
            admission: addresses.admission.endpoint.clone(),
            config: config_file,
            abandon: 0.0,
            slots: spec.slots,
            instant: true,
        },
    );
    for slot in 0..spec.workers {
        pool.start(slot)?;
    }
    let mut tails: Vec<Tail> = pool.logs().into_iter().map(Tail::new).collect();
    let mut drained = Drained::new(spec.jobs);
    let drain_started_ms = now_ms();
    let deadline_ms = drain_started_ms + i64::try_from(spec.deadline.as_millis())?;
    progress.restart(0);
    let restarted = ["admission", "limit-grant"];
    let mut kill: Option<(i64, i64, usize)> = None;
    let mut after_restart = [0u64; SERVICES.len()];
    let mut probe: Option<tokio::task::JoinHandle<i64>> = None;
    let mut enqueue_again_ms: Option<i64> = None;
    let mut failures: Vec<String> = Vec::new();
    while drained.completed < spec.jobs {
        tokio::time::sleep(TICK).await;
        drained.read(&mut tails);
        let waiting = spec.jobs - drained.completed;
        let sample = resident(&cluster);
        if kill.is_some() {
            peak(&mut after_restart, &sample);
        }
        if probe.as_ref().is_some_and(tokio::task::JoinHandle::is_finished) {
            if let Some(answered) = probe.take() {
                enqueue_again_ms = Some(answered.await?);
            }
        }
        progress.say("completed", drained.completed, waiting, &sample);
        if kill.is_none() && spec.kill_at > 0 && waiting <= spec.kill_at {
            let victims: Vec<usize> = (0..cluster.instances.len())
                .filter(|index| restarted.contains(&cluster.instances[*index].service))
                .collect();
            eprintln!(
                "backlog: {waiting} jobs waiting: kill -9 every admission and limit-grant instance ({}), and start them again",
                victims.len()
            );
            let kill_ms = now_ms();
            cluster.restart(&victims, Duration::ZERO).await;
            let restart_ms = now_ms();
            // Every completion read so far came before the kill.
            drained.accepted_by = Some((kill_ms, drained.completed));
            drained.push_after = Some((restart_ms, None));
            kill = Some((kill_ms, restart_ms, waiting));
            probe = Some(tokio::spawn(first_enqueue_answered(
                addresses.admission.endpoint.clone(),
                spec.request(0),
            )));
        }
        if now_ms() > deadline_ms {
            failures.push(format!(
                "the drain did not finish within {:?}: {} of {} jobs completed",
                spec.deadline, drained.completed, spec.jobs
            ));
            break;
        }
    }
    if let Some(probe) = probe.take() {
        match tokio::time::timeout(Duration::from_secs(60), probe).await {
            Ok(answered) => enqueue_again_ms = Some(answered?),
            Err(_) => failures.push("Enqueue did not answer within 60s of the end after the kill".to_string()),
        }
    }
    let done_ms = now_ms();

    // 4. Exactly once: one ACCEPTED attempt per job, every job SUCCEEDED.
    let never: Vec<usize> = (0..spec.jobs).filter(|job| drained.accepted[*job] == 0).collect();
    if !never.is_empty() {
        describe_stuck(
            &client,
            &addresses.limit_grant.endpoint,
            &spec,
            &never[..never.len().min(5)],
        )
        .await;
        failures.push(format!(
            "{} jobs never completed (first: {:?})",
            never.len(),
            never.iter().take(10).map(|job| job_id(*job)).collect::<Vec<_>>()
        ));
    }
    if !drained.accepted_twice.is_empty() {
        failures.push(format!(
            "{} jobs completed twice (two attempts ACCEPTED; first: {:?})",
            drained.accepted_twice.len(),
            drained
                .accepted_twice
                .iter()
                .take(10)
                .map(|job| job_id(*job))
                .collect::<Vec<_>>()
        ));
    }
    if drained.unknown_jobs > 0 {
        failures.push(format!("{} log lines of jobs never enqueued", drained.unknown_jobs));
    }
    let pg = admin_pool(&base).await?;
    let mut stored = (0, 0);
    let jobs_i64 = i64::try_from(spec.jobs)?;
    // Outcome rows are written with the completion; a moment for the last.
    for _ in 0..30 {
        stored = stored_statuses(&base, &pg).await?;
        if stored == (jobs_i64, jobs_i64) {
            break;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    if stored != (jobs_i64, jobs_i64) {
        failures.push(format!(
            "admission's tables: {} jobs, {} SUCCEEDED (want {} of each)",
            stored.0, stored.1, spec.jobs
        ));
    }

    let first_push_ms = drained.first_push_ms.unwrap_or(drain_started_ms);
    let last_ms = drained.last_accept_ms.max(first_push_ms + 1);
    let overall = drained.completed as f64 / seconds(last_ms - first_push_ms);
    let (drain, kill_figures) = match kill {
        Some((kill_ms, restart_ms, waiting)) => {
            let before_kill = drained.accepted_by.map_or(0, |(_, count)| count);
            let first_push_after = drained.push_after.and_then(|(_, first)| first);
            if first_push_after.is_none() {
                failures.push("no job was pushed to a worker after the restart".to_string());
            }
            let after = (drained.completed - before_kill) as f64 / seconds((last_ms - kill_ms).max(1));
            (
                before_kill as f64 / seconds((kill_ms - first_push_ms).max(1)),
                serde_json::json!({
                    "waiting_at_kill": waiting,
                    "instances_killed": spec.instances * restarted.len(),
                    "restart_s": seconds(restart_ms - kill_ms),
                    "serve_again_s": first_push_after.map(|at| seconds(at - kill_ms)),
                    "enqueue_again_s": enqueue_again_ms.map(|at| seconds(at - kill_ms)),
                    "drain_after_restart_jobs_per_s": after.round(),
                    "resident_bytes_per_waiting_job_after_restart":
                        per_job(&after_restart, &baseline, waiting, &restarted),
                }),
            )
        }
        None => (overall, serde_json::json!({})),
    };
    let mut figures = serde_json::json!({
        "jobs": spec.jobs,
        "keys": spec.keys,
        "limit": spec.limit,
        "instances": spec.instances,
        "producers": spec.producers,
        "batch": spec.batch,
        "worker_processes": spec.workers,
        "slots": spec.slots,
        "single_message_batches": spec.single_batches,
        "enqueue_jobs_per_s": enqueue_jobs_per_s.round(),
        "enqueue_s": seconds(enqueue_ms),
        "enqueue_retries": retries.load(Ordering::Relaxed),
        "enqueue_calls_unanswered": unanswered.load(Ordering::Relaxed),
        "held_by_limit_grant": held,
        "drain_jobs_per_s": drain.round(),
        "drain_jobs_per_s_overall": overall.round(),
        "drain_s": seconds(last_ms - first_push_ms),
        "resident_bytes_per_waiting_job": per_job(&before_drain, &baseline, spec.jobs, &SERVICES),
        "resident_mb_idle": mb_map(&baseline),
        "resident_mb_peak": mb_map(&before_drain),
        "completed": drained.completed,
        "jobs_run_more_than_once": drained.starts.iter().filter(|starts| **starts > 1).count(),
        "handler_runs": drained.starts.iter().map(|starts| usize::from(*starts)).sum::<usize>(),
        "accepted_again": drained.accepted_again,
        "stale_completions": drained.stale,
        "max_attempts": spec.max_attempts,
        "elapsed_s": seconds(done_ms - started_ms),
        "failed": failures.clone(),
        "logs": work.to_string_lossy(),
    });
    if let (Some(figures), serde_json::Value::Object(kill)) = (figures.as_object_mut(), kill_figures) {
        figures.extend(kill);
    }

    for slot in 0..pool.slots() {
        pool.kill(slot, false).await;
    }
    for instance in &mut cluster.instances {
        Cluster::kill(instance).await;
    }
    if spec.clean && failures.is_empty() {
        cleanup(&base, &pg).await;
        for log in pool.logs() {
            let _ = std::fs::remove_file(log);
        }
    }
    println!("{figures}");
    if !failures.is_empty() {
        eprintln!("backlog: FAILED: {}", failures.join("; "));
        std::process::exit(1);
    }
    Ok(())
}

fn mb_map(resident: &Resident) -> serde_json::Value {
    SERVICES
        .iter()
        .zip(resident)
        .map(|(service, bytes)| ((*service).to_string(), ((*bytes as f64 / 1e5).round() / 10.0).into()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}
