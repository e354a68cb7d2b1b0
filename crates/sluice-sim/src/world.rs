//! The simulated cluster: events on one clock, in one thread, from one
//! seed.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::Arc;

use prost::Message;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_admission::chain;
use sluice_admission::partition::{Incoming, Local, OnConflict};
use sluice_common::core::Ask;
use sluice_common::link::Link;
use sluice_common::partition::{job_partition, key_partition};
use sluice_common::SluiceConfig;
use sluice_limit_grant::core::{LimitAnswer, LimitQuery};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::checks::Checks;
use crate::model::{BatchEnd, ServiceModel};
use crate::services::{Admission, LimitGrant};
use crate::workers::{WorkerEvent, Workers};

/// Epoch milliseconds at simulated time 0.
pub const BASE_MS: i64 = 1_800_000_000_000;

/// A bug the simulation can put back, to show that it finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// An owner answers a batch that wrote nothing without a fenced commit
    /// (issue 29: a fenced owner answered from its memory, a job ran twice).
    AnswerWithoutFence,
}

impl Bug {
    /// Every bug, with the name SIM_BUG gives it.
    pub const ALL: &'static [(&'static str, Bug)] = &[("answer-without-fence", Bug::AnswerWithoutFence)];

    pub fn from_name(name: &str) -> Option<Bug> {
        Bug::ALL.iter().find(|(known, _)| *known == name).map(|(_, bug)| *bug)
    }
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub jobs: usize,
    pub keys: usize,
    pub max: u32,
    pub job_partitions: usize,
    pub limit_partitions: usize,
    pub instances: usize,
    pub workers: usize,
    pub lease_ms: i64,
    /// Faults happen while simulated time is below this.
    pub faults_until_ms: i64,
    /// After the faults stop, every job ends within this.
    pub liveness_bound_ms: i64,
    pub bug: Option<Bug>,
    /// Keep a digest of every event handled (Report::digest), and print
    /// each one (SIM_TRACE): the history a seed gives, to compare or read.
    pub trace: Trace,
}

/// What the run does with the events it handles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Trace {
    /// Nothing (the fast path).
    #[default]
    Off,
    /// A digest of them (Report::digest).
    Digest,
    /// A digest, and each printed on stderr.
    Print,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            jobs: 40,
            keys: 3,
            max: 2,
            job_partitions: 2,
            limit_partitions: 2,
            instances: 2,
            workers: 3,
            lease_ms: 3_000,
            faults_until_ms: 30_000,
            liveness_bound_ms: 120_000,
            bug: None,
            trace: Trace::Off,
        }
    }
}

/// What one seed's run found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub seed: u64,
    pub steps: u64,
    pub jobs: usize,
    pub finished: usize,
    /// The first guarantee broken, with the simulated time.
    pub violation: Option<String>,
    /// The longest time a key had waiting jobs and nothing running.
    pub stall_max_ms: i64,
    /// Every such stall, for percentiles over seeds.
    pub stalls_ms: Vec<i64>,
    pub end_ms: i64,
    pub faults: u64,
    /// A digest of every event handled, in order (with `Trace::Digest` or
    /// `Trace::Print`): two runs of one seed give the same.
    pub digest: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Svc {
    Admission,
    LimitGrant,
}

/// A worker's call to admission, and where its answer goes.
pub enum CallKind {
    Claim(oneshot::Receiver<Vec<pb::ClaimResult>>),
    Heartbeat(oneshot::Receiver<Vec<pb::HeartbeatResult>>),
    Complete(oneshot::Receiver<Vec<pb::CompleteResult>>),
    Enqueue(
        oneshot::Receiver<
            Result<Vec<sluice_admission::partition::EnqueueOutcome>, sluice_admission::partition::EnqueueError>,
        >,
    ),
}

pub struct PendingCall {
    /// `None`: the producer.
    pub worker: Option<usize>,
    pub token: u64,
    pub kind: CallKind,
}

/// Answers workers get.
#[derive(Debug)]
pub enum Answer {
    Claim(Vec<pb::ClaimResult>),
    Heartbeat(Vec<pb::HeartbeatResult>),
    Complete,
    Enqueued,
    Unavailable,
}

/// One admission instance's link client (modelled after
/// `sluice_common::link::LinkClient`): commands kept until applied,
/// written to the owner its directory names.
#[derive(Default)]
struct LinkClient {
    next_seq: u64,
    unacked: BTreeMap<u64, Pending>,
    directory: BTreeMap<usize, usize>,
    directory_wanted: bool,
}

/// A link batch waiting for its commit at an owner.
struct LinkAck {
    adm: usize,
    owner: usize,
    conn: u64,
    seq: u64,
    receiver: oneshot::Receiver<LimitAnswer>,
}

struct Pending {
    partition: usize,
    commands: Arc<Vec<Vec<u8>>>,
    sent: Option<(usize, u64)>,
}

/// A limit-grant instance's grant router: job partition → (admission
/// instance, epoch, connection).
#[derive(Default)]
struct Router {
    routes: BTreeMap<usize, (usize, i64, u64)>,
}

#[derive(Debug)]
enum Event {
    Run {
        svc: Svc,
        instance: usize,
        partition: usize,
    },
    Produce {
        job: usize,
    },
    Commands {
        adm: usize,
        owner: usize,
        conn: u64,
        seq: u64,
        partition: usize,
        commands: Arc<Vec<Vec<u8>>>,
    },
    Applied {
        adm: usize,
        owner: usize,
        conn: u64,
        seq: u64,
    },
    Refused {
        adm: usize,
        owner: usize,
        conn: u64,
        seq: u64,
    },
    Grants {
        adm: usize,
        owner: usize,
        conn: u64,
        entries: Vec<Vec<u8>>,
    },
    Hello {
        adm: usize,
        owner: usize,
        conn: u64,
        claims: Vec<(usize, i64)>,
    },
    Connect {
        adm: usize,
        owner: usize,
    },
    DirectoryRead {
        adm: usize,
    },
    Answer {
        worker: Option<usize>,
        token: u64,
        answer: Answer,
    },
    Worker {
        worker: usize,
        event: WorkerEvent,
    },
    Fault,
    Restart {
        svc: Svc,
        instance: usize,
    },
    Reassign {
        svc: Svc,
        partition: usize,
        to: usize,
    },
    Revoke {
        svc: Svc,
        instance: usize,
        partition: usize,
    },
    IdleCheck {
        svc: Svc,
        instance: usize,
        partition: usize,
    },
    Check,
}

