//! Property test of the admission core: any interleaving of claims,
//! heartbeats, completions (success, failure, hand-back) from several
//! workers and of time passing (leases expiring, backoffs ending) keeps one
//! running attempt per job: a claim wins only for the job's current attempt
//! and only once, only the holder's completion is accepted, and a worker that
//! lost its lease can no longer complete.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use proptest::prelude::*;
use sluice_common::kafka::Outbox;
use sluice_common::owner::{OwnedState, Rejected, Reply};
use sluice_common::{Faults, SluiceConfig};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::transitions::JobState;

use super::*;

const JOBS: usize = 3;
const WORKERS: usize = 3;

#[derive(Clone, Debug)]
enum Op {
    Claim {
        worker: usize,
        job: usize,
        attempt: u32,
    },
    Heartbeat {
        worker: usize,
        job: usize,
        attempt: u32,
    },
    Complete {
        worker: usize,
        job: usize,
        attempt: u32,
        end: u8,
    },
    Advance {
        ms: i64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..WORKERS, 0..JOBS, 1u32..4).prop_map(|(worker, job, attempt)| Op::Claim { worker, job, attempt }),
        1 => (0..WORKERS, 0..JOBS, 1u32..4).prop_map(|(worker, job, attempt)| Op::Heartbeat { worker, job, attempt }),
        3 => (0..WORKERS, 0..JOBS, 1u32..4, 0u8..3)
            .prop_map(|(worker, job, attempt, end)| Op::Complete { worker, job, attempt, end }),
        2 => (0i64..40_000).prop_map(|ms| Op::Advance { ms }),
    ]
}

fn job_id(job: usize) -> String {
    format!("job-{job}")
}

fn worker_id(worker: usize) -> String {
    format!("worker-{worker}")
}

struct Harness {
    partition: AdmissionPartition,
    now_ms: i64,
    /// What the partition's commits saved: its active jobs as a new owner
    /// loads them (`AdmissionStore::load`, without PostgreSQL).
    saved: HashMap<String, crate::jobs::JobRow>,
    saved_seq: i64,
}

impl Harness {
    fn new() -> Self {
        Harness::with_limits(Vec::new())
    }

    /// Jobs that each list `limits` (none: admitted at once).
    fn with_limits(limits: Vec<pb::Limit>) -> Self {
        Harness::with_hub(limits, crate::work::WorkerHub::without_workers())
    }

    /// Jobs that each list `limits`, with `hub`'s stream workers.
    fn with_hub(limits: Vec<pb::Limit>, hub: Arc<crate::work::WorkerHub>) -> Self {
        let config = Arc::new(SluiceConfig::load_with(None, &[]).expect("default configuration"));
        let settings = crate::partition_settings(&config, &Faults::none(), hub);
        let mut harness = Harness {
            partition: AdmissionPartition::new(settings, Vec::new(), 0, None, 0),
            now_ms: 1_800_000_000_000,
            saved: HashMap::new(),
            saved_seq: 0,
        };
        // Three attempts each.
        let jobs: Vec<Incoming> = (0..JOBS)
            .map(|job| {
                let request = pb::JobRequest {
                    job_id: Some(job_id(job)),
                    tenant: "acme".to_string(),
                    task_group: "default".to_string(),
                    payload: b"x".to_vec(),
                    limits: limits.clone(),
                    retry: Some(pb::RetryPolicy {
                        max_attempts: 3,
                        initial_backoff: "1s".to_string(),
                        max_backoff: "2s".to_string(),
                        ..pb::RetryPolicy::default()
                    }),
                    ..pb::JobRequest::default()
                };
                Incoming {
                    job_id: job_id(job),
                    valid: crate::chain::validate(&config, request).expect("a valid request"),
                    trace: pb::TraceContext::default(),
                }
            })
            .collect();
        let (reply, mut answer) = oneshot::channel();
        harness.apply(vec![Local::Enqueue {
            jobs,
            on_conflict: OnConflict::Refuse,
            reply,
        }]);
        let outcomes = answer.try_recv().expect("answered").expect("no conflict");
        let expected = if limits.is_empty() {
            Status::Admitted
        } else {
            Status::Waiting
        };
        assert!(
            outcomes.iter().all(|outcome| outcome.status == expected),
            "{outcomes:?}"
        );
        harness
    }

    fn apply(&mut self, locals: Vec<Local>) {
        self.apply_sending(locals);
    }

    /// `apply`, returning what the batch sends.
    fn apply_sending(&mut self, locals: Vec<Local>) -> Outbox {
        let mut writes = AdmissionWrites::default();
        let mut outbox = Outbox::new();
        let mut replies: Vec<Reply> = Vec::new();
        let mut rejected: Vec<Rejected> = Vec::new();
        self.partition.apply(
            self.now_ms,
            &[],
            locals,
            &mut writes,
            &mut outbox,
            &mut replies,
            &mut rejected,
        );
        self.save(writes);
        for reply in replies {
            reply();
        }
        outbox
    }

    /// Fold a committed batch's writes into what a new owner would load.
    fn save(&mut self, writes: AdmissionWrites) {
        let mut created: HashMap<String, crate::jobs::JobRow> = writes
            .inserted
            .into_iter()
            .map(|mut row| {
                row.payload = Vec::new();
                (row.state.job_id.clone(), row)
            })
            .collect();
        if let Some((seq, batch)) = writes.journal {
            crate::journal::replay(&mut self.saved, &mut created, batch);
            self.saved_seq = seq;
        }
        if let Some((seq, snapshot)) = writes.snapshot {
            self.saved = snapshot
                .jobs
                .into_iter()
                .map(|job| {
                    let row = job.into_row(0);
                    (row.state.job_id.clone(), row)
                })
                .collect();
            self.saved_seq = seq;
        }
    }

    /// Another instance takes the partition over: it loads what was saved
    /// and gives running attempts their takeover lease, as
    /// `OwnedState::begin_serving` does when the owner starts serving.
    fn take_over(&mut self) {
        self.take_over_from(false);
    }

    /// A takeover from an owner that was alive (`true`: a handover) or
    /// crashed.
    fn take_over_from(&mut self, live_owner: bool) {
        let settings = self.partition.settings().clone();
        let rows: Vec<crate::jobs::JobRow> = self.saved.values().cloned().collect();
        self.partition = AdmissionPartition::new(settings, rows, self.saved_seq, None, 0);
        self.partition.handed_over_by_live_owner(live_owner);
        OwnedState::begin_serving(&mut self.partition, self.now_ms);
    }

    /// `admission.stream_end_grace` in milliseconds.
    fn stream_end_grace_ms(&self) -> i64 {
        i64::try_from(
            self.partition
                .settings()
                .config
                .admission
                .stream_end_grace
                .0
                .as_millis(),
        )
        .unwrap()
    }

    /// The jobs running now (claimed or pushed), in job order.
    fn running_jobs(&self) -> Vec<usize> {
        (0..JOBS)
            .filter(|job| self.state(*job).is_some_and(|state| state.status == Status::Running))
            .collect()
    }

    fn state(&self, job: usize) -> Option<&JobState> {
        self.partition.job(&job_id(job)).map(|row| &row.state)
    }
}

/// The model: who holds each job's current attempt, as the answers said.
#[derive(Default)]
struct Model {
    holder: HashMap<usize, (u32, usize)>,
    /// Attempts handed back as lost on its way, and their worker.
    lost: HashMap<usize, (u32, usize)>,
    won: HashSet<(usize, u32)>,
}

fn check(harness: &mut Harness, model: &mut Model, op: &Op) -> Result<(), TestCaseError> {
    apply_op(harness, model, op)?;
    check_holders(harness, model)
}

