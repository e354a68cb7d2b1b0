//! Turning decided effects into Kafka messages: acquire and release commands
//! to the owners of the job's keys, admitted jobs to workers, dead letters.

use sluice_common::hash::HashMap;
use std::sync::Arc;

use prost::Message;
use sluice_common::kafka::{OutMsg, Outbox};
use sluice_common::link::Link;
use sluice_common::partition::{job_partition, key_partition, rate_key_partition};
use sluice_common::telemetry::trace_headers;
use sluice_common::SluiceConfig;
use sluice_proto::v1 as pb;

use crate::chain::StoredStep;
use crate::jobs::JobRow;
use crate::transitions::Effect;

/// One ticket release (`Routes::push_release_of`).
pub struct Release<'a> {
    pub job_id: &'a str,
    pub trace: &'a pb::TraceContext,
    pub attempt: u32,
    pub step_index: u32,
    pub reason: pb::ReleaseReason,
    /// How long the attempt ran (claim to its end), for adaptive keys.
    pub run_ms: Option<i64>,
    /// The partition's clock when the release was decided.
    pub sent_at_ms: i64,
}

/// Where admission's messages go.
#[derive(Clone, Debug)]
pub struct Routes {
    pub limit_partitions: i32,
    pub rate_partitions: i32,
    /// Job partitions (`sluice.jobs`).
    pub jobs_partitions: i32,
    pub deadletter: Arc<str>,
    pub admitted: HashMap<String, Arc<str>>,
    /// `kafka.partitions.admitted`: where an admitted message's key puts it
    /// (`partition/overtaken.rs`).
    pub admitted_partitions: i32,
    pub max_message_bytes: usize,
    /// `admission.claim_timeout`: an admitted job published again this long
    /// after its admission goes to another partition (`admitted_key`).
    pub claim_timeout_ms: i64,
}

impl Routes {
    pub fn from_config(config: &SluiceConfig) -> Self {
        Routes {
            limit_partitions: config.kafka.partitions.limit_commands,
            rate_partitions: config.kafka.partitions.rate_commands,
            jobs_partitions: config.kafka.partitions.jobs,
            deadletter: Arc::from(config.topic(&config.topics.deadletter)),
            admitted: config
                .task_groups
                .keys()
                .map(|group| (group.clone(), Arc::from(config.admitted_topic(group))))
                .collect(),
            admitted_partitions: config.kafka.partitions.admitted,
            max_message_bytes: config.kafka.max_message_bytes,
            claim_timeout_ms: i64::try_from(config.claim_timeout().0.as_millis()).unwrap_or(i64::MAX),
        }
    }

    pub fn job_partition(&self, job_id: &str) -> i32 {
        job_partition(job_id, self.jobs_partitions)
    }

    /// Add the messages of `effects` for `job` (its state after the
    /// transition). `now_ms`: the partition's clock (the batch's), stamped
    /// on what is sent: a decision replays from its inputs.
    pub fn push_effects(&self, outbox: &mut Outbox, job: &JobRow, effects: &[Effect], now_ms: i64) {
        for effect in effects {
            match effect {
                Effect::Acquire => self.push_acquire(outbox, job, now_ms),
                Effect::Admitted => self.push_admitted(outbox, job, now_ms, 0),
                Effect::Release {
                    attempt,
                    steps,
                    reason,
                    run_ms,
                } => {
                    for step_index in steps {
                        self.push_release(outbox, job, *attempt, *step_index, *reason, *run_ms, now_ms);
                    }
                }
                Effect::CancelRateWait { attempt, step } => self.push_rate_cancel(outbox, job, *attempt, *step, now_ms),
            }
        }
    }

