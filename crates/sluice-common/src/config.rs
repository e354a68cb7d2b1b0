//! Layered configuration: embedded `default.toml`, then an optional file, then
//! `SLUICE__SECTION__KEY` environment variables. Unknown keys are refused,
//! except settings an earlier release read (`removed`: ignored, with a
//! warning), and `validate()` runs after loading.

mod removed;

pub use removed::RemovedSetting;

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
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

/// `[auth]`: who may call the services (see `auth.rs`).
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// Refuse calls without credentials. On by default; `sluice dev` turns
    /// it off (and binds to loopback).
    pub enabled: bool,
    /// A secret (at least 16 printable characters) the services send on
    /// their calls to each other; every instance and the console read the
    /// same file. Required when auth is on.
    pub internal_token_file: String,
    /// A JWKS document (RSA, EC or Ed25519 public keys) verifying bearer
    /// tokens; a token's `kid` picks the key.
    pub jwks_file: String,
    /// PEM public keys (RSA, EC or Ed25519) verifying bearer tokens.
    #[serde(default, deserialize_with = "list_or_comma_separated")]
    pub public_key_files: Vec<String>,
    /// A token's `iss` must be this (required with keys).
    pub issuer: String,
    /// A token's `aud` must hold this (required with keys).
    pub audience: String,
    /// The claims listing a token's tenants and roles.
    pub tenants_claim: String,
    pub roles_claim: String,
    /// Clock skew allowed on `exp` and `nbf`.
    pub leeway: HumanDuration,
    /// How often the key files are read again.
    pub reload_interval: HumanDuration,
    /// Client certificates (mutual TLS) mapped to principals by common name
    /// or DNS / URI subject alternative name.
    #[serde(default)]
    pub client_certificates: Vec<ClientCertificatePrincipal>,
}

impl AuthConfig {
    /// With auth on: the internal token is set, keys come with an issuer
    /// and an audience, and something can authenticate a caller.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled {
            return Ok(());
        }
        if self.internal_token_file.trim().is_empty() {
            return Err(invalid(
                "auth.internal_token_file",
                "must be set when auth is on: a file holding a random secret (at least 16 characters) shared by every \
                 Sluice process, which the services send each other (or set auth.enabled = false, only on a trusted network)",
            ));
        }
        let has_keys = !self.jwks_file.trim().is_empty() || !self.public_key_files.is_empty();
        if has_keys && self.issuer.trim().is_empty() {
            return Err(invalid("auth.issuer", "must be set with jwks_file or public_key_files"));
        }
        if has_keys && self.audience.trim().is_empty() {
            return Err(invalid(
                "auth.audience",
                "must be set with jwks_file or public_key_files",
            ));
        }
        for (index, mapping) in self.client_certificates.iter().enumerate() {
            let field = format!("auth.client_certificates[{index}]");
            if mapping.name.trim().is_empty() {
                return Err(invalid(format!("{field}.name"), "must not be empty"));
            }
            for role in &mapping.roles {
                if crate::auth::Role::parse(role).is_none() {
                    return Err(invalid(
                        format!("{field}.roles"),
                        format!("{role:?} is not a role: producer, worker, operator, reader or admin"),
                    ));
                }
            }
            if mapping.tenants.iter().any(|tenant| tenant == "*") {
                return Err(invalid(
                    format!("{field}.tenants"),
                    "tenant `*` (global caps) is reached through the admin role, not listed",
                ));
            }
        }
        for (field, value) in [
            ("auth.tenants_claim", &self.tenants_claim),
            ("auth.roles_claim", &self.roles_claim),
        ] {
            if value.trim().is_empty() {
                return Err(invalid(field, "must not be empty"));
            }
        }
        Ok(())
    }
}

/// `[[auth.client_certificates]]`: a certificate name and what it may do.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientCertificatePrincipal {
    pub name: String,
    #[serde(default)]
    pub tenants: Vec<String>,
    pub roles: Vec<String>,
}

/// `[tls]`: empty files mean plaintext gRPC.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// The server's certificate chain (PEM). With `key_file`, turns TLS on
    /// for every gRPC server of the process.
    pub cert_file: String,
    /// The private key of `cert_file` (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key_file: String,
    /// Require client certificates signed by this CA (PEM); empty: none.
    pub client_ca_file: String,
    /// The CA (PEM) this process trusts for `https://` endpoints of other
    /// services; empty: none configured, `https://` calls fail to connect.
    pub ca_file: String,
    /// The name clients check in the services' certificates, whatever
    /// address they dial (instances advertise `https://<pod IP>:<port>`,
    /// which a certificate rarely names); empty: the endpoint's host.
    pub server_name: String,
    /// How often the certificate files are read again.
    pub reload_interval: HumanDuration,
}

