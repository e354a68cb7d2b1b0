//! `make sim`: run seeds of the simulation, print one JSON line.
//!
//! Environment: SEEDS (1000), SEED_FROM (0), SEED (one seed, with a trace of
//! every event on stderr and its digest), SIM_TRACE (trace every seed run),
//! SIM_BUG (put back a bug of the modelled runtime, links or workers:
//! crates/sluice-sim/bugs/model-bugs.txt), SIM_STOP_AT_FIRST (stop at the
//! first failing seed), SIM_FAULTS_UNTIL_MS, SIM_JOBS, SIM_STALL_BOUND_MS,
//! SIM_PRODUCE_EVERY_MS. A failing seed
//! prints the command that replays it; a panic in a core is a failure of
//! its seed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::Instant;

use sluice_sim::{run, Bug, Report, SimConfig, Trace};

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// The settings a replay needs besides the seed.
fn replay_prefix() -> String {
    [
        "SIM_BUG",
        "SIM_FAULTS_UNTIL_MS",
        "SIM_JOBS",
        "SIM_STALL_BOUND_MS",
        "SIM_PRODUCE_EVERY_MS",
    ]
    .iter()
    .filter_map(|name| std::env::var(name).ok().map(|value| format!("{name}={value} ")))
    .collect()
}

fn config_from_env() -> anyhow::Result<SimConfig> {
    let mut config = SimConfig::default();
    if let Ok(until) = std::env::var("SIM_FAULTS_UNTIL_MS") {
        config.faults_until_ms = until.parse()?;
    }
    if let Ok(bound) = std::env::var("SIM_STALL_BOUND_MS") {
        config.stall_bound_ms = bound.parse()?;
    }
    if let Ok(every) = std::env::var("SIM_PRODUCE_EVERY_MS") {
        config.produce_every_ms = every.parse()?;
    }
    if let Ok(jobs) = std::env::var("SIM_JOBS") {
        config.jobs = jobs.parse()?;
    }
    if let Ok(bug) = std::env::var("SIM_BUG") {
        config.bug = Some(Bug::from_name(&bug).ok_or_else(|| anyhow::anyhow!("SIM_BUG={bug}: unknown bug"))?);
    }
    if std::env::var("SEED").is_ok() || std::env::var("SIM_TRACE").is_ok() {
        config.trace = Trace::Print;
    }
    Ok(config)
}

/// One seed; a panic (a core's assertion) is its failure.
fn run_seed(seed: u64, config: &SimConfig) -> anyhow::Result<Report> {
    match catch_unwind(AssertUnwindSafe(|| run(seed, config))) {
        Ok(report) => report,
        Err(panic) => {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
                .unwrap_or_default();
            Ok(Report {
                seed,
                violation: Some(format!("panic: {message}")),
                ..Report::default()
            })
        }
    }
}

fn percentile(sorted: &[i64], share: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    let index = ((sorted.len() as f64 - 1.0) * share).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

#[allow(clippy::disallowed_methods, reason = "the simulation's run time, not simulated time")]
fn main() -> anyhow::Result<()> {
    let config = config_from_env()?;
    let (from, seeds) = match std::env::var("SEED").ok().and_then(|seed| seed.parse::<u64>().ok()) {
        Some(seed) => (seed, 1),
        None => (env_number("SEED_FROM", 0), env_number("SEEDS", 1000)),
    };
    let stop_at_first = std::env::var("SIM_STOP_AT_FIRST").is_ok();
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut first_violation = None;
    let mut stalls: Vec<i64> = Vec::new();
    let (mut steps, mut run) = (0u64, 0u64);
    let mut digest = None;
    for seed in from..from + seeds {
        let report = run_seed(seed, &config)?;
        run += 1;
        steps += report.steps;
        stalls.extend(&report.stalls_ms);
        digest = report.digest;
        if let Some(violation) = &report.violation {
            eprintln!("seed {seed}: {violation}");
            eprintln!("replay: {}SEED={seed} make sim", replay_prefix());
            failures.push(seed);
            first_violation.get_or_insert_with(|| violation.clone());
            if stop_at_first {
                break;
            }
        }
    }
    stalls.sort_unstable();
    let elapsed = started.elapsed().as_secs_f64();
    let line = serde_json::json!({
        "seeds": seeds,
        "seed_from": from,
        "seeds_run": run,
        "failures": failures.len(),
        "failed_seeds": failures.iter().take(20).collect::<Vec<_>>(),
        "first_violation": first_violation,
        "bug": std::env::var("SIM_BUG").ok(),
        "stall_p99_ms": percentile(&stalls, 0.99),
        "stall_max_ms": stalls.last().copied().unwrap_or(0),
        "steps": steps,
        "steps_per_s": (steps as f64 / elapsed.max(1e-9)).round(),
        "seeds_per_s": (run as f64 / elapsed.max(1e-9) * 10.0).round() / 10.0,
        "seconds": (elapsed * 10.0).round() / 10.0,
        "digest": if seeds == 1 { digest.map(|digest| format!("{digest:016x}")) } else { None },
    });
    println!("{line}");
    if !failures.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}
