//! `make sim`: run seeds of the simulation, print one JSON line.
//!
//! Environment: SEEDS (1000), SEED_FROM (0), SEED (one seed, with a trace of
//! what happened), SIM_BUG (put back a known bug: answer-without-fence).

use std::time::Instant;

use sluice_sim::{run, Bug, SimConfig};

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

fn main() -> anyhow::Result<()> {
    let mut config = SimConfig::default();
    if let Ok(until) = std::env::var("SIM_FAULTS_UNTIL_MS") {
        config.faults_until_ms = until.parse()?;
    }
    if let Ok(jobs) = std::env::var("SIM_JOBS") {
        config.jobs = jobs.parse()?;
    }
    if let Ok(bug) = std::env::var("SIM_BUG") {
        config.bug = Some(match bug.as_str() {
            "answer-without-fence" => Bug::AnswerWithoutFence,
            other => anyhow::bail!("SIM_BUG={other}: unknown bug"),
        });
    }
    let (from, seeds) = match std::env::var("SEED").ok().and_then(|seed| seed.parse::<u64>().ok()) {
        Some(seed) => (seed, 1),
        None => (env_number("SEED_FROM", 0), env_number("SEEDS", 1000)),
    };
    let started = Instant::now();
    let mut failures = Vec::new();
    let mut stalls: Vec<i64> = Vec::new();
    let mut steps = 0u64;
    for seed in from..from + seeds {
        let report = run(seed, &config)?;
        steps += report.steps;
        stalls.extend(&report.stalls_ms);
        if let Some(violation) = &report.violation {
            eprintln!("seed {seed}: {violation}");
            failures.push(seed);
        }
    }
    stalls.sort_unstable();
    let percentile = |share: f64| -> i64 {
        if stalls.is_empty() {
            return 0;
        }
        let index = ((stalls.len() as f64 - 1.0) * share).round() as usize;
        stalls[index.min(stalls.len() - 1)]
    };
    let elapsed = started.elapsed().as_secs_f64();
    let line = serde_json::json!({
        "seeds": seeds,
        "seed_from": from,
        "failures": failures.len(),
        "failed_seeds": failures.iter().take(20).collect::<Vec<_>>(),
        "bug": std::env::var("SIM_BUG").ok(),
        "stall_p99_ms": percentile(0.99),
        "stall_max_ms": stalls.last().copied().unwrap_or(0),
        "steps": steps,
        "steps_per_s": (steps as f64 / elapsed.max(1e-9)).round(),
        "seconds": (elapsed * 10.0).round() / 10.0,
    });
    println!("{line}");
    if !failures.is_empty() {
        std::process::exit(1);
    }
    Ok(())
}