/// Apply `op`, checking its answers against the model.
fn apply_op(harness: &mut Harness, model: &mut Model, op: &Op) -> Result<(), TestCaseError> {
    match *op {
        Op::Claim { worker, job, attempt } => {
            let before = harness.state(job).map(|state| (state.status, state.attempt));
            let (reply, mut answer) = oneshot::channel();
            harness.apply(vec![Local::Claim {
                scope: sluice_common::auth::JobScope::All,
                worker_id: worker_id(worker),
                attempts: vec![(job_id(job), attempt)],
                reply,
            }]);
            let results = answer.try_recv().map_err(|_| TestCaseError::fail("claim unanswered"))?;
            let outcome = results.first().map(|result| result.outcome);
            if outcome == Some(pb::ClaimOutcome::Claimed as i32) {
                prop_assert_eq!(
                    before,
                    Some((Status::Admitted, attempt)),
                    "won a claim of an attempt not admitted"
                );
                prop_assert!(
                    model.won.insert((job, attempt)),
                    "two claims of job {} attempt {} won",
                    job,
                    attempt
                );
                model.holder.insert(job, (attempt, worker));
                let state = harness.state(job).expect("active");
                prop_assert_eq!(state.status, Status::Running);
                prop_assert_eq!(state.claimed_by.clone(), Some(worker_id(worker)));
            }
        }
        Op::Heartbeat { worker, job, attempt } => {
            let (reply, mut answer) = oneshot::channel();
            harness.apply(vec![Local::Heartbeat {
                scope: sluice_common::auth::JobScope::All,
                worker_id: worker_id(worker),
                attempts: vec![(job_id(job), attempt)],
                ended: None,
                reply,
            }]);
            let results = answer
                .try_recv()
                .map_err(|_| TestCaseError::fail("heartbeat unanswered"))?;
            let extended = results
                .first()
                .is_some_and(|result| result.outcome == pb::HeartbeatOutcome::Extended as i32);
            if extended {
                prop_assert_eq!(
                    model.holder.get(&job).copied(),
                    Some((attempt, worker)),
                    "a non-holder's lease extended"
                );
            }
        }
        Op::Complete {
            worker,
            job,
            attempt,
            end,
        } => {
            let end_kind = end;
            let end = match end {
                0 => AttemptEnd::Succeeded,
                1 => AttemptEnd::Failed {
                    error: "boom".to_string(),
                    non_retryable: false,
                },
                _ => AttemptEnd::HandedBack {
                    reason: "busy".to_string(),
                },
            };
            let (reply, mut answer) = oneshot::channel();
            harness.apply(vec![Local::Complete {
                scope: sluice_common::auth::JobScope::All,
                worker_id: worker_id(worker),
                completions: vec![(job_id(job), attempt, end)],
                caller_trace: pb::TraceContext::default(),
                reply,
            }]);
            let results = answer
                .try_recv()
                .map_err(|_| TestCaseError::fail("complete unanswered"))?;
            let accepted = results
                .first()
                .is_some_and(|result| result.outcome == pb::CompleteOutcome::Accepted as i32);
            let late_success = accepted
                && matches!(end_kind, 0)
                && model.lost.get(&job) == Some(&(attempt, worker))
                && !model.holder.contains_key(&job)
                && harness.state(job).is_none();
            if late_success {
                // Its next attempt had not started: the job succeeded.
                model.lost.remove(&job);
            } else if accepted {
                prop_assert_eq!(
                    model.holder.remove(&job),
                    Some((attempt, worker)),
                    "a non-holder's completion accepted"
                );
            }
        }
        Op::Advance { ms } => {
            harness.now_ms += ms;
            harness.apply(Vec::new());
        }
    }
    Ok(())
}

fn check_holders(harness: &Harness, model: &mut Model) -> Result<(), TestCaseError> {
    // One running attempt per job, held by the worker the answers named;
    // an attempt that is no longer running has no holder.
    for job in 0..JOBS {
        let running = harness
            .state(job)
            .filter(|state| state.status == Status::Running)
            .map(|state| (state.attempt, state.claimed_by.clone()));
        match running {
            Some((attempt, claimed_by)) => {
                let holder = model.holder.get(&job).copied();
                prop_assert_eq!(
                    holder.map(|(held, _)| held),
                    Some(attempt),
                    "job {} runs an attempt nobody won",
                    job
                );
                prop_assert_eq!(claimed_by, holder.map(|(_, worker)| worker_id(worker)));
            }
            None => {
                // Handed back as lost on its way (no sign of its worker):
                // its worker's success may still come, and ends the job
                // while the next attempt has not started.
                if let Some(held) = model.holder.remove(&job) {
                    let lost = harness.state(job).is_some_and(|state| {
                        state.history.records.last().is_some_and(|record| {
                            record.attempt == held.0
                                && record.outcome == "handed_back"
                                && record.detail.starts_with("no sign of worker")
                        })
                    });
                    if lost {
                        model.lost.insert(job, held);
                    }
                }
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn one_running_attempt_per_job_whatever_the_workers_and_the_clock_do(ops in proptest::collection::vec(op(), 1..80)) {
        let mut harness = Harness::new();
        let mut model = Model::default();
        for op in &ops {
            check(&mut harness, &mut model, op)?;
        }
    }
}

/// A grant event, as limit-grant sends it, for one step of one attempt.
fn grant(job: usize, attempt: u32, step: u32) -> pb::GrantEvent {
    pb::GrantEvent {
        ticket: Some(pb::TicketId {
            job_id: job_id(job),
            attempt,
            step,
        }),
        key: Some(pb::KeyRef {
            tenant: "acme".to_string(),
            key: format!("k{step}"),
        }),
        kind: pb::LimitKind::Concurrency as i32,
        holders: 1,
        max: 1,
        ..pb::GrantEvent::default()
    }
}

#[derive(Clone, Debug)]
enum GrantOp {
    /// A grant for (job, attempt, step), maybe a duplicate or stale one.
    Grant {
        job: usize,
        attempt: u32,
        step: u32,
    },
    /// The grant the job waits for now.
    Pending {
        job: usize,
    },
    /// The holder finishes: success, or failure (a retry).
    Run {
        job: usize,
        fail: bool,
    },
    Advance {
        ms: i64,
    },
}

fn grant_op() -> impl Strategy<Value = GrantOp> {
    prop_oneof![
        3 => (0..JOBS, 1u32..4, 0u32..3).prop_map(|(job, attempt, step)| GrantOp::Grant { job, attempt, step }),
        3 => (0..JOBS).prop_map(|job| GrantOp::Pending { job }),
        2 => (0..JOBS, any::<bool>()).prop_map(|(job, fail)| GrantOp::Run { job, fail }),
        1 => (0i64..5_000).prop_map(|ms| GrantOp::Advance { ms }),
    ]
}

fn two_limits() -> Vec<pb::Limit> {
    (0..2)
        .map(|step| pb::Limit {
            kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                key: format!("k{step}"),
                max_concurrency: 1,
                shadow: false,
            })),
        })
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Jobs with two limits under duplicated, stale and out-of-order grants:
    /// a job moves a step only on the grant of the step it waits on (so it
    /// is admitted only holding every limit of its chain), and that grant
    /// always moves it (no lost wake-up).
    #[test]
    fn a_job_advances_exactly_on_the_grant_of_its_pending_step(ops in proptest::collection::vec(grant_op(), 1..80)) {
        let mut harness = Harness::with_limits(two_limits());
        for op in &ops {
            match *op {
                GrantOp::Grant { job, attempt, step } => {
                    let before = harness.state(job).map(|state| (state.status, state.attempt, state.step));
                    harness.apply(vec![Local::Grants(vec![grant(job, attempt, step)])]);
                    let after = harness.state(job).map(|state| (state.status, state.attempt, state.step));
                    match before {
                        Some((Status::Waiting, current, pending)) if current == attempt && pending == step => {
                            let moved = if step + 1 >= 2 {
                                Some((Status::Admitted, attempt, step + 1))
                            } else {
                                Some((Status::Waiting, attempt, step + 1))
                            };
                            prop_assert_eq!(after, moved, "the pending step's grant must move the job");
                        }
                        _ => prop_assert_eq!(after, before, "a grant for another step or attempt moved the job"),
                    }
                }
                GrantOp::Pending { job } => {
                    let Some((Status::Waiting, attempt, step)) =
                        harness.state(job).map(|state| (state.status, state.attempt, state.step))
                    else {
                        continue;
                    };
                    harness.apply(vec![Local::Grants(vec![grant(job, attempt, step)])]);
                    let after = harness.state(job).map(|state| (state.status, state.step));
                    prop_assert!(
                        after == Some((Status::Waiting, step + 1)) || after == Some((Status::Admitted, step + 1)),
                        "job {} waiting on step {} did not move: {:?}", job, step, after
                    );
                }
                GrantOp::Run { job, fail } => {
                    let Some((Status::Admitted, attempt)) =
                        harness.state(job).map(|state| (state.status, state.attempt))
                    else {
                        continue;
                    };
                    prop_assert_eq!(harness.state(job).map(|state| state.step), Some(2), "admitted without every grant");
                    let (reply, mut answer) = oneshot::channel();
                    harness.apply(vec![Local::Claim {
                        scope: sluice_common::auth::JobScope::All,
                        worker_id: worker_id(0),
                        attempts: vec![(job_id(job), attempt)],
                        reply,
                    }]);
                    let claimed = answer.try_recv().map_err(|_| TestCaseError::fail("claim unanswered"))?;
                    prop_assert_eq!(claimed.first().map(|result| result.outcome), Some(pb::ClaimOutcome::Claimed as i32));
                    let end = if fail {
                        AttemptEnd::Failed { error: "boom".to_string(), non_retryable: false }
                    } else {
                        AttemptEnd::Succeeded
                    };
                    let (reply, mut answer) = oneshot::channel();
                    harness.apply(vec![Local::Complete {
                        scope: sluice_common::auth::JobScope::All,
                        worker_id: worker_id(0),
                        completions: vec![(job_id(job), attempt, end)],
                        caller_trace: pb::TraceContext::default(),
                        reply,
                    }]);
                    let completed = answer.try_recv().map_err(|_| TestCaseError::fail("complete unanswered"))?;
                    prop_assert_eq!(completed.first().map(|result| result.outcome), Some(pb::CompleteOutcome::Accepted as i32));
                }
                GrantOp::Advance { ms } => {
                    harness.now_ms += ms;
                    harness.apply(Vec::new());
                }
            }
            // A waiting or admitted job's step never passes its chain.
            for job in 0..JOBS {
                if let Some(state) = harness.state(job) {
                    prop_assert!(state.step <= 2);
                    if state.status == Status::Admitted || state.status == Status::Running {
                        prop_assert_eq!(state.step, 2, "job {} admitted without every grant", job);
                    }
                }
            }
        }
    }
}

