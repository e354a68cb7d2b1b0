//! `sluice`: run everything locally (`sluice dev`), set up topics, migrate,
//! check health, inspect and steer a running stack (jobs, keys, rate limits,
//! floating limits), and watch a live demo.

mod demo;
mod endpoints;
mod floating;
mod jobs;
mod keys;
mod output;
mod rate_limits;
mod tenants;
mod try_it;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use serde::Serialize;
use sluice_common::kafka::ensure_topics;
use sluice_common::service::{all_topics, Supervisor};
use sluice_common::{grpc, telemetry, Faults, Shutdown, SluiceConfig};

use crate::endpoints::Endpoints;
use crate::output::{OutputFormat, Printable, Render, RpcError, Table};

#[derive(Debug, Parser)]
#[command(name = "sluice", version, about = "Admission control for background jobs")]
struct Cli {
    /// Configuration file (TOML), layered over the built-in defaults and
    /// under SLUICE__SECTION__KEY environment variables. Used by dev,
    /// migrate, topics, try and demo (brokers, topic prefix, database).
    #[arg(long, global = true, env = "SLUICE_CONFIG")]
    config: Option<PathBuf>,
    /// Output format: human-readable tables, or JSON for scripts.
    #[arg(
        long,
        short = 'o',
        global = true,
        value_enum,
        default_value = "table",
        env = "SLUICE_OUTPUT"
    )]
    output: OutputFormat,
    #[command(flatten)]
    endpoints: Endpoints,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run all four services in one process against the configured
    /// PostgreSQL and Kafka (what `make run` starts). Authentication is off
    /// in dev, so every listener binds to loopback (127.0.0.1 / ::1), even
    /// one configured on all interfaces, unless `--expose`.
    Dev {
        /// Keep listeners configured on all interfaces (0.0.0.0 / [::]):
        /// anyone who can reach them can act on every tenant.
        #[arg(long)]
        expose: bool,
    },
    /// Apply every service's database migrations and exit.
    Migrate,
    /// Kafka topics.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// Jobs: status and why they wait; cancel.
    Jobs {
        #[command(subcommand)]
        command: jobs::JobsCommand,
    },
    /// Concurrency and floating keys: list, describe, override, pause, resume.
    Keys {
        #[command(subcommand)]
        command: keys::KeysCommand,
    },
    /// Stored rate limits (referenced by jobs as rate_limit_key).
    RateLimits {
        #[command(subcommand)]
        command: rate_limits::RateLimitsCommand,
    },
    /// Per-tenant quotas: list; set or clear (admin).
    Tenants {
        #[command(subcommand)]
        command: tenants::TenantsCommand,
    },
    /// Floating concurrency limits: refresh state; delete.
    Floating {
        #[command(subcommand)]
        command: floating::FloatingCommand,
    },
    /// Enqueue jobs on one key and run them with a worker, showing the limit
    /// hold (an example against a running stack).
    Try {
        /// Admission endpoint (default: --admission).
        #[arg(long)]
        endpoint: Option<String>,
        #[arg(long, default_value_t = 30)]
        jobs: usize,
        #[arg(long, default_value_t = 2)]
        limit: u32,
        #[arg(long, default_value = "try-key")]
        key: String,
        #[arg(long, default_value = "demo")]
        tenant: String,
        /// How long the worker holds each job, e.g. 300ms.
        #[arg(long, default_value = "300ms")]
        hold: String,
    },
    /// Run producers and workers against a running stack and watch each key
    /// live: holders against max, waiting jobs, admitted per second.
    Demo(demo::DemoArgs),
    /// Check the services' gRPC health: all four, or one --endpoint. Exits
    /// non-zero unless every one checked is SERVING.
    Health {
        /// Check only this endpoint.
        #[arg(long)]
        endpoint: Option<String>,
        /// Check one named service instead of the whole server.
        #[arg(long, default_value = "")]
        service: String,
    },
}

