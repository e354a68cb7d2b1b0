//! The worker on `Work` streams (docs/worker-protocol.md, "The Work
//! stream"): no Kafka consumer, no `Claim`. The worker opens a stream to
//! every admission instance (`Admission.Instances` on the configured
//! endpoint, asked again every few seconds) and gives the streams credits
//! for its free slots; admission pushes jobs already claimed for this
//! worker. Completions go back on the stream a job came from (another one
//! when that stream is gone: admission routes them to the job's owner);
//! heartbeats of every running attempt go on any open stream.
//!
//! Credits follow the work: a freed slot goes back to the stream its job
//! came from, and the credits of a stream that breaks go to the others.
//! A handler whose lease could not be renewed within the lease is stopped
//! (`StopReason::LeaseLost`): by then admission may run another attempt.
//! When a stream ends, admission shortens the leases of the attempts it
//! pushed to the stream's end grace (`WorkOpened.stream_end_grace_ms`)
//! unless it hears from the worker; so those attempts are heartbeaten every
//! third of the grace, at once when their stream ends, and a renewal counts
//! for the grace at most.
//!
//! Shutdown: no more credits; running handlers have `shutdown_grace`, then
//! are stopped and their attempts handed back; completions are flushed.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;

use crate::propagation::TraceContext;
use crate::worker::handler::{JobHandler, StopReason, StopSignal};
use crate::worker::runner::{count_outcome, handle_attempt, AttemptOutcome, HandlerRun};
use crate::worker::status::{Counters, StatusShared};

/// How often the instance list is asked again, and dead streams reopened.
const DISCOVER_EVERY: Duration = Duration::from_secs(3);
/// A failed request (an owner changing, say) is sent again after this.
const RESEND_AFTER: Duration = Duration::from_millis(200);
/// Attempts per heartbeat or completion message, at most.
const MAX_PER_MESSAGE: usize = 500;
/// How often due heartbeats are looked for (no `heartbeat_interval` set).
const HEARTBEAT_TICK: Duration = Duration::from_millis(250);
/// A stream holding more than its share of credits gives the rest back
/// once it pushed nothing for this long while another stream has none.
const IDLE_BEFORE_WITHDRAW: Duration = Duration::from_millis(250);
/// Messages buffered up one stream.
const UP_BUFFER: usize = 1024;

/// What the stream worker is configured with.
pub(crate) struct StreamSettings {
    pub worker_id: String,
    pub task_groups: Vec<String>,
    pub concurrency: usize,
    pub seed_endpoint: String,
    /// For `https://` instances.
    pub dial: crate::grpc::Dial,
    pub request_timeout: Duration,
    pub handler: Arc<dyn JobHandler>,
    pub heartbeat_interval: Option<Duration>,
    pub stop_grace: Duration,
    pub shutdown_grace: Duration,
    pub status: Arc<StatusShared>,
}

/// What the stream, handler and timer tasks tell the worker's loop.
enum Event {
    Down {
        endpoint: Arc<str>,
        message: pb::WorkResponse,
    },
    Closed {
        endpoint: Arc<str>,
        generation: u64,
    },
    Finished {
        key: (String, u32),
        outcome: AttemptOutcome,
    },
    Resend {
        id: u64,
    },
    Instances(Vec<String>),
}

struct Session {
    up: mpsc::Sender<pb::WorkRequest>,
    generation: u64,
    /// Admission registered the session (its `opened` came).
    confirmed: bool,
    /// Credits given and not yet used by a push.
    credits: usize,
    /// How long admission keeps the leases of the attempts pushed on this
    /// stream once it ends (its `opened` says; none from older instances).
    end_grace: Option<Duration>,
    /// The instance takes back unused credits (its `opened` says).
    withdraws: bool,
    /// A withdraw was sent and not answered yet.
    withdrawing: bool,
    /// The last push on this stream (or its opening).
    last_push: Instant,
}