pub struct World {
    pub now: i64,
    pub rng: StdRng,
    seq: u64,
    events: BinaryHeap<Reverse<(i64, u64, usize)>>,
    slots: Vec<Option<Event>>,
    free: Vec<usize>,
    pub config: SimConfig,
    pub sluice: Arc<SluiceConfig>,
    pub adm: ServiceModel<Admission>,
    pub lg: ServiceModel<LimitGrant>,
    clients: Vec<LinkClient>,
    routers: Vec<Router>,
    /// `conns[adm][owner]`: the link's generation when open.
    conns: Vec<Vec<Option<u64>>>,
    next_conn: u64,
    /// The claims each admission instance last sent.
    claims: Vec<Vec<(usize, i64)>>,
    pub calls: Vec<PendingCall>,
    link_acks: Vec<LinkAck>,
    next_token: u64,
    /// A crash point armed for the next committed batch of (service,
    /// instance): the instance dies after the commit, before sending.
    crash_after_commit: BTreeSet<(Svc, usize)>,
    pub workers: Workers,
    pub checks: Checks,
    /// Requests not yet answered: job index → token.
    producing: BTreeMap<u64, usize>,
    /// Commit failures still to come, per (service, partition).
    failing_commits: BTreeMap<(Svc, usize), u32>,
    /// The earliest run event queued for each partition task.
    queued_runs: BTreeMap<(Svc, usize, usize), i64>,
    pub faults: u64,
    pub steps: u64,
    /// The digest of the events handled so far (`Trace::Digest`, `Print`).
    digest: Option<std::hash::DefaultHasher>,
}

impl World {
    pub fn new(seed: u64, config: SimConfig) -> anyhow::Result<World> {
        let lease = format!("{}ms", config.lease_ms);
        let job_partitions = config.job_partitions.to_string();
        let limit_partitions = config.limit_partitions.to_string();
        let sluice = Arc::new(SluiceConfig::load_with(
            None,
            &[
                ("task_groups.default.lease", lease.as_str()),
                ("kafka.partitions.jobs", job_partitions.as_str()),
                ("kafka.partitions.limit_commands", limit_partitions.as_str()),
                ("admission.stream_end_grace", "1s"),
            ],
        )?);
        let limit_settings = sluice_limit_grant::core::PartitionSettings {
            partition: 0,
            limit_partitions: sluice.kafka.partitions.limit_commands,
            grants_partitions: sluice.kafka.partitions.jobs,
            refresh_due_topic: Arc::from(sluice.topic(&sluice.topics.refresh_due)),
            refresh_due_partitions: sluice.kafka.partitions.refresh_due,
            max_message_bytes: sluice.kafka.max_message_bytes,
            ticket_grace_ms: sluice.limit_grant.ticket_grace.as_millis_i64(),
            input: sluice_common::validate::InputLimits::from_config(&sluice),
        };
        let instances = config.instances;
        let mut world = World {
            now: 0,
            rng: StdRng::seed_from_u64(seed),
            seq: 0,
            events: BinaryHeap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            adm: ServiceModel::new(Admission { config: sluice.clone() }, config.job_partitions, instances),
            lg: ServiceModel::new(
                LimitGrant {
                    settings: limit_settings,
                },
                config.limit_partitions,
                instances,
            ),
            sluice,
            clients: (0..instances).map(|_| LinkClient::default()).collect(),
            routers: (0..instances).map(|_| Router::default()).collect(),
            conns: vec![vec![None; instances]; instances],
            next_conn: 0,
            claims: vec![Vec::new(); instances],
            calls: Vec::new(),
            link_acks: Vec::new(),
            next_token: 0,
            crash_after_commit: BTreeSet::new(),
            workers: Workers::new(config.workers),
            checks: Checks::new(&config),
            producing: BTreeMap::new(),
            failing_commits: BTreeMap::new(),
            queued_runs: BTreeMap::new(),
            faults: 0,
            steps: 0,
            digest: (config.trace != Trace::Off).then(std::hash::DefaultHasher::new),
            config,
        };
        world.start();
        Ok(world)
    }

    // -- events -------------------------------------------------------------

