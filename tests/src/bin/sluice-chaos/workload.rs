//! The jobs every run enqueues, and how long a worker runs each.

use rand::Rng;
use sluice_e2e::concurrency_job;
use sluice_proto::v1 as pb;

/// Every fifth job (but the floating ones) is a chain: its concurrency key,
/// then one unit of one of `RATE_KEYS` rate limits of `RATE_LIMIT` per
/// `RATE_WINDOW_MS`. It holds its key's slot while it waits for the rate
/// (rate limits come last in the acquisition order). Together they let
/// `RATE_KEYS × RATE_LIMIT` such jobs start per second: more than a fifth of
/// what the stack runs on two cores, so the rate is rarely what a key waits
/// for, and a wait on it counts as a stall only once the rate-window has the
/// step and the window is full (see `analysis`).
pub const RATE_LIMIT: i64 = 20;
pub const RATE_WINDOW_MS: i64 = 1000;
const RATE_KEYS: usize = 2;

pub fn rate_key_of(job: usize) -> Option<String> {
    (job % 5 == 3).then(|| format!("r{}", (job / 5) % RATE_KEYS))
}

/// One job in twenty also takes the floating limit `FLOATING_KEY` (default
/// max `FLOATING_DEFAULT_MAX`, refreshed every `FLOATING_REFRESH_MS` while it
/// has waiters) and runs longer, so that it has waiters: they come three
/// close together in every sixty (jobs 1, 2 and 4; never a rate-limited
/// one), and the default max is 1, so the first burst makes the key wait
/// whatever the workers' speed — spread one by one with a default of 2, a
/// run with fast workers could see the key never wait, and its check that
/// a refresh happened failed by chance (CI, 2026-11-27). The refresh worker
/// answers a max from 1 to `FLOATING_CEILING`. The floating key (a max of 2
/// on average once refreshed) is a serial chain, and it drains last: in the
/// runs of 2026-11-27 the other jobs had all started 26–30 s into a run
/// without faults and 47–58 s into one with faults, the floating key's last
/// job 42–50 s and 73–119 s in. So a run's `jobs_per_s`, and the throughput
/// ratio under chaos, are mostly the floating key's: each fault stalls its
/// chain for seconds, and the stalls add up.
pub const FLOATING_KEY: &str = "f0";
pub const FLOATING_DEFAULT_MAX: u32 = 1;
pub const FLOATING_CEILING: u32 = 3;
const FLOATING_REFRESH_MS: u64 = 1000;

pub fn is_floating(job: usize) -> bool {
    matches!(job % 60, 1 | 2 | 4)
}

/// How long a handler runs job `job`.
pub fn run_ms(job: usize) -> u64 {
    if is_floating(job) {
        rand::rng().random_range(100..300)
    } else {
        rand::rng().random_range(20..100)
    }
}

pub fn job_id(job: usize) -> String {
    format!("chaos-{job}")
}

/// The job index of `chaos-<n>`.
pub fn job_index(job_id: &str) -> Option<usize> {
    job_id.strip_prefix("chaos-")?.parse().ok()
}

/// Job `job`: on key `k<job % keys>` of `limit`, some also on a rate limit
/// or the floating limit, retried up to 100 attempts.
pub fn chaos_request(job: usize, keys: usize, limit: u32) -> pb::JobRequest {
    let mut request = concurrency_job("chaos", &format!("k{}", job % keys.max(1)), limit, 0, &job.to_string());
    request.job_id = Some(job_id(job));
    if let Some(name) = rate_key_of(job) {
        request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Rate(pb::RateLimit {
                spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
                    name,
                    unique_key: String::new(),
                    limit: RATE_LIMIT,
                    duration_ms: RATE_WINDOW_MS,
                    cost: 1,
                })),
            })),
        });
    }
    if is_floating(job) {
        request.limits.push(pb::Limit {
            kind: Some(pb::limit::Kind::Floating(pb::FloatingConcurrencyLimit {
                key: FLOATING_KEY.to_string(),
                default_max: FLOATING_DEFAULT_MAX,
                refresh_interval_ms: FLOATING_REFRESH_MS,
                metadata: Default::default(),
            })),
        });
    }
    // A killed or abandoning worker's attempt ends as a lease expiry, which
    // uses up an attempt: enough of them that faults never fail a job.
    request.retry = Some(pb::RetryPolicy {
        max_attempts: 100,
        initial_backoff: "100ms".to_string(),
        max_backoff: "1s".to_string(),
        ..pb::RetryPolicy::default()
    });
    request
}
