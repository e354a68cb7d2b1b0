//! The sliding rate window of one rate key: the pure core behind guarantee 5
//! of docs/architecture.md ("rate windows hold at every instant"). No I/O, no async: the
//! clock is injected and every method takes `now_ms` (unix milliseconds).
//!
//! # The promise
//!
//! A window allows `limit` units per `window_ms` milliseconds, at 1 ms
//! granularity. A grant of `cost` units made at millisecond `t` counts in
//! every interval of length `window_ms` that contains `t`, and no half-open
//! interval `[s, s + window_ms)` may ever hold more than `limit` units.
//!
//! Grants are only made at their own time, never reserved ahead. So granting
//! `cost` at `t` is legal iff the units granted in `(t - window_ms, t]` plus
//! `cost` stay within `limit`. Checking that at every grant is enough: the
//! latest grant of any interval of length `window_ms` sees every other grant of
//! that interval in its own look-back.
//!
//! When a grant is not legal yet, [`SlidingWindow::earliest`] gives the exact
//! millisecond at which it becomes legal: the moment enough of the oldest
//! grants have left the window (a grant made at `g` leaves at `g + window_ms`).
//! Nothing is ever rejected for lack of room; only a cost above the limit is
//! an error, because no amount of waiting can make it legal.
//!
//! # Time never goes backwards inside a window
//!
//! A `now_ms` earlier than the latest grant is treated as the latest grant's
//! time. Granting "in the past" would be checked against a look-back that
//! misses the grants made after it, and a later interval could then hold both.
//! Clamping keeps the guarantee when a new owner's clock is slightly behind the
//! previous owner's after a failover: [`SlidingWindow::restore`] sets the clamp
//! to the newest persisted grant, so the new owner's first grant cannot land
//! before it. Only grants move the clamp; queries (`used`, `earliest`) and
//! deferred decisions never do, so a caller passing a wrong future `now_ms` to
//! a query does not shift later grants.
//!
//! # Memory
//!
//! Grants are aggregated per millisecond: one entry per distinct millisecond
//! that holds a grant, oldest first, in a `VecDeque`. Each entry stores the
//! running total of units granted through it, so that the units in any suffix
//! of the window, and the exact retry time, come from binary searches instead
//! of walks. Entries older than the window are evicted lazily, when a grant is
//! recorded (the only moment the clamp above moves, so the only moment an
//! entry becomes useless for every future decision).
//!
//! - Fixed part per key: `size_of::<SlidingWindow>()` = 64 bytes on 64-bit
//!   targets, plus the allocator's header for the entry buffer.
//! - Per stored entry: 16 bytes (`i64` millisecond + `u64` running total). The
//!   buffer grows by doubling and keeps its capacity so the steady state does
//!   not allocate; it can therefore hold up to twice the peak entry count until
//!   [`SlidingWindow::release_spare_memory`] is called.
//! - Worst case: `min(limit, window_ms)` entries. After eviction every entry
//!   lies in the last `window_ms` milliseconds (at most `window_ms` distinct
//!   milliseconds) and holds at least one of the at most `limit` units granted
//!   there. Examples: 1,000,000 per 1,000 ms keeps at most 1,000 entries
//!   (16 KB); 100 per day keeps at most 100 entries (1.6 KB). After the limit
//!   is lowered, the entries still in the window were admitted under the old
//!   limit, so the bound uses the largest limit in effect during the last
//!   window.
//!
//! # Changing the limit or the window in place
//!
//! [`SlidingWindow::set_spec`] makes later decisions use the new values against
//! the recorded grants:
//!
//! - A raised limit takes effect at once. A lowered limit applies to new grants
//!   at once: nothing is granted until the window (old grants included) has
//!   room for the grant under the new limit. Grants already made stay counted.
//! - A shorter window takes effect at once, and entries older than it are
//!   evicted at the next grant.
//! - A longer window only sees the history that is still stored: grants older
//!   than the window in effect at the latest grant were already evicted. So
//!   right after a window grows, an interval of the new length that reaches
//!   back past the old window may end up holding more than `limit` units
//!   (counting grants from before the change). This is the permissive
//!   direction; it is accepted because stored resources change rarely and
//!   keeping history for the largest window ever configured would make the
//!   memory bound depend on history rather than on the current spec. Every
//!   interval that starts after the change holds the promise.

use std::collections::VecDeque;

/// The largest window accepted, about a century. It keeps every time sum far
/// from `i64` overflow for any realistic unix time.
pub const MAX_WINDOW_MS: u64 = sluice_common::validate::MAX_RATE_WINDOW_MS;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    #[error("a rate limit must allow at least 1 unit per window; retrying cannot help")]
    ZeroLimit,
    #[error(
        "a rate window must last between 1 ms and {MAX_WINDOW_MS} ms, got {window_ms} ms; \
         retrying cannot help"
    )]
    WindowLengthOutOfRange { window_ms: u64 },
    #[error(
        "a cost of {cost} units exceeds the limit of {limit} units per window, so it can \
         never be granted; retrying cannot help until the limit is raised"
    )]
    CostExceedsLimit { cost: u64, limit: u64 },
    #[error("the restored grants add up to more than u64::MAX units; the persisted state is corrupt")]
    RestoredUnitsOverflow,
}

