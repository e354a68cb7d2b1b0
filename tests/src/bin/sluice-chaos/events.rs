//! A worker's history: one text line per event, appended by each worker
//! process to a file of its own with one `write` per line (a SIGKILL leaves
//! whole lines), and read by the runner. Times are wall-clock milliseconds:
//! the runner and its worker processes share the machine's clock.
//!
//! `<at_ms> <kind> <job> <attempt> [fields]`, the job as its index.

use std::io::Write;
use std::sync::Mutex;

pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| i64::try_from(since.as_millis()).unwrap_or(i64::MAX))
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The worker is ready for jobs (a stream open to every instance; a
    /// partition assigned): logged once, with job and attempt 0.
    Ready,
    /// This worker won the attempt: pushed on a `Work` stream (`push`), a
    /// claim answered CLAIMED (`claim`), or a claim whose answer was lost
    /// and a heartbeat then answered EXTENDED (`heartbeat`).
    Got { via: String },
    /// Admission said the attempt is this worker's: a claim answered
    /// CLAIMED or a heartbeat EXTENDED. From then on the attempt must end
    /// as a lease expiry (using an attempt) if the worker goes silent.
    Confirmed,
    /// The handler began.
    Start,
    /// The handler stopped: `done` (success, to be completed), `abandoned`
    /// (the worker stops heartbeating and never completes it),
    /// `lease_lost` (a heartbeat answered LEASE_LOST), `lease_timeout` (no
    /// renewal held any longer).
    End { how: String },
    /// A heartbeat answered LEASE_LOST; `held_until_ms` is when the worker's
    /// last renewal stopped holding (a LEASE_LOST before it breaks the
    /// contract).
    LeaseLost { held_until_ms: i64 },
    /// The answer to the success completion sent at `sent_ms` (`ACCEPTED`,
    /// `STALE`, `NOT_FOUND`, or `GAVE_UP` when none came within a minute),
    /// and when the worker's lease stopped holding by its own count.
    Complete {
        answer: String,
        sent_ms: i64,
        held_until_ms: i64,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Line {
    pub at_ms: i64,
    pub job: usize,
    pub attempt: u32,
    pub event: Event,
}

impl Line {
    pub fn format(&self) -> String {
        let (kind, rest) = match &self.event {
            Event::Got { via } => ("got", via.clone()),
            Event::Ready => ("ready", String::new()),
            Event::Confirmed => ("confirmed", String::new()),
            Event::Start => ("start", String::new()),
            Event::End { how } => ("end", how.clone()),
            Event::LeaseLost { held_until_ms } => ("lease_lost", held_until_ms.to_string()),
            Event::Complete {
                answer,
                sent_ms,
                held_until_ms,
            } => ("complete", format!("{answer} {sent_ms} {held_until_ms}")),
        };
        format!("{} {kind} {} {} {rest}\n", self.at_ms, self.job, self.attempt)
    }

    /// `None` for a line that is not one (cut short, say).
    pub fn parse(text: &str) -> Option<Line> {
        let mut fields = text.split_whitespace();
        let at_ms = fields.next()?.parse().ok()?;
        let kind = fields.next()?;
        let job = fields.next()?.parse().ok()?;
        let attempt = fields.next()?.parse().ok()?;
        let event = match kind {
            "got" => Event::Got {
                via: fields.next()?.to_string(),
            },
            "ready" => Event::Ready,
            "confirmed" => Event::Confirmed,
            "start" => Event::Start,
            "end" => Event::End {
                how: fields.next()?.to_string(),
            },
            "lease_lost" => Event::LeaseLost {
                held_until_ms: fields.next()?.parse().ok()?,
            },
            "complete" => Event::Complete {
                answer: fields.next()?.to_string(),
                sent_ms: fields.next()?.parse().ok()?,
                held_until_ms: fields.next()?.parse().ok()?,
            },
            _ => return None,
        };
        Some(Line {
            at_ms,
            job,
            attempt,
            event,
        })
    }
}

/// The file a worker process appends its events to.
pub struct EventLog {
    file: Mutex<std::fs::File>,
}

impl EventLog {
    pub fn create(path: &std::path::Path) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new().create(true).append(true).open(path)?;
        Ok(EventLog { file: Mutex::new(file) })
    }

    pub fn write(&self, job: usize, attempt: u32, event: Event) {
        let line = Line {
            at_ms: now_ms(),
            job,
            attempt,
            event,
        }
        .format();
        let mut file = self.file.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Err(error) = file.write_all(line.as_bytes()) {
            eprintln!("chaos worker: writing its history failed: {error}");
        }
    }
}

/// Every whole line of `path` (none when it cannot be read).
pub fn read(path: &std::path::Path) -> Vec<Line> {
    std::fs::read_to_string(path)
        .map(|text| text.lines().filter_map(Line::parse).collect())
        .unwrap_or_default()
}

/// A log read as it grows: each `read_new` gives the whole lines written
/// since the last one (a line being written waits for the next).
pub struct Tail {
    path: std::path::PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl Tail {
    pub fn new(path: std::path::PathBuf) -> Self {
        Tail {
            path,
            offset: 0,
            partial: Vec::new(),
        }
    }

    pub fn read_new(&mut self) -> Vec<Line> {
        use std::io::{Read, Seek};
        let Ok(mut file) = std::fs::File::open(&self.path) else {
            return Vec::new();
        };
        if file.seek(std::io::SeekFrom::Start(self.offset)).is_err() {
            return Vec::new();
        }
        let mut bytes = std::mem::take(&mut self.partial);
        let Ok(read) = file.read_to_end(&mut bytes) else {
            return Vec::new();
        };
        self.offset += read as u64;
        let whole = bytes.iter().rposition(|byte| *byte == b'\n').map_or(0, |end| end + 1);
        self.partial = bytes.split_off(whole);
        String::from_utf8_lossy(&bytes)
            .lines()
            .filter_map(Line::parse)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_back_as_written() {
        for event in [
            Event::Ready,
            Event::Got {
                via: "push".to_string(),
            },
            Event::Confirmed,
            Event::Start,
            Event::End {
                how: "abandoned".to_string(),
            },
            Event::LeaseLost { held_until_ms: 17 },
            Event::Complete {
                answer: "STALE".to_string(),
                sent_ms: 5,
                held_until_ms: 9,
            },
        ] {
            let line = Line {
                at_ms: 1_700_000_000_123,
                job: 42,
                attempt: 3,
                event,
            };
            assert_eq!(Line::parse(&line.format()), Some(line));
        }
        assert_eq!(Line::parse("1700 complete 4"), None, "a line cut short is skipped");
    }
}
