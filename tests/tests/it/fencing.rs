//! A stale owner's commit (old epoch) is refused, and so is its release of a
//! grant it does not know the job of.

use std::time::Duration;

use sluice_common::faults::FaultPoint;
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
    let (first_epoch, _) = bump_epoch(&mut connection, 3, "owner-a", "http://a", false).await?;
    let (second_epoch, _) = bump_epoch(&mut connection, 3, "owner-b", "http://b", false).await?;
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
    let (first_epoch, _) = bump_epoch(&mut connection, 5, "owner-a", "http://a", false).await?;
    let (second_epoch, _) = bump_epoch(&mut connection, 5, "owner-b", "http://b", false).await?;
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

/// A grant for a job an admission partition does not know is released only
/// by the partition's current owner. An instance that lost the partition
/// without knowing it yet (rebalances overlap) may be sent the grant of a job
/// that waits for it at the new owner: it must not give the slot back. Its
/// release is fenced like a commit, so it gives the partition up instead.
/// (Released unfenced, the job waited for its re-sent acquire, 30 s, with
/// its key free: a stall make chaos found.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_current_owner_releases_a_grant_of_a_job_it_does_not_know() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("unknowngrant", &[])?, 1).await?;
    stack.wait_owned(Duration::from_secs(60)).await?;
    let config = stack.config.clone();
    let job_id = "ghost-of-a-newer-owner";
    let job_partition = sluice_common::partition::job_partition(job_id, config.kafka.partitions.jobs);
    let schema = config.schema("admission");
    eventually(Duration::from_secs(60), "the job partition owned", || async {
        Ok(owner_epoch(&stack.pool, &schema, job_partition).await? > 0)
    })
    .await?;
    // Everything the owner had to commit since it took the partition (its
    // first commits after a takeover) is committed: the only commit of the
    // partition the row lock below can hold up is the release.
    stack.barrier().await?;
    // Another instance is taking the job partition over (its new epoch not
    // committed yet: the row stays locked, so the order below is fixed), and
    // the running one's check of its owner row misses it.
    stack.admissions[0]
        .faults
        .arm(FaultPoint::OwnerIdleFenceCheckMissed, 0, u64::MAX);
    let mut newer_owner = stack.pool.begin().await?;
    let newer_owner_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut *newer_owner)
        .await?;
    let newer_epoch: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{schema}\".owners SET epoch = epoch + 1, owner_id = 'newer-owner' WHERE partition = $1 RETURNING epoch"
    )))
    .bind(job_partition)
    .fetch_one(&mut *newer_owner)
    .await?;

    // The job's acquire (sent by the newer owner) is granted at once; the
    // grant reaches the running instance, which does not know the job.
    let key = "ghost-key";
    let acquire = acquire_command("acme", key, job_id, 1);
    publish_raw(
        &config,
        vec![sluice_common::kafka::OutMsg {
            topic: std::sync::Arc::from(config.topic(&config.topics.limit_commands)),
            partition: Some(key_partition("acme", key, config.kafka.partitions.limit_commands)),
            key: None,
            payload: prost::Message::encode_to_vec(&pb::LimitCommandBatch {
                commands: vec![acquire],
            }),
            headers: Vec::new(),
        }],
    )
    .await?;

    // limit-grant grants it (the ticket saved, held) ...
    eventually(Duration::from_secs(30), "the ghost job's ticket granted", || async {
        Ok(stack
            .saved_tickets()
            .await?
            .iter()
            .any(|ticket| &*ticket.ticket.job_id == job_id))
    })
    .await?;
    // ... its release waits for the owner row, as a commit does (unfenced,
    // it would have been sent at once and nothing would wait) ...
    let fence_waits = "SELECT count(*) FROM pg_stat_activity \
         WHERE $1 = ANY(pg_blocking_pids(pid)) AND query LIKE '%applied_offset = GREATEST%'";
    eventually(Duration::from_secs(30), "the release waiting for the owner row", || {
        let pool = stack.pool.clone();
        async move {
            let waiting: i64 = sqlx::query_scalar(fence_waits)
                .bind(newer_owner_pid)
                .fetch_one(&pool)
                .await?;
            Ok(waiting > 0)
        }
    })
    .await?;
    // ... so the ticket is still held ...
    let held: Vec<bool> = stack
        .saved_tickets()
        .await?
        .into_iter()
        .filter(|ticket| &*ticket.ticket.job_id == job_id)
        .map(|ticket| ticket.held)
        .collect();
    assert_eq!(held, vec![true], "the stale instance gave the grant back");
    // ... and once the newer owner's epoch is in, the release is refused:
    // the instance gives the partition up, and its consumer takes it over
    // again (its own newer epoch; the grant is then the current owner's to
    // release).
    newer_owner.commit().await?;
    eventually(Duration::from_secs(30), "the partition taken over again", || async {
        Ok(owner_epoch(&stack.pool, &schema, job_partition).await? > newer_epoch)
    })
    .await?;
    stack.stop().await;
    Ok(())
}

