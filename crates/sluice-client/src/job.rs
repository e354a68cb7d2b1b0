//! Builders for job requests and their limits. They produce the protobuf
//! `JobRequest` of `proto/sluice/v1/jobs.proto`, checked for the mistakes the
//! service would refuse anyway, with the same field names in the error.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sluice_proto::v1 as pb;

use crate::error::{Error, Result};

/// The tenant reserved for global caps.
const GLOBAL_TENANT: &str = "*";

/// Builds a [`pb::JobRequest`].
///
/// ```
/// use std::time::Duration;
/// use sluice_client::{JobBuilder, FloatingLimit, InlineRate, RetryPolicy};
///
/// let request = JobBuilder::new("acme", "default")
///     .payload(b"resize:42".to_vec())
///     .priority(10)
///     .concurrency("images", 4)
///     .floating(FloatingLimit::new("gpu-pool", 2).refresh_every(Duration::from_secs(60)).metadata("pool", "a100"))
///     .rate(InlineRate::new("api", 100, Duration::from_secs(1)))
///     .idempotency("order-42", Duration::from_secs(3600))
///     .retry(RetryPolicy::attempts(3).backoff(Duration::from_millis(500), Duration::from_secs(60)))
///     .build()
///     .unwrap();
/// assert_eq!(request.limits.len(), 3);
/// ```
#[derive(Clone, Debug)]
pub struct JobBuilder {
    request: pb::JobRequest,
}

impl JobBuilder {
    /// A job of `tenant` in `task_group` (which must be declared in the
    /// services' configuration).
    pub fn new(tenant: impl Into<String>, task_group: impl Into<String>) -> Self {
        JobBuilder {
            request: pb::JobRequest {
                tenant: tenant.into(),
                task_group: task_group.into(),
                ..Default::default()
            },
        }
    }

    /// A job id of your own. Without one, Kafka requests get a deterministic
    /// id from (topic, partition, offset) and gRPC requests a random one.
    pub fn job_id(mut self, job_id: impl Into<String>) -> Self {
        self.request.job_id = Some(job_id.into());
        self
    }

    /// 0 is most urgent, 99 least; unset means 50.
    pub fn priority(mut self, priority: u32) -> Self {
        self.request.priority = Some(priority);
        self
    }

    /// Opaque bytes handed to the worker unchanged.
    pub fn payload(mut self, payload: impl Into<Vec<u8>>) -> Self {
        self.request.payload = payload.into();
        self
    }

    /// Do not start acquiring before `at`.
    pub fn run_at(mut self, at: SystemTime) -> Self {
        let millis = at
            .duration_since(UNIX_EPOCH)
            .map(|since| i64::try_from(since.as_millis()).unwrap_or(i64::MAX))
            .unwrap_or(0);
        self.request.run_at_ms = Some(millis);
        self
    }

    /// Do not start acquiring before `delay` from now.
    pub fn run_after(self, delay: Duration) -> Self {
        let at = SystemTime::now() + delay;
        self.run_at(at)
    }

    /// A second request with the same (tenant, key) inside the service's
    /// default window (24 h) returns the first job, `deduplicated = true`.
    pub fn idempotency_key(mut self, key: impl Into<String>) -> Self {
        self.request.idempotency_key = key.into();
        self.request.idempotency_window.clear();
        self
    }

    /// Like [`JobBuilder::idempotency_key`], with the window given.
    pub fn idempotency(mut self, key: impl Into<String>, window: Duration) -> Self {
        self.request.idempotency_key = key.into();
        self.request.idempotency_window = duration_text(window);
        self
    }

    pub fn retry(mut self, policy: RetryPolicy) -> Self {
        self.request.retry = Some(policy.into_proto());
        self
    }

    /// The job's flow among a key's waiters: flows share a key by weighted
    /// round-robin (`sluice keys set-weight`); no fairness key: the default flow.
    pub fn fairness_key(mut self, key: impl Into<String>) -> Self {
        self.request.fairness_key = key.into();
        self
    }

