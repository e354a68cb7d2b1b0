//! What a job partition keeps in PostgreSQL besides the job rows
//! (docs/hot-path.md): a journal row per committed batch holding the changes
//! of the batch's jobs, and a snapshot of the partition's active jobs
//! written when the journal since the last one has outgrown it. Storage
//! formats, not messages between services.

use std::collections::HashMap;

use prost::Message;
use sluice_proto::v1 as pb;

use crate::chain::{History, StoredChain};
use crate::jobs::JobRow;
use crate::transitions::{JobState, Status};

/// The part of a job that changes after it is saved.
#[derive(Clone, PartialEq, prost::Message)]
pub struct JobDynamic {
    #[prost(enumeration = "pb::JobStatus", tag = "1")]
    pub status: i32,
    #[prost(uint32, tag = "2")]
    pub attempt: u32,
    #[prost(uint32, tag = "3")]
    pub attempts_used: u32,
    #[prost(uint32, tag = "4")]
    pub step: u32,
    #[prost(int64, optional, tag = "5")]
    pub due_at_ms: Option<i64>,
    #[prost(int64, optional, tag = "6")]
    pub step_started_at_ms: Option<i64>,
    #[prost(int64, optional, tag = "7")]
    pub admitted_at_ms: Option<i64>,
    #[prost(string, optional, tag = "8")]
    pub claimed_by: Option<String>,
    #[prost(int64, optional, tag = "9")]
    pub claimed_at_ms: Option<i64>,
    #[prost(int64, optional, tag = "10")]
    pub lease_expires_at_ms: Option<i64>,
    #[prost(string, optional, tag = "11")]
    pub cancel_reason: Option<String>,
    #[prost(string, tag = "12")]
    pub last_error: String,
    #[prost(int64, optional, tag = "13")]
    pub finished_at_ms: Option<i64>,
    /// `JobState::pushed`.
    #[prost(bool, tag = "14")]
    pub pushed: bool,
    /// `JobState::confirmed`: its worker showed it holds the attempt (a
    /// claim, a heartbeat), to this owner or an earlier one.
    #[prost(bool, tag = "15")]
    pub confirmed: bool,
    /// `JobState::stream_ended_at_ms`.
    #[prost(int64, optional, tag = "16")]
    pub stream_ended_at_ms: Option<i64>,
}

impl JobDynamic {
    pub fn of(state: &JobState) -> Self {
        JobDynamic {
            status: state.status as i32,
            attempt: state.attempt,
            attempts_used: state.attempts_used,
            step: state.step,
            due_at_ms: state.due_at_ms,
            step_started_at_ms: state.step_started_at_ms,
            admitted_at_ms: state.admitted_at_ms,
            claimed_by: state.claimed_by.clone(),
            claimed_at_ms: state.claimed_at_ms,
            lease_expires_at_ms: state.lease_expires_at_ms,
            cancel_reason: state.cancel_reason.clone(),
            last_error: state.last_error.clone(),
            finished_at_ms: state.finished_at_ms,
            pushed: state.pushed,
            confirmed: state.confirmed,
            stream_ended_at_ms: state.stream_ended_at_ms,
        }
    }

    /// Overwrite `state`'s changing part with this one.
    pub fn apply_to(&self, state: &mut JobState) {
        state.status = Status::try_from(self.status).unwrap_or(Status::Unspecified);
        state.attempt = self.attempt;
        state.attempts_used = self.attempts_used;
        state.step = self.step;
        state.due_at_ms = self.due_at_ms;
        state.step_started_at_ms = self.step_started_at_ms;
        state.admitted_at_ms = self.admitted_at_ms;
        state.claimed_by = self.claimed_by.clone();
        state.claimed_at_ms = self.claimed_at_ms;
        state.lease_expires_at_ms = self.lease_expires_at_ms;
        state.cancel_reason = self.cancel_reason.clone();
        state.last_error = self.last_error.clone();
        state.finished_at_ms = self.finished_at_ms;
        state.pushed = self.pushed;
        state.confirmed = self.confirmed;
        state.stream_ended_at_ms = self.stream_ended_at_ms;
    }
}

