//! The job state machine as pure functions: given a job row and what
//! happened, the new row and the effects to publish. The callers write the
//! new row with a compare-and-set on (status, attempt, step), so of two
//! racing transitions (a lease expiry and a late completion) exactly one wins.

use sluice_proto::v1 as pb;

use crate::chain::{History, RetrySettings, StoredStep};

pub type Status = pb::JobStatus;

/// The mutable part of a job row plus what transitions need to read.
#[derive(Clone, Debug, PartialEq)]
pub struct JobState {
    pub job_id: String,
    pub status: Status,
    pub attempt: u32,
    pub attempts_used: u32,
    pub max_attempts: u32,
    pub step: u32,
    pub chain: Vec<StoredStep>,
    pub retry: RetrySettings,
    pub lease_ms: i64,
    pub run_timeout_ms: Option<i64>,
    pub due_at_ms: Option<i64>,
    pub step_started_at_ms: Option<i64>,
    pub admitted_at_ms: Option<i64>,
    pub claimed_by: Option<String>,
    pub claimed_at_ms: Option<i64>,
    pub lease_expires_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub cancel_reason: Option<String>,
    pub last_error: String,
    pub history: History,
    /// The running attempt's worker has shown it holds it (its `Claim`, a
    /// heartbeat, ...). An attempt pushed on a `Work` stream is not, until
    /// the worker heartbeats: one whose lease ends unconfirmed was lost on
    /// its way (with an admission instance or the stream) and never ran, so
    /// it is handed back instead of using up an attempt. Saved (the first
    /// heartbeat's batch journals it before it is answered), so a takeover
    /// keeps it.
    pub confirmed: bool,
    /// When the running attempt's worker was last heard from (its claim, a
    /// heartbeat), by this owner's clock. In memory only, like `confirmed`.
    pub heard_at_ms: Option<i64>,
    /// The running attempt was pushed on a `Work` stream (not claimed):
    /// its worker heartbeats it every third of the stream end grace. Saved,
    /// so that a new owner knows a lost instance's pushes from claims
    /// (`AdmissionPartition::grant_lease_grace`).
    pub pushed: bool,
    /// The running attempt's `Work` stream ended (when, by the clock of
    /// the instance that held it) and its worker was not heard from since:
    /// its lease was shortened to the grace. Saved, like the renewal that
    /// clears it (a heartbeat heard after the end), so that a new owner
    /// knows a dead worker's attempt from a live one's and does not give it
    /// a fresh lease at every takeover (`AdmissionPartition::grant_lease_grace`).
    pub stream_ended_at_ms: Option<i64>,
}

/// Something to publish after the new row is saved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Acquire the job's current step (its current attempt).
    Acquire,
    /// Publish the job to its task group's admitted topic.
    Admitted,
    /// Release tickets of `attempt` for these steps (held, or waiting).
    Release {
        attempt: u32,
        steps: Vec<u32>,
        reason: pb::ReleaseReason,
        /// How long the attempt ran (claim to its end): what adaptive keys
        /// learn from. Set only when the attempt ran and ended here.
        run_ms: Option<i64>,
    },
    /// Remove the job's waiting rate ticket at `step`.
    CancelRateWait { attempt: u32, step: u32 },
}

/// The longest gap between two timer re-sends of one job's pending command,
/// however many jobs its partition holds.
pub const MAX_RESEND_INTERVAL_MS: i64 = 10 * 60 * 1000;

/// Timer re-sends one job partition makes per second, on average, at most:
/// a partition holding more active jobs than this many re-sends per
/// second cover in one interval re-sends each of them less often
/// (`resend_interval`). Re-sends on events (a takeover, a link opened
/// again, an owner moved) are not counted: they are sent at once.
pub const RESENDS_PER_SECOND_PER_PARTITION: i64 = 1_000;

/// Timing settings transitions need.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    pub resend_waiting_after_ms: i64,
    pub claim_timeout_ms: i64,
    /// An admitted job published this long ago, and overtaken by a job of
    /// its task group published later and claimed, is published again
    /// (`partition/overtaken.rs`).
    pub claim_overtaken_after_ms: i64,
}

