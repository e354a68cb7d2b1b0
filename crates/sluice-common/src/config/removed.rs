//! Settings an earlier release read and this one does not. A file or an
//! environment written for that release still loads: each such key is taken
//! out before the configuration is read, and named in a warning with what
//! replaced it. A removed key stays in `REMOVED` for at least one release
//! after the one that removed it (CHANGELOG.md lists them). Every other
//! unknown key is still refused.

use std::path::Path;

use config::{Value, ValueKind};

/// A setting this release no longer reads.
struct Removed {
    key: &'static str,
    removed_in: &'static str,
    replaced_by: &'static str,
}

const REMOVED: &[Removed] = &[
    Removed {
        key: "kafka.partitions.grants",
        removed_in: "0.2.0",
        replaced_by: "nothing: grants travel on the owners' gRPC link streams, not on a topic \
                      (admission's own partitions are kafka.partitions.jobs, a new topic)",
    },
    Removed {
        key: "topics.grants",
        removed_in: "0.2.0",
        replaced_by: "nothing: grants travel on the owners' gRPC link streams, not on a topic \
                      (admission's own topic is topics.jobs, a new topic)",
    },
];

/// A removed setting the file or the environment set: ignored, and named
/// in a warning once logging is up (`SluiceConfig::warn_removed_settings`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemovedSetting {
    pub key: &'static str,
    pub removed_in: &'static str,
    /// What does its job now.
    pub replaced_by: &'static str,
    /// Where it was set: the file's path, or the environment variable.
    pub set_in: String,
}

/// Takes every removed setting out of the loaded tree, saying where each
/// was set (`file` is the configuration file, if one was given).
pub(super) fn take_removed(root: &mut Value, file: Option<&Path>) -> Vec<RemovedSetting> {
    REMOVED
        .iter()
        .filter_map(|removed| {
            let value = take(root, removed.key)?;
            let set_in = match value.origin() {
                Some("the environment") => format!(
                    "environment variable SLUICE__{}",
                    removed.key.replace('.', "__").to_uppercase()
                ),
                // The file's path as given (the origin is made relative to
                // the working directory).
                Some(origin) => file.map_or_else(|| origin.to_string(), |file| file.display().to_string()),
                None => "an override".to_string(),
            };
            Some(RemovedSetting {
                key: removed.key,
                removed_in: removed.removed_in,
                replaced_by: removed.replaced_by,
                set_in,
            })
        })
        .collect()
}

/// Removes the value at a dotted `key` from nested tables.
fn take(root: &mut Value, key: &str) -> Option<Value> {
    let (path, last) = key.rsplit_once('.').unwrap_or(("", key));
    let mut table = match &mut root.kind {
        ValueKind::Table(table) => table,
        _ => return None,
    };
    for section in path.split('.').filter(|section| !section.is_empty()) {
        table = match &mut table.get_mut(section)?.kind {
            ValueKind::Table(inner) => inner,
            _ => return None,
        };
    }
    table.remove(last)
}
