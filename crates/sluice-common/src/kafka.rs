//! Kafka plumbing on rdkafka: client configuration, a publisher that awaits
//! every delivery, batched internal messages, topic setup, and one consumer
//! runtime that hands each assigned partition to its own task.
//!
//! Offsets: auto-commit is on but auto *store* is off; a partition task stores
//! an offset only after the message's effects are durable and published, so
//! only processed offsets are ever committed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::{Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::config::KafkaConfig;
use crate::shutdown::Shutdown;

#[derive(Debug, thiserror::Error)]
pub enum KafkaPlumbingError {
    #[error("kafka client error: {0}")]
    Client(#[from] KafkaError),
    #[error("topic {topic}: {message}")]
    Topic { topic: String, message: String },
    #[error("delivery to {topic}[{partition}] failed: {source}")]
    Delivery {
        topic: String,
        partition: i32,
        #[source]
        source: KafkaError,
    },
}

/// librdkafka settings shared by producers, consumers and the admin client.
pub fn client_config(kafka: &KafkaConfig) -> ClientConfig {
    let mut client = ClientConfig::new();
    client.set("bootstrap.servers", &kafka.brokers);
    client.set_log_level(RDKafkaLogLevel::Warning);
    if !kafka.sasl_username.is_empty() {
        client.set("sasl.username", &kafka.sasl_username);
        client.set("sasl.password", kafka.sasl_password.expose());
    }
    for (key, value) in &kafka.properties {
        client.set(key, value);
    }
    client
}

// ---------------------------------------------------------------------------
// Producing

/// `kafka.producer_properties`, applied last to a producer's settings.
pub fn apply_producer_properties(client: &mut ClientConfig, kafka: &KafkaConfig) {
    for (key, value) in &kafka.producer_properties {
        client.set(key, value);
    }
}

/// One message to publish.
#[derive(Clone, Debug)]
pub struct OutMsg {
    pub topic: Arc<str>,
    /// Sluice computes partitions itself for internal topics; `None` lets the
    /// client's partitioner pick from the key (edge topics).
    pub partition: Option<i32>,
    pub key: Option<Vec<u8>>,
    pub payload: Vec<u8>,
    pub headers: Vec<(String, Vec<u8>)>,
}

/// Effects to publish after a commit. Internal entries for one (topic,
/// partition) are packed into batch messages whose field 1 is the repeated
/// entry (`LimitCommandBatch`, `GrantEventBatch`, ...).
#[derive(Debug, Default)]
pub struct Outbox {
    batches: BTreeMap<(Arc<str>, i32), Vec<Vec<u8>>>,
    messages: Vec<OutMsg>,
    entries: usize,
}

impl Outbox {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one entry to the batch message for `(topic, partition)`.
    pub fn push_entry<M: prost::Message>(&mut self, topic: &Arc<str>, partition: i32, entry: &M, max_bytes: usize) {
        let chunks = self.batches.entry((topic.clone(), partition)).or_default();
        let needed = entry.encoded_len() + 10;
        let start_new = match chunks.last() {
            None => true,
            Some(chunk) => !chunk.is_empty() && chunk.len() + needed > max_bytes,
        };
        if start_new {
            chunks.push(Vec::with_capacity(needed.max(256)));
        }
        if let Some(chunk) = chunks.last_mut() {
            // Field 1, wire type 2 (length-delimited): the batch's repeated entry.
            chunk.push(0x0a);
            // Writing into a Vec cannot fail.
            let _ = entry.encode_length_delimited(chunk);
        }
        self.entries += 1;
    }

