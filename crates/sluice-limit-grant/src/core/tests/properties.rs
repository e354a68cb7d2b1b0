use super::*;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Acquire {
        job: u8,
        key: u8,
        priority: u8,
        max: u8,
        flow: u8,
    },
    Release {
        job: u8,
    },
    Override {
        key: u8,
        max: Option<u8>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..40, 0u8..3, 0u8..3, 1u8..4, 0u8..3).prop_map(|(job, key, priority, max, flow)| Op::Acquire {
            job,
            key,
            priority,
            max,
            flow
        }),
        (0u8..40).prop_map(|job| Op::Release { job }),
        (0u8..3, proptest::option::of(0u8..4)).prop_map(|(key, max)| Op::Override { key, max }),
    ]
}

fn flow_name(flow: u8) -> &'static str {
    ["", "f1", "f2"][usize::from(flow % 3)]
}

fn live(state: &LimitPartition) -> sluice_common::hash::HashMap<TicketKey, TicketRecord> {
    state
        .tickets()
        .map(|record| (record.ticket.clone(), record.clone()))
        .collect()
}

proptest! {
    /// What the batches journal (and the snapshots that replace the
    /// journal) rebuilds exactly the live tickets after every batch,
    /// and a partition restored from it answers as the original.
    #[test]
    fn the_journal_rebuilds_the_tickets(
        batches in proptest::collection::vec((proptest::collection::vec(op(), 0..8), any::<bool>()), 1..40)
    ) {
        let mut state = partition();
        state.journal_loaded(0, None, 0);
        let mut saved: sluice_common::hash::HashMap<TicketKey, TicketRecord> = Default::default();
        let mut job_keys: HashMap<u8, u8> = HashMap::new();
        let mut last_seq = 0;
        for (index, (ops, snapshot_now)) in batches.into_iter().enumerate() {
            let mut out = Decided::new();
            for operation in ops {
                let command = match operation {
                    Op::Acquire { job, key: key_index, priority, max, flow } => {
                        let key_index = *job_keys.entry(job).or_insert(key_index);
                        acquire_in_flow(&format!("j{job}"), &format!("k{key_index}"), u32::from(priority), i64::try_from(index).unwrap(), u32::from(max), flow_name(flow))
                    }
                    Op::Release { job } => match job_keys.get(&job) {
                        Some(key_index) => release(&format!("j{job}"), &format!("k{key_index}")),
                        None => continue,
                    },
                    Op::Override { key: key_index, max } => set_override(&format!("k{key_index}"), max.map(u32::from)),
                };
                state.apply_command(0, command, &mut out).unwrap();
            }
            if snapshot_now {
                state.snapshot_due = true;
            }
            let writes = &mut out.writes;
            state.close_batch(writes);
            prop_assert!(writes.journal.is_none() || writes.snapshot.is_none());
            if let Some((seq, snapshot)) = writes.snapshot.take() {
                prop_assert!(seq > last_seq);
                last_seq = seq;
                saved = snapshot
                    .tickets
                    .into_iter()
                    .map(|stored| {
                        let record = stored.into_record();
                        (record.ticket.clone(), record)
                    })
                    .collect();
            }
            if let Some((seq, batch)) = writes.journal.take() {
                prop_assert_eq!(seq, last_seq + 1, "journal rows are numbered without gaps");
                last_seq = seq;
                batch.apply_to(&mut saved);
            }
            prop_assert_eq!(&saved, &live(&state));
        }
        let mut restored = partition();
        restored.restore(0, Vec::new(), saved.into_values().collect());
        prop_assert_eq!(live(&restored), live(&state));
        for key_index in 0..3 {
            let key = format!("k{key_index}");
            prop_assert_eq!(restored.holders_of("t", &key), state.holders_of("t", &key));
            prop_assert_eq!(restored.waiting_on("t", &key), state.waiting_on("t", &key));
        }
    }

    /// After every command, holders never exceed the max in force for
    /// the last grant, and a job never holds twice.
    #[test]
    fn no_overrun_under_any_sequence(ops in proptest::collection::vec(op(), 1..200)) {
        let mut state = partition();
        let mut job_keys: HashMap<u8, u8> = HashMap::new();
        for (index, operation) in ops.into_iter().enumerate() {
            let mut out = Decided::new();
            let command = match operation {
                Op::Acquire { job, key: key_index, priority, max, flow } => {
                    let key_index = *job_keys.entry(job).or_insert(key_index);
                    acquire_in_flow(&format!("j{job}"), &format!("k{key_index}"), u32::from(priority), i64::try_from(index).unwrap(), u32::from(max), flow_name(flow))
                }
                Op::Release { job } => match job_keys.get(&job) {
                    Some(key_index) => release(&format!("j{job}"), &format!("k{key_index}")),
                    None => continue,
                },
                Op::Override { key: key_index, max } => set_override(&format!("k{key_index}"), max.map(u32::from)),
            };
            let held_before: HashSet<TicketKey> = state
                .keys
                .values()
                .flat_map(|key_state| key_state.holders.keys().cloned())
                .collect();
            state.apply_command(0, command, &mut out).unwrap();
            for event in grants(&mut out.sends) {
                let ticket = TicketKey::from_proto(event.ticket.as_ref().unwrap());
                if held_before.contains(&ticket) {
                    continue; // a re-sent grant of a duplicate acquire
                }
                prop_assert!(i64::from(event.holders) <= event.max, "grant over max: {event:?}");
            }
            for key_state in state.keys.values() {
                for holder in key_state.holders.values() {
                    prop_assert!(!key_state.waiters.iter().any(|(_, _, waiting)| waiting.record.ticket == holder.record.ticket));
                }
                // Nobody waits while the next head would fit (no lost wake-up).
                if let Some((_, head)) = key_state.waiters.peek() {
                    let max = usize::try_from(key_state.max_for(&head.record)).unwrap();
                    prop_assert!(key_state.holders.len() >= max, "head fits but waits");
                }
                for (flow, _, waiting) in key_state.waiters.iter() {
                    let place = state.ticket_keys.get(&waiting.record.ticket);
                    prop_assert!(
                        place.is_some_and(|place| place.order(&waiting.record.ticket) == WaitOrder::of(&waiting.record) && place.flow == *flow),
                        "every waiter is found by its ticket"
                    );
                }
            }
        }
    }
}
