//! `make bench`: Sluice's throughput and latency on this machine, against the
//! real broker and PostgreSQL, next to a plain Kafka relay on the same broker.
//! Prints its figures as one JSON object on the last line.
//!
//! Environment: BENCH_JOBS (20000), BENCH_KEYS (1000), BENCH_LIMIT (5),
//! BENCH_FETCH_WAIT_MS (5), BENCH_LATENCY_JOBS (300), BENCH_HOT_JOBS (3000),
//! BENCH_WIDE_JOBS (20000, over 100,000 keys), BENCH_RESEND_WAITING_AFTER
//! (60s: `admission.resend_waiting_after`; the default, 12s, re-sends a
//! large backlog's acquires while it drains), BENCH_BROKER_PID (the broker's
//! process, for its CPU time; `scripts/bench.sh` sets it), BENCH_BACKLOG
//! (100000: waiting jobs for `BENCH_ONLY=backlog`, resident memory per
//! waiting job).
//!
//! CPU time per job is split by process: `sluice` is this process (the four
//! services, and the bench's own producer and workers), `postgres` every
//! PostgreSQL process, `broker` the broker. They are read from /proc over the
//! 1,000-key run, as are PostgreSQL's rows written and WAL bytes.
//!
//! The pipeline figures (issue 30) repeat the main stream-worker run:
//! `admitted_jobs_per_s_one_partition` with one partition of `jobs.requested`,
//! `sluice.jobs` and `sluice.limit-commands` (each a stage whose task waits
//! for its own commit before its next batch), and `one_partition_share` that
//! over the main run's figure; `admitted_jobs_per_s_1_thread` and
//! `admitted_jobs_per_s_2_threads` with 1 and 2 runtime worker threads, each
//! in a child process of this binary (`BENCH_ONLY=stream`, with
//! `TOKIO_WORKER_THREADS` in its environment: the whole stack runs on this
//! binary's runtime), and `thread_gain` the second over the first. Issue 30
//! targets, on 2 cores, a share of at least 0.5 and a gain of at least 1.6.
//!
//! `BENCH_ONLY` runs one part and prints its own JSON line: `main`, `hot`,
//! `latency`, `waiters`, `flows`, `backlog`, `stream` (the main stream-worker
//! run alone, with the runtime threads it ran with) and `pipeline` (an
//! all-partition run, then the pipeline figures).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use prost::Message as _;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message;
use sluice_common::kafka::{client_config, ensure_topics, TopicSpec};
use sluice_common::{Shutdown, SluiceConfig};
use sluice_e2e::*;
use sluice_proto::v1 as pb;
use sluice_proto::v1::admission_client::AdmissionClient;

/// Kafka hops on one job's path before the hot path moved to links (request, acquire, grant,
/// admitted, release): the relay is kept as a fixed reference of what the
/// broker alone moves through that many hops. Today a job crosses the broker
/// once with stream workers (its request) and twice with Kafka workers
/// (request, admitted).
const HOPS_PER_JOB: usize = 5;

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}

/// Resident memory of this process, in bytes.
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|field| field.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// CPU time used so far, in microseconds, by the processes the bench
/// splits its figures by.
#[derive(Clone, Copy, Debug, Default)]
struct CpuTimes {
    sluice_us: f64,
    postgres_us: f64,
    broker_us: f64,
}

impl CpuTimes {
    fn total(&self) -> f64 {
        self.sluice_us + self.postgres_us + self.broker_us
    }
}

/// User plus system time of one process, in microseconds (0 if it is gone).
fn process_cpu_us(pid: &str) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The command name (field 2) may hold spaces; the fields after it are
    // fixed: utime and stime are the 12th and 13th after the closing paren.
    let Some((_, after_name)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|index| fields.get(*index).and_then(|field| field.parse::<u64>().ok()))
        .sum();
    // Linux reports these in USER_HZ, 100 per second.
    to_f64(ticks) * 10_000.0
}

fn cpu_times() -> CpuTimes {
    let mut postgres_us = 0.0;
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(pid) = name
                .to_str()
                .filter(|pid| pid.bytes().all(|byte| byte.is_ascii_digit()))
            else {
                continue;
            };
            let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
            if comm.trim() == "postgres" {
                postgres_us += process_cpu_us(pid);
            }
        }
    }
    let broker_us = std::env::var("BENCH_BROKER_PID")
        .map(|pid| process_cpu_us(pid.trim()))
        .unwrap_or(0.0);
    CpuTimes {
        sluice_us: process_cpu_us("self"),
        postgres_us,
        broker_us,
    }
}

/// PostgreSQL's WAL position, in bytes.
async fn wal_position(pool: &sqlx::PgPool) -> anyhow::Result<i64> {
    let position: Option<i64> = sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint")
        .fetch_one(pool)
        .await?;
    Ok(position.unwrap_or(0))
}

/// Memory limit-grant keeps per waiting job: `waiters` acquires of one key
/// limited to 1 (one holder, the rest waiting), each with a UUID job id and
/// a W3C trace context, applied in batches as the owner runtime does. Returns
/// the growth of resident memory per waiter (run first, in a fresh process).
fn run_waiter_memory(waiters: u64) -> f64 {
    use sluice_limit_grant::core::Decided;
    let mut partition = core_partition();
    let resident_before = resident_bytes();
    let mut out = Decided::new();
    for index in 0..waiters {
        let job_id = uuid::Uuid::new_v5(&uuid::Uuid::NAMESPACE_OID, &index.to_le_bytes()).to_string();
        let command = pb::LimitCommand {
            trace: Some(pb::TraceContext {
                traceparent: format!("00-{:032x}-{:016x}-01", u128::from(index) + 1, index + 1),
                tracestate: String::new(),
            }),
            sent_at_ms: 0,
            command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
                key: Some(pb::KeyRef {
                    tenant: "bench".to_string(),
                    key: "one-key".to_string(),
                }),
                ticket: Some(pb::TicketId {
                    job_id,
                    attempt: 1,
                    step: 0,
                }),
                priority: 50,
                enqueued_at_us: i64::try_from(index).unwrap_or(i64::MAX),
                limit: Some(pb::acquire_ticket::Limit::MaxConcurrency(1)),
                fairness_key: String::new(),
                shadow: false,
            })),
        };
        let _ = partition.apply_command(1_000, command, &mut out);
        if index % 4_000 == 3_999 {
            // What a commit and a publish let go of.
            out = Decided::new();
        }
    }
    drop(out);
    let resident = resident_bytes().saturating_sub(resident_before);
    assert_eq!(
        partition.waiting_on("bench", "one-key"),
        usize::try_from(waiters - 1).unwrap_or(0)
    );
    to_f64(resident) / to_f64(waiters)
}

