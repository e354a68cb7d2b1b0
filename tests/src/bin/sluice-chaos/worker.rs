//! A worker process (`sluice-chaos worker`), started and SIGKILLed by the
//! runner. It runs the chaos jobs as docs/worker-protocol.md says, written
//! from that document alone (as a worker in another language would be,
//! not with the Rust SDK), and appends what it saw to its event log
//! (`events`). Two kinds: `stream` (§7: a `Work` stream to every admission
//! instance) and `kafka` (§1–§4: consume `jobs.admitted.default`, unary
//! `Claim`, `Heartbeat`, `Complete`).
//!
//! A share `CHAOS_W_ABANDON` of the jobs is abandoned once admission
//! confirmed the attempt (a claim answered CLAIMED, a heartbeat EXTENDED):
//! the handler runs, then the worker stops heartbeating and never completes
//! it, while the process lives on. The lease must expire and use an
//! attempt.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use sluice_proto::v1::admission_client::AdmissionClient;
use tonic::transport::Channel;

use crate::events::EventLog;

/// The task group every chaos job runs in.
pub const TASK_GROUP: &str = "default";
/// A call's deadline (the protocol document's advice).
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
pub struct Settings {
    /// `stream` or `kafka`.
    pub kind: String,
    pub worker_id: String,
    pub log: PathBuf,
    /// Admission's stable address (any instance).
    pub admission: String,
    /// The stack's configuration file (brokers, topic prefix).
    pub config: PathBuf,
    pub abandon: f64,
    /// Jobs run at once (a stream worker gives each of its two streams
    /// half as credits).
    pub slots: usize,
    /// Handlers return at once instead of running `workload::run_ms`
    /// (the backlog benchmark's drain).
    pub instant: bool,
}

impl Settings {
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("CHAOS_W_KIND", self.kind.clone()),
            ("CHAOS_W_ID", self.worker_id.clone()),
            ("CHAOS_W_LOG", self.log.to_string_lossy().into_owned()),
            ("CHAOS_W_ADMISSION", self.admission.clone()),
            ("CHAOS_W_CONFIG", self.config.to_string_lossy().into_owned()),
            ("CHAOS_W_ABANDON", self.abandon.to_string()),
            ("CHAOS_W_SLOTS", self.slots.to_string()),
            ("CHAOS_W_INSTANT", u8::from(self.instant).to_string()),
        ]
    }

    pub fn from_env() -> anyhow::Result<Self> {
        let var = |name: &str| std::env::var(name).with_context(|| format!("{name} is not set"));
        Ok(Settings {
            kind: var("CHAOS_W_KIND")?,
            worker_id: var("CHAOS_W_ID")?,
            log: var("CHAOS_W_LOG")?.into(),
            admission: var("CHAOS_W_ADMISSION")?,
            config: var("CHAOS_W_CONFIG")?.into(),
            abandon: var("CHAOS_W_ABANDON")?.parse().context("CHAOS_W_ABANDON")?,
            slots: var("CHAOS_W_SLOTS")?.parse().context("CHAOS_W_SLOTS")?,
            instant: var("CHAOS_W_INSTANT").is_ok_and(|instant| instant == "1"),
        })
    }
}

pub async fn main() -> anyhow::Result<()> {
    let settings = Settings::from_env()?;
    let log = std::sync::Arc::new(EventLog::create(&settings.log)?);
    match settings.kind.as_str() {
        "stream" => crate::stream_worker::run(&settings, log).await,
        "kafka" => crate::kafka_worker::run(&settings, log).await,
        other => anyhow::bail!("CHAOS_W_KIND {other:?}: stream or kafka"),
    }
}

/// A client of `endpoint` that connects when first used and again after a
/// failure; every call has `CALL_TIMEOUT`.
pub fn admission_client(endpoint: &str) -> anyhow::Result<AdmissionClient<Channel>> {
    let channel = sluice_common::tls::endpoint(endpoint)?
        .connect_timeout(Duration::from_secs(2))
        .timeout(CALL_TIMEOUT)
        .connect_lazy();
    Ok(AdmissionClient::new(channel))
}
