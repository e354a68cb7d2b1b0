//! The `Admission` gRPC service: thin adapters. Validate, reach the job's
//! owner (this instance's partition task, or one forward to the owner the
//! directory names), map errors. Calls naming jobs of several partitions
//! are split by partition and their answers merged in the caller's order.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_common::auth::{principal_of, Action, Channel, JobScope, Principal};
use sluice_common::forward::{forwarded_request, is_forwarded, owner_endpoint, ChannelCache};
use sluice_common::owner::OwnerRegistry;
use sluice_common::partition::job_partition;
use sluice_common::validate::{check_name, check_text, FieldError, MAX_ID_BYTES, MAX_TEXT_BYTES};
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;
use sluice_proto::v1::limits_client::LimitsClient;
use sluice_proto::v1::rate_limits_client::RateLimitsClient;
use sqlx::PgPool;
use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use crate::chain;
use crate::jobs::{request_fingerprint, JobRow};
use crate::partition::{EnqueueConflict, EnqueueError, Incoming, Local, OnConflict};
use crate::transitions::{AttemptEnd, Status as JobStatus, StreamEnd};

#[derive(Clone)]
pub struct AdmissionApi {
    pub config: Arc<sluice_common::SluiceConfig>,
    pub registry: Arc<OwnerRegistry<Local>>,
    pub pool: PgPool,
    pub own_endpoint: String,
    pub channels: Arc<ChannelCache>,
    pub jobs_partitions: i32,
    pub limits: LimitsClient<Channel>,
    pub rates: RateLimitsClient<Channel>,
    /// This instance's `Work` stream sessions.
    pub hub: Arc<crate::work::WorkerHub>,
    /// Per-tenant quotas (shared with the partitions).
    pub quotas: Arc<crate::quota::Quotas>,
    pub shutdown: sluice_common::Shutdown,
}

const MAX_BATCH_ITEMS: usize = 10_000;

pub(crate) fn check_batch<T>(field: &str, items: &[T]) -> Result<(), Status> {
    if items.is_empty() {
        return Err(FieldError::new(field, "must not be empty").into());
    }
    if items.len() > MAX_BATCH_ITEMS {
        return Err(FieldError::new(field, format!("at most {MAX_BATCH_ITEMS} per call")).into());
    }
    Ok(())
}

