//! The owner runtime's tasks as the simulation drives them: assignments and
//! takeovers, the idle check that touches the owner row or stands by, and
//! the partition batches (decided, committed fenced, then sent and
//! answered).

use prost::Message;
use rand::Rng;
use sluice_common::link::Link;
use sluice_proto::v1 as pb;

use crate::config::Bug;
use crate::model::BatchEnd;
use crate::world::{Event, Svc, World, BASE_MS};

impl World {
    pub(crate) fn up(&self, svc: Svc, instance: usize) -> bool {
        match svc {
            Svc::Admission => self.adm.up[instance],
            Svc::LimitGrant => self.lg.up[instance],
        }
    }

    /// The group assigns `partition` to `instance`, which takes it over:
    /// it loads and re-sends what the partition implies now, and serves
    /// once its takeover is done (`serve`, `takeover_ms` later).
    pub(crate) fn assign(&mut self, svc: Svc, partition: usize, instance: usize) {
        let now_ms = self.clock_ms();
        let (epoch, sends) = match svc {
            Svc::Admission => {
                self.adm.assigned[partition] = Some(instance);
                self.adm.assigned_at[partition] = self.now;
                self.adm.take_over(instance, partition, now_ms)
            }
            Svc::LimitGrant => {
                self.lg.assigned[partition] = Some(instance);
                self.lg.assigned_at[partition] = self.now;
                self.lg.take_over(instance, partition, now_ms)
            }
        };
        self.send(svc, instance, sends);
        if svc == Svc::Admission {
            // An ownership of the partition here that this one replaces
            // ended: its claim goes (the new one claims when it serves).
            self.claims_changed(instance);
        }
        let takeover_ms = self.takeover_ms();
        self.at(
            takeover_ms,
            Event::Serve {
                svc,
                instance,
                partition,
                epoch,
            },
        );
    }

    /// An owner never ends a lease its worker still holds by its own copy
    /// (worker-protocol §3: from when its last renewal answered was sent):
    /// every renewal is saved before its answer, and a new owner keeps a
    /// confirmed attempt until the lease its worker was told ends (plus a
    /// second), so the worker has stopped the job by then.
    fn check_lease_expiries(&mut self, instance: usize, partition: usize) {
        let now_ms = self.clock_ms();
        let Some(task) = self.adm.tasks[instance][partition].as_ref() else {
            return;
        };
        let early = task.state.active_rows().find_map(|row| {
            let record = row.state.history.records.last()?;
            if record.outcome != "lease_expired" || record.at_ms != now_ms {
                return None;
            }
            let held_until = self
                .workers
                .held_by_its_worker_until(&row.state.job_id, record.attempt)?;
            (held_until > now_ms).then(|| (row.state.job_id.clone(), record.attempt, held_until - now_ms))
        });
        if let Some((job_id, attempt, held_for)) = early {
            self.checks.violation = Some(format!(
                "{job_id} attempt {attempt}: its owner (admission {instance}, partition {partition}) ended its lease \
                 while its worker held it by its own count for {held_for} ms more"
            ));
        }
    }

    /// How long a takeover takes between its load and serving: loading
    /// and re-sending thousands of jobs under load, or held until the old
    /// owner's revoke (`OwnerHeldBeforeServing`). Mostly quick; a fifth of
    /// takeovers outlast the lease (3 s), the stream end grace (1 s) and
    /// even a caller's wait for a loading partition (5 s).
    fn takeover_ms(&mut self) -> i64 {
        match self.rng.random_range(0..10) {
            0..=5 => self.rng.random_range(1..100),
            6 | 7 => self.rng.random_range(100..2_000),
            _ => self.rng.random_range(2_000..8_000),
        }
    }

    /// The takeover of `instance`'s task (of `epoch`) is done: it serves
    /// (leases and re-send timers from now), takes the calls that waited,
    /// touches its row every 2 s and, for admission, claims the partition
    /// on its links.
    pub(crate) fn serve(&mut self, svc: Svc, instance: usize, partition: usize, epoch: i64) {
        let now_ms = self.clock_ms();
        let grace_from_load = self.config.bug == Some(Bug::GraceFromLoad);
        let serving = match svc {
            Svc::Admission => self
                .adm
                .begin_serving(instance, partition, epoch, now_ms, grace_from_load),
            Svc::LimitGrant => self
                .lg
                .begin_serving(instance, partition, epoch, now_ms, grace_from_load),
        };
        if !serving {
            return;
        }
        self.schedule_run(svc, instance, partition, 1);
        self.at(
            2_000,
            Event::IdleCheck {
                svc,
                instance,
                partition,
            },
        );
        if svc == Svc::Admission {
            self.claims_changed(instance);
        }
    }