// -- stream workers: dispatch is the claim ----------------------------------

#[derive(Clone, Debug)]
enum StreamOp {
    Open {
        worker: usize,
    },
    Credits {
        worker: usize,
        credits: u32,
    },
    Close {
        worker: usize,
    },
    /// A Kafka worker's unary claim of whatever attempt.
    Claim {
        worker: usize,
        job: usize,
        attempt: u32,
    },
    /// The end of an attempt, reported by a worker.
    Complete {
        worker: usize,
        job: usize,
        attempt: u32,
        end: u8,
    },
    Advance {
        ms: i64,
    },
}

fn stream_op() -> impl Strategy<Value = StreamOp> {
    prop_oneof![
        2 => (0..WORKERS).prop_map(|worker| StreamOp::Open { worker }),
        4 => (0..WORKERS, 0u32..3).prop_map(|(worker, credits)| StreamOp::Credits { worker, credits }),
        1 => (0..WORKERS).prop_map(|worker| StreamOp::Close { worker }),
        1 => (0..WORKERS, 0..JOBS, 1u32..4).prop_map(|(worker, job, attempt)| StreamOp::Claim { worker, job, attempt }),
        4 => (0..WORKERS, 0..JOBS, 1u32..4, 0u8..3)
            .prop_map(|(worker, job, attempt, end)| StreamOp::Complete { worker, job, attempt, end }),
        2 => (0i64..40_000).prop_map(|ms| StreamOp::Advance { ms }),
    ]
}

type Downstream = tokio::sync::mpsc::Receiver<Result<pb::WorkResponse, tonic::Status>>;

/// Stream workers around a harness, doing what the `Work` service does:
/// credits wake the partition, undelivered pushes are handed back.
struct StreamWorkers {
    hub: Arc<crate::work::WorkerHub>,
    reports: crate::work::PushReports,
    sessions: HashMap<usize, (Arc<crate::work::WorkSession>, Downstream)>,
    /// Credits each worker gave, and pushes it received, over all its
    /// sessions.
    given: HashMap<usize, u64>,
    pushed: HashMap<usize, u64>,
}

impl StreamWorkers {
    fn wake(&self, harness: &mut Harness, partitions: std::collections::BTreeSet<i32>) {
        if partitions.contains(&0) {
            harness.apply(vec![Local::Dispatch]);
        }
    }

