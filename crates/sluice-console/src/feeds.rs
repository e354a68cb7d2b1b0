//! The console's background readers: every owner instance's grant watch
//! (found through the owner directories), `jobs.admitted.*` and `deadletter`
//! on Kafka (assigned, from their ends, committing nothing), and the sampler
//! of the keys being looked at. Each runs until shutdown; a reader that
//! loses its source retries, and the pages say what is not flowing.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use prost::Message as _;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};
use sluice_common::Shutdown;
use sluice_proto::v1 as pb;

use crate::activity::DeadLetter;
use crate::services::{self, ApiError, OwnerService};
use crate::watch::{RefreshRecord, Sample};
use crate::{lock, now_ms, Console, ConsoleError};

/// How often the owner directories are read for new instances to watch.
const DIRECTORY_INTERVAL: Duration = Duration::from_secs(5);
/// Keys sampled at once.
const SAMPLE_CONCURRENCY: usize = 8;
/// Bytes of a dead letter's payload shown as a preview.
const PAYLOAD_PREVIEW_BYTES: usize = 160;

/// Watch the grants of every instance of limit-grant and rate-window,
/// opening a stream to each endpoint their directories name.
pub async fn watch_all_grants(console: Arc<Console>, shutdown: Shutdown) -> Result<(), ConsoleError> {
    let open: Arc<Mutex<HashSet<(OwnerService, String)>>> = Arc::new(Mutex::new(HashSet::new()));
    loop {
        for service in [OwnerService::LimitGrant, OwnerService::RateWindow] {
            match console.services.owner_endpoints(service).await {
                Ok(endpoints) => {
                    for endpoint in endpoints {
                        let fresh = lock(&open).insert((service, endpoint.clone()));
                        if fresh {
                            tokio::spawn(watch_one(
                                console.clone(),
                                service,
                                endpoint,
                                open.clone(),
                                shutdown.clone(),
                            ));
                        }
                    }
                }
                Err(error) => {
                    tracing::debug!(%error, "reading an owner directory failed");
                    lock(&console.feeds).grant_error = Some(error.to_string());
                }
            }
        }
        lock(&console.feeds).grant_streams = lock(&open).len();
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(DIRECTORY_INTERVAL) => {}
        }
    }
}

async fn watch_one(
    console: Arc<Console>,
    service: OwnerService,
    endpoint: String,
    open: Arc<Mutex<HashSet<(OwnerService, String)>>>,
    shutdown: Shutdown,
) {
    let watching = async {
        let mut stream = services::watch_grants(service, &endpoint).await?;
        lock(&console.feeds).grant_error = None;
        loop {
            let batch = stream.message().await.map_err(|status| ApiError {
                service: "grant watch",
                endpoint: endpoint.clone(),
                code: status.code(),
                message: status.message().to_string(),
            })?;
            let Some(batch) = batch else {
                return Ok::<(), ApiError>(());
            };
            let now = now_ms();
            let mut activity = lock(&console.activity);
            for encoded in &batch.events {
                let Ok(event) = pb::GrantEvent::decode(encoded.as_slice()) else {
                    continue;
                };
                let Some(key) = event.key else {
                    continue;
                };
                activity.record_grant(&key.tenant, &key.key, event.granted_at_ms, now);
            }
        }
    };
    let outcome = tokio::select! {
        _ = shutdown.cancelled() => Ok(()),
        outcome = watching => outcome,
    };
    if let Err(error) = outcome {
        tracing::debug!(%error, "a grant watch ended");
        lock(&console.feeds).grant_error = Some(error.to_string());
    }
    lock(&open).remove(&(service, endpoint));
}

/// Read admitted jobs and dead letters from Kafka, from the topics' ends
/// (the last `dead_letters_kept` dead letters of each partition first).
pub async fn read_kafka(console: Arc<Console>, shutdown: Shutdown) -> Result<(), ConsoleError> {
    let config = &console.config;
    if !config.console.watch_kafka {
        lock(&console.feeds).kafka = "off (console.watch_kafka = false)".to_string();
        return Ok(());
    }
    let mut settings = sluice_common::kafka::client_config(&config.kafka);
    settings
        .set("group.id", config.group(&config.console.consumer_group))
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "latest")
        .set("fetch.wait.max.ms", config.kafka.fetch_wait_max_ms.to_string())
        // Bounds what is buffered: the console only counts admitted jobs.
        .set("queued.max.messages.kbytes", "8192");
    let consumer: StreamConsumer = settings.create().map_err(ConsoleError::Kafka)?;
    let deadletter_topic = config.topic(&config.topics.deadletter);
    let mut assignment = TopicPartitionList::new();
    let backlog = i64::try_from(config.console.dead_letters_kept).unwrap_or(i64::MAX);
    for partition in 0..config.kafka.partitions.deadletter {
        assignment
            .add_partition_offset(&deadletter_topic, partition, Offset::OffsetTail(backlog))
            .map_err(ConsoleError::Kafka)?;
    }
    for task_group in config.task_groups.keys() {
        let topic = config.admitted_topic(task_group);
        for partition in 0..config.kafka.partitions.admitted {
            assignment
                .add_partition_offset(&topic, partition, Offset::End)
                .map_err(ConsoleError::Kafka)?;
        }
    }
    consumer.assign(&assignment).map_err(ConsoleError::Kafka)?;
    lock(&console.feeds).kafka = "reading".to_string();
    loop {
        let received = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            received = consumer.recv() => received,
        };
        let message = match received {
            Ok(message) => message,
            Err(error) => {
                tracing::debug!(%error, "console: Kafka read failed; retrying");
                lock(&console.feeds).kafka = format!("retrying after: {error}");
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
                continue;
            }
        };
        let now = now_ms();
        let payload = message.payload().unwrap_or_default();
        if message.topic() == deadletter_topic {
            let header = |name: &str| sluice_common::kafka::message_header(&message, name);
            let source = format!(
                "{}/{}@{}",
                header("sluice-source-topic"),
                header("sluice-source-partition"),
                header("sluice-source-offset")
            );
            let dead_letter = DeadLetter {
                at_ms: message.timestamp().to_millis().unwrap_or(now),
                class: header("sluice-deadletter-class"),
                reason: header("sluice-deadletter-reason"),
                tenant: tenant_of(payload),
                source,
                payload_preview: preview(payload),
            };
            lock(&console.activity).record_dead_letter(dead_letter, now);
        } else if let Ok(admitted) = pb::AdmittedJob::decode(payload) {
            lock(&console.activity).record_admitted(&admitted.tenant, now);
        }
        let mut feeds = lock(&console.feeds);
        if feeds.kafka != "reading" {
            feeds.kafka = "reading".to_string();
        }
    }
}

