//! Bootstrap every service shares: its database schema and migrations, the
//! topics it needs, the endpoint other instances reach it on, and a
//! supervisor that stops the node when any named task fails.

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
            name: config.topic(&topics.grants),
            partitions: counts.grants,
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
    specs
}

/// The address other instances forward to: the configured one, else the
/// listener's address (its IP, or this host's name when bound to 0.0.0.0).
pub fn advertised_endpoint(configured: &str, listener: &TcpListener) -> String {
    if !configured.trim().is_empty() {
        return configured.trim().to_string();
    }
    let Ok(address) = listener.local_addr() else {
        return "http://localhost".to_string();
    };
    if address.ip().is_unspecified() {
        let host = std::env::var("POD_IP")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| "localhost".to_string());
        format!("http://{host}:{}", address.port())
    } else {
        format!("http://{address}")
    }
}

/// Named tasks of one node: the first to fail stops the others.
pub struct Supervisor {
    tasks: JoinSet<(&'static str, Result<(), String>)>,
    shutdown: Shutdown,
}

impl Supervisor {
    pub fn new(shutdown: Shutdown) -> Self {
        Supervisor {
            tasks: JoinSet::new(),
            shutdown,
        }
    }

    pub fn spawn<E: std::fmt::Display>(
        &mut self,
        name: &'static str,
        task: impl Future<Output = Result<(), E>> + Send + 'static,
    ) {
        self.tasks
            .spawn(async move { (name, task.await.map_err(|error| error.to_string())) });
    }

    /// Wait for every task; returns the first failure. A task that ends
    /// before shutdown was asked for is a failure too.
    pub async fn wait(mut self) -> Result<(), String> {
        let mut first_error: Option<String> = None;
        while let Some(joined) = self.tasks.join_next().await {
            let (name, outcome) = match joined {
                Ok(result) => result,
                Err(join_error) => ("task", Err(format!("panicked: {join_error}"))),
            };
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

/// Health follows the owner runtime: not serving while a partition rebuilds.
pub async fn report_readiness<L: Send + 'static>(
    registry: std::sync::Arc<crate::owner::OwnerRegistry<L>>,
    health: crate::grpc::Health,
    shutdown: Shutdown,
) -> Result<(), std::convert::Infallible> {
    let mut ready = registry.watch_ready();
    health.set_serving(registry.is_ready()).await;
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