    /// Read what reached the workers and hand back what did not, as the
    /// service does, until nothing moves.
    fn settle(&mut self, harness: &mut Harness, model: &mut Model) -> Result<(), TestCaseError> {
        loop {
            for (worker, (_, downstream)) in &mut self.sessions {
                while let Ok(message) = downstream.try_recv() {
                    let Ok(pb::WorkResponse {
                        message: Some(pb::work_response::Message::Jobs(jobs)),
                    }) = message
                    else {
                        continue;
                    };
                    for dispatched in jobs.jobs {
                        let job = dispatched.job.expect("a pushed job");
                        let index: usize = job.job_id.trim_start_matches("job-").parse().expect("a job index");
                        prop_assert!(
                            model.won.insert((index, job.attempt)),
                            "job {} attempt {} pushed or claimed twice",
                            index,
                            job.attempt
                        );
                        prop_assert!(dispatched.lease_expires_at_ms > 0);
                        model.holder.insert(index, (job.attempt, *worker));
                        *self.pushed.entry(*worker).or_default() += 1;
                    }
                }
            }
            // Written: the partition starts their leases now.
            while let Ok(written) = self.reports.written.try_recv() {
                // (Stamped by the harness's clock, not the push's wall clock.)
                let written_at_ms = harness.now_ms;
                harness.apply(vec![Local::Pushed {
                    worker_id: written.worker_id,
                    attempts: written.attempts,
                    written_at_ms,
                }]);
            }
            let Ok(handed) = self.reports.undelivered.try_recv() else {
                return Ok(());
            };
            // Undelivered: the worker never held them; hand them back.
            let (reply, _answer) = oneshot::channel();
            harness.apply(vec![Local::Complete {
                scope: sluice_common::auth::JobScope::All,
                worker_id: handed.worker_id.clone(),
                completions: handed
                    .attempts
                    .iter()
                    .map(|(job_id, attempt)| {
                        (
                            job_id.clone(),
                            *attempt,
                            AttemptEnd::HandedBack {
                                reason: "undelivered".to_string(),
                            },
                        )
                    })
                    .collect(),
                caller_trace: pb::TraceContext::default(),
                reply,
            }]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Stream workers that open, give credits and close at any time beside
    /// Kafka workers' claims, completions and the clock: one running
    /// attempt per job (a push is a won claim), no worker pushed more jobs
    /// than it gave credits, and no lost wake-up: an admitted job never
    /// waits while an open session has a credit.
    #[test]
    fn dispatch_is_the_claim_and_credits_are_never_overrun(ops in proptest::collection::vec(stream_op(), 1..80)) {
        let (hub, reports) = crate::work::WorkerHub::new();
        let mut workers = StreamWorkers {
            hub: hub.clone(),
            reports,
            sessions: HashMap::new(),
            given: HashMap::new(),
            pushed: HashMap::new(),
        };
        let mut harness = Harness::with_hub(Vec::new(), hub);
        let mut model = Model::default();
        for op in &ops {
            match *op {
                StreamOp::Open { worker } => {
                    if !workers.sessions.contains_key(&worker) {
                        let (sender, downstream) = tokio::sync::mpsc::channel(64);
                        let session = workers
                            .hub
                            .open(worker_id(worker), vec!["default".to_string()], sluice_common::auth::JobScope::All, 0, Some(sender));
                        workers.sessions.insert(worker, (session, downstream));
                    }
                }
                StreamOp::Credits { worker, credits } => {
                    if let Some((session, _)) = workers.sessions.get(&worker) {
                        let wake = workers.hub.add_credits(session, credits);
                        *workers.given.entry(worker).or_default() += u64::from(credits);
                        workers.wake(&mut harness, wake);
                    }
                }
                StreamOp::Close { worker } => {
                    if let Some((session, downstream)) = workers.sessions.remove(&worker) {
                        workers.hub.close(&session);
                        // Credits it held are gone with it.
                        let unused = u64::from(session.credits());
                        *workers.given.entry(worker).or_default() -= unused;
                        drop(downstream);
                    }
                }
                StreamOp::Claim { worker, job, attempt } => {
                    apply_op(&mut harness, &mut model, &Op::Claim { worker, job, attempt })?;
                }
                StreamOp::Complete { worker, job, attempt, end } => {
                    apply_op(&mut harness, &mut model, &Op::Complete { worker, job, attempt, end })?;
                }
                StreamOp::Advance { ms } => {
                    apply_op(&mut harness, &mut model, &Op::Advance { ms })?;
                }
            }
            workers.settle(&mut harness, &mut model)?;
            check_holders(&harness, &mut model)?;
            for worker in 0..WORKERS {
                let pushed = workers.pushed.get(&worker).copied().unwrap_or(0);
                let given = workers.given.get(&worker).copied().unwrap_or(0);
                prop_assert!(pushed <= given, "worker {} got {} pushes for {} credits", worker, pushed, given);
            }
            let credit_open = workers.sessions.values().any(|(session, _)| session.credits() > 0);
            for job in 0..JOBS {
                let admitted = harness.state(job).is_some_and(|state| state.status == Status::Admitted);
                prop_assert!(!(admitted && credit_open), "job {} waits admitted while a session has credit", job);
            }
        }
    }
}

/// A partition of its own (one job partition, so its share is the whole
/// quota) with `settings` over the defaults.
fn quota_harness(settings: &[(&str, &str)]) -> (Harness, Arc<SluiceConfig>) {
    let mut overrides = vec![("kafka.partitions.jobs", "1")];
    overrides.extend_from_slice(settings);
    let config = Arc::new(SluiceConfig::load_with(None, &overrides).expect("configuration"));
    let settings = crate::partition_settings(&config, &Faults::none(), crate::work::WorkerHub::without_workers());
    let harness = Harness {
        partition: AdmissionPartition::new(settings, Vec::new(), 0, None, 0),
        now_ms: 1_800_000_000_000,
        saved: HashMap::new(),
        saved_seq: 0,
    };
    (harness, config)
}

fn enqueue_one(
    harness: &mut Harness,
    config: &SluiceConfig,
    tenant: &str,
    job_id: &str,
) -> Result<Vec<EnqueueOutcome>, EnqueueError> {
    let request = pb::JobRequest {
        job_id: Some(job_id.to_string()),
        tenant: tenant.to_string(),
        task_group: "default".to_string(),
        payload: b"x".to_vec(),
        ..pb::JobRequest::default()
    };
    let incoming = Incoming {
        job_id: job_id.to_string(),
        valid: crate::chain::validate(config, request).expect("a valid request"),
        trace: pb::TraceContext::default(),
    };
    let (reply, mut answer) = oneshot::channel();
    harness.apply(vec![Local::Enqueue {
        jobs: vec![incoming],
        on_conflict: OnConflict::Refuse,
        reply,
    }]);
    answer.try_recv().expect("answered")
}

fn refused_for(answer: Result<Vec<EnqueueOutcome>, EnqueueError>) -> Option<&'static str> {
    match answer {
        Err(EnqueueError::Quota(refusal)) => Some(refusal.quota),
        _ => None,
    }
}

#[test]
fn a_tenant_over_max_waiting_is_refused_until_one_of_its_jobs_finishes() {
    let (mut harness, config) = quota_harness(&[("admission.default_max_waiting", "3")]);
    for index in 0..3 {
        let saved = enqueue_one(&mut harness, &config, "acme", &format!("acme-{index}"));
        assert!(saved.is_ok(), "{saved:?}");
    }
    assert_eq!(
        refused_for(enqueue_one(&mut harness, &config, "acme", "acme-3")),
        Some("max_waiting")
    );
    assert!(harness.partition.job("acme-3").is_none(), "a refused job is not kept");
    // Another tenant has its own quota; a duplicate of a saved job is not new.
    assert!(enqueue_one(&mut harness, &config, "globex", "globex-0").is_ok());
    assert!(enqueue_one(&mut harness, &config, "acme", "acme-0").is_ok());
    // One of acme's jobs runs and succeeds: room for one more.
    let (reply, mut claimed) = oneshot::channel();
    harness.apply(vec![Local::Claim {
        worker_id: "w".to_string(),
        attempts: vec![("acme-0".to_string(), 1)],
        scope: sluice_common::auth::JobScope::All,
        reply,
    }]);
    assert_eq!(
        claimed.try_recv().expect("answered")[0].outcome,
        pb::ClaimOutcome::Claimed as i32
    );
    let (reply, mut completed) = oneshot::channel();
    harness.apply(vec![Local::Complete {
        worker_id: "w".to_string(),
        completions: vec![("acme-0".to_string(), 1, AttemptEnd::Succeeded)],
        scope: sluice_common::auth::JobScope::All,
        caller_trace: pb::TraceContext::default(),
        reply,
    }]);
    assert_eq!(
        completed.try_recv().expect("answered")[0].outcome,
        pb::CompleteOutcome::Accepted as i32
    );
    assert!(enqueue_one(&mut harness, &config, "acme", "acme-3").is_ok());
    assert_eq!(
        refused_for(enqueue_one(&mut harness, &config, "acme", "acme-4")),
        Some("max_waiting")
    );
}

#[test]
fn a_tenant_over_its_enqueue_rate_is_refused_until_tokens_come_back() {
    let (mut harness, config) = quota_harness(&[("admission.default_max_enqueues_per_second", "2")]);
    assert!(enqueue_one(&mut harness, &config, "acme", "a-0").is_ok());
    assert!(enqueue_one(&mut harness, &config, "acme", "a-1").is_ok());
    assert_eq!(
        refused_for(enqueue_one(&mut harness, &config, "acme", "a-2")),
        Some("max_enqueues_per_second")
    );
    assert!(enqueue_one(&mut harness, &config, "globex", "g-0").is_ok());
    harness.now_ms += 499;
    assert!(refused_for(enqueue_one(&mut harness, &config, "acme", "a-2")).is_some());
    harness.now_ms += 1;
    assert!(enqueue_one(&mut harness, &config, "acme", "a-2").is_ok());
}

#[test]
fn a_stored_quota_overrides_the_default_at_once() {
    let (mut harness, config) = quota_harness(&[]);
    for index in 0..5 {
        assert!(enqueue_one(&mut harness, &config, "acme", &format!("acme-{index}")).is_ok());
    }
    harness.partition.settings().quotas.set(
        "acme",
        Some(crate::quota::QuotaOverride {
            max_waiting: Some(5),
            max_enqueues_per_second: None,
        }),
    );
    assert_eq!(
        refused_for(enqueue_one(&mut harness, &config, "acme", "acme-5")),
        Some("max_waiting")
    );
    harness.partition.settings().quotas.set("acme", None);
    assert!(enqueue_one(&mut harness, &config, "acme", "acme-5").is_ok());
}

/// A stream session of `worker` with `credits`, and what its stream
/// receives.
fn stream_session(
    hub: &Arc<crate::work::WorkerHub>,
    worker: &str,
    credits: u32,
) -> (Arc<crate::work::WorkSession>, Downstream) {
    let (sender, downstream) = tokio::sync::mpsc::channel(64);
    let session = hub.open(
        worker.to_string(),
        vec!["default".to_string()],
        sluice_common::auth::JobScope::All,
        credits,
        Some(sender),
    );
    (session, downstream)
}

fn heartbeat(harness: &mut Harness, worker: &str, job: usize, attempt: u32) -> i32 {
    let (reply, mut answer) = oneshot::channel();
    harness.apply(vec![Local::Heartbeat {
        scope: sluice_common::auth::JobScope::All,
        worker_id: worker.to_string(),
        attempts: vec![(job_id(job), attempt)],
        ended: None,
        reply,
    }]);
    answer.try_recv().expect("answered")[0].outcome
}

/// An attempt pushed to a worker that confirmed it with a heartbeat, then
/// lost it (the worker hung, or abandoned the job), is a lease expiry that
/// uses an attempt — also when the partition changed owners in between
/// (issue 29: a takeover reset `confirmed`, so 36 abandoned attempts were
/// handed back as "lost on their way" without using one).
#[test]
fn a_takeover_keeps_a_confirmed_push_confirmed() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    harness.apply(vec![Local::Dispatch]);
    let pushed: Vec<usize> = harness.running_jobs();
    assert_eq!(pushed.len(), 1, "one credit, one push");
    let job = pushed[0];
    assert!(!harness.state(job).expect("active").confirmed);
    assert_eq!(
        heartbeat(&mut harness, "worker-s", job, 1),
        pb::HeartbeatOutcome::Extended as i32
    );
    assert!(harness.state(job).expect("active").confirmed);

    harness.now_ms += 1_000;
    harness.take_over();
    let state = harness.state(job).expect("active after the takeover");
    assert!(state.confirmed, "the takeover forgot the worker's confirmation");
    // Received by its worker: the whole lease from the takeover, not the
    // stream end grace a push nobody confirmed gets (its worker's word may
    // take longer than that to reach a new owner busy with its takeover).
    // The worker is gone: the lease ends and uses an attempt.
    let state = outlives_the_grace_then_the_lease_ends(
        &mut harness,
        job,
        "a confirmed push lost its lease at the stream end grace",
    );
    assert_eq!(
        state.attempts_used, 1,
        "a confirmed attempt's lease expiry used no attempt"
    );
    assert_eq!(
        state.history.records.last().map(|record| record.outcome.as_str()),
        Some("lease_expired")
    );
}

/// `job` (attempt 1) still runs just after the stream end grace (`why`
/// says what it means if not); its state once its whole lease (30 s from
/// now) is over.
fn outlives_the_grace_then_the_lease_ends(harness: &mut Harness, job: usize, why: &str) -> JobState {
    let grace_ms = harness.stream_end_grace_ms();
    harness.now_ms += grace_ms + 1;
    harness.apply(Vec::new());
    assert_eq!(
        harness.state(job).map(|state| (state.status, state.attempt)),
        Some((Status::Running, 1)),
        "{why}"
    );
    harness.now_ms += 31_000 - grace_ms - 1;
    harness.apply(Vec::new());
    harness.state(job).expect("active").clone()
}

/// Its `Work` stream ended at `closed_at_ms` (reported by the instance that
/// held it).
fn stream_ended(harness: &mut Harness, worker: &str, job: usize, closed_at_ms: i64) {
    let grace_ms = harness.stream_end_grace_ms();
    let (reply, mut answer) = oneshot::channel();
    harness.apply(vec![Local::Heartbeat {
        scope: sluice_common::auth::JobScope::All,
        worker_id: worker.to_string(),
        attempts: vec![(job_id(job), 1)],
        ended: Some(StreamEnd { closed_at_ms, grace_ms }),
        reply,
    }]);
    answer.try_recv().expect("answered");
}

/// A confirmed push whose stream ended (its worker was killed) keeps the
/// lease its stream end left it through any number of takeovers: the
/// stream end is saved, so a new owner does not give the dead worker's
/// attempt a fresh lease. A make chaos run left a key idle for 20 s that
/// way (three takeovers in a row, each a new lease). A worker heard from
/// after the end is alive: the takeover gives it the whole lease again.
#[test]
fn a_dead_stream_workers_attempt_gets_no_fresh_lease_at_takeovers() {
    for heard_after_the_end in [false, true] {
        let (hub, _reports) = crate::work::WorkerHub::new();
        let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
        let mut harness = Harness::with_hub(Vec::new(), hub);
        harness.apply(vec![Local::Dispatch]);
        let job = harness.running_jobs().first().copied().expect("one push");
        assert_eq!(
            heartbeat(&mut harness, "worker-s", job, 1),
            pb::HeartbeatOutcome::Extended as i32
        );
        let grace_ms = harness.stream_end_grace_ms();
        let lease_ms = harness.state(job).expect("active").lease_ms;
        assert!(lease_ms > grace_ms + 2_000, "the default lease outlasts the grace");
        let ended_at = harness.now_ms;
        harness.now_ms += 100;
        stream_ended(&mut harness, "worker-s", job, ended_at);
        if heard_after_the_end {
            harness.now_ms += transitions::STREAM_END_CLOCK_SKEW_MS + 100;
            assert_eq!(
                heartbeat(&mut harness, "worker-s", job, 1),
                pb::HeartbeatOutcome::Extended as i32
            );
        }
        // Three takeovers, a second apart, all after a crash.
        for _ in 0..3 {
            harness.now_ms += 1_000;
            harness.take_over();
        }
        let held_at_most = ended_at + transitions::STREAM_END_CLOCK_SKEW_MS + grace_ms;
        harness.now_ms = held_at_most + 1;
        harness.apply(Vec::new());
        let state = harness.state(job).expect("active");
        if heard_after_the_end {
            assert_eq!(
                (state.status, state.attempt),
                (Status::Running, 1),
                "a worker heard from after its stream ended lost its lease at a takeover"
            );
        } else {
            assert_eq!(
                (state.attempt, state.attempts_used),
                (2, 1),
                "the dead worker's attempt outlived the grace after its stream ended: {:?}",
                state.lease_expires_at_ms.map(|lease| lease - held_at_most)
            );
        }
    }
}

/// An unconfirmed push whose lease ends was lost on its way: handed back,
/// no attempt used, also after a takeover (nothing heard anywhere).
#[test]
fn an_unconfirmed_push_is_handed_back_after_a_takeover() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    harness.apply(vec![Local::Dispatch]);
    let job = harness.running_jobs().first().copied().expect("one push");
    harness.take_over();
    harness.now_ms += 31_000;
    harness.apply(Vec::new());
    let state = harness.state(job).expect("active");
    assert_eq!(state.attempts_used, 0);
    assert_eq!(state.attempt, 2, "handed back: a new attempt");
    assert_eq!(
        state.history.records.last().map(|record| record.outcome.as_str()),
        Some("handed_back")
    );
}

