//! Resuming, at a member's start, the partitions this instance's previous
//! run held when it was killed (`PartitionTaskFactory::orphans`), before the
//! group notices the dead member and reassigns them: each runs as a
//! provisional task fed by a reader of its own (a consumer of no group,
//! assigned that one partition from the first offset not applied), until
//! the group assigns the partition here (the member then starts its usual
//! task) or a member it was assigned to takes it over.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::input::{spawn_partition_task, TaskEnd};
use super::queues::message_cost;
use super::{
    Assignments, InMsg, KafkaPlumbingError, OffsetStore, Orphan, PartitionInput, PartitionMessages,
    PartitionTaskFactory,
};

/// A provisional task's end, as the member hears of it.
pub(super) type ResumedEnd = TaskEnd;

/// What a member keeps of a resumed partition while its task runs.
pub(super) struct Resumed {
    pub(super) stop: CancellationToken,
}

/// How long the reader waits after a consumer error before reading again.
const READ_RETRY: Duration = Duration::from_millis(200);

pub(super) struct ResumeSettings<'a> {
    pub(super) topic: &'a Arc<str>,
    pub(super) probe: &'a Arc<rdkafka::config::ClientConfig>,
    pub(super) buffer_bytes: usize,
    pub(super) channel_capacity: usize,
    pub(super) assignments: &'a Assignments,
    pub(super) stop: CancellationToken,
    pub(super) done: mpsc::UnboundedSender<ResumedEnd>,
}

/// Start `orphan`'s provisional task and its reader. An error: the reader's
/// consumer could not be made (the partition is left to the group).
pub(super) fn start_resumed(
    orphan: Orphan,
    factory: &Arc<dyn PartitionTaskFactory>,
    settings: ResumeSettings<'_>,
) -> Result<Resumed, KafkaPlumbingError> {
    let partition = orphan.partition;
    let topic = settings.topic.clone();
    let consumer = resumed_reader(settings.probe, &topic, orphan, settings.buffer_bytes)?;
    let (sender, receiver) = mpsc::channel(settings.channel_capacity.max(1));
    let budget = Arc::new(tokio::sync::Semaphore::new(settings.buffer_bytes));
    let input = PartitionInput {
        topic: topic.clone(),
        partition,
        messages: PartitionMessages {
            receiver,
            budget: budget.clone(),
            capacity: settings.buffer_bytes,
        },
        stop: settings.stop.clone(),
        offsets: OffsetStore {
            // Offsets are the group's: a provisional owner stores none (its
            // successor skips what the owner row says was applied).
            consumer: std::sync::Weak::new(),
            probe: settings.probe.clone(),
            topic: topic.clone(),
            partition,
            stored: Arc::new(std::sync::atomic::AtomicI64::new(-1)),
        },
        max_batch_bytes: settings.buffer_bytes,
        assignments: settings.assignments.clone(),
        provisional: true,
    };
    tokio::spawn(read_resumed(ResumedReader {
        consumer,
        topic: topic.clone(),
        partition,
        sender,
        budget,
        buffer_bytes: settings.buffer_bytes,
        stop: settings.stop.clone(),
    }));
    spawn_partition_task(factory.start(input), partition, settings.done);
    tracing::info!(
        %topic,
        partition,
        resume_from = ?orphan.resume_from,
        "resuming a partition this instance held before it was killed, ahead of the group's reassignment"
    );
    Ok(Resumed { stop: settings.stop })
}

/// A consumer of no group assigned `orphan`'s partition alone, from its
/// first offset not applied (the log's start when it applied nothing, or
/// when that offset is gone).
fn resumed_reader(
    probe: &rdkafka::config::ClientConfig,
    topic: &str,
    orphan: Orphan,
    buffer_bytes: usize,
) -> Result<StreamConsumer, KafkaPlumbingError> {
    let mut config = probe.clone();
    config
        .set("auto.offset.reset", "earliest")
        .set("enable.partition.eof", "false")
        // librdkafka's prefetch queue, bounded like a member's.
        .set("queued.max.messages.kbytes", (buffer_bytes / 1024).max(1).to_string());
    let consumer: StreamConsumer = config.create()?;
    let mut list = TopicPartitionList::new();
    let offset = orphan.resume_from.map_or(Offset::Beginning, Offset::Offset);
    list.add_partition_offset(topic, orphan.partition, offset)?;
    consumer.assign(&list)?;
    Ok(consumer)
}

struct ResumedReader {
    consumer: StreamConsumer,
    topic: Arc<str>,
    partition: i32,
    sender: mpsc::Sender<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    budget: Arc<tokio::sync::Semaphore>,
    buffer_bytes: usize,
    stop: CancellationToken,
}

/// Hand the partition's messages to the provisional task, in order, bounded
/// like a member's (bytes and count), until it stops or ends.
async fn read_resumed(reader: ResumedReader) {
    loop {
        let received = tokio::select! {
            biased;
            _ = reader.stop.cancelled() => break,
            () = reader.sender.closed() => break,
            received = reader.consumer.recv() => received.map(|message| InMsg::from_borrowed(&message)),
        };
        let message = match received {
            Ok(message) => message,
            Err(KafkaError::PartitionEOF(_)) => continue,
            Err(error) => {
                tracing::warn!(topic = %reader.topic, partition = reader.partition, %error, "reading a resumed partition failed; reading again");
                tokio::select! {
                    _ = reader.stop.cancelled() => break,
                    () = tokio::time::sleep(READ_RETRY) => continue,
                }
            }
        };
        let cost = message_cost(&message, reader.buffer_bytes);
        let permit = tokio::select! {
            _ = reader.stop.cancelled() => break,
            permit = reader.budget.clone().acquire_many_owned(cost) => match permit {
                Ok(permit) => permit,
                Err(_closed) => break,
            },
        };
        if reader.sender.send((message, permit)).await.is_err() {
            break;
        }
    }
    // Closing a consumer waits on the broker: not on the runtime.
    let consumer = reader.consumer;
    let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
}
