//! Telemetry, initialised once per process: `tracing` with an `EnvFilter`
//! (`RUST_LOG` wins over `telemetry.log_level`), text or JSON logs, and OTLP
//! trace export only when an endpoint is configured. W3C trace context is
//! injected into and extracted from Kafka headers, message entries and gRPC
//! metadata with the global propagator.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::metrics::SdkMeterProvider;
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

/// Flushes and stops the exporters when dropped (at process exit).
#[must_use = "dropping the guard stops trace export"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
    meters: Option<SdkMeterProvider>,
    otlp_metrics: bool,
    registry: prometheus::Registry,
}

impl TelemetryGuard {
    /// Whether an OTLP trace exporter was started.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Whether an OTLP metric exporter was started.
    pub fn exporting_metrics(&self) -> bool {
        self.otlp_metrics
    }

    /// Export every finished span now (tests; the batch exporter otherwise
    /// sends on its own schedule and at exit).
    pub fn flush(&self) {
        if let Some(provider) = &self.provider {
            if let Err(error) = provider.force_flush() {
                tracing::warn!(%error, "flushing traces failed");
            }
        }
    }

    /// The registry the Prometheus scrape endpoint serves.
    pub fn prometheus_registry(&self) -> prometheus::Registry {
        self.registry.clone()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            if let Err(error) = provider.shutdown() {
                eprintln!("telemetry: flushing traces at exit failed: {error}");
            }
        }
        if let Some(meters) = self.meters.take() {
            if let Err(error) = meters.shutdown() {
                eprintln!("telemetry: flushing metrics at exit failed: {error}");
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

/// For an `https://` OTLP endpoint, a channel over TLS trusting
/// `telemetry.otlp_ca_file`; `None` for plaintext `http://`.
fn otlp_tls_channel(
    endpoint: &str,
    config: &TelemetryConfig,
) -> Result<Option<tonic::transport::Channel>, TelemetryError> {
    if !endpoint.starts_with("https://") {
        return Ok(None);
    }
    let failed = |message: String| TelemetryError::Exporter {
        endpoint: endpoint.to_string(),
        message,
    };
    if config.otlp_ca_file.trim().is_empty() {
        return Err(failed(
            "an https:// endpoint needs telemetry.otlp_ca_file (the CA that signed the collector's certificate)"
                .to_string(),
        ));
    }
    let ca = std::fs::read(config.otlp_ca_file.trim())
        .map_err(|error| failed(format!("telemetry.otlp_ca_file {:?}: {error}", config.otlp_ca_file)))?;
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .and_then(|built| built.tls_config(crate::tls::client_tls(Some(&ca), None)))
        .map_err(|error| failed(error.to_string()))?
        .connect_timeout(std::time::Duration::from_secs(5))
        .connect_lazy();
    Ok(Some(channel))
}

/// Whether text logs may use ANSI colour: stdout is a terminal and
/// `NO_COLOR` is not set.
fn colour_wanted() -> bool {
    colour_wanted_on(&std::io::stdout())
}

fn colour_wanted_on(stream: &impl std::io::IsTerminal) -> bool {
    stream.is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|value| value.is_empty())
}

/// Install the global subscriber, logging to stdout (a service's log). A
/// second call in one process (tests, `sluice dev`) keeps the first
/// subscriber and still returns a guard.
pub fn init(config: &TelemetryConfig, service_name: &str) -> Result<TelemetryGuard, TelemetryError> {
    init_logging_to(config, service_name, LogTo::Stdout)
}

/// As [`init`], logging to stderr: for a command whose stdout is its
/// answer (`sluice migrate -o json`), so a warning never corrupts it.
pub fn init_for_command(config: &TelemetryConfig, service_name: &str) -> Result<TelemetryGuard, TelemetryError> {
    init_logging_to(config, service_name, LogTo::Stderr)
}

/// Where log lines go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LogTo {
    Stdout,
    Stderr,
}

fn init_logging_to(
    config: &TelemetryConfig,
    service_name: &str,
    log_to: LogTo,
) -> Result<TelemetryGuard, TelemetryError> {
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter_text = std::env::var("RUST_LOG").unwrap_or_else(|_| config.log_level.clone());
    let filter = EnvFilter::try_new(&filter_text).map_err(|error| TelemetryError::Filter {
        filter: filter_text.clone(),
        message: error.to_string(),
    })?;
    let fmt_layer = match config.log_format {
        // Colour only on a terminal (and never with NO_COLOR): a log file or
        // a collector gets plain text.
        LogFormat::Text => {
            let layer = tracing_subscriber::fmt::layer().with_target(true);
            match log_to {
                LogTo::Stdout => layer.with_ansi(colour_wanted()).boxed(),
                LogTo::Stderr => layer
                    .with_ansi(colour_wanted_on(&std::io::stderr()))
                    .with_writer(std::io::stderr)
                    .boxed(),
            }
        }
        LogFormat::Json => {
            let layer = tracing_subscriber::fmt::layer().event_format(JsonWithTrace);
            match log_to {
                LogTo::Stdout => layer.boxed(),
                LogTo::Stderr => layer.with_writer(std::io::stderr).boxed(),
            }
        }
    };
    let endpoint = otlp_endpoint(config);
    let tls_channel = match &endpoint {
        Some(endpoint) => otlp_tls_channel(endpoint, config)?,
        None => None,
    };
    let provider = match &endpoint {
        Some(endpoint) => Some(build_provider(
            endpoint,
            tls_channel.clone(),
            config.sampling_ratio,
            service_name,
        )?),
        None => None,
    };
    let registry = prometheus::Registry::new();
    let meters = build_meter_provider(endpoint.as_deref(), tls_channel, &registry, service_name)?;
    let installed_meters = METER_PROVIDER_SET.set(()).is_ok();
    if installed_meters {
        opentelemetry::global::set_meter_provider(meters.clone());
    }
    crate::metrics::metrics().set_selection(crate::metrics::KeySelection {
        top_n: config.key_metrics_top_n,
        patterns: config.key_metrics_patterns.clone(),
    });
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
        install_tracer_provider(provider, config.sampling_ratio);
    }
    Ok(TelemetryGuard {
        provider,
        otlp_metrics: endpoint.is_some() && installed_meters,
        meters: installed_meters.then_some(meters),
        registry,
    })
}

