//! The shape of every owner's core (docs/architecture.md, "Where each
//! decision lives"): a partition's state takes its inputs and a clock and
//! returns its decisions as a plain value — the writes to commit, what to
//! send, the answers (by query id), and the effects to carry out after them
//! (metrics, spans, pushes to workers). The owner runtime commits, then
//! sends, then answers, then carries the effects out, so each decision is
//! counted once and can be replayed from its inputs (the simulation does).
//!
//! A core has no wall clock, channel, shared hub, tracer or fault hook:
//! `tests::cores_are_pure` checks the core modules' sources.

use std::collections::HashMap;
use std::sync::Arc;

use tokio::sync::oneshot;

use crate::kafka::{InMsg, Outbox};
pub use crate::metrics::KeyStat;
use crate::owner::{OwnedState, Rejected, Reply, WriteSet};
/// Plain data and pure checks a core takes from modules that also hold I/O
/// (the trace context a ticket carries, checked as it arrives).
pub use crate::telemetry::{checked as checked_trace, CompactTraceContext};

/// Which query an answer is for, unique within a partition's batch.
pub type QueryId = u64;

/// A request to a partition from this process (a gRPC call, a link), as
/// data.
#[derive(Clone, Debug, PartialEq)]
pub struct Query<Q> {
    pub id: QueryId,
    pub body: Q,
}

/// What a batch decided.
#[derive(Debug)]
pub struct Decisions<W, A, E> {
    /// Saved (fenced) before anything below happens.
    pub writes: W,
    /// Kafka messages and link entries, sent once `writes` are saved.
    pub sends: Outbox,
    /// Answers to the batch's queries, by id, given after the sends.
    pub answers: Vec<(QueryId, A)>,
    /// Carried out last, in order: observations of the decisions (metrics,
    /// spans, logs), pushes to workers.
    pub effects: Vec<E>,
    /// Input that can never be applied, set aside with the reason.
    pub rejected: Vec<Rejected>,
}

impl<W: Default, A, E> Default for Decisions<W, A, E> {
    fn default() -> Self {
        Decisions {
            writes: W::default(),
            sends: Outbox::new(),
            answers: Vec::new(),
            effects: Vec::new(),
            rejected: Vec::new(),
        }
    }
}

impl<W: Default, A, E> Decisions<W, A, E> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn answer(&mut self, id: QueryId, answer: A) {
        self.answers.push((id, answer));
    }

    pub fn effect(&mut self, effect: E) {
        self.effects.push(effect);
    }
}

/// A partition's in-memory state and its decisions. Pure: see the module.
pub trait Core: Send + 'static {
    /// What this process asks of the partition (gRPC calls, links).
    type Query: Send + 'static;
    type Answer: Send + 'static;
    type Writes: WriteSet;
    /// What the runtime carries out after the answers.
    type Effect: Send + 'static;
    /// What the store read for a batch before it is decided (`()`: nothing).
    type Prepared: Default + Send;

    /// Take what the store read for the batch about to be decided.
    fn prepared(&mut self, _prepared: Self::Prepared) {}

    /// Advance to `now_ms` (timers), then apply `messages` and `queries` in
    /// order. An entry that can never be applied changes nothing and is
    /// rejected with its bytes and the reason; the others are applied.
    fn apply(
        &mut self,
        now_ms: i64,
        messages: &[InMsg],
        queries: Vec<Query<Self::Query>>,
    ) -> Decisions<Self::Writes, Self::Answer, Self::Effect>;

    /// Everything the saved state implies was sent, for a new owner to send
    /// again (never an effect: a re-send is not a new decision).
    fn resend_all(&self, now_ms: i64, sends: &mut Outbox);

    /// When `apply` must run next even without input.
    fn next_wakeup_ms(&self) -> Option<i64>;

    /// The partition's keys at `now_ms`, for per-key metrics (bounded by
    /// configuration).
    fn key_stats(&self, _now_ms: i64) -> Vec<KeyStat> {
        Vec::new()
    }
}

/// Carries out a core's effects (the service's metrics, spans, pushes).
pub trait Effector<E>: Send + Sync + 'static {
    fn effect(&self, effect: E);
}

/// An effector that does nothing (tests, tools).
pub struct NoEffects;

impl<E> Effector<E> for NoEffects {
    fn effect(&self, _effect: E) {}
}

/// What the owner runtime hands a core's partition task: a query with the
/// channel its answer goes to, or a barrier.
pub enum Ask<C: Core> {
    Query {
        query: C::Query,
        reply: oneshot::Sender<C::Answer>,
    },
    /// Answered once everything sent to the partition before it is applied
    /// and committed (tests wait on it instead of sleeping).
    Barrier(oneshot::Sender<()>),
}

impl<C: Core> crate::owner::BarrierLocal for Ask<C> {
    fn barrier(reply: oneshot::Sender<()>) -> Self {
        Ask::Barrier(reply)
    }
}

impl<C: Core> Ask<C> {
    pub fn query(&self) -> Option<&C::Query> {
        match self {
            Ask::Query { query, .. } => Some(query),
            Ask::Barrier(_) => None,
        }
    }
}

/// A core run by the owner runtime: queries get ids, answers go back to
/// their callers' channels, effects to the effector once committed.
pub struct Owned<C: Core> {
    core: C,
    effector: Arc<dyn Effector<C::Effect>>,
    next_query: QueryId,
}

impl<C: Core> Owned<C> {
    pub fn new(core: C, effector: Arc<dyn Effector<C::Effect>>) -> Self {
        Owned {
            core,
            effector,
            next_query: 0,
        }
    }

    pub fn core(&self) -> &C {
        &self.core
    }

    pub fn core_mut(&mut self) -> &mut C {
        &mut self.core
    }
}

impl<C: Core> OwnedState for Owned<C> {
    type Local = Ask<C>;
    type Writes = C::Writes;
    type Prepared = C::Prepared;

    fn prepared(&mut self, prepared: Self::Prepared) {
        self.core.prepared(prepared);
    }

    fn apply(
        &mut self,
        now_ms: i64,
        messages: &[InMsg],
        locals: Vec<Self::Local>,
        writes: &mut Self::Writes,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
        rejected: &mut Vec<Rejected>,
    ) {
        let mut queries = Vec::with_capacity(locals.len());
        let mut waiting: HashMap<QueryId, oneshot::Sender<C::Answer>> = HashMap::with_capacity(locals.len());
        let mut barriers = Vec::new();
        for local in locals {
            match local {
                Ask::Query { query, reply } => {
                    self.next_query = self.next_query.wrapping_add(1);
                    let id = self.next_query;
                    waiting.insert(id, reply);
                    queries.push(Query { id, body: query });
                }
                Ask::Barrier(reply) => barriers.push(reply),
            }
        }
        let decided = self.core.apply(now_ms, messages, queries);
        *writes = decided.writes;
        outbox.append(decided.sends);
        rejected.extend(decided.rejected);
        for (id, answer) in decided.answers {
            if let Some(reply) = waiting.remove(&id) {
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
        }
        for reply in barriers {
            replies.push(Box::new(move || {
                let _ = reply.send(());
            }));
        }
        for effect in decided.effects {
            let effector = self.effector.clone();
            outbox.observe(move || effector.effect(effect));
        }
    }

    fn resend_all(&self, now_ms: i64, outbox: &mut Outbox) {
        self.core.resend_all(now_ms, outbox);
    }

    fn next_wakeup_ms(&self) -> Option<i64> {
        self.core.next_wakeup_ms()
    }

    fn key_stats(&self, now_ms: i64) -> Vec<KeyStat> {
        self.core.key_stats(now_ms)
    }
}
