//! When a floating key's refresh falls due, and the refresh-due event.

use sluice_common::kafka::Outbox;
use sluice_common::partition::key_partition;
use sluice_proto::v1 as pb;

use super::{Decided, FloatingRecord, KeyId, LimitPartition};

impl LimitPartition {
    /// A floating key's refresh is due when a job using it is enqueued or
    /// released, the key has waiters, and the refresh interval has passed
    /// since the last refresh-due event (or none was ever sent: the first
    /// waiter triggers the first refresh). The refresh-dispatcher keeps at
    /// most one refresh in flight per key and ignores a due event it has
    /// already seen (same `due_at_ms`), so re-sending one is harmless.
    pub(super) fn refresh_if_due(&mut self, now_ms: i64, key_id: &KeyId, trace: &pb::TraceContext, out: &mut Decided) {
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

    pub(super) fn emit_refresh_due(
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
}
