//! Generated and mutated producer messages — protobuf and JSON,
//! valid, nearly valid and garbage — through admission's decode-and-validate
//! path (`consumers::check_message`), the dead letter built for each refusal,
//! and the saved row's fingerprint: nothing may panic, and every message must
//! end as a job or as a dead letter with a reason.
//!
//! How many: 200,000 in the dev profile `make test` builds (the crate is
//! not optimized there, to keep the first build short: about 40 s of CPU),
//! a million in an optimized build, or `SLUICE_FUZZ_CASES`.
//!
//! The generator is seeded (the seed is printed), so a failure reproduces:
//! `SLUICE_FUZZ_SEED=<seed> SLUICE_FUZZ_CASES=<n> cargo test -p sluice-admission fuzz`.

use rand::Rng;
use sluice_common::hostile::HostileRequests;
use sluice_common::SluiceConfig;

use crate::consumers::check_message;
use crate::effects::Routes;

#[test]
fn generated_and_mutated_requests_each_become_a_job_or_a_dead_letter_with_a_reason() {
    let config = SluiceConfig::load_with(None, &[]).expect("defaults load");
    let routes = Routes::from_config(&config);
    let cases: u64 = std::env::var("SLUICE_FUZZ_CASES")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) { 200_000 } else { 1_000_000 });
    let seed: u64 = std::env::var("SLUICE_FUZZ_SEED")
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| rand::rng().random());
    println!("fuzz seed {seed}, {cases} cases");
    let mut generator = HostileRequests::new(seed, config.admission.max_payload_bytes);
    let (mut jobs, mut dead_letters) = (0u64, 0u64);
    let mut classes = std::collections::BTreeMap::new();
    for case in 0..cases {
        let offset = i64::try_from(case).unwrap_or(i64::MAX);
        let message = generator.message(offset);
        match check_message(&config, "jobs.requested", &message) {
            Ok(job) => {
                jobs += 1;
                // What admission saves and sends for it.
                let mut spec = job.valid.request.clone();
                spec.payload = Vec::new();
                assert_eq!(
                    crate::jobs::request_fingerprint(&spec, &job.valid.request.payload).len(),
                    32
                );
                assert!(!job.job_id.is_empty());
                assert!(
                    job.valid.request.payload.len() + config.admitted_envelope_bytes()
                        <= config.kafka.max_message_bytes,
                    "an accepted job always fits in its admitted message"
                );
                assert!(!job.trace.traceparent.contains('\0'), "trace context is checked");
            }
            Err(refusal) => {
                dead_letters += 1;
                assert!(!refusal.reason.is_empty(), "case {case} (seed {seed}): a reason");
                *classes.entry(refusal.class.label()).or_insert(0u64) += 1;
                let letter = routes.dead_letter("jobs.requested", &message, refusal.class, &refusal.reason);
                let size = letter.payload.len()
                    + letter.key.as_ref().map_or(0, Vec::len)
                    + letter
                        .headers
                        .iter()
                        .map(|(name, value)| name.len() + value.len())
                        .sum::<usize>();
                assert!(
                    size <= config.kafka.max_message_bytes,
                    "case {case}: dead letter of {size} bytes"
                );
            }
        }
    }
    println!("{jobs} jobs, {dead_letters} dead letters by class {classes:?}");
    assert_eq!(jobs + dead_letters, cases);
    // The generator reaches both sides.
    assert!(jobs >= cases / 20, "too few valid jobs generated: {jobs}");
    assert!(dead_letters >= cases / 5, "too few refusals generated: {dead_letters}");
}