/// A `Work` stream ended while the attempts it carried ran
/// (`HeartbeatRequest.stream_ended`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamEnd {
    /// When it ended (the serving instance's clock).
    pub closed_at_ms: i64,
    /// How long the worker has to show it is alive.
    pub grace_ms: i64,
}

impl StreamEnd {
    pub fn of(message: &pb::StreamEnded) -> Self {
        Self {
            closed_at_ms: message.closed_at_ms,
            grace_ms: i64::try_from(message.grace_ms).unwrap_or(i64::MAX),
        }
    }

    pub fn message(self) -> pb::StreamEnded {
        pb::StreamEnded {
            closed_at_ms: self.closed_at_ms,
            grace_ms: u64::try_from(self.grace_ms).unwrap_or_default(),
        }
    }
}

/// How far apart the clock that stamps a stream's end (the wall clock of
/// the instance that held the stream) and the partition's clock (anchored at
/// PostgreSQL's) may be. A heartbeat counts as heard after the end only
/// when it is stamped later than the end by more than this: taken the other
/// way, a heartbeat answered just before the stream ended (the same
/// millisecond, or another host's clock a little ahead) kept a dead
/// worker's slot for its whole lease. Shortening a live worker's lease is
/// harmless: it heartbeats within the grace, which renews it.
pub const STREAM_END_CLOCK_SKEW_MS: i64 = 1_000;

/// Shorten the running attempt's lease after its stream ended: to at most
/// `grace_ms` from now, unless the worker was heard from since the stream
/// ended (`STREAM_END_CLOCK_SKEW_MS` later). Never lengthens it. Returns
/// whether the lease changed.
pub fn on_stream_ended(job: &mut JobState, now_ms: i64, ended: StreamEnd) -> bool {
    let heard_since = |heard: i64| heard > ended.closed_at_ms.saturating_add(STREAM_END_CLOCK_SKEW_MS);
    if job.heard_at_ms.is_some_and(heard_since) {
        return false;
    }
    let Some(lease) = job.lease_expires_at_ms else {
        return false;
    };
    let shortened = lease.min(now_ms.saturating_add(ended.grace_ms.max(0)));
    if shortened == lease {
        return false;
    }
    job.lease_expires_at_ms = Some(shortened);
    job.stream_ended_at_ms = Some(ended.closed_at_ms);
    job.due_at_ms = running_due_at(job);
    true
}

/// Why an attempt ended.
#[derive(Clone, Debug, PartialEq)]
pub enum AttemptEnd {
    Succeeded,
    Failed { error: String, non_retryable: bool },
    HandedBack { reason: String },
    LeaseExpired,
    RunTimedOut,
}

impl JobState {
    pub fn chain_len(&self) -> u32 {
        u32::try_from(self.chain.len()).unwrap_or(u32::MAX)
    }

    pub fn is_finished(&self) -> bool {
        matches!(self.status, Status::Succeeded | Status::Failed | Status::Cancelled)
    }

    /// Whether the attempt before this one ended without its worker:
    /// its lease ran out, or it was handed back (by the worker, or as lost
    /// on its way). The worker that had it may be dead, and so may the
    /// consumer of the partition it came from.
    pub fn previous_attempt_lost(&self) -> bool {
        self.history.records.last().is_some_and(|record| {
            record.attempt.saturating_add(1) == self.attempt
                && matches!(record.outcome.as_str(), "lease_expired" | "handed_back")
        })
    }

