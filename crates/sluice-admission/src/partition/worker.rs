//! The worker protocol: claims (exactly one per attempt), heartbeats and
//! leases, pushes to stream workers, completions and cancels.

// Seeded maps: what the core iterates comes out in an order a seed fixes,
// so the simulation replays a history exactly (sluice_common::hash).
use sluice_common::hash::HashSet;

use sluice_proto::v1 as pb;

use crate::transitions::{self, AttemptEnd, JobState, Status, StreamEnd};

use super::spans::complete_span;
use super::{AdmissionPartition, Out};

impl AdmissionPartition {
    /// Claim admitted attempts for `worker_id`: exactly one claim per
    /// attempt wins.
    pub(super) fn claim(&mut self, now_ms: i64, worker_id: &str, attempts: &[(String, u32)]) -> Vec<pb::ClaimResult> {
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

    /// Extend leases; name the jobs to stop. Every renewal is saved before
    /// its answer, so a new owner knows the lease end each worker was told
    /// and holds it no longer (`AdmissionPartition::grant_lease_grace`); the
    /// first heartbeat of a pushed attempt also confirms it, so whoever owns
    /// the partition later counts its lease expiry as an attempt used. With
    /// `ended`, the attempts' stream ended instead: their leases are
    /// shortened (`transitions::on_stream_ended`) unless the worker was
    /// heard since, and that is saved too, so that a new owner does not give
    /// a dead worker's attempt a fresh lease.
    pub(super) fn heartbeat(
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
                    // Not `lease > now_ms`: the attempt is the worker's until
                    // a timer ends it, and a lease end waits for what was
                    // received before it (`lease_end_waits_for_queued_requests`);
                    // this heartbeat, applied before the batch's timers, may
                    // be one (after a takeover, whose lease is the one the
                    // worker was told, behind a load of seconds).
                });
                if holder.is_none() {
                    return result;
                }
                let renew = |state: &mut JobState| match ended {
                    Some(ended) => {
                        if transitions::on_stream_ended(state, now_ms, ended) {
                            tracing::info!(job_id = %state.job_id, attempt = state.attempt, lease_expires_at_ms = ?state.lease_expires_at_ms, "the attempt's Work stream ended: lease shortened to the grace");
                        }
                    }
                    None => {
                        // Never before the lease end already told (a push
                        // stamps its lease from its own clock).
                        let renewed = now_ms + state.lease_ms;
                        state.lease_expires_at_ms =
                            Some(state.lease_expires_at_ms.map_or(renewed, |lease| lease.max(renewed)));
                        state.confirmed = true;
                        state.heard_at_ms = Some(now_ms);
                        state.stream_ended_at_ms = None;
                        state.due_at_ms = transitions::running_due_at(state);
                    }
                };
                // Saved before the answer: the lease end it tells the
                // worker, a confirmation, a stream end.
                self.update(job_id, renew);
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
    pub(super) fn pushed(&mut self, now_ms: i64, worker_id: &str, attempts: &[(String, u32)]) {
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
    pub(super) fn complete(
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
            } else if let Some(effects) = self.late_success(now_ms, &job_id, attempt, &end, worker_id) {
                result.outcome = pb::CompleteOutcome::Accepted as i32;
                result.status = Status::Succeeded as i32;
                self.after_transition(&job_id, &effects, out);
            } else if let Some(active) = self.jobs.get(&job_id) {
                result.outcome = pb::CompleteOutcome::Stale as i32;
                result.status = active.row.state.status as i32;
            } else {
                result.outcome = pb::CompleteOutcome::NotFound as i32;
            }
            if let Some(trace) = trace.filter(|_| sluice_common::telemetry::spans_exported()) {
                out.outbox.observe(complete_span(&result, caller_trace, &trace, now_ms));
            }
            results.push(result);
        }
        results
    }

    /// A success reported after its attempt was handed back as lost on its
    /// way, while the next attempt has not started
    /// (`transitions::late_success`): the job ends succeeded.
    fn late_success(
        &mut self,
        now_ms: i64,
        job_id: &str,
        attempt: u32,
        end: &AttemptEnd,
        worker_id: &str,
    ) -> Option<Vec<transitions::Effect>> {
        let applies = matches!(end, AttemptEnd::Succeeded)
            && self
                .jobs
                .get(job_id)
                .is_some_and(|active| transitions::succeeds_late(&active.row.state, attempt, worker_id));
        if !applies {
            return None;
        }
        let mut effects = Vec::new();
        self.update(job_id, |state| {
            effects = transitions::late_success(state, now_ms, attempt);
        });
        Some(effects)
    }

    /// Cancel a job (`transitions::cancel`). `None`: no such job.
    pub(super) fn cancel(&mut self, now_ms: i64, job_id: &str, reason: &str, out: &mut Out<'_>) -> Option<Status> {
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
}

/// The same worker completing an attempt whose completion is already saved.
pub(super) fn is_duplicate_completion(state: &JobState, attempt: u32) -> bool {
    let last = state.history.records.last();
    last.is_some_and(|record| record.attempt == attempt && record.outcome == "succeeded")
        && state.status == Status::Succeeded
        && state.attempt == attempt
}
