use super::*;

#[test]
fn a_floating_key_is_shared_and_refreshes_fall_due_on_enqueue_or_release_with_waiters() {
    let mut state = partition();
    // The first job creates the state with its default; b's default (9) is ignored.
    let (granted, dues) = run_at(
        &mut state,
        10_000,
        vec![acquire_floating("a", "f", 1, 1), acquire_floating("b", "f", 2, 9)],
    );
    assert_eq!(granted, vec!["a"], "max 1 from the first job's default_max");
    assert_eq!(dues.len(), 1, "the first waiter makes the first refresh due");
    assert_eq!(dues[0].current_max, 1);
    assert_eq!(dues[0].due_at_ms, 10_000);
    assert_eq!(dues[0].waiting, 1);
    assert_eq!(dues[0].metadata.get("region").map(String::as_str), Some("eu"));
    // Within the interval nothing more is due.
    let (granted, dues) = run_at(&mut state, 10_500, vec![acquire_floating("c", "f", 3, 1)]);
    assert!(granted.is_empty() && dues.is_empty());
    // A new max raises the limit and grants waiters at once.
    let (granted, _) = run_at(&mut state, 10_600, vec![set_floating_max("f", 3, "t1")]);
    assert_eq!(granted, vec!["b", "c"]);
    // The same task's value never applies twice.
    let (granted, _) = run_at(&mut state, 10_700, vec![set_floating_max("f", 1, "t1")]);
    assert!(granted.is_empty());
    let described = state.describe("t", "f", 10);
    assert_eq!(described.floating_max, Some(3));
    assert_eq!(
        described.floating.as_ref().map(|floating| floating.default_max),
        Some(1)
    );
    // A release after the interval, with waiters, makes the next refresh due.
    run_at(&mut state, 10_800, vec![acquire_floating("d", "f", 4, 1)]);
    let (granted, dues) = run_at(&mut state, 11_000, vec![release("a", "f")]);
    assert_eq!(granted, vec!["d"]);
    assert!(
        dues.is_empty(),
        "no waiters left after d's grant: nothing to refresh for"
    );
    let (_, dues) = run_at(&mut state, 11_100, vec![acquire_floating("e", "f", 5, 1)]);
    assert_eq!(dues.len(), 1, "interval passed and the key has waiters");
    assert_eq!(dues[0].current_max, 3);
    assert_eq!(dues[0].waiting, 1);
    let (_, dues) = run_at(&mut state, 11_200, vec![acquire_floating("g", "f", 6, 1)]);
    assert!(dues.is_empty(), "one due event per interval");
    // A new owner re-sends the last due event; the dispatcher ignores it by due_at_ms.
    let mut outbox = Outbox::new();
    state.resend_all(11_300, &mut outbox);
    let _grants = outbox.take_links();
    let resent: Vec<pb::RefreshDue> = outbox
        .into_messages()
        .iter()
        .filter(|message| &*message.topic == "refresh-due")
        .flat_map(|message| pb::RefreshDueBatch::decode(message.payload.as_slice()).unwrap().events)
        .collect();
    assert_eq!(resent.len(), 1);
    assert_eq!(resent[0].due_at_ms, 11_100);
}

#[test]
fn lowering_a_floating_max_affects_only_new_grants() {
    let mut state = partition();
    run_at(&mut state, 1_000, vec![acquire_floating("a", "f", 1, 4)]);
    let (granted, _) = run_at(
        &mut state,
        1_001,
        vec![
            acquire_floating("b", "f", 2, 4),
            acquire_floating("c", "f", 3, 4),
            acquire_floating("d", "f", 4, 4),
            acquire_floating("e", "f", 5, 4),
        ],
    );
    assert_eq!(granted, vec!["b", "c", "d"]);
    run_at(&mut state, 1_002, vec![set_floating_max("f", 2, "t1")]);
    assert_eq!(state.holders_of("t", "f"), 4, "running jobs are never interrupted");
    let (granted, _) = run_at(&mut state, 1_003, vec![release("a", "f"), release("b", "f")]);
    assert!(granted.is_empty(), "3 >= 2 holders: e waits");
    let (granted, _) = run_at(&mut state, 1_004, vec![release("c", "f")]);
    assert_eq!(granted, vec!["e"]);
}

/// Key `f` (max 1, interval 1 s) at 10 s: job a holds it, b waits; the
/// grants and the refresh-due events of that batch.
fn holder_and_waiter_at_10_s(state: &mut LimitPartition) -> (Vec<String>, Vec<pb::RefreshDue>) {
    run_at(
        state,
        10_000,
        vec![acquire_floating("a", "f", 1, 1), acquire_floating("b", "f", 2, 1)],
    )
}