    pub fn push(&mut self, message: OutMsg) {
        self.messages.push(message);
        self.entries += 1;
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Entries and single messages pushed so far.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn append(&mut self, other: Outbox) {
        for (destination, chunks) in other.batches {
            self.batches.entry(destination).or_default().extend(chunks);
        }
        self.messages.extend(other.messages);
        self.entries += other.entries;
    }

    pub fn into_messages(self) -> Vec<OutMsg> {
        let mut messages = self.messages;
        for ((topic, partition), chunks) in self.batches {
            for payload in chunks {
                messages.push(OutMsg {
                    topic: topic.clone(),
                    partition: Some(partition),
                    key: None,
                    payload,
                    headers: Vec::new(),
                });
            }
        }
        messages
    }
}

/// A producer that returns only when every message is acknowledged.
#[derive(Clone)]
pub struct Publisher {
    producer: FutureProducer,
    pub max_message_bytes: usize,
}

impl Publisher {
    pub fn new(kafka: &KafkaConfig) -> Result<Self, KafkaPlumbingError> {
        let mut client = client_config(kafka);
        client
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("linger.ms", kafka.linger_ms.to_string())
            .set("batch.size", "1000000")
            .set("message.max.bytes", (kafka.max_message_bytes + 100_000).to_string())
            .set("queue.buffering.max.messages", "1000000")
            .set("message.timeout.ms", "30000");
        apply_producer_properties(&mut client, kafka);
        let producer: FutureProducer = client.create()?;
        Ok(Publisher {
            producer,
            max_message_bytes: kafka.max_message_bytes,
        })
    }

    /// Publish every message and wait for all acknowledgements.
    pub async fn send_all(&self, messages: Vec<OutMsg>) -> Result<(), KafkaPlumbingError> {
        if messages.is_empty() {
            return Ok(());
        }
        let mut deliveries = Vec::with_capacity(messages.len());
        for message in &messages {
            let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
            for (name, value) in &message.headers {
                headers = headers.insert(Header {
                    key: name,
                    value: Some(value),
                });
            }
            let mut record = FutureRecord::<[u8], [u8]>::to(&message.topic)
                .payload(&message.payload)
                .headers(headers);
            if let Some(key) = &message.key {
                record = record.key(key);
            }
            if let Some(partition) = message.partition {
                record = record.partition(partition);
            }
            loop {
                match self.producer.send_result(record) {
                    Ok(delivery) => {
                        deliveries.push((message.topic.clone(), message.partition, delivery));
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned)) => {
                        record = returned;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err((error, _)) => {
                        return Err(KafkaPlumbingError::Delivery {
                            topic: message.topic.to_string(),
                            partition: message.partition.unwrap_or(-1),
                            source: error,
                        })
                    }
                }
            }
        }
        let mut produced: std::collections::HashMap<Arc<str>, u64> = std::collections::HashMap::new();
        for (topic, partition, delivery) in deliveries {
            *produced.entry(topic.clone()).or_default() += 1;
            let outcome = delivery.await.map_err(|_cancelled| KafkaPlumbingError::Delivery {
                topic: topic.to_string(),
                partition: partition.unwrap_or(-1),
                source: KafkaError::Canceled,
            })?;
            if let Err(report) = outcome {
                return Err(KafkaPlumbingError::Delivery {
                    topic: topic.to_string(),
                    partition: partition.unwrap_or(-1),
                    source: report.0,
                });
            }
        }
        for (topic, count) in produced {
            crate::metrics::metrics()
                .produced
                .add(count, &[opentelemetry::KeyValue::new("topic", topic.to_string())]);
        }
        Ok(())
    }

    /// Publish an outbox; see `send_all`.
    pub async fn publish(&self, outbox: Outbox) -> Result<(), KafkaPlumbingError> {
        self.send_all(outbox.into_messages()).await
    }

