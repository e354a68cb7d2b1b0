//! refresh-dispatcher: the refresh schedule of floating concurrency keys, for
//! the partitions of the refresh-due topic it is assigned (the shared owner
//! runtime). limit-grant says when a key's refresh is due; the dispatcher
//! keeps at most one refresh task in flight per key on `refresh.tasks`,
//! takes the workers' results over gRPC `ReportRefresh`, sends a new max to
//! limit-grant as a `SetFloatingMax` command, and retries failures with
//! exponential backoff.

pub mod schedule;
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

use crate::schedule::RefreshPolicy;
use crate::state::{LocalRequest, PartitionSettings};
use crate::store::RefreshStore;

pub const SERVICE: &str = "refresh-dispatcher";
pub const SCHEMA: &str = "refresh_dispatcher";

#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Storage(#[from] sluice_common::storage::StorageError),
    #[error(transparent)]
    Kafka(#[from] sluice_common::kafka::KafkaPlumbingError),
    #[error(transparent)]
    Grpc(#[from] sluice_common::grpc::GrpcError),
    #[error("refresh-dispatcher stopped: {0}")]
    Stopped(String),
}

pub async fn migrate(config: &SluiceConfig) -> Result<(), ServiceError> {
    sluice_common::service::migrate_only(config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &store::MIGRATOR]).await?;
    Ok(())
}

/// The refresh policy configured for the dispatcher.
pub fn policy(config: &SluiceConfig) -> RefreshPolicy {
    let dispatcher = &config.refresh_dispatcher;
    RefreshPolicy {
        initial_backoff_ms: dispatcher.initial_backoff.as_millis_i64(),
        max_backoff_ms: dispatcher.max_backoff.as_millis_i64(),
        task_timeout_ms: dispatcher.task_timeout.as_millis_i64(),
    }
}

/// Run one refresh-dispatcher instance until `shutdown`.
pub async fn run(
    config: Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    faults: Faults,
) -> Result<(), ServiceError> {
    let pool = open_database(&config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &store::MIGRATOR]).await?;
    kafka::ensure_topics(&config.kafka, &all_topics(&config), config.kafka.create_topics).await?;
    let publisher = Publisher::new(&config.kafka)?;
    let endpoint = advertised_endpoint(&config.refresh_dispatcher.advertised_endpoint, &listener);
    let registry: Arc<OwnerRegistry<LocalRequest>> = OwnerRegistry::new();
    let settings = PartitionSettings {
        partition: 0,
        refresh_due_partitions: config.kafka.partitions.refresh_due,
        limit_commands_topic: Arc::from(config.topic(&config.topics.limit_commands)),
        limit_partitions: config.kafka.partitions.limit_commands,
        refresh_tasks_topic: Arc::from(config.topic(&config.topics.refresh_tasks)),
        refresh_tasks_partitions: config.kafka.partitions.refresh_tasks,
        max_message_bytes: config.kafka.max_message_bytes,
        policy: policy(&config),
    };
    let runtime = OwnerRuntime::new(
        Arc::new(RefreshStore { settings }),
        pool.clone(),
        publisher.clone(),
        registry.clone(),
        OwnerSettings {
            service: SERVICE,
            owner_id: format!("{SERVICE}-{}", uuid::Uuid::new_v4()),
            endpoint: endpoint.clone(),
            max_batch: config.refresh_dispatcher.max_batch,
        },
        faults,
    );
    let (mut routes, health) = grpc::base_routes(vec!["sluice.v1.Refresh"])?;
    routes.add_service(sluice_proto::v1::refresh_server::RefreshServer::new(
        service::RefreshApi {
            registry: registry.clone(),
            pool: pool.clone(),
            refresh_due_partitions: config.kafka.partitions.refresh_due,
            own_endpoint: endpoint.clone(),
            channels: ChannelCache::default(),
            max_key_bytes: config.admission.max_key_bytes,
        },
    ));

    let mut supervisor = Supervisor::new(shutdown.clone());
    {
        let config = config.clone();
        let shutdown = shutdown.clone();
        supervisor.spawn("refresh-due consumer", async move {
            kafka::run_partitioned_consumer(
                &config.kafka,
                ConsumerOptions {
                    group: config.group(&config.refresh_dispatcher.consumer_group),
                    topic: config.topic(&config.topics.refresh_due),
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
    tracing::info!(%endpoint, "refresh-dispatcher started");
    let outcome = supervisor.wait().await;
    publisher.flush(std::time::Duration::from_secs(5));
    pool.close().await;
    outcome.map_err(ServiceError::Stopped)
}
