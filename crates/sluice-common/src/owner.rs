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

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use futures::FutureExt;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::mpsc;

use crate::clock::AnchoredClock;
use crate::fault::{classify_kafka, classify_sql, clean_text, panic_message};
use crate::faults::{FaultPoint, Faults};
use crate::kafka::{
    batch_entries, single_entry_batch, InMsg, OutMsg, Outbox, PartitionInput, PartitionTaskError, PartitionTaskFactory,
    Publisher,
};
use crate::link::LinkSink;
use crate::readiness::Readiness;
use crate::retry::Backoff;

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// What a partition task knows about its ownership.
#[derive(Clone, Copy, Debug)]
pub struct OwnerContext {
    pub partition: i32,
    pub epoch: i64,
    pub clock: AnchoredClock,
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

    /// When `apply` must run next even without input (lease expiry, slots).
    fn next_wakeup_ms(&self) -> Option<i64>;

    /// A fault hook of the state's own fired while deciding the last batch:
    /// once that batch is committed, the partition stops as a crash would
    /// (a crash point between the commit and what follows it). Asking
    /// clears it.
    fn crash_after_commit(&mut self) -> bool {
        false
    }

    /// The partition's keys, for per-key metrics (bounded by configuration).
    fn key_stats(&self) -> Vec<crate::metrics::KeyStat> {
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

type PgQuery = sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// Writes committed with the fence in one statement
/// (`OwnedStore::one_statement`, `commit_fenced`): data-modifying CTEs that
/// each select from `fence`, the owners row updated only while the
/// partition's epoch is still ours. In their SQL, `$1` is the partition and
/// `$3` the epoch; values of their own are added with `param`.
pub struct FencedStatement {
    ctes: String,
    writes: usize,
    parameters: usize,
    binds: Vec<Box<dyn FnOnce(PgQuery) -> PgQuery + Send>>,
}

impl Default for FencedStatement {
    fn default() -> Self {
        FencedStatement {
            ctes: String::new(),
            writes: 0,
            // $1 partition, $2 applied offset, $3 epoch.
            parameters: 3,
            binds: Vec::new(),
        }
    }
}

impl FencedStatement {
    /// Bind `value`; returns its placeholder (`$4`, `$5`, …).
    pub fn param<T>(&mut self, value: T) -> String
    where
        T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + 'static,
    {
        self.parameters += 1;
        self.binds.push(Box::new(move |query: PgQuery| query.bind(value)));
        format!("${}", self.parameters)
    }

    /// Add a data-modifying statement; it must read `FROM fence` so that it
    /// writes nothing when the epoch has moved on.
    pub fn write(&mut self, statement: &str) {
        use std::fmt::Write as _;
        self.writes += 1;
        let _ = write!(self.ctes, ", write{} AS ({statement})", self.writes);
    }

    /// A journal row: `table` has the columns (partition, seq, epoch, entry).
    pub fn journal(&mut self, table: &str, seq: i64, entry: Vec<u8>) {
        let seq = self.param(seq);
        let entry = self.param(entry);
        self.write(&format!(
            "INSERT INTO {table} (partition, seq, epoch, entry) SELECT $1, {seq}, $3, {entry} FROM fence"
        ));
    }
}

/// Commit `statement` fenced by `epoch`: the owners row is updated (applied
/// offset) and the writes made only while the partition's epoch is still
/// ours, atomically, under the owners row's lock like `fence_and_advance` in
/// a transaction.
pub async fn commit_fenced(
    pool: &PgPool,
    partition: i32,
    epoch: i64,
    new_offset: Option<i64>,
    statement: FencedStatement,
) -> Result<(), CommitError> {
    let sql = format!(
        "WITH fence AS (
            UPDATE owners SET applied_offset = GREATEST(applied_offset, $2), updated_at = now()
            WHERE partition = $1 AND epoch = $3 RETURNING epoch){}
         SELECT count(*) FROM fence",
        statement.ctes
    );
    let mut query: PgQuery = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(partition)
        .bind(new_offset)
        .bind(epoch);
    for bind in statement.binds {
        query = bind(query);
    }
    let fenced_rows: i64 = sqlx::Row::try_get(&query.fetch_one(pool).await?, 0)?;
    if fenced_rows == 1 {
        return Ok(());
    }
    let current = lookup_owner(pool, partition).await?.map_or(-1, |(_, current)| current);
    Err(CommitError::Fenced {
        partition,
        ours: epoch,
        current,
    })
}

#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("fenced: partition {partition} now belongs to epoch {current} (ours {ours})")]
    Fenced { partition: i32, ours: i64, current: i64 },
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Take over `partition`: bump its epoch and record the owner directory row.
/// Waits for an old owner's in-flight commit (it holds the row lock).
pub async fn bump_epoch(
    connection: &mut PgConnection,
    partition: i32,
    owner_id: &str,
    endpoint: &str,
) -> Result<(i64, i64), sqlx::Error> {
    let row: (i64, i64) = sqlx::query_as(
        "INSERT INTO owners (partition, epoch, owner_id, endpoint) VALUES ($1, 1, $2, $3)
         ON CONFLICT (partition) DO UPDATE
            SET epoch = owners.epoch + 1, owner_id = EXCLUDED.owner_id, endpoint = EXCLUDED.endpoint,
                owned_since = now(), updated_at = now(), released = false
         RETURNING epoch, applied_offset",
    )
    .bind(partition)
    .bind(owner_id)
    .bind(endpoint)
    .fetch_one(connection)
    .await?;
    Ok(row)
}

/// Inside a batch transaction, first: lock the partition's row, move its
/// applied offset to `new_offset` (when the batch consumed input), and refuse
/// if another owner has bumped the epoch since we took over (the caller then
/// rolls back, offset included). One statement, so a batch pays one round
/// trip for its fence.
pub async fn fence_and_advance(
    connection: &mut PgConnection,
    partition: i32,
    epoch: i64,
    new_offset: Option<i64>,
) -> Result<(), CommitError> {
    let current: Option<i64> = sqlx::query_scalar(
        "UPDATE owners SET applied_offset = GREATEST(applied_offset, $2), updated_at = now()
         WHERE partition = $1 RETURNING epoch",
    )
    .bind(partition)
    .bind(new_offset)
    .fetch_optional(&mut *connection)
    .await?;
    match current {
        Some(current) if current == epoch => Ok(()),
        Some(current) => Err(CommitError::Fenced {
            partition,
            ours: epoch,
            current,
        }),
        None => Err(CommitError::Fenced {
            partition,
            ours: epoch,
            current: -1,
        }),
    }
}

/// The owner directory: who owns a partition now.
pub async fn lookup_owner(pool: &PgPool, partition: i32) -> Result<Option<(String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT endpoint, epoch FROM owners WHERE partition = $1")
        .bind(partition)
        .fetch_optional(pool)
        .await
}

/// Why the owner of `partition` let it go, if it did: it released it, or
/// its row has not moved for `silent_after`. `None`: it holds it.
pub async fn owner_let_go(
    pool: &PgPool,
    partition: i32,
    silent_after: Duration,
) -> Result<Option<String>, sqlx::Error> {
    let silent_ms = i64::try_from(silent_after.as_millis()).unwrap_or(i64::MAX);
    let row: Option<(bool, i64)> = sqlx::query_as(
        "SELECT released, (extract(epoch FROM now() - updated_at) * 1000)::bigint FROM owners WHERE partition = $1",
    )
    .bind(partition)
    .fetch_optional(pool)
    .await?;
    Ok(match row {
        None => Some("no owner".to_string()),
        Some((true, _)) => Some("its owner released it".to_string()),
        Some((false, silent_for_ms)) if silent_for_ms >= silent_ms => {
            Some(format!("its owner has been silent for {silent_for_ms} ms"))
        }
        Some(_) => None,
    })
}

/// Mark `partition` released by the owner of `epoch` (given up in order):
/// a member standing by for it takes it at once. Best effort: a member
/// otherwise takes it once the row has been silent long enough.
async fn release(pool: &PgPool, partition: i32, epoch: i64) {
    let released = sqlx::query("UPDATE owners SET released = true WHERE partition = $1 AND epoch = $2")
        .bind(partition)
        .bind(epoch)
        .execute(pool)
        .await;
    if let Err(error) = released {
        tracing::debug!(partition, %error, "marking the partition released failed");
    }
}

/// Set input aside: its bytes and the reason, in the service's `quarantine`
/// table (inside the caller's transaction).
pub async fn insert_quarantined(
    connection: &mut PgConnection,
    topic: &str,
    partition: i32,
    rejected: &[Rejected],
) -> Result<(), sqlx::Error> {
    if rejected.is_empty() {
        return Ok(());
    }
    let offsets: Vec<i64> = rejected.iter().map(|entry| entry.offset).collect();
    let entries: Vec<&[u8]> = rejected.iter().map(|entry| entry.entry.as_slice()).collect();
    let reasons: Vec<String> = rejected
        .iter()
        .map(|entry| clean_text(&entry.reason, crate::validate::MAX_TEXT_BYTES))
        .collect();
    sqlx::query(
        "INSERT INTO quarantine (topic, partition, input_offset, entry, reason)
         SELECT $1, $2, u.input_offset, u.entry, u.reason
         FROM UNNEST($3::bigint[], $4::bytea[], $5::text[]) AS u(input_offset, entry, reason)",
    )
    .bind(clean_text(topic, 1024))
    .bind(partition)
    .bind(offsets)
    .bind(entries)
    .bind(reasons)
    .execute(connection)
    .await?;
    Ok(())
}

/// Log and count input that was set aside (once it is durable).
pub fn report_quarantined(service: &'static str, topic: &str, partition: i32, rejected: &[Rejected]) {
    for entry in rejected {
        tracing::error!(
            service,
            topic,
            partition,
            offset = entry.offset,
            bytes = entry.entry.len(),
            reason = %clean_text(&entry.reason, 2048),
            "input set aside in the quarantine table: it can never be applied"
        );
    }
    if !rejected.is_empty() {
        crate::metrics::metrics().quarantined.add(
            u64::try_from(rejected.len()).unwrap_or(u64::MAX),
            &[opentelemetry::KeyValue::new("service", service)],
        );
    }
}

/// Where a local request can reach the partition task that owns it.
pub struct OwnedPartitionHandle<L> {
    sender: mpsc::Sender<L>,
    epoch: i64,
}

/// Partitions this instance owns and is ready to serve. Readiness is the
/// instance's: a partition that is loading, or retrying a fault that passes,
/// is a condition on it.
pub struct OwnerRegistry<L> {
    service: &'static str,
    partitions: RwLock<HashMap<i32, OwnedPartitionHandle<L>>>,
    /// Partitions whose task is taking over here: the owner directory may
    /// already name this instance, so a call waits for the task rather than
    /// being sent back here by the directory.
    loading: Mutex<HashSet<i32>>,
    readiness: Readiness,
    /// Woken whenever a partition task starts taking calls here, or stops
    /// loading without starting.
    started: tokio::sync::Notify,
}

/// How long a call waits for a partition that is loading here.
const LOADING_WAIT: Duration = Duration::from_secs(5);

/// Marks a partition as loading while alive; dropped when its task starts
/// taking calls, stops, or is cancelled mid-takeover.
struct Loading<'a, L> {
    registry: &'a OwnerRegistry<L>,
    partition: i32,
}

