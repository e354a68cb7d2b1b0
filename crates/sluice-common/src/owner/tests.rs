use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;

use super::*;
use crate::kafka::{batch_entries, single_entry_batch, InMsg, Outbox};
use crate::readiness::Readiness;
use prost::Message as _;
use sluice_proto::v1 as pb;

fn message_of(payload: Vec<u8>) -> InMsg {
    InMsg {
        partition: 0,
        offset: 7,
        key: None,
        payload: Some(payload),
        headers: Vec::new(),
        timestamp_ms: None,
    }
}

#[test]
fn a_bad_entry_is_rejected_alone_and_the_others_are_applied() {
    let topic: Arc<str> = Arc::from("t");
    let mut outbox = Outbox::new();
    for step in 0..3 {
        let event = pb::GrantEvent {
            ticket: Some(pb::TicketId {
                job_id: format!("job-{step}"),
                attempt: 1,
                step,
            }),
            ..Default::default()
        };
        outbox.push_entry(&topic, 0, &event, 100_000);
    }
    let mut payload = outbox.into_messages().remove(0).payload;
    // A fourth entry that is not a GrantEvent (field 2 with wire type 7).
    payload.extend_from_slice(&single_entry_batch(&[0x17, 0x01]));
    let mut applied = Vec::new();
    let mut rejected = Vec::new();
    apply_entries(
        &message_of(payload),
        "grant event",
        &mut rejected,
        |event: pb::GrantEvent| {
            let ticket = event.ticket.unwrap_or_default();
            if ticket.step == 1 {
                return Err("step 1 is refused".to_string());
            }
            applied.push(ticket.job_id);
            Ok(())
        },
    );
    assert_eq!(applied, vec!["job-0", "job-2"]);
    assert_eq!(rejected.len(), 2);
    assert_eq!(rejected[0].reason, "step 1 is refused");
    let refused = pb::GrantEvent::decode(rejected[0].entry.as_slice()).unwrap();
    assert_eq!(refused.ticket.unwrap().job_id, "job-1");
    assert!(
        rejected[1].reason.starts_with("undecodable grant event"),
        "{rejected:?}"
    );
    assert!(rejected.iter().all(|entry| entry.offset == 7));
}

#[test]
fn a_payload_that_is_not_a_batch_is_rejected_whole() {
    let mut rejected = Vec::new();
    apply_entries(
        &message_of(vec![0xff, 0xff, 0xff]),
        "limit command",
        &mut rejected,
        |_: pb::LimitCommand| Ok(()),
    );
    assert_eq!(rejected.len(), 1);
    assert_eq!(rejected[0].entry, vec![0xff, 0xff, 0xff]);
    assert!(rejected[0].reason.starts_with("undecodable limit command batch"));
}

#[test]
fn batch_entries_split_and_rejoin() {
    let entries: Vec<Vec<u8>> = vec![vec![1, 2, 3], vec![], vec![9; 300]];
    let mut payload = Vec::new();
    for entry in &entries {
        payload.extend(single_entry_batch(entry));
    }
    let split = batch_entries(&payload).unwrap();
    assert_eq!(split, entries.iter().map(Vec::as_slice).collect::<Vec<_>>());
    assert!(batch_entries(&[0x0a, 0x05, 1]).is_err(), "a length past the end");
}

#[tokio::test]
async fn a_call_to_a_partition_loading_here_waits_for_its_task() {
    let registry: Arc<OwnerRegistry<tokio::sync::oneshot::Sender<u32>>> = OwnerRegistry::new("test", Readiness::new());
    let loading = registry.begin_loading(3);
    let caller = tokio::spawn({
        let registry = registry.clone();
        async move { registry.call(3, |reply| reply).await }
    });
    // The call is parked on the loading partition, not answered NOT_OWNER.
    tokio::task::yield_now().await;
    assert!(!caller.is_finished(), "answered before the partition loaded");
    let (sender, mut receiver) = mpsc::channel(1);
    registry.register(3, 1, sender);
    drop(loading);
    let reply = receiver.recv().await.unwrap().local;
    reply.send(42).unwrap();
    assert_eq!(caller.await.unwrap().unwrap(), 42);
}

