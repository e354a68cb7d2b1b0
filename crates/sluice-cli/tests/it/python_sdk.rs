//! The Python SDK (`sdks/python`, package `sluice-client`) against real
//! stacks: its pytest suites run with the stack's endpoints in the
//! environment (`sdks/python/tests/conftest.py`), each scenario against a
//! stack configured for it; the type check and the wheel build need none.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use anyhow::Context;
use sluice_e2e::pki::{folder, new_pki_for, write_pki};
use sluice_e2e::tokens::{auth_settings, TokenIssuer};
use sluice_e2e::*;

use crate::support::{python_tools, repo_root, LOW_CONNECTIONS};

fn sdk_dir() -> PathBuf {
    repo_root().join("sdks/python")
}

/// pytest on `tests` (paths under `sdks/python/tests`) with `stack`'s
/// endpoints and `env`.
fn pytest_command(
    stack: Option<&Stack>,
    tests: &[&str],
    env: &[(&str, String)],
) -> anyhow::Result<tokio::process::Command> {
    let tools = python_tools()?;
    let mut command = tokio::process::Command::new(&tools.python);
    command
        .current_dir(sdk_dir())
        .args(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"])
        .args(tests)
        // e.g. `-k limit_of_two -x`, to run part of a suite by hand.
        .args(
            std::env::var("SLUICE_PYTEST_ARGS")
                .unwrap_or_default()
                .split_whitespace(),
        )
        .env("PYTHONPATH", sdk_dir().join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env_remove("SLUICE_ADMISSION_ENDPOINT")
        .env_remove("SLUICE_TOKEN")
        .env_remove("SLUICE_TOKEN_FILE")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    if let Some(stack) = stack {
        command
            .env("SLUICE_ADMISSION_ENDPOINT", &stack.admissions[0].endpoint)
            .env(
                "SLUICE_REFRESH_DISPATCHER_ENDPOINT",
                &stack.refresh_dispatchers[0].endpoint,
            )
            .env("SLUICE_BROKERS", &stack.config.kafka.brokers)
            .env("SLUICE_TOPIC_PREFIX", &stack.config.kafka.topic_prefix);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    Ok(command)
}

/// Run pytest on `tests` (see `pytest_command`); fail with its output
/// unless every test passed (none skipped).
async fn pytest(stack: Option<&Stack>, tests: &[&str], env: &[(&str, String)]) -> anyhow::Result<String> {
    let mut command = pytest_command(stack, tests, env)?;
    finish(command.spawn().context("starting pytest")?, tests).await
}

async fn finish(child: tokio::process::Child, tests: &[&str]) -> anyhow::Result<String> {
    let output = tokio::time::timeout(Duration::from_secs(300), child.wait_with_output())
        .await
        .context("pytest ran over 5 minutes")?
        .context("waiting for pytest")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    anyhow::ensure!(
        output.status.success(),
        "pytest {} failed ({}):\n{text}",
        tests.join(" "),
        output.status
    );
    anyhow::ensure!(
        !text.contains(" skipped"),
        "pytest {} skipped tests:\n{text}",
        tests.join(" ")
    );
    eprintln!("{text}");
    Ok(text)
}

/// Producers (gRPC, asyncio, Kafka protobuf and JSON), the sync and asyncio
/// workers under a limit of 2 and their own concurrency, every outcome, a
/// hand-back on stop, and a floating max moved by a refresh handler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_produces_runs_jobs_within_their_limits_and_refreshes() -> anyhow::Result<()> {
    let stack = Stack::start(
        test_config("pysdk", &[("task_groups.default.lease", "2s"), LOW_CONNECTIONS[0]])?,
        1,
    )
    .await?;
    pytest(
        Some(&stack),
        &[
            "tests/test_producer.py",
            "tests/test_worker.py",
            "tests/test_refresh.py",
        ],
        &[],
    )
    .await?;
    eventually(Duration::from_secs(30), "no ticket left", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    stack.stop().await;
    Ok(())
}

/// A worker process killed mid-job (SIGKILL): its jobs come back and another
/// worker runs them (the stream's end grace, 1 s, shortens their leases).
/// Before that, credits move: a worker whose credits all sit on the only
/// instance's stream gives some back (withdraw) when a second instance joins
/// and owns jobs (the test adds it when pytest says so).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_moves_credits_between_instances_and_a_killed_workers_jobs_come_back() -> anyhow::Result<()> {
    let mut stack = Stack::start(
        test_config(
            "pysdkkill",
            &[
                ("task_groups.default.lease", "3s"),
                ("admission.stream_end_grace", "1s"),
                LOW_CONNECTIONS[0],
            ],
        )?,
        1,
    )
    .await?;
    let signals = folder("pysdk-signals")?;
    let tests = ["tests/test_instances.py", "tests/test_kill.py"];
    let mut command = pytest_command(
        Some(&stack),
        &tests,
        &[("SLUICE_TEST_SIGNAL_DIR", signals.to_string_lossy().into_owned())],
    )?;
    let mut child = command.spawn().context("starting pytest")?;
    // A second admission instance once the worker's credits all sit on the
    // first one's stream.
    let ready = signals.join("one-stream");
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !ready.exists() {
        if let Some(status) = child.try_wait()? {
            let output = finish(child, &tests).await;
            anyhow::bail!("pytest ended ({status}) before asking for a second instance: {output:?}");
        }
        anyhow::ensure!(
            std::time::Instant::now() < deadline,
            "pytest never asked for a second instance"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stack.add_admission(sluice_common::Faults::none()).await?;
    std::fs::write(signals.join("instance-added"), b"")?;
    finish(child, &tests).await?;
    eventually(Duration::from_secs(30), "no ticket left", || async {
        Ok(stack.tickets_left().await? == 0)
    })
    .await?;
    stack.stop().await;
    std::fs::remove_dir_all(signals)?;
    Ok(())
}

/// Bearer tokens and TLS: a stack with authentication on, serving only TLS
/// with a certificate for `sluice.internal`; a token for tenant a cannot
/// enqueue for tenant b, b cannot see a's job, and b's worker is never
/// pushed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_authenticates_with_tokens_over_tls() -> anyhow::Result<()> {
    let folder = folder("pysdk-auth")?;
    let issuer = TokenIssuer::new()?;
    let pki = new_pki_for("pysdk", &["sluice.internal"])?;
    let (cert, key, ca) = write_pki(&folder, &pki)?;
    let mut settings: Vec<(&str, String)> = auth_settings(&folder, &issuer)?;
    settings.extend([
        ("tls.cert_file", cert),
        ("tls.key_file", key),
        ("tls.ca_file", ca.clone()),
        ("tls.server_name", "sluice.internal".to_string()),
    ]);
    let mut overrides: Vec<(&str, &str)> = settings.iter().map(|(name, value)| (*name, value.as_str())).collect();
    overrides.push(LOW_CONNECTIONS[0]);
    let stack = Stack::start(test_config("pysdkauth", &overrides)?, 1).await?;
    let roles = ["producer", "reader", "worker"];
    pytest(
        Some(&stack),
        &["tests/test_auth.py"],
        &[
            ("TOKEN_A", issuer.token("tenant-a", &["a"], &roles)?),
            ("TOKEN_B", issuer.token("tenant-b", &["b"], &roles)?),
            ("SLUICE_TLS_CA_FILE", ca),
            ("SLUICE_TLS_SERVER_NAME", "sluice.internal".to_string()),
        ],
    )
    .await?;
    stack.stop().await;
    std::fs::remove_dir_all(folder)?;
    Ok(())
}

/// No stack: the package type-checks (mypy --strict on its sources, with
/// the generated stubs' .pyi), its unit tests pass, and a wheel built from
/// `sdks/python` carries the generated modules and works installed, away
/// from the source tree.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_sdk_type_checks_and_builds_a_wheel_with_its_stubs() -> anyhow::Result<()> {
    pytest(None, &["tests/test_units.py"], &[]).await?;
    let tools = python_tools()?;
    let run = |args: &[&str], cwd: &std::path::Path, pythonpath: Option<&std::path::Path>| {
        let mut command = std::process::Command::new(&tools.python);
        command.args(args).current_dir(cwd).env("PYTHONDONTWRITEBYTECODE", "1");
        match pythonpath {
            Some(path) => command.env("PYTHONPATH", path),
            None => command.env_remove("PYTHONPATH"),
        };
        command
    };
    let mypy = crate::support::run(run(&["-m", "mypy"], &sdk_dir(), Some(&sdk_dir().join("src")))).await?;
    anyhow::ensure!(mypy.status.success(), "mypy --strict: {mypy}");

    let scratch = folder("pysdk-wheel")?;
    let wheels = scratch.join("wheels");
    let wheel_dir = wheels.to_string_lossy().into_owned();
    let built = crate::support::run(run(
        &[
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--wheel-dir",
            &wheel_dir,
            ".",
        ],
        &sdk_dir(),
        None,
    ))
    .await?;
    anyhow::ensure!(built.status.success(), "pip wheel: {built}");
    let wheel = std::fs::read_dir(&wheels)?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| path.extension().is_some_and(|ext| ext == "whl"))
        .context("no wheel built")?;
    let installed = scratch.join("site");
    let target = installed.to_string_lossy().into_owned();
    let install = crate::support::run(run(
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            &target,
            &wheel.to_string_lossy(),
        ],
        &scratch,
        None,
    ))
    .await?;
    anyhow::ensure!(install.status.success(), "pip install: {install}");
    for file in [
        "py.typed",
        "_proto/sluice/v1/admission_pb2.py",
        "_proto/sluice/v1/admission_pb2.pyi",
    ] {
        anyhow::ensure!(
            installed.join("sluice_client").join(file).is_file(),
            "the wheel lacks sluice_client/{file}"
        );
    }
    let check = "import sluice_client, sluice_client.proto as p; \
                 r = sluice_client.job_request('acme', limits=[sluice_client.concurrency('k', 2)]); \
                 assert p.admission_pb2.EnqueueRequest(job=r).job.limits[0].concurrency.max_concurrency == 2; \
                 print(sluice_client.__file__)";
    let imported = crate::support::run(run(&["-c", check], &scratch, Some(&installed))).await?;
    anyhow::ensure!(imported.status.success(), "importing the installed wheel: {imported}");
    anyhow::ensure!(
        imported.stdout.trim().starts_with(&target),
        "imported from {} instead of the installed wheel",
        imported.stdout
    );
    std::fs::remove_dir_all(scratch)?;
    Ok(())
}

