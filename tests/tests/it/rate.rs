//! rate-window end to end: exact sliding windows that defer to the exact
//! slot, never drop; chains; durable windows across a restart; stored
//! resources; TryAcquire.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_common::Shutdown;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

fn start_workers(stack: &Stack, recorder: &Arc<Recorder>, stop: &Shutdown, min_run_ms: u64, max_run_ms: u64) {
    for index in 0..2 {
        tokio::spawn(run_worker(
            stack.config.clone(),
            stack.admissions[0].endpoint.clone(),
            WorkerOptions {
                worker_id: format!("worker-{index}"),
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
}

async fn observe(stack: &Stack, stop: &Shutdown) -> anyhow::Result<Arc<Mutex<Vec<pb::GrantEvent>>>> {
    let events = Arc::new(Mutex::new(Vec::new()));
    observe_grants(stack, events.clone(), stop.clone()).await?;
    Ok(events)
}

/// Checks that no interval of `window_ms` holds more than `limit` grants,
/// and returns the rate achieved once the window had to slide. The rate is
/// printed, not asserted: timer lateness on a loaded machine lowers it, and
/// speed belongs to `make bench`. That a deferred job is scheduled for the
/// exact slot is checked with an explicit clock in rate-window's unit tests
/// (`over_the_limit_waits_for_the_exact_slot_and_keeps_queue_order`).
fn check_window(times: &[i64], limit: usize, window_ms: i64) -> f64 {
    let peak = max_in_window(times, window_ms);
    assert!(
        peak <= limit,
        "{peak} grants in one {window_ms} ms interval, limit {limit}"
    );
    let first = *times.iter().min().unwrap();
    let last = *times.iter().max().unwrap();
    // The first `limit` go at once; the rest need the window to slide.
    let seconds = (last - first) as f64 / 1000.0;
    (times.len() - limit) as f64 / seconds
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_hundred_jobs_at_fifty_per_two_seconds_never_exceed_the_window() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("rate300", &[])?, 1).await?;
    let stop = Shutdown::new();
    let events = observe(&stack, &stop).await?;
    let recorder = Arc::new(Recorder::default());
    start_workers(&stack, &recorder, &stop, 1, 5);
    let requests: Vec<pb::JobRequest> = (0..300)
        .map(|index| rate_job("acme", "api", 50, 2000, &format!("r/{index}")))
        .collect();
    RequestProducer::new(&stack.config)?.send(&requests).await?;
    eventually(Duration::from_secs(60), "300 completions", || async {
        Ok(recorder.completed() == 300)
    })
    .await?;
    let times = rate_grant_times(&events.lock().unwrap(), "inline:api:");
    assert_eq!(times.len(), 300, "every job was granted once, none dropped");
    let rate = check_window(&times, 50, 2000);
    println!("achieved {rate:.2} jobs/s through a window of 50 per 2 s (at most 25)");
    stop.trigger();
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_chain_of_concurrency_then_rate_holds_both() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("ratechain", &[])?, 1).await?;
    let stop = Shutdown::new();
    let events = observe(&stack, &stop).await?;
    let recorder = Arc::new(Recorder::default());
    start_workers(&stack, &recorder, &stop, 100, 300);
    let requests: Vec<pb::JobRequest> = (0..60)
        .map(|index| {
            let mut request = rate_job("acme", "calls", 10, 1000, &format!("c/{index}"));
            // Listed after the rate limit; acquired before it all the same.
            request.limits.push(pb::Limit {
                kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                    key: "workers".to_string(),
                    max_concurrency: 2,
                    shadow: false,
                })),
            });
            request
        })
        .collect();
    RequestProducer::new(&stack.config)?.send(&requests).await?;
    eventually(Duration::from_secs(120), "60 completions", || async {
        Ok(recorder.completed() == 60)
    })
    .await?;
    let runs = recorder.runs();
    let all: Vec<&RunRecord> = runs.iter().collect();
    assert!(max_overlap(&all) <= 2, "concurrency limit 2 overran");
    let times = rate_grant_times(&events.lock().unwrap(), "inline:calls:");
    assert_eq!(times.len(), 60);
    assert!(max_in_window(&times, 1000) <= 10, "rate 10 per second overran");
    let job = job_view(&stack.admission_client().await?, &runs[0].job_id).await?;
    let order: Vec<i32> = job.acquisition_order.iter().map(|step| step.kind).collect();
    assert_eq!(
        order,
        vec![pb::LimitKind::Concurrency as i32, pb::LimitKind::Rate as i32],
        "rate limits come last"
    );
    eventually(Duration::from_secs(30), "no ticket left", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    stop.trigger();
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restart_of_rate_window_keeps_the_window() -> anyhow::Result<()> {
    let mut stack = Stack::start(test_config("raterestart", &[])?, 1).await?;
    let stop = Shutdown::new();
    let events = observe(&stack, &stop).await?;
    let recorder = Arc::new(Recorder::default());
    start_workers(&stack, &recorder, &stop, 1, 5);
    let requests: Vec<pb::JobRequest> = (0..300)
        .map(|index| rate_job("acme", "api", 50, 2000, &format!("r/{index}")))
        .collect();
    RequestProducer::new(&stack.config)?.send(&requests).await?;
    eventually(Duration::from_secs(60), "some grants before the restart", || async {
        Ok(rate_grant_times(&events.lock().unwrap(), "inline:api:").len() >= 120)
    })
    .await?;
    let old = stack.take_rate_window(0);
    old.kill().await;
    stack.add_rate_window(sluice_common::Faults::none()).await?;
    eventually(Duration::from_secs(90), "300 completions", || async {
        Ok(recorder.completed() == 300)
    })
    .await?;
    let times = rate_grant_times(&events.lock().unwrap(), "inline:api:");
    assert_eq!(times.len(), 300);
    // No burst after the restart: every 2 s interval, across it, holds at most 50.
    check_window(&times, 50, 2000);
    stop.trigger();
    stack.stop().await;
    Ok(())
}

fn resource_job(tenant: &str, resource_key: &str, payload: &str) -> pb::JobRequest {
    pb::JobRequest {
        tenant: tenant.to_string(),
        task_group: "default".to_string(),
        payload: payload.as_bytes().to_vec(),
        limits: vec![pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::RateLimitKey(resource_key.to_string())),
            })),
        }],
        ..Default::default()
    }
}

