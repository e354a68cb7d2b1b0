//! The pure core of limit-grant: for each key of one partition, its holders
//! and its waiting queue, and the grant decision (docs/architecture.md,
//! guarantee 1, "No overrun").
//! No I/O: decisions go into a write set and an outbox that the owner runtime
//! commits and publishes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use sluice_common::core::{checked_trace, CompactTraceContext, Core, Decisions, KeyStat, Query};
use sluice_common::kafka::{InMsg, Outbox};
use sluice_common::link::Link;
use sluice_common::owner::{apply_entries, Rejected, WriteSet};
use sluice_common::partition::{job_partition, key_partition};
use sluice_common::validate::{
    check_adaptive_values, check_floating_values, check_key_ref, check_text, check_ticket, check_u32, check_u64,
    FieldError, InputLimits, MAX_BACKOFF_MS, MAX_CONCURRENCY, MAX_ID_BYTES,
};
use sluice_proto::v1 as pb;

use crate::adaptive::{Adaptive, AdaptiveSettings, Change, Outcome};
use crate::flows::{self, Flows};
use crate::journal::{StoredTicket, TicketBatch, TicketSnapshot};
use crate::shadow::{ShadowSim, WouldHaveWaited};

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
    /// The job's flow among the key's waiters (`crate::flows`); empty: the
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
    /// An adaptive key's computed max (`crate::adaptive`), created by its
    /// first job.
    pub adaptive: Option<Adaptive>,
}

impl KeyRecord {
    fn is_empty(&self) -> bool {
        self.override_max.is_none()
            && self.floating.is_none()
            && self.flow_weights.is_empty()
            && self.mode.is_none()
            && self.adaptive.is_none()
    }

    /// The kind a grant of `ticket` reports.
    fn grant_kind(&self, ticket: &TicketRecord) -> pb::LimitKind {
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
    fn key_max(&self) -> Option<u32> {
        self.override_max
            .or(self.floating.as_ref().map(|floating| floating.current_max))
            .or(self.adaptive.as_ref().map(Adaptive::current))
    }
}

/// Whether `ticket` is granted in shadow mode (at once, accounted only):
/// the key's stored mode, else the job's own flag.
fn is_shadow(record: &KeyRecord, ticket: &TicketRecord) -> bool {
    match record.mode {
        Some(pb::LimitMode::Shadow) => true,
        Some(pb::LimitMode::Enforce) => false,
        _ => ticket.shadow,
    }
}

/// Queue order: lower priority number first, then earlier enqueue, then id.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct WaitOrder {
    priority: u32,
    enqueued_at_us: i64,
    ticket: TicketKey,
}

impl WaitOrder {
    fn of(record: &TicketRecord) -> Self {
        WaitOrder {
            priority: record.priority,
            enqueued_at_us: record.enqueued_at_us,
            ticket: record.ticket.clone(),
        }
    }
}

#[derive(Debug)]
struct Holder {
    record: TicketRecord,
    /// Last time admission stood behind this ticket (or it was granted/loaded).
    confirmed_at_ms: i64,
}

#[derive(Debug)]
struct Waiting {
    record: TicketRecord,
    confirmed_at_ms: i64,
}

#[derive(Debug)]
struct KeyState {
    /// (tenant, key), shared with the key's tickets.
    id: Arc<KeyId>,
    record: KeyRecord,
    holders: HashMap<TicketKey, Holder>,
    /// Waiters by flow, granted by weighted deficit round-robin across flows
    /// and in `WaitOrder` within one. A waiter is found by ticket through
    /// its `TicketPlace` (its flow, and the priority and enqueue time that
    /// make its `WaitOrder`).
    waiters: Flows<WaitOrder, Waiting>,
    /// What the limit would do, for tickets granted in shadow mode
    /// (`crate::shadow`); created by the first one.
    shadow: Option<ShadowSim<WaitOrder>>,
    /// The last shadow ticket's own max (the simulated max of a key with no
    /// override or floating max).
    shadow_job_max: u32,
}

/// Where a ticket (held or waiting) is: its key, and what orders it in the
/// key's queue (fixed for the ticket's life).
#[derive(Debug)]
struct TicketPlace {
    key_id: Arc<KeyId>,
    flow: Arc<str>,
    priority: u32,
    enqueued_at_us: i64,
}

impl TicketPlace {
    fn of(record: &TicketRecord) -> Self {
        TicketPlace {
            key_id: record.key_id.clone(),
            flow: record.fairness_key.clone(),
            priority: record.priority,
            enqueued_at_us: record.enqueued_at_us,
        }
    }

    fn order(&self, ticket: &TicketKey) -> WaitOrder {
        WaitOrder {
            priority: self.priority,
            enqueued_at_us: self.enqueued_at_us,
            ticket: ticket.clone(),
        }
    }
}

impl KeyState {
    fn new(id: Arc<KeyId>) -> Self {
        KeyState {
            id,
            record: KeyRecord::default(),
            holders: HashMap::new(),
            waiters: Flows::default(),
            shadow: None,
            shadow_job_max: 1,
        }
    }

    /// The max the shadow simulation enforces.
    fn shadow_max(&self) -> u32 {
        self.record.key_max().unwrap_or(self.shadow_job_max)
    }

    /// The max a grant to `head` is checked against: the override, else the
    /// floating value, else the job's own max.
    fn max_for(&self, head: &TicketRecord) -> u32 {
        max_for(&self.record, head)
    }

    fn insert_waiter(&mut self, waiting: Waiting) {
        let flow = waiting.record.fairness_key.clone();
        self.waiters.insert(&flow, WaitOrder::of(&waiting.record), waiting);
    }

    /// Some waiter (for the max of keys whose max is the key's own).
    fn any_waiter(&self) -> Option<&TicketRecord> {
        self.waiters.iter().next().map(|(_, _, waiting)| &waiting.record)
    }

    /// Nothing to keep: no tickets, no stored settings, and no shadow-mode
    /// accounting to show (a shadow key's totals stay until its owner
    /// changes).
    fn is_idle(&self) -> bool {
        self.holders.is_empty() && self.waiters.is_empty() && self.record.is_empty() && self.shadow.is_none()
    }
}

/// How many flows `DescribeKey` lists (the most waiting first).
const DESCRIBED_FLOWS: usize = 20;

/// A key's flows for `DescribeKey`: those with waiters (the most waiting
/// first, at most `DESCRIBED_FLOWS`) and those with a stored weight; and how
/// many flows have waiters.
fn describe_flows(state: &KeyState) -> (Vec<pb::FlowState>, u32) {
    let mut waiting: Vec<(&Arc<str>, usize, i64)> = state.waiters.waiting_flows().collect();
    let flows_waiting = u32::try_from(waiting.len()).unwrap_or(u32::MAX);
    waiting.sort_unstable_by(|left, right| right.1.cmp(&left.1).then_with(|| left.0.cmp(right.0)));
    waiting.truncate(DESCRIBED_FLOWS);
    let mut holders: HashMap<&str, u32> = HashMap::new();
    for holder in state.holders.values() {
        *holders.entry(&*holder.record.fairness_key).or_default() += 1;
    }
    let weights = &state.record.flow_weights;
    let flow_state = |name: &str, waiting: usize, deficit: i64| pb::FlowState {
        fairness_key: name.to_string(),
        weight: flows::weight_of(weights, name),
        stored_weight: weights.get(name).copied(),
        waiting: u32::try_from(waiting).unwrap_or(u32::MAX),
        holders: holders.get(name).copied().unwrap_or_default(),
        deficit,
    };
    let mut described: Vec<pb::FlowState> = waiting
        .iter()
        .map(|(name, count, deficit)| flow_state(name, *count, *deficit))
        .collect();
    for name in weights.keys() {
        if !waiting.iter().any(|(listed, _, _)| ***listed == **name) {
            let count = state.waiters.waiting_in(name);
            described.push(flow_state(name, count, 0));
        }
    }
    (described, flows_waiting)
}

/// The max a grant to `head` is checked against: the key's override, else
/// its floating value, else its adaptive value, else the job's own max.
fn max_for(record: &KeyRecord, head: &TicketRecord) -> u32 {
    record.key_max().unwrap_or(head.job_max)
}

/// What a release says about its attempt for an adaptive key: how long it
/// ran, and whether it ended well (failures, run timeouts and expired leases
/// are signs of overload). Nothing for releases that say nothing about the
/// downstream (cancelled, handed back, unwanted).
fn observed_run(release: &pb::ReleaseTicket) -> Option<(i64, Outcome)> {
    let run_ms = i64::try_from(release.run_ms?).unwrap_or(i64::MAX);
    let outcome = match pb::ReleaseReason::try_from(release.reason).ok()? {
        pb::ReleaseReason::Succeeded => Outcome::Succeeded,
        pb::ReleaseReason::Failed | pb::ReleaseReason::LeaseExpired => Outcome::Failed,
        _ => return None,
    };
    Some((run_ms, outcome))
}

/// What a batch decided: its writes, what it sends, the answers to its
/// queries and its effects.
pub type Decided = Decisions<LimitWrites, LimitAnswer, LimitEffect>;

/// What a decision records once its batch is committed, each once however
/// often it is sent again (`crate::observe` carries it out).
#[derive(Clone, Debug, PartialEq)]
pub enum LimitEffect {
    /// A new grant (not a re-send): the grant counter, the wait histogram
    /// and the `limit-grant.grant` span.
    Granted {
        record: TicketRecord,
        kind: pb::LimitKind,
        holders: usize,
        max: i64,
    },
    /// A shadow-mode key's simulated grant: the would-have-waited metric,
    /// and a `limit-grant.shadow` span on the job's trace.
    ShadowWaited {
        key_id: Arc<KeyId>,
        simulated: WouldHaveWaited,
    },
    /// A grant in shadow mode took the key's holders over its max.
    ShadowExceeded { key_id: Arc<KeyId> },
    /// An adaptive key's computed max changed (logged and counted).
    AdaptiveChanged { key_id: Arc<KeyId>, change: Change },
    /// A ticket nobody stood behind was reclaimed (logged).
    TicketReclaimed { key_id: Arc<KeyId>, ticket: TicketKey },
}

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
    fn save_key(&mut self, key_id: &KeyId, record: &KeyRecord) {
        let row = (!record.is_empty()).then(|| record.clone());
        self.keys.insert(key_id.clone(), row);
    }

    fn upsert(&mut self, record: TicketRecord) {
        self.deletes.remove(&record.ticket);
        self.upserts.insert(record.ticket.clone(), record);
    }

    fn delete(&mut self, ticket: &TicketKey) {
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

/// What this instance's gRPC handlers and admission's links ask of a
/// partition.
#[derive(Clone, Debug, PartialEq)]
pub enum LimitQuery {
    /// Answered with `LimitAnswer::KeyState`.
    SetLimit {
        tenant: String,
        key: String,
        change: LimitChange,
    },
    /// Answered with `LimitAnswer::Described`.
    DescribeKey {
        tenant: String,
        key: String,
        ticket: Option<TicketKey>,
        first_waiters: usize,
    },
    /// The partition's keys of `tenant` starting with `prefix`, after `after`
    /// in key order, at most `limit` (`ListKeys` gathers every partition's).
    /// Answered with `LimitAnswer::Keys`.
    ListKeys {
        tenant: String,
        prefix: String,
        after: String,
        limit: usize,
    },
    /// Limit commands from admission's link (the hot path), from the
    /// admission instance `client`. Answered `Applied` (after the commit).
    Link { commands: Vec<Vec<u8>>, client: Arc<str> },
    /// A stream now takes the grants of these job partitions: send again
    /// the grants of every ticket held for their jobs. Answered `Applied`.
    ResendGrants { job_partitions: Vec<i32> },
}

/// The answer to a `LimitQuery`.
#[derive(Clone, Debug, PartialEq)]
pub enum LimitAnswer {
    /// The key after a `SetLimit`.
    KeyState(pb::KeyState),
    Described(pb::DescribeKeyResponse),
    Keys(Vec<pb::KeySummary>),
    /// Link commands applied (and, once the answer arrives, committed).
    Applied,
}

/// A change to a key's settings (`SetLimit`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitChange {
    /// Set (or, `None`, clear) the override of the key's max.
    Max(Option<u32>),
    /// Set (or, `None`, reset to the default) a flow's weight.
    FlowWeight { fairness_key: String, weight: Option<u32> },
    /// Store the key's mode (or, `None`, clear it).
    Mode(Option<pb::LimitMode>),
}

