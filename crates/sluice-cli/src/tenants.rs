//! `sluice tenants list|quota`: per-tenant quotas (unfinished jobs at most,
//! new jobs per second at most), stored and applied at run time.

use serde::Serialize;
use sluice_proto::v1 as pb;

use crate::endpoints::Endpoints;
use crate::keys::TenantArg;
use crate::output::{or_dash, Printable, Render, Table};

#[derive(Debug, clap::Subcommand)]
pub enum TenantsCommand {
    /// Quotas of every tenant with an override (admin), or of one tenant,
    /// and the configured defaults.
    List {
        /// Only this tenant.
        #[arg(long, short = 't', env = "SLUICE_TENANT")]
        tenant: Option<String>,
    },
    /// Set or clear a tenant's quotas (admin).
    Quota {
        #[command(subcommand)]
        command: QuotaCommand,
    },
}

#[derive(Debug, clap::Subcommand)]
pub enum QuotaCommand {
    /// Store a tenant's quotas; a quota left out falls back to the
    /// configured default.
    Set {
        #[command(flatten)]
        tenant: TenantArg,
        /// Unfinished jobs (waiting, admitted or running) at most.
        #[arg(long)]
        max_waiting: Option<u64>,
        /// New jobs per second at most.
        #[arg(long)]
        max_enqueues_per_second: Option<f64>,
    },
    /// Delete a tenant's override: the defaults apply again.
    Clear {
        #[command(flatten)]
        tenant: TenantArg,
    },
}

pub async fn run(endpoints: &Endpoints, command: TenantsCommand) -> anyhow::Result<Box<dyn Printable>> {
    let mut admission = endpoints.admission()?;
    let request = match command {
        TenantsCommand::List { tenant } => {
            let response = admission
                .client
                .list_tenant_quotas(pb::ListTenantQuotasRequest {
                    tenant: tenant.unwrap_or_default(),
                })
                .await
                .map_err(|status| admission.error(status))?
                .into_inner();
            return Ok(Box::new(QuotasOut {
                quotas: response.quotas.into_iter().map(QuotaOut::from).collect(),
                defaults: response.defaults.map(QuotaOut::from),
            }));
        }
        TenantsCommand::Quota {
            command:
                QuotaCommand::Set {
                    tenant,
                    max_waiting,
                    max_enqueues_per_second,
                },
        } => {
            if max_waiting.is_none() && max_enqueues_per_second.is_none() {
                anyhow::bail!(
                    "name a quota: --max-waiting N and/or --max-enqueues-per-second R (`sluice tenants quota clear` \
                     removes the override)"
                );
            }
            pb::SetTenantQuotaRequest {
                tenant: tenant.tenant,
                max_waiting,
                max_enqueues_per_second,
                clear: false,
            }
        }
        TenantsCommand::Quota {
            command: QuotaCommand::Clear { tenant },
        } => pb::SetTenantQuotaRequest {
            tenant: tenant.tenant,
            clear: true,
            ..Default::default()
        },
    };
    let quota = admission
        .client
        .set_tenant_quota(request)
        .await
        .map_err(|status| admission.error(status))?
        .into_inner();
    Ok(Box::new(QuotaOut::from(quota)))
}

#[derive(Debug, Serialize)]
pub struct QuotaOut {
    pub tenant: String,
    /// Absent: unlimited.
    pub max_waiting: Option<u64>,
    pub max_enqueues_per_second: Option<f64>,
    pub overridden: bool,
}

impl From<pb::TenantQuota> for QuotaOut {
    fn from(quota: pb::TenantQuota) -> Self {
        QuotaOut {
            tenant: quota.tenant,
            max_waiting: quota.max_waiting,
            max_enqueues_per_second: quota.max_enqueues_per_second,
            overridden: quota.overridden,
        }
    }
}

fn limit<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "unlimited".to_string(), |value| value.to_string())
}

impl Render for QuotaOut {
    fn table(&self) -> String {
        format!(
            "tenant {}: max_waiting {}, max_enqueues_per_second {}{}\n",
            self.tenant,
            limit(self.max_waiting),
            limit(self.max_enqueues_per_second),
            if self.overridden { "" } else { " (the defaults)" }
        )
    }
}

#[derive(Debug, Serialize)]
pub struct QuotasOut {
    pub quotas: Vec<QuotaOut>,
    pub defaults: Option<QuotaOut>,
}

impl Render for QuotasOut {
    fn table(&self) -> String {
        let mut table = Table::new(&["TENANT", "MAX WAITING", "MAX ENQUEUES/S", "OVERRIDE"]);
        for quota in self.defaults.iter().chain(&self.quotas) {
            let tenant = if quota.tenant.is_empty() {
                "(default)".to_string()
            } else {
                quota.tenant.clone()
            };
            table.row(vec![
                tenant,
                limit(quota.max_waiting),
                limit(quota.max_enqueues_per_second),
                or_dash(quota.overridden.then_some("yes")),
            ]);
        }
        table.render(0)
    }
}
