//! Arguments every service binary takes.

use std::path::PathBuf;

use crate::config::{ConfigError, SluiceConfig};

#[derive(Debug, clap::Parser)]
pub struct ServiceArgs {
    /// Configuration file (TOML), layered over the built-in defaults and
    /// under SLUICE__SECTION__KEY environment variables.
    #[arg(long, env = "SLUICE_CONFIG")]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    pub command: Option<ServiceCommand>,
}

#[derive(Clone, Copy, Debug, Default, clap::Subcommand)]
pub enum ServiceCommand {
    /// Run the service (the default).
    #[default]
    Run,
    /// Apply the service's database migrations and exit.
    Migrate,
}

impl ServiceArgs {
    pub fn load_config(&self) -> Result<SluiceConfig, ConfigError> {
        SluiceConfig::load(self.config.as_deref())
    }
}
