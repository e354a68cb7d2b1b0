//! Workers on streams (docs/worker-protocol.md, "The Work stream"): the hub
//! of this instance's open `Work` sessions and their credits.
//!
//! A worker opens a `Work` stream to every admission instance and gives each
//! some credits (how many jobs it may be pushed). When a job partition of
//! this instance admits a job and a session of the job's task group has a
//! credit, the partition claims the job for that session's worker in the
//! same batch (dispatch is the claim) and pushes it once the batch is
//! committed. A push that cannot be written (the stream is gone) hands the
//! attempt back at once; a push lost with the instance costs one lease.
//!
//! The hub is plain data behind short locks and atomics: the partitions'
//! pure cores read it while they decide, and tests drive it directly.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

use sluice_common::auth::JobScope;
use sluice_proto::v1 as pb;
use tokio::sync::mpsc;

/// What a session's stream carries down.
pub type WorkSender = mpsc::Sender<Result<pb::WorkResponse, tonic::Status>>;

/// One open `Work` stream.
pub struct WorkSession {
    pub id: u64,
    pub worker_id: String,
    pub task_groups: Vec<String>,
    /// The jobs its worker may run (its principal's tenants).
    pub scope: JobScope,
    credits: AtomicU32,
    closed: AtomicBool,
    sender: Option<WorkSender>,
    /// Attempts written to the stream and not completed on it (job id →
    /// attempt): when the stream ends, their owners hear of it
    /// (`admission.stream_end_grace`). Its lock also orders a write against
    /// the end, so no written attempt is missed.
    carried: Mutex<HashMap<String, u32>>,
}

impl std::fmt::Debug for WorkSession {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("WorkSession")
            .field("id", &self.id)
            .field("worker_id", &self.worker_id)
            .field("credits", &self.credits.load(Ordering::Relaxed))
            .field("closed", &self.closed.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl WorkSession {
    pub fn credits(&self) -> u32 {
        self.credits.load(Ordering::Acquire)
    }

    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// The worker completed these jobs (on this stream): its attempts are
    /// no longer carried.
    pub fn completed<'a>(&self, attempts: impl IntoIterator<Item = (&'a str, u32)>) {
        let mut carried = self.carried.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        for (job_id, attempt) in attempts {
            if carried.get(job_id) == Some(&attempt) {
                carried.remove(job_id);
            }
        }
    }

    /// Close the session; the attempts it still carried.
    fn end(&self) -> Vec<(String, u32)> {
        let mut carried = self.carried.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        self.closed.store(true, Ordering::Release);
        carried.drain().collect()
    }

    /// Take one credit, if there is one and the session is open.
    fn take_credit(&self) -> bool {
        if self.is_closed() {
            return false;
        }
        self.credits
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |credits| credits.checked_sub(1))
            .is_ok()
    }

    /// Take back up to `credits` unused credits; how many were taken.
    pub fn withdraw(&self, credits: u32) -> u32 {
        let before = self
            .credits
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
                Some(held.saturating_sub(credits))
            })
            .unwrap_or_default();
        before.min(credits)
    }

    fn give_credits(&self, credits: u32) {
        let _ = self
            .credits
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |current| {
                Some(current.saturating_add(credits))
            });
    }

    /// Write jobs to the stream. Fails (giving the jobs back) when the
    /// stream is gone or its buffer is full: the worker then never sees
    /// them, and they must be handed back.
    fn write(&self, jobs: Vec<pb::DispatchedJob>) -> Result<(), Vec<pb::DispatchedJob>> {
        let Some(sender) = &self.sender else {
            return Err(jobs);
        };
        let mut carried = self.carried.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if self.is_closed() {
            return Err(jobs);
        }
        let attempts: Vec<(String, u32)> = jobs
            .iter()
            .filter_map(|dispatched| dispatched.job.as_ref())
            .map(|job| (job.job_id.clone(), job.attempt))
            .collect();
        let message = pb::WorkResponse {
            message: Some(pb::work_response::Message::Jobs(pb::DispatchedJobs { jobs })),
        };
        let written = sender.try_send(Ok(message));
        if written.is_ok() {
            carried.extend(attempts);
        }
        written.map_err(|error| {
            let message = match error {
                mpsc::error::TrySendError::Full(message) | mpsc::error::TrySendError::Closed(message) => message,
            };
            match message {
                Ok(pb::WorkResponse {
                    message: Some(pb::work_response::Message::Jobs(pb::DispatchedJobs { jobs })),
                }) => jobs,
                _ => Vec::new(),
            }
        })
    }
}

