//! The pure core of the refresh-dispatcher: one floating key's refresh
//! schedule. At most one refresh task is in flight per key; a failed,
//! out-of-range or unanswered refresh keeps the current max and is retried
//! after an exponential backoff (1 s, x2, capped at 60 s by default) whose
//! retry counter resets on success. Time is always passed in (`now_ms`), so
//! tests drive it like a paused clock.

use std::collections::BTreeMap;

use sluice_proto::v1 as pb;

/// The backoff of failed refreshes and how long a task may stay unanswered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefreshPolicy {
    pub initial_backoff_ms: i64,
    pub max_backoff_ms: i64,
    pub task_timeout_ms: i64,
}

impl Default for RefreshPolicy {
    fn default() -> Self {
        RefreshPolicy {
            initial_backoff_ms: 1_000,
            max_backoff_ms: 60_000,
            task_timeout_ms: 30_000,
        }
    }
}

impl RefreshPolicy {
    /// The wait before retry number `failures` (1 for the first failure):
    /// initial x 2^(failures-1), capped.
    pub fn backoff_ms(&self, failures: u32) -> i64 {
        let doublings = failures.saturating_sub(1).min(62);
        let factor = 1i64 << doublings;
        self.initial_backoff_ms
            .saturating_mul(factor)
            .min(self.max_backoff_ms)
            .max(0)
    }
}

/// The task a key is waiting on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InFlight {
    pub task_id: String,
    pub attempt: u32,
    pub issued_at_ms: i64,
    pub deadline_ms: i64,
}

/// How the last refresh of a key ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LastRefresh {
    pub at_ms: i64,
    pub value: i64,
    pub outcome: pb::RefreshOutcome,
    pub error: String,
}

/// One floating key's schedule, as saved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub current_max: u32,
    /// When `current_max` was learnt: a due event's time or a success's.
    pub current_max_at_ms: i64,
    pub default_max: u32,
    pub refresh_interval_ms: u64,
    pub metadata: BTreeMap<String, String>,
    /// `due_at_ms` of the newest due event seen; older or equal ones are
    /// duplicates (a new limit-grant owner re-sends its last one).
    pub last_due_at_ms: i64,
    pub in_flight: Option<InFlight>,
    /// Failures since the last success.
    pub retry_count: u32,
    /// A failed refresh is retried at this time.
    pub retry_at_ms: Option<i64>,
    pub last_refresh: Option<LastRefresh>,
    pub last_error: String,
    /// The newest value sent to limit-grant, and its task: a new owner
    /// re-sends it (limit-grant applies a task's value once).
    pub applied: Option<(String, u32)>,
    /// Trace context of the due event that started the current refresh.
    pub traceparent: String,
    pub tracestate: String,
}

/// What a report did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReportOutcome {
    /// The new max, to send to limit-grant.
    Applied(u32),
    /// Counted as a failure; retried at `retry_at_ms`.
    Failed {
        outcome: pb::RefreshOutcome,
        reason: String,
        retry_at_ms: i64,
    },
    /// Not the task in flight (stale, or a duplicate of an answered one).
    Ignored(String),
}

/// A worker's answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefreshResult {
    NewMax(i64),
    Error(String),
}

impl Schedule {
    /// A schedule created by the first due event of a key.
    pub fn from_due(due: &pb::RefreshDue) -> Self {
        let trace = due.trace.clone().unwrap_or_default();
        Schedule {
            current_max: due.current_max,
            current_max_at_ms: due.due_at_ms,
            default_max: due.default_max,
            refresh_interval_ms: due.refresh_interval_ms,
            metadata: due.metadata.clone().into_iter().collect(),
            last_due_at_ms: i64::MIN,
            in_flight: None,
            retry_count: 0,
            retry_at_ms: None,
            last_refresh: None,
            last_error: String::new(),
            applied: None,
            traceparent: trace.traceparent,
            tracestate: trace.tracestate,
        }
    }