pub(crate) fn attempts_of(field: &str, jobs: Vec<pb::JobAttempt>) -> Result<Vec<(String, u32)>, Status> {
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

/// Who answered a call: this instance's partition task, or the owner it
/// was forwarded to.
enum OwnerAnswer<R, F> {
    Here(R),
    Forwarded(F),
}

/// How long a call waits for its job's partition to get an owner (a
/// rebalance, or this instance still loading it) before it answers
/// `UNAVAILABLE` (NOT_OWNER).
const OWNER_WAIT: Duration = Duration::from_secs(5);
/// How often a waiting call looks at the owner directory again.
const OWNER_RECHECK: Duration = Duration::from_millis(100);

/// Whether a forwarded call's error says the owner could not be reached or
/// could not answer (it stopped, it is handing the partition over, or the
/// connection broke mid-call), so the call may go to the next owner.
fn owner_unreachable(status: &Status) -> bool {
    use std::error::Error as _;
    match status.code() {
        tonic::Code::Unavailable => true,
        tonic::Code::Unknown | tonic::Code::Cancelled => status
            .source()
            .is_some_and(|source| source.downcast_ref::<tonic::transport::Error>().is_some()),
        _ => false,
    }
}

/// Items of one call grouped by job partition, each with its place in the call.
fn by_partition<T>(items: Vec<T>, partition_of: impl Fn(&T) -> i32) -> BTreeMap<i32, Vec<(usize, T)>> {
    let mut groups: BTreeMap<i32, Vec<(usize, T)>> = BTreeMap::new();
    for (index, item) in items.into_iter().enumerate() {
        groups.entry(partition_of(&item)).or_default().push((index, item));
    }
    groups
}

/// Answers of the groups put back in the call's order.
pub(crate) fn in_call_order<R>(count: usize, answered: Vec<(Vec<usize>, Vec<R>)>) -> Result<Vec<R>, Status> {
    let mut slots: Vec<Option<R>> = (0..count).map(|_| None).collect();
    for (indexes, results) in answered {
        if indexes.len() != results.len() {
            return Err(Status::internal("an owner answered a different number of results"));
        }
        for (index, result) in indexes.into_iter().zip(results) {
            if let Some(slot) = slots.get_mut(index) {
                *slot = Some(result);
            }
        }
    }
    slots
        .into_iter()
        .map(|slot| slot.ok_or_else(|| Status::internal("a result is missing")))
        .collect()
}

impl AdmissionApi {
    fn partition_of(&self, job_id: &str) -> i32 {
        job_partition(job_id, self.jobs_partitions)
    }

    /// `items` grouped by their job's partition, each item with its index in
    /// `items`.
    pub(crate) fn by_job_partition<T>(&self, items: Vec<T>, job_id: impl Fn(&T) -> &str) -> Vec<(Vec<usize>, Vec<T>)> {
        by_partition(items, |item| self.partition_of(job_id(item)))
            .into_values()
            .map(|group| group.into_iter().unzip())
            .collect()
    }

    /// Ask the partition task when this instance owns the partition, else
    /// forward the call to the owner the directory names. While the partition
    /// has no owner, the directory names this instance but its task is not
    /// running yet (it is loading, or the call was forwarded here during a
    /// handover), or the named owner cannot be reached or answers
    /// `UNAVAILABLE` (it stopped, or it is handing the partition over), the
    /// call waits up to `OWNER_WAIT`, woken when a partition task starts
    /// here. Every call is keyed by job and attempt, so sending it again to
    /// the next owner is harmless.
    async fn ask<R, F, Fut>(
        &self,
        partition: i32,
        forwarded: bool,
        make: impl Fn(oneshot::Sender<R>) -> Local,
        forward: impl Fn(AdmissionClient<Channel>) -> Fut,
    ) -> Result<OwnerAnswer<R, F>, Status>
    where
        Fut: std::future::Future<Output = Result<F, Status>>,
    {
        let deadline = tokio::time::Instant::now() + OWNER_WAIT;
        loop {
            let started_here = self.registry.partition_started();
            let unavailable = if self.registry.owns(partition) {
                match self.registry.call(partition, &make).await {
                    Ok(reply) => return Ok(OwnerAnswer::Here(reply)),
                    // The task stopped (the partition is being handed over)
                    // before it answered: ask the next owner.
                    Err(error) => Status::unavailable(error.to_string()),
                }
            } else {
                match owner_endpoint(&self.pool, partition, forwarded, &self.own_endpoint).await {
                    Ok(endpoint) => match forward(AdmissionClient::new(self.channels.channel(&endpoint)?)).await {
                        Ok(answer) => return Ok(OwnerAnswer::Forwarded(answer)),
                        Err(status) if owner_unreachable(&status) => {
                            tracing::debug!(partition, %endpoint, error = %status.message(), "owner unavailable; waiting for the directory to change");
                            status
                        }
                        Err(status) => return Err(status),
                    },
                    Err(status) => status,
                }
            };
            if tokio::time::Instant::now() >= deadline {
                return Err(unavailable);
            }
            tokio::select! {
                () = started_here => {}
                () = tokio::time::sleep(OWNER_RECHECK) => {}
            }
        }
    }

    /// A worker's call about attempts (claim, heartbeat): each job
    /// partition's attempts go to its owner (`ask`), and the results come
    /// back in the call's order.
    async fn ask_per_partition<R, Fut>(
        &self,
        forwarded: bool,
        attempts: Vec<(String, u32)>,
        make: impl Fn(Vec<(String, u32)>, oneshot::Sender<Vec<R>>) -> Local,
        forward: impl Fn(AdmissionClient<Channel>, Vec<pb::JobAttempt>) -> Fut,
    ) -> Result<Vec<R>, Status>
    where
        Fut: std::future::Future<Output = Result<Vec<R>, Status>>,
    {
        let count = attempts.len();
        // The partitions are asked side by side: one whose owner is away
        // (a takeover takes seconds) holds up none of the others.
        let asks = by_partition(attempts, |(job_id, _)| self.partition_of(job_id))
            .into_iter()
            .map(|(partition, group)| {
                let (indexes, attempts): (Vec<usize>, Vec<(String, u32)>) = group.into_iter().unzip();
                let (make, forward) = (&make, &forward);
                async move {
                    let answer = self
                        .ask(
                            partition,
                            forwarded,
                            |reply| make(attempts.clone(), reply),
                            |owner| forward(owner, job_attempts(&attempts)),
                        )
                        .await?;
                    let (OwnerAnswer::Here(results) | OwnerAnswer::Forwarded(results)) = answer;
                    Ok::<_, Status>((indexes, results))
                }
            });
        let answered = futures::future::join_all(asks)
            .await
            .into_iter()
            .collect::<Result<Vec<_>, Status>>()?;
        in_call_order(count, answered)
    }

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
        let valid = chain::validate(&self.config, request).map_err(|error| match &field_prefix {
            Some(prefix) => error.within(prefix),
            None => error,
        })?;
        Ok(Incoming {
            job_id,
            valid,
            trace: trace.clone(),
        })
    }

    /// Enqueue validated jobs at their owners. A conflict (a job id saved
    /// with another request) saves none of the call's jobs when they all
    /// belong to one partition; across partitions, saved rows are checked
    /// first, so only a conflict racing this call can save the others.
    async fn enqueue_all(
        &self,
        caller: &Principal,
        incoming: Vec<Incoming>,
        forwarded: bool,
    ) -> Result<Vec<pb::EnqueueResponse>, Status> {
        for job in &incoming {
            caller.authorize(&job.valid.request.tenant, Action::Enqueue, "tenant")?;
        }
        let count = incoming.len();
        let groups = by_partition(incoming, |job| self.partition_of(&job.job_id));
        if groups.len() > 1 {
            self.check_saved_conflicts(&groups).await?;
        }
        let mut answered = Vec::with_capacity(groups.len());
        for (partition, group) in groups {
            let (indexes, jobs): (Vec<usize>, Vec<Incoming>) = group.into_iter().unzip();
            let answer = match self
                .ask(
                    partition,
                    forwarded,
                    |reply| Local::Enqueue {
                        jobs: jobs.clone(),
                        on_conflict: OnConflict::Refuse,
                        reply,
                    },
                    |mut owner| {
                        let requests: Vec<pb::JobRequest> = jobs
                            .iter()
                            .map(|job| {
                                let mut request = job.valid.request.clone();
                                request.job_id = Some(job.job_id.clone());
                                request
                            })
                            .collect();
                        let indexes = &indexes;
                        async move {
                            Ok(owner
                                .enqueue_batch(forwarded_request(pb::EnqueueBatchRequest { jobs: requests }, caller))
                                .await
                                .map_err(|status| renumber_conflict(status, indexes))?
                                .into_inner()
                                .results)
                        }
                    },
                )
                .await
            {
                Ok(answer) => answer,
                Err(status) if status.code() == tonic::Code::ResourceExhausted => {
                    return Err(saved_before_refusal(status, &answered));
                }
                Err(status) => return Err(status),
            };
            let results = match answer {
                OwnerAnswer::Here(Ok(outcomes)) => outcomes
                    .into_iter()
                    .map(|outcome| pb::EnqueueResponse {
                        job_id: outcome.job_id,
                        status: outcome.status as i32,
                        deduplicated: outcome.deduplicated,
                    })
                    .collect(),
                OwnerAnswer::Here(Err(EnqueueError::Conflict(EnqueueConflict { index, job_id }))) => {
                    return Err(conflict_status(indexes.get(index).copied(), &job_id, count > 1));
                }
                OwnerAnswer::Here(Err(EnqueueError::Quota(refusal))) => {
                    return Err(saved_before_refusal(
                        Status::resource_exhausted(refusal.message),
                        &answered,
                    ));
                }
                OwnerAnswer::Forwarded(results) => results,
            };
            answered.push((indexes, results));
        }
        in_call_order(count, answered)
    }

    /// Refuse the call when a job id it names is saved with another request.
    async fn check_saved_conflicts(&self, groups: &BTreeMap<i32, Vec<(usize, Incoming)>>) -> Result<(), Status> {
        let job_ids: Vec<String> = groups.values().flatten().map(|(_, job)| job.job_id.clone()).collect();
        let mut connection = self.pool.acquire().await.map_err(storage_status)?;
        let saved = crate::store::stored_jobs(&mut connection, &job_ids)
            .await
            .map_err(storage_status)?;
        for (index, job) in groups.values().flatten() {
            let Some(stored) = saved.get(&job.job_id) else {
                continue;
            };
            let mut spec = job.valid.request.clone();
            spec.payload = Vec::new();
            spec.job_id = Some(job.job_id.clone());
            let ours = request_fingerprint(&spec, &job.valid.request.payload);
            if stored.row.request_hash.as_ref().is_some_and(|saved| *saved != ours) {
                return Err(conflict_status(Some(*index), &job.job_id, true));
            }
        }
        Ok(())
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
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let trace = sluice_common::telemetry::trace_context_from_metadata(request.metadata());
        let Some(job) = request.into_inner().job else {
            return Err(FieldError::new("job", "must be set").into());
        };
        let incoming = self.incoming(None, job, &trace)?;
        let mut results = self.enqueue_all(&caller, vec![incoming], forwarded).await?;
        let result = results
            .pop()
            .ok_or_else(|| Status::internal("enqueue returned nothing"))?;
        Ok(Response::new(result))
    }

    async fn enqueue_batch(
        &self,
        request: Request<pb::EnqueueBatchRequest>,
    ) -> Result<Response<pb::EnqueueBatchResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let trace = sluice_common::telemetry::trace_context_from_metadata(request.metadata());
        let jobs = request.into_inner().jobs;
        check_batch("jobs", &jobs)?;
        let incoming = jobs
            .into_iter()
            .enumerate()
            .map(|(index, job)| self.incoming(Some(format!("jobs[{index}]")), job, &trace))
            .collect::<Result<Vec<_>, Status>>()?;
        let results = self.enqueue_all(&caller, incoming, forwarded).await?;
        Ok(Response::new(pb::EnqueueBatchResponse { results }))
    }

    async fn get_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::GetJobResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let scope = caller.job_scope(Action::Read)?;
        let message = request.into_inner();
        let job_id = message.job_id.clone();
        check_name("job_id", &job_id, MAX_ID_BYTES)?;
        let partition = self.partition_of(&job_id);
        let active = match self
            .ask(
                partition,
                forwarded,
                |reply| Local::Describe {
                    job_id: job_id.clone(),
                    reply,
                },
                |mut owner| {
                    let request = forwarded_request(message.clone(), &caller);
                    async move { owner.get_job(request).await }
                },
            )
            .await?
        {
            OwnerAnswer::Here(active) => active,
            OwnerAnswer::Forwarded(response) => return Ok(response),
        };
        let row = match active {
            Some(row) => row,
            // Not active: ended, or never saved.
            None => {
                let mut connection = self.pool.acquire().await.map_err(storage_status)?;
                let mut stored = crate::store::stored_jobs(&mut connection, std::slice::from_ref(&job_id))
                    .await
                    .map_err(storage_status)?;
                match stored.remove(&job_id) {
                    Some(stored) => stored.row,
                    None => return Err(Status::not_found(format!("job {job_id} not found"))),
                }
            }
        };
        if !scope.allows(&row.tenant) {
            return Err(Status::not_found(format!("job {job_id} not found")));
        }
        Ok(Response::new(pb::GetJobResponse {
            job: Some(self.view(row).await),
        }))
    }

    async fn cancel_job(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Result<Response<pb::CancelJobResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let scope = caller.job_scope(Action::Operate)?;
        let message = request.into_inner();
        check_name("job_id", &message.job_id, MAX_ID_BYTES)?;
        check_text("reason", &message.reason, MAX_TEXT_BYTES)?;
        let reason = if message.reason.is_empty() {
            "cancelled by request".to_string()
        } else {
            message.reason.clone()
        };
        let partition = self.partition_of(&message.job_id);
        let answer = self
            .ask(
                partition,
                forwarded,
                |reply| Local::Cancel {
                    job_id: message.job_id.clone(),
                    reason: reason.clone(),
                    scope: scope.clone(),
                    reply,
                },
                |mut owner| {
                    let request = forwarded_request(message.clone(), &caller);
                    async move { owner.cancel_job(request).await }
                },
            )
            .await?;
        match answer {
            OwnerAnswer::Here(Some(status)) => Ok(Response::new(pb::CancelJobResponse { status: status as i32 })),
            OwnerAnswer::Here(None) => Err(Status::not_found(format!("job {} not found", message.job_id))),
            OwnerAnswer::Forwarded(response) => Ok(response),
        }
    }

    async fn claim(&self, request: Request<pb::ClaimRequest>) -> Result<Response<pb::ClaimResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let scope = caller.job_scope(Action::Work)?;
        let message = request.into_inner();
        check_name("worker_id", &message.worker_id, MAX_ID_BYTES)?;
        let attempts = attempts_of("jobs", message.jobs)?;
        let worker_id = &message.worker_id;
        let results = self
            .ask_per_partition(
                forwarded,
                attempts,
                |attempts, reply| Local::Claim {
                    worker_id: worker_id.clone(),
                    attempts,
                    scope: scope.clone(),
                    reply,
                },
                |mut owner, jobs| {
                    let request = forwarded_request(
                        pb::ClaimRequest {
                            worker_id: worker_id.clone(),
                            jobs,
                        },
                        &caller,
                    );
                    async move { Ok(owner.claim(request).await?.into_inner().results) }
                },
            )
            .await?;
        Ok(Response::new(pb::ClaimResponse { results }))
    }

    async fn heartbeat(
        &self,
        request: Request<pb::HeartbeatRequest>,
    ) -> Result<Response<pb::HeartbeatResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        let message = request.into_inner();
        check_name("worker_id", &message.worker_id, MAX_ID_BYTES)?;
        let attempts = attempts_of("jobs", message.jobs)?;
        if message.stream_ended.is_some() && !caller.service {
            return Err(Status::permission_denied(
                "stream_ended: only admission instances report an ended Work stream",
            ));
        }
        let ended = message.stream_ended.map(|ended| StreamEnd::of(&ended));
        let results = self
            .heartbeat_attempts(&caller, forwarded, &message.worker_id, attempts, ended)
            .await?;
        Ok(Response::new(pb::HeartbeatResponse { results }))
    }

    async fn complete(&self, request: Request<pb::CompleteRequest>) -> Result<Response<pb::CompleteResponse>, Status> {
        let forwarded = is_forwarded(request.metadata());
        let caller = principal_of(&request);
        // The worker's span, when it sent one: the completion hangs below it.
        let caller_trace = sluice_common::telemetry::trace_context_from_metadata(request.metadata());
        let message = request.into_inner();
        check_name("worker_id", &message.worker_id, MAX_ID_BYTES)?;
        let results = self
            .complete_attempts(
                &caller,
                forwarded,
                &message.worker_id,
                "completions",
                message.completions,
                &caller_trace,
            )
            .await?;
        Ok(Response::new(pb::CompleteResponse { results }))
    }

    type WorkStream = tokio_stream::wrappers::ReceiverStream<Result<pb::WorkResponse, Status>>;

    async fn work(
        &self,
        request: Request<tonic::Streaming<pb::WorkRequest>>,
    ) -> Result<Response<Self::WorkStream>, Status> {
        let caller = principal_of(&request);
        crate::work_stream::serve(self.clone(), caller, request.into_inner()).await
    }

    async fn set_tenant_quota(
        &self,
        request: Request<pb::SetTenantQuotaRequest>,
    ) -> Result<Response<pb::TenantQuota>, Status> {
        let caller = principal_of(&request);
        let message = request.into_inner();
        check_name("tenant", &message.tenant, self.config.admission.max_key_bytes)?;
        if message.tenant == crate::chain::GLOBAL_CAP_TENANT {
            return Err(FieldError::new("tenant", "\"*\" holds global caps, not jobs: it has no quota").into());
        }
        if !caller.is_admin() {
            return Err(Status::permission_denied(format!(
                "{}: tenant quotas are set by an admin",
                caller.name
            )));
        }
        if let Some(rate) = message.max_enqueues_per_second {
            if !rate.is_finite() || !(0.0..=1_000_000.0).contains(&rate) {
                return Err(FieldError::new("max_enqueues_per_second", "must be from 0 to 1000000").into());
            }
        }
        let stored = if message.clear {
            if message.max_waiting.is_some() || message.max_enqueues_per_second.is_some() {
                return Err(FieldError::new("clear", "clears the override: set no quota with it").into());
            }
            None
        } else {
            Some(crate::quota::QuotaOverride {
                max_waiting: message.max_waiting,
                max_enqueues_per_second: message.max_enqueues_per_second,
            })
        };
        crate::quota::store(&self.pool, &message.tenant, stored)
            .await
            .map_err(storage_status)?;
        self.quotas.set(&message.tenant, stored);
        let quota = self.quotas.of(&message.tenant);
        tracing::info!(tenant = %message.tenant, by = %caller.name, ?quota, "tenant quota set");
        Ok(Response::new(crate::quota::to_proto(&message.tenant, quota, stored)))
    }

    async fn list_tenant_quotas(
        &self,
        request: Request<pb::ListTenantQuotasRequest>,
    ) -> Result<Response<pb::ListTenantQuotasResponse>, Status> {
        let caller = principal_of(&request);
        let message = request.into_inner();
        let defaults = Some(crate::quota::to_proto("", self.quotas.defaults(), None));
        // Read from the table: a quota set through another instance shows at
        // once, before this instance's next refresh.
        let stored = crate::quota::load(&self.pool).await.map_err(storage_status)?;
        let with_defaults = |tenant: &str, stored: Option<crate::quota::QuotaOverride>| {
            let defaults = self.quotas.defaults();
            let quota = crate::quota::Quota {
                max_waiting: stored.and_then(|stored| stored.max_waiting).or(defaults.max_waiting),
                max_enqueues_per_second: stored
                    .and_then(|stored| stored.max_enqueues_per_second)
                    .or(defaults.max_enqueues_per_second),
            };
            crate::quota::to_proto(tenant, quota, stored)
        };
        if message.tenant.is_empty() {
            if !caller.is_admin() {
                return Err(Status::permission_denied(format!(
                    "{}: listing every tenant's quota needs the admin role; name your tenant",
                    caller.name
                )));
            }
            let mut tenants: Vec<&String> = stored.keys().collect();
            tenants.sort();
            let quotas = tenants
                .into_iter()
                .map(|tenant| with_defaults(tenant, stored.get(tenant).copied()))
                .collect();
            return Ok(Response::new(pb::ListTenantQuotasResponse { quotas, defaults }));
        }
        check_name("tenant", &message.tenant, self.config.admission.max_key_bytes)?;
        caller.authorize(&message.tenant, Action::Read, format_args!("tenant {}", message.tenant))?;
        let quota = with_defaults(&message.tenant, stored.get(&message.tenant).copied());
        Ok(Response::new(pb::ListTenantQuotasResponse {
            quotas: vec![quota],
            defaults,
        }))
    }

    async fn instances(
        &self,
        _request: Request<pb::InstancesRequest>,
    ) -> Result<Response<pb::InstancesResponse>, Status> {
        let endpoints: Vec<String> = sqlx::query_scalar("SELECT DISTINCT endpoint FROM owners ORDER BY endpoint")
            .fetch_all(&self.pool)
            .await
            .map_err(storage_status)?;
        let instances = endpoints.iter().map(|endpoint| dialable_instance(endpoint)).collect();
        Ok(Response::new(pb::InstancesResponse { endpoints, instances }))
    }
}