/// One job's change in a batch.
#[derive(Clone, PartialEq, prost::Message)]
pub struct JobChange {
    #[prost(string, tag = "1")]
    pub job_id: String,
    /// The job was saved in this batch (its row holds what does not change).
    #[prost(bool, tag = "2")]
    pub created: bool,
    /// The job ended in this batch (its outcome row holds the end); it
    /// leaves the partition's active jobs.
    #[prost(bool, tag = "3")]
    pub removed: bool,
    #[prost(message, optional, tag = "4")]
    pub state: Option<JobDynamic>,
    /// Attempt records added in this batch.
    #[prost(message, repeated, tag = "5")]
    pub history_added: Vec<pb::AttemptRecord>,
    /// The whole history, when records were dropped from its front (it is
    /// bounded) in this batch: it replaces the job's.
    #[prost(message, optional, tag = "6")]
    pub history: Option<History>,
}

/// The journal row of one batch.
#[derive(Clone, PartialEq, prost::Message)]
pub struct JournalBatch {
    #[prost(message, repeated, tag = "1")]
    pub changes: Vec<JobChange>,
}

/// Apply one journal row to a partition's saved active jobs (by id): a
/// job created in it comes from `created` (its row), an ended one leaves.
pub fn replay(rows: &mut HashMap<String, JobRow>, created: &mut HashMap<String, JobRow>, batch: JournalBatch) {
    for change in batch.changes {
        if change.created {
            if let Some(row) = created.remove(&change.job_id) {
                rows.insert(change.job_id.clone(), row);
            }
        }
        if change.removed {
            rows.remove(&change.job_id);
            continue;
        }
        let Some(row) = rows.get_mut(&change.job_id) else {
            continue;
        };
        if let Some(dynamic) = &change.state {
            dynamic.apply_to(&mut row.state);
        }
        match change.history {
            Some(history) => row.state.history = history,
            None => row.state.history.records.extend(change.history_added),
        }
    }
}

/// An active job in a snapshot: its row's content (without the payload,
/// which stays in the row) and its current state.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SnapshotJob {
    #[prost(string, tag = "1")]
    pub job_id: String,
    #[prost(string, tag = "2")]
    pub tenant: String,
    #[prost(string, tag = "3")]
    pub task_group: String,
    #[prost(uint32, tag = "4")]
    pub priority: u32,
    /// The saved request (`pb::JobRequest`), encoded: a snapshot copies the
    /// bytes admission keeps (`jobs::Spec`) without decoding them (the same
    /// wire format as the embedded message it was before).
    #[prost(bytes = "vec", optional, tag = "5")]
    pub spec: Option<Vec<u8>>,
    #[prost(message, optional, tag = "6")]
    pub chain: Option<StoredChain>,
    #[prost(uint32, tag = "7")]
    pub max_attempts: u32,
    #[prost(int64, tag = "8")]
    pub lease_ms: i64,
    #[prost(int64, optional, tag = "9")]
    pub run_timeout_ms: Option<i64>,
    #[prost(int64, tag = "10")]
    pub enqueued_at_us: i64,
    #[prost(int64, optional, tag = "11")]
    pub run_at_ms: Option<i64>,
    #[prost(string, optional, tag = "12")]
    pub idempotency_key: Option<String>,
    #[prost(message, optional, tag = "13")]
    pub trace: Option<pb::TraceContext>,
    #[prost(bytes = "vec", optional, tag = "14")]
    pub request_hash: Option<Vec<u8>>,
    #[prost(message, optional, tag = "15")]
    pub state: Option<JobDynamic>,
    #[prost(message, optional, tag = "16")]
    pub history: Option<History>,
}

/// Every active job of a partition after the batch `seq`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Snapshot {
    #[prost(message, repeated, tag = "1")]
    pub jobs: Vec<SnapshotJob>,
}

/// The active jobs a saved snapshot holds, by id. The encoded snapshot is
/// dropped once decoded, and each decoded job as its row is made: a
/// partition of a million waiting jobs is loaded with the least held at
/// once (issue 30).
pub fn rows_of_snapshot(encoded: Vec<u8>, partition: i32) -> Result<HashMap<String, JobRow>, prost::DecodeError> {
    use prost::bytes::Buf as _;
    use prost::encoding::{decode_key, skip_field, DecodeContext, WireType};
    // `Snapshot` decoded one job at a time: a decoded `SnapshotJob` is
    // about a kilobyte, and a vector of them all beside the rows made of
    // them was most of a takeover's peak.
    let mut rows = HashMap::new();
    let mut buffer = encoded.as_slice();
    while buffer.has_remaining() {
        let (tag, wire_type) = decode_key(&mut buffer)?;
        if tag != 1 || wire_type != WireType::LengthDelimited {
            skip_field(wire_type, tag, &mut buffer, DecodeContext::default())?;
            continue;
        }
        let row = SnapshotJob::decode_length_delimited(&mut buffer)?.into_row(partition);
        rows.insert(row.state.job_id.clone(), row);
    }
    rows.shrink_to_fit();
    Ok(rows)
}

