//! The image functions the simulation stores partitions with
//! (`core::image::{save, load}`) keep what PostgreSQL keeps: batches of every
//! kind are both persisted by `LimitStore` (in a schema of this test's own)
//! and saved to an image, and the partition `LimitStore::load` builds from
//! the tables holds what `image::load` builds from the image, and decides
//! its next batch alike.

use std::sync::Arc;

use sluice_common::clock::AnchoredClock;
use sluice_common::core::{Core, Query};
use sluice_common::owner::{OwnedStore, OwnerContext};
use sluice_common::validate::InputLimits;
use sluice_common::SluiceConfig;
use sluice_limit_grant::core::image::{self, SavedImage};
use sluice_limit_grant::core::{LimitChange, LimitPartition, LimitQuery};
use sluice_limit_grant::store::{LimitStore, Topology, MIGRATOR};
use sluice_proto::v1 as pb;

const NOW_MS: i64 = 1_700_000_000_000;

fn topology() -> Topology {
    Topology {
        limit_partitions: 1,
        grants_partitions: 1,
        refresh_due_topic: Arc::from("refresh-due"),
        refresh_due_partitions: 1,
        max_message_bytes: 1_000_000,
        ticket_grace_ms: 30_000,
        input: InputLimits::default(),
    }
}

fn key(name: &str) -> Option<pb::KeyRef> {
    Some(pb::KeyRef {
        tenant: "t".to_string(),
        key: name.to_string(),
    })
}

fn ticket(job: &str) -> Option<pb::TicketId> {
    Some(pb::TicketId {
        job_id: job.to_string(),
        attempt: 1,
        step: 0,
    })
}

fn acquire(job: &str, key_name: &str, limit: pb::acquire_ticket::Limit, flow: &str) -> pb::LimitCommand {
    pb::LimitCommand {
        trace: Some(pb::TraceContext {
            traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
            tracestate: "vendor=a".to_string(),
        }),
        command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
            key: key(key_name),
            ticket: ticket(job),
            priority: 10,
            enqueued_at_us: 1,
            limit: Some(limit),
            fairness_key: flow.to_string(),
            shadow: false,
        })),
        ..Default::default()
    }
}

fn release(job: &str, key_name: &str, run_ms: Option<u64>) -> pb::LimitCommand {
    pb::LimitCommand {
        command: Some(pb::limit_command::Command::Release(pb::ReleaseTicket {
            key: key(key_name),
            ticket: ticket(job),
            reason: pb::ReleaseReason::Succeeded as i32,
            run_ms,
        })),
        ..Default::default()
    }
}

fn link(id: u64, commands: Vec<pb::LimitCommand>) -> Query<LimitQuery> {
    Query {
        id,
        body: LimitQuery::Link {
            commands: commands.iter().map(prost::Message::encode_to_vec).collect(),
            client: Arc::from("admission-test"),
        },
    }
}

fn set_limit(id: u64, key_name: &str, change: LimitChange) -> Query<LimitQuery> {
    Query {
        id,
        body: LimitQuery::SetLimit {
            tenant: "t".to_string(),
            key: key_name.to_string(),
            change,
        },
    }
}

/// Batches touching every kind of saved state: plain, floating and
/// adaptive keys, overrides, flow weights, modes, floating maxes, a deleted
/// floating key, releases with run times.
fn batches() -> Vec<Vec<Query<LimitQuery>>> {
    let plain = |max| pb::acquire_ticket::Limit::MaxConcurrency(max);
    let floating = pb::acquire_ticket::Limit::Floating(pb::FloatingConcurrencyLimit {
        key: "f".to_string(),
        default_max: 1,
        refresh_interval_ms: 60_000,
        metadata: [("region".to_string(), "eu".to_string())].into_iter().collect(),
    });
    let adaptive = pb::acquire_ticket::Limit::Adaptive(pb::AdaptiveConcurrencyLimit {
        key: "a".to_string(),
        initial: 2,
        target_latency_ms: 100,
        ..Default::default()
    });
    vec![
        vec![link(
            1,
            vec![
                acquire("p1", "p", plain(1), "x"),
                acquire("p2", "p", plain(1), "y"),
                acquire("p3", "p", plain(1), "y"),
            ],
        )],
        vec![
            set_limit(2, "p", LimitChange::Max(Some(2))),
            set_limit(
                3,
                "p",
                LimitChange::FlowWeight {
                    fairness_key: "y".to_string(),
                    weight: Some(3),
                },
            ),
            link(
                4,
                vec![
                    acquire("f1", "f", floating.clone(), ""),
                    acquire("f2", "f", floating.clone(), ""),
                ],
            ),
        ],
        vec![link(
            5,
            (1..=5)
                .map(|index| acquire(&format!("a{index}"), "a", adaptive.clone(), ""))
                .collect(),
        )],
        vec![
            link(
                6,
                // Five fast runs close the adaptive key's window: its max grows.
                (1..=5)
                    .map(|index| release(&format!("a{index}"), "a", Some(50)))
                    .chain([release("p1", "p", None)])
                    .collect(),
            ),
            set_limit(7, "m", LimitChange::Mode(Some(pb::LimitMode::Shadow))),
            link(
                8,
                vec![pb::LimitCommand {
                    command: Some(pb::limit_command::Command::SetFloatingMax(pb::SetFloatingMax {
                        key: key("f"),
                        max: 3,
                        task_id: "task-1".to_string(),
                    })),
                    ..Default::default()
                }],
            ),
        ],
        vec![
            link(
                9,
                vec![
                    acquire("m1", "m", plain(1), ""),
                    acquire("m2", "m", plain(1), ""),
                    acquire("g1", "g", floating.clone(), ""),
                    pb::LimitCommand {
                        command: Some(pb::limit_command::Command::DeleteFloating(pb::DeleteFloatingState {
                            key: key("g"),
                        })),
                        ..Default::default()
                    },
                ],
            ),
            set_limit(10, "p", LimitChange::Max(None)),
        ],
    ]
}

