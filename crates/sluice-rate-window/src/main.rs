//! `sluice-rate-window [--config FILE] [run|migrate]`

use std::sync::Arc;

use clap::Parser;
use sluice_common::cli::{ServiceArgs, ServiceCommand};
use sluice_common::{grpc, telemetry, Faults, Shutdown};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = ServiceArgs::parse();
    let config = Arc::new(args.load_config()?);
    let telemetry_guard = telemetry::init(&config.telemetry, "sluice-rate-window")?;
    config.warn_removed_settings();
    match args.command.unwrap_or_default() {
        ServiceCommand::Migrate => sluice_rate_window::migrate(&config).await?,
        ServiceCommand::Run => {
            let shutdown = Shutdown::new();
            shutdown.trigger_on_signals(config.process.drain_timeout.0);
            telemetry::spawn_metrics_endpoint(&config.telemetry, &telemetry_guard, shutdown.clone()).await?;
            let listener = grpc::bind(&config.rate_window.listen).await?;
            sluice_rate_window::run(config, listener, shutdown, Faults::none()).await?;
        }
    }
    Ok(())
}
