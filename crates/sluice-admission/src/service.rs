//! The `Admission` gRPC service: thin adapters over `AdmissionCore`.

use std::sync::Arc;

use sluice_common::validate::{check_name, check_text, FieldError, MAX_ID_BYTES, MAX_TEXT_BYTES};
use sluice_proto::v1 as pb;
use sluice_proto::v1::limits_client::LimitsClient;
use sluice_proto::v1::rate_limits_client::RateLimitsClient;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::chain;
use crate::core::{AdmissionCore, AdmissionError, Incoming, OnConflict};
use crate::jobs::JobRow;
use crate::transitions::{AttemptEnd, Status as JobStatus};

pub struct AdmissionApi {
    pub core: Arc<AdmissionCore>,
    pub limits: LimitsClient<Channel>,
    pub rates: RateLimitsClient<Channel>,
}

const MAX_BATCH_ITEMS: usize = 10_000;

fn check_batch<T>(field: &str, items: &[T]) -> Result<(), Status> {
    if items.is_empty() {
        return Err(FieldError::new(field, "must not be empty").into());
    }
    if items.len() > MAX_BATCH_ITEMS {
        return Err(FieldError::new(field, format!("at most {MAX_BATCH_ITEMS} per call")).into());
    }
    Ok(())
}

fn attempts_of(field: &str, jobs: Vec<pb::JobAttempt>) -> Result<Vec<(String, u32)>, Status> {
    check_batch(field, &jobs)?;
    jobs.into_iter()
        .enumerate()
        .map(|(index, job)| {
            check_name(&format!("{field}[{index}].job_id"), &job.job_id, MAX_ID_BYTES)?;
            if job.attempt == 0 {
                return Err(FieldError::new(format!("{field}[{index}].attempt"), "attempts start at 1").into());
            }
            Ok((job.job_id, job.attempt))
        })
        .collect()
}

impl AdmissionApi {
    fn incoming(
        &self,
        field_prefix: Option<String>,
        request: pb::JobRequest,
        trace: &pb::TraceContext,
    ) -> Result<Incoming, Status> {
        let job_id = request
            .job_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let valid = chain::validate(&self.core.config, request).map_err(|error| match &field_prefix {
            Some(prefix) => error.within(prefix),
            None => error,
        })?;
        Ok(Incoming {
            job_id,
            valid,
            trace: trace.clone(),
        })
    }

    async fn wait_info(&self, row: &JobRow) -> (Option<pb::WaitInfo>, String) {
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
            let floating_note = floating_note(step.floating.as_ref(), &key_state);
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
            return (Some(info), reason);
        }
        let Some(rate_key) = step.rate_key.clone() else {
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

    async fn view(&self, row: JobRow) -> pb::JobView {
        let state = &row.state;
        let (waiting, reason) = match state.status {
            JobStatus::Waiting => self.wait_info(&row).await,
            JobStatus::Scheduled if state.attempts_used > 0 => (
                None,
                format!(
                    "retry backoff until {} (attempt {} of {} next); last error: {}",
                    state.due_at_ms.unwrap_or_default(),
                    state.attempts_used + 1,
                    state.max_attempts,
                    state.last_error
                ),
            ),
            JobStatus::Scheduled => (
                None,
                format!(
                    "scheduled: starts acquiring at run_at {}",
                    state.due_at_ms.unwrap_or_default()
                ),
            ),
            JobStatus::Admitted => (
                None,
                "admitted: holds every limit; waiting for a worker's claim".to_string(),
            ),
            JobStatus::Running => (
                None,
                format!(
                    "running on worker {:?}; lease until {}",
                    state.claimed_by.clone().unwrap_or_default(),
                    state.lease_expires_at_ms.unwrap_or_default()
                ),
            ),
            JobStatus::Cancelling => (
                None,
                "cancel requested: tickets return when the worker confirms or the lease expires".to_string(),
            ),
            JobStatus::Succeeded => (None, "succeeded".to_string()),
            JobStatus::Failed => (None, format!("failed: {}", state.last_error)),
            JobStatus::Cancelled => (
                None,
                format!("cancelled: {}", state.cancel_reason.clone().unwrap_or_default()),
            ),
            JobStatus::Unspecified => (None, String::new()),
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
            listed_limits: row.spec.limits.clone(),
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
            fairness_key: row.spec.fairness_key.clone(),
            history: state.history.records.clone(),
        }
    }
}

#[tonic::async_trait]
impl pb::admission_server::Admission for AdmissionApi {
    async fn enqueue(&self, request: Request<pb::EnqueueRequest>) -> Result<Response<pb::EnqueueResponse>, Status> {
        let trace = sluice_common::telemetry::trace_context_from_metadata(request.metadata());
        let Some(job) = request.into_inner().job else {
            return Err(FieldError::new("job", "must be set").into());
        };
        let incoming = self.incoming(None, job, &trace)?;
        let mut outcomes = self
            .core
            .enqueue(std::slice::from_ref(&incoming), OnConflict::Refuse)
            .await
            .map_err(|error| conflict_status(error, None))?;
        let outcome = outcomes
            .pop()
            .ok_or_else(|| Status::internal("enqueue returned nothing"))?;
        Ok(Response::new(pb::EnqueueResponse {
            job_id: outcome.job_id,
            status: outcome.status as i32,
            deduplicated: outcome.deduplicated,
        }))
    }

