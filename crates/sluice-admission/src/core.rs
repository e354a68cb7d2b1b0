//! Admission's flows, shared by the Kafka consumers, the gRPC service and the
//! sweeper. Every flow saves first, then publishes; a crash between the two
//! is repaired by redelivery or by the sweeper re-sending the pending effect.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use opentelemetry::KeyValue;
use sluice_common::clock::{wall_clock_ms, wall_clock_us};
use sluice_common::fault::classify_sql;
use sluice_common::kafka::{Outbox, Publisher};
use sluice_common::link::{Link, LinkClient};
use sluice_common::readiness::Readiness;
use sluice_common::telemetry::record_span;
use sluice_common::{FaultPoint, Faults, SluiceConfig};
use sluice_proto::v1 as pb;
use sqlx::{Connection, PgPool};

use crate::chain::{History, ValidJob};
use crate::effects::Routes;
use crate::jobs::{self, GrantKey, JobRow};
use crate::transitions::{self, AttemptEnd, Effect, JobState, Status, Timing};

#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
    /// A job id that exists with a different request (`OnConflict::Refuse`).
    #[error("job {job_id:?} already exists with a different request")]
    Conflict { index: usize, job_id: String },
    /// A fault hook stopped the instance (tests).
    #[error("crash injected")]
    Crashed,
}

impl AdmissionError {
    /// Whether doing the same again can succeed (`sluice_common::fault`).
    pub fn is_transient(&self) -> bool {
        match self {
            AdmissionError::Database(error) => classify_sql(error).is_transient(),
            AdmissionError::Conflict { .. } => false,
            AdmissionError::Crashed => true,
        }
    }

    /// The gRPC answer: UNAVAILABLE (retry) only for faults that pass.
    pub fn to_status(&self) -> tonic::Status {
        match self {
            AdmissionError::Database(error) if classify_sql(error).is_transient() => {
                tracing::warn!(%error, "database error");
                tonic::Status::unavailable("database unavailable; retry")
            }
            AdmissionError::Database(error) => {
                tracing::error!(%error, "PostgreSQL refuses the request's data");
                tonic::Status::internal(format!(
                    "the request cannot be stored ({}); retrying will not help",
                    sluice_common::fault::clean_text(&error.to_string(), 512)
                ))
            }
            AdmissionError::Conflict { .. } => tonic::Status::already_exists(self.to_string()),
            AdmissionError::Crashed => tonic::Status::unavailable("instance stopping"),
        }
    }
}

/// What `enqueue` does with a request whose job id exists with a different
/// request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnConflict {
    /// Save nothing of the batch; answer `AdmissionError::Conflict` (gRPC).
    Refuse,
    /// Save the rest; the outcome says `conflict` (Kafka: a dead letter).
    Report,
}

/// A validated request with its id and trace context.
#[derive(Clone, Debug)]
pub struct Incoming {
    pub job_id: String,
    pub valid: ValidJob,
    pub trace: pb::TraceContext,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EnqueueOutcome {
    pub job_id: String,
    pub status: Status,
    /// The job already existed (the same request again, or the same
    /// idempotency key within its window): nothing new was saved.
    pub deduplicated: bool,
    /// The job id exists with a different request: nothing was saved.
    pub conflict: bool,
}

/// The hot path's streams to limit-grant and rate-window.
#[derive(Clone)]
pub struct AdmissionLinks {
    pub limit: LinkClient,
    pub rate: LinkClient,
}

pub struct AdmissionCore {
    pub config: Arc<SluiceConfig>,
    pub pool: PgPool,
    pub publisher: Publisher,
    pub links: AdmissionLinks,
    pub routes: Routes,
    pub faults: Faults,
    pub timing: Timing,
    /// The instance's readiness: faults being retried are conditions on it.
    pub readiness: Readiness,
    last_enqueued_at_us: AtomicI64,
}

/// Claim results by (job, attempt).
pub type ClaimResults = Vec<pb::ClaimResult>;

impl AdmissionCore {
    pub fn new(
        config: Arc<SluiceConfig>,
        pool: PgPool,
        publisher: Publisher,
        links: AdmissionLinks,
        faults: Faults,
        readiness: Readiness,
    ) -> Self {
        let timing = Timing {
            resend_waiting_after_ms: config.admission.resend_waiting_after.as_millis_i64(),
            claim_timeout_ms: config.admission.claim_timeout.as_millis_i64(),
        };
        AdmissionCore {
            routes: Routes::from_config(&config),
            config,
            pool,
            publisher,
            links,
            faults,
            timing,
            readiness,
            last_enqueued_at_us: AtomicI64::new(0),
        }
    }

    /// A fault that passes is being retried: not ready until it clears.
    pub fn note_transient(&self, condition: &str, reason: String) {
        self.readiness.set(condition, reason);
        sluice_common::metrics::metrics()
            .transient_faults
            .add(1, &[KeyValue::new("service", crate::SERVICE)]);
    }

