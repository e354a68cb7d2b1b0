//! Adaptive concurrency limits: a key whose max Sluice computes from how its
//! jobs fare — each attempt's run time (claim to completion, measured by
//! admission and carried on the release) and outcome.
//!
//! In the style of TCP congestion control and the published gradient
//! concurrency-limit algorithms, with a job's run as the round trip:
//!
//! - Completions are counted in windows. Only jobs granted while a window is
//!   open count in it (a job granted under the previous max says nothing
//!   about this one), so the max moves at most once per round trip. A window
//!   closes when it has counted `max(current max, MIN_WINDOW)` completions.
//! - When a window closes:
//!   - its error ratio over `max_error_ratio`: the max shrinks toward
//!     `max × (1 − ratio)` — the share of jobs the downstream refused is the
//!     share it is over capacity;
//!   - else its mean run time over `target_latency_ms`: the max shrinks
//!     toward `max × target / mean` (the gradient);
//!   - else, when the window used the whole max (a grant filled it, or jobs
//!     waited): it grows, doubling until the first shrink (slow start), then
//!     by one;
//!   - else it stays.
//!
//!   A shrink moves `smoothing` of the way to the computed value and at most
//!   halves the max; every value stays within `min..=max`.
//!
//! Pure: no clock of its own, no I/O. The caller applies the computed max
//! like a floating max (a lower value only affects new grants) and persists
//! the durable part (`StoredAdaptive`) when it changes. The open window is
//! kept in memory only: a new owner starts a new one.

use sluice_common::hash::HashSet;
use std::fmt;

use sluice_proto::v1 as pb;

use super::TicketKey;

/// The fewest completions a window closes with (noise at small maxes).
pub const MIN_WINDOW: u32 = 5;
pub const DEFAULT_MAX: u32 = 100;
pub const DEFAULT_MAX_ERROR_RATIO: f64 = 0.1;
pub const DEFAULT_SMOOTHING: f64 = 0.5;
/// A shrink at most halves the max.
const MAX_SHRINK: f64 = 0.5;

/// A key's settings, defaults applied.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveSettings {
    pub min: u32,
    pub max: u32,
    pub initial: u32,
    /// 0: run time is not a signal.
    pub target_latency_ms: u64,
    pub max_error_ratio: f64,
    pub smoothing: f64,
}

impl AdaptiveSettings {
    /// The settings a job's limit names, with the defaults for its zeros.
    /// Bounds are checked at the edge (`validate`); a value out of them here
    /// is clamped, never trusted.
    pub fn of(spec: &pb::AdaptiveConcurrencyLimit) -> Self {
        let min = spec.min.max(1);
        let max = if spec.max == 0 {
            DEFAULT_MAX.max(min)
        } else {
            spec.max.max(min)
        };
        let initial = if spec.initial == 0 {
            min
        } else {
            spec.initial.clamp(min, max)
        };
        let ratio = |value: f64, default: f64| {
            if value.is_finite() && value > 0.0 {
                value.min(1.0)
            } else {
                default
            }
        };
        AdaptiveSettings {
            min,
            max,
            initial,
            target_latency_ms: spec.target_latency_ms,
            max_error_ratio: ratio(spec.max_error_ratio, DEFAULT_MAX_ERROR_RATIO),
            smoothing: ratio(spec.smoothing, DEFAULT_SMOOTHING),
        }
    }

    pub fn to_proto(self, key: &str) -> pb::AdaptiveConcurrencyLimit {
        pb::AdaptiveConcurrencyLimit {
            key: key.to_string(),
            min: self.min,
            max: self.max,
            initial: self.initial,
            target_latency_ms: self.target_latency_ms,
            max_error_ratio: self.max_error_ratio,
            smoothing: self.smoothing,
        }
    }
}

/// How an attempt ended, for the window.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    /// Failed, timed out, or its lease expired: a sign of overload.
    Failed,
}

/// Why the max changed, with the window's figures.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ChangeReason {
    /// The window used the whole max within the targets.
    Grow {
        slow_start: bool,
        mean_run_ms: f64,
    },
    Latency {
        mean_run_ms: f64,
        target_ms: u64,
    },
    Errors {
        ratio: f64,
        max_ratio: f64,
    },
}

