//! One membership of the consumer group: the dispatch loop that starts,
//! feeds, restarts and stops the partition tasks, and leaving the group.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{BorrowedMessage, Message};
use rdkafka::Offset;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::consumer::{member_consumer, task_condition, FenceRetakes, MemberEnd, Restart, RESTART_FIRST, RESTART_MAX};
use super::input::{spawn_partition_task, TaskEnd};
use super::queues::{
    mark_at_end, message_cost, note_first_offset, park, pause_or_resume, read_split_queue, split_partition_queues,
    Parked, ParkedTask, SplitQueue, SplitReader,
};
use super::resume::{start_resumed, ResumeSettings, Resumed, ResumedEnd};
use super::{
    probe_config, Assignments, ConsumerOptions, ConsumerProgress, InMsg, KafkaPlumbingError, OffsetStore,
    PartitionInput, PartitionMessages, PartitionTaskError, PartitionTaskFactory, RebalanceContext,
};
use crate::config::KafkaConfig;
use crate::shutdown::Shutdown;

/// A partition task of this member, as the dispatch loop sees it.
struct Running {
    sender: mpsc::Sender<(InMsg, tokio::sync::OwnedSemaphorePermit)>,
    budget: Arc<tokio::sync::Semaphore>,
    stop: CancellationToken,
    /// The first offset handed to the task (where it resumed); -1: none yet.
    first_offset: Arc<std::sync::atomic::AtomicI64>,
    stored: Arc<std::sync::atomic::AtomicI64>,
    started_at: tokio::time::Instant,
    /// Set while the task is behind: the partition is paused in the
    /// consumer and its messages queue here, in order, for a forwarder
    /// that waits for room (`park`).
    parked: Option<Parked>,
}

impl Running {
    /// Where a successor must resume: the last stored offset, else the
    /// first offset this task was given.
    fn resume_point(&self) -> Option<i64> {
        let stored = self.stored.load(std::sync::atomic::Ordering::Relaxed);
        let first = self.first_offset.load(std::sync::atomic::Ordering::Relaxed);
        if stored >= 0 {
            Some(stored)
        } else {
            (first >= 0).then_some(first)
        }
    }
}

type Finished = TaskEnd;
/// (partition, park session, messages forwarded): a parked partition's
/// forwarder has handed over everything it was given.
type CaughtUp = (i32, u64, u64);

/// One membership of the group: the consumer, the partition tasks, and
/// the dispatch loop's bookkeeping. Nothing in it waits on one partition.
struct Member<'a> {
    assignments: Assignments,
    options: &'a ConsumerOptions,
    factory: &'a Arc<dyn PartitionTaskFactory>,
    progress: &'a Arc<ConsumerProgress>,
    shutdown: &'a Shutdown,
    topic: Arc<str>,
    consumer: Arc<StreamConsumer<RebalanceContext>>,
    assigned: Arc<Mutex<HashSet<i32>>>,
    lost_since: Arc<Mutex<Option<std::time::Instant>>>,
    buffer_bytes: usize,
    probe: Arc<ClientConfig>,
    running: HashMap<i32, Running>,
    restarts: HashMap<i32, Restart>,
    fence_retakes: FenceRetakes,
    finished: mpsc::UnboundedSender<Finished>,
    caught_up: mpsc::UnboundedSender<CaughtUp>,
    park_sessions: u64,
    consumed_since_report: u64,
    topic_attribute: [opentelemetry::KeyValue; 1],
    /// Each partition's own queue in the consumer (`split_partition_queues`).
    queues: HashMap<i32, Arc<SplitQueue>>,
    /// The tasks reading them (awaited before the consumer is dropped).
    readers: Vec<tokio::task::JoinHandle<()>>,
    /// Partitions resumed at the start, ahead of the group (`resume`),
    /// whose provisional tasks still run: the member starts no task of its
    /// own for one until its provisional task has ended.
    resumed: HashMap<i32, Resumed>,
}

