//! Loads a partition's tickets and keys, and saves a batch's writes: the
//! ticket changes as one journal row (or a snapshot, see `journal.rs`), key
//! settings as rows.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use prost::Message as _;
use sluice_common::core::Owned;
use sluice_common::owner::{FencedStatement, OwnedStore, OwnerContext};
use sluice_common::telemetry::CompactTraceContext;
use sluice_proto::v1 as pb;
use sqlx::{PgConnection, Row};

use crate::core::adaptive::{Adaptive, StoredAdaptive};
pub use crate::core::image::SavedTickets;
use crate::core::journal::{TicketBatch, TicketSnapshot};
use crate::core::{
    FloatingRecord, KeyId, KeyRecord, LimitPartition, LimitWrites, PartitionSettings, TicketKey, TicketRecord,
};
use crate::observe::LimitEffector;

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

impl Topology {
    /// The settings of `partition`.
    pub fn settings(&self, partition: i32) -> PartitionSettings {
        PartitionSettings {
            partition,
            limit_partitions: self.limit_partitions,
            grants_partitions: self.grants_partitions,
            refresh_due_topic: self.refresh_due_topic.clone(),
            refresh_due_partitions: self.refresh_due_partitions,
            max_message_bytes: self.max_message_bytes,
            ticket_grace_ms: self.ticket_grace_ms,
            input: self.input,
        }
    }
}

#[async_trait]
impl OwnedStore for LimitStore {
    type State = Owned<LimitPartition>;

    async fn load(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
    ) -> Result<Owned<LimitPartition>, sqlx::Error> {
        let keys = load_keys(&mut *connection, context.partition).await?;
        let saved = load_tickets(&mut *connection, context.partition).await?;
        tracing::debug!(
            partition = context.partition,
            tickets = saved.tickets.len(),
            journal_seq = saved.journal_seq,
            snapshot_bytes = ?saved.snapshot_bytes,
            journal_bytes = saved.journal_bytes,
            "tickets loaded from the snapshot and the journal"
        );
        let partition = LimitPartition::loaded(
            self.topology.settings(context.partition),
            context.epoch,
            context.clock.now_ms(),
            keys,
            saved,
        );
        let effector = LimitEffector {
            partition: context.partition,
        };
        Ok(Owned::new(partition, Arc::new(effector)))
    }

    fn one_statement(&self, writes: &LimitWrites) -> Option<FencedStatement> {
        let (seq, batch) = writes.journal.as_ref()?;
        if !writes.keys.is_empty() || writes.snapshot.is_some() {
            return None;
        }
        let mut statement = FencedStatement::default();
        statement.journal("ticket_journal", *seq, batch.encode_to_vec());
        Some(statement)
    }

    async fn persist(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
        writes: LimitWrites,
    ) -> Result<(), sqlx::Error> {
        if let Some((seq, batch)) = &writes.journal {
            sqlx::query("INSERT INTO ticket_journal (partition, seq, epoch, entry) VALUES ($1, $2, $3, $4)")
                .bind(context.partition)
                .bind(seq)
                .bind(context.epoch)
                .bind(batch.encode_to_vec())
                .execute(&mut *connection)
                .await?;
        }
        if let Some((seq, snapshot)) = &writes.snapshot {
            save_snapshot(connection, context, *seq, snapshot).await?;
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
                Some(record) => write_key(connection, context.partition, &tenant, &key, &record).await?,
            }
        }
        Ok(())
    }
}

/// `partition`'s key settings.
async fn load_keys(connection: &mut PgConnection, partition: i32) -> Result<Vec<(KeyId, KeyRecord)>, sqlx::Error> {
    let key_rows = sqlx::query(
        "SELECT tenant, key, override_max, floating_max, floating_default_max, floating_refresh_interval_ms,
                    floating_metadata::text, floating_last_due_ms, floating_last_set_ms, floating_last_task_id,
                    flow_weights::text, mode, adaptive
             FROM keys WHERE partition = $1",
    )
    .bind(partition)
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
        let weights_text: String = row.try_get(10)?;
        let flow_weights = serde_json::from_str::<BTreeMap<String, u32>>(&weights_text)
            .map_err(|error| sqlx::Error::Decode(Box::new(error)))?;
        keys.push((
            (row.try_get(0)?, row.try_get(1)?),
            KeyRecord {
                override_max: override_max.map(to_u32),
                floating,
                flow_weights,
                mode: row
                    .try_get::<Option<i16>, _>(11)?
                    .and_then(|mode| pb::LimitMode::try_from(i32::from(mode)).ok()),
                adaptive: row
                    .try_get::<Option<Vec<u8>>, _>(12)?
                    .map(|bytes| StoredAdaptive::decode(bytes.as_slice()))
                    .transpose()
                    .map_err(|error| sqlx::Error::Decode(Box::new(error)))?
                    .map(Adaptive::from_stored),
            },
        ));
    }
    Ok(keys)
}

