//! Input validation shared by every service: an error names the field, so a
//! gRPC caller gets `INVALID_ARGUMENT: limits[1].concurrency.key: must not be
//! empty` and a Kafka producer gets the same text in the dead-letter header.

use sluice_proto::v1 as pb;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    pub field: String,
    pub message: String,
}

impl FieldError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        FieldError {
            field: field.into(),
            message: message.into(),
        }
    }

    /// Prefix the field with its parent, e.g. `jobs[3]`.
    pub fn within(self, parent: &str) -> Self {
        FieldError {
            field: format!("{parent}.{}", self.field),
            message: self.message,
        }
    }
}

impl From<FieldError> for tonic::Status {
    fn from(error: FieldError) -> Self {
        tonic::Status::invalid_argument(error.to_string())
    }
}

/// Upper bounds every service and PostgreSQL agree on. Admission checks a job
/// against them at the edge, so what it accepts every owner accepts; the
/// owners check the commands they receive against the same values.
///
/// The largest concurrency max, override or floating value: they are stored
/// as PostgreSQL `integer`.
pub const MAX_CONCURRENCY: u32 = 2_147_483_647;
/// The most units a rate window allows (and the largest cost).
pub const MAX_RATE_LIMIT: i64 = 1_000_000_000_000_000;
/// The longest rate window, about a century: every time sum stays far from
/// `i64` overflow for any realistic unix time.
pub const MAX_RATE_WINDOW_MS: u64 = 100 * 365 * 24 * 60 * 60 * 1000;
/// The longest stored rate-limit window, in seconds.
pub const MAX_RATE_WINDOW_SECONDS: i64 = 100 * 365 * 24 * 60 * 60;
/// The longest refresh interval of a floating limit.
pub const MAX_REFRESH_INTERVAL_MS: u64 = MAX_RATE_WINDOW_MS;
/// The longest idempotency window: ten years.
pub const MAX_IDEMPOTENCY_WINDOW_MS: i64 = 10 * 366 * 24 * 60 * 60 * 1000;
/// The longest retry backoff: thirty days.
pub const MAX_BACKOFF_MS: i64 = 30 * 24 * 60 * 60 * 1000;
/// The latest `run_at_ms`: the end of year 9999.
pub const MAX_RUN_AT_MS: i64 = 253_402_300_799_999;
/// The largest `admission.max_key_bytes` (tenants and keys are in primary
/// keys; a PostgreSQL btree entry must stay under about 2,700 bytes).
pub const MAX_KEY_BYTES: usize = 1024;
/// Job ids, worker ids, task ids.
pub const MAX_ID_BYTES: usize = 200;
/// Error messages and reasons a caller sends (failures, hand-backs,
/// cancels, refresh errors).
pub const MAX_TEXT_BYTES: usize = 16 * 1024;

/// The configured input bounds an owner checks commands against, the same
/// admission checks requests against (`admission.max_key_bytes`,
/// `admission.max_floating_metadata_bytes`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InputLimits {
    pub max_key_bytes: usize,
    pub max_floating_metadata_bytes: usize,
}

impl InputLimits {
    pub fn from_config(config: &crate::SluiceConfig) -> Self {
        InputLimits {
            max_key_bytes: config.admission.max_key_bytes,
            max_floating_metadata_bytes: config.admission.max_floating_metadata_bytes,
        }
    }
}

impl Default for InputLimits {
    /// The built-in defaults.
    fn default() -> Self {
        InputLimits {
            max_key_bytes: 256,
            max_floating_metadata_bytes: 16 * 1024,
        }
    }
}

/// Free text that is stored: at most `max_bytes`, no NUL (PostgreSQL refuses
/// it in text). May be empty.
pub fn check_text(field: &str, value: &str, max_bytes: usize) -> Result<(), FieldError> {
    if value.len() > max_bytes {
        return Err(FieldError::new(
            field,
            format!("is {} bytes; at most {max_bytes}", value.len()),
        ));
    }
    if value.contains('\0') {
        return Err(FieldError::new(field, "must not contain NUL bytes"));
    }
    Ok(())
}

/// An unsigned 32-bit field within `min..=max`. A negative number a client
/// wrote as a 64-bit varint arrives as a large one; the message says so.
pub fn check_u32(field: &str, value: u32, min: u32, max: u32) -> Result<(), FieldError> {
    if value < min {
        return Err(FieldError::new(field, below_minimum(min.into())));
    }
    if value > max {
        return Err(FieldError::new(field, out_of_range_upper(value.into(), max.into())));
    }
    Ok(())
}

/// An unsigned 64-bit field within `min..=max`.
pub fn check_u64(field: &str, value: u64, min: u64, max: u64) -> Result<(), FieldError> {
    if value < min {
        return Err(FieldError::new(field, below_minimum(min.into())));
    }
    if value > max {
        return Err(FieldError::new(field, out_of_range_upper(value, max)));
    }
    Ok(())
}

