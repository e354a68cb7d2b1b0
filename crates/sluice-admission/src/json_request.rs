//! The JSON form of `sluice.v1.JobRequest`, for producers that do not speak
//! protobuf: a message on `jobs.requested` whose `content-type` header is
//! `application/json`.
//!
//! The JSON is decoded into the protobuf types and then goes through the same
//! validation as a protobuf request (`chain::validate`), so both forms are
//! checked identically. This module only checks what JSON adds: the shape,
//! the types, unknown fields, and the JSON-only conveniences (`payload` as
//! text or `payload_base64`, `run_at` as an RFC 3339 time). The schema users
//! read is `docs/job-request.schema.json`; a unit test keeps the field lists
//! here and there equal.
//!
//! Errors name the field with the same path `chain::validate` uses
//! (`limits[1].concurrency.max_concurrency`), and become the dead-letter
//! reason.

use std::collections::HashMap;

use base64::Engine as _;
use serde_json::{Map, Value};
use sluice_common::validate::FieldError;
use sluice_proto::v1 as pb;

/// Top-level fields of a JSON job request.
pub const JOB_REQUEST_FIELDS: &[&str] = &[
    "job_id",
    "tenant",
    "task_group",
    "priority",
    "payload",
    "payload_base64",
    "run_at_ms",
    "run_at",
    "idempotency_key",
    "idempotency_window",
    "retry",
    "limits",
    "fairness_key",
];
pub const RETRY_FIELDS: &[&str] = &[
    "max_attempts",
    "initial_backoff",
    "max_backoff",
    "backoff_multiplier",
    "on_lease_expiry",
];
pub const LIMIT_FIELDS: &[&str] = &["concurrency", "floating", "rate", "adaptive"];
pub const CONCURRENCY_FIELDS: &[&str] = &["key", "max_concurrency", "shadow"];
pub const FLOATING_FIELDS: &[&str] = &["key", "default_max", "refresh_interval_ms", "metadata"];
pub const ADAPTIVE_FIELDS: &[&str] = &[
    "key",
    "min",
    "max",
    "initial",
    "target_latency_ms",
    "max_error_ratio",
    "smoothing",
];
pub const RATE_FIELDS: &[&str] = &["inline", "rate_limit_key"];
pub const INLINE_RATE_FIELDS: &[&str] = &["name", "unique_key", "limit", "duration_ms", "cost"];

/// Why a JSON message is not a job request. Its text is the dead-letter reason.
#[derive(Debug, thiserror::Error)]
pub enum JsonRequestError {
    /// Not JSON, or not a JSON object.
    #[error("{0}")]
    Message(String),
    #[error(transparent)]
    Field(#[from] FieldError),
}

/// Decode a JSON job request into the protobuf type. The result still has to
/// pass `chain::validate`.
pub fn decode_json_request(bytes: &[u8]) -> Result<pb::JobRequest, JsonRequestError> {
    let document: Value = serde_json::from_slice(bytes)
        .map_err(|error| JsonRequestError::Message(format!("message is not valid JSON: {error}")))?;
    let Value::Object(fields) = &document else {
        return Err(JsonRequestError::Message(format!(
            "message must be a JSON object (a sluice.v1.JobRequest), not {}",
            type_name(&document)
        )));
    };
    let top = Fields::new(String::new(), fields, JOB_REQUEST_FIELDS)?;
    Ok(job_request(&top)?)
}

fn job_request(top: &Fields<'_>) -> Result<pb::JobRequest, FieldError> {
    let payload = match (top.string("payload")?, top.string("payload_base64")?) {
        (Some(_), Some(_)) => {
            return Err(FieldError::new(
                "payload_base64",
                "set payload (text) or payload_base64 (bytes), not both",
            ))
        }
        (Some(text), None) => text.into_bytes(),
        (None, Some(encoded)) => base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|error| {
                FieldError::new(
                    "payload_base64",
                    format!("is not standard base64 (RFC 4648, with padding): {error}"),
                )
            })?,
        (None, None) => Vec::new(),
    };
    let run_at_ms = match (top.i64("run_at_ms")?, top.string("run_at")?) {
        (Some(_), Some(_)) => return Err(FieldError::new("run_at", "set run_at or run_at_ms, not both")),
        (Some(millis), None) => Some(millis),
        (None, Some(text)) => Some(rfc3339_to_unix_ms(&text)?),
        (None, None) => None,
    };
    let retry = match top.object("retry", RETRY_FIELDS)? {
        Some(retry) => Some(retry_policy(&retry)?),
        None => None,
    };
    let limits = top
        .array("limits")?
        .into_iter()
        .enumerate()
        .map(|(index, value)| limit(&top.child_path(&format!("limits[{index}]")), value))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(pb::JobRequest {
        job_id: top.string("job_id")?,
        tenant: top.string("tenant")?.unwrap_or_default(),
        task_group: top.string("task_group")?.unwrap_or_default(),
        priority: top.u32("priority")?,
        payload,
        run_at_ms,
        idempotency_key: top.string("idempotency_key")?.unwrap_or_default(),
        idempotency_window: top.string("idempotency_window")?.unwrap_or_default(),
        retry,
        limits,
        fairness_key: top.string("fairness_key")?.unwrap_or_default(),
    })
}

