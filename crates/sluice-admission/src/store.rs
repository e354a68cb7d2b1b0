//! Loading and saving a job partition (docs/hot-path.md): job rows written
//! once, outcome rows when jobs end, a journal row per batch and a snapshot
//! now and then; and the reads a batch needs before it is decided (rows of
//! jobs not active here, idempotency keys, payloads).

use std::collections::{HashMap, HashSet};

use async_trait::async_trait;
use prost::Message;
use sluice_common::kafka::{batch_entries, InMsg, OutMsg};
use sluice_common::owner::{FencedStatement, OwnedStore, OwnerContext, Rejected};
use sqlx::{PgConnection, PgPool, Row};

use crate::effects::DeadLetterClass;
use crate::jobs::{self, status_code, status_from_i16, JobRow};
use crate::journal::JournalBatch;
use crate::partition::{
    checked_handover, AdmissionPartition, AdmissionWrites, Local, PartitionSettings, Prepared, StoredJob,
};
use crate::transitions::Status;

pub struct AdmissionStore {
    /// Settings of every partition (its number set at load).
    pub settings: PartitionSettings,
}

fn to_i32(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

/// Active statuses (a job row written before job partitions existed still
/// holds its current status; `bootstrap` reads those).
fn active_statuses() -> Vec<i16> {
    [
        Status::Scheduled,
        Status::Waiting,
        Status::Admitted,
        Status::Running,
        Status::Cancelling,
    ]
    .into_iter()
    .map(status_code)
    .collect()
}

/// An error that makes the runtime reload the partition and decide the
/// batch again: what `prepare` read changed before the commit (another
/// partition took the same idempotency key).
fn decide_again(why: &str) -> sqlx::Error {
    sqlx::Error::Protocol(format!("decide the batch again: {why}"))
}

impl AdmissionStore {
    fn partition_settings(&self, partition: i32) -> PartitionSettings {
        PartitionSettings {
            partition,
            ..self.settings.clone()
        }
    }
}

/// Rows of `job_ids`, with their outcomes applied to those that ended.
///
/// Its lookups (and every other lookup of a batch of ids in a table that
/// grows without bound) are planned for the ids they are given, on every
/// call (`persistent(false)`: an unnamed statement). A named one gets a
/// generic plan after five executions, made from the table as it was then:
/// planned while `job_outcomes` held a few hundred rows, it stayed a
/// sequential scan comparing every row with every id for the connection's
/// life, until an ANALYZE (autovacuum may be off or behind). With 200,000
/// ended jobs each enqueue batch's lookup then took 2-4 s.
pub async fn stored_jobs(
    connection: &mut PgConnection,
    job_ids: &[String],
) -> Result<HashMap<String, StoredJob>, sqlx::Error> {
    if job_ids.is_empty() {
        return Ok(HashMap::new());
    }
    let mut stored: HashMap<String, StoredJob> = jobs::fetch_jobs(&mut *connection, job_ids)
        .await?
        .into_iter()
        .map(|row| (row.state.job_id.clone(), StoredJob { row, finished: false }))
        .collect();
    let outcomes = sqlx::query(
        "SELECT job_id, status, attempt, attempts_used, step, admitted_at_ms, claimed_by, finished_at_ms,
                cancel_reason, last_error, history
         FROM job_outcomes WHERE job_id = ANY($1)",
    )
    .persistent(false)
    .bind(job_ids)
    .fetch_all(&mut *connection)
    .await?;
    for outcome in outcomes {
        let job_id: String = outcome.try_get(0)?;
        let Some(job) = stored.get_mut(&job_id) else {
            continue;
        };
        let state = &mut job.row.state;
        state.status = status_from_i16(outcome.try_get(1)?);
        state.attempt = u32::try_from(outcome.try_get::<i32, _>(2)?).unwrap_or_default();
        state.attempts_used = u32::try_from(outcome.try_get::<i32, _>(3)?).unwrap_or_default();
        state.step = u32::try_from(outcome.try_get::<i32, _>(4)?).unwrap_or_default();
        state.admitted_at_ms = outcome.try_get(5)?;
        state.claimed_by = outcome.try_get(6)?;
        state.finished_at_ms = Some(outcome.try_get(7)?);
        state.cancel_reason = outcome.try_get(8)?;
        state.last_error = outcome.try_get(9)?;
        state.due_at_ms = None;
        state.lease_expires_at_ms = None;
        let history: Option<Vec<u8>> = outcome.try_get(10)?;
        if let Some(bytes) = history {
            state.history = crate::chain::History::decode(bytes.as_slice()).unwrap_or_default();
        }
        job.finished = true;
    }
    Ok(stored)
}

#[async_trait]
impl OwnedStore for AdmissionStore {
    type State = AdmissionPartition;

    async fn load(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
    ) -> Result<AdmissionPartition, sqlx::Error> {
        let partition = context.partition;
        let snapshot: Option<(i64, Vec<u8>)> =
            sqlx::query_as("SELECT seq, state FROM job_snapshots WHERE partition = $1")
                .bind(partition)
                .fetch_optional(&mut *connection)
                .await?;
        let snapshot_seq = snapshot.as_ref().map_or(0, |(seq, _)| *seq);
        let snapshot_bytes = snapshot.as_ref().map(|(_, state)| state.len());
        let mut rows: HashMap<String, JobRow> = match snapshot {
            Some((_, state)) => crate::journal::rows_of_snapshot(state, partition)
                .map_err(|error| sqlx::Error::Decode(Box::new(error)))?,
            None => bootstrap(connection, partition).await?,
        };
        let journal: Vec<(i64, Vec<u8>)> =
            sqlx::query_as("SELECT seq, entry FROM job_journal WHERE partition = $1 AND seq > $2 ORDER BY seq")
                .bind(partition)
                .bind(snapshot_seq)
                .fetch_all(&mut *connection)
                .await?;
        let journal_bytes: usize = journal.iter().map(|(_, entry)| entry.len()).sum();
        let journal_seq = journal.last().map_or(snapshot_seq, |(seq, _)| *seq);
        let replayed = journal.len();
        let batches: Vec<JournalBatch> = journal
            .into_iter()
            .map(|(_, entry)| JournalBatch::decode(entry.as_slice()))
            .collect::<Result<_, _>>()
            .map_err(|error| sqlx::Error::Decode(Box::new(error)))?;
        // Jobs created after the snapshot: their rows hold what the journal
        // does not.
        let created: Vec<String> = batches
            .iter()
            .flat_map(|batch| batch.changes.iter())
            .filter(|change| change.created)
            .map(|change| change.job_id.clone())
            .collect();
        let mut created_rows: HashMap<String, JobRow> = jobs::fetch_jobs_without_payloads(&mut *connection, &created)
            .await?
            .into_iter()
            .map(|row| (row.state.job_id.clone(), row))
            .collect();
        for batch in batches {
            crate::journal::replay(&mut rows, &mut created_rows, batch);
        }
        let mut loaded = AdmissionPartition::new(
            self.partition_settings(partition),
            rows.into_values(),
            journal_seq,
            snapshot_bytes,
            journal_bytes,
        );
        loaded.handed_over_by_live_owner(context.previous_owner_alive);
        // Leases and re-send timers start when the owner serves
        // (`OwnedState::begin_serving`), not here.
        tracing::debug!(
            partition,
            active_jobs = loaded.active_jobs(),
            journal_seq,
            replayed,
            "job partition loaded"
        );
        Ok(loaded)
    }

    /// The journal row, with the outcome rows of jobs that ended (a
    /// worker's completions): plain inserts, one statement. Batches that
    /// create jobs (their insert is checked) or write a snapshot take a
    /// transaction.
    fn one_statement(&self, writes: &AdmissionWrites) -> Option<FencedStatement> {
        let (seq, batch) = writes.journal.as_ref()?;
        let plain = writes.inserted.is_empty() && writes.idempotency.is_empty() && writes.snapshot.is_none();
        if !plain {
            return None;
        }
        let mut statement = FencedStatement::default();
        if !writes.finished.is_empty() {
            OutcomeColumns::of(&writes.finished).add_to(&mut statement);
        }
        statement.journal("job_journal", *seq, batch.encode_to_vec());
        Some(statement)
    }

    async fn persist(
        &self,
        connection: &mut PgConnection,
        context: &OwnerContext,
        writes: AdmissionWrites,
    ) -> Result<(), sqlx::Error> {
        if let Some(refused) = writes
            .inserted
            .iter()
            .find(|row| self.settings.faults.refuses_job(&row.state.job_id))
        {
            tracing::warn!(job_id = %refused.state.job_id, "a fault hook refuses this job's save");
            return Err(sluice_common::faults::refused_by_storage());
        }
        if !writes.inserted.is_empty() {
            let inserted = jobs::insert_jobs(&mut *connection, &writes.inserted).await?;
            if inserted.len() != writes.inserted.len() {
                return Err(decide_again("a job row it was about to insert exists"));
            }
        }
        insert_idempotency_keys(connection, &writes.idempotency).await?;
        insert_outcomes(connection, &writes.finished).await?;
        if let Some((seq, batch)) = &writes.journal {
            sqlx::query("INSERT INTO job_journal (partition, seq, epoch, entry) VALUES ($1, $2, $3, $4)")
                .bind(context.partition)
                .bind(*seq)
                .bind(context.epoch)
                .bind(batch.encode_to_vec())
                .execute(&mut *connection)
                .await?;
        }
        if let Some((seq, snapshot)) = &writes.snapshot {
            sqlx::query(
                "INSERT INTO job_snapshots (partition, seq, epoch, state) VALUES ($1, $2, $3, $4)
                 ON CONFLICT (partition) DO UPDATE
                    SET seq = EXCLUDED.seq, epoch = EXCLUDED.epoch, state = EXCLUDED.state, written_at = now()",
            )
            .bind(context.partition)
            .bind(*seq)
            .bind(context.epoch)
            .bind(snapshot.encode_to_vec())
            .execute(&mut *connection)
            .await?;
            sqlx::query("DELETE FROM job_journal WHERE partition = $1 AND seq <= $2")
                .bind(context.partition)
                .bind(*seq)
                .execute(&mut *connection)
                .await?;
        }
        Ok(())
    }

    async fn prepare(
        &self,
        pool: &PgPool,
        state: &AdmissionPartition,
        messages: &[InMsg],
        locals: &[Local],
    ) -> Result<Prepared, sqlx::Error> {
        let mut prepared = Prepared::default();
        let mut job_ids: HashSet<String> = HashSet::new();
        let mut idempotency: HashSet<(String, String)> = HashSet::new();
        let mut claimed: Vec<String> = Vec::new();
        for message in messages {
            let Ok(entries) = batch_entries(message.payload.as_deref().unwrap_or_default()) else {
                continue;
            };
            for (index, entry) in entries.into_iter().enumerate() {
                let Ok(handover) = sluice_proto::v1::JobHandOver::decode(entry) else {
                    continue;
                };
                let checked = checked_handover(&state.settings().config, handover);
                if let Ok(incoming) = &checked.checked {
                    note_incoming(incoming, &mut job_ids, &mut idempotency);
                }
                prepared.handovers.insert((message.offset, index), checked);
            }
        }
        for local in locals {
            note_local(local, &mut job_ids, &mut idempotency, &mut claimed);
        }
        let not_active: Vec<String> = job_ids
            .into_iter()
            .filter(|job_id| state.job(job_id).is_none())
            .collect();
        let payloads_needed = state.payloads_needed(claimed.iter().map(String::as_str));
        if not_active.is_empty() && idempotency.is_empty() && payloads_needed.is_empty() {
            return Ok(prepared);
        }
        let mut connection = pool.acquire().await?;
        prepared.stored = stored_jobs(&mut connection, &not_active).await?.into_iter().collect();
        prepared.idempotency = read_idempotency_keys(&mut connection, &idempotency)
            .await?
            .into_iter()
            .collect();
        if !payloads_needed.is_empty() {
            let rows: Vec<(String, Vec<u8>)> =
                sqlx::query_as("SELECT job_id, payload FROM jobs WHERE job_id = ANY($1)")
                    .persistent(false)
                    .bind(&payloads_needed)
                    .fetch_all(&mut *connection)
                    .await?;
            prepared.payloads = rows.into_iter().collect();
            for job_id in &payloads_needed {
                if !prepared.payloads.contains_key(job_id) {
                    tracing::error!(%job_id, "an active job has no row to read its payload from; handing it out empty");
                    prepared.payloads.insert(job_id.clone(), Vec::new());
                }
            }
        }
        Ok(prepared)
    }

    /// A handed-over request PostgreSQL refuses to store, every time, is
    /// producer input: it goes to the dead-letter topic, not quarantine.
    fn redirect_rejected(&self, _topic: &str, _partition: i32, rejected: &Rejected) -> Option<OutMsg> {
        // A message of one entry is set aside whole (a batch of one); an
        // entry of a larger message is set aside alone (the bare entry).
        let handover_in = |bytes: &[u8]| {
            sluice_proto::v1::JobHandOver::decode(bytes)
                .ok()
                .filter(|handover| !handover.source_topic.is_empty())
        };
        let handover = match batch_entries(&rejected.entry).ok().as_deref() {
            Some([single]) => handover_in(single),
            _ => None,
        }
        .or_else(|| handover_in(&rejected.entry))?;
        let checked = checked_handover(&self.settings.config, handover);
        let reason = format!("PostgreSQL refuses to store this request: {}", rejected.reason);
        crate::effects::count_dead_letters(&checked.source_topic, DeadLetterClass::Storage, 1);
        Some(self.settings.routes.dead_letter(
            &checked.source_topic,
            &checked.source,
            DeadLetterClass::Storage,
            &reason,
        ))
    }
}

/// Active jobs of a partition from rows written before job partitions
/// existed (a partition with no snapshot yet): their rows hold their
/// current state. Jobs with an outcome ended.
async fn bootstrap(connection: &mut PgConnection, partition: i32) -> Result<HashMap<String, JobRow>, sqlx::Error> {
    let statement = format!(
        "SELECT {} FROM jobs j
         WHERE job_partition = $1 AND status = ANY($2)
           AND NOT EXISTS (SELECT 1 FROM job_outcomes o WHERE o.job_id = j.job_id)",
        jobs::job_columns_without_payload()
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(partition)
        .bind(active_statuses())
        .fetch_all(&mut *connection)
        .await?;
    rows.iter()
        .map(|row| {
            let job = JobRow::from_row(row)?;
            Ok((job.state.job_id.clone(), job))
        })
        .collect()
}

/// Notes what a local request needs read: the jobs it names, the
/// idempotency keys of jobs it enqueues, the jobs it claims (their payloads).
fn note_local(
    local: &Local,
    job_ids: &mut HashSet<String>,
    idempotency: &mut HashSet<(String, String)>,
    claimed: &mut Vec<String>,
) {
    match local {
        Local::Enqueue { jobs, .. } => {
            for incoming in jobs {
                note_incoming(incoming, job_ids, idempotency);
            }
        }
        Local::Cancel { job_id, .. } => {
            job_ids.insert(job_id.clone());
        }
        Local::Claim { attempts, .. } => {
            for (job_id, _) in attempts {
                job_ids.insert(job_id.clone());
                claimed.push(job_id.clone());
            }
        }
        Local::Complete { completions, .. } => {
            for (job_id, _, _) in completions {
                job_ids.insert(job_id.clone());
            }
        }
        Local::HandOver { handovers, .. } => {
            for handover in handovers {
                if let Ok(incoming) = &handover.checked {
                    note_incoming(incoming, job_ids, idempotency);
                }
            }
        }
        Local::Describe { .. }
        | Local::Heartbeat { .. }
        | Local::Grants(_)
        | Local::Dispatch
        | Local::Pushed { .. }
        | Local::PathChanged { .. }
        | Local::Barrier(_) => {}
    }
}

/// Note a new job's id and idempotency key (`prepare`).
fn note_incoming(
    incoming: &crate::partition::Incoming,
    job_ids: &mut HashSet<String>,
    idempotency: &mut HashSet<(String, String)>,
) {
    job_ids.insert(incoming.job_id.clone());
    if !incoming.valid.request.idempotency_key.is_empty() {
        idempotency.insert((
            incoming.valid.request.tenant.clone(),
            incoming.valid.request.idempotency_key.clone(),
        ));
    }
}

/// Holders of `pairs` (tenant, key): (job id, expires_at_ms).
async fn read_idempotency_keys(
    connection: &mut PgConnection,
    pairs: &HashSet<(String, String)>,
) -> Result<HashMap<(String, String), (String, i64)>, sqlx::Error> {
    if pairs.is_empty() {
        return Ok(HashMap::new());
    }
    let tenants: Vec<&str> = pairs.iter().map(|pair| pair.0.as_str()).collect();
    let keys: Vec<&str> = pairs.iter().map(|pair| pair.1.as_str()).collect();
    let rows: Vec<(String, String, String, i64)> = sqlx::query_as(
        "SELECT i.tenant, i.idempotency_key, i.job_id, i.expires_at_ms FROM idempotency_keys i
         JOIN UNNEST($1::text[], $2::text[]) AS m(tenant, idempotency_key)
           ON i.tenant = m.tenant AND i.idempotency_key = m.idempotency_key",
    )
    .persistent(false)
    .bind(&tenants)
    .bind(&keys)
    .fetch_all(connection)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(tenant, key, job_id, expires)| ((tenant, key), (job_id, expires)))
        .collect())
}