/// A signed 64-bit field within `min..=max`.
pub fn check_i64(field: &str, value: i64, min: i64, max: i64) -> Result<(), FieldError> {
    if value < min {
        return Err(FieldError::new(field, below_minimum(min.into())));
    }
    if value > max {
        return Err(FieldError::new(field, format!("{value} is above the maximum {max}")));
    }
    Ok(())
}

fn below_minimum(min: i128) -> String {
    match min {
        0 => "must not be negative".to_string(),
        1 => "must be greater than 0".to_string(),
        _ => format!("must be at least {min}"),
    }
}

fn out_of_range_upper(value: u64, max: u64) -> String {
    if value > u64::from(u32::MAX / 2) && max <= u64::from(u32::MAX) {
        format!(
            "{value} is above the maximum {max} (a negative number sent as a 64-bit varint \
             arrives as a large unsigned one)"
        )
    } else {
        format!("{value} is above the maximum {max}")
    }
}

/// A tenant or key: non-empty, at most `max_bytes`, no control characters.
pub fn check_name(field: &str, value: &str, max_bytes: usize) -> Result<(), FieldError> {
    if value.is_empty() {
        return Err(FieldError::new(field, "must not be empty"));
    }
    if value.len() > max_bytes {
        return Err(FieldError::new(field, format!("must be at most {max_bytes} bytes")));
    }
    if value.chars().any(char::is_control) {
        return Err(FieldError::new(field, "must not contain control characters"));
    }
    Ok(())
}

/// A (tenant, key) reference: both names checked, as at the edge.
pub fn check_key_ref(field: &str, key: Option<&pb::KeyRef>, max_key_bytes: usize) -> Result<(), FieldError> {
    let Some(key) = key else {
        return Err(FieldError::new(field, "must be set"));
    };
    check_name(&format!("{field}.tenant"), &key.tenant, max_key_bytes)?;
    check_name(&format!("{field}.key"), &key.key, max_key_bytes)
}

/// A ticket: its job id and an attempt from 1.
pub fn check_ticket(field: &str, ticket: Option<&pb::TicketId>) -> Result<(), FieldError> {
    let Some(ticket) = ticket else {
        return Err(FieldError::new(field, "must be set"));
    };
    check_name(&format!("{field}.job_id"), &ticket.job_id, MAX_ID_BYTES)?;
    if ticket.attempt == 0 {
        return Err(FieldError::new(format!("{field}.attempt"), "attempts start at 1"));
    }
    Ok(())
}

/// A floating limit's values, as every service stores them: its max and
/// interval within bounds, its metadata (keys and values) free of NUL bytes
/// (PostgreSQL's `jsonb` refuses `\u0000`) and at most `max_metadata_bytes`
/// in all. The key is checked by the caller.
pub fn check_floating_values(
    field: &str,
    floating: &pb::FloatingConcurrencyLimit,
    max_metadata_bytes: usize,
) -> Result<(), FieldError> {
    check_u32(
        &format!("{field}.default_max"),
        floating.default_max,
        1,
        MAX_CONCURRENCY,
    )?;
    check_u64(
        &format!("{field}.refresh_interval_ms"),
        floating.refresh_interval_ms,
        1,
        MAX_REFRESH_INTERVAL_MS,
    )?;
    check_metadata(&format!("{field}.metadata"), &floating.metadata, max_metadata_bytes)
}

/// The longest target run time of an adaptive limit (a day).
pub const MAX_TARGET_LATENCY_MS: u64 = 24 * 60 * 60 * 1000;

/// An adaptive limit's values (0 means the default for each): bounds
/// within `MAX_CONCURRENCY` with `min <= max` and `initial` between them, a
/// target run time of at most a day, ratios in [0, 1] and not NaN. The key
/// is checked by the caller.
pub fn check_adaptive_values(field: &str, adaptive: &pb::AdaptiveConcurrencyLimit) -> Result<(), FieldError> {
    check_u32(&format!("{field}.min"), adaptive.min, 0, MAX_CONCURRENCY)?;
    check_u32(&format!("{field}.max"), adaptive.max, 0, MAX_CONCURRENCY)?;
    check_u32(&format!("{field}.initial"), adaptive.initial, 0, MAX_CONCURRENCY)?;
    let min = adaptive.min.max(1);
    if adaptive.max != 0 && adaptive.max < min {
        return Err(FieldError::new(
            format!("{field}.max"),
            format!("is {}; must be at least min ({min})", adaptive.max),
        ));
    }
    if adaptive.initial != 0 && (adaptive.initial < min || (adaptive.max != 0 && adaptive.initial > adaptive.max)) {
        return Err(FieldError::new(
            format!("{field}.initial"),
            format!("is {}; must be between min and max", adaptive.initial),
        ));
    }
    check_u64(
        &format!("{field}.target_latency_ms"),
        adaptive.target_latency_ms,
        0,
        MAX_TARGET_LATENCY_MS,
    )?;
    for (name, value) in [
        ("max_error_ratio", adaptive.max_error_ratio),
        ("smoothing", adaptive.smoothing),
    ] {
        if !(0.0..=1.0).contains(&value) {
            return Err(FieldError::new(
                format!("{field}.{name}"),
                format!("is {value}; must be between 0 and 1 (0: the default)"),
            ));
        }
    }
    Ok(())
}

