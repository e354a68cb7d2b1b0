use super::*;

#[test]
fn a_sweep_reclaims_tickets_nobody_stands_behind() {
    let mut state = partition();
    run(
        &mut state,
        vec![acquire("a", "k", 50, 1, 1), acquire("b", "k", 50, 2, 1)],
    );
    // Within the grace nothing expires even when unlisted.
    let (granted, _) = run(&mut state, vec![stand_behind(20_000, &["b"])]);
    assert!(granted.is_empty());
    // a was last confirmed at 1_000: a sweep at 40_000 without it reclaims it.
    let (granted, writes) = run(&mut state, vec![stand_behind(40_000, &["b"])]);
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

/// Seed 1572 of the simulation: an attempt's lease expired, and its
/// release was lost with the admission instance that sent it (it lost the
/// job partition, then restarted). The job's next attempt waited behind
/// the old attempt's ticket for the whole grace (30 s after the new
/// owner's load), though every sweep listed the new attempt. A sweep that
/// lists a later attempt of a job reclaims the older attempt's tickets at
/// once: a job starts a new attempt only after releasing the old one's.
#[test]
fn a_sweep_listing_a_later_attempt_reclaims_the_earlier_attempts_tickets() {
    let mut state = partition();
    let ticket = |job: &str, attempt: u32| pb::TicketId {
        job_id: job.to_string(),
        attempt,
        step: 0,
    };
    let acquire_attempt = |job: &str, attempt: u32, enqueued_at_us: i64| {
        let mut command = acquire(job, "k", 50, enqueued_at_us, 1);
        if let Some(pb::limit_command::Command::Acquire(acquire)) = command.command.as_mut() {
            acquire.ticket = Some(ticket(job, attempt));
        }
        command
    };
    let (granted, _) = run(&mut state, vec![acquire_attempt("a", 1, 1), acquire_attempt("b", 1, 2)]);
    assert_eq!(granted, vec!["a"]);
    // a's attempt 1 ended; its release never arrives. Attempt 2 waits.
    let (granted, _) = run(&mut state, vec![acquire_attempt("a", 2, 1)]);
    assert!(granted.is_empty());
    let sweep = pb::LimitCommand {
        command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
            sweep_id: "s".to_string(),
            // Well within the grace of every ticket here.
            snapshot_at_ms: 1_000,
            job_partitions: vec![0],
            part: 0,
            parts: 1,
            tickets: vec![ticket("a", 2), ticket("b", 1)],
            grace_ms: 30_000,
            waiting: vec![ticket("a", 2), ticket("b", 1)],
        })),
        ..Default::default()
    };
    let (granted, writes) = run(&mut state, vec![sweep]);
    assert!(
        writes.deletes.contains(&TicketKey {
            job_id: Arc::from("a"),
            attempt: 1,
            step: 0
        }),
        "the superseded attempt's ticket is reclaimed"
    );
    assert_eq!(
        granted,
        vec!["a"],
        "the freed slot goes to a's attempt 2 (enqueued first)"
    );
    assert_eq!(state.holders_of("t", "k"), 1);
    assert_eq!(state.waiting_on("t", "k"), 1);
}

/// A release lost around a takeover (sim seed 2267: two jobs succeeded and
/// their last releases never arrived): the new owner restored the ticket
/// as stood behind at its takeover, and it held its slot a whole grace
/// from there (30 s, then the next sweep) while a job waited behind it. A
/// sweep taken after the takeover (beyond the margin for clocks) that does
/// not list it reclaims it; one taken within the margin does not, and a
/// restored ticket the sweep lists keeps its grace.
#[test]
fn a_restored_ticket_a_sweep_taken_after_the_takeover_does_not_list_is_reclaimed() {
    let mut first = partition();
    run(
        &mut first,
        vec![
            acquire("lost", "k", 50, 1, 2),
            acquire("live", "k", 50, 2, 2),
            acquire("behind", "k", 50, 3, 2),
        ],
    );
    let saved: Vec<TicketRecord> = first.tickets().cloned().collect();
    let restored_at = 50_000;
    let mut second = partition();
    second.restore(restored_at, Vec::new(), saved);
    let sweep = |snapshot_at_ms: i64| stand_behind(snapshot_at_ms, &["live", "behind"]);
    let lost = TicketKey {
        job_id: Arc::from("lost"),
        attempt: 1,
        step: 0,
    };
    // Taken within the margin of the takeover: nothing is reclaimed.
    let (granted, writes) = run(
        &mut second,
        vec![sweep(restored_at + crate::core::sweep::RESTORED_MARGIN_MS)],
    );
    assert!(granted.is_empty() && writes.deletes.is_empty(), "{granted:?}");
    // Taken after it, well within the grace: the unlisted restored ticket
    // goes, and the job behind it is granted its slot.
    let (granted, writes) = run(
        &mut second,
        vec![sweep(restored_at + crate::core::sweep::RESTORED_MARGIN_MS + 1)],
    );
    assert_eq!(granted, vec!["behind"]);
    assert!(writes.deletes.contains(&lost));
    // The listed ones were confirmed by the sweeps: a later sweep that
    // omits them but is within their grace reclaims nothing.
    let (granted, writes) = run(&mut second, vec![stand_behind(restored_at + 10_000, &[])]);
    assert!(granted.is_empty() && writes.deletes.is_empty(), "{writes:?}");
}

/// A one-part sweep of job partition 0 at `snapshot_at_ms` that stands
/// behind the first-attempt step-0 tickets of `jobs`.
fn stand_behind(snapshot_at_ms: i64, jobs: &[&str]) -> pb::LimitCommand {
    pb::LimitCommand {
        command: Some(pb::limit_command::Command::StandBehind(pb::StandBehind {
            sweep_id: format!("s{snapshot_at_ms}-{}", jobs.join("-")),
            snapshot_at_ms,
            job_partitions: vec![0],
            part: 0,
            parts: 1,
            tickets: jobs
                .iter()
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
    }
}
