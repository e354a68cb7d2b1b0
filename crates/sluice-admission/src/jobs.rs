//! The job table: batched inserts, the grant and claim hot paths as single
//! set-based statements, and a compare-and-set writer for every other
//! transition (`transitions.rs` decides, this module saves).

use std::collections::{HashMap, HashSet};

use prost::Message;
use sluice_proto::v1 as pb;
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};

use crate::chain::{History, RetrySettings, StoredChain};
use crate::transitions::{JobState, Status};

/// Every column of a job row, for `JobRow::from_row`.
pub const JOB_COLUMNS: &str = "job_id, tenant, task_group, priority, status, attempt, attempts_used, max_attempts, \
     step, chain, spec, payload, job_partition, lease_ms, run_timeout_ms, enqueued_at_us, run_at_ms, due_at_ms, \
     step_started_at_ms, admitted_at_ms, claimed_by, claimed_at_ms, lease_expires_at_ms, finished_at_ms, \
     cancel_reason, last_error, history, idempotency_key, traceparent, tracestate, request_hash";

/// A whole job row.
#[derive(Clone, Debug)]
pub struct JobRow {
    pub state: JobState,
    pub tenant: String,
    pub task_group: String,
    pub priority: u32,
    pub spec: pb::JobRequest,
    pub payload: Vec<u8>,
    pub job_partition: i32,
    pub enqueued_at_us: i64,
    pub run_at_ms: Option<i64>,
    pub idempotency_key: Option<String>,
    pub trace: pb::TraceContext,
    /// A fingerprint of the request (`request_fingerprint`): the same job id
    /// sent again with another request is a conflict. `None` for rows saved
    /// before fingerprints were kept.
    pub request_hash: Option<Vec<u8>>,
}

/// SHA-256 of the request as saved (`spec`, with the job id set and no
/// payload) and its payload. Map fields (floating metadata) are hashed in
/// key order: protobuf's encoding of a map has no fixed order.
pub fn request_fingerprint(spec: &pb::JobRequest, payload: &[u8]) -> Vec<u8> {
    use sha2::Digest as _;
    let mut hasher = sha2::Sha256::new();
    let mut without_maps = spec.clone();
    for (index, limit) in without_maps.limits.iter_mut().enumerate() {
        if let Some(pb::limit::Kind::Floating(floating)) = &mut limit.kind {
            let sorted: std::collections::BTreeMap<String, String> = floating.metadata.drain().collect();
            for (name, value) in sorted {
                hasher.update(u64::try_from(index).unwrap_or(u64::MAX).to_le_bytes());
                hasher.update(u64::try_from(name.len()).unwrap_or(u64::MAX).to_le_bytes());
                hasher.update(name.as_bytes());
                hasher.update(u64::try_from(value.len()).unwrap_or(u64::MAX).to_le_bytes());
                hasher.update(value.as_bytes());
            }
        }
    }
    let encoded = without_maps.encode_to_vec();
    hasher.update(u64::try_from(encoded.len()).unwrap_or(u64::MAX).to_le_bytes());
    hasher.update(&encoded);
    hasher.update(payload);
    hasher.finalize().to_vec()
}

fn to_u32(value: i32) -> u32 {
    u32::try_from(value).unwrap_or_default()
}

pub fn to_i32(value: u32) -> i32 {
    i32::try_from(value).unwrap_or(i32::MAX)
}

fn decode_error(column: &str, error: prost::DecodeError) -> sqlx::Error {
    sqlx::Error::ColumnDecode {
        index: column.to_string(),
        source: Box::new(error),
    }
}

pub fn status_from_i16(value: i16) -> Status {
    Status::try_from(i32::from(value)).unwrap_or(Status::Unspecified)
}

pub fn status_code(status: Status) -> i16 {
    i16::try_from(status as i32).unwrap_or_default()
}