/// Handed over by a live owner (the group moved the partition, or took it
/// from an owner that had resumed it after a kill), an unconfirmed push
/// keeps the whole lease, not the stream end grace: that owner did not die
/// with the push unsent, and the worker's first word may have been queued
/// in it when it was fenced. Its lease still ends (handed back, no attempt
/// used) when nobody hears from the worker.
#[test]
fn an_unconfirmed_push_handed_over_by_a_live_owner_keeps_the_whole_lease() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    harness.apply(vec![Local::Dispatch]);
    let job = harness.running_jobs().first().copied().expect("one push");
    assert!(!harness.state(job).expect("active").confirmed);
    harness.take_over_from(true);
    let state = outlives_the_grace_then_the_lease_ends(
        &mut harness,
        job,
        "a push handed over by a live owner lost its lease at the stream end grace",
    );
    assert_eq!(
        (state.attempt, state.attempts_used),
        (2, 0),
        "handed back, no attempt used"
    );
}

/// After a takeover, a pushed attempt's grace ends while requests received
/// before the batch still wait behind it (after a takeover, the grants of
/// thousands of re-sent acquires): its worker's completion may be among
/// them, so the attempt is not handed back before they are applied. The
/// 100,000-job backlog run had 59 jobs run twice this way. A partition
/// that stays behind ends the lease one lease later. Requests received
/// after the lease ended cannot hold it: a busy partition, always with some
/// waiting, ended every lease one lease late (a `make chaos` run: a key
/// idle 9 s, the abandoned job's lease ending 6 s after it ran out).
#[test]
fn a_lease_does_not_end_while_requests_received_before_it_wait() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 2);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    harness.apply(vec![Local::Dispatch]);
    let pushed: Vec<usize> = harness.running_jobs();
    let [completed, stranded] = pushed[..] else {
        panic!("two pushes: {pushed:?}");
    };
    harness.take_over();
    let grace_ms = harness.stream_end_grace_ms();
    let lease_ms = harness.state(completed).expect("active").lease_ms;
    let grace_ends_ms = harness.now_ms + grace_ms;
    harness.now_ms += grace_ms + 1;
    // Everything received up to just before the grace ended is in.
    OwnedState::requests_received_through(&mut harness.partition, grace_ends_ms - 1);
    harness.apply(Vec::new());
    for job in [completed, stranded] {
        let state = harness.state(job).expect("active");
        assert_eq!(
            (state.status, state.attempt),
            (Status::Running, 1),
            "a lease ended with requests received before it queued: {:?}",
            state.history.records
        );
    }
    // The queued completion is applied: the job succeeded once.
    let (reply, mut answer) = oneshot::channel();
    harness.apply(vec![Local::Complete {
        scope: sluice_common::auth::JobScope::All,
        worker_id: "worker-s".to_string(),
        completions: vec![(job_id(completed), 1, AttemptEnd::Succeeded)],
        caller_trace: pb::TraceContext::default(),
        reply,
    }]);
    assert_eq!(
        answer.try_recv().expect("answered")[0].outcome,
        pb::CompleteOutcome::Accepted as i32
    );
    // Still behind, one lease after the grace: the other push is handed back.
    harness.now_ms += lease_ms;
    harness.apply(Vec::new());
    assert_handed_back(&harness, stranded);
}

/// Attempt 1 of `job` was handed back: attempt 2 is on its way.
fn assert_handed_back(harness: &Harness, job: usize) {
    let state = harness.state(job).expect("active");
    assert_eq!(
        (
            state.attempt,
            state.history.records.last().map(|record| record.outcome.as_str())
        ),
        (2, Some("handed_back"))
    );
}

/// A lease that ran out ends at once when every request received before
/// it ran out has been applied, however many received since still wait.
#[test]
fn a_lease_ends_at_once_when_only_requests_received_after_it_wait() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    harness.apply(vec![Local::Dispatch]);
    let [stranded] = harness.running_jobs()[..] else {
        panic!("one push");
    };
    harness.take_over();
    let grace_ends_ms = harness.now_ms + harness.stream_end_grace_ms();
    harness.now_ms = grace_ends_ms + 1;
    // Requests wait, all received after the grace ended.
    OwnedState::requests_received_through(&mut harness.partition, grace_ends_ms);
    harness.apply(Vec::new());
    assert_handed_back(&harness, stranded);
}

