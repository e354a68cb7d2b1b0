//! admission: owns jobs — their state machine, attempts, leases, claims and
//! chains — and idempotency keys. Jobs belong to job partitions
//! (`sluice.jobs`, by Sluice's hash of the job id), owned like every other
//! owner's partitions (docs/hot-path.md): a partition's active jobs live in
//! its owner's memory, decided by one pure core (`partition`), committed in
//! fenced batches (`store`). It reads producers' requests, sends limit
//! commands on the links and takes their grants, publishes admitted jobs,
//! and serves the worker protocol over gRPC.

pub mod chain;
pub mod consumers;
pub mod effects;
#[cfg(test)]
mod fuzz;
pub mod jobs;
pub mod journal;
pub mod json_request;
pub mod partition;
pub mod quota;
pub mod service;
pub mod store;
pub mod transitions;
pub mod work;
pub mod work_stream;

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use sluice_common::clock::wall_clock_ms;
use sluice_common::kafka::{self, ConsumerOptions, ConsumerProgress, Publisher};
use sluice_common::link::{Downlink, Link, LinkClient, LinkClientSettings, LinkEntries, LinkSink};
use sluice_common::owner::{OwnerRegistry, OwnerRuntime, OwnerSettings};
use sluice_common::readiness::Readiness;
use sluice_common::service::{advertised_endpoint, all_topics, open_database, Supervisor};
use sluice_common::{grpc, Faults, Shutdown, SluiceConfig};
use sluice_proto::v1::limits_client::LimitsClient;
use sluice_proto::v1::rate_limits_client::RateLimitsClient;
use tokio::net::TcpListener;

use crate::partition::{Local, PartitionSettings};
use crate::transitions::Timing;

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

fn lazy_channel(endpoint: &str) -> Result<sluice_common::auth::Channel, AdmissionServiceError> {
    Ok(sluice_common::auth::with_credentials(
        sluice_common::tls::endpoint(endpoint)
            .map_err(|error| AdmissionServiceError::Endpoint {
                endpoint: endpoint.to_string(),
                message: error.to_string(),
            })?
            .connect_timeout(Duration::from_secs(3))
            .timeout(Duration::from_secs(10))
            .connect_lazy(),
    ))
}

/// The hot path's streams to limit-grant and rate-window.
#[derive(Clone)]
pub struct AdmissionLinks {
    pub limit: LinkClient,
    pub rate: LinkClient,
}

impl LinkSink for AdmissionLinks {
    fn deliver(&self, entries: LinkEntries) -> BoxFuture<'_, ()> {
        // The link clients keep each command until its owner applied it.
        for ((link, partition), commands) in entries {
            match link {
                Link::LimitGrant => self.limit.send(partition, commands),
                Link::RateWindow => self.rate.send(partition, commands),
                Link::Admission => tracing::error!(partition, "admission cannot send grants; dropped"),
            }
        }
        async {}.boxed()
    }
}

/// Admission's ordering barrier (tests wait on it instead of sleeping before
/// they check that something did not happen). Returns once:
///
/// 1. every job partition this instance owns has applied, committed and
///    sent what was queued to it before the call (its link commands are
///    with the link clients);
/// 2. every command the link clients were given is applied by its owner,
///    and the grants those owners delivered here before saying so are
///    handed to the job partitions (`LinkClient::barrier`);
/// 3. the job partitions have applied and committed those grants.
///
/// Requests still in Kafka (`jobs.requested`, `sluice.jobs`) and commands
/// sent over Kafka are not covered: a test waits for their offsets first.
pub async fn barrier(registry: &OwnerRegistry<Local>, links: &AdmissionLinks) -> Result<(), String> {
    registry.barrier_all().await.map_err(|error| error.to_string())?;
    links.limit.barrier().await.map_err(|error| error.to_string())?;
    links.rate.barrier().await.map_err(|error| error.to_string())?;
    registry.barrier_all().await.map_err(|error| error.to_string())
}

