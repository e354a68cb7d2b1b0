//! One owned partition of rate-window: its windows (sliding, 1 ms), their
//! waiting queues, the stored resources of its keys, and recent grants. Pure:
//! decisions go into a write set and an outbox the owner runtime commits and
//! publishes. A deferred job is granted by a timer at the exact millisecond
//! its slot opens (`next_wakeup_ms`), never by polling.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use sluice_common::kafka::{InMsg, Outbox};
use sluice_common::link::LinkInput;
use sluice_common::owner::{apply_entries, OwnedState, Rejected, Reply, WriteSet};
use sluice_common::partition::rate_key_partition;
use sluice_common::validate::{
    check_i64, check_rate_key, check_rate_window, check_ticket, check_u32, FieldError, InputLimits,
};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::queue::{RateQueue, Waiter};
use crate::window::{SlidingWindow, WindowSpec};

mod grants;
mod local;
mod queueing;

/// The identity of a window, as stored: kind, tenant and names joined by a
/// separator no valid name contains.
pub type WindowKey = String;

const SEPARATOR: char = '\u{1f}';

/// The stored key of a rate key reference.
pub fn window_key(key: &pb::RateKeyRef) -> WindowKey {
    match &key.kind {
        Some(pb::rate_key_ref::Kind::Inline(inline)) => {
            format!(
                "i{SEPARATOR}{}{SEPARATOR}{}{SEPARATOR}{}",
                key.tenant, inline.name, inline.unique_key
            )
        }
        Some(pb::rate_key_ref::Kind::ResourceKey(resource_key)) => {
            format!("r{SEPARATOR}{}{SEPARATOR}{resource_key}", key.tenant)
        }
        None => format!("?{SEPARATOR}{}", key.tenant),
    }
}

/// How the key reads in grant events, `GetJob` and logs.
pub fn display_key(key: &pb::RateKeyRef) -> String {
    match &key.kind {
        Some(pb::rate_key_ref::Kind::Inline(inline)) => format!("inline:{}:{}", inline.name, inline.unique_key),
        Some(pb::rate_key_ref::Kind::ResourceKey(resource_key)) => format!("resource:{resource_key}"),
        None => String::new(),
    }
}

fn resource_of(key: &pb::RateKeyRef) -> Option<(String, String)> {
    match &key.kind {
        Some(pb::rate_key_ref::Kind::ResourceKey(resource_key)) => Some((key.tenant.clone(), resource_key.clone())),
        _ => None,
    }
}

pub use sluice_common::ticket::TicketKey;

/// A rate ticket as stored: waiting, or granted recently.
#[derive(Clone, Debug, PartialEq)]
pub struct TicketRecord {
    pub ticket: TicketKey,
    pub window_key: WindowKey,
    pub granted: bool,
    pub priority: u32,
    pub enqueued_at_us: i64,
    pub cost: u64,
    pub waiting_since_ms: i64,
    pub position_at_enqueue: u32,
    pub granted_at_ms: Option<i64>,
    pub unthrottled: bool,
    pub traceparent: String,
    pub tracestate: String,
}

/// A window's row: its key and current spec.
#[derive(Clone, Debug, PartialEq)]
pub struct WindowRecord {
    pub key: pb::RateKeyRef,
    pub rate_limit: i64,
    pub window_ms: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResourceRecord {
    pub max_count: i64,
    pub window_seconds: i64,
}

impl ResourceRecord {
    fn spec(&self) -> Option<WindowSpec> {
        let limit = u64::try_from(self.max_count).ok()?;
        let window_ms = u64::try_from(self.window_seconds).ok()?.checked_mul(1000)?;
        WindowSpec::new(limit, window_ms).ok()
    }
}

struct WindowState {
    key: pb::RateKeyRef,
    window: SlidingWindow,
    queue: RateQueue<TicketKey>,
    waiting: HashMap<TicketKey, TicketRecord>,
    wakeup: Option<i64>,
}

/// The writes of one batch.
#[derive(Debug, Default)]
pub struct RateWrites {
    /// Units granted per (window, millisecond), to add.
    pub grant_units: HashMap<(WindowKey, i64), u64>,
    /// Per window, drop grant rows older than this (they left the window).
    pub prune_before: HashMap<WindowKey, i64>,
    /// Window rows to upsert (`Some`) or delete with their grants (`None`).
    pub windows: HashMap<WindowKey, Option<WindowRecord>>,
    pub ticket_upserts: HashMap<TicketKey, TicketRecord>,
    pub ticket_deletes: HashSet<TicketKey>,
    /// Drop granted tickets granted before this (past the retention).
    pub forget_granted_before: Option<i64>,
    pub resources: HashMap<(String, String), Option<ResourceRecord>>,
}

impl RateWrites {
    fn upsert_ticket(&mut self, record: TicketRecord) {
        self.ticket_deletes.remove(&record.ticket);
        self.ticket_upserts.insert(record.ticket.clone(), record);
    }

