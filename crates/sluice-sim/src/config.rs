//! What a run simulates (the cluster's size, the lease, how long faults
//! last), the bugs the simulation can put back, and what it traces.

/// A bug the simulation can put back, to show that it finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// An owner answers a batch that wrote nothing without a fenced commit
    /// (issue 29: a fenced owner answered from its memory, a job ran twice).
    AnswerWithoutFence,
    /// An owner sends what a batch decided without a fenced commit when
    /// the batch writes and answers nothing (before f79a5e0: a stale
    /// admission owner released the grant of a job it did not know, and
    /// freed a slot the new owner's job waited for).
    SendWithoutFence,
    /// Link commands an owner took and dropped before its commit (the
    /// partition released or revoked) are not refused: the client waits
    /// on the open link (before 4ecf2cc: 35-50 s stalls in make chaos).
    DroppedCommandsNotRefused,
    /// A Kafka worker claims a second delivery of an attempt it already
    /// handles (before 2c8f8ec / 0f9cf2f: a duplicate whose claim failed in
    /// transit was settled by a heartbeat answering EXTENDED, and ran twice).
    WorkerRunsDuplicateDelivery,
    /// A new owner gives running attempts their lease grace (and restarts
    /// its re-send timers) from when it loaded the partition, not from
    /// when it serves (before bde4573: a takeover that outlasted the grace
    /// handed back attempts whose workers were heard in time, and they ran
    /// again).
    GraceFromLoad,
}

impl Bug {
    /// Every bug, with the name SIM_BUG gives it.
    pub const ALL: &'static [(&'static str, Bug)] = &[
        ("answer-without-fence", Bug::AnswerWithoutFence),
        ("send-without-fence", Bug::SendWithoutFence),
        ("dropped-commands-not-refused", Bug::DroppedCommandsNotRefused),
        ("worker-runs-duplicate-delivery", Bug::WorkerRunsDuplicateDelivery),
        ("grace-from-load", Bug::GraceFromLoad),
    ];

    pub fn from_name(name: &str) -> Option<Bug> {
        Bug::ALL.iter().find(|(known, _)| *known == name).map(|(_, bug)| *bug)
    }
}

/// What to simulate.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub jobs: usize,
    pub keys: usize,
    pub max: u32,
    pub job_partitions: usize,
    pub limit_partitions: usize,
    pub instances: usize,
    pub workers: usize,
    pub lease_ms: i64,
    /// Faults happen while simulated time is below this.
    pub faults_until_ms: i64,
    /// After the faults stop, every job ends within this.
    pub liveness_bound_ms: i64,
    /// After the faults stop, no key stalls (jobs waiting, none running)
    /// longer than this.
    pub stall_bound_ms: i64,
    /// The producer enqueues job n at n times this (ms).
    pub produce_every_ms: i64,
    pub bug: Option<Bug>,
    /// Keep a digest of every event handled (Report::digest), and print
    /// each one (SIM_TRACE): the history a seed gives, to compare or read.
    pub trace: Trace,
}

/// What the run does with the events it handles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Trace {
    /// Nothing (the fast path).
    #[default]
    Off,
    /// A digest of them (Report::digest).
    Digest,
    /// A digest, and each printed on stderr.
    Print,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            jobs: 40,
            keys: 3,
            max: 2,
            job_partitions: 2,
            limit_partitions: 2,
            instances: 2,
            workers: 3,
            lease_ms: 3_000,
            faults_until_ms: 30_000,
            liveness_bound_ms: 120_000,
            stall_bound_ms: 30_000,
            produce_every_ms: 20,
            bug: None,
            trace: Trace::Off,
        }
    }
}
