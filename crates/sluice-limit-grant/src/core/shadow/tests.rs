use super::*;
use std::sync::Arc;

fn ticket(job: &str) -> TicketKey {
    TicketKey {
        job_id: Arc::from(job),
        attempt: 1,
        step: 0,
    }
}

#[test]
fn ten_jobs_of_100_ms_on_a_key_of_one_would_have_waited_in_turn() {
    let mut sim: ShadowSim<u64> = ShadowSim::default();
    for index in 0..10u64 {
        sim.arrive(ticket(&format!("j{index}")), index, 0, CompactTraceContext::default());
    }
    let mut waits = Vec::new();
    waits.extend(sim.pump(1));
    // In reality all ran at once, each for 100 ms.
    for index in 0..10u64 {
        sim.release(&ticket(&format!("j{index}")), 100);
        waits.extend(sim.pump(1));
    }
    let waited: Vec<i64> = waits.iter().map(|grant| grant.waited_ms).collect();
    assert_eq!(waited, (0..10).map(|index| index * 100).collect::<Vec<i64>>());
    assert_eq!(sim.totals.would_have_waited_ms_total, 4_500);
    assert_eq!(sim.totals.would_have_waited_ms_max, 900);
    assert!(sim.is_empty());
}

#[test]
fn a_later_arrival_waits_only_for_what_is_still_held_then() {
    let mut sim: ShadowSim<u64> = ShadowSim::default();
    sim.arrive(ticket("a"), 0, 0, CompactTraceContext::default());
    sim.pump(1);
    sim.arrive(ticket("b"), 1, 50, CompactTraceContext::default());
    assert!(sim.pump(1).is_empty(), "b would wait for a");
    sim.release(&ticket("a"), 100);
    let granted = sim.pump(1);
    assert_eq!(
        granted.iter().map(|grant| grant.waited_ms).collect::<Vec<_>>(),
        vec![50]
    );
    sim.release(&ticket("b"), 150); // held 100 ms from its real grant at 50: frees at 200
    sim.arrive(ticket("c"), 2, 300, CompactTraceContext::default());
    assert_eq!(sim.pump(1).first().map(|grant| grant.waited_ms), Some(0));
}

#[test]
fn real_grants_over_the_max_are_counted() {
    let mut sim: ShadowSim<u64> = ShadowSim::default();
    assert!(!sim.real_grant(2, 2));
    assert!(sim.real_grant(3, 2));
    assert_eq!(sim.totals.would_have_exceeded, 1);
}
