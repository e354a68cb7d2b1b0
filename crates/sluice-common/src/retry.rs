//! One backoff for every loop that retries a fault that passes (which
//! faults pass is `crate::fault`'s one decision: `classify_sql`,
//! `classify_kafka`): the wait doubles from 100 ms to 5 s, each drawn
//! between half the step and the step, so instances that hit the same fault
//! do not retry in lockstep; and it knows how long the fault has lasted, for
//! the log line that says what is retried and since when.

use std::time::{Duration, Instant};

use rand::Rng;

pub const RETRY_FIRST: Duration = Duration::from_millis(100);
pub const RETRY_MAX: Duration = Duration::from_secs(5);

#[derive(Debug)]
pub struct Backoff {
    step: Duration,
    since: Option<Instant>,
    attempts: u32,
}

impl Default for Backoff {
    fn default() -> Self {
        Self::new()
    }
}

impl Backoff {
    pub fn new() -> Self {
        Backoff {
            step: RETRY_FIRST,
            since: None,
            attempts: 0,
        }
    }

    /// The next wait: between half the step and the step; the step doubles.
    pub fn next_wait(&mut self) -> Duration {
        let step_ms = u64::try_from(self.step.as_millis()).unwrap_or(u64::MAX);
        self.step = (self.step * 2).min(RETRY_MAX);
        let half = step_ms / 2;
        Duration::from_millis(half + rand::rng().random_range(0..=step_ms - half))
    }

    /// Count a failed try, and wait before the next.
    pub async fn wait(&mut self) {
        self.since.get_or_insert_with(Instant::now);
        self.attempts += 1;
        let wait = self.next_wait();
        tokio::time::sleep(wait).await;
    }

    /// How long the fault has been retried (zero before the first wait).
    pub fn retrying_for(&self) -> Duration {
        self.since.map_or(Duration::ZERO, |since| since.elapsed())
    }

    /// Failed tries so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_with_jitter_up_to_the_cap() {
        for _ in 0..200 {
            let mut backoff = Backoff::new();
            let mut step = RETRY_FIRST;
            for _ in 0..12 {
                let wait = backoff.next_wait();
                assert!(
                    wait >= step / 2 && wait <= step,
                    "{wait:?} outside [{:?}, {step:?}]",
                    step / 2
                );
                step = (step * 2).min(RETRY_MAX);
            }
        }
        // Not in lockstep: two backoffs draw different waits (almost surely).
        let draws: std::collections::HashSet<Duration> = (0..50).map(|_| Backoff::new().next_wait()).collect();
        assert!(draws.len() > 1, "{draws:?}");
    }
}
