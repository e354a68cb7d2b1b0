//! `sluice keys list|describe|set-limit|set-weight|set-mode|pause|resume`:
//! concurrency and floating keys, at their owner in limit-grant.

use serde::Serialize;
use sluice_proto::v1 as pb;

use sluice_common::auth::Channel;
use sluice_proto::v1::limits_client::LimitsClient;

use crate::endpoints::{Endpoints, Service};
use crate::jobs::kind_word;
use crate::output::{fields, optional_time_ms, or_dash, time_ms, Printable, Render, Table};

#[derive(Debug, clap::Args)]
pub struct TenantArg {
    /// The tenant (`*` for global task-group caps).
    #[arg(long, short = 't', env = "SLUICE_TENANT")]
    pub tenant: String,
}

#[derive(Debug, clap::Subcommand)]
pub enum KeysCommand {
    /// Keys of a tenant that have holders, waiters, an override or floating
    /// state, ordered by key.
    List {
        #[command(flatten)]
        tenant: TenantArg,
        /// Only keys starting with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// At most this many keys (1 to 1000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(1..=1000))]
        limit: u32,
        /// Continue after a previous listing (its next_page_token).
        #[arg(long, default_value = "")]
        page_token: String,
    },
    /// A key's max and where it comes from, its holders and first waiters.
    Describe {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
        /// How many of the first waiters to show.
        #[arg(long, default_value_t = 10)]
        waiters: u32,
    },
    /// Set a runtime override of the key's max (beats the jobs' values, is
    /// persisted); 0 pauses the key. Or --clear it to restore the jobs' values.
    SetLimit {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
        #[arg(required_unless_present = "clear", conflicts_with = "clear")]
        max: Option<u32>,
        #[arg(long)]
        clear: bool,
    },
    /// Set the weight of one flow (the jobs with this fairness key) among
    /// the key's waiters, 1 to 1000 (default 1): flows are granted by
    /// weighted round-robin. Stored; applies to the next grants. --clear
    /// sets it back to 1. An empty fairness key is the default flow.
    SetWeight {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
        fairness_key: String,
        #[arg(required_unless_present = "clear", conflicts_with = "clear",
              value_parser = clap::value_parser!(u32).range(1..=1000))]
        weight: Option<u32>,
        #[arg(long)]
        clear: bool,
    },
    /// Store the key's mode: `shadow` (jobs are admitted as if the limit
    /// were absent; describe shows what it would have done) or `enforce`.
    /// Applies at once. --clear lets the jobs' own shadow flags decide.
    SetMode {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
        #[arg(required_unless_present = "clear", conflicts_with = "clear", value_enum)]
        mode: Option<ModeArg>,
        #[arg(long)]
        clear: bool,
    },
    /// Pause a key (an override of 0): no new grants; running jobs go on.
    Pause {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
    },
    /// Resume a paused key by clearing its override (waiters are granted at
    /// once). To resume at a given max instead, use set-limit.
    Resume {
        #[command(flatten)]
        tenant: TenantArg,
        key: String,
    },
}

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum ModeArg {
    Shadow,
    Enforce,
}

pub async fn run(endpoints: &Endpoints, command: KeysCommand) -> anyhow::Result<Box<dyn Printable>> {
    let mut limits = endpoints.limits()?;
    let (key, change, verb) = match command {
        KeysCommand::List {
            tenant,
            prefix,
            limit,
            page_token,
        } => {
            let request = pb::ListKeysRequest {
                tenant: tenant.tenant,
                prefix,
                page_size: limit,
                page_token,
            };
            return Ok(Box::new(list(&mut limits, request).await?));
        }
        KeysCommand::Describe { tenant, key, waiters } => {
            return Ok(Box::new(describe(&mut limits, (tenant.tenant, key), waiters).await?));
        }
        KeysCommand::SetLimit {
            tenant,
            key,
            max,
            clear,
        } => {
            let (change, verb) = match (max, clear) {
                (Some(max), false) => (pb::set_limit_request::Change::Max(max), "set"),
                _ => (pb::set_limit_request::Change::Clear(true), "cleared"),
            };
            ((tenant.tenant, key), change, verb)
        }
        KeysCommand::SetWeight {
            tenant,
            key,
            fairness_key,
            weight,
            clear,
        } => (
            (tenant.tenant, key),
            pb::set_limit_request::Change::FlowWeight(pb::FlowWeight {
                fairness_key,
                weight: weight.filter(|_| !clear),
            }),
            "weighted",
        ),
        KeysCommand::SetMode {
            tenant,
            key,
            mode,
            clear,
        } => (
            (tenant.tenant, key),
            pb::set_limit_request::Change::Mode(limit_mode(mode, clear) as i32),
            "mode set",
        ),
        KeysCommand::Pause { tenant, key } => ((tenant.tenant, key), pb::set_limit_request::Change::Max(0), "paused"),
        KeysCommand::Resume { tenant, key } => (
            (tenant.tenant, key),
            pb::set_limit_request::Change::Clear(true),
            "resumed",
        ),
    };
    let state = set_limit(&mut limits, key, change).await?;
    Ok(Box::new(SetLimitOut {
        change: verb.to_string(),
        state,
    }))
}

