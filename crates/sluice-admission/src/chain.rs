//! Validating a job request and building its acquisition chain.
//!
//! A job acquires its limits in one global order, whatever order it lists
//! them in (docs/architecture.md, "Limit kinds and the acquisition order"):
//! its own concurrency and floating keys sorted by (tenant, key), then its
//! task group's caps, then rate limits. Caps live in a key namespace no job
//! can name (`cap:` keys; tenant `*` for global caps), so "own keys before
//! caps" is itself a total order over keys, and no two jobs can hold each
//! other's next key.

use std::collections::HashSet;

use sluice_common::config::{parse_duration, CapScope, SluiceConfig, TaskGroupConfig};
use sluice_common::validate::{
    check_adaptive_values, check_floating_values, check_i64, check_name, check_rate_window, check_u32,
    check_unique_key, FieldError, MAX_BACKOFF_MS, MAX_CONCURRENCY, MAX_IDEMPOTENCY_WINDOW_MS, MAX_ID_BYTES,
    MAX_RUN_AT_MS,
};
use sluice_proto::v1 as pb;

/// Keys starting with this are task-group caps; jobs cannot name them.
pub const CAP_KEY_PREFIX: &str = "cap:";
/// The tenant of caps shared by every tenant.
pub const GLOBAL_CAP_TENANT: &str = "*";

/// One step of a frozen chain, as stored on the job row.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StoredStep {
    #[prost(string, tag = "1")]
    pub tenant: String,
    #[prost(string, tag = "2")]
    pub key: String,
    #[prost(enumeration = "pb::LimitKind", tag = "3")]
    pub kind: i32,
    /// Concurrency: the job's max.
    #[prost(uint32, tag = "4")]
    pub max_concurrency: u32,
    // The rarer parts of a step are boxed: a step is held by every waiting
    // job, and inline they made it 336 bytes (issue 30).
    #[prost(message, optional, boxed, tag = "5")]
    pub floating: Option<Box<pb::FloatingConcurrencyLimit>>,
    #[prost(message, optional, boxed, tag = "6")]
    pub rate_key: Option<Box<pb::RateKeyRef>>,
    #[prost(int64, tag = "7")]
    pub rate_limit: i64,
    #[prost(int64, tag = "8")]
    pub rate_window_ms: i64,
    #[prost(int64, tag = "9")]
    pub rate_cost: i64,
    /// "job" or "task_group:<name>".
    #[prost(string, tag = "10")]
    pub origin: String,
    /// Concurrency: the job names the limit in shadow mode.
    #[prost(bool, tag = "11")]
    pub shadow: bool,
    /// Adaptive: the job's settings (the first job's create the key's state).
    #[prost(message, optional, boxed, tag = "12")]
    pub adaptive: Option<Box<pb::AdaptiveConcurrencyLimit>>,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct StoredChain {
    #[prost(message, repeated, tag = "1")]
    pub steps: Vec<StoredStep>,
}

/// The recorded outcomes of ended attempts.
#[derive(Clone, PartialEq, prost::Message)]
pub struct History {
    #[prost(message, repeated, tag = "1")]
    pub records: Vec<pb::AttemptRecord>,
}

impl StoredStep {
    pub fn limit_kind(&self) -> pb::LimitKind {
        pb::LimitKind::try_from(self.kind).unwrap_or(pb::LimitKind::Unspecified)
    }

    /// Steps limit-grant holds tickets for (and that must be released).
    pub fn is_ticketed(&self) -> bool {
        matches!(
            self.limit_kind(),
            pb::LimitKind::Concurrency | pb::LimitKind::Floating | pb::LimitKind::Adaptive
        )
    }

