//! Links: the hot path's gRPC streams between admission and the owners of
//! keys (docs/hot-path.md, `proto/sluice/v1/link.proto`).
//!
//! - Owner side (limit-grant, rate-window): `LinkService` takes commands from
//!   a stream into the partition tasks and answers `LinkApplied` once they
//!   are committed; `GrantRouter` writes committed grants to the stream that
//!   claimed the job's partition.
//! - Admission side: `LinkClient` keeps one stream to every instance that
//!   owns partitions of a service, found through the service's directory,
//!   and keeps every command until its partition's owner has applied it,
//!   sending it again on the next stream when a stream breaks or the owner
//!   changes. Commands are idempotent by identity, so a second copy is
//!   harmless; none is ever dropped.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use sluice_proto::v1 as pb;
use sluice_proto::v1::owner_link_client::OwnerLinkClient;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::owner::OwnerRegistry;
use crate::shutdown::Shutdown;

/// Which stream an outbox entry travels on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Link {
    /// Limit commands up to limit-grant; the partition is the key's.
    LimitGrant,
    /// Rate commands up to rate-window; the partition is the rate key's.
    RateWindow,
    /// Grant events down to admission; the partition is the job's.
    Admission,
}

/// Encoded entries by (link, partition).
pub type LinkEntries = BTreeMap<(Link, i32), Vec<Vec<u8>>>;

/// What a link client hands on to its instance, in the order the streams
/// delivered it.
#[derive(Debug)]
pub enum Downlink {
    /// Encoded `GrantEvent`s: one stream message.
    Grants(Vec<Vec<u8>>),
    /// A barrier (`LinkClient::barrier`): answered by whoever takes the
    /// grants once every grant before it is handed on.
    Barrier(oneshot::Sender<()>),
}

/// Where a committed batch's link entries go.
pub trait LinkSink: Send + Sync + 'static {
    /// Hand `entries` to their streams. Never waits on one stream: each
    /// stream queues what it has not written yet (up to a bound, beyond
    /// which it drops: every link entry can be rebuilt from state), so a
    /// slow admission instance never holds up the grants of another.
    fn deliver(&self, entries: LinkEntries) -> BoxFuture<'_, ()>;
}

/// Messages buffered per stream, each way.
const STREAM_BUFFER: usize = 4096;
/// Grant bytes one stream may queue beyond its buffer before grants for it
/// are dropped (admission re-sends the acquires; the grants follow).
const MAX_QUEUED_GRANT_BYTES: usize = 64 << 20;
/// The most command bytes in one stream message.
const MAX_MESSAGE_BYTES: usize = 1 << 20;

// ---------------------------------------------------------------------------
// Owner side

type DownSender = mpsc::Sender<Result<pb::LinkDown, Status>>;

/// The grants waiting for one stream. `deliver` only queues (never
/// waits); the stream's own forwarder task writes them to the stream in
/// order, at the pace its reader takes them.
#[derive(Clone)]
struct StreamGrants {
    queue: mpsc::UnboundedSender<(pb::LinkDown, usize)>,
    queued_bytes: Arc<AtomicUsize>,
    /// The stream itself, to end it (fault hook).
    down: DownSender,
}

impl StreamGrants {
    /// Queue `events` for the stream, or say they were dropped: the stream
    /// is closed, or so far behind that it holds `MAX_QUEUED_GRANT_BYTES`.
    fn push(&self, events: Vec<Vec<u8>>) -> Result<(), GrantsDropped> {
        let bytes = events.iter().map(|event| event.len() + 8).sum::<usize>();
        let queued = self.queued_bytes.fetch_add(bytes, Ordering::AcqRel);
        if queued + bytes > MAX_QUEUED_GRANT_BYTES {
            self.queued_bytes.fetch_sub(bytes, Ordering::AcqRel);
            return Err(GrantsDropped::Behind { queued });
        }
        let message = pb::LinkDown {
            message: Some(pb::link_down::Message::Grants(pb::LinkGrants { events })),
        };
        self.queue.send((message, bytes)).map_err(|_closed| {
            self.queued_bytes.fetch_sub(bytes, Ordering::AcqRel);
            GrantsDropped::Closed
        })
    }
}

impl StreamGrants {
    /// Queue a message that is not grants (`LinkApplied`, `LinkRefused`)
    /// behind the grants queued before it. Small and never dropped while
    /// the stream is open.
    fn send_control(&self, message: pb::link_down::Message) {
        let _ = self.queue.send((pb::LinkDown { message: Some(message) }, 0));
    }
}

enum GrantsDropped {
    Closed,
    Behind { queued: usize },
}

/// Open the grant queue of a stream writing to `down`: a forwarder task
/// moves queued grants to the stream until either end closes.
fn open_grants(down: DownSender) -> StreamGrants {
    let (queue, mut queued) = mpsc::unbounded_channel::<(pb::LinkDown, usize)>();
    let queued_bytes = Arc::new(AtomicUsize::new(0));
    let grants = StreamGrants {
        queue,
        queued_bytes: queued_bytes.clone(),
        down: down.clone(),
    };
    tokio::spawn(async move {
        while let Some((message, bytes)) = queued.recv().await {
            let sent = down.send(Ok(message)).await;
            queued_bytes.fetch_sub(bytes, Ordering::AcqRel);
            if sent.is_err() {
                break;
            }
        }
    });
    grants
}

