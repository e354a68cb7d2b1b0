use super::*;

/// What one command sent and observed: grant events, and observations
/// (counted once the batch commits).
fn sent_and_observed(state: &mut LimitPartition, command: pb::LimitCommand) -> (usize, usize) {
    let mut out = Decided::new();
    state.apply_command(1_000, command, &mut out).unwrap();
    assert!(out.sends.take_observations().is_empty(), "effects, not observations");
    let observed = out.effects.len();
    (grants(&mut out.sends).len(), observed)
}

#[test]
fn each_grant_is_observed_once_whatever_is_sent_again_after_a_failover() {
    let mut first = partition();
    let (mut sent, mut observed) = (0, 0);
    for job in ["a", "b", "c", "d"] {
        let (s, o) = sent_and_observed(&mut first, acquire(job, "k", 10, 1, 2));
        sent += s;
        observed += o;
    }
    // A duplicate acquire of a holder: its grant is sent again, not observed again.
    let (s, o) = sent_and_observed(&mut first, acquire("a", "k", 10, 1, 2));
    assert_eq!((s, o), (1, 0));
    sent += s;
    observed += o;
    let (s, o) = sent_and_observed(&mut first, release("a", "k"));
    sent += s;
    observed += o;
    assert_eq!((sent, observed), (4, 3), "grants a, b, then c; a sent twice");

    // The owner fails over: a new one loads the saved tickets and sends
    // every held grant again, observing none of them.
    let saved: Vec<TicketRecord> = first.tickets().cloned().collect();
    let mut second = partition();
    second.restore(2_000, Vec::new(), saved);
    let mut outbox = Outbox::new();
    second.resend_all(2_000, &mut outbox);
    assert_eq!(outbox.take_observations().len(), 0);
    assert_eq!(grants(&mut outbox).len(), 2, "b and c sent again");
    let (s, o) = sent_and_observed(&mut second, release("b", "k"));
    assert_eq!((s, o), (1, 1), "d is a new grant");
    // Distinct grants a, b, c, d: observed four times in all.
    assert_eq!(observed + o, 4);
}
