//! The job row: written once, at enqueue (batched), and read back for jobs
//! that are not active in memory (`store`). What changes afterwards is
//! journaled; how a job ended is its outcome row.

use std::collections::HashSet;

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
    pub spec: Spec,
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

/// The request as saved (with the job id set and no payload), kept
/// encoded: every waiting job holds one, and a decoded `pb::JobRequest` costs
/// a few hundred bytes inline and an allocation per string and list where
/// the encoding is one allocation of about a hundred bytes (issue 30). What
/// a batch needs of it on every send (the fairness key) is kept beside it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Spec {
    encoded: Box<[u8]>,
    fairness_key: Box<str>,
}

impl Spec {
    pub fn of(request: &pb::JobRequest) -> Spec {
        Spec {
            encoded: request.encode_to_vec().into_boxed_slice(),
            fairness_key: request.fairness_key.as_str().into(),
        }
    }

    /// A spec as the jobs table stores it.
    pub fn decode(encoded: Vec<u8>) -> Result<(Spec, pb::JobRequest), prost::DecodeError> {
        let request = pb::JobRequest::decode(encoded.as_slice())?;
        let spec = Spec {
            fairness_key: request.fairness_key.as_str().into(),
            encoded: encoded.into_boxed_slice(),
        };
        Ok((spec, request))
    }

    /// The request. A spec is only ever made from a request (`of`) or from
    /// bytes that decoded (`decode`), so this decodes; an empty request if
    /// it ever did not.
    pub fn request(&self) -> pb::JobRequest {
        pb::JobRequest::decode(&*self.encoded).unwrap_or_default()
    }

    pub fn encoded(&self) -> &[u8] {
        &self.encoded
    }

