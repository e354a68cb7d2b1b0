use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use sluice_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use super::client::{reconnect_backoff, ClientActor, ClientEvent, Connection, ConnectionState, PATH_CHANGES_BUFFER};
use super::router::{open_grants, GrantsDropped};

use super::*;

fn claims(partition: u32) -> Vec<pb::JobPartitionClaim> {
    vec![pb::JobPartitionClaim { partition, epoch: 1 }]
}

fn grants_of(message: Option<Result<pb::LinkDown, Status>>) -> Vec<Vec<u8>> {
    match message {
        Some(Ok(pb::LinkDown {
            message: Some(pb::link_down::Message::Grants(grants)),
        })) => grants.events,
        other => panic!("expected grants, got {other:?}"),
    }
}

#[tokio::test]
async fn a_stream_that_is_behind_never_holds_up_the_grants_of_another() {
    let router = GrantRouter::new(crate::faults::Faults::none());
    // Job partition 0's stream is read by no one: its buffer of one
    // message is full after the first batch.
    let (slow_down, mut slow_reader) = mpsc::channel(1);
    let slow = open_grants(slow_down);
    router.claim(router.new_stream_id(), &slow, &claims(0));
    let (fast_down, mut fast_reader) = mpsc::channel(STREAM_BUFFER);
    let fast = open_grants(fast_down);
    router.claim(router.new_stream_id(), &fast, &claims(1));

    for batch in 0..10 {
        let mut entries = LinkEntries::new();
        entries.insert((Link::Admission, 0), vec![format!("slow-{batch}").into_bytes()]);
        entries.insert((Link::Admission, 1), vec![format!("fast-{batch}").into_bytes()]);
        assert!(
            router.deliver(entries).now_or_never().is_some(),
            "batch {batch}: deliver waited for a stream that is behind"
        );
    }
    for batch in 0..10 {
        assert_eq!(
            grants_of(fast_reader.recv().await),
            vec![format!("fast-{batch}").into_bytes()]
        );
    }
    // The slow stream loses nothing: once read, every batch follows in order.
    for batch in 0..10 {
        assert_eq!(
            grants_of(slow_reader.recv().await),
            vec![format!("slow-{batch}").into_bytes()]
        );
    }
}

#[tokio::test]
async fn a_stream_too_far_behind_drops_grants_and_takes_them_again_once_it_catches_up() {
    let (down, mut reader) = mpsc::channel(1);
    down.try_send(Ok(pb::LinkDown { message: None })).unwrap();
    let grants = open_grants(down);
    let half = MAX_QUEUED_GRANT_BYTES / 2;
    // The first half waits in the queue (the stream's buffer is full);
    // a second half would pass the bound.
    assert!(grants.push(vec![vec![1; half]]).is_ok());
    assert!(matches!(
        grants.push(vec![vec![2; half]]),
        Err(GrantsDropped::Behind { .. })
    ));
    // Control messages are never dropped and keep their place.
    grants.send_control(pb::link_down::Message::Applied(pb::LinkApplied { seqs: vec![7] }));
    assert!(reader
        .recv()
        .await
        .is_some_and(|first| first.is_ok_and(|first| first.message.is_none())));
    assert_eq!(grants_of(reader.recv().await), vec![vec![1; half]]);
    assert!(matches!(
        reader.recv().await,
        Some(Ok(pb::LinkDown {
            message: Some(pb::link_down::Message::Applied(_))
        }))
    ));
    // Caught up: grants are taken again.
    assert!(grants.push(vec![vec![3; half]]).is_ok());
    assert_eq!(grants_of(reader.recv().await), vec![vec![3; half]]);
    drop(reader);
    // A closed stream says so (once its forwarder has seen it close).
    while !matches!(grants.push(vec![vec![4]]), Err(GrantsDropped::Closed)) {
        tokio::task::yield_now().await;
    }
}