fn inline_limit(name: &str, limit: i64, duration_ms: i64) -> Option<pb::RateLimit> {
    Some(pb::RateLimit {
        spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
            name: name.to_string(),
            unique_key: String::new(),
            limit,
            duration_ms,
            cost: 0,
        })),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_resources_are_managed_and_deleting_one_releases_its_waiters() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("resources", &[])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let mut rates = stack.rates_client().await?;
    let put = rates
        .put_rate_limit(pb::PutRateLimitRequest {
            resource: Some(pb::RateLimitResource {
                tenant: "acme".to_string(),
                resource_key: "smtp".to_string(),
                max_count: 1,
                window_seconds: 3600,
            }),
        })
        .await?
        .into_inner();
    assert!(put.created);
    let listed = rates
        .list_rate_limits(pb::ListRateLimitsRequest {
            tenant: "acme".to_string(),
            page_size: 10,
            page_token: String::new(),
        })
        .await?
        .into_inner();
    assert_eq!(listed.resources.len(), 1);
    assert_eq!(listed.resources[0].max_count, 1);

    let [first, second, free] = ["first", "second", "free"].map(|name| format!("{prefix}{name}"));
    enqueue_with_id(&admission, &first, resource_job("acme", "smtp", "1")).await?;
    wait_status(&admission, &first, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    enqueue_with_id(&admission, &second, resource_job("acme", "smtp", "2")).await?;
    eventually(Duration::from_secs(10), "the second job's exact slot known", || async {
        let job = job_view(&admission, &second).await?;
        Ok(job
            .waiting
            .as_ref()
            .is_some_and(|waiting| waiting.retry_at_ms.is_some()))
    })
    .await?;
    let waiting = job_view(&admission, &second).await?;
    let slot = waiting.waiting.as_ref().unwrap().retry_at_ms.unwrap();
    let granted_first = job_view(&admission, &first).await?.admitted_at_ms.unwrap();
    assert!(
        (slot - (granted_first + 3_600_000)).abs() < 2000,
        "the slot opens when the first grant leaves the hour window: {slot} vs {granted_first}"
    );
    assert!(waiting.reason.contains("slot opens at"), "{}", waiting.reason);

    // Updating in place: a raised limit grants the waiter at once.
    rates
        .put_rate_limit(pb::PutRateLimitRequest {
            resource: Some(pb::RateLimitResource {
                tenant: "acme".to_string(),
                resource_key: "smtp".to_string(),
                max_count: 2,
                window_seconds: 3600,
            }),
        })
        .await?;
    wait_status(&admission, &second, pb::JobStatus::Admitted, Duration::from_secs(10)).await?;

    // Deleting releases the jobs waiting on it at once.
    let third = format!("{prefix}third");
    enqueue_with_id(&admission, &third, resource_job("acme", "smtp", "3")).await?;
    eventually(Duration::from_secs(10), "the third waits", || async {
        Ok(
            job_view(&admission, &third).await?.status == pb::JobStatus::Waiting as i32
                && key_waiting(&stack, "smtp").await? == 1,
        )
    })
    .await?;
    let deleted = rates
        .delete_rate_limit(pb::DeleteRateLimitRequest {
            tenant: "acme".to_string(),
            resource_key: "smtp".to_string(),
        })
        .await?
        .into_inner();
    assert!(deleted.deleted);
    assert_eq!(deleted.released_waiters, 1);
    wait_status(&admission, &third, pb::JobStatus::Admitted, Duration::from_secs(10)).await?;

    // A reference to a key with no stored resource is not throttled, and GetJob says so.
    enqueue_with_id(&admission, &free, resource_job("acme", "no-such-resource", "free")).await?;
    let admitted = wait_status(&admission, &free, pb::JobStatus::Admitted, Duration::from_secs(10)).await?;
    assert!(
        admitted.reason.contains("names no stored resource: not throttled"),
        "{}",
        admitted.reason
    );
    stack.stop().await;
    Ok(())
}