    /// Enqueue times are strictly increasing within an instance, so equal
    /// priorities keep arrival order.
    fn next_enqueue_time_us(&self) -> i64 {
        let now = wall_clock_us();
        let mut previous = self.last_enqueued_at_us.load(Ordering::Relaxed);
        loop {
            let next = now.max(previous + 1);
            match self
                .last_enqueued_at_us
                .compare_exchange_weak(previous, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return next,
                Err(actual) => previous = actual,
            }
        }
    }

    /// Publish, retrying for a while. What is saved is never lost: if Kafka
    /// stays down the sweeper re-sends the pending effects later.
    pub async fn publish(&self, mut outbox: Outbox) {
        // Commands to limit-grant and rate-window go on the links, which keep
        // them until their owner has applied them.
        for ((link, partition), commands) in outbox.take_links() {
            match link {
                Link::LimitGrant => self.links.limit.send(partition, commands),
                Link::RateWindow => self.links.rate.send(partition, commands),
                Link::Admission => tracing::error!(partition, "admission cannot send grants; dropped"),
            }
        }
        if outbox.is_empty() {
            return;
        }
        let messages = outbox.into_messages();
        // What admission publishes to Kafka (admitted jobs) is rebuilt from
        // its state (an unclaimed job is published again after
        // `claim_timeout`), so waiting long for a broker in trouble only
        // holds up the grants and requests behind this one.
        let attempts = async {
            let mut delay = Duration::from_millis(50);
            for attempt in 1.. {
                match self.publisher.send_all(messages.clone()).await {
                    Ok(()) => return,
                    Err(error) => {
                        tracing::warn!(%error, attempt, "publish failed, retrying");
                        tokio::time::sleep(delay).await;
                        delay = (delay * 2).min(Duration::from_secs(1));
                    }
                }
            }
        };
        if tokio::time::timeout(PUBLISH_BUDGET, attempts).await.is_err() {
            tracing::error!(
                budget = ?PUBLISH_BUDGET,
                "giving up publishing for now; the sweeper re-sends the saved effects"
            );
        }
    }

    /// The row `enqueue` saves for `incoming` (its state decided at `now_ms`).
    pub fn new_row(&self, incoming: &Incoming, now_ms: i64) -> JobRow {
        let valid = &incoming.valid;
        // The job's own span, under the producer's: every span of the job
        // hangs below it, across services.
        let now = std::time::SystemTime::now();
        let job_trace = record_span(
            SCOPE,
            "admission.enqueue",
            &incoming.trace,
            now,
            now,
            vec![
                KeyValue::new("sluice.job_id", incoming.job_id.clone()),
                KeyValue::new("sluice.tenant", valid.request.tenant.clone()),
                KeyValue::new("sluice.task_group", valid.request.task_group.clone()),
                KeyValue::new("sluice.limits", i64::try_from(valid.chain.len()).unwrap_or(i64::MAX)),
            ],
        );
        let mut spec = valid.request.clone();
        spec.payload = Vec::new();
        spec.job_id = Some(incoming.job_id.clone());
        let request_hash = Some(jobs::request_fingerprint(&spec, &valid.request.payload));
        let mut state = JobState {
            job_id: incoming.job_id.clone(),
            status: Status::Scheduled,
            attempt: 1,
            attempts_used: 0,
            max_attempts: valid.retry.max_attempts,
            step: 0,
            chain: valid.chain.clone(),
            retry: valid.retry,
            lease_ms: valid.lease_ms,
            run_timeout_ms: valid.run_timeout_ms,
            due_at_ms: None,
            step_started_at_ms: None,
            admitted_at_ms: None,
            claimed_by: None,
            claimed_at_ms: None,
            lease_expires_at_ms: None,
            finished_at_ms: None,
            cancel_reason: None,
            last_error: String::new(),
            history: History::default(),
        };
        match valid.request.run_at_ms {
            Some(run_at) if run_at > now_ms => state.due_at_ms = Some(run_at),
            _ => {
                transitions::start_acquiring(&mut state, now_ms, self.timing);
            }
        }
        JobRow {
            state,
            tenant: valid.request.tenant.clone(),
            task_group: valid.request.task_group.clone(),
            priority: valid.priority,
            spec,
            payload: valid.request.payload.clone(),
            job_partition: self.routes.job_partition(&incoming.job_id),
            enqueued_at_us: self.next_enqueue_time_us(),
            run_at_ms: valid.request.run_at_ms,
            idempotency_key: if valid.request.idempotency_key.is_empty() {
                None
            } else {
                Some(valid.request.idempotency_key.clone())
            },
            trace: job_trace,
            request_hash,
        }
    }

