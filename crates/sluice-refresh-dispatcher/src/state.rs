//! One owned partition of the refresh-dispatcher: the refresh schedules of
//! the floating keys that hash to it. Pure: decisions go into a write set and
//! an outbox that the owner runtime commits and then publishes, so a refresh
//! task is saved as in flight before any worker can see it, and a new max is
//! saved before limit-grant hears of it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use prost::Message;
use sluice_common::kafka::{InMsg, OutMsg, Outbox};
use sluice_common::owner::{apply_entries, OwnedState, Rejected, Reply, WriteSet};
use sluice_common::partition::key_partition;
use sluice_common::validate::{
    check_key_ref, check_metadata, check_u32, check_u64, FieldError, InputLimits, MAX_CONCURRENCY,
    MAX_REFRESH_INTERVAL_MS,
};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::schedule::{RefreshPolicy, RefreshResult, ReportOutcome, Schedule};

/// (tenant, key).
pub type KeyId = (String, String);

/// Where this partition's effects go, and its policy.
#[derive(Clone, Debug)]
pub struct PartitionSettings {
    pub partition: i32,
    pub refresh_due_partitions: i32,
    pub limit_commands_topic: Arc<str>,
    pub limit_partitions: i32,
    pub refresh_tasks_topic: Arc<str>,
    pub refresh_tasks_partitions: i32,
    pub max_message_bytes: usize,
    pub policy: RefreshPolicy,
    /// What refresh-due events are checked against (the edge's bounds).
    pub input: InputLimits,
}

/// Requests from this instance's gRPC handlers.
pub enum LocalRequest {
    Report {
        key: KeyId,
        task_id: String,
        result: RefreshResult,
        reply: oneshot::Sender<pb::ReportRefreshResponse>,
    },
    Describe {
        key: KeyId,
        reply: oneshot::Sender<Option<pb::DescribeFloatingLimitResponse>>,
    },
    Delete {
        key: KeyId,
        reply: oneshot::Sender<pb::DeleteFloatingLimitResponse>,
    },
}

/// The writes of one batch, collapsed per key.
#[derive(Debug, Default)]
pub struct RefreshWrites {
    pub upserts: HashMap<KeyId, Schedule>,
    pub deletes: HashSet<KeyId>,
}

impl RefreshWrites {
    fn upsert(&mut self, key: &KeyId, schedule: &Schedule) {
        self.deletes.remove(key);
        self.upserts.insert(key.clone(), schedule.clone());
    }

    fn delete(&mut self, key: &KeyId) {
        self.upserts.remove(key);
        self.deletes.insert(key.clone());
    }
}

impl WriteSet for RefreshWrites {
    fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.deletes.is_empty()
    }
}

/// What one batch did, for metrics and logs.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchCounts {
    pub issued: u32,
    pub succeeded: u32,
    pub failed: u32,
    pub ignored: u32,
}

pub struct RefreshPartition {
    settings: PartitionSettings,
    epoch: i64,
    schedules: HashMap<KeyId, Schedule>,
    /// Makes task ids unique: (partition, epoch) is never reused, and the
    /// sequence counts the tasks this owner issued.
    issued_by_this_owner: u64,
}

impl RefreshPartition {
    pub fn new(settings: PartitionSettings, epoch: i64) -> Self {
        RefreshPartition {
            settings,
            epoch,
            schedules: HashMap::new(),
            issued_by_this_owner: 0,
        }
    }

    pub fn restore(&mut self, schedules: Vec<(KeyId, Schedule)>) {
        self.schedules.extend(schedules);
    }

    pub fn schedule(&self, tenant: &str, key: &str) -> Option<&Schedule> {
        self.schedules.get(&(tenant.to_string(), key.to_string()))
    }