async fn key_waiting(stack: &Stack, resource_key: &str) -> anyhow::Result<u32> {
    let mut rates = stack.rates_client().await?;
    Ok(rates
        .describe_rate_key(pb::DescribeRateKeyRequest {
            key: Some(pb::RateKeyRef {
                tenant: "acme".to_string(),
                kind: Some(pb::rate_key_ref::Kind::ResourceKey(resource_key.to_string())),
            }),
            ticket: None,
        })
        .await?
        .into_inner()
        .waiting)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn try_acquire_is_strict_and_bad_input_names_the_field() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("tryacquire", &[])?, 1).await?;
    let rates = stack.rates_client().await?;
    let mut calls = Vec::new();
    for _ in 0..20 {
        let mut client = rates.clone();
        calls.push(tokio::spawn(async move {
            client
                .try_acquire(pb::TryAcquireRequest {
                    tenant: "acme".to_string(),
                    limit: inline_limit("plain", 5, 1000),
                    cost: 1,
                })
                .await
                .map(tonic::Response::into_inner)
        }));
    }
    let mut allowed = 0;
    let mut retry_ats = Vec::new();
    for call in calls {
        let answer = call.await??;
        if answer.allowed {
            allowed += 1;
        } else {
            retry_ats.push(answer.retry_at_ms.expect("a refusal says when to retry"));
        }
    }
    assert_eq!(allowed, 5, "exactly the limit is allowed");
    let earliest_retry = *retry_ats.iter().min().unwrap();
    let mut client = rates.clone();
    let too_early = client
        .try_acquire(pb::TryAcquireRequest {
            tenant: "acme".to_string(),
            limit: inline_limit("plain", 5, 1000),
            cost: 1,
        })
        .await?
        .into_inner();
    assert!(!too_early.allowed);
    // Allowed once the retry time has come, and not before (on rate-window's
    // clock, which follows PostgreSQL's and may be a few milliseconds off
    // ours): asked again and again, the first yes comes after the retry time.
    loop {
        let answer = client
            .try_acquire(pb::TryAcquireRequest {
                tenant: "acme".to_string(),
                limit: inline_limit("plain", 5, 1000),
                cost: 1,
            })
            .await?
            .into_inner();
        let answered_at = sluice_common::clock::wall_clock_ms();
        if answer.allowed {
            assert!(
                answered_at >= earliest_retry - 50,
                "allowed {} ms before the retry time",
                earliest_retry - answered_at
            );
            break;
        }
        assert!(
            answered_at < earliest_retry + 2_000,
            "still refused 2 s after the retry time"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    let bad: Vec<(pb::TryAcquireRequest, &str)> = vec![
        (
            pb::TryAcquireRequest {
                tenant: "acme".to_string(),
                limit: inline_limit("x", 0, 1000),
                cost: 1,
            },
            "limit.inline.limit: must be greater than 0",
        ),
        (
            pb::TryAcquireRequest {
                tenant: "acme".to_string(),
                limit: inline_limit("x", -3, 1000),
                cost: 1,
            },
            "limit.inline.limit: must be greater than 0",
        ),
        (
            pb::TryAcquireRequest {
                tenant: "acme".to_string(),
                limit: inline_limit("x", 5, 0),
                cost: 1,
            },
            "limit.inline.duration_ms: must be greater than 0",
        ),
        (
            pb::TryAcquireRequest {
                tenant: "acme".to_string(),
                limit: inline_limit("x", 5, 1000),
                cost: 6,
            },
            "cost: 6 is above the limit 5",
        ),
        (
            pb::TryAcquireRequest {
                tenant: "acme".to_string(),
                limit: inline_limit("", 5, 1000),
                cost: 1,
            },
            "limit.inline.name: must not be empty",
        ),
    ];
    for (request, expected) in bad {
        let error = client.try_acquire(request).await.unwrap_err();
        assert_eq!(error.code(), tonic::Code::InvalidArgument);
        assert!(
            error.message().starts_with(expected),
            "expected {expected:?}, got {:?}",
            error.message()
        );
    }
    let error = client
        .put_rate_limit(pb::PutRateLimitRequest {
            resource: Some(pb::RateLimitResource {
                tenant: "acme".to_string(),
                resource_key: "k".to_string(),
                max_count: 5,
                window_seconds: 0,
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(error.message(), "resource.window_seconds: must be greater than 0");
    // Jobs get the same checks at enqueue.
    let mut admission = stack.admission_client().await?;
    let error = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(rate_job("acme", "api", 0, 1000, "bad")),
        })
        .await
        .unwrap_err();
    assert_eq!(error.message(), "limits[0].rate.inline.limit: must be greater than 0");
    stack.stop().await;
    Ok(())
}