    fn delete_ticket(&mut self, ticket: &TicketKey) {
        self.ticket_upserts.remove(ticket);
        self.ticket_deletes.insert(ticket.clone());
    }
}

impl WriteSet for RateWrites {
    fn is_empty(&self) -> bool {
        self.grant_units.is_empty()
            && self.windows.is_empty()
            && self.ticket_upserts.is_empty()
            && self.ticket_deletes.is_empty()
            && self.resources.is_empty()
            && self.forget_granted_before.is_none()
    }
}

#[derive(Clone, Debug)]
pub struct PartitionSettings {
    pub partition: i32,
    pub rate_partitions: i32,
    pub grants_partitions: i32,
    pub max_message_bytes: usize,
    /// How long a granted ticket is remembered for duplicates.
    pub granted_retention_ms: i64,
    /// What commands are checked against (the edge's bounds).
    pub input: InputLimits,
}

/// The answer to a local request: a value, or a status for the caller.
pub type LocalResult<T> = Result<T, tonic::Status>;

/// Requests from this instance's gRPC handlers.
pub enum LocalRequest {
    TryAcquire {
        key: pb::RateKeyRef,
        /// Inline windows: the caller's limit and window (ignored for resources).
        limit: u64,
        window_ms: u64,
        cost: u64,
        reply: oneshot::Sender<LocalResult<pb::TryAcquireResponse>>,
    },
    PutResource {
        resource: pb::RateLimitResource,
        reply: oneshot::Sender<LocalResult<pb::PutRateLimitResponse>>,
    },
    DeleteResource {
        tenant: String,
        resource_key: String,
        reply: oneshot::Sender<LocalResult<pb::DeleteRateLimitResponse>>,
    },
    Describe {
        key: pb::RateKeyRef,
        ticket: Option<TicketKey>,
        reply: oneshot::Sender<LocalResult<pb::DescribeRateKeyResponse>>,
    },
    /// Rate commands, or a grant re-send, from admission's link (the hot path).
    Link(LinkInput),
}

pub struct RatePartition {
    settings: PartitionSettings,
    windows: HashMap<WindowKey, WindowState>,
    resources: HashMap<(String, String), ResourceRecord>,
    /// Recently granted tickets: a duplicate acquire re-sends the grant.
    granted: HashMap<TicketKey, TicketRecord>,
    granted_order: VecDeque<(i64, TicketKey)>,
    /// Which window each waiting ticket is in.
    waiting_in: HashMap<TicketKey, WindowKey>,
    wakeups: BTreeSet<(i64, WindowKey)>,
}

impl RatePartition {
    pub fn new(settings: PartitionSettings) -> Self {
        RatePartition {
            settings,
            windows: HashMap::new(),
            resources: HashMap::new(),
            granted: HashMap::new(),
            granted_order: VecDeque::new(),
            waiting_in: HashMap::new(),
            wakeups: BTreeSet::new(),
        }
    }

