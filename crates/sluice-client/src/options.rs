//! Where the SDK finds Sluice: brokers, topic names, gRPC endpoints and the
//! consumer group. A small struct of its own, so an application never needs
//! the services' configuration to produce or to run a worker.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::config::RDKafkaLogLevel;
use rdkafka::ClientConfig;

/// Connection settings shared by [`crate::Producer`] and [`crate::Worker`].
///
/// The defaults match a local `make run` (`sluice dev`): broker on
/// 127.0.0.1:9092, admission on :50051, refresh-dispatcher on :50054, the
/// default topic names and no prefix.
#[derive(Clone, Debug)]
pub struct ClientOptions {
    /// Kafka bootstrap servers (`host:port,host:port`). Empty: no Kafka; the
    /// producer can then only enqueue over gRPC, and a worker cannot run.
    pub brokers: String,
    /// Prepended to every topic name and to the consumer group, as the
    /// services' `kafka.topic_prefix`.
    pub topic_prefix: String,
    /// Where producers put job requests (`topics.requested`).
    pub requested_topic: String,
    /// Admitted jobs of task group `g` are on `<admitted_topic_prefix>g`.
    pub admitted_topic_prefix: String,
    /// Refresh tasks of floating limits (`topics.refresh_tasks`).
    pub refresh_tasks_topic: String,
    /// Any admission instance (gRPC): enqueue, claim, heartbeat, complete.
    pub admission_endpoint: String,
    /// Any refresh-dispatcher instance (gRPC): `ReportRefresh`.
    pub refresh_endpoint: String,
    /// Workers of one fleet share this consumer group (after the prefix).
    /// The refresh handler uses `<group_id>.refresh`.
    pub group_id: String,
    /// librdkafka `fetch.wait.max.ms`. Real Kafka answers a waiting fetch as
    /// soon as data arrives, so 500 is fine there; the tansu broker sleeps it
    /// out on every fetch, so keep it small (5-25) against tansu.
    pub fetch_wait_max_ms: u32,
    /// librdkafka `linger.ms` of the producer.
    pub linger_ms: u32,
    /// Timeout of each gRPC call.
    pub request_timeout: Duration,
    /// Extra librdkafka settings of every client (security.protocol, sasl.*,
    /// ssl.*, ...), applied last.
    pub kafka_properties: BTreeMap<String, String>,
    /// Extra librdkafka settings of consumers only (session.timeout.ms,
    /// max.poll.interval.ms, ...), applied after `kafka_properties`.
    pub consumer_properties: BTreeMap<String, String>,
    /// CA certificates (PEM) trusted for `https://` endpoints (the
    /// services' `tls.ca_file`). `https://` needs it: no system roots are
    /// loaded.
    pub tls_ca_pem: Option<Vec<u8>>,
    /// Client certificate chain and key (PEM), for services that require
    /// client certificates (`tls.client_ca_file`).
    pub tls_identity_pem: Option<(Vec<u8>, Vec<u8>)>,
    /// The name to check in the services' certificates, whatever address is
    /// dialled (the services' `tls.server_name`; Work streams dial the
    /// instances' advertised addresses, pod IPs in Kubernetes).
    pub tls_server_name: Option<String>,
    /// The bearer token (a JWT) sent on every gRPC call, for services with
    /// `auth.enabled`; its claims name the tenants and roles it may use.
    pub bearer_token: Option<String>,
}

impl Default for ClientOptions {
    fn default() -> Self {
        ClientOptions {
            brokers: "127.0.0.1:9092".to_string(),
            topic_prefix: String::new(),
            requested_topic: "jobs.requested".to_string(),
            admitted_topic_prefix: "jobs.admitted.".to_string(),
            refresh_tasks_topic: "refresh.tasks".to_string(),
            admission_endpoint: "http://127.0.0.1:50051".to_string(),
            refresh_endpoint: "http://127.0.0.1:50054".to_string(),
            group_id: "sluice-workers".to_string(),
            fetch_wait_max_ms: 5,
            linger_ms: 5,
            request_timeout: Duration::from_secs(10),
            kafka_properties: BTreeMap::new(),
            consumer_properties: BTreeMap::new(),
            tls_ca_pem: None,
            tls_identity_pem: None,
            tls_server_name: None,
            bearer_token: None,
        }
    }
}

