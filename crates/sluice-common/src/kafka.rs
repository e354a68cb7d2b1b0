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
use futures::FutureExt;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::stream_consumer::StreamPartitionQueue;
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

/// A span to record when a message is sent (not when it is decided: a
/// batch decided twice sends once), whose context then replaces the
/// message's trace headers, so that what its consumer does hangs below it.
/// The message's own trace headers are its parent.
#[derive(Clone, Debug, PartialEq)]
pub struct SendSpan {
    /// The tracer scope (the service's crate).
    pub scope: &'static str,
    pub name: &'static str,
    /// When it started and ended (ms since the epoch); a moment.
    pub at_ms: i64,
    pub attributes: Vec<(&'static str, SpanValue)>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum SpanValue {
    Text(String),
    Number(i64),
}

/// Effects to publish after a commit. Internal entries for one (topic,
/// partition) are packed into batch messages whose field 1 is the repeated
/// entry (`LimitCommandBatch`, `GrantEventBatch`, ...). Entries for a link
/// (a gRPC stream of the hot path, `crate::link`) are kept encoded, by
/// (link, partition).
#[derive(Debug, Default)]
pub struct Outbox {
    batches: BTreeMap<(Arc<str>, i32), Vec<Vec<u8>>>,
    messages: Vec<OutMsg>,
    links: crate::link::LinkEntries,
    entries: usize,
    observations: Observations,
    /// Spans to record when single messages are sent: (index in
    /// `messages`, span).
    spans: Vec<(usize, SendSpan)>,
}

/// What a batch decided, as metrics, spans and logs, recorded only once the
/// batch is committed (`Outbox::observe`): a batch that does not commit is
/// decided again from the saved state and observed then, and a re-send of
/// what was decided before (after a takeover, for a duplicate) is never
/// observed. So counters count each decision once.
#[derive(Default)]
pub struct Observations(Vec<Box<dyn FnOnce() + Send>>);

impl Observations {
    /// Record them (the batch is committed).
    pub fn record(self) {
        for observation in self.0 {
            observation();
        }
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Observations {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Observations({})", self.0.len())
    }
}

impl Outbox {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `other`'s entries, messages and observations after this one's.
    pub fn append(&mut self, other: Outbox) {
        for (key, chunks) in other.batches {
            self.batches.entry(key).or_default().extend(chunks);
        }
        let offset = self.messages.len();
        self.spans
            .extend(other.spans.into_iter().map(|(index, span)| (index + offset, span)));
        self.messages.extend(other.messages);
        for (key, entries) in other.links {
            self.links.entry(key).or_default().extend(entries);
        }
        self.entries += other.entries;
        self.observations.0.extend(other.observations.0);
    }

    /// Record `observation` (metrics, spans, logs of a decision) once the
    /// batch is committed; see `Observations`.
    pub fn observe(&mut self, observation: impl FnOnce() + Send + 'static) {
        self.observations.0.push(Box::new(observation));
    }