/// Attempts claimed for a worker whose push could not be written: to be
/// handed back (a new attempt, none used up).
#[derive(Debug)]
pub struct UndeliveredPush {
    pub worker_id: String,
    pub attempts: Vec<(String, u32)>,
}

/// Attempts just written to a worker's stream: their leases run from now
/// (the job partition that claimed them moves their lease ends there).
#[derive(Debug, PartialEq)]
pub struct PushWritten {
    pub partition: i32,
    pub worker_id: String,
    pub attempts: Vec<(String, u32)>,
    /// The wall-clock time the push's lease ends were stamped from.
    pub written_at_ms: i64,
}

/// What the hub reports about pushes, for the instance to act on.
#[derive(Debug)]
pub struct PushReports {
    /// Pushes that could not be written: hand their attempts back.
    pub undelivered: mpsc::UnboundedReceiver<UndeliveredPush>,
    /// Pushes written: tell their partitions when.
    pub written: mpsc::UnboundedReceiver<PushWritten>,
}

#[derive(Default)]
struct GroupSessions {
    sessions: Vec<Arc<WorkSession>>,
    /// Where the next search for a credit starts (round robin).
    turn: usize,
    /// Job partitions holding admitted jobs of this group that wait for a
    /// credit: woken when credits arrive.
    wanted_by: BTreeSet<i32>,
}

/// This instance's open sessions, by task group.
pub struct WorkerHub {
    groups: RwLock<HashMap<String, Mutex<GroupSessions>>>,
    next_session: AtomicU64,
    undelivered: mpsc::UnboundedSender<UndeliveredPush>,
    written: mpsc::UnboundedSender<PushWritten>,
}

impl std::fmt::Debug for WorkerHub {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("WorkerHub").finish_non_exhaustive()
    }
}

impl WorkerHub {
    /// A hub, and where its reports come out: the attempts of undelivered
    /// pushes (the instance hands them back) and of written ones (their
    /// partitions start their leases). At most one entry per pushed batch,
    /// so the channels are bounded by the credits workers gave.
    pub fn new() -> (Arc<WorkerHub>, PushReports) {
        let (undelivered, undelivered_receiver) = mpsc::unbounded_channel();
        let (written, written_receiver) = mpsc::unbounded_channel();
        (
            Arc::new(WorkerHub {
                groups: RwLock::new(HashMap::new()),
                next_session: AtomicU64::new(1),
                undelivered,
                written,
            }),
            PushReports {
                undelivered: undelivered_receiver,
                written: written_receiver,
            },
        )
    }

    /// A hub with no stream workers (tests of the partition without them).
    pub fn without_workers() -> Arc<WorkerHub> {
        Self::new().0
    }

    /// Register an open stream with `credits` (a stream handler opens with
    /// none and adds the worker's with `add_credits`, which wakes waiting
    /// partitions). `sender: None` makes a session whose every push fails
    /// (tests).
    pub fn open(
        &self,
        worker_id: String,
        task_groups: Vec<String>,
        scope: JobScope,
        credits: u32,
        sender: Option<WorkSender>,
    ) -> Arc<WorkSession> {
        let session = Arc::new(WorkSession {
            id: self.next_session.fetch_add(1, Ordering::Relaxed),
            worker_id,
            task_groups,
            scope,
            credits: AtomicU32::new(credits),
            closed: AtomicBool::new(false),
            sender,
            carried: Mutex::new(HashMap::new()),
        });
        let mut groups = self.groups.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        for group in &session.task_groups {
            let entry = groups.entry(group.clone()).or_default();
            entry
                .get_mut()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .sessions
                .push(session.clone());
        }
        session
    }

    /// The stream ended: no more pushes to it. Returns the attempts written
    /// to it and not completed on it.
    pub fn close(&self, session: &Arc<WorkSession>) -> Vec<(String, u32)> {
        let carried = session.end();
        let mut groups = self.groups.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        for group in &session.task_groups {
            let now_empty = match groups.get_mut(group) {
                Some(entry) => {
                    let entry = entry.get_mut().unwrap_or_else(|poisoned| poisoned.into_inner());
                    entry.sessions.retain(|open| open.id != session.id);
                    entry.sessions.is_empty() && entry.wanted_by.is_empty()
                }
                None => false,
            };
            if now_empty {
                groups.remove(group);
            }
        }
        carried
    }

    /// Add credits to a session. Returns the job partitions that hold
    /// admitted jobs of its task groups waiting for a credit (each once;
    /// the caller wakes them).
    pub fn add_credits(&self, session: &WorkSession, credits: u32) -> BTreeSet<i32> {
        session.give_credits(credits);
        let groups = self.groups.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut wake = BTreeSet::new();
        for group in &session.task_groups {
            if let Some(entry) = groups.get(group) {
                let mut entry = entry.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
                wake.append(&mut entry.wanted_by);
            }
        }
        wake
    }

