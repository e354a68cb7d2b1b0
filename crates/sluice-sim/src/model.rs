//! The owner runtime, modelled after `sluice_common::owner` for one
//! service: the fenced store of each partition, and the partition tasks of
//! each instance (current or stale owners, standing by when fenced). A
//! batch is decided by the service's real core, committed fenced (every
//! batch that answers or sends anything), then its sends and answers come
//! out; a fenced batch gives the partition up with nothing sent or
//! answered.

use sluice_common::kafka::{InMsg, Outbox};
use sluice_common::owner::{OwnedState, Rejected, Reply};

use crate::services::Service;

/// What one partition's tables hold, and its fence.
pub struct PartStore<I> {
    pub epoch: i64,
    pub image: I,
    /// The owner gave it up in order (revoked, stopping).
    pub released: bool,
    /// When the owner last committed or touched its row.
    pub touched_ms: i64,
    /// The instance the owner directory names.
    pub owner: Option<usize>,
}

/// One instance's task for one partition.
pub struct Task<S: Service> {
    pub epoch: i64,
    pub state: S::State,
    pub locals: Vec<<S::State as OwnedState>::Local>,
    pub messages: Vec<InMsg>,
    /// Fenced: the task stands by until the owner lets the partition go.
    pub standing_by: bool,
    /// Taken over and not serving yet (the takeover loads, re-sends and
    /// may be held: `OwnerHeldBeforeServing`): it decides nothing, and the
    /// calls that reach it wait in `waiting`.
    pub loading: bool,
    /// When the task loaded the partition (owner clock, ms).
    pub loaded_ms: i64,
    /// When it began serving (owner clock, ms; again after a reload).
    pub serving_since_ms: i64,
    /// Calls waiting for the task to serve, each with the simulated time
    /// its caller gives up (`LOADING_WAIT`: then UNAVAILABLE).
    pub waiting: Vec<(i64, <S::State as OwnedState>::Local)>,
}

/// How a batch ended.
pub enum BatchEnd {
    /// Committed: what to send, and the answers to give (in this order).
    Committed {
        sends: Outbox,
        replies: Vec<Reply>,
        rejected: Vec<Rejected>,
    },
    /// A newer owner holds the partition: nothing was saved, sent or
    /// answered, and the task stands by.
    Fenced,
    /// The commit failed (a fault that passes): the state is reloaded and
    /// the batch's callers get no answer (they retry).
    Failed,
    /// Nothing to do.
    Idle,
}

/// One service's partitions across its instances.
pub struct ServiceModel<S: Service> {
    pub service: S,
    pub stores: Vec<PartStore<S::Image>>,
    /// `tasks[instance][partition]`.
    pub tasks: Vec<Vec<Option<Task<S>>>>,
    /// The partition's assignment in the consumer group.
    pub assigned: Vec<Option<usize>>,
    /// When (simulated ms) the group last assigned the partition.
    pub assigned_at: Vec<i64>,
    pub up: Vec<bool>,
}

impl<S: Service> ServiceModel<S> {
    pub fn new(service: S, partitions: usize, instances: usize) -> Self {
        ServiceModel {
            service,
            stores: (0..partitions)
                .map(|_| PartStore {
                    epoch: 0,
                    image: S::Image::default(),
                    released: false,
                    touched_ms: 0,
                    owner: None,
                })
                .collect(),
            tasks: (0..instances)
                .map(|_| (0..partitions).map(|_| None).collect())
                .collect(),
            assigned: vec![None; partitions],
            assigned_at: vec![0; partitions],
            up: vec![true; instances],
        }
    }

    pub fn partitions(&self) -> usize {
        self.stores.len()
    }

    /// Take `partition` over on `instance`: bump the epoch, load what is
    /// saved. Returns the new epoch and what the new owner sends again
    /// (`resend_all`). The task serves from `begin_serving` on.
    pub fn take_over(&mut self, instance: usize, partition: usize, now_ms: i64) -> (i64, Outbox) {
        let store = &mut self.stores[partition];
        store.epoch += 1;
        store.released = false;
        store.touched_ms = now_ms;
        store.owner = Some(instance);
        let epoch = store.epoch;
        let partition_number = i32::try_from(partition).unwrap_or(i32::MAX);
        let state = self.service.load(&store.image, partition_number, epoch, now_ms);
        let mut sends = Outbox::new();
        state.resend_all(now_ms, &mut sends);
        self.tasks[instance][partition] = Some(Task {
            epoch,
            state,
            locals: Vec::new(),
            messages: Vec::new(),
            standing_by: false,
            loading: true,
            loaded_ms: now_ms,
            serving_since_ms: now_ms,
            waiting: Vec::new(),
        });
        (epoch, sends)
    }

    /// The takeover of `instance`'s task (of `epoch`) for `partition` is
    /// done: it serves from `now_ms` (`OwnedState::begin_serving`; with
    /// `grace_from_load`, from its load time: the bug bde4573 fixed), and
    /// the calls that waited for it are its first batch's. False when that
    /// task is gone or serves already.
    pub fn begin_serving(
        &mut self,
        instance: usize,
        partition: usize,
        epoch: i64,
        now_ms: i64,
        grace_from_load: bool,
    ) -> bool {
        if !self.up[instance] {
            return false;
        }
        let Some(task) = self.tasks[instance][partition]
            .as_mut()
            .filter(|task| task.epoch == epoch && task.loading && !task.standing_by)
        else {
            return false;
        };
        task.loading = false;
        task.serving_since_ms = now_ms;
        let serving_from = if grace_from_load { task.loaded_ms } else { now_ms };
        task.state.begin_serving(serving_from);
        let waiting = std::mem::take(&mut task.waiting);
        task.locals.extend(waiting.into_iter().map(|(_, local)| local));
        true
    }