struct Route {
    epoch: i64,
    stream: u64,
    grants: StreamGrants,
}

/// Which stream takes the grants of each job partition; and the watchers
/// of every grant sent (`WatchGrants`).
pub struct GrantRouter {
    routes: Mutex<HashMap<i32, Route>>,
    next_stream: AtomicU64,
    watchers: tokio::sync::broadcast::Sender<Arc<Vec<Vec<u8>>>>,
    faults: crate::faults::Faults,
}

/// Grant batches a watcher may fall behind by before it misses some.
const WATCH_BUFFER: usize = 1024;

impl GrantRouter {
    pub fn new(faults: crate::faults::Faults) -> Arc<Self> {
        let (watchers, _) = tokio::sync::broadcast::channel(WATCH_BUFFER);
        Arc::new(GrantRouter {
            routes: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(0),
            watchers,
            faults,
        })
    }

    fn new_stream_id(&self) -> u64 {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    /// `stream` takes the grants of `claims` (a higher epoch wins; at equal
    /// epochs the later claim) and no longer those it stopped claiming.
    /// Returns the job partitions whose grants now go to `stream` and did
    /// not before.
    fn claim(&self, stream: u64, grants: &StreamGrants, claims: &[pb::JobPartitionClaim]) -> Vec<i32> {
        let mut newly_routed = Vec::new();
        let mut routes = self.routes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let claimed: std::collections::HashSet<i32> = claims
            .iter()
            .filter_map(|claim| i32::try_from(claim.partition).ok())
            .collect();
        routes.retain(|partition, route| route.stream != stream || claimed.contains(partition));
        for claim in claims {
            let Ok(partition) = i32::try_from(claim.partition) else {
                continue;
            };
            let replace = routes.get(&partition).is_none_or(|route| claim.epoch >= route.epoch);
            if replace {
                if routes.get(&partition).is_none_or(|route| route.stream != stream) {
                    newly_routed.push(partition);
                }
                routes.insert(
                    partition,
                    Route {
                        epoch: claim.epoch,
                        stream,
                        grants: grants.clone(),
                    },
                );
            }
        }
        newly_routed
    }

    fn forget(&self, stream: u64) {
        let mut routes = self.routes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        routes.retain(|_, route| route.stream != stream);
    }

    /// End the stream that takes `partition`'s grants, as a broken
    /// connection would (fault hook): the client sees an error and connects
    /// again, and nothing is routed to the stream meanwhile.
    fn break_stream_of(&self, partition: i32) {
        let broken = {
            let routes = self.routes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            routes
                .get(&partition)
                .map(|route| (route.stream, route.grants.down.clone()))
        };
        if let Some((stream, down)) = broken {
            self.forget(stream);
            let _ = down.try_send(Err(Status::unavailable("fault hook: the link broke")));
        }
    }

    fn grants_for(&self, partition: i32) -> Option<StreamGrants> {
        let routes = self.routes.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        routes.get(&partition).map(|route| route.grants.clone())
    }

    /// Whether some stream takes the grants of `partition` (tests, readiness).
    pub fn is_routed(&self, partition: i32) -> bool {
        self.grants_for(partition).is_some()
    }
}

impl LinkSink for GrantRouter {
    fn deliver(&self, entries: LinkEntries) -> BoxFuture<'_, ()> {
        async move {
            for ((link, partition), events) in entries {
                if link != Link::Admission {
                    tracing::error!(?link, partition, "an owner tried to send commands up a link; dropped");
                    continue;
                }
                if self.watchers.receiver_count() > 0 {
                    let _ = self.watchers.send(Arc::new(events.clone()));
                }
                if self.faults.hit(crate::faults::FaultPoint::LinkBrokenBeforeGrants) {
                    tracing::warn!(partition, grants = events.len(), "fault hook: the link breaks before these committed grants are written");
                    self.break_stream_of(partition);
                    continue;
                }
                let Some(grants) = self.grants_for(partition) else {
                    // Admission re-sends the acquire when it connects and
                    // after a wait; the grant is sent again then.
                    tracing::debug!(partition, grants = events.len(), "no stream takes this job partition's grants yet");
                    crate::metrics::metrics().link_grants_unrouted.add(
                        u64::try_from(events.len()).unwrap_or(u64::MAX),
                        &[],
                    );
                    continue;
                };
                for events in chunked(events) {
                    let count = events.len();
                    match grants.push(events) {
                        Ok(()) => {}
                        Err(GrantsDropped::Closed) => {
                            tracing::debug!(partition, "the stream of this job partition closed; grants dropped");
                            break;
                        }
                        Err(GrantsDropped::Behind { queued }) => {
                            tracing::warn!(
                                partition,
                                grants = count,
                                queued_bytes = queued,
                                "the stream of this job partition is too far behind; grants dropped (admission re-sends its acquires)"
                            );
                            crate::metrics::metrics()
                                .link_grants_unrouted
                                .add(u64::try_from(count).unwrap_or(u64::MAX), &[]);
                        }
                    }
                }
            }
        }
        .boxed()
    }
}

