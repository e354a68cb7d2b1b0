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

mod client;
mod connection;
mod router;
mod service;

pub use client::{LinkBarrierError, LinkClient, LinkClientSettings, PathChange};
pub use router::GrantRouter;
pub use service::{LinkBatch, LinkInput, LinkService};

use std::collections::BTreeMap;

use futures::future::BoxFuture;
use tokio::sync::oneshot;

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

#[cfg(test)]
mod tests;