    async fn enqueue_batch(
        &self,
        request: Request<pb::EnqueueBatchRequest>,
    ) -> Result<Response<pb::EnqueueBatchResponse>, Status> {
        let trace = sluice_common::telemetry::trace_context_from_metadata(request.metadata());
        let jobs = request.into_inner().jobs;
        check_batch("jobs", &jobs)?;
        let incoming = jobs
            .into_iter()
            .enumerate()
            .map(|(index, job)| self.incoming(Some(format!("jobs[{index}]")), job, &trace))
            .collect::<Result<Vec<_>, Status>>()?;
        let outcomes = self
            .core
            .enqueue(&incoming, OnConflict::Refuse)
            .await
            .map_err(|error| conflict_status(error, Some("jobs")))?;
        Ok(Response::new(pb::EnqueueBatchResponse {
            results: outcomes
                .into_iter()
                .map(|outcome| pb::EnqueueResponse {
                    job_id: outcome.job_id,
                    status: outcome.status as i32,
                    deduplicated: outcome.deduplicated,
                })
                .collect(),
        }))
    }

    async fn get_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::GetJobResponse>, Status> {
        let job_id = request.into_inner().job_id;
        check_name("job_id", &job_id, MAX_ID_BYTES)?;
        let row = self.core.get_job(&job_id).await.map_err(|error| error.to_status())?;
        let Some(row) = row else {
            return Err(Status::not_found(format!("job {job_id} not found")));
        };
        Ok(Response::new(pb::GetJobResponse {
            job: Some(self.view(row).await),
        }))
    }

    async fn cancel_job(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::CancelJobResponse>, Status> {
        let message = request.into_inner();
        check_name("job_id", &message.job_id, MAX_ID_BYTES)?;
        check_text("reason", &message.reason, MAX_TEXT_BYTES)?;
        let reason = if message.reason.is_empty() {
            "cancelled by request".to_string()
        } else {
            message.reason
        };
        let status = self
            .core
            .cancel(&message.job_id, &reason)
            .await
            .map_err(|error| error.to_status())?;
        match status {
            Some(status) => Ok(Response::new(pb::CancelJobResponse { status: status as i32 })),
            None => Err(Status::not_found(format!("job {} not found", message.job_id))),
        }
    }

    async fn claim(&self, request: Request<pb::ClaimRequest>) -> Result<Response<pb::ClaimResponse>, Status> {
        let message = request.into_inner();
        check_name("worker_id", &message.worker_id, MAX_ID_BYTES)?;
        let attempts = attempts_of("jobs", message.jobs)?;
        let results = self
            .core
            .claim(&message.worker_id, attempts)
            .await
            .map_err(|error| error.to_status())?;
        Ok(Response::new(pb::ClaimResponse { results }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let message = request.into_inner();
        check_name("worker_id", &message.worker_id, MAX_ID_BYTES)?;
        let attempts = attempts_of("jobs", message.jobs)?;
        let results = self
            .core
            .heartbeat(&message.worker_id, attempts)
            .await
            .map_err(|error| error.to_status())?;
        Ok(Response::new(pb::HeartbeatResponse { results }))
    }

    async fn complete(&self, request: Request<pb::CompleteRequest>) -> Result<Response<pb::CompleteResponse>, Status> {
        // The worker's span, when it sent one: the completion hangs below it.
        let caller_trace = sluice_common::telemetry::trace_context_from_metadata(request.metadata());
        let message = request.into_inner();
        check_name("worker_id", &message.worker_id, MAX_ID_BYTES)?;
        check_batch("completions", &message.completions)?;
        let mut completions = Vec::with_capacity(message.completions.len());
        for (index, completion) in message.completions.into_iter().enumerate() {
            let field = format!("completions[{index}]");
            check_name(&format!("{field}.job_id"), &completion.job_id, MAX_ID_BYTES)?;
            if completion.attempt == 0 {
                return Err(FieldError::new(format!("{field}.attempt"), "attempts start at 1").into());
            }
            let end = match completion.outcome {
                Some(pb::completion::Outcome::Success(_)) => AttemptEnd::Succeeded,
                Some(pb::completion::Outcome::Failure(failure)) => {
                    check_text(&format!("{field}.failure.error"), &failure.error, MAX_TEXT_BYTES)?;
                    AttemptEnd::Failed {
                        error: failure.error,
                        non_retryable: failure.non_retryable,
                    }
                }
                Some(pb::completion::Outcome::HandBack(hand_back)) => {
                    check_text(&format!("{field}.hand_back.reason"), &hand_back.reason, MAX_TEXT_BYTES)?;
                    AttemptEnd::HandedBack {
                        reason: if hand_back.reason.is_empty() {
                            "handed back".to_string()
                        } else {
                            hand_back.reason
                        },
                    }
                }
                None => {
                    return Err(FieldError::new(format!("{field}.outcome"), "set success, failure or hand_back").into())
                }
            };
            completions.push((completion.job_id, completion.attempt, end));
        }
        let results = self
            .core
            .complete(&message.worker_id, completions, &caller_trace)
            .await
            .map_err(|error| error.to_status())?;
        Ok(Response::new(pb::CompleteResponse { results }))
    }
}

/// A conflict names the job (and, in a batch, its index); other errors map
/// as `AdmissionError::to_status` says.
fn conflict_status(error: AdmissionError, batch_field: Option<&str>) -> Status {
    match (&error, batch_field) {
        (AdmissionError::Conflict { index, job_id }, Some(field)) => Status::already_exists(format!(
            "{field}[{index}].job_id: job {job_id:?} already exists with a different request; nothing of the batch \
             was saved"
        )),
        (AdmissionError::Conflict { job_id, .. }, None) => Status::already_exists(format!(
            "job_id: job {job_id:?} already exists with a different request"
        )),
        _ => error.to_status(),
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
