//! What one seed's run found, the checks made against the owners' state,
//! and the dump of the cluster for a failing seed.

use sluice_common::partition::key_partition;

use crate::world::{job_index, job_name, World, BASE_MS};

/// What one seed's run found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Report {
    pub seed: u64,
    pub steps: u64,
    pub jobs: usize,
    pub finished: usize,
    /// The first guarantee broken, with the simulated time.
    pub violation: Option<String>,
    /// The longest time a key had waiting jobs and nothing running.
    pub stall_max_ms: i64,
    /// Every such stall, for percentiles over seeds.
    pub stalls_ms: Vec<i64>,
    pub end_ms: i64,
    pub faults: u64,
    /// A digest of every event handled, in order (with `Trace::Digest` or
    /// `Trace::Print`): two runs of one seed give the same.
    pub digest: Option<u64>,
}

impl World {
    /// Guarantee 1 at the owner: a key's holders never exceed its max.
    pub(crate) fn check_limit_partition(&mut self, instance: usize, partition: usize) {
        let Some(task) = self.lg.tasks[instance][partition].as_ref() else {
            return;
        };
        if task.epoch != self.lg.stores[partition].epoch {
            return;
        }
        for key in 0..self.config.keys {
            let name = format!("k{key}");
            if key_partition("acme", &name, i32::try_from(self.config.limit_partitions).unwrap_or(1))
                != i32::try_from(partition).unwrap_or(-1)
            {
                continue;
            }
            let holders = task.state.core().holders_of("acme", &name);
            if holders > usize::try_from(self.config.max).unwrap_or(usize::MAX) {
                self.checks.violation = Some(format!(
                    "overrun at {} ms: key {name} has {holders} holders at limit-grant, max {}",
                    self.now, self.config.max
                ));
            }
        }
    }

    /// Jobs whose end is saved (succeeded, failed, cancelled) have ended.
    pub(crate) fn check_owners(&mut self) {
        for store in &self.adm.stores {
            for row in store.image.outcomes.values() {
                if let Some(job) = job_index(&row.state.job_id) {
                    self.checks
                        .ended_at(job, row.state.finished_at_ms.map_or(self.now, |at| at - BASE_MS));
                }
            }
        }
    }

    /// What the cluster holds, for a failing seed (SIM_TRACE).
    pub(crate) fn dump(&self) {
        eprintln!("--- at {} ms", self.now);
        for instance in 0..self.config.instances {
            for partition in 0..self.adm.partitions() {
                if let Some(task) = self.adm.tasks[instance][partition].as_ref() {
                    eprintln!(
                        "admission {instance} p{partition} epoch {} (store {}) standing_by {} locals {}",
                        task.epoch,
                        self.adm.stores[partition].epoch,
                        task.standing_by,
                        task.locals.len()
                    );
                    for job in 0..self.config.jobs {
                        if let Some(row) = task.state.job(&job_name(job)) {
                            eprintln!(
                                "  {} {:?} attempt {} step {} due {:?} lease {:?}",
                                row.state.job_id,
                                row.state.status,
                                row.state.attempt,
                                row.state.step,
                                row.state.due_at_ms.map(|at| at - BASE_MS),
                                row.state.lease_expires_at_ms.map(|at| at - BASE_MS)
                            );
                        }
                    }
                }
            }
            for partition in 0..self.lg.partitions() {
                if let Some(task) = self.lg.tasks[instance][partition].as_ref() {
                    eprintln!(
                        "limit-grant {instance} p{partition} epoch {} (store {}) standing_by {}",
                        task.epoch, self.lg.stores[partition].epoch, task.standing_by
                    );
                    for key in 0..self.config.keys {
                        let name = format!("k{key}");
                        let holders = task.state.core().holders_of("acme", &name);
                        let waiting = task.state.core().waiting_on("acme", &name);
                        if holders + waiting > 0 {
                            eprintln!("  {name}: {holders} holders, {waiting} waiting");
                        }
                    }
                }
            }
            eprintln!(
                "client {instance}: {} unacked, directory {:?}, conns {:?}",
                self.clients[instance].unacked.len(),
                self.clients[instance].directory,
                self.conns[instance]
            );
        }
        eprintln!("workers: {} queued", self.workers.queued());
    }
}
