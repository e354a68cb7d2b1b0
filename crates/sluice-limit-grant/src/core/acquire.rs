//! Acquires and releases, and their duplicates.

use std::sync::Arc;

use sluice_common::core::CompactTraceContext;
use sluice_common::kafka::Outbox;
use sluice_proto::v1 as pb;

use super::adaptive::{Adaptive, AdaptiveSettings, Outcome};
use super::keys::{is_shadow, KeyState, WaitOrder, Waiting};
use super::shadow::ShadowSim;
use super::{
    Decided, FloatingRecord, KeyId, LimitEffect, LimitPartition, LimitWrites, TicketKey, TicketPlace, TicketRecord,
};

/// What a release says about its attempt for an adaptive key: how long it
/// ran, and whether it ended well (failures, run timeouts and expired leases
/// are signs of overload). Nothing for releases that say nothing about the
/// downstream (cancelled, handed back, unwanted).
pub(super) fn observed_run(release: &pb::ReleaseTicket) -> Option<(i64, Outcome)> {
    let run_ms = i64::try_from(release.run_ms?).unwrap_or(i64::MAX);
    let outcome = match pb::ReleaseReason::try_from(release.reason).ok()? {
        pb::ReleaseReason::Succeeded => Outcome::Succeeded,
        pb::ReleaseReason::Failed | pb::ReleaseReason::LeaseExpired => Outcome::Failed,
        _ => return None,
    };
    Some((run_ms, outcome))
}

/// What an acquire asks for: the job's own max, and the shared state its
/// key is created with when the job is its first.
struct Requested {
    job_max: u32,
    floating: Option<pb::FloatingConcurrencyLimit>,
    adaptive: Option<AdaptiveSettings>,
}

impl Requested {
    fn of(limit: pb::acquire_ticket::Limit) -> Self {
        match limit {
            pb::acquire_ticket::Limit::MaxConcurrency(max) => Requested {
                job_max: max,
                floating: None,
                adaptive: None,
            },
            pb::acquire_ticket::Limit::Floating(spec) => Requested {
                job_max: spec.default_max,
                floating: Some(spec),
                adaptive: None,
            },
            pb::acquire_ticket::Limit::Adaptive(spec) => {
                let settings = AdaptiveSettings::of(&spec);
                Requested {
                    job_max: settings.initial,
                    floating: None,
                    adaptive: Some(settings),
                }
            }
        }
    }
}

impl KeyState {
    /// The first job of a key creates its shared floating or adaptive
    /// state; later jobs' values are ignored.
    fn create_shared(&mut self, requested: &Requested, writes: &mut LimitWrites) {
        if let Some(settings) = requested.adaptive {
            if self.record.adaptive.is_none() {
                self.record.adaptive = Some(Adaptive::new(settings));
                writes.save_key(&self.id, &self.record);
            }
        }
        if let Some(spec) = &requested.floating {
            if self.record.floating.is_none() {
                self.record.floating = Some(FloatingRecord {
                    current_max: spec.default_max.max(1),
                    default_max: spec.default_max.max(1),
                    refresh_interval_ms: spec.refresh_interval_ms,
                    metadata: spec.metadata.clone().into_iter().collect(),
                    last_due_ms: None,
                    last_set_ms: None,
                    last_task_id: None,
                });
                writes.keys.insert((*self.id).clone(), Some(self.record.clone()));
            }
        }
    }

    /// Queue a new waiter (and, in shadow mode, let the simulation see it
    /// arrive).
    fn enqueue(&mut self, record: TicketRecord, now_ms: i64) {
        if is_shadow(&self.record, &record) {
            self.shadow_job_max = record.job_max.max(1);
            self.shadow.get_or_insert_with(ShadowSim::default).arrive(
                record.ticket.clone(),
                WaitOrder::of(&record),
                now_ms,
                record.trace.clone(),
            );
        }
        self.insert_waiter(Waiting {
            record,
            confirmed_at_ms: now_ms,
        });
    }
}

impl LimitPartition {
    pub(super) fn acquire(
        &mut self,
        now_ms: i64,
        acquire: pb::AcquireTicket,
        trace: pb::TraceContext,
        out: &mut Decided,
    ) -> Result<(), String> {
        let key_id = self.checked_key(acquire.key.as_ref())?;
        let ticket = TicketKey::from_proto(&acquire.ticket.unwrap_or_default());
        if self.ticket_keys.contains_key(&ticket) {
            self.acquire_again(now_ms, &ticket, &mut out.sends);
            return Ok(());
        }
        let Some(requested) = acquire.limit.map(Requested::of) else {
            return Err(format!("acquire for job {} has no limit", ticket.job_id));
        };
        let state = self.key_state(&key_id);
        state.create_shared(&requested, &mut out.writes);
        let record = TicketRecord {
            ticket: ticket.clone(),
            key_id: state.id.clone(),
            held: false,
            priority: acquire.priority,
            enqueued_at_us: acquire.enqueued_at_us,
            job_max: requested.job_max,
            floating: requested.floating.is_some(),
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
        state.enqueue(record, now_ms);
        self.ticket_keys.insert(ticket, place);
        self.grant_waiters_that_fit(now_ms, &key_id, out);
        self.refresh_if_due(now_ms, &key_id, &trace, out);
        Ok(())
    }

    /// A duplicate acquire: the grant is sent again if the ticket is held
    /// (and the ticket counts as confirmed); a waiter just waits.
    fn acquire_again(&mut self, now_ms: i64, ticket: &TicketKey, sends: &mut Outbox) {
        let Some(place) = self.ticket_keys.get(ticket) else {
            return;
        };
        let Some(state) = self.keys.get_mut(&*place.key_id) else {
            return;
        };
        let holders = state.holders.len();
        if let Some(holder) = state.holders.get_mut(ticket) {
            holder.confirmed_at_ms = holder.confirmed_at_ms.max(now_ms);
            let record = holder.record.clone();
            let max = i64::from(state.max_for(&record));
            let kind = state.record.grant_kind(&record);
            self.emit_grant(&record, kind, holders, max, sends);
        }
    }

    /// Free a held ticket or remove a waiting one. `observed`: how long a
    /// held ticket's attempt ran and how it ended, for an adaptive key.
    pub(super) fn release(
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
}
