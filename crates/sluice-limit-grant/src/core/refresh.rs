//! When a floating key's refresh falls due, and the refresh-due event.

use sluice_common::kafka::Outbox;
use sluice_common::partition::key_partition;
use sluice_proto::v1 as pb;

use super::{Decided, FloatingRecord, KeyId, LimitPartition};

/// The timer makes a waiting key's refresh due at most this often, whatever
/// its interval (an interval of 1 ms would otherwise write a due event every
/// millisecond; a job enqueued or released still honours the interval).
pub const MIN_TIMER_REFRESH_MS: i64 = 1_000;

impl LimitPartition {
    /// A floating key's refresh is due when it has waiters and the refresh
    /// interval has passed since the last refresh-due event (or none was
    /// ever sent: the first waiter triggers the first refresh). Looked at
    /// when a job using the key is enqueued or released, and on a timer
    /// while the key has waiters (`refresh_timers`, at most once every
    /// `MIN_TIMER_REFRESH_MS`): a key whose holders run long, or hang, still
    /// gets its max recomputed — that is when a higher max would let its
    /// waiters in. The refresh-dispatcher keeps at most one refresh in
    /// flight per key and ignores a due event it has already seen (same
    /// `due_at_ms`), so re-sending one is harmless.
    pub(super) fn refresh_if_due(&mut self, now_ms: i64, key_id: &KeyId, trace: &pb::TraceContext, out: &mut Decided) {
        self.refresh_if_due_after(now_ms, key_id, trace, 0, out);
    }

    /// `refresh_if_due`, with the interval at least `floor_ms`.
    fn refresh_if_due_after(
        &mut self,
        now_ms: i64,
        key_id: &KeyId,
        trace: &pb::TraceContext,
        floor_ms: i64,
        out: &mut Decided,
    ) {
        // Called on every acquire and release: a key that is not floating
        // costs one lookup while no floating key waits.
        let Some(state) = self.keys.get_mut(key_id) else {
            self.refresh_watch.remove(key_id);
            return;
        };
        let Some(floating) = state.record.floating.as_mut() else {
            if !self.refresh_watch.is_empty() {
                self.refresh_watch.remove(key_id);
            }
            return;
        };
        if state.waiters.is_empty() {
            self.refresh_watch.remove(key_id);
            return;
        }
        let waiting = state.waiters.len();
        if !self.refresh_watch.contains(key_id) {
            self.refresh_watch.insert(key_id.clone());
        }
        let interval_ms = i64::try_from(floating.refresh_interval_ms)
            .unwrap_or(i64::MAX)
            .max(floor_ms);
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

    /// The refreshes of waiting floating keys whose interval has passed
    /// (and forget the keys that no longer wait).
    pub(super) fn refresh_timers(&mut self, now_ms: i64, out: &mut Decided) {
        if self.next_refresh_ms().is_none_or(|at_ms| at_ms > now_ms) {
            return;
        }
        let watched: Vec<KeyId> = self.refresh_watch.iter().cloned().collect();
        for key_id in watched {
            self.refresh_if_due_after(now_ms, &key_id, &pb::TraceContext::default(), MIN_TIMER_REFRESH_MS, out);
        }
    }

    /// When the next watched key's refresh falls due. A key in the watch
    /// that no longer waits counts as due now, so that the next batch
    /// forgets it.
    pub(super) fn next_refresh_ms(&self) -> Option<i64> {
        self.refresh_watch
            .iter()
            .map(|key_id| {
                let floating = self
                    .keys
                    .get(key_id)
                    .filter(|state| !state.waiters.is_empty())
                    .and_then(|state| state.record.floating.as_ref());
                match floating {
                    Some(floating) => floating.last_due_ms.map_or(0, |last_due_ms| {
                        let interval_ms = i64::try_from(floating.refresh_interval_ms)
                            .unwrap_or(i64::MAX)
                            .max(MIN_TIMER_REFRESH_MS);
                        last_due_ms.saturating_add(interval_ms)
                    }),
                    None => 0,
                }
            })
            .min()
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
