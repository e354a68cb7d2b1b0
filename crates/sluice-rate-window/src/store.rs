//! Loads a rate-window partition and saves a batch's writes with set-based
//! statements.

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use sluice_common::owner::{OwnedStore, OwnerContext};
use sluice_proto::v1 as pb;
use sqlx::{PgConnection, Row};

use crate::state::{
    window_key, PartitionSettings, RatePartition, RateWrites, ResourceRecord, TicketKey, TicketRecord, WindowKey,
    WindowRecord,
};

pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

#[derive(Clone, Debug)]
pub struct Topology {
    pub rate_partitions: i32,
    pub grants_partitions: i32,
    pub max_message_bytes: usize,
    pub granted_retention_ms: i64,
    pub input: sluice_common::validate::InputLimits,
}

pub struct RateStore {
    pub topology: Topology,
}

fn to_u32(value: i32) -> u32 {
    u32::try_from(value).unwrap_or_default()
}

fn to_i32(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

fn key_of(
    tenant: String,
    name: Option<String>,
    unique_key: Option<String>,
    resource_key: Option<String>,
) -> pb::RateKeyRef {
    let kind = match resource_key {
        Some(resource_key) => pb::rate_key_ref::Kind::ResourceKey(resource_key),
        None => pb::rate_key_ref::Kind::Inline(pb::InlineKey {
            name: name.unwrap_or_default(),
            unique_key: unique_key.unwrap_or_default(),
        }),
    };
    pb::RateKeyRef {
        tenant,
        kind: Some(kind),
    }
}

#[async_trait]
impl OwnedStore for RateStore {
    type State = RatePartition;

    async fn load(&self, connection: &mut PgConnection, context: &OwnerContext) -> Result<RatePartition, sqlx::Error> {
        let now_ms = context.clock.now_ms();
        let topology = &self.topology;
        let mut partition = RatePartition::new(PartitionSettings {
            partition: context.partition,
            rate_partitions: topology.rate_partitions,
            grants_partitions: topology.grants_partitions,
            max_message_bytes: topology.max_message_bytes,
            granted_retention_ms: topology.granted_retention_ms,
            input: topology.input,
        });
        let resources = load_resources(connection, context.partition).await?;
        let windows = load_windows(connection, context.partition, now_ms).await?;
        let tickets = load_tickets(connection, context.partition).await?;
        partition.restore(now_ms, resources, windows, tickets);
        Ok(partition)
    }

    async fn persist(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
        writes: RateWrites,
    ) -> Result<(), sqlx::Error> {
        write_resources(connection, context.partition, &writes.resources).await?;
        write_windows(connection, context.partition, &writes.windows).await?;
        add_grant_units(connection, writes.grant_units).await?;
        prune_grant_units(connection, writes.prune_before).await?;
        delete_tickets(connection, &writes.ticket_deletes).await?;
        upsert_tickets(connection, context.partition, writes.ticket_upserts).await?;
        if let Some(cutoff) = writes.forget_granted_before {
            sqlx::query("DELETE FROM tickets WHERE partition = $1 AND granted AND granted_at_ms < $2")
                .bind(context.partition)
                .bind(cutoff)
                .execute(&mut *connection)
                .await?;
        }
        Ok(())
    }
}

/// Save resources set and removed.
/// The partition's stored resources (their max and window), by tenant and key.
async fn load_resources(
    connection: &mut PgConnection,
    partition: i32,
) -> Result<Vec<((String, String), ResourceRecord)>, sqlx::Error> {
    let resources: Vec<(String, String, i64, i64)> =
        sqlx::query_as("SELECT tenant, resource_key, max_count, window_seconds FROM resources WHERE partition = $1")
            .bind(partition)
            .fetch_all(&mut *connection)
            .await?;
    Ok(resources
        .into_iter()
        .map(|(tenant, resource_key, max_count, window_seconds)| {
            (
                (tenant, resource_key),
                ResourceRecord {
                    max_count,
                    window_seconds,
                },
            )
        })
        .collect())
}

/// The partition's windows, each with its grants still inside the window at `now_ms`.
async fn load_windows(
    connection: &mut PgConnection,
    partition: i32,
    now_ms: i64,
) -> Result<Vec<(WindowRecord, Vec<(i64, u64)>)>, sqlx::Error> {
    let window_rows = sqlx::query(
        "SELECT window_key, tenant, name, unique_key, resource_key, rate_limit, window_ms
         FROM windows WHERE partition = $1",
    )
    .bind(partition)
    .fetch_all(&mut *connection)
    .await?;
    let mut windows: HashMap<String, (WindowRecord, Vec<(i64, u64)>)> = HashMap::new();
    for row in window_rows {
        let stored: String = row.try_get(0)?;
        let record = WindowRecord {
            key: key_of(row.try_get(1)?, row.try_get(2)?, row.try_get(3)?, row.try_get(4)?),
            rate_limit: row.try_get(5)?,
            window_ms: row.try_get(6)?,
        };
        windows.insert(stored, (record, Vec::new()));
    }
    let grants: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT g.window_key, g.at_ms, g.units FROM window_grants g JOIN windows w USING (window_key)
         WHERE w.partition = $1 AND g.at_ms > $2 - w.window_ms ORDER BY g.window_key, g.at_ms",
    )
    .bind(partition)
    .bind(now_ms)
    .fetch_all(&mut *connection)
    .await?;
    for (stored, at_ms, units) in grants {
        if let Some((_, entries)) = windows.get_mut(&stored) {
            entries.push((at_ms, u64::try_from(units).unwrap_or_default()));
        }
    }
    Ok(windows.into_values().collect())
}