impl ClientOptions {
    /// The TLS settings and credentials of every channel.
    pub(crate) fn dial(&self) -> crate::error::Result<crate::grpc::Dial> {
        let bearer = match &self.bearer_token {
            None => None,
            Some(token) => Some(
                tonic::metadata::AsciiMetadataValue::try_from(format!("Bearer {}", token.trim())).map_err(|_| {
                    crate::error::Error::Config {
                        field: "bearer_token",
                        message: "must be printable ASCII".to_string(),
                    }
                })?,
            ),
        };
        Ok(crate::grpc::Dial {
            tls: self.tls(),
            bearer: crate::grpc::Bearer(bearer),
        })
    }

    /// The TLS settings of `https://` channels.
    pub(crate) fn tls(&self) -> tonic::transport::ClientTlsConfig {
        let mut tls = tonic::transport::ClientTlsConfig::new();
        if let Some(ca) = &self.tls_ca_pem {
            tls = tls.ca_certificate(tonic::transport::Certificate::from_pem(ca));
        }
        if let Some((cert, key)) = &self.tls_identity_pem {
            tls = tls.identity(tonic::transport::Identity::from_pem(cert, key));
        }
        if let Some(name) = &self.tls_server_name {
            tls = tls.domain_name(name.clone());
        }
        tls
    }

    /// Set one extra librdkafka property of every client.
    pub fn kafka_property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.kafka_properties.insert(name.into(), value.into());
        self
    }

    /// Set one extra librdkafka property of consumers.
    pub fn consumer_property(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.consumer_properties.insert(name.into(), value.into());
        self
    }

    /// The full name of the requested topic.
    pub fn requested_topic(&self) -> String {
        format!("{}{}", self.topic_prefix, self.requested_topic)
    }

    /// The full name of a task group's admitted topic.
    pub fn admitted_topic(&self, task_group: &str) -> String {
        format!("{}{}{}", self.topic_prefix, self.admitted_topic_prefix, task_group)
    }

    /// The full name of the refresh-task topic.
    pub fn refresh_tasks_topic(&self) -> String {
        format!("{}{}", self.topic_prefix, self.refresh_tasks_topic)
    }

    /// The consumer group of job workers.
    pub fn worker_group(&self) -> String {
        format!("{}{}", self.topic_prefix, self.group_id)
    }

    /// The consumer group of refresh handlers.
    pub fn refresh_group(&self) -> String {
        format!("{}{}.refresh", self.topic_prefix, self.group_id)
    }

    /// A librdkafka configuration with the brokers and the extra properties.
    pub(crate) fn kafka_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &self.brokers);
        config.set_log_level(RDKafkaLogLevel::Warning);
        for (name, value) in &self.kafka_properties {
            config.set(name, value);
        }
        config
    }

    /// A consumer configuration: manual offset store (an offset is stored only
    /// once its message is dealt with), auto-commit of stored offsets, the
    /// cooperative-sticky assignor.
    pub(crate) fn consumer_config(&self, group: &str) -> ClientConfig {
        let mut config = ClientConfig::new();
        config
            .set("bootstrap.servers", &self.brokers)
            .set("group.id", group)
            .set("enable.auto.commit", "true")
            .set("enable.auto.offset.store", "false")
            .set("auto.commit.interval.ms", "1000")
            .set("auto.offset.reset", "earliest")
            // Incremental rebalances: when a worker joins or dies, the
            // others keep their partitions and go on consuming
            // (docs/worker-protocol.md §1).
            .set("partition.assignment.strategy", "cooperative-sticky")
            // A killed worker's partitions move after this (librdkafka's
            // default is 45 s); heartbeats come from librdkafka's own
            // thread, so a busy handler does not miss them.
            .set("session.timeout.ms", "6000")
            .set("fetch.wait.max.ms", self.fetch_wait_max_ms.to_string());
        config.set_log_level(RDKafkaLogLevel::Warning);
        for (name, value) in self.kafka_properties.iter().chain(&self.consumer_properties) {
            config.set(name, value);
        }
        config
    }
}
