//! One job partition, owned (docs/hot-path.md): its active jobs in memory,
//! and every decision about them — enqueue, grants, claims, heartbeats,
//! completions, cancels, and what falls due (run_at, retry backoffs, waits
//! long enough to re-send, unclaimed admitted jobs, leases, run timeouts,
//! stand-behind statements). Pure: no I/O, an explicit clock; the owner
//! runtime commits what it decides (`AdmissionWrites`), then sends its
//! effects. The state machine itself is `transitions`.

use std::collections::{BTreeSet, VecDeque};

// Seeded maps: what the core iterates comes out in an order a seed fixes,
// so the simulation replays a history exactly (sluice_common::hash).
use sluice_common::hash::HashMap;
use std::sync::Arc;

use sluice_common::auth::JobScope;
use sluice_common::kafka::{batch_entries, InMsg, Outbox};
use sluice_common::link::Link;
use sluice_common::owner::{OwnedState, Rejected, Reply, WriteSet};
use sluice_common::{Faults, SluiceConfig};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::consumers::{admit_message, Refusal};
use crate::effects::Routes;
use crate::jobs::JobRow;
use crate::journal::{JobChange, JournalBatch, Snapshot};
use crate::transitions::{self, AttemptEnd, Status, StreamEnd, Timing};
use crate::work::{Push, WorkerHub};

mod active;
mod enqueue;
mod grants;
mod local;
mod overtaken;
pub use overtaken::Consumers;
mod spans;
mod time;
mod worker;

/// A validated request with its id and trace context.
#[derive(Clone, Debug)]
pub struct Incoming {
    pub job_id: String,
    pub valid: crate::chain::ValidJob,
    pub trace: pb::TraceContext,
}

/// What `enqueue` does with a request whose job id exists with a different
/// request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnConflict {
    /// Save nothing of the call; answer a conflict (gRPC ALREADY_EXISTS).
    Refuse,
    /// Save the rest; the outcome says `conflict` (Kafka: a dead letter).
    Report,
}

/// How the jobs of one Enqueue call are answered, decided before anything
/// changes (`plan_enqueue`).
struct EnqueuePlan {
    outcomes: Vec<EnqueueOutcome>,
    /// Each job id new in this call, at its first index.
    first_in_call: HashMap<String, usize>,
    /// The new jobs: their index, and when their idempotency key expires.
    new_rows: Vec<(usize, i64)>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnqueueOutcome {
    pub job_id: String,
    pub status: Status,
    /// The job already existed (the same request again, or the same
    /// idempotency key within its window): nothing new was saved.
    pub deduplicated: bool,
    /// The job id exists with a different request: nothing was saved.
    pub conflict: bool,
}

/// A refused `Enqueue` call (`OnConflict::Refuse`): the index of the first
/// request whose job id exists with a different request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnqueueConflict {
    pub index: usize,
    pub job_id: String,
}

/// Why a call's jobs were refused (none of them saved).
#[derive(Clone, Debug, PartialEq)]
pub enum EnqueueError {
    Conflict(EnqueueConflict),
    Quota(QuotaRefusal),
}

/// A tenant over one of its quotas.
#[derive(Clone, Debug, PartialEq)]
pub struct QuotaRefusal {
    pub tenant: String,
    /// `max_waiting` or `max_enqueues_per_second`.
    pub quota: &'static str,
    pub message: String,
}

