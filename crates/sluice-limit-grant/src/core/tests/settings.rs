use super::*;

#[test]
fn override_pauses_and_raising_grants_waiters_at_once() {
    let mut state = partition();
    let (granted, _) = run(
        &mut state,
        vec![set_override("k", Some(0)), acquire("a", "k", 50, 1, 3)],
    );
    assert!(granted.is_empty(), "paused key grants nothing");
    let (granted, _) = run(
        &mut state,
        vec![acquire("b", "k", 50, 2, 3), set_override("k", Some(1))],
    );
    assert_eq!(granted, vec!["a"]);
    let (granted, writes) = run(&mut state, vec![set_override("k", None)]);
    assert_eq!(granted, vec!["b"], "clearing restores the job's max of 3");
    assert_eq!(writes.keys.get(&("t".to_string(), "k".to_string())), Some(&None));
}
