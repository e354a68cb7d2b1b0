use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::core::image::{self, SavedImage};

/// One command or setting change, on jobs `j0..j29` and keys `k0..k2`.
#[derive(Clone, Debug)]
enum Step {
    Acquire {
        job: u8,
        key: u8,
        priority: u8,
        max: u8,
        flow: u8,
        floating: bool,
    },
    Release {
        job: u8,
    },
    Override {
        key: u8,
        max: Option<u8>,
    },
    FlowWeight {
        key: u8,
        flow: u8,
        weight: Option<u8>,
    },
    Mode {
        key: u8,
        shadow: Option<bool>,
    },
    FloatingMax {
        key: u8,
        max: u8,
        task: u8,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (0u8..30, 0u8..3, 0u8..3, 1u8..4, 0u8..3, any::<bool>()).prop_map(
            |(job, key, priority, max, flow, floating)| Step::Acquire { job, key, priority, max, flow, floating }
        ),
        3 => (0u8..30).prop_map(|job| Step::Release { job }),
        1 => (0u8..3, proptest::option::of(0u8..4)).prop_map(|(key, max)| Step::Override { key, max }),
        1 => (0u8..3, 0u8..3, proptest::option::of(1u8..4)).prop_map(|(key, flow, weight)| Step::FlowWeight { key, flow, weight }),
        1 => (0u8..3, proptest::option::of(any::<bool>())).prop_map(|(key, shadow)| Step::Mode { key, shadow }),
        1 => (0u8..3, 1u8..5, 0u8..3).prop_map(|(key, max, task)| Step::FloatingMax { key, max, task }),
    ]
}

fn flow_name(flow: u8) -> String {
    ["", "f1", "f2"][usize::from(flow % 3)].to_string()
}

/// The query `step` becomes (commands go over a link, settings through
/// `SetLimit`); `None` for a release of a job that never acquired.
fn query(id: u64, step: Step, job_keys: &mut HashMap<u8, u8>) -> Option<Query<LimitQuery>> {
    let set_limit = |key: u8, change: LimitChange| LimitQuery::SetLimit {
        tenant: "t".to_string(),
        key: format!("k{key}"),
        change,
    };
    let command = match step {
        Step::Acquire {
            job,
            key,
            priority,
            max,
            flow,
            floating,
        } => {
            let key = *job_keys.entry(job).or_insert(key);
            let name = format!("k{key}");
            let mut command = acquire_in_flow(
                &format!("j{job}"),
                &name,
                u32::from(priority),
                i64::from(job),
                u32::from(max),
                &flow_name(flow),
            );
            if floating {
                command = acquire_floating(&format!("j{job}"), &name, i64::from(job), u32::from(max));
            }
            command
        }
        Step::Release { job } => release(&format!("j{job}"), &format!("k{}", job_keys.get(&job)?)),
        Step::FloatingMax { key, max, task } => {
            set_floating_max(&format!("k{key}"), u32::from(max), &format!("{task}"))
        }
        Step::Override { key, max } => {
            return Some(Query {
                id,
                body: set_limit(key, LimitChange::Max(max.map(u32::from))),
            })
        }
        Step::FlowWeight { key, flow, weight } => {
            return Some(Query {
                id,
                body: set_limit(
                    key,
                    LimitChange::FlowWeight {
                        fairness_key: flow_name(flow),
                        weight: weight.map(u32::from),
                    },
                ),
            })
        }
        Step::Mode { key, shadow } => {
            let mode = shadow.map(|shadow| {
                if shadow {
                    pb::LimitMode::Shadow
                } else {
                    pb::LimitMode::Enforce
                }
            });
            return Some(Query {
                id,
                body: set_limit(key, LimitChange::Mode(mode)),
            });
        }
    };
    Some(Query {
        id,
        body: LimitQuery::Link {
            commands: vec![command.encode_to_vec()],
            client: Arc::from("admission-test"),
        },
    })
}

/// Each key's queues, flow by flow, in queue order.
fn queues(state: &LimitPartition) -> BTreeMap<(KeyId, String), Vec<TicketKey>> {
    let mut queues: BTreeMap<(KeyId, String), Vec<TicketKey>> = BTreeMap::new();
    for (key_id, key_state) in &state.keys {
        for (flow, _, waiting) in key_state.waiters.iter() {
            queues
                .entry((key_id.clone(), flow.to_string()))
                .or_default()
                .push(waiting.record.ticket.clone());
        }
    }
    queues
}

