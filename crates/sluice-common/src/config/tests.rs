//! Unit tests of loading and validating the configuration.

use super::*;

/// A file and an environment written for 0.1.0 (which had a grants
/// topic) load: the removed settings are ignored and reported, where
/// they were set; a key no release had is still refused.
#[test]
fn settings_a_release_removed_load_and_are_reported_unknown_ones_are_refused() {
    let file = std::env::temp_dir().join(format!("sluice-removed-{}.toml", std::process::id()));
    std::fs::write(&file, "[kafka.partitions]\ngrants = 2\njobs = 4\n").unwrap();
    let environment = config::Map::from([("SLUICE__TOPICS__GRANTS".to_string(), "old.grants".to_string())]);
    let loaded = SluiceConfig::load_from(Some(&file), Some(environment), &[]).unwrap();
    assert_eq!(loaded.kafka.partitions.jobs, 4, "the rest of the file applies");
    let found: Vec<(&str, &str)> = loaded
        .removed_settings()
        .iter()
        .map(|removed| (removed.key, removed.set_in.as_str()))
        .collect();
    assert_eq!(
        found,
        [
            ("kafka.partitions.grants", file.to_str().unwrap()),
            ("topics.grants", "environment variable SLUICE__TOPICS__GRANTS"),
        ]
    );
    assert!(loaded.removed_settings()[0].replaced_by.contains("link streams"));
    assert!(SluiceConfig::load_from(None, None, &[])
        .unwrap()
        .removed_settings()
        .is_empty());

    std::fs::write(&file, "[kafka.partitions]\ngrant = 2\n").unwrap();
    let refused = SluiceConfig::load_from(Some(&file), None, &[]).unwrap_err();
    assert!(refused.to_string().contains("grant"), "{refused}");
    std::fs::remove_file(&file).unwrap();
}

#[test]
fn resend_and_claim_timers_follow_the_session_timeout_unless_set() {
    let defaults = SluiceConfig::load_from(None, None, &[]).unwrap();
    assert_eq!(defaults.kafka.session_timeout_ms, 6000);
    assert_eq!(defaults.resend_waiting_after().0, Duration::from_secs(12));
    assert_eq!(defaults.claim_timeout().0, Duration::from_secs(30));
    let slower = SluiceConfig::load_from(None, None, &[("kafka.session_timeout_ms", "10000")]).unwrap();
    assert_eq!(slower.resend_waiting_after().0, Duration::from_secs(20));
    assert_eq!(slower.claim_timeout().0, Duration::from_secs(50));
    let set = SluiceConfig::load_from(
        None,
        None,
        &[
            ("admission.resend_waiting_after", "3s"),
            ("admission.claim_timeout", "2m"),
        ],
    )
    .unwrap();
    assert_eq!(set.resend_waiting_after().0, Duration::from_secs(3));
    assert_eq!(set.claim_timeout().0, Duration::from_secs(120));
    let zero = SluiceConfig::load_from(None, None, &[("admission.claim_timeout", "0s")]).unwrap_err();
    assert!(zero.to_string().contains("admission.claim_timeout"), "{zero}");
}

/// Every key of `default.toml` has a row in the settings table of
/// docs/configuration.md (a row may name several: `section.a` / `b`).
#[test]
fn every_setting_has_a_row_in_the_configuration_page() {
    let page = include_str!("../../../../docs/configuration.md");
    let table = page
        .split("\n## Settings\n")
        .nth(1)
        .and_then(|rest| rest.split("\n## ").next())
        .expect("a Settings section");
    let mut documented = std::collections::BTreeSet::new();
    for line in table.lines().filter(|line| line.starts_with("| `")) {
        let first_cell = line.split('|').nth(1).unwrap_or_default();
        let mut section = String::new();
        for token in first_cell.split('`').skip(1).step_by(2) {
            if token.starts_with("SLUICE__") {
                continue;
            }
            match token.rsplit_once('.') {
                Some((prefix, _)) => {
                    section = prefix.to_string();
                    documented.insert(token.to_string());
                }
                None if !section.is_empty() => {
                    documented.insert(format!("{section}.{token}"));
                }
                None => {}
            }
        }
    }
    let mut missing = Vec::new();
    let mut section = String::new();
    for line in DEFAULT_TOML.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|rest| rest.strip_suffix(']')) {
            section = name.to_string();
            continue;
        }
        // Maps of librdkafka settings, and the example task group.
        if ["kafka.properties", "kafka.producer_properties"].contains(&section.as_str())
            || section.starts_with("task_groups.")
        {
            continue;
        }
        if let Some((key, _)) = line.split_once('=') {
            let key = format!("{section}.{}", key.trim());
            if !documented.contains(&key) {
                missing.push(key);
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/configuration.md's settings table has no row for {missing:?}"
    );
}

