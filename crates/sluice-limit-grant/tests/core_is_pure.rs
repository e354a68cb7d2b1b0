//! limit-grant's core decides without I/O, clock, channel, tracer, metrics
//! or fault hook (issue 31): none of them is named in `src/core/`.

use std::path::Path;

const FORBIDDEN: &[&str] = &[
    "tokio",
    "sqlx",
    "rdkafka",
    "opentelemetry",
    "Instant::now",
    "SystemTime::now",
    "wall_clock",
    "clock::",
    "sluice_common::metrics",
    "record_span",
    "telemetry",
    "oneshot",
    "mpsc",
    "Faults",
    "FaultPoint",
];

fn sources(dir: &Path, found: &mut Vec<std::path::PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            sources(&path, found)?;
        } else if path.extension().is_some_and(|extension| extension == "rs") {
            found.push(path);
        }
    }
    Ok(())
}

#[test]
fn the_core_names_no_io_clock_channel_tracer_or_fault_hook() -> std::io::Result<()> {
    let core = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = Vec::new();
    sources(&core, &mut files)?;
    assert!(files.len() > 10, "the core's sources: {files:?}");
    let mut offences = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file)?;
        for (number, line) in text.lines().enumerate() {
            for token in FORBIDDEN.iter().filter(|token| line.contains(*token)) {
                offences.push(format!("{}:{}: {token}", file.display(), number + 1));
            }
        }
    }
    assert!(offences.is_empty(), "{offences:#?}");
    Ok(())
}