/// `entries` in groups of at most `MAX_MESSAGE_BYTES` (one stream message each).
fn chunked(entries: Vec<Vec<u8>>) -> Vec<Vec<Vec<u8>>> {
    let mut chunks: Vec<Vec<Vec<u8>>> = Vec::new();
    let mut chunk_bytes = 0;
    for entry in entries {
        let starts_new = chunks
            .last()
            .is_none_or(|chunk| !chunk.is_empty() && chunk_bytes + entry.len() > MAX_MESSAGE_BYTES);
        if starts_new {
            chunks.push(Vec::new());
            chunk_bytes = 0;
        }
        chunk_bytes += entry.len() + 8;
        if let Some(chunk) = chunks.last_mut() {
            chunk.push(entry);
        }
    }
    chunks
}

/// What a link hands a partition task.
pub enum LinkInput {
    /// Commands, with what to call once the batch holding them is committed.
    Commands(LinkBatch),
    /// A stream now takes the grants of these job partitions: send again
    /// the grants of every ticket held for their jobs (one committed while
    /// no stream took them was dropped).
    ResendGrants { job_partitions: Vec<i32> },
}

/// Commands from a link for one partition task, with what to call once
/// the batch holding them is committed.
pub struct LinkBatch {
    pub commands: Vec<Vec<u8>>,
    /// The admission instance that sent them (quarantine reasons, logs).
    pub client: Arc<str>,
    pub applied: oneshot::Sender<()>,
}

/// `OwnerLink` for one owner service: commands into its partition tasks
/// (`make_local` wraps them in the service's local request), grants out
/// through `router`, and the service's owner directory.
pub struct LinkService<L> {
    pub service: &'static str,
    pub registry: Arc<OwnerRegistry<L>>,
    pub router: Arc<GrantRouter>,
    pub pool: sqlx::PgPool,
    pub make_local: fn(LinkInput) -> L,
    pub shutdown: Shutdown,
}

/// `OwnerLink` is the services' own API: only a caller with the internal
/// token (or any caller, with auth off) may use it.
fn services_only<T>(request: &Request<T>) -> Result<(), Status> {
    if crate::auth::principal_of(request).service {
        return Ok(());
    }
    Err(Status::permission_denied(
        "OwnerLink is the Sluice services' own API (callers authenticate with auth.internal_token_file)",
    ))
}

#[tonic::async_trait]
impl<L: Send + 'static> pb::owner_link_server::OwnerLink for LinkService<L> {
    type LinkStream = ReceiverStream<Result<pb::LinkDown, Status>>;

    async fn link(&self, request: Request<Streaming<pb::LinkUp>>) -> Result<Response<Self::LinkStream>, Status> {
        services_only(&request)?;
        let mut inbound = request.into_inner();
        let (down, down_receiver) = mpsc::channel(STREAM_BUFFER);
        let stream = self.router.new_stream_id();
        let grants = open_grants(down);
        let reader = LinkReader {
            service: self.service,
            registry: self.registry.clone(),
            router: self.router.clone(),
            pool: self.pool.clone(),
            make_local: self.make_local,
            stream,
            grants,
            client: Arc::from("unknown"),
        };
        let shutdown = self.shutdown.clone();
        tokio::spawn(async move {
            let mut reader = reader;
            loop {
                let message = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    message = inbound.message() => message,
                };
                match message {
                    Ok(Some(message)) => reader.handle(message).await,
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(service = reader.service, client = %reader.client, %status, "link closed by an error");
                        break;
                    }
                }
            }
            reader.router.forget(reader.stream);
            tracing::debug!(service = reader.service, client = %reader.client, "link closed");
        });
        Ok(Response::new(ReceiverStream::new(down_receiver)))
    }

    type WatchGrantsStream = futures::stream::BoxStream<'static, Result<pb::LinkGrants, Status>>;

    async fn watch_grants(
        &self,
        request: Request<pb::WatchGrantsRequest>,
    ) -> Result<Response<Self::WatchGrantsStream>, Status> {
        services_only(&request)?;
        use futures::StreamExt as _;
        let watched = tokio_stream::wrappers::BroadcastStream::new(self.router.watchers.subscribe());
        let service = self.service;
        let shutdown = self.shutdown.clone();
        let stream = watched
            .filter_map(move |received| async move {
                match received {
                    Ok(events) => Some(Ok(pb::LinkGrants {
                        events: events.as_ref().clone(),
                    })),
                    Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(missed)) => {
                        tracing::warn!(service, missed, "a grant watcher fell behind and missed grant batches");
                        None
                    }
                }
            })
            .take_until(async move { shutdown.cancelled().await })
            .boxed();
        Ok(Response::new(stream))
    }

    async fn directory(
        &self,
        request: Request<pb::DirectoryRequest>,
    ) -> Result<Response<pb::DirectoryResponse>, Status> {
        services_only(&request)?;
        let rows: Vec<(i32, String, i64)> = sqlx::query_as("SELECT partition, endpoint, epoch FROM owners")
            .fetch_all(&self.pool)
            .await
            .map_err(|error| Status::unavailable(format!("owner directory unavailable: {error}")))?;
        Ok(Response::new(pb::DirectoryResponse {
            partitions: rows
                .into_iter()
                .filter_map(|(partition, endpoint, epoch)| {
                    Some(pb::DirectoryEntry {
                        partition: u32::try_from(partition).ok()?,
                        endpoint,
                        epoch,
                    })
                })
                .collect(),
        }))
    }
}

