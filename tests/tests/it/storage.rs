//! PostgreSQL connections: TLS when the URL asks for it (managed PostgreSQL
//! services usually require it).

use sluice_common::config::Secret;
use sluice_e2e::*;

async fn connection_uses_tls(url: &str, schema: &str) -> anyhow::Result<bool> {
    let mut config = test_config("tls", &[])?;
    config.postgres.url = Secret::new(url);
    let pool = sluice_common::storage::connect(&config.postgres, schema).await?;
    let tls: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await?;
    let statement = format!("DROP SCHEMA IF EXISTS \"{schema}\"");
    sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&pool).await?;
    pool.close().await;
    Ok(tls)
}

#[tokio::test]
async fn postgres_connections_use_tls_when_the_url_requires_it() -> anyhow::Result<()> {
    let base = test_config("tls", &[])?;
    let admin = admin_pool(&base).await?;
    let server_tls: String = sqlx::query_scalar("SHOW ssl").fetch_one(&admin).await?;
    admin.close().await;
    if server_tls != "on" {
        eprintln!("skipped: this PostgreSQL server has ssl = {server_tls}");
        return Ok(());
    }
    let url = base.postgres.url.expose().to_string();
    let separator = if url.contains('?') { '&' } else { '?' };
    let schema = format!("{}tls", base.postgres.schema_prefix);
    assert!(
        connection_uses_tls(&format!("{url}{separator}sslmode=require"), &schema).await?,
        "sslmode=require gives a TLS connection"
    );
    assert!(
        !connection_uses_tls(&format!("{url}{separator}sslmode=disable"), &schema).await?,
        "sslmode=disable gives a plain one"
    );
    Ok(())
}

/// Admission's lookup of a batch of job ids in `job_outcomes` (each
/// enqueue batch makes one), run many times while the table was small,
/// still uses the index once the table holds many rows: a generic plan
/// cached from the small table would compare every row with every id.
#[tokio::test]
async fn a_lookup_run_on_a_small_table_uses_the_index_once_it_is_large() -> anyhow::Result<()> {
    let mut config = test_config("plans", &[])?;
    config.postgres.max_connections = 1;
    let schema = format!("{}plans", config.postgres.schema_prefix);
    let pool = sluice_common::storage::connect(&config.postgres, &schema).await?;
    sluice_common::storage::migrate(&pool, &schema, &sluice_admission::MIGRATOR).await?;
    let mut connection = pool.acquire().await?;
    let ended = "INSERT INTO job_outcomes (job_id, status, attempt, attempts_used, step, finished_at_ms)
                 SELECT 'ended-' || n, 4, 1, 1, 1, n FROM generate_series($1::bigint, $2::bigint) AS n";
    // The first few hundred jobs ended (a table of a few pages).
    sqlx::query(ended)
        .bind(1_i64)
        .bind(400_i64)
        .execute(&mut *connection)
        .await?;
    // Batches as large as an enqueue batch's, more often than the five
    // executions after which PostgreSQL may keep a generic plan.
    let batch: Vec<String> = (0..2000).map(|index| format!("job-{index}")).collect();
    for _ in 0..8 {
        let stored = sluice_admission::store::stored_jobs(&mut connection, &batch).await?;
        assert!(stored.is_empty());
    }
    sqlx::query(ended)
        .bind(401_i64)
        .bind(100_000_i64)
        .execute(&mut *connection)
        .await?;
    // Counted within one transaction: the scans of one lookup alone.
    let mut transaction = sqlx::Connection::begin(&mut *connection).await?;
    let scans = "SELECT seq_scan, COALESCE(idx_scan, 0) FROM pg_stat_xact_user_tables
                 WHERE relname = 'job_outcomes' AND schemaname = $1";
    let before: (i64, i64) = sqlx::query_as(scans).bind(&schema).fetch_one(&mut *transaction).await?;
    let stored = sluice_admission::store::stored_jobs(&mut transaction, &batch[..100]).await?;
    assert!(stored.is_empty());
    let after: (i64, i64) = sqlx::query_as(scans).bind(&schema).fetch_one(&mut *transaction).await?;
    let (seq_scans, index_scans) = (after.0 - before.0, after.1 - before.1);
    transaction.rollback().await?;
    drop(connection);
    let statement = format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE");
    sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&pool).await?;
    pool.close().await;
    assert_eq!(seq_scans, 0, "the lookup read the whole table instead of its index");
    assert!(index_scans >= 1, "the lookup used the index: {index_scans} index scans");
    Ok(())
}
