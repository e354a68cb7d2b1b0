//! limit-grant: owns concurrency and floating keys — tickets, waiting queues,
//! overrides and the current floating max — for the partitions of the limit
//! command topic it is assigned. Decisions are made in memory by the owner,
//! committed in batches fenced by the partition's epoch, then published.

pub mod service;
pub mod state;
pub mod store;

use std::sync::Arc;

use sluice_common::forward::ChannelCache;
use sluice_common::kafka::{self, ConsumerOptions, ConsumerProgress, Publisher};
use sluice_common::owner::{OwnerRegistry, OwnerRuntime, OwnerSettings};
use sluice_common::service::{advertised_endpoint, all_topics, open_database, report_readiness, Supervisor};
use sluice_common::{grpc, Faults, Shutdown, SluiceConfig};
use tokio::net::TcpListener;

use crate::state::LocalRequest;
use crate::store::{LimitStore, Topology};

pub const SERVICE: &str = "limit-grant";
pub const SCHEMA: &str = "limit_grant";

#[derive(Debug, thiserror::Error)]
pub enum LimitGrantError {
    #[error(transparent)]
    Storage(#[from] sluice_common::storage::StorageError),
    #[error(transparent)]
    Kafka(#[from] sluice_common::kafka::KafkaPlumbingError),
    #[error(transparent)]
    Grpc(#[from] sluice_common::grpc::GrpcError),
    #[error("limit-grant stopped: {0}")]
    Stopped(String),
}

pub async fn migrate(config: &SluiceConfig) -> Result<(), LimitGrantError> {
    sluice_common::service::migrate_only(config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &store::MIGRATOR]).await?;
    Ok(())
}

/// Run one limit-grant instance until `shutdown`.
pub async fn run(
    config: Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    faults: Faults,
) -> Result<(), LimitGrantError> {
    let pool = open_database(&config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &store::MIGRATOR]).await?;
    kafka::ensure_topics(&config.kafka, &all_topics(&config), config.kafka.create_topics).await?;
    let publisher = Publisher::new(&config.kafka)?;
    let endpoint = advertised_endpoint(&config.limit_grant.advertised_endpoint, &listener);
    let registry: Arc<OwnerRegistry<LocalRequest>> = OwnerRegistry::new();
    let topology = Topology {
        limit_partitions: config.kafka.partitions.limit_commands,
        grants_topic: Arc::from(config.topic(&config.topics.grants)),
        grants_partitions: config.kafka.partitions.grants,
        refresh_due_topic: Arc::from(config.topic(&config.topics.refresh_due)),
        refresh_due_partitions: config.kafka.partitions.refresh_due,
        max_message_bytes: config.kafka.max_message_bytes,
        ticket_grace_ms: config.limit_grant.ticket_grace.as_millis_i64(),
    };
    let runtime = OwnerRuntime::new(
        Arc::new(LimitStore { topology }),
        pool.clone(),
        publisher.clone(),
        registry.clone(),
        OwnerSettings {
            service: SERVICE,
            owner_id: format!("{SERVICE}-{}", uuid::Uuid::new_v4()),
            endpoint: endpoint.clone(),
            max_batch: config.limit_grant.max_batch,
        },
        faults,
    );

    let (mut routes, health) = grpc::base_routes(vec!["sluice.v1.Limits"])?;
    routes.add_service(sluice_proto::v1::limits_server::LimitsServer::new(service::LimitsApi {
        registry: registry.clone(),
        pool: pool.clone(),
        limit_partitions: config.kafka.partitions.limit_commands,
        own_endpoint: endpoint.clone(),
        channels: ChannelCache::default(),
        max_key_bytes: config.admission.max_key_bytes,
    }));

    let mut supervisor = Supervisor::new(shutdown.clone());
    let consumer_config = config.clone();
    let consumer_shutdown = shutdown.clone();
    supervisor.spawn("limit-command consumer", async move {
        kafka::run_partitioned_consumer(
            &consumer_config.kafka,
            ConsumerOptions {
                group: consumer_config.group(&consumer_config.limit_grant.consumer_group),
                topic: consumer_config.topic(&consumer_config.topics.limit_commands),
                channel_capacity: 10_000,
                track_end: false,
            },
            Arc::new(runtime),
            Arc::new(ConsumerProgress::default()),
            consumer_shutdown,
        )
        .await
    });
    supervisor.spawn("readiness", report_readiness(registry, health, shutdown.clone()));
    supervisor.spawn("grpc server", grpc::serve(listener, routes, shutdown.clone()));
    tracing::info!(%endpoint, "limit-grant started");
    let outcome = supervisor.wait().await;
    publisher.flush(std::time::Duration::from_secs(5));
    pool.close().await;
    outcome.map_err(LimitGrantError::Stopped)
}