static METER_PROVIDER_SET: std::sync::OnceLock<()> = std::sync::OnceLock::new();

fn build_meter_provider(
    endpoint: Option<&str>,
    tls_channel: Option<tonic::transport::Channel>,
    registry: &prometheus::Registry,
    service_name: &str,
) -> Result<SdkMeterProvider, TelemetryError> {
    let prometheus_reader = opentelemetry_prometheus::exporter()
        .with_registry(registry.clone())
        .build()
        .map_err(|error| TelemetryError::Exporter {
            endpoint: "prometheus".to_string(),
            message: error.to_string(),
        })?;
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service_name.to_string())
        .build();
    let mut builder = SdkMeterProvider::builder()
        .with_reader(prometheus_reader)
        .with_resource(resource);
    if let Some(endpoint) = endpoint {
        use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
        let mut exporter = opentelemetry_otlp::MetricExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint);
        if let Some(channel) = tls_channel {
            exporter = exporter.with_channel(channel);
        }
        let exporter = exporter.build().map_err(|error| TelemetryError::Exporter {
            endpoint: endpoint.to_string(),
            message: error.to_string(),
        })?;
        builder = builder.with_reader(opentelemetry_sdk::metrics::PeriodicReader::builder(exporter).build());
    }
    Ok(builder.build())
}

/// Start the Prometheus scrape endpoint on `telemetry.metrics_listen`
/// (nothing when empty). Returns the bound address.
pub async fn spawn_metrics_endpoint(
    config: &TelemetryConfig,
    guard: &TelemetryGuard,
    shutdown: crate::shutdown::Shutdown,
) -> Result<Option<std::net::SocketAddr>, std::io::Error> {
    let address = config.metrics_listen.trim();
    if address.is_empty() {
        return Ok(None);
    }
    let listener = tokio::net::TcpListener::bind(address).await.map_err(|error| {
        std::io::Error::new(
            error.kind(),
            format!(
                "telemetry.metrics_listen: cannot bind {address}: {error} (services on one host need a port \
                 each: set SLUICE__TELEMETRY__METRICS_LISTEN, or \"\" for no metrics endpoint)"
            ),
        )
    })?;
    let local = listener.local_addr()?;
    let registry = guard.prometheus_registry();
    tokio::spawn(async move {
        if let Err(error) = crate::metrics::serve_prometheus(listener, registry, shutdown).await {
            tracing::error!(%error, "metrics endpoint stopped");
        }
    });
    Ok(Some(local))
}

/// JSON log lines with the current span's `trace_id` and `span_id`.
struct JsonWithTrace;

struct JsonFields<'a>(&'a mut serde_json::Map<String, serde_json::Value>);

