//! The simulated cluster: events on one clock, in one thread, from one
//! seed.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sluice_common::SluiceConfig;

use crate::checks::Checks;
use crate::model::ServiceModel;
use crate::services::{Admission, LimitGrant};
use crate::workers::{WorkerEvent, Workers};

pub use crate::calls::{Answer, CallKind, PendingCall};
pub use crate::config::{SimConfig, Trace};
use crate::links::{LinkAck, LinkClient, Router};
pub use crate::report::Report;

/// Epoch milliseconds at simulated time 0.
pub const BASE_MS: i64 = 1_800_000_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Svc {
    Admission,
    LimitGrant,
}

#[derive(Debug)]
pub(crate) enum Event {
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
        /// When the group decided it: a revoke is overtaken only by an
        /// assignment to the same member after it.
        decided_at: i64,
    },
    IdleCheck {
        svc: Svc,
        instance: usize,
        partition: usize,
    },
    /// A takeover is done: the task of `epoch` serves.
    Serve {
        svc: Svc,
        instance: usize,
        partition: usize,
        epoch: i64,
    },
    /// Callers waiting for a loading partition give up.
    LoadingWaitOver {
        svc: Svc,
        instance: usize,
        partition: usize,
    },
    Check,
}

pub struct World {
    pub now: i64,
    pub rng: StdRng,
    pub(crate) seq: u64,
    pub(crate) events: BinaryHeap<Reverse<(i64, u64, usize)>>,
    pub(crate) slots: Vec<Option<Event>>,
    pub(crate) free: Vec<usize>,
    pub config: SimConfig,
    pub sluice: Arc<SluiceConfig>,
    pub adm: ServiceModel<Admission>,
    pub lg: ServiceModel<LimitGrant>,
    pub(crate) clients: Vec<LinkClient>,
    pub(crate) routers: Vec<Router>,
    /// `conns[adm][owner]`: the link's generation when open.
    pub(crate) conns: Vec<Vec<Option<u64>>>,
    /// When the last message on a link arrives, by (link generation,
    /// towards the owner): a link is one gRPC stream, which delivers each
    /// way in the order sent (TCP reorders nothing within it).
    pub(crate) conn_last_arrival: std::collections::BTreeMap<(u64, bool), i64>,
    pub(crate) next_conn: u64,
    /// The claims each admission instance last sent.
    pub(crate) claims: Vec<Vec<(usize, i64)>>,
    pub calls: Vec<PendingCall>,
    pub(crate) link_acks: Vec<LinkAck>,
    pub(crate) next_token: u64,
    /// A crash point armed for the next committed batch of (service,
    /// instance): the instance dies after the commit, before sending.
    pub(crate) crash_after_commit: BTreeSet<(Svc, usize)>,
    pub workers: Workers,
    pub checks: Checks,
    /// Requests not yet answered: job index → token.
    pub(crate) producing: BTreeMap<u64, usize>,
    /// Commit failures still to come, per (service, partition).
    pub(crate) failing_commits: BTreeMap<(Svc, usize), u32>,
    /// The earliest run event queued for each partition task.
    pub(crate) queued_runs: BTreeMap<(Svc, usize, usize), i64>,
    pub faults: u64,
    pub steps: u64,
    /// The digest of the events handled so far (`Trace::Digest`, `Print`).
    pub(crate) digest: Option<std::hash::DefaultHasher>,
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
                // The waiting acquire's re-send is a backstop: a slow one
                // lets the stall check see a recovery that leans on it
                // (a lost grant is sent again at admission's next sweep,
                // every 10 s, not at this timer's pace).
                ("admission.resend_waiting_after", "60s"),
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
            conn_last_arrival: std::collections::BTreeMap::new(),
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

    pub(crate) fn at(&mut self, delay_ms: i64, event: Event) {
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

    pub(crate) fn net_delay(&mut self) -> i64 {
        self.rng.random_range(1..=15)
    }

    /// The delay of a message on link `conn` (`to_owner`: admission to
    /// limit-grant, else back): a network delay, but never arriving before
    /// the message sent before it the same way.
    pub(crate) fn conn_delay(&mut self, conn: u64, to_owner: bool) -> i64 {
        let delay = self.net_delay();
        let last = self.conn_last_arrival.get(&(conn, to_owner)).copied().unwrap_or(0);
        let arrival = (self.now + delay).max(last);
        self.conn_last_arrival.insert((conn, to_owner), arrival);
        arrival - self.now
    }

    /// The clock of a partition's owner (anchored at PostgreSQL's).
    pub fn clock_ms(&self) -> i64 {
        BASE_MS + self.now
    }

    pub(crate) fn start(&mut self) {
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
            // Jobs arrive through the faults, not all at once: a job new to
            // an owner that took over must exist for some bugs to show.
            let delay = i64::try_from(job).unwrap_or(0) * self.config.produce_every_ms + 50;
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
        if self.checks.violation.is_none() {
            self.check_stalls_after_faults();
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

    /// Once the faults stopped, no key waits long with nothing running:
    /// what recovers from a fault (re-sent grants, refused commands sent
    /// again, leases that end, partitions taken over) does so within
    /// `stall_bound_ms`, not at a backstop timer's pace.
    fn check_stalls_after_faults(&mut self) {
        let since = self.config.faults_until_ms;
        if let Some((key, from, to)) = self.checks.longest_stall_after(since, self.now) {
            if to - from > self.config.stall_bound_ms {
                self.checks.violation = Some(format!(
                    "stall after the faults stopped: key k{key} had jobs waiting and none running from {from} ms to {to} ms ({} ms, bound {} ms)",
                    to - from,
                    self.config.stall_bound_ms
                ));
            }
        }
    }

    /// Fold the event into the digest (std's `DefaultHasher::new` has fixed
    /// keys: the same in every process), and print it with `Trace::Print`.
    pub(crate) fn record(&mut self, event: &Event) {
        let Some(digest) = self.digest.as_mut() else {
            return;
        };
        let line = format!("{} {event:?}", self.now);
        std::hash::Hash::hash(&line, digest);
        if self.config.trace == Trace::Print {
            eprintln!("{line}");
        }
    }

    pub(crate) fn handle(&mut self, event: Event) {
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
            Event::Check => {
                self.check_owners();
                self.at(250, Event::Check);
            }
            owners => self.handle_owners(owners),
        }
    }

    /// The events of the group and the owners' tasks (faults.rs, owners.rs).
    fn handle_owners(&mut self, event: Event) {
        match event {
            Event::Fault => self.fault(),
            Event::Restart { svc, instance } => self.restart(svc, instance),
            Event::Reassign { svc, partition, to } => self.reassign(svc, partition, to),
            Event::Revoke {
                svc,
                instance,
                partition,
                decided_at,
            } => self.revoke(svc, instance, partition, decided_at),
            Event::IdleCheck {
                svc,
                instance,
                partition,
            } => self.idle_check(svc, instance, partition),
            Event::Serve {
                svc,
                instance,
                partition,
                epoch,
            } => self.serve(svc, instance, partition, epoch),
            Event::LoadingWaitOver {
                svc,
                instance,
                partition,
            } => self.loading_wait_over(svc, instance, partition),
            _ => {}
        }
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