impl JobRow {
    pub fn from_row(row: &PgRow) -> Result<JobRow, sqlx::Error> {
        let chain_bytes: Vec<u8> = row.try_get("chain")?;
        let chain = StoredChain::decode(chain_bytes.as_slice()).map_err(|error| decode_error("chain", error))?;
        let spec_bytes: Vec<u8> = row.try_get("spec")?;
        let spec = pb::JobRequest::decode(spec_bytes.as_slice()).map_err(|error| decode_error("spec", error))?;
        let history_bytes: Option<Vec<u8>> = row.try_get("history")?;
        let history = match history_bytes {
            Some(bytes) => History::decode(bytes.as_slice()).map_err(|error| decode_error("history", error))?,
            None => History::default(),
        };
        let retry = RetrySettings::from_request(spec.retry.as_ref()).unwrap_or(RetrySettings {
            max_attempts: 1,
            initial_backoff_ms: 1_000,
            max_backoff_ms: 300_000,
            multiplier: 2.0,
            fail_on_lease_expiry: false,
        });
        let state = JobState {
            job_id: row.try_get("job_id")?,
            status: status_from_i16(row.try_get("status")?),
            attempt: to_u32(row.try_get("attempt")?),
            attempts_used: to_u32(row.try_get("attempts_used")?),
            max_attempts: to_u32(row.try_get("max_attempts")?),
            step: to_u32(row.try_get("step")?),
            chain: chain.steps,
            retry,
            lease_ms: row.try_get("lease_ms")?,
            run_timeout_ms: row.try_get("run_timeout_ms")?,
            due_at_ms: row.try_get("due_at_ms")?,
            step_started_at_ms: row.try_get("step_started_at_ms")?,
            admitted_at_ms: row.try_get("admitted_at_ms")?,
            claimed_by: row.try_get("claimed_by")?,
            claimed_at_ms: row.try_get("claimed_at_ms")?,
            lease_expires_at_ms: row.try_get("lease_expires_at_ms")?,
            finished_at_ms: row.try_get("finished_at_ms")?,
            cancel_reason: row.try_get("cancel_reason")?,
            last_error: row.try_get("last_error")?,
            history,
        };
        Ok(JobRow {
            state,
            tenant: row.try_get("tenant")?,
            task_group: row.try_get("task_group")?,
            priority: u32::try_from(row.try_get::<i16, _>("priority")?).unwrap_or_default(),
            spec,
            payload: row.try_get("payload")?,
            job_partition: row.try_get("job_partition")?,
            enqueued_at_us: row.try_get("enqueued_at_us")?,
            run_at_ms: row.try_get("run_at_ms")?,
            idempotency_key: row.try_get("idempotency_key")?,
            trace: pb::TraceContext {
                traceparent: row.try_get("traceparent")?,
                tracestate: row.try_get("tracestate")?,
            },
            request_hash: row.try_get("request_hash")?,
        })
    }
}

/// Read jobs by id.
pub async fn fetch_jobs(connection: &mut PgConnection, job_ids: &[String]) -> Result<Vec<JobRow>, sqlx::Error> {
    if job_ids.is_empty() {
        return Ok(Vec::new());
    }
    let statement = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ANY($1)");
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(job_ids)
        .fetch_all(connection)
        .await?;
    rows.iter().map(JobRow::from_row).collect()
}

/// Read and lock jobs by id (for a compare-and-set in the same transaction).
pub async fn fetch_jobs_for_update(
    connection: &mut PgConnection,
    job_ids: &[String],
) -> Result<Vec<JobRow>, sqlx::Error> {
    if job_ids.is_empty() {
        return Ok(Vec::new());
    }
    let statement = format!("SELECT {JOB_COLUMNS} FROM jobs WHERE job_id = ANY($1) ORDER BY job_id FOR UPDATE");
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(job_ids)
        .fetch_all(connection)
        .await?;
    rows.iter().map(JobRow::from_row).collect()
}

