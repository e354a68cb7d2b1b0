//! The waiting queues of a rate partition: acquiring (granted at once or
//! queued), cancelling, granting from the head of a queue when its slot
//! opens, the timers that do so, and the non-queueing try-acquire.

use sluice_common::kafka::Outbox;
use sluice_proto::v1 as pb;

use super::{
    display_key, resource_of, window_key, LocalResult, RatePartition, RateWrites, TicketKey, TicketRecord, WindowKey,
};
use crate::queue::Waiter;
use crate::window::{Decision, WindowSpec};

impl RatePartition {
    pub(super) fn acquire(
        &mut self,
        now_ms: i64,
        mut acquire: pb::RateAcquire,
        trace: pb::TraceContext,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
    ) -> Result<(), String> {
        let Some(key) = acquire.key.take() else {
            return Err("rate acquire without a key".to_string());
        };
        self.check_partition(&key)?;
        let ticket = TicketKey::from_proto(&acquire.ticket.take().unwrap_or_default());
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
        let inline_spec = match (u64::try_from(acquire.limit), u64::try_from(acquire.window_ms)) {
            (Ok(limit), Ok(window_ms)) => WindowSpec::new(limit, window_ms).ok(),
            _ => None,
        };
        let mut record = waiting_record(ticket.clone(), &key, &acquire, trace, now_ms);
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
            cost: record.cost,
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
            // Counted once the batch is committed (once, whatever a failed
            // commit makes the runtime decide again).
            outbox.observe(move || count_deferral(&key));
        }
        Ok(())
    }

    pub(super) fn cancel(&mut self, now_ms: i64, cancel: pb::RateCancel, writes: &mut RateWrites, outbox: &mut Outbox) {
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
    pub(super) fn pump(&mut self, now_ms: i64, stored: &WindowKey, writes: &mut RateWrites, outbox: &mut Outbox) {
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

    pub(super) fn reschedule(&mut self, stored: &WindowKey, now_ms: i64) {
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

    pub(super) fn run_timers(&mut self, now_ms: i64, writes: &mut RateWrites, outbox: &mut Outbox) {
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

    pub(super) fn try_acquire(
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
}

/// A ticket's record as it joins its key's queue (not granted yet).
fn waiting_record(
    ticket: TicketKey,
    key: &pb::RateKeyRef,
    acquire: &pb::RateAcquire,
    trace: pb::TraceContext,
    now_ms: i64,
) -> TicketRecord {
    let cost = u64::try_from(acquire.cost.max(1)).unwrap_or(1);
    TicketRecord {
        ticket,
        window_key: window_key(key),
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
    }
}

/// Counts an acquire that had to wait for a later slot.
fn count_deferral(key: &pb::RateKeyRef) {
    // Per key only for keys selected for per-key metrics (bounded).
    let metrics = sluice_common::metrics::metrics();
    let display = display_key(key);
    let mut labels = vec![opentelemetry::KeyValue::new(
        "kind",
        if resource_of(key).is_some() {
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