impl ChangeReason {
    /// The metric label.
    pub fn label(&self) -> &'static str {
        match self {
            ChangeReason::Grow { .. } => "grow",
            ChangeReason::Latency { .. } => "latency",
            ChangeReason::Errors { .. } => "errors",
        }
    }
}

impl fmt::Display for ChangeReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChangeReason::Grow {
                slow_start,
                mean_run_ms,
            } => write!(
                f,
                "grow{}: the window used the whole max, mean run {mean_run_ms:.0} ms within the targets",
                if *slow_start { " (slow start)" } else { "" }
            ),
            ChangeReason::Latency { mean_run_ms, target_ms } => {
                write!(
                    f,
                    "latency: mean run {mean_run_ms:.0} ms over the {target_ms} ms target"
                )
            }
            ChangeReason::Errors { ratio, max_ratio } => write!(
                f,
                "errors: {:.0} % of the window failed, over the {:.0} % allowed",
                ratio * 100.0,
                max_ratio * 100.0
            ),
        }
    }
}

/// A change of the computed max.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Change {
    pub at_ms: i64,
    pub from: u32,
    pub to: u32,
    pub reason: ChangeReason,
}

/// The completions of the open window.
#[derive(Clone, Debug, Default, PartialEq)]
struct Window {
    /// Tickets granted while it is open; only their completions count.
    members: HashSet<TicketKey>,
    size: u32,
    samples: u32,
    errors: u32,
    run_ms_total: i64,
    /// A grant filled the max, or jobs waited.
    saturated: bool,
}

/// A closed window's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WindowStats {
    pub samples: u32,
    pub mean_run_ms: Option<f64>,
    pub error_ratio: f64,
}

/// One adaptive key's computed max.
#[derive(Clone, Debug, PartialEq)]
pub struct Adaptive {
    pub settings: AdaptiveSettings,
    /// The exact value; the max applied is its floor (`current`).
    limit: f64,
    slow_start: bool,
    changes: u64,
    last_change: Option<pb::AdaptiveChange>,
    last_window: WindowStats,
    window: Window,
}

impl Adaptive {
    pub fn new(settings: AdaptiveSettings) -> Self {
        let mut adaptive = Adaptive {
            settings,
            limit: f64::from(settings.initial),
            slow_start: true,
            changes: 0,
            last_change: None,
            last_window: WindowStats::default(),
            window: Window::default(),
        };
        adaptive.open_window();
        adaptive
    }

    /// The max grants are checked against.
    pub fn current(&self) -> u32 {
        // `as` saturates; the clamp keeps it within the bounds.
        (self.limit.floor() as u32).clamp(self.settings.min, self.settings.max)
    }

    /// A ticket of the key was granted: it counts in the open window.
    pub fn granted(&mut self, ticket: &TicketKey) {
        self.window.members.insert(ticket.clone());
    }

    /// The key is using its whole max (holders at the max, or waiters).
    pub fn saturated(&mut self) {
        self.window.saturated = true;
    }

    /// A granted ticket ended after `run_ms`. Returns the change of the max
    /// when this completion closed a window that moved it.
    pub fn observe(&mut self, now_ms: i64, ticket: &TicketKey, run_ms: i64, outcome: Outcome) -> Option<Change> {
        if !self.window.members.remove(ticket) {
            return None;
        }
        let window = &mut self.window;
        window.samples += 1;
        window.run_ms_total = window.run_ms_total.saturating_add(run_ms.max(0));
        if outcome == Outcome::Failed {
            window.errors += 1;
        }
        if window.samples < window.size {
            return None;
        }
        self.close_window(now_ms)
    }

    fn open_window(&mut self) {
        self.window = Window {
            size: self.current().max(MIN_WINDOW),
            ..Window::default()
        };
    }