struct Running {
    stop: StopSignal,
    endpoint: Arc<str>,
    lease_ms: u64,
    /// Stopped as lease-lost when no heartbeat extended it by then.
    lease_until: Instant,
    /// The next heartbeat of this attempt is due then. The first is due at
    /// once: it confirms a pushed attempt to admission (an attempt whose
    /// lease ends unconfirmed is taken for lost on its way and handed back).
    heartbeat_at: Instant,
    /// The end grace of the stream it came on (its `opened` said): when
    /// that stream ends, admission may shorten the lease to this from then.
    /// So the attempt is heartbeaten every third of it, and a renewal
    /// counts for this long at most from when it was sent.
    end_grace: Option<Duration>,
}

impl Running {
    /// How long one renewal holds, from when its heartbeat was sent.
    fn renewal(&self) -> Duration {
        let lease = Duration::from_millis(self.lease_ms);
        self.end_grace.map_or(lease, |grace| lease.min(grace))
    }
}

/// A request waiting for its answer, to send again if it fails.
enum Pending {
    /// Completions, preferably sent on the stream of `endpoint` (where
    /// their jobs came from: their owner).
    Complete {
        endpoint: Option<Arc<str>>,
        completions: Vec<pb::Completion>,
    },
    Heartbeat(Vec<pb::JobAttempt>),
}

/// A request sent and not answered yet, and the stream it went on.
struct Sent {
    request: Pending,
    endpoint: Arc<str>,
    generation: u64,
    at: Instant,
}

struct StreamWorker {
    settings: StreamSettings,
    events: mpsc::Sender<Event>,
    sessions: BTreeMap<Arc<str>, Session>,
    next_generation: u64,
    running: HashMap<(String, u32), Running>,
    pending: HashMap<u64, Sent>,
    /// Requests whose stream was gone when they were to be sent.
    unsent: VecDeque<Pending>,
    /// Withdraws sent and not answered, by id: their stream.
    withdrawing: HashMap<u64, Arc<str>>,
    next_id: u64,
    draining: bool,
    force_stop: CancellationToken,
}

pub(crate) async fn run(settings: StreamSettings, shutdown: CancellationToken) {
    let (events, mut receiver) = mpsc::channel(4 * settings.concurrency + 256);
    let mut worker = StreamWorker {
        settings,
        events,
        sessions: BTreeMap::new(),
        next_generation: 1,
        running: HashMap::new(),
        pending: HashMap::new(),
        unsent: VecDeque::new(),
        withdrawing: HashMap::new(),
        next_id: 1,
        draining: false,
        force_stop: CancellationToken::new(),
    };
    worker.discover();
    let mut discover = tokio::time::interval(DISCOVER_EVERY);
    discover.tick().await;
    let mut heartbeat = tokio::time::interval(worker.heartbeat_every());
    heartbeat.tick().await;
    let mut grace_ends: Option<Instant> = None;
    loop {
        if worker.draining && worker.running.is_empty() && worker.pending.is_empty() && worker.unsent.is_empty() {
            break;
        }
        let grace = grace_ends.filter(|_| !worker.force_stop.is_cancelled());
        tokio::select! {
            _ = shutdown.cancelled(), if !worker.draining => {
                worker.draining = true;
                grace_ends = Some(Instant::now() + worker.settings.shutdown_grace);
                tracing::info!(running = worker.running.len(), "worker draining");
            }
            _ = async { if let Some(at) = grace { tokio::time::sleep_until(at).await } }, if grace.is_some() => {
                tracing::info!(running = worker.running.len(), "shutdown grace over: stopping handlers");
                worker.force_stop.cancel();
                for running in worker.running.values() {
                    running.stop.stop(StopReason::Shutdown);
                }
                // Give up on answers still missing well after the grace.
                grace_ends = None;
                let events = worker.events.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_secs(15)).await;
                    let _ = events.send(Event::Resend { id: u64::MAX }).await;
                });
            }
            _ = discover.tick() => worker.discover(),
            _ = heartbeat.tick() => {
                worker.rebalance_credits();
                worker.heartbeat();
            }
            event = receiver.recv() => {
                let Some(event) = event else { break };
                worker.handle(event);
                // Take what else is ready, so completions and credits of
                // jobs that end together travel in one message each.
                let mut batch = 0;
                while batch < MAX_PER_MESSAGE {
                    match receiver.try_recv() {
                        Ok(event) => worker.handle(event),
                        Err(_) => break,
                    }
                    batch += 1;
                }
                worker.flush();
            }
        }
    }
    worker.sessions.clear();
    tracing::info!(worker_id = %worker.settings.worker_id, "worker stopped");
}