/// Take idempotency keys; a key another job took since `prepare` read it
/// makes the batch be decided again.
#[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
async fn insert_idempotency_keys(
    connection: &mut PgConnection,
    claims: &[(String, String, String, i64)],
) -> Result<(), sqlx::Error> {
    if claims.is_empty() {
        return Ok(());
    }
    let now_ms = sluice_common::clock::wall_clock_ms();
    let tenants: Vec<&str> = claims.iter().map(|claim| claim.0.as_str()).collect();
    let keys: Vec<&str> = claims.iter().map(|claim| claim.1.as_str()).collect();
    let job_ids: Vec<&str> = claims.iter().map(|claim| claim.2.as_str()).collect();
    let expiries: Vec<i64> = claims.iter().map(|claim| claim.3).collect();
    let taken: Vec<(String,)> = sqlx::query_as(
        "INSERT INTO idempotency_keys (tenant, idempotency_key, job_id, expires_at_ms)
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[])
         ON CONFLICT (tenant, idempotency_key) DO UPDATE
            SET job_id = EXCLUDED.job_id, expires_at_ms = EXCLUDED.expires_at_ms
            WHERE idempotency_keys.expires_at_ms <= $5 OR idempotency_keys.job_id = EXCLUDED.job_id
         RETURNING job_id",
    )
    .bind(&tenants)
    .bind(&keys)
    .bind(&job_ids)
    .bind(&expiries)
    .bind(now_ms)
    .fetch_all(connection)
    .await?;
    if taken.len() != claims.len() {
        return Err(decide_again("another job took an idempotency key meanwhile"));
    }
    Ok(())
}