    /// Restore loaded rows.
    pub fn restore(
        &mut self,
        now_ms: i64,
        resources: Vec<((String, String), ResourceRecord)>,
        windows: Vec<(WindowRecord, Vec<(i64, u64)>)>,
        tickets: Vec<TicketRecord>,
    ) {
        self.resources = resources.into_iter().collect();
        for (record, grants) in windows {
            let Some(spec) = self.spec_of(&record) else {
                continue;
            };
            let mut window = SlidingWindow::new(spec);
            if let Err(error) = window.restore(grants) {
                tracing::error!(key = %display_key(&record.key), %error, "window grants could not be restored");
            }
            self.windows.insert(
                window_key(&record.key),
                WindowState {
                    key: record.key,
                    window,
                    queue: RateQueue::new(),
                    waiting: HashMap::new(),
                    wakeup: None,
                },
            );
        }
        let mut granted: Vec<TicketRecord> = Vec::new();
        for record in tickets {
            if record.granted {
                granted.push(record);
                continue;
            }
            let Some(state) = self.windows.get_mut(&record.window_key) else {
                tracing::warn!(job_id = %record.ticket.job_id, "waiting ticket without its window; dropped");
                continue;
            };
            state.queue.push(Waiter {
                ticket: record.ticket.clone(),
                priority: record.priority,
                enqueued_at_us: record.enqueued_at_us,
                cost: record.cost,
            });
            self.waiting_in.insert(record.ticket.clone(), record.window_key.clone());
            state.waiting.insert(record.ticket.clone(), record);
        }
        granted.sort_by_key(|record| record.granted_at_ms.unwrap_or_default());
        for record in granted {
            self.granted_order
                .push_back((record.granted_at_ms.unwrap_or_default(), record.ticket.clone()));
            self.granted.insert(record.ticket.clone(), record);
        }
        let keys: Vec<WindowKey> = self.windows.keys().cloned().collect();
        for key in keys {
            self.reschedule(&key, now_ms);
        }
    }

    fn spec_of(&self, record: &WindowRecord) -> Option<WindowSpec> {
        if let Some(resource) = resource_of(&record.key) {
            return self.resources.get(&resource).and_then(ResourceRecord::spec);
        }
        WindowSpec::new(
            u64::try_from(record.rate_limit).ok()?,
            u64::try_from(record.window_ms).ok()?,
        )
        .ok()
    }

    /// Apply one rate command (after `check_command`).
    pub fn apply_command(
        &mut self,
        now_ms: i64,
        command: pb::RateCommand,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
    ) -> Result<(), String> {
        self.check_command(&command)?;
        let trace = sluice_common::telemetry::checked(&command.trace.unwrap_or_default());
        match command.command {
            Some(pb::rate_command::Command::Acquire(acquire)) => self.acquire(now_ms, acquire, trace, writes, outbox),
            Some(pb::rate_command::Command::Cancel(cancel)) => {
                self.cancel(now_ms, cancel, writes, outbox);
                Ok(())
            }
            // Rate tickets are not held, so there is nothing to stand behind.
            Some(pb::rate_command::Command::StandBehind(_)) => Ok(()),
            None => Err("rate command without a command".to_string()),
        }
    }

    /// Everything a command must satisfy before it changes anything: the
    /// bounds admission checks at the edge, so what admission accepts is
    /// accepted here, and a command that fails them is set aside alone.
    pub fn check_command(&self, command: &pb::RateCommand) -> Result<(), String> {
        let key = self.check_fields(command).map_err(|error| error.to_string())?;
        match key {
            Some(key) => self.check_partition(key),
            None => Ok(()),
        }
    }

