//! Requests from this instance's gRPC handlers and links (`Local`), and
//! the tenant scope of what a caller may see.

use sluice_common::auth::JobScope;
use sluice_proto::v1 as pb;

use tokio::sync::oneshot;

use crate::transitions::{AttemptEnd, StreamEnd};

use super::{checked_handover, AdmissionPartition, HandOver, Local, Out};

impl AdmissionPartition {
    pub(super) fn apply_local(&mut self, now_ms: i64, local: Local, out: &mut Out<'_>) {
        match local {
            Local::Enqueue {
                jobs,
                on_conflict,
                reply,
            } => {
                let outcome = self.enqueue(now_ms, &jobs, on_conflict, out);
                reply_after_commit(out, reply, outcome);
            }
            Local::Describe { job_id, reply } => {
                let job = self.jobs.get(&job_id).map(|active| active.row.clone());
                reply_after_commit(out, reply, job);
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
                reply_after_commit(out, reply, status);
            }
            Local::Claim {
                worker_id,
                attempts,
                scope,
                reply,
            } => {
                let results = self.claim_in_scope(now_ms, &worker_id, attempts, &scope);
                reply_after_commit(out, reply, results);
            }
            Local::Heartbeat {
                worker_id,
                attempts,
                ended,
                scope,
                reply,
            } => {
                let results = self.heartbeat_in_scope(now_ms, &worker_id, attempts, ended, &scope);
                reply_after_commit(out, reply, results);
            }
            Local::Complete {
                worker_id,
                completions,
                scope,
                caller_trace,
                reply,
            } => {
                let results = self.complete_in_scope(now_ms, &worker_id, completions, &scope, &caller_trace, out);
                reply_after_commit(out, reply, results);
            }
            Local::Grants(events) => self.grants(now_ms, events, out),
            Local::Dispatch => self.dispatch_unclaimed(),
            // The push told the worker its lease runs from `written_at_ms`
            // (another clock than the partition's, possibly a little ahead).
            Local::Pushed {
                worker_id,
                attempts,
                written_at_ms,
            } => self.pushed(now_ms.max(written_at_ms), &worker_id, &attempts),
            Local::PathChanged { link, partitions } => self.resend_on_path(link, &partitions, out.outbox),
            Local::HandOver { handovers, reply } => {
                for handover in handovers {
                    self.hand_over(now_ms, handover, out);
                }
                reply_after_commit(out, reply, ());
            }
            Local::Barrier(reply) => reply_after_commit(out, reply, ()),
        }
    }

    /// A claim, its jobs outside the caller's scope answered not found.
    fn claim_in_scope(
        &mut self,
        now_ms: i64,
        worker_id: &str,
        attempts: Vec<(String, u32)>,
        scope: &JobScope,
    ) -> Vec<pb::ClaimResult> {
        let shown = self.shown(attempts.iter().map(|(job_id, _)| job_id.as_str()), scope);
        within_scope(
            attempts,
            &shown,
            |(job_id, attempt)| pb::ClaimResult {
                job_id: job_id.clone(),
                attempt: *attempt,
                outcome: pb::ClaimOutcome::NotFound as i32,
                ..Default::default()
            },
            |attempts| self.claim(now_ms, worker_id, &attempts),
        )
    }

    /// Heartbeats, their jobs outside the caller's scope answered lease lost.
    fn heartbeat_in_scope(
        &mut self,
        now_ms: i64,
        worker_id: &str,
        attempts: Vec<(String, u32)>,
        ended: Option<StreamEnd>,
        scope: &JobScope,
    ) -> Vec<pb::HeartbeatResult> {
        let shown = self.shown(attempts.iter().map(|(job_id, _)| job_id.as_str()), scope);
        within_scope(
            attempts,
            &shown,
            |(job_id, attempt)| pb::HeartbeatResult {
                job_id: job_id.clone(),
                attempt: *attempt,
                outcome: pb::HeartbeatOutcome::LeaseLost as i32,
                lease_expires_at_ms: 0,
            },
            |attempts| self.heartbeat(now_ms, worker_id, &attempts, ended),
        )
    }

    /// Completions, their jobs outside the caller's scope answered not found.
    fn complete_in_scope(
        &mut self,
        now_ms: i64,
        worker_id: &str,
        completions: Vec<(String, u32, AttemptEnd)>,
        scope: &JobScope,
        caller_trace: &pb::TraceContext,
        out: &mut Out<'_>,
    ) -> Vec<pb::CompleteResult> {
        let shown = self.shown(completions.iter().map(|(job_id, _, _)| job_id.as_str()), scope);
        within_scope(
            completions,
            &shown,
            |(job_id, attempt, _)| pb::CompleteResult {
                job_id: job_id.clone(),
                attempt: *attempt,
                outcome: pb::CompleteOutcome::NotFound as i32,
                ..Default::default()
            },
            |completions| self.complete(now_ms, worker_id, completions, caller_trace, out),
        )
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
    pub(super) fn check_handover(&self, entry: &[u8]) -> Result<HandOver, String> {
        let handover: pb::JobHandOver =
            prost::Message::decode(entry).map_err(|error| format!("undecodable job hand-over: {error}"))?;
        Ok(checked_handover(&self.settings.config, handover))
    }
}

/// The answers to a call's `entries` in call order: those `shown` from
/// `act`, the others `hidden` (as if their jobs did not exist). An empty
/// `shown` shows every entry.
pub(super) fn within_scope<T, R>(
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

/// Answers a local request once its batch is durable (`Out::replies`).
fn reply_after_commit<T: Send + 'static>(out: &mut Out<'_>, reply: oneshot::Sender<T>, answer: T) {
    out.replies.push(Box::new(move || {
        let _ = reply.send(answer);
    }));
}
