//! The `Work` stream: a worker's session with this instance
//! (docs/worker-protocol.md). The first message opens the session in the
//! hub (`work`); credits add room and wake the job partitions that hold
//! admitted jobs for the session's task groups; heartbeats and completions
//! go to their jobs' owners exactly as the unary calls do, and are answered
//! on the stream by id. Requests about one job are applied in the order the
//! stream carried them (a confirming heartbeat before the completion sent
//! after it); requests about other jobs go on beside them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use sluice_common::auth::{Action, Principal};
use sluice_common::validate::{check_name, FieldError, MAX_ID_BYTES};
use sluice_common::Shutdown;
use sluice_proto::v1 as pb;
use tokio::sync::{mpsc, Notify, Semaphore};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Response, Status, Streaming};

use crate::service::{attempts_of, check_batch, checked_completion, side_by_side, AdmissionApi};
use crate::transitions::StreamEnd;
use crate::work::{UndeliveredPush, WorkSession};

/// Messages buffered down one stream: pushes and answers.
const STREAM_BUFFER: usize = 1024;
/// Credits one message may add, and credits one session may hold, at most.
pub const MAX_CREDITS: u32 = 10_000;
/// Task groups one session may name, at most.
const MAX_TASK_GROUPS: usize = 64;
/// Heartbeats and completions of one stream answered at once, at most (the
/// next request waits).
const IN_FLIGHT_PER_STREAM: usize = 64;
/// A request that waited this long behind an earlier one about the same
/// jobs is logged (at info).
const SLOW_TURN: std::time::Duration = std::time::Duration::from_secs(1);

/// Open a session from the stream's first message and serve the rest.
pub async fn serve(
    api: AdmissionApi,
    caller: Arc<Principal>,
    mut inbound: Streaming<pb::WorkRequest>,
) -> Result<Response<ReceiverStream<Result<pb::WorkResponse, Status>>>, Status> {
    // Jobs of other tenants are neither pushed to this stream nor
    // heartbeated or completed through it.
    let scope = caller.job_scope(Action::Work)?;
    let open = match inbound.message().await? {
        Some(pb::WorkRequest {
            message: Some(pb::work_request::Message::Open(open)),
        }) => open,
        Some(_) => return Err(FieldError::new("open", "the first message of a Work stream must be open").into()),
        None => return Err(Status::cancelled("the Work stream closed before it opened")),
    };
    check_open(&api, &open)?;
    let (sender, receiver) = mpsc::channel(STREAM_BUFFER);
    let session = api.hub.open(
        open.worker_id.clone(),
        open.task_groups.clone(),
        scope,
        0,
        Some(sender.clone()),
    );
    tracing::debug!(worker_id = %open.worker_id, task_groups = ?open.task_groups, credits = open.credits, "work stream opened");
    let shutdown = api.shutdown.clone();
    tokio::spawn(async move {
        let reader = StreamReader {
            api,
            caller,
            session,
            sender,
            in_flight: Arc::new(Semaphore::new(IN_FLIGHT_PER_STREAM)),
            order: Mutex::new(JobOrder::default()),
        };
        reader.run(open.credits, inbound, shutdown).await;
    });
    Ok(Response::new(ReceiverStream::new(receiver)))
}

fn check_open(api: &AdmissionApi, open: &pb::WorkOpen) -> Result<(), Status> {
    check_name("open.worker_id", &open.worker_id, MAX_ID_BYTES)?;
    if open.task_groups.is_empty() {
        return Err(FieldError::new("open.task_groups", "name at least one task group").into());
    }
    if open.task_groups.len() > MAX_TASK_GROUPS {
        return Err(FieldError::new("open.task_groups", format!("at most {MAX_TASK_GROUPS}")).into());
    }
    for (index, group) in open.task_groups.iter().enumerate() {
        let field = format!("open.task_groups[{index}]");
        check_name(&field, group, MAX_ID_BYTES)?;
        if !api.config.task_groups.contains_key(group) {
            return Err(FieldError::new(field, format!("task group {group:?} is not declared")).into());
        }
    }
    if open.credits > MAX_CREDITS {
        return Err(FieldError::new("open.credits", format!("at most {MAX_CREDITS}")).into());
    }
    Ok(())
}

struct StreamReader {
    api: AdmissionApi,
    caller: Arc<Principal>,
    session: Arc<WorkSession>,
    sender: mpsc::Sender<Result<pb::WorkResponse, Status>>,
    in_flight: Arc<Semaphore>,
    order: Mutex<JobOrder>,
}