    /// Effects that give back everything the current attempt holds or waits for.
    pub fn release_everything(&self, reason: pb::ReleaseReason) -> Vec<Effect> {
        let held_through = match self.status {
            Status::Waiting => self.step.saturating_add(1).min(self.chain_len()),
            Status::Admitted | Status::Running | Status::Cancelling => self.chain_len(),
            _ => 0,
        };
        let steps: Vec<u32> = (0..held_through)
            .filter(|index| {
                self.chain
                    .get(usize::try_from(*index).unwrap_or(usize::MAX))
                    .is_some_and(StoredStep::is_ticketed)
            })
            .collect();
        let mut effects = Vec::new();
        if !steps.is_empty() {
            effects.push(Effect::Release {
                attempt: self.attempt,
                steps,
                reason,
                run_ms: None,
            });
        }
        if self.status == Status::Waiting {
            let waiting_on_rate = self
                .chain
                .get(usize::try_from(self.step).unwrap_or(usize::MAX))
                .is_some_and(|step| !step.is_ticketed());
            if waiting_on_rate {
                effects.push(Effect::CancelRateWait {
                    attempt: self.attempt,
                    step: self.step,
                });
            }
        }
        effects
    }

    fn record(&mut self, now_ms: i64, outcome: &str, detail: String) {
        self.history.records.push(pb::AttemptRecord {
            attempt: self.attempt,
            outcome: outcome.to_string(),
            detail,
            at_ms: now_ms,
        });
        // Bounded: the newest 50 records.
        let excess = self.history.records.len().saturating_sub(50);
        if excess > 0 {
            self.history.records.drain(..excess);
        }
    }

    fn clear_run(&mut self) {
        self.confirmed = false;
        self.pushed = false;
        self.stream_ended_at_ms = None;
        self.heard_at_ms = None;
        self.claimed_by = None;
        self.claimed_at_ms = None;
        self.lease_expires_at_ms = None;
        self.admitted_at_ms = None;
    }

    fn finish(&mut self, now_ms: i64, status: Status) {
        self.status = status;
        self.finished_at_ms = Some(now_ms);
        self.due_at_ms = None;
        self.lease_expires_at_ms = None;
    }
}

/// A new attempt starts acquiring from step 0 (or is admitted at once when
/// it has no limits).
pub fn start_acquiring(job: &mut JobState, now_ms: i64, timing: Timing) -> Vec<Effect> {
    job.step = 0;
    job.step_started_at_ms = Some(now_ms);
    if job.chain.is_empty() {
        job.status = Status::Admitted;
        job.admitted_at_ms = Some(now_ms);
        job.due_at_ms = Some(now_ms + timing.claim_timeout_ms);
        return vec![Effect::Admitted];
    }
    job.status = Status::Waiting;
    job.due_at_ms = Some(now_ms + timing.resend_waiting_after_ms);
    vec![Effect::Acquire]
}

/// The interval between two timer re-sends of one job's pending command:
/// `base_ms`, whatever the job has already waited (a lost command costs one
/// interval, never a time that grows with the wait). Only a partition that
/// holds more `active_jobs` than `RESENDS_PER_SECOND_PER_PARTITION` cover in
/// `base_ms` re-sends each of them less often, so that its re-sends stay
/// within that rate; never more than `MAX_RESEND_INTERVAL_MS` (or `base_ms`
/// if longer).
pub fn resend_interval(base_ms: i64, active_jobs: usize) -> i64 {
    let jobs = i64::try_from(active_jobs).unwrap_or(i64::MAX);
    let spread_ms = jobs.saturating_mul(1_000) / RESENDS_PER_SECOND_PER_PARTITION;
    spread_ms.clamp(base_ms, MAX_RESEND_INTERVAL_MS.max(base_ms))
}

