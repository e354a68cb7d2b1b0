//! Requests from this instance's gRPC handlers to a rate partition: stored
//! resources (put, delete), describing a key, and applying a local request.

use sluice_common::kafka::Outbox;
use sluice_common::link::LinkInput;
use sluice_common::owner::{Rejected, Reply};
use sluice_proto::v1 as pb;

use super::{
    resource_of, window_key, LocalRequest, LocalResult, RatePartition, RateWrites, ResourceRecord, TicketKey,
    TicketRecord, WindowRecord, WindowState,
};

impl RatePartition {
    pub(super) fn put_resource(
        &mut self,
        now_ms: i64,
        resource: pb::RateLimitResource,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
    ) -> LocalResult<pb::PutRateLimitResponse> {
        let key = (resource.tenant.clone(), resource.resource_key.clone());
        let record = ResourceRecord {
            max_count: resource.max_count,
            window_seconds: resource.window_seconds,
        };
        let spec = record
            .spec()
            .ok_or_else(|| tonic::Status::invalid_argument("max_count and window_seconds must be at least 1"))?;
        let created = self.resources.insert(key.clone(), record).is_none();
        writes.resources.insert(key, Some(record));
        let key_ref = pb::RateKeyRef {
            tenant: resource.tenant.clone(),
            kind: Some(pb::rate_key_ref::Kind::ResourceKey(resource.resource_key.clone())),
        };
        let stored = window_key(&key_ref);
        if let Some(state) = self.windows.get_mut(&stored) {
            if state.window.spec() != spec {
                state.window.set_spec(spec);
                writes.windows.insert(
                    stored.clone(),
                    Some(WindowRecord {
                        key: key_ref,
                        rate_limit: resource.max_count,
                        window_ms: resource.window_seconds.saturating_mul(1000),
                    }),
                );
            }
            // A raised limit grants waiters at once.
            self.pump(now_ms, &stored, writes, outbox);
        }
        Ok(pb::PutRateLimitResponse {
            resource: Some(resource),
            created,
        })
    }

    pub(super) fn delete_resource(
        &mut self,
        now_ms: i64,
        tenant: String,
        resource_key: String,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
    ) -> LocalResult<pb::DeleteRateLimitResponse> {
        let deleted = self.resources.remove(&(tenant.clone(), resource_key.clone())).is_some();
        if deleted {
            writes.resources.insert((tenant.clone(), resource_key.clone()), None);
        }
        let key_ref = pb::RateKeyRef {
            tenant,
            kind: Some(pb::rate_key_ref::Kind::ResourceKey(resource_key)),
        };
        let stored = window_key(&key_ref);
        let mut released = 0u32;
        if let Some(state) = self.windows.remove(&stored) {
            if let Some(at) = state.wakeup {
                self.wakeups.remove(&(at, stored.clone()));
            }
            writes.windows.insert(stored.clone(), None);
            // Waiters are released at once: the key no longer throttles.
            let mut waiters: Vec<TicketRecord> = state
                .queue
                .iter()
                .filter_map(|waiter| state.waiting.get(&waiter.ticket).cloned())
                .collect();
            for record in &mut waiters {
                self.waiting_in.remove(&record.ticket);
                record.granted = true;
                record.granted_at_ms = Some(now_ms);
                record.unthrottled = true;
                released += 1;
            }
            for record in waiters {
                self.grant_out(&record, &key_ref, 0, outbox);
                self.remember_grant(record, writes);
            }
        }
        Ok(pb::DeleteRateLimitResponse {
            deleted,
            released_waiters: released,
        })
    }

    pub(super) fn describe(
        &self,
        now_ms: i64,
        key: &pb::RateKeyRef,
        ticket: Option<&TicketKey>,
    ) -> pb::DescribeRateKeyResponse {
        let mut response = pb::DescribeRateKeyResponse {
            key: Some(key.clone()),
            partition: u32::try_from(self.settings.partition).unwrap_or_default(),
            ..Default::default()
        };
        if let Some(resource) = resource_of(key) {
            response.stored_resource_missing = !self.resources.contains_key(&resource);
        }
        let Some(state) = self.windows.get(&window_key(key)) else {
            return response;
        };
        let spec = state.window.spec();
        response.limit = i64::try_from(spec.limit()).unwrap_or(i64::MAX);
        response.window_ms = i64::try_from(spec.window_ms()).unwrap_or(i64::MAX);
        response.used = i64::try_from(state.window.used(now_ms)).unwrap_or(i64::MAX);
        response.waiting = u32::try_from(state.queue.len()).unwrap_or(u32::MAX);
        response.next_slot_at_ms = state.wakeup;
        if let Some(ticket) = ticket {
            response.ticket_position = state
                .queue
                .position(ticket)
                .and_then(|position| u32::try_from(position).ok());
            response.ticket_retry_at_ms = simulate_slot(state, now_ms, ticket);
        }
        response
    }

    pub(super) fn apply_local(
        &mut self,
        now_ms: i64,
        local: LocalRequest,
        writes: &mut RateWrites,
        outbox: &mut Outbox,
        replies: &mut Vec<Reply>,
        rejected: &mut Vec<Rejected>,
    ) {
        match local {
            LocalRequest::Link(LinkInput::ResendGrants { job_partitions }) => {
                self.resend_grants(&job_partitions, outbox);
            }
            LocalRequest::Link(LinkInput::Commands(batch)) => {
                for entry in &batch.commands {
                    let outcome = <pb::RateCommand as prost::Message>::decode(entry.as_slice())
                        .map_err(|error| format!("undecodable rate command: {error}"))
                        .and_then(|command| self.apply_command(now_ms, command, writes, outbox));
                    if let Err(reason) = outcome {
                        rejected.push(Rejected {
                            offset: -1,
                            entry: entry.clone(),
                            reason: format!("from admission {} over its link: {reason}", batch.client),
                        });
                    }
                }
                let applied = batch.applied;
                replies.push(Box::new(move || {
                    let _ = applied.send(());
                }));
            }
            LocalRequest::TryAcquire {
                key,
                limit,
                window_ms,
                cost,
                reply,
            } => {
                let answer = match self.check_partition(&key) {
                    Ok(()) => self.try_acquire(now_ms, &key, limit, window_ms, cost, writes),
                    Err(reason) => Err(tonic::Status::internal(reason)),
                };
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
            LocalRequest::PutResource { resource, reply } => {
                let answer = self.put_resource(now_ms, resource, writes, outbox);
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
            LocalRequest::DeleteResource {
                tenant,
                resource_key,
                reply,
            } => {
                let answer = self.delete_resource(now_ms, tenant, resource_key, writes, outbox);
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
            LocalRequest::Describe { key, ticket, reply } => {
                let answer = Ok(self.describe(now_ms, &key, ticket.as_ref()));
                replies.push(Box::new(move || {
                    let _ = reply.send(answer);
                }));
            }
        }
    }
}

/// The exact time `ticket`'s slot opens if nothing else arrives: replay the
/// queue ahead of it on a copy of the window.
fn simulate_slot(state: &WindowState, now_ms: i64, ticket: &TicketKey) -> Option<i64> {
    const MAX_SIMULATED: usize = 10_000;
    let mut window = state.window.clone();
    let mut at = now_ms;
    for waiter in state.queue.iter().take(MAX_SIMULATED) {
        at = window.earliest(at, waiter.cost).ok()?;
        window.try_acquire(at, waiter.cost).ok()?;
        if &waiter.ticket == ticket {
            return Some(at);
        }
    }
    None
}