    /// Wait for queued messages (graceful shutdown).
    pub fn flush(&self, timeout: Duration) {
        if let Err(error) = self.producer.flush(timeout) {
            tracing::warn!(%error, "producer flush at shutdown did not finish");
        }
    }
}

// ---------------------------------------------------------------------------
// Topics

#[derive(Clone, Debug)]
pub struct TopicSpec {
    pub name: String,
    pub partitions: i32,
    /// Internal topics must keep their partition count: it maps keys to owners.
    pub internal: bool,
}

/// Create missing topics; refuse an internal topic whose partition count
/// differs from the configured one. Returns the partition count of each.
pub async fn ensure_topics(
    kafka: &KafkaConfig,
    specs: &[TopicSpec],
    create: bool,
) -> Result<HashMap<String, i32>, KafkaPlumbingError> {
    let admin: Arc<AdminClient<DefaultClientContext>> = Arc::new(client_config(kafka).create()?);
    let existing = fetch_partition_counts(&admin, specs).await?;
    let missing: Vec<&TopicSpec> = specs.iter().filter(|spec| !existing.contains_key(&spec.name)).collect();
    if !missing.is_empty() {
        if !create {
            return Err(KafkaPlumbingError::Topic {
                topic: missing[0].name.clone(),
                message: "does not exist and kafka.create_topics is false".to_string(),
            });
        }
        let new_topics: Vec<NewTopic<'_>> = missing
            .iter()
            .map(|spec| {
                NewTopic::new(
                    &spec.name,
                    spec.partitions,
                    TopicReplication::Fixed(kafka.replication_factor),
                )
            })
            .collect();
        let results = admin
            .create_topics(
                &new_topics,
                &AdminOptions::new().operation_timeout(Some(Duration::from_secs(10))),
            )
            .await?;
        for result in results {
            match result {
                Ok(name) => tracing::info!(topic = %name, "created topic"),
                Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => {
                    tracing::debug!(topic = %name, "topic created concurrently")
                }
                Err((name, code)) => {
                    return Err(KafkaPlumbingError::Topic {
                        topic: name,
                        message: format!("create failed: {code}"),
                    })
                }
            }
        }
    }
    // Metadata may lag creation for a moment.
    let mut counts = fetch_partition_counts(&admin, specs).await?;
    for _ in 0..50 {
        if specs.iter().all(|spec| counts.contains_key(&spec.name)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        counts = fetch_partition_counts(&admin, specs).await?;
    }
    for spec in specs {
        let Some(actual) = counts.get(&spec.name).copied() else {
            return Err(KafkaPlumbingError::Topic {
                topic: spec.name.clone(),
                message: "not visible in metadata after creation".to_string(),
            });
        };
        if spec.internal && actual != spec.partitions {
            return Err(KafkaPlumbingError::Topic {
                topic: spec.name.clone(),
                message: format!(
                    "has {actual} partitions but {} are configured; an internal topic's partition count \
                     must never change (it maps keys to owners)",
                    spec.partitions
                ),
            });
        }
    }
    Ok(counts)
}

async fn fetch_partition_counts(
    admin: &Arc<AdminClient<DefaultClientContext>>,
    specs: &[TopicSpec],
) -> Result<HashMap<String, i32>, KafkaPlumbingError> {
    let wanted: HashSet<&str> = specs.iter().map(|spec| spec.name.as_str()).collect();
    let admin = admin.clone();
    let metadata = tokio::task::spawn_blocking(move || admin.inner().fetch_metadata(None, Duration::from_secs(10)))
        .await
        .map_err(|_join| KafkaPlumbingError::Client(KafkaError::Canceled))??;
    let mut counts = HashMap::new();
    for topic in metadata.topics() {
        if wanted.contains(topic.name()) && topic.error().is_none() && !topic.partitions().is_empty() {
            let count = i32::try_from(topic.partitions().len()).unwrap_or(i32::MAX);
            counts.insert(topic.name().to_string(), count);
        }
    }
    Ok(counts)
}

// ---------------------------------------------------------------------------
// Consuming

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
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_slice())
    }

