//! The waiting queue of one rate key: the pure core behind guarantees 2 and 6
//! of docs/architecture.md for rate limits. A job whose grant is not legal yet waits here;
//! it is deferred, never rejected.
//!
//! Waiters are ordered by priority (lower first), then enqueue time, then
//! ticket (so ties have one order on every owner). The head is never
//! overtaken: while the head cannot be granted nobody behind it is, even a
//! waiter whose own cost would fit. That keeps a large job from starving
//! behind a stream of small ones, and makes the head's grant time exact: it is
//! the time enough of the oldest grants leave the window
//! ([`RateQueue::next_wakeup`]).
//!
//! The owner drives the queue with an event loop: [`RateQueue::push`] (or
//! [`RateQueue::remove`], or a spec change) then [`RateQueue::pump`] then
//! [`RateQueue::next_wakeup`], and `pump` again at that time. A push or a
//! removal can change the head, so the wake-up must be recomputed after each.
//!
//! Callers must not grant from the same [`SlidingWindow`] outside the queue
//! while it has waiters, or they would overtake the head.
//!
//! Memory per waiter: one entry in each of two ordered maps (the order and the
//! ticket index), each holding the ticket, priority and enqueue time.

use std::collections::BTreeMap;

use super::window::{Decision, SlidingWindow, WindowError};

/// A job waiting for room in one rate window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Waiter<T> {
    pub ticket: T,
    /// Lower goes first.
    pub priority: u32,
    pub enqueued_at_us: i64,
    /// Units to acquire; must not exceed the window's limit to ever be granted.
    pub cost: u64,
}

/// A waiter that left the queue with its grant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueGrant<T> {
    pub waiter: Waiter<T>,
    /// The time the units were recorded in the window (see the window's clamp).
    pub granted_at_ms: i64,
}

/// A waiter's place in the queue; the field order is the queue order.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct QueuePlace<T> {
    priority: u32,
    enqueued_at_us: i64,
    ticket: T,
}

impl<T> QueuePlace<T> {
    fn into_waiter(self, cost: u64) -> Waiter<T> {
        Waiter {
            ticket: self.ticket,
            priority: self.priority,
            enqueued_at_us: self.enqueued_at_us,
            cost,
        }
    }
}

/// The waiters of one rate key. `T` is the ticket id.
#[derive(Debug, Clone)]
pub struct RateQueue<T: Ord + Clone> {
    cost_by_place: BTreeMap<QueuePlace<T>, u64>,
    /// Lets a ticket be found and removed in O(log n) without a scan.
    priority_and_enqueue_time_by_ticket: BTreeMap<T, (u32, i64)>,
}

impl<T: Ord + Clone> Default for RateQueue<T> {
    fn default() -> Self {
        RateQueue {
            cost_by_place: BTreeMap::new(),
            priority_and_enqueue_time_by_ticket: BTreeMap::new(),
        }
    }
}