fn core_partition() -> sluice_limit_grant::core::LimitPartition {
    sluice_limit_grant::core::LimitPartition::new(
        sluice_limit_grant::core::PartitionSettings {
            partition: 0,
            limit_partitions: 1,
            grants_partitions: 1,
            refresh_due_topic: Arc::from("refresh-due"),
            refresh_due_partitions: 1,
            max_message_bytes: 1_000_000,
            ticket_grace_ms: 30_000,
            input: sluice_common::validate::InputLimits::default(),
        },
        1,
    )
}

fn flow_ticket(job_id: &str) -> Option<pb::TicketId> {
    Some(pb::TicketId {
        job_id: job_id.to_string(),
        attempt: 1,
        step: 0,
    })
}

fn flow_key() -> Option<pb::KeyRef> {
    Some(pb::KeyRef {
        tenant: "bench".to_string(),
        key: "shared".to_string(),
    })
}

/// What a grant costs in limit-grant's core when the key's waiters are
/// spread over `flows` flows (fair sharing by weighted deficit round-robin):
/// `waiters` acquires of one key limited to 1, round-robin over the flows;
/// then, `cycles` times, the holder is released and the next waiter is
/// granted. Returns nanoseconds per release-and-grant (the release command
/// applied, the grant decided and its event written; decoding the grant to
/// find the next holder is not counted).
fn run_grant_by_flows(flows: u64, waiters: u64, cycles: u64) -> anyhow::Result<f64> {
    use sluice_limit_grant::core::Decided;
    let mut partition = core_partition();
    let mut out = Decided::new();
    for index in 0..waiters {
        let command = pb::LimitCommand {
            trace: None,
            sent_at_ms: 0,
            command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
                key: flow_key(),
                ticket: flow_ticket(&format!("job-{index}")),
                priority: 50,
                enqueued_at_us: i64::try_from(index).unwrap_or(i64::MAX),
                limit: Some(pb::acquire_ticket::Limit::MaxConcurrency(1)),
                fairness_key: format!("customer-{}", index % flows),
                shadow: false,
            })),
        };
        partition
            .apply_command(1_000, command, &mut out)
            .map_err(|error| anyhow::anyhow!(error))?;
    }
    let mut holder = "job-0".to_string();
    let mut spent = Duration::ZERO;
    for _ in 0..cycles {
        out = Decided::new();
        let release = pb::LimitCommand {
            trace: None,
            sent_at_ms: 0,
            command: Some(pb::limit_command::Command::Release(pb::ReleaseTicket {
                key: flow_key(),
                ticket: flow_ticket(&holder),
                reason: pb::ReleaseReason::Succeeded as i32,
                run_ms: None,
            })),
        };
        let started = Instant::now();
        partition
            .apply_command(2_000, release, &mut out)
            .map_err(|error| anyhow::anyhow!(error))?;
        spent += started.elapsed();
        let granted = out
            .sends
            .take_links()
            .into_values()
            .flatten()
            .find_map(|event| pb::GrantEvent::decode(event.as_slice()).ok())
            .and_then(|event| event.ticket)
            .context("a release of the holder granted nobody")?;
        holder = granted.job_id;
    }
    Ok(spent.as_secs_f64() * 1e9 / to_f64(cycles))
}

