//! What a run's history says: the workers' event logs, the enqueue times,
//! GetJob's views at the end and the rate grants, turned into the figures
//! of the run's JSON line. Pure functions of their inputs (times in
//! wall-clock ms), so the checks themselves are tested below.

use std::collections::{BTreeMap, HashMap, HashSet};

use sluice_proto::v1 as pb;

use crate::events::{Event, Line};
use crate::workload::{is_floating, rate_key_of, RATE_LIMIT, RATE_WINDOW_MS};

/// The detail admission gives an attempt it hands back because no sign of
/// its worker came within the lease (taken for lost on its way: free).
const UNCONFIRMED_HAND_BACK: &str = "no sign of worker";
/// Slack for judging "while the worker's lease held": push and answer
/// times are taken on the worker's side.
const HELD_MARGIN_MS: i64 = 1000;

/// One worker process's log, and when the runner killed it.
pub struct WorkerHistory {
    pub lines: Vec<Line>,
    pub killed_at: Option<i64>,
}

/// A handler run of one attempt.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub job: usize,
    pub attempt: u32,
    pub worker: usize,
    pub start: i64,
    pub end: i64,
    /// `done`, `abandoned`, `lease_lost`, `lease_timeout`, `killed`, or
    /// `unended` (its worker lived on and logged no end).
    pub how: String,
}

/// The handler runs in the workers' logs; a run its worker did not end ends
/// when the worker was killed (or at `end_ms`).
pub fn runs_of(workers: &[WorkerHistory], end_ms: i64) -> Vec<Run> {
    let mut runs = Vec::new();
    for (worker, history) in workers.iter().enumerate() {
        let mut open: HashMap<(usize, u32), i64> = HashMap::new();
        for line in &history.lines {
            match &line.event {
                Event::Start => {
                    open.insert((line.job, line.attempt), line.at_ms);
                }
                Event::End { how } => {
                    if let Some(start) = open.remove(&(line.job, line.attempt)) {
                        runs.push(Run {
                            job: line.job,
                            attempt: line.attempt,
                            worker,
                            start,
                            end: line.at_ms,
                            how: how.clone(),
                        });
                    }
                }
                _ => {}
            }
        }
        for ((job, attempt), start) in open {
            runs.push(Run {
                job,
                attempt,
                worker,
                start,
                end: history.killed_at.unwrap_or(end_ms).max(start),
                how: if history.killed_at.is_some() {
                    "killed"
                } else {
                    "unended"
                }
                .to_string(),
            });
        }
    }
    runs.sort_by_key(|run| (run.start, run.job));
    runs
}

/// The ways a job ran more than once that at-least-once delivery does not
/// excuse.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Duplicates {
    /// Attempts won by more than one claim or push (each extra win).
    pub won_twice: usize,
    /// Pairs of runs of one job at the same time.
    pub overlapping: usize,
    /// Runs of a job that started after a success of it was accepted
    /// (ACCEPTED, or STALE while the worker's lease held).
    pub after_success: usize,
    /// Success completions answered STALE while the worker's lease still
    /// held by its own count.
    pub stale_while_held: usize,
    /// Heartbeats answered LEASE_LOST while the lease still held.
    pub lease_lost_while_held: usize,
    /// Jobs with any of the first three, a few of them.
    pub examples: Vec<String>,
}

impl Duplicates {
    pub fn total(&self) -> usize {
        self.won_twice + self.overlapping + self.after_success
    }
}

