//! Which offset of each partition may be committed: everything below the
//! oldest message not yet dealt with. Messages finish out of order (one job
//! runs, the next is handed off); the committed offset only moves past a
//! message once every message before it is done, so a crash re-delivers
//! what was not done and never skips it.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// (topic, partition)
pub(crate) type PartitionId = (Arc<str>, i32);

#[derive(Debug, Default)]
struct PartitionOffsets {
    in_flight: BTreeSet<i64>,
    /// Given up on: never done here, so the position never passes them.
    abandoned: BTreeSet<i64>,
    /// One past the highest offset finished so far.
    finished_end: Option<i64>,
    /// The last position returned for storing.
    stored: Option<i64>,
}

impl PartitionOffsets {
    /// The offset to commit now: the oldest unfinished one, or one past the
    /// newest finished one.
    fn position(&self) -> Option<i64> {
        let oldest_in_flight = self.in_flight.first().copied();
        let oldest_abandoned = self.abandoned.first().copied();
        match (oldest_in_flight, oldest_abandoned) {
            (Some(left), Some(right)) => Some(left.min(right)),
            (Some(oldest), None) | (None, Some(oldest)) => Some(oldest),
            (None, None) => self.finished_end,
        }
    }
}

#[derive(Debug, Default)]
pub(crate) struct OffsetTracker {
    partitions: HashMap<PartitionId, PartitionOffsets>,
}

impl OffsetTracker {
    /// A message was received and is not done yet.
    pub fn begin(&mut self, partition: &PartitionId, offset: i64) {
        self.partitions
            .entry(partition.clone())
            .or_default()
            .in_flight
            .insert(offset);
    }

    /// The message is done. Returns the new position to store, when it moved.
    pub fn finish(&mut self, partition: &PartitionId, offset: i64) -> Option<i64> {
        let state = self.partitions.get_mut(partition)?;
        if !state.in_flight.remove(&offset) {
            return None;
        }
        state.abandoned.remove(&offset);
        state.finished_end = Some(state.finished_end.map_or(offset + 1, |end| end.max(offset + 1)));
        let position = state.position()?;
        if state.stored == Some(position) {
            return None;
        }
        state.stored = Some(position);
        Some(position)
    }

    /// The message will not be done by this process (the worker gave up on
    /// it): the position never moves past it, so it is delivered again.
    pub fn abandon(&mut self, partition: &PartitionId, offset: i64) {
        if let Some(state) = self.partitions.get_mut(partition) {
            if state.in_flight.remove(&offset) {
                state.abandoned.insert(offset);
            }
        }
    }

    /// Messages received and not done.
    pub fn in_flight(&self) -> usize {
        self.partitions.values().map(|state| state.in_flight.len()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn partition() -> PartitionId {
        (Arc::from("topic"), 0)
    }

    #[test]
    fn the_position_waits_for_the_oldest_unfinished_message() {
        let mut tracker = OffsetTracker::default();
        let id = partition();
        for offset in 10..14 {
            tracker.begin(&id, offset);
        }
        // 11 and 12 finish first: 10 still runs, nothing may be committed past it.
        assert_eq!(tracker.finish(&id, 11), Some(10));
        assert_eq!(tracker.finish(&id, 12), None);
        assert_eq!(tracker.finish(&id, 10), Some(13));
        assert_eq!(tracker.finish(&id, 13), Some(14));
        assert_eq!(tracker.in_flight(), 0);
    }

    #[test]
    fn finishing_twice_or_unknown_offsets_changes_nothing() {
        let mut tracker = OffsetTracker::default();
        let id = partition();
        tracker.begin(&id, 5);
        assert_eq!(tracker.finish(&id, 5), Some(6));
        assert_eq!(tracker.finish(&id, 5), None);
        assert_eq!(tracker.finish(&(Arc::from("other"), 0), 1), None);
    }

    #[test]
    fn redelivery_after_a_rebalance_moves_the_position_back_to_the_unfinished_message() {
        let mut tracker = OffsetTracker::default();
        let id = partition();
        tracker.begin(&id, 20);
        assert_eq!(tracker.finish(&id, 20), Some(21));
        // The partition came back and re-delivers from 18.
        tracker.begin(&id, 18);
        tracker.begin(&id, 19);
        assert_eq!(tracker.finish(&id, 19), Some(18));
        assert_eq!(tracker.finish(&id, 18), Some(21));
    }

    #[test]
    fn an_abandoned_message_holds_the_position() {
        let mut tracker = OffsetTracker::default();
        let id = partition();
        tracker.begin(&id, 1);
        tracker.begin(&id, 2);
        tracker.abandon(&id, 1);
        assert_eq!(tracker.finish(&id, 2), Some(1));
        assert_eq!(tracker.in_flight(), 0);
    }
}