    /// Save new jobs (deduplicated by id and idempotency key), then send
    /// their first effects. The same job id with a different request is a
    /// conflict, handled as `on_conflict` says.
    pub async fn enqueue(
        &self,
        incoming: &[Incoming],
        on_conflict: OnConflict,
    ) -> Result<Vec<EnqueueOutcome>, AdmissionError> {
        let now_ms = wall_clock_ms();
        tracing::debug!(jobs = incoming.len(), "enqueue batch");
        let rows: Vec<JobRow> = incoming.iter().map(|request| self.new_row(request, now_ms)).collect();
        let mut outbox = Outbox::new();
        let mut outcomes: Vec<Option<EnqueueOutcome>> = vec![None; rows.len()];

        if self.faults.hit(FaultPoint::AdmissionSaveRefused) {
            return Err(AdmissionError::Database(sluice_common::faults::refused_by_storage()));
        }
        let mut connection = self.pool.acquire().await?;
        let mut transaction = connection.begin().await?;
        // Idempotency keys: the first request of a (tenant, key) in the batch
        // claims it; later ones, and ones whose key is held, are duplicates.
        let mut claims = Vec::new();
        let mut claim_index: HashMap<(String, String), usize> = HashMap::new();
        for (index, (row, request)) in rows.iter().zip(incoming).enumerate() {
            if let (Some(key), Some(window_ms)) = (&row.idempotency_key, request.valid.idempotency_window_ms) {
                let pair = (row.tenant.clone(), key.clone());
                if let std::collections::hash_map::Entry::Vacant(entry) = claim_index.entry(pair) {
                    entry.insert(index);
                    claims.push((
                        row.tenant.clone(),
                        key.clone(),
                        row.state.job_id.clone(),
                        now_ms.saturating_add(window_ms),
                    ));
                }
            }
        }
        let started = std::time::Instant::now();
        let holders = jobs::claim_idempotency_keys(&mut transaction, &claims, now_ms).await?;
        let mut to_insert: Vec<JobRow> = Vec::new();
        let mut insert_positions: Vec<usize> = Vec::new();
        // The first row of each job id in the batch; later ones repeat it.
        let mut first_of: HashMap<String, usize> = HashMap::new();
        let mut repeats: Vec<(usize, usize)> = Vec::new();
        let mut existing_ids: Vec<String> = Vec::new();
        for (index, row) in rows.iter().enumerate() {
            if let Some(key) = &row.idempotency_key {
                let holder = holders.get(&(row.tenant.clone(), key.clone()));
                if let Some(holder) = holder {
                    if holder != &row.state.job_id {
                        outcomes[index] = Some(EnqueueOutcome {
                            job_id: holder.clone(),
                            status: Status::Unspecified,
                            deduplicated: true,
                            conflict: false,
                        });
                        existing_ids.push(holder.clone());
                        continue;
                    }
                }
            }
            match first_of.entry(row.state.job_id.clone()) {
                std::collections::hash_map::Entry::Occupied(first) => {
                    repeats.push((index, *first.get()));
                    continue;
                }
                std::collections::hash_map::Entry::Vacant(entry) => {
                    entry.insert(index);
                }
            }
            to_insert.push(row.clone());
            insert_positions.push(index);
        }
        let inserted = jobs::insert_jobs(&mut transaction, &to_insert).await?;
        let mut redelivered: Vec<usize> = Vec::new();
        for (row, index) in to_insert.iter().zip(&insert_positions) {
            if !inserted.contains(&row.state.job_id) {
                redelivered.push(*index);
                existing_ids.push(row.state.job_id.clone());
            }
        }
        existing_ids.sort_unstable();
        existing_ids.dedup();
        let existing: HashMap<String, JobRow> = jobs::fetch_jobs(&mut transaction, &existing_ids)
            .await?
            .into_iter()
            .map(|row| (row.state.job_id.clone(), row))
            .collect();
        // The same id again: a redelivery when the request is the same, a
        // conflict when it is not.
        let same_request = |row: &JobRow, saved: Option<&Vec<u8>>| match (saved, &row.request_hash) {
            (Some(saved), Some(ours)) => saved == ours,
            _ => true,
        };
        let mut conflicts: Vec<usize> = Vec::new();
        let mut resend: Vec<String> = Vec::new();
        for index in &redelivered {
            let row = &rows[*index];
            let saved = existing.get(&row.state.job_id);
            if same_request(row, saved.and_then(|saved| saved.request_hash.as_ref())) {
                resend.push(row.state.job_id.clone());
                outcomes[*index] = Some(EnqueueOutcome {
                    job_id: row.state.job_id.clone(),
                    status: saved.map_or(row.state.status, |saved| saved.state.status),
                    deduplicated: true,
                    conflict: false,
                });
            } else {
                conflicts.push(*index);
            }
        }
        for (index, first) in &repeats {
            // The request the id stands for: the one saved now, else the one
            // saved before (the first occurrence may itself be a conflict).
            let first_row = &rows[*first];
            let reference = if inserted.contains(&first_row.state.job_id) {
                first_row.request_hash.as_ref()
            } else {
                existing
                    .get(&first_row.state.job_id)
                    .and_then(|saved| saved.request_hash.as_ref())
            };
            if same_request(&rows[*index], reference) {
                continue;
            }
            conflicts.push(*index);
        }
        conflicts.sort_unstable();
        if let (OnConflict::Refuse, Some(index)) = (on_conflict, conflicts.first()) {
            // Nothing of the batch is saved.
            drop(transaction);
            return Err(AdmissionError::Conflict {
                index: *index,
                job_id: rows[*index].state.job_id.clone(),
            });
        }
        transaction.commit().await?;
        drop(connection);

        if self.faults.hit(FaultPoint::AdmissionAfterSaveBeforeAcquire) {
            return Err(AdmissionError::Crashed);
        }
        for row in &to_insert {
            if !inserted.contains(&row.state.job_id) {
                continue;
            }
            match row.state.status {
                Status::Waiting => self.routes.push_acquire(&mut outbox, row),
                Status::Admitted => self.routes.push_admitted(&mut outbox, row),
                _ => {}
            }
        }
        // A redelivered request changes nothing and re-sends its effect.
        for job_id in &resend {
            if let Some(row) = existing.get(job_id) {
                self.push_pending_effect(&mut outbox, row);
            }
        }
        record_commit(started);
        self.publish(outbox).await;

        for index in &conflicts {
            let row = &rows[*index];
            outcomes[*index] = Some(EnqueueOutcome {
                job_id: row.state.job_id.clone(),
                status: existing
                    .get(&row.state.job_id)
                    .map_or(Status::Unspecified, |saved| saved.state.status),
                deduplicated: false,
                conflict: true,
            });
        }
        let mut results = Vec::with_capacity(rows.len());
        for (index, row) in rows.iter().enumerate() {
            let outcome = match outcomes[index].take() {
                Some(outcome) if outcome.deduplicated && outcome.status == Status::Unspecified => EnqueueOutcome {
                    status: existing
                        .get(&outcome.job_id)
                        .map_or(Status::Unspecified, |job| job.state.status),
                    ..outcome
                },
                Some(outcome) => outcome,
                None => {
                    let repeat = repeats.iter().any(|(repeat, _)| *repeat == index);
                    EnqueueOutcome {
                        job_id: row.state.job_id.clone(),
                        status: row.state.status,
                        deduplicated: repeat,
                        conflict: false,
                    }
                }
            };
            results.push(outcome);
        }
        Ok(results)
    }

