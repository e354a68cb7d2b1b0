//! One batch of a partition task: decide, commit fenced by the epoch,
//! and, for a batch that fails every time, apply it again in parts to set
//! aside what still fails.

use super::task::{BatchEnd, PartitionTask, Step};
use super::{
    commit_fenced, fence_and_advance, insert_quarantined, report_quarantined, CommitError, FencedStatement, OwnedState,
    OwnedStore, OwnerContext, Rejected, Reply, WriteSet,
};
use crate::fault::{classify_sql, panic_message};
use crate::faults::FaultPoint;
use crate::kafka::{batch_entries, single_entry_batch, InMsg, Outbox, PartitionInput, PartitionTaskError};
use crate::retry::Backoff;

impl<S: OwnedStore> PartitionTask<S> {
    /// One batch: decide, commit (fenced), publish, reply. A batch that fails
    /// every time is applied again in parts, and what still fails is set
    /// aside (`isolate`).
    pub(super) async fn process_batch(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        messages: &[InMsg],
        locals: Vec<<S::State as OwnedState>::Local>,
        input: &PartitionInput,
    ) -> Result<Step<()>, PartitionTaskError> {
        let new_offset = messages.last().map(|message| message.offset);
        match self
            .run_batch(context, state, applied_offset, messages, locals, new_offset, input)
            .await?
        {
            BatchEnd::Done => Ok(Step::Done(())),
            BatchEnd::Stop => Ok(Step::Stop),
            BatchEnd::Permanent(reason) => {
                self.isolate(context, state, applied_offset, messages, input, reason)
                    .await
            }
        }
    }

    /// Apply a failed batch's messages one at a time; a message that still
    /// fails alone is applied one entry at a time, and an entry that fails
    /// alone is set aside. The local requests of the failed batch were
    /// answered with an error (their callers retry).
    async fn isolate(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        messages: &[InMsg],
        input: &PartitionInput,
        reason: String,
    ) -> Result<Step<()>, PartitionTaskError> {
        tracing::warn!(
            service = self.settings.service,
            partition = context.partition,
            messages = messages.len(),
            %reason,
            "a batch fails every time it is applied; applying it in parts to set aside what fails"
        );
        for message in messages {
            let single = std::slice::from_ref(message);
            let reason = match self
                .run_batch(
                    context,
                    state,
                    applied_offset,
                    single,
                    Vec::new(),
                    Some(message.offset),
                    input,
                )
                .await?
            {
                BatchEnd::Done => continue,
                BatchEnd::Stop => return Ok(Step::Stop),
                BatchEnd::Permanent(reason) => reason,
            };
            let payload = message.payload.as_deref().unwrap_or_default();
            let entries: Vec<&[u8]> = batch_entries(payload).unwrap_or_default();
            if entries.len() <= 1 {
                let whole = Rejected {
                    offset: message.offset,
                    entry: payload.to_vec(),
                    reason,
                };
                match self
                    .quarantine(context, applied_offset, vec![whole], Some(message.offset), input)
                    .await
                {
                    Step::Done(()) => continue,
                    Step::Stop => return Ok(Step::Stop),
                }
            }
            if let Step::Stop = self
                .apply_entries_alone(context, state, applied_offset, message, entries, input)
                .await?
            {
                return Ok(Step::Stop);
            }
        }
        Ok(Step::Done(()))
    }

    /// Applies each entry of `message` on its own, setting aside those that
    /// fail alone.
    async fn apply_entries_alone(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        message: &InMsg,
        entries: Vec<&[u8]>,
        input: &PartitionInput,
    ) -> Result<Step<()>, PartitionTaskError> {
        let count = entries.len();
        for (index, entry) in entries.into_iter().enumerate() {
            // Only the last entry saves the message's offset: a crash in
            // between re-applies the message, and commands are idempotent.
            let new_offset = (index + 1 == count).then_some(message.offset);
            let part = InMsg {
                payload: Some(single_entry_batch(entry)),
                ..message.clone()
            };
            match self
                .run_batch(context, state, applied_offset, &[part], Vec::new(), new_offset, input)
                .await?
            {
                BatchEnd::Done => {}
                BatchEnd::Stop => return Ok(Step::Stop),
                BatchEnd::Permanent(reason) => {
                    let rejected = Rejected {
                        offset: message.offset,
                        entry: entry.to_vec(),
                        reason,
                    };
                    if let Step::Stop = self
                        .quarantine(context, applied_offset, vec![rejected], new_offset, input)
                        .await
                    {
                        return Ok(Step::Stop);
                    }
                }
            }
        }
        Ok(Step::Done(()))
    }