/// Save the partition's ticket snapshot at journal position `seq`, and
/// forget the journal up to it.
async fn save_snapshot(
    connection: &mut PgConnection,
    context: &OwnerContext,
    seq: i64,
    snapshot: &TicketSnapshot,
) -> Result<(), sqlx::Error> {
    sqlx::query(
        "INSERT INTO ticket_snapshots (partition, seq, epoch, state) VALUES ($1, $2, $3, $4)
         ON CONFLICT (partition) DO UPDATE SET seq = EXCLUDED.seq, epoch = EXCLUDED.epoch,
                                             state = EXCLUDED.state",
    )
    .bind(context.partition)
    .bind(seq)
    .bind(context.epoch)
    .bind(snapshot.encode_to_vec())
    .execute(&mut *connection)
    .await?;
    sqlx::query("DELETE FROM ticket_journal WHERE partition = $1 AND seq <= $2")
        .bind(context.partition)
        .bind(seq)
        .execute(&mut *connection)
        .await?;
    // Tickets saved as rows before the journal: the first snapshot
    // holds them now.
    sqlx::query("DELETE FROM tickets WHERE partition = $1")
        .bind(context.partition)
        .execute(&mut *connection)
        .await?;
    Ok(())
}

/// Save a key's settings (its limits' state lives in the tickets).
async fn write_key(
    connection: &mut PgConnection,
    partition: i32,
    tenant: &str,
    key: &str,
    record: &KeyRecord,
) -> Result<(), sqlx::Error> {
    let floating = record.floating.as_ref();
    let metadata =
        floating.map(|floating| serde_json::to_string(&floating.metadata).unwrap_or_else(|_| "{}".to_string()));
    let flow_weights = serde_json::to_string(&record.flow_weights).unwrap_or_else(|_| "{}".to_string());
    sqlx::query(
        "INSERT INTO keys (tenant, key, partition, override_max, floating_max, floating_default_max,
                           floating_refresh_interval_ms, floating_metadata, floating_last_due_ms,
                           floating_last_set_ms, floating_last_task_id, flow_weights, mode, adaptive)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8::jsonb, $9, $10, $11, $12::jsonb, $13, $14)
         ON CONFLICT (tenant, key) DO UPDATE SET
            override_max = EXCLUDED.override_max, floating_max = EXCLUDED.floating_max,
            floating_default_max = EXCLUDED.floating_default_max,
            floating_refresh_interval_ms = EXCLUDED.floating_refresh_interval_ms,
            floating_metadata = EXCLUDED.floating_metadata,
            floating_last_due_ms = EXCLUDED.floating_last_due_ms,
            floating_last_set_ms = EXCLUDED.floating_last_set_ms,
            floating_last_task_id = EXCLUDED.floating_last_task_id,
            flow_weights = EXCLUDED.flow_weights, mode = EXCLUDED.mode,
            adaptive = EXCLUDED.adaptive,
            updated_at = now()",
    )
    .bind(tenant)
    .bind(key)
    .bind(partition)
    .bind(record.override_max.map(to_i32))
    .bind(floating.map(|floating| to_i32(floating.current_max)))
    .bind(floating.map(|floating| to_i32(floating.default_max)))
    .bind(floating.map(|floating| i64::try_from(floating.refresh_interval_ms).unwrap_or(i64::MAX)))
    .bind(metadata)
    .bind(floating.and_then(|floating| floating.last_due_ms))
    .bind(floating.and_then(|floating| floating.last_set_ms))
    .bind(floating.and_then(|floating| floating.last_task_id.clone()))
    .bind(flow_weights)
    .bind(record.mode.and_then(|mode| i16::try_from(mode as i32).ok()))
    .bind(
        record
            .adaptive
            .as_ref()
            .map(|adaptive| adaptive.stored(key).encode_to_vec()),
    )
    .execute(&mut *connection)
    .await?;
    Ok(())
}

/// Load `partition`'s tickets as committed (on a connection whose
/// `search_path` is limit-grant's schema). Before the partition's first
/// snapshot, tickets saved as rows by an earlier version are the start.
pub async fn load_tickets(connection: &mut PgConnection, partition: i32) -> Result<SavedTickets, sqlx::Error> {
    let snapshot: Option<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT seq, state FROM ticket_snapshots WHERE partition = $1")
            .bind(partition)
            .fetch_optional(&mut *connection)
            .await?;
    let mut saved = match snapshot {
        Some((seq, state)) => SavedTickets::from_snapshot(
            seq,
            state.len(),
            TicketSnapshot::decode(state.as_slice()).map_err(|error| sqlx::Error::Decode(Box::new(error)))?,
        ),
        None => SavedTickets::without_snapshot(legacy_ticket_rows(&mut *connection, partition).await?),
    };
    let journal: Vec<(i64, Vec<u8>)> =
        sqlx::query_as("SELECT seq, entry FROM ticket_journal WHERE partition = $1 AND seq > $2 ORDER BY seq")
            .bind(partition)
            .bind(saved.journal_seq)
            .fetch_all(&mut *connection)
            .await?;
    for (seq, entry) in journal {
        let batch = TicketBatch::decode(entry.as_slice()).map_err(|error| sqlx::Error::Decode(Box::new(error)))?;
        saved.replay(seq, entry.len(), batch);
    }
    Ok(saved)
}

/// Tickets an earlier version saved as rows (the `tickets` table).
async fn legacy_ticket_rows(connection: &mut PgConnection, partition: i32) -> Result<Vec<TicketRecord>, sqlx::Error> {
    let ticket_rows = sqlx::query(
        "SELECT job_id, attempt, step, tenant, key, held, priority, enqueued_at_us, job_max, floating,
                waiting_since_ms, position_at_enqueue, granted_at_ms, traceparent, tracestate
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
            fairness_key: std::sync::Arc::from(""),
            shadow: false,
        });
    }
    Ok(tickets)
}