    /// At most `max_concurrency` holders of `key` (in this tenant) at once.
    pub fn concurrency(mut self, key: impl Into<String>, max_concurrency: u32) -> Self {
        self.request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                key: key.into(),
                max_concurrency,
                shadow: false,
            })),
        });
        self
    }

    /// A concurrency limit whose max your refresh handler recomputes.
    pub fn floating(mut self, limit: FloatingLimit) -> Self {
        self.request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Floating(limit.into_proto())),
        });
        self
    }

    /// A concurrency limit whose max Sluice computes from the key's run
    /// times and outcomes.
    pub fn adaptive(mut self, limit: AdaptiveLimit) -> Self {
        self.request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Adaptive(limit.proto)),
        });
        self
    }

    /// An inline sliding-window rate limit.
    pub fn rate(mut self, rate: InlineRate) -> Self {
        self.request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::Inline(rate.into_proto())),
            })),
        });
        self
    }

    /// A reference to a stored rate-limit resource (`RateLimits.PutRateLimit`).
    pub fn rate_limit_key(mut self, resource_key: impl Into<String>) -> Self {
        self.request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::RateLimitKey(resource_key.into())),
            })),
        });
        self
    }

    /// Any limit, as the protobuf message.
    pub fn limit(mut self, limit: pb::Limit) -> Self {
        self.request.limits.push(limit);
        self
    }

    /// The request, or the first field the service would refuse.
    pub fn build(self) -> Result<pb::JobRequest> {
        check_request(&self.request)?;
        Ok(self.request)
    }
}

/// A floating concurrency limit: `{key, default_max, refresh_interval_ms, metadata}`.
#[derive(Clone, Debug)]
pub struct FloatingLimit {
    key: String,
    default_max: u32,
    refresh_interval: Duration,
    metadata: BTreeMap<String, String>,
}

impl FloatingLimit {
    /// The first job that names `key` creates its shared state with
    /// `default_max`; later jobs' values are ignored. Refreshed every 60 s
    /// unless [`FloatingLimit::refresh_every`] says otherwise.
    pub fn new(key: impl Into<String>, default_max: u32) -> Self {
        FloatingLimit {
            key: key.into(),
            default_max,
            refresh_interval: Duration::from_secs(60),
            metadata: BTreeMap::new(),
        }
    }

    pub fn refresh_every(mut self, interval: Duration) -> Self {
        self.refresh_interval = interval;
        self
    }

    /// Passed to the refresh handler unchanged.
    pub fn metadata(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.metadata.insert(name.into(), value.into());
        self
    }

    fn into_proto(self) -> pb::FloatingConcurrencyLimit {
        pb::FloatingConcurrencyLimit {
            key: self.key,
            default_max: self.default_max,
            refresh_interval_ms: u64::try_from(self.refresh_interval.as_millis()).unwrap_or(u64::MAX),
            metadata: self.metadata.into_iter().collect(),
        }
    }
}

/// An adaptive concurrency limit: Sluice computes the key's max between
/// `min` and `max` from its jobs' run times (claim to completion) and
/// outcomes. The first job that names `key` creates its state; later jobs'
/// values are ignored.
#[derive(Clone, Debug)]
pub struct AdaptiveLimit {
    proto: pb::AdaptiveConcurrencyLimit,
}

impl AdaptiveLimit {
    /// A max between `min` and `max`, starting at `min`; errors (10 % of a
    /// window) are the only signal until [`AdaptiveLimit::target_latency`].
    pub fn new(key: impl Into<String>, min: u32, max: u32) -> Self {
        AdaptiveLimit {
            proto: pb::AdaptiveConcurrencyLimit {
                key: key.into(),
                min,
                max,
                ..Default::default()
            },
        }
    }

    /// The mean run time above which the max shrinks.
    pub fn target_latency(mut self, target: Duration) -> Self {
        self.proto.target_latency_ms = u64::try_from(target.as_millis()).unwrap_or(u64::MAX);
        self
    }

    /// Start from this max instead of `min`.
    pub fn initial(mut self, initial: u32) -> Self {
        self.proto.initial = initial;
        self
    }

    /// The share of failed completions (0 to 1) above which the max shrinks.
    pub fn max_error_ratio(mut self, ratio: f64) -> Self {
        self.proto.max_error_ratio = ratio;
        self
    }

    /// How far one window moves the max down toward what it computed (0 to 1).
    pub fn smoothing(mut self, smoothing: f64) -> Self {
        self.proto.smoothing = smoothing;
        self
    }
}

/// An inline rate limit: at most `limit` units per sliding `duration` for
/// (tenant, name, unique_key).
#[derive(Clone, Debug)]
pub struct InlineRate {
    name: String,
    unique_key: String,
    limit: i64,
    duration: Duration,
    cost: i64,
}

impl InlineRate {
    pub fn new(name: impl Into<String>, limit: i64, duration: Duration) -> Self {
        InlineRate {
            name: name.into(),
            unique_key: String::new(),
            limit,
            duration,
            cost: 1,
        }
    }

