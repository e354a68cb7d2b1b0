//! admission: owns jobs — their state machine, attempts, leases, claims and
//! chains — and idempotency keys. Consumes job requests and grant events,
//! sends limit commands, publishes admitted jobs, and serves the worker
//! protocol over gRPC. It owns no partitions: any instance serves any job.

pub mod chain;
pub mod consumers;
pub mod core;
pub mod effects;
#[cfg(test)]
mod fuzz;
pub mod jobs;
pub mod json_request;
pub mod service;
pub mod sweeper;
pub mod transitions;

use std::sync::Arc;
use std::time::Duration;

use sluice_common::kafka::{self, ConsumerOptions, ConsumerProgress, Publisher};
use sluice_common::link::{LinkClient, LinkClientSettings};
use sluice_common::readiness::Readiness;
use sluice_common::service::{all_topics, open_database, Supervisor};
use sluice_common::{grpc, Faults, Shutdown, SluiceConfig};
use sluice_proto::v1::limits_client::LimitsClient;
use sluice_proto::v1::rate_limits_client::RateLimitsClient;
use tokio::net::TcpListener;
use tonic::transport::Endpoint;

use crate::core::AdmissionCore;

pub const SERVICE: &str = "admission";
pub const SCHEMA: &str = "admission";

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[derive(Debug, thiserror::Error)]
pub enum AdmissionServiceError {
    #[error(transparent)]
    Storage(#[from] sluice_common::storage::StorageError),
    #[error(transparent)]
    Kafka(#[from] sluice_common::kafka::KafkaPlumbingError),
    #[error(transparent)]
    Grpc(#[from] sluice_common::grpc::GrpcError),
    #[error("invalid endpoint {endpoint}: {message}")]
    Endpoint { endpoint: String, message: String },
    #[error("admission stopped: {0}")]
    Stopped(String),
}

pub async fn migrate(config: &SluiceConfig) -> Result<(), AdmissionServiceError> {
    sluice_common::service::migrate_only(config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &MIGRATOR]).await?;
    Ok(())
}

fn lazy_channel(endpoint: &str) -> Result<tonic::transport::Channel, AdmissionServiceError> {
    Ok(Endpoint::from_shared(endpoint.to_string())
        .map_err(|error| AdmissionServiceError::Endpoint {
            endpoint: endpoint.to_string(),
            message: error.to_string(),
        })?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(10))
        .connect_lazy())
}

/// Tell the owners, over every link, which job partitions' grants this
/// instance takes: those of the grants topic it is assigned, which are the
/// jobs its sweeper looks after. Follows the assignment as it changes.
async fn claim_job_partitions(
    links: core::AdmissionLinks,
    progress: Arc<ConsumerProgress>,
    shutdown: Shutdown,
) -> Result<(), std::convert::Infallible> {
    let mut claimed: Option<Vec<i32>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let assigned = progress.assigned();
        if claimed.as_ref() == Some(&assigned) {
            continue;
        }
        let claims: Vec<sluice_proto::v1::JobPartitionClaim> = assigned
            .iter()
            .filter_map(|partition| u32::try_from(*partition).ok())
            .map(|partition| sluice_proto::v1::JobPartitionClaim { partition, epoch: 0 })
            .collect();
        links.limit.claim_job_partitions(claims.clone());
        links.rate.claim_job_partitions(claims);
        claimed = Some(assigned);
    }
}