/// Requests from this instance's gRPC handlers and links for one job
/// partition. Each carries its reply, sent once the batch is durable.
pub enum Local {
    Enqueue {
        jobs: Vec<Incoming>,
        on_conflict: OnConflict,
        reply: oneshot::Sender<Result<Vec<EnqueueOutcome>, EnqueueError>>,
    },
    /// The job if it is active here (else the caller reads its rows).
    Describe {
        job_id: String,
        reply: oneshot::Sender<Option<JobRow>>,
    },
    /// `scope`, here and below: the jobs the caller may touch; a job out
    /// of scope is answered as if it did not exist.
    Cancel {
        job_id: String,
        reason: String,
        scope: JobScope,
        reply: oneshot::Sender<Option<Status>>,
    },
    Claim {
        worker_id: String,
        attempts: Vec<(String, u32)>,
        scope: JobScope,
        reply: oneshot::Sender<Vec<pb::ClaimResult>>,
    },
    Heartbeat {
        worker_id: String,
        attempts: Vec<(String, u32)>,
        /// Not a heartbeat: the stream these attempts were pushed on ended.
        ended: Option<StreamEnd>,
        scope: JobScope,
        reply: oneshot::Sender<Vec<pb::HeartbeatResult>>,
    },
    Complete {
        worker_id: String,
        completions: Vec<(String, u32, AttemptEnd)>,
        scope: JobScope,
        /// The worker's trace context, when its call carried one.
        caller_trace: pb::TraceContext,
        reply: oneshot::Sender<Vec<pb::CompleteResult>>,
    },
    /// Grant events from the links.
    Grants(Vec<pb::GrantEvent>),
    /// Stream workers have credits again: push the admitted jobs that wait
    /// for them.
    Dispatch,
    /// These attempts were just written to `worker_id`'s stream: their
    /// leases run from now (docs/worker-protocol.md §7).
    Pushed {
        worker_id: String,
        attempts: Vec<(String, u32)>,
        /// When the push stamped the lease ends it told the worker: the
        /// partition's lease ends are never before those.
        written_at_ms: i64,
    },
    /// The path to the owners of some limit or rate partitions changed: a
    /// link stream to their owner opened again after a break, or the owner
    /// directory names a new owner for them. Every acquire a job waits on
    /// there is sent again at once (a command or its grant may have been
    /// lost on the old path; a copy is harmless).
    PathChanged {
        link: Link,
        /// The owner partitions (of `link`'s service) whose path changed.
        partitions: Vec<i32>,
    },
    /// Requests read from `jobs.requested` by this instance, for a partition
    /// it owns: the same as their hand-over through `sluice.jobs`, without
    /// the broker round trip. Answered once they are saved.
    HandOver {
        handovers: Vec<HandOver>,
        reply: oneshot::Sender<()>,
    },
    /// Changes nothing; answered once the batch holding it is committed and
    /// sent (`sluice_common::owner::BarrierLocal`).
    Barrier(oneshot::Sender<()>),
}

impl sluice_common::owner::BarrierLocal for Local {
    fn barrier(reply: oneshot::Sender<()>) -> Self {
        Local::Barrier(reply)
    }
}

/// A job that is not active in this partition, as its rows say.
#[derive(Clone, Debug)]
pub struct StoredJob {
    /// The job, with its outcome's state when it ended.
    pub row: JobRow,
    pub finished: bool,
}

/// What `AdmissionStore::prepare` read for a batch.
#[derive(Debug, Default)]
pub struct Prepared {
    /// Jobs the batch names that are not active here, by id (absent: no
    /// such job).
    pub stored: HashMap<String, StoredJob>,
    /// Holders of the idempotency keys the batch's new jobs name:
    /// (tenant, key) → (job id, expires_at_ms).
    pub idempotency: HashMap<(String, String), (String, i64)>,
    /// Payloads of active jobs whose payload is not in memory.
    pub payloads: HashMap<String, Vec<u8>>,
    /// Handed-over requests, checked: by (offset, entry index).
    pub handovers: HashMap<(i64, usize), HandOver>,
}

/// A request handed over through `sluice.jobs`, as checked.
#[derive(Clone, Debug)]
pub struct HandOver {
    /// The producer's message as it was read from its topic.
    pub source_topic: String,
    pub source: InMsg,
    pub checked: Result<Incoming, Refusal>,
}

/// What a batch saves.
#[derive(Debug, Default)]
pub struct AdmissionWrites {
    /// New jobs (their rows).
    pub inserted: Vec<JobRow>,
    /// Jobs that ended (their outcome rows).
    pub finished: Vec<JobRow>,
    /// Idempotency keys taken: (tenant, key, job id, expires_at_ms).
    pub idempotency: Vec<(String, String, String, i64)>,
    /// The batch's journal entry, numbered.
    pub journal: Option<(i64, JournalBatch)>,
    /// A snapshot of the partition after this batch, when due.
    pub snapshot: Option<(i64, Snapshot)>,
}

impl WriteSet for AdmissionWrites {
    fn is_empty(&self) -> bool {
        self.inserted.is_empty()
            && self.finished.is_empty()
            && self.idempotency.is_empty()
            && self.journal.is_none()
            && self.snapshot.is_none()
    }
}

