//! The documented JSON producer examples, run exactly as written against a
//! stack: the kcat block from docs/producing-jobs.md and the Python block
//! of the README's tour (the fenced block after each `<!-- example: NAME`
//! marker), so the documented commands are the ones tested.

use std::sync::Arc;
use std::time::Duration;

use sluice_common::Shutdown;
use sluice_e2e::*;
use sluice_proto::v1 as pb;

use crate::support::{python_tools, repo_root, run, LOW_CONNECTIONS};

/// The body of the fenced code block that follows `<!-- example: NAME` in
/// `file` (relative to the repository).
pub fn documented_example(file: &str, name: &str) -> anyhow::Result<String> {
    let text = std::fs::read_to_string(repo_root().join(file))?;
    let marker = format!("<!-- example: {name} ");
    let after_marker = text
        .split_once(&marker)
        .map(|(_, rest)| rest)
        .ok_or_else(|| anyhow::anyhow!("{file} has no {marker:?} marker"))?;
    let mut lines = after_marker.lines().skip(1);
    let fence = lines.next().unwrap_or_default();
    anyhow::ensure!(
        fence.starts_with("```"),
        "the {name} marker is not followed by a code block"
    );
    let body: Vec<&str> = lines.take_while(|line| *line != "```").collect();
    Ok(body.join("\n") + "\n")
}

/// A worker for the examples' jobs, recording what ran.
fn start_worker(stack: &Stack, stop: &Shutdown) -> Arc<Recorder> {
    let recorder = Arc::new(Recorder::default());
    tokio::spawn(run_worker(
        stack.config.clone(),
        stack.admissions[0].endpoint.clone(),
        WorkerOptions {
            worker_id: "readme-worker".to_string(),
            task_group: "default".to_string(),
            group: format!("{}workers", stack.config.kafka.topic_prefix),
            concurrency: 4,
            min_run: Duration::from_millis(10),
            max_run: Duration::from_millis(20),
        },
        recorder.clone(),
        stop.clone(),
    ));
    recorder
}

/// Wait until the job exists (the request is on its way through Kafka) and
/// has succeeded.
async fn wait_succeeded(stack: &Stack, job_id: &str) -> anyhow::Result<pb::JobView> {
    let admission = stack.admission_client().await?;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let view = job_view(&admission, job_id).await.ok();
        if let Some(view) = view.filter(|view| view.status == pb::JobStatus::Succeeded as i32) {
            return Ok(view);
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "{job_id} not succeeded within 30s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The payload the worker ran the job with (it records a run once its
/// Complete has been answered, so shortly after the job shows SUCCEEDED).
async fn payload_of(recorder: &Recorder, job_id: &str) -> anyhow::Result<String> {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(run) = recorder.runs().into_iter().find(|run| run.job_id == job_id) {
            return Ok(run.payload);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "no recorded run of {job_id}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_kcat_example_produces_a_job_that_runs_and_a_typo_that_is_dead_lettered() -> anyhow::Result<()> {
    let tools = python_tools()?;
    let block = documented_example("docs/producing-jobs.md", "json-kcat")?;
    let stack = Stack::start(test_config("readmekcat", LOW_CONNECTIONS)?, 1).await?;
    let stop = Shutdown::new();
    let recorder = start_worker(&stack, &stop);

    let mut command = std::process::Command::new("bash");
    command
        .args(["-euo", "pipefail", "-c", &block])
        .env("PATH", tools.path_env())
        .env("SLUICE_BROKERS", &stack.config.kafka.brokers)
        .env("SLUICE_TOPIC_PREFIX", &stack.config.kafka.topic_prefix);
    let ran = tokio::time::timeout(Duration::from_secs(60), run(command)).await??;
    assert!(
        ran.status.success(),
        "the kcat example of docs/producing-jobs.md failed: {ran}"
    );
    assert!(
        ran.stdout.contains(
            "sluice-deadletter-reason=limits[0].concurrency.max_concurency: unknown field (expected one of: key, max_concurrency, shadow)"
        ),
        "kcat shows the dead letter's reason: {ran}"
    );

    let admission = stack.admission_client().await?;
    let view = wait_succeeded(&stack, "report-42").await?;
    let keys: Vec<&str> = view.acquisition_order.iter().map(|step| step.key.as_str()).collect();
    assert_eq!(keys, vec!["warehouse", "inline:exports:"]);
    assert_eq!(payload_of(&recorder, "report-42").await?, r#"{"report": 42}"#);
    let missing = admission
        .clone()
        .get_job(pb::GetJobRequest {
            job_id: "report-43".to_string(),
        })
        .await;
    assert_eq!(
        missing.map(|_| ()).map_err(|status| status.code()),
        Err(tonic::Code::NotFound),
        "the typo never became a job"
    );

    // The published schema agrees: the first line is valid, the typo is not.
    let lines: Vec<&str> = block.lines().filter(|line| line.starts_with('{')).collect();
    assert_eq!(lines.len(), 2, "{block}");
    let check = r#"
import json, sys
import jsonschema
schema = json.load(open(sys.argv[1]))
for line in sys.argv[2:]:
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(json.loads(line)))
    print("valid" if not errors else "invalid: " + errors[0].message)
"#;
    let mut validate = std::process::Command::new(&tools.python);
    validate
        .args(["-c", check])
        .arg(repo_root().join("docs/job-request.schema.json"))
        .args(&lines);
    let validated = run(validate).await?;
    assert!(validated.status.success(), "{validated}");
    let verdicts: Vec<&str> = validated.stdout.lines().collect();
    assert_eq!(verdicts[0], "valid", "{validated}");
    assert!(
        verdicts[1].starts_with("invalid: Additional properties are not allowed ('max_concurency' was unexpected)"),
        "{validated}"
    );
    stop.trigger();
    stack.stop().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_python_example_produces_a_job_that_runs() -> anyhow::Result<()> {
    let tools = python_tools()?;
    let block = documented_example("README.md", "json-python")?;
    let stack = Stack::start(test_config("readmepython", LOW_CONNECTIONS)?, 1).await?;
    let stop = Shutdown::new();
    let recorder = start_worker(&stack, &stop);

    let script = std::env::temp_dir().join(format!("{}readme_example.py", stack.config.kafka.topic_prefix));
    std::fs::write(&script, &block)?;
    let mut command = std::process::Command::new(&tools.python);
    command
        .arg(&script)
        .env("SLUICE_BROKERS", &stack.config.kafka.brokers)
        .env("SLUICE_TOPIC_PREFIX", &stack.config.kafka.topic_prefix);
    let ran = tokio::time::timeout(Duration::from_secs(60), run(command)).await??;
    let _ = std::fs::remove_file(&script);
    assert!(ran.status.success(), "the README's Python producer failed: {ran}");

    let view = wait_succeeded(&stack, "invoice-7").await?;
    assert_eq!(view.priority, 10);
    assert_eq!(view.max_attempts, 3);
    assert!(
        view.reason.contains("names no stored resource: not throttled"),
        "the stripe key has no stored resource here, so it does not throttle: {}",
        view.reason
    );
    assert_eq!(payload_of(&recorder, "invoice-7").await?, r#"{"invoice": 7}"#);
    stop.trigger();
    stack.stop().await;
    Ok(())
}
