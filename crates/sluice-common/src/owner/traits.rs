//! What a service plugs into the owner runtime: its partition state
//! (`OwnedState`, pure decisions) and the store that loads and saves it
//! (`OwnedStore`), with the types they exchange.

use async_trait::async_trait;
use sqlx::{PgConnection, PgPool};

use super::FencedStatement;
use crate::clock::AnchoredClock;
use crate::kafka::{batch_entries, InMsg, OutMsg, Outbox};

/// What a partition task knows about its ownership.
#[derive(Clone, Copy, Debug)]
pub struct OwnerContext {
    pub partition: i32,
    pub epoch: i64,
    pub clock: AnchoredClock,
    /// The owner this one took the partition from was alive (this process,
    /// or one whose row moved within the last few seconds and that had not
    /// released the partition; never when resuming after a kill): a
    /// handover, not a crash. What it sent after its commits reached their
    /// streams, which its live instance still holds.
    pub previous_owner_alive: bool,
}

/// Replies to local (gRPC) requests, sent once the batch is durable.
pub type Reply = Box<dyn FnOnce() + Send>;

/// An entry of the input that can never be applied (undecodable, invalid,
/// not this partition's): set aside with its bytes and the reason.
#[derive(Clone, Debug, PartialEq)]
pub struct Rejected {
    pub offset: i64,
    pub entry: Vec<u8>,
    pub reason: String,
}

pub trait WriteSet: Default + Send + 'static {
    fn is_empty(&self) -> bool;
}

/// A partition's in-memory state and its decisions. Pure: no I/O.
pub trait OwnedState: Send + 'static {
    /// A request from this process's gRPC handlers, with its reply channel.
    type Local: Send + 'static;
    type Writes: WriteSet;
    /// What `OwnedStore::prepare` read for a batch (`()` when nothing).
    type Prepared: Default + Send;

    /// Take what `OwnedStore::prepare` read for the batch `apply` is about
    /// to decide on.
    fn prepared(&mut self, _prepared: Self::Prepared) {}

    /// Before `apply`: every request this process's handlers received for
    /// the partition at or before `through_ms` (the partition's clock) is
    /// in this batch or an earlier one; any received later may still wait
    /// (in the partition's queue, or on its way to it: the queue was full,
    /// the partition was loading). A state that ends something by time
    /// because nobody spoke up (a lease ending at `end_ms`) waits while
    /// `through_ms < end_ms`: the word may be on its way (a completion
    /// behind thousands of grants after a takeover). Requests received
    /// after the end cannot be that word, however many wait.
    fn requests_received_through(&mut self, _through_ms: i64) {}

    /// Advance to `now_ms` (timers), then apply `messages` and `locals` in
    /// order, recording writes, effects and replies.
    ///
    /// An entry that can never be applied changes nothing: it goes to
    /// `rejected` with its bytes and the reason, and the other entries are
    /// applied. Implementations check an entry completely before they change
    /// any state for it (`apply_entries` helps).
    #[allow(clippy::too_many_arguments)]
    fn apply(
        &mut self,
        now_ms: i64,
        messages: &[InMsg],
        locals: Vec<Self::Local>,
        writes: &mut Self::Writes,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
        rejected: &mut Vec<Rejected>,
    );

    /// Every effect the saved state implies, for a new owner to re-send.
    fn resend_all(&self, now_ms: i64, outbox: &mut Outbox);

    /// The owner starts serving at `now_ms`: its takeover (load, re-sends)
    /// is done and requests reach it from now on. Whatever the state grants
    /// others from its takeover (a running attempt's lease, a re-send timer)
    /// runs from here, not from the load: a takeover can take longer than
    /// such a grace (thousands of re-sends under load), and a worker heard
    /// by nobody meanwhile must not lose to it. Also called after a reload.
    fn begin_serving(&mut self, _now_ms: i64) {}

    /// When `apply` must run next even without input (lease expiry, slots).
    fn next_wakeup_ms(&self) -> Option<i64>;

    /// A fault hook of the state's own fired while deciding the last batch:
    /// once that batch is committed, the partition stops as a crash would
    /// (a crash point between the commit and what follows it). Asking
    /// clears it.
    fn crash_after_commit(&mut self) -> bool {
        false
    }

    /// The partition's keys at `now_ms` (the owner's clock: a state reads
    /// none), for per-key metrics (bounded by configuration).
    fn key_stats(&self, _now_ms: i64) -> Vec<crate::metrics::KeyStat> {
        Vec::new()
    }
}

/// Apply each entry of a batch message (`LimitCommandBatch`, ...: field 1
/// is the entry) with `apply`. An entry that does not decode, or that `apply`
/// refuses (it must refuse before changing anything), is rejected with its
/// own bytes; the others are applied. `what` names the entry in reasons.
pub fn apply_entries<M: prost::Message + Default>(
    message: &InMsg,
    what: &str,
    rejected: &mut Vec<Rejected>,
    mut apply: impl FnMut(M) -> Result<(), String>,
) {
    let payload = message.payload.as_deref().unwrap_or_default();
    let entries = match batch_entries(payload) {
        Ok(entries) => entries,
        Err(error) => {
            rejected.push(Rejected {
                offset: message.offset,
                entry: payload.to_vec(),
                reason: format!("undecodable {what} batch: {error}"),
            });
            return;
        }
    };
    for entry in entries {
        let outcome = M::decode(entry)
            .map_err(|error| format!("undecodable {what}: {error}"))
            .and_then(&mut apply);
        if let Err(reason) = outcome {
            rejected.push(Rejected {
                offset: message.offset,
                entry: entry.to_vec(),
                reason,
            });
        }
    }
}

/// Loads and saves a partition's state.
#[async_trait]
pub trait OwnedStore: Send + Sync + 'static {
    type State: OwnedState;

    async fn load(&self, connection: &mut PgConnection, context: &OwnerContext) -> Result<Self::State, sqlx::Error>;

    async fn persist(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
        writes: <Self::State as OwnedState>::Writes,
    ) -> Result<(), sqlx::Error>;

    /// A batch whose writes are all plain inserts (the common case on the
    /// hot path: a journal row, and outcome rows when jobs end) is committed
    /// with the fence in one autocommitted statement instead of a
    /// transaction's round trips. `None` (the default): `persist` in a
    /// transaction.
    fn one_statement(&self, _writes: &<Self::State as OwnedState>::Writes) -> Option<FencedStatement> {
        None
    }

    /// Input that must be set aside can be sent somewhere instead of the
    /// quarantine table: a message to publish (admission dead-letters a
    /// producer's request PostgreSQL refuses to store). `None`: quarantine.
    fn redirect_rejected(&self, _topic: &str, _partition: i32, _rejected: &Rejected) -> Option<OutMsg> {
        None
    }

    /// Read what deciding on a batch needs and the in-memory state does not
    /// hold (rows of finished jobs, say). Runs before `apply`, outside the
    /// batch's transaction; the default reads nothing.
    async fn prepare(
        &self,
        _pool: &PgPool,
        _state: &Self::State,
        _messages: &[InMsg],
        _locals: &[<Self::State as OwnedState>::Local],
    ) -> Result<<Self::State as OwnedState>::Prepared, sqlx::Error> {
        Ok(Default::default())
    }
}