#[derive(Debug)]
struct PendingSweep {
    snapshot_at_ms: i64,
    grace_ms: i64,
    job_partitions: HashSet<i32>,
    parts: u32,
    seen_parts: HashSet<u32>,
    received_at_ms: i64,
}

/// One owned partition of limit-grant.
pub struct LimitPartition {
    settings: PartitionSettings,
    epoch: i64,
    keys: HashMap<KeyId, KeyState>,
    /// Where each ticket (held or waiting) is.
    ticket_keys: HashMap<TicketKey, TicketPlace>,
    sweeps: HashMap<String, PendingSweep>,
    /// The last journal row (or snapshot) saved.
    journal_seq: i64,
    journal_bytes_since_snapshot: usize,
    last_snapshot_bytes: usize,
    /// Write a snapshot at the next batch (none saved yet).
    snapshot_due: bool,
}

/// The journal may grow to the last snapshot's size, and at least this much,
/// before a new snapshot replaces it.
const MIN_JOURNAL_BEFORE_SNAPSHOT: usize = 1 << 20;

impl LimitPartition {
    pub fn new(settings: PartitionSettings, epoch: i64) -> Self {
        LimitPartition {
            settings,
            epoch,
            keys: HashMap::new(),
            ticket_keys: HashMap::new(),
            sweeps: HashMap::new(),
            journal_seq: 0,
            journal_bytes_since_snapshot: 0,
            last_snapshot_bytes: 0,
            snapshot_due: true,
        }
    }

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
    fn close_batch(&mut self, writes: &mut LimitWrites) {
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

    /// This partition's part of `ListKeys`: keys with tickets or settings.
    pub fn list_keys(&self, tenant: &str, prefix: &str, after: &str, limit: usize) -> Vec<pb::KeySummary> {
        let mut found: Vec<&KeyState> = self
            .keys
            .iter()
            .filter(|((key_tenant, key), state)| {
                key_tenant == tenant && key.starts_with(prefix) && key.as_str() > after && !state.is_idle()
            })
            .map(|(_, state)| state)
            .collect();
        found.sort_unstable_by(|left, right| left.id.1.cmp(&right.id.1));
        found.truncate(limit);
        found
            .into_iter()
            .map(|state| {
                let floating_ticket = state
                    .holders
                    .values()
                    .map(|holder| &holder.record)
                    .chain(state.waiters.iter().map(|(_, _, waiting)| &waiting.record))
                    .next()
                    .is_some_and(|record| record.floating);
                pb::KeySummary {
                    key: Some(pb::KeyRef {
                        tenant: state.id.0.clone(),
                        key: state.id.1.clone(),
                    }),
                    kind: if floating_ticket || state.record.floating.is_some() {
                        pb::LimitKind::Floating as i32
                    } else if state.record.adaptive.is_some() {
                        pb::LimitKind::Adaptive as i32
                    } else {
                        pb::LimitKind::Concurrency as i32
                    },
                    holders: u32::try_from(state.holders.len()).unwrap_or(u32::MAX),
                    waiting: u32::try_from(state.waiters.len()).unwrap_or(u32::MAX),
                    override_max: state.record.override_max,
                    floating_max: state.record.floating.as_ref().map(|floating| floating.current_max),
                    adaptive_max: state.record.adaptive.as_ref().map(Adaptive::current),
                }
            })
            .collect()
    }

    /// Restore loaded rows. Every restored ticket gets one grace period from
    /// `now_ms` (a new owner gives every ticket one lease of grace).
    /// Flows join their key's round in the order of their first waiters.
    pub fn restore(&mut self, now_ms: i64, keys: Vec<(KeyId, KeyRecord)>, mut tickets: Vec<TicketRecord>) {
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

    /// Apply one decoded command.
    pub fn apply_command(&mut self, now_ms: i64, command: pb::LimitCommand, out: &mut Decided) -> Result<(), String> {
        self.check_command(&command)?;
        let trace = checked_trace(&command.trace.unwrap_or_default());
        let Some(inner) = command.command else {
            return Err("limit command without a command".to_string());
        };
        match inner {
            pb::limit_command::Command::Acquire(acquire) => self.acquire(now_ms, acquire, trace, out),
            pb::limit_command::Command::Release(release) => {
                let key_id = self.checked_key(release.key.as_ref())?;
                let observed = observed_run(&release);
                let ticket = TicketKey::from_proto(&release.ticket.unwrap_or_default());
                self.release(now_ms, &key_id, &ticket, observed, out);
                Ok(())
            }
            pb::limit_command::Command::StandBehind(stand_behind) => {
                self.stand_behind(now_ms, stand_behind, out);
                Ok(())
            }
            pb::limit_command::Command::SetOverride(set_override) => {
                let key_id = self.checked_key(set_override.key.as_ref())?;
                self.set_override(now_ms, &key_id, set_override.max, out);
                Ok(())
            }
            pb::limit_command::Command::SetFloatingMax(set_max) => {
                let key_id = self.checked_key(set_max.key.as_ref())?;
                self.set_floating_max(now_ms, &key_id, set_max.max, &set_max.task_id, out);
                Ok(())
            }
            pb::limit_command::Command::DeleteFloating(delete) => {
                let key_id = self.checked_key(delete.key.as_ref())?;
                if let Some(state) = self.keys.get_mut(&key_id) {
                    if state.record.floating.take().is_some() {
                        out.writes.keys.insert(key_id.clone(), Some(state.record.clone()));
                    }
                }
                self.grant_waiters_that_fit(now_ms, &key_id, out);
                Ok(())
            }
        }
    }

    /// Everything a command must satisfy before it changes anything: the
    /// bounds admission checks at the edge, so what admission accepts is
    /// accepted here, and a command that fails them is set aside alone.
    pub fn check_command(&self, command: &pb::LimitCommand) -> Result<(), String> {
        let key = self.check_fields(command).map_err(|error| error.to_string())?;
        match key {
            Some(key) => self.checked_key(Some(key)).map(|_| ()),
            None => Ok(()),
        }
    }

    /// The fields of `command`; its key when it names one.
    fn check_fields<'a>(&self, command: &'a pb::LimitCommand) -> Result<Option<&'a pb::KeyRef>, FieldError> {
        use pb::limit_command::Command;
        let input = self.settings.input;
        let Some(inner) = &command.command else {
            return Err(FieldError::new("command", "must be set"));
        };
        let key = match inner {
            Command::Acquire(acquire) => {
                check_ticket("acquire.ticket", acquire.ticket.as_ref())?;
                check_u32("acquire.priority", acquire.priority, 0, 99)?;
                check_text("acquire.fairness_key", &acquire.fairness_key, input.max_key_bytes)?;
                match &acquire.limit {
                    Some(pb::acquire_ticket::Limit::MaxConcurrency(max)) => {
                        check_u32("acquire.max_concurrency", *max, 1, MAX_CONCURRENCY)?;
                    }
                    Some(pb::acquire_ticket::Limit::Floating(floating)) => {
                        check_floating_values("acquire.floating", floating, input.max_floating_metadata_bytes)?;
                    }
                    Some(pb::acquire_ticket::Limit::Adaptive(adaptive)) => {
                        check_adaptive_values("acquire.adaptive", adaptive)?;
                    }
                    None => return Err(FieldError::new("acquire.limit", "must be set")),
                }
                acquire.key.as_ref()
            }
            Command::Release(release) => {
                check_ticket("release.ticket", release.ticket.as_ref())?;
                release.key.as_ref()
            }
            Command::StandBehind(stand_behind) => {
                check_text("stand_behind.sweep_id", &stand_behind.sweep_id, MAX_ID_BYTES)?;
                check_u32(
                    "stand_behind.part",
                    stand_behind.part,
                    0,
                    stand_behind.parts.saturating_sub(1),
                )?;
                check_u64(
                    "stand_behind.grace_ms",
                    stand_behind.grace_ms,
                    0,
                    u64::try_from(MAX_BACKOFF_MS).unwrap_or(u64::MAX),
                )?;
                for (index, ticket) in stand_behind.tickets.iter().enumerate() {
                    check_ticket(&format!("stand_behind.tickets[{index}]"), Some(ticket))?;
                }
                return Ok(None);
            }
            Command::SetOverride(set_override) => {
                if let Some(max) = set_override.max {
                    check_u32("set_override.max", max, 0, MAX_CONCURRENCY)?;
                }
                set_override.key.as_ref()
            }
            Command::SetFloatingMax(set_max) => {
                check_u32("set_floating_max.max", set_max.max, 1, MAX_CONCURRENCY)?;
                check_text("set_floating_max.task_id", &set_max.task_id, MAX_ID_BYTES)?;
                set_max.key.as_ref()
            }
            Command::DeleteFloating(delete) => delete.key.as_ref(),
        };
        check_key_ref("key", key, input.max_key_bytes)?;
        Ok(key)
    }

    /// The key of a command, refused unless it hashes to this partition.
    fn checked_key(&self, key: Option<&pb::KeyRef>) -> Result<KeyId, String> {
        let Some(key) = key else {
            return Err("command without a key".to_string());
        };
        let expected = key_partition(&key.tenant, &key.key, self.settings.limit_partitions);
        if expected != self.settings.partition {
            return Err(format!(
                "key ({:?}, {:?}) hashes to partition {expected}, not {}: a producer partitions differently \
                 or the topic's partition count changed",
                key.tenant, key.key, self.settings.partition
            ));
        }
        Ok((key.tenant.clone(), key.key.clone()))
    }