/// One request of a stream, done once its answer is decided.
#[derive(Default)]
struct Completion {
    done: AtomicBool,
    notify: Notify,
}

impl Completion {
    fn finish(&self) {
        self.done.store(true, Ordering::Release);
        self.notify.notify_waiters();
    }

    async fn finished(&self) {
        loop {
            let notified = self.notify.notified();
            if self.done.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    fn is_finished(&self) -> bool {
        self.done.load(Ordering::Acquire)
    }
}

struct FinishOnDrop(Arc<Completion>);

impl Drop for FinishOnDrop {
    fn drop(&mut self) {
        self.0.finish();
    }
}

/// Requests in flight on one stream above which finished ones are forgotten.
const ORDER_PRUNE_AT: usize = 4 * IN_FLIGHT_PER_STREAM;

/// The last request of a stream about each job: the next one about the job
/// waits for it, so one job's requests apply in the order sent (a
/// heartbeat handled beside the completion that followed it was answered
/// LEASE_LOST: 726 of 5,000 pushes in issue 29's run).
#[derive(Default)]
struct JobOrder {
    last: HashMap<String, Arc<Completion>>,
}

impl JobOrder {
    /// A new request about `job_ids`: the requests it must wait for, and its
    /// own completion.
    fn enter<'a>(&mut self, job_ids: impl Iterator<Item = &'a str>) -> (Vec<Arc<Completion>>, Arc<Completion>) {
        if self.last.len() >= ORDER_PRUNE_AT {
            self.last.retain(|_, completion| !completion.is_finished());
        }
        let own = Arc::new(Completion::default());
        let mut before = Vec::new();
        for job_id in job_ids {
            if let Some(previous) = self.last.insert(job_id.to_string(), own.clone()) {
                if !previous.is_finished() && !before.iter().any(|seen| Arc::ptr_eq(seen, &previous)) {
                    before.push(previous);
                }
            }
        }
        (before, own)
    }
}

impl StreamReader {
    async fn run(self, credits: u32, mut inbound: Streaming<pb::WorkRequest>, shutdown: Shutdown) {
        self.add_credits(credits).await;
        let opened = pb::WorkResponse {
            message: Some(pb::work_response::Message::Opened(pb::WorkOpened {
                instance: self.api.own_endpoint.clone(),
                stream_end_grace_ms: u64::try_from(self.api.config.admission.stream_end_grace.0.as_millis())
                    .unwrap_or(u64::MAX),
                withdraws: true,
            })),
        };
        if self.sender.send(Ok(opened)).await.is_err() {
            self.api.hub.close(&self.session);
            return;
        }
        loop {
            let message = tokio::select! {
                _ = shutdown.cancelled() => {
                    // This instance stops: the worker keeps its attempts
                    // through its other streams (or within the leases).
                    self.api.hub.close(&self.session);
                    return;
                }
                message = inbound.message() => message,
            };
            let request = match message {
                Ok(Some(request)) => request,
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!(worker_id = %self.session.worker_id, %status, "work stream broke");
                    break;
                }
            };
            if let Err(status) = self.handle(request).await {
                let _ = self.sender.send(Err(status)).await;
                break;
            }
        }
        let carried = self.api.hub.close(&self.session);
        tracing::debug!(worker_id = %self.session.worker_id, carried = carried.len(), "work stream closed");
        if !carried.is_empty() {
            tokio::spawn(tell_stream_ended(
                self.api.clone(),
                self.session.worker_id.clone(),
                carried,
            ));
        }
    }

    /// One message. An error ends the stream (a second open, too many
    /// credits); a failed heartbeat or completion is answered instead.
    async fn handle(&self, request: pb::WorkRequest) -> Result<(), Status> {
        match request.message {
            Some(pb::work_request::Message::Open(_)) => Err(FieldError::new("open", "a Work stream opens once").into()),
            Some(pb::work_request::Message::Credits(credits)) => {
                let held = self.session.credits();
                if credits.credits > MAX_CREDITS || held.saturating_add(credits.credits) > MAX_CREDITS {
                    return Err(FieldError::new(
                        "credits.credits",
                        format!("a session holds at most {MAX_CREDITS} credits (it holds {held})"),
                    )
                    .into());
                }
                self.add_credits(credits.credits).await;
                Ok(())
            }
            Some(pb::work_request::Message::Heartbeat(heartbeat)) => {
                self.heartbeat(heartbeat).await;
                Ok(())
            }
            Some(pb::work_request::Message::Complete(complete)) => {
                self.complete(complete).await;
                Ok(())
            }
            Some(pb::work_request::Message::Withdraw(withdraw)) => {
                if withdraw.credits > MAX_CREDITS {
                    return Err(FieldError::new("withdraw.credits", format!("at most {MAX_CREDITS}")).into());
                }
                // Answered on the stream after the pushes already written;
                // pushes of credits taken before this are on their way.
                let taken = self.session.withdraw(withdraw.credits);
                let answer = pb::WorkResponse {
                    message: Some(pb::work_response::Message::Answer(pb::WorkAnswer {
                        id: withdraw.id,
                        result: Some(pb::work_answer::Result::Withdrawn(pb::WorkWithdrawn { credits: taken })),
                    })),
                };
                let _ = self.sender.send(Ok(answer)).await;
                Ok(())
            }
            None => Err(FieldError::new("message", "set open, credits, heartbeat, complete or withdraw").into()),
        }
    }

