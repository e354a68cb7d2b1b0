//! How commands print: aligned tables for people, one JSON document for
//! scripts (`--output json`), and errors that name the service, the gRPC
//! status code and its message.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    /// Aligned tables and key-value lists.
    Table,
    /// One JSON document on stdout; field names are stable.
    Json,
}

/// A command's result, printable either way.
pub trait Render: Serialize {
    fn table(&self) -> String;
}

/// `Render` behind a box (each command has its own output type).
pub trait Printable {
    fn json(&self) -> serde_json::Result<String>;
    fn table(&self) -> String;
}

impl<T: Render> Printable for T {
    fn json(&self) -> serde_json::Result<String> {
        serde_json::to_string_pretty(self)
    }

    fn table(&self) -> String {
        Render::table(self)
    }
}

pub fn print(format: OutputFormat, value: &dyn Printable) -> anyhow::Result<()> {
    match format {
        OutputFormat::Json => println!("{}", value.json()?),
        OutputFormat::Table => print!("{}", value.table()),
    }
    Ok(())
}

/// A failed gRPC call: which service, where, and what it answered.
#[derive(Debug)]
pub struct RpcError {
    pub service: &'static str,
    pub endpoint: String,
    pub code: tonic::Code,
    pub message: String,
}

impl RpcError {
    pub fn new(service: &'static str, endpoint: &str, status: tonic::Status) -> Self {
        RpcError {
            service,
            endpoint: endpoint.to_string(),
            code: status.code(),
            message: status.message().to_string(),
        }
    }

    /// The canonical name, e.g. `NOT_FOUND`.
    pub fn code_name(&self) -> &'static str {
        code_name(self.code)
    }
}

impl std::fmt::Display for RpcError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            formatter,
            "{} at {} answered {}: {}",
            self.service,
            self.endpoint,
            self.code_name(),
            self.message
        )
    }
}

impl std::error::Error for RpcError {}

