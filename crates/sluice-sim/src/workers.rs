//! Kafka workers as docs/worker-protocol.md §1–§4 describes them: they read
//! `jobs.admitted` (at least once), run a job only after `Claim` answers
//! `CLAIMED` (a claim whose answer was lost is settled with `Heartbeat`),
//! heartbeat every third of the lease, stop when their own copy of the
//! lease runs out, and complete. Some die, stall, abandon a job, hand one
//! back or complete twice.

use std::collections::{BTreeMap, VecDeque};

use rand::Rng;
use sluice_admission::partition::Local;
use sluice_admission::transitions::AttemptEnd;
use sluice_common::auth::JobScope;
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::world::{job_index, Answer, CallKind, World};

#[derive(Debug)]
pub enum WorkerEvent {
    Poll,
    HeartbeatDue {
        run: u64,
    },
    RunEnds {
        run: u64,
    },
    DeadlineCheck {
        run: u64,
    },
    Restart,
    RetryClaimCheck {
        job: pb::AdmittedJob,
        tries: u32,
    },
    RetryComplete {
        job_id: String,
        attempt: u32,
        end: AttemptEnd,
        tries: u32,
    },
}

struct ActiveRun {
    job_id: String,
    attempt: u32,
    lease_ms: i64,
    /// The worker's own copy of the lease end (from when its last renewal
    /// was sent).
    deadline: i64,
    stalled_until: i64,
    /// The completion is sent twice.
    complete_twice: bool,
}

enum Purpose {
    Claim {
        job: pb::AdmittedJob,
        sent_at: i64,
        tries: u32,
    },
    /// A claim whose answer was lost: does the worker hold the attempt?
    ClaimCheck {
        job: pb::AdmittedJob,
        sent_at: i64,
        tries: u32,
    },
    Heartbeat {
        run: u64,
        sent_at: i64,
    },
    Complete {
        job_id: String,
        attempt: u32,
        end: AttemptEnd,
        tries: u32,
    },
}

#[derive(Default)]
struct Worker {
    up: bool,
    incarnation: u32,
    active: BTreeMap<u64, ActiveRun>,
    calls: BTreeMap<u64, Purpose>,
    /// Messages delivered to this worker and not dealt with yet.
    held: Vec<pb::AdmittedJob>,
    /// Attempts whose completion is not answered yet (one entry for each
    /// completion sent).
    completing: Vec<(String, u32)>,
    complete_twice_next: bool,
}

pub struct Workers {
    list: Vec<Worker>,
    /// `jobs.admitted`: (deliverable from, job).
    queue: VecDeque<(i64, pb::AdmittedJob)>,
    next_run: u64,
}

/// Jobs a worker runs at once, at most.
const SLOTS: usize = 3;

impl Workers {
    pub fn new(count: usize) -> Self {
        Workers {
            list: (0..count)
                .map(|_| Worker {
                    up: true,
                    ..Worker::default()
                })
                .collect(),
            queue: VecDeque::new(),
            next_run: 0,
        }
    }

    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    pub fn publish(&mut self, job: pb::AdmittedJob, at: i64) {
        self.queue.push_back((at, job));
    }

    /// Until when a live worker running the attempt holds it by its own
    /// copy of the lease (none runs it: `None`).
    pub fn held_by_its_worker_until(&self, job_id: &str, attempt: u32) -> Option<i64> {
        self.list
            .iter()
            .filter(|worker| worker.up)
            .flat_map(|worker| worker.active.values())
            .filter(|active| active.job_id == job_id && active.attempt == attempt)
            .map(|active| active.deadline)
            .max()
    }
}

impl Worker {
    /// Whether the worker handles the attempt: claiming it (held), running
    /// it, or completing it (a completion not answered yet, or to be sent
    /// again after UNAVAILABLE: a takeover can take seconds).
    fn handles(&self, job_id: &str, attempt: u32) -> bool {
        self.held
            .iter()
            .any(|held| held.job_id == job_id && held.attempt == attempt)
            || self
                .active
                .values()
                .any(|active| active.job_id == job_id && active.attempt == attempt)
            || self
                .completing
                .iter()
                .any(|(completing, completing_attempt)| completing == job_id && *completing_attempt == attempt)
    }
}

fn worker_id(worker: usize, incarnation: u32) -> String {
    format!("worker-{worker}.{incarnation}")
}

