//! The guarantees, checked as the simulation goes, from what the workers
//! saw: one running attempt per job, no attempt run twice, no key with more
//! jobs running than its max; and at the end, every job ended, with the
//! stalls (a key with jobs waiting and nothing running) measured.

use std::collections::{BTreeMap, BTreeSet};

use crate::world::SimConfig;

struct Run {
    job: usize,
    attempt: u32,
    worker: usize,
    key: usize,
    start: i64,
    end: Option<i64>,
}

pub struct Checks {
    pub violation: Option<String>,
    keys: usize,
    max: usize,
    enqueued: Vec<Option<i64>>,
    ended: Vec<Option<i64>>,
    runs: BTreeMap<u64, Run>,
    running_by_job: BTreeMap<usize, u64>,
    running_by_key: Vec<usize>,
    attempts: BTreeSet<(usize, u32)>,
}

impl Checks {
    pub fn new(config: &SimConfig) -> Self {
        Checks {
            violation: None,
            keys: config.keys,
            max: usize::try_from(config.max).unwrap_or(usize::MAX),
            enqueued: vec![None; config.jobs],
            ended: vec![None; config.jobs],
            runs: BTreeMap::new(),
            running_by_job: BTreeMap::new(),
            running_by_key: vec![0; config.keys],
            attempts: BTreeSet::new(),
        }
    }

    fn key_of(&self, job: usize) -> usize {
        job % self.keys
    }

    pub fn enqueued(&mut self, job: usize, at: i64) {
        if let Some(slot) = self.enqueued.get_mut(job) {
            slot.get_or_insert(at);
        }
    }

    pub fn ended_at(&mut self, job: usize, at: i64) {
        if let Some(slot) = self.ended.get_mut(job) {
            slot.get_or_insert(at);
        }
    }

    pub fn ended(&self) -> usize {
        self.ended.iter().filter(|ended| ended.is_some()).count()
    }

    pub fn all_ended(&self, jobs: usize) -> bool {
        self.ended() == jobs
    }

    /// The first jobs that did not end, for the report.
    pub fn unfinished(&self, jobs: usize) -> String {
        let names: Vec<String> = (0..jobs)
            .filter(|job| self.ended[*job].is_none())
            .take(5)
            .map(|job| {
                let state = if self.enqueued[job].is_some() {
                    "enqueued"
                } else {
                    "never enqueued"
                };
                format!("{} ({state})", crate::world::job_name(job))
            })
            .collect();
        names.join(", ")
    }

    pub fn run_started(&mut self, run: u64, job: usize, attempt: u32, at: i64, worker: usize) {
        if self.violation.is_some() {
            return;
        }
        if let Some(other) = self.running_by_job.get(&job) {
            let (other_attempt, other_worker) = self.runs.get(other).map_or((0, 0), |run| (run.attempt, run.worker));
            self.violation = Some(format!(
                "one running attempt broken at {at} ms: {} attempt {attempt} started on worker {worker} while attempt {other_attempt} runs on worker {other_worker}",
                crate::world::job_name(job)
            ));
            return;
        }
        if !self.attempts.insert((job, attempt)) {
            self.violation = Some(format!(
                "an attempt ran twice at {at} ms: {} attempt {attempt} (worker {worker})",
                crate::world::job_name(job)
            ));
            return;
        }
        let key = self.key_of(job);
        self.running_by_key[key] += 1;
        if self.running_by_key[key] > self.max {
            self.violation = Some(format!(
                "overrun at {at} ms: key k{key} runs {} jobs, max {} ({} attempt {attempt} on worker {worker})",
                self.running_by_key[key],
                self.max,
                crate::world::job_name(job)
            ));
        }
        self.running_by_job.insert(job, run);
        self.runs.insert(
            run,
            Run {
                job,
                attempt,
                worker,
                key,
                start: at,
                end: None,
            },
        );
    }

    pub fn run_ended(&mut self, run: u64, at: i64) {
        let Some(record) = self.runs.get_mut(&run) else {
            return;
        };
        if record.end.is_some() {
            return;
        }
        record.end = Some(at);
        let (job, key) = (record.job, record.key);
        self.running_by_key[key] = self.running_by_key[key].saturating_sub(1);
        if self.running_by_job.get(&job) == Some(&run) {
            self.running_by_job.remove(&job);
        }
    }

    /// Every stretch of time a key had a job waiting (enqueued, not ended,
    /// not running) and nothing running, in ms.
    pub fn stalls(&self, now: i64) -> Vec<i64> {
        self.stretches(now).into_iter().map(|(_, from, to)| to - from).collect()
    }

    /// The longest stall after `since` (the faults stopped), counted from
    /// `since` at the earliest: (key, from, to).
    pub fn longest_stall_after(&self, since: i64, now: i64) -> Option<(usize, i64, i64)> {
        self.stretches(now)
            .into_iter()
            .filter(|(_, _, to)| *to > since)
            .map(|(key, from, to)| (key, from.max(since), to))
            .max_by_key(|(key, from, to)| (to - from, std::cmp::Reverse(*key)))
    }

    /// The stalls as (key, from, to).
    fn stretches(&self, now: i64) -> Vec<(usize, i64, i64)> {
        let mut stalls = Vec::new();
        for key in 0..self.keys {
            // (time, pending change, running change)
            let mut changes: Vec<(i64, i64, i64)> = Vec::new();
            for (job, enqueued) in self.enqueued.iter().enumerate() {
                if job % self.keys != key {
                    continue;
                }
                let Some(enqueued) = enqueued else {
                    continue;
                };
                changes.push((*enqueued, 1, 0));
                changes.push((self.ended[job].unwrap_or(now), -1, 0));
            }
            for run in self.runs.values().filter(|run| run.key == key) {
                changes.push((run.start, 0, 1));
                changes.push((run.end.unwrap_or(now), 0, -1));
            }
            changes.sort_unstable();
            let (mut pending, mut running) = (0i64, 0i64);
            let mut stalled_since: Option<i64> = None;
            for (at, pending_change, running_change) in changes {
                pending += pending_change;
                running += running_change;
                let stalled = pending > 0 && running == 0;
                match (stalled, stalled_since) {
                    (true, None) => stalled_since = Some(at),
                    (false, Some(since)) => {
                        if at > since {
                            stalls.push((key, since, at));
                        }
                        stalled_since = None;
                    }
                    _ => {}
                }
            }
            if let Some(since) = stalled_since {
                stalls.push((key, since, now));
            }
        }
        stalls
    }
}