/// `grant_ns_by_flows`: the grant cost with 1, 100 and 10,000 flows on one
/// key (100,000 waiters, 50,000 grants each).
fn run_grants_by_flows() -> anyhow::Result<serde_json::Value> {
    let mut figures = serde_json::Map::new();
    for flows in [1u64, 100, 10_000] {
        let ns = run_grant_by_flows(flows, 100_000, 50_000)?;
        eprintln!("bench: {ns:.0} ns per release and grant with {flows} flows");
        figures.insert(flows.to_string(), serde_json::json!(ns.round()));
    }
    Ok(serde_json::Value::Object(figures))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let only = std::env::var("BENCH_ONLY").unwrap_or_default();
    if only == "backlog" {
        let overrides = [("kafka.partitions.limit_commands", "8"), ("kafka.partitions.jobs", "8")];
        let figures = run_backlog_memory(&overrides, env_number("BENCH_BACKLOG", 100_000)).await?;
        println!("{figures}");
        return Ok(());
    }
    let jobs = env_number("BENCH_JOBS", 20_000);
    let keys = env_number("BENCH_KEYS", 1_000);
    let limit = u32::try_from(env_number("BENCH_LIMIT", 5))?;
    let fetch_wait_ms = env_number("BENCH_FETCH_WAIT_MS", 5);
    let latency_jobs = env_number("BENCH_LATENCY_JOBS", 300);
    let fetch_wait = fetch_wait_ms.to_string();
    let resend_waiting_after = std::env::var("BENCH_RESEND_WAITING_AFTER").unwrap_or_else(|_| "60s".to_string());
    let overrides: Vec<(&str, &str)> = vec![
        ("kafka.fetch_wait_max_ms", fetch_wait.as_str()),
        ("kafka.partitions.requested", "4"),
        ("kafka.partitions.admitted", "4"),
        ("kafka.partitions.limit_commands", "8"),
        ("kafka.partitions.jobs", "8"),
        ("postgres.max_connections", "16"),
        ("admission.resend_waiting_after", resend_waiting_after.as_str()),
        ("admission.claim_timeout", "120s"),
        ("limit_grant.ticket_grace", "60s"),
        ("admission.stand_behind_interval", "20s"),
    ];

    let main = MainRun {
        overrides: &overrides,
        jobs,
        keys,
        limit,
    };
    if only == "stream" {
        // The child of `run_in_child`: the main stream-worker run alone.
        let run = main.measure("bench", Partitions::All).await?;
        println!(
            "{}",
            serde_json::json!({
                "admitted_jobs_per_s": round(run.throughput.jobs_per_s),
                "cpu_us_per_job": run.cpu_json(),
                "runtime_threads": tokio::runtime::Handle::current().metrics().num_workers(),
            })
        );
        return Ok(());
    }
    if only == "pipeline" {
        eprintln!("bench: end to end, {jobs} jobs over {keys} keys with limit {limit}, stream workers, all partitions");
        let all = main.measure("bench", Partitions::All).await?;
        let pipeline = run_pipeline(&main).await?;
        let mut figures = serde_json::json!({
            "admitted_jobs_per_s": round(all.throughput.jobs_per_s),
            "jobs": jobs,
            "keys": keys,
            "limit": limit,
        });
        pipeline.insert_into(&mut figures, all.throughput.jobs_per_s);
        println!("{figures}");
        return Ok(());
    }
    let waiter_count = env_number("BENCH_WAITERS", 200_000);
    eprintln!("bench: memory per waiting job in limit-grant ({waiter_count} waiters on one key)");
    let bytes_per_waiter = run_waiter_memory(waiter_count);
    eprintln!("bench: {bytes_per_waiter:.0} resident bytes per waiter");
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "flows") {
        let grant_ns_by_flows = run_grants_by_flows()?;
        println!("{}", serde_json::json!({ "grant_ns_by_flows": grant_ns_by_flows }));
        return Ok(());
    }
    if std::env::var("BENCH_ONLY").is_ok_and(|only| only == "waiters") {
        println!(
            "{}",
            serde_json::json!({"bytes_per_waiter": bytes_per_waiter.round(), "waiters": waiter_count})
        );
        return Ok(());
    }

    let hot_jobs = env_number("BENCH_HOT_JOBS", 3_000);
    let wide_jobs = env_number("BENCH_WIDE_JOBS", 20_000);
    if only == "hot" {
        let stream = run_hot_key(&overrides, hot_jobs, limit, Workers::Stream).await?;
        let kafka = run_hot_key(&overrides, hot_jobs, limit, Workers::Kafka).await?;
        println!(
            "{}",
            serde_json::json!({"hot_key_jobs_per_s": round(stream), "kafka_workers": {"hot_key_jobs_per_s": round(kafka)}})
        );
        return Ok(());
    }
    if only == "latency" {
        let stream = run_latency_on_stack(&overrides, latency_jobs, Workers::Stream).await?;
        let kafka = run_latency_on_stack(&overrides, latency_jobs, Workers::Kafka).await?;
        println!(
            "{}",
            serde_json::json!({
                "release_to_admit_p50_ms": round(percentile(&stream, 0.50)),
                "release_to_admit_p99_ms": round(percentile(&stream, 0.99)),
                "kafka_workers": {
                    "release_to_admit_p50_ms": round(percentile(&kafka, 0.50)),
                    "release_to_admit_p99_ms": round(percentile(&kafka, 0.99)),
                },
            })
        );
        return Ok(());
    }
    eprintln!("bench: end to end, {jobs} jobs over {keys} keys with limit {limit}, stream workers (fetch.wait.max.ms={fetch_wait_ms})");
    let main_run = main.measure("bench", Partitions::All).await?;
    eprintln!("bench: end to end, the same with Kafka workers (jobs.admitted + Claim)");
    let kafka_run = run_measured(&overrides, "benchkafka", jobs, keys, limit, Workers::Kafka).await?;
    if only == "main" {
        println!(
            "{}",
            serde_json::json!({
                "admitted_jobs_per_s": round(main_run.throughput.jobs_per_s),
                "cpu_us_per_job": main_run.cpu_json(),
                "pg_rows_per_job": main_run.pg_rows_per_job,
                "wal_bytes_per_job": main_run.wal_bytes_per_job,
                "kafka_workers": kafka_run.json(),
            })
        );
        return Ok(());
    }
    let pipeline = run_pipeline(&main).await?;
    eprintln!("bench: end to end, {wide_jobs} jobs over 100000 keys with limit {limit}, stream workers");
    let wide_stack = Stack::start(bench_config("benchwide", &overrides)?, 1).await?;
    let wide_run = run_throughput(&wide_stack, wide_jobs, 100_000, limit, Workers::Stream).await?;
    eprintln!("bench: {:.0} admitted jobs/s over 100000 keys", wide_run.jobs_per_s);
    let wide_config = wide_stack.config.clone();
    let wide_pool = wide_stack.pool.clone();
    wide_stack.stop().await;
    cleanup(&wide_config, &wide_pool).await;

    let hot_stream = run_hot_key(&overrides, hot_jobs, limit, Workers::Stream).await?;
    let hot_kafka = run_hot_key(&overrides, hot_jobs, limit, Workers::Kafka).await?;
    let latencies = run_latency_on_stack(&overrides, latency_jobs, Workers::Stream).await?;
    let kafka_latencies = run_latency_on_stack(&overrides, latency_jobs, Workers::Kafka).await?;

    eprintln!("bench: TryAcquire decisions over gRPC on loopback");
    let rate_stack = Stack::start(bench_config("benchrate", &overrides)?, 1).await?;
    let grpc_decisions = run_try_acquire_grpc(&rate_stack, Duration::from_secs(5)).await?;
    rate_stack.stop().await;
    eprintln!("bench: TryAcquire decisions in process (the window core, one thread)");
    let in_process_decisions = run_try_acquire_in_process(20_000_000);

    eprintln!("bench: plain relay, {jobs} messages through {HOPS_PER_JOB} consume->produce hops");
    let relay = run_relay(&main_run.config, jobs).await?;

    let mut kafka_figures = kafka_run.json();
    kafka_figures["hot_key_jobs_per_s"] = serde_json::json!(round(hot_kafka));
    kafka_figures["release_to_admit_p50_ms"] = serde_json::json!(round(percentile(&kafka_latencies, 0.50)));
    kafka_figures["release_to_admit_p99_ms"] = serde_json::json!(round(percentile(&kafka_latencies, 0.99)));
    let mut figures = serde_json::json!({
        "admitted_jobs_per_s": round(main_run.throughput.jobs_per_s),
        "jobs": jobs,
        "keys": keys,
        "limit": limit,
        "workers": "stream",
        "cpu_us_per_job": main_run.cpu_json(),
        "pg_rows_per_job": main_run.pg_rows_per_job,
        "wal_bytes_per_job": main_run.wal_bytes_per_job,
        "admitted_jobs_per_s_100k_keys": round(wide_run.jobs_per_s),
        "cpu_us_per_job_100k_keys": round(wide_run.cpu_us_per_job.total()),
        "hot_key_jobs_per_s": round(hot_stream),
        "release_to_admit_p50_ms": round(percentile(&latencies, 0.50)),
        "release_to_admit_p99_ms": round(percentile(&latencies, 0.99)),
        "kafka_workers": kafka_figures,
        "relay_jobs_per_s": round(relay),
        "hops_per_job": HOPS_PER_JOB,
        "ratio_to_relay": (main_run.throughput.jobs_per_s / relay * 1000.0).round() / 1000.0,
        "fetch_wait_max_ms": fetch_wait_ms,
        "try_acquire_per_s_in_process": in_process_decisions.round(),
        "try_acquire_per_s_grpc": grpc_decisions.round(),
        "bytes_per_waiter": bytes_per_waiter.round(),
        "waiters": waiter_count,
        "grant_ns_by_flows": run_grants_by_flows()?,
    });
    pipeline.insert_into(&mut figures, main_run.throughput.jobs_per_s);
    println!("{figures}");
    Ok(())
}

