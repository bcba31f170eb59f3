//! Operation deadlines that share timers.
//!
//! Every operation that has to wait carries a deadline (10 s unless
//! changed). A tokio `Sleep` per operation costs a timer-wheel insertion
//! and removal under the wheel's lock, a runtime-handle lookup and a clock
//! read: about 0.4 µs per waiting operation, a fifth of the CPU of an 8 B
//! write when 16 are in flight over TCP (`rdmx perf --mode bw`, one worker).
//! Deadlines need no such precision, so operations that start waiting on
//! one thread within one *tick* of each other share one timer: a [`Batch`]
//! that fires once and wakes its members. A member registers its waker in
//! the batch's slab and removes it when it finishes, so a batch holds no
//! task alive past its operation.
//!
//! A deadline of `d` fires no earlier than `d` after [`SharedDeadline::new`]
//! and at most one tick later; the tick is `d / 32`, between 1 ms (the
//! resolution of tokio's timer) and 100 ms. With the default 10 s deadline
//! about a hundred batches per busy thread are alive at a time, each a
//! small allocation and one timer task.
//!
//! The batch's timer is a tokio timer on the runtime that made it, so a
//! paused test clock drives it as it drives `tokio::time::sleep`; a thread
//! reuses only batches of the runtime it is in.

use std::cell::RefCell;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use parking_lot::Mutex;
use slab::Slab;
use tokio::runtime::Handle;
use tokio::time::Instant;

/// The shortest tick (tokio's timer counts whole milliseconds).
const MIN_TICK: Duration = Duration::from_millis(1);
/// The longest tick: how late a long deadline may fire at most.
const MAX_TICK: Duration = Duration::from_millis(100);
/// The longest deadline kept as given (longer ones fire after this).
const FAR: Duration = Duration::from_secs(86400 * 365 * 30);
/// Batches a thread keeps at hand to join (one per deadline length in use).
const KEPT: usize = 4;

/// How late a deadline of `d` may fire: `d / 32` within [1 ms, 100 ms].
fn tick(d: Duration) -> Duration {
    (d / 32).clamp(MIN_TICK, MAX_TICK)
}

/// Deadlines due at one instant, sharing one timer.
struct Batch {
    due: Instant,
    runtime: tokio::runtime::Id,
    fired: AtomicBool,
    /// Wakers of the members still waiting; emptied when the batch fires.
    members: Mutex<Slab<Waker>>,
}

impl Batch {
    /// Start a batch due at `due` on the current runtime.
    fn start(rt: &Handle, due: Instant) -> Arc<Batch> {
        let b = Arc::new(Batch {
            due,
            runtime: rt.id(),
            fired: AtomicBool::new(false),
            members: Mutex::new(Slab::new()),
        });
        let fire = b.clone();
        rt.spawn(async move {
            tokio::time::sleep_until(fire.due).await;
            fire.fire();
        });
        b
    }

    fn fire(&self) {
        let wakers = {
            let mut m = self.members.lock();
            // Under the lock: a member that registers or re-registers sees
            // either its waker taken here or the flag set.
            self.fired.store(true, Ordering::Release);
            std::mem::take(&mut *m)
        };
        for (_, w) in wakers {
            w.wake();
        }
    }
}

thread_local! {
    /// Batches this thread may join, newest last.
    static AT_HAND: RefCell<Vec<Arc<Batch>>> = const { RefCell::new(Vec::new()) };
}

/// One waiting operation's deadline: pending until `d` has passed since it
/// was made (and at most a tick more), then ready.
pub(crate) struct SharedDeadline {
    batch: Arc<Batch>,
    /// The member's slot in the batch (none once the batch fired).
    key: Option<usize>,
}

impl SharedDeadline {
    /// A deadline `d` from now that wakes `waker` when it passes. Must be
    /// called within a tokio runtime (as `tokio::time::sleep` must).
    pub(crate) fn new(d: Duration, waker: &Waker) -> SharedDeadline {
        let rt = Handle::current();
        let now = Instant::now();
        // A deadline past what the clock can name is, as tokio's `sleep`
        // makes it, about 30 years out.
        let d = d.min(FAR);
        let earliest = now + d;
        let latest = earliest + tick(d);
        loop {
            let batch = AT_HAND.with(|h| {
                let mut h = h.borrow_mut();
                let found = h.iter().rev().find(|b| {
                    b.runtime == rt.id()
                        && b.due >= earliest
                        && b.due <= latest
                        && !b.fired.load(Ordering::Acquire)
                });
                if let Some(b) = found {
                    return b.clone();
                }
                // A new batch, due a whole tick out so that the operations
                // of the next tick can join it.
                let b = Batch::start(&rt, latest);
                h.retain(|o| o.due > now && !o.fired.load(Ordering::Acquire));
                if h.len() >= KEPT {
                    h.remove(0);
                }
                h.push(b.clone());
                b
            });
            let mut m = batch.members.lock();
            if batch.fired.load(Ordering::Acquire) {
                // Only a batch that came due meanwhile; take another.
                continue;
            }
            let key = m.insert(waker.clone());
            drop(m);
            return SharedDeadline {
                batch,
                key: Some(key),
            };
        }
    }

