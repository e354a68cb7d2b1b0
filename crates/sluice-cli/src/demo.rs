//! `sluice demo`: producers put jobs on a few keys through Kafka, workers
//! claim, run and complete them, and a live view shows each key: holders
//! against its max, waiting jobs, and jobs admitted per second.
//!
//! Producers send to `jobs.requested` (protobuf, or JSON with --json) at a
//! steady rate; each job names one concurrency key (`demo-1` ... `demo-N`)
//! with `--limit`. Workers share a consumer group on the admitted topic and
//! follow the worker protocol (claim, heartbeat on long jobs, complete). The
//! view polls each key's owner (`DescribeKey`) four times a second.

use std::collections::{HashSet, VecDeque};
use std::io::IsTerminal;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use prost::Message as _;
use rand::Rng;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Message, TopicPartitionList};
use serde::Serialize;
use sluice_common::auth::Channel;
use sluice_common::kafka::client_config;
use sluice_common::SluiceConfig;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;
use sluice_proto::v1::limits_client::LimitsClient;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::endpoints::{Endpoints, Service};
use crate::output::{self, OutputFormat, Render, Table};

#[derive(Debug, clap::Args)]
pub struct DemoArgs {
    /// How many keys the jobs spread over (demo-1 ... demo-N).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=50))]
    keys: u32,
    /// max_concurrency every job carries for its key.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..))]
    limit: u32,
    /// Jobs to produce in all; 0 produces until ctrl-c.
    #[arg(long, default_value_t = 90)]
    jobs: u64,
    /// Jobs produced per second, all producers together.
    #[arg(long, default_value_t = 20.0)]
    rate: f64,
    /// Producer tasks.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    producers: u32,
    /// Worker tasks, each reading its share of the admitted topic's partitions.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=16))]
    workers: u32,
    /// Jobs each worker runs at once.
    #[arg(long, default_value_t = 8)]
    worker_concurrency: usize,
    /// Each job works a random time between --min-work and --max-work.
    #[arg(long, default_value = "200ms", value_parser = parse_duration)]
    min_work: Duration,
    #[arg(long, default_value = "800ms", value_parser = parse_duration)]
    max_work: Duration,
    #[arg(long, default_value = "demo")]
    tenant: String,
    #[arg(long, default_value = "default")]
    task_group: String,
    /// Produce JSON requests (content-type: application/json) instead of protobuf.
    #[arg(long)]
    json: bool,
    /// Status lines instead of progress bars (the default when stderr is not
    /// a terminal).
    #[arg(long)]
    plain: bool,
    /// Give up when the jobs are not all done by then.
    #[arg(long, default_value = "10m", value_parser = parse_duration)]
    timeout: Duration,
}

fn parse_duration(text: &str) -> Result<Duration, String> {
    sluice_common::config::parse_duration(text)
}

/// What producers, workers and the view share about one key.
#[derive(Default)]
struct KeyStats {
    produced: AtomicU64,
    admitted: AtomicU64,
    done: AtomicU64,
    running: AtomicUsize,
    peak_running: AtomicUsize,
    /// When our jobs on this key were first delivered to a worker, for the
    /// admitted-per-second figure.
    admitted_at: Mutex<VecDeque<Instant>>,
}

struct Shared {
    run_id: String,
    keys: Vec<String>,
    stats: Vec<KeyStats>,
    seen: Mutex<HashSet<(String, u32)>>,
    produced: AtomicU64,
}

impl Shared {
    /// Jobs done, all keys together.
    fn done(&self) -> u64 {
        self.stats.iter().map(|stats| stats.done.load(Ordering::Relaxed)).sum()
    }

    fn key_index(&self, key: &str) -> Option<usize> {
        self.keys.iter().position(|name| name == key)
    }

    fn admitted_per_second(&self, index: usize, now: Instant, started: Instant) -> f64 {
        const WINDOW: Duration = Duration::from_secs(3);
        let mut times = self.stats[index]
            .admitted_at
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        while times.front().is_some_and(|at| now.duration_since(*at) > WINDOW) {
            times.pop_front();
        }
        let window = now.duration_since(started).min(WINDOW).as_secs_f64().max(0.25);
        #[allow(clippy::cast_precision_loss)]
        let count = times.len() as f64;
        count / window
    }
}

/// One key as the view last saw it.
#[derive(Clone, Debug, Default, Serialize)]
struct KeyView {
    key: String,
    holders: usize,
    max: i64,
    waiting: u32,
}