    /// The batch's observations, to record after its commit.
    pub fn take_observations(&mut self) -> Observations {
        std::mem::take(&mut self.observations)
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

    /// Add one message whose span is recorded when it is sent
    /// (`SendSpan`).
    pub fn push_with_span(&mut self, message: OutMsg, span: SendSpan) {
        self.spans.push((self.messages.len(), span));
        self.push(message);
    }

    /// The spans of single messages, by their index in `into_messages`
    /// (single messages come first there).
    pub fn take_spans(&mut self) -> Vec<(usize, SendSpan)> {
        std::mem::take(&mut self.spans)
    }

    /// Add one entry for `partition` of `link` (sent on a stream, not Kafka).
    pub fn push_link<M: prost::Message>(&mut self, link: crate::link::Link, partition: i32, entry: &M) {
        self.links
            .entry((link, partition))
            .or_default()
            .push(entry.encode_to_vec());
        self.entries += 1;
    }

    /// The link entries, leaving the Kafka messages.
    pub fn take_links(&mut self) -> crate::link::LinkEntries {
        let links = std::mem::take(&mut self.links);
        let taken: usize = links.values().map(Vec::len).sum();
        self.entries -= taken;
        links
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// Entries and single messages pushed so far.
    pub fn len(&self) -> usize {
        self.entries
    }

    /// The Kafka messages. Link entries must have been taken (`take_links`).
    pub fn into_messages(self) -> Vec<OutMsg> {
        debug_assert!(self.links.is_empty(), "link entries left in an outbox sent to Kafka");
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
///
/// Idempotent (no duplicates or reordering on retries). When the idempotent
/// producer turns fatal — a broker that lost its state answers with an
/// unknown producer id or sequence — it is rebuilt, and readiness is
/// NOT_SERVING until it is; the messages that failed are the caller's to
/// send again (their failures classify as transient).
#[derive(Clone)]
pub struct Publisher {
    inner: Arc<PublisherInner>,
    pub max_message_bytes: usize,
}

struct PublisherInner {
    kafka: KafkaConfig,
    producer: std::sync::RwLock<(u64, FutureProducer)>,
    readiness: crate::readiness::Readiness,
    faults: crate::faults::Faults,
    /// The generation a `ProducerFatal` fault hook made fatal (tests).
    fatal_by_fault: std::sync::atomic::AtomicU64,
}

const PRODUCER_CONDITION: &str = "kafka producer";

fn create_producer(kafka: &KafkaConfig) -> Result<FutureProducer, KafkaError> {
    let mut client = client_config(kafka);
    client
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", kafka.linger_ms.to_string())
        .set("batch.size", "1000000")
        // librdkafka's own check of a request's size: every message Sluice
        // builds stays under `max_message_bytes`; the margin is the batch's
        // framing.
        .set("message.max.bytes", (kafka.max_message_bytes + 65_536).to_string())
        .set("queue.buffering.max.messages", "1000000")
        .set("message.timeout.ms", "30000");
    apply_producer_properties(&mut client, kafka);
    client.create()
}

impl Publisher {
    pub fn new(kafka: &KafkaConfig) -> Result<Self, KafkaPlumbingError> {
        Self::with_readiness(kafka, crate::readiness::Readiness::new())
    }

    /// A publisher that reports a producer being rebuilt to `readiness`.
    pub fn with_readiness(
        kafka: &KafkaConfig,
        readiness: crate::readiness::Readiness,
    ) -> Result<Self, KafkaPlumbingError> {
        Self::for_service(kafka, readiness, crate::faults::Faults::none())
    }

    /// A service's publisher: rebuilds reported to `readiness`; `faults`
    /// can make it fatal (`FaultPoint::ProducerFatal`).
    pub fn for_service(
        kafka: &KafkaConfig,
        readiness: crate::readiness::Readiness,
        faults: crate::faults::Faults,
    ) -> Result<Self, KafkaPlumbingError> {
        let producer = create_producer(kafka)?;
        Ok(Publisher {
            inner: Arc::new(PublisherInner {
                kafka: kafka.clone(),
                producer: std::sync::RwLock::new((0, producer)),
                readiness,
                faults,
                fatal_by_fault: std::sync::atomic::AtomicU64::new(u64::MAX),
            }),
            max_message_bytes: kafka.max_message_bytes,
        })
    }

    fn current(&self) -> (u64, FutureProducer) {
        let current = self
            .inner
            .producer
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        (current.0, current.1.clone())
    }

    /// Replace a fatal producer (once per generation).
    fn rebuild_if_fatal(&self, generation: u64, producer: &FutureProducer) {
        let fatal = producer.client().fatal_error().or_else(|| {
            (self.inner.fatal_by_fault.load(std::sync::atomic::Ordering::Relaxed) == generation)
                .then(|| (RDKafkaErrorCode::Fatal, "made fatal by a fault hook".to_string()))
        });
        let Some((code, reason)) = fatal else {
            return;
        };
        let mut current = self
            .inner
            .producer
            .write()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if current.0 != generation {
            return;
        }
        tracing::error!(%code, %reason, "the Kafka producer hit a fatal error; rebuilding it");
        self.inner.readiness.set(
            PRODUCER_CONDITION,
            format!("rebuilding after a fatal error: {code}: {reason}"),
        );
        match create_producer(&self.inner.kafka) {
            Ok(fresh) => {
                let old = std::mem::replace(&mut *current, (generation + 1, fresh));
                drop(current);
                // Destroying the old client waits for its threads: off the runtime.
                tokio::task::spawn_blocking(move || drop(old));
                self.inner.readiness.clear(PRODUCER_CONDITION);
                tracing::info!("the Kafka producer was rebuilt");
            }
            Err(error) => {
                tracing::error!(%error, "rebuilding the Kafka producer failed; retrying on the next send");
            }
        }
    }

    /// Publish every message; the outcome of each, in order. Waits for
    /// every acknowledgement (or failure).
    pub async fn send_each(&self, messages: &[OutMsg]) -> Vec<Result<(), KafkaError>> {
        let (generation, producer) = self.current();
        if self.inner.faults.hit(crate::faults::FaultPoint::ProducerFatal) {
            self.inner
                .fatal_by_fault
                .store(generation, std::sync::atomic::Ordering::Relaxed);
        }
        if self.inner.fatal_by_fault.load(std::sync::atomic::Ordering::Relaxed) == generation && !messages.is_empty() {
            // A fatal producer fails every send, as librdkafka's does.
            self.rebuild_if_fatal(generation, &producer);
            return messages
                .iter()
                .map(|_| Err(KafkaError::MessageProduction(RDKafkaErrorCode::Fatal)))
                .collect();
        }
        let mut deliveries = Vec::with_capacity(messages.len());
        for message in messages {
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
                match producer.send_result(record) {
                    Ok(delivery) => {
                        deliveries.push(Ok(delivery));
                        break;
                    }
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), returned)) => {
                        record = returned;
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    Err((error, _)) => {
                        deliveries.push(Err(error));
                        break;
                    }
                }
            }
        }
        let mut results = Vec::with_capacity(deliveries.len());
        let mut produced: HashMap<Arc<str>, u64> = HashMap::new();
        for (delivery, message) in deliveries.into_iter().zip(messages) {
            let outcome = match delivery {
                Ok(future) => match future.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err((error, _))) => Err(error),
                    Err(_cancelled) => Err(KafkaError::Canceled),
                },
                Err(error) => Err(error),
            };
            if outcome.is_ok() {
                *produced.entry(message.topic.clone()).or_default() += 1;
            }
            results.push(outcome);
        }
        if results.iter().any(Result::is_err) {
            self.rebuild_if_fatal(generation, &producer);
        }
        for (topic, count) in produced {
            crate::metrics::metrics()
                .produced
                .add(count, &[opentelemetry::KeyValue::new("topic", topic.to_string())]);
        }
        results
    }

    /// Publish every message and wait for all acknowledgements; the first
    /// failure, if any.
    pub async fn send_all(&self, messages: Vec<OutMsg>) -> Result<(), KafkaPlumbingError> {
        if messages.is_empty() {
            return Ok(());
        }
        let results = self.send_each(&messages).await;
        for (result, message) in results.into_iter().zip(&messages) {
            if let Err(source) = result {
                return Err(KafkaPlumbingError::Delivery {
                    topic: message.topic.to_string(),
                    partition: message.partition.unwrap_or(-1),
                    source,
                });
            }
        }
        Ok(())
    }

    /// Wait for queued messages (graceful shutdown), at most `timeout`,
    /// off the async runtime (librdkafka's flush blocks its thread).
    pub async fn flush(&self, timeout: Duration) {
        let (_, producer) = self.current();
        match tokio::task::spawn_blocking(move || producer.flush(timeout)).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => tracing::warn!(%error, "producer flush at shutdown did not finish"),
            Err(error) => tracing::warn!(%error, "producer flush at shutdown was cut short"),
        }
    }
}

