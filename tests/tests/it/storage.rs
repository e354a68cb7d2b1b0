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