/// A validated `limit` units per `window_ms` milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowSpec {
    limit: u64,
    window_ms: u64,
}

impl WindowSpec {
    pub fn new(limit: u64, window_ms: u64) -> Result<Self, WindowError> {
        if limit == 0 {
            return Err(WindowError::ZeroLimit);
        }
        if window_ms == 0 || window_ms > MAX_WINDOW_MS {
            return Err(WindowError::WindowLengthOutOfRange { window_ms });
        }
        Ok(WindowSpec { limit, window_ms })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }
}

/// The outcome of [`SlidingWindow::try_acquire`]. A cost of zero is always
/// granted and records nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// The units were recorded at `at_ms`, which is `now_ms` unless the clamp
    /// of the module doc moved it later. `remaining` is the room left in the
    /// window ending at `at_ms`.
    Granted { at_ms: i64, remaining: u64 },
    /// Nothing was recorded. `retry_at_ms` is the exact first millisecond at
    /// which the same cost becomes legal if nothing else is granted before.
    Deferred { retry_at_ms: i64 },
}

/// One millisecond that holds grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    at_ms: i64,
    /// Units granted by this window through this millisecond, counted from an
    /// arbitrary origin with wrapping arithmetic. Only differences between
    /// stored totals are meaningful; they are exact because the units stored
    /// at once never exceed `u64::MAX`.
    units_granted_through: u64,
}

/// Where the window ending at some millisecond starts within the entries.
#[derive(Debug, Clone, Copy)]
struct WindowView {
    /// Index of the oldest entry inside the window (`entries.len()` if none).
    first_inside_index: usize,
    /// Units stored before that entry, relative to the oldest stored entry.
    units_stored_before_window: u64,
    units_in_window: u64,
}

/// The grants of one rate key over its current window. See the module doc.
#[derive(Debug, Clone)]
pub struct SlidingWindow {
    spec: WindowSpec,
    entries: VecDeque<Entry>,
    /// The running total just before the oldest stored entry (the total of the
    /// last evicted entry), which is the origin of every stored difference.
    units_granted_before_oldest_entry: u64,
    /// The time of the latest grant, `i64::MIN` before any. Decisions are
    /// never taken at an earlier time (see the module doc).
    latest_grant_ms: i64,
}

impl SlidingWindow {
    pub fn new(spec: WindowSpec) -> Self {
        SlidingWindow {
            spec,
            entries: VecDeque::new(),
            units_granted_before_oldest_entry: 0,
            latest_grant_ms: i64::MIN,
        }
    }

    pub fn spec(&self) -> WindowSpec {
        self.spec
    }

    /// Later decisions use the new spec against the recorded grants; see the
    /// module doc for what a longer window can and cannot see.
    pub fn set_spec(&mut self, spec: WindowSpec) {
        self.spec = spec;
    }

    /// The time of the latest grant, below which `now_ms` is clamped.
    pub fn latest_grant_ms(&self) -> Option<i64> {
        if self.latest_grant_ms == i64::MIN && self.entries.is_empty() {
            return None;
        }
        Some(self.latest_grant_ms)
    }

    /// Grants `cost` units now if that is legal, else changes nothing and
    /// returns the exact time it becomes legal. Allocation-free once the entry
    /// buffer has reached its working size; O(log entries).
    pub fn try_acquire(&mut self, now_ms: i64, cost: u64) -> Result<Decision, WindowError> {
        self.check_cost_fits_limit(cost)?;
        let decision_ms = self.decision_time(now_ms);
        let view = self.view_at(decision_ms);
        // `limit - cost` cannot underflow: the cost was checked above.
        if view.units_in_window > self.spec.limit - cost {
            let retry_at_ms = self.retry_time(decision_ms, cost, view);
            return Ok(Decision::Deferred { retry_at_ms });
        }
        self.record_grant(decision_ms, cost);
        let units_in_window_after_grant = view.units_in_window + cost;
        // Recording evicts everything outside this window (unless nothing was
        // recorded), so what is stored is exactly this window.
        debug_assert!(cost == 0 || units_in_window_after_grant == self.units_stored());
        Ok(Decision::Granted {
            at_ms: decision_ms,
            remaining: self.spec.limit - units_in_window_after_grant,
        })
    }

    /// The exact earliest time, at or after `now_ms` (clamped), at which
    /// granting `cost` is legal given the recorded grants. Changes nothing.
    pub fn earliest(&self, now_ms: i64, cost: u64) -> Result<i64, WindowError> {
        self.check_cost_fits_limit(cost)?;
        let decision_ms = self.decision_time(now_ms);
        let view = self.view_at(decision_ms);
        if view.units_in_window <= self.spec.limit - cost {
            return Ok(decision_ms);
        }
        Ok(self.retry_time(decision_ms, cost, view))
    }

    /// Units granted in the window ending at `now_ms` (clamped).
    pub fn used(&self, now_ms: i64) -> u64 {
        self.view_at(self.decision_time(now_ms)).units_in_window
    }

