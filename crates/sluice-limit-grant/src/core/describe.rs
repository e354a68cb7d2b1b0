//! What a partition tells about its keys: `DescribeKey`, its part of
//! `ListKeys`, and the per-key metrics.

use sluice_common::hash::HashMap;
use std::sync::Arc;

use sluice_common::core::KeyStat;
use sluice_proto::v1 as pb;

use super::adaptive::Adaptive;
use super::flows;
use super::keys::{Holder, KeyState, WaitOrder, Waiting};
use super::shadow::ShadowSim;
use super::{LimitPartition, TicketKey};

/// How many flows `DescribeKey` lists (the most waiting first).
const DESCRIBED_FLOWS: usize = 20;

/// A key's flows for `DescribeKey`: those with waiters (the most waiting
/// first, at most `DESCRIBED_FLOWS`) and those with a stored weight; and how
/// many flows have waiters.
fn describe_flows(state: &KeyState) -> (Vec<pb::FlowState>, u32) {
    let mut waiting: Vec<(&Arc<str>, usize, i64)> = state.waiters.waiting_flows().collect();
    let flows_waiting = u32::try_from(waiting.len()).unwrap_or(u32::MAX);
    waiting.sort_unstable_by(|left, right| right.1.cmp(&left.1).then_with(|| left.0.cmp(right.0)));
    waiting.truncate(DESCRIBED_FLOWS);
    let mut holders: HashMap<&str, u32> = HashMap::default();
    for holder in state.holders.values() {
        *holders.entry(&*holder.record.fairness_key).or_default() += 1;
    }
    let weights = &state.record.flow_weights;
    let flow_state = |name: &str, waiting: usize, deficit: i64| pb::FlowState {
        fairness_key: name.to_string(),
        weight: flows::weight_of(weights, name),
        stored_weight: weights.get(name).copied(),
        waiting: u32::try_from(waiting).unwrap_or(u32::MAX),
        holders: holders.get(name).copied().unwrap_or_default(),
        deficit,
    };
    let mut described: Vec<pb::FlowState> = waiting
        .iter()
        .map(|(name, count, deficit)| flow_state(name, *count, *deficit))
        .collect();
    for name in weights.keys() {
        if !waiting.iter().any(|(listed, _, _)| ***listed == **name) {
            let count = state.waiters.waiting_in(name);
            described.push(flow_state(name, count, 0));
        }
    }
    (described, flows_waiting)
}

/// A key's limit for `DescribeKey`: its kind, its stored max, floating and
/// adaptive state, and the max in force.
fn describe_limit(state: &KeyState, key: &str, described: &mut pb::KeyState) {
    described.override_max = state.record.override_max;
    described.paused = state.record.override_max == Some(0);
    if let Some(floating) = &state.record.floating {
        described.kind = pb::LimitKind::Floating as i32;
        described.floating_max = Some(floating.current_max);
        described.floating = Some(pb::FloatingConcurrencyLimit {
            key: key.to_string(),
            default_max: floating.default_max,
            refresh_interval_ms: floating.refresh_interval_ms,
            metadata: floating.metadata.clone().into_iter().collect(),
        });
    }
    if let Some(adaptive) = &state.record.adaptive {
        described.kind = pb::LimitKind::Adaptive as i32;
        described.adaptive = Some(adaptive.describe(key));
    }
    let reference = state
        .any_waiter()
        .or_else(|| state.holders.values().next().map(|holder| &holder.record));
    described.effective_max = reference.map(|record| i64::from(state.max_for(record)));
    if described.effective_max.is_none() {
        described.effective_max = state.record.key_max().map(i64::from);
    }
}

/// The first `count` waiters of every flow, in queue order across flows
/// (an introspection call: it may look at every flow).
fn first_waiters(state: &KeyState, count: usize) -> Vec<pb::Waiter> {
    let mut first: Vec<(&WaitOrder, &Waiting)> = state
        .waiters
        .waiting_flows()
        .flat_map(|(flow, _, _)| state.waiters.first_in_flow(flow, count))
        .map(|(order, waiting)| (order, &**waiting))
        .collect();
    first.sort_unstable_by(|left, right| left.0.cmp(right.0));
    first
        .into_iter()
        .map(|(_, waiting)| waiting)
        .take(count)
        .map(|waiting| pb::Waiter {
            ticket: Some(waiting.record.ticket.to_proto()),
            priority: waiting.record.priority,
            enqueued_at_us: waiting.record.enqueued_at_us,
            waiting_since_ms: waiting.record.waiting_since_ms,
            job_max: waiting.record.job_max,
        })
        .collect()
}

/// What a shadow-mode key's simulation says the enforced limit would do.
fn shadow_stats(shadow: &ShadowSim<WaitOrder>) -> pb::ShadowStats {
    pb::ShadowStats {
        would_hold: u32::try_from(shadow.would_hold()).unwrap_or(u32::MAX),
        would_wait: u32::try_from(shadow.would_wait()).unwrap_or(u32::MAX),
        would_have_waited_count: shadow.totals.would_have_waited_count,
        would_have_waited_ms_total: shadow.totals.would_have_waited_ms_total,
        would_have_waited_ms_max: shadow.totals.would_have_waited_ms_max,
        would_have_exceeded: shadow.totals.would_have_exceeded,
    }
}