/// A client actor connected to nothing, for tests of its decisions.
fn actor() -> (ClientActor, tokio::sync::broadcast::Receiver<PathChange>) {
    let (events, _receiver) = mpsc::unbounded_channel();
    let (grants, _) = mpsc::channel(1);
    let (paths, changes) = tokio::sync::broadcast::channel(PATH_CHANGES_BUFFER);
    let actor = ClientActor {
        settings: LinkClientSettings {
            service: "rate-window",
            seed_endpoint: String::new(),
            client_id: "test".to_string(),
        },
        events,
        grants,
        readiness: crate::readiness::Readiness::new(),
        seq: 0,
        unacked: BTreeMap::new(),
        unacked_count: Arc::new(AtomicU64::new(0)),
        directory: HashMap::new(),
        directory_wanted: false,
        directory_in_flight: false,
        connections: HashMap::new(),
        next_generation: 0,
        claims: Vec::new(),
        waiting_since: None,
        barriers: Vec::new(),
        paths,
        opened_before: std::collections::HashSet::new(),
        known_owners: HashMap::new(),
    };
    (actor, changes)
}

/// Open (again) the stream to `endpoint` as `run_connection` would.
fn open(actor: &mut ClientActor, endpoint: &Arc<str>) -> mpsc::Receiver<pb::LinkUp> {
    actor.next_generation += 1;
    let generation = actor.next_generation;
    let connection = actor
        .connections
        .entry(endpoint.clone())
        .or_insert_with(Connection::new);
    connection.generation = generation;
    connection.state = ConnectionState::Connecting;
    let (sender, receiver) = mpsc::channel(16);
    actor.handle(ClientEvent::Opened {
        endpoint: endpoint.clone(),
        generation,
        sender,
    });
    receiver
}

#[tokio::test]
async fn a_stream_opened_again_or_an_owner_moved_is_told_as_a_path_change() {
    let (mut actor, mut changes) = actor();
    let first: Arc<str> = Arc::from("http://rate-a:1");
    let second: Arc<str> = Arc::from("http://rate-b:1");
    let directory = |owners: &[(i32, &Arc<str>)]| {
        ClientEvent::Directory(Ok(owners
            .iter()
            .map(|(partition, owner)| (*partition, Arc::clone(owner)))
            .collect()))
    };
    // The first owners known and the first stream: nothing was sent on
    // an older path.
    actor.handle(directory(&[(0, &first), (1, &first), (2, &second)]));
    let _first_stream = open(&mut actor, &first);
    let _second_stream = open(&mut actor, &second);
    assert!(changes.try_recv().is_err(), "no change yet");
    // The stream to `first` breaks and opens again: its partitions.
    let generation = actor.connections[&first].generation;
    actor.handle(ClientEvent::Closed {
        endpoint: first.clone(),
        generation,
        error: "broken".to_string(),
    });
    let _reopened = open(&mut actor, &first);
    assert_eq!(changes.try_recv().ok().as_deref(), Some(&vec![0, 1]));
    // Partition 1 moves to `second`.
    actor.handle(directory(&[(0, &first), (1, &second), (2, &second)]));
    assert_eq!(changes.try_recv().ok().as_deref(), Some(&vec![1]));
    // A refusal naming another owner is a move too; the same owner again
    // is none.
    actor.handle(ClientEvent::Refused(pb::LinkRefused {
        seq: 1,
        partition: 2,
        owner_endpoint: first.to_string(),
        reason: "not the owner".to_string(),
    }));
    assert_eq!(changes.try_recv().ok().as_deref(), Some(&vec![2]));
    actor.handle(directory(&[(0, &first), (1, &second), (2, &first)]));
    assert!(changes.try_recv().is_err(), "nothing moved");
}