async fn load_tickets(connection: &mut PgConnection, partition: i32) -> Result<Vec<TicketRecord>, sqlx::Error> {
    let ticket_rows = sqlx::query(
        "SELECT job_id, attempt, step, window_key, granted, priority, enqueued_at_us, cost, waiting_since_ms,
                position_at_enqueue, granted_at_ms, unthrottled, traceparent, tracestate
         FROM tickets WHERE partition = $1",
    )
    .bind(partition)
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
            window_key: row.try_get(3)?,
            granted: row.try_get(4)?,
            priority: u32::try_from(row.try_get::<i16, _>(5)?).unwrap_or_default(),
            enqueued_at_us: row.try_get(6)?,
            cost: u64::try_from(row.try_get::<i64, _>(7)?).unwrap_or(1),
            waiting_since_ms: row.try_get(8)?,
            position_at_enqueue: to_u32(row.try_get(9)?),
            granted_at_ms: row.try_get(10)?,
            unthrottled: row.try_get(11)?,
            traceparent: row.try_get(12)?,
            tracestate: row.try_get(13)?,
        });
    }
    Ok(tickets)
}

async fn write_resources(
    connection: &mut PgConnection,
    partition: i32,
    resources: &HashMap<(String, String), Option<ResourceRecord>>,
) -> Result<(), sqlx::Error> {
    for ((tenant, resource_key), record) in resources {
        match record {
            Some(record) => {
                sqlx::query(
                    "INSERT INTO resources (tenant, resource_key, partition, max_count, window_seconds)
                     VALUES ($1, $2, $3, $4, $5)
                     ON CONFLICT (tenant, resource_key) DO UPDATE
                        SET max_count = EXCLUDED.max_count, window_seconds = EXCLUDED.window_seconds, updated_at = now()",
                )
                .bind(tenant)
                .bind(resource_key)
                .bind(partition)
                .bind(record.max_count)
                .bind(record.window_seconds)
                .execute(&mut *connection)
                .await?;
            }
            None => {
                sqlx::query("DELETE FROM resources WHERE tenant = $1 AND resource_key = $2")
                    .bind(tenant)
                    .bind(resource_key)
                    .execute(&mut *connection)
                    .await?;
            }
        }
    }
    Ok(())
}

