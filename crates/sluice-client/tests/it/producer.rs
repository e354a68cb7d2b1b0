//! The producer: every limit kind from the builder reaches admission over
//! Kafka and over gRPC; enqueue answers ids, statuses and idempotency matches.

use std::time::Duration;

use sluice_client::{Error, FloatingLimit, InlineRate, JobBuilder, Producer, RetryPolicy};
use sluice_e2e::{test_config, Stack};
use sluice_proto::v1 as pb;

use crate::*;

fn every_kind(job_id: &str) -> sluice_client::Result<pb::JobRequest> {
    JobBuilder::new("acme", "default")
        .job_id(job_id)
        .priority(7)
        .payload(b"hello".to_vec())
        .concurrency("db", 3)
        .floating(
            FloatingLimit::new("gpu", 2)
                .refresh_every(Duration::from_secs(60))
                .metadata("pool", "a100"),
        )
        .rate(InlineRate::new("api", 100, Duration::from_secs(1)).unique_key("u1"))
        .rate_limit_key("stored")
        .retry(RetryPolicy::attempts(3).backoff(Duration::from_millis(200), Duration::from_secs(5)))
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_with_every_limit_kind_go_through_kafka_and_grpc() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("sdk_producer", &[])?, 1).await?;
    let producer = Producer::new(&client_options(&stack))?;

    // Over Kafka.
    let sent = producer.send(&every_kind("via-kafka")?).await?;
    assert!(sent.offset >= 0);
    // Over gRPC, one and a batch.
    let one = producer.enqueue(every_kind("via-grpc")?).await?;
    assert_eq!(one.job_id, "via-grpc");
    assert!(!one.deduplicated);
    let batch = producer
        .enqueue_batch(vec![every_kind("batch-1")?, every_kind("batch-2")?])
        .await?;
    assert_eq!(
        batch
            .iter()
            .map(|enqueued| enqueued.job_id.as_str())
            .collect::<Vec<_>>(),
        ["batch-1", "batch-2"]
    );

    let admission = stack.admission_client().await?;
    for job_id in ["via-kafka", "via-grpc", "batch-1"] {
        sluice_e2e::eventually(Duration::from_secs(30), "the job to be known", || async {
            Ok(producer.get_job(job_id).await.is_ok())
        })
        .await?;
        let view = sluice_e2e::job_view(&admission, job_id).await?;
        assert_eq!(view.priority, 7);
        assert_eq!(view.max_attempts, 3);
        assert_eq!(view.listed_limits.len(), 4, "{view:?}");
        let kinds: Vec<i32> = view.acquisition_order.iter().map(|step| step.kind).collect();
        assert!(kinds.contains(&(pb::LimitKind::Floating as i32)), "{kinds:?}");
        assert!(kinds.contains(&(pb::LimitKind::Rate as i32)), "{kinds:?}");
    }

    // An idempotency key inside its window returns the first job.
    let keyed = |payload: &str| {
        JobBuilder::new("acme", "default")
            .payload(payload.to_string())
            .idempotency("order-42", Duration::from_secs(3600))
            .build()
    };
    let first = producer.enqueue(keyed("first")?).await?;
    let again = producer.enqueue(keyed("again")?).await?;
    assert!(!first.deduplicated);
    assert!(again.deduplicated);
    assert_eq!(again.job_id, first.job_id);

    // Refused locally, naming the field; refused by admission, not retryable.
    match JobBuilder::new("acme", "default").priority(120).build() {
        Err(Error::InvalidRequest { field, .. }) => assert_eq!(field, "priority"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    let undeclared = JobBuilder::new("acme", "no-such-group").build()?;
    match producer.enqueue(undeclared).await {
        Err(error @ Error::Rpc { .. }) => {
            assert!(!error.is_retryable());
            assert!(error.to_string().contains("task_group"), "{error}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }

    // Cancel a waiting job through the producer.
    let status = producer.cancel_job("batch-2", "not needed").await?;
    assert!(
        [pb::JobStatus::Cancelled, pb::JobStatus::Cancelling].contains(&status),
        "{status:?}"
    );
    stack.stop().await;
    Ok(())
}