/// A stream whose buffer is full when the instance's claims change (a
/// takeover in the middle of a burst) still gets the new claims, and before
/// any command sent after them: the owner routes a job partition's grants
/// by the last claims it read, so claims lost here would send that
/// partition's grants to its last owner, or to nobody, for good.
#[tokio::test]
async fn claims_that_meet_a_full_stream_are_written_once_it_drains_and_before_later_commands() {
    let (mut actor, _changes) = actor();
    let owner: Arc<str> = Arc::from("http://limit-a:1");
    actor.handle(ClientEvent::Directory(Ok(HashMap::from([(0, owner.clone())]))));
    actor.next_generation += 1;
    let generation = actor.next_generation;
    let connection = actor.connections.entry(owner.clone()).or_insert_with(Connection::new);
    connection.generation = generation;
    connection.state = ConnectionState::Connecting;
    let (sender, mut stream) = mpsc::channel(2);
    actor.handle(ClientEvent::Opened {
        endpoint: owner.clone(),
        generation,
        sender,
    });
    let hello_of = |message: Option<pb::LinkUp>| match message {
        Some(pb::LinkUp {
            message: Some(pb::link_up::Message::Hello(hello)),
        }) => hello.job_partitions,
        other => panic!("expected the claims, got {other:?}"),
    };
    let commands_of = |message: Option<pb::LinkUp>| match message {
        Some(pb::LinkUp {
            message: Some(pb::link_up::Message::Commands(commands)),
        }) => commands.commands,
        other => panic!("expected commands, got {other:?}"),
    };
    // The stream opens with the (empty) claims; one command fills it.
    actor.handle(ClientEvent::Send {
        partition: 0,
        commands: vec![b"first".to_vec()],
    });
    // Partition 3 is taken over here while the buffer is full; the
    // takeover's re-sends follow.
    actor.handle(ClientEvent::Claims(claims(3)));
    actor.handle(ClientEvent::Send {
        partition: 0,
        commands: vec![b"after the takeover".to_vec()],
    });
    assert_eq!(hello_of(stream.recv().await), Vec::new());
    assert_eq!(commands_of(stream.recv().await), vec![b"first".to_vec()]);
    assert!(stream.try_recv().is_err(), "nothing else fitted");
    // Drained: the next tick writes the claims, then the later command.
    actor.tick();
    assert_eq!(hello_of(stream.recv().await), claims(3));
    assert_eq!(commands_of(stream.recv().await), vec![b"after the takeover".to_vec()]);
}

/// A link that keeps failing (its owner is down: `make chaos` kills every
/// instance of a service for 5 s) is tried again at least every
/// `RECONNECT_BACKOFF_MAX`, so it opens within that of the owner's restart.
/// With the old backoff (doubling to 5 s) a restarted limit-grant instance
/// waited 1.5 s for its links.
#[tokio::test(start_paused = true)]
async fn a_link_that_keeps_failing_is_tried_again_within_half_a_second() {
    let (mut actor, _changes) = actor();
    let owner: Arc<str> = Arc::from("http://limit-a:1");
    let _stream = open(&mut actor, &owner);
    let mut generation = actor.connections[&owner].generation;
    let mut waits = Vec::new();
    for _ in 0..10 {
        actor.handle(ClientEvent::Closed {
            endpoint: owner.clone(),
            generation,
            error: "connection refused".to_string(),
        });
        let ConnectionState::Idle { retry_at } = actor.connections[&owner].state else {
            panic!("closed, not idle");
        };
        waits.push(retry_at - tokio::time::Instant::now());
        // Tried again (as `tick` does once due), and the connect fails.
        actor.next_generation += 1;
        generation = actor.next_generation;
        let connection = actor.connections.get_mut(&owner).expect("known");
        connection.generation = generation;
        connection.state = ConnectionState::Connecting;
    }
    assert!(
        waits.iter().all(|wait| *wait <= Duration::from_millis(500)),
        "waits before the link is tried again: {waits:?}"
    );
    assert_eq!(reconnect_backoff(1), Duration::from_millis(200));
    assert_eq!(reconnect_backoff(30), Duration::from_millis(500));
}
