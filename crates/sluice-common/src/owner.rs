//! The owner runtime of DESIGN.md, written once for limit-grant, rate-window
//! and refresh-dispatcher.
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
//! skips input whose effects are already saved.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;
use futures::future::BoxFuture;
use futures::FutureExt;
use sqlx::{Connection, PgConnection, PgPool};
use tokio::sync::{mpsc, watch};

use crate::clock::AnchoredClock;
use crate::faults::{FaultPoint, Faults};
use crate::kafka::{InMsg, Outbox, PartitionInput, PartitionTaskError, PartitionTaskFactory, Publisher};
use crate::storage::is_transient_sql;

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

/// Input that cannot be processed: the partition stops and alerts rather
/// than skip it (internal messages are never dropped silently).
#[derive(Debug, thiserror::Error)]
#[error("partition {partition} offset {offset}: {reason}")]
pub struct InputError {
    pub partition: i32,
    pub offset: i64,
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

    /// Advance to `now_ms` (timers), then apply `messages` and `locals` in
    /// order, recording writes, effects and replies.
    fn apply(
        &mut self,
        now_ms: i64,
        messages: &[InMsg],
        locals: Vec<Self::Local>,
        writes: &mut Self::Writes,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
    ) -> Result<(), InputError>;

    /// Every effect the saved state implies, for a new owner to re-send.
    fn resend_all(&self, now_ms: i64, outbox: &mut Outbox);

    /// When `apply` must run next even without input (lease expiry, slots).
    fn next_wakeup_ms(&self) -> Option<i64>;

    /// The partition's keys, for per-key metrics (bounded by configuration).
    fn key_stats(&self) -> Vec<crate::metrics::KeyStat> {
        Vec::new()
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
                owned_since = now(), updated_at = now()
         RETURNING epoch, applied_offset",
    )
    .bind(partition)
    .bind(owner_id)
    .bind(endpoint)
    .fetch_one(connection)
    .await?;
    Ok(row)
}