impl tracing::field::Visit for JsonFields<'_> {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().to_string(), serde_json::Value::from(value));
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.insert(field.name().to_string(), serde_json::Value::from(value));
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().to_string(), serde_json::Value::from(value));
    }
    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.0.insert(field.name().to_string(), serde_json::Value::from(value));
    }
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        self.0.insert(field.name().to_string(), serde_json::Value::from(value));
    }
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_string(), serde_json::Value::from(format!("{value:?}")));
    }
}

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for JsonWithTrace
where
    S: tracing::Subscriber + for<'lookup> tracing_subscriber::registry::LookupSpan<'lookup>,
    N: for<'writer> tracing_subscriber::fmt::FormatFields<'writer> + 'static,
{
    fn format_event(
        &self,
        context: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        use opentelemetry::trace::TraceContextExt;
        let mut line = serde_json::Map::new();
        line.insert(
            "timestamp".to_string(),
            serde_json::Value::from(humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string()),
        );
        line.insert(
            "level".to_string(),
            serde_json::Value::from(event.metadata().level().as_str()),
        );
        line.insert("target".to_string(), serde_json::Value::from(event.metadata().target()));
        event.record(&mut JsonFields(&mut line));
        if let Some(span) = context.lookup_current() {
            line.insert("span".to_string(), serde_json::Value::from(span.name()));
        }
        let current = tracing::Span::current().context();
        let span_context = current.span().span_context().clone();
        if span_context.is_valid() {
            line.insert(
                "trace_id".to_string(),
                serde_json::Value::from(span_context.trace_id().to_string()),
            );
            line.insert(
                "span_id".to_string(),
                serde_json::Value::from(span_context.span_id().to_string()),
            );
        }
        writeln!(writer, "{}", serde_json::Value::Object(line))
    }
}

/// Record one span of a job's trace with explicit start and end times (a
/// wait that began in another process, a decision, a publication) as a
/// child of `parent`, using the tracer named `scope` (the service). Returns
/// the new span's context for its children; without a tracer (no endpoint)
/// it returns `parent`, so propagation goes on and nothing is exported.
///
/// Nothing is built when no tracer exports spans in this process (no OTLP
/// endpoint), nor for a parent whose trace is not sampled: `attributes` is
/// called only for a span that is recorded (it was ~a tenth of the hot
/// path's allocations when every job built its spans for nobody).
pub fn record_span(
    scope: &'static str,
    name: &'static str,
    parent: &TraceContext,
    start: std::time::SystemTime,
    end: std::time::SystemTime,
    attributes: impl FnOnce() -> Vec<opentelemetry::KeyValue>,
) -> TraceContext {
    let (context, planned) = plan_span(scope, name, parent, start, end, attributes);
    if let Some(planned) = planned {
        planned.record();
    }
    context
}

/// A span a decision made, to record once the decision is committed
/// (`kafka::Outbox::observe`): its ids are chosen when it is planned, so
/// what the decision sends can name it as a parent before it is recorded,
/// and a decision made again after a failed commit records it once.
#[derive(Debug)]
pub struct PlannedSpan {
    scope: &'static str,
    name: &'static str,
    parent: TraceContext,
    trace_id: opentelemetry::trace::TraceId,
    span_id: opentelemetry::trace::SpanId,
    start: std::time::SystemTime,
    end: std::time::SystemTime,
    attributes: Vec<opentelemetry::KeyValue>,
}

