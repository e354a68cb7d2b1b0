use super::*;

fn record(job: &str, held: bool) -> TicketRecord {
    TicketRecord {
        ticket: TicketKey {
            job_id: Arc::from(job),
            attempt: 2,
            step: 1,
        },
        key_id: Arc::new(("t".to_string(), "k".to_string())),
        held,
        priority: 3,
        enqueued_at_us: 17,
        job_max: 5,
        floating: true,
        waiting_since_ms: 9,
        position_at_enqueue: 4,
        granted_at_ms: held.then_some(11),
        trace: CompactTraceContext::from_context(&pb::TraceContext {
            traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_string(),
            tracestate: "a=b".to_string(),
        }),
        fairness_key: Arc::from("customer-7"),
        shadow: true,
    }
}

#[test]
fn a_ticket_survives_the_journal_unchanged() {
    let original = record("job", true);
    assert_eq!(StoredTicket::of(&original).into_record(), original);
}

#[test]
fn batches_replay_in_order_over_a_snapshot() {
    let mut tickets: HashMap<TicketKey, TicketRecord> = HashMap::default();
    let waiting = record("a", false);
    TicketBatch {
        upserts: vec![StoredTicket::of(&waiting), StoredTicket::of(&record("b", true))],
        deletes: Vec::new(),
    }
    .apply_to(&mut tickets);
    let granted = record("a", true);
    TicketBatch {
        upserts: vec![StoredTicket::of(&granted)],
        deletes: vec![record("b", true).ticket.to_proto()],
    }
    .apply_to(&mut tickets);
    assert_eq!(tickets.len(), 1);
    assert_eq!(tickets.get(&granted.ticket), Some(&granted));
}