/// Inside a batch transaction: lock the partition's row and refuse if another
/// owner has bumped the epoch since we took over.
pub async fn check_epoch(connection: &mut PgConnection, partition: i32, epoch: i64) -> Result<(), CommitError> {
    let current: Option<i64> = sqlx::query_scalar("SELECT epoch FROM owners WHERE partition = $1 FOR UPDATE")
        .bind(partition)
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

/// Where a local request can reach the partition task that owns it.
pub struct OwnedPartitionHandle<L> {
    sender: mpsc::Sender<L>,
}

/// Partitions this instance owns and is ready to serve, and readiness.
pub struct OwnerRegistry<L> {
    partitions: RwLock<HashMap<i32, OwnedPartitionHandle<L>>>,
    loading: Mutex<HashMap<i32, u32>>,
    stopped: Mutex<HashMap<i32, String>>,
    ready_sender: watch::Sender<bool>,
}

#[derive(Debug, thiserror::Error)]
pub enum LocalCallError {
    #[error("partition {0} is not owned by this instance")]
    NotOwner(i32),
    #[error("partition {0} stopped before answering; retry")]
    Interrupted(i32),
}

impl<L: Send + 'static> OwnerRegistry<L> {
    pub fn new() -> Arc<Self> {
        let (ready_sender, _) = watch::channel(true);
        Arc::new(OwnerRegistry {
            partitions: RwLock::new(HashMap::new()),
            loading: Mutex::new(HashMap::new()),
            stopped: Mutex::new(HashMap::new()),
            ready_sender,
        })
    }

    /// Send a request to the partition task, if this instance owns it.
    pub async fn call<R>(
        &self,
        partition: i32,
        make: impl FnOnce(tokio::sync::oneshot::Sender<R>) -> L,
    ) -> Result<R, LocalCallError> {
        let sender = {
            let partitions = self.partitions.read().unwrap_or_else(|poisoned| poisoned.into_inner());
            match partitions.get(&partition) {
                Some(handle) => handle.sender.clone(),
                None => return Err(LocalCallError::NotOwner(partition)),
            }
        };
        let (reply_sender, reply_receiver) = tokio::sync::oneshot::channel();
        sender
            .send(make(reply_sender))
            .await
            .map_err(|_| LocalCallError::NotOwner(partition))?;
        reply_receiver.await.map_err(|_| LocalCallError::Interrupted(partition))
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

    /// False while any owned partition is rebuilding, or has stopped.
    pub fn is_ready(&self) -> bool {
        let loading = self.loading.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let stopped = self.stopped.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        loading.is_empty() && stopped.is_empty()
    }

    pub fn watch_ready(&self) -> watch::Receiver<bool> {
        self.ready_sender.subscribe()
    }

    pub fn stopped_partitions(&self) -> Vec<(i32, String)> {
        let stopped = self.stopped.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        stopped
            .iter()
            .map(|(partition, reason)| (*partition, reason.clone()))
            .collect()
    }

    fn publish_ready(&self) {
        let ready = self.is_ready();
        self.ready_sender.send_if_modified(|current| {
            let changed = *current != ready;
            *current = ready;
            changed
        });
    }

    fn begin_loading(&self, partition: i32) {
        {
            let mut loading = self.loading.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            *loading.entry(partition).or_default() += 1;
            let mut stopped = self.stopped.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            stopped.remove(&partition);
        }
        self.publish_ready();
    }

    fn end_loading(&self, partition: i32) {
        {
            let mut loading = self.loading.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            if let Some(count) = loading.get_mut(&partition) {
                *count -= 1;
                if *count == 0 {
                    loading.remove(&partition);
                }
            }
        }
        self.publish_ready();
    }

    fn register(&self, partition: i32, sender: mpsc::Sender<L>) {
        let mut partitions = self.partitions.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        partitions.insert(partition, OwnedPartitionHandle { sender });
    }

    fn unregister(&self, partition: i32, sender: &mpsc::Sender<L>) {
        let mut partitions = self.partitions.write().unwrap_or_else(|poisoned| poisoned.into_inner());
        if partitions
            .get(&partition)
            .is_some_and(|handle| handle.sender.same_channel(sender))
        {
            partitions.remove(&partition);
        }
    }

    fn mark_stopped(&self, partition: i32, reason: String) {
        {
            let mut stopped = self.stopped.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            stopped.insert(partition, reason);
        }
        self.publish_ready();
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
            registry,
            settings,
            faults,
        }
    }
}