    /// The effect a job in its current state is waiting on.
    fn push_pending_effect(&self, outbox: &mut Outbox, row: &JobRow) {
        match row.state.status {
            Status::Waiting => self.routes.push_acquire(outbox, row),
            Status::Admitted => self.routes.push_admitted(outbox, row),
            _ => {}
        }
    }

    /// Apply grant events: advance the job, then acquire its next step or
    /// publish it to workers. A duplicate re-sends its effect; a grant nobody
    /// wants is answered with a release.
    pub async fn process_grants(&self, events: Vec<pb::GrantEvent>) -> Result<(), AdmissionError> {
        let now_ms = wall_clock_ms();
        tracing::debug!(events = events.len(), "grant batch");
        let mut keys: Vec<GrantKey> = Vec::with_capacity(events.len());
        let mut by_key: HashMap<GrantKey, pb::GrantEvent> = HashMap::with_capacity(events.len());
        for event in events {
            let Some(ticket) = &event.ticket else {
                tracing::warn!(?event, "grant event without a ticket");
                continue;
            };
            let key = GrantKey {
                job_id: ticket.job_id.clone(),
                attempt: ticket.attempt,
                step: ticket.step,
            };
            if by_key.insert(key.clone(), event).is_none() {
                keys.push(key);
            }
        }
        // A rate limit naming no stored resource did not throttle: say so in
        // the job's history (GetJob shows it).
        let additions: Vec<Vec<u8>> = keys
            .iter()
            .map(|key| match by_key.get(key) {
                Some(event) if event.unthrottled => jobs::history_append(&[pb::AttemptRecord {
                    attempt: key.attempt,
                    outcome: "unthrottled".to_string(),
                    detail: format!(
                        "rate limit {} names no stored resource: not throttled",
                        event
                            .key
                            .as_ref()
                            .map(|key_ref| key_ref.key.as_str())
                            .unwrap_or_default()
                    ),
                    at_ms: event.granted_at_ms,
                }]),
                _ => Vec::new(),
            })
            .collect();
        let started = std::time::Instant::now();
        let mut connection = self.pool.acquire().await?;
        let advanced = jobs::apply_grants(
            &mut connection,
            &keys,
            &additions,
            now_ms,
            self.timing.resend_waiting_after_ms,
            self.timing.claim_timeout_ms,
        )
        .await?;
        let mut outbox = Outbox::new();
        let mut matched: HashSet<GrantKey> = HashSet::with_capacity(advanced.len());
        for row in &advanced {
            let key = GrantKey {
                job_id: row.state.job_id.clone(),
                attempt: row.state.attempt,
                step: row.state.step.saturating_sub(1),
            };
            if let Some(event) = by_key.get(&key) {
                record_wait_span(row, key.step, event);
            }
            matched.insert(key);
            if row.state.status == Status::Admitted {
                // The admitted message carries its own span's context: the
                // worker's handler span hangs below it.
                let now = std::time::SystemTime::now();
                let admitted_trace = record_span(
                    SCOPE,
                    "admission.admit",
                    &row.trace,
                    now,
                    now,
                    vec![
                        KeyValue::new("sluice.job_id", row.state.job_id.clone()),
                        KeyValue::new("sluice.attempt", i64::from(row.state.attempt)),
                        KeyValue::new("sluice.task_group", row.task_group.clone()),
                    ],
                );
                let mut published = row.clone();
                published.trace = admitted_trace;
                self.push_pending_effect(&mut outbox, &published);
            } else {
                self.push_pending_effect(&mut outbox, row);
            }
        }
        let unmatched: Vec<&GrantKey> = keys.iter().filter(|key| !matched.contains(*key)).collect();
        if !unmatched.is_empty() {
            let ids: Vec<String> = unmatched.iter().map(|key| key.job_id.clone()).collect();
            let rows: HashMap<String, JobRow> = jobs::fetch_jobs(&mut connection, &ids)
                .await?
                .into_iter()
                .map(|row| (row.state.job_id.clone(), row))
                .collect();
            for key in unmatched {
                let Some(event) = by_key.get(key) else {
                    continue;
                };
                self.answer_unmatched_grant(&mut outbox, key, event, rows.get(&key.job_id));
            }
        }
        drop(connection);
        record_commit(started);
        self.publish(outbox).await;
        Ok(())
    }

