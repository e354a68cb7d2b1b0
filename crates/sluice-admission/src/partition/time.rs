//! Time: acting on jobs that fall due (run_at, backoffs, re-sends,
//! leases, run timeouts) and the stand-behind statements.

use sluice_common::kafka::Outbox;
use sluice_common::link::Link;
use sluice_proto::v1 as pb;

use crate::transitions::{self, JobState, Status};

use super::{AdmissionPartition, Out};

impl AdmissionPartition {
    /// Act on every job due by `now_ms`, and on the partition's own timers.
    pub(super) fn run_timers(&mut self, now_ms: i64, out: &mut Out<'_>) {
        let timing = self.settings.timing;
        // Each due job once per batch, whatever its next due time.
        let due: Vec<String> = self
            .timers
            .iter()
            .take_while(|(due, _)| *due <= now_ms)
            .map(|(_, job_id)| job_id.clone())
            .collect();
        for job_id in due {
            if self.lease_end_waits_for_queued_requests(&job_id, now_ms) {
                continue;
            }
            let active_jobs = self.jobs.len();
            // A waiting or admitted job's timer re-sends its pending command
            // and moves only its own next time: kept in memory, so re-sends
            // write nothing (a new owner re-sends every pending command at
            // its takeover and starts these timers over:
            // `restart_resend_timers`).
            let resend = self
                .jobs
                .get(&job_id)
                .is_some_and(|active| matches!(active.row.state.status, Status::Waiting | Status::Admitted));
            let claimed_by = self.claiming_worker(&job_id);
            let mut effects = Vec::new();
            let decide = |state: &mut JobState| {
                effects = transitions::on_due(state, now_ms, timing, active_jobs);
            };
            if resend {
                self.update_unsaved(&job_id, decide);
            } else {
                self.update(&job_id, decide);
            }
            if let Some((task_group, worker, attempt)) = claimed_by {
                self.note_worker_lost(&job_id, &task_group, &worker, attempt, now_ms);
            }
            self.after_transition(&job_id, &effects, out);
        }
        for job_id in self.overtaken.due(now_ms, timing.claim_overtaken_after_ms) {
            let admitted = self
                .jobs
                .get(&job_id)
                .is_some_and(|active| active.row.state.status == Status::Admitted);
            if admitted {
                tracing::debug!(%job_id, "a job of its task group published later was claimed first: publishing it again under a new key");
                self.publish_admitted(&job_id, out);
            } else {
                self.overtaken.forget(&job_id);
            }
        }
        if now_ms >= self.next_stand_behind_ms {
            self.next_stand_behind_ms = now_ms + self.settings.stand_behind_interval_ms;
            self.stand_behind(now_ms, out.outbox);
        }
    }

    /// The task group, worker and attempt of `job_id` when it runs an
    /// attempt its worker claimed (not a push).
    fn claiming_worker(&self, job_id: &str) -> Option<(String, String, u32)> {
        let active = self.jobs.get(job_id)?;
        let state = &active.row.state;
        let running = matches!(state.status, Status::Running | Status::Cancelling) && !state.pushed;
        let worker = state.claimed_by.clone().filter(|_| running)?;
        Some((active.row.task_group.clone(), worker, state.attempt))
    }

    /// `attempt` of `job_id`, claimed by `worker`, ended just now: if its
    /// lease ran out (no word from its worker for a lease), the worker is
    /// taken for lost and the partitions it claimed from are avoided
    /// (`Overtaken::worker_lost`).
    fn note_worker_lost(&self, job_id: &str, task_group: &str, worker: &str, attempt: u32, now_ms: i64) {
        let expired = self.jobs.get(job_id).is_some_and(|active| {
            active.row.state.history.records.last().is_some_and(|record| {
                record.attempt == attempt && record.outcome == "lease_expired" && record.at_ms == now_ms
            })
        });
        if expired {
            let after_ms = self.settings.timing.claim_overtaken_after_ms;
            self.overtaken.worker_lost(task_group, worker, now_ms, after_ms);
        }
    }

    /// A running attempt's lease has ended, but a request the instance
    /// received before it ended may still wait behind this batch (in the
    /// partition's queue, or on its way there): its worker's heartbeat or
    /// completion may be that request (after a takeover, behind the grants
    /// of thousands of re-sent acquires), and ending the attempt first would
    /// run the job again. It waits for them, for one more lease at most, so
    /// a partition that never catches up still ends leases. Requests
    /// received after the end cannot hold it: a busy partition always has
    /// some waiting. The job stays due: looked at again next batch.
    fn lease_end_waits_for_queued_requests(&self, job_id: &str, now_ms: i64) -> bool {
        let Some(active) = self.jobs.get(job_id) else {
            return false;
        };
        let state = &active.row.state;
        matches!(state.status, Status::Running | Status::Cancelling)
            && state.lease_expires_at_ms.is_some_and(|end| {
                end <= now_ms && now_ms < end.saturating_add(state.lease_ms) && self.requests_received_through_ms < end
            })
    }