impl StreamWorker {
    /// How often due heartbeats are sent: the configured interval, else
    /// every 250 ms (each attempt is heartbeaten every third of its lease,
    /// and first at the tick after it started).
    fn heartbeat_every(&self) -> Duration {
        self.settings
            .heartbeat_interval
            .unwrap_or(HEARTBEAT_TICK)
            .max(Duration::from_millis(50))
    }

    /// Ask for the instances, then open streams to new ones and reopen
    /// broken ones (the answer comes back as an event).
    fn discover(&self) {
        let seed = self.settings.seed_endpoint.clone();
        let timeout = self.settings.request_timeout;
        let dial = self.settings.dial.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            let endpoints = match instances(&seed, &dial, timeout).await {
                Ok(endpoints) if !endpoints.is_empty() => endpoints,
                Ok(_) => vec![seed],
                Err(status) => {
                    tracing::debug!(%seed, %status, "asking admission for its instances failed; using the seed");
                    vec![seed]
                }
            };
            let _ = events.send(Event::Instances(endpoints)).await;
        });
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Instances(endpoints) => {
                if self.draining {
                    return;
                }
                for endpoint in endpoints {
                    if !self.sessions.contains_key(endpoint.as_str()) {
                        self.open(Arc::from(endpoint.as_str()));
                    }
                }
            }
            Event::Down { endpoint, message } => self.down(&endpoint, message),
            Event::Closed { endpoint, generation } => {
                let current = self
                    .sessions
                    .get(&endpoint)
                    .is_some_and(|session| session.generation == generation);
                if current {
                    self.sessions.remove(&endpoint);
                    self.stream_ended(&endpoint);
                    tracing::debug!(%endpoint, "work stream closed");
                    // Its credits go to the other streams in `flush`; what
                    // it did not answer goes on another stream.
                    let lost: Vec<u64> = self
                        .pending
                        .iter()
                        .filter(|(_, sent)| sent.endpoint == endpoint && sent.generation == generation)
                        .map(|(id, _)| *id)
                        .collect();
                    for id in lost {
                        if let Some(sent) = self.pending.remove(&id) {
                            self.unsent.push_back(sent.request);
                        }
                    }
                }
            }
            Event::Finished { key, outcome } => self.finished(key, outcome),
            Event::Resend { id } => {
                if id == u64::MAX {
                    // The drain's last wait is over.
                    self.pending.clear();
                    self.unsent.clear();
                    return;
                }
                if let Some(sent) = self.pending.remove(&id) {
                    self.unsent.push_back(sent.request);
                }
            }
        }
    }

    /// The stream to `endpoint` ended: admission shortens the leases of the
    /// attempts it pushed to the stream's end grace unless it hears from
    /// this worker, so they are heartbeaten at once (on another stream).
    fn stream_ended(&mut self, endpoint: &Arc<str>) {
        let now = Instant::now();
        for running in self.running.values_mut() {
            if running.endpoint == *endpoint {
                running.heartbeat_at = now;
            }
        }
    }

    /// Open a stream to `endpoint` with no credits (`flush` gives them).
    fn open(&mut self, endpoint: Arc<str>) {
        let generation = self.next_generation;
        self.next_generation += 1;
        let (up, up_receiver) = mpsc::channel(UP_BUFFER);
        let open = pb::WorkRequest {
            message: Some(pb::work_request::Message::Open(pb::WorkOpen {
                worker_id: self.settings.worker_id.clone(),
                task_groups: self.settings.task_groups.clone(),
                credits: 0,
            })),
        };
        if up.try_send(open).is_err() {
            return;
        }
        self.sessions.insert(
            endpoint.clone(),
            Session {
                up,
                generation,
                confirmed: false,
                credits: 0,
                end_grace: None,
                withdraws: false,
                withdrawing: false,
                last_push: Instant::now(),
            },
        );
        let events = self.events.clone();
        let timeout = self.settings.request_timeout;
        let dial = self.settings.dial.clone();
        tokio::spawn(async move {
            match connect(&endpoint, &dial, timeout).await {
                Ok(client) => read_stream(client, endpoint.clone(), up_receiver, &events).await,
                Err(error) => tracing::debug!(%endpoint, %error, "work stream could not connect"),
            }
            let _ = events.send(Event::Closed { endpoint, generation }).await;
        });
    }

    fn down(&mut self, endpoint: &Arc<str>, message: pb::WorkResponse) {
        match message.message {
            Some(pb::work_response::Message::Jobs(jobs)) => {
                for dispatched in jobs.jobs {
                    self.start(endpoint, dispatched);
                }
            }
            Some(pb::work_response::Message::Answer(answer)) => self.answered(answer),
            Some(pb::work_response::Message::Opened(opened)) => {
                if let Some(session) = self.sessions.get_mut(endpoint) {
                    session.confirmed = true;
                    session.end_grace =
                        (opened.stream_end_grace_ms > 0).then(|| Duration::from_millis(opened.stream_end_grace_ms));
                    session.withdraws = opened.withdraws;
                }
            }
            None => {}
        }
    }

    /// Run a pushed job: it is claimed for this worker already.
    fn start(&mut self, endpoint: &Arc<str>, dispatched: pb::DispatchedJob) {
        if let Some(session) = self.sessions.get_mut(endpoint) {
            session.credits = session.credits.saturating_sub(1);
            session.last_push = Instant::now();
        }
        let Some(admitted) = dispatched.job else {
            return;
        };
        let counters = &self.settings.status.counters;
        Counters::add(&counters.delivered);
        Counters::add(&counters.claimed);
        let key = (admitted.job_id.clone(), admitted.attempt);
        if self.running.contains_key(&key) {
            // Pushed twice (a stream re-opened mid-push): it runs once.
            return;
        }
        let stop = StopSignal::default();
        let lease_ms = admitted.lease_ms.max(1000);
        let end_grace = self.sessions.get(endpoint).and_then(|session| session.end_grace);
        let mut running = Running {
            stop: stop.clone(),
            endpoint: endpoint.clone(),
            lease_ms,
            lease_until: Instant::now(),
            heartbeat_at: Instant::now(),
            end_grace,
        };
        running.lease_until += running.renewal();
        self.running.insert(key.clone(), running);
        let trace = dispatched
            .trace
            .map(|trace| TraceContext {
                traceparent: trace.traceparent,
                tracestate: trace.tracestate,
            })
            .unwrap_or_default();
        let handler = self.settings.handler.clone();
        let events = self.events.clone();
        let force_stop = self.force_stop.clone();
        let stop_grace = self.settings.stop_grace;
        let worker_id = self.settings.worker_id.clone();
        let status = self.settings.status.clone();
        tokio::spawn(async move {
            let admitted = Arc::new(admitted);
            let task_type: Arc<str> = Arc::from(admitted.task_group.as_str());
            let run = HandlerRun {
                handler: &handler,
                worker_id: &worker_id,
                force_stop: &force_stop,
                stop_grace,
            };
            let (span, outcome) = handle_attempt(run, admitted, task_type, &trace, stop).await;
            count_outcome(&status.counters, &outcome, &span);
            let _ = events.send(Event::Finished { key, outcome }).await;
        });
    }

    fn finished(&mut self, key: (String, u32), outcome: AttemptOutcome) {
        let Some(running) = self.running.remove(&key) else {
            return;
        };
        // The slot is free: its credit goes back to the stream the job came
        // from (in `flush`).
        if !self.draining {
            if let Some(session) = self.sessions.get_mut(&running.endpoint) {
                session.credits += 1;
                self.send_credits(&running.endpoint, 1);
            }
        }
        if let Some(reported) = outcome.completion() {
            let completion = pb::Completion {
                job_id: key.0,
                attempt: key.1,
                outcome: Some(reported),
            };
            self.unsent.push_back(Pending::Complete {
                endpoint: Some(running.endpoint),
                completions: vec![completion],
            });
        }
    }

    fn answered(&mut self, answer: pb::WorkAnswer) {
        if let Some(pb::work_answer::Result::Withdrawn(withdrawn)) = &answer.result {
            if let Some(endpoint) = self.withdrawing.remove(&answer.id) {
                if let Some(session) = self.sessions.get_mut(&endpoint) {
                    session.withdrawing = false;
                    session.credits = session.credits.saturating_sub(withdrawn.credits as usize);
                }
            }
            return;
        }
        let Some(sent) = self.pending.remove(&answer.id) else {
            return;
        };
        match answer.result {
            Some(pb::work_answer::Result::Completed(_) | pb::work_answer::Result::Withdrawn(_)) => {}
            Some(pb::work_answer::Result::Heartbeats(response)) => {
                for result in response.results {
                    let key = (result.job_id, result.attempt);
                    let Some(running) = self.running.get_mut(&key) else {
                        continue;
                    };
                    match pb::HeartbeatOutcome::try_from(result.outcome) {
                        Ok(pb::HeartbeatOutcome::Extended) => {
                            // From when it was sent: admission renewed it
                            // no earlier.
                            running.lease_until = running.lease_until.max(sent.at + running.renewal());
                        }
                        Ok(pb::HeartbeatOutcome::Cancelled) => running.stop.stop(StopReason::Cancelled),
                        _ => running.stop.stop(StopReason::LeaseLost),
                    }
                }
            }
            Some(pb::work_answer::Result::Error(error)) => {
                let code = tonic::Code::from(error.code);
                if code == tonic::Code::InvalidArgument {
                    // Sending it again cannot help (the SDK built it).
                    tracing::error!(message = %error.message, "admission refused a work request");
                    return;
                }
                tracing::debug!(?code, message = %error.message, "work request failed; sending it again");
                let id = self.next_id;
                self.next_id += 1;
                self.pending.insert(id, sent);
                let events = self.events.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(RESEND_AFTER).await;
                    let _ = events.send(Event::Resend { id }).await;
                });
            }
            None => {}
        }
    }

    /// Heartbeat the attempts that are due, on any open stream; stop
    /// handlers whose lease went by without a renewal.
    fn heartbeat(&mut self) {
        let now = Instant::now();
        let fixed = self.settings.heartbeat_interval;
        let mut attempts: Vec<pb::JobAttempt> = Vec::new();
        for ((job_id, attempt), running) in &mut self.running {
            if running.lease_until <= now {
                running.stop.stop(StopReason::LeaseLost);
            }
            if running.stop.reason().is_some() || (fixed.is_none() && running.heartbeat_at > now) {
                continue;
            }
            running.heartbeat_at = now + running.renewal() / 3;
            attempts.push(pb::JobAttempt {
                job_id: job_id.clone(),
                attempt: *attempt,
            });
        }
        for chunk in attempts.chunks(MAX_PER_MESSAGE) {
            self.unsent.push_back(Pending::Heartbeat(chunk.to_vec()));
        }
        self.flush();
    }

    /// Send what waits to be sent, on the open streams; spread the free
    /// slots' credits over the streams that have none.
    fn flush(&mut self) {
        self.publish_gauges();
        self.spread_credits();
        let mut completions: BTreeMap<Option<Arc<str>>, Vec<pb::Completion>> = BTreeMap::new();
        let mut heartbeats: Vec<Vec<pb::JobAttempt>> = Vec::new();
        for pending in std::mem::take(&mut self.unsent) {
            match pending {
                Pending::Complete {
                    endpoint,
                    completions: mut batch,
                } => completions.entry(endpoint).or_default().append(&mut batch),
                Pending::Heartbeat(attempts) => heartbeats.push(attempts),
            }
        }
        for (endpoint, batch) in completions {
            for chunk in batch.chunks(MAX_PER_MESSAGE) {
                self.send(Pending::Complete {
                    endpoint: endpoint.clone(),
                    completions: chunk.to_vec(),
                });
            }
        }
        for attempts in heartbeats {
            self.send(Pending::Heartbeat(attempts));
        }
    }

    fn publish_gauges(&self) {
        let mut gauges = self
            .settings
            .status
            .gauges
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        gauges.running = self.running.len();
        gauges.streams = self.sessions.values().filter(|session| session.confirmed).count();
    }

    /// Send one request on an open stream (the preferred one when open),
    /// keeping it until answered.
    fn send(&mut self, request: Pending) {
        let preferred = match &request {
            Pending::Complete { endpoint, .. } => endpoint.clone(),
            Pending::Heartbeat(_) => None,
        };
        let id = self.next_id;
        self.next_id += 1;
        let message = match &request {
            Pending::Complete { completions, .. } => pb::work_request::Message::Complete(pb::WorkComplete {
                id,
                completions: completions.clone(),
            }),
            Pending::Heartbeat(jobs) => {
                pb::work_request::Message::Heartbeat(pb::WorkHeartbeat { id, jobs: jobs.clone() })
            }
        };
        let message = pb::WorkRequest { message: Some(message) };
        let targets: Vec<Arc<str>> = preferred.into_iter().chain(self.sessions.keys().cloned()).collect();
        for endpoint in targets {
            let Some(session) = self.sessions.get(&endpoint) else {
                continue;
            };
            if session.up.try_send(message.clone()).is_ok() {
                let generation = session.generation;
                self.pending.insert(
                    id,
                    Sent {
                        request,
                        endpoint,
                        generation,
                        at: Instant::now(),
                    },
                );
                return;
            }
        }
        // No open stream: it waits for one.
        self.unsent.push_back(request);
    }

    fn send_credits(&mut self, endpoint: &Arc<str>, credits: u32) {
        let Some(session) = self.sessions.get(endpoint) else {
            return;
        };
        let request = pb::WorkRequest {
            message: Some(pb::work_request::Message::Credits(pb::WorkCredits { credits })),
        };
        if session.up.try_send(request).is_err() {
            // The stream is going away; its credits are spread again.
            if let Some(session) = self.sessions.get_mut(endpoint) {
                session.credits = session.credits.saturating_sub(credits as usize);
            }
        }
    }

    /// Credits follow the work, so the streams of instances that had jobs
    /// hold them; when the jobs move (a job partition changes owner), the
    /// instance that has them now may have none. So when a stream has no
    /// credit, a stream that has more than its share and pushed nothing for
    /// `IDLE_BEFORE_WITHDRAW` gives back what is over its share (taken back
    /// with `withdraw`; `spread_credits` then gives it to the streams with
    /// the fewest).
    fn rebalance_credits(&mut self) {
        if self.draining {
            return;
        }
        let confirmed = self.sessions.values().filter(|session| session.confirmed).count();
        let starving = self
            .sessions
            .values()
            .any(|session| session.confirmed && session.credits == 0);
        if confirmed < 2 || !starving {
            return;
        }
        let free = self.settings.concurrency.saturating_sub(self.running.len());
        let share = (free / confirmed).max(1);
        let now = Instant::now();
        let over: Vec<(Arc<str>, usize)> = self
            .sessions
            .iter()
            .filter(|(_, session)| {
                session.confirmed
                    && session.withdraws
                    && !session.withdrawing
                    && session.credits > share
                    && now.duration_since(session.last_push) >= IDLE_BEFORE_WITHDRAW
            })
            .map(|(endpoint, session)| (endpoint.clone(), session.credits - share))
            .collect();
        for (endpoint, credits) in over {
            let id = self.next_id;
            self.next_id += 1;
            let Some(session) = self.sessions.get_mut(&endpoint) else {
                continue;
            };
            let request = pb::WorkRequest {
                message: Some(pb::work_request::Message::Withdraw(pb::WorkWithdraw {
                    id,
                    credits: u32::try_from(credits).unwrap_or(u32::MAX),
                })),
            };
            if session.up.try_send(request).is_ok() {
                session.withdrawing = true;
                self.withdrawing.insert(id, endpoint);
            }
        }
    }

    /// Free slots not held as credits by any stream go to the streams with
    /// the fewest, one at a time, so every instance can push.
    fn spread_credits(&mut self) {
        if self.draining || self.sessions.is_empty() {
            return;
        }
        let given: usize = self.sessions.values().map(|session| session.credits).sum();
        let used = self.running.len() + given;
        let mut free = self.settings.concurrency.saturating_sub(used);
        let mut added: BTreeMap<Arc<str>, u32> = BTreeMap::new();
        while free > 0 {
            let Some((endpoint, session)) = self.sessions.iter_mut().min_by_key(|(_, session)| session.credits) else {
                break;
            };
            session.credits += 1;
            *added.entry(endpoint.clone()).or_default() += 1;
            free -= 1;
        }
        for (endpoint, credits) in added {
            self.send_credits(&endpoint, credits);
        }
    }
}