impl LimitPartition {
    pub(super) fn describe(&self, tenant: &str, key: &str, first_waiters_count: usize) -> pb::KeyState {
        let key_id = (tenant.to_string(), key.to_string());
        let mut described = pb::KeyState {
            key: Some(pb::KeyRef {
                tenant: tenant.to_string(),
                key: key.to_string(),
            }),
            kind: pb::LimitKind::Concurrency as i32,
            partition: u32::try_from(self.settings.partition).unwrap_or_default(),
            epoch: u64::try_from(self.epoch).unwrap_or_default(),
            ..Default::default()
        };
        let Some(state) = self.keys.get(&key_id) else {
            return described;
        };
        describe_limit(state, key, &mut described);
        let mut holders: Vec<&Holder> = state.holders.values().collect();
        holders.sort_by(|left, right| left.record.ticket.cmp(&right.record.ticket));
        described.holders = holders
            .into_iter()
            .map(|holder| pb::Holder {
                ticket: Some(holder.record.ticket.to_proto()),
                granted_at_ms: holder.record.granted_at_ms.unwrap_or_default(),
                expires_unless_confirmed_at_ms: holder.confirmed_at_ms + self.settings.ticket_grace_ms,
                lease_expires_at_ms: None,
            })
            .collect();
        described.waiting = u32::try_from(state.waiters.len()).unwrap_or(u32::MAX);
        described.first_waiters = first_waiters(state, first_waiters_count);
        described.oldest_waiting_since_ms = state
            .waiters
            .iter()
            .map(|(_, _, waiting)| waiting.record.waiting_since_ms)
            .min();
        (described.flows, described.flows_waiting) = describe_flows(state);
        described.mode = state.record.mode.map(|mode| mode as i32);
        described.shadow = state.shadow.as_ref().map(shadow_stats);
        described
    }

    pub(super) fn describe_with_ticket(
        &self,
        tenant: &str,
        key: &str,
        ticket: Option<&TicketKey>,
        first_waiters: usize,
    ) -> pb::DescribeKeyResponse {
        let state = self.describe(tenant, key, first_waiters);
        let mut response = pb::DescribeKeyResponse {
            state: Some(state),
            ticket_position: None,
            ticket_held: false,
        };
        if let (Some(ticket), Some(key_state)) = (ticket, self.keys.get(&(tenant.to_string(), key.to_string()))) {
            response.ticket_held = key_state.holders.contains_key(ticket);
            response.ticket_position = self
                .ticket_keys
                .get(ticket)
                .filter(|place| key_state.waiters.contains(&place.flow, &place.order(ticket)))
                .map(|place| key_state.waiters.ahead_in_flow(&place.flow, &place.order(ticket)))
                .and_then(|position| u32::try_from(position).ok());
        }
        response
    }

    /// This partition's part of `ListKeys`: keys with tickets or settings.
    pub fn list_keys(&self, tenant: &str, prefix: &str, after: &str, limit: usize) -> Vec<pb::KeySummary> {
        let mut found: Vec<&KeyState> = self
            .keys
            .iter()
            .filter(|((key_tenant, key), state)| {
                key_tenant == tenant && key.starts_with(prefix) && key.as_str() > after && !state.is_idle()
            })
            .map(|(_, state)| state)
            .collect();
        found.sort_unstable_by(|left, right| left.id.1.cmp(&right.id.1));
        found.truncate(limit);
        found
            .into_iter()
            .map(|state| {
                let floating_ticket = state
                    .holders
                    .values()
                    .map(|holder| &holder.record)
                    .chain(state.waiters.iter().map(|(_, _, waiting)| &waiting.record))
                    .next()
                    .is_some_and(|record| record.floating);
                pb::KeySummary {
                    key: Some(pb::KeyRef {
                        tenant: state.id.0.clone(),
                        key: state.id.1.clone(),
                    }),
                    kind: if floating_ticket || state.record.floating.is_some() {
                        pb::LimitKind::Floating as i32
                    } else if state.record.adaptive.is_some() {
                        pb::LimitKind::Adaptive as i32
                    } else {
                        pb::LimitKind::Concurrency as i32
                    },
                    holders: u32::try_from(state.holders.len()).unwrap_or(u32::MAX),
                    waiting: u32::try_from(state.waiters.len()).unwrap_or(u32::MAX),
                    override_max: state.record.override_max,
                    floating_max: state.record.floating.as_ref().map(|floating| floating.current_max),
                    adaptive_max: state.record.adaptive.as_ref().map(Adaptive::current),
                }
            })
            .collect()
    }

    /// The partition's keys, for per-key metrics.
    pub(super) fn per_key_stats(&self) -> Vec<KeyStat> {
        self.keys
            .iter()
            .map(|((tenant, key), state)| {
                let reference = state
                    .any_waiter()
                    .or_else(|| state.holders.values().next().map(|holder| &holder.record));
                KeyStat {
                    tenant: tenant.clone(),
                    key: key.clone(),
                    kind: if state.record.floating.is_some() {
                        "floating"
                    } else {
                        "concurrency"
                    },
                    holders: u64::try_from(state.holders.len()).unwrap_or(u64::MAX),
                    waiting: u64::try_from(state.waiters.len()).unwrap_or(u64::MAX),
                    max: reference.map(|record| u64::from(state.max_for(record))),
                }
            })
            .collect()
    }
}
