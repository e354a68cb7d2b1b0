//! How a partition's messages reach a task that is behind: each
//! partition's own queue in the consumer and its reader, and, for a
//! partition without one, parking (a forwarder, the partition paused).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::stream_consumer::StreamPartitionQueue;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::TopicPartitionList;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{ConsumerProgress, InMsg, RebalanceContext};

/// A parked partition, as the dispatch loop sees it (`park`).
pub(super) struct Parked {
    pub(super) session: u64,
    /// Messages for the forwarder, in order.
    pub(super) overflow: mpsc::UnboundedSender<InMsg>,
    /// How many it was given (the forwarder reports how many it handed on).
    pub(super) pushed: u64,
}

/// What a parked partition's forwarder needs.
pub(super) struct ParkedTask {
    pub(super) partition: i32,
    pub(super) session: u64,
    pub(super) sender: mpsc::Sender<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    pub(super) budget: Arc<tokio::sync::Semaphore>,
    pub(super) stop: CancellationToken,
    pub(super) buffer_bytes: usize,
    pub(super) caught_up: mpsc::UnboundedSender<(i32, u64, u64)>,
}

/// A partition's own queue in a member's consumer, read by one task at a
/// time (the reader of the partition's current task).
pub(super) type SplitQueue = tokio::sync::Mutex<StreamPartitionQueue<RebalanceContext>>;

/// Give every partition of `topic` a queue of its own in `consumer`, before
/// it subscribes: a partition's fetched messages then wait there, not in
/// the consumer's shared queue, and its task's reader takes them at the
/// task's pace. librdkafka stops fetching a partition whose own queue holds
/// `queued.max.messages.kbytes`, and goes on from where its last fetch
/// ended, so a task that is behind holds up neither the other partitions
/// nor its own position.
///
/// Why not pause the partition instead (what `park` does for a partition
/// without a queue of its own): a pause drops what librdkafka prefetched,
/// and the resume fetches again from the next offset to hand over, most
/// often inside a producer's batch. tansu answers a fetch inside a batch
/// from the next batch on, so the rest of that batch was never read (its
/// offsets were stored past it), or, inside the partition's last batch,
/// answers nothing until more is produced: a burst of 100,000 requests
/// stopped at about 60,000, and nothing was logged.
///
/// A partition the metadata does not list (the topic grew since) has no
/// queue of its own and goes through the shared queue (`dispatch`).
pub(super) async fn split_partition_queues(
    consumer: &Arc<StreamConsumer<RebalanceContext>>,
    topic: &Arc<str>,
) -> HashMap<i32, Arc<SplitQueue>> {
    let probe = consumer.clone();
    let name = topic.to_string();
    let partitions = tokio::task::spawn_blocking(move || {
        probe
            .fetch_metadata(Some(&name), Duration::from_secs(10))
            .map(|metadata| {
                metadata
                    .topics()
                    .iter()
                    .filter(|found| found.name() == name)
                    .flat_map(|found| found.partitions().iter().map(|partition| partition.id()))
                    .collect::<Vec<i32>>()
            })
    })
    .await;
    let partitions = match partitions {
        Ok(Ok(partitions)) => partitions,
        Ok(Err(error)) => {
            tracing::warn!(topic = %topic, %error, "reading the topic's partitions failed; its partitions share the consumer's queue (paused when their task is behind)");
            Vec::new()
        }
        Err(error) => {
            tracing::warn!(topic = %topic, %error, "reading the topic's partitions failed; its partitions share the consumer's queue (paused when their task is behind)");
            Vec::new()
        }
    };
    partitions
        .into_iter()
        .filter_map(|partition| {
            consumer
                .split_partition_queue(topic, partition)
                .map(|queue| (partition, Arc::new(tokio::sync::Mutex::new(queue))))
        })
        .collect()
}

/// What the reader of one partition task's queue needs.
pub(super) struct SplitReader {
    pub(super) topic: Arc<str>,
    pub(super) partition: i32,
    pub(super) queue: Arc<SplitQueue>,
    pub(super) sender: mpsc::Sender<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    pub(super) budget: Arc<tokio::sync::Semaphore>,
    pub(super) buffer_bytes: usize,
    pub(super) channel_capacity: usize,
    pub(super) stop: CancellationToken,
    pub(super) first_offset: Arc<std::sync::atomic::AtomicI64>,
    /// Set when partition ends are reported (`ConsumerOptions::track_end`).
    pub(super) progress: Option<Arc<ConsumerProgress>>,
    pub(super) topic_attribute: [opentelemetry::KeyValue; 1],
}