    /// Apply one due event from limit-grant.
    pub fn apply_due(
        &mut self,
        now_ms: i64,
        due: pb::RefreshDue,
        writes: &mut RefreshWrites,
        outbox: &mut Outbox,
        counts: &mut BatchCounts,
    ) -> Result<(), String> {
        self.check_due(&due).map_err(|error| error.to_string())?;
        let key_id = self.checked_key(due.key.as_ref())?;
        let due = pb::RefreshDue {
            trace: due.trace.as_ref().map(sluice_common::telemetry::checked),
            ..due
        };
        let schedule = self
            .schedules
            .entry(key_id.clone())
            .or_insert_with(|| Schedule::from_due(&due));
        let issue_now = schedule.on_due(&due);
        writes.upsert(&key_id, schedule);
        if issue_now {
            self.issue(now_ms, &key_id, writes, outbox, counts);
        }
        Ok(())
    }

    /// Everything a refresh-due event must satisfy before it changes
    /// anything (the bounds admission checks floating limits against).
    pub fn check_due(&self, due: &pb::RefreshDue) -> Result<(), FieldError> {
        check_key_ref("key", due.key.as_ref(), self.settings.input.max_key_bytes)?;
        check_u32("current_max", due.current_max, 1, MAX_CONCURRENCY)?;
        check_u32("default_max", due.default_max, 1, MAX_CONCURRENCY)?;
        check_u64(
            "refresh_interval_ms",
            due.refresh_interval_ms,
            1,
            MAX_REFRESH_INTERVAL_MS,
        )?;
        check_metadata(
            "metadata",
            &due.metadata,
            self.settings.input.max_floating_metadata_bytes,
        )
    }

    /// The key of an input, refused unless it hashes to this partition.
    fn checked_key(&self, key: Option<&pb::KeyRef>) -> Result<KeyId, String> {
        let Some(key) = key else {
            return Err("refresh-due event without a key".to_string());
        };
        let expected = key_partition(&key.tenant, &key.key, self.settings.refresh_due_partitions);
        if expected != self.settings.partition {
            return Err(format!(
                "key ({:?}, {:?}) hashes to partition {expected}, not {}: a producer partitions differently \
                 or the topic's partition count changed",
                key.tenant, key.key, self.settings.partition
            ));
        }
        Ok((key.tenant.clone(), key.key.clone()))
    }

    fn next_task_id(&mut self) -> String {
        self.issued_by_this_owner += 1;
        format!(
            "rt-{}.{}.{}",
            self.settings.partition, self.epoch, self.issued_by_this_owner
        )
    }

    /// Put a new task in flight for `key_id` and publish it.
    fn issue(
        &mut self,
        now_ms: i64,
        key_id: &KeyId,
        writes: &mut RefreshWrites,
        outbox: &mut Outbox,
        counts: &mut BatchCounts,
    ) {
        let task_id = self.next_task_id();
        let policy = self.settings.policy;
        let Some(schedule) = self.schedules.get_mut(key_id) else {
            return;
        };
        let task = schedule.issue(task_id, now_ms, &policy);
        tracing::debug!(
            tenant = %key_id.0,
            key = %key_id.1,
            task_id = %task.task_id,
            attempt = task.attempt,
            "refresh task issued"
        );
        counts.issued += 1;
        writes.upsert(key_id, schedule);
        let schedule = schedule.clone();
        self.emit_task(key_id, &schedule, outbox);
    }