/// The settings every job partition of this instance shares.
pub fn partition_settings(config: &Arc<SluiceConfig>, faults: &Faults, hub: Arc<work::WorkerHub>) -> PartitionSettings {
    PartitionSettings {
        partition: 0,
        config: config.clone(),
        routes: Arc::new(effects::Routes::from_config(config)),
        timing: Timing {
            resend_waiting_after_ms: config.resend_waiting_after().as_millis_i64(),
            claim_timeout_ms: config.claim_timeout().as_millis_i64(),
            claim_overtaken_after_ms: config.claim_overtaken_after().as_millis_i64(),
        },
        stand_behind_interval_ms: config.admission.stand_behind_interval.as_millis_i64(),
        ticket_grace_ms: config.limit_grant.ticket_grace.as_millis_i64(),
        faults: faults.clone(),
        hub,
        quotas: Arc::new(quota::Quotas::from_config(config)),
        consumers: partition::Consumers::default(),
    }
}

/// Run one admission instance until `shutdown`.
pub async fn run(
    config: Arc<SluiceConfig>,
    listener: TcpListener,
    shutdown: Shutdown,
    faults: Faults,
) -> Result<(), AdmissionServiceError> {
    let tls = sluice_common::tls::ServerTls::load(&config.tls).map_err(grpc::GrpcError::from)?;
    sluice_common::tls::configure_clients(&config.tls).map_err(grpc::GrpcError::from)?;
    let auth = sluice_common::auth::start(&config.auth, &shutdown).map_err(grpc::GrpcError::from)?;
    let pool = open_database(&config, SCHEMA, &[&sluice_common::owner::MIGRATOR, &MIGRATOR]).await?;
    kafka::ensure_topics(&config.kafka, &all_topics(&config), config.kafka.create_topics).await?;
    let readiness = Readiness::new();
    let publisher = Publisher::for_service(&config.kafka, readiness.clone(), faults.clone())?;
    let endpoint = advertised_endpoint(&config.admission.advertised_endpoint, &listener, tls.is_some());

    // The hot path: commands up and grants down over streams to limit-grant
    // and rate-window (docs/hot-path.md).
    let client_id = format!("admission-{}", uuid::Uuid::new_v4());
    let (links, grants_receiver) = start_links(&config, &client_id, &readiness, &shutdown);

    // Workers on streams: dispatch is the claim (docs/worker-protocol.md).
    let (hub, push_reports) = work::WorkerHub::new();
    let settings = partition_settings(&config, &faults, hub.clone());
    let routes = settings.routes.clone();
    let quotas = settings.quotas.clone();
    let registry: Arc<OwnerRegistry<Local>> = OwnerRegistry::new(SERVICE, readiness.clone());
    let runtime = OwnerRuntime::new(
        Arc::new(store::AdmissionStore { settings }),
        pool.clone(),
        publisher.clone(),
        registry.clone(),
        OwnerSettings {
            service: SERVICE,
            owner_id: client_id,
            endpoint: endpoint.clone(),
            max_batch: config.admission.max_batch,
        },
        faults.clone(),
    )
    .with_links(Arc::new(links.clone()));
    set_barrier(&faults, &registry, &links);

    let instance = Instance {
        config,
        registry,
        pool,
        readiness,
        shutdown,
    };
    let (mut grpc_routes, health) =
        grpc::base_routes(vec!["sluice.v1.Admission"], instance.config.process.grpc_reflection)?;
    let api = instance.api(endpoint.clone(), hub, quotas.clone())?;
    grpc_routes.add_service(sluice_common::auth::guarded(
        sluice_proto::v1::admission_server::AdmissionServer::new(api.clone()),
        &auth,
    ));

    let mut supervisor = Supervisor::new(instance.shutdown.clone(), instance.config.process.drain_timeout.0);
    instance.spawn_consumers(&mut supervisor, runtime, routes, &publisher, &faults);
    instance.spawn_link_tasks(&mut supervisor, links, grants_receiver, push_reports, api, quotas);
    instance.spawn_serving(&mut supervisor, listener, grpc_routes, tls, health.clone());
    tracing::info!(%endpoint, "admission started");
    let outcome = supervisor.wait().await;
    health.set_serving(false).await;
    tracing::debug!("admission tasks ended; flushing the producer");
    publisher.flush(Duration::from_secs(5)).await;
    tracing::debug!("closing the database pool");
    instance.pool.close().await;
    tracing::debug!("admission stopped");
    outcome.map_err(AdmissionServiceError::Stopped)
}

/// Tests wait on admission's barrier (`barrier`) through the faults handle.
fn set_barrier(faults: &Faults, registry: &Arc<OwnerRegistry<Local>>, links: &AdmissionLinks) {
    let registry = registry.clone();
    let links = links.clone();
    faults.set_barrier(Arc::new(move || {
        let registry = registry.clone();
        let links = links.clone();
        async move { barrier(&registry, &links).await }.boxed()
    }));
}