/// An endpoint URL of the owner directory as workers dial it: the
/// `host:port` target and whether it speaks TLS, apart.
fn dialable_instance(endpoint: &str) -> pb::Instance {
    let (tls, rest) = match endpoint.split_once("://") {
        Some((scheme, rest)) => (scheme.eq_ignore_ascii_case("https"), rest),
        None => (false, endpoint),
    };
    pb::Instance {
        address: rest.trim_end_matches('/').to_string(),
        tls,
        endpoint: endpoint.to_string(),
    }
}

impl AdmissionApi {
    /// Heartbeats of `worker_id` (checked), each at its job's owner; with
    /// `ended`, the notice that the stream they were pushed on ended.
    pub async fn heartbeat_attempts(
        &self,
        caller: &Principal,
        forwarded: bool,
        worker_id: &str,
        attempts: Vec<(String, u32)>,
        ended: Option<StreamEnd>,
    ) -> Result<Vec<pb::HeartbeatResult>, Status> {
        let scope = caller.job_scope(Action::Work)?;
        self.ask_per_partition(
            forwarded,
            attempts,
            |attempts, reply| Local::Heartbeat {
                worker_id: worker_id.to_string(),
                attempts,
                ended,
                scope: scope.clone(),
                reply,
            },
            |mut owner, jobs| {
                let request = forwarded_request(
                    pb::HeartbeatRequest {
                        worker_id: worker_id.to_string(),
                        jobs,
                        stream_ended: ended.map(|ended| ended.message()),
                    },
                    caller,
                );
                async move { Ok(owner.heartbeat(request).await?.into_inner().results) }
            },
        )
        .await
    }

