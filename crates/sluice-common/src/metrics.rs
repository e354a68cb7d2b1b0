//! Metrics through OpenTelemetry: exported over OTLP when an endpoint is
//! configured, and always readable on a Prometheus scrape endpoint
//! (`telemetry.metrics_listen`, `GET /metrics`).
//!
//! Per-key series have bounded cardinality: owners publish a snapshot of
//! their keys, and only the top `telemetry.key_metrics_top_n` keys (by
//! waiting, then holders) plus keys matching `telemetry.key_metrics_patterns`
//! are exported.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Mutex, OnceLock, RwLock};

use opentelemetry::metrics::{Counter, Histogram, Meter};
use opentelemetry::KeyValue;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::shutdown::Shutdown;

/// One key's state as its owner sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct KeyStat {
    pub tenant: String,
    pub key: String,
    /// "concurrency", "floating" or "rate".
    pub kind: &'static str,
    pub holders: u64,
    pub waiting: u64,
    /// The max in force (or the rate limit), when known.
    pub max: Option<u64>,
}

/// Which keys get per-key series.
#[derive(Clone, Debug, Default)]
pub struct KeySelection {
    pub top_n: usize,
    pub patterns: Vec<String>,
}

impl KeySelection {
    /// Whether `tenant/key` matches a configured pattern (`*` matches any run).
    pub fn matches(&self, tenant: &str, key: &str) -> bool {
        if self.patterns.is_empty() {
            return false;
        }
        let name = format!("{tenant}/{key}");
        self.patterns.iter().any(|pattern| glob_matches(pattern, &name))
    }
}

fn glob_matches(pattern: &str, text: &str) -> bool {
    let parts: Vec<&str> = pattern.split('*').collect();
    if parts.len() == 1 {
        return pattern == text;
    }
    let mut rest = text;
    for (index, part) in parts.iter().enumerate() {
        if index == 0 {
            let Some(stripped) = rest.strip_prefix(part) else {
                return false;
            };
            rest = stripped;
        } else if index == parts.len() - 1 {
            return rest.ends_with(part);
        } else if let Some(found) = rest.find(part) {
            rest = &rest[found + part.len()..];
        } else {
            return false;
        }
    }
    true
}

/// Snapshots of every owned partition's keys, by (service, partition).
#[derive(Default)]
struct KeyStats {
    snapshots: HashMap<(&'static str, i32), Vec<KeyStat>>,
}

/// The instruments every service records into.
pub struct SluiceMetrics {
    pub grants: Counter<u64>,
    pub waits: Counter<u64>,
    pub wait_seconds: Histogram<f64>,
    pub key_wait_seconds: Histogram<f64>,
    pub shadow_wait_seconds: Histogram<f64>,
    pub shadow_exceeded: Counter<u64>,
    pub adaptive_max: opentelemetry::metrics::Gauge<u64>,
    pub adaptive_changes: Counter<u64>,
    pub rate_deferrals: Counter<u64>,
    pub refresh_outcomes: Counter<u64>,
    pub dead_letters: Counter<u64>,
    pub tenant_quota: opentelemetry::metrics::Gauge<f64>,
    pub quota_refusals: Counter<u64>,
    pub quarantined: Counter<u64>,
    pub link_grants_unrouted: Counter<u64>,
    pub link_grants_not_owned: Counter<u64>,
    pub transient_faults: Counter<u64>,
    pub consumed: Counter<u64>,
    pub partition_behind: Counter<u64>,
    pub produced: Counter<u64>,
    pub commit_seconds: Histogram<f64>,
    pub publish_seconds: Histogram<f64>,
    selection: RwLock<KeySelection>,
    key_stats: Mutex<KeyStats>,
    consumer_lag: Mutex<HashMap<(String, i32), i64>>,
    /// Partitions the owner runtimes of this process own, by service
    /// (`sluice dev` prints its endpoints once every one is owned).
    owned_partitions: tokio::sync::watch::Sender<BTreeMap<&'static str, i64>>,
}

static METRICS: OnceLock<SluiceMetrics> = OnceLock::new();

/// The process's instruments (created on first use from the global meter
/// provider, which `telemetry::init` sets; before that they record nowhere).
pub fn metrics() -> &'static SluiceMetrics {
    METRICS.get_or_init(|| SluiceMetrics::new(&opentelemetry::global::meter("sluice")))
}

