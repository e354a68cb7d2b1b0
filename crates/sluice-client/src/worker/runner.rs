//! The worker's tasks around one job: claim, run the handler under its
//! span, heartbeat, complete, forward, hand back. They report to the
//! dispatcher through one bounded channel of [`Event`]s.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt as _;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use sluice_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot, Notify};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::grpc::Admission;
use crate::propagation::{request_with, TraceContext};
use crate::worker::handler::{Job, JobError, JobHandler, StopReason, StopSignal};
use crate::worker::kafka::{PartitionCounts, Received};
use crate::worker::offsets::PartitionId;
use crate::worker::reported_text::reported_text;
use crate::worker::status::{Counters, StatusShared};
use crate::worker::HANDOFF_HOPS_HEADER;

/// Attempts per Claim/Heartbeat/Complete call, at most.
const MAX_BATCH: usize = 500;
/// Retries of failed calls back off from this, doubling...
const FIRST_RETRY: Duration = Duration::from_millis(100);
/// ...up to this.
const MAX_RETRY: Duration = Duration::from_secs(5);

/// A received admitted job, waiting for a slot or on its way.
#[derive(Debug)]
pub(crate) struct Delivery {
    pub admitted: Arc<pb::AdmittedJob>,
    pub task_type: Arc<str>,
    pub trace: TraceContext,
    /// Times this message was forwarded between workers.
    pub hops: u32,
    /// Handed off when still waiting at this instant.
    pub handoff_at: Instant,
    pub received: Received,
}

impl Delivery {
    fn attempt(&self) -> pb::JobAttempt {
        pb::JobAttempt {
            job_id: self.admitted.job_id.clone(),
            attempt: self.admitted.attempt,
        }
    }
}

/// What the tasks tell the dispatcher.
#[derive(Debug)]
pub(crate) enum Event {
    /// The message's fate is durable: its offset may be committed.
    Done { partition: PartitionId, offset: i64 },
    /// The worker gave up on the message: never commit past it.
    Abandoned { partition: PartitionId, offset: i64 },
    /// A local slot of this task type is free again.
    SlotFree { task_type: Arc<str> },
}

/// One running attempt, as heartbeats see it.
#[derive(Debug)]
pub(crate) struct RunningEntry {
    stop: StopSignal,
    lease_ms: u64,
    trace: TraceContext,
    /// The lease by this worker's own count: from when the claim, or the
    /// last heartbeat answered `EXTENDED`, was sent. When it passes the
    /// handler is stopped as lease-lost (docs/worker-protocol.md §3): a new
    /// owner of the job's partition keeps the attempt no longer than the
    /// lease admission told, and may run the next one after it.
    held_until: Instant,
}

/// When a lease of `lease_ms` counted from `from` ends; an unknown lease
/// (0) does not end by this worker's count.
fn lease_end(from: Instant, lease_ms: u64) -> Instant {
    let lease = if lease_ms == 0 {
        Duration::from_secs(100 * 365 * 24 * 3600)
    } else {
        Duration::from_millis(lease_ms)
    };
    from.checked_add(lease).unwrap_or(from)
}

/// The attempts this worker holds (running, or reporting their end).
#[derive(Debug, Default)]
pub(crate) struct Registry {
    entries: Mutex<HashMap<(String, u32), RunningEntry>>,
    added: Notify,
}

impl Registry {
    /// Register an attempt; false when it is already here (a duplicate
    /// delivery whose claim this worker already won).
    fn insert(&self, key: (String, u32), entry: RunningEntry) -> bool {
        let inserted = {
            let mut entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            match entries.entry(key) {
                std::collections::hash_map::Entry::Occupied(_) => false,
                std::collections::hash_map::Entry::Vacant(vacant) => {
                    vacant.insert(entry);
                    true
                }
            }
        };
        if inserted {
            self.added.notify_one();
        }
        inserted
    }

    pub(crate) fn contains(&self, key: &(String, u32)) -> bool {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .contains_key(key)
    }

    fn remove(&self, key: &(String, u32)) {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .remove(key);
    }