/// The tenant a dead-lettered request names, if its bytes say: JSON first,
/// then protobuf. Hostile bytes: only a plain, short name is taken.
pub fn tenant_of(payload: &[u8]) -> Option<String> {
    let named = match serde_json::from_slice::<serde_json::Value>(payload) {
        Ok(serde_json::Value::Object(fields)) => fields
            .get("tenant")
            .and_then(|tenant| tenant.as_str())
            .map(str::to_string),
        Ok(_) => None,
        Err(_) => pb::JobRequest::decode(payload).ok().map(|request| request.tenant),
    }?;
    let plain = !named.is_empty() && named.len() <= 256 && !named.chars().any(char::is_control);
    plain.then_some(named)
}

fn preview(payload: &[u8]) -> String {
    let cut = &payload[..payload.len().min(PAYLOAD_PREVIEW_BYTES)];
    String::from_utf8_lossy(cut)
        .chars()
        .map(|c| if c.is_control() { '·' } else { c })
        .collect()
}

/// Sample the keys being looked at, every `console.sample_interval`.
pub async fn sample_watched_keys(console: Arc<Console>, shutdown: Shutdown) -> Result<(), ConsoleError> {
    let mut ticker = tokio::time::interval(console.config.console.sample_interval.0);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = ticker.tick() => {}
        }
        let due = lock(&console.watch).due(Instant::now());
        futures::stream::iter(due)
            .for_each_concurrent(SAMPLE_CONCURRENCY, |(tenant, key)| {
                let console = console.clone();
                async move {
                    if let Err(error) = sample_key(&console, &tenant, &key).await {
                        tracing::debug!(%error, tenant, key, "sampling a key failed");
                    }
                }
            })
            .await;
    }
}

/// One sample of a key (and its refresh state, when floating).
pub async fn sample_key(console: &Console, tenant: &str, key: &str) -> Result<(), ApiError> {
    let state = console.services.describe_key(tenant, key, 1).await?;
    record_key_state(console, tenant, key, &state);
    if state.kind == pb::LimitKind::Floating as i32 {
        if let Some(floating) = console.services.describe_floating(tenant, key).await? {
            record_floating(console, tenant, key, &floating);
        }
    }
    Ok(())
}

pub fn record_key_state(console: &Console, tenant: &str, key: &str, state: &pb::KeyState) {
    let sample = Sample {
        at_ms: now_ms(),
        holders: u32::try_from(state.holders.len()).unwrap_or(u32::MAX),
        waiting: state.waiting,
    };
    lock(&console.watch).record_sample(tenant, key, sample);
}

pub fn record_floating(console: &Console, tenant: &str, key: &str, floating: &pb::DescribeFloatingLimitResponse) {
    if let Some(last) = &floating.last_refresh {
        let outcome = pb::RefreshOutcome::try_from(last.outcome)
            .map(crate::html::refresh_outcome_name)
            .unwrap_or("unknown");
        lock(&console.watch).record_refresh(
            tenant,
            key,
            RefreshRecord {
                at_ms: last.at_ms,
                value: last.value,
                outcome: outcome.to_string(),
                error: last.error.clone(),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tenant_of_a_dead_letter_is_read_from_json_or_protobuf_and_only_when_plain() {
        assert_eq!(tenant_of(br#"{"tenant": "acme", "x": 1}"#), Some("acme".to_string()));
        assert_eq!(tenant_of(br#"{"tenant": 5}"#), None);
        assert_eq!(tenant_of(b"{\"tenant\": \"a\\u0000b\"}"), None);
        let request = pb::JobRequest {
            tenant: "globex".to_string(),
            ..Default::default()
        };
        assert_eq!(tenant_of(&request.encode_to_vec()), Some("globex".to_string()));
        assert_eq!(tenant_of(&[0xff, 0xff, 0xff]), None);
    }

    #[test]
    fn previews_are_short_and_printable() {
        let shown = preview(&[b'a', 0, b'b', b'\n']);
        assert_eq!(shown, "a·b·");
        assert_eq!(preview(&[b'x'; 1000]).len(), PAYLOAD_PREVIEW_BYTES);
    }
}
