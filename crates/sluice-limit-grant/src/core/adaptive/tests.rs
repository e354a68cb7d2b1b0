use std::sync::Arc;

use super::*;

fn ticket(n: u64) -> TicketKey {
    TicketKey {
        job_id: Arc::from(format!("job-{n}").as_str()),
        attempt: 1,
        step: 0,
    }
}

fn settings(min: u32, max: u32, target_latency_ms: u64) -> AdaptiveSettings {
    AdaptiveSettings::of(&pb::AdaptiveConcurrencyLimit {
        key: "k".to_string(),
        min,
        max,
        initial: 0,
        target_latency_ms,
        max_error_ratio: 0.0,
        smoothing: 1.0,
    })
}

/// One saturated window of `count` completions of `run_ms`, `failed`
/// of them failed; the change it made.
fn window(adaptive: &mut Adaptive, next: &mut u64, run_ms: i64, failed: u32) -> Option<Change> {
    let size = adaptive.window.size;
    let tickets: Vec<TicketKey> = (0..size)
        .map(|_| {
            *next += 1;
            ticket(*next)
        })
        .collect();
    for ticket in &tickets {
        adaptive.granted(ticket);
    }
    adaptive.saturated();
    let mut change = None;
    for (index, ticket) in tickets.iter().enumerate() {
        let outcome = if u32::try_from(index).unwrap() < failed {
            Outcome::Failed
        } else {
            Outcome::Succeeded
        };
        change = adaptive.observe(0, ticket, run_ms, outcome).or(change);
    }
    change
}

#[test]
fn defaults_fill_the_zeros_and_bad_values_are_clamped() {
    let settings = AdaptiveSettings::of(&pb::AdaptiveConcurrencyLimit {
        max_error_ratio: f64::NAN,
        smoothing: 7.0,
        ..Default::default()
    });
    assert_eq!((settings.min, settings.max, settings.initial), (1, DEFAULT_MAX, 1));
    assert_eq!(settings.max_error_ratio, DEFAULT_MAX_ERROR_RATIO);
    assert_eq!(settings.smoothing, 1.0);
    let settings = AdaptiveSettings::of(&pb::AdaptiveConcurrencyLimit {
        min: 10,
        max: 5,
        initial: 50,
        ..Default::default()
    });
    assert_eq!((settings.min, settings.max, settings.initial), (10, 10, 10));
}

#[test]
fn slow_start_doubles_then_a_slow_window_shrinks_by_the_gradient_and_growth_turns_additive() {
    let mut adaptive = Adaptive::new(settings(1, 1000, 100));
    let mut next = 0;
    let mut seen = vec![adaptive.current()];
    for _ in 0..5 {
        window(&mut adaptive, &mut next, 50, 0);
        seen.push(adaptive.current());
    }
    assert_eq!(seen, vec![1, 2, 4, 8, 16, 32]);
    // Twice the target: the max halves (smoothing 1), slow start ends.
    let change = window(&mut adaptive, &mut next, 200, 0).unwrap();
    assert_eq!((change.from, change.to), (32, 16));
    assert!(matches!(change.reason, ChangeReason::Latency { target_ms: 100, .. }));
    assert_eq!(
        change.reason.to_string(),
        "latency: mean run 200 ms over the 100 ms target"
    );
    window(&mut adaptive, &mut next, 50, 0);
    assert_eq!(adaptive.current(), 17);
    assert_eq!(adaptive.describe("k").changes, 7);
}

#[test]
fn errors_shrink_by_their_share_and_an_unsaturated_window_does_not_grow() {
    let mut adaptive = Adaptive::new(AdaptiveSettings {
        initial: 20,
        ..settings(1, 100, 0)
    });
    let mut next = 0;
    // 5 of 20 failed: 25 % over the 10 % allowed.
    let change = window(&mut adaptive, &mut next, 10, 5).unwrap();
    assert_eq!((change.from, change.to), (20, 15));
    assert_eq!(change.reason.label(), "errors");
    // Within the targets but the key never filled: no growth.
    let tickets: Vec<TicketKey> = (100..115).map(ticket).collect();
    for ticket in &tickets {
        adaptive.granted(ticket);
    }
    for ticket in &tickets {
        assert_eq!(adaptive.observe(0, ticket, 10, Outcome::Succeeded), None);
    }
    assert_eq!(adaptive.current(), 15);
    assert_eq!(adaptive.describe("k").window_samples, 15);
}

#[test]
fn only_jobs_granted_in_the_open_window_count() {
    let mut adaptive = Adaptive::new(settings(1, 100, 100));
    let old = ticket(1);
    adaptive.granted(&old);
    let mut next = 10;
    window(&mut adaptive, &mut next, 10, 0);
    assert_eq!(adaptive.current(), 2);
    // Granted before the window closed: its slow run is not this window's.
    assert_eq!(adaptive.observe(0, &old, 10_000, Outcome::Failed), None);
    assert_eq!(adaptive.describe("k").open_window_samples, 0);
}

#[test]
fn a_shrink_moves_smoothing_of_the_way_at_most_halving_and_stays_within_the_bounds() {
    let mut adaptive = Adaptive::new(AdaptiveSettings {
        initial: 40,
        smoothing: 0.5,
        ..settings(4, 100, 100)
    });
    let mut next = 0;
    // Computed 40 × 100/125 = 32; half way: 36.
    window(&mut adaptive, &mut next, 125, 0);
    assert_eq!(adaptive.current(), 36);
    // Ten times the target: at most halving.
    // Computed 36 × 100/1000 = 3.6; half way: 19.8 (halving would be 18).
    window(&mut adaptive, &mut next, 1000, 0);
    assert_eq!(adaptive.current(), 19);
    // Smoothing 1: the computed 1.9 is less than half, so half.
    adaptive.settings.smoothing = 1.0;
    window(&mut adaptive, &mut next, 1000, 0);
    assert_eq!(adaptive.current(), 9);
    for _ in 0..10 {
        window(&mut adaptive, &mut next, 1000, 0);
    }
    assert_eq!(adaptive.current(), 4);
}

#[test]
fn the_stored_part_survives_and_a_new_owner_opens_a_new_window() {
    let mut adaptive = Adaptive::new(settings(1, 100, 100));
    let mut next = 0;
    for _ in 0..3 {
        window(&mut adaptive, &mut next, 10, 0);
    }
    window(&mut adaptive, &mut next, 400, 0);
    let restored = Adaptive::from_stored(adaptive.stored("k"));
    assert_eq!(restored.current(), adaptive.current());
    assert_eq!(restored.describe("k").last_change, adaptive.describe("k").last_change);
    assert!(!restored.describe("k").slow_start);
}
