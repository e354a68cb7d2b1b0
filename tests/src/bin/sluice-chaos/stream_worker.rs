//! The `Work`-stream worker: docs/worker-protocol.md §7.
//!
//! One stream to every instance `Instances` lists (asked every 3 s; a
//! stream that ends is opened again within a second while its instance is
//! listed), each opened with half its slots as credits (there are two
//! instances), a credit given back to the
//! stream a job came from when the job is done with. Every pushed attempt
//! is heartbeaten at once (which confirms it), then every third of
//! `min(lease, stream end grace)`, on any open stream; a renewal holds for
//! that long from when it was sent, and a handler whose renewals stopped
//! holding is stopped. Completions go on the job's own stream, or any
//! other when it is gone, and are sent again until answered (a minute at
//! most).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use sluice_proto::v1 as pb;
use sluice_proto::v1::work_request::Message as Up;
use sluice_proto::v1::work_response::Message as Down;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::events::{now_ms, Event, EventLog};
use crate::worker::{admission_client, Settings, TASK_GROUP};
use crate::workload::{job_index, run_ms};

const DISCOVER_EVERY: Duration = Duration::from_secs(3);
const REOPEN_AFTER: Duration = Duration::from_secs(1);
const RETRY_AFTER_MS: i64 = 200;
const COMPLETE_FOR_MS: i64 = 60_000;

type Key = (String, u32);

enum Msg {
    Down {
        endpoint: Arc<str>,
        generation: u64,
        message: pb::WorkResponse,
    },
    Closed {
        endpoint: Arc<str>,
        generation: u64,
    },
    Done(Key),
    Instances(Vec<String>),
}

struct Session {
    up: mpsc::Sender<pb::WorkRequest>,
    generation: u64,
    opened: bool,
    grace_ms: i64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    /// The handler ended; the attempt is to be abandoned once confirmed.
    AbandonWhenConfirmed,
    /// The handler ended; its success is being completed.
    Completing,
}

struct Running {
    index: usize,
    endpoint: Arc<str>,
    generation: u64,
    /// How long one renewal holds: `min(lease, stream end grace)`.
    renewal_ms: i64,
    held_until: i64,
    next_beat: i64,
    confirmed: bool,
    abandon: bool,
    state: State,
    handler: Option<tokio::task::AbortHandle>,
    /// A completion waiting to be sent again (at this time), and when the
    /// first was sent.
    resend_at: Option<i64>,
    first_complete_ms: Option<i64>,
}

enum Request {
    Heartbeat(Vec<Key>),
    Complete { key: Key, held_until: i64 },
}

struct Sent {
    request: Request,
    endpoint: Arc<str>,
    generation: u64,
    at_ms: i64,
}

struct Worker {
    worker_id: String,
    credits: u32,
    abandon: f64,
    instant: bool,
    log: Arc<EventLog>,
    events: mpsc::UnboundedSender<Msg>,
    instances: Vec<String>,
    sessions: HashMap<Arc<str>, Session>,
    tried: HashMap<Arc<str>, Instant>,
    next_generation: u64,
    running: HashMap<Key, Running>,
    sent: HashMap<u64, Sent>,
    next_id: u64,
    ready: bool,
}