/// A throughput run on a stack of its own, with PostgreSQL's writes.
struct MeasuredRun {
    throughput: ThroughputRun,
    pg_rows_per_job: f64,
    wal_bytes_per_job: f64,
    config: Arc<SluiceConfig>,
}

impl MeasuredRun {
    fn cpu_json(&self) -> serde_json::Value {
        let cpu = self.throughput.cpu_us_per_job;
        serde_json::json!({
            "total": round(cpu.total()),
            "sluice": round(cpu.sluice_us),
            "postgres": round(cpu.postgres_us),
            "broker": round(cpu.broker_us),
        })
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "admitted_jobs_per_s": round(self.throughput.jobs_per_s),
            "cpu_us_per_job": self.cpu_json(),
            "pg_rows_per_job": self.pg_rows_per_job,
            "wal_bytes_per_job": self.wal_bytes_per_job,
        })
    }
}

/// The main end-to-end run: `jobs` jobs over `keys` keys of limit `limit`,
/// stream workers, on a stack with `overrides`.
struct MainRun<'a> {
    overrides: &'a [(&'a str, &'a str)],
    jobs: u64,
    keys: u64,
    limit: u32,
}

/// How many partitions the main run's stack has on a job's path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Partitions {
    /// The main run's counts.
    All,
    /// One partition in each stage of a stream-worker job's path whose task
    /// waits for its own commit before it takes its next batch
    /// (`ONE_PARTITION`).
    One,
}

/// The partition counts `Partitions::One` sets to 1: `jobs.requested` (its
/// reader hands a batch over and waits until the job partition saved it),
/// `sluice.jobs` (admission's job partitions) and `sluice.limit-commands`
/// (limit-grant's). `jobs.admitted.<group>` keeps its count: stream workers
/// get their jobs on `Work` streams, not from it.
const ONE_PARTITION: [&str; 3] = [
    "kafka.partitions.requested",
    "kafka.partitions.jobs",
    "kafka.partitions.limit_commands",
];

impl MainRun<'_> {
    async fn measure(&self, name: &str, partitions: Partitions) -> anyhow::Result<MeasuredRun> {
        let overrides: Vec<(&str, &str)> = match partitions {
            Partitions::All => self.overrides.to_vec(),
            Partitions::One => self
                .overrides
                .iter()
                .copied()
                .filter(|(key, _)| !ONE_PARTITION.contains(key))
                .chain(ONE_PARTITION.iter().map(|key| (*key, "1")))
                .collect(),
        };
        run_measured(&overrides, name, self.jobs, self.keys, self.limit, Workers::Stream).await
    }
}

/// Issue 30's pipeline figures: the main stream-worker run with one
/// partition (`Partitions::One`), and with 1 and with 2 runtime threads.
struct Pipeline {
    one_partition: f64,
    one_thread: f64,
    two_threads: f64,
}

impl Pipeline {
    /// Add the figures to `figures`, with `all_partitions` (the main run's
    /// admitted jobs/s) for `one_partition_share`.
    fn insert_into(&self, figures: &mut serde_json::Value, all_partitions: f64) {
        figures["admitted_jobs_per_s_one_partition"] = serde_json::json!(round(self.one_partition));
        figures["one_partition_share"] = serde_json::json!(ratio(self.one_partition, all_partitions));
        figures["admitted_jobs_per_s_1_thread"] = serde_json::json!(round(self.one_thread));
        figures["admitted_jobs_per_s_2_threads"] = serde_json::json!(round(self.two_threads));
        figures["thread_gain"] = serde_json::json!(ratio(self.two_threads, self.one_thread));
    }
}

/// `part / whole` to 3 decimals (0 when `whole` is not positive).
fn ratio(part: f64, whole: f64) -> f64 {
    if whole > 0.0 {
        (part / whole * 1000.0).round() / 1000.0
    } else {
        0.0
    }
}

async fn run_pipeline(main: &MainRun<'_>) -> anyhow::Result<Pipeline> {
    eprintln!(
        "bench: end to end, the main stream-worker run with one partition ({})",
        ONE_PARTITION.join(", ")
    );
    let one_partition = main.measure("benchone", Partitions::One).await?;
    let one_thread = run_in_child(1).await?;
    let two_threads = run_in_child(2).await?;
    Ok(Pipeline {
        one_partition: one_partition.throughput.jobs_per_s,
        one_thread,
        two_threads,
    })
}