    fn answer_unmatched_grant(
        &self,
        outbox: &mut Outbox,
        key: &GrantKey,
        event: &pb::GrantEvent,
        row: Option<&JobRow>,
    ) {
        let current_attempt_wants_it = row.is_some_and(|row| {
            row.state.attempt == key.attempt
                && match row.state.status {
                    Status::Waiting => row.state.step > key.step,
                    Status::Admitted | Status::Running | Status::Cancelling => true,
                    _ => false,
                }
        });
        if current_attempt_wants_it {
            // A duplicate: the grant's effect was the next step's acquire or
            // the admitted message; re-send it if it is still the pending one.
            if let Some(row) = row {
                let was_last_grant = key.step + 1 == row.state.step;
                if was_last_grant {
                    self.push_pending_effect(outbox, row);
                }
            }
            return;
        }
        let kind = pb::LimitKind::try_from(event.kind).unwrap_or(pb::LimitKind::Unspecified);
        if kind == pb::LimitKind::Rate {
            // Rate grants hold nothing to give back.
            return;
        }
        let Some(key_ref) = &event.key else {
            return;
        };
        tracing::debug!(job_id = %key.job_id, attempt = key.attempt, step = key.step, "releasing a grant nobody wants");
        let step = crate::chain::StoredStep {
            tenant: key_ref.tenant.clone(),
            key: key_ref.key.clone(),
            kind: event.kind,
            ..Default::default()
        };
        let trace = event.trace.clone().unwrap_or_default();
        self.routes.push_release_of(
            outbox,
            &key.job_id,
            &trace,
            key.attempt,
            key.step,
            &step,
            pb::ReleaseReason::UnwantedGrant,
        );
    }

    /// Claim admitted attempts: exactly one claim per attempt wins.
    pub async fn claim(&self, worker_id: &str, attempts: Vec<(String, u32)>) -> Result<ClaimResults, AdmissionError> {
        let now_ms = wall_clock_ms();
        tracing::debug!(jobs = attempts.len(), "claim batch");
        let mut connection = self.pool.acquire().await?;
        let won = jobs::claim(&mut connection, worker_id, &attempts, now_ms).await?;
        let lost: Vec<String> = attempts
            .iter()
            .filter(|attempt| !won.contains_key(*attempt))
            .map(|attempt| attempt.0.clone())
            .collect();
        let others = if lost.is_empty() {
            HashMap::new()
        } else {
            jobs::fetch_jobs(&mut connection, &lost)
                .await?
                .into_iter()
                .map(|row| (row.state.job_id.clone(), row))
                .collect()
        };
        let mut results = Vec::with_capacity(attempts.len());
        // An attempt named twice in one call (a redelivered admitted message
        // batched with the first) is claimed once: the first entry wins.
        let mut answered: HashSet<(String, u32)> = HashSet::with_capacity(attempts.len());
        for (job_id, attempt) in attempts {
            let mut result = pb::ClaimResult {
                job_id: job_id.clone(),
                attempt,
                ..Default::default()
            };
            let first_entry = answered.insert((job_id.clone(), attempt));
            if !first_entry && won.contains_key(&(job_id.clone(), attempt)) {
                result.outcome = pb::ClaimOutcome::Taken as i32;
            } else if let Some((lease_end, lease_ms, payload)) = won.get(&(job_id.clone(), attempt)) {
                result.outcome = pb::ClaimOutcome::Claimed as i32;
                result.lease_expires_at_ms = *lease_end;
                result.lease_ms = u64::try_from(*lease_ms).unwrap_or_default();
                result.payload = payload.clone();
            } else if let Some(row) = others.get(&job_id) {
                // A claim wins once, even for the worker that won it: a second
                // delivery of the same attempt must not run twice. A worker that
                // lost the answer to its claim confirms ownership by Heartbeat.
                let running = matches!(row.state.status, Status::Running | Status::Cancelling);
                if running && row.state.attempt == attempt {
                    result.outcome = pb::ClaimOutcome::Taken as i32;
                } else {
                    result.outcome = pb::ClaimOutcome::Stale as i32;
                }
            } else {
                result.outcome = pb::ClaimOutcome::NotFound as i32;
            }
            results.push(result);
        }
        Ok(results)
    }

