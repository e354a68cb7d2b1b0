//! Loads a partition's tickets and keys, and saves a batch's writes with a
//! handful of set-based statements (one `UNNEST` per kind of write).

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use sluice_common::owner::{OwnedStore, OwnerContext};
use sluice_common::telemetry::CompactTraceContext;
use sqlx::{PgConnection, Row};

use crate::state::{
    FloatingRecord, KeyId, KeyRecord, LimitPartition, LimitWrites, PartitionSettings, TicketKey, TicketRecord,
};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Builds the settings of a partition from the service's topology.
#[derive(Clone, Debug)]
pub struct Topology {
    pub limit_partitions: i32,
    pub grants_partitions: i32,
    pub refresh_due_topic: Arc<str>,
    pub refresh_due_partitions: i32,
    pub max_message_bytes: usize,
    pub ticket_grace_ms: i64,
    pub input: sluice_common::validate::InputLimits,
}

pub struct LimitStore {
    pub topology: Topology,
}

fn to_i32(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

fn to_u32(value: i32) -> u32 {
    u32::try_from(value).unwrap_or_default()
}

#[async_trait]
impl OwnedStore for LimitStore {
    type State = LimitPartition;

    async fn load(&self, connection: &mut PgConnection, context: &OwnerContext) -> Result<LimitPartition, sqlx::Error> {
        let topology = &self.topology;
        let mut partition = LimitPartition::new(
            PartitionSettings {
                partition: context.partition,
                limit_partitions: topology.limit_partitions,
                grants_partitions: topology.grants_partitions,
                refresh_due_topic: topology.refresh_due_topic.clone(),
                refresh_due_partitions: topology.refresh_due_partitions,
                max_message_bytes: topology.max_message_bytes,
                ticket_grace_ms: topology.ticket_grace_ms,
                input: topology.input,
            },
            context.epoch,
        );
        let key_rows = sqlx::query(
            "SELECT tenant, key, override_max, floating_max, floating_default_max, floating_refresh_interval_ms,
                    floating_metadata::text, floating_last_due_ms, floating_last_set_ms, floating_last_task_id
             FROM keys WHERE partition = $1",
        )
        .bind(context.partition)
        .fetch_all(&mut *connection)
        .await?;
        let mut keys: Vec<(KeyId, KeyRecord)> = Vec::with_capacity(key_rows.len());
        for row in key_rows {
            let floating_max: Option<i32> = row.try_get(3)?;
            let metadata_text: Option<String> = row.try_get(6)?;
            let floating = match floating_max {
                Some(current_max) => Some(FloatingRecord {
                    current_max: to_u32(current_max),
                    default_max: to_u32(row.try_get::<Option<i32>, _>(4)?.unwrap_or(current_max)),
                    refresh_interval_ms: u64::try_from(row.try_get::<Option<i64>, _>(5)?.unwrap_or_default())
                        .unwrap_or_default(),
                    metadata: metadata_text
                        .as_deref()
                        .and_then(|text| serde_json::from_str::<BTreeMap<String, String>>(text).ok())
                        .unwrap_or_default(),
                    last_due_ms: row.try_get(7)?,
                    last_set_ms: row.try_get(8)?,
                    last_task_id: row.try_get(9)?,
                }),
                None => None,
            };
            let override_max: Option<i32> = row.try_get(2)?;
            keys.push((
                (row.try_get(0)?, row.try_get(1)?),
                KeyRecord {
                    override_max: override_max.map(to_u32),
                    floating,
                },
            ));
        }
        let ticket_rows = sqlx::query(
            "SELECT job_id, attempt, step, tenant, key, held, priority, enqueued_at_us, job_max, floating,
                    waiting_since_ms, position_at_enqueue, granted_at_ms, traceparent, tracestate
             FROM tickets WHERE partition = $1",
        )
        .bind(context.partition)
        .fetch_all(&mut *connection)
        .await?;
        let mut tickets = Vec::with_capacity(ticket_rows.len());
        for row in ticket_rows {
            tickets.push(TicketRecord {
                ticket: TicketKey {
                    job_id: std::sync::Arc::from(row.try_get::<String, _>(0)?.as_str()),
                    attempt: to_u32(row.try_get(1)?),
                    step: to_u32(row.try_get(2)?),
                },
                key_id: std::sync::Arc::new((row.try_get(3)?, row.try_get(4)?)),
                held: row.try_get(5)?,
                priority: u32::try_from(row.try_get::<i16, _>(6)?).unwrap_or_default(),
                enqueued_at_us: row.try_get(7)?,
                job_max: to_u32(row.try_get(8)?),
                floating: row.try_get(9)?,
                waiting_since_ms: row.try_get(10)?,
                position_at_enqueue: to_u32(row.try_get(11)?),
                granted_at_ms: row.try_get(12)?,
                trace: CompactTraceContext::from_context(&sluice_proto::v1::TraceContext {
                    traceparent: row.try_get(13)?,
                    tracestate: row.try_get(14)?,
                }),
            });
        }
        partition.restore(context.clock.now_ms(), keys, tickets);
        Ok(partition)
    }

    async fn persist(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
        writes: LimitWrites,
    ) -> Result<(), sqlx::Error> {
        if !writes.deletes.is_empty() {
            let mut job_ids = Vec::with_capacity(writes.deletes.len());
            let mut attempts = Vec::with_capacity(writes.deletes.len());
            let mut steps = Vec::with_capacity(writes.deletes.len());
            for ticket in &writes.deletes {
                job_ids.push(ticket.job_id.to_string());
                attempts.push(to_i32(ticket.attempt));
                steps.push(to_i32(ticket.step));
            }
            sqlx::query(
                "DELETE FROM tickets AS t
                 USING UNNEST($1::text[], $2::integer[], $3::integer[]) AS d(job_id, attempt, step)
                 WHERE t.job_id = d.job_id AND t.attempt = d.attempt AND t.step = d.step",
            )
            .bind(job_ids)
            .bind(attempts)
            .bind(steps)
            .execute(&mut *connection)
            .await?;
        }
        if !writes.upserts.is_empty() {
            let count = writes.upserts.len();
            let mut job_ids = Vec::with_capacity(count);
            let mut attempts = Vec::with_capacity(count);
            let mut steps = Vec::with_capacity(count);
            let mut tenants = Vec::with_capacity(count);
            let mut keys = Vec::with_capacity(count);
            let mut held = Vec::with_capacity(count);
            let mut priorities = Vec::with_capacity(count);
            let mut enqueued = Vec::with_capacity(count);
            let mut job_maxes = Vec::with_capacity(count);
            let mut floating = Vec::with_capacity(count);
            let mut waiting_since = Vec::with_capacity(count);
            let mut positions = Vec::with_capacity(count);
            let mut granted_at: Vec<Option<i64>> = Vec::with_capacity(count);
            let mut traceparents = Vec::with_capacity(count);
            let mut tracestates = Vec::with_capacity(count);
            for record in writes.upserts.into_values() {
                job_ids.push(record.ticket.job_id.to_string());
                attempts.push(to_i32(record.ticket.attempt));
                steps.push(to_i32(record.ticket.step));
                tenants.push(record.tenant().to_string());
                keys.push(record.key().to_string());
                held.push(record.held);
                priorities.push(i16::try_from(record.priority).unwrap_or(i16::MAX));
                enqueued.push(record.enqueued_at_us);
                job_maxes.push(to_i32(record.job_max));
                floating.push(record.floating);
                waiting_since.push(record.waiting_since_ms);
                positions.push(to_i32(record.position_at_enqueue));
                granted_at.push(record.granted_at_ms);
                traceparents.push(record.trace.traceparent());
                tracestates.push(record.trace.tracestate().to_string());
            }
            sqlx::query(
                "INSERT INTO tickets (job_id, attempt, step, partition, tenant, key, held, priority, enqueued_at_us,
                                      job_max, floating, waiting_since_ms, position_at_enqueue, granted_at_ms,
                                      traceparent, tracestate)
                 SELECT u.job_id, u.attempt, u.step, $1, u.tenant, u.key, u.held, u.priority, u.enqueued_at_us,
                        u.job_max, u.floating, u.waiting_since_ms, u.position_at_enqueue, u.granted_at_ms,
                        u.traceparent, u.tracestate
                 FROM UNNEST($2::text[], $3::integer[], $4::integer[], $5::text[], $6::text[], $7::boolean[],
                             $8::smallint[], $9::bigint[], $10::integer[], $11::boolean[], $12::bigint[],
                             $13::integer[], $14::bigint[], $15::text[], $16::text[])
                      AS u(job_id, attempt, step, tenant, key, held, priority, enqueued_at_us, job_max, floating,
                           waiting_since_ms, position_at_enqueue, granted_at_ms, traceparent, tracestate)
                 ON CONFLICT (job_id, attempt, step) DO UPDATE
                    SET held = EXCLUDED.held, granted_at_ms = EXCLUDED.granted_at_ms",
            )
            .bind(context.partition)
            .bind(job_ids)
            .bind(attempts)
            .bind(steps)
            .bind(tenants)
            .bind(keys)
            .bind(held)
            .bind(priorities)
            .bind(enqueued)
            .bind(job_maxes)
            .bind(floating)
            .bind(waiting_since)
            .bind(positions)
            .bind(granted_at)
            .bind(traceparents)
            .bind(tracestates)
            .execute(&mut *connection)
            .await?;
        }
        for ((tenant, key), record) in writes.keys {
            match record {
                None => {
                    sqlx::query("DELETE FROM keys WHERE tenant = $1 AND key = $2")
                        .bind(&tenant)
                        .bind(&key)
                        .execute(&mut *connection)
                        .await?;
                }
                Some(record) => {
                    let floating = record.floating.as_ref();
                    let metadata = floating
                        .map(|floating| serde_json::to_string(&floating.metadata).unwrap_or_else(|_| "{}".to_string()));
                    sqlx::query(
                        "INSERT INTO keys (tenant, key, partition, override_max, floating_max, floating_default_max,
                                           floating_refresh_interval_ms, floating_metadata, floating_last_due_ms,
                                           floating_last_set_ms, floating_last_task_id)
                         VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10, $11)
                         ON CONFLICT (tenant, key) DO UPDATE SET
                            override_max = EXCLUDED.override_max, floating_max = EXCLUDED.floating_max,
                            floating_default_max = EXCLUDED.floating_default_max,
                            floating_refresh_interval_ms = EXCLUDED.floating_refresh_interval_ms,
                            floating_metadata = EXCLUDED.floating_metadata,
                            floating_last_due_ms = EXCLUDED.floating_last_due_ms,
                            floating_last_set_ms = EXCLUDED.floating_last_set_ms,
                            floating_last_task_id = EXCLUDED.floating_last_task_id,
                            updated_at = now()",
                    )
                    .bind(&tenant)
                    .bind(&key)
                    .bind(context.partition)
                    .bind(record.override_max.map(to_i32))
                    .bind(floating.map(|floating| to_i32(floating.current_max)))
                    .bind(floating.map(|floating| to_i32(floating.default_max)))
                    .bind(floating.map(|floating| i64::try_from(floating.refresh_interval_ms).unwrap_or(i64::MAX)))
                    .bind(metadata)
                    .bind(floating.and_then(|floating| floating.last_due_ms))
                    .bind(floating.and_then(|floating| floating.last_set_ms))
                    .bind(floating.and_then(|floating| floating.last_task_id.clone()))
                    .execute(&mut *connection)
                    .await?;
                }
            }
        }
        Ok(())
    }
}
