//! A key's settings: overrides and pauses, floating maxes, flow weights,
//! modes (`SetLimit` and the limit commands that carry them).

use sluice_proto::v1 as pb;

use super::flows;
use super::{Decided, KeyId, LimitPartition, LimitWrites};

/// A change to a key's settings (`SetLimit`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitChange {
    /// Set (or, `None`, clear) the override of the key's max.
    Max(Option<u32>),
    /// Set (or, `None`, reset to the default) a flow's weight.
    FlowWeight { fairness_key: String, weight: Option<u32> },
    /// Store the key's mode (or, `None`, clear it).
    Mode(Option<pb::LimitMode>),
}

impl LimitPartition {
    pub(super) fn set_override(&mut self, now_ms: i64, key_id: &KeyId, max: Option<u32>, out: &mut Decided) {
        let state = self.key_state(key_id);
        state.record.override_max = max;
        out.writes.save_key(key_id, &state.record);
        self.grant_waiters_that_fit(now_ms, key_id, out);
    }

    /// Store a flow's weight (`None`, or the default: forget it). It counts
    /// from the flow's next turn; nothing is granted by it alone (a weight
    /// changes the order of grants, not how many fit).
    pub(super) fn set_flow_weight(
        &mut self,
        key_id: &KeyId,
        fairness_key: String,
        weight: Option<u32>,
        writes: &mut LimitWrites,
    ) {
        let state = self.key_state(key_id);
        match weight.map(|weight| weight.clamp(1, flows::MAX_WEIGHT)) {
            Some(weight) if weight != flows::DEFAULT_WEIGHT => {
                state.record.flow_weights.insert(fairness_key, weight);
            }
            _ => {
                state.record.flow_weights.remove(&fairness_key);
            }
        }
        writes.save_key(key_id, &state.record);
        if state.is_idle() {
            self.keys.remove(key_id);
        }
    }

    /// Store the key's mode. It applies at once: to shadow, the grant decision grants
    /// every waiter; to enforce, the next grants wait for room (holders
    /// granted in shadow mode keep their slots, as after a lowered max) and
    /// the simulation stops (its totals stay).
    pub(super) fn set_mode(&mut self, now_ms: i64, key_id: &KeyId, mode: Option<pb::LimitMode>, out: &mut Decided) {
        let state = self.key_state(key_id);
        state.record.mode = mode;
        if mode == Some(pb::LimitMode::Enforce) {
            if let Some(shadow) = state.shadow.as_mut() {
                shadow.stop();
            }
        }
        out.writes.save_key(key_id, &state.record);
        self.grant_waiters_that_fit(now_ms, key_id, out);
    }

    pub(super) fn set_floating_max(&mut self, now_ms: i64, key_id: &KeyId, max: u32, task_id: &str, out: &mut Decided) {
        let Some(state) = self.keys.get_mut(key_id) else {
            return;
        };
        let Some(floating) = state.record.floating.as_mut() else {
            return;
        };
        if max == 0 || floating.last_task_id.as_deref() == Some(task_id) {
            return;
        }
        floating.current_max = max;
        floating.last_set_ms = Some(now_ms);
        floating.last_task_id = Some(task_id.to_string());
        out.writes.keys.insert(key_id.clone(), Some(state.record.clone()));
        self.grant_waiters_that_fit(now_ms, key_id, out);
    }

    /// Forget a floating key's shared state (its jobs' own maxes apply).
    pub(super) fn delete_floating(&mut self, now_ms: i64, key_id: &KeyId, out: &mut Decided) {
        if let Some(state) = self.keys.get_mut(key_id) {
            if state.record.floating.take().is_some() {
                out.writes.keys.insert(key_id.clone(), Some(state.record.clone()));
            }
        }
        self.grant_waiters_that_fit(now_ms, key_id, out);
    }
}