/// The entries of a batch message (`LimitCommandBatch`, `GrantEventBatch`,
/// ...: field 1 is the repeated entry), each as its encoded bytes, without
/// decoding them: one bad entry does not hide the others. Other fields are
/// skipped as protobuf says; a payload that is not protobuf is an error.
pub fn batch_entries(payload: &[u8]) -> Result<Vec<&[u8]>, String> {
    fn varint(bytes: &[u8], at: &mut usize) -> Result<u64, String> {
        let mut value = 0u64;
        for shift in (0..70).step_by(7) {
            let Some(byte) = bytes.get(*at) else {
                return Err("truncated varint".to_string());
            };
            *at += 1;
            if shift == 63 && *byte > 1 {
                return Err("varint overflows 64 bits".to_string());
            }
            value |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(value);
            }
        }
        Err("varint longer than 10 bytes".to_string())
    }
    let mut entries = Vec::new();
    let mut at = 0;
    while at < payload.len() {
        let key = varint(payload, &mut at)?;
        let field = key >> 3;
        if field == 0 {
            return Err("field number 0".to_string());
        }
        match key & 7 {
            0 => {
                varint(payload, &mut at)?;
            }
            1 => {
                at = at
                    .checked_add(8)
                    .filter(|end| *end <= payload.len())
                    .ok_or("truncated")?
            }
            5 => {
                at = at
                    .checked_add(4)
                    .filter(|end| *end <= payload.len())
                    .ok_or("truncated")?
            }
            2 => {
                let length = usize::try_from(varint(payload, &mut at)?).map_err(|_| "length too large")?;
                let end = at
                    .checked_add(length)
                    .filter(|end| *end <= payload.len())
                    .ok_or("length past the end")?;
                if field == 1 {
                    entries.push(&payload[at..end]);
                }
                at = end;
            }
            other => return Err(format!("unsupported wire type {other}")),
        }
    }
    Ok(entries)
}

/// A batch message holding only `entry` (field 1).
pub fn single_entry_batch(entry: &[u8]) -> Vec<u8> {
    let mut message = Vec::with_capacity(entry.len() + 11);
    message.push(0x0a);
    let mut length = u64::try_from(entry.len()).unwrap_or(u64::MAX);
    loop {
        // The low seven bits, with the continuation bit when more follow.
        let byte = u8::try_from(length & 0x7f).unwrap_or(0);
        length >>= 7;
        if length == 0 {
            message.push(byte);
            break;
        }
        message.push(byte | 0x80);
    }
    message.extend_from_slice(entry);
    message
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

/// Keep checking, every `kafka.topic_check_interval`, that `specs` exist. A
/// broker that lost its log (an in-memory broker restarted, a topic deleted
/// by hand) would otherwise leave producers failing and consumers waiting
/// for ever: a missing topic is logged, created again when
/// `kafka.create_topics` is true, and readiness is NOT_SERVING until every
/// topic is back. Runs until `shutdown`.
pub async fn watch_topics(
    kafka: KafkaConfig,
    specs: Vec<TopicSpec>,
    readiness: crate::readiness::Readiness,
    shutdown: Shutdown,
) -> Result<(), KafkaPlumbingError> {
    const CONDITION: &str = "kafka topics";
    let admin: Arc<AdminClient<DefaultClientContext>> = Arc::new(client_config(&kafka).create()?);
    let mut timer = tokio::time::interval(kafka.topic_check_interval.0);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    timer.tick().await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = timer.tick() => {}
        }
        let counts = match fetch_partition_counts(&admin, &specs).await {
            Ok(counts) => counts,
            Err(error) => {
                tracing::debug!(%error, "checking topics failed (the broker may be away)");
                continue;
            }
        };
        let missing: Vec<TopicSpec> = specs
            .iter()
            .filter(|spec| !counts.contains_key(&spec.name))
            .cloned()
            .collect();
        if missing.is_empty() {
            readiness.clear(CONDITION);
            continue;
        }
        let names: Vec<&str> = missing.iter().map(|spec| spec.name.as_str()).collect();
        readiness.set(CONDITION, format!("missing: {}", names.join(", ")));
        if !kafka.create_topics {
            tracing::error!(topics = ?names, "topics are missing and kafka.create_topics is false: create them");
            continue;
        }
        tracing::warn!(topics = ?names, "topics are missing (did the broker lose its log?); creating them again");
        match ensure_topics(&kafka, &missing, true).await {
            Ok(_) => readiness.clear(CONDITION),
            Err(error) => tracing::warn!(%error, "creating the missing topics failed; retrying"),
        }
    }
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
    /// A client configuration without a group, for reading one offset of
    /// the partition (`holds_offset`).
    probe: Arc<ClientConfig>,
    topic: Arc<str>,
    partition: i32,
    /// The last offset stored (next to read), -1 before the first store: where
    /// a restarted task resumes.
    stored: Arc<std::sync::atomic::AtomicI64>,
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

/// The messages of one assigned partition, in offset order. Bounded by bytes
/// (`kafka.consumer_buffer_bytes`): the consumer waits to hand over more
/// until the task has taken enough out.
pub struct PartitionMessages {
    receiver: mpsc::Receiver<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    budget: Arc<tokio::sync::Semaphore>,
    capacity: usize,
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
    assignments: Assignments,
}

/// How many times the group assigned each partition to this member: a task
/// standing by for a partition (a newer owner fenced it while it stayed
/// assigned here) takes it over again when the group assigns it here anew.
#[derive(Clone, Debug, Default)]
pub struct Assignments(Arc<Mutex<HashMap<i32, u64>>>);

impl Assignments {
    fn assigned(&self, partition: i32) {
        *self
            .0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .entry(partition)
            .or_default() += 1;
    }

    /// How many times `partition` was assigned here so far.
    pub fn count(&self, partition: i32) -> u64 {
        self.0
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(&partition)
            .copied()
            .unwrap_or_default()
    }
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
                self.assignments.assigned(element.partition());
            }
            tracing::debug!(topic = %self.topic, assigned = list.count(), "partitions assigned");
        }
    }
}

pub struct ConsumerOptions {
    pub group: String,
    pub topic: String,
    pub channel_capacity: usize,
    /// Report partition ends (`ConsumerProgress`); costs nothing when idle.
    pub track_end: bool,
    /// Where a failed partition task is reported (NOT_SERVING until it runs again).
    pub readiness: crate::readiness::Readiness,
}

