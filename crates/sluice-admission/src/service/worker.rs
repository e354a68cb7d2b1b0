//! A worker's calls about its attempts: heartbeats and completions (each
//! completion checked), asked of each job's owner, and waking partitions
//! whose `Work` streams have credits.

use sluice_common::auth::{Action, JobScope, Principal};
use sluice_common::forward::forwarded_request;
use sluice_common::validate::{check_name, check_text, FieldError, MAX_ID_BYTES, MAX_TEXT_BYTES};
use sluice_proto::v1 as pb;
use tonic::Status;

use super::owner::{by_partition, side_by_side, OwnerAnswer};
use super::{check_batch, AdmissionApi};
use crate::partition::Local;
use crate::transitions::{AttemptEnd, StreamEnd};

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
        side_by_side(count, asks).await
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
