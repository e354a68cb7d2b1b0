//! One job partition, owned (docs/hot-path.md): its active jobs in memory,
//! and every decision about them — enqueue, grants, claims, heartbeats,
//! completions, cancels, and what falls due (run_at, retry backoffs, waits
//! long enough to re-send, unclaimed admitted jobs, leases, run timeouts,
//! stand-behind statements). Pure: no I/O, an explicit clock; the owner
//! runtime commits what it decides (`AdmissionWrites`), then sends its
//! effects. The state machine itself is `transitions`.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

// Seeded maps: what the core iterates comes out in an order a seed fixes,
// so the simulation replays a history exactly (sluice_common::hash).
use sluice_common::hash::{HashMap, HashSet};
use std::sync::Arc;

use opentelemetry::KeyValue;
use sluice_common::auth::JobScope;
use sluice_common::kafka::{batch_entries, InMsg, Outbox};
use sluice_common::link::Link;
use sluice_common::owner::{OwnedState, Rejected, Reply, WriteSet};
use sluice_common::telemetry::record_span;
use sluice_common::{FaultPoint, Faults, SluiceConfig};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::chain::StoredStep;
use crate::consumers::{admit_message, Refusal};
use crate::effects::{count_dead_letters, DeadLetterClass, Routes};
use crate::jobs::{request_fingerprint, JobRow};
use crate::journal::{JobChange, JobDynamic, JournalBatch, Snapshot, SnapshotJob};
use crate::transitions::{self, AttemptEnd, Effect, JobState, Status, StreamEnd, Timing};
use crate::work::{Push, WorkerHub};

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
    jobs: HashMap<String, Active>,
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
        jobs: Vec<JobRow>,
        journal_seq: i64,
        snapshot_bytes: Option<usize>,
        journal_bytes: usize,
    ) -> Self {
        let mut partition = AdmissionPartition {
            settings,
            jobs: HashMap::with_capacity_and_hasher(jobs.len(), Default::default()),
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
            pushes: HashMap::default(),
            now_ms: 0,
            crash_after_commit: false,
            active_by_tenant: HashMap::default(),
            buckets: HashMap::default(),
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

    /// A new owner gives every running job one lease from `now_ms`: a worker
    /// whose heartbeats reached the old owner within its lease keeps it.
    /// An attempt pushed on a `Work` stream gets the stream end grace
    /// instead (if shorter): the old owner may have died with the push
    /// unsent, and its streams ended with it, so this is a stream end that
    /// nobody reported. A worker that holds the attempt heartbeats it every
    /// third of the grace (at once when its stream ends) and keeps it; a lost
    /// push no longer holds its slots for a whole lease. Safe for a live
    /// worker: its own renewal counts for the grace at most from when it was
    /// sent, so it stops the handler before this lease ends.
    pub fn grant_lease_grace(&mut self, now_ms: i64) {
        let stream_end_grace_ms =
            i64::try_from(self.settings.config.admission.stream_end_grace.0.as_millis()).unwrap_or(i64::MAX);
        let running: Vec<String> = self
            .jobs
            .values()
            .filter(|active| matches!(active.row.state.status, Status::Running | Status::Cancelling))
            .map(|active| active.row.state.job_id.clone())
            .collect();
        for job_id in running {
            // `confirmed` stays as saved: an attempt its worker confirmed
            // (to any owner) and then lost is a lease expiry that uses an
            // attempt, whoever owns the partition by then.
            self.update_unsaved(&job_id, |state| {
                state.lease_expires_at_ms = Some(if state.pushed {
                    now_ms.saturating_add(state.lease_ms.min(stream_end_grace_ms))
                } else {
                    let grace = now_ms.saturating_add(state.lease_ms);
                    state.lease_expires_at_ms.unwrap_or(grace).max(grace)
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

    // -- keeping jobs, timers and changes -------------------------------

    fn put(&mut self, row: JobRow, payload_loaded: bool) {
        let job_id = row.state.job_id.clone();
        if let Some(due) = row.state.due_at_ms {
            self.timers.insert((due, job_id.clone()));
        }
        if payload_loaded {
            self.payload_bytes += row.payload.len();
        }
        *self.active_by_tenant.entry(row.tenant.clone()).or_default() += 1;
        if let Some(replaced) = self.jobs.insert(job_id, Active { row, payload_loaded }) {
            self.forget_tenant_job(&replaced.row.tenant);
        }
    }

    fn forget_tenant_job(&mut self, tenant: &str) {
        if let Some(count) = self.active_by_tenant.get_mut(tenant) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                self.active_by_tenant.remove(tenant);
            }
        }
    }

    /// Change a job's state, keeping its timer and the batch's changes.
    fn update(&mut self, job_id: &str, change: impl FnOnce(&mut JobState)) {
        let Some(history_before) = self.update_unsaved(job_id, change) else {
            return;
        };
        let Some(active) = self.jobs.get(job_id) else {
            return;
        };
        let state = &active.row.state;
        let entry = self.changes.entry(job_id.to_string()).or_insert_with(|| JobChange {
            job_id: job_id.to_string(),
            ..Default::default()
        });
        entry.state = Some(JobDynamic::of(state));
        if state.history.records.len() >= history_before && entry.history.is_none() {
            entry
                .history_added
                .extend(state.history.records[history_before..].iter().cloned());
        } else {
            // The oldest records were dropped (the history is bounded): the
            // journal keeps the whole of it.
            entry.history_added.clear();
            entry.history = Some(state.history.clone());
        }
    }

    /// Change a job's state in memory only (a lease extended: a new owner
    /// gives every running attempt a lease of its own), keeping its timer.
    /// The length of its history before the change; `None`: no such job.
    fn update_unsaved(&mut self, job_id: &str, change: impl FnOnce(&mut JobState)) -> Option<usize> {
        let active = self.jobs.get_mut(job_id)?;
        let old_due = active.row.state.due_at_ms;
        let history_before = active.row.state.history.records.len();
        change(&mut active.row.state);
        let new_due = active.row.state.due_at_ms;
        if old_due != new_due {
            if let Some(due) = old_due {
                self.timers.remove(&(due, job_id.to_string()));
            }
            if let Some(due) = new_due {
                self.timers.insert((due, job_id.to_string()));
            }
        }
        Some(history_before)
    }

    /// Remove a job that ended: its outcome is saved, and it leaves memory.
    fn finish(&mut self, job_id: &str, out: &mut Out<'_>) {
        let Some(active) = self.jobs.remove(job_id) else {
            return;
        };
        self.forget_tenant_job(&active.row.tenant);
        if let Some(due) = active.row.state.due_at_ms {
            self.timers.remove(&(due, job_id.to_string()));
        }
        if active.payload_loaded {
            self.payload_bytes = self.payload_bytes.saturating_sub(active.row.payload.len());
        }
        self.awaiting_payload.remove(job_id);
        let entry = self.changes.entry(job_id.to_string()).or_insert_with(|| JobChange {
            job_id: job_id.to_string(),
            ..Default::default()
        });
        entry.removed = true;
        entry.state = Some(JobDynamic::of(&active.row.state));
        out.writes.finished.push(active.row);
    }

    fn after_transition(&mut self, job_id: &str, effects: &[Effect], out: &mut Out<'_>) {
        let has_releases = effects.iter().any(|effect| matches!(effect, Effect::Release { .. }));
        let drop_releases = has_releases && self.settings.faults.hit(FaultPoint::AdmissionDropRelease);
        let Some(active) = self.jobs.get(job_id) else {
            return;
        };
        let kept: Vec<Effect> = effects
            .iter()
            .filter(|effect| !(drop_releases && matches!(effect, Effect::Release { .. })))
            .cloned()
            .collect();
        let wants_publish = kept.iter().any(|effect| matches!(effect, Effect::Admitted));
        let sendable: Vec<Effect> = kept
            .into_iter()
            .filter(|effect| !matches!(effect, Effect::Admitted))
            .collect();
        self.settings
            .routes
            .push_effects(out.outbox, &active.row, &sendable, self.now_ms);
        let finished = active.row.state.is_finished();
        if wants_publish {
            self.publish_admitted(job_id, out);
        }
        if finished {
            self.finish(job_id, out);
        }
    }

    /// Hand an admitted job to its task group's workers once its payload is
    /// in memory: claimed for a stream worker that has a credit (pushed
    /// after the commit), else kept for one while stream workers of the
    /// group are connected, else published to `jobs.admitted.<group>`.
    fn publish_admitted(&mut self, job_id: &str, out: &mut Out<'_>) {
        let Some(active) = self.jobs.get(job_id) else {
            return;
        };
        if !active.payload_loaded {
            self.awaiting_payload.insert(job_id.to_string());
            return;
        }
        let task_group = active.row.task_group.clone();
        let tenant = active.row.tenant.clone();
        let hub = self.settings.hub.clone();
        if let Some(session) = hub.take(&task_group, &tenant) {
            self.dispatch(job_id, session);
            return;
        }
        // Ask to be woken by the next credit, then look once more: a credit
        // that came in between is not missed.
        hub.want(&task_group, self.settings.partition);
        if let Some(session) = hub.take(&task_group, &tenant) {
            self.dispatch(job_id, session);
            return;
        }
        self.remember_unclaimed(&task_group, job_id);
        if hub.has_sessions(&task_group, &tenant) {
            // Stream workers of the group are connected: the job waits for
            // their credit.
            return;
        }
        // The admitted message carries its own span's context: the worker's
        // handler span hangs below it.
        let published = self.with_admitted_span(job_id);
        if let Some(published) = published {
            self.settings.routes.push_admitted(out.outbox, &published, self.now_ms);
        }
    }

    /// Keep an admitted job nobody claimed for the next stream credit (a
    /// job published to Kafka too: whichever claim comes first wins).
    /// Entries of jobs that moved on are dropped now and then, so the queue
    /// stays within twice what it must hold.
    fn remember_unclaimed(&mut self, task_group: &str, job_id: &str) {
        let queue = self.unclaimed.entry(task_group.to_string()).or_default();
        queue.push_back(job_id.to_string());
        if queue.len() < UNCLAIMED_COMPACT_FROM || queue.len() < 2 * self.unclaimed_kept {
            return;
        }
        let jobs = &self.jobs;
        let mut seen = HashSet::with_capacity_and_hasher(queue.len(), Default::default());
        queue.retain(|job_id| {
            jobs.get(job_id)
                .is_some_and(|active| active.row.state.status == Status::Admitted)
                && seen.insert(job_id.clone())
        });
        self.unclaimed_kept = queue.len();
    }

    /// The job's row with the trace context of its `admission.admit` span.
    fn with_admitted_span(&self, job_id: &str) -> Option<JobRow> {
        let active = self.jobs.get(job_id)?;
        let now = std::time::SystemTime::now();
        let admitted_trace = record_span(SCOPE, "admission.admit", &active.row.trace, now, now, || {
            vec![
                KeyValue::new("sluice.job_id", job_id.to_string()),
                KeyValue::new("sluice.attempt", i64::from(active.row.state.attempt)),
                KeyValue::new("sluice.task_group", active.row.task_group.clone()),
            ]
        });
        let mut published = active.row.clone();
        published.trace = admitted_trace;
        Some(published)
    }

    /// Claim an admitted job for a stream session's worker (a credit taken)
    /// and queue its push for after the commit.
    fn dispatch(&mut self, job_id: &str, session: Arc<crate::work::WorkSession>) {
        let worker_id = session.worker_id.clone();
        // Not confirmed until the worker heartbeats: a push can be lost.
        if !self.claim_admitted(job_id, &worker_id, self.now_ms, false) {
            return;
        }
        let Some(dispatched) = self.with_admitted_span(job_id).map(|row| pb::DispatchedJob {
            lease_expires_at_ms: row.state.lease_expires_at_ms.unwrap_or_default(),
            job: Some(self.settings.routes.admitted_job(&row, self.now_ms)),
            trace: Some(row.trace),
        }) else {
            return;
        };
        let hub = self.settings.hub.clone();
        let partition = self.settings.partition;
        self.pushes
            .entry(session.id)
            .or_insert_with(|| Push::new(hub, session, partition))
            .add(dispatched);
    }

    /// The one claim transition (a `Claim` that wins, or a dispatch):
    /// running under `worker_id` with a lease from `now_ms`. False when the
    /// job is not admitted.
    fn claim_admitted(&mut self, job_id: &str, worker_id: &str, now_ms: i64, confirmed: bool) -> bool {
        let admitted = self
            .jobs
            .get(job_id)
            .is_some_and(|active| active.row.state.status == Status::Admitted);
        if !admitted {
            return false;
        }
        let worker = worker_id.to_string();
        self.update(job_id, |state| {
            state.status = Status::Running;
            state.claimed_by = Some(worker);
            state.confirmed = confirmed;
            // Only a push is unconfirmed at its claim.
            state.pushed = !confirmed;
            state.heard_at_ms = confirmed.then_some(now_ms);
            state.claimed_at_ms = Some(now_ms);
            state.lease_expires_at_ms = Some(now_ms + state.lease_ms);
            state.due_at_ms = transitions::running_due_at(state);
        });
        self.awaiting_payload.remove(job_id);
        true
    }

    /// Stream workers have credits again: push the admitted jobs that wait
    /// for them, oldest first, while credits last.
    /// A job whose tenant no session with a credit may run (stream workers
    /// scoped to other tenants) keeps its place and lets the jobs behind it
    /// go.
    fn dispatch_unclaimed(&mut self) {
        let groups: Vec<String> = self.unclaimed.keys().cloned().collect();
        for task_group in groups {
            let mut kept: VecDeque<String> = VecDeque::new();
            while let Some(job_id) = self.unclaimed.get_mut(&task_group).and_then(VecDeque::pop_front) {
                let tenant = match self.jobs.get(&job_id) {
                    Some(active) if active.row.state.status == Status::Admitted && active.payload_loaded => {
                        active.row.tenant.clone()
                    }
                    _ => continue,
                };
                if let Some(session) = self.settings.hub.take(&task_group, &tenant) {
                    self.dispatch(&job_id, session);
                    continue;
                }
                kept.push_back(job_id);
                if !self.settings.hub.has_credit(&task_group) {
                    break;
                }
            }
            if !kept.is_empty() {
                self.settings.hub.want(&task_group, self.settings.partition);
                let queue = self.unclaimed.entry(task_group.clone()).or_default();
                while let Some(job_id) = kept.pop_back() {
                    queue.push_front(job_id);
                }
            }
            if self.unclaimed.get(&task_group).is_some_and(VecDeque::is_empty) {
                self.unclaimed.remove(&task_group);
            }
        }
    }

    /// Turn the batch's pushes into replies: written to the workers' streams
    /// once the batch is committed.
    fn queue_pushes(&mut self, out: &mut Out<'_>) {
        if self.pushes.is_empty() {
            return;
        }
        let pushes: Vec<Push> = self.pushes.drain().map(|(_, push)| push).collect();
        if self.settings.faults.hit(FaultPoint::AdmissionAfterCommitBeforePush) {
            // The crash point between the commit and the push: the claims
            // are committed, the pushes are lost with the instance.
            for push in pushes {
                push.lose();
            }
            self.crash_after_commit = true;
            return;
        }
        for push in pushes {
            out.replies.push(Box::new(move || push.send()));
        }
    }

    /// Keep a payload read from PostgreSQL for the job being dispatched.
    fn keep_payload(&mut self, job_id: &str, payload: Vec<u8>) {
        let Some(active) = self.jobs.get_mut(job_id) else {
            return;
        };
        if active.payload_loaded {
            return;
        }
        active.row.payload = payload;
        active.payload_loaded = true;
        self.payload_bytes += active.row.payload.len();
    }

    /// Whether a new job's payload stays in memory.
    fn payload_fits(&self, payload: &[u8]) -> bool {
        let config = &self.settings.config.admission;
        payload.len() <= config.memory_payload_max_bytes
            && self.payload_bytes + payload.len() <= config.memory_payload_budget_bytes
    }

    /// Close the batch's journal entry (and a snapshot, when due).
    fn close_batch(&mut self, writes: &mut AdmissionWrites) {
        if self.changes.is_empty() && !self.snapshot_due {
            return;
        }
        self.journal_seq += 1;
        let mut changes: Vec<JobChange> = self.changes.drain().map(|(_, change)| change).collect();
        changes.sort_by(|left, right| left.job_id.cmp(&right.job_id));
        let batch = JournalBatch { changes };
        let batch_bytes = prost::Message::encoded_len(&batch);
        self.journal_bytes_since_snapshot += batch_bytes;
        if self.snapshot_due
            || self.journal_bytes_since_snapshot > self.last_snapshot_bytes.max(MIN_JOURNAL_BEFORE_SNAPSHOT)
        {
            let snapshot = Snapshot {
                jobs: self.jobs.values().map(|active| SnapshotJob::of(&active.row)).collect(),
            };
            self.last_snapshot_bytes = prost::Message::encoded_len(&snapshot);
            self.journal_bytes_since_snapshot = 0;
            self.snapshot_due = false;
            writes.snapshot = Some((self.journal_seq, snapshot));
        } else {
            writes.journal = Some((self.journal_seq, batch));
        }
    }

    /// Strictly increasing enqueue times, so equal priorities keep arrival
    /// order.
    fn next_enqueue_time_us(&mut self, now_us: i64) -> i64 {
        let next = now_us.max(self.last_enqueued_at_us + 1);
        self.last_enqueued_at_us = next;
        next
    }

    // -- enqueue ----------------------------------------------------------

    /// The row of a new job (its state decided at `now_ms`).
    fn new_row(&mut self, incoming: &Incoming, now_ms: i64) -> JobRow {
        let valid = &incoming.valid;
        // The job's own span, under the producer's: every span of the job
        // hangs below it, across services.
        let now = std::time::SystemTime::now();
        let job_trace = record_span(SCOPE, "admission.enqueue", &incoming.trace, now, now, || {
            vec![
                KeyValue::new("sluice.job_id", incoming.job_id.clone()),
                KeyValue::new("sluice.tenant", valid.request.tenant.clone()),
                KeyValue::new("sluice.task_group", valid.request.task_group.clone()),
                KeyValue::new("sluice.limits", i64::try_from(valid.chain.len()).unwrap_or(i64::MAX)),
            ]
        });
        let mut spec = valid.request.clone();
        spec.payload = Vec::new();
        spec.job_id = Some(incoming.job_id.clone());
        let request_hash = Some(request_fingerprint(&spec, &valid.request.payload));
        let mut state = JobState {
            job_id: incoming.job_id.clone(),
            status: Status::Scheduled,
            attempt: 1,
            attempts_used: 0,
            max_attempts: valid.retry.max_attempts,
            step: 0,
            chain: valid.chain.clone(),
            retry: valid.retry,
            lease_ms: valid.lease_ms,
            run_timeout_ms: valid.run_timeout_ms,
            due_at_ms: None,
            step_started_at_ms: None,
            admitted_at_ms: None,
            claimed_by: None,
            claimed_at_ms: None,
            lease_expires_at_ms: None,
            finished_at_ms: None,
            cancel_reason: None,
            last_error: String::new(),
            history: Default::default(),
            confirmed: false,
            heard_at_ms: None,
            pushed: false,
        };
        match valid.request.run_at_ms {
            Some(run_at) if run_at > now_ms => state.due_at_ms = Some(run_at),
            _ => {
                transitions::start_acquiring(&mut state, now_ms, self.settings.timing);
            }
        }
        JobRow {
            state,
            tenant: valid.request.tenant.clone(),
            task_group: valid.request.task_group.clone(),
            priority: valid.priority,
            spec,
            payload: valid.request.payload.clone(),
            job_partition: self.settings.partition,
            enqueued_at_us: self.next_enqueue_time_us(now_ms.saturating_mul(1000)),
            run_at_ms: valid.request.run_at_ms,
            idempotency_key: if valid.request.idempotency_key.is_empty() {
                None
            } else {
                Some(valid.request.idempotency_key.clone())
            },
            trace: job_trace,
            request_hash,
        }
    }

    /// The job an id already names, if any: active here, or stored.
    fn existing(&self, job_id: &str) -> Option<(Status, Option<Vec<u8>>)> {
        if let Some(active) = self.jobs.get(job_id) {
            return Some((active.row.state.status, active.row.request_hash.clone()));
        }
        self.prepared
            .stored
            .get(job_id)
            .map(|stored| (stored.row.state.status, stored.row.request_hash.clone()))
    }

    /// Enqueue `jobs`: new ones are saved and start acquiring; the same
    /// request again is a duplicate (its pending effect is sent again); a
    /// different request under a saved job id is a conflict.
    fn enqueue(
        &mut self,
        now_ms: i64,
        jobs: &[Incoming],
        on_conflict: OnConflict,
        out: &mut Out<'_>,
    ) -> Result<Vec<EnqueueOutcome>, EnqueueError> {
        // Decide every outcome first: a refused call changes nothing.
        let rows: Vec<JobRow> = jobs.iter().map(|incoming| self.new_row(incoming, now_ms)).collect();
        let plan = self.plan_enqueue(now_ms, &rows, jobs, on_conflict)?;
        self.check_quotas(
            now_ms,
            plan.new_rows.iter().map(|(index, _)| rows[*index].tenant.as_str()),
        )
        .map_err(EnqueueError::Quota)?;
        // Duplicates re-send the effect their job is waiting on.
        for outcome in &plan.outcomes {
            if outcome.deduplicated && !plan.first_in_call.contains_key(&outcome.job_id) {
                self.resend_pending(&outcome.job_id, out);
            }
        }
        let mut rows: Vec<Option<JobRow>> = rows.into_iter().map(Some).collect();
        for (index, expires_at_ms) in plan.new_rows {
            if let Some(row) = rows.get_mut(index).and_then(Option::take) {
                self.insert_new_job(row, expires_at_ms, out);
            }
        }
        Ok(plan.outcomes)
    }

    /// The outcome of each job of an Enqueue call, changing nothing: a new
    /// job, a duplicate (of a saved job, of one earlier in the call, or of
    /// the holder of its idempotency key), or a conflict.
    fn plan_enqueue(
        &self,
        now_ms: i64,
        rows: &[JobRow],
        jobs: &[Incoming],
        on_conflict: OnConflict,
    ) -> Result<EnqueuePlan, EnqueueError> {
        let mut plan = EnqueuePlan {
            outcomes: Vec::with_capacity(rows.len()),
            first_in_call: HashMap::default(),
            new_rows: Vec::new(),
        };
        let mut idempotency_in_call: HashMap<(String, String), String> = HashMap::default();
        for (index, (row, incoming)) in rows.iter().zip(jobs).enumerate() {
            let job_id = &row.state.job_id;
            if let Some(holder) = self.idempotency_holder(now_ms, row, incoming, &mut idempotency_in_call) {
                let status = self.existing(&holder).map_or(Status::Unspecified, |(status, _)| status);
                plan.outcomes.push(EnqueueOutcome {
                    job_id: holder,
                    status,
                    deduplicated: true,
                    conflict: false,
                });
                continue;
            }
            // The same id earlier in this call, or already saved.
            let earlier = plan.first_in_call.get(job_id).map(|first| &rows[*first]);
            let existing = match earlier {
                Some(first) => Some((first.state.status, first.request_hash.clone())),
                None => self.existing(job_id),
            };
            let Some((status, saved_hash)) = existing else {
                plan.first_in_call.insert(job_id.clone(), index);
                let expires_at_ms = incoming
                    .valid
                    .idempotency_window_ms
                    .map_or(0, |window_ms| now_ms.saturating_add(window_ms));
                plan.new_rows.push((index, expires_at_ms));
                plan.outcomes.push(EnqueueOutcome {
                    job_id: job_id.clone(),
                    status: row.state.status,
                    deduplicated: false,
                    conflict: false,
                });
                continue;
            };
            let same = match (&saved_hash, &row.request_hash) {
                (Some(saved), Some(ours)) => saved == ours,
                _ => true,
            };
            if !same && on_conflict == OnConflict::Refuse {
                return Err(EnqueueError::Conflict(EnqueueConflict {
                    index,
                    job_id: job_id.clone(),
                }));
            }
            plan.outcomes.push(EnqueueOutcome {
                job_id: job_id.clone(),
                status,
                deduplicated: same,
                conflict: !same,
            });
        }
        Ok(plan)
    }

    /// Another job that holds `row`'s idempotency key inside its window
    /// (saved, or earlier in this call). Takes the key for `row` in
    /// `in_call` when nobody holds it.
    fn idempotency_holder(
        &self,
        now_ms: i64,
        row: &JobRow,
        incoming: &Incoming,
        in_call: &mut HashMap<(String, String), String>,
    ) -> Option<String> {
        let (Some(key), Some(_)) = (&row.idempotency_key, incoming.valid.idempotency_window_ms) else {
            return None;
        };
        let pair = (row.tenant.clone(), key.clone());
        let holder = in_call.get(&pair).cloned().or_else(|| {
            self.prepared
                .idempotency
                .get(&pair)
                .filter(|(_, expires_at_ms)| *expires_at_ms > now_ms)
                .map(|(holder, _)| holder.clone())
        });
        match holder {
            Some(holder) if holder != row.state.job_id => Some(holder),
            Some(_) => None,
            None => {
                in_call.insert(pair, row.state.job_id.clone());
                None
            }
        }
    }

    /// Save a new job and start it: it acquires its limits (or is
    /// admitted at once when it names none).
    fn insert_new_job(&mut self, row: JobRow, idempotency_expires_at_ms: i64, out: &mut Out<'_>) {
        if let Some(key) = &row.idempotency_key {
            out.writes.idempotency.push((
                row.tenant.clone(),
                key.clone(),
                row.state.job_id.clone(),
                idempotency_expires_at_ms,
            ));
            // Later requests of the same batch see the key taken.
            self.prepared.idempotency.insert(
                (row.tenant.clone(), key.clone()),
                (row.state.job_id.clone(), idempotency_expires_at_ms),
            );
        }
        let job_id = row.state.job_id.clone();
        let effects = match row.state.status {
            Status::Waiting => vec![Effect::Acquire],
            Status::Admitted => vec![Effect::Admitted],
            _ => Vec::new(),
        };
        out.writes.inserted.push(row.clone());
        let keep_payload = self.payload_fits(&row.payload);
        let mut kept = row;
        if !keep_payload {
            kept.payload = Vec::new();
        }
        self.put(kept, keep_payload);
        self.changes.insert(
            job_id.clone(),
            JobChange {
                job_id: job_id.clone(),
                created: true,
                ..Default::default()
            },
        );
        self.after_transition(&job_id, &effects, out);
    }

    /// Refuse new jobs of a tenant over its quotas (this partition's share:
    /// `quota::Quotas::share_of`); else take their rate tokens.
    fn check_quotas<'a>(&mut self, now_ms: i64, tenants: impl Iterator<Item = &'a str>) -> Result<(), QuotaRefusal> {
        if self.settings.quotas.unlimited() {
            return Ok(());
        }
        let mut new_by_tenant: BTreeMap<&str, u64> = BTreeMap::new();
        for tenant in tenants {
            *new_by_tenant.entry(tenant).or_default() += 1;
        }
        let quotas = self.settings.quotas.clone();
        let partition = self.settings.partition;
        let mut taken: Vec<(&str, f64)> = Vec::new();
        for (tenant, new) in &new_by_tenant {
            let quota = quotas.of(tenant);
            if let Some(max) = quota.max_waiting {
                let share = quotas.share_of(max, partition);
                let unfinished = self.active_by_tenant.get(*tenant).copied().unwrap_or(0);
                if unfinished + new > share {
                    crate::quota::count_refusal(tenant, "max_waiting", *new);
                    return Err(QuotaRefusal {
                        tenant: tenant.to_string(),
                        quota: "max_waiting",
                        message: format!(
                            "quota: tenant {tenant:?} is over its quota max_waiting ({max} unfinished jobs; job \
                             partition {partition} holds {unfinished} of its share {share}): enqueue again once some \
                             of its jobs finish"
                        ),
                    });
                }
            }
            if let Some(rate) = quota.max_enqueues_per_second {
                let share = quotas.rate_share(rate);
                let bucket = self
                    .buckets
                    .entry(tenant.to_string())
                    .or_insert_with(|| crate::quota::Bucket::full(share, now_ms));
                if !bucket.take(share, *new as f64, now_ms) {
                    crate::quota::count_refusal(tenant, "max_enqueues_per_second", *new);
                    // Give back what this call took from earlier tenants.
                    for (earlier, count) in taken {
                        if let Some(bucket) = self.buckets.get_mut(earlier) {
                            bucket.give_back(count);
                        }
                    }
                    return Err(QuotaRefusal {
                        tenant: tenant.to_string(),
                        quota: "max_enqueues_per_second",
                        message: format!(
                            "quota: tenant {tenant:?} is over its quota max_enqueues_per_second ({rate}/s): slow down \
                             and enqueue again"
                        ),
                    });
                }
                taken.push((tenant, *new as f64));
            }
        }
        Ok(())
    }

    /// Send again the effect an active job is waiting on.
    fn resend_pending(&mut self, job_id: &str, out: &mut Out<'_>) {
        let Some(active) = self.jobs.get(job_id) else {
            return;
        };
        match active.row.state.status {
            Status::Waiting => self.settings.routes.push_acquire(out.outbox, &active.row, self.now_ms),
            Status::Admitted => self.publish_admitted(job_id, out),
            _ => {}
        }
    }

    /// Send again the acquire of every waiting job whose current step's owner
    /// is one of `partitions` of `link`'s service (its path changed). Its
    /// timer is left as it is: this is no re-send it waits for.
    fn resend_on_path(&self, link: Link, partitions: &[i32], outbox: &mut Outbox) {
        let changed: HashSet<i32> = partitions.iter().copied().collect();
        let routes = &self.settings.routes;
        for active in self.jobs.values() {
            if active.row.state.status != Status::Waiting {
                continue;
            }
            let on_path = routes
                .acquire_route(&active.row)
                .is_some_and(|(to, partition)| to == link && changed.contains(&partition));
            if on_path {
                routes.push_acquire(outbox, &active.row, self.now_ms);
            }
        }
    }

    /// A request handed over through `sluice.jobs`: a new job, a duplicate,
    /// or a conflict (dead-lettered).
    fn hand_over(&mut self, now_ms: i64, handover: HandOver, out: &mut Out<'_>) {
        let refusal = match &handover.checked {
            Ok(incoming) => match self.enqueue(now_ms, std::slice::from_ref(incoming), OnConflict::Report, out) {
                Ok(outcomes) if outcomes.iter().any(|outcome| outcome.conflict) => Some(Refusal {
                    class: DeadLetterClass::Conflict,
                    reason: format!(
                        "conflict: job {:?} already exists with a different request (a job id names one request; \
                         send a new id for a new job)",
                        incoming.job_id
                    ),
                }),
                Ok(_) => None,
                Err(EnqueueError::Conflict(conflict)) => Some(Refusal {
                    class: DeadLetterClass::Conflict,
                    reason: format!(
                        "conflict: job {:?} already exists with a different request",
                        conflict.job_id
                    ),
                }),
                Err(EnqueueError::Quota(refusal)) => Some(Refusal {
                    class: DeadLetterClass::Quota,
                    reason: refusal.message,
                }),
            },
            Err(refusal) => Some(refusal.clone()),
        };
        if let Some(refusal) = refusal {
            tracing::warn!(topic = %handover.source_topic, partition = handover.source.partition, offset = handover.source.offset, reason = %refusal.reason, "dead-lettering a job request");
            self.settings.routes.push_deadletter(
                out.outbox,
                &handover.source_topic,
                &handover.source,
                refusal.class,
                &refusal.reason,
            );
            count_dead_letters(&handover.source_topic, refusal.class, 1);
        }
    }

    // -- grants -----------------------------------------------------------

    /// Apply grant events: advance the job to its next step, or admit it. A
    /// duplicate re-sends its effect; a grant nobody wants is released.
    fn grants(&mut self, now_ms: i64, events: Vec<pb::GrantEvent>, out: &mut Out<'_>) {
        for event in events {
            let Some(ticket) = event.ticket.clone() else {
                continue;
            };
            let job_id = ticket.job_id.clone();
            let current = self
                .jobs
                .get(&job_id)
                .map(|active| (active.row.state.status, active.row.state.attempt, active.row.state.step));
            match current {
                Some((Status::Waiting, attempt, step)) if attempt == ticket.attempt && step == ticket.step => {
                    self.advance(now_ms, &job_id, &event, out);
                }
                _ => self.answer_unmatched_grant(&ticket, &event, out),
            }
        }
    }

    fn advance(&mut self, now_ms: i64, job_id: &str, event: &pb::GrantEvent, out: &mut Out<'_>) {
        let timing = self.settings.timing;
        if let Some(active) = self.jobs.get(job_id) {
            // Recorded once the grant's batch is committed: a batch decided
            // again (after a failed commit) records it once.
            if let Some(span) = wait_span(&active.row, active.row.state.step, event) {
                out.outbox.observe(span);
            }
        }
        let mut effects = Vec::new();
        self.update(job_id, |state| {
            if event.unthrottled {
                state.history.records.push(pb::AttemptRecord {
                    attempt: state.attempt,
                    outcome: "unthrottled".to_string(),
                    detail: format!(
                        "rate limit {} names no stored resource: not throttled",
                        event.key.as_ref().map(|key| key.key.as_str()).unwrap_or_default()
                    ),
                    at_ms: event.granted_at_ms,
                });
            }
            state.step += 1;
            state.step_started_at_ms = Some(now_ms);
            if state.step >= state.chain_len() {
                state.status = Status::Admitted;
                state.admitted_at_ms = Some(now_ms);
                state.due_at_ms = Some(now_ms + timing.claim_timeout_ms);
                effects.push(Effect::Admitted);
            } else {
                state.due_at_ms = Some(now_ms + timing.resend_waiting_after_ms);
                effects.push(Effect::Acquire);
            }
        });
        self.after_transition(job_id, &effects, out);
    }

    fn answer_unmatched_grant(&mut self, ticket: &pb::TicketId, event: &pb::GrantEvent, out: &mut Out<'_>) {
        let current_attempt_wants_it = self.jobs.get(&ticket.job_id).is_some_and(|active| {
            let state = &active.row.state;
            state.attempt == ticket.attempt
                && match state.status {
                    Status::Waiting => state.step > ticket.step,
                    Status::Admitted | Status::Running | Status::Cancelling => true,
                    _ => false,
                }
        });
        if current_attempt_wants_it {
            // A duplicate: its effect was the next step's acquire or the
            // admitted message; send it again if it is still the pending one.
            let was_last_grant = self
                .jobs
                .get(&ticket.job_id)
                .is_some_and(|active| ticket.step + 1 == active.row.state.step);
            if was_last_grant {
                self.resend_pending(&ticket.job_id, out);
            }
            return;
        }
        let kind = pb::LimitKind::try_from(event.kind).unwrap_or(pb::LimitKind::Unspecified);
        if kind == pb::LimitKind::Rate {
            // Rate grants hold nothing to give back.
            return;
        }
        let Some(key_ref) = &event.key else {
            return;
        };
        tracing::debug!(job_id = %ticket.job_id, attempt = ticket.attempt, step = ticket.step, "releasing a grant nobody wants");
        // This instance may no longer own the partition without knowing it
        // yet (rebalances overlap): the job may be waiting for this very
        // grant at the new owner. Only the current owner releases it: like
        // everything sent, the release goes out after a fenced commit.
        let step = StoredStep {
            tenant: key_ref.tenant.clone(),
            key: key_ref.key.clone(),
            kind: event.kind,
            ..Default::default()
        };
        let trace = event.trace.clone().unwrap_or_default();
        self.settings.routes.push_release_of(
            out.outbox,
            &step,
            crate::effects::Release {
                job_id: &ticket.job_id,
                trace: &trace,
                attempt: ticket.attempt,
                step_index: ticket.step,
                reason: pb::ReleaseReason::UnwantedGrant,
                run_ms: None,
                sent_at_ms: self.now_ms,
            },
        );
    }

    // -- the worker protocol ----------------------------------------------

    /// Claim admitted attempts for `worker_id`: exactly one claim per
    /// attempt wins.
    fn claim(&mut self, now_ms: i64, worker_id: &str, attempts: &[(String, u32)]) -> Vec<pb::ClaimResult> {
        let mut results = Vec::with_capacity(attempts.len());
        let mut answered: HashSet<(String, u32)> =
            HashSet::with_capacity_and_hasher(attempts.len(), Default::default());
        for (job_id, attempt) in attempts {
            let mut result = pb::ClaimResult {
                job_id: job_id.clone(),
                attempt: *attempt,
                ..Default::default()
            };
            let first_entry = answered.insert((job_id.clone(), *attempt));
            let state = self
                .jobs
                .get(job_id)
                .map(|active| (active.row.state.status, active.row.state.attempt));
            result.outcome = match state {
                Some((Status::Admitted, current)) if current == *attempt && first_entry => {
                    if let Some(payload) = self.prepared.payloads.remove(job_id) {
                        self.keep_payload(job_id, payload);
                    }
                    if self.jobs.get(job_id).is_some_and(|active| !active.payload_loaded) {
                        // `prepare` reads it; a worker must never run an
                        // empty payload. The job is published again after
                        // claim_timeout.
                        tracing::error!(%job_id, "a claim found the payload unread; answering taken");
                        result.outcome = pb::ClaimOutcome::Taken as i32;
                        results.push(result);
                        continue;
                    }
                    // The worker's own claim: it holds the attempt.
                    self.claim_admitted(job_id, worker_id, now_ms, true);
                    if let Some(active) = self.jobs.get(job_id) {
                        result.lease_expires_at_ms = active.row.state.lease_expires_at_ms.unwrap_or_default();
                        result.lease_ms = u64::try_from(active.row.state.lease_ms).unwrap_or_default();
                        result.payload = active.row.payload.clone();
                    }
                    pb::ClaimOutcome::Claimed
                }
                // A claim wins once, even for the worker that won it: a
                // second delivery of the same attempt must not run twice.
                Some((Status::Running | Status::Cancelling | Status::Admitted, current)) if current == *attempt => {
                    pb::ClaimOutcome::Taken
                }
                Some(_) => pb::ClaimOutcome::Stale,
                None if self.prepared.stored.contains_key(job_id) => pb::ClaimOutcome::Stale,
                None => pb::ClaimOutcome::NotFound,
            } as i32;
            results.push(result);
        }
        results
    }

    /// Extend leases; name the jobs to stop. A lease extension is not
    /// saved (a new owner gives every running attempt a lease from its
    /// takeover); the first heartbeat of a pushed attempt confirms it, and
    /// that is saved before the answer, so that whoever owns the partition
    /// later counts its lease expiry as an attempt used. With `ended`, the
    /// attempts' stream ended instead: their leases are shortened
    /// (`transitions::on_stream_ended`) unless the worker was heard since.
    fn heartbeat(
        &mut self,
        now_ms: i64,
        worker_id: &str,
        attempts: &[(String, u32)],
        ended: Option<StreamEnd>,
    ) -> Vec<pb::HeartbeatResult> {
        attempts
            .iter()
            .map(|(job_id, attempt)| {
                let mut result = pb::HeartbeatResult {
                    job_id: job_id.clone(),
                    attempt: *attempt,
                    outcome: pb::HeartbeatOutcome::LeaseLost as i32,
                    lease_expires_at_ms: 0,
                };
                let holder = self.jobs.get(job_id).filter(|active| {
                    let state = &active.row.state;
                    matches!(state.status, Status::Running | Status::Cancelling)
                        && state.attempt == *attempt
                        && state.claimed_by.as_deref() == Some(worker_id)
                        && state.lease_expires_at_ms.is_some_and(|lease| lease > now_ms)
                });
                let Some(confirmed) = holder.map(|active| active.row.state.confirmed) else {
                    return result;
                };
                let renew = |state: &mut JobState| match ended {
                    Some(ended) => {
                        if transitions::on_stream_ended(state, now_ms, ended) {
                            tracing::info!(job_id = %state.job_id, attempt = state.attempt, lease_expires_at_ms = ?state.lease_expires_at_ms, "the attempt's Work stream ended: lease shortened to the grace");
                        }
                    }
                    None => {
                        state.lease_expires_at_ms = Some(now_ms + state.lease_ms);
                        state.confirmed = true;
                        state.heard_at_ms = Some(now_ms);
                        state.due_at_ms = transitions::running_due_at(state);
                    }
                };
                if !confirmed && ended.is_none() {
                    self.update(job_id, renew);
                } else {
                    self.update_unsaved(job_id, renew);
                }
                if let Some(state) = self.jobs.get(job_id).map(|active| &active.row.state) {
                    result.outcome = if state.status == Status::Cancelling {
                        pb::HeartbeatOutcome::Cancelled
                    } else {
                        pb::HeartbeatOutcome::Extended
                    } as i32;
                    result.lease_expires_at_ms = state.lease_expires_at_ms.unwrap_or_default();
                }
                result
            })
            .collect()
    }

    /// Attempts were written to `worker_id`'s stream now: an unconfirmed
    /// push's lease runs from here (the commit before it, and anything it
    /// waited for, is not the worker's time). Never shortens a lease.
    fn pushed(&mut self, now_ms: i64, worker_id: &str, attempts: &[(String, u32)]) {
        for (job_id, attempt) in attempts {
            let pushed_here = self.jobs.get(job_id).is_some_and(|active| {
                let state = &active.row.state;
                state.status == Status::Running
                    && state.attempt == *attempt
                    && state.pushed
                    && !state.confirmed
                    && state.claimed_by.as_deref() == Some(worker_id)
            });
            if pushed_here {
                self.update_unsaved(job_id, |state| {
                    let from_push = now_ms.saturating_add(state.lease_ms);
                    state.lease_expires_at_ms = Some(
                        state
                            .lease_expires_at_ms
                            .map_or(from_push, |lease| lease.max(from_push)),
                    );
                    state.due_at_ms = transitions::running_due_at(state);
                });
            }
        }
    }

    /// End attempts as their workers report. A duplicate of an accepted
    /// completion is accepted again and re-sends its releases.
    fn complete(
        &mut self,
        now_ms: i64,
        worker_id: &str,
        completions: Vec<(String, u32, AttemptEnd)>,
        caller_trace: &pb::TraceContext,
        out: &mut Out<'_>,
    ) -> Vec<pb::CompleteResult> {
        let timing = self.settings.timing;
        let mut results = Vec::with_capacity(completions.len());
        for (job_id, attempt, end) in completions {
            let mut result = pb::CompleteResult {
                job_id: job_id.clone(),
                attempt,
                ..Default::default()
            };
            let holds_it = self.jobs.get(&job_id).is_some_and(|active| {
                let state = &active.row.state;
                matches!(state.status, Status::Running | Status::Cancelling)
                    && state.attempt == attempt
                    && state.claimed_by.as_deref() == Some(worker_id)
            });
            let trace = self
                .jobs
                .get(&job_id)
                .map(|active| active.row.trace.clone())
                .or_else(|| self.prepared.stored.get(&job_id).map(|stored| stored.row.trace.clone()));
            if holds_it {
                let mut effects = Vec::new();
                self.update(&job_id, |state| {
                    effects = transitions::end_attempt(state, now_ms, end, timing);
                });
                result.outcome = pb::CompleteOutcome::Accepted as i32;
                result.status =
                    self.jobs
                        .get(&job_id)
                        .map_or(Status::Unspecified, |active| active.row.state.status) as i32;
                self.after_transition(&job_id, &effects, out);
            } else if let Some(stored) = self.prepared.stored.get(&job_id).filter(|stored| stored.finished) {
                if is_duplicate_completion(&stored.row.state, attempt) {
                    // Already saved: change nothing, re-send the releases.
                    let finished = JobState {
                        status: Status::Running,
                        attempt,
                        ..stored.row.state.clone()
                    };
                    let effects = finished.release_everything(pb::ReleaseReason::Succeeded);
                    self.settings
                        .routes
                        .push_effects(out.outbox, &stored.row, &effects, self.now_ms);
                    result.outcome = pb::CompleteOutcome::Accepted as i32;
                } else {
                    result.outcome = pb::CompleteOutcome::Stale as i32;
                }
                result.status = stored.row.state.status as i32;
            } else if let Some(active) = self.jobs.get(&job_id) {
                result.outcome = pb::CompleteOutcome::Stale as i32;
                result.status = active.row.state.status as i32;
            } else {
                result.outcome = pb::CompleteOutcome::NotFound as i32;
            }
            if let Some(trace) = trace.filter(|_| sluice_common::telemetry::spans_exported()) {
                out.outbox.observe(complete_span(&result, caller_trace, &trace));
            }
            results.push(result);
        }
        results
    }

    /// Cancel a job (`transitions::cancel`). `None`: no such job.
    fn cancel(&mut self, now_ms: i64, job_id: &str, reason: &str, out: &mut Out<'_>) -> Option<Status> {
        if !self.jobs.contains_key(job_id) {
            return self.prepared.stored.get(job_id).map(|stored| stored.row.state.status);
        }
        let mut effects = Vec::new();
        let mut status = Status::Unspecified;
        self.update(job_id, |state| {
            effects = transitions::cancel(state, now_ms, reason);
            status = state.status;
        });
        self.after_transition(job_id, &effects, out);
        Some(status)
    }

    // -- time ---------------------------------------------------------------

    /// Act on every job due by `now_ms`, and on the partition's own timers.
    fn run_timers(&mut self, now_ms: i64, out: &mut Out<'_>) {
        let timing = self.settings.timing;
        // Each due job once per batch, whatever its next due time.
        let due: Vec<String> = self
            .timers
            .iter()
            .take_while(|(due, _)| *due <= now_ms)
            .map(|(_, job_id)| job_id.clone())
            .collect();
        for job_id in due {
            let active_jobs = self.jobs.len();
            // A waiting or admitted job's timer re-sends its pending command
            // and moves only its own next time: kept in memory, so re-sends
            // write nothing (a new owner re-sends every pending command at
            // its takeover and starts these timers over:
            // `restart_resend_timers`).
            let resend = self
                .jobs
                .get(&job_id)
                .is_some_and(|active| matches!(active.row.state.status, Status::Waiting | Status::Admitted));
            let mut effects = Vec::new();
            let decide = |state: &mut JobState| {
                effects = transitions::on_due(state, now_ms, timing, active_jobs);
            };
            if resend {
                self.update_unsaved(&job_id, decide);
            } else {
                self.update(&job_id, decide);
            }
            self.after_transition(&job_id, &effects, out);
        }
        if now_ms >= self.next_stand_behind_ms {
            self.next_stand_behind_ms = now_ms + self.settings.stand_behind_interval_ms;
            self.stand_behind(now_ms, out.outbox);
        }
    }

    /// Tell every limit partition which tickets this job partition stands
    /// behind, as of now. Sent to every limit partition, even with nothing
    /// to list, so tickets nobody stands behind expire there (a lost release
    /// then costs one grace period, not a slot for ever).
    pub fn stand_behind(&self, now_ms: i64, outbox: &mut Outbox) {
        let routes = &self.settings.routes;
        let partitions = usize::try_from(routes.limit_partitions).unwrap_or_default();
        let mut by_partition: Vec<Vec<pb::TicketId>> = vec![Vec::new(); partitions];
        // The tickets whose grant the job waits for now.
        let mut waiting_by_partition: Vec<Vec<pb::TicketId>> = vec![Vec::new(); partitions];
        for active in self.jobs.values() {
            let state = &active.row.state;
            let held_through = match state.status {
                Status::Waiting => state.step.saturating_add(1),
                Status::Admitted | Status::Running | Status::Cancelling => state.chain_len(),
                _ => 0,
            };
            for (index, step) in state.chain.iter().enumerate() {
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                if index >= held_through || !step.is_ticketed() {
                    continue;
                }
                let partition =
                    sluice_common::partition::key_partition(&step.tenant, &step.key, routes.limit_partitions);
                let slot = usize::try_from(partition).unwrap_or(usize::MAX);
                let ticket = pb::TicketId {
                    job_id: state.job_id.clone(),
                    attempt: state.attempt,
                    step: index,
                };
                if state.status == Status::Waiting && index == state.step {
                    if let Some(waiting) = waiting_by_partition.get_mut(slot) {
                        waiting.push(ticket.clone());
                    }
                }
                if let Some(tickets) = by_partition.get_mut(slot) {
                    tickets.push(ticket);
                }
            }
        }
        const TICKETS_PER_PART: usize = 10_000;
        let sweep_id = format!("{}-{}-{now_ms}", self.settings.partition, self.journal_seq);
        let covered = vec![u32::try_from(self.settings.partition).unwrap_or_default()];
        for (partition, (tickets, waiting)) in by_partition.into_iter().zip(waiting_by_partition).enumerate() {
            let chunks: Vec<Vec<pb::TicketId>> = if tickets.is_empty() {
                vec![Vec::new()]
            } else {
                tickets.chunks(TICKETS_PER_PART).map(<[pb::TicketId]>::to_vec).collect()
            };
            let parts = u32::try_from(chunks.len()).unwrap_or(u32::MAX);
            // The waiting tickets go with the first part (a ticket of
            // theirs in another part is still known: parts are one sweep).
            let mut waiting = Some(waiting);
            for (part, chunk) in chunks.into_iter().enumerate() {
                let command = pb::LimitCommand {
                    trace: None,
                    sent_at_ms: now_ms,
                    command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
                        sweep_id: sweep_id.clone(),
                        snapshot_at_ms: now_ms,
                        job_partitions: covered.clone(),
                        part: u32::try_from(part).unwrap_or(u32::MAX),
                        parts,
                        tickets: chunk,
                        grace_ms: u64::try_from(self.settings.ticket_grace_ms).unwrap_or_default(),
                        waiting: waiting.take().unwrap_or_default(),
                    })),
                };
                outbox.push_link(Link::LimitGrant, i32::try_from(partition).unwrap_or_default(), &command);
            }
        }
    }

    /// Publish admitted jobs whose payload was read.
    fn publish_read_payloads(&mut self, out: &mut Out<'_>) {
        let payloads = std::mem::take(&mut self.prepared.payloads);
        for (job_id, payload) in payloads {
            self.keep_payload(&job_id, payload);
            if self.awaiting_payload.remove(&job_id) {
                let admitted = self
                    .jobs
                    .get(&job_id)
                    .is_some_and(|active| active.row.state.status == Status::Admitted);
                if admitted {
                    self.publish_admitted(&job_id, out);
                }
            }
        }
    }

    fn apply_local(&mut self, now_ms: i64, local: Local, out: &mut Out<'_>) {
        match local {
            Local::Enqueue {
                jobs,
                on_conflict,
                reply,
            } => {
                let outcome = self.enqueue(now_ms, &jobs, on_conflict, out);
                out.replies.push(Box::new(move || {
                    let _ = reply.send(outcome);
                }));
            }
            Local::Describe { job_id, reply } => {
                let job = self.jobs.get(&job_id).map(|active| active.row.clone());
                out.replies.push(Box::new(move || {
                    let _ = reply.send(job);
                }));
            }
            Local::Cancel {
                job_id,
                reason,
                scope,
                reply,
            } => {
                let status = if self.in_scope(&job_id, &scope) {
                    self.cancel(now_ms, &job_id, &reason, out)
                } else {
                    None
                };
                out.replies.push(Box::new(move || {
                    let _ = reply.send(status);
                }));
            }
            Local::Claim {
                worker_id,
                attempts,
                scope,
                reply,
            } => {
                let shown = self.shown(attempts.iter().map(|(job_id, _)| job_id.as_str()), &scope);
                let results = within_scope(
                    attempts,
                    &shown,
                    |(job_id, attempt)| pb::ClaimResult {
                        job_id: job_id.clone(),
                        attempt: *attempt,
                        outcome: pb::ClaimOutcome::NotFound as i32,
                        ..Default::default()
                    },
                    |attempts| self.claim(now_ms, &worker_id, &attempts),
                );
                out.replies.push(Box::new(move || {
                    let _ = reply.send(results);
                }));
            }
            Local::Heartbeat {
                worker_id,
                attempts,
                ended,
                scope,
                reply,
            } => {
                let shown = self.shown(attempts.iter().map(|(job_id, _)| job_id.as_str()), &scope);
                let results = within_scope(
                    attempts,
                    &shown,
                    |(job_id, attempt)| pb::HeartbeatResult {
                        job_id: job_id.clone(),
                        attempt: *attempt,
                        outcome: pb::HeartbeatOutcome::LeaseLost as i32,
                        lease_expires_at_ms: 0,
                    },
                    |attempts| self.heartbeat(now_ms, &worker_id, &attempts, ended),
                );
                out.replies.push(Box::new(move || {
                    let _ = reply.send(results);
                }));
            }
            Local::Complete {
                worker_id,
                completions,
                scope,
                caller_trace,
                reply,
            } => {
                let shown = self.shown(completions.iter().map(|(job_id, _, _)| job_id.as_str()), &scope);
                let results = within_scope(
                    completions,
                    &shown,
                    |(job_id, attempt, _)| pb::CompleteResult {
                        job_id: job_id.clone(),
                        attempt: *attempt,
                        outcome: pb::CompleteOutcome::NotFound as i32,
                        ..Default::default()
                    },
                    |completions| self.complete(now_ms, &worker_id, completions, &caller_trace, out),
                );
                out.replies.push(Box::new(move || {
                    let _ = reply.send(results);
                }));
            }
            Local::Grants(events) => self.grants(now_ms, events, out),
            Local::Dispatch => self.dispatch_unclaimed(),
            Local::Pushed { worker_id, attempts } => self.pushed(now_ms, &worker_id, &attempts),
            Local::PathChanged { link, partitions } => self.resend_on_path(link, &partitions, out.outbox),
            Local::HandOver { handovers, reply } => {
                for handover in handovers {
                    self.hand_over(now_ms, handover, out);
                }
                out.replies.push(Box::new(move || {
                    let _ = reply.send(());
                }));
            }
            Local::Barrier(reply) => out.replies.push(Box::new(move || {
                let _ = reply.send(());
            })),
        }
    }

    /// Whether a caller of `scope` may see `job_id` (a job this partition
    /// does not know is not hidden: it answers not found anyway).
    fn in_scope(&self, job_id: &str, scope: &JobScope) -> bool {
        if *scope == JobScope::All {
            return true;
        }
        let tenant = self
            .jobs
            .get(job_id)
            .map(|active| active.row.tenant.as_str())
            .or_else(|| {
                self.prepared
                    .stored
                    .get(job_id)
                    .map(|stored| stored.row.tenant.as_str())
            });
        tenant.is_none_or(|tenant| scope.allows(tenant))
    }

    /// Which of a call's jobs `scope` may see; empty for `JobScope::All`
    /// (every one: `within_scope` then hands the call over untouched).
    fn shown<'a>(&self, job_ids: impl Iterator<Item = &'a str>, scope: &JobScope) -> Vec<bool> {
        if *scope == JobScope::All {
            return Vec::new();
        }
        job_ids.map(|job_id| self.in_scope(job_id, scope)).collect()
    }

    /// A hand-over entry checked now (when `prepare` did not).
    fn check_handover(&self, entry: &[u8]) -> Result<HandOver, String> {
        let handover: pb::JobHandOver =
            prost::Message::decode(entry).map_err(|error| format!("undecodable job hand-over: {error}"))?;
        Ok(checked_handover(&self.settings.config, handover))
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
    }

    fn crash_after_commit(&mut self) -> bool {
        std::mem::take(&mut self.crash_after_commit)
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
        Some(timer.map_or(self.next_stand_behind_ms, |due| due.min(self.next_stand_behind_ms)))
    }
}

