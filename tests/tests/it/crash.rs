//! Crash points, injected deterministically with fault hooks: each run must
//! still complete every job, never overrun a key, run each job once, and end
//! with no ticket held.

use std::sync::Arc;
use std::time::Duration;

use sluice_common::{FaultPoint, Faults, Shutdown};
use sluice_e2e::*;
use sluice_proto::v1 as pb;

use crate::flow::{check_runs, three_hundred_requests};

/// Which node a scenario breaks, and how.
enum Break {
    /// Arm `point` on the first limit-grant; when it fires, start a new one.
    LimitGrant(FaultPoint),
    /// Arm `point` on the first admission (a second one serves workers and
    /// takes over its partitions).
    Admission(FaultPoint),
    /// Kill the second of two limit-grant instances after `after` completions.
    KillSecondLimitGrant { after: usize },
}

async fn run_scenario(name: &str, broken: Break) -> anyhow::Result<()> {
    let limit_grants = match broken {
        Break::KillSecondLimitGrant { .. } => 2,
        _ => 1,
    };
    let mut stack = Stack::start(test_config(name, &[])?, limit_grants).await?;
    stack.add_admission(Faults::none()).await?;
    let worker_endpoint = stack.admissions[1].endpoint.clone();
    match &broken {
        // Let a few batches through first, so the crash lands mid-run.
        Break::LimitGrant(point) => stack.limit_grants[0].faults.arm(*point, 5, 1),
        Break::Admission(point) => stack.admissions[0].faults.arm(*point, 1, 1),
        Break::KillSecondLimitGrant { .. } => {}
    }

    let stop = Shutdown::new();
    let recorder = Arc::new(Recorder::default());
    let worker_stack = WorkerTarget {
        stack: &stack,
        endpoint: worker_endpoint.clone(),
    };
    worker_stack.start(&recorder, &stop);
    RequestProducer::new(&stack.config)?
        .send(&three_hundred_requests())
        .await?;

    match broken {
        Break::LimitGrant(point) => {
            stack.limit_grants[0].wait_stopped(Duration::from_secs(60)).await?;
            assert_eq!(stack.limit_grants[0].faults.fired(point), 1);
            let crashed = stack.take_limit_grant(0);
            drop(crashed);
            stack.add_limit_grant(Faults::none()).await?;
        }
        Break::Admission(point) => {
            stack.admissions[0].wait_stopped(Duration::from_secs(60)).await?;
            assert_eq!(stack.admissions[0].faults.fired(point), 1);
        }
        Break::KillSecondLimitGrant { after } => {
            eventually(Duration::from_secs(60), "some completions", || async {
                Ok(recorder.completed() >= after)
            })
            .await?;
            let second = stack.take_limit_grant(1);
            second.kill().await;
        }
    }

    let completed = eventually(Duration::from_secs(180), "300 completions", || async {
        Ok(recorder.completed() == 300)
    })
    .await;
    if let Err(error) = completed {
        // Say where the missing jobs are before failing.
        let statuses = stack.job_statuses().await?;
        let schema = stack.config.schema("admission");
        let query = format!(
            "SELECT j.job_id, coalesce(o.status, 0::smallint), j.attempt, j.step FROM \"{schema}\".jobs j
             LEFT JOIN \"{schema}\".job_outcomes o USING (job_id)
             WHERE o.status IS DISTINCT FROM {} LIMIT 5",
            pb::JobStatus::Succeeded as i16
        );
        let stuck: Vec<(String, i16, i32, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(query))
            .fetch_all(&stack.pool)
            .await?;
        let admission = sluice_proto::v1::admission_client::AdmissionClient::new(connect(&worker_endpoint).await?);
        let mut views = Vec::new();
        for (job_id, ..) in &stuck {
            views.push(job_view(&admission, job_id).await?);
        }
        anyhow::bail!(
            "{error}; {} completed; statuses {statuses:?}; stuck {stuck:?}; claims {:?}; views {views:#?}",
            recorder.completed(),
            recorder.claim_outcomes.lock().unwrap()
        );
    }
    check_runs(&recorder, 300, 2);
    eventually(Duration::from_secs(60), "no ticket left", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    let statuses = stack.job_statuses().await?;
    assert_eq!(
        statuses.get(&(pb::JobStatus::Succeeded as i16)),
        Some(&300),
        "{statuses:?}"
    );
    stop.trigger();
    stack.stop().await;
    Ok(())
}

struct WorkerTarget<'a> {
    stack: &'a Stack,
    endpoint: String,
}

