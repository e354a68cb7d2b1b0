//! One trace per job: an in-process OTLP receiver (opentelemetry-proto's
//! `TraceServiceServer` on 127.0.0.1:0) collects what every service exports
//! for one job that waits on a concurrency limit and then on a rate limit,
//! on the real broker and PostgreSQL, and the test checks the trace's shape.
//! Spans also reach a collector over TLS. Its own test binary: telemetry is
//! initialised once per process (nextest runs each test in a process).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::metrics::v1::metrics_service_server::{
    MetricsService, MetricsServiceServer,
};
use opentelemetry_proto::tonic::collector::metrics::v1::{ExportMetricsServiceRequest, ExportMetricsServiceResponse};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use sluice_common::telemetry;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

/// A span as received, with the name of the tracer (scope) that made it.
#[derive(Clone, Debug)]
struct Received {
    scope: String,
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent_span_id: String,
    start_ns: u64,
    end_ns: u64,
    attributes: HashMap<String, String>,
}

#[derive(Default, Clone)]
struct Receiver {
    spans: Arc<Mutex<Vec<Received>>>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(text)) => text.clone(),
        Some(Value::IntValue(number)) => number.to_string(),
        Some(Value::BoolValue(flag)) => flag.to_string(),
        Some(Value::DoubleValue(number)) => number.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.spans.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .as_ref()
                .and_then(|resource| {
                    resource
                        .attributes
                        .iter()
                        .find(|attribute| attribute.key == "service.name")
                })
                .map(|attribute| text(attribute.value.as_ref().and_then(|value| value.value.as_ref())))
                .unwrap_or_default();
            for scope_spans in resource_spans.scope_spans {
                let scope = scope_spans.scope.map(|scope| scope.name).unwrap_or_default();
                for span in scope_spans.spans {
                    spans.push(Received {
                        scope: scope.clone(),
                        service: service.clone(),
                        name: span.name,
                        trace_id: hex(&span.trace_id),
                        span_id: hex(&span.span_id),
                        parent_span_id: hex(&span.parent_span_id),
                        start_ns: span.start_time_unix_nano,
                        end_ns: span.end_time_unix_nano,
                        attributes: span
                            .attributes
                            .into_iter()
                            .map(|attribute| {
                                let value = text(attribute.value.as_ref().and_then(|value| value.value.as_ref()));
                                (attribute.key, value)
                            })
                            .collect(),
                    });
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

/// Takes the services' OTLP metrics and drops them (this test is about traces).
struct MetricsSink;

#[tonic::async_trait]
impl MetricsService for MetricsSink {
    async fn export(
        &self,
        _request: tonic::Request<ExportMetricsServiceRequest>,
    ) -> Result<tonic::Response<ExportMetricsServiceResponse>, tonic::Status> {
        Ok(tonic::Response::new(ExportMetricsServiceResponse {
            partial_success: None,
        }))
    }
}

async fn start_receiver() -> anyhow::Result<(Receiver, String)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let receiver = Receiver::default();
    let service = TraceServiceServer::new(receiver.clone());
    tokio::spawn(async move {
        let _ = tonic::transport::Server::builder()
            .add_service(service)
            .add_service(MetricsServiceServer::new(MetricsSink))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await;
    });
    Ok((receiver, endpoint))
}

fn trace_id_of(context: &pb::TraceContext) -> String {
    context.traceparent.split('-').nth(1).unwrap_or_default().to_string()
}

fn span_id_of(context: &pb::TraceContext) -> String {
    context.traceparent.split('-').nth(2).unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_job_is_one_trace_across_every_service() -> anyhow::Result<()> {
    std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
    // The worker's span is a `tracing` span at INFO: a quieter RUST_LOG
    // would filter it out of the trace.
    std::env::remove_var("RUST_LOG");
    let (receiver, otlp_endpoint) = start_receiver().await?;
    let config = test_config(
        "trace",
        &[
            ("telemetry.otlp_endpoint", otlp_endpoint.as_str()),
            ("telemetry.sampling_ratio", "1.0"),
            ("telemetry.metrics_listen", ""),
        ],
    )?;
    let guard = telemetry::init(&config.telemetry, "sluice-trace-test")?;
    assert!(guard.exporting(), "an OTLP exporter with an endpoint");
    let stack = Stack::start(config, 1).await?;
    // The worker is the Rust SDK's: its handler span joins the job's trace.
    let options = sluice_client::ClientOptions {
        brokers: stack.config.kafka.brokers.clone(),
        topic_prefix: stack.config.kafka.topic_prefix.clone(),
        requested_topic: stack.config.topics.requested.clone(),
        admitted_topic_prefix: stack.config.topics.admitted_prefix.clone(),
        refresh_tasks_topic: stack.config.topics.refresh_tasks.clone(),
        admission_endpoint: stack.admissions[0].endpoint.clone(),
        refresh_endpoint: stack.refresh_dispatchers[0].endpoint.clone(),
        group_id: "workers".to_string(),
        fetch_wait_max_ms: 25,
        ..Default::default()
    };
    // The blocker runs until the test releases it, once the traced job is
    // seen waiting behind it; the traced job works for 1 s.
    let (release_blocker, blocker_released) = tokio::sync::watch::channel(false);
    let worker = sluice_client::Worker::builder(options, move |job: sluice_client::Job| {
        let mut released = blocker_released.clone();
        async move {
            if job.job_id() == "blocker" {
                let _ = released.wait_for(|released| *released).await;
            } else {
                // The traced job's work: its handler span lasts 1 s.
                tokio::time::sleep(Duration::from_millis(1_000)).await;
            }
            Ok(())
        }
    })
    .task_group("default")
    .worker_id("tracer")
    .build()?;
    let stop = tokio_util::sync::CancellationToken::new();
    let worker_task = tokio::spawn(worker.run(stop.clone()));

    // The blocker holds the concurrency key until the traced job waits
    // behind it, and a TryAcquire made just before the blocker goes holds
    // the only unit of its rate window for 3 s: the traced job waits on
    // both, in that order.
    let job = |payload: &str| {
        let mut request = concurrency_job("acme", "traced", 1, 0, payload);
        request
            .limits
            .extend(rate_job("acme", "traced-rate", 1, 3_000, "").limits);
        request
    };
    let admission = stack.admission_client().await?;
    enqueue_with_id(
        &admission,
        "blocker",
        concurrency_job("acme", "traced", 1, 0, "blocker"),
    )
    .await?;
    wait_status(&admission, "blocker", pb::JobStatus::Running, Duration::from_secs(30)).await?;

    // The producer's span is the root; its context rides in the Kafka headers.
    let now = std::time::SystemTime::now();
    let producer = telemetry::record_span(
        "test-producer",
        "producer.send",
        &pb::TraceContext::default(),
        now,
        now,
        Vec::new,
    );
    let trace_id = trace_id_of(&producer);
    assert_eq!(trace_id.len(), 32, "the producer span is sampled: {producer:?}");
    let mut traced = job("traced");
    traced.job_id = Some("traced".to_string());
    RequestProducer::new(&stack.config)?
        .send_messages(vec![RawRequest {
            partition: None,
            key: Some(b"traced".to_vec()),
            payload: prost::Message::encode_to_vec(&traced),
            headers: telemetry::trace_headers(&producer),
        }])
        .await?;
    eventually(
        Duration::from_secs(60),
        "the traced job waiting behind the blocker",
        || async {
            Ok(job_view(&admission, "traced")
                .await
                .is_ok_and(|job| job.status == pb::JobStatus::Waiting as i32 && job.step == 0))
        },
    )
    .await?;
    let seen_waiting_ns = unix_nanos();
    // The rate window's only unit is taken now, just before the blocker
    // goes (taken earlier, a slow enqueue could outlast the window): the
    // job's rate step, right after its concurrency step, waits for it.
    let rate_taken_ns = unix_nanos();
    let taken = stack
        .rates_client()
        .await?
        .try_acquire(pb::TryAcquireRequest {
            tenant: "acme".to_string(),
            limit: rate_job("acme", "traced-rate", 1, 3_000, "").limits[0]
                .kind
                .as_ref()
                .and_then(|kind| match kind {
                    pb::limit::Kind::Rate(rate) => Some(rate.clone()),
                    _ => None,
                }),
            cost: 1,
        })
        .await?
        .into_inner();
    assert!(taken.allowed, "the rate window's only unit is taken: {taken:?}");
    release_blocker.send_replace(true);
    wait_status(&admission, "traced", pb::JobStatus::Succeeded, Duration::from_secs(60)).await?;

    // Everything of the job's trace reaches the receiver. Spans arrive in the
    // order they end, not the order of the job's path: the worker's handler
    // span ends after its Complete call returns, so after admission's
    // `admission.complete`. Wait for every span the checks below look at.
    let expected = [
        "producer.send",
        "admission.enqueue",
        "limit-grant.grant",
        "rate-window.grant",
        "admission.admit",
        sluice_client::HANDLE_SPAN,
        "admission.complete",
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let spans = loop {
        guard.flush();
        let spans: Vec<Received> = receiver
            .spans
            .lock()
            .unwrap()
            .iter()
            .filter(|span| span.trace_id == trace_id)
            .cloned()
            .collect();
        let waits = spans.iter().filter(|span| span.name == "sluice.wait").count();
        if waits >= 2 && expected.iter().all(|name| spans.iter().any(|span| span.name == *name)) {
            break spans;
        }
        assert!(std::time::Instant::now() < deadline, "trace incomplete: {spans:#?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let all_spans = receiver.spans.lock().unwrap().clone();
    let blocker_spans = all_spans
        .iter()
        .filter(|span| span.attributes.get("sluice.job_id").map(String::as_str) == Some("blocker"))
        .count();
    assert!(blocker_spans > 0, "the blocker has spans of its own");
    assert!(
        all_spans
            .iter()
            .filter(|span| span.attributes.get("sluice.job_id").map(String::as_str) == Some("blocker"))
            .all(|span| span.trace_id != trace_id),
        "another job's spans are in another trace"
    );

    let named = |name: &str| -> Vec<&Received> { spans.iter().filter(|span| span.name == name).collect() };
    let one = |name: &str| -> &Received {
        let found = named(name);
        assert_eq!(found.len(), 1, "one {name} span: {spans:#?}");
        found[0]
    };
    let producer_span = one("producer.send");
    assert_eq!(producer_span.span_id, span_id_of(&producer));
    assert_eq!(producer_span.parent_span_id, "", "the producer's span is the root");

    // admission's span hangs under the producer's and is the job's parent span.
    let enqueue = one("admission.enqueue");
    assert_eq!(enqueue.scope, "sluice-admission");
    assert_eq!(enqueue.parent_span_id, producer_span.span_id);
    assert_eq!(enqueue.attributes["sluice.job_id"], "traced");

    // One wait span per limit, in chain order, with the wait's facts.
    let waits = named("sluice.wait");
    assert_eq!(waits.len(), 2, "{waits:#?}");
    let wait_of = |kind: &str| -> &Received {
        waits
            .iter()
            .find(|span| span.attributes.get("sluice.limit_kind").map(String::as_str) == Some(kind))
            .unwrap_or_else(|| panic!("no {kind} wait: {waits:#?}"))
    };
    let concurrency_wait = wait_of("LIMIT_KIND_CONCURRENCY");
    let rate_wait = wait_of("LIMIT_KIND_RATE");
    for wait in [concurrency_wait, rate_wait] {
        assert_eq!(wait.scope, "sluice-admission");
        assert_eq!(wait.parent_span_id, enqueue.span_id);
        assert_eq!(wait.attributes["sluice.tenant"], "acme");
        assert_eq!(wait.attributes["sluice.outcome"], "granted");
        assert_eq!(wait.attributes["sluice.position_at_enqueue"], "0");
    }
    assert_eq!(concurrency_wait.attributes["sluice.key"], "traced");
    assert_eq!(concurrency_wait.attributes["sluice.max"], "1");
    assert_eq!(rate_wait.attributes["sluice.key"], "inline:traced-rate:");
    assert_eq!(rate_wait.attributes["sluice.max"], "1");
    let millis = |span: &Received| (span.end_ns.saturating_sub(span.start_ns)) / 1_000_000;
    // The wait spans the moment the test saw the job waiting, up to the
    // blocker's release (clocks of one process; 5 ms of rounding to ms).
    assert!(
        concurrency_wait.start_ns <= seen_waiting_ns + 5_000_000 && concurrency_wait.end_ns + 5_000_000 >= seen_waiting_ns,
        "the concurrency wait covers the time the job was seen waiting behind the blocker: {concurrency_wait:?}, seen at {seen_waiting_ns}"
    );
    // The rate wait ends when the window gives its unit back, 3 s after the
    // test took it (rate-window's clock is anchored to PostgreSQL's, on this
    // machine: 50 ms for the anchoring and the rounding to ms).
    assert!(
        rate_wait.end_ns + 50_000_000 >= rate_taken_ns + 3_000_000_000,
        "waited for the rate slot until the window gave it back: {} ms, ended {} ms after the unit was taken",
        millis(rate_wait),
        (rate_wait.end_ns.saturating_sub(rate_taken_ns)) / 1_000_000
    );
    assert!(
        rate_wait.start_ns >= concurrency_wait.end_ns.saturating_sub(5_000_000),
        "rate limits are acquired after concurrency keys"
    );

    // The owners' decisions, under the job's span.
    let limit_grant = one("limit-grant.grant");
    assert_eq!(limit_grant.scope, "sluice-limit-grant");
    assert_eq!(limit_grant.parent_span_id, enqueue.span_id);
    assert_eq!(limit_grant.attributes["sluice.key"], "traced");
    let rate_grant = one("rate-window.grant");
    assert_eq!(rate_grant.scope, "sluice-rate-window");
    assert_eq!(rate_grant.parent_span_id, enqueue.span_id);

    // The admitted message's span, the SDK worker's handler span under it
    // (context from the message's headers), then the completion under the
    // handler (context from the Complete call's metadata).
    let admit = one("admission.admit");
    assert_eq!(admit.parent_span_id, enqueue.span_id);
    let handle = one(sluice_client::HANDLE_SPAN);
    assert_eq!(handle.parent_span_id, admit.span_id, "{handle:#?}");
    assert_eq!(handle.attributes["job_id"], "traced");
    assert_eq!(handle.attributes["outcome"], "succeeded");
    assert!(millis(handle) >= 900, "the handler ran 1 s: {} ms", millis(handle));
    let complete = one("admission.complete");
    assert_eq!(complete.attributes["sluice.status"], "JOB_STATUS_SUCCEEDED");
    assert_eq!(
        complete.parent_span_id, handle.span_id,
        "the completion hangs under the worker's span: {complete:#?}"
    );
    assert!(spans.iter().all(|span| !span.service.is_empty()), "service.name is set");

    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), worker_task).await;
    stack.stop().await;
    drop(guard);
    Ok(())
}

fn unix_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// An `https://` collector: spans are exported over TLS, trusting
/// `telemetry.otlp_ca_file`; without the CA file startup refuses the
/// endpoint, naming the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_https_collector_trusting_the_configured_ca() -> anyhow::Result<()> {
    use sluice_e2e::pki::{folder, new_pki, serve_over_tls, server_tls, write_pki};

    std::env::remove_var("OTEL_EXPORTER_OTLP_ENDPOINT");
    std::env::remove_var("RUST_LOG");
    let folder = folder("otlp")?;
    let pki = new_pki("collector")?;
    let (cert, key, ca) = write_pki(&folder, &pki)?;
    let receiver = Receiver::default();
    let mut routes = tonic::service::RoutesBuilder::default();
    routes
        .add_service(TraceServiceServer::new(receiver.clone()))
        .add_service(MetricsServiceServer::new(MetricsSink));
    let stop = sluice_common::Shutdown::new();
    let otlp_endpoint = serve_over_tls(routes, &server_tls(&cert, &key, "", Duration::from_secs(10)), &stop).await?;

    let without_ca = test_config(
        "otlpnoca",
        &[
            ("telemetry.otlp_endpoint", otlp_endpoint.as_str()),
            ("telemetry.metrics_listen", ""),
        ],
    )?;
    let refused = telemetry::init(&without_ca.telemetry, "sluice-otlp-test").err();
    assert!(
        refused
            .as_ref()
            .is_some_and(|error| error.to_string().contains("telemetry.otlp_ca_file")),
        "{refused:?}"
    );

    let config = test_config(
        "otlptls",
        &[
            ("telemetry.otlp_endpoint", otlp_endpoint.as_str()),
            ("telemetry.otlp_ca_file", ca.as_str()),
            ("telemetry.sampling_ratio", "1.0"),
            ("telemetry.metrics_listen", ""),
        ],
    )?;
    let guard = telemetry::init(&config.telemetry, "sluice-otlp-test")?;
    assert!(guard.exporting());
    tracing::info_span!("over.tls").in_scope(|| tracing::info!("a span for the collector"));
    eventually(Duration::from_secs(30), "the span received over TLS", || {
        guard.flush();
        let receiver = receiver.clone();
        async move {
            Ok(receiver
                .spans
                .lock()
                .unwrap()
                .iter()
                .any(|span| span.name == "over.tls"))
        }
    })
    .await?;
    stop.trigger();
    std::fs::remove_dir_all(folder)?;
    Ok(())
}