    /// Callers that waited `LOADING_WAIT` for a task still loading give
    /// up: UNAVAILABLE, or a refused link command.
    pub(crate) fn loading_wait_over(&mut self, svc: Svc, instance: usize, partition: usize) {
        match svc {
            Svc::Admission => self.adm.give_up_waiting(instance, partition, self.now),
            Svc::LimitGrant => self.lg.give_up_waiting(instance, partition, self.now),
        }
        self.resolve_calls();
        self.resolve_link_acks();
    }

    pub(crate) fn schedule_run(&mut self, svc: Svc, instance: usize, partition: usize, delay: i64) {
        let at = self.now + delay.max(0);
        let earlier = self
            .queued_runs
            .get(&(svc, instance, partition))
            .is_none_or(|queued| at < *queued);
        if earlier {
            self.queued_runs.insert((svc, instance, partition), at);
            self.at(
                delay,
                Event::Run {
                    svc,
                    instance,
                    partition,
                },
            );
        }
    }

    /// Every 2 s an owner touches its row, and finds out when a newer owner
    /// took the partition (then it stands by); a task standing by takes
    /// the partition back when its owner let it go. A task still taking
    /// the partition over checks nothing: this chain of checks ends, and
    /// `serve` starts the task's own.
    pub(crate) fn idle_check(&mut self, svc: Svc, instance: usize, partition: usize) {
        let now = self.now;
        let (exists, standing_by, ours, released, silent, assigned_here) = match svc {
            Svc::Admission => {
                let store = &self.adm.stores[partition];
                let task = self.adm.tasks[instance][partition].as_ref();
                (
                    task.is_some_and(|task| !task.loading),
                    task.is_some_and(|task| task.standing_by),
                    task.is_some_and(|task| task.epoch == store.epoch),
                    store.released,
                    now - (store.touched_ms - BASE_MS) >= 15_000,
                    self.adm.assigned[partition] == Some(instance),
                )
            }
            Svc::LimitGrant => {
                let store = &self.lg.stores[partition];
                let task = self.lg.tasks[instance][partition].as_ref();
                (
                    task.is_some_and(|task| !task.loading),
                    task.is_some_and(|task| task.standing_by),
                    task.is_some_and(|task| task.epoch == store.epoch),
                    store.released,
                    now - (store.touched_ms - BASE_MS) >= 15_000,
                    self.lg.assigned[partition] == Some(instance),
                )
            }
        };
        if !exists || !self.up(svc, instance) {
            return;
        }
        if ours && !standing_by {
            let touched = self.clock_ms();
            match svc {
                Svc::Admission => self.adm.stores[partition].touched_ms = touched,
                Svc::LimitGrant => self.lg.stores[partition].touched_ms = touched,
            }
        } else if !standing_by {
            self.stand_by(svc, instance, partition);
        } else if assigned_here && (released || silent) {
            self.assign(svc, partition, instance);
            return;
        }
        let next = if standing_by || !ours { 1_000 } else { 2_000 };
        self.at(
            next,
            Event::IdleCheck {
                svc,
                instance,
                partition,
            },
        );
    }

    pub(crate) fn stand_by(&mut self, svc: Svc, instance: usize, partition: usize) {
        match svc {
            Svc::Admission => {
                if let Some(task) = self.adm.tasks[instance][partition].as_mut() {
                    task.standing_by = true;
                    // Its callers' channels close: they retry elsewhere.
                    task.locals.clear();
                    task.waiting.clear();
                }
                self.claims_changed(instance);
            }
            Svc::LimitGrant => {
                if let Some(task) = self.lg.tasks[instance][partition].as_mut() {
                    task.standing_by = true;
                    task.locals.clear();
                    task.waiting.clear();
                }
            }
        }
        self.resolve_calls();
        self.resolve_link_acks();
    }