    /// Extend leases; name the jobs to stop.
    pub async fn heartbeat(
        &self,
        worker_id: &str,
        attempts: Vec<(String, u32)>,
    ) -> Result<Vec<pb::HeartbeatResult>, AdmissionError> {
        let now_ms = wall_clock_ms();
        let mut connection = self.pool.acquire().await?;
        let extended = jobs::extend_leases(&mut connection, worker_id, &attempts, now_ms).await?;
        Ok(attempts
            .into_iter()
            .map(|(job_id, attempt)| {
                let found = extended.get(&(job_id.clone(), attempt)).copied();
                let outcome = match found {
                    Some((_, Status::Cancelling)) => pb::HeartbeatOutcome::Cancelled,
                    Some(_) => pb::HeartbeatOutcome::Extended,
                    None => pb::HeartbeatOutcome::LeaseLost,
                };
                pb::HeartbeatResult {
                    job_id,
                    attempt,
                    outcome: outcome as i32,
                    lease_expires_at_ms: found.map(|(lease_end, _)| lease_end).unwrap_or_default(),
                }
            })
            .collect())
    }

    /// End attempts as their workers report. A duplicate of an accepted
    /// completion is accepted again and re-sends its releases.
    pub async fn complete(
        &self,
        worker_id: &str,
        completions: Vec<(String, u32, AttemptEnd)>,
        caller_trace: &pb::TraceContext,
    ) -> Result<Vec<pb::CompleteResult>, AdmissionError> {
        let now_ms = wall_clock_ms();
        tracing::debug!(jobs = completions.len(), "complete batch");
        let mut ids: Vec<String> = completions.iter().map(|completion| completion.0.clone()).collect();
        ids.sort_unstable();
        ids.dedup();
        let mut connection = self.pool.acquire().await?;
        let mut transaction = connection.begin().await?;
        let mut rows: HashMap<String, JobRow> = jobs::fetch_jobs_for_update(&mut transaction, &ids)
            .await?
            .into_iter()
            .map(|row| (row.state.job_id.clone(), row))
            .collect();
        let mut results = Vec::with_capacity(completions.len());
        let mut changed: Vec<(Status, u32, u32, String)> = Vec::new();
        let mut effects_by_job: Vec<(String, Vec<Effect>)> = Vec::new();
        for (job_id, attempt, end) in completions {
            let mut result = pb::CompleteResult {
                job_id: job_id.clone(),
                attempt,
                ..Default::default()
            };
            let Some(row) = rows.get_mut(&job_id) else {
                result.outcome = pb::CompleteOutcome::NotFound as i32;
                results.push(result);
                continue;
            };
            let holds_it = matches!(row.state.status, Status::Running | Status::Cancelling)
                && row.state.attempt == attempt
                && row.state.claimed_by.as_deref() == Some(worker_id);
            if holds_it {
                let before = (row.state.status, row.state.attempt, row.state.step);
                let effects = transitions::end_attempt(&mut row.state, now_ms, end, self.timing);
                changed.push((before.0, before.1, before.2, job_id.clone()));
                effects_by_job.push((job_id.clone(), effects));
                result.outcome = pb::CompleteOutcome::Accepted as i32;
            } else if is_duplicate_completion(&row.state, attempt) {
                // Already saved: change nothing, re-send the releases.
                let finished = JobState {
                    status: Status::Running,
                    attempt,
                    ..row.state.clone()
                };
                effects_by_job.push((
                    job_id.clone(),
                    finished.release_everything(pb::ReleaseReason::Succeeded),
                ));
                result.outcome = pb::CompleteOutcome::Accepted as i32;
            } else {
                result.outcome = pb::CompleteOutcome::Stale as i32;
            }
            result.status = row.state.status as i32;
            results.push(result);
        }
        let states: Vec<(Status, u32, u32, &JobState)> = changed
            .iter()
            .filter_map(|(status, attempt, step, job_id)| {
                rows.get(job_id).map(|row| (*status, *attempt, *step, &row.state))
            })
            .collect();
        jobs::compare_and_set(&mut transaction, &states).await?;
        transaction.commit().await?;
        drop(connection);

        let now = std::time::SystemTime::now();
        for result in &results {
            if let Some(row) = rows.get(&result.job_id) {
                // Under the worker's handler span when the call carries one
                // of this job's trace, else under the job's own span.
                let parent = if same_trace(caller_trace, &row.trace) {
                    caller_trace
                } else {
                    &row.trace
                };
                record_span(
                    SCOPE,
                    "admission.complete",
                    parent,
                    now,
                    now,
                    vec![
                        KeyValue::new("sluice.job_id", result.job_id.clone()),
                        KeyValue::new("sluice.attempt", i64::from(result.attempt)),
                        KeyValue::new(
                            "sluice.outcome",
                            pb::CompleteOutcome::try_from(result.outcome)
                                .map(|outcome| outcome.as_str_name().to_string())
                                .unwrap_or_default(),
                        ),
                        KeyValue::new(
                            "sluice.status",
                            Status::try_from(result.status)
                                .map(|status| status.as_str_name().to_string())
                                .unwrap_or_default(),
                        ),
                    ],
                );
            }
        }
        let drop_releases = self.faults.hit(FaultPoint::AdmissionDropRelease);
        let mut outbox = Outbox::new();
        for (job_id, effects) in effects_by_job {
            let Some(row) = rows.get(&job_id) else {
                continue;
            };
            let kept: Vec<Effect> = effects
                .into_iter()
                .filter(|effect| !(drop_releases && matches!(effect, Effect::Release { .. })))
                .collect();
            self.routes.push_effects(&mut outbox, row, &kept);
        }
        self.publish(outbox).await;
        Ok(results)
    }

