//! What a running worker can tell about itself: its partitions, what runs,
//! and counters of what happened to the messages it received. For
//! readiness probes, dashboards and tests.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Counters since the worker started.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub delivered: AtomicU64,
    pub duplicates: AtomicU64,
    pub claimed: AtomicU64,
    pub not_claimed: AtomicU64,
    pub succeeded: AtomicU64,
    pub failed: AtomicU64,
    pub handed_back: AtomicU64,
    pub forwarded: AtomicU64,
    pub cancelled: AtomicU64,
    pub lease_lost: AtomicU64,
    pub malformed: AtomicU64,
    pub refreshes_reported: AtomicU64,
    pub pauses: AtomicU64,
}

impl Counters {
    pub fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

#[derive(Debug, Default)]
pub(crate) struct Gauges {
    pub pending: usize,
    pub running: usize,
    pub running_by_type: HashMap<String, usize>,
    /// `Work` streams open (admission confirmed them), stream workers only.
    pub streams: usize,
}

/// Shared between the worker and whoever watches it.
#[derive(Debug, Default)]
pub(crate) struct StatusShared {
    pub counters: Counters,
    pub gauges: Mutex<Gauges>,
    /// (topic, partition) this worker's consumer owns now.
    pub assigned: Mutex<BTreeSet<(String, i32)>>,
}

/// A handle on a worker's status; cheap to clone, usable after the worker
/// stopped (it then shows the last state).
#[derive(Clone, Debug, Default)]
pub struct WorkerStatus {
    pub(crate) shared: Arc<StatusShared>,
}

/// One look at a worker.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerSnapshot {
    /// (topic, partition) of `jobs.admitted.*` this worker consumes now.
    pub assigned: Vec<(String, i32)>,
    /// Received, not started yet (waiting for a local slot).
    pub pending: usize,
    /// Slots taken: claiming, running, or reporting.
    pub running: usize,
    pub running_by_type: HashMap<String, usize>,
    /// Admitted-job messages received (duplicates and forwards included).
    pub delivered: u64,
    /// Deliveries of an attempt already queued or running here (admission
    /// re-sent it, or a rebalance delivered it again): kept once, the copy
    /// dropped on arrival.
    pub duplicates: u64,
    /// Claims won.
    pub claimed: u64,
    /// Claims answered TAKEN, STALE or NOT_FOUND (duplicates, old attempts).
    pub not_claimed: u64,
    pub succeeded: u64,
    pub failed: u64,
    /// Attempts given back with `Complete(hand_back)` (shutdown, handler
    /// asked, or a job that could not start here nor be forwarded).
    pub handed_back: u64,
    /// Unstarted jobs passed to another worker's partition.
    pub forwarded: u64,
    /// Handlers stopped by a cancel.
    pub cancelled: u64,
    /// Handlers stopped because the lease was lost.
    pub lease_lost: u64,
    /// Messages that were not an `AdmittedJob` (logged and skipped).
    pub malformed: u64,
    pub refreshes_reported: u64,
    /// Times the partitions were paused because the local queue stayed full.
    pub pauses: u64,
    /// `Work` streams open now (admission confirmed them), with
    /// `Transport::Stream`: one per admission instance when all is well.
    pub streams: usize,
}

impl WorkerStatus {
    pub fn snapshot(&self) -> WorkerSnapshot {
        let counters = &self.shared.counters;
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let gauges = self
            .shared
            .gauges
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let assigned = self
            .shared
            .assigned
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .cloned()
            .collect();
        WorkerSnapshot {
            assigned,
            pending: gauges.pending,
            running: gauges.running,
            running_by_type: gauges.running_by_type.clone(),
            delivered: load(&counters.delivered),
            duplicates: load(&counters.duplicates),
            claimed: load(&counters.claimed),
            not_claimed: load(&counters.not_claimed),
            succeeded: load(&counters.succeeded),
            failed: load(&counters.failed),
            handed_back: load(&counters.handed_back),
            forwarded: load(&counters.forwarded),
            cancelled: load(&counters.cancelled),
            lease_lost: load(&counters.lease_lost),
            malformed: load(&counters.malformed),
            refreshes_reported: load(&counters.refreshes_reported),
            pauses: load(&counters.pauses),
            streams: gauges.streams,
        }
    }
}
