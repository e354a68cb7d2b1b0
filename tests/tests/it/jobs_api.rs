//! Cancel, idempotency keys and bad input, over gRPC and Kafka.

use std::time::Duration;

use prost::Message as _;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_removes_a_waiter_and_a_running_job_keeps_its_ticket_until_confirmed() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("cancel", &[])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let [running, waiting, next] = ["running", "waiting", "next"].map(|name| format!("{prefix}{name}"));
    enqueue_with_id(&admission, &running, concurrency_job("acme", "cancel-key", 1, 0, "r")).await?;
    wait_status(&admission, &running, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    // The waiter arrives over Kafka.
    let mut over_kafka = concurrency_job("acme", "cancel-key", 1, 0, "w");
    over_kafka.job_id = Some(waiting.clone());
    RequestProducer::new(&stack.config)?.send(&[over_kafka]).await?;
    enqueue_with_id(&admission, &next, concurrency_job("acme", "cancel-key", 1, 0, "n")).await?;
    eventually(Duration::from_secs(30), "two waiters", || async {
        Ok(key_state(&stack, "acme", "cancel-key").await?.waiting == 2)
    })
    .await?;

    let mut client = admission.clone();
    let cancelled = client
        .cancel_job(pb::CancelJobRequest {
            job_id: waiting.clone(),
            reason: "not needed".to_string(),
        })
        .await?
        .into_inner();
    assert_eq!(cancelled.status, pb::JobStatus::Cancelled as i32);
    eventually(Duration::from_secs(10), "the waiter left the queue", || async {
        Ok(key_state(&stack, "acme", "cancel-key").await?.waiting == 1)
    })
    .await?;
    assert!(job_view(&admission, &waiting).await?.reason.contains("not needed"));

    // A running job: the worker learns by heartbeat; the ticket stays until it confirms.
    assert_eq!(
        claim_one(&admission, "w", &running, 1).await?,
        pb::ClaimOutcome::Claimed as i32
    );
    let cancelling = client
        .cancel_job(pb::CancelJobRequest {
            job_id: running.clone(),
            reason: String::new(),
        })
        .await?
        .into_inner();
    assert_eq!(cancelling.status, pb::JobStatus::Cancelling as i32);
    assert_eq!(
        heartbeat_one(&admission, "w", &running, 1).await?,
        pb::HeartbeatOutcome::Cancelled as i32
    );
    // Everything before is applied: a release the cancel sent would have
    // reached limit-grant, and a grant to `next` come back.
    stack.barrier().await?;
    assert_eq!(
        job_view(&admission, &next).await?.status,
        pb::JobStatus::Waiting as i32,
        "running work never exceeds the limit: the ticket is still held"
    );
    let confirmed = complete_one(
        &admission,
        "w",
        &running,
        1,
        pb::completion::Outcome::Success(pb::Success {}),
    )
    .await?;
    assert_eq!(confirmed.status, pb::JobStatus::Cancelled as i32);
    wait_status(&admission, &next, pb::JobStatus::Admitted, Duration::from_secs(10)).await?;
    assert_eq!(
        claim_one(&admission, "w2", &waiting, 1).await?,
        pb::ClaimOutcome::Stale as i32,
        "a cancelled job cannot be claimed"
    );
    stack.stop().await;
    Ok(())
}

