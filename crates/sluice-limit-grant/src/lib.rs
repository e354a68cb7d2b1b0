//! limit-grant: owns concurrency and floating keys — tickets, waiting queues,
//! overrides and the current floating max — for the partitions of the limit
//! command topic it is assigned. Decisions are made in memory by the owner,
//! committed in batches fenced by the partition's epoch, then published.

pub mod core;
pub mod observe;
pub mod service;
pub mod store;

use std::sync::Arc;

use sluice_common::core::Ask;
use sluice_common::forward::ChannelCache;
use sluice_common::link::LinkInput;
use sluice_common::service::{run_owner_service, OwnerServiceSpec};
use sluice_common::{Faults, Shutdown, SluiceConfig};
use tokio::net::TcpListener;

use crate::core::{LimitPartition, LimitQuery};
use crate::store::{LimitStore, Topology};

pub const SERVICE: &str = "limit-grant";
pub const SCHEMA: &str = "limit_grant";

/// Why limit-grant could not start or stopped.
pub type LimitGrantError = sluice_common::service::ServiceError;

pub async fn migrate(config: &SluiceConfig) -> Result<(), LimitGrantError> {
    sluice_common::service::migrate_owner_service(config, SCHEMA, &store::MIGRATOR).await
}

/// Run one limit-grant instance until `shutdown`.
pub async fn run(
    config: Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    faults: Faults,
) -> Result<(), LimitGrantError> {
    let topology = Topology {
        limit_partitions: config.kafka.partitions.limit_commands,
        grants_partitions: config.kafka.partitions.jobs,
        refresh_due_topic: Arc::from(config.topic(&config.topics.refresh_due)),
        refresh_due_partitions: config.kafka.partitions.refresh_due,
        max_message_bytes: config.kafka.max_message_bytes,
        ticket_grace_ms: config.limit_grant.ticket_grace.as_millis_i64(),
        input: sluice_common::validate::InputLimits::from_config(&config),
    };
    let spec = OwnerServiceSpec {
        service: SERVICE,
        schema: SCHEMA,
        migrator: &store::MIGRATOR,
        grpc_service: "sluice.v1.Limits",
        input_topic: config.topics.limit_commands.clone(),
        consumer_group: config.limit_grant.consumer_group.clone(),
        consumer_task: "limit-command consumer",
        advertised_endpoint: config.limit_grant.advertised_endpoint.clone(),
        max_batch: config.limit_grant.max_batch,
    };
    let limit_partitions = config.kafka.partitions.limit_commands;
    let max_key_bytes = config.admission.max_key_bytes;
    run_owner_service(
        config,
        listener,
        shutdown,
        faults,
        spec,
        LimitStore { topology },
        Some(link_query),
        |routes, parts| {
            let api = service::LimitsApi {
                registry: parts.registry,
                pool: parts.pool,
                limit_partitions,
                own_endpoint: parts.endpoint,
                channels: ChannelCache::default(),
                max_key_bytes,
            };
            routes.add_service(sluice_common::auth::guarded(
                sluice_proto::v1::limits_server::LimitsServer::new(api),
                &parts.auth,
            ));
        },
    )
    .await
}

/// What a link hands a partition task, as a query. The link waits for its
/// commands' `applied`: it is told when the query is answered (after the
/// commit), and never when the partition stops before (the answer's channel
/// is dropped, and `applied` with it).
fn link_query(input: LinkInput) -> Ask<LimitPartition> {
    let (reply, answered) = tokio::sync::oneshot::channel();
    let query = match input {
        LinkInput::Commands(batch) => {
            let applied = batch.applied;
            tokio::spawn(async move {
                if answered.await.is_ok() {
                    let _ = applied.send(());
                }
            });
            LimitQuery::Link {
                commands: batch.commands,
                client: batch.client,
            }
        }
        LinkInput::ResendGrants { job_partitions } => LimitQuery::ResendGrants { job_partitions },
    };
    Ask::Query { query, reply }
}
