//! What the console has seen happen, in memory and bounded: grants per key
//! and tenant (from the owners' grant watch), admitted jobs per tenant (from
//! `jobs.admitted.*`), and dead letters (from `deadletter`). A pure core with
//! explicit times, so the bounds and rates are unit-tested.

use std::collections::{BTreeSet, HashMap, VecDeque};

/// Events per second over a sliding horizon: (unix second, count), oldest
/// first, only seconds that had events.
#[derive(Clone, Debug, Default)]
pub struct SecondCounts {
    seconds: VecDeque<(i64, u64)>,
}

impl SecondCounts {
    pub fn add(&mut self, second: i64, count: u64) {
        match self.seconds.back_mut() {
            Some((last, total)) if *last == second => *total += count,
            Some((last, _)) if *last > second => {
                // A late event (another host's clock): file it in its second.
                if let Some(entry) = self.seconds.iter_mut().rev().find(|(at, _)| *at == second) {
                    entry.1 += count;
                } else {
                    let index = self.seconds.partition_point(|(at, _)| *at < second);
                    self.seconds.insert(index, (second, count));
                }
            }
            _ => self.seconds.push_back((second, count)),
        }
    }

    /// Forget seconds before `oldest`.
    pub fn trim(&mut self, oldest: i64) {
        while self.seconds.front().is_some_and(|(at, _)| *at < oldest) {
            self.seconds.pop_front();
        }
    }

    pub fn is_empty(&self) -> bool {
        self.seconds.is_empty()
    }

    pub fn last_second(&self) -> Option<i64> {
        self.seconds.back().map(|(at, _)| *at)
    }

    /// Average per second over the `span` whole seconds before `now_second`
    /// (the current, unfinished second is left out).
    pub fn rate(&self, now_second: i64, span: i64) -> f64 {
        if span <= 0 {
            return 0.0;
        }
        let from = now_second - span;
        let total: u64 = self
            .seconds
            .iter()
            .filter(|(at, _)| *at >= from && *at < now_second)
            .map(|(_, count)| *count)
            .sum();
        total as f64 / span as f64
    }

    /// Counts of each second in `[from, to)`, zeros included.
    pub fn per_second(&self, from: i64, to: i64) -> Vec<u64> {
        let length = usize::try_from(to.saturating_sub(from)).unwrap_or(0);
        let mut counts = vec![0u64; length];
        for (at, count) in &self.seconds {
            if *at >= from && *at < to {
                if let Ok(index) = usize::try_from(at - from) {
                    counts[index] = *count;
                }
            }
        }
        counts
    }
}

/// One dead letter as the console keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    pub at_ms: i64,
    pub class: String,
    pub reason: String,
    /// The request's tenant, when its bytes decode far enough to name one.
    pub tenant: Option<String>,
    pub source: String,
    /// The start of the dead-lettered bytes, as text (for a glance).
    pub payload_preview: String,
}

/// The bounds of what `Activity` keeps.
#[derive(Clone, Copy, Debug)]
pub struct ActivityLimits {
    /// Seconds of history kept for rates and charts.
    pub horizon_seconds: i64,
    /// Keys whose grants are counted; the ones idle longest go first.
    pub max_keys: usize,
    /// Tenants tracked (rates, and the overview's list).
    pub max_tenants: usize,
    pub dead_letters_kept: usize,
    /// Distinct reasons counted; the rest count under `OTHER_REASONS`.
    pub max_reasons: usize,
}

pub const OTHER_REASONS: &str = "(other reasons)";
/// A grant that reaches the console this much later than it was made is a
/// re-send (a new stream claiming a partition) or predates the watch: it was
/// counted already, or the console was not looking then.
pub const LATE_GRANT_MS: i64 = 5_000;

#[derive(Debug)]
pub struct Activity {
    limits: ActivityLimits,
    key_grants: HashMap<(String, String), SecondCounts>,
    tenant_grants: HashMap<String, SecondCounts>,
    tenant_admitted: HashMap<String, SecondCounts>,
    tenant_dead_letters: HashMap<String, SecondCounts>,
    tenants_seen: BTreeSet<String>,
    dead_letters: VecDeque<DeadLetter>,
    reason_counts: HashMap<String, u64>,
    class_counts: HashMap<String, u64>,
    pub grants_seen: u64,
    pub late_grants_ignored: u64,
    pub admitted_seen: u64,
    pub dead_letters_seen: u64,
}