    /// Completions of `worker_id` (its id checked; each completion is
    /// checked here, named `<field>[i]`), each at its job's owner.
    pub async fn complete_attempts(
        &self,
        caller: &Principal,
        forwarded: bool,
        worker_id: &str,
        field: &str,
        completions: Vec<pb::Completion>,
        caller_trace: &pb::TraceContext,
    ) -> Result<Vec<pb::CompleteResult>, Status> {
        let scope: JobScope = caller.job_scope(Action::Work)?;
        check_batch(field, &completions)?;
        let mut checked = Vec::with_capacity(completions.len());
        for (index, completion) in completions.iter().enumerate() {
            checked.push(checked_completion(field, index, completion)?);
        }
        let count = checked.len();
        let originals = by_partition(completions, |completion| self.partition_of(&completion.job_id));
        let mut groups = by_partition(checked, |(job_id, _, _)| self.partition_of(job_id));
        // The partitions are asked side by side, as in `ask_per_partition`.
        let asks = originals.into_iter().map(|(partition, original)| {
            let group = groups.remove(&partition).unwrap_or_default();
            let (indexes, completions): (Vec<usize>, Vec<(String, u32, AttemptEnd)>) = group.into_iter().unzip();
            let scope = &scope;
            async move {
                let answer = self
                    .ask(
                        partition,
                        forwarded,
                        |reply| Local::Complete {
                            worker_id: worker_id.to_string(),
                            completions: completions.clone(),
                            scope: scope.clone(),
                            caller_trace: caller_trace.clone(),
                            reply,
                        },
                        |mut owner| {
                            let mut request = forwarded_request(
                                pb::CompleteRequest {
                                    worker_id: worker_id.to_string(),
                                    completions: original.iter().map(|(_, completion)| completion.clone()).collect(),
                                },
                                caller,
                            );
                            sluice_common::telemetry::inject_into_metadata(caller_trace, request.metadata_mut());
                            async move { Ok(owner.complete(request).await?.into_inner().results) }
                        },
                    )
                    .await?;
                let (OwnerAnswer::Here(results) | OwnerAnswer::Forwarded(results)) = answer;
                Ok::<_, Status>((indexes, results))
            }
        });
        let answered = futures::future::join_all(asks)
            .await
            .into_iter()
            .collect::<Result<Vec<_>, Status>>()?;
        in_call_order(count, answered)
    }

