//! Telemetry, initialised once per process: `tracing` with an `EnvFilter`
//! (`RUST_LOG` wins over `telemetry.log_level`), text or JSON logs, and OTLP
//! trace export only when an endpoint is configured. W3C trace context is
//! injected into and extracted from Kafka headers, message entries and gRPC
//! metadata with the global propagator.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};
use sluice_proto::v1::TraceContext;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

use crate::config::{LogFormat, TelemetryConfig};

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid log filter {filter:?}: {message}")]
    Filter { filter: String, message: String },
    #[error("cannot build the OTLP exporter for {endpoint}: {message}")]
    Exporter { endpoint: String, message: String },
}

/// Flushes and stops the exporter when dropped (at process exit).
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether an OTLP exporter was started.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(error) = provider.shutdown() {
                eprintln!("telemetry: flushing traces at exit failed: {error}");
            }
        }
    }
}

/// The OTLP endpoint in force: configuration first, then the standard env var.
pub fn otlp_endpoint(config: &TelemetryConfig) -> Option<String> {
    if !config.otlp_endpoint.trim().is_empty() {
        return Some(config.otlp_endpoint.trim().to_string());
    }
    std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .map(|value| value.trim().to_string())
        .filter(|value| !value.is_empty())
}

/// Install the global subscriber. A second call in one process (tests,
/// `sluice dev`) keeps the first subscriber and still returns a guard.
pub fn init(config: &TelemetryConfig, service_name: &str) -> Result<TelemetryGuard, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter_text = std::env::var("RUST_LOG").unwrap_or_else(|_| config.log_level.clone());
    let filter = EnvFilter::try_new(&filter_text).map_err(|error| TelemetryError::Filter {
        filter: filter_text.clone(),
        message: error.to_string(),
    })?;
    let fmt_layer = match config.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer().with_target(true).boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_current_span(true)
            .flatten_event(true)
            .boxed(),
    };
    let provider = match otlp_endpoint(config) {
        Some(endpoint) => Some(build_provider(&endpoint, config.sampling_ratio, service_name)?),
        None => None,
    };
    let otel_layer = provider.as_ref().map(|provider| {
        tracing_opentelemetry::layer()
            .with_tracer(provider.tracer(service_name.to_string()))
            .boxed()
    });
    let installed = tracing_subscriber::registry()
        .with(filter)
        .with(fmt_layer)
        .with(otel_layer)
        .try_init();
    if installed.is_err() {
        tracing::debug!(service_name, "telemetry already initialised in this process");
    }
    if let Some(provider) = &provider {
        opentelemetry::global::set_tracer_provider(provider.clone());
    }
    Ok(TelemetryGuard { provider })
}

fn build_provider(
    endpoint: &str,
    sampling_ratio: f64,
    service_name: &str,
) -> Result<SdkTracerProvider, TelemetryError> {
    use opentelemetry_otlp::WithExportConfig;
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .build()
        .map_err(|error| TelemetryError::Exporter {
            endpoint: endpoint.to_string(),
            message: error.to_string(),
        })?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service_name.to_string())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            sampling_ratio,
        ))))
        .with_resource(resource)
        .build())
}

struct MapCarrier<'a>(&'a mut HashMap<String, String>);

impl Injector for MapCarrier<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_string(), value);
    }
}

struct ReadCarrier<'a>(&'a HashMap<String, String>);

impl Extractor for ReadCarrier<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// The W3C context of `span` (empty when it is not sampled/exported).
pub fn trace_context_of(span: &tracing::Span) -> TraceContext {
    let context = span.context();
    let mut fields = HashMap::new();
    TraceContextPropagator::new().inject_context(&context, &mut MapCarrier(&mut fields));
    TraceContext {
        traceparent: fields.remove("traceparent").unwrap_or_default(),
        tracestate: fields.remove("tracestate").unwrap_or_default(),
    }
}

/// The context of the current span.
pub fn current_trace_context() -> TraceContext {
    trace_context_of(&tracing::Span::current())
}

/// Make `span` a child of the remote context, when there is one.
pub fn set_remote_parent(span: &tracing::Span, remote: &TraceContext) {
    if remote.traceparent.is_empty() {
        return;
    }
    let mut fields = HashMap::new();
    fields.insert("traceparent".to_string(), remote.traceparent.clone());
    if !remote.tracestate.is_empty() {
        fields.insert("tracestate".to_string(), remote.tracestate.clone());
    }
    let parent = TraceContextPropagator::new().extract(&ReadCarrier(&fields));
    let _ = span.set_parent(parent);
}

/// Trace context from Kafka headers (`traceparent`, `tracestate`).
pub fn trace_context_from_headers(headers: &[(String, Vec<u8>)]) -> TraceContext {
    TraceContext {
        traceparent: crate::kafka::header_text(headers, "traceparent")
            .unwrap_or_default()
            .to_string(),
        tracestate: crate::kafka::header_text(headers, "tracestate")
            .unwrap_or_default()
            .to_string(),
    }
}

/// Kafka headers carrying `context` (none when empty).
pub fn trace_headers(context: &TraceContext) -> Vec<(String, Vec<u8>)> {
    let mut headers = Vec::new();
    if !context.traceparent.is_empty() {
        headers.push(("traceparent".to_string(), context.traceparent.clone().into_bytes()));
        if !context.tracestate.is_empty() {
            headers.push(("tracestate".to_string(), context.tracestate.clone().into_bytes()));
        }
    }
    headers
}

/// Trace context from gRPC request metadata.
pub fn trace_context_from_metadata(metadata: &tonic::metadata::MetadataMap) -> TraceContext {
    let text = |name: &str| {
        metadata
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    TraceContext {
        traceparent: text("traceparent"),
        tracestate: text("tracestate"),
    }
}

/// Put the current span's context into outgoing gRPC metadata.
pub fn inject_current_into_metadata(metadata: &mut tonic::metadata::MetadataMap) {
    let context = current_trace_context();
    if let Ok(value) = context.traceparent.parse() {
        if !context.traceparent.is_empty() {
            metadata.insert("traceparent", value);
        }
    }
    if let Ok(value) = context.tracestate.parse() {
        if !context.tracestate.is_empty() {
            metadata.insert("tracestate", value);
        }
    }
}
