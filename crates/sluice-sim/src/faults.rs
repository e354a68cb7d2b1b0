//! Faults while simulated time is below `faults_until_ms`: instances killed
//! and restarted, overlapping rebalances, broken links, failed commits,
//! crashes after a commit, worker faults.

use rand::Rng;

use crate::links::{LinkClient, Router};
use crate::world::{Event, Svc, World};

impl World {
    pub(crate) fn fault(&mut self) {
        if self.now >= self.config.faults_until_ms {
            return;
        }
        self.faults += 1;
        let instances = self.config.instances;
        // Overlapping owners (a rebalance the old member hears of late)
        // are where fencing bugs show: a quarter of the faults.
        match self.rng.random_range(0..12) {
            0 => {
                let instance = self.rng.random_range(0..instances);
                self.kill(Svc::Admission, instance);
            }
            1 => {
                let instance = self.rng.random_range(0..instances);
                self.kill(Svc::LimitGrant, instance);
            }
            2 | 10 | 11 => {
                let svc = if self.rng.random_bool(0.5) {
                    Svc::Admission
                } else {
                    Svc::LimitGrant
                };
                self.overlapping_move(svc);
            }
            3 | 4 => {
                let adm = self.rng.random_range(0..instances);
                let owner = self.rng.random_range(0..instances);
                self.break_link(adm, owner);
            }
            5 => {
                let svc = if self.rng.random_bool(0.5) {
                    Svc::Admission
                } else {
                    Svc::LimitGrant
                };
                let partitions = match svc {
                    Svc::Admission => self.config.job_partitions,
                    Svc::LimitGrant => self.config.limit_partitions,
                };
                let partition = self.rng.random_range(0..partitions);
                let failures = self.rng.random_range(1..4);
                *self.failing_commits.entry((svc, partition)).or_default() += failures;
            }
            6 => {
                let svc = if self.rng.random_bool(0.5) {
                    Svc::Admission
                } else {
                    Svc::LimitGrant
                };
                let instance = self.rng.random_range(0..instances);
                self.crash_after_commit.insert((svc, instance));
            }
            _ => self.worker_fault(),
        }
        let next = self.rng.random_range(300..2_000);
        self.at(next, Event::Fault);
    }

    /// Whether `kill` would stop `instance`: it is up, and another instance
    /// of its service is.
    pub(crate) fn can_kill(&self, svc: Svc, instance: usize) -> bool {
        let others = (0..self.config.instances)
            .filter(|other| *other != instance && self.up(svc, *other))
            .count();
        others > 0 && self.up(svc, instance)
    }

    /// An instance dies (kill -9): its tasks and links are gone; the group
    /// gives its partitions to another instance after the session timeout;
    /// it comes back later.
    pub(crate) fn kill(&mut self, svc: Svc, instance: usize) {
        if !self.can_kill(svc, instance) {
            return;
        }
        match svc {
            Svc::Admission => {
                self.adm.stop_instance(instance, false);
                for owner in 0..self.config.instances {
                    self.conns[instance][owner] = None;
                }
                self.clients[instance] = LinkClient::default();
                self.claims[instance].clear();
            }
            Svc::LimitGrant => {
                self.lg.stop_instance(instance, false);
                self.routers[instance] = Router::default();
                for adm in 0..self.config.instances {
                    if self.conns[adm][instance].is_some() {
                        self.break_link(adm, instance);
                    }
                }
            }
        }
        self.resolve_calls();
        self.resolve_link_acks();
        let partitions = match svc {
            Svc::Admission => self.adm.partitions(),
            Svc::LimitGrant => self.lg.partitions(),
        };
        let session_timeout = self.rng.random_range(500..3_000);
        for partition in 0..partitions {
            let assigned = match svc {
                Svc::Admission => self.adm.assigned[partition],
                Svc::LimitGrant => self.lg.assigned[partition],
            };
            if assigned == Some(instance) {
                let to = (0..self.config.instances)
                    .find(|other| *other != instance && self.up(svc, *other))
                    .unwrap_or(instance);
                self.at(session_timeout, Event::Reassign { svc, partition, to });
            }
        }
        let restart = session_timeout + self.rng.random_range(200..3_000);
        self.at(restart, Event::Restart { svc, instance });
    }