impl World {
    pub(crate) fn worker_event(&mut self, worker: usize, event: WorkerEvent) {
        if !self.workers.list[worker].up && !matches!(event, WorkerEvent::Restart) {
            return;
        }
        match event {
            WorkerEvent::Poll => {
                self.poll(worker);
                self.after(20, worker, WorkerEvent::Poll);
            }
            WorkerEvent::HeartbeatDue { run } => self.heartbeat(worker, run),
            WorkerEvent::RunEnds { run } => self.run_ends(worker, run),
            WorkerEvent::DeadlineCheck { run } => self.deadline_check(worker, run),
            WorkerEvent::Restart => {
                let state = &mut self.workers.list[worker];
                state.up = true;
                state.incarnation += 1;
                self.after(1, worker, WorkerEvent::Poll);
            }
            WorkerEvent::RetryClaimCheck { job, tries } => self.claim_check(worker, job, tries),
            WorkerEvent::RetryComplete {
                job_id,
                attempt,
                end,
                tries,
            } => self.send_complete(worker, job_id, attempt, end, tries),
        }
    }

    fn after(&mut self, delay: i64, worker: usize, event: WorkerEvent) {
        self.schedule_worker(delay, worker, event);
    }

    fn poll(&mut self, worker: usize) {
        loop {
            let state = &self.workers.list[worker];
            if state.active.len() + state.held.len() >= SLOTS {
                return;
            }
            let ready = self.workers.queue.front().is_some_and(|(at, _)| *at <= self.now);
            if !ready {
                return;
            }
            let Some((_, job)) = self.workers.queue.pop_front() else {
                return;
            };
            // A delivery of an attempt this worker already handles
            // (claiming, running, completing) is a duplicate
            // (worker-protocol.md §2): dropped without a claim.
            let handled = self.workers.list[worker].handles(&job.job_id, job.attempt);
            if handled && self.config.bug != Some(crate::config::Bug::WorkerRunsDuplicateDelivery) {
                continue;
            }
            self.workers.list[worker].held.push(job.clone());
            self.claim(worker, job, 0);
        }
    }

    fn claim(&mut self, worker: usize, job: pb::AdmittedJob, tries: u32) {
        let id = worker_id(worker, self.workers.list[worker].incarnation);
        let attempts = vec![(job.job_id.clone(), job.attempt)];
        let token = self.call(Some(worker), &job.job_id.clone(), move || {
            let (reply, receiver) = oneshot::channel();
            (
                Local::Claim {
                    worker_id: id,
                    attempts,
                    scope: JobScope::All,
                    reply,
                },
                CallKind::Claim(receiver),
            )
        });
        let sent_at = self.now;
        self.workers.list[worker]
            .calls
            .insert(token, Purpose::Claim { job, sent_at, tries });
    }

    fn claim_check(&mut self, worker: usize, job: pb::AdmittedJob, tries: u32) {
        let token = self.send_heartbeat(worker, &job.job_id, job.attempt);
        let sent_at = self.now;
        self.workers.list[worker]
            .calls
            .insert(token, Purpose::ClaimCheck { job, sent_at, tries });
    }

    fn send_heartbeat(&mut self, worker: usize, job_id: &str, attempt: u32) -> u64 {
        let id = worker_id(worker, self.workers.list[worker].incarnation);
        let attempts = vec![(job_id.to_string(), attempt)];
        self.call(Some(worker), job_id, move || {
            let (reply, receiver) = oneshot::channel();
            (
                Local::Heartbeat {
                    worker_id: id,
                    attempts,
                    ended: None,
                    scope: JobScope::All,
                    reply,
                },
                CallKind::Heartbeat(receiver),
            )
        })
    }

    fn send_complete(&mut self, worker: usize, job_id: String, attempt: u32, end: AttemptEnd, tries: u32) {
        if tries == 0 {
            self.workers.list[worker].completing.push((job_id.clone(), attempt));
        }
        let id = worker_id(worker, self.workers.list[worker].incarnation);
        let completions = vec![(job_id.clone(), attempt, end.clone())];
        let token = self.call(Some(worker), &job_id.clone(), move || {
            let (reply, receiver) = oneshot::channel();
            (
                Local::Complete {
                    worker_id: id,
                    completions,
                    scope: JobScope::All,
                    caller_trace: pb::TraceContext::default(),
                    reply,
                },
                CallKind::Complete(receiver),
            )
        });
        self.workers.list[worker].calls.insert(
            token,
            Purpose::Complete {
                job_id,
                attempt,
                end,
                tries,
            },
        );
    }