/// Insert new rows; returns the ids that were new (the others existed).
pub async fn insert_jobs(connection: &mut PgConnection, jobs: &[JobRow]) -> Result<HashSet<String>, sqlx::Error> {
    if jobs.is_empty() {
        return Ok(HashSet::new());
    }
    let count = jobs.len();
    let mut job_ids = Vec::with_capacity(count);
    let mut tenants = Vec::with_capacity(count);
    let mut task_groups = Vec::with_capacity(count);
    let mut priorities = Vec::with_capacity(count);
    let mut statuses = Vec::with_capacity(count);
    let mut max_attempts = Vec::with_capacity(count);
    let mut chain_lens = Vec::with_capacity(count);
    let mut chains = Vec::with_capacity(count);
    let mut specs = Vec::with_capacity(count);
    let mut payloads = Vec::with_capacity(count);
    let mut partitions = Vec::with_capacity(count);
    let mut leases = Vec::with_capacity(count);
    let mut run_timeouts: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut enqueued = Vec::with_capacity(count);
    let mut run_ats: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut due_ats: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut step_starts: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut admitted_ats: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut idempotency_keys: Vec<Option<String>> = Vec::with_capacity(count);
    let mut traceparents = Vec::with_capacity(count);
    let mut tracestates = Vec::with_capacity(count);
    let mut request_hashes: Vec<Option<Vec<u8>>> = Vec::with_capacity(count);
    for job in jobs {
        job_ids.push(job.state.job_id.clone());
        tenants.push(job.tenant.clone());
        task_groups.push(job.task_group.clone());
        priorities.push(i16::try_from(job.priority).unwrap_or(i16::MAX));
        statuses.push(status_code(job.state.status));
        max_attempts.push(to_i32(job.state.max_attempts));
        chain_lens.push(to_i32(job.state.chain_len()));
        chains.push(
            StoredChain {
                steps: job.state.chain.clone(),
            }
            .encode_to_vec(),
        );
        specs.push(job.spec.encode_to_vec());
        payloads.push(job.payload.clone());
        partitions.push(job.job_partition);
        leases.push(job.state.lease_ms);
        run_timeouts.push(job.state.run_timeout_ms);
        enqueued.push(job.enqueued_at_us);
        run_ats.push(job.run_at_ms);
        due_ats.push(job.state.due_at_ms);
        step_starts.push(job.state.step_started_at_ms);
        admitted_ats.push(job.state.admitted_at_ms);
        idempotency_keys.push(job.idempotency_key.clone());
        traceparents.push(job.trace.traceparent.clone());
        tracestates.push(job.trace.tracestate.clone());
        request_hashes.push(job.request_hash.clone());
    }
    let inserted: Vec<String> = sqlx::query_scalar(
        "INSERT INTO jobs (job_id, tenant, task_group, priority, status, attempt, attempts_used, max_attempts, step,
                           chain_len, chain, spec, payload, job_partition, lease_ms, run_timeout_ms, enqueued_at_us,
                           run_at_ms, due_at_ms, step_started_at_ms, admitted_at_ms, idempotency_key, traceparent,
                           tracestate, request_hash)
         SELECT u.job_id, u.tenant, u.task_group, u.priority, u.status, 1, 0, u.max_attempts, 0, u.chain_len, u.chain,
                u.spec, u.payload, u.job_partition, u.lease_ms, u.run_timeout_ms, u.enqueued_at_us, u.run_at_ms,
                u.due_at_ms, u.step_started_at_ms, u.admitted_at_ms, u.idempotency_key, u.traceparent, u.tracestate,
                u.request_hash
         FROM UNNEST($1::text[], $2::text[], $3::text[], $4::smallint[], $5::smallint[], $6::integer[],
                     $7::integer[], $8::bytea[], $9::bytea[], $10::bytea[], $11::integer[], $12::bigint[],
                     $13::bigint[], $14::bigint[], $15::bigint[], $16::bigint[], $17::bigint[], $18::bigint[],
                     $19::text[], $20::text[], $21::text[], $22::bytea[])
              AS u(job_id, tenant, task_group, priority, status, max_attempts, chain_len, chain, spec, payload,
                   job_partition, lease_ms, run_timeout_ms, enqueued_at_us, run_at_ms, due_at_ms,
                   step_started_at_ms, admitted_at_ms, idempotency_key, traceparent, tracestate, request_hash)
         ON CONFLICT (job_id) DO NOTHING
         RETURNING job_id",
    )
    .bind(job_ids)
    .bind(tenants)
    .bind(task_groups)
    .bind(priorities)
    .bind(statuses)
    .bind(max_attempts)
    .bind(chain_lens)
    .bind(chains)
    .bind(specs)
    .bind(payloads)
    .bind(partitions)
    .bind(leases)
    .bind(run_timeouts)
    .bind(enqueued)
    .bind(run_ats)
    .bind(due_ats)
    .bind(step_starts)
    .bind(admitted_ats)
    .bind(idempotency_keys)
    .bind(traceparents)
    .bind(tracestates)
    .bind(request_hashes)
    .fetch_all(connection)
    .await?;
    Ok(inserted.into_iter().collect())
}