pub async fn run(
    config: &SluiceConfig,
    endpoints: &Endpoints,
    args: DemoArgs,
    format: OutputFormat,
) -> anyhow::Result<()> {
    anyhow::ensure!(args.min_work <= args.max_work, "--min-work must not exceed --max-work");
    anyhow::ensure!(args.rate > 0.0, "--rate must be greater than 0");
    anyhow::ensure!(args.worker_concurrency > 0, "--worker-concurrency must be at least 1");
    let run_id = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let shared = Arc::new(Shared {
        keys: (1..=args.keys).map(|index| format!("demo-{index}")).collect(),
        stats: (0..args.keys).map(|_| KeyStats::default()).collect(),
        seen: Mutex::new(HashSet::new()),
        produced: AtomicU64::new(0),
        run_id,
    });
    let admission = endpoints.admission()?;
    let mut limits = endpoints.limits()?;
    // Fail early and clearly when the stack is not there.
    for key in &shared.keys {
        describe(&mut limits.client, &args.tenant, key)
            .await
            .map_err(|status| limits.error(status))?;
    }

    let stop = CancellationToken::new();
    let mut tasks = JoinSet::new();
    start_workers(config, &args, &shared, admission.client.clone(), &stop, &mut tasks).await?;
    let started = Instant::now();
    start_producers(config, &args, &shared, &stop, &mut tasks)?;

    let live = Live::new(&args, &shared, format);
    let mut watched = Watched::new(shared.keys.len());
    let mut ticker = tokio::time::interval(Duration::from_millis(250));
    let deadline = started + args.timeout;
    let outcome: anyhow::Result<()> = loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = tokio::signal::ctrl_c() => break Ok(()),
            joined = tasks.join_next() => {
                if let Some(Ok(Err(error))) = joined {
                    break Err(error);
                }
                continue;
            }
        }
        if let Err(error) = watched.look(&mut limits, &args, &shared).await {
            break Err(error);
        }
        live.update(&shared, &watched.views, started);
        let done = shared.done();
        if args.jobs > 0 && done >= args.jobs {
            break Ok(());
        }
        if Instant::now() >= deadline {
            break Err(anyhow::anyhow!(
                "only {done} of {} jobs done within --timeout {:?}",
                args.jobs,
                args.timeout
            ));
        }
    };
    stop.cancel();
    watched.last_look(&mut limits, &args, &shared).await;
    live.update(&shared, &watched.views, started);
    live.finish();
    tasks.shutdown().await;
    outcome?;

    let summary = watched.summary(&shared, started);
    output::print(format, &summary)?;
    anyhow::ensure!(
        summary.overruns.is_empty(),
        "a key had more holders than its max: {}",
        summary.overruns.join("; ")
    );
    Ok(())
}

/// What the view has seen of the keys so far.
struct Watched {
    views: Vec<KeyView>,
    peak_holders: Vec<usize>,
    overruns: Vec<String>,
    /// Since when a key's owner has not answered.
    unanswered_since: Option<Instant>,
}

impl Watched {
    fn new(keys: usize) -> Self {
        Watched {
            views: vec![KeyView::default(); keys],
            peak_holders: vec![0; keys],
            overruns: Vec::new(),
            unanswered_since: None,
        }
    }

    /// Asks each key's owner for the key's state; an error once an owner
    /// has not answered for 30 s.
    async fn look(
        &mut self,
        limits: &mut Service<LimitsClient<Channel>>,
        args: &DemoArgs,
        shared: &Shared,
    ) -> anyhow::Result<()> {
        for (index, key) in shared.keys.iter().enumerate() {
            // A key's owner can be briefly away (a rebalance moving its
            // partition): keep the last view, give up only if it stays away.
            let state = match describe(&mut limits.client, &args.tenant, key).await {
                Ok(state) => {
                    self.unanswered_since = None;
                    state
                }
                Err(status) => {
                    let since = *self.unanswered_since.get_or_insert_with(Instant::now);
                    if since.elapsed() > Duration::from_secs(30) {
                        return Err(limits.error(status).into());
                    }
                    continue;
                }
            };
            let holders = state.holders.len();
            let max = state.effective_max.unwrap_or(i64::from(args.limit));
            self.peak_holders[index] = self.peak_holders[index].max(holders);
            if i64::try_from(holders).unwrap_or(i64::MAX) > max {
                self.overruns
                    .push(format!("{key}: {holders} holders against a max of {max}"));
            }
            self.views[index] = KeyView {
                key: key.clone(),
                holders,
                max,
                waiting: state.waiting,
            };
        }
        Ok(())
    }