    /// Whether an open session of `task_group` that may run `tenant`'s jobs
    /// exists (credit or not).
    pub fn has_sessions(&self, task_group: &str, tenant: &str) -> bool {
        self.any_session(task_group, |session| session.scope.allows(tenant))
    }

    /// Whether an open session of `task_group` has a credit.
    pub fn has_credit(&self, task_group: &str) -> bool {
        self.any_session(task_group, |session| session.credits() > 0)
    }

    fn any_session(&self, task_group: &str, test: impl Fn(&WorkSession) -> bool) -> bool {
        let groups = self.groups.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        groups.get(task_group).is_some_and(|entry| {
            entry
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .sessions
                .iter()
                .any(|session| !session.is_closed() && test(session))
        })
    }

    /// Take one credit from a session of `task_group` that may run
    /// `tenant`'s jobs, taking turns among them. `None`: no such session
    /// has room.
    pub fn take(&self, task_group: &str, tenant: &str) -> Option<Arc<WorkSession>> {
        let groups = self.groups.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut entry = groups
            .get(task_group)?
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let count = entry.sessions.len();
        for offset in 0..count {
            let index = (entry.turn + offset) % count;
            if entry.sessions[index].scope.allows(tenant) && entry.sessions[index].take_credit() {
                entry.turn = (index + 1) % count;
                return Some(entry.sessions[index].clone());
            }
        }
        None
    }

    /// Partition `partition` holds admitted jobs of `task_group` that wait
    /// for a credit: wake it when credits arrive.
    pub fn want(&self, task_group: &str, partition: i32) {
        {
            let groups = self.groups.read().unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(entry) = groups.get(task_group) {
                entry
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .wanted_by
                    .insert(partition);
                return;
            }
        }
        let mut groups = self.groups.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        groups
            .entry(task_group.to_string())
            .or_default()
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .wanted_by
            .insert(partition);
    }
}

/// Jobs claimed in one batch for one session, pushed once the batch is
/// committed. Dropped unsent (the commit failed, the batch was decided
/// again) it only gives the credits back: the claim was never committed, so
/// there is nothing to hand back — and handing back would end an attempt
/// that the partition's next owner (or this one, deciding again) claimed
/// for the same worker and pushed (`make bench-backlog`: a job ran twice).
/// Sent after the commit and not written (the stream was gone), it gives
/// the credits back and hands the attempts back: the worker never saw them.
pub struct Push {
    hub: Arc<WorkerHub>,
    session: Arc<WorkSession>,
    /// The job partition that claimed the jobs.
    partition: i32,
    jobs: Vec<pb::DispatchedJob>,
    /// Set by a crash-point fault hook: lost with the instance, as a crash
    /// after the commit loses it (nothing given or handed back).
    lost: bool,
    /// `send` was called: the batch that claimed the jobs is committed.
    committed: bool,
}

impl Push {
    pub fn new(hub: Arc<WorkerHub>, session: Arc<WorkSession>, partition: i32) -> Self {
        Push {
            hub,
            session,
            partition,
            jobs: Vec::new(),
            lost: false,
            committed: false,
        }
    }

    pub fn add(&mut self, job: pb::DispatchedJob) {
        self.jobs.push(job);
    }

    pub fn session_id(&self) -> u64 {
        self.session.id
    }

    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.jobs.is_empty()
    }

    /// The crash point between a commit and the push: this push is lost as
    /// the instance would lose it.
    pub fn lose(mut self) {
        self.lost = true;
    }

    /// Write the jobs to the worker's stream (after the commit). Their
    /// leases run from now, the push (docs/worker-protocol.md §7): the
    /// commit, and whatever waited before it, does not eat into them. The
    /// partition hears of it and moves its own lease ends as far.
    #[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
    pub fn send(mut self) {
        self.committed = true;
        let mut jobs = std::mem::take(&mut self.jobs);
        let now_ms = sluice_common::clock::wall_clock_ms();
        for dispatched in &mut jobs {
            let lease_ms = dispatched
                .job
                .as_ref()
                .map_or(0, |job| i64::try_from(job.lease_ms).unwrap_or(i64::MAX));
            dispatched.lease_expires_at_ms = dispatched.lease_expires_at_ms.max(now_ms.saturating_add(lease_ms));
        }
        let attempts = attempts_of(&jobs);
        match self.session.write(jobs) {
            Ok(()) => {
                let _ = self.hub.written.send(PushWritten {
                    partition: self.partition,
                    worker_id: self.session.worker_id.clone(),
                    attempts,
                    written_at_ms: now_ms,
                });
            }
            Err(jobs) => {
                self.jobs = jobs;
                // Dropped now: undelivered.
            }
        }
    }

    fn hand_back(&mut self) {
        let jobs = std::mem::take(&mut self.jobs);
        if jobs.is_empty() {
            return;
        }
        self.session.give_credits(u32::try_from(jobs.len()).unwrap_or(u32::MAX));
        if !self.committed {
            return;
        }
        let attempts = attempts_of(&jobs);
        let _ = self.hub.undelivered.send(UndeliveredPush {
            worker_id: self.session.worker_id.clone(),
            attempts,
        });
    }
}