/// What the tasks of one admission instance share.
struct Instance {
    config: Arc<SluiceConfig>,
    registry: Arc<OwnerRegistry<Local>>,
    pool: sqlx::PgPool,
    readiness: Readiness,
    shutdown: Shutdown,
}

impl Instance {
    /// The gRPC API (`Admission`).
    fn api(
        &self,
        own_endpoint: String,
        hub: Arc<work::WorkerHub>,
        quotas: Arc<quota::Quotas>,
    ) -> Result<service::AdmissionApi, AdmissionServiceError> {
        let config = &self.config;
        Ok(service::AdmissionApi {
            config: config.clone(),
            registry: self.registry.clone(),
            pool: self.pool.clone(),
            own_endpoint,
            channels: Arc::default(),
            jobs_partitions: config.kafka.partitions.jobs,
            limits: LimitsClient::new(lazy_channel(&config.admission.limit_grant_endpoint)?),
            rates: RateLimitsClient::new(lazy_channel(&config.admission.rate_window_endpoint)?),
            hub,
            quotas,
            shutdown: self.shutdown.clone(),
        })
    }

    /// The job partitions (owned on `sluice.jobs`) and the request consumers
    /// that hand new jobs over to them.
    fn spawn_consumers(
        &self,
        supervisor: &mut Supervisor,
        runtime: OwnerRuntime<store::AdmissionStore>,
        routes: Arc<effects::Routes>,
        publisher: &Publisher,
        faults: &Faults,
    ) {
        let config = &self.config;
        let jobs_topic = config.topic(&config.topics.jobs);
        spawn_consumer(
            supervisor,
            "job partitions",
            config,
            ConsumerOptions {
                group: config.group(&format!("{}-jobs", config.admission.consumer_group)),
                topic: jobs_topic.clone(),
                channel_capacity: 10_000,
                track_end: false,
                readiness: self.readiness.clone(),
            },
            Arc::new(runtime),
            &self.shutdown,
        );
        spawn_request_consumers(
            supervisor,
            config,
            |topic, tenants| consumers::RequestConsumer {
                config: config.clone(),
                routes: routes.clone(),
                publisher: publisher.clone(),
                readiness: self.readiness.clone(),
                faults: faults.clone(),
                topic,
                tenants,
                jobs_topic: Arc::from(jobs_topic.as_str()),
                registry: self.registry.clone(),
            },
            &self.readiness,
            &self.shutdown,
        );
    }

    /// The tasks around the links and the worker streams: grants in, pushes
    /// written or not, paths changed, job partitions claimed; and the
    /// housekeeping (tenant quotas, expired idempotency keys).
    fn spawn_link_tasks(
        &self,
        supervisor: &mut Supervisor,
        links: AdmissionLinks,
        grants_receiver: tokio::sync::mpsc::Receiver<Downlink>,
        push_reports: work::PushReports,
        api: service::AdmissionApi,
        quotas: Arc<quota::Quotas>,
    ) {
        supervisor.spawn(
            "tenant quotas",
            quota::refresh(
                quotas,
                self.pool.clone(),
                self.config.admission.quota_refresh_interval.0,
                self.shutdown.clone(),
            ),
        );
        supervisor.spawn(
            "link grants",
            consumers::run_link_grants(
                self.registry.clone(),
                self.pool.clone(),
                self.config.kafka.partitions.jobs,
                grants_receiver,
                self.shutdown.clone(),
            ),
        );
        supervisor.spawn(
            "written pushes",
            work_stream::start_leases_at_the_push(self.registry.clone(), push_reports.written, self.shutdown.clone()),
        );
        supervisor.spawn(
            "undelivered pushes",
            work_stream::hand_back_undelivered(api, push_reports.undelivered, self.shutdown.clone()),
        );
        supervisor.spawn(
            "limit-grant path changes",
            resend_on_path_changes(
                Link::LimitGrant,
                links.limit.path_changes(),
                self.config.kafka.partitions.limit_commands,
                self.registry.clone(),
                self.shutdown.clone(),
            ),
        );
        supervisor.spawn(
            "rate-window path changes",
            resend_on_path_changes(
                Link::RateWindow,
                links.rate.path_changes(),
                self.config.kafka.partitions.rate_commands,
                self.registry.clone(),
                self.shutdown.clone(),
            ),
        );
        supervisor.spawn(
            "job partition claims",
            claim_job_partitions(links, self.registry.clone(), self.shutdown.clone()),
        );
        supervisor.spawn(
            "idempotency key cleanup",
            drop_expired_idempotency_keys(
                self.pool.clone(),
                self.config.admission.sweep_interval.0,
                self.shutdown.clone(),
            ),
        );
    }