#[tokio::test]
#[allow(clippy::disallowed_methods, reason = "a test's own clock")]
async fn the_image_loads_as_the_tables_do() -> anyhow::Result<()> {
    let nonce = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .subsec_nanos();
    let prefix = format!("it_lgimage_{}_{nonce:08x}_", std::process::id());
    let config = SluiceConfig::load_with(None, &[("postgres.schema_prefix", prefix.as_str())])?;
    let schema = config.schema("limit_grant");
    let pool = sluice_common::storage::connect(&config.postgres, &schema).await?;
    let outcome = async {
        sluice_common::storage::migrate(&pool, &schema, &sluice_common::owner::MIGRATOR).await?;
        sluice_common::storage::migrate(&pool, &schema, &MIGRATOR).await?;
        let store = LimitStore { topology: topology() };
        let context = OwnerContext {
            partition: 0,
            epoch: 1,
            clock: AnchoredClock::starting_at(NOW_MS),
            previous_owner_alive: false,
        };
        let mut live = LimitPartition::new(topology().settings(0), 1);
        let mut image = SavedImage::default();
        for (index, queries) in batches().into_iter().enumerate() {
            let now_ms = NOW_MS + 1_000 * i64::try_from(index)?;
            let decided = live.apply(now_ms, &[], queries);
            anyhow::ensure!(decided.rejected.is_empty(), "{:?}", decided.rejected);
            image::save(&mut image, &decided.writes);
            let mut transaction = pool.begin().await?;
            store.persist(&mut transaction, &context, decided.writes).await?;
            transaction.commit().await?;

            let mut connection = pool.acquire().await?;
            let mut from_tables = store.load(&mut connection, &context).await?;
            let mut from_image = image::load(&image, topology().settings(0), 1, now_ms);
            assert_eq!(
                image::held(&from_image),
                image::held(from_tables.core()),
                "after batch {index}"
            );
            assert_eq!(
                image::held(&from_image).tickets,
                image::held(&live).tickets,
                "after batch {index}"
            );
            // Where the journal stands: the next batch is numbered alike.
            let next = vec![link(
                99,
                vec![release("p2", "p", None), acquire("n", "p", plain_one(), "")],
            )];
            let (a, b) = (
                from_tables.core_mut().apply(now_ms, &[], next.clone()).writes,
                from_image.apply(now_ms, &[], next).writes,
            );
            assert_eq!(
                (a.journal.map(|(seq, _)| seq), a.snapshot.map(|(seq, _)| seq)),
                (b.journal.map(|(seq, _)| seq), b.snapshot.map(|(seq, _)| seq)),
                "after batch {index}"
            );
        }
        anyhow::ensure!(
            image.snapshot.is_some() && !image.journal.is_empty() && !image.keys.is_empty(),
            "the image holds a snapshot, journal rows and key rows: {image:?}"
        );
        Ok::<_, anyhow::Error>(())
    }
    .await;
    sluice_common::storage::drop_schemas_with_prefix(&pool, &prefix).await?;
    outcome
}

fn plain_one() -> pb::acquire_ticket::Limit {
    pb::acquire_ticket::Limit::MaxConcurrency(1)
}