    /// Ready once the deadline has passed; otherwise `cx`'s waker is the one
    /// woken when it does.
    pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.batch.fired.load(Ordering::Acquire) {
            self.key = None;
            return Poll::Ready(());
        }
        let Some(key) = self.key else {
            return Poll::Ready(());
        };
        let mut m = self.batch.members.lock();
        if self.batch.fired.load(Ordering::Acquire) {
            self.key = None;
            return Poll::Ready(());
        }
        if let Some(w) = m.get_mut(key) {
            if !w.will_wake(cx.waker()) {
                w.clone_from(cx.waker());
            }
        }
        Poll::Pending
    }
}

impl Drop for SharedDeadline {
    fn drop(&mut self) {
        if let Some(key) = self.key {
            let mut m = self.batch.members.lock();
            if !self.batch.fired.load(Ordering::Acquire) {
                m.try_remove(key);
            }
        }
    }
}

impl std::future::Future for SharedDeadline {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        SharedDeadline::poll(self.get_mut(), cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::future::poll_fn;

    /// A deadline made from inside a task (so it has that task's waker).
    async fn deadline(d: Duration) -> SharedDeadline {
        poll_fn(|cx| Poll::Ready(SharedDeadline::new(d, cx.waker()))).await
    }

    fn members(d: &SharedDeadline) -> usize {
        d.batch.members.lock().len()
    }

    #[tokio::test(start_paused = true)]
    async fn fires_no_earlier_than_its_deadline_and_at_most_a_tick_later() {
        for ms in [1u64, 50, 1000, 10_000, 60_000] {
            let d = Duration::from_millis(ms);
            let start = Instant::now();
            deadline(d).await.await;
            let took = start.elapsed();
            assert!(took >= d, "{ms} ms: fired after {took:?}");
            assert!(
                took <= d + tick(d) + MIN_TICK,
                "{ms} ms: fired after {took:?}"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_made_within_a_tick_share_a_batch_and_leave_it_when_dropped() {
        let d = Duration::from_secs(10);
        let a = deadline(d).await;
        tokio::time::advance(tick(d) / 2).await;
        let b = deadline(d).await;
        assert!(Arc::ptr_eq(&a.batch, &b.batch), "one timer for both");
        assert_eq!(members(&a), 2);
        drop(b);
        assert_eq!(members(&a), 1, "a dropped deadline leaves its batch");
        // Past the tick a new batch starts (the first would fire early).
        tokio::time::advance(tick(d)).await;
        let c = deadline(d).await;
        assert!(!Arc::ptr_eq(&a.batch, &c.batch));
        // A different length has its own batch.
        let e = deadline(Duration::from_millis(100)).await;
        assert!(!Arc::ptr_eq(&c.batch, &e.batch));
    }

    #[tokio::test]
    async fn a_deadline_past_the_clocks_range_never_fires() {
        let dl = deadline(Duration::MAX).await;
        assert!(dl.batch.due > Instant::now() + Duration::from_secs(86400 * 365));
        let waited = tokio::time::timeout(Duration::from_millis(20), dl).await;
        assert!(waited.is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn the_latest_waker_is_the_one_woken() {
        let d = Duration::from_millis(200);
        let mut dl = deadline(d).await;
        // Polled once more from another task: that task must be woken.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let t = tokio::spawn(async move {
            poll_fn(|cx| dl.poll(cx)).await;
            tx.send(()).unwrap();
        });
        tokio::time::timeout(d * 2, rx)
            .await
            .expect("the task that polled last was woken")
            .unwrap();
        t.await.unwrap();
    }

    #[test]
    fn batches_of_a_finished_runtime_are_not_joined() {
        let d = Duration::from_millis(30);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let first = rt.block_on(deadline(d));
        drop(rt);
        // A new runtime on the same thread: its deadline must fire on a
        // timer of its own (the first runtime's timer task is gone).
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        rt.block_on(async {
            let dl = deadline(d).await;
            assert!(!Arc::ptr_eq(&first.batch, &dl.batch));
            tokio::time::timeout(Duration::from_secs(5), dl)
                .await
                .expect("fires on the new runtime");
        });
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_deadlines_across_threads_all_fire() {
        let d = Duration::from_millis(20);
        let tasks: Vec<_> = (0..64)
            .map(|_| tokio::spawn(async move { deadline(d).await.await }))
            .collect();
        for t in tasks {
            tokio::time::timeout(Duration::from_secs(5), t)
                .await
                .expect("fired")
                .unwrap();
        }
    }
}