    /// One last look, so the view ends on the keys' final state.
    async fn last_look(&mut self, limits: &mut Service<LimitsClient<Channel>>, args: &DemoArgs, shared: &Shared) {
        for (index, key) in shared.keys.iter().enumerate() {
            if let Ok(state) = describe(&mut limits.client, &args.tenant, key).await {
                self.views[index].holders = state.holders.len();
                self.views[index].waiting = state.waiting;
            }
        }
    }

    fn summary(self, shared: &Shared, started: Instant) -> Summary {
        Summary {
            run_id: shared.run_id.clone(),
            elapsed_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
            produced: shared.produced.load(Ordering::Relaxed),
            done: shared.done(),
            keys: shared
                .keys
                .iter()
                .enumerate()
                .map(|(index, key)| {
                    let stats = &shared.stats[index];
                    KeySummary {
                        key: key.clone(),
                        max: self.views[index].max,
                        produced: stats.produced.load(Ordering::Relaxed),
                        done: stats.done.load(Ordering::Relaxed),
                        peak_running: stats.peak_running.load(Ordering::Relaxed),
                        peak_holders: self.peak_holders[index],
                    }
                })
                .collect(),
            overruns: self.overruns,
        }
    }
}

async fn describe(limits: &mut LimitsClient<Channel>, tenant: &str, key: &str) -> Result<pb::KeyState, tonic::Status> {
    Ok(limits
        .describe_key(pb::DescribeKeyRequest {
            key: Some(pb::KeyRef {
                tenant: tenant.to_string(),
                key: key.to_string(),
            }),
            ticket: None,
            first_waiters: 1,
        })
        .await?
        .into_inner()
        .state
        .unwrap_or_default())
}

// ---------------------------------------------------------------------------
// Producers

#[derive(Serialize, serde::Deserialize)]
struct DemoPayload {
    key: String,
    work_ms: u64,
}

/// What every demo job's request carries besides its id, key and payload.
struct JobTemplate {
    tenant: String,
    task_group: String,
    limit: u32,
    json: bool,
}

impl JobTemplate {
    /// One job's request, encoded as JSON or protobuf, and its content type.
    fn encode(&self, job_id: &str, key: &str, payload: String) -> anyhow::Result<(Vec<u8>, &'static str)> {
        if self.json {
            let request = serde_json::json!({
                "job_id": job_id,
                "tenant": self.tenant,
                "task_group": self.task_group,
                "payload": payload,
                "limits": [{"concurrency": {"key": key, "max_concurrency": self.limit}}],
            });
            Ok((serde_json::to_vec(&request)?, "application/json"))
        } else {
            let request = pb::JobRequest {
                job_id: Some(job_id.to_string()),
                tenant: self.tenant.clone(),
                task_group: self.task_group.clone(),
                payload: payload.into_bytes(),
                limits: vec![pb::Limit {
                    kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                        key: key.to_string(),
                        max_concurrency: self.limit,
                        shadow: false,
                    })),
                }],
                ..Default::default()
            };
            Ok((request.encode_to_vec(), "application/x-protobuf"))
        }
    }
}

fn start_producers(
    config: &SluiceConfig,
    args: &DemoArgs,
    shared: &Arc<Shared>,
    stop: &CancellationToken,
    tasks: &mut JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let mut settings = client_config(&config.kafka);
    settings.set("linger.ms", "5");
    let producer: FutureProducer = settings.create().context("creating the Kafka producer")?;
    let topic = config.topic(&config.topics.requested);
    let next_job = Arc::new(AtomicU64::new(0));
    let interval = Duration::from_secs_f64(f64::from(args.producers) / args.rate);
    for _ in 0..args.producers {
        let producer = producer.clone();
        let topic = topic.clone();
        let shared = shared.clone();
        let stop = stop.clone();
        let next_job = next_job.clone();
        let total = args.jobs;
        let template = JobTemplate {
            tenant: args.tenant.clone(),
            task_group: args.task_group.clone(),
            limit: args.limit,
            json: args.json,
        };
        let (min_work, max_work) = (args.min_work, args.max_work);
        tasks.spawn(async move {
            let mut ticker = tokio::time::interval(interval);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return Ok(()),
                    _ = ticker.tick() => {}
                }
                let number = next_job.fetch_add(1, Ordering::Relaxed);
                if total > 0 && number >= total {
                    return Ok(());
                }
                let index = usize::try_from(number % shared.keys.len() as u64).unwrap_or_default();
                let key = shared.keys[index].clone();
                let work = if max_work > min_work {
                    rand::rng().random_range(min_work..=max_work)
                } else {
                    min_work
                };
                let job_id = format!("demo-{}-{number}", shared.run_id);
                let payload = serde_json::to_string(&DemoPayload {
                    key: key.clone(),
                    work_ms: u64::try_from(work.as_millis()).unwrap_or(u64::MAX),
                })?;
                let (body, content_type) = template.encode(&job_id, &key, payload)?;
                let headers = OwnedHeaders::new().insert(Header {
                    key: "content-type",
                    value: Some(content_type),
                });
                producer
                    .send(
                        FutureRecord::to(&topic).key(&job_id).payload(&body).headers(headers),
                        Duration::from_secs(10),
                    )
                    .await
                    .map_err(|(error, _)| anyhow::anyhow!("producing to {topic}: {error}"))?;
                shared.stats[index].produced.fetch_add(1, Ordering::Relaxed);
                shared.produced.fetch_add(1, Ordering::Relaxed);
            }
        });
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Workers