struct LinkReader<L> {
    service: &'static str,
    registry: Arc<OwnerRegistry<L>>,
    router: Arc<GrantRouter>,
    pool: sqlx::PgPool,
    make_local: fn(LinkInput) -> L,
    stream: u64,
    /// Everything written down the stream goes through its queue, in order.
    grants: StreamGrants,
    client: Arc<str>,
}

impl<L: Send + 'static> LinkReader<L> {
    async fn handle(&mut self, message: pb::LinkUp) {
        match message.message {
            Some(pb::link_up::Message::Hello(hello)) => {
                self.client = Arc::from(crate::fault::clean_text(&hello.client_id, 200).as_str());
                let newly_routed = self.router.claim(self.stream, &self.grants, &hello.job_partitions);
                tracing::debug!(service = self.service, client = %self.client, partitions = hello.job_partitions.len(), newly_routed = newly_routed.len(), "link claims job partitions");
                if !newly_routed.is_empty() {
                    for partition in self.registry.owned() {
                        let input = LinkInput::ResendGrants {
                            job_partitions: newly_routed.clone(),
                        };
                        let _ = self.registry.submit(partition, (self.make_local)(input)).await;
                    }
                }
            }
            Some(pb::link_up::Message::Commands(commands)) => self.submit(commands).await,
            None => {}
        }
    }

    /// Hand the commands to the partition task without waiting for the
    /// commit (the next message is read at once); `LinkApplied` follows it.
    async fn submit(&self, commands: pb::LinkCommands) {
        let seq = commands.seq;
        let partition_number = commands.partition;
        let Ok(partition) = i32::try_from(commands.partition) else {
            self.refuse(seq, commands.partition, "partition out of range".to_string())
                .await;
            return;
        };
        let (applied, applied_receiver) = oneshot::channel();
        let batch = LinkBatch {
            commands: commands.commands,
            client: self.client.clone(),
            applied,
        };
        let make_local = self.make_local;
        let submitted = if self
            .router
            .faults
            .hit(crate::faults::FaultPoint::LinkCommandsDroppedBeforeCommit)
        {
            tracing::warn!(
                partition,
                seq,
                "fault hook: the partition stops before these commands are committed"
            );
            drop(batch);
            Ok(())
        } else {
            self.registry
                .submit(partition, make_local(LinkInput::Commands(batch)))
                .await
        };
        match submitted {
            Ok(()) => {
                let grants = self.grants.clone();
                tokio::spawn(async move {
                    let message = if applied_receiver.await.is_ok() {
                        pb::link_down::Message::Applied(pb::LinkApplied { seqs: vec![seq] })
                    } else {
                        // Dropped unanswered: the partition stopped before
                        // the commit (released, revoked). Refused, owner
                        // unknown: the client reads the directory again
                        // and sends them to the new owner at once (they
                        // would wait on this open stream for ever).
                        pb::link_down::Message::Refused(pb::LinkRefused {
                            seq,
                            partition: partition_number,
                            owner_endpoint: String::new(),
                            reason: "the partition stopped before the commands were committed".to_string(),
                        })
                    };
                    grants.send_control(message);
                });
            }
            Err(_not_owner) => {
                self.refuse(seq, commands.partition, "not the owner of this partition".to_string())
                    .await;
            }
        }
    }

    async fn refuse(&self, seq: u64, partition: u32, reason: String) {
        let owner = match i32::try_from(partition) {
            Ok(partition) => crate::owner::lookup_owner(&self.pool, partition)
                .await
                .ok()
                .flatten()
                .map(|(endpoint, _)| endpoint)
                .unwrap_or_default(),
            Err(_) => String::new(),
        };
        tracing::debug!(service = self.service, partition, %owner, %reason, "refusing link commands");
        self.grants
            .send_control(pb::link_down::Message::Refused(pb::LinkRefused {
                seq,
                partition,
                owner_endpoint: owner,
                reason,
            }));
    }
}

// ---------------------------------------------------------------------------
// Admission side

/// Settings of one `LinkClient`.
#[derive(Clone, Debug)]
pub struct LinkClientSettings {
    /// The service at the other end (logs, readiness).
    pub service: &'static str,
    /// Any instance of the service (its Kubernetes Service), asked for the
    /// directory.
    pub seed_endpoint: String,
    /// This admission instance (the owners' logs).
    pub client_id: String,
}

/// Sends a service's commands to its partitions' owners over links.
#[derive(Clone)]
pub struct LinkClient {
    events: mpsc::UnboundedSender<ClientEvent>,
    unacked: Arc<AtomicU64>,
    paths: tokio::sync::broadcast::Sender<PathChange>,
}

/// The owner partitions (of the client's service) whose path changed: a
/// stream to their owner opened again after a break, or the directory
/// names another owner for them (`LinkClient::path_changes`).
pub type PathChange = Arc<Vec<i32>>;

/// Path changes a subscriber may fall behind by before it misses some (it
/// is told: `RecvError::Lagged`).
const PATH_CHANGES_BUFFER: usize = 64;