/// The main stream-worker run (`BENCH_ONLY=stream`) in a child process of
/// this binary whose runtime has `threads` worker threads: `#[tokio::main]`
/// sets no count, so tokio's multi-thread runtime takes it from
/// `TOKIO_WORKER_THREADS`. The child inherits the environment (the broker,
/// `BENCH_JOBS`, ...) and stderr; its last line on stdout is its JSON, which
/// says how many worker threads it ran with. Returns its admitted jobs/s.
async fn run_in_child(threads: usize) -> anyhow::Result<f64> {
    eprintln!("bench: end to end, the main stream-worker run in a child process with {threads} runtime thread(s)");
    let program = std::env::current_exe().context("find this bench's own executable")?;
    let child = tokio::process::Command::new(program)
        .env("BENCH_ONLY", "stream")
        .env("TOKIO_WORKER_THREADS", threads.to_string())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("start the bench in a child process")?;
    // `Command::output` would capture stderr as well; this keeps it inherited.
    let output = child.wait_with_output().await.context("wait for the child bench")?;
    anyhow::ensure!(
        output.status.success(),
        "the child bench with {threads} runtime thread(s) failed: {}",
        output.status
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout
        .lines()
        .rev()
        .find(|line| !line.trim().is_empty())
        .context("the child bench printed nothing on stdout")?;
    let figures: serde_json::Value =
        serde_json::from_str(last).with_context(|| format!("the child bench's last line is not JSON: {last}"))?;
    let ran_with = figures["runtime_threads"].as_u64();
    anyhow::ensure!(
        ran_with == Some(u64::try_from(threads)?),
        "the child bench ran with {ran_with:?} runtime threads, not {threads}"
    );
    figures["admitted_jobs_per_s"]
        .as_f64()
        .with_context(|| format!("no admitted_jobs_per_s in the child bench's line: {last}"))
}

async fn run_measured(
    overrides: &[(&str, &str)],
    name: &str,
    jobs: u64,
    keys: u64,
    limit: u32,
    workers: Workers,
) -> anyhow::Result<MeasuredRun> {
    let mut stack = Stack::start(bench_config(name, overrides)?, 1).await?;
    let writes_before = pg_writes(&stack).await?;
    let wal_before = wal_position(&stack.pool).await?;
    let throughput = run_throughput(&stack, jobs, keys, limit, workers).await?;
    eprintln!(
        "bench: {:.0} admitted jobs/s ({workers:?} workers)",
        throughput.jobs_per_s
    );
    let config = stack.config.clone();
    stack.stop_nodes().await;
    let writes_after = pg_writes(&stack).await?;
    let wal_after = wal_position(&stack.pool).await?;
    let pg_rows_per_job = (to_f64(writes_after - writes_before) / to_f64(jobs) * 100.0).round() / 100.0;
    let wal_bytes_per_job = (to_f64(u64::try_from(wal_after - wal_before).unwrap_or(0)) / to_f64(jobs)).round();
    cleanup(&config, &stack.pool).await;
    let cpu = throughput.cpu_us_per_job;
    eprintln!(
        "bench: CPU per job {:.0} us (sluice {:.0}, postgres {:.0}, broker {:.0}); {pg_rows_per_job:.2} rows and {wal_bytes_per_job:.0} WAL bytes per job",
        cpu.total(),
        cpu.sluice_us,
        cpu.postgres_us,
        cpu.broker_us
    );
    Ok(MeasuredRun {
        throughput,
        pg_rows_per_job,
        wal_bytes_per_job,
        config,
    })
}

async fn run_hot_key(overrides: &[(&str, &str)], jobs: u64, limit: u32, workers: Workers) -> anyhow::Result<f64> {
    eprintln!("bench: one hot key, limit {limit}, {jobs} jobs, {workers:?} workers that finish at once");
    let stack = Stack::start(bench_config("benchhot", overrides)?, 1).await?;
    let run = run_throughput(&stack, jobs, 1, limit, workers).await?;
    eprintln!("bench: {:.0} jobs/s through one key", run.jobs_per_s);
    let config = stack.config.clone();
    let pool = stack.pool.clone();
    stack.stop().await;
    cleanup(&config, &pool).await;
    Ok(run.jobs_per_s)
}

async fn run_latency_on_stack(overrides: &[(&str, &str)], jobs: u64, workers: Workers) -> anyhow::Result<Vec<f64>> {
    eprintln!("bench: release-to-admit latency on a saturated key ({jobs} jobs, {workers:?} workers)");
    let stack = Stack::start(bench_config("benchlatency", overrides)?, 1).await?;
    let latencies = match workers {
        Workers::Stream => run_stream_latency(&stack, jobs).await?,
        Workers::Kafka => run_latency(&stack, jobs).await?,
    };
    eprintln!(
        "bench: release to the next receipt p50 {:.1} ms, p99 {:.1} ms",
        percentile(&latencies, 0.50),
        percentile(&latencies, 0.99)
    );
    let config = stack.config.clone();
    let pool = stack.pool.clone();
    stack.stop().await;
    cleanup(&config, &pool).await;
    Ok(latencies)
}

fn to_f64(value: u64) -> f64 {
    // Counts here stay far below 2^52.
    #[allow(clippy::cast_precision_loss)]
    let converted = value as f64;
    converted
}

fn round(value: f64) -> f64 {
    (value * 10.0).round() / 10.0
}

fn percentile(sorted: &[f64], quantile: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let index = ((sorted.len() - 1) as f64 * quantile).round() as usize;
    sorted[index.min(sorted.len() - 1)]
}

/// Rows inserted, updated and deleted in the bench's schemas so far.
async fn pg_writes(stack: &Stack) -> anyhow::Result<u64> {
    // Statistics reach the shared counters when backends report; stopped
    // nodes have closed their connections, which flushes them.
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&stack.pool)
        .await?;
    let total: Option<i64> = sqlx::query_scalar(
        "SELECT sum(n_tup_ins + n_tup_upd + n_tup_del)::bigint FROM pg_stat_user_tables WHERE starts_with(schemaname, $1)",
    )
    .bind(&stack.config.postgres.schema_prefix)
    .fetch_one(&stack.pool)
    .await?;
    Ok(u64::try_from(total.unwrap_or(0)).unwrap_or(0))
}

fn consumer(config: &SluiceConfig, group: &str, topic: &str) -> anyhow::Result<StreamConsumer> {
    let mut settings = client_config(&config.kafka);
    settings
        .set("group.id", group)
        .set("auto.offset.reset", "earliest")
        .set("fetch.wait.max.ms", config.kafka.fetch_wait_max_ms.to_string())
        .set("fetch.min.bytes", "1");
    let consumer: StreamConsumer = settings.create()?;
    consumer.subscribe(&[topic])?;
    Ok(consumer)
}

