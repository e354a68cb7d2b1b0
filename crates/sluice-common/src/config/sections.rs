//! The sections of the configuration (`[auth]`, `[kafka]`, `[admission]`,
//! ...): one struct per section, each field documented as the setting it
//! reads, with the serde helpers and defaults they name.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Deserializer};

use super::{HumanDuration, Secret};

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