type Limits = Service<LimitsClient<Channel>>;

/// The stored mode `keys set-mode` asks for; Unspecified clears it.
fn limit_mode(mode: Option<ModeArg>, clear: bool) -> pb::LimitMode {
    match (mode, clear) {
        (Some(ModeArg::Shadow), false) => pb::LimitMode::Shadow,
        (Some(ModeArg::Enforce), false) => pb::LimitMode::Enforce,
        _ => pb::LimitMode::Unspecified,
    }
}

/// `keys list`: one page of a tenant's keys.
async fn list(limits: &mut Limits, request: pb::ListKeysRequest) -> anyhow::Result<KeyListOut> {
    let response = limits
        .client
        .list_keys(request)
        .await
        .map_err(|status| limits.error(status))?
        .into_inner();
    Ok(KeyListOut {
        keys: response.keys.into_iter().map(summary_out).collect(),
        next_page_token: (!response.next_page_token.is_empty()).then_some(response.next_page_token),
    })
}

fn summary_out(summary: pb::KeySummary) -> KeySummaryOut {
    let key = summary.key.unwrap_or_default();
    KeySummaryOut {
        tenant: key.tenant,
        key: key.key,
        kind: kind_word(summary.kind),
        holders: summary.holders,
        waiting: summary.waiting,
        override_max: summary.override_max,
        floating_max: summary.floating_max,
        adaptive_max: summary.adaptive_max,
    }
}

/// `keys describe`: a key's state with its first `waiters` waiters.
async fn describe(limits: &mut Limits, (tenant, key): (String, String), waiters: u32) -> anyhow::Result<KeyOut> {
    let response = limits
        .client
        .describe_key(pb::DescribeKeyRequest {
            key: Some(pb::KeyRef { tenant, key }),
            ticket: None,
            first_waiters: waiters.max(1),
        })
        .await
        .map_err(|status| limits.error(status))?
        .into_inner();
    Ok(KeyOut::from(response.state.unwrap_or_default()))
}

/// The change of every other subcommand, sent to the key's owner; returns
/// the key's state after it.
async fn set_limit(
    limits: &mut Limits,
    (tenant, key): (String, String),
    change: pb::set_limit_request::Change,
) -> anyhow::Result<KeyOut> {
    let response = limits
        .client
        .set_limit(pb::SetLimitRequest {
            key: Some(pb::KeyRef { tenant, key }),
            change: Some(change),
        })
        .await
        .map_err(|status| limits.error(status))?
        .into_inner();
    Ok(KeyOut::from(response.state.unwrap_or_default()))
}

#[derive(Debug, Serialize)]
pub struct KeySummaryOut {
    pub tenant: String,
    pub key: String,
    pub kind: String,
    pub holders: u32,
    pub waiting: u32,
    pub override_max: Option<u32>,
    pub floating_max: Option<u32>,
    pub adaptive_max: Option<u32>,
}

#[derive(Debug, Serialize)]
pub struct KeyListOut {
    pub keys: Vec<KeySummaryOut>,
    pub next_page_token: Option<String>,
}