const WAIT_BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0, 300.0,
];

impl SluiceMetrics {
    fn new(meter: &Meter) -> Self {
        let latency_buckets = vec![
            0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
        ];
        let created = SluiceMetrics {
            grants: meter
                .u64_counter("sluice_grants")
                .with_description("Grants made, by limit kind")
                .build(),
            waits: meter
                .u64_counter("sluice_waits")
                .with_description("Grants that had to wait first, by limit kind")
                .build(),
            wait_seconds: meter
                .f64_histogram("sluice_wait_time")
                .with_description("Time from joining a key's queue to the grant, by limit kind")
                .with_unit("s")
                .with_boundaries(WAIT_BUCKETS.to_vec())
                .build(),
            key_wait_seconds: meter
                .f64_histogram("sluice_key_wait_time")
                .with_description("Wait time per key, for keys selected by telemetry.key_metrics_patterns")
                .with_unit("s")
                .with_boundaries(WAIT_BUCKETS.to_vec())
                .build(),
            shadow_wait_seconds: meter
                .f64_histogram("sluice_shadow_wait_time")
                .with_description(
                    "Shadow-mode keys: how long a job would have waited had the limit been enforced, by tenant and key",
                )
                .with_unit("s")
                .with_boundaries(WAIT_BUCKETS.to_vec())
                .build(),
            shadow_exceeded: meter
                .u64_counter("sluice_shadow_exceeded")
                .with_description("Shadow-mode keys: grants that took the holders over the max, by tenant and key")
                .build(),
            adaptive_max: meter
                .u64_gauge("sluice_adaptive_max")
                .with_description("Adaptive keys: the computed max after its last change, by tenant and key")
                .build(),
            adaptive_changes: meter
                .u64_counter("sluice_adaptive_changes")
                .with_description(
                    "Adaptive keys: changes of the computed max, by tenant, key and reason (grow, latency, errors)",
                )
                .build(),
            rate_deferrals: meter
                .u64_counter("sluice_rate_deferrals")
                .with_description("Rate acquires deferred to a later slot")
                .build(),
            refresh_outcomes: meter
                .u64_counter("sluice_refresh_outcomes")
                .with_description("Floating-limit refresh results, by outcome")
                .build(),
            dead_letters: meter
                .u64_counter("sluice_dead_letters")
                .with_description("Producer messages sent to the dead-letter topic")
                .build(),
            tenant_quota: meter
                .f64_gauge("sluice_tenant_quota")
                .with_description(
                    "A tenant's quota (max_waiting jobs, max_enqueues_per_second) as this instance enforces it, for \
                     tenants with an override; -1: unlimited",
                )
                .build(),
            quota_refusals: meter
                .u64_counter("sluice_quota_refusals")
                .with_description("Jobs refused because their tenant was over a quota, by tenant and quota")
                .build(),
            quarantined: meter
                .u64_counter("sluice_quarantined")
                .with_description(
                    "Internal input set aside because it fails every time (undecodable, invalid, refused by \
                     PostgreSQL), by service; the entries are in the service's quarantine table",
                )
                .build(),
            link_grants_unrouted: meter
                .u64_counter("sluice_link_grants_unrouted")
                .with_description(
                    "Committed grants no admission stream took, or whose stream was too far behind to queue them (admission re-sends its acquire; the grant follows)",
                )
                .build(),
            link_grants_not_owned: meter
                .u64_counter("sluice_link_grants_not_owned")
                .with_description(
                    "Grants an admission instance received for a job partition it does not own (handed over; the owner re-sends its acquires and the grant follows). Growing for long: grants routed to the wrong instance",
                )
                .build(),
            transient_faults: meter
                .u64_counter("sluice_transient_faults")
                .with_description("Faults that pass (database, broker) met and retried with backoff, by service")
                .build(),
            consumed: meter
                .u64_counter("sluice_kafka_consumed_messages")
                .with_description("Kafka messages consumed, by topic")
                .build(),
            partition_behind: meter
                .u64_counter("sluice_kafka_partition_behind")
                .with_description(
                    "Messages a partition's task had no room for when fetched (its buffer, kafka.consumer_buffer_bytes, was full): the partition is then fetched as the task catches up, by topic",
                )
                .build(),
            produced: meter
                .u64_counter("sluice_kafka_produced_messages")
                .with_description("Kafka messages produced (acknowledged), by topic")
                .build(),
            commit_seconds: meter
                .f64_histogram("sluice_commit_duration")
                .with_description("PostgreSQL batch commit latency, by service")
                .with_unit("s")
                .with_boundaries(latency_buckets.clone())
                .build(),
            publish_seconds: meter
                .f64_histogram("sluice_kafka_publish_duration")
                .with_description("Time to publish a batch's effects and get every acknowledgement")
                .with_unit("s")
                .with_boundaries(latency_buckets)
                .build(),
            selection: RwLock::new(KeySelection::default()),
            key_stats: Mutex::new(KeyStats::default()),
            consumer_lag: Mutex::new(HashMap::new()),
            owned_partitions: tokio::sync::watch::Sender::new(BTreeMap::new()),
        };
        register_observers(meter);
        created
    }

