//! Loads a refresh-dispatcher partition and saves a batch's writes.

use std::collections::BTreeMap;

use async_trait::async_trait;
use sluice_common::owner::{OwnedStore, OwnerContext};
use sluice_proto::v1 as pb;
use sqlx::{PgConnection, Row};

use crate::schedule::{InFlight, LastRefresh, Schedule};
use crate::state::{PartitionSettings, RefreshPartition, RefreshWrites};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

pub struct RefreshStore {
    /// Settings of every partition; `partition` is filled in at load.
    pub settings: PartitionSettings,
}

fn to_u32(value: i64) -> u32 {
    u32::try_from(value.max(0)).unwrap_or(u32::MAX)
}

const COLUMNS: &str = "tenant, key, current_max, current_max_at_ms, default_max, refresh_interval_ms, metadata::text,
     last_due_at_ms, in_flight_task_id, in_flight_attempt, in_flight_issued_at_ms, in_flight_deadline_ms,
     retry_count, retry_at_ms, last_refresh_at_ms, last_refresh_value, last_refresh_outcome, last_refresh_error,
     last_error, applied_task_id, applied_max, traceparent, tracestate";

fn schedule_from_row(row: &sqlx::postgres::PgRow) -> Result<((String, String), Schedule), sqlx::Error> {
    let metadata_text: String = row.try_get(6)?;
    // The column is written by this crate from a string map; anything else
    // is treated as no metadata rather than stopping the partition.
    let metadata: BTreeMap<String, String> = serde_json::from_str(&metadata_text).unwrap_or_default();
    let in_flight = match row.try_get::<Option<String>, _>(8)? {
        Some(task_id) => Some(InFlight {
            task_id,
            attempt: u32::try_from(row.try_get::<Option<i32>, _>(9)?.unwrap_or(1)).unwrap_or(1),
            issued_at_ms: row.try_get::<Option<i64>, _>(10)?.unwrap_or_default(),
            deadline_ms: row.try_get::<Option<i64>, _>(11)?.unwrap_or_default(),
        }),
        None => None,
    };
    let last_refresh = match row.try_get::<Option<i64>, _>(14)? {
        Some(at_ms) => Some(LastRefresh {
            at_ms,
            value: row.try_get::<Option<i64>, _>(15)?.unwrap_or_default(),
            outcome: pb::RefreshOutcome::try_from(i32::from(row.try_get::<Option<i16>, _>(16)?.unwrap_or_default()))
                .unwrap_or(pb::RefreshOutcome::Unspecified),
            error: row.try_get::<Option<String>, _>(17)?.unwrap_or_default(),
        }),
        None => None,
    };
    let applied = match (
        row.try_get::<Option<String>, _>(19)?,
        row.try_get::<Option<i64>, _>(20)?,
    ) {
        (Some(task_id), Some(max)) => Some((task_id, to_u32(max))),
        _ => None,
    };
    let schedule = Schedule {
        current_max: to_u32(row.try_get(2)?),
        current_max_at_ms: row.try_get(3)?,
        default_max: to_u32(row.try_get(4)?),
        refresh_interval_ms: u64::try_from(row.try_get::<i64, _>(5)?).unwrap_or_default(),
        metadata,
        last_due_at_ms: row.try_get(7)?,
        in_flight,
        retry_count: u32::try_from(row.try_get::<i32, _>(12)?).unwrap_or_default(),
        retry_at_ms: row.try_get(13)?,
        last_refresh,
        last_error: row.try_get(18)?,
        applied,
        traceparent: row.try_get(21)?,
        tracestate: row.try_get(22)?,
    };
    Ok(((row.try_get(0)?, row.try_get(1)?), schedule))
}

#[async_trait]
impl OwnedStore for RefreshStore {
    type State = RefreshPartition;

    async fn load(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
    ) -> Result<RefreshPartition, sqlx::Error> {
        let settings = PartitionSettings {
            partition: context.partition,
            ..self.settings.clone()
        };
        let mut partition = RefreshPartition::new(settings, context.epoch);
        let query = format!("SELECT {COLUMNS} FROM schedules WHERE partition = $1");
        let rows = sqlx::query(sqlx::AssertSqlSafe(query))
            .bind(context.partition)
            .fetch_all(&mut *connection)
            .await?;
        let schedules = rows.iter().map(schedule_from_row).collect::<Result<Vec<_>, _>>()?;
        tracing::debug!(
            partition = context.partition,
            schedules = schedules.len(),
            "refresh schedules loaded"
        );
        partition.restore(schedules);
        Ok(partition)
    }