    fn at(&mut self, delay_ms: i64, event: Event) {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some(event);
                slot
            }
            None => {
                self.slots.push(Some(event));
                self.slots.len() - 1
            }
        };
        self.seq += 1;
        self.events.push(Reverse((self.now + delay_ms.max(0), self.seq, slot)));
    }

    fn net_delay(&mut self) -> i64 {
        self.rng.random_range(1..=15)
    }

    /// The clock of a partition's owner (anchored at PostgreSQL's).
    pub fn clock_ms(&self) -> i64 {
        BASE_MS + self.now
    }

    fn start(&mut self) {
        for partition in 0..self.config.job_partitions {
            let instance = partition % self.config.instances;
            self.assign(Svc::Admission, partition, instance);
        }
        for partition in 0..self.config.limit_partitions {
            let instance = (partition + 1) % self.config.instances;
            self.assign(Svc::LimitGrant, partition, instance);
        }
        for adm in 0..self.config.instances {
            for owner in 0..self.config.instances {
                self.at(1, Event::Connect { adm, owner });
            }
            self.at(1, Event::DirectoryRead { adm });
        }
        for job in 0..self.config.jobs {
            let delay = i64::try_from(job).unwrap_or(0) * 20 + 50;
            self.at(delay, Event::Produce { job });
        }
        let workers = self.config.workers;
        for worker in 0..workers {
            self.at(
                10,
                Event::Worker {
                    worker,
                    event: WorkerEvent::Poll,
                },
            );
        }
        self.at(100, Event::Check);
        if self.config.faults_until_ms > 0 {
            let first = self.rng.random_range(200..1_500);
            self.at(first, Event::Fault);
        }
    }

    /// Run until every job ended or the bound passed.
    pub fn run(mut self, seed: u64) -> Report {
        let deadline = self.config.faults_until_ms + self.config.liveness_bound_ms;
        while let Some(Reverse((at, _, slot))) = self.events.pop() {
            if at > deadline {
                break;
            }
            self.now = at;
            let Some(event) = self.slots[slot].take() else {
                continue;
            };
            self.free.push(slot);
            self.steps += 1;
            self.record(&event);
            self.handle(event);
            if self.checks.violation.is_some() {
                break;
            }
            if self.checks.all_ended(self.config.jobs) && self.now > self.config.faults_until_ms {
                break;
            }
        }
        if self.config.trace == Trace::Print {
            self.dump();
        }
        if self.checks.violation.is_none() && !self.checks.all_ended(self.config.jobs) {
            self.checks.violation = Some(format!(
                "liveness: {} of {} jobs ended {} ms after the faults stopped ({})",
                self.checks.ended(),
                self.config.jobs,
                self.config.liveness_bound_ms,
                self.checks.unfinished(self.config.jobs)
            ));
        }
        let stalls_ms = self.checks.stalls(self.now);
        Report {
            seed,
            steps: self.steps,
            jobs: self.config.jobs,
            finished: self.checks.ended(),
            violation: self.checks.violation.clone(),
            stall_max_ms: stalls_ms.iter().copied().max().unwrap_or(0),
            stalls_ms,
            end_ms: self.now,
            faults: self.faults,
            digest: self.digest.as_ref().map(std::hash::Hasher::finish),
        }
    }

    /// Fold the event into the digest (std's `DefaultHasher::new` has fixed
    /// keys: the same in every process), and print it with `Trace::Print`.
    fn record(&mut self, event: &Event) {
        let Some(digest) = self.digest.as_mut() else {
            return;
        };
        let line = format!("{} {event:?}", self.now);
        std::hash::Hash::hash(&line, digest);
        if self.config.trace == Trace::Print {
            eprintln!("{line}");
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Run {
                svc,
                instance,
                partition,
            } => {
                if self.queued_runs.get(&(svc, instance, partition)) == Some(&self.now) {
                    self.queued_runs.remove(&(svc, instance, partition));
                }
                self.run_partition(svc, instance, partition);
            }
            Event::Produce { job } => self.produce(job),
            Event::Commands {
                adm,
                owner,
                conn,
                seq,
                partition,
                commands,
            } => self.commands_arrive(adm, owner, conn, seq, partition, commands),
            Event::Applied { adm, owner, conn, seq } => {
                if self.conn_open(adm, owner, conn) {
                    self.clients[adm].unacked.remove(&seq);
                }
            }
            Event::Refused { adm, owner, conn, seq } => {
                if self.conn_open(adm, owner, conn) {
                    self.refused(adm, seq);
                }
            }
            Event::Grants {
                adm,
                owner,
                conn,
                entries,
            } => {
                if self.conn_open(adm, owner, conn) {
                    self.grants_arrive(adm, entries);
                }
            }
            Event::Hello {
                adm,
                owner,
                conn,
                claims,
            } => {
                if self.conn_open(adm, owner, conn) {
                    self.hello_arrives(adm, owner, conn, claims);
                }
            }
            Event::Connect { adm, owner } => self.connect(adm, owner),
            Event::DirectoryRead { adm } => self.read_directory(adm),
            Event::Answer { worker, token, answer } => match worker {
                Some(worker) => self.worker_answer(worker, token, answer),
                None => self.producer_answer(token, answer),
            },
            Event::Worker { worker, event } => self.worker_event(worker, event),
            Event::Fault => self.fault(),
            Event::Restart { svc, instance } => self.restart(svc, instance),
            Event::Reassign { svc, partition, to } => self.reassign(svc, partition, to),
            Event::Revoke {
                svc,
                instance,
                partition,
            } => self.revoke(svc, instance, partition),
            Event::IdleCheck {
                svc,
                instance,
                partition,
            } => self.idle_check(svc, instance, partition),
            Event::Check => {
                self.check_owners();
                self.at(250, Event::Check);
            }
        }
    }

    // -- ownership ------------------------------------------------------------

    fn up(&self, svc: Svc, instance: usize) -> bool {
        match svc {
            Svc::Admission => self.adm.up[instance],
            Svc::LimitGrant => self.lg.up[instance],
        }
    }

    /// The group assigns `partition` to `instance`, which takes it over.
    fn assign(&mut self, svc: Svc, partition: usize, instance: usize) {
        let now_ms = self.clock_ms();
        let sends = match svc {
            Svc::Admission => {
                self.adm.assigned[partition] = Some(instance);
                self.adm.take_over(instance, partition, now_ms)
            }
            Svc::LimitGrant => {
                self.lg.assigned[partition] = Some(instance);
                self.lg.take_over(instance, partition, now_ms)
            }
        };
        self.send(svc, instance, sends);
        self.schedule_run(svc, instance, partition, 1);
        self.at(
            2_000,
            Event::IdleCheck {
                svc,
                instance,
                partition,
            },
        );
        if svc == Svc::Admission {
            self.claims_changed(instance);
        }
    }

    fn schedule_run(&mut self, svc: Svc, instance: usize, partition: usize, delay: i64) {
        let at = self.now + delay.max(0);
        let earlier = self
            .queued_runs
            .get(&(svc, instance, partition))
            .is_none_or(|queued| at < *queued);
        if earlier {
            self.queued_runs.insert((svc, instance, partition), at);
            self.at(
                delay,
                Event::Run {
                    svc,
                    instance,
                    partition,
                },
            );
        }
    }

    /// Every 2 s an owner touches its row, and finds out when a newer owner
    /// took the partition (then it stands by); a task standing by takes
    /// the partition back when its owner let it go.
    fn idle_check(&mut self, svc: Svc, instance: usize, partition: usize) {
        let now = self.now;
        let (exists, standing_by, ours, released, silent, assigned_here) = match svc {
            Svc::Admission => {
                let store = &self.adm.stores[partition];
                let task = self.adm.tasks[instance][partition].as_ref();
                (
                    task.is_some(),
                    task.is_some_and(|task| task.standing_by),
                    task.is_some_and(|task| task.epoch == store.epoch),
                    store.released,
                    now - (store.touched_ms - BASE_MS) >= 15_000,
                    self.adm.assigned[partition] == Some(instance),
                )
            }
            Svc::LimitGrant => {
                let store = &self.lg.stores[partition];
                let task = self.lg.tasks[instance][partition].as_ref();
                (
                    task.is_some(),
                    task.is_some_and(|task| task.standing_by),
                    task.is_some_and(|task| task.epoch == store.epoch),
                    store.released,
                    now - (store.touched_ms - BASE_MS) >= 15_000,
                    self.lg.assigned[partition] == Some(instance),
                )
            }
        };
        if !exists || !self.up(svc, instance) {
            return;
        }
        if ours && !standing_by {
            let touched = self.clock_ms();
            match svc {
                Svc::Admission => self.adm.stores[partition].touched_ms = touched,
                Svc::LimitGrant => self.lg.stores[partition].touched_ms = touched,
            }
        } else if !standing_by {
            self.stand_by(svc, instance, partition);
        } else if assigned_here && (released || silent) {
            self.assign(svc, partition, instance);
            return;
        }
        let next = if standing_by || !ours { 1_000 } else { 2_000 };
        self.at(
            next,
            Event::IdleCheck {
                svc,
                instance,
                partition,
            },
        );
    }

    fn stand_by(&mut self, svc: Svc, instance: usize, partition: usize) {
        match svc {
            Svc::Admission => {
                if let Some(task) = self.adm.tasks[instance][partition].as_mut() {
                    task.standing_by = true;
                    // Its callers' channels close: they retry elsewhere.
                    task.locals.clear();
                }
                self.claims_changed(instance);
            }
            Svc::LimitGrant => {
                if let Some(task) = self.lg.tasks[instance][partition].as_mut() {
                    task.standing_by = true;
                    task.locals.clear();
                }
            }
        }
        self.resolve_calls();
        self.resolve_link_acks();
    }

    // -- partition batches ------------------------------------------------------

    fn run_partition(&mut self, svc: Svc, instance: usize, partition: usize) {
        if !self.up(svc, instance) {
            return;
        }
        let now_ms = self.clock_ms();
        let commit_fails = match self.failing_commits.get_mut(&(svc, partition)) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        };
        let answer_without_fence = self.config.bug == Some(Bug::AnswerWithoutFence);
        let end = match svc {
            Svc::Admission => self
                .adm
                .run_batch(instance, partition, now_ms, commit_fails, answer_without_fence),
            Svc::LimitGrant => self
                .lg
                .run_batch(instance, partition, now_ms, commit_fails, answer_without_fence),
        };
        match end {
            BatchEnd::Committed {
                sends,
                replies,
                rejected,
            } => {
                // Nothing is set aside without its reason.
                if let Some(bare) = rejected.iter().find(|entry| entry.reason.trim().is_empty()) {
                    self.checks.violation = Some(format!(
                        "input set aside without a reason at {} ms (offset {})",
                        self.now, bare.offset
                    ));
                }
                if self.crash_after_commit.remove(&(svc, instance)) {
                    // Saved, nothing sent or answered: the instance dies.
                    drop(replies);
                    drop(sends);
                    self.kill(svc, instance);
                    return;
                }
                self.send(svc, instance, sends);
                for reply in replies {
                    reply();
                }
                self.resolve_calls();
                self.resolve_link_acks();
                if svc == Svc::LimitGrant {
                    self.check_limit_partition(instance, partition);
                }
            }
            BatchEnd::Fenced => {
                self.stand_by(svc, instance, partition);
                return;
            }
            BatchEnd::Failed => {
                self.resolve_calls();
                self.resolve_link_acks();
                self.schedule_run(svc, instance, partition, 50);
                return;
            }
            BatchEnd::Idle => {}
        }
        self.schedule_wakeup(svc, instance, partition);
    }

    /// The partition's next timer (lease ends, re-sends, sweeps).
    fn schedule_wakeup(&mut self, svc: Svc, instance: usize, partition: usize) {
        let now_ms = self.clock_ms();
        let wakeup = match svc {
            Svc::Admission => self.adm.tasks[instance][partition]
                .as_ref()
                .filter(|task| !task.standing_by)
                .and_then(|task| sluice_common::owner::OwnedState::next_wakeup_ms(&task.state)),
            Svc::LimitGrant => self.lg.tasks[instance][partition]
                .as_ref()
                .filter(|task| !task.standing_by)
                .and_then(|task| sluice_common::owner::OwnedState::next_wakeup_ms(&task.state)),
        };
        if let Some(at) = wakeup {
            let delay = (at - now_ms).max(1);
            self.schedule_run(svc, instance, partition, delay);
        }
    }

    /// What a committed batch sends: link entries and Kafka messages.
    fn send(&mut self, svc: Svc, instance: usize, mut sends: sluice_common::kafka::Outbox) {
        let links = sends.take_links();
        for ((link, partition), entries) in links {
            let partition = usize::try_from(partition).unwrap_or(0);
            match link {
                Link::LimitGrant => self.client_send(instance, partition, entries),
                Link::Admission => self.route_grants(instance, partition, entries),
                Link::RateWindow => {}
            }
        }
        for message in sends.into_messages() {
            if svc == Svc::Admission && message.topic.contains("admitted") {
                if let Ok(admitted) = pb::AdmittedJob::decode(message.payload.as_slice()) {
                    let delay = self.rng.random_range(5..60);
                    self.workers.publish(admitted, self.now + delay);
                }
            }
        }
    }

    // -- links ------------------------------------------------------------------

    fn conn_open(&self, adm: usize, owner: usize, conn: u64) -> bool {
        self.adm.up[adm] && self.lg.up[owner] && self.conns[adm][owner] == Some(conn)
    }

    fn connect(&mut self, adm: usize, owner: usize) {
        if !self.adm.up[adm] {
            return;
        }
        if !self.lg.up[owner] {
            self.at(500, Event::Connect { adm, owner });
            return;
        }
        if self.conns[adm][owner].is_some() {
            return;
        }
        self.next_conn += 1;
        let conn = self.next_conn;
        self.conns[adm][owner] = Some(conn);
        let claims = self.claims[adm].clone();
        let delay = self.net_delay();
        self.at(
            delay,
            Event::Hello {
                adm,
                owner,
                conn,
                claims,
            },
        );
        let seqs: Vec<u64> = self.clients[adm].unacked.keys().copied().collect();
        for seq in seqs {
            self.route(adm, seq);
        }
    }

    /// A link breaks: what was on its way is lost; the client connects
    /// again and sends what was not applied.
    pub fn break_link(&mut self, adm: usize, owner: usize) {
        if self.conns[adm][owner].take().is_none() {
            return;
        }
        for pending in self.clients[adm].unacked.values_mut() {
            if pending.sent.is_some_and(|(sent_to, _)| sent_to == owner) {
                pending.sent = None;
            }
        }
        self.clients[adm].directory_wanted = true;
        self.at(250, Event::DirectoryRead { adm });
        let retry = self.rng.random_range(100..1_000);
        self.at(retry, Event::Connect { adm, owner });
    }

    fn read_directory(&mut self, adm: usize) {
        if !self.adm.up[adm] {
            return;
        }
        let directory: BTreeMap<usize, usize> = self
            .lg
            .stores
            .iter()
            .enumerate()
            .filter_map(|(partition, store)| store.owner.map(|owner| (partition, owner)))
            .collect();
        self.clients[adm].directory = directory;
        self.clients[adm].directory_wanted = false;
        let seqs: Vec<u64> = self.clients[adm].unacked.keys().copied().collect();
        for seq in seqs {
            self.route(adm, seq);
        }
        self.at(10_000, Event::DirectoryRead { adm });
    }

    fn client_send(&mut self, adm: usize, partition: usize, entries: Vec<Vec<u8>>) {
        let client = &mut self.clients[adm];
        client.next_seq += 1;
        let seq = client.next_seq;
        client.unacked.insert(
            seq,
            Pending {
                partition,
                commands: Arc::new(entries),
                sent: None,
            },
        );
        self.route(adm, seq);
    }

    fn route(&mut self, adm: usize, seq: u64) {
        let Some(pending) = self.clients[adm].unacked.get(&seq) else {
            return;
        };
        let partition = pending.partition;
        let Some(owner) = self.clients[adm].directory.get(&partition).copied() else {
            if !self.clients[adm].directory_wanted {
                self.clients[adm].directory_wanted = true;
                self.at(250, Event::DirectoryRead { adm });
            }
            return;
        };
        let Some(conn) = self.conns[adm][owner] else {
            return;
        };
        if pending.sent == Some((owner, conn)) {
            return;
        }
        let commands = pending.commands.clone();
        if let Some(pending) = self.clients[adm].unacked.get_mut(&seq) {
            pending.sent = Some((owner, conn));
        }
        let delay = self.net_delay();
        self.at(
            delay,
            Event::Commands {
                adm,
                owner,
                conn,
                seq,
                partition,
                commands,
            },
        );
    }

    fn refused(&mut self, adm: usize, seq: u64) {
        let Some(pending) = self.clients[adm].unacked.get_mut(&seq) else {
            return;
        };
        pending.sent = None;
        let partition = pending.partition;
        self.clients[adm].directory.remove(&partition);
        self.clients[adm].directory_wanted = true;
        self.at(250, Event::DirectoryRead { adm });
    }

    fn commands_arrive(
        &mut self,
        adm: usize,
        owner: usize,
        conn: u64,
        seq: u64,
        partition: usize,
        commands: Arc<Vec<Vec<u8>>>,
    ) {
        if !self.conn_open(adm, owner, conn) {
            return;
        }
        let Some(task) = self.lg.serving(owner, partition) else {
            let delay = self.net_delay();
            self.at(delay, Event::Refused { adm, owner, conn, seq });
            return;
        };
        let (reply, receiver) = oneshot::channel();
        task.locals.push(Ask::Query {
            query: LimitQuery::Link {
                commands: commands.as_ref().clone(),
                client: Arc::from(format!("admission-{adm}").as_str()),
            },
            reply,
        });
        self.link_acks.push(LinkAck {
            adm,
            owner,
            conn,
            seq,
            receiver,
        });
        self.schedule_run(Svc::LimitGrant, owner, partition, 1);
    }
}