/// Save windows set and removed (with their grant units).
async fn write_windows(
    connection: &mut PgConnection,
    partition: i32,
    windows: &HashMap<WindowKey, Option<WindowRecord>>,
) -> Result<(), sqlx::Error> {
    for (stored, record) in windows {
        match record {
            Some(record) => {
                let (name, unique_key, resource_key) = match &record.key.kind {
                    Some(pb::rate_key_ref::Kind::Inline(inline)) => {
                        (Some(inline.name.clone()), Some(inline.unique_key.clone()), None)
                    }
                    Some(pb::rate_key_ref::Kind::ResourceKey(resource_key)) => (None, None, Some(resource_key.clone())),
                    None => (None, None, None),
                };
                debug_assert_eq!(stored, &window_key(&record.key));
                sqlx::query(
                    "INSERT INTO windows (window_key, partition, tenant, name, unique_key, resource_key, rate_limit, window_ms)
                     VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
                     ON CONFLICT (window_key) DO UPDATE
                        SET rate_limit = EXCLUDED.rate_limit, window_ms = EXCLUDED.window_ms, updated_at = now()",
                )
                .bind(stored)
                .bind(partition)
                .bind(&record.key.tenant)
                .bind(name)
                .bind(unique_key)
                .bind(resource_key)
                .bind(record.rate_limit)
                .bind(record.window_ms)
                .execute(&mut *connection)
                .await?;
            }
            None => {
                sqlx::query("DELETE FROM window_grants WHERE window_key = $1")
                    .bind(stored)
                    .execute(&mut *connection)
                    .await?;
                sqlx::query("DELETE FROM windows WHERE window_key = $1")
                    .bind(stored)
                    .execute(&mut *connection)
                    .await?;
            }
        }
    }
    Ok(())
}

/// Add the units granted per window and instant.
async fn add_grant_units(
    connection: &mut PgConnection,
    grant_units: HashMap<(WindowKey, i64), u64>,
) -> Result<(), sqlx::Error> {
    if grant_units.is_empty() {
        return Ok(());
    }
    let mut keys = Vec::with_capacity(grant_units.len());
    let mut times = Vec::with_capacity(grant_units.len());
    let mut units = Vec::with_capacity(grant_units.len());
    for ((stored, at_ms), granted) in grant_units {
        keys.push(stored);
        times.push(at_ms);
        units.push(i64::try_from(granted).unwrap_or(i64::MAX));
    }
    sqlx::query(
        "INSERT INTO window_grants (window_key, at_ms, units)
         SELECT * FROM UNNEST($1::text[], $2::bigint[], $3::bigint[])
         ON CONFLICT (window_key, at_ms) DO UPDATE SET units = window_grants.units + EXCLUDED.units",
    )
    .bind(keys)
    .bind(times)
    .bind(units)
    .execute(&mut *connection)
    .await?;
    Ok(())
}

/// Forget grant units that slid out of their windows.
async fn prune_grant_units(
    connection: &mut PgConnection,
    prune_before: HashMap<WindowKey, i64>,
) -> Result<(), sqlx::Error> {
    if prune_before.is_empty() {
        return Ok(());
    }
    let (keys, cutoffs): (Vec<String>, Vec<i64>) = prune_before.into_iter().unzip();
    sqlx::query(
        "DELETE FROM window_grants AS g USING UNNEST($1::text[], $2::bigint[]) AS p(window_key, cutoff)
         WHERE g.window_key = p.window_key AND g.at_ms <= p.cutoff",
    )
    // Planned for these values each time (see admission's `stored_jobs`).
    .persistent(false)
    .bind(keys)
    .bind(cutoffs)
    .execute(&mut *connection)
    .await?;
    Ok(())
}

