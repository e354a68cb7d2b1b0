//! The services the simulation runs, each behind `Service`: how a new
//! owner builds the partition's state from what was saved (the image), and
//! how a committed batch changes the image — what the services' SQL stores
//! do, in memory.

use std::collections::HashMap;
use std::sync::Arc;

use sluice_admission::jobs::JobRow;
use sluice_admission::partition::{AdmissionPartition, AdmissionWrites, Local, Prepared, StoredJob};
use sluice_common::core::{NoEffects, Owned};
use sluice_common::owner::OwnedState;
use sluice_common::SluiceConfig;
use sluice_limit_grant::core::image::{self, SavedImage};
use sluice_limit_grant::core::{LimitPartition, LimitWrites, PartitionSettings};

/// A partition-owning service, as the simulation runs it.
pub trait Service {
    type State: OwnedState;
    /// What the service's tables hold for one partition.
    type Image: Default;

    /// The state a new owner loads (`OwnedStore::load`); it serves after
    /// `OwnedState::begin_serving`.
    fn load(&self, image: &Self::Image, partition: i32, epoch: i64, now_ms: i64) -> Self::State;

    /// Fold a committed batch's writes into the image (`OwnedStore::persist`).
    fn save(&self, image: &mut Self::Image, writes: <Self::State as OwnedState>::Writes);

    /// What the store reads before a batch (`OwnedStore::prepare`).
    fn prepare(
        &self,
        _image: &Self::Image,
        _state: &Self::State,
        _locals: &[<Self::State as OwnedState>::Local],
    ) -> <Self::State as OwnedState>::Prepared {
        Default::default()
    }
}

// ---------------------------------------------------------------------------
// Admission

pub struct Admission {
    pub config: Arc<SluiceConfig>,
}

/// Admission's tables for one job partition: the job rows (payloads), the
/// outcomes of jobs that ended, and the active jobs as a new owner loads
/// them (snapshot and journal folded).
#[derive(Default)]
pub struct AdmissionImage {
    pub rows: HashMap<String, JobRow>,
    pub outcomes: HashMap<String, JobRow>,
    pub active: HashMap<String, JobRow>,
    pub seq: i64,
}

impl Service for Admission {
    type State = AdmissionPartition;
    type Image = AdmissionImage;

    fn load(&self, image: &AdmissionImage, partition: i32, _epoch: i64, _now_ms: i64) -> AdmissionPartition {
        let hub = sluice_admission::work::WorkerHub::without_workers();
        let settings = sluice_admission::partition::PartitionSettings {
            partition,
            ..sluice_admission::partition_settings(&self.config, &sluice_common::Faults::none(), hub)
        };
        let mut rows: Vec<JobRow> = image.active.values().cloned().collect();
        // The order a SQL load gives is no order: make it one.
        rows.sort_by(|left, right| left.state.job_id.cmp(&right.state.job_id));
        // Leases and re-send timers start when the owner serves
        // (`ServiceModel::begin_serving`), not here.
        AdmissionPartition::new(settings, rows, image.seq, None, 0)
    }

    fn save(&self, image: &mut AdmissionImage, writes: AdmissionWrites) {
        let mut created: HashMap<String, JobRow> = HashMap::new();
        for row in writes.inserted {
            image.rows.insert(row.state.job_id.clone(), row.clone());
            let mut active = row;
            active.payload = Vec::new();
            created.insert(active.state.job_id.clone(), active);
        }
        for row in writes.finished {
            image.outcomes.insert(row.state.job_id.clone(), row);
        }
        if let Some((seq, batch)) = writes.journal {
            sluice_admission::journal::replay(&mut image.active, &mut created, batch);
            image.seq = seq;
        }
        if let Some((seq, snapshot)) = writes.snapshot {
            image.active = snapshot
                .jobs
                .into_iter()
                .map(|job| {
                    let row = job.into_row(0);
                    (row.state.job_id.clone(), row)
                })
                .collect();
            image.seq = seq;
        }
    }

    fn prepare(&self, image: &AdmissionImage, state: &AdmissionPartition, locals: &[Local]) -> Prepared {
        let mut prepared = Prepared::default();
        let mut named: Vec<&str> = Vec::new();
        let mut claimed: Vec<&str> = Vec::new();
        for local in locals {
            match local {
                Local::Claim { attempts, .. } => {
                    for (job_id, _) in attempts {
                        named.push(job_id);
                        claimed.push(job_id);
                    }
                }
                Local::Complete { completions, .. } => {
                    named.extend(completions.iter().map(|(job_id, _, _)| job_id.as_str()))
                }
                Local::Cancel { job_id, .. } => named.push(job_id),
                Local::Enqueue { jobs, .. } => named.extend(jobs.iter().map(|job| job.job_id.as_str())),
                _ => {}
            }
        }
        for job_id in named {
            if state.job(job_id).is_some() {
                continue;
            }
            if let Some(outcome) = image.outcomes.get(job_id) {
                prepared.stored.insert(
                    job_id.to_string(),
                    StoredJob {
                        row: outcome.clone(),
                        finished: true,
                    },
                );
            } else if let Some(row) = image.rows.get(job_id) {
                prepared.stored.insert(
                    job_id.to_string(),
                    StoredJob {
                        row: row.clone(),
                        finished: false,
                    },
                );
            }
        }
        for job_id in state.payloads_needed(claimed.into_iter()) {
            let payload = image
                .rows
                .get(&job_id)
                .map(|row| row.payload.clone())
                .unwrap_or_default();
            prepared.payloads.insert(job_id, payload);
        }
        prepared
    }
}

// ---------------------------------------------------------------------------
// limit-grant

pub struct LimitGrant {
    pub settings: PartitionSettings,
}

impl Service for LimitGrant {
    type State = Owned<LimitPartition>;
    /// limit-grant's tables for one key partition (its core's own image).
    type Image = SavedImage;

    fn load(&self, image: &SavedImage, partition: i32, epoch: i64, now_ms: i64) -> Owned<LimitPartition> {
        let settings = PartitionSettings {
            partition,
            ..self.settings.clone()
        };
        Owned::new(image::load(image, settings, epoch, now_ms), Arc::new(NoEffects))
    }

    fn save(&self, image: &mut SavedImage, writes: LimitWrites) {
        image::save(image, &writes);
    }
}
