//! [`Waiters`]: the receivers of a connection waiting for a message, kept
//! under the same lock as the transport's queue of received messages.
//!
//! A transport that keeps its received messages in a queue behind a mutex
//! can keep its waiting receivers beside them: looking for a message and
//! registering to wait for one then take that one lock, and a delivery
//! pushes its message and takes the first waiter under it (a separate
//! `tokio::sync::Notify` costs its own lock on each side, and one more when
//! a registered waiter is dropped).
//!
//! A receive future holds an `Option<u64>` slot for its registration and:
//! - on each pending poll calls [`Waiters::register`] (under the queue's lock);
//! - when it takes a message calls [`Waiters::remove`];
//! - when dropped calls [`Waiters::leave`], which forgets it and, if a
//!   delivery had already woken it while messages are still queued, gives
//!   the next waiter to wake, so that the wake-up is not lost with it.

use std::collections::VecDeque;
use std::task::Waker;

/// Registered receivers, oldest first. See the module doc for the protocol.
#[derive(Debug, Default)]
pub struct Waiters {
    list: VecDeque<(u64, Waker)>,
    next: u64,
}

impl Waiters {
    /// No waiters.
    pub fn new() -> Waiters {
        Waiters::default()
    }

    /// Register (or refresh) the waiter in `slot` with `waker`. A waiter
    /// that a delivery already woke, polled again with nothing to take,
    /// goes to the back of the line.
    pub fn register(&mut self, slot: &mut Option<u64>, waker: &Waker) {
        let id = *slot.get_or_insert_with(|| {
            self.next += 1;
            self.next
        });
        match self.list.iter_mut().find(|(w, _)| *w == id) {
            Some((_, w)) => {
                if !w.will_wake(waker) {
                    w.clone_from(waker);
                }
            }
            None => self.list.push_back((id, waker.clone())),
        }
    }

    /// Forget the waiter in `slot` (emptying it). Returns true if it had
    /// been registered and not yet woken by [`Waiters::pop_first`] or
    /// [`Waiters::take_all`]; false if the slot was empty or it was woken.
    pub fn remove(&mut self, slot: &mut Option<u64>) -> bool {
        let Some(id) = slot.take() else {
            return false;
        };
        match self.list.iter().position(|(w, _)| *w == id) {
            Some(i) => {
                self.list.remove(i);
                true
            }
            None => false,
        }
    }

    /// The waiter in `slot` leaves (its future is dropped): forget it. If a
    /// delivery had already woken it and messages are still `queued`, return
    /// the next waiter, to wake in its place once the lock is released.
    pub fn leave(&mut self, slot: &mut Option<u64>, queued: bool) -> Option<Waker> {
        let was_registered = slot.is_none() || self.remove(slot);
        if was_registered || !queued {
            return None;
        }
        self.pop_first()
    }

    /// Take the oldest waiter, to wake once the lock is released.
    pub fn pop_first(&mut self) -> Option<Waker> {
        self.list.pop_front().map(|(_, w)| w)
    }

    /// Take every waiter (the connection closed), to wake once the lock is
    /// released.
    pub fn take_all(&mut self) -> Vec<Waker> {
        self.list.drain(..).map(|(_, w)| w).collect()
    }

    /// Registered waiters.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether nobody waits.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn counter() -> (Arc<Count>, Waker) {
        let c = Arc::new(Count(AtomicUsize::new(0)));
        (c.clone(), Waker::from(c))
    }

    #[test]
    fn first_registered_is_woken_first_and_reregistering_keeps_the_place() {
        let mut w = Waiters::new();
        let (ca, a) = counter();
        let (cb, b) = counter();
        let (mut sa, mut sb) = (None, None);
        w.register(&mut sa, &a);
        w.register(&mut sb, &b);
        // Polled again with the same waker: still one entry, still first.
        w.register(&mut sa, &a);
        assert_eq!(w.len(), 2);
        w.pop_first().unwrap().wake();
        assert_eq!(ca.0.load(Ordering::SeqCst), 1);
        assert_eq!(cb.0.load(Ordering::SeqCst), 0);
        // The woken one found nothing: back of the line, behind b.
        w.register(&mut sa, &a);
        w.pop_first().unwrap().wake();
        assert_eq!(cb.0.load(Ordering::SeqCst), 1);
        assert!(w.remove(&mut sa), "a is registered again");
    }

    #[test]
    fn remove_tells_a_registered_waiter_from_a_woken_one() {
        let mut w = Waiters::new();
        let (_, a) = counter();
        let (mut sa, mut sb, mut never) = (None, None, None);
        w.register(&mut sa, &a);
        w.register(&mut sb, &a);
        assert!(w.remove(&mut sb), "b was still registered");
        assert!(sb.is_none());
        let _ = w.pop_first();
        assert!(!w.remove(&mut sa), "a had been woken");
        assert!(!w.remove(&mut never), "never registered");
        assert!(w.is_empty());
    }

    #[test]
    fn a_woken_waiter_that_leaves_passes_the_wake_up_on() {
        let mut w = Waiters::new();
        let (_, a) = counter();
        let (cb, b) = counter();
        let (mut sa, mut sb) = (None, None);
        w.register(&mut sa, &a);
        w.register(&mut sb, &b);
        let _ = w.pop_first(); // a delivery wakes a
        assert!(w.leave(&mut sa.clone(), false).is_none(), "nothing queued");
        w.leave(&mut sa, true).expect("b in a's place").wake();
        assert_eq!(cb.0.load(Ordering::SeqCst), 1);
        // A waiter still registered just leaves.
        let mut sc = None;
        w.register(&mut sc, &a);
        assert!(w.leave(&mut sc, true).is_none());
        assert!(w.is_empty());
    }

    #[test]
    fn a_new_waker_replaces_the_old_one() {
        let mut w = Waiters::new();
        let (c1, k1) = counter();
        let (c2, k2) = counter();
        let mut s = None;
        w.register(&mut s, &k1);
        w.register(&mut s, &k2);
        assert_eq!(w.len(), 1);
        for k in w.take_all() {
            k.wake();
        }
        assert_eq!(c1.0.load(Ordering::SeqCst), 0);
        assert_eq!(c2.0.load(Ordering::SeqCst), 1);
    }
}
