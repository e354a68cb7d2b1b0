//! Grants: a grant event moves its job to its next step or admits it; a
//! grant nobody wants is released.

use sluice_proto::v1 as pb;

use crate::chain::StoredStep;
use crate::transitions::{Effect, Status};

use super::spans::wait_span;
use super::{AdmissionPartition, Out};

impl AdmissionPartition {
    /// Apply grant events: advance the job to its next step, or admit it. A
    /// duplicate re-sends its effect; a grant nobody wants is released.
    pub(super) fn grants(&mut self, now_ms: i64, events: Vec<pb::GrantEvent>, out: &mut Out<'_>) {
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
}
