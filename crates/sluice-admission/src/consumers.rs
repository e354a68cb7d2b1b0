//! admission's input besides its gRPC API: the producers' job requests on
//! `jobs.requested`, and the grant events that come down the links.
//!
//! A request is checked where it is read (decoded, validated, its job id
//! derived) and handed over to the owner of its job's partition, which
//! decides on it (`partition::AdmissionPartition`): in process when this
//! instance owns that partition, else through `sluice.jobs`. One task per
//! assigned partition of `jobs.requested`; offsets are stored only after the
//! batch's hand-overs are saved or acknowledged, and its dead letters
//! acknowledged.
//!
//! No message stops a partition. A producer message that is not a valid job
//! request goes to the dead-letter topic with the reason (the owner
//! dead-letters conflicts, and requests PostgreSQL refuses to store). A
//! grant event that can never be applied is set aside in the quarantine
//! table (an internal message is never dropped silently). Faults that pass
//! (the broker) are retried with backoff while readiness is NOT_SERVING
//! (`sluice_common::fault` decides which is which).

use std::collections::BTreeMap;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use prost::Message;
use sluice_common::fault::{classify_kafka, panic_message};
use sluice_common::kafka::{
    next_batch, InMsg, OutMsg, Outbox, PartitionInput, PartitionTaskError, PartitionTaskFactory, Publisher,
};
use sluice_common::link::Downlink;
use sluice_common::owner::{insert_quarantined, report_quarantined, OwnerRegistry, Rejected};
use sluice_common::partition::job_partition;
use sluice_common::readiness::Readiness;
use sluice_common::telemetry::trace_context_from_headers;
use sluice_common::validate::{check_ticket, FieldError};
use sluice_common::{FaultPoint, Faults, SluiceConfig};
use sluice_proto::v1 as pb;

use crate::chain;
use crate::effects::{count_dead_letters, DeadLetterClass, Routes};
use crate::json_request::decode_json_request;
use crate::partition::{HandOver, Incoming, Local};

use sluice_common::retry::Backoff;

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

/// What the request consumer needs.
pub struct RequestConsumer {
    pub config: Arc<SluiceConfig>,
    pub routes: Arc<Routes>,
    pub publisher: Publisher,
    pub readiness: Readiness,
    pub faults: Faults,
    /// The topic it reads (`jobs.requested`, or a tenant's own).
    pub topic: Arc<str>,
    /// Whose requests may come on it.
    pub tenants: TopicTenants,
    /// Where requests are handed over (`sluice.jobs`).
    pub jobs_topic: Arc<str>,
    /// This instance's job partitions: requests for them are handed over
    /// in process.
    pub registry: Arc<OwnerRegistry<Local>>,
}

/// The tenants whose requests a requested-jobs topic carries.
#[derive(Clone, Debug)]
pub enum TopicTenants {
    /// A tenant's own topic: that tenant only.
    Only(Arc<str>),
    /// The shared topic: every tenant but those with a topic of their own.
    AllBut(Arc<std::collections::BTreeSet<String>>),
}

impl TopicTenants {
    /// Why a request of `tenant` may not come on `topic`, if it may not.
    pub fn refusal(&self, topic: &str, tenant: &str) -> Option<Refusal> {
        let reason = match self {
            TopicTenants::Only(own) if own.as_ref() != tenant => format!(
                "tenant_mismatch: the request names tenant {tenant:?} but came on {topic}, the topic of tenant {own:?}"
            ),
            TopicTenants::AllBut(own_topics) if own_topics.contains(tenant) => format!(
                "tenant_mismatch: tenant {tenant:?} sends its requests on its own topic (topics.tenant_requested), not on {topic}"
            ),
            _ => return None,
        };
        Some(Refusal {
            class: DeadLetterClass::TenantMismatch,
            reason,
        })
    }
}

impl PartitionTaskFactory for RequestConsumer {
    fn start(&self, input: PartitionInput) -> BoxFuture<'static, Result<(), PartitionTaskError>> {
        let context = RequestContext {
            config: self.config.clone(),
            routes: self.routes.clone(),
            publisher: self.publisher.clone(),
            readiness: self.readiness.clone(),
            faults: self.faults.clone(),
            topic: self.topic.clone(),
            tenants: self.tenants.clone(),
            jobs_topic: self.jobs_topic.clone(),
            registry: self.registry.clone(),
        };
        async move { context.run(input).await }.boxed()
    }
}

/// How a step of the consumer ended.
enum Step<T> {
    Done(T),
    Stop,
}

