//! A partition's keys and tickets: what is saved of them (`TicketRecord`,
//! `KeyRecord`), and each key's holders and queue in memory (`KeyState`).

use sluice_common::hash::HashMap;
use std::collections::BTreeMap;
use std::sync::Arc;

use sluice_common::core::CompactTraceContext;
use sluice_proto::v1 as pb;

use super::adaptive::Adaptive;
use super::flows::Flows;
use super::shadow::ShadowSim;

/// (tenant, key).
pub type KeyId = (String, String);

pub use sluice_common::ticket::TicketKey;

/// A ticket as stored: held, or waiting in its key's queue.
///
/// Lean, since a partition keeps one per waiting job: the key is shared with
/// its key's state and the job id with the indexes, the trace context is
/// binary (`CompactTraceContext`).
#[derive(Clone, Debug, PartialEq)]
pub struct TicketRecord {
    pub ticket: TicketKey,
    pub key_id: Arc<KeyId>,
    pub held: bool,
    pub priority: u32,
    pub enqueued_at_us: i64,
    /// The job's own max (plain keys) or its floating `default_max`.
    pub job_max: u32,
    pub floating: bool,
    pub waiting_since_ms: i64,
    pub position_at_enqueue: u32,
    pub granted_at_ms: Option<i64>,
    pub trace: CompactTraceContext,
    /// The job's flow among the key's waiters (`super::flows`); empty: the
    /// default flow.
    pub fairness_key: Arc<str>,
    /// The job names the limit in shadow mode (the key's stored mode beats
    /// it: `is_shadow`).
    pub shadow: bool,
}

impl TicketRecord {
    pub fn tenant(&self) -> &str {
        &self.key_id.0
    }

    pub fn key(&self) -> &str {
        &self.key_id.1
    }
}

/// The shared state of a floating key.
#[derive(Clone, Debug, PartialEq)]
pub struct FloatingRecord {
    pub current_max: u32,
    pub default_max: u32,
    pub refresh_interval_ms: u64,
    pub metadata: BTreeMap<String, String>,
    pub last_due_ms: Option<i64>,
    pub last_set_ms: Option<i64>,
    pub last_task_id: Option<String>,
}

/// Per-key state that outlives tickets.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KeyRecord {
    pub override_max: Option<u32>,
    pub floating: Option<FloatingRecord>,
    /// Weights of the key's flows that do not have the default
    /// (`flows::DEFAULT_WEIGHT`), by fairness key.
    pub flow_weights: BTreeMap<String, u32>,
    /// The stored mode (`SetLimit{mode}`); `None`: the jobs' shadow flags decide.
    pub mode: Option<pb::LimitMode>,
    /// An adaptive key's computed max (`super::adaptive`), created by its
    /// first job.
    pub adaptive: Option<Adaptive>,
}

impl KeyRecord {
    pub(super) fn is_empty(&self) -> bool {
        self.override_max.is_none()
            && self.floating.is_none()
            && self.flow_weights.is_empty()
            && self.mode.is_none()
            && self.adaptive.is_none()
    }

    /// The kind a grant of `ticket` reports.
    pub(super) fn grant_kind(&self, ticket: &TicketRecord) -> pb::LimitKind {
        if ticket.floating {
            pb::LimitKind::Floating
        } else if self.adaptive.is_some() {
            pb::LimitKind::Adaptive
        } else {
            pb::LimitKind::Concurrency
        }
    }

    /// The key's own max, when it has one: the override, else the floating
    /// value, else the adaptive one.
    pub(super) fn key_max(&self) -> Option<u32> {
        self.override_max
            .or(self.floating.as_ref().map(|floating| floating.current_max))
            .or(self.adaptive.as_ref().map(Adaptive::current))
    }
}

/// Whether `ticket` is granted in shadow mode (at once, accounted only):
/// the key's stored mode, else the job's own flag.
pub(super) fn is_shadow(record: &KeyRecord, ticket: &TicketRecord) -> bool {
    match record.mode {
        Some(pb::LimitMode::Shadow) => true,
        Some(pb::LimitMode::Enforce) => false,
        _ => ticket.shadow,
    }
}

/// The max a grant to `head` is checked against: the key's override, else
/// its floating value, else its adaptive value, else the job's own max.
pub(super) fn max_for(record: &KeyRecord, head: &TicketRecord) -> u32 {
    record.key_max().unwrap_or(head.job_max)
}

