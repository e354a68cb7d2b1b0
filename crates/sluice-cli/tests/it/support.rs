//! What the tests of this crate share: the repository, the Python tools, and
//! running the `sluice` binary against a stack.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

use anyhow::Context;
use sluice_e2e::Stack;

/// PostgreSQL is shared by every test (and engineer) on the machine; these
/// tests need few connections.
pub const LOW_CONNECTIONS: &[(&str, &str)] = &[("postgres.max_connections", "4")];

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python venv and kcat that `scripts/install-python-tools.sh` manages
/// (installed here when missing, so this crate's tests work on their own).
pub struct PythonTools {
    pub python: PathBuf,
    /// Holds the `kcat` wrapper; put it first on PATH.
    pub bin_dir: PathBuf,
}

pub fn python_tools() -> anyhow::Result<&'static PythonTools> {
    static TOOLS: OnceLock<PythonTools> = OnceLock::new();
    if let Some(tools) = TOOLS.get() {
        return Ok(tools);
    }
    let output = Command::new("bash")
        .arg(repo_root().join("scripts/install-python-tools.sh"))
        .stderr(Stdio::inherit())
        .output()
        .context("running scripts/install-python-tools.sh")?;
    anyhow::ensure!(
        output.status.success(),
        "scripts/install-python-tools.sh failed ({})",
        output.status
    );
    let stdout = String::from_utf8(output.stdout)?;
    let python = PathBuf::from(
        stdout
            .lines()
            .last()
            .context("install-python-tools printed no python")?,
    );
    // <tools>/python/bin/python -> <tools>/bin
    let tools_dir = python
        .ancestors()
        .nth(3)
        .context("unexpected venv layout")?
        .to_path_buf();
    let tools = PythonTools {
        python,
        bin_dir: tools_dir.join("bin"),
    };
    Ok(TOOLS.get_or_init(|| tools))
}

impl PythonTools {
    /// PATH with the tools first (the kcat wrapper).
    pub fn path_env(&self) -> String {
        let path = std::env::var("PATH").unwrap_or_default();
        format!("{}:{path}", self.bin_dir.display())
    }

    /// Generate the worker example's gRPC stubs (only when stale).
    pub fn generate_stubs(&self) -> anyhow::Result<()> {
        let status = Command::new(&self.python)
            .arg(repo_root().join("examples/python/generate_stubs.py"))
            .status()?;
        anyhow::ensure!(status.success(), "generate_stubs.py failed ({status})");
        Ok(())
    }
}

/// The `sluice` binary, pointed at `stack` through the environment: its four
/// endpoints, and its configuration (topic and schema prefixes, brokers)
/// through `SLUICE__...` variables.
pub fn sluice(stack: &Stack) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_sluice"));
    command
        .env("SLUICE_ADMISSION_ENDPOINT", &stack.admissions[0].endpoint)
        .env("SLUICE_LIMIT_GRANT_ENDPOINT", &stack.limit_grants[0].endpoint)
        .env("SLUICE_RATE_WINDOW_ENDPOINT", &stack.rate_windows[0].endpoint)
        .env(
            "SLUICE_REFRESH_DISPATCHER_ENDPOINT",
            &stack.refresh_dispatchers[0].endpoint,
        )
        .env("SLUICE__KAFKA__TOPIC_PREFIX", &stack.config.kafka.topic_prefix)
        .env("SLUICE__POSTGRES__SCHEMA_PREFIX", &stack.config.postgres.schema_prefix)
        .env("SLUICE__KAFKA__BROKERS", &stack.config.kafka.brokers)
        .env("SLUICE__POSTGRES__MAX_CONNECTIONS", "2")
        .env(
            "SLUICE__KAFKA__FETCH_WAIT_MAX_MS",
            stack.config.kafka.fetch_wait_max_ms.to_string(),
        )
        .env("RUST_LOG", "warn")
        .env_remove("SLUICE_CONFIG")
        .env_remove("SLUICE_TENANT")
        .env_remove("SLUICE_OUTPUT");
    let counts = &stack.config.kafka.partitions;
    for (name, count) in [
        ("REQUESTED", counts.requested),
        ("ADMITTED", counts.admitted),
        ("LIMIT_COMMANDS", counts.limit_commands),
        ("RATE_COMMANDS", counts.rate_commands),
        ("JOBS", counts.jobs),
        ("REFRESH_DUE", counts.refresh_due),
        ("REFRESH_TASKS", counts.refresh_tasks),
        ("DEADLETTER", counts.deadletter),
    ] {
        command.env(format!("SLUICE__KAFKA__PARTITIONS__{name}"), count.to_string());
    }
    command
}

/// A finished command's output as text.
pub struct Ran {
    pub status: std::process::ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Ran {
    /// The value of a `label  value` line of a key-value listing.
    pub fn field(&self, label: &str) -> Option<String> {
        self.stdout.lines().find_map(|line| {
            let rest = line.strip_prefix(label)?;
            rest.starts_with("  ").then(|| rest.trim().to_string())
        })
    }

    pub fn json(&self) -> anyhow::Result<serde_json::Value> {
        serde_json::from_str(&self.stdout)
            .with_context(|| format!("stdout is not JSON:\n{}\nstderr:\n{}", self.stdout, self.stderr))
    }
}

impl std::fmt::Display for Ran {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "exit {}\n--- stdout\n{}--- stderr\n{}",
            self.status, self.stdout, self.stderr
        )
    }
}

/// Run `command` to the end (off the async runtime) and keep its output.
pub async fn run(mut command: Command) -> anyhow::Result<Ran> {
    let output: Output = tokio::task::spawn_blocking(move || command.output()).await??;
    Ok(Ran {
        status: output.status,
        stdout: String::from_utf8_lossy(&output.stdout).to_string(),
        stderr: String::from_utf8_lossy(&output.stderr).to_string(),
    })
}

/// Run `sluice ARGS...` against `stack`; fail unless it exits 0.
pub async fn sluice_ok(stack: &Stack, args: &[&str]) -> anyhow::Result<Ran> {
    let mut command = sluice(stack);
    command.args(args);
    let ran = run(command).await?;
    anyhow::ensure!(ran.status.success(), "sluice {}: {ran}", args.join(" "));
    Ok(ran)
}

/// Run `sluice ARGS...` against `stack`; fail unless it exits non-zero.
pub async fn sluice_fails(stack: &Stack, args: &[&str]) -> anyhow::Result<Ran> {
    let mut command = sluice(stack);
    command.args(args);
    let ran = run(command).await?;
    anyhow::ensure!(!ran.status.success(), "sluice {} should fail: {ran}", args.join(" "));
    Ok(ran)
}