    /// Decide, commit, publish and reply for `messages` and `locals`, saving
    /// `new_offset` as applied. Faults that pass are retried here.
    #[allow(clippy::too_many_arguments)]
    async fn run_batch(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        messages: &[InMsg],
        locals: Vec<<S::State as OwnedState>::Local>,
        new_offset: Option<i64>,
        input: &PartitionInput,
    ) -> Result<BatchEnd, PartitionTaskError> {
        let partition = context.partition;
        let mut locals = Some(locals);
        let mut backoff = Backoff::new();
        loop {
            let mut writes = <S::State as OwnedState>::Writes::default();
            let mut outbox = Outbox::new();
            let mut replies: Vec<Reply> = Vec::new();
            let mut rejected: Vec<Rejected> = Vec::new();
            let taken = locals.take().unwrap_or_default();
            let batch_locals = match self
                .prepare_until_done(partition, state, messages, taken, input, &mut backoff)
                .await
            {
                Ok(batch_locals) => batch_locals,
                Err(end) => return Ok(end),
            };
            let now_ms = context.clock.now_ms();
            let decided = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                state.apply(
                    now_ms,
                    messages,
                    batch_locals,
                    &mut writes,
                    &mut outbox,
                    &mut replies,
                    &mut rejected,
                );
            }));
            if let Err(panic) = decided {
                return Ok(self.reload_after_panic(context, state, input, panic, replies).await);
            }
            if writes.is_empty() && outbox.is_empty() && replies.is_empty() && rejected.is_empty() {
                return Ok(BatchEnd::Done);
            }
            match self
                .commit_batch(context, writes, &rejected, input, new_offset, applied_offset)
                .await
            {
                Ok(()) => {}
                Err(CommitError::Fenced { .. }) => return Ok(BatchEnd::Stop),
                Err(CommitError::Sql(error)) => {
                    // Local requests of the batch get an error.
                    drop(replies);
                    match self
                        .recover_from_failed_commit(
                            context,
                            state,
                            applied_offset,
                            new_offset,
                            input,
                            error,
                            &mut backoff,
                        )
                        .await
                    {
                        Some(end) => return Ok(end),
                        None => continue,
                    }
                }
            }
            if state.crash_after_commit() || self.faults.hit(FaultPoint::OwnerAfterCommitBeforePublish) {
                return Err(PartitionTaskError::Crashed);
            }
            return self.publish_committed(outbox, replies, input).await;
        }
    }

    /// A batch's decision panicked: its local requests get an error (their
    /// callers retry) and the partition is reloaded from PostgreSQL.
    async fn reload_after_panic(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        input: &PartitionInput,
        panic: Box<dyn std::any::Any + Send>,
        replies: Vec<Reply>,
    ) -> BatchEnd {
        let reason = format!("panicked while applying: {}", panic_message(panic.as_ref()));
        tracing::error!(service = self.settings.service, partition = context.partition, %reason, "applying a batch panicked; reloading the partition");
        drop(replies);
        match self.reload_until_done(context, state, input).await {
            Step::Done(_) => BatchEnd::Permanent(reason),
            Step::Stop => BatchEnd::Stop,
        }
    }

    /// Commits a decided batch, timed, and on success saves `new_offset` as
    /// applied and reports what was set aside; a fence is logged here.
    ///
    /// Every batch that answers or sends anything is committed fenced,
    /// also when it writes nothing (an answer read from memory, a
    /// re-sent grant): the fence proves this instance still owns the
    /// partition, so its memory is the latest saved state. An owner
    /// fenced while idle answered from a state a newer owner had
    /// already changed (a `Complete` answered STALE for a claim the
    /// new owner had made: the job ran twice). docs/architecture.md,
    /// "Answers follow commits".
    async fn commit_batch(
        &self,
        context: &OwnerContext,
        writes: <S::State as OwnedState>::Writes,
        rejected: &[Rejected],
        input: &PartitionInput,
        new_offset: Option<i64>,
        applied_offset: &mut i64,
    ) -> Result<(), CommitError> {
        let partition = context.partition;
        let started = std::time::Instant::now();
        let committed = self.commit(context, writes, rejected, &input.topic, new_offset).await;
        match &committed {
            Ok(()) => {
                crate::metrics::metrics().commit_seconds.record(
                    started.elapsed().as_secs_f64(),
                    &[opentelemetry::KeyValue::new("service", self.settings.service)],
                );
                if let Some(offset) = new_offset {
                    *applied_offset = offset;
                }
                self.registry.clear_condition(partition);
                report_quarantined(self.settings.service, &input.topic, partition, rejected);
            }
            Err(CommitError::Fenced { current, ours, .. }) => {
                tracing::warn!(
                    service = self.settings.service,
                    partition,
                    ours,
                    current,
                    "fenced by a newer owner; giving the partition up"
                );
            }
            Err(CommitError::Sql(_)) => {}
        }
        committed
    }

    /// Read what a batch needs from PostgreSQL into the state, retrying
    /// what fails for a reason that passes; hands `locals` back. `Err`: how
    /// the batch ends.
    async fn prepare_until_done(
        &self,
        partition: i32,
        state: &mut S::State,
        messages: &[InMsg],
        locals: Vec<<S::State as OwnedState>::Local>,
        input: &PartitionInput,
        backoff: &mut Backoff,
    ) -> Result<Vec<<S::State as OwnedState>::Local>, BatchEnd> {
        loop {
            match self.store.prepare(&self.pool, state, messages, &locals).await {
                Ok(prepared) => {
                    state.prepared(prepared);
                    return Ok(locals);
                }
                Err(error) if classify_sql(&error).is_transient() => {
                    tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition, %error, "reading for a batch failed; retrying");
                    self.note_transient(partition, format!("database: {error}"));
                    if input.stop.is_cancelled() {
                        return Err(BatchEnd::Stop);
                    }
                    backoff.wait().await;
                }
                Err(error) => {
                    return Err(BatchEnd::Permanent(format!(
                        "PostgreSQL refuses the reads this batch needs: {error}"
                    )));
                }
            }
        }
    }

    /// A batch's commit failed. The in-memory state holds the batch's
    /// uncommitted decisions: rebuild it from PostgreSQL, then say how the
    /// batch ends, or `None` to decide it again (a fault that passes; one
    /// that does not ends it as permanent, and the caller decides its
    /// messages in parts).
    #[allow(clippy::too_many_arguments)]
    async fn recover_from_failed_commit(
        &self,
        context: &OwnerContext,
        state: &mut S::State,
        applied_offset: &mut i64,
        new_offset: Option<i64>,
        input: &PartitionInput,
        error: sqlx::Error,
        backoff: &mut Backoff,
    ) -> Option<BatchEnd> {
        let partition = context.partition;
        let transient = classify_sql(&error).is_transient();
        if transient {
            tracing::warn!(retrying_for = ?backoff.retrying_for(), attempts = backoff.attempts(), service = self.settings.service, partition, %error, "batch commit failed; retrying");
            self.note_transient(partition, format!("database: {error}"));
            backoff.wait().await;
        } else {
            tracing::error!(service = self.settings.service, partition, %error, "PostgreSQL refuses the batch's commit");
        }
        let reloaded_offset = match self.reload_until_done(context, state, input).await {
            Step::Done(reloaded_offset) => reloaded_offset,
            Step::Stop => return Some(BatchEnd::Stop),
        };
        // The saved offset shows whether a batch of Kafka input went through
        // after all. A batch without Kafka input (timers, local requests)
        // leaves no such trace and may have gone through too; deciding it
        // again would then find nothing to do and its messages would never
        // be sent. In both cases what the reloaded state holds is sent again
        // (every receiver ignores a repeat).
        let committed_anyway = new_offset.is_some_and(|offset| reloaded_offset >= offset);
        if committed_anyway || new_offset.is_none() {
            if committed_anyway {
                *applied_offset = reloaded_offset;
            }
            let mut outbox = Outbox::new();
            state.resend_all(context.clock.now_ms(), &mut outbox);
            if let Step::Stop = self.publish_until_done(outbox, input).await {
                return Some(BatchEnd::Stop);
            }
            if committed_anyway {
                return Some(BatchEnd::Done);
            }
        }
        if !transient {
            return Some(BatchEnd::Permanent(format!("PostgreSQL refused the commit: {error}")));
        }
        None
    }

    pub(super) async fn commit(
        &self,
        context: &OwnerContext,
        writes: <S::State as OwnedState>::Writes,
        rejected: &[Rejected],
        topic: &str,
        new_offset: Option<i64>,
    ) -> Result<(), CommitError> {
        if !writes.is_empty() && self.faults.hit(FaultPoint::OwnerCommitRefused) {
            return Err(CommitError::Sql(crate::faults::refused_by_storage()));
        }
        if rejected.is_empty() {
            let statement = if writes.is_empty() {
                // The fence alone: one statement.
                Some(FencedStatement::default())
            } else {
                self.store.one_statement(&writes)
            };
            if let Some(statement) = statement {
                return commit_fenced(&self.pool, context.partition, context.epoch, new_offset, statement).await;
            }
        }
        let mut transaction = self.pool.begin().await?;
        fence_and_advance(&mut transaction, context.partition, context.epoch, new_offset).await?;
        if !writes.is_empty() {
            self.store.persist(&mut transaction, context, writes).await?;
        }
        insert_quarantined(&mut transaction, topic, context.partition, rejected).await?;
        transaction.commit().await?;
        Ok(())
    }
}