async fn connect(
    endpoint: &str,
    dial: &crate::grpc::Dial,
    timeout: Duration,
) -> Result<AdmissionClient<crate::grpc::Channel>, String> {
    let channel = crate::grpc::endpoint(endpoint, &dial.tls)
        .map_err(|error| error.to_string())?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(timeout)
        .connect()
        .await
        .map_err(|error| error.to_string())?;
    Ok(AdmissionClient::new(crate::grpc::Channel::new(
        channel,
        dial.bearer.clone(),
    )))
}

async fn instances(seed: &str, dial: &crate::grpc::Dial, timeout: Duration) -> Result<Vec<String>, tonic::Status> {
    let mut client = connect(seed, dial, timeout).await.map_err(tonic::Status::unavailable)?;
    let mut request = tonic::Request::new(pb::InstancesRequest {});
    request.set_timeout(timeout);
    Ok(client.instances(request).await?.into_inner().endpoints)
}

/// Carry one stream: requests up from `up`, everything down to `events`.
async fn read_stream(
    mut client: AdmissionClient<crate::grpc::Channel>,
    endpoint: Arc<str>,
    up: mpsc::Receiver<pb::WorkRequest>,
    events: &mpsc::Sender<Event>,
) {
    let mut down = match client.work(ReceiverStream::new(up)).await {
        Ok(response) => response.into_inner(),
        Err(status) => {
            tracing::debug!(%endpoint, %status, "work stream refused");
            return;
        }
    };
    loop {
        match down.message().await {
            Ok(Some(message)) => {
                if events
                    .send(Event::Down {
                        endpoint: endpoint.clone(),
                        message,
                    })
                    .await
                    .is_err()
                {
                    return;
                }
            }
            Ok(None) => return,
            Err(status) => {
                tracing::debug!(%endpoint, %status, "work stream broke");
                return;
            }
        }
    }
}
