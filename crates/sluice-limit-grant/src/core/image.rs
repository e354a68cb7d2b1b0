//! A partition's saved image in memory: what limit-grant's tables hold for
//! one partition (its `keys` rows, its row of `ticket_snapshots` and its
//! `ticket_journal` rows after it), for a simulation that keeps them
//! instead of PostgreSQL. `save` folds a committed batch's writes in as
//! `store::LimitStore::persist` does; `load` builds the partition a new
//! owner loads from them, as `store::LimitStore::load` does.

use sluice_common::hash::HashMap;
use std::collections::BTreeMap;

use prost::Message as _;

use super::adaptive::Adaptive;
use super::journal::{TicketBatch, TicketSnapshot};
use super::{KeyId, KeyRecord, LimitPartition, LimitWrites, PartitionSettings, TicketKey, TicketRecord};

/// What the tables hold for one partition.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SavedImage {
    /// Key settings as their rows keep them (`as_saved`).
    pub keys: BTreeMap<KeyId, KeyRecord>,
    /// The last snapshot and the journal position it stands at.
    pub snapshot: Option<(i64, TicketSnapshot)>,
    /// The journal rows after the snapshot, in order.
    pub journal: Vec<(i64, TicketBatch)>,
}

/// Fold one committed batch's writes into `image`, in the order `persist`
/// writes them: the journal row, the snapshot (which forgets the journal up
/// to it), the key rows.
pub fn save(image: &mut SavedImage, writes: &LimitWrites) {
    if let Some((seq, batch)) = &writes.journal {
        image.journal.push((*seq, batch.clone()));
    }
    if let Some((seq, snapshot)) = &writes.snapshot {
        image.snapshot = Some((*seq, snapshot.clone()));
        image.journal.retain(|(journal_seq, _)| journal_seq > seq);
    }
    for (key_id, record) in &writes.keys {
        match record {
            Some(record) => {
                image.keys.insert(key_id.clone(), as_saved(&key_id.1, record));
            }
            None => {
                image.keys.remove(key_id);
            }
        }
    }
}

/// The partition a new owner of `settings.partition` at `epoch` loads from
/// `image` at `now_ms`.
pub fn load(image: &SavedImage, settings: PartitionSettings, epoch: i64, now_ms: i64) -> LimitPartition {
    let mut saved = match &image.snapshot {
        Some((seq, snapshot)) => SavedTickets::from_snapshot(*seq, snapshot.encoded_len(), snapshot.clone()),
        None => SavedTickets::without_snapshot(Vec::new()),
    };
    let snapshot_seq = saved.journal_seq;
    for (seq, batch) in image.journal.iter().filter(|(seq, _)| *seq > snapshot_seq) {
        saved.replay(*seq, batch.encoded_len(), batch.clone());
    }
    let keys = image
        .keys
        .iter()
        .map(|(key_id, record)| (key_id.clone(), record.clone()))
        .collect();
    LimitPartition::loaded(settings, epoch, now_ms, keys, saved)
}

/// A key's settings as its row keeps them: integers within the columns'
/// ranges, and of an adaptive key only its stored part (a new owner opens a
/// new window).
pub fn as_saved(key: &str, record: &KeyRecord) -> KeyRecord {
    let column = |value: u32| value.min(u32::try_from(i32::MAX).unwrap_or(u32::MAX));
    let mut saved = record.clone();
    saved.override_max = record.override_max.map(column);
    if let Some(floating) = saved.floating.as_mut() {
        floating.current_max = column(floating.current_max);
        floating.default_max = column(floating.default_max);
        floating.refresh_interval_ms = floating
            .refresh_interval_ms
            .min(u64::try_from(i64::MAX).unwrap_or(u64::MAX));
    }
    saved.adaptive = record
        .adaptive
        .as_ref()
        .map(|adaptive| Adaptive::from_stored(adaptive.stored(key)));
    saved
}

/// A partition's saved tickets: its snapshot with the journal after it
/// replayed in order, and where the journal stands.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SavedTickets {
    pub tickets: HashMap<TicketKey, TicketRecord>,
    pub journal_seq: i64,
    /// `None`: no snapshot saved yet.
    pub snapshot_bytes: Option<usize>,
    pub journal_bytes: usize,
}

impl SavedTickets {
    /// Before the partition's first snapshot: `tickets` (saved as rows by
    /// an earlier version, or none).
    pub fn without_snapshot(tickets: Vec<TicketRecord>) -> Self {
        SavedTickets {
            tickets: tickets
                .into_iter()
                .map(|record| (record.ticket.clone(), record))
                .collect(),
            ..SavedTickets::default()
        }
    }

    /// From the snapshot saved at journal position `seq`, `bytes` long.
    pub fn from_snapshot(seq: i64, bytes: usize, snapshot: TicketSnapshot) -> Self {
        SavedTickets {
            tickets: snapshot
                .tickets
                .into_iter()
                .map(|stored| {
                    let record = stored.into_record();
                    (record.ticket.clone(), record)
                })
                .collect(),
            journal_seq: seq,
            snapshot_bytes: Some(bytes),
            journal_bytes: 0,
        }
    }

    /// Replay the journal row `seq`, `bytes` long (rows in order).
    pub fn replay(&mut self, seq: i64, bytes: usize, batch: TicketBatch) {
        batch.apply_to(&mut self.tickets);
        self.journal_seq = seq;
        self.journal_bytes += bytes;
    }
}

/// What a partition holds that its owner saves: every key's settings and
/// every live ticket (held or waiting; with their priorities, enqueue times
/// and flows, the order of each flow's queue). Two partitions that hold the
/// same grant the same, but for the turn among a key's flows (not saved).
/// An adaptive key's settings include its open window, which is not saved
/// either: compare them between loaded partitions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Held {
    pub keys: BTreeMap<KeyId, KeyRecord>,
    pub tickets: BTreeMap<TicketKey, TicketRecord>,
}

/// What `partition` holds (see `Held`).
pub fn held(partition: &LimitPartition) -> Held {
    Held {
        keys: partition
            .keys
            .iter()
            .filter(|(_, state)| !state.record.is_empty())
            .map(|(key_id, state)| (key_id.clone(), state.record.clone()))
            .collect(),
        tickets: partition
            .tickets()
            .map(|record| (record.ticket.clone(), record.clone()))
            .collect(),
    }
}