impl<T: Ord + Clone> RateQueue<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.debug_assert_index_matches_order();
        self.cost_by_place.len()
    }

    pub fn is_empty(&self) -> bool {
        self.cost_by_place.is_empty()
    }

    pub fn contains(&self, ticket: &T) -> bool {
        self.priority_and_enqueue_time_by_ticket.contains_key(ticket)
    }

    /// Adds a waiter. Returns false and changes nothing if its ticket is
    /// already waiting: a redelivered acquire keeps its original place.
    /// O(log n).
    pub fn push(&mut self, waiter: Waiter<T>) -> bool {
        if self.contains(&waiter.ticket) {
            return false;
        }
        self.priority_and_enqueue_time_by_ticket
            .insert(waiter.ticket.clone(), (waiter.priority, waiter.enqueued_at_us));
        let place = QueuePlace {
            priority: waiter.priority,
            enqueued_at_us: waiter.enqueued_at_us,
            ticket: waiter.ticket,
        };
        self.cost_by_place.insert(place, waiter.cost);
        self.debug_assert_index_matches_order();
        true
    }

    /// Takes a waiter out (cancel, expiry, old attempt). O(log n).
    pub fn remove(&mut self, ticket: &T) -> Option<Waiter<T>> {
        let (priority, enqueued_at_us) = self.priority_and_enqueue_time_by_ticket.remove(ticket)?;
        let place = QueuePlace {
            priority,
            enqueued_at_us,
            ticket: ticket.clone(),
        };
        let removed = self.cost_by_place.remove_entry(&place);
        debug_assert!(removed.is_some(), "the ticket index and the order disagree");
        self.debug_assert_index_matches_order();
        removed.map(|(removed_place, cost)| removed_place.into_waiter(cost))
    }

    /// The waiter that goes next.
    pub fn head(&self) -> Option<Waiter<T>> {
        self.cost_by_place
            .first_key_value()
            .map(|(place, cost)| place.clone().into_waiter(*cost))
    }

    /// How many waiters are ahead of this ticket (0 for the head). O(number
    /// ahead): meant for introspection, not for the decision path.
    pub fn position(&self, ticket: &T) -> Option<usize> {
        let (priority, enqueued_at_us) = self.priority_and_enqueue_time_by_ticket.get(ticket)?;
        let place = QueuePlace {
            priority: *priority,
            enqueued_at_us: *enqueued_at_us,
            ticket: ticket.clone(),
        };
        Some(self.cost_by_place.range(..place).count())
    }

    /// The waiters in queue order, e.g. for persistence or introspection.
    pub fn iter(&self) -> impl Iterator<Item = Waiter<T>> + '_ {
        self.cost_by_place
            .iter()
            .map(|(place, cost)| place.clone().into_waiter(*cost))
    }

    /// Grants from the head, in order, for as long as the head is legal at
    /// `now_ms`, and stops at the first head that is not: nobody behind it is
    /// granted. A head whose cost exceeds the window's limit also stops the
    /// queue and stays at the head; [`RateQueue::next_wakeup`] reports it.
    pub fn pump(&mut self, window: &mut SlidingWindow, now_ms: i64) -> Vec<QueueGrant<T>> {
        let mut granted = Vec::new();
        while let Some(head_entry) = self.cost_by_place.first_entry() {
            let head_cost = *head_entry.get();
            let granted_at_ms = match window.try_acquire(now_ms, head_cost) {
                Ok(Decision::Granted { at_ms, .. }) => at_ms,
                Ok(Decision::Deferred { .. }) => break,
                // The only error: the head's cost exceeds the limit, so it can
                // never be granted under it. It keeps its place (nothing is
                // dropped) until the limit is raised or the caller removes it.
                Err(_) => break,
            };
            let (head_place, cost) = head_entry.remove_entry();
            let index_entry = self.priority_and_enqueue_time_by_ticket.remove(&head_place.ticket);
            debug_assert!(index_entry.is_some(), "the ticket index and the order disagree");
            granted.push(QueueGrant {
                waiter: head_place.into_waiter(cost),
                granted_at_ms,
            });
        }
        self.debug_assert_index_matches_order();
        granted
    }

    /// The exact time the head becomes legal, if nothing else is granted from
    /// the window before: `Ok(None)` for an empty queue, the decision time
    /// itself (`now_ms`, or the latest grant's time if the clock is behind it)
    /// if [`RateQueue::pump`] would grant the head now, and
    /// `Err(CostExceedsLimit)` if the head can never be granted under the
    /// current limit (take it out with [`RateQueue::head`] and
    /// [`RateQueue::remove`], or raise the limit; until then the queue waits).
    pub fn next_wakeup(&self, window: &SlidingWindow, now_ms: i64) -> Result<Option<i64>, WindowError> {
        let Some((_, head_cost)) = self.cost_by_place.first_key_value() else {
            return Ok(None);
        };
        window.earliest(now_ms, *head_cost).map(Some)
    }

    fn debug_assert_index_matches_order(&self) {
        debug_assert_eq!(self.cost_by_place.len(), self.priority_and_enqueue_time_by_ticket.len());
    }
}

#[cfg(test)]
mod tests {
    use super::super::window::WindowSpec;
    use super::*;
    use proptest::prelude::*;

    fn window(limit: u64, window_ms: u64) -> SlidingWindow {
        SlidingWindow::new(WindowSpec::new(limit, window_ms).unwrap())
    }

