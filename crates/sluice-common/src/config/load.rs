//! Loading the configuration: the embedded defaults, then a file, then the
//! environment (and test overrides), with settings of an earlier release
//! taken out and reported, the payload limit resolved, and `validate()` run.

use std::path::Path;

use super::{removed, ConfigError, RemovedSetting, SluiceConfig, DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_TOML, DEV_TOML};

impl SluiceConfig {
    /// Defaults, then `file` if given, then the environment.
    pub fn load(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_with(file, &[])
    }

    /// Like `load`, with extra `(key, value)` overrides applied last (tests).
    pub fn load_with(file: Option<&Path>, overrides: &[(&str, &str)]) -> Result<Self, ConfigError> {
        Self::load_from(file, None, overrides)
    }

    /// `sluice dev`'s configuration: like `load`, but authentication is off
    /// unless the file or the environment turns it on.
    pub fn load_dev(file: Option<&Path>) -> Result<Self, ConfigError> {
        Self::load_layered(file, None, &[], Some(DEV_TOML))
    }

    /// `environment` replaces the process environment when given (tests).
    pub(super) fn load_from(
        file: Option<&Path>,
        environment: Option<config::Map<String, String>>,
        overrides: &[(&str, &str)],
    ) -> Result<Self, ConfigError> {
        Self::load_layered(file, environment, overrides, None)
    }

    fn load_layered(
        file: Option<&Path>,
        environment: Option<config::Map<String, String>>,
        overrides: &[(&str, &str)],
        defaults: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let mut builder =
            config::Config::builder().add_source(config::File::from_str(DEFAULT_TOML, config::FileFormat::Toml));
        if let Some(defaults) = defaults {
            builder = builder.add_source(config::File::from_str(defaults, config::FileFormat::Toml));
        }
        if let Some(path) = file {
            builder = builder.add_source(config::File::from(path).required(true));
        }
        // Values stay strings until a field asks for a number, a bool or a
        // list: parsing them up front would turn a password "0123" into 123.
        builder = builder.add_source(
            config::Environment::with_prefix("SLUICE")
                .prefix_separator("__")
                .separator("__")
                .source(environment),
        );
        for (key, value) in overrides {
            builder = builder.set_override(*key, *value)?;
        }
        let mut built = builder.build()?;
        let removed_settings = removed::take_removed(&mut built.cache, file);
        let mut loaded: SluiceConfig = built.try_deserialize()?;
        loaded.removed_settings = removed_settings;
        if loaded.admission.max_payload_bytes == 0 {
            // Follows kafka.max_message_bytes: a file of 0.1.0 that sets
            // only that (900000) keeps starting.
            let room = loaded
                .kafka
                .max_message_bytes
                .saturating_sub(loaded.admitted_envelope_bytes());
            loaded.admission.max_payload_bytes = DEFAULT_MAX_PAYLOAD_BYTES.min(room);
        }
        loaded.validate()?;
        Ok(loaded)
    }

    /// Settings an earlier release read that the file or the environment
    /// set; this release ignores them.
    pub fn removed_settings(&self) -> &[RemovedSetting] {
        &self.removed_settings
    }

    /// A warning per removed setting that was set, naming it, where it was
    /// set and what replaced it. Called once logging is up (loading comes
    /// before it).
    pub fn warn_removed_settings(&self) {
        for removed in &self.removed_settings {
            tracing::warn!(
                setting = removed.key,
                set_in = %removed.set_in,
                removed_in = removed.removed_in,
                replaced_by = removed.replaced_by,
                "ignoring {}, a setting removed in {}: remove it from the configuration",
                removed.key,
                removed.removed_in
            );
        }
    }
}