/// Take idempotency keys for `(tenant, key, job_id, expires_at_ms)`; a key
/// held by an unexpired row is not taken. Returns, per (tenant, key), the job
/// that holds it now.
pub async fn claim_idempotency_keys(
    connection: &mut PgConnection,
    claims: &[(String, String, String, i64)],
    now_ms: i64,
) -> Result<HashMap<(String, String), String>, sqlx::Error> {
    let mut holders = HashMap::new();
    if claims.is_empty() {
        return Ok(holders);
    }
    let tenants: Vec<&str> = claims.iter().map(|claim| claim.0.as_str()).collect();
    let keys: Vec<&str> = claims.iter().map(|claim| claim.1.as_str()).collect();
    let job_ids: Vec<&str> = claims.iter().map(|claim| claim.2.as_str()).collect();
    let expiries: Vec<i64> = claims.iter().map(|claim| claim.3).collect();
    let taken: Vec<(String, String, String)> = sqlx::query_as(
        "INSERT INTO idempotency_keys (tenant, idempotency_key, job_id, expires_at_ms)
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bigint[])
         ON CONFLICT (tenant, idempotency_key) DO UPDATE
            SET job_id = EXCLUDED.job_id, expires_at_ms = EXCLUDED.expires_at_ms
            WHERE idempotency_keys.expires_at_ms <= $5
         RETURNING tenant, idempotency_key, job_id",
    )
    .bind(&tenants)
    .bind(&keys)
    .bind(&job_ids)
    .bind(&expiries)
    .bind(now_ms)
    .fetch_all(&mut *connection)
    .await?;
    for (tenant, key, job_id) in taken {
        holders.insert((tenant, key), job_id);
    }
    let missing: Vec<(&str, &str)> = claims
        .iter()
        .filter(|claim| !holders.contains_key(&(claim.0.clone(), claim.1.clone())))
        .map(|claim| (claim.0.as_str(), claim.1.as_str()))
        .collect();
    if !missing.is_empty() {
        let missing_tenants: Vec<&str> = missing.iter().map(|pair| pair.0).collect();
        let missing_keys: Vec<&str> = missing.iter().map(|pair| pair.1).collect();
        let existing: Vec<(String, String, String)> = sqlx::query_as(
            "SELECT i.tenant, i.idempotency_key, i.job_id FROM idempotency_keys i
             JOIN UNNEST($1::text[], $2::text[]) AS m(tenant, idempotency_key)
               ON i.tenant = m.tenant AND i.idempotency_key = m.idempotency_key",
        )
        .bind(&missing_tenants)
        .bind(&missing_keys)
        .fetch_all(&mut *connection)
        .await?;
        for (tenant, key, job_id) in existing {
            holders.insert((tenant, key), job_id);
        }
    }
    Ok(holders)
}

/// A grant to apply: (job, attempt, step).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GrantKey {
    pub job_id: String,
    pub attempt: u32,
    pub step: u32,
}

/// Encoded `History` records to append to a job's history (protobuf
/// repeated fields concatenate), empty for none.
pub fn history_append(records: &[pb::AttemptRecord]) -> Vec<u8> {
    if records.is_empty() {
        return Vec::new();
    }
    History {
        records: records.to_vec(),
    }
    .encode_to_vec()
}