    /// The stored grants, oldest first, one `(millisecond, units)` per distinct
    /// millisecond; what must be persisted to [`SlidingWindow::restore`] this
    /// window. May include grants that have already left the window as seen
    /// from the current time (eviction is lazy); restoring them is harmless.
    pub fn entries(&self) -> impl Iterator<Item = (i64, u64)> + '_ {
        let mut units_granted_before_entry = self.units_granted_before_oldest_entry;
        self.entries.iter().map(move |entry| {
            let units = entry.units_granted_through.wrapping_sub(units_granted_before_entry);
            units_granted_before_entry = entry.units_granted_through;
            (entry.at_ms, units)
        })
    }

    pub fn entry_count(&self) -> usize {
        self.entries.len()
    }

    /// Replaces the recorded grants with persisted ones, e.g. when a new owner
    /// takes over the key. The rows may come in any order; rows of the same
    /// millisecond are added up, rows of zero units are ignored, and rows that
    /// can no longer matter (older than the window at the newest row) are
    /// dropped. The clamp moves to the newest row. On error nothing changes.
    pub fn restore(&mut self, grants: impl IntoIterator<Item = (i64, u64)>) -> Result<(), WindowError> {
        let mut sorted_grants: Vec<(i64, u64)> = grants.into_iter().filter(|(_, units)| *units > 0).collect();
        sorted_grants.sort_unstable_by_key(|(at_ms, _)| *at_ms);
        let mut restored_entries: VecDeque<Entry> = VecDeque::with_capacity(sorted_grants.len());
        let mut units_granted_through: u64 = 0;
        for (at_ms, units) in sorted_grants {
            units_granted_through = units_granted_through
                .checked_add(units)
                .ok_or(WindowError::RestoredUnitsOverflow)?;
            match restored_entries.back_mut() {
                Some(newest_entry) if newest_entry.at_ms == at_ms => {
                    newest_entry.units_granted_through = units_granted_through;
                }
                _ => restored_entries.push_back(Entry {
                    at_ms,
                    units_granted_through,
                }),
            }
        }
        self.entries = restored_entries;
        self.units_granted_before_oldest_entry = 0;
        self.latest_grant_ms = self.entries.back().map_or(i64::MIN, |entry| entry.at_ms);
        self.evict_entries_outside_window_ending_at(self.latest_grant_ms);
        Ok(())
    }

    /// Gives back entry buffer capacity beyond what the stored entries need,
    /// e.g. for a key that has gone quiet after a burst.
    pub fn release_spare_memory(&mut self) {
        self.entries.shrink_to_fit();
    }

    fn check_cost_fits_limit(&self, cost: u64) -> Result<(), WindowError> {
        if cost > self.spec.limit {
            return Err(WindowError::CostExceedsLimit {
                cost,
                limit: self.spec.limit,
            });
        }
        Ok(())
    }

    fn decision_time(&self, now_ms: i64) -> i64 {
        now_ms.max(self.latest_grant_ms)
    }

    /// Entries at or before this millisecond are outside the window ending at
    /// `window_end_ms`. Computed in `i128` so no time near the `i64` range
    /// ends can make it wrap.
    fn last_millisecond_outside_window(&self, window_end_ms: i64) -> i128 {
        i128::from(window_end_ms) - i128::from(self.spec.window_ms)
    }

    fn is_outside_window(&self, entry: &Entry, window_end_ms: i64) -> bool {
        i128::from(entry.at_ms) <= self.last_millisecond_outside_window(window_end_ms)
    }

    /// Units stored through `entry`, counted from the oldest stored entry.
    fn units_stored_through(&self, entry: &Entry) -> u64 {
        entry
            .units_granted_through
            .wrapping_sub(self.units_granted_before_oldest_entry)
    }

    fn units_stored(&self) -> u64 {
        self.entries
            .back()
            .map_or(0, |newest_entry| self.units_stored_through(newest_entry))
    }

    fn view_at(&self, window_end_ms: i64) -> WindowView {
        let units_stored = self.units_stored();
        let oldest_entry_is_inside = self
            .entries
            .front()
            .is_none_or(|oldest_entry| !self.is_outside_window(oldest_entry, window_end_ms));
        // The common case (nothing stored has left the window yet) needs no search.
        if oldest_entry_is_inside {
            return WindowView {
                first_inside_index: 0,
                units_stored_before_window: 0,
                units_in_window: units_stored,
            };
        }
        let first_inside_index = self
            .entries
            .partition_point(|entry| self.is_outside_window(entry, window_end_ms));
        debug_assert!(first_inside_index >= 1);
        let units_stored_before_window = self
            .entries
            .get(first_inside_index - 1)
            .map_or(0, |last_outside_entry| self.units_stored_through(last_outside_entry));
        WindowView {
            first_inside_index,
            units_stored_before_window,
            units_in_window: units_stored - units_stored_before_window,
        }
    }

    /// The first time after `decision_ms` at which `cost` fits, for a cost that
    /// does not fit at `decision_ms`: the time the oldest entry whose leaving
    /// frees enough units leaves the window.
    fn retry_time(&self, decision_ms: i64, cost: u64, view: WindowView) -> i64 {
        debug_assert!(cost <= self.spec.limit);
        debug_assert!(view.units_in_window > self.spec.limit - cost);
        // What must leave so that what stays plus `cost` fits the limit. It
        // also covers a window holding more than a lowered limit.
        let units_that_must_leave = view.units_in_window - (self.spec.limit - cost);
        let units_stored_through_target = view.units_stored_before_window + units_that_must_leave;
        let leaving_entry_index = self
            .entries
            .partition_point(|entry| self.units_stored_through(entry) < units_stored_through_target);
        debug_assert!(leaving_entry_index >= view.first_inside_index);
        debug_assert!(leaving_entry_index < self.entries.len());
        let Some(leaving_entry) = self.entries.get(leaving_entry_index) else {
            // Unreachable: the window holds more than `units_that_must_leave`.
            return decision_ms;
        };
        let leaves_at_ms = i128::from(leaving_entry.at_ms) + i128::from(self.spec.window_ms);
        let retry_at_ms = i64::try_from(leaves_at_ms).unwrap_or(i64::MAX);
        // Only a time saturated at the end of the i64 range can fail to be later.
        debug_assert!(retry_at_ms > decision_ms || retry_at_ms == i64::MAX);
        retry_at_ms
    }

    fn record_grant(&mut self, at_ms: i64, cost: u64) {
        debug_assert!(at_ms >= self.latest_grant_ms);
        // A grant of nothing is not persisted, so it must not move the clamp
        // either: a window restored from `entries()` would not know about it.
        if cost == 0 {
            return;
        }
        self.latest_grant_ms = at_ms;
        self.evict_entries_outside_window_ending_at(at_ms);
        let units_granted_before = self
            .entries
            .back()
            .map_or(self.units_granted_before_oldest_entry, |newest_entry| {
                newest_entry.units_granted_through
            });
        let units_granted_through = units_granted_before.wrapping_add(cost);
        match self.entries.back_mut() {
            Some(newest_entry) if newest_entry.at_ms == at_ms => {
                newest_entry.units_granted_through = units_granted_through;
            }
            _ => self.entries.push_back(Entry {
                at_ms,
                units_granted_through,
            }),
        }
    }

    fn evict_entries_outside_window_ending_at(&mut self, window_end_ms: i64) {
        while let Some(oldest_entry) = self.entries.front().copied() {
            if !self.is_outside_window(&oldest_entry, window_end_ms) {
                return;
            }
            self.units_granted_before_oldest_entry = oldest_entry.units_granted_through;
            self.entries.pop_front();
        }
    }

    #[cfg(test)]
    fn with_running_total_origin(spec: WindowSpec, origin: u64) -> Self {
        SlidingWindow {
            units_granted_before_oldest_entry: origin,
            ..SlidingWindow::new(spec)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn window(limit: u64, window_ms: u64) -> SlidingWindow {
        SlidingWindow::new(WindowSpec::new(limit, window_ms).unwrap())
    }

    fn granted_at(decision: Decision) -> i64 {
        match decision {
            Decision::Granted { at_ms, .. } => at_ms,
            Decision::Deferred { retry_at_ms } => panic!("deferred to {retry_at_ms}"),
        }
    }

    fn deferred_to(decision: Decision) -> i64 {
        match decision {
            Decision::Deferred { retry_at_ms } => retry_at_ms,
            Decision::Granted { at_ms, .. } => panic!("granted at {at_ms}"),
        }
    }

    #[test]
    fn retry_times_are_exact_for_three_per_second() {
        let mut rate = window(3, 1000);
        for at_ms in [0, 10, 20] {
            assert_eq!(granted_at(rate.try_acquire(at_ms, 1).unwrap()), at_ms);
        }
        // Each extra unit waits for one more of the oldest grants to leave.
        assert_eq!(deferred_to(rate.try_acquire(30, 1).unwrap()), 1000);
        assert_eq!(deferred_to(rate.try_acquire(30, 2).unwrap()), 1010);
        assert_eq!(deferred_to(rate.try_acquire(30, 3).unwrap()), 1020);
        assert_eq!(rate.earliest(30, 2).unwrap(), 1010);
        assert_eq!(deferred_to(rate.try_acquire(999, 1).unwrap()), 1000);
        assert_eq!(rate.used(999), 3);
        assert_eq!(
            rate.try_acquire(1000, 1).unwrap(),
            Decision::Granted {
                at_ms: 1000,
                remaining: 0
            }
        );
        // Now 10, 20, 1000 are inside: cost 2 needs 10 and 20 to leave.
        assert_eq!(deferred_to(rate.try_acquire(1000, 2).unwrap()), 1020);
        assert_eq!(deferred_to(rate.try_acquire(1005, 1).unwrap()), 1010);
    }

    #[test]
    fn a_grant_leaves_exactly_window_ms_after_it_was_made() {
        let mut rate = window(5, 100);
        assert_eq!(granted_at(rate.try_acquire(7, 5).unwrap()), 7);
        assert_eq!(deferred_to(rate.try_acquire(106, 1).unwrap()), 107);
        assert_eq!(rate.used(106), 5);
        assert_eq!(rate.used(107), 0);
        assert_eq!(
            rate.try_acquire(107, 5).unwrap(),
            Decision::Granted {
                at_ms: 107,
                remaining: 0
            }
        );
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(107, 5)]);
    }

    #[test]
    fn a_window_of_one_millisecond_allows_the_limit_per_millisecond() {
        let mut rate = window(2, 1);
        assert_eq!(granted_at(rate.try_acquire(50, 1).unwrap()), 50);
        assert_eq!(granted_at(rate.try_acquire(50, 1).unwrap()), 50);
        assert_eq!(deferred_to(rate.try_acquire(50, 1).unwrap()), 51);
        assert_eq!(granted_at(rate.try_acquire(51, 2).unwrap()), 51);
        assert_eq!(rate.entry_count(), 1);
    }

    #[test]
    fn the_retry_time_skips_entries_already_outside_the_window() {
        let mut rate = window(4, 100);
        for at_ms in [0, 50, 60, 70] {
            assert_eq!(granted_at(rate.try_acquire(at_ms, 1).unwrap()), at_ms);
        }
        // At 120 the grant at 0 has left but is still stored (lazy eviction).
        assert_eq!(rate.entry_count(), 4);
        assert_eq!(rate.used(120), 3);
        assert_eq!(deferred_to(rate.try_acquire(120, 2).unwrap()), 150);
        assert_eq!(deferred_to(rate.try_acquire(120, 4).unwrap()), 170);
        assert_eq!(granted_at(rate.try_acquire(120, 1).unwrap()), 120);
        assert_eq!(rate.entry_count(), 4);
        assert_eq!(
            rate.entries().collect::<Vec<_>>(),
            vec![(50, 1), (60, 1), (70, 1), (120, 1)]
        );
    }

    #[test]
    fn grants_of_one_millisecond_share_one_entry() {
        let mut rate = window(10, 1000);
        for _ in 0..4 {
            granted_at(rate.try_acquire(5, 2).unwrap());
        }
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(5, 8)]);
        assert_eq!(
            rate.try_acquire(5, 2).unwrap(),
            Decision::Granted { at_ms: 5, remaining: 0 }
        );
        assert_eq!(deferred_to(rate.try_acquire(6, 1).unwrap()), 1005);
    }

    #[test]
    fn a_cost_above_the_limit_is_an_error_and_changes_nothing() {
        let mut rate = window(3, 1000);
        let expected = WindowError::CostExceedsLimit { cost: 4, limit: 3 };
        assert_eq!(rate.try_acquire(0, 4), Err(expected.clone()));
        assert_eq!(rate.earliest(0, 4), Err(expected));
        assert_eq!(rate.entry_count(), 0);
        assert_eq!(rate.latest_grant_ms(), None);
        assert_eq!(granted_at(rate.try_acquire(0, 3).unwrap()), 0);
    }

    #[test]
    fn a_zero_cost_is_always_granted_and_stores_nothing() {
        let mut rate = window(1, 1000);
        granted_at(rate.try_acquire(0, 1).unwrap());
        assert_eq!(
            rate.try_acquire(10, 0).unwrap(),
            Decision::Granted {
                at_ms: 10,
                remaining: 0
            }
        );
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(0, 1)]);
        // Not persisted, so it leaves the clamp alone (see `record_grant`).
        assert_eq!(rate.latest_grant_ms(), Some(0));
        assert_eq!(granted_at(rate.try_acquire(5, 0).unwrap()), 5);
    }

    #[test]
    fn invalid_specs_are_refused() {
        assert_eq!(WindowSpec::new(0, 10), Err(WindowError::ZeroLimit));
        assert_eq!(
            WindowSpec::new(1, 0),
            Err(WindowError::WindowLengthOutOfRange { window_ms: 0 })
        );
        assert_eq!(
            WindowSpec::new(1, MAX_WINDOW_MS + 1),
            Err(WindowError::WindowLengthOutOfRange {
                window_ms: MAX_WINDOW_MS + 1
            })
        );
        let widest = WindowSpec::new(u64::MAX, MAX_WINDOW_MS).unwrap();
        assert_eq!(widest.limit(), u64::MAX);
        assert_eq!(widest.window_ms(), MAX_WINDOW_MS);
    }

    #[test]
    fn a_now_earlier_than_the_latest_grant_is_clamped_to_it() {
        let mut rate = window(2, 100);
        granted_at(rate.try_acquire(500, 1).unwrap());
        // A failover clock 40 ms behind: the grant lands at 500, not 460.
        assert_eq!(granted_at(rate.try_acquire(460, 1).unwrap()), 500);
        assert_eq!(rate.used(0), 2);
        assert_eq!(rate.earliest(0, 1).unwrap(), 600);
        assert_eq!(deferred_to(rate.try_acquire(450, 1).unwrap()), 600);
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(500, 2)]);
    }

    #[test]
    fn queries_and_deferrals_do_not_move_the_clamp() {
        let mut rate = window(1, 100);
        granted_at(rate.try_acquire(10, 1).unwrap());
        assert_eq!(rate.used(5_000), 0);
        assert_eq!(rate.earliest(5_000, 1).unwrap(), 5_000);
        assert_eq!(deferred_to(rate.try_acquire(20, 1).unwrap()), 110);
        assert_eq!(rate.latest_grant_ms(), Some(10));
        assert_eq!(granted_at(rate.try_acquire(110, 1).unwrap()), 110);
    }

    #[test]
    fn restore_rebuilds_the_same_decisions() {
        let mut original = window(5, 100);
        for (at_ms, cost) in [(0, 2), (30, 1), (30, 1), (90, 1)] {
            granted_at(original.try_acquire(at_ms, cost).unwrap());
        }
        let persisted: Vec<(i64, u64)> = original.entries().collect();
        assert_eq!(persisted, vec![(0, 2), (30, 2), (90, 1)]);
        let mut restored = window(5, 100);
        restored.restore(persisted).unwrap();
        assert_eq!(restored.latest_grant_ms(), Some(90));
        for (now_ms, cost) in [(50, 1), (95, 2), (100, 3), (130, 4), (190, 5)] {
            assert_eq!(restored.earliest(now_ms, cost), original.earliest(now_ms, cost));
        }
        assert_eq!(deferred_to(restored.try_acquire(95, 3).unwrap()), 130);
    }

    #[test]
    fn restore_sorts_merges_and_drops_rows_that_cannot_matter() {
        let mut rate = window(10, 100);
        granted_at(rate.try_acquire(0, 1).unwrap());
        rate.restore([(250, 1), (200, 0), (150, 2), (250, 3), (151, 1), (100, 4)])
            .unwrap();
        // 100 and 150 are outside the window (150, 250]; 151 is inside.
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(151, 1), (250, 4)]);
        assert_eq!(rate.latest_grant_ms(), Some(250));
        assert_eq!(rate.used(250), 5);
        assert_eq!(deferred_to(rate.try_acquire(250, 6).unwrap()), 251);
    }

    #[test]
    fn restore_refuses_an_overflowing_total_and_changes_nothing() {
        let mut rate = window(10, 100);
        granted_at(rate.try_acquire(3, 4).unwrap());
        assert_eq!(
            rate.restore([(1, u64::MAX), (2, 1)]),
            Err(WindowError::RestoredUnitsOverflow)
        );
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(3, 4)]);
        rate.restore(std::iter::empty()).unwrap();
        assert_eq!(rate.entry_count(), 0);
        assert_eq!(rate.latest_grant_ms(), None);
    }

    #[test]
    fn a_raised_limit_takes_effect_at_once() {
        let mut rate = window(2, 1000);
        granted_at(rate.try_acquire(0, 2).unwrap());
        assert_eq!(deferred_to(rate.try_acquire(10, 1).unwrap()), 1000);
        rate.set_spec(WindowSpec::new(3, 1000).unwrap());
        assert_eq!(granted_at(rate.try_acquire(10, 1).unwrap()), 10);
    }

    #[test]
    fn a_lowered_limit_waits_until_the_window_has_room_under_it() {
        let mut rate = window(10, 100);
        for at_ms in [0, 10, 20, 30] {
            granted_at(rate.try_acquire(at_ms, 2).unwrap());
        }
        rate.set_spec(WindowSpec::new(3, 100).unwrap());
        assert_eq!(rate.used(40), 8);
        // 8 in the window, limit 3: for 1 more, 6 units (0, 10, 20) must leave.
        assert_eq!(deferred_to(rate.try_acquire(40, 1).unwrap()), 120);
        assert_eq!(deferred_to(rate.try_acquire(40, 3).unwrap()), 130);
        assert_eq!(
            rate.try_acquire(120, 1).unwrap(),
            Decision::Granted {
                at_ms: 120,
                remaining: 0
            }
        );
    }

    #[test]
    fn a_shorter_window_takes_effect_at_once() {
        let mut rate = window(1, 1000);
        granted_at(rate.try_acquire(0, 1).unwrap());
        rate.set_spec(WindowSpec::new(1, 100).unwrap());
        assert_eq!(deferred_to(rate.try_acquire(50, 1).unwrap()), 100);
        assert_eq!(granted_at(rate.try_acquire(100, 1).unwrap()), 100);
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(100, 1)]);
    }

    /// Documents the permissive case of the module doc: history evicted under
    /// a shorter window is not seen by a longer one.
    #[test]
    fn a_longer_window_does_not_see_grants_evicted_before_it_grew() {
        let mut rate = window(1, 100);
        granted_at(rate.try_acquire(0, 1).unwrap());
        granted_at(rate.try_acquire(100, 1).unwrap());
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(100, 1)]);
        rate.set_spec(WindowSpec::new(2, 1000).unwrap());
        // With full history [0, 1000) would already hold 2 units; the grant at
        // 0 is gone, so one more is granted at 150.
        assert_eq!(granted_at(rate.try_acquire(150, 1).unwrap()), 150);
        // Without eviction in between, a longer window sees everything stored.
        let mut unevicted = window(1, 100);
        granted_at(unevicted.try_acquire(0, 1).unwrap());
        unevicted.set_spec(WindowSpec::new(1, 1000).unwrap());
        assert_eq!(deferred_to(unevicted.try_acquire(150, 1).unwrap()), 1000);
    }

    #[test]
    fn running_totals_may_wrap_around_u64() {
        let spec = WindowSpec::new(u64::MAX, 100).unwrap();
        let mut rate = SlidingWindow::with_running_total_origin(spec, u64::MAX - 5);
        granted_at(rate.try_acquire(0, 4).unwrap());
        granted_at(rate.try_acquire(1, 4).unwrap());
        granted_at(rate.try_acquire(2, u64::MAX - 10).unwrap());
        assert_eq!(rate.used(2), u64::MAX - 2);
        assert_eq!(
            rate.entries().collect::<Vec<_>>(),
            vec![(0, 4), (1, 4), (2, u64::MAX - 10)]
        );
        assert_eq!(deferred_to(rate.try_acquire(3, 3).unwrap()), 100);
        assert_eq!(deferred_to(rate.try_acquire(3, 6).unwrap()), 100);
        assert_eq!(deferred_to(rate.try_acquire(3, 7).unwrap()), 101);
        assert_eq!(deferred_to(rate.try_acquire(3, u64::MAX).unwrap()), 102);
        granted_at(rate.try_acquire(101, 8).unwrap());
        assert_eq!(rate.entries().collect::<Vec<_>>(), vec![(2, u64::MAX - 10), (101, 8)]);
    }

    #[test]
    fn times_at_the_ends_of_the_i64_range_do_not_overflow() {
        let mut early = window(1, MAX_WINDOW_MS);
        granted_at(early.try_acquire(i64::MIN, 1).unwrap());
        assert_eq!(
            deferred_to(early.try_acquire(i64::MIN + 1, 1).unwrap()),
            i64::MIN + i64::try_from(MAX_WINDOW_MS).unwrap()
        );
        let mut late = window(1, MAX_WINDOW_MS);
        granted_at(late.try_acquire(i64::MAX - 1, 1).unwrap());
        assert_eq!(deferred_to(late.try_acquire(i64::MAX, 1).unwrap()), i64::MAX);
    }

    #[cfg(target_pointer_width = "64")]
    #[test]
    fn the_memory_cost_matches_the_module_doc() {
        assert_eq!(std::mem::size_of::<SlidingWindow>(), 64);
        assert_eq!(std::mem::size_of::<Entry>(), 16);
    }

    /// Performance sanity, not a timed assertion: a million cost-1 grants per
    /// second, a thousand per millisecond, stays at a thousand entries and
    /// stops allocating once the buffer has grown.
    #[test]
    fn a_million_per_second_stays_small_and_exact() {
        let mut rate = window(1_000_000, 1000);
        for at_ms in 0..1000 {
            for _ in 0..1000 {
                granted_at(rate.try_acquire(at_ms, 1).unwrap());
            }
        }
        assert_eq!(rate.used(999), 1_000_000);
        assert_eq!(deferred_to(rate.try_acquire(999, 1).unwrap()), 1000);
        assert_eq!(deferred_to(rate.try_acquire(999, 1001).unwrap()), 1001);
        let warmed_up_capacity = rate.entries.capacity();
        for at_ms in 1000..3000 {
            for _ in 0..1000 {
                granted_at(rate.try_acquire(at_ms, 1).unwrap());
            }
            assert_eq!(deferred_to(rate.try_acquire(at_ms, 1).unwrap()), at_ms + 1);
        }
        assert_eq!(rate.entry_count(), 1000);
        assert_eq!(rate.entries.capacity(), warmed_up_capacity);
        assert_eq!(rate.earliest(2999, 1_000_000).unwrap(), 3999);
        rate.release_spare_memory();
        assert!(rate.entries.capacity() >= 1000);
    }

    // ----- property tests against a brute-force model -----

    /// Every grant ever made, never evicted, checked millisecond by millisecond.
    #[derive(Debug, Clone, Default)]
    struct BruteForceModel {
        grants: Vec<(i64, u64)>,
        latest_grant_ms: Option<i64>,
    }

    impl BruteForceModel {
        fn decision_time(&self, now_ms: i64) -> i64 {
            self.latest_grant_ms.map_or(now_ms, |latest| now_ms.max(latest))
        }

        fn units_in_window(&self, window_end_ms: i64, window_ms: u64) -> u64 {
            let window_ms = i64::try_from(window_ms).unwrap();
            self.grants
                .iter()
                .filter(|(at_ms, _)| *at_ms > window_end_ms - window_ms && *at_ms <= window_end_ms)
                .map(|(_, units)| units)
                .sum()
        }

        fn earliest(&self, now_ms: i64, cost: u64, spec: WindowSpec) -> i64 {
            let mut candidate_ms = self.decision_time(now_ms);
            while self.units_in_window(candidate_ms, spec.window_ms()) + cost > spec.limit() {
                candidate_ms += 1;
            }
            candidate_ms
        }
    }

    /// No interval [s, s + W) holds more than the limit: checking the look-back
    /// of every grant is equivalent (module doc).
    fn assert_no_interval_overflows(grants: &[(i64, u64)], spec: WindowSpec) {
        let window_ms = i64::try_from(spec.window_ms()).unwrap();
        for (window_end_ms, _) in grants {
            let units: u64 = grants
                .iter()
                .filter(|(at_ms, _)| *at_ms > window_end_ms - window_ms && at_ms <= window_end_ms)
                .map(|(_, units)| units)
                .sum();
            assert!(
                units <= spec.limit(),
                "{units} units in the window ending at {window_end_ms}"
            );
        }
    }

    #[derive(Debug, Clone)]
    enum Operation {
        TryAcquire { time_step_ms: i64, cost_per_mille: u64 },
        SetSpec { limit: u64, window_shrink_per_mille: u64 },
    }

    fn operation_strategy() -> impl Strategy<Value = Operation> {
        prop_oneof![
            10 => (-30i64..40, 0u64..=1100).prop_map(|(time_step_ms, cost_per_mille)| {
                Operation::TryAcquire { time_step_ms, cost_per_mille }
            }),
            1 => (1u64..=12, 0u64..=1000).prop_map(|(limit, window_shrink_per_mille)| {
                Operation::SetSpec { limit, window_shrink_per_mille }
            }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// Every decision, retry time and `used` value equals the brute-force
        /// model's, with times going back now and then, costs above the limit,
        /// limit changes and window shrinks (a model that never forgets agrees,
        /// so nothing needed is evicted). Also checks the guarantee and that a
        /// window restored from `entries()` decides the same.
        #[test]
        fn decisions_match_a_brute_force_model(
            initial_limit in 1u64..=12,
            initial_window_ms in 1u64..=60,
            start_ms in -1000i64..1000,
            operations in prop::collection::vec(operation_strategy(), 1..80),
        ) {
            let mut spec = WindowSpec::new(initial_limit, initial_window_ms).unwrap();
            let mut rate = SlidingWindow::new(spec);
            let mut model = BruteForceModel::default();
            let mut now_ms = start_ms;
            let mut spec_changed = false;
            for operation in operations {
                match operation {
                    Operation::SetSpec { limit, window_shrink_per_mille } => {
                        spec_changed = true;
                        let shorter_window_ms =
                            (spec.window_ms() * (1000 - window_shrink_per_mille) / 1000).max(1);
                        spec = WindowSpec::new(limit, shorter_window_ms).unwrap();
                        rate.set_spec(spec);
                    }
                    Operation::TryAcquire { time_step_ms, cost_per_mille } => {
                        now_ms += time_step_ms;
                        let cost = spec.limit() * cost_per_mille / 1000;
                        prop_assert_eq!(rate.used(now_ms), model.units_in_window(model.decision_time(now_ms), spec.window_ms()));
                        let decision = rate.try_acquire(now_ms, cost);
                        if cost > spec.limit() {
                            prop_assert_eq!(decision, Err(WindowError::CostExceedsLimit { cost, limit: spec.limit() }));
                            continue;
                        }
                        let expected_earliest_ms = model.earliest(now_ms, cost, spec);
                        let decision_ms = model.decision_time(now_ms);
                        if expected_earliest_ms == decision_ms {
                            if cost > 0 {
                                model.grants.push((decision_ms, cost));
                                model.latest_grant_ms = Some(decision_ms);
                            }
                            let remaining = spec.limit() - model.units_in_window(decision_ms, spec.window_ms());
                            prop_assert_eq!(decision, Ok(Decision::Granted { at_ms: decision_ms, remaining }));
                        } else {
                            prop_assert_eq!(decision, Ok(Decision::Deferred { retry_at_ms: expected_earliest_ms }));
                        }
                    }
                }
                // The largest limit generated is 12 and windows only shrink.
                prop_assert!(rate.entry_count() as u64 <= initial_window_ms.min(12));
                let mut restored = SlidingWindow::new(spec);
                restored.restore(rate.entries()).unwrap();
                for (probe_offset_ms, probe_cost) in [(-5i64, 1u64), (0, spec.limit()), (7, spec.limit() / 2 + 1)] {
                    prop_assert_eq!(
                        restored.earliest(now_ms + probe_offset_ms, probe_cost),
                        rate.earliest(now_ms + probe_offset_ms, probe_cost)
                    );
                }
            }
            // With spec changes, each grant was checked against its own spec by
            // the model; one final spec only describes an unchanged run.
            if !spec_changed {
                assert_no_interval_overflows(&model.grants, spec);
            }
        }

        /// Large limits and windows: exact retry times with many entries.
        #[test]
        fn retry_times_are_exact_with_large_limits(
            limit in 1u64..=1_000_000,
            window_ms in 1u64..=3000,
            arrivals in prop::collection::vec((0i64..200, 0u64..=1000), 1..60),
        ) {
            let spec = WindowSpec::new(limit, window_ms).unwrap();
            let mut rate = SlidingWindow::new(spec);
            let mut model = BruteForceModel::default();
            let mut now_ms = 0i64;
            for (time_step_ms, cost_per_mille) in arrivals {
                now_ms += time_step_ms;
                let cost = (limit * cost_per_mille / 1000).max(1);
                let expected_earliest_ms = model.earliest(now_ms, cost, spec);
                prop_assert_eq!(rate.earliest(now_ms, cost), Ok(expected_earliest_ms));
                // Grant at the retry time, as a deferred waiter would be.
                now_ms = expected_earliest_ms;
                let decision = rate.try_acquire(now_ms, cost).unwrap();
                prop_assert_eq!(granted_at(decision), now_ms);
                model.grants.push((now_ms, cost));
                model.latest_grant_ms = Some(now_ms);
            }
            assert_no_interval_overflows(&model.grants, spec);
        }
    }
}