    async fn persist(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
        writes: RefreshWrites,
    ) -> Result<(), sqlx::Error> {
        for (tenant, key) in &writes.deletes {
            sqlx::query("DELETE FROM schedules WHERE tenant = $1 AND key = $2")
                .bind(tenant)
                .bind(key)
                .execute(&mut *connection)
                .await?;
        }
        for ((tenant, key), schedule) in &writes.upserts {
            let metadata = serde_json::to_string(&schedule.metadata).unwrap_or_else(|_| "{}".to_string());
            let in_flight = schedule.in_flight.as_ref();
            let last = schedule.last_refresh.as_ref();
            sqlx::query(
                "INSERT INTO schedules (tenant, key, partition, current_max, current_max_at_ms, default_max,
                     refresh_interval_ms, metadata, last_due_at_ms, in_flight_task_id, in_flight_attempt,
                     in_flight_issued_at_ms, in_flight_deadline_ms, retry_count, retry_at_ms, last_refresh_at_ms,
                     last_refresh_value, last_refresh_outcome, last_refresh_error, last_error, applied_task_id,
                     applied_max, traceparent, tracestate)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18,
                     $19, $20, $21, $22, $23, $24)
                 ON CONFLICT (tenant, key) DO UPDATE SET
                     partition = EXCLUDED.partition, current_max = EXCLUDED.current_max,
                     current_max_at_ms = EXCLUDED.current_max_at_ms, default_max = EXCLUDED.default_max,
                     refresh_interval_ms = EXCLUDED.refresh_interval_ms, metadata = EXCLUDED.metadata,
                     last_due_at_ms = EXCLUDED.last_due_at_ms, in_flight_task_id = EXCLUDED.in_flight_task_id,
                     in_flight_attempt = EXCLUDED.in_flight_attempt,
                     in_flight_issued_at_ms = EXCLUDED.in_flight_issued_at_ms,
                     in_flight_deadline_ms = EXCLUDED.in_flight_deadline_ms, retry_count = EXCLUDED.retry_count,
                     retry_at_ms = EXCLUDED.retry_at_ms, last_refresh_at_ms = EXCLUDED.last_refresh_at_ms,
                     last_refresh_value = EXCLUDED.last_refresh_value,
                     last_refresh_outcome = EXCLUDED.last_refresh_outcome,
                     last_refresh_error = EXCLUDED.last_refresh_error, last_error = EXCLUDED.last_error,
                     applied_task_id = EXCLUDED.applied_task_id, applied_max = EXCLUDED.applied_max,
                     traceparent = EXCLUDED.traceparent, tracestate = EXCLUDED.tracestate, updated_at = now()",
            )
            .bind(tenant)
            .bind(key)
            .bind(context.partition)
            .bind(i64::from(schedule.current_max))
            .bind(schedule.current_max_at_ms)
            .bind(i64::from(schedule.default_max))
            .bind(i64::try_from(schedule.refresh_interval_ms).unwrap_or(i64::MAX))
            .bind(metadata)
            .bind(schedule.last_due_at_ms)
            .bind(in_flight.map(|task| task.task_id.clone()))
            .bind(in_flight.map(|task| i32::try_from(task.attempt).unwrap_or(i32::MAX)))
            .bind(in_flight.map(|task| task.issued_at_ms))
            .bind(in_flight.map(|task| task.deadline_ms))
            .bind(i32::try_from(schedule.retry_count).unwrap_or(i32::MAX))
            .bind(schedule.retry_at_ms)
            .bind(last.map(|last| last.at_ms))
            .bind(last.map(|last| last.value))
            .bind(last.map(|last| i16::try_from(last.outcome as i32).unwrap_or_default()))
            .bind(last.map(|last| last.error.clone()))
            .bind(&schedule.last_error)
            .bind(schedule.applied.as_ref().map(|(task_id, _)| task_id.clone()))
            .bind(schedule.applied.as_ref().map(|(_, max)| i64::from(*max)))
            .bind(&schedule.traceparent)
            .bind(&schedule.tracestate)
            .execute(&mut *connection)
            .await?;
        }
        Ok(())
    }
}