    /// Heartbeats, applied partition by partition (`answer`).
    async fn heartbeat(&self, heartbeat: pb::WorkHeartbeat) {
        let attempts = match attempts_of("heartbeat.jobs", heartbeat.jobs) {
            Ok(attempts) => attempts,
            Err(status) => {
                self.answer_error(heartbeat.id, &status).await;
                return;
            }
        };
        let count = attempts.len();
        let mut parts = Vec::new();
        for (indexes, attempts) in self.api.by_job_partition(attempts, |(job_id, _)| job_id) {
            let turn = self.enter(attempts.iter().map(|(job_id, _)| job_id.as_str()));
            let (api, worker_id, caller) = (self.api.clone(), self.session.worker_id.clone(), self.caller.clone());
            let work: Part<pb::HeartbeatResult> =
                Box::pin(async move { api.heartbeat_attempts(&caller, false, &worker_id, attempts, None).await });
            parts.push((indexes, turn, work));
        }
        self.answer(heartbeat.id, count, parts, |results| {
            pb::work_answer::Result::Heartbeats(pb::HeartbeatResponse { results })
        })
        .await;
    }

    /// Completions, checked whole, then applied partition by partition.
    async fn complete(&self, complete: pb::WorkComplete) {
        self.session.completed(
            complete
                .completions
                .iter()
                .map(|completion| (completion.job_id.as_str(), completion.attempt)),
        );
        // Checked whole first, so that an error names the
        // completion's place in this request, not in its part.
        let checked = check_batch("complete.completions", &complete.completions).and_then(|()| {
            complete
                .completions
                .iter()
                .enumerate()
                .try_for_each(|(index, completion)| {
                    checked_completion("complete.completions", index, completion).map(|_| ())
                })
        });
        if let Err(status) = checked {
            self.answer_error(complete.id, &status).await;
            return;
        }
        let count = complete.completions.len();
        let mut parts = Vec::new();
        for (indexes, completions) in self
            .api
            .by_job_partition(complete.completions, |completion| completion.job_id.as_str())
        {
            let turn = self.enter(completions.iter().map(|completion| completion.job_id.as_str()));
            let (api, worker_id, caller) = (self.api.clone(), self.session.worker_id.clone(), self.caller.clone());
            let work: Part<pb::CompleteResult> = Box::pin(async move {
                api.complete_attempts(
                    &caller,
                    false,
                    &worker_id,
                    "complete.completions",
                    completions,
                    &pb::TraceContext::default(),
                )
                .await
            });
            parts.push((indexes, turn, work));
        }
        self.answer(complete.id, count, parts, |results| {
            pb::work_answer::Result::Completed(pb::CompleteResponse { results })
        })
        .await;
    }

    async fn add_credits(&self, credits: u32) {
        let wake = self.api.hub.add_credits(&self.session, credits);
        self.api.wake_partitions(wake).await;
    }

