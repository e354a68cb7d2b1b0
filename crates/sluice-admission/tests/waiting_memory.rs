//! Heap bytes a waiting job costs admission's core (issue 30): a partition
//! that holds `JOBS` waiting jobs, each naming one concurrency key, as the
//! backlog benchmark enqueues them; and what a new owner holds at its peak
//! while it loads them from a snapshot and re-sends their acquires. Counted
//! by a global allocator that tracks live and peak bytes, so the figures are
//! exact and the same on every machine. One test per binary: the counter is
//! the process's.

use std::sync::Arc;

use peak_alloc::PeakAlloc;
use prost::Message;
use sluice_admission::chain;
use sluice_admission::journal::{Snapshot, SnapshotJob};
use sluice_admission::partition::{AdmissionPartition, AdmissionWrites, Incoming, Local, OnConflict};
use sluice_common::kafka::Outbox;
use sluice_common::owner::{OwnedState, Rejected, Reply};
use sluice_common::{Faults, SluiceConfig};
use sluice_proto::v1 as pb;
use tokio::sync::oneshot;

#[global_allocator]
static ALLOCATOR: PeakAlloc = PeakAlloc;

const JOBS: usize = 20_000;
const BATCH: usize = 1_000;
/// What a waiting job may cost admission's core in heap bytes. 2,112 before
/// issue 30's first step (a job row inline in the map, its request decoded,
/// every chain step 336 bytes); 1,087 after it.
const HELD_BOUND: usize = 1_200;
/// What a new owner may hold at its peak per waiting job while it loads and
/// re-sends them: 2,274 when the snapshot was decoded whole, 1,763 read one
/// job at a time.
const TAKEOVER_PEAK_BOUND: usize = 2_000;
/// What a loaded waiting job may hold: 1,199 when a decoded chain kept room
/// for four steps, 791 without.
const LOADED_BOUND: usize = 900;

type TestResult<T> = Result<T, Box<dyn std::error::Error>>;

fn request(config: &SluiceConfig, job: usize) -> TestResult<Incoming> {
    let job_id = format!("backlog-{job:08}");
    let request = pb::JobRequest {
        job_id: Some(job_id.clone()),
        tenant: "backlog".to_string(),
        task_group: "default".to_string(),
        priority: Some(0),
        limits: vec![pb::Limit {
            kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                key: format!("k{}", job % 1_000),
                max_concurrency: 5,
                shadow: false,
            })),
        }],
        retry: Some(pb::RetryPolicy {
            max_attempts: 100,
            initial_backoff: "100ms".to_string(),
            max_backoff: "1s".to_string(),
            ..pb::RetryPolicy::default()
        }),
        ..pb::JobRequest::default()
    };
    Ok(Incoming {
        job_id,
        valid: chain::validate(config, request).map_err(|error| format!("{error:?}"))?,
        trace: pb::TraceContext {
            traceparent: format!("00-{job:032x}-{job:016x}-01"),
            tracestate: String::new(),
        },
    })
}

fn partition(config: &Arc<SluiceConfig>) -> AdmissionPartition {
    let settings = sluice_admission::partition_settings(
        config,
        &Faults::none(),
        sluice_admission::work::WorkerHub::without_workers(),
    );
    AdmissionPartition::new(settings, Vec::new(), 0, None, 0)
}

/// `JOBS` waiting jobs enqueued into `partition`, the batches' writes,
/// sends and replies dropped as the runtime drops them.
fn enqueue_backlog(config: &SluiceConfig, partition: &mut AdmissionPartition, start_ms: i64) -> TestResult<()> {
    for (now_ms, first) in (start_ms..).zip((0..JOBS).step_by(BATCH)) {
        let jobs = (first..first + BATCH)
            .map(|job| request(config, job))
            .collect::<TestResult<Vec<Incoming>>>()?;
        let (reply, mut answer) = oneshot::channel();
        let mut writes = AdmissionWrites::default();
        let mut outbox = Outbox::new();
        let mut replies: Vec<Reply> = Vec::new();
        let mut rejected: Vec<Rejected> = Vec::new();
        partition.apply(
            now_ms,
            &[],
            vec![Local::Enqueue {
                jobs,
                on_conflict: OnConflict::Refuse,
                reply,
            }],
            &mut writes,
            &mut outbox,
            &mut replies,
            &mut rejected,
        );
        for reply in replies {
            reply();
        }
        let outcomes = answer.try_recv()?.map_err(|error| format!("{error:?}"))?;
        assert_eq!(outcomes.len(), BATCH);
    }
    Ok(())
}

fn per_job(bytes: usize) -> usize {
    bytes / JOBS
}

#[test]
fn a_waiting_job_and_its_takeover_cost_admissions_core_bounded_heap_bytes() -> TestResult<()> {
    let config = Arc::new(SluiceConfig::load_with(None, &[])?);
    let start_ms = 1_800_000_000_000;

    // Held: the heap the waiting jobs hold once enqueued.
    let mut first = partition(&config);
    first.begin_serving(start_ms);
    let before = ALLOCATOR.current_usage();
    enqueue_backlog(&config, &mut first, start_ms)?;
    let held = per_job(ALLOCATOR.current_usage().saturating_sub(before));

    // The takeover: the snapshot as PostgreSQL holds it, loaded by a new
    // owner that then re-sends every waiting job's acquire (`resend_all`,
    // what the runtime publishes before it serves).
    let snapshot = Snapshot {
        jobs: first.active_rows().map(SnapshotJob::of).collect(),
    }
    .encode_to_vec();
    drop(first);
    let before = ALLOCATOR.current_usage();
    ALLOCATOR.reset_peak_usage();
    let rows = sluice_admission::journal::rows_of_snapshot(snapshot, 0)?;
    let settings = sluice_admission::partition_settings(
        &config,
        &Faults::none(),
        sluice_admission::work::WorkerHub::without_workers(),
    );
    let mut loaded = AdmissionPartition::new(settings, rows.into_values(), 1, Some(0), 0);
    let mut outbox = Outbox::new();
    loaded.resend_all(start_ms + 60_000, &mut outbox);
    let resent = outbox.len();
    drop(outbox);
    loaded.begin_serving(start_ms + 60_000);
    let peak = per_job(ALLOCATOR.peak_usage().saturating_sub(before));
    let loaded_held = per_job(ALLOCATOR.current_usage().saturating_sub(before));
    eprintln!(
        "admission core, per waiting job: {held} heap bytes held; a takeover peaks at {peak} \
         (the snapshot's bytes freed as it loads), then holds {loaded_held}; {resent} acquires re-sent"
    );
    assert_eq!(loaded.active_jobs(), JOBS);
    assert!(resent >= JOBS, "every waiting job's acquire is re-sent: {resent}");
    assert!(
        held <= HELD_BOUND,
        "{held} heap bytes per waiting job, more than {HELD_BOUND}"
    );
    assert!(
        peak <= TAKEOVER_PEAK_BOUND,
        "a takeover peaks at {peak} heap bytes per waiting job, more than {TAKEOVER_PEAK_BOUND}"
    );
    assert!(
        loaded_held <= LOADED_BOUND,
        "a loaded waiting job holds {loaded_held} heap bytes, more than {LOADED_BOUND}"
    );
    Ok(())
}
