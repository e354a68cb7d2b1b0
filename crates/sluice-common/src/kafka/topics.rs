//! Topics: creating missing ones, refusing an internal topic whose
//! partition count changed, and watching that they stay there.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

use super::{client_config, KafkaPlumbingError};
use crate::config::KafkaConfig;
use crate::shutdown::Shutdown;

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
