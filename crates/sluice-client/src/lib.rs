//! Rust SDK for Sluice.
//!
//! - [`Producer`] sends job requests built with [`JobBuilder`]: over Kafka to
//!   `jobs.requested` ([`Producer::send`]), or over gRPC to admission
//!   ([`Producer::enqueue`], [`Producer::enqueue_batch`]) with the job ids,
//!   statuses and idempotency matches back.
//! - [`Worker`] runs a [`JobHandler`] for admitted jobs: consumer group on
//!   `jobs.admitted.<task_group>`, `Claim` before running, heartbeats, stop
//!   on cancel or lost lease, `Complete` with success, failure or hand-back,
//!   per-process limits per task type, hand-off of jobs it cannot start, an
//!   optional floating-limit [`RefreshHandler`], and a graceful shutdown.
//! - [`ClientOptions`] says where Sluice is; no service configuration needed.
//!
//! Each handler runs inside a `tracing` span named [`HANDLE_SPAN`]
//! (`sluice.worker.handle`, fields `job_id`, `attempt`, `tenant`,
//! `task_group`, `task_type`, `worker_id`, `outcome`) whose parent is the W3C
//! trace context of the admitted message; Claim, Heartbeat and Complete
//! carry the trace context in their gRPC metadata. With a
//! `tracing-opentelemetry` layer installed, the job's trace runs from the
//! producer through the services into the handler.

mod error;
mod grpc;
mod job;
mod options;
mod producer;
mod propagation;
mod signals;
mod worker;

pub use error::{Error, Result};
pub use job::{FloatingLimit, InlineRate, JobBuilder, RetryPolicy};
pub use options::ClientOptions;
pub use producer::{Enqueued, Producer, Sent};
pub use propagation::TraceContext;
pub use signals::shutdown_on_signals;
pub use sluice_proto::v1 as proto;
pub use worker::{
    Job, JobError, JobHandler, RefreshError, RefreshHandler, StopReason, TaskTypeFn, Worker, WorkerBuilder,
    WorkerSnapshot, WorkerStatus, HANDOFF_HOPS_HEADER,
};

/// The name of the span each job handler runs in.
pub const HANDLE_SPAN: &str = "sluice.worker.handle";
/// Re-exported so handlers can name the token type without a dependency.
pub use tokio_util::sync::CancellationToken;
