//! Ownership in PostgreSQL: fencing epochs, the owner directory, commits
//! fenced by the epoch, and the quarantine table.

use std::time::Duration;

use sqlx::{PgConnection, PgPool};

use super::Rejected;
use crate::fault::clean_text;

type PgQuery = sqlx::query::Query<'static, sqlx::Postgres, sqlx::postgres::PgArguments>;

/// Writes committed with the fence in one statement
/// (`OwnedStore::one_statement`, `commit_fenced`): data-modifying CTEs that
/// each select from `fence`, the owners row updated only while the
/// partition's epoch is still ours. In their SQL, `$1` is the partition and
/// `$3` the epoch; values of their own are added with `param`.
pub struct FencedStatement {
    ctes: String,
    writes: usize,
    parameters: usize,
    binds: Vec<Box<dyn FnOnce(PgQuery) -> PgQuery + Send>>,
}

impl Default for FencedStatement {
    fn default() -> Self {
        FencedStatement {
            ctes: String::new(),
            writes: 0,
            // $1 partition, $2 applied offset, $3 epoch.
            parameters: 3,
            binds: Vec::new(),
        }
    }
}

impl FencedStatement {
    /// Bind `value`; returns its placeholder (`$4`, `$5`, …).
    pub fn param<T>(&mut self, value: T) -> String
    where
        T: for<'q> sqlx::Encode<'q, sqlx::Postgres> + sqlx::Type<sqlx::Postgres> + Send + 'static,
    {
        self.parameters += 1;
        self.binds.push(Box::new(move |query: PgQuery| query.bind(value)));
        format!("${}", self.parameters)
    }

    /// Add a data-modifying statement; it must read `FROM fence` so that it
    /// writes nothing when the epoch has moved on.
    pub fn write(&mut self, statement: &str) {
        use std::fmt::Write as _;
        self.writes += 1;
        let _ = write!(self.ctes, ", write{} AS ({statement})", self.writes);
    }

    /// A journal row: `table` has the columns (partition, seq, epoch, entry).
    pub fn journal(&mut self, table: &str, seq: i64, entry: Vec<u8>) {
        let seq = self.param(seq);
        let entry = self.param(entry);
        self.write(&format!(
            "INSERT INTO {table} (partition, seq, epoch, entry) SELECT $1, {seq}, $3, {entry} FROM fence"
        ));
    }
}

/// Commit `statement` fenced by `epoch`: the owners row is updated (applied
/// offset) and the writes made only while the partition's epoch is still
/// ours, atomically, under the owners row's lock like `fence_and_advance` in
/// a transaction.
pub async fn commit_fenced(
    pool: &PgPool,
    partition: i32,
    epoch: i64,
    new_offset: Option<i64>,
    statement: FencedStatement,
) -> Result<(), CommitError> {
    let sql = format!(
        "WITH fence AS (
            UPDATE owners SET applied_offset = GREATEST(applied_offset, $2), updated_at = now()
            WHERE partition = $1 AND epoch = $3 RETURNING epoch){}
         SELECT count(*) FROM fence",
        statement.ctes
    );
    let mut query: PgQuery = sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(partition)
        .bind(new_offset)
        .bind(epoch);
    for bind in statement.binds {
        query = bind(query);
    }
    let fenced_rows: i64 = sqlx::Row::try_get(&query.fetch_one(pool).await?, 0)?;
    if fenced_rows == 1 {
        return Ok(());
    }
    let current = lookup_owner(pool, partition).await?.map_or(-1, |(_, current)| current);
    Err(CommitError::Fenced {
        partition,
        ours: epoch,
        current,
    })
}

