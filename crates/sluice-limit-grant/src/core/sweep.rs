//! Admission's sweeps: the tickets it stands behind, the grants it still
//! waits for; a ticket nobody stands behind is reclaimed, and so is a
//! ticket of an attempt the sweep shows is over.

use sluice_common::hash::{HashMap, HashSet};
use std::sync::Arc;

use sluice_common::kafka::Outbox;
use sluice_common::partition::job_partition;
use sluice_proto::v1 as pb;

use super::{Decided, KeyId, LimitEffect, LimitPartition, TicketKey};

#[derive(Debug)]
pub(super) struct PendingSweep {
    snapshot_at_ms: i64,
    grace_ms: i64,
    job_partitions: HashSet<i32>,
    parts: u32,
    seen_parts: HashSet<u32>,
    received_at_ms: i64,
    /// The newest attempt of each job the sweep lists a ticket of. A job
    /// moves to a new attempt only after its previous attempt ended and
    /// gave back every ticket it held or waited for (`end_attempt`'s
    /// release), so a ticket of an older attempt is one whose release was
    /// lost (an admission instance that died or lost the job partition
    /// with the release unsent): reclaimed at once, not after the grace.
    newest_attempts: HashMap<String, u32>,
}

/// How much later than a takeover a sweep must be taken for it to reclaim
/// a restored ticket it does not list, without the grace: room for clocks
/// that differ between instances and for an acquire sent just before the
/// sweep's snapshot (the grace, `limit_grant.ticket_grace`, covers tickets
/// created around a sweep; a restored one was created before the takeover).
pub(super) const RESTORED_MARGIN_MS: i64 = 2_000;

impl LimitPartition {
    /// Admission waits for the grant of these tickets, and this owner holds
    /// them as granted: their grants were lost on the way (a stream that
    /// broke, a grant sent to an instance that had just lost the job's
    /// partition). Sent again; a re-send, not a new decision (not
    /// observed).
    pub(super) fn resend_lost_grants(&self, waiting: &[pb::TicketId], outbox: &mut Outbox) {
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
    pub(super) fn stand_behind(&mut self, now_ms: i64, stand_behind: pb::StandBehind, out: &mut Decided) {
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
                seen_parts: HashSet::default(),
                received_at_ms: now_ms,
                newest_attempts: HashMap::default(),
            });
        pending.seen_parts.insert(stand_behind.part);
        // Attempts count from 1: a first attempt supersedes nothing, so
        // a sweep of first attempts (the usual one) records nothing here.
        for ticket in stand_behind.tickets.iter().filter(|ticket| ticket.attempt > 1) {
            let newest = pending.newest_attempts.entry(ticket.job_id.clone()).or_default();
            *newest = (*newest).max(ticket.attempt);
        }
        if u32::try_from(pending.seen_parts.len()).unwrap_or(u32::MAX) >= pending.parts {
            if let Some(complete) = self.sweeps.remove(&stand_behind.sweep_id) {
                self.expire_unconfirmed(now_ms, &complete, out);
            }
        }
        // A sweep whose parts never all arrive (its sender died) is dropped.
        let horizon = now_ms - 10 * self.settings.ticket_grace_ms.max(1);
        self.sweeps.retain(|_, sweep| sweep.received_at_ms >= horizon);
    }

    pub(super) fn expire_unconfirmed(&mut self, now_ms: i64, sweep: &PendingSweep, out: &mut Decided) {
        let cutoff = sweep.snapshot_at_ms - sweep.grace_ms;
        // A sweep taken well after this owner restored its tickets: a
        // restored ticket it does not list (and no sweep listed since) is
        // one whose release was lost around the takeover. Every ticket
        // restored was created before the takeover, so admission, which
        // asks for a ticket only after saving the job that waits for it,
        // lists every live one in a sweep taken after it.
        let restored_unconfirmed = self
            .restored_at_ms
            .filter(|restored_at| sweep.snapshot_at_ms > restored_at.saturating_add(RESTORED_MARGIN_MS));
        let unconfirmed =
            |confirmed_at_ms: i64| confirmed_at_ms < cutoff || restored_unconfirmed == Some(confirmed_at_ms);
        let grants_partitions = self.settings.grants_partitions;
        let mut expired: Vec<(Arc<KeyId>, TicketKey)> = Vec::new();
        for state in self.keys.values() {
            let covered = |ticket: &TicketKey| {
                sweep
                    .job_partitions
                    .contains(&job_partition(&ticket.job_id, grants_partitions))
            };
            let superseded = |ticket: &TicketKey| {
                sweep
                    .newest_attempts
                    .get(&*ticket.job_id)
                    .is_some_and(|newest| *newest > ticket.attempt)
            };
            for (ticket, holder) in &state.holders {
                if (unconfirmed(holder.confirmed_at_ms) && covered(ticket)) || superseded(ticket) {
                    expired.push((state.id.clone(), ticket.clone()));
                }
            }
            for (_, _, waiting) in state.waiters.iter() {
                let ticket = &waiting.record.ticket;
                if (unconfirmed(waiting.confirmed_at_ms) && covered(ticket)) || superseded(ticket) {
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
}