/// Start the workers. Each reads its share of the admitted topic's
/// partitions from the current end, assigned explicitly: no group
/// rebalance to wait for, and no job produced from now on can fall before a
/// worker's start (starting at a watermark read now, not at "latest"
/// resolved whenever the first fetch happens).
async fn start_workers(
    config: &SluiceConfig,
    args: &DemoArgs,
    shared: &Arc<Shared>,
    admission: AdmissionClient<Channel>,
    stop: &CancellationToken,
    tasks: &mut JoinSet<anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let topic = config.admitted_topic(&args.task_group);
    let mut settings = client_config(&config.kafka);
    settings
        .set("group.id", config.group(&format!("sluice-demo-{}", shared.run_id)))
        .set("enable.auto.commit", "false")
        .set("fetch.wait.max.ms", config.kafka.fetch_wait_max_ms.to_string());
    let probe: StreamConsumer = settings.create().context("creating a Kafka consumer")?;
    let partitions: Vec<i32> = probe
        .fetch_metadata(Some(&topic), Duration::from_secs(10))
        .with_context(|| format!("reading the metadata of {topic}"))?
        .topics()
        .first()
        .map(|metadata| metadata.partitions().iter().map(|partition| partition.id()).collect())
        .unwrap_or_default();
    anyhow::ensure!(
        !partitions.is_empty(),
        "topic {topic} does not exist: is task group {:?} declared?",
        args.task_group
    );
    let mut starts = Vec::with_capacity(partitions.len());
    for partition in &partitions {
        let (_, high) = probe
            .fetch_watermarks(&topic, *partition, Duration::from_secs(10))
            .with_context(|| format!("reading the end of {topic}/{partition}"))?;
        starts.push((*partition, high));
    }
    let workers = usize::try_from(args.workers).unwrap_or(1).min(partitions.len());
    for number in 0..workers {
        let mut assignment = TopicPartitionList::new();
        for (partition, start) in starts.iter().skip(number).step_by(workers) {
            assignment.add_partition_offset(&topic, *partition, rdkafka::Offset::Offset(*start))?;
        }
        let consumer: StreamConsumer = settings.create().context("creating a Kafka consumer")?;
        consumer.assign(&assignment)?;
        let worker = Worker {
            worker_id: format!("sluice-demo-{}-{number}", shared.run_id),
            admission: admission.clone(),
            shared: shared.clone(),
            slots: Arc::new(tokio::sync::Semaphore::new(args.worker_concurrency)),
        };
        let stop = stop.clone();
        tasks.spawn(async move { worker.run(Arc::new(consumer), stop).await });
    }
    Ok(())
}

#[derive(Clone)]
struct Worker {
    worker_id: String,
    admission: AdmissionClient<Channel>,
    shared: Arc<Shared>,
    slots: Arc<tokio::sync::Semaphore>,
}

