//! The worker: consumes `jobs.admitted.<task_group>` in a consumer group,
//! claims each admitted attempt before running it, heartbeats, completes,
//! and never sits on a job it cannot start.
//!
//! How a received job moves:
//!
//! 1. It waits in a small local queue (`prefetch`) for a slot: the worker's
//!    total `concurrency` and the per-process limit of its task type.
//! 2. With a slot it is claimed (claims of jobs that start together go in one
//!    `Claim` call). `CLAIMED` runs the handler; `TAKEN`/`STALE` drop it.
//! 3. Without a slot within `handoff_after`, it is handed off: forwarded
//!    unclaimed to a partition of the same topic that another worker of the
//!    group owns (up to `max_handoff_hops` times), else claimed and handed
//!    back with `Complete(hand_back)` so its tickets return and admission
//!    admits it again. A worker that owns every partition has nobody to hand
//!    off to and keeps the job until a slot frees.
//! 4. Running handlers are heartbeaten in batches, every third of the
//!    shortest lease among them. `CANCELLED` or `LEASE_LOST` cancels the
//!    handler's token, and so does a lease that passes by the worker's own
//!    count (from the claim, then from each answered heartbeat's sending)
//!    while heartbeats fail; a handler that does not return within
//!    `stop_grace` is dropped. A cancel is confirmed with `Complete`.
//! 5. The message's offset is stored once its fate is durable (claim
//!    answered, forward acknowledged, hand-back accepted), in offset order
//!    per partition, and auto-committed; nothing is committed past a message
//!    that is not done.
//!
//! Shutdown: stop fetching, hand back every queued job at once, let running
//! handlers finish within `shutdown_grace`, then stop and hand back the
//! rest, and commit the offsets.

mod handler;
mod kafka;
mod offsets;
mod refresh;
mod reported_text;
mod runner;
mod slots;
mod status;
mod stream;

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prost::Message as _;
use rdkafka::consumer::Consumer;
use rdkafka::message::Message as _;
use rdkafka::producer::FutureProducer;
use sluice_proto::v1 as pb;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

pub use handler::{Job, JobError, JobHandler, RefreshError, RefreshHandler, StopReason};

pub use status::{WorkerSnapshot, WorkerStatus};

use crate::error::{Error, Result};
use crate::grpc::{Admission, Refresh};
use crate::options::ClientOptions;
use crate::propagation::TraceContext;
use kafka::{AssignmentContext, PartitionCounts, Received, WorkerConsumer};
use offsets::{OffsetTracker, PartitionId};
use runner::{Delivery, Event, Shared};
use slots::LocalLimits;
use status::Counters;

/// Header a forwarding worker sets: how many times the message was forwarded.
pub const HANDOFF_HOPS_HEADER: &str = "sluice-handoff-hops";

/// Names the task type of an admitted job, for per-process limits.
pub type TaskTypeFn = Arc<dyn Fn(&pb::AdmittedJob) -> String + Send + Sync>;

/// Builds a [`Worker`].
pub struct WorkerBuilder {
    options: ClientOptions,
    handler: Arc<dyn JobHandler>,
    task_groups: Vec<String>,
    worker_id: Option<String>,
    concurrency: usize,
    prefetch: Option<usize>,
    process_limits: HashMap<String, usize>,
    task_type: TaskTypeFn,
    handoff_after: Duration,
    max_handoff_hops: u32,
    heartbeat_interval: Option<Duration>,
    stop_grace: Duration,
    shutdown_grace: Duration,
    refresh_handler: Option<Arc<dyn RefreshHandler>>,
    refresh_concurrency: usize,
    pause_when_full_for: Duration,
    transport: Transport,
}

/// How a worker receives admitted jobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Transport {
    /// `Work` streams to every admission instance: admission pushes jobs
    /// already claimed for this worker, as it has free slots (no Kafka, no
    /// `Claim`; the lowest latency). Prefetch, hand-off and per-process
    /// limits do not apply: the worker only ever receives what it can run.
    Stream,
    /// The `jobs.admitted.<group>` topics in a consumer group, each job
    /// claimed before it runs (see the module docs).
    Kafka,
}

