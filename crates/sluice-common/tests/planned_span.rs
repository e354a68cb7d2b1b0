//! A span a decision plans is exported only when the runtime records it
//! (after the commit), with the ids its children were given when it was
//! planned: a decision made again after a failed commit exports its spans
//! once, and what it sent names the span that is exported (issue 31).
//! Its own test binary: it installs the process's tracer.

use std::time::{Duration, SystemTime};

use opentelemetry::KeyValue;
use opentelemetry_sdk::trace::{InMemorySpanExporter, Sampler, SdkTracerProvider};
use sluice_common::telemetry::{install_tracer_provider, plan_span, record_span, PlannedIdGenerator};
use sluice_proto::v1::TraceContext;

const PARENT_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";
const PARENT_SPAN: &str = "b7ad6b7169203331";

fn ids(context: &TraceContext) -> (String, String) {
    let parts: Vec<&str> = context.traceparent.split('-').collect();
    assert_eq!(parts.len(), 4, "{context:?}");
    (parts[1].to_string(), parts[2].to_string())
}

#[test]
fn a_planned_span_is_exported_when_recorded_with_the_ids_it_was_planned_with() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(1.0))))
        .with_id_generator(PlannedIdGenerator)
        .build();
    install_tracer_provider(&provider, 1.0);
    let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let exported = || exporter.get_finished_spans().expect("the in-memory exporter answers");

    // Under a sampled parent.
    let parent = TraceContext {
        traceparent: format!("00-{PARENT_TRACE}-{PARENT_SPAN}-01"),
        tracestate: String::new(),
    };
    let (child, planned) = plan_span("sluice-test", "admission.enqueue", &parent, at, at, || {
        vec![KeyValue::new("sluice.job_id", "j1")]
    });
    let planned = planned.expect("a sampled parent's child is planned");
    let (trace_id, span_id) = ids(&child);
    assert_eq!(trace_id, PARENT_TRACE);
    assert_ne!(span_id, PARENT_SPAN);
    assert!(exported().is_empty(), "nothing is exported before it is recorded");

    // A span recorded at once in between takes ids of its own.
    let other = record_span("sluice-test", "other", &parent, at, at, Vec::new);
    assert_ne!(ids(&other).1, span_id);

    planned.record();
    let spans = exported();
    assert_eq!(spans.len(), 2);
    let span = spans
        .iter()
        .find(|span| span.name == "admission.enqueue")
        .expect("the planned span is exported");
    assert_eq!(span.span_context.trace_id().to_string(), trace_id);
    assert_eq!(span.span_context.span_id().to_string(), span_id);
    assert_eq!(span.parent_span_id.to_string(), PARENT_SPAN);
    assert_eq!(span.start_time, at);

    // A root (no parent): a trace of its own, the same one exported.
    let (root, planned) = plan_span("sluice-test", "root", &TraceContext::default(), at, at, Vec::new);
    planned.expect("sampled at ratio 1").record();
    let spans = exported();
    let span = spans.iter().find(|span| span.name == "root").expect("exported");
    assert_eq!(
        (
            span.span_context.trace_id().to_string(),
            span.span_context.span_id().to_string()
        ),
        ids(&root)
    );

    // A parent whose sampled flag is off: nothing planned, the parent goes on.
    let unsampled = TraceContext {
        traceparent: format!("00-{PARENT_TRACE}-{PARENT_SPAN}-00"),
        tracestate: String::new(),
    };
    let (context, planned) = plan_span("sluice-test", "unsampled", &unsampled, at, at, Vec::new);
    assert!(planned.is_none());
    assert_eq!(context, unsampled);
}
