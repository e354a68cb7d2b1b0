//! What a partition task is given: its consumed messages (`InMsg`, bounded
//! by bytes), the way to store its offsets, and the factory that starts it.

use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use rdkafka::message::{BorrowedMessage, Headers, Message};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{Assignments, OffsetStore};

/// A consumed message, detached from the consumer.
#[derive(Clone, Debug)]
pub struct InMsg {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    pub timestamp_ms: Option<i64>,
}

impl InMsg {
    /// Bytes the message holds (payload, key, headers).
    pub fn size(&self) -> usize {
        self.payload.as_ref().map_or(0, Vec::len)
            + self.key.as_ref().map_or(0, Vec::len)
            + self
                .headers
                .iter()
                .map(|(name, value)| name.len() + value.len())
                .sum::<usize>()
    }

    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_slice())
    }

    pub(super) fn from_borrowed(message: &BorrowedMessage<'_>) -> Self {
        let headers = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|header| (header.key.to_string(), header.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default();
        InMsg {
            partition: message.partition(),
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().map(<[u8]>::to_vec),
            headers,
            timestamp_ms: message.timestamp().to_millis(),
        }
    }
}

/// The messages of one assigned partition, in offset order. Bounded by bytes
/// (`kafka.consumer_buffer_bytes`): the consumer waits to hand over more
/// until the task has taken enough out.
pub struct PartitionMessages {
    pub(super) receiver: mpsc::Receiver<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    pub(super) budget: Arc<tokio::sync::Semaphore>,
    pub(super) capacity: usize,
}

impl PartitionMessages {
    /// Bytes handed over and not yet taken out.
    pub fn buffered_bytes(&self) -> usize {
        self.capacity.saturating_sub(self.budget.available_permits())
    }

    /// Messages handed over and not yet taken out.
    pub fn len(&self) -> usize {
        self.receiver.len()
    }

    pub fn is_empty(&self) -> bool {
        self.receiver.is_empty()
    }

    /// The next message; `None` once the consumer let go of the partition.
    pub async fn recv(&mut self) -> Option<InMsg> {
        self.receiver.recv().await.map(|(message, _bytes)| message)
    }

    /// A message if one is waiting.
    pub fn try_recv(&mut self) -> Option<InMsg> {
        self.receiver.try_recv().ok().map(|(message, _bytes)| message)
    }
}

/// Wait for one message, then take what is waiting, up to `max_count`
/// messages and the input's `max_batch_bytes` (at least one message). `None`
/// when `stop` is cancelled or the partition is gone.
pub async fn next_batch(input: &mut PartitionInput, max_count: usize) -> Option<Vec<InMsg>> {
    let max_bytes = input.max_batch_bytes;
    let first = tokio::select! {
        biased;
        _ = input.stop.cancelled() => return None,
        received = input.messages.recv() => received?,
    };
    let mut bytes = first.size();
    let mut batch = Vec::with_capacity(max_count.min(1024));
    batch.push(first);
    while batch.len() < max_count && bytes < max_bytes {
        match input.messages.try_recv() {
            Some(message) => {
                bytes += message.size();
                batch.push(message);
            }
            None => break,
        }
    }
    Some(batch)
}

/// What a partition task gets.
pub struct PartitionInput {
    pub topic: Arc<str>,
    pub partition: i32,
    pub messages: PartitionMessages,
    /// Cancelled when the partition is revoked or the service stops.
    pub stop: CancellationToken,
    pub offsets: OffsetStore,
    /// The most payload bytes a batch should hold (`kafka.consumer_buffer_bytes`).
    pub max_batch_bytes: usize,
    /// The group's assignments of partitions to this member.
    pub assignments: Assignments,
    /// Resumed by this instance before the group assigned it anywhere
    /// (`PartitionTaskFactory::orphans`): the task takes it over without
    /// waiting for a handover, holds it provisionally (the member the group
    /// assigns it to takes it at once), and ends, rather than stand by,
    /// when a newer owner fences it.
    pub provisional: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum PartitionTaskError {
    /// Stop the whole service instance, as a killed process would (fault hooks).
    #[error("crash injected")]
    Crashed,
    /// This partition's task cannot go on; the consumer restarts it from its
    /// last stored offset after a backoff, and readiness says so meanwhile.
    #[error("partition {partition} stopped: {reason}")]
    Stopped { partition: i32, reason: String },
}

/// A partition task's end: its partition and outcome.
pub(super) type TaskEnd = (i32, Result<(), PartitionTaskError>);

/// Run a partition task, reporting its end (a panic as a failure) to `done`.
pub(super) fn spawn_partition_task(
    task: BoxFuture<'static, Result<(), PartitionTaskError>>,
    partition: i32,
    done: mpsc::UnboundedSender<TaskEnd>,
) {
    tokio::spawn(async move {
        let outcome = match std::panic::AssertUnwindSafe(task).catch_unwind().await {
            Ok(outcome) => outcome,
            Err(panic) => Err(PartitionTaskError::Stopped {
                partition,
                reason: format!("panicked: {}", crate::fault::panic_message(panic.as_ref())),
            }),
        };
        let _ = done.send((partition, outcome));
    });
}

/// A partition this instance's previous run owned when it died, and where
/// to read its input from (`PartitionTaskFactory::orphans`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Orphan {
    pub partition: i32,
    /// The first offset not applied yet; `None`: nothing was applied.
    pub resume_from: Option<i64>,
}

/// Starts the task that processes one assigned partition.
pub trait PartitionTaskFactory: Send + Sync + 'static {
    fn start(&self, input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>>;

    /// The partitions this instance's previous run held when it stopped
    /// without giving them up (killed): the member resumes them at once
    /// (`PartitionInput::provisional`) instead of leaving them unserved
    /// until the group notices the dead member (its session timeout) and
    /// reassigns them. None by default.
    fn orphans(&self) -> BoxFuture<'static, Vec<Orphan>> {
        futures::future::ready(Vec::new()).boxed()
    }
}