    fn waiter(ticket: u32, priority: u32, enqueued_at_us: i64, cost: u64) -> Waiter<u32> {
        Waiter {
            ticket,
            priority,
            enqueued_at_us,
            cost,
        }
    }

    fn granted(grants: &[QueueGrant<u32>]) -> Vec<(u32, i64)> {
        grants
            .iter()
            .map(|grant| (grant.waiter.ticket, grant.granted_at_ms))
            .collect()
    }

    #[test]
    fn waiters_go_by_priority_then_enqueue_time_then_ticket() {
        let mut queue = RateQueue::new();
        assert!(queue.push(waiter(1, 5, 100, 1)));
        assert!(queue.push(waiter(2, 1, 300, 1)));
        assert!(queue.push(waiter(3, 1, 200, 1)));
        assert!(queue.push(waiter(9, 1, 200, 1)));
        assert!(queue.push(waiter(4, 1, 200, 1)));
        let order: Vec<u32> = queue.iter().map(|waiting| waiting.ticket).collect();
        assert_eq!(order, vec![3, 4, 9, 2, 1]);
        assert_eq!(queue.position(&3), Some(0));
        assert_eq!(queue.position(&9), Some(2));
        assert_eq!(queue.position(&1), Some(4));
        assert_eq!(queue.position(&7), None);
        let mut rate = window(10, 1000);
        assert_eq!(
            granted(&queue.pump(&mut rate, 0)),
            vec![(3, 0), (4, 0), (9, 0), (2, 0), (1, 0)]
        );
        assert!(queue.is_empty());
    }

    #[test]
    fn the_head_is_not_overtaken_by_a_waiter_that_would_fit() {
        let mut rate = window(3, 1000);
        granted_at_zero(&mut rate, 2);
        let mut queue = RateQueue::new();
        queue.push(waiter(1, 0, 10, 3));
        queue.push(waiter(2, 0, 20, 1));
        // One unit of room: ticket 2 would fit, but the head needs three.
        assert!(queue.pump(&mut rate, 10).is_empty());
        assert_eq!(queue.next_wakeup(&rate, 10), Ok(Some(1000)));
        assert_eq!(queue.pump(&mut rate, 999), vec![]);
        assert_eq!(granted(&queue.pump(&mut rate, 1000)), vec![(1, 1000)]);
        assert_eq!(queue.next_wakeup(&rate, 1000), Ok(Some(2000)));
        assert_eq!(granted(&queue.pump(&mut rate, 2000)), vec![(2, 2000)]);
        assert_eq!(queue.next_wakeup(&rate, 2000), Ok(None));
    }

    fn granted_at_zero(rate: &mut SlidingWindow, cost: u64) {
        assert_eq!(
            rate.try_acquire(0, cost)
                .map(|decision| matches!(decision, Decision::Granted { at_ms: 0, .. })),
            Ok(true)
        );
    }

    #[test]
    fn pump_grants_everything_that_fits_in_order_at_once() {
        let mut rate = window(3, 1000);
        let mut queue = RateQueue::new();
        for ticket in 1..=5 {
            queue.push(waiter(ticket, 0, i64::from(ticket), 1));
        }
        assert_eq!(granted(&queue.pump(&mut rate, 0)), vec![(1, 0), (2, 0), (3, 0)]);
        assert_eq!(queue.next_wakeup(&rate, 0), Ok(Some(1000)));
        assert_eq!(granted(&queue.pump(&mut rate, 1000)), vec![(4, 1000), (5, 1000)]);
    }

    #[test]
    fn a_higher_priority_arrival_becomes_the_head_and_moves_the_wakeup() {
        let mut rate = window(3, 1000);
        for at_ms in [0, 10, 20] {
            assert!(matches!(rate.try_acquire(at_ms, 1), Ok(Decision::Granted { .. })));
        }
        let mut queue = RateQueue::new();
        queue.push(waiter(1, 5, 30_000, 1));
        assert_eq!(queue.next_wakeup(&rate, 30), Ok(Some(1000)));
        queue.push(waiter(2, 0, 40_000, 3));
        assert_eq!(queue.next_wakeup(&rate, 40), Ok(Some(1020)));
        assert!(queue.pump(&mut rate, 1000).is_empty());
        assert_eq!(granted(&queue.pump(&mut rate, 1020)), vec![(2, 1020)]);
        assert_eq!(queue.next_wakeup(&rate, 1020), Ok(Some(2020)));
    }