/// What a partition is configured with.
#[derive(Clone)]
pub struct PartitionSettings {
    pub partition: i32,
    pub config: Arc<SluiceConfig>,
    pub routes: Arc<Routes>,
    pub timing: Timing,
    pub stand_behind_interval_ms: i64,
    pub ticket_grace_ms: i64,
    pub faults: Faults,
    /// This instance's `Work` stream sessions (dispatch is the claim).
    pub hub: Arc<WorkerHub>,
    /// Per-tenant quotas, shared by the instance's partitions.
    pub quotas: Arc<crate::quota::Quotas>,
    /// What claims showed of the admitted topics' consumers, shared by the
    /// instance's partitions (`partition/overtaken.rs`).
    pub consumers: overtaken::Consumers,
}

/// An active job and whether its payload is in memory.
#[derive(Clone, Debug)]
struct Active {
    row: JobRow,
    payload_loaded: bool,
}

/// `unclaimed` queues shorter than this are never compacted.
const UNCLAIMED_COMPACT_FROM: usize = 1024;

/// The journal always grows to at least this before a snapshot replaces it.
const MIN_JOURNAL_BEFORE_SNAPSHOT: usize = 1 << 20;

/// One owned job partition.
pub struct AdmissionPartition {
    settings: PartitionSettings,
    /// Boxed: a map grows to twice what it holds, and an unboxed row would
    /// make that slack cost a whole row per empty slot (issue 30).
    jobs: HashMap<String, Box<Active>>,
    /// (due_at_ms, job id) of every active job that has a due time.
    timers: BTreeSet<(i64, String)>,
    /// Admitted jobs to publish once their payload is read.
    awaiting_payload: BTreeSet<String>,
    payload_bytes: usize,
    next_stand_behind_ms: i64,
    /// The last journal entry's number.
    journal_seq: i64,
    journal_bytes_since_snapshot: usize,
    last_snapshot_bytes: usize,
    snapshot_due: bool,
    last_enqueued_at_us: i64,
    prepared: Prepared,
    /// Changes of the batch being decided, by job id.
    changes: HashMap<String, JobChange>,
    /// Admitted jobs that wait for a stream worker's credit, by task group,
    /// oldest first (an entry whose job moved on is skipped).
    unclaimed: HashMap<String, VecDeque<String>>,
    /// Entries `unclaimed` kept at its last compaction.
    unclaimed_kept: usize,
    /// Admitted jobs published to their task group's topic and not claimed
    /// yet: published again when jobs published after them are claimed
    /// first (`overtaken`).
    overtaken: overtaken::Overtaken,
    /// Jobs the batch being decided claimed for stream workers, by session.
    pushes: HashMap<u64, Push>,
    /// The time the batch being decided is decided at.
    now_ms: i64,
    /// A crash-point fault hook fired in this batch: the runtime stops the
    /// partition as a crash would, right after the commit.
    crash_after_commit: bool,
    /// Unfinished jobs here, by tenant (`max_waiting`).
    active_by_tenant: HashMap<String, u64>,
    /// Rate tokens by tenant (`max_enqueues_per_second`).
    buckets: HashMap<String, crate::quota::Bucket>,
    /// Spans the batch being decided planned, recorded once it is
    /// committed (its observations).
    planned_spans: Vec<sluice_common::telemetry::PlannedSpan>,
    /// Every request the instance received up to this time is in this
    /// batch or an earlier one (`OwnedState::requests_received_through`):
    /// a lease that ended later does not end while one may still wait.
    requests_received_through_ms: i64,
    /// Taken over from a live owner (`OwnerContext::previous_owner_alive`):
    /// its pushes reached their streams, so none is treated as lost with it.
    from_live_owner: bool,
}

/// Where a batch's decisions go.
struct Out<'a> {
    writes: &'a mut AdmissionWrites,
    outbox: &'a mut Outbox,
    replies: &'a mut Vec<Reply>,
}