    fn stop(&self, key: &(String, u32), reason: StopReason) {
        if let Some(entry) = self
            .entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get(key)
        {
            entry.stop.stop(reason);
        }
    }

    /// A heartbeat sent at `sent` renewed the attempt: it holds for its
    /// lease from then.
    fn renewed(&self, key: &(String, u32), sent: Instant) {
        if let Some(entry) = self
            .entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .get_mut(key)
        {
            entry.held_until = entry.held_until.max(lease_end(sent, entry.lease_ms));
        }
    }

    /// Stop, as lease-lost, every attempt whose lease went by without a
    /// renewal by `now`; when the next one ends otherwise.
    fn stop_unrenewed(&self, now: Instant) -> Option<Instant> {
        let entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let mut next = None;
        for ((job_id, attempt), entry) in entries.iter() {
            if entry.held_until <= now {
                if entry.stop.reason().is_none() {
                    tracing::warn!(%job_id, attempt, "no heartbeat was answered within the lease; stopping the handler");
                }
                entry.stop.stop(StopReason::LeaseLost);
            } else {
                next = Some(next.map_or(entry.held_until, |next: Instant| next.min(entry.held_until)));
            }
        }
        next
    }

    /// Every held attempt, the shortest lease, and a trace context to send.
    fn snapshot(&self) -> (Vec<pb::JobAttempt>, Option<u64>, TraceContext) {
        let entries = self.entries.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let attempts = entries
            .keys()
            .map(|(job_id, attempt)| pb::JobAttempt {
                job_id: job_id.clone(),
                attempt: *attempt,
            })
            .collect();
        let shortest = entries
            .values()
            .map(|entry| entry.lease_ms)
            .filter(|lease| *lease > 0)
            .min();
        let trace = entries
            .values()
            .next()
            .map(|entry| entry.trace.clone())
            .unwrap_or_default();
        (attempts, shortest, trace)
    }
}

/// A completion on its way to admission, with whom to tell the answer.
pub(crate) struct CompletionItem {
    completion: pb::Completion,
    trace: TraceContext,
    answered: oneshot::Sender<Option<pb::CompleteResult>>,
}

/// What every worker task shares.
pub(crate) struct Shared {
    pub worker_id: String,
    pub admission: Admission,
    pub handler: Arc<dyn JobHandler>,
    pub registry: Registry,
    pub completions: mpsc::Sender<CompletionItem>,
    pub events: mpsc::Sender<Event>,
    pub stop_grace: Duration,
    /// Cancelled when the shutdown grace is over: running handlers stop.
    pub force_stop: CancellationToken,
    /// Cancelled when RPCs that keep failing must be given up (late in a
    /// shutdown).
    pub give_up: CancellationToken,
    pub status: Arc<StatusShared>,
    pub forwarder: FutureProducer,
    pub assigned: Arc<Mutex<BTreeSet<(String, i32)>>>,
    pub partition_counts: PartitionCounts,
    pub forward_turn: AtomicUsize,
}

impl Shared {
    async fn event(&self, event: Event) {
        // The dispatcher outlives every task that reports to it.
        let _ = self.events.send(event).await;
    }

    async fn done(&self, delivery: &Delivery) {
        self.event(Event::Done {
            partition: delivery.received.partition.clone(),
            offset: delivery.received.offset,
        })
        .await;
    }

    /// A partition of `topic` another member of the group owns, taken in
    /// turn; none when this worker owns them all (or the count is unknown).
    pub fn forward_target(&self, topic: &str) -> Option<i32> {
        let count = self.partition_counts.get(topic)?;
        let others: Vec<i32> = {
            let assigned = self.assigned.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            (0..count)
                .filter(|partition| !assigned.contains(&(topic.to_string(), *partition)))
                .collect()
        };
        if others.is_empty() {
            return None;
        }
        let turn = self.forward_turn.fetch_add(1, Ordering::Relaxed) % others.len();
        others.get(turn).copied()
    }

