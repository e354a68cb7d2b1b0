//! `sluice jobs get|cancel`.

use serde::Serialize;
use serde_json::json;
use sluice_proto::v1 as pb;

use crate::endpoints::Endpoints;
use crate::output::{enum_word, fields, time_ms, Printable, Render, Table};

#[derive(Debug, clap::Subcommand)]
pub enum JobsCommand {
    /// A job's status, limits, acquisition order and step, why it waits
    /// (key, holders against max, place in the queue), and its history.
    Get { job_id: String },
    /// Cancel a job. A job not running ends at once; a running job ends when
    /// its worker confirms (it learns by heartbeat) or its lease expires.
    Cancel {
        job_id: String,
        /// Recorded in the job's history.
        #[arg(long, default_value = "")]
        reason: String,
    },
}

pub async fn run(endpoints: &Endpoints, command: JobsCommand) -> anyhow::Result<Box<dyn Printable>> {
    let mut admission = endpoints.admission()?;
    match command {
        JobsCommand::Get { job_id } => {
            let response = admission
                .client
                .get_job(pb::GetJobRequest { job_id })
                .await
                .map_err(|status| admission.error(status))?
                .into_inner();
            Ok(Box::new(JobOut::from(response.job.unwrap_or_default())))
        }
        JobsCommand::Cancel { job_id, reason } => {
            let response = admission
                .client
                .cancel_job(pb::CancelJobRequest {
                    job_id: job_id.clone(),
                    reason,
                })
                .await
                .map_err(|status| admission.error(status))?
                .into_inner();
            Ok(Box::new(CancelOut {
                job_id,
                status: status_word(response.status),
            }))
        }
    }
}

pub fn status_word(status: i32) -> String {
    pb::JobStatus::try_from(status)
        .map(|status| enum_word(status.as_str_name(), "JOB_STATUS_"))
        .unwrap_or_else(|_| status.to_string())
}

pub fn kind_word(kind: i32) -> String {
    pb::LimitKind::try_from(kind)
        .map(|kind| enum_word(kind.as_str_name(), "LIMIT_KIND_"))
        .unwrap_or_else(|_| kind.to_string())
}

/// A limit in the JSON form producers write (docs/job-request.schema.json).
pub fn limit_json(limit: &pb::Limit) -> serde_json::Value {
    match &limit.kind {
        Some(pb::limit::Kind::Concurrency(concurrency)) if concurrency.shadow => json!({
            "concurrency": {"key": concurrency.key, "max_concurrency": concurrency.max_concurrency, "shadow": true}
        }),
        Some(pb::limit::Kind::Concurrency(concurrency)) => json!({
            "concurrency": {"key": concurrency.key, "max_concurrency": concurrency.max_concurrency}
        }),
        Some(pb::limit::Kind::Adaptive(adaptive)) => json!({
            "adaptive": {
                "key": adaptive.key,
                "min": adaptive.min,
                "max": adaptive.max,
                "initial": adaptive.initial,
                "target_latency_ms": adaptive.target_latency_ms,
                "max_error_ratio": adaptive.max_error_ratio,
                "smoothing": adaptive.smoothing,
            }
        }),
        Some(pb::limit::Kind::Floating(floating)) => json!({
            "floating": {
                "key": floating.key,
                "default_max": floating.default_max,
                "refresh_interval_ms": floating.refresh_interval_ms,
                "metadata": floating.metadata,
            }
        }),
        Some(pb::limit::Kind::Rate(rate)) => match &rate.spec {
            Some(pb::rate_limit::Spec::Inline(inline)) => json!({
                "rate": {"inline": {
                    "name": inline.name,
                    "unique_key": inline.unique_key,
                    "limit": inline.limit,
                    "duration_ms": inline.duration_ms,
                    "cost": inline.cost,
                }}
            }),
            Some(pb::rate_limit::Spec::RateLimitKey(key)) => json!({"rate": {"rate_limit_key": key}}),
            None => json!({"rate": {}}),
        },
        None => json!({}),
    }
}