/// Workers that claim and complete at once, in batches.
async fn batch_worker(
    config: Arc<SluiceConfig>,
    endpoint: String,
    group: String,
    worker_id: String,
    completed: Arc<AtomicU64>,
    stop: Shutdown,
) -> anyhow::Result<()> {
    let consumer = consumer(&config, &group, &config.admitted_topic("default"))?;
    let mut admission = AdmissionClient::new(connect(&endpoint).await?);
    loop {
        let first = tokio::select! {
            _ = stop.cancelled() => return Ok(()),
            received = consumer.recv() => received?,
        };
        let mut batch = vec![pb::AdmittedJob::decode(first.payload().unwrap_or_default())?];
        drop(first);
        while batch.len() < 500 {
            match tokio::time::timeout(Duration::from_millis(1), consumer.recv()).await {
                Ok(received) => {
                    let message = received?;
                    batch.push(pb::AdmittedJob::decode(message.payload().unwrap_or_default())?);
                }
                Err(_) => break,
            }
        }
        let claimed = admission
            .claim(pb::ClaimRequest {
                worker_id: worker_id.clone(),
                jobs: batch
                    .iter()
                    .map(|job| pb::JobAttempt {
                        job_id: job.job_id.clone(),
                        attempt: job.attempt,
                    })
                    .collect(),
            })
            .await?
            .into_inner();
        let completions: Vec<pb::Completion> = claimed
            .results
            .into_iter()
            .filter(|result| result.outcome == pb::ClaimOutcome::Claimed as i32)
            .map(|result| pb::Completion {
                job_id: result.job_id,
                attempt: result.attempt,
                outcome: Some(pb::completion::Outcome::Success(pb::Success {})),
            })
            .collect();
        if completions.is_empty() {
            continue;
        }
        let count = u64::try_from(completions.len())?;
        admission
            .complete(pb::CompleteRequest {
                worker_id: worker_id.clone(),
                completions,
            })
            .await?;
        completed.fetch_add(count, Ordering::Relaxed);
    }
}

/// What one throughput run measured.
struct ThroughputRun {
    jobs_per_s: f64,
    /// CPU time per job from the first request sent to the last completion.
    cpu_us_per_job: CpuTimes,
}

/// How the bench's workers get admitted jobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Workers {
    /// The SDK worker on `Work` streams: jobs pushed already claimed.
    Stream,
    /// `jobs.admitted.default` in a consumer group, then `Claim`.
    Kafka,
}

/// Four SDK workers on `Work` streams whose handlers return at once,
/// counting the jobs they run.
fn start_stream_workers(
    stack: &Stack,
    completed: &Arc<AtomicU64>,
    stop: &Shutdown,
    concurrency: usize,
) -> anyhow::Result<()> {
    for index in 0..4 {
        let options = sluice_client::ClientOptions {
            brokers: String::new(),
            admission_endpoint: stack.admissions[0].endpoint.clone(),
            ..sluice_client::ClientOptions::default()
        };
        let counted = completed.clone();
        let worker = sluice_client::Worker::builder(options, move |_job: sluice_client::Job| {
            counted.fetch_add(1, Ordering::Relaxed);
            async { Ok(()) }
        })
        .task_group("default")
        .worker_id(format!("bench-stream-{index}"))
        .concurrency(concurrency)
        .transport(sluice_client::Transport::Stream)
        .build()?;
        let token = sluice_client::CancellationToken::new();
        let stop = stop.clone();
        let cancel = token.clone();
        tokio::spawn(async move {
            stop.cancelled().await;
            cancel.cancel();
        });
        tokio::spawn(worker.run(token));
    }
    Ok(())
}

