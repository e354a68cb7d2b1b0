//! Shadow mode: a limit that is measured, not enforced. Its jobs are granted
//! at once; this simulation works out what the enforced limit would have
//! done — who would hold and wait now, how long each job would have waited.
//!
//! It runs on virtual time. A ticket's hold time is what it really held (its
//! release minus its real grant, which in shadow mode is its arrival). A
//! simulated holder frees its simulated slot at its simulated grant plus that
//! hold time, and the next simulated waiter (priority, then enqueue time) is
//! granted then, or at its arrival if later. With the same arrivals and hold
//! times, the simulated waits are the waits the enforced limit would have
//! had (exactly, for a key whose jobs hold it for as long whether or not they
//! waited first). Kept in memory only: a new owner starts the simulation
//! afresh from the tickets that arrive after it.

use sluice_common::hash::HashMap;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};

use sluice_common::core::CompactTraceContext;

use super::TicketKey;

/// A simulated grant: the ticket would have waited `waited_ms`.
#[derive(Clone, Debug, PartialEq)]
pub struct WouldHaveWaited {
    pub ticket: TicketKey,
    pub waited_ms: i64,
    /// When it would have been granted (virtual ms).
    pub granted_at_ms: i64,
    pub trace: CompactTraceContext,
}

#[derive(Clone, Debug)]
struct SimWaiter {
    ticket: TicketKey,
    arrived_at_ms: i64,
    /// Known once the real ticket is released (it may end before the
    /// simulation would have granted it).
    held_ms: Option<i64>,
    trace: CompactTraceContext,
}

#[derive(Clone, Debug)]
struct SimHolder {
    /// Simulated grant (virtual ms).
    granted_at_ms: i64,
    arrived_at_ms: i64,
}

/// Totals since the key's owner loaded it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ShadowTotals {
    pub would_have_waited_count: u64,
    pub would_have_waited_ms_total: i64,
    pub would_have_waited_ms_max: i64,
    pub would_have_exceeded: u64,
}

/// One key's simulation. `O` orders waiters (the key's queue order).
#[derive(Debug)]
pub struct ShadowSim<O> {
    holders: HashMap<TicketKey, SimHolder>,
    waiters: BTreeMap<O, SimWaiter>,
    /// Where each waiting ticket is in `waiters`.
    waiting: HashMap<TicketKey, O>,
    /// Simulated slots freed and not taken again, by when (virtual ms).
    free: BinaryHeap<Reverse<i64>>,
    pub totals: ShadowTotals,
}

impl<O: Ord + Clone> Default for ShadowSim<O> {
    fn default() -> Self {
        ShadowSim {
            holders: HashMap::default(),
            waiters: BTreeMap::new(),
            waiting: HashMap::default(),
            free: BinaryHeap::new(),
            totals: ShadowTotals::default(),
        }
    }
}

impl<O: Ord + Clone> ShadowSim<O> {
    pub fn would_hold(&self) -> usize {
        self.holders.len()
    }

    pub fn would_wait(&self) -> usize {
        self.waiters.len()
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty() && self.waiters.is_empty()
    }

    /// A ticket arrives (and is really granted at once).
    pub fn arrive(&mut self, ticket: TicketKey, order: O, now_ms: i64, trace: CompactTraceContext) {
        if self.holders.contains_key(&ticket) || self.waiting.contains_key(&ticket) {
            return;
        }
        self.waiting.insert(ticket.clone(), order.clone());
        self.waiters.insert(
            order,
            SimWaiter {
                ticket,
                arrived_at_ms: now_ms,
                held_ms: None,
                trace,
            },
        );
    }

    /// The real ticket is released at `now_ms`: its hold time is known.
    pub fn release(&mut self, ticket: &TicketKey, now_ms: i64) {
        if let Some(holder) = self.holders.remove(ticket) {
            let held_ms = now_ms.saturating_sub(holder.arrived_at_ms).max(0);
            self.free.push(Reverse(holder.granted_at_ms.saturating_add(held_ms)));
        } else if let Some(order) = self.waiting.get(ticket) {
            if let Some(waiter) = self.waiters.get_mut(order) {
                waiter.held_ms = Some(now_ms.saturating_sub(waiter.arrived_at_ms).max(0));
            }
        }
    }

    /// A real grant took the real holders to `holders` against `max`.
    pub fn real_grant(&mut self, holders: usize, max: u32) -> bool {
        let exceeded = holders > usize::try_from(max).unwrap_or(usize::MAX);
        if exceeded {
            self.totals.would_have_exceeded += 1;
        }
        exceeded
    }

    /// Grant simulated waiters while the simulated key has room under `max`;
    /// returns the simulated grants.
    pub fn pump(&mut self, max: u32) -> Vec<WouldHaveWaited> {
        let max = usize::try_from(max).unwrap_or(usize::MAX);
        let mut granted = Vec::new();
        while self.holders.len() < max {
            let Some((_, waiter)) = self.waiters.pop_first() else {
                break;
            };
            self.waiting.remove(&waiter.ticket);
            let slot_free_at = self.free.pop().map_or(i64::MIN, |Reverse(at)| at);
            let granted_at_ms = waiter.arrived_at_ms.max(slot_free_at);
            let waited_ms = granted_at_ms - waiter.arrived_at_ms;
            self.totals.would_have_waited_count += 1;
            self.totals.would_have_waited_ms_total = self.totals.would_have_waited_ms_total.saturating_add(waited_ms);
            self.totals.would_have_waited_ms_max = self.totals.would_have_waited_ms_max.max(waited_ms);
            match waiter.held_ms {
                // Already released: its slot frees at once in the simulation.
                Some(held_ms) => self.free.push(Reverse(granted_at_ms.saturating_add(held_ms))),
                None => {
                    self.holders.insert(
                        waiter.ticket.clone(),
                        SimHolder {
                            granted_at_ms,
                            arrived_at_ms: waiter.arrived_at_ms,
                        },
                    );
                }
            }
            granted.push(WouldHaveWaited {
                ticket: waiter.ticket,
                waited_ms,
                granted_at_ms,
                trace: waiter.trace,
            });
        }
        // Slots beyond the max are never taken (the max was lowered): keep
        // the earliest free ones.
        if self.free.len() > max {
            let mut times: Vec<i64> = self.free.drain().map(|Reverse(at)| at).collect();
            times.sort_unstable();
            times.truncate(max);
            self.free = times.into_iter().map(Reverse).collect();
        }
        granted
    }

    /// The key is enforced again: the simulation stops (the totals stay).
    pub fn stop(&mut self) {
        self.holders.clear();
        self.waiters.clear();
        self.waiting.clear();
        self.free.clear();
    }
}

#[cfg(test)]
mod tests;