impl WorkerBuilder {
    /// How jobs reach this worker (default [`Transport::Kafka`]).
    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// The task groups whose admitted jobs this worker runs (at least one).
    pub fn task_group(mut self, task_group: impl Into<String>) -> Self {
        self.task_groups.push(task_group.into());
        self
    }

    /// The id this worker claims under (default: host name, process id and a
    /// random suffix). Unique per process.
    pub fn worker_id(mut self, worker_id: impl Into<String>) -> Self {
        self.worker_id = Some(worker_id.into());
        self
    }

    /// Handlers running at once in this process (default 10).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = concurrency.max(1);
        self
    }

    /// Received jobs waiting locally for a slot, at most (default: the
    /// concurrency). Small on purpose: what waits here is not available to
    /// other workers until it is handed off.
    pub fn prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = Some(prefetch.max(1));
        self
    }

    /// At most `limit` handlers of `task_type` at once in this process.
    pub fn process_limit(mut self, task_type: impl Into<String>, limit: usize) -> Self {
        self.process_limits.insert(task_type.into(), limit);
        self
    }

    /// How a job's task type is named (default: its task group). E.g. a
    /// handler registry that dispatches on a name in the payload returns that
    /// name, so `process_limit("thumbnail", 2)` limits one kind of job.
    /// Called once per received job on the worker's dispatch task: keep it
    /// cheap (no I/O).
    pub fn task_type(mut self, task_type: impl Fn(&pb::AdmittedJob) -> String + Send + Sync + 'static) -> Self {
        self.task_type = Arc::new(task_type);
        self
    }

    /// A received job that could not start within this time is handed off
    /// (default 500 ms).
    pub fn handoff_after(mut self, after: Duration) -> Self {
        self.handoff_after = after;
        self
    }

    /// How many times one admission of a job may be forwarded between
    /// workers before it is handed back to admission instead (default 2).
    pub fn max_handoff_hops(mut self, hops: u32) -> Self {
        self.max_handoff_hops = hops;
        self
    }

    /// Heartbeat this often (default: a third of the shortest lease among
    /// running jobs).
    pub fn heartbeat_interval(mut self, interval: Duration) -> Self {
        self.heartbeat_interval = Some(interval);
        self
    }

    /// After its token is cancelled (cancel, lost lease), a handler has this
    /// long to return before it is dropped (default 5 s).
    pub fn stop_grace(mut self, grace: Duration) -> Self {
        self.stop_grace = grace;
        self
    }

    /// On shutdown, running handlers have this long to finish before they are
    /// stopped and their jobs handed back (default 30 s).
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// Also compute floating-limit refreshes: consume `refresh.tasks` (group
    /// `<group_id>.refresh`) and report with `Refresh.ReportRefresh`.
    pub fn refresh_handler(mut self, handler: impl RefreshHandler) -> Self {
        self.refresh_handler = Some(Arc::new(handler));
        self
    }

    /// A local queue full this long pauses the partitions and keeps polling,
    /// so the consumer stays in its group however long the jobs run
    /// (default 30 s, well within librdkafka's `max.poll.interval.ms` of 5
    /// minutes). Shorter stops only stop reading: resuming a paused partition
    /// costs a fetch round.
    pub fn pause_when_full_for(mut self, after: Duration) -> Self {
        self.pause_when_full_for = after;
        self
    }

    /// Refresh tasks handled at once (default 4).
    pub fn refresh_concurrency(mut self, concurrency: usize) -> Self {
        self.refresh_concurrency = concurrency.max(1);
        self
    }

    pub fn build(self) -> Result<Worker> {
        if self.task_groups.is_empty() {
            return Err(Error::Config {
                field: "task_groups",
                message: "name at least one task group".to_string(),
            });
        }
        if self.transport == Transport::Kafka && self.options.brokers.trim().is_empty() {
            return Err(Error::Config {
                field: "brokers",
                message: "a worker needs Kafka brokers".to_string(),
            });
        }
        let admission = Admission::new(&self.options.admission_endpoint, &self.options)?;
        let refresh = match &self.refresh_handler {
            Some(_) => Some(Refresh::new(&self.options.refresh_endpoint, &self.options)?),
            None => None,
        };
        let worker_id = self.worker_id.unwrap_or_else(default_worker_id);
        Ok(Worker {
            prefetch: self.prefetch.unwrap_or(self.concurrency),
            options: self.options,
            handler: self.handler,
            task_groups: self.task_groups,
            worker_id,
            concurrency: self.concurrency,
            process_limits: self.process_limits,
            task_type: self.task_type,
            handoff_after: self.handoff_after,
            max_handoff_hops: self.max_handoff_hops,
            heartbeat_interval: self.heartbeat_interval,
            stop_grace: self.stop_grace,
            shutdown_grace: self.shutdown_grace,
            refresh_handler: self.refresh_handler,
            refresh_concurrency: self.refresh_concurrency,
            pause_when_full_for: self.pause_when_full_for,
            transport: self.transport,
            admission,
            refresh,
            status: WorkerStatus::default(),
        })
    }
}