/// The epoch of `partition`'s owner row in `schema` (0: no row yet).
async fn owner_epoch(pool: &sqlx::PgPool, schema: &str, partition: i32) -> anyhow::Result<i64> {
    let epoch: Option<i64> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT epoch FROM \"{schema}\".owners WHERE partition = $1"
    )))
    .bind(partition)
    .fetch_optional(pool)
    .await?;
    Ok(epoch.unwrap_or(0))
}

/// A call for a partition is forwarded to the owner the directory names;
/// when the directory still names this instance, which no longer serves the
/// partition (it is giving it up), the caller is told to retry, not sent
/// "there".
#[tokio::test]
async fn a_call_is_forwarded_to_the_named_owner_and_never_back_to_this_instance() -> anyhow::Result<()> {
    let config = test_config("forwardself", &[])?;
    let schema = config.schema("limit_grant");
    let pool = sluice_common::storage::connect(&config.postgres, &schema).await?;
    sluice_common::storage::migrate(&pool, &schema, &sluice_common::owner::MIGRATOR).await?;
    let mut connection = pool.acquire().await?;
    bump_epoch(&mut connection, 2, "owner-other", "http://other:1", false).await?;
    let forwarded = sluice_common::forward::owner_endpoint(&pool, 2, false, "http://me:1").await;
    assert_eq!(forwarded.ok().as_deref(), Some("http://other:1"));
    let twice = sluice_common::forward::owner_endpoint(&pool, 2, true, "http://me:1")
        .await
        .unwrap_err();
    assert!(twice.message().contains("owned by http://other:1"), "{twice:?}");
    // Told apart: a forwarded call another instance serves goes back to the
    // instance that forwarded it at once (admission's `ask` returns it
    // without waiting), not "retry shortly" here.
    let route = sluice_common::forward::owner_route(&pool, 2, true, "http://me:1").await;
    assert!(
        matches!(&route, sluice_common::forward::OwnerRoute::OwnedElsewhere(status) if status.message().contains("owned by http://other:1")),
        "{route:?}"
    );
    bump_epoch(&mut connection, 2, "owner-me", "http://me:1", false).await?;
    let itself = sluice_common::forward::owner_endpoint(&pool, 2, false, "http://me:1")
        .await
        .unwrap_err();
    assert_eq!(itself.code(), tonic::Code::Unavailable);
    assert!(
        itself.message().contains("changing owners") && itself.message().contains("retry shortly"),
        "{itself:?}"
    );
    let route = sluice_common::forward::owner_route(&pool, 2, true, "http://me:1").await;
    assert!(
        matches!(route, sluice_common::forward::OwnerRoute::NotYet(_)),
        "{route:?}"
    );
    let unowned = sluice_common::forward::owner_endpoint(&pool, 3, false, "http://me:1")
        .await
        .unwrap_err();
    assert!(unowned.message().contains("no owner yet"), "{unowned:?}");
    Ok(())
}

