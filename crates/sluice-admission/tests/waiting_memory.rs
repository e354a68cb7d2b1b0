//! Heap bytes a waiting job costs admission's core (issue 30): a partition
//! that holds `JOBS` waiting jobs, each naming one concurrency key, as the
//! backlog benchmark enqueues them. Counted by the global allocator's
//! statistics (live bytes), so the figure is exact and the same on every machine.

use std::alloc::System;
use std::sync::Arc;

use sluice_admission::chain;
use sluice_admission::partition::{AdmissionPartition, AdmissionWrites, Incoming, Local, OnConflict};
use sluice_common::kafka::Outbox;
use sluice_common::owner::{OwnedState, Rejected, Reply};
use sluice_common::{Faults, SluiceConfig};
use sluice_proto::v1 as pb;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};
use tokio::sync::oneshot;

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const JOBS: usize = 20_000;
/// What a waiting job may cost admission's core in heap bytes. 2,112 before
/// issue 30's first step (a job row inline in the map, its request decoded,
/// every chain step 336 bytes); 1,087 after it.
const BOUND: isize = 1_200;
const BATCH: usize = 1_000;

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

/// Bytes of heap one waiting job holds in admission's core, the batch's
/// writes, sends and replies dropped as the runtime drops them.
fn bytes_per_waiting_job() -> TestResult<isize> {
    let config = Arc::new(SluiceConfig::load_with(None, &[])?);
    let settings = sluice_admission::partition_settings(
        &config,
        &Faults::none(),
        sluice_admission::work::WorkerHub::without_workers(),
    );
    let mut partition = AdmissionPartition::new(settings, Vec::new(), 0, None, 0);
    let start_ms = 1_800_000_000_000;
    partition.begin_serving(start_ms);
    let region = Region::new(GLOBAL);
    for (now_ms, first) in (start_ms..).zip((0..JOBS).step_by(BATCH)) {
        let jobs = (first..first + BATCH)
            .map(|job| request(&config, job))
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
    let change = region.change();
    drop(partition);
    Ok(
        (isize::try_from(change.bytes_allocated)? - isize::try_from(change.bytes_deallocated)?)
            / isize::try_from(JOBS)?,
    )
}

#[test]
fn a_waiting_job_costs_admissions_core_a_bounded_number_of_heap_bytes() -> TestResult<()> {
    let bytes = bytes_per_waiting_job()?;
    eprintln!("admission core: {bytes} heap bytes per waiting job");
    assert!(bytes <= BOUND, "{bytes} heap bytes per waiting job, more than {BOUND}");
    Ok(())
}
