//! `sluice rate-limits put|list|delete`: stored rate-limit resources, which
//! jobs reference by `rate_limit_key`.

use serde::Serialize;
use sluice_proto::v1 as pb;

use crate::endpoints::Endpoints;
use crate::keys::TenantArg;
use crate::output::{Printable, Render, Table};

#[derive(Debug, clap::Subcommand)]
pub enum RateLimitsCommand {
    /// Create or update a stored rate limit in place: at most MAX_COUNT job
    /// starts per sliding WINDOW. A raised limit grants waiters at once.
    Put {
        #[command(flatten)]
        tenant: TenantArg,
        /// The resource key jobs name as `rate_limit_key`.
        key: String,
        #[arg(long)]
        max_count: i64,
        /// The sliding window, in whole seconds: 1s, 90s, 1h, 1d.
        #[arg(long, value_parser = parse_window_seconds)]
        window: i64,
    },
    /// The tenant's stored rate limits.
    List {
        #[command(flatten)]
        tenant: TenantArg,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[arg(long, default_value = "")]
        page_token: String,
    },
    /// Delete a stored rate limit; jobs waiting on it are released at once.
    Delete {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
    },
}

fn parse_window_seconds(text: &str) -> Result<i64, String> {
    let duration = sluice_common::config::parse_duration(text)?;
    if duration.subsec_nanos() != 0 || duration.as_secs() == 0 {
        return Err(format!("{text:?}: the window is whole seconds, at least 1s"));
    }
    i64::try_from(duration.as_secs()).map_err(|_| format!("{text:?} is too long"))
}

pub async fn run(endpoints: &Endpoints, command: RateLimitsCommand) -> anyhow::Result<Box<dyn Printable>> {
    let mut rates = endpoints.rates()?;
    match command {
        RateLimitsCommand::Put {
            tenant,
            key,
            max_count,
            window,
        } => {
            let response = rates
                .client
                .put_rate_limit(pb::PutRateLimitRequest {
                    resource: Some(pb::RateLimitResource {
                        tenant: tenant.tenant,
                        resource_key: key,
                        max_count,
                        window_seconds: window,
                    }),
                })
                .await
                .map_err(|status| rates.error(status))?
                .into_inner();
            Ok(Box::new(PutOut {
                created: response.created,
                rate_limit: response.resource.unwrap_or_default().into(),
            }))
        }
        RateLimitsCommand::List {
            tenant,
            limit,
            page_token,
        } => {
            let response = rates
                .client
                .list_rate_limits(pb::ListRateLimitsRequest {
                    tenant: tenant.tenant,
                    page_size: limit,
                    page_token,
                })
                .await
                .map_err(|status| rates.error(status))?
                .into_inner();
            Ok(Box::new(ListOut {
                rate_limits: response.resources.into_iter().map(RateLimitOut::from).collect(),
                next_page_token: (!response.next_page_token.is_empty()).then_some(response.next_page_token),
            }))
        }
        RateLimitsCommand::Delete { tenant, key } => {
            let response = rates
                .client
                .delete_rate_limit(pb::DeleteRateLimitRequest {
                    tenant: tenant.tenant.clone(),
                    resource_key: key.clone(),
                })
                .await
                .map_err(|status| rates.error(status))?
                .into_inner();
            Ok(Box::new(DeleteOut {
                tenant: tenant.tenant,
                resource_key: key,
                deleted: response.deleted,
                released_waiters: response.released_waiters,
            }))
        }
    }
}

#[derive(Debug, Serialize)]
pub struct RateLimitOut {
    pub tenant: String,
    pub resource_key: String,
    pub max_count: i64,
    pub window_seconds: i64,
}

impl From<pb::RateLimitResource> for RateLimitOut {
    fn from(resource: pb::RateLimitResource) -> Self {
        RateLimitOut {
            tenant: resource.tenant,
            resource_key: resource.resource_key,
            max_count: resource.max_count,
            window_seconds: resource.window_seconds,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct PutOut {
    pub created: bool,
    pub rate_limit: RateLimitOut,
}

impl Render for PutOut {
    fn table(&self) -> String {
        format!(
            "{} rate limit {} (tenant {}): {} per {}s\n",
            if self.created { "created" } else { "updated" },
            self.rate_limit.resource_key,
            self.rate_limit.tenant,
            self.rate_limit.max_count,
            self.rate_limit.window_seconds
        )
    }
}

#[derive(Debug, Serialize)]
pub struct ListOut {
    pub rate_limits: Vec<RateLimitOut>,
    pub next_page_token: Option<String>,
}

impl Render for ListOut {
    fn table(&self) -> String {
        let mut table = Table::new(&["TENANT", "KEY", "MAX COUNT", "WINDOW"]);
        for limit in &self.rate_limits {
            table.row(vec![
                limit.tenant.clone(),
                limit.resource_key.clone(),
                limit.max_count.to_string(),
                format!("{}s", limit.window_seconds),
            ]);
        }
        let mut out = if table.is_empty() {
            "no stored rate limits\n".to_string()
        } else {
            table.render(0)
        };
        if let Some(token) = &self.next_page_token {
            out.push_str(&format!("more: --page-token {token}\n"));
        }
        out
    }
}

#[derive(Debug, Serialize)]
pub struct DeleteOut {
    pub tenant: String,
    pub resource_key: String,
    pub deleted: bool,
    pub released_waiters: u32,
}

impl Render for DeleteOut {
    fn table(&self) -> String {
        if self.deleted {
            format!(
                "deleted rate limit {} (tenant {}); {} waiting jobs released\n",
                self.resource_key, self.tenant, self.released_waiters
            )
        } else {
            format!(
                "no rate limit {} (tenant {}): nothing deleted\n",
                self.resource_key, self.tenant
            )
        }
    }
}