/// The six jobs that ran twice (issue 29): a job's partition moved to a new
/// admission owner, whose `Claim` of the job was answered `CLAIMED`; the
/// worker ran it and sent `Complete` to the old instance, which had not
/// noticed yet that it was fenced (idle, between two checks of its owner
/// row). It answered from its memory — `STALE`, the job `ADMITTED` — without
/// a commit; the worker took the claim for lost, and the job ran again. An
/// owner answers only after a fenced commit: the fenced one answers nothing
/// (`UNAVAILABLE` at worst, which the worker retries) and the completion is
/// accepted by the owner that made the claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_owner_never_answers_from_its_memory() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("answerfenced", &[])?, 1).await?;
    stack.wait_owned(Duration::from_secs(60)).await?;
    let config = stack.config.clone();
    let schema = config.schema("admission");
    let admission = stack.admission_client().await?;
    let job_id = "claimed-by-the-newer-owner";
    let partition = sluice_common::partition::job_partition(job_id, config.kafka.partitions.jobs);
    let request = pb::JobRequest {
        tenant: "acme".to_string(),
        task_group: "default".to_string(),
        payload: b"run me once".to_vec(),
        ..Default::default()
    };
    enqueue_with_id(&admission, job_id, request).await?;
    let admitted = wait_status(&admission, job_id, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;

    // The running owner's checks of its owner row miss what follows: it
    // stays idle and believes it owns the partition.
    stack.admissions[0]
        .faults
        .arm(FaultPoint::OwnerIdleFenceCheckMissed, 0, u64::MAX);
    // A newer owner takes the partition over and commits a worker's claim
    // of the job: a journal row under its epoch, after the saved state.
    let now_ms = sluice_common::clock::wall_clock_ms();
    let mut newer_owner = stack.pool.begin().await?;
    let newer_epoch: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{schema}\".owners SET epoch = epoch + 1, owner_id = 'newer-owner', updated_at = now()
         WHERE partition = $1 RETURNING epoch"
    )))
    .bind(partition)
    .fetch_one(&mut *newer_owner)
    .await?;
    let last_seq: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT GREATEST(
            (SELECT max(seq) FROM \"{schema}\".job_journal WHERE partition = $1),
            (SELECT seq FROM \"{schema}\".job_snapshots WHERE partition = $1), 0)"
    )))
    .bind(partition)
    .fetch_one(&mut *newer_owner)
    .await?;
    let lease_ms = 30_000;
    let claim = sluice_admission::journal::JournalBatch {
        changes: vec![sluice_admission::journal::JobChange {
            job_id: job_id.to_string(),
            state: Some(sluice_admission::journal::JobDynamic {
                status: pb::JobStatus::Running as i32,
                attempt: 1,
                admitted_at_ms: admitted.admitted_at_ms,
                claimed_by: Some("worker-new".to_string()),
                claimed_at_ms: Some(now_ms),
                lease_expires_at_ms: Some(now_ms + lease_ms),
                due_at_ms: Some(now_ms + lease_ms),
                ..Default::default()
            }),
            ..Default::default()
        }],
    };
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO \"{schema}\".job_journal (partition, seq, epoch, entry) VALUES ($1, $2, $3, $4)"
    )))
    .bind(partition)
    .bind(last_seq + 1)
    .bind(newer_epoch)
    .bind(prost::Message::encode_to_vec(&claim))
    .execute(&mut *newer_owner)
    .await?;
    newer_owner.commit().await?;

    // The worker that won the claim completes the job through the instance
    // that was fenced. Every answer is the claim's owner's: ACCEPTED, never
    // STALE (UNAVAILABLE while the partition changes hands, retried).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let result = loop {
        let answer = complete_one(
            &admission,
            "worker-new",
            job_id,
            1,
            pb::completion::Outcome::Success(pb::Success {}),
        )
        .await;
        match answer {
            Ok(result) => break result,
            Err(error) => {
                let unavailable = error
                    .downcast_ref::<tonic::Status>()
                    .is_some_and(|status| status.code() == tonic::Code::Unavailable);
                anyhow::ensure!(unavailable, "Complete failed: {error:#}");
                anyhow::ensure!(
                    tokio::time::Instant::now() < deadline,
                    "Complete unavailable for a minute: {error:#}"
                );
            }
        }
    };
    assert_eq!(
        pb::CompleteOutcome::try_from(result.outcome),
        Ok(pb::CompleteOutcome::Accepted),
        "a fenced owner answered the completion from its memory: {result:?}"
    );
    wait_status(&admission, job_id, pb::JobStatus::Succeeded, Duration::from_secs(30)).await?;
    // Nobody can claim the attempt again.
    let again = claim_one(&admission, "worker-other", job_id, 1).await?;
    assert_ne!(again, pb::ClaimOutcome::Claimed as i32);
    stack.stop().await;
    Ok(())
}