    /// Report one attempt's end; waits for admission's answer (none when the
    /// call was given up).
    async fn complete(&self, completion: pb::Completion, trace: TraceContext) -> Option<pb::CompleteResult> {
        let (answered, answer) = oneshot::channel();
        let item = CompletionItem {
            completion,
            trace,
            answered,
        };
        if self.completions.send(item).await.is_err() {
            return None;
        }
        answer.await.ok().flatten()
    }
}

fn retryable(code: tonic::Code) -> bool {
    !matches!(
        code,
        tonic::Code::InvalidArgument
            | tonic::Code::NotFound
            | tonic::Code::PermissionDenied
            | tonic::Code::Unauthenticated
            | tonic::Code::Unimplemented
            | tonic::Code::FailedPrecondition
            | tonic::Code::OutOfRange
    )
}

/// Sleep before the next try; false when the worker gave up meanwhile.
async fn back_off(shared: &Shared, delay: &mut Duration) -> bool {
    let wait = *delay;
    *delay = (*delay * 2).min(MAX_RETRY);
    tokio::select! {
        _ = shared.give_up.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}

/// Claim the deliveries' attempts in one call (retrying while admission
/// cannot be reached). One result per delivery, in order; none when the
/// worker gave up.
async fn claim(shared: &Shared, deliveries: &[Delivery]) -> Option<Vec<pb::ClaimResult>> {
    let jobs: Vec<pb::JobAttempt> = deliveries.iter().map(Delivery::attempt).collect();
    let first_trace = deliveries
        .first()
        .map(|delivery| delivery.trace.clone())
        .unwrap_or_default();
    let span = tracing::info_span!("sluice.worker.claim", worker_id = %shared.worker_id, jobs = jobs.len());
    first_trace.set_as_parent_of(&span);
    let trace = TraceContext::of_span_or(&span, &first_trace);
    let mut answer_lost = false;
    let mut delay = FIRST_RETRY;
    loop {
        let mut client = shared.admission.client.clone();
        let request = request_with(
            pb::ClaimRequest {
                worker_id: shared.worker_id.clone(),
                jobs: jobs.clone(),
            },
            &trace,
        );
        match client.claim(request).instrument(span.clone()).await {
            Ok(response) => {
                let mut results = response.into_inner().results;
                if results.len() == jobs.len() {
                    if answer_lost {
                        confirm_own_claims(shared, &mut results, deliveries, &trace).await;
                    }
                    return Some(results);
                }
                tracing::error!(
                    expected = jobs.len(),
                    got = results.len(),
                    "claim answered a different number of results; retrying"
                );
            }
            Err(status) if !retryable(status.code()) => {
                tracing::error!(endpoint = %shared.admission.endpoint, %status, "claim refused; dropping these deliveries");
                return Some(jobs.iter().map(|_| pb::ClaimResult::default()).collect());
            }
            Err(status) => {
                tracing::warn!(endpoint = %shared.admission.endpoint, %status, "claim failed; retrying");
            }
        }
        answer_lost = true;
        if !back_off(shared, &mut delay).await {
            return None;
        }
    }
}

/// After a claim whose earlier try got no answer, `TAKEN` may be this
/// worker's own win: a heartbeat tells (the protocol's rule).
async fn confirm_own_claims(
    shared: &Shared,
    results: &mut [pb::ClaimResult],
    deliveries: &[Delivery],
    trace: &TraceContext,
) {
    let taken: Vec<pb::JobAttempt> = results
        .iter()
        .filter(|result| result.outcome == pb::ClaimOutcome::Taken as i32)
        .filter(|result| !shared.registry.contains(&(result.job_id.clone(), result.attempt)))
        .map(|result| pb::JobAttempt {
            job_id: result.job_id.clone(),
            attempt: result.attempt,
        })
        .collect();
    if taken.is_empty() {
        return;
    }
    let mut client = shared.admission.client.clone();
    let request = request_with(
        pb::HeartbeatRequest {
            worker_id: shared.worker_id.clone(),
            jobs: taken,
            stream_ended: None,
        },
        trace,
    );
    let Ok(response) = client.heartbeat(request).await else {
        // Unknown: do not run it; if it was ours, its lease lapses and the
        // job's retry policy applies.
        return;
    };
    for beat in response.into_inner().results {
        if beat.outcome != pb::HeartbeatOutcome::Extended as i32 {
            continue;
        }
        for (result, delivery) in results.iter_mut().zip(deliveries) {
            if result.job_id == beat.job_id && result.attempt == beat.attempt {
                result.outcome = pb::ClaimOutcome::Claimed as i32;
                result.lease_ms = delivery.admitted.lease_ms;
            }
        }
    }
}

/// Claim deliveries that have slots, run the ones this worker won.
pub(crate) async fn claim_and_run(shared: Arc<Shared>, deliveries: Vec<Delivery>) {
    // The winning try was sent at this moment or later: counting the lease
    // from here errs short.
    let claim_sent = Instant::now();
    let Some(results) = claim(&shared, &deliveries).await else {
        for delivery in deliveries {
            shared
                .event(Event::Abandoned {
                    partition: delivery.received.partition.clone(),
                    offset: delivery.received.offset,
                })
                .await;
            shared
                .event(Event::SlotFree {
                    task_type: delivery.task_type,
                })
                .await;
        }
        return;
    };
    for (delivery, result) in deliveries.into_iter().zip(results) {
        // Claimed or not, admission now holds the attempt's fate.
        shared.done(&delivery).await;
        let lease_ms = if result.lease_ms > 0 {
            result.lease_ms
        } else {
            delivery.admitted.lease_ms
        };
        let key = (delivery.admitted.job_id.clone(), delivery.admitted.attempt);
        let stop = StopSignal::default();
        let won = result.outcome == pb::ClaimOutcome::Claimed as i32
            && shared.registry.insert(
                key,
                RunningEntry {
                    stop: stop.clone(),
                    lease_ms,
                    trace: delivery.trace.clone(),
                    held_until: lease_end(claim_sent, lease_ms),
                },
            );
        if won {
            Counters::add(&shared.status.counters.claimed);
            tokio::spawn(run_attempt(shared.clone(), delivery, stop));
        } else {
            Counters::add(&shared.status.counters.not_claimed);
            tracing::debug!(
                job_id = %delivery.admitted.job_id,
                attempt = delivery.admitted.attempt,
                outcome = ?pb::ClaimOutcome::try_from(result.outcome),
                "not claimed, dropping the delivery"
            );
            shared
                .event(Event::SlotFree {
                    task_type: delivery.task_type,
                })
                .await;
        }
    }
}

/// How a handler run ended.
pub(crate) enum Ended {
    Returned(std::thread::Result<Result<(), JobError>>),
    /// Asked to stop and did not return in time: dropped.
    Dropped,
}

/// What the worker reports for an attempt.
#[derive(Debug)]
pub(crate) enum AttemptOutcome {
    Succeeded,
    Failed {
        message: String,
        non_retryable: bool,
    },
    HandedBack {
        reason: String,
    },
    /// A cancel was requested; confirmed with Complete.
    CancelConfirmed,
    /// The lease is gone; nothing to report.
    LeaseLost,
}

impl AttemptOutcome {
    pub(crate) fn label(&self) -> &'static str {
        match self {
            AttemptOutcome::Succeeded => "succeeded",
            AttemptOutcome::Failed { .. } => "failed",
            AttemptOutcome::HandedBack { .. } => "handed_back",
            AttemptOutcome::CancelConfirmed => "cancelled",
            AttemptOutcome::LeaseLost => "lease_lost",
        }
    }

    /// What `Complete` reports. An error or a reason is sent as admission
    /// takes it (at most 16 KiB, no NUL bytes): a handler's long stack trace
    /// must not make the completion itself fail.
    pub(crate) fn completion(&self) -> Option<pb::completion::Outcome> {
        match self {
            AttemptOutcome::Succeeded => Some(pb::completion::Outcome::Success(pb::Success {})),
            AttemptOutcome::Failed { message, non_retryable } => Some(pb::completion::Outcome::Failure(pb::Failure {
                error: reported_text(message),
                non_retryable: *non_retryable,
            })),
            AttemptOutcome::HandedBack { reason } => Some(pb::completion::Outcome::HandBack(pb::HandBack {
                reason: reported_text(reason),
            })),
            // Any outcome confirms a cancel; a failure that cannot retry says
            // what happened if the cancel were somehow not recorded.
            AttemptOutcome::CancelConfirmed => Some(pb::completion::Outcome::Failure(pb::Failure {
                error: "stopped: cancel requested".to_string(),
                non_retryable: true,
            })),
            AttemptOutcome::LeaseLost => None,
        }
    }
}