pub(super) async fn consume_as_member(
    kafka: &KafkaConfig,
    options: &ConsumerOptions,
    factory: &Arc<dyn PartitionTaskFactory>,
    progress: &Arc<ConsumerProgress>,
    shutdown: &Shutdown,
    rejoin_within: Duration,
) -> Result<MemberEnd, KafkaPlumbingError> {
    let topic: Arc<str> = Arc::from(options.topic.as_str());
    let context = RebalanceContext::new(topic.clone(), progress.clone());
    let (assigned, lost_since, assignments) = (
        context.assigned.clone(),
        context.lost_since.clone(),
        context.assignments.clone(),
    );
    let consumer = Arc::new(member_consumer(kafka, options, context)?);
    let queues = split_partition_queues(&consumer, &topic).await;
    consumer.subscribe(&[&options.topic])?;
    let (finished_sender, mut finished) = mpsc::unbounded_channel::<Finished>();
    let (caught_up_sender, mut caught_up) = mpsc::unbounded_channel::<CaughtUp>();
    let (resumed_sender, mut resumed_end) = mpsc::unbounded_channel::<ResumedEnd>();
    let mut member = Member {
        assignments,
        options,
        factory,
        progress,
        shutdown,
        topic_attribute: [opentelemetry::KeyValue::new("topic", topic.to_string())],
        topic,
        consumer: consumer.clone(),
        assigned,
        lost_since,
        buffer_bytes: kafka.consumer_buffer_bytes.max(1),
        probe: Arc::new(probe_config(kafka)),
        running: HashMap::new(),
        restarts: HashMap::new(),
        fence_retakes: FenceRetakes::default(),
        finished: finished_sender,
        caught_up: caught_up_sender,
        park_sessions: 0,
        consumed_since_report: 0,
        queues,
        readers: Vec::new(),
        resumed: HashMap::new(),
    };
    member.resume_orphans(resumed_sender).await;
    let mut reconcile_timer = tokio::time::interval(Duration::from_millis(100));
    reconcile_timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let outcome = loop {
        tokio::select! {
            _ = shutdown.cancelled() => break MemberEnd::Stopped,
            Some((partition, outcome)) = finished.recv() => {
                if let Some(end) = member.task_finished(partition, outcome) {
                    break end;
                }
            }
            Some((partition, session, forwarded)) = caught_up.recv() => {
                member.caught_up(partition, session, forwarded);
            }
            Some((partition, outcome)) = resumed_end.recv() => {
                if let Some(end) = member.resumed_finished(partition, outcome) {
                    break end;
                }
            }
            _ = reconcile_timer.tick() => {
                if let Some(end) = member.reconcile(rejoin_within).await {
                    break end;
                }
            }
            received = consumer.recv() => match received {
                Ok(message) => member.dispatch(message),
                Err(KafkaError::PartitionEOF(partition)) => mark_at_end(progress, partition),
                Err(error) => tracing::warn!(topic = %member.topic, %error, "consumer error"),
            },
        }
    };
    drop(consumer);
    member.leave(&outcome, &mut finished).await;
    Ok(outcome)
}

