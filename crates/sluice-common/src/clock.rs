//! Time for owners. One time source across failover: PostgreSQL's clock read
//! at takeover, advanced by the local monotonic clock, so a new owner's "now"
//! continues the old owner's and never jumps with a pod's wall clock.
//!
//! The monotonic part is tokio's clock: the same as `std::time::Instant` in
//! a running service, and virtual in a test that pauses time
//! (`tokio::time::pause`, `advance`), so an owner's timers can be driven
//! without waiting.

use std::time::{SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use sqlx::PgConnection;

/// Unix milliseconds from the local wall clock.
pub fn wall_clock_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// The instant `ms` milliseconds after the unix epoch (0 for negatives).
pub fn system_time_at_ms(ms: i64) -> std::time::SystemTime {
    std::time::UNIX_EPOCH + std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}

/// Unix microseconds from the local wall clock.
pub fn wall_clock_us() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|elapsed| i64::try_from(elapsed.as_micros()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

#[derive(Clone, Copy, Debug)]
pub struct AnchoredClock {
    base_ms: i64,
    anchor: Instant,
}

impl AnchoredClock {
    /// Anchor at PostgreSQL's clock.
    pub async fn from_postgres(connection: &mut PgConnection) -> Result<Self, sqlx::Error> {
        let base_ms: i64 = sqlx::query_scalar("SELECT (extract(epoch FROM clock_timestamp()) * 1000)::bigint")
            .fetch_one(connection)
            .await?;
        Ok(AnchoredClock {
            base_ms,
            anchor: Instant::now(),
        })
    }

    /// Anchor at a given time (tests).
    pub fn starting_at(base_ms: i64) -> Self {
        AnchoredClock {
            base_ms,
            anchor: Instant::now(),
        }
    }

    pub fn now_ms(&self) -> i64 {
        self.base_ms + i64::try_from(self.anchor.elapsed().as_millis()).unwrap_or(i64::MAX / 2)
    }

    /// What this clock read (or will read) at the monotonic instant `at`.
    pub fn ms_at(&self, at: Instant) -> i64 {
        let millis = |duration: std::time::Duration| i64::try_from(duration.as_millis()).unwrap_or(i64::MAX / 2);
        if at >= self.anchor {
            self.base_ms.saturating_add(millis(at - self.anchor))
        } else {
            self.base_ms.saturating_sub(millis(self.anchor - at))
        }
    }

    /// The monotonic instant (tokio's) at which this clock reads `at_ms`.
    pub fn instant_at(&self, at_ms: i64) -> Instant {
        let offset = at_ms.saturating_sub(self.base_ms);
        if offset <= 0 {
            return self.anchor;
        }
        self.anchor + std::time::Duration::from_millis(u64::try_from(offset).unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn follows_paused_time() {
        let clock = AnchoredClock::starting_at(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        tokio::time::advance(Duration::from_millis(1_500)).await;
        assert_eq!(clock.now_ms(), 2_500);
        // A timer set from the clock fires when virtual time reaches it.
        let due = clock.instant_at(4_000);
        tokio::time::sleep_until(due).await;
        assert_eq!(clock.now_ms(), 4_000);
        assert_eq!(
            clock.instant_at(0),
            clock.instant_at(1_000),
            "a time before the anchor is the anchor"
        );
    }
}