impl AdmissionPartition {
    /// A partition holding `jobs` (loaded), whose journal ends at
    /// `journal_seq`. `snapshot_bytes` is the size of the snapshot it was
    /// loaded from (none: a snapshot is written with the first batch).
    pub fn new(
        settings: PartitionSettings,
        jobs: impl IntoIterator<Item = JobRow>,
        journal_seq: i64,
        snapshot_bytes: Option<usize>,
        journal_bytes: usize,
    ) -> Self {
        let jobs = jobs.into_iter();
        let overtaken = overtaken::Overtaken::new(settings.consumers.clone());
        let mut partition = AdmissionPartition {
            settings,
            jobs: HashMap::with_capacity_and_hasher(jobs.size_hint().0, Default::default()),
            timers: BTreeSet::new(),
            awaiting_payload: BTreeSet::new(),
            payload_bytes: 0,
            next_stand_behind_ms: 0,
            journal_seq,
            journal_bytes_since_snapshot: journal_bytes,
            last_snapshot_bytes: snapshot_bytes.unwrap_or(0),
            snapshot_due: snapshot_bytes.is_none(),
            last_enqueued_at_us: 0,
            prepared: Prepared::default(),
            changes: HashMap::default(),
            unclaimed: HashMap::default(),
            unclaimed_kept: 0,
            overtaken,
            pushes: HashMap::default(),
            now_ms: 0,
            crash_after_commit: false,
            active_by_tenant: HashMap::default(),
            buckets: HashMap::default(),
            planned_spans: Vec::new(),
            requests_received_through_ms: i64::MAX,
            from_live_owner: false,
        };
        for row in jobs {
            partition.last_enqueued_at_us = partition.last_enqueued_at_us.max(row.enqueued_at_us);
            if row.state.status == Status::Admitted {
                // A new owner publishes them again (the old one may not have).
                partition.awaiting_payload.insert(row.state.job_id.clone());
            }
            partition.put(row, false);
        }
        partition
    }

    /// This partition was taken over from an owner that was alive (a
    /// handover: the group moved it, or a member took it from one that held
    /// it provisionally), not one that crashed.
    pub fn handed_over_by_live_owner(&mut self, alive: bool) {
        self.from_live_owner = alive;
    }

    /// A new owner's lease for every running attempt. A confirmed attempt
    /// (its worker claimed it, or heartbeated the push) keeps the lease its
    /// worker was last told, plus a second for clocks that differ between
    /// instances: every renewal is saved before it is answered, and the
    /// worker stops the job when that lease passes without a renewal
    /// (docs/worker-protocol.md §3, §7), so a longer one only holds a dead
    /// or stopped worker's slots. Before renewals were saved, a takeover
    /// gave every confirmed attempt a whole lease from serving: in two
    /// `make chaos` runs an attempt abandoned by its worker as an
    /// admission instance was killed got one at a takeover 9 s later, and
    /// its key waited 10.3 s. A worker whose heartbeat reached the instance
    /// before its lease ended is not cut off by a long load: the lease end
    /// waits for requests received before it, and a heartbeat is applied
    /// before the batch's timers.
    ///
    /// An attempt pushed on a `Work` stream that its worker has not
    /// confirmed gets the stream end grace from `now_ms` instead: the old
    /// owner may have died with the push unsent, and its streams ended with
    /// it, so this is a stream end that nobody reported. Its lease ran from
    /// the push, which is not saved. A worker that holds the attempt
    /// heartbeats it every third of the grace (at once when its stream
    /// ends) and keeps it; a lost push no longer holds its slots for a
    /// whole lease.
    ///
    /// An attempt whose `Work` stream ended without a word from its worker
    /// since (`JobState::stream_ended_at_ms`, saved) keeps the lease its
    /// stream end left it: its worker is gone or stops the job within the
    /// grace of its last renewal. A make chaos run (stream workers) left a
    /// key idle for 20 s because a killed worker's attempts got a fresh
    /// lease at each of three takeovers in a row.
    ///
    /// Taken over from a live owner (`handed_over_by_live_owner`), an
    /// unconfirmed push keeps the whole lease from `now_ms`: that owner did
    /// not die with it unsent (a push is sent after its commit, on a stream
    /// its live instance holds; a stream that ends is reported), and a
    /// worker's first word — often the completion of a short job — may have
    /// been queued in the old owner when it was fenced and reach this one
    /// seconds later. A 100,000-job backlog run had 124 jobs run twice this
    /// way, each pushed by an owner that resumed the partition after a kill
    /// and handed it to the group's assignee 5 s later.
    pub fn grant_lease_grace(&mut self, now_ms: i64) {
        let stream_end_grace_ms =
            i64::try_from(self.settings.config.admission.stream_end_grace.0.as_millis()).unwrap_or(i64::MAX);
        let running: Vec<String> = self
            .jobs
            .values()
            .filter(|active| matches!(active.row.state.status, Status::Running | Status::Cancelling))
            .map(|active| active.row.state.job_id.clone())
            .collect();
        let from_live_owner = self.from_live_owner;
        for job_id in running {
            // `confirmed` stays as saved: an attempt its worker confirmed
            // (to any owner) and then lost is a lease expiry that uses an
            // attempt, whoever owns the partition by then.
            self.update_unsaved(&job_id, |state| {
                let from_now = |lease_ms: i64| now_ms.saturating_add(lease_ms);
                let stream_ended = state.stream_ended_at_ms.filter(|_| state.pushed);
                state.lease_expires_at_ms = Some(if let Some(ended_at) = stream_ended {
                    // Its stream ended and its worker was not heard from
                    // since (a renewal after the end is saved and clears
                    // this): the shortened lease stands, however many
                    // takeovers follow. Its worker's last renewal answered
                    // was sent before the end (plus the clock allowance),
                    // and holds for the grace at most.
                    let held_at_most = ended_at
                        .saturating_add(transitions::STREAM_END_CLOCK_SKEW_MS)
                        .saturating_add(state.lease_ms.min(stream_end_grace_ms));
                    state.lease_expires_at_ms.unwrap_or(held_at_most).max(held_at_most)
                } else if state.confirmed {
                    // The lease its worker was last told (saved with the
                    // answer), in the previous owner's clock.
                    state.lease_expires_at_ms.map_or_else(
                        || from_now(state.lease_ms),
                        |told| told.saturating_add(transitions::STREAM_END_CLOCK_SKEW_MS),
                    )
                } else if from_live_owner {
                    let whole = from_now(state.lease_ms);
                    state.lease_expires_at_ms.unwrap_or(whole).max(whole)
                } else {
                    from_now(state.lease_ms.min(stream_end_grace_ms))
                });
                state.due_at_ms = transitions::running_due_at(state);
            });
        }
    }

