//! `sluice-console [--config FILE] [run]`: the web console on
//! `console.listen`, reading the services at `console.*_endpoint`.

use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use sluice_common::cli::{ServiceArgs, ServiceCommand};
use sluice_common::{telemetry, Shutdown};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = ServiceArgs::parse();
    let config = Arc::new(args.load_config()?);
    let telemetry_guard = telemetry::init(&config.telemetry, "sluice-console")?;
    config.warn_removed_settings();
    match args.command.unwrap_or_default() {
        // The console owns no tables: nothing to migrate.
        ServiceCommand::Migrate => Ok(()),
        ServiceCommand::Run => {
            let shutdown = Shutdown::new();
            shutdown.trigger_on_signals(config.process.drain_timeout.0);
            telemetry::spawn_metrics_endpoint(&config.telemetry, &telemetry_guard, shutdown.clone()).await?;
            let listener = tokio::net::TcpListener::bind(&config.console.listen)
                .await
                .with_context(|| format!("cannot bind console.listen {}", config.console.listen))?;
            println!("sluice console: http://{}/", listener.local_addr()?);
            sluice_console::run(config, listener, shutdown).await?;
            Ok(())
        }
    }
}