/// Advance every waiting job whose current step was granted. Returns the
/// advanced rows (after the update); grants that matched nothing are the
/// caller's to classify.
pub async fn apply_grants(
    connection: &mut PgConnection,
    grants: &[GrantKey],
    history_additions: &[Vec<u8>],
    now_ms: i64,
    resend_waiting_after_ms: i64,
    claim_timeout_ms: i64,
) -> Result<Vec<JobRow>, sqlx::Error> {
    if grants.is_empty() {
        return Ok(Vec::new());
    }
    let job_ids: Vec<&str> = grants.iter().map(|grant| grant.job_id.as_str()).collect();
    let attempts: Vec<i32> = grants.iter().map(|grant| to_i32(grant.attempt)).collect();
    let steps: Vec<i32> = grants.iter().map(|grant| to_i32(grant.step)).collect();
    let statement = format!(
        "UPDATE jobs AS j SET
            step = j.step + 1,
            status = CASE WHEN j.step + 1 >= j.chain_len THEN {admitted} ELSE {waiting} END,
            admitted_at_ms = CASE WHEN j.step + 1 >= j.chain_len THEN $4 ELSE NULL END,
            due_at_ms = CASE WHEN j.step + 1 >= j.chain_len THEN $4 + $6 ELSE $4 + $5 END,
            step_started_at_ms = $4,
            history = CASE WHEN octet_length(g.addition) > 0 THEN coalesce(j.history, ''::bytea) || g.addition
                           ELSE j.history END
         FROM UNNEST($1::text[], $2::integer[], $3::integer[], $7::bytea[]) AS g(job_id, attempt, step, addition)
         WHERE j.job_id = g.job_id AND j.attempt = g.attempt AND j.step = g.step AND j.status = {waiting}
         RETURNING {columns}",
        admitted = Status::Admitted as i32,
        waiting = Status::Waiting as i32,
        columns = JOB_COLUMNS
            .split(", ")
            .map(|column| format!("j.{column}"))
            .collect::<Vec<_>>()
            .join(", "),
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(&job_ids)
        .bind(&attempts)
        .bind(&steps)
        .bind(now_ms)
        .bind(resend_waiting_after_ms)
        .bind(claim_timeout_ms)
        .bind(history_additions)
        .fetch_all(connection)
        .await?;
    rows.iter().map(JobRow::from_row).collect()
}

/// Claim admitted attempts for `worker_id`; returns the winners with their
/// lease end and payload.
pub async fn claim(
    connection: &mut PgConnection,
    worker_id: &str,
    attempts: &[(String, u32)],
    now_ms: i64,
) -> Result<HashMap<(String, u32), (i64, i64, Vec<u8>)>, sqlx::Error> {
    let job_ids: Vec<&str> = attempts.iter().map(|attempt| attempt.0.as_str()).collect();
    let numbers: Vec<i32> = attempts.iter().map(|attempt| to_i32(attempt.1)).collect();
    let statement = format!(
        "UPDATE jobs AS j SET
            status = {running}, claimed_by = $3, claimed_at_ms = $4, lease_expires_at_ms = $4 + j.lease_ms,
            due_at_ms = CASE WHEN j.run_timeout_ms IS NULL THEN $4 + j.lease_ms
                             ELSE LEAST($4 + j.lease_ms, $4 + j.run_timeout_ms) END
         FROM UNNEST($1::text[], $2::integer[]) AS c(job_id, attempt)
         WHERE j.job_id = c.job_id AND j.attempt = c.attempt AND j.status = {admitted}
         RETURNING j.job_id, j.attempt, j.lease_expires_at_ms, j.lease_ms, j.payload",
        running = Status::Running as i32,
        admitted = Status::Admitted as i32,
    );
    let rows: Vec<(String, i32, i64, i64, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(statement))
        .bind(&job_ids)
        .bind(&numbers)
        .bind(worker_id)
        .bind(now_ms)
        .fetch_all(connection)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(job_id, attempt, lease_end, lease_ms, payload)| {
            ((job_id, to_u32(attempt)), (lease_end, lease_ms, payload))
        })
        .collect())
}

