//! The soft provider's completion queue: a queue plus an event fd (one end of
//! a Unix datagram pair) that becomes readable when an armed CQ gets a
//! completion, as an `ibv_comp_channel` does.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Weak;

use parking_lot::Mutex;
use rdmx_core::{Error, Result};

use crate::verbs::{CompletionHandler, CompletionQueue, WorkCompletion};

/// A completion queue of the soft provider.
#[derive(Debug)]
pub(crate) struct SoftCq {
    queue: Mutex<VecDeque<WorkCompletion>>,
    armed: AtomicBool,
    /// Woken instead of the fd when a waiter registered one.
    waker: Mutex<Option<std::task::Waker>>,
    /// Runs completions added by the device's own tasks (see
    /// [`SoftCq::push`] and [`SoftCq::run_handler`]).
    handler: Mutex<Option<Weak<dyn CompletionHandler>>>,
    /// Completions were added for the handler to take.
    handler_due: AtomicBool,
    /// Written when an armed CQ gets a completion.
    notify: UnixDatagram,
    /// The event fd handed out.
    events: UnixDatagram,
}

impl SoftCq {
    pub(crate) fn new() -> Result<SoftCq> {
        let (notify, events) = UnixDatagram::pair()
            .map_err(|e| Error::ResourceExhausted(format!("CQ event pair: {e}")))?;
        for s in [&notify, &events] {
            s.set_nonblocking(true)
                .map_err(|e| Error::ResourceExhausted(format!("CQ event pair: {e}")))?;
        }
        Ok(SoftCq {
            queue: Mutex::new(VecDeque::new()),
            armed: AtomicBool::new(false),
            waker: Mutex::new(None),
            handler: Mutex::new(None),
            handler_due: AtomicBool::new(false),
            notify,
            events,
        })
    }

    /// Add completions; signal the event fd if the CQ was armed. With
    /// `handler_follows`, the caller promises to call [`SoftCq::run_handler`]
    /// once it holds no lock: if a handler is set, it takes them then, and
    /// the waiter is not woken.
    pub(crate) fn push(
        &self,
        wcs: impl IntoIterator<Item = WorkCompletion>,
        handler_follows: bool,
    ) {
        let mut n = 0;
        {
            let mut q = self.queue.lock();
            for wc in wcs {
                q.push_back(wc);
                n += 1;
            }
        }
        if n > 0 && handler_follows && self.handler.lock().is_some() {
            self.handler_due.store(true, Ordering::Release);
            return;
        }
        self.wake(n);
    }

    /// Hand completions added with `handler_follows` to the handler (or, if
    /// it is gone, to the waiter).
    pub(crate) fn run_handler(&self) {
        if !self.handler_due.swap(false, Ordering::AcqRel) {
            return;
        }
        let h = self.handler.lock().as_ref().and_then(Weak::upgrade);
        match h {
            Some(h) => h.completions_ready(),
            None => self.wake(1),
        }
    }

    fn wake(&self, n: usize) {
        if n > 0 && self.armed.swap(false, Ordering::AcqRel) {
            match self.waker.lock().take() {
                Some(w) => w.wake(),
                // A full socket buffer already means "readable": ignore WouldBlock.
                None => {
                    let _ = self.notify.send(&[1]);
                }
            }
        }
    }
}

impl CompletionQueue for SoftCq {
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let mut q = self.queue.lock();
        let n = q.len().min(max);
        out.extend(q.drain(..n));
        n
    }

    fn req_notify(&self) -> Result<()> {
        self.armed.store(true, Ordering::Release);
        Ok(())
    }

    fn event_fd(&self) -> BorrowedFd<'_> {
        self.events.as_fd()
    }

    fn ack_events(&self) {
        let mut buf = [0u8; 64];
        while self.events.recv(&mut buf).is_ok() {}
    }

    fn register_waker(&self, waker: &std::task::Waker) -> bool {
        let mut w = self.waker.lock();
        match w.as_ref() {
            Some(old) if old.will_wake(waker) => {}
            _ => *w = Some(waker.clone()),
        }
        true
    }

    fn set_handler(&self, handler: Weak<dyn CompletionHandler>) -> bool {
        *self.handler.lock() = Some(handler);
        true
    }

    fn pending(&self) -> Option<usize> {
        Some(self.queue.lock().len())
    }

    fn as_any(self: std::sync::Arc<Self>) -> std::sync::Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::verbs::{CqWaiter, WcOpcode, WcStatus};
    use std::sync::Arc;

    fn wc(id: u64) -> WorkCompletion {
        WorkCompletion {
            wr_id: id,
            qpn: 1,
            status: WcStatus::Success,
            opcode: WcOpcode::Send,
            byte_len: 0,
            data: bytes::Bytes::new(),
            imm: None,
            atomic_orig: None,
        }
    }

    struct Count(std::sync::atomic::AtomicUsize, Arc<SoftCq>);
    impl CompletionHandler for Count {
        fn completions_ready(&self) {
            let mut got = Vec::new();
            self.1.poll(&mut got, 64);
            self.0.fetch_add(got.len(), Ordering::Relaxed);
        }
    }

    /// Completions a device task adds go to the handler when it runs it, not
    /// to the waiter; those added elsewhere wake the waiter; once the handler
    /// is gone, the device task's wake the waiter too.
    #[tokio::test]
    async fn device_completions_go_to_the_handler() {
        let cq = Arc::new(SoftCq::new().unwrap());
        let h = Arc::new(Count(Default::default(), cq.clone()));
        let weak = Arc::downgrade(&h);
        assert!(cq.set_handler(weak));
        let mut w = CqWaiter::new(cq.clone()).unwrap();
        // Armed, as a waiting task leaves it.
        cq.req_notify().unwrap();
        cq.push([wc(1), wc(2)], true);
        assert_eq!(cq.pending(), Some(2));
        assert!(cq.armed.load(Ordering::Acquire), "the waiter was woken");
        cq.run_handler();
        assert_eq!((h.0.load(Ordering::Relaxed), cq.pending()), (2, Some(0)));
        // From an application's post: the waiter's.
        cq.push([wc(3)], false);
        let mut got = Vec::new();
        w.next(&mut got, 8).await.unwrap();
        assert_eq!(got[0].wr_id, 3);
        // The handler dropped: nothing is lost.
        drop(h);
        cq.req_notify().unwrap();
        cq.push([wc(4)], true);
        cq.run_handler();
        got.clear();
        w.next(&mut got, 8).await.unwrap();
        assert_eq!(got[0].wr_id, 4);
    }

    /// Completions pushed from another thread, before and after arming, are
    /// all seen by a waiter on the event fd, in order, none twice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn waiter_sees_every_completion_once() {
        let cq = Arc::new(SoftCq::new().unwrap());
        let mut w = CqWaiter::new(cq.clone()).unwrap();
        let producer = {
            let cq = cq.clone();
            std::thread::spawn(move || {
                for i in 0..20_000u64 {
                    cq.push([wc(i)], false);
                    if i % 1000 == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
            })
        };
        let mut got = Vec::new();
        while got.len() < 20_000 {
            w.next(&mut got, 64).await.unwrap();
        }
        producer.join().unwrap();
        assert!(got.iter().enumerate().all(|(i, c)| c.wr_id == i as u64));
        let mut more = Vec::new();
        assert_eq!(cq.poll(&mut more, 10), 0);
    }
}
