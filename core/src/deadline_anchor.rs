//! Keeps operation deadlines from waking the runtime's I/O driver.
//!
//! Tokio wakes the thread parked in its I/O driver whenever a timer is
//! registered that falls due before the wake-up that thread planned when it
//! parked (`tokio::runtime::time::Handle::reregister`; tokio-rs/tokio#5207).
//! Every rdmx operation carries a deadline ([`crate::conn::DEFAULT_OP_TIMEOUT`]
//! unless changed), so on a multi-thread runtime whose driver sleeps on
//! another worker with no timer pending, each operation wrote to the
//! driver's eventfd and woke that worker: a context switch per operation
//! and tasks handed between threads (two thirds of the driver wake-ups of a
//! soft RoCE send ping-pong).
//!
//! The anchor is one task per multi-thread runtime that sleeps
//! [`ANCHOR_PERIOD`] at a time, so a timer due within that period is always
//! registered and the driver never plans to sleep past it. A deadline
//! further away than the period cannot fall before the planned wake-up, and
//! registering it wakes nobody. The price is one timer firing per period per
//! runtime. Current-thread runtimes are left alone: their driver runs on the
//! thread that registers the deadline, and a test's paused clock would
//! advance through the anchor's sleeps.

use std::collections::HashSet;
use std::time::Duration;

use parking_lot::Mutex;
use tokio::runtime::{Handle, Id, RuntimeFlavor};

/// How long the anchor sleeps at a time: shorter than any deadline it is
/// meant to keep quiet (the default operation timeout is 10 s).
pub const ANCHOR_PERIOD: Duration = Duration::from_secs(1);

/// Runtimes that have an anchor (ids are never reused).
static ANCHORED: Mutex<Option<HashSet<Id>>> = Mutex::new(None);

/// Start the current runtime's anchor if it is a multi-thread runtime
/// without one. Returns whether this call started it.
pub(crate) fn ensure() -> bool {
    let Ok(rt) = Handle::try_current() else {
        return false;
    };
    if rt.runtime_flavor() != RuntimeFlavor::MultiThread {
        return false;
    }
    if !ANCHORED
        .lock()
        .get_or_insert_with(HashSet::new)
        .insert(rt.id())
    {
        return false;
    }
    rt.spawn(async {
        loop {
            tokio::time::sleep(ANCHOR_PERIOD).await;
        }
    });
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_anchor_per_multi_thread_runtime() {
        let mt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let tasks = || mt.metrics().num_alive_tasks();
        assert!(mt.block_on(async { ensure() }));
        assert_eq!(tasks(), 1, "the anchor runs");
        assert!(!mt.block_on(async { ensure() }), "one per runtime");
        assert_eq!(tasks(), 1);
        let ct = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        assert!(
            !ct.block_on(async { ensure() }),
            "none on a current-thread runtime"
        );
        assert_eq!(ct.metrics().num_alive_tasks(), 0);
        assert!(!ensure(), "none outside a runtime");
    }
}