impl<L> Drop for Loading<'_, L> {
    fn drop(&mut self) {
        self.registry
            .loading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(&self.partition);
        self.registry.started.notify_waiters();
    }
}

/// A partition task's local request that can be an ordering barrier.
pub trait BarrierLocal: Sized {
    /// A request that changes nothing and is answered once everything queued
    /// to the partition before it is applied, committed (fenced: the
    /// instance still owns the partition) and sent.
    fn barrier(reply: tokio::sync::oneshot::Sender<()>) -> Self;
}

#[derive(Debug, thiserror::Error)]
pub enum LocalCallError {
    #[error("partition {0} is not owned by this instance")]
    NotOwner(i32),
    #[error("partition {0} stopped before answering; retry")]
    Interrupted(i32),
    #[error("partition {0} is still loading on this instance; retry shortly")]
    Loading(i32),
}

impl<L: Send + 'static> OwnerRegistry<L> {
    pub fn new(service: &'static str, readiness: Readiness) -> Arc<Self> {
        Arc::new(OwnerRegistry {
            service,
            partitions: RwLock::new(HashMap::new()),
            loading: Mutex::new(HashSet::new()),
            readiness,
            started: tokio::sync::Notify::new(),
        })
    }

    /// The partition task's queue, if this instance owns the partition. A
    /// partition still loading here is waited for, up to `LOADING_WAIT`.
    async fn sender(&self, partition: i32) -> Result<mpsc::Sender<L>, LocalCallError> {
        let deadline = tokio::time::Instant::now() + LOADING_WAIT;
        loop {
            // Created before the checks, so a start between them is not missed.
            let changed = self.started.notified();
            if let Some(handle) = self
                .partitions
                .read()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .get(&partition)
            {
                return Ok(handle.sender.clone());
            }
            let loading = self
                .loading
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .contains(&partition);
            if !loading {
                return Err(LocalCallError::NotOwner(partition));
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return Err(LocalCallError::Loading(partition));
            }
        }
    }

    /// Send a request to the partition task, if this instance owns it.
    pub async fn call<R>(
        &self,
        partition: i32,
        make: impl FnOnce(tokio::sync::oneshot::Sender<R>) -> L,
    ) -> Result<R, LocalCallError> {
        let sender = self.sender(partition).await?;
        let (reply_sender, reply_receiver) = tokio::sync::oneshot::channel();
        sender
            .send(make(reply_sender))
            .await
            .map_err(|_| LocalCallError::NotOwner(partition))?;
        reply_receiver.await.map_err(|_| LocalCallError::Interrupted(partition))
    }

    /// Queue a request for the partition task, if this instance owns it,
    /// without waiting for the answer (the request carries its own reply).
    pub async fn submit(&self, partition: i32, local: L) -> Result<(), LocalCallError> {
        let sender = self.sender(partition).await?;
        sender
            .send(local)
            .await
            .map_err(|_| LocalCallError::NotOwner(partition))
    }

    /// Wait until everything queued to the partitions this instance owns
    /// now is applied, committed and sent (`BarrierLocal`). Tests wait on it
    /// instead of sleeping before they check that something did not happen.
    /// A partition given up meanwhile is skipped: what was queued to it is
    /// not applied here, and its new owner starts from what was committed.
    pub async fn barrier_all(&self) -> Result<(), LocalCallError>
    where
        L: BarrierLocal,
    {
        for partition in self.owned() {
            match self.call(partition, L::barrier).await {
                Ok(()) | Err(LocalCallError::NotOwner(_)) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(())
    }

    /// Completes when a partition task next starts taking calls here. Get
    /// it before checking `owns`: a start between the two is not missed.
    pub fn partition_started(&self) -> tokio::sync::futures::Notified<'_> {
        self.started.notified()
    }

    pub fn owns(&self, partition: i32) -> bool {
        let partitions = self.partitions.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        partitions.contains_key(&partition)
    }

    pub fn owned(&self) -> Vec<i32> {
        let partitions = self.partitions.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut owned: Vec<i32> = partitions.keys().copied().collect();
        owned.sort_unstable();
        owned
    }

    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    fn condition(&self, partition: i32) -> String {
        format!("{} partition {partition}", self.service)
    }

    fn begin_loading(&self, partition: i32) -> Loading<'_, L> {
        self.loading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(partition);
        Loading {
            registry: self,
            partition,
        }
    }

    fn set_condition(&self, partition: i32, reason: impl Into<String>) {
        self.readiness.set(self.condition(partition), reason);
    }

    /// Loading is part of every start and rebalance, not a fault.
    fn set_loading(&self, partition: i32) {
        self.readiness.set_expected(self.condition(partition), "loading");
    }

    fn clear_condition(&self, partition: i32) {
        self.readiness.clear(&self.condition(partition));
    }

    /// Whether the partition was not registered already.
    fn register(&self, partition: i32, epoch: i64, sender: mpsc::Sender<L>) -> bool {
        let mut partitions = self.partitions.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        let newly_owned = partitions
            .insert(partition, OwnedPartitionHandle { sender, epoch })
            .is_none();
        drop(partitions);
        self.started.notify_waiters();
        newly_owned
    }

    /// A partition's takeover is done. Once no partition is loading here
    /// (after a start or a rebalance), one line says how many partitions
    /// this instance owns and at which epochs; each partition's own lines
    /// are at debug. The partition is counted in the metrics after that
    /// line, so `sluice dev`, which prints its endpoints once every
    /// partition counts, prints them after it.
    fn taken_over(&self, newly_owned: bool) {
        self.log_owned_when_settled();
        if newly_owned {
            crate::metrics::metrics().partitions_owned_changed(self.service, 1);
        }
    }

    fn log_owned_when_settled(&self) {
        let loading = self
            .loading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .len();
        if loading > 0 {
            return;
        }
        let owned = self.owned_with_epochs();
        let lowest = owned.iter().map(|(_, epoch)| *epoch).min().unwrap_or_default();
        let highest = owned.iter().map(|(_, epoch)| *epoch).max().unwrap_or_default();
        let epochs = if lowest == highest {
            lowest.to_string()
        } else {
            format!("{lowest}-{highest}")
        };
        tracing::info!(service = self.service, partitions = owned.len(), %epochs, "partitions owned");
    }

    /// The partitions this instance owns, with the epoch it owns each at.
    pub fn owned_with_epochs(&self) -> Vec<(i32, i64)> {
        let partitions = self.partitions.read().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut owned: Vec<(i32, i64)> = partitions
            .iter()
            .map(|(partition, handle)| (*partition, handle.epoch))
            .collect();
        owned.sort_unstable();
        owned
    }

    fn unregister(&self, partition: i32, sender: &mpsc::Sender<L>) {
        let mut partitions = self.partitions.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if partitions
            .get(&partition)
            .is_some_and(|handle| handle.sender.same_channel(sender))
        {
            partitions.remove(&partition);
            crate::metrics::metrics().partitions_owned_changed(self.service, -1);
        }
    }
}

