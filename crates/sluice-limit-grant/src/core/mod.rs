//! The pure core of limit-grant: for each key of one partition, its holders
//! and its waiting queue, and the decisions on them (docs/architecture.md,
//! guarantee 1, "No overrun"). `LimitPartition` is a `sluice_common::core::Core`:
//! a batch's decisions come back as a value (writes, sends, answers,
//! effects) that the owner runtime commits, sends, answers and records.
//! No I/O, clock, channel or tracer here.

mod acquire;
pub mod adaptive;
mod apply;
mod describe;
mod effects;
pub mod flows;
mod grant;
pub mod image;
pub mod journal;
mod keys;
mod query;
mod refresh;
mod settings;
pub mod shadow;
mod sweep;
mod validation;
mod writes;

#[cfg(test)]
mod tests;

use sluice_common::hash::HashMap;
use std::collections::BTreeSet;
use std::sync::Arc;

use sluice_common::core::Decisions;
use sluice_common::validate::InputLimits;

pub use effects::LimitEffect;
pub use keys::{FloatingRecord, KeyId, KeyRecord, TicketKey, TicketRecord};
use keys::{Holder, KeyState, TicketPlace, WaitOrder, Waiting};
pub use query::{LimitAnswer, LimitQuery};
pub use settings::LimitChange;
use sweep::PendingSweep;
pub use writes::LimitWrites;

/// What a batch decided: its writes, what it sends, the answers to its
/// queries and its effects.
pub type Decided = Decisions<LimitWrites, LimitAnswer, LimitEffect>;

/// Where this partition's effects go.
#[derive(Clone, Debug)]
pub struct PartitionSettings {
    pub partition: i32,
    pub limit_partitions: i32,
    /// Job partitions: a grant goes to the link that claimed its job's.
    pub grants_partitions: i32,
    pub refresh_due_topic: Arc<str>,
    pub refresh_due_partitions: i32,
    pub max_message_bytes: usize,
    /// Default grace for tickets nobody confirms (a sweep may carry its own).
    pub ticket_grace_ms: i64,
    /// What commands are checked against (the edge's bounds).
    pub input: InputLimits,
}

/// One owned partition of limit-grant.
pub struct LimitPartition {
    settings: PartitionSettings,
    epoch: i64,
    keys: HashMap<KeyId, KeyState>,
    /// Where each ticket (held or waiting) is.
    ticket_keys: HashMap<TicketKey, TicketPlace>,
    sweeps: HashMap<String, PendingSweep>,
    /// When this owner restored the saved tickets (its takeover): a ticket
    /// still confirmed at exactly this time was never stood behind since
    /// (`sweep::RESTORED_MARGIN_MS`).
    restored_at_ms: Option<i64>,
    /// Floating keys that had waiters when last looked at: their refresh
    /// falls due on a timer too, not only when a job comes or goes
    /// (`refresh::refresh_if_due`). Ordered, so timers fire in one order.
    refresh_watch: BTreeSet<KeyId>,
    /// The last journal row (or snapshot) saved.
    journal_seq: i64,
    journal_bytes_since_snapshot: usize,
    last_snapshot_bytes: usize,
    /// Write a snapshot at the next batch (none saved yet).
    snapshot_due: bool,
}

impl LimitPartition {
    pub fn new(settings: PartitionSettings, epoch: i64) -> Self {
        LimitPartition {
            settings,
            epoch,
            keys: HashMap::default(),
            ticket_keys: HashMap::default(),
            sweeps: HashMap::default(),
            restored_at_ms: None,
            refresh_watch: BTreeSet::new(),
            journal_seq: 0,
            journal_bytes_since_snapshot: 0,
            last_snapshot_bytes: 0,
            snapshot_due: true,
        }
    }

    /// Every live ticket, held or waiting.
    fn tickets(&self) -> impl Iterator<Item = &TicketRecord> {
        self.keys.values().flat_map(|state| {
            state
                .holders
                .values()
                .map(|holder| &holder.record)
                .chain(state.waiters.iter().map(|(_, _, waiting)| &waiting.record))
        })
    }

    /// The partition a new owner loads at `now_ms`: the saved key settings
    /// and tickets, and where the journal stands.
    pub fn loaded(
        settings: PartitionSettings,
        epoch: i64,
        now_ms: i64,
        keys: Vec<(KeyId, KeyRecord)>,
        saved: image::SavedTickets,
    ) -> Self {
        let mut partition = LimitPartition::new(settings, epoch);
        partition.journal_loaded(saved.journal_seq, saved.snapshot_bytes, saved.journal_bytes);
        partition.restore(now_ms, keys, saved.tickets.into_values().collect());
        partition
    }

    /// Restore loaded rows. Every restored ticket counts as stood behind at
    /// `now_ms`: one grace period from it, unless a sweep taken after it
    /// shows nobody stands behind it (`sweep::RESTORED_MARGIN_MS`).
    /// Flows join their key's round in the order of their first waiters.
    pub fn restore(&mut self, now_ms: i64, keys: Vec<(KeyId, KeyRecord)>, mut tickets: Vec<TicketRecord>) {
        self.restored_at_ms = Some(now_ms);
        for (key_id, record) in keys {
            self.key_state(&key_id).record = record;
        }
        tickets.sort_by_cached_key(WaitOrder::of);
        for mut record in tickets {
            let state = self.key_state(&record.key_id);
            // One shared id per key, whatever the loader built.
            record.key_id = state.id.clone();
            let shared = state.id.clone();
            self.ticket_keys.insert(record.ticket.clone(), TicketPlace::of(&record));
            let Some(state) = self.keys.get_mut(&*shared) else {
                continue;
            };
            if record.held {
                state.holders.insert(
                    record.ticket.clone(),
                    Holder {
                        record,
                        confirmed_at_ms: now_ms,
                    },
                );
            } else {
                state.insert_waiter(Waiting {
                    record,
                    confirmed_at_ms: now_ms,
                });
            }
        }
        // A floating key that waits: its next refresh is on the timer.
        self.refresh_watch = self
            .keys
            .iter()
            .filter(|(_, state)| state.record.floating.is_some() && !state.waiters.is_empty())
            .map(|(key_id, _)| key_id.clone())
            .collect();
    }

    /// The state of `key_id`, created empty on first use.
    fn key_state(&mut self, key_id: &KeyId) -> &mut KeyState {
        self.keys
            .entry(key_id.clone())
            .or_insert_with(|| KeyState::new(Arc::new(key_id.clone())))
    }

    pub fn holders_of(&self, tenant: &str, key: &str) -> usize {
        self.keys
            .get(&(tenant.to_string(), key.to_string()))
            .map_or(0, |state| state.holders.len())
    }

    pub fn waiting_on(&self, tenant: &str, key: &str) -> usize {
        self.keys
            .get(&(tenant.to_string(), key.to_string()))
            .map_or(0, |state| state.waiters.len())
    }
}