    fn emit_task(&self, key_id: &KeyId, schedule: &Schedule, outbox: &mut Outbox) {
        let Some(in_flight) = &schedule.in_flight else {
            return;
        };
        let task = pb::RefreshTask {
            task_id: in_flight.task_id.clone(),
            key: Some(key_ref(key_id)),
            current_max: schedule.current_max,
            metadata: schedule.metadata.clone().into_iter().collect(),
            attempt: in_flight.attempt,
            issued_at_ms: in_flight.issued_at_ms,
            deadline_ms: in_flight.deadline_ms,
        };
        let parent = pb::TraceContext {
            traceparent: schedule.traceparent.clone(),
            tracestate: schedule.tracestate.clone(),
        };
        let at = sluice_common::clock::system_time_at_ms;
        let (span, planned) = sluice_common::telemetry::plan_span(
            "sluice-refresh-dispatcher",
            "refresh-dispatcher.issue",
            &parent,
            at(in_flight.issued_at_ms),
            at(in_flight.issued_at_ms),
            || {
                vec![
                    opentelemetry::KeyValue::new("sluice.tenant", key_id.0.clone()),
                    opentelemetry::KeyValue::new("sluice.key", key_id.1.clone()),
                    opentelemetry::KeyValue::new("sluice.refresh.task_id", in_flight.task_id.clone()),
                    opentelemetry::KeyValue::new("sluice.refresh.attempt", i64::from(in_flight.attempt)),
                    opentelemetry::KeyValue::new("sluice.max", i64::from(schedule.current_max)),
                ]
            },
        );
        if let Some(planned) = planned {
            // Recorded once the batch is committed.
            outbox.observe(move || planned.record());
        }
        let partition = key_partition(&key_id.0, &key_id.1, self.settings.refresh_tasks_partitions);
        outbox.push(OutMsg {
            topic: self.settings.refresh_tasks_topic.clone(),
            partition: Some(partition),
            key: Some(format!("{}/{}", key_id.0, key_id.1).into_bytes()),
            payload: task.encode_to_vec(),
            headers: sluice_common::telemetry::trace_headers(&span),
        });
    }

    fn emit_set_max(&self, now_ms: i64, key_id: &KeyId, task_id: &str, max: u32, outbox: &mut Outbox) {
        let command = pb::limit_command::Command::SetFloatingMax(pb::SetFloatingMax {
            key: Some(key_ref(key_id)),
            max,
            task_id: task_id.to_string(),
        });
        self.push_limit_command(now_ms, key_id, command, outbox);
    }

    fn emit_delete(&self, now_ms: i64, key_id: &KeyId, outbox: &mut Outbox) {
        let command = pb::limit_command::Command::DeleteFloating(pb::DeleteFloatingState {
            key: Some(key_ref(key_id)),
        });
        self.push_limit_command(now_ms, key_id, command, outbox);
    }

    /// A command to the key's owner in limit-grant.
    fn push_limit_command(
        &self,
        now_ms: i64,
        key_id: &KeyId,
        command: pb::limit_command::Command,
        outbox: &mut Outbox,
    ) {
        let command = pb::LimitCommand {
            trace: None,
            sent_at_ms: now_ms,
            command: Some(command),
        };
        let partition = key_partition(&key_id.0, &key_id.1, self.settings.limit_partitions);
        outbox.push_entry(
            &self.settings.limit_commands_topic,
            partition,
            &command,
            self.settings.max_message_bytes,
        );
    }

