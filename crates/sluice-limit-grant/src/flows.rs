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

use std::collections::{BTreeMap, HashMap, VecDeque};
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
            flows: HashMap::new(),
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
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn flow(name: &str) -> Arc<str> {
        Arc::from(name)
    }

    /// Grant `count` waiters (each its flow's name).
    fn grant(flows: &mut Flows<(u32, u64), String>, weights: &BTreeMap<String, u32>, count: usize) -> Vec<String> {
        let mut granted = Vec::new();
        for _ in 0..count {
            if flows.next(|name| weight_of(weights, name)).is_none() {
                break;
            }
            if let Some((_, name)) = flows.take_next() {
                granted.push(name);
            }
        }
        granted
    }

    #[test]
    fn nine_small_flows_finish_within_their_fair_share_beside_one_of_ten_thousand() {
        let mut flows: Flows<(u32, u64), String> = Flows::default();
        let mut seq = 0u64;
        for _ in 0..10_000 {
            seq += 1;
            flows.insert(&flow("big"), (0, seq), "big".to_string());
        }
        for small in 0..9 {
            let name = format!("small-{small}");
            for _ in 0..10 {
                seq += 1;
                flows.insert(&flow(&name), (0, seq), name.clone());
            }
        }
        let weights = BTreeMap::new();
        // Ten flows of equal weight: every round grants one of each, so the
        // small flows' 90 waiters are done within the first 100 grants.
        let first = grant(&mut flows, &weights, 100);
        let small = first.iter().filter(|name| name.starts_with("small-")).count();
        assert_eq!(small, 90, "{first:?}");
        assert_eq!(flows.len(), 10_000 - 10);
        // Then the big flow has the key to itself.
        assert!(grant(&mut flows, &weights, 500).iter().all(|name| name == "big"));
    }

    #[test]
    fn grant_ratios_follow_the_weights_within_five_percent() {
        let mut flows: Flows<(u32, u64), String> = Flows::default();
        let mut seq = 0u64;
        let weights: BTreeMap<String, u32> = [("a", 1), ("b", 2), ("c", 5), ("d", 12)]
            .into_iter()
            .map(|(name, weight)| (name.to_string(), weight))
            .collect();
        for name in weights.keys() {
            for _ in 0..5_000 {
                seq += 1;
                flows.insert(&flow(name), (0, seq), name.clone());
            }
        }
        let granted = grant(&mut flows, &weights, 4_000);
        let total_weight: u32 = weights.values().sum();
        for (name, weight) in &weights {
            let share = granted.iter().filter(|granted| *granted == name).count() as f64 / granted.len() as f64;
            let expected = f64::from(*weight) / f64::from(total_weight);
            assert!(
                (share - expected).abs() <= 0.05 * expected,
                "{name}: share {share:.4}, expected {expected:.4}"
            );
        }
    }

    #[test]
    fn within_a_flow_priority_then_enqueue_time() {
        let mut flows: Flows<(u32, u64), u64> = Flows::default();
        flows.insert(&flow("x"), (5, 1), 1);
        flows.insert(&flow("x"), (1, 3), 3);
        flows.insert(&flow("x"), (1, 2), 2);
        let mut order = Vec::new();
        while flows.next(|_| 1).is_some() {
            order.push(flows.take_next().map(|(_, value)| value));
        }
        assert_eq!(order, vec![Some(2), Some(3), Some(1)]);
    }

    #[test]
    fn a_removed_waiter_and_an_emptied_flow_leave_no_turn_behind() {
        let mut flows: Flows<(u32, u64), &str> = Flows::default();
        flows.insert(&flow("a"), (0, 1), "a1");
        flows.insert(&flow("b"), (0, 2), "b1");
        assert_eq!(flows.remove("a", &(0, 1)), Some("a1"));
        assert_eq!(flows.next(|_| 1).map(|(_, value)| *value), Some("b1"));
        flows.take_next();
        assert!(flows.is_empty());
        assert!(flows.next(|_| 1).is_none());
        // A flow that comes back starts with no saved credit.
        flows.insert(&flow("a"), (0, 3), "a2");
        flows.insert(&flow("b"), (0, 4), "b2");
        let mut granted = Vec::new();
        while flows.next(|name| if name == "a" { 3 } else { 1 }).is_some() {
            granted.push(flows.take_next().map(|(_, value)| value));
        }
        assert_eq!(granted, vec![Some("a2"), Some("b2")]);
    }

    /// Textbook weighted DRR, written as rounds: each round visits the
    /// active flows in order of arrival; a visited flow adds its quantum and
    /// sends while its deficit covers a grant; an emptied flow leaves and
    /// forgets its deficit. Waiters arrive only between grants.
    #[derive(Default)]
    struct Model {
        /// (flow, FIFO of waiter ids) in ring order, the visited one first.
        active: VecDeque<(u8, VecDeque<u64>)>,
        deficits: HashMap<u8, i64>,
        visiting: bool,
    }

    impl Model {
        fn add(&mut self, flow: u8, id: u64) {
            match self.active.iter_mut().find(|(name, _)| *name == flow) {
                Some((_, queue)) => queue.push_back(id),
                None => self.active.push_back((flow, VecDeque::from([id]))),
            }
        }

        fn grant(&mut self, weights: &[u32; 4]) -> Option<u64> {
            loop {
                let (flow, _) = self.active.front()?;
                let flow = *flow;
                let deficit = self.deficits.entry(flow).or_insert(0);
                if !self.visiting {
                    *deficit += i64::from(weights[usize::from(flow)]);
                    self.visiting = true;
                }
                if *deficit >= 1 {
                    *deficit -= 1;
                    let (_, queue) = self.active.front_mut()?;
                    let id = queue.pop_front();
                    if queue.is_empty() {
                        self.active.pop_front();
                        self.deficits.remove(&flow);
                        self.visiting = false;
                    } else if self.deficits.get(&flow).is_some_and(|deficit| *deficit < 1) {
                        let visited = self.active.pop_front()?;
                        self.active.push_back(visited);
                        self.visiting = false;
                    }
                    return id;
                }
                let visited = self.active.pop_front()?;
                self.active.push_back(visited);
                self.visiting = false;
            }
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        Arrive { flow: u8 },
        Grant,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![(0u8..4).prop_map(|flow| Op::Arrive { flow }), Just(Op::Grant)]
    }

    proptest! {
        #[test]
        fn grants_in_the_order_of_the_weighted_drr_model(
            weights in proptest::array::uniform4(1u32..6),
            ops in proptest::collection::vec(op(), 1..300),
        ) {
            let mut flows: Flows<u64, u64> = Flows::default();
            let mut model = Model::default();
            let names: Vec<Arc<str>> = (0..4).map(|index| flow(&index.to_string())).collect();
            let weight = |name: &str| name.parse::<usize>().map_or(1, |index| weights[index]);
            let mut next_id = 0u64;
            for op in ops {
                match op {
                    Op::Arrive { flow } => {
                        next_id += 1;
                        flows.insert(&names[usize::from(flow)], next_id, next_id);
                        model.add(flow, next_id);
                    }
                    Op::Grant => {
                        let expected = model.grant(&weights);
                        let got = flows.next(weight).map(|(_, id)| *id);
                        if got.is_some() {
                            flows.take_next();
                        }
                        prop_assert_eq!(got, expected);
                    }
                }
            }
        }
    }
}