pub fn duplicates(workers: &[WorkerHistory], runs: &[Run]) -> Duplicates {
    let mut found = Duplicates::default();
    let mut flagged: BTreeMap<usize, &'static str> = BTreeMap::new();
    let mut wins: HashMap<(usize, u32), usize> = HashMap::new();
    // When each job's first accepted success was sent.
    let mut succeeded: HashMap<usize, i64> = HashMap::new();
    for line in workers.iter().flat_map(|worker| &worker.lines) {
        match &line.event {
            Event::Got { .. } => *wins.entry((line.job, line.attempt)).or_default() += 1,
            Event::Complete {
                answer,
                sent_ms,
                held_until_ms,
            } => {
                let held = *sent_ms + HELD_MARGIN_MS < *held_until_ms;
                if answer == "STALE" && held {
                    found.stale_while_held += 1;
                }
                if answer == "ACCEPTED" || (answer == "STALE" && held) {
                    let first = succeeded.entry(line.job).or_insert(*sent_ms);
                    *first = (*first).min(*sent_ms);
                }
            }
            Event::LeaseLost { held_until_ms } if line.at_ms + HELD_MARGIN_MS < *held_until_ms => {
                found.lease_lost_while_held += 1;
            }
            _ => {}
        }
    }
    for ((job, _), count) in &wins {
        if *count > 1 {
            found.won_twice += count - 1;
            flagged.entry(*job).or_insert("attempt won twice");
        }
    }
    let mut by_job: BTreeMap<usize, Vec<&Run>> = BTreeMap::new();
    for run in runs {
        by_job.entry(run.job).or_default().push(run);
    }
    for (job, runs) in &by_job {
        for (index, first) in runs.iter().enumerate() {
            for second in &runs[index + 1..] {
                if first.start < second.end && second.start < first.end {
                    found.overlapping += 1;
                    flagged.entry(*job).or_insert("runs at once");
                }
            }
        }
        if let Some(success) = succeeded.get(job) {
            let later = runs.iter().filter(|run| run.start > *success).count();
            if later > 0 {
                found.after_success += later;
                flagged.entry(*job).or_insert("ran again after a success");
            }
        }
    }
    found.examples = flagged
        .iter()
        .take(10)
        .map(|(job, why)| format!("chaos-{job}: {why}"))
        .collect();
    found
}

/// A job's end as GetJob showed it.
#[derive(Clone, Debug, Default)]
pub struct JobEnd {
    pub succeeded: bool,
    /// (attempt, outcome, detail) of each attempt that ended.
    pub history: Vec<(u32, String, String)>,
}

impl JobEnd {
    pub fn from_view(view: &pb::JobView) -> Self {
        JobEnd {
            succeeded: view.status == pb::JobStatus::Succeeded as i32,
            history: view
                .history
                .iter()
                .map(|record| (record.attempt, record.outcome.clone(), record.detail.clone()))
                .collect(),
        }
    }
}

/// Confirmed attempts (a claim answered CLAIMED, a heartbeat EXTENDED) that
/// admission then handed back as never confirmed, so they used no attempt:
/// the count, and a few of them.
pub fn attempts_not_counted(workers: &[WorkerHistory], ends: &HashMap<usize, JobEnd>) -> (usize, Vec<String>) {
    let confirmed: HashSet<(usize, u32)> = workers
        .iter()
        .flat_map(|worker| &worker.lines)
        .filter(|line| line.event == Event::Confirmed)
        .map(|line| (line.job, line.attempt))
        .collect();
    let mut found: Vec<(usize, u32)> = ends
        .iter()
        .flat_map(|(job, end)| {
            end.history
                .iter()
                .filter(|(attempt, outcome, detail)| {
                    outcome == "handed_back"
                        && detail.contains(UNCONFIRMED_HAND_BACK)
                        && confirmed.contains(&(*job, *attempt))
                })
                .map(move |(attempt, _, _)| (*job, *attempt))
        })
        .collect();
    found.sort_unstable();
    let examples = found
        .iter()
        .take(10)
        .map(|(job, attempt)| format!("chaos-{job} attempt {attempt}"))
        .collect();
    (found.len(), examples)
}

/// Attempts a live worker abandoned after admission confirmed them whose
/// end (GetJob's history) is not a lease expiry, which uses an attempt:
/// the count, and a few of them.
pub fn abandoned_not_expired(runs: &[Run], ends: &HashMap<usize, JobEnd>) -> (usize, Vec<String>) {
    let mut found: Vec<(usize, u32, String)> = runs
        .iter()
        .filter(|run| run.how == "abandoned")
        .filter_map(|run| {
            let outcome = ends
                .get(&run.job)?
                .history
                .iter()
                .find(|(attempt, _, _)| *attempt == run.attempt)
                .map_or("no record", |(_, outcome, _)| outcome.as_str());
            (outcome != "lease_expired").then(|| (run.job, run.attempt, outcome.to_string()))
        })
        .collect();
    found.sort_unstable();
    let examples = found
        .iter()
        .take(10)
        .map(|(job, attempt, outcome)| format!("chaos-{job} attempt {attempt}: {outcome}"))
        .collect();
    (found.len(), examples)
}