    pub fn set_selection(&self, selection: KeySelection) {
        let mut current = self.selection.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        *current = selection;
    }

    /// Whether per-key wait histograms are kept for this key.
    pub fn key_selected(&self, tenant: &str, key: &str) -> bool {
        self.selection
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .matches(tenant, key)
    }

    /// A grant; `waited_ms` is 0 when it did not wait.
    pub fn record_grant(&self, service: &'static str, kind: &'static str, tenant: &str, key: &str, waited_ms: i64) {
        let attributes = [KeyValue::new("service", service), KeyValue::new("kind", kind)];
        self.grants.add(1, &attributes);
        if waited_ms > 0 {
            self.waits.add(1, &attributes);
        }
        #[allow(clippy::cast_precision_loss)]
        let seconds = waited_ms.max(0) as f64 / 1000.0;
        self.wait_seconds.record(seconds, &attributes);
        if self.key_selected(tenant, key) {
            self.key_wait_seconds.record(
                seconds,
                &[
                    KeyValue::new("tenant", tenant.to_string()),
                    KeyValue::new("key", key.to_string()),
                    KeyValue::new("kind", kind),
                ],
            );
        }
    }

    /// A shadow-mode key's simulated grant: the job would have waited
    /// `waited_ms`. By tenant and key (a shadow key is one an operator is
    /// studying).
    pub fn record_shadow_wait(&self, tenant: &str, key: &str, waited_ms: i64) {
        #[allow(clippy::cast_precision_loss)]
        let seconds = waited_ms.max(0) as f64 / 1000.0;
        self.shadow_wait_seconds.record(
            seconds,
            &[
                KeyValue::new("tenant", tenant.to_string()),
                KeyValue::new("key", key.to_string()),
            ],
        );
    }

    /// A shadow-mode key's real grant took its holders over the max.
    pub fn record_shadow_exceeded(&self, tenant: &str, key: &str) {
        self.shadow_exceeded.add(
            1,
            &[
                KeyValue::new("tenant", tenant.to_string()),
                KeyValue::new("key", key.to_string()),
            ],
        );
    }