    /// Wake job partitions of this instance (stream workers have credits).
    pub async fn wake_partitions(&self, partitions: impl IntoIterator<Item = i32>) {
        for partition in partitions {
            // A partition that moved away lets its new owner's jobs go to
            // Kafka or to that instance's sessions: nothing waits here.
            let _ = self.registry.submit(partition, Local::Dispatch).await;
        }
    }
}

fn job_attempts(attempts: &[(String, u32)]) -> Vec<pb::JobAttempt> {
    attempts
        .iter()
        .map(|(job_id, attempt)| pb::JobAttempt {
            job_id: job_id.clone(),
            attempt: *attempt,
        })
        .collect()
}

/// A completion, checked; its fields named by its place in the call.
pub(crate) fn checked_completion(
    field: &str,
    index: usize,
    completion: &pb::Completion,
) -> Result<(String, u32, AttemptEnd), Status> {
    let field = format!("{field}[{index}]");
    check_name(&format!("{field}.job_id"), &completion.job_id, MAX_ID_BYTES)?;
    if completion.attempt == 0 {
        return Err(FieldError::new(format!("{field}.attempt"), "attempts start at 1").into());
    }
    let end = match &completion.outcome {
        Some(pb::completion::Outcome::Success(_)) => AttemptEnd::Succeeded,
        Some(pb::completion::Outcome::Failure(failure)) => {
            check_text(&format!("{field}.failure.error"), &failure.error, MAX_TEXT_BYTES)?;
            AttemptEnd::Failed {
                error: failure.error.clone(),
                non_retryable: failure.non_retryable,
            }
        }
        Some(pb::completion::Outcome::HandBack(hand_back)) => {
            check_text(&format!("{field}.hand_back.reason"), &hand_back.reason, MAX_TEXT_BYTES)?;
            AttemptEnd::HandedBack {
                reason: if hand_back.reason.is_empty() {
                    "handed back".to_string()
                } else {
                    hand_back.reason.clone()
                },
            }
        }
        None => return Err(FieldError::new(format!("{field}.outcome"), "set success, failure or hand_back").into()),
    };
    Ok((completion.job_id.clone(), completion.attempt, end))
}

