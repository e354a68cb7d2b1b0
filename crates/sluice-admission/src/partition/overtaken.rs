//! Admitted jobs overtaken on their task group's topic. A job published to
//! `jobs.admitted.<group>` sits on one Kafka partition until the worker
//! that consumes it claims it. When that worker was killed, the partition
//! has no live consumer until the workers' group notices (a session
//! timeout, then a rebalance: 45 s with librdkafka's default session;
//! 14–33 s measured on tansu after a kill, and one partition nobody was
//! given for 33 s), and until then the job holds its limits' tickets while
//! nothing runs (issue 29). `claim_timeout` (30 s) is the backstop for
//! that; this is the event that shows it sooner: another partition of the
//! task group claimed since this job's publish while this one, out for
//! `claim_overtaken_after_ms` already, was not claimed, and nothing was
//! claimed from its partition for that long either (until 2026-11-28 the
//! claim had to be of a job published *later*: at a serial chain's tail
//! nothing later exists, and a floating key's chain waited 7 s). Its
//! consumer is dead (one that is only behind keeps claiming: a backlog of
//! 100,000 jobs, its partitions read at different paces, had 12 % of its
//! jobs published again when the publish order alone counted, 0.07 % with
//! this), and the job is published
//! again, at most `MAX_OVERTAKEN_RESENDS`
//! times per attempt (then every `claim_timeout` as before). Whichever copy
//! is claimed first wins; the other is answered `TAKEN` or `STALE`.
//!
//! The copy goes to a partition whose consumer is known to be alive: one
//! where a job published after the stuck one was claimed, and that claimed
//! within the same wait (in a chaos run, a partition that claimed such a
//! job just before its consumer died took both copies of three jobs, which
//! waited 36 s for the group to give it a consumer again). Admission leaves
//! the partition to the producer's partitioner (librdkafka's
//! `consistent_random`: CRC-32 of the key modulo the partition count), so it
//! picks the key's re-send number that lands there (`admitted_partition`).
//! A key merely changed lands anywhere, the dead partition included: in a
//! chaos run, two jobs whose first four keys all hashed to the partition
//! nobody consumed waited 26 s.
//!
//! A partition found holding an overtaken job is marked stuck until a claim
//! comes from it, for `2 × claim_overtaken_after_ms` at most. While it is,
//! nothing new is published to it either: a job whose key lands there (a
//! new attempt after a killed worker's lease ended, a claim-timeout
//! re-send) goes to a live partition at once, instead of waiting there for
//! the wait and then being published again (in a chaos run, a killed
//! worker's job waited its 5 s lease, then 6 s more on a partition of the
//! same dead worker). The mark ends by itself so a partition the group
//! gives to a live consumer again is not left without work: if it is still
//! dead, the next job there marks it again. The next attempt of a job
//! whose worker was lost (its lease ran out, or it was handed back) goes to
//! a partition that claimed within the wait when its own did not, even
//! with no mark: the consumer that worker was may be the one its key lands
//! on, and at a task group's tail no later claim elsewhere shows it.
//!
//! A job its own partition's consumer got past is overtaken too: that
//! consumer claimed a job published to the partition after it (a partition
//! is read in order) and, `claim_overtaken_after_ms` later, this one is
//! still unclaimed. The message never reached the consumer (a broker that
//! skipped an offset, seen once in a `make chaos` run; a worker that
//! committed its offset and died before claiming), and only the claim
//! timeout would publish it again. The partition is not marked stuck: its
//! consumer is alive.
//!
//! A worker that was lost marks the partitions it claimed from last as
//! stuck too (`worker_lost`: an attempt it claimed ran out its lease): at a
//! task group's tail nothing is left for the live workers to claim, so no
//! claim elsewhere shows that jobs published to a killed worker's
//! partitions wait for nobody. What waits there is published again once
//! out the wait, and what would go there goes to a partition a worker not
//! lost claimed from, however long ago, when none claimed within the wait.
//!
//! What claims show of each partition's consumer (`Consumers`) is the
//! instance's, shared by its job partitions: it is the same consumer
//! whichever job partition published, and a new owner (a takeover, a
//! resumed partition handed to the member's own task) starts knowing it
//! instead of blind. Such an owner publishes every admitted job again, and
//! a job published again (a takeover, a claim timeout) whose key lands on a
//! partition that did not claim within the wait goes to one that did, as
//! the next attempt of a lost worker's job does: in a chaos run, a job
//! partition taken over twice while a killed worker's partition had no
//! consumer published one job there three times under its first key.
//!
//! In memory only: a restarted instance starts this over.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use sluice_common::hash::HashMap;

/// How many times one attempt is published again because it was overtaken.
pub const MAX_OVERTAKEN_RESENDS: u32 = 2;

/// How many re-send numbers to try for a key that lands on the partition
/// picked (with `n` partitions one in `n` does: 64 tries miss with 6
/// partitions about once in 10^5).
const KEY_TRIES: u32 = 64;

/// Queues shorter than this are never compacted.
const COMPACT_FROM: usize = 1024;