    pub(crate) fn worker_answer(&mut self, worker: usize, token: u64, answer: Answer) {
        if !self.workers.list[worker].up {
            return;
        }
        let Some(purpose) = self.workers.list[worker].calls.remove(&token) else {
            return;
        };
        self.trace_answer(worker, &purpose, &answer);
        match purpose {
            Purpose::Claim { job, sent_at, tries } => match answer {
                Answer::Claim(results) => {
                    let outcome = results.first().map(|result| result.outcome);
                    let lease_ms = results
                        .first()
                        .map_or(0, |result| i64::try_from(result.lease_ms).unwrap_or(i64::MAX));
                    if outcome == Some(pb::ClaimOutcome::Claimed as i32) {
                        self.start_run(worker, &job, sent_at, lease_ms);
                    } else {
                        self.drop_held(worker, &job);
                    }
                }
                // The claim may have won: ask with a heartbeat (§2).
                _ => self.claim_check(worker, job, tries),
            },
            Purpose::ClaimCheck { job, sent_at, tries } => match answer {
                Answer::Heartbeat(results) => {
                    let held = results
                        .first()
                        .is_some_and(|result| result.outcome == pb::HeartbeatOutcome::Extended as i32);
                    if held {
                        let lease_ms = self.lease_ms();
                        self.start_run(worker, &job, sent_at, lease_ms);
                    } else if tries < 10 {
                        self.claim(worker, job, tries + 1);
                    } else {
                        // Published again after the claim timeout.
                        self.drop_held(worker, &job);
                    }
                }
                _ => {
                    if tries < 40 {
                        let retry = self.rng.random_range(100..500);
                        self.retry_claim_check(worker, job, tries + 1, retry);
                    } else {
                        self.drop_held(worker, &job);
                    }
                }
            },
            Purpose::Heartbeat { run, sent_at } => {
                let Answer::Heartbeat(results) = answer else {
                    return;
                };
                let outcome = results.first().map(|result| result.outcome);
                if outcome == Some(pb::HeartbeatOutcome::Extended as i32) {
                    if let Some(active) = self.workers.list[worker].active.get_mut(&run) {
                        active.deadline = active.deadline.max(sent_at + active.lease_ms);
                    }
                } else if outcome == Some(pb::HeartbeatOutcome::LeaseLost as i32) {
                    self.stop_run(worker, run);
                }
            }
            Purpose::Complete {
                job_id,
                attempt,
                end,
                tries,
            } => {
                if matches!(answer, Answer::Unavailable) && tries < 40 {
                    let retry = self.rng.random_range(100..500);
                    self.retry_complete(worker, job_id, attempt, end, tries + 1, retry);
                } else {
                    let completing = &mut self.workers.list[worker].completing;
                    if let Some(index) = completing
                        .iter()
                        .position(|(other, other_attempt)| *other == job_id && *other_attempt == attempt)
                    {
                        completing.remove(index);
                    }
                }
            }
        }
    }

    /// With SIM_TRACE_JOB set to a job id: prints each answer a worker gets
    /// about that job.
    fn trace_answer(&self, worker: usize, purpose: &Purpose, answer: &Answer) {
        if let Ok(traced) = std::env::var("SIM_TRACE_JOB") {
            let job_id = match purpose {
                Purpose::Claim { job, .. } | Purpose::ClaimCheck { job, .. } => job.job_id.clone(),
                Purpose::Complete { job_id, .. } => job_id.clone(),
                Purpose::Heartbeat { run, .. } => self.workers.list[worker]
                    .active
                    .get(run)
                    .map(|active| active.job_id.clone())
                    .unwrap_or_default(),
            };
            if job_id == traced {
                let what = match purpose {
                    Purpose::Claim { .. } => "claim",
                    Purpose::ClaimCheck { .. } => "claim check",
                    Purpose::Complete { .. } => "complete",
                    Purpose::Heartbeat { .. } => "heartbeat",
                };
                eprintln!("{} ms worker {worker} {what} {job_id}: {answer:?}", self.now);
            }
        }
    }

    fn retry_claim_check(&mut self, worker: usize, job: pb::AdmittedJob, tries: u32, delay: i64) {
        self.after(delay, worker, WorkerEvent::RetryClaimCheck { job, tries });
    }

    fn retry_complete(&mut self, worker: usize, job_id: String, attempt: u32, end: AttemptEnd, tries: u32, delay: i64) {
        self.after(
            delay,
            worker,
            WorkerEvent::RetryComplete {
                job_id,
                attempt,
                end,
                tries,
            },
        );
    }

    fn lease_ms(&self) -> i64 {
        self.config.lease_ms
    }

    fn drop_held(&mut self, worker: usize, job: &pb::AdmittedJob) {
        let held = &mut self.workers.list[worker].held;
        if let Some(index) = held
            .iter()
            .position(|other| other.job_id == job.job_id && other.attempt == job.attempt)
        {
            held.remove(index);
        }
    }