/// `items` without spare capacity: a decoded repeated field grows by
/// doubling (a one-step chain was held in room for four), and a waiting
/// job keeps what it loads for as long as it waits.
pub fn compact<T>(mut items: Vec<T>) -> Vec<T> {
    items.shrink_to_fit();
    items
}

impl SnapshotJob {
    pub fn of(row: &JobRow) -> Self {
        SnapshotJob {
            job_id: row.state.job_id.clone(),
            tenant: row.tenant.clone(),
            task_group: row.task_group.clone(),
            priority: row.priority,
            spec: Some(row.spec.encoded().to_vec()),
            chain: Some(StoredChain {
                steps: row.state.chain.clone(),
            }),
            max_attempts: row.state.max_attempts,
            lease_ms: row.state.lease_ms,
            run_timeout_ms: row.state.run_timeout_ms,
            enqueued_at_us: row.enqueued_at_us,
            run_at_ms: row.run_at_ms,
            idempotency_key: row.idempotency_key.clone(),
            trace: Some(row.trace.clone()),
            request_hash: row.request_hash.clone(),
            state: Some(JobDynamic::of(&row.state)),
            history: Some(row.state.history.clone()),
        }
    }

    /// The job row it describes, without its payload; `job_partition` is
    /// the snapshot's partition.
    pub fn into_row(self, job_partition: i32) -> JobRow {
        // A snapshot holds what a spec encoded, so it decodes; a job whose
        // spec did not loads with an empty request (its row in the jobs
        // table still holds the request), and says so.
        let (spec, request) = crate::jobs::Spec::decode(self.spec.unwrap_or_default()).unwrap_or_else(|error| {
            tracing::error!(job_id = %self.job_id, %error, "a snapshot's saved request does not decode; loading the job without it");
            Default::default()
        });
        let retry =
            crate::chain::RetrySettings::from_request(request.retry.as_ref()).unwrap_or(crate::chain::RetrySettings {
                max_attempts: 1,
                initial_backoff_ms: 1_000,
                max_backoff_ms: 300_000,
                multiplier: 2.0,
                fail_on_lease_expiry: false,
            });
        let mut state = JobState {
            job_id: self.job_id,
            status: Status::Unspecified,
            attempt: 1,
            attempts_used: 0,
            max_attempts: self.max_attempts,
            step: 0,
            chain: compact(self.chain.unwrap_or_default().steps),
            retry,
            lease_ms: self.lease_ms,
            run_timeout_ms: self.run_timeout_ms,
            due_at_ms: None,
            step_started_at_ms: None,
            admitted_at_ms: None,
            claimed_by: None,
            claimed_at_ms: None,
            lease_expires_at_ms: None,
            finished_at_ms: None,
            cancel_reason: None,
            last_error: String::new(),
            history: {
                let mut history = self.history.unwrap_or_default();
                history.records = compact(history.records);
                history
            },
            confirmed: false,
            heard_at_ms: None,
            pushed: false,
            stream_ended_at_ms: None,
        };
        if let Some(dynamic) = &self.state {
            dynamic.apply_to(&mut state);
        }
        JobRow {
            state,
            tenant: self.tenant,
            task_group: self.task_group,
            priority: self.priority,
            spec,
            payload: Vec::new(),
            job_partition,
            enqueued_at_us: self.enqueued_at_us,
            run_at_ms: self.run_at_ms,
            idempotency_key: self.idempotency_key,
            trace: self.trace.unwrap_or_default(),
            request_hash: self.request_hash,
        }
    }
}

pub fn encode<M: Message>(message: &M) -> Vec<u8> {
    message.encode_to_vec()
}

#[cfg(test)]
mod tests {
    use prost::Message;
    use sluice_proto::v1 as pb;

    use super::{rows_of_snapshot, Snapshot, SnapshotJob};

    /// A snapshot job as it was saved before its spec was kept encoded: the
    /// request as an embedded message under the same tag.
    #[derive(Clone, PartialEq, prost::Message)]
    struct SnapshotJobWithMessage {
        #[prost(string, tag = "1")]
        job_id: String,
        #[prost(message, optional, tag = "5")]
        spec: Option<pb::JobRequest>,
    }

