//! Layered configuration: embedded `default.toml`, then an optional file, then
//! `SLUICE__SECTION__KEY` environment variables. Unknown keys are refused,
//! except settings an earlier release read (`removed`: ignored, with a
//! warning), and `validate()` runs after loading.

mod load;
mod removed;
mod sections;
mod validate;

pub use removed::RemovedSetting;
pub use sections::{
    AdmissionConfig, AuthConfig, CapConfig, CapScope, ClientCertificatePrincipal, ConsoleConfig, KafkaConfig,
    LogFormat, OwnerServiceConfig, PartitionCounts, PostgresConfig, ProcessConfig, RefreshDispatcherConfig,
    TaskGroupConfig, TelemetryConfig, TlsConfig, TopicsConfig,
};

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

const DEFAULT_TOML: &str = include_str!("default.toml");

/// The largest payload when `admission.max_payload_bytes` is 0 and
/// `kafka.max_message_bytes` leaves room for it (960 KiB).
const DEFAULT_MAX_PAYLOAD_BYTES: usize = 983_040;

/// What `sluice dev` changes in the defaults (a file or the environment
/// still wins).
const DEV_TOML: &str = "[auth]\nenabled = false\n";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot load configuration: {0}")]
    Load(#[from] config::ConfigError),
    #[error("invalid configuration: {field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        message: message.into(),
    }
}

/// A string that must not be printed: `Debug` shows `***`.
#[derive(Clone, Default, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Secret(value.into())
    }
    pub fn expose(&self) -> &str {
        &self.0
    }
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("***")
    }
}

/// A duration written as "500ms", "30s", "1h", "7d".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HumanDuration(pub Duration);

impl HumanDuration {
    pub fn as_millis_i64(&self) -> i64 {
        i64::try_from(self.0.as_millis()).unwrap_or(i64::MAX)
    }
}

impl<'de> Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        parse_duration(&text)
            .map(HumanDuration)
            .map_err(serde::de::Error::custom)
    }
}

/// Parses "90s", "1h", "7d", "500ms", "1h30m". Refuses empty and unit-less input.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let trimmed = text.trim();
    if trimmed.is_empty() {
        return Err("empty duration".to_string());
    }
    humantime::parse_duration(trimmed)
        .map_err(|error| format!("malformed duration {trimmed:?} ({error}); use e.g. 90s, 15m, 1h, 7d"))
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SluiceConfig {
    pub postgres: PostgresConfig,
    pub kafka: KafkaConfig,
    pub topics: TopicsConfig,
    pub telemetry: TelemetryConfig,
    pub admission: AdmissionConfig,
    pub limit_grant: OwnerServiceConfig,
    pub rate_window: OwnerServiceConfig,
    pub refresh_dispatcher: RefreshDispatcherConfig,
    pub task_groups: BTreeMap<String, TaskGroupConfig>,
    pub process: ProcessConfig,
    pub console: ConsoleConfig,
    pub tls: TlsConfig,
    pub auth: AuthConfig,
    /// Settings of an earlier release found while loading (ignored).
    #[serde(skip)]
    removed_settings: Vec<RemovedSetting>,
}

impl SluiceConfig {
    /// When a waiting job's pending acquire is sent again (the interval then
    /// doubles with the time waited). Every loss the services detect — a
    /// broken link, an owner change, a rebalance — re-sends at once and is
    /// over within about two session timeouts; this backstop covers what
    /// nothing detects, so by default it is `2 × kafka.session_timeout_ms`
    /// (12 s).
    pub fn resend_waiting_after(&self) -> HumanDuration {
        self.admission
            .resend_waiting_after
            .unwrap_or_else(|| self.session_timeouts(2))
    }

    /// When an admitted job nobody claimed is published (or pushed) again
    /// (the interval then doubles with the time since it was admitted). A
    /// worker group's rebalance ends within a few session timeouts, so by
    /// default it is `5 × kafka.session_timeout_ms` (30 s).
    pub fn claim_timeout(&self) -> HumanDuration {
        self.admission.claim_timeout.unwrap_or_else(|| self.session_timeouts(5))
    }

    /// When an admitted job that sits unclaimed on its task group's topic
    /// while a job of the group published after it was claimed is published
    /// again under a new key (its partition's consumer is dead or behind; at
    /// most twice per attempt): `kafka.session_timeout_ms / 2` (3 s), long
    /// enough that consumers of a healthy group, which read their partitions
    /// at about the same pace, are not taken for stuck.
    pub fn claim_overtaken_after(&self) -> HumanDuration {
        HumanDuration(Duration::from_millis(u64::from(self.kafka.session_timeout_ms) / 2))
    }

    /// `times` × `kafka.session_timeout_ms`.
    fn session_timeouts(&self, times: u64) -> HumanDuration {
        HumanDuration(Duration::from_millis(times * u64::from(self.kafka.session_timeout_ms)))
    }

    /// The most bytes an admitted job's message adds to its payload: the
    /// `AdmittedJob` fields (job id, tenant, task group, numbers), its key
    /// (`<job id>/<attempt>`), the trace-context and content-type headers,
    /// and the record's own overhead.
    pub fn admitted_envelope_bytes(&self) -> usize {
        let ids = 2 * (crate::validate::MAX_ID_BYTES + 16);
        let task_group = crate::validate::MAX_ID_BYTES;
        let headers = crate::telemetry::MAX_TRACESTATE_BYTES + 256;
        ids + task_group + self.admission.max_key_bytes + headers + 512
    }

    /// The topic a tenant listed in `topics.tenant_requested` writes its
    /// requests to (before the prefix).
    pub fn tenant_requested_topic(&self, tenant: &str) -> String {
        format!("{}.{tenant}", self.topics.requested)
    }

    /// The full name of a topic after the configured prefix.
    pub fn topic(&self, name: &str) -> String {
        format!("{}{}", self.kafka.topic_prefix, name)
    }

    pub fn admitted_topic(&self, task_group: &str) -> String {
        self.topic(&format!("{}{}", self.topics.admitted_prefix, task_group))
    }

    /// The consumer group after the configured prefix.
    pub fn group(&self, name: &str) -> String {
        format!("{}{}", self.kafka.topic_prefix, name)
    }

    pub fn schema(&self, service: &str) -> String {
        format!("{}{}", self.postgres.schema_prefix, service)
    }
}

#[cfg(test)]
mod tests;