/// Outcome rows of jobs that ended (again, the same, if a batch is re-applied).
/// Outcome rows of jobs that ended, as the columns `job_outcomes` takes.
struct OutcomeColumns {
    job_ids: Vec<String>,
    statuses: Vec<i16>,
    attempts: Vec<i32>,
    attempts_used: Vec<i32>,
    steps: Vec<i32>,
    admitted_ats: Vec<Option<i64>>,
    claimed_bys: Vec<Option<String>>,
    finished_ats: Vec<i64>,
    cancel_reasons: Vec<Option<String>>,
    last_errors: Vec<String>,
    histories: Vec<Vec<u8>>,
}

impl OutcomeColumns {
    fn of(finished: &[JobRow]) -> Self {
        let count = finished.len();
        let mut columns = OutcomeColumns {
            job_ids: Vec::with_capacity(count),
            statuses: Vec::with_capacity(count),
            attempts: Vec::with_capacity(count),
            attempts_used: Vec::with_capacity(count),
            steps: Vec::with_capacity(count),
            admitted_ats: Vec::with_capacity(count),
            claimed_bys: Vec::with_capacity(count),
            finished_ats: Vec::with_capacity(count),
            cancel_reasons: Vec::with_capacity(count),
            last_errors: Vec::with_capacity(count),
            histories: Vec::with_capacity(count),
        };
        for row in finished {
            let state = &row.state;
            columns.job_ids.push(state.job_id.clone());
            columns.statuses.push(status_code(state.status));
            columns.attempts.push(to_i32(state.attempt));
            columns.attempts_used.push(to_i32(state.attempts_used));
            columns.steps.push(to_i32(state.step));
            columns.admitted_ats.push(state.admitted_at_ms);
            columns.claimed_bys.push(state.claimed_by.clone());
            columns.finished_ats.push(state.finished_at_ms.unwrap_or_default());
            columns.cancel_reasons.push(state.cancel_reason.clone());
            columns.last_errors.push(state.last_error.clone());
            columns.histories.push(state.history.encode_to_vec());
        }
        columns
    }