enum ClientEvent {
    Send {
        partition: i32,
        commands: Vec<Vec<u8>>,
    },
    Claims(Vec<pb::JobPartitionClaim>),
    Opened {
        endpoint: Arc<str>,
        generation: u64,
        sender: mpsc::Sender<pb::LinkUp>,
    },
    Closed {
        endpoint: Arc<str>,
        generation: u64,
        error: String,
    },
    Applied(Vec<u64>),
    Refused(pb::LinkRefused),
    Directory(Result<HashMap<i32, Arc<str>>, String>),
    Barrier(oneshot::Sender<()>),
}

impl LinkClient {
    /// Start the client; grants that arrive are sent to `grants` (encoded
    /// `GrantEvent`s, one batch per message). Runs until `shutdown`.
    pub fn start(
        settings: LinkClientSettings,
        grants: mpsc::Sender<Downlink>,
        readiness: crate::readiness::Readiness,
        shutdown: Shutdown,
    ) -> LinkClient {
        let (events, receiver) = mpsc::unbounded_channel();
        let unacked = Arc::new(AtomicU64::new(0));
        let (paths, _) = tokio::sync::broadcast::channel(PATH_CHANGES_BUFFER);
        let actor = ClientActor {
            paths: paths.clone(),
            opened_before: std::collections::HashSet::new(),
            known_owners: HashMap::new(),
            settings,
            events: events.clone(),
            grants,
            readiness,
            seq: 0,
            unacked: BTreeMap::new(),
            unacked_count: unacked.clone(),
            directory: HashMap::new(),
            directory_wanted: true,
            directory_in_flight: false,
            connections: HashMap::new(),
            next_generation: 0,
            claims: Vec::new(),
            waiting_since: None,
            barriers: Vec::new(),
        };
        tokio::spawn(actor.run(receiver, shutdown));
        LinkClient { events, unacked, paths }
    }

    /// A client connected to nothing: what it is given is dropped. For
    /// code that decides without sending (tests of the decisions).
    pub fn detached() -> LinkClient {
        let (events, _receiver) = mpsc::unbounded_channel();
        LinkClient {
            events,
            unacked: Arc::new(AtomicU64::new(0)),
            paths: tokio::sync::broadcast::channel(1).0,
        }
    }

    /// The owner partitions whose path changes from now on. The client
    /// itself sends again what its owners have not applied; a subscriber
    /// re-sends what it still waits for there (an applied command whose
    /// answer was lost on the old path).
    pub fn path_changes(&self) -> tokio::sync::broadcast::Receiver<PathChange> {
        self.paths.subscribe()
    }

    /// Send `commands` (encoded) to the owner of `partition`; kept until the
    /// owner applies them.
    pub fn send(&self, partition: i32, commands: Vec<Vec<u8>>) {
        // At most about 1 MiB per stream message (gRPC limits a message to 4 MiB).
        for commands in chunked(commands) {
            let _ = self.events.send(ClientEvent::Send { partition, commands });
        }
    }

    /// The job partitions whose grants this instance takes (sent to every
    /// owner).
    pub fn claim_job_partitions(&self, claims: Vec<pb::JobPartitionClaim>) {
        let _ = self.events.send(ClientEvent::Claims(claims));
    }

    /// Commands sent and not yet applied (tests, metrics).
    pub fn unacked(&self) -> u64 {
        self.unacked.load(Ordering::Relaxed)
    }

    /// Wait until every command given to `send` before this call is applied
    /// by its owner (committed), then until every grant the streams
    /// delivered before those `LinkApplied`s is handed on: the barrier goes
    /// to the grants' channel behind them (`Downlink::Barrier`), and returns
    /// once the taker answers it. An owner queues a batch's grants before
    /// its `LinkApplied` on the same stream, so the grants of those commands
    /// that come to this instance are among them. Tests wait on it instead
    /// of sleeping. `Err`: the client or the taker stopped.
    pub async fn barrier(&self) -> Result<(), LinkBarrierError> {
        let (reply, answered) = oneshot::channel();
        self.events
            .send(ClientEvent::Barrier(reply))
            .map_err(|_| LinkBarrierError)?;
        answered.await.map_err(|_| LinkBarrierError)
    }
}

/// The link client, or whoever takes its grants, stopped before a barrier
/// was answered.
#[derive(Debug, thiserror::Error)]
#[error("the link client stopped before the barrier was answered")]
pub struct LinkBarrierError;

struct Pending {
    partition: i32,
    commands: Arc<Vec<Vec<u8>>>,
    /// The stream it was last written to (endpoint, generation).
    sent_on: Option<(Arc<str>, u64)>,
}

/// One stream to one owner instance.
struct Connection {
    /// The current (or last) attempt; events of older attempts are ignored.
    generation: u64,
    state: ConnectionState,
    failures: u32,
}

enum ConnectionState {
    /// Not connected; try again at this time.
    Idle {
        retry_at: tokio::time::Instant,
    },
    Connecting,
    Open(mpsc::Sender<pb::LinkUp>),
}

impl Connection {
    fn new() -> Self {
        Connection {
            generation: 0,
            state: ConnectionState::Idle {
                retry_at: tokio::time::Instant::now(),
            },
            failures: 0,
        }
    }

    fn sender(&self) -> Option<&mpsc::Sender<pb::LinkUp>> {
        match &self.state {
            ConnectionState::Open(sender) => Some(sender),
            _ => None,
        }
    }
}