    fn acquire(
        &mut self,
        now_ms: i64,
        acquire: pb::AcquireTicket,
        trace: pb::TraceContext,
        out: &mut Decided,
    ) -> Result<(), String> {
        let key_id = self.checked_key(acquire.key.as_ref())?;
        let ticket = TicketKey::from_proto(&acquire.ticket.unwrap_or_default());
        if let Some(place) = self.ticket_keys.get(&ticket) {
            // A duplicate: re-send the grant if held; a waiter just waits.
            if let Some(state) = self.keys.get_mut(&*place.key_id) {
                let holders = state.holders.len();
                if let Some(holder) = state.holders.get_mut(&ticket) {
                    holder.confirmed_at_ms = holder.confirmed_at_ms.max(now_ms);
                    let record = holder.record.clone();
                    let max = i64::from(state.max_for(&record));
                    let kind = state.record.grant_kind(&record);
                    self.emit_grant(&record, kind, holders, max, &mut out.sends);
                }
            }
            return Ok(());
        }
        let (job_max, floating_spec, adaptive_settings) = match acquire.limit {
            Some(pb::acquire_ticket::Limit::MaxConcurrency(max)) => (max, None, None),
            Some(pb::acquire_ticket::Limit::Floating(spec)) => (spec.default_max, Some(spec), None),
            Some(pb::acquire_ticket::Limit::Adaptive(spec)) => {
                let settings = AdaptiveSettings::of(&spec);
                (settings.initial, None, Some(settings))
            }
            None => return Err(format!("acquire for job {} has no limit", ticket.job_id)),
        };
        let state = self.key_state(&key_id);
        if let Some(settings) = adaptive_settings {
            if state.record.adaptive.is_none() {
                // The first job creates the shared state; later jobs' values are ignored.
                state.record.adaptive = Some(Adaptive::new(settings));
                out.writes.save_key(&key_id, &state.record);
            }
        }
        if let Some(spec) = &floating_spec {
            if state.record.floating.is_none() {
                // The first job creates the shared state; later jobs' values are ignored.
                state.record.floating = Some(FloatingRecord {
                    current_max: spec.default_max.max(1),
                    default_max: spec.default_max.max(1),
                    refresh_interval_ms: spec.refresh_interval_ms,
                    metadata: spec.metadata.clone().into_iter().collect(),
                    last_due_ms: None,
                    last_set_ms: None,
                    last_task_id: None,
                });
                out.writes.keys.insert(key_id.clone(), Some(state.record.clone()));
            }
        }
        let record = TicketRecord {
            ticket: ticket.clone(),
            key_id: state.id.clone(),
            held: false,
            priority: acquire.priority,
            enqueued_at_us: acquire.enqueued_at_us,
            job_max,
            floating: floating_spec.is_some(),
            waiting_since_ms: now_ms,
            position_at_enqueue: 0,
            granted_at_ms: None,
            trace: CompactTraceContext::from_context(&trace),
            fairness_key: state
                .waiters
                .flow_named(&acquire.fairness_key)
                .unwrap_or_else(|| Arc::from(acquire.fairness_key.as_str())),
            shadow: acquire.shadow,
        };
        let trace_for_refresh = trace;
        // Its place in its flow.
        let ahead = state
            .waiters
            .ahead_in_flow(&record.fairness_key, &WaitOrder::of(&record));
        let record = TicketRecord {
            position_at_enqueue: u32::try_from(ahead).unwrap_or(u32::MAX),
            ..record
        };
        out.writes.upsert(record.clone());
        let place = TicketPlace::of(&record);
        if is_shadow(&state.record, &record) {
            state.shadow_job_max = record.job_max.max(1);
            state.shadow.get_or_insert_with(ShadowSim::default).arrive(
                record.ticket.clone(),
                WaitOrder::of(&record),
                now_ms,
                record.trace.clone(),
            );
        }
        state.insert_waiter(Waiting {
            record,
            confirmed_at_ms: now_ms,
        });
        self.ticket_keys.insert(ticket, place);
        self.grant_waiters_that_fit(now_ms, &key_id, out);
        self.refresh_if_due(now_ms, &key_id, &trace_for_refresh, out);
        Ok(())
    }

    /// Free a held ticket or remove a waiting one. `observed`: how long a
    /// held ticket's attempt ran and how it ended, for an adaptive key.
    fn release(
        &mut self,
        now_ms: i64,
        key_id: &KeyId,
        ticket: &TicketKey,
        observed: Option<(i64, Outcome)>,
        out: &mut Decided,
    ) {
        let Some(state) = self.keys.get_mut(key_id) else {
            return;
        };
        let place = self.ticket_keys.get(ticket);
        let was_held = state.holders.remove(ticket).is_some();
        let removed =
            was_held || place.is_some_and(|place| state.waiters.remove(&place.flow, &place.order(ticket)).is_some());
        if !removed {
            return;
        }
        if let (true, Some((run_ms, outcome)), Some(adaptive)) = (was_held, observed, state.record.adaptive.as_mut()) {
            if let Some(change) = adaptive.observe(now_ms, ticket, run_ms, outcome) {
                out.writes.save_key(key_id, &state.record);
                out.effect(LimitEffect::AdaptiveChanged {
                    key_id: state.id.clone(),
                    change,
                });
            }
        }
        if let Some(shadow) = state.shadow.as_mut() {
            shadow.release(ticket, now_ms);
        }
        self.ticket_keys.remove(ticket);
        out.writes.delete(ticket);
        self.grant_waiters_that_fit(now_ms, key_id, out);
        self.refresh_if_due(now_ms, key_id, &pb::TraceContext::default(), out);
    }

    /// A floating key's refresh is due when a job using it is enqueued or
    /// released, the key has waiters, and the refresh interval has passed
    /// since the last refresh-due event (or none was ever sent: the first
    /// waiter triggers the first refresh). The refresh-dispatcher keeps at
    /// most one refresh in flight per key and ignores a due event it has
    /// already seen (same `due_at_ms`), so re-sending one is harmless.
    fn refresh_if_due(&mut self, now_ms: i64, key_id: &KeyId, trace: &pb::TraceContext, out: &mut Decided) {
        let Some(state) = self.keys.get_mut(key_id) else {
            return;
        };
        if state.waiters.is_empty() {
            return;
        }
        let waiting = state.waiters.len();
        let Some(floating) = state.record.floating.as_mut() else {
            return;
        };
        let interval_ms = i64::try_from(floating.refresh_interval_ms).unwrap_or(i64::MAX);
        let due = floating
            .last_due_ms
            .is_none_or(|last_due_ms| now_ms.saturating_sub(last_due_ms) >= interval_ms);
        if !due {
            return;
        }
        floating.last_due_ms = Some(now_ms);
        let floating = floating.clone();
        out.writes.keys.insert(key_id.clone(), Some(state.record.clone()));
        self.emit_refresh_due(key_id, &floating, waiting, trace, &mut out.sends);
    }

    fn emit_refresh_due(
        &self,
        key_id: &KeyId,
        floating: &FloatingRecord,
        waiting: usize,
        trace: &pb::TraceContext,
        outbox: &mut Outbox,
    ) {
        let Some(due_at_ms) = floating.last_due_ms else {
            return;
        };
        let event = pb::RefreshDue {
            trace: Some(trace.clone()),
            key: Some(pb::KeyRef {
                tenant: key_id.0.clone(),
                key: key_id.1.clone(),
            }),
            current_max: floating.current_max,
            refresh_interval_ms: floating.refresh_interval_ms,
            metadata: floating.metadata.clone().into_iter().collect(),
            due_at_ms,
            waiting: u32::try_from(waiting).unwrap_or(u32::MAX),
            default_max: floating.default_max,
        };
        let partition = key_partition(&key_id.0, &key_id.1, self.settings.refresh_due_partitions);
        outbox.push_entry(
            &self.settings.refresh_due_topic,
            partition,
            &event,
            self.settings.max_message_bytes,
        );
    }

    fn set_override(&mut self, now_ms: i64, key_id: &KeyId, max: Option<u32>, out: &mut Decided) {
        let state = self.key_state(key_id);
        state.record.override_max = max;
        out.writes.save_key(key_id, &state.record);
        self.grant_waiters_that_fit(now_ms, key_id, out);
    }

    /// Store a flow's weight (`None`, or the default: forget it). It counts
    /// from the flow's next turn; nothing is granted by it alone (a weight
    /// changes the order of grants, not how many fit).
    fn set_flow_weight(&mut self, key_id: &KeyId, fairness_key: String, weight: Option<u32>, writes: &mut LimitWrites) {
        let state = self.key_state(key_id);
        match weight.map(|weight| weight.clamp(1, flows::MAX_WEIGHT)) {
            Some(weight) if weight != flows::DEFAULT_WEIGHT => {
                state.record.flow_weights.insert(fairness_key, weight);
            }
            _ => {
                state.record.flow_weights.remove(&fairness_key);
            }
        }
        writes.save_key(key_id, &state.record);
        if state.is_idle() {
            self.keys.remove(key_id);
        }
    }

    /// Store the key's mode. It applies at once: to shadow, the grant decision grants
    /// every waiter; to enforce, the next grants wait for room (holders
    /// granted in shadow mode keep their slots, as after a lowered max) and
    /// the simulation stops (its totals stay).
    fn set_mode(&mut self, now_ms: i64, key_id: &KeyId, mode: Option<pb::LimitMode>, out: &mut Decided) {
        let state = self.key_state(key_id);
        state.record.mode = mode;
        if mode == Some(pb::LimitMode::Enforce) {
            if let Some(shadow) = state.shadow.as_mut() {
                shadow.stop();
            }
        }
        out.writes.save_key(key_id, &state.record);
        self.grant_waiters_that_fit(now_ms, key_id, out);
    }

    fn set_floating_max(&mut self, now_ms: i64, key_id: &KeyId, max: u32, task_id: &str, out: &mut Decided) {
        let Some(state) = self.keys.get_mut(key_id) else {
            return;
        };
        let Some(floating) = state.record.floating.as_mut() else {
            return;
        };
        if max == 0 || floating.last_task_id.as_deref() == Some(task_id) {
            return;
        }
        floating.current_max = max;
        floating.last_set_ms = Some(now_ms);
        floating.last_task_id = Some(task_id.to_string());
        out.writes.keys.insert(key_id.clone(), Some(state.record.clone()));
        self.grant_waiters_that_fit(now_ms, key_id, out);
    }