/// The timer found the job due; `active_jobs`: how many active jobs its
/// partition holds (`resend_interval`).
pub fn on_due(job: &mut JobState, now_ms: i64, timing: Timing, active_jobs: usize) -> Vec<Effect> {
    match job.status {
        Status::Scheduled => start_acquiring(job, now_ms, timing),
        Status::Waiting => {
            // No grant yet: re-send the pending acquire (idempotent at the
            // owner; a granted ticket's grant is sent again). The last
            // resort: a lost command is re-sent at once when the path to
            // its owner changes; this covers what no event shows.
            job.due_at_ms = Some(now_ms + resend_interval(timing.resend_waiting_after_ms, active_jobs));
            vec![Effect::Acquire]
        }
        Status::Admitted => {
            // Nobody claimed it within claim_timeout: publish (or push)
            // again, every claim_timeout while nobody claims it.
            job.due_at_ms = Some(now_ms + resend_interval(timing.claim_timeout_ms, active_jobs));
            vec![Effect::Admitted]
        }
        Status::Running | Status::Cancelling => {
            let lease_over = job.lease_expires_at_ms.is_some_and(|at| at <= now_ms);
            let run_over = job.status == Status::Running
                && matches!((job.run_timeout_ms, job.claimed_at_ms), (Some(limit), Some(claimed)) if claimed + limit <= now_ms);
            if lease_over && !job.confirmed {
                let reason = lost_on_its_way(job.claimed_by.as_deref().unwrap_or_default());
                end_attempt(job, now_ms, AttemptEnd::HandedBack { reason }, timing)
            } else if lease_over {
                end_attempt(job, now_ms, AttemptEnd::LeaseExpired, timing)
            } else if run_over {
                end_attempt(job, now_ms, AttemptEnd::RunTimedOut, timing)
            } else {
                job.due_at_ms = running_due_at(job);
                Vec::new()
            }
        }
        _ => {
            job.due_at_ms = None;
            Vec::new()
        }
    }
}

/// The reason an unconfirmed attempt whose lease ended is handed back.
fn lost_on_its_way(worker_id: &str) -> String {
    format!("no sign of worker {worker_id:?} within the lease: the attempt was lost on its way (never ran)")
}

/// Whether `worker_id`'s report that `attempt` succeeded, come after the
/// attempt was handed back as lost on its way (its completion reached the
/// owner late: after a takeover, behind everything the new owner's instance
/// had to do), finds the next attempt not started (nobody claimed it): then
/// the job succeeded (`late_success`); else the report is stale.
pub fn succeeds_late(job: &JobState, attempt: u32, worker_id: &str) -> bool {
    let not_started = matches!(job.status, Status::Scheduled | Status::Waiting | Status::Admitted);
    let handed_back_as_lost = job.history.records.last().is_some_and(|record| {
        record.attempt == attempt && record.outcome == "handed_back" && record.detail == lost_on_its_way(worker_id)
    });
    not_started && handed_back_as_lost && job.attempt == attempt.saturating_add(1)
}

/// The job ends succeeded by `attempt` (`succeeds_late` holds): what the
/// next attempt holds or waits for is given back.
pub fn late_success(job: &mut JobState, now_ms: i64, attempt: u32) -> Vec<Effect> {
    let effects = job.release_everything(pb::ReleaseReason::Cancelled);
    job.attempt = attempt;
    job.record(
        now_ms,
        "succeeded",
        "its completion came after it was handed back as lost on its way, before the next attempt started".to_string(),
    );
    job.clear_run();
    job.finish(now_ms, Status::Succeeded);
    effects
}

/// When a running job must be looked at: its lease end or run-time end.
pub fn running_due_at(job: &JobState) -> Option<i64> {
    let run_end = match (job.status, job.run_timeout_ms, job.claimed_at_ms) {
        (Status::Running, Some(limit), Some(claimed)) => Some(claimed + limit),
        _ => None,
    };
    match (job.lease_expires_at_ms, run_end) {
        (Some(lease), Some(run)) => Some(lease.min(run)),
        (lease, run) => lease.or(run),
    }
}