pub async fn run(settings: &Settings, log: Arc<EventLog>) -> anyhow::Result<()> {
    let (events, mut receiver) = mpsc::unbounded_channel();
    let seed = admission_client(&settings.admission)?;
    {
        let events = events.clone();
        tokio::spawn(async move {
            loop {
                if let Ok(response) = seed.clone().instances(pb::InstancesRequest {}).await {
                    let response = response.into_inner();
                    let endpoints = if response.endpoints.is_empty() {
                        response
                            .instances
                            .into_iter()
                            .map(|instance| instance.endpoint)
                            .collect()
                    } else {
                        response.endpoints
                    };
                    if events.send(Msg::Instances(endpoints)).is_err() {
                        return;
                    }
                }
                tokio::time::sleep(DISCOVER_EVERY).await;
            }
        });
    }
    let mut worker = Worker {
        worker_id: settings.worker_id.clone(),
        // Its slots shared between the two admission instances' streams.
        credits: u32::try_from(settings.slots / 2).unwrap_or(8).max(1),
        abandon: settings.abandon.clamp(0.0, 1.0),
        instant: settings.instant,
        log,
        events,
        instances: Vec::new(),
        sessions: HashMap::new(),
        tried: HashMap::new(),
        next_generation: 1,
        running: HashMap::new(),
        sent: HashMap::new(),
        next_id: 1,
        ready: false,
    };
    let mut tick = tokio::time::interval(Duration::from_millis(100));
    loop {
        tokio::select! {
            message = receiver.recv() => match message {
                Some(message) => worker.on_message(message),
                None => return Ok(()),
            },
            _ = tick.tick() => worker.on_tick(),
        }
    }
}

impl Worker {
    fn on_message(&mut self, message: Msg) {
        match message {
            Msg::Instances(endpoints) => {
                self.instances = endpoints;
                self.open_missing();
            }
            Msg::Closed { endpoint, generation } => self.on_closed(&endpoint, generation),
            Msg::Done(key) => self.on_done(key),
            Msg::Down {
                endpoint,
                generation,
                message,
            } => match message.message {
                Some(Down::Opened(opened)) => {
                    if let Some(session) = self.sessions.get_mut(&endpoint).filter(|s| s.generation == generation) {
                        session.opened = true;
                        session.grace_ms = i64::try_from(opened.stream_end_grace_ms).unwrap_or(i64::MAX);
                    }
                    self.say_ready();
                }
                Some(Down::Jobs(jobs)) => {
                    for job in jobs.jobs {
                        self.on_pushed(&endpoint, generation, job);
                    }
                    // Soon after a push: the first heartbeat confirms it.
                    self.send_heartbeats(now_ms());
                }
                Some(Down::Answer(answer)) => self.on_answer(answer),
                None => {}
            },
        }
    }

    /// Say once in the log that a stream is open to every instance listed.
    fn say_ready(&mut self) {
        if !self.ready
            && !self.instances.is_empty()
            && self.instances.iter().all(|endpoint| {
                self.sessions
                    .get(endpoint.as_str())
                    .is_some_and(|session| session.opened)
            })
        {
            self.ready = true;
            self.log.write(0, 0, Event::Ready);
        }
    }

    fn open_missing(&mut self) {
        let missing: Vec<String> = self
            .instances
            .iter()
            .filter(|endpoint| !self.sessions.contains_key(endpoint.as_str()))
            .filter(|endpoint| {
                self.tried
                    .get(endpoint.as_str())
                    .is_none_or(|at| at.elapsed() >= REOPEN_AFTER)
            })
            .cloned()
            .collect();
        for endpoint in missing {
            self.open(endpoint.into());
        }
    }

    fn open(&mut self, endpoint: Arc<str>) {
        let generation = self.next_generation;
        self.next_generation += 1;
        self.tried.insert(endpoint.clone(), Instant::now());
        let (up, up_receiver) = mpsc::channel(1024);
        let _ = up.try_send(pb::WorkRequest {
            message: Some(Up::Open(pb::WorkOpen {
                worker_id: self.worker_id.clone(),
                task_groups: vec![TASK_GROUP.to_string()],
                credits: self.credits,
            })),
        });
        self.sessions.insert(
            endpoint.clone(),
            Session {
                up,
                generation,
                opened: false,
                grace_ms: 0,
            },
        );
        let events = self.events.clone();
        tokio::spawn(async move {
            let served = async {
                let channel = sluice_common::tls::endpoint(&endpoint)?
                    .connect_timeout(Duration::from_secs(2))
                    .connect()
                    .await?;
                let mut down = pb::admission_client::AdmissionClient::new(channel)
                    .work(ReceiverStream::new(up_receiver))
                    .await?
                    .into_inner();
                while let Some(message) = down.message().await? {
                    let _ = events.send(Msg::Down {
                        endpoint: endpoint.clone(),
                        generation,
                        message,
                    });
                }
                anyhow::Ok(())
            };
            let _ = served.await;
            let _ = events.send(Msg::Closed { endpoint, generation });
        });
    }