    /// The insert, reading its eleven arrays from `placeholders` and its
    /// rows from `source` (the fence's row, or nothing).
    fn insert_sql(placeholders: &[String], from: &str) -> String {
        let types = [
            "text[]",
            "smallint[]",
            "integer[]",
            "integer[]",
            "integer[]",
            "bigint[]",
            "text[]",
            "bigint[]",
            "text[]",
            "text[]",
            "bytea[]",
        ];
        let arrays: Vec<String> = placeholders
            .iter()
            .zip(types)
            .map(|(placeholder, kind)| format!("{placeholder}::{kind}"))
            .collect();
        format!(
            "INSERT INTO job_outcomes (job_id, status, attempt, attempts_used, step, admitted_at_ms, claimed_by,
                                       finished_at_ms, cancel_reason, last_error, history)
             SELECT u.* FROM {from}UNNEST({}) AS u
             ON CONFLICT (job_id) DO NOTHING",
            arrays.join(", ")
        )
    }

    /// Add the insert to a one-statement commit.
    fn add_to(self, statement: &mut FencedStatement) {
        let placeholders = [
            statement.param(self.job_ids),
            statement.param(self.statuses),
            statement.param(self.attempts),
            statement.param(self.attempts_used),
            statement.param(self.steps),
            statement.param(self.admitted_ats),
            statement.param(self.claimed_bys),
            statement.param(self.finished_ats),
            statement.param(self.cancel_reasons),
            statement.param(self.last_errors),
            statement.param(self.histories),
        ];
        statement.write(&Self::insert_sql(&placeholders, "fence, "));
    }
}

