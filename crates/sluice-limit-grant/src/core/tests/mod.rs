//! Tests of limit-grant's core, by command (the helpers build commands and
//! read what a batch sent).

mod adaptive;
mod effects;
mod floating;
mod grants;
mod image;
mod properties;
mod queries;
mod settings;
mod shadow;
mod sweep;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use prost::Message as _;
use sluice_common::core::{Core, Query};
use sluice_common::kafka::Outbox;
use sluice_common::link::Link;
use sluice_common::owner::WriteSet;
use sluice_common::partition::key_partition;
use sluice_common::validate::InputLimits;
use sluice_proto::v1 as pb;

use super::*;

const PARTITIONS: i32 = 1;

fn settings() -> PartitionSettings {
    PartitionSettings {
        partition: 0,
        limit_partitions: PARTITIONS,
        grants_partitions: 1,
        refresh_due_topic: Arc::from("refresh-due"),
        refresh_due_partitions: 1,
        max_message_bytes: 1_000_000,
        ticket_grace_ms: 30_000,
        input: InputLimits::default(),
    }
}

fn partition() -> LimitPartition {
    LimitPartition::new(settings(), 1)
}

fn key(name: &str) -> Option<pb::KeyRef> {
    Some(pb::KeyRef {
        tenant: "t".to_string(),
        key: name.to_string(),
    })
}

fn acquire(job: &str, key_name: &str, priority: u32, enqueued_at_us: i64, max: u32) -> pb::LimitCommand {
    acquire_in_flow(job, key_name, priority, enqueued_at_us, max, "")
}

fn acquire_in_flow(
    job: &str,
    key_name: &str,
    priority: u32,
    enqueued_at_us: i64,
    max: u32,
    fairness_key: &str,
) -> pb::LimitCommand {
    pb::LimitCommand {
        command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
            key: key(key_name),
            ticket: Some(pb::TicketId {
                job_id: job.to_string(),
                attempt: 1,
                step: 0,
            }),
            priority,
            enqueued_at_us,
            limit: Some(pb::acquire_ticket::Limit::MaxConcurrency(max)),
            fairness_key: fairness_key.to_string(),
            shadow: false,
        })),
        ..Default::default()
    }
}

fn release(job: &str, key_name: &str) -> pb::LimitCommand {
    pb::LimitCommand {
        command: Some(pb::limit_command::Command::Release(pb::ReleaseTicket {
            key: key(key_name),
            ticket: Some(pb::TicketId {
                job_id: job.to_string(),
                attempt: 1,
                step: 0,
            }),
            reason: 0,
            run_ms: None,
        })),
        ..Default::default()
    }
}

fn set_override(key_name: &str, max: Option<u32>) -> pb::LimitCommand {
    pb::LimitCommand {
        command: Some(pb::limit_command::Command::SetOverride(pb::SetOverride {
            key: key(key_name),
            max,
        })),
        ..Default::default()
    }
}

/// The grants in `outbox`, in order (they go down the admission link).
fn grants(outbox: &mut Outbox) -> Vec<pb::GrantEvent> {
    outbox
        .take_links()
        .into_iter()
        .filter(|((link, _), _)| *link == Link::Admission)
        .flat_map(|(_, events)| events)
        .map(|event| pb::GrantEvent::decode(event.as_slice()).unwrap())
        .collect()
}

fn granted_jobs(mut outbox: Outbox) -> Vec<String> {
    grants(&mut outbox)
        .into_iter()
        .map(|event| event.ticket.unwrap().job_id)
        .collect()
}

fn run(state: &mut LimitPartition, commands: Vec<pb::LimitCommand>) -> (Vec<String>, LimitWrites) {
    let mut out = Decided::new();
    for command in commands {
        state.apply_command(1_000, command, &mut out).unwrap();
    }
    (granted_jobs(out.sends), out.writes)
}

fn acquire_floating(job: &str, key_name: &str, enqueued_at_us: i64, default_max: u32) -> pb::LimitCommand {
    let mut command = acquire(job, key_name, 50, enqueued_at_us, default_max);
    if let Some(pb::limit_command::Command::Acquire(acquire)) = command.command.as_mut() {
        acquire.limit = Some(pb::acquire_ticket::Limit::Floating(pb::FloatingConcurrencyLimit {
            key: key_name.to_string(),
            default_max,
            refresh_interval_ms: 1_000,
            metadata: [("region".to_string(), "eu".to_string())].into_iter().collect(),
        }));
    }
    command
}

fn set_floating_max(key_name: &str, max: u32, task_id: &str) -> pb::LimitCommand {
    pb::LimitCommand {
        command: Some(pb::limit_command::Command::SetFloatingMax(pb::SetFloatingMax {
            key: key(key_name),
            max,
            task_id: task_id.to_string(),
        })),
        ..Default::default()
    }
}

/// Apply at `now_ms`; the grants and the refresh-due events sent.
fn run_at(
    state: &mut LimitPartition,
    now_ms: i64,
    commands: Vec<pb::LimitCommand>,
) -> (Vec<String>, Vec<pb::RefreshDue>) {
    let mut out = Decided::new();
    for command in commands {
        state.apply_command(now_ms, command, &mut out).unwrap();
    }
    let mut outbox = out.sends;
    let granted = grants(&mut outbox)
        .into_iter()
        .map(|event| event.ticket.unwrap().job_id)
        .collect();
    let messages = outbox.into_messages();
    let dues = messages
        .iter()
        .filter(|message| &*message.topic == "refresh-due")
        .flat_map(|message| pb::RefreshDueBatch::decode(message.payload.as_slice()).unwrap().events)
        .collect();
    (granted, dues)
}