/// Consume `topic` in `group`, one task per assigned partition, until
/// shutdown or a crash. A crash (fault hooks) stops everything. A partition
/// task that fails — it returned an error, or it panicked — is restarted
/// after a backoff (1 s, doubling to 30 s) from its last stored offset, and
/// readiness is NOT_SERVING until the restarted task has run for as long as
/// the backoff: no partition stays stopped.
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

/// A partition whose task ended while the consumer still has it assigned
/// is started again after a delay: the first time `RETAKE_FIRST`, doubling
/// for each end within `RETAKE_FORGET` of the last, up to `RETAKE_MAX`.
/// (A task fenced by a newer owner does not end: it stands by until that
/// owner lets the partition go, `owner.rs`, so two members that both hold a
/// partition during an overlapping rebalance do not take it from each other
/// back and forth.)
const RETAKE_FIRST: Duration = Duration::from_millis(500);
const RETAKE_MAX: Duration = Duration::from_secs(8);
const RETAKE_FORGET: Duration = Duration::from_secs(30);

/// The fences each partition met lately (`RETAKE_FIRST`).
#[derive(Debug, Default)]
struct FenceRetakes {
    recent: HashMap<i32, (u32, tokio::time::Instant)>,
}

impl FenceRetakes {
    /// `partition` was just given up to a newer owner: how long to wait
    /// before taking it over again.
    fn delay(&mut self, partition: i32, now: tokio::time::Instant) -> Duration {
        let (count, last) = self.recent.entry(partition).or_insert((0, now));
        if now.saturating_duration_since(*last) > RETAKE_FORGET {
            *count = 0;
        }
        *count = count.saturating_add(1);
        *last = now;
        let doublings = (*count - 1).min(16);
        RETAKE_FIRST.saturating_mul(1u32 << doublings).min(RETAKE_MAX)
    }
}

const RESTART_FIRST: Duration = Duration::from_secs(1);
const RESTART_MAX: Duration = Duration::from_secs(30);

/// A partition whose task failed: when to start it again, and from where.
struct Restart {
    at: tokio::time::Instant,
    backoff: Duration,
    resume_from: Option<i64>,
    /// The ended task's first offset, read again at the restart when it
    /// stored none: its partition's reader may have taken a message (and
    /// let it go) after the task ended.
    first_offset: Option<Arc<std::sync::atomic::AtomicI64>>,
}

/// The readiness condition of a failed partition task.
fn task_condition(topic: &str, partition: i32) -> String {
    format!("{topic} partition {partition}")
}

/// The consumer of one group member, configured for partition tasks: its
/// own offsets stored by the tasks and committed in the background,
/// cooperative rebalances, and librdkafka's prefetch bounded like ours.
fn member_consumer(
    kafka: &KafkaConfig,
    options: &ConsumerOptions,
    context: RebalanceContext,
) -> Result<StreamConsumer<RebalanceContext>, KafkaPlumbingError> {
    let buffer_bytes = kafka.consumer_buffer_bytes.max(1);
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
        // librdkafka's prefetch queue, bounded like ours.
        .set("queued.max.messages.kbytes", (buffer_bytes / 1024).max(1).to_string())
        .set("enable.partition.eof", if options.track_end { "true" } else { "false" })
        // A member that rejoined while its topic was gone (a broker that
        // lost its log) is assigned nothing, and only notices the topic
        // created again on its next metadata refresh, which triggers a
        // rebalance. librdkafka's 5-minute default would leave the topic
        // unconsumed that long; refresh as often as topics are checked.
        .set(
            "topic.metadata.refresh.interval.ms",
            kafka
                .topic_check_interval
                .0
                .as_millis()
                .clamp(1_000, 300_000)
                .to_string(),
        )
        .set("statistics.interval.ms", "15000");
    for (key, value) in &kafka.properties {
        client.set(key, value);
    }
    Ok(client.create_with_context(context)?)
}

/// A partition task of this member, as the dispatch loop sees it.
struct Running {
    sender: mpsc::Sender<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    budget: Arc<tokio::sync::Semaphore>,
    stop: CancellationToken,
    /// The first offset handed to the task (where it resumed); -1: none yet.
    first_offset: Arc<std::sync::atomic::AtomicI64>,
    stored: Arc<std::sync::atomic::AtomicI64>,
    started_at: tokio::time::Instant,
    /// Set while the task is behind: the partition is paused in the
    /// consumer and its messages queue here, in order, for a forwarder
    /// that waits for room (`park`).
    parked: Option<Parked>,
}

impl Running {
    /// Where a successor must resume: the last stored offset, else the
    /// first offset this task was given.
    fn resume_point(&self) -> Option<i64> {
        let stored = self.stored.load(std::sync::atomic::Ordering::Relaxed);
        let first = self.first_offset.load(std::sync::atomic::Ordering::Relaxed);
        if stored >= 0 {
            Some(stored)
        } else {
            (first >= 0).then_some(first)
        }
    }
}

type Finished = (i32, Result<(), PartitionTaskError>);
/// (partition, park session, messages forwarded): a parked partition's
/// forwarder has handed over everything it was given.
type CaughtUp = (i32, u64, u64);