impl Member<'_> {
    /// Resume the partitions this instance's previous run held when it was
    /// killed (`PartitionTaskFactory::orphans`), each as a provisional task.
    async fn resume_orphans(&mut self, done: mpsc::UnboundedSender<ResumedEnd>) {
        for orphan in self.factory.orphans().await {
            let settings = ResumeSettings {
                topic: &self.topic,
                probe: &self.probe,
                buffer_bytes: self.buffer_bytes,
                channel_capacity: self.options.channel_capacity,
                assignments: &self.assignments,
                stop: self.shutdown.token().child_token(),
                done: done.clone(),
            };
            match start_resumed(orphan, self.factory, settings) {
                Ok(resumed) => {
                    self.resumed.insert(orphan.partition, resumed);
                }
                Err(error) => {
                    tracing::warn!(topic = %self.topic, partition = orphan.partition, %error, "could not resume a partition held before; leaving it to the group");
                }
            }
        }
    }

    /// A provisional task ended: the partition is the group's again (a
    /// crash stops the member, as any task's does).
    fn resumed_finished(&mut self, partition: i32, outcome: Result<(), PartitionTaskError>) -> Option<MemberEnd> {
        self.resumed.remove(&partition);
        match outcome {
            Err(PartitionTaskError::Crashed) => {
                self.shutdown.crash();
                return Some(MemberEnd::Stopped);
            }
            Err(PartitionTaskError::Stopped { reason, .. }) => {
                tracing::warn!(topic = %self.topic, partition, %reason, "a resumed partition's task failed; leaving the partition to the group");
            }
            Ok(()) => {
                tracing::debug!(topic = %self.topic, partition, "a resumed partition's task ended");
            }
        }
        None
    }

    fn start_task(&mut self, partition: i32) {
        let (sender, receiver) = mpsc::channel(self.options.channel_capacity.max(1));
        let stop = self.shutdown.token().child_token();
        let stored = Arc::new(std::sync::atomic::AtomicI64::new(-1));
        let budget = Arc::new(tokio::sync::Semaphore::new(self.buffer_bytes));
        let input = PartitionInput {
            topic: self.topic.clone(),
            partition,
            messages: PartitionMessages {
                receiver,
                budget: budget.clone(),
                capacity: self.buffer_bytes,
            },
            stop: stop.clone(),
            offsets: OffsetStore {
                consumer: Arc::downgrade(&self.consumer),
                probe: self.probe.clone(),
                topic: self.topic.clone(),
                partition,
                stored: stored.clone(),
            },
            max_batch_bytes: self.buffer_bytes,
            assignments: self.assignments.clone(),
            provisional: false,
        };
        let task = self.factory.start(input);
        // A partition paused for an earlier task that fell behind.
        pause_or_resume(&self.consumer, &self.topic, partition, false);
        let first_offset = Arc::new(std::sync::atomic::AtomicI64::new(-1));
        if let Some(queue) = self.queues.get(&partition) {
            self.readers.retain(|reader| !reader.is_finished());
            self.readers.push(tokio::spawn(read_split_queue(SplitReader {
                topic: self.topic.clone(),
                partition,
                queue: queue.clone(),
                sender: sender.clone(),
                budget: budget.clone(),
                buffer_bytes: self.buffer_bytes,
                channel_capacity: self.options.channel_capacity.max(1),
                stop: stop.clone(),
                first_offset: first_offset.clone(),
                progress: self.options.track_end.then(|| self.progress.clone()),
                topic_attribute: self.topic_attribute.clone(),
            })));
        }
        spawn_partition_task(task, partition, self.finished.clone());
        tracing::debug!(topic = %self.topic, partition, "partition task started");
        self.running.insert(
            partition,
            Running {
                sender,
                budget,
                stop,
                first_offset,
                stored,
                started_at: tokio::time::Instant::now(),
                parked: None,
            },
        );
    }

    /// A partition task ended. A crash stops the member; a failure is
    /// restarted after a backoff; a task that gave its partition up to a
    /// newer owner is started again after the retake delay if the
    /// partition is still assigned here.
    fn task_finished(&mut self, partition: i32, outcome: Result<(), PartitionTaskError>) -> Option<MemberEnd> {
        match outcome {
            Err(PartitionTaskError::Crashed) => {
                self.shutdown.crash();
                return Some(MemberEnd::Stopped);
            }
            Err(PartitionTaskError::Stopped { reason, .. }) => {
                let entry = self.running.remove(&partition)?;
                entry.stop.cancel();
                let backoff = self.restarts.get(&partition).map_or(RESTART_FIRST, |previous| {
                    (previous.backoff * 2).clamp(RESTART_FIRST, RESTART_MAX)
                });
                let resume_from = entry.resume_point();
                tracing::error!(
                    topic = %self.topic,
                    partition,
                    %reason,
                    ?resume_from,
                    ?backoff,
                    "partition task failed; restarting it from its last stored offset"
                );
                self.options.readiness.set(
                    task_condition(&self.topic, partition),
                    format!("task failed ({reason}); restarting"),
                );
                self.restarts.insert(
                    partition,
                    Restart {
                        at: tokio::time::Instant::now() + backoff,
                        backoff,
                        resume_from,
                        first_offset: Some(entry.first_offset.clone()),
                    },
                );
            }
            Ok(()) => {
                // Revoked (the next reconcile forgets it), or its input
                // ended: if the partition is still assigned here, a
                // reconcile after the retake delay starts it again, from
                // what this task had stored.
                let entry = self.running.remove(&partition)?;
                if !entry.stop.is_cancelled() {
                    let now = tokio::time::Instant::now();
                    let delay = self.fence_retakes.delay(partition, now);
                    tracing::info!(topic = %self.topic, partition, ?delay, "partition task ended while assigned; starting it again after the delay");
                    self.restarts.entry(partition).or_insert(Restart {
                        at: now + delay,
                        backoff: Duration::ZERO,
                        resume_from: entry.resume_point(),
                        first_offset: Some(entry.first_offset.clone()),
                    });
                }
            }
        }
        None
    }

    /// A parked partition's forwarder handed over everything of `session`
    /// it was given: if nothing came since, resume the partition.
    fn caught_up(&mut self, partition: i32, session: u64, forwarded: u64) {
        let Some(entry) = self.running.get_mut(&partition) else {
            return;
        };
        let done = entry
            .parked
            .as_ref()
            .is_some_and(|parked| parked.session == session && parked.pushed == forwarded);
        if done {
            // Everything queued was handed over: the task has room again,
            // and messages go straight to it.
            entry.parked = None;
            pause_or_resume(&self.consumer, &self.topic, partition, false);
            tracing::debug!(topic = %self.topic, partition, "partition caught up; resumed");
        }
    }

    /// Every tick: leave a membership lost for too long, report the
    /// consumed count, stop the tasks of partitions no longer assigned and
    /// start (or restart, when due) those of assigned ones.
    async fn reconcile(&mut self, rejoin_within: Duration) -> Option<MemberEnd> {
        let lost_for = self
            .lost_since
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .map(|since| since.elapsed());
        if lost_for.is_some_and(|lost_for| lost_for >= rejoin_within) {
            return Some(MemberEnd::MembershipLost);
        }
        self.report_consumed(0);
        let current: HashSet<i32> = self
            .assigned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        self.running.retain(|partition, entry| {
            let keep = current.contains(partition);
            if !keep {
                entry.stop.cancel();
            }
            keep
        });
        let (readiness, topic) = (&self.options.readiness, self.topic.clone());
        self.restarts.retain(|partition, _| {
            let keep = current.contains(partition);
            if !keep {
                readiness.clear(&task_condition(&topic, *partition));
            }
            keep
        });
        let now = tokio::time::Instant::now();
        for partition in current {
            if let Some(resumed) = self.resumed.get(&partition) {
                // The group assigned a resumed partition here: its
                // provisional task gives it up, then this member's own
                // task takes it over.
                if !resumed.stop.is_cancelled() {
                    tracing::info!(topic = %self.topic, partition, "the group assigned a resumed partition here; handing it to the member's own task");
                    resumed.stop.cancel();
                }
                continue;
            }
            if self.running.contains_key(&partition) {
                continue;
            }
            match self.restarts.get_mut(&partition) {
                Some(restart) if restart.at > now => continue,
                Some(restart) => {
                    let late_first = restart
                        .first_offset
                        .take()
                        .map(|first| first.load(std::sync::atomic::Ordering::Relaxed))
                        .filter(|first| *first >= 0);
                    if let Some(offset) = restart.resume_from.take().or(late_first) {
                        seek(&self.consumer, &self.topic, partition, offset).await;
                    }
                }
                None => {}
            }
            self.start_task(partition);
        }
        // A restarted task that has run as long as its backoff is healthy again.
        let running = &self.running;
        self.restarts.retain(|partition, restart| {
            let healthy = running
                .get(partition)
                .is_some_and(|entry| entry.started_at + restart.backoff <= now && restart.at <= entry.started_at);
            if healthy {
                readiness.clear(&task_condition(&topic, *partition));
            }
            !healthy
        });
        None
    }

    /// Add the messages consumed since the last report to the metric, if
    /// more than `more_than`.
    fn report_consumed(&mut self, more_than: u64) {
        if self.consumed_since_report > more_than {
            crate::metrics::metrics()
                .consumed
                .add(self.consumed_since_report, &self.topic_attribute);
            self.consumed_since_report = 0;
        }
    }

    /// Hand a message of the shared queue to its partition's task without
    /// waiting: straight into the task's channel when it has room, else
    /// through the partition's forwarder, pausing the partition (only it
    /// waits). Only partitions without a queue of their own come here
    /// (`split_partition_queues`: the topic grew since the member joined).
    fn dispatch(&mut self, message: BorrowedMessage<'_>) {
        let partition = message.partition();
        let is_assigned = self
            .assigned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(&partition);
        if !is_assigned {
            return;
        }
        if self.options.track_end {
            self.progress.update(partition, |state| state.at_end = false);
        }
        self.consumed_since_report += 1;
        self.report_consumed(255);
        if self.held_for_resumed(partition, message.offset()) {
            return;
        }
        if let Some(restart) = self
            .restarts
            .get_mut(&partition)
            .filter(|restart| restart.at > tokio::time::Instant::now())
        {
            // Its task is waiting to restart; it re-reads from its last
            // stored offset (or this one) then.
            restart.resume_from.get_or_insert(message.offset());
            return;
        }
        if !self.running.contains_key(&partition) {
            self.start_task(partition);
        }
        let detached = InMsg::from_borrowed(&message);
        drop(message);
        let Some(entry) = self.running.get_mut(&partition) else {
            return;
        };
        note_first_offset(&entry.first_offset, &self.topic, partition, detached.offset);
        if let Some(parked) = entry.parked.as_mut() {
            parked.pushed += 1;
            let _ = parked.overflow.send(detached);
            return;
        }
        let cost = message_cost(&detached, self.buffer_bytes);
        let refused = match entry.budget.clone().try_acquire_many_owned(cost) {
            Ok(permit) => match entry.sender.try_send((detached, permit)) {
                Ok(()) => None,
                Err(mpsc::error::TrySendError::Full((detached, _permit))) => Some(detached),
                Err(mpsc::error::TrySendError::Closed(_)) => {
                    tracing::debug!(topic = %self.topic, partition, "partition task gone; message left for the next owner");
                    None
                }
            },
            Err(tokio::sync::TryAcquireError::NoPermits) => Some(detached),
            Err(tokio::sync::TryAcquireError::Closed) => None,
        };
        if let Some(detached) = refused {
            self.park_sessions += 1;
            entry.parked = Some(park(
                ParkedTask {
                    partition,
                    session: self.park_sessions,
                    sender: entry.sender.clone(),
                    budget: entry.budget.clone(),
                    stop: entry.stop.clone(),
                    buffer_bytes: self.buffer_bytes,
                    caught_up: self.caught_up.clone(),
                },
                detached,
            ));
            pause_or_resume(&self.consumer, &self.topic, partition, true);
            tracing::debug!(topic = %self.topic, partition, "partition task behind; paused the partition");
        }
    }

    /// Whether `partition`'s provisional task still runs (it is giving the
    /// partition up): then the member's own task reads from `offset` once
    /// that one has ended.
    fn held_for_resumed(&mut self, partition: i32, offset: i64) -> bool {
        if !self.resumed.contains_key(&partition) {
            return false;
        }
        let restart = self.restarts.entry(partition).or_insert(Restart {
            at: tokio::time::Instant::now(),
            backoff: Duration::ZERO,
            resume_from: None,
            first_offset: None,
        });
        restart.resume_from.get_or_insert(offset);
        true
    }

    /// Stop the tasks; at a clean stop, wait for them to end (each stores
    /// its last offset as it stops) and commit the stored offsets; then
    /// leave the group. Every wait is bounded, and none blocks the runtime.
    async fn leave(self, outcome: &MemberEnd, finished: &mut mpsc::UnboundedReceiver<Finished>) {
        let Member {
            options,
            shutdown,
            topic,
            consumer,
            running,
            restarts,
            queues,
            readers,
            resumed,
            ..
        } = self;
        for entry in running.values() {
            entry.stop.cancel();
        }
        for entry in resumed.values() {
            entry.stop.cancel();
        }
        for partition in restarts.keys() {
            options.readiness.clear(&task_condition(&topic, *partition));
        }
        if matches!(outcome, MemberEnd::Stopped) && !shutdown.is_crashed() {
            let mut left: HashSet<i32> = running.keys().copied().collect();
            let all_ended = tokio::time::timeout(TASKS_END_TIMEOUT, async {
                while !left.is_empty() {
                    match finished.recv().await {
                        Some((partition, _)) => {
                            left.remove(&partition);
                        }
                        None => break,
                    }
                }
            })
            .await;
            if all_ended.is_err() {
                tracing::warn!(topic = %topic, "partition tasks still running {TASKS_END_TIMEOUT:?} after the stop; committing what they stored");
            }
            commit_stored_offsets(&consumer, &topic).await;
        }
        // The split queues hold the consumer too: its last reference must
        // be dropped below, off the runtime.
        drop(queues);
        if tokio::time::timeout(TASKS_END_TIMEOUT, futures::future::join_all(readers))
            .await
            .is_err()
        {
            tracing::warn!(topic = %topic, "partition queue readers still running {TASKS_END_TIMEOUT:?} after the stop");
        }
        consumer.unsubscribe();
        // Closing waits for the group to acknowledge the leave: do it off
        // the async runtime, and not for ever (a broker that is gone never
        // answers). Offset stores hold the consumer weakly, so this is the
        // last strong reference.
        let closed = tokio::time::timeout(CLOSE_TIMEOUT, tokio::task::spawn_blocking(move || drop(consumer))).await;
        match closed {
            Ok(Ok(())) => {}
            Ok(Err(error)) if error.is_panic() => {
                tracing::warn!(topic = %topic, %error, "closing the consumer panicked")
            }
            Ok(Err(error)) => tracing::debug!(topic = %topic, %error, "closing the consumer was cut short"),
            Err(_) => {
                tracing::warn!(topic = %topic, "closing the consumer did not finish within {CLOSE_TIMEOUT:?}; going on")
            }
        }
    }
}