    /// Split the window per value (e.g. a user id).
    pub fn unique_key(mut self, unique_key: impl Into<String>) -> Self {
        self.unique_key = unique_key.into();
        self
    }

    /// Units this job takes (default 1).
    pub fn cost(mut self, cost: i64) -> Self {
        self.cost = cost;
        self
    }

    fn into_proto(self) -> pb::InlineRateLimit {
        pb::InlineRateLimit {
            name: self.name,
            unique_key: self.unique_key,
            limit: self.limit,
            duration_ms: i64::try_from(self.duration.as_millis()).unwrap_or(i64::MAX),
            cost: self.cost,
        }
    }
}

/// How often a job is tried, and what a lost lease means.
#[derive(Clone, Debug, Default)]
pub struct RetryPolicy {
    proto: pb::RetryPolicy,
}

impl RetryPolicy {
    /// `max_attempts` in total, the first included (1: no retry).
    pub fn attempts(max_attempts: u32) -> Self {
        RetryPolicy {
            proto: pb::RetryPolicy {
                max_attempts,
                ..Default::default()
            },
        }
    }

    /// Backoff before attempt n+1 is `initial * multiplier^(n-1)`, capped at
    /// `max` (defaults 1 s, 5 min, multiplier 2).
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.proto.initial_backoff = duration_text(initial);
        self.proto.max_backoff = duration_text(max);
        self
    }

    pub fn multiplier(mut self, multiplier: f64) -> Self {
        self.proto.backoff_multiplier = multiplier;
        self
    }

    /// A lost lease (the worker died) fails the job instead of retrying it.
    pub fn fail_on_lease_expiry(mut self) -> Self {
        self.proto.on_lease_expiry = pb::LeaseExpiryPolicy::Fail as i32;
        self
    }

    fn into_proto(self) -> pb::RetryPolicy {
        self.proto
    }
}

/// A duration as the service parses it ("1500ms").
fn duration_text(duration: Duration) -> String {
    format!("{}ms", duration.as_millis())
}

/// The checks a request can fail without asking the service: empty or
/// reserved names, out-of-range numbers. The service checks again (it knows
/// the declared task groups and the size limits).
pub(crate) fn check_request(request: &pb::JobRequest) -> Result<()> {
    if request.tenant.is_empty() {
        return Err(Error::invalid("tenant", "must not be empty"));
    }
    if request.tenant == GLOBAL_TENANT {
        return Err(Error::invalid("tenant", "\"*\" is reserved for global caps"));
    }
    if request.task_group.is_empty() {
        return Err(Error::invalid("task_group", "must not be empty"));
    }
    if request.priority.is_some_and(|priority| priority > 99) {
        return Err(Error::invalid("priority", "must be 0 (most urgent) to 99"));
    }
    if request.idempotency_key.is_empty() && !request.idempotency_window.is_empty() {
        return Err(Error::invalid(
            "idempotency_window",
            "set only together with idempotency_key",
        ));
    }
    if request.idempotency_window == "0ms" {
        return Err(Error::invalid("idempotency_window", "must be greater than 0"));
    }
    for (index, limit) in request.limits.iter().enumerate() {
        check_limit(limit).map_err(|error| match error {
            Error::InvalidRequest { field, message } => Error::InvalidRequest {
                field: format!("limits[{index}].{field}"),
                message,
            },
            other => other,
        })?;
    }
    Ok(())
}

