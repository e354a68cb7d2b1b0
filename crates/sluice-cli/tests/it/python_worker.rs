//! The Python worker example (`examples/python/worker.py`) against a real
//! stack: it runs jobs under their limit, keeps a job longer than its lease by
//! heartbeating, reports failures, stops a cancelled job, answers refresh
//! tasks, and hands back its job on SIGTERM.

use std::collections::HashMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use sluice_e2e::*;
use sluice_proto::v1 as pb;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::support::{python_tools, repo_root, LOW_CONNECTIONS};

/// A running `worker.py` and the JSON events it printed so far.
struct PythonWorker {
    child: tokio::process::Child,
    events: Arc<Mutex<Vec<serde_json::Value>>>,
}

impl PythonWorker {
    fn start(stack: &Stack, extra: &[&str]) -> anyhow::Result<PythonWorker> {
        let mut args: Vec<&str> = vec![
            "--brokers",
            &stack.config.kafka.brokers,
            "--refresh-dispatcher",
            &stack.refresh_dispatchers[0].endpoint,
            "--topic-prefix",
            &stack.config.kafka.topic_prefix,
            "--fetch-wait-max-ms",
            "25",
        ];
        args.extend_from_slice(extra);
        Self::start_script(stack, "worker.py", &args)
    }

    /// `examples/python/<script>` with the admission endpoint, JSON events
    /// and `args`.
    fn start_script(stack: &Stack, script: &str, args: &[&str]) -> anyhow::Result<PythonWorker> {
        let tools = python_tools()?;
        tools.generate_stubs()?;
        let mut child = tokio::process::Command::new(&tools.python)
            .arg(repo_root().join("examples/python").join(script))
            .args(["--admission", &stack.admissions[0].endpoint])
            .arg("--json-events")
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting examples/python/{script}"))?;
        let stdout = child.stdout.take().context("worker stdout")?;
        let events = Arc::new(Mutex::new(Vec::new()));
        tokio::spawn({
            let events = events.clone();
            async move {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    match serde_json::from_str::<serde_json::Value>(&line) {
                        Ok(event) => events.lock().unwrap().push(event),
                        Err(_) => eprintln!("worker.py stdout: {line}"),
                    }
                }
            }
        });
        Ok(PythonWorker { child, events })
    }

    fn events(&self) -> Vec<serde_json::Value> {
        self.events.lock().unwrap().clone()
    }

    fn events_for(&self, job_id: &str) -> Vec<serde_json::Value> {
        self.events()
            .into_iter()
            .filter(|event| event["job_id"] == job_id)
            .collect()
    }

    async fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<std::process::ExitStatus> {
        Ok(tokio::time::timeout(timeout, self.child.wait())
            .await
            .context("worker.py did not exit in time")??)
    }

    async fn signal_term(&self) -> anyhow::Result<()> {
        let pid = self.child.id().context("worker already exited")?;
        let status = tokio::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .await?;
        anyhow::ensure!(status.success(), "kill -TERM {pid} failed");
        Ok(())
    }
}

fn job(key: &str, max: u32, payload: &str) -> pb::JobRequest {
    concurrency_job("acme", key, max, 50, payload)
}