/// Where the journal stands (what the next batch's row is numbered, and
/// whether it is a snapshot).
fn journal_position(state: &LimitPartition) -> (i64, usize, usize, bool) {
    (
        state.journal_seq,
        state.journal_bytes_since_snapshot,
        state.last_snapshot_bytes,
        state.snapshot_due,
    )
}

proptest! {
    /// After every committed batch, the partition a new owner loads from
    /// the saved image (`image::save` of each batch's writes, then
    /// `image::load`) holds the live partition's key settings and tickets,
    /// queues them alike, and stands at the same place in the journal.
    #[test]
    fn a_partition_loaded_from_its_image_holds_and_queues_what_the_live_one_does(
        batches in proptest::collection::vec((proptest::collection::vec(step(), 0..8), any::<bool>()), 1..30)
    ) {
        let mut state = partition();
        let mut image = SavedImage::default();
        let mut job_keys: HashMap<u8, u8> = HashMap::new();
        let mut next_id = 0;
        for (index, (steps, snapshot_now)) in batches.into_iter().enumerate() {
            let queries: Vec<Query<LimitQuery>> = steps
                .into_iter()
                .filter_map(|step| {
                    next_id += 1;
                    query(next_id, step, &mut job_keys)
                })
                .collect();
            if snapshot_now {
                state.snapshot_due = true;
            }
            let now_ms = 1_000 * i64::try_from(index).unwrap();
            let decided = state.apply(now_ms, &[], queries);
            prop_assert!(decided.rejected.is_empty(), "{:?}", decided.rejected);
            image::save(&mut image, &decided.writes);
            let loaded = image::load(&image, settings(), 2, now_ms);
            prop_assert_eq!(image::held(&loaded), image::held(&state));
            prop_assert_eq!(queues(&loaded), queues(&state));
            prop_assert_eq!(journal_position(&loaded), journal_position(&state));
            for key in ["k0", "k1", "k2"] {
                prop_assert_eq!(loaded.holders_of("t", key), state.holders_of("t", key));
                prop_assert_eq!(loaded.waiting_on("t", key), state.waiting_on("t", key));
            }
        }
    }
}

/// An adaptive key's image keeps what its row keeps: its computed max, not
/// its windows' figures (a new owner starts counting afresh).
#[test]
fn an_adaptive_key_is_saved_as_its_row_keeps_it() {
    let spec = pb::AdaptiveConcurrencyLimit {
        key: "api".to_string(),
        initial: 4,
        ..Default::default()
    };
    let mut state = partition();
    let mut image = SavedImage::default();
    let mut out = Decided::new();
    for index in 0..6 {
        let command = pb::LimitCommand {
            command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
                key: key("api"),
                ticket: Some(pb::TicketId {
                    job_id: format!("a{index}"),
                    attempt: 1,
                    step: 0,
                }),
                limit: Some(pb::acquire_ticket::Limit::Adaptive(spec.clone())),
                ..Default::default()
            })),
            ..Default::default()
        };
        state.apply_command(0, command, &mut out).unwrap();
    }
    for job in ["a0", "a1", "a2", "a3", "a4"] {
        let mut command = release(job, "api");
        if let Some(pb::limit_command::Command::Release(release)) = command.command.as_mut() {
            release.run_ms = Some(20);
            release.reason = pb::ReleaseReason::Succeeded as i32;
        }
        state.apply_command(0, command, &mut out).unwrap();
    }
    state.close_batch(&mut out.writes);
    image::save(&mut image, &out.writes);
    let loaded = image::load(&image, settings(), 2, 0);
    assert_eq!(loaded.holders_of("t", "api"), 1);
    let (live, new) = (state.describe("t", "api", 0), loaded.describe("t", "api", 0));
    assert_eq!(new.effective_max, live.effective_max);
    let (live, new) = (live.adaptive.unwrap(), new.adaptive.unwrap());
    assert_eq!(
        (new.current_max, new.open_window_size),
        (8, 8),
        "a full window of fast runs doubled 4"
    );
    assert_eq!((new.current_max, new.changes), (live.current_max, live.changes));
    assert_eq!(
        (live.window_samples, new.window_samples),
        (5, 0),
        "the closed window's figures are not saved"
    );
    assert_eq!(image::held(&loaded).tickets, image::held(&state).tickets);
}
