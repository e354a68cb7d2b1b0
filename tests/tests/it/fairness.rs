//! Fair sharing inside a key: flows (fairness keys) granted by weighted
//! deficit round-robin, with weights stored and changed at run time.

use std::time::Duration;

use sluice_e2e::*;
use sluice_proto::v1 as pb;
use sluice_proto::v1::set_limit_request::Change;

fn flow_weight(fairness_key: &str, weight: Option<u32>) -> Change {
    Change::FlowWeight(pb::FlowWeight {
        fairness_key: fairness_key.to_string(),
        weight,
    })
}

fn stored_weight(state: &pb::KeyState, fairness_key: &str) -> Option<u32> {
    state
        .flows
        .iter()
        .find(|flow| flow.fairness_key == fairness_key)
        .and_then(|flow| flow.stored_weight)
}

/// Twelve jobs of one customer, then four of another, wait on a paused key
/// of max 1; the second customer's flow has weight 3 (stored, and still
/// there after limit-grant restarts). Once the key resumes, the four small
/// jobs are granted within the first six grants: FIFO would grant them last
/// (13th to 16th), equal weights at best 2nd, 4th, 6th and 8th.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_flow_is_not_stuck_behind_a_big_one_and_weights_survive_a_restart() -> anyhow::Result<()> {
    let mut stack = Stack::start(test_config("fairflows", &[])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let key = "api:stripe";
    let weighted = set_key(&stack, "acme", key, flow_weight("small", Some(3))).await?;
    assert_eq!(stored_weight(&weighted, "small"), Some(3), "{weighted:?}");
    set_key(&stack, "acme", key, Change::Max(0)).await?;
    let mut small = Vec::new();
    for (customer, count) in [("big", 12), ("small", 4)] {
        for index in 0..count {
            let job_id = format!("{prefix}{customer}-{index}");
            let mut request = concurrency_job("acme", key, 1, 0, &job_id);
            request.fairness_key = customer.to_string();
            enqueue_with_id(&admission, &job_id, request).await?;
            if customer == "small" {
                small.push(job_id);
            }
        }
    }
    eventually(Duration::from_secs(30), "sixteen waiters", || async {
        Ok(key_state(&stack, "acme", key).await?.waiting == 16)
    })
    .await?;

    let old = stack.take_limit_grant(0);
    old.stop().await;
    stack.add_limit_grant(sluice_common::Faults::none()).await?;
    eventually(Duration::from_secs(60), "the new owner serves the key", || async {
        Ok(key_state(&stack, "acme", key)
            .await
            .is_ok_and(|state| state.waiting == 16))
    })
    .await?;
    let state = key_state(&stack, "acme", key).await?;
    assert_eq!(
        stored_weight(&state, "small"),
        Some(3),
        "the weight is stored: {state:?}"
    );
    assert_eq!(state.flows_waiting, 2, "{state:?}");
    let big = state.flows.iter().find(|flow| flow.fairness_key == "big");
    assert_eq!(big.map(|flow| (flow.waiting, flow.weight)), Some((12, 1)), "{state:?}");

    set_key(&stack, "acme", key, Change::Clear(true)).await?;
    let mut granted: Vec<String> = Vec::new();
    for _ in 0..6 {
        eventually(Duration::from_secs(30), "the next grant", || async {
            let state = key_state(&stack, "acme", key).await?;
            Ok(state
                .holders
                .first()
                .and_then(|holder| holder.ticket.as_ref())
                .is_some_and(|ticket| !granted.contains(&ticket.job_id)))
        })
        .await?;
        let state = key_state(&stack, "acme", key).await?;
        let job_id = state
            .holders
            .first()
            .and_then(|holder| holder.ticket.clone())
            .map(|ticket| ticket.job_id)
            .unwrap_or_default();
        wait_status(&admission, &job_id, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
        assert_eq!(
            claim_one(&admission, "w", &job_id, 1).await?,
            pb::ClaimOutcome::Claimed as i32
        );
        complete_one(
            &admission,
            "w",
            &job_id,
            1,
            pb::completion::Outcome::Success(pb::Success {}),
        )
        .await?;
        granted.push(job_id);
    }
    let small_granted = granted.iter().filter(|job_id| small.contains(job_id)).count();
    assert_eq!(
        small_granted, 4,
        "the small flow's jobs among the first six grants: {granted:?}"
    );

    // Back to the default weight: the stored weight goes.
    let reset = set_key(&stack, "acme", key, flow_weight("small", None)).await?;
    assert_eq!(stored_weight(&reset, "small"), None, "{reset:?}");
    stack.stop().await;
    Ok(())
}

/// A weight out of range or a fairness key with a NUL byte is refused,
/// naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_flow_weight_is_refused_naming_the_field() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("fairbad", &[])?, 1).await?;
    for (change, field) in [
        (flow_weight("x", Some(0)), "flow_weight.weight"),
        (flow_weight("x", Some(1001)), "flow_weight.weight"),
        (flow_weight("a\0b", Some(2)), "flow_weight.fairness_key"),
    ] {
        let refused = set_key(&stack, "acme", "k", change).await.expect_err("refused");
        let status = refused.downcast_ref::<tonic::Status>().expect("a gRPC status");
        assert_eq!(status.code(), tonic::Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains(field), "{status:?}");
    }
    stack.stop().await;
    Ok(())
}
