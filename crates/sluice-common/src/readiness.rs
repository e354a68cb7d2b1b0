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
    conditions: Arc<Mutex<BTreeMap<String, String>>>,
    ready: Arc<watch::Sender<bool>>,
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

    /// Not ready while `name` holds (replaces its reason if already set).
    pub fn set(&self, name: impl Into<String>, reason: impl Into<String>) {
        let name = name.into();
        let reason = reason.into();
        let newly_set = {
            let mut conditions = self.conditions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            conditions.insert(name.clone(), reason.clone()).is_none()
        };
        if newly_set {
            tracing::warn!(condition = %name, %reason, "not ready");
        }
        self.publish();
    }

    /// `name` no longer holds.
    pub fn clear(&self, name: &str) {
        let removed = {
            let mut conditions = self.conditions.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            conditions.remove(name).is_some()
        };
        if removed {
            tracing::info!(condition = %name, "condition cleared");
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
            .map(|(name, reason)| (name.clone(), reason.clone()))
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