    pub fn view(&self) -> pb::ChainStep {
        let (max, window_ms, cost) = match self.limit_kind() {
            pb::LimitKind::Concurrency => (i64::from(self.max_concurrency), 0, 0),
            pb::LimitKind::Floating => (
                self.floating
                    .as_ref()
                    .map_or(0, |floating| i64::from(floating.default_max)),
                0,
                0,
            ),
            pb::LimitKind::Adaptive => (
                self.adaptive.as_ref().map_or(0, |adaptive| i64::from(adaptive.max)),
                0,
                0,
            ),
            _ => (self.rate_limit, self.rate_window_ms, self.rate_cost),
        };
        pb::ChainStep {
            tenant: self.tenant.clone(),
            key: self.key.clone(),
            kind: self.kind,
            max,
            origin: self.origin.clone(),
            window_ms,
            cost,
        }
    }
}

/// Retry settings resolved from the request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RetrySettings {
    pub max_attempts: u32,
    pub initial_backoff_ms: i64,
    pub max_backoff_ms: i64,
    pub multiplier: f64,
    pub fail_on_lease_expiry: bool,
}

impl RetrySettings {
    /// Backoff before the attempt after `attempts_used` failed ones (>= 1).
    pub fn backoff_ms(&self, attempts_used: u32) -> i64 {
        let exponent = i32::try_from(attempts_used.saturating_sub(1).min(60)).unwrap_or(60);
        // Float math here is bounded by `max_backoff_ms`.
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
        let raw = (self.initial_backoff_ms as f64) * self.multiplier.powi(exponent);
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
        let capped = raw.min(self.max_backoff_ms as f64) as i64;
        capped.max(0)
    }

    pub fn from_request(retry: Option<&pb::RetryPolicy>) -> Result<Self, FieldError> {
        let default = pb::RetryPolicy::default();
        let retry = retry.unwrap_or(&default);
        let initial = optional_duration_ms("retry.initial_backoff", &retry.initial_backoff, 1_000, MAX_BACKOFF_MS)?;
        let max = optional_duration_ms("retry.max_backoff", &retry.max_backoff, 300_000, MAX_BACKOFF_MS)?;
        if max < initial {
            return Err(FieldError::new(
                "retry.max_backoff",
                "must not be below retry.initial_backoff",
            ));
        }
        let multiplier = if retry.backoff_multiplier == 0.0 {
            2.0
        } else {
            retry.backoff_multiplier
        };
        if !multiplier.is_finite() || !(1.0..=100.0).contains(&multiplier) {
            return Err(FieldError::new("retry.backoff_multiplier", "must be between 1 and 100"));
        }
        if retry.max_attempts > 1000 {
            return Err(FieldError::new("retry.max_attempts", "must be at most 1000"));
        }
        let fail_on_lease_expiry = match pb::LeaseExpiryPolicy::try_from(retry.on_lease_expiry) {
            Ok(pb::LeaseExpiryPolicy::Fail) => true,
            Ok(_) => false,
            Err(_) => return Err(FieldError::new("retry.on_lease_expiry", "unknown policy")),
        };
        Ok(RetrySettings {
            max_attempts: retry.max_attempts.max(1),
            initial_backoff_ms: initial,
            max_backoff_ms: max,
            multiplier,
            fail_on_lease_expiry,
        })
    }
}

/// A duration field ("90s", "1h"), empty for `default_ms`, at most `max_ms`.
fn optional_duration_ms(field: &str, text: &str, default_ms: i64, max_ms: i64) -> Result<i64, FieldError> {
    if text.trim().is_empty() {
        return Ok(default_ms);
    }
    if text.len() > 64 {
        return Err(FieldError::new(field, "is not a duration (too long)"));
    }
    let duration = parse_duration(text).map_err(|message| FieldError::new(field, message))?;
    match i64::try_from(duration.as_millis()) {
        Ok(millis) if millis <= max_ms => Ok(millis),
        _ => Err(FieldError::new(
            field,
            format!(
                "{text:?} is longer than the maximum {}",
                humantime::format_duration(std::time::Duration::from_millis(u64::try_from(max_ms).unwrap_or(0)))
            ),
        )),
    }
}