/// Settings of one owner runtime.
#[derive(Clone, Debug)]
pub struct OwnerSettings {
    pub service: &'static str,
    /// Unique per instance (logs and the owner directory).
    pub owner_id: String,
    /// The gRPC address other instances forward to.
    pub endpoint: String,
    pub max_batch: usize,
}

/// The factory the partitioned consumer calls for each assigned partition.
pub struct OwnerRuntime<S: OwnedStore> {
    store: Arc<S>,
    pool: PgPool,
    publisher: Publisher,
    links: Option<Arc<dyn LinkSink>>,
    registry: Arc<OwnerRegistry<<S::State as OwnedState>::Local>>,
    settings: OwnerSettings,
    faults: Faults,
}

impl<S: OwnedStore> OwnerRuntime<S> {
    pub fn new(
        store: Arc<S>,
        pool: PgPool,
        publisher: Publisher,
        registry: Arc<OwnerRegistry<<S::State as OwnedState>::Local>>,
        settings: OwnerSettings,
        faults: Faults,
    ) -> Self {
        OwnerRuntime {
            store,
            pool,
            publisher,
            links: None,
            registry,
            settings,
            faults,
        }
    }

    /// Where committed link entries go (the hot path's streams).
    pub fn with_links(mut self, links: Arc<dyn LinkSink>) -> Self {
        self.links = Some(links);
        self
    }
}

impl<S: OwnedStore> PartitionTaskFactory for OwnerRuntime<S> {
    fn start(&self, input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let task = PartitionTask {
            store: self.store.clone(),
            pool: self.pool.clone(),
            publisher: self.publisher.clone(),
            links: self.links.clone(),
            registry: self.registry.clone(),
            settings: self.settings.clone(),
            faults: self.faults.clone(),
        };
        task.run(input).boxed()
    }
}

struct PartitionTask<S: OwnedStore> {
    store: Arc<S>,
    pool: PgPool,
    publisher: Publisher,
    links: Option<Arc<dyn LinkSink>>,
    registry: Arc<OwnerRegistry<<S::State as OwnedState>::Local>>,
    settings: OwnerSettings,
    faults: Faults,
}

/// How often an owned partition checks that no newer owner took it over.
/// A commit finds out anyway; a partition with no input commits nothing,
/// and while it believes it owns the partition (its consumer still assigned
/// it after a rebalance that overlapped), nobody serves it: its callers are
/// sent to the newer owner's row, which has given it up.
const FENCE_CHECK_EVERY: Duration = Duration::from_secs(2);
/// How often a fenced task that still has the partition assigned looks at
/// whether the newer owner let it go.
const STANDBY_CHECK_EVERY: Duration = Duration::from_secs(1);
/// An owner whose row has not moved for this long (no commit, no idle
/// touch, which comes every `FENCE_CHECK_EVERY`: four of them missed) is gone: a member standing
/// by takes the partition over. The group reassigns a dead member's
/// partitions sooner (its session timeout); this covers a member that
/// still holds an assignment the group already gave away.
const OWNER_SILENT_AFTER: Duration = Duration::from_secs(8);
/// How often an owned partition publishes its keys for per-key metrics.
const KEY_STATS_EVERY: Duration = Duration::from_secs(1);
/// How long reading a partition's watermarks may take.
const WATERMARKS_TIMEOUT: Duration = Duration::from_secs(5);

