//! admission's Kafka consumers: `jobs.requested` (producers' job requests) and
//! the grant events from limit-grant and rate-window. One task per assigned
//! partition; offsets are stored only after the batch's effects are saved and
//! published — dead letters included.
//!
//! No message stops a partition. A producer message that is not a valid job
//! request, or whose job id exists with another request, or that PostgreSQL
//! refuses to store every time, goes to the dead-letter topic with the
//! reason. A grant event that can never be applied is set aside in the
//! quarantine table (an internal message is never dropped silently). Faults
//! that pass (the database, the broker) are retried with backoff while
//! readiness is NOT_SERVING (`sluice_common::fault` decides which is which).

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use prost::Message;
use sluice_common::fault::{classify_kafka, panic_message};
use sluice_common::kafka::{next_batch, InMsg, OutMsg, PartitionInput, PartitionTaskError, PartitionTaskFactory};
use sluice_common::owner::{apply_entries, insert_quarantined, report_quarantined, Rejected};
use sluice_common::telemetry::trace_context_from_headers;
use sluice_common::validate::{check_ticket, FieldError};
use sluice_common::{FaultPoint, SluiceConfig};
use sluice_proto::v1 as pb;

use crate::chain;
use crate::core::{AdmissionCore, AdmissionError, EnqueueOutcome, Incoming, OnConflict};
use crate::effects::{count_dead_letters, DeadLetterClass};
use crate::json_request::decode_json_request;

const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// A backoff that doubles from 100 ms to 5 s.
struct Backoff(Duration);

impl Backoff {
    fn new() -> Self {
        Backoff(RETRY_FIRST)
    }

    async fn wait(&mut self) {
        tokio::time::sleep(self.0).await;
        self.0 = (self.0 * 2).min(RETRY_MAX);
    }
}

/// A deterministic job id for a request without one: a redelivered message
/// (same topic, partition, offset and timestamp) gets the same id, so it never
/// becomes a second job. The timestamp keeps a re-created topic's offsets from
/// colliding with old jobs.
pub fn deterministic_job_id(topic: &str, message: &InMsg) -> String {
    let name = format!(
        "{topic}/{}/{}/{}",
        message.partition,
        message.offset,
        message.timestamp_ms.unwrap_or_default()
    );
    uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_URL, name.as_bytes()).to_string()
}

/// Why a producer message cannot become a job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub class: DeadLetterClass,
    pub reason: String,
}

impl From<FieldError> for Refusal {
    fn from(error: FieldError) -> Self {
        Refusal {
            class: DeadLetterClass::Invalid,
            reason: error.to_string(),
        }
    }
}

/// Decode a producer's message: JSON when its `content-type` header says
/// `application/json` (parameters such as `; charset=utf-8` allowed), else
/// protobuf.
pub fn decode_request(message: &InMsg) -> Result<pb::JobRequest, Refusal> {
    let payload = message.payload.as_deref().unwrap_or_default();
    let content_type = sluice_common::kafka::header_text(&message.headers, "content-type").unwrap_or("");
    if is_json(content_type) {
        return decode_json_request(payload).map_err(|error| match error {
            crate::json_request::JsonRequestError::Message(reason) => Refusal {
                class: DeadLetterClass::Undecodable,
                reason,
            },
            crate::json_request::JsonRequestError::Field(field) => field.into(),
        });
    }
    pb::JobRequest::decode(payload).map_err(|error| Refusal {
        class: DeadLetterClass::Undecodable,
        reason: format!("payload is not a protobuf sluice.v1.JobRequest: {error}"),
    })
}

fn is_json(content_type: &str) -> bool {
    let media_type = content_type.split(';').next().unwrap_or_default().trim();
    media_type.eq_ignore_ascii_case("application/json")
}

/// A producer message as a job to save, or why it cannot be one: decoded
/// (protobuf or JSON) and validated against `config`. Pure; see
/// `admit_message` for the form that cannot panic.
pub fn check_message(config: &SluiceConfig, topic: &str, message: &InMsg) -> Result<Incoming, Refusal> {
    let request = decode_request(message)?;
    let job_id = request
        .job_id
        .clone()
        .unwrap_or_else(|| deterministic_job_id(topic, message));
    let valid = chain::validate(config, request)?;
    Ok(Incoming {
        job_id,
        valid,
        trace: trace_context_from_headers(&message.headers),
    })
}

