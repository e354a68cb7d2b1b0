//! `make chaos`: the four services as separate processes, two of each, on
//! the real broker and PostgreSQL, while producers enqueue jobs on
//! concurrency keys and worker processes run them. A run without faults,
//! then one with them, for each kind of worker: `Work` streams, and Kafka
//! consumers with unary `Claim` (`CHAOS_WORKERS`: `stream,kafka`, or one
//! of them). Workers are written from docs/worker-protocol.md alone
//! (`worker`).
//!
//! Faults, while jobs are pending: every 3-6 s SIGKILL of a service
//! instance (restarted after 0.5-2 s), SIGSTOP of the broker for 1-3 s
//! (CHAOS_BROKER_PID names it), or every PostgreSQL connection of the
//! services paused for 1-3 s (they go through a proxy in this runner);
//! once, both instances of one service killed and restarted after 5 s
//! (CHAOS_DOWN_SERVICE picks it); about every CHAOS_WORKER_KILL_S (20) a
//! worker process SIGKILLed with its jobs in flight (and started again);
//! and live workers abandon CHAOS_ABANDON (0.005) of their jobs once
//! admission confirmed them: no more heartbeats, no completion, so the
//! lease must expire and use an attempt.
//!
//! Each run's figures come from the workers' event logs, GetJob's history
//! of every job at the end, and the rate-window's grants (see `analysis`):
//! lost, duplicated (an attempt won twice, two runs of a job at once, a
//! run after an accepted success), over-limit, attempts_not_counted
//! (confirmed attempts handed back for free), the longest time a key had
//! waiters and nothing running, throughput and, under faults, its ratio to
//! the run without. One JSON line per run, then one summary line (the last
//! line printed); exit 1 when a guarantee fails in any run (and, with
//! CHAOS_STRICT_IDLE=1, when a key was idle with waiters longer than
//! CHAOS_IDLE_BOUND_S, 10).
//!
//! Environment: CHAOS_JOBS (5000), CHAOS_KEYS (50), CHAOS_LIMIT (3),
//! CHAOS_KILLS (1; 0: only the runs without faults), CHAOS_CLEAN (1; 0:
//! only the runs with faults), CHAOS_DEADLINE_S (600 per run), CHAOS_RATE
//! (300 jobs/s enqueued at most), CHAOS_LEASE (the task group's lease,
//! 5s), CHAOS_WORKER_PROCESSES (2), CHAOS_SLOTS (16 jobs at once per
//! worker process),
//! CHAOS_SERVICE_LOG (the services' RUST_LOG, `warn`), CHAOS_VICTIMS
//! (`workers`: kill only workers). The service binaries are taken from
//! this binary's directory (`make chaos` builds them); the configuration
//! is the built-in defaults plus a test prefix.
//!
//! `sluice-chaos backlog` is `make bench-backlog` instead (`backlog`).

#![recursion_limit = "256"]

#[path = "sluice-chaos/analysis.rs"]
mod analysis;
#[path = "sluice-chaos/backlog.rs"]
mod backlog;
#[path = "sluice-chaos/cluster.rs"]
mod cluster;
#[path = "sluice-chaos/events.rs"]
mod events;
#[path = "sluice-chaos/kafka_worker.rs"]
mod kafka_worker;
#[path = "sluice-chaos/run.rs"]
mod run;
#[path = "sluice-chaos/stream_worker.rs"]
mod stream_worker;
#[path = "sluice-chaos/watch.rs"]
mod watch;
#[path = "sluice-chaos/worker.rs"]
mod worker;
#[path = "sluice-chaos/workload.rs"]
mod workload;

use std::time::Duration;

fn env_number<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match std::env::args().nth(1).as_deref() {
        Some("worker") => return worker::main().await,
        Some("backlog") => {
            sluice_e2e::init_logging();
            return backlog::main().await;
        }
        _ => {}
    }
    sluice_e2e::init_logging();
    let kinds: Vec<String> = std::env::var("CHAOS_WORKERS")
        .unwrap_or_else(|_| "stream,kafka".to_string())
        .split(',')
        .map(|kind| kind.trim().to_string())
        .filter(|kind| !kind.is_empty())
        .collect();
    for kind in &kinds {
        anyhow::ensure!(
            kind == "stream" || kind == "kafka",
            "CHAOS_WORKERS: {kind:?} is not stream or kafka"
        );
    }
    let mut modes = Vec::new();
    if env_number::<u32>("CHAOS_CLEAN", 1) > 0 {
        modes.push(false);
    }
    if env_number::<u32>("CHAOS_KILLS", 1) > 0 {
        modes.push(true);
    }
    let base = run::Spec {
        workers: String::new(),
        faults: false,
        jobs: env_number("CHAOS_JOBS", 5000),
        keys: env_number("CHAOS_KEYS", 50),
        limit: env_number("CHAOS_LIMIT", 3),
        rate: env_number("CHAOS_RATE", 300.0),
        deadline: Duration::from_secs(env_number("CHAOS_DEADLINE_S", 600)),
        lease: std::env::var("CHAOS_LEASE").unwrap_or_else(|_| "5s".to_string()),
        abandon: env_number("CHAOS_ABANDON", 0.005),
        worker_kill_every: Duration::from_secs_f64(env_number("CHAOS_WORKER_KILL_S", 20.0)),
        workers_only: std::env::var("CHAOS_VICTIMS").is_ok_and(|victims| victims == "workers"),
        worker_processes: env_number("CHAOS_WORKER_PROCESSES", 2),
        slots: env_number("CHAOS_SLOTS", 16),
        broker_pid: std::env::var("CHAOS_BROKER_PID").ok().and_then(|pid| pid.parse().ok()),
    };
    let mut lines = Vec::new();
    let mut failed = false;
    let mut idle_bound_held = true;
    let mut ratios_held = true;
    for kind in &kinds {
        let mut clean_jobs_per_s: Option<f64> = None;
        for faults in &modes {
            let spec = run::Spec {
                workers: kind.clone(),
                faults: *faults,
                ..base.clone()
            };
            let mut outcome = match run::run(&spec).await {
                Ok(outcome) => outcome,
                Err(error) => {
                    // The stack did not come up: a failed run, still a line.
                    let mut figures = serde_json::Map::new();
                    figures.insert("workers".into(), kind.clone().into());
                    figures.insert("faults".into(), (*faults).into());
                    figures.insert("failed".into(), vec![format!("the run failed: {error:#}")].into());
                    run::Outcome {
                        figures,
                        failures: vec![format!("{error:#}")],
                        idle_max_s: f64::INFINITY,
                        jobs_per_s: 0.0,
                    }
                }
            };
            if *faults {
                let ratio = clean_jobs_per_s
                    .filter(|clean| *clean > 0.0)
                    .map(|clean| outcome.jobs_per_s / clean);
                // The goal: under faults at least half the throughput.
                ratios_held &= ratio.is_none_or(|ratio| ratio >= 0.5);
                outcome.figures.insert("throughput_ratio".into(), ratio.into());
            } else {
                clean_jobs_per_s = Some(outcome.jobs_per_s);
            }
            idle_bound_held &= outcome.idle_max_s <= env_number("CHAOS_IDLE_BOUND_S", 10.0);
            failed |= !outcome.failures.is_empty();
            let line = serde_json::Value::Object(outcome.figures);
            println!("{line}");
            lines.push(line);
        }
    }
    let summary = serde_json::json!({
        "summary": true,
        "failed": failed,
        "idle_bound_held": idle_bound_held,
        "throughput_ratio_held": ratios_held,
        "runs": lines,
    });
    println!("{summary}");
    std::process::exit(i32::from(failed));
}