    /// The gRPC server, the topic watch and readiness reporting.
    fn spawn_serving(
        &self,
        supervisor: &mut Supervisor,
        listener: TcpListener,
        grpc_routes: tonic::service::RoutesBuilder,
        tls: Option<Arc<sluice_common::tls::ServerTls>>,
        health: grpc::Health,
    ) {
        supervisor.spawn(
            "grpc server",
            grpc::serve(
                listener,
                grpc_routes,
                tls,
                grpc::ServerLimits::of(&self.config.process),
                self.shutdown.clone(),
            ),
        );
        supervisor.spawn(
            "topic watch",
            kafka::watch_topics(
                self.config.kafka.clone(),
                all_topics(&self.config),
                self.readiness.clone(),
                self.shutdown.clone(),
            ),
        );
        supervisor.spawn(
            "readiness",
            sluice_common::service::report_readiness(self.readiness.clone(), health, self.shutdown.clone()),
        );
    }
}

/// One link client per owner service, both handing the grants they receive
/// to the returned channel.
fn start_links(
    config: &SluiceConfig,
    client_id: &str,
    readiness: &Readiness,
    shutdown: &Shutdown,
) -> (AdmissionLinks, tokio::sync::mpsc::Receiver<Downlink>) {
    let (grants_sender, grants_receiver) = tokio::sync::mpsc::channel(1024);
    let links = AdmissionLinks {
        limit: LinkClient::start(
            LinkClientSettings {
                service: "limit-grant",
                seed_endpoint: config.admission.limit_grant_endpoint.clone(),
                client_id: client_id.to_string(),
            },
            grants_sender.clone(),
            readiness.clone(),
            shutdown.clone(),
        ),
        rate: LinkClient::start(
            LinkClientSettings {
                service: "rate-window",
                seed_endpoint: config.admission.rate_window_endpoint.clone(),
                client_id: client_id.to_string(),
            },
            grants_sender,
            readiness.clone(),
            shutdown.clone(),
        ),
    };
    (links, grants_receiver)
}

/// Consume the shared requested-jobs topic, and each tenant's own
/// (`topics.tenant_requested`), each in a consumer group of its own, with
/// the consumer `make` builds for a topic and the tenants it takes.
fn spawn_request_consumers(
    supervisor: &mut Supervisor,
    config: &Arc<SluiceConfig>,
    make: impl Fn(Arc<str>, consumers::TopicTenants) -> consumers::RequestConsumer,
    readiness: &Readiness,
    shutdown: &Shutdown,
) {
    let own_topics: Arc<std::collections::BTreeSet<String>> =
        Arc::new(config.topics.tenant_requested.iter().cloned().collect());
    let mut request_topics = vec![(
        config.topics.requested.clone(),
        consumers::TopicTenants::AllBut(own_topics),
        String::new(),
    )];
    for tenant in &config.topics.tenant_requested {
        request_topics.push((
            config.tenant_requested_topic(tenant),
            consumers::TopicTenants::Only(Arc::from(tenant.as_str())),
            format!("-{tenant}"),
        ));
    }
    for (topic, tenants, group_suffix) in request_topics {
        let requested_topic = config.topic(&topic);
        let factory = Arc::new(make(Arc::from(requested_topic.as_str()), tenants));
        let options = ConsumerOptions {
            group: config.group(&format!("{}-requests{group_suffix}", config.admission.consumer_group)),
            topic: requested_topic,
            channel_capacity: 10_000,
            track_end: false,
            readiness: readiness.clone(),
        };
        spawn_consumer(supervisor, "job request consumer", config, options, factory, shutdown);
    }
}

/// Run a partitioned consumer under the supervisor as task `name`.
fn spawn_consumer(
    supervisor: &mut Supervisor,
    name: &'static str,
    config: &Arc<SluiceConfig>,
    options: ConsumerOptions,
    factory: Arc<dyn kafka::PartitionTaskFactory>,
    shutdown: &Shutdown,
) {
    let config = config.clone();
    let shutdown = shutdown.clone();
    supervisor.spawn(name, async move {
        kafka::run_partitioned_consumer(
            &config.kafka,
            options,
            factory,
            Arc::new(ConsumerProgress::default()),
            shutdown,
        )
        .await
    });
}

