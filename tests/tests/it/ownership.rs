//! Ownership moves only when the group moves a partition or its owner is
//! gone: two members that both believe they hold the same partitions (an
//! overlapping rebalance; here, for as long as the test runs, two consumer
//! groups) do not take them from each other back and forth.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_common::{Faults, Shutdown, SluiceConfig};
use sluice_e2e::*;
use sluice_proto::v1 as pb;

/// (partition → epoch) of `service`'s owner rows.
async fn epochs(stack: &Stack, service: &str) -> anyhow::Result<BTreeMap<i32, i64>> {
    let rows: Vec<(i32, i64)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT partition, epoch FROM \"{}\".owners ORDER BY partition",
        stack.config.schema(service)
    )))
    .fetch_all(&stack.pool)
    .await?;
    Ok(rows.into_iter().collect())
}

/// Which endpoints own `service`'s partitions.
async fn owners(stack: &Stack, service: &str) -> anyhow::Result<Vec<String>> {
    Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT DISTINCT endpoint FROM \"{}\".owners",
        stack.config.schema(service)
    )))
    .fetch_all(&stack.pool)
    .await?)
}

/// A second admission instance in a consumer group of its own is assigned
/// every job partition the first one holds, for good. It takes them over
/// once; the first, fenced, stands by instead of taking them back (before,
/// each took them from the other every few seconds, each time reloading
/// and sending its callers elsewhere). A minute of jobs later no epoch has
/// moved, and every job ran once under its limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_members_holding_the_same_partitions_do_not_take_them_back_and_forth() -> anyhow::Result<()> {
    let mut stack = Stack::start(test_config("nopingpong", &[])?, 1).await?;
    stack.wait_owned(Duration::from_secs(60)).await?;
    let first = stack.admissions[0].endpoint.clone();
    let mut split: SluiceConfig = (*stack.config).clone();
    split.admission.consumer_group = format!("{}-split", split.admission.consumer_group);
    let second = start_admission(&Arc::new(split), Faults::none()).await?;
    let second_endpoint = second.endpoint.clone();
    stack.admissions.push(second);
    eventually(
        Duration::from_secs(60),
        "the second instance owns every job partition",
        || async { Ok(owners(&stack, "admission").await? == vec![second_endpoint.clone()]) },
    )
    .await?;
    wait_serving(&second_endpoint, Duration::from_secs(60)).await?;
    let settled = epochs(&stack, "admission").await?;

    // A minute of work through the first instance (its calls go to the
    // owner): 120 one-second jobs on a key of limit 2.
    let stop = Shutdown::new();
    let recorder = Arc::new(Recorder::default());
    let options = WorkerOptions {
        worker_id: "steady".to_string(),
        task_group: "default".to_string(),
        group: format!("{}workers", stack.config.kafka.topic_prefix),
        concurrency: 4,
        min_run: Duration::from_millis(1_000),
        max_run: Duration::from_millis(1_000),
    };
    tokio::spawn(run_worker(
        stack.config.clone(),
        first.clone(),
        options,
        recorder.clone(),
        stop.clone(),
    ));
    let admission = sluice_proto::v1::admission_client::AdmissionClient::new(connect(&first).await?);
    for index in 0..120 {
        enqueue_with_id(
            &admission,
            &format!("steady-{index:03}"),
            concurrency_job("acme", "steady", 2, 0, "x"),
        )
        .await?;
    }
    eventually(Duration::from_secs(300), "120 completions", || async {
        Ok(recorder.completed() == 120)
    })
    .await?;
    stop.trigger();
    assert_eq!(
        epochs(&stack, "admission").await?,
        settled,
        "a job partition changed owners while both members held on"
    );
    assert_eq!(owners(&stack, "admission").await?, vec![second_endpoint]);
    let runs = recorder.runs();
    assert_eq!(runs.len(), 120, "every job ran once");
    let runs: Vec<&RunRecord> = runs.iter().collect();
    assert!(max_overlap(&runs) <= 2, "the key's limit of 2 was overrun");
    let view = job_view(&admission, "steady-000").await?;
    assert_eq!(view.status, pb::JobStatus::Succeeded as i32);
    stack.stop().await;
    Ok(())
}