struct ClientActor {
    settings: LinkClientSettings,
    events: mpsc::UnboundedSender<ClientEvent>,
    grants: mpsc::Sender<Downlink>,
    readiness: crate::readiness::Readiness,
    seq: u64,
    unacked: BTreeMap<u64, Pending>,
    unacked_count: Arc<AtomicU64>,
    directory: HashMap<i32, Arc<str>>,
    directory_wanted: bool,
    directory_in_flight: bool,
    connections: HashMap<Arc<str>, Connection>,
    next_generation: u64,
    claims: Vec<pb::JobPartitionClaim>,
    /// Since when some command has had no stream to go on.
    waiting_since: Option<tokio::time::Instant>,
    /// Where path changes are told.
    paths: tokio::sync::broadcast::Sender<PathChange>,
    /// Endpoints a stream was ever open to: one opening again is a new path.
    opened_before: std::collections::HashSet<Arc<str>>,
    /// The last owner known of each partition (kept when `directory`
    /// forgets one), to tell an owner change.
    known_owners: HashMap<i32, Arc<str>>,
    /// Barriers waiting for the commands up to their seq to be applied.
    barriers: Vec<(u64, oneshot::Sender<()>)>,
}

/// How long commands may wait for a stream before the instance says it is
/// not ready.
const WAITING_BEFORE_NOT_READY: Duration = Duration::from_secs(2);

/// How often the client looks at its streams and the directory.
const CLIENT_TICK: Duration = Duration::from_millis(250);
/// How often the directory is read even when nothing seems wrong.
const DIRECTORY_EVERY: Duration = Duration::from_secs(10);

