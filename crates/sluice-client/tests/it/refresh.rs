//! The refresh handler round trip: a floating key's refresh task reaches the
//! worker's handler, its answer is reported, and the key's max changes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use sluice_client::{FloatingLimit, JobBuilder, Producer, RefreshError, Worker};
use sluice_e2e::{key_state, test_config, Stack};
use sluice_proto::v1 as pb;

use crate::*;

const NEW_MAX: u32 = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_refresh_handler_sets_a_floating_keys_max() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("sdk_refresh", &[])?, 1).await?;
    let runs = Runs::default();
    let tasks: Arc<Mutex<Vec<pb::RefreshTask>>> = Arc::default();
    let handler = {
        let runs = runs.clone();
        move |job: sluice_client::Job| {
            let runs = runs.clone();
            async move {
                let guard = RunGuard::start(&runs, "worker", &job);
                tokio::time::sleep(Duration::from_millis(millis_of(job.payload()))).await;
                guard.finished();
                Ok(())
            }
        }
    };
    let refresh_handler = {
        let tasks = tasks.clone();
        move |task: pb::RefreshTask| {
            let tasks = tasks.clone();
            async move {
                tasks.lock().unwrap().push(task);
                Ok::<u32, RefreshError>(NEW_MAX)
            }
        }
    };
    let worker = RunningWorker::start(
        Worker::builder(client_options(&stack), handler)
            .task_group("default")
            .worker_id("refresh-worker")
            .concurrency(8)
            .refresh_handler(refresh_handler)
            .build()?,
    );
    wait_assigned(&[&worker], usize::try_from(stack.config.kafka.partitions.admitted)?).await?;
    let producer = Producer::new(&client_options(&stack))?;

    // Default max 1: the first job holds the key, the others wait, which
    // makes a refresh due.
    let requests = (0..8)
        .map(|index| {
            JobBuilder::new("acme", "default")
                .job_id(format!("gpu-{index}"))
                .payload("gpu/2000")
                .floating(
                    FloatingLimit::new("gpu", 1)
                        .refresh_every(Duration::from_millis(200))
                        .metadata("pool", "a100"),
                )
                .build()
        })
        .collect::<Result<Vec<_>, _>>()?;
    let job_ids: Vec<String> = producer
        .enqueue_batch(requests)
        .await?
        .into_iter()
        .map(|enqueued| enqueued.job_id)
        .collect();

    sluice_e2e::eventually(Duration::from_secs(30), "the key's max to become 5", || async {
        Ok(key_state(&stack, "acme", "gpu").await?.floating_max == Some(NEW_MAX))
    })
    .await?;
    wait_all_status(&stack, &job_ids, pb::JobStatus::Succeeded, Duration::from_secs(60)).await?;

    let seen = tasks.lock().unwrap().clone();
    let first = seen.first().expect("a refresh task reached the handler");
    let mut refresh = stack.refresh_client().await?;
    let described = refresh
        .describe_floating_limit(pb::DescribeFloatingLimitRequest {
            key: Some(pb::KeyRef {
                tenant: "acme".to_string(),
                key: "gpu".to_string(),
            }),
        })
        .await?
        .into_inner();
    let state = key_state(&stack, "acme", "gpu").await?;
    let all = runs.all();
    println!(
        "{} refresh task(s), first {first:?}; key {state:?}; described {described:?}; peak running {}",
        seen.len(),
        max_overlap(&all)
    );
    assert_eq!(first.key.as_ref().map(|key| key.key.as_str()), Some("gpu"));
    assert_eq!(first.current_max, 1);
    assert_eq!(first.metadata.get("pool").map(String::as_str), Some("a100"));
    assert_eq!(state.floating_max, Some(NEW_MAX));
    let last = described.last_refresh.expect("a refresh was recorded");
    assert_eq!(last.value, i64::from(NEW_MAX));
    assert_eq!(last.outcome, pb::RefreshOutcome::Succeeded as i32);
    assert!(worker.status.snapshot().refreshes_reported >= 1);
    // The new max is in force: jobs ran side by side, never above it.
    let peak = max_overlap(&all);
    assert!((2..=NEW_MAX as usize).contains(&peak), "peak {peak}");

    worker.stop().await;
    assert_eq!(stack.tickets_left().await?, 0);
    stack.stop().await;
    Ok(())
}
