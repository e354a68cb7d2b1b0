//! End-to-end tests on the real broker (tansu or Kafka at 127.0.0.1:9092) and
//! PostgreSQL (127.0.0.1:5432). `make test` starts both.

// Test-only crate: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod adaptive;
mod auth;
mod broker_reset;
mod consumer_buffer;
mod crash;
mod deadletter;
mod docs;
mod edge;
mod fairness;
mod fencing;
mod floating;
mod flow;
mod hostile;
mod introspection;
mod jobs_api;
mod limits;
mod membership;
mod ownership;
mod quota;
mod rate;
mod reflection;
mod resume;
mod shadow;
mod storage;
mod stranded;
mod tls;
mod work;