/// The web console (`sluice-console`): where it listens, the services it
/// reads and steers through their public gRPC APIs, and the bounds of what it
/// keeps in memory.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleConfig {
    pub listen: String,
    pub admission_endpoint: String,
    pub limit_grant_endpoint: String,
    pub rate_window_endpoint: String,
    pub refresh_dispatcher_endpoint: String,
    /// Tenants the overview always shows; tenants seen in grants, admitted
    /// jobs and dead letters are added.
    #[serde(default, deserialize_with = "list_or_comma_separated")]
    pub tenants: Vec<String>,
    /// A job's trace in the tracing UI; `{job_id}` and `{tenant}` are
    /// replaced (URL-encoded). Empty: no link.
    pub trace_url_template: String,
    /// How often pages refresh their live parts (doubling on errors).
    pub refresh_interval: HumanDuration,
    /// How often the keys being looked at are sampled for their chart.
    pub sample_interval: HumanDuration,
    /// How far back charts and rates go.
    pub chart_window: HumanDuration,
    pub max_watched_keys: usize,
    /// Read `jobs.admitted.*` and `deadletter` (admitted/s, dead letters).
    pub watch_kafka: bool,
    /// The consumer group named on the console's reads (it commits nothing).
    pub consumer_group: String,
    pub dead_letters_kept: usize,
    /// Keys of a tenant the overview reads (ListKeys pages) per refresh.
    pub overview_scan_keys: usize,
}

