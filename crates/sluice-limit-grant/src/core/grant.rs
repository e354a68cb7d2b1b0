//! The grant decision (docs/architecture.md, guarantee 1, "No overrun"),
//! and the grant events to admission.

use sluice_common::hash::HashSet;

use sluice_common::kafka::Outbox;
use sluice_common::link::Link;
use sluice_common::partition::job_partition;
use sluice_proto::v1 as pb;

use super::flows;
use super::keys::{is_shadow, max_for, Holder, KeyState};
use super::shadow::{ShadowSim, WouldHaveWaited};
use super::{Decided, KeyId, LimitEffect, LimitPartition, TicketRecord};

/// A new grant: the ticket as granted, its kind, the holders with it and
/// the max it was granted under.
struct Granted {
    record: TicketRecord,
    kind: pb::LimitKind,
    holders: usize,
    max: i64,
}

impl KeyState {
    /// Grant the next waiter (by flow, then queue order) while it fits
    /// under the max. A flow's head is never overtaken: if it does not fit,
    /// nobody is granted.
    fn grant_while_room(&mut self, now_ms: i64, out: &mut Decided) -> Vec<Granted> {
        let mut granted = Vec::new();
        let weights = &self.record.flow_weights;
        while let Some((_, head)) = self.waiters.next(|flow| flows::weight_of(weights, flow)) {
            let max = max_for(&self.record, &head.record);
            let kind = self.record.grant_kind(&head.record);
            let shadow = is_shadow(&self.record, &head.record);
            // In shadow mode the limit is accounted, not enforced.
            if !shadow && self.holders.len() >= usize::try_from(max).unwrap_or(usize::MAX) {
                break;
            }
            let Some((_, waiting)) = self.waiters.take_next() else {
                break;
            };
            let mut record = waiting.record;
            record.held = true;
            record.granted_at_ms = Some(now_ms);
            out.writes.upsert(record.clone());
            self.holders.insert(
                record.ticket.clone(),
                Holder {
                    record: record.clone(),
                    confirmed_at_ms: now_ms.max(waiting.confirmed_at_ms),
                },
            );
            debug_assert!(
                shadow || self.holders.len() <= usize::try_from(max).unwrap_or(usize::MAX),
                "overrun: {} holders over max {max}",
                self.holders.len()
            );
            if shadow {
                let exceeded = self
                    .shadow
                    .get_or_insert_with(ShadowSim::default)
                    .real_grant(self.holders.len(), max);
                if exceeded {
                    out.effect(LimitEffect::ShadowExceeded {
                        key_id: self.id.clone(),
                    });
                }
            }
            if let Some(adaptive) = self.record.adaptive.as_mut() {
                adaptive.granted(&record.ticket);
            }
            let holders = self.holders.len();
            granted.push(Granted {
                record,
                kind,
                holders,
                max: i64::from(max),
            });
        }
        granted
    }

    /// After the grants: an adaptive key's window notes whether the key
    /// used its whole max, and a shadow-mode key's simulation grants what
    /// the enforced limit would have.
    fn after_grants(&mut self) -> Vec<WouldHaveWaited> {
        if let Some(adaptive) = self.record.adaptive.as_mut() {
            // The window used the whole max: jobs wait, or the holders fill it.
            if !self.waiters.is_empty() || self.holders.len() >= usize::try_from(adaptive.current()).unwrap_or(0) {
                adaptive.saturated();
            }
        }
        let shadow_max = self.shadow_max();
        self.shadow
            .as_mut()
            .map(|shadow| shadow.pump(shadow_max))
            .unwrap_or_default()
    }
}

impl LimitPartition {
    /// The grant decision for `key_id` (`KeyState::grant_while_room`), and
    /// what follows it: the grant events, the effects, an idle key dropped.
    pub(super) fn grant_waiters_that_fit(&mut self, now_ms: i64, key_id: &KeyId, out: &mut Decided) {
        let Some(state) = self.keys.get_mut(key_id) else {
            return;
        };
        let granted = state.grant_while_room(now_ms, out);
        let would_have_waited = state.after_grants();
        let idle = state.is_idle();
        let shared_id = state.id.clone();
        for Granted {
            record,
            kind,
            holders,
            max,
        } in granted
        {
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
    pub(super) fn emit_grant(
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

    /// Send again the grants of every ticket held for jobs in
    /// `job_partitions` (a stream now takes them).
    pub(super) fn resend_grants(&self, job_partitions: &[i32], outbox: &mut Outbox) {
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
}
