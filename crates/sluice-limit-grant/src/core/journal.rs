//! How a partition's tickets are kept in PostgreSQL (docs/hot-path.md,
//! "Tickets journaled"): one journal row per committed batch holding the
//! batch's ticket changes, and a snapshot of the partition's live tickets
//! written when the journal since the last one has outgrown it. A ticket is no longer a row
//! written three times (acquired, granted, released). Storage formats, not
//! messages between services.

use sluice_common::hash::HashMap;
use std::sync::Arc;

use sluice_common::core::CompactTraceContext;
use sluice_proto::v1 as pb;

use super::{TicketKey, TicketRecord};

/// A ticket as journaled: everything `TicketRecord` holds.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StoredTicket {
    #[prost(string, tag = "1")]
    pub job_id: String,
    #[prost(uint32, tag = "2")]
    pub attempt: u32,
    #[prost(uint32, tag = "3")]
    pub step: u32,
    #[prost(string, tag = "4")]
    pub tenant: String,
    #[prost(string, tag = "5")]
    pub key: String,
    #[prost(bool, tag = "6")]
    pub held: bool,
    #[prost(uint32, tag = "7")]
    pub priority: u32,
    #[prost(int64, tag = "8")]
    pub enqueued_at_us: i64,
    #[prost(uint32, tag = "9")]
    pub job_max: u32,
    #[prost(bool, tag = "10")]
    pub floating: bool,
    #[prost(int64, tag = "11")]
    pub waiting_since_ms: i64,
    #[prost(uint32, tag = "12")]
    pub position_at_enqueue: u32,
    #[prost(int64, optional, tag = "13")]
    pub granted_at_ms: Option<i64>,
    #[prost(string, tag = "14")]
    pub traceparent: String,
    #[prost(string, tag = "15")]
    pub tracestate: String,
    #[prost(string, tag = "16")]
    pub fairness_key: String,
    #[prost(bool, tag = "17")]
    pub shadow: bool,
}

impl StoredTicket {
    pub fn of(record: &TicketRecord) -> Self {
        StoredTicket {
            job_id: record.ticket.job_id.to_string(),
            attempt: record.ticket.attempt,
            step: record.ticket.step,
            tenant: record.tenant().to_string(),
            key: record.key().to_string(),
            held: record.held,
            priority: record.priority,
            enqueued_at_us: record.enqueued_at_us,
            job_max: record.job_max,
            floating: record.floating,
            waiting_since_ms: record.waiting_since_ms,
            position_at_enqueue: record.position_at_enqueue,
            granted_at_ms: record.granted_at_ms,
            traceparent: record.trace.traceparent(),
            tracestate: record.trace.tracestate().to_string(),
            fairness_key: record.fairness_key.to_string(),
            shadow: record.shadow,
        }
    }

    pub fn into_record(self) -> TicketRecord {
        TicketRecord {
            ticket: TicketKey {
                job_id: Arc::from(self.job_id.as_str()),
                attempt: self.attempt,
                step: self.step,
            },
            key_id: Arc::new((self.tenant, self.key)),
            held: self.held,
            priority: self.priority,
            enqueued_at_us: self.enqueued_at_us,
            job_max: self.job_max,
            floating: self.floating,
            waiting_since_ms: self.waiting_since_ms,
            position_at_enqueue: self.position_at_enqueue,
            granted_at_ms: self.granted_at_ms,
            trace: CompactTraceContext::from_context(&pb::TraceContext {
                traceparent: self.traceparent,
                tracestate: self.tracestate,
            }),
            fairness_key: Arc::from(self.fairness_key.as_str()),
            shadow: self.shadow,
        }
    }
}

/// The journal row of one batch: tickets written (whole) and tickets gone.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TicketBatch {
    #[prost(message, repeated, tag = "1")]
    pub upserts: Vec<StoredTicket>,
    #[prost(message, repeated, tag = "2")]
    pub deletes: Vec<pb::TicketId>,
}

/// Every live ticket of a partition after the batch `seq`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct TicketSnapshot {
    #[prost(message, repeated, tag = "1")]
    pub tickets: Vec<StoredTicket>,
}

impl TicketBatch {
    /// Apply this batch to `tickets` (a snapshot's, then each later batch's
    /// in order).
    pub fn apply_to(self, tickets: &mut HashMap<TicketKey, TicketRecord>) {
        for deleted in &self.deletes {
            tickets.remove(&TicketKey::from_proto(deleted));
        }
        for stored in self.upserts {
            let record = stored.into_record();
            tickets.insert(record.ticket.clone(), record);
        }
    }
}

#[cfg(test)]
mod tests;