impl Worker {
    async fn run(self, consumer: Arc<StreamConsumer>, stop: CancellationToken) -> anyhow::Result<()> {
        let ours = format!("demo-{}-", self.shared.run_id);
        let mut running = JoinSet::new();
        loop {
            // Fetch only with a free slot: a busy worker leaves jobs to others.
            let permit = tokio::select! {
                _ = stop.cancelled() => break,
                permit = self.slots.clone().acquire_owned() => permit?,
            };
            let message = tokio::select! {
                _ = stop.cancelled() => break,
                received = consumer.recv() => received?,
            };
            let admitted = pb::AdmittedJob::decode(message.payload().unwrap_or_default())?;
            if !admitted.job_id.starts_with(&ours) {
                continue;
            }
            let Ok(payload) = serde_json::from_slice::<DemoPayload>(&admitted.payload) else {
                continue;
            };
            let Some(index) = self.shared.key_index(&payload.key) else {
                continue;
            };
            let first_delivery = self
                .shared
                .seen
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .insert((admitted.job_id.clone(), admitted.attempt));
            if first_delivery {
                let stats = &self.shared.stats[index];
                stats.admitted.fetch_add(1, Ordering::Relaxed);
                stats
                    .admitted_at
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push_back(Instant::now());
            }
            let worker = self.clone();
            running.spawn(async move {
                let _permit = permit;
                if let Err(error) = worker.run_job(admitted, index, payload.work_ms).await {
                    tracing::warn!(%error, "demo job failed");
                }
            });
            while running.try_join_next().is_some() {}
        }
        running.shutdown().await;
        Ok(())
    }