    #[test]
    fn removal_by_ticket_updates_the_head_and_positions() {
        let mut rate = window(1, 100);
        granted_at_zero(&mut rate, 1);
        let mut queue = RateQueue::new();
        queue.push(waiter(1, 0, 1, 1));
        queue.push(waiter(2, 0, 2, 1));
        queue.push(waiter(3, 0, 3, 1));
        assert_eq!(queue.remove(&2), Some(waiter(2, 0, 2, 1)));
        assert_eq!(queue.remove(&2), None);
        assert_eq!(queue.position(&3), Some(1));
        assert_eq!(queue.remove(&1), Some(waiter(1, 0, 1, 1)));
        assert_eq!(queue.head(), Some(waiter(3, 0, 3, 1)));
        assert_eq!(queue.len(), 1);
        assert_eq!(granted(&queue.pump(&mut rate, 100)), vec![(3, 100)]);
        assert!(!queue.contains(&3));
    }

    #[test]
    fn a_duplicate_push_keeps_the_original_place() {
        let mut queue = RateQueue::new();
        assert!(queue.push(waiter(1, 3, 100, 1)));
        assert!(queue.push(waiter(2, 3, 200, 1)));
        assert!(!queue.push(waiter(2, 0, 0, 5)));
        assert_eq!(queue.len(), 2);
        assert_eq!(queue.position(&2), Some(1));
        assert_eq!(queue.head(), Some(waiter(1, 3, 100, 1)));
    }

    #[test]
    fn a_head_above_the_limit_blocks_the_queue_until_removed_or_the_limit_rises() {
        let mut rate = window(5, 100);
        let mut queue = RateQueue::new();
        queue.push(waiter(1, 0, 1, 4));
        queue.push(waiter(2, 0, 2, 1));
        rate.set_spec(WindowSpec::new(3, 100).unwrap());
        assert!(queue.pump(&mut rate, 0).is_empty());
        assert_eq!(
            queue.next_wakeup(&rate, 0),
            Err(WindowError::CostExceedsLimit { cost: 4, limit: 3 })
        );
        assert_eq!(queue.len(), 2);
        rate.set_spec(WindowSpec::new(4, 100).unwrap());
        assert_eq!(queue.next_wakeup(&rate, 0), Ok(Some(0)));
        assert_eq!(granted(&queue.pump(&mut rate, 0)), vec![(1, 0)]);
        queue.push(waiter(3, 0, 0, 9));
        assert_eq!(
            queue.next_wakeup(&rate, 0),
            Err(WindowError::CostExceedsLimit { cost: 9, limit: 4 })
        );
        let blocked_head = queue.head().map(|head| head.ticket);
        assert_eq!(blocked_head, Some(3));
        queue.remove(&3);
        assert_eq!(queue.next_wakeup(&rate, 0), Ok(Some(100)));
    }

    #[test]
    fn a_clock_behind_the_latest_grant_grants_at_the_latest_grant() {
        let mut rate = window(2, 100);
        assert!(matches!(rate.try_acquire(500, 1), Ok(Decision::Granted { .. })));
        let mut queue = RateQueue::new();
        queue.push(waiter(1, 0, 1, 1));
        queue.push(waiter(2, 0, 2, 1));
        assert_eq!(granted(&queue.pump(&mut rate, 450)), vec![(1, 500)]);
        assert_eq!(queue.next_wakeup(&rate, 450), Ok(Some(600)));
    }

    #[test]
    fn removal_from_a_large_queue_uses_the_index() {
        let waiter_count: u32 = 100_000;
        let mut queue = RateQueue::new();
        for ticket in 0..waiter_count {
            // Scatter priorities so removal order differs from queue order.
            queue.push(waiter(ticket, ticket.wrapping_mul(2_654_435_761) % 7, 0, 1));
        }
        for ticket in (0..waiter_count).rev().step_by(2) {
            assert!(queue.remove(&ticket).is_some());
        }
        assert_eq!(queue.len(), usize::try_from(waiter_count / 2).unwrap());
        assert!(queue.iter().all(|waiting| waiting.ticket % 2 == 0));
    }

