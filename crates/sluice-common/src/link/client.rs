//! Admission side: `LinkClient`, through which a service's commands are
//! sent, and its actor, which keeps one stream to every owner instance
//! found through the directory, keeps every command until its owner has
//! applied it, and sends it again when a stream breaks or the owner
//! changes.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sluice_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot};

use crate::shutdown::Shutdown;

use super::connection::{read_directory, run_connection};
use super::router::chunked;
use super::Downlink;

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
pub(super) const PATH_CHANGES_BUFFER: usize = 64;

pub(super) enum ClientEvent {
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

pub(super) struct Pending {
    partition: i32,
    commands: Arc<Vec<Vec<u8>>>,
    /// The stream it was last written to (endpoint, generation).
    sent_on: Option<(Arc<str>, u64)>,
}

/// One stream to one owner instance.
pub(super) struct Connection {
    /// The current (or last) attempt; events of older attempts are ignored.
    pub(super) generation: u64,
    pub(super) state: ConnectionState,
    failures: u32,
    /// The claims (`LinkHello`) are not written to the open stream yet: no
    /// command goes on it before them.
    hello_pending: bool,
}

pub(super) enum ConnectionState {
    /// Not connected; try again at this time.
    Idle {
        retry_at: tokio::time::Instant,
    },
    Connecting,
    Open(mpsc::Sender<pb::LinkUp>),
}

impl Connection {
    pub(super) fn new() -> Self {
        Connection {
            generation: 0,
            state: ConnectionState::Idle {
                retry_at: tokio::time::Instant::now(),
            },
            failures: 0,
            hello_pending: false,
        }
    }

    fn sender(&self) -> Option<&mpsc::Sender<pb::LinkUp>> {
        match &self.state {
            ConnectionState::Open(sender) => Some(sender),
            _ => None,
        }
    }
}

pub(super) struct ClientActor {
    pub(super) settings: LinkClientSettings,
    pub(super) events: mpsc::UnboundedSender<ClientEvent>,
    pub(super) grants: mpsc::Sender<Downlink>,
    pub(super) readiness: crate::readiness::Readiness,
    pub(super) seq: u64,
    pub(super) unacked: BTreeMap<u64, Pending>,
    pub(super) unacked_count: Arc<AtomicU64>,
    pub(super) directory: HashMap<i32, Arc<str>>,
    pub(super) directory_wanted: bool,
    pub(super) directory_in_flight: bool,
    pub(super) connections: HashMap<Arc<str>, Connection>,
    pub(super) next_generation: u64,
    pub(super) claims: Vec<pb::JobPartitionClaim>,
    /// Since when some command has had no stream to go on.
    pub(super) waiting_since: Option<tokio::time::Instant>,
    /// Where path changes are told.
    pub(super) paths: tokio::sync::broadcast::Sender<PathChange>,
    /// Endpoints a stream was ever open to: one opening again is a new path.
    pub(super) opened_before: std::collections::HashSet<Arc<str>>,
    /// The last owner known of each partition (kept when `directory`
    /// forgets one), to tell an owner change.
    pub(super) known_owners: HashMap<i32, Arc<str>>,
    /// Barriers waiting for the commands up to their seq to be applied.
    pub(super) barriers: Vec<(u64, oneshot::Sender<()>)>,
}

/// How long commands may wait for a stream before the instance says it is
/// not ready.
const WAITING_BEFORE_NOT_READY: Duration = Duration::from_secs(2);

/// How often the client looks at its streams and the directory.
const CLIENT_TICK: Duration = Duration::from_millis(250);
/// How often the directory is read even when nothing seems wrong.
const DIRECTORY_EVERY: Duration = Duration::from_secs(10);

impl ClientActor {
    pub(super) async fn run(mut self, mut receiver: mpsc::UnboundedReceiver<ClientEvent>, shutdown: Shutdown) {
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

    pub(super) fn handle(&mut self, event: ClientEvent) {
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
            ClientEvent::Claims(claims) => self.claims_changed(claims),
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

    /// Every open stream tells its owner the new claims, ahead of any
    /// command sent after them (a full buffer keeps the commands back too
    /// until the claims are written: `route`).
    fn claims_changed(&mut self, claims: Vec<pb::JobPartitionClaim>) {
        self.claims = claims;
        let endpoints: Vec<Arc<str>> = self.connections.keys().cloned().collect();
        for endpoint in endpoints {
            if let Some(connection) = self.connections.get_mut(&endpoint) {
                connection.hello_pending = true;
            }
            self.write_hello(&endpoint);
        }
    }

    /// Write the claims to the stream to `endpoint` if they are pending
    /// there. Whether nothing is pending now (a full buffer: the next tick
    /// tries again).
    fn write_hello(&mut self, endpoint: &Arc<str>) -> bool {
        // Checked before the message is built: `route` asks for every command.
        if !self
            .connections
            .get(endpoint)
            .is_some_and(|connection| connection.hello_pending)
        {
            return true;
        }
        let hello = self.hello();
        let Some(connection) = self.connections.get_mut(endpoint) else {
            return true;
        };
        let Some(sender) = connection.sender() else {
            return false;
        };
        match sender.try_send(hello) {
            Ok(()) => {
                connection.hello_pending = false;
                true
            }
            // Closed: `Closed` follows, and the next stream starts with them.
            Err(_) => false,
        }
    }

    /// Write `seq` to its partition's owner, unless it is already on that
    /// owner's current stream; connect when there is no stream yet. Never
    /// ahead of claims still pending on that stream: a grant answering the
    /// command must find the stream claimed.
    fn route(&mut self, seq: u64) {
        let Some(partition) = self.unacked.get(&seq).map(|pending| pending.partition) else {
            return;
        };
        let Some(endpoint) = self.directory.get(&partition).cloned() else {
            self.directory_wanted = true;
            return;
        };
        let connection = self.connections.entry(endpoint.clone()).or_insert_with(Connection::new);
        if connection.sender().is_none() || !self.write_hello(&endpoint) {
            return;
        }
        let (Some(pending), Some(connection)) = (self.unacked.get(&seq), self.connections.get(&endpoint)) else {
            return;
        };
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
        let Some(connection) = self.connections.get_mut(&endpoint) else {
            return;
        };
        if connection.generation != generation {
            return;
        }
        connection.state = ConnectionState::Open(sender);
        connection.hello_pending = true;
        connection.failures = 0;
        self.write_hello(&endpoint);
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
        let backoff = reconnect_backoff(connection.failures);
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

    pub(super) fn tick(&mut self) {
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
        // Claims not written yet (a full buffer), then commands.
        let endpoints: Vec<Arc<str>> = self.connections.keys().cloned().collect();
        for endpoint in endpoints {
            self.write_hello(&endpoint);
        }
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

/// The longest wait before a closed link is opened again.
pub(super) const RECONNECT_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// How long a link waits before it is opened again after `failures` breaks
/// or failed connects in a row: 200 ms, then 400 ms, then every
/// `RECONNECT_BACKOFF_MAX`. The owner it leads to is down or restarting,
/// and everything waiting on that owner waits for this link: a longer
/// backoff (up to 5 s) left a restarted limit-grant instance 1.5 s without
/// its links in `make chaos`, every key whose tickets it owns waiting. A
/// connect to a dead address fails at once, so two a second cost nothing.
pub(super) fn reconnect_backoff(failures: u32) -> Duration {
    Duration::from_millis(100)
        .saturating_mul(2u32.saturating_pow(failures.min(6)))
        .min(RECONNECT_BACKOFF_MAX)
}
