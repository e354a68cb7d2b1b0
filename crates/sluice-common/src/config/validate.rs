//! Validation after loading: every setting checked, a refusal naming its
//! field (`SluiceConfig::validate`, `AuthConfig::validate`).

use std::time::Duration;

use super::{invalid, AuthConfig, ConfigError, SluiceConfig};

impl SluiceConfig {
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_postgres_and_kafka()?;
        self.validate_admission()?;
        self.validate_durations()?;
        self.validate_console()?;
        self.validate_task_groups()?;
        self.validate_tenant_topics()
    }

    /// The connections: PostgreSQL, Kafka and its topics' partitions and message sizes.
    fn validate_postgres_and_kafka(&self) -> Result<(), ConfigError> {
        if self.postgres.url.is_empty() {
            return Err(invalid("postgres.url", "must be set"));
        }
        if !is_identifier(&self.postgres.schema_prefix) {
            return Err(invalid(
                "postgres.schema_prefix",
                "use lowercase letters, digits and underscores, starting with a letter",
            ));
        }
        if self.postgres.max_connections < 2 {
            return Err(invalid("postgres.max_connections", "must be at least 2"));
        }
        if self.kafka.brokers.trim().is_empty() {
            return Err(invalid("kafka.brokers", "must be set"));
        }
        let counts = &self.kafka.partitions;
        for (field, count) in [
            ("kafka.partitions.requested", counts.requested),
            ("kafka.partitions.admitted", counts.admitted),
            ("kafka.partitions.limit_commands", counts.limit_commands),
            ("kafka.partitions.rate_commands", counts.rate_commands),
            ("kafka.partitions.jobs", counts.jobs),
            ("kafka.partitions.refresh_due", counts.refresh_due),
            ("kafka.partitions.refresh_tasks", counts.refresh_tasks),
            ("kafka.partitions.deadletter", counts.deadletter),
        ] {
            if !(1..=10_000).contains(&count) {
                return Err(invalid(field, "must be between 1 and 10000"));
            }
        }
        if self.kafka.max_message_bytes < 10_000 {
            return Err(invalid("kafka.max_message_bytes", "must be at least 10000"));
        }
        if self.kafka.consumer_buffer_bytes < self.kafka.max_message_bytes {
            return Err(invalid(
                "kafka.consumer_buffer_bytes",
                format!(
                    "must be at least kafka.max_message_bytes ({}): one message must fit",
                    self.kafka.max_message_bytes
                ),
            ));
        }
        if self.kafka.topic_check_interval.0 < Duration::from_secs(1) {
            return Err(invalid("kafka.topic_check_interval", "must be at least 1s"));
        }
        Ok(())
    }

    /// The drain timeout and what admission accepts: payload and key sizes, sampling, priority.
    fn validate_admission(&self) -> Result<(), ConfigError> {
        if self.process.drain_timeout.0.is_zero() {
            return Err(invalid("process.drain_timeout", "must be greater than 0"));
        }
        let envelope = self.admitted_envelope_bytes();
        if self.admission.max_payload_bytes.saturating_add(envelope) > self.kafka.max_message_bytes {
            return Err(invalid(
                "admission.max_payload_bytes",
                format!(
                    "{} bytes plus the admitted message's envelope (up to {envelope} bytes with \
                     admission.max_key_bytes {}) does not fit in kafka.max_message_bytes ({}): an \
                     accepted job could never be handed to workers; lower it to at most {} or raise \
                     kafka.max_message_bytes (and the topics' max.message.bytes)",
                    self.admission.max_payload_bytes,
                    self.admission.max_key_bytes,
                    self.kafka.max_message_bytes,
                    self.kafka.max_message_bytes.saturating_sub(envelope)
                ),
            ));
        }
        if self.admission.max_key_bytes > crate::validate::MAX_KEY_BYTES {
            return Err(invalid(
                "admission.max_key_bytes",
                format!(
                    "must be at most {} (keys are indexed in PostgreSQL)",
                    crate::validate::MAX_KEY_BYTES
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.telemetry.sampling_ratio) {
            return Err(invalid("telemetry.sampling_ratio", "must be between 0 and 1"));
        }
        if self.admission.default_priority > 99 {
            return Err(invalid("admission.default_priority", "must be 0..=99"));
        }
        Ok(())
    }

    /// Intervals and timeouts, and how they must relate.
    fn validate_durations(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("admission.sweep_interval", self.admission.sweep_interval),
            ("admission.stand_behind_interval", self.admission.stand_behind_interval),
            ("admission.claim_timeout", self.claim_timeout()),
            ("admission.resend_waiting_after", self.resend_waiting_after()),
            ("admission.stream_end_grace", self.admission.stream_end_grace),
            ("limit_grant.ticket_grace", self.limit_grant.ticket_grace),
            ("refresh_dispatcher.task_timeout", self.refresh_dispatcher.task_timeout),
            (
                "refresh_dispatcher.initial_backoff",
                self.refresh_dispatcher.initial_backoff,
            ),
        ] {
            if value.0.is_zero() {
                return Err(invalid(field, "must be greater than 0"));
            }
        }
        if self.refresh_dispatcher.max_backoff.0 < self.refresh_dispatcher.initial_backoff.0 {
            return Err(invalid(
                "refresh_dispatcher.max_backoff",
                "must be at least refresh_dispatcher.initial_backoff",
            ));
        }
        if self.admission.stand_behind_interval.0 * 2 > self.limit_grant.ticket_grace.0 {
            return Err(invalid(
                "admission.stand_behind_interval",
                "must be at most half of limit_grant.ticket_grace (a third is the default)",
            ));
        }
        Ok(())
    }

    /// The web console's intervals and sizes.
    fn validate_console(&self) -> Result<(), ConfigError> {
        for (field, value) in [
            ("console.refresh_interval", self.console.refresh_interval),
            ("console.sample_interval", self.console.sample_interval),
            ("console.chart_window", self.console.chart_window),
        ] {
            if value.0 < Duration::from_millis(100) {
                return Err(invalid(field, "must be at least 100ms"));
            }
        }
        for (field, value) in [
            ("console.max_watched_keys", self.console.max_watched_keys),
            ("console.dead_letters_kept", self.console.dead_letters_kept),
            ("console.overview_scan_keys", self.console.overview_scan_keys),
        ] {
            if !(1..=1_000_000).contains(&value) {
                return Err(invalid(field, "must be between 1 and 1000000"));
            }
        }
        Ok(())
    }

    /// Task-group names, leases and caps.
    fn validate_task_groups(&self) -> Result<(), ConfigError> {
        if self.task_groups.is_empty() {
            return Err(invalid("task_groups", "declare at least one task group"));
        }
        for (name, group) in &self.task_groups {
            if !is_task_group_name(name) {
                return Err(invalid(
                    format!("task_groups.{name}"),
                    "names use letters, digits, '-', '_' and '.' (they become topic names)",
                ));
            }
            if group.lease.0 < Duration::from_millis(100) {
                return Err(invalid(format!("task_groups.{name}.lease"), "must be at least 100ms"));
            }
            for (index, cap) in group.caps.iter().enumerate() {
                if cap.key.is_empty() {
                    return Err(invalid(
                        format!("task_groups.{name}.caps[{index}].key"),
                        "must not be empty",
                    ));
                }
                if cap.max == 0 || cap.max > crate::validate::MAX_CONCURRENCY {
                    return Err(invalid(
                        format!("task_groups.{name}.caps[{index}].max"),
                        format!("must be from 1 to {}", crate::validate::MAX_CONCURRENCY),
                    ));
                }
                if let Err(error) = crate::validate::check_name("key", &cap.key, self.admission.max_key_bytes) {
                    return Err(invalid(format!("task_groups.{name}.caps[{index}].key"), error.message));
                }
            }
        }
        Ok(())
    }

    /// Tenants with a requested topic of their own.
    fn validate_tenant_topics(&self) -> Result<(), ConfigError> {
        for (index, tenant) in self.topics.tenant_requested.iter().enumerate() {
            if !is_task_group_name(tenant) {
                return Err(invalid(
                    format!("topics.tenant_requested[{index}]"),
                    "a tenant with a topic of its own uses letters, digits, '-', '_' and '.' (it becomes a topic name)",
                ));
            }
        }
        Ok(())
    }
}

impl AuthConfig {
    /// With auth on: the internal token is set, keys come with an issuer
    /// and an audience, and something can authenticate a caller.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.enabled {
            return Ok(());
        }
        if self.internal_token_file.trim().is_empty() {
            return Err(invalid(
                "auth.internal_token_file",
                "must be set when auth is on: a file holding a random secret (at least 16 characters) shared by every \
                 Sluice process, which the services send each other (or set auth.enabled = false, only on a trusted network)",
            ));
        }
        let has_keys = !self.jwks_file.trim().is_empty() || !self.public_key_files.is_empty();
        if has_keys && self.issuer.trim().is_empty() {
            return Err(invalid("auth.issuer", "must be set with jwks_file or public_key_files"));
        }
        if has_keys && self.audience.trim().is_empty() {
            return Err(invalid(
                "auth.audience",
                "must be set with jwks_file or public_key_files",
            ));
        }
        for (index, mapping) in self.client_certificates.iter().enumerate() {
            let field = format!("auth.client_certificates[{index}]");
            if mapping.name.trim().is_empty() {
                return Err(invalid(format!("{field}.name"), "must not be empty"));
            }
            for role in &mapping.roles {
                if crate::auth::Role::parse(role).is_none() {
                    return Err(invalid(
                        format!("{field}.roles"),
                        format!("{role:?} is not a role: producer, worker, operator, reader or admin"),
                    ));
                }
            }
            if mapping.tenants.iter().any(|tenant| tenant == "*") {
                return Err(invalid(
                    format!("{field}.tenants"),
                    "tenant `*` (global caps) is reached through the admin role, not listed",
                ));
            }
        }
        for (field, value) in [
            ("auth.tenants_claim", &self.tenants_claim),
            ("auth.roles_claim", &self.roles_claim),
        ] {
            if value.trim().is_empty() {
                return Err(invalid(field, "must not be empty"));
            }
        }
        Ok(())
    }
}

fn is_identifier(text: &str) -> bool {
    let mut chars = text.chars();
    matches!(chars.next(), Some(first) if first.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

fn is_task_group_name(text: &str) -> bool {
    !text.is_empty()
        && text.len() <= 100
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.')
}
