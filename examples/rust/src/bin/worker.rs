//! Example worker: runs the producer example's jobs ("<type>:<ms>"
//! payloads), at most `--concurrency` at once and at most
//! `--report-limit` reports per process; answers floating-limit refreshes;
//! drains on SIGTERM / Ctrl-C.
//!
//! ```sh
//! cargo run -p sluice-examples --bin sluice-example-worker -- --concurrency 4 --report-limit 1
//! ```

use std::time::{Duration, Instant};

use clap::Parser;
use sluice_client::proto::{AdmittedJob, RefreshTask};
use sluice_client::{shutdown_on_signals, ClientOptions, Job, JobError, RefreshError, Worker};

#[derive(Debug, Parser)]
#[command(about = "Run example jobs admitted by Sluice")]
struct Args {
    #[arg(long, env = "SLUICE_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    #[arg(long, env = "SLUICE_ADMISSION", default_value = "http://127.0.0.1:50051")]
    admission: String,
    #[arg(long, env = "SLUICE_REFRESH", default_value = "http://127.0.0.1:50054")]
    refresh: String,
    /// The services' kafka.topic_prefix.
    #[arg(long, env = "SLUICE_TOPIC_PREFIX", default_value = "")]
    topic_prefix: String,
    /// librdkafka fetch.wait.max.ms: small against tansu, 500 on Kafka.
    #[arg(long, default_value_t = 5)]
    fetch_wait_max_ms: u32,
    #[arg(long, default_value = "example-workers")]
    group: String,
    #[arg(long, default_value = "default")]
    task_group: String,
    #[arg(long, default_value_t = 4)]
    concurrency: usize,
    /// Reports running at once in this process.
    #[arg(long, default_value_t = 1)]
    report_limit: usize,
    /// The max the refresh handler answers for floating keys.
    #[arg(long, default_value_t = 4)]
    refresh_max: u32,
    /// Seconds running jobs get to finish on shutdown.
    #[arg(long, default_value_t = 30)]
    shutdown_grace_secs: u64,
}

/// "<type>:<ms>" payloads: the type names the job for per-process limits.
fn task_type(job: &AdmittedJob) -> String {
    String::from_utf8_lossy(&job.payload)
        .split(':')
        .next()
        .unwrap_or_default()
        .to_string()
}

async fn handle(job: Job) -> Result<(), JobError> {
    let payload = String::from_utf8_lossy(job.payload()).to_string();
    let work_ms: u64 = payload
        .rsplit(':')
        .next()
        .and_then(|text| text.parse().ok())
        .ok_or_else(|| JobError::fatal(format!("payload {payload:?} is not <type>:<ms>")))?;
    let began = Instant::now();
    println!(
        "start  {} attempt {} ({})",
        job.job_id(),
        job.attempt(),
        job.task_type()
    );
    tokio::select! {
        _ = tokio::time::sleep(Duration::from_millis(work_ms)) => {}
        // Stop early when cancelled (or the lease is lost, or shutdown ends the grace).
        _ = job.cancelled() => {
            println!("stop   {} ({:?})", job.job_id(), job.stop_reason());
            return Ok(());
        }
    }
    println!("finish {} after {:?}", job.job_id(), began.elapsed());
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let args = Args::parse();
    let options = ClientOptions {
        brokers: args.brokers,
        topic_prefix: args.topic_prefix,
        admission_endpoint: args.admission,
        refresh_endpoint: args.refresh,
        group_id: args.group,
        fetch_wait_max_ms: args.fetch_wait_max_ms,
        ..Default::default()
    };
    let refresh_max = args.refresh_max;
    let refresh = move |task: RefreshTask| async move {
        // A real handler would ask a quota API, using the key's metadata.
        println!(
            "refresh {:?} (current max {}, metadata {:?}) -> {refresh_max}",
            task.key, task.current_max, task.metadata
        );
        Ok::<u32, RefreshError>(refresh_max)
    };
    let worker = Worker::builder(options, handle)
        .task_group(args.task_group)
        .concurrency(args.concurrency)
        .task_type(task_type)
        .process_limit("report", args.report_limit)
        .refresh_handler(refresh)
        .shutdown_grace(Duration::from_secs(args.shutdown_grace_secs))
        .build()?;
    println!("worker {} running; Ctrl-C to drain", worker.worker_id());
    worker.run(shutdown_on_signals()).await?;
    Ok(())
}
