use super::*;

#[test]
fn grants_up_to_the_jobs_max_then_queues_by_priority_then_time() {
    let mut state = partition();
    let (granted, _) = run(
        &mut state,
        vec![
            acquire("a", "k", 50, 1, 2),
            acquire("b", "k", 50, 2, 2),
            acquire("c", "k", 50, 3, 2),
            acquire("d", "k", 10, 4, 2),
            acquire("e", "k", 50, 0, 2),
        ],
    );
    assert_eq!(granted, vec!["a", "b"]);
    assert_eq!(state.holders_of("t", "k"), 2);
    // Order now: d (priority 10), then e (enqueued 0), then c.
    let (granted, _) = run(&mut state, vec![release("a", "k")]);
    assert_eq!(granted, vec!["d"]);
    let (granted, _) = run(&mut state, vec![release("b", "k"), release("d", "k")]);
    assert_eq!(granted, vec!["e", "c"]);
    let (granted, _) = run(&mut state, vec![release("e", "k"), release("c", "k")]);
    assert!(granted.is_empty());
    assert!(state.keys.is_empty(), "idle keys are dropped from memory");
}

#[test]
fn the_head_is_not_overtaken_by_a_job_with_a_larger_max() {
    let mut state = partition();
    let (granted, _) = run(
        &mut state,
        vec![
            acquire("a", "k", 50, 1, 1),
            acquire("b", "k", 50, 2, 1),
            acquire("c", "k", 50, 3, 5),
        ],
    );
    // b is head and needs max 1; c (max 5) behind it must not be granted.
    assert_eq!(granted, vec!["a"]);
    assert_eq!(state.waiting_on("t", "k"), 2);
}

#[test]
fn duplicates_change_nothing_and_resend_the_grant() {
    let mut state = partition();
    let (granted, first_writes) = run(&mut state, vec![acquire("a", "k", 50, 1, 1)]);
    assert_eq!(granted, vec!["a"]);
    assert_eq!(first_writes.upserts.len(), 1);
    let (granted, writes) = run(&mut state, vec![acquire("a", "k", 50, 1, 1)]);
    assert_eq!(
        granted,
        vec!["a"],
        "a duplicate acquire from a holder re-sends its grant"
    );
    assert!(writes.is_empty());
    let (_, writes) = run(&mut state, vec![release("a", "k"), release("a", "k")]);
    assert_eq!(writes.deletes.len(), 1);
    let (_, writes) = run(&mut state, vec![release("a", "k")]);
    assert!(writes.is_empty(), "a release of nothing changes nothing");
}

#[test]
fn a_misrouted_command_is_refused() {
    let mut state = LimitPartition::new(
        PartitionSettings {
            partition: 0,
            limit_partitions: 64,
            grants_partitions: 1,
            refresh_due_topic: Arc::from("refresh-due"),
            refresh_due_partitions: 1,
            max_message_bytes: 1_000_000,
            ticket_grace_ms: 30_000,
            input: InputLimits::default(),
        },
        1,
    );
    let misrouted = (0..100)
        .map(|index| format!("k{index}"))
        .find(|name| key_partition("t", name, 64) != 0)
        .unwrap();
    let error = state
        .apply_command(0, acquire("a", &misrouted, 50, 1, 1), &mut Decided::new())
        .unwrap_err();
    assert!(error.contains("hashes to partition"), "{error}");
}
