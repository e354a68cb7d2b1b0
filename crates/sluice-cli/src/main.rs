//! `sluice`: run everything locally (`sluice dev`), set up topics, migrate,
//! and check health.

mod try_it;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use sluice_common::kafka::ensure_topics;
use sluice_common::service::{all_topics, Supervisor};
use sluice_common::{grpc, telemetry, Faults, Shutdown, SluiceConfig};

#[derive(Debug, Parser)]
#[command(name = "sluice", version, about = "Admission control for background jobs")]
struct Cli {
    /// Configuration file (TOML), layered over the built-in defaults and
    /// under SLUICE__SECTION__KEY environment variables.
    #[arg(long, global = true, env = "SLUICE_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run all four services in one process against the configured
    /// PostgreSQL and Kafka (what `make run` starts).
    Dev,
    /// Apply every service's database migrations and exit.
    Migrate,
    /// Kafka topics.
    Topics {
        #[command(subcommand)]
        command: TopicsCommand,
    },
    /// Enqueue jobs on one key and run them with a worker, showing the limit
    /// hold (an example against a running stack).
    Try {
        #[arg(long, default_value = "http://127.0.0.1:50051")]
        endpoint: String,
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
    /// Exit 0 when the gRPC health service at ENDPOINT reports SERVING.
    Health {
        #[arg(long, default_value = "http://127.0.0.1:50051")]
        endpoint: String,
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
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Health { endpoint, service } => health(&endpoint, &service).await,
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
            try_it::run(
                &config,
                try_it::TryOptions {
                    endpoint,
                    jobs,
                    limit,
                    key,
                    tenant,
                    hold,
                },
            )
            .await
        }
        Command::Dev => {
            let config = Arc::new(SluiceConfig::load(cli.config.as_deref())?);
            let telemetry = telemetry::init(&config.telemetry, "sluice-dev")?;
            dev(config, &telemetry).await
        }
        Command::Migrate => {
            let config = SluiceConfig::load(cli.config.as_deref())?;
            let _telemetry = telemetry::init(&config.telemetry, "sluice")?;
            sluice_admission::migrate(&config).await?;
            sluice_limit_grant::migrate(&config).await?;
            sluice_rate_window::migrate(&config).await?;
            sluice_refresh_dispatcher::migrate(&config).await?;
            println!("migrations applied");
            Ok(())
        }
        Command::Topics {
            command: TopicsCommand::Ensure,
        } => {
            let config = SluiceConfig::load(cli.config.as_deref())?;
            let _telemetry = telemetry::init(&config.telemetry, "sluice")?;
            let counts = ensure_topics(&config.kafka, &all_topics(&config), true).await?;
            let mut names: Vec<_> = counts.into_iter().collect();
            names.sort();
            for (name, partitions) in names {
                println!("{name}\t{partitions} partitions");
            }
            Ok(())
        }
    }
}

async fn health(endpoint: &str, service: &str) -> anyhow::Result<()> {
    use tonic_health::pb::health_client::HealthClient;
    use tonic_health::pb::HealthCheckRequest;
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .with_context(|| format!("bad endpoint {endpoint}"))?
        .connect_timeout(Duration::from_secs(3))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
        .with_context(|| format!("cannot connect to {endpoint}"))?;
    let response = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_string(),
        })
        .await
        .with_context(|| format!("health check of {endpoint} failed"))?
        .into_inner();
    let status = tonic_health::pb::health_check_response::ServingStatus::try_from(response.status)
        .map(|status| status.as_str_name().to_string())
        .unwrap_or_else(|_| response.status.to_string());
    println!("{endpoint}: {status}");
    if status != "SERVING" {
        anyhow::bail!("{endpoint} is {status}");
    }
    Ok(())
}

async fn dev(config: Arc<SluiceConfig>, telemetry: &telemetry::TelemetryGuard) -> anyhow::Result<()> {
    let shutdown = Shutdown::new();
    shutdown.trigger_on_signals();
    let metrics = telemetry::spawn_metrics_endpoint(&config.telemetry, telemetry, shutdown.clone()).await?;
    let admission = grpc::bind(&config.admission.listen).await?;
    let limit_grant = grpc::bind(&config.limit_grant.listen).await?;
    let rate_window = grpc::bind(&config.rate_window.listen).await?;
    let refresh_dispatcher = grpc::bind(&config.refresh_dispatcher.listen).await?;
    let addresses = [
        ("admission", admission.local_addr()?),
        ("limit-grant", limit_grant.local_addr()?),
        ("rate-window", rate_window.local_addr()?),
        ("refresh-dispatcher", refresh_dispatcher.local_addr()?),
    ];
    let faults = Faults::none();
    let mut supervisor = Supervisor::new(shutdown.clone());
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
    supervisor.spawn(
        "admission",
        sluice_admission::run(config.clone(), admission, shutdown.clone(), faults),
    );
    println!("sluice dev: all four services in one process");
    for (name, address) in addresses {
        println!("  {name:<20} grpc://{address}");
    }
    if let Some(metrics) = metrics {
        println!("  metrics              http://{metrics}/metrics");
    }
    println!("  kafka brokers        {}", config.kafka.brokers);
    println!("  job requests topic   {}", config.topic(&config.topics.requested));
    println!("press ctrl-c to stop");
    supervisor.wait().await.map_err(|error| anyhow::anyhow!(error))
}
