//! The worker's own limits: how many handlers run at once in this process,
//! in total and per task type (sidekiq-limit_fetch `process_limits`, Oban
//! `local_limit`). They protect the process, not the downstream: cluster-wide
//! limits are Sluice's keys and caps.

use std::collections::HashMap;

#[derive(Clone, Debug)]
pub(crate) struct LocalLimits {
    total_limit: usize,
    per_type_limit: HashMap<String, usize>,
    total_used: usize,
    per_type_used: HashMap<String, usize>,
}

impl LocalLimits {
    pub fn new(total_limit: usize, per_type_limit: HashMap<String, usize>) -> Self {
        LocalLimits {
            total_limit,
            per_type_limit,
            total_used: 0,
            per_type_used: HashMap::new(),
        }
    }

    /// Whether one more job of `task_type` may start now.
    pub fn has_room(&self, task_type: &str) -> bool {
        if self.total_used >= self.total_limit {
            return false;
        }
        match self.per_type_limit.get(task_type) {
            Some(limit) => self.per_type_used.get(task_type).copied().unwrap_or(0) < *limit,
            None => true,
        }
    }

    /// Take a slot for `task_type`, when there is room.
    pub fn try_take(&mut self, task_type: &str) -> bool {
        if !self.has_room(task_type) {
            return false;
        }
        self.total_used += 1;
        *self.per_type_used.entry(task_type.to_string()).or_default() += 1;
        true
    }

    /// Give a slot of `task_type` back.
    pub fn give_back(&mut self, task_type: &str) {
        debug_assert!(self.total_used > 0, "more slots given back than taken");
        self.total_used = self.total_used.saturating_sub(1);
        if let Some(used) = self.per_type_used.get_mut(task_type) {
            *used = used.saturating_sub(1);
            if *used == 0 {
                self.per_type_used.remove(task_type);
            }
        }
    }

    pub fn total_used(&self) -> usize {
        self.total_used
    }

    pub fn used_by_type(&self) -> HashMap<String, usize> {
        self.per_type_used.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_type_limits_hold_inside_the_total() {
        let mut limits = LocalLimits::new(3, HashMap::from([("slow".to_string(), 1)]));
        assert!(limits.try_take("slow"));
        assert!(!limits.try_take("slow"), "slow is limited to 1");
        assert!(limits.try_take("fast"));
        assert!(limits.try_take("fast"));
        assert!(!limits.try_take("fast"), "3 in total");
        limits.give_back("slow");
        assert_eq!(limits.total_used(), 2);
        assert!(limits.try_take("slow"), "the slow slot is free again");
        assert_eq!(limits.used_by_type().get("fast"), Some(&2));
        assert!(!limits.has_room("other"), "3 in total again");
    }
}