fn default_worker_id() -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "worker".to_string());
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    format!("{host}-{}-{}", std::process::id(), &suffix[..8])
}

/// A configured worker; [`Worker::run`] runs it.
pub struct Worker {
    options: ClientOptions,
    handler: Arc<dyn JobHandler>,
    task_groups: Vec<String>,
    worker_id: String,
    concurrency: usize,
    prefetch: usize,
    process_limits: HashMap<String, usize>,
    task_type: TaskTypeFn,
    handoff_after: Duration,
    max_handoff_hops: u32,
    heartbeat_interval: Option<Duration>,
    stop_grace: Duration,
    shutdown_grace: Duration,
    refresh_handler: Option<Arc<dyn RefreshHandler>>,
    refresh_concurrency: usize,
    pause_when_full_for: Duration,
    transport: Transport,
    admission: Admission,
    refresh: Option<Refresh>,
    status: WorkerStatus,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Worker")
            .field("worker_id", &self.worker_id)
            .field("task_groups", &self.task_groups)
            .field("concurrency", &self.concurrency)
            .field("process_limits", &self.process_limits)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// A worker running `handler` for admitted jobs; name the task groups and
    /// limits on the builder.
    pub fn builder(options: ClientOptions, handler: impl JobHandler) -> WorkerBuilder {
        WorkerBuilder {
            options,
            handler: Arc::new(handler),
            task_groups: Vec::new(),
            worker_id: None,
            concurrency: 10,
            prefetch: None,
            process_limits: HashMap::new(),
            task_type: Arc::new(|job: &pb::AdmittedJob| job.task_group.clone()),
            handoff_after: Duration::from_millis(500),
            max_handoff_hops: 2,
            heartbeat_interval: None,
            stop_grace: Duration::from_secs(5),
            shutdown_grace: Duration::from_secs(30),
            refresh_handler: None,
            refresh_concurrency: 4,
            pause_when_full_for: Duration::from_secs(30),
            transport: Transport::Kafka,
        }
    }

    pub fn worker_id(&self) -> &str {
        &self.worker_id
    }

    /// A handle on this worker's state, usable while it runs.
    pub fn status(&self) -> WorkerStatus {
        self.status.clone()
    }

