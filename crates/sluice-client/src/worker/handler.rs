//! What a job handler sees and answers.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use futures::future::BoxFuture;
use sluice_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

/// Why a running handler is asked to stop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `CancelJob` was called; the worker confirms with `Complete` once the
    /// handler has returned (or was dropped), and the job's tickets return.
    Cancelled,
    /// The lease is gone (expired or the attempt superseded): another
    /// attempt may run. Nothing is reported.
    LeaseLost,
    /// The worker is shutting down and the grace period is over: the job is
    /// handed back and runs again elsewhere.
    Shutdown,
}

/// The stop signal of one running attempt: a cancellation token plus why.
#[derive(Clone, Debug, Default)]
pub(crate) struct StopSignal {
    token: CancellationToken,
    reason: Arc<OnceLock<StopReason>>,
}

impl StopSignal {
    /// Ask the handler to stop; the first reason wins.
    pub fn stop(&self, reason: StopReason) {
        let _ = self.reason.set(reason);
        self.token.cancel();
    }

    pub fn reason(&self) -> Option<StopReason> {
        self.reason.get().copied()
    }

    pub fn token(&self) -> &CancellationToken {
        &self.token
    }
}

/// One claimed attempt, handed to the handler.
#[derive(Clone, Debug)]
pub struct Job {
    admitted: Arc<pb::AdmittedJob>,
    task_type: Arc<str>,
    stop: StopSignal,
}

impl Job {
    pub(crate) fn new(admitted: Arc<pb::AdmittedJob>, task_type: Arc<str>, stop: StopSignal) -> Self {
        Job {
            admitted,
            task_type,
            stop,
        }
    }

    pub fn job_id(&self) -> &str {
        &self.admitted.job_id
    }

    pub fn attempt(&self) -> u32 {
        self.admitted.attempt
    }

    pub fn tenant(&self) -> &str {
        &self.admitted.tenant
    }

    pub fn task_group(&self) -> &str {
        &self.admitted.task_group
    }

    /// The task type the worker's per-process limits counted this job under.
    pub fn task_type(&self) -> &str {
        &self.task_type
    }

    pub fn payload(&self) -> &[u8] {
        &self.admitted.payload
    }

    /// Everything admission published about the attempt.
    pub fn admitted(&self) -> &pb::AdmittedJob {
        &self.admitted
    }

    /// Cancelled when the handler must stop (see [`Job::stop_reason`]). A
    /// handler that does not return within the worker's `stop_grace` after
    /// this fires is dropped at its next `.await`.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.stop.token().clone()
    }

    /// Resolves when the handler must stop.
    pub async fn cancelled(&self) {
        self.stop.token().cancelled().await;
    }

    pub fn is_cancelled(&self) -> bool {
        self.stop.token().is_cancelled()
    }

    /// Why the handler was asked to stop, once it was.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.stop.reason()
    }
}

/// How a handler's attempt ended, when not in success.
///
/// Any `std::error::Error` converts into a retryable failure, so `?` works in
/// handlers. (`JobError` itself is not a `std::error::Error`, for that
/// conversion to exist.)
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum JobError {
    /// The attempt failed; the job retries while its policy allows
    /// (`non_retryable` ends it now).
    Failed { message: String, non_retryable: bool },
    /// Give the attempt back without using it up: the job's tickets return
    /// and it is admitted again, for any worker.
    HandBack { reason: String },
}

impl JobError {
    /// A failure the job's retry policy may retry.
    pub fn retryable(message: impl std::fmt::Display) -> Self {
        JobError::Failed {
            message: message.to_string(),
            non_retryable: false,
        }
    }

    /// A failure that ends the job now, whatever attempts remain.
    pub fn fatal(message: impl std::fmt::Display) -> Self {
        JobError::Failed {
            message: message.to_string(),
            non_retryable: true,
        }
    }

    /// Hand the attempt back (e.g. a downstream this process cannot reach).
    pub fn hand_back(reason: impl std::fmt::Display) -> Self {
        JobError::HandBack {
            reason: reason.to_string(),
        }
    }
}

impl std::fmt::Display for JobError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            JobError::Failed {
                message,
                non_retryable: false,
            } => write!(formatter, "failed: {message}"),
            JobError::Failed {
                message,
                non_retryable: true,
            } => write!(formatter, "failed (not retryable): {message}"),
            JobError::HandBack { reason } => write!(formatter, "handed back: {reason}"),
        }
    }
}

impl<E: std::error::Error> From<E> for JobError {
    fn from(error: E) -> Self {
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message.push_str(": ");
            message.push_str(&cause.to_string());
            source = cause.source();
        }
        JobError::retryable(message)
    }
}

/// Runs one attempt of a job. Implemented for every
/// `Fn(Job) -> impl Future<Output = Result<(), JobError>>`.
pub trait JobHandler: Send + Sync + 'static {
    fn handle(&self, job: Job) -> BoxFuture<'static, Result<(), JobError>>;
}

impl<F, Fut> JobHandler for F
where
    F: Fn(Job) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), JobError>> + Send + 'static,
{
    fn handle(&self, job: Job) -> BoxFuture<'static, Result<(), JobError>> {
        Box::pin(self(job))
    }
}

/// Why a refresh failed; the dispatcher keeps the current max and retries
/// with backoff. Any `std::error::Error` converts into it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RefreshError(pub String);

impl RefreshError {
    pub fn new(message: impl std::fmt::Display) -> Self {
        RefreshError(message.to_string())
    }
}

impl std::fmt::Display for RefreshError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str(&self.0)
    }
}

impl<E: std::error::Error> From<E> for RefreshError {
    fn from(error: E) -> Self {
        RefreshError(error.to_string())
    }
}

/// Computes a floating key's new max (>= 1) from its refresh task (tenant,
/// key, current max, the limit's metadata). Implemented for every
/// `Fn(RefreshTask) -> impl Future<Output = Result<u32, RefreshError>>`.
pub trait RefreshHandler: Send + Sync + 'static {
    fn refresh(&self, task: pb::RefreshTask) -> BoxFuture<'static, Result<u32, RefreshError>>;
}

impl<F, Fut> RefreshHandler for F
where
    F: Fn(pb::RefreshTask) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<u32, RefreshError>> + Send + 'static,
{
    fn refresh(&self, task: pb::RefreshTask) -> BoxFuture<'static, Result<u32, RefreshError>> {
        Box::pin(self(task))
    }
}