pub(crate) fn decide(ended: Ended, reason: Option<StopReason>) -> AttemptOutcome {
    match (reason, ended) {
        (Some(StopReason::LeaseLost), _) => AttemptOutcome::LeaseLost,
        (Some(StopReason::Cancelled), _) => AttemptOutcome::CancelConfirmed,
        (_, Ended::Dropped) => AttemptOutcome::HandedBack {
            reason: "worker shutting down".to_string(),
        },
        (_, Ended::Returned(Ok(Ok(())))) => AttemptOutcome::Succeeded,
        (_, Ended::Returned(Ok(Err(JobError::Failed { message, non_retryable })))) => {
            AttemptOutcome::Failed { message, non_retryable }
        }
        (_, Ended::Returned(Ok(Err(JobError::HandBack { reason })))) => AttemptOutcome::HandedBack { reason },
        (_, Ended::Returned(Err(panic))) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|text| (*text).to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "no message".to_string());
            AttemptOutcome::Failed {
                message: format!("handler panicked: {text}"),
                non_retryable: false,
            }
        }
    }
}

/// Run the handler until it returns, or stop it: after its token is
/// cancelled it has `stop_grace` to return; at the end of the shutdown grace
/// it is dropped at once.
pub(crate) async fn supervise<F>(
    handling: F,
    stop: &StopSignal,
    force_stop: &CancellationToken,
    stop_grace: Duration,
) -> Ended
where
    F: Future<Output = std::thread::Result<Result<(), JobError>>>,
{
    tokio::pin!(handling);
    tokio::select! {
        result = &mut handling => return Ended::Returned(result),
        _ = stop.token().cancelled() => {}
        _ = force_stop.cancelled() => {
            stop.stop(StopReason::Shutdown);
            return Ended::Dropped;
        }
    }
    tokio::select! {
        result = &mut handling => Ended::Returned(result),
        _ = tokio::time::sleep(stop_grace) => Ended::Dropped,
        _ = force_stop.cancelled() => {
            stop.stop(StopReason::Shutdown);
            Ended::Dropped
        }
    }
}