async fn run_throughput(
    stack: &Stack,
    jobs: u64,
    keys: u64,
    limit: u32,
    workers: Workers,
) -> anyhow::Result<ThroughputRun> {
    let completed = Arc::new(AtomicU64::new(0));
    let stop = Shutdown::new();
    match workers {
        Workers::Kafka => {
            let group = format!("{}bench-workers", stack.config.kafka.topic_prefix);
            for index in 0..4 {
                tokio::spawn(batch_worker(
                    stack.config.clone(),
                    stack.admissions[0].endpoint.clone(),
                    group.clone(),
                    format!("bench-worker-{index}"),
                    completed.clone(),
                    stop.clone(),
                ));
            }
        }
        Workers::Stream => start_stream_workers(stack, &completed, &stop, 1000)?,
    }
    // Let the worker group settle (or the streams open) before the clock
    // starts.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let requests: Vec<pb::JobRequest> = (0..jobs)
        .map(|index| {
            let key = format!("key-{}", index % keys);
            concurrency_job("bench", &key, limit, 50, &format!("{index}"))
        })
        .collect();
    let producer = RequestProducer::new(&stack.config)?;
    let cpu_before = cpu_times();
    let started = Instant::now();
    producer.send(&requests).await?;
    eprintln!(
        "bench: {jobs} requests sent in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    // A progress line every 10 s, so a run that stalls shows where.
    let mut reported_at = Instant::now();
    eventually(Duration::from_secs(600), "every bench job completed", || {
        let done = completed.load(Ordering::Relaxed);
        if reported_at.elapsed() >= Duration::from_secs(10) {
            reported_at = Instant::now();
            eprintln!(
                "bench: {done} of {jobs} jobs completed after {:.0} s",
                started.elapsed().as_secs_f64()
            );
        }
        async move { Ok(done >= jobs) }
    })
    .await?;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu_after = cpu_times();
    stop.trigger();
    let per_job = |before: f64, after: f64| (after - before) / to_f64(jobs);
    Ok(ThroughputRun {
        jobs_per_s: to_f64(jobs) / elapsed,
        cpu_us_per_job: CpuTimes {
            sluice_us: per_job(cpu_before.sluice_us, cpu_after.sluice_us),
            postgres_us: per_job(cpu_before.postgres_us, cpu_after.postgres_us),
            broker_us: per_job(cpu_before.broker_us, cpu_after.broker_us),
        },
    })
}

/// Resident memory per waiting job (`BENCH_ONLY=backlog`): `jobs` jobs on
/// one key limited to 1, enqueued over gRPC with no worker, so all but one
/// wait (in admission's job partitions and in limit-grant's key queue).
/// The growth of this process's resident memory (the four services) from
/// before the enqueue to when limit-grant holds them all, divided by the
/// jobs. Run in a fresh process (`BENCH_ONLY=waiters` gives limit-grant's
/// core alone, in a process of its own).
async fn run_backlog_memory(overrides: &[(&str, &str)], jobs: u64) -> anyhow::Result<serde_json::Value> {
    let stack = Stack::start(bench_config("benchbacklog", overrides)?, 1).await?;
    let mut admission = stack.admission_client().await?;
    let resident_before = resident_bytes();
    let started = Instant::now();
    let mut index = 0u64;
    while index < jobs {
        let end = (index + 1_000).min(jobs);
        let requests: Vec<pb::JobRequest> = (index..end)
            .map(|job| concurrency_job("bench", "backlog", 1, 50, &format!("backlog-{job}")))
            .collect();
        admission
            .enqueue_batch(pb::EnqueueBatchRequest { jobs: requests })
            .await
            .context("enqueue backlog jobs")?;
        index = end;
    }
    let limits = stack.limits_client().await?;
    eventually(Duration::from_secs(600), "limit-grant holds every backlog job", || {
        let mut limits = limits.clone();
        async move {
            let state = limits
                .describe_key(pb::DescribeKeyRequest {
                    key: Some(pb::KeyRef {
                        tenant: "bench".to_string(),
                        key: "backlog".to_string(),
                    }),
                    ticket: None,
                    first_waiters: 1,
                })
                .await?
                .into_inner()
                .state
                .unwrap_or_default();
            Ok(u64::from(state.waiting) + u64::try_from(state.holders.len())? == jobs)
        }
    })
    .await?;
    let enqueued_s = started.elapsed().as_secs_f64();
    let resident_after = resident_bytes();
    let stack_bytes_per_job = to_f64(resident_after.saturating_sub(resident_before)) / to_f64(jobs);
    eprintln!(
        "bench: {jobs} waiting jobs in {enqueued_s:.1} s; resident memory {:.0} MB -> {:.0} MB: {stack_bytes_per_job:.0} bytes per waiting job",
        to_f64(resident_before) / 1e6,
        to_f64(resident_after) / 1e6,
    );
    let config = stack.config.clone();
    let pool = stack.pool.clone();
    stack.stop().await;
    cleanup(&config, &pool).await;
    Ok(serde_json::json!({
        "waiting_jobs": jobs,
        "resident_bytes_per_waiting_job": stack_bytes_per_job.round(),
    }))
}

/// The saturated key's jobs (limit 1), enqueued and all queued.
async fn fill_saturated_key(stack: &Stack, jobs: u64) -> anyhow::Result<()> {
    let requests: Vec<pb::JobRequest> = (0..jobs)
        .map(|index| concurrency_job("bench", "saturated", 1, 50, &format!("lat-{index}")))
        .collect();
    let mut admission = stack.admission_client().await?;
    admission
        .enqueue_batch(pb::EnqueueBatchRequest { jobs: requests })
        .await
        .context("enqueue latency jobs")?;
    let limits = stack.limits_client().await?;
    eventually(Duration::from_secs(120), "the saturated key's queue filled", || {
        let mut limits = limits.clone();
        async move {
            let state = limits
                .describe_key(pb::DescribeKeyRequest {
                    key: Some(pb::KeyRef {
                        tenant: "bench".to_string(),
                        key: "saturated".to_string(),
                    }),
                    ticket: None,
                    first_waiters: 1,
                })
                .await?
                .into_inner()
                .state
                .unwrap_or_default();
            Ok(u64::from(state.waiting) + u64::try_from(state.holders.len())? == jobs)
        }
    })
    .await
}

/// A release to the next job's receipt by the worker, on one saturated key
/// (limit 1), with the SDK worker on `Work` streams: measured from the
/// handler's return (the SDK then completes on the stream) to the next
/// handler's start.
async fn run_stream_latency(stack: &Stack, jobs: u64) -> anyhow::Result<Vec<f64>> {
    fill_saturated_key(stack, jobs).await?;
    let released_at: Arc<std::sync::Mutex<Option<Instant>>> = Arc::default();
    let latencies: Arc<std::sync::Mutex<Vec<f64>>> = Arc::default();
    let received = Arc::new(AtomicU64::new(0));
    let options = sluice_client::ClientOptions {
        brokers: String::new(),
        admission_endpoint: stack.admissions[0].endpoint.clone(),
        ..sluice_client::ClientOptions::default()
    };
    let handler = {
        let released_at = released_at.clone();
        let latencies = latencies.clone();
        let received = received.clone();
        move |_job: sluice_client::Job| {
            let now = Instant::now();
            if let Some(at) = released_at
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .take()
            {
                latencies
                    .lock()
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .push(now.duration_since(at).as_secs_f64() * 1000.0);
            }
            received.fetch_add(1, Ordering::Relaxed);
            let released_at = released_at.clone();
            async move {
                *released_at.lock().unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(Instant::now());
                Ok(())
            }
        }
    };
    let worker = sluice_client::Worker::builder(options, handler)
        .task_group("default")
        .worker_id("latency")
        .concurrency(1)
        .transport(sluice_client::Transport::Stream)
        .build()?;
    let stop = sluice_client::CancellationToken::new();
    let running = tokio::spawn(worker.run(stop.clone()));
    eventually(Duration::from_secs(120), "every latency job received", || {
        let received = received.clone();
        async move { Ok(received.load(Ordering::Relaxed) >= jobs) }
    })
    .await?;
    stop.cancel();
    let _ = running.await;
    let mut latencies = latencies
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
        .clone();
    latencies.sort_by(f64::total_cmp);
    Ok(latencies)
}

/// Completion to the next admission on one saturated key (limit 1).
async fn run_latency(stack: &Stack, jobs: u64) -> anyhow::Result<Vec<f64>> {
    fill_saturated_key(stack, jobs).await?;
    let mut admission = stack.admission_client().await?;
    let consumer = consumer(
        &stack.config,
        &format!("{}latency-worker", stack.config.kafka.topic_prefix),
        &stack.config.admitted_topic("default"),
    )?;
    let mut latencies = Vec::with_capacity(usize::try_from(jobs)?);
    let mut released_at: Option<Instant> = None;
    let mut done = 0;
    while done < jobs {
        let message = tokio::time::timeout(Duration::from_secs(60), consumer.recv())
            .await
            .context("no admitted job for 60s")??;
        let job = pb::AdmittedJob::decode(message.payload().unwrap_or_default())?;
        if !String::from_utf8_lossy(&job.payload).starts_with("lat-") {
            continue;
        }
        if let Some(at) = released_at.take() {
            latencies.push(at.elapsed().as_secs_f64() * 1000.0);
        }
        let claimed = admission
            .claim(pb::ClaimRequest {
                worker_id: "latency".to_string(),
                jobs: vec![pb::JobAttempt {
                    job_id: job.job_id.clone(),
                    attempt: job.attempt,
                }],
            })
            .await?
            .into_inner();
        if claimed.results.first().map(|result| result.outcome) != Some(pb::ClaimOutcome::Claimed as i32) {
            continue;
        }
        released_at = Some(Instant::now());
        admission
            .complete(pb::CompleteRequest {
                worker_id: "latency".to_string(),
                completions: vec![pb::Completion {
                    job_id: job.job_id,
                    attempt: job.attempt,
                    outcome: Some(pb::completion::Outcome::Success(pb::Success {})),
                }],
            })
            .await?;
        done += 1;
    }
    latencies.sort_by(f64::total_cmp);
    Ok(latencies)
}

/// Decisions per second of the sliding window itself on one thread: cost-1
/// requests against 1,000,000 per second, the clock advancing 1 ms every
/// 1,000 calls (so nearly all are granted and the window slides).
fn run_try_acquire_in_process(decisions: u64) -> f64 {
    use sluice_rate_window::window::{SlidingWindow, WindowSpec};
    let Ok(spec) = WindowSpec::new(1_000_000, 1000) else {
        return 0.0;
    };
    let mut window = SlidingWindow::new(spec);
    let started = Instant::now();
    let mut allowed = 0u64;
    for index in 0..decisions {
        let now_ms = i64::try_from(index / 1000).unwrap_or(i64::MAX);
        if matches!(
            window.try_acquire(now_ms, 1),
            Ok(sluice_rate_window::window::Decision::Granted { .. })
        ) {
            allowed += 1;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    std::hint::black_box(allowed);
    to_f64(decisions) / elapsed
}

/// TryAcquire decisions per second over gRPC on loopback: concurrent callers
/// on 16 keys with a generous limit, so most answers are grants, each durable
/// before it is returned.
async fn run_try_acquire_grpc(stack: &Stack, duration: Duration) -> anyhow::Result<f64> {
    let rates = stack.rates_client().await?;
    let decisions = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + duration;
    let mut callers = tokio::task::JoinSet::new();
    for caller in 0..64u64 {
        let mut client = rates.clone();
        let decisions = decisions.clone();
        callers.spawn(async move {
            let request = pb::TryAcquireRequest {
                tenant: "bench".to_string(),
                limit: Some(pb::RateLimit {
                    spec: Some(pb::rate_limit::Spec::Inline(pb::InlineRateLimit {
                        name: format!("plain-{}", caller % 16),
                        unique_key: String::new(),
                        limit: 10_000_000,
                        duration_ms: 1000,
                        cost: 1,
                    })),
                }),
                cost: 1,
            };
            while Instant::now() < deadline {
                if client.try_acquire(request.clone()).await.is_ok() {
                    decisions.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
    }
    let started = Instant::now();
    while callers.join_next().await.is_some() {}
    Ok(to_f64(decisions.load(Ordering::Relaxed)) / started.elapsed().as_secs_f64())
}

/// A plain consume->produce relay with `HOPS_PER_JOB` hops, same broker and
/// fetch settings: `messages` messages of ~120 bytes.
async fn run_relay(config: &SluiceConfig, messages: u64) -> anyhow::Result<f64> {
    let prefix = unique_prefix("relay");
    let topics: Vec<String> = (0..=HOPS_PER_JOB).map(|hop| format!("{prefix}relay-{hop}")).collect();
    let specs: Vec<TopicSpec> = topics
        .iter()
        .map(|name| TopicSpec {
            name: name.clone(),
            partitions: 8,
            internal: false,
        })
        .collect();
    ensure_topics(&config.kafka, &specs, true).await?;
    let producer: FutureProducer = {
        let mut settings = client_config(&config.kafka);
        settings
            .set("linger.ms", config.kafka.linger_ms.to_string())
            .set("batch.size", "1000000")
            .set("queue.buffering.max.messages", "1000000");
        settings.create()?
    };
    let stop = Shutdown::new();
    let arrived = Arc::new(AtomicU64::new(0));
    // Stage i reads relay-i and writes relay-(i+1); the last topic is counted.
    for hop in 0..HOPS_PER_JOB {
        let input = consumer(config, &format!("{prefix}stage-{hop}"), &topics[hop])?;
        let output = topics[hop + 1].clone();
        let producer = producer.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    _ = stop.cancelled() => return,
                    received = input.recv() => match received { Ok(message) => message, Err(_) => continue },
                };
                let payload = message.payload().unwrap_or_default().to_vec();
                let key = message.key().unwrap_or_default().to_vec();
                drop(message);
                let mut record = FutureRecord::<[u8], [u8]>::to(&output).payload(&payload).key(&key);
                loop {
                    match producer.send_result(record) {
                        Ok(_delivery) => break,
                        Err((_, returned)) => {
                            record = returned;
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                }
            }
        });
    }
    let sink = consumer(config, &format!("{prefix}sink"), &topics[HOPS_PER_JOB])?;
    {
        let arrived = arrived.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    received = sink.recv() => if received.is_ok() { arrived.fetch_add(1, Ordering::Relaxed); },
                }
            }
        });
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let payload = vec![b'x'; 120];
    let started = Instant::now();
    let mut by_key: HashMap<u64, Vec<u8>> = HashMap::new();
    for index in 0..messages {
        let key = by_key
            .entry(index % 1000)
            .or_insert_with(|| index.to_string().into_bytes());
        let mut record = FutureRecord::<[u8], [u8]>::to(&topics[0])
            .payload(&payload)
            .key(key.as_slice());
        loop {
            match producer.send_result(record) {
                Ok(_delivery) => break,
                Err((_, returned)) => {
                    record = returned;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        }
    }
    eventually(Duration::from_secs(600), "every relayed message arrived", || {
        let arrived = arrived.clone();
        async move { Ok(arrived.load(Ordering::Relaxed) >= messages) }
    })
    .await?;
    let elapsed = started.elapsed().as_secs_f64();
    stop.trigger();
    Ok(to_f64(messages) / elapsed)
}

/// The tests' configuration with production-like producer batching: the
/// benchmark runs on a fresh broker, and its consumers never fetch from
/// inside a batch (a task that is behind is not paused: issue 30).
fn bench_config(name: &str, overrides: &[(&str, &str)]) -> anyhow::Result<sluice_common::SluiceConfig> {
    let mut config = test_config(name, overrides)?;
    config.kafka.producer_properties.clear();
    Ok(config)
}