/// `record_span`, but recorded later (`PlannedSpan::record`): returns the
/// new span's context at once, and the span to record when spans are
/// exported and it is sampled (the same decision the tracer will make:
/// its parent's flag, else the configured ratio on the trace id).
pub fn plan_span(
    scope: &'static str,
    name: &'static str,
    parent: &TraceContext,
    start: std::time::SystemTime,
    end: std::time::SystemTime,
    attributes: impl FnOnce() -> Vec<opentelemetry::KeyValue>,
) -> (TraceContext, Option<PlannedSpan>) {
    use opentelemetry::trace::{SpanContext, SpanKind, TraceContextExt, TraceFlags, TraceState};
    use opentelemetry_sdk::trace::{IdGenerator, RandomIdGenerator, SamplingDecision, ShouldSample};
    if !spans_exported() || parent_not_sampled(parent) {
        return (parent.clone(), None);
    }
    let parent_span = extract(parent).span().span_context().clone();
    let ids = RandomIdGenerator::default();
    let (trace_id, trace_state) = if parent_span.is_valid() {
        (parent_span.trace_id(), parent_span.trace_state().clone())
    } else {
        let trace_id = ids.new_trace_id();
        let ratio = f64::from_bits(ROOT_SAMPLING_RATIO.load(std::sync::atomic::Ordering::Relaxed));
        let decision = Sampler::TraceIdRatioBased(ratio)
            .should_sample(None, trace_id, name, &SpanKind::Internal, &[], &[])
            .decision;
        if decision != SamplingDecision::RecordAndSample {
            return (parent.clone(), None);
        }
        (trace_id, TraceState::default())
    };
    let span_id = ids.new_span_id();
    let context = opentelemetry::Context::new().with_remote_span_context(SpanContext::new(
        trace_id,
        span_id,
        TraceFlags::SAMPLED,
        true,
        trace_state,
    ));
    let mut fields = HashMap::new();
    TraceContextPropagator::new().inject_context(&context, &mut MapCarrier(&mut fields));
    let child = TraceContext {
        traceparent: fields.remove("traceparent").unwrap_or_default(),
        tracestate: fields.remove("tracestate").unwrap_or_default(),
    };
    let planned = PlannedSpan {
        scope,
        name,
        parent: parent.clone(),
        trace_id,
        span_id,
        start,
        end,
        attributes: attributes(),
    };
    (child, Some(planned))
}

impl PlannedSpan {
    /// Export the span, with the ids it was planned with (the tracer's
    /// `PlannedIdGenerator` hands them out while it is built).
    pub fn record(self) {
        use opentelemetry::trace::{Span as _, Tracer as _};
        let parent_context = extract(&self.parent);
        let tracer = opentelemetry::global::tracer(self.scope);
        PLANNED_IDS.with(|ids| ids.set(Some((self.trace_id, self.span_id))));
        let mut span = tracer
            .span_builder(self.name)
            .with_start_time(self.start)
            .with_attributes(self.attributes)
            .start_with_context(&tracer, &parent_context);
        PLANNED_IDS.with(|ids| ids.set(None));
        span.end_with_timestamp(self.end);
    }
}

thread_local! {
    /// The ids of the span `PlannedSpan::record` builds on this thread.
    static PLANNED_IDS: std::cell::Cell<Option<(opentelemetry::trace::TraceId, opentelemetry::trace::SpanId)>> =
        const { std::cell::Cell::new(None) };
}

/// The tracer's id generator: the planned ids of the span being recorded
/// (`PlannedSpan::record`), else random ones.
#[derive(Debug, Default)]
pub struct PlannedIdGenerator;

impl opentelemetry_sdk::trace::IdGenerator for PlannedIdGenerator {
    fn new_trace_id(&self) -> opentelemetry::trace::TraceId {
        PLANNED_IDS
            .with(|ids| ids.get())
            .map(|(trace_id, _)| trace_id)
            .unwrap_or_else(|| opentelemetry_sdk::trace::RandomIdGenerator::default().new_trace_id())
    }

    fn new_span_id(&self) -> opentelemetry::trace::SpanId {
        PLANNED_IDS
            .with(|ids| ids.get())
            .map(|(_, span_id)| span_id)
            .unwrap_or_else(|| opentelemetry_sdk::trace::RandomIdGenerator::default().new_span_id())
    }
}

/// The sampling ratio of spans without a parent (as `f64` bits), which
/// `plan_span` decides as the tracer does.
static ROOT_SAMPLING_RATIO: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x3FF0_0000_0000_0000);

