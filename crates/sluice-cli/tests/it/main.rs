//! Integration tests of the `sluice` command and of the user-facing paths
//! around it (the Python worker example, JSON producers and the documented
//! producer examples), against the real broker and PostgreSQL.

// Test-only crate: a failed unwrap is a failed test.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod broker_loss;
mod cli;
mod json_requests;
mod old_config;
mod python_sdk;
mod python_worker;
mod readme_examples;
mod support;
