//! Taking a partition over (bump the epoch, load, adopt a lost log,
//! re-send what the state implies) and reloading its saved state.

use sqlx::Connection;

use super::task::{PartitionTask, Step, OWNER_ALIVE_WITHIN, WATERMARKS_TIMEOUT};
use super::{bump_epoch, OwnedState, OwnedStore, OwnerContext};
use crate::clock::AnchoredClock;
use crate::fault::classify_sql;
use crate::kafka::{Outbox, PartitionInput};
use crate::retry::Backoff;

impl<S: OwnedStore> PartitionTask<S> {
    /// Bump the epoch, load, adopt a new log if the old one is gone, re-send.
    /// Retries every error with backoff: a partition is never left unowned
    /// because loading failed once (readiness says so meanwhile).
    pub(super) async fn take_over(&self, input: &PartitionInput) -> Step<(OwnerContext, S::State, i64)> {
        let partition = input.partition;
        let mut backoff = Backoff::new();
        loop {
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            match self.try_take_over(partition, input.provisional).await {
                Ok((context, mut state, mut applied_offset)) => {
                    match self
                        .adopt_if_log_lost(&context, &mut state, &mut applied_offset, input)
                        .await
                    {
                        Step::Done(()) => {}
                        Step::Stop => return Step::Stop,
                    }
                    let mut outbox = Outbox::new();
                    state.resend_all(context.clock.now_ms(), &mut outbox);
                    let resent = outbox.len();
                    match self.publish_until_done(outbox, input).await {
                        Step::Done(()) => {}
                        Step::Stop => return Step::Stop,
                    }
                    tracing::debug!(
                        service = self.settings.service,
                        partition,
                        resent,
                        "re-sent saved effects after takeover"
                    );
                    return Step::Done((context, state, applied_offset));
                }
                Err(error) => {
                    if classify_sql(&error).is_transient() {
                        tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition, %error, "takeover failed, retrying");
                    } else {
                        tracing::error!(service = self.settings.service, partition, %error, "takeover failed and will fail again until the cause is fixed; retrying");
                    }
                    self.registry
                        .set_condition(partition, format!("loading failed ({error}); retrying"));
                    backoff.wait().await;
                }
            }
        }
    }

    async fn try_take_over(
        &self,
        partition: i32,
        provisional: bool,
    ) -> Result<(OwnerContext, S::State, i64), sqlx::Error> {
        let mut connection = self.pool.acquire().await?;
        // A provisional owner resumes a partition whose owner was killed
        // (its row may still look fresh). Otherwise the previous owner is
        // alive and its pushes reached their streams when it is this process
        // (a provisional or failed task of ours), or its row moved within
        // `OWNER_ALIVE_WITHIN` and it did not release the partition: one
        // that released it stopped (in order, or crashed and let go), and
        // its streams ended with it.
        let previous: Option<(String, bool, i64)> = if provisional {
            None
        } else {
            sqlx::query_as(
                "SELECT owner_id, released, (extract(epoch FROM now() - updated_at) * 1000)::bigint
                 FROM owners WHERE partition = $1",
            )
            .bind(partition)
            .fetch_optional(&mut *connection)
            .await?
        };
        let alive_within_ms = i64::try_from(OWNER_ALIVE_WITHIN.as_millis()).unwrap_or(i64::MAX);
        let previous_owner_alive = previous.is_some_and(|(owner_id, released, still_ms)| {
            owner_id == self.settings.owner_id || (!released && still_ms < alive_within_ms)
        });
        let (epoch, applied_offset) = bump_epoch(
            &mut connection,
            partition,
            &self.settings.owner_id,
            &self.settings.endpoint,
            provisional,
        )
        .await?;
        let clock = AnchoredClock::from_postgres(&mut connection).await?;
        let context = OwnerContext {
            partition,
            epoch,
            clock,
            previous_owner_alive,
        };
        let mut transaction = connection.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *transaction)
            .await?;
        let state = self.store.load(&mut transaction, &context).await?;
        transaction.commit().await?;
        Ok((context, state, applied_offset))
    }

    /// A partition whose log now ends at or below the offset this partition
    /// had applied was lost by the broker (an in-memory broker restarted, the
    /// topic deleted and created again): every new message would be skipped
    /// as already applied. Say so, adopt the new log (applied offset just
    /// below its first offset, saved fenced) and re-send from state.
    ///
    /// A broker whose high watermark is too low (tansu reports its last
    /// batch's base offset + 1) makes this replay the end of the old log,
    /// which commands' idempotence makes harmless.
    pub(super) async fn adopt_if_log_lost(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        input: &PartitionInput,
    ) -> Step<()> {
        if *applied_offset < 0 {
            return Step::Done(());
        }
        let Some((low, high)) = input.offsets.watermarks(WATERMARKS_TIMEOUT).await else {
            return Step::Done(());
        };
        if high > *applied_offset {
            return Step::Done(());
        }
        // A log end at or below what was applied says the log was lost, or
        // the broker's high watermark is off (tansu's is): read the log at
        // that offset to know.
        match input.offsets.holds_offset(*applied_offset, WATERMARKS_TIMEOUT).await {
            Some(false) => {}
            Some(true) => {
                tracing::debug!(
                    service = self.settings.service,
                    topic = %input.topic,
                    partition = context.partition,
                    applied_offset = *applied_offset,
                    log_end = high,
                    "the broker's log end is below an offset it still holds; nothing was lost"
                );
                return Step::Done(());
            }
            None => {
                tracing::warn!(
                    service = self.settings.service,
                    topic = %input.topic,
                    partition = context.partition,
                    applied_offset = *applied_offset,
                    log_end = high,
                    "the broker's log end is below the applied offset and reading the log there failed; \
                     keeping the applied offset (checked again if the consumer goes back)"
                );
                return Step::Done(());
            }
        }
        let adopted = low.max(0) - 1;
        tracing::warn!(
            service = self.settings.service,
            topic = %input.topic,
            partition = context.partition,
            applied_offset = *applied_offset,
            log_start = low,
            log_end = high,
            "the partition's log ends at or below the offset this owner had applied: the broker lost the log \
             (restarted without storage, or the topic was created again); adopting the new log and re-sending \
             from state"
        );
        if let Step::Stop = self.save_adopted_offset(context, adopted, input).await {
            return Step::Stop;
        }
        *applied_offset = adopted;
        let mut outbox = Outbox::new();
        state.resend_all(context.clock.now_ms(), &mut outbox);
        self.publish_until_done(outbox, input).await
    }

    /// Saves the adopted log's applied offset, fenced, retrying what fails;
    /// `Stop` when fenced or stopping.
    async fn save_adopted_offset(&self, context: &OwnerContext, adopted: i64, input: &PartitionInput) -> Step<()> {
        let mut backoff = Backoff::new();
        loop {
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            let saved = sqlx::query(
                "UPDATE owners SET applied_offset = $3, updated_at = now() WHERE partition = $1 AND epoch = $2",
            )
            .bind(context.partition)
            .bind(context.epoch)
            .bind(adopted)
            .execute(&self.pool)
            .await;
            match saved {
                Ok(result) if result.rows_affected() == 1 => return Step::Done(()),
                Ok(_) => return Step::Stop,
                Err(error) => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition = context.partition, %error, "saving the adopted log's offset failed, retrying");
                    backoff.wait().await;
                }
            }
        }
    }

    /// Replace `state` with what is saved (without bumping the epoch),
    /// retrying until it works. Returns the saved applied offset; `Stop`
    /// when fenced or stopping.
    pub(super) async fn reload_until_done(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        input: &PartitionInput,
    ) -> Step<i64> {
        let mut backoff = Backoff::new();
        loop {
            if input.stop.is_cancelled() {
                return Step::Stop;
            }
            match self.reload(context).await {
                Ok(Some((reloaded, applied_offset))) => {
                    *state = reloaded;
                    state.begin_serving(context.clock.now_ms());
                    return Step::Done(applied_offset);
                }
                Ok(None) => return Step::Stop,
                Err(error) => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition = context.partition, %error, "reload failed; retrying");
                    self.note_transient(context.partition, format!("reloading: {error}"));
                    backoff.wait().await;
                }
            }
        }
    }

    /// Reload the state without bumping the epoch. `None` when fenced.
    async fn reload(&self, context: &OwnerContext) -> Result<Option<(S::State, i64)>, sqlx::Error> {
        let mut transaction = self.pool.begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            .execute(&mut *transaction)
            .await?;
        let row: Option<(i64, i64)> = sqlx::query_as("SELECT epoch, applied_offset FROM owners WHERE partition = $1")
            .bind(context.partition)
            .fetch_optional(&mut *transaction)
            .await?;
        let Some((epoch, applied_offset)) = row else {
            return Ok(None);
        };
        if epoch != context.epoch {
            return Ok(None);
        }
        let state = self.store.load(&mut transaction, context).await?;
        transaction.commit().await?;
        Ok(Some((state, applied_offset)))
    }
}
