//! Heap bytes a waiting ticket costs limit-grant's core (issue 30): one key
//! partition holding `JOBS` acquires over `KEYS` keys of max 5, as the
//! backlog benchmark sends them (a trace context each), so all but five per
//! key wait. Counted by a global allocator that tracks live bytes: exact,
//! and the same on every machine. One test per binary: the counter is the
//! process's.

use std::sync::Arc;

use peak_alloc::PeakAlloc;
use sluice_common::validate::InputLimits;
use sluice_limit_grant::core::{Decided, LimitPartition, PartitionSettings};
use sluice_proto::v1 as pb;

#[global_allocator]
static ALLOCATOR: PeakAlloc = PeakAlloc;

const JOBS: usize = 20_000;
const KEYS: usize = 200;
const BATCH: usize = 1_000;
/// What a waiting ticket may cost limit-grant's core in heap bytes: 509
/// when a key's queue held ticket records unboxed in its B-tree nodes, 400
/// boxed.
const HELD_BOUND: usize = 450;

fn acquire(job: usize) -> pb::LimitCommand {
    pb::LimitCommand {
        trace: Some(pb::TraceContext {
            traceparent: format!("00-{job:032x}-{job:016x}-01"),
            tracestate: String::new(),
        }),
        sent_at_ms: 0,
        command: Some(pb::limit_command::Command::Acquire(pb::AcquireTicket {
            key: Some(pb::KeyRef {
                tenant: "backlog".to_string(),
                key: format!("k{}", job % KEYS),
            }),
            ticket: Some(pb::TicketId {
                job_id: format!("backlog-{job:08}"),
                attempt: 1,
                step: 0,
            }),
            priority: 0,
            enqueued_at_us: i64::try_from(job).unwrap_or(i64::MAX),
            limit: Some(pb::acquire_ticket::Limit::MaxConcurrency(5)),
            fairness_key: String::new(),
            shadow: false,
        })),
    }
}

#[test]
fn a_waiting_ticket_costs_limit_grants_core_bounded_heap_bytes() -> Result<(), String> {
    let settings = PartitionSettings {
        partition: 0,
        limit_partitions: 1,
        grants_partitions: 8,
        refresh_due_topic: Arc::from("refresh-due"),
        refresh_due_partitions: 1,
        max_message_bytes: 1_000_000,
        ticket_grace_ms: 30_000,
        input: InputLimits::default(),
    };
    let mut partition = LimitPartition::new(settings, 1);
    let before = ALLOCATOR.current_usage();
    for (now_ms, first) in (1_800_000_000_000_i64..).zip((0..JOBS).step_by(BATCH)) {
        let mut out = Decided::new();
        for job in first..first + BATCH {
            partition.apply_command(now_ms, acquire(job), &mut out)?;
        }
        drop(out);
    }
    let held = ALLOCATOR.current_usage().saturating_sub(before) / JOBS;
    eprintln!(
        "limit-grant core: {held} heap bytes per ticket ({} waiting)",
        JOBS - 5 * KEYS
    );
    assert!(
        held <= HELD_BOUND,
        "{held} heap bytes per ticket, more than {HELD_BOUND}"
    );
    Ok(())
}