/// The tracer scope of admission's spans.
const SCOPE: &str = "sluice-admission";

/// The span covering a job's wait on one limit, from when the key's owner
/// queued it to the grant, to record when the grant is committed. `None`
/// when spans are not exported.
fn wait_span(row: &JobRow, step_index: u32, event: &pb::GrantEvent) -> Option<impl FnOnce() + Send + 'static> {
    use sluice_common::clock::system_time_at_ms as at_ms;
    if !sluice_common::telemetry::spans_exported() {
        return None;
    }
    let step = row.state.chain.get(usize::try_from(step_index).unwrap_or(usize::MAX));
    let kind = pb::LimitKind::try_from(event.kind).unwrap_or(pb::LimitKind::Unspecified);
    let key = event.key.clone().unwrap_or_default();
    let outcome = if event.unthrottled { "unthrottled" } else { "granted" };
    let start_ms = if event.waiting_since_ms > 0 {
        event.waiting_since_ms
    } else {
        event.granted_at_ms
    };
    let trace = row.trace.clone();
    let end_ms = event.granted_at_ms.max(start_ms);
    let attributes = vec![
        KeyValue::new("sluice.job_id", row.state.job_id.clone()),
        KeyValue::new("sluice.step", i64::from(step_index)),
        KeyValue::new("sluice.tenant", key.tenant),
        KeyValue::new("sluice.key", key.key),
        KeyValue::new("sluice.limit_kind", kind.as_str_name()),
        KeyValue::new("sluice.max", event.max),
        KeyValue::new("sluice.position_at_enqueue", i64::from(event.position_at_enqueue)),
        KeyValue::new("sluice.outcome", outcome),
        KeyValue::new(
            "sluice.origin",
            step.map(|step| step.origin.clone()).unwrap_or_default(),
        ),
    ];
    Some(move || {
        record_span(SCOPE, "sluice.wait", &trace, at_ms(start_ms), at_ms(end_ms), || {
            attributes
        });
    })
}