/// A request that passed validation, with everything derived from it.
#[derive(Clone, Debug)]
pub struct ValidJob {
    pub request: pb::JobRequest,
    pub priority: u32,
    pub chain: Vec<StoredStep>,
    pub retry: RetrySettings,
    pub idempotency_window_ms: Option<i64>,
    pub lease_ms: i64,
    pub run_timeout_ms: Option<i64>,
}

/// Validate `request` against `config`. Errors name the field.
pub fn validate(config: &SluiceConfig, request: pb::JobRequest) -> Result<ValidJob, FieldError> {
    let limits = &config.admission;
    if let Some(job_id) = &request.job_id {
        check_name("job_id", job_id, MAX_ID_BYTES)?;
    }
    check_name("tenant", &request.tenant, limits.max_key_bytes)?;
    if request.tenant == GLOBAL_CAP_TENANT {
        return Err(FieldError::new("tenant", "\"*\" is reserved for global caps"));
    }
    if request.task_group.is_empty() {
        return Err(FieldError::new("task_group", "must not be empty"));
    }
    let group = declared_task_group(config, &request.task_group)?;
    let priority = request.priority.unwrap_or(limits.default_priority);
    if priority > 99 {
        return Err(FieldError::new("priority", "must be 0 (most urgent) to 99"));
    }
    if let Some(run_at_ms) = request.run_at_ms {
        check_i64("run_at_ms", run_at_ms, 0, MAX_RUN_AT_MS)?;
    }
    if request.payload.len() > limits.max_payload_bytes {
        return Err(FieldError::new(
            "payload",
            format!(
                "{} bytes is over the limit of {} bytes",
                request.payload.len(),
                limits.max_payload_bytes
            ),
        ));
    }
    let idempotency_window_ms = idempotency_window_ms(&request, limits)?;
    let retry = RetrySettings::from_request(request.retry.as_ref())?;
    if request.limits.len() > limits.max_limits_per_job {
        return Err(FieldError::new(
            "limits",
            format!("at most {} limits per job", limits.max_limits_per_job),
        ));
    }
    if !request.fairness_key.is_empty() {
        check_name("fairness_key", &request.fairness_key, limits.max_key_bytes)?;
    }

    let chain = acquisition_chain(&request, group, limits)?;

    Ok(ValidJob {
        priority,
        chain,
        retry,
        idempotency_window_ms,
        lease_ms: group.lease.as_millis_i64(),
        run_timeout_ms: group.run_timeout.map(|timeout| timeout.as_millis_i64()),
        request,
    })
}

fn declared_task_group<'a>(config: &'a SluiceConfig, task_group: &str) -> Result<&'a TaskGroupConfig, FieldError> {
    let Some(group) = config.task_groups.get(task_group) else {
        let declared: Vec<&str> = config.task_groups.keys().map(String::as_str).collect();
        return Err(FieldError::new(
            "task_group",
            format!(
                "undeclared task group {:?} (declared: {})",
                task_group,
                declared.join(", ")
            ),
        ));
    };
    Ok(group)
}

/// The idempotency window of a job with an idempotency key (the default
/// when not set); `None` without a key.
fn idempotency_window_ms(
    request: &pb::JobRequest,
    limits: &sluice_common::config::AdmissionConfig,
) -> Result<Option<i64>, FieldError> {
    let idempotency_window_ms = if request.idempotency_key.is_empty() {
        if !request.idempotency_window.is_empty() {
            return Err(FieldError::new(
                "idempotency_window",
                "set only together with idempotency_key",
            ));
        }
        None
    } else {
        check_name("idempotency_key", &request.idempotency_key, limits.max_key_bytes)?;
        Some(optional_duration_ms(
            "idempotency_window",
            &request.idempotency_window,
            limits.default_idempotency_window.as_millis_i64(),
            MAX_IDEMPOTENCY_WINDOW_MS,
        )?)
    };
    if idempotency_window_ms == Some(0) {
        return Err(FieldError::new("idempotency_window", "must be greater than 0"));
    }
    Ok(idempotency_window_ms)
}

