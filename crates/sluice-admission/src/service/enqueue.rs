//! Enqueueing: a job request validated into an `Incoming` job, a call's jobs
//! enqueued at their owners partition by partition, and the statuses of a
//! conflict or of a refusal after part of the call was saved.

use std::collections::BTreeMap;

use sluice_common::auth::{Action, Principal};
use sluice_common::forward::forwarded_request;
use sluice_proto::v1 as pb;
use tonic::Status;

use super::owner::{by_partition, in_call_order, OwnerAnswer};
use super::{storage_status, AdmissionApi};
use crate::chain;
use crate::jobs::request_fingerprint;
use crate::partition::{EnqueueConflict, EnqueueError, Incoming, Local, OnConflict};

impl AdmissionApi {
    pub(super) fn incoming(
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
    pub(super) async fn enqueue_all(
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
    pub(super) async fn check_saved_conflicts(
        &self,
        groups: &BTreeMap<i32, Vec<(usize, Incoming)>>,
    ) -> Result<(), Status> {
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

/// A forwarded batch's conflict names its place in the forwarded call;
/// name it in this call.
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
