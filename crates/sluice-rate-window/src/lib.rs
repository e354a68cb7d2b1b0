//! rate-window: owns rate limits — sliding windows at 1 ms, their waiting
//! queues and the stored rate-limit resources — for the partitions of the
//! rate command topic it is assigned. A job over the limit is deferred to the
//! exact earliest time it becomes legal, never rejected.

pub mod queue;
pub mod service;
pub mod state;
pub mod store;
pub mod window;

use std::sync::Arc;

use sluice_common::forward::ChannelCache;
use sluice_common::kafka::{self, ConsumerOptions, ConsumerProgress, Publisher};
use sluice_common::owner::{OwnerRegistry, OwnerRuntime, OwnerSettings};
use sluice_common::service::{advertised_endpoint, all_topics, open_database, report_readiness, Supervisor};
use sluice_common::{grpc, Faults, Shutdown, SluiceConfig};
use tokio::net::TcpListener;

use crate::state::LocalRequest;
use crate::store::{RateStore, Topology};

pub const SERVICE: &str = "rate-window";
pub const SCHEMA: &str = "rate_window";

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Storage(#[from] sluice_common::storage::StorageError),
    #[error(transparent)]
    Kafka(#[from] sluice_common::kafka::KafkaPlumbingError),
    #[error(transparent)]
    Grpc(#[from] sluice_common::grpc::GrpcError),
    #[error("rate-window stopped: {0}")]
    Stopped(String),
}

pub async fn migrate(config: &SluiceConfig) -> Result<(), ServiceError> {
    sluice_common::service::migrate_only(config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &store::MIGRATOR]).await?;
    Ok(())
}

/// Run one rate-window instance until `shutdown`.
pub async fn run(
    config: Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    faults: Faults,
) -> Result<(), ServiceError> {
    let pool = open_database(&config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &store::MIGRATOR]).await?;
    kafka::ensure_topics(&config.kafka, &all_topics(&config), config.kafka.create_topics).await?;
    let publisher = Publisher::new(&config.kafka)?;
    let endpoint = advertised_endpoint(&config.rate_window.advertised_endpoint, &listener);
    let registry: Arc<OwnerRegistry<LocalRequest>> = OwnerRegistry::new();
    let topology = Topology {
        rate_partitions: config.kafka.partitions.rate_commands,
        grants_topic: Arc::from(config.topic(&config.topics.grants)),
        grants_partitions: config.kafka.partitions.grants,
        max_message_bytes: config.kafka.max_message_bytes,
        granted_retention_ms: config.rate_window.granted_retention.as_millis_i64(),
    };
    let runtime = OwnerRuntime::new(
        Arc::new(RateStore { topology }),
        pool.clone(),
        publisher.clone(),
        registry.clone(),
        OwnerSettings {
            service: SERVICE,
            owner_id: format!("{SERVICE}-{}", uuid::Uuid::new_v4()),
            endpoint: endpoint.clone(),
            max_batch: config.rate_window.max_batch,
        },
        faults,
    );
    let (mut routes, health) = grpc::base_routes(vec!["sluice.v1.RateLimits"])?;
    routes.add_service(sluice_proto::v1::rate_limits_server::RateLimitsServer::new(
        service::RateLimitsApi {
            registry: registry.clone(),
            pool: pool.clone(),
            rate_partitions: config.kafka.partitions.rate_commands,
            own_endpoint: endpoint.clone(),
            channels: ChannelCache::default(),
            max_key_bytes: config.admission.max_key_bytes,
        },
    ));

    let mut supervisor = Supervisor::new(shutdown.clone());
    {
        let config = config.clone();
        let shutdown = shutdown.clone();
        supervisor.spawn("rate-command consumer", async move {
            kafka::run_partitioned_consumer(
                &config.kafka,
                ConsumerOptions {
                    group: config.group(&config.rate_window.consumer_group),
                    topic: config.topic(&config.topics.rate_commands),
                    channel_capacity: 10_000,
                    track_end: false,
                },
                Arc::new(runtime),
                Arc::new(ConsumerProgress::default()),
                shutdown,
            )
            .await
        });
    }
    supervisor.spawn("readiness", report_readiness(registry, health, shutdown.clone()));
    supervisor.spawn("grpc server", grpc::serve(listener, routes, shutdown.clone()));
    tracing::info!(%endpoint, "rate-window started");
    let outcome = supervisor.wait().await;
    publisher.flush(std::time::Duration::from_secs(5));
    pool.close().await;
    outcome.map_err(ServiceError::Stopped)
}
