//! Reaching a job's owner: a call's items grouped by job partition, each
//! group asked of its partition's owner (this instance's partition task, or
//! a forward), waiting out a partition with no owner, and the answers put
//! back in the call's order.

use std::collections::BTreeMap;
use std::time::Duration;

use sluice_common::auth::Channel;
use sluice_common::forward::{owner_route, OwnerRoute};
use sluice_common::partition::job_partition;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;
use tokio::sync::oneshot;
use tonic::Status;

use super::AdmissionApi;
use crate::partition::Local;

/// Who answered a call: this instance's partition task, or the owner it
/// was forwarded to.
pub(super) enum OwnerAnswer<R, F> {
    Here(R),
    Forwarded(F),
}

/// How long a call waits for its job's partition to get an owner (a
/// rebalance, or this instance still loading it) before it answers
/// `UNAVAILABLE` (NOT_OWNER).
const OWNER_WAIT: Duration = Duration::from_secs(5);
/// How often a waiting call looks at the owner directory again.
const OWNER_RECHECK: Duration = Duration::from_millis(100);
/// A call to a job partition's owner that takes this long is logged.
const SLOW_OWNER_CALL: Duration = Duration::from_secs(1);

/// How a call's tries to reach its partition's owner went (`ask`'s log).
#[derive(Default)]
struct OwnerTries {
    count: u32,
    last_failure: String,
    last_took: Duration,
}

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
pub(super) fn by_partition<T>(items: Vec<T>, partition_of: impl Fn(&T) -> i32) -> BTreeMap<i32, Vec<(usize, T)>> {
    let mut groups: BTreeMap<i32, Vec<(usize, T)>> = BTreeMap::new();
    for (index, item) in items.into_iter().enumerate() {
        groups.entry(partition_of(&item)).or_default().push((index, item));
    }
    groups
}

/// Run the groups' asks side by side (one whose owner is away holds up
/// none of the others); their answers in the call's order, or the first
/// error.
pub(crate) async fn side_by_side<R>(
    count: usize,
    asks: impl IntoIterator<Item = impl std::future::Future<Output = Result<(Vec<usize>, Vec<R>), Status>>>,
) -> Result<Vec<R>, Status> {
    let answered = futures::future::join_all(asks)
        .await
        .into_iter()
        .collect::<Result<Vec<_>, Status>>()?;
    in_call_order(count, answered)
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
    pub(super) fn partition_of(&self, job_id: &str) -> i32 {
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
    ///
    /// A call that took `SLOW_OWNER_CALL` or longer is logged at info: how
    /// long, how often the owner was tried, and what the last failed try
    /// answered (a worker's completion held that long may reach its owner
    /// after the attempt's lease ran out).
    #[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
    pub(super) async fn ask<R, F, Fut>(
        &self,
        partition: i32,
        forwarded: bool,
        make: impl Fn(oneshot::Sender<R>) -> Local,
        forward: impl Fn(AdmissionClient<Channel>) -> Fut,
    ) -> Result<OwnerAnswer<R, F>, Status>
    where
        Fut: std::future::Future<Output = Result<F, Status>>,
    {
        let started = tokio::time::Instant::now();
        let mut tries = OwnerTries::default();
        let answer = self
            .ask_until_answered(partition, forwarded, make, forward, &mut tries)
            .await;
        let waited = started.elapsed();
        if waited >= SLOW_OWNER_CALL {
            let answered = match &answer {
                Ok(OwnerAnswer::Here(_)) => "answered by this instance's partition task".to_string(),
                Ok(OwnerAnswer::Forwarded(_)) => "answered by the owner it was forwarded to".to_string(),
                Err(status) => format!("not answered: {}", status.message()),
            };
            tracing::info!(
                partition,
                forwarded,
                waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                tries = tries.count,
                last_failed_try = %tries.last_failure,
                last_try_ms = u64::try_from(tries.last_took.as_millis()).unwrap_or(u64::MAX),
                %answered,
                "a call waited for its job partition's owner"
            );
        }
        answer
    }

    #[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
    async fn ask_until_answered<R, F, Fut>(
        &self,
        partition: i32,
        forwarded: bool,
        make: impl Fn(oneshot::Sender<R>) -> Local,
        forward: impl Fn(AdmissionClient<Channel>) -> Fut,
        tries: &mut OwnerTries,
    ) -> Result<OwnerAnswer<R, F>, Status>
    where
        Fut: std::future::Future<Output = Result<F, Status>>,
    {
        let deadline = tokio::time::Instant::now() + OWNER_WAIT;
        loop {
            let started_here = self.registry.partition_started();
            let try_started = tokio::time::Instant::now();
            tries.count += 1;
            let unavailable = if self.registry.owns(partition) {
                let reply = self.registry.call(partition, &make).await;
                tries.last_took = try_started.elapsed();
                match reply {
                    Ok(reply) => return Ok(OwnerAnswer::Here(reply)),
                    // The task stopped (the partition is being handed over)
                    // before it answered: ask the next owner.
                    Err(error) => {
                        tries.last_failure = format!("this instance's partition task: {error}");
                        Status::unavailable(error.to_string())
                    }
                }
            } else {
                match owner_route(&self.pool, partition, forwarded, &self.own_endpoint).await {
                    OwnerRoute::Forward(endpoint) => {
                        let answer = forward(AdmissionClient::new(self.channels.channel(&endpoint)?)).await;
                        tries.last_took = try_started.elapsed();
                        match answer {
                            Ok(answer) => return Ok(OwnerAnswer::Forwarded(answer)),
                            Err(status) if owner_unreachable(&status) => {
                                tracing::debug!(partition, %endpoint, error = %status.message(), "owner unavailable; waiting for the directory to change");
                                tries.last_failure = format!("{endpoint}: {}", status.message());
                                status
                            }
                            Err(status) => return Err(status),
                        }
                    }
                    // A forwarded call whose partition another instance
                    // serves goes back at once: the instance that forwarded
                    // it asks that one. Waiting here held both calls for
                    // `OWNER_WAIT` while the partition was served elsewhere
                    // (the forwarder read the directory just before it
                    // changed), and a worker's completion held that long
                    // reached its owner after the attempt's lease ran out:
                    // the job ran again (make chaos, issue 29).
                    OwnerRoute::OwnedElsewhere(status) => return Err(status),
                    OwnerRoute::NotYet(status) => {
                        tries.last_took = try_started.elapsed();
                        tries.last_failure = format!("the owner directory: {}", status.message());
                        status
                    }
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
    pub(super) async fn ask_per_partition<R, Fut>(
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
        side_by_side(count, asks).await
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