    /// Take in a due event. True when a task must be issued now: the event
    /// is new, nothing is in flight and no failed refresh waits for its retry
    /// (then the retry is the refresh).
    pub fn on_due(&mut self, due: &pb::RefreshDue) -> bool {
        if due.due_at_ms <= self.last_due_at_ms {
            return false;
        }
        self.last_due_at_ms = due.due_at_ms;
        self.default_max = due.default_max;
        self.refresh_interval_ms = due.refresh_interval_ms;
        self.metadata = due.metadata.clone().into_iter().collect();
        if due.due_at_ms >= self.current_max_at_ms {
            self.current_max = due.current_max;
            self.current_max_at_ms = due.due_at_ms;
        }
        if self.in_flight.is_some() || self.retry_at_ms.is_some() {
            return false;
        }
        let trace = due.trace.clone().unwrap_or_default();
        self.traceparent = trace.traceparent;
        self.tracestate = trace.tracestate;
        true
    }

    /// Start a task (a first try when no failure is pending, else a retry).
    pub fn issue(&mut self, task_id: String, now_ms: i64, policy: &RefreshPolicy) -> InFlight {
        debug_assert!(self.in_flight.is_none(), "one refresh in flight per key");
        let task = InFlight {
            task_id,
            attempt: self.retry_count.saturating_add(1),
            issued_at_ms: now_ms,
            deadline_ms: now_ms.saturating_add(policy.task_timeout_ms),
        };
        self.retry_at_ms = None;
        self.in_flight = Some(task.clone());
        task
    }

    /// A due event newer than the task in flight came while it ran: the
    /// task's value may predate what made the refresh due again (a worker
    /// that computed it before a restart, say), so another refresh follows
    /// its success — limit-grant sends no further due event once nobody
    /// waits, and that one would be lost. A clock skew between the two
    /// services' owners costs at most one extra refresh.
    pub fn due_since_issued(&self) -> bool {
        self.in_flight
            .as_ref()
            .is_some_and(|in_flight| self.last_due_at_ms > in_flight.issued_at_ms)
    }

    /// A worker's report for `task_id`.
    pub fn report(
        &mut self,
        task_id: &str,
        result: RefreshResult,
        now_ms: i64,
        policy: &RefreshPolicy,
    ) -> ReportOutcome {
        let Some(in_flight) = &self.in_flight else {
            return ReportOutcome::Ignored(format!("task {task_id} is not in flight (no refresh is)"));
        };
        if in_flight.task_id != task_id {
            return ReportOutcome::Ignored(format!(
                "task {task_id} is not the one in flight ({})",
                in_flight.task_id
            ));
        }
        match result {
            RefreshResult::NewMax(value) => match u32::try_from(value) {
                Ok(max) if (1..=sluice_common::validate::MAX_CONCURRENCY).contains(&max) => {
                    let task_id = in_flight.task_id.clone();
                    self.in_flight = None;
                    self.retry_count = 0;
                    self.retry_at_ms = None;
                    self.current_max = max;
                    self.current_max_at_ms = now_ms;
                    self.applied = Some((task_id, max));
                    self.last_refresh = Some(LastRefresh {
                        at_ms: now_ms,
                        value,
                        outcome: pb::RefreshOutcome::Succeeded,
                        error: String::new(),
                    });
                    ReportOutcome::Applied(max)
                }
                _ => self.fail(
                    now_ms,
                    value,
                    pb::RefreshOutcome::OutOfRange,
                    format!(
                        "new max {value} is out of range: it must be from 1 to {}",
                        sluice_common::validate::MAX_CONCURRENCY
                    ),
                    policy,
                ),
            },
            RefreshResult::Error(error) => {
                let reason = if error.trim().is_empty() {
                    "the refresh handler failed without a message".to_string()
                } else {
                    error
                };
                self.fail(now_ms, 0, pb::RefreshOutcome::Failed, reason, policy)
            }
        }
    }

