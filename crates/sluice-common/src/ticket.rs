//! The identity of a ticket (docs/architecture.md, "Identity and idempotency"), shared by the
//! owners that keep tickets: one step of one attempt of one job.

use std::sync::Arc;

use sluice_proto::v1 as pb;

/// The job id is shared (`Arc<str>`): an owner keeps a ticket's key in
/// several indexes (its queue, its place in it, its key), and a waiting job
/// should cost one copy of its id, not one per index.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TicketKey {
    pub job_id: Arc<str>,
    pub attempt: u32,
    pub step: u32,
}

impl TicketKey {
    pub fn from_proto(ticket: &pb::TicketId) -> Self {
        TicketKey {
            job_id: Arc::from(ticket.job_id.as_str()),
            attempt: ticket.attempt,
            step: ticket.step,
        }
    }

    pub fn to_proto(&self) -> pb::TicketId {
        pb::TicketId {
            job_id: self.job_id.to_string(),
            attempt: self.attempt,
            step: self.step,
        }
    }
}