/// A floating limit's metadata: no NUL bytes in keys or values (PostgreSQL's
/// `jsonb` refuses `\u0000`), at most `max_bytes` of keys and values in all.
pub fn check_metadata(
    field: &str,
    metadata: &std::collections::HashMap<String, String>,
    max_bytes: usize,
) -> Result<(), FieldError> {
    let mut total = 0usize;
    for (name, value) in metadata {
        if name.contains('\0') || value.contains('\0') {
            return Err(FieldError::new(field, format!("entry {name:?} contains a NUL byte")));
        }
        total = total.saturating_add(name.len() + value.len());
    }
    if total > max_bytes {
        return Err(FieldError::new(
            field,
            format!("is {total} bytes; at most {max_bytes} (admission.max_floating_metadata_bytes)"),
        ));
    }
    Ok(())
}

/// A rate key: its tenant and its inline name and unique key, or its
/// resource key.
pub fn check_rate_key(field: &str, key: Option<&pb::RateKeyRef>, max_key_bytes: usize) -> Result<(), FieldError> {
    let Some(key) = key else {
        return Err(FieldError::new(field, "must be set"));
    };
    check_name(&format!("{field}.tenant"), &key.tenant, max_key_bytes)?;
    match &key.kind {
        Some(pb::rate_key_ref::Kind::Inline(inline)) => {
            check_name(&format!("{field}.inline.name"), &inline.name, max_key_bytes)?;
            check_unique_key(&format!("{field}.inline.unique_key"), &inline.unique_key, max_key_bytes)
        }
        Some(pb::rate_key_ref::Kind::ResourceKey(resource_key)) => {
            check_name(&format!("{field}.resource_key"), resource_key, max_key_bytes)
        }
        None => Err(FieldError::new(field, "set inline or resource_key")),
    }
}

/// An inline rate limit's unique key: may be empty, else like a key.
pub fn check_unique_key(field: &str, value: &str, max_key_bytes: usize) -> Result<(), FieldError> {
    if value.len() > max_key_bytes || value.chars().any(char::is_control) {
        return Err(FieldError::new(
            field,
            format!("must be at most {max_key_bytes} bytes without control characters"),
        ));
    }
    Ok(())
}

/// A rate window: `limit` units (and a `cost`) per `window_ms`.
pub fn check_rate_window(field: &str, limit: i64, window_ms: i64, cost: i64) -> Result<(), FieldError> {
    check_i64(&format!("{field}.limit"), limit, 1, MAX_RATE_LIMIT)?;
    check_i64(
        &format!("{field}.duration_ms"),
        window_ms,
        1,
        i64::try_from(MAX_RATE_WINDOW_MS).unwrap_or(i64::MAX),
    )?;
    check_i64(&format!("{field}.cost"), cost, 0, MAX_RATE_LIMIT)?;
    if cost > limit {
        return Err(FieldError::new(
            format!("{field}.cost"),
            format!("{cost} is above the limit {limit}; it could never be granted"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_with_the_field() {
        assert!(check_name("tenant", "acme", 10).is_ok());
        assert_eq!(
            check_name("tenant", "", 10).unwrap_err().to_string(),
            "tenant: must not be empty"
        );
        assert!(check_name("key", "a\u{0}b", 10).is_err());
        assert!(check_name("key", "abcdefghijk", 10).is_err());
        let nested = check_name("key", "", 10).unwrap_err().within("limits[2]");
        assert_eq!(nested.field, "limits[2].key");
    }

    #[test]
    fn numbers_are_checked_before_they_are_used() {
        assert!(check_u32("max", 0, 0, MAX_CONCURRENCY).is_ok());
        // -1 written as a 64-bit varint into a uint32 field.
        let error = check_u32("max", u32::MAX, 0, MAX_CONCURRENCY).unwrap_err();
        assert_eq!(error.field, "max");
        assert!(error.message.contains("negative number"), "{error}");
        assert!(check_i64("limit", 0, 1, MAX_RATE_LIMIT).is_err());
        assert!(check_u64("interval", MAX_REFRESH_INTERVAL_MS + 1, 1, MAX_REFRESH_INTERVAL_MS).is_err());
        assert!(check_text("reason", "fine", 10).is_ok());
        assert!(check_text("reason", "a\0b", 10).is_err());
        assert!(check_text("reason", "abcdefghijk", 10).is_err());
    }
}