/// A job published to its task group's topic and not claimed yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Published {
    at_ms: i64,
    /// The partition the producer puts it on (`admitted_partition`).
    partition: i32,
    /// How many times it was published again because it was overtaken.
    overtaken: u32,
    /// What its key's re-send number adds to the claim timeouts passed.
    salt: u32,
    /// `due` found it overtaken: its next publish aims at a live partition.
    retarget: bool,
    /// When its partition's consumer first claimed a job published after
    /// it: the consumer got past it (`claimed`).
    passed_at_ms: Option<i64>,
}

/// What claims showed of one partition's consumer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Progress {
    /// The latest publish time of a job claimed from it.
    newest_published_ms: i64,
    /// When the last claim of a job from it came.
    last_claim_ms: i64,
    /// When `due` found a job overtaken on it with no claim since, or the
    /// worker that last claimed from it was lost (`worker_lost`): nothing
    /// new goes to it for a while, and what waits on it is published again
    /// once out the wait (`is_stuck`).
    stuck_since_ms: Option<i64>,
    /// Who claimed from it last (`worker_key` of its worker id; 0: nobody):
    /// the consumer of the partition, as far as claims show.
    last_claimer: u64,
}

/// A worker id as `Progress::last_claimer` holds it (never 0).
fn worker_key(worker_id: &str) -> u64 {
    u64::from(crc32(worker_id.as_bytes())) | (1 << 32)
}

impl Progress {
    /// Whether the partition counts as stuck at `now_ms`: marked by `due`
    /// less than `2 × after_ms` ago, and nothing claimed from it since.
    fn is_stuck(&self, now_ms: i64, after_ms: i64) -> bool {
        self.stuck_since_ms
            .is_some_and(|since| now_ms < since.saturating_add(after_ms.saturating_mul(2)))
    }

    /// Whether the partition's consumer is known alive at `now_ms`: it
    /// claimed within `after_ms`, and is not marked stuck.
    fn is_live(&self, now_ms: i64, after_ms: i64) -> bool {
        self.last_claim_ms >= now_ms.saturating_sub(after_ms) && !self.is_stuck(now_ms, after_ms)
    }
}

/// Per task group and partition of its admitted topic: what claims showed
/// of the partition's consumer. One per instance, shared by its job
/// partitions (`PartitionSettings::consumers`).
#[derive(Clone, Debug, Default)]
pub struct Consumers(Arc<Mutex<HashMap<String, HashMap<i32, Progress>>>>);

impl Consumers {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, HashMap<i32, Progress>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Cloned, it shares its `Consumers` with the original.
#[derive(Clone, Debug, Default)]
pub(super) struct Overtaken {
    /// Jobs published and not claimed, by id.
    jobs: HashMap<String, Published>,
    /// Per task group and partition: (published at, job id), oldest first;
    /// an entry whose job was claimed or published again since is skipped.
    queues: HashMap<(String, i32), VecDeque<(i64, String)>>,
    /// What claims showed of each partition's consumer: the instance's.
    consumers: Consumers,
}

/// The partition librdkafka's default partitioner (`consistent_random`)
/// puts a message with `key` on: CRC-32 (IEEE, as zlib's) of the key modulo
/// the partition count.
pub fn admitted_partition(key: &[u8], partitions: i32) -> i32 {
    let partitions = u32::try_from(partitions.max(1)).unwrap_or(1);
    i32::try_from(crc32(key) % partitions).unwrap_or(0)
}

fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = u32::MAX;
    for byte in bytes {
        crc ^= u32::from(*byte);
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0xEDB8_8320 & mask);
        }
    }
    !crc
}

/// When the oldest job of `partition`'s queue, published at `at_ms`, counts
/// as overtaken: `after_ms` after its publish and after the partition's last
/// claim (a partition whose consumer keeps claiming is alive, only behind:
/// a backlog read at different paces is not a reason to publish again), if
/// another partition of the group claimed since its publish. Not only a job
/// published after it: at a task group's tail nothing later may exist (a
/// floating key's serial chain admits its next job only when this one
/// ends), and a `make chaos` run's chain waited 7 s for the group to give a
/// killed worker's partition a consumer while the others claimed.
///
/// On a partition marked stuck (its last claimer was lost, or a job there
/// was found overtaken) no claim elsewhere is needed: at a task group's
/// tail, a Kafka worker killed with the jobs of a floating key's chain
/// left nothing for the live workers to claim, and the jobs published to
/// its partitions waited 10 s in a `make chaos` run, until it restarted.
fn overtaken_at(
    partitions: Option<&HashMap<i32, Progress>>,
    partition: i32,
    at_ms: i64,
    (now_ms, after_ms): (i64, i64),
) -> Option<i64> {
    let partitions = partitions?;
    let own = partitions.get(&partition);
    let stuck = own.is_some_and(|progress| progress.is_stuck(now_ms, after_ms));
    let passed = partitions
        .iter()
        .any(|(other, progress)| *other != partition && progress.last_claim_ms > at_ms);
    if !passed && !stuck {
        return None;
    }
    let last_claim_ms = own.map_or(i64::MIN, |progress| progress.last_claim_ms);
    Some(at_ms.max(last_claim_ms).saturating_add(after_ms))
}

