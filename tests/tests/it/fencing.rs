//! A stale owner's commit (old epoch) is refused.

use std::time::Duration;

use sluice_common::owner::{bump_epoch, commit_fenced, fence_and_advance, CommitError, FencedStatement};
use sluice_common::partition::key_partition;
use sluice_e2e::*;
use sluice_proto::v1 as pb;
use sqlx::Connection;

#[tokio::test]
async fn the_fence_refuses_an_older_owner_and_moves_the_offset_only_for_the_current_one() -> anyhow::Result<()> {
    init_logging();
    let config = test_config("epochunit", &[])?;
    let schema = config.schema("limit_grant");
    let pool = sluice_common::storage::connect(&config.postgres, &schema).await?;
    sluice_common::storage::migrate(&pool, &schema, &sluice_common::owner::MIGRATOR).await?;
    let mut connection = pool.acquire().await?;
    let (first_epoch, _) = bump_epoch(&mut connection, 3, "owner-a", "http://a").await?;
    let (second_epoch, _) = bump_epoch(&mut connection, 3, "owner-b", "http://b").await?;
    assert_eq!(second_epoch, first_epoch + 1);
    let applied = "SELECT applied_offset FROM owners WHERE partition = 3";

    let mut stale = connection.begin().await?;
    let refused = fence_and_advance(&mut stale, 3, first_epoch, Some(40)).await;
    assert!(
        matches!(refused, Err(CommitError::Fenced { ours, current, .. }) if ours == first_epoch && current == second_epoch),
        "{refused:?}"
    );
    stale.rollback().await?;
    let offset: i64 = sqlx::query_scalar(applied).fetch_one(&mut *connection).await?;
    assert_eq!(offset, -1, "a refused batch moves no offset");

    let mut current = connection.begin().await?;
    fence_and_advance(&mut current, 3, second_epoch, Some(40)).await?;
    current.commit().await?;
    // A batch without consumed input (a local call) and an older offset
    // leave the offset where it is.
    let mut current = connection.begin().await?;
    fence_and_advance(&mut current, 3, second_epoch, None).await?;
    fence_and_advance(&mut current, 3, second_epoch, Some(12)).await?;
    current.commit().await?;
    let offset: i64 = sqlx::query_scalar(applied).fetch_one(&mut *connection).await?;
    assert_eq!(offset, 40);
    Ok(())
}

/// A batch committed as one statement (no transaction) is fenced the same
/// way: none of a stale owner's writes is made, and it moves no offset.
#[tokio::test]
async fn a_batch_committed_as_one_statement_is_fenced_like_a_transaction() -> anyhow::Result<()> {
    init_logging();
    let config = test_config("epochjournal", &[])?;
    let schema = config.schema("limit_grant");
    let pool = sluice_common::storage::connect(&config.postgres, &schema).await?;
    sluice_common::storage::migrate(&pool, &schema, &sluice_common::owner::MIGRATOR).await?;
    sluice_common::storage::migrate(&pool, &schema, &sluice_limit_grant::store::MIGRATOR).await?;
    let mut connection = pool.acquire().await?;
    let (first_epoch, _) = bump_epoch(&mut connection, 5, "owner-a", "http://a").await?;
    let (second_epoch, _) = bump_epoch(&mut connection, 5, "owner-b", "http://b").await?;
    drop(connection);
    // Two writes per statement: each must be gated by the fence.
    let row = |seq: i64| {
        let mut statement = FencedStatement::default();
        statement.journal("ticket_journal", seq, vec![1, 2, 3]);
        statement.journal("ticket_journal", seq + 100, vec![4]);
        statement
    };
    let journal = "SELECT count(*) FROM ticket_journal WHERE partition = 5";
    let applied = "SELECT applied_offset FROM owners WHERE partition = 5";

    let refused = commit_fenced(&pool, 5, first_epoch, Some(40), row(1)).await;
    assert!(
        matches!(refused, Err(CommitError::Fenced { ours, current, .. }) if ours == first_epoch && current == second_epoch),
        "{refused:?}"
    );
    let rows: i64 = sqlx::query_scalar(journal).fetch_one(&pool).await?;
    assert_eq!(rows, 0, "a stale owner writes no row");
    let offset: i64 = sqlx::query_scalar(applied).fetch_one(&pool).await?;
    assert_eq!(offset, -1, "nor moves the offset");

    commit_fenced(&pool, 5, second_epoch, Some(40), row(1)).await?;
    commit_fenced(&pool, 5, second_epoch, None, row(2)).await?;
    let rows: i64 = sqlx::query_scalar(journal).fetch_one(&pool).await?;
    assert_eq!(rows, 4);
    let offset: i64 = sqlx::query_scalar(applied).fetch_one(&pool).await?;
    assert_eq!(offset, 40, "the current owner's rows go in and move the offset");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_owner_writes_nothing_and_the_partition_is_taken_over_again() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("fenced", &[])?, 1).await?;
    let schema = stack.config.schema("limit_grant");
    let partition = key_partition("acme", "fenced-key", stack.config.kafka.partitions.limit_commands);
    let epoch_query = format!("SELECT epoch FROM \"{schema}\".owners WHERE partition = $1");
    let epoch_before: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(epoch_query.clone()))
        .bind(partition)
        .fetch_one(&stack.pool)
        .await?;
    // Another owner takes the partition over behind the running one's back.
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{schema}\".owners SET epoch = epoch + 1, owner_id = 'intruder' WHERE partition = $1"
    )))
    .bind(partition)
    .execute(&stack.pool)
    .await?;

    let mut admission = stack.admission_client().await?;
    let job_id = admission
        .enqueue(pb::EnqueueRequest {
            job: Some(concurrency_job("acme", "fenced-key", 1, 0, "fenced")),
        })
        .await?
        .into_inner()
        .job_id;
    // The running owner decided the grant in memory, but its commit carried
    // the old epoch and was refused; it gave the partition up, took it over
    // again with a new epoch, reloaded and decided again.
    eventually(Duration::from_secs(30), "the job admitted", || {
        let mut admission = admission.clone();
        let job_id = job_id.clone();
        async move {
            let job = admission
                .get_job(pb::GetJobRequest { job_id })
                .await?
                .into_inner()
                .job
                .unwrap_or_default();
            Ok(job.status == pb::JobStatus::Admitted as i32)
        }
    })
    .await?;
    let epoch_after: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(epoch_query))
        .bind(partition)
        .fetch_one(&stack.pool)
        .await?;
    assert_eq!(
        epoch_after,
        epoch_before + 2,
        "intruder's bump, then the owner's re-takeover"
    );
    let tickets = stack
        .saved_tickets()
        .await?
        .into_iter()
        .filter(|ticket| ticket.key() == "fenced-key")
        .count();
    assert_eq!(tickets, 1, "one ticket: the refused commit wrote nothing");
    stack.stop().await;
    Ok(())
}