    // ----- the event loop against a millisecond-by-millisecond oracle -----

    #[derive(Debug, Clone)]
    enum Event {
        Arrive {
            time_step_ms: i64,
            priority: u32,
            enqueue_jitter_us: i64,
            cost: u64,
        },
        Cancel {
            time_step_ms: i64,
            ticket_pick: u32,
        },
        SetSpec {
            time_step_ms: i64,
            limit: u64,
            window_shrink_per_mille: u64,
        },
    }

    impl Event {
        fn time_step_ms(&self) -> i64 {
            match self {
                Event::Arrive { time_step_ms, .. }
                | Event::Cancel { time_step_ms, .. }
                | Event::SetSpec { time_step_ms, .. } => *time_step_ms,
            }
        }
    }

    /// Times mostly move forward; some steps go back to exercise the clamp.
    fn time_step_strategy() -> impl Strategy<Value = i64> {
        prop_oneof![8 => 0i64..25, 1 => -40i64..0]
    }

    fn event_strategy(max_cost: u64) -> impl Strategy<Value = Event> {
        prop_oneof![
            12 => (time_step_strategy(), 0u32..3, 0i64..3000, 0..=max_cost).prop_map(
                |(time_step_ms, priority, enqueue_jitter_us, cost)| Event::Arrive {
                    time_step_ms, priority, enqueue_jitter_us, cost,
                }
            ),
            2 => (time_step_strategy(), any::<u32>()).prop_map(|(time_step_ms, ticket_pick)| {
                Event::Cancel { time_step_ms, ticket_pick }
            }),
            1 => (time_step_strategy(), max_cost..=12, 0u64..=500).prop_map(
                |(time_step_ms, limit, window_shrink_per_mille)| Event::SetSpec {
                    time_step_ms, limit, window_shrink_per_mille,
                }
            ),
        ]
    }

    fn scenario_strategy() -> impl Strategy<Value = (u64, u64, u64, Vec<Event>)> {
        (1u64..=6).prop_flat_map(|max_cost| {
            (
                Just(max_cost),
                max_cost..=12,
                1u64..=60,
                prop::collection::vec(event_strategy(max_cost), 1..70),
            )
        })
    }

    /// The naive reference: all grants ever made, a plain list of waiters, and
    /// legality checked by summing the look-back of every candidate millisecond.
    #[derive(Debug, Default)]
    struct Oracle {
        grants: Vec<(i64, u64)>,
        waiting: Vec<Waiter<u32>>,
        latest_grant_ms: Option<i64>,
        /// The last millisecond at which the oracle granted what it could.
        pumped_through_ms: Option<i64>,
        granted: Vec<(u32, i64)>,
    }

    impl Oracle {
        fn is_legal(&self, at_ms: i64, cost: u64, spec: WindowSpec) -> bool {
            let window_ms = i64::try_from(spec.window_ms()).unwrap();
            let units_in_window: u64 = self
                .grants
                .iter()
                .filter(|(granted_ms, _)| *granted_ms > at_ms - window_ms && *granted_ms <= at_ms)
                .map(|(_, units)| units)
                .sum();
            units_in_window + cost <= spec.limit()
        }

        fn head_index(&self) -> Option<usize> {
            (0..self.waiting.len()).min_by_key(|index| {
                let waiting = &self.waiting[*index];
                (waiting.priority, waiting.enqueued_at_us, waiting.ticket)
            })
        }

        fn grant_heads_at(&mut self, at_ms: i64, spec: WindowSpec) {
            let decision_ms = self.latest_grant_ms.map_or(at_ms, |latest| at_ms.max(latest));
            while let Some(head_index) = self.head_index() {
                let head_cost = self.waiting[head_index].cost;
                if !self.is_legal(decision_ms, head_cost, spec) {
                    break;
                }
                let head = self.waiting.remove(head_index);
                if head.cost > 0 {
                    self.grants.push((decision_ms, head.cost));
                    self.latest_grant_ms = Some(decision_ms);
                }
                self.granted.push((head.ticket, decision_ms));
            }
            // A clock that went back rewinds the scan too, as it rewinds the
            // caller's next pump.
            self.pumped_through_ms = Some(decision_ms);
        }