/// Commit the stored offsets synchronously, off the async runtime (it
/// waits for the broker), for at most `CLOSE_TIMEOUT`.
async fn commit_stored_offsets(consumer: &Arc<StreamConsumer<RebalanceContext>>, topic: &str) {
    let committing = consumer.clone();
    let committed = tokio::time::timeout(
        CLOSE_TIMEOUT,
        tokio::task::spawn_blocking(move || committing.commit_consumer_state(rdkafka::consumer::CommitMode::Sync)),
    )
    .await;
    match committed {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(error))) => tracing::debug!(%error, "final offset commit"),
        Ok(Err(error)) => tracing::debug!(%error, "final offset commit was cut short"),
        Err(_) => tracing::warn!(topic = %topic, "the final offset commit did not finish within {CLOSE_TIMEOUT:?}"),
    }
}

/// How long leaving a consumer group may take at shutdown.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a member waits for its partition tasks to end at a stop.
const TASKS_END_TIMEOUT: Duration = Duration::from_secs(10);

/// Point the consumer's position for `partition` at `offset` (a restarted
/// task re-reads what its failed predecessor had not stored).
async fn seek(consumer: &Arc<StreamConsumer<RebalanceContext>>, topic: &Arc<str>, partition: i32, offset: i64) {
    let consumer = consumer.clone();
    let name = topic.clone();
    let sought = tokio::task::spawn_blocking(move || {
        consumer.seek(&name, partition, Offset::Offset(offset), Duration::from_secs(5))
    })
    .await;
    match sought {
        Ok(Ok(())) => tracing::info!(topic = %topic, partition, offset, "re-reading from the last stored offset"),
        Ok(Err(error)) => {
            tracing::warn!(topic = %topic, partition, offset, %error, "seek failed; the next owner re-reads from the committed offset")
        }
        Err(_join) => {}
    }
}