    fn step_of<'a>(&self, job: &'a JobRow, step_index: u32) -> Option<&'a StoredStep> {
        job.state.chain.get(usize::try_from(step_index).unwrap_or(usize::MAX))
    }

    /// Which link and owner partition the acquire of the job's current
    /// step travels to (`None`: no such step, or a rate step without a key).
    pub fn acquire_route(&self, job: &JobRow) -> Option<(Link, i32)> {
        let step = self.step_of(job, job.state.step)?;
        if step.is_ticketed() {
            Some((
                Link::LimitGrant,
                key_partition(&step.tenant, &step.key, self.limit_partitions),
            ))
        } else {
            let rate_key = step.rate_key.as_ref()?;
            Some((Link::RateWindow, rate_key_partition(rate_key, self.rate_partitions)))
        }
    }

    /// Acquire the job's current step from its owner.
    pub fn push_acquire(&self, outbox: &mut Outbox, job: &JobRow, now_ms: i64) {
        let Some(step) = self.step_of(job, job.state.step) else {
            tracing::error!(job_id = %job.state.job_id, step = job.state.step, "acquire past the end of the chain");
            return;
        };
        let ticket = pb::TicketId {
            job_id: job.state.job_id.clone(),
            attempt: job.state.attempt,
            step: job.state.step,
        };
        let sent_at_ms = now_ms;
        if step.is_ticketed() {
            let limit = match (&step.floating, &step.adaptive) {
                (Some(floating), _) => pb::acquire_ticket::Limit::Floating((**floating).clone()),
                (None, Some(adaptive)) => pb::acquire_ticket::Limit::Adaptive((**adaptive).clone()),
                (None, None) => pb::acquire_ticket::Limit::MaxConcurrency(step.max_concurrency),
            };
            let command = pb::LimitCommand {
                trace: Some(job.trace.clone()),
                sent_at_ms,
                command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
                    key: Some(pb::KeyRef {
                        tenant: step.tenant.clone(),
                        key: step.key.clone(),
                    }),
                    ticket: Some(ticket),
                    priority: job.priority,
                    enqueued_at_us: job.enqueued_at_us,
                    limit: Some(limit),
                    fairness_key: job.spec.fairness_key().to_string(),
                    shadow: step.shadow,
                })),
            };
            let partition = key_partition(&step.tenant, &step.key, self.limit_partitions);
            outbox.push_link(Link::LimitGrant, partition, &command);
        } else {
            let Some(rate_key) = step.rate_key.as_deref().cloned() else {
                tracing::error!(job_id = %job.state.job_id, "rate step without a key");
                return;
            };
            let partition = rate_key_partition(&rate_key, self.rate_partitions);
            let command = pb::RateCommand {
                trace: Some(job.trace.clone()),
                sent_at_ms,
                command: Some(pb::rate_command::Command::Acquire(pb::RateAcquire {
                    key: Some(rate_key),
                    ticket: Some(ticket),
                    priority: job.priority,
                    enqueued_at_us: job.enqueued_at_us,
                    limit: step.rate_limit,
                    window_ms: step.rate_window_ms,
                    cost: step.rate_cost,
                })),
            };
            outbox.push_link(Link::RateWindow, partition, &command);
        }
    }

    /// Release (or withdraw) the ticket of `attempt` at `step_index`;
    /// `run_ms`: how long the attempt ran, for adaptive keys.
    #[allow(clippy::too_many_arguments)]
    pub fn push_release(
        &self,
        outbox: &mut Outbox,
        job: &JobRow,
        attempt: u32,
        step_index: u32,
        reason: pb::ReleaseReason,
        run_ms: Option<i64>,
        now_ms: i64,
    ) {
        let Some(step) = self.step_of(job, step_index) else {
            return;
        };
        if !step.is_ticketed() {
            return;
        }
        let release = Release {
            job_id: &job.state.job_id,
            trace: &job.trace,
            attempt,
            step_index,
            reason,
            run_ms,
            sent_at_ms: now_ms,
        };
        self.push_release_of(outbox, step, release);
    }

    pub fn push_release_of(&self, outbox: &mut Outbox, step: &StoredStep, release: Release<'_>) {
        let Release {
            job_id,
            trace,
            attempt,
            step_index,
            reason,
            run_ms,
            sent_at_ms,
        } = release;
        let command = pb::LimitCommand {
            trace: Some(trace.clone()),
            sent_at_ms,
            command: Some(pb::limit_command::Command::Release(pb::ReleaseTicket {
                key: Some(pb::KeyRef {
                    tenant: step.tenant.clone(),
                    key: step.key.clone(),
                }),
                ticket: Some(pb::TicketId {
                    job_id: job_id.to_string(),
                    attempt,
                    step: step_index,
                }),
                reason: reason as i32,
                run_ms: run_ms.and_then(|run_ms| u64::try_from(run_ms).ok()),
            })),
        };
        let partition = key_partition(&step.tenant, &step.key, self.limit_partitions);
        outbox.push_link(Link::LimitGrant, partition, &command);
    }

    fn push_rate_cancel(&self, outbox: &mut Outbox, job: &JobRow, attempt: u32, step_index: u32, now_ms: i64) {
        let Some(step) = self.step_of(job, step_index) else {
            return;
        };
        let Some(rate_key) = step.rate_key.as_deref().cloned() else {
            return;
        };
        let partition = rate_key_partition(&rate_key, self.rate_partitions);
        let command = pb::RateCommand {
            trace: Some(job.trace.clone()),
            sent_at_ms: now_ms,
            command: Some(pb::rate_command::Command::Cancel(pb::RateCancel {
                key: Some(rate_key),
                ticket: Some(pb::TicketId {
                    job_id: job.state.job_id.clone(),
                    attempt,
                    step: step_index,
                }),
            })),
        };
        outbox.push_link(Link::RateWindow, partition, &command);
    }

    /// Publish the job to its task group's workers.
    /// What a worker gets of an admitted job (Kafka message or stream push).
    pub fn admitted_job(&self, job: &JobRow, now_ms: i64) -> pb::AdmittedJob {
        pb::AdmittedJob {
            job_id: job.state.job_id.clone(),
            attempt: job.state.attempt,
            tenant: job.tenant.clone(),
            task_group: job.task_group.clone(),
            priority: job.priority,
            payload: job.payload.clone(),
            enqueued_at_ms: job.enqueued_at_us / 1000,
            admitted_at_ms: job.state.admitted_at_ms.unwrap_or(now_ms),
            max_attempts: job.state.max_attempts,
            lease_ms: u64::try_from(job.state.lease_ms).unwrap_or_default(),
        }
    }

    /// The key of `job`'s admitted message published at `now_ms`, its
    /// re-send number raised by `salt` (`partition/overtaken.rs`). Keyed by
    /// attempt: a job handed back (a new attempt) may land on another
    /// worker's partition instead of the one that gave it back. Published
    /// again because nobody claimed it within the claim timeout, it is keyed
    /// by how many claim timeouts passed too: the partition it sat on may
    /// have no live consumer (a worker that hangs while its client still
    /// heartbeats holds its partitions until `max.poll.interval.ms`; a group
    /// slow to reassign a dead worker's).
    pub fn admitted_key_of(&self, job: &JobRow, now_ms: i64, salt: u32) -> String {
        let resends = job.state.admitted_at_ms.map_or(0, |admitted_at| {
            now_ms.saturating_sub(admitted_at) / self.claim_timeout_ms.max(1)
        });
        let resends = u32::try_from(resends).unwrap_or(u32::MAX).saturating_add(salt);
        admitted_key(&job.state.job_id, job.state.attempt, resends)
    }

    /// Publish the admitted job, its key's re-send number raised by `salt`
    /// (`admitted_key_of`).
    pub fn push_admitted(&self, outbox: &mut Outbox, job: &JobRow, now_ms: i64, salt: u32) {
        let Some(topic) = self.admitted.get(&job.task_group) else {
            tracing::error!(job_id = %job.state.job_id, task_group = %job.task_group, "no admitted topic for task group");
            return;
        };
        let admitted = self.admitted_job(job, now_ms);
        let mut headers = trace_headers(&job.trace);
        headers.push(("content-type".to_string(), b"application/x-protobuf".to_vec()));
        outbox.push(OutMsg {
            topic: topic.clone(),
            partition: None,
            key: Some(self.admitted_key_of(job, now_ms, salt).into_bytes()),
            payload: admitted.encode_to_vec(),
            headers,
        });
    }

    /// A producer message that cannot become a job, with the reason, as a
    /// dead letter (see `dead_letter`).
    pub fn push_deadletter(
        &self,
        outbox: &mut Outbox,
        source_topic: &str,
        message: &sluice_common::kafka::InMsg,
        class: DeadLetterClass,
        reason: &str,
    ) {
        outbox.push(self.dead_letter(source_topic, message, class, reason));
    }

    /// The dead letter of a producer message: its key, payload and headers,
    /// plus `sluice-deadletter-reason` (the reason, naming the field),
    /// `sluice-deadletter-class` (one of a fixed set: the metric's label),
    /// and where it came from. One that would not fit in
    /// `kafka.max_message_bytes` has its payload cut (and, if that is not
    /// enough, its own headers dropped), with headers saying so: a dead
    /// letter is never lost for its size.
    pub fn dead_letter(
        &self,
        source_topic: &str,
        message: &sluice_common::kafka::InMsg,
        class: DeadLetterClass,
        reason: &str,
    ) -> OutMsg {
        let reason = sluice_common::fault::clean_text(reason, MAX_REASON_BYTES);
        let ours = vec![
            ("sluice-deadletter-reason".to_string(), reason.into_bytes()),
            ("sluice-deadletter-class".to_string(), class.label().as_bytes().to_vec()),
            ("sluice-source-topic".to_string(), source_topic.as_bytes().to_vec()),
            (
                "sluice-source-partition".to_string(),
                message.partition.to_string().into_bytes(),
            ),
            (
                "sluice-source-offset".to_string(),
                message.offset.to_string().into_bytes(),
            ),
        ];
        let payload = message.payload.clone().unwrap_or_default();
        let key = message.key.clone();
        let headers_size = |headers: &[(String, Vec<u8>)]| -> usize {
            headers
                .iter()
                .map(|(name, value)| name.len() + value.len() + RECORD_FIELD_OVERHEAD)
                .sum()
        };
        let budget = self.max_message_bytes.saturating_sub(RECORD_OVERHEAD);
        let key_size = key.as_ref().map_or(0, Vec::len);
        let mut headers = message.headers.clone();
        let mut extra = Vec::new();
        let mut fixed = key_size + headers_size(&headers) + headers_size(&ours) + 128;
        if fixed > budget {
            // The producer's own headers alone do not leave room.
            extra.push((
                "sluice-deadletter-headers-dropped".to_string(),
                headers.len().to_string().into_bytes(),
            ));
            headers.clear();
            fixed = key_size + headers_size(&ours) + 256;
        }
        let room = budget.saturating_sub(fixed);
        let payload = if payload.len() > room {
            extra.push((
                "sluice-deadletter-payload-truncated".to_string(),
                payload.len().to_string().into_bytes(),
            ));
            payload[..room].to_vec()
        } else {
            payload
        };
        headers.extend(ours);
        headers.extend(extra);
        OutMsg {
            topic: self.deadletter.clone(),
            partition: None,
            key: if key_size > budget / 2 { None } else { key },
            payload,
            headers,
        }
    }
}