    fn check_fields<'a>(&self, command: &'a pb::RateCommand) -> Result<Option<&'a pb::RateKeyRef>, FieldError> {
        let max_key_bytes = self.settings.input.max_key_bytes;
        match &command.command {
            Some(pb::rate_command::Command::Acquire(acquire)) => {
                check_rate_key("acquire.key", acquire.key.as_ref(), max_key_bytes)?;
                check_ticket("acquire.ticket", acquire.ticket.as_ref())?;
                check_u32("acquire.priority", acquire.priority, 0, 99)?;
                let inline = matches!(
                    acquire.key.as_ref().and_then(|key| key.kind.as_ref()),
                    Some(pb::rate_key_ref::Kind::Inline(_))
                );
                if inline {
                    check_rate_window("acquire", acquire.limit, acquire.window_ms, acquire.cost)?;
                } else {
                    check_i64("acquire.cost", acquire.cost, 0, sluice_common::validate::MAX_RATE_LIMIT)?;
                }
                Ok(acquire.key.as_ref())
            }
            Some(pb::rate_command::Command::Cancel(cancel)) => {
                check_rate_key("cancel.key", cancel.key.as_ref(), max_key_bytes)?;
                check_ticket("cancel.ticket", cancel.ticket.as_ref())?;
                Ok(cancel.key.as_ref())
            }
            Some(pb::rate_command::Command::StandBehind(_)) => Ok(None),
            None => Err(FieldError::new("command", "must be set")),
        }
    }

    fn check_partition(&self, key: &pb::RateKeyRef) -> Result<(), String> {
        let expected = rate_key_partition(key, self.settings.rate_partitions);
        if expected != self.settings.partition {
            return Err(format!(
                "rate key {} of tenant {:?} hashes to partition {expected}, not {}",
                display_key(key),
                key.tenant,
                self.settings.partition
            ));
        }
        Ok(())
    }

    /// The window for `key`, created or updated to `inline_spec` for inline
    /// keys. `None` for a resource key with no stored resource.
    fn window_for(
        &mut self,
        key: &pb::RateKeyRef,
        inline_spec: Option<WindowSpec>,
        writes: &mut RateWrites,
    ) -> Option<WindowKey> {
        let stored = window_key(key);
        let spec = match resource_of(key) {
            Some(resource) => self.resources.get(&resource).and_then(ResourceRecord::spec)?,
            None => inline_spec?,
        };
        let record = || WindowRecord {
            key: key.clone(),
            rate_limit: i64::try_from(spec.limit()).unwrap_or(i64::MAX),
            window_ms: i64::try_from(spec.window_ms()).unwrap_or(i64::MAX),
        };
        match self.windows.get_mut(&stored) {
            Some(state) => {
                if state.window.spec() != spec {
                    state.window.set_spec(spec);
                    writes.windows.insert(stored.clone(), Some(record()));
                }
            }
            None => {
                self.windows.insert(
                    stored.clone(),
                    WindowState {
                        key: key.clone(),
                        window: SlidingWindow::new(spec),
                        queue: RateQueue::new(),
                        waiting: HashMap::new(),
                        wakeup: None,
                    },
                );
                writes.windows.insert(stored.clone(), Some(record()));
            }
        }
        Some(stored)
    }

    pub fn waiting(&self) -> usize {
        self.waiting_in.len()
    }
}

impl OwnedState for RatePartition {
    type Local = LocalRequest;
    type Writes = RateWrites;
    type Prepared = ();

    fn apply(
        &mut self,
        now_ms: i64,
        messages: &[InMsg],
        locals: Vec<LocalRequest>,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
        rejected: &mut Vec<Rejected>,
    ) {
        self.run_timers(now_ms, writes, outbox);
        for message in messages {
            apply_entries(message, "rate command", rejected, |command: pb::RateCommand| {
                self.apply_command(now_ms, command, writes, outbox)
            });
        }
        for local in locals {
            self.apply_local(now_ms, local, writes, outbox, replies, rejected);
        }
        self.forget_old_grants(now_ms, writes);
    }

    fn resend_all(&self, _now_ms: i64, outbox: &mut Outbox) {
        self.resend_grants_where(|_| true, outbox);
    }

    fn next_wakeup_ms(&self) -> Option<i64> {
        self.wakeups.first().map(|(at, _)| *at)
    }

    fn key_stats(&self, now_ms: i64) -> Vec<sluice_common::metrics::KeyStat> {
        self.windows
            .values()
            .map(|state| sluice_common::metrics::KeyStat {
                tenant: state.key.tenant.clone(),
                key: display_key(&state.key),
                kind: "rate",
                holders: state.window.used(now_ms),
                waiting: u64::try_from(state.queue.len()).unwrap_or(u64::MAX),
                max: Some(state.window.spec().limit()),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
