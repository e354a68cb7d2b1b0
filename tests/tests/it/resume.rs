//! A service instance killed with SIGKILL stays a member of its consumer
//! group until its session times out, and only then does the group hand its
//! partitions to anyone. Started again on its address, it resumes them at
//! once (`PartitionTaskFactory::orphans`): the address is its identity in
//! the owner directory, and holding it proves the old process is gone.

use std::time::Duration;

use sluice_e2e::*;
use sluice_proto::v1 as pb;
use sluice_proto::v1::limits_client::LimitsClient;

/// The four limit partitions (test settings).
const PARTITIONS: i64 = 4;

/// limit-grant run as a process with a group session of a minute: killed,
/// then started again on the same port, it owns and serves every partition
/// it held well before the group could reassign them (the session of the
/// killed member has not expired when the test ends), and so does a third
/// start after the second is killed while it holds them provisionally.
/// Fails without the resume: the restarted member is assigned nothing until
/// then, and `DescribeKey` answers that the partition has no owner here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_instance_started_again_on_its_address_serves_its_partitions_before_the_group_reassigns_them(
) -> anyhow::Result<()> {
    init_logging();
    let overrides = [("kafka.session_timeout_ms", "60000")];
    let config = test_config("resume", &overrides)?;
    let prefix = config.kafka.topic_prefix.clone();
    let pool = admin_pool(&config).await?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let schema = config.schema("limit_grant");

    let mut first = ServiceProcess::start("limit-grant", &prefix, &overrides, port)?;
    let endpoint = first.endpoint.clone();
    let held = format!("SELECT count(*) FROM \"{schema}\".owners WHERE endpoint = $1 AND NOT released");
    eventually(
        Duration::from_secs(60),
        "the first process owns every partition",
        || async {
            let owned: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(held.clone()))
                .bind(&endpoint)
                .fetch_one(&pool)
                .await
                .unwrap_or(0);
            Ok(owned == PARTITIONS)
        },
    )
    .await?;
    let owners = format!("SELECT owner_id, max(epoch) FROM \"{schema}\".owners GROUP BY owner_id");
    let (killed_owner, killed_epoch): (String, i64) = sqlx::query_as(sqlx::AssertSqlSafe(owners.clone()))
        .fetch_one(&pool)
        .await?;
    first.kill()?;

    // Started again, then killed again while it holds the partitions
    // provisionally, then started a third time: each resumes them.
    let mut second = ServiceProcess::start("limit-grant", &prefix, &overrides, port)?;
    let second_epoch = resumed_by_another(&pool, &schema, &endpoint, &killed_owner, killed_epoch).await?;
    let (second_owner, _): (String, i64) = sqlx::query_as(sqlx::AssertSqlSafe(owners.clone()))
        .fetch_one(&pool)
        .await?;
    second.kill()?;
    let _third = ServiceProcess::start("limit-grant", &prefix, &overrides, port)?;
    resumed_by_another(&pool, &schema, &endpoint, &second_owner, second_epoch).await?;
    // It serves them: keys of every partition are described by their owner.
    let mut limits = LimitsClient::connect(endpoint.clone()).await?;
    for index in 0..16 {
        let described = limits
            .describe_key(pb::DescribeKeyRequest {
                key: Some(pb::KeyRef {
                    tenant: "acme".to_string(),
                    key: format!("resume-{index}"),
                }),
                ticket: None,
                first_waiters: 1,
            })
            .await;
        anyhow::ensure!(described.is_ok(), "key resume-{index}: {described:?}");
    }
    Ok(())
}

/// Waits until every partition's row names `endpoint` under an owner other
/// than `before` at an epoch above `before_epoch` (the group waits 60 s for
/// the killed member, so only a resume does this within 40 s); returns the
/// new owner's highest epoch.
async fn resumed_by_another(
    pool: &sqlx::PgPool,
    schema: &str,
    endpoint: &str,
    before: &str,
    before_epoch: i64,
) -> anyhow::Result<i64> {
    let taken = format!(
        "SELECT count(*), coalesce(max(epoch), 0) FROM \"{schema}\".owners
         WHERE endpoint = $1 AND owner_id <> $2 AND epoch > $3"
    );
    let epoch = std::sync::Mutex::new(0);
    eventually(
        Duration::from_secs(40),
        "the restarted process owns every partition (the group waits 60 s for the killed member)",
        || async {
            let (resumed, highest): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(taken.clone()))
                .bind(endpoint)
                .bind(before)
                .bind(before_epoch)
                .fetch_one(pool)
                .await
                .unwrap_or((0, 0));
            *epoch.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = highest;
            Ok(resumed == PARTITIONS)
        },
    )
    .await?;
    let highest = *epoch.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    Ok(highest)
}
