//! The Kafka worker: docs/worker-protocol.md §1–§4.
//!
//! It fetches a job only when it has a free slot, claims it at once, runs
//! it when the claim answers CLAIMED, heartbeats every third of the lease
//! while it runs, and completes it. A claim that failed in transit is sent
//! again; if that answers TAKEN (maybe its own first claim), or no claim
//! is answered at all, a heartbeat decides (§2): EXTENDED means the claim
//! was this worker's. A heartbeat answered LEASE_LOST, or no renewal
//! holding any more (§3), stops the handler without completing.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use rand::Rng;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::{ClientContext, Message as _};
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;
use tokio::time::Instant;
use tonic::transport::Channel;

use crate::events::{now_ms, Event, EventLog};
use crate::worker::{admission_client, Settings, TASK_GROUP};
use crate::workload::{job_index, run_ms};

/// How long a claim (or its resolution by heartbeat) is tried.
const CLAIM_FOR: Duration = Duration::from_secs(15);
/// How long a completion is sent again after transport errors.
const COMPLETE_FOR: Duration = Duration::from_secs(60);
const RETRY_AFTER: Duration = Duration::from_millis(200);

pub async fn run(settings: &Settings, log: Arc<EventLog>) -> anyhow::Result<()> {
    let config = sluice_common::SluiceConfig::load(Some(&settings.config))?;
    let mut client_config = sluice_common::kafka::client_config(&config.kafka);
    client_config
        .set("group.id", format!("{}chaos-workers", config.kafka.topic_prefix))
        .set("auto.offset.reset", "earliest")
        .set("enable.auto.commit", "true")
        .set("session.timeout.ms", config.kafka.session_timeout_ms.to_string())
        // As docs/worker-protocol.md §1 advises: a worker's death moves only
        // its own partitions, the others go on consuming.
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("fetch.wait.max.ms", config.kafka.fetch_wait_max_ms.to_string());
    let consumer: Arc<StreamConsumer<Logged>> = Arc::new(client_config.create_with_context(Logged)?);
    consumer.subscribe(&[&config.admitted_topic(TASK_GROUP)])?;
    {
        // Ready once the group assigned this worker partitions (the
        // assignment happens while it waits for a message).
        let (consumer, log) = (consumer.clone(), log.clone());
        tokio::spawn(async move {
            loop {
                if consumer.assignment().is_ok_and(|assigned| assigned.count() > 0) {
                    log.write(0, 0, Event::Ready);
                    return;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
    }
    let client = admission_client(&settings.admission)?;
    let worker_id: Arc<str> = settings.worker_id.clone().into();
    let slots = Arc::new(tokio::sync::Semaphore::new(settings.slots.max(1)));
    // Attempts this process is dealing with: a second delivery of one of
    // them is dropped. (A duplicate whose claim failed in transit would
    // otherwise be resolved by a heartbeat answering EXTENDED, the
    // attempt being this worker's, and run a second time.)
    let handling: Arc<std::sync::Mutex<HashSet<(String, u32)>>> = Arc::default();
    loop {
        let slot = slots.clone().acquire_owned().await?;
        let job = match consumer.recv().await {
            Ok(message) => {
                let job = pb::AdmittedJob::decode(message.payload().unwrap_or_default());
                if let Ok(job) = &job {
                    eprintln!(
                        "at {} ms received {} attempt {} from partition {} offset {}",
                        now_ms(),
                        job.job_id,
                        job.attempt,
                        message.partition(),
                        message.offset()
                    );
                }
                job
            }
            Err(error) => {
                eprintln!("chaos worker {worker_id}: consuming: {error}");
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            }
        };
        let Ok(job) = job else { continue };
        let attempt = (job.job_id.clone(), job.attempt);
        if !lock(&handling).insert(attempt.clone()) {
            continue;
        }
        let (client, worker_id, log, handling) = (client.clone(), worker_id.clone(), log.clone(), handling.clone());
        let abandon = rand::rng().random_bool(settings.abandon.clamp(0.0, 1.0));
        tokio::spawn(async move {
            run_job(job, client, &worker_id, &log, abandon).await;
            lock(&handling).remove(&attempt);
            drop(slot);
        });
    }
}

/// Logs every rebalance with the wall clock, to line a stall up with the
/// group's moves (the worker's log file).
struct Logged;

impl ClientContext for Logged {}

impl ConsumerContext for Logged {
    fn pre_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Revoke(list) => eprintln!("at {} ms revoked {} partitions", now_ms(), list.count()),
            Rebalance::Error(error) => eprintln!("at {} ms rebalance error: {error}", now_ms()),
            Rebalance::Assign(_) => {}
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(list) = rebalance {
            let partitions: Vec<i32> = list.elements().iter().map(|element| element.partition()).collect();
            eprintln!("at {} ms assigned {partitions:?}", now_ms());
        }
    }
}

fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn attempt_of(job: &pb::AdmittedJob) -> pb::JobAttempt {
    pb::JobAttempt {
        job_id: job.job_id.clone(),
        attempt: job.attempt,
    }
}

async fn run_job(
    job: pb::AdmittedJob,
    client: AdmissionClient<Channel>,
    worker_id: &str,
    log: &EventLog,
    abandon: bool,
) {
    let Some(index) = job_index(&job.job_id) else { return };
    let attempt = job.attempt;
    let lease_ms = i64::try_from(job.lease_ms).unwrap_or(i64::MAX).max(1);
    let Some((via, claim_sent)) = claim(&client, worker_id, &job).await else {
        return;
    };
    log.write(index, attempt, Event::Got { via: via.to_string() });
    log.write(index, attempt, Event::Confirmed);
    // By the worker's own count: from when the winning call was sent.
    let mut held_until = claim_sent + lease_ms;
    log.write(index, attempt, Event::Start);
    let ends = Instant::now() + Duration::from_millis(run_ms(index));
    let every = Duration::from_millis(u64::try_from(lease_ms / 3).unwrap_or(1).max(1));
    let mut next_beat = Instant::now() + every;
    while Instant::now() < ends {
        tokio::time::sleep_until(if abandon { ends } else { ends.min(next_beat) }).await;
        if Instant::now() >= ends {
            break;
        }
        let sent = now_ms();
        let answer = client
            .clone()
            .heartbeat(pb::HeartbeatRequest {
                worker_id: worker_id.to_string(),
                jobs: vec![attempt_of(&job)],
                stream_ended: None,
            })
            .await
            .ok()
            .and_then(|response| response.into_inner().results.into_iter().next());
        match answer.map(|result| result.outcome()) {
            Some(pb::HeartbeatOutcome::Extended) => {
                held_until = held_until.max(sent + lease_ms);
                next_beat = Instant::now() + every;
            }
            Some(pb::HeartbeatOutcome::LeaseLost) => {
                log.write(
                    index,
                    attempt,
                    Event::LeaseLost {
                        held_until_ms: held_until,
                    },
                );
                log.write(
                    index,
                    attempt,
                    Event::End {
                        how: "lease_lost".into(),
                    },
                );
                return;
            }
            // No answer, or one this workload never causes (CANCELLED):
            // try again soon.
            _ => next_beat = Instant::now() + RETRY_AFTER,
        }
        if now_ms() > held_until {
            log.write(
                index,
                attempt,
                Event::End {
                    how: "lease_timeout".into(),
                },
            );
            return;
        }
    }
    if abandon {
        log.write(
            index,
            attempt,
            Event::End {
                how: "abandoned".into(),
            },
        );
        return;
    }
    log.write(index, attempt, Event::End { how: "done".into() });
    let first = Instant::now();
    loop {
        let sent = now_ms();
        let answer = client
            .clone()
            .complete(pb::CompleteRequest {
                worker_id: worker_id.to_string(),
                completions: vec![pb::Completion {
                    job_id: job.job_id.clone(),
                    attempt,
                    outcome: Some(pb::completion::Outcome::Success(pb::Success {})),
                }],
            })
            .await
            .ok()
            .and_then(|response| response.into_inner().results.into_iter().next());
        if let Some(result) = answer {
            let answer = result
                .outcome()
                .as_str_name()
                .trim_start_matches("COMPLETE_OUTCOME_")
                .to_string();
            log.write(
                index,
                attempt,
                Event::Complete {
                    answer,
                    sent_ms: sent,
                    held_until_ms: held_until,
                },
            );
            return;
        }
        if first.elapsed() > COMPLETE_FOR {
            log.write(
                index,
                attempt,
                Event::Complete {
                    answer: "GAVE_UP".into(),
                    sent_ms: sent,
                    held_until_ms: held_until,
                },
            );
            return;
        }
        tokio::time::sleep(RETRY_AFTER).await;
    }
}

/// Claim the job's attempt (§2): how it was won and when the winning call
/// was sent, or `None` when it is not this worker's to run.
async fn claim(
    client: &AdmissionClient<Channel>,
    worker_id: &str,
    job: &pb::AdmittedJob,
) -> Option<(&'static str, i64)> {
    let started = Instant::now();
    let mut unsure = false;
    while started.elapsed() < CLAIM_FOR {
        let sent = now_ms();
        let claimed = client
            .clone()
            .claim(pb::ClaimRequest {
                worker_id: worker_id.to_string(),
                jobs: vec![attempt_of(job)],
            })
            .await;
        match claimed {
            Ok(response) => {
                let outcome = response.into_inner().results.first().map(pb::ClaimResult::outcome);
                match outcome {
                    Some(pb::ClaimOutcome::Claimed) => return Some(("claim", sent)),
                    // Maybe this worker's own claim that failed in transit.
                    Some(pb::ClaimOutcome::Taken) if unsure => break,
                    other => {
                        eprintln!(
                            "at {} ms claim of {} attempt {} answered {other:?}",
                            now_ms(),
                            job.job_id,
                            job.attempt
                        );
                        return None;
                    }
                }
            }
            Err(_) => {
                unsure = true;
                tokio::time::sleep(RETRY_AFTER).await;
            }
        }
    }
    // Whether a claim whose answer was lost won: a heartbeat says.
    let started = Instant::now();
    while started.elapsed() < CLAIM_FOR {
        let sent = now_ms();
        let answered = client
            .clone()
            .heartbeat(pb::HeartbeatRequest {
                worker_id: worker_id.to_string(),
                jobs: vec![attempt_of(job)],
                stream_ended: None,
            })
            .await;
        match answered {
            Ok(response) => {
                let outcome = response.into_inner().results.first().map(pb::HeartbeatResult::outcome);
                return (outcome == Some(pb::HeartbeatOutcome::Extended)).then_some(("heartbeat", sent));
            }
            Err(_) => tokio::time::sleep(RETRY_AFTER).await,
        }
    }
    None
}
