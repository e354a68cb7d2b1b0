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

/// A member the group assigns a partition that its previous owner still
/// serves waits for that owner to give it up (the group can assign a
/// partition to a new member before the old one has let it go: tansu does,
/// for seconds, and fencing the live owner at once moved partitions there
/// and back). What it waits on: another member's row that moved recently
/// and is not released. Its own row, a released one or a still one is no
/// reason to wait.
#[tokio::test]
async fn only_a_live_owner_that_has_not_released_a_partition_holds_up_its_new_assignee() -> anyhow::Result<()> {
    use sluice_common::owner::live_other_owner;
    let stack = Stack::start(test_config("handover", &[])?, 1).await?;
    stack.wait_owned(Duration::from_secs(60)).await?;
    let pool = sluice_common::storage::connect(&stack.config.postgres, &stack.config.schema("admission")).await?;
    let (owner_id, endpoint): (String, String) =
        sqlx::query_as("SELECT owner_id, endpoint FROM owners WHERE partition = 0")
            .fetch_one(&pool)
            .await?;
    let alive_within = Duration::from_secs(5);
    // The owner touches its row every two seconds while it serves.
    assert_eq!(
        live_other_owner(&pool, 0, "another-member", alive_within)
            .await?
            .map(|(owner, _)| owner),
        Some(endpoint),
        "a live owner holds up a new assignee"
    );
    assert_eq!(
        live_other_owner(&pool, 0, &owner_id, alive_within).await?,
        None,
        "its own row"
    );
    assert_eq!(
        live_other_owner(&pool, 0, "another-member", Duration::ZERO).await?,
        None,
        "a row stiller than the threshold: its owner is gone"
    );
    sqlx::query("UPDATE owners SET released = true WHERE partition = 0")
        .execute(&pool)
        .await?;
    assert_eq!(
        live_other_owner(&pool, 0, "another-member", alive_within).await?,
        None,
        "a released partition"
    );
    Ok(())
}
