//! Shutdown: stop fetching, hand back queued jobs at once, let running
//! handlers finish within the grace, hand back the rest; tickets return at
//! once (not after the 30 s lease), offsets are committed.

use std::sync::Arc;
use std::time::Duration;

use sluice_client::{JobBuilder, Producer, StopReason, Worker};
use sluice_e2e::{key_state, test_config, Stack};
use sluice_proto::v1 as pb;
use tokio::sync::Notify;

use crate::*;

const GRACE_MS: i64 = 1_000;
const KEY: &str = "sd";

fn job(job_id: &str, payload: &str, priority: u32) -> sluice_client::Result<pb::JobRequest> {
    JobBuilder::new("acme", "default")
        .job_id(job_id)
        .payload(payload.to_string())
        .priority(priority)
        .concurrency(KEY, 4)
        .build()
}

fn handed_back_at(view: &pb::JobView) -> Option<i64> {
    view.history
        .iter()
        .find(|record| record.outcome == "handed_back" && record.detail == "worker shutting down")
        .map(|record| record.at_ms)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_hands_back_queued_and_overdue_jobs_and_their_tickets_return_at_once() -> anyhow::Result<()> {
    // The default lease (30 s): a ticket coming back by lease expiry would be far too late.
    let stack = Stack::start(test_config("sdk_shutdown", &[])?, 1).await?;
    let runs = Runs::default();
    let shutdown_began = Arc::new(Notify::new());
    let handler = {
        let runs = runs.clone();
        let shutdown_began = shutdown_began.clone();
        move |job: sluice_client::Job| {
            let runs = runs.clone();
            let shutdown_began = shutdown_began.clone();
            async move {
                let guard = RunGuard::start(&runs, "first", &job);
                if job.payload().starts_with(b"graceful") {
                    // Finishes 300 ms into the shutdown grace.
                    shutdown_began.notified().await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                } else {
                    // Ignores its token: still running when the grace ends.
                    tokio::time::sleep(Duration::from_millis(millis_of(job.payload()))).await;
                }
                guard.finished();
                Ok(())
            }
        }
    };
    let first = RunningWorker::start(
        Worker::builder(client_options(&stack), handler)
            .task_group("default")
            .worker_id("first")
            .concurrency(2)
            .prefetch(4)
            .shutdown_grace(Duration::from_millis(u64::try_from(GRACE_MS)?))
            .build()?,
    );
    wait_assigned(&[&first], usize::try_from(stack.config.kafka.partitions.admitted)?).await?;
    let producer = Producer::new(&client_options(&stack))?;
    let admission = stack.admission_client().await?;

    // Two running, two queued in the worker (no slot), all four holding a
    // ticket of the key (max 4); two more wait for a ticket.
    producer.enqueue(job("graceful", "graceful/0", 50)?).await?;
    producer.enqueue(job("stubborn", "stubborn/60000", 50)?).await?;
    for job_id in ["graceful", "stubborn"] {
        sluice_e2e::wait_status(&admission, job_id, pb::JobStatus::Running, Duration::from_secs(30)).await?;
    }
    producer.enqueue(job("queued-1", "quick/10", 50)?).await?;
    producer.enqueue(job("queued-2", "quick/10", 50)?).await?;
    let queued = sluice_e2e::eventually(Duration::from_secs(30), "two jobs queued in the worker", || async {
        Ok(first.status.snapshot().pending == 2)
    })
    .await;
    if let Err(error) = queued {
        // Failed under full `make test` runs (CI) with four jobs queued: two
        // messages came again while the first two waited (re-sent after the
        // claim timeout, or delivered again) and the worker queued them
        // twice; it now keeps each attempt once (redelivery.rs). Say where
        // the two jobs were.
        let snapshot = first.status.snapshot();
        let views = [job_view(&stack, "queued-1").await, job_view(&stack, "queued-2").await];
        let views: Vec<String> = views
            .iter()
            .map(|view| match view {
                Ok(view) => format!(
                    "{} {:?} attempt {} ({})",
                    view.job_id,
                    view.status(),
                    view.attempt,
                    view.reason
                ),
                Err(error) => error.to_string(),
            })
            .collect();
        anyhow::bail!("{error}; the worker: {snapshot:?}; the jobs: {views:?}");
    }
    // Most urgent: they get the first tickets that come back.
    producer.enqueue(job("waiting-1", "quick/10", 0)?).await?;
    producer.enqueue(job("waiting-2", "quick/10", 0)?).await?;
    for job_id in ["waiting-1", "waiting-2"] {
        sluice_e2e::wait_status(&admission, job_id, pb::JobStatus::Waiting, Duration::from_secs(30)).await?;
    }
    sluice_e2e::eventually(Duration::from_secs(30), "4 holders and 2 waiters", || async {
        let state = key_state(&stack, "acme", KEY).await?;
        Ok((state.holders.len(), state.waiting) == (4, 2))
    })
    .await?;

    let shutdown_at = now_ms();
    shutdown_began.notify_waiters();
    let drain = first.stop().await;
    let stopped_at = now_ms();

    // Both waiting jobs got tickets: the graceful job's and the hand-backs'.
    let waiting = ["waiting-1".to_string(), "waiting-2".to_string()];
    wait_all_status(&stack, &waiting, pb::JobStatus::Admitted, Duration::from_secs(10)).await?;
    let mut tickets_back_after = 0;
    for job_id in &waiting {
        let admitted_at = job_view(&stack, job_id).await?.admitted_at_ms.unwrap_or(i64::MAX);
        tickets_back_after = tickets_back_after.max(admitted_at - shutdown_at);
    }

    let graceful = job_view(&stack, "graceful").await?;
    let stubborn = job_view(&stack, "stubborn").await?;
    let queued_1 = job_view(&stack, "queued-1").await?;
    let queued_2 = job_view(&stack, "queued-2").await?;
    let stubborn_back = handed_back_at(&stubborn).map(|at| at - shutdown_at);
    let queued_back = [handed_back_at(&queued_1), handed_back_at(&queued_2)].map(|at| at.map(|at| at - shutdown_at));
    println!(
        "drain {drain:?} (worker returned {} ms after the signal); queued handed back after {queued_back:?} ms, stubborn after {stubborn_back:?} ms; both waiting jobs admitted {tickets_back_after} ms after the signal",
        stopped_at - shutdown_at
    );

    assert!(
        drain < Duration::from_millis(u64::try_from(GRACE_MS)? + 3_000),
        "drain took {drain:?}"
    );
    // The in-flight job that finished within the grace succeeded.
    assert_eq!(graceful.status, pb::JobStatus::Succeeded as i32, "{graceful:?}");
    assert_eq!(graceful.attempt, 1);
    // Queued jobs went back at once, without running here.
    for (view, back) in [(&queued_1, queued_back[0]), (&queued_2, queued_back[1])] {
        let back = back.unwrap_or_else(|| panic!("{} was not handed back: {:?}", view.job_id, view.history));
        assert!(back < 700, "{} handed back {back} ms after the signal", view.job_id);
        assert_eq!(view.attempt, 2, "a hand-back starts a new attempt: {view:?}");
        assert!(
            runs.of_job(&view.job_id).is_empty(),
            "{} ran on the draining worker",
            view.job_id
        );
    }
    // The job still running at the end of the grace was stopped and handed back.
    let stubborn_back = stubborn_back.unwrap_or_else(|| panic!("stubborn was not handed back: {:?}", stubborn.history));
    assert!(
        (GRACE_MS - 100..GRACE_MS + 1_500).contains(&stubborn_back),
        "stubborn handed back {stubborn_back} ms after the signal"
    );
    let stubborn_runs = runs.of_job("stubborn");
    assert_eq!(stubborn_runs.len(), 1);
    assert!(stubborn_runs[0].dropped);
    assert_eq!(stubborn_runs[0].stop_reason, Some(StopReason::Shutdown));
    // Tickets came back at once, not after the 30 s lease.
    assert!(
        tickets_back_after < 5_000,
        "the waiting jobs were admitted {tickets_back_after} ms after the signal"
    );
    // Every attempt-1 ticket of a handed-back job is released (the releases
    // travel through Kafka to limit-grant; well inside the 30 s lease).
    sluice_e2e::eventually(
        Duration::from_secs(10),
        "the handed-back attempts' tickets released",
        || async {
            let state = key_state(&stack, "acme", KEY).await?;
            Ok(state
                .holders
                .iter()
                .filter_map(|holder| holder.ticket.as_ref())
                .all(|ticket| ticket.attempt >= 2 || ticket.job_id.starts_with("waiting")))
        },
    )
    .await?;

    // Another worker of the group runs the rest. The first one committed its
    // offsets, so the second sees none of the messages the first dealt with:
    // only the new attempts (and, on a slow machine, re-sends of them after
    // the claim timeout).
    let deliveries: Arc<std::sync::Mutex<Vec<(String, u32)>>> = Arc::default();
    let second_handler = |_job: sluice_client::Job| async move { Ok(()) };
    let second = RunningWorker::start(
        Worker::builder(client_options(&stack), second_handler)
            .task_group("default")
            .worker_id("second")
            .task_type({
                let deliveries = deliveries.clone();
                move |job: &pb::AdmittedJob| {
                    deliveries.lock().unwrap().push((job.job_id.clone(), job.attempt));
                    job.task_group.clone()
                }
            })
            .build()?,
    );
    let rest: Vec<String> = ["stubborn", "queued-1", "queued-2", "waiting-1", "waiting-2"]
        .iter()
        .map(ToString::to_string)
        .collect();
    wait_all_status(&stack, &rest, pb::JobStatus::Succeeded, Duration::from_secs(60)).await?;
    let second_snapshot = second.status.snapshot();
    let seen = deliveries.lock().unwrap().clone();
    println!("second worker: {second_snapshot:?}; received {seen:?}");
    assert_eq!(second_snapshot.claimed, 5);
    let dealt_with_by_the_first = ["graceful", "stubborn", "queued-1", "queued-2"];
    assert!(
        seen.iter()
            .all(|(job_id, attempt)| !(dealt_with_by_the_first.contains(&job_id.as_str()) && *attempt == 1)),
        "messages the first worker dealt with came again: {seen:?}"
    );
    second.stop().await;
    assert_eq!(stack.tickets_left().await?, 0);
    stack.stop().await;
    Ok(())
}