impl ClientActor {
    async fn run(mut self, mut receiver: mpsc::UnboundedReceiver<ClientEvent>, shutdown: Shutdown) {
        let mut tick = tokio::time::interval(CLIENT_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut directory_at = tokio::time::Instant::now();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                event = receiver.recv() => match event {
                    Some(event) => self.handle(event),
                    None => return,
                },
                _ = tick.tick() => {
                    if directory_at.elapsed() >= DIRECTORY_EVERY {
                        directory_at = tokio::time::Instant::now();
                        self.directory_wanted = true;
                    }
                    self.tick();
                }
            }
            self.unacked_count
                .store(u64::try_from(self.unacked.len()).unwrap_or(u64::MAX), Ordering::Relaxed);
            self.pass_barriers();
        }
    }

    /// Send on the barriers whose commands are all applied: behind the
    /// grants already handed to the grants' channel (the streams hand a
    /// batch's grants on before its `LinkApplied` reaches this actor).
    fn pass_barriers(&mut self) {
        if self.barriers.is_empty() {
            return;
        }
        let oldest_unacked = self.unacked.keys().next().copied().unwrap_or(u64::MAX);
        let (passed, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.barriers)
            .into_iter()
            .partition(|(upto, _)| *upto < oldest_unacked);
        self.barriers = waiting;
        for (_, reply) in passed {
            let grants = self.grants.clone();
            tokio::spawn(async move {
                let _ = grants.send(Downlink::Barrier(reply)).await;
            });
        }
    }

    fn handle(&mut self, event: ClientEvent) {
        match event {
            ClientEvent::Send { partition, commands } => {
                self.seq += 1;
                let seq = self.seq;
                self.unacked.insert(
                    seq,
                    Pending {
                        partition,
                        commands: Arc::new(commands),
                        sent_on: None,
                    },
                );
                self.route(seq);
            }
            ClientEvent::Claims(claims) => {
                self.claims = claims;
                let hello = self.hello();
                for connection in self.connections.values() {
                    if let Some(sender) = connection.sender() {
                        let _ = sender.try_send(hello.clone());
                    }
                }
            }
            ClientEvent::Opened {
                endpoint,
                generation,
                sender,
            } => self.opened(endpoint, generation, sender),
            ClientEvent::Closed {
                endpoint,
                generation,
                error,
            } => self.closed(&endpoint, generation, &error),
            ClientEvent::Applied(seqs) => {
                for seq in seqs {
                    self.unacked.remove(&seq);
                }
            }
            ClientEvent::Refused(refused) => {
                let partition = i32::try_from(refused.partition).unwrap_or(-1);
                tracing::debug!(service = self.settings.service, partition, owner = %refused.owner_endpoint, reason = %refused.reason, "link commands refused; sending them to the owner");
                // An owner naming itself (its row not replaced yet) is no
                // answer: read the directory again rather than loop.
                let names_itself = self.unacked.get(&refused.seq).is_some_and(|pending| {
                    pending
                        .sent_on
                        .as_ref()
                        .is_some_and(|(sent_to, _)| **sent_to == *refused.owner_endpoint)
                });
                if refused.owner_endpoint.is_empty() || names_itself {
                    self.directory.remove(&partition);
                    self.directory_wanted = true;
                } else {
                    let owner: Arc<str> = Arc::from(refused.owner_endpoint.as_str());
                    self.directory.insert(partition, owner.clone());
                    self.note_owners(std::iter::once((partition, owner)));
                }
                if let Some(pending) = self.unacked.get_mut(&refused.seq) {
                    pending.sent_on = None;
                }
                self.route(refused.seq);
            }
            ClientEvent::Directory(Ok(directory)) => {
                self.directory_in_flight = false;
                self.note_owners(directory.iter().map(|(partition, owner)| (*partition, owner.clone())));
                self.directory = directory;
                let seqs: Vec<u64> = self.unacked.keys().copied().collect();
                for seq in seqs {
                    self.route(seq);
                }
            }
            ClientEvent::Barrier(reply) => self.barriers.push((self.seq, reply)),
            ClientEvent::Directory(Err(error)) => {
                self.directory_in_flight = false;
                self.directory_wanted = true;
                tracing::warn!(service = self.settings.service, %error, "reading the owner directory failed; retrying");
            }
        }
    }

    /// Record the owners `owners` name, and tell the partitions whose owner
    /// changed (a first owner known is no change: nothing was sent on an
    /// older path).
    fn note_owners(&mut self, owners: impl Iterator<Item = (i32, Arc<str>)>) {
        let mut moved: Vec<i32> = Vec::new();
        for (partition, owner) in owners {
            if let Some(before) = self.known_owners.insert(partition, owner.clone()) {
                if before != owner {
                    moved.push(partition);
                }
            }
        }
        if !moved.is_empty() {
            moved.sort_unstable();
            tracing::debug!(service = self.settings.service, partitions = ?moved, "owners moved; re-sending what waits on them");
            let _ = self.paths.send(Arc::new(moved));
        }
    }

    fn hello(&self) -> pb::LinkUp {
        pb::LinkUp {
            message: Some(pb::link_up::Message::Hello(pb::LinkHello {
                client_id: self.settings.client_id.clone(),
                job_partitions: self.claims.clone(),
            })),
        }
    }

    /// Write `seq` to its partition's owner, unless it is already on that
    /// owner's current stream; connect when there is no stream yet.
    fn route(&mut self, seq: u64) {
        let Some(pending) = self.unacked.get(&seq) else {
            return;
        };
        let Some(endpoint) = self.directory.get(&pending.partition).cloned() else {
            self.directory_wanted = true;
            return;
        };
        let connection = self.connections.entry(endpoint.clone()).or_insert_with(Connection::new);
        let Some(sender) = connection.sender().cloned() else {
            return;
        };
        let generation = connection.generation;
        if pending
            .sent_on
            .as_ref()
            .is_some_and(|(sent_to, sent_generation)| *sent_to == endpoint && *sent_generation == generation)
        {
            return;
        }
        let message = pb::LinkUp {
            message: Some(pb::link_up::Message::Commands(pb::LinkCommands {
                seq,
                partition: u32::try_from(pending.partition).unwrap_or_default(),
                commands: pending.commands.as_ref().clone(),
            })),
        };
        // Full: the next tick writes it. Closed: `Closed` follows.
        if sender.try_send(message).is_ok() {
            if let Some(pending) = self.unacked.get_mut(&seq) {
                pending.sent_on = Some((endpoint, generation));
            }
        }
    }

    fn opened(&mut self, endpoint: Arc<str>, generation: u64, sender: mpsc::Sender<pb::LinkUp>) {
        let hello = self.hello();
        let Some(connection) = self.connections.get_mut(&endpoint) else {
            return;
        };
        if connection.generation != generation {
            return;
        }
        let _ = sender.try_send(hello);
        connection.state = ConnectionState::Open(sender);
        connection.failures = 0;
        tracing::debug!(service = self.settings.service, %endpoint, "link open");
        let seqs: Vec<u64> = self.unacked.keys().copied().collect();
        for seq in seqs {
            self.route(seq);
        }
        if !self.opened_before.insert(endpoint.clone()) {
            // Open again after a break: what its owner answered on the old
            // stream may be lost (a grant on its way down).
            let mut partitions: Vec<i32> = self
                .directory
                .iter()
                .filter(|(_, owner)| **owner == endpoint)
                .map(|(partition, _)| *partition)
                .collect();
            if !partitions.is_empty() {
                partitions.sort_unstable();
                let _ = self.paths.send(Arc::new(partitions));
            }
        }
    }

    fn closed(&mut self, endpoint: &Arc<str>, generation: u64, error: &str) {
        let Some(connection) = self.connections.get_mut(endpoint) else {
            return;
        };
        if connection.generation != generation {
            return;
        }
        connection.failures = connection.failures.saturating_add(1);
        let backoff = Duration::from_millis(100)
            .saturating_mul(2u32.saturating_pow(connection.failures.min(6)))
            .min(Duration::from_secs(5));
        connection.state = ConnectionState::Idle {
            retry_at: tokio::time::Instant::now() + backoff,
        };
        for pending in self.unacked.values_mut() {
            if pending.sent_on.as_ref().is_some_and(|(sent_to, _)| sent_to == endpoint) {
                pending.sent_on = None;
            }
        }
        tracing::debug!(service = self.settings.service, %endpoint, %error, "link closed");
        // The owner may have moved.
        self.directory_wanted = true;
    }

    fn condition(&self) -> String {
        format!("links to {}", self.settings.service)
    }

    /// Not ready while commands have had no stream to go on for a while
    /// (their owner unknown or unreachable); they wait, none is dropped.
    fn report_waiting(&mut self) {
        let now = tokio::time::Instant::now();
        let waiting = self
            .unacked
            .values()
            .filter(|pending| pending.sent_on.is_none())
            .count();
        if waiting == 0 {
            if self.waiting_since.take().is_some() {
                self.readiness.clear(&self.condition());
            }
            return;
        }
        let since = *self.waiting_since.get_or_insert(now);
        if now.duration_since(since) >= WAITING_BEFORE_NOT_READY {
            let reason = format!(
                "{waiting} commands wait for their owner (unknown or unreachable) since {:?} ago",
                now.duration_since(since)
            );
            self.readiness.set(self.condition(), reason);
        }
    }

    fn tick(&mut self) {
        if self.directory_wanted && !self.directory_in_flight {
            self.directory_wanted = false;
            self.directory_in_flight = true;
            let events = self.events.clone();
            let seed = self.settings.seed_endpoint.clone();
            tokio::spawn(async move {
                let _ = events.send(ClientEvent::Directory(read_directory(&seed).await));
            });
        }
        // One stream to every instance that owns a partition; none to others.
        let wanted: std::collections::HashSet<Arc<str>> = self.directory.values().cloned().collect();
        self.connections.retain(|endpoint, connection| {
            let keep = wanted.contains(endpoint) || matches!(connection.state, ConnectionState::Connecting);
            if !keep {
                tracing::debug!(%endpoint, "closing the link to an instance that owns nothing");
            }
            keep
        });
        let now = tokio::time::Instant::now();
        for endpoint in wanted {
            let connection = self.connections.entry(endpoint.clone()).or_insert_with(Connection::new);
            let due = matches!(connection.state, ConnectionState::Idle { retry_at } if retry_at <= now);
            if !due {
                continue;
            }
            self.next_generation += 1;
            connection.generation = self.next_generation;
            connection.state = ConnectionState::Connecting;
            tokio::spawn(run_connection(
                endpoint.clone(),
                connection.generation,
                self.events.clone(),
                self.grants.clone(),
            ));
        }
        self.report_waiting();
        // Commands not written yet (a full buffer, a stream just opened).
        let unsent: Vec<u64> = self
            .unacked
            .iter()
            .filter(|(_, pending)| pending.sent_on.is_none())
            .map(|(seq, _)| *seq)
            .collect();
        for seq in unsent {
            self.route(seq);
        }
    }
}