#[derive(Debug, Subcommand)]
enum TopicsCommand {
    /// Create missing topics; refuse an internal topic whose partition count
    /// differs from the configuration (that would move keys between owners).
    Ensure,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let format = cli.output;
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            output::print_error(format, &error);
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    cli.endpoints.configure_clients()?;
    let format = cli.output;
    let printable: Box<dyn Printable> = match cli.command {
        Command::Jobs { command } => jobs::run(&cli.endpoints, command).await?,
        Command::Keys { command } => keys::run(&cli.endpoints, command).await?,
        Command::RateLimits { command } => rate_limits::run(&cli.endpoints, command).await?,
        Command::Tenants { command } => tenants::run(&cli.endpoints, command).await?,
        Command::Floating { command } => floating::run(&cli.endpoints, command).await?,
        Command::Health { endpoint, service } => {
            let checks: Vec<(&'static str, String)> = match endpoint {
                Some(endpoint) => vec![("", endpoints::normalized(&endpoint))],
                None => cli.endpoints.all().to_vec(),
            };
            return check_health(checks, &service, format).await;
        }
        Command::Try {
            endpoint,
            jobs,
            limit,
            key,
            tenant,
            hold,
        } => {
            let config = SluiceConfig::load(cli.config.as_deref())?;
            let hold =
                sluice_common::config::parse_duration(&hold).map_err(|message| anyhow::anyhow!("--hold: {message}"))?;
            return try_it::run(
                &config,
                try_it::TryOptions {
                    endpoint: endpoints::normalized(&endpoint.unwrap_or(cli.endpoints.admission)),
                    jobs,
                    limit,
                    key,
                    tenant,
                    hold,
                },
            )
            .await;
        }
        Command::Demo(args) => {
            let config = SluiceConfig::load(cli.config.as_deref())?;
            return demo::run(&config, &cli.endpoints, args, format).await;
        }
        Command::Dev { expose } => return run_dev(cli.config.as_deref(), expose).await,
        Command::Migrate => Box::new(migrate(cli.config.as_deref()).await?),
        Command::Topics {
            command: TopicsCommand::Ensure,
        } => Box::new(ensure_all_topics(cli.config.as_deref()).await?),
    };
    output::print(format, printable.as_ref())
}