    /// An adaptive key's computed max changed to `to`, for `reason` (grow,
    /// latency or errors).
    pub fn record_adaptive_change(&self, tenant: &str, key: &str, reason: &'static str, to: u32) {
        let labels = [
            KeyValue::new("tenant", tenant.to_string()),
            KeyValue::new("key", key.to_string()),
        ];
        self.adaptive_max.record(u64::from(to), &labels);
        self.adaptive_changes.add(
            1,
            &[
                KeyValue::new("tenant", tenant.to_string()),
                KeyValue::new("key", key.to_string()),
                KeyValue::new("reason", reason),
            ],
        );
    }

    /// Replace a partition's key snapshot (`None` when the partition is released).
    pub fn publish_keys(&self, service: &'static str, partition: i32, keys: Option<Vec<KeyStat>>) {
        let mut stats = self.key_stats.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match keys {
            Some(keys) => {
                stats.snapshots.insert((service, partition), keys);
            }
            None => {
                stats.snapshots.remove(&(service, partition));
            }
        }
    }

    /// The keys that get per-key series now.
    pub fn selected_keys(&self) -> Vec<KeyStat> {
        let selection = self
            .selection
            .read()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let stats = self.key_stats.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut all: Vec<&KeyStat> = stats.snapshots.values().flatten().collect();
        all.sort_by(|left, right| {
            (right.waiting, right.holders)
                .cmp(&(left.waiting, left.holders))
                .then_with(|| (&left.tenant, &left.key).cmp(&(&right.tenant, &right.key)))
        });
        let mut chosen: Vec<KeyStat> = Vec::new();
        for (index, stat) in all.into_iter().enumerate() {
            if index < selection.top_n || selection.matches(&stat.tenant, &stat.key) {
                chosen.push(stat.clone());
            }
        }
        chosen
    }

    /// A partition of `service` became owned here (`delta` 1) or was let go (-1).
    pub fn partitions_owned_changed(&self, service: &'static str, delta: i64) {
        self.owned_partitions.send_modify(|owned| {
            *owned.entry(service).or_default() += delta;
        });
    }

    /// How many partitions each service owns in this process, as it changes.
    pub fn watch_owned_partitions(&self) -> tokio::sync::watch::Receiver<BTreeMap<&'static str, i64>> {
        self.owned_partitions.subscribe()
    }

    pub fn set_consumer_lag(&self, topic: &str, partition: i32, lag: i64) {
        let mut lags = self
            .consumer_lag
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        lags.insert((topic.to_string(), partition), lag);
    }
}

fn register_observers(meter: &Meter) {
    let key_attributes = |stat: &KeyStat| {
        [
            KeyValue::new("tenant", stat.tenant.clone()),
            KeyValue::new("key", stat.key.clone()),
            KeyValue::new("kind", stat.kind),
        ]
    };
    meter
        .u64_observable_gauge("sluice_key_holders")
        .with_description("Holders of a key (selected keys only)")
        .with_callback(move |observer| {
            for stat in metrics().selected_keys() {
                observer.observe(stat.holders, &key_attributes(&stat));
            }
        })
        .build();
    meter
        .u64_observable_gauge("sluice_key_waiting")
        .with_description("Queue depth of a key (selected keys only)")
        .with_callback(move |observer| {
            for stat in metrics().selected_keys() {
                observer.observe(stat.waiting, &key_attributes(&stat));
            }
        })
        .build();
    meter
        .f64_observable_gauge("sluice_key_utilization")
        .with_description("Holders / max of a key (selected keys only)")
        .with_callback(move |observer| {
            for stat in metrics().selected_keys() {
                if let Some(max) = stat.max.filter(|max| *max > 0) {
                    #[allow(clippy::cast_precision_loss)]
                    let ratio = stat.holders as f64 / max as f64;
                    observer.observe(ratio, &key_attributes(&stat));
                }
            }
        })
        .build();
    meter
        .i64_observable_gauge("sluice_owned_partitions")
        .with_description(
            "Partitions this process owns, by service (summed over instances: every partition of the topic)",
        )
        .with_callback(|observer| {
            let owned = metrics().owned_partitions.borrow().clone();
            for (service, count) in owned {
                observer.observe(count, &[KeyValue::new("service", service)]);
            }
        })
        .build();
    meter
        .i64_observable_gauge("sluice_kafka_consumer_lag")
        .with_description("Messages behind the high watermark, per topic partition (from librdkafka statistics)")
        .with_callback(|observer| {
            let lags = metrics()
                .consumer_lag
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .clone();
            for ((topic, partition), lag) in lags {
                observer.observe(
                    lag,
                    &[
                        KeyValue::new("topic", topic),
                        KeyValue::new("partition", i64::from(partition)),
                    ],
                );
            }
        })
        .build();
}

