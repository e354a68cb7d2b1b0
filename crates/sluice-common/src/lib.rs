//! What every Sluice service shares. Each service is a library with a thin
//! `main`; this crate gives them configuration, telemetry, Kafka plumbing,
//! PostgreSQL storage, gRPC bootstrap and the owner runtime.

pub mod auth;
mod cert_names;
pub mod cli;
pub mod clock;
pub mod config;
pub mod core;
pub mod fault;
pub mod faults;
pub mod forward;
pub mod grpc;
pub mod hash;
pub mod hostile;
pub mod kafka;
pub mod link;
pub mod metrics;
pub mod owner;
pub mod partition;
pub mod readiness;
pub mod retry;
pub mod service;
pub mod shutdown;
pub mod storage;
pub mod telemetry;
pub mod ticket;
pub mod tls;
pub mod validate;

pub use config::SluiceConfig;
pub use faults::{FaultPoint, Faults};
pub use shutdown::Shutdown;