    /// Tell every limit partition which tickets this job partition stands
    /// behind, as of now. Sent to every limit partition, even with nothing
    /// to list, so tickets nobody stands behind expire there (a lost release
    /// then costs one grace period, not a slot for ever).
    pub fn stand_behind(&self, now_ms: i64, outbox: &mut Outbox) {
        let routes = &self.settings.routes;
        let partitions = usize::try_from(routes.limit_partitions).unwrap_or_default();
        let mut by_partition: Vec<Vec<pb::TicketId>> = vec![Vec::new(); partitions];
        // The tickets whose grant the job waits for now.
        let mut waiting_by_partition: Vec<Vec<pb::TicketId>> = vec![Vec::new(); partitions];
        for active in self.jobs.values() {
            let state = &active.row.state;
            let held_through = match state.status {
                Status::Waiting => state.step.saturating_add(1),
                Status::Admitted | Status::Running | Status::Cancelling => state.chain_len(),
                _ => 0,
            };
            for (index, step) in state.chain.iter().enumerate() {
                let index = u32::try_from(index).unwrap_or(u32::MAX);
                if index >= held_through || !step.is_ticketed() {
                    continue;
                }
                let partition =
                    sluice_common::partition::key_partition(&step.tenant, &step.key, routes.limit_partitions);
                let slot = usize::try_from(partition).unwrap_or(usize::MAX);
                let ticket = pb::TicketId {
                    job_id: state.job_id.clone(),
                    attempt: state.attempt,
                    step: index,
                };
                if state.status == Status::Waiting && index == state.step {
                    if let Some(waiting) = waiting_by_partition.get_mut(slot) {
                        waiting.push(ticket.clone());
                    }
                }
                if let Some(tickets) = by_partition.get_mut(slot) {
                    tickets.push(ticket);
                }
            }
        }
        let sweep_id = format!("{}-{}-{now_ms}", self.settings.partition, self.journal_seq);
        let covered = vec![u32::try_from(self.settings.partition).unwrap_or_default()];
        for (partition, (tickets, waiting)) in by_partition.into_iter().zip(waiting_by_partition).enumerate() {
            let chunks = stand_behind_parts(tickets, waiting, TICKETS_PER_PART);
            let parts = u32::try_from(chunks.len()).unwrap_or(u32::MAX);
            for (part, (chunk, waiting)) in chunks.into_iter().enumerate() {
                let command = pb::LimitCommand {
                    trace: None,
                    sent_at_ms: now_ms,
                    command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
                        sweep_id: sweep_id.clone(),
                        snapshot_at_ms: now_ms,
                        job_partitions: covered.clone(),
                        part: u32::try_from(part).unwrap_or(u32::MAX),
                        parts,
                        tickets: chunk,
                        grace_ms: u64::try_from(self.settings.ticket_grace_ms).unwrap_or_default(),
                        waiting,
                    })),
                };
                outbox.push_link(Link::LimitGrant, i32::try_from(partition).unwrap_or_default(), &command);
            }
        }
    }
}

/// Tickets one part of a stand-behind statement lists at most, and waiting
/// tickets it names at most: about 0.2 MiB each (a job id of 36 bytes),
/// well under the link's 1 MiB per message and gRPC's 4 MiB.
const TICKETS_PER_PART: usize = 10_000;

/// The parts of one limit partition's stand-behind statement: (tickets,
/// waiting) of at most `per_part` each, at least one part. The waiting
/// tickets are split across the parts too (a ticket of theirs in another
/// part is still known: parts are one sweep). They all went with the
/// first part until 2026-11-28: 240,000 jobs waiting on one job partition
/// made it a 4.5 MB message, over gRPC's 4 MiB limit; limit-grant closed
/// the link on it, admission sent it again on the new link, and the
/// 300,000-job one-partition bench stopped at 62,273 jobs for good.
fn stand_behind_parts(
    tickets: Vec<pb::TicketId>,
    waiting: Vec<pb::TicketId>,
    per_part: usize,
) -> Vec<(Vec<pb::TicketId>, Vec<pb::TicketId>)> {
    let per_part = per_part.max(1);
    let mut tickets = tickets.chunks(per_part).map(<[pb::TicketId]>::to_vec);
    let mut waiting = waiting.chunks(per_part).map(<[pb::TicketId]>::to_vec);
    let mut parts = Vec::new();
    loop {
        match (tickets.next(), waiting.next()) {
            (None, None) if !parts.is_empty() => return parts,
            (tickets, waiting) => parts.push((tickets.unwrap_or_default(), waiting.unwrap_or_default())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tickets(count: usize) -> Vec<pb::TicketId> {
        (0..count)
            .map(|index| pb::TicketId {
                job_id: format!("job-{index}"),
                attempt: 1,
                step: 0,
            })
            .collect()
    }

    /// Every part of a stand-behind statement stays small, the waiting
    /// tickets included, and together the parts list every ticket once.
    #[test]
    fn a_stand_behind_statement_splits_its_waiting_tickets_across_its_parts() {
        let all = tickets(25);
        let waiting: Vec<pb::TicketId> = all.iter().take(23).cloned().collect();
        let parts = stand_behind_parts(all.clone(), waiting.clone(), 10);
        assert_eq!(parts.len(), 3);
        for (tickets, waiting) in &parts {
            assert!(
                tickets.len() <= 10 && waiting.len() <= 10,
                "a part of {} tickets, {} waiting",
                tickets.len(),
                waiting.len()
            );
        }
        let listed: Vec<pb::TicketId> = parts.iter().flat_map(|(tickets, _)| tickets.clone()).collect();
        let named: Vec<pb::TicketId> = parts.iter().flat_map(|(_, waiting)| waiting.clone()).collect();
        assert_eq!((listed, named), (all, waiting));
        // Nothing to state is still one (empty) part: tickets nobody
        // stands behind expire.
        assert_eq!(stand_behind_parts(Vec::new(), Vec::new(), 10).len(), 1);
    }
}
