//! admission's Kafka consumers: `jobs.requested` (producers' job requests) and
//! the grant events from limit-grant and rate-window. One task per assigned
//! partition; offsets are stored only after the batch's effects are saved and
//! published.

use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::FutureExt;
use prost::Message;
use sluice_common::kafka::{InMsg, Outbox, PartitionInput, PartitionTaskError, PartitionTaskFactory};
use sluice_common::telemetry::trace_context_from_headers;
use sluice_common::FaultPoint;
use sluice_proto::v1 as pb;

use crate::chain;
use crate::core::{AdmissionCore, AdmissionError, Incoming};
use crate::json_request::decode_json_request;

/// Collect up to `max` messages: wait for one, then take what is queued.
async fn next_batch(input: &mut PartitionInput, max: usize) -> Option<Vec<InMsg>> {
    let first = tokio::select! {
        biased;
        _ = input.stop.cancelled() => return None,
        received = input.messages.recv() => received?,
    };
    let mut batch = Vec::with_capacity(max.min(1024));
    batch.push(first);
    while batch.len() < max {
        match input.messages.try_recv() {
            Ok(message) => batch.push(message),
            Err(_) => break,
        }
    }
    Some(batch)
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

/// Decode a producer's message: JSON when its `content-type` header says
/// `application/json` (parameters such as `; charset=utf-8` allowed), else
/// protobuf. The error is the dead-letter reason.
pub fn decode_request(message: &InMsg) -> Result<pb::JobRequest, String> {
    let payload = message.payload.as_deref().unwrap_or_default();
    let content_type = sluice_common::kafka::header_text(&message.headers, "content-type").unwrap_or("");
    if is_json(content_type) {
        return decode_json_request(payload).map_err(|error| error.to_string());
    }
    pb::JobRequest::decode(payload).map_err(|error| format!("payload is not a protobuf sluice.v1.JobRequest: {error}"))
}

fn is_json(content_type: &str) -> bool {
    let media_type = content_type.split(';').next().unwrap_or_default().trim();
    media_type.eq_ignore_ascii_case("application/json")
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

/// Decode and validate a batch: the jobs to enqueue and the dead letters.
fn decode_batch(core: &AdmissionCore, topic: &str, batch: &[InMsg]) -> (Vec<Incoming>, Outbox) {
    let mut dead_letters = Outbox::new();
    let mut incoming = Vec::with_capacity(batch.len());
    for message in batch {
        let decoded = decode_request(message).and_then(|request| {
            let job_id = request
                .job_id
                .clone()
                .unwrap_or_else(|| deterministic_job_id(topic, message));
            chain::validate(&core.config, request)
                .map(|valid| (job_id, valid))
                .map_err(|error| error.to_string())
        });
        match decoded {
            Ok((job_id, valid)) => incoming.push(Incoming {
                job_id,
                valid,
                trace: trace_context_from_headers(&message.headers),
            }),
            Err(reason) => {
                tracing::warn!(topic, partition = message.partition, offset = message.offset, %reason, "dead-lettering a job request");
                core.routes.push_deadletter(&mut dead_letters, topic, message, &reason);
            }
        }
    }
    (incoming, dead_letters)
}

async fn run_requests(
    core: Arc<AdmissionCore>,
    topic: Arc<str>,
    mut input: PartitionInput,
) -> Result<(), PartitionTaskError> {
    let max_batch = core.config.admission.max_batch;
    while let Some(batch) = next_batch(&mut input, max_batch).await {
        let mut delay = Duration::from_millis(100);
        loop {
            let (incoming, dead_letters) = decode_batch(&core, &topic, &batch);
            match core.enqueue(incoming, dead_letters).await {
                Ok(_) => break,
                Err(AdmissionError::Crashed) => return Err(PartitionTaskError::Crashed),
                Err(AdmissionError::Database(error)) => {
                    tracing::warn!(%error, partition = input.partition, "saving job requests failed, retrying the batch");
                    if input.stop.is_cancelled() {
                        return Ok(());
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
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

pub struct GrantConsumer {
    pub core: Arc<AdmissionCore>,
}

impl PartitionTaskFactory for GrantConsumer {
    fn start(&self, input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let core = self.core.clone();
        async move { run_grants(core, input).await }.boxed()
    }
}

async fn run_grants(core: Arc<AdmissionCore>, mut input: PartitionInput) -> Result<(), PartitionTaskError> {
    let max_batch = core.config.admission.max_batch;
    while let Some(batch) = next_batch(&mut input, max_batch).await {
        let mut events = Vec::new();
        for message in &batch {
            let payload = message.payload.as_deref().unwrap_or_default();
            match pb::GrantEventBatch::decode(payload) {
                Ok(decoded) => events.extend(decoded.events),
                Err(error) => {
                    // Internal messages are never dropped: stop and alert.
                    return Err(PartitionTaskError::Stopped {
                        partition: message.partition,
                        reason: format!("undecodable grant event batch at offset {}: {error}", message.offset),
                    });
                }
            }
        }
        let mut delay = Duration::from_millis(100);
        loop {
            match core.process_grants(events.clone()).await {
                Ok(()) => break,
                Err(AdmissionError::Crashed) => return Err(PartitionTaskError::Crashed),
                Err(AdmissionError::Database(error)) => {
                    tracing::warn!(%error, partition = input.partition, "applying grants failed, retrying the batch");
                    if input.stop.is_cancelled() {
                        return Ok(());
                    }
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_secs(5));
                }
            }
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