    /// The grant decision: grant the next waiter (by flow, then queue
    /// order) while it fits under the max. A flow's head is never overtaken:
    /// if it does not fit, nobody is granted.
    fn grant_waiters_that_fit(&mut self, now_ms: i64, key_id: &KeyId, out: &mut Decided) {
        let Some(state) = self.keys.get_mut(key_id) else {
            return;
        };
        let mut granted = Vec::new();
        let weights = &state.record.flow_weights;
        while let Some((_, head)) = state.waiters.next(|flow| flows::weight_of(weights, flow)) {
            let max = max_for(&state.record, &head.record);
            let kind = state.record.grant_kind(&head.record);
            let shadow = is_shadow(&state.record, &head.record);
            // In shadow mode the limit is accounted, not enforced.
            if !shadow && state.holders.len() >= usize::try_from(max).unwrap_or(usize::MAX) {
                break;
            }
            let Some((_, waiting)) = state.waiters.take_next() else {
                break;
            };
            let mut record = waiting.record;
            record.held = true;
            record.granted_at_ms = Some(now_ms);
            out.writes.upsert(record.clone());
            state.holders.insert(
                record.ticket.clone(),
                Holder {
                    record: record.clone(),
                    confirmed_at_ms: now_ms.max(waiting.confirmed_at_ms),
                },
            );
            debug_assert!(
                shadow || state.holders.len() <= usize::try_from(max).unwrap_or(usize::MAX),
                "overrun: {} holders over max {max}",
                state.holders.len()
            );
            if shadow {
                let exceeded = state
                    .shadow
                    .get_or_insert_with(ShadowSim::default)
                    .real_grant(state.holders.len(), max);
                if exceeded {
                    out.effect(LimitEffect::ShadowExceeded {
                        key_id: state.id.clone(),
                    });
                }
            }
            if let Some(adaptive) = state.record.adaptive.as_mut() {
                adaptive.granted(&record.ticket);
            }
            granted.push((record, kind, state.holders.len(), i64::from(max)));
        }
        if let Some(adaptive) = state.record.adaptive.as_mut() {
            // The window used the whole max: jobs wait, or the holders fill it.
            if !state.waiters.is_empty() || state.holders.len() >= usize::try_from(adaptive.current()).unwrap_or(0) {
                adaptive.saturated();
            }
        }
        let shadow_max = state.shadow_max();
        let would_have_waited = state
            .shadow
            .as_mut()
            .map(|shadow| shadow.pump(shadow_max))
            .unwrap_or_default();
        let idle = state.is_idle();
        let shared_id = state.id.clone();
        for (record, kind, holders, max) in granted {
            self.emit_grant(&record, kind, holders, max, &mut out.sends);
            out.effect(LimitEffect::Granted {
                record,
                kind,
                holders,
                max,
            });
        }
        for simulated in would_have_waited {
            out.effect(LimitEffect::ShadowWaited {
                key_id: shared_id.clone(),
                simulated,
            });
        }
        if idle {
            self.keys.remove(key_id);
        }
    }

    /// The grant event to admission (a new grant, or one sent again).
    fn emit_grant(
        &self,
        record: &TicketRecord,
        limit_kind: pb::LimitKind,
        holders: usize,
        max: i64,
        outbox: &mut Outbox,
    ) {
        let event = pb::GrantEvent {
            trace: Some(record.trace.to_context()),
            ticket: Some(record.ticket.to_proto()),
            key: Some(pb::KeyRef {
                tenant: record.tenant().to_string(),
                key: record.key().to_string(),
            }),
            kind: limit_kind as i32,
            granted_at_ms: record.granted_at_ms.unwrap_or_default(),
            holders: u32::try_from(holders).unwrap_or(u32::MAX),
            max,
            waiting_since_ms: record.waiting_since_ms,
            position_at_enqueue: record.position_at_enqueue,
            unthrottled: false,
        };
        let partition = job_partition(&record.ticket.job_id, self.settings.grants_partitions);
        outbox.push_link(Link::Admission, partition, &event);
    }

    /// Admission waits for the grant of these tickets, and this owner holds
    /// them as granted: their grants were lost on the way (a stream that
    /// broke, a grant sent to an instance that had just lost the job's
    /// partition). Sent again; a re-send, not a new decision (not
    /// observed).
    fn resend_lost_grants(&self, waiting: &[pb::TicketId], outbox: &mut Outbox) {
        for ticket in waiting {
            let ticket = TicketKey::from_proto(ticket);
            let Some(place) = self.ticket_keys.get(&ticket) else {
                continue;
            };
            let Some(state) = self.keys.get(&*place.key_id) else {
                continue;
            };
            let Some(holder) = state.holders.get(&ticket) else {
                continue;
            };
            let max = i64::from(state.max_for(&holder.record));
            let kind = state.record.grant_kind(&holder.record);
            tracing::debug!(job_id = %ticket.job_id, attempt = ticket.attempt, step = ticket.step, "admission still waits for a grant this owner made: sending it again");
            self.emit_grant(&holder.record, kind, state.holders.len(), max, outbox);
        }
    }

    /// Admission states the tickets it stands behind. When every part of a
    /// sweep has arrived, tickets of the covered jobs that nobody confirmed
    /// within the grace before the sweep's snapshot expire.
    fn stand_behind(&mut self, now_ms: i64, stand_behind: pb::StandBehind, out: &mut Decided) {
        let snapshot = stand_behind.snapshot_at_ms;
        self.resend_lost_grants(&stand_behind.waiting, &mut out.sends);
        for ticket in &stand_behind.tickets {
            let ticket = TicketKey::from_proto(ticket);
            let Some(place) = self.ticket_keys.get(&ticket) else {
                continue;
            };
            let Some(state) = self.keys.get_mut(&*place.key_id) else {
                continue;
            };
            if let Some(holder) = state.holders.get_mut(&ticket) {
                holder.confirmed_at_ms = holder.confirmed_at_ms.max(snapshot);
            } else if let Some(waiting) = state.waiters.get_mut(&place.flow, &place.order(&ticket)) {
                waiting.confirmed_at_ms = waiting.confirmed_at_ms.max(snapshot);
            }
        }
        let parts = stand_behind.parts.max(1);
        let grace_ms = if stand_behind.grace_ms > 0 {
            i64::try_from(stand_behind.grace_ms).unwrap_or(i64::MAX)
        } else {
            self.settings.ticket_grace_ms
        };
        let pending = self
            .sweeps
            .entry(stand_behind.sweep_id.clone())
            .or_insert_with(|| PendingSweep {
                snapshot_at_ms: snapshot,
                grace_ms,
                job_partitions: stand_behind
                    .job_partitions
                    .iter()
                    .filter_map(|partition| i32::try_from(*partition).ok())
                    .collect(),
                parts,
                seen_parts: HashSet::new(),
                received_at_ms: now_ms,
            });
        pending.seen_parts.insert(stand_behind.part);
        if u32::try_from(pending.seen_parts.len()).unwrap_or(u32::MAX) >= pending.parts {
            if let Some(complete) = self.sweeps.remove(&stand_behind.sweep_id) {
                self.expire_unconfirmed(now_ms, &complete, out);
            }
        }
        // A sweep whose parts never all arrive (its sender died) is dropped.
        let horizon = now_ms - 10 * self.settings.ticket_grace_ms.max(1);
        self.sweeps.retain(|_, sweep| sweep.received_at_ms >= horizon);
    }

    fn expire_unconfirmed(&mut self, now_ms: i64, sweep: &PendingSweep, out: &mut Decided) {
        let cutoff = sweep.snapshot_at_ms - sweep.grace_ms;
        let grants_partitions = self.settings.grants_partitions;
        let mut expired: Vec<(Arc<KeyId>, TicketKey)> = Vec::new();
        for state in self.keys.values() {
            let covered = |ticket: &TicketKey| {
                sweep
                    .job_partitions
                    .contains(&job_partition(&ticket.job_id, grants_partitions))
            };
            for (ticket, holder) in &state.holders {
                if holder.confirmed_at_ms < cutoff && covered(ticket) {
                    expired.push((state.id.clone(), ticket.clone()));
                }
            }
            for (_, _, waiting) in state.waiters.iter() {
                if waiting.confirmed_at_ms < cutoff && covered(&waiting.record.ticket) {
                    expired.push((state.id.clone(), waiting.record.ticket.clone()));
                }
            }
        }
        for (key_id, ticket) in expired {
            out.effect(LimitEffect::TicketReclaimed {
                key_id: key_id.clone(),
                ticket: ticket.clone(),
            });
            self.release(now_ms, &key_id, &ticket, None, out);
        }
    }

    fn describe(&self, tenant: &str, key: &str, first_waiters: usize) -> pb::KeyState {
        let key_id = (tenant.to_string(), key.to_string());
        let mut described = pb::KeyState {
            key: Some(pb::KeyRef {
                tenant: tenant.to_string(),
                key: key.to_string(),
            }),
            kind: pb::LimitKind::Concurrency as i32,
            partition: u32::try_from(self.settings.partition).unwrap_or_default(),
            epoch: u64::try_from(self.epoch).unwrap_or_default(),
            ..Default::default()
        };
        let Some(state) = self.keys.get(&key_id) else {
            return described;
        };
        described.override_max = state.record.override_max;
        described.paused = state.record.override_max == Some(0);
        if let Some(floating) = &state.record.floating {
            described.kind = pb::LimitKind::Floating as i32;
            described.floating_max = Some(floating.current_max);
            described.floating = Some(pb::FloatingConcurrencyLimit {
                key: key.to_string(),
                default_max: floating.default_max,
                refresh_interval_ms: floating.refresh_interval_ms,
                metadata: floating.metadata.clone().into_iter().collect(),
            });
        }
        if let Some(adaptive) = &state.record.adaptive {
            described.kind = pb::LimitKind::Adaptive as i32;
            described.adaptive = Some(adaptive.describe(key));
        }
        let reference = state
            .any_waiter()
            .or_else(|| state.holders.values().next().map(|holder| &holder.record));
        described.effective_max = reference.map(|record| i64::from(state.max_for(record)));
        if described.effective_max.is_none() {
            described.effective_max = state.record.key_max().map(i64::from);
        }
        let mut holders: Vec<&Holder> = state.holders.values().collect();
        holders.sort_by(|left, right| left.record.ticket.cmp(&right.record.ticket));
        described.holders = holders
            .into_iter()
            .map(|holder| pb::Holder {
                ticket: Some(holder.record.ticket.to_proto()),
                granted_at_ms: holder.record.granted_at_ms.unwrap_or_default(),
                expires_unless_confirmed_at_ms: holder.confirmed_at_ms + self.settings.ticket_grace_ms,
                lease_expires_at_ms: None,
            })
            .collect();
        described.waiting = u32::try_from(state.waiters.len()).unwrap_or(u32::MAX);
        // The first waiters of every flow, in queue order across flows (an
        // introspection call: it may look at every flow).
        let mut first: Vec<(&WaitOrder, &Waiting)> = state
            .waiters
            .waiting_flows()
            .flat_map(|(flow, _, _)| state.waiters.first_in_flow(flow, first_waiters))
            .collect();
        first.sort_unstable_by(|left, right| left.0.cmp(right.0));
        described.first_waiters = first
            .into_iter()
            .map(|(_, waiting)| waiting)
            .take(first_waiters)
            .map(|waiting| pb::Waiter {
                ticket: Some(waiting.record.ticket.to_proto()),
                priority: waiting.record.priority,
                enqueued_at_us: waiting.record.enqueued_at_us,
                waiting_since_ms: waiting.record.waiting_since_ms,
                job_max: waiting.record.job_max,
            })
            .collect();
        described.oldest_waiting_since_ms = state
            .waiters
            .iter()
            .map(|(_, _, waiting)| waiting.record.waiting_since_ms)
            .min();
        (described.flows, described.flows_waiting) = describe_flows(state);
        described.mode = state.record.mode.map(|mode| mode as i32);
        described.shadow = state.shadow.as_ref().map(|shadow| pb::ShadowStats {
            would_hold: u32::try_from(shadow.would_hold()).unwrap_or(u32::MAX),
            would_wait: u32::try_from(shadow.would_wait()).unwrap_or(u32::MAX),
            would_have_waited_count: shadow.totals.would_have_waited_count,
            would_have_waited_ms_total: shadow.totals.would_have_waited_ms_total,
            would_have_waited_ms_max: shadow.totals.would_have_waited_ms_max,
            would_have_exceeded: shadow.totals.would_have_exceeded,
        });
        described
    }