    /// Cancel a job (see `transitions::cancel`).
    pub async fn cancel(&self, job_id: &str, reason: &str) -> Result<Option<Status>, AdmissionError> {
        let now_ms = wall_clock_ms();
        let mut connection = self.pool.acquire().await?;
        let mut transaction = connection.begin().await?;
        let mut rows = jobs::fetch_jobs_for_update(&mut transaction, &[job_id.to_string()]).await?;
        let Some(mut row) = rows.pop() else {
            return Ok(None);
        };
        let before = (row.state.status, row.state.attempt, row.state.step);
        let effects = transitions::cancel(&mut row.state, now_ms, reason);
        if row.state.status != before.0 {
            jobs::compare_and_set(&mut transaction, &[(before.0, before.1, before.2, &row.state)]).await?;
        }
        transaction.commit().await?;
        drop(connection);
        let mut outbox = Outbox::new();
        self.routes.push_effects(&mut outbox, &row, &effects);
        self.publish(outbox).await;
        Ok(Some(row.state.status))
    }

    /// One pass over due jobs of `partitions`; returns how many were handled.
    pub async fn sweep_due(&self, partitions: &[i32], limit: i64) -> Result<usize, AdmissionError> {
        if partitions.is_empty() {
            return Ok(0);
        }
        let now_ms = wall_clock_ms();
        let mut connection = self.pool.acquire().await?;
        let mut transaction = connection.begin().await?;
        let mut rows = jobs::lock_due_jobs(&mut transaction, partitions, now_ms, limit).await?;
        let handled = rows.len();
        let mut befores = Vec::with_capacity(rows.len());
        let mut all_effects = Vec::with_capacity(rows.len());
        for row in &mut rows {
            befores.push((row.state.status, row.state.attempt, row.state.step));
            all_effects.push(transitions::on_due(&mut row.state, now_ms, self.timing));
        }
        let states: Vec<(Status, u32, u32, &JobState)> = befores
            .iter()
            .zip(&rows)
            .map(|(before, row)| (before.0, before.1, before.2, &row.state))
            .collect();
        jobs::compare_and_set(&mut transaction, &states).await?;
        transaction.commit().await?;
        drop(connection);
        let mut outbox = Outbox::new();
        for (row, effects) in rows.iter().zip(&all_effects) {
            if !effects.is_empty() {
                tracing::debug!(job_id = %row.state.job_id, status = ?row.state.status, ?effects, "sweeper acted");
            }
            self.routes.push_effects(&mut outbox, row, effects);
        }
        self.publish(outbox).await;
        Ok(handled)
    }