/// Hand the messages of a partition's own queue to its task, in order,
/// each once the task has room (its byte budget and channel): while it has
/// none, nothing more is taken from the queue, and librdkafka stops
/// fetching the partition once the queue is full. The first time the task
/// is behind, a warning says so with the figures; every time, the counter
/// `sluice_kafka_partition_behind` goes up.
pub(super) async fn read_split_queue(reader: SplitReader) {
    // The reader of an earlier task of the partition lets go when stopped.
    let queue = tokio::select! {
        biased;
        _ = reader.stop.cancelled() => return,
        queue = reader.queue.lock() => queue,
    };
    let mut warned = false;
    loop {
        let received = tokio::select! {
            biased;
            _ = reader.stop.cancelled() => return,
            // The task ended (its successor's reader waits for the queue).
            () = reader.sender.closed() => return,
            received = queue.recv() => received,
        };
        let message = match received {
            Ok(message) => InMsg::from_borrowed(&message),
            Err(KafkaError::PartitionEOF(_)) => {
                if let Some(progress) = &reader.progress {
                    mark_at_end(progress, reader.partition);
                }
                continue;
            }
            Err(error) => {
                tracing::warn!(topic = %reader.topic, partition = reader.partition, %error, "consumer error");
                continue;
            }
        };
        if let Some(progress) = &reader.progress {
            progress.update(reader.partition, |state| state.at_end = false);
        }
        crate::metrics::metrics().consumed.add(1, &reader.topic_attribute);
        note_first_offset(&reader.first_offset, &reader.topic, reader.partition, message.offset);
        let cost = message_cost(&message, reader.buffer_bytes);
        let permit = match reader.budget.clone().try_acquire_many_owned(cost) {
            Ok(permit) => Some(permit),
            Err(tokio::sync::TryAcquireError::Closed) => return,
            Err(tokio::sync::TryAcquireError::NoPermits) => None,
        };
        let behind = permit.is_none() || reader.sender.capacity() == 0;
        if behind {
            crate::metrics::metrics()
                .partition_behind
                .add(1, &reader.topic_attribute);
            if !warned {
                warned = true;
                reader.warn_behind(message.offset);
            }
        }
        let permit = match permit {
            Some(permit) => permit,
            None => match reader.wait_for_room(cost).await {
                Some(permit) => permit,
                None => return,
            },
        };
        let sent = tokio::select! {
            biased;
            _ = reader.stop.cancelled() => return,
            sent = reader.sender.send((message, permit)) => sent,
        };
        if sent.is_err() {
            return;
        }
    }
}

impl SplitReader {
    fn warn_behind(&self, offset: i64) {
        tracing::warn!(
            topic = %self.topic,
            partition = self.partition,
            offset,
            waiting_messages = self.channel_capacity.saturating_sub(self.sender.capacity()),
            channel_capacity = self.channel_capacity,
            waiting_bytes = self.buffer_bytes.saturating_sub(self.budget.available_permits()),
            buffer_bytes = self.buffer_bytes,
            "the partition's task is behind: its buffer is full (kafka.consumer_buffer_bytes, or the \
             channel), so the partition is fetched as the task catches up (said once per task; counted \
             in sluice_kafka_partition_behind)"
        );
    }

    /// Waits until the task's byte budget has room for `cost`; `None` when
    /// stopped or the budget is closed.
    async fn wait_for_room(&self, cost: u32) -> Option<tokio::sync::OwnedSemaphorePermit> {
        tokio::select! {
            biased;
            _ = self.stop.cancelled() => None,
            permit = self.budget.clone().acquire_many_owned(cost) => permit.ok(),
        }
    }
}

/// The partition's end was reached (`ConsumerOptions::track_end`).
pub(super) fn mark_at_end(progress: &ConsumerProgress, partition: i32) {
    progress.update(partition, |state| {
        state.at_end = true;
        state.reached_end_at = Some(std::time::Instant::now());
    });
}

/// The first message handed to a partition's task says where the partition
/// resumed (`first_offset` is -1 until then).
pub(super) fn note_first_offset(first_offset: &std::sync::atomic::AtomicI64, topic: &str, partition: i32, offset: i64) {
    if first_offset
        .compare_exchange(
            -1,
            offset,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        )
        .is_ok()
    {
        tracing::info!(topic = %topic, partition, offset, "partition resumed");
    }
}

/// A message's share of its partition's byte budget.
pub(super) fn message_cost(message: &InMsg, buffer_bytes: usize) -> u32 {
    u32::try_from(message.size().clamp(1, buffer_bytes)).unwrap_or(u32::MAX)
}

/// Park a partition whose task is behind: a forwarder of its own hands
/// `first`, then whatever the dispatch loop queues after it, to the task in
/// order as room frees (waiting on the budget and the channel, which the
/// dispatch loop never does), and reports each time it has handed over
/// everything it was given. The caller pauses the partition in the
/// consumer, so what queues here is at most what was already fetched.
pub(super) fn park(task: ParkedTask, first: InMsg) -> Parked {
    let (overflow, mut queued) = mpsc::unbounded_channel::<InMsg>();
    let _ = overflow.send(first);
    let session = task.session;
    tokio::spawn(async move {
        let mut forwarded = 0u64;
        loop {
            let message = tokio::select! {
                _ = task.stop.cancelled() => return,
                message = queued.recv() => match message {
                    Some(message) => message,
                    None => return,
                },
            };
            let cost = message_cost(&message, task.buffer_bytes);
            let permit = tokio::select! {
                _ = task.stop.cancelled() => return,
                permit = task.budget.clone().acquire_many_owned(cost) => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            };
            let sent = tokio::select! {
                _ = task.stop.cancelled() => return,
                sent = task.sender.send((message, permit)) => sent,
            };
            if sent.is_err() {
                return;
            }
            forwarded += 1;
            if queued.is_empty() && task.caught_up.send((task.partition, task.session, forwarded)).is_err() {
                return;
            }
        }
    });
    Parked {
        session,
        overflow,
        pushed: 1,
    }
}

/// Pause (or resume) fetching `partition`; local to the client, it does
/// not wait for the broker.
pub(super) fn pause_or_resume(consumer: &StreamConsumer<RebalanceContext>, topic: &str, partition: i32, pause: bool) {
    let mut partitions = TopicPartitionList::new();
    partitions.add_partition(topic, partition);
    let done = if pause {
        consumer.pause(&partitions)
    } else {
        consumer.resume(&partitions)
    };
    if let Err(error) = done {
        tracing::debug!(%topic, partition, pause, %error, "could not pause or resume the partition");
    }
}