    fn describe_with_ticket(
        &self,
        tenant: &str,
        key: &str,
        ticket: Option<&TicketKey>,
        first_waiters: usize,
    ) -> pb::DescribeKeyResponse {
        let state = self.describe(tenant, key, first_waiters);
        let mut response = pb::DescribeKeyResponse {
            state: Some(state),
            ticket_position: None,
            ticket_held: false,
        };
        if let (Some(ticket), Some(key_state)) = (ticket, self.keys.get(&(tenant.to_string(), key.to_string()))) {
            response.ticket_held = key_state.holders.contains_key(ticket);
            response.ticket_position = self
                .ticket_keys
                .get(ticket)
                .filter(|place| key_state.waiters.contains(&place.flow, &place.order(ticket)))
                .map(|place| key_state.waiters.ahead_in_flow(&place.flow, &place.order(ticket)))
                .and_then(|position| u32::try_from(position).ok());
        }
        response
    }

    /// Send again the grants of every ticket held for jobs in
    /// `job_partitions` (a stream now takes them).
    fn resend_grants(&self, job_partitions: &[i32], outbox: &mut Outbox) {
        let wanted: HashSet<i32> = job_partitions.iter().copied().collect();
        let partitions = self.settings.grants_partitions;
        for state in self.keys.values() {
            for holder in state.holders.values() {
                if wanted.contains(&job_partition(&holder.record.ticket.job_id, partitions)) {
                    let max = i64::from(state.max_for(&holder.record));
                    let kind = state.record.grant_kind(&holder.record);
                    self.emit_grant(&holder.record, kind, state.holders.len(), max, outbox);
                }
            }
        }
    }

    /// Apply limit commands from admission's link: each one that can never
    /// be applied is set aside alone, with the reason.
    fn apply_link_commands(&mut self, now_ms: i64, commands: Vec<Vec<u8>>, client: &str, out: &mut Decided) {
        for entry in commands {
            let outcome = <pb::LimitCommand as prost::Message>::decode(entry.as_slice())
                .map_err(|error| format!("undecodable limit command: {error}"))
                .and_then(|command| self.apply_command(now_ms, command, out));
            if let Err(reason) = outcome {
                out.rejected.push(Rejected {
                    offset: -1,
                    entry,
                    reason: format!("from admission {client} over its link: {reason}"),
                });
            }
        }
    }

    /// Apply one query and answer it.
    fn apply_query(&mut self, now_ms: i64, query: Query<LimitQuery>, out: &mut Decided) {
        let answer = match query.body {
            LimitQuery::ResendGrants { job_partitions } => {
                self.resend_grants(&job_partitions, &mut out.sends);
                LimitAnswer::Applied
            }
            LimitQuery::Link { commands, client } => {
                self.apply_link_commands(now_ms, commands, &client, out);
                LimitAnswer::Applied
            }
            LimitQuery::SetLimit { tenant, key, change } => {
                let key_id = (tenant, key);
                match change {
                    LimitChange::Max(max) => self.set_override(now_ms, &key_id, max, out),
                    LimitChange::FlowWeight { fairness_key, weight } => {
                        self.set_flow_weight(&key_id, fairness_key, weight, &mut out.writes);
                    }
                    LimitChange::Mode(mode) => self.set_mode(now_ms, &key_id, mode, out),
                }
                LimitAnswer::KeyState(self.describe(&key_id.0, &key_id.1, 10))
            }
            LimitQuery::DescribeKey {
                tenant,
                key,
                ticket,
                first_waiters,
            } => LimitAnswer::Described(self.describe_with_ticket(&tenant, &key, ticket.as_ref(), first_waiters)),
            LimitQuery::ListKeys {
                tenant,
                prefix,
                after,
                limit,
            } => LimitAnswer::Keys(self.list_keys(&tenant, &prefix, &after, limit)),
        };
        out.answer(query.id, answer);
    }
}

impl Core for LimitPartition {
    type Query = LimitQuery;
    type Answer = LimitAnswer;
    type Writes = LimitWrites;
    type Effect = LimitEffect;
    type Prepared = ();

    fn apply(&mut self, now_ms: i64, messages: &[InMsg], queries: Vec<Query<LimitQuery>>) -> Decided {
        let mut out = Decided::new();
        let mut rejected = Vec::new();
        for message in messages {
            apply_entries(message, "limit command", &mut rejected, |command: pb::LimitCommand| {
                self.apply_command(now_ms, command, &mut out)
            });
        }
        out.rejected.append(&mut rejected);
        for query in queries {
            self.apply_query(now_ms, query, &mut out);
        }
        self.close_batch(&mut out.writes);
        out
    }

    fn resend_all(&self, _now_ms: i64, outbox: &mut Outbox) {
        for (key_id, state) in &self.keys {
            for holder in state.holders.values() {
                let max = i64::from(state.max_for(&holder.record));
                let kind = state.record.grant_kind(&holder.record);
                self.emit_grant(&holder.record, kind, state.holders.len(), max, outbox);
            }
            // The last refresh-due event may have been saved and not sent.
            if let Some(floating) = &state.record.floating {
                self.emit_refresh_due(
                    key_id,
                    floating,
                    state.waiters.len(),
                    &pb::TraceContext::default(),
                    outbox,
                );
            }
        }
    }

    fn next_wakeup_ms(&self) -> Option<i64> {
        None
    }