    fn on_closed(&mut self, endpoint: &Arc<str>, generation: u64) {
        if self
            .sessions
            .get(endpoint)
            .is_some_and(|session| session.generation == generation)
        {
            self.sessions.remove(endpoint);
        }
        let now = now_ms();
        // Requests it did not answer go again, on another stream.
        let lost: Vec<u64> = self
            .sent
            .iter()
            .filter(|(_, sent)| sent.endpoint == *endpoint && sent.generation == generation)
            .map(|(id, _)| *id)
            .collect();
        for id in lost {
            if let Some(sent) = self.sent.remove(&id) {
                if let Request::Complete { key, .. } = &sent.request {
                    eprintln!(
                        "{now} completion of {} attempt {} sent at {} lost with the stream to {endpoint}; sending it again",
                        key.0, key.1, sent.at_ms
                    );
                }
                self.retry(sent.request, now);
            }
        }
        // Its attempts stay this worker's if heartbeaten at once.
        for running in self.running.values_mut() {
            if running.endpoint == *endpoint {
                running.next_beat = now;
            }
        }
    }

    fn retry(&mut self, request: Request, now: i64) {
        match request {
            Request::Heartbeat(keys) => {
                for key in keys {
                    if let Some(running) = self.running.get_mut(&key) {
                        running.next_beat = running.next_beat.min(now + RETRY_AFTER_MS);
                    }
                }
            }
            Request::Complete { key, .. } => {
                if let Some(running) = self.running.get_mut(&key) {
                    running.resend_at = Some(now + RETRY_AFTER_MS);
                }
            }
        }
    }

    fn on_pushed(&mut self, endpoint: &Arc<str>, generation: u64, pushed: pb::DispatchedJob) {
        let Some(job) = pushed.job else { return };
        let Some(index) = job_index(&job.job_id) else { return };
        let key = (job.job_id.clone(), job.attempt);
        self.log.write(index, job.attempt, Event::Got { via: "push".into() });
        if self.running.contains_key(&key) {
            // The same attempt pushed again (counted from the log): run it
            // once, and give the credit back.
            self.give_credit(endpoint, generation);
            return;
        }
        let now = now_ms();
        let lease_ms = i64::try_from(job.lease_ms).unwrap_or(i64::MAX).max(1);
        let grace_ms = self.sessions.get(endpoint).map_or(0, |session| session.grace_ms);
        let renewal_ms = if grace_ms > 0 { lease_ms.min(grace_ms) } else { lease_ms };
        self.log.write(index, job.attempt, Event::Start);
        let events = self.events.clone();
        let done = key.clone();
        let run_for = Duration::from_millis(if self.instant { 0 } else { run_ms(index) });
        let handler = tokio::spawn(async move {
            tokio::time::sleep(run_for).await;
            let _ = events.send(Msg::Done(done));
        });
        self.running.insert(
            key,
            Running {
                index,
                endpoint: endpoint.clone(),
                generation,
                renewal_ms,
                held_until: pushed.lease_expires_at_ms.min(now + renewal_ms),
                // At once: the first heartbeat confirms the push.
                next_beat: now,
                confirmed: false,
                abandon: rand::rng().random_bool(self.abandon),
                state: State::Running,
                handler: Some(handler.abort_handle()),
                resend_at: None,
                first_complete_ms: None,
            },
        );
    }

    fn on_done(&mut self, key: Key) {
        let Some(running) = self.running.get_mut(&key) else {
            return;
        };
        running.handler = None;
        if running.abandon {
            if running.confirmed {
                self.finish(&key, "abandoned");
            } else {
                running.state = State::AbandonWhenConfirmed;
            }
            return;
        }
        running.state = State::Completing;
        self.log.write(running.index, key.1, Event::End { how: "done".into() });
        running.resend_at = Some(now_ms());
        self.send_completions();
    }