/// The largest number of attempts running at once among `job_ids`, from the
/// worker's own events: from its claim winning to its handler returning
/// (before it calls Complete, so before anything could take the slot).
fn peak_running(events: &[serde_json::Value], job_ids: &[String]) -> usize {
    let mut edges: Vec<(f64, i32)> = Vec::new();
    for event in events {
        let Some(job_id) = event["job_id"].as_str() else {
            continue;
        };
        if !job_ids.iter().any(|id| id == job_id) {
            continue;
        }
        let at = event["at"].as_f64().unwrap_or_default();
        match event["event"].as_str() {
            Some("claimed") => edges.push((at, 1)),
            Some("handler_done") => edges.push((at, -1)),
            _ => {}
        }
    }
    edges.sort_by(|left, right| left.0.total_cmp(&right.0).then(left.1.cmp(&right.1)));
    let mut running = 0;
    let mut peak = 0;
    for (_, delta) in edges {
        running += delta;
        peak = peak.max(running);
    }
    usize::try_from(peak).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_worker_runs_jobs_under_their_limit_heartbeats_a_long_job_and_reports_failures() -> anyhow::Result<()>
{
    let stack = Stack::start(
        test_config("pyworker", &[("task_groups.default.lease", "2s"), LOW_CONNECTIONS[0]])?,
        1,
    )
    .await?;
    let admission = stack.admission_client().await?;
    let limited: Vec<String> = (0..10).map(|index| format!("limited-{index}")).collect();
    for job_id in &limited {
        enqueue_with_id(&admission, job_id, job("py-key", 2, r#"{"work_ms": 300}"#)).await?;
    }
    // Runs 4.5 s against a 2 s lease: only heartbeats keep it.
    enqueue_with_id(&admission, "long", job("py-long", 1, r#"{"work_ms": 4500}"#)).await?;
    enqueue_with_id(
        &admission,
        "failing",
        job("py-fail", 1, r#"{"fail": "boom", "non_retryable": true}"#),
    )
    .await?;

    let started = Instant::now();
    let mut worker = PythonWorker::start(&stack, &["--concurrency", "4", "--exit-after", "12"])?;
    let mut peak_holders = 0;
    while worker.child.try_wait()?.is_none() {
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(90),
            "worker.py still running after 90s"
        );
        // The key's owner can be briefly away under load; skip that sample.
        if let Ok(state) = key_state(&stack, "acme", "py-key").await {
            peak_holders = peak_holders.max(state.holders.len());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let status = worker.wait_exit(Duration::from_secs(1)).await?;
    assert!(status.success(), "worker.py exited with {status}");
    let events = worker.events();

    for job_id in &limited {
        let view = job_view(&admission, job_id).await?;
        assert_eq!(
            view.status,
            pb::JobStatus::Succeeded as i32,
            "{job_id}: {}",
            view.reason
        );
        assert_eq!(view.attempt, 1, "{job_id} ran once");
    }
    let peak = peak_running(&events, &limited);
    let limited_events: Vec<&serde_json::Value> = events
        .iter()
        .filter(|event| limited.iter().any(|id| event["job_id"] == id.as_str()))
        .collect();
    assert_eq!(
        peak, 2,
        "the worker ran py-key jobs two at a time (limit 2, concurrency 4): {limited_events:#?}"
    );
    assert!(
        peak_holders <= 2,
        "py-key never had more than 2 holders: {peak_holders}"
    );

    let long = job_view(&admission, "long").await?;
    assert_eq!(long.status, pb::JobStatus::Succeeded as i32, "{}", long.reason);
    assert_eq!(long.attempt, 1);
    assert!(
        long.history.iter().all(|record| record.outcome != "lease_expired"),
        "heartbeats kept the lease: {:?}",
        long.history
    );
    let failing = job_view(&admission, "failing").await?;
    assert_eq!(failing.status, pb::JobStatus::Failed as i32, "{}", failing.reason);
    assert!(failing.last_error.contains("boom"), "{}", failing.last_error);

    let claims = events.iter().filter(|event| event["event"] == "claimed").count();
    assert_eq!(claims, 12, "each job claimed once: {events:?}");
    eventually(Duration::from_secs(20), "every ticket returned", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_worker_answers_refreshes_stops_a_cancelled_job_and_hands_back_on_sigterm() -> anyhow::Result<()> {
    let stack = Stack::start(
        test_config("pyworker2", &[("task_groups.default.lease", "2s"), LOW_CONNECTIONS[0]])?,
        1,
    )
    .await?;
    let admission = stack.admission_client().await?;
    let mut worker = PythonWorker::start(&stack, &["--concurrency", "8", "--refresh", "--grace-s", "0.5"])?;

    // Floating key, default max 1: the first waiter makes a refresh due; the
    // worker's handler answers the metadata's next_max.
    for index in 0..3 {
        let request = pb::JobRequest {
            tenant: "acme".to_string(),
            task_group: "default".to_string(),
            payload: br#"{"work_ms": 1500}"#.to_vec(),
            limits: vec![pb::Limit {
                kind: Some(pb::limit::Kind::Floating(pb::FloatingConcurrencyLimit {
                    key: "py-float".to_string(),
                    default_max: 1,
                    refresh_interval_ms: 200,
                    metadata: HashMap::from([("next_max".to_string(), "3".to_string())]),
                })),
            }],
            ..Default::default()
        };
        enqueue_with_id(&admission, &format!("floating-{index}"), request).await?;
    }
    let refresh = stack.refresh_client().await?;
    eventually(Duration::from_secs(30), "the refresh answer applied", || {
        let mut refresh = refresh.clone();
        async move {
            // NOT_FOUND until the first refresh is due.
            let described = refresh
                .describe_floating_limit(pb::DescribeFloatingLimitRequest {
                    key: Some(pb::KeyRef {
                        tenant: "acme".to_string(),
                        key: "py-float".to_string(),
                    }),
                })
                .await;
            Ok(described.is_ok_and(|described| described.into_inner().current_max == 3))
        }
    })
    .await?;
    // The worker prints its event once ReportRefresh has answered.
    eventually(
        Duration::from_secs(5),
        "the worker's refresh_reported event",
        || async {
            Ok(worker.events().iter().any(|event| {
                event["event"] == "refresh_reported"
                    && event["new_max"] == 3
                    && event["applied"] == true
                    && event["key"] == "acme/py-float"
            }))
        },
    )
    .await?;
    for index in 0..3 {
        wait_status(
            &admission,
            &format!("floating-{index}"),
            pb::JobStatus::Succeeded,
            Duration::from_secs(30),
        )
        .await?;
    }

    // Cancel a running job: the worker learns it by heartbeat, stops the
    // handler and confirms with Complete.
    enqueue_with_id(&admission, "cancel-me", job("py-cancel", 1, r#"{"work_ms": 60000}"#)).await?;
    wait_status(&admission, "cancel-me", pb::JobStatus::Running, Duration::from_secs(30)).await?;
    let mut cancel_client = admission.clone();
    cancel_client
        .cancel_job(pb::CancelJobRequest {
            job_id: "cancel-me".to_string(),
            reason: "test".to_string(),
        })
        .await?;
    let cancelled = wait_status(
        &admission,
        "cancel-me",
        pb::JobStatus::Cancelled,
        Duration::from_secs(10),
    )
    .await?;
    assert_eq!(
        cancelled.history.last().map(|record| record.outcome.as_str()),
        Some("cancelled")
    );
    // The worker prints its events once Complete has answered.
    eventually(
        Duration::from_secs(5),
        "cancel_requested, then completed as cancelled",
        || async {
            let events = worker.events_for("cancel-me");
            let requested = events.iter().any(|event| event["event"] == "cancel_requested");
            let confirmed = events
                .iter()
                .any(|event| event["event"] == "completed" && event["outcome"] == "cancelled");
            Ok(requested && confirmed)
        },
    )
    .await?;

    // SIGTERM: the running job is handed back (a new attempt, none used up)
    // and its ticket returns; the worker exits.
    enqueue_with_id(&admission, "hand-back", job("py-term", 1, r#"{"work_ms": 60000}"#)).await?;
    wait_status(&admission, "hand-back", pb::JobStatus::Running, Duration::from_secs(30)).await?;
    worker.signal_term().await?;
    let status = worker.wait_exit(Duration::from_secs(15)).await?;
    assert!(status.success(), "worker.py exited with {status}");
    let handed_back = job_view(&admission, "hand-back").await?;
    assert_eq!(handed_back.attempt, 2, "{}", handed_back.reason);
    assert!(
        handed_back
            .history
            .iter()
            .any(|record| record.outcome == "handed_back" && record.detail == "worker shutting down"),
        "{:?}",
        handed_back.history
    );
    // Attempt 2 acquires the key again: attempt 1's ticket was released.
    eventually(Duration::from_secs(20), "attempt 2 admitted", || async {
        let view = job_view(&admission, "hand-back").await?;
        Ok(view.status == pb::JobStatus::Admitted as i32)
    })
    .await?;
    let state = key_state(&stack, "acme", "py-term").await?;
    let holders: Vec<u32> = state
        .holders
        .iter()
        .filter_map(|holder| holder.ticket.as_ref().map(|ticket| ticket.attempt))
        .collect();
    assert_eq!(holders, vec![2], "only attempt 2 holds py-term");
    stack.stop().await;
    Ok(())
}

/// `examples/python/stream_worker.py`: jobs pushed on `Work` streams run
/// under their limit (two at a time on a key limited to 2 with four slots),
/// each once, heartbeats keep a job longer than its lease, a failure is
/// reported, and no ticket is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_stream_worker_runs_pushed_jobs_under_their_limit() -> anyhow::Result<()> {
    let stack = Stack::start(
        test_config("pystream", &[("task_groups.default.lease", "2s"), LOW_CONNECTIONS[0]])?,
        1,
    )
    .await?;
    let admission = stack.admission_client().await?;
    let limited: Vec<String> = (0..10).map(|index| format!("streamed-{index}")).collect();
    for job_id in &limited {
        enqueue_with_id(&admission, job_id, job("py-stream-key", 2, r#"{"work_ms": 200}"#)).await?;
    }
    // Runs 3.5 s against a 2 s lease: only heartbeats keep it.
    enqueue_with_id(
        &admission,
        "stream-long",
        job("py-stream-long", 1, r#"{"work_ms": 3500}"#),
    )
    .await?;
    enqueue_with_id(
        &admission,
        "stream-failing",
        job("py-stream-fail", 1, r#"{"fail": "boom", "non_retryable": true}"#),
    )
    .await?;
    let mut worker = PythonWorker::start_script(
        &stack,
        "stream_worker.py",
        &["--concurrency", "4", "--exit-after", "12"],
    )?;
    let status = worker.wait_exit(Duration::from_secs(90)).await?;
    assert!(status.success(), "stream_worker.py exited with {status}");
    let events = worker.events();
    for job_id in &limited {
        let view = job_view(&admission, job_id).await?;
        assert_eq!(
            view.status,
            pb::JobStatus::Succeeded as i32,
            "{job_id}: {}",
            view.reason
        );
        assert_eq!(view.attempt, 1, "{job_id} ran once");
    }
    assert_eq!(
        peak_running(&events, &limited),
        2,
        "two at a time under limit 2 with four slots: {events:#?}"
    );
    let long = job_view(&admission, "stream-long").await?;
    assert_eq!(long.status, pb::JobStatus::Succeeded as i32, "{}", long.reason);
    assert_eq!(long.attempt, 1, "the heartbeats kept the long job's lease");
    let failing = job_view(&admission, "stream-failing").await?;
    assert_eq!(failing.status, pb::JobStatus::Failed as i32);
    assert_eq!(failing.last_error, "boom");
    eventually(Duration::from_secs(30), "no ticket left", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    stack.stop().await;
    Ok(())
}
