//! The handler's span continues the job's trace: `sluice.worker.handle`,
//! with its attributes, in the trace the producer's span started.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{SdkTracerProvider, SpanData, SpanExporter};
use sluice_client::{JobBuilder, Producer, TraceContext, Worker, HANDLE_SPAN};
use sluice_e2e::{test_config, Stack};
use sluice_proto::v1 as pb;
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::layer::SubscriberExt as _;

use crate::*;

/// Keeps every finished span.
#[derive(Clone, Debug, Default)]
struct Collect(Arc<Mutex<Vec<SpanData>>>);

impl SpanExporter for Collect {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        self.0.lock().unwrap().extend(batch);
        Ok(())
    }
}

// The subscriber is process-wide; nextest runs each test in its own process.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_handler_runs_in_a_span_of_the_jobs_trace() -> anyhow::Result<()> {
    let spans = Collect::default();
    let provider = SdkTracerProvider::builder().with_simple_exporter(spans.clone()).build();
    let subscriber = tracing_subscriber::registry()
        .with(tracing_subscriber::EnvFilter::new("info"))
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("sdk-test")));
    if tracing::subscriber::set_global_default(subscriber).is_err() {
        // Another test of this process installed its subscriber first (plain
        // `cargo test`); `cargo nextest` gives every test its own process.
        eprintln!("skipped: a global tracing subscriber is already installed; run with cargo nextest");
        return Ok(());
    }

    let stack = Stack::start(test_config("sdk_trace", &[])?, 1).await?;
    let seen_in_handler: Arc<Mutex<Option<TraceContext>>> = Arc::default();
    let handler = {
        let seen = seen_in_handler.clone();
        move |_job: sluice_client::Job| {
            let seen = seen.clone();
            async move {
                *seen.lock().unwrap() = Some(TraceContext::current());
                Ok(())
            }
        }
    };
    let worker = RunningWorker::start(
        Worker::builder(client_options(&stack), handler)
            .task_group("default")
            .worker_id("traced")
            .build()?,
    );
    wait_assigned(&[&worker], usize::try_from(stack.config.kafka.partitions.admitted)?).await?;

    let producer = Producer::new(&client_options(&stack))?;
    let producing = tracing::info_span!("test.produce");
    let trace_id = producing.context().span().span_context().trace_id();
    let request = JobBuilder::new("acme", "default").job_id("traced-job").build()?;
    producer.enqueue(request).instrument(producing.clone()).await?;
    drop(producing);
    let client = stack.admission_client().await?;
    sluice_e2e::wait_status(&client, "traced-job", pb::JobStatus::Succeeded, Duration::from_secs(30)).await?;
    worker.stop().await;
    stack.stop().await;

    let in_handler = seen_in_handler.lock().unwrap().clone().expect("the handler ran");
    let handle = spans
        .0
        .lock()
        .unwrap()
        .iter()
        .find(|span| span.name == HANDLE_SPAN)
        .cloned()
        .expect("a sluice.worker.handle span was exported");
    let attribute = |name: &str| {
        handle
            .attributes
            .iter()
            .find(|pair| pair.key.as_str() == name)
            .map(|pair| pair.value.to_string())
    };
    println!(
        "producer trace {trace_id}; handler saw {in_handler:?}; handle span {} parent {} attributes {:?}",
        handle.span_context.trace_id(),
        handle.parent_span_id,
        handle.attributes
    );
    assert_eq!(
        handle.span_context.trace_id(),
        trace_id,
        "the handler's span is in the job's trace"
    );
    assert!(in_handler.traceparent.contains(&trace_id.to_string()), "{in_handler:?}");
    assert_eq!(attribute("job_id").as_deref(), Some("traced-job"));
    assert_eq!(attribute("attempt").as_deref(), Some("1"));
    assert_eq!(attribute("tenant").as_deref(), Some("acme"));
    assert_eq!(attribute("task_group").as_deref(), Some("default"));
    assert_eq!(attribute("outcome").as_deref(), Some("succeeded"));
    Ok(())
}