    /// Run until `shutdown` is cancelled, then drain (see the module docs)
    /// and return. Errors only when the worker cannot start (Kafka client
    /// creation, subscription).
    pub async fn run(self, shutdown: CancellationToken) -> Result<()> {
        if self.transport == Transport::Stream {
            return self.run_on_streams(shutdown).await;
        }
        let topics: Vec<String> = self
            .task_groups
            .iter()
            .map(|group| self.options.admitted_topic(group))
            .collect();
        let assigned: Arc<Mutex<BTreeSet<(String, i32)>>> = Arc::new(Mutex::new(Default::default()));
        let consumer = Arc::new(self.subscribe(&topics, assigned.clone())?);
        let forwarder = self.forwarder(&topics)?;

        let background = CancellationToken::new();
        let partition_counts = PartitionCounts::default();
        let metadata_task = tokio::spawn({
            let (counts, consumer) = (partition_counts.clone(), consumer.clone());
            let (topics, stop) = (topics.clone(), background.clone());
            async move { counts.keep_fresh(consumer, topics, Duration::from_secs(15), stop).await }
        });

        let refresh_task = self.spawn_refresh(&shutdown);

        let (events_sender, events) = mpsc::channel(self.concurrency * 4 + self.prefetch * 4 + 16);
        let (completions_sender, completions) = mpsc::channel(self.concurrency * 2 + self.prefetch + 16);
        let force_stop = CancellationToken::new();
        let give_up = CancellationToken::new();
        let shared = Arc::new(Shared {
            worker_id: self.worker_id.clone(),
            admission: self.admission.clone(),
            handler: self.handler.clone(),
            registry: runner::Registry::default(),
            completions: completions_sender,
            events: events_sender,
            stop_grace: self.stop_grace,
            force_stop: force_stop.clone(),
            give_up: give_up.clone(),
            status: self.status.shared.clone(),
            forwarder,
            assigned: assigned.clone(),
            partition_counts,
            forward_turn: Default::default(),
        });
        let completer = tokio::spawn(runner::run_completer(shared.clone(), completions, background.clone()));
        let heartbeats = tokio::spawn(runner::run_heartbeats(
            shared.clone(),
            self.heartbeat_interval,
            background.clone(),
        ));

        let mirror = self.spawn_status_mirror(assigned, background.clone());

        let mut dispatcher = self.dispatcher(shared.clone(), consumer.clone(), events, &topics);
        dispatcher
            .run(&shutdown, self.shutdown_grace, &force_stop, &give_up)
            .await;

        // Every handler has ended and every completion was answered (or given
        // up): stop the helpers and commit what is done.
        background.cancel();
        drop(dispatcher);
        let _ = completer.await;
        let _ = heartbeats.await;
        let _ = metadata_task.await;
        let _ = mirror.await;
        // The forwarding producer joins its polling thread when dropped: drop
        // it off the runtime.
        if let Ok(last) = Arc::try_unwrap(shared) {
            let _ = tokio::task::spawn_blocking(move || drop(last)).await;
        }
        join_refresh(refresh_task).await;
        final_commit(consumer).await;
        tracing::info!(worker_id = %self.worker_id, "worker stopped");
        Ok(())
    }
}

impl Worker {
    /// The consumer of the admitted topics, subscribed; its rebalance
    /// callbacks keep `assigned` current.
    fn subscribe(&self, topics: &[String], assigned: Arc<Mutex<BTreeSet<(String, i32)>>>) -> Result<WorkerConsumer> {
        let context = AssignmentContext { assigned };
        let consumer: WorkerConsumer = self
            .options
            .consumer_config(&self.options.worker_group())
            .create_with_context(context)
            .map_err(|source| Error::Kafka {
                operation: "create consumer",
                topic: topics.join(","),
                source,
            })?;
        let topic_names: Vec<&str> = topics.iter().map(String::as_str).collect();
        consumer.subscribe(&topic_names).map_err(|source| Error::Kafka {
            operation: "subscribe",
            topic: topics.join(","),
            source,
        })?;
        Ok(consumer)
    }