    /// Forget the attempt: log how its handler ended, stop it, give its
    /// credit back.
    fn finish(&mut self, key: &Key, how: &str) {
        let Some(running) = self.running.remove(key) else {
            return;
        };
        if let Some(handler) = running.handler {
            handler.abort();
        }
        self.log.write(running.index, key.1, Event::End { how: how.into() });
        self.give_credit(&running.endpoint, running.generation);
    }

    fn give_credit(&self, endpoint: &Arc<str>, generation: u64) {
        // A stream opened again came with all its credits.
        if let Some(session) = self.sessions.get(endpoint).filter(|s| s.generation == generation) {
            let _ = session.up.try_send(pb::WorkRequest {
                message: Some(Up::Credits(pb::WorkCredits { credits: 1 })),
            });
        }
    }

    /// An open stream: `preferred`'s if it is open, else any.
    fn stream_for(&self, preferred: Option<&Arc<str>>) -> Option<(Arc<str>, u64, mpsc::Sender<pb::WorkRequest>)> {
        let own = preferred
            .and_then(|endpoint| self.sessions.get_key_value(endpoint))
            .filter(|(_, session)| session.opened);
        own.or_else(|| self.sessions.iter().find(|(_, session)| session.opened))
            .map(|(endpoint, session)| (endpoint.clone(), session.generation, session.up.clone()))
    }

    fn on_answer(&mut self, answer: pb::WorkAnswer) {
        let Some(sent) = self.sent.remove(&answer.id) else {
            return;
        };
        let now = now_ms();
        match answer.result {
            Some(pb::work_answer::Result::Heartbeats(response)) => {
                for result in response.results {
                    self.on_heartbeat(result, sent.at_ms);
                }
            }
            Some(pb::work_answer::Result::Completed(response)) => {
                let held_until = match &sent.request {
                    Request::Complete { held_until, .. } => *held_until,
                    Request::Heartbeat(_) => 0,
                };
                for result in response.results {
                    let key = (result.job_id.clone(), result.attempt);
                    let Some(index) = job_index(&result.job_id) else {
                        continue;
                    };
                    let answer = result
                        .outcome()
                        .as_str_name()
                        .trim_start_matches("COMPLETE_OUTCOME_")
                        .to_string();
                    self.log.write(
                        index,
                        result.attempt,
                        Event::Complete {
                            answer,
                            sent_ms: sent.at_ms,
                            held_until_ms: held_until,
                        },
                    );
                    if let Some(running) = self.running.remove(&key) {
                        self.give_credit(&running.endpoint, running.generation);
                    }
                }
            }
            // Failed as the unary call would (UNAVAILABLE while an owner
            // changes): send it again.
            Some(pb::work_answer::Result::Error(error)) => {
                if let Request::Complete { key, .. } = &sent.request {
                    eprintln!(
                        "{now} completion of {} attempt {} sent at {} to {} answered {:?}: {}; sending it again",
                        key.0, key.1, sent.at_ms, sent.endpoint, error.code, error.message
                    );
                }
                self.retry(sent.request, now);
            }
            None => self.retry(sent.request, now),
            Some(pb::work_answer::Result::Withdrawn(_)) => {}
        }
    }

    fn on_heartbeat(&mut self, result: pb::HeartbeatResult, sent_ms: i64) {
        let key = (result.job_id.clone(), result.attempt);
        let Some(running) = self.running.get_mut(&key) else {
            return;
        };
        match result.outcome() {
            pb::HeartbeatOutcome::Extended => {
                running.held_until = running.held_until.max(sent_ms + running.renewal_ms);
                if !running.confirmed {
                    running.confirmed = true;
                    self.log.write(running.index, key.1, Event::Confirmed);
                    if running.abandon && running.state == State::AbandonWhenConfirmed {
                        self.finish(&key, "abandoned");
                    }
                }
            }
            // A completion under way gets its own answer (a heartbeat that
            // crossed an accepted completion answers LEASE_LOST).
            pb::HeartbeatOutcome::LeaseLost if running.state == State::Completing => {}
            pb::HeartbeatOutcome::LeaseLost => {
                self.log.write(
                    running.index,
                    key.1,
                    Event::LeaseLost {
                        held_until_ms: running.held_until,
                    },
                );
                self.finish(&key, "lease_lost");
            }
            _ => {}
        }
    }