    async fn run_job(&self, admitted: pb::AdmittedJob, index: usize, work_ms: u64) -> Result<(), tonic::Status> {
        let mut admission = self.admission.clone();
        let attempt = pb::JobAttempt {
            job_id: admitted.job_id.clone(),
            attempt: admitted.attempt,
        };
        let claim = admission
            .claim(pb::ClaimRequest {
                worker_id: self.worker_id.clone(),
                jobs: vec![attempt.clone()],
            })
            .await?
            .into_inner();
        let Some(result) = claim.results.first() else {
            return Ok(());
        };
        if result.outcome != pb::ClaimOutcome::Claimed as i32 {
            return Ok(());
        }
        let stats = &self.shared.stats[index];
        let now_running = stats.running.fetch_add(1, Ordering::SeqCst) + 1;
        stats.peak_running.fetch_max(now_running, Ordering::SeqCst);
        // Heartbeat every third of the lease while the job works.
        let heartbeat_every = Duration::from_millis((result.lease_ms / 3).max(100));
        let work_until = tokio::time::Instant::now() + Duration::from_millis(work_ms);
        loop {
            let now = tokio::time::Instant::now();
            if now >= work_until {
                break;
            }
            tokio::time::sleep((work_until - now).min(heartbeat_every)).await;
            if tokio::time::Instant::now() < work_until {
                admission
                    .heartbeat(pb::HeartbeatRequest {
                        worker_id: self.worker_id.clone(),
                        jobs: vec![attempt.clone()],
                        stream_ended: None,
                    })
                    .await?;
            }
        }
        stats.running.fetch_sub(1, Ordering::SeqCst);
        let completion = pb::CompleteRequest {
            worker_id: self.worker_id.clone(),
            completions: vec![pb::Completion {
                job_id: admitted.job_id,
                attempt: admitted.attempt,
                outcome: Some(pb::completion::Outcome::Success(pb::Success {})),
            }],
        };
        // Completing twice is harmless (ACCEPTED again), so retry while
        // admission is briefly unavailable.
        let mut delay = Duration::from_millis(100);
        loop {
            match admission.complete(completion.clone()).await {
                Ok(_) => break,
                Err(status) if status.code() == tonic::Code::Unavailable && delay < Duration::from_secs(5) => {
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(status) => return Err(status),
            }
        }
        stats.done.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

// ---------------------------------------------------------------------------
// The live view

enum Live {
    Bars {
        _multi: MultiProgress,
        keys: Vec<ProgressBar>,
        total: ProgressBar,
    },
    Lines {
        last_printed: Mutex<Option<Instant>>,
    },
    Quiet,
}

impl Live {
    fn new(args: &DemoArgs, shared: &Shared, format: OutputFormat) -> Live {
        if format == OutputFormat::Json {
            return Live::Quiet;
        }
        if args.plain || !std::io::stderr().is_terminal() {
            println!(
                "demo {}: {} jobs on {} keys (max {} each), {}/s from {} producers, {} workers x {}",
                shared.run_id,
                if args.jobs == 0 {
                    "endless".to_string()
                } else {
                    args.jobs.to_string()
                },
                args.keys,
                args.limit,
                args.rate,
                args.producers,
                args.workers,
                args.worker_concurrency
            );
            return Live::Lines {
                last_printed: Mutex::new(None),
            };
        }
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::stderr_with_hz(8));
        let key_style =
            ProgressStyle::with_template("{prefix:>8} [{bar:30.cyan/blue}] {pos:>2}/{len:<2} holders  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("█▉▊▋▌▍▎▏ ");
        let keys = shared
            .keys
            .iter()
            .map(|key| {
                multi.add(
                    ProgressBar::new(u64::from(args.limit))
                        .with_style(key_style.clone())
                        .with_prefix(key.clone()),
                )
            })
            .collect();
        let total_style =
            ProgressStyle::with_template("{prefix:>8} [{bar:30.green/white}] {pos}/{len} jobs done  {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("█▉▊▋▌▍▎▏ ");
        let total = multi.add(
            ProgressBar::new(args.jobs.max(1))
                .with_style(total_style)
                .with_prefix("all"),
        );
        Live::Bars {
            _multi: multi,
            keys,
            total,
        }
    }

    fn update(&self, shared: &Shared, views: &[KeyView], started: Instant) {
        let now = Instant::now();
        match self {
            Live::Quiet => {}
            Live::Bars { keys, total, .. } => {
                for (index, (bar, view)) in keys.iter().zip(views).enumerate() {
                    bar.set_length(u64::try_from(view.max.max(1)).unwrap_or(1));
                    bar.set_position(u64::try_from(view.holders).unwrap_or(0));
                    let stats = &shared.stats[index];
                    bar.set_message(format!(
                        "waiting {:>4}   admitted {:>5.1}/s   done {}",
                        view.waiting,
                        shared.admitted_per_second(index, now, started),
                        stats.done.load(Ordering::Relaxed)
                    ));
                }
                let done: u64 = shared
                    .stats
                    .iter()
                    .map(|stats| stats.done.load(Ordering::Relaxed))
                    .sum();
                if total.length() == Some(1) && done > 1 {
                    total.set_length(done);
                }
                total.set_position(done);
                total.set_message(format!(
                    "produced {}   {}",
                    shared.produced.load(Ordering::Relaxed),
                    output::short_duration(started.elapsed())
                ));
            }
            Live::Lines { last_printed } => {
                let mut last = last_printed.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                if last.is_some_and(|at| now.duration_since(at) < Duration::from_secs(1)) {
                    return;
                }
                *last = Some(now);
                for (index, view) in views.iter().enumerate() {
                    println!(
                        "{:>6.1}s  {:<8} holders {}/{}  waiting {}  admitted {:.1}/s  done {}",
                        started.elapsed().as_secs_f64(),
                        view.key,
                        view.holders,
                        view.max,
                        view.waiting,
                        shared.admitted_per_second(index, now, started),
                        shared.stats[index].done.load(Ordering::Relaxed)
                    );
                }
            }
        }
    }

    fn finish(&self) {
        if let Live::Bars { keys, total, .. } = self {
            for bar in keys {
                bar.finish();
            }
            total.finish();
        }
    }
}

// ---------------------------------------------------------------------------
// The summary

#[derive(Debug, Serialize)]
struct KeySummary {
    key: String,
    max: i64,
    produced: u64,
    done: u64,
    /// Jobs of this key running at once in the demo's workers, at most.
    peak_running: usize,
    /// Holders of the key its owner reported, at most.
    peak_holders: usize,
}

#[derive(Debug, Serialize)]
struct Summary {
    run_id: String,
    elapsed_ms: u64,
    produced: u64,
    done: u64,
    keys: Vec<KeySummary>,
    /// Times a key had more holders than its max (never, by design).
    overruns: Vec<String>,
}

impl Render for Summary {
    fn table(&self) -> String {
        let mut table = Table::new(&["KEY", "MAX", "PRODUCED", "DONE", "PEAK RUNNING", "PEAK HOLDERS"]);
        for key in &self.keys {
            table.row(vec![
                key.key.clone(),
                key.max.to_string(),
                key.produced.to_string(),
                key.done.to_string(),
                key.peak_running.to_string(),
                key.peak_holders.to_string(),
            ]);
        }
        let mut out = format!(
            "demo {}: {} of {} jobs done in {}\n",
            self.run_id,
            self.done,
            self.produced,
            output::short_duration(Duration::from_millis(self.elapsed_ms))
        );
        out.push_str(&table.render(0));
        if self.overruns.is_empty() {
            out.push_str("no key ever had more holders than its max\n");
        } else {
            for overrun in &self.overruns {
                out.push_str(&format!("OVERRUN {overrun}\n"));
            }
        }
        out
    }
}