struct RequestContext {
    config: Arc<SluiceConfig>,
    routes: Arc<Routes>,
    publisher: Publisher,
    readiness: Readiness,
    faults: Faults,
    topic: Arc<str>,
    tenants: TopicTenants,
    jobs_topic: Arc<str>,
    registry: Arc<OwnerRegistry<Local>>,
}

impl RequestContext {
    async fn run(self, mut input: PartitionInput) -> Result<(), PartitionTaskError> {
        let max_batch = self.config.admission.max_batch;
        let condition = format!("admission {} partition {}", self.topic, input.partition);
        while let Some(batch) = next_batch(&mut input, max_batch).await {
            let mut handovers = Outbox::new();
            let mut handed: Vec<&InMsg> = Vec::new();
            let mut local: BTreeMap<i32, Vec<(&InMsg, Incoming)>> = BTreeMap::new();
            let mut dead_letters: Vec<(OutMsg, DeadLetterClass)> = Vec::new();
            for message in &batch {
                let admitted = admit_message(&self.config, &self.topic, message).and_then(|incoming| {
                    match self.tenants.refusal(&self.topic, &incoming.valid.request.tenant) {
                        Some(refusal) => Err(refusal),
                        None => Ok(incoming),
                    }
                });
                match admitted {
                    Ok(incoming) => {
                        let partition = job_partition(&incoming.job_id, self.routes.jobs_partitions);
                        if self.registry.owns(partition) {
                            local.entry(partition).or_default().push((message, incoming));
                        } else {
                            let handover = self.handover_of(message, &incoming.job_id);
                            handovers.push_entry(&self.jobs_topic, partition, &handover, self.routes.max_message_bytes);
                            handed.push(message);
                        }
                    }
                    Err(refusal) => {
                        tracing::warn!(topic = %self.topic, partition = message.partition, offset = message.offset, reason = %refusal.reason, "dead-lettering a job request");
                        dead_letters.push((
                            self.routes
                                .dead_letter(&self.topic, message, refusal.class, &refusal.reason),
                            refusal.class,
                        ));
                    }
                }
            }
            // Requests for partitions this instance owns go to their task
            // directly; those whose partition moved meanwhile go through
            // `sluice.jobs` like the others (a request that was saved after
            // all is a duplicate there: same job id).
            for (partition, missed) in self.hand_over_locally(local).await {
                for (message, job_id) in missed {
                    let handover = self.handover_of(message, &job_id);
                    handovers.push_entry(&self.jobs_topic, partition, &handover, self.routes.max_message_bytes);
                    handed.push(message);
                }
            }
            match self.hand_over(handovers, &input, &condition).await {
                Step::Done(true) => {}
                Step::Done(false) => {
                    // The broker refuses the hand-over for its size: the
                    // requests are dead letters, not lost.
                    for message in handed {
                        dead_letters.push((
                            self.routes.dead_letter(
                                &self.topic,
                                message,
                                DeadLetterClass::Internal,
                                "handing the request over to its job's owner failed: the broker refuses the message",
                            ),
                            DeadLetterClass::Internal,
                        ));
                    }
                }
                Step::Stop => return Ok(()),
            }
            if let Step::Stop = deliver_dead_letters(&self, dead_letters, &input, &condition).await {
                return Ok(());
            }
            if self.faults.hit(FaultPoint::AdmissionAfterPublishBeforeOffsetStore) {
                return Err(PartitionTaskError::Crashed);
            }
            if let Some(last) = batch.last() {
                input.offsets.store(last.offset + 1);
            }
        }
        Ok(())
    }