    fn from_borrowed(message: &BorrowedMessage<'_>) -> Self {
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

/// Stores "processed up to here" for one partition; auto-commit sends it.
///
/// Holds the consumer weakly: when the consumer loop ends, the consumer is
/// closed (it leaves the group at once) even if a partition task lingers.
#[derive(Clone)]
pub struct OffsetStore {
    consumer: std::sync::Weak<StreamConsumer<RebalanceContext>>,
    topic: Arc<str>,
    partition: i32,
}

impl OffsetStore {
    /// Every message below `next_offset` is durable and published.
    pub fn store(&self, next_offset: i64) {
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
}

/// What a partition task gets.
pub struct PartitionInput {
    pub topic: Arc<str>,
    pub partition: i32,
    pub messages: mpsc::Receiver<InMsg>,
    /// Cancelled when the partition is revoked or the service stops.
    pub stop: CancellationToken,
    pub offsets: OffsetStore,
}

#[derive(Debug, thiserror::Error)]
pub enum PartitionTaskError {
    /// Stop the whole service instance, as a killed process would (fault hooks).
    #[error("crash injected")]
    Crashed,
    /// This partition cannot go on (bad internal input, fenced); others continue.
    #[error("partition {partition} stopped: {reason}")]
    Stopped { partition: i32, reason: String },
}

/// Starts the task that processes one assigned partition.
pub trait PartitionTaskFactory: Send + Sync + 'static {
    fn start(&self, input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>>;
}

/// Whether the consumer has read to the end of each assigned partition.
#[derive(Debug, Default)]
pub struct ConsumerProgress {
    partitions: Mutex<HashMap<i32, PartitionProgress>>,
}

#[derive(Clone, Copy, Debug, Default)]
pub struct PartitionProgress {
    pub at_end: bool,
    pub reached_end_at: Option<std::time::Instant>,
}

impl ConsumerProgress {
    /// Assigned partitions that are at their end now, or were within `recent`.
    pub fn caught_up(&self, recent: Duration) -> Vec<i32> {
        let partitions = self.partitions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut caught_up: Vec<i32> = partitions
            .iter()
            .filter(|(_, progress)| progress.at_end || progress.reached_end_at.is_some_and(|at| at.elapsed() <= recent))
            .map(|(partition, _)| *partition)
            .collect();
        caught_up.sort_unstable();
        caught_up
    }

    pub fn assigned(&self) -> Vec<i32> {
        let partitions = self.partitions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut assigned: Vec<i32> = partitions.keys().copied().collect();
        assigned.sort_unstable();
        assigned
    }

    fn update(&self, partition: i32, change: impl FnOnce(&mut PartitionProgress)) {
        let mut partitions = self.partitions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(progress) = partitions.get_mut(&partition) {
            change(progress);
        }
    }
}

/// Tracks the assignment synchronously inside librdkafka's rebalance
/// callback, so the dispatch loop never routes a message of a partition it
/// has not yet seen assigned.
pub struct RebalanceContext {
    topic: Arc<str>,
    assigned: Arc<Mutex<HashSet<i32>>>,
    progress: Arc<ConsumerProgress>,
    /// Since when the group session is lost (librdkafka revoked the
    /// assignment as lost) with no assignment back yet.
    lost_since: Arc<Mutex<Option<std::time::Instant>>>,
}

impl ClientContext for RebalanceContext {
    fn error(&self, error: KafkaError, reason: &str) {
        // Partition ends are reported through the message stream as well;
        // librdkafka's global copy of them is not an error.
        if matches!(error, KafkaError::PartitionEOF(_))
            || error.rdkafka_error_code() == Some(RDKafkaErrorCode::PartitionEOF)
        {
            return;
        }
        tracing::error!(%error, reason, "kafka client error");
    }

    fn stats(&self, statistics: rdkafka::Statistics) {
        // Consumer lag (tests must not assert on it: tansu's high watermark is off).
        self.record_lag(&statistics);
    }
}

impl RebalanceContext {
    fn record_lag(&self, statistics: &rdkafka::Statistics) {
        for (name, topic) in &statistics.topics {
            for (partition, state) in &topic.partitions {
                if *partition >= 0 && state.consumer_lag >= 0 {
                    crate::metrics::metrics().set_consumer_lag(name, *partition, state.consumer_lag);
                }
            }
        }
    }
}

impl ConsumerContext for RebalanceContext {
    fn pre_rebalance(&self, consumer: &rdkafka::consumer::BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Error(error) = rebalance {
            tracing::warn!(topic = %self.topic, %error, "rebalance error");
        }
        if let Rebalance::Revoke(list) = rebalance {
            if consumer.assignment_lost() {
                tracing::warn!(topic = %self.topic, "the group session was lost; partitions revoked as lost");
                let mut lost_since = self.lost_since.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                lost_since.get_or_insert_with(std::time::Instant::now);
            }
            let mut assigned = self.assigned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let mut progress = self
                .progress
                .partitions
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            for element in list.elements_for_topic(&self.topic) {
                assigned.remove(&element.partition());
                progress.remove(&element.partition());
            }
            tracing::info!(topic = %self.topic, revoked = list.count(), "partitions revoked");
        }
    }

    fn post_rebalance(&self, _consumer: &rdkafka::consumer::BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            // Any assignment, even an empty one, means the member is back in the group.
            *self.lost_since.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = None;
            let mut assigned = self.assigned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let mut progress = self
                .progress
                .partitions
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            for element in list.elements_for_topic(&self.topic) {
                assigned.insert(element.partition());
                progress.entry(element.partition()).or_default();
            }
            tracing::info!(topic = %self.topic, assigned = list.count(), "partitions assigned");
        }
    }
}

pub struct ConsumerOptions {
    pub group: String,
    pub topic: String,
    pub channel_capacity: usize,
    /// Report partition ends (`ConsumerProgress`); costs nothing when idle.
    pub track_end: bool,
}

/// Consume `topic` in `group`, one task per assigned partition, until
/// shutdown or a crash. A partition task that stops with an error is restarted
/// only by a new assignment; a crash stops everything.
///
/// A member whose group session is lost (it could not heartbeat in time)
/// normally rejoins by itself. If no assignment comes back within twice the
/// session timeout, the consumer is re-created and joins as a new member:
/// seen with tansu under CPU starvation, and harmless with Kafka.
pub async fn run_partitioned_consumer(
    kafka: &KafkaConfig,
    options: ConsumerOptions,
    factory: Arc<dyn PartitionTaskFactory>,
    progress: Arc<ConsumerProgress>,
    shutdown: Shutdown,
) -> Result<(), KafkaPlumbingError> {
    let rejoin_within = Duration::from_millis(u64::from(kafka.session_timeout_ms) * 2).max(Duration::from_secs(10));
    loop {
        match consume_as_member(kafka, &options, &factory, &progress, &shutdown, rejoin_within).await? {
            MemberEnd::Stopped => return Ok(()),
            MemberEnd::MembershipLost => {
                tracing::warn!(
                    topic = %options.topic,
                    group = %options.group,
                    ?rejoin_within,
                    "no assignment since the group session was lost; re-creating the consumer"
                );
            }
        }
    }
}

enum MemberEnd {
    Stopped,
    MembershipLost,
}

async fn consume_as_member(
    kafka: &KafkaConfig,
    options: &ConsumerOptions,
    factory: &Arc<dyn PartitionTaskFactory>,
    progress: &Arc<ConsumerProgress>,
    shutdown: &Shutdown,
    rejoin_within: Duration,
) -> Result<MemberEnd, KafkaPlumbingError> {
    let topic: Arc<str> = Arc::from(options.topic.as_str());
    let assigned = Arc::new(Mutex::new(HashSet::new()));
    let lost_since = Arc::new(Mutex::new(None));
    let context = RebalanceContext {
        topic: topic.clone(),
        assigned: assigned.clone(),
        progress: progress.clone(),
        lost_since: lost_since.clone(),
    };
    let mut client = client_config(kafka);
    client
        .set("group.id", &options.group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.commit.interval.ms", "200")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", kafka.session_timeout_ms.to_string())
        // Also the coordinator's rebalance timeout: how long a rebalance
        // waits for a member that stopped polling (a zombie) before going on
        // without it. librdkafka's 300 s default stalls a group for minutes.
        .set(
            "max.poll.interval.ms",
            (kafka.session_timeout_ms.saturating_mul(3)).max(30_000).to_string(),
        )
        .set(
            "heartbeat.interval.ms",
            (kafka.session_timeout_ms / 5).max(100).to_string(),
        )
        .set("fetch.wait.max.ms", kafka.fetch_wait_max_ms.to_string())
        .set("enable.partition.eof", if options.track_end { "true" } else { "false" })
        .set("statistics.interval.ms", "15000");
    for (key, value) in &kafka.properties {
        client.set(key, value);
    }
    let consumer: Arc<StreamConsumer<RebalanceContext>> = Arc::new(client.create_with_context(context)?);
    consumer.subscribe(&[&options.topic])?;

    struct Running {
        sender: mpsc::Sender<InMsg>,
        stop: CancellationToken,
        /// Whether the task's first message was logged (where it resumed).
        resumed: bool,
    }
    let mut running: HashMap<i32, Running> = HashMap::new();
    let (finished_sender, mut finished) = mpsc::unbounded_channel::<(i32, Result<(), PartitionTaskError>)>();

    let start_task = |partition: i32, running: &mut HashMap<i32, Running>| {
        let (sender, receiver) = mpsc::channel(options.channel_capacity);
        let stop = shutdown.token().child_token();
        let input = PartitionInput {
            topic: topic.clone(),
            partition,
            messages: receiver,
            stop: stop.clone(),
            offsets: OffsetStore {
                consumer: Arc::downgrade(&consumer),
                topic: topic.clone(),
                partition,
            },
        };
        let task = factory.start(input);
        let finished_sender = finished_sender.clone();
        tokio::spawn(async move {
            let outcome = task.await;
            let _ = finished_sender.send((partition, outcome));
        });
        tracing::debug!(topic = %topic, partition, "partition task started");
        running.insert(
            partition,
            Running {
                sender,
                stop,
                resumed: false,
            },
        );
    };

    let topic_attribute = [opentelemetry::KeyValue::new("topic", topic.to_string())];
    let mut consumed_since_report = 0u64;
    let mut reconcile_timer = tokio::time::interval(Duration::from_millis(100));
    reconcile_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let outcome = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break MemberEnd::Stopped,
            Some((partition, outcome)) = finished.recv() => {
                match outcome {
                    Err(PartitionTaskError::Crashed) => {
                        shutdown.crash();
                        break MemberEnd::Stopped;
                    }
                    Err(error @ PartitionTaskError::Stopped { .. }) => {
                        // Keep the dead entry: the partition stays stopped (and
                        // the instance not ready) until a new assignment.
                        tracing::error!(topic = %topic, partition, %error, "partition task stopped; alert: its input is not being processed");
                    }
                    Ok(()) => {
                        // Revoked, or fenced by a newer owner. If the partition
                        // is still assigned here, the next reconcile takes it
                        // over again.
                        if running.get(&partition).is_some_and(|entry| entry.sender.is_closed()) {
                            running.remove(&partition);
                        }
                    }
                }
            }
            _ = reconcile_timer.tick() => {
                let lost_for = lost_since
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .map(|since| since.elapsed());
                if lost_for.is_some_and(|lost_for| lost_for >= rejoin_within) {
                    break MemberEnd::MembershipLost;
                }
                if consumed_since_report > 0 {
                    crate::metrics::metrics().consumed.add(consumed_since_report, &topic_attribute);
                    consumed_since_report = 0;
                }
                let current: HashSet<i32> = assigned.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clone();
                running.retain(|partition, entry| {
                    let keep = current.contains(partition);
                    if !keep {
                        entry.stop.cancel();
                    }
                    keep
                });
                for partition in current {
                    if !running.contains_key(&partition) {
                        start_task(partition, &mut running);
                    }
                }
            }
            received = consumer.recv() => {
                match received {
                    Ok(message) => {
                        let partition = message.partition();
                        let is_assigned = assigned.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).contains(&partition);
                        if !is_assigned {
                            continue;
                        }
                        if options.track_end {
                            progress.update(partition, |state| state.at_end = false);
                        }
                        consumed_since_report += 1;
                        if consumed_since_report >= 256 {
                            crate::metrics::metrics().consumed.add(consumed_since_report, &topic_attribute);
                            consumed_since_report = 0;
                        }
                        if !running.contains_key(&partition) {
                            start_task(partition, &mut running);
                        }
                        let detached = InMsg::from_borrowed(&message);
                        drop(message);
                        if let Some(entry) = running.get_mut(&partition) {
                            if !entry.resumed {
                                entry.resumed = true;
                                tracing::info!(topic = %topic, partition, offset = detached.offset, "partition resumed");
                            }
                            if entry.sender.send(detached).await.is_err() {
                                tracing::debug!(topic = %topic, partition, "partition task gone; message left for the next owner");
                            }
                        }
                    }
                    Err(KafkaError::PartitionEOF(partition)) => {
                        progress.update(partition, |state| {
                            state.at_end = true;
                            state.reached_end_at = Some(std::time::Instant::now());
                        });
                    }
                    Err(error) => {
                        tracing::warn!(topic = %topic, %error, "consumer error");
                    }
                }
            }
        }
    };
    for entry in running.values() {
        entry.stop.cancel();
    }
    if matches!(outcome, MemberEnd::Stopped) && !shutdown.is_crashed() {
        // Give partition tasks a moment to store their last offsets, then
        // commit them before leaving the group.
        tokio::time::sleep(Duration::from_millis(50)).await;
        if let Err(error) = consumer.commit_consumer_state(rdkafka::consumer::CommitMode::Sync) {
            tracing::debug!(%error, "final offset commit");
        }
    }
    consumer.unsubscribe();
    // Closing waits for the group to acknowledge the leave: do it off the
    // async runtime. Offset stores hold the consumer weakly, so this is the
    // last strong reference.
    let closed = tokio::task::spawn_blocking(move || drop(consumer)).await;
    if let Err(error) = closed {
        // Cancelled when the runtime itself is shutting down.
        if error.is_panic() {
            tracing::warn!(topic = %topic, %error, "closing the consumer panicked");
        } else {
            tracing::debug!(topic = %topic, %error, "closing the consumer was cut short");
        }
    }
    Ok(outcome)
}

