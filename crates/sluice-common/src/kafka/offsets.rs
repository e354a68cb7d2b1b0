//! Offsets: storing what a partition task has processed (`OffsetStore`),
//! and probing whether a partition's log still holds an offset.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, ConsumerContext, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{ClientContext, Offset, TopicPartitionList};

use super::{client_config, RebalanceContext};
use crate::config::KafkaConfig;

/// Stores "processed up to here" for one partition; auto-commit sends it.
///
/// Holds the consumer weakly: when the consumer loop ends, the consumer is
/// closed (it leaves the group at once) even if a partition task lingers.
#[derive(Clone)]
pub struct OffsetStore {
    pub(super) consumer: std::sync::Weak<StreamConsumer<RebalanceContext>>,
    /// A client configuration without a group, for reading one offset of
    /// the partition (`holds_offset`).
    pub(super) probe: Arc<ClientConfig>,
    pub(super) topic: Arc<str>,
    pub(super) partition: i32,
    /// The last offset stored (next to read), -1 before the first store: where
    /// a restarted task resumes.
    pub(super) stored: Arc<std::sync::atomic::AtomicI64>,
}

impl OffsetStore {
    /// Every message below `next_offset` is durable and published.
    pub fn store(&self, next_offset: i64) {
        self.stored.fetch_max(next_offset, std::sync::atomic::Ordering::Relaxed);
        let Some(consumer) = self.consumer.upgrade() else {
            return;
        };
        let mut list = TopicPartitionList::new();
        if list
            .add_partition_offset(&self.topic, self.partition, Offset::Offset(next_offset))
            .is_err()
        {
            return;
        }
        if let Err(error) = consumer.store_offsets(&list) {
            // After a revoke the store is refused; the new owner re-reads from
            // the last committed offset and processing is idempotent.
            tracing::debug!(topic = %self.topic, partition = self.partition, %error, "offset store refused");
        }
    }

    /// The partition's (low, high) watermarks from the broker: the first
    /// offset still in the log and the offset after the last. `None` when
    /// the broker does not answer within `timeout`.
    pub async fn watermarks(&self, timeout: Duration) -> Option<(i64, i64)> {
        let consumer = self.consumer.upgrade()?;
        let topic = self.topic.clone();
        let partition = self.partition;
        let fetched = tokio::task::spawn_blocking(move || consumer.fetch_watermarks(&topic, partition, timeout)).await;
        match fetched {
            Ok(Ok(watermarks)) => Some(watermarks),
            Ok(Err(error)) => {
                tracing::warn!(topic = %self.topic, partition, %error, "reading the partition's watermarks failed");
                None
            }
            Err(_join) => None,
        }
    }
}

impl OffsetStore {
    /// Whether the partition's log still holds `offset` (or a later one:
    /// the log goes on past it), read with a consumer of its own that
    /// starts there. `Some(false)`: the log ends at or before it, starts
    /// after it, or gave nothing from there within `timeout`. `None`: the
    /// read failed.
    ///
    /// A broker's high watermark alone is not proof: tansu reports its last
    /// batch's base offset + 1, below messages it holds.
    pub async fn holds_offset(&self, offset: i64, timeout: Duration) -> Option<bool> {
        let probe = self.probe.clone();
        let topic = self.topic.clone();
        let partition = self.partition;
        log_holds_offset(probe, topic, partition, offset, timeout).await
    }
}

/// Whether `topic`/`partition`'s log holds `offset` (or a later one), read
/// with a consumer of `probe_config` (`OffsetStore::holds_offset`).
pub async fn log_holds_offset(
    probe: Arc<ClientConfig>,
    topic: Arc<str>,
    partition: i32,
    offset: i64,
    timeout: Duration,
) -> Option<bool> {
    let reading = topic.clone();
    let read = tokio::task::spawn_blocking(move || read_at(&probe, &reading, partition, offset, timeout)).await;
    match read {
        Ok(Ok(holds)) => holds,
        Ok(Err(error)) => {
            tracing::warn!(%topic, partition, offset, %error, "reading the partition at an offset failed");
            None
        }
        Err(_join) => None,
    }
}

/// Read `topic`/`partition` from `offset` with a consumer of no group that
/// neither commits nor resets its position.
fn read_at(
    probe: &ClientConfig,
    topic: &str,
    partition: i32,
    offset: i64,
    timeout: Duration,
) -> Result<Option<bool>, KafkaError> {
    use rdkafka::consumer::BaseConsumer;
    let consumer: BaseConsumer<ProbeContext> = probe.create_with_context(ProbeContext::default())?;
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(topic, partition, Offset::Offset(offset))?;
    consumer.assign(&list)?;
    let deadline = std::time::Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            // Nothing at or after it (brokers do not always say "end of
            // partition" for an empty fetch).
            return Ok(Some(false));
        }
        let polled = consumer.poll(left.min(Duration::from_millis(100)));
        if consumer
            .context()
            .past_the_end
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return Ok(Some(false));
        }
        match polled {
            Some(Ok(message)) => return Ok(Some(message.offset() >= offset)),
            Some(Err(error)) if is_past_the_end(&error) => return Ok(Some(false)),
            Some(Err(error)) => return Err(error),
            None => {}
        }
    }
}

/// The end of the partition, or an offset out of its range.
fn is_past_the_end(error: &KafkaError) -> bool {
    matches!(error, KafkaError::PartitionEOF(_))
        || matches!(
            error.rdkafka_error_code(),
            Some(
                RDKafkaErrorCode::PartitionEOF | RDKafkaErrorCode::OffsetOutOfRange | RDKafkaErrorCode::AutoOffsetReset
            )
        )
}

/// Notes what librdkafka reports about a probed offset as a client error
/// (the end of the partition, an offset out of range) instead of logging it.
#[derive(Default)]
struct ProbeContext {
    past_the_end: std::sync::atomic::AtomicBool,
}

impl ClientContext for ProbeContext {
    fn error(&self, error: KafkaError, reason: &str) {
        if is_past_the_end(&error) {
            self.past_the_end.store(true, std::sync::atomic::Ordering::Release);
        } else {
            tracing::debug!(%error, reason, "kafka client error while reading an offset");
        }
    }
}

impl ConsumerContext for ProbeContext {}

/// The configuration of `holds_offset`'s consumers.
pub fn probe_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut client = client_config(kafka);
    client
        .set("group.id", format!("sluice-probe-{}", uuid::Uuid::new_v4()))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "error")
        .set("enable.partition.eof", "true")
        .set("fetch.wait.max.ms", kafka.fetch_wait_max_ms.to_string());
    client
}
