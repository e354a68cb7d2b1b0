//! Floating concurrency limits end to end: limit-grant says when a refresh is
//! due, the refresh-dispatcher sends refresh tasks to workers and their
//! answers back to limit-grant as the key's new max, with backoff on failure
//! and nothing lost across a restart of the dispatcher.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_common::{FaultPoint, Faults, Shutdown};
use sluice_e2e::*;
use sluice_proto::v1 as pb;

fn start_job_workers(stack: &Stack, recorder: &Arc<Recorder>, stop: &Shutdown, min_run_ms: u64, max_run_ms: u64) {
    tokio::spawn(run_worker(
        stack.config.clone(),
        stack.admissions[0].endpoint.clone(),
        WorkerOptions {
            worker_id: "worker".to_string(),
            task_group: "default".to_string(),
            group: format!("{}workers", stack.config.kafka.topic_prefix),
            concurrency: 16,
            min_run: Duration::from_millis(min_run_ms),
            max_run: Duration::from_millis(max_run_ms),
        },
        recorder.clone(),
        stop.clone(),
    ));
}

fn start_refresh_worker(
    stack: &Stack,
    handler: RefreshHandler,
    stop: &Shutdown,
) -> (Arc<Mutex<Vec<RefreshRecord>>>, DispatcherAddress) {
    let records = Arc::new(Mutex::new(Vec::new()));
    let address: DispatcherAddress = Arc::new(Mutex::new(stack.refresh_dispatchers[0].endpoint.clone()));
    tokio::spawn(run_refresh_worker(
        stack.config.clone(),
        address.clone(),
        handler,
        records.clone(),
        stop.clone(),
    ));
    (records, address)
}