        /// Every millisecond after the last pump up to `until_ms`.
        fn scan_until(&mut self, until_ms: i64, spec: WindowSpec) {
            let Some(pumped_through_ms) = self.pumped_through_ms else {
                return;
            };
            let mut candidate_ms = pumped_through_ms + 1;
            while candidate_ms <= until_ms && !self.waiting.is_empty() {
                self.grant_heads_at(candidate_ms, spec);
                candidate_ms += 1;
            }
        }
    }

    /// Everything the system under test granted, with the checks (a) and (c).
    #[derive(Debug, Default)]
    struct GrantLog {
        granted: Vec<(u32, i64)>,
        /// Each grant with the spec it was made under.
        grants_with_spec: Vec<(i64, u64, WindowSpec)>,
    }

    impl GrantLog {
        fn record(&mut self, grants: Vec<QueueGrant<u32>>, spec: WindowSpec, waiting: &mut BTreeMap<u32, Waiter<u32>>) {
            for grant in grants {
                // (c) the granted waiter is the first, in queue order, of the
                // waiters present: nobody overtook it.
                let expected_head = waiting
                    .values()
                    .min_by_key(|present| (present.priority, present.enqueued_at_us, present.ticket))
                    .map(|present| present.ticket);
                assert_eq!(Some(grant.waiter.ticket), expected_head);
                let removed = waiting.remove(&grant.waiter.ticket);
                assert_eq!(removed.as_ref(), Some(&grant.waiter));
                // Zero-cost grants record nothing, so only units are ordered in time.
                let latest_units_ms = self
                    .grants_with_spec
                    .iter()
                    .filter(|(_, cost, _)| *cost > 0)
                    .map(|(at_ms, _, _)| *at_ms)
                    .max();
                if let Some(latest_units_ms) = latest_units_ms.filter(|_| grant.waiter.cost > 0) {
                    assert!(grant.granted_at_ms >= latest_units_ms, "grant times go back");
                }
                self.granted.push((grant.waiter.ticket, grant.granted_at_ms));
                self.grants_with_spec
                    .push((grant.granted_at_ms, grant.waiter.cost, spec));
                self.assert_latest_grant_is_legal();
            }
        }