/// A conflict names the job (and, in a batch, its index).
fn conflict_status(index: Option<usize>, job_id: &str, batch: bool) -> Status {
    match (index, batch) {
        (Some(index), true) => Status::already_exists(format!(
            "jobs[{index}].job_id: job {job_id:?} already exists with a different request; nothing of the batch \
             was saved"
        )),
        _ => Status::already_exists(format!(
            "job_id: job {job_id:?} already exists with a different request"
        )),
    }
}

/// A forwarded batch's conflict names its place in the forwarded call;
/// name it in this call.
/// A refusal of part of a call whose other partitions' jobs were saved
/// already: say which, so the caller retries only the others.
fn saved_before_refusal(status: Status, answered: &[(Vec<usize>, Vec<pb::EnqueueResponse>)]) -> Status {
    let mut saved: Vec<usize> = answered
        .iter()
        .flat_map(|(indexes, _)| indexes.iter().copied())
        .collect();
    if saved.is_empty() {
        return status;
    }
    saved.sort_unstable();
    let named: Vec<String> = saved.iter().map(|index| format!("jobs[{index}]")).collect();
    Status::new(
        status.code(),
        format!(
            "{} ({} of this call were saved before the refusal: send only the others again)",
            status.message(),
            named.join(", ")
        ),
    )
}