    /// Whether `instance` serves `partition` or is taking it over.
    pub fn owns(&self, instance: usize, partition: usize) -> bool {
        self.up[instance]
            && self.tasks[instance][partition]
                .as_ref()
                .is_some_and(|task| !task.standing_by)
    }

    /// The task of `instance` that is taking `partition` over (loading).
    pub fn loading(&mut self, instance: usize, partition: usize) -> Option<&mut Task<S>> {
        if !self.up[instance] {
            return None;
        }
        self.tasks[instance][partition]
            .as_mut()
            .filter(|task| task.loading && !task.standing_by)
    }

    /// Callers that waited for a loading task until `now` give up: their
    /// channels close (UNAVAILABLE, or a refused link command).
    pub fn give_up_waiting(&mut self, instance: usize, partition: usize, now: i64) {
        if let Some(task) = self.tasks[instance][partition].as_mut() {
            task.waiting.retain(|(give_up_at, _)| *give_up_at > now);
        }
    }

    /// The task of `instance` that serves `partition` now (taken over,
    /// not standing by).
    pub fn serving(&mut self, instance: usize, partition: usize) -> Option<&mut Task<S>> {
        if !self.up[instance] {
            return None;
        }
        self.tasks[instance][partition]
            .as_mut()
            .filter(|task| !task.standing_by && !task.loading)
    }

    /// Decide and commit one batch of `instance`'s task for `partition`.
    /// `commit_fails`: the store refuses this commit for a reason that passes.
    /// `answer_without_fence` puts back issue 29's bug: a batch that wrote
    /// nothing is answered without a fenced commit, and one whose fenced
    /// commit matched no fence row is answered as if it had committed.
    pub fn run_batch(
        &mut self,
        instance: usize,
        partition: usize,
        now_ms: i64,
        commit_fails: bool,
        answer_without_fence: bool,
        send_without_fence: bool,
    ) -> BatchEnd {
        let Some(task) = self.tasks[instance][partition]
            .as_mut()
            .filter(|task| !task.standing_by && !task.loading)
        else {
            return BatchEnd::Idle;
        };
        let locals = std::mem::take(&mut task.locals);
        let messages = std::mem::take(&mut task.messages);
        let prepared = self
            .service
            .prepare(&self.stores[partition].image, &task.state, &locals);
        task.state.prepared(prepared);
        let mut writes = <<S::State as OwnedState>::Writes as Default>::default();
        let mut sends = Outbox::new();
        let mut replies: Vec<Reply> = Vec::new();
        let mut rejected: Vec<Rejected> = Vec::new();
        task.state.apply(
            now_ms,
            &messages,
            locals,
            &mut writes,
            &mut sends,
            &mut replies,
            &mut rejected,
        );
        let nothing = sluice_common::owner::WriteSet::is_empty(&writes)
            && sends.is_empty()
            && replies.is_empty()
            && rejected.is_empty();
        if nothing {
            return BatchEnd::Idle;
        }
        let store = &mut self.stores[partition];
        if answer_without_fence && sluice_common::owner::WriteSet::is_empty(&writes) && rejected.is_empty() {
            return BatchEnd::Committed {
                sends,
                replies,
                rejected,
            };
        }
        let only_sends = sluice_common::owner::WriteSet::is_empty(&writes) && replies.is_empty() && rejected.is_empty();
        if send_without_fence && only_sends {
            return BatchEnd::Committed {
                sends,
                replies,
                rejected,
            };
        }
        if store.epoch != task.epoch {
            return fenced(&mut task.standing_by, replies, rejected, answer_without_fence);
        }
        if commit_fails {
            // What the task decided is gone with its memory: reload.
            let epoch = task.epoch;
            let partition_number = i32::try_from(partition).unwrap_or(i32::MAX);
            task.state = self.service.load(&store.image, partition_number, epoch, now_ms);
            // A reload serves at once (`reload_until_done`).
            task.state.begin_serving(now_ms);
            task.serving_since_ms = now_ms;
            return BatchEnd::Failed;
        }
        self.service.save(&mut store.image, writes);
        store.touched_ms = now_ms;
        BatchEnd::Committed {
            sends,
            replies,
            rejected,
        }
    }

    /// The instance stops (killed or in order): its tasks are gone. In
    /// order, the partitions it owned are marked released.
    pub fn stop_instance(&mut self, instance: usize, in_order: bool) {
        self.up[instance] = false;
        for partition in 0..self.partitions() {
            if let Some(task) = self.tasks[instance][partition].take() {
                let store = &mut self.stores[partition];
                if in_order && store.epoch == task.epoch {
                    store.released = true;
                }
            }
        }
    }

    /// Give `partition` up on `instance` in order (revoked).
    pub fn release(&mut self, instance: usize, partition: usize) {
        if let Some(task) = self.tasks[instance][partition].take() {
            let store = &mut self.stores[partition];
            if store.epoch == task.epoch {
                store.released = true;
            }
        }
    }
}

/// A batch whose commit found a newer owner's epoch: the task stands by.
/// With `answer_without_fence` (the bug of that name where the batch
/// wrote), a fenced commit that matched no fence row is taken for done:
/// what it wrote is lost, its answers go, and it goes on from its memory.
fn fenced(
    standing_by: &mut bool,
    replies: Vec<Reply>,
    rejected: Vec<Rejected>,
    answer_without_fence: bool,
) -> BatchEnd {
    if answer_without_fence {
        return BatchEnd::Committed {
            sends: Outbox::new(),
            replies,
            rejected,
        };
    }
    *standing_by = true;
    BatchEnd::Fenced
}