#[tokio::test]
async fn a_partition_that_stops_loading_without_starting_is_not_owned() {
    let registry: Arc<OwnerRegistry<tokio::sync::oneshot::Sender<u32>>> = OwnerRegistry::new("test", Readiness::new());
    let loading = registry.begin_loading(5);
    let caller = tokio::spawn({
        let registry = registry.clone();
        async move { registry.call(5, |reply| reply).await }
    });
    tokio::task::yield_now().await;
    drop(loading);
    assert!(matches!(caller.await.unwrap(), Err(LocalCallError::NotOwner(5))));
    assert!(matches!(
        registry.call(6, |reply| reply).await,
        Err(LocalCallError::NotOwner(6))
    ));
}

enum TestLocal {
    Work(u32),
    Barrier(tokio::sync::oneshot::Sender<()>),
}

impl BarrierLocal for TestLocal {
    fn barrier(reply: tokio::sync::oneshot::Sender<()>) -> Self {
        TestLocal::Barrier(reply)
    }
}

#[tokio::test]
async fn a_barrier_follows_what_was_queued_before_it_on_every_owned_partition() {
    let registry: Arc<OwnerRegistry<TestLocal>> = OwnerRegistry::new("test", Readiness::new());
    let (first, mut first_queue) = mpsc::channel(8);
    let (second, mut second_queue) = mpsc::channel(8);
    registry.register(1, 1, first);
    registry.register(2, 1, second);
    registry.submit(1, TestLocal::Work(7)).await.unwrap();
    let barrier = tokio::spawn({
        let registry = registry.clone();
        async move { registry.barrier_all().await }
    });
    // Partition 1 takes its work first, then the barrier.
    assert!(matches!(
        first_queue.recv().await.map(|received| received.local),
        Some(TestLocal::Work(7))
    ));
    let Some(TestLocal::Barrier(first_reply)) = first_queue.recv().await.map(|received| received.local) else {
        panic!("partition 1 got no barrier");
    };
    tokio::task::yield_now().await;
    assert!(!barrier.is_finished(), "passed before partition 1 answered");
    first_reply.send(()).unwrap();
    let Some(TestLocal::Barrier(second_reply)) = second_queue.recv().await.map(|received| received.local) else {
        panic!("partition 2 got no barrier");
    };
    tokio::task::yield_now().await;
    assert!(!barrier.is_finished(), "passed before partition 2 answered");
    second_reply.send(()).unwrap();
    barrier.await.unwrap().unwrap();
    // A partition that stops without answering is an error to retry.
    let blocked = tokio::spawn({
        let registry = registry.clone();
        async move { registry.barrier_all().await }
    });
    drop(first_queue.recv().await);
    assert!(matches!(blocked.await.unwrap(), Err(LocalCallError::Interrupted(1))));
}

/// A request counts as received from the moment it is handed to the
/// registry, waiting for a loading partition or for room in its queue
/// included, until its partition task takes it: a lease that ran out after
/// a worker's completion arrived must not end while the completion waits
/// anywhere in the instance (a million-job backlog ran 5 jobs twice when
/// only the queue was counted).
#[tokio::test(start_paused = true)]
async fn a_request_counts_as_received_from_its_call_until_its_partition_takes_it() {
    let registry: Arc<OwnerRegistry<TestLocal>> = OwnerRegistry::new("test", Readiness::new());
    assert_eq!(
        registry.received_through(4),
        tokio::time::Instant::now(),
        "nothing waits"
    );
    let loading = registry.begin_loading(4);
    let received_at = tokio::time::Instant::now();
    let submitted = tokio::spawn({
        let registry = registry.clone();
        async move { registry.submit(4, TestLocal::Work(1)).await }
    });
    tokio::task::yield_now().await;
    tokio::time::advance(Duration::from_millis(500)).await;
    let before_it = received_at - Duration::from_millis(1);
    assert_eq!(
        registry.received_through(4),
        before_it,
        "waiting for the partition to load"
    );
    assert_eq!(
        registry.received_through(5),
        tokio::time::Instant::now(),
        "another partition's"
    );
    // Loaded: the request waits in the partition's queue, still not taken.
    let (sender, mut queue) = mpsc::channel(8);
    registry.register(4, 1, sender);
    drop(loading);
    submitted.await.unwrap().unwrap();
    tokio::time::advance(Duration::from_millis(500)).await;
    assert_eq!(registry.received_through(4), before_it, "in the queue");
    // Taken for a batch: everything received until now is in.
    let taken = queue.recv().await.unwrap().local;
    assert!(matches!(taken, TestLocal::Work(1)));
    assert_eq!(registry.received_through(4), tokio::time::Instant::now());
}