impl World {
    // -- grants -----------------------------------------------------------------

    fn resolve_link_acks(&mut self) {
        let acks = std::mem::take(&mut self.link_acks);
        for mut ack in acks {
            match ack.receiver.try_recv() {
                Ok(_) => {
                    let delay = self.net_delay();
                    self.at(
                        delay,
                        Event::Applied {
                            adm: ack.adm,
                            owner: ack.owner,
                            conn: ack.conn,
                            seq: ack.seq,
                        },
                    );
                }
                Err(oneshot::error::TryRecvError::Closed) => {
                    let delay = self.net_delay();
                    self.at(
                        delay,
                        Event::Refused {
                            adm: ack.adm,
                            owner: ack.owner,
                            conn: ack.conn,
                            seq: ack.seq,
                        },
                    );
                }
                Err(oneshot::error::TryRecvError::Empty) => self.link_acks.push(ack),
            }
        }
    }

    /// A limit-grant instance sends grants of `job_partition` to the link
    /// that claimed it (dropped when none does: the claim brings them again).
    fn route_grants(&mut self, owner: usize, job_partition: usize, entries: Vec<Vec<u8>>) {
        let Some((adm, _, conn)) = self.routers[owner].routes.get(&job_partition).copied() else {
            return;
        };
        if self.conns[adm][owner] != Some(conn) {
            return;
        }
        let delay = self.net_delay();
        self.at(
            delay,
            Event::Grants {
                adm,
                owner,
                conn,
                entries,
            },
        );
    }