    fn on_tick(&mut self) {
        self.open_missing();
        let now = now_ms();
        // Renewals that stopped holding: the attempt may be another's now.
        let expired: Vec<Key> = self
            .running
            .iter()
            .filter(|(_, running)| running.state != State::Completing && now > running.held_until)
            .map(|(key, _)| key.clone())
            .collect();
        for key in expired {
            self.finish(&key, "lease_timeout");
        }
        // Completions that got no answer for a minute.
        let given_up: Vec<Key> = self
            .running
            .iter()
            .filter(|(_, running)| {
                running
                    .first_complete_ms
                    .is_some_and(|first| now - first > COMPLETE_FOR_MS)
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in given_up {
            if let Some(running) = self.running.remove(&key) {
                self.log.write(
                    running.index,
                    key.1,
                    Event::Complete {
                        answer: "GAVE_UP".into(),
                        sent_ms: now,
                        held_until_ms: running.held_until,
                    },
                );
                self.give_credit(&running.endpoint, running.generation);
            }
        }
        self.send_completions();
        self.send_heartbeats(now);
    }

    fn send_completions(&mut self) {
        let now = now_ms();
        let due: Vec<Key> = self
            .running
            .iter()
            .filter(|(_, running)| running.state == State::Completing && running.resend_at.is_some_and(|at| at <= now))
            .map(|(key, _)| key.clone())
            .collect();
        for key in due {
            let Some(running) = self.running.get(&key) else {
                continue;
            };
            let Some((endpoint, generation, up)) = self.stream_for(Some(&running.endpoint)) else {
                continue;
            };
            let held_until = running.held_until;
            let id = self.next_id;
            self.next_id += 1;
            let request = pb::WorkRequest {
                message: Some(Up::Complete(pb::WorkComplete {
                    id,
                    completions: vec![pb::Completion {
                        job_id: key.0.clone(),
                        attempt: key.1,
                        outcome: Some(pb::completion::Outcome::Success(pb::Success {})),
                    }],
                })),
            };
            if up.try_send(request).is_err() {
                continue;
            }
            if let Some(running) = self.running.get_mut(&key) {
                running.resend_at = None;
                running.first_complete_ms.get_or_insert(now);
            }
            self.sent.insert(
                id,
                Sent {
                    request: Request::Complete { key, held_until },
                    endpoint,
                    generation,
                    at_ms: now,
                },
            );
        }
    }

    fn send_heartbeats(&mut self, now: i64) {
        let due: Vec<Key> = self
            .running
            .iter()
            .filter(|(_, running)| !(running.abandon && running.confirmed) && running.next_beat <= now)
            .map(|(key, _)| key.clone())
            .collect();
        if due.is_empty() {
            return;
        }
        let Some((endpoint, generation, up)) = self.stream_for(None) else {
            return;
        };
        let id = self.next_id;
        self.next_id += 1;
        let request = pb::WorkRequest {
            message: Some(Up::Heartbeat(pb::WorkHeartbeat {
                id,
                jobs: due
                    .iter()
                    .map(|(job_id, attempt)| pb::JobAttempt {
                        job_id: job_id.clone(),
                        attempt: *attempt,
                    })
                    .collect(),
            })),
        };
        if up.try_send(request).is_err() {
            return;
        }
        for key in &due {
            if let Some(running) = self.running.get_mut(key) {
                running.next_beat = now + (running.renewal_ms / 3).max(1);
            }
        }
        self.sent.insert(
            id,
            Sent {
                request: Request::Heartbeat(due),
                endpoint,
                generation,
                at_ms: now,
            },
        );
    }
}