async fn read_directory(seed: &str) -> Result<HashMap<i32, Arc<str>>, String> {
    let channel = stream_channel(seed)
        .map_err(|error| error.to_string())?
        .connect()
        .await
        .map_err(|error| format!("connecting to {seed}: {error}"))?;
    let response = OwnerLinkClient::new(crate::auth::with_credentials(channel))
        .directory(pb::DirectoryRequest {})
        .await
        .map_err(|status| format!("{seed} answered {status}"))?;
    Ok(response
        .into_inner()
        .partitions
        .into_iter()
        .filter_map(|entry| Some((i32::try_from(entry.partition).ok()?, Arc::from(entry.endpoint.as_str()))))
        .collect())
}

/// A channel for long-lived streams: no per-request timeout, keep-alives to
/// notice a peer that went away.
fn stream_channel(endpoint: &str) -> Result<tonic::transport::Endpoint, tonic::transport::Error> {
    Ok(crate::tls::endpoint(endpoint)?
        .connect_timeout(Duration::from_secs(3))
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true))
}

async fn run_connection(
    endpoint: Arc<str>,
    generation: u64,
    events: mpsc::UnboundedSender<ClientEvent>,
    grants: mpsc::Sender<Downlink>,
) {
    let error = match open_and_read(&endpoint, generation, &events, &grants).await {
        Ok(()) => "the owner ended the stream".to_string(),
        Err(error) => error,
    };
    let _ = events.send(ClientEvent::Closed {
        endpoint,
        generation,
        error,
    });
}

async fn open_and_read(
    endpoint: &Arc<str>,
    generation: u64,
    events: &mpsc::UnboundedSender<ClientEvent>,
    grants: &mpsc::Sender<Downlink>,
) -> Result<(), String> {
    let channel = stream_channel(endpoint)
        .map_err(|error| error.to_string())?
        .connect()
        .await
        .map_err(|error| format!("connecting: {error}"))?;
    let (sender, receiver) = mpsc::channel(STREAM_BUFFER);
    let response = OwnerLinkClient::new(crate::auth::with_credentials(channel))
        .link(ReceiverStream::new(receiver))
        .await
        .map_err(|status| format!("opening the stream: {status}"))?;
    events
        .send(ClientEvent::Opened {
            endpoint: endpoint.clone(),
            generation,
            sender,
        })
        .map_err(|_| "client stopped".to_string())?;
    let mut inbound = response.into_inner();
    while let Some(message) = inbound.message().await.map_err(|status| status.to_string())? {
        match message.message {
            Some(pb::link_down::Message::Grants(batch)) => {
                let taken = grants.send(Downlink::Grants(batch.events)).await;
                taken.map_err(|_| "admission stopped taking grants".to_string())?;
            }
            Some(pb::link_down::Message::Applied(applied)) => {
                let _ = events.send(ClientEvent::Applied(applied.seqs));
            }
            Some(pb::link_down::Message::Refused(refused)) => {
                let _ = events.send(ClientEvent::Refused(refused));
            }
            None => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
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
}