    #[test]
    fn a_snapshot_saved_with_the_request_as_a_message_loads_the_same_request() {
        let request = pb::JobRequest {
            job_id: Some("j1".to_string()),
            tenant: "acme".to_string(),
            task_group: "default".to_string(),
            fairness_key: "customer-7".to_string(),
            limits: vec![pb::Limit {
                kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                    key: "k".to_string(),
                    max_concurrency: 3,
                    shadow: false,
                })),
            }],
            retry: Some(pb::RetryPolicy {
                max_attempts: 4,
                initial_backoff: "2s".to_string(),
                ..pb::RetryPolicy::default()
            }),
            ..pb::JobRequest::default()
        };
        let old = SnapshotJobWithMessage {
            job_id: "j1".to_string(),
            spec: Some(request.clone()),
        }
        .encode_to_vec();
        let loaded = SnapshotJob::decode(old.as_slice()).expect("an old snapshot job decodes");
        let row = loaded.into_row(0);
        assert_eq!(row.spec.request(), request);
        assert_eq!(row.spec.fairness_key(), "customer-7");
        assert_eq!(row.state.retry.max_attempts, 4);
        assert_eq!(row.state.retry.initial_backoff_ms, 2_000);
        // And the new encoding reads back as the old message.
        let new = SnapshotJob::of(&row).encode_to_vec();
        let read_old = SnapshotJobWithMessage::decode(new.as_slice()).expect("decodes as the old message");
        assert_eq!(read_old.spec, Some(request));
    }

    fn snapshot_job(job_id: &str, key: &str) -> SnapshotJob {
        let request = pb::JobRequest {
            job_id: Some(job_id.to_string()),
            tenant: "acme".to_string(),
            limits: vec![pb::Limit {
                kind: Some(pb::limit::Kind::Concurrency(pb::ConcurrencyLimit {
                    key: key.to_string(),
                    max_concurrency: 2,
                    shadow: false,
                })),
            }],
            ..pb::JobRequest::default()
        };
        SnapshotJob {
            job_id: job_id.to_string(),
            tenant: "acme".to_string(),
            spec: Some(request.encode_to_vec()),
            chain: Some(crate::chain::StoredChain {
                steps: vec![crate::chain::StoredStep {
                    tenant: "acme".to_string(),
                    key: key.to_string(),
                    max_concurrency: 2,
                    ..Default::default()
                }],
            }),
            ..SnapshotJob::default()
        }
    }

    #[test]
    fn a_snapshot_read_one_job_at_a_time_gives_the_rows_a_whole_decode_gives() {
        let snapshot = Snapshot {
            jobs: vec![
                snapshot_job("a", "k1"),
                snapshot_job("b", "k2"),
                snapshot_job("c", "k1"),
            ],
        };
        let mut encoded = snapshot.encode_to_vec();
        // A field a later version might add is passed over.
        prost::encoding::string::encode(9, &"later".to_string(), &mut encoded);
        let rows = rows_of_snapshot(encoded.clone(), 3).expect("decodes");
        let whole = Snapshot::decode(encoded.as_slice()).expect("decodes whole");
        assert_eq!(rows.len(), 3);
        for job in whole.jobs {
            let expected = job.into_row(3);
            let row = &rows[&expected.state.job_id];
            assert_eq!(row.spec, expected.spec);
            assert_eq!(row.state.chain, expected.state.chain);
            assert_eq!(row.state.chain.capacity(), row.state.chain.len(), "no spare room held");
            assert_eq!(row.job_partition, 3);
        }
        // A snapshot cut short (inside its last job) is an error, not a
        // partial load.
        let jobs_only = snapshot.encode_to_vec();
        let cut = &jobs_only[..jobs_only.len() - 2];
        assert!(rows_of_snapshot(cut.to_vec(), 3).is_err());
    }

    #[test]
    fn a_snapshot_job_whose_request_does_not_decode_loads_without_it() {
        let mut job = snapshot_job("garbled", "k1");
        job.spec = Some(vec![0xff, 0x00, 0xff]);
        let row = job.into_row(0);
        assert_eq!(row.state.job_id, "garbled");
        assert_eq!(row.state.chain.len(), 1, "the chain is kept");
        assert_eq!(row.spec.request(), pb::JobRequest::default());
        // And a whole snapshot holding it still loads its other jobs.
        let mut bad = snapshot_job("garbled", "k1");
        bad.spec = Some(vec![0xff, 0x00, 0xff]);
        let snapshot = Snapshot {
            jobs: vec![bad, snapshot_job("fine", "k2")],
        };
        let rows = rows_of_snapshot(snapshot.encode_to_vec(), 0).expect("decodes");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows["fine"].spec.request().tenant, "acme");
    }
}