/// The most runs of one key at once; `key_of` says which key a job counts
/// on (`None`: none).
pub fn max_running(runs: &[Run], key_of: impl Fn(usize) -> Option<usize>) -> usize {
    let mut events: BTreeMap<usize, Vec<(i64, i32)>> = BTreeMap::new();
    for run in runs {
        let Some(key) = key_of(run.job) else {
            continue;
        };
        // An end before a start at the same instant: back to back is fine.
        events.entry(key).or_default().push((run.start, 1));
        events.entry(key).or_default().push((run.end, -1));
    }
    let mut most = 0;
    for mut events in events.into_values() {
        events.sort_unstable();
        let mut running = 0i32;
        for (_, change) in events {
            running += change;
            most = most.max(usize::try_from(running).unwrap_or(0));
        }
    }
    most
}

/// A period in which a key had a waiting job and nothing running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Idle {
    pub key: usize,
    pub from: i64,
    pub to: i64,
}

impl Idle {
    pub fn ms(&self) -> i64 {
        self.to - self.from
    }
}

/// What the idle measure needs besides the runs.
pub struct IdleInputs<'a> {
    pub enqueued: &'a HashMap<usize, i64>,
    pub succeeded: &'a HashSet<usize>,
    /// Rate steps the rate-window held while its window was full: (job,
    /// attempt) → (when the rate-window had the step, when it granted it).
    pub rate_waits: &'a HashMap<(usize, u32), (i64, i64)>,
    pub limit: u32,
    pub end: i64,
}

/// Every period in which a key had waiters and nothing running, shortest
/// first. A job waits from its enqueue (and from the end of each run that
/// was not its last) until a run starts; after its last run only if it
/// never succeeded. `key_of` names the key a job counts on (`None`: it
/// is not a waiter there, as floating-limit jobs, which wait on the
/// floating key first). A chained job waiting for its rate step holds its
/// key's slot: that wait is not the key's stall while the rate-window holds
/// the step in a full window (`rate_waits`), and is one before the step
/// reached it (sent late). A key whose every slot is held by such waits is
/// not stalled either.
pub fn idle_periods(runs: &[Run], inputs: &IdleInputs<'_>, key_of: impl Fn(usize) -> Option<usize>) -> Vec<Idle> {
    let mut by_job: HashMap<usize, Vec<&Run>> = HashMap::new();
    for run in runs {
        by_job.entry(run.job).or_default().push(run);
    }
    // (at, running, waiting, excused) changes per key.
    let mut events: BTreeMap<usize, Vec<(i64, i32, i32, i32)>> = BTreeMap::new();
    for run in runs {
        if let Some(key) = key_of(run.job) {
            events.entry(key).or_default().push((run.start, 1, 0, 0));
            events.entry(key).or_default().push((run.end, -1, 0, 0));
        }
    }
    for (job, enqueued) in inputs.enqueued {
        let Some(key) = key_of(*job) else { continue };
        let entry = events.entry(key).or_default();
        let mut runs = by_job.get(job).cloned().unwrap_or_default();
        runs.sort_by_key(|run| run.start);
        let mut from = *enqueued;
        for run in &runs {
            if run.start > from {
                entry.push((from, 0, 1, 0));
                entry.push((run.start, 0, -1, 0));
            }
            from = from.max(run.end);
        }
        if !inputs.succeeded.contains(job) && inputs.end > from {
            entry.push((from, 0, 1, 0));
            entry.push((inputs.end, 0, -1, 0));
        }
    }
    for ((job, _), (since, granted)) in inputs.rate_waits {
        let Some(key) = key_of(*job) else { continue };
        if granted > since {
            events.entry(key).or_default().push((*since, 0, 0, 1));
            events.entry(key).or_default().push((*granted, 0, 0, -1));
        }
    }
    let limit = i32::try_from(inputs.limit).unwrap_or(i32::MAX);
    let mut periods = Vec::new();
    for (key, mut events) in events {
        // At one instant: starts before ends (back to back is no stall).
        events.sort_by_key(|(at, running, waiting, excused)| (*at, -running, -waiting, -excused));
        let (mut running, mut waiting, mut excused) = (0, 0, 0);
        let mut since: Option<i64> = None;
        for (at, running_change, waiting_change, excused_change) in events {
            running += running_change;
            waiting += waiting_change;
            excused += excused_change;
            let idle = running == 0 && waiting - excused > 0 && excused < limit;
            match (idle, since) {
                (true, None) => since = Some(at),
                (false, Some(from)) => {
                    if at > from {
                        periods.push(Idle { key, from, to: at });
                    }
                    since = None;
                }
                _ => {}
            }
        }
        if let Some(from) = since.filter(|from| inputs.end > *from) {
            periods.push(Idle {
                key,
                from,
                to: inputs.end,
            });
        }
    }
    periods.sort_by_key(|idle| (idle.ms(), idle.key));
    periods
}

