//! The wake-up protocol between the device's timer task and the queue pairs
//! whose deadlines move (ACK timeouts, RNR waits, pacing).
//!
//! The timer task scans every QP's deadline and sleeps until the earliest; a
//! QP that sets an earlier deadline than the one the task sleeps to must wake
//! it. Doing that check against the target the task stored at the end of its
//! *previous* scan loses wake-ups: a deadline set after the scan read the
//! QP's old one, but before the task stored its new target, compares against
//! the stale (past) target, sends no wake-up, and the task then sleeps to a
//! target that does not include it. A QP waiting out an RNR NAK has nothing
//! else to wake it, so it stalled for good (CI's `ib_send_bw -r 2` capture
//! against rxe: rdmx went silent after two RNR cycles).
//!
//! Here the task resets the target before it scans, and both sides lower it
//! with `fetch_min` (sequentially consistent): a deadline the scan missed was
//! stored after the scan read it, so its `fetch_min` follows the reset and
//! either wakes the task or finds a target no later than itself.

use std::sync::atomic::{AtomicU64, Ordering::SeqCst};

/// The instant (device nanoseconds) the timer task sleeps to.
#[derive(Debug)]
pub(crate) struct TimerTarget(AtomicU64);

impl TimerTarget {
    /// No target: the task sleeps until woken.
    pub(crate) fn new() -> Self {
        TimerTarget(AtomicU64::new(u64::MAX))
    }

    /// A QP's deadline became `deadline` (already stored where the scan
    /// reads it). Returns whether the timer task must be woken.
    pub(crate) fn lower(&self, deadline: u64) -> bool {
        deadline < self.0.fetch_min(deadline, SeqCst)
    }

    /// A QP's deadline became `deadline`, of which only `urgent` must be
    /// kept (a held ACK's release may wait for the next pass the task makes
    /// anyway, as long as there is one: a task sleeping with no target is
    /// woken for it). Returns when the timer task must wake (the deadline
    /// that lowered its target), or `None` if its target already does.
    pub(crate) fn lower_lazily(&self, deadline: u64, urgent: u64) -> Option<u64> {
        if urgent <= deadline {
            return self.lower(deadline).then_some(deadline);
        }
        if self.lower(urgent) {
            return Some(urgent);
        }
        // The task sleeps to a target (it will scan, and see `deadline`),
        // or to none: then it must hear of this one.
        self.0
            .compare_exchange(u64::MAX, deadline, SeqCst, SeqCst)
            .is_ok()
            .then_some(deadline)
    }

    /// The timer task starts a scan of the QPs' deadlines.
    pub(crate) fn begin_scan(&self) {
        self.0.store(u64::MAX, SeqCst);
    }

    /// The scan found `earliest`; returns the instant to sleep to (earlier
    /// when a QP lowered the target during the scan).
    pub(crate) fn end_scan(&self, earliest: u64) -> u64 {
        self.0.fetch_min(earliest, SeqCst).min(earliest)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The interleaving that lost the wake-up: the previous target is in the
    /// past, the scan reads the QP's old deadline (none), then the QP sets a
    /// new one before the scan ends.
    #[test]
    fn a_deadline_set_during_a_scan_is_never_lost() {
        let t = TimerTarget::new();
        t.begin_scan();
        assert_eq!(t.end_scan(100), 100, "the previous scan's target");
        // The next scan (at a time past 100) reads the QP's deadline: none.
        t.begin_scan();
        let seen_by_scan = u64::MAX;
        // The QP now waits for an RNR NAK's delay, until 500.
        let woken = t.lower(500);
        let sleep_to = t.end_scan(seen_by_scan);
        assert!(
            woken || sleep_to <= 500,
            "the task would sleep to {sleep_to} without being woken"
        );
    }

    /// A held ACK's release (`deadline`, before the QP's `urgent` one)
    /// wakes the task only when it sleeps with no target at all; an urgent
    /// deadline before the target still wakes it.
    #[test]
    fn a_lazy_deadline_wakes_only_a_task_with_no_target() {
        let t = TimerTarget::new();
        t.begin_scan();
        assert_eq!(t.end_scan(u64::MAX), u64::MAX);
        assert_eq!(t.lower_lazily(300, u64::MAX), Some(300), "no target: woken");
        assert_eq!(
            t.lower_lazily(200, u64::MAX),
            None,
            "a target: the pass sees it"
        );
        assert_eq!(t.lower_lazily(250, 900), None, "urgent after the target");
        assert_eq!(
            t.lower_lazily(100, 150),
            Some(150),
            "urgent before the target: woken for the urgent one"
        );
        t.begin_scan();
        assert_eq!(t.end_scan(u64::MAX), u64::MAX);
        assert_eq!(t.lower_lazily(500, 500), Some(500), "no hold: as lower()");
    }

    #[test]
    fn later_deadlines_do_not_wake_and_earlier_ones_do() {
        let t = TimerTarget::new();
        t.begin_scan();
        assert_eq!(t.end_scan(1_000), 1_000);
        assert!(!t.lower(2_000), "after what the task sleeps to");
        assert!(t.lower(500), "before it");
        assert!(!t.lower(700), "after the lowered target");
        t.begin_scan();
        assert_eq!(t.end_scan(u64::MAX), u64::MAX, "a scan that finds none");
    }
}
