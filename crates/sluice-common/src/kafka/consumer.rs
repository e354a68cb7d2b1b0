//! The partitioned consumer: its entry point (`run_partitioned_consumer`),
//! the configuration of a group member's consumer, and the delays before a
//! partition task is started again.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rdkafka::consumer::StreamConsumer;

use super::member::consume_as_member;
use super::{client_config, ConsumerProgress, KafkaPlumbingError, PartitionTaskFactory, RebalanceContext};
use crate::config::KafkaConfig;
use crate::shutdown::Shutdown;

pub struct ConsumerOptions {
    pub group: String,
    pub topic: String,
    pub channel_capacity: usize,
    /// Report partition ends (`ConsumerProgress`); costs nothing when idle.
    pub track_end: bool,
    /// Where a failed partition task is reported (NOT_SERVING until it runs again).
    pub readiness: crate::readiness::Readiness,
}

/// Consume `topic` in `group`, one task per assigned partition, until
/// shutdown or a crash. A crash (fault hooks) stops everything. A partition
/// task that fails — it returned an error, or it panicked — is restarted
/// after a backoff (1 s, doubling to 30 s) from its last stored offset, and
/// readiness is NOT_SERVING until the restarted task has run for as long as
/// the backoff: no partition stays stopped.
///
/// A member whose group session is lost (it could not heartbeat in time)
/// normally rejoins by itself. If no assignment comes back within twice the
/// session timeout, the consumer is re-created and joins as a new member:
/// seen with tansu under CPU starvation, and harmless with Kafka.
pub async fn run_partitioned_consumer(
    kafka: &KafkaConfig,
    options: ConsumerOptions,
    factory: Arc<dyn PartitionTaskFactory>,
    progress: Arc<ConsumerProgress>,
    shutdown: Shutdown,
) -> Result<(), KafkaPlumbingError> {
    let rejoin_within = Duration::from_millis(u64::from(kafka.session_timeout_ms) * 2).max(Duration::from_secs(10));
    loop {
        match consume_as_member(kafka, &options, &factory, &progress, &shutdown, rejoin_within).await? {
            MemberEnd::Stopped => return Ok(()),
            MemberEnd::MembershipLost => {
                tracing::warn!(
                    topic = %options.topic,
                    group = %options.group,
                    ?rejoin_within,
                    "no assignment since the group session was lost; re-creating the consumer"
                );
            }
        }
    }
}

pub(super) enum MemberEnd {
    Stopped,
    MembershipLost,
}

/// A partition whose task ended while the consumer still has it assigned
/// is started again after a delay: the first time `RETAKE_FIRST`, doubling
/// for each end within `RETAKE_FORGET` of the last, up to `RETAKE_MAX`.
/// (A task fenced by a newer owner does not end: it stands by until that
/// owner lets the partition go, `owner/task.rs`, so two members that both hold a
/// partition during an overlapping rebalance do not take it from each other
/// back and forth.)
pub(super) const RETAKE_FIRST: Duration = Duration::from_millis(500);
pub(super) const RETAKE_MAX: Duration = Duration::from_secs(8);
const RETAKE_FORGET: Duration = Duration::from_secs(30);

/// The fences each partition met lately (`RETAKE_FIRST`).
#[derive(Debug, Default)]
pub(super) struct FenceRetakes {
    recent: HashMap<i32, (u32, tokio::time::Instant)>,
}

impl FenceRetakes {
    /// `partition` was just given up to a newer owner: how long to wait
    /// before taking it over again.
    pub(super) fn delay(&mut self, partition: i32, now: tokio::time::Instant) -> Duration {
        let (count, last) = self.recent.entry(partition).or_insert((0, now));
        if now.saturating_duration_since(*last) > RETAKE_FORGET {
            *count = 0;
        }
        *count = count.saturating_add(1);
        *last = now;
        let doublings = (*count - 1).min(16);
        RETAKE_FIRST.saturating_mul(1u32 << doublings).min(RETAKE_MAX)
    }
}

pub(super) const RESTART_FIRST: Duration = Duration::from_secs(1);
pub(super) const RESTART_MAX: Duration = Duration::from_secs(30);

/// A partition whose task failed: when to start it again, and from where.
pub(super) struct Restart {
    pub(super) at: tokio::time::Instant,
    pub(super) backoff: Duration,
    pub(super) resume_from: Option<i64>,
    /// The ended task's first offset, read again at the restart when it
    /// stored none: its partition's reader may have taken a message (and
    /// let it go) after the task ended.
    pub(super) first_offset: Option<Arc<std::sync::atomic::AtomicI64>>,
}

/// The readiness condition of a failed partition task.
pub(super) fn task_condition(topic: &str, partition: i32) -> String {
    format!("{topic} partition {partition}")
}

/// The consumer of one group member, configured for partition tasks: its
/// own offsets stored by the tasks and committed in the background,
/// cooperative rebalances, and librdkafka's prefetch bounded like ours.
pub(super) fn member_consumer(
    kafka: &KafkaConfig,
    options: &ConsumerOptions,
    context: RebalanceContext,
) -> Result<StreamConsumer<RebalanceContext>, KafkaPlumbingError> {
    let buffer_bytes = kafka.consumer_buffer_bytes.max(1);
    let mut client = client_config(kafka);
    client
        .set("group.id", &options.group)
        .set("enable.auto.commit", "true")
        .set("enable.auto.offset.store", "false")
        .set("auto.commit.interval.ms", "200")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", kafka.session_timeout_ms.to_string())
        // Also the coordinator's rebalance timeout: how long a rebalance
        // waits for a member that stopped polling (a zombie) before going on
        // without it. librdkafka's 300 s default stalls a group for minutes.
        .set(
            "max.poll.interval.ms",
            (kafka.session_timeout_ms.saturating_mul(3)).max(30_000).to_string(),
        )
        .set(
            "heartbeat.interval.ms",
            (kafka.session_timeout_ms / 5).max(100).to_string(),
        )
        .set("fetch.wait.max.ms", kafka.fetch_wait_max_ms.to_string())
        // librdkafka's prefetch queue, bounded like ours.
        .set("queued.max.messages.kbytes", (buffer_bytes / 1024).max(1).to_string())
        .set("enable.partition.eof", if options.track_end { "true" } else { "false" })
        // A member that rejoined while its topic was gone (a broker that
        // lost its log) is assigned nothing, and only notices the topic
        // created again on its next metadata refresh, which triggers a
        // rebalance. librdkafka's 5-minute default would leave the topic
        // unconsumed that long; refresh as often as topics are checked.
        .set(
            "topic.metadata.refresh.interval.ms",
            kafka
                .topic_check_interval
                .0
                .as_millis()
                .clamp(1_000, 300_000)
                .to_string(),
        )
        .set("statistics.interval.ms", "15000");
    for (key, value) in &kafka.properties {
        client.set(key, value);
    }
    Ok(client.create_with_context(context)?)
}
