use super::*;

fn link_query(id: u64, commands: Vec<Vec<u8>>) -> Query<LimitQuery> {
    Query {
        id,
        body: LimitQuery::Link {
            commands,
            client: Arc::from("admission-7"),
        },
    }
}

/// Commands from a link are applied in order; one that can never be
/// applied is set aside alone, naming the admission instance; the query is
/// answered once, `Applied`.
#[test]
fn link_commands_are_applied_and_a_bad_one_is_set_aside_alone() {
    let mut state = partition();
    let decided = state.apply(
        1_000,
        &[],
        vec![link_query(
            7,
            vec![
                acquire("a", "k", 50, 1, 1).encode_to_vec(),
                vec![0xff, 0xff],
                acquire("b", "k", 50, 2, 1).encode_to_vec(),
            ],
        )],
    );
    assert_eq!(decided.answers, vec![(7, LimitAnswer::Applied)]);
    assert_eq!(decided.rejected.len(), 1);
    assert_eq!(decided.rejected[0].entry, vec![0xff, 0xff]);
    assert!(
        decided.rejected[0]
            .reason
            .starts_with("from admission admission-7 over its link: undecodable"),
        "{}",
        decided.rejected[0].reason
    );
    assert_eq!((state.holders_of("t", "k"), state.waiting_on("t", "k")), (1, 1));
    assert!(
        decided.writes.snapshot.is_some(),
        "a new partition's first batch is a snapshot"
    );
}

/// A stream that takes a job partition gets the grants of the tickets held
/// for its jobs again: a re-send, not a decision (no effect), and nobody
/// waits for an answer (none is given, so a batch with nothing to re-send
/// is not committed for it).
#[test]
fn grants_are_sent_again_to_a_new_stream_without_an_answer_or_effect() {
    let mut state = partition();
    let commands = vec![
        acquire("a", "k", 50, 1, 1).encode_to_vec(),
        acquire("b", "k", 50, 2, 1).encode_to_vec(),
    ];
    state.apply(1_000, &[], vec![link_query(1, commands)]);
    let resend = |id| Query {
        id,
        body: LimitQuery::ResendGrants {
            job_partitions: vec![0],
        },
    };
    let mut decided = state.apply(2_000, &[], vec![resend(1)]);
    assert_eq!(granted_jobs(std::mem::take(&mut decided.sends)), vec!["a"]);
    assert!(decided.answers.is_empty() && decided.effects.is_empty() && decided.writes.is_empty());
    let mut idle = partition();
    let decided = idle.apply(2_000, &[], vec![resend(2)]);
    assert!(decided.answers.is_empty() && decided.sends.is_empty());
}