/// The `p` quantile of the periods' lengths, in seconds.
pub fn percentile_s(periods: &[Idle], p: f64) -> f64 {
    if periods.is_empty() {
        return 0.0;
    }
    let index = ((periods.len() as f64 - 1.0) * p).round() as usize;
    periods[index.min(periods.len() - 1)].ms() as f64 / 1000.0
}

/// The key a non-floating job counts on in the idle measure.
pub fn plain_key(keys: usize) -> impl Fn(usize) -> Option<usize> {
    move |job| (!is_floating(job)).then_some(job % keys.max(1))
}

/// The rate steps held by the rate-window, from its grants: per (job,
/// attempt), when it had the step and when it granted it (the first grant
/// of each ticket; a re-sent grant repeats it).
pub fn rate_waits(events: &[pb::GrantEvent]) -> HashMap<(usize, u32), (i64, i64)> {
    let mut waits = HashMap::new();
    for event in events {
        if event.kind != pb::LimitKind::Rate as i32 {
            continue;
        }
        let Some(ticket) = &event.ticket else { continue };
        let Some(job) = crate::workload::job_index(&ticket.job_id) else {
            continue;
        };
        if rate_key_of(job).is_none() {
            continue;
        }
        let entry = waits
            .entry((job, ticket.attempt))
            .or_insert((event.waiting_since_ms, event.granted_at_ms));
        if event.granted_at_ms < entry.1 {
            *entry = (event.waiting_since_ms, event.granted_at_ms);
        }
    }
    waits
}

