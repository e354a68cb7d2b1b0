//! The writes of a batch, and the journal policy: a batch's ticket changes
//! become one journal row, or a snapshot when the journal has outgrown the
//! last (docs/hot-path.md, "Tickets journaled").

use sluice_common::hash::{HashMap, HashSet};

use sluice_common::owner::WriteSet;

use super::journal::{StoredTicket, TicketBatch, TicketSnapshot};
use super::{KeyId, KeyRecord, LimitPartition, TicketKey, TicketRecord};

/// The writes of one batch, collapsed per row.
#[derive(Debug, Default)]
pub struct LimitWrites {
    pub upserts: HashMap<TicketKey, TicketRecord>,
    pub deletes: HashSet<TicketKey>,
    /// `None` deletes the key row.
    pub keys: HashMap<KeyId, Option<KeyRecord>>,
    /// The batch's ticket changes as one journal row (`upserts` and
    /// `deletes` encoded), numbered; set when the batch closes.
    pub journal: Option<(i64, TicketBatch)>,
    /// Instead of the journal row: every live ticket after this batch.
    pub snapshot: Option<(i64, TicketSnapshot)>,
}

impl LimitWrites {
    /// Save a key's settings (an empty record deletes its row).
    pub(super) fn save_key(&mut self, key_id: &KeyId, record: &KeyRecord) {
        let row = (!record.is_empty()).then(|| record.clone());
        self.keys.insert(key_id.clone(), row);
    }

    pub(super) fn upsert(&mut self, record: TicketRecord) {
        self.deletes.remove(&record.ticket);
        self.upserts.insert(record.ticket.clone(), record);
    }

    pub(super) fn delete(&mut self, ticket: &TicketKey) {
        self.upserts.remove(ticket);
        self.deletes.insert(ticket.clone());
    }
}

impl WriteSet for LimitWrites {
    fn is_empty(&self) -> bool {
        self.upserts.is_empty()
            && self.deletes.is_empty()
            && self.keys.is_empty()
            && self.journal.is_none()
            && self.snapshot.is_none()
    }
}

/// The journal may grow to the last snapshot's size, and at least this much,
/// before a new snapshot replaces it.
const MIN_JOURNAL_BEFORE_SNAPSHOT: usize = 1 << 20;

impl LimitPartition {
    /// Where the loaded journal stands: its last `journal_seq`, the size of
    /// the snapshot it started from (`None`: no snapshot yet, so the next
    /// batch writes one) and of the journal rows after it.
    pub fn journal_loaded(&mut self, journal_seq: i64, snapshot_bytes: Option<usize>, journal_bytes: usize) {
        self.journal_seq = journal_seq;
        self.journal_bytes_since_snapshot = journal_bytes;
        self.last_snapshot_bytes = snapshot_bytes.unwrap_or(0);
        self.snapshot_due = snapshot_bytes.is_none();
    }

    /// Close the batch: its ticket changes become one journal row, or a
    /// snapshot of every live ticket when the journal has outgrown the last.
    pub(super) fn close_batch(&mut self, writes: &mut LimitWrites) {
        if writes.upserts.is_empty() && writes.deletes.is_empty() && !self.snapshot_due {
            return;
        }
        self.journal_seq += 1;
        let batch = TicketBatch {
            upserts: writes.upserts.values().map(StoredTicket::of).collect(),
            deletes: writes.deletes.iter().map(TicketKey::to_proto).collect(),
        };
        self.journal_bytes_since_snapshot += prost::Message::encoded_len(&batch);
        if self.snapshot_due
            || self.journal_bytes_since_snapshot > self.last_snapshot_bytes.max(MIN_JOURNAL_BEFORE_SNAPSHOT)
        {
            let snapshot = TicketSnapshot {
                tickets: self.tickets().map(StoredTicket::of).collect(),
            };
            self.last_snapshot_bytes = prost::Message::encoded_len(&snapshot);
            self.journal_bytes_since_snapshot = 0;
            self.snapshot_due = false;
            writes.snapshot = Some((self.journal_seq, snapshot));
        } else {
            writes.journal = Some((self.journal_seq, batch));
        }
    }
}
