//! W3C trace context between `tracing` spans, Kafka headers and gRPC
//! metadata. Spans carry OpenTelemetry context only when the application
//! installed a `tracing-opentelemetry` layer; without one, the context that
//! came in is passed on unchanged, so a trace still follows the job.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::TraceContextExt;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use rdkafka::message::{Headers, OwnedHeaders};
use tracing_opentelemetry::OpenTelemetrySpanExt;

pub(crate) const TRACEPARENT: &str = "traceparent";
pub(crate) const TRACESTATE: &str = "tracestate";

/// A W3C trace context as text (both empty: none).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TraceContext {
    pub traceparent: String,
    pub tracestate: String,
}

impl TraceContext {
    pub fn is_empty(&self) -> bool {
        self.traceparent.is_empty()
    }

    /// From Kafka headers (`traceparent`, `tracestate`).
    pub fn from_headers<H: Headers>(headers: Option<&H>) -> TraceContext {
        let mut context = TraceContext::default();
        let Some(headers) = headers else {
            return context;
        };
        for header in headers.iter() {
            let value = header
                .value
                .and_then(|bytes| std::str::from_utf8(bytes).ok())
                .unwrap_or_default();
            if header.key.eq_ignore_ascii_case(TRACEPARENT) {
                context.traceparent = value.to_string();
            } else if header.key.eq_ignore_ascii_case(TRACESTATE) {
                context.tracestate = value.to_string();
            }
        }
        context
    }

    /// From detached Kafka headers.
    pub(crate) fn from_pairs(headers: &[(String, Vec<u8>)]) -> TraceContext {
        let text = |name: &str| {
            headers
                .iter()
                .find(|(key, _)| key.eq_ignore_ascii_case(name))
                .and_then(|(_, value)| std::str::from_utf8(value).ok())
                .unwrap_or_default()
                .to_string()
        };
        TraceContext {
            traceparent: text(TRACEPARENT),
            tracestate: text(TRACESTATE),
        }
    }

    /// Add this context to Kafka headers.
    pub(crate) fn add_to_headers(&self, mut headers: OwnedHeaders) -> OwnedHeaders {
        if self.traceparent.is_empty() {
            return headers;
        }
        headers = headers.insert(rdkafka::message::Header {
            key: TRACEPARENT,
            value: Some(self.traceparent.as_bytes()),
        });
        if !self.tracestate.is_empty() {
            headers = headers.insert(rdkafka::message::Header {
                key: TRACESTATE,
                value: Some(self.tracestate.as_bytes()),
            });
        }
        headers
    }

    /// Put this context into outgoing gRPC metadata.
    pub(crate) fn add_to_metadata(&self, metadata: &mut tonic::metadata::MetadataMap) {
        if self.traceparent.is_empty() {
            return;
        }
        if let Ok(value) = self.traceparent.parse() {
            metadata.insert(TRACEPARENT, value);
        }
        if !self.tracestate.is_empty() {
            if let Ok(value) = self.tracestate.parse() {
                metadata.insert(TRACESTATE, value);
            }
        }
    }

    /// The context of `span`, or `fallback` when the span has none (no
    /// OpenTelemetry layer installed, or not sampled).
    pub(crate) fn of_span_or(span: &tracing::Span, fallback: &TraceContext) -> TraceContext {
        let context = span.context();
        if !context.span().span_context().is_valid() {
            return fallback.clone();
        }
        let mut fields = HashMap::new();
        TraceContextPropagator::new().inject_context(&context, &mut FieldsOut(&mut fields));
        TraceContext {
            traceparent: fields.remove(TRACEPARENT).unwrap_or_default(),
            tracestate: fields.remove(TRACESTATE).unwrap_or_default(),
        }
    }

    /// The context of the current span (empty without one).
    pub fn current() -> TraceContext {
        TraceContext::of_span_or(&tracing::Span::current(), &TraceContext::default())
    }

    /// Make `span` a child of this remote context.
    pub(crate) fn set_as_parent_of(&self, span: &tracing::Span) {
        if self.traceparent.is_empty() {
            return;
        }
        let mut fields = HashMap::new();
        fields.insert(TRACEPARENT.to_string(), self.traceparent.clone());
        if !self.tracestate.is_empty() {
            fields.insert(TRACESTATE.to_string(), self.tracestate.clone());
        }
        let parent = TraceContextPropagator::new().extract(&FieldsIn(&fields));
        // Fails only when the span is disabled; then there is nothing to link.
        let _ = span.set_parent(parent);
    }
}

struct FieldsOut<'a>(&'a mut HashMap<String, String>);

impl Injector for FieldsOut<'_> {
    fn set(&mut self, key: &str, value: String) {
        self.0.insert(key.to_string(), value);
    }
}

struct FieldsIn<'a>(&'a HashMap<String, String>);

impl Extractor for FieldsIn<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

/// A gRPC request carrying `context` in its metadata.
pub(crate) fn request_with<T>(message: T, context: &TraceContext) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    context.add_to_metadata(request.metadata_mut());
    request
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let context = TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_string(),
            tracestate: "vendor=1".to_string(),
        };
        let headers = context.add_to_headers(OwnedHeaders::new());
        assert_eq!(TraceContext::from_headers(Some(&headers)), context);
        assert!(TraceContext::from_headers::<OwnedHeaders>(None).is_empty());
    }

    #[test]
    fn without_an_opentelemetry_layer_the_fallback_passes_through() {
        let fallback = TraceContext {
            traceparent: "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".to_string(),
            tracestate: String::new(),
        };
        let span = tracing::info_span!("test");
        assert_eq!(TraceContext::of_span_or(&span, &fallback), fallback);
    }
}