pub fn code_name(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Ok => "OK",
        tonic::Code::Cancelled => "CANCELLED",
        tonic::Code::Unknown => "UNKNOWN",
        tonic::Code::InvalidArgument => "INVALID_ARGUMENT",
        tonic::Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        tonic::Code::NotFound => "NOT_FOUND",
        tonic::Code::AlreadyExists => "ALREADY_EXISTS",
        tonic::Code::PermissionDenied => "PERMISSION_DENIED",
        tonic::Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        tonic::Code::FailedPrecondition => "FAILED_PRECONDITION",
        tonic::Code::Aborted => "ABORTED",
        tonic::Code::OutOfRange => "OUT_OF_RANGE",
        tonic::Code::Unimplemented => "UNIMPLEMENTED",
        tonic::Code::Internal => "INTERNAL",
        tonic::Code::Unavailable => "UNAVAILABLE",
        tonic::Code::DataLoss => "DATA_LOSS",
        tonic::Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Print a command's failure on stderr: a line for people, or with
/// `--output json` a JSON object `{"error": {...}}`.
pub fn print_error(format: OutputFormat, error: &anyhow::Error) {
    let rpc = error.downcast_ref::<RpcError>();
    match format {
        OutputFormat::Json => {
            let mut body = serde_json::json!({ "message": format!("{error:#}") });
            if let Some(rpc) = rpc {
                body["code"] = rpc.code_name().into();
                body["service"] = rpc.service.into();
                body["endpoint"] = rpc.endpoint.clone().into();
                body["message"] = rpc.message.clone().into();
            }
            eprintln!("{}", serde_json::json!({ "error": body }));
        }
        OutputFormat::Table => {
            eprintln!("error: {error:#}");
            if rpc.is_some_and(|rpc| rpc.code == tonic::Code::Unavailable) {
                eprintln!("hint: is the stack running (`make run`), and is the endpoint right (--help lists the flags and their environment variables)?");
            }
        }
    }
}

/// A table with a header row; columns padded to their widest cell.
pub struct Table {
    headers: Vec<&'static str>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(headers: &[&'static str]) -> Self {
        Table {
            headers: headers.to_vec(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        debug_assert_eq!(cells.len(), self.headers.len());
        self.rows.push(cells);
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// Rendered with `indent` spaces before every line.
    pub fn render(&self, indent: usize) -> String {
        let mut widths: Vec<usize> = self.headers.iter().map(|header| header.chars().count()).collect();
        for row in &self.rows {
            for (width, cell) in widths.iter_mut().zip(row) {
                *width = (*width).max(cell.chars().count());
            }
        }
        let mut out = String::new();
        let header_cells: Vec<String> = self.headers.iter().map(|header| header.to_string()).collect();
        for cells in std::iter::once(&header_cells).chain(self.rows.iter()) {
            let mut line = " ".repeat(indent);
            for (index, (cell, width)) in cells.iter().zip(&widths).enumerate() {
                if index + 1 == cells.len() {
                    line.push_str(cell);
                } else {
                    let _ = write!(line, "{cell:<width$}  ");
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// `label  value` lines with the values aligned.
pub fn fields(pairs: &[(&str, String)]) -> String {
    let width = pairs.iter().map(|(label, _)| label.chars().count()).max().unwrap_or(0);
    let mut out = String::new();
    for (label, value) in pairs {
        let _ = writeln!(out, "{label:<width$}  {value}");
    }
    out
}

/// `JOB_STATUS_WAITING` -> `waiting` for a proto enum name with its prefix.
pub fn enum_word(name: &str, prefix: &str) -> String {
    name.strip_prefix(prefix).unwrap_or(name).to_ascii_lowercase()
}

/// Unix ms as an RFC 3339 time with how long ago (or how far ahead) it is.
pub fn time_ms(unix_ms: i64) -> String {
    if unix_ms <= 0 {
        return "-".to_string();
    }
    let at = UNIX_EPOCH + Duration::from_millis(u64::try_from(unix_ms).unwrap_or_default());
    let stamp = humantime::format_rfc3339_millis(at);
    let relative = match SystemTime::now().duration_since(at) {
        Ok(ago) => format!("{} ago", short_duration(ago)),
        Err(ahead) => format!("in {}", short_duration(ahead.duration())),
    };
    format!("{stamp} ({relative})")
}

pub fn optional_time_ms(unix_ms: Option<i64>) -> String {
    unix_ms.map_or_else(|| "-".to_string(), time_ms)
}

/// 1.2s, 3m4s, 2h5m: two units at most.
pub fn short_duration(duration: Duration) -> String {
    let millis = duration.as_millis();
    if millis < 1_000 {
        return format!("{millis}ms");
    }
    let seconds = duration.as_secs();
    if seconds < 60 {
        return format!("{:.1}s", duration.as_secs_f64());
    }
    if seconds < 3_600 {
        return format!("{}m{}s", seconds / 60, seconds % 60);
    }
    if seconds < 86_400 {
        return format!("{}h{}m", seconds / 3_600, (seconds % 3_600) / 60);
    }
    format!("{}d{}h", seconds / 86_400, (seconds % 86_400) / 3_600)
}

pub fn or_dash<T: ToString>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_string(), |value| value.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align_columns_and_drop_trailing_spaces() {
        let mut table = Table::new(&["KEY", "HOLDERS", "NOTE"]);
        table.row(vec!["a".to_string(), "10".to_string(), String::new()]);
        table.row(vec!["longer-key".to_string(), "2".to_string(), "x".to_string()]);
        assert_eq!(
            table.render(2),
            "  KEY         HOLDERS  NOTE\n  a           10\n  longer-key  2        x\n"
        );
    }

    #[test]
    fn words_and_durations_read_well() {
        assert_eq!(enum_word("JOB_STATUS_WAITING", "JOB_STATUS_"), "waiting");
        assert_eq!(short_duration(Duration::from_millis(250)), "250ms");
        assert_eq!(short_duration(Duration::from_millis(1_250)), "1.2s");
        assert_eq!(short_duration(Duration::from_secs(125)), "2m5s");
        assert_eq!(short_duration(Duration::from_secs(7_500)), "2h5m");
        assert_eq!(code_name(tonic::Code::NotFound), "NOT_FOUND");
    }
}