    /// Hand requests to this instance's partition tasks, one call per
    /// partition, answered once saved. Returns the requests of partitions
    /// that could not take them (no longer owned here).
    async fn hand_over_locally<'a>(
        &self,
        local: BTreeMap<i32, Vec<(&'a InMsg, Incoming)>>,
    ) -> Vec<(i32, Vec<(&'a InMsg, String)>)> {
        let calls = local.into_iter().map(|(partition, items)| async move {
            let mut sources = Vec::with_capacity(items.len());
            let mut handovers = Vec::with_capacity(items.len());
            for (message, incoming) in items {
                sources.push((message, incoming.job_id.clone()));
                handovers.push(HandOver {
                    source_topic: self.topic.to_string(),
                    source: message.clone(),
                    checked: Ok(incoming),
                });
            }
            let answered = self
                .registry
                .call(partition, |reply| Local::HandOver { handovers, reply })
                .await
                .is_ok();
            (partition, if answered { Vec::new() } else { sources })
        });
        futures::future::join_all(calls)
            .await
            .into_iter()
            .filter(|(_, missed)| !missed.is_empty())
            .collect()
    }

    fn handover_of(&self, message: &InMsg, job_id: &str) -> pb::JobHandOver {
        pb::JobHandOver {
            job_id: job_id.to_string(),
            source_topic: self.topic.to_string(),
            source_partition: message.partition,
            source_offset: message.offset,
            source_timestamp_ms: message.timestamp_ms.unwrap_or_default(),
            payload: message.payload.clone().unwrap_or_default(),
            headers: message
                .headers
                .iter()
                .map(|(name, value)| pb::MessageHeader {
                    name: name.clone(),
                    value: value.clone(),
                })
                .collect(),
        }
    }

    /// Publish the hand-overs until acknowledged. `Done(false)` when the
    /// broker refuses them for what they are (their size).
    async fn hand_over(&self, handovers: Outbox, input: &PartitionInput, condition: &str) -> Step<bool> {
        if handovers.is_empty() {
            return Step::Done(true);
        }
        let messages = handovers.into_messages();
        let mut backoff = Backoff::new();
        loop {
            match self.publisher.send_all(messages.clone()).await {
                Ok(()) => {
                    self.readiness.clear(condition);
                    return Step::Done(true);
                }
                Err(sluice_common::kafka::KafkaPlumbingError::Delivery { source, .. })
                    if !classify_kafka(&source).is_transient() =>
                {
                    tracing::error!(topic = %self.topic, error = %source, "the broker refuses a hand-over; dead-lettering its requests");
                    return Step::Done(false);
                }
                Err(error) => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), topic = %self.topic, %error, "handing requests over failed, retrying");
                    self.readiness.set(condition, format!("handing requests over: {error}"));
                    sluice_common::metrics::metrics()
                        .transient_faults
                        .add(1, &[opentelemetry::KeyValue::new("service", crate::SERVICE)]);
                    if input.stop.is_cancelled() {
                        return Step::Stop;
                    }
                    backoff.wait().await;
                }
            }
        }
    }
}

/// Publish dead letters until every one is acknowledged (offsets are stored
/// only after). One the broker refuses for its size is sent again with its
/// payload and the producer's headers cut; the others are never held back by
/// it. `Stop` when the partition is given up (the next owner reads the
/// messages again, so no dead letter is lost).
async fn deliver_dead_letters(
    context: &RequestContext,
    letters: Vec<(OutMsg, DeadLetterClass)>,
    input: &PartitionInput,
    condition: &str,
) -> Step<()> {
    let topic: &str = &context.topic;
    let mut pending = letters;
    let mut backoff = Backoff::new();
    while !pending.is_empty() {
        let messages: Vec<OutMsg> = pending.iter().map(|(message, _)| message.clone()).collect();
        let results = context.publisher.send_each(&messages).await;
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
            tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), topic, %error, dead_letters = pending.len(), "publishing dead letters failed, retrying");
            context
                .readiness
                .set(condition, format!("publishing dead letters: {error}"));
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            backoff.wait().await;
        }
    }
    context.readiness.clear(condition);
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

/// A grant event admission can apply: its ticket names a job and attempt.
fn check_grant(event: &pb::GrantEvent) -> Result<(), String> {
    check_ticket("ticket", event.ticket.as_ref()).map_err(|error| error.to_string())
}