fn retry_policy(retry: &Fields<'_>) -> Result<pb::RetryPolicy, FieldError> {
    let on_lease_expiry = match retry.string("on_lease_expiry")? {
        None => pb::LeaseExpiryPolicy::Unspecified,
        Some(name) => lease_expiry_policy(&name).ok_or_else(|| {
            FieldError::new(
                retry.field("on_lease_expiry"),
                format!("unknown policy {name:?} (expected \"retry\" or \"fail\")"),
            )
        })?,
    };
    Ok(pb::RetryPolicy {
        max_attempts: retry.u32("max_attempts")?.unwrap_or_default(),
        initial_backoff: retry.string("initial_backoff")?.unwrap_or_default(),
        max_backoff: retry.string("max_backoff")?.unwrap_or_default(),
        backoff_multiplier: retry.f64("backoff_multiplier")?.unwrap_or_default(),
        on_lease_expiry: on_lease_expiry as i32,
    })
}

/// `retry` / `fail`, in any case, with or without the proto enum's prefix.
fn lease_expiry_policy(name: &str) -> Option<pb::LeaseExpiryPolicy> {
    let upper = name.trim().to_ascii_uppercase();
    let short = upper.strip_prefix("LEASE_EXPIRY_POLICY_").unwrap_or(&upper);
    match short {
        "RETRY" => Some(pb::LeaseExpiryPolicy::Retry),
        "FAIL" => Some(pb::LeaseExpiryPolicy::Fail),
        "UNSPECIFIED" => Some(pb::LeaseExpiryPolicy::Unspecified),
        _ => None,
    }
}

