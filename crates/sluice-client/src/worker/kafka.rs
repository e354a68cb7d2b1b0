//! Kafka plumbing of the worker: a consumer that records its assignment as
//! the group changes it, received messages detached from the consumer, and
//! the partition counts of the admitted topics (to forward a job to a
//! partition another worker owns).

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Headers, Message as _};
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use crate::worker::offsets::PartitionId;

/// Keeps the set of owned partitions up to date from librdkafka's rebalance
/// callbacks (which run inside `recv`, before any message of a new
/// assignment is returned).
pub(crate) struct AssignmentContext {
    pub assigned: Arc<Mutex<BTreeSet<(String, i32)>>>,
}

impl ClientContext for AssignmentContext {
    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(%error, reason, "kafka client error");
    }
}

impl ConsumerContext for AssignmentContext {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let mut assigned = self.assigned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            for element in list.elements() {
                assigned.remove(&(element.topic().to_string(), element.partition()));
            }
            tracing::info!(revoked = list.count(), "worker partitions revoked");
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let mut assigned = self.assigned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            for element in list.elements() {
                assigned.insert((element.topic().to_string(), element.partition()));
            }
            tracing::info!(assigned = list.count(), "worker partitions assigned");
        }
    }
}

pub(crate) type WorkerConsumer = StreamConsumer<AssignmentContext>;

/// A received message, detached from the consumer.
#[derive(Clone, Debug)]
pub(crate) struct Received {
    pub partition: PartitionId,
    pub offset: i64,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Received {
    pub fn from_message(message: &BorrowedMessage<'_>, topic: Arc<str>) -> Self {
        let headers = message
            .headers()
            .map(|headers| {
                headers
                    .iter()
                    .map(|header| (header.key.to_string(), header.value.unwrap_or_default().to_vec()))
                    .collect()
            })
            .unwrap_or_default();
        Received {
            partition: (topic, message.partition()),
            offset: message.offset(),
            key: message.key().map(<[u8]>::to_vec),
            payload: message.payload().unwrap_or_default().to_vec(),
            headers,
        }
    }

    pub fn header_text(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .and_then(|(_, value)| std::str::from_utf8(value).ok())
    }
}

/// Store "done below `next_offset`" for auto-commit. Refused after a revoke;
/// the new owner then re-reads from the last commit (claims dedup).
pub(crate) fn store_position<C: ConsumerContext>(
    consumer: &StreamConsumer<C>,
    partition: &PartitionId,
    next_offset: i64,
) {
    let mut list = TopicPartitionList::new();
    if list
        .add_partition_offset(&partition.0, partition.1, Offset::Offset(next_offset))
        .is_err()
    {
        return;
    }
    if let Err(error) = consumer.store_offsets(&list) {
        tracing::debug!(topic = %partition.0, partition = partition.1, %error, "offset store refused");
    }
}

/// Partition counts of the topics a worker consumes, refreshed in the
/// background (metadata calls block, so they run on the blocking pool).
#[derive(Clone, Debug, Default)]
pub(crate) struct PartitionCounts {
    counts: Arc<Mutex<HashMap<String, i32>>>,
}

impl PartitionCounts {
    pub fn get(&self, topic: &str) -> Option<i32> {
        self.counts
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(topic)
            .copied()
    }

    /// Refresh every `period` until `stop`.
    pub async fn keep_fresh<C: ConsumerContext + 'static>(
        &self,
        consumer: Arc<StreamConsumer<C>>,
        topics: Vec<String>,
        period: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) {
        loop {
            for topic in &topics {
                let consumer = consumer.clone();
                let name = topic.clone();
                let fetched = tokio::task::spawn_blocking(move || {
                    consumer
                        .fetch_metadata(Some(&name), Duration::from_secs(5))
                        .map(|metadata| {
                            metadata
                                .topics()
                                .iter()
                                .find(|entry| entry.name() == name)
                                .map(|entry| entry.partitions().len())
                        })
                })
                .await;
                match fetched {
                    Ok(Ok(Some(count))) if count > 0 => {
                        self.counts
                            .lock()
                            .unwrap_or_else(|poisoned| poisoned.into_inner())
                            .insert(topic.clone(), i32::try_from(count).unwrap_or(i32::MAX));
                    }
                    Ok(Ok(_)) => tracing::debug!(topic, "topic has no partitions yet"),
                    Ok(Err(error)) => tracing::debug!(topic, %error, "metadata fetch failed"),
                    Err(join_error) => tracing::debug!(topic, %join_error, "metadata task failed"),
                }
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(period) => {}
            }
        }
    }
}