/// One membership of the group: the consumer, the partition tasks, and
/// the dispatch loop's bookkeeping. Nothing in it waits on one partition.
struct Member<'a> {
    assignments: Assignments,
    options: &'a ConsumerOptions,
    factory: &'a Arc<dyn PartitionTaskFactory>,
    progress: &'a Arc<ConsumerProgress>,
    shutdown: &'a Shutdown,
    topic: Arc<str>,
    consumer: Arc<StreamConsumer<RebalanceContext>>,
    assigned: Arc<Mutex<HashSet<i32>>>,
    lost_since: Arc<Mutex<Option<std::time::Instant>>>,
    buffer_bytes: usize,
    probe: Arc<ClientConfig>,
    running: HashMap<i32, Running>,
    restarts: HashMap<i32, Restart>,
    fence_retakes: FenceRetakes,
    finished: mpsc::UnboundedSender<Finished>,
    caught_up: mpsc::UnboundedSender<CaughtUp>,
    park_sessions: u64,
    consumed_since_report: u64,
    topic_attribute: [opentelemetry::KeyValue; 1],
    /// Each partition's own queue in the consumer (`split_partition_queues`).
    queues: HashMap<i32, Arc<SplitQueue>>,
    /// The tasks reading them (awaited before the consumer is dropped).
    readers: Vec<tokio::task::JoinHandle<()>>,
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
    let assignments = Assignments::default();
    let context = RebalanceContext {
        topic: topic.clone(),
        assigned: assigned.clone(),
        progress: progress.clone(),
        lost_since: lost_since.clone(),
        assignments: assignments.clone(),
    };
    let consumer = Arc::new(member_consumer(kafka, options, context)?);
    let queues = split_partition_queues(&consumer, &topic).await;
    consumer.subscribe(&[&options.topic])?;
    let (finished_sender, mut finished) = mpsc::unbounded_channel::<Finished>();
    let (caught_up_sender, mut caught_up) = mpsc::unbounded_channel::<CaughtUp>();
    let mut member = Member {
        assignments,
        options,
        factory,
        progress,
        shutdown,
        topic_attribute: [opentelemetry::KeyValue::new("topic", topic.to_string())],
        topic,
        consumer: consumer.clone(),
        assigned,
        lost_since,
        buffer_bytes: kafka.consumer_buffer_bytes.max(1),
        probe: Arc::new(probe_config(kafka)),
        running: HashMap::new(),
        restarts: HashMap::new(),
        fence_retakes: FenceRetakes::default(),
        finished: finished_sender,
        caught_up: caught_up_sender,
        park_sessions: 0,
        consumed_since_report: 0,
        queues,
        readers: Vec::new(),
    };
    let mut reconcile_timer = tokio::time::interval(Duration::from_millis(100));
    reconcile_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let outcome = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break MemberEnd::Stopped,
            Some((partition, outcome)) = finished.recv() => {
                if let Some(end) = member.task_finished(partition, outcome) {
                    break end;
                }
            }
            Some((partition, session, forwarded)) = caught_up.recv() => {
                member.caught_up(partition, session, forwarded);
            }
            _ = reconcile_timer.tick() => {
                if let Some(end) = member.reconcile(rejoin_within).await {
                    break end;
                }
            }
            received = consumer.recv() => match received {
                Ok(message) => member.dispatch(message),
                Err(KafkaError::PartitionEOF(partition)) => {
                    progress.update(partition, |state| {
                        state.at_end = true;
                        state.reached_end_at = Some(std::time::Instant::now());
                    });
                }
                Err(error) => tracing::warn!(topic = %member.topic, %error, "consumer error"),
            },
        }
    };
    drop(consumer);
    member.leave(&outcome, &mut finished).await;
    Ok(outcome)
}