/// Distinct rate grants (by ticket), and how many of them have more than
/// `RATE_LIMIT` grants of their key within `RATE_WINDOW_MS` up to and
/// including themselves, by the rate-window's grant time.
pub fn rate_windows_exceeded(events: &[pb::GrantEvent]) -> (usize, usize) {
    let mut by_key: HashMap<String, BTreeMap<(String, u32, u32), i64>> = HashMap::new();
    for event in events {
        if event.kind != pb::LimitKind::Rate as i32 {
            continue;
        }
        let (Some(key), Some(ticket)) = (&event.key, &event.ticket) else {
            continue;
        };
        by_key
            .entry(key.key.clone())
            .or_default()
            .entry((ticket.job_id.clone(), ticket.attempt, ticket.step))
            .or_insert(event.granted_at_ms);
    }
    let mut granted = 0;
    let mut exceeded = 0;
    for tickets in by_key.values() {
        let mut times: Vec<i64> = tickets.values().copied().collect();
        times.sort_unstable();
        granted += times.len();
        let mut first = 0;
        for (last, at) in times.iter().enumerate() {
            while times[first] <= at - RATE_WINDOW_MS {
                first += 1;
            }
            if i64::try_from(last - first + 1).unwrap_or(i64::MAX) > RATE_LIMIT {
                exceeded += 1;
            }
        }
    }
    (granted, exceeded)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(at_ms: i64, job: usize, attempt: u32, event: Event) -> Line {
        Line {
            at_ms,
            job,
            attempt,
            event,
        }
    }

    fn got(at: i64, job: usize, attempt: u32) -> Line {
        line(at, job, attempt, Event::Got { via: "push".into() })
    }

    fn ran(start: i64, end: i64, job: usize, attempt: u32) -> Vec<Line> {
        vec![
            got(start, job, attempt),
            line(start, job, attempt, Event::Start),
            line(end, job, attempt, Event::End { how: "done".into() }),
        ]
    }

    fn completed(at: i64, job: usize, attempt: u32, answer: &str, held_until_ms: i64) -> Line {
        line(
            at,
            job,
            attempt,
            Event::Complete {
                answer: answer.into(),
                sent_ms: at,
                held_until_ms,
            },
        )
    }

    fn worker(lines: Vec<Line>, killed_at: Option<i64>) -> WorkerHistory {
        WorkerHistory { lines, killed_at }
    }

    #[test]
    fn a_killed_workers_run_ends_at_the_kill() {
        let workers = [worker(vec![got(10, 1, 1), line(10, 1, 1, Event::Start)], Some(50))];
        let runs = runs_of(&workers, 1000);
        assert_eq!(runs.len(), 1);
        assert_eq!((runs[0].end, runs[0].how.as_str()), (50, "killed"));
    }

    #[test]
    fn a_rerun_after_a_kill_is_no_duplicate_but_one_after_an_accepted_success_is() {
        // Worker 0 ran job 1 and died before completing; worker 1 ran the
        // next attempt: at least once, not a duplicate.
        let mut first = ran(10, 20, 1, 1);
        first.pop();
        let workers = [
            worker(first, Some(25)),
            worker(
                [ran(100, 110, 1, 2), vec![completed(111, 1, 2, "ACCEPTED", 5000)]].concat(),
                None,
            ),
        ];
        let runs = runs_of(&workers, 1000);
        assert_eq!(duplicates(&workers, &runs).total(), 0);

        // A success accepted, and the job ran again.
        let workers = [
            worker(
                [ran(10, 20, 1, 1), vec![completed(21, 1, 1, "ACCEPTED", 5000)]].concat(),
                None,
            ),
            worker(ran(100, 110, 1, 2), None),
        ];
        let runs = runs_of(&workers, 1000);
        let found = duplicates(&workers, &runs);
        assert_eq!(found.after_success, 1);
        assert_eq!(found.examples, vec!["chaos-1: ran again after a success".to_string()]);
    }

    #[test]
    fn stale_while_the_lease_held_counts_as_a_success_and_stale_after_it_does_not() {
        let rerun = |held_until| {
            let workers = [
                worker(
                    [ran(10, 20, 1, 1), vec![completed(21, 1, 1, "STALE", held_until)]].concat(),
                    None,
                ),
                worker(ran(100, 110, 1, 2), None),
            ];
            let runs = runs_of(&workers, 1000);
            duplicates(&workers, &runs)
        };
        let fenced = rerun(30_000);
        assert_eq!((fenced.stale_while_held, fenced.after_success), (1, 1));
        let expired = rerun(15);
        assert_eq!((expired.stale_while_held, expired.total()), (0, 0));
    }

    #[test]
    fn one_attempt_won_by_two_workers_and_overlapping_runs_are_duplicates() {
        let workers = [worker(ran(10, 50, 1, 1), None), worker(ran(30, 60, 1, 1), None)];
        let runs = runs_of(&workers, 1000);
        let found = duplicates(&workers, &runs);
        assert_eq!((found.won_twice, found.overlapping), (1, 1));
    }

    #[test]
    fn only_confirmed_attempts_handed_back_as_unconfirmed_are_not_counted() {
        let workers = [worker(
            vec![got(10, 1, 1), line(11, 1, 1, Event::Confirmed), got(10, 2, 1)],
            Some(20),
        )];
        let hand_back = |attempt| {
            (
                attempt,
                "handed_back".to_string(),
                "no sign of worker \"w\" within the lease: the attempt was lost on its way (never ran)".to_string(),
            )
        };
        let ends: HashMap<usize, JobEnd> = [
            (
                1,
                JobEnd {
                    succeeded: true,
                    history: vec![hand_back(1)],
                },
            ),
            (
                2,
                JobEnd {
                    succeeded: true,
                    history: vec![hand_back(1)],
                },
            ),
        ]
        .into();
        assert_eq!(
            attempts_not_counted(&workers, &ends),
            (1, vec!["chaos-1 attempt 1".to_string()])
        );
    }

    #[test]
    fn an_abandoned_attempt_must_end_as_a_lease_expiry() {
        let abandoned = |job| Run {
            job,
            attempt: 1,
            worker: 0,
            start: 0,
            end: 10,
            how: "abandoned".into(),
        };
        let ends: HashMap<usize, JobEnd> = [
            (
                1,
                JobEnd {
                    succeeded: true,
                    history: vec![(1, "lease_expired".into(), String::new())],
                },
            ),
            (
                2,
                JobEnd {
                    succeeded: true,
                    history: vec![(1, "handed_back".into(), String::new())],
                },
            ),
        ]
        .into();
        assert_eq!(
            abandoned_not_expired(&[abandoned(1), abandoned(2)], &ends),
            (1, vec!["chaos-2 attempt 1: handed_back".to_string()])
        );
    }

    fn run(job: usize, start: i64, end: i64) -> Run {
        Run {
            job,
            attempt: 1,
            worker: 0,
            start,
            end,
            how: "done".into(),
        }
    }

    #[test]
    fn a_key_with_waiters_and_nothing_running_is_idle() {
        // Job 0 runs 0-100 on key 0; job 2 (key 0) waits from 50 and runs
        // only at 400: idle 100-400. Job 1 is on key 1, never waiting.
        let runs = [run(0, 0, 100), run(2, 400, 450), run(1, 0, 10)];
        let enqueued: HashMap<usize, i64> = [(0, 0), (2, 50), (1, 0)].into();
        let succeeded: HashSet<usize> = [0, 1, 2].into();
        let waits = HashMap::new();
        let inputs = IdleInputs {
            enqueued: &enqueued,
            succeeded: &succeeded,
            rate_waits: &waits,
            limit: 3,
            end: 1000,
        };
        let periods = idle_periods(&runs, &inputs, |job| Some(job % 2));
        assert_eq!(
            periods,
            vec![Idle {
                key: 0,
                from: 100,
                to: 400
            }]
        );
        assert_eq!(percentile_s(&periods, 0.99), 0.3);
    }

    #[test]
    fn a_wait_in_a_full_rate_window_is_no_stall_but_a_step_sent_late_is() {
        // Job 3 (key 1 of 2) holds its key from 0, reaches the rate-window
        // at 300, granted at 500, runs 500-520: idle 0-300 only.
        let runs = [run(3, 500, 520)];
        let enqueued: HashMap<usize, i64> = [(3, 0)].into();
        let succeeded: HashSet<usize> = [3].into();
        let waits: HashMap<(usize, u32), (i64, i64)> = [((3, 1), (300, 500))].into();
        let inputs = IdleInputs {
            enqueued: &enqueued,
            succeeded: &succeeded,
            rate_waits: &waits,
            limit: 3,
            end: 1000,
        };
        let periods = idle_periods(&runs, &inputs, |job| Some(job % 2));
        assert_eq!(
            periods,
            vec![Idle {
                key: 1,
                from: 0,
                to: 300
            }]
        );
    }

    #[test]
    fn a_job_that_never_succeeded_waits_until_the_end_and_a_rerun_waits_between_runs() {
        let runs = [run(0, 10, 20), run(0, 70, 80)];
        let enqueued: HashMap<usize, i64> = [(0, 0)].into();
        let succeeded = HashSet::new();
        let waits = HashMap::new();
        let inputs = IdleInputs {
            enqueued: &enqueued,
            succeeded: &succeeded,
            rate_waits: &waits,
            limit: 3,
            end: 200,
        };
        let periods = idle_periods(&runs, &inputs, |_| Some(0));
        assert_eq!(
            periods,
            vec![
                Idle {
                    key: 0,
                    from: 0,
                    to: 10
                },
                Idle {
                    key: 0,
                    from: 20,
                    to: 70
                },
                Idle {
                    key: 0,
                    from: 80,
                    to: 200
                },
            ]
        );
    }

    #[test]
    fn back_to_back_runs_are_not_over_a_limit() {
        let runs = [run(0, 0, 10), run(2, 10, 20), run(4, 5, 15)];
        assert_eq!(max_running(&runs, |job| Some(job % 2)), 2);
    }
}
