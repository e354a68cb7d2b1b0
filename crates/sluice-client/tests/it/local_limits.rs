//! Per-process limits, and no job stranded behind a worker saturated by its
//! own limit while another worker has room.

use std::time::Duration;

use sluice_client::{JobBuilder, Producer, Worker};
use sluice_e2e::{test_config, Stack};
use sluice_proto::v1 as pb;

use crate::*;

const JOBS: usize = 8;
const RUN_MS: u64 = 800;
const HANDOFF_MS: u64 = 300;

fn worker(stack: &Stack, name: &'static str, slow_limit: usize, runs: &Runs) -> anyhow::Result<Worker> {
    let runs = runs.clone();
    let handler = move |job: sluice_client::Job| {
        let runs = runs.clone();
        async move {
            let guard = RunGuard::start(&runs, name, &job);
            tokio::time::sleep(Duration::from_millis(millis_of(job.payload()))).await;
            guard.finished();
            Ok(())
        }
    };
    Ok(Worker::builder(client_options(stack), handler)
        .task_group("default")
        .worker_id(name)
        .concurrency(4)
        // The task type is the payload's name before the first '/'.
        .task_type(|job: &pb::AdmittedJob| {
            String::from_utf8_lossy(&job.payload)
                .split('/')
                .next()
                .unwrap_or_default()
                .to_string()
        })
        .process_limit("slow", slow_limit)
        .handoff_after(Duration::from_millis(HANDOFF_MS))
        .build()?)
}

/// Milliseconds, within [first enqueue, last end], during which `idle_worker`
/// ran fewer than `idle_limit` jobs while some job had been waiting (since
/// enqueue) for longer than `threshold_ms` without starting.
fn stranded_ms(runs: &[Run], idle_worker: &str, idle_limit: usize, threshold_ms: i64) -> i64 {
    let Some(from) = runs.iter().map(|run| run.enqueued_at_ms).min() else {
        return 0;
    };
    let until = runs.iter().map(|run| run.ended_ms).max().unwrap_or(from);
    let mut stranded = 0;
    let mut at = from;
    while at < until {
        let idle_running = runs
            .iter()
            .filter(|run| run.worker == idle_worker && run.started_ms <= at && at < run.ended_ms)
            .count();
        let someone_waits_too_long = runs
            .iter()
            .any(|run| run.enqueued_at_ms + threshold_ms < at && at < run.started_ms);
        if idle_running < idle_limit && someone_waits_too_long {
            stranded += 10;
        }
        at += 10;
    }
    stranded
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_process_limits_hold_and_a_saturated_worker_hands_its_jobs_to_an_idle_one() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("sdk_limits", &[])?, 1).await?;
    let partitions = stack.config.kafka.partitions.admitted;
    let runs = Runs::default();
    // "busy" may run one slow job at a time, "idle" two.
    let busy = RunningWorker::start(worker(&stack, "busy", 1, &runs)?);
    let idle = RunningWorker::start(worker(&stack, "idle", 2, &runs)?);
    wait_assigned(&[&busy, &idle], usize::try_from(partitions)?).await?;
    let busy_partition = busy.status.snapshot().assigned[0].1;

    // Every job is admitted to the busy worker's partition.
    let job_ids = job_ids_on_partition("slow", busy_partition, partitions, JOBS);
    let producer = Producer::new(&client_options(&stack))?;
    let requests = job_ids
        .iter()
        .map(|job_id| {
            JobBuilder::new("acme", "default")
                .job_id(job_id)
                .payload(format!("slow/{RUN_MS}"))
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let enqueued = producer.enqueue_batch(requests).await?;
    assert_eq!(enqueued.len(), JOBS);
    wait_all_status(&stack, &job_ids, pb::JobStatus::Succeeded, Duration::from_secs(60)).await?;

    let all = runs.all();
    let busy_runs = runs.of_worker("busy");
    let idle_runs = runs.of_worker("idle");
    let first_enqueue = all.iter().map(|run| run.enqueued_at_ms).min().unwrap();
    let last_end = all.iter().map(|run| run.ended_ms).max().unwrap();
    let stranded = stranded_ms(&all, "idle", 2, i64::try_from(HANDOFF_MS)? + 700);
    let busy_snapshot = busy.status.snapshot();
    let idle_snapshot = idle.status.snapshot();
    println!(
        "busy ran {} (peak {}), idle ran {} (peak {}); makespan {} ms; stranded {stranded} ms; busy {busy_snapshot:?}; idle {idle_snapshot:?}",
        busy_runs.len(),
        max_overlap(&busy_runs),
        idle_runs.len(),
        max_overlap(&idle_runs),
        last_end - first_enqueue
    );

    // Every job ran once, to success.
    assert_eq!(all.len(), JOBS, "{all:?}");
    assert!(all.iter().all(|run| !run.dropped));
    // Per-process limits held.
    assert!(
        max_overlap(&busy_runs) <= 1,
        "busy ran more than 1 slow job at once: {busy_runs:?}"
    );
    assert!(
        max_overlap(&idle_runs) <= 2,
        "idle ran more than 2 slow jobs at once: {idle_runs:?}"
    );
    // Admission put every job on the busy worker's partition...
    assert!(
        busy_snapshot.delivered >= JOBS as u64,
        "the jobs did not all land on the busy worker's partition: {busy_snapshot:?}"
    );
    // ...and the idle worker ran most of them.
    assert!(idle_runs.len() >= 4, "the idle worker ran only {}", idle_runs.len());
    // No job waited long while the idle worker had room.
    assert!(
        stranded <= 1_000,
        "jobs waited {stranded} ms while the idle worker had room"
    );
    // Three slots for 8 jobs of 800 ms: about 3 rounds, not 8 in a row.
    assert!(
        last_end - first_enqueue < 5_000,
        "took {} ms; one at a time would take {} ms",
        last_end - first_enqueue,
        JOBS as u64 * RUN_MS
    );

    busy.stop().await;
    idle.stop().await;
    assert_eq!(stack.tickets_left().await?, 0);
    stack.stop().await;
    Ok(())
}
