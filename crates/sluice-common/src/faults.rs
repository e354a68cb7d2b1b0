//! Deterministic fault hooks for the crash points (between a commit and a
//! publish, between a publish and an offset commit, ...). Tests arm a point to
//! fire on its n-th hit; production never arms any, and an unarmed hook costs
//! one relaxed atomic load.
//!
//! The same handle carries the instance's ordering barrier to tests
//! (`Faults::barrier`): the service registers it at start, a test that
//! started the instance in process calls it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FaultPoint {
    /// An owner committed a batch to PostgreSQL and has not published its effects.
    OwnerAfterCommitBeforePublish,
    /// An owner published a batch's effects and has not stored the input offsets.
    OwnerAfterPublishBeforeOffsetStore,
    /// Admission handed a batch of job requests over to their owners (and
    /// dead-lettered the rest) and has not stored the request offsets.
    AdmissionAfterPublishBeforeOffsetStore,
    /// Admission drops the release commands it would send (a lost release).
    AdmissionDropRelease,
    /// PostgreSQL refuses an owner's batch commit as it refuses bad data
    /// (an error that comes back every time): the batch is applied in parts
    /// and what still fails is set aside.
    OwnerCommitRefused,
    /// PostgreSQL refuses admission's save of the jobs named with
    /// `Faults::refuse_job`, every time (as it refuses bad data).
    AdmissionSaveRefused,
    /// The Kafka producer turns fatal (as an idempotent producer does when
    /// the broker lost its state): every send fails until it is rebuilt.
    ProducerFatal,
    /// An owner committed grants, and the stream that takes them (the job
    /// partition's admission link) breaks before they are written to it.
    LinkBrokenBeforeGrants,
    /// Admission committed a batch that claimed jobs for stream workers and
    /// dies before it pushes them (the partition stops as a crash would).
    AdmissionAfterCommitBeforePush,
    /// An owner took link commands from a stream and its partition stopped
    /// before the batch holding them was committed (released, revoked):
    /// they are never applied, and the stream stays open.
    LinkCommandsDroppedBeforeCommit,
    /// An owner's periodic check of its owner row misses a newer epoch (it
    /// read the row just before another instance took the partition over):
    /// it goes on believing it owns the partition until a commit fences it.
    OwnerIdleFenceCheckMissed,
    /// An owner took a partition over (loaded it, re-sent what it implies)
    /// and is held there, not yet serving, until the test calls
    /// `Faults::release` (a takeover that takes seconds under load).
    OwnerHeldBeforeServing,
}

/// The error an armed `OwnerCommitRefused` or `AdmissionSaveRefused` gives:
/// one PostgreSQL gives for data it can never store.
pub fn refused_by_storage() -> sqlx::Error {
    sqlx::Error::Encode("refused by a fault hook (as PostgreSQL refuses bad data)".into())
}

#[derive(Debug)]
struct Armed {
    hits_before_firing: u64,
    fires_left: u64,
    fired: u64,
}

/// An instance's ordering barrier: completes once everything the instance
/// was given before the call is applied and committed (what that covers is
/// the service's to say: admission's is `sluice_admission::barrier`).
pub type Barrier = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Shared by every component of one service instance.
#[derive(Clone, Default)]
pub struct Faults {
    any_armed: Arc<AtomicBool>,
    points: Arc<Mutex<HashMap<FaultPoint, Armed>>>,
    refused_jobs: Arc<Mutex<std::collections::HashSet<String>>>,
    barrier: Arc<Mutex<Option<Barrier>>>,
    /// Permits for the tasks a hold point keeps (`hold_if_hit`).
    releases: Arc<Releases>,
}

/// No permit until a test releases a held task.
struct Releases(tokio::sync::Semaphore);

impl Default for Releases {
    fn default() -> Self {
        Releases(tokio::sync::Semaphore::new(0))
    }
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Faults")
            .field("any_armed", &self.any_armed)
            .field("points", &self.points)
            .finish_non_exhaustive()
    }
}

impl Faults {
    pub fn none() -> Self {
        Self::default()
    }

    /// Fire `times` times, starting at the `(skip + 1)`-th hit of `point`.
    pub fn arm(&self, point: FaultPoint, skip: u64, times: u64) {
        let mut points = self.points.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        points.insert(
            point,
            Armed {
                hits_before_firing: skip,
                fires_left: times,
                fired: 0,
            },
        );
        self.any_armed.store(true, Ordering::Release);
    }

    /// True when the hook fires at this hit.
    pub fn hit(&self, point: FaultPoint) -> bool {
        if !self.any_armed.load(Ordering::Relaxed) {
            return false;
        }
        let mut points = self.points.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let Some(armed) = points.get_mut(&point) else {
            return false;
        };
        if armed.hits_before_firing > 0 {
            armed.hits_before_firing -= 1;
            return false;
        }
        if armed.fires_left == 0 {
            return false;
        }
        armed.fires_left -= 1;
        armed.fired += 1;
        tracing::warn!(?point, "fault hook fired");
        true
    }

    /// When `point` fires, wait here until the test calls `release`.
    pub async fn hold_if_hit(&self, point: FaultPoint) {
        if !self.hit(point) {
            return;
        }
        if let Ok(permit) = self.releases.0.acquire().await {
            permit.forget();
        }
    }

    /// Let one task held at a hold point go on.
    pub fn release(&self) {
        self.releases.0.add_permits(1);
    }

    /// PostgreSQL refuses to store `job_id`, every time it is saved
    /// (`FaultPoint::AdmissionSaveRefused` counts the refusals).
    pub fn refuse_job(&self, job_id: &str) {
        self.refused_jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .insert(job_id.to_string());
        self.arm(FaultPoint::AdmissionSaveRefused, 0, u64::MAX);
    }

    /// Whether saving `job_id` is refused (and counts the refusal).
    pub fn refuses_job(&self, job_id: &str) -> bool {
        if !self.any_armed.load(Ordering::Relaxed) {
            return false;
        }
        let refused = self
            .refused_jobs
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains(job_id);
        refused && self.hit(FaultPoint::AdmissionSaveRefused)
    }

    /// The service registers its ordering barrier (at start; a restarted
    /// instance given the same handle replaces it).
    pub fn set_barrier(&self, barrier: Barrier) {
        *self.barrier.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(barrier);
    }

    /// Wait on the instance's ordering barrier. `Err`: the instance has
    /// none, or stopped before answering.
    pub async fn barrier(&self) -> Result<(), String> {
        let barrier = self
            .barrier
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone()
            .ok_or_else(|| "this instance has no barrier (not started yet?)".to_string())?;
        barrier().await
    }

    /// How many times `point` has fired.
    pub fn fired(&self, point: FaultPoint) -> u64 {
        let points = self.points.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        points.get(&point).map_or(0, |armed| armed.fired)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fires_on_the_chosen_hit_only() {
        let faults = Faults::none();
        assert!(!faults.hit(FaultPoint::AdmissionDropRelease));
        faults.arm(FaultPoint::AdmissionDropRelease, 2, 1);
        assert!(!faults.hit(FaultPoint::AdmissionDropRelease));
        assert!(!faults.hit(FaultPoint::AdmissionDropRelease));
        assert!(faults.hit(FaultPoint::AdmissionDropRelease));
        assert!(!faults.hit(FaultPoint::AdmissionDropRelease));
        assert_eq!(faults.fired(FaultPoint::AdmissionDropRelease), 1);
        assert!(!faults.hit(FaultPoint::OwnerAfterCommitBeforePublish));
    }
}