fn renumber_conflict(status: Status, indexes: &[usize]) -> Status {
    if status.code() != tonic::Code::AlreadyExists {
        return status;
    }
    let message = status.message();
    let renumbered = message
        .strip_prefix("jobs[")
        .and_then(|rest| rest.split_once(']'))
        .and_then(|(number, rest)| {
            let index: usize = number.parse().ok()?;
            Some(format!("jobs[{}]{rest}", indexes.get(index).copied().unwrap_or(index)))
        });
    match renumbered {
        Some(message) => Status::already_exists(message),
        None => status,
    }
}

fn storage_status(error: sqlx::Error) -> Status {
    if sluice_common::fault::classify_sql(&error).is_transient() {
        tracing::warn!(%error, "database error");
        Status::unavailable("database unavailable; retry")
    } else {
        tracing::error!(%error, "PostgreSQL refused a read");
        Status::internal("reading the job failed; retrying will not help")
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

#[cfg(test)]
mod tests {
    use super::dialable_instance;

    #[test]
    fn instances_are_listed_as_dialable_addresses() {
        let plain = dialable_instance("http://10.0.0.7:7070");
        assert_eq!(plain.address, "10.0.0.7:7070");
        assert!(!plain.tls);
        assert_eq!(plain.endpoint, "http://10.0.0.7:7070");
        let secure = dialable_instance("https://admission-0.admission.ns.svc:7070/");
        assert_eq!(secure.address, "admission-0.admission.ns.svc:7070");
        assert!(secure.tls);
        let bare = dialable_instance("127.0.0.1:1");
        assert_eq!(bare.address, "127.0.0.1:1");
        assert!(!bare.tls);
    }
}