/// How one attempt's handler runs, whichever transport brought the job.
pub(crate) struct HandlerRun<'a> {
    pub handler: &'a Arc<dyn JobHandler>,
    pub worker_id: &'a str,
    /// Cancelled when the shutdown grace is over: running handlers stop.
    pub force_stop: &'a CancellationToken,
    pub stop_grace: Duration,
}

/// Run the handler on one attempt under its `sluice.worker.handle` span (a
/// child of the job's `trace`), supervised by `stop`; the span, with its
/// `outcome` recorded, and how the attempt ended.
pub(crate) async fn handle_attempt(
    run: HandlerRun<'_>,
    admitted: Arc<pb::AdmittedJob>,
    task_type: Arc<str>,
    trace: &TraceContext,
    stop: StopSignal,
) -> (tracing::Span, AttemptOutcome) {
    // The name is `crate::HANDLE_SPAN` (a literal here, as tracing requires).
    let span = tracing::info_span!(
        "sluice.worker.handle",
        job_id = %admitted.job_id,
        attempt = admitted.attempt,
        tenant = %admitted.tenant,
        task_group = %admitted.task_group,
        task_type = %task_type,
        worker_id = %run.worker_id,
        outcome = tracing::field::Empty,
    );
    trace.set_as_parent_of(&span);
    let job = Job::new(admitted, task_type, stop.clone());
    let handling = AssertUnwindSafe(run.handler.handle(job))
        .catch_unwind()
        .instrument(span.clone());
    let ended = supervise(handling, &stop, run.force_stop, run.stop_grace).await;
    let outcome = decide(ended, stop.reason());
    span.record("outcome", outcome.label());
    (span, outcome)
}