impl Render for KeyListOut {
    fn table(&self) -> String {
        let mut table = Table::new(&[
            "TENANT",
            "KEY",
            "KIND",
            "HOLDERS",
            "WAITING",
            "OVERRIDE",
            "FLOATING MAX",
            "ADAPTIVE MAX",
        ]);
        for key in &self.keys {
            table.row(vec![
                key.tenant.clone(),
                key.key.clone(),
                key.kind.clone(),
                key.holders.to_string(),
                key.waiting.to_string(),
                match key.override_max {
                    Some(0) => "0 (paused)".to_string(),
                    other => or_dash(other),
                },
                or_dash(key.floating_max),
                or_dash(key.adaptive_max),
            ]);
        }
        let mut out = if table.is_empty() {
            "no keys with holders, waiters, an override or floating state\n".to_string()
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
pub struct HolderOut {
    pub job_id: String,
    pub attempt: u32,
    pub step: u32,
    pub granted_at_ms: i64,
    pub expires_unless_confirmed_at_ms: i64,
}

#[derive(Debug, Serialize)]
pub struct WaiterOut {
    pub job_id: String,
    pub attempt: u32,
    pub step: u32,
    pub priority: u32,
    pub waiting_since_ms: i64,
    pub job_max: u32,
}

#[derive(Debug, Serialize)]
pub struct FlowOut {
    pub fairness_key: String,
    pub weight: u32,
    /// Absent: the default weight.
    pub stored_weight: Option<u32>,
    pub waiting: u32,
    pub holders: u32,
    pub deficit: i64,
}

#[derive(Debug, Serialize)]
pub struct ShadowOut {
    pub would_hold: u32,
    pub would_wait: u32,
    pub would_have_waited_count: u64,
    pub would_have_waited_ms_total: i64,
    pub would_have_waited_ms_max: i64,
    pub would_have_exceeded: u64,
}

#[derive(Debug, Serialize)]
pub struct FloatingOut {
    pub default_max: u32,
    pub refresh_interval_ms: u64,
    pub metadata: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Serialize)]
pub struct AdaptiveOut {
    pub current_max: u32,
    pub min: u32,
    pub max: u32,
    pub target_latency_ms: u64,
    pub max_error_ratio: f64,
    pub smoothing: f64,
    pub slow_start: bool,
    /// The last closed window: completions, mean run time, error ratio.
    pub window_samples: u32,
    pub window_mean_run_ms: Option<f64>,
    pub window_error_ratio: f64,
    pub changes: u64,
    pub last_change: Option<AdaptiveChangeOut>,
}

#[derive(Debug, Serialize)]
pub struct AdaptiveChangeOut {
    pub at_ms: i64,
    pub from: u32,
    pub to: u32,
    pub reason: String,
}

#[derive(Debug, Serialize)]
pub struct KeyOut {
    pub tenant: String,
    pub key: String,
    pub kind: String,
    /// The max the head waiter would be checked against now.
    pub effective_max: Option<i64>,
    pub override_max: Option<u32>,
    pub paused: bool,
    pub floating_max: Option<u32>,
    pub floating: Option<FloatingOut>,
    pub holders: usize,
    pub waiting: u32,
    pub oldest_waiting_since_ms: Option<i64>,
    pub holder_tickets: Vec<HolderOut>,
    pub first_waiters: Vec<WaiterOut>,
    /// Flows with waiters (the most waiting first) and flows with a stored weight.
    pub flows: Vec<FlowOut>,
    pub flows_waiting: u32,
    /// The stored mode ("shadow" or "enforce"); absent: the jobs' flags decide.
    pub mode: Option<String>,
    /// What the limit would have done in shadow mode.
    pub shadow: Option<ShadowOut>,
    /// Adaptive keys: the computed max, its settings and its last change.
    pub adaptive: Option<AdaptiveOut>,
    pub partition: u32,
    pub epoch: u64,
}

impl From<pb::KeyState> for KeyOut {
    fn from(state: pb::KeyState) -> Self {
        let key = state.key.unwrap_or_default();
        KeyOut {
            tenant: key.tenant,
            key: key.key,
            kind: kind_word(state.kind),
            effective_max: state.effective_max,
            override_max: state.override_max,
            paused: state.paused,
            floating_max: state.floating_max,
            floating: state.floating.map(|floating| FloatingOut {
                default_max: floating.default_max,
                refresh_interval_ms: floating.refresh_interval_ms,
                metadata: floating.metadata.into_iter().collect(),
            }),
            holders: state.holders.len(),
            waiting: state.waiting,
            oldest_waiting_since_ms: state.oldest_waiting_since_ms,
            holder_tickets: state
                .holders
                .into_iter()
                .map(|holder| {
                    let ticket = holder.ticket.unwrap_or_default();
                    HolderOut {
                        job_id: ticket.job_id,
                        attempt: ticket.attempt,
                        step: ticket.step,
                        granted_at_ms: holder.granted_at_ms,
                        expires_unless_confirmed_at_ms: holder.expires_unless_confirmed_at_ms,
                    }
                })
                .collect(),
            first_waiters: state
                .first_waiters
                .into_iter()
                .map(|waiter| {
                    let ticket = waiter.ticket.unwrap_or_default();
                    WaiterOut {
                        job_id: ticket.job_id,
                        attempt: ticket.attempt,
                        step: ticket.step,
                        priority: waiter.priority,
                        waiting_since_ms: waiter.waiting_since_ms,
                        job_max: waiter.job_max,
                    }
                })
                .collect(),
            flows: state
                .flows
                .into_iter()
                .map(|flow| FlowOut {
                    fairness_key: flow.fairness_key,
                    weight: flow.weight,
                    stored_weight: flow.stored_weight,
                    waiting: flow.waiting,
                    holders: flow.holders,
                    deficit: flow.deficit,
                })
                .collect(),
            flows_waiting: state.flows_waiting,
            mode: state.mode.and_then(|mode| match pb::LimitMode::try_from(mode) {
                Ok(pb::LimitMode::Shadow) => Some("shadow".to_string()),
                Ok(pb::LimitMode::Enforce) => Some("enforce".to_string()),
                _ => None,
            }),
            shadow: state.shadow.map(|shadow| ShadowOut {
                would_hold: shadow.would_hold,
                would_wait: shadow.would_wait,
                would_have_waited_count: shadow.would_have_waited_count,
                would_have_waited_ms_total: shadow.would_have_waited_ms_total,
                would_have_waited_ms_max: shadow.would_have_waited_ms_max,
                would_have_exceeded: shadow.would_have_exceeded,
            }),
            adaptive: state.adaptive.map(|adaptive| {
                let settings = adaptive.settings.unwrap_or_default();
                AdaptiveOut {
                    current_max: adaptive.current_max,
                    min: settings.min,
                    max: settings.max,
                    target_latency_ms: settings.target_latency_ms,
                    max_error_ratio: settings.max_error_ratio,
                    smoothing: settings.smoothing,
                    slow_start: adaptive.slow_start,
                    window_samples: adaptive.window_samples,
                    window_mean_run_ms: adaptive.window_mean_run_ms,
                    window_error_ratio: adaptive.window_error_ratio,
                    changes: adaptive.changes,
                    last_change: adaptive.last_change.map(|change| AdaptiveChangeOut {
                        at_ms: change.at_ms,
                        from: change.from,
                        to: change.to,
                        reason: change.reason,
                    }),
                }
            }),
            partition: state.partition,
            epoch: state.epoch,
        }
    }
}

impl KeyOut {
    /// Where the max in force comes from.
    fn max_source(&self) -> String {
        if self.paused {
            "paused (override 0)".to_string()
        } else if let Some(max) = self.override_max {
            format!("{max} (override)")
        } else if let Some(max) = self.floating_max {
            format!("{max} (floating)")
        } else if let Some(adaptive) = &self.adaptive {
            format!("{} (adaptive)", adaptive.current_max)
        } else if let Some(max) = self.effective_max {
            format!("{max} (the jobs' own max)")
        } else {
            "- (no holders or waiters)".to_string()
        }
    }
}

impl Render for KeyOut {
    fn table(&self) -> String {
        let mut pairs = vec![
            ("key", format!("{} (tenant {})", self.key, self.tenant)),
            ("kind", self.kind.clone()),
            ("max", self.max_source()),
            (
                "holders",
                match self.effective_max {
                    Some(max) => format!("{} of {max}", self.holders),
                    None => self.holders.to_string(),
                },
            ),
            ("waiting", self.waiting.to_string()),
            ("oldest wait", optional_time_ms(self.oldest_waiting_since_ms)),
        ];
        if let Some(floating) = &self.floating {
            pairs.push((
                "floating",
                format!(
                    "default_max {}, refresh every {} ms, metadata {:?}",
                    floating.default_max, floating.refresh_interval_ms, floating.metadata
                ),
            ));
        }
        if let Some(mode) = &self.mode {
            pairs.push(("mode", format!("{mode} (stored)")));
        }
        if let Some(adaptive) = &self.adaptive {
            adaptive_pairs(adaptive, &mut pairs);
        }
        if let Some(shadow) = &self.shadow {
            shadow_pair(shadow, &mut pairs);
        }
        pairs.push(("owner", format!("partition {}, epoch {}", self.partition, self.epoch)));
        let mut out = fields(&pairs);
        if !self.holder_tickets.is_empty() {
            self.push_holders(&mut out);
        }
        if !self.first_waiters.is_empty() {
            self.push_first_waiters(&mut out);
        }
        if self.flows.len() > 1 || self.flows.iter().any(|flow| flow.stored_weight.is_some()) {
            self.push_flows(&mut out);
        }
        out
    }
}

/// The adaptive settings, the last closed window and the last change.
fn adaptive_pairs(adaptive: &AdaptiveOut, pairs: &mut Vec<(&'static str, String)>) {
    let target = match adaptive.target_latency_ms {
        0 => "no latency target".to_string(),
        ms => format!("target {ms} ms"),
    };
    pairs.push((
        "adaptive",
        format!(
            "{} to {}, {target}, errors up to {:.0} %, smoothing {}{}",
            adaptive.min,
            adaptive.max,
            adaptive.max_error_ratio * 100.0,
            adaptive.smoothing,
            if adaptive.slow_start { ", slow start" } else { "" }
        ),
    ));
    pairs.push((
        "last window",
        match adaptive.window_mean_run_ms {
            Some(mean) => format!(
                "{} completions, mean run {mean:.0} ms, {:.0} % failed",
                adaptive.window_samples,
                adaptive.window_error_ratio * 100.0
            ),
            None => "none closed yet".to_string(),
        },
    ));
    pairs.push((
        "last change",
        match &adaptive.last_change {
            Some(change) => format!(
                "{} -> {} at {} ({}); {} changes in all",
                change.from,
                change.to,
                time_ms(change.at_ms),
                change.reason,
                adaptive.changes
            ),
            None => "none yet".to_string(),
        },
    ));
}

fn shadow_pair(shadow: &ShadowOut, pairs: &mut Vec<(&'static str, String)>) {
    #[allow(clippy::cast_precision_loss)]
    let mean = if shadow.would_have_waited_count == 0 {
        0.0
    } else {
        shadow.would_have_waited_ms_total as f64 / shadow.would_have_waited_count as f64
    };
    pairs.push((
        "shadow",
        format!(
            "would hold {}, would wait {}; {} would-be grants waited {mean:.0} ms on average, {} ms at most; {} grants over the max",
            shadow.would_hold,
            shadow.would_wait,
            shadow.would_have_waited_count,
            shadow.would_have_waited_ms_max,
            shadow.would_have_exceeded
        ),
    ));
}

impl KeyOut {
    fn push_holders(&self, out: &mut String) {
        let mut holders = Table::new(&["JOB", "ATTEMPT", "STEP", "GRANTED"]);
        for holder in &self.holder_tickets {
            holders.row(vec![
                holder.job_id.clone(),
                holder.attempt.to_string(),
                (holder.step + 1).to_string(),
                time_ms(holder.granted_at_ms),
            ]);
        }
        out.push_str("\nholders\n");
        out.push_str(&holders.render(2));
    }

    fn push_first_waiters(&self, out: &mut String) {
        let mut waiters = Table::new(&["#", "JOB", "ATTEMPT", "PRIORITY", "JOB MAX", "WAITING SINCE"]);
        for (position, waiter) in self.first_waiters.iter().enumerate() {
            waiters.row(vec![
                position.to_string(),
                waiter.job_id.clone(),
                waiter.attempt.to_string(),
                waiter.priority.to_string(),
                waiter.job_max.to_string(),
                time_ms(waiter.waiting_since_ms),
            ]);
        }
        out.push_str("\nfirst waiters\n");
        out.push_str(&waiters.render(2));
    }

    fn push_flows(&self, out: &mut String) {
        let mut flows = Table::new(&["FAIRNESS KEY", "WEIGHT", "WAITING", "HOLDERS"]);
        for flow in &self.flows {
            flows.row(vec![
                if flow.fairness_key.is_empty() {
                    "(default)".to_string()
                } else {
                    flow.fairness_key.clone()
                },
                flow.weight.to_string(),
                flow.waiting.to_string(),
                flow.holders.to_string(),
            ]);
        }
        out.push_str(&format!("\nflows ({} with waiters)\n", self.flows_waiting));
        out.push_str(&flows.render(2));
    }
}

#[derive(Debug, Serialize)]
pub struct SetLimitOut {
    /// "set", "cleared", "weighted", "mode set", "paused" or "resumed".
    pub change: String,
    pub state: KeyOut,
}

impl Render for SetLimitOut {
    fn table(&self) -> String {
        format!(
            "{} {} (tenant {}): max {}\n",
            self.change,
            self.state.key,
            self.state.tenant,
            self.state.max_source()
        )
    }
}