    /// The producer that hands jobs off to other workers.
    fn forwarder(&self, topics: &[String]) -> Result<FutureProducer> {
        // Forwards need no idempotence (a duplicate is dropped by its claim),
        // which spares the first forward a producer-id round trip.
        let mut forward_config = self.options.kafka_config();
        forward_config
            .set("enable.idempotence", "false")
            .set("acks", "all")
            .set("linger.ms", "0");
        forward_config.create().map_err(|source| Error::Kafka {
            operation: "create producer",
            topic: topics.join(","),
            source,
        })
    }

    /// Copies the consumer's assignment to the status handle until `stop`.
    fn spawn_status_mirror(
        &self,
        assigned: Arc<Mutex<BTreeSet<(String, i32)>>>,
        stop: CancellationToken,
    ) -> tokio::task::JoinHandle<()> {
        {
            let mut status_assigned = self
                .status
                .shared
                .assigned
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            status_assigned.clear();
        }
        let status_assigned = self.status.shared.clone();
        tokio::spawn(async move {
            // The status handle mirrors the consumer's assignment.
            loop {
                let current = assigned.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
                *status_assigned
                    .assigned
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner()) = current;
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
            }
        })
    }

    fn dispatcher(
        &self,
        shared: Arc<Shared>,
        consumer: Arc<WorkerConsumer>,
        events: mpsc::Receiver<Event>,
        topics: &[String],
    ) -> Dispatcher {
        Dispatcher {
            shared,
            consumer,
            events,
            pending: VecDeque::new(),
            limits: LocalLimits::new(self.concurrency, self.process_limits.clone()),
            offsets: OffsetTracker::default(),
            prefetch: self.prefetch,
            handoff_after: self.handoff_after,
            max_handoff_hops: self.max_handoff_hops,
            task_type: self.task_type.clone(),
            topics: topics.iter().map(|topic| Arc::from(topic.as_str())).collect(),
            paused: None,
            pause_when_full_for: self.pause_when_full_for,
        }
    }
}

async fn join_refresh(task: Option<tokio::task::JoinHandle<()>>) {
    if let Some(task) = task {
        if let Err(join_error) = task.await {
            tracing::warn!(%join_error, "refresh consumer task failed");
        }
    }
}

/// Commits the offsets of what is done, off the runtime (a sync commit
/// blocks), and drops the consumer there too.
async fn final_commit(consumer: Arc<WorkerConsumer>) {
    let final_commit = tokio::task::spawn_blocking(move || {
        match consumer.commit_consumer_state(rdkafka::consumer::CommitMode::Sync) {
            Ok(()) => {}
            // Nothing stored since the last auto-commit.
            Err(rdkafka::error::KafkaError::ConsumerCommit(rdkafka::types::RDKafkaErrorCode::NoOffset)) => {}
            Err(error) => tracing::warn!(%error, "final offset commit failed"),
        }
        drop(consumer);
    })
    .await;
    if let Err(join_error) = final_commit {
        tracing::warn!(%join_error, "final commit task failed");
    }
}

impl Worker {
    /// The floating-limit refresh consumer, when a refresh handler is set
    /// (either transport).
    fn spawn_refresh(&self, shutdown: &CancellationToken) -> Option<tokio::task::JoinHandle<()>> {
        let (Some(handler), Some(refresh)) = (self.refresh_handler.clone(), self.refresh.clone()) else {
            return None;
        };
        Some(tokio::spawn(refresh::run_refresh_consumer(
            refresh::RefreshSettings {
                options: self.options.clone(),
                handler,
                refresh,
                concurrency: self.refresh_concurrency,
                shutdown_grace: self.shutdown_grace,
                status: self.status.shared.clone(),
            },
            shutdown.clone(),
        )))
    }