/// The job's limits in the order it acquires them: its own concurrency,
/// floating and adaptive keys, then the task group's caps, then rate
/// windows, each part sorted by tenant and key.
fn acquisition_chain(
    request: &pb::JobRequest,
    group: &TaskGroupConfig,
    limits: &sluice_common::config::AdmissionConfig,
) -> Result<Vec<StoredStep>, FieldError> {
    let mut own_steps: Vec<StoredStep> = Vec::new();
    let mut rate_steps: Vec<StoredStep> = Vec::new();
    let mut seen: HashSet<(String, String, bool)> = HashSet::new();
    for (index, limit) in request.limits.iter().enumerate() {
        let parent = format!("limits[{index}]");
        let step = validate_limit(&request.tenant, limit, limits).map_err(|error| error.within(&parent))?;
        let is_rate = step.limit_kind() == pb::LimitKind::Rate;
        if !seen.insert((step.tenant.clone(), step.key.clone(), is_rate)) {
            return Err(FieldError::new(
                format!("{parent}.key"),
                format!("{:?} is named twice; a job holds each key once", step.key),
            ));
        }
        if is_rate {
            rate_steps.push(step);
        } else {
            own_steps.push(step);
        }
    }
    own_steps.sort_by(|left, right| (&left.tenant, &left.key).cmp(&(&right.tenant, &right.key)));
    let mut cap_steps: Vec<StoredStep> = group
        .caps
        .iter()
        .map(|cap| StoredStep {
            tenant: match cap.scope {
                CapScope::Tenant => request.tenant.clone(),
                CapScope::Global => GLOBAL_CAP_TENANT.to_string(),
            },
            key: format!("{CAP_KEY_PREFIX}{}", cap.key),
            kind: pb::LimitKind::Concurrency as i32,
            max_concurrency: cap.max,
            origin: format!("task_group:{}", request.task_group),
            ..Default::default()
        })
        .collect();
    cap_steps.sort_by(|left, right| (&left.tenant, &left.key).cmp(&(&right.tenant, &right.key)));
    cap_steps.dedup_by(|left, right| left.tenant == right.tenant && left.key == right.key);
    rate_steps.sort_by(|left, right| (&left.tenant, &left.key).cmp(&(&right.tenant, &right.key)));
    let mut chain = own_steps;
    chain.extend(cap_steps);
    chain.extend(rate_steps);
    Ok(chain)
}

fn validate_limit(
    tenant: &str,
    limit: &pb::Limit,
    limits: &sluice_common::config::AdmissionConfig,
) -> Result<StoredStep, FieldError> {
    let max_key_bytes = limits.max_key_bytes;
    match &limit.kind {
        None => Err(FieldError::new(
            "kind",
            "set one of concurrency, floating, rate, adaptive",
        )),
        Some(pb::limit::Kind::Concurrency(concurrency)) => {
            check_job_key("concurrency.key", &concurrency.key, max_key_bytes)?;
            if concurrency.max_concurrency < 1 {
                return Err(FieldError::new(
                    "concurrency.max_concurrency",
                    "must be at least 1 (pause a key with an override of 0 instead)",
                ));
            }
            check_u32(
                "concurrency.max_concurrency",
                concurrency.max_concurrency,
                1,
                MAX_CONCURRENCY,
            )?;
            Ok(StoredStep {
                tenant: tenant.to_string(),
                key: concurrency.key.clone(),
                kind: pb::LimitKind::Concurrency as i32,
                max_concurrency: concurrency.max_concurrency,
                origin: "job".to_string(),
                shadow: concurrency.shadow,
                ..Default::default()
            })
        }
        Some(pb::limit::Kind::Floating(floating)) => {
            check_job_key("floating.key", &floating.key, max_key_bytes)?;
            check_floating_values("floating", floating, limits.max_floating_metadata_bytes)?;
            Ok(StoredStep {
                tenant: tenant.to_string(),
                key: floating.key.clone(),
                kind: pb::LimitKind::Floating as i32,
                floating: Some(Box::new(floating.clone())),
                origin: "job".to_string(),
                ..Default::default()
            })
        }
        Some(pb::limit::Kind::Adaptive(adaptive)) => {
            check_job_key("adaptive.key", &adaptive.key, max_key_bytes)?;
            check_adaptive_values("adaptive", adaptive)?;
            Ok(StoredStep {
                tenant: tenant.to_string(),
                key: adaptive.key.clone(),
                kind: pb::LimitKind::Adaptive as i32,
                adaptive: Some(Box::new(adaptive.clone())),
                origin: "job".to_string(),
                ..Default::default()
            })
        }
        Some(pb::limit::Kind::Rate(rate)) => validate_rate(tenant, rate, max_key_bytes),
    }
}