/// Grant events from the links (the hot path): each goes to the task of its
/// job's partition. One that can never be applied is set aside in the
/// quarantine table; one for a partition this instance does not own is
/// dropped (its new owner re-sends the acquire, and the key's owner then
/// sends the grant again). Runs until `shutdown`.
pub async fn run_link_grants(
    registry: Arc<OwnerRegistry<Local>>,
    pool: sqlx::PgPool,
    jobs_partitions: i32,
    mut grants: tokio::sync::mpsc::Receiver<Downlink>,
    shutdown: sluice_common::Shutdown,
) -> Result<(), PartitionTaskError> {
    let mut not_owned = NotOwnedGrants::default();
    loop {
        let encoded = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            received = grants.recv() => match received {
                Some(Downlink::Grants(batch)) => batch,
                // Every grant before it is queued to its job partition.
                Some(Downlink::Barrier(reply)) => {
                    let _ = reply.send(());
                    continue;
                }
                None => return Ok(()),
            },
        };
        let mut by_partition: std::collections::BTreeMap<i32, Vec<pb::GrantEvent>> = std::collections::BTreeMap::new();
        let mut rejected: Vec<Rejected> = Vec::new();
        for entry in encoded {
            let checked = pb::GrantEvent::decode(entry.as_slice())
                .map_err(|error| format!("undecodable grant event: {error}"))
                .and_then(|event| check_grant(&event).map(|()| event));
            match checked {
                Ok(event) => {
                    let job_id = event
                        .ticket
                        .as_ref()
                        .map(|ticket| ticket.job_id.as_str())
                        .unwrap_or_default();
                    by_partition
                        .entry(job_partition(job_id, jobs_partitions))
                        .or_default()
                        .push(event);
                }
                Err(reason) => rejected.push(Rejected {
                    offset: -1,
                    entry,
                    reason,
                }),
            }
        }
        for (partition, events) in by_partition {
            let count = events.len();
            if let Err(error) = registry.submit(partition, Local::Grants(events)).await {
                not_owned.dropped(partition, count, &error);
            }
        }
        if !rejected.is_empty() {
            set_aside_grants(&pool, &rejected, &shutdown).await;
        }
    }
}

/// Grants for job partitions this instance does not own: normal for a
/// moment after a handover (the owner re-sends its acquires, and the grant
/// follows), a fault if it goes on (the owners route a partition's grants
/// by the claims they last read). Counted; said once drops have gone on
/// for `NOT_OWNED_FOR`, and then at most that often.
#[derive(Default)]
struct NotOwnedGrants {
    /// Grants dropped since the streak began or was last said.
    grants: u64,
    partitions: std::collections::BTreeSet<i32>,
    /// The first drop of drops no more than `NOT_OWNED_FOR` apart.
    streak_from: Option<std::time::Instant>,
    last_drop: Option<std::time::Instant>,
    said_at: Option<std::time::Instant>,
}

const NOT_OWNED_FOR: std::time::Duration = std::time::Duration::from_secs(10);

impl NotOwnedGrants {
    #[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
    fn dropped(&mut self, partition: i32, count: usize, error: &sluice_common::owner::LocalCallError) {
        let count = u64::try_from(count).unwrap_or(u64::MAX);
        sluice_common::metrics::metrics().link_grants_not_owned.add(count, &[]);
        tracing::debug!(partition, grants = count, %error, "grants for a job partition this instance does not own; dropped");
        let now = std::time::Instant::now();
        if self
            .last_drop
            .is_none_or(|last| now.duration_since(last) > NOT_OWNED_FOR)
        {
            *self = NotOwnedGrants {
                streak_from: Some(now),
                ..NotOwnedGrants::default()
            };
        }
        self.last_drop = Some(now);
        self.grants = self.grants.saturating_add(count);
        self.partitions.insert(partition);
        let going_on = self
            .streak_from
            .is_some_and(|from| now.duration_since(from) >= NOT_OWNED_FOR);
        let said_lately = self
            .said_at
            .is_some_and(|said| now.duration_since(said) < NOT_OWNED_FOR);
        if going_on && !said_lately {
            tracing::warn!(
                grants = self.grants,
                partitions = ?self.partitions,
                since = ?self.streak_from.map(|from| now.duration_since(from)),
                "grants for job partitions this instance does not own keep arriving and are dropped: \
                 the owners route them to this instance although another owns the partitions"
            );
            self.grants = 0;
            self.partitions.clear();
            self.said_at = Some(now);
        }
    }
}

/// Set grant events aside in admission's quarantine table (logged, counted).
async fn set_aside_grants(pool: &sqlx::PgPool, rejected: &[Rejected], shutdown: &sluice_common::Shutdown) {
    const TOPIC: &str = "link";
    let mut backoff = Backoff::new();
    loop {
        let saved = async {
            let mut connection = pool.acquire().await?;
            insert_quarantined(&mut connection, TOPIC, -1, rejected).await
        }
        .await;
        match saved {
            Ok(()) => {
                report_quarantined(crate::SERVICE, TOPIC, -1, rejected);
                return;
            }
            Err(error) => {
                // Never dropped: a permanent refusal is said loudly and
                // retried all the same (an operator can fix the table).
                if sluice_common::fault::classify_sql(&error).is_transient() {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), %error, "setting grant events aside failed, retrying");
                } else {
                    tracing::error!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), %error, "PostgreSQL refuses to set grant events aside; retrying until it takes them");
                }
                if shutdown.is_triggered() {
                    return;
                }
                backoff.wait().await;
            }
        }
    }
}
