//! One owned partition of rate-window: its windows (sliding, 1 ms), their
//! waiting queues, the stored resources of its keys, and recent grants. Pure:
//! decisions go into a write set and an outbox the owner runtime commits and
//! publishes. A deferred job is granted by a timer at the exact millisecond
//! its slot opens (`next_wakeup_ms`), never by polling.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};

use sluice_common::kafka::{InMsg, Outbox};
use sluice_common::link::{Link, LinkInput};
use sluice_common::owner::{apply_entries, OwnedState, Rejected, Reply, WriteSet};
use sluice_common::partition::{job_partition, rate_key_partition};
use sluice_common::validate::{
    check_i64, check_rate_key, check_rate_window, check_ticket, check_u32, FieldError, InputLimits,
};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::queue::{RateQueue, Waiter};
use crate::window::{Decision, SlidingWindow, WindowSpec};

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

    fn remember_grant(&mut self, record: TicketRecord, writes: &mut RateWrites) {
        writes.upsert_ticket(record.clone());
        self.granted_order
            .push_back((record.granted_at_ms.unwrap_or_default(), record.ticket.clone()));
        self.granted.insert(record.ticket.clone(), record);
    }

    fn forget_old_grants(&mut self, now_ms: i64, writes: &mut RateWrites) {
        let cutoff = now_ms - self.settings.granted_retention_ms;
        let mut forgot = false;
        while let Some((at, ticket)) = self.granted_order.front() {
            if *at >= cutoff {
                break;
            }
            if self.granted.get(ticket).and_then(|record| record.granted_at_ms) == Some(*at) {
                self.granted.remove(ticket);
            }
            self.granted_order.pop_front();
            forgot = true;
        }
        if forgot {
            writes.forget_granted_before = Some(cutoff);
        }
    }

    /// A new grant, sent and (once the batch is committed) counted, with
    /// its `rate-window.grant` span. Re-sends use `emit_grant` alone, so
    /// each grant counts once.
    fn grant_out(&self, record: &TicketRecord, key: &pb::RateKeyRef, limit: i64, outbox: &mut Outbox) {
        let (record_seen, key_seen) = (record.clone(), key.clone());
        let partition = self.settings.partition;
        outbox.observe(move || {
            let (record, key) = (record_seen, key_seen);
            let granted_at_ms = record.granted_at_ms.unwrap_or_default();
            let display = display_key(&key);
            sluice_common::metrics::metrics().record_grant(
                "rate-window",
                "rate",
                &key.tenant,
                &display,
                granted_at_ms - record.waiting_since_ms,
            );
            let at = sluice_common::clock::system_time_at_ms;
            sluice_common::telemetry::record_span(
                "sluice-rate-window",
                "rate-window.grant",
                &pb::TraceContext {
                    traceparent: record.traceparent.clone(),
                    tracestate: record.tracestate.clone(),
                },
                at(granted_at_ms),
                at(granted_at_ms),
                || {
                    vec![
                        opentelemetry::KeyValue::new("sluice.job_id", record.ticket.job_id.clone()),
                        opentelemetry::KeyValue::new("sluice.tenant", key.tenant.clone()),
                        opentelemetry::KeyValue::new("sluice.key", display.clone()),
                        opentelemetry::KeyValue::new("sluice.limit", limit),
                        opentelemetry::KeyValue::new("sluice.cost", i64::try_from(record.cost).unwrap_or(i64::MAX)),
                        opentelemetry::KeyValue::new("sluice.unthrottled", record.unthrottled),
                        opentelemetry::KeyValue::new("sluice.partition", i64::from(partition)),
                    ]
                },
            );
        });
        self.emit_grant(record, key, limit, outbox);
    }

    /// The grant event to admission (a new grant, or one sent again).
    fn emit_grant(&self, record: &TicketRecord, key: &pb::RateKeyRef, limit: i64, outbox: &mut Outbox) {
        let event = pb::GrantEvent {
            trace: Some(pb::TraceContext {
                traceparent: record.traceparent.clone(),
                tracestate: record.tracestate.clone(),
            }),
            ticket: Some(record.ticket.to_proto()),
            key: Some(pb::KeyRef {
                tenant: key.tenant.clone(),
                key: display_key(key),
            }),
            kind: pb::LimitKind::Rate as i32,
            granted_at_ms: record.granted_at_ms.unwrap_or_default(),
            holders: 0,
            max: limit,
            waiting_since_ms: record.waiting_since_ms,
            position_at_enqueue: record.position_at_enqueue,
            unthrottled: record.unthrottled,
        };
        let partition = job_partition(&record.ticket.job_id, self.settings.grants_partitions);
        outbox.push_link(Link::Admission, partition, &event);
    }

    fn acquire(
        &mut self,
        now_ms: i64,
        acquire: pb::RateAcquire,
        trace: pb::TraceContext,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
    ) -> Result<(), String> {
        let Some(key) = acquire.key else {
            return Err("rate acquire without a key".to_string());
        };
        self.check_partition(&key)?;
        let ticket = TicketKey::from_proto(&acquire.ticket.unwrap_or_default());
        if let Some(record) = self.granted.get(&ticket) {
            // A duplicate of a granted acquire: re-send the grant.
            let limit = self.windows.get(&record.window_key).map_or(0, |state| {
                i64::try_from(state.window.spec().limit()).unwrap_or(i64::MAX)
            });
            let record = record.clone();
            self.emit_grant(&record, &key, limit, outbox);
            return Ok(());
        }
        if self.waiting_in.contains_key(&ticket) {
            return Ok(());
        }
        let cost = u64::try_from(acquire.cost.max(1)).unwrap_or(1);
        let inline_spec = match (u64::try_from(acquire.limit), u64::try_from(acquire.window_ms)) {
            (Ok(limit), Ok(window_ms)) => WindowSpec::new(limit, window_ms).ok(),
            _ => None,
        };
        let mut record = TicketRecord {
            ticket: ticket.clone(),
            window_key: window_key(&key),
            granted: false,
            priority: acquire.priority,
            enqueued_at_us: acquire.enqueued_at_us,
            cost,
            waiting_since_ms: now_ms,
            position_at_enqueue: 0,
            granted_at_ms: None,
            unthrottled: false,
            traceparent: trace.traceparent,
            tracestate: trace.tracestate,
        };
        let Some(stored) = self.window_for(&key, inline_spec, writes) else {
            if resource_of(&key).is_none() {
                return Err(format!(
                    "rate acquire for job {} has an invalid inline spec",
                    ticket.job_id
                ));
            }
            // A reference to a key with no stored resource is not throttled.
            record.granted = true;
            record.granted_at_ms = Some(now_ms);
            record.unthrottled = true;
            self.grant_out(&record, &key, 0, outbox);
            self.remember_grant(record, writes);
            return Ok(());
        };
        let Some(state) = self.windows.get_mut(&stored) else {
            return Ok(());
        };
        state.queue.push(Waiter {
            ticket: ticket.clone(),
            priority: record.priority,
            enqueued_at_us: record.enqueued_at_us,
            cost,
        });
        record.position_at_enqueue = state
            .queue
            .position(&ticket)
            .and_then(|position| u32::try_from(position).ok())
            .unwrap_or_default();
        writes.upsert_ticket(record.clone());
        state.waiting.insert(ticket.clone(), record);
        self.waiting_in.insert(ticket.clone(), stored.clone());
        self.pump(now_ms, &stored, writes, outbox);
        if self.waiting_in.contains_key(&ticket) {
            // Per key only for keys selected for per-key metrics (bounded).
            let metrics = sluice_common::metrics::metrics();
            let display = display_key(&key);
            let mut labels = vec![opentelemetry::KeyValue::new(
                "kind",
                if resource_of(&key).is_some() {
                    "resource"
                } else {
                    "inline"
                },
            )];
            if metrics.key_selected(&key.tenant, &display) {
                labels.push(opentelemetry::KeyValue::new("tenant", key.tenant.clone()));
                labels.push(opentelemetry::KeyValue::new("key", display));
            }
            metrics.rate_deferrals.add(1, &labels);
        }
        Ok(())
    }

    fn cancel(&mut self, now_ms: i64, cancel: pb::RateCancel, writes: &mut RateWrites, outbox: &mut Outbox) {
        let ticket = TicketKey::from_proto(&cancel.ticket.unwrap_or_default());
        let Some(stored) = self.waiting_in.remove(&ticket) else {
            return;
        };
        if let Some(state) = self.windows.get_mut(&stored) {
            state.queue.remove(&ticket);
            state.waiting.remove(&ticket);
        }
        writes.delete_ticket(&ticket);
        // The head may have changed.
        self.pump(now_ms, &stored, writes, outbox);
    }

    /// Grant from the head while legal now, then schedule the next slot.
    fn pump(&mut self, now_ms: i64, stored: &WindowKey, writes: &mut RateWrites, outbox: &mut Outbox) {
        let Some(state) = self.windows.get_mut(stored) else {
            return;
        };
        let grants = state.queue.pump(&mut state.window, now_ms);
        let limit = i64::try_from(state.window.spec().limit()).unwrap_or(i64::MAX);
        let window_ms = i64::try_from(state.window.spec().window_ms()).unwrap_or(i64::MAX);
        let key = state.key.clone();
        let mut records = Vec::with_capacity(grants.len());
        for grant in grants {
            let Some(mut record) = state.waiting.remove(&grant.waiter.ticket) else {
                continue;
            };
            record.granted = true;
            record.granted_at_ms = Some(grant.granted_at_ms);
            *writes
                .grant_units
                .entry((stored.clone(), grant.granted_at_ms))
                .or_default() += grant.waiter.cost;
            let prune = writes.prune_before.entry(stored.clone()).or_insert(i64::MIN);
            *prune = (*prune).max(grant.granted_at_ms - window_ms);
            records.push(record);
        }
        for record in records {
            self.waiting_in.remove(&record.ticket);
            self.grant_out(&record, &key, limit, outbox);
            self.remember_grant(record, writes);
        }
        self.reschedule(stored, now_ms);
    }

    fn reschedule(&mut self, stored: &WindowKey, now_ms: i64) {
        let Some(state) = self.windows.get_mut(stored) else {
            return;
        };
        if let Some(previous) = state.wakeup.take() {
            self.wakeups.remove(&(previous, stored.clone()));
        }
        match state.queue.next_wakeup(&state.window, now_ms) {
            Ok(Some(at)) => {
                state.wakeup = Some(at);
                self.wakeups.insert((at, stored.clone()));
            }
            Ok(None) => {}
            Err(error) => {
                // The head costs more than the current limit: it waits for a
                // raise (a job is never rejected for being over the limit).
                tracing::warn!(key = %display_key(&state.key), %error, "the head of a rate queue cannot be granted under the current limit");
            }
        }
    }

    fn run_timers(&mut self, now_ms: i64, writes: &mut RateWrites, outbox: &mut Outbox) {
        while let Some((at, stored)) = self.wakeups.first().cloned() {
            if at > now_ms {
                break;
            }
            self.wakeups.remove(&(at, stored.clone()));
            if let Some(state) = self.windows.get_mut(&stored) {
                state.wakeup = None;
            }
            self.pump(now_ms, &stored, writes, outbox);
        }
    }

    fn try_acquire(
        &mut self,
        now_ms: i64,
        key: &pb::RateKeyRef,
        limit: u64,
        window_ms: u64,
        cost: u64,
        writes: &mut RateWrites,
    ) -> LocalResult<pb::TryAcquireResponse> {
        let inline_spec = if resource_of(key).is_none() {
            Some(
                WindowSpec::new(limit, window_ms)
                    .map_err(|error| tonic::Status::invalid_argument(error.to_string()))?,
            )
        } else {
            None
        };
        let Some(stored) = self.window_for(key, inline_spec, writes) else {
            return Ok(pb::TryAcquireResponse {
                allowed: true,
                unthrottled: true,
                ..Default::default()
            });
        };
        let Some(state) = self.windows.get_mut(&stored) else {
            return Err(tonic::Status::internal("window vanished"));
        };
        let spec = state.window.spec();
        if cost > spec.limit() {
            return Err(tonic::Status::invalid_argument(format!(
                "cost: {cost} is above the limit {} of this window; it could never be allowed",
                spec.limit()
            )));
        }
        let mut response = pb::TryAcquireResponse {
            limit: i64::try_from(spec.limit()).unwrap_or(i64::MAX),
            window_ms: i64::try_from(spec.window_ms()).unwrap_or(i64::MAX),
            ..Default::default()
        };
        if let Some(head_at) = state.wakeup.filter(|_| !state.queue.is_empty()) {
            // Jobs wait on this window: they go first.
            let earliest = state
                .window
                .earliest(now_ms, cost)
                .map_err(|error| tonic::Status::invalid_argument(error.to_string()))?;
            response.retry_at_ms = Some(earliest.max(head_at).max(now_ms + 1));
            response.remaining = 0;
            return Ok(response);
        }
        if !state.queue.is_empty() {
            response.retry_at_ms = None;
            return Ok(response);
        }
        match state.window.try_acquire(now_ms, cost) {
            Ok(Decision::Granted { at_ms, remaining }) => {
                response.allowed = true;
                response.remaining = i64::try_from(remaining).unwrap_or(i64::MAX);
                *writes.grant_units.entry((stored.clone(), at_ms)).or_default() += cost;
                let prune = writes.prune_before.entry(stored).or_insert(i64::MIN);
                *prune = (*prune).max(at_ms - response.window_ms);
            }
            Ok(Decision::Deferred { retry_at_ms }) => {
                response.retry_at_ms = Some(retry_at_ms);
            }
            Err(error) => return Err(tonic::Status::invalid_argument(error.to_string())),
        }
        Ok(response)
    }

    fn put_resource(
        &mut self,
        now_ms: i64,
        resource: pb::RateLimitResource,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
    ) -> LocalResult<pb::PutRateLimitResponse> {
        let key = (resource.tenant.clone(), resource.resource_key.clone());
        let record = ResourceRecord {
            max_count: resource.max_count,
            window_seconds: resource.window_seconds,
        };
        let spec = record
            .spec()
            .ok_or_else(|| tonic::Status::invalid_argument("max_count and window_seconds must be at least 1"))?;
        let created = self.resources.insert(key.clone(), record).is_none();
        writes.resources.insert(key, Some(record));
        let key_ref = pb::RateKeyRef {
            tenant: resource.tenant.clone(),
            kind: Some(pb::rate_key_ref::Kind::ResourceKey(resource.resource_key.clone())),
        };
        let stored = window_key(&key_ref);
        if let Some(state) = self.windows.get_mut(&stored) {
            if state.window.spec() != spec {
                state.window.set_spec(spec);
                writes.windows.insert(
                    stored.clone(),
                    Some(WindowRecord {
                        key: key_ref,
                        rate_limit: resource.max_count,
                        window_ms: resource.window_seconds.saturating_mul(1000),
                    }),
                );
            }
            // A raised limit grants waiters at once.
            self.pump(now_ms, &stored, writes, outbox);
        }
        Ok(pb::PutRateLimitResponse {
            resource: Some(resource),
            created,
        })
    }

    fn delete_resource(
        &mut self,
        now_ms: i64,
        tenant: String,
        resource_key: String,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
    ) -> LocalResult<pb::DeleteRateLimitResponse> {
        let deleted = self.resources.remove(&(tenant.clone(), resource_key.clone())).is_some();
        if deleted {
            writes.resources.insert((tenant.clone(), resource_key.clone()), None);
        }
        let key_ref = pb::RateKeyRef {
            tenant,
            kind: Some(pb::rate_key_ref::Kind::ResourceKey(resource_key)),
        };
        let stored = window_key(&key_ref);
        let mut released = 0u32;
        if let Some(state) = self.windows.remove(&stored) {
            if let Some(at) = state.wakeup {
                self.wakeups.remove(&(at, stored.clone()));
            }
            writes.windows.insert(stored.clone(), None);
            // Waiters are released at once: the key no longer throttles.
            let mut waiters: Vec<TicketRecord> = state
                .queue
                .iter()
                .filter_map(|waiter| state.waiting.get(&waiter.ticket).cloned())
                .collect();
            for record in &mut waiters {
                self.waiting_in.remove(&record.ticket);
                record.granted = true;
                record.granted_at_ms = Some(now_ms);
                record.unthrottled = true;
                released += 1;
            }
            for record in waiters {
                self.grant_out(&record, &key_ref, 0, outbox);
                self.remember_grant(record, writes);
            }
        }
        Ok(pb::DeleteRateLimitResponse {
            deleted,
            released_waiters: released,
        })
    }

    fn describe(&self, now_ms: i64, key: &pb::RateKeyRef, ticket: Option<&TicketKey>) -> pb::DescribeRateKeyResponse {
        let mut response = pb::DescribeRateKeyResponse {
            key: Some(key.clone()),
            partition: u32::try_from(self.settings.partition).unwrap_or_default(),
            ..Default::default()
        };
        if let Some(resource) = resource_of(key) {
            response.stored_resource_missing = !self.resources.contains_key(&resource);
        }
        let Some(state) = self.windows.get(&window_key(key)) else {
            return response;
        };
        let spec = state.window.spec();
        response.limit = i64::try_from(spec.limit()).unwrap_or(i64::MAX);
        response.window_ms = i64::try_from(spec.window_ms()).unwrap_or(i64::MAX);
        response.used = i64::try_from(state.window.used(now_ms)).unwrap_or(i64::MAX);
        response.waiting = u32::try_from(state.queue.len()).unwrap_or(u32::MAX);
        response.next_slot_at_ms = state.wakeup;
        if let Some(ticket) = ticket {
            response.ticket_position = state
                .queue
                .position(ticket)
                .and_then(|position| u32::try_from(position).ok());
            response.ticket_retry_at_ms = simulate_slot(state, now_ms, ticket);
        }
        response
    }

    /// Send again the grants of recently granted tickets of jobs in
    /// `job_partitions` (a stream now takes them).
    fn resend_grants(&self, job_partitions: &[i32], outbox: &mut Outbox) {
        let wanted: HashSet<i32> = job_partitions.iter().copied().collect();
        let partitions = self.settings.grants_partitions;
        self.resend_grants_where(
            |record| wanted.contains(&job_partition(&record.ticket.job_id, partitions)),
            outbox,
        );
    }

    fn resend_grants_where(&self, include: impl Fn(&TicketRecord) -> bool, outbox: &mut Outbox) {
        for record in self.granted.values().filter(|record| include(record)) {
            let key = self
                .windows
                .get(&record.window_key)
                .map(|state| state.key.clone())
                .unwrap_or_default();
            let limit = self.windows.get(&record.window_key).map_or(0, |state| {
                i64::try_from(state.window.spec().limit()).unwrap_or(i64::MAX)
            });
            self.emit_grant(record, &key, limit, outbox);
        }
    }

    fn apply_local(
        &mut self,
        now_ms: i64,
        local: LocalRequest,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
        rejected: &mut Vec<Rejected>,
    ) {
        match local {
            LocalRequest::Link(LinkInput::ResendGrants { job_partitions }) => {
                self.resend_grants(&job_partitions, outbox);
            }
            LocalRequest::Link(LinkInput::Commands(batch)) => {
                for entry in &batch.commands {
                    let outcome = <pb::RateCommand as prost::Message>::decode(entry.as_slice())
                        .map_err(|error| format!("undecodable rate command: {error}"))
                        .and_then(|command| self.apply_command(now_ms, command, writes, outbox));
                    if let Err(reason) = outcome {
                        rejected.push(Rejected {
                            offset: -1,
                            entry: entry.clone(),
                            reason: format!("from admission {} over its link: {reason}", batch.client),
                        });
                    }
                }
                let applied = batch.applied;
                replies.push(Box::new(move || {
                    let _ = applied.send(());
                }));
            }
            LocalRequest::TryAcquire {
                key,
                limit,
                window_ms,
                cost,
                reply,
            } => {
                let answer = match self.check_partition(&key) {
                    Ok(()) => self.try_acquire(now_ms, &key, limit, window_ms, cost, writes),
                    Err(reason) => Err(tonic::Status::internal(reason)),
                };
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
            LocalRequest::PutResource { resource, reply } => {
                let answer = self.put_resource(now_ms, resource, writes, outbox);
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
            LocalRequest::DeleteResource {
                tenant,
                resource_key,
                reply,
            } => {
                let answer = self.delete_resource(now_ms, tenant, resource_key, writes, outbox);
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
            LocalRequest::Describe { key, ticket, reply } => {
                let answer = Ok(self.describe(now_ms, &key, ticket.as_ref()));
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiting_in.len()
    }
}

/// The exact time `ticket`'s slot opens if nothing else arrives: replay the
/// queue ahead of it on a copy of the window.
fn simulate_slot(state: &WindowState, now_ms: i64, ticket: &TicketKey) -> Option<i64> {
    const MAX_SIMULATED: usize = 10_000;
    let mut window = state.window.clone();
    let mut at = now_ms;
    for waiter in state.queue.iter().take(MAX_SIMULATED) {
        at = window.earliest(at, waiter.cost).ok()?;
        window.try_acquire(at, waiter.cost).ok()?;
        if &waiter.ticket == ticket {
            return Some(at);
        }
    }
    None
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

    fn key_stats(&self) -> Vec<sluice_common::metrics::KeyStat> {
        let now_ms = sluice_common::clock::wall_clock_ms();
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
mod tests {
    use super::*;
    use prost::Message as _;

    fn partition() -> RatePartition {
        RatePartition::new(PartitionSettings {
            partition: 0,
            rate_partitions: 1,
            grants_partitions: 1,
            max_message_bytes: 1_000_000,
            granted_retention_ms: 60_000,
            input: InputLimits::default(),
        })
    }

    fn inline_key(name: &str) -> pb::RateKeyRef {
        pb::RateKeyRef {
            tenant: "t".to_string(),
            kind: Some(pb::rate_key_ref::Kind::Inline(pb::InlineKey {
                name: name.to_string(),
                unique_key: String::new(),
            })),
        }
    }

    fn acquire(
        job: &str,
        key: pb::RateKeyRef,
        priority: u32,
        enqueued: i64,
        limit: i64,
        window_ms: i64,
    ) -> pb::RateAcquire {
        pb::RateAcquire {
            key: Some(key),
            ticket: Some(pb::TicketId {
                job_id: job.to_string(),
                attempt: 1,
                step: 0,
            }),
            priority,
            enqueued_at_us: enqueued,
            limit,
            window_ms,
            cost: 1,
        }
    }

    fn grants(mut outbox: Outbox) -> Vec<(String, i64, bool)> {
        outbox
            .take_links()
            .into_values()
            .flatten()
            .map(|event| pb::GrantEvent::decode(event.as_slice()).unwrap())
            .map(|event| (event.ticket.unwrap().job_id, event.granted_at_ms, event.unthrottled))
            .collect()
    }

    fn step(
        state: &mut RatePartition,
        now: i64,
        commands: Vec<pb::RateAcquire>,
    ) -> (Vec<(String, i64, bool)>, RateWrites) {
        let mut writes = RateWrites::default();
        let mut outbox = Outbox::new();
        state.run_timers(now, &mut writes, &mut outbox);
        for command in commands {
            state
                .acquire(now, command, pb::TraceContext::default(), &mut writes, &mut outbox)
                .unwrap();
        }
        (grants(outbox), writes)
    }

    #[test]
    fn over_the_limit_waits_for_the_exact_slot_and_keeps_queue_order() {
        let mut state = partition();
        let key = inline_key("api");
        let (granted, writes) = step(
            &mut state,
            1_000,
            vec![
                acquire("a", key.clone(), 5, 1, 2, 1000),
                acquire("b", key.clone(), 5, 2, 2, 1000),
                acquire("c", key.clone(), 5, 3, 2, 1000),
                acquire("d", key.clone(), 1, 4, 2, 1000),
            ],
        );
        assert_eq!(
            granted.iter().map(|grant| grant.0.as_str()).collect::<Vec<_>>(),
            vec!["a", "b"]
        );
        assert_eq!(writes.grant_units.values().sum::<u64>(), 2);
        // d (priority 1) is now the head; the slot opens when a's grant leaves.
        assert_eq!(state.next_wakeup_ms(), Some(2_000));
        let (granted, _) = step(&mut state, 1_999, vec![]);
        assert!(granted.is_empty(), "nothing before the slot");
        let (granted, _) = step(&mut state, 2_000, vec![]);
        assert_eq!(
            granted,
            vec![("d".to_string(), 2_000, false), ("c".to_string(), 2_000, false)]
        );
    }

    #[test]
    fn duplicates_resend_the_grant_without_taking_units_twice() {
        let mut state = partition();
        let key = inline_key("api");
        step(&mut state, 0, vec![acquire("a", key.clone(), 5, 1, 1, 1000)]);
        let (granted, writes) = step(&mut state, 10, vec![acquire("a", key.clone(), 5, 1, 1, 1000)]);
        assert_eq!(granted.len(), 1, "the grant is re-sent");
        assert!(writes.grant_units.is_empty(), "no second unit");
        let (granted, _) = step(&mut state, 20, vec![acquire("b", key, 5, 2, 1, 1000)]);
        assert!(granted.is_empty(), "a's one unit still fills the window");
    }

    #[test]
    fn a_missing_resource_does_not_throttle_and_deleting_one_releases_waiters() {
        let mut state = partition();
        let resource = pb::RateKeyRef {
            tenant: "t".to_string(),
            kind: Some(pb::rate_key_ref::Kind::ResourceKey("smtp".to_string())),
        };
        let (granted, _) = step(&mut state, 0, vec![acquire("free", resource.clone(), 5, 1, 0, 0)]);
        assert_eq!(granted, vec![("free".to_string(), 0, true)]);

        let mut writes = RateWrites::default();
        let mut outbox = Outbox::new();
        state
            .put_resource(
                0,
                pb::RateLimitResource {
                    tenant: "t".to_string(),
                    resource_key: "smtp".to_string(),
                    max_count: 1,
                    window_seconds: 60,
                },
                &mut writes,
                &mut outbox,
            )
            .unwrap();
        let (granted, _) = step(
            &mut state,
            1,
            vec![
                acquire("x", resource.clone(), 5, 2, 0, 0),
                acquire("y", resource.clone(), 5, 3, 0, 0),
            ],
        );
        assert_eq!(granted.len(), 1);
        assert_eq!(state.waiting(), 1);
        let mut outbox = Outbox::new();
        let deleted = state
            .delete_resource(
                2,
                "t".to_string(),
                "smtp".to_string(),
                &mut RateWrites::default(),
                &mut outbox,
            )
            .unwrap();
        assert!(deleted.deleted);
        assert_eq!(deleted.released_waiters, 1);
        assert_eq!(grants(outbox), vec![("y".to_string(), 2, true)]);
        assert_eq!(state.next_wakeup_ms(), None);
    }

    #[test]
    fn try_acquire_is_exact_and_does_not_overtake_waiting_jobs() {
        let mut state = partition();
        let key = inline_key("plain");
        let mut writes = RateWrites::default();
        let allowed = state.try_acquire(0, &key, 2, 1000, 2, &mut writes).unwrap();
        assert!(allowed.allowed);
        assert_eq!(allowed.remaining, 0);
        let refused = state.try_acquire(500, &key, 2, 1000, 1, &mut writes).unwrap();
        assert!(!refused.allowed);
        assert_eq!(refused.retry_at_ms, Some(1000));
        assert!(
            state.try_acquire(0, &key, 2, 1000, 3, &mut writes).is_err(),
            "cost above the limit"
        );
        step(&mut state, 600, vec![acquire("job", key.clone(), 5, 1, 2, 1000)]);
        let behind_the_job = state
            .try_acquire(1_000, &key, 2, 1000, 1, &mut RateWrites::default())
            .unwrap();
        assert!(!behind_the_job.allowed, "the waiting job goes first");
        assert_eq!(behind_the_job.retry_at_ms, Some(1_001));
    }

    #[test]
    fn describe_gives_a_waiters_exact_retry_time() {
        let mut state = partition();
        let key = inline_key("api");
        step(
            &mut state,
            0,
            vec![
                acquire("a", key.clone(), 5, 1, 1, 1000),
                acquire("b", key.clone(), 5, 2, 1, 1000),
                acquire("c", key.clone(), 5, 3, 1, 1000),
            ],
        );
        let described = state.describe(
            100,
            &key,
            Some(&TicketKey {
                job_id: std::sync::Arc::from("c"),
                attempt: 1,
                step: 0,
            }),
        );
        assert_eq!(described.waiting, 2);
        assert_eq!(described.ticket_position, Some(1));
        assert_eq!(described.ticket_retry_at_ms, Some(2000), "b at 1000, then c at 2000");
        assert_eq!(described.used, 1);
    }
}
