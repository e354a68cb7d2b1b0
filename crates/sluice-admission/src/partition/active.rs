//! Keeping a partition's active jobs: their rows and payloads, timers,
//! the batch's changes, dispatching admitted jobs to stream workers, and
//! closing a batch into journal entries (or a snapshot).

use std::collections::VecDeque;

// Seeded maps: what the core iterates comes out in an order a seed fixes,
// so the simulation replays a history exactly (sluice_common::hash).
use sluice_common::hash::HashSet;
use std::sync::Arc;

use opentelemetry::KeyValue;
use sluice_common::telemetry::plan_span;
use sluice_common::FaultPoint;
use sluice_proto::v1 as pb;

use crate::jobs::JobRow;
use crate::journal::{JobChange, JobDynamic, JournalBatch, Snapshot, SnapshotJob};
use crate::transitions::{self, Effect, JobState, Status};
use crate::work::Push;

use super::overtaken;
use super::spans::SCOPE;
use super::{Active, AdmissionPartition, AdmissionWrites, Out, MIN_JOURNAL_BEFORE_SNAPSHOT, UNCLAIMED_COMPACT_FROM};

impl AdmissionPartition {
    pub(super) fn put(&mut self, row: JobRow, payload_loaded: bool) {
        let job_id = row.state.job_id.clone();
        if let Some(due) = row.state.due_at_ms {
            self.timers.insert((due, job_id.clone()));
        }
        if payload_loaded {
            self.payload_bytes += row.payload.len();
        }
        *self.active_by_tenant.entry(row.tenant.clone()).or_default() += 1;
        if let Some(replaced) = self.jobs.insert(job_id, Box::new(Active { row, payload_loaded })) {
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
    pub(super) fn update(&mut self, job_id: &str, change: impl FnOnce(&mut JobState)) {
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
    pub(super) fn update_unsaved(&mut self, job_id: &str, change: impl FnOnce(&mut JobState)) -> Option<usize> {
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
        self.overtaken.forget(job_id);
        let entry = self.changes.entry(job_id.to_string()).or_insert_with(|| JobChange {
            job_id: job_id.to_string(),
            ..Default::default()
        });
        entry.removed = true;
        entry.state = Some(JobDynamic::of(&active.row.state));
        out.writes.finished.push(active.row);
    }

    pub(super) fn after_transition(&mut self, job_id: &str, effects: &[Effect], out: &mut Out<'_>) {
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
    pub(super) fn publish_admitted(&mut self, job_id: &str, out: &mut Out<'_>) {
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
            let routes = &self.settings.routes;
            let now_ms = self.now_ms;
            let partition_of = |salt: u32| {
                let key = routes.admitted_key_of(&published, now_ms, salt);
                overtaken::admitted_partition(key.as_bytes(), routes.admitted_partitions)
            };
            let after_ms = self.settings.timing.claim_overtaken_after_ms;
            // Published again (a takeover, a claim timeout), or its worker
            // was lost: its key's partition may have no consumer.
            let reroute = published.state.previous_attempt_lost()
                || published
                    .state
                    .admitted_at_ms
                    .is_some_and(|admitted_at| admitted_at < now_ms);
            let salt = self
                .overtaken
                .salt(&task_group, job_id, now_ms, after_ms, reroute, partition_of);
            let partition = partition_of(salt);
            self.overtaken.published(&task_group, job_id, now_ms, salt, partition);
            routes.push_admitted(out.outbox, &published, now_ms, salt);
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
    fn with_admitted_span(&mut self, job_id: &str) -> Option<JobRow> {
        let active = self.jobs.get(job_id)?;
        let now = sluice_common::clock::system_time_at_ms(self.now_ms);
        let (admitted_trace, span) = plan_span(SCOPE, "admission.admit", &active.row.trace, now, now, || {
            vec![
                KeyValue::new("sluice.job_id", job_id.to_string()),
                KeyValue::new("sluice.attempt", i64::from(active.row.state.attempt)),
                KeyValue::new("sluice.task_group", active.row.task_group.clone()),
            ]
        });
        let mut published = active.row.clone();
        published.trace = admitted_trace;
        // Recorded once the batch is committed.
        self.planned_spans.extend(span);
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
    pub(super) fn claim_admitted(&mut self, job_id: &str, worker_id: &str, now_ms: i64, confirmed: bool) -> bool {
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
            state.stream_ended_at_ms = None;
            // Only a push is unconfirmed at its claim.
            state.pushed = !confirmed;
            state.heard_at_ms = confirmed.then_some(now_ms);
            state.claimed_at_ms = Some(now_ms);
            state.lease_expires_at_ms = Some(now_ms + state.lease_ms);
            state.due_at_ms = transitions::running_due_at(state);
        });
        self.awaiting_payload.remove(job_id);
        if confirmed {
            // A worker's own claim: its group's consumers got this far.
            if let Some(active) = self.jobs.get(job_id) {
                let worker = active.row.state.claimed_by.as_deref().unwrap_or_default();
                self.overtaken.claimed(&active.row.task_group, job_id, now_ms, worker);
            }
        } else {
            self.overtaken.forget(job_id);
        }
        true
    }

    /// Stream workers have credits again: push the admitted jobs that wait
    /// for them, oldest first, while credits last.
    /// A job whose tenant no session with a credit may run (stream workers
    /// scoped to other tenants) keeps its place and lets the jobs behind it
    /// go.
    pub(super) fn dispatch_unclaimed(&mut self) {
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
    pub(super) fn queue_pushes(&mut self, out: &mut Out<'_>) {
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
    pub(super) fn keep_payload(&mut self, job_id: &str, payload: Vec<u8>) {
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
    pub(super) fn payload_fits(&self, payload: &[u8]) -> bool {
        let config = &self.settings.config.admission;
        payload.len() <= config.memory_payload_max_bytes
            && self.payload_bytes + payload.len() <= config.memory_payload_budget_bytes
    }

    /// Close the batch's journal entry (and a snapshot, when due).
    pub(super) fn close_batch(&mut self, writes: &mut AdmissionWrites) {
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
    pub(super) fn next_enqueue_time_us(&mut self, now_us: i64) -> i64 {
        let next = now_us.max(self.last_enqueued_at_us + 1);
        self.last_enqueued_at_us = next;
        next
    }

    /// Publish admitted jobs whose payload was read.
    pub(super) fn publish_read_payloads(&mut self, out: &mut Out<'_>) {
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
}