/// Queue order: lower priority number first, then earlier enqueue, then id.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct WaitOrder {
    pub(super) priority: u32,
    pub(super) enqueued_at_us: i64,
    pub(super) ticket: TicketKey,
}

impl WaitOrder {
    pub(super) fn of(record: &TicketRecord) -> Self {
        WaitOrder {
            priority: record.priority,
            enqueued_at_us: record.enqueued_at_us,
            ticket: record.ticket.clone(),
        }
    }
}

#[derive(Debug)]
pub(super) struct Holder {
    pub(super) record: TicketRecord,
    /// Last time admission stood behind this ticket (or it was granted/loaded).
    pub(super) confirmed_at_ms: i64,
}

#[derive(Debug)]
pub(super) struct Waiting {
    pub(super) record: TicketRecord,
    pub(super) confirmed_at_ms: i64,
}

#[derive(Debug)]
pub(super) struct KeyState {
    /// (tenant, key), shared with the key's tickets.
    pub(super) id: Arc<KeyId>,
    pub(super) record: KeyRecord,
    pub(super) holders: HashMap<TicketKey, Holder>,
    /// Waiters by flow, granted by weighted deficit round-robin across flows
    /// and in `WaitOrder` within one. A waiter is found by ticket through
    /// its `TicketPlace` (its flow, and the priority and enqueue time that
    /// make its `WaitOrder`).
    ///
    /// Boxed: a B-tree node holds eleven entries and is seldom full, and
    /// an unboxed ticket record made every empty place cost a record
    /// (issue 30).
    pub(super) waiters: Flows<WaitOrder, Box<Waiting>>,
    /// What the limit would do, for tickets granted in shadow mode
    /// (`super::shadow`); created by the first one.
    pub(super) shadow: Option<ShadowSim<WaitOrder>>,
    /// The last shadow ticket's own max (the simulated max of a key with no
    /// override or floating max).
    pub(super) shadow_job_max: u32,
}

/// Where a ticket (held or waiting) is: its key, and what orders it in the
/// key's queue (fixed for the ticket's life).
#[derive(Debug)]
pub(super) struct TicketPlace {
    pub(super) key_id: Arc<KeyId>,
    pub(super) flow: Arc<str>,
    pub(super) priority: u32,
    pub(super) enqueued_at_us: i64,
}

impl TicketPlace {
    pub(super) fn of(record: &TicketRecord) -> Self {
        TicketPlace {
            key_id: record.key_id.clone(),
            flow: record.fairness_key.clone(),
            priority: record.priority,
            enqueued_at_us: record.enqueued_at_us,
        }
    }

    pub(super) fn order(&self, ticket: &TicketKey) -> WaitOrder {
        WaitOrder {
            priority: self.priority,
            enqueued_at_us: self.enqueued_at_us,
            ticket: ticket.clone(),
        }
    }
}

impl KeyState {
    pub(super) fn new(id: Arc<KeyId>) -> Self {
        KeyState {
            id,
            record: KeyRecord::default(),
            holders: HashMap::default(),
            waiters: Flows::default(),
            shadow: None,
            shadow_job_max: 1,
        }
    }

    /// The max the shadow simulation enforces.
    pub(super) fn shadow_max(&self) -> u32 {
        self.record.key_max().unwrap_or(self.shadow_job_max)
    }

    /// The max a grant to `head` is checked against: the override, else the
    /// floating value, else the job's own max.
    pub(super) fn max_for(&self, head: &TicketRecord) -> u32 {
        max_for(&self.record, head)
    }

    pub(super) fn insert_waiter(&mut self, waiting: Waiting) {
        let flow = waiting.record.fairness_key.clone();
        self.waiters
            .insert(&flow, WaitOrder::of(&waiting.record), Box::new(waiting));
    }

    /// Some waiter (for the max of keys whose max is the key's own).
    pub(super) fn any_waiter(&self) -> Option<&TicketRecord> {
        self.waiters.iter().next().map(|(_, _, waiting)| &waiting.record)
    }

    /// Nothing to keep: no tickets, no stored settings, and no shadow-mode
    /// accounting to show (a shadow key's totals stay until its owner
    /// changes).
    pub(super) fn is_idle(&self) -> bool {
        self.holders.is_empty() && self.waiters.is_empty() && self.record.is_empty() && self.shadow.is_none()
    }
}