/// Export spans to `provider` from now on in this process (what `init`
/// does with an OTLP endpoint; tests install an in-memory one), roots
/// sampled at `sampling_ratio`.
pub fn install_tracer_provider(provider: &SdkTracerProvider, sampling_ratio: f64) {
    ROOT_SAMPLING_RATIO.store(sampling_ratio.to_bits(), std::sync::atomic::Ordering::Relaxed);
    opentelemetry::global::set_tracer_provider(provider.clone());
    SPANS_EXPORTED.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// Record `span` below the context in `headers` and put the span's
/// context there instead (a message sent from a decision:
/// `kafka::SendSpan`).
pub fn record_send_span(headers: &mut Vec<(String, Vec<u8>)>, span: &crate::kafka::SendSpan) {
    if !spans_exported() {
        return;
    }
    let text = |name: &str| {
        headers
            .iter()
            .find(|(header, _)| header == name)
            .map(|(_, value)| String::from_utf8_lossy(value).to_string())
            .unwrap_or_default()
    };
    let parent = TraceContext {
        traceparent: text("traceparent"),
        tracestate: text("tracestate"),
    };
    let at = crate::clock::system_time_at_ms(span.at_ms);
    let child = record_span(span.scope, span.name, &parent, at, at, || {
        span.attributes
            .iter()
            .map(|(name, value)| match value {
                crate::kafka::SpanValue::Text(text) => opentelemetry::KeyValue::new(*name, text.clone()),
                crate::kafka::SpanValue::Number(number) => opentelemetry::KeyValue::new(*name, *number),
            })
            .collect()
    });
    headers.retain(|(name, _)| name != "traceparent" && name != "tracestate");
    headers.extend(trace_headers(&child));
}

/// Whether a tracer provider with an exporter is installed in this process.
static SPANS_EXPORTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether spans recorded in this process go anywhere.
pub fn spans_exported() -> bool {
    SPANS_EXPORTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// A W3C parent whose sampled flag is off: its children are not recorded.
fn parent_not_sampled(parent: &TraceContext) -> bool {
    // version-traceid-parentid-flags; bit 0 of the flags is "sampled".
    parent
        .traceparent
        .rsplit('-')
        .next()
        .filter(|_| parent.traceparent.len() == 55)
        .and_then(|flags| u8::from_str_radix(flags, 16).ok())
        .is_some_and(|flags| flags & 1 == 0)
}

fn extract(remote: &TraceContext) -> opentelemetry::Context {
    if remote.traceparent.is_empty() {
        return opentelemetry::Context::new();
    }
    let mut fields = HashMap::new();
    fields.insert("traceparent".to_string(), remote.traceparent.clone());
    if !remote.tracestate.is_empty() {
        fields.insert("tracestate".to_string(), remote.tracestate.clone());
    }
    TraceContextPropagator::new().extract(&ReadCarrier(&fields))
}

fn build_provider(
    endpoint: &str,
    tls_channel: Option<tonic::transport::Channel>,
    sampling_ratio: f64,
    service_name: &str,
) -> Result<SdkTracerProvider, TelemetryError> {
    use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint);
    if let Some(channel) = tls_channel {
        builder = builder.with_channel(channel);
    }
    let exporter = builder.build().map_err(|error| TelemetryError::Exporter {
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
        .with_id_generator(PlannedIdGenerator)
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

/// The longest `tracestate` kept (W3C: at most 512 characters).
pub const MAX_TRACESTATE_BYTES: usize = 512;

/// A W3C `traceparent`: `00-<32 hex trace id>-<16 hex parent id>-<2 hex
/// flags>`, lowercase, ids not all zero (a later version may append fields
/// after a `-`; version `ff` is invalid).
pub fn is_valid_traceparent(value: &str) -> bool {
    let bytes = value.as_bytes();
    if bytes.len() < 55 || (bytes.len() > 55 && bytes[55] != b'-') {
        return false;
    }
    let hex = |range: std::ops::Range<usize>| {
        bytes[range]
            .iter()
            .all(|byte| byte.is_ascii_digit() || (b'a'..=b'f').contains(byte))
    };
    let not_zero = |range: std::ops::Range<usize>| bytes[range].iter().any(|byte| *byte != b'0');
    hex(0..2)
        && &bytes[0..2] != b"ff"
        && (bytes.len() == 55 || &bytes[0..2] != b"00")
        && bytes[2] == b'-'
        && hex(3..35)
        && not_zero(3..35)
        && bytes[35] == b'-'
        && hex(36..52)
        && not_zero(36..52)
        && bytes[52] == b'-'
        && hex(53..55)
}

/// A W3C `tracestate`: printable ASCII, at most 512 bytes.
pub fn is_valid_tracestate(value: &str) -> bool {
    value.len() <= MAX_TRACESTATE_BYTES && value.bytes().all(|byte| (0x20..=0x7e).contains(&byte))
}

/// Trace context as W3C says to treat what arrives from outside: an invalid
/// `traceparent` is ignored (the job starts a trace of its own) and takes its
/// `tracestate` with it; an invalid `tracestate` alone is dropped. What this
/// returns is safe to store and to put in headers.
pub fn checked_trace_context(traceparent: &str, tracestate: &str) -> TraceContext {
    if !is_valid_traceparent(traceparent) {
        return TraceContext::default();
    }
    TraceContext {
        traceparent: traceparent.to_string(),
        tracestate: if is_valid_tracestate(tracestate) {
            tracestate.to_string()
        } else {
            String::new()
        },
    }
}

/// A W3C trace context held per ticket, in 41 bytes and no allocation for
/// the usual case: a version-00 `traceparent` as its 25 binary bytes (trace
/// id, parent id, flags) and the `tracestate` (usually empty). A context of
/// another version is not kept (the job's next span starts a new trace).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompactTraceContext {
    parent: Option<[u8; 25]>,
    state: Box<str>,
}

impl CompactTraceContext {
    pub fn from_context(context: &TraceContext) -> Self {
        let parent = parse_traceparent_v00(&context.traceparent);
        CompactTraceContext {
            state: if parent.is_some() {
                context.tracestate.as_str().into()
            } else {
                Box::from("")
            },
            parent,
        }
    }

    /// The context as it travels (`traceparent`, `tracestate`).
    pub fn to_context(&self) -> TraceContext {
        TraceContext {
            traceparent: self.traceparent(),
            tracestate: self.state.to_string(),
        }
    }

    pub fn traceparent(&self) -> String {
        let Some(parent) = &self.parent else {
            return String::new();
        };
        let mut text = String::with_capacity(55);
        text.push_str("00-");
        for (index, byte) in parent.iter().enumerate() {
            if index == 16 || index == 24 {
                text.push('-');
            }
            text.push_str(&format!("{byte:02x}"));
        }
        text
    }

    pub fn tracestate(&self) -> &str {
        &self.state
    }
}

fn parse_traceparent_v00(value: &str) -> Option<[u8; 25]> {
    if value.len() != 55 || !value.starts_with("00-") || !is_valid_traceparent(value) {
        return None;
    }
    let hex: String = value[3..].chars().filter(|c| *c != '-').collect();
    let mut bytes = [0u8; 25];
    for (index, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(index * 2..index * 2 + 2)?, 16).ok()?;
    }
    Some(bytes)
}

/// `checked_trace_context` of a context received inside a message.
pub fn checked(context: &TraceContext) -> TraceContext {
    if context.traceparent.is_empty() && context.tracestate.is_empty() {
        return TraceContext::default();
    }
    checked_trace_context(&context.traceparent, &context.tracestate)
}

/// Trace context from Kafka headers (`traceparent`, `tracestate`), checked.
pub fn trace_context_from_headers(headers: &[(String, Vec<u8>)]) -> TraceContext {
    checked_trace_context(
        crate::kafka::header_text(headers, "traceparent").unwrap_or_default(),
        crate::kafka::header_text(headers, "tracestate").unwrap_or_default(),
    )
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

/// Trace context from gRPC request metadata, checked.
pub fn trace_context_from_metadata(metadata: &tonic::metadata::MetadataMap) -> TraceContext {
    let text = |name: &str| {
        metadata
            .get(name)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
    };
    checked_trace_context(text("traceparent"), text("tracestate"))
}

/// Put the current span's context into outgoing gRPC metadata.
pub fn inject_current_into_metadata(metadata: &mut tonic::metadata::MetadataMap) {
    inject_into_metadata(&current_trace_context(), metadata);
}

/// Put `context` into outgoing gRPC metadata (a forwarded call keeps its
/// caller's context).
pub fn inject_into_metadata(context: &TraceContext, metadata: &mut tonic::metadata::MetadataMap) {
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

#[cfg(test)]
mod tests {
    use super::*;

    const VALID: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn only_well_formed_trace_context_is_kept() {
        assert!(is_valid_traceparent(VALID));
        let kept = checked_trace_context(VALID, "vendor=a");
        assert_eq!(kept.traceparent, VALID);
        assert_eq!(kept.tracestate, "vendor=a");
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0\0",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01é",
        ] {
            assert!(!is_valid_traceparent(bad), "{bad:?}");
            assert_eq!(
                checked_trace_context(bad, "vendor=a"),
                TraceContext::default(),
                "{bad:?}"
            );
        }
        // A later version may append fields.
        assert!(is_valid_traceparent(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-brings"
        ));
        let compact = CompactTraceContext::from_context(&checked_trace_context(VALID, "vendor=a"));
        assert_eq!(
            compact.to_context(),
            checked_trace_context(VALID, "vendor=a"),
            "round trip"
        );
        assert_eq!(
            CompactTraceContext::from_context(&TraceContext::default()).to_context(),
            TraceContext::default()
        );
        // A bad tracestate alone is dropped.
        assert_eq!(checked_trace_context(VALID, "a=\0").tracestate, "");
        assert_eq!(checked_trace_context(VALID, &"x".repeat(513)).tracestate, "");
    }
}
