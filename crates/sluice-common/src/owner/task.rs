//! The owner runtime (`OwnerRuntime`) and one partition task's life: take
//! the partition over, own it batch after batch, stand by when fenced.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use sqlx::PgPool;
use tokio::sync::mpsc;

use super::fence::{live_other_owner, orphaned_partitions, release};
use super::registry::{Loading, Received};
use super::{lookup_owner, owner_let_go, OwnedState, OwnedStore, OwnerContext, OwnerRegistry};
use crate::faults::{FaultPoint, Faults};
use crate::kafka::{InMsg, Orphan, PartitionInput, PartitionTaskError, PartitionTaskFactory, Publisher};
use crate::link::LinkSink;

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
    /// The partitions whose owner row names this instance's endpoint under
    /// another owner id and were not released: the process that served this
    /// endpoint before was killed (this one holds its address now). A
    /// failed read resumes nothing (the group reassigns them as usual).
    fn orphans(&self) -> BoxFuture<'static, Vec<Orphan>> {
        let pool = self.pool.clone();
        let settings = self.settings.clone();
        async move {
            match orphaned_partitions(&pool, &settings.endpoint, &settings.owner_id).await {
                Ok(rows) => rows
                    .into_iter()
                    .map(|(partition, applied_offset)| Orphan {
                        partition,
                        resume_from: (applied_offset >= 0).then(|| applied_offset.saturating_add(1)),
                    })
                    .collect(),
                Err(error) => {
                    tracing::warn!(service = settings.service, %error, "reading the partitions this endpoint held before failed; leaving them to the group");
                    Vec::new()
                }
            }
        }
        .boxed()
    }

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