enum Step<T> {
    Done(T),
    Stop,
}

/// How one ownership of a partition ended.
enum Ownership {
    /// Revoked, or the service stops.
    Ended,
    /// A newer owner took it over.
    Fenced,
}

/// Whether `messages` go back to or before an offset received earlier,
/// updating `last_received`.
fn went_back(last_received: &mut Option<i64>, messages: &[InMsg]) -> bool {
    let mut back = false;
    for message in messages {
        if last_received.is_some_and(|last| message.offset <= last) {
            back = true;
        }
        *last_received = Some(message.offset);
    }
    back
}

/// How one batch ended.
enum BatchEnd {
    Done,
    /// Fenced, or the partition was given up.
    Stop,
    /// It fails every time: its decision panicked, or PostgreSQL refuses its
    /// commit for what it holds. The state was reloaded; nothing of it is saved.
    Permanent(String),
}

impl<S: OwnedStore> PartitionTask<S> {
    /// Say this owner is alive (its row's `updated_at`, which commits move
    /// too), and whether a newer owner took the partition over while this
    /// one had no input. The task then stands by. A failed read is not a
    /// fence.
    async fn alive_or_fenced(&self, partition: i32, epoch: i64) -> bool {
        if self.faults.hit(FaultPoint::OwnerIdleFenceCheckMissed) {
            return false;
        }
        let touched: Result<Option<i64>, sqlx::Error> = sqlx::query_scalar(
            "UPDATE owners SET updated_at = now() WHERE partition = $1 AND epoch = $2 RETURNING epoch",
        )
        .bind(partition)
        .bind(epoch)
        .fetch_optional(&self.pool)
        .await;
        if !matches!(touched, Ok(None)) {
            return false;
        }
        match lookup_owner(&self.pool, partition).await {
            Ok(Some((endpoint, current))) if current > epoch => {
                tracing::warn!(
                    service = self.settings.service,
                    partition,
                    ours = epoch,
                    current,
                    %endpoint,
                    "fenced by a newer owner while idle"
                );
                true
            }
            _ => false,
        }
    }

