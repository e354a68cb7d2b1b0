//! Grants of a rate partition: remembering recent grants (for duplicates),
//! sending a grant to admission with its metric and span, and sending
//! recent grants again when a stream takes their job partitions.

use std::collections::HashSet;

use sluice_common::kafka::Outbox;
use sluice_common::link::Link;
use sluice_common::partition::job_partition;
use sluice_proto::v1 as pb;

use super::{display_key, RatePartition, RateWrites, TicketRecord};

impl RatePartition {
    pub(super) fn remember_grant(&mut self, record: TicketRecord, writes: &mut RateWrites) {
        writes.upsert_ticket(record.clone());
        self.granted_order
            .push_back((record.granted_at_ms.unwrap_or_default(), record.ticket.clone()));
        self.granted.insert(record.ticket.clone(), record);
    }

    pub(super) fn forget_old_grants(&mut self, now_ms: i64, writes: &mut RateWrites) {
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
    pub(super) fn grant_out(&self, record: &TicketRecord, key: &pb::RateKeyRef, limit: i64, outbox: &mut Outbox) {
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
    pub(super) fn emit_grant(&self, record: &TicketRecord, key: &pb::RateKeyRef, limit: i64, outbox: &mut Outbox) {
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

    /// Send again the grants of recently granted tickets of jobs in
    /// `job_partitions` (a stream now takes them).
    pub(super) fn resend_grants(&self, job_partitions: &[i32], outbox: &mut Outbox) {
        let wanted: HashSet<i32> = job_partitions.iter().copied().collect();
        let partitions = self.settings.grants_partitions;
        self.resend_grants_where(
            |record| wanted.contains(&job_partition(&record.ticket.job_id, partitions)),
            outbox,
        );
    }

    pub(super) fn resend_grants_where(&self, include: impl Fn(&TicketRecord) -> bool, outbox: &mut Outbox) {
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
}