/// End the running attempt. Only valid from Running or Cancelling.
pub fn end_attempt(job: &mut JobState, now_ms: i64, end: AttemptEnd, timing: Timing) -> Vec<Effect> {
    debug_assert!(matches!(job.status, Status::Running | Status::Cancelling));
    let was_cancelling = job.status == Status::Cancelling;
    let (reason, outcome, detail) = attempt_outcome(job, &end);
    let mut effects = job.release_everything(if was_cancelling {
        pb::ReleaseReason::Cancelled
    } else {
        reason
    });
    // What the attempt's run says about its keys' downstream.
    let ran_ms = job.claimed_at_ms.map(|claimed_at_ms| (now_ms - claimed_at_ms).max(0));
    for effect in &mut effects {
        if let Effect::Release { run_ms, .. } = effect {
            *run_ms = ran_ms;
        }
    }
    job.record(
        now_ms,
        if was_cancelling { "cancelled" } else { outcome },
        detail.clone(),
    );
    job.clear_run();
    if was_cancelling {
        job.finish(now_ms, Status::Cancelled);
        return effects;
    }
    let mut all_effects = effects;
    match end {
        AttemptEnd::Succeeded => job.finish(now_ms, Status::Succeeded),
        AttemptEnd::HandedBack { .. } => {
            // A new attempt identity, but no attempt used up.
            job.attempt += 1;
            all_effects.extend(start_acquiring(job, now_ms, timing));
        }
        AttemptEnd::Failed { non_retryable, .. } => {
            job.attempts_used += 1;
            job.last_error = detail;
            if non_retryable || job.attempts_used >= job.max_attempts {
                job.finish(now_ms, Status::Failed);
            } else {
                schedule_retry(job, now_ms);
            }
        }
        AttemptEnd::LeaseExpired => {
            job.attempts_used += 1;
            job.last_error = detail;
            if job.retry.fail_on_lease_expiry || job.attempts_used >= job.max_attempts {
                job.finish(now_ms, Status::Failed);
            } else {
                schedule_retry(job, now_ms);
            }
        }
        AttemptEnd::RunTimedOut => {
            job.attempts_used += 1;
            job.last_error = detail;
            if job.attempts_used >= job.max_attempts {
                job.finish(now_ms, Status::Failed);
            } else {
                schedule_retry(job, now_ms);
            }
        }
    }
    all_effects
}

/// How an attempt's end is released and recorded: the release reason, the
/// history outcome and its detail.
fn attempt_outcome(job: &JobState, end: &AttemptEnd) -> (pb::ReleaseReason, &'static str, String) {
    match end {
        AttemptEnd::Succeeded => (pb::ReleaseReason::Succeeded, "succeeded", String::new()),
        AttemptEnd::Failed { error, .. } => (pb::ReleaseReason::Failed, "failed", error.clone()),
        AttemptEnd::HandedBack { reason } => (pb::ReleaseReason::HandedBack, "handed_back", reason.clone()),
        AttemptEnd::LeaseExpired => (
            pb::ReleaseReason::LeaseExpired,
            "lease_expired",
            format!("no heartbeat within the {} ms lease", job.lease_ms),
        ),
        AttemptEnd::RunTimedOut => (
            pb::ReleaseReason::Failed,
            "run_timed_out",
            format!(
                "ran longer than the task group's {} ms run timeout",
                job.run_timeout_ms.unwrap_or_default()
            ),
        ),
    }
}

fn schedule_retry(job: &mut JobState, now_ms: i64) {
    job.attempt += 1;
    job.step = 0;
    job.status = Status::Scheduled;
    job.due_at_ms = Some(now_ms + job.retry.backoff_ms(job.attempts_used));
}