    pub(crate) fn run_partition(&mut self, svc: Svc, instance: usize, partition: usize) {
        if !self.up(svc, instance) {
            return;
        }
        let now_ms = self.clock_ms();
        let commit_fails = match self.failing_commits.get_mut(&(svc, partition)) {
            Some(left) if *left > 0 => {
                *left -= 1;
                true
            }
            _ => false,
        };
        let answer_without_fence = self.config.bug == Some(Bug::AnswerWithoutFence);
        let send_without_fence = self.config.bug == Some(Bug::SendWithoutFence);
        let end = match svc {
            Svc::Admission => self.adm.run_batch(
                instance,
                partition,
                now_ms,
                commit_fails,
                answer_without_fence,
                send_without_fence,
            ),
            Svc::LimitGrant => self.lg.run_batch(
                instance,
                partition,
                now_ms,
                commit_fails,
                answer_without_fence,
                send_without_fence,
            ),
        };
        match end {
            BatchEnd::Committed {
                sends,
                replies,
                rejected,
            } => {
                // Nothing is set aside without its reason.
                if let Some(bare) = rejected.iter().find(|entry| entry.reason.trim().is_empty()) {
                    self.checks.violation = Some(format!(
                        "input set aside without a reason at {} ms (offset {})",
                        self.now, bare.offset
                    ));
                }
                // A crash is not injected into the only instance of its
                // service that is up (`kill` declines it): the batch then
                // goes on as committed (sent, answered, its next run
                // scheduled), instead of being left without a run.
                if self.crash_after_commit.remove(&(svc, instance)) && self.can_kill(svc, instance) {
                    // Saved, nothing sent or answered: the instance dies.
                    drop(replies);
                    drop(sends);
                    self.kill(svc, instance);
                    return;
                }
                if svc == Svc::Admission {
                    self.check_lease_expiries(instance, partition);
                }
                self.send(svc, instance, sends);
                for reply in replies {
                    reply();
                }
                self.resolve_calls();
                self.resolve_link_acks();
                if svc == Svc::LimitGrant {
                    self.check_limit_partition(instance, partition);
                }
            }
            BatchEnd::Fenced => {
                self.stand_by(svc, instance, partition);
                return;
            }
            BatchEnd::Failed => {
                self.resolve_calls();
                self.resolve_link_acks();
                self.schedule_run(svc, instance, partition, 50);
                return;
            }
            BatchEnd::Idle => {}
        }
        self.schedule_wakeup(svc, instance, partition);
    }

    /// The partition's next timer (lease ends, re-sends, sweeps).
    pub(crate) fn schedule_wakeup(&mut self, svc: Svc, instance: usize, partition: usize) {
        let now_ms = self.clock_ms();
        let wakeup = match svc {
            Svc::Admission => self.adm.tasks[instance][partition]
                .as_ref()
                .filter(|task| !task.standing_by && !task.loading)
                .and_then(|task| sluice_common::owner::OwnedState::next_wakeup_ms(&task.state)),
            Svc::LimitGrant => self.lg.tasks[instance][partition]
                .as_ref()
                .filter(|task| !task.standing_by && !task.loading)
                .and_then(|task| sluice_common::owner::OwnedState::next_wakeup_ms(&task.state)),
        };
        if let Some(at) = wakeup {
            let delay = (at - now_ms).max(1);
            self.schedule_run(svc, instance, partition, delay);
        }
    }

    /// What a committed batch sends: link entries and Kafka messages.
    pub(crate) fn send(&mut self, svc: Svc, instance: usize, mut sends: sluice_common::kafka::Outbox) {
        let links = sends.take_links();
        for ((link, partition), entries) in links {
            let partition = usize::try_from(partition).unwrap_or(0);
            match link {
                Link::LimitGrant => self.client_send(instance, partition, entries),
                Link::Admission => self.route_grants(instance, partition, entries),
                Link::RateWindow => {}
            }
        }
        for message in sends.into_messages() {
            if svc == Svc::Admission && message.topic.contains("admitted") {
                if let Ok(admitted) = pb::AdmittedJob::decode(message.payload.as_slice()) {
                    let delay = self.rng.random_range(5..60);
                    self.workers.publish(admitted, self.now + delay);
                }
            }
        }
    }
}