    /// An admission instance's claims reach an owner: the job partitions
    /// now routed to it get every held ticket's grant again.
    fn hello_arrives(&mut self, adm: usize, owner: usize, conn: u64, claims: Vec<(usize, i64)>) {
        let router = &mut self.routers[owner];
        let claimed: BTreeSet<usize> = claims.iter().map(|(partition, _)| *partition).collect();
        router
            .routes
            .retain(|partition, route| !(route.0 == adm && route.2 == conn) || claimed.contains(partition));
        let mut newly_routed = Vec::new();
        for (partition, epoch) in claims {
            let replace = router.routes.get(&partition).is_none_or(|route| epoch >= route.1);
            if replace {
                if router
                    .routes
                    .get(&partition)
                    .is_none_or(|route| !(route.0 == adm && route.2 == conn))
                {
                    newly_routed.push(i32::try_from(partition).unwrap_or(0));
                }
                router.routes.insert(partition, (adm, epoch, conn));
            }
        }
        if newly_routed.is_empty() {
            return;
        }
        for partition in 0..self.lg.partitions() {
            if let Some(task) = self.lg.serving(owner, partition) {
                // Not answered (nobody waits for it): the channel is kept
                // open and dropped with the batch.
                let (reply, _unanswered) = oneshot::channel();
                task.locals.push(Ask::Query {
                    query: LimitQuery::ResendGrants {
                        job_partitions: newly_routed.clone(),
                    },
                    reply,
                });
                self.schedule_run(Svc::LimitGrant, owner, partition, 1);
            }
        }
    }