async fn describe_floating(stack: &Stack, key: &str) -> anyhow::Result<pb::DescribeFloatingLimitResponse> {
    let mut client = stack.refresh_client().await?;
    Ok(client
        .describe_floating_limit(pb::DescribeFloatingLimitRequest {
            key: Some(pb::KeyRef {
                tenant: "acme".to_string(),
                key: key.to_string(),
            }),
        })
        .await?
        .into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refreshes_move_the_max_raise_admits_at_once_and_a_failure_keeps_the_max() -> anyhow::Result<()> {
    let stack = Stack::start(
        test_config("floating", &[("refresh_dispatcher.task_timeout", "5s")])?,
        1,
    )
    .await?;
    let stop = Shutdown::new();
    let events = Arc::new(Mutex::new(Vec::new()));
    observe_grants(&stack, events.clone(), stop.clone()).await?;
    // The worker's refresh handler: 2, then 6, then a failure, then 4 (and 4 after that).
    let script = Arc::new(Mutex::new(VecDeque::from([
        Ok(2),
        Ok(6),
        Err("quota service unavailable".to_string()),
        Ok(4),
    ])));
    let handler: RefreshHandler = {
        let script = script.clone();
        Arc::new(move |_task| script.lock().unwrap().pop_front().unwrap_or(Ok(4)))
    };
    let (records, _) = start_refresh_worker(&stack, handler, &stop);
    let recorder = Arc::new(Recorder::default());
    start_job_workers(&stack, &recorder, &stop, 600, 900);

    // 40 jobs; the first creates the key's state with default_max 1. Later
    // jobs carry another default, which is ignored.
    let producer = RequestProducer::new(&stack.config)?;
    producer.send(&[floating_job("acme", "gpu", 1, 300, "f/0")]).await?;
    eventually(
        Duration::from_secs(30),
        "the first job creates the key's state",
        || async { Ok(key_state(&stack, "acme", "gpu").await?.floating.is_some()) },
    )
    .await?;
    let requests: Vec<pb::JobRequest> = (1..40)
        .map(|index| floating_job("acme", "gpu", 9, 300, &format!("f/{index}")))
        .collect();
    producer.send(&requests).await?;

    // While the failed refresh waits for its retry, the dispatcher shows it.
    eventually(Duration::from_secs(60), "the failed refresh", || async {
        Ok(records.lock().unwrap().len() >= 3)
    })
    .await?;
    let during_backoff = describe_floating(&stack, "gpu").await?;
    if records.lock().unwrap().len() == 3 {
        assert_eq!(
            during_backoff.current_max, 6,
            "the failure keeps the max: {during_backoff:?}"
        );
        assert_eq!(during_backoff.retry_count, 1);
        assert!(during_backoff.last_error.contains("quota service unavailable"));
        // Both times are the dispatcher's own clock: exactly 1 s apart.
        let retry_at = during_backoff.next_refresh_due_at_ms.expect("a retry is scheduled");
        let failed_at = during_backoff.last_refresh.as_ref().expect("the failure").at_ms;
        assert_eq!(retry_at - failed_at, 1_000, "the first retry waits 1 s");
    }

    eventually(Duration::from_secs(90), "40 completions", || async {
        Ok(recorder.completed() == 40)
    })
    .await?;
    let records = records.lock().unwrap().clone();
    let events = events.lock().unwrap().clone();

    // The refresh tasks: the script in order, metadata passed through, the
    // failure retried as attempt 2 after its 1 s backoff with the max kept.
    assert!(records.len() >= 4, "{records:?}");
    let results: Vec<Result<i64, String>> = records.iter().take(4).map(|record| record.result.clone()).collect();
    assert_eq!(
        results,
        vec![Ok(2), Ok(6), Err("quota service unavailable".to_string()), Ok(4)]
    );
    assert!(
        records.iter().take(4).all(|record| record.response.applied),
        "{records:?}"
    );
    let current_maxes: Vec<u32> = records.iter().take(4).map(|record| record.task.current_max).collect();
    assert_eq!(current_maxes, vec![1, 2, 6, 6], "each task carries the max in force");
    assert!(records
        .iter()
        .all(|record| record.task.metadata.get("pool").map(String::as_str) == Some("gpu")));
    let attempts: Vec<u32> = records.iter().take(4).map(|record| record.task.attempt).collect();
    assert_eq!(attempts, vec![1, 1, 1, 2]);
    // Task times are the dispatcher's clock: the retry is issued 1 s after
    // the failure, which came right after task 3 was issued.
    let backoff = records[3].task.issued_at_ms - records[2].task.issued_at_ms;
    assert!(
        (1_000..1_500).contains(&backoff),
        "the retry came {backoff} ms after the failure"
    );
    let mut task_ids: Vec<&str> = records.iter().map(|record| record.task.task_id.as_str()).collect();
    task_ids.sort_unstable();
    task_ids.dedup();
    assert_eq!(task_ids.len(), records.len(), "one task per refresh");

    // Grants: never more holders than the max in force at the grant, and
    // that max follows the refreshes in order.
    // A grant is re-sent when admission re-sends a long wait's acquire; the
    // first event of each ticket is the grant.
    let mut seen = std::collections::HashSet::new();
    let grants: Vec<&pb::GrantEvent> = events
        .iter()
        .filter(|event| event.kind == pb::LimitKind::Floating as i32)
        .filter(|event| seen.insert(event.ticket.clone()))
        .collect();
    assert_eq!(grants.len(), 40, "each job granted once");
    let grant_of: HashMap<&str, &pb::GrantEvent> = grants
        .iter()
        .map(|event| (event.ticket.as_ref().unwrap().job_id.as_str(), *event))
        .collect();
    for event in &grants {
        assert!(i64::from(event.holders) <= event.max, "overrun at grant: {event:?}");
    }
    // Never more running than the max in force at the last grant among
    // the jobs running: every running job already held its slot then, and
    // a lower max only affects later grants. (Not the max at the starting
    // job's own grant: a job granted under 2 may start after the max rose
    // to 6 and others were granted under it.)
    let runs = recorder.runs();
    for run in &runs {
        let running: Vec<&RunRecord> = runs
            .iter()
            .filter(|other| other.claimed_at <= run.claimed_at && run.claimed_at < other.finished_at)
            .collect();
        let last_granted_at = running
            .iter()
            .map(|other| grant_of[other.job_id.as_str()].granted_at_ms)
            .max()
            .unwrap_or_default();
        let max = running
            .iter()
            .map(|other| grant_of[other.job_id.as_str()])
            .filter(|grant| grant.granted_at_ms == last_granted_at)
            .map(|grant| grant.max)
            .max()
            .unwrap_or_default();
        assert!(
            i64::try_from(running.len()).unwrap() <= max,
            "{} running when {} started, under max {max} at the last of their grants",
            running.len(),
            run.job_id
        );
    }
    let mut by_time = grants.clone();
    by_time.sort_by_key(|event| event.granted_at_ms);
    let sequence = [1i64, 2, 6, 4];
    let mut position = 0;
    for event in &by_time {
        let found = sequence[position..]
            .iter()
            .position(|max| *max == event.max)
            .unwrap_or_else(|| panic!("max {} out of order (at step {position})", event.max));
        position += found;
    }
    assert_eq!(position, 3, "the max went 1, 2, 6, 4");

    // Raising to 6 admits waiters in the same batch as the new max arrives.
    let first_six = by_time.iter().find(|event| event.max == 6).unwrap();
    let granted_with_it = by_time
        .iter()
        .filter(|event| event.max == 6 && event.granted_at_ms == first_six.granted_at_ms)
        .count();
    assert!(
        granted_with_it >= 3,
        "only {granted_with_it} granted when the max rose to 6"
    );
    let round_trip = first_six.granted_at_ms - records[1].reporting_at_ms;
    assert!(
        (-50..2_000).contains(&round_trip),
        "the raise admitted waiters {round_trip} ms after the report"
    );

    // Between the failure and the retry's success the max stays 6.
    let kept: Vec<i64> = by_time
        .iter()
        .filter(|event| {
            event.granted_at_ms > records[2].reported_at_ms && event.granted_at_ms < records[3].reporting_at_ms
        })
        .map(|event| event.max)
        .collect();
    assert!(!kept.is_empty(), "no grants during the backoff to check");
    assert!(kept.iter().all(|max| *max == 6), "max during backoff: {kept:?}");

    // Introspection agrees: the dispatcher's schedule and limit-grant's key.
    let described = describe_floating(&stack, "gpu").await?;
    assert_eq!(described.current_max, 4);
    assert_eq!(described.default_max, 1, "the first job's default; later ones ignored");
    assert_eq!(described.retry_count, 0, "reset on success");
    assert_eq!(described.metadata.get("pool").map(String::as_str), Some("gpu"));
    let last = described.last_refresh.unwrap();
    assert_eq!(last.outcome, pb::RefreshOutcome::Succeeded as i32);
    assert_eq!(last.value, 4);
    assert!(described.last_error.contains("quota"), "{}", described.last_error);
    let key = key_state(&stack, "acme", "gpu").await?;
    assert_eq!(key.floating_max, Some(4));
    assert_eq!(key.floating.unwrap().default_max, 1);
    eventually(Duration::from_secs(30), "every ticket released", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;

    // Admin: deleting the state forgets the schedule and limit-grant's max.
    let mut refresh = stack.refresh_client().await?;
    let deleted = refresh
        .delete_floating_limit(pb::DeleteFloatingLimitRequest {
            key: Some(pb::KeyRef {
                tenant: "acme".to_string(),
                key: "gpu".to_string(),
            }),
        })
        .await?
        .into_inner();
    assert!(deleted.deleted);
    let missing = describe_floating(&stack, "gpu").await.unwrap_err();
    assert!(missing.to_string().contains("no refresh has been due"), "{missing}");
    eventually(
        Duration::from_secs(30),
        "limit-grant forgets the floating max",
        || async { Ok(key_state(&stack, "acme", "gpu").await?.floating_max.is_none()) },
    )
    .await?;

    stop.trigger();
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_dispatcher_loses_no_due_refresh() -> anyhow::Result<()> {
    let mut stack = Stack::start(test_config("floatrestart", &[])?, 1).await?;
    let stop = Shutdown::new();
    let answer = Arc::new(AtomicI64::new(3));
    let handler: RefreshHandler = {
        let answer = answer.clone();
        Arc::new(move |_task| Ok(answer.load(Ordering::SeqCst)))
    };
    let (records, dispatcher_address) = start_refresh_worker(&stack, handler, &stop);
    let recorder = Arc::new(Recorder::default());
    start_job_workers(&stack, &recorder, &stop, 500, 700);

    // Crash point: the dispatcher saves the first refresh task as in flight
    // and dies before publishing it.
    stack.refresh_dispatchers[0]
        .faults
        .arm(FaultPoint::OwnerAfterCommitBeforePublish, 0, 1);
    let first: Vec<pb::JobRequest> = (0..10)
        .map(|index| floating_job("acme", "render", 1, 200, &format!("a/{index}")))
        .collect();
    RequestProducer::new(&stack.config)?.send(&first).await?;
    let mut crashed = stack.refresh_dispatchers.remove(0);
    crashed.wait_stopped(Duration::from_secs(60)).await?;
    assert_eq!(crashed.faults.fired(FaultPoint::OwnerAfterCommitBeforePublish), 1);
    assert!(records.lock().unwrap().is_empty(), "the task was never published");
    let replacement = start_refresh_dispatcher(&stack.config, Faults::none()).await?;
    *dispatcher_address.lock().unwrap() = replacement.endpoint.clone();
    stack.refresh_dispatchers.push(replacement);
    eventually(
        Duration::from_secs(60),
        "the saved task is re-sent and applied",
        || async { Ok(key_state(&stack, "acme", "render").await?.floating_max == Some(3)) },
    )
    .await?;
    {
        let records = records.lock().unwrap();
        assert!(!records.is_empty(), "{records:?}");
        let task_id = &records[0].task.task_id;
        let crashed_epoch_prefix = format!(
            "rt-{}.1.",
            sluice_common::partition::key_partition("acme", "render", stack.config.kafka.partitions.refresh_due,)
        );
        assert!(
            task_id.starts_with(&crashed_epoch_prefix),
            "the crashed owner's task {task_id} was re-sent, not a new one"
        );
        assert!(records[0].response.applied);
    }

    // A due event sent while no dispatcher runs waits in Kafka for the next one.
    let stopped = stack.refresh_dispatchers.remove(0);
    stopped.stop().await;
    answer.store(5, Ordering::SeqCst);
    let due_topic = stack.config.topic(&stack.config.topics.refresh_due);
    let due_before = messages_written(&stack.config, &due_topic).await?;
    let second: Vec<pb::JobRequest> = (0..10)
        .map(|index| floating_job("acme", "render", 1, 200, &format!("b/{index}")))
        .collect();
    RequestProducer::new(&stack.config)?.send(&second).await?;
    eventually(
        Duration::from_secs(30),
        "a refresh-due event sent while no dispatcher runs",
        || async { Ok(messages_written(&stack.config, &due_topic).await? > due_before) },
    )
    .await?;
    // Once no job waits on the key, limit-grant sends no more due events:
    // the refresh to 5 below can only come from the ones waiting in Kafka.
    eventually(Duration::from_secs(60), "no job waiting on the key", || async {
        Ok(key_state(&stack, "acme", "render").await?.waiting == 0)
    })
    .await?;
    let replacement = start_refresh_dispatcher(&stack.config, Faults::none()).await?;
    *dispatcher_address.lock().unwrap() = replacement.endpoint.clone();
    stack.refresh_dispatchers.push(replacement);
    let refreshed = eventually(Duration::from_secs(60), "the due refresh after the restart", || async {
        Ok(key_state(&stack, "acme", "render").await?.floating_max == Some(5))
    })
    .await;
    if let Err(error) = refreshed {
        // Where the refresh stopped: the dispatcher's schedule, limit-grant's
        // key, the tasks the worker saw (this failed twice under a full
        // `make test`, never alone).
        let schedule = describe_floating(&stack, "render").await;
        let key = key_state(&stack, "acme", "render").await;
        let seen: Vec<(String, u32)> = records
            .lock()
            .unwrap()
            .iter()
            .map(|record| (record.task.task_id.clone(), record.task.attempt))
            .collect();
        anyhow::bail!("{error}; the dispatcher's schedule: {schedule:?}; limit-grant's key: {key:?}; tasks the worker saw: {seen:?}");
    }
    eventually(Duration::from_secs(60), "20 completions", || async {
        Ok(recorder.completed() == 20)
    })
    .await?;
    eventually(Duration::from_secs(30), "every ticket released", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    let described = describe_floating(&stack, "render").await?;
    assert_eq!(described.current_max, 5);
    assert_eq!(described.retry_count, 0);

    stop.trigger();
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refresh_reports_are_validated_and_stale_ones_ignored() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("floatbad", &[])?, 1).await?;
    let mut refresh = stack.refresh_client().await?;
    let key = Some(pb::KeyRef {
        tenant: "acme".to_string(),
        key: "k".to_string(),
    });
    let cases = [
        (
            pb::ReportRefreshRequest {
                task_id: String::new(),
                key: key.clone(),
                result: Some(pb::report_refresh_request::Result::NewMax(2)),
            },
            "task_id",
        ),
        (
            pb::ReportRefreshRequest {
                task_id: "t".to_string(),
                key: None,
                result: Some(pb::report_refresh_request::Result::NewMax(2)),
            },
            "key",
        ),
        (
            pb::ReportRefreshRequest {
                task_id: "t".to_string(),
                key: Some(pb::KeyRef {
                    tenant: String::new(),
                    key: "k".to_string(),
                }),
                result: Some(pb::report_refresh_request::Result::NewMax(2)),
            },
            "key.tenant",
        ),
        (
            pb::ReportRefreshRequest {
                task_id: "t".to_string(),
                key: key.clone(),
                result: None,
            },
            "result",
        ),
    ];
    for (request, field) in cases {
        let status = refresh.report_refresh(request).await.unwrap_err();
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert!(status.message().starts_with(field), "{field}: {}", status.message());
    }
    let stale = refresh
        .report_refresh(pb::ReportRefreshRequest {
            task_id: "never-issued".to_string(),
            key,
            result: Some(pb::report_refresh_request::Result::NewMax(2)),
        })
        .await?
        .into_inner();
    assert!(!stale.applied);
    assert!(stale.detail.contains("ignored"), "{}", stale.detail);

    // A job's floating limit is checked at admission, naming the field.
    let mut admission = stack.admission_client().await?;
    let mut bad = floating_job("acme", "k", 0, 100, "x");
    let status = admission
        .enqueue(pb::EnqueueRequest { job: Some(bad.clone()) })
        .await
        .unwrap_err();
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("floating.default_max"),
        "{}",
        status.message()
    );
    bad = floating_job("acme", "k", 1, 0, "x");
    let status = admission
        .enqueue(pb::EnqueueRequest { job: Some(bad.clone()) })
        .await
        .unwrap_err();
    assert!(
        status.message().contains("floating.refresh_interval_ms"),
        "{}",
        status.message()
    );
    if let Some(pb::limit::Kind::Floating(floating)) = bad.limits[0].kind.as_mut() {
        floating.refresh_interval_ms = 100;
        floating.metadata.insert("blob".to_string(), "x".repeat(20_000));
    }
    let status = admission
        .enqueue(pb::EnqueueRequest { job: Some(bad) })
        .await
        .unwrap_err();
    assert!(status.message().contains("floating.metadata"), "{}", status.message());

    // The first job creates the key's shared state; GetJob tells a later job
    // that its own values are ignored.
    enqueue_with_id(&admission, "first", floating_job("acme", "shared", 1, 60_000, "1")).await?;
    wait_status(&admission, "first", pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    enqueue_with_id(&admission, "second", floating_job("acme", "shared", 7, 1_000, "2")).await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let reason = loop {
        let reason = job_view(&admission, "second").await?.reason;
        if reason.contains("ahead of this job") {
            break reason;
        }
        assert!(std::time::Instant::now() < deadline, "second job not waiting: {reason}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(reason.contains("floating max 1"), "{reason}");
    assert!(reason.contains("default_max 7 (the key's is 1)"), "{reason}");
    assert!(reason.contains("ignored"), "{reason}");
    let key = key_state(&stack, "acme", "shared").await?;
    assert_eq!(key.floating_max, Some(1));
    assert_eq!(key.floating.unwrap().refresh_interval_ms, 60_000);
    stack.stop().await;
    Ok(())
}