    /// [`Transport::Stream`]: jobs pushed on `Work` streams (`stream`).
    async fn run_on_streams(self, shutdown: CancellationToken) -> Result<()> {
        let refresh_task = self.spawn_refresh(&shutdown);
        stream::run(
            stream::StreamSettings {
                worker_id: self.worker_id.clone(),
                task_groups: self.task_groups.clone(),
                concurrency: self.concurrency,
                seed_endpoint: self.admission.endpoint.clone(),
                dial: self.options.dial()?,
                request_timeout: self.options.request_timeout,
                handler: self.handler.clone(),
                heartbeat_interval: self.heartbeat_interval,
                stop_grace: self.stop_grace,
                shutdown_grace: self.shutdown_grace,
                status: self.status.shared.clone(),
            },
            shutdown,
        )
        .await;
        join_refresh(refresh_task).await;
        Ok(())
    }
}

/// The single task that owns the local queue, the slots and the offsets.
struct Dispatcher {
    shared: Arc<Shared>,
    consumer: Arc<WorkerConsumer>,
    events: mpsc::Receiver<Event>,
    pending: VecDeque<Delivery>,
    limits: LocalLimits,
    offsets: OffsetTracker,
    prefetch: usize,
    handoff_after: Duration,
    max_handoff_hops: u32,
    task_type: TaskTypeFn,
    topics: Vec<Arc<str>>,
    /// The partitions paused because the local queue is full (or draining).
    paused: Option<BTreeSet<(String, i32)>>,
    pause_when_full_for: Duration,
}