/// Count how an attempt ended (and log the endings worth a warning).
pub(crate) fn count_outcome(counters: &Counters, outcome: &AttemptOutcome, span: &tracing::Span) {
    match outcome {
        AttemptOutcome::Succeeded => Counters::add(&counters.succeeded),
        AttemptOutcome::Failed { message, .. } => {
            Counters::add(&counters.failed);
            tracing::warn!(parent: span, error = %message, "job attempt failed");
        }
        AttemptOutcome::HandedBack { .. } => Counters::add(&counters.handed_back),
        AttemptOutcome::CancelConfirmed => Counters::add(&counters.cancelled),
        AttemptOutcome::LeaseLost => {
            Counters::add(&counters.lease_lost);
            tracing::warn!(parent: span, "lease lost; handler stopped");
        }
    }
}

/// Run one claimed attempt under its span and report how it ended.
async fn run_attempt(shared: Arc<Shared>, delivery: Delivery, stop: StopSignal) {
    let admitted = delivery.admitted.clone();
    let run = HandlerRun {
        handler: &shared.handler,
        worker_id: &shared.worker_id,
        force_stop: &shared.force_stop,
        stop_grace: shared.stop_grace,
    };
    let (span, outcome) =
        handle_attempt(run, admitted.clone(), delivery.task_type.clone(), &delivery.trace, stop).await;
    let trace = TraceContext::of_span_or(&span, &delivery.trace);
    let key = (admitted.job_id.clone(), admitted.attempt);
    count_outcome(&shared.status.counters, &outcome, &span);
    if let Some(reported) = outcome.completion() {
        let completion = pb::Completion {
            job_id: admitted.job_id.clone(),
            attempt: admitted.attempt,
            outcome: Some(reported),
        };
        match shared.complete(completion, trace).instrument(span.clone()).await {
            Some(result) if result.outcome == pb::CompleteOutcome::Accepted as i32 => {}
            Some(result) => tracing::info!(
                parent: &span,
                outcome = ?pb::CompleteOutcome::try_from(result.outcome),
                "completion not accepted (the attempt is no longer this worker's)"
            ),
            None => tracing::warn!(parent: &span, "completion given up; the lease will lapse"),
        }
    }
    shared.registry.remove(&key);
    shared
        .event(Event::SlotFree {
            task_type: delivery.task_type,
        })
        .await;
}

/// Send queued completions in batches until `stop`.
pub(crate) async fn run_completer(
    shared: Arc<Shared>,
    mut items: mpsc::Receiver<CompletionItem>,
    stop: CancellationToken,
) {
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => return,
            item = items.recv() => match item {
                Some(item) => item,
                None => return,
            },
        };
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match items.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        let answers = send_completions(&shared, &batch).await;
        match answers {
            Some(results) => {
                for (item, result) in batch.into_iter().zip(results) {
                    let _ = item.answered.send(Some(result));
                }
            }
            None => {
                for item in batch {
                    let _ = item.answered.send(None);
                }
            }
        }
    }
}

async fn send_completions(shared: &Shared, batch: &[CompletionItem]) -> Option<Vec<pb::CompleteResult>> {
    let completions: Vec<pb::Completion> = batch.iter().map(|item| item.completion.clone()).collect();
    // A batch carries the trace context of its first completion.
    let trace = batch.first().map(|item| item.trace.clone()).unwrap_or_default();
    let mut delay = FIRST_RETRY;
    loop {
        let mut client = shared.admission.client.clone();
        let request = request_with(
            pb::CompleteRequest {
                worker_id: shared.worker_id.clone(),
                completions: completions.clone(),
            },
            &trace,
        );
        match client.complete(request).await {
            Ok(response) => {
                let results = response.into_inner().results;
                if results.len() == completions.len() {
                    return Some(results);
                }
                tracing::error!(
                    expected = completions.len(),
                    got = results.len(),
                    "complete answered a different number of results; retrying"
                );
            }
            Err(status) if !retryable(status.code()) => {
                tracing::error!(endpoint = %shared.admission.endpoint, %status, "complete refused");
                return None;
            }
            Err(status) => tracing::warn!(endpoint = %shared.admission.endpoint, %status, "complete failed; retrying"),
        }
        if !back_off(shared, &mut delay).await {
            return None;
        }
    }
}