#[derive(Debug, Serialize)]
pub struct StepOut {
    pub tenant: String,
    pub key: String,
    pub kind: String,
    pub max: i64,
    pub origin: String,
    pub window_ms: Option<i64>,
    pub cost: Option<i64>,
}

#[derive(Debug, Serialize)]
pub struct WaitOut {
    pub tenant: String,
    pub key: String,
    pub kind: String,
    pub holders: u32,
    pub max: i64,
    pub overridden: bool,
    pub paused: bool,
    pub position: u32,
    pub waiting: u32,
    pub retry_at_ms: Option<i64>,
    pub waiting_since_ms: i64,
}

#[derive(Debug, Serialize)]
pub struct HistoryOut {
    pub attempt: u32,
    pub outcome: String,
    pub detail: String,
    pub at_ms: i64,
}

#[derive(Debug, Serialize)]
pub struct JobOut {
    pub job_id: String,
    pub tenant: String,
    pub task_group: String,
    pub status: String,
    pub priority: u32,
    pub attempt: u32,
    pub max_attempts: u32,
    pub reason: String,
    pub last_error: String,
    pub limits: Vec<serde_json::Value>,
    pub acquisition_order: Vec<StepOut>,
    pub step: u32,
    pub waiting: Option<WaitOut>,
    pub enqueued_at_ms: i64,
    pub run_at_ms: Option<i64>,
    pub admitted_at_ms: Option<i64>,
    pub claimed_by: Option<String>,
    pub lease_expires_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub idempotency_key: Option<String>,
    pub fairness_key: Option<String>,
    pub history: Vec<HistoryOut>,
}

fn non_empty(text: String) -> Option<String> {
    if text.is_empty() {
        None
    } else {
        Some(text)
    }
}

impl From<pb::JobView> for JobOut {
    fn from(view: pb::JobView) -> Self {
        JobOut {
            status: status_word(view.status),
            limits: view.listed_limits.iter().map(limit_json).collect(),
            acquisition_order: view
                .acquisition_order
                .iter()
                .map(|step| {
                    let is_rate = step.kind == pb::LimitKind::Rate as i32;
                    StepOut {
                        tenant: step.tenant.clone(),
                        key: step.key.clone(),
                        kind: kind_word(step.kind),
                        max: step.max,
                        origin: step.origin.clone(),
                        window_ms: is_rate.then_some(step.window_ms),
                        cost: is_rate.then_some(step.cost),
                    }
                })
                .collect(),
            waiting: view.waiting.map(|wait| WaitOut {
                kind: kind_word(wait.kind),
                tenant: wait.tenant,
                key: wait.key,
                holders: wait.holders,
                max: wait.max,
                overridden: wait.overridden,
                paused: wait.paused,
                position: wait.position,
                waiting: wait.waiting,
                retry_at_ms: wait.retry_at_ms,
                waiting_since_ms: wait.waiting_since_ms,
            }),
            history: view
                .history
                .into_iter()
                .map(|record| HistoryOut {
                    attempt: record.attempt,
                    outcome: record.outcome,
                    detail: record.detail,
                    at_ms: record.at_ms,
                })
                .collect(),
            job_id: view.job_id,
            tenant: view.tenant,
            task_group: view.task_group,
            priority: view.priority,
            attempt: view.attempt,
            max_attempts: view.max_attempts,
            reason: view.reason,
            last_error: view.last_error,
            step: view.step,
            enqueued_at_ms: view.enqueued_at_ms,
            run_at_ms: view.run_at_ms,
            admitted_at_ms: view.admitted_at_ms,
            claimed_by: non_empty(view.claimed_by),
            lease_expires_at_ms: view.lease_expires_at_ms,
            finished_at_ms: view.finished_at_ms,
            idempotency_key: non_empty(view.idempotency_key),
            fairness_key: non_empty(view.fairness_key),
        }
    }
}

