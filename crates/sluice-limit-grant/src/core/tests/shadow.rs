use super::*;

/// Run `arrivals` (ms) on key "s" (max `max`), each job holding its slot
/// for `hold_ms` from its real grant, on an explicit clock; in shadow
/// mode when `shadow`. Returns each job's measured wait (real grant minus
/// arrival) and the key's state at the end.
fn run_workload(shadow: bool, arrivals: &[i64], hold_ms: i64, max: u32) -> (Vec<i64>, pb::KeyState) {
    let mut state = partition();
    let mut releases: std::collections::BTreeMap<(i64, usize), String> = std::collections::BTreeMap::new();
    let mut waits = vec![0i64; arrivals.len()];
    let mut next_arrival = 0;
    loop {
        let release_due = releases.first_key_value().map(|((at, _), _)| *at);
        let arrival_due = arrivals.get(next_arrival).copied();
        let (now_ms, command) = match (release_due, arrival_due) {
            // A release at the same instant as an arrival goes first.
            (Some(release_at), arrival) if arrival.is_none_or(|arrival| release_at <= arrival) => {
                let Some((_, job)) = releases.pop_first() else { break };
                (release_at, release(&job, "s"))
            }
            (_, Some(arrival)) => {
                let job = format!("j{next_arrival}");
                next_arrival += 1;
                let mut command = acquire(&job, "s", 0, arrival, max);
                if let Some(pb::limit_command::Command::Acquire(acquire)) = command.command.as_mut() {
                    acquire.shadow = shadow;
                }
                (arrival, command)
            }
            _ => break,
        };
        let mut out = Decided::new();
        state.apply_command(now_ms, command, &mut out).unwrap();
        for grant in grants(&mut out.sends) {
            let job = grant.ticket.unwrap().job_id;
            let index: usize = job.trim_start_matches('j').parse().unwrap();
            waits[index] = grant.granted_at_ms - grant.waiting_since_ms;
            releases.insert((grant.granted_at_ms + hold_ms, index), job);
        }
    }
    (waits, state.describe("t", "s", 0))
}

#[test]
fn shadow_mode_predicts_the_waits_that_enforcing_measures() {
    // Bursts and gaps on a key of max 2, every job holding it 100 ms.
    let arrivals = [0, 0, 0, 10, 20, 30, 250, 260, 400, 400, 400, 400, 405];
    let (enforced, _) = run_workload(false, &arrivals, 100, 2);
    let (shadowed, shadow_state) = run_workload(true, &arrivals, 100, 2);
    assert!(
        shadowed.iter().all(|wait| *wait == 0),
        "shadow mode admits at once: {shadowed:?}"
    );
    let stats = shadow_state.shadow.expect("shadow stats");
    assert_eq!(stats.would_have_waited_count, arrivals.len() as u64);
    assert_eq!(
        stats.would_have_waited_ms_total,
        enforced.iter().sum::<i64>(),
        "predicted against measured waits: {enforced:?}"
    );
    assert_eq!(stats.would_have_waited_ms_max, *enforced.iter().max().unwrap());
    assert!(enforced.iter().sum::<i64>() > 0, "the workload does wait when enforced");
    // Up to 5 jobs ran at once on a key of 2: each grant over 2 counted.
    assert!(stats.would_have_exceeded > 0);
    assert_eq!((stats.would_hold, stats.would_wait), (0, 0));
}

#[test]
fn switching_a_key_from_shadow_to_enforce_applies_at_once() {
    let mut state = partition();
    let mode = |mode: pb::LimitMode| Query {
        id: 1,
        body: LimitQuery::SetLimit {
            tenant: "t".to_string(),
            key: "m".to_string(),
            change: LimitChange::Mode(Some(mode)),
        },
    };
    let apply_local = |state: &mut LimitPartition, query: Query<LimitQuery>| {
        let decided = state.apply(0, &[], vec![query]);
        assert!(matches!(decided.answers.as_slice(), [(1, LimitAnswer::KeyState(_))]));
        (decided.writes, decided.sends)
    };
    let (writes, _) = apply_local(&mut state, mode(pb::LimitMode::Shadow));
    assert_eq!(
        writes
            .keys
            .get(&("t".to_string(), "m".to_string()))
            .cloned()
            .flatten()
            .and_then(|record| record.mode),
        Some(pb::LimitMode::Shadow),
        "the mode is stored"
    );
    let (granted, _) = run(
        &mut state,
        (0..3)
            .map(|index| acquire(&format!("s{index}"), "m", 0, index, 1))
            .collect(),
    );
    assert_eq!(granted.len(), 3, "shadow mode grants past the max of 1");
    apply_local(&mut state, mode(pb::LimitMode::Enforce));
    let (granted, _) = run(&mut state, vec![acquire("e0", "m", 0, 10, 1)]);
    assert!(granted.is_empty(), "enforced at once: three hold a key of 1");
    for index in 0..3 {
        run(&mut state, vec![release(&format!("s{index}"), "m")]);
    }
    assert_eq!(state.holders_of("t", "m"), 1, "e0 granted once the shadow holders left");
    // Back to shadow: the waiters are granted at once.
    run(&mut state, vec![acquire("e1", "m", 0, 11, 1)]);
    assert_eq!(state.waiting_on("t", "m"), 1);
    let (_, outbox) = apply_local(&mut state, mode(pb::LimitMode::Shadow));
    assert_eq!(granted_jobs(outbox), vec!["e1".to_string()]);
}
