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
//! ```no_run
//! use std::time::Duration;
//! use sluice_client::proto::RefreshTask;
//! use sluice_client::{ClientOptions, FloatingLimit, InlineRate, Job, JobBuilder, JobError, Producer, RefreshError, Worker};
//!
//! # async fn do_the_work(_payload: &[u8]) {}
//! # fn quota_for(_metadata: &std::collections::HashMap<String, String>) -> u32 { 4 }
//! # async fn example() -> Result<(), sluice_client::Error> {
//! let options = ClientOptions::default();
//! let producer = Producer::new(&options)?;
//! let request = JobBuilder::new("acme", "default")
//!     .payload(b"thumbnail:42".to_vec())
//!     .concurrency("images", 4)
//!     .floating(FloatingLimit::new("gpu-pool", 2).refresh_every(Duration::from_secs(60)))
//!     .rate(InlineRate::new("api", 100, Duration::from_secs(1)))
//!     .idempotency("upload-42", Duration::from_secs(3600))
//!     .build()?;
//! let enqueued = producer.enqueue(request.clone()).await?; // gRPC: job id, status, deduplicated
//! producer.send(&request).await?; // or Kafka: jobs.requested
//!
//! let worker = Worker::builder(options, |job: Job| async move {
//!     tokio::select! {
//!         _ = do_the_work(job.payload()) => Ok(()),
//!         _ = job.cancelled() => Err(JobError::retryable("stopped")), // cancel, lost lease, shutdown
//!     }
//! })
//! .task_group("default")
//! .concurrency(8) // handlers at once in this process
//! .task_type(|job| String::from_utf8_lossy(&job.payload).split(':').next().unwrap_or("").to_string())
//! .process_limit("thumbnail", 2) // at most 2 thumbnails at once here
//! .refresh_handler(|task: RefreshTask| async move { Ok::<_, RefreshError>(quota_for(&task.metadata)) })
//! .build()?;
//! worker.run(sluice_client::shutdown_on_signals()).await?;
//! # let _ = enqueued;
//! # Ok(())
//! # }
//! ```
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
pub use job::{AdaptiveLimit, FloatingLimit, InlineRate, JobBuilder, RetryPolicy};
pub use options::ClientOptions;
pub use producer::{Enqueued, Producer, Sent};
pub use propagation::TraceContext;
pub use signals::shutdown_on_signals;
pub use sluice_proto::v1 as proto;
pub use worker::{
    Job, JobError, JobHandler, RefreshError, RefreshHandler, StopReason, TaskTypeFn, Transport, Worker, WorkerBuilder,
    WorkerSnapshot, WorkerStatus, HANDOFF_HOPS_HEADER,
};

/// The name of the span each job handler runs in.
pub const HANDLE_SPAN: &str = "sluice.worker.handle";
/// Re-exported so handlers can name the token type without a dependency.
pub use tokio_util::sync::CancellationToken;