impl Render for JobOut {
    fn table(&self) -> String {
        let steps = self.acquisition_order.len();
        let mut pairs = vec![
            ("job", self.job_id.clone()),
            ("status", self.status.clone()),
            ("reason", self.reason.clone()),
            ("tenant", self.tenant.clone()),
            ("task group", self.task_group.clone()),
            ("priority", self.priority.to_string()),
            ("attempt", format!("{} of {}", self.attempt, self.max_attempts)),
            ("enqueued", time_ms(self.enqueued_at_ms)),
        ];
        let holds_every_limit = matches!(self.status.as_str(), "admitted" | "running" | "cancelling");
        if self.status == "waiting" {
            pairs.push(("step", format!("{} of {steps}", self.step + 1)));
        } else if holds_every_limit {
            pairs.push(("step", format!("{steps} of {steps} (every limit held)")));
        }
        if let Some(run_at) = self.run_at_ms {
            pairs.push(("run at", time_ms(run_at)));
        }
        if let Some(admitted) = self.admitted_at_ms {
            pairs.push(("admitted", time_ms(admitted)));
        }
        if let Some(worker) = &self.claimed_by {
            pairs.push(("claimed by", worker.clone()));
        }
        if let Some(lease) = self.lease_expires_at_ms {
            pairs.push(("lease until", time_ms(lease)));
        }
        if let Some(finished) = self.finished_at_ms {
            pairs.push(("finished", time_ms(finished)));
        }
        if !self.last_error.is_empty() {
            pairs.push(("last error", self.last_error.clone()));
        }
        if let Some(key) = &self.idempotency_key {
            pairs.push(("idempotency key", key.clone()));
        }
        if let Some(wait) = &self.waiting {
            pairs.push(("waiting since", time_ms(wait.waiting_since_ms)));
            if let Some(retry_at) = wait.retry_at_ms {
                pairs.push(("slot opens", time_ms(retry_at)));
            }
        }
        let mut out = fields(&pairs);
        self.push_acquisition_order(&mut out);
        if !self.history.is_empty() {
            self.push_history(&mut out);
        }
        out
    }
}

impl JobOut {
    /// The job's limits in the order it acquires them, each with its state.
    fn push_acquisition_order(&self, out: &mut String) {
        let mut order = Table::new(&["STEP", "KIND", "TENANT", "KEY", "MAX", "ORIGIN", "STATE"]);
        for (index, step) in self.acquisition_order.iter().enumerate() {
            let index_u32 = u32::try_from(index).unwrap_or(u32::MAX);
            let state = match self.status.as_str() {
                "waiting" if index_u32 < self.step => "held",
                "waiting" if index_u32 == self.step => "acquiring",
                "admitted" | "running" | "cancelling" => "held",
                _ => "-",
            };
            let max = match (step.window_ms, step.cost) {
                (Some(window), Some(cost)) => format!("{}/{}ms (cost {cost})", step.max, window),
                _ => step.max.to_string(),
            };
            order.row(vec![
                (index + 1).to_string(),
                step.kind.clone(),
                step.tenant.clone(),
                step.key.clone(),
                max,
                step.origin.clone(),
                state.to_string(),
            ]);
        }
        out.push_str("\nacquisition order\n");
        if order.is_empty() {
            out.push_str("  (no limits)\n");
        } else {
            out.push_str(&order.render(2));
        }
    }

    fn push_history(&self, out: &mut String) {
        let mut history = Table::new(&["ATTEMPT", "OUTCOME", "AT", "DETAIL"]);
        for record in &self.history {
            history.row(vec![
                record.attempt.to_string(),
                record.outcome.clone(),
                time_ms(record.at_ms),
                record.detail.clone(),
            ]);
        }
        out.push_str("\nhistory\n");
        out.push_str(&history.render(2));
    }
}

#[derive(Debug, Serialize)]
pub struct CancelOut {
    pub job_id: String,
    pub status: String,
}

impl Render for CancelOut {
    fn table(&self) -> String {
        let note = match self.status.as_str() {
            "cancelling" => " (running: it stops when its worker confirms or its lease expires)",
            "cancelled" => "",
            _ => " (already finished: nothing changed)",
        };
        format!("job {}: {}{note}\n", self.job_id, self.status)
    }
}