/// Tell the owners, over every link, which job partitions' grants this
/// instance takes: those it owns, at their epochs. Follows ownership as it
/// changes.
async fn claim_job_partitions(
    links: AdmissionLinks,
    registry: Arc<OwnerRegistry<Local>>,
    shutdown: Shutdown,
) -> Result<(), std::convert::Infallible> {
    let mut claimed: Option<Vec<(i32, i64)>> = None;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tick.tick() => {}
        }
        let owned = registry.owned_with_epochs();
        if claimed.as_ref() == Some(&owned) {
            continue;
        }
        let claims: Vec<sluice_proto::v1::JobPartitionClaim> = owned
            .iter()
            .filter_map(|(partition, epoch)| {
                Some(sluice_proto::v1::JobPartitionClaim {
                    partition: u32::try_from(*partition).ok()?,
                    epoch: *epoch,
                })
            })
            .collect();
        links.limit.claim_job_partitions(claims.clone());
        links.rate.claim_job_partitions(claims);
        claimed = Some(owned);
    }
}

/// The shortest time between two re-sends a link's path changes ask of the
/// job partitions: a change is passed on at once, and those that follow
/// within this time together at its end (a link that breaks again and again
/// does not re-send every waiting job each time).
const PATH_RESEND_SPACING: Duration = Duration::from_secs(1);

/// Tell every job partition this instance owns when the path to some owner
/// partitions of `link`'s service changes (`LinkClient::path_changes`): each
/// sends again at once the acquires its jobs wait on there.
#[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
async fn resend_on_path_changes(
    link: Link,
    mut changes: tokio::sync::broadcast::Receiver<sluice_common::link::PathChange>,
    owner_partitions: i32,
    registry: Arc<OwnerRegistry<Local>>,
    shutdown: Shutdown,
) -> Result<(), std::convert::Infallible> {
    use tokio::sync::broadcast::error::{RecvError, TryRecvError};
    let every_partition = || (0..owner_partitions).collect::<std::collections::BTreeSet<i32>>();
    let mut last_sent: Option<tokio::time::Instant> = None;
    loop {
        let mut changed: std::collections::BTreeSet<i32> = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            received = changes.recv() => match received {
                Ok(partitions) => partitions.iter().copied().collect(),
                Err(RecvError::Lagged(_)) => every_partition(),
                Err(RecvError::Closed) => return Ok(()),
            },
        };
        if let Some(at) = last_sent {
            let until = at + PATH_RESEND_SPACING;
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep_until(until) => {}
            }
        }
        loop {
            match changes.try_recv() {
                Ok(partitions) => changed.extend(partitions.iter().copied()),
                Err(TryRecvError::Lagged(_)) => changed = every_partition(),
                Err(TryRecvError::Empty | TryRecvError::Closed) => break,
            }
        }
        last_sent = Some(tokio::time::Instant::now());
        let partitions: Vec<i32> = changed.into_iter().collect();
        tracing::debug!(?link, partitions = ?partitions, "owners' path changed: re-sending the acquires that wait on them");
        for job_partition in registry.owned() {
            let local = Local::PathChanged {
                link,
                partitions: partitions.clone(),
            };
            // A partition given up meanwhile: its new owner re-sends
            // everything at its takeover.
            let _ = registry.submit(job_partition, local).await;
        }
    }
}

/// Drop idempotency keys whose window has passed, a bounded number at a time.
#[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
async fn drop_expired_idempotency_keys(
    pool: sqlx::PgPool,
    interval: Duration,
    shutdown: Shutdown,
) -> Result<(), std::convert::Infallible> {
    let every = interval.max(Duration::from_secs(60));
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(every) => {}
        }
        let deleted = sqlx::query(
            "DELETE FROM idempotency_keys WHERE ctid IN
               (SELECT ctid FROM idempotency_keys WHERE expires_at_ms < $1 LIMIT 10000)",
        )
        .bind(wall_clock_ms())
        .execute(&pool)
        .await;
        if let Err(error) = deleted {
            tracing::warn!(%error, "idempotency key cleanup failed; trying again later");
        }
    }
}
