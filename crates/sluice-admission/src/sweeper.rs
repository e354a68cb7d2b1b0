//! The sweeper: for the jobs of the grant partitions this instance is
//! assigned, acts on what is due — run_at and retry backoffs, waits long
//! enough to re-send, unclaimed admitted jobs, expired leases and run-time
//! limits — states the tickets it stands behind (every
//! `stand_behind_interval`), and drops expired idempotency keys.

use std::sync::Arc;
use std::time::Duration;

use sluice_common::clock::wall_clock_ms;
use sluice_common::kafka::ConsumerProgress;
use sluice_common::Shutdown;

use crate::core::{AdmissionCore, AdmissionError};

const SWEEP_BATCH: i64 = 1000;

pub async fn run(
    core: Arc<AdmissionCore>,
    progress: Arc<ConsumerProgress>,
    shutdown: Shutdown,
) -> Result<(), AdmissionError> {
    let interval = core.config.admission.sweep_interval.0;
    let stand_behind_every = core.config.admission.stand_behind_interval.0;
    let ticket_grace_ms = core.config.limit_grant.ticket_grace.as_millis_i64();
    let mut next_idempotency_cleanup = tokio::time::Instant::now();
    let mut next_stand_behind = tokio::time::Instant::now() + stand_behind_every;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            _ = tokio::time::sleep(interval) => {}
        }
        let partitions = progress.assigned();
        loop {
            match core.sweep_due(&partitions, SWEEP_BATCH).await {
                Ok(handled) if handled < usize::try_from(SWEEP_BATCH).unwrap_or(usize::MAX) => break,
                Ok(_) => continue,
                Err(AdmissionError::Crashed) => return Err(AdmissionError::Crashed),
                Err(error) => {
                    tracing::warn!(%error, "sweep failed; retrying next round");
                    break;
                }
            }
        }
        if tokio::time::Instant::now() >= next_stand_behind {
            next_stand_behind = tokio::time::Instant::now() + stand_behind_every;
            // Only partitions whose grants are read to the end: a grant still
            // in flight to us must not look like a ticket nobody wants.
            let caught_up = progress.caught_up(stand_behind_every);
            match core.stand_behind(&caught_up, ticket_grace_ms).await {
                Ok(_) => {}
                Err(AdmissionError::Crashed) => return Err(AdmissionError::Crashed),
                Err(error) => tracing::warn!(%error, "stand-behind round failed; retrying next round"),
            }
        }
        if tokio::time::Instant::now() >= next_idempotency_cleanup {
            next_idempotency_cleanup = tokio::time::Instant::now() + Duration::from_secs(60);
            let deleted = sqlx::query(
                "DELETE FROM idempotency_keys WHERE ctid IN
                   (SELECT ctid FROM idempotency_keys WHERE expires_at_ms < $1 LIMIT 10000)",
            )
            .bind(wall_clock_ms())
            .execute(&core.pool)
            .await;
            if let Err(error) = deleted {
                tracing::warn!(%error, "idempotency key cleanup failed");
            }
        }
    }
}
