//! A batch: its messages, then its queries, each command to its decision;
//! what the saved state implies was sent, for a new owner.

use sluice_common::core::{checked_trace, Core, KeyStat, Query};
use sluice_common::kafka::{InMsg, Outbox};
use sluice_common::owner::apply_entries;
use sluice_proto::v1 as pb;

use super::acquire::observed_run;
use super::{Decided, LimitAnswer, LimitEffect, LimitPartition, LimitQuery, LimitWrites, TicketKey};

impl LimitPartition {
    /// Apply one decoded command.
    pub fn apply_command(&mut self, now_ms: i64, command: pb::LimitCommand, out: &mut Decided) -> Result<(), String> {
        self.check_command(&command)?;
        let trace = checked_trace(&command.trace.unwrap_or_default());
        let Some(inner) = command.command else {
            return Err("limit command without a command".to_string());
        };
        match inner {
            pb::limit_command::Command::Acquire(acquire) => self.acquire(now_ms, acquire, trace, out),
            pb::limit_command::Command::Release(release) => {
                let key_id = self.checked_key(release.key.as_ref())?;
                let observed = observed_run(&release);
                let ticket = TicketKey::from_proto(&release.ticket.unwrap_or_default());
                self.release(now_ms, &key_id, &ticket, observed, out);
                Ok(())
            }
            pb::limit_command::Command::StandBehind(stand_behind) => {
                self.stand_behind(now_ms, stand_behind, out);
                Ok(())
            }
            pb::limit_command::Command::SetOverride(set_override) => {
                let key_id = self.checked_key(set_override.key.as_ref())?;
                self.set_override(now_ms, &key_id, set_override.max, out);
                Ok(())
            }
            pb::limit_command::Command::SetFloatingMax(set_max) => {
                let key_id = self.checked_key(set_max.key.as_ref())?;
                self.set_floating_max(now_ms, &key_id, set_max.max, &set_max.task_id, out);
                Ok(())
            }
            pb::limit_command::Command::DeleteFloating(delete) => {
                let key_id = self.checked_key(delete.key.as_ref())?;
                self.delete_floating(now_ms, &key_id, out);
                Ok(())
            }
        }
    }
}

impl Core for LimitPartition {
    type Query = LimitQuery;
    type Answer = LimitAnswer;
    type Writes = LimitWrites;
    type Effect = LimitEffect;
    type Prepared = ();

    fn apply(&mut self, now_ms: i64, messages: &[InMsg], queries: Vec<Query<LimitQuery>>) -> Decided {
        let mut out = Decided::new();
        self.refresh_timers(now_ms, &mut out);
        let mut rejected = Vec::new();
        for message in messages {
            apply_entries(message, "limit command", &mut rejected, |command: pb::LimitCommand| {
                self.apply_command(now_ms, command, &mut out)
            });
        }
        out.rejected.append(&mut rejected);
        for query in queries {
            self.apply_query(now_ms, query, &mut out);
        }
        self.close_batch(&mut out.writes);
        out
    }

    fn resend_all(&self, _now_ms: i64, outbox: &mut Outbox) {
        for (key_id, state) in &self.keys {
            for holder in state.holders.values() {
                let max = i64::from(state.max_for(&holder.record));
                let kind = state.record.grant_kind(&holder.record);
                self.emit_grant(&holder.record, kind, state.holders.len(), max, outbox);
            }
            // The last refresh-due event may have been saved and not sent.
            if let Some(floating) = &state.record.floating {
                self.emit_refresh_due(
                    key_id,
                    floating,
                    state.waiters.len(),
                    &pb::TraceContext::default(),
                    outbox,
                );
            }
        }
    }

    fn next_wakeup_ms(&self) -> Option<i64> {
        self.next_refresh_ms()
    }

    fn key_stats(&self, _now_ms: i64) -> Vec<KeyStat> {
        self.per_key_stats()
    }
}
