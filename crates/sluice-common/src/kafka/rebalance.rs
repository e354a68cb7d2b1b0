//! What a member's consumer knows of its assignment, kept up inside
//! librdkafka's callbacks: the assigned partitions, how many times each was
//! assigned, and which are read to their end.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::consumer::{Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::ClientContext;

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

    pub(super) fn update(&self, partition: i32, change: impl FnOnce(&mut PartitionProgress)) {
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
    pub(super) topic: Arc<str>,
    pub(super) assigned: Arc<Mutex<HashSet<i32>>>,
    pub(super) progress: Arc<ConsumerProgress>,
    /// Since when the group session is lost (librdkafka revoked the
    /// assignment as lost) with no assignment back yet.
    pub(super) lost_since: Arc<Mutex<Option<std::time::Instant>>>,
    pub(super) assignments: Assignments,
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
    /// A member's context: nothing assigned yet.
    pub(super) fn new(topic: Arc<str>, progress: Arc<ConsumerProgress>) -> Self {
        RebalanceContext {
            topic,
            assigned: Arc::new(Mutex::new(HashSet::new())),
            progress,
            lost_since: Arc::new(Mutex::new(None)),
            assignments: Assignments::default(),
        }
    }

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
