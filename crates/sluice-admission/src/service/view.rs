//! What `GetJob` shows of a job: its row as a view, and what the job waits
//! on, asked of the limit or rate owner of its current step.

use sluice_proto::v1 as pb;
use tonic::Response;

use super::AdmissionApi;
use crate::chain;
use crate::jobs::JobRow;
use crate::transitions::{JobState, Status as JobStatus};

impl AdmissionApi {
    pub(super) async fn wait_info(&self, row: &JobRow) -> (Option<pb::WaitInfo>, String) {
        let state = &row.state;
        let Some(step) = state.chain.get(usize::try_from(state.step).unwrap_or(usize::MAX)) else {
            return (None, "waiting".to_string());
        };
        let ticket = pb::TicketId {
            job_id: state.job_id.clone(),
            attempt: state.attempt,
            step: state.step,
        };
        let waiting_since_ms = state.step_started_at_ms.unwrap_or_default();
        let name = chain::describe_step(step);
        if step.is_ticketed() {
            return self.key_wait_info(step, ticket, &name, waiting_since_ms).await;
        }
        self.rate_wait_info(step, ticket, &name, waiting_since_ms).await
    }

    /// A job waiting on a concurrency, floating or adaptive key, as the
    /// key's owner in limit-grant sees it.
    async fn key_wait_info(
        &self,
        step: &chain::StoredStep,
        ticket: pb::TicketId,
        name: &str,
        waiting_since_ms: i64,
    ) -> (Option<pb::WaitInfo>, String) {
        let mut client = self.limits.clone();
        let described = client
            .describe_key(pb::DescribeKeyRequest {
                key: Some(pb::KeyRef {
                    tenant: step.tenant.clone(),
                    key: step.key.clone(),
                }),
                ticket: Some(ticket),
                first_waiters: 1,
            })
            .await;
        let Ok(described) = described.map(Response::into_inner) else {
            return (
                None,
                format!("waiting on {name} (its owner did not answer; limit-grant unreachable?)"),
            );
        };
        let key_state = described.state.unwrap_or_default();
        let max = key_state.effective_max.unwrap_or(i64::from(step.max_concurrency));
        let holders = u32::try_from(key_state.holders.len()).unwrap_or(u32::MAX);
        let info = pb::WaitInfo {
            tenant: step.tenant.clone(),
            key: step.key.clone(),
            kind: step.kind,
            holders,
            max,
            overridden: key_state.override_max.is_some(),
            paused: key_state.paused,
            position: described.ticket_position.unwrap_or_default(),
            waiting: key_state.waiting,
            retry_at_ms: None,
            waiting_since_ms,
        };
        let floating_note = floating_note(step.floating.as_deref(), &key_state);
        let reason = if described.ticket_held {
            format!("granted {name}; moving to the next step")
        } else if key_state.paused {
            format!("waiting on {name}: the key is paused (override 0)")
        } else if let Some(position) = described.ticket_position {
            format!(
                "waiting on {name}: {holders} of {max} held, {position} ahead of this job among {} waiting{floating_note}",
                key_state.waiting
            )
        } else {
            format!("waiting on {name}: the acquire is on its way to the key's owner")
        };
        (Some(info), reason)
    }

    /// A job waiting on a rate window, as its owner in rate-window sees it.
    async fn rate_wait_info(
        &self,
        step: &chain::StoredStep,
        ticket: pb::TicketId,
        name: &str,
        waiting_since_ms: i64,
    ) -> (Option<pb::WaitInfo>, String) {
        let Some(rate_key) = step.rate_key.as_deref().cloned() else {
            return (None, format!("waiting on {name}"));
        };
        let mut client = self.rates.clone();
        let described = client
            .describe_rate_key(pb::DescribeRateKeyRequest {
                key: Some(rate_key),
                ticket: Some(ticket),
            })
            .await;
        let Ok(described) = described.map(Response::into_inner) else {
            return (None, format!("waiting on {name} (rate-window did not answer)"));
        };
        let info = pb::WaitInfo {
            tenant: step.tenant.clone(),
            key: step.key.clone(),
            kind: step.kind,
            holders: 0,
            max: described.limit,
            overridden: false,
            paused: false,
            position: described.ticket_position.unwrap_or_default(),
            waiting: described.waiting,
            retry_at_ms: described.ticket_retry_at_ms,
            waiting_since_ms,
        };
        let reason = if described.stored_resource_missing {
            format!("{name} names no stored rate limit: not throttled")
        } else if let Some(retry_at) = described.ticket_retry_at_ms {
            format!(
                "waiting on {name}: {} of {} units used in the window; this job's slot opens at {retry_at} (unix ms)",
                described.used, described.limit
            )
        } else {
            format!("waiting on {name}")
        };
        (Some(info), reason)
    }

