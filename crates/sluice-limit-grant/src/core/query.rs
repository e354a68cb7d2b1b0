//! What this instance's gRPC handlers and admission's links ask of a
//! partition, and the answers.

use std::sync::Arc;

use sluice_common::core::Query;
use sluice_common::owner::Rejected;
use sluice_proto::v1 as pb;

use super::{Decided, LimitChange, LimitPartition, TicketKey};

/// What this instance's gRPC handlers and admission's links ask of a
/// partition.
#[derive(Clone, Debug, PartialEq)]
pub enum LimitQuery {
    /// Answered with `LimitAnswer::KeyState`.
    SetLimit {
        tenant: String,
        key: String,
        change: LimitChange,
    },
    /// Answered with `LimitAnswer::Described`.
    DescribeKey {
        tenant: String,
        key: String,
        ticket: Option<TicketKey>,
        first_waiters: usize,
    },
    /// The partition's keys of `tenant` starting with `prefix`, after `after`
    /// in key order, at most `limit` (`ListKeys` gathers every partition's).
    /// Answered with `LimitAnswer::Keys`.
    ListKeys {
        tenant: String,
        prefix: String,
        after: String,
        limit: usize,
    },
    /// Limit commands from admission's link (the hot path), from the
    /// admission instance `client`. Answered `Applied` (after the commit).
    Link { commands: Vec<Vec<u8>>, client: Arc<str> },
    /// A stream now takes the grants of these job partitions: send again
    /// the grants of every ticket held for their jobs. Not answered:
    /// nobody waits for it, and a batch that answers is committed fenced
    /// even when it changes and sends nothing.
    ResendGrants { job_partitions: Vec<i32> },
}

/// The answer to a `LimitQuery`.
#[derive(Clone, Debug, PartialEq)]
pub enum LimitAnswer {
    /// The key after a `SetLimit`.
    KeyState(pb::KeyState),
    Described(pb::DescribeKeyResponse),
    Keys(Vec<pb::KeySummary>),
    /// Link commands applied (and, once the answer arrives, committed).
    Applied,
}

impl LimitPartition {
    /// Apply limit commands from admission's link: each one that can never
    /// be applied is set aside alone, with the reason.
    pub(super) fn apply_link_commands(&mut self, now_ms: i64, commands: Vec<Vec<u8>>, client: &str, out: &mut Decided) {
        for entry in commands {
            let outcome = <pb::LimitCommand as prost::Message>::decode(entry.as_slice())
                .map_err(|error| format!("undecodable limit command: {error}"))
                .and_then(|command| self.apply_command(now_ms, command, out));
            if let Err(reason) = outcome {
                out.rejected.push(Rejected {
                    offset: -1,
                    entry,
                    reason: format!("from admission {client} over its link: {reason}"),
                });
            }
        }
    }

    /// Apply one query and answer it (but a grant re-send).
    pub(super) fn apply_query(&mut self, now_ms: i64, query: Query<LimitQuery>, out: &mut Decided) {
        let answer = match query.body {
            LimitQuery::ResendGrants { job_partitions } => {
                self.resend_grants(&job_partitions, &mut out.sends);
                return;
            }
            LimitQuery::Link { commands, client } => {
                self.apply_link_commands(now_ms, commands, &client, out);
                LimitAnswer::Applied
            }
            LimitQuery::SetLimit { tenant, key, change } => {
                let key_id = (tenant, key);
                match change {
                    LimitChange::Max(max) => self.set_override(now_ms, &key_id, max, out),
                    LimitChange::FlowWeight { fairness_key, weight } => {
                        self.set_flow_weight(&key_id, fairness_key, weight, &mut out.writes);
                    }
                    LimitChange::Mode(mode) => self.set_mode(now_ms, &key_id, mode, out),
                }
                LimitAnswer::KeyState(self.describe(&key_id.0, &key_id.1, 10))
            }
            LimitQuery::DescribeKey {
                tenant,
                key,
                ticket,
                first_waiters,
            } => LimitAnswer::Described(self.describe_with_ticket(&tenant, &key, ticket.as_ref(), first_waiters)),
            LimitQuery::ListKeys {
                tenant,
                prefix,
                after,
                limit,
            } => LimitAnswer::Keys(self.list_keys(&tenant, &prefix, &after, limit)),
        };
        out.answer(query.id, answer);
    }
}
