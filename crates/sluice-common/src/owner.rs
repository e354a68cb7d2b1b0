//! The owner runtime (docs/architecture.md, "Ownership and fencing"),
//! written once for limit-grant, rate-window and refresh-dispatcher.
//!
//! Instances of a service share a consumer group on the service's input topic;
//! the partitions a member is assigned are the keys it owns. For each assigned
//! partition a task:
//!
//! 1. bumps the partition's fencing epoch in PostgreSQL and records itself in
//!    the owner directory (`owners`: partition, epoch, endpoint);
//! 2. loads the partition's state;
//! 3. re-sends what the state implies was sent (a previous owner may have
//!    saved a decision and died before publishing it);
//! 4. then, batch after batch: decides in memory, commits the batch's writes in
//!    one transaction that re-checks the epoch under the row lock (a stale
//!    owner's commit is refused), publishes the effects, stores the offsets.
//!
//! The last applied input offset is saved with every commit, so a new owner
//! skips input whose effects are already saved. A partition whose log ends
//! below that offset was lost by the broker (restarted without storage, the
//! topic re-created): the owner says so and adopts the new log.
//!
//! No input stops a partition (`crate::fault`): an entry the state refuses is
//! set aside in the `quarantine` table with its bytes and the reason; a batch
//! whose commit fails every time (or whose decision panics) is applied again
//! one message, then one entry, at a time, and the entry that still fails is
//! set aside the same way. Faults that pass (the database or the broker away)
//! are retried with backoff, and readiness is NOT_SERVING while they last.

mod batch;
mod fence;
mod publish;
mod registry;
mod takeover;
mod task;
mod traits;

pub use fence::{
    bump_epoch, commit_fenced, fence_and_advance, insert_quarantined, live_other_owner, lookup_owner,
    orphaned_partitions, owner_let_go, report_quarantined, CommitError, FencedStatement,
};
pub use registry::{BarrierLocal, LocalCallError, OwnedPartitionHandle, OwnerRegistry, Received};
pub use task::{OwnerRuntime, OwnerSettings};
pub use traits::{apply_entries, OwnedState, OwnedStore, OwnerContext, Rejected, Reply, WriteSet};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[cfg(test)]
mod tests;
