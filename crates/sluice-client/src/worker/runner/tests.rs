use super::*;

/// A held attempt whose heartbeats stop being answered is stopped as
/// lease-lost once its lease by the worker's own count (from the claim,
/// then from each answered heartbeat's sending) passes: a new owner of
/// its partition keeps it no longer than the lease admission told, and
/// may start the next attempt after it (docs/worker-protocol.md §3).
#[tokio::test(start_paused = true)]
async fn an_attempt_is_stopped_as_lease_lost_when_its_lease_passes_unrenewed() {
    let registry = Arc::new(Registry::default());
    let stop = StopSignal::default();
    let claimed = Instant::now();
    let key = ("job".to_string(), 1);
    assert!(registry.insert(
        key.clone(),
        RunningEntry {
            stop: stop.clone(),
            lease_ms: 3_000,
            trace: TraceContext::default(),
            held_until: lease_end(claimed, 3_000),
        },
    ));
    let watch_stopped = CancellationToken::new();
    let watch = tokio::spawn({
        let (registry, watch_stopped) = (registry.clone(), watch_stopped.clone());
        async move { watch_leases(&registry, &watch_stopped).await }
    });
    // A heartbeat sent 2 s in is answered EXTENDED: held until 5 s.
    tokio::time::advance(Duration::from_secs(2)).await;
    registry.renewed(&key, Instant::now());
    tokio::time::sleep_until(claimed + Duration::from_millis(4_900)).await;
    assert_eq!(stop.reason(), None, "stopped while the renewed lease held");
    tokio::time::sleep_until(claimed + Duration::from_millis(5_300)).await;
    assert_eq!(stop.reason(), Some(StopReason::LeaseLost));
    watch_stopped.cancel();
    watch.await.expect("the watch ends");
}

fn returned(result: Result<(), JobError>) -> Ended {
    Ended::Returned(Ok(result))
}

#[test]
fn an_error_is_reported_as_admission_takes_it() {
    let long = format!("stack\0trace {}", "é".repeat(20_000));
    let outcome = AttemptOutcome::Failed {
        message: long,
        non_retryable: false,
    };
    let Some(pb::completion::Outcome::Failure(failure)) = outcome.completion() else {
        panic!("a failure");
    };
    assert!(failure.error.len() <= crate::worker::reported_text::MAX_REPORTED_TEXT_BYTES);
    assert!(!failure.error.contains('\0'));
    assert!(failure.error.starts_with("stack"));
}

#[test]
fn what_is_reported_for_each_way_a_handler_ends() {
    assert!(matches!(decide(returned(Ok(())), None), AttemptOutcome::Succeeded));
    assert!(matches!(
        decide(returned(Err(JobError::fatal("boom"))), None),
        AttemptOutcome::Failed {
            non_retryable: true,
            ..
        }
    ));
    assert!(matches!(
        decide(returned(Err(JobError::hand_back("later"))), None),
        AttemptOutcome::HandedBack { .. }
    ));
    // A cancel is confirmed however the handler ended.
    assert!(matches!(
        decide(returned(Ok(())), Some(StopReason::Cancelled)),
        AttemptOutcome::CancelConfirmed
    ));
    assert!(matches!(
        decide(Ended::Dropped, Some(StopReason::Cancelled)),
        AttemptOutcome::CancelConfirmed
    ));
    // A lost lease reports nothing; a shutdown hands back.
    assert!(AttemptOutcome::LeaseLost.completion().is_none());
    assert!(matches!(
        decide(returned(Ok(())), Some(StopReason::LeaseLost)),
        AttemptOutcome::LeaseLost
    ));
    assert!(matches!(
        decide(Ended::Dropped, Some(StopReason::Shutdown)),
        AttemptOutcome::HandedBack { .. }
    ));
    let panicked = decide(Ended::Returned(Err(Box::new("oops"))), None);
    match panicked {
        AttemptOutcome::Failed { message, non_retryable } => {
            assert!(message.contains("oops"), "{message}");
            assert!(!non_retryable);
        }
        other => panic!("a panic is a failure, not {other:?}"),
    }
}

// Real time, a short grace: tokio's paused clock (its `test-util`
// feature) would give the test build a tokio other than `make run`'s, and
// so a second build of everything above it.
#[tokio::test]
async fn a_stopped_handler_gets_the_stop_grace_then_is_dropped() {
    let grace = Duration::from_millis(200);
    let stop = StopSignal::default();
    let force = CancellationToken::new();
    stop.stop(StopReason::Cancelled);
    let stubborn = async {
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok(Ok(()))
    };
    let began = Instant::now();
    let ended = supervise(stubborn, &stop, &force, grace).await;
    assert!(matches!(ended, Ended::Dropped));
    assert!(
        began.elapsed() >= grace,
        "dropped after {:?}, before the grace",
        began.elapsed()
    );

    // At the end of the shutdown grace a handler is dropped at once.
    let stop = StopSignal::default();
    force.cancel();
    let ended = supervise(std::future::pending(), &stop, &force, Duration::from_secs(5)).await;
    assert!(matches!(ended, Ended::Dropped));
    assert_eq!(stop.reason(), Some(StopReason::Shutdown));
}
