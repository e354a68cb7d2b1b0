//! The floating-limit refresh handler: consume `refresh.tasks`, compute the
//! key's new max with the application's handler, report it with
//! `Refresh.ReportRefresh` before the task's deadline.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures::FutureExt as _;
use prost::Message as _;
use rdkafka::consumer::{Consumer, DefaultConsumerContext, StreamConsumer};
use sluice_proto::v1 as pb;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::grpc::Refresh;
use crate::options::ClientOptions;
use crate::propagation::{request_with, TraceContext};
use crate::worker::handler::RefreshHandler;
use crate::worker::kafka::{store_position, Received};
use crate::worker::offsets::{OffsetTracker, PartitionId};
use crate::worker::reported_text::reported_text;
use crate::worker::status::{Counters, StatusShared};

pub(crate) struct RefreshSettings {
    pub options: ClientOptions,
    pub handler: Arc<dyn RefreshHandler>,
    pub refresh: Refresh,
    pub concurrency: usize,
    pub shutdown_grace: Duration,
    pub status: Arc<StatusShared>,
}

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|since| i64::try_from(since.as_millis()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

/// Runs until `shutdown`, then lets running refreshes finish within the
/// shutdown grace and commits.
pub(crate) async fn run_refresh_consumer(settings: RefreshSettings, shutdown: CancellationToken) {
    let topic: Arc<str> = Arc::from(settings.options.refresh_tasks_topic().as_str());
    let consumer: StreamConsumer<DefaultConsumerContext> = match settings
        .options
        .consumer_config(&settings.options.refresh_group())
        .create()
    {
        Ok(consumer) => consumer,
        Err(error) => {
            tracing::error!(%error, topic = %topic, "cannot create the refresh consumer; refreshes are not handled");
            return;
        }
    };
    if let Err(error) = consumer.subscribe(&[&topic]) {
        tracing::error!(%error, topic = %topic, "cannot subscribe to refresh tasks; refreshes are not handled");
        return;
    }
    let consumer = Arc::new(consumer);
    let mut offsets = OffsetTracker::default();
    let mut running: JoinSet<(PartitionId, i64)> = JoinSet::new();
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            Some(joined) = running.join_next(), if !running.is_empty() => {
                if let Ok((partition, offset)) = joined {
                    if let Some(position) = offsets.finish(&partition, offset) {
                        store_position(&consumer, &partition, position);
                    }
                }
            }
            received = consumer.recv(), if running.len() < settings.concurrency => match received {
                Ok(message) => {
                    let received = Received::from_message(&message, topic.clone());
                    drop(message);
                    offsets.begin(&received.partition, received.offset);
                    running.spawn(handle_task(
                        received,
                        settings.handler.clone(),
                        settings.refresh.clone(),
                        settings.status.clone(),
                    ));
                }
                Err(error) => {
                    tracing::warn!(%error, "kafka receive failed (refresh tasks)");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
        }
    }
    let drained = tokio::time::timeout(settings.shutdown_grace, async {
        while let Some(joined) = running.join_next().await {
            if let Ok((partition, offset)) = joined {
                if let Some(position) = offsets.finish(&partition, offset) {
                    store_position(&consumer, &partition, position);
                }
            }
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            unfinished = running.len(),
            "refreshes still running at the end of the grace; they are retried by the dispatcher"
        );
        running.abort_all();
    }
    let committed = tokio::task::spawn_blocking(move || {
        match consumer.commit_consumer_state(rdkafka::consumer::CommitMode::Sync) {
            Ok(()) => {}
            Err(rdkafka::error::KafkaError::ConsumerCommit(rdkafka::types::RDKafkaErrorCode::NoOffset)) => {}
            Err(error) => tracing::warn!(%error, "final refresh offset commit failed"),
        }
        drop(consumer);
    })
    .await;
    if let Err(join_error) = committed {
        tracing::warn!(%join_error, "final refresh commit task failed");
    }
}

/// Compute and report one refresh; returns the message's place.
async fn handle_task(
    received: Received,
    handler: Arc<dyn RefreshHandler>,
    refresh: Refresh,
    status: Arc<StatusShared>,
) -> (PartitionId, i64) {
    let place = (received.partition.clone(), received.offset);
    let task = match pb::RefreshTask::decode(received.payload.as_slice()) {
        Ok(task) => task,
        Err(error) => {
            tracing::error!(%error, partition = received.partition.1, offset = received.offset, "skipping a message that is not a RefreshTask");
            return place;
        }
    };
    let key = task.key.clone().unwrap_or_default();
    let span = tracing::info_span!(
        "sluice.worker.refresh",
        task_id = %task.task_id,
        tenant = %key.tenant,
        key = %key.key,
        attempt = task.attempt,
        outcome = tracing::field::Empty,
    );
    let incoming = TraceContext::from_pairs(&received.headers);
    incoming.set_as_parent_of(&span);
    let trace = TraceContext::of_span_or(&span, &incoming);
    let remaining_ms = task.deadline_ms - now_ms();
    if task.deadline_ms > 0 && remaining_ms <= 0 {
        // The dispatcher already counted it as failed and will retry.
        span.record("outcome", "expired");
        tracing::debug!(parent: &span, "refresh task past its deadline; skipped");
        return place;
    }
    let budget = if task.deadline_ms > 0 {
        Duration::from_millis(u64::try_from(remaining_ms).unwrap_or(0))
    } else {
        Duration::from_secs(30)
    };
    let computing = AssertUnwindSafe(handler.refresh(task.clone()))
        .catch_unwind()
        .instrument(span.clone());
    let result = match tokio::time::timeout(budget, computing).await {
        Err(_) => {
            span.record("outcome", "timed_out");
            tracing::warn!(parent: &span, "refresh handler ran past the task's deadline; not reported");
            return place;
        }
        Ok(Err(_panic)) => pb::report_refresh_request::Result::Error("refresh handler panicked".to_string()),
        Ok(Ok(Err(error))) => pb::report_refresh_request::Result::Error(reported_text(&error.0)),
        Ok(Ok(Ok(new_max))) => pb::report_refresh_request::Result::NewMax(i64::from(new_max)),
    };
    let request = pb::ReportRefreshRequest {
        task_id: task.task_id.clone(),
        key: task.key.clone(),
        result: Some(result),
    };
    report(&refresh, request, task.deadline_ms, &trace, &span, &status).await;
    place
}

/// Reports a refresh's result, retrying with backoff until it is answered
/// or the task's deadline (if any) has passed.
async fn report(
    refresh: &Refresh,
    request: pb::ReportRefreshRequest,
    deadline_ms: i64,
    trace: &TraceContext,
    span: &tracing::Span,
    status: &StatusShared,
) {
    let mut delay = Duration::from_millis(100);
    loop {
        let mut client = refresh.client.clone();
        match client
            .report_refresh(request_with(request.clone(), trace))
            .instrument(span.clone())
            .await
        {
            Ok(response) => {
                let response = response.into_inner();
                Counters::add(&status.counters.refreshes_reported);
                span.record("outcome", if response.applied { "applied" } else { "not_applied" });
                if !response.applied {
                    tracing::info!(parent: span, detail = %response.detail, "refresh report not applied");
                }
                return;
            }
            Err(status) => {
                if deadline_ms > 0 && now_ms() >= deadline_ms {
                    span.record("outcome", "report_failed");
                    tracing::warn!(parent: span, %status, "could not report the refresh before its deadline");
                    return;
                }
                tracing::warn!(parent: span, endpoint = %refresh.endpoint, %status, "report refresh failed; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(2));
            }
        }
    }
}
