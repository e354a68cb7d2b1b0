//! Concurrency limits complete: leases, lost releases, retries, overrides
//! across restarts, deadlock-free chains, queue and cluster caps.

use std::sync::Arc;
use std::time::{Duration, Instant};

use sluice_common::{FaultPoint, Shutdown};
use sluice_e2e::*;
use sluice_proto::v1 as pb;

fn retrying(mut request: pb::JobRequest, max_attempts: u32, initial_backoff: &str) -> pb::JobRequest {
    request.retry = Some(pb::RetryPolicy {
        max_attempts,
        initial_backoff: initial_backoff.to_string(),
        ..Default::default()
    });
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_lease_gives_the_ticket_back_and_heartbeats_keep_it() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("lease", &[("task_groups.default.lease", "2s")])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let a = format!("{prefix}a");
    let b = format!("{prefix}b");
    enqueue_with_id(
        &admission,
        &a,
        retrying(concurrency_job("acme", "lease-key", 1, 0, "a"), 3, "100ms"),
    )
    .await?;
    wait_status(&admission, &a, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    enqueue_with_id(&admission, &b, concurrency_job("acme", "lease-key", 1, 0, "b")).await?;
    assert_eq!(
        claim_one(&admission, "w1", &a, 1).await?,
        pb::ClaimOutcome::Claimed as i32
    );
    let claimed_at = Instant::now();
    let claimed_at_ms = sluice_common::clock::wall_clock_ms();

    // w1 never heartbeats: within lease + one sweep the lease expires and the
    // ticket goes back; b runs once the release and the grant have travelled.
    wait_status(&admission, &b, pb::JobStatus::Admitted, Duration::from_secs(15)).await?;
    let reclaimed_after = claimed_at.elapsed();
    assert!(
        reclaimed_after >= Duration::from_millis(1900),
        "reclaimed early: {reclaimed_after:?}"
    );
    let expired = job_view(&admission, &a).await?;
    let expired_after_ms = expired.history[0].at_ms - claimed_at_ms;
    assert!(
        (1_900..=2_000 + 200 + 1_000).contains(&expired_after_ms),
        "lease 2s + one sweep of 200ms (+ scheduling): expired {expired_after_ms} ms after the claim"
    );
    assert_eq!(expired.attempt, 2, "the retry policy gave it a new attempt");
    assert_eq!(expired.history[0].outcome, "lease_expired");
    assert_eq!(
        heartbeat_one(&admission, "w1", &a, 1).await?,
        pb::HeartbeatOutcome::LeaseLost as i32,
        "the old attempt's worker learns to stop"
    );

    // w2 heartbeats b for three leases: it keeps its ticket and a waits.
    assert_eq!(
        claim_one(&admission, "w2", &b, 1).await?,
        pb::ClaimOutcome::Claimed as i32
    );
    let until = Instant::now() + Duration::from_secs(6);
    while Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            heartbeat_one(&admission, "w2", &b, 1).await?,
            pb::HeartbeatOutcome::Extended as i32
        );
    }
    let waiting = job_view(&admission, &a).await?;
    assert_eq!(waiting.status, pb::JobStatus::Waiting as i32, "{}", waiting.reason);
    let state = key_state(&stack, "acme", "lease-key").await?;
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].ticket.as_ref().unwrap().job_id, b);

    let done = complete_one(
        &admission,
        "w2",
        &b,
        1,
        pb::completion::Outcome::Success(pb::Success {}),
    )
    .await?;
    assert_eq!(done.outcome, pb::CompleteOutcome::Accepted as i32);
    let readmitted = wait_status(&admission, &a, pb::JobStatus::Admitted, Duration::from_secs(10)).await?;
    assert_eq!(readmitted.attempt, 2);
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_release_is_reclaimed_by_the_stand_behind_sweep() -> anyhow::Result<()> {
    // Stand-behind every 1s, tickets nobody stands behind expire after 3s.
    let stack = Stack::start(test_config("lostrelease", &[])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let a = format!("{prefix}a");
    let b = format!("{prefix}b");
    enqueue_with_id(&admission, &a, concurrency_job("acme", "lost-key", 1, 0, "a")).await?;
    wait_status(&admission, &a, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    enqueue_with_id(&admission, &b, concurrency_job("acme", "lost-key", 1, 0, "b")).await?;
    assert_eq!(
        claim_one(&admission, "w", &a, 1).await?,
        pb::ClaimOutcome::Claimed as i32
    );

    stack.admissions[0].faults.arm(FaultPoint::AdmissionDropRelease, 0, 1);
    complete_one(&admission, "w", &a, 1, pb::completion::Outcome::Success(pb::Success {})).await?;
    let completed_at = Instant::now();
    assert_eq!(stack.admissions[0].faults.fired(FaultPoint::AdmissionDropRelease), 1);
    assert_eq!(job_view(&admission, &a).await?.status, pb::JobStatus::Succeeded as i32);

    // Nobody stands behind a's ticket any more: it expires and b is granted.
    wait_status(&admission, &b, pb::JobStatus::Admitted, Duration::from_secs(20)).await?;
    let reclaimed_after = completed_at.elapsed();
    assert!(
        reclaimed_after >= Duration::from_millis(1500),
        "b was admitted too soon for a reclaim: {reclaimed_after:?} (was the release really dropped?)"
    );
    let state = key_state(&stack, "acme", "lost-key").await?;
    let holders: Vec<&str> = state
        .holders
        .iter()
        .map(|holder| holder.ticket.as_ref().unwrap().job_id.as_str())
        .collect();
    assert_eq!(holders, vec![b.as_str()], "a's ticket is gone, nothing leaks");
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_retries_after_its_backoff_and_a_late_complete_frees_nothing() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("retries", &[])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let a = format!("{prefix}a");
    let c = format!("{prefix}c");
    enqueue_with_id(
        &admission,
        &a,
        retrying(concurrency_job("acme", "retry-key", 1, 0, "a"), 3, "1s"),
    )
    .await?;
    wait_status(&admission, &a, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    assert_eq!(
        claim_one(&admission, "w", &a, 1).await?,
        pb::ClaimOutcome::Claimed as i32
    );
    let failed = complete_one(
        &admission,
        "w",
        &a,
        1,
        pb::completion::Outcome::Failure(pb::Failure {
            error: "boom".to_string(),
            non_retryable: false,
        }),
    )
    .await?;
    let failed_at = Instant::now();
    assert_eq!(failed.outcome, pb::CompleteOutcome::Accepted as i32);
    assert_eq!(failed.status, pb::JobStatus::Scheduled as i32, "waits out its backoff");
    // Tickets are released during the backoff (the owner applies the release
    // right after Complete publishes it).
    eventually(
        Duration::from_millis(900),
        "attempt 1's ticket released in the backoff",
        || async { Ok(key_state(&stack, "acme", "retry-key").await?.holders.is_empty()) },
    )
    .await?;

    let retried = wait_status(&admission, &a, pb::JobStatus::Admitted, Duration::from_secs(15)).await?;
    assert!(
        failed_at.elapsed() >= Duration::from_millis(950),
        "backoff of 1s not kept"
    );
    assert_eq!(retried.attempt, 2);
    assert_eq!(retried.history[0].outcome, "failed");
    assert_eq!(retried.history[0].detail, "boom");
    assert_eq!(retried.last_error, "boom");
    assert_eq!(claim_one(&admission, "w", &a, 1).await?, pb::ClaimOutcome::Stale as i32);
    assert_eq!(
        claim_one(&admission, "w", &a, 2).await?,
        pb::ClaimOutcome::Claimed as i32
    );

    enqueue_with_id(&admission, &c, concurrency_job("acme", "retry-key", 1, 0, "c")).await?;
    let late = complete_one(&admission, "w", &a, 1, pb::completion::Outcome::Success(pb::Success {})).await?;
    assert_eq!(late.outcome, pb::CompleteOutcome::Stale as i32);
    // Everything before is applied: a release the late complete sent would
    // have reached limit-grant, and a grant to c come back.
    stack.barrier().await?;
    let state = key_state(&stack, "acme", "retry-key").await?;
    let holder = state.holders[0].ticket.clone().unwrap();
    assert_eq!(
        (holder.job_id.as_str(), holder.attempt),
        (a.as_str(), 2),
        "attempt 2 still holds"
    );
    assert_eq!(job_view(&admission, &c).await?.status, pb::JobStatus::Waiting as i32);

    complete_one(&admission, "w", &a, 2, pb::completion::Outcome::Success(pb::Success {})).await?;
    wait_status(&admission, &c, pb::JobStatus::Admitted, Duration::from_secs(10)).await?;
    assert_eq!(job_view(&admission, &a).await?.status, pb::JobStatus::Succeeded as i32);
    stack.stop().await;
    Ok(())
}

async fn restart_limit_grant(stack: &mut Stack) -> anyhow::Result<()> {
    let old = stack.take_limit_grant(0);
    old.stop().await;
    stack.add_limit_grant(sluice_common::Faults::none()).await?;
    let endpoint = stack.limit_grants[0].endpoint.clone();
    wait_serving(&endpoint, Duration::from_secs(60)).await?;
    Ok(())
}

async fn admitted_count(
    admission: &sluice_proto::v1::admission_client::AdmissionClient<tonic::transport::Channel>,
    ids: &[String],
) -> anyhow::Result<usize> {
    let mut count = 0;
    for id in ids {
        if job_view(admission, id).await?.status == pb::JobStatus::Admitted as i32 {
            count += 1;
        }
    }
    Ok(count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overrides_survive_a_restart_of_limit_grant() -> anyhow::Result<()> {
    use pb::set_limit_request::Change;
    let mut stack = Stack::start(test_config("overrides", &[])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let paused = set_key(&stack, "acme", "ov-key", Change::Max(0)).await?;
    assert!(paused.paused);
    let ids: Vec<String> = (0..3).map(|index| format!("{prefix}job-{index}")).collect();
    for id in &ids {
        enqueue_with_id(&admission, id, concurrency_job("acme", "ov-key", 2, 0, id)).await?;
    }
    eventually(Duration::from_secs(30), "three waiters on the paused key", || async {
        Ok(key_state(&stack, "acme", "ov-key").await?.waiting == 3)
    })
    .await?;
    assert_eq!(
        admitted_count(&admission, &ids).await?,
        0,
        "a paused key grants nothing"
    );

    restart_limit_grant(&mut stack).await?;
    eventually(Duration::from_secs(60), "the new owner serves the key", || async {
        Ok(key_state(&stack, "acme", "ov-key")
            .await
            .is_ok_and(|state| state.waiting == 3))
    })
    .await?;
    let state = key_state(&stack, "acme", "ov-key").await?;
    assert!(
        state.paused && state.override_max == Some(0),
        "still paused after the restart: {state:?}"
    );
    // Admission's link to the new owner is up (a job on another key goes
    // through it), and everything in flight is applied (the grants the new
    // owner sent when the link claimed the job partitions, commands and
    // grants since): still nothing admitted.
    let probe = format!("{prefix}probe");
    enqueue_with_id(&admission, &probe, concurrency_job("acme", "probe-key", 1, 0, "probe")).await?;
    wait_status(&admission, &probe, pb::JobStatus::Admitted, Duration::from_secs(30)).await?;
    stack.barrier().await?;
    assert_eq!(admitted_count(&admission, &ids).await?, 0);

    // Raising the limit grants waiters at once.
    let raised_at = Instant::now();
    set_key(&stack, "acme", "ov-key", Change::Max(2)).await?;
    eventually(Duration::from_secs(10), "two admitted", || async {
        Ok(admitted_count(&admission, &ids).await? == 2)
    })
    .await?;
    assert!(raised_at.elapsed() < Duration::from_secs(5));
    restart_limit_grant(&mut stack).await?;
    eventually(
        Duration::from_secs(60),
        "override 2 after the second restart",
        || async {
            Ok(key_state(&stack, "acme", "ov-key")
                .await
                .is_ok_and(|state| state.override_max == Some(2) && state.holders.len() == 2))
        },
    )
    .await?;
    let mut limits = stack.limits_client().await?;
    let listed = limits
        .list_keys(pb::ListKeysRequest {
            tenant: "acme".to_string(),
            prefix: "ov-".to_string(),
            page_size: 10,
            page_token: String::new(),
        })
        .await?
        .into_inner();
    assert_eq!(listed.keys.len(), 1);
    let summary = &listed.keys[0];
    assert_eq!(
        (
            summary.key.as_ref().unwrap().key.as_str(),
            summary.holders,
            summary.waiting,
            summary.override_max
        ),
        ("ov-key", 2, 1, Some(2))
    );
    let cleared = set_key(&stack, "acme", "ov-key", Change::Clear(true)).await?;
    assert_eq!(cleared.override_max, None);
    stack.stop().await;
    Ok(())
}

fn start_workers(stack: &Stack, recorder: &Arc<Recorder>, stop: &Shutdown, task_group: &str, count: usize) {
    for index in 0..count {
        tokio::spawn(run_worker(
            stack.config.clone(),
            stack.admissions[0].endpoint.clone(),
            WorkerOptions {
                worker_id: format!("{task_group}-worker-{index}"),
                task_group: task_group.to_string(),
                group: format!("{}{task_group}-workers", stack.config.kafka.topic_prefix),
                concurrency: 8,
                min_run: Duration::from_millis(1),
                max_run: Duration::from_millis(25),
            },
            recorder.clone(),
            stop.clone(),
        ));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chains_race_without_overrun_or_deadlock() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("chainrace", &[])?, 1).await?;
    let mut requests = Vec::new();
    for index in 0..200 {
        requests.push(multi_key_job(
            "acme",
            &[("tenant-key", 3), ("shared-key", 2)],
            &format!("shared/{index}"),
        ));
    }
    for index in 0..100 {
        let keys: &[(&str, u32)] = if index % 2 == 0 {
            &[("k1", 1), ("k2", 1)]
        } else {
            &[("k2", 1), ("k1", 1)]
        };
        requests.push(multi_key_job("acme", keys, &format!("crossed/{index}")));
    }
    let stop = Shutdown::new();
    let recorder = Arc::new(Recorder::default());
    start_workers(&stack, &recorder, &stop, "default", 2);
    RequestProducer::new(&stack.config)?.send(&requests).await?;
    eventually(Duration::from_secs(240), "300 completions (no deadlock)", || async {
        Ok(recorder.completed() == 300)
    })
    .await?;
    let runs = recorder.runs();
    let shared: Vec<&RunRecord> = runs.iter().filter(|run| run.payload.starts_with("shared/")).collect();
    let crossed: Vec<&RunRecord> = runs.iter().filter(|run| run.payload.starts_with("crossed/")).collect();
    assert_eq!((shared.len(), crossed.len()), (200, 100));
    assert!(
        max_overlap(&shared) <= 2,
        "shared-key (limit 2) overran: {}",
        max_overlap(&shared)
    );
    // Every crossed job holds both k1 and k2 (limit 1): they run one at a time.
    assert_eq!(max_overlap(&crossed), 1, "k1/k2 (limit 1) overran");
    eventually(Duration::from_secs(30), "no ticket left", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    stop.trigger();
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queue_and_cluster_caps_from_configuration_hold() -> anyhow::Result<()> {
    use pb::set_limit_request::Change;
    let config = test_config_toml(
        "caps",
        r#"
        [task_groups.emails]
        lease = "30s"
        caps = [{ key = "smtp-queue", max = 2 }]

        [task_groups.reports]
        lease = "30s"
        caps = [{ key = "cluster", max = 3, scope = "global" }]
        "#,
        &[],
    )?;
    let stack = Stack::start(config, 1).await?;
    // Both caps paused until every job waits on them: resuming grants each
    // cap's whole max in one batch, so "the cap is reached" is a state to
    // check, not a race between workers (their runs overlapping in time).
    let caps = [("acme", "cap:smtp-queue", 2usize), ("*", "cap:cluster", 3)];
    for (tenant, key, _) in caps {
        set_key(&stack, tenant, key, Change::Max(0)).await?;
    }
    let mut requests = Vec::new();
    for index in 0..40 {
        let mut email = concurrency_job("acme", &format!("mailbox-{index}"), 10, 0, &format!("emails/{index}"));
        email.task_group = "emails".to_string();
        requests.push(email);
        let tenant = ["t1", "t2", "t3", "t4"][index % 4];
        let mut report = concurrency_job(tenant, &format!("report-{index}"), 10, 0, &format!("reports/{index}"));
        report.task_group = "reports".to_string();
        requests.push(report);
    }
    let stop = Shutdown::new();
    let recorder = Arc::new(Recorder::default());
    start_workers(&stack, &recorder, &stop, "emails", 1);
    start_workers(&stack, &recorder, &stop, "reports", 1);
    RequestProducer::new(&stack.config)?.send(&requests).await?;
    // The cluster cap is one key (tenant `*`) that all four tenants' reports wait on.
    for (tenant, key, _) in caps {
        eventually(Duration::from_secs(60), "40 jobs waiting on the cap", || async {
            Ok(key_state(&stack, tenant, key).await?.waiting == 40)
        })
        .await?;
    }
    for (tenant, key, max) in caps {
        let resumed = set_key(&stack, tenant, key, Change::Clear(true)).await?;
        assert_eq!(
            (resumed.holders.len(), resumed.waiting),
            (max, 40 - u32::try_from(max)?),
            "{tenant}/{key}: the cap's max is granted at once (and no more): {resumed:?}"
        );
    }
    eventually(Duration::from_secs(120), "80 completions", || async {
        Ok(recorder.completed() == 80)
    })
    .await?;
    let runs = recorder.runs();
    let emails: Vec<&RunRecord> = runs.iter().filter(|run| run.payload.starts_with("emails/")).collect();
    let reports: Vec<&RunRecord> = runs.iter().filter(|run| run.payload.starts_with("reports/")).collect();
    assert!(max_overlap(&emails) <= 2, "the per-queue cap is 2");
    assert!(max_overlap(&reports) <= 3, "the cluster-wide cap across tenants is 3");
    let job = job_view(&stack.admission_client().await?, &runs[0].job_id).await?;
    assert!(job
        .acquisition_order
        .iter()
        .any(|step| step.origin.starts_with("task_group:")));
    stop.trigger();
    stack.stop().await;
    Ok(())
}

/// Tickets an earlier version saved as rows (the `tickets` table) are what a
/// partition without a journal starts from; its first snapshot holds them
/// and deletes the rows. Here a holder's ticket is turned into such a row
/// while limit-grant is down: after the upgrade it still keeps its key full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tickets_saved_as_rows_by_an_earlier_version_are_kept() -> anyhow::Result<()> {
    // No worker claims the holder: a long grace keeps the stand-behind sweep
    // out of the test.
    let mut stack = Stack::start(test_config("legacytickets", &[("limit_grant.ticket_grace", "10m")])?, 1).await?;
    let prefix = stack.config.kafka.topic_prefix.clone();
    let admission = stack.admission_client().await?;
    let holder = format!("{prefix}holder");
    enqueue_with_id(
        &admission,
        &holder,
        concurrency_job("acme", "legacy-key", 1, 0, &holder),
    )
    .await?;
    eventually(Duration::from_secs(30), "the holder granted", || async {
        Ok(key_state(&stack, "acme", "legacy-key")
            .await
            .is_ok_and(|state| state.holders.len() == 1))
    })
    .await?;

    // limit-grant down; its saved state rewritten as an earlier version
    // would have left it: the ticket as a row, no snapshot, no journal.
    let old = stack.take_limit_grant(0);
    old.stop().await;
    let saved = stack.saved_tickets().await?;
    let [ticket] = saved.as_slice() else {
        anyhow::bail!("one saved ticket expected: {saved:?}");
    };
    assert!(ticket.held && *ticket.ticket.job_id == *holder, "{ticket:?}");
    let schema = stack.config.schema("limit_grant");
    let pool = sluice_common::storage::connect(&stack.config.postgres, &schema).await?;
    let partition =
        sluice_common::partition::key_partition("acme", "legacy-key", stack.config.kafka.partitions.limit_commands);
    sqlx::query("DELETE FROM ticket_snapshots WHERE partition = $1")
        .bind(partition)
        .execute(&pool)
        .await?;
    sqlx::query("DELETE FROM ticket_journal WHERE partition = $1")
        .bind(partition)
        .execute(&pool)
        .await?;
    sqlx::query(
        "INSERT INTO tickets (job_id, attempt, step, partition, tenant, key, held, priority, enqueued_at_us,
                              job_max, floating, waiting_since_ms, position_at_enqueue, granted_at_ms)
         VALUES ($1, $2, $3, $4, 'acme', 'legacy-key', true, $5, $6, $7, false, $8, $9, $10)",
    )
    .bind(&*ticket.ticket.job_id)
    .bind(i32::try_from(ticket.ticket.attempt)?)
    .bind(i32::try_from(ticket.ticket.step)?)
    .bind(partition)
    .bind(i16::try_from(ticket.priority)?)
    .bind(ticket.enqueued_at_us)
    .bind(i32::try_from(ticket.job_max)?)
    .bind(ticket.waiting_since_ms)
    .bind(i32::try_from(ticket.position_at_enqueue)?)
    .bind(ticket.granted_at_ms)
    .execute(&pool)
    .await?;

    stack.add_limit_grant(sluice_common::Faults::none()).await?;
    wait_serving(&stack.limit_grants[0].endpoint, Duration::from_secs(60)).await?;
    let waiter = format!("{prefix}waiter");
    enqueue_with_id(
        &admission,
        &waiter,
        concurrency_job("acme", "legacy-key", 1, 0, &waiter),
    )
    .await?;
    eventually(
        Duration::from_secs(30),
        "the new job waits behind the saved holder",
        || async {
            Ok(key_state(&stack, "acme", "legacy-key")
                .await
                .is_ok_and(|state| state.waiting == 1 && state.holders.len() == 1))
        },
    )
    .await?;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM tickets")
        .fetch_one(&pool)
        .await?;
    assert_eq!(rows, 0, "the first snapshot took the rows over");
    let saved = stack.saved_tickets().await?;
    assert!(
        saved
            .iter()
            .any(|ticket| *ticket.ticket.job_id == *holder && ticket.held),
        "the saved holder is journaled: {saved:?}"
    );
    assert!(
        saved
            .iter()
            .any(|ticket| *ticket.ticket.job_id == *waiter && !ticket.held),
        "and the new waiter: {saved:?}"
    );
    stack.stop().await;
    Ok(())
}