/// The key with the most recent grants, for the overview and tests.
#[derive(Clone, Debug, PartialEq)]
pub struct TenantRates {
    pub grants_per_second: f64,
    pub admitted_per_second: f64,
    pub dead_letters_per_second: f64,
}

impl Activity {
    pub fn new(limits: ActivityLimits) -> Self {
        Activity {
            limits,
            key_grants: HashMap::new(),
            tenant_grants: HashMap::new(),
            tenant_admitted: HashMap::new(),
            tenant_dead_letters: HashMap::new(),
            tenants_seen: BTreeSet::new(),
            dead_letters: VecDeque::new(),
            reason_counts: HashMap::new(),
            class_counts: HashMap::new(),
            grants_seen: 0,
            late_grants_ignored: 0,
            admitted_seen: 0,
            dead_letters_seen: 0,
        }
    }

    fn oldest_second(&self, now_ms: i64) -> i64 {
        now_ms.div_euclid(1000) - self.limits.horizon_seconds
    }

    /// A grant an owner sent at `granted_at_ms`, seen at `now_ms`.
    pub fn record_grant(&mut self, tenant: &str, key: &str, granted_at_ms: i64, now_ms: i64) {
        if now_ms - granted_at_ms > LATE_GRANT_MS {
            self.late_grants_ignored += 1;
            return;
        }
        self.grants_seen += 1;
        let second = granted_at_ms.div_euclid(1000);
        let oldest = self.oldest_second(now_ms);
        let key_id = (tenant.to_string(), key.to_string());
        if !self.key_grants.contains_key(&key_id) && self.key_grants.len() >= self.limits.max_keys {
            self.forget_idle_keys(oldest);
        }
        let counts = self.key_grants.entry(key_id).or_default();
        counts.add(second, 1);
        counts.trim(oldest);
        self.note_tenant(tenant);
        if let Some(counts) = tenant_counts(&mut self.tenant_grants, tenant, self.limits.max_tenants) {
            counts.add(second, 1);
            counts.trim(oldest);
        }
    }

    /// Keeps at most `max_keys - 1` keys: first those with grants inside the
    /// horizon, then the most recently granted.
    fn forget_idle_keys(&mut self, oldest: i64) {
        for counts in self.key_grants.values_mut() {
            counts.trim(oldest);
        }
        self.key_grants.retain(|_, counts| !counts.is_empty());
        let keep = self.limits.max_keys.saturating_sub(1);
        if self.key_grants.len() > keep {
            let mut by_last: Vec<((String, String), i64)> = self
                .key_grants
                .iter()
                .map(|(key, counts)| (key.clone(), counts.last_second().unwrap_or(i64::MIN)))
                .collect();
            by_last.sort_by_key(|(_, last)| std::cmp::Reverse(*last));
            for (key, _) in by_last.into_iter().skip(keep) {
                self.key_grants.remove(&key);
            }
        }
    }

    /// A job of `tenant` handed to workers, seen at `now_ms`.
    pub fn record_admitted(&mut self, tenant: &str, now_ms: i64) {
        self.admitted_seen += 1;
        self.note_tenant(tenant);
        let oldest = self.oldest_second(now_ms);
        if let Some(counts) = tenant_counts(&mut self.tenant_admitted, tenant, self.limits.max_tenants) {
            counts.add(now_ms.div_euclid(1000), 1);
            counts.trim(oldest);
        }
    }

