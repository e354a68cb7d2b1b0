use super::*;

#[test]
fn a_sweep_reclaims_tickets_nobody_stands_behind() {
    let mut state = partition();
    run(
        &mut state,
        vec![acquire("a", "k", 50, 1, 1), acquire("b", "k", 50, 2, 1)],
    );
    let sweep = |snapshot_at_ms: i64, tickets: Vec<&str>| pb::LimitCommand {
        command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
            sweep_id: format!("s{snapshot_at_ms}"),
            snapshot_at_ms,
            job_partitions: vec![0],
            part: 0,
            parts: 1,
            tickets: tickets
                .into_iter()
                .map(|job| pb::TicketId {
                    job_id: job.to_string(),
                    attempt: 1,
                    step: 0,
                })
                .collect(),
            grace_ms: 30_000,
            waiting: Vec::new(),
        })),
        ..Default::default()
    };
    // Within the grace nothing expires even when unlisted.
    let (granted, _) = run(&mut state, vec![sweep(20_000, vec!["b"])]);
    assert!(granted.is_empty());
    // a was last confirmed at 1_000: a sweep at 40_000 without it reclaims it.
    let (granted, writes) = run(&mut state, vec![sweep(40_000, vec!["b"])]);
    assert_eq!(granted, vec!["b"]);
    assert!(writes.deletes.contains(&TicketKey {
        job_id: Arc::from("a"),
        attempt: 1,
        step: 0
    }));
}

/// A grant lost on its way to admission (issue 29: keys idle with jobs
/// waiting until a timer re-sent their acquires) is sent again as soon
/// as admission's next sweep says the job still waits for it; a ticket
/// that waits here, or one admission no longer waits for, is not.
#[test]
fn a_grant_admission_still_waits_for_is_sent_again_at_its_sweep() {
    let mut state = partition();
    let (granted, _) = run(
        &mut state,
        vec![acquire("a", "k", 50, 1, 1), acquire("b", "k", 50, 2, 1)],
    );
    assert_eq!(granted, vec!["a"], "a holds the key; b waits");
    let ticket = |job: &str| pb::TicketId {
        job_id: job.to_string(),
        attempt: 1,
        step: 0,
    };
    let sweep = |waiting: Vec<&str>| pb::LimitCommand {
        command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
            sweep_id: format!("s-{}", waiting.join("-")),
            snapshot_at_ms: 1_000,
            job_partitions: vec![0],
            part: 0,
            parts: 1,
            tickets: vec![ticket("a"), ticket("b")],
            grace_ms: 30_000,
            waiting: waiting.into_iter().map(ticket).collect(),
        })),
        ..Default::default()
    };
    // a's grant never reached admission: it still waits for it.
    let (granted, writes) = run(&mut state, vec![sweep(vec!["a", "b"])]);
    assert_eq!(
        granted,
        vec!["a"],
        "the held ticket's grant is sent again; b still waits"
    );
    assert!(writes.deletes.is_empty());
    assert_eq!(state.holders_of("t", "k"), 1);
    // Once admission has it, the sweep lists it as held, not waited for.
    let (granted, _) = run(&mut state, vec![sweep(vec!["b"])]);
    assert!(granted.is_empty());
}