/// Worker `w` claims attempt 1 of the job `later`, which must be answered
/// `CLAIMED`; returns what the claim's batch sent.
fn claim_later(harness: &mut Harness) -> Outbox {
    let (reply, mut claimed) = oneshot::channel();
    let outbox = harness.apply_sending(vec![Local::Claim {
        worker_id: "w".to_string(),
        attempts: vec![("later".to_string(), 1)],
        scope: sluice_common::auth::JobScope::All,
        reply,
    }]);
    assert_eq!(
        claimed.try_recv().expect("answered")[0].outcome,
        pb::ClaimOutcome::Claimed as i32
    );
    outbox
}

/// The keys of the admitted messages a batch sent, sorted.
fn admitted_keys(mut outbox: Outbox) -> Vec<String> {
    drop(outbox.take_links());
    let mut keys: Vec<String> = outbox
        .into_messages()
        .into_iter()
        .filter(|message| message.topic.contains("admitted"))
        .filter_map(|message| message.key.map(|key| String::from_utf8_lossy(&key).to_string()))
        .collect();
    keys.sort();
    keys
}

/// An admitted job nobody claims is published again every claim timeout,
/// each time under a new key, so that it lands on a partition picked anew:
/// the one it sat on may have no live consumer.
#[test]
fn an_unclaimed_job_is_published_again_under_a_new_key_each_claim_timeout() {
    let mut harness = Harness::new();
    let claim_timeout_ms = harness.partition.settings().routes.claim_timeout_ms;
    let keys_after = |harness: &mut Harness, ms: i64| -> Vec<String> {
        harness.now_ms += ms;
        admitted_keys(harness.apply_sending(Vec::new()))
    };
    let expected = |resends: u32| -> Vec<String> {
        let mut keys: Vec<String> = (0..JOBS)
            .map(|job| crate::effects::admitted_key(&job_id(job), 1, resends))
            .collect();
        keys.sort();
        keys
    };
    assert_eq!(keys_after(&mut harness, claim_timeout_ms), expected(1));
    assert_eq!(keys_after(&mut harness, claim_timeout_ms), expected(2));
    assert_ne!(expected(1), expected(0), "a re-send's key is its first publish's");
}

/// An admitted job that sits on its topic while a job of its task group
/// published after it is claimed (the worker that consumes its partition
/// was killed, and the group has not noticed) is published again under a
/// new key once it has been out `claim_overtaken_after`, not only after the
/// claim timeout: the chaos run's Kafka workers left keys idle for 30–36 s,
/// a claim timeout, this way (issue 29). Nothing is published again while
/// no later job was claimed.
#[test]
fn an_admitted_job_overtaken_by_a_later_one_claimed_is_published_again_under_a_new_key() {
    let mut harness = Harness::new();
    let config = harness.partition.settings().config.clone();
    let overtaken_after_ms = harness.partition.settings().timing.claim_overtaken_after_ms;
    assert!(overtaken_after_ms > 1_000, "{overtaken_after_ms}");
    // A later job, published a second after the first three, and claimed.
    harness.now_ms += 1_000;
    assert!(enqueue_one(&mut harness, &config, "acme", "later").is_ok());
    harness.now_ms += overtaken_after_ms;
    assert_eq!(
        admitted_keys(harness.apply_sending(Vec::new())),
        Vec::<String>::new(),
        "no job published after them was claimed yet"
    );
    // The claim's own batch publishes them again (its timers run last).
    let outbox = claim_later(&mut harness);
    // Each under a new key that lands where the later job was claimed from
    // (its consumer is alive), unless that is where it sat already.
    let partitions = harness.partition.settings().routes.admitted_partitions;
    let partition = |key: &str| super::overtaken::admitted_partition(key.as_bytes(), partitions);
    let live = partition("later/1");
    let keys = admitted_keys(outbox);
    assert_eq!(keys.len(), JOBS, "{keys:?}");
    for job in 0..JOBS {
        let first = crate::effects::admitted_key(&job_id(job), 1, 0);
        let again = keys
            .iter()
            .find(|key| key.starts_with(&format!("{}/1/", job_id(job))))
            .unwrap_or_else(|| panic!("{} not published again: {keys:?}", job_id(job)));
        if partition(&first) != live {
            assert_eq!(partition(again), live, "{again}");
        }
    }
    harness.now_ms += 1;
    // Published again a second time at most once more each, then only at
    // claim timeouts.
    assert_eq!(admitted_keys(harness.apply_sending(Vec::new())), Vec::<String>::new());
}

/// A new owner publishes every admitted job again at its takeover. It
/// knows what the instance's claims showed of the topic's consumers: a job
/// whose key lands on a partition that claimed nothing within the wait
/// goes to one that did (in a chaos run, a job partition taken over twice
/// while a killed worker's partition had no consumer published one job
/// there three times under its first key).
#[test]
fn a_job_published_again_at_a_takeover_avoids_a_partition_that_stopped_claiming() {
    let mut harness = Harness::new();
    let config = harness.partition.settings().config.clone();
    harness.now_ms += 1_000;
    assert!(enqueue_one(&mut harness, &config, "acme", "later").is_ok());
    claim_later(&mut harness);
    let partitions = harness.partition.settings().routes.admitted_partitions;
    let partition = |key: &str| super::overtaken::admitted_partition(key.as_bytes(), partitions);
    let live = partition("later/1");
    harness.now_ms += 100;
    harness.take_over();
    // The new owner reads their payloads, then publishes them.
    let payloads = (0..JOBS).map(|job| (job_id(job), b"x".to_vec())).collect();
    OwnedState::prepared(
        &mut harness.partition,
        crate::partition::Prepared {
            payloads,
            ..Default::default()
        },
    );
    let keys = admitted_keys(harness.apply_sending(Vec::new()));
    assert_eq!(keys.len(), JOBS, "{keys:?}");
    let mut moved = 0;
    for key in &keys {
        assert_eq!(partition(key), live, "{key} published again where nothing claims");
        moved += usize::from(!key.ends_with("/1"));
    }
    assert!(
        moved > 0,
        "every job's first key landed on the live partition: {keys:?}"
    );
}

/// A push handed back as lost on its way whose worker did run it: its
/// success, reported late (the 100,000-job backlog run: completions that
/// waited 6.7 s inside the new owner's instance), ends the job if the next
/// attempt has not started, instead of running the job again. Another
/// worker's report is stale.
#[test]
fn a_late_success_of_an_attempt_handed_back_as_lost_ends_the_job_if_the_next_has_not_started() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    harness.apply(vec![Local::Dispatch]);
    let job = harness.running_jobs().first().copied().expect("one push");
    harness.take_over();
    harness.now_ms += 31_000;
    harness.apply(Vec::new());
    let state = harness.state(job).expect("active");
    assert_eq!(
        (state.attempt, state.status),
        (2, Status::Admitted),
        "handed back, not started"
    );
    let complete = |harness: &mut Harness, worker: &str| {
        let (reply, mut answer) = oneshot::channel();
        harness.apply(vec![Local::Complete {
            scope: sluice_common::auth::JobScope::All,
            worker_id: worker.to_string(),
            completions: vec![(job_id(job), 1, AttemptEnd::Succeeded)],
            caller_trace: pb::TraceContext::default(),
            reply,
        }]);
        answer.try_recv().expect("answered")[0].clone()
    };
    assert_eq!(
        complete(&mut harness, "worker-other").outcome,
        pb::CompleteOutcome::Stale as i32,
        "only the worker the attempt was pushed to ran it"
    );
    let result = complete(&mut harness, "worker-s");
    assert_eq!(
        (result.outcome, result.status),
        (pb::CompleteOutcome::Accepted as i32, pb::JobStatus::Succeeded as i32)
    );
    assert!(harness.state(job).is_none(), "the job ended");
    let saved = harness
        .saved
        .get(&job_id(job))
        .map(|row| (row.state.status, row.state.attempt));
    assert!(
        saved.is_none() || saved == Some((Status::Succeeded, 1)),
        "saved as {saved:?}"
    );
}