/// `sluice health`: prints each service's status; an error when one is not serving.
async fn check_health(checks: Vec<(&'static str, String)>, service: &str, format: OutputFormat) -> anyhow::Result<()> {
    let report = health(checks, service).await;
    output::print(format, &report)?;
    let failing: Vec<String> = report
        .services
        .iter()
        .filter(|check| check.status != "SERVING")
        .map(|check| format!("{} is {}", check.endpoint, check.status))
        .collect();
    anyhow::ensure!(failing.is_empty(), "not serving: {}", failing.join(", "));
    Ok(())
}

/// `sluice dev`: all four services in this process, on loopback unless `expose`.
async fn run_dev(config_path: Option<&Path>, expose: bool) -> anyhow::Result<()> {
    let mut config = SluiceConfig::load_dev(config_path)?;
    let moved = if expose { Vec::new() } else { loopback_only(&mut config) };
    let config = Arc::new(config);
    let telemetry = telemetry::init(&config.telemetry, "sluice-dev")?;
    config.warn_removed_settings();
    if !moved.is_empty() {
        let moved: Vec<String> = moved
            .iter()
            .map(|(setting, configured, bound)| format!("{setting} {configured} -> {bound}"))
            .collect();
        tracing::info!(
            moved = %moved.join(", "),
            "sluice dev binds to loopback: authentication is off (--expose keeps all interfaces)"
        );
    }
    if expose {
        tracing::warn!("sluice dev --expose: authentication is off and listeners on all interfaces stay there; anyone who can reach them can act on every tenant");
    }
    dev(config, &telemetry).await
}

/// `sluice migrate`: every service's schema.
async fn migrate(config_path: Option<&Path>) -> anyhow::Result<Migrated> {
    let config = SluiceConfig::load(config_path)?;
    let _telemetry = telemetry::init_for_command(&config.telemetry, "sluice")?;
    config.warn_removed_settings();
    sluice_admission::migrate(&config).await?;
    sluice_limit_grant::migrate(&config).await?;
    sluice_rate_window::migrate(&config).await?;
    sluice_refresh_dispatcher::migrate(&config).await?;
    Ok(Migrated {
        schemas: ["admission", "limit_grant", "rate_window", "refresh_dispatcher"]
            .iter()
            .map(|service| config.schema(service))
            .collect(),
    })
}

/// `sluice topics ensure`: creates the topics that are missing.
async fn ensure_all_topics(config_path: Option<&Path>) -> anyhow::Result<Topics> {
    let config = SluiceConfig::load(config_path)?;
    let _telemetry = telemetry::init_for_command(&config.telemetry, "sluice")?;
    config.warn_removed_settings();
    let counts = ensure_topics(&config.kafka, &all_topics(&config), true).await?;
    let mut topics: Vec<TopicOut> = counts
        .into_iter()
        .map(|(name, partitions)| TopicOut { name, partitions })
        .collect();
    topics.sort_by(|left, right| left.name.cmp(&right.name));
    Ok(Topics { topics })
}

#[derive(Debug, Serialize)]
struct Migrated {
    schemas: Vec<String>,
}

impl Render for Migrated {
    fn table(&self) -> String {
        format!("migrations applied: {}\n", self.schemas.join(", "))
    }
}

#[derive(Debug, Serialize)]
struct TopicOut {
    name: String,
    partitions: i32,
}

#[derive(Debug, Serialize)]
struct Topics {
    topics: Vec<TopicOut>,
}

impl Render for Topics {
    fn table(&self) -> String {
        let mut table = Table::new(&["TOPIC", "PARTITIONS"]);
        for topic in &self.topics {
            table.row(vec![topic.name.clone(), topic.partitions.to_string()]);
        }
        table.render(0)
    }
}

#[derive(Debug, Serialize)]
struct HealthCheck {
    service: String,
    endpoint: String,
    /// SERVING, NOT_SERVING, ... or UNREACHABLE.
    status: String,
    error: Option<String>,
}

#[derive(Debug, Serialize)]
struct HealthReport {
    services: Vec<HealthCheck>,
}

impl Render for HealthReport {
    fn table(&self) -> String {
        let mut table = Table::new(&["SERVICE", "ENDPOINT", "STATUS"]);
        for check in &self.services {
            let status = match &check.error {
                Some(error) => format!("{} ({error})", check.status),
                None => check.status.clone(),
            };
            table.row(vec![
                if check.service.is_empty() {
                    "-".to_string()
                } else {
                    check.service.clone()
                },
                check.endpoint.clone(),
                status,
            ]);
        }
        table.render(0)
    }
}

async fn health(checks: Vec<(&'static str, String)>, service: &str) -> HealthReport {
    use tonic_health::pb::health_check_response::ServingStatus;
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let mut services = Vec::with_capacity(checks.len());
    for (name, endpoint) in checks {
        let answer = match endpoints::channel(&endpoint) {
            Ok(channel) => HealthClient::new(channel)
                .check(HealthCheckRequest {
                    service: service.to_string(),
                })
                .await
                .map_err(|status| RpcError::new("health", &endpoint, status).to_string()),
            Err(error) => Err(format!("{error:#}")),
        };
        let (status, error) = match answer {
            Ok(response) => (
                ServingStatus::try_from(response.into_inner().status)
                    .map(|status| status.as_str_name().to_string())
                    .unwrap_or_else(|_| "UNKNOWN".to_string()),
                None,
            ),
            Err(error) => ("UNREACHABLE".to_string(), Some(error)),
        };
        services.push(HealthCheck {
            service: name.to_string(),
            endpoint,
            status,
            error,
        });
    }
    HealthReport { services }
}

/// `http://` and the address, with 127.0.0.1 for a listener on every interface.
fn local_endpoint(address: std::net::SocketAddr) -> String {
    if address.ip().is_unspecified() {
        format!("http://127.0.0.1:{}", address.port())
    } else {
        format!("http://{address}")
    }
}

/// The loopback address for a listen address on all interfaces (0.0.0.0,
/// [::]); `None` for any other (a named host, a specific IP, empty).
fn loopback_for(address: &str) -> Option<String> {
    let parsed: std::net::SocketAddr = address.parse().ok()?;
    if !parsed.ip().is_unspecified() {
        return None;
    }
    let loopback = match parsed {
        std::net::SocketAddr::V4(_) => std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        std::net::SocketAddr::V6(_) => std::net::IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
    };
    Some(std::net::SocketAddr::new(loopback, parsed.port()).to_string())
}

/// `sluice dev` has no authentication: move every listener configured on all
/// interfaces to loopback. Returns (setting, configured, now bound) for each
/// one moved.
fn loopback_only(config: &mut SluiceConfig) -> Vec<(&'static str, String, String)> {
    let mut moved = Vec::new();
    let listeners: [(&'static str, &mut String); 6] = [
        ("admission.listen", &mut config.admission.listen),
        ("limit_grant.listen", &mut config.limit_grant.listen),
        ("rate_window.listen", &mut config.rate_window.listen),
        ("refresh_dispatcher.listen", &mut config.refresh_dispatcher.listen),
        ("console.listen", &mut config.console.listen),
        ("telemetry.metrics_listen", &mut config.telemetry.metrics_listen),
    ];
    for (setting, address) in listeners {
        if let Some(loopback) = loopback_for(address) {
            moved.push((setting, std::mem::replace(address, loopback.clone()), loopback));
        }
    }
    moved
}

async fn dev(config: Arc<SluiceConfig>, telemetry: &telemetry::TelemetryGuard) -> anyhow::Result<()> {
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals(config.process.drain_timeout.0);
    let metrics = telemetry::spawn_metrics_endpoint(&config.telemetry, telemetry, shutdown.clone()).await?;
    let admission = grpc::bind(&config.admission.listen).await?;
    let limit_grant = grpc::bind(&config.limit_grant.listen).await?;
    let rate_window = grpc::bind(&config.rate_window.listen).await?;
    let refresh_dispatcher = grpc::bind(&config.refresh_dispatcher.listen).await?;
    let console = grpc::bind(&config.console.listen).await?;
    let console_address = console.local_addr()?;
    let addresses = [
        ("admission", admission.local_addr()?),
        ("limit-grant", limit_grant.local_addr()?),
        ("rate-window", rate_window.local_addr()?),
        ("refresh-dispatcher", refresh_dispatcher.local_addr()?),
    ];
    let faults = Faults::none();
    let mut supervisor = Supervisor::new(shutdown.clone(), config.process.drain_timeout.0);
    supervisor.spawn(
        "limit-grant",
        sluice_limit_grant::run(config.clone(), limit_grant, shutdown.clone(), faults.clone()),
    );
    supervisor.spawn(
        "rate-window",
        sluice_rate_window::run(config.clone(), rate_window, shutdown.clone(), faults.clone()),
    );
    supervisor.spawn(
        "refresh-dispatcher",
        sluice_refresh_dispatcher::run(config.clone(), refresh_dispatcher, shutdown.clone(), faults.clone()),
    );
    // Admission reaches limit-grant and rate-window where they listen in this
    // process (a port of 0 picks one).
    let mut admission_config = (*config).clone();
    admission_config.admission.limit_grant_endpoint = format!("http://{}", addresses[1].1);
    admission_config.admission.rate_window_endpoint = format!("http://{}", addresses[2].1);
    supervisor.spawn(
        "admission",
        sluice_admission::run(Arc::new(admission_config), admission, shutdown.clone(), faults),
    );
    // The console reads the services where they listen in this process.
    let mut console_config = (*config).clone();
    console_config.console.admission_endpoint = local_endpoint(addresses[0].1);
    console_config.console.limit_grant_endpoint = local_endpoint(addresses[1].1);
    console_config.console.rate_window_endpoint = local_endpoint(addresses[2].1);
    console_config.console.refresh_dispatcher_endpoint = local_endpoint(addresses[3].1);
    supervisor.spawn(
        "console",
        sluice_console::run(Arc::new(console_config), console, shutdown.clone()),
    );
    // The endpoints come last, once every partition is owned, so the
    // startup's log lines do not scroll them away. A service that fails
    // meanwhile ends the wait: the supervisor reports it.
    let listening = DevAddresses {
        services: addresses,
        console: console_address,
        metrics,
    };
    let supervised = supervisor.wait();
    tokio::pin!(supervised);
    tokio::select! {
        outcome = &mut supervised => return outcome.map_err(|error| anyhow::anyhow!(error)),
        still_missing = wait_until_owned(&config, &shutdown) => {
            if !shutdown.is_triggered() {
                print_endpoints(&config, &listening, &still_missing);
            }
        }
    }
    supervised.await.map_err(|error| anyhow::anyhow!(error))
}

/// Where `sluice dev` listens.
struct DevAddresses {
    services: [(&'static str, std::net::SocketAddr); 4],
    console: std::net::SocketAddr,
    metrics: Option<std::net::SocketAddr>,
}

fn print_endpoints(config: &SluiceConfig, endpoints: &DevAddresses, still_missing: &[String]) {
    println!("sluice dev: all four services in one process; authentication is off (dev only)");
    for (name, address) in endpoints.services {
        println!("  {name:<20} grpc://{address}");
    }
    println!("  console              http://{}/", endpoints.console);
    if let Some(metrics) = endpoints.metrics {
        println!("  metrics              http://{metrics}/metrics");
    }
    println!("  kafka brokers        {}", config.kafka.brokers);
    println!("  job requests topic   {}", config.topic(&config.topics.requested));
    if !still_missing.is_empty() {
        println!(
            "  still taking over    {} (another member of the consumer group may hold the rest)",
            still_missing.join(", ")
        );
    }
    let program = std::env::current_exe().map_or_else(|_| "sluice".to_string(), |path| path.display().to_string());
    println!("try it from another terminal (30 jobs on one key limited to 2 at a time):");
    println!("  {program} try --jobs 30 --limit 2");
    println!("press ctrl-c to stop");
}

/// How long `sluice dev` waits for its partitions before it prints its
/// endpoints anyway.
const OWNED_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Waits until this process owns every partition of each owner service (in
/// `sluice dev` one instance owns them all), for at most `OWNED_WAIT` or
/// until the shutdown; returns the services still short of theirs.
async fn wait_until_owned(config: &SluiceConfig, shutdown: &Shutdown) -> Vec<String> {
    let counts = &config.kafka.partitions;
    let expected = [
        (sluice_admission::SERVICE, counts.jobs),
        (sluice_limit_grant::SERVICE, counts.limit_commands),
        (sluice_rate_window::SERVICE, counts.rate_commands),
        (sluice_refresh_dispatcher::SERVICE, counts.refresh_due),
    ];
    let missing = |owned: &std::collections::BTreeMap<&'static str, i64>| -> Vec<String> {
        expected
            .iter()
            .filter_map(|(service, count)| {
                let have = owned.get(service).copied().unwrap_or_default();
                (have < i64::from(*count)).then(|| format!("{service} {have}/{count}"))
            })
            .collect()
    };
    let mut owned = sluice_common::metrics::metrics().watch_owned_partitions();
    let deadline = tokio::time::sleep(OWNED_WAIT);
    tokio::pin!(deadline);
    loop {
        let now_missing = missing(&owned.borrow_and_update());
        if now_missing.is_empty() {
            return now_missing;
        }
        tokio::select! {
            changed = owned.changed() => if changed.is_err() { return now_missing },
            () = &mut deadline => return now_missing,
            () = shutdown.cancelled() => return now_missing,
        }
    }
}

#[cfg(test)]
mod dev_tests {
    use super::loopback_for;

    #[test]
    fn only_listeners_on_all_interfaces_move_to_loopback() {
        assert_eq!(loopback_for("0.0.0.0:50051").as_deref(), Some("127.0.0.1:50051"));
        assert_eq!(loopback_for("[::]:9090").as_deref(), Some("[::1]:9090"));
        assert_eq!(loopback_for("127.0.0.1:0"), None);
        assert_eq!(loopback_for("10.1.2.3:50051"), None);
        assert_eq!(loopback_for("sluice.internal:50051"), None);
        assert_eq!(loopback_for(""), None);
    }
}
