//! The simulation in `make test`: 1,000 seeds of the cluster under faults,
//! each checked for the guarantees after every step; a failure names its
//! seed (`SEED=<n> make sim` replays it). Also: a known bug put back is
//! found.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use sluice_sim::{run, Bug, SimConfig};

#[test]
fn a_thousand_seeds_keep_every_guarantee() {
    let config = SimConfig::default();
    let seeds: u64 = std::env::var("SIM_SEEDS")
        .ok()
        .and_then(|seeds| seeds.parse().ok())
        .unwrap_or(1000);
    let mut failed = Vec::new();
    for seed in 0..seeds {
        let report = run(seed, &config).unwrap();
        if let Some(violation) = report.violation {
            failed.push(format!("seed {seed}: {violation}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {seeds} seeds failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

#[test]
fn an_owner_answering_without_a_fenced_commit_is_found() {
    let config = SimConfig {
        bug: Some(Bug::AnswerWithoutFence),
        ..SimConfig::default()
    };
    let found = (0..1000).find_map(|seed| run(seed, &config).unwrap().violation.map(|violation| (seed, violation)));
    assert!(found.is_some(), "1,000 seeds did not find the bug");
}