    fn start_run(&mut self, worker: usize, job: &pb::AdmittedJob, claim_sent_at: i64, lease_ms: i64) {
        self.drop_held(worker, job);
        let lease_ms = if lease_ms > 0 { lease_ms } else { self.config.lease_ms };
        self.workers.next_run += 1;
        let run = self.workers.next_run;
        let duration = self.rng.random_range(50..(2 * lease_ms).max(100));
        let complete_twice = std::mem::take(&mut self.workers.list[worker].complete_twice_next);
        self.workers.list[worker].active.insert(
            run,
            ActiveRun {
                job_id: job.job_id.clone(),
                attempt: job.attempt,
                lease_ms,
                deadline: claim_sent_at + lease_ms,
                stalled_until: 0,
                complete_twice,
            },
        );
        if let Some(index) = job_index(&job.job_id) {
            self.checks.run_started(run, index, job.attempt, self.now, worker);
        }
        self.after(lease_ms / 3, worker, WorkerEvent::HeartbeatDue { run });
        self.after(duration, worker, WorkerEvent::RunEnds { run });
        self.after(lease_ms, worker, WorkerEvent::DeadlineCheck { run });
    }

    fn stop_run(&mut self, worker: usize, run: u64) {
        if self.workers.list[worker].active.remove(&run).is_some() {
            self.checks.run_ended(run, self.now);
        }
    }

    fn heartbeat(&mut self, worker: usize, run: u64) {
        let Some(active) = self.workers.list[worker].active.get(&run) else {
            return;
        };
        let (job_id, attempt, lease_ms) = (active.job_id.clone(), active.attempt, active.lease_ms);
        if active.stalled_until <= self.now {
            let token = self.send_heartbeat(worker, &job_id, attempt);
            let sent_at = self.now;
            self.workers.list[worker]
                .calls
                .insert(token, Purpose::Heartbeat { run, sent_at });
        }
        self.after(lease_ms / 3, worker, WorkerEvent::HeartbeatDue { run });
    }

    fn deadline_check(&mut self, worker: usize, run: u64) {
        let Some(active) = self.workers.list[worker].active.get(&run) else {
            return;
        };
        if self.now >= active.deadline {
            // Its own copy of the lease ran out: it stops the job (§3).
            self.stop_run(worker, run);
        } else {
            let left = active.deadline - self.now;
            self.after(left, worker, WorkerEvent::DeadlineCheck { run });
        }
    }

    fn run_ends(&mut self, worker: usize, run: u64) {
        let Some(active) = self.workers.list[worker].active.remove(&run) else {
            return;
        };
        self.checks.run_ended(run, self.now);
        let end = if self.rng.random_bool(0.05) {
            AttemptEnd::HandedBack {
                reason: "busy".to_string(),
            }
        } else if self.rng.random_bool(0.05) {
            AttemptEnd::Failed {
                error: "boom".to_string(),
                non_retryable: false,
            }
        } else {
            AttemptEnd::Succeeded
        };
        self.send_complete(worker, active.job_id.clone(), active.attempt, end.clone(), 0);
        if active.complete_twice {
            self.send_complete(worker, active.job_id, active.attempt, end, 0);
        }
    }

    /// A worker fault: it dies (its messages go to others after the
    /// session timeout, its runs stop), it stalls, it abandons a job, it
    /// hands one back, or it completes its next job twice.
    pub(crate) fn worker_fault(&mut self) {
        let up: Vec<usize> = (0..self.workers.list.len())
            .filter(|worker| self.workers.list[*worker].up)
            .collect();
        if up.len() < 2 {
            return;
        }
        let worker = up[self.rng.random_range(0..up.len())];
        let runs: Vec<u64> = self.workers.list[worker].active.keys().copied().collect();
        match self.rng.random_range(0..5) {
            0 => {
                let state = &mut self.workers.list[worker];
                state.up = false;
                state.calls.clear();
                state.completing.clear();
                let held = std::mem::take(&mut state.held);
                for run in runs {
                    self.stop_run(worker, run);
                }
                let redeliver_at = self.now + self.rng.random_range(500..3_000);
                for job in held {
                    self.workers.queue.push_back((redeliver_at, job));
                }
                let restart = self.rng.random_range(1_000..5_000);
                self.after(restart, worker, WorkerEvent::Restart);
            }
            1 => {
                let lease_ms = self.config.lease_ms;
                let stalled_until = self.now + self.rng.random_range(lease_ms / 2..2 * lease_ms);
                for active in self.workers.list[worker].active.values_mut() {
                    active.stalled_until = stalled_until;
                }
            }
            2 => {
                // Abandoned: the handler gave up silently; the worker lives.
                if let Some(run) = runs.first() {
                    self.stop_run(worker, *run);
                }
            }
            3 => {
                if let Some(run) = runs.first().copied() {
                    if let Some(active) = self.workers.list[worker].active.remove(&run) {
                        self.checks.run_ended(run, self.now);
                        let end = AttemptEnd::HandedBack {
                            reason: "shutting down".to_string(),
                        };
                        self.send_complete(worker, active.job_id, active.attempt, end, 0);
                    }
                }
            }
            _ => self.workers.list[worker].complete_twice_next = true,
        }
    }
}