    /// The job partitions `adm` serves changed: it claims them on every link.
    fn claims_changed(&mut self, adm: usize) {
        let claims: Vec<(usize, i64)> = (0..self.adm.partitions())
            .filter_map(|partition| {
                self.adm.tasks[adm][partition]
                    .as_ref()
                    .filter(|task| !task.standing_by)
                    .map(|task| (partition, task.epoch))
            })
            .collect();
        if claims == self.claims[adm] {
            return;
        }
        self.claims[adm] = claims.clone();
        for owner in 0..self.config.instances {
            if let Some(conn) = self.conns[adm][owner] {
                let delay = self.net_delay();
                self.at(
                    delay,
                    Event::Hello {
                        adm,
                        owner,
                        conn,
                        claims: claims.clone(),
                    },
                );
            }
        }
    }

    fn grants_arrive(&mut self, adm: usize, entries: Vec<Vec<u8>>) {
        let mut by_partition: BTreeMap<usize, Vec<pb::GrantEvent>> = BTreeMap::new();
        for entry in entries {
            let Ok(event) = pb::GrantEvent::decode(entry.as_slice()) else {
                continue;
            };
            let job_id = event
                .ticket
                .as_ref()
                .map(|ticket| ticket.job_id.clone())
                .unwrap_or_default();
            let partition = job_partition(&job_id, i32::try_from(self.config.job_partitions).unwrap_or(1));
            by_partition
                .entry(usize::try_from(partition).unwrap_or(0))
                .or_default()
                .push(event);
        }
        for (partition, events) in by_partition {
            if let Some(task) = self.adm.serving(adm, partition) {
                task.locals.push(Local::Grants(events));
                self.schedule_run(Svc::Admission, adm, partition, 1);
            }
        }
    }

    // -- calls to admission -------------------------------------------------------

    /// A call for the owner of `job_id`'s partition, entering at a random
    /// admission instance: answered by the task there or at the owner the
    /// directory names, else UNAVAILABLE. Returns the call's token.
    pub fn call(&mut self, worker: Option<usize>, job_id: &str, make: impl FnOnce() -> (Local, CallKind)) -> u64 {
        self.next_token += 1;
        let token = self.next_token;
        let partition = usize::try_from(job_partition(
            job_id,
            i32::try_from(self.config.job_partitions).unwrap_or(1),
        ))
        .unwrap_or(0);
        let up: Vec<usize> = (0..self.config.instances)
            .filter(|instance| self.adm.up[*instance])
            .collect();
        let (local, kind) = make();
        if up.is_empty() {
            drop(local);
        } else {
            let entry = up[self.rng.random_range(0..up.len())];
            let target = if self.adm.serving(entry, partition).is_some() {
                Some(entry)
            } else {
                self.adm.stores[partition]
                    .owner
                    .filter(|owner| *owner != entry && self.adm.serving(*owner, partition).is_some())
            };
            match target {
                Some(instance) => {
                    if let Some(task) = self.adm.serving(instance, partition) {
                        task.locals.push(local);
                    }
                    let delay = self.net_delay();
                    self.schedule_run(Svc::Admission, instance, partition, delay);
                }
                None => drop(local),
            }
        }
        self.calls.push(PendingCall { worker, token, kind });
        self.resolve_calls();
        token
    }

    /// Answers that came out of committed batches (or channels that
    /// closed: UNAVAILABLE) go back to their callers.
    fn resolve_calls(&mut self) {
        let calls = std::mem::take(&mut self.calls);
        for mut call in calls {
            let answer = match &mut call.kind {
                CallKind::Claim(receiver) => match receiver.try_recv() {
                    Ok(results) => Some(Answer::Claim(results)),
                    Err(oneshot::error::TryRecvError::Closed) => Some(Answer::Unavailable),
                    Err(oneshot::error::TryRecvError::Empty) => None,
                },
                CallKind::Heartbeat(receiver) => match receiver.try_recv() {
                    Ok(results) => Some(Answer::Heartbeat(results)),
                    Err(oneshot::error::TryRecvError::Closed) => Some(Answer::Unavailable),
                    Err(oneshot::error::TryRecvError::Empty) => None,
                },
                CallKind::Complete(receiver) => match receiver.try_recv() {
                    Ok(_) => Some(Answer::Complete),
                    Err(oneshot::error::TryRecvError::Closed) => Some(Answer::Unavailable),
                    Err(oneshot::error::TryRecvError::Empty) => None,
                },
                CallKind::Enqueue(receiver) => match receiver.try_recv() {
                    Ok(Ok(_)) => Some(Answer::Enqueued),
                    Ok(Err(_)) | Err(oneshot::error::TryRecvError::Closed) => Some(Answer::Unavailable),
                    Err(oneshot::error::TryRecvError::Empty) => None,
                },
            };
            match answer {
                Some(answer) => {
                    let delay = self.net_delay();
                    self.at(
                        delay,
                        Event::Answer {
                            worker: call.worker,
                            token: call.token,
                            answer,
                        },
                    );
                }
                None => self.calls.push(call),
            }
        }
    }

    // -- the producer -----------------------------------------------------------