/// Read a header as UTF-8 text.
pub fn header_text<'a>(headers: &'a [(String, Vec<u8>)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(key, _)| key.eq_ignore_ascii_case(name))
        .and_then(|(_, value)| std::str::from_utf8(value).ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;
    use sluice_proto::v1::{GrantEvent, GrantEventBatch, TicketId};

    #[test]
    fn outbox_packs_entries_into_decodable_batches_and_splits_by_size() {
        let topic: Arc<str> = Arc::from("grants");
        let mut outbox = Outbox::new();
        for index in 0..100u32 {
            let event = GrantEvent {
                ticket: Some(TicketId {
                    job_id: format!("job-{index}"),
                    attempt: 1,
                    step: index,
                }),
                ..Default::default()
            };
            outbox.push_entry(&topic, i32::try_from(index % 2).unwrap(), &event, 400);
        }
        assert_eq!(outbox.len(), 100);
        let messages = outbox.into_messages();
        assert!(messages.len() > 2, "expected splitting, got {}", messages.len());
        let mut seen = 0;
        for message in messages {
            assert!(message.payload.len() <= 400 + 40);
            let batch = GrantEventBatch::decode(message.payload.as_slice()).unwrap();
            for event in batch.events {
                let step = event.ticket.unwrap().step;
                assert_eq!(i32::try_from(step % 2).unwrap(), message.partition.unwrap());
                seen += 1;
            }
        }
        assert_eq!(seen, 100);
    }
}