/// How a service process stops.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessConfig {
    /// After SIGTERM, how long the drain (in-flight batches, offset commits,
    /// producer flush, leaving the consumer groups) may take before the
    /// process exits anyway with status 1.
    pub drain_timeout: HumanDuration,
    /// Serve gRPC reflection (grpcurl's `list` and `describe`) beside the
    /// health service. Health always stays open for probes.
    pub grpc_reflection: bool,
    /// The longest a unary gRPC call (or a stream's opening) may take before
    /// it is answered DEADLINE_EXCEEDED; a client's shorter `grpc-timeout`
    /// wins. Open streams are not cut by it.
    pub grpc_request_timeout: HumanDuration,
    /// gRPC calls served at once per client connection; more wait their
    /// turn (HTTP/2 flow control pushes back on the client).
    pub grpc_max_concurrent_requests: usize,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresConfig {
    pub url: Secret,
    pub schema_prefix: String,
    pub max_connections: u32,
    pub acquire_timeout: HumanDuration,
    pub run_migrations: bool,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    pub brokers: String,
    pub topic_prefix: String,
    pub create_topics: bool,
    pub replication_factor: i32,
    pub fetch_wait_max_ms: u32,
    pub linger_ms: u32,
    pub session_timeout_ms: u32,
    /// The largest message the brokers accept (a topic's `max.message.bytes`).
    /// Every message Sluice writes stays under it: internal batches are cut
    /// to it, an admitted job is its payload plus a bounded envelope (so
    /// `admission.max_payload_bytes` must leave room), a dead letter too
    /// large for it is sent with its payload cut.
    pub max_message_bytes: usize,
    /// Bytes of fetched messages buffered per assigned partition (and the
    /// most one batch holds) before fetching waits; librdkafka's own
    /// prefetch queue is bounded to the same size.
    pub consumer_buffer_bytes: usize,
    /// How often each service checks that its topics exist (a broker that
    /// lost its log, a topic deleted by hand); missing topics are created
    /// again when `create_topics` is true, and readiness is NOT_SERVING while
    /// one is missing.
    pub topic_check_interval: HumanDuration,
    pub sasl_username: String,
    pub sasl_password: Secret,
    #[serde(default)]
    pub properties: BTreeMap<String, String>,
    /// Extra librdkafka properties of producers only (e.g. compression.type),
    /// applied after `properties`.
    #[serde(default)]
    pub producer_properties: BTreeMap<String, String>,
    pub partitions: PartitionCounts,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartitionCounts {
    pub requested: i32,
    pub admitted: i32,
    pub limit_commands: i32,
    pub rate_commands: i32,
    /// Admission's job partitions (`sluice.jobs`): a job belongs to the
    /// partition of Sluice's hash of its id.
    pub jobs: i32,
    pub refresh_due: i32,
    pub refresh_tasks: i32,
    pub deadletter: i32,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopicsConfig {
    pub requested: String,
    /// Tenants whose requests come on a topic of their own,
    /// `<requested>.<tenant>` (so Kafka ACLs can tell producers apart): a
    /// request there naming another tenant, or one naming such a tenant on
    /// the shared topic, is dead-lettered `tenant_mismatch`.
    #[serde(default, deserialize_with = "list_or_comma_separated")]
    pub tenant_requested: Vec<String>,
    pub admitted_prefix: String,
    pub refresh_tasks: String,
    pub deadletter: String,
    pub limit_commands: String,
    pub rate_commands: String,
    pub jobs: String,
    pub refresh_due: String,
}

#[derive(Clone, Copy, Debug, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    pub log_format: LogFormat,
    pub log_level: String,
    pub otlp_endpoint: String,
    /// CA (PEM) trusted for an `https://` OTLP endpoint; required for one.
    pub otlp_ca_file: String,
    pub sampling_ratio: f64,
    /// Prometheus scrape endpoint (`GET /metrics`); empty: none.
    pub metrics_listen: String,
    /// Per-key series for the busiest keys (by waiting, then holders).
    pub key_metrics_top_n: usize,
    /// Per-key series (and wait-time histograms) for keys matching these
    /// `tenant/key` globs, e.g. "acme/payments-*".
    /// A list, or one comma-separated string (handy in environment variables).
    #[serde(default, deserialize_with = "list_or_comma_separated")]
    pub key_metrics_patterns: Vec<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionConfig {
    pub listen: String,
    /// The address other admission instances forward job calls to; empty
    /// means the listener's address (`POD_IP` or the host name when bound to
    /// 0.0.0.0).
    pub advertised_endpoint: String,
    pub consumer_group: String,
    pub limit_grant_endpoint: String,
    pub rate_window_endpoint: String,
    pub default_priority: u32,
    /// Largest job payload; 0 in the file means the largest that fits
    /// (`DEFAULT_MAX_PAYLOAD_BYTES` at most), resolved at load.
    pub max_payload_bytes: usize,
    pub max_limits_per_job: usize,
    pub max_key_bytes: usize,
    /// Largest `metadata` of a floating limit (keys plus values, bytes).
    pub max_floating_metadata_bytes: usize,
    pub default_idempotency_window: HumanDuration,
    /// Unset: `2 × kafka.session_timeout_ms` (`resend_waiting_after()`).
    pub resend_waiting_after: Option<HumanDuration>,
    /// Unset: `5 × kafka.session_timeout_ms` (`claim_timeout()`).
    pub claim_timeout: Option<HumanDuration>,
    /// When a worker's `Work` stream ends, the attempts pushed on it keep
    /// their leases this long at most unless the worker heartbeats them.
    pub stream_end_grace: HumanDuration,
    pub sweep_interval: HumanDuration,
    pub stand_behind_interval: HumanDuration,
    pub max_batch: usize,
    /// Payloads up to this size are kept in memory with their active job
    /// (larger ones are read from PostgreSQL when the job is dispatched).
    pub memory_payload_max_bytes: usize,
    /// At most this many payload bytes kept in memory per job partition.
    pub memory_payload_budget_bytes: usize,
    /// A tenant's unfinished jobs at most, unless its stored quota says
    /// otherwise; 0: unlimited.
    pub default_max_waiting: u64,
    /// A tenant's new jobs per second at most, unless its stored quota says
    /// otherwise; 0: unlimited.
    pub default_max_enqueues_per_second: f64,
    /// How often stored tenant quotas are read again.
    pub quota_refresh_interval: HumanDuration,
}

/// Configuration shared by the partition-owning services.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OwnerServiceConfig {
    pub listen: String,
    pub advertised_endpoint: String,
    pub consumer_group: String,
    /// limit-grant: a ticket nobody stands behind for this long is reclaimed.
    #[serde(default = "default_ticket_grace")]
    pub ticket_grace: HumanDuration,
    /// rate-window: how long a granted ticket is remembered, so a duplicate
    /// acquire re-sends its grant instead of taking units twice.
    #[serde(default = "default_granted_retention")]
    pub granted_retention: HumanDuration,
    pub max_batch: usize,
}

/// The refresh-dispatcher: an owner service with the refresh policy.
#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RefreshDispatcherConfig {
    pub listen: String,
    pub advertised_endpoint: String,
    pub consumer_group: String,
    pub max_batch: usize,
    /// A refresh task nobody answers within this time counts as failed.
    pub task_timeout: HumanDuration,
    /// Backoff of failed refreshes: `initial_backoff` x 2^(failures-1),
    /// capped at `max_backoff`.
    pub initial_backoff: HumanDuration,
    pub max_backoff: HumanDuration,
}

