//! What a limit command must satisfy before it changes anything.

use sluice_common::partition::key_partition;
use sluice_common::validate::{
    check_adaptive_values, check_floating_values, check_key_ref, check_text, check_ticket, check_u32, check_u64,
    FieldError, MAX_BACKOFF_MS, MAX_CONCURRENCY, MAX_ID_BYTES,
};
use sluice_proto::v1 as pb;

use super::{KeyId, LimitPartition};

impl LimitPartition {
    /// Everything a command must satisfy before it changes anything: the
    /// bounds admission checks at the edge, so what admission accepts is
    /// accepted here, and a command that fails them is set aside alone.
    pub fn check_command(&self, command: &pb::LimitCommand) -> Result<(), String> {
        let key = self.check_fields(command).map_err(|error| error.to_string())?;
        match key {
            Some(key) => self.checked_key(Some(key)).map(|_| ()),
            None => Ok(()),
        }
    }

    /// The fields of `command`; its key when it names one.
    pub(super) fn check_fields<'a>(&self, command: &'a pb::LimitCommand) -> Result<Option<&'a pb::KeyRef>, FieldError> {
        use pb::limit_command::Command;
        let input = self.settings.input;
        let Some(inner) = &command.command else {
            return Err(FieldError::new("command", "must be set"));
        };
        let key = match inner {
            Command::Acquire(acquire) => {
                check_ticket("acquire.ticket", acquire.ticket.as_ref())?;
                check_u32("acquire.priority", acquire.priority, 0, 99)?;
                check_text("acquire.fairness_key", &acquire.fairness_key, input.max_key_bytes)?;
                match &acquire.limit {
                    Some(pb::acquire_ticket::Limit::MaxConcurrency(max)) => {
                        check_u32("acquire.max_concurrency", *max, 1, MAX_CONCURRENCY)?;
                    }
                    Some(pb::acquire_ticket::Limit::Floating(floating)) => {
                        check_floating_values("acquire.floating", floating, input.max_floating_metadata_bytes)?;
                    }
                    Some(pb::acquire_ticket::Limit::Adaptive(adaptive)) => {
                        check_adaptive_values("acquire.adaptive", adaptive)?;
                    }
                    None => return Err(FieldError::new("acquire.limit", "must be set")),
                }
                acquire.key.as_ref()
            }
            Command::Release(release) => {
                check_ticket("release.ticket", release.ticket.as_ref())?;
                release.key.as_ref()
            }
            Command::StandBehind(stand_behind) => {
                check_text("stand_behind.sweep_id", &stand_behind.sweep_id, MAX_ID_BYTES)?;
                check_u32(
                    "stand_behind.part",
                    stand_behind.part,
                    0,
                    stand_behind.parts.saturating_sub(1),
                )?;
                check_u64(
                    "stand_behind.grace_ms",
                    stand_behind.grace_ms,
                    0,
                    u64::try_from(MAX_BACKOFF_MS).unwrap_or(u64::MAX),
                )?;
                for (index, ticket) in stand_behind.tickets.iter().enumerate() {
                    check_ticket(&format!("stand_behind.tickets[{index}]"), Some(ticket))?;
                }
                return Ok(None);
            }
            Command::SetOverride(set_override) => {
                if let Some(max) = set_override.max {
                    check_u32("set_override.max", max, 0, MAX_CONCURRENCY)?;
                }
                set_override.key.as_ref()
            }
            Command::SetFloatingMax(set_max) => {
                check_u32("set_floating_max.max", set_max.max, 1, MAX_CONCURRENCY)?;
                check_text("set_floating_max.task_id", &set_max.task_id, MAX_ID_BYTES)?;
                set_max.key.as_ref()
            }
            Command::DeleteFloating(delete) => delete.key.as_ref(),
        };
        check_key_ref("key", key, input.max_key_bytes)?;
        Ok(key)
    }

    /// The key of a command, refused unless it hashes to this partition.
    pub(super) fn checked_key(&self, key: Option<&pb::KeyRef>) -> Result<KeyId, String> {
        let Some(key) = key else {
            return Err("command without a key".to_string());
        };
        let expected = key_partition(&key.tenant, &key.key, self.settings.limit_partitions);
        if expected != self.settings.partition {
            return Err(format!(
                "key ({:?}, {:?}) hashes to partition {expected}, not {}: a producer partitions differently \
                 or the topic's partition count changed",
                key.tenant, key.key, self.settings.partition
            ));
        }
        Ok((key.tenant.clone(), key.key.clone()))
    }
}
