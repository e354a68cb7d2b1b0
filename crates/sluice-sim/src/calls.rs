//! Calls to admission (workers' and the producer's): entered at a random
//! instance, answered by the partition's owner once its batch committed, or
//! UNAVAILABLE.

use rand::Rng;
use sluice_admission::partition::Local;
use sluice_common::partition::job_partition;
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::world::{Event, Svc, World};

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
            let target = if self.adm.serving(entry, partition).is_some() {
                Some(entry)
            } else {
                self.adm.stores[partition]
                    .owner
                    .filter(|owner| *owner != entry && self.adm.serving(*owner, partition).is_some())
            };
            match target {
                Some(instance) => {
                    if let Some(task) = self.adm.serving(instance, partition) {
                        task.locals.push(local);
                    }
                    let delay = self.net_delay();
                    self.schedule_run(Svc::Admission, instance, partition, delay);
                }
                None => drop(local),
            }
        }
        self.calls.push(PendingCall { worker, token, kind });
        self.resolve_calls();
        token
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