    fn produce(&mut self, job: usize) {
        let job_id = job_name(job);
        let key = format!("k{}", job % self.config.keys);
        let request = pb::JobRequest {
            job_id: Some(job_id.clone()),
            tenant: "acme".to_string(),
            task_group: "default".to_string(),
            payload: format!("job {job}").into_bytes(),
            retry: Some(pb::RetryPolicy {
                max_attempts: 8,
                initial_backoff: "100ms".to_string(),
                max_backoff: "1s".to_string(),
                ..pb::RetryPolicy::default()
            }),
            limits: vec![pb::Limit {
                kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                    key,
                    max_concurrency: self.config.max,
                    shadow: false,
                })),
            }],
            ..pb::JobRequest::default()
        };
        let Ok(valid) = chain::validate(&self.sluice, request) else {
            self.checks.violation = Some(format!("job {job_id}: the simulation's request is invalid"));
            return;
        };
        let incoming = Incoming {
            job_id: job_id.clone(),
            valid,
            trace: pb::TraceContext::default(),
        };
        let token = self.call(None, &job_id, move || {
            let (reply, receiver) = oneshot::channel();
            (
                Local::Enqueue {
                    jobs: vec![incoming],
                    on_conflict: OnConflict::Refuse,
                    reply,
                },
                CallKind::Enqueue(receiver),
            )
        });
        self.producing.insert(token, job);
    }

    fn producer_answer(&mut self, token: u64, answer: Answer) {
        let Some(job) = self.producing.remove(&token) else {
            return;
        };
        match answer {
            Answer::Enqueued => self.checks.enqueued(job, self.now),
            _ => {
                let retry = self.rng.random_range(100..600);
                self.at(retry, Event::Produce { job });
            }
        }
    }

    // -- faults -----------------------------------------------------------------

    fn fault(&mut self) {
        if self.now >= self.config.faults_until_ms {
            return;
        }
        self.faults += 1;
        let instances = self.config.instances;
        match self.rng.random_range(0..10) {
            0 => {
                let instance = self.rng.random_range(0..instances);
                self.kill(Svc::Admission, instance);
            }
            1 => {
                let instance = self.rng.random_range(0..instances);
                self.kill(Svc::LimitGrant, instance);
            }
            2 => {
                let svc = if self.rng.random_bool(0.5) {
                    Svc::Admission
                } else {
                    Svc::LimitGrant
                };
                self.overlapping_move(svc);
            }
            3 | 4 => {
                let adm = self.rng.random_range(0..instances);
                let owner = self.rng.random_range(0..instances);
                self.break_link(adm, owner);
            }
            5 => {
                let svc = if self.rng.random_bool(0.5) {
                    Svc::Admission
                } else {
                    Svc::LimitGrant
                };
                let partitions = match svc {
                    Svc::Admission => self.config.job_partitions,
                    Svc::LimitGrant => self.config.limit_partitions,
                };
                let partition = self.rng.random_range(0..partitions);
                let failures = self.rng.random_range(1..4);
                *self.failing_commits.entry((svc, partition)).or_default() += failures;
            }
            6 => {
                let svc = if self.rng.random_bool(0.5) {
                    Svc::Admission
                } else {
                    Svc::LimitGrant
                };
                let instance = self.rng.random_range(0..instances);
                self.crash_after_commit.insert((svc, instance));
            }
            _ => self.worker_fault(),
        }
        let next = self.rng.random_range(300..2_000);
        self.at(next, Event::Fault);
    }

    /// An instance dies (kill -9): its tasks and links are gone; the group
    /// gives its partitions to another instance after the session timeout;
    /// it comes back later.
    fn kill(&mut self, svc: Svc, instance: usize) {
        let others = (0..self.config.instances)
            .filter(|other| *other != instance && self.up(svc, *other))
            .count();
        if others == 0 || !self.up(svc, instance) {
            return;
        }
        match svc {
            Svc::Admission => {
                self.adm.stop_instance(instance, false);
                for owner in 0..self.config.instances {
                    self.conns[instance][owner] = None;
                }
                self.clients[instance] = LinkClient::default();
                self.claims[instance].clear();
            }
            Svc::LimitGrant => {
                self.lg.stop_instance(instance, false);
                self.routers[instance] = Router::default();
                for adm in 0..self.config.instances {
                    if self.conns[adm][instance].is_some() {
                        self.break_link(adm, instance);
                    }
                }
            }
        }
        self.resolve_calls();
        self.resolve_link_acks();
        let partitions = match svc {
            Svc::Admission => self.adm.partitions(),
            Svc::LimitGrant => self.lg.partitions(),
        };
        let session_timeout = self.rng.random_range(500..3_000);
        for partition in 0..partitions {
            let assigned = match svc {
                Svc::Admission => self.adm.assigned[partition],
                Svc::LimitGrant => self.lg.assigned[partition],
            };
            if assigned == Some(instance) {
                let to = (0..self.config.instances)
                    .find(|other| *other != instance && self.up(svc, *other))
                    .unwrap_or(instance);
                self.at(session_timeout, Event::Reassign { svc, partition, to });
            }
        }
        let restart = session_timeout + self.rng.random_range(200..3_000);
        self.at(restart, Event::Restart { svc, instance });
    }

    fn restart(&mut self, svc: Svc, instance: usize) {
        match svc {
            Svc::Admission => {
                self.adm.up[instance] = true;
                for owner in 0..self.config.instances {
                    self.at(1, Event::Connect { adm: instance, owner });
                }
                self.at(1, Event::DirectoryRead { adm: instance });
            }
            Svc::LimitGrant => {
                self.lg.up[instance] = true;
                for adm in 0..self.config.instances {
                    self.at(50, Event::Connect { adm, owner: instance });
                }
            }
        }
        // The rebalance after it joins moves one partition to it (the old
        // owner gives it up first).
        let partitions = match svc {
            Svc::Admission => self.adm.partitions(),
            Svc::LimitGrant => self.lg.partitions(),
        };
        let partition = self.rng.random_range(0..partitions);
        let assigned = match svc {
            Svc::Admission => self.adm.assigned[partition],
            Svc::LimitGrant => self.lg.assigned[partition],
        };
        if let Some(old) = assigned.filter(|old| *old != instance) {
            self.at(
                100,
                Event::Revoke {
                    svc,
                    instance: old,
                    partition,
                },
            );
        }
        self.at(
            150,
            Event::Reassign {
                svc,
                partition,
                to: instance,
            },
        );
    }

    /// The group moves a partition while its old member does not know yet
    /// (overlapping rebalances): both hold it for a while.
    fn overlapping_move(&mut self, svc: Svc) {
        let partitions = match svc {
            Svc::Admission => self.adm.partitions(),
            Svc::LimitGrant => self.lg.partitions(),
        };
        let partition = self.rng.random_range(0..partitions);
        let assigned = match svc {
            Svc::Admission => self.adm.assigned[partition],
            Svc::LimitGrant => self.lg.assigned[partition],
        };
        let Some(old) = assigned else {
            return;
        };
        let Some(to) = (0..self.config.instances).find(|other| *other != old && self.up(svc, *other)) else {
            return;
        };
        self.at(1, Event::Reassign { svc, partition, to });
        let told = self.rng.random_range(200..6_000);
        self.at(
            told,
            Event::Revoke {
                svc,
                instance: old,
                partition,
            },
        );
    }

    fn reassign(&mut self, svc: Svc, partition: usize, to: usize) {
        if !self.up(svc, to) {
            return;
        }
        let has_task = match svc {
            Svc::Admission => self.adm.tasks[to][partition].is_some(),
            Svc::LimitGrant => self.lg.tasks[to][partition].is_some(),
        };
        let assigned = match svc {
            Svc::Admission => self.adm.assigned[partition],
            Svc::LimitGrant => self.lg.assigned[partition],
        };
        if has_task && assigned == Some(to) {
            return;
        }
        self.assign(svc, partition, to);
    }

    fn revoke(&mut self, svc: Svc, instance: usize, partition: usize) {
        let assigned = match svc {
            Svc::Admission => self.adm.assigned[partition],
            Svc::LimitGrant => self.lg.assigned[partition],
        };
        if assigned == Some(instance) {
            // Still assigned here: this revoke was overtaken.
            return;
        }
        match svc {
            Svc::Admission => {
                self.adm.release(instance, partition);
                self.claims_changed(instance);
            }
            Svc::LimitGrant => self.lg.release(instance, partition),
        }
        self.resolve_calls();
        self.resolve_link_acks();
    }

    // -- checks -------------------------------------------------------------------

    /// Guarantee 1 at the owner: a key's holders never exceed its max.
    fn check_limit_partition(&mut self, instance: usize, partition: usize) {
        let Some(task) = self.lg.tasks[instance][partition].as_ref() else {
            return;
        };
        if task.epoch != self.lg.stores[partition].epoch {
            return;
        }
        for key in 0..self.config.keys {
            let name = format!("k{key}");
            if key_partition("acme", &name, i32::try_from(self.config.limit_partitions).unwrap_or(1))
                != i32::try_from(partition).unwrap_or(-1)
            {
                continue;
            }
            let holders = task.state.core().holders_of("acme", &name);
            if holders > usize::try_from(self.config.max).unwrap_or(usize::MAX) {
                self.checks.violation = Some(format!(
                    "overrun at {} ms: key {name} has {holders} holders at limit-grant, max {}",
                    self.now, self.config.max
                ));
            }
        }
    }

    /// Jobs whose end is saved (succeeded, failed, cancelled) have ended.
    fn check_owners(&mut self) {
        for store in &self.adm.stores {
            for row in store.image.outcomes.values() {
                if let Some(job) = job_index(&row.state.job_id) {
                    self.checks
                        .ended_at(job, row.state.finished_at_ms.map_or(self.now, |at| at - BASE_MS));
                }
            }
        }
    }
}

