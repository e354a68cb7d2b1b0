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
use sluice_common::service::{run_owner_service, OwnerServiceSpec};
use sluice_common::{Faults, Shutdown, SluiceConfig};
use tokio::net::TcpListener;

use crate::store::{RateStore, Topology};

pub const SERVICE: &str = "rate-window";
pub const SCHEMA: &str = "rate_window";

/// Why rate-window could not start or stopped.
pub type ServiceError = sluice_common::service::ServiceError;

pub async fn migrate(config: &SluiceConfig) -> Result<(), ServiceError> {
    sluice_common::service::migrate_owner_service(config, SCHEMA, &store::MIGRATOR).await
}

/// Run one rate-window instance until `shutdown`.
pub async fn run(
    config: Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    faults: Faults,
) -> Result<(), ServiceError> {
    let topology = Topology {
        rate_partitions: config.kafka.partitions.rate_commands,
        grants_partitions: config.kafka.partitions.jobs,
        max_message_bytes: config.kafka.max_message_bytes,
        granted_retention_ms: config.rate_window.granted_retention.as_millis_i64(),
        input: sluice_common::validate::InputLimits::from_config(&config),
    };
    let spec = OwnerServiceSpec {
        service: SERVICE,
        schema: SCHEMA,
        migrator: &store::MIGRATOR,
        grpc_service: "sluice.v1.RateLimits",
        input_topic: config.topics.rate_commands.clone(),
        consumer_group: config.rate_window.consumer_group.clone(),
        consumer_task: "rate-command consumer",
        advertised_endpoint: config.rate_window.advertised_endpoint.clone(),
        max_batch: config.rate_window.max_batch,
    };
    let rate_partitions = config.kafka.partitions.rate_commands;
    let max_key_bytes = config.admission.max_key_bytes;
    run_owner_service(
        config,
        listener,
        shutdown,
        faults,
        spec,
        RateStore { topology },
        Some(state::LocalRequest::Link),
        |routes, parts| {
            let api = service::RateLimitsApi {
                registry: parts.registry,
                pool: parts.pool,
                rate_partitions,
                own_endpoint: parts.endpoint,
                channels: ChannelCache::default(),
                max_key_bytes,
            };
            routes.add_service(sluice_common::auth::guarded(
                sluice_proto::v1::rate_limits_server::RateLimitsServer::new(api),
                &parts.auth,
            ));
        },
    )
    .await
}