#[test]
fn defaults_load_and_validate() {
    let loaded = SluiceConfig::load_with(None, &[]).unwrap();
    assert_eq!(loaded.kafka.partitions.limit_commands, 12);
    assert_eq!(loaded.task_groups["default"].lease.0, Duration::from_secs(30));
    assert_eq!(loaded.topic("jobs.requested"), "jobs.requested");
}

#[test]
fn overrides_apply_and_unknown_keys_are_refused() {
    let loaded = SluiceConfig::load_with(None, &[("kafka.topic_prefix", "t1."), ("admission.max_batch", "7")]).unwrap();
    assert_eq!(loaded.admitted_topic("default"), "t1.jobs.admitted.default");
    assert_eq!(loaded.admission.max_batch, 7);
    let error = SluiceConfig::load_with(None, &[("admission.no_such_key", "1")]).unwrap_err();
    assert!(error.to_string().contains("no_such_key"), "{error}");
}

#[test]
fn invalid_values_name_the_field() {
    let error = SluiceConfig::load_with(None, &[("telemetry.sampling_ratio", "2")]).unwrap_err();
    assert!(error.to_string().contains("telemetry.sampling_ratio"), "{error}");
}

#[test]
fn a_payload_limit_that_leaves_no_room_for_the_envelope_is_refused() {
    let defaults = SluiceConfig::load_with(None, &[]).unwrap();
    assert!(
        defaults.admission.max_payload_bytes + defaults.admitted_envelope_bytes() <= defaults.kafka.max_message_bytes,
        "the defaults fit"
    );
    // The old defaults: a 1 MiB payload against 900,000-byte messages.
    let error = SluiceConfig::load_with(
        None,
        &[
            ("admission.max_payload_bytes", "1048576"),
            ("kafka.max_message_bytes", "900000"),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("admission.max_payload_bytes"), "{error}");
    assert!(error.contains("kafka.max_message_bytes (900000)"), "{error}");
    // Unset, the payload limit follows a smaller message size.
    let smaller = SluiceConfig::load_with(None, &[("kafka.max_message_bytes", "900000")]).unwrap();
    assert_eq!(
        smaller.admission.max_payload_bytes,
        900_000 - smaller.admitted_envelope_bytes()
    );
    assert_eq!(defaults.admission.max_payload_bytes, DEFAULT_MAX_PAYLOAD_BYTES);
    // Exactly the room there is is fine.
    let room = defaults.kafka.max_message_bytes - defaults.admitted_envelope_bytes();
    let room = room.to_string();
    assert!(SluiceConfig::load_with(None, &[("admission.max_payload_bytes", room.as_str())]).is_ok());
}

#[test]
fn durations_parse_days_and_refuse_garbage() {
    assert_eq!(parse_duration("7d").unwrap(), Duration::from_secs(7 * 86_400));
    assert_eq!(parse_duration("90s").unwrap(), Duration::from_secs(90));
    assert!(parse_duration("soon").is_err());
    assert!(parse_duration("").is_err());
}

#[test]
fn environment_values_keep_their_text_and_still_fill_numbers_and_flags() {
    let environment: config::Map<String, String> = [
        ("SLUICE__KAFKA__SASL_PASSWORD", "0123"),
        ("SLUICE__KAFKA__SASL_USERNAME", "1e3"),
        ("SLUICE__KAFKA__LINGER_MS", "7"),
        ("SLUICE__KAFKA__CREATE_TOPICS", "false"),
        ("SLUICE__TELEMETRY__SAMPLING_RATIO", "0.25"),
        ("SLUICE__TELEMETRY__KEY_METRICS_PATTERNS", "acme/a*, acme/b*"),
        ("SLUICE__ADMISSION__CLAIM_TIMEOUT", "90s"),
    ]
    .into_iter()
    .map(|(name, value)| (name.to_string(), value.to_string()))
    .collect();
    let loaded = SluiceConfig::load_from(None, Some(environment), &[]).unwrap();
    assert_eq!(
        loaded.kafka.sasl_password.expose(),
        "0123",
        "a secret is never re-printed as a number"
    );
    assert_eq!(loaded.kafka.sasl_username, "1e3");
    assert_eq!(loaded.kafka.linger_ms, 7);
    assert!(!loaded.kafka.create_topics);
    assert!((loaded.telemetry.sampling_ratio - 0.25).abs() < f64::EPSILON);
    assert_eq!(loaded.telemetry.key_metrics_patterns, vec!["acme/a*", "acme/b*"]);
    assert_eq!(loaded.claim_timeout().0, Duration::from_secs(90));
    let bad: config::Map<String, String> = [("SLUICE__KAFKA__LINGER_MS".to_string(), "soon".to_string())]
        .into_iter()
        .collect();
    let error = SluiceConfig::load_from(None, Some(bad), &[]).unwrap_err();
    assert!(error.to_string().contains("linger_ms"), "{error}");
}

#[test]
fn secrets_do_not_print() {
    let secret = Secret::new("hunter2");
    assert_eq!(format!("{secret:?}"), "***");
}