impl Member<'_> {
    fn start_task(&mut self, partition: i32) {
        let (sender, receiver) = mpsc::channel(self.options.channel_capacity.max(1));
        let stop = self.shutdown.token().child_token();
        let stored = Arc::new(std::sync::atomic::AtomicI64::new(-1));
        let budget = Arc::new(tokio::sync::Semaphore::new(self.buffer_bytes));
        let input = PartitionInput {
            topic: self.topic.clone(),
            partition,
            messages: PartitionMessages {
                receiver,
                budget: budget.clone(),
                capacity: self.buffer_bytes,
            },
            stop: stop.clone(),
            offsets: OffsetStore {
                consumer: Arc::downgrade(&self.consumer),
                probe: self.probe.clone(),
                topic: self.topic.clone(),
                partition,
                stored: stored.clone(),
            },
            max_batch_bytes: self.buffer_bytes,
            assignments: self.assignments.clone(),
        };
        let task = self.factory.start(input);
        // A partition paused for an earlier task that fell behind.
        pause_or_resume(&self.consumer, &self.topic, partition, false);
        let first_offset = Arc::new(std::sync::atomic::AtomicI64::new(-1));
        if let Some(queue) = self.queues.get(&partition) {
            self.readers.retain(|reader| !reader.is_finished());
            self.readers.push(tokio::spawn(read_split_queue(SplitReader {
                topic: self.topic.clone(),
                partition,
                queue: queue.clone(),
                sender: sender.clone(),
                budget: budget.clone(),
                buffer_bytes: self.buffer_bytes,
                channel_capacity: self.options.channel_capacity.max(1),
                stop: stop.clone(),
                first_offset: first_offset.clone(),
                progress: self.options.track_end.then(|| self.progress.clone()),
                topic_attribute: self.topic_attribute.clone(),
            })));
        }
        let finished = self.finished.clone();
        tokio::spawn(async move {
            let outcome = match std::panic::AssertUnwindSafe(task).catch_unwind().await {
                Ok(outcome) => outcome,
                Err(panic) => Err(PartitionTaskError::Stopped {
                    partition,
                    reason: format!("panicked: {}", crate::fault::panic_message(panic.as_ref())),
                }),
            };
            let _ = finished.send((partition, outcome));
        });
        tracing::debug!(topic = %self.topic, partition, "partition task started");
        self.running.insert(
            partition,
            Running {
                sender,
                budget,
                stop,
                first_offset,
                stored,
                started_at: tokio::time::Instant::now(),
                parked: None,
            },
        );
    }

    /// A partition task ended. A crash stops the member; a failure is
    /// restarted after a backoff; a task that gave its partition up to a
    /// newer owner is started again after the retake delay if the
    /// partition is still assigned here.
    fn task_finished(&mut self, partition: i32, outcome: Result<(), PartitionTaskError>) -> Option<MemberEnd> {
        match outcome {
            Err(PartitionTaskError::Crashed) => {
                self.shutdown.crash();
                return Some(MemberEnd::Stopped);
            }
            Err(PartitionTaskError::Stopped { reason, .. }) => {
                let entry = self.running.remove(&partition)?;
                entry.stop.cancel();
                let backoff = self.restarts.get(&partition).map_or(RESTART_FIRST, |previous| {
                    (previous.backoff * 2).clamp(RESTART_FIRST, RESTART_MAX)
                });
                let resume_from = entry.resume_point();
                tracing::error!(
                    topic = %self.topic,
                    partition,
                    %reason,
                    ?resume_from,
                    ?backoff,
                    "partition task failed; restarting it from its last stored offset"
                );
                self.options.readiness.set(
                    task_condition(&self.topic, partition),
                    format!("task failed ({reason}); restarting"),
                );
                self.restarts.insert(
                    partition,
                    Restart {
                        at: tokio::time::Instant::now() + backoff,
                        backoff,
                        resume_from,
                        first_offset: Some(entry.first_offset.clone()),
                    },
                );
            }
            Ok(()) => {
                // Revoked (the next reconcile forgets it), or its input
                // ended: if the partition is still assigned here, a
                // reconcile after the retake delay starts it again, from
                // what this task had stored.
                let entry = self.running.remove(&partition)?;
                if !entry.stop.is_cancelled() {
                    let now = tokio::time::Instant::now();
                    let delay = self.fence_retakes.delay(partition, now);
                    tracing::info!(topic = %self.topic, partition, ?delay, "partition task ended while assigned; starting it again after the delay");
                    self.restarts.entry(partition).or_insert(Restart {
                        at: now + delay,
                        backoff: Duration::ZERO,
                        resume_from: entry.resume_point(),
                        first_offset: Some(entry.first_offset.clone()),
                    });
                }
            }
        }
        None
    }

    /// A parked partition's forwarder handed over everything of `session`
    /// it was given: if nothing came since, resume the partition.
    fn caught_up(&mut self, partition: i32, session: u64, forwarded: u64) {
        let Some(entry) = self.running.get_mut(&partition) else {
            return;
        };
        let done = entry
            .parked
            .as_ref()
            .is_some_and(|parked| parked.session == session && parked.pushed == forwarded);
        if done {
            // Everything queued was handed over: the task has room again,
            // and messages go straight to it.
            entry.parked = None;
            pause_or_resume(&self.consumer, &self.topic, partition, false);
            tracing::debug!(topic = %self.topic, partition, "partition caught up; resumed");
        }
    }

    /// Every tick: leave a membership lost for too long, report the
    /// consumed count, stop the tasks of partitions no longer assigned and
    /// start (or restart, when due) those of assigned ones.
    async fn reconcile(&mut self, rejoin_within: Duration) -> Option<MemberEnd> {
        let lost_for = self
            .lost_since
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .map(|since| since.elapsed());
        if lost_for.is_some_and(|lost_for| lost_for >= rejoin_within) {
            return Some(MemberEnd::MembershipLost);
        }
        self.report_consumed(0);
        let current: HashSet<i32> = self
            .assigned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        self.running.retain(|partition, entry| {
            let keep = current.contains(partition);
            if !keep {
                entry.stop.cancel();
            }
            keep
        });
        let (readiness, topic) = (&self.options.readiness, self.topic.clone());
        self.restarts.retain(|partition, _| {
            let keep = current.contains(partition);
            if !keep {
                readiness.clear(&task_condition(&topic, *partition));
            }
            keep
        });
        let now = tokio::time::Instant::now();
        for partition in current {
            if self.running.contains_key(&partition) {
                continue;
            }
            match self.restarts.get_mut(&partition) {
                Some(restart) if restart.at > now => continue,
                Some(restart) => {
                    let late_first = restart
                        .first_offset
                        .take()
                        .map(|first| first.load(std::sync::atomic::Ordering::Relaxed))
                        .filter(|first| *first >= 0);
                    if let Some(offset) = restart.resume_from.take().or(late_first) {
                        seek(&self.consumer, &self.topic, partition, offset).await;
                    }
                }
                None => {}
            }
            self.start_task(partition);
        }
        // A restarted task that has run as long as its backoff is healthy again.
        let running = &self.running;
        self.restarts.retain(|partition, restart| {
            let healthy = running
                .get(partition)
                .is_some_and(|entry| entry.started_at + restart.backoff <= now && restart.at <= entry.started_at);
            if healthy {
                readiness.clear(&task_condition(&topic, *partition));
            }
            !healthy
        });
        None
    }

    /// Add the messages consumed since the last report to the metric, if
    /// more than `more_than`.
    fn report_consumed(&mut self, more_than: u64) {
        if self.consumed_since_report > more_than {
            crate::metrics::metrics()
                .consumed
                .add(self.consumed_since_report, &self.topic_attribute);
            self.consumed_since_report = 0;
        }
    }

    /// Hand a message of the shared queue to its partition's task without
    /// waiting: straight into the task's channel when it has room, else
    /// through the partition's forwarder, pausing the partition (only it
    /// waits). Only partitions without a queue of their own come here
    /// (`split_partition_queues`: the topic grew since the member joined).
    fn dispatch(&mut self, message: BorrowedMessage<'_>) {
        let partition = message.partition();
        let is_assigned = self
            .assigned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(&partition);
        if !is_assigned {
            return;
        }
        if self.options.track_end {
            self.progress.update(partition, |state| state.at_end = false);
        }
        self.consumed_since_report += 1;
        self.report_consumed(255);
        if let Some(restart) = self
            .restarts
            .get_mut(&partition)
            .filter(|restart| restart.at > tokio::time::Instant::now())
        {
            // Its task is waiting to restart; it re-reads from its last
            // stored offset (or this one) then.
            restart.resume_from.get_or_insert(message.offset());
            return;
        }
        if !self.running.contains_key(&partition) {
            self.start_task(partition);
        }
        let detached = InMsg::from_borrowed(&message);
        drop(message);
        let Some(entry) = self.running.get_mut(&partition) else {
            return;
        };
        if entry
            .first_offset
            .compare_exchange(
                -1,
                detached.offset,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
        {
            tracing::info!(topic = %self.topic, partition, offset = detached.offset, "partition resumed");
        }
        if let Some(parked) = entry.parked.as_mut() {
            parked.pushed += 1;
            let _ = parked.overflow.send(detached);
            return;
        }
        let cost = message_cost(&detached, self.buffer_bytes);
        let refused = match entry.budget.clone().try_acquire_many_owned(cost) {
            Ok(permit) => match entry.sender.try_send((detached, permit)) {
                Ok(()) => None,
                Err(mpsc::error::TrySendError::Full((detached, _permit))) => Some(detached),
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    tracing::debug!(topic = %self.topic, partition, "partition task gone; message left for the next owner");
                    None
                }
            },
            Err(tokio::sync::TryAcquireError::NoPermits) => Some(detached),
            Err(tokio::sync::TryAcquireError::Closed) => None,
        };
        if let Some(detached) = refused {
            self.park_sessions += 1;
            entry.parked = Some(park(
                ParkedTask {
                    partition,
                    session: self.park_sessions,
                    sender: entry.sender.clone(),
                    budget: entry.budget.clone(),
                    stop: entry.stop.clone(),
                    buffer_bytes: self.buffer_bytes,
                    caught_up: self.caught_up.clone(),
                },
                detached,
            ));
            pause_or_resume(&self.consumer, &self.topic, partition, true);
            tracing::debug!(topic = %self.topic, partition, "partition task behind; paused the partition");
        }
    }

    /// Stop the tasks; at a clean stop, wait for them to end (each stores
    /// its last offset as it stops) and commit the stored offsets; then
    /// leave the group. Every wait is bounded, and none blocks the runtime.
    async fn leave(self, outcome: &MemberEnd, finished: &mut mpsc::UnboundedReceiver<Finished>) {
        let Member {
            options,
            shutdown,
            topic,
            consumer,
            running,
            restarts,
            queues,
            readers,
            ..
        } = self;
        for entry in running.values() {
            entry.stop.cancel();
        }
        for partition in restarts.keys() {
            options.readiness.clear(&task_condition(&topic, *partition));
        }
        if matches!(outcome, MemberEnd::Stopped) && !shutdown.is_crashed() {
            let mut left: HashSet<i32> = running.keys().copied().collect();
            let all_ended = tokio::time::timeout(TASKS_END_TIMEOUT, async {
                while !left.is_empty() {
                    match finished.recv().await {
                        Some((partition, _)) => {
                            left.remove(&partition);
                        }
                        None => break,
                    }
                }
            })
            .await;
            if all_ended.is_err() {
                tracing::warn!(topic = %topic, "partition tasks still running {TASKS_END_TIMEOUT:?} after the stop; committing what they stored");
            }
            commit_stored_offsets(&consumer, &topic).await;
        }
        // The split queues hold the consumer too: its last reference must
        // be dropped below, off the runtime.
        drop(queues);
        if tokio::time::timeout(TASKS_END_TIMEOUT, futures::future::join_all(readers))
            .await
            .is_err()
        {
            tracing::warn!(topic = %topic, "partition queue readers still running {TASKS_END_TIMEOUT:?} after the stop");
        }
        consumer.unsubscribe();
        // Closing waits for the group to acknowledge the leave: do it off
        // the async runtime, and not for ever (a broker that is gone never
        // answers). Offset stores hold the consumer weakly, so this is the
        // last strong reference.
        let closed = tokio::time::timeout(CLOSE_TIMEOUT, tokio::task::spawn_blocking(move || drop(consumer))).await;
        match closed {
            Ok(Ok(())) => {}
            Ok(Err(error)) if error.is_panic() => {
                tracing::warn!(topic = %topic, %error, "closing the consumer panicked")
            }
            Ok(Err(error)) => tracing::debug!(topic = %topic, %error, "closing the consumer was cut short"),
            Err(_) => {
                tracing::warn!(topic = %topic, "closing the consumer did not finish within {CLOSE_TIMEOUT:?}; going on")
            }
        }
    }
}