    pub fn record_dead_letter(&mut self, dead_letter: DeadLetter, now_ms: i64) {
        self.dead_letters_seen += 1;
        let oldest = self.oldest_second(now_ms);
        let tenant = dead_letter.tenant.clone().unwrap_or_default();
        if !tenant.is_empty() {
            self.note_tenant(&tenant);
        }
        if let Some(counts) = tenant_counts(&mut self.tenant_dead_letters, &tenant, self.limits.max_tenants) {
            counts.add(now_ms.div_euclid(1000), 1);
            counts.trim(oldest);
        }
        let reason_key = if self.reason_counts.contains_key(&dead_letter.reason)
            || self.reason_counts.len() < self.limits.max_reasons
        {
            dead_letter.reason.clone()
        } else {
            OTHER_REASONS.to_string()
        };
        *self.reason_counts.entry(reason_key).or_default() += 1;
        if self.class_counts.len() < 64 || self.class_counts.contains_key(&dead_letter.class) {
            *self.class_counts.entry(dead_letter.class.clone()).or_default() += 1;
        }
        self.dead_letters.push_back(dead_letter);
        while self.dead_letters.len() > self.limits.dead_letters_kept {
            self.dead_letters.pop_front();
        }
    }

    fn note_tenant(&mut self, tenant: &str) {
        if tenant.is_empty() || self.tenants_seen.contains(tenant) || self.tenants_seen.len() >= self.limits.max_tenants
        {
            return;
        }
        self.tenants_seen.insert(tenant.to_string());
    }

    pub fn tenants_seen(&self) -> Vec<String> {
        self.tenants_seen.iter().cloned().collect()
    }

    /// Rates over the `span` seconds before now.
    pub fn tenant_rates(&self, tenant: &str, now_ms: i64, span: i64) -> TenantRates {
        let now_second = now_ms.div_euclid(1000);
        let rate =
            |map: &HashMap<String, SecondCounts>| map.get(tenant).map_or(0.0, |counts| counts.rate(now_second, span));
        TenantRates {
            grants_per_second: rate(&self.tenant_grants),
            admitted_per_second: rate(&self.tenant_admitted),
            dead_letters_per_second: rate(&self.tenant_dead_letters),
        }
    }

    /// Grants of one key in each second of `[from, to)`.
    pub fn key_grants_per_second(&self, tenant: &str, key: &str, from: i64, to: i64) -> Vec<u64> {
        self.key_grants.get(&(tenant.to_string(), key.to_string())).map_or_else(
            || vec![0; usize::try_from(to - from).unwrap_or(0)],
            |counts| counts.per_second(from, to),
        )
    }

    pub fn key_grant_rate(&self, tenant: &str, key: &str, now_ms: i64, span: i64) -> f64 {
        self.key_grants
            .get(&(tenant.to_string(), key.to_string()))
            .map_or(0.0, |counts| counts.rate(now_ms.div_euclid(1000), span))
    }

    pub fn tracked_keys(&self) -> usize {
        self.key_grants.len()
    }

    /// The newest dead letters first.
    pub fn recent_dead_letters(&self, limit: usize) -> Vec<DeadLetter> {
        self.dead_letters.iter().rev().take(limit).cloned().collect()
    }

    /// (reason, count), the most frequent first.
    pub fn dead_letter_reasons(&self) -> Vec<(String, u64)> {
        sorted_counts(&self.reason_counts)
    }

    pub fn dead_letter_classes(&self) -> Vec<(String, u64)> {
        sorted_counts(&self.class_counts)
    }
}

fn sorted_counts(counts: &HashMap<String, u64>) -> Vec<(String, u64)> {
    let mut sorted: Vec<(String, u64)> = counts.iter().map(|(name, count)| (name.clone(), *count)).collect();
    sorted.sort_by(|left, right| right.1.cmp(&left.1).then_with(|| left.0.cmp(&right.0)));
    sorted
}

