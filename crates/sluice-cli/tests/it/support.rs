//! What the tests of this crate share: the repository, the Python tools, and
//! running the `sluice` binary against a stack.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

use anyhow::Context;

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The Python venv and kcat that `scripts/install-python-tools.sh` manages
/// (installed here when missing, so this crate's tests work on their own).
pub struct PythonTools {
    pub python: PathBuf,
    /// Holds the `kcat` wrapper; put it first on PATH.
    pub _bin_dir: PathBuf,
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
        _bin_dir: tools_dir.join("bin"),
    };
    Ok(TOOLS.get_or_init(|| tools))
}

impl PythonTools {
    /// Generate the worker example's gRPC stubs (only when stale).
    pub fn generate_stubs(&self) -> anyhow::Result<()> {
        let status = Command::new(&self.python)
            .arg(repo_root().join("examples/python/generate_stubs.py"))
            .status()?;
        anyhow::ensure!(status.success(), "generate_stubs.py failed ({status})");
        Ok(())
    }
}