    /// A request about `job_ids` takes its turn after the earlier ones
    /// about the same jobs.
    fn enter<'a>(&self, job_ids: impl Iterator<Item = &'a str>) -> Turn {
        self.order
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .enter(job_ids)
    }

    /// Run a request's `parts` (one per job partition) beside the stream
    /// (at most `IN_FLIGHT_PER_STREAM` requests at once), each once the
    /// earlier requests about its own jobs are done, and send their results,
    /// in the request's order (`count` in all), under `id`. A part is done
    /// for the requests after it as soon as it is applied: a partition whose
    /// owner is away (seconds, during a takeover) holds up only the requests
    /// about its own jobs, never a completion of another partition's job
    /// that was heartbeaten in the same request. A part that waited
    /// `SLOW_TURN` or longer for the earlier ones is logged.
    #[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
    async fn answer<R: Send + 'static>(
        &self,
        id: u64,
        count: usize,
        parts: Vec<(Vec<usize>, Turn, Part<R>)>,
        wrap: impl FnOnce(Vec<R>) -> pb::work_answer::Result + Send + 'static,
    ) {
        // Finished however this ends (answered, the stream gone, a panic):
        // the requests after them must not wait for ever.
        let parts: Vec<_> = parts
            .into_iter()
            .map(|(indexes, (before, own), work)| (indexes, before, FinishOnDrop(own), work))
            .collect();
        let Ok(permit) = self.in_flight.clone().acquire_owned().await else {
            return;
        };
        let sender = self.sender.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let runs = parts.into_iter().map(|(indexes, before, own, work)| async move {
                let waiting = tokio::time::Instant::now();
                for earlier in &before {
                    earlier.finished().await;
                }
                let waited = waiting.elapsed();
                if waited >= SLOW_TURN {
                    tracing::info!(
                        id,
                        waited_ms = u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                        "a Work stream request waited behind an earlier request about the same jobs"
                    );
                }
                let results = work.await;
                drop(own);
                results.map(|results| (indexes, results))
            });
            let result = match side_by_side(count, runs).await {
                Ok(results) => wrap(results),
                Err(status) => error_result(&status),
            };
            send_answer(&sender, id, result).await;
        });
    }

    /// Answer `id` with an error at once (a request refused as a whole).
    async fn answer_error(&self, id: u64, status: &Status) {
        send_answer(&self.sender, id, error_result(status)).await;
    }
}

/// A request's turn: the earlier requests about its jobs, and its own
/// completion (`JobOrder::enter`).
type Turn = (Vec<Arc<Completion>>, Arc<Completion>);

/// One job partition's share of a request: its results, in its order.
type Part<R> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<R>, Status>> + Send>>;

fn error_result(status: &Status) -> pb::work_answer::Result {
    pb::work_answer::Result::Error(pb::WorkError {
        code: status.code() as i32,
        message: status.message().to_string(),
    })
}

async fn send_answer(
    sender: &mpsc::Sender<Result<pb::WorkResponse, Status>>,
    id: u64,
    result: pb::work_answer::Result,
) {
    let answer = pb::WorkResponse {
        message: Some(pb::work_response::Message::Answer(pb::WorkAnswer {
            id,
            result: Some(result),
        })),
    };
    let _ = sender.send(Ok(answer)).await;
}

/// Tell the owners of the attempts a stream carried that it ended
/// (`admission.stream_end_grace`). Tried again for at most the grace: what
/// cannot be told by then (an owner unreachable) keeps its whole lease.
#[allow(clippy::disallowed_methods, reason = "the runtime reads the clock here, not a core")]
async fn tell_stream_ended(api: AdmissionApi, worker_id: String, attempts: Vec<(String, u32)>) {
    let grace = api.config.admission.stream_end_grace.0;
    let ended = StreamEnd {
        closed_at_ms: sluice_common::clock::wall_clock_ms(),
        grace_ms: i64::try_from(grace.as_millis()).unwrap_or(i64::MAX),
    };
    let give_up = tokio::time::Instant::now() + grace;
    let system = Principal::system();
    let mut backoff = sluice_common::retry::Backoff::new();
    loop {
        let told = api
            .heartbeat_attempts(&system, false, &worker_id, attempts.clone(), Some(ended))
            .await;
        let Err(status) = told else {
            return;
        };
        let transient = sluice_common::fault::classify_status(&status).is_transient();
        if !transient || tokio::time::Instant::now() >= give_up {
            tracing::warn!(%worker_id, attempts = attempts.len(), %status, retrying_for = ?backoff.retrying_for(), "could not tell owners a Work stream ended: its attempts keep their whole leases");
            return;
        }
        tracing::debug!(%worker_id, attempts = attempts.len(), %status, retrying_for = ?backoff.retrying_for(), "telling owners a Work stream ended failed; trying again");
        // One last try at the end of the grace, never after it.
        tokio::select! {
            () = backoff.wait() => {}
            () = tokio::time::sleep_until(give_up) => {}
        }
    }
}