    /// Called at or after the in-flight task's deadline: an unanswered task
    /// counts as a failure.
    pub fn time_out(&mut self, now_ms: i64, policy: &RefreshPolicy) -> Option<ReportOutcome> {
        let in_flight = self.in_flight.as_ref()?;
        if now_ms < in_flight.deadline_ms {
            return None;
        }
        let reason = format!(
            "task {} (attempt {}) was not answered within {} ms",
            in_flight.task_id, in_flight.attempt, policy.task_timeout_ms
        );
        Some(self.fail(now_ms, 0, pb::RefreshOutcome::TimedOut, reason, policy))
    }

    /// Whether a failed refresh's retry is due at `now_ms`.
    pub fn retry_due(&self, now_ms: i64) -> bool {
        self.in_flight.is_none() && self.retry_at_ms.is_some_and(|at| at <= now_ms)
    }

    /// When the owner must look at this key next without input.
    pub fn next_wakeup_ms(&self) -> Option<i64> {
        match &self.in_flight {
            Some(in_flight) => Some(in_flight.deadline_ms),
            None => self.retry_at_ms,
        }
    }

    /// When the next refresh can happen: the pending retry, else one
    /// interval after the last due event (limit-grant sends the next due
    /// event then, at the first enqueue or release with waiters). None while
    /// a task is in flight.
    pub fn next_refresh_due_at_ms(&self) -> Option<i64> {
        if self.in_flight.is_some() {
            return None;
        }
        if let Some(retry_at_ms) = self.retry_at_ms {
            return Some(retry_at_ms);
        }
        let interval = i64::try_from(self.refresh_interval_ms).unwrap_or(i64::MAX);
        Some(self.last_due_at_ms.saturating_add(interval))
    }