/// When a job its partition's consumer got past (`Published::passed_at_ms`)
/// counts as overtaken: `after_ms` after it was passed (claims of one
/// batch of messages may come in any order within that).
fn skipped_at(published: &Published, after_ms: i64) -> Option<i64> {
    published
        .passed_at_ms
        .map(|passed_at| passed_at.max(published.at_ms).saturating_add(after_ms))
}

/// The partitions but `avoid` whose consumer was alive when last seen:
/// they claimed once, and are not stuck since. Sorted.
fn last_seen_alive(partitions: Option<&HashMap<i32, Progress>>, now_ms: i64, after_ms: i64, avoid: i32) -> Vec<i32> {
    let mut alive: Vec<i32> = partitions
        .map(|partitions| {
            partitions
                .iter()
                .filter(|(partition, progress)| {
                    progress.last_claimer != 0 && !progress.is_stuck(now_ms, after_ms) && **partition != avoid
                })
                .map(|(partition, _)| *partition)
                .collect()
        })
        .unwrap_or_default();
    alive.sort_unstable();
    alive
}

/// The earlier of two due times, either of which may be unknown.
fn earliest(first: Option<i64>, second: Option<i64>) -> Option<i64> {
    match (first, second) {
        (Some(first), Some(second)) => Some(first.min(second)),
        (first, second) => first.or(second),
    }
}

impl Overtaken {
    /// A job partition's, sharing the instance's `consumers`.
    pub fn new(consumers: Consumers) -> Self {
        Overtaken {
            consumers,
            ..Overtaken::default()
        }
    }

    /// The re-send number to add to `job_id`'s key for its next publish.
    /// `partition_of(salt)` says where the key with `salt` lands. A job
    /// `due` found overtaken gets the first salt past its last whose key
    /// lands on a live partition of `task_group` (one a job published after
    /// it was claimed from, not its own, that claimed within `after_ms`
    /// before `now_ms`: a partition whose consumer died since is not),
    /// picked by the job id. Any other keeps its salt (0 for its first
    /// publish), unless its key lands on a partition marked stuck, or
    /// `reroute` (its previous attempt ended without its worker, whose
    /// consumer may be dead; or it is published again) and its key lands on
    /// a partition that did not claim within `after_ms`: then it too goes to
    /// a partition that claimed within `after_ms`.
    pub fn salt(
        &self,
        task_group: &str,
        job_id: &str,
        now_ms: i64,
        after_ms: i64,
        reroute: bool,
        partition_of: impl Fn(u32) -> i32,
    ) -> u32 {
        let claimed = self.consumers.lock();
        let partitions = claimed.get(task_group);
        let (current, avoid, claimed_after_ms) = match self.jobs.get(job_id) {
            Some(published) if published.retarget => (published.salt, published.partition, Some(published.at_ms)),
            published => {
                let salt = published.map_or(0, |published| published.salt);
                let any_stuck = partitions
                    .is_some_and(|partitions| partitions.values().any(|progress| progress.is_stuck(now_ms, after_ms)));
                if !any_stuck && !reroute {
                    return salt;
                }
                let natural = partition_of(salt);
                let progress = partitions.and_then(|partitions| partitions.get(&natural));
                let stuck = progress.is_some_and(|progress| progress.is_stuck(now_ms, after_ms));
                let live = progress.is_some_and(|progress| progress.is_live(now_ms, after_ms));
                if live || !(stuck || reroute) {
                    return salt;
                }
                (salt, natural, None)
            }
        };
        // Live partitions other than the one to avoid; for an overtaken job,
        // those that got past it (claimed a job published after it: not
        // behind) if there are any.
        let live_where = |past: bool| -> Vec<i32> {
            let mut live: Vec<i32> = partitions
                .map(|partitions| {
                    partitions
                        .iter()
                        .filter(|(partition, progress)| {
                            (!past || claimed_after_ms.is_none_or(|at_ms| progress.newest_published_ms > at_ms))
                                && progress.is_live(now_ms, after_ms)
                                && **partition != avoid
                        })
                        .map(|(partition, _)| *partition)
                        .collect()
                })
                .unwrap_or_default();
            live.sort_unstable();
            live
        };
        let past = live_where(true);
        let mut live = if past.is_empty() { live_where(false) } else { past };
        if live.is_empty() {
            // None claimed within the wait (a task group's tail: nothing
            // to claim).
            live = last_seen_alive(partitions, now_ms, after_ms, avoid);
        }
        let next = current.saturating_add(1);
        if live.is_empty() {
            // Nowhere known to be better: a retargeted job still gets a new
            // key; any other keeps its own.
            return if claimed_after_ms.is_some() { next } else { current };
        }
        let pick = usize::try_from(crc32(job_id.as_bytes())).unwrap_or(0) % live.len();
        let target = live[pick];
        (next..next.saturating_add(KEY_TRIES))
            .find(|salt| partition_of(*salt) == target)
            .unwrap_or(next)
    }

