//! Keys someone is looking at: sampled every `console.sample_interval` for
//! their chart (holders and waiters over the last `chart_window`), and, for
//! floating keys, the refreshes seen (the refresh-dispatcher keeps only the
//! last one, so the console keeps the history it observes). Bounded: at most
//! `max_watched_keys` keys, the least recently viewed dropped first; a key
//! nobody viewed for a chart window stops being sampled.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Refreshes kept per floating key.
pub const REFRESH_HISTORY: usize = 50;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    pub at_ms: i64,
    pub holders: u32,
    pub waiting: u32,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefreshRecord {
    pub at_ms: i64,
    pub value: i64,
    pub outcome: String,
    pub error: String,
}

#[derive(Debug)]
struct WatchedKey {
    last_viewed: Instant,
    samples: VecDeque<Sample>,
    refreshes: VecDeque<RefreshRecord>,
}

#[derive(Debug)]
pub struct KeyWatch {
    keys: HashMap<(String, String), WatchedKey>,
    max_keys: usize,
    window: Duration,
}

impl KeyWatch {
    pub fn new(max_keys: usize, window: Duration) -> Self {
        KeyWatch {
            keys: HashMap::new(),
            max_keys: max_keys.max(1),
            window,
        }
    }

    /// Someone looks at the key: sample it from now on.
    pub fn view(&mut self, tenant: &str, key: &str, now: Instant) {
        let key_id = (tenant.to_string(), key.to_string());
        if let Some(watched) = self.keys.get_mut(&key_id) {
            watched.last_viewed = now;
            return;
        }
        if self.keys.len() >= self.max_keys {
            let least_recent = self
                .keys
                .iter()
                .min_by_key(|(_, watched)| watched.last_viewed)
                .map(|(key, _)| key.clone());
            if let Some(least_recent) = least_recent {
                self.keys.remove(&least_recent);
            }
        }
        self.keys.insert(
            key_id,
            WatchedKey {
                last_viewed: now,
                samples: VecDeque::new(),
                refreshes: VecDeque::new(),
            },
        );
    }

    /// Keys to sample now; forgets those nobody viewed for a window.
    pub fn due(&mut self, now: Instant) -> Vec<(String, String)> {
        let window = self.window;
        self.keys
            .retain(|_, watched| now.saturating_duration_since(watched.last_viewed) <= window);
        self.keys.keys().cloned().collect()
    }

    pub fn record_sample(&mut self, tenant: &str, key: &str, sample: Sample) {
        let window_ms = i64::try_from(self.window.as_millis()).unwrap_or(i64::MAX);
        let Some(watched) = self.keys.get_mut(&(tenant.to_string(), key.to_string())) else {
            return;
        };
        if watched.samples.back().is_some_and(|last| last.at_ms >= sample.at_ms) {
            return;
        }
        watched.samples.push_back(sample);
        while watched
            .samples
            .front()
            .is_some_and(|first| sample.at_ms - first.at_ms > window_ms)
        {
            watched.samples.pop_front();
        }
    }

    /// The key's last refresh as the dispatcher reports it; kept when new.
    pub fn record_refresh(&mut self, tenant: &str, key: &str, refresh: RefreshRecord) {
        let Some(watched) = self.keys.get_mut(&(tenant.to_string(), key.to_string())) else {
            return;
        };
        if refresh.at_ms <= 0 || watched.refreshes.back().is_some_and(|last| last.at_ms >= refresh.at_ms) {
            return;
        }
        watched.refreshes.push_back(refresh);
        while watched.refreshes.len() > REFRESH_HISTORY {
            watched.refreshes.pop_front();
        }
    }

    pub fn samples(&self, tenant: &str, key: &str) -> Vec<Sample> {
        self.keys
            .get(&(tenant.to_string(), key.to_string()))
            .map(|watched| watched.samples.iter().copied().collect())
            .unwrap_or_default()
    }

    /// Newest first.
    pub fn refreshes(&self, tenant: &str, key: &str) -> Vec<RefreshRecord> {
        self.keys
            .get(&(tenant.to_string(), key.to_string()))
            .map(|watched| watched.refreshes.iter().rev().cloned().collect())
            .unwrap_or_default()
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(at_ms: i64, holders: u32) -> Sample {
        Sample {
            at_ms,
            holders,
            waiting: 0,
        }
    }

    #[test]
    fn watched_keys_are_bounded_by_last_view() {
        let start = Instant::now();
        let mut watch = KeyWatch::new(2, Duration::from_secs(60));
        watch.view("t", "a", start);
        watch.view("t", "b", start + Duration::from_secs(1));
        watch.view("t", "a", start + Duration::from_secs(2));
        watch.view("t", "c", start + Duration::from_secs(3));
        let mut due = watch.due(start + Duration::from_secs(3));
        due.sort();
        assert_eq!(
            due,
            vec![("t".to_string(), "a".to_string()), ("t".to_string(), "c".to_string())]
        );
        // Not viewed for longer than the window: no longer sampled.
        assert!(watch.due(start + Duration::from_secs(120)).is_empty());
        assert!(watch.is_empty());
    }

    #[test]
    fn samples_keep_one_window_in_time_order() {
        let start = Instant::now();
        let mut watch = KeyWatch::new(4, Duration::from_secs(10));
        watch.view("t", "k", start);
        watch.record_sample("t", "k", sample(1_000, 1));
        watch.record_sample("t", "k", sample(900, 9)); // out of order: dropped
        watch.record_sample("t", "k", sample(5_000, 2));
        watch.record_sample("t", "k", sample(12_000, 3));
        let kept: Vec<u32> = watch.samples("t", "k").iter().map(|kept| kept.holders).collect();
        assert_eq!(kept, vec![2, 3]);
        // A key nobody views is not recorded.
        watch.record_sample("t", "other", sample(1, 1));
        assert!(watch.samples("t", "other").is_empty());
    }

    #[test]
    fn refresh_history_keeps_each_refresh_once() {
        let start = Instant::now();
        let mut watch = KeyWatch::new(4, Duration::from_secs(10));
        watch.view("t", "f", start);
        let refresh = |at_ms: i64, value: i64| RefreshRecord {
            at_ms,
            value,
            outcome: "succeeded".to_string(),
            error: String::new(),
        };
        watch.record_refresh("t", "f", refresh(0, 1)); // never refreshed
        watch.record_refresh("t", "f", refresh(100, 2));
        watch.record_refresh("t", "f", refresh(100, 2));
        watch.record_refresh("t", "f", refresh(200, 6));
        for at_ms in 0..(REFRESH_HISTORY as i64 + 5) {
            watch.record_refresh("t", "f", refresh(300 + at_ms, 4));
        }
        let history = watch.refreshes("t", "f");
        assert_eq!(history.len(), REFRESH_HISTORY);
        assert_eq!(history[0].at_ms, 300 + REFRESH_HISTORY as i64 + 4);
    }
}
