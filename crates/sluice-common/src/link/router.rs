//! Owner side, grants out: `GrantRouter` writes committed grants to the
//! stream that claimed the job's partition, each stream through a queue of
//! its own so that a slow one holds up no other.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use futures::FutureExt;
use sluice_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use super::{Link, LinkEntries, LinkSink, MAX_MESSAGE_BYTES, MAX_QUEUED_GRANT_BYTES};

type DownSender = mpsc::Sender<Result<pb::LinkDown, Status>>;

/// The grants waiting for one stream. `deliver` only queues (never
/// waits); the stream's own forwarder task writes them to the stream in
/// order, at the pace its reader takes them.
#[derive(Clone)]
pub(super) struct StreamGrants {
    queue: mpsc::UnboundedSender<(pb::LinkDown, usize)>,
    queued_bytes: Arc<AtomicUsize>,
    /// The stream itself, to end it (fault hook).
    down: DownSender,
}

impl StreamGrants {
    /// Queue `events` for the stream, or say they were dropped: the stream
    /// is closed, or so far behind that it holds `MAX_QUEUED_GRANT_BYTES`.
    pub(super) fn push(&self, events: Vec<Vec<u8>>) -> Result<(), GrantsDropped> {
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
    pub(super) fn send_control(&self, message: pb::link_down::Message) {
        let _ = self.queue.send((pb::LinkDown { message: Some(message) }, 0));
    }
}

pub(super) enum GrantsDropped {
    Closed,
    Behind { queued: usize },
}

/// Open the grant queue of a stream writing to `down`: a forwarder task
/// moves queued grants to the stream until either end closes.
pub(super) fn open_grants(down: DownSender) -> StreamGrants {
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
    pub(super) watchers: tokio::sync::broadcast::Sender<Arc<Vec<Vec<u8>>>>,
    pub(super) faults: crate::faults::Faults,
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

    pub(super) fn new_stream_id(&self) -> u64 {
        self.next_stream.fetch_add(1, Ordering::Relaxed)
    }

    /// `stream` takes the grants of `claims` (a higher epoch wins; at equal
    /// epochs the later claim) and no longer those it stopped claiming.
    /// Returns the job partitions whose grants now go to `stream` and did
    /// not before.
    pub(super) fn claim(&self, stream: u64, grants: &StreamGrants, claims: &[pb::JobPartitionClaim]) -> Vec<i32> {
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

    pub(super) fn forget(&self, stream: u64) {
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
pub(super) fn chunked(entries: Vec<Vec<u8>>) -> Vec<Vec<Vec<u8>>> {
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
