//! Example producer: enqueues jobs of two task types on one concurrency key,
//! over gRPC (ids and statuses back) or over Kafka.
//!
//! ```sh
//! cargo run -p sluice-examples --bin sluice-example-producer -- --jobs 20 --limit 3
//! ```

use std::time::Duration;

use clap::{Parser, ValueEnum};
use sluice_client::{ClientOptions, JobBuilder, Producer, RetryPolicy};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Via {
    Grpc,
    Kafka,
}

#[derive(Debug, Parser)]
#[command(about = "Enqueue example jobs into Sluice")]
struct Args {
    #[arg(long, env = "SLUICE_BROKERS", default_value = "127.0.0.1:9092")]
    brokers: String,
    #[arg(long, env = "SLUICE_ADMISSION", default_value = "http://127.0.0.1:50051")]
    admission: String,
    /// The services' kafka.topic_prefix.
    #[arg(long, env = "SLUICE_TOPIC_PREFIX", default_value = "")]
    topic_prefix: String,
    #[arg(long, default_value_t = 20)]
    jobs: usize,
    #[arg(long, default_value = "example")]
    tenant: String,
    #[arg(long, default_value = "default")]
    task_group: String,
    /// Concurrency key every job names.
    #[arg(long, default_value = "example-key")]
    key: String,
    /// Max holders of the key.
    #[arg(long, default_value_t = 3)]
    limit: u32,
    /// How long each job's handler works, in ms.
    #[arg(long, default_value_t = 500)]
    work_ms: u64,
    #[arg(long, value_enum, default_value = "grpc")]
    via: Via,
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
        ..Default::default()
    };
    let producer = Producer::new(&options)?;
    for index in 0..args.jobs {
        // Every third job is a "report" (the worker example limits those per
        // process), the rest "thumbnail"s. The payload is "<type>:<ms>".
        let task_type = if index % 3 == 0 { "report" } else { "thumbnail" };
        let request = JobBuilder::new(&args.tenant, &args.task_group)
            .payload(format!("{task_type}:{}", args.work_ms))
            .priority(if task_type == "report" { 20 } else { 50 })
            .concurrency(&args.key, args.limit)
            .retry(RetryPolicy::attempts(3).backoff(Duration::from_millis(500), Duration::from_secs(30)))
            .build()?;
        match args.via {
            Via::Grpc => {
                let enqueued = producer.enqueue(request).await?;
                println!(
                    "enqueued {} ({task_type}): {:?}{}",
                    enqueued.job_id,
                    enqueued.status,
                    if enqueued.deduplicated { ", deduplicated" } else { "" }
                );
            }
            Via::Kafka => {
                let sent = producer.send(&request).await?;
                println!(
                    "sent a {task_type} job to partition {} offset {}",
                    sent.partition, sent.offset
                );
            }
        }
    }
    Ok(())
}