fn check_limit(limit: &pb::Limit) -> Result<()> {
    match &limit.kind {
        None => Err(Error::invalid("kind", "set concurrency, floating, rate or adaptive")),
        Some(pb::limit::Kind::Adaptive(adaptive)) => {
            if adaptive.key.is_empty() {
                return Err(Error::invalid("adaptive.key", "must not be empty"));
            }
            if adaptive.max != 0 && adaptive.max < adaptive.min {
                return Err(Error::invalid("adaptive.max", "must be at least min"));
            }
            for (name, value) in [
                ("max_error_ratio", adaptive.max_error_ratio),
                ("smoothing", adaptive.smoothing),
            ] {
                if !(0.0..=1.0).contains(&value) {
                    return Err(Error::invalid(format!("adaptive.{name}"), "must be between 0 and 1"));
                }
            }
            Ok(())
        }
        Some(pb::limit::Kind::Concurrency(concurrency)) => {
            if concurrency.key.is_empty() {
                return Err(Error::invalid("concurrency.key", "must not be empty"));
            }
            if concurrency.max_concurrency == 0 {
                return Err(Error::invalid("concurrency.max_concurrency", "must be at least 1"));
            }
            Ok(())
        }
        Some(pb::limit::Kind::Floating(floating)) => {
            if floating.key.is_empty() {
                return Err(Error::invalid("floating.key", "must not be empty"));
            }
            if floating.default_max == 0 {
                return Err(Error::invalid("floating.default_max", "must be at least 1"));
            }
            if floating.refresh_interval_ms == 0 {
                return Err(Error::invalid("floating.refresh_interval_ms", "must be greater than 0"));
            }
            Ok(())
        }
        Some(pb::limit::Kind::Rate(rate)) => match &rate.spec {
            None => Err(Error::invalid("rate.spec", "set inline or rate_limit_key")),
            Some(pb::rate_limit::Spec::RateLimitKey(key)) => {
                if key.is_empty() {
                    return Err(Error::invalid("rate.rate_limit_key", "must not be empty"));
                }
                Ok(())
            }
            Some(pb::rate_limit::Spec::Inline(inline)) => {
                if inline.name.is_empty() {
                    return Err(Error::invalid("rate.inline.name", "must not be empty"));
                }
                if inline.limit < 1 {
                    return Err(Error::invalid("rate.inline.limit", "must be at least 1"));
                }
                if inline.duration_ms < 1 {
                    return Err(Error::invalid("rate.inline.duration_ms", "must be at least 1"));
                }
                if inline.cost < 0 || inline.cost > inline.limit {
                    return Err(Error::invalid(
                        "rate.inline.cost",
                        "must be 0 (meaning 1) up to the limit",
                    ));
                }
                Ok(())
            }
        },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    #[test]
    fn builds_every_limit_kind() {
        let request = JobBuilder::new("acme", "default")
            .job_id("j1")
            .priority(3)
            .payload(b"hello".to_vec())
            .concurrency("db", 2)
            .floating(
                FloatingLimit::new("gpu", 1)
                    .refresh_every(Duration::from_millis(250))
                    .metadata("pool", "a100"),
            )
            .rate(
                InlineRate::new("api", 10, Duration::from_secs(1))
                    .unique_key("u1")
                    .cost(2),
            )
            .rate_limit_key("stored")
            .idempotency("k", Duration::from_secs(90))
            .retry(
                RetryPolicy::attempts(3)
                    .backoff(Duration::from_millis(500), Duration::from_secs(10))
                    .fail_on_lease_expiry(),
            )
            .build()
            .unwrap();
        assert_eq!(request.job_id.as_deref(), Some("j1"));
        assert_eq!(request.priority, Some(3));
        assert_eq!(request.limits.len(), 4);
        assert_eq!(request.idempotency_window, "90000ms");
        let retry = request.retry.unwrap();
        assert_eq!(retry.max_attempts, 3);
        assert_eq!(retry.initial_backoff, "500ms");
        assert_eq!(retry.on_lease_expiry, pb::LeaseExpiryPolicy::Fail as i32);
        match &request.limits[1].kind {
            Some(pb::limit::Kind::Floating(floating)) => {
                assert_eq!(floating.refresh_interval_ms, 250);
                assert_eq!(floating.metadata.get("pool").map(String::as_str), Some("a100"));
            }
            other => panic!("not floating: {other:?}"),
        }
        match &request.limits[2].kind {
            Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::Inline(inline)),
            })) => {
                assert_eq!((inline.limit, inline.duration_ms, inline.cost), (10, 1000, 2));
                assert_eq!(inline.unique_key, "u1");
            }
            other => panic!("not an inline rate: {other:?}"),
        }
    }

    #[test]
    fn refusals_name_the_field() {
        let field_of = |builder: JobBuilder| match builder.build() {
            Err(Error::InvalidRequest { field, .. }) => field,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert_eq!(field_of(JobBuilder::new("", "default")), "tenant");
        assert_eq!(field_of(JobBuilder::new("*", "default")), "tenant");
        assert_eq!(field_of(JobBuilder::new("t", "")), "task_group");
        assert_eq!(field_of(JobBuilder::new("t", "g").priority(100)), "priority");
        assert_eq!(
            field_of(JobBuilder::new("t", "g").concurrency("a", 1).concurrency("b", 0)),
            "limits[1].concurrency.max_concurrency"
        );
        assert_eq!(
            field_of(JobBuilder::new("t", "g").floating(FloatingLimit::new("f", 0))),
            "limits[0].floating.default_max"
        );
        assert_eq!(
            field_of(JobBuilder::new("t", "g").rate(InlineRate::new("r", 5, Duration::ZERO))),
            "limits[0].rate.inline.duration_ms"
        );
    }
}