impl WorkerTarget<'_> {
    fn start(&self, recorder: &Arc<Recorder>, stop: &Shutdown) {
        for index in 0..2 {
            let options = WorkerOptions {
                worker_id: format!("worker-{index}"),
                task_group: "default".to_string(),
                group: format!("{}workers", self.stack.config.kafka.topic_prefix),
                concurrency: 8,
                min_run: Duration::from_millis(1),
                max_run: Duration::from_millis(20),
            };
            tokio::spawn(run_worker(
                self.stack.config.clone(),
                self.endpoint.clone(),
                options,
                recorder.clone(),
                stop.clone(),
            ));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limit_grant_killed_after_commit_before_publish() -> anyhow::Result<()> {
    run_scenario("lgcommit", Break::LimitGrant(FaultPoint::OwnerAfterCommitBeforePublish)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn limit_grant_killed_after_publish_before_offset_commit() -> anyhow::Result<()> {
    run_scenario(
        "lgoffset",
        Break::LimitGrant(FaultPoint::OwnerAfterPublishBeforeOffsetStore),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admission_killed_after_saving_jobs_before_sending_acquires() -> anyhow::Result<()> {
    run_scenario("admsave", Break::Admission(FaultPoint::OwnerAfterCommitBeforePublish)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admission_killed_after_publish_before_offset_commit() -> anyhow::Result<()> {
    run_scenario(
        "admoffset",
        Break::Admission(FaultPoint::AdmissionAfterPublishBeforeOffsetStore),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_of_two_limit_grants_killed_mid_run() -> anyhow::Result<()> {
    run_scenario("lgkill", Break::KillSecondLimitGrant { after: 80 }).await
}

/// limit-grant commits grants and the stream that takes them breaks before
/// they are written (three times, mid-run). Admission re-sends acquires only
/// after 10 minutes here, so only the link's own recovery can deliver them:
/// admission connects again, claims its job partitions, and the owner sends
/// the grants of their held tickets again. Every job runs once, no key is
/// overrun, and no ticket is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_link_that_breaks_between_commit_and_grant_delivery_loses_no_grant() -> anyhow::Result<()> {
    let stack = Stack::start(
        test_config(
            "linkbreak",
            &[
                ("admission.resend_waiting_after", "10m"),
                ("admission.claim_timeout", "10m"),
            ],
        )?,
        1,
    )
    .await?;
    stack.limit_grants[0]
        .faults
        .arm(FaultPoint::LinkBrokenBeforeGrants, 5, 3);
    let stop = Shutdown::new();
    let recorder = Arc::new(Recorder::default());
    crate::flow::start_workers(&stack, &recorder, &stop, 2);
    RequestProducer::new(&stack.config)?
        .send(&three_hundred_requests())
        .await?;
    eventually(Duration::from_secs(120), "300 completions", || async {
        Ok(recorder.completed() == 300)
    })
    .await?;
    assert_eq!(
        stack.limit_grants[0].faults.fired(FaultPoint::LinkBrokenBeforeGrants),
        3,
        "the link broke three times"
    );
    check_runs(&recorder, 300, 2);
    eventually(Duration::from_secs(60), "no ticket left", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    stop.trigger();
    stack.stop().await;
    Ok(())
}

/// An owner takes link commands off an open stream and its partition stops
/// before it commits them (the first twenty messages): it refuses them, and
/// admission sends them again at once (re-sends after a wait are off here),
/// so the job's acquire is applied and the job admitted. Before, such
/// commands waited on the open stream for admission's next re-send.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn link_commands_an_owner_dropped_before_its_commit_are_sent_again() -> anyhow::Result<()> {
    let stack = Stack::start(
        test_config(
            "linkdrop",
            &[
                ("admission.resend_waiting_after", "10m"),
                ("admission.claim_timeout", "10m"),
            ],
        )?,
        1,
    )
    .await?;
    stack.wait_owned(Duration::from_secs(60)).await?;
    stack.limit_grants[0]
        .faults
        .arm(FaultPoint::LinkCommandsDroppedBeforeCommit, 0, 20);
    let mut admission = stack.admission_client().await?;
    let mut request = concurrency_job("acme", "dropped", 1, 50, "x");
    request.job_id = Some("dropped-acquire".to_string());
    admission.enqueue(pb::EnqueueRequest { job: Some(request) }).await?;
    eventually(Duration::from_secs(30), "the job admitted", || async {
        Ok(job_view(&admission, "dropped-acquire").await?.status == pb::JobStatus::Admitted as i32)
    })
    .await?;
    assert!(
        stack.limit_grants[0]
            .faults
            .fired(FaultPoint::LinkCommandsDroppedBeforeCommit)
            > 0
    );
    stack.stop().await;
    Ok(())
}

/// A newer owner took a partition over and gave it up again while this
/// instance, still assigned it, had no input (rebalances that overlapped
/// under faults): the owner row names the other instance at a newer epoch,
/// so callers go there, and this one never commits to find out. Here the
/// rate-window rows (nothing else writes to them while no rate job runs)
/// are moved by hand to an address nobody serves. The idle owner sees the
/// newer epoch within seconds and takes its partitions over again (before,
/// they stayed with the address nobody serves for ever), and a rate job is
/// then admitted (re-sends after a wait are off).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_idle_owner_fenced_by_a_newer_epoch_takes_its_partitions_over_again() -> anyhow::Result<()> {
    let stack = Stack::start(
        test_config(
            "idlefence",
            &[
                ("admission.resend_waiting_after", "10m"),
                ("admission.claim_timeout", "10m"),
            ],
        )?,
        1,
    )
    .await?;
    stack.wait_owned(Duration::from_secs(60)).await?;
    let schema = stack.config.schema("rate_window");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE \"{schema}\".owners SET epoch = epoch + 1, endpoint = 'http://127.0.0.1:1'"
    )))
    .execute(&stack.pool)
    .await?;
    let elsewhere = format!("SELECT count(*) FROM \"{schema}\".owners WHERE endpoint = 'http://127.0.0.1:1'");
    eventually(Duration::from_secs(30), "every partition taken over again", || async {
        let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(elsewhere.clone()))
            .fetch_one(&stack.pool)
            .await?;
        Ok(left == 0)
    })
    .await?;
    let mut admission = stack.admission_client().await?;
    let mut request = rate_job("acme", "fenced", 10, 1000, "x");
    request.job_id = Some("after-fence".to_string());
    admission.enqueue(pb::EnqueueRequest { job: Some(request) }).await?;
    eventually(Duration::from_secs(30), "the job admitted", || async {
        Ok(job_view(&admission, "after-fence").await?.status == pb::JobStatus::Admitted as i32)
    })
    .await?;
    stack.stop().await;
    Ok(())
}