impl World {
    /// What the cluster holds, for a failing seed (SIM_TRACE).
    fn dump(&self) {
        eprintln!("--- at {} ms", self.now);
        for instance in 0..self.config.instances {
            for partition in 0..self.adm.partitions() {
                if let Some(task) = self.adm.tasks[instance][partition].as_ref() {
                    eprintln!(
                        "admission {instance} p{partition} epoch {} (store {}) standing_by {} locals {}",
                        task.epoch,
                        self.adm.stores[partition].epoch,
                        task.standing_by,
                        task.locals.len()
                    );
                    for job in 0..self.config.jobs {
                        if let Some(row) = task.state.job(&job_name(job)) {
                            eprintln!(
                                "  {} {:?} attempt {} step {} due {:?} lease {:?}",
                                row.state.job_id,
                                row.state.status,
                                row.state.attempt,
                                row.state.step,
                                row.state.due_at_ms.map(|at| at - BASE_MS),
                                row.state.lease_expires_at_ms.map(|at| at - BASE_MS)
                            );
                        }
                    }
                }
            }
            for partition in 0..self.lg.partitions() {
                if let Some(task) = self.lg.tasks[instance][partition].as_ref() {
                    eprintln!(
                        "limit-grant {instance} p{partition} epoch {} (store {}) standing_by {}",
                        task.epoch, self.lg.stores[partition].epoch, task.standing_by
                    );
                    for key in 0..self.config.keys {
                        let name = format!("k{key}");
                        let holders = task.state.core().holders_of("acme", &name);
                        let waiting = task.state.core().waiting_on("acme", &name);
                        if holders + waiting > 0 {
                            eprintln!("  {name}: {holders} holders, {waiting} waiting");
                        }
                    }
                }
            }
            eprintln!(
                "client {instance}: {} unacked, directory {:?}, conns {:?}",
                self.clients[instance].unacked.len(),
                self.clients[instance].directory,
                self.conns[instance]
            );
        }
        eprintln!("workers: {} queued", self.workers.queued());
    }

    pub(crate) fn schedule_worker(&mut self, delay: i64, worker: usize, event: WorkerEvent) {
        self.at(delay, Event::Worker { worker, event });
    }
}

pub fn job_name(job: usize) -> String {
    format!("job-{job:05}")
}

pub fn job_index(job_id: &str) -> Option<usize> {
    job_id.strip_prefix("job-")?.parse().ok()
}

/// Run one seed.
pub fn run(seed: u64, config: &SimConfig) -> anyhow::Result<Report> {
    // Maps iterate in the same order in every run: a seed replays.
    sluice_common::hash::set_deterministic();
    let world = World::new(seed, config.clone())?;
    Ok(world.run(seed))
}