fn attempts_of(jobs: &[pb::DispatchedJob]) -> Vec<(String, u32)> {
    jobs.iter()
        .filter_map(|dispatched| dispatched.job.as_ref())
        .map(|job| (job.job_id.clone(), job.attempt))
        .collect()
}

impl Drop for Push {
    fn drop(&mut self) {
        if !self.lost {
            self.hand_back();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dispatched(job_id: &str) -> pb::DispatchedJob {
        pb::DispatchedJob {
            job: Some(pb::AdmittedJob {
                job_id: job_id.to_string(),
                attempt: 1,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_session_takes_only_the_jobs_of_its_tenants() {
        let (hub, _reports) = WorkerHub::new();
        let scoped = JobScope::Tenants(Arc::new(["a".to_string()].into_iter().collect()));
        let session = hub.open("w".into(), vec!["g".into()], scoped, 1, None);
        assert!(hub.has_sessions("g", "a"));
        assert!(!hub.has_sessions("g", "b"));
        assert!(
            hub.take("g", "b").is_none(),
            "a job of tenant b went to a worker of tenant a"
        );
        assert_eq!(session.credits(), 1);
        assert!(hub.take("g", "a").is_some());
    }

    #[test]
    fn credits_are_taken_in_turns_and_never_below_zero() {
        let hub = WorkerHub::without_workers();
        let first = hub.open("a".into(), vec!["g".into()], JobScope::All, 2, None);
        let second = hub.open("b".into(), vec!["g".into()], JobScope::All, 1, None);
        let taken: Vec<String> = std::iter::from_fn(|| hub.take("g", "t"))
            .map(|session| session.worker_id.clone())
            .collect();
        assert_eq!(taken, vec!["a", "b", "a"]);
        assert_eq!(first.credits(), 0);
        assert_eq!(second.credits(), 0);
        assert!(hub.take("other", "t").is_none());
        hub.close(&first);
        assert!(hub.has_sessions("g", "t"));
        hub.close(&second);
        assert!(!hub.has_sessions("g", "t"));
    }

    #[test]
    fn credits_wake_the_partitions_that_wait_for_them_once() {
        let hub = WorkerHub::without_workers();
        let session = hub.open("a".into(), vec!["g".into()], JobScope::All, 0, None);
        hub.want("g", 3);
        hub.want("g", 1);
        assert_eq!(hub.add_credits(&session, 2).into_iter().collect::<Vec<_>>(), vec![1, 3]);
        assert!(hub.add_credits(&session, 1).is_empty());
        assert_eq!(session.credits(), 3);
    }

    /// A stream-less session of worker `w` whose one credit a push of job
    /// `j1` took.
    fn push_of_one_job_to_a_gone_stream() -> (Arc<WorkerHub>, PushReports, Arc<WorkSession>, Push) {
        let (hub, reports) = WorkerHub::new();
        let session = hub.open("w".into(), vec!["g".into()], JobScope::All, 1, None);
        assert!(hub.take("g", "t").is_some());
        let mut push = Push::new(hub.clone(), session.clone(), 0);
        push.add(dispatched("j1"));
        (hub, reports, session, push)
    }

    #[test]
    fn a_push_to_a_gone_stream_is_handed_back_with_its_credit() {
        let (_hub, mut reports, session, push) = push_of_one_job_to_a_gone_stream();
        push.send();
        let handed = reports.undelivered.try_recv().unwrap();
        assert_eq!(handed.worker_id, "w");
        assert_eq!(handed.attempts, vec![("j1".to_string(), 1)]);
        assert_eq!(session.credits(), 1, "the credit came back");
    }

    #[test]
    fn a_push_written_to_an_open_stream_is_not_handed_back() {
        let (hub, mut reports) = WorkerHub::new();
        let (sender, mut receiver) = mpsc::channel(4);
        let session = hub.open("w".into(), vec!["g".into()], JobScope::All, 1, Some(sender));
        assert!(hub.take("g", "t").is_some());
        let mut push = Push::new(hub.clone(), session.clone(), 0);
        push.add(dispatched("j1"));
        push.send();
        let written = receiver.try_recv().unwrap().unwrap();
        assert!(matches!(written.message, Some(pb::work_response::Message::Jobs(_))));
        assert!(reports.undelivered.try_recv().is_err());
        let reported = reports.written.try_recv().unwrap();
        assert_eq!(
            reported,
            PushWritten {
                partition: 0,
                worker_id: "w".to_string(),
                attempts: vec![("j1".to_string(), 1)],
                written_at_ms: reported.written_at_ms,
            },
            "the partition hears when its push was written"
        );
        assert!(reported.written_at_ms > 0);
        assert_eq!(session.credits(), 0);
    }

    /// The lease of a pushed job runs from the push, not from the claim
    /// decided before the commit (issue 29: pushes arrived 5 s into their
    /// leases).
    #[test]
    #[allow(clippy::disallowed_methods, reason = "a test's own clock")]
    fn a_pushed_lease_starts_when_the_push_is_written() {
        let (hub, _reports) = WorkerHub::new();
        let (sender, mut receiver) = mpsc::channel(4);
        let session = hub.open("w".into(), vec!["g".into()], JobScope::All, 1, Some(sender));
        let mut push = Push::new(hub.clone(), session.clone(), 0);
        let mut claimed_long_ago = dispatched("j1");
        if let Some(job) = claimed_long_ago.job.as_mut() {
            job.lease_ms = 30_000;
        }
        // Claimed at 1,000 ms (decided, then a slow commit).
        claimed_long_ago.lease_expires_at_ms = 1_000 + 30_000;
        push.add(claimed_long_ago);
        let before = sluice_common::clock::wall_clock_ms();
        push.send();
        let after = sluice_common::clock::wall_clock_ms();
        let Some(pb::work_response::Message::Jobs(jobs)) = receiver.try_recv().unwrap().unwrap().message else {
            panic!("no jobs written");
        };
        let lease_end = jobs.jobs[0].lease_expires_at_ms;
        assert!(
            (before + 30_000..=after + 30_000).contains(&lease_end),
            "lease end {lease_end} not a lease from the push ({before}..{after})"
        );
    }

    /// A push whose batch was never committed (fenced, or decided again
    /// after a failed commit) hands nothing back: the attempt it named may
    /// be the one the next decision claimed for the same worker, pushed and
    /// running. Its credit comes back.
    #[test]
    fn a_push_dropped_before_its_commit_returns_its_credit_and_hands_nothing_back() {
        let (_hub, mut reports, session, push) = push_of_one_job_to_a_gone_stream();
        drop(push);
        assert!(
            reports.undelivered.try_recv().is_err(),
            "an uncommitted claim was handed back"
        );
        assert_eq!(session.credits(), 1, "the credit came back");
    }

    #[test]
    fn a_lost_push_neither_returns_credit_nor_hands_back() {
        let (_hub, mut reports, session, push) = push_of_one_job_to_a_gone_stream();
        push.lose();
        assert!(reports.undelivered.try_recv().is_err());
        assert_eq!(session.credits(), 0);
    }

    #[test]
    fn a_closed_stream_names_the_attempts_written_to_it_and_not_completed() {
        let (hub, _reports) = WorkerHub::new();
        let (sender, _receiver) = mpsc::channel(4);
        let session = hub.open("w".into(), vec!["g".into()], JobScope::All, 3, Some(sender));
        let mut push = Push::new(hub.clone(), session.clone(), 0);
        push.add(dispatched("j1"));
        push.add(dispatched("j2"));
        push.send();
        // A completion of another attempt of j2 does not count.
        session.completed([("j1", 1), ("j2", 7)]);
        assert_eq!(hub.close(&session), vec![("j2".to_string(), 1)]);
        // Nothing is written, or carried, after the end.
        let mut late = Push::new(hub.clone(), session.clone(), 0);
        late.add(dispatched("j3"));
        late.send();
        assert!(hub.close(&session).is_empty());
    }

    #[test]
    fn withdrawn_credits_are_at_most_those_held() {
        let hub = WorkerHub::without_workers();
        let session = hub.open("w".into(), vec!["g".into()], JobScope::All, 5, None);
        assert!(hub.take("g", "t").is_some(), "a push used one");
        assert_eq!(session.withdraw(3), 3);
        assert_eq!(session.withdraw(3), 1, "only what was left");
        assert_eq!(session.credits(), 0);
        assert!(hub.take("g", "t").is_none());
    }
}