/// The span of a completion, to record once it is committed: under the
/// worker's handler span when the call carries one of this job's trace,
/// else under the job's own span.
fn complete_span(
    result: &pb::CompleteResult,
    caller_trace: &pb::TraceContext,
    job_trace: &pb::TraceContext,
) -> impl FnOnce() + Send + 'static {
    let parent = if same_trace(caller_trace, job_trace) {
        caller_trace.clone()
    } else {
        job_trace.clone()
    };
    let attributes = vec![
        KeyValue::new("sluice.job_id", result.job_id.clone()),
        KeyValue::new("sluice.attempt", i64::from(result.attempt)),
        KeyValue::new(
            "sluice.outcome",
            pb::CompleteOutcome::try_from(result.outcome)
                .map(|outcome| outcome.as_str_name().to_string())
                .unwrap_or_default(),
        ),
        KeyValue::new(
            "sluice.status",
            Status::try_from(result.status)
                .map(|status| status.as_str_name().to_string())
                .unwrap_or_default(),
        ),
    ];
    move || {
        let now = std::time::SystemTime::now();
        record_span(SCOPE, "admission.complete", &parent, now, now, || attributes);
    }
}

/// Whether two W3C contexts belong to one trace.
fn same_trace(left: &pb::TraceContext, right: &pb::TraceContext) -> bool {
    let trace_id = |context: &pb::TraceContext| context.traceparent.split('-').nth(1).map(str::to_string);
    match (trace_id(left), trace_id(right)) {
        (Some(left), Some(right)) => left == right && left.len() == 32,
        _ => false,
    }
}

