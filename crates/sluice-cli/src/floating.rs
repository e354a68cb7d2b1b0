//! `sluice floating describe|delete`: the refresh schedule of floating
//! concurrency keys, at their owner in the refresh-dispatcher.

use std::collections::BTreeMap;

use serde::Serialize;
use sluice_proto::v1 as pb;

use crate::endpoints::Endpoints;
use crate::keys::TenantArg;
use crate::output::{enum_word, fields, optional_time_ms, time_ms, Printable, Render};

#[derive(Debug, clap::Subcommand)]
pub enum FloatingCommand {
    /// A floating key's current max, last refresh, next due time, retries
    /// and the refresh task in flight.
    Describe {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
    },
    /// Forget a floating key's state (its schedule and its current max); the
    /// next job that uses the key creates it again from its default_max.
    Delete {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
    },
}

pub async fn run(endpoints: &Endpoints, command: FloatingCommand) -> anyhow::Result<Box<dyn Printable>> {
    let mut refresh = endpoints.refresh()?;
    match command {
        FloatingCommand::Describe { tenant, key } => {
            let response = refresh
                .client
                .describe_floating_limit(pb::DescribeFloatingLimitRequest {
                    key: Some(pb::KeyRef {
                        tenant: tenant.tenant,
                        key,
                    }),
                })
                .await
                .map_err(|status| refresh.error(status))?
                .into_inner();
            Ok(Box::new(FloatingOut::from(response)))
        }
        FloatingCommand::Delete { tenant, key } => {
            let response = refresh
                .client
                .delete_floating_limit(pb::DeleteFloatingLimitRequest {
                    key: Some(pb::KeyRef {
                        tenant: tenant.tenant.clone(),
                        key: key.clone(),
                    }),
                })
                .await
                .map_err(|status| refresh.error(status))?
                .into_inner();
            Ok(Box::new(DeleteOut {
                tenant: tenant.tenant,
                key,
                deleted: response.deleted,
            }))
        }
    }
}

#[derive(Debug, Serialize)]
pub struct LastRefreshOut {
    pub at_ms: i64,
    pub value: i64,
    pub outcome: String,
    pub error: String,
}

#[derive(Debug, Serialize)]
pub struct FloatingOut {
    pub tenant: String,
    pub key: String,
    pub current_max: u32,
    pub default_max: u32,
    pub refresh_interval_ms: u64,
    pub metadata: BTreeMap<String, String>,
    pub last_refresh: Option<LastRefreshOut>,
    pub next_refresh_due_at_ms: Option<i64>,
    pub retry_count: u32,
    pub last_error: String,
    pub in_flight_task_id: Option<String>,
    pub in_flight_deadline_ms: Option<i64>,
}

impl From<pb::DescribeFloatingLimitResponse> for FloatingOut {
    fn from(response: pb::DescribeFloatingLimitResponse) -> Self {
        let key = response.key.unwrap_or_default();
        FloatingOut {
            tenant: key.tenant,
            key: key.key,
            current_max: response.current_max,
            default_max: response.default_max,
            refresh_interval_ms: response.refresh_interval_ms,
            metadata: response.metadata.into_iter().collect(),
            last_refresh: response
                .last_refresh
                .filter(|last| last.at_ms > 0)
                .map(|last| LastRefreshOut {
                    at_ms: last.at_ms,
                    value: last.value,
                    outcome: pb::RefreshOutcome::try_from(last.outcome)
                        .map(|outcome| enum_word(outcome.as_str_name(), "REFRESH_OUTCOME_"))
                        .unwrap_or_else(|_| last.outcome.to_string()),
                    error: last.error,
                }),
            next_refresh_due_at_ms: response.next_refresh_due_at_ms,
            retry_count: response.retry_count,
            last_error: response.last_error,
            in_flight_task_id: (!response.in_flight_task_id.is_empty()).then_some(response.in_flight_task_id),
            in_flight_deadline_ms: response.in_flight_deadline_ms,
        }
    }
}

impl Render for FloatingOut {
    fn table(&self) -> String {
        let mut pairs = vec![
            ("key", format!("{} (tenant {})", self.key, self.tenant)),
            ("current max", self.current_max.to_string()),
            ("default max", self.default_max.to_string()),
            ("refresh every", format!("{} ms", self.refresh_interval_ms)),
            ("metadata", format!("{:?}", self.metadata)),
            (
                "last refresh",
                match &self.last_refresh {
                    None => "never".to_string(),
                    Some(last) if last.error.is_empty() => {
                        format!("{} -> {} at {}", last.outcome, last.value, time_ms(last.at_ms))
                    }
                    Some(last) => format!("{}: {} at {}", last.outcome, last.error, time_ms(last.at_ms)),
                },
            ),
            ("next due", optional_time_ms(self.next_refresh_due_at_ms)),
            ("retries", self.retry_count.to_string()),
        ];
        if !self.last_error.is_empty() {
            pairs.push(("last error", self.last_error.clone()));
        }
        if let Some(task) = &self.in_flight_task_id {
            pairs.push((
                "in flight",
                format!("task {task}, deadline {}", optional_time_ms(self.in_flight_deadline_ms)),
            ));
        }
        fields(&pairs)
    }
}

#[derive(Debug, Serialize)]
pub struct DeleteOut {
    pub tenant: String,
    pub key: String,
    pub deleted: bool,
}

impl Render for DeleteOut {
    fn table(&self) -> String {
        if self.deleted {
            format!("deleted floating state of {} (tenant {})\n", self.key, self.tenant)
        } else {
            format!(
                "no floating state for {} (tenant {}): nothing deleted\n",
                self.key, self.tenant
            )
        }
    }
}