/// Heartbeat every held attempt in batches: every `fixed` when set, else a
/// third of the shortest lease among them. Stops handlers whose answer is
/// CANCELLED or LEASE_LOST, and those whose lease passed with no heartbeat
/// answered (a heartbeat may hang while a job partition changes owner).
pub(crate) async fn run_heartbeats(shared: Arc<Shared>, fixed: Option<Duration>, stop: CancellationToken) {
    tokio::join!(beat(&shared, fixed, &stop), watch_leases(&shared.registry, &stop));
}

/// How often the lease watch looks when no attempt is held.
const LEASE_WATCH_IDLE: Duration = Duration::from_millis(250);

/// Stop each held attempt as lease-lost when its lease by this worker's
/// own count passes (`Registry::stop_unrenewed`).
async fn watch_leases(registry: &Registry, stop: &CancellationToken) {
    loop {
        let now = Instant::now();
        let next = registry.stop_unrenewed(now).unwrap_or(now + LEASE_WATCH_IDLE);
        tokio::select! {
            _ = stop.cancelled() => return,
            // A new attempt's lease ends after the next one due, or is
            // looked at within the idle period.
            _ = tokio::time::sleep_until(next.min(now + LEASE_WATCH_IDLE)) => {}
        }
    }
}

async fn beat(shared: &Arc<Shared>, fixed: Option<Duration>, stop: &CancellationToken) {
    let mut last_beat = Instant::now();
    loop {
        let (attempts, shortest_lease, trace) = shared.registry.snapshot();
        let interval = match (fixed, shortest_lease) {
            (Some(fixed), _) => fixed,
            (None, Some(lease_ms)) => {
                Duration::from_millis(lease_ms / 3).clamp(Duration::from_millis(50), Duration::from_secs(10))
            }
            (None, None) => Duration::from_millis(250),
        };
        if attempts.is_empty() {
            // The first beat of a new attempt comes one interval after the
            // last beat at the latest (its claim just started its lease).
            last_beat = Instant::now();
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = shared.registry.added.notified() => continue,
                _ = tokio::time::sleep(interval) => continue,
            }
        }
        let due = last_beat + interval;
        if Instant::now() < due {
            tokio::select! {
                _ = stop.cancelled() => return,
                // A new attempt may have a shorter lease: recompute.
                _ = shared.registry.added.notified() => continue,
                _ = tokio::time::sleep_until(due) => {}
            }
        }
        let (attempts, _, _) = shared.registry.snapshot();
        let mut all_answered = true;
        for chunk in attempts.chunks(MAX_BATCH) {
            if !heartbeat_once(shared, chunk, &trace).await {
                all_answered = false;
            }
        }
        last_beat = if all_answered {
            Instant::now()
        } else {
            // Try again soon; the lease has two more intervals of room.
            Instant::now() - interval + Duration::from_millis(200).min(interval)
        };
    }
}

async fn heartbeat_once(shared: &Shared, attempts: &[pb::JobAttempt], trace: &TraceContext) -> bool {
    let mut client = shared.admission.client.clone();
    let request = request_with(
        pb::HeartbeatRequest {
            worker_id: shared.worker_id.clone(),
            jobs: attempts.to_vec(),
            stream_ended: None,
        },
        trace,
    );
    let sent = Instant::now();
    match client.heartbeat(request).await {
        Ok(response) => {
            for result in response.into_inner().results {
                let key = (result.job_id, result.attempt);
                if result.outcome == pb::HeartbeatOutcome::Extended as i32 {
                    shared.registry.renewed(&key, sent);
                } else if result.outcome == pb::HeartbeatOutcome::Cancelled as i32 {
                    shared.registry.stop(&key, StopReason::Cancelled);
                } else if result.outcome == pb::HeartbeatOutcome::LeaseLost as i32 {
                    shared.registry.stop(&key, StopReason::LeaseLost);
                }
            }
            true
        }
        Err(status) => {
            tracing::warn!(endpoint = %shared.admission.endpoint, %status, jobs = attempts.len(), "heartbeat failed; retrying soon");
            false
        }
    }
}

