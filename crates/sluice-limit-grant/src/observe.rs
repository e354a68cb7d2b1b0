//! Carries out what limit-grant's decisions record (`LimitEffect`), once
//! their batch is committed: metrics, spans on the jobs' traces, and logs.

use sluice_common::clock::system_time_at_ms;
use sluice_common::core::Effector;
use sluice_common::metrics::metrics;
use sluice_common::telemetry::record_span;
use sluice_proto::v1 as pb;

use crate::core::shadow::WouldHaveWaited;
use crate::core::{KeyId, LimitEffect, TicketKey, TicketRecord};

/// The effector of one partition.
pub struct LimitEffector {
    pub partition: i32,
}

impl Effector<LimitEffect> for LimitEffector {
    fn effect(&self, effect: LimitEffect) {
        match effect {
            LimitEffect::Granted {
                record,
                kind,
                holders,
                max,
            } => self.granted(&record, kind, holders, max),
            LimitEffect::ShadowWaited { key_id, simulated } => self.shadow_waited(&key_id, &simulated),
            LimitEffect::ShadowExceeded { key_id } => metrics().record_shadow_exceeded(&key_id.0, &key_id.1),
            LimitEffect::AdaptiveChanged { key_id, change } => {
                tracing::info!(
                    partition = self.partition,
                    tenant = %key_id.0,
                    key = %key_id.1,
                    from = change.from,
                    to = change.to,
                    reason = %change.reason,
                    "adaptive max changed"
                );
                metrics().record_adaptive_change(&key_id.0, &key_id.1, change.reason.label(), change.to);
            }
            LimitEffect::TicketReclaimed { key_id, ticket } => self.reclaimed(&key_id, &ticket),
        }
    }
}

impl LimitEffector {
    /// A new grant: the grant counter, the wait histogram and the
    /// `limit-grant.grant` span.
    fn granted(&self, record: &TicketRecord, limit_kind: pb::LimitKind, holders: usize, max: i64) {
        let kind = match limit_kind {
            pb::LimitKind::Floating => "floating",
            pb::LimitKind::Adaptive => "adaptive",
            _ => "concurrency",
        };
        let granted_at_ms = record.granted_at_ms.unwrap_or_default();
        metrics().record_grant(
            "limit-grant",
            kind,
            record.tenant(),
            record.key(),
            granted_at_ms - record.waiting_since_ms,
        );
        record_span(
            "sluice-limit-grant",
            "limit-grant.grant",
            &record.trace.to_context(),
            system_time_at_ms(granted_at_ms),
            system_time_at_ms(granted_at_ms),
            || {
                vec![
                    opentelemetry::KeyValue::new("sluice.job_id", record.ticket.job_id.clone()),
                    opentelemetry::KeyValue::new("sluice.tenant", record.tenant().to_string()),
                    opentelemetry::KeyValue::new("sluice.key", record.key().to_string()),
                    opentelemetry::KeyValue::new("sluice.limit_kind", kind),
                    opentelemetry::KeyValue::new("sluice.holders", i64::try_from(holders).unwrap_or(i64::MAX)),
                    opentelemetry::KeyValue::new("sluice.max", max),
                    opentelemetry::KeyValue::new("sluice.partition", i64::from(self.partition)),
                ]
            },
        );
    }

    /// A shadow-mode key's simulated grant: the would-have-waited metric,
    /// and a span on the job's trace with `sluice.shadow_wait` (ms).
    fn shadow_waited(&self, key_id: &KeyId, simulated: &WouldHaveWaited) {
        let (tenant, key) = key_id;
        metrics().record_shadow_wait(tenant, key, simulated.waited_ms);
        record_span(
            "sluice-limit-grant",
            "limit-grant.shadow",
            &simulated.trace.to_context(),
            system_time_at_ms(simulated.granted_at_ms - simulated.waited_ms),
            system_time_at_ms(simulated.granted_at_ms),
            || {
                vec![
                    opentelemetry::KeyValue::new("sluice.job_id", simulated.ticket.job_id.to_string()),
                    opentelemetry::KeyValue::new("sluice.tenant", tenant.clone()),
                    opentelemetry::KeyValue::new("sluice.key", key.clone()),
                    opentelemetry::KeyValue::new("sluice.shadow_wait", simulated.waited_ms),
                    opentelemetry::KeyValue::new("sluice.partition", i64::from(self.partition)),
                ]
            },
        );
    }

    fn reclaimed(&self, key_id: &KeyId, ticket: &TicketKey) {
        tracing::warn!(
            partition = self.partition,
            tenant = %key_id.0,
            key = %key_id.1,
            job_id = %ticket.job_id,
            attempt = ticket.attempt,
            step = ticket.step,
            "reclaiming a ticket nobody stands behind"
        );
    }
}