/// `check_message`, never panicking: a panic while checking a message (a
/// bug) makes it a dead letter of class `internal`, so one message can never
/// take its partition down.
pub fn admit_message(config: &SluiceConfig, topic: &str, message: &InMsg) -> Result<Incoming, Refusal> {
    let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check_message(config, topic, message)));
    checked.unwrap_or_else(|panic| {
        let reason = format!("checking this request failed inside Sluice: {}", panic_message(panic.as_ref()));
        tracing::error!(topic, partition = message.partition, offset = message.offset, %reason, "a request made the check panic; dead-lettering it");
        Err(Refusal {
            class: DeadLetterClass::Internal,
            reason,
        })
    })
}

pub struct RequestConsumer {
    pub core: Arc<AdmissionCore>,
    pub topic: Arc<str>,
}

impl PartitionTaskFactory for RequestConsumer {
    fn start(&self, input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let core = self.core.clone();
        let topic = self.topic.clone();
        async move { run_requests(core, topic, input).await }.boxed()
    }
}

/// How a step of the consumer ended.
enum Step<T> {
    Done(T),
    Stop,
}

async fn run_requests(
    core: Arc<AdmissionCore>,
    topic: Arc<str>,
    mut input: PartitionInput,
) -> Result<(), PartitionTaskError> {
    let max_batch = core.config.admission.max_batch;
    let condition = format!("admission {topic} partition {}", input.partition);
    while let Some(batch) = next_batch(&mut input, max_batch).await {
        let mut incoming = Vec::with_capacity(batch.len());
        let mut sources = Vec::with_capacity(batch.len());
        let mut dead_letters: Vec<(OutMsg, DeadLetterClass)> = Vec::new();
        for message in &batch {
            match admit_message(&core.config, &topic, message) {
                Ok(job) => {
                    incoming.push(job);
                    sources.push(message);
                }
                Err(refusal) => {
                    tracing::warn!(topic = %topic, partition = message.partition, offset = message.offset, reason = %refusal.reason, "dead-lettering a job request");
                    dead_letters.push((
                        core.routes.dead_letter(&topic, message, refusal.class, &refusal.reason),
                        refusal.class,
                    ));
                }
            }
        }
        let outcomes = match save_requests(&core, &topic, &incoming, &sources, &input, &condition).await? {
            Step::Done(outcomes) => outcomes,
            Step::Stop => return Ok(()),
        };
        for (outcome, message) in outcomes.into_iter().zip(&sources) {
            let refusal = match outcome {
                Ok(outcome) if outcome.conflict => Refusal {
                    class: DeadLetterClass::Conflict,
                    reason: format!(
                        "conflict: job {:?} already exists with a different request (a job id names one request; \
                         send a new id for a new job)",
                        outcome.job_id
                    ),
                },
                Ok(_) => continue,
                Err(refusal) => refusal,
            };
            tracing::warn!(topic = %topic, partition = message.partition, offset = message.offset, reason = %refusal.reason, "dead-lettering a job request");
            dead_letters.push((
                core.routes.dead_letter(&topic, message, refusal.class, &refusal.reason),
                refusal.class,
            ));
        }
        if let Step::Stop = deliver_dead_letters(&core, &topic, dead_letters, &input, &condition).await {
            return Ok(());
        }
        if core.faults.hit(FaultPoint::AdmissionAfterPublishBeforeOffsetStore) {
            return Err(PartitionTaskError::Crashed);
        }
        if let Some(last) = batch.last() {
            input.offsets.store(last.offset + 1);
        }
    }
    Ok(())
}