    fn close_window(&mut self, now_ms: i64) -> Option<Change> {
        let window = std::mem::take(&mut self.window);
        let samples = f64::from(window.samples.max(1));
        let mean_run_ms = window.run_ms_total as f64 / samples;
        let error_ratio = f64::from(window.errors) / samples;
        self.last_window = WindowStats {
            samples: window.samples,
            mean_run_ms: Some(mean_run_ms),
            error_ratio,
        };
        let settings = self.settings;
        let target_ms = settings.target_latency_ms;
        let (computed, reason) = if error_ratio > settings.max_error_ratio {
            let shrunk = self.shrink_toward(self.limit * (1.0 - error_ratio));
            (
                shrunk,
                ChangeReason::Errors {
                    ratio: error_ratio,
                    max_ratio: settings.max_error_ratio,
                },
            )
        } else if target_ms > 0 && mean_run_ms > target_ms as f64 {
            let shrunk = self.shrink_toward(self.limit * target_ms as f64 / mean_run_ms);
            (shrunk, ChangeReason::Latency { mean_run_ms, target_ms })
        } else if window.saturated {
            let grown = if self.slow_start {
                self.limit * 2.0
            } else {
                self.limit + 1.0
            };
            (
                grown,
                ChangeReason::Grow {
                    slow_start: self.slow_start,
                    mean_run_ms,
                },
            )
        } else {
            self.open_window();
            return None;
        };
        if !matches!(reason, ChangeReason::Grow { .. }) {
            self.slow_start = false;
        }
        let from = self.current();
        self.limit = computed.clamp(f64::from(settings.min), f64::from(settings.max));
        self.open_window();
        let to = self.current();
        if to == from {
            return None;
        }
        self.changes += 1;
        let change = Change {
            at_ms: now_ms,
            from,
            to,
            reason,
        };
        self.last_change = Some(pb::AdaptiveChange {
            at_ms: now_ms,
            from,
            to,
            reason: reason.to_string(),
        });
        Some(change)
    }

    /// `smoothing` of the way from the limit to `target`, at most halving.
    fn shrink_toward(&self, target: f64) -> f64 {
        let moved = self.limit + self.settings.smoothing * (target - self.limit);
        moved.max(self.limit * MAX_SHRINK)
    }

    /// For `DescribeKey`.
    pub fn describe(&self, key: &str) -> pb::AdaptiveState {
        pb::AdaptiveState {
            settings: Some(self.settings.to_proto(key)),
            current_max: self.current(),
            slow_start: self.slow_start,
            window_samples: self.last_window.samples,
            window_mean_run_ms: self.last_window.mean_run_ms,
            window_error_ratio: self.last_window.error_ratio,
            open_window_samples: self.window.samples,
            open_window_size: self.window.size,
            changes: self.changes,
            last_change: self.last_change.clone(),
        }
    }

    /// The durable part, as stored with the key.
    pub fn stored(&self, key: &str) -> StoredAdaptive {
        StoredAdaptive {
            settings: Some(self.settings.to_proto(key)),
            limit: self.limit,
            slow_start: self.slow_start,
            changes: self.changes,
            last_change: self.last_change.clone(),
        }
    }

    pub fn from_stored(stored: StoredAdaptive) -> Self {
        let settings = AdaptiveSettings::of(&stored.settings.unwrap_or_default());
        let limit = if stored.limit.is_finite() {
            stored.limit.clamp(f64::from(settings.min), f64::from(settings.max))
        } else {
            f64::from(settings.initial)
        };
        let mut adaptive = Adaptive {
            settings,
            limit,
            slow_start: stored.slow_start,
            changes: stored.changes,
            last_change: stored.last_change,
            last_window: WindowStats::default(),
            window: Window::default(),
        };
        adaptive.open_window();
        adaptive
    }
}

/// An adaptive key's durable state (the `keys.adaptive` column). A storage
/// format, not a message between services.
#[derive(Clone, PartialEq, prost::Message)]
pub struct StoredAdaptive {
    #[prost(message, optional, tag = "1")]
    pub settings: Option<pb::AdaptiveConcurrencyLimit>,
    #[prost(double, tag = "2")]
    pub limit: f64,
    #[prost(bool, tag = "3")]
    pub slow_start: bool,
    #[prost(uint64, tag = "4")]
    pub changes: u64,
    #[prost(message, optional, tag = "5")]
    pub last_change: Option<pb::AdaptiveChange>,
}

#[cfg(test)]
mod tests;