/// Why a producer message is a dead letter: a fixed set, so the metric's
/// label stays bounded (the reason itself is in the dead letter's header).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeadLetterClass {
    /// Not a protobuf or JSON job request at all.
    Undecodable,
    /// A request with a field that fails validation (the reason names it).
    Invalid,
    /// The job id exists with a different request.
    Conflict,
    /// PostgreSQL refuses to store it, every time.
    Storage,
    /// Checking it failed inside Sluice (a bug); it is kept, not lost.
    Internal,
    /// Its tenant is not the tenant of the topic it came on
    /// (`topics.tenant_requested`).
    TenantMismatch,
    /// Its tenant was over a quota (`max_waiting`,
    /// `max_enqueues_per_second`).
    Quota,
}

impl DeadLetterClass {
    pub fn label(self) -> &'static str {
        match self {
            DeadLetterClass::Undecodable => "undecodable",
            DeadLetterClass::Invalid => "invalid",
            DeadLetterClass::Conflict => "conflict",
            DeadLetterClass::Storage => "storage",
            DeadLetterClass::Internal => "internal",
            DeadLetterClass::TenantMismatch => "tenant_mismatch",
            DeadLetterClass::Quota => "quota",
        }
    }
}

/// The longest reason header.
const MAX_REASON_BYTES: usize = 2048;
/// A record's framing on the broker, and each header's, in bytes (generous).
const RECORD_OVERHEAD: usize = 512;
const RECORD_FIELD_OVERHEAD: usize = 16;

/// Count dead letters that were delivered, by source topic and class.
pub fn count_dead_letters(source_topic: &str, class: DeadLetterClass, count: u64) {
    sluice_common::metrics::metrics().dead_letters.add(
        count,
        &[
            opentelemetry::KeyValue::new("topic", source_topic.to_string()),
            opentelemetry::KeyValue::new("reason", class.label()),
        ],
    );
}

/// The Kafka key of an admitted message: `<job id>/<attempt>` when it is
/// published at its admission (or by a new owner within a claim timeout of
/// it), `<job id>/<attempt>/<n>` when published again `n` claim timeouts
/// after it: each re-send lands on a partition picked anew.
pub fn admitted_key(job_id: &str, attempt: u32, resends: u32) -> String {
    if resends == 0 {
        format!("{job_id}/{attempt}")
    } else {
        format!("{job_id}/{attempt}/{resends}")
    }
}