    pub(super) async fn view(&self, row: JobRow) -> pb::JobView {
        let state = &row.state;
        let spec = row.spec.request();
        let (waiting, reason) = match state.status {
            JobStatus::Waiting => self.wait_info(&row).await,
            _ => (None, status_reason(state)),
        };
        let unthrottled: Vec<&str> = state
            .history
            .records
            .iter()
            .filter(|record| record.attempt == state.attempt && record.outcome == "unthrottled")
            .map(|record| record.detail.as_str())
            .collect();
        let reason = if unthrottled.is_empty() {
            reason
        } else {
            format!("{reason}; {}", unthrottled.join("; "))
        };
        pb::JobView {
            job_id: state.job_id.clone(),
            tenant: row.tenant.clone(),
            task_group: row.task_group.clone(),
            priority: row.priority,
            status: state.status as i32,
            attempt: state.attempt,
            max_attempts: state.max_attempts,
            listed_limits: spec.limits,
            acquisition_order: state.chain.iter().map(chain::StoredStep::view).collect(),
            step: state.step.min(state.chain_len()),
            enqueued_at_ms: row.enqueued_at_us / 1000,
            run_at_ms: row.run_at_ms,
            admitted_at_ms: state.admitted_at_ms,
            claimed_by: state.claimed_by.clone().unwrap_or_default(),
            lease_expires_at_ms: state.lease_expires_at_ms,
            waiting,
            reason,
            last_error: state.last_error.clone(),
            finished_at_ms: state.finished_at_ms,
            idempotency_key: row.idempotency_key.clone().unwrap_or_default(),
            fairness_key: spec.fairness_key,
            history: state.history.records.clone(),
        }
    }
}

/// Why a job that is not waiting on a limit is where it is (a waiting job's
/// reason comes from the limit's owner: `wait_info`).
fn status_reason(state: &JobState) -> String {
    match state.status {
        JobStatus::Scheduled if state.attempts_used > 0 => format!(
            "retry backoff until {} (attempt {} of {} next); last error: {}",
            state.due_at_ms.unwrap_or_default(),
            state.attempts_used + 1,
            state.max_attempts,
            state.last_error
        ),
        JobStatus::Scheduled => format!(
            "scheduled: starts acquiring at run_at {}",
            state.due_at_ms.unwrap_or_default()
        ),
        JobStatus::Admitted => "admitted: holds every limit; waiting for a worker's claim".to_string(),
        JobStatus::Running => format!(
            "running on worker {:?}; lease until {}",
            state.claimed_by.clone().unwrap_or_default(),
            state.lease_expires_at_ms.unwrap_or_default()
        ),
        JobStatus::Cancelling => {
            "cancel requested: tickets return when the worker confirms or the lease expires".to_string()
        }
        JobStatus::Succeeded => "succeeded".to_string(),
        JobStatus::Failed => format!("failed: {}", state.last_error),
        JobStatus::Cancelled => format!("cancelled: {}", state.cancel_reason.clone().unwrap_or_default()),
        JobStatus::Waiting | JobStatus::Unspecified => String::new(),
    }
}

/// For a job waiting on a floating key: where the max comes from, and which
/// of the job's own values the key's shared state overrides.
fn floating_note(own: Option<&pb::FloatingConcurrencyLimit>, key_state: &pb::KeyState) -> String {
    let (Some(own), Some(shared)) = (own, key_state.floating.as_ref()) else {
        return String::new();
    };
    let current = key_state
        .floating_max
        .map_or_else(|| "unknown".to_string(), |max| max.to_string());
    let mut ignored = Vec::new();
    if own.default_max != shared.default_max {
        ignored.push(format!(
            "default_max {} (the key's is {})",
            own.default_max, shared.default_max
        ));
    }
    if own.refresh_interval_ms != shared.refresh_interval_ms {
        ignored.push(format!(
            "refresh_interval_ms {} (the key's is {})",
            own.refresh_interval_ms, shared.refresh_interval_ms
        ));
    }
    if own.metadata != shared.metadata {
        ignored.push("metadata".to_string());
    }
    if ignored.is_empty() {
        format!("; floating max {current} from the key's shared state")
    } else {
        format!(
            "; floating max {current} from the key's shared state, created by the first job that used it: this job's {} ignored",
            ignored.join(", ")
        )
    }
}
