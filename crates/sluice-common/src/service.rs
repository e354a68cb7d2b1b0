//! Bootstrap every service shares: its database schema and migrations, the
//! topics it needs, the endpoint other instances reach it on, and a
//! supervisor that stops the node when any named task fails.

use std::collections::HashMap;
use std::future::Future;

use sqlx::migrate::Migrator;
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use crate::config::SluiceConfig;
use crate::kafka::TopicSpec;
use crate::shutdown::Shutdown;
use crate::storage::{self, StorageError};

/// Connect to the service's schema and, when configured, migrate it.
pub async fn open_database(
    config: &SluiceConfig,
    service_schema: &str,
    migrators: &[&Migrator],
) -> Result<PgPool, StorageError> {
    let schema = config.schema(service_schema);
    let pool = storage::connect(&config.postgres, &schema).await?;
    if config.postgres.run_migrations {
        for migrator in migrators {
            storage::migrate(&pool, &schema, migrator).await?;
        }
    }
    Ok(pool)
}

/// Run migrations only (the `migrate` subcommand and the Helm hook Job).
pub async fn migrate_only(
    config: &SluiceConfig,
    service_schema: &str,
    migrators: &[&Migrator],
) -> Result<(), StorageError> {
    let schema = config.schema(service_schema);
    let pool = storage::connect(&config.postgres, &schema).await?;
    for migrator in migrators {
        storage::migrate(&pool, &schema, migrator).await?;
    }
    pool.close().await;
    Ok(())
}

/// Every topic Sluice uses, with configured partition counts. Internal topics
/// must never change partition count.
pub fn all_topics(config: &SluiceConfig) -> Vec<TopicSpec> {
    let counts = &config.kafka.partitions;
    let topics = &config.topics;
    let mut specs = vec![
        TopicSpec {
            name: config.topic(&topics.requested),
            partitions: counts.requested,
            internal: false,
        },
        TopicSpec {
            name: config.topic(&topics.deadletter),
            partitions: counts.deadletter,
            internal: false,
        },
        TopicSpec {
            name: config.topic(&topics.refresh_tasks),
            partitions: counts.refresh_tasks,
            internal: false,
        },
        TopicSpec {
            name: config.topic(&topics.limit_commands),
            partitions: counts.limit_commands,
            internal: true,
        },
        TopicSpec {
            name: config.topic(&topics.rate_commands),
            partitions: counts.rate_commands,
            internal: true,
        },
        TopicSpec {
            name: config.topic(&topics.jobs),
            partitions: counts.jobs,
            internal: true,
        },
        TopicSpec {
            name: config.topic(&topics.refresh_due),
            partitions: counts.refresh_due,
            internal: true,
        },
    ];
    for task_group in config.task_groups.keys() {
        specs.push(TopicSpec {
            name: config.admitted_topic(task_group),
            partitions: counts.admitted,
            internal: false,
        });
    }
    for tenant in &topics.tenant_requested {
        specs.push(TopicSpec {
            name: config.topic(&config.tenant_requested_topic(tenant)),
            partitions: counts.requested,
            internal: false,
        });
    }
    specs
}

/// The address other instances forward to: the configured one, else the
/// listener's address (its IP, or this host's name when bound to 0.0.0.0),
/// `https://` when the server speaks TLS.
pub fn advertised_endpoint(configured: &str, listener: &TcpListener, tls: bool) -> String {
    if !configured.trim().is_empty() {
        return configured.trim().to_string();
    }
    let scheme = if tls { "https" } else { "http" };
    let Ok(address) = listener.local_addr() else {
        return format!("{scheme}://localhost");
    };
    if address.ip().is_unspecified() {
        let host = std::env::var("POD_IP")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "localhost".to_string());
        format!("{scheme}://{host}:{}", address.port())
    } else {
        format!("{scheme}://{address}")
    }
}

/// Named tasks of one node: the first to fail stops the others. Once the
/// node stops, the tasks have `drain_timeout` to end; those still running
/// then are aborted and named in the error.
pub struct Supervisor {
    tasks: JoinSet<(&'static str, Result<(), String>)>,
    names: HashMap<tokio::task::Id, &'static str>,
    shutdown: Shutdown,
    drain_timeout: std::time::Duration,
}

impl Supervisor {
    pub fn new(shutdown: Shutdown, drain_timeout: std::time::Duration) -> Self {
        Supervisor {
            tasks: JoinSet::new(),
            names: HashMap::new(),
            shutdown,
            drain_timeout,
        }
    }

    pub fn spawn<E: std::fmt::Display>(
        &mut self,
        name: &'static str,
        task: impl Future<Output = Result<(), E>> + Send + 'static,
    ) {
        let handle = self
            .tasks
            .spawn(async move { (name, task.await.map_err(|error| error.to_string())) });
        self.names.insert(handle.id(), name);
    }