fn keyed(key: &str, window: &str, payload: &str) -> pb::JobRequest {
    let mut request = concurrency_job("acme", "idem-key", 100, 0, payload);
    request.idempotency_key = key.to_string();
    request.idempotency_window = window.to_string();
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_keys_deduplicate_within_their_window_over_grpc_and_kafka() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("idempotency", &[])?, 1).await?;
    let mut admission = stack.admission_client().await?;
    let first = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(keyed("order-1", "1h", "first")),
        })
        .await?
        .into_inner();
    assert!(!first.deduplicated);
    let second = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(keyed("order-1", "1h", "second")),
        })
        .await?
        .into_inner();
    assert!(second.deduplicated);
    assert_eq!(second.job_id, first.job_id);
    // The same key in another tenant is another key.
    let mut other_tenant = keyed("order-1", "1h", "other");
    other_tenant.tenant = "globex".to_string();
    let other = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(other_tenant),
        })
        .await?
        .into_inner();
    assert!(!other.deduplicated);

    // Over Kafka: two requests with one key make one job, and a later gRPC
    // request with the key gets that job, deduplicated.
    let producer = RequestProducer::new(&stack.config)?;
    producer
        .send(&[keyed("order-2", "1h", "kafka-a"), keyed("order-2", "1h", "kafka-b")])
        .await?;
    let jobs_with_key = format!(
        "SELECT job_id FROM \"{}\".jobs WHERE idempotency_key = 'order-2'",
        stack.config.schema("admission")
    );
    eventually(Duration::from_secs(30), "the Kafka requests processed", || async {
        let rows: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(jobs_with_key.clone()))
            .fetch_all(&stack.pool)
            .await?;
        Ok(!rows.is_empty())
    })
    .await?;
    // Both Kafka requests are handed over and saved.
    stack.barrier().await?;
    let order_two: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(jobs_with_key))
        .fetch_all(&stack.pool)
        .await?;
    assert_eq!(order_two.len(), 1, "two Kafka requests with one key make one job");
    let over_grpc = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(keyed("order-2", "1h", "grpc")),
        })
        .await?
        .into_inner();
    assert!(over_grpc.deduplicated);
    assert_eq!(over_grpc.job_id, order_two[0]);

    // After the window the key can be used again, and not before: enqueue
    // until a request is not deduplicated, then check when that was.
    let before_short = std::time::Instant::now();
    let short = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(keyed("order-3", "1s", "short")),
        })
        .await?
        .into_inner();
    let within = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(keyed("order-3", "1s", "within")),
        })
        .await?
        .into_inner();
    assert!(within.deduplicated);
    let deadline = before_short + Duration::from_secs(30);
    let after = loop {
        let answer = admission
            .enqueue(pb::EnqueueRequest {
                job: Some(keyed("order-3", "1s", "after")),
            })
            .await?
            .into_inner();
        if !answer.deduplicated {
            break answer;
        }
        assert_eq!(answer.job_id, short.job_id, "deduplicated to the first job");
        assert!(std::time::Instant::now() < deadline, "the 1s window never passed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // The window runs from the first job's commit, on admission's clock
    // (monotonic, whole milliseconds): at least 1 s after `before_short`.
    let reused_after = before_short.elapsed();
    assert!(
        reused_after >= Duration::from_millis(999),
        "the key was free again {reused_after:?} after the first request, within its 1s window"
    );
    assert_ne!(after.job_id, short.job_id);
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_naming_the_field_over_grpc_and_dead_lettered_over_kafka() -> anyhow::Result<()> {
    let stack = Stack::start(
        test_config(
            "badinput",
            &[
                ("admission.max_payload_bytes", "64"),
                ("kafka.partitions.requested", "1"),
            ],
        )?,
        1,
    )
    .await?;
    let mut admission = stack.admission_client().await?;
    let good = || concurrency_job("acme", "k", 1, 0, "ok");
    let cases: Vec<(pb::JobRequest, &str)> = vec![
        (
            concurrency_job("acme", "", 1, 0, "x"),
            "limits[0].concurrency.key: must not be empty",
        ),
        (
            concurrency_job("acme", "k", 0, 0, "x"),
            "limits[0].concurrency.max_concurrency: must be at least 1",
        ),
        (
            pb::JobRequest {
                tenant: String::new(),
                ..good()
            },
            "tenant: must not be empty",
        ),
        (
            pb::JobRequest {
                payload: vec![7; 65],
                ..good()
            },
            "payload: 65 bytes is over the limit of 64 bytes",
        ),
        (
            pb::JobRequest {
                priority: Some(100),
                ..good()
            },
            "priority: must be 0 (most urgent) to 99",
        ),
        (
            pb::JobRequest {
                idempotency_key: "k".to_string(),
                idempotency_window: "ten minutes".to_string(),
                ..good()
            },
            "idempotency_window: malformed duration",
        ),
        (
            pb::JobRequest {
                retry: Some(pb::RetryPolicy {
                    max_attempts: 3,
                    initial_backoff: "fast".to_string(),
                    ..Default::default()
                }),
                ..good()
            },
            "retry.initial_backoff: malformed duration",
        ),
        (
            pb::JobRequest {
                task_group: "nope".to_string(),
                ..good()
            },
            "task_group: undeclared task group",
        ),
    ];
    for (request, expected) in &cases {
        let error = admission
            .enqueue(pb::EnqueueRequest {
                job: Some(request.clone()),
            })
            .await
            .unwrap_err();
        assert_eq!(error.code(), tonic::Code::InvalidArgument, "{expected}");
        assert!(
            error.message().starts_with(expected),
            "expected {expected:?}, got {:?}",
            error.message()
        );
    }
    // The same requests over Kafka are dead-lettered with the same reasons,
    // and nothing else is lost: the valid one after them is admitted.
    let producer = RequestProducer::new(&stack.config)?;
    let mut messages: Vec<RawRequest> = cases
        .iter()
        .map(|(request, _)| RawRequest {
            partition: None,
            payload: request.encode_to_vec(),
            ..Default::default()
        })
        .collect();
    messages.push(RawRequest {
        partition: None,
        payload: good().encode_to_vec(),
        ..Default::default()
    });
    producer.send_messages(messages).await?;
    let reasons = read_dead_letters(&stack, cases.len()).await?;
    for ((_, expected), reason) in cases.iter().zip(&reasons) {
        assert!(reason.starts_with(expected), "expected {expected:?}, got {reason:?}");
    }
    eventually(Duration::from_secs(30), "the valid job admitted", || async {
        Ok(stack.job_statuses().await?.get(&(pb::JobStatus::Admitted as i16)) == Some(&1))
    })
    .await?;
    stack.stop().await;
    Ok(())
}

/// Read `count` dead letters' reasons, in order.
pub async fn read_dead_letters(stack: &Stack, count: usize) -> anyhow::Result<Vec<String>> {
    use rdkafka::consumer::{Consumer, StreamConsumer};
    use rdkafka::message::{Headers, Message};
    let mut settings = sluice_common::kafka::client_config(&stack.config.kafka);
    settings
        .set("group.id", format!("{}dlq-reader", stack.config.kafka.topic_prefix))
        .set("auto.offset.reset", "earliest");
    let consumer: StreamConsumer = settings.create()?;
    consumer.subscribe(&[&stack.config.topic(&stack.config.topics.deadletter)])?;
    let mut reasons = Vec::new();
    while reasons.len() < count {
        let message = tokio::time::timeout(Duration::from_secs(30), consumer.recv()).await??;
        let reason = message
            .headers()
            .and_then(|headers| {
                headers
                    .iter()
                    .find(|header| header.key == "sluice-deadletter-reason")
                    .and_then(|header| header.value)
                    .map(|value| String::from_utf8_lossy(value).to_string())
            })
            .unwrap_or_default();
        reasons.push(reason);
    }
    Ok(reasons)
}
