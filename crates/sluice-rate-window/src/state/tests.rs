//! Unit tests of a rate partition.

use super::*;
use prost::Message as _;

fn partition() -> RatePartition {
    RatePartition::new(PartitionSettings {
        partition: 0,
        rate_partitions: 1,
        grants_partitions: 1,
        max_message_bytes: 1_000_000,
        granted_retention_ms: 60_000,
        input: InputLimits::default(),
    })
}

fn inline_key(name: &str) -> pb::RateKeyRef {
    pb::RateKeyRef {
        tenant: "t".to_string(),
        kind: Some(pb::rate_key_ref::Kind::Inline(pb::InlineKey {
            name: name.to_string(),
            unique_key: String::new(),
        })),
    }
}

fn acquire(
    job: &str,
    key: pb::RateKeyRef,
    priority: u32,
    enqueued: i64,
    limit: i64,
    window_ms: i64,
) -> pb::RateAcquire {
    pb::RateAcquire {
        key: Some(key),
        ticket: Some(pb::TicketId {
            job_id: job.to_string(),
            attempt: 1,
            step: 0,
        }),
        priority,
        enqueued_at_us: enqueued,
        limit,
        window_ms,
        cost: 1,
    }
}

fn grants(mut outbox: Outbox) -> Vec<(String, i64, bool)> {
    outbox
        .take_links()
        .into_values()
        .flatten()
        .map(|event| pb::GrantEvent::decode(event.as_slice()).unwrap())
        .map(|event| (event.ticket.unwrap().job_id, event.granted_at_ms, event.unthrottled))
        .collect()
}

fn step(state: &mut RatePartition, now: i64, commands: Vec<pb::RateAcquire>) -> (Vec<(String, i64, bool)>, RateWrites) {
    let mut writes = RateWrites::default();
    let mut outbox = Outbox::new();
    state.run_timers(now, &mut writes, &mut outbox);
    for command in commands {
        state
            .acquire(now, command, pb::TraceContext::default(), &mut writes, &mut outbox)
            .unwrap();
    }
    (grants(outbox), writes)
}

#[test]
fn over_the_limit_waits_for_the_exact_slot_and_keeps_queue_order() {
    let mut state = partition();
    let key = inline_key("api");
    let (granted, writes) = step(
        &mut state,
        1_000,
        vec![
            acquire("a", key.clone(), 5, 1, 2, 1000),
            acquire("b", key.clone(), 5, 2, 2, 1000),
            acquire("c", key.clone(), 5, 3, 2, 1000),
            acquire("d", key.clone(), 1, 4, 2, 1000),
        ],
    );
    assert_eq!(
        granted.iter().map(|grant| grant.0.as_str()).collect::<Vec<_>>(),
        vec!["a", "b"]
    );
    assert_eq!(writes.grant_units.values().sum::<u64>(), 2);
    // d (priority 1) is now the head; the slot opens when a's grant leaves.
    assert_eq!(state.next_wakeup_ms(), Some(2_000));
    let (granted, _) = step(&mut state, 1_999, vec![]);
    assert!(granted.is_empty(), "nothing before the slot");
    let (granted, _) = step(&mut state, 2_000, vec![]);
    assert_eq!(
        granted,
        vec![("d".to_string(), 2_000, false), ("c".to_string(), 2_000, false)]
    );
}

#[test]
fn duplicates_resend_the_grant_without_taking_units_twice() {
    let mut state = partition();
    let key = inline_key("api");
    step(&mut state, 0, vec![acquire("a", key.clone(), 5, 1, 1, 1000)]);
    let (granted, writes) = step(&mut state, 10, vec![acquire("a", key.clone(), 5, 1, 1, 1000)]);
    assert_eq!(granted.len(), 1, "the grant is re-sent");
    assert!(writes.grant_units.is_empty(), "no second unit");
    let (granted, _) = step(&mut state, 20, vec![acquire("b", key, 5, 2, 1, 1000)]);
    assert!(granted.is_empty(), "a's one unit still fills the window");
}

#[test]
fn a_missing_resource_does_not_throttle_and_deleting_one_releases_waiters() {
    let mut state = partition();
    let resource = pb::RateKeyRef {
        tenant: "t".to_string(),
        kind: Some(pb::rate_key_ref::Kind::ResourceKey("smtp".to_string())),
    };
    let (granted, _) = step(&mut state, 0, vec![acquire("free", resource.clone(), 5, 1, 0, 0)]);
    assert_eq!(granted, vec![("free".to_string(), 0, true)]);

    let mut writes = RateWrites::default();
    let mut outbox = Outbox::new();
    state
        .put_resource(
            0,
            pb::RateLimitResource {
                tenant: "t".to_string(),
                resource_key: "smtp".to_string(),
                max_count: 1,
                window_seconds: 60,
            },
            &mut writes,
            &mut outbox,
        )
        .unwrap();
    let (granted, _) = step(
        &mut state,
        1,
        vec![
            acquire("x", resource.clone(), 5, 2, 0, 0),
            acquire("y", resource.clone(), 5, 3, 0, 0),
        ],
    );
    assert_eq!(granted.len(), 1);
    assert_eq!(state.waiting(), 1);
    let mut outbox = Outbox::new();
    let deleted = state
        .delete_resource(
            2,
            "t".to_string(),
            "smtp".to_string(),
            &mut RateWrites::default(),
            &mut outbox,
        )
        .unwrap();
    assert!(deleted.deleted);
    assert_eq!(deleted.released_waiters, 1);
    assert_eq!(grants(outbox), vec![("y".to_string(), 2, true)]);
    assert_eq!(state.next_wakeup_ms(), None);
}

#[test]
fn try_acquire_is_exact_and_does_not_overtake_waiting_jobs() {
    let mut state = partition();
    let key = inline_key("plain");
    let mut writes = RateWrites::default();
    let allowed = state.try_acquire(0, &key, 2, 1000, 2, &mut writes).unwrap();
    assert!(allowed.allowed);
    assert_eq!(allowed.remaining, 0);
    let refused = state.try_acquire(500, &key, 2, 1000, 1, &mut writes).unwrap();
    assert!(!refused.allowed);
    assert_eq!(refused.retry_at_ms, Some(1000));
    assert!(
        state.try_acquire(0, &key, 2, 1000, 3, &mut writes).is_err(),
        "cost above the limit"
    );
    step(&mut state, 600, vec![acquire("job", key.clone(), 5, 1, 2, 1000)]);
    let behind_the_job = state
        .try_acquire(1_000, &key, 2, 1000, 1, &mut RateWrites::default())
        .unwrap();
    assert!(!behind_the_job.allowed, "the waiting job goes first");
    assert_eq!(behind_the_job.retry_at_ms, Some(1_001));
}

#[test]
fn describe_gives_a_waiters_exact_retry_time() {
    let mut state = partition();
    let key = inline_key("api");
    step(
        &mut state,
        0,
        vec![
            acquire("a", key.clone(), 5, 1, 1, 1000),
            acquire("b", key.clone(), 5, 2, 1, 1000),
            acquire("c", key.clone(), 5, 3, 1, 1000),
        ],
    );
    let described = state.describe(
        100,
        &key,
        Some(&TicketKey {
            job_id: std::sync::Arc::from("c"),
            attempt: 1,
            step: 0,
        }),
    );
    assert_eq!(described.waiting, 2);
    assert_eq!(described.ticket_position, Some(1));
    assert_eq!(described.ticket_retry_at_ms, Some(2000), "b at 1000, then c at 2000");
    assert_eq!(described.used, 1);
}