    pub(crate) fn restart(&mut self, svc: Svc, instance: usize) {
        match svc {
            Svc::Admission => {
                self.adm.up[instance] = true;
                for owner in 0..self.config.instances {
                    self.at(1, Event::Connect { adm: instance, owner });
                }
                self.at(1, Event::DirectoryRead { adm: instance });
            }
            Svc::LimitGrant => {
                self.lg.up[instance] = true;
                for adm in 0..self.config.instances {
                    self.at(50, Event::Connect { adm, owner: instance });
                }
            }
        }
        // The rebalance after it joins moves one partition to it (the old
        // owner gives it up first).
        let partitions = match svc {
            Svc::Admission => self.adm.partitions(),
            Svc::LimitGrant => self.lg.partitions(),
        };
        let partition = self.rng.random_range(0..partitions);
        let assigned = match svc {
            Svc::Admission => self.adm.assigned[partition],
            Svc::LimitGrant => self.lg.assigned[partition],
        };
        if let Some(old) = assigned.filter(|old| *old != instance) {
            self.at(
                100,
                Event::Revoke {
                    svc,
                    instance: old,
                    partition,
                    decided_at: self.now,
                },
            );
        }
        self.at(
            150,
            Event::Reassign {
                svc,
                partition,
                to: instance,
            },
        );
    }

    /// The group moves a partition while its old member does not know yet
    /// (overlapping rebalances): both hold it for a while.
    pub(crate) fn overlapping_move(&mut self, svc: Svc) {
        let partitions = match svc {
            Svc::Admission => self.adm.partitions(),
            Svc::LimitGrant => self.lg.partitions(),
        };
        let partition = self.rng.random_range(0..partitions);
        let assigned = match svc {
            Svc::Admission => self.adm.assigned[partition],
            Svc::LimitGrant => self.lg.assigned[partition],
        };
        let Some(old) = assigned else {
            return;
        };
        let Some(to) = (0..self.config.instances).find(|other| *other != old && self.up(svc, *other)) else {
            return;
        };
        self.at(1, Event::Reassign { svc, partition, to });
        let told = self.rng.random_range(200..6_000);
        self.at(
            told,
            Event::Revoke {
                svc,
                instance: old,
                partition,
                decided_at: self.now,
            },
        );
    }

    pub(crate) fn reassign(&mut self, svc: Svc, partition: usize, to: usize) {
        // The group assigns among the members it has: a member that went
        // down meanwhile is not one of them.
        let Some(to) = std::iter::once(to)
            .chain(0..self.config.instances)
            .find(|member| self.up(svc, *member))
        else {
            return;
        };
        let has_task = match svc {
            Svc::Admission => self.adm.tasks[to][partition].is_some(),
            Svc::LimitGrant => self.lg.tasks[to][partition].is_some(),
        };
        let assigned = match svc {
            Svc::Admission => self.adm.assigned[partition],
            Svc::LimitGrant => self.lg.assigned[partition],
        };
        if has_task && assigned == Some(to) {
            return;
        }
        self.assign(svc, partition, to);
    }

    pub(crate) fn revoke(&mut self, svc: Svc, instance: usize, partition: usize, decided_at: i64) {
        let (assigned, assigned_at) = match svc {
            Svc::Admission => (self.adm.assigned[partition], self.adm.assigned_at[partition]),
            Svc::LimitGrant => (self.lg.assigned[partition], self.lg.assigned_at[partition]),
        };
        if assigned == Some(instance) && assigned_at > decided_at {
            // Assigned here again after the group decided this revoke: it
            // was overtaken. (A member that joins has the old owner give a
            // partition up before it is assigned anew: still assigned here
            // then, and revoked all the same.)
            return;
        }
        match svc {
            Svc::Admission => {
                self.adm.release(instance, partition);
                self.claims_changed(instance);
            }
            Svc::LimitGrant => self.lg.release(instance, partition),
        }
        self.resolve_calls();
        self.resolve_link_acks();
    }
}
