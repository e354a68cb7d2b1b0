//! Per-process limits, and no job stranded behind a worker saturated by its
//! own limit while another worker has room.

use std::time::Duration;

use sluice_client::{JobBuilder, Producer, Worker};
use sluice_e2e::{test_config, Stack};
use sluice_proto::v1 as pb;

use crate::*;

const JOBS: usize = 8;
const RUN_MS: u64 = 1_000;
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
        .concurrency(8)
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

/// Milliseconds, within [first admission, last end], during which the `idle`
/// worker ran fewer than `idle_limit` jobs while some job had been waiting
/// (since admission) for longer than `threshold_ms` without starting.
fn stranded_ms(runs: &[Run], idle_limit: usize, threshold_ms: i64) -> i64 {
    let Some(from) = runs.iter().map(|run| run.admitted_at_ms).min() else {
        return 0;
    };
    let until = runs.iter().map(|run| run.ended_ms).max().unwrap_or(from);
    let mut stranded = 0;
    let mut at = from;
    while at < until {
        let idle_running = runs
            .iter()
            .filter(|run| run.worker == "idle" && run.started_ms <= at && at < run.ended_ms)
            .count();
        let someone_waits_too_long = runs
            .iter()
            .any(|run| run.admitted_at_ms + threshold_ms < at && at < run.started_ms);
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
    // "busy" may run one slow job at a time, "idle" eight.
    let busy = RunningWorker::start(worker(&stack, "busy", 1, &runs)?);
    let idle = RunningWorker::start(worker(&stack, "idle", 8, &runs)?);
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
    let first_enqueue = all.iter().map(|run| run.admitted_at_ms).min().unwrap();
    let last_end = all.iter().map(|run| run.ended_ms).max().unwrap();
    // A job may wait its 300 ms at the busy worker plus a Kafka hop and a
    // claim (slow on a loaded machine); 2.5 s in all is allowed before its
    // wait counts as stranded.
    let stranded = stranded_ms(&all, 8, 2_500);
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
    let mut timeline = all.clone();
    timeline.sort_by_key(|run| run.started_ms);
    for run in &timeline {
        println!(
            "  {} {} attempt {} started +{} ended +{}",
            run.worker,
            run.job_id,
            run.attempt,
            run.started_ms - first_enqueue,
            run.ended_ms - first_enqueue
        );
    }

    // Every job ran once, to success.
    assert_eq!(all.len(), JOBS, "{all:?}");
    assert!(all.iter().all(|run| !run.dropped));
    // The per-process limit held.
    assert!(
        max_overlap(&busy_runs) <= 1,
        "busy ran more than 1 slow job at once: {busy_runs:?}"
    );
    assert!(max_overlap(&idle_runs) <= 8);
    // Admission put every job on the busy worker's partition...
    assert!(
        busy_snapshot.delivered >= JOBS as u64,
        "the jobs did not all land on the busy worker's partition: {busy_snapshot:?}"
    );
    // ...and the idle worker ran most of them.
    assert!(idle_runs.len() >= 5, "the idle worker ran only {}", idle_runs.len());
    // No job waited long while the idle worker had room: without hand-off
    // the busy worker runs them one after another and this is ~6 s.
    assert!(
        stranded <= 4_000,
        "jobs waited {stranded} ms while the idle worker had room"
    );
    // About one round (1 s plus the hand-off), not 8 in a row (8 s).
    assert!(
        last_end - first_enqueue < 6_500,
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

/// A worker whose local queue stays full pauses its partitions (to keep
/// polling and its group membership) and resumes where it stopped: nothing
/// is lost or stalls.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_full_for_long_pauses_its_partitions_and_resumes_without_losing_a_job() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("sdk_pause", &[])?, 1).await?;
    let runs = Runs::default();
    let handler = {
        let runs = runs.clone();
        move |job: sluice_client::Job| {
            let runs = runs.clone();
            async move {
                let guard = RunGuard::start(&runs, "single", &job);
                tokio::time::sleep(Duration::from_millis(millis_of(job.payload()))).await;
                guard.finished();
                Ok(())
            }
        }
    };
    let producer = Producer::new(&client_options(&stack))?;
    // One enqueue at a time, so each admitted job is its own record batch:
    // tansu (memory storage) reports a partition's high watermark as its last
    // batch's base offset + 1, so a fetch resumed inside a multi-record batch
    // sees nothing until newer data arrives (real Kafka has no such gap).
    let mut job_ids = Vec::new();
    for index in 0..5 {
        let request = JobBuilder::new("acme", "default")
            .job_id(format!("p-{index}"))
            .payload("job/700")
            .build()?;
        let job_id = producer.enqueue(request).await?.job_id;
        // Admitted (published) before the next one is enqueued.
        sluice_e2e::eventually(Duration::from_secs(30), "the job to be admitted", || async {
            Ok(job_view(&stack, &job_id).await?.admitted_at_ms.is_some())
        })
        .await?;
        job_ids.push(job_id);
    }
    // The worker starts with every job waiting in Kafka: one runs, one waits
    // in the queue (prefetch 1) long enough to pause the partitions.
    let worker = RunningWorker::start(
        Worker::builder(client_options(&stack), handler)
            .task_group("default")
            .worker_id("single")
            .concurrency(1)
            .prefetch(1)
            .pause_when_full_for(Duration::from_millis(200))
            .build()?,
    );
    wait_all_status(&stack, &job_ids, pb::JobStatus::Succeeded, Duration::from_secs(60)).await?;

    let mut all = runs.all();
    all.sort_by_key(|run| run.started_ms);
    let gaps: Vec<i64> = all
        .windows(2)
        .map(|pair| pair[1].started_ms - pair[0].ended_ms)
        .collect();
    println!("gaps between runs (ms): {gaps:?}; {:?}", worker.status.snapshot());
    assert_eq!(all.len(), 5, "{all:?}");
    assert_eq!(max_overlap(&all), 1);
    assert!(
        worker.status.snapshot().pauses >= 1,
        "the queue never stayed full long enough to pause"
    );
    // The next job was already queued while the partitions were paused: a
    // gap is a claim, never a stalled fetch (the test's claim timeout, 10 s,
    // would re-send a job nobody fetched).
    assert!(gaps.iter().all(|gap| *gap < 3_000), "gaps {gaps:?}");
    worker.stop().await;
    stack.stop().await;
    Ok(())
}