    /// Time out unanswered tasks and start the retries that are due.
    fn run_timers(&mut self, now_ms: i64, writes: &mut RefreshWrites, outbox: &mut Outbox, counts: &mut BatchCounts) {
        let policy = self.settings.policy;
        let mut to_issue = Vec::new();
        for (key_id, schedule) in &mut self.schedules {
            if let Some(outcome) = schedule.time_out(now_ms, &policy) {
                // Logged and counted once the batch is committed.
                let (failed_key, label) = (key_id.clone(), outcome_label(&outcome));
                outbox.observe(move || {
                    log_failure(&failed_key, &outcome);
                    record_outcome(label);
                });
                counts.failed += 1;
                writes.upsert(key_id, schedule);
            }
            if schedule.retry_due(now_ms) {
                to_issue.push(key_id.clone());
            }
        }
        for key_id in to_issue {
            self.issue(now_ms, &key_id, writes, outbox, counts);
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn report(
        &mut self,
        now_ms: i64,
        key_id: &KeyId,
        task_id: &str,
        result: RefreshResult,
        writes: &mut RefreshWrites,
        outbox: &mut Outbox,
        counts: &mut BatchCounts,
    ) -> pb::ReportRefreshResponse {
        let policy = self.settings.policy;
        let Some(schedule) = self.schedules.get_mut(key_id) else {
            counts.ignored += 1;
            return pb::ReportRefreshResponse {
                applied: false,
                detail: format!(
                    "ignored: no refresh is scheduled for ({:?}, {:?}); task {task_id} is stale",
                    key_id.0, key_id.1
                ),
            };
        };
        let due_again = schedule.due_since_issued();
        let outcome = schedule.report(task_id, result, now_ms, &policy);
        // Counted and logged once the batch is committed.
        let label = outcome_label(&outcome);
        outbox.observe(move || record_outcome(label));
        match outcome {
            ReportOutcome::Applied(max) => {
                counts.succeeded += 1;
                writes.upsert(key_id, schedule);
                let (tenant, key, task) = (key_id.0.clone(), key_id.1.clone(), task_id.to_string());
                outbox.observe(move || {
                    tracing::info!(%tenant, %key, task_id = %task, max, "floating max refreshed");
                });
                self.emit_set_max(now_ms, key_id, task_id, max, outbox);
                if due_again {
                    self.issue(now_ms, key_id, writes, outbox, counts);
                }
                pb::ReportRefreshResponse {
                    applied: true,
                    detail: format!("new max {max} sent to the key's owner"),
                }
            }
            ReportOutcome::Failed {
                ref reason,
                retry_at_ms,
                ..
            } => {
                counts.failed += 1;
                writes.upsert(key_id, schedule);
                let (failed_key, failed) = (key_id.clone(), outcome.clone());
                outbox.observe(move || log_failure(&failed_key, &failed));
                pb::ReportRefreshResponse {
                    applied: true,
                    detail: format!(
                        "recorded as failure {} ({reason}); the current max {} stays and the refresh is retried at {retry_at_ms} ms",
                        schedule.retry_count, schedule.current_max
                    ),
                }
            }
            ReportOutcome::Ignored(reason) => {
                counts.ignored += 1;
                pb::ReportRefreshResponse {
                    applied: false,
                    detail: format!("ignored: {reason}"),
                }
            }
        }
    }

    fn describe(&self, key_id: &KeyId) -> Option<pb::DescribeFloatingLimitResponse> {
        let schedule = self.schedules.get(key_id)?;
        Some(pb::DescribeFloatingLimitResponse {
            key: Some(key_ref(key_id)),
            current_max: schedule.current_max,
            default_max: schedule.default_max,
            refresh_interval_ms: schedule.refresh_interval_ms,
            metadata: schedule.metadata.clone().into_iter().collect(),
            last_refresh: schedule.last_refresh.as_ref().map(|last| pb::LastRefresh {
                at_ms: last.at_ms,
                value: last.value,
                outcome: last.outcome as i32,
                error: last.error.clone(),
            }),
            next_refresh_due_at_ms: schedule.next_refresh_due_at_ms(),
            retry_count: schedule.retry_count,
            last_error: schedule.last_error.clone(),
            in_flight_task_id: schedule
                .in_flight
                .as_ref()
                .map(|in_flight| in_flight.task_id.clone())
                .unwrap_or_default(),
            in_flight_deadline_ms: schedule.in_flight.as_ref().map(|in_flight| in_flight.deadline_ms),
        })
    }

    fn apply_local(
        &mut self,
        now_ms: i64,
        local: LocalRequest,
        writes: &mut RefreshWrites,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
        counts: &mut BatchCounts,
    ) {
        match local {
            LocalRequest::Report {
                key,
                task_id,
                result,
                reply,
            } => {
                let response = self.report(now_ms, &key, &task_id, result, writes, outbox, counts);
                replies.push(Box::new(move || {
                    let _ = reply.send(response);
                }));
            }
            LocalRequest::Describe { key, reply } => {
                let described = self.describe(&key);
                replies.push(Box::new(move || {
                    let _ = reply.send(described);
                }));
            }
            LocalRequest::Delete { key, reply } => {
                let deleted = self.schedules.remove(&key).is_some();
                writes.delete(&key);
                // limit-grant forgets its floating state too; the reply waits
                // until the command is published, so a caller that saw an
                // error calls again (deleting twice changes nothing).
                self.emit_delete(now_ms, &key, outbox);
                tracing::info!(tenant = %key.0, key = %key.1, deleted, "floating limit state deleted");
                replies.push(Box::new(move || {
                    let _ = reply.send(pb::DeleteFloatingLimitResponse { deleted });
                }));
            }
        }
    }
}

fn key_ref(key_id: &KeyId) -> pb::KeyRef {
    pb::KeyRef {
        tenant: key_id.0.clone(),
        key: key_id.1.clone(),
    }
}

fn log_failure(key_id: &KeyId, outcome: &ReportOutcome) {
    if let ReportOutcome::Failed {
        outcome,
        reason,
        retry_at_ms,
    } = outcome
    {
        tracing::warn!(
            tenant = %key_id.0,
            key = %key_id.1,
            outcome = outcome.as_str_name(),
            %reason,
            retry_at_ms,
            "floating limit refresh failed; keeping the current max"
        );
    }
}

fn outcome_label(outcome: &ReportOutcome) -> &'static str {
    match outcome {
        ReportOutcome::Applied(_) => "succeeded",
        ReportOutcome::Failed {
            outcome: pb::RefreshOutcome::TimedOut,
            ..
        } => "timed_out",
        ReportOutcome::Failed {
            outcome: pb::RefreshOutcome::OutOfRange,
            ..
        } => "out_of_range",
        ReportOutcome::Failed { .. } => "failed",
        ReportOutcome::Ignored(_) => "ignored",
    }
}

fn record_outcome(label: &'static str) {
    sluice_common::metrics::metrics()
        .refresh_outcomes
        .add(1, &[opentelemetry::KeyValue::new("outcome", label)]);
}

impl OwnedState for RefreshPartition {
    type Local = LocalRequest;
    type Writes = RefreshWrites;
    type Prepared = ();

