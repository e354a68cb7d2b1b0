//! Calls to admission (workers' and the producer's): entered at a random
//! instance, answered by the partition's owner once its batch committed, or
//! UNAVAILABLE.

use rand::Rng;
use sluice_admission::partition::Local;
use sluice_common::partition::job_partition;
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::world::{Event, Svc, World};

/// How long a call waits for a partition that is loading at the instance
/// it reached (`OwnerRegistry`'s `LOADING_WAIT`), then UNAVAILABLE.
pub(crate) const LOADING_WAIT_MS: i64 = 5_000;

/// A worker's call to admission, and where its answer goes.
pub enum CallKind {
    Claim(oneshot::Receiver<Vec<pb::ClaimResult>>),
    Heartbeat(oneshot::Receiver<Vec<pb::HeartbeatResult>>),
    Complete(oneshot::Receiver<Vec<pb::CompleteResult>>),
    Enqueue(
        oneshot::Receiver<
            Result<Vec<sluice_admission::partition::EnqueueOutcome>, sluice_admission::partition::EnqueueError>,
        >,
    ),
}

pub struct PendingCall {
    /// `None`: the producer.
    pub worker: Option<usize>,
    pub token: u64,
    pub kind: CallKind,
}

/// Answers workers get.
#[derive(Debug)]
pub enum Answer {
    Claim(Vec<pb::ClaimResult>),
    Heartbeat(Vec<pb::HeartbeatResult>),
    Complete,
    Enqueued,
    Unavailable,
}

impl World {
    /// A call for the owner of `job_id`'s partition, entering at a random
    /// admission instance: answered by the task there or at the owner the
    /// directory names, else UNAVAILABLE. Returns the call's token.
    pub fn call(&mut self, worker: Option<usize>, job_id: &str, make: impl FnOnce() -> (Local, CallKind)) -> u64 {
        self.next_token += 1;
        let token = self.next_token;
        let partition = usize::try_from(job_partition(
            job_id,
            i32::try_from(self.config.job_partitions).unwrap_or(1),
        ))
        .unwrap_or(0);
        let up: Vec<usize> = (0..self.config.instances)
            .filter(|instance| self.adm.up[*instance])
            .collect();
        let (local, kind) = make();
        if up.is_empty() {
            drop(local);
        } else {
            let entry = up[self.rng.random_range(0..up.len())];
            let target = if self.adm.owns(entry, partition) {
                Some(entry)
            } else {
                self.adm.stores[partition]
                    .owner
                    .filter(|owner| *owner != entry && self.adm.owns(*owner, partition))
            };
            match target {
                Some(instance) => self.deliver(instance, partition, local),
                None => drop(local),
            }
        }
        self.calls.push(PendingCall { worker, token, kind });
        self.resolve_calls();
        token
    }

    /// A call reaches the task of `instance` for `partition`: queued for
    /// its next batch when it serves; while it takes the partition over,
    /// the call waits for it, `LOADING_WAIT_MS` at most.
    fn deliver(&mut self, instance: usize, partition: usize, local: Local) {
        if let Some(task) = self.adm.serving(instance, partition) {
            task.locals.push(local);
            let delay = self.net_delay();
            self.schedule_run(Svc::Admission, instance, partition, delay);
        } else if let Some(task) = self.adm.loading(instance, partition) {
            task.waiting.push((self.now + LOADING_WAIT_MS, local));
            self.at(
                LOADING_WAIT_MS,
                Event::LoadingWaitOver {
                    svc: Svc::Admission,
                    instance,
                    partition,
                },
            );
        }
    }

    /// Answers that came out of committed batches (or channels that
    /// closed: UNAVAILABLE) go back to their callers.
    pub(crate) fn resolve_calls(&mut self) {
        let calls = std::mem::take(&mut self.calls);
        for mut call in calls {
            let answer = match &mut call.kind {
                CallKind::Claim(receiver) => match receiver.try_recv() {
                    Ok(results) => Some(Answer::Claim(results)),
                    Err(oneshot::error::TryRecvError::Closed) => Some(Answer::Unavailable),
                    Err(oneshot::error::TryRecvError::Empty) => None,
                },
                CallKind::Heartbeat(receiver) => match receiver.try_recv() {
                    Ok(results) => Some(Answer::Heartbeat(results)),
                    Err(oneshot::error::TryRecvError::Closed) => Some(Answer::Unavailable),
                    Err(oneshot::error::TryRecvError::Empty) => None,
                },
                CallKind::Complete(receiver) => match receiver.try_recv() {
                    Ok(_) => Some(Answer::Complete),
                    Err(oneshot::error::TryRecvError::Closed) => Some(Answer::Unavailable),
                    Err(oneshot::error::TryRecvError::Empty) => None,
                },
                CallKind::Enqueue(receiver) => match receiver.try_recv() {
                    Ok(Ok(_)) => Some(Answer::Enqueued),
                    Ok(Err(_)) | Err(oneshot::error::TryRecvError::Closed) => Some(Answer::Unavailable),
                    Err(oneshot::error::TryRecvError::Empty) => None,
                },
            };
            match answer {
                Some(answer) => {
                    let delay = self.net_delay();
                    self.at(
                        delay,
                        Event::Answer {
                            worker: call.worker,
                            token: call.token,
                            answer,
                        },
                    );
                }
                None => self.calls.push(call),
            }
        }
    }
}