/// Tell job partitions which of their pushes were written, so that those
/// attempts' leases run from the push. A partition that moved away since
/// is not told: its new owner gave the attempts a lease of its own.
pub async fn start_leases_at_the_push(
    registry: Arc<sluice_common::owner::OwnerRegistry<crate::partition::Local>>,
    mut written: mpsc::UnboundedReceiver<crate::work::PushWritten>,
    shutdown: Shutdown,
) -> Result<(), std::convert::Infallible> {
    loop {
        let push = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            push = written.recv() => match push {
                Some(push) => push,
                None => return Ok(()),
            },
        };
        let pushed = crate::partition::Local::Pushed {
            worker_id: push.worker_id,
            attempts: push.attempts,
            written_at_ms: push.written_at_ms,
        };
        let _ = registry.submit(push.partition, pushed).await;
    }
}

/// Hand back the attempts of pushes that could not be written (their
/// stream was gone): a new attempt, none used up, admitted again at once.
/// What cannot be handed back now (its owner unreachable) is left to its
/// lease.
pub async fn hand_back_undelivered(
    api: AdmissionApi,
    mut undelivered: mpsc::UnboundedReceiver<UndeliveredPush>,
    shutdown: Shutdown,
) -> Result<(), std::convert::Infallible> {
    loop {
        let push = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            push = undelivered.recv() => match push {
                Some(push) => push,
                None => return Ok(()),
            },
        };
        let completions: Vec<pb::Completion> = push
            .attempts
            .iter()
            .map(|(job_id, attempt)| pb::Completion {
                job_id: job_id.clone(),
                attempt: *attempt,
                outcome: Some(pb::completion::Outcome::HandBack(pb::HandBack {
                    reason: "pushed to a Work stream that was gone".to_string(),
                })),
            })
            .collect();
        let mut backoff = sluice_common::retry::Backoff::new();
        let system = Principal::system();
        // At most five tries: what is not handed back is left to its lease.
        for _ in 0..5 {
            match api
                .complete_attempts(
                    &system,
                    false,
                    &push.worker_id,
                    "completions",
                    completions.clone(),
                    &pb::TraceContext::default(),
                )
                .await
            {
                Ok(_) => break,
                Err(status) if !sluice_common::fault::classify_status(&status).is_transient() => {
                    tracing::warn!(worker_id = %push.worker_id, attempts = push.attempts.len(), %status, "handing back undelivered pushes refused; left to their leases");
                    break;
                }
                Err(status) => {
                    tracing::warn!(worker_id = %push.worker_id, attempts = push.attempts.len(), %status, retrying_for = ?backoff.retrying_for(), "handing back undelivered pushes failed; trying again");
                    backoff.wait().await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A heartbeat sent before a completion of the same job is applied
    /// first, however long it takes; requests about other jobs do not wait.
    #[tokio::test]
    async fn one_jobs_requests_apply_in_the_order_sent() {
        let mut order = JobOrder::default();
        let (before_heartbeat, heartbeat) = order.enter(["j1", "j2"].into_iter());
        assert!(before_heartbeat.is_empty());
        let (before_complete, complete) = order.enter(["j1"].into_iter());
        assert_eq!(before_complete.len(), 1, "the completion of j1 waits for the heartbeat");
        let (before_other, _other) = order.enter(["j3"].into_iter());
        assert!(before_other.is_empty(), "another job waits for nothing");

        let applied = Arc::new(Mutex::new(Vec::new()));
        let (complete_started, started) = tokio::sync::oneshot::channel();
        let completion = tokio::spawn({
            let applied = applied.clone();
            async move {
                let _ = complete_started.send(());
                for earlier in &before_complete {
                    earlier.finished().await;
                }
                applied.lock().unwrap().push("complete");
                complete.finish();
            }
        });
        started.await.unwrap();
        tokio::task::yield_now().await;
        assert!(
            applied.lock().unwrap().is_empty(),
            "the completion ran before the heartbeat"
        );
        applied.lock().unwrap().push("heartbeat");
        heartbeat.finish();
        completion.await.unwrap();
        assert_eq!(*applied.lock().unwrap(), vec!["heartbeat", "complete"]);
        // Finished requests are not waited for.
        let (after_both, _) = order.enter(["j1", "j2"].into_iter());
        assert!(after_both.is_empty());
    }

    #[test]
    fn finished_requests_are_forgotten_once_many_are_remembered() {
        let mut order = JobOrder::default();
        for index in 0..ORDER_PRUNE_AT * 3 {
            let job_id = format!("job-{index}");
            let (_, own) = order.enter([job_id.as_str()].into_iter());
            own.finish();
        }
        assert!(order.last.len() <= ORDER_PRUNE_AT, "{} remembered", order.last.len());
    }
}