impl Dispatcher {
    async fn run(
        &mut self,
        shutdown: &CancellationToken,
        shutdown_grace: Duration,
        force_stop: &CancellationToken,
        give_up: &CancellationToken,
    ) {
        let mut draining = false;
        let mut grace_ends: Option<Instant> = None;
        let mut give_up_at: Option<Instant> = None;
        let mut full_since: Option<Instant> = None;
        loop {
            if !draining {
                self.start_what_fits();
                self.hand_off_expired(Instant::now());
            }
            self.publish_gauges();
            if draining && self.pending.is_empty() && self.limits.total_used() == 0 && self.offsets.in_flight() == 0 {
                return;
            }
            // A full queue stops reading. Should it stay full for long, the
            // partitions are paused and polling goes on, so the consumer stays
            // in its group (max.poll.interval.ms); a resume restarts fetching
            // from the next unread message. Short stops skip the pause, whose
            // resume costs a fetch backoff. Draining pauses at once.
            let full = !draining && self.pending.len() >= self.prefetch;
            if !full {
                full_since = None;
            } else if full_since.is_none() {
                full_since = Some(Instant::now());
            }
            let pause_at = full_since.map(|since| since + self.pause_when_full_for);
            let long_full = pause_at.is_some_and(|at| at <= Instant::now());
            self.pause_while(draining || long_full);
            let poll = !full || self.paused.is_some();
            let next_handoff = self.pending.iter().map(|delivery| delivery.handoff_at).min();
            let grace_timer = grace_ends.filter(|_| !force_stop.is_cancelled());
            let give_up_timer = give_up_at.filter(|_| !give_up.is_cancelled());
            tokio::select! {
                biased;
                _ = shutdown.cancelled(), if !draining => {
                    draining = true;
                    let (grace_end, give_up_time) = self.start_draining(shutdown_grace);
                    grace_ends = Some(grace_end);
                    give_up_at = Some(give_up_time);
                }
                Some(event) = self.events.recv() => self.apply(event),
                _ = sleep_until_opt(grace_timer), if grace_timer.is_some() => {
                    tracing::info!(running = self.limits.total_used(), "shutdown grace over, stopping running handlers");
                    force_stop.cancel();
                }
                _ = sleep_until_opt(give_up_timer), if give_up_timer.is_some() => {
                    tracing::warn!("giving up on unanswered claims and completions");
                    give_up.cancel();
                }
                received = self.consumer.recv(), if poll => match received {
                    // Read before a pause took effect, or from a partition
                    // assigned while draining: not tracked, so delivered again
                    // after a restart.
                    Ok(_) if draining => {}
                    Ok(message) => {
                        let received = Received::from_message(&message, self.topic_name(message.topic()));
                        drop(message);
                        self.accept_polled(received);
                    }
                    Err(error) => {
                        tracing::warn!(%error, "kafka receive failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
                _ = sleep_until_opt(next_handoff), if next_handoff.is_some() && !draining => {}
                _ = sleep_until_opt(pause_at), if pause_at.is_some() && !long_full => {}
            }
        }
    }

    /// Shutdown: hands the queued jobs back; returns when the grace ends
    /// and when unanswered RPCs are given up.
    fn start_draining(&mut self, shutdown_grace: Duration) -> (Instant, Instant) {
        let now = Instant::now();
        tracing::info!(
            queued = self.pending.len(),
            running = self.limits.total_used(),
            "worker draining"
        );
        let queued: Vec<Delivery> = self.pending.drain(..).collect();
        if !queued.is_empty() {
            tokio::spawn(runner::hand_back(self.shared.clone(), queued, "worker shutting down"));
        }
        // RPCs still failing this long after the grace are given up:
        // their messages are delivered again after a restart.
        (now + shutdown_grace, now + shutdown_grace + Duration::from_secs(15))
    }

    /// The shared name of a topic we read (one allocation per topic, not per message).
    fn topic_name(&self, name: &str) -> Arc<str> {
        self.topics
            .iter()
            .find(|topic| topic.as_ref() == name)
            .cloned()
            .unwrap_or_else(|| Arc::from(name))
    }

    /// Accepts a polled message.
    fn accept_polled(&mut self, received: Received) {
        self.accept(received);
        if self.pending.len() > self.prefetch {
            // A partition the pause missed (e.g. assigned
            // again by a rebalance): pause everything again.
            self.paused = None;
        }
    }

    /// Pause every assigned partition while `full`, resume when not.
    fn pause_while(&mut self, full: bool) {
        let assigned = self
            .shared
            .assigned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        if full {
            if self.paused.as_ref() == Some(&assigned) {
                return;
            }
            if let Err(error) = self.consumer.pause(&partition_list(&assigned)) {
                tracing::warn!(%error, "pausing partitions failed");
            }
            Counters::add(&self.shared.status.counters.pauses);
            self.paused = Some(assigned);
        } else if self.paused.take().is_some() {
            if let Err(error) = self.consumer.resume(&partition_list(&assigned)) {
                tracing::warn!(%error, "resuming partitions failed");
            }
        }
    }

    fn accept(&mut self, received: Received) {
        Counters::add(&self.shared.status.counters.delivered);
        self.offsets.begin(&received.partition, received.offset);
        let admitted = match pb::AdmittedJob::decode(received.payload.as_slice()) {
            Ok(admitted) if !admitted.job_id.is_empty() => admitted,
            Ok(_) | Err(_) => {
                Counters::add(&self.shared.status.counters.malformed);
                tracing::error!(
                    topic = %received.partition.0,
                    partition = received.partition.1,
                    offset = received.offset,
                    "skipping a message that is not an AdmittedJob"
                );
                self.done(&received.partition, received.offset);
                return;
            }
        };
        let queued_already = self
            .pending
            .iter()
            .find(|queued| queued.admitted.job_id == admitted.job_id && queued.admitted.attempt == admitted.attempt);
        if let Some(queued) = queued_already {
            // Admission re-sent an attempt nobody claimed within its claim
            // timeout, or a rebalance delivered the message again, while it
            // waits here for a slot: keep it once, in its place in the queue.
            let same_message =
                queued.received.partition == received.partition && queued.received.offset == received.offset;
            tracing::debug!(
                job_id = %admitted.job_id,
                attempt = admitted.attempt,
                same_message,
                "a job already queued here came again: kept once"
            );
            Counters::add(&self.shared.status.counters.duplicates);
            if !same_message {
                self.done(&received.partition, received.offset);
            }
            return;
        }
        if self
            .shared
            .registry
            .contains(&(admitted.job_id.clone(), admitted.attempt))
        {
            // A copy of an attempt this worker runs (admission re-sent it
            // before the claim reached it): claiming it would only be
            // answered "claimed already", after waiting for a slot.
            tracing::debug!(
                job_id = %admitted.job_id,
                attempt = admitted.attempt,
                "a job running here came again: the copy is dropped"
            );
            Counters::add(&self.shared.status.counters.duplicates);
            self.done(&received.partition, received.offset);
            return;
        }
        let hops = received
            .header_text(HANDOFF_HOPS_HEADER)
            .and_then(|text| text.parse().ok())
            .unwrap_or(0);
        let task_type: Arc<str> = Arc::from((self.task_type)(&admitted).as_str());
        let trace = TraceContext::from_pairs(&received.headers);
        let now = Instant::now();
        self.pending.push_back(Delivery {
            admitted: Arc::new(admitted),
            task_type,
            trace,
            hops,
            handoff_at: now + self.handoff_after,
            received,
        });
    }

    /// Start every queued job that has a slot, in arrival order; one claim
    /// call for all of them.
    fn start_what_fits(&mut self) {
        let mut starting = Vec::new();
        let mut index = 0;
        while index < self.pending.len() {
            let fits = self
                .pending
                .get(index)
                .is_some_and(|delivery| self.limits.try_take(&delivery.task_type));
            if fits {
                if let Some(delivery) = self.pending.remove(index) {
                    starting.push(delivery);
                }
            } else {
                index += 1;
            }
        }
        if !starting.is_empty() {
            tokio::spawn(runner::claim_and_run(self.shared.clone(), starting));
        }
    }

    /// Jobs that waited `handoff_after` without a slot go to another worker.
    fn hand_off_expired(&mut self, now: Instant) {
        let mut forward = Vec::new();
        let mut give_back = Vec::new();
        let mut index = 0;
        while index < self.pending.len() {
            let expired = self
                .pending
                .get(index)
                .is_some_and(|delivery| delivery.handoff_at <= now);
            if !expired {
                index += 1;
                continue;
            }
            let Some(delivery) = self.pending.get_mut(index) else {
                break;
            };
            match self.shared.forward_target(&delivery.received.partition.0) {
                // Nobody else consumes this topic: nobody else could run it.
                None => {
                    delivery.handoff_at = now + self.handoff_after;
                    index += 1;
                }
                Some(target) => {
                    if let Some(delivery) = self.pending.remove(index) {
                        if delivery.hops < self.max_handoff_hops {
                            forward.push((delivery, target));
                        } else {
                            give_back.push(delivery);
                        }
                    }
                }
            }
        }
        if !forward.is_empty() {
            tokio::spawn(runner::forward(self.shared.clone(), forward));
        }
        if !give_back.is_empty() {
            tokio::spawn(runner::hand_back(
                self.shared.clone(),
                give_back,
                "no worker had room to start it",
            ));
        }
    }

    fn apply(&mut self, event: Event) {
        match event {
            Event::Done { partition, offset } => self.done(&partition, offset),
            Event::Abandoned { partition, offset } => self.offsets.abandon(&partition, offset),
            Event::SlotFree { task_type } => self.limits.give_back(&task_type),
        }
    }

    fn done(&mut self, partition: &PartitionId, offset: i64) {
        if let Some(position) = self.offsets.finish(partition, offset) {
            kafka::store_position(&self.consumer, partition, position);
        }
    }

    fn publish_gauges(&self) {
        let mut gauges = self
            .shared
            .status
            .gauges
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        gauges.pending = self.pending.len();
        gauges.running = self.limits.total_used();
        gauges.running_by_type = self.limits.used_by_type();
    }
}

fn partition_list(partitions: &BTreeSet<(String, i32)>) -> rdkafka::TopicPartitionList {
    let mut list = rdkafka::TopicPartitionList::new();
    for (topic, partition) in partitions {
        list.add_partition(topic, *partition);
    }
    list
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}