/// The README's Python SDK worker, run as written: it runs a job enqueued
/// for it and drains on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_python_worker_runs_a_job() -> anyhow::Result<()> {
    let stack = Stack::start(test_config("pyreadme", &[LOW_CONNECTIONS[0]])?, 1).await?;
    let script = crate::readme_examples::documented_example("README.md", "python-sdk-worker")?;
    let scratch = std::env::temp_dir().join(format!("sluice-readme-worker-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let path = scratch.join("worker.py");
    std::fs::write(&path, script)?;
    let tools = python_tools()?;
    let worker = tokio::process::Command::new(&tools.python)
        .arg(&path)
        .env("PYTHONPATH", sdk_dir().join("src"))
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .env("SLUICE_ADMISSION_ENDPOINT", &stack.admissions[0].endpoint)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the README's worker")?;
    let admission = stack.admission_client().await?;
    let mut request = concurrency_job("acme", "readme", 1, 0, "hello from the README");
    request.job_id = Some("readme-python-1".to_string());
    enqueue_with_id(&admission, "readme-python-1", request).await?;
    wait_status(
        &admission,
        "readme-python-1",
        sluice_proto::v1::JobStatus::Succeeded,
        Duration::from_secs(60),
    )
    .await?;
    let pid = worker.id().context("the worker's pid")?;
    std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .context("sending SIGTERM")?;
    let output = tokio::time::timeout(Duration::from_secs(60), worker.wait_with_output())
        .await
        .context("the worker did not stop within a minute of SIGTERM")??;
    let stdout = String::from_utf8_lossy(&output.stdout);
    anyhow::ensure!(
        stdout.contains("running readme-python-1 hello from the README"),
        "the handler did not print the job: {stdout}"
    );
    std::fs::remove_dir_all(scratch)?;
    stack.stop().await;
    Ok(())
}
