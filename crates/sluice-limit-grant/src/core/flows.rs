//! Fair sharing inside a key: a key's waiters are split into flows by their
//! job's fairness key, and flows are granted by weighted deficit
//! round-robin (Shreedhar and Varghese's DRR, with a grant costing one).
//!
//! - The flows with waiters form a ring. The flow at the front gets its
//!   quantum (its weight) when its turn starts and gives grants from its
//!   head while its deficit lasts; then the next flow's turn starts.
//! - Within a flow, waiters are in their order (priority, then enqueue
//!   time): a flow's head is never overtaken within its flow.
//! - A flow that empties leaves the ring and its deficit is dropped (a flow
//!   cannot save up credit while it has nothing waiting).
//!
//! Choosing the next head, granting it and adding a waiter are O(1) in the
//! number of flows (plus the flow's own ordered map), so the cost of a grant
//! does not grow with the number of flows (`make bench`: `grant_ns_by_flows`).
//! Where a round stands is kept in memory only: a new owner starts a new
//! round with the flows in the order of their first waiters.

use sluice_common::hash::HashMap;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// A flow's weight when none is stored.
pub const DEFAULT_WEIGHT: u32 = 1;

/// The largest weight a flow may be given.
pub const MAX_WEIGHT: u32 = 1000;

/// The weight of `flow` given the key's stored weights.
pub fn weight_of(weights: &BTreeMap<String, u32>, flow: &str) -> u32 {
    weights
        .get(flow)
        .copied()
        .unwrap_or(DEFAULT_WEIGHT)
        .clamp(1, MAX_WEIGHT)
}

#[derive(Debug)]
struct Flow<K, V> {
    waiters: BTreeMap<K, V>,
    /// Grants the flow may still take in its current turn.
    deficit: i64,
}

/// The waiters of one key, by flow. `K` orders waiters within a flow.
#[derive(Debug)]
pub struct Flows<K, V> {
    flows: HashMap<Arc<str>, Flow<K, V>>,
    /// Flows in round order; the front one has the turn. May hold flows
    /// that emptied (they are dropped when they reach the front).
    ring: VecDeque<Arc<str>>,
    /// The front flow got its quantum for this turn.
    credited: bool,
    len: usize,
}

impl<K: Ord + Clone, V> Default for Flows<K, V> {
    fn default() -> Self {
        Flows {
            flows: HashMap::default(),
            ring: VecDeque::new(),
            credited: false,
            len: 0,
        }
    }
}

impl<K: Ord + Clone, V> Flows<K, V> {
    /// Waiters in every flow.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Add a waiter to `flow` (the back of the ring when the flow is new).
    pub fn insert(&mut self, flow: &Arc<str>, order: K, waiter: V) {
        let entry = self.flows.entry(flow.clone()).or_insert_with(|| {
            self.ring.push_back(flow.clone());
            Flow {
                waiters: BTreeMap::new(),
                deficit: 0,
            }
        });
        if entry.waiters.insert(order, waiter).is_none() {
            self.len += 1;
        }
    }

    /// The shared name of `flow` when it has waiters (so that its waiters
    /// share one allocation).
    pub fn flow_named(&self, flow: &str) -> Option<Arc<str>> {
        self.flows.get_key_value(flow).map(|(name, _)| name.clone())
    }

    /// Remove a waiter (a released or expired waiting ticket).
    pub fn remove(&mut self, flow: &str, order: &K) -> Option<V> {
        let removed = self.flows.get_mut(flow)?.waiters.remove(order)?;
        self.len -= 1;
        Some(removed)
    }

    pub fn get_mut(&mut self, flow: &str, order: &K) -> Option<&mut V> {
        self.flows.get_mut(flow)?.waiters.get_mut(order)
    }

    /// The waiter granted next: the head of the flow whose turn it is (its
    /// quantum added when its turn starts). `weight` gives a flow's weight.
    pub fn next(&mut self, weight: impl Fn(&str) -> u32) -> Option<(&K, &V)> {
        loop {
            let front = self.ring.front()?.clone();
            let Some(flow) = self.flows.get_mut(&front) else {
                self.end_turn(false);
                continue;
            };
            if flow.waiters.is_empty() {
                self.flows.remove(&front);
                self.end_turn(false);
                continue;
            }
            if !self.credited {
                flow.deficit = flow
                    .deficit
                    .saturating_add(i64::from(weight(&front).clamp(1, MAX_WEIGHT)));
                self.credited = true;
            }
            if flow.deficit >= 1 {
                break;
            }
            // Turn used up: the next flow's.
            self.end_turn(true);
        }
        let front = self.ring.front()?;
        self.flows.get(front)?.waiters.first_key_value()
    }

    /// The head of the first flow in the ring with waiters: the waiter
    /// `next` names, without starting a turn.
    pub fn peek(&self) -> Option<(&K, &V)> {
        self.ring
            .iter()
            .find_map(|flow| self.flows.get(flow)?.waiters.first_key_value())
    }

    /// Take the waiter `next` named: one grant of the front flow's turn.
    pub fn take_next(&mut self) -> Option<(K, V)> {
        let front = self.ring.front()?.clone();
        let flow = self.flows.get_mut(&front)?;
        let taken = flow.waiters.pop_first()?;
        self.len -= 1;
        flow.deficit -= 1;
        if flow.waiters.is_empty() {
            self.flows.remove(&front);
            self.end_turn(false);
        } else if flow.deficit < 1 {
            self.end_turn(true);
        }
        Some(taken)
    }

    /// The front flow's turn ends: it goes to the back (`keep`) or leaves.
    fn end_turn(&mut self, keep: bool) {
        self.credited = false;
        if let Some(front) = self.ring.pop_front() {
            if keep {
                self.ring.push_back(front);
            }
        }
    }

    /// Every waiter, flow by flow (no grant order across flows).
    pub fn iter(&self) -> impl Iterator<Item = (&Arc<str>, &K, &V)> {
        self.flows
            .iter()
            .flat_map(|(flow, entry)| entry.waiters.iter().map(move |(order, waiter)| (flow, order, waiter)))
    }

    pub fn contains(&self, flow: &str, order: &K) -> bool {
        self.flows
            .get(flow)
            .is_some_and(|entry| entry.waiters.contains_key(order))
    }

    /// Waiters in `flow`.
    pub fn waiting_in(&self, flow: &str) -> usize {
        self.flows.get(flow).map_or(0, |entry| entry.waiters.len())
    }

    /// Waiters ahead of `order` in `flow`.
    pub fn ahead_in_flow(&self, flow: &str, order: &K) -> usize {
        let Some(entry) = self.flows.get(flow) else {
            return 0;
        };
        match entry.waiters.last_key_value() {
            // The common case: a new waiter joins at the tail.
            Some((last, _)) if last < order => entry.waiters.len(),
            None => 0,
            Some(_) => entry.waiters.range(..order.clone()).count(),
        }
    }

    /// Flows with waiters: (flow, waiters, deficit).
    pub fn waiting_flows(&self) -> impl Iterator<Item = (&Arc<str>, usize, i64)> {
        self.flows
            .iter()
            .filter(|(_, entry)| !entry.waiters.is_empty())
            .map(|(flow, entry)| (flow, entry.waiters.len(), entry.deficit))
    }

    /// The first `count` waiters of `flow`.
    pub fn first_in_flow(&self, flow: &str, count: usize) -> impl Iterator<Item = (&K, &V)> {
        self.flows
            .get(flow)
            .into_iter()
            .flat_map(move |entry| entry.waiters.iter().take(count))
    }
}

#[cfg(test)]
mod tests;
