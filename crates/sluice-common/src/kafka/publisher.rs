//! Producing: the idempotent producer that awaits every delivery
//! (`Publisher`), rebuilt when it turns fatal.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};

use super::{client_config, KafkaPlumbingError, OutMsg};
use crate::config::KafkaConfig;

/// `kafka.producer_properties`, applied last to a producer's settings.
pub fn apply_producer_properties(client: &mut ClientConfig, kafka: &KafkaConfig) {
    for (key, value) in &kafka.producer_properties {
        client.set(key, value);
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
        // librdkafka's default, named: admission picks the key of an
        // admitted job published again so that it lands on a partition a
        // live worker consumes (sluice-admission's partition/overtaken.rs).
        .set("partitioner", "consistent_random")
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