/// Pass unstarted jobs to partitions other workers own; what cannot be
/// forwarded is handed back.
pub(crate) async fn forward(shared: Arc<Shared>, deliveries: Vec<(Delivery, i32)>) {
    let sends = deliveries.into_iter().map(|(delivery, target)| {
        let shared = shared.clone();
        async move {
            let sent = forward_one(&shared, &delivery, target).await;
            (delivery, sent)
        }
    });
    let mut failed = Vec::new();
    for (delivery, sent) in futures::future::join_all(sends).await {
        match sent {
            Ok(()) => {
                Counters::add(&shared.status.counters.forwarded);
                shared.done(&delivery).await;
            }
            Err(error) => {
                tracing::warn!(job_id = %delivery.admitted.job_id, %error, "forwarding failed; handing the job back");
                failed.push(delivery);
            }
        }
    }
    if !failed.is_empty() {
        hand_back(shared, failed, "forwarding to another worker failed").await;
    }
}

async fn forward_one(shared: &Shared, delivery: &Delivery, target: i32) -> Result<(), rdkafka::error::KafkaError> {
    let hops = (delivery.hops + 1).to_string();
    let mut headers = OwnedHeaders::new_with_capacity(delivery.received.headers.len() + 1);
    for (name, value) in &delivery.received.headers {
        if name.eq_ignore_ascii_case(HANDOFF_HOPS_HEADER) {
            continue;
        }
        headers = headers.insert(Header {
            key: name,
            value: Some(value),
        });
    }
    headers = headers.insert(Header {
        key: HANDOFF_HOPS_HEADER,
        value: Some(hops.as_bytes()),
    });
    let topic = delivery.received.partition.0.clone();
    let mut record = FutureRecord::<[u8], [u8]>::to(&topic)
        .partition(target)
        .payload(&delivery.received.payload)
        .headers(headers);
    if let Some(key) = &delivery.received.key {
        record = record.key(key);
    }
    shared
        .forwarder
        .send(record, Duration::from_secs(10))
        .await
        .map(|_| ())
        .map_err(|(error, _)| error)
}

/// Claim and hand back unstarted jobs, so their tickets return now and
/// admission admits them again for any worker.
pub(crate) async fn hand_back(shared: Arc<Shared>, deliveries: Vec<Delivery>, reason: &'static str) {
    let Some(results) = claim(&shared, &deliveries).await else {
        for delivery in deliveries {
            shared
                .event(Event::Abandoned {
                    partition: delivery.received.partition.clone(),
                    offset: delivery.received.offset,
                })
                .await;
        }
        return;
    };
    let mut claimed = Vec::new();
    for (delivery, result) in deliveries.into_iter().zip(results) {
        if result.outcome == pb::ClaimOutcome::Claimed as i32 {
            claimed.push(delivery);
        } else {
            Counters::add(&shared.status.counters.not_claimed);
            shared.done(&delivery).await;
        }
    }
    let completions = claimed.into_iter().map(|delivery| {
        let shared = shared.clone();
        async move {
            let completion = pb::Completion {
                job_id: delivery.admitted.job_id.clone(),
                attempt: delivery.admitted.attempt,
                outcome: Some(pb::completion::Outcome::HandBack(pb::HandBack {
                    reason: reason.to_string(),
                })),
            };
            let answer = shared.complete(completion, delivery.trace.clone()).await;
            (delivery, answer)
        }
    });
    for (delivery, answer) in futures::future::join_all(completions).await {
        match answer {
            Some(result) if result.outcome == pb::CompleteOutcome::Accepted as i32 => {
                Counters::add(&shared.status.counters.handed_back);
            }
            _ => tracing::warn!(
                job_id = %delivery.admitted.job_id,
                "hand-back not accepted; the claim's lease will lapse"
            ),
        }
        // Claimed: admission holds the attempt's fate either way.
        shared.done(&delivery).await;
    }
}

#[cfg(test)]
mod tests;