/// The tenant's counts, created if there is room.
fn tenant_counts<'a>(
    map: &'a mut HashMap<String, SecondCounts>,
    tenant: &str,
    max_tenants: usize,
) -> Option<&'a mut SecondCounts> {
    if !map.contains_key(tenant) && map.len() >= max_tenants {
        return None;
    }
    Some(map.entry(tenant.to_string()).or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> ActivityLimits {
        ActivityLimits {
            horizon_seconds: 60,
            max_keys: 3,
            max_tenants: 2,
            dead_letters_kept: 2,
            max_reasons: 2,
        }
    }

    #[test]
    fn rates_average_over_finished_seconds() {
        let mut counts = SecondCounts::default();
        counts.add(100, 4);
        counts.add(101, 6);
        counts.add(102, 50); // the current second: not counted yet
        assert!((counts.rate(102, 2) - 5.0).abs() < f64::EPSILON);
        assert_eq!(counts.per_second(99, 103), vec![0, 4, 6, 50]);
        counts.add(100, 1); // late
        assert_eq!(counts.per_second(100, 101), vec![5]);
        counts.add(98, 2); // late, before every other second
        assert_eq!(counts.per_second(98, 100), vec![2, 0]);
        counts.trim(101);
        assert_eq!(counts.per_second(98, 103), vec![0, 0, 0, 6, 50]);
    }

    #[test]
    fn grants_count_per_key_and_tenant_and_late_ones_are_ignored() {
        let mut activity = Activity::new(limits());
        let now = 1_000_000;
        activity.record_grant("acme", "k", now - 10, now);
        activity.record_grant("acme", "k", now - 20, now);
        activity.record_grant("acme", "k", now - LATE_GRANT_MS - 1, now);
        assert_eq!(activity.late_grants_ignored, 1);
        assert_eq!(activity.key_grants_per_second("acme", "k", 999, 1001), vec![2, 0]);
        assert!((activity.tenant_rates("acme", now, 1).grants_per_second - 2.0).abs() < f64::EPSILON);
        assert_eq!(activity.tenants_seen(), vec!["acme"]);
    }

    #[test]
    fn keys_are_bounded_and_the_idle_ones_go_first() {
        let mut activity = Activity::new(limits());
        let now = 1_000_000;
        activity.record_grant("t", "old", now - 3000, now);
        activity.record_grant("t", "mid", now - 2000, now);
        activity.record_grant("t", "new", now - 1000, now);
        activity.record_grant("t", "newest", now, now);
        assert!(activity.tracked_keys() <= 3);
        assert_eq!(
            activity
                .key_grants_per_second("t", "old", 990, 1001)
                .iter()
                .sum::<u64>(),
            0
        );
        assert_eq!(activity.key_grants_per_second("t", "newest", 1000, 1001), vec![1]);
        assert_eq!(activity.key_grants_per_second("t", "new", 999, 1000), vec![1]);
        // Keys idle past the horizon are dropped before busy ones.
        let later = now + 120_000;
        activity.record_grant("t", "fresh", later, later);
        assert_eq!(activity.tracked_keys(), 1);
    }

    #[test]
    fn tenants_are_bounded() {
        let mut activity = Activity::new(limits());
        for tenant in ["a", "b", "c"] {
            activity.record_admitted(tenant, 5_000);
        }
        assert_eq!(activity.tenants_seen(), vec!["a", "b"]);
        assert_eq!(activity.admitted_seen, 3);
        assert!((activity.tenant_rates("a", 6_000, 1).admitted_per_second - 1.0).abs() < f64::EPSILON);
        assert!(activity.tenant_rates("c", 6_000, 1).admitted_per_second.abs() < f64::EPSILON);
    }

    #[test]
    fn dead_letters_keep_the_newest_and_count_reasons_within_bounds() {
        let mut activity = Activity::new(limits());
        for (index, reason) in ["r1", "r2", "r3", "r1"].iter().enumerate() {
            activity.record_dead_letter(
                DeadLetter {
                    at_ms: i64::try_from(index).unwrap_or_default(),
                    class: "invalid".to_string(),
                    reason: reason.to_string(),
                    tenant: Some("acme".to_string()),
                    source: String::new(),
                    payload_preview: String::new(),
                },
                10_000,
            );
        }
        let recent: Vec<i64> = activity
            .recent_dead_letters(10)
            .iter()
            .map(|letter| letter.at_ms)
            .collect();
        assert_eq!(recent, vec![3, 2]);
        assert_eq!(
            activity.dead_letter_reasons(),
            vec![
                ("r1".to_string(), 2),
                (OTHER_REASONS.to_string(), 1),
                ("r2".to_string(), 1)
            ]
        );
        assert_eq!(activity.dead_letter_classes(), vec![("invalid".to_string(), 4)]);
        assert!((activity.tenant_rates("acme", 11_000, 1).dead_letters_per_second - 4.0).abs() < f64::EPSILON);
    }
}