fn limit(path: &str, value: &Value) -> Result<pb::Limit, FieldError> {
    let fields = Fields::of_value(path, value, LIMIT_FIELDS)?;
    let present = fields.present(LIMIT_FIELDS);
    if present.len() != 1 {
        return Err(FieldError::new(path, exactly_one_message(LIMIT_FIELDS, &present)));
    }
    let kind = if let Some(concurrency) = fields.object("concurrency", CONCURRENCY_FIELDS)? {
        pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
            key: concurrency.string("key")?.unwrap_or_default(),
            max_concurrency: concurrency.u32("max_concurrency")?.unwrap_or_default(),
            shadow: concurrency.bool("shadow")?.unwrap_or_default(),
        })
    } else if let Some(floating) = fields.object("floating", FLOATING_FIELDS)? {
        pb::limit::Kind::Floating(pb::FloatingConcurrencyLimit {
            key: floating.string("key")?.unwrap_or_default(),
            default_max: floating.u32("default_max")?.unwrap_or_default(),
            refresh_interval_ms: floating.u64("refresh_interval_ms")?.unwrap_or_default(),
            metadata: floating.string_map("metadata")?,
        })
    } else if let Some(rate) = fields.object("rate", RATE_FIELDS)? {
        pb::limit::Kind::Rate(rate_limit(&rate)?)
    } else if let Some(adaptive) = fields.object("adaptive", ADAPTIVE_FIELDS)? {
        pb::limit::Kind::Adaptive(pb::AdaptiveConcurrencyLimit {
            key: adaptive.string("key")?.unwrap_or_default(),
            min: adaptive.u32("min")?.unwrap_or_default(),
            max: adaptive.u32("max")?.unwrap_or_default(),
            initial: adaptive.u32("initial")?.unwrap_or_default(),
            target_latency_ms: adaptive.u64("target_latency_ms")?.unwrap_or_default(),
            max_error_ratio: adaptive.f64("max_error_ratio")?.unwrap_or_default(),
            smoothing: adaptive.f64("smoothing")?.unwrap_or_default(),
        })
    } else {
        return Err(FieldError::new(path, exactly_one_message(LIMIT_FIELDS, &[])));
    };
    Ok(pb::Limit { kind: Some(kind) })
}

fn rate_limit(rate: &Fields<'_>) -> Result<pb::RateLimit, FieldError> {
    let present = rate.present(RATE_FIELDS);
    if present.len() != 1 {
        return Err(FieldError::new(
            rate.path.clone(),
            exactly_one_message(RATE_FIELDS, &present),
        ));
    }
    let spec = if let Some(inline) = rate.object("inline", INLINE_RATE_FIELDS)? {
        pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
            name: inline.string("name")?.unwrap_or_default(),
            unique_key: inline.string("unique_key")?.unwrap_or_default(),
            limit: inline.i64("limit")?.unwrap_or_default(),
            duration_ms: inline.i64("duration_ms")?.unwrap_or_default(),
            cost: inline.i64("cost")?.unwrap_or_default(),
        })
    } else {
        pb::rate_limit::Spec::RateLimitKey(rate.string("rate_limit_key")?.unwrap_or_default())
    };
    Ok(pb::RateLimit { spec: Some(spec) })
}

fn exactly_one_message(allowed: &[&str], present: &[&str]) -> String {
    if present.is_empty() {
        format!("set exactly one of {}", allowed.join(", "))
    } else {
        format!(
            "set exactly one of {}, not {}",
            allowed.join(", "),
            present.join(" and ")
        )
    }
}

/// `2030-01-01T00:00:00Z` (UTC, optional fraction) to unix milliseconds.
fn rfc3339_to_unix_ms(text: &str) -> Result<i64, FieldError> {
    let time = humantime::parse_rfc3339(text.trim()).map_err(|error| {
        FieldError::new(
            "run_at",
            format!("{text:?} is not an RFC 3339 UTC time like 2030-01-01T09:30:00Z ({error})"),
        )
    })?;
    let since_epoch = time
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| FieldError::new("run_at", "must not be before 1970"))?;
    i64::try_from(since_epoch.as_millis()).map_err(|_| FieldError::new("run_at", "is too far in the future"))
}