async fn insert_outcomes(connection: &mut PgConnection, finished: &[JobRow]) -> Result<(), sqlx::Error> {
    if finished.is_empty() {
        return Ok(());
    }
    let columns = OutcomeColumns::of(finished);
    let placeholders: Vec<String> = (1..=11).map(|index| format!("${index}")).collect();
    sqlx::query(sqlx::AssertSqlSafe(OutcomeColumns::insert_sql(&placeholders, "")))
        .bind(columns.job_ids)
        .bind(columns.statuses)
        .bind(columns.attempts)
        .bind(columns.attempts_used)
        .bind(columns.steps)
        .bind(columns.admitted_ats)
        .bind(columns.claimed_bys)
        .bind(columns.finished_ats)
        .bind(columns.cancel_reasons)
        .bind(columns.last_errors)
        .bind(columns.histories)
        .execute(connection)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prost::Message;
    use sluice_common::kafka::single_entry_batch;
    use sluice_common::owner::{OwnedStore, Rejected};
    use sluice_common::{Faults, SluiceConfig};
    use sluice_proto::v1 as pb;

    use super::AdmissionStore;

    fn store() -> AdmissionStore {
        let config = Arc::new(SluiceConfig::load_with(None, &[]).unwrap());
        AdmissionStore {
            settings: crate::partition_settings(&config, &Faults::default(), crate::work::WorkerHub::without_workers()),
        }
    }

    fn handover() -> Vec<u8> {
        pb::JobHandOver {
            job_id: "refused".to_string(),
            source_topic: "jobs.requested".to_string(),
            source_partition: 3,
            source_offset: 41,
            payload: b"request bytes".to_vec(),
            ..Default::default()
        }
        .encode_to_vec()
    }

    fn reason_of(message: &sluice_common::kafka::OutMsg) -> String {
        message
            .headers
            .iter()
            .find(|(name, _)| name == "sluice-deadletter-reason")
            .map(|(_, value)| String::from_utf8_lossy(value).to_string())
            .unwrap_or_default()
    }

    #[test]
    fn a_refused_hand_over_becomes_a_dead_letter_whether_set_aside_whole_or_alone() {
        let store = store();
        // A message of one entry is set aside whole; an entry of a larger
        // message is set aside as the bare entry.
        for entry in [single_entry_batch(&handover()), handover()] {
            let rejected = Rejected {
                offset: 7,
                entry,
                reason: "refused".to_string(),
            };
            let letter = store
                .redirect_rejected("sluice.jobs", 0, &rejected)
                .expect("a dead letter, not quarantine");
            assert_eq!(letter.payload, b"request bytes");
            assert!(reason_of(&letter).starts_with("PostgreSQL refuses to store this request"));
            let offset = letter
                .headers
                .iter()
                .find(|(name, _)| name == "sluice-source-offset")
                .map(|(_, value)| value.clone());
            assert_eq!(offset, Some(b"41".to_vec()), "it names the producer's message");
        }
    }

    #[test]
    fn internal_input_that_is_no_hand_over_is_quarantined() {
        let rejected = Rejected {
            offset: 7,
            entry: vec![0x0a, 0x7f],
            reason: "undecodable".to_string(),
        };
        assert!(store().redirect_rejected("sluice.jobs", 0, &rejected).is_none());
    }
}