/// A pushed attempt's lease runs from when its push was written, not from
/// the claim decided before the commit.
#[test]
fn a_pushed_attempt_lease_runs_from_the_push() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    let claimed_at = harness.now_ms;
    harness.apply(vec![Local::Dispatch]);
    let job = harness.running_jobs().first().copied().expect("one push");
    let lease_ms = harness.state(job).expect("active").lease_ms;
    assert_eq!(
        harness.state(job).expect("active").lease_expires_at_ms,
        Some(claimed_at + lease_ms)
    );
    // The commit took 5 s; then the push was written.
    harness.now_ms += 5_000;
    let written_at_ms = harness.now_ms;
    harness.apply(vec![Local::Pushed {
        worker_id: "worker-s".to_string(),
        attempts: vec![(job_id(job), 1)],
        written_at_ms,
    }]);
    assert_eq!(
        harness.state(job).expect("active").lease_expires_at_ms,
        Some(harness.now_ms + lease_ms),
        "the lease does not run from the push"
    );
    // Another worker's report, or an old attempt's, changes nothing.
    harness.now_ms += 1_000;
    let written_at_ms = harness.now_ms;
    harness.apply(vec![Local::Pushed {
        worker_id: "worker-other".to_string(),
        attempts: vec![(job_id(job), 1)],
        written_at_ms,
    }]);
    assert_eq!(
        harness.state(job).expect("active").lease_expires_at_ms,
        Some(harness.now_ms - 1_000 + lease_ms)
    );
}

/// A push stamps the lease end it tells the worker from its own clock,
/// which may run a little ahead of the partition's: the partition's lease
/// end, and a heartbeat's answer right after the push, are never before
/// it (the flaky end-to-end test asserted exactly this and failed when the
/// clocks were 1–2 ms apart).
#[test]
fn a_heartbeat_right_after_a_push_never_answers_a_lease_end_before_the_push_said() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    harness.apply(vec![Local::Dispatch]);
    let job = harness.running_jobs().first().copied().expect("one push");
    let lease_ms = harness.state(job).expect("active").lease_ms;
    // The push's clock reads 2 ms later than the partition's.
    let written_at_ms = harness.now_ms + 2;
    harness.apply(vec![Local::Pushed {
        worker_id: "worker-s".to_string(),
        attempts: vec![(job_id(job), 1)],
        written_at_ms,
    }]);
    let told = written_at_ms + lease_ms;
    assert_eq!(harness.state(job).expect("active").lease_expires_at_ms, Some(told));
    harness.now_ms += 1;
    let (reply, mut answer) = oneshot::channel();
    harness.apply(vec![Local::Heartbeat {
        scope: sluice_common::auth::JobScope::All,
        worker_id: "worker-s".to_string(),
        attempts: vec![(job_id(job), 1)],
        ended: None,
        reply,
    }]);
    let result = answer.try_recv().expect("answered")[0].clone();
    assert_eq!(result.outcome, pb::HeartbeatOutcome::Extended as i32);
    assert!(
        result.lease_expires_at_ms >= told,
        "the heartbeat answered a lease end {} before the push's {told}",
        result.lease_expires_at_ms
    );
}

/// A concurrency limit then a rate limit (the chaos run's key-then-rate
/// chains).
fn key_then_rate() -> Vec<pb::Limit> {
    vec![
        pb::Limit {
            kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                key: "k0".to_string(),
                max_concurrency: 3,
                shadow: false,
            })),
        },
        pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
                    name: "api".to_string(),
                    unique_key: "r".to_string(),
                    limit: 20,
                    duration_ms: 1_000,
                    cost: 1,
                })),
            })),
        },
    ]
}

/// The rate acquires `outbox` sends, as (job id, step, owner partition).
fn rate_acquires(outbox: &mut Outbox) -> Vec<(String, u32, i32)> {
    use prost::Message as _;
    let mut acquires = Vec::new();
    for ((link, partition), entries) in outbox.take_links() {
        if link != Link::RateWindow {
            continue;
        }
        for entry in entries {
            let command = pb::RateCommand::decode(entry.as_slice()).expect("a rate command");
            if let Some(pb::rate_command::Command::Acquire(acquire)) = command.command {
                let ticket = acquire.ticket.expect("a ticket");
                acquires.push((ticket.job_id, ticket.step, partition));
            }
        }
    }
    acquires.sort();
    acquires
}

/// The chaos run's key k16: a job's concurrency step is granted, and the
/// acquire of its rate step is lost in a link break (written to a stream
/// that broke before rate-window applied it, or applied and its grant lost
/// on the way back). When the link to rate-window opens again, the
/// acquire is sent again at once: within a second of the new link, not at
/// the job's next timer re-send.
#[test]
fn a_command_lost_in_a_link_break_is_sent_again_within_a_second_of_the_new_link() {
    let mut harness = Harness::with_limits(key_then_rate());
    let mut sent = harness.apply_sending(vec![Local::Grants(vec![grant(0, 1, 0)])]);
    let lost = rate_acquires(&mut sent);
    assert_eq!(lost.len(), 1, "the grant moves job 0 to its rate step: {lost:?}");
    let (_, step, rate_partition) = lost[0].clone();
    assert_eq!(step, 1);
    // The link breaks: the acquire is lost. It opens again 300 ms later.
    harness.now_ms += 300;
    let link_opened_at = harness.now_ms;
    let mut other_link = harness.apply_sending(vec![Local::PathChanged {
        link: Link::LimitGrant,
        partitions: vec![rate_partition],
    }]);
    assert!(
        rate_acquires(&mut other_link).is_empty(),
        "a path change to limit-grant re-sends no rate acquire"
    );
    let mut other_partition = harness.apply_sending(vec![Local::PathChanged {
        link: Link::RateWindow,
        partitions: vec![rate_partition + 1],
    }]);
    assert!(
        rate_acquires(&mut other_partition).is_empty(),
        "a path change to another rate partition re-sends nothing of this one"
    );
    // Nothing but the new link re-sends it within the second: the timer
    // would wait for resend_waiting_after.
    harness.now_ms = link_opened_at + 999;
    let mut timers = harness.apply_sending(Vec::new());
    assert!(rate_acquires(&mut timers).is_empty());
    let mut resent = harness.apply_sending(vec![Local::PathChanged {
        link: Link::RateWindow,
        partitions: vec![rate_partition],
    }]);
    assert!(harness.now_ms - link_opened_at < 1_000);
    assert_eq!(
        rate_acquires(&mut resent),
        lost,
        "the lost acquire, sent again on the new link"
    );
    let state = harness.state(0).expect("active");
    assert_eq!((state.status, state.step), (Status::Waiting, 1));
}

/// The timer is the last resort, at a fixed interval: a rate acquire nobody
/// answers is sent again every resend_waiting_after (12 s by default), not
/// at intervals that grow with the wait (the chaos run's 50 s), and a
/// re-send saves nothing.
#[test]
fn a_waiting_job_is_resent_every_resend_waiting_after_however_long_it_waited() {
    let mut harness = Harness::with_limits(key_then_rate());
    let mut sent = harness.apply_sending(vec![Local::Grants(vec![grant(0, 1, 0)])]);
    let acquire = rate_acquires(&mut sent);
    assert_eq!(acquire.len(), 1);
    let interval = harness.partition.settings().timing.resend_waiting_after_ms;
    let started = harness.now_ms;
    for round in 1..=6 {
        harness.now_ms = started + round * interval - 1;
        let mut early = harness.apply_sending(Vec::new());
        assert!(rate_acquires(&mut early).is_empty(), "round {round}: sent early");
        harness.now_ms = started + round * interval;
        let mut writes = AdmissionWrites::default();
        let mut outbox = Outbox::new();
        harness.partition.apply(
            harness.now_ms,
            &[],
            Vec::new(),
            &mut writes,
            &mut outbox,
            &mut Vec::new(),
            &mut Vec::new(),
        );
        assert_eq!(rate_acquires(&mut outbox), acquire, "round {round}: re-sent on time");
        assert!(
            writes.journal.is_none() && writes.snapshot.is_none(),
            "round {round}: a re-send writes nothing"
        );
    }
}

/// A new owner re-sends every waiting acquire at its takeover and starts the
/// re-send timers over from there: the saved due time (long past) does not
/// make it send them all a second time in its first batch.
#[test]
fn a_takeover_starts_the_resend_timers_over() {
    let mut harness = Harness::with_limits(key_then_rate());
    harness.apply_sending(vec![Local::Grants(vec![grant(0, 1, 0)])]);
    let interval = harness.partition.settings().timing.resend_waiting_after_ms;
    harness.now_ms += 5 * interval;
    harness.take_over();
    let mut resent = Outbox::new();
    harness.partition.resend_all(harness.now_ms, &mut resent);
    assert_eq!(rate_acquires(&mut resent).len(), 1, "the takeover re-sends it");
    let mut first = harness.apply_sending(Vec::new());
    assert!(rate_acquires(&mut first).is_empty(), "not again in the first batch");
    harness.now_ms += interval;
    let mut due = harness.apply_sending(Vec::new());
    assert_eq!(rate_acquires(&mut due).len(), 1, "then every interval");
}