async fn delete_tickets(connection: &mut PgConnection, deletes: &HashSet<TicketKey>) -> Result<(), sqlx::Error> {
    if deletes.is_empty() {
        return Ok(());
    }
    let mut job_ids = Vec::new();
    let mut attempts = Vec::new();
    let mut steps = Vec::new();
    for ticket in deletes {
        job_ids.push(ticket.job_id.to_string());
        attempts.push(to_i32(ticket.attempt));
        steps.push(to_i32(ticket.step));
    }
    sqlx::query(
        "DELETE FROM tickets AS t USING UNNEST($1::text[], $2::integer[], $3::integer[]) AS d(job_id, attempt, step)
         WHERE t.job_id = d.job_id AND t.attempt = d.attempt AND t.step = d.step",
    )
    // Planned for these values each time (see admission's `stored_jobs`).
    .persistent(false)
    .bind(job_ids)
    .bind(attempts)
    .bind(steps)
    .execute(&mut *connection)
    .await?;
    Ok(())
}

async fn upsert_tickets(
    connection: &mut PgConnection,
    partition: i32,
    upserts: HashMap<TicketKey, TicketRecord>,
) -> Result<(), sqlx::Error> {
    if upserts.is_empty() {
        return Ok(());
    }
    let count = upserts.len();
    let mut job_ids = Vec::with_capacity(count);
    let mut attempts = Vec::with_capacity(count);
    let mut steps = Vec::with_capacity(count);
    let mut window_keys = Vec::with_capacity(count);
    let mut granted = Vec::with_capacity(count);
    let mut priorities = Vec::with_capacity(count);
    let mut enqueued = Vec::with_capacity(count);
    let mut costs = Vec::with_capacity(count);
    let mut waiting_since = Vec::with_capacity(count);
    let mut positions = Vec::with_capacity(count);
    let mut granted_at: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut unthrottled = Vec::with_capacity(count);
    let mut traceparents = Vec::with_capacity(count);
    let mut tracestates = Vec::with_capacity(count);
    for record in upserts.into_values() {
        job_ids.push(record.ticket.job_id.to_string());
        attempts.push(to_i32(record.ticket.attempt));
        steps.push(to_i32(record.ticket.step));
        window_keys.push(record.window_key);
        granted.push(record.granted);
        priorities.push(i16::try_from(record.priority).unwrap_or(i16::MAX));
        enqueued.push(record.enqueued_at_us);
        costs.push(i64::try_from(record.cost).unwrap_or(i64::MAX));
        waiting_since.push(record.waiting_since_ms);
        positions.push(to_i32(record.position_at_enqueue));
        granted_at.push(record.granted_at_ms);
        unthrottled.push(record.unthrottled);
        traceparents.push(record.traceparent);
        tracestates.push(record.tracestate);
    }
    sqlx::query(
        "INSERT INTO tickets (job_id, attempt, step, partition, window_key, granted, priority, enqueued_at_us, cost,
                              waiting_since_ms, position_at_enqueue, granted_at_ms, unthrottled, traceparent, tracestate)
         SELECT u.job_id, u.attempt, u.step, $1, u.window_key, u.granted, u.priority, u.enqueued_at_us, u.cost,
                u.waiting_since_ms, u.position_at_enqueue, u.granted_at_ms, u.unthrottled, u.traceparent, u.tracestate
         FROM UNNEST($2::text[], $3::integer[], $4::integer[], $5::text[], $6::boolean[], $7::smallint[], $8::bigint[],
                     $9::bigint[], $10::bigint[], $11::integer[], $12::bigint[], $13::boolean[], $14::text[], $15::text[])
              AS u(job_id, attempt, step, window_key, granted, priority, enqueued_at_us, cost, waiting_since_ms,
                   position_at_enqueue, granted_at_ms, unthrottled, traceparent, tracestate)
         ON CONFLICT (job_id, attempt, step) DO UPDATE
            SET granted = EXCLUDED.granted, granted_at_ms = EXCLUDED.granted_at_ms, unthrottled = EXCLUDED.unthrottled",
    )
    .bind(partition)
    .bind(job_ids)
    .bind(attempts)
    .bind(steps)
    .bind(window_keys)
    .bind(granted)
    .bind(priorities)
    .bind(enqueued)
    .bind(costs)
    .bind(waiting_since)
    .bind(positions)
    .bind(granted_at)
    .bind(unthrottled)
    .bind(traceparents)
    .bind(tracestates)
    .execute(&mut *connection)
    .await?;
    Ok(())
}