    fn apply(
        &mut self,
        now_ms: i64,
        messages: &[InMsg],
        locals: Vec<LocalRequest>,
        writes: &mut RefreshWrites,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
        rejected: &mut Vec<Rejected>,
    ) {
        let mut counts = BatchCounts::default();
        self.run_timers(now_ms, writes, outbox, &mut counts);
        for message in messages {
            apply_entries(message, "refresh-due event", rejected, |due: pb::RefreshDue| {
                self.apply_due(now_ms, due, writes, outbox, &mut counts)
            });
        }
        for local in locals {
            self.apply_local(now_ms, local, writes, outbox, replies, &mut counts);
        }
    }

    /// In-flight tasks (a worker may never have seen them) and the newest
    /// value of every key (limit-grant applies a task's value once).
    fn resend_all(&self, now_ms: i64, outbox: &mut Outbox) {
        for (key_id, schedule) in &self.schedules {
            self.emit_task(key_id, schedule, outbox);
            if let Some((task_id, max)) = &schedule.applied {
                self.emit_set_max(now_ms, key_id, task_id, *max, outbox);
            }
        }
    }

    fn next_wakeup_ms(&self) -> Option<i64> {
        self.schedules.values().filter_map(Schedule::next_wakeup_ms).min()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn settings() -> PartitionSettings {
        PartitionSettings {
            partition: 0,
            refresh_due_partitions: 1,
            limit_commands_topic: Arc::from("limits"),
            limit_partitions: 1,
            refresh_tasks_topic: Arc::from("tasks"),
            refresh_tasks_partitions: 1,
            max_message_bytes: 1_000_000,
            input: InputLimits::default(),
            policy: RefreshPolicy {
                initial_backoff_ms: 1_000,
                max_backoff_ms: 60_000,
                task_timeout_ms: 5_000,
            },
        }
    }

    fn due(key: &str, at_ms: i64, current_max: u32) -> pb::RefreshDue {
        pb::RefreshDue {
            key: Some(pb::KeyRef {
                tenant: "t".to_string(),
                key: key.to_string(),
            }),
            current_max,
            default_max: 1,
            refresh_interval_ms: 1_000,
            metadata: [("m".to_string(), "v".to_string())].into_iter().collect(),
            due_at_ms: at_ms,
            waiting: 1,
            trace: None,
        }
    }

    struct Effects {
        tasks: Vec<pb::RefreshTask>,
        set_max: Vec<pb::SetFloatingMax>,
        deletes: usize,
        writes: RefreshWrites,
        replies: Vec<Reply>,
    }

    fn effects(outbox: Outbox, writes: RefreshWrites, replies: Vec<Reply>) -> Effects {
        let mut found = Effects {
            tasks: Vec::new(),
            set_max: Vec::new(),
            deletes: 0,
            writes,
            replies,
        };
        for message in outbox.into_messages() {
            match &*message.topic {
                "tasks" => found
                    .tasks
                    .push(pb::RefreshTask::decode(message.payload.as_slice()).unwrap()),
                "limits" => {
                    for command in pb::LimitCommandBatch::decode(message.payload.as_slice())
                        .unwrap()
                        .commands
                    {
                        match command.command {
                            Some(pb::limit_command::Command::SetFloatingMax(set)) => found.set_max.push(set),
                            Some(pb::limit_command::Command::DeleteFloating(_)) => found.deletes += 1,
                            other => panic!("unexpected command {other:?}"),
                        }
                    }
                }
                other => panic!("unexpected topic {other}"),
            }
        }
        found
    }

    fn step(
        state: &mut RefreshPartition,
        now_ms: i64,
        dues: Vec<pb::RefreshDue>,
        locals: Vec<LocalRequest>,
    ) -> Effects {
        let message = InMsg {
            partition: 0,
            offset: 0,
            key: None,
            payload: Some(pb::RefreshDueBatch { events: dues }.encode_to_vec()),
            headers: Vec::new(),
            timestamp_ms: None,
        };
        let mut writes = RefreshWrites::default();
        let mut outbox = Outbox::new();
        let mut replies = Vec::new();
        let mut rejected = Vec::new();
        state.apply(
            now_ms,
            &[message],
            locals,
            &mut writes,
            &mut outbox,
            &mut replies,
            &mut rejected,
        );
        assert!(rejected.is_empty(), "{rejected:?}");
        effects(outbox, writes, replies)
    }

    fn report(
        key: &str,
        task_id: &str,
        result: RefreshResult,
    ) -> (LocalRequest, oneshot::Receiver<pb::ReportRefreshResponse>) {
        let (reply, receiver) = oneshot::channel();
        (
            LocalRequest::Report {
                key: ("t".to_string(), key.to_string()),
                task_id: task_id.to_string(),
                result,
                reply,
            },
            receiver,
        )
    }

    /// What a batch logs, captured.
    #[derive(Clone, Default)]
    struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_timed_out_task_is_logged_and_counted_once_its_batch_is_committed() {
        let mut state = RefreshPartition::new(settings(), 3);
        assert_eq!(step(&mut state, 100, vec![due("k", 100, 1)], Vec::new()).tasks.len(), 1);
        let logs = Captured::default();
        let subscriber = {
            let logs = logs.clone();
            tracing_subscriber::fmt().with_writer(move || logs.clone()).finish()
        };
        let logged = || {
            String::from_utf8_lossy(&logs.0.lock().unwrap())
                .matches("refresh failed")
                .count()
        };
        tracing::subscriber::with_default(subscriber, || {
            let mut writes = RefreshWrites::default();
            let mut outbox = Outbox::new();
            let (mut replies, mut rejected) = (Vec::new(), Vec::new());
            // Past the task's 5 s deadline: it times out.
            state.apply(
                6_000,
                &[],
                Vec::new(),
                &mut writes,
                &mut outbox,
                &mut replies,
                &mut rejected,
            );
            assert!(!writes.is_empty(), "the failure is saved");
            // Decided, not committed: nothing logged (a batch decided again
            // after a failed commit would log and count it twice).
            assert_eq!(logged(), 0);
            outbox.take_observations().record();
            assert_eq!(logged(), 1);
        });
    }

    #[test]
    fn a_due_event_issues_one_task_and_a_success_sends_the_new_max() {
        let mut state = RefreshPartition::new(settings(), 3);
        let first = step(&mut state, 100, vec![due("k", 100, 1), due("k", 100, 1)], Vec::new());
        assert_eq!(first.tasks.len(), 1, "a duplicate due event issues nothing");
        let task = &first.tasks[0];
        assert_eq!(task.attempt, 1);
        assert_eq!(task.current_max, 1);
        assert_eq!(
            task.metadata.get("m").map(String::as_str),
            Some("v"),
            "metadata passes through unchanged"
        );
        assert_eq!(task.deadline_ms, 5_100);
        assert!(task.task_id.starts_with("rt-0.3."), "{}", task.task_id);
        assert!(first
            .writes
            .upserts
            .values()
            .all(|schedule| schedule.in_flight.is_some()));
        // While it is in flight, another due event issues nothing.
        assert!(step(&mut state, 200, vec![due("k", 200, 1)], Vec::new())
            .tasks
            .is_empty());

        let (local, mut answer) = report("k", &task.task_id, RefreshResult::NewMax(6));
        let done = step(&mut state, 300, Vec::new(), vec![local]);
        assert_eq!(done.set_max.len(), 1);
        assert_eq!(done.set_max[0].max, 6);
        assert_eq!(done.set_max[0].task_id, task.task_id);
        for reply in done.replies {
            reply();
        }
        assert!(answer.try_recv().unwrap().applied);
        // The same report again never applies twice.
        let (local, mut answer) = report("k", &task.task_id, RefreshResult::NewMax(6));
        let again = step(&mut state, 310, Vec::new(), vec![local]);
        assert!(again.set_max.is_empty() && again.writes.is_empty());
        for reply in again.replies {
            reply();
        }
        let answer = answer.try_recv().unwrap();
        assert!(!answer.applied);
        assert!(answer.detail.contains("ignored"), "{}", answer.detail);
    }

    /// A due event that came while a task was in flight is not lost when
    /// that task succeeds: the task's value may predate it (a worker that
    /// computed it before the dispatcher restarted), and limit-grant sends
    /// no further due event once nobody waits — so another task follows.
    /// With no due event since the task was issued, none does.
    #[test]
    fn a_due_event_during_a_task_brings_another_task_after_its_success() {
        let mut state = RefreshPartition::new(settings(), 3);
        let first = step(&mut state, 100, vec![due("k", 100, 1)], Vec::new());
        let task = first.tasks[0].clone();
        assert!(step(&mut state, 200, vec![due("k", 200, 1)], Vec::new())
            .tasks
            .is_empty());
        let (local, _) = report("k", &task.task_id, RefreshResult::NewMax(3));
        let done = step(&mut state, 300, Vec::new(), vec![local]);
        assert_eq!(done.set_max.len(), 1);
        assert_eq!(
            done.tasks.len(),
            1,
            "the due event at 200 came after the task: refresh again"
        );
        let second = done.tasks[0].clone();
        assert_ne!(second.task_id, task.task_id);
        let (local, _) = report("k", &second.task_id, RefreshResult::NewMax(5));
        let done = step(&mut state, 400, Vec::new(), vec![local]);
        assert_eq!(done.set_max.iter().map(|set| set.max).collect::<Vec<_>>(), vec![5]);
        assert!(done.tasks.is_empty(), "no due event since the second task");
    }

    #[test]
    fn failures_and_timeouts_retry_on_timers_and_a_new_owner_resends() {
        let mut state = RefreshPartition::new(settings(), 1);
        let first = step(&mut state, 0, vec![due("k", 0, 2)], Vec::new());
        let task = first.tasks[0].clone();
        let (local, _) = report("k", &task.task_id, RefreshResult::Error("boom".into()));
        let failed = step(&mut state, 10, Vec::new(), vec![local]);
        assert!(failed.tasks.is_empty() && failed.set_max.is_empty());
        assert_eq!(state.next_wakeup_ms(), Some(1_010), "retry after 1 s");
        assert!(step(&mut state, 1_009, Vec::new(), Vec::new()).tasks.is_empty());
        let retried = step(&mut state, 1_010, Vec::new(), Vec::new());
        assert_eq!(retried.tasks.len(), 1);
        assert_eq!(retried.tasks[0].attempt, 2);
        assert_eq!(retried.tasks[0].current_max, 2, "the failure kept the max");
        // Nobody answers: the deadline counts as the second failure, retried after 2 s.
        assert_eq!(state.next_wakeup_ms(), Some(6_010));
        let timed_out = step(&mut state, 6_010, Vec::new(), Vec::new());
        assert!(timed_out.tasks.is_empty());
        let schedule = state.schedule("t", "k").unwrap();
        assert_eq!(schedule.retry_count, 2);
        assert_eq!(schedule.retry_at_ms, Some(8_010));
        let third = step(&mut state, 8_010, Vec::new(), Vec::new());
        assert_eq!(third.tasks[0].attempt, 3);

        // A new owner restores the saved schedule and re-sends the task in flight.
        let saved = state.schedule("t", "k").unwrap().clone();
        let mut next_owner = RefreshPartition::new(settings(), 2);
        next_owner.restore(vec![(("t".to_string(), "k".to_string()), saved)]);
        let mut outbox = Outbox::new();
        next_owner.resend_all(8_500, &mut outbox);
        let resent = effects(outbox, RefreshWrites::default(), Vec::new());
        assert_eq!(resent.tasks.len(), 1);
        assert_eq!(
            resent.tasks[0].task_id, third.tasks[0].task_id,
            "the same task, not a new one"
        );
        // Its answer applies with the new owner.
        let (local, _) = report("k", &third.tasks[0].task_id, RefreshResult::NewMax(4));
        let applied = step(&mut next_owner, 8_600, Vec::new(), vec![local]);
        assert_eq!(applied.set_max.len(), 1);
        assert_eq!(next_owner.schedule("t", "k").unwrap().retry_count, 0);
        let mut outbox = Outbox::new();
        next_owner.resend_all(9_000, &mut outbox);
        let resent = effects(outbox, RefreshWrites::default(), Vec::new());
        assert!(resent.tasks.is_empty());
        assert_eq!(
            resent.set_max.len(),
            1,
            "the newest value is re-sent; limit-grant applies it once"
        );
    }

    #[test]
    fn delete_forgets_the_schedule_and_tells_limit_grant() {
        let mut state = RefreshPartition::new(settings(), 1);
        step(&mut state, 0, vec![due("k", 0, 2)], Vec::new());
        let (reply, mut answer) = oneshot::channel();
        let deleted = step(
            &mut state,
            5,
            Vec::new(),
            vec![LocalRequest::Delete {
                key: ("t".to_string(), "k".to_string()),
                reply,
            }],
        );
        assert_eq!(deleted.deletes, 1);
        assert!(deleted.writes.deletes.contains(&("t".to_string(), "k".to_string())));
        for reply in deleted.replies {
            reply();
        }
        assert!(answer.try_recv().unwrap().deleted);
        assert!(state.schedule("t", "k").is_none());
        assert_eq!(state.next_wakeup_ms(), None, "the deleted task no longer times out");
    }

    #[test]
    fn a_key_of_another_partition_stops_the_partition() {
        let mut partitioned = settings();
        partitioned.refresh_due_partitions = 64;
        let mut state = RefreshPartition::new(partitioned, 1);
        let other = (0..100)
            .map(|index| format!("key-{index}"))
            .find(|key| key_partition("t", key, 64) != 0)
            .unwrap();
        let message = InMsg {
            partition: 0,
            offset: 7,
            key: None,
            payload: Some(
                pb::RefreshDueBatch {
                    events: vec![due(&other, 0, 1)],
                }
                .encode_to_vec(),
            ),
            headers: Vec::new(),
            timestamp_ms: None,
        };
        let mut writes = RefreshWrites::default();
        let mut rejected = Vec::new();
        state.apply(
            0,
            &[message],
            Vec::new(),
            &mut writes,
            &mut Outbox::new(),
            &mut Vec::new(),
            &mut rejected,
        );
        assert_eq!(rejected.len(), 1, "set aside, not applied");
        assert_eq!(rejected[0].offset, 7);
        assert!(
            rejected[0].reason.contains("hashes to partition"),
            "{}",
            rejected[0].reason
        );
        assert_eq!(
            pb::RefreshDue::decode(rejected[0].entry.as_slice()).unwrap(),
            due(&other, 0, 1),
            "the refused entry's own bytes"
        );
        assert!(writes.is_empty(), "nothing applied");
    }
}
