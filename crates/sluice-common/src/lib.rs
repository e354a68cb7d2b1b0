//! What every Sluice service shares. Each service is a library with a thin
//! `main`; this crate gives them configuration, telemetry, Kafka plumbing,
//! PostgreSQL storage, gRPC bootstrap and the owner runtime.

pub mod cli;
pub mod clock;
pub mod config;
pub mod fault;
pub mod faults;
pub mod forward;
pub mod grpc;
pub mod hostile;
pub mod kafka;
pub mod link;
pub mod metrics;
pub mod owner;
pub mod partition;
pub mod readiness;
pub mod service;
pub mod shutdown;
pub mod storage;
pub mod telemetry;
pub mod ticket;
pub mod validate;

pub use config::SluiceConfig;

/// Every Sluice process allocates with mimalloc: the hot path decodes,
/// clones and frees many small buffers per job, and the system allocator's
/// malloc, free and memmove were a quarter of the machine's samples in the
/// benchmark's profile (issue 13). Set here, once, for every binary and test
/// that links this crate.
#[global_allocator]
static GLOBAL_ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;
pub use faults::{FaultPoint, Faults};
pub use shutdown::Shutdown;