    /// `job_id` was published to `task_group`'s topic at `now_ms`, with
    /// `salt` in its key, on `partition`.
    pub fn published(&mut self, task_group: &str, job_id: &str, now_ms: i64, salt: u32, partition: i32) {
        let overtaken = self.jobs.get(job_id).map_or(0, |published| published.overtaken);
        self.jobs.insert(
            job_id.to_string(),
            Published {
                at_ms: now_ms,
                partition,
                overtaken,
                salt,
                retarget: false,
                passed_at_ms: None,
            },
        );
        let queue = self.queues.entry((task_group.to_string(), partition)).or_default();
        queue.push_back((now_ms, job_id.to_string()));
        if queue.len() >= COMPACT_FROM && queue.len() > 2 * self.jobs.len() {
            let jobs = &self.jobs;
            queue.retain(|(at_ms, job_id)| jobs.get(job_id).is_some_and(|published| published.at_ms == *at_ms));
        }
    }

    /// `job_id` was claimed at `now_ms` (or pushed to a stream worker, or
    /// left the partition): it is no longer waiting on the topic. A claim
    /// through `Claim` shows that the consumer of its partition is alive and
    /// got as far as its publish.
    pub fn claimed(&mut self, task_group: &str, job_id: &str, now_ms: i64, worker_id: &str) {
        let Some(published) = self.jobs.remove(job_id) else {
            return;
        };
        let mut claimed = self.consumers.lock();
        let progress = claimed
            .entry(task_group.to_string())
            .or_default()
            .entry(published.partition)
            .or_default();
        progress.newest_published_ms = progress.newest_published_ms.max(published.at_ms);
        progress.last_claim_ms = progress.last_claim_ms.max(now_ms);
        progress.stuck_since_ms = None;
        progress.last_claimer = worker_key(worker_id);
        drop(claimed);
        self.got_past(task_group, published.partition, published.at_ms, now_ms);
    }

    /// The consumer of `task_group`'s `partition` claimed, at `now_ms`, a
    /// job published at `published_ms`: it read the partition past every
    /// job published there before (a partition is read in order). Those
    /// still unclaimed are marked passed: a message the consumer never got
    /// (a broker that skipped it, a worker that committed its offset and
    /// died before claiming) is published again after the wait (`due`),
    /// not after a whole claim timeout while the consumer claims on.
    fn got_past(&mut self, task_group: &str, partition: i32, published_ms: i64, now_ms: i64) {
        let Overtaken { jobs, queues, .. } = self;
        let Some(queue) = queues.get_mut(&(task_group.to_string(), partition)) else {
            return;
        };
        let is_live = |at_ms: i64, job_id: &str| jobs.get(job_id).is_some_and(|published| published.at_ms == at_ms);
        while queue.front().is_some_and(|(at_ms, job_id)| !is_live(*at_ms, job_id)) {
            queue.pop_front();
        }
        for (at_ms, job_id) in queue.iter() {
            if *at_ms >= published_ms {
                break;
            }
            if let Some(waiting) = jobs.get_mut(job_id).filter(|published| published.at_ms == *at_ms) {
                waiting.passed_at_ms.get_or_insert(now_ms);
            }
        }
    }

    /// A worker that claimed jobs of `task_group` was lost at `now_ms`: an
    /// attempt it claimed ran out its lease without a word from it. The
    /// partitions it claimed from last have no live consumer as far as
    /// anyone knows: marked stuck (`Progress::is_stuck`), so nothing new
    /// goes there and what waits there is published again once out the
    /// wait, until a claim comes from them. A live worker that only
    /// abandoned one job claims on, and its next claim clears the mark.
    pub fn worker_lost(&self, task_group: &str, worker_id: &str, now_ms: i64, after_ms: i64) {
        let lost = worker_key(worker_id);
        let mut claimed = self.consumers.lock();
        let Some(partitions) = claimed.get_mut(task_group) else {
            return;
        };
        for progress in partitions.values_mut() {
            if progress.last_claimer == lost && !progress.is_stuck(now_ms, after_ms) {
                progress.stuck_since_ms = Some(now_ms);
            }
        }
    }

    /// Forget the job without counting it as claimed.
    pub fn forget(&mut self, job_id: &str) {
        self.jobs.remove(job_id);
    }

    /// The jobs overtaken by `now_ms`: on a partition nothing was claimed
    /// from for `after_ms`, published at least `after_ms` ago, before a job
    /// of their task group claimed from another partition, and published
    /// again fewer than `MAX_OVERTAKEN_RESENDS` times. Each is counted as
    /// published again once more, and its next publish aims at a live
    /// partition (publish it: `salt`, then `published`), and its partition
    /// is marked stuck (`Progress::is_stuck`).
    pub fn due(&mut self, now_ms: i64, after_ms: i64) -> Vec<String> {
        let mut due = Vec::new();
        let mut stuck = Vec::new();
        let Overtaken {
            jobs,
            queues,
            consumers,
        } = self;
        let mut claimed = consumers.lock();
        for ((task_group, partition), queue) in queues.iter_mut() {
            let partitions = claimed.get(task_group);
            while let Some((at_ms, job_id)) = queue.front() {
                let at_ms = *at_ms;
                let Some(published) = jobs.get_mut(job_id).filter(|published| published.at_ms == at_ms) else {
                    queue.pop_front();
                    continue;
                };
                let behind_a_dead_consumer = overtaken_at(partitions, *partition, at_ms, (now_ms, after_ms));
                let skipped = skipped_at(published, after_ms);
                let due_at = earliest(behind_a_dead_consumer, skipped);
                if due_at.is_none_or(|at| at > now_ms) {
                    break;
                }
                // A consumer that got past it and claims on is alive.
                if behind_a_dead_consumer.is_some_and(|at| at <= now_ms)
                    && stuck.last() != Some(&(task_group, *partition))
                {
                    stuck.push((task_group, *partition));
                }
                if published.overtaken < MAX_OVERTAKEN_RESENDS {
                    published.overtaken += 1;
                    published.retarget = true;
                    due.push(job_id.clone());
                }
                queue.pop_front();
            }
        }
        for (task_group, partition) in stuck {
            let progress = claimed
                .entry(task_group.clone())
                .or_default()
                .entry(partition)
                .or_default();
            if !progress.is_stuck(now_ms, after_ms) {
                progress.stuck_since_ms = Some(now_ms);
            }
        }
        due.sort_unstable();
        due
    }