        /// (a) The look-back of each grant, under its own spec, holds at most
        /// the limit; with one spec this is "no interval [s, s + W) overflows".
        fn assert_latest_grant_is_legal(&self) {
            let Some((granted_at_ms, _, spec)) = self.grants_with_spec.last() else {
                return;
            };
            let window_ms = i64::try_from(spec.window_ms()).unwrap();
            let units_in_window: u64 = self
                .grants_with_spec
                .iter()
                .filter(|(at_ms, _, _)| *at_ms > granted_at_ms - window_ms)
                .map(|(_, cost, _)| cost)
                .sum();
            assert!(
                units_in_window <= spec.limit(),
                "{units_in_window} units in the window ending at {granted_at_ms}"
            );
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        /// An owner's event loop: pump at every event and at every wake-up. The
        /// grants must equal the oracle's exactly (b), every grant is legal (a)
        /// and goes to the head (c), every wake-up grants something (it is
        /// exact, not early), and every waiter not cancelled is granted (d).
        #[test]
        fn the_event_loop_grants_exactly_like_a_brute_force_oracle(
            (_max_cost, initial_limit, initial_window_ms, events) in scenario_strategy(),
            start_ms in -500i64..500,
        ) {
            let mut spec = WindowSpec::new(initial_limit, initial_window_ms).unwrap();
            let mut rate = SlidingWindow::new(spec);
            let mut queue: RateQueue<u32> = RateQueue::new();
            let mut oracle = Oracle::default();
            let mut log = GrantLog::default();
            let mut waiting: BTreeMap<u32, Waiter<u32>> = BTreeMap::new();
            let mut cancelled: Vec<u32> = Vec::new();
            let mut next_ticket: u32 = 0;
            let mut clock_ms = start_ms;
            let mut wakeup_ms: Option<i64> = None;

            for event in events {
                clock_ms += event.time_step_ms();
                while let Some(due_ms) = wakeup_ms.filter(|due_ms| *due_ms <= clock_ms) {
                    let grants = queue.pump(&mut rate, due_ms);
                    prop_assert!(!grants.is_empty(), "woke at {} for nothing", due_ms);
                    log.record(grants, spec, &mut waiting);
                    wakeup_ms = queue.next_wakeup(&rate, due_ms).unwrap();
                }
                oracle.scan_until(clock_ms, spec);

                match event {
                    Event::Arrive { priority, enqueue_jitter_us, cost, .. } => {
                        let arrival = Waiter {
                            ticket: next_ticket,
                            priority,
                            enqueued_at_us: clock_ms * 1000 + enqueue_jitter_us,
                            cost,
                        };
                        next_ticket += 1;
                        prop_assert!(queue.push(arrival.clone()));
                        prop_assert!(!queue.push(arrival.clone()));
                        waiting.insert(arrival.ticket, arrival.clone());
                        oracle.waiting.push(arrival);
                    }
                    Event::Cancel { ticket_pick, .. } => {
                        let ticket = if next_ticket == 0 { 0 } else { ticket_pick % next_ticket };
                        let removed = queue.remove(&ticket);
                        prop_assert_eq!(removed.as_ref(), waiting.get(&ticket));
                        if removed.is_some() {
                            waiting.remove(&ticket);
                            oracle.waiting.retain(|present| present.ticket != ticket);
                            cancelled.push(ticket);
                        }
                    }
                    Event::SetSpec { limit, window_shrink_per_mille, .. } => {
                        // Windows only shrink here: a longer window does not see
                        // evicted history (documented in window.rs), which the
                        // never-forgetting oracle would.
                        let shorter_window_ms =
                            (spec.window_ms() * (1000 - window_shrink_per_mille) / 1000).max(1);
                        spec = WindowSpec::new(limit, shorter_window_ms).unwrap();
                        rate.set_spec(spec);
                    }
                }
                let grants = queue.pump(&mut rate, clock_ms);
                log.record(grants, spec, &mut waiting);
                wakeup_ms = queue.next_wakeup(&rate, clock_ms).unwrap();
                oracle.grant_heads_at(clock_ms, spec);

                prop_assert_eq!(queue.len(), waiting.len());
                let mut expected_order: Vec<&Waiter<u32>> = waiting.values().collect();
                expected_order.sort_by_key(|present| (present.priority, present.enqueued_at_us, present.ticket));
                for (expected_position, present) in expected_order.iter().enumerate() {
                    prop_assert_eq!(queue.position(&present.ticket), Some(expected_position));
                }
                prop_assert_eq!(&log.granted, &oracle.granted);
            }

            // Drain: with no more arrivals, every waiter is granted in time.
            while let Some(due_ms) = wakeup_ms {
                let grants = queue.pump(&mut rate, due_ms);
                prop_assert!(!grants.is_empty(), "woke at {} for nothing", due_ms);
                log.record(grants, spec, &mut waiting);
                wakeup_ms = queue.next_wakeup(&rate, due_ms).unwrap();
            }
            if let Some(last_grant_ms) = log.granted.last().map(|(_, at_ms)| *at_ms) {
                oracle.scan_until(last_grant_ms, spec);
            }
            prop_assert_eq!(&log.granted, &oracle.granted);
            prop_assert!(oracle.waiting.is_empty());
            // (d) nothing dropped: every ticket is granted once or was cancelled.
            prop_assert!(queue.is_empty());
            prop_assert!(waiting.is_empty());
            let mut accounted: Vec<u32> = log.granted.iter().map(|(ticket, _)| *ticket).chain(cancelled).collect();
            accounted.sort_unstable();
            prop_assert_eq!(accounted, (0..next_ticket).collect::<Vec<u32>>());
        }
    }
}
