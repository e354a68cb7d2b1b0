use super::*;

/// A downstream that serves `capacity` jobs at once in `base_ms`; above
/// that its latency climbs with the load: a job started with `running`
/// jobs in flight takes `base × (1 + 2 × (running − capacity) / capacity)`.
#[derive(Clone, Copy)]
struct Downstream {
    capacity: u32,
    base_ms: i64,
}

impl Downstream {
    fn run_ms(self, running: u32) -> i64 {
        let over = i64::from(running.saturating_sub(self.capacity));
        self.base_ms + 2 * self.base_ms * over / i64::from(self.capacity)
    }
}

fn acquire_adaptive(job: &str, spec: &pb::AdaptiveConcurrencyLimit) -> pb::LimitCommand {
    pb::LimitCommand {
        command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
            key: key(&spec.key),
            ticket: Some(pb::TicketId {
                job_id: job.to_string(),
                attempt: 1,
                step: 0,
            }),
            limit: Some(pb::acquire_ticket::Limit::Adaptive(spec.clone())),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn release_after(job: &str, key_name: &str, run_ms: i64, reason: pb::ReleaseReason) -> pb::LimitCommand {
    let mut command = release(job, key_name);
    if let Some(pb::limit_command::Command::Release(release)) = &mut command.command {
        release.run_ms = Some(u64::try_from(run_ms).unwrap());
        release.reason = reason as i32;
    }
    command
}

/// Runs an adaptive key against `phases` of a downstream, each for a
/// number of completions, on an explicit clock, with jobs always waiting.
/// Returns the key's max after every completion, and checks at every
/// grant that the holders never exceed the max they were granted under.
fn simulate(spec: &pb::AdaptiveConcurrencyLimit, phases: &[(Downstream, usize)]) -> Vec<u32> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut state = partition();
    let mut now_ms = 0i64;
    let mut next_job = 0u64;
    // (ends at, job, run ms)
    let mut running: BinaryHeap<Reverse<(i64, String, i64)>> = BinaryHeap::new();
    let mut maxes = Vec::new();
    let apply = |state: &mut LimitPartition, command: pb::LimitCommand, now_ms: i64| {
        let mut out = Decided::new();
        state.apply_command(now_ms, command, &mut out).unwrap();
        grants(&mut out.sends)
    };
    for (downstream, completions) in phases {
        for _ in 0..*completions {
            // Keep ten jobs waiting: the key is always in demand.
            while state.waiting_on("t", &spec.key) < 10 {
                next_job += 1;
                let job = format!("job-{next_job}");
                for grant in apply(&mut state, acquire_adaptive(&job, spec), now_ms) {
                    assert!(i64::from(grant.holders) <= grant.max, "overrun");
                    let run_ms = downstream.run_ms(grant.holders);
                    running.push(Reverse((now_ms + run_ms, grant.ticket.unwrap().job_id, run_ms)));
                }
            }
            let Reverse((ends_at, job, run_ms)) = running.pop().expect("a job runs");
            now_ms = ends_at;
            let release = release_after(&job, &spec.key, run_ms, pb::ReleaseReason::Succeeded);
            for grant in apply(&mut state, release, now_ms) {
                assert!(i64::from(grant.holders) <= grant.max, "overrun");
                let run_ms = downstream.run_ms(grant.holders);
                running.push(Reverse((now_ms + run_ms, grant.ticket.unwrap().job_id, run_ms)));
            }
            let described = state.describe("t", &spec.key, 0);
            maxes.push(described.adaptive.unwrap().current_max);
        }
    }
    maxes
}

fn adaptive_spec() -> pb::AdaptiveConcurrencyLimit {
    pb::AdaptiveConcurrencyLimit {
        key: "api".to_string(),
        min: 1,
        max: 500,
        initial: 0,
        target_latency_ms: 110,
        max_error_ratio: 0.0,
        smoothing: 0.0,
    }
}

/// The first completion from which every later max is within `low..=high`.
fn settled_from(maxes: &[u32], low: u32, high: u32) -> Option<usize> {
    let last_outside = maxes.iter().rposition(|max| !(low..=high).contains(max));
    match last_outside {
        None => Some(0),
        Some(index) if index + 1 < maxes.len() => Some(index + 1),
        Some(_) => None,
    }
}

#[test]
fn an_adaptive_key_settles_near_the_concurrency_where_latency_climbs() {
    let downstream = Downstream {
        capacity: 40,
        base_ms: 100,
    };
    let maxes = simulate(&adaptive_spec(), &[(downstream, 4_000)]);
    // ±20 % of 40, within 1,000 completions (from a max of 1).
    let settled = settled_from(&maxes, 32, 48).expect("settles within ±20 % of 40");
    assert!(settled <= 1_000, "settled only after {settled} completions: {maxes:?}");
    assert!(maxes.iter().all(|max| (1..=500).contains(max)));
}

#[test]
fn an_adaptive_key_backs_off_when_the_downstream_slows_down_mid_run() {
    let fast = Downstream {
        capacity: 40,
        base_ms: 100,
    };
    let slow = Downstream {
        capacity: 10,
        base_ms: 100,
    };
    let maxes = simulate(&adaptive_spec(), &[(fast, 2_000), (slow, 3_000)]);
    let (before, after) = maxes.split_at(2_000);
    assert!(settled_from(before, 32, 48).is_some(), "{before:?}");
    let settled = settled_from(after, 8, 12).expect("settles within ±20 % of 10");
    assert!(settled <= 1_000, "settled only after {settled} completions: {after:?}");
    // And it recovers when the downstream does.
    let maxes = simulate(&adaptive_spec(), &[(slow, 1_000), (fast, 4_000)]);
    let settled = settled_from(&maxes[1_000..], 32, 48).expect("grows back within ±20 % of 40");
    assert!(settled <= 2_500, "grew back only after {settled} completions");
}

#[test]
fn an_adaptive_key_shrinks_on_errors_and_its_changes_are_described() {
    let spec = pb::AdaptiveConcurrencyLimit {
        target_latency_ms: 0,
        initial: 20,
        max_error_ratio: 0.2,
        smoothing: 1.0,
        ..adaptive_spec()
    };
    let mut state = partition();
    let mut holders = Vec::new();
    for index in 0..40 {
        let job = format!("job-{index}");
        let mut out = Decided::new();
        state.apply_command(0, acquire_adaptive(&job, &spec), &mut out).unwrap();
        holders.extend(
            grants(&mut out.sends)
                .into_iter()
                .map(|grant| grant.ticket.unwrap().job_id),
        );
        if index == 0 {
            // The first job creates the key's state, saved with the key.
            assert!(out
                .writes
                .keys
                .values()
                .any(|record| record.as_ref().is_some_and(|record| record.adaptive.is_some())));
        }
    }
    assert_eq!(holders.len(), 20);
    // Half the window fails (a lost lease counts as a failure; a
    // cancelled job says nothing about the downstream).
    let mut saved = None;
    for (index, job) in holders.iter().enumerate() {
        let reason = match index % 4 {
            0 => pb::ReleaseReason::Failed,
            1 => pb::ReleaseReason::LeaseExpired,
            _ => pb::ReleaseReason::Succeeded,
        };
        let mut out = Decided::new();
        state
            .apply_command(1_000, release_after(job, "api", 50, reason), &mut out)
            .unwrap();
        if let Some(Some(record)) = out.writes.keys.remove(&("t".to_string(), "api".to_string())) {
            saved = record.adaptive;
        }
    }
    let described = state.describe("t", "api", 0);
    assert_eq!(described.kind, pb::LimitKind::Adaptive as i32);
    assert_eq!(described.effective_max, Some(10));
    let adaptive = described.adaptive.unwrap();
    assert_eq!(adaptive.current_max, 10);
    assert_eq!(adaptive.window_samples, 20);
    assert_eq!(adaptive.window_error_ratio, 0.5);
    let change = adaptive.last_change.unwrap();
    assert_eq!((change.from, change.to, change.at_ms), (20, 10, 1_000));
    assert_eq!(
        change.reason,
        "errors: 50 % of the window failed, over the 20 % allowed"
    );
    // The change was saved with the key: a new owner starts from 10.
    assert_eq!(saved.map(|adaptive| adaptive.current()), Some(10));
    // Like a lowered floating max, the new max only affects new grants:
    // the first 19 releases each granted a waiter under the old max, the
    // 20th (which closed the window) none; no more until holders < 10.
    assert_eq!(state.holders_of("t", "api"), 19);
    assert_eq!(state.waiting_on("t", "api"), 1);
    // An override beats the computed max.
    run(&mut state, vec![set_override("api", Some(3))]);
    assert_eq!(state.describe("t", "api", 0).effective_max, Some(3));
}