/// Cancel: a job not running ends now and gives everything back; a running
/// job keeps its tickets until its worker confirms or the lease expires.
pub fn cancel(job: &mut JobState, now_ms: i64, reason: &str) -> Vec<Effect> {
    match job.status {
        Status::Running => {
            job.status = Status::Cancelling;
            job.cancel_reason = Some(reason.to_string());
            Vec::new()
        }
        Status::Scheduled | Status::Waiting | Status::Admitted => {
            let effects = job.release_everything(pb::ReleaseReason::Cancelled);
            job.cancel_reason = Some(reason.to_string());
            job.record(now_ms, "cancelled", reason.to_string());
            job.clear_run();
            job.finish(now_ms, Status::Cancelled);
            effects
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(key: &str, kind: pb::LimitKind) -> StoredStep {
        StoredStep {
            tenant: "t".to_string(),
            key: key.to_string(),
            kind: kind as i32,
            max_concurrency: 1,
            ..Default::default()
        }
    }

    fn job(status: Status) -> JobState {
        JobState {
            job_id: "j".to_string(),
            status,
            attempt: 1,
            attempts_used: 0,
            max_attempts: 3,
            step: 0,
            chain: vec![
                step("a", pb::LimitKind::Concurrency),
                step("b", pb::LimitKind::Floating),
                step("r", pb::LimitKind::Rate),
            ],
            retry: RetrySettings {
                max_attempts: 3,
                initial_backoff_ms: 1000,
                max_backoff_ms: 60_000,
                multiplier: 2.0,
                fail_on_lease_expiry: false,
            },
            lease_ms: 30_000,
            run_timeout_ms: None,
            due_at_ms: None,
            step_started_at_ms: None,
            admitted_at_ms: None,
            claimed_by: Some("w".to_string()),
            claimed_at_ms: Some(0),
            lease_expires_at_ms: Some(30_000),
            confirmed: true,
            heard_at_ms: None,
            pushed: false,
            stream_ended_at_ms: None,
            finished_at_ms: None,
            cancel_reason: None,
            last_error: String::new(),
            history: History::default(),
        }
    }

    const TIMING: Timing = Timing {
        resend_waiting_after_ms: 5_000,
        claim_timeout_ms: 60_000,
        claim_overtaken_after_ms: 3_000,
    };

    #[test]
    fn failure_releases_ticketed_steps_and_schedules_a_retry_with_backoff() {
        let mut running = job(Status::Running);
        running.step = 3;
        let effects = end_attempt(
            &mut running,
            100,
            AttemptEnd::Failed {
                error: "boom".to_string(),
                non_retryable: false,
            },
            TIMING,
        );
        assert_eq!(
            effects,
            vec![Effect::Release {
                attempt: 1,
                steps: vec![0, 1],
                reason: pb::ReleaseReason::Failed,
                // Claimed at 0, failed at 100: adaptive keys learn from it.
                run_ms: Some(100),
            }]
        );
        assert_eq!(running.status, Status::Scheduled);
        assert_eq!((running.attempt, running.attempts_used), (2, 1));
        assert_eq!(running.due_at_ms, Some(1_100));
        assert_eq!(running.last_error, "boom");
    }

    #[test]
    fn an_unconfirmed_attempt_whose_lease_ends_is_handed_back_without_using_an_attempt() {
        let timing = Timing {
            resend_waiting_after_ms: 5_000,
            claim_timeout_ms: 60_000,
            claim_overtaken_after_ms: 3_000,
        };
        let mut pushed = job(Status::Running);
        pushed.step = 3;
        pushed.confirmed = false;
        let effects = on_due(&mut pushed, 30_000, timing, 1);
        assert_eq!(pushed.attempts_used, 0, "a lost push uses no attempt");
        assert_eq!(pushed.attempt, 2);
        assert_eq!(pushed.status, Status::Waiting);
        assert!(effects.contains(&Effect::Acquire));
        assert_eq!(
            pushed.history.records.last().map(|record| record.outcome.as_str()),
            Some("handed_back")
        );

        let mut confirmed = job(Status::Running);
        confirmed.step = 3;
        on_due(&mut confirmed, 30_000, timing, 1);
        assert_eq!(
            confirmed.attempts_used, 1,
            "a confirmed attempt's lease expiry uses one"
        );
        assert_eq!(
            confirmed.history.records.last().map(|record| record.outcome.as_str()),
            Some("lease_expired")
        );
    }

    #[test]
    fn hand_back_starts_a_new_attempt_without_using_one() {
        let mut running = job(Status::Running);
        let effects = end_attempt(
            &mut running,
            5,
            AttemptEnd::HandedBack {
                reason: "shutdown".to_string(),
            },
            TIMING,
        );
        assert_eq!(running.status, Status::Waiting);
        assert_eq!((running.attempt, running.attempts_used), (2, 0));
        assert_eq!(effects.last(), Some(&Effect::Acquire));
    }

    #[test]
    fn attempts_run_out_and_lease_policy_fail_is_honoured() {
        let mut last = job(Status::Running);
        last.attempts_used = 2;
        end_attempt(&mut last, 5, AttemptEnd::LeaseExpired, TIMING);
        assert_eq!(last.status, Status::Failed);
        let mut strict = job(Status::Running);
        strict.retry.fail_on_lease_expiry = true;
        end_attempt(&mut strict, 5, AttemptEnd::LeaseExpired, TIMING);
        assert_eq!(strict.status, Status::Failed);
        assert_eq!(strict.history.records[0].outcome, "lease_expired");
    }

    /// The next attempt of a job whose worker vanished (lease over,
    /// confirmed or not) or gave it back counts as lost; one that failed or
    /// a first attempt does not.
    #[test]
    fn an_attempt_after_one_its_worker_lost_says_so() {
        assert!(!job(Status::Running).previous_attempt_lost(), "a first attempt");
        for confirmed in [true, false] {
            let mut running = job(Status::Running);
            running.confirmed = confirmed;
            on_due(&mut running, 30_000, TIMING, 1);
            assert_eq!(running.attempt, 2);
            assert!(running.previous_attempt_lost(), "confirmed: {confirmed}");
        }
        let mut failed = job(Status::Running);
        let end = AttemptEnd::Failed {
            error: "boom".to_string(),
            non_retryable: false,
        };
        end_attempt(&mut failed, 100, end, TIMING);
        assert_eq!(failed.attempt, 2);
        assert!(!failed.previous_attempt_lost(), "its worker reported the failure");
    }

    #[test]
    fn cancel_of_a_waiting_job_releases_held_and_waiting_tickets() {
        let mut waiting = job(Status::Waiting);
        waiting.step = 2;
        let effects = cancel(&mut waiting, 9, "user");
        assert_eq!(waiting.status, Status::Cancelled);
        assert_eq!(
            effects,
            vec![
                Effect::Release {
                    attempt: 1,
                    steps: vec![0, 1],
                    reason: pb::ReleaseReason::Cancelled,
                    run_ms: None,
                },
                Effect::CancelRateWait { attempt: 1, step: 2 }
            ]
        );
    }

    #[test]
    fn cancel_of_a_running_job_keeps_tickets_until_the_worker_confirms() {
        let mut running = job(Status::Running);
        assert!(cancel(&mut running, 9, "user").is_empty());
        assert_eq!(running.status, Status::Cancelling);
        let effects = end_attempt(&mut running, 10, AttemptEnd::Succeeded, TIMING);
        assert_eq!(running.status, Status::Cancelled);
        assert!(matches!(
            effects[0],
            Effect::Release {
                reason: pb::ReleaseReason::Cancelled,
                ..
            }
        ));
    }

    #[test]
    fn waiting_resends_come_at_a_fixed_interval_whatever_the_wait() {
        let mut waiting = job(Status::Waiting);
        waiting.step_started_at_ms = Some(0);
        assert_eq!(on_due(&mut waiting, 5_000, TIMING, 10), vec![Effect::Acquire]);
        assert_eq!(waiting.due_at_ms, Some(10_000));
        assert_eq!(on_due(&mut waiting, 10_000, TIMING, 10), vec![Effect::Acquire]);
        assert_eq!(waiting.due_at_ms, Some(15_000));
        // Waiting for a day does not stretch it: a lost acquire costs one
        // interval.
        let day = 24 * 3_600_000;
        assert_eq!(on_due(&mut waiting, day, TIMING, 10), vec![Effect::Acquire]);
        assert_eq!(waiting.due_at_ms, Some(day + 5_000));
    }

    #[test]
    fn unclaimed_republishes_come_every_claim_timeout_whatever_the_wait() {
        let mut admitted = job(Status::Admitted);
        admitted.admitted_at_ms = Some(0);
        // TIMING's claim_timeout is 60 s.
        assert_eq!(on_due(&mut admitted, 60_000, TIMING, 10), vec![Effect::Admitted]);
        assert_eq!(admitted.due_at_ms, Some(120_000));
        on_due(&mut admitted, 120_000, TIMING, 10);
        assert_eq!(admitted.due_at_ms, Some(180_000));
        on_due(&mut admitted, 100_000_000, TIMING, 10);
        assert_eq!(admitted.due_at_ms, Some(100_060_000));
    }

    #[test]
    fn a_crowded_partition_spreads_its_resends_within_the_bound() {
        // Up to 5,000 jobs, 1,000 re-sends a second cover them in 5 s.
        assert_eq!(resend_interval(5_000, 0), 5_000);
        assert_eq!(resend_interval(5_000, 5_000), 5_000);
        // 62,500 jobs (a million over 16 partitions): each every 62.5 s,
        // so the partition re-sends about 1,000 a second.
        assert_eq!(resend_interval(5_000, 62_500), 62_500);
        let mut waiting = job(Status::Waiting);
        on_due(&mut waiting, 1_000, TIMING, 62_500);
        assert_eq!(waiting.due_at_ms, Some(63_500));
        // Never beyond the bound, however many jobs.
        assert_eq!(resend_interval(5_000, usize::MAX), MAX_RESEND_INTERVAL_MS);
        // A configured interval longer than the bound is kept.
        assert_eq!(
            resend_interval(2 * MAX_RESEND_INTERVAL_MS, 1),
            2 * MAX_RESEND_INTERVAL_MS
        );
    }

    #[test]
    fn run_timeout_ends_a_job_that_heartbeats_but_hangs() {
        let mut running = job(Status::Running);
        running.run_timeout_ms = Some(1_000);
        running.lease_expires_at_ms = Some(50_000);
        assert_eq!(running_due_at(&running), Some(1_000));
        let effects = on_due(&mut running, 1_000, TIMING, 1);
        assert!(!effects.is_empty());
        assert_eq!(running.status, Status::Scheduled);
        assert_eq!(running.history.records[0].outcome, "run_timed_out");
    }

    #[test]
    fn an_ended_stream_shortens_a_lease_unless_the_worker_was_heard_since() {
        let ended = StreamEnd {
            closed_at_ms: 10_000,
            grace_ms: 5_000,
        };
        let mut silent = job(Status::Running);
        silent.lease_expires_at_ms = Some(40_000);
        silent.heard_at_ms = Some(9_000);
        assert!(on_stream_ended(&mut silent, 10_100, ended));
        assert_eq!(silent.lease_expires_at_ms, Some(15_100));
        assert_eq!(silent.due_at_ms, Some(15_100));

        // Heard at the very end (the same millisecond, or a clock a little
        // ahead): not since; the lease is shortened.
        let mut at_the_end = job(Status::Running);
        at_the_end.lease_expires_at_ms = Some(40_000);
        at_the_end.heard_at_ms = Some(10_000 + STREAM_END_CLOCK_SKEW_MS);
        assert!(on_stream_ended(&mut at_the_end, 11_100, ended));
        assert_eq!(at_the_end.lease_expires_at_ms, Some(16_100));

        let mut heard = job(Status::Running);
        heard.lease_expires_at_ms = Some(40_000);
        heard.heard_at_ms = Some(10_001 + STREAM_END_CLOCK_SKEW_MS);
        assert!(!on_stream_ended(&mut heard, 11_100, ended));
        assert_eq!(heard.lease_expires_at_ms, Some(40_000));

        // Never lengthened, and a huge grace does not overflow.
        let mut ending = job(Status::Running);
        ending.lease_expires_at_ms = Some(12_000);
        assert!(!on_stream_ended(&mut ending, 10_100, ended));
        let huge = StreamEnd {
            closed_at_ms: 10_000,
            grace_ms: i64::MAX,
        };
        assert!(!on_stream_ended(&mut ending, 10_100, huge));
        assert_eq!(ending.lease_expires_at_ms, Some(12_000));
    }
}