fn type_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The fields of one JSON object, at `path` in the request, with typed
/// getters that name the field in their errors. `null` counts as absent, as
/// in protobuf's JSON mapping.
struct Fields<'a> {
    path: String,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    /// Refuse names outside `allowed`, naming the first unknown one.
    fn new(path: String, map: &'a Map<String, Value>, allowed: &[&str]) -> Result<Self, FieldError> {
        let fields = Fields { path, map };
        if let Some(unknown) = map.keys().find(|name| !allowed.contains(&name.as_str())) {
            let hint = snake_case(unknown)
                .filter(|snake| allowed.contains(&snake.as_str()))
                .map(|snake| format!("; field names are snake_case: did you mean {snake:?}?"))
                .unwrap_or_default();
            return Err(FieldError::new(
                fields.field(unknown),
                format!("unknown field (expected one of: {}){hint}", allowed.join(", ")),
            ));
        }
        Ok(fields)
    }

    fn of_value(path: &str, value: &'a Value, allowed: &[&str]) -> Result<Self, FieldError> {
        match value {
            Value::Object(map) => Fields::new(path.to_string(), map, allowed),
            other => Err(FieldError::new(
                path,
                format!("must be an object, not {}", type_name(other)),
            )),
        }
    }

    fn field(&self, name: &str) -> String {
        self.child_path(name)
    }

    fn child_path(&self, name: &str) -> String {
        if self.path.is_empty() {
            name.to_string()
        } else {
            format!("{}.{name}", self.path)
        }
    }

    fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name).filter(|value| !value.is_null())
    }

    fn present(&self, names: &[&'static str]) -> Vec<&'static str> {
        names.iter().copied().filter(|name| self.get(name).is_some()).collect()
    }

    fn wrong_type(&self, name: &str, expected: &str, found: &Value) -> FieldError {
        FieldError::new(
            self.field(name),
            format!("must be {expected}, not {}", type_name(found)),
        )
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, FieldError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(value)) => Ok(Some(*value)),
            Some(other) => Err(self.wrong_type(name, "true or false", other)),
        }
    }

    fn string(&self, name: &str) -> Result<Option<String>, FieldError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(text)) => Ok(Some(text.clone())),
            Some(other) => Err(self.wrong_type(name, "a string", other)),
        }
    }

    /// An integer given as a JSON number or, as protobuf's JSON mapping
    /// allows for 64-bit values, a string of decimal digits.
    fn integer<T>(&self, name: &str, range: &str) -> Result<Option<T>, FieldError>
    where
        T: TryFrom<i128> + std::str::FromStr,
    {
        let out_of_range = || FieldError::new(self.field(name), format!("must be an integer from {range}"));
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(number)) => {
                let whole = number
                    .as_i64()
                    .map(i128::from)
                    .or_else(|| number.as_u64().map(i128::from))
                    .ok_or_else(out_of_range)?;
                T::try_from(whole).map(Some).map_err(|_| out_of_range())
            }
            Some(Value::String(text)) => text.trim().parse::<T>().map(Some).map_err(|_| out_of_range()),
            Some(other) => Err(self.wrong_type(name, &format!("an integer from {range}"), other)),
        }
    }

    fn u32(&self, name: &str) -> Result<Option<u32>, FieldError> {
        self.integer(name, "0 to 4294967295")
    }

    fn u64(&self, name: &str) -> Result<Option<u64>, FieldError> {
        self.integer(name, "0 to 18446744073709551615")
    }

    fn i64(&self, name: &str) -> Result<Option<i64>, FieldError> {
        self.integer(name, "-9223372036854775808 to 9223372036854775807")
    }

    fn f64(&self, name: &str) -> Result<Option<f64>, FieldError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Number(number)) => number
                .as_f64()
                .map(Some)
                .ok_or_else(|| FieldError::new(self.field(name), "must be a finite number")),
            Some(other) => Err(self.wrong_type(name, "a number", other)),
        }
    }

    fn object(&self, name: &str, allowed: &[&str]) -> Result<Option<Fields<'a>>, FieldError> {
        match self.get(name) {
            None => Ok(None),
            Some(value) => Fields::of_value(&self.field(name), value, allowed).map(Some),
        }
    }

    fn array(&self, name: &str) -> Result<Vec<&'a Value>, FieldError> {
        match self.get(name) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => Ok(items.iter().collect()),
            Some(other) => Err(self.wrong_type(name, "an array", other)),
        }
    }

    fn string_map(&self, name: &str) -> Result<HashMap<String, String>, FieldError> {
        match self.get(name) {
            None => Ok(HashMap::new()),
            Some(Value::Object(entries)) => entries
                .iter()
                .map(|(key, value)| match value {
                    Value::String(text) => Ok((key.clone(), text.clone())),
                    other => Err(FieldError::new(
                        format!("{}.{key}", self.field(name)),
                        format!("must be a string, not {}", type_name(other)),
                    )),
                })
                .collect(),
            Some(other) => Err(self.wrong_type(name, "an object of strings", other)),
        }
    }
}