/// A rate limit: a stored resource's window or an inline one.
fn validate_rate(tenant: &str, rate: &pb::RateLimit, max_key_bytes: usize) -> Result<StoredStep, FieldError> {
    match &rate.spec {
        None => Err(FieldError::new("rate.spec", "set inline or rate_limit_key")),
        Some(pb::rate_limit::Spec::RateLimitKey(resource_key)) => {
            check_name("rate.rate_limit_key", resource_key, max_key_bytes)?;
            Ok(StoredStep {
                tenant: tenant.to_string(),
                key: format!("resource:{resource_key}"),
                kind: pb::LimitKind::Rate as i32,
                rate_key: Some(Box::new(pb::RateKeyRef {
                    tenant: tenant.to_string(),
                    kind: Some(pb::rate_key_ref::Kind::ResourceKey(resource_key.clone())),
                })),
                rate_cost: 1,
                origin: "job".to_string(),
                ..Default::default()
            })
        }
        Some(pb::rate_limit::Spec::Inline(inline)) => {
            check_name("rate.inline.name", &inline.name, max_key_bytes)?;
            check_unique_key("rate.inline.unique_key", &inline.unique_key, max_key_bytes)?;
            let cost = if inline.cost == 0 { 1 } else { inline.cost };
            check_rate_window("rate.inline", inline.limit, inline.duration_ms, inline.cost)?;
            check_rate_window("rate.inline", inline.limit, inline.duration_ms, cost)?;
            Ok(StoredStep {
                tenant: tenant.to_string(),
                key: format!("inline:{}:{}", inline.name, inline.unique_key),
                kind: pb::LimitKind::Rate as i32,
                rate_key: Some(Box::new(pb::RateKeyRef {
                    tenant: tenant.to_string(),
                    kind: Some(pb::rate_key_ref::Kind::Inline(pb::InlineKey {
                        name: inline.name.clone(),
                        unique_key: inline.unique_key.clone(),
                    })),
                })),
                rate_limit: inline.limit,
                rate_window_ms: inline.duration_ms,
                rate_cost: cost,
                origin: "job".to_string(),
                ..Default::default()
            })
        }
    }
}

fn check_job_key(field: &str, key: &str, max_key_bytes: usize) -> Result<(), FieldError> {
    check_name(field, key, max_key_bytes)?;
    if key.starts_with(CAP_KEY_PREFIX) {
        return Err(FieldError::new(
            field,
            format!("keys starting with {CAP_KEY_PREFIX:?} are reserved for task group caps"),
        ));
    }
    Ok(())
}