    /// When `due` may next find a job: the oldest live entry of each
    /// partition's queue, when another partition got past it.
    pub fn next_due_ms(&self, now_ms: i64, after_ms: i64) -> Option<i64> {
        let claimed = self.consumers.lock();
        self.queues
            .iter()
            .filter_map(|((task_group, partition), queue)| {
                let (at_ms, job_id) = queue.front()?;
                let dead = overtaken_at(claimed.get(task_group), *partition, *at_ms, (now_ms, after_ms));
                let skipped = self
                    .jobs
                    .get(job_id)
                    .filter(|published| published.at_ms == *at_ms)
                    .and_then(|published| skipped_at(published, after_ms));
                earliest(dead, skipped)
            })
            .min()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first job ids `job-<n>` whose first publish lands on `partition`.
    fn jobs_landing_on(partition: i32, count: usize) -> Vec<String> {
        (0..)
            .map(|n| format!("job-{n}"))
            .filter(|job_id| admitted_partition(format!("{job_id}/1/0").as_bytes(), 6) == partition)
            .take(count)
            .collect()
    }

    /// At a task group's tail a Kafka worker is killed with the jobs it
    /// claimed: nothing is left for the live workers to claim, so no claim
    /// elsewhere shows that the jobs published to the dead worker's
    /// partitions meanwhile wait for nobody. Once an attempt it claimed runs
    /// out its lease (`worker_lost`), its partitions are marked stuck: what
    /// waits there is published again once out the wait, to a partition a
    /// worker not lost claimed from (however long ago), and new jobs whose
    /// key lands there go elsewhere too. In a `make chaos` run they waited
    /// 10 s, until the killed worker restarted.
    #[test]
    fn the_partitions_a_lost_worker_claimed_from_are_avoided_and_what_waits_there_is_published_again() {
        let mut overtaken = Overtaken::default();
        let (dead, live) = (0, 3);
        let on_dead = jobs_landing_on(dead, 4);
        let on_live = jobs_landing_on(live, 1);
        for (job_id, worker) in [(&on_dead[0], "w-dead"), (&on_live[0], "w-live")] {
            assert_eq!(
                publish(&mut overtaken, job_id, 0).1,
                if worker == "w-dead" { dead } else { live }
            );
            overtaken.claimed("g", job_id, 100, worker);
        }
        // Much later: a job lands on the dead worker's partition, and no
        // other partition claims anything after it.
        assert_eq!(publish(&mut overtaken, &on_dead[1], 10_000).1, dead);
        assert!(
            overtaken.due(20_000, 3_000).is_empty(),
            "nothing shows the consumer dead yet"
        );
        overtaken.worker_lost("g", "w-dead", 20_000, 3_000);
        assert_eq!(overtaken.next_due_ms(20_000, 3_000), Some(13_000));
        assert_eq!(overtaken.due(20_000, 3_000), vec![on_dead[1].clone()]);
        assert_eq!(
            publish(&mut overtaken, &on_dead[1], 20_000).1,
            live,
            "published again on the lost worker's partition"
        );
        assert_eq!(
            publish(&mut overtaken, &on_dead[2], 20_100).1,
            live,
            "a new job went to the lost worker's partition"
        );
        // The mark ends by itself (the group may give the partition a
        // live consumer): a new job whose key lands there goes there.
        assert_eq!(publish(&mut overtaken, &on_dead[3], 26_001).1, dead);
    }

    /// Publish as the partition does: the salt `salt` picks, on the
    /// partition `key(salt)` lands on.
    fn publish(overtaken: &mut Overtaken, job_id: &str, now_ms: i64) -> (u32, i32) {
        let partition_of = |salt: u32| admitted_partition(format!("{job_id}/1/{salt}").as_bytes(), 6);
        let salt = overtaken.salt("g", job_id, now_ms, 3_000, false, partition_of);
        let partition = partition_of(salt);
        overtaken.published("g", job_id, now_ms, salt, partition);
        (salt, partition)
    }

    /// A job its partition's consumer got past (it claimed a job
    /// published there after it, and claims on) never reached it: a broker
    /// that skipped the message, a worker that committed its offset and died
    /// before claiming. It is published again once the wait has passed
    /// since, not after a whole claim timeout (a `make chaos` run: the
    /// broker skipped one offset, and a key had waiters and nothing running
    /// for 20 s). One claimed within the wait, out of order, is not.
    #[test]
    fn a_job_its_own_partitions_consumer_got_past_is_overtaken_after_the_wait() {
        let mut overtaken = Overtaken::default();
        overtaken.published("g", "skipped", 1_000, 0, 2);
        overtaken.published("g", "out-of-order", 1_050, 0, 2);
        overtaken.published("g", "later", 1_100, 0, 2);
        overtaken.published("g", "later-still", 1_200, 0, 2);
        overtaken.published("g", "not-yet-read", 5_000, 0, 2);
        overtaken.claimed("g", "later", 1_500, "w");
        overtaken.claimed("g", "out-of-order", 2_000, "w");
        overtaken.claimed("g", "later-still", 4_000, "w");
        assert_eq!(overtaken.next_due_ms(0, 3_000), Some(4_500));
        assert!(overtaken.due(4_499, 3_000).is_empty(), "within the wait");
        assert_eq!(overtaken.due(4_500, 3_000), vec!["skipped".to_string()]);
        assert!(overtaken.due(60_000, 3_000).is_empty(), "nothing else was passed");
        // The consumer is alive: its partition is not marked stuck.
        assert_eq!(overtaken.salt("g", "new", 4_500, 3_000, false, |_| 2), 0);
    }

    #[test]
    fn the_partition_is_librdkafkas_consistent_random() {
        // Where tansu put these keys, published by librdkafka (a chaos
        // run's worker log), and zlib's CRC-32 of them modulo 6.
        assert_eq!(admitted_partition(b"chaos-4289/1", 6), 3);
        assert_eq!(admitted_partition(b"chaos-4289/1/3", 6), 5);
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    /// A job is overtaken once another partition of its task group claimed
    /// since its publish (a job published before it, too: at a chain's
    /// tail nothing later exists), and only after the wait.
    #[test]
    fn a_job_is_overtaken_only_once_another_partition_claimed_since_its_publish_and_after_the_wait() {
        let mut overtaken = Overtaken::default();
        overtaken.published("g", "earlier", 500, 0, 1);
        overtaken.published("g", "earlier-too", 600, 0, 1);
        overtaken.published("g", "stuck", 1_000, 0, 0);
        overtaken.published("other", "elsewhere", 1_000, 0, 0);
        assert_eq!(overtaken.next_due_ms(0, 3_000), None, "nothing claimed yet");
        assert!(overtaken.due(10_000, 3_000).is_empty());
        overtaken.claimed("g", "earlier", 900, "w");
        assert!(
            overtaken.due(10_000, 3_000).is_empty(),
            "a claim before its publish overtakes nothing"
        );
        overtaken.claimed("g", "earlier-too", 2_000, "w");
        assert_eq!(overtaken.next_due_ms(0, 3_000), Some(4_000));
        assert!(overtaken.due(3_999, 3_000).is_empty(), "out for less than the wait");
        assert_eq!(overtaken.due(4_000, 3_000), vec!["stuck".to_string()]);
        assert!(
            overtaken
                .jobs
                .get("elsewhere")
                .is_some_and(|published| !published.retarget),
            "another task group's claims overtake nothing there"
        );
    }

    /// A partition whose consumer keeps claiming is behind, not dead: its
    /// jobs are not published again while claims come from it (a backlog of
    /// 100,000 jobs read at different paces had 12 % of its jobs published
    /// again when only the publish order counted).
    #[test]
    fn a_partition_that_keeps_claiming_is_not_taken_for_dead() {
        let mut overtaken = Overtaken::default();
        overtaken.published("g", "earlier-on-0", 900, 0, 0);
        overtaken.published("g", "behind", 1_000, 0, 0);
        overtaken.published("g", "ahead", 2_000, 0, 1);
        overtaken.claimed("g", "ahead", 2_100, "w");
        overtaken.claimed("g", "earlier-on-0", 3_500, "w");
        assert!(
            overtaken.due(4_000, 3_000).is_empty(),
            "its partition claimed 0.5 s ago"
        );
        assert_eq!(overtaken.next_due_ms(0, 3_000), Some(6_500));
        assert!(overtaken.due(6_499, 3_000).is_empty());
        assert_eq!(
            overtaken.due(6_500, 3_000),
            vec!["behind".to_string()],
            "silent for the wait"
        );
    }

    /// The copy lands on a partition whose consumer claimed a job published
    /// after the stuck one, never on the stuck one's own.
    #[test]
    fn an_overtaken_job_is_published_again_to_a_partition_whose_consumer_is_alive() {
        for stuck in (0..200).map(|job| format!("stuck-{job}")) {
            let mut overtaken = Overtaken::default();
            let (_, dead) = publish(&mut overtaken, &stuck, 0);
            // Later jobs on every partition; those off the dead one claimed.
            let mut live = Vec::new();
            for job in (0..60).map(|job| format!("later-{job}")) {
                let (_, partition) = publish(&mut overtaken, &job, 10);
                if partition != dead {
                    overtaken.claimed("g", &job, 20, "w");
                    live.push(partition);
                }
            }
            assert_eq!(overtaken.due(3_000, 3_000), vec![stuck.clone()]);
            let (salt, partition) = publish(&mut overtaken, &stuck, 3_000);
            assert!(salt >= 1, "a new key");
            assert_ne!(
                partition, dead,
                "{stuck}: published again to the partition nobody consumes"
            );
            assert!(
                live.contains(&partition),
                "{stuck}: {partition} is not known to be consumed"
            );
        }
    }

    /// A partition that claimed a later job once, and nothing since (its
    /// consumer died right after), is no target: the copy goes to one that
    /// claims now.
    #[test]
    fn a_partition_that_stopped_claiming_is_not_taken_for_alive() {
        for stuck in (0..100).map(|job| format!("stuck-{job}")) {
            let mut overtaken = Overtaken::default();
            let (_, own) = publish(&mut overtaken, &stuck, 0);
            let later = |index: usize| format!("later-{stuck}-{index}");
            // A later job on another partition, claimed at once; then that
            // partition's consumer is gone.
            let (index, gone) = (0..)
                .map(|index| (index, publish(&mut overtaken, &later(index), 10).1))
                .find(|(_, partition)| *partition != own)
                .expect("a later job on another partition");
            overtaken.claimed("g", &later(index), 20, "w");
            // Later jobs on a third partition keep being claimed.
            let (index, claiming) = (1_000..)
                .map(|index| (index, publish(&mut overtaken, &later(index), 30).1))
                .find(|(_, partition)| *partition != own && *partition != gone)
                .expect("a later job on a third partition");
            overtaken.claimed("g", &later(index), 9_000, "w");
            assert!(overtaken.due(9_000, 3_000).contains(&stuck));
            let (_, partition) = publish(&mut overtaken, &stuck, 9_000);
            assert_ne!(
                partition, gone,
                "{stuck}: sent to a partition that claims nothing any more"
            );
            assert_eq!(partition, claiming, "{stuck}");
        }
    }

    /// A partition found holding an overtaken job takes nothing new while
    /// it is marked: a job whose key lands there (a killed worker's job
    /// handed back as a new attempt, say) goes to a partition that claims,
    /// at once. A claim from it, or the end of the mark, lets jobs land
    /// there again.
    #[test]
    fn nothing_new_lands_on_a_partition_found_stuck() {
        let natural = |job: &str| admitted_partition(format!("{job}/1/0").as_bytes(), 6);
        let landing_on = |prefix: &str, partition: i32, count: usize| -> Vec<String> {
            (0..)
                .map(|index| format!("{prefix}-{index}"))
                .filter(|job| natural(job) == partition)
                .take(count)
                .collect()
        };
        for stuck in (0..50).map(|job| format!("stuck-{job}")) {
            let mut overtaken = Overtaken::default();
            let (_, dead) = publish(&mut overtaken, &stuck, 0);
            let mut live = Vec::new();
            for job in (0..60).map(|job| format!("later-{stuck}-{job}")) {
                let (_, partition) = publish(&mut overtaken, &job, 10);
                if partition != dead {
                    overtaken.claimed("g", &job, 2_500, "w");
                    live.push(partition);
                }
            }
            for job in landing_on("before", dead, 3) {
                assert_eq!(publish(&mut overtaken, &job, 2_900).1, dead, "not marked yet");
            }
            assert_eq!(overtaken.due(3_000, 3_000), vec![stuck.clone()]);
            for job in landing_on("new", dead, 20) {
                let (salt, partition) = publish(&mut overtaken, &job, 3_100);
                assert!(salt >= 1, "{job}: a new key");
                assert!(
                    live.contains(&partition),
                    "{job}: {partition} is not known to be consumed"
                );
            }
            let elsewhere = landing_on("elsewhere", (dead + 1) % 6, 1);
            assert_eq!(
                publish(&mut overtaken, &elsewhere[0], 3_100).0,
                0,
                "a job landing on a live partition keeps its key"
            );

            // The mark ends by itself, twice the wait after it was made.
            let mut ended = overtaken.clone();
            let after_mark = landing_on("after-mark", dead, 1);
            assert_eq!(publish(&mut ended, &after_mark[0], 9_000), (0, dead));

            // A claim from the partition ends it at once.
            overtaken.claimed("g", &stuck, 3_200, "w");
            let claimed_again = landing_on("claimed-again", dead, 1);
            assert_eq!(publish(&mut overtaken, &claimed_again[0], 3_300), (0, dead));
        }
    }

    /// A job whose previous attempt ended without its worker (a worker
    /// killed with it: its lease ran out) is published to a partition that
    /// claims now, even when nothing showed its own partition dead yet (no
    /// later job was claimed elsewhere while one waited there): the
    /// consumer that worker was may be the one it lands on.
    #[test]
    fn a_job_whose_worker_was_lost_goes_to_a_partition_that_claims() {
        let natural = |job: &str| admitted_partition(format!("{job}/1/0").as_bytes(), 6);
        for round in 0..50 {
            let mut overtaken = Overtaken::default();
            // Partitions 0-2 claimed at 9 s; 3-5 last at 1 s (their
            // consumer was killed then).
            for (index, job) in (0..).map(|index| (index, format!("claimed-{round}-{index}"))).take(60) {
                let (_, partition) = publish(&mut overtaken, &job, 0);
                overtaken.claimed("g", &job, if partition < 3 { 9_000 } else { 1_000 + index }, "w");
            }
            let job = (0..)
                .map(|index| format!("retried-{round}-{index}"))
                .find(|job| natural(job) >= 3)
                .expect("a job landing on a silent partition");
            let copy = overtaken.clone();
            let partition_of = |salt: u32| admitted_partition(format!("{job}/1/{salt}").as_bytes(), 6);
            let salt = copy.salt("g", &job, 10_000, 3_000, true, partition_of);
            assert!(partition_of(salt) < 3, "{job}: lost, sent to {}", partition_of(salt));
            assert_eq!(
                overtaken.salt("g", &job, 10_000, 3_000, false, partition_of),
                0,
                "{job}: a first attempt keeps its key while nothing shows its partition dead"
            );
            let live_one = (0..)
                .map(|index| format!("live-{round}-{index}"))
                .find(|job| natural(job) < 3)
                .expect("a job landing on a live partition");
            let partition_of = |salt: u32| admitted_partition(format!("{live_one}/1/{salt}").as_bytes(), 6);
            assert_eq!(
                copy.salt("g", &live_one, 10_000, 3_000, true, partition_of),
                0,
                "{live_one}: its own partition claims: it keeps its key"
            );
        }
    }

    /// A new owner (another job partition of the instance, or the same one
    /// taken over) knows at once what the instance's claims showed: its
    /// first publishes avoid a partition found stuck, and a job it
    /// publishes again (its takeover) avoids one that stopped claiming.
    #[test]
    fn a_new_owner_knows_what_the_instances_claims_showed() {
        let natural = |job: &str| admitted_partition(format!("{job}/1/0").as_bytes(), 6);
        for round in 0..50 {
            let mut before = Overtaken::default();
            let (_, dead) = publish(&mut before, &format!("stuck-{round}"), 0);
            let mut live = Vec::new();
            for job in (0..60).map(|index| format!("later-{round}-{index}")) {
                let (_, partition) = publish(&mut before, &job, 10);
                if partition != dead {
                    before.claimed("g", &job, 2_500, "w");
                    live.push(partition);
                }
            }
            assert_eq!(before.due(3_000, 3_000).len(), 1);

            let mut fresh = Overtaken::new(before.consumers.clone());
            let landing = (0..)
                .map(|index| format!("new-{round}-{index}"))
                .find(|job| natural(job) == dead)
                .expect("a job landing on the stuck partition");
            let (_, partition) = publish(&mut fresh, &landing, 3_100);
            assert!(live.contains(&partition), "{landing}: sent to {partition}");

            // Past the mark, a job published again at the takeover still
            // avoids the partition that has claimed nothing since.
            let again = (0..)
                .map(|index| format!("again-{round}-{index}"))
                .find(|job| natural(job) == dead)
                .expect("a job landing on the silent partition");
            let partition_of = |salt: u32| admitted_partition(format!("{again}/1/{salt}").as_bytes(), 6);
            for job in (0..60).map(|index| format!("claiming-{round}-{index}")) {
                let (_, partition) = publish(&mut fresh, &job, 9_000);
                if partition != dead {
                    fresh.claimed("g", &job, 9_500, "w");
                }
            }
            let salt = fresh.salt("g", &again, 10_000, 3_000, true, partition_of);
            assert_ne!(
                partition_of(salt),
                dead,
                "{again}: published again to the silent partition"
            );
            assert_eq!(
                fresh.salt("g", &again, 10_000, 3_000, false, partition_of),
                0,
                "{again}: a first publish keeps its key once the mark is over"
            );
        }
    }

    #[test]
    fn an_attempt_is_published_again_at_most_twice_for_being_overtaken() {
        let mut overtaken = Overtaken::default();
        overtaken.published("g", "stuck", 0, 0, 0);
        let mut now = 0;
        let mut times = 0;
        let mut salts = vec![0];
        for round in 1..=5 {
            let claimed = format!("claimed-{round}");
            overtaken.published("g", &claimed, now + 1, 0, 1);
            overtaken.claimed("g", &claimed, now + 1, "w");
            now += 3_000;
            for job in overtaken.due(now, 3_000) {
                assert_eq!(job, "stuck");
                times += 1;
                let salt = overtaken.salt("g", &job, now, 3_000, false, |salt| if salt == 0 { 0 } else { 2 });
                salts.push(salt);
                // Its copies land on a partition nothing is claimed from.
                overtaken.published("g", &job, now, salt, 2);
            }
        }
        assert_eq!(times, MAX_OVERTAKEN_RESENDS);
        assert!(
            salts.windows(2).all(|pair| pair[0] < pair[1]),
            "each copy under a new key: {salts:?}"
        );
        overtaken.claimed("g", "stuck", now, "w");
        assert!(!overtaken.jobs.contains_key("stuck"), "claimed: forgotten");
    }
}
