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
use sluice_common::service::{run_owner_service, OwnerServiceSpec};
use sluice_common::{Faults, Shutdown, SluiceConfig};
use tokio::net::TcpListener;

use crate::schedule::RefreshPolicy;
use crate::state::PartitionSettings;
use crate::store::RefreshStore;

pub const SERVICE: &str = "refresh-dispatcher";
pub const SCHEMA: &str = "refresh_dispatcher";

/// Why the refresh-dispatcher could not start or stopped.
pub type ServiceError = sluice_common::service::ServiceError;

pub async fn migrate(config: &SluiceConfig) -> Result<(), ServiceError> {
    sluice_common::service::migrate_owner_service(config, SCHEMA, &store::MIGRATOR).await
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
    let settings = PartitionSettings {
        partition: 0,
        refresh_due_partitions: config.kafka.partitions.refresh_due,
        limit_commands_topic: Arc::from(config.topic(&config.topics.limit_commands)),
        limit_partitions: config.kafka.partitions.limit_commands,
        refresh_tasks_topic: Arc::from(config.topic(&config.topics.refresh_tasks)),
        refresh_tasks_partitions: config.kafka.partitions.refresh_tasks,
        max_message_bytes: config.kafka.max_message_bytes,
        policy: policy(&config),
        input: sluice_common::validate::InputLimits::from_config(&config),
    };
    let spec = OwnerServiceSpec {
        service: SERVICE,
        schema: SCHEMA,
        migrator: &store::MIGRATOR,
        grpc_service: "sluice.v1.Refresh",
        input_topic: config.topics.refresh_due.clone(),
        consumer_group: config.refresh_dispatcher.consumer_group.clone(),
        consumer_task: "refresh-due consumer",
        advertised_endpoint: config.refresh_dispatcher.advertised_endpoint.clone(),
        max_batch: config.refresh_dispatcher.max_batch,
    };
    let refresh_due_partitions = config.kafka.partitions.refresh_due;
    let max_key_bytes = config.admission.max_key_bytes;
    run_owner_service(
        config,
        listener,
        shutdown,
        faults,
        spec,
        RefreshStore { settings },
        None,
        |routes, parts| {
            let api = service::RefreshApi {
                registry: parts.registry,
                pool: parts.pool,
                refresh_due_partitions,
                own_endpoint: parts.endpoint,
                channels: ChannelCache::default(),
                max_key_bytes,
            };
            routes.add_service(sluice_common::auth::guarded(
                sluice_proto::v1::refresh_server::RefreshServer::new(api),
                &parts.auth,
            ));
        },
    )
    .await
}