/// At most this many scrape connections at once; more are closed at once.
pub const MAX_SCRAPE_CONNECTIONS: usize = 32;
/// How long a client may take to send its request, and to read the answer.
pub const SCRAPE_IO_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Serve the Prometheus text format on `GET /metrics` until `shutdown`.
///
/// Bounded: at most `MAX_SCRAPE_CONNECTIONS` connections at once (others
/// are closed as they arrive), a request head of at most 4 KiB read within
/// `SCRAPE_IO_TIMEOUT`, and the answer written within it too, so idle or
/// slow connections can never stop the endpoint.
pub async fn serve_prometheus(
    listener: TcpListener,
    registry: prometheus::Registry,
    shutdown: Shutdown,
) -> Result<(), std::io::Error> {
    tracing::info!(address = ?listener.local_addr().ok(), "metrics endpoint listening");
    let slots = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_SCRAPE_CONNECTIONS));
    loop {
        let accepted = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            accepted = listener.accept() => accepted,
        };
        let mut stream = match accepted {
            Ok((stream, _)) => stream,
            Err(error) => {
                // Out of file descriptors and the like: pass; never end the loop.
                tracing::warn!(%error, "accepting a metrics connection failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            tracing::debug!("too many metrics connections; closing a new one");
            drop(stream);
            continue;
        };
        let registry = registry.clone();
        tokio::spawn(async move {
            let _slot = slot;
            let head = match tokio::time::timeout(SCRAPE_IO_TIMEOUT, read_request_head(&mut stream)).await {
                Ok(Some(head)) => head,
                Ok(None) | Err(_) => return,
            };
            let path = head.split_whitespace().nth(1).unwrap_or("");
            let (status, body) = if path == "/metrics" || path.starts_with("/metrics?") {
                let encoder = prometheus::TextEncoder::new();
                match encoder.encode_to_string(&registry.gather()) {
                    Ok(text) => ("200 OK", text),
                    Err(error) => ("500 Internal Server Error", error.to_string()),
                }
            } else {
                ("404 Not Found", "try /metrics\n".to_string())
            };
            let response = format!(
                "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = tokio::time::timeout(SCRAPE_IO_TIMEOUT, async {
                let _ = stream.write_all(response.as_bytes()).await;
                let _ = stream.shutdown().await;
            })
            .await;
        });
    }
}

/// The request line and headers (up to the blank line), at most 4 KiB.
async fn read_request_head(stream: &mut tokio::net::TcpStream) -> Option<String> {
    let mut request = vec![0u8; 4096];
    let mut read = 0;
    while read < request.len() {
        match stream.read(&mut request[read..]).await {
            Ok(0) | Err(_) => return None,
            Ok(count) => read += count,
        }
        if request[..read].windows(4).any(|window| window == b"\r\n\r\n") {
            return Some(String::from_utf8_lossy(&request[..read]).into_owned());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_select_keys() {
        let selection = KeySelection {
            top_n: 0,
            patterns: vec!["acme/payments-*".to_string(), "*/exact".to_string()],
        };
        assert!(selection.matches("acme", "payments-eu"));
        assert!(!selection.matches("acme", "orders"));
        assert!(selection.matches("globex", "exact"));
        assert!(!selection.matches("globex", "exactly"));
        assert!(glob_matches("a*b*c", "aXXbYYc"));
        assert!(!glob_matches("a*b*c", "aXXcYYb"));
    }
}