/// Run one admission instance until `shutdown`.
pub async fn run(
    config: Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    faults: Faults,
) -> Result<(), AdmissionServiceError> {
    let pool = open_database(&config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &MIGRATOR]).await?;
    kafka::ensure_topics(&config.kafka, &all_topics(&config), config.kafka.create_topics).await?;
    let readiness = Readiness::new();
    let publisher = Publisher::for_service(&config.kafka, readiness.clone(), faults.clone())?;
    // The hot path: commands up and grants down over streams to limit-grant
    // and rate-window (docs/hot-path.md).
    let client_id = format!("admission-{}", uuid::Uuid::new_v4());
    let (grants_sender, grants_receiver) = tokio::sync::mpsc::channel(1024);
    let links = core::AdmissionLinks {
        limit: LinkClient::start(
            LinkClientSettings {
                service: "limit-grant",
                seed_endpoint: config.admission.limit_grant_endpoint.clone(),
                client_id: client_id.clone(),
            },
            grants_sender.clone(),
            readiness.clone(),
            shutdown.clone(),
        ),
        rate: LinkClient::start(
            LinkClientSettings {
                service: "rate-window",
                seed_endpoint: config.admission.rate_window_endpoint.clone(),
                client_id,
            },
            grants_sender,
            readiness.clone(),
            shutdown.clone(),
        ),
    };
    let core = Arc::new(AdmissionCore::new(
        config.clone(),
        pool.clone(),
        publisher.clone(),
        links.clone(),
        faults,
        readiness.clone(),
    ));
    let grant_progress = Arc::new(ConsumerProgress::default());

    let (mut routes, health) = grpc::base_routes(vec!["sluice.v1.Admission"])?;
    routes.add_service(sluice_proto::v1::admission_server::AdmissionServer::new(
        service::AdmissionApi {
            core: core.clone(),
            limits: LimitsClient::new(lazy_channel(&config.admission.limit_grant_endpoint)?),
            rates: RateLimitsClient::new(lazy_channel(&config.admission.rate_window_endpoint)?),
        },
    ));

    let mut supervisor = Supervisor::new(shutdown.clone());
    let requested_topic = config.topic(&config.topics.requested);
    {
        let config = config.clone();
        let shutdown = shutdown.clone();
        let readiness = readiness.clone();
        let factory = Arc::new(consumers::RequestConsumer {
            core: core.clone(),
            topic: Arc::from(requested_topic.as_str()),
        });
        supervisor.spawn("job request consumer", async move {
            kafka::run_partitioned_consumer(
                &config.kafka,
                ConsumerOptions {
                    group: config.group(&format!("{}-requests", config.admission.consumer_group)),
                    topic: requested_topic,
                    channel_capacity: 10_000,
                    track_end: false,
                    readiness: readiness.clone(),
                },
                factory,
                Arc::new(ConsumerProgress::default()),
                shutdown,
            )
            .await
        });
    }
    {
        let config = config.clone();
        let shutdown = shutdown.clone();
        let readiness = readiness.clone();
        let factory = Arc::new(consumers::GrantConsumer {
            core: core.clone(),
            topic: Arc::from(config.topic(&config.topics.grants)),
        });
        let progress = grant_progress.clone();
        supervisor.spawn("grant consumer", async move {
            kafka::run_partitioned_consumer(
                &config.kafka,
                ConsumerOptions {
                    group: config.group(&format!("{}-grants", config.admission.consumer_group)),
                    topic: config.topic(&config.topics.grants),
                    channel_capacity: 10_000,
                    track_end: true,
                    readiness: readiness.clone(),
                },
                factory,
                progress,
                shutdown,
            )
            .await
        });
    }
    supervisor.spawn(
        "link grants",
        consumers::run_link_grants(core.clone(), grants_receiver, shutdown.clone()),
    );
    supervisor.spawn(
        "job partition claims",
        claim_job_partitions(links, grant_progress.clone(), shutdown.clone()),
    );
    supervisor.spawn("sweeper", sweeper::run(core.clone(), grant_progress, shutdown.clone()));
    supervisor.spawn("grpc server", grpc::serve(listener, routes, shutdown.clone()));
    supervisor.spawn(
        "topic watch",
        kafka::watch_topics(
            config.kafka.clone(),
            all_topics(&config),
            readiness.clone(),
            shutdown.clone(),
        ),
    );
    supervisor.spawn(
        "readiness",
        sluice_common::service::report_readiness(readiness, health.clone(), shutdown.clone()),
    );
    tracing::info!("admission started");
    let outcome = supervisor.wait().await;
    health.set_serving(false).await;
    publisher.flush(Duration::from_secs(5));
    pool.close().await;
    outcome.map_err(AdmissionServiceError::Stopped)
}