    /// A new owner re-sends every waiting job's acquire at its takeover
    /// (`resend_all`) and publishes every admitted job again (`new`): their
    /// timer re-sends start over from `now_ms` (the saved due times are those
    /// of an older re-send, or of none: re-sends are not saved).
    pub fn restart_resend_timers(&mut self, now_ms: i64) {
        let timing = self.settings.timing;
        let active_jobs = self.jobs.len();
        let pending: Vec<(String, i64)> = self
            .jobs
            .values()
            .filter_map(|active| {
                let base = match active.row.state.status {
                    Status::Waiting => timing.resend_waiting_after_ms,
                    Status::Admitted => timing.claim_timeout_ms,
                    _ => return None,
                };
                Some((active.row.state.job_id.clone(), base))
            })
            .collect();
        for (job_id, base) in pending {
            self.update_unsaved(&job_id, |state| {
                state.due_at_ms = Some(now_ms.saturating_add(transitions::resend_interval(base, active_jobs)));
            });
        }
    }

    pub fn active_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Every active job's row, in no order.
    pub fn active_rows(&self) -> impl Iterator<Item = &JobRow> + '_ {
        self.jobs.values().map(|active| &active.row)
    }

    pub fn job(&self, job_id: &str) -> Option<&JobRow> {
        self.jobs.get(job_id).map(|active| &active.row)
    }

    /// Ids of active jobs whose payload is not in memory, among `job_ids`
    /// and those waiting to be published (`AdmissionStore::prepare`).
    pub fn payloads_needed<'a>(&'a self, job_ids: impl Iterator<Item = &'a str>) -> Vec<String> {
        let mut needed: BTreeSet<String> = self.awaiting_payload.clone();
        for job_id in job_ids {
            if self.jobs.get(job_id).is_some_and(|active| !active.payload_loaded) {
                needed.insert(job_id.to_string());
            }
        }
        needed.into_iter().collect()
    }

    pub fn settings(&self) -> &PartitionSettings {
        &self.settings
    }
}