pub(super) struct PartitionTask<S: OwnedStore> {
    pub(super) store: Arc<S>,
    pub(super) pool: PgPool,
    pub(super) publisher: Publisher,
    pub(super) links: Option<Arc<dyn LinkSink>>,
    pub(super) registry: Arc<OwnerRegistry<<S::State as OwnedState>::Local>>,
    pub(super) settings: OwnerSettings,
    pub(super) faults: Faults,
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
/// A member the group assigns a partition that another member still
/// serves (alive: its row moved within this, which is over two of its
/// idle touches) waits for that owner to give it up before taking it over.
/// A dead owner's row is stiller than this by the time the group
/// reassigns its partitions (the session timeout, 6 s by default).
pub(super) const OWNER_ALIVE_WITHIN: Duration = Duration::from_secs(5);
/// The longest a member waits for a live owner to give a partition up
/// before it takes it over all the same.
const HANDOVER_WAIT_MAX: Duration = Duration::from_secs(10);
/// How often a waiting member looks at the owner row again.
const HANDOVER_CHECK_EVERY: Duration = Duration::from_millis(200);
/// How often an owned partition publishes its keys for per-key metrics.
const KEY_STATS_EVERY: Duration = Duration::from_secs(1);
/// How long reading a partition's watermarks may take.
pub(super) const WATERMARKS_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) enum Step<T> {
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
pub(super) enum BatchEnd {
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
    ///
    /// A provisional task (a partition this instance's previous run held
    /// when it died, resumed before the group reassigned it) takes it over
    /// at once and ends when fenced: whoever fenced it is the member the
    /// group gave the partition to.
    async fn run(self, mut input: PartitionInput) -> Result<(), PartitionTaskError> {
        let mut carried: Vec<InMsg> = Vec::new();
        if !input.provisional && !self.wait_for_handover(&input).await {
            return Ok(());
        }
        loop {
            match self.own(&mut input, &mut carried).await? {
                Ownership::Ended => return Ok(()),
                Ownership::Fenced => {
                    if input.provisional {
                        tracing::info!(
                            service = self.settings.service,
                            partition = input.partition,
                            "a member the group assigned the resumed partition took it over"
                        );
                        return Ok(());
                    }
                    if !self.stand_by(&input).await {
                        return Ok(());
                    }
                }
            }
        }
    }

    /// Before taking a newly assigned partition over: wait while another
    /// member still serves it (the group may assign a partition to a new
    /// member before the old one has given it up: tansu does, for
    /// seconds). Fencing a live owner at once moved partitions from one
    /// member to the other and back within seconds, and a completion sent
    /// meanwhile could miss every owner's grace: the job ran again. True
    /// when this member should take it over (the owner released it, fell
    /// silent, or `HANDOVER_WAIT_MAX` passed); false when the partition was
    /// revoked here meanwhile, or the service stops.
    async fn wait_for_handover(&self, input: &PartitionInput) -> bool {
        let partition = input.partition;
        let deadline = tokio::time::Instant::now() + HANDOVER_WAIT_MAX;
        let mut said = false;
        loop {
            if input.stop.is_cancelled() {
                return false;
            }
            match live_other_owner(&self.pool, partition, &self.settings.owner_id, OWNER_ALIVE_WITHIN).await {
                Ok(None) => return true,
                Ok(Some((endpoint, _))) if tokio::time::Instant::now() >= deadline => {
                    tracing::warn!(service = self.settings.service, partition, %endpoint, waited = ?HANDOVER_WAIT_MAX, "the previous owner still holds the partition; taking it over all the same");
                    return true;
                }
                Ok(Some((endpoint, still_ms))) => {
                    if !said {
                        tracing::info!(service = self.settings.service, partition, %endpoint, still_ms, "assigned a partition its previous owner still serves; waiting for it to give it up");
                        said = true;
                    }
                }
                Err(error) => {
                    tracing::debug!(service = self.settings.service, partition, %error, "reading the owner row failed; taking the partition over");
                    return true;
                }
            }
            tokio::select! {
                _ = input.stop.cancelled() => return false,
                () = tokio::time::sleep(HANDOVER_CHECK_EVERY) => {}
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
        self.faults.hold_if_hit(FaultPoint::OwnerHeldBeforeServing).await;
        state.begin_serving(context.clock.now_ms());

        let (local_sender, mut local_receiver) = self.register_owned(&context, applied_offset, loading);

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
                match self
                    .wait_for_work(&context, wakeup, input, &mut local_receiver, &mut fence_check)
                    .await
                {
                    Woken::Message(message) => messages.push(message),
                    Woken::Local(received) => locals.push(received.local),
                    Woken::Timer => {}
                    Woken::StillOwned => continue,
                    Woken::End(ownership) => break Ok(ownership),
                }
            }
            self.fill_batch(input, &mut local_receiver, &mut messages, &mut locals);
            state.requests_received_through(context.clock.ms_at(self.registry.received_through(partition)));
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
            self.publish_key_stats_every(&mut last_key_stats, partition, &state, context.clock.now_ms());
        };
        self.release_ownership(&context, &local_sender, &outcome).await;
        outcome
    }

    /// Registers the partition as owned here, so local requests reach it,
    /// and ends its loading.
    fn register_owned(
        &self,
        context: &OwnerContext,
        applied_offset: i64,
        loading: Loading<'_, LocalOf<S>>,
    ) -> LocalQueue<LocalOf<S>> {
        let partition = context.partition;
        let (local_sender, local_receiver) = mpsc::channel(1024);
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
        (local_sender, local_receiver)
    }

    fn publish_key_stats_every(&self, last: &mut std::time::Instant, partition: i32, state: &S::State, now_ms: i64) {
        if last.elapsed() >= KEY_STATS_EVERY {
            *last = std::time::Instant::now();
            crate::metrics::metrics().publish_keys(self.settings.service, partition, Some(state.key_stats(now_ms)));
        }
    }

    /// Waits, with nothing to decide, for a message, a local request, the
    /// state's next wakeup (`wakeup`) or the fence check.
    async fn wait_for_work(
        &self,
        context: &OwnerContext,
        wakeup: Option<tokio::time::Instant>,
        input: &mut PartitionInput,
        local_receiver: &mut mpsc::Receiver<Received<LocalOf<S>>>,
        fence_check: &mut tokio::time::Interval,
    ) -> Woken<Received<LocalOf<S>>> {
        let sleep = async {
            match wakeup {
                Some(at) => tokio::time::sleep_until(at).await,
                None => futures::future::pending::<()>().await,
            }
        };
        tokio::select! {
            biased;
            _ = input.stop.cancelled() => Woken::End(Ownership::Ended),
            received = input.messages.recv() => match received {
                Some(message) => Woken::Message(message),
                None => Woken::End(Ownership::Ended),
            },
            Some(local) = local_receiver.recv() => Woken::Local(local),
            _ = sleep => Woken::Timer,
            _ = fence_check.tick() => {
                if self.alive_or_fenced(context.partition, context.epoch).await {
                    Woken::End(Ownership::Fenced)
                } else {
                    Woken::StillOwned
                }
            }
        }
    }

    /// The end of an ownership: the partition's key metrics, its registry
    /// entry and condition go; the owner row is released if given up in order.
    async fn release_ownership(
        &self,
        context: &OwnerContext,
        local_sender: &mpsc::Sender<Received<LocalOf<S>>>,
        outcome: &Result<Ownership, PartitionTaskError>,
    ) {
        let partition = context.partition;
        crate::metrics::metrics().publish_keys(self.settings.service, partition, None);
        self.registry.unregister(partition, local_sender);
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
        local_receiver: &mut mpsc::Receiver<Received<LocalOf<S>>>,
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
                // Taken: its receipt goes (the batch applies it).
                Ok(received) => locals.push(received.local),
                Err(_) => break,
            }
        }
    }
}

/// The local requests of a store's partitions.
type LocalOf<S> = <<S as OwnedStore>::State as OwnedState>::Local;

/// Both ends of a partition task's queue of local requests.
type LocalQueue<L> = (mpsc::Sender<Received<L>>, mpsc::Receiver<Received<L>>);

/// What woke an idle partition task (`wait_for_work`).
enum Woken<L> {
    Message(InMsg),
    Local(L),
    /// The state's next wakeup is due.
    Timer,
    /// The fence check found this instance still the owner.
    StillOwned,
    End(Ownership),
}
