//! Kafka plumbing on rdkafka: client configuration, a publisher that awaits
//! every delivery, batched internal messages, topic setup, and one consumer
//! runtime that hands each assigned partition to its own task.
//!
//! Offsets: auto-commit is on but auto *store* is off; a partition task stores
//! an offset only after the message's effects are durable and published, so
//! only processed offsets are ever committed.

mod consumer;
mod input;
mod member;
mod offsets;
mod outbox;
mod publisher;
mod queues;
mod rebalance;
mod resume;
mod topics;

pub use consumer::{run_partitioned_consumer, ConsumerOptions};
pub use input::{
    next_batch, InMsg, Orphan, PartitionInput, PartitionMessages, PartitionTaskError, PartitionTaskFactory,
};
pub use offsets::{log_holds_offset, probe_config, OffsetStore};
pub use outbox::{batch_entries, single_entry_batch, Observations, OutMsg, Outbox, SendSpan, SpanValue};
pub use publisher::{apply_producer_properties, Publisher};
pub use rebalance::{Assignments, ConsumerProgress, PartitionProgress, RebalanceContext};
pub use topics::{ensure_topics, watch_topics, TopicSpec};

use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::error::KafkaError;

use crate::config::KafkaConfig;

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
mod tests;
