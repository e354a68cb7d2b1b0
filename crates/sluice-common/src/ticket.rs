//! The identity of a ticket (DESIGN: identity and idempotency), shared by the
//! owners that keep tickets: one step of one attempt of one job.

use sluice_proto::v1 as pb;

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TicketKey {
    pub job_id: String,
    pub attempt: u32,
    pub step: u32,
}

impl TicketKey {
    pub fn from_proto(ticket: &pb::TicketId) -> Self {
        TicketKey {
            job_id: ticket.job_id.clone(),
            attempt: ticket.attempt,
            step: ticket.step,
        }
    }

    pub fn to_proto(&self) -> pb::TicketId {
        pb::TicketId {
            job_id: self.job_id.clone(),
            attempt: self.attempt,
            step: self.step,
        }
    }
}