    pub fn fairness_key(&self) -> &str {
        &self.fairness_key
    }
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
        let (spec, request) = Spec::decode(row.try_get("spec")?).map_err(|error| decode_error("spec", error))?;
        let history_bytes: Option<Vec<u8>> = row.try_get("history")?;
        let mut history = match history_bytes {
            Some(bytes) => History::decode(bytes.as_slice()).map_err(|error| decode_error("history", error))?,
            None => History::default(),
        };
        history.records = crate::journal::compact(history.records);
        let retry = RetrySettings::from_request(request.retry.as_ref()).unwrap_or(RetrySettings {
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
            chain: crate::journal::compact(chain.steps),
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
            confirmed: false,
            heard_at_ms: None,
            pushed: false,
            stream_ended_at_ms: None,
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
    fetch_jobs_selecting(connection, job_ids, JOB_COLUMNS).await
}

/// Every column of a job row but its payload (read back empty).
pub fn job_columns_without_payload() -> String {
    JOB_COLUMNS.replace(" payload,", " ''::bytea AS payload,")
}

/// `fetch_jobs` without the payloads: what a new owner loads (a payload is
/// read when its job is admitted), so a takeover of a partition with many
/// waiting jobs neither reads nor holds their payloads.
pub async fn fetch_jobs_without_payloads(
    connection: &mut PgConnection,
    job_ids: &[String],
) -> Result<Vec<JobRow>, sqlx::Error> {
    fetch_jobs_selecting(connection, job_ids, &job_columns_without_payload()).await
}

async fn fetch_jobs_selecting(
    connection: &mut PgConnection,
    job_ids: &[String],
    columns: &str,
) -> Result<Vec<JobRow>, sqlx::Error> {
    if job_ids.is_empty() {
        return Ok(Vec::new());
    }
    let statement = format!("SELECT {columns} FROM jobs WHERE job_id = ANY($1)");
    let rows = sqlx::query(sqlx::AssertSqlSafe(statement))
        // Planned for these values each time (see admission's `stored_jobs`).
        .persistent(false)
        .bind(job_ids)
        .fetch_all(connection)
        .await?;
    rows.iter().map(JobRow::from_row).collect()
}

/// Job rows as one array per column, for an insert through UNNEST.
struct JobColumns {
    job_ids: Vec<String>,
    tenants: Vec<String>,
    task_groups: Vec<String>,
    priorities: Vec<i16>,
    statuses: Vec<i16>,
    max_attempts: Vec<i32>,
    chain_lens: Vec<i32>,
    chains: Vec<Vec<u8>>,
    specs: Vec<Vec<u8>>,
    payloads: Vec<Vec<u8>>,
    partitions: Vec<i32>,
    leases: Vec<i64>,
    run_timeouts: Vec<Option<i64>>,
    enqueued: Vec<i64>,
    run_ats: Vec<Option<i64>>,
    due_ats: Vec<Option<i64>>,
    step_starts: Vec<Option<i64>>,
    admitted_ats: Vec<Option<i64>>,
    idempotency_keys: Vec<Option<String>>,
    traceparents: Vec<String>,
    tracestates: Vec<String>,
    request_hashes: Vec<Option<Vec<u8>>>,
}

impl JobColumns {
    fn of(jobs: &[JobRow]) -> Self {
        let count = jobs.len();
        let mut columns = JobColumns {
            job_ids: Vec::with_capacity(count),
            tenants: Vec::with_capacity(count),
            task_groups: Vec::with_capacity(count),
            priorities: Vec::with_capacity(count),
            statuses: Vec::with_capacity(count),
            max_attempts: Vec::with_capacity(count),
            chain_lens: Vec::with_capacity(count),
            chains: Vec::with_capacity(count),
            specs: Vec::with_capacity(count),
            payloads: Vec::with_capacity(count),
            partitions: Vec::with_capacity(count),
            leases: Vec::with_capacity(count),
            run_timeouts: Vec::with_capacity(count),
            enqueued: Vec::with_capacity(count),
            run_ats: Vec::with_capacity(count),
            due_ats: Vec::with_capacity(count),
            step_starts: Vec::with_capacity(count),
            admitted_ats: Vec::with_capacity(count),
            idempotency_keys: Vec::with_capacity(count),
            traceparents: Vec::with_capacity(count),
            tracestates: Vec::with_capacity(count),
            request_hashes: Vec::with_capacity(count),
        };
        for job in jobs {
            columns.job_ids.push(job.state.job_id.clone());
            columns.tenants.push(job.tenant.clone());
            columns.task_groups.push(job.task_group.clone());
            columns.priorities.push(i16::try_from(job.priority).unwrap_or(i16::MAX));
            columns.statuses.push(status_code(job.state.status));
            columns.max_attempts.push(to_i32(job.state.max_attempts));
            columns.chain_lens.push(to_i32(job.state.chain_len()));
            columns.chains.push(
                StoredChain {
                    steps: job.state.chain.clone(),
                }
                .encode_to_vec(),
            );
            columns.specs.push(job.spec.encoded().to_vec());
            columns.payloads.push(job.payload.clone());
            columns.partitions.push(job.job_partition);
            columns.leases.push(job.state.lease_ms);
            columns.run_timeouts.push(job.state.run_timeout_ms);
            columns.enqueued.push(job.enqueued_at_us);
            columns.run_ats.push(job.run_at_ms);
            columns.due_ats.push(job.state.due_at_ms);
            columns.step_starts.push(job.state.step_started_at_ms);
            columns.admitted_ats.push(job.state.admitted_at_ms);
            columns.idempotency_keys.push(job.idempotency_key.clone());
            columns.traceparents.push(job.trace.traceparent.clone());
            columns.tracestates.push(job.trace.tracestate.clone());
            columns.request_hashes.push(job.request_hash.clone());
        }
        columns
    }
}

/// Insert new rows; returns the ids that were new (the others existed).
pub async fn insert_jobs(connection: &mut PgConnection, jobs: &[JobRow]) -> Result<HashSet<String>, sqlx::Error> {
    if jobs.is_empty() {
        return Ok(HashSet::new());
    }
    let columns = JobColumns::of(jobs);
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
    .bind(columns.job_ids)
    .bind(columns.tenants)
    .bind(columns.task_groups)
    .bind(columns.priorities)
    .bind(columns.statuses)
    .bind(columns.max_attempts)
    .bind(columns.chain_lens)
    .bind(columns.chains)
    .bind(columns.specs)
    .bind(columns.payloads)
    .bind(columns.partitions)
    .bind(columns.leases)
    .bind(columns.run_timeouts)
    .bind(columns.enqueued)
    .bind(columns.run_ats)
    .bind(columns.due_ats)
    .bind(columns.step_starts)
    .bind(columns.admitted_ats)
    .bind(columns.idempotency_keys)
    .bind(columns.traceparents)
    .bind(columns.tracestates)
    .bind(columns.request_hashes)
    .fetch_all(connection)
    .await?;
    Ok(inserted.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::{job_columns_without_payload, JOB_COLUMNS};

    #[test]
    fn a_load_selects_every_column_but_the_payload() {
        let columns = job_columns_without_payload();
        assert_eq!(columns.matches("''::bytea AS payload").count(), 1, "{columns}");
        let names = |columns: &str| -> Vec<String> {
            columns
                .split(',')
                .map(|column| column.split_whitespace().last().unwrap_or_default().to_string())
                .collect()
        };
        assert_eq!(names(&columns), names(JOB_COLUMNS));
    }
}