/// Save a batch's jobs: each request's outcome, or why PostgreSQL refuses
/// to store it. Faults that pass are retried (readiness NOT_SERVING
/// meanwhile); a batch PostgreSQL refuses for what it holds is saved one
/// request at a time, and the one it still refuses becomes a dead letter.
async fn save_requests(
    core: &AdmissionCore,
    topic: &str,
    incoming: &[Incoming],
    sources: &[&InMsg],
    input: &PartitionInput,
    condition: &str,
) -> Result<Step<Vec<Result<EnqueueOutcome, Refusal>>>, PartitionTaskError> {
    if incoming.is_empty() {
        return Ok(Step::Done(Vec::new()));
    }
    let reason = match enqueue_until_done(core, incoming, input, condition).await? {
        Step::Done(Ok(outcomes)) => return Ok(Step::Done(outcomes.into_iter().map(Ok).collect())),
        Step::Done(Err(reason)) => reason,
        Step::Stop => return Ok(Step::Stop),
    };
    tracing::warn!(topic, partition = input.partition, jobs = incoming.len(), %reason, "PostgreSQL refuses the batch; saving its requests one at a time");
    let mut outcomes = Vec::with_capacity(incoming.len());
    for (job, message) in incoming.iter().zip(sources) {
        match enqueue_until_done(core, std::slice::from_ref(job), input, condition).await? {
            Step::Done(Ok(mut saved)) => outcomes.push(saved.pop().ok_or_else(|| Refusal {
                class: DeadLetterClass::Internal,
                reason: "saving the request returned no outcome".to_string(),
            })),
            Step::Done(Err(reason)) => {
                tracing::error!(topic, partition = message.partition, offset = message.offset, %reason, "PostgreSQL refuses to store a request");
                outcomes.push(Err(Refusal {
                    class: DeadLetterClass::Storage,
                    reason: format!("PostgreSQL refuses to store this request: {reason}"),
                }));
            }
            Step::Stop => return Ok(Step::Stop),
        }
    }
    Ok(Step::Done(outcomes))
}

/// `enqueue`, retrying faults that pass; `Err(reason)` when PostgreSQL
/// refuses it for what it holds.
async fn enqueue_until_done(
    core: &AdmissionCore,
    incoming: &[Incoming],
    input: &PartitionInput,
    condition: &str,
) -> Result<Step<Result<Vec<EnqueueOutcome>, String>>, PartitionTaskError> {
    let mut backoff = Backoff::new();
    loop {
        match core.enqueue(incoming, OnConflict::Report).await {
            Ok(outcomes) => {
                core.readiness.clear(condition);
                return Ok(Step::Done(Ok(outcomes)));
            }
            Err(AdmissionError::Crashed) => return Err(PartitionTaskError::Crashed),
            Err(error) if error.is_transient() => {
                tracing::warn!(%error, partition = input.partition, "saving job requests failed, retrying");
                core.note_transient(condition, format!("saving job requests: {error}"));
                if input.stop.is_cancelled() {
                    return Ok(Step::Stop);
                }
                backoff.wait().await;
            }
            Err(error) => return Ok(Step::Done(Err(error.to_string()))),
        }
    }
}

/// Publish dead letters until every one is acknowledged (offsets are stored
/// only after). One the broker refuses for its size is sent again with its
/// payload and the producer's headers cut; the others are never held back by
/// it. `Stop` when the partition is given up (the next owner reads the
/// messages again, so no dead letter is lost).
async fn deliver_dead_letters(
    core: &AdmissionCore,
    topic: &str,
    letters: Vec<(OutMsg, DeadLetterClass)>,
    input: &PartitionInput,
    condition: &str,
) -> Step<()> {
    let mut pending = letters;
    let mut backoff = Backoff::new();
    while !pending.is_empty() {
        let messages: Vec<OutMsg> = pending.iter().map(|(message, _)| message.clone()).collect();
        let results = core.publisher.send_each(&messages).await;
        let mut retry = Vec::new();
        let mut last_error = None;
        for (result, (message, class)) in results.into_iter().zip(pending) {
            match result {
                Ok(()) => count_dead_letters(topic, class, 1),
                Err(error) if classify_kafka(&error).is_transient() => {
                    last_error = Some(error.to_string());
                    retry.push((message, class));
                }
                Err(error) if message.payload.is_empty() => {
                    // Nothing left to cut: say so loudly, keep going.
                    tracing::error!(topic, %error, headers = ?message.headers.iter().map(|(name, _)| name).collect::<Vec<_>>(), "a dead letter cut to its headers is still refused by the broker; it is lost");
                }
                Err(error) => {
                    tracing::warn!(topic, %error, bytes = message.payload.len(), "the broker refuses a dead letter; sending it with its payload cut");
                    retry.push((cut_dead_letter(message, &error.to_string()), class));
                }
            }
        }
        pending = retry;
        if let Some(error) = last_error {
            tracing::warn!(topic, %error, dead_letters = pending.len(), "publishing dead letters failed, retrying");
            core.note_transient(condition, format!("publishing dead letters: {error}"));
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            backoff.wait().await;
        }
    }
    Step::Done(())
}