fn list_or_comma_separated<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ListOrText {
        List(Vec<String>),
        Text(String),
    }
    Ok(match ListOrText::deserialize(deserializer)? {
        ListOrText::List(items) => items,
        ListOrText::Text(text) => text
            .split(',')
            .map(str::trim)
            .filter(|item| !item.is_empty())
            .map(str::to_string)
            .collect(),
    })
}

fn default_granted_retention() -> HumanDuration {
    HumanDuration(Duration::from_secs(300))
}

fn default_ticket_grace() -> HumanDuration {
    HumanDuration(Duration::from_secs(30))
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TaskGroupConfig {
    /// How long a claimed attempt lives without a heartbeat.
    pub lease: HumanDuration,
    /// Ends attempts that heartbeat but run longer than this. Absent: no limit.
    #[serde(default)]
    pub run_timeout: Option<HumanDuration>,
    /// Caps every job of the group acquires after its own keys.
    #[serde(default)]
    pub caps: Vec<CapConfig>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapConfig {
    pub key: String,
    pub max: u32,
    /// "tenant": one cap per tenant; "global": one cap across tenants.
    #[serde(default)]
    pub scope: CapScope,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CapScope {
    #[default]
    Tenant,
    Global,
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

    /// Defaults, then `file` if given, then the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with(file, &[])
    }

    /// Like `load`, with extra `(key, value)` overrides applied last (tests).
    pub fn load_with(file: Option<&Path>, overrides: &[(&str, &str)]) -> Result<Self, ConfigError> {
        Self::load_from(file, None, overrides)
    }

    /// `sluice dev`'s configuration: like `load`, but authentication is off
    /// unless the file or the environment turns it on.
    pub fn load_dev(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_layered(file, None, &[], Some(DEV_TOML))
    }

    /// `environment` replaces the process environment when given (tests).
    fn load_from(
        file: Option<&Path>,
        environment: Option<config::Map<String, String>>,
        overrides: &[(&str, &str)],
    ) -> Result<Self, ConfigError> {
        Self::load_layered(file, environment, overrides, None)
    }

    fn load_layered(
        file: Option<&Path>,
        environment: Option<config::Map<String, String>>,
        overrides: &[(&str, &str)],
        defaults: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let mut builder =
            config::Config::builder().add_source(config::File::from_str(DEFAULT_TOML, config::FileFormat::Toml));
        if let Some(defaults) = defaults {
            builder = builder.add_source(config::File::from_str(defaults, config::FileFormat::Toml));
        }
        if let Some(path) = file {
            builder = builder.add_source(config::File::from(path).required(true));
        }
        // Values stay strings until a field asks for a number, a bool or a
        // list: parsing them up front would turn a password "0123" into 123.
        builder = builder.add_source(
            config::Environment::with_prefix("SLUICE")
                .prefix_separator("__")
                .separator("__")
                .source(environment),
        );
        for (key, value) in overrides {
            builder = builder.set_override(*key, *value)?;
        }
        let mut built = builder.build()?;
        let removed_settings = removed::take_removed(&mut built.cache, file);
        let mut loaded: SluiceConfig = built.try_deserialize()?;
        loaded.removed_settings = removed_settings;
        if loaded.admission.max_payload_bytes == 0 {
            // Follows kafka.max_message_bytes: a file of 0.1.0 that sets
            // only that (900000) keeps starting.
            let room = loaded
                .kafka
                .max_message_bytes
                .saturating_sub(loaded.admitted_envelope_bytes());
            loaded.admission.max_payload_bytes = DEFAULT_MAX_PAYLOAD_BYTES.min(room);
        }
        loaded.validate()?;
        Ok(loaded)
    }

    /// Settings an earlier release read that the file or the environment
    /// set; this release ignores them.
    pub fn removed_settings(&self) -> &[RemovedSetting] {
        &self.removed_settings
    }

    /// A warning per removed setting that was set, naming it, where it was
    /// set and what replaced it. Called once logging is up (loading comes
    /// before it).
    pub fn warn_removed_settings(&self) {
        for removed in &self.removed_settings {
            tracing::warn!(
                setting = removed.key,
                set_in = %removed.set_in,
                removed_in = removed.removed_in,
                replaced_by = removed.replaced_by,
                "ignoring {}, a setting removed in {}: remove it from the configuration",
                removed.key,
                removed.removed_in
            );
        }
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.postgres.url.is_empty() {
            return Err(invalid("postgres.url", "must be set"));
        }
        if !is_identifier(&self.postgres.schema_prefix) {
            return Err(invalid(
                "postgres.schema_prefix",
                "use lowercase letters, digits and underscores, starting with a letter",
            ));
        }
        if self.postgres.max_connections < 2 {
            return Err(invalid("postgres.max_connections", "must be at least 2"));
        }
        if self.kafka.brokers.trim().is_empty() {
            return Err(invalid("kafka.brokers", "must be set"));
        }
        let counts = &self.kafka.partitions;
        for (field, count) in [
            ("kafka.partitions.requested", counts.requested),
            ("kafka.partitions.admitted", counts.admitted),
            ("kafka.partitions.limit_commands", counts.limit_commands),
            ("kafka.partitions.rate_commands", counts.rate_commands),
            ("kafka.partitions.jobs", counts.jobs),
            ("kafka.partitions.refresh_due", counts.refresh_due),
            ("kafka.partitions.refresh_tasks", counts.refresh_tasks),
            ("kafka.partitions.deadletter", counts.deadletter),
        ] {
            if !(1..=10_000).contains(&count) {
                return Err(invalid(field, "must be between 1 and 10000"));
            }
        }
        if self.kafka.max_message_bytes < 10_000 {
            return Err(invalid("kafka.max_message_bytes", "must be at least 10000"));
        }
        if self.kafka.consumer_buffer_bytes < self.kafka.max_message_bytes {
            return Err(invalid(
                "kafka.consumer_buffer_bytes",
                format!(
                    "must be at least kafka.max_message_bytes ({}): one message must fit",
                    self.kafka.max_message_bytes
                ),
            ));
        }
        if self.kafka.topic_check_interval.0 < Duration::from_secs(1) {
            return Err(invalid("kafka.topic_check_interval", "must be at least 1s"));
        }
        if self.process.drain_timeout.0.is_zero() {
            return Err(invalid("process.drain_timeout", "must be greater than 0"));
        }
        let envelope = self.admitted_envelope_bytes();
        if self.admission.max_payload_bytes.saturating_add(envelope) > self.kafka.max_message_bytes {
            return Err(invalid(
                "admission.max_payload_bytes",
                format!(
                    "{} bytes plus the admitted message's envelope (up to {envelope} bytes with \
                     admission.max_key_bytes {}) does not fit in kafka.max_message_bytes ({}): an \
                     accepted job could never be handed to workers; lower it to at most {} or raise \
                     kafka.max_message_bytes (and the topics' max.message.bytes)",
                    self.admission.max_payload_bytes,
                    self.admission.max_key_bytes,
                    self.kafka.max_message_bytes,
                    self.kafka.max_message_bytes.saturating_sub(envelope)
                ),
            ));
        }
        if self.admission.max_key_bytes > crate::validate::MAX_KEY_BYTES {
            return Err(invalid(
                "admission.max_key_bytes",
                format!(
                    "must be at most {} (keys are indexed in PostgreSQL)",
                    crate::validate::MAX_KEY_BYTES
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.telemetry.sampling_ratio) {
            return Err(invalid("telemetry.sampling_ratio", "must be between 0 and 1"));
        }
        if self.admission.default_priority > 99 {
            return Err(invalid("admission.default_priority", "must be 0..=99"));
        }
        for (field, value) in [
            ("admission.sweep_interval", self.admission.sweep_interval),
            ("admission.stand_behind_interval", self.admission.stand_behind_interval),
            ("admission.claim_timeout", self.claim_timeout()),
            ("admission.resend_waiting_after", self.resend_waiting_after()),
            ("admission.stream_end_grace", self.admission.stream_end_grace),
            ("limit_grant.ticket_grace", self.limit_grant.ticket_grace),
            ("refresh_dispatcher.task_timeout", self.refresh_dispatcher.task_timeout),
            (
                "refresh_dispatcher.initial_backoff",
                self.refresh_dispatcher.initial_backoff,
            ),
        ] {
            if value.0.is_zero() {
                return Err(invalid(field, "must be greater than 0"));
            }
        }
        if self.refresh_dispatcher.max_backoff.0 < self.refresh_dispatcher.initial_backoff.0 {
            return Err(invalid(
                "refresh_dispatcher.max_backoff",
                "must be at least refresh_dispatcher.initial_backoff",
            ));
        }
        if self.admission.stand_behind_interval.0 * 2 > self.limit_grant.ticket_grace.0 {
            return Err(invalid(
                "admission.stand_behind_interval",
                "must be at most half of limit_grant.ticket_grace (a third is the default)",
            ));
        }
        for (field, value) in [
            ("console.refresh_interval", self.console.refresh_interval),
            ("console.sample_interval", self.console.sample_interval),
            ("console.chart_window", self.console.chart_window),
        ] {
            if value.0 < Duration::from_millis(100) {
                return Err(invalid(field, "must be at least 100ms"));
            }
        }
        for (field, value) in [
            ("console.max_watched_keys", self.console.max_watched_keys),
            ("console.dead_letters_kept", self.console.dead_letters_kept),
            ("console.overview_scan_keys", self.console.overview_scan_keys),
        ] {
            if !(1..=1_000_000).contains(&value) {
                return Err(invalid(field, "must be between 1 and 1000000"));
            }
        }
        if self.task_groups.is_empty() {
            return Err(invalid("task_groups", "declare at least one task group"));
        }
        for (name, group) in &self.task_groups {
            if !is_task_group_name(name) {
                return Err(invalid(
                    format!("task_groups.{name}"),
                    "names use letters, digits, '-', '_' and '.' (they become topic names)",
                ));
            }
            if group.lease.0 < Duration::from_millis(100) {
                return Err(invalid(format!("task_groups.{name}.lease"), "must be at least 100ms"));
            }
            for (index, cap) in group.caps.iter().enumerate() {
                if cap.key.is_empty() {
                    return Err(invalid(
                        format!("task_groups.{name}.caps[{index}].key"),
                        "must not be empty",
                    ));
                }
                if cap.max == 0 || cap.max > crate::validate::MAX_CONCURRENCY {
                    return Err(invalid(
                        format!("task_groups.{name}.caps[{index}].max"),
                        format!("must be from 1 to {}", crate::validate::MAX_CONCURRENCY),
                    ));
                }
                if let Err(error) = crate::validate::check_name("key", &cap.key, self.admission.max_key_bytes) {
                    return Err(invalid(format!("task_groups.{name}.caps[{index}].key"), error.message));
                }
            }
        }
        for (index, tenant) in self.topics.tenant_requested.iter().enumerate() {
            if !is_task_group_name(tenant) {
                return Err(invalid(
                    format!("topics.tenant_requested[{index}]"),
                    "a tenant with a topic of its own uses letters, digits, '-', '_' and '.' (it becomes a topic name)",
                ));
            }
        }
        Ok(())
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

fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    matches!(chars.next(), Some(first) if first.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn is_task_group_name(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 100
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file and an environment written for 0.1.0 (which had a grants
    /// topic) load: the removed settings are ignored and reported, where
    /// they were set; a key no release had is still refused.
    #[test]
    fn settings_a_release_removed_load_and_are_reported_unknown_ones_are_refused() {
        let file = std::env::temp_dir().join(format!("sluice-removed-{}.toml", std::process::id()));
        std::fs::write(&file, "[kafka.partitions]\ngrants = 2\njobs = 4\n").unwrap();
        let environment = config::Map::from([("SLUICE__TOPICS__GRANTS".to_string(), "old.grants".to_string())]);
        let loaded = SluiceConfig::load_from(Some(&file), Some(environment), &[]).unwrap();
        assert_eq!(loaded.kafka.partitions.jobs, 4, "the rest of the file applies");
        let found: Vec<(&str, &str)> = loaded
            .removed_settings()
            .iter()
            .map(|removed| (removed.key, removed.set_in.as_str()))
            .collect();
        assert_eq!(
            found,
            [
                ("kafka.partitions.grants", file.to_str().unwrap()),
                ("topics.grants", "environment variable SLUICE__TOPICS__GRANTS"),
            ]
        );
        assert!(loaded.removed_settings()[0].replaced_by.contains("link streams"));
        assert!(SluiceConfig::load_from(None, None, &[])
            .unwrap()
            .removed_settings()
            .is_empty());

        std::fs::write(&file, "[kafka.partitions]\ngrant = 2\n").unwrap();
        let refused = SluiceConfig::load_from(Some(&file), None, &[]).unwrap_err();
        assert!(refused.to_string().contains("grant"), "{refused}");
        std::fs::remove_file(&file).unwrap();
    }

    #[test]
    fn resend_and_claim_timers_follow_the_session_timeout_unless_set() {
        let defaults = SluiceConfig::load_from(None, None, &[]).unwrap();
        assert_eq!(defaults.kafka.session_timeout_ms, 6000);
        assert_eq!(defaults.resend_waiting_after().0, Duration::from_secs(12));
        assert_eq!(defaults.claim_timeout().0, Duration::from_secs(30));
        let slower = SluiceConfig::load_from(None, None, &[("kafka.session_timeout_ms", "10000")]).unwrap();
        assert_eq!(slower.resend_waiting_after().0, Duration::from_secs(20));
        assert_eq!(slower.claim_timeout().0, Duration::from_secs(50));
        let set = SluiceConfig::load_from(
            None,
            None,
            &[
                ("admission.resend_waiting_after", "3s"),
                ("admission.claim_timeout", "2m"),
            ],
        )
        .unwrap();
        assert_eq!(set.resend_waiting_after().0, Duration::from_secs(3));
        assert_eq!(set.claim_timeout().0, Duration::from_secs(120));
        let zero = SluiceConfig::load_from(None, None, &[("admission.claim_timeout", "0s")]).unwrap_err();
        assert!(zero.to_string().contains("admission.claim_timeout"), "{zero}");
    }

    /// Every key of `default.toml` has a row in the settings table of
    /// docs/configuration.md (a row may name several: `section.a` / `b`).
    #[test]
    fn every_setting_has_a_row_in_the_configuration_page() {
        let page = include_str!("../../../docs/configuration.md");
        let table = page
            .split("\n## Settings\n")
            .nth(1)
            .and_then(|rest| rest.split("\n## ").next())
            .expect("a Settings section");
        let mut documented = std::collections::BTreeSet::new();
        for line in table.lines().filter(|line| line.starts_with("| `")) {
            let first_cell = line.split('|').nth(1).unwrap_or_default();
            let mut section = String::new();
            for token in first_cell.split('`').skip(1).step_by(2) {
                if token.starts_with("SLUICE__") {
                    continue;
                }
                match token.rsplit_once('.') {
                    Some((prefix, _)) => {
                        section = prefix.to_string();
                        documented.insert(token.to_string());
                    }
                    None if !section.is_empty() => {
                        documented.insert(format!("{section}.{token}"));
                    }
                    None => {}
                }
            }
        }
        let mut missing = Vec::new();
        let mut section = String::new();
        for line in DEFAULT_TOML.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            if let Some(name) = line.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')) {
                section = name.to_string();
                continue;
            }
            // Maps of librdkafka settings, and the example task group.
            if ["kafka.properties", "kafka.producer_properties"].contains(&section.as_str())
                || section.starts_with("task_groups.")
            {
                continue;
            }
            if let Some((key, _)) = line.split_once('=') {
                let key = format!("{section}.{}", key.trim());
                if !documented.contains(&key) {
                    missing.push(key);
                }
            }
        }
        assert!(
            missing.is_empty(),
            "docs/configuration.md's settings table has no row for {missing:?}"
        );
    }

    #[test]
    fn defaults_load_and_validate() {
        let loaded = SluiceConfig::load_with(None, &[]).unwrap();
        assert_eq!(loaded.kafka.partitions.limit_commands, 12);
        assert_eq!(loaded.task_groups["default"].lease.0, Duration::from_secs(30));
        assert_eq!(loaded.topic("jobs.requested"), "jobs.requested");
    }

    #[test]
    fn overrides_apply_and_unknown_keys_are_refused() {
        let loaded =
            SluiceConfig::load_with(None, &[("kafka.topic_prefix", "t1."), ("admission.max_batch", "7")]).unwrap();
        assert_eq!(loaded.admitted_topic("default"), "t1.jobs.admitted.default");
        assert_eq!(loaded.admission.max_batch, 7);
        let error = SluiceConfig::load_with(None, &[("admission.no_such_key", "1")]).unwrap_err();
        assert!(error.to_string().contains("no_such_key"), "{error}");
    }

    #[test]
    fn invalid_values_name_the_field() {
        let error = SluiceConfig::load_with(None, &[("telemetry.sampling_ratio", "2")]).unwrap_err();
        assert!(error.to_string().contains("telemetry.sampling_ratio"), "{error}");
    }

    #[test]
    fn a_payload_limit_that_leaves_no_room_for_the_envelope_is_refused() {
        let defaults = SluiceConfig::load_with(None, &[]).unwrap();
        assert!(
            defaults.admission.max_payload_bytes + defaults.admitted_envelope_bytes()
                <= defaults.kafka.max_message_bytes,
            "the defaults fit"
        );
        // The old defaults: a 1 MiB payload against 900,000-byte messages.
        let error = SluiceConfig::load_with(
            None,
            &[
                ("admission.max_payload_bytes", "1048576"),
                ("kafka.max_message_bytes", "900000"),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("admission.max_payload_bytes"), "{error}");
        assert!(error.contains("kafka.max_message_bytes (900000)"), "{error}");
        // Unset, the payload limit follows a smaller message size.
        let smaller = SluiceConfig::load_with(None, &[("kafka.max_message_bytes", "900000")]).unwrap();
        assert_eq!(
            smaller.admission.max_payload_bytes,
            900_000 - smaller.admitted_envelope_bytes()
        );
        assert_eq!(defaults.admission.max_payload_bytes, DEFAULT_MAX_PAYLOAD_BYTES);
        // Exactly the room there is is fine.
        let room = defaults.kafka.max_message_bytes - defaults.admitted_envelope_bytes();
        let room = room.to_string();
        assert!(SluiceConfig::load_with(None, &[("admission.max_payload_bytes", room.as_str())]).is_ok());
    }

    #[test]
    fn durations_parse_days_and_refuse_garbage() {
        assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(7 * 86_400));
        assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
        assert!(parse_duration("soon").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn environment_values_keep_their_text_and_still_fill_numbers_and_flags() {
        let environment: config::Map<String, String> = [
            ("SLUICE__KAFKA__SASL_PASSWORD", "0123"),
            ("SLUICE__KAFKA__SASL_USERNAME", "1e3"),
            ("SLUICE__KAFKA__LINGER_MS", "7"),
            ("SLUICE__KAFKA__CREATE_TOPICS", "false"),
            ("SLUICE__TELEMETRY__SAMPLING_RATIO", "0.25"),
            ("SLUICE__TELEMETRY__KEY_METRICS_PATTERNS", "acme/a*, acme/b*"),
            ("SLUICE__ADMISSION__CLAIM_TIMEOUT", "90s"),
        ]
        .into_iter()
        .map(|(name, value)| (name.to_string(), value.to_string()))
        .collect();
        let loaded = SluiceConfig::load_from(None, Some(environment), &[]).unwrap();
        assert_eq!(
            loaded.kafka.sasl_password.expose(),
            "0123",
            "a secret is never re-printed as a number"
        );
        assert_eq!(loaded.kafka.sasl_username, "1e3");
        assert_eq!(loaded.kafka.linger_ms, 7);
        assert!(!loaded.kafka.create_topics);
        assert!((loaded.telemetry.sampling_ratio - 0.25).abs() < f64::EPSILON);
        assert_eq!(loaded.telemetry.key_metrics_patterns, vec!["acme/a*", "acme/b*"]);
        assert_eq!(loaded.claim_timeout().0, Duration::from_secs(90));
        let bad: config::Map<String, String> = [("SLUICE__KAFKA__LINGER_MS".to_string(), "soon".to_string())]
            .into_iter()
            .collect();
        let error = SluiceConfig::load_from(None, Some(bad), &[]).unwrap_err();
        assert!(error.to_string().contains("linger_ms"), "{error}");
    }

    #[test]
    fn secrets_do_not_print() {
        let secret = Secret::new("hunter2");
        assert_eq!(format!("{secret:?}"), "***");
    }
}