    /// Wait for every task; returns the first failure. A task that ends
    /// before shutdown was asked for is a failure too, and so is a drain
    /// that does not finish within the drain timeout.
    pub async fn wait(mut self) -> Result<(), String> {
        let mut first_error: Option<String> = None;
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        loop {
            if drain_deadline.is_none() && self.shutdown.is_triggered() {
                drain_deadline = Some(tokio::time::Instant::now() + self.drain_timeout);
            }
            let joined = tokio::select! {
                joined = self.tasks.join_next_with_id() => joined,
                _ = self.shutdown.cancelled(), if drain_deadline.is_none() => continue,
                _ = sleep_until_some(drain_deadline) => {
                    let mut left: Vec<&str> = self.names.values().copied().collect();
                    left.sort_unstable();
                    let error = format!(
                        "the drain did not finish within {:?}; still running: {}",
                        self.drain_timeout,
                        left.join(", ")
                    );
                    tracing::error!(%error, "aborting the tasks left");
                    self.tasks.abort_all();
                    while self.tasks.join_next().await.is_some() {}
                    first_error.get_or_insert(error);
                    break;
                }
            };
            let Some(joined) = joined else {
                break;
            };
            let (name, outcome) = match joined {
                Ok((id, result)) => {
                    self.names.remove(&id);
                    result
                }
                Err(join_error) => {
                    let name = self.names.remove(&join_error.id()).unwrap_or("task");
                    (name, Err(format!("panicked: {join_error}")))
                }
            };
            tracing::debug!(task = name, remaining = self.tasks.len(), "node task ended");
            let error = match outcome {
                Err(error) => Some(format!("{name}: {error}")),
                Ok(()) if !self.shutdown.is_triggered() => Some(format!("{name}: ended unexpectedly")),
                Ok(()) => None,
            };
            if let Some(error) = error {
                if !self.shutdown.is_crashed() {
                    tracing::error!(task = name, %error, "task failed; stopping the node");
                }
                self.shutdown.trigger();
                first_error.get_or_insert(error);
            }
        }
        if self.shutdown.is_crashed() {
            return Err(first_error.unwrap_or_else(|| "crashed".to_string()));
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// Sleep until `deadline`, or for ever without one.
async fn sleep_until_some(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

/// gRPC health follows the instance's readiness: NOT_SERVING while a
/// partition rebuilds, a fault that passes is being retried, a producer is
/// rebuilt or a topic is missing.
pub async fn report_readiness(
    readiness: crate::readiness::Readiness,
    health: crate::grpc::Health,
    shutdown: Shutdown,
) -> Result<(), std::convert::Infallible> {
    let mut ready = readiness.watch();
    health.set_serving(readiness.is_ready()).await;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => {
                health.set_serving(false).await;
                return Ok(());
            }
            changed = ready.changed() => {
                if changed.is_err() {
                    return Ok(());
                }
                let serving = *ready.borrow_and_update();
                health.set_serving(serving).await;
            }
        }
    }
}

/// Why a service instance could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Storage(#[from] StorageError),
    #[error(transparent)]
    Kafka(#[from] crate::kafka::KafkaPlumbingError),
    #[error(transparent)]
    Grpc(#[from] crate::grpc::GrpcError),
    #[error("{service} stopped: {reason}")]
    Stopped { service: &'static str, reason: String },
}

/// What sets one partition-owning service (limit-grant, rate-window,
/// refresh-dispatcher) apart; `run_owner_service` does the rest.
pub struct OwnerServiceSpec {
    /// The service's name (logs, the owner directory, metrics).
    pub service: &'static str,
    /// Its schema (after `postgres.schema_prefix`) and its own migrations;
    /// the owner runtime's are added.
    pub schema: &'static str,
    pub migrator: &'static Migrator,
    /// The gRPC service it serves (health and reflection).
    pub grpc_service: &'static str,
    /// The input topic and consumer group (before the prefix), and the name
    /// of the consuming task.
    pub input_topic: String,
    pub consumer_group: String,
    pub consumer_task: &'static str,
    pub advertised_endpoint: String,
    pub max_batch: usize,
}

/// Wraps what a link hands a partition task in the service's local request.
pub type LinkLocal<S> =
    fn(crate::link::LinkInput) -> <<S as crate::owner::OwnedStore>::State as crate::owner::OwnedState>::Local;

/// What a service's gRPC API needs to reach the keys' owners.
pub struct OwnerApiParts<L> {
    /// Put in front of the service's API (`auth::guarded`).
    pub auth: crate::auth::Authenticator,
    pub registry: std::sync::Arc<crate::owner::OwnerRegistry<L>>,
    pub pool: PgPool,
    /// This instance's advertised endpoint.
    pub endpoint: String,
}

/// Apply a partition-owning service's migrations (the `migrate` subcommand).
pub async fn migrate_owner_service(
    config: &SluiceConfig,
    schema: &str,
    migrator: &Migrator,
) -> Result<(), ServiceError> {
    migrate_only(config, schema, &[&crate::owner::MIGRATOR, migrator]).await?;
    Ok(())
}

/// Run one instance of a partition-owning service until `shutdown`: its
/// database, topics and publisher, the owner runtime on the input topic's
/// consumer group, readiness that follows the owner runtime, and the gRPC
/// API that `add_api` adds to the base routes (health, reflection); with
/// `link_local`, the hot path's `OwnerLink` streams too.
#[allow(clippy::too_many_arguments)]
pub async fn run_owner_service<S: crate::owner::OwnedStore>(
    config: std::sync::Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    faults: crate::faults::Faults,
    spec: OwnerServiceSpec,
    store: S,
    link_local: Option<LinkLocal<S>>,
    add_api: impl FnOnce(&mut tonic::service::RoutesBuilder, OwnerApiParts<<S::State as crate::owner::OwnedState>::Local>),
) -> Result<(), ServiceError> {
    use std::sync::Arc;

    use crate::kafka::Publisher;
    use crate::owner::{OwnerRegistry, OwnerRuntime, OwnerSettings};

    let tls = crate::tls::ServerTls::load(&config.tls).map_err(crate::grpc::GrpcError::from)?;
    crate::tls::configure_clients(&config.tls).map_err(crate::grpc::GrpcError::from)?;
    let auth = crate::auth::start(&config.auth, &shutdown).map_err(crate::grpc::GrpcError::from)?;
    let pool = open_database(&config, spec.schema, &[&crate::owner::MIGRATOR, spec.migrator]).await?;
    crate::kafka::ensure_topics(&config.kafka, &all_topics(&config), config.kafka.create_topics).await?;
    let readiness = crate::readiness::Readiness::new();
    let publisher = Publisher::for_service(&config.kafka, readiness.clone(), faults.clone())?;
    let endpoint = advertised_endpoint(&spec.advertised_endpoint, &listener, tls.is_some());
    let registry = OwnerRegistry::new(spec.service, readiness.clone());
    let runtime = OwnerRuntime::new(
        Arc::new(store),
        pool.clone(),
        publisher.clone(),
        registry.clone(),
        OwnerSettings {
            service: spec.service,
            owner_id: format!("{}-{}", spec.service, uuid::Uuid::new_v4()),
            endpoint: endpoint.clone(),
            max_batch: spec.max_batch,
        },
        faults.clone(),
    );
    let (runtime, link_service) =
        with_link_service(runtime, link_local, spec.service, &registry, &pool, &faults, &shutdown);
    let grpc_services = match link_service {
        Some(_) => vec![spec.grpc_service, "sluice.v1.OwnerLink"],
        None => vec![spec.grpc_service],
    };
    let (mut routes, health) = crate::grpc::base_routes(grpc_services, config.process.grpc_reflection)?;
    if let Some(link_service) = link_service {
        routes.add_service(crate::auth::guarded(
            sluice_proto::v1::owner_link_server::OwnerLinkServer::new(link_service),
            &auth,
        ));
    }
    add_api(
        &mut routes,
        OwnerApiParts {
            auth,
            registry: registry.clone(),
            pool: pool.clone(),
            endpoint: endpoint.clone(),
        },
    );

    let mut supervisor = Supervisor::new(shutdown.clone(), config.process.drain_timeout.0);
    spawn_input_consumer(&mut supervisor, &config, &spec, runtime, &readiness, &shutdown);
    spawn_serving(
        &mut supervisor,
        &config,
        (listener, routes, tls),
        readiness,
        health,
        &shutdown,
    );
    tracing::info!(service = spec.service, %endpoint, "service started");
    let outcome = supervisor.wait().await;
    publisher.flush(std::time::Duration::from_secs(5)).await;
    pool.close().await;
    outcome.map_err(|reason| ServiceError::Stopped {
        service: spec.service,
        reason,
    })
}

type OwnerLocal<S> = <<S as crate::owner::OwnedStore>::State as crate::owner::OwnedState>::Local;

/// The hot path, for a service that has one (`link_local`): commands in
/// from admission's links, grants out (through the router `runtime` is given).
fn with_link_service<S: crate::owner::OwnedStore>(
    runtime: crate::owner::OwnerRuntime<S>,
    link_local: Option<LinkLocal<S>>,
    service: &'static str,
    registry: &std::sync::Arc<crate::owner::OwnerRegistry<OwnerLocal<S>>>,
    pool: &PgPool,
    faults: &crate::faults::Faults,
    shutdown: &Shutdown,
) -> (
    crate::owner::OwnerRuntime<S>,
    Option<crate::link::LinkService<OwnerLocal<S>>>,
) {
    let Some(make_local) = link_local else {
        return (runtime, None);
    };
    let router = crate::link::GrantRouter::new(faults.clone());
    let runtime = runtime.with_links(router.clone());
    let link_service = crate::link::LinkService {
        service,
        registry: registry.clone(),
        router,
        pool: pool.clone(),
        make_local,
        shutdown: shutdown.clone(),
    };
    (runtime, Some(link_service))
}

/// The owner runtime on the input topic's consumer group.
fn spawn_input_consumer<S: crate::owner::OwnedStore>(
    supervisor: &mut Supervisor,
    config: &std::sync::Arc<SluiceConfig>,
    spec: &OwnerServiceSpec,
    runtime: crate::owner::OwnerRuntime<S>,
    readiness: &crate::readiness::Readiness,
    shutdown: &Shutdown,
) {
    use std::sync::Arc;

    use crate::kafka::{ConsumerOptions, ConsumerProgress};

    let config = config.clone();
    let shutdown = shutdown.clone();
    let options = ConsumerOptions {
        group: config.group(&spec.consumer_group),
        topic: config.topic(&spec.input_topic),
        channel_capacity: 10_000,
        track_end: false,
        readiness: readiness.clone(),
    };
    supervisor.spawn(spec.consumer_task, async move {
        crate::kafka::run_partitioned_consumer(
            &config.kafka,
            options,
            Arc::new(runtime),
            Arc::new(ConsumerProgress::default()),
            shutdown,
        )
        .await
    });
}

/// The gRPC server, the topic watch and readiness reporting.
fn spawn_serving(
    supervisor: &mut Supervisor,
    config: &SluiceConfig,
    (listener, routes, tls): (
        TcpListener,
        tonic::service::RoutesBuilder,
        Option<std::sync::Arc<crate::tls::ServerTls>>,
    ),
    readiness: crate::readiness::Readiness,
    health: crate::grpc::Health,
    shutdown: &Shutdown,
) {
    supervisor.spawn(
        "topic watch",
        crate::kafka::watch_topics(
            config.kafka.clone(),
            all_topics(config),
            readiness.clone(),
            shutdown.clone(),
        ),
    );
    supervisor.spawn("readiness", report_readiness(readiness, health, shutdown.clone()));
    supervisor.spawn(
        "grpc server",
        crate::grpc::serve(
            listener,
            routes,
            tls,
            crate::grpc::ServerLimits::of(&config.process),
            shutdown.clone(),
        ),
    );
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_drain_that_cannot_finish_ends_at_the_deadline_naming_the_tasks_left() {
        let shutdown = Shutdown::new();
        let mut supervisor = Supervisor::new(shutdown.clone(), Duration::from_millis(200));
        let stopping = shutdown.clone();
        supervisor.spawn("drains", async move {
            stopping.cancelled().await;
            Ok::<(), String>(())
        });
        // Ignores the stop, as a call to a broker that never answers would.
        supervisor.spawn("stuck flush", std::future::pending::<Result<(), String>>());
        shutdown.trigger();
        let waited = tokio::time::timeout(Duration::from_secs(30), supervisor.wait())
            .await
            .expect("the drain is bounded");
        let error = waited.unwrap_err();
        assert!(error.contains("did not finish within 200ms"), "{error}");
        assert!(error.contains("still running: stuck flush"), "{error}");
        assert!(!error.contains("drains"), "{error}");
    }

    #[tokio::test]
    async fn a_drain_that_finishes_is_a_clean_stop_and_a_failure_stops_the_others() {
        let shutdown = Shutdown::new();
        let mut supervisor = Supervisor::new(shutdown.clone(), Duration::from_secs(60));
        let stopping = shutdown.clone();
        supervisor.spawn("server", async move {
            stopping.cancelled().await;
            Ok::<(), String>(())
        });
        shutdown.trigger();
        assert_eq!(supervisor.wait().await, Ok(()));

        let shutdown = Shutdown::new();
        let mut supervisor = Supervisor::new(shutdown.clone(), Duration::from_secs(60));
        let stopping = shutdown.clone();
        supervisor.spawn("server", async move {
            stopping.cancelled().await;
            Ok::<(), String>(())
        });
        supervisor.spawn("consumer", async { Err::<(), String>("broker gone".to_string()) });
        assert_eq!(supervisor.wait().await, Err("consumer: broker gone".to_string()));
    }
}