/// Extend leases of running attempts held by `worker_id`. Returns, per
/// extended attempt, the new lease end and the status (running or cancelling).
pub async fn extend_leases(
    connection: &mut PgConnection,
    worker_id: &str,
    attempts: &[(String, u32)],
    now_ms: i64,
) -> Result<HashMap<(String, u32), (i64, Status)>, sqlx::Error> {
    let job_ids: Vec<&str> = attempts.iter().map(|attempt| attempt.0.as_str()).collect();
    let numbers: Vec<i32> = attempts.iter().map(|attempt| to_i32(attempt.1)).collect();
    let statement = format!(
        "UPDATE jobs AS j SET
            lease_expires_at_ms = $4 + j.lease_ms,
            due_at_ms = CASE WHEN j.run_timeout_ms IS NULL OR j.status <> {running} THEN $4 + j.lease_ms
                             ELSE LEAST($4 + j.lease_ms, j.claimed_at_ms + j.run_timeout_ms) END
         FROM UNNEST($1::text[], $2::integer[]) AS h(job_id, attempt)
         WHERE j.job_id = h.job_id AND j.attempt = h.attempt AND j.status IN ({running}, {cancelling})
           AND j.claimed_by = $3 AND j.lease_expires_at_ms > $4
         RETURNING j.job_id, j.attempt, j.lease_expires_at_ms, j.status",
        running = Status::Running as i32,
        cancelling = Status::Cancelling as i32,
    );
    let rows: Vec<(String, i32, i64, i16)> = sqlx::query_as(sqlx::AssertSqlSafe(statement))
        .bind(&job_ids)
        .bind(&numbers)
        .bind(worker_id)
        .bind(now_ms)
        .fetch_all(connection)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(job_id, attempt, lease_end, status)| ((job_id, to_u32(attempt)), (lease_end, status_from_i16(status))))
        .collect())
}

/// The statuses, attempts and workers of jobs (cheap classification reads).
pub async fn fetch_brief(
    connection: &mut PgConnection,
    job_ids: &[String],
) -> Result<HashMap<String, (Status, u32, u32, Option<String>)>, sqlx::Error> {
    let rows: Vec<(String, i16, i32, i32, Option<String>)> =
        sqlx::query_as("SELECT job_id, status, attempt, step, claimed_by FROM jobs WHERE job_id = ANY($1)")
            .bind(job_ids)
            .fetch_all(connection)
            .await?;
    Ok(rows
        .into_iter()
        .map(|(job_id, status, attempt, step, claimed_by)| {
            (
                job_id,
                (status_from_i16(status), to_u32(attempt), to_u32(step), claimed_by),
            )
        })
        .collect())
}

