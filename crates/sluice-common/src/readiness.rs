//! Readiness of one service instance: SERVING unless some part of it reports a
//! condition that keeps it from doing its work — a partition rebuilding, a
//! database or broker fault being retried, a producer being rebuilt. Each
//! condition has a name (`limit-grant partition 3`, `kafka producer`) so the
//! log and `conditions()` say what is wrong; the gRPC health service follows
//! `watch()` (`service::report_readiness`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

#[derive(Clone, Debug)]
pub struct Readiness {
    conditions: Arc<Mutex<BTreeMap<String, Condition>>>,
    ready: Arc<watch::Sender<bool>>,
}

#[derive(Debug)]
struct Condition {
    reason: String,
    /// Part of normal work (a partition loading at start or after a
    /// rebalance): logged at debug, where a fault is a warning.
    expected: bool,
}

impl Default for Readiness {
    fn default() -> Self {
        Self::new()
    }
}

impl Readiness {
    pub fn new() -> Self {
        let (ready, _) = watch::channel(true);
        Readiness {
            conditions: Arc::new(Mutex::new(BTreeMap::new())),
            ready: Arc::new(ready),
        }
    }

    /// Not ready while `name` holds (replaces its reason if already set):
    /// a fault, logged as a warning when it starts.
    pub fn set(&self, name: impl Into<String>, reason: impl Into<String>) {
        self.insert(name.into(), reason.into(), false);
    }

    /// Not ready while `name` holds, as part of normal work (a partition
    /// loading): logged at debug, so a start is not a page of warnings.
    pub fn set_expected(&self, name: impl Into<String>, reason: impl Into<String>) {
        self.insert(name.into(), reason.into(), true);
    }

    fn insert(&self, name: String, reason: String, expected: bool) {
        let was_expected = {
            let mut conditions = self.conditions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            let was_expected = conditions.get(&name).map(|previous| previous.expected);
            // A fault stays one until cleared, so its clearing is logged
            // at the level its start was.
            let condition = Condition {
                reason: reason.clone(),
                expected: expected && was_expected.unwrap_or(true),
            };
            conditions.insert(name.clone(), condition);
            was_expected
        };
        match (was_expected, expected) {
            (None, true) => tracing::debug!(condition = %name, %reason, "not ready"),
            // New, or what was expected turned into a fault.
            (None | Some(true), false) => tracing::warn!(condition = %name, %reason, "not ready"),
            (Some(_), _) => {}
        }
        self.publish();
    }

    /// `name` no longer holds.
    pub fn clear(&self, name: &str) {
        let removed = {
            let mut conditions = self.conditions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            conditions.remove(name).map(|condition| condition.expected)
        };
        match removed {
            Some(true) => tracing::debug!(condition = %name, "condition cleared"),
            Some(false) => tracing::info!(condition = %name, "condition cleared"),
            None => {}
        }
        self.publish();
    }

    pub fn is_ready(&self) -> bool {
        self.conditions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .is_empty()
    }

    /// What keeps the instance from being ready, by name.
    pub fn conditions(&self) -> Vec<(String, String)> {
        self.conditions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .iter()
            .map(|(name, condition)| (name.clone(), condition.reason.clone()))
            .collect()
    }

    pub fn watch(&self) -> watch::Receiver<bool> {
        self.ready.subscribe()
    }

    fn publish(&self) {
        let ready = self.is_ready();
        self.ready.send_if_modified(|current| {
            let changed = *current != ready;
            *current = ready;
            changed
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_no_condition_holds() {
        let readiness = Readiness::new();
        let mut watched = readiness.watch();
        assert!(readiness.is_ready());
        readiness.set("database", "connection refused");
        readiness.set("partition 3", "loading");
        assert!(!readiness.is_ready());
        assert!(watched.has_changed().unwrap());
        assert!(!*watched.borrow_and_update());
        readiness.clear("database");
        assert!(!readiness.is_ready());
        assert_eq!(
            readiness.conditions(),
            vec![("partition 3".to_string(), "loading".to_string())]
        );
        readiness.clear("partition 3");
        assert!(readiness.is_ready());
        assert!(*watched.borrow_and_update());
    }
}