/// A dead letter reduced to what always fits: no payload, only Sluice's
/// headers, and a header with the broker's answer.
fn cut_dead_letter(mut message: OutMsg, error: &str) -> OutMsg {
    let original = message.payload.len();
    message.payload = Vec::new();
    message.key = None;
    message.headers.retain(|(name, _)| name.starts_with("sluice-"));
    message
        .headers
        .retain(|(name, _)| name != "sluice-deadletter-payload-truncated");
    message.headers.push((
        "sluice-deadletter-payload-truncated".to_string(),
        original.to_string().into_bytes(),
    ));
    message.headers.push((
        "sluice-deadletter-broker-error".to_string(),
        sluice_common::fault::clean_text(error, 512).into_bytes(),
    ));
    message
}

pub struct GrantConsumer {
    pub core: Arc<AdmissionCore>,
    pub topic: Arc<str>,
}

impl PartitionTaskFactory for GrantConsumer {
    fn start(&self, input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let core = self.core.clone();
        let topic = self.topic.clone();
        async move { run_grants(core, topic, input).await }.boxed()
    }
}

/// Where grant events came from: a partition of the grants topic, or a link
/// (partition -1), and what stops their processing.
struct GrantSource<'a> {
    partition: i32,
    stop: &'a tokio_util::sync::CancellationToken,
}

/// Grant events from the links (the hot path): applied like the grants
/// topic's, in batches; those that can never be applied are set aside in
/// the quarantine table. Runs until `shutdown`.
pub async fn run_link_grants(
    core: Arc<AdmissionCore>,
    mut grants: tokio::sync::mpsc::Receiver<Vec<Vec<u8>>>,
    shutdown: sluice_common::Shutdown,
) -> Result<(), PartitionTaskError> {
    const TOPIC: &str = "link";
    let stop = tokio_util::sync::CancellationToken::new();
    let source = GrantSource {
        partition: -1,
        stop: &stop,
    };
    let condition = "admission link grants".to_string();
    let max_batch = core.config.admission.max_batch;
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            received = grants.recv() => match received {
                Some(batch) => batch,
                None => return Ok(()),
            },
        };
        let mut encoded = first;
        while encoded.len() < max_batch {
            match grants.try_recv() {
                Ok(more) => encoded.extend(more),
                Err(_) => break,
            }
        }
        let mut events: Vec<(i64, pb::GrantEvent)> = Vec::with_capacity(encoded.len());
        let mut rejected: Vec<Rejected> = Vec::new();
        for entry in encoded {
            let checked = pb::GrantEvent::decode(entry.as_slice())
                .map_err(|error| format!("undecodable grant event: {error}"))
                .and_then(|event| check_grant(&event).map(|()| event));
            match checked {
                Ok(event) => events.push((-1, event)),
                Err(reason) => rejected.push(Rejected {
                    offset: -1,
                    entry,
                    reason,
                }),
            }
        }
        match apply_grants(&core, TOPIC, events, &source, &condition).await? {
            Step::Done(mut refused) => rejected.append(&mut refused),
            Step::Stop => return Ok(()),
        }
        if let Step::Stop = quarantine(&core, TOPIC, &rejected, &source, &condition).await {
            return Ok(());
        }
    }
}

/// A grant event admission can apply: its ticket names a job and attempt.
fn check_grant(event: &pb::GrantEvent) -> Result<(), String> {
    check_ticket("ticket", event.ticket.as_ref()).map_err(|error| error.to_string())
}

async fn run_grants(
    core: Arc<AdmissionCore>,
    topic: Arc<str>,
    mut input: PartitionInput,
) -> Result<(), PartitionTaskError> {
    let max_batch = core.config.admission.max_batch;
    let condition = format!("admission {topic} partition {}", input.partition);
    while let Some(batch) = next_batch(&mut input, max_batch).await {
        let mut events: Vec<(i64, pb::GrantEvent)> = Vec::new();
        let mut rejected: Vec<Rejected> = Vec::new();
        for message in &batch {
            apply_entries(message, "grant event", &mut rejected, |event: pb::GrantEvent| {
                check_grant(&event)?;
                events.push((message.offset, event));
                Ok(())
            });
        }
        let source = GrantSource {
            partition: input.partition,
            stop: &input.stop,
        };
        match apply_grants(&core, &topic, events, &source, &condition).await? {
            Step::Done(mut refused) => rejected.append(&mut refused),
            Step::Stop => return Ok(()),
        }
        if let Step::Stop = quarantine(&core, &topic, &rejected, &source, &condition).await {
            return Ok(());
        }
        if core.faults.hit(FaultPoint::AdmissionAfterPublishBeforeOffsetStore) {
            return Err(PartitionTaskError::Crashed);
        }
        if let Some(last) = batch.last() {
            input.offsets.store(last.offset + 1);
        }
    }
    Ok(())
}