/// A readable name of a step for reasons and logs.
pub fn describe_step(step: &StoredStep) -> String {
    let kind = match step.limit_kind() {
        pb::LimitKind::Concurrency => "concurrency",
        pb::LimitKind::Floating => "floating concurrency",
        pb::LimitKind::Rate => "rate",
        pb::LimitKind::Adaptive => "adaptive concurrency",
        pb::LimitKind::Unspecified => "unknown",
    };
    format!("{kind} key {:?} (tenant {:?})", step.key, step.tenant)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SluiceConfig {
        SluiceConfig::load_with(None, &[]).unwrap()
    }

    fn concurrency(key: &str, max: u32) -> pb::Limit {
        pb::Limit {
            kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                key: key.to_string(),
                max_concurrency: max,
                shadow: false,
            })),
        }
    }

    fn inline_rate(name: &str, limit: i64, cost: i64) -> pb::Limit {
        pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
                    name: name.to_string(),
                    unique_key: "u".to_string(),
                    limit,
                    duration_ms: 1000,
                    cost,
                })),
            })),
        }
    }

    fn request(limits: Vec<pb::Limit>) -> pb::JobRequest {
        pb::JobRequest {
            tenant: "acme".to_string(),
            task_group: "default".to_string(),
            limits,
            ..Default::default()
        }
    }

    fn adaptive(spec: pb::AdaptiveConcurrencyLimit) -> pb::Limit {
        pb::Limit {
            kind: Some(pb::limit::Kind::Adaptive(pb::AdaptiveConcurrencyLimit {
                key: "api".to_string(),
                ..spec
            })),
        }
    }

    #[test]
    fn an_adaptive_limit_is_a_ticketed_step_and_bad_settings_name_their_field() {
        let valid = validate(
            &config(),
            request(vec![adaptive(pb::AdaptiveConcurrencyLimit {
                min: 2,
                max: 40,
                target_latency_ms: 250,
                ..Default::default()
            })]),
        )
        .unwrap();
        assert_eq!(valid.chain.len(), 1);
        assert!(valid.chain[0].is_ticketed());
        assert_eq!(valid.chain[0].limit_kind(), pb::LimitKind::Adaptive);
        assert_eq!(valid.chain[0].view().max, 40);
        let refused =
            |spec: pb::AdaptiveConcurrencyLimit| validate(&config(), request(vec![adaptive(spec)])).unwrap_err().field;
        let cases = [
            (
                pb::AdaptiveConcurrencyLimit {
                    min: 10,
                    max: 5,
                    ..Default::default()
                },
                "limits[0].adaptive.max",
            ),
            (
                pb::AdaptiveConcurrencyLimit {
                    min: 2,
                    initial: 1,
                    ..Default::default()
                },
                "limits[0].adaptive.initial",
            ),
            (
                pb::AdaptiveConcurrencyLimit {
                    smoothing: f64::NAN,
                    ..Default::default()
                },
                "limits[0].adaptive.smoothing",
            ),
            (
                pb::AdaptiveConcurrencyLimit {
                    max_error_ratio: -0.5,
                    ..Default::default()
                },
                "limits[0].adaptive.max_error_ratio",
            ),
            (
                pb::AdaptiveConcurrencyLimit {
                    target_latency_ms: u64::MAX,
                    ..Default::default()
                },
                "limits[0].adaptive.target_latency_ms",
            ),
            (
                pb::AdaptiveConcurrencyLimit {
                    max: u32::MAX,
                    ..Default::default()
                },
                "limits[0].adaptive.max",
            ),
        ];
        for (spec, field) in cases {
            assert_eq!(refused(spec.clone()), field, "{spec:?}");
        }
        let mut no_key = adaptive(pb::AdaptiveConcurrencyLimit::default());
        if let Some(pb::limit::Kind::Adaptive(spec)) = &mut no_key.kind {
            spec.key = "bad\0key".to_string();
        }
        assert_eq!(
            validate(&config(), request(vec![no_key])).unwrap_err().field,
            "limits[0].adaptive.key"
        );
    }

    #[test]
    fn chain_follows_the_global_order_whatever_the_listed_order() {
        let valid = validate(
            &config(),
            request(vec![
                inline_rate("api", 10, 1),
                concurrency("zeta", 2),
                concurrency("alpha", 1),
            ]),
        )
        .unwrap();
        let keys: Vec<&str> = valid.chain.iter().map(|step| step.key.as_str()).collect();
        assert_eq!(keys, vec!["alpha", "zeta", "inline:api:u"]);
        assert_eq!(valid.priority, 50);
    }

    #[test]
    fn caps_come_after_own_keys_and_before_rates() {
        let loaded = SluiceConfig::load_with(None, &[]).unwrap();
        let mut with_caps = loaded.clone();
        let group = with_caps.task_groups.get_mut("default").unwrap();
        group.caps = vec![
            sluice_common::config::CapConfig {
                key: "queue".to_string(),
                max: 10,
                scope: CapScope::Tenant,
            },
            sluice_common::config::CapConfig {
                key: "cluster".to_string(),
                max: 100,
                scope: CapScope::Global,
            },
        ];
        let valid = validate(
            &with_caps,
            request(vec![inline_rate("api", 10, 1), concurrency("zzz", 2)]),
        )
        .unwrap();
        let steps: Vec<(&str, &str)> = valid
            .chain
            .iter()
            .map(|step| (step.tenant.as_str(), step.key.as_str()))
            .collect();
        assert_eq!(
            steps,
            vec![
                ("acme", "zzz"),
                ("*", "cap:cluster"),
                ("acme", "cap:queue"),
                ("acme", "inline:api:u")
            ]
        );
    }

    #[test]
    fn bad_input_names_the_field() {
        let loaded = config();
        let cases: Vec<(pb::JobRequest, &str)> = vec![
            (request(vec![concurrency("", 1)]), "limits[0].concurrency.key"),
            (
                request(vec![concurrency("k", 0)]),
                "limits[0].concurrency.max_concurrency",
            ),
            (request(vec![concurrency("cap:x", 1)]), "limits[0].concurrency.key"),
            (request(vec![concurrency("k", 1), concurrency("k", 2)]), "limits[1].key"),
            (request(vec![inline_rate("api", 0, 1)]), "limits[0].rate.inline.limit"),
            (request(vec![inline_rate("api", 5, 6)]), "limits[0].rate.inline.cost"),
            (
                pb::JobRequest {
                    tenant: String::new(),
                    ..request(vec![])
                },
                "tenant",
            ),
            (
                pb::JobRequest {
                    task_group: "nope".to_string(),
                    ..request(vec![])
                },
                "task_group",
            ),
            (
                pb::JobRequest {
                    priority: Some(100),
                    ..request(vec![])
                },
                "priority",
            ),
            (
                pb::JobRequest {
                    idempotency_key: "k".to_string(),
                    idempotency_window: "soon".to_string(),
                    ..request(vec![])
                },
                "idempotency_window",
            ),
            (
                pb::JobRequest {
                    payload: vec![0; loaded.admission.max_payload_bytes + 1],
                    ..request(vec![])
                },
                "payload",
            ),
        ];
        for (bad, field) in cases {
            let error = validate(&loaded, bad).unwrap_err();
            assert_eq!(error.field, field, "{error}");
        }
    }

    #[test]
    fn backoff_grows_and_caps() {
        let retry = RetrySettings {
            max_attempts: 5,
            initial_backoff_ms: 1000,
            max_backoff_ms: 5000,
            multiplier: 2.0,
            fail_on_lease_expiry: false,
        };
        assert_eq!(retry.backoff_ms(1), 1000);
        assert_eq!(retry.backoff_ms(2), 2000);
        assert_eq!(retry.backoff_ms(3), 4000);
        assert_eq!(retry.backoff_ms(4), 5000);
    }
}