    /// Own the partition while it is assigned here: take it over, serve
    /// it, and when a newer owner fences this one, stand by until that
    /// owner lets it go (or the group moves it away), then take it over
    /// again. Ownership moves only when the group moves the partition or
    /// its owner is gone, never back and forth between two members that
    /// both believe they hold it (an overlapping rebalance): the fenced one
    /// waits instead of fencing back.
    async fn run(self, mut input: PartitionInput) -> Result<(), PartitionTaskError> {
        let mut carried: Vec<InMsg> = Vec::new();
        loop {
            match self.own(&mut input, &mut carried).await? {
                Ownership::Ended => return Ok(()),
                Ownership::Fenced => {
                    if !self.stand_by(&input).await {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Wait while a newer owner holds the partition. True when it let the
    /// partition go (released it, or went silent: no commit and no touch of
    /// its row for `OWNER_SILENT_AFTER`) and this task should take it over
    /// again; false when the partition was revoked here or the service
    /// stops.
    async fn stand_by(&self, input: &PartitionInput) -> bool {
        let partition = input.partition;
        tracing::info!(
            service = self.settings.service,
            partition,
            "a newer owner holds the partition: standing by until it lets it go or the group moves it"
        );
        let assigned_before = input.assignments.count(partition);
        let mut check = tokio::time::interval(STANDBY_CHECK_EVERY);
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = input.stop.cancelled() => return false,
                _ = check.tick() => {}
            }
            if input.assignments.count(partition) > assigned_before {
                // The group assigned it here anew (its owner left the group,
                // say): this member is the one to own it.
                tracing::info!(
                    service = self.settings.service,
                    partition,
                    "the group assigned the partition here again; taking it over"
                );
                return true;
            }
            match owner_let_go(&self.pool, partition, OWNER_SILENT_AFTER).await {
                Ok(Some(why)) => {
                    tracing::info!(service = self.settings.service, partition, %why, "taking the partition over again");
                    return true;
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::debug!(service = self.settings.service, partition, %error, "reading the owner row failed; standing by");
                }
            }
        }
    }

    /// One ownership of the partition: take it over, then decide batch after
    /// batch until the partition is revoked (`Ended`) or a newer owner
    /// fences this one (`Fenced`; the input of the batch it was deciding is
    /// left in `carried`, to decide again if it takes the partition back).
    async fn own(&self, input: &mut PartitionInput, carried: &mut Vec<InMsg>) -> Result<Ownership, PartitionTaskError> {
        let partition = input.partition;
        self.registry.set_loading(partition);
        let loading = self.registry.begin_loading(partition);
        let (context, mut state, mut applied_offset) = match self.take_over(input).await {
            Step::Done(loaded) => loaded,
            Step::Stop => {
                self.registry.clear_condition(partition);
                return Ok(self.fenced_unless_stopped(input));
            }
        };
        self.registry.clear_condition(partition);

        let (local_sender, mut local_receiver) = mpsc::channel(1024);
        let newly_owned = self.registry.register(partition, context.epoch, local_sender.clone());
        drop(loading);
        tracing::debug!(
            service = self.settings.service,
            partition,
            epoch = context.epoch,
            applied_offset,
            "partition owned"
        );
        self.registry.taken_over(newly_owned);

        let mut last_received: Option<i64> = None;
        let mut last_key_stats = std::time::Instant::now() - KEY_STATS_EVERY;
        let mut fence_check = tokio::time::interval(FENCE_CHECK_EVERY);
        fence_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        fence_check.tick().await;
        let outcome = loop {
            let mut messages: Vec<InMsg> = std::mem::take(carried);
            let mut locals = Vec::new();
            if messages.is_empty() {
                let wakeup = state.next_wakeup_ms().map(|at| context.clock.instant_at(at));
                let sleep = async {
                    match wakeup {
                        Some(at) => tokio::time::sleep_until(at).await,
                        None => futures::future::pending::<()>().await,
                    }
                };
                tokio::select! {
                    biased;
                    _ = input.stop.cancelled() => break Ok(Ownership::Ended),
                    received = input.messages.recv() => match received {
                        Some(message) => messages.push(message),
                        None => break Ok(Ownership::Ended),
                    },
                    Some(local) = local_receiver.recv() => locals.push(local),
                    _ = sleep => {}
                    _ = fence_check.tick() => {
                        if self.alive_or_fenced(partition, context.epoch).await {
                            break Ok(Ownership::Fenced);
                        }
                        continue;
                    }
                }
            }
            self.fill_batch(input, &mut local_receiver, &mut messages, &mut locals);
            // The consumer only goes back when its position was reset (the
            // log it read is gone): see whether the log was lost.
            if went_back(&mut last_received, &messages) {
                match self
                    .adopt_if_log_lost(&context, &mut state, &mut applied_offset, input)
                    .await
                {
                    Step::Done(()) => {}
                    Step::Stop => {
                        *carried = messages;
                        break Ok(self.fenced_unless_stopped(input));
                    }
                }
            }
            let last_offset = messages.last().map(|message| message.offset);
            messages.retain(|message| message.offset > applied_offset);

            match self
                .process_batch(&context, &mut state, &mut applied_offset, &messages, locals, input)
                .await
            {
                Ok(Step::Done(())) => {}
                Ok(Step::Stop) => {
                    *carried = messages;
                    break Ok(self.fenced_unless_stopped(input));
                }
                Err(error) => break Err(error),
            }
            if let Some(offset) = last_offset {
                input.offsets.store(offset + 1);
            }
            if last_key_stats.elapsed() >= KEY_STATS_EVERY {
                last_key_stats = std::time::Instant::now();
                crate::metrics::metrics().publish_keys(self.settings.service, partition, Some(state.key_stats()));
            }
        };
        crate::metrics::metrics().publish_keys(self.settings.service, partition, None);
        self.registry.unregister(partition, &local_sender);
        self.registry.clear_condition(partition);
        if matches!(outcome, Ok(Ownership::Ended)) {
            // Given up in order (revoked, stopping): a member standing by
            // for it may take it at once.
            release(&self.pool, partition, context.epoch).await;
        }
        tracing::debug!(
            service = self.settings.service,
            partition,
            epoch = context.epoch,
            "partition released"
        );
        outcome
    }

    /// A batch or takeover gave the partition up: revoked or stopping, or
    /// fenced by a newer owner.
    fn fenced_unless_stopped(&self, input: &PartitionInput) -> Ownership {
        if input.stop.is_cancelled() {
            Ownership::Ended
        } else {
            Ownership::Fenced
        }
    }

    /// Add to a batch what is already waiting, without waiting: messages up
    /// to `max_batch` and the partition's byte budget, local requests up to
    /// `max_batch`.
    fn fill_batch(
        &self,
        input: &mut PartitionInput,
        local_receiver: &mut mpsc::Receiver<<S::State as OwnedState>::Local>,
        messages: &mut Vec<InMsg>,
        locals: &mut Vec<<S::State as OwnedState>::Local>,
    ) {
        let mut bytes: usize = messages.iter().map(InMsg::size).sum();
        while messages.len() + locals.len() < self.settings.max_batch && bytes < input.max_batch_bytes {
            match input.messages.try_recv() {
                Some(message) => {
                    bytes += message.size();
                    messages.push(message);
                }
                None => break,
            }
        }
        while locals.len() < self.settings.max_batch {
            match local_receiver.try_recv() {
                Ok(local) => locals.push(local),
                Err(_) => break,
            }
        }
    }

    /// Bump the epoch, load, adopt a new log if the old one is gone, re-send.
    /// Retries every error with backoff: a partition is never left unowned
    /// because loading failed once (readiness says so meanwhile).
    async fn take_over(&self, input: &PartitionInput) -> Step<(OwnerContext, S::State, i64)> {
        let partition = input.partition;
        let mut backoff = Backoff::new();
        loop {
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            match self.try_take_over(partition).await {
                Ok((context, mut state, mut applied_offset)) => {
                    match self
                        .adopt_if_log_lost(&context, &mut state, &mut applied_offset, input)
                        .await
                    {
                        Step::Done(()) => {}
                        Step::Stop => return Step::Stop,
                    }
                    let mut outbox = Outbox::new();
                    state.resend_all(context.clock.now_ms(), &mut outbox);
                    let resent = outbox.len();
                    match self.publish_until_done(outbox, input).await {
                        Step::Done(()) => {}
                        Step::Stop => return Step::Stop,
                    }
                    tracing::debug!(
                        service = self.settings.service,
                        partition,
                        resent,
                        "re-sent saved effects after takeover"
                    );
                    return Step::Done((context, state, applied_offset));
                }
                Err(error) => {
                    if classify_sql(&error).is_transient() {
                        tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition, %error, "takeover failed, retrying");
                    } else {
                        tracing::error!(service = self.settings.service, partition, %error, "takeover failed and will fail again until the cause is fixed; retrying");
                    }
                    self.registry
                        .set_condition(partition, format!("loading failed ({error}); retrying"));
                    backoff.wait().await;
                }
            }
        }
    }

    async fn try_take_over(&self, partition: i32) -> Result<(OwnerContext, S::State, i64), sqlx::Error> {
        let mut connection = self.pool.acquire().await?;
        let (epoch, applied_offset) = bump_epoch(
            &mut connection,
            partition,
            &self.settings.owner_id,
            &self.settings.endpoint,
        )
        .await?;
        let clock = AnchoredClock::from_postgres(&mut connection).await?;
        let context = OwnerContext {
            partition,
            epoch,
            clock,
        };
        let mut transaction = connection.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *transaction)
            .await?;
        let state = self.store.load(&mut transaction, &context).await?;
        transaction.commit().await?;
        Ok((context, state, applied_offset))
    }

    /// A partition whose log now ends at or below the offset this partition
    /// had applied was lost by the broker (an in-memory broker restarted, the
    /// topic deleted and created again): every new message would be skipped
    /// as already applied. Say so, adopt the new log (applied offset just
    /// below its first offset, saved fenced) and re-send from state.
    ///
    /// A broker whose high watermark is too low (tansu reports its last
    /// batch's base offset + 1) makes this replay the end of the old log,
    /// which commands' idempotence makes harmless.
    async fn adopt_if_log_lost(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        input: &PartitionInput,
    ) -> Step<()> {
        if *applied_offset < 0 {
            return Step::Done(());
        }
        let Some((low, high)) = input.offsets.watermarks(WATERMARKS_TIMEOUT).await else {
            return Step::Done(());
        };
        if high > *applied_offset {
            return Step::Done(());
        }
        // A log end at or below what was applied says the log was lost, or
        // the broker's high watermark is off (tansu's is): read the log at
        // that offset to know.
        match input.offsets.holds_offset(*applied_offset, WATERMARKS_TIMEOUT).await {
            Some(false) => {}
            Some(true) => {
                tracing::debug!(
                    service = self.settings.service,
                    topic = %input.topic,
                    partition = context.partition,
                    applied_offset = *applied_offset,
                    log_end = high,
                    "the broker's log end is below an offset it still holds; nothing was lost"
                );
                return Step::Done(());
            }
            None => {
                tracing::warn!(
                    service = self.settings.service,
                    topic = %input.topic,
                    partition = context.partition,
                    applied_offset = *applied_offset,
                    log_end = high,
                    "the broker's log end is below the applied offset and reading the log there failed; \
                     keeping the applied offset (checked again if the consumer goes back)"
                );
                return Step::Done(());
            }
        }
        let adopted = low.max(0) - 1;
        tracing::warn!(
            service = self.settings.service,
            topic = %input.topic,
            partition = context.partition,
            applied_offset = *applied_offset,
            log_start = low,
            log_end = high,
            "the partition's log ends at or below the offset this owner had applied: the broker lost the log \
             (restarted without storage, or the topic was created again); adopting the new log and re-sending \
             from state"
        );
        let mut backoff = Backoff::new();
        loop {
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            let saved = sqlx::query(
                "UPDATE owners SET applied_offset = $3, updated_at = now() WHERE partition = $1 AND epoch = $2",
            )
            .bind(context.partition)
            .bind(context.epoch)
            .bind(adopted)
            .execute(&self.pool)
            .await;
            match saved {
                Ok(result) if result.rows_affected() == 1 => break,
                Ok(_) => return Step::Stop,
                Err(error) => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition = context.partition, %error, "saving the adopted log's offset failed, retrying");
                    backoff.wait().await;
                }
            }
        }
        *applied_offset = adopted;
        let mut outbox = Outbox::new();
        state.resend_all(context.clock.now_ms(), &mut outbox);
        self.publish_until_done(outbox, input).await
    }

    /// One batch: decide, commit (fenced), publish, reply. A batch that fails
    /// every time is applied again in parts, and what still fails is set
    /// aside (`isolate`).
    async fn process_batch(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        messages: &[InMsg],
        locals: Vec<<S::State as OwnedState>::Local>,
        input: &PartitionInput,
    ) -> Result<Step<()>, PartitionTaskError> {
        let new_offset = messages.last().map(|message| message.offset);
        match self
            .run_batch(context, state, applied_offset, messages, locals, new_offset, input)
            .await?
        {
            BatchEnd::Done => Ok(Step::Done(())),
            BatchEnd::Stop => Ok(Step::Stop),
            BatchEnd::Permanent(reason) => {
                self.isolate(context, state, applied_offset, messages, input, reason)
                    .await
            }
        }
    }

    /// Apply a failed batch's messages one at a time; a message that still
    /// fails alone is applied one entry at a time, and an entry that fails
    /// alone is set aside. The local requests of the failed batch were
    /// answered with an error (their callers retry).
    async fn isolate(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        messages: &[InMsg],
        input: &PartitionInput,
        reason: String,
    ) -> Result<Step<()>, PartitionTaskError> {
        tracing::warn!(
            service = self.settings.service,
            partition = context.partition,
            messages = messages.len(),
            %reason,
            "a batch fails every time it is applied; applying it in parts to set aside what fails"
        );
        for message in messages {
            let single = std::slice::from_ref(message);
            let reason = match self
                .run_batch(
                    context,
                    state,
                    applied_offset,
                    single,
                    Vec::new(),
                    Some(message.offset),
                    input,
                )
                .await?
            {
                BatchEnd::Done => continue,
                BatchEnd::Stop => return Ok(Step::Stop),
                BatchEnd::Permanent(reason) => reason,
            };
            let payload = message.payload.as_deref().unwrap_or_default();
            let entries: Vec<&[u8]> = batch_entries(payload).unwrap_or_default();
            if entries.len() <= 1 {
                let whole = Rejected {
                    offset: message.offset,
                    entry: payload.to_vec(),
                    reason,
                };
                match self
                    .quarantine(context, applied_offset, vec![whole], Some(message.offset), input)
                    .await
                {
                    Step::Done(()) => continue,
                    Step::Stop => return Ok(Step::Stop),
                }
            }
            let count = entries.len();
            for (index, entry) in entries.into_iter().enumerate() {
                // Only the last entry saves the message's offset: a crash in
                // between re-applies the message, and commands are idempotent.
                let new_offset = (index + 1 == count).then_some(message.offset);
                let part = InMsg {
                    payload: Some(single_entry_batch(entry)),
                    ..message.clone()
                };
                match self
                    .run_batch(context, state, applied_offset, &[part], Vec::new(), new_offset, input)
                    .await?
                {
                    BatchEnd::Done => {}
                    BatchEnd::Stop => return Ok(Step::Stop),
                    BatchEnd::Permanent(reason) => {
                        let rejected = Rejected {
                            offset: message.offset,
                            entry: entry.to_vec(),
                            reason,
                        };
                        if let Step::Stop = self
                            .quarantine(context, applied_offset, vec![rejected], new_offset, input)
                            .await
                        {
                            return Ok(Step::Stop);
                        }
                    }
                }
            }
        }
        Ok(Step::Done(()))
    }

    /// Decide, commit, publish and reply for `messages` and `locals`, saving
    /// `new_offset` as applied. Faults that pass are retried here.
    #[allow(clippy::too_many_arguments)]
    async fn run_batch(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        messages: &[InMsg],
        locals: Vec<<S::State as OwnedState>::Local>,
        new_offset: Option<i64>,
        input: &PartitionInput,
    ) -> Result<BatchEnd, PartitionTaskError> {
        let partition = context.partition;
        let mut locals = Some(locals);
        let mut backoff = Backoff::new();
        loop {
            let mut writes = <S::State as OwnedState>::Writes::default();
            let mut outbox = Outbox::new();
            let mut replies: Vec<Reply> = Vec::new();
            let mut rejected: Vec<Rejected> = Vec::new();
            let batch_locals = match self
                .prepare_until_done(
                    partition,
                    state,
                    messages,
                    locals.take().unwrap_or_default(),
                    input,
                    &mut backoff,
                )
                .await
            {
                Ok(batch_locals) => batch_locals,
                Err(end) => return Ok(end),
            };
            let now_ms = context.clock.now_ms();
            let decided = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                state.apply(
                    now_ms,
                    messages,
                    batch_locals,
                    &mut writes,
                    &mut outbox,
                    &mut replies,
                    &mut rejected,
                );
            }));
            if let Err(panic) = decided {
                let reason = format!("panicked while applying: {}", panic_message(panic.as_ref()));
                tracing::error!(service = self.settings.service, partition, %reason, "applying a batch panicked; reloading the partition");
                drop(replies);
                return Ok(match self.reload_until_done(context, state, input).await {
                    Step::Done(_) => BatchEnd::Permanent(reason),
                    Step::Stop => BatchEnd::Stop,
                });
            }
            if writes.is_empty() && outbox.is_empty() && replies.is_empty() && rejected.is_empty() {
                return Ok(BatchEnd::Done);
            }
            // Every batch that answers or sends anything is committed fenced,
            // also when it writes nothing (an answer read from memory, a
            // re-sent grant): the fence proves this instance still owns the
            // partition, so its memory is the latest saved state. An owner
            // fenced while idle answered from a state a newer owner had
            // already changed (a `Complete` answered STALE for a claim the
            // new owner had made: the job ran twice). docs/architecture.md,
            // "Answers follow commits".
            {
                let started = std::time::Instant::now();
                match self.commit(context, writes, &rejected, &input.topic, new_offset).await {
                    Ok(()) => {
                        crate::metrics::metrics().commit_seconds.record(
                            started.elapsed().as_secs_f64(),
                            &[opentelemetry::KeyValue::new("service", self.settings.service)],
                        );
                        if let Some(offset) = new_offset {
                            *applied_offset = offset;
                        }
                        self.registry.clear_condition(partition);
                        report_quarantined(self.settings.service, &input.topic, partition, &rejected);
                    }
                    Err(CommitError::Fenced { current, ours, .. }) => {
                        tracing::warn!(
                            service = self.settings.service,
                            partition,
                            ours,
                            current,
                            "fenced by a newer owner; giving the partition up"
                        );
                        return Ok(BatchEnd::Stop);
                    }
                    Err(CommitError::Sql(error)) => {
                        // Local requests of the batch get an error.
                        drop(replies);
                        match self
                            .recover_from_failed_commit(
                                context,
                                state,
                                applied_offset,
                                new_offset,
                                input,
                                error,
                                &mut backoff,
                            )
                            .await
                        {
                            Some(end) => return Ok(end),
                            None => continue,
                        }
                    }
                }
                if state.crash_after_commit() || self.faults.hit(FaultPoint::OwnerAfterCommitBeforePublish) {
                    return Err(PartitionTaskError::Crashed);
                }
            }
            return self.publish_committed(outbox, replies, input).await;
        }
    }

    /// Read what a batch needs from PostgreSQL into the state, retrying
    /// what fails for a reason that passes; hands `locals` back. `Err`: how
    /// the batch ends.
    async fn prepare_until_done(
        &self,
        partition: i32,
        state: &mut S::State,
        messages: &[InMsg],
        locals: Vec<<S::State as OwnedState>::Local>,
        input: &PartitionInput,
        backoff: &mut Backoff,
    ) -> Result<Vec<<S::State as OwnedState>::Local>, BatchEnd> {
        loop {
            match self.store.prepare(&self.pool, state, messages, &locals).await {
                Ok(prepared) => {
                    state.prepared(prepared);
                    return Ok(locals);
                }
                Err(error) if classify_sql(&error).is_transient() => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition, %error, "reading for a batch failed; retrying");
                    self.note_transient(partition, format!("database: {error}"));
                    if input.stop.is_cancelled() {
                        return Err(BatchEnd::Stop);
                    }
                    backoff.wait().await;
                }
                Err(error) => {
                    return Err(BatchEnd::Permanent(format!(
                        "PostgreSQL refuses the reads this batch needs: {error}"
                    )));
                }
            }
        }
    }

    /// A batch's commit failed. The in-memory state holds the batch's
    /// uncommitted decisions: rebuild it from PostgreSQL, then say how the
    /// batch ends, or `None` to decide it again (a fault that passes; one
    /// that does not ends it as permanent, and the caller decides its
    /// messages in parts).
    #[allow(clippy::too_many_arguments)]
    async fn recover_from_failed_commit(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        new_offset: Option<i64>,
        input: &PartitionInput,
        error: sqlx::Error,
        backoff: &mut Backoff,
    ) -> Option<BatchEnd> {
        let partition = context.partition;
        let transient = classify_sql(&error).is_transient();
        if transient {
            tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition, %error, "batch commit failed; retrying");
            self.note_transient(partition, format!("database: {error}"));
            backoff.wait().await;
        } else {
            tracing::error!(service = self.settings.service, partition, %error, "PostgreSQL refuses the batch's commit");
        }
        let reloaded_offset = match self.reload_until_done(context, state, input).await {
            Step::Done(reloaded_offset) => reloaded_offset,
            Step::Stop => return Some(BatchEnd::Stop),
        };
        // The saved offset shows whether a batch of Kafka input went through
        // after all. A batch without Kafka input (timers, local requests)
        // leaves no such trace and may have gone through too; deciding it
        // again would then find nothing to do and its messages would never
        // be sent. In both cases what the reloaded state holds is sent again
        // (every receiver ignores a repeat).
        let committed_anyway = new_offset.is_some_and(|offset| reloaded_offset >= offset);
        if committed_anyway || new_offset.is_none() {
            if committed_anyway {
                *applied_offset = reloaded_offset;
            }
            let mut outbox = Outbox::new();
            state.resend_all(context.clock.now_ms(), &mut outbox);
            if let Step::Stop = self.publish_until_done(outbox, input).await {
                return Some(BatchEnd::Stop);
            }
            if committed_anyway {
                return Some(BatchEnd::Done);
            }
        }
        if !transient {
            return Some(BatchEnd::Permanent(format!("PostgreSQL refused the commit: {error}")));
        }
        None
    }

    /// After the commit (or with nothing to commit): record what was
    /// decided, publish it, then answer the batch's local requests.
    async fn publish_committed(
        &self,
        mut outbox: Outbox,
        replies: Vec<Reply>,
        input: &PartitionInput,
    ) -> Result<BatchEnd, PartitionTaskError> {
        outbox.take_observations().record();
        let published_from = std::time::Instant::now();
        if let Step::Stop = self.publish_until_done(outbox, input).await {
            return Ok(BatchEnd::Stop);
        }
        crate::metrics::metrics().publish_seconds.record(
            published_from.elapsed().as_secs_f64(),
            &[opentelemetry::KeyValue::new("service", self.settings.service)],
        );
        if self.faults.hit(FaultPoint::OwnerAfterPublishBeforeOffsetStore) {
            return Err(PartitionTaskError::Crashed);
        }
        for reply in replies {
            reply();
        }
        Ok(BatchEnd::Done)
    }

    fn note_transient(&self, partition: i32, reason: String) {
        self.registry.set_condition(partition, reason);
        crate::metrics::metrics()
            .transient_faults
            .add(1, &[opentelemetry::KeyValue::new("service", self.settings.service)]);
    }

    /// Set `rejected` aside (fenced, saving `new_offset` as applied).
    async fn quarantine(
        &self,
        context: &OwnerContext,
        applied_offset: &mut i64,
        rejected: Vec<Rejected>,
        new_offset: Option<i64>,
        input: &PartitionInput,
    ) -> Step<()> {
        // What the store sends elsewhere (dead letters) goes first; the
        // applied offset is saved after, with the rest.
        let mut redirected = Outbox::new();
        let mut kept: Vec<Rejected> = Vec::with_capacity(rejected.len());
        for entry in rejected {
            match self.store.redirect_rejected(&input.topic, context.partition, &entry) {
                Some(message) => {
                    tracing::error!(
                        service = self.settings.service,
                        partition = context.partition,
                        offset = entry.offset,
                        reason = %clean_text(&entry.reason, 2048),
                        topic = %message.topic,
                        "input that can never be applied, sent on instead of set aside"
                    );
                    redirected.push(message);
                }
                None => kept.push(entry),
            }
        }
        if let Step::Stop = self.publish_until_done(redirected, input).await {
            return Step::Stop;
        }
        let rejected = kept;
        let mut backoff = Backoff::new();
        loop {
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            let committed = self
                .commit(
                    context,
                    <S::State as OwnedState>::Writes::default(),
                    &rejected,
                    &input.topic,
                    new_offset,
                )
                .await;
            match committed {
                Ok(()) => {
                    if let Some(offset) = new_offset {
                        *applied_offset = offset;
                    }
                    self.registry.clear_condition(context.partition);
                    report_quarantined(self.settings.service, &input.topic, context.partition, &rejected);
                    return Step::Done(());
                }
                Err(CommitError::Fenced { .. }) => return Step::Stop,
                Err(CommitError::Sql(error)) => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition = context.partition, %error, "setting input aside failed; retrying");
                    self.note_transient(context.partition, format!("database: {error}"));
                    backoff.wait().await;
                }
            }
        }
    }

    async fn commit(
        &self,
        context: &OwnerContext,
        writes: <S::State as OwnedState>::Writes,
        rejected: &[Rejected],
        topic: &str,
        new_offset: Option<i64>,
    ) -> Result<(), CommitError> {
        if !writes.is_empty() && self.faults.hit(FaultPoint::OwnerCommitRefused) {
            return Err(CommitError::Sql(crate::faults::refused_by_storage()));
        }
        if rejected.is_empty() {
            let statement = if writes.is_empty() {
                // The fence alone: one statement.
                Some(FencedStatement::default())
            } else {
                self.store.one_statement(&writes)
            };
            if let Some(statement) = statement {
                return commit_fenced(&self.pool, context.partition, context.epoch, new_offset, statement).await;
            }
        }
        let mut transaction = self.pool.begin().await?;
        fence_and_advance(&mut transaction, context.partition, context.epoch, new_offset).await?;
        if !writes.is_empty() {
            self.store.persist(&mut transaction, context, writes).await?;
        }
        insert_quarantined(&mut transaction, topic, context.partition, rejected).await?;
        transaction.commit().await?;
        Ok(())
    }

    /// Replace `state` with what is saved (without bumping the epoch),
    /// retrying until it works. Returns the saved applied offset; `Stop`
    /// when fenced or stopping.
    async fn reload_until_done(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        input: &PartitionInput,
    ) -> Step<i64> {
        let mut backoff = Backoff::new();
        loop {
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            match self.reload(context).await {
                Ok(Some((reloaded, applied_offset))) => {
                    *state = reloaded;
                    return Step::Done(applied_offset);
                }
                Ok(None) => return Step::Stop,
                Err(error) => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition = context.partition, %error, "reload failed; retrying");
                    self.note_transient(context.partition, format!("reloading: {error}"));
                    backoff.wait().await;
                }
            }
        }
    }

    /// Reload the state without bumping the epoch. `None` when fenced.
    async fn reload(&self, context: &OwnerContext) -> Result<Option<(S::State, i64)>, sqlx::Error> {
        let mut transaction = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *transaction)
            .await?;
        let row: Option<(i64, i64)> = sqlx::query_as("SELECT epoch, applied_offset FROM owners WHERE partition = $1")
            .bind(context.partition)
            .fetch_optional(&mut *transaction)
            .await?;
        let Some((epoch, applied_offset)) = row else {
            return Ok(None);
        };
        if epoch != context.epoch {
            return Ok(None);
        }
        let state = self.store.load(&mut transaction, context).await?;
        transaction.commit().await?;
        Ok(Some((state, applied_offset)))
    }

    /// Publish, retrying what fails for a reason that passes until it works
    /// or the partition is given up (the next owner re-sends from the saved
    /// state). A message the broker refuses for what it is (too large) can
    /// never be sent: it is set aside in the quarantine table with the reason,
    /// so nothing is dropped silently.
    async fn publish_until_done(&self, mut outbox: Outbox, input: &PartitionInput) -> Step<()> {
        let links = outbox.take_links();
        if !links.is_empty() {
            match &self.links {
                Some(sink) => sink.deliver(links).await,
                None => tracing::error!(
                    service = self.settings.service,
                    partition = input.partition,
                    "link entries but no link sink; dropped"
                ),
            }
        }
        if outbox.is_empty() {
            return Step::Done(());
        }
        let spans = outbox.take_spans();
        let mut pending = outbox.into_messages();
        for (index, span) in spans {
            if let Some(message) = pending.get_mut(index) {
                crate::telemetry::record_send_span(&mut message.headers, &span);
            }
        }
        let mut backoff = Backoff::new();
        let condition = format!(
            "{} publishing from partition {}",
            self.settings.service, input.partition
        );
        loop {
            let results = self.publisher.send_each(&pending).await;
            let mut failed: Vec<OutMsg> = Vec::new();
            let mut refused: Vec<(OutMsg, String)> = Vec::new();
            let mut last_error = None;
            for (result, message) in results.into_iter().zip(pending) {
                match result {
                    Ok(()) => {}
                    Err(error) if classify_kafka(&error).is_transient() => {
                        last_error = Some(error.to_string());
                        failed.push(message);
                    }
                    Err(error) => refused.push((message, error.to_string())),
                }
            }
            if !refused.is_empty() {
                self.quarantine_refused(input, refused).await;
            }
            if failed.is_empty() {
                self.registry.readiness().clear(&condition);
                return Step::Done(());
            }
            let error = last_error.unwrap_or_default();
            tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition = input.partition, %error, messages = failed.len(), "publish failed, retrying");
            self.registry
                .readiness()
                .set(condition.clone(), format!("publishing failed: {error}"));
            if input.stop.is_cancelled() {
                self.registry.readiness().clear(&condition);
                return Step::Stop;
            }
            backoff.wait().await;
            pending = failed;
        }
    }

    /// Outgoing messages the broker refuses for what they are: saved with
    /// the reason (not fenced: it is a record, not a decision).
    async fn quarantine_refused(&self, input: &PartitionInput, refused: Vec<(OutMsg, String)>) {
        for (message, error) in refused {
            let rejected = Rejected {
                offset: -1,
                entry: message.payload,
                reason: format!("the broker refused this message for {} ({error})", message.topic),
            };
            let mut backoff = Backoff::new();
            loop {
                let saved = async {
                    let mut connection = self.pool.acquire().await?;
                    insert_quarantined(
                        &mut connection,
                        &message.topic,
                        input.partition,
                        std::slice::from_ref(&rejected),
                    )
                    .await
                }
                .await;
                match saved {
                    Ok(()) => {
                        report_quarantined(
                            self.settings.service,
                            &message.topic,
                            input.partition,
                            std::slice::from_ref(&rejected),
                        );
                        break;
                    }
                    Err(error) if input.stop.is_cancelled() => {
                        tracing::error!(service = self.settings.service, %error, reason = %rejected.reason, "could not set a refused message aside before stopping");
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, %error, "setting a refused message aside failed; retrying");
                        backoff.wait().await;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
        let registry: Arc<OwnerRegistry<tokio::sync::oneshot::Sender<u32>>> =
            OwnerRegistry::new("test", Readiness::new());
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
        let reply = receiver.recv().await.unwrap();
        reply.send(42).unwrap();
        assert_eq!(caller.await.unwrap().unwrap(), 42);
    }

    #[tokio::test]
    async fn a_partition_that_stops_loading_without_starting_is_not_owned() {
        let registry: Arc<OwnerRegistry<tokio::sync::oneshot::Sender<u32>>> =
            OwnerRegistry::new("test", Readiness::new());
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
        assert!(matches!(first_queue.recv().await, Some(TestLocal::Work(7))));
        let Some(TestLocal::Barrier(first_reply)) = first_queue.recv().await else {
            panic!("partition 1 got no barrier");
        };
        tokio::task::yield_now().await;
        assert!(!barrier.is_finished(), "passed before partition 1 answered");
        first_reply.send(()).unwrap();
        let Some(TestLocal::Barrier(second_reply)) = second_queue.recv().await else {
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
}