/// Write transitions decided in Rust. Each new state replaces its row only if
/// the row still has the `(status, attempt, step)` it was read with; returns
/// the job ids that were written.
pub async fn compare_and_set(
    connection: &mut PgConnection,
    changes: &[(Status, u32, u32, &JobState)],
) -> Result<HashSet<String>, sqlx::Error> {
    if changes.is_empty() {
        return Ok(HashSet::new());
    }
    let count = changes.len();
    let mut job_ids = Vec::with_capacity(count);
    let mut old_statuses = Vec::with_capacity(count);
    let mut old_attempts = Vec::with_capacity(count);
    let mut old_steps = Vec::with_capacity(count);
    let mut statuses = Vec::with_capacity(count);
    let mut attempts = Vec::with_capacity(count);
    let mut attempts_used = Vec::with_capacity(count);
    let mut steps = Vec::with_capacity(count);
    let mut due_ats: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut step_starts: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut admitted_ats: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut claimed_bys: Vec<Option<String>> = Vec::with_capacity(count);
    let mut claimed_ats: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut lease_ends: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut finished_ats: Vec<Option<i64>> = Vec::with_capacity(count);
    let mut cancel_reasons: Vec<Option<String>> = Vec::with_capacity(count);
    let mut last_errors = Vec::with_capacity(count);
    let mut histories = Vec::with_capacity(count);
    for (old_status, old_attempt, old_step, state) in changes {
        job_ids.push(state.job_id.clone());
        old_statuses.push(status_code(*old_status));
        old_attempts.push(to_i32(*old_attempt));
        old_steps.push(to_i32(*old_step));
        statuses.push(status_code(state.status));
        attempts.push(to_i32(state.attempt));
        attempts_used.push(to_i32(state.attempts_used));
        steps.push(to_i32(state.step));
        due_ats.push(state.due_at_ms);
        step_starts.push(state.step_started_at_ms);
        admitted_ats.push(state.admitted_at_ms);
        claimed_bys.push(state.claimed_by.clone());
        claimed_ats.push(state.claimed_at_ms);
        lease_ends.push(state.lease_expires_at_ms);
        finished_ats.push(state.finished_at_ms);
        cancel_reasons.push(state.cancel_reason.clone());
        last_errors.push(state.last_error.clone());
        histories.push(state.history.encode_to_vec());
    }
    let written: Vec<String> = sqlx::query_scalar(
        "UPDATE jobs AS j SET
            status = u.status, attempt = u.attempt, attempts_used = u.attempts_used, step = u.step,
            due_at_ms = u.due_at_ms, step_started_at_ms = u.step_started_at_ms, admitted_at_ms = u.admitted_at_ms,
            claimed_by = u.claimed_by, claimed_at_ms = u.claimed_at_ms, lease_expires_at_ms = u.lease_expires_at_ms,
            finished_at_ms = u.finished_at_ms, cancel_reason = u.cancel_reason, last_error = u.last_error,
            history = u.history
         FROM UNNEST($1::text[], $2::smallint[], $3::integer[], $4::integer[], $5::smallint[], $6::integer[],
                     $7::integer[], $8::integer[], $9::bigint[], $10::bigint[], $11::bigint[], $12::text[],
                     $13::bigint[], $14::bigint[], $15::bigint[], $16::text[], $17::text[], $18::bytea[])
              AS u(job_id, old_status, old_attempt, old_step, status, attempt, attempts_used, step, due_at_ms,
                   step_started_at_ms, admitted_at_ms, claimed_by, claimed_at_ms, lease_expires_at_ms,
                   finished_at_ms, cancel_reason, last_error, history)
         WHERE j.job_id = u.job_id AND j.status = u.old_status AND j.attempt = u.old_attempt AND j.step = u.old_step
         RETURNING j.job_id",
    )
    .bind(job_ids)
    .bind(old_statuses)
    .bind(old_attempts)
    .bind(old_steps)
    .bind(statuses)
    .bind(attempts)
    .bind(attempts_used)
    .bind(steps)
    .bind(due_ats)
    .bind(step_starts)
    .bind(admitted_ats)
    .bind(claimed_bys)
    .bind(claimed_ats)
    .bind(lease_ends)
    .bind(finished_ats)
    .bind(cancel_reasons)
    .bind(last_errors)
    .bind(histories)
    .fetch_all(connection)
    .await?;
    Ok(written.into_iter().collect())
}

/// Jobs due for the sweeper in the given job partitions, locked (others
/// skip them) for this transaction.
pub async fn lock_due_jobs(
    connection: &mut PgConnection,
    partitions: &[i32],
    now_ms: i64,
    limit: i64,
) -> Result<Vec<JobRow>, sqlx::Error> {
    let statement = format!(
        "SELECT {JOB_COLUMNS} FROM jobs
         WHERE job_partition = ANY($1) AND due_at_ms IS NOT NULL AND due_at_ms <= $2
         ORDER BY due_at_ms LIMIT $3 FOR UPDATE SKIP LOCKED"
    );
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        .bind(partitions)
        .bind(now_ms)
        .bind(limit)
        .fetch_all(connection)
        .await?;
    rows.iter().map(JobRow::from_row).collect()
}
