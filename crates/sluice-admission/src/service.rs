//! The `Admission` gRPC service: thin adapters. Validate, reach the job's
//! owner (this instance's partition task, or one forward to the owner the
//! directory names), map errors. Calls naming jobs of several partitions
//! are split by partition and their answers merged in the caller's order.

use std::sync::Arc;

use sluice_common::auth::{principal_of, Action, Channel};
use sluice_common::forward::{forwarded_request, is_forwarded, ChannelCache};
use sluice_common::owner::OwnerRegistry;
use sluice_common::validate::{check_name, check_text, FieldError, MAX_ID_BYTES, MAX_TEXT_BYTES};
use sluice_proto::v1 as pb;
use sluice_proto::v1::limits_client::LimitsClient;
use sluice_proto::v1::rate_limits_client::RateLimitsClient;
use sqlx::PgPool;
use tonic::{Request, Response, Status};

use crate::partition::Local;
use crate::transitions::StreamEnd;

mod enqueue;
mod owner;
mod view;
mod worker;

pub(crate) use owner::side_by_side;
pub(crate) use worker::checked_completion;

use owner::OwnerAnswer;

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

fn storage_status(error: sqlx::Error) -> Status {
    if sluice_common::fault::classify_sql(&error).is_transient() {
        tracing::warn!(%error, "database error");
        Status::unavailable("database unavailable; retry")
    } else {
        tracing::error!(%error, "PostgreSQL refused a read");
        Status::internal("reading the job failed; retrying will not help")
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