    /// Tell every limit partition which tickets this instance stands behind
    /// for the jobs of `job_partitions`, as read now. Sent to every partition,
    /// even with nothing to list, so tickets nobody stands behind expire there
    /// (a lost release then costs one grace period, not a slot forever).
    /// Only call it for job partitions whose grant events are processed up
    /// to date. Returns how many tickets were listed.
    pub async fn stand_behind(&self, job_partitions: &[i32], grace_ms: i64) -> Result<usize, AdmissionError> {
        if job_partitions.is_empty() {
            return Ok(0);
        }
        // The snapshot time is taken before the read: everything saved before
        // it is in what we read.
        let snapshot_at_ms = wall_clock_ms();
        let statement = format!(
            "SELECT job_id, attempt, step, status, chain FROM jobs
             WHERE job_partition = ANY($1) AND due_at_ms IS NOT NULL AND status IN ({}, {}, {}, {})",
            Status::Waiting as i32,
            Status::Admitted as i32,
            Status::Running as i32,
            Status::Cancelling as i32
        );
        let rows: Vec<(String, i32, i32, i16, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(statement))
            .bind(job_partitions)
            .fetch_all(&self.pool)
            .await?;
        let limit_partitions = self.routes.limit_partitions;
        let mut by_partition: Vec<Vec<pb::TicketId>> =
            vec![Vec::new(); usize::try_from(limit_partitions).unwrap_or_default()];
        let mut listed = 0;
        for (job_id, attempt, step, status, chain_bytes) in rows {
            let Ok(chain) = <crate::chain::StoredChain as prost::Message>::decode(chain_bytes.as_slice()) else {
                tracing::error!(%job_id, "undecodable chain; its tickets are not stood behind");
                continue;
            };
            let step = u32::try_from(step).unwrap_or_default();
            let held_through = if jobs::status_from_i16(status) == Status::Waiting {
                step.saturating_add(1)
            } else {
                u32::try_from(chain.steps.len()).unwrap_or(u32::MAX)
            };
            for (index, chain_step) in chain.steps.iter().enumerate() {
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                if index >= held_through || !chain_step.is_ticketed() {
                    continue;
                }
                let partition =
                    sluice_common::partition::key_partition(&chain_step.tenant, &chain_step.key, limit_partitions);
                if let Some(tickets) = by_partition.get_mut(usize::try_from(partition).unwrap_or(usize::MAX)) {
                    tickets.push(pb::TicketId {
                        job_id: job_id.clone(),
                        attempt: u32::try_from(attempt).unwrap_or_default(),
                        step: index,
                    });
                    listed += 1;
                }
            }
        }
        const TICKETS_PER_PART: usize = 10_000;
        let sweep_id = uuid::Uuid::new_v4().to_string();
        let covered: Vec<u32> = job_partitions
            .iter()
            .filter_map(|partition| u32::try_from(*partition).ok())
            .collect();
        let mut outbox = Outbox::new();
        for (partition, tickets) in by_partition.into_iter().enumerate() {
            let chunks: Vec<Vec<pb::TicketId>> = if tickets.is_empty() {
                vec![Vec::new()]
            } else {
                tickets.chunks(TICKETS_PER_PART).map(<[pb::TicketId]>::to_vec).collect()
            };
            let parts = u32::try_from(chunks.len()).unwrap_or(u32::MAX);
            for (part, chunk) in chunks.into_iter().enumerate() {
                let command = pb::LimitCommand {
                    trace: None,
                    sent_at_ms: snapshot_at_ms,
                    command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
                        sweep_id: sweep_id.clone(),
                        snapshot_at_ms,
                        job_partitions: covered.clone(),
                        part: u32::try_from(part).unwrap_or(u32::MAX),
                        parts,
                        tickets: chunk,
                        grace_ms: u64::try_from(grace_ms).unwrap_or_default(),
                    })),
                };
                outbox.push_link(Link::LimitGrant, i32::try_from(partition).unwrap_or_default(), &command);
            }
        }
        self.publish(outbox).await;
        tracing::debug!(listed, job_partitions = ?job_partitions, "stood behind tickets");
        Ok(listed)
    }

    pub async fn get_job(&self, job_id: &str) -> Result<Option<JobRow>, AdmissionError> {
        let mut connection = self.pool.acquire().await?;
        Ok(jobs::fetch_jobs(&mut connection, &[job_id.to_string()]).await?.pop())
    }
}

fn record_commit(started: std::time::Instant) {
    sluice_common::metrics::metrics().commit_seconds.record(
        started.elapsed().as_secs_f64(),
        &[KeyValue::new("service", "admission")],
    );
}

/// Whether two W3C contexts belong to one trace.
fn same_trace(left: &pb::TraceContext, right: &pb::TraceContext) -> bool {
    let trace_id = |context: &pb::TraceContext| context.traceparent.split('-').nth(1).map(str::to_string);
    match (trace_id(left), trace_id(right)) {
        (Some(left), Some(right)) => left == right && left.len() == 32,
        _ => false,
    }
}

/// How long `publish` keeps trying before it leaves the re-send to the sweeper.
const PUBLISH_BUDGET: Duration = Duration::from_secs(5);

/// The tracer scope of admission's spans.
const SCOPE: &str = "sluice-admission";

use sluice_common::clock::system_time_at_ms as at_ms;

/// The span covering a job's wait on one limit, from when the key's owner
/// queued it to the grant.
fn record_wait_span(row: &JobRow, step_index: u32, event: &pb::GrantEvent) {
    let step = row.state.chain.get(usize::try_from(step_index).unwrap_or(usize::MAX));
    let kind = pb::LimitKind::try_from(event.kind).unwrap_or(pb::LimitKind::Unspecified);
    let key = event.key.clone().unwrap_or_default();
    let outcome = if event.unthrottled { "unthrottled" } else { "granted" };
    let start_ms = if event.waiting_since_ms > 0 {
        event.waiting_since_ms
    } else {
        event.granted_at_ms
    };
    record_span(
        SCOPE,
        "sluice.wait",
        &row.trace,
        at_ms(start_ms),
        at_ms(event.granted_at_ms.max(start_ms)),
        vec![
            KeyValue::new("sluice.job_id", row.state.job_id.clone()),
            KeyValue::new("sluice.step", i64::from(step_index)),
            KeyValue::new("sluice.tenant", key.tenant),
            KeyValue::new("sluice.key", key.key),
            KeyValue::new("sluice.limit_kind", kind.as_str_name()),
            KeyValue::new("sluice.max", event.max),
            KeyValue::new("sluice.position_at_enqueue", i64::from(event.position_at_enqueue)),
            KeyValue::new("sluice.outcome", outcome),
            KeyValue::new(
                "sluice.origin",
                step.map(|step| step.origin.clone()).unwrap_or_default(),
            ),
        ],
    );
}

/// The same worker completing an attempt whose completion is already saved.
fn is_duplicate_completion(state: &JobState, attempt: u32) -> bool {
    let last = state.history.records.last();
    last.is_some_and(|record| record.attempt == attempt && record.outcome == "succeeded")
        && state.status == Status::Succeeded
        && state.attempt == attempt
}