/// Apply grant events, retrying faults that pass; when PostgreSQL refuses
/// the batch for what it holds, apply them one at a time and return the
/// ones it still refuses, to be set aside.
async fn apply_grants(
    core: &AdmissionCore,
    topic: &str,
    events: Vec<(i64, pb::GrantEvent)>,
    source: &GrantSource<'_>,
    condition: &str,
) -> Result<Step<Vec<Rejected>>, PartitionTaskError> {
    if events.is_empty() {
        return Ok(Step::Done(Vec::new()));
    }
    let all: Vec<pb::GrantEvent> = events.iter().map(|(_, event)| event.clone()).collect();
    let reason = match process_grants_until_done(core, &all, source, condition).await? {
        Step::Done(None) => return Ok(Step::Done(Vec::new())),
        Step::Done(Some(reason)) => reason,
        Step::Stop => return Ok(Step::Stop),
    };
    tracing::warn!(topic, partition = source.partition, events = events.len(), %reason, "PostgreSQL refuses the grant batch; applying its events one at a time");
    let mut refused = Vec::new();
    for (offset, event) in events {
        match process_grants_until_done(core, std::slice::from_ref(&event), source, condition).await? {
            Step::Done(None) => {}
            Step::Done(Some(reason)) => refused.push(Rejected {
                offset,
                entry: event.encode_to_vec(),
                reason: format!("PostgreSQL refuses this grant event: {reason}"),
            }),
            Step::Stop => return Ok(Step::Stop),
        }
    }
    Ok(Step::Done(refused))
}

/// `process_grants`, retrying faults that pass; `Some(reason)` when
/// PostgreSQL refuses it for what it holds.
async fn process_grants_until_done(
    core: &AdmissionCore,
    events: &[pb::GrantEvent],
    source: &GrantSource<'_>,
    condition: &str,
) -> Result<Step<Option<String>>, PartitionTaskError> {
    let mut backoff = Backoff::new();
    loop {
        match core.process_grants(events.to_vec()).await {
            Ok(()) => {
                core.readiness.clear(condition);
                return Ok(Step::Done(None));
            }
            Err(AdmissionError::Crashed) => return Err(PartitionTaskError::Crashed),
            Err(error) if error.is_transient() => {
                tracing::warn!(%error, partition = source.partition, "applying grants failed, retrying the batch");
                core.note_transient(condition, format!("applying grants: {error}"));
                if source.stop.is_cancelled() {
                    return Ok(Step::Stop);
                }
                backoff.wait().await;
            }
            Err(error) => return Ok(Step::Done(Some(error.to_string()))),
        }
    }
}

/// Set grant events aside in admission's quarantine table (logged, counted).
async fn quarantine(
    core: &AdmissionCore,
    topic: &str,
    rejected: &[Rejected],
    source: &GrantSource<'_>,
    condition: &str,
) -> Step<()> {
    if rejected.is_empty() {
        return Step::Done(());
    }
    let mut backoff = Backoff::new();
    loop {
        let saved = async {
            let mut connection = core.pool.acquire().await?;
            insert_quarantined(&mut connection, topic, source.partition, rejected).await
        }
        .await;
        match saved {
            Ok(()) => {
                report_quarantined(crate::SERVICE, topic, source.partition, rejected);
                core.readiness.clear(condition);
                return Step::Done(());
            }
            Err(error) => {
                tracing::warn!(%error, partition = source.partition, "setting grant events aside failed, retrying");
                core.note_transient(condition, format!("setting grant events aside: {error}"));
                if source.stop.is_cancelled() {
                    return Step::Stop;
                }
                backoff.wait().await;
            }
        }
    }
}
