//! What limit-grant's decisions record, as data.

use std::sync::Arc;

use sluice_proto::v1 as pb;

use super::adaptive::Change;
use super::shadow::WouldHaveWaited;
use super::{KeyId, TicketKey, TicketRecord};

/// What a decision records once its batch is committed, each once however
/// often it is sent again (`crate::observe` carries it out).
#[derive(Clone, Debug, PartialEq)]
pub enum LimitEffect {
    /// A new grant (not a re-send): the grant counter, the wait histogram
    /// and the `limit-grant.grant` span.
    Granted {
        record: TicketRecord,
        kind: pb::LimitKind,
        holders: usize,
        max: i64,
    },
    /// A shadow-mode key's simulated grant: the would-have-waited metric,
    /// and a `limit-grant.shadow` span on the job's trace.
    ShadowWaited {
        key_id: Arc<KeyId>,
        simulated: WouldHaveWaited,
    },
    /// A grant in shadow mode took the key's holders over its max.
    ShadowExceeded { key_id: Arc<KeyId> },
    /// An adaptive key's computed max changed (logged and counted).
    AdaptiveChanged { key_id: Arc<KeyId>, change: Change },
    /// A ticket nobody stood behind was reclaimed (logged).
    TicketReclaimed { key_id: Arc<KeyId>, ticket: TicketKey },
}