/// The same worker completing an attempt whose completion is already saved.
fn is_duplicate_completion(state: &JobState, attempt: u32) -> bool {
    let last = state.history.records.last();
    last.is_some_and(|record| record.attempt == attempt && record.outcome == "succeeded")
        && state.status == Status::Succeeded
        && state.attempt == attempt
}

#[cfg(test)]
#[path = "partition_tests.rs"]
mod tests;

/// The answers to a call's `entries` in call order: those `shown` from
/// `act`, the others `hidden` (as if their jobs did not exist). An empty
/// `shown` shows every entry.
fn within_scope<T, R>(
    entries: Vec<T>,
    shown: &[bool],
    hidden: impl Fn(&T) -> R,
    act: impl FnOnce(Vec<T>) -> Vec<R>,
) -> Vec<R> {
    if shown.iter().all(|shown| *shown) {
        return act(entries);
    }
    let mut answers: Vec<Option<R>> = Vec::with_capacity(entries.len());
    let mut acted_on = Vec::new();
    for (entry, shown) in entries.into_iter().zip(shown) {
        if *shown {
            answers.push(None);
            acted_on.push(entry);
        } else {
            answers.push(Some(hidden(&entry)));
        }
    }
    let mut acted = act(acted_on).into_iter();
    answers
        .into_iter()
        .filter_map(|answer| answer.or_else(|| acted.next()))
        .collect()
}