/// The refresh-due events of a batch with no input (the owner's timer).
fn on_timer(state: &mut LimitPartition, now_ms: i64) -> Vec<pb::RefreshDue> {
    let decided = Core::apply(state, now_ms, &[], Vec::new());
    decided
        .sends
        .into_messages()
        .iter()
        .filter(|message| &*message.topic == "refresh-due")
        .flat_map(|message| pb::RefreshDueBatch::decode(message.payload.as_slice()).unwrap().events)
        .collect()
}

/// Holders that run long (or hang) release nothing and no job comes: the
/// key's waiters still get a refresh every interval, on the owner's timer —
/// that is when a higher max would let them in. A key without waiters
/// wakes nobody.
#[test]
fn a_waiting_floating_key_falls_due_every_interval_with_no_job_coming_or_going() {
    let mut state = partition();
    assert_eq!(Core::next_wakeup_ms(&state), None, "no floating key: no timer");
    let (granted, dues) = holder_and_waiter_at_10_s(&mut state);
    assert_eq!((granted.len(), dues.len()), (1, 1));
    // The interval (1 s in acquire_floating) from the last due event.
    assert_eq!(Core::next_wakeup_ms(&state), Some(11_000));
    assert!(on_timer(&mut state, 10_999).is_empty(), "not before the interval");
    let dues = on_timer(&mut state, 11_000);
    assert_eq!(dues.len(), 1, "due on the timer, with no job enqueued or released");
    assert_eq!((dues[0].due_at_ms, dues[0].waiting), (11_000, 1));
    assert_eq!(Core::next_wakeup_ms(&state), Some(12_000));
    let dues = on_timer(&mut state, 12_500);
    assert_eq!(dues.iter().map(|due| due.due_at_ms).collect::<Vec<_>>(), vec![12_500]);
    // The waiter gets in: the next batch forgets the key, and no timer is left.
    let (granted, _) = run_at(&mut state, 12_600, vec![set_floating_max("f", 2, "t1")]);
    assert_eq!(granted, vec!["b"]);
    assert!(
        on_timer(&mut state, 13_600).is_empty(),
        "nobody waits: nothing to refresh for"
    );
    assert_eq!(Core::next_wakeup_ms(&state), None);
}

/// A new owner loads a floating key with waiters: its timer runs from the
/// last due event saved.
#[test]
fn a_new_owner_keeps_refreshing_a_waiting_floating_key() {
    let mut state = partition();
    holder_and_waiter_at_10_s(&mut state);
    let keys: Vec<(KeyId, KeyRecord)> = state
        .keys
        .iter()
        .map(|(key_id, key_state)| (key_id.clone(), key_state.record.clone()))
        .collect();
    let mut restored = partition();
    restored.restore(20_000, keys, state.tickets().cloned().collect());
    assert_eq!(Core::next_wakeup_ms(&restored), Some(11_000));
    let dues = on_timer(&mut restored, 20_000);
    assert_eq!(dues.iter().map(|due| due.due_at_ms).collect::<Vec<_>>(), vec![20_000]);
}

/// A tiny interval (1 ms) makes the timer fire at most once a second, not
/// every millisecond; an enqueue still honours the interval.
#[test]
fn the_timer_refreshes_a_key_of_a_tiny_interval_at_most_once_a_second() {
    let with_interval = |job: &str, at_us: i64| {
        let mut command = acquire_floating(job, "f", at_us, 1);
        if let Some(pb::limit_command::Command::Acquire(acquire)) = command.command.as_mut() {
            if let Some(pb::acquire_ticket::Limit::Floating(floating)) = acquire.limit.as_mut() {
                floating.refresh_interval_ms = 1;
            }
        }
        command
    };
    let mut state = partition();
    let (_, dues) = run_at(&mut state, 10_000, vec![with_interval("a", 1), with_interval("b", 2)]);
    assert_eq!(dues.len(), 1);
    assert_eq!(
        Core::next_wakeup_ms(&state),
        Some(10_000 + super::super::refresh::MIN_TIMER_REFRESH_MS)
    );
    assert!(on_timer(&mut state, 10_500).is_empty(), "the timer waits a second");
    assert_eq!(on_timer(&mut state, 11_000).len(), 1);
    let (_, dues) = run_at(&mut state, 11_002, vec![with_interval("c", 3)]);
    assert_eq!(dues.len(), 1, "an enqueue 2 ms later: the 1 ms interval passed");
}

/// A waiting key whose floating state is deleted leaves the timer's watch:
/// no wake-up is left for it (it would otherwise fire at once, for ever).
#[test]
fn a_deleted_floating_key_leaves_no_refresh_timer() {
    let mut state = partition();
    holder_and_waiter_at_10_s(&mut state);
    assert_eq!(Core::next_wakeup_ms(&state), Some(11_000));
    let mut out = Decided::new();
    state.delete_floating(10_100, &("t".to_string(), "f".to_string()), &mut out);
    assert!(on_timer(&mut state, 10_200).is_empty());
    assert_eq!(
        Core::next_wakeup_ms(&state),
        None,
        "a timer left for a key that is no longer floating"
    );
}