impl<S: OwnedStore> PartitionTaskFactory for OwnerRuntime<S> {
    fn start(&self, input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let task = PartitionTask {
            store: self.store.clone(),
            pool: self.pool.clone(),
            publisher: self.publisher.clone(),
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
    registry: Arc<OwnerRegistry<<S::State as OwnedState>::Local>>,
    settings: OwnerSettings,
    faults: Faults,
}

const RETRY_FIRST: Duration = Duration::from_millis(100);
/// How often an owned partition publishes its keys for per-key metrics.
const KEY_STATS_EVERY: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(5);

enum Step<T> {
    Done(T),
    Stop,
}

impl<S: OwnedStore> PartitionTask<S> {
    async fn run(self, mut input: PartitionInput) -> Result<(), PartitionTaskError> {
        let partition = input.partition;
        self.registry.begin_loading(partition);
        let taken_over = self.take_over(&input).await;
        self.registry.end_loading(partition);
        let (context, mut state, mut applied_offset) = match taken_over {
            Ok(Step::Done(loaded)) => loaded,
            Ok(Step::Stop) => return Ok(()),
            Err(error) => {
                self.registry.mark_stopped(partition, error.to_string());
                return Err(error);
            }
        };

        let (local_sender, mut local_receiver) = mpsc::channel(1024);
        self.registry.register(partition, local_sender.clone());
        tracing::info!(
            service = self.settings.service,
            partition,
            epoch = context.epoch,
            applied_offset,
            "partition owned"
        );

        let mut last_key_stats = std::time::Instant::now() - KEY_STATS_EVERY;
        let outcome = loop {
            let mut messages: Vec<InMsg> = Vec::new();
            let mut locals = Vec::new();
            let wakeup = state.next_wakeup_ms().map(|at| context.clock.instant_at(at));
            let sleep = async {
                match wakeup {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => futures::future::pending::<()>().await,
                }
            };
            tokio::select! {
                biased;
                _ = input.stop.cancelled() => break Ok(()),
                received = input.messages.recv() => match received {
                    Some(message) => messages.push(message),
                    None => break Ok(()),
                },
                Some(local) = local_receiver.recv() => locals.push(local),
                _ = sleep => {}
            }
            while messages.len() + locals.len() < self.settings.max_batch {
                match input.messages.try_recv() {
                    Ok(message) => messages.push(message),
                    Err(_) => break,
                }
            }
            while locals.len() < self.settings.max_batch {
                match local_receiver.try_recv() {
                    Ok(local) => locals.push(local),
                    Err(_) => break,
                }
            }
            let last_offset = messages.last().map(|message| message.offset);
            messages.retain(|message| message.offset > applied_offset);

            match self
                .process_batch(&context, &mut state, &mut applied_offset, &messages, locals, &input)
                .await
            {
                Ok(Step::Done(())) => {}
                Ok(Step::Stop) => break Ok(()),
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
        if let Err(PartitionTaskError::Stopped { reason, .. }) = &outcome {
            self.registry.mark_stopped(partition, reason.clone());
        }
        tracing::info!(
            service = self.settings.service,
            partition,
            epoch = context.epoch,
            "partition released"
        );
        outcome
    }

    /// Bump the epoch, load, re-send. Retries transient database errors.
    async fn take_over(
        &self,
        input: &PartitionInput,
    ) -> Result<Step<(OwnerContext, S::State, i64)>, PartitionTaskError> {
        let partition = input.partition;
        let mut delay = RETRY_FIRST;
        loop {
            if input.stop.is_cancelled() {
                return Ok(Step::Stop);
            }
            match self.try_take_over(partition).await {
                Ok((context, state, applied_offset)) => {
                    let mut outbox = Outbox::new();
                    state.resend_all(context.clock.now_ms(), &mut outbox);
                    let resent = outbox.len();
                    match self.publish_until_done(outbox, input).await {
                        Step::Done(()) => {}
                        Step::Stop => return Ok(Step::Stop),
                    }
                    tracing::info!(
                        service = self.settings.service,
                        partition,
                        resent,
                        "re-sent saved effects after takeover"
                    );
                    return Ok(Step::Done((context, state, applied_offset)));
                }
                Err(error) if is_transient_sql(&error) => {
                    tracing::warn!(service = self.settings.service, partition, %error, "takeover failed, retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
                Err(error) => {
                    return Err(PartitionTaskError::Stopped {
                        partition,
                        reason: format!("takeover failed: {error}"),
                    })
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

    /// One batch: decide, commit (fenced), publish, reply.
    async fn process_batch(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        messages: &[InMsg],
        locals: Vec<<S::State as OwnedState>::Local>,
        input: &PartitionInput,
    ) -> Result<Step<()>, PartitionTaskError> {
        let partition = context.partition;
        let mut locals = Some(locals);
        let mut delay = RETRY_FIRST;
        loop {
            let mut writes = <S::State as OwnedState>::Writes::default();
            let mut outbox = Outbox::new();
            let mut replies: Vec<Reply> = Vec::new();
            let now_ms = context.clock.now_ms();
            state
                .apply(
                    now_ms,
                    messages,
                    locals.take().unwrap_or_default(),
                    &mut writes,
                    &mut outbox,
                    &mut replies,
                )
                .map_err(|error| PartitionTaskError::Stopped {
                    partition,
                    reason: error.to_string(),
                })?;
            let new_offset = messages.last().map(|message| message.offset);
            if writes.is_empty() && outbox.is_empty() && replies.is_empty() {
                return Ok(Step::Done(()));
            }
            let started = std::time::Instant::now();
            if !writes.is_empty() {
                match self.commit(context, writes, new_offset).await {
                    Ok(()) => {
                        crate::metrics::metrics().commit_seconds.record(
                            started.elapsed().as_secs_f64(),
                            &[opentelemetry::KeyValue::new("service", self.settings.service)],
                        );
                        if let Some(offset) = new_offset {
                            *applied_offset = offset;
                        }
                    }
                    Err(CommitError::Fenced { current, ours, .. }) => {
                        tracing::warn!(
                            service = self.settings.service,
                            partition,
                            ours,
                            current,
                            "fenced by a newer owner; giving the partition up"
                        );
                        return Ok(Step::Stop);
                    }
                    Err(CommitError::Sql(error)) => {
                        // The in-memory state holds this batch's uncommitted
                        // decisions: rebuild it from PostgreSQL and decide again.
                        // Local requests of the failed batch get an error.
                        tracing::warn!(service = self.settings.service, partition, %error, "batch commit failed; reloading");
                        drop(replies);
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(RETRY_MAX);
                        if input.stop.is_cancelled() {
                            return Ok(Step::Stop);
                        }
                        match self.reload(context).await {
                            Ok(Some((reloaded, reloaded_offset))) => {
                                *state = reloaded;
                                if reloaded_offset >= new_offset.unwrap_or(i64::MIN) {
                                    // The commit had gone through after all.
                                    *applied_offset = reloaded_offset;
                                    let mut outbox = Outbox::new();
                                    state.resend_all(context.clock.now_ms(), &mut outbox);
                                    return Ok(self.publish_until_done(outbox, input).await);
                                }
                            }
                            Ok(None) => return Ok(Step::Stop),
                            Err(error) => {
                                tracing::warn!(service = self.settings.service, partition, %error, "reload failed");
                            }
                        }
                        continue;
                    }
                }
                if self.faults.hit(FaultPoint::OwnerAfterCommitBeforePublish) {
                    return Err(PartitionTaskError::Crashed);
                }
            }
            let published_from = std::time::Instant::now();
            match self.publish_until_done(outbox, input).await {
                Step::Done(()) => {}
                Step::Stop => return Ok(Step::Stop),
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
            return Ok(Step::Done(()));
        }
    }

    async fn commit(
        &self,
        context: &OwnerContext,
        writes: <S::State as OwnedState>::Writes,
        new_offset: Option<i64>,
    ) -> Result<(), CommitError> {
        let mut transaction = self.pool.begin().await?;
        check_epoch(&mut transaction, context.partition, context.epoch).await?;
        self.store.persist(&mut transaction, context, writes).await?;
        if let Some(offset) = new_offset {
            sqlx::query("UPDATE owners SET applied_offset = GREATEST(applied_offset, $2), updated_at = now() WHERE partition = $1")
                .bind(context.partition)
                .bind(offset)
                .execute(&mut *transaction)
                .await?;
        }
        transaction.commit().await?;
        Ok(())
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

    /// Publish, retrying until it works or the partition is given up (the
    /// next owner re-sends from the saved state).
    async fn publish_until_done(&self, outbox: Outbox, input: &PartitionInput) -> Step<()> {
        if outbox.is_empty() {
            return Step::Done(());
        }
        let messages = outbox.into_messages();
        let mut delay = RETRY_FIRST;
        loop {
            match self.publisher.send_all(messages.clone()).await {
                Ok(()) => return Step::Done(()),
                Err(error) => {
                    tracing::warn!(service = self.settings.service, partition = input.partition, %error, "publish failed, retrying");
                    if input.stop.is_cancelled() {
                        return Step::Stop;
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
    }
}
