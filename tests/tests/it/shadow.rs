//! Shadow mode: a limit measured, not enforced, and switched to enforce at
//! run time.

use std::time::Duration;

use sluice_e2e::*;
use sluice_proto::v1 as pb;
use sluice_proto::v1::set_limit_request::Change;

fn shadow_job(key: &str, payload: &str) -> pb::JobRequest {
    let mut request = concurrency_job("acme", key, 1, 0, payload);
    for limit in &mut request.limits {
        if let Some(pb::limit::Kind::Concurrency(concurrency)) = limit.kind.as_mut() {
            concurrency.shadow = true;
        }
    }
    request
}

/// Five jobs name a key of max 1 in shadow mode: all five are admitted at
/// once, and the key accounts one would-be holder, four would-be waiters and
/// four grants over the max. Switched to enforce (a stored mode, beating the
/// jobs' flags), a sixth waits until the five are done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_limit_admits_everyone_accounts_the_limit_and_enforcing_applies_at_once() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("shadow", &[])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let key = "api:new-downstream";
    let ids: Vec<String> = (0..5).map(|index| format!("{prefix}shadow-{index}")).collect();
    for id in &ids {
        enqueue_with_id(&admission, id, shadow_job(key, id)).await?;
    }
    for id in &ids {
        wait_status(&admission, id, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    }
    let state = key_state(&stack, "acme", key).await?;
    assert_eq!(state.holders.len(), 5, "shadow mode admits past the max: {state:?}");
    let shadow = state.shadow.unwrap_or_default();
    assert_eq!(
        (shadow.would_hold, shadow.would_wait, shadow.would_have_exceeded),
        (1, 4, 4),
        "{state:?}"
    );

    let enforced = set_key(&stack, "acme", key, Change::Mode(pb::LimitMode::Enforce as i32)).await?;
    assert_eq!(enforced.mode, Some(pb::LimitMode::Enforce as i32));
    let late = format!("{prefix}late");
    enqueue_with_id(&admission, &late, shadow_job(key, "late")).await?;
    eventually(
        Duration::from_secs(30),
        "the late job waits on the enforced key",
        || async { Ok(key_state(&stack, "acme", key).await?.waiting == 1) },
    )
    .await?;
    assert_eq!(job_view(&admission, &late).await?.status, pb::JobStatus::Waiting as i32);
    for id in &ids {
        assert_eq!(
            claim_one(&admission, "w", id, 1).await?,
            pb::ClaimOutcome::Claimed as i32
        );
        complete_one(&admission, "w", id, 1, pb::completion::Outcome::Success(pb::Success {})).await?;
    }
    wait_status(&admission, &late, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    stack.stop().await;
    Ok(())
}