/// Commit the stored offsets synchronously, off the async runtime (it
/// waits for the broker), for at most `CLOSE_TIMEOUT`.
async fn commit_stored_offsets(consumer: &Arc<StreamConsumer<RebalanceContext>>, topic: &str) {
    let committing = consumer.clone();
    let committed = tokio::time::timeout(
        CLOSE_TIMEOUT,
        tokio::task::spawn_blocking(move || committing.commit_consumer_state(rdkafka::consumer::CommitMode::Sync)),
    )
    .await;
    match committed {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(error))) => tracing::debug!(%error, "final offset commit"),
        Ok(Err(error)) => tracing::debug!(%error, "final offset commit was cut short"),
        Err(_) => tracing::warn!(topic = %topic, "the final offset commit did not finish within {CLOSE_TIMEOUT:?}"),
    }
}

/// How long leaving a consumer group may take at shutdown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a member waits for its partition tasks to end at a stop.
const TASKS_END_TIMEOUT: Duration = Duration::from_secs(10);

/// A parked partition, as the dispatch loop sees it (`park`).
struct Parked {
    session: u64,
    /// Messages for the forwarder, in order.
    overflow: mpsc::UnboundedSender<InMsg>,
    /// How many it was given (the forwarder reports how many it handed on).
    pushed: u64,
}

/// What a parked partition's forwarder needs.
struct ParkedTask {
    partition: i32,
    session: u64,
    sender: mpsc::Sender<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    budget: Arc<tokio::sync::Semaphore>,
    stop: CancellationToken,
    buffer_bytes: usize,
    caught_up: mpsc::UnboundedSender<(i32, u64, u64)>,
}