#[derive(Debug, thiserror::Error)]
pub enum CommitError {
    #[error("fenced: partition {partition} now belongs to epoch {current} (ours {ours})")]
    Fenced { partition: i32, ours: i64, current: i64 },
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Take over `partition`: bump its epoch and record the owner directory row.
/// Waits for an old owner's in-flight commit (it holds the row lock).
/// `provisional`: the owner resumed the partition ahead of the group
/// (`PartitionInput::provisional`); any member the group assigns it to takes
/// it at once, as from an owner that released it.
pub async fn bump_epoch(
    connection: &mut PgConnection,
    partition: i32,
    owner_id: &str,
    endpoint: &str,
    provisional: bool,
) -> Result<(i64, i64), sqlx::Error> {
    let row: (i64, i64) = sqlx::query_as(
        "INSERT INTO owners (partition, epoch, owner_id, endpoint, provisional) VALUES ($1, 1, $2, $3, $4)
         ON CONFLICT (partition) DO UPDATE
            SET epoch = owners.epoch + 1, owner_id = EXCLUDED.owner_id, endpoint = EXCLUDED.endpoint,
                owned_since = now(), updated_at = now(), released = false, provisional = EXCLUDED.provisional
         RETURNING epoch, applied_offset",
    )
    .bind(partition)
    .bind(owner_id)
    .bind(endpoint)
    .bind(provisional)
    .fetch_one(connection)
    .await?;
    Ok(row)
}

/// The partitions an earlier process at `endpoint` owned and did not give
/// up (no release; provisionally held ones included): it died, since this
/// process (`owner_id`) now serves that endpoint. With the last offset each
/// had applied.
pub async fn orphaned_partitions(
    pool: &PgPool,
    endpoint: &str,
    owner_id: &str,
) -> Result<Vec<(i32, i64)>, sqlx::Error> {
    sqlx::query_as(
        "SELECT partition, applied_offset FROM owners
         WHERE endpoint = $1 AND owner_id <> $2 AND NOT released ORDER BY partition",
    )
    .bind(endpoint)
    .bind(owner_id)
    .fetch_all(pool)
    .await
}

/// Inside a batch transaction, first: lock the partition's row, move its
/// applied offset to `new_offset` (when the batch consumed input), and refuse
/// if another owner has bumped the epoch since we took over (the caller then
/// rolls back, offset included). One statement, so a batch pays one round
/// trip for its fence.
pub async fn fence_and_advance(
    connection: &mut PgConnection,
    partition: i32,
    epoch: i64,
    new_offset: Option<i64>,
) -> Result<(), CommitError> {
    let current: Option<i64> = sqlx::query_scalar(
        "UPDATE owners SET applied_offset = GREATEST(applied_offset, $2), updated_at = now()
         WHERE partition = $1 RETURNING epoch",
    )
    .bind(partition)
    .bind(new_offset)
    .fetch_optional(&mut *connection)
    .await?;
    match current {
        Some(current) if current == epoch => Ok(()),
        Some(current) => Err(CommitError::Fenced {
            partition,
            ours: epoch,
            current,
        }),
        None => Err(CommitError::Fenced {
            partition,
            ours: epoch,
            current: -1,
        }),
    }
}

/// The owner directory: who owns a partition now.
pub async fn lookup_owner(pool: &PgPool, partition: i32) -> Result<Option<(String, i64)>, sqlx::Error> {
    sqlx::query_as("SELECT endpoint, epoch FROM owners WHERE partition = $1")
        .bind(partition)
        .fetch_optional(pool)
        .await
}

/// Why the owner of `partition` let it go, if it did: it released it, or
/// its row has not moved for `silent_after`. `None`: it holds it.
pub async fn owner_let_go(
    pool: &PgPool,
    partition: i32,
    silent_after: Duration,
) -> Result<Option<String>, sqlx::Error> {
    let silent_ms = i64::try_from(silent_after.as_millis()).unwrap_or(i64::MAX);
    let row: Option<(bool, i64)> = sqlx::query_as(
        "SELECT released OR provisional, (extract(epoch FROM now() - updated_at) * 1000)::bigint
         FROM owners WHERE partition = $1",
    )
    .bind(partition)
    .fetch_optional(pool)
    .await?;
    Ok(match row {
        None => Some("no owner".to_string()),
        Some((true, _)) => Some("its owner released it (or held it provisionally)".to_string()),
        Some((false, silent_for_ms)) if silent_for_ms >= silent_ms => {
            Some(format!("its owner has been silent for {silent_for_ms} ms"))
        }
        Some(_) => None,
    })
}

/// Another owner that still holds `partition` and is alive (its row moved
/// within `silent_after`, it did not release it and does not hold it
/// provisionally): its endpoint and how
/// long its row has been still. `None`: no other owner holds it, or the
/// one that did is gone.
pub async fn live_other_owner(
    pool: &PgPool,
    partition: i32,
    owner_id: &str,
    silent_after: Duration,
) -> Result<Option<(String, i64)>, sqlx::Error> {
    let silent_ms = i64::try_from(silent_after.as_millis()).unwrap_or(i64::MAX);
    let row: Option<(String, String, bool, i64)> = sqlx::query_as(
        "SELECT owner_id, endpoint, released OR provisional, (extract(epoch FROM now() - updated_at) * 1000)::bigint
         FROM owners WHERE partition = $1",
    )
    .bind(partition)
    .fetch_optional(pool)
    .await?;
    Ok(row.and_then(|(owner, endpoint, released, still_ms)| {
        (owner != owner_id && !released && still_ms < silent_ms).then_some((endpoint, still_ms))
    }))
}

/// Mark `partition` released by the owner of `epoch` (given up in order):
/// a member standing by for it takes it at once. Best effort: a member
/// otherwise takes it once the row has been silent long enough.
pub(super) async fn release(pool: &PgPool, partition: i32, epoch: i64) {
    let released = sqlx::query("UPDATE owners SET released = true WHERE partition = $1 AND epoch = $2")
        .bind(partition)
        .bind(epoch)
        .execute(pool)
        .await;
    if let Err(error) = released {
        tracing::debug!(partition, %error, "marking the partition released failed");
    }
}

/// Set input aside: its bytes and the reason, in the service's `quarantine`
/// table (inside the caller's transaction).
pub async fn insert_quarantined(
    connection: &mut PgConnection,
    topic: &str,
    partition: i32,
    rejected: &[Rejected],
) -> Result<(), sqlx::Error> {
    if rejected.is_empty() {
        return Ok(());
    }
    let offsets: Vec<i64> = rejected.iter().map(|entry| entry.offset).collect();
    let entries: Vec<&[u8]> = rejected.iter().map(|entry| entry.entry.as_slice()).collect();
    let reasons: Vec<String> = rejected
        .iter()
        .map(|entry| clean_text(&entry.reason, crate::validate::MAX_TEXT_BYTES))
        .collect();
    sqlx::query(
        "INSERT INTO quarantine (topic, partition, input_offset, entry, reason)
         SELECT $1, $2, u.input_offset, u.entry, u.reason
         FROM UNNEST($3::bigint[], $4::bytea[], $5::text[]) AS u(input_offset, entry, reason)",
    )
    .bind(clean_text(topic, 1024))
    .bind(partition)
    .bind(offsets)
    .bind(entries)
    .bind(reasons)
    .execute(connection)
    .await?;
    Ok(())
}

/// Log and count input that was set aside (once it is durable).
pub fn report_quarantined(service: &'static str, topic: &str, partition: i32, rejected: &[Rejected]) {
    for entry in rejected {
        tracing::error!(
            service,
            topic,
            partition,
            offset = entry.offset,
            bytes = entry.entry.len(),
            reason = %clean_text(&entry.reason, 2048),
            "input set aside in the quarantine table: it can never be applied"
        );
    }
    if !rejected.is_empty() {
        crate::metrics::metrics().quarantined.add(
            u64::try_from(rejected.len()).unwrap_or(u64::MAX),
            &[opentelemetry::KeyValue::new("service", service)],
        );
    }
}