/// A completion that waited in the partition's queue (behind a slow commit,
/// a paused PostgreSQL) while its lease ran out is applied before the
/// batch's timers: the attempt ended when its worker said so, and the
/// sweep does not hand it back first and answer it STALE (the chaos run's
/// chaos-401: ran 157 ms, its completion waited 5 s, the job ran again).
#[test]
fn a_completion_queued_before_its_lease_ran_out_wins_over_the_sweep() {
    let (hub, _reports) = crate::work::WorkerHub::new();
    let (_session, _downstream) = stream_session(&hub, "worker-s", 1);
    let mut harness = Harness::with_hub(Vec::new(), hub);
    harness.apply(vec![Local::Dispatch]);
    let job = harness.running_jobs().first().copied().expect("one push");
    let lease_ms = harness.state(job).expect("active").lease_ms;
    // The next batch runs after the lease's end, with the completion in it.
    harness.now_ms += lease_ms + 500;
    let (reply, mut answer) = oneshot::channel();
    harness.apply(vec![Local::Complete {
        scope: sluice_common::auth::JobScope::All,
        worker_id: "worker-s".to_string(),
        completions: vec![(job_id(job), 1, AttemptEnd::Succeeded)],
        caller_trace: pb::TraceContext::default(),
        reply,
    }]);
    let results = answer.try_recv().expect("answered");
    assert_eq!(
        results[0].outcome,
        pb::CompleteOutcome::Accepted as i32,
        "the sweep handed the attempt back before its queued completion"
    );
    assert!(
        harness.state(job).is_none_or(|state| state.status == Status::Succeeded),
        "{:?}",
        harness.state(job)
    );
}

/// What a batch logs, captured.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("not poisoned").extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Captured {
    fn count(&self, needle: &str) -> usize {
        String::from_utf8_lossy(&self.0.lock().expect("not poisoned"))
            .matches(needle)
            .count()
    }
}

#[test]
fn a_dead_letter_is_logged_and_counted_once_its_batch_is_committed() {
    use prost::Message as _;
    let mut harness = Harness::new();
    let handover = pb::JobHandOver {
        job_id: String::new(),
        source_topic: "sluice.requests".to_string(),
        source_partition: 0,
        source_offset: 7,
        source_timestamp_ms: 0,
        payload: b"not a job request".to_vec(),
        headers: Vec::new(),
    };
    let message = sluice_common::kafka::InMsg {
        partition: 0,
        offset: 1,
        key: None,
        payload: Some(
            pb::JobHandOverBatch {
                requests: vec![handover],
            }
            .encode_to_vec(),
        ),
        headers: Vec::new(),
        timestamp_ms: None,
    };
    let logs = Captured::default();
    let subscriber = {
        let logs = logs.clone();
        tracing_subscriber::fmt().with_writer(move || logs.clone()).finish()
    };
    tracing::subscriber::with_default(subscriber, || {
        let mut writes = AdmissionWrites::default();
        let mut outbox = Outbox::new();
        let (mut replies, mut rejected) = (Vec::new(), Vec::new());
        harness.partition.apply(
            harness.now_ms,
            std::slice::from_ref(&message),
            Vec::new(),
            &mut writes,
            &mut outbox,
            &mut replies,
            &mut rejected,
        );
        assert!(rejected.is_empty(), "{rejected:?}");
        assert!(!outbox.is_empty(), "the dead letter is sent");
        // Decided, not committed: nothing logged (a batch decided again
        // after a failed commit would log it twice).
        assert_eq!(logs.count("dead-lettering a job request"), 0);
        outbox.take_observations().record();
        assert_eq!(logs.count("dead-lettering a job request"), 1);
    });
}

/// Worker `w` claims attempt 1 of `job` (admitted at once: no limits).
fn claim_job(harness: &mut Harness, job: usize) {
    let (reply, mut claimed) = oneshot::channel();
    harness.apply(vec![Local::Claim {
        worker_id: "w".to_string(),
        attempts: vec![(job_id(job), 1)],
        scope: sluice_common::auth::JobScope::All,
        reply,
    }]);
    assert_eq!(
        claimed.try_recv().expect("answered")[0].outcome,
        pb::ClaimOutcome::Claimed as i32
    );
}

/// A new owner keeps a confirmed attempt for the lease its worker was last
/// told, plus a second for clocks, and no longer: the worker stops the job
/// when that lease passes unrenewed (docs/worker-protocol.md §3). Each
/// renewal is saved before its answer, so the new owner knows it. Before,
/// renewals were not saved and a takeover gave every confirmed attempt a
/// whole lease from serving: twice in `make chaos`, an attempt its worker
/// abandoned as an admission instance was killed got one at a takeover 9 s
/// later, and its key waited 10.3 s (issue 29).
#[test]
fn a_takeover_keeps_a_confirmed_attempt_for_the_lease_its_worker_was_last_told() {
    let mut harness = Harness::new();
    let (renewing, abandoned) = (0, 1);
    claim_job(&mut harness, renewing);
    claim_job(&mut harness, abandoned);
    let lease_ms = harness.state(renewing).expect("active").lease_ms;
    harness.now_ms += lease_ms * 2 / 3;
    for job in [renewing, abandoned] {
        assert_eq!(
            heartbeat(&mut harness, "w", job, 1),
            pb::HeartbeatOutcome::Extended as i32
        );
    }
    let abandoned_told = harness.now_ms + lease_ms;
    // `abandoned`'s worker stops heartbeating; `renewing`'s renews once more.
    harness.now_ms += lease_ms * 2 / 3;
    assert_eq!(
        heartbeat(&mut harness, "w", renewing, 1),
        pb::HeartbeatOutcome::Extended as i32
    );
    let renewing_told = harness.now_ms + lease_ms;
    // The owner is killed; a new one serves after `abandoned`'s lease (and
    // the clock allowance) ran out, before `renewing`'s did.
    harness.now_ms = abandoned_told + transitions::STREAM_END_CLOCK_SKEW_MS + 1;
    assert!(harness.now_ms < renewing_told);
    harness.take_over();
    harness.apply(Vec::new());
    let state = harness.state(abandoned).expect("active");
    assert_eq!(
        (state.attempt, state.attempts_used),
        (2, 1),
        "the abandoned attempt got a fresh lease at the takeover: {:?} after the one its worker was told",
        state.lease_expires_at_ms.map(|lease| lease - abandoned_told)
    );
    assert_eq!(
        state.history.records.last().map(|record| record.outcome.as_str()),
        Some("lease_expired")
    );
    // The renewing worker holds the lease it was told (its last renewal was
    // saved): not cut short by the takeover.
    harness.now_ms = renewing_told + transitions::STREAM_END_CLOCK_SKEW_MS - 1;
    harness.apply(Vec::new());
    assert_eq!(
        harness.state(renewing).map(|state| (state.status, state.attempt)),
        Some((Status::Running, 1)),
        "a takeover cut short the lease a renewal told the worker"
    );
    harness.now_ms += 2;
    harness.apply(Vec::new());
    let state = harness.state(renewing).expect("active");
    assert_eq!(
        (state.attempt, state.attempts_used),
        (2, 1),
        "unrenewed, the lease ends"
    );
}

/// A heartbeat that reached the instance while a takeover loaded the
/// partition is applied in the first batch after it serves, before that
/// batch's timers: it extends the lease even when the lease it renews has
/// ended by then (the load took longer), instead of being answered
/// `LEASE_LOST` — the worker sent it while its lease held.
#[test]
fn a_heartbeat_that_waited_through_a_takeovers_load_extends_the_lease() {
    let mut harness = Harness::new();
    claim_job(&mut harness, 0);
    let lease_ms = harness.state(0).expect("active").lease_ms;
    harness.now_ms += lease_ms - 100;
    harness.take_over();
    harness.now_ms += 1_500;
    assert_eq!(
        heartbeat(&mut harness, "w", 0, 1),
        pb::HeartbeatOutcome::Extended as i32,
        "a heartbeat applied before the batch's timers lost a lease nobody had ended"
    );
    let state = harness.state(0).expect("active");
    assert_eq!((state.status, state.attempt), (Status::Running, 1));
    assert_eq!(state.lease_expires_at_ms, Some(harness.now_ms + lease_ms));
    // Once a timer ended the attempt, a heartbeat is too late.
    harness.now_ms += lease_ms + transitions::STREAM_END_CLOCK_SKEW_MS + 1;
    harness.apply(Vec::new());
    assert_eq!(
        heartbeat(&mut harness, "w", 0, 1),
        pb::HeartbeatOutcome::LeaseLost as i32
    );
}
