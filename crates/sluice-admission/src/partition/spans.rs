//! The spans admission records once a batch is committed: a job's wait on
//! a limit, and a completion.

use opentelemetry::KeyValue;
use sluice_common::telemetry::record_span;
use sluice_proto::v1 as pb;

use crate::jobs::JobRow;
use crate::transitions::Status;

/// The tracer scope of admission's spans.
pub(super) const SCOPE: &str = "sluice-admission";

/// The span covering a job's wait on one limit, from when the key's owner
/// queued it to the grant, to record when the grant is committed. `None`
/// when spans are not exported.
pub(super) fn wait_span(
    row: &JobRow,
    step_index: u32,
    event: &pb::GrantEvent,
) -> Option<impl FnOnce() + Send + 'static> {
    use sluice_common::clock::system_time_at_ms as at_ms;
    if !sluice_common::telemetry::spans_exported() {
        return None;
    }
    let step = row.state.chain.get(usize::try_from(step_index).unwrap_or(usize::MAX));
    let kind = pb::LimitKind::try_from(event.kind).unwrap_or(pb::LimitKind::Unspecified);
    let key = event.key.clone().unwrap_or_default();
    let outcome = if event.unthrottled { "unthrottled" } else { "granted" };
    let start_ms = if event.waiting_since_ms > 0 {
        event.waiting_since_ms
    } else {
        event.granted_at_ms
    };
    let trace = row.trace.clone();
    let end_ms = event.granted_at_ms.max(start_ms);
    let attributes = vec![
        KeyValue::new("sluice.job_id", row.state.job_id.clone()),
        KeyValue::new("sluice.step", i64::from(step_index)),
        KeyValue::new("sluice.tenant", key.tenant),
        KeyValue::new("sluice.key", key.key),
        KeyValue::new("sluice.limit_kind", kind.as_str_name()),
        KeyValue::new("sluice.max", event.max),
        KeyValue::new("sluice.position_at_enqueue", i64::from(event.position_at_enqueue)),
        KeyValue::new("sluice.outcome", outcome),
        KeyValue::new(
            "sluice.origin",
            step.map(|step| step.origin.clone()).unwrap_or_default(),
        ),
    ];
    Some(move || {
        record_span(SCOPE, "sluice.wait", &trace, at_ms(start_ms), at_ms(end_ms), || {
            attributes
        });
    })
}

/// The span of a completion, to record once it is committed: under the
/// worker's handler span when the call carries one of this job's trace,
/// else under the job's own span.
pub(super) fn complete_span(
    result: &pb::CompleteResult,
    caller_trace: &pb::TraceContext,
    job_trace: &pb::TraceContext,
    now_ms: i64,
) -> impl FnOnce() + Send + 'static {
    let parent = if same_trace(caller_trace, job_trace) {
        caller_trace.clone()
    } else {
        job_trace.clone()
    };
    let attributes = vec![
        KeyValue::new("sluice.job_id", result.job_id.clone()),
        KeyValue::new("sluice.attempt", i64::from(result.attempt)),
        KeyValue::new(
            "sluice.outcome",
            pb::CompleteOutcome::try_from(result.outcome)
                .map(|outcome| outcome.as_str_name().to_string())
                .unwrap_or_default(),
        ),
        KeyValue::new(
            "sluice.status",
            Status::try_from(result.status)
                .map(|status| status.as_str_name().to_string())
                .unwrap_or_default(),
        ),
    ];
    // At the batch's time: a core reads no clock (the runtime records the
    // span after the commit).
    let now = sluice_common::clock::system_time_at_ms(now_ms);
    move || {
        record_span(SCOPE, "admission.complete", &parent, now, now, || attributes);
    }
}

/// Whether two W3C contexts belong to one trace.
fn same_trace(left: &pb::TraceContext, right: &pb::TraceContext) -> bool {
    let trace_id = |context: &pb::TraceContext| context.traceparent.split('-').nth(1).map(str::to_string);
    match (trace_id(left), trace_id(right)) {
        (Some(left), Some(right)) => left == right && left.len() == 32,
        _ => false,
    }
}