/// Decode and check a handed-over request as it was read from its topic.
pub fn checked_handover(config: &SluiceConfig, handover: pb::JobHandOver) -> HandOver {
    let source = InMsg {
        partition: handover.source_partition,
        offset: handover.source_offset,
        key: None,
        payload: Some(handover.payload),
        headers: handover
            .headers
            .into_iter()
            .map(|header| (header.name, header.value))
            .collect(),
        timestamp_ms: (handover.source_timestamp_ms != 0).then_some(handover.source_timestamp_ms),
    };
    let checked = admit_message(config, &handover.source_topic, &source).map(|mut incoming| {
        // The id the edge derived (a request without one gets one from where
        // it was read), whatever re-deriving it here would give.
        if !handover.job_id.is_empty() {
            incoming.job_id = handover.job_id.clone();
        }
        incoming
    });
    HandOver {
        source_topic: handover.source_topic,
        source,
        checked,
    }
}

impl OwnedState for AdmissionPartition {
    type Local = Local;
    type Writes = AdmissionWrites;
    type Prepared = Prepared;

    fn prepared(&mut self, prepared: Prepared) {
        self.prepared = prepared;
    }

    fn requests_received_through(&mut self, through_ms: i64) {
        self.requests_received_through_ms = through_ms;
    }

    fn apply(
        &mut self,
        now_ms: i64,
        messages: &[InMsg],
        locals: Vec<Local>,
        writes: &mut AdmissionWrites,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
        rejected: &mut Vec<Rejected>,
    ) {
        self.changes.clear();
        self.pushes.clear();
        self.now_ms = now_ms;
        let mut out = Out {
            writes,
            outbox,
            replies,
        };
        self.publish_read_payloads(&mut out);
        for message in messages {
            let payload = message.payload.as_deref().unwrap_or_default();
            let entries = match batch_entries(payload) {
                Ok(entries) => entries,
                Err(error) => {
                    rejected.push(Rejected {
                        offset: message.offset,
                        entry: payload.to_vec(),
                        reason: format!("undecodable job hand-over batch: {error}"),
                    });
                    continue;
                }
            };
            for (index, entry) in entries.into_iter().enumerate() {
                let handover = match self.prepared.handovers.remove(&(message.offset, index)) {
                    Some(handover) => handover,
                    None => match self.check_handover(entry) {
                        Ok(handover) => handover,
                        Err(reason) => {
                            rejected.push(Rejected {
                                offset: message.offset,
                                entry: entry.to_vec(),
                                reason,
                            });
                            continue;
                        }
                    },
                };
                self.hand_over(now_ms, handover, &mut out);
            }
        }
        for local in locals {
            self.apply_local(now_ms, local, &mut out);
        }
        // Timers last: what workers sent before this batch ran (a
        // completion, a heartbeat, a push written) was sent before `now_ms`
        // and is applied first, so a batch that waited behind a slow commit
        // does not hand an attempt back that its worker already completed.
        self.run_timers(now_ms, &mut out);
        self.prepared = Prepared::default();
        self.queue_pushes(&mut out);
        self.close_batch(out.writes);
        for span in self.planned_spans.drain(..) {
            out.outbox.observe(move || span.record());
        }
    }

    fn crash_after_commit(&mut self) -> bool {
        std::mem::take(&mut self.crash_after_commit)
    }

    /// Running attempts get their takeover lease, and re-send timers start
    /// over, from when this owner serves: a worker that completed a pushed
    /// attempt while the takeover loaded and re-sent (seconds under load)
    /// is heard before its attempt could be handed back as never run.
    fn begin_serving(&mut self, now_ms: i64) {
        self.grant_lease_grace(now_ms);
        self.restart_resend_timers(now_ms);
    }

    fn resend_all(&self, now_ms: i64, outbox: &mut Outbox) {
        for active in self.jobs.values() {
            if active.row.state.status == Status::Waiting {
                self.settings.routes.push_acquire(outbox, &active.row, now_ms);
            }
        }
        self.stand_behind(now_ms, outbox);
    }

    fn next_wakeup_ms(&self) -> Option<i64> {
        if !self.awaiting_payload.is_empty() || self.snapshot_due {
            return Some(0);
        }
        let timer = self.timers.first().map(|(due, _)| *due);
        let overtaken = self
            .overtaken
            .next_due_ms(self.now_ms, self.settings.timing.claim_overtaken_after_ms);
        let next = timer.map_or(self.next_stand_behind_ms, |due| due.min(self.next_stand_behind_ms));
        Some(overtaken.map_or(next, |due| due.min(next)))
    }
}

#[cfg(test)]
#[path = "partition_tests.rs"]
mod tests;