/// A partition's own queue in a member's consumer, read by one task at a
/// time (the reader of the partition's current task).
type SplitQueue = tokio::sync::Mutex<StreamPartitionQueue<RebalanceContext>>;

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
async fn split_partition_queues(
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
struct SplitReader {
    topic: Arc<str>,
    partition: i32,
    queue: Arc<SplitQueue>,
    sender: mpsc::Sender<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    budget: Arc<tokio::sync::Semaphore>,
    buffer_bytes: usize,
    channel_capacity: usize,
    stop: CancellationToken,
    first_offset: Arc<std::sync::atomic::AtomicI64>,
    /// Set when partition ends are reported (`ConsumerOptions::track_end`).
    progress: Option<Arc<ConsumerProgress>>,
    topic_attribute: [opentelemetry::KeyValue; 1],
}

/// Hand the messages of a partition's own queue to its task, in order,
/// each once the task has room (its byte budget and channel): while it has
/// none, nothing more is taken from the queue, and librdkafka stops
/// fetching the partition once the queue is full. The first time the task
/// is behind, a warning says so with the figures; every time, the counter
/// `sluice_kafka_partition_behind` goes up.
async fn read_split_queue(reader: SplitReader) {
    let SplitReader {
        topic,
        partition,
        queue,
        sender,
        budget,
        buffer_bytes,
        channel_capacity,
        stop,
        first_offset,
        progress,
        topic_attribute,
    } = reader;
    // The reader of an earlier task of the partition lets go when stopped.
    let queue = tokio::select! {
        biased;
        _ = stop.cancelled() => return,
        queue = queue.lock() => queue,
    };
    let mut warned = false;
    loop {
        let received = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            // The task ended (its successor's reader waits for the queue).
            () = sender.closed() => return,
            received = queue.recv() => received,
        };
        let message = match received {
            Ok(message) => InMsg::from_borrowed(&message),
            Err(KafkaError::PartitionEOF(_)) => {
                if let Some(progress) = &progress {
                    progress.update(partition, |state| {
                        state.at_end = true;
                        state.reached_end_at = Some(std::time::Instant::now());
                    });
                }
                continue;
            }
            Err(error) => {
                tracing::warn!(topic = %topic, partition, %error, "consumer error");
                continue;
            }
        };
        if let Some(progress) = &progress {
            progress.update(partition, |state| state.at_end = false);
        }
        crate::metrics::metrics().consumed.add(1, &topic_attribute);
        if first_offset
            .compare_exchange(
                -1,
                message.offset,
                std::sync::atomic::Ordering::Relaxed,
                std::sync::atomic::Ordering::Relaxed,
            )
            .is_ok()
        {
            tracing::info!(topic = %topic, partition, offset = message.offset, "partition resumed");
        }
        let cost = message_cost(&message, buffer_bytes);
        let permit = match budget.clone().try_acquire_many_owned(cost) {
            Ok(permit) => Some(permit),
            Err(tokio::sync::TryAcquireError::Closed) => return,
            Err(tokio::sync::TryAcquireError::NoPermits) => None,
        };
        let behind = permit.is_none() || sender.capacity() == 0;
        if behind {
            crate::metrics::metrics().partition_behind.add(1, &topic_attribute);
            if !warned {
                warned = true;
                tracing::warn!(
                    topic = %topic,
                    partition,
                    offset = message.offset,
                    waiting_messages = channel_capacity.saturating_sub(sender.capacity()),
                    channel_capacity,
                    waiting_bytes = buffer_bytes.saturating_sub(budget.available_permits()),
                    buffer_bytes,
                    "the partition's task is behind: its buffer is full (kafka.consumer_buffer_bytes, or the \
                     channel), so the partition is fetched as the task catches up (said once per task; counted \
                     in sluice_kafka_partition_behind)"
                );
            }
        }
        let permit = match permit {
            Some(permit) => permit,
            None => tokio::select! {
                biased;
                _ = stop.cancelled() => return,
                permit = budget.clone().acquire_many_owned(cost) => match permit {
                    Ok(permit) => permit,
                    Err(_) => return,
                },
            },
        };
        let sent = tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            sent = sender.send((message, permit)) => sent,
        };
        if sent.is_err() {
            return;
        }
    }
}

/// A message's share of its partition's byte budget.
fn message_cost(message: &InMsg, buffer_bytes: usize) -> u32 {
    u32::try_from(message.size().clamp(1, buffer_bytes)).unwrap_or(u32::MAX)
}

/// Park a partition whose task is behind: a forwarder of its own hands
/// `first`, then whatever the dispatch loop queues after it, to the task in
/// order as room frees (waiting on the budget and the channel, which the
/// dispatch loop never does), and reports each time it has handed over
/// everything it was given. The caller pauses the partition in the
/// consumer, so what queues here is at most what was already fetched.
fn park(task: ParkedTask, first: InMsg) -> Parked {
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
fn pause_or_resume(consumer: &StreamConsumer<RebalanceContext>, topic: &str, partition: i32, pause: bool) {
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

/// Point the consumer's position for `partition` at `offset` (a restarted
/// task re-reads what its failed predecessor had not stored).
async fn seek(consumer: &Arc<StreamConsumer<RebalanceContext>>, topic: &Arc<str>, partition: i32, offset: i64) {
    let consumer = consumer.clone();
    let name = topic.clone();
    let sought = tokio::task::spawn_blocking(move || {
        consumer.seek(&name, partition, Offset::Offset(offset), Duration::from_secs(5))
    })
    .await;
    match sought {
        Ok(Ok(())) => tracing::info!(topic = %topic, partition, offset, "re-reading from the last stored offset"),
        Ok(Err(error)) => {
            tracing::warn!(topic = %topic, partition, offset, %error, "seek failed; the next owner re-reads from the committed offset")
        }
        Err(_join) => {}
    }
}

/// A consumed message's header as text, lossily ("" when it has none of
/// that name): dead letters' reason, class and source, for readers.
pub fn message_header<M: rdkafka::Message>(message: &M, name: &str) -> String {
    use rdkafka::message::Headers as _;
    message
        .headers()
        .and_then(|headers| {
            headers
                .iter()
                .find(|header| header.key == name)
                .and_then(|header| header.value)
        })
        .map(|value| String::from_utf8_lossy(value).into_owned())
        .unwrap_or_default()
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
    fn a_partition_fenced_again_and_again_is_taken_over_again_ever_later() {
        let mut retakes = FenceRetakes::default();
        let start = tokio::time::Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        assert_eq!(retakes.delay(4, at(0)), Duration::from_millis(500));
        assert_eq!(retakes.delay(4, at(700)), Duration::from_secs(1));
        assert_eq!(retakes.delay(4, at(2_000)), Duration::from_secs(2));
        assert_eq!(retakes.delay(4, at(4_500)), Duration::from_secs(4));
        assert_eq!(retakes.delay(4, at(9_000)), RETAKE_MAX);
        assert_eq!(retakes.delay(4, at(18_000)), RETAKE_MAX);
        // Another partition counts apart; a quiet spell starts over.
        assert_eq!(retakes.delay(5, at(18_000)), RETAKE_FIRST);
        assert_eq!(retakes.delay(4, at(18_000 + 31_000)), RETAKE_FIRST);
    }

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