    fn key_stats(&self) -> Vec<KeyStat> {
        self.keys
            .iter()
            .map(|((tenant, key), state)| {
                let reference = state
                    .any_waiter()
                    .or_else(|| state.holders.values().next().map(|holder| &holder.record));
                KeyStat {
                    tenant: tenant.clone(),
                    key: key.clone(),
                    kind: if state.record.floating.is_some() {
                        "floating"
                    } else {
                        "concurrency"
                    },
                    holders: u64::try_from(state.holders.len()).unwrap_or(u64::MAX),
                    waiting: u64::try_from(state.waiters.len()).unwrap_or(u64::MAX),
                    max: reference.map(|record| u64::from(state.max_for(record))),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message as _;

    const PARTITIONS: i32 = 1;

    fn partition() -> LimitPartition {
        LimitPartition::new(
            PartitionSettings {
                partition: 0,
                limit_partitions: PARTITIONS,
                grants_partitions: 1,
                refresh_due_topic: Arc::from("refresh-due"),
                refresh_due_partitions: 1,
                max_message_bytes: 1_000_000,
                ticket_grace_ms: 30_000,
                input: InputLimits::default(),
            },
            1,
        )
    }

    fn key(name: &str) -> Option<pb::KeyRef> {
        Some(pb::KeyRef {
            tenant: "t".to_string(),
            key: name.to_string(),
        })
    }

    fn acquire(job: &str, key_name: &str, priority: u32, enqueued_at_us: i64, max: u32) -> pb::LimitCommand {
        acquire_in_flow(job, key_name, priority, enqueued_at_us, max, "")
    }

    fn acquire_in_flow(
        job: &str,
        key_name: &str,
        priority: u32,
        enqueued_at_us: i64,
        max: u32,
        fairness_key: &str,
    ) -> pb::LimitCommand {
        pb::LimitCommand {
            command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
                key: key(key_name),
                ticket: Some(pb::TicketId {
                    job_id: job.to_string(),
                    attempt: 1,
                    step: 0,
                }),
                priority,
                enqueued_at_us,
                limit: Some(pb::acquire_ticket::Limit::MaxConcurrency(max)),
                fairness_key: fairness_key.to_string(),
                shadow: false,
            })),
            ..Default::default()
        }
    }

    fn release(job: &str, key_name: &str) -> pb::LimitCommand {
        pb::LimitCommand {
            command: Some(pb::limit_command::Command::Release(pb::ReleaseTicket {
                key: key(key_name),
                ticket: Some(pb::TicketId {
                    job_id: job.to_string(),
                    attempt: 1,
                    step: 0,
                }),
                reason: 0,
                run_ms: None,
            })),
            ..Default::default()
        }
    }

    fn set_override(key_name: &str, max: Option<u32>) -> pb::LimitCommand {
        pb::LimitCommand {
            command: Some(pb::limit_command::Command::SetOverride(pb::SetOverride {
                key: key(key_name),
                max,
            })),
            ..Default::default()
        }
    }

    /// The grants in `outbox`, in order (they go down the admission link).
    fn grants(outbox: &mut Outbox) -> Vec<pb::GrantEvent> {
        outbox
            .take_links()
            .into_iter()
            .filter(|((link, _), _)| *link == Link::Admission)
            .flat_map(|(_, events)| events)
            .map(|event| pb::GrantEvent::decode(event.as_slice()).unwrap())
            .collect()
    }

    fn granted_jobs(mut outbox: Outbox) -> Vec<String> {
        grants(&mut outbox)
            .into_iter()
            .map(|event| event.ticket.unwrap().job_id)
            .collect()
    }

    fn run(state: &mut LimitPartition, commands: Vec<pb::LimitCommand>) -> (Vec<String>, LimitWrites) {
        let mut out = Decided::new();
        for command in commands {
            state.apply_command(1_000, command, &mut out).unwrap();
        }
        (granted_jobs(out.sends), out.writes)
    }

    #[test]
    fn grants_up_to_the_jobs_max_then_queues_by_priority_then_time() {
        let mut state = partition();
        let (granted, _) = run(
            &mut state,
            vec![
                acquire("a", "k", 50, 1, 2),
                acquire("b", "k", 50, 2, 2),
                acquire("c", "k", 50, 3, 2),
                acquire("d", "k", 10, 4, 2),
                acquire("e", "k", 50, 0, 2),
            ],
        );
        assert_eq!(granted, vec!["a", "b"]);
        assert_eq!(state.holders_of("t", "k"), 2);
        // Order now: d (priority 10), then e (enqueued 0), then c.
        let (granted, _) = run(&mut state, vec![release("a", "k")]);
        assert_eq!(granted, vec!["d"]);
        let (granted, _) = run(&mut state, vec![release("b", "k"), release("d", "k")]);
        assert_eq!(granted, vec!["e", "c"]);
        let (granted, _) = run(&mut state, vec![release("e", "k"), release("c", "k")]);
        assert!(granted.is_empty());
        assert!(state.keys.is_empty(), "idle keys are dropped from memory");
    }

    fn acquire_floating(job: &str, key_name: &str, enqueued_at_us: i64, default_max: u32) -> pb::LimitCommand {
        let mut command = acquire(job, key_name, 50, enqueued_at_us, default_max);
        if let Some(pb::limit_command::Command::Acquire(acquire)) = command.command.as_mut() {
            acquire.limit = Some(pb::acquire_ticket::Limit::Floating(pb::FloatingConcurrencyLimit {
                key: key_name.to_string(),
                default_max,
                refresh_interval_ms: 1_000,
                metadata: [("region".to_string(), "eu".to_string())].into_iter().collect(),
            }));
        }
        command
    }

    fn set_floating_max(key_name: &str, max: u32, task_id: &str) -> pb::LimitCommand {
        pb::LimitCommand {
            command: Some(pb::limit_command::Command::SetFloatingMax(pb::SetFloatingMax {
                key: key(key_name),
                max,
                task_id: task_id.to_string(),
            })),
            ..Default::default()
        }
    }

    /// Apply at `now_ms`; the grants and the refresh-due events sent.
    fn run_at(
        state: &mut LimitPartition,
        now_ms: i64,
        commands: Vec<pb::LimitCommand>,
    ) -> (Vec<String>, Vec<pb::RefreshDue>) {
        let mut out = Decided::new();
        for command in commands {
            state.apply_command(now_ms, command, &mut out).unwrap();
        }
        let mut outbox = out.sends;
        let granted = grants(&mut outbox)
            .into_iter()
            .map(|event| event.ticket.unwrap().job_id)
            .collect();
        let messages = outbox.into_messages();
        let dues = messages
            .iter()
            .filter(|message| &*message.topic == "refresh-due")
            .flat_map(|message| pb::RefreshDueBatch::decode(message.payload.as_slice()).unwrap().events)
            .collect();
        (granted, dues)
    }

    #[test]
    fn a_floating_key_is_shared_and_refreshes_fall_due_on_enqueue_or_release_with_waiters() {
        let mut state = partition();
        // The first job creates the state with its default; b's default (9) is ignored.
        let (granted, dues) = run_at(
            &mut state,
            10_000,
            vec![acquire_floating("a", "f", 1, 1), acquire_floating("b", "f", 2, 9)],
        );
        assert_eq!(granted, vec!["a"], "max 1 from the first job's default_max");
        assert_eq!(dues.len(), 1, "the first waiter makes the first refresh due");
        assert_eq!(dues[0].current_max, 1);
        assert_eq!(dues[0].due_at_ms, 10_000);
        assert_eq!(dues[0].waiting, 1);
        assert_eq!(dues[0].metadata.get("region").map(String::as_str), Some("eu"));
        // Within the interval nothing more is due.
        let (granted, dues) = run_at(&mut state, 10_500, vec![acquire_floating("c", "f", 3, 1)]);
        assert!(granted.is_empty() && dues.is_empty());
        // A new max raises the limit and grants waiters at once.
        let (granted, _) = run_at(&mut state, 10_600, vec![set_floating_max("f", 3, "t1")]);
        assert_eq!(granted, vec!["b", "c"]);
        // The same task's value never applies twice.
        let (granted, _) = run_at(&mut state, 10_700, vec![set_floating_max("f", 1, "t1")]);
        assert!(granted.is_empty());
        let described = state.describe("t", "f", 10);
        assert_eq!(described.floating_max, Some(3));
        assert_eq!(
            described.floating.as_ref().map(|floating| floating.default_max),
            Some(1)
        );
        // A release after the interval, with waiters, makes the next refresh due.
        run_at(&mut state, 10_800, vec![acquire_floating("d", "f", 4, 1)]);
        let (granted, dues) = run_at(&mut state, 11_000, vec![release("a", "f")]);
        assert_eq!(granted, vec!["d"]);
        assert!(
            dues.is_empty(),
            "no waiters left after d's grant: nothing to refresh for"
        );
        let (_, dues) = run_at(&mut state, 11_100, vec![acquire_floating("e", "f", 5, 1)]);
        assert_eq!(dues.len(), 1, "interval passed and the key has waiters");
        assert_eq!(dues[0].current_max, 3);
        assert_eq!(dues[0].waiting, 1);
        let (_, dues) = run_at(&mut state, 11_200, vec![acquire_floating("g", "f", 6, 1)]);
        assert!(dues.is_empty(), "one due event per interval");
        // A new owner re-sends the last due event; the dispatcher ignores it by due_at_ms.
        let mut outbox = Outbox::new();
        state.resend_all(11_300, &mut outbox);
        let _grants = outbox.take_links();
        let resent: Vec<pb::RefreshDue> = outbox
            .into_messages()
            .iter()
            .filter(|message| &*message.topic == "refresh-due")
            .flat_map(|message| pb::RefreshDueBatch::decode(message.payload.as_slice()).unwrap().events)
            .collect();
        assert_eq!(resent.len(), 1);
        assert_eq!(resent[0].due_at_ms, 11_100);
    }

    #[test]
    fn lowering_a_floating_max_affects_only_new_grants() {
        let mut state = partition();
        run_at(&mut state, 1_000, vec![acquire_floating("a", "f", 1, 4)]);
        let (granted, _) = run_at(
            &mut state,
            1_001,
            vec![
                acquire_floating("b", "f", 2, 4),
                acquire_floating("c", "f", 3, 4),
                acquire_floating("d", "f", 4, 4),
                acquire_floating("e", "f", 5, 4),
            ],
        );
        assert_eq!(granted, vec!["b", "c", "d"]);
        run_at(&mut state, 1_002, vec![set_floating_max("f", 2, "t1")]);
        assert_eq!(state.holders_of("t", "f"), 4, "running jobs are never interrupted");
        let (granted, _) = run_at(&mut state, 1_003, vec![release("a", "f"), release("b", "f")]);
        assert!(granted.is_empty(), "3 >= 2 holders: e waits");
        let (granted, _) = run_at(&mut state, 1_004, vec![release("c", "f")]);
        assert_eq!(granted, vec!["e"]);
    }

    #[test]
    fn the_head_is_not_overtaken_by_a_job_with_a_larger_max() {
        let mut state = partition();
        let (granted, _) = run(
            &mut state,
            vec![
                acquire("a", "k", 50, 1, 1),
                acquire("b", "k", 50, 2, 1),
                acquire("c", "k", 50, 3, 5),
            ],
        );
        // b is head and needs max 1; c (max 5) behind it must not be granted.
        assert_eq!(granted, vec!["a"]);
        assert_eq!(state.waiting_on("t", "k"), 2);
    }

    #[test]
    fn duplicates_change_nothing_and_resend_the_grant() {
        let mut state = partition();
        let (granted, first_writes) = run(&mut state, vec![acquire("a", "k", 50, 1, 1)]);
        assert_eq!(granted, vec!["a"]);
        assert_eq!(first_writes.upserts.len(), 1);
        let (granted, writes) = run(&mut state, vec![acquire("a", "k", 50, 1, 1)]);
        assert_eq!(
            granted,
            vec!["a"],
            "a duplicate acquire from a holder re-sends its grant"
        );
        assert!(writes.is_empty());
        let (_, writes) = run(&mut state, vec![release("a", "k"), release("a", "k")]);
        assert_eq!(writes.deletes.len(), 1);
        let (_, writes) = run(&mut state, vec![release("a", "k")]);
        assert!(writes.is_empty(), "a release of nothing changes nothing");
    }

    /// Run `arrivals` (ms) on key "s" (max `max`), each job holding its slot
    /// for `hold_ms` from its real grant, on an explicit clock; in shadow
    /// mode when `shadow`. Returns each job's measured wait (real grant minus
    /// arrival) and the key's state at the end.
    fn run_workload(shadow: bool, arrivals: &[i64], hold_ms: i64, max: u32) -> (Vec<i64>, pb::KeyState) {
        let mut state = partition();
        let mut releases: std::collections::BTreeMap<(i64, usize), String> = std::collections::BTreeMap::new();
        let mut waits = vec![0i64; arrivals.len()];
        let mut next_arrival = 0;
        loop {
            let release_due = releases.first_key_value().map(|((at, _), _)| *at);
            let arrival_due = arrivals.get(next_arrival).copied();
            let (now_ms, command) = match (release_due, arrival_due) {
                // A release at the same instant as an arrival goes first.
                (Some(release_at), arrival) if arrival.is_none_or(|arrival| release_at <= arrival) => {
                    let Some((_, job)) = releases.pop_first() else { break };
                    (release_at, release(&job, "s"))
                }
                (_, Some(arrival)) => {
                    let job = format!("j{next_arrival}");
                    next_arrival += 1;
                    let mut command = acquire(&job, "s", 0, arrival, max);
                    if let Some(pb::limit_command::Command::Acquire(acquire)) = command.command.as_mut() {
                        acquire.shadow = shadow;
                    }
                    (arrival, command)
                }
                _ => break,
            };
            let mut out = Decided::new();
            state.apply_command(now_ms, command, &mut out).unwrap();
            for grant in grants(&mut out.sends) {
                let job = grant.ticket.unwrap().job_id;
                let index: usize = job.trim_start_matches('j').parse().unwrap();
                waits[index] = grant.granted_at_ms - grant.waiting_since_ms;
                releases.insert((grant.granted_at_ms + hold_ms, index), job);
            }
        }
        (waits, state.describe("t", "s", 0))
    }

    #[test]
    fn shadow_mode_predicts_the_waits_that_enforcing_measures() {
        // Bursts and gaps on a key of max 2, every job holding it 100 ms.
        let arrivals = [0, 0, 0, 10, 20, 30, 250, 260, 400, 400, 400, 400, 405];
        let (enforced, _) = run_workload(false, &arrivals, 100, 2);
        let (shadowed, shadow_state) = run_workload(true, &arrivals, 100, 2);
        assert!(
            shadowed.iter().all(|wait| *wait == 0),
            "shadow mode admits at once: {shadowed:?}"
        );
        let stats = shadow_state.shadow.expect("shadow stats");
        assert_eq!(stats.would_have_waited_count, arrivals.len() as u64);
        assert_eq!(
            stats.would_have_waited_ms_total,
            enforced.iter().sum::<i64>(),
            "predicted against measured waits: {enforced:?}"
        );
        assert_eq!(stats.would_have_waited_ms_max, *enforced.iter().max().unwrap());
        assert!(enforced.iter().sum::<i64>() > 0, "the workload does wait when enforced");
        // Up to 5 jobs ran at once on a key of 2: each grant over 2 counted.
        assert!(stats.would_have_exceeded > 0);
        assert_eq!((stats.would_hold, stats.would_wait), (0, 0));
    }

    #[test]
    fn switching_a_key_from_shadow_to_enforce_applies_at_once() {
        let mut state = partition();
        let mode = |mode: pb::LimitMode| Query {
            id: 1,
            body: LimitQuery::SetLimit {
                tenant: "t".to_string(),
                key: "m".to_string(),
                change: LimitChange::Mode(Some(mode)),
            },
        };
        let apply_local = |state: &mut LimitPartition, query: Query<LimitQuery>| {
            let decided = state.apply(0, &[], vec![query]);
            assert!(matches!(decided.answers.as_slice(), [(1, LimitAnswer::KeyState(_))]));
            (decided.writes, decided.sends)
        };
        let (writes, _) = apply_local(&mut state, mode(pb::LimitMode::Shadow));
        assert_eq!(
            writes
                .keys
                .get(&("t".to_string(), "m".to_string()))
                .cloned()
                .flatten()
                .and_then(|record| record.mode),
            Some(pb::LimitMode::Shadow),
            "the mode is stored"
        );
        let (granted, _) = run(
            &mut state,
            (0..3)
                .map(|index| acquire(&format!("s{index}"), "m", 0, index, 1))
                .collect(),
        );
        assert_eq!(granted.len(), 3, "shadow mode grants past the max of 1");
        apply_local(&mut state, mode(pb::LimitMode::Enforce));
        let (granted, _) = run(&mut state, vec![acquire("e0", "m", 0, 10, 1)]);
        assert!(granted.is_empty(), "enforced at once: three hold a key of 1");
        for index in 0..3 {
            run(&mut state, vec![release(&format!("s{index}"), "m")]);
        }
        assert_eq!(state.holders_of("t", "m"), 1, "e0 granted once the shadow holders left");
        // Back to shadow: the waiters are granted at once.
        run(&mut state, vec![acquire("e1", "m", 0, 11, 1)]);
        assert_eq!(state.waiting_on("t", "m"), 1);
        let (_, outbox) = apply_local(&mut state, mode(pb::LimitMode::Shadow));
        assert_eq!(granted_jobs(outbox), vec!["e1".to_string()]);
    }

    #[test]
    fn override_pauses_and_raising_grants_waiters_at_once() {
        let mut state = partition();
        let (granted, _) = run(
            &mut state,
            vec![set_override("k", Some(0)), acquire("a", "k", 50, 1, 3)],
        );
        assert!(granted.is_empty(), "paused key grants nothing");
        let (granted, _) = run(
            &mut state,
            vec![acquire("b", "k", 50, 2, 3), set_override("k", Some(1))],
        );
        assert_eq!(granted, vec!["a"]);
        let (granted, writes) = run(&mut state, vec![set_override("k", None)]);
        assert_eq!(granted, vec!["b"], "clearing restores the job's max of 3");
        assert_eq!(writes.keys.get(&("t".to_string(), "k".to_string())), Some(&None));
    }

    #[test]
    fn a_sweep_reclaims_tickets_nobody_stands_behind() {
        let mut state = partition();
        run(
            &mut state,
            vec![acquire("a", "k", 50, 1, 1), acquire("b", "k", 50, 2, 1)],
        );
        let sweep = |snapshot_at_ms: i64, tickets: Vec<&str>| pb::LimitCommand {
            command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
                sweep_id: format!("s{snapshot_at_ms}"),
                snapshot_at_ms,
                job_partitions: vec![0],
                part: 0,
                parts: 1,
                tickets: tickets
                    .into_iter()
                    .map(|job| pb::TicketId {
                        job_id: job.to_string(),
                        attempt: 1,
                        step: 0,
                    })
                    .collect(),
                grace_ms: 30_000,
                waiting: Vec::new(),
            })),
            ..Default::default()
        };
        // Within the grace nothing expires even when unlisted.
        let (granted, _) = run(&mut state, vec![sweep(20_000, vec!["b"])]);
        assert!(granted.is_empty());
        // a was last confirmed at 1_000: a sweep at 40_000 without it reclaims it.
        let (granted, writes) = run(&mut state, vec![sweep(40_000, vec!["b"])]);
        assert_eq!(granted, vec!["b"]);
        assert!(writes.deletes.contains(&TicketKey {
            job_id: Arc::from("a"),
            attempt: 1,
            step: 0
        }));
    }

    /// A grant lost on its way to admission (issue 29: keys idle with jobs
    /// waiting until a timer re-sent their acquires) is sent again as soon
    /// as admission's next sweep says the job still waits for it; a ticket
    /// that waits here, or one admission no longer waits for, is not.
    #[test]
    fn a_grant_admission_still_waits_for_is_sent_again_at_its_sweep() {
        let mut state = partition();
        let (granted, _) = run(
            &mut state,
            vec![acquire("a", "k", 50, 1, 1), acquire("b", "k", 50, 2, 1)],
        );
        assert_eq!(granted, vec!["a"], "a holds the key; b waits");
        let ticket = |job: &str| pb::TicketId {
            job_id: job.to_string(),
            attempt: 1,
            step: 0,
        };
        let sweep = |waiting: Vec<&str>| pb::LimitCommand {
            command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
                sweep_id: format!("s-{}", waiting.join("-")),
                snapshot_at_ms: 1_000,
                job_partitions: vec![0],
                part: 0,
                parts: 1,
                tickets: vec![ticket("a"), ticket("b")],
                grace_ms: 30_000,
                waiting: waiting.into_iter().map(ticket).collect(),
            })),
            ..Default::default()
        };
        // a's grant never reached admission: it still waits for it.
        let (granted, writes) = run(&mut state, vec![sweep(vec!["a", "b"])]);
        assert_eq!(
            granted,
            vec!["a"],
            "the held ticket's grant is sent again; b still waits"
        );
        assert!(writes.deletes.is_empty());
        assert_eq!(state.holders_of("t", "k"), 1);
        // Once admission has it, the sweep lists it as held, not waited for.
        let (granted, _) = run(&mut state, vec![sweep(vec!["b"])]);
        assert!(granted.is_empty());
    }

    #[test]
    fn a_misrouted_command_is_refused() {
        let mut state = LimitPartition::new(
            PartitionSettings {
                partition: 0,
                limit_partitions: 64,
                grants_partitions: 1,
                refresh_due_topic: Arc::from("refresh-due"),
                refresh_due_partitions: 1,
                max_message_bytes: 1_000_000,
                ticket_grace_ms: 30_000,
                input: InputLimits::default(),
            },
            1,
        );
        let misrouted = (0..100)
            .map(|index| format!("k{index}"))
            .find(|name| key_partition("t", name, 64) != 0)
            .unwrap();
        let error = state
            .apply_command(0, acquire("a", &misrouted, 50, 1, 1), &mut Decided::new())
            .unwrap_err();
        assert!(error.contains("hashes to partition"), "{error}");
    }

    /// A downstream that serves `capacity` jobs at once in `base_ms`; above
    /// that its latency climbs with the load: a job started with `running`
    /// jobs in flight takes `base × (1 + 2 × (running − capacity) / capacity)`.
    #[derive(Clone, Copy)]
    struct Downstream {
        capacity: u32,
        base_ms: i64,
    }

    impl Downstream {
        fn run_ms(self, running: u32) -> i64 {
            let over = i64::from(running.saturating_sub(self.capacity));
            self.base_ms + 2 * self.base_ms * over / i64::from(self.capacity)
        }
    }

    fn acquire_adaptive(job: &str, spec: &pb::AdaptiveConcurrencyLimit) -> pb::LimitCommand {
        pb::LimitCommand {
            command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
                key: key(&spec.key),
                ticket: Some(pb::TicketId {
                    job_id: job.to_string(),
                    attempt: 1,
                    step: 0,
                }),
                limit: Some(pb::acquire_ticket::Limit::Adaptive(spec.clone())),
                ..Default::default()
            })),
            ..Default::default()
        }
    }

    fn release_after(job: &str, key_name: &str, run_ms: i64, reason: pb::ReleaseReason) -> pb::LimitCommand {
        let mut command = release(job, key_name);
        if let Some(pb::limit_command::Command::Release(release)) = &mut command.command {
            release.run_ms = Some(u64::try_from(run_ms).unwrap());
            release.reason = reason as i32;
        }
        command
    }

    /// Runs an adaptive key against `phases` of a downstream, each for a
    /// number of completions, on an explicit clock, with jobs always waiting.
    /// Returns the key's max after every completion, and checks at every
    /// grant that the holders never exceed the max they were granted under.
    fn simulate(spec: &pb::AdaptiveConcurrencyLimit, phases: &[(Downstream, usize)]) -> Vec<u32> {
        use std::cmp::Reverse;
        use std::collections::BinaryHeap;
        let mut state = partition();
        let mut now_ms = 0i64;
        let mut next_job = 0u64;
        // (ends at, job, run ms)
        let mut running: BinaryHeap<Reverse<(i64, String, i64)>> = BinaryHeap::new();
        let mut maxes = Vec::new();
        let apply = |state: &mut LimitPartition, command: pb::LimitCommand, now_ms: i64| {
            let mut out = Decided::new();
            state.apply_command(now_ms, command, &mut out).unwrap();
            grants(&mut out.sends)
        };
        for (downstream, completions) in phases {
            for _ in 0..*completions {
                // Keep ten jobs waiting: the key is always in demand.
                while state.waiting_on("t", &spec.key) < 10 {
                    next_job += 1;
                    let job = format!("job-{next_job}");
                    for grant in apply(&mut state, acquire_adaptive(&job, spec), now_ms) {
                        assert!(i64::from(grant.holders) <= grant.max, "overrun");
                        let run_ms = downstream.run_ms(grant.holders);
                        running.push(Reverse((now_ms + run_ms, grant.ticket.unwrap().job_id, run_ms)));
                    }
                }
                let Reverse((ends_at, job, run_ms)) = running.pop().expect("a job runs");
                now_ms = ends_at;
                let release = release_after(&job, &spec.key, run_ms, pb::ReleaseReason::Succeeded);
                for grant in apply(&mut state, release, now_ms) {
                    assert!(i64::from(grant.holders) <= grant.max, "overrun");
                    let run_ms = downstream.run_ms(grant.holders);
                    running.push(Reverse((now_ms + run_ms, grant.ticket.unwrap().job_id, run_ms)));
                }
                let described = state.describe("t", &spec.key, 0);
                maxes.push(described.adaptive.unwrap().current_max);
            }
        }
        maxes
    }

    fn adaptive_spec() -> pb::AdaptiveConcurrencyLimit {
        pb::AdaptiveConcurrencyLimit {
            key: "api".to_string(),
            min: 1,
            max: 500,
            initial: 0,
            target_latency_ms: 110,
            max_error_ratio: 0.0,
            smoothing: 0.0,
        }
    }

    /// The first completion from which every later max is within `low..=high`.
    fn settled_from(maxes: &[u32], low: u32, high: u32) -> Option<usize> {
        let last_outside = maxes.iter().rposition(|max| !(low..=high).contains(max));
        match last_outside {
            None => Some(0),
            Some(index) if index + 1 < maxes.len() => Some(index + 1),
            Some(_) => None,
        }
    }

    #[test]
    fn an_adaptive_key_settles_near_the_concurrency_where_latency_climbs() {
        let downstream = Downstream {
            capacity: 40,
            base_ms: 100,
        };
        let maxes = simulate(&adaptive_spec(), &[(downstream, 4_000)]);
        // ±20 % of 40, within 1,000 completions (from a max of 1).
        let settled = settled_from(&maxes, 32, 48).expect("settles within ±20 % of 40");
        assert!(settled <= 1_000, "settled only after {settled} completions: {maxes:?}");
        assert!(maxes.iter().all(|max| (1..=500).contains(max)));
    }

    #[test]
    fn an_adaptive_key_backs_off_when_the_downstream_slows_down_mid_run() {
        let fast = Downstream {
            capacity: 40,
            base_ms: 100,
        };
        let slow = Downstream {
            capacity: 10,
            base_ms: 100,
        };
        let maxes = simulate(&adaptive_spec(), &[(fast, 2_000), (slow, 3_000)]);
        let (before, after) = maxes.split_at(2_000);
        assert!(settled_from(before, 32, 48).is_some(), "{before:?}");
        let settled = settled_from(after, 8, 12).expect("settles within ±20 % of 10");
        assert!(settled <= 1_000, "settled only after {settled} completions: {after:?}");
        // And it recovers when the downstream does.
        let maxes = simulate(&adaptive_spec(), &[(slow, 1_000), (fast, 4_000)]);
        let settled = settled_from(&maxes[1_000..], 32, 48).expect("grows back within ±20 % of 40");
        assert!(settled <= 2_500, "grew back only after {settled} completions");
    }

    #[test]
    fn an_adaptive_key_shrinks_on_errors_and_its_changes_are_described() {
        let spec = pb::AdaptiveConcurrencyLimit {
            target_latency_ms: 0,
            initial: 20,
            max_error_ratio: 0.2,
            smoothing: 1.0,
            ..adaptive_spec()
        };
        let mut state = partition();
        let mut holders = Vec::new();
        for index in 0..40 {
            let job = format!("job-{index}");
            let mut out = Decided::new();
            state.apply_command(0, acquire_adaptive(&job, &spec), &mut out).unwrap();
            holders.extend(
                grants(&mut out.sends)
                    .into_iter()
                    .map(|grant| grant.ticket.unwrap().job_id),
            );
            if index == 0 {
                // The first job creates the key's state, saved with the key.
                assert!(out
                    .writes
                    .keys
                    .values()
                    .any(|record| record.as_ref().is_some_and(|record| record.adaptive.is_some())));
            }
        }
        assert_eq!(holders.len(), 20);
        // Half the window fails (a lost lease counts as a failure; a
        // cancelled job says nothing about the downstream).
        let mut saved = None;
        for (index, job) in holders.iter().enumerate() {
            let reason = match index % 4 {
                0 => pb::ReleaseReason::Failed,
                1 => pb::ReleaseReason::LeaseExpired,
                _ => pb::ReleaseReason::Succeeded,
            };
            let mut out = Decided::new();
            state
                .apply_command(1_000, release_after(job, "api", 50, reason), &mut out)
                .unwrap();
            if let Some(Some(record)) = out.writes.keys.remove(&("t".to_string(), "api".to_string())) {
                saved = record.adaptive;
            }
        }
        let described = state.describe("t", "api", 0);
        assert_eq!(described.kind, pb::LimitKind::Adaptive as i32);
        assert_eq!(described.effective_max, Some(10));
        let adaptive = described.adaptive.unwrap();
        assert_eq!(adaptive.current_max, 10);
        assert_eq!(adaptive.window_samples, 20);
        assert_eq!(adaptive.window_error_ratio, 0.5);
        let change = adaptive.last_change.unwrap();
        assert_eq!((change.from, change.to, change.at_ms), (20, 10, 1_000));
        assert_eq!(
            change.reason,
            "errors: 50 % of the window failed, over the 20 % allowed"
        );
        // The change was saved with the key: a new owner starts from 10.
        assert_eq!(saved.map(|adaptive| adaptive.current()), Some(10));
        // Like a lowered floating max, the new max only affects new grants:
        // the first 19 releases each granted a waiter under the old max, the
        // 20th (which closed the window) none; no more until holders < 10.
        assert_eq!(state.holders_of("t", "api"), 19);
        assert_eq!(state.waiting_on("t", "api"), 1);
        // An override beats the computed max.
        run(&mut state, vec![set_override("api", Some(3))]);
        assert_eq!(state.describe("t", "api", 0).effective_max, Some(3));
    }

    /// What one command sent and observed: grant events, and observations
    /// (counted once the batch commits).
    fn sent_and_observed(state: &mut LimitPartition, command: pb::LimitCommand) -> (usize, usize) {
        let mut out = Decided::new();
        state.apply_command(1_000, command, &mut out).unwrap();
        assert!(out.sends.take_observations().is_empty(), "effects, not observations");
        let observed = out.effects.len();
        (grants(&mut out.sends).len(), observed)
    }

    #[test]
    fn each_grant_is_observed_once_whatever_is_sent_again_after_a_failover() {
        let mut first = partition();
        let (mut sent, mut observed) = (0, 0);
        for job in ["a", "b", "c", "d"] {
            let (s, o) = sent_and_observed(&mut first, acquire(job, "k", 10, 1, 2));
            sent += s;
            observed += o;
        }
        // A duplicate acquire of a holder: its grant is sent again, not observed again.
        let (s, o) = sent_and_observed(&mut first, acquire("a", "k", 10, 1, 2));
        assert_eq!((s, o), (1, 0));
        sent += s;
        observed += o;
        let (s, o) = sent_and_observed(&mut first, release("a", "k"));
        sent += s;
        observed += o;
        assert_eq!((sent, observed), (4, 3), "grants a, b, then c; a sent twice");

        // The owner fails over: a new one loads the saved tickets and sends
        // every held grant again, observing none of them.
        let saved: Vec<TicketRecord> = first.tickets().cloned().collect();
        let mut second = partition();
        second.restore(2_000, Vec::new(), saved);
        let mut outbox = Outbox::new();
        second.resend_all(2_000, &mut outbox);
        assert_eq!(outbox.take_observations().len(), 0);
        assert_eq!(grants(&mut outbox).len(), 2, "b and c sent again");
        let (s, o) = sent_and_observed(&mut second, release("b", "k"));
        assert_eq!((s, o), (1, 1), "d is a new grant");
        // Distinct grants a, b, c, d: observed four times in all.
        assert_eq!(observed + o, 4);
    }

    mod properties {
        use super::*;
        use proptest::prelude::*;

        #[derive(Clone, Debug)]
        enum Op {
            Acquire {
                job: u8,
                key: u8,
                priority: u8,
                max: u8,
                flow: u8,
            },
            Release {
                job: u8,
            },
            Override {
                key: u8,
                max: Option<u8>,
            },
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (0u8..40, 0u8..3, 0u8..3, 1u8..4, 0u8..3).prop_map(|(job, key, priority, max, flow)| Op::Acquire {
                    job,
                    key,
                    priority,
                    max,
                    flow
                }),
                (0u8..40).prop_map(|job| Op::Release { job }),
                (0u8..3, proptest::option::of(0u8..4)).prop_map(|(key, max)| Op::Override { key, max }),
            ]
        }

        fn flow_name(flow: u8) -> &'static str {
            ["", "f1", "f2"][usize::from(flow % 3)]
        }

        fn live(state: &LimitPartition) -> HashMap<TicketKey, TicketRecord> {
            state
                .tickets()
                .map(|record| (record.ticket.clone(), record.clone()))
                .collect()
        }

        proptest! {
            /// What the batches journal (and the snapshots that replace the
            /// journal) rebuilds exactly the live tickets after every batch,
            /// and a partition restored from it answers as the original.
            #[test]
            fn the_journal_rebuilds_the_tickets(
                batches in proptest::collection::vec((proptest::collection::vec(op(), 0..8), any::<bool>()), 1..40)
            ) {
                let mut state = partition();
                state.journal_loaded(0, None, 0);
                let mut saved: HashMap<TicketKey, TicketRecord> = HashMap::new();
                let mut job_keys: HashMap<u8, u8> = HashMap::new();
                let mut last_seq = 0;
                for (index, (ops, snapshot_now)) in batches.into_iter().enumerate() {
                    let mut out = Decided::new();
                    for operation in ops {
                        let command = match operation {
                            Op::Acquire { job, key: key_index, priority, max, flow } => {
                                let key_index = *job_keys.entry(job).or_insert(key_index);
                                acquire_in_flow(&format!("j{job}"), &format!("k{key_index}"), u32::from(priority), i64::try_from(index).unwrap(), u32::from(max), flow_name(flow))
                            }
                            Op::Release { job } => match job_keys.get(&job) {
                                Some(key_index) => release(&format!("j{job}"), &format!("k{key_index}")),
                                None => continue,
                            },
                            Op::Override { key: key_index, max } => set_override(&format!("k{key_index}"), max.map(u32::from)),
                        };
                        state.apply_command(0, command, &mut out).unwrap();
                    }
                    if snapshot_now {
                        state.snapshot_due = true;
                    }
                    let writes = &mut out.writes;
                    state.close_batch(writes);
                    prop_assert!(writes.journal.is_none() || writes.snapshot.is_none());
                    if let Some((seq, snapshot)) = writes.snapshot.take() {
                        prop_assert!(seq > last_seq);
                        last_seq = seq;
                        saved = snapshot
                            .tickets
                            .into_iter()
                            .map(|stored| {
                                let record = stored.into_record();
                                (record.ticket.clone(), record)
                            })
                            .collect();
                    }
                    if let Some((seq, batch)) = writes.journal.take() {
                        prop_assert_eq!(seq, last_seq + 1, "journal rows are numbered without gaps");
                        last_seq = seq;
                        batch.apply_to(&mut saved);
                    }
                    prop_assert_eq!(&saved, &live(&state));
                }
                let mut restored = partition();
                restored.restore(0, Vec::new(), saved.into_values().collect());
                prop_assert_eq!(live(&restored), live(&state));
                for key_index in 0..3 {
                    let key = format!("k{key_index}");
                    prop_assert_eq!(restored.holders_of("t", &key), state.holders_of("t", &key));
                    prop_assert_eq!(restored.waiting_on("t", &key), state.waiting_on("t", &key));
                }
            }

            /// After every command, holders never exceed the max in force for
            /// the last grant, and a job never holds twice.
            #[test]
            fn no_overrun_under_any_sequence(ops in proptest::collection::vec(op(), 1..200)) {
                let mut state = partition();
                let mut job_keys: HashMap<u8, u8> = HashMap::new();
                for (index, operation) in ops.into_iter().enumerate() {
                    let mut out = Decided::new();
                    let command = match operation {
                        Op::Acquire { job, key: key_index, priority, max, flow } => {
                            let key_index = *job_keys.entry(job).or_insert(key_index);
                            acquire_in_flow(&format!("j{job}"), &format!("k{key_index}"), u32::from(priority), i64::try_from(index).unwrap(), u32::from(max), flow_name(flow))
                        }
                        Op::Release { job } => match job_keys.get(&job) {
                            Some(key_index) => release(&format!("j{job}"), &format!("k{key_index}")),
                            None => continue,
                        },
                        Op::Override { key: key_index, max } => set_override(&format!("k{key_index}"), max.map(u32::from)),
                    };
                    let held_before: HashSet<TicketKey> = state
                        .keys
                        .values()
                        .flat_map(|key_state| key_state.holders.keys().cloned())
                        .collect();
                    state.apply_command(0, command, &mut out).unwrap();
                    for event in grants(&mut out.sends) {
                        let ticket = TicketKey::from_proto(event.ticket.as_ref().unwrap());
                        if held_before.contains(&ticket) {
                            continue; // a re-sent grant of a duplicate acquire
                        }
                        prop_assert!(i64::from(event.holders) <= event.max, "grant over max: {event:?}");
                    }
                    for key_state in state.keys.values() {
                        for holder in key_state.holders.values() {
                            prop_assert!(!key_state.waiters.iter().any(|(_, _, waiting)| waiting.record.ticket == holder.record.ticket));
                        }
                        // Nobody waits while the next head would fit (no lost wake-up).
                        if let Some((_, head)) = key_state.waiters.peek() {
                            let max = usize::try_from(key_state.max_for(&head.record)).unwrap();
                            prop_assert!(key_state.holders.len() >= max, "head fits but waits");
                        }
                        for (flow, _, waiting) in key_state.waiters.iter() {
                            let place = state.ticket_keys.get(&waiting.record.ticket);
                            prop_assert!(
                                place.is_some_and(|place| place.order(&waiting.record.ticket) == WaitOrder::of(&waiting.record) && place.flow == *flow),
                                "every waiter is found by its ticket"
                            );
                        }
                    }
                }
            }
        }
    }
}