/// `maxConcurrency` -> `max_concurrency`; `None` when there is nothing to change.
fn snake_case(name: &str) -> Option<String> {
    if !name.chars().any(|c| c.is_ascii_uppercase()) {
        return None;
    }
    let mut snake = String::with_capacity(name.len() + 4);
    for c in name.chars() {
        if c.is_ascii_uppercase() {
            snake.push('_');
            snake.push(c.to_ascii_lowercase());
        } else {
            snake.push(c);
        }
    }
    Some(snake)
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_common::SluiceConfig;

    fn decode(text: &str) -> Result<pb::JobRequest, String> {
        decode_json_request(text.as_bytes()).map_err(|error| error.to_string())
    }

    #[test]
    fn a_full_request_decodes_into_the_protobuf_types() {
        let request = decode(
            r#"{
              "job_id": "job-1", "tenant": "acme", "task_group": "default", "priority": 5,
              "payload": "{\"user\": 42}", "run_at_ms": "1700000000000",
              "idempotency_key": "k", "idempotency_window": "1h", "fairness_key": "f",
              "retry": {"max_attempts": 3, "initial_backoff": "1s", "max_backoff": "1m",
                        "backoff_multiplier": 1.5, "on_lease_expiry": "fail"},
              "limits": [
                {"concurrency": {"key": "db", "max_concurrency": 2}},
                {"floating": {"key": "gpu", "default_max": 4, "refresh_interval_ms": 60000,
                              "metadata": {"pool": "a100"}}},
                {"rate": {"inline": {"name": "api", "unique_key": "u", "limit": 10,
                                     "duration_ms": 1000, "cost": 2}}},
                {"rate": {"rate_limit_key": "stored"}}
              ]
            }"#,
        )
        .unwrap();
        let expected = pb::JobRequest {
            job_id: Some("job-1".to_string()),
            tenant: "acme".to_string(),
            task_group: "default".to_string(),
            priority: Some(5),
            payload: br#"{"user": 42}"#.to_vec(),
            run_at_ms: Some(1_700_000_000_000),
            idempotency_key: "k".to_string(),
            idempotency_window: "1h".to_string(),
            retry: Some(pb::RetryPolicy {
                max_attempts: 3,
                initial_backoff: "1s".to_string(),
                max_backoff: "1m".to_string(),
                backoff_multiplier: 1.5,
                on_lease_expiry: pb::LeaseExpiryPolicy::Fail as i32,
            }),
            limits: vec![
                pb::Limit {
                    kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                        key: "db".to_string(),
                        max_concurrency: 2,
                        shadow: false,
                    })),
                },
                pb::Limit {
                    kind: Some(pb::limit::Kind::Floating(pb::FloatingConcurrencyLimit {
                        key: "gpu".to_string(),
                        default_max: 4,
                        refresh_interval_ms: 60_000,
                        metadata: [("pool".to_string(), "a100".to_string())].into_iter().collect(),
                    })),
                },
                pb::Limit {
                    kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                        spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
                            name: "api".to_string(),
                            unique_key: "u".to_string(),
                            limit: 10,
                            duration_ms: 1000,
                            cost: 2,
                        })),
                    })),
                },
                pb::Limit {
                    kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                        spec: Some(pb::rate_limit::Spec::RateLimitKey("stored".to_string())),
                    })),
                },
            ],
            fairness_key: "f".to_string(),
        };
        assert_eq!(request, expected);
    }

    #[test]
    fn payload_is_text_or_base64_and_run_at_may_be_rfc3339() {
        let binary = decode(r#"{"tenant": "t", "payload_base64": "AP8Q"}"#).unwrap();
        assert_eq!(binary.payload, vec![0x00, 0xff, 0x10]);
        let text = decode(r#"{"tenant": "t", "payload": "héllo"}"#).unwrap();
        assert_eq!(text.payload, "héllo".as_bytes());
        let scheduled = decode(r#"{"tenant": "t", "run_at": "2030-01-01T00:00:00.250Z"}"#).unwrap();
        assert_eq!(scheduled.run_at_ms, Some(1_893_456_000_250));
        let nulls = decode(r#"{"tenant": "t", "job_id": null, "priority": null, "retry": null}"#).unwrap();
        assert_eq!((nulls.job_id, nulls.priority, nulls.retry), (None, None, None));
    }

    #[test]
    fn errors_name_the_field() {
        let cases: &[(&str, &str)] = &[
            (r#"{"tenant": "t", "color": "red"}"#, "color: unknown field (expected one of: job_id,"),
            (
                r#"{"tenant": "t", "limits": [{"concurrency": {"key": "k", "maxConcurrency": 1}}]}"#,
                "limits[0].concurrency.maxConcurrency: unknown field (expected one of: key, max_concurrency, shadow); field names are snake_case: did you mean \"max_concurrency\"?",
            ),
            (
                r#"{"tenant": "t", "limits": [{"concurrency": {"key": "k", "max_concurrency": -1}}]}"#,
                "limits[0].concurrency.max_concurrency: must be an integer from 0 to 4294967295",
            ),
            (
                r#"{"tenant": "t", "limits": [{"concurrency": {"key": "k", "max_concurrency": 1.5}}]}"#,
                "limits[0].concurrency.max_concurrency: must be an integer from 0 to 4294967295",
            ),
            (r#"{"tenant": 7}"#, "tenant: must be a string, not a number"),
            (r#"{"tenant": "t", "priority": "high"}"#, "priority: must be an integer from 0 to 4294967295"),
            (r#"{"tenant": "t", "limits": {}}"#, "limits: must be an array, not an object"),
            (r#"{"tenant": "t", "limits": [7]}"#, "limits[0]: must be an object, not a number"),
            (
                r#"{"tenant": "t", "limits": [{}]}"#,
                "limits[0]: set exactly one of concurrency, floating, rate, adaptive",
            ),
            (
                r#"{"tenant": "t", "limits": [{"concurrency": {"key": "a", "max_concurrency": 1}, "rate": {"rate_limit_key": "r"}}]}"#,
                "limits[0]: set exactly one of concurrency, floating, rate, adaptive, not concurrency and rate",
            ),
            (
                r#"{"tenant": "t", "limits": [{"rate": {}}]}"#,
                "limits[0].rate: set exactly one of inline, rate_limit_key",
            ),
            (
                r#"{"tenant": "t", "limits": [{"floating": {"key": "g", "metadata": {"n": 1}}}]}"#,
                "limits[0].floating.metadata.n: must be a string, not a number",
            ),
            (
                r#"{"tenant": "t", "retry": {"on_lease_expiry": "sometimes"}}"#,
                "retry.on_lease_expiry: unknown policy \"sometimes\"",
            ),
            (
                r#"{"tenant": "t", "payload": "a", "payload_base64": "YQ=="}"#,
                "payload_base64: set payload (text) or payload_base64 (bytes), not both",
            ),
            (r#"{"tenant": "t", "payload_base64": "not base64!"}"#, "payload_base64: is not standard base64"),
            (r#"{"tenant": "t", "run_at": "tomorrow"}"#, "run_at: \"tomorrow\" is not an RFC 3339 UTC time"),
            (r#"{"tenant": "t""#, "message is not valid JSON: EOF while parsing an object"),
            (r#"[1, 2]"#, "message must be a JSON object (a sluice.v1.JobRequest), not an array"),
        ];
        for (input, expected) in cases {
            let error = decode(input).unwrap_err();
            assert!(
                error.starts_with(expected),
                "{input}\n  gave: {error}\n  want: {expected}"
            );
        }
    }

    #[test]
    fn an_adaptive_limit_decodes_and_its_wrong_types_name_the_field() {
        let request = decode(
            r#"{"tenant": "acme", "task_group": "default",
                "limits": [{"adaptive": {"key": "api", "min": 2, "max": 40, "target_latency_ms": 250,
                                         "max_error_ratio": 0.05, "smoothing": 0.25}}]}"#,
        )
        .unwrap();
        let Some(pb::limit::Kind::Adaptive(adaptive)) = &request.limits[0].kind else {
            panic!("an adaptive limit: {request:?}");
        };
        assert_eq!((adaptive.min, adaptive.max, adaptive.target_latency_ms), (2, 40, 250));
        assert_eq!((adaptive.max_error_ratio, adaptive.smoothing), (0.05, 0.25));
        let cases = [
            (r#"{"smoothing": "half"}"#, "limits[0].adaptive.smoothing"),
            (r#"{"max": -1}"#, "limits[0].adaptive.max"),
            (r#"{"target": 5}"#, "limits[0].adaptive"),
        ];
        for (fields, field) in cases {
            let input =
                format!(r#"{{"tenant": "acme", "task_group": "default", "limits": [{{"adaptive": {fields}}}]}}"#);
            let error = decode(&input).unwrap_err();
            assert!(error.starts_with(field), "{input}\n  gave: {error}\n  want: {field}");
        }
        // The shadow flag of a concurrency limit must be a boolean.
        let error = decode(
            r#"{"tenant": "acme", "task_group": "default",
                "limits": [{"concurrency": {"key": "k", "max_concurrency": 1, "shadow": "yes"}}]}"#,
        )
        .unwrap_err();
        assert!(error.starts_with("limits[0].concurrency.shadow"), "{error}");
    }

    #[test]
    fn json_requests_go_through_the_same_validation_as_protobuf() {
        let config = SluiceConfig::load_with(None, &[]).unwrap();
        let request = decode(
            r#"{"tenant": "acme", "task_group": "default",
                "limits": [{"concurrency": {"key": "k", "max_concurrency": 0}}]}"#,
        )
        .unwrap();
        let error = crate::chain::validate(&config, request).unwrap_err();
        assert_eq!(error.field, "limits[0].concurrency.max_concurrency");
    }

    /// `docs/job-request.schema.json` lists exactly the fields the decoder
    /// accepts, at every level, and refuses others.
    #[test]
    fn the_published_schema_matches_the_decoder() {
        let schema: Value = serde_json::from_str(include_str!("../../../docs/job-request.schema.json")).unwrap();
        let definition = |name: &str| -> Value {
            if name.is_empty() {
                schema.clone()
            } else {
                schema["$defs"][name].clone()
            }
        };
        let levels: &[(&str, &[&str])] = &[
            ("", JOB_REQUEST_FIELDS),
            ("RetryPolicy", RETRY_FIELDS),
            ("Limit", LIMIT_FIELDS),
            ("ConcurrencyLimit", CONCURRENCY_FIELDS),
            ("FloatingConcurrencyLimit", FLOATING_FIELDS),
            ("AdaptiveConcurrencyLimit", ADAPTIVE_FIELDS),
            ("RateLimit", RATE_FIELDS),
            ("InlineRateLimit", INLINE_RATE_FIELDS),
        ];
        for (name, fields) in levels {
            let object = definition(name);
            let mut documented: Vec<&str> = object["properties"]
                .as_object()
                .unwrap_or_else(|| panic!("schema {name:?} has properties"))
                .keys()
                .map(String::as_str)
                .collect();
            documented.sort_unstable();
            let mut accepted = fields.to_vec();
            accepted.sort_unstable();
            assert_eq!(documented, accepted, "schema {name:?}");
            assert_eq!(
                object["additionalProperties"],
                Value::Bool(false),
                "schema {name:?} refuses unknown fields"
            );
        }
    }
}
