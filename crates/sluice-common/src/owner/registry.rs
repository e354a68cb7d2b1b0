//! The partitions this instance owns (`OwnerRegistry`): where local
//! requests reach their partition task, and the readiness of loading and
//! faulty partitions.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::mpsc;

use crate::readiness::Readiness;

/// Where a local request can reach the partition task that owns it.
pub struct OwnedPartitionHandle<L> {
    sender: mpsc::Sender<Received<L>>,
    epoch: i64,
}

/// A local request on its way to its partition task, with its receipt: it
/// counts as received from the moment the registry was asked to deliver it
/// (`call`, `submit`) until the task takes it for a batch.
pub struct Received<L> {
    pub(super) local: L,
    /// Dropped with the request's wrapper when the task takes it.
    _receipt: Receipt,
}

/// Holds a request's place in `Receipts` while it waits; taken when dropped.
pub(super) struct Receipt {
    book: Arc<Receipts>,
    partition: i32,
    id: u64,
}

impl Drop for Receipt {
    fn drop(&mut self) {
        let mut waiting = self
            .book
            .waiting
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        // An emptied partition's map stays (one per partition ever called).
        if let Some(partition) = waiting.get_mut(&self.partition) {
            partition.remove(&self.id);
        }
    }
}

/// When each local request that no partition task has taken yet was
/// received, by partition (`OwnerRegistry::received_through`). Ids and
/// times are given under one lock, so a partition's waiting requests are in
/// the order they came, oldest first.
#[derive(Default)]
pub(super) struct Receipts {
    waiting: Mutex<HashMap<i32, BTreeMap<u64, tokio::time::Instant>>>,
    next: std::sync::atomic::AtomicU64,
}

impl Receipts {
    fn receive(book: &Arc<Receipts>, partition: i32) -> Receipt {
        let mut waiting = book.waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let id = book.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        waiting
            .entry(partition)
            .or_default()
            .insert(id, tokio::time::Instant::now());
        Receipt {
            book: book.clone(),
            partition,
            id,
        }
    }

    /// Every request for `partition` received before the returned instant
    /// has been taken: the oldest one still waiting came then (`None`: none
    /// waits, so everything received until now was taken).
    fn oldest_waiting(&self, partition: i32) -> Option<tokio::time::Instant> {
        let waiting = self.waiting.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        waiting
            .get(&partition)
            .and_then(|requests| requests.first_key_value())
            .map(|(_, at)| *at)
    }
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
    /// The requests on their way to their partition task.
    receipts: Arc<Receipts>,
}

/// How long a call waits for a partition that is loading here.
const LOADING_WAIT: Duration = Duration::from_secs(5);

/// Marks a partition as loading while alive; dropped when its task starts
/// taking calls, stops, or is cancelled mid-takeover.
pub(super) struct Loading<'a, L> {
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
            receipts: Arc::new(Receipts::default()),
        })
    }

    /// The partition task's queue, if this instance owns the partition. A
    /// partition still loading here is waited for, up to `LOADING_WAIT`.
    async fn sender(&self, partition: i32) -> Result<mpsc::Sender<Received<L>>, LocalCallError> {
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
        let receipt = Receipts::receive(&self.receipts, partition);
        let sender = self.sender(partition).await?;
        let (reply_sender, reply_receiver) = tokio::sync::oneshot::channel();
        sender
            .send(Received {
                local: make(reply_sender),
                _receipt: receipt,
            })
            .await
            .map_err(|_| LocalCallError::NotOwner(partition))?;
        reply_receiver.await.map_err(|_| LocalCallError::Interrupted(partition))
    }

    /// Queue a request for the partition task, if this instance owns it,
    /// without waiting for the answer (the request carries its own reply).
    pub async fn submit(&self, partition: i32, local: L) -> Result<(), LocalCallError> {
        let receipt = Receipts::receive(&self.receipts, partition);
        let sender = self.sender(partition).await?;
        sender
            .send(Received {
                local,
                _receipt: receipt,
            })
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

    pub(super) fn begin_loading(&self, partition: i32) -> Loading<'_, L> {
        self.loading
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(partition);
        Loading {
            registry: self,
            partition,
        }
    }

    pub(super) fn set_condition(&self, partition: i32, reason: impl Into<String>) {
        self.readiness.set(self.condition(partition), reason);
    }

    /// Loading is part of every start and rebalance, not a fault.
    pub(super) fn set_loading(&self, partition: i32) {
        self.readiness.set_expected(self.condition(partition), "loading");
    }

    pub(super) fn clear_condition(&self, partition: i32) {
        self.readiness.clear(&self.condition(partition));
    }

    /// Every request for `partition` this instance received (`call`,
    /// `submit`) before the returned instant has been taken by its task
    /// (`OwnedState::requests_received_through`): just before the oldest
    /// one still waiting was received, or now if none waits.
    pub(super) fn received_through(&self, partition: i32) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        match self.receipts.oldest_waiting(partition) {
            Some(oldest) => oldest.checked_sub(Duration::from_millis(1)).unwrap_or(oldest),
            None => now,
        }
    }

    /// Whether the partition was not registered already.
    pub(super) fn register(&self, partition: i32, epoch: i64, sender: mpsc::Sender<Received<L>>) -> bool {
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
    pub(super) fn taken_over(&self, newly_owned: bool) {
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

    pub(super) fn unregister(&self, partition: i32, sender: &mpsc::Sender<Received<L>>) {
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
