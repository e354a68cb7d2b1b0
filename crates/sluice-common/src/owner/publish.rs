//! After a commit: publishing what a batch decided, retrying faults that
//! pass, and setting aside input and messages that can never succeed.

use super::task::{BatchEnd, PartitionTask, Step};
use super::{
    insert_quarantined, report_quarantined, CommitError, OwnedState, OwnedStore, OwnerContext, Rejected, Reply,
};
use crate::fault::{classify_kafka, clean_text};
use crate::faults::FaultPoint;
use crate::kafka::{OutMsg, Outbox, PartitionInput, PartitionTaskError};
use crate::retry::Backoff;

impl<S: OwnedStore> PartitionTask<S> {
    /// After the commit (or with nothing to commit): record what was
    /// decided, publish it, then answer the batch's local requests.
    pub(super) async fn publish_committed(
        &self,
        mut outbox: Outbox,
        replies: Vec<Reply>,
        input: &PartitionInput,
    ) -> Result<BatchEnd, PartitionTaskError> {
        outbox.take_observations().record();
        let published_from = std::time::Instant::now();
        if let Step::Stop = self.publish_until_done(outbox, input).await {
            return Ok(BatchEnd::Stop);
        }
        crate::metrics::metrics().publish_seconds.record(
            published_from.elapsed().as_secs_f64(),
            &[opentelemetry::KeyValue::new("service", self.settings.service)],
        );
        if self.faults.hit(FaultPoint::OwnerAfterPublishBeforeOffsetStore) {
            return Err(PartitionTaskError::Crashed);
        }
        for reply in replies {
            reply();
        }
        Ok(BatchEnd::Done)
    }

    pub(super) fn note_transient(&self, partition: i32, reason: String) {
        self.registry.set_condition(partition, reason);
        crate::metrics::metrics()
            .transient_faults
            .add(1, &[opentelemetry::KeyValue::new("service", self.settings.service)]);
    }

    /// Set `rejected` aside (fenced, saving `new_offset` as applied).
    pub(super) async fn quarantine(
        &self,
        context: &OwnerContext,
        applied_offset: &mut i64,
        rejected: Vec<Rejected>,
        new_offset: Option<i64>,
        input: &PartitionInput,
    ) -> Step<()> {
        // What the store sends elsewhere (dead letters) goes first; the
        // applied offset is saved after, with the rest.
        let mut redirected = Outbox::new();
        let mut kept: Vec<Rejected> = Vec::with_capacity(rejected.len());
        for entry in rejected {
            match self.store.redirect_rejected(&input.topic, context.partition, &entry) {
                Some(message) => {
                    tracing::error!(
                        service = self.settings.service,
                        partition = context.partition,
                        offset = entry.offset,
                        reason = %clean_text(&entry.reason, 2048),
                        topic = %message.topic,
                        "input that can never be applied, sent on instead of set aside"
                    );
                    redirected.push(message);
                }
                None => kept.push(entry),
            }
        }
        if let Step::Stop = self.publish_until_done(redirected, input).await {
            return Step::Stop;
        }
        let rejected = kept;
        let mut backoff = Backoff::new();
        loop {
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            let committed = self
                .commit(
                    context,
                    <S::State as OwnedState>::Writes::default(),
                    &rejected,
                    &input.topic,
                    new_offset,
                )
                .await;
            match committed {
                Ok(()) => {
                    if let Some(offset) = new_offset {
                        *applied_offset = offset;
                    }
                    self.registry.clear_condition(context.partition);
                    report_quarantined(self.settings.service, &input.topic, context.partition, &rejected);
                    return Step::Done(());
                }
                Err(CommitError::Fenced { .. }) => return Step::Stop,
                Err(CommitError::Sql(error)) => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition = context.partition, %error, "setting input aside failed; retrying");
                    self.note_transient(context.partition, format!("database: {error}"));
                    backoff.wait().await;
                }
            }
        }
    }

    /// Publish, retrying what fails for a reason that passes until it works
    /// or the partition is given up (the next owner re-sends from the saved
    /// state). A message the broker refuses for what it is (too large) can
    /// never be sent: it is set aside in the quarantine table with the reason,
    /// so nothing is dropped silently.
    pub(super) async fn publish_until_done(&self, mut outbox: Outbox, input: &PartitionInput) -> Step<()> {
        let links = outbox.take_links();
        if !links.is_empty() {
            match &self.links {
                Some(sink) => sink.deliver(links).await,
                None => tracing::error!(
                    service = self.settings.service,
                    partition = input.partition,
                    "link entries but no link sink; dropped"
                ),
            }
        }
        if outbox.is_empty() {
            return Step::Done(());
        }
        let spans = outbox.take_spans();
        let mut pending = outbox.into_messages();
        for (index, span) in spans {
            if let Some(message) = pending.get_mut(index) {
                crate::telemetry::record_send_span(&mut message.headers, &span);
            }
        }
        let mut backoff = Backoff::new();
        let condition = format!(
            "{} publishing from partition {}",
            self.settings.service, input.partition
        );
        loop {
            let results = self.publisher.send_each(&pending).await;
            let mut failed: Vec<OutMsg> = Vec::new();
            let mut refused: Vec<(OutMsg, String)> = Vec::new();
            let mut last_error = None;
            for (result, message) in results.into_iter().zip(pending) {
                match result {
                    Ok(()) => {}
                    Err(error) if classify_kafka(&error).is_transient() => {
                        last_error = Some(error.to_string());
                        failed.push(message);
                    }
                    Err(error) => refused.push((message, error.to_string())),
                }
            }
            if !refused.is_empty() {
                self.quarantine_refused(input, refused).await;
            }
            if failed.is_empty() {
                self.registry.readiness().clear(&condition);
                return Step::Done(());
            }
            let error = last_error.unwrap_or_default();
            tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition = input.partition, %error, messages = failed.len(), "publish failed, retrying");
            self.registry
                .readiness()
                .set(condition.clone(), format!("publishing failed: {error}"));
            if input.stop.is_cancelled() {
                self.registry.readiness().clear(&condition);
                return Step::Stop;
            }
            backoff.wait().await;
            pending = failed;
        }
    }

    /// Outgoing messages the broker refuses for what they are: saved with
    /// the reason (not fenced: it is a record, not a decision).
    async fn quarantine_refused(&self, input: &PartitionInput, refused: Vec<(OutMsg, String)>) {
        for (message, error) in refused {
            let rejected = Rejected {
                offset: -1,
                entry: message.payload,
                reason: format!("the broker refused this message for {} ({error})", message.topic),
            };
            let mut backoff = Backoff::new();
            loop {
                let saved = async {
                    let mut connection = self.pool.acquire().await?;
                    insert_quarantined(
                        &mut connection,
                        &message.topic,
                        input.partition,
                        std::slice::from_ref(&rejected),
                    )
                    .await
                }
                .await;
                match saved {
                    Ok(()) => {
                        report_quarantined(
                            self.settings.service,
                            &message.topic,
                            input.partition,
                            std::slice::from_ref(&rejected),
                        );
                        break;
                    }
                    Err(error) if input.stop.is_cancelled() => {
                        tracing::error!(service = self.settings.service, %error, reason = %rejected.reason, "could not set a refused message aside before stopping");
                        break;
                    }
                    Err(error) => {
                        tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, %error, "setting a refused message aside failed; retrying");
                        backoff.wait().await;
                    }
                }
            }
        }
    }
}
