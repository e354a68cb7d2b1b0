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