    fn fail(
        &mut self,
        now_ms: i64,
        value: i64,
        outcome: pb::RefreshOutcome,
        reason: String,
        policy: &RefreshPolicy,
    ) -> ReportOutcome {
        self.in_flight = None;
        self.retry_count = self.retry_count.saturating_add(1);
        let retry_at_ms = now_ms.saturating_add(policy.backoff_ms(self.retry_count));
        self.retry_at_ms = Some(retry_at_ms);
        self.last_error = reason.clone();
        self.last_refresh = Some(LastRefresh {
            at_ms: now_ms,
            value,
            outcome,
            error: reason.clone(),
        });
        ReportOutcome::Failed {
            outcome,
            reason,
            retry_at_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    fn due(at_ms: i64, current_max: u32) -> pb::RefreshDue {
        pb::RefreshDue {
            key: Some(pb::KeyRef {
                tenant: "t".to_string(),
                key: "k".to_string(),
            }),
            current_max,
            refresh_interval_ms: 5_000,
            metadata: [("a".to_string(), "b".to_string())].into_iter().collect(),
            due_at_ms: at_ms,
            waiting: 3,
            default_max: 1,
            trace: None,
        }
    }

    /// A paused clock: time moves only when the test says so.
    struct PausedClock {
        now_ms: i64,
    }

    impl PausedClock {
        fn advance_to(&mut self, at_ms: i64) -> i64 {
            assert!(at_ms >= self.now_ms, "time never goes back");
            self.now_ms = at_ms;
            at_ms
        }
    }

    #[test]
    fn backoff_doubles_from_one_second_and_caps_at_sixty() {
        let policy = RefreshPolicy::default();
        let waits: Vec<i64> = (1..=9).map(|failures| policy.backoff_ms(failures) / 1_000).collect();
        assert_eq!(waits, vec![1, 2, 4, 8, 16, 32, 60, 60, 60]);
        assert_eq!(policy.backoff_ms(u32::MAX), 60_000, "no overflow");
    }

    #[test]
    fn failures_retry_on_the_exact_backoff_sequence_and_success_resets_the_counter() {
        let policy = RefreshPolicy::default();
        let mut clock = PausedClock { now_ms: 0 };
        let mut schedule = Schedule::from_due(&due(0, 2));
        assert!(schedule.on_due(&due(0, 2)));
        let mut task = schedule.issue("t0".to_string(), clock.now_ms, &policy);
        assert_eq!(task.attempt, 1);
        let mut retry_times = Vec::new();
        for attempt in 1..=8u32 {
            let now = clock.advance_to(task.issued_at_ms + 10);
            let outcome = schedule.report(
                &task.task_id,
                RefreshResult::Error("quota api down".into()),
                now,
                &policy,
            );
            let ReportOutcome::Failed { retry_at_ms, .. } = outcome else {
                panic!("a failure: {outcome:?}");
            };
            assert_eq!(schedule.retry_count, attempt);
            assert_eq!(schedule.current_max, 2, "a failure keeps the current max");
            retry_times.push((retry_at_ms - now) / 1_000);
            // Nothing happens before the retry is due, even with new due events.
            assert!(!schedule.retry_due(retry_at_ms - 1));
            assert!(
                !schedule.on_due(&due(retry_at_ms - 1, 2)),
                "a pending retry absorbs due events"
            );
            assert_eq!(schedule.next_wakeup_ms(), Some(retry_at_ms));
            let now = clock.advance_to(retry_at_ms);
            assert!(schedule.retry_due(now));
            task = schedule.issue(format!("t{attempt}"), now, &policy);
            assert_eq!(task.attempt, attempt + 1, "the retry counter numbers the attempts");
        }
        assert_eq!(retry_times, vec![1, 2, 4, 8, 16, 32, 60, 60]);
        let now = clock.advance_to(task.issued_at_ms + 5);
        assert_eq!(
            schedule.report(&task.task_id, RefreshResult::NewMax(7), now, &policy),
            ReportOutcome::Applied(7)
        );
        assert_eq!(schedule.retry_count, 0, "success resets the counter");
        assert_eq!(schedule.retry_at_ms, None);
        assert_eq!(schedule.current_max, 7);
        assert_eq!(schedule.applied, Some((task.task_id.clone(), 7)));
        // The next failure starts the sequence again at 1 s.
        let now = clock.advance_to(now + 10_000);
        assert!(schedule.on_due(&due(now, 7)));
        let task = schedule.issue("again".to_string(), now, &policy);
        assert_eq!(task.attempt, 1);
        let outcome = schedule.report("again", RefreshResult::Error(String::new()), now + 1, &policy);
        assert!(matches!(outcome, ReportOutcome::Failed { retry_at_ms, .. } if retry_at_ms == now + 1 + 1_000));
    }

    #[test]
    fn an_unanswered_task_times_out_as_a_failure() {
        let policy = RefreshPolicy {
            task_timeout_ms: 3_000,
            ..RefreshPolicy::default()
        };
        let mut clock = PausedClock { now_ms: 100 };
        let mut schedule = Schedule::from_due(&due(100, 4));
        assert!(schedule.on_due(&due(100, 4)));
        let task = schedule.issue("t1".to_string(), clock.now_ms, &policy);
        assert_eq!(schedule.next_wakeup_ms(), Some(3_100));
        assert_eq!(schedule.time_out(clock.advance_to(3_099), &policy), None);
        let outcome = schedule.time_out(clock.advance_to(3_100), &policy).expect("timed out");
        assert!(matches!(
            outcome,
            ReportOutcome::Failed {
                outcome: pb::RefreshOutcome::TimedOut,
                retry_at_ms: 4_100,
                ..
            }
        ));
        assert_eq!(schedule.retry_count, 1);
        assert_eq!(schedule.current_max, 4);
        assert!(schedule.last_error.contains("not answered"), "{}", schedule.last_error);
        // The late answer of the timed-out task is stale: it never applies.
        let late = schedule.report(
            &task.task_id,
            RefreshResult::NewMax(9),
            clock.advance_to(3_200),
            &policy,
        );
        assert!(matches!(late, ReportOutcome::Ignored(_)));
        assert_eq!(schedule.current_max, 4);
    }

    #[test]
    fn stale_and_duplicate_reports_are_ignored_and_never_apply_twice() {
        let policy = RefreshPolicy::default();
        let mut schedule = Schedule::from_due(&due(0, 1));
        assert!(schedule.on_due(&due(0, 1)));
        let task = schedule.issue("t1".to_string(), 0, &policy);
        assert!(matches!(
            schedule.report("someone-else", RefreshResult::NewMax(3), 10, &policy),
            ReportOutcome::Ignored(_)
        ));
        assert_eq!(
            schedule.report(&task.task_id, RefreshResult::NewMax(3), 20, &policy),
            ReportOutcome::Applied(3)
        );
        // The same report again (a worker retrying its call) changes nothing.
        let again = schedule.report(&task.task_id, RefreshResult::NewMax(3), 30, &policy);
        assert!(matches!(again, ReportOutcome::Ignored(_)));
        let failure_after = schedule.report(&task.task_id, RefreshResult::Error("late".into()), 40, &policy);
        assert!(matches!(failure_after, ReportOutcome::Ignored(_)));
        assert_eq!(schedule.retry_count, 0);
    }

    #[test]
    fn out_of_range_values_count_as_failures_with_the_reason() {
        let policy = RefreshPolicy::default();
        for value in [
            0,
            -5,
            i64::from(sluice_common::validate::MAX_CONCURRENCY) + 1,
            i64::from(u32::MAX) + 1,
        ] {
            let mut schedule = Schedule::from_due(&due(0, 2));
            assert!(schedule.on_due(&due(0, 2)));
            schedule.issue("t".to_string(), 0, &policy);
            let outcome = schedule.report("t", RefreshResult::NewMax(value), 5, &policy);
            let ReportOutcome::Failed { outcome, reason, .. } = outcome else {
                panic!("{value} must fail");
            };
            assert_eq!(outcome, pb::RefreshOutcome::OutOfRange);
            assert!(reason.contains("out of range"), "{reason}");
            assert_eq!(schedule.current_max, 2);
        }
        let mut schedule = Schedule::from_due(&due(0, 2));
        assert!(schedule.on_due(&due(0, 2)));
        schedule.issue("t".to_string(), 0, &policy);
        assert_eq!(
            schedule.report(
                "t",
                RefreshResult::NewMax(i64::from(sluice_common::validate::MAX_CONCURRENCY)),
                5,
                &policy
            ),
            ReportOutcome::Applied(sluice_common::validate::MAX_CONCURRENCY)
        );
    }

    #[test]
    fn one_task_in_flight_and_duplicate_due_events_are_ignored() {
        let policy = RefreshPolicy::default();
        let mut schedule = Schedule::from_due(&due(1_000, 2));
        assert!(schedule.on_due(&due(1_000, 2)));
        assert!(!schedule.on_due(&due(1_000, 2)), "the same due event again");
        schedule.issue("t1".to_string(), 1_000, &policy);
        assert!(!schedule.on_due(&due(6_000, 2)), "a refresh is already in flight");
        assert_eq!(schedule.last_due_at_ms, 6_000);
        assert_eq!(
            schedule.report("t1", RefreshResult::NewMax(5), 6_100, &policy),
            ReportOutcome::Applied(5)
        );
        // A due event older than the success does not roll the known max back.
        assert!(!schedule.on_due(&due(5_999, 2)));
        assert_eq!(schedule.current_max, 5);
        assert!(schedule.on_due(&due(11_000, 5)));
        assert_eq!(schedule.next_refresh_due_at_ms(), Some(16_000));
    }
}
