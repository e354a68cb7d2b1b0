//! PostgreSQL: one pool per service, pinned to the service's own schema with
//! `search_path`, and embedded sqlx migrations run under PostgreSQL's
//! migration lock (or by the `migrate` subcommand / Helm hook Job).

use std::str::FromStr;

use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

use crate::config::PostgresConfig;

#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("invalid postgres.url: {0}")]
    Url(#[source] sqlx::Error),
    #[error("cannot connect to PostgreSQL (schema {schema}): {source}")]
    Connect {
        schema: String,
        #[source]
        source: sqlx::Error,
    },
    #[error("migrating schema {schema} failed: {source}")]
    Migrate {
        schema: String,
        #[source]
        source: sqlx::migrate::MigrateError,
    },
    #[error("database error: {0}")]
    Sql(#[from] sqlx::Error),
}

/// A pool whose connections see `schema` first. Creates the schema if needed.
pub async fn connect(config: &PostgresConfig, schema: &str) -> Result<PgPool, StorageError> {
    let base = PgConnectOptions::from_str(config.url.expose()).map_err(StorageError::Url)?;
    create_schema(&base, schema).await?;
    let options = base.options([("search_path", schema)]);
    PgPoolOptions::new()
        .max_connections(config.max_connections)
        .acquire_timeout(config.acquire_timeout.0)
        .connect_with(options)
        .await
        .map_err(|source| StorageError::Connect {
            schema: schema.to_string(),
            source,
        })
}

async fn create_schema(base: &PgConnectOptions, schema: &str) -> Result<(), StorageError> {
    let mut connection = sqlx::PgConnection::connect_with(base)
        .await
        .map_err(|source| StorageError::Connect {
            schema: schema.to_string(),
            source,
        })?;
    // Two services starting together may race on the same schema; the loser
    // sees a unique violation and the schema exists either way.
    // `schema` is built from the validated `postgres.schema_prefix`.
    let statement = format!("CREATE SCHEMA IF NOT EXISTS \"{schema}\"");
    match sqlx::query(sqlx::AssertSqlSafe(statement))
        .execute(&mut connection)
        .await
    {
        Ok(_) => {}
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("23505") => {}
        Err(error) => return Err(error.into()),
    }
    connection.close().await.ok();
    Ok(())
}

/// Apply `migrator`'s migrations to the pool's schema. Migrators of different
/// crates share the schema's history table, so each ignores the others'.
pub async fn migrate(pool: &PgPool, schema: &str, migrator: &Migrator) -> Result<(), StorageError> {
    let mut migrator = Migrator {
        migrations: migrator.migrations.clone(),
        ..Migrator::DEFAULT
    };
    migrator.set_ignore_missing(true);
    migrator.run(pool).await.map_err(|source| StorageError::Migrate {
        schema: schema.to_string(),
        source,
    })
}

/// Drop every schema whose name starts with `prefix` (test cleanup helper).
pub async fn drop_schemas_with_prefix(pool: &PgPool, prefix: &str) -> Result<(), StorageError> {
    let schemas: Vec<String> =
        sqlx::query_scalar("SELECT nspname::text FROM pg_namespace WHERE starts_with(nspname, $1)")
            .bind(prefix)
            .fetch_all(pool)
            .await?;
    for schema in schemas {
        let statement = format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", schema.replace('"', ""));
        sqlx::query(sqlx::AssertSqlSafe(statement)).execute(pool).await?;
    }
    Ok(())
}
