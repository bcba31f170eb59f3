//! The work-request registry of a hardware QP: what every posted request owns
//! (staging buffer, result buffer) stays here, keyed by wr_id, until its
//! completion or flush arrives, so a dropped future never frees memory the
//! NIC still uses.
//!
//! Send-queue requests complete in order (IBTA vol. 1 ch. 10), so with
//! selective signaling one CQE for request `n` completes every unsignaled
//! request posted before it; [`SendTrack::complete`] hands those back too,
//! each with the status it finished with.

use std::collections::VecDeque;

use rustc_hash::FxHashMap;

use crate::verbs::{WcOpcode, WcStatus};

/// A posted send-queue request.
#[derive(Debug)]
pub struct Posted<B> {
    /// The provider's id for it (what the NIC returns).
    pub id: u64,
    /// The caller's id.
    pub wr_id: u64,
    /// What kind of request it is.
    pub opcode: WcOpcode,
    /// Bytes it moves.
    pub len: u64,
    /// It asked for a CQE.
    pub signaled: bool,
    /// What it owns until it completes.
    pub buf: B,
}

/// The send queue of one QP.
#[derive(Debug)]
pub struct SendTrack<B> {
    next_id: u64,
    posted: VecDeque<Posted<B>>,
    /// A completion with an error was seen: the QP is in ERROR and
    /// everything after it is flushed.
    failed: bool,
    depth: usize,
}

impl<B> SendTrack<B> {
    /// A send queue of `depth` slots.
    pub fn new(depth: usize) -> SendTrack<B> {
        SendTrack {
            next_id: 1,
            posted: VecDeque::new(),
            failed: false,
            depth,
        }
    }

    /// Requests posted and not completed (they hold send-queue slots).
    pub fn outstanding(&self) -> usize {
        self.posted.len()
    }

    /// True if `n` more requests fit in the send queue.
    pub fn has_room(&self, n: usize) -> bool {
        self.posted.len() + n <= self.depth
    }

    /// Record a request about to be posted; returns the id to post it with.
    pub fn push(&mut self, wr_id: u64, opcode: WcOpcode, len: u64, signaled: bool, buf: B) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.posted.push_back(Posted {
            id,
            wr_id,
            opcode,
            len,
            signaled,
            buf,
        });
        id
    }

    /// Forget the newest request (its post failed, so the NIC never saw it).
    pub fn unpush(&mut self, id: u64) -> Option<Posted<B>> {
        if self.posted.back().is_some_and(|p| p.id == id) {
            self.posted.pop_back()
        } else {
            None
        }
    }

    /// The NIC completed request `id` with `status`. Returns it and every
    /// unsignaled request before it, oldest first. Those finished as the
    /// QP stood: successfully, or flushed once an error was seen. An id
    /// that is not outstanding returns nothing.
    pub fn complete(&mut self, id: u64, status: WcStatus) -> Vec<(Posted<B>, WcStatus)> {
        if !self.posted.iter().any(|p| p.id == id) {
            return Vec::new();
        }
        let mut done = Vec::new();
        while let Some(p) = self.posted.pop_front() {
            if p.id == id {
                if status != WcStatus::Success {
                    self.failed = true;
                }
                done.push((p, status));
                break;
            }
            let before = if self.failed {
                WcStatus::Flushed
            } else {
                WcStatus::Success
            };
            done.push((p, before));
        }
        done
    }

    /// Everything still outstanding, flushed (the QP is being destroyed).
    pub fn flush_all(&mut self) -> Vec<(Posted<B>, WcStatus)> {
        self.failed = true;
        self.posted
            .drain(..)
            .map(|p| (p, WcStatus::Flushed))
            .collect()
    }
}

/// The receive queue of one QP: posted receives by id, in any completion order.
#[derive(Debug)]
pub struct RecvTrack<B> {
    next_id: u64,
    posted: FxHashMap<u64, (u64, B)>,
}

impl<B> Default for RecvTrack<B> {
    fn default() -> Self {
        RecvTrack {
            next_id: 1,
            posted: FxHashMap::default(),
        }
    }
}

impl<B> RecvTrack<B> {
    /// Record a receive about to be posted; returns the id to post it with.
    pub fn push(&mut self, wr_id: u64, buf: B) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.posted.insert(id, (wr_id, buf));
        id
    }

    /// The receive `id` completed: the caller's id and its buffer.
    pub fn complete(&mut self, id: u64) -> Option<(u64, B)> {
        self.posted.remove(&id)
    }

    /// Receives posted and not completed.
    pub fn outstanding(&self) -> usize {
        self.posted.len()
    }

    /// Everything still posted (the QP is being destroyed).
    pub fn drain(&mut self) -> Vec<(u64, B)> {
        self.posted.drain().map(|(_, v)| v).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// A buffer that counts how many of its kind are alive.
    struct Buf(Arc<AtomicUsize>);
    impl Buf {
        fn new(live: &Arc<AtomicUsize>) -> Buf {
            live.fetch_add(1, Ordering::SeqCst);
            Buf(live.clone())
        }
    }
    impl Drop for Buf {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn one_cqe_completes_the_unsignaled_requests_before_it() {
        let live = Arc::new(AtomicUsize::new(0));
        let mut sq = SendTrack::new(8);
        let ids: Vec<u64> = (0..5)
            .map(|i| {
                sq.push(
                    100 + i,
                    WcOpcode::Write,
                    10,
                    i == 2 || i == 4,
                    Buf::new(&live),
                )
            })
            .collect();
        assert_eq!(live.load(Ordering::SeqCst), 5, "buffers kept while posted");
        assert!(sq.has_room(3) && !sq.has_room(4));
        let done = sq.complete(ids[2], WcStatus::Success);
        let got: Vec<(u64, WcStatus)> = done.iter().map(|(p, s)| (p.wr_id, *s)).collect();
        assert_eq!(
            got,
            [
                (100, WcStatus::Success),
                (101, WcStatus::Success),
                (102, WcStatus::Success)
            ]
        );
        drop(done);
        assert_eq!(live.load(Ordering::SeqCst), 2, "released at completion");
        assert!(
            sq.complete(ids[2], WcStatus::Success).is_empty(),
            "no double completion"
        );
        assert_eq!(sq.complete(ids[4], WcStatus::Success).len(), 2);
        assert_eq!(sq.outstanding(), 0);
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn after_an_error_the_rest_is_flushed() {
        let mut sq = SendTrack::new(16);
        let ids: Vec<u64> = (0..6)
            .map(|i| sq.push(i, WcOpcode::Send, 1, i % 2 == 1, ()))
            .collect();
        // Request 1 fails: request 0 (unsignaled, before it) had succeeded.
        let d = sq.complete(ids[1], WcStatus::RemoteAccess);
        let s: Vec<WcStatus> = d.iter().map(|x| x.1).collect();
        assert_eq!(s, [WcStatus::Success, WcStatus::RemoteAccess]);
        // The NIC flushes 3 (signaled); 2 (unsignaled) is flushed with it.
        let d = sq.complete(ids[3], WcStatus::Flushed);
        let s: Vec<WcStatus> = d.iter().map(|x| x.1).collect();
        assert_eq!(s, [WcStatus::Flushed, WcStatus::Flushed]);
        let rest = sq.flush_all();
        assert_eq!(rest.iter().map(|x| x.0.wr_id).collect::<Vec<_>>(), [4, 5]);
        assert!(rest.iter().all(|x| x.1 == WcStatus::Flushed));
    }

    #[test]
    fn a_failed_post_is_forgotten() {
        let mut sq = SendTrack::new(4);
        let a = sq.push(1, WcOpcode::Read, 8, true, ());
        let b = sq.push(2, WcOpcode::Read, 8, true, ());
        assert!(sq.unpush(a).is_none(), "only the newest");
        assert_eq!(sq.unpush(b).unwrap().wr_id, 2);
        assert_eq!(sq.outstanding(), 1);
    }

    #[test]
    fn receives_complete_in_any_order() {
        let live = Arc::new(AtomicUsize::new(0));
        let mut rq = RecvTrack::default();
        let a = rq.push(7, Buf::new(&live));
        let b = rq.push(8, Buf::new(&live));
        assert_eq!(rq.complete(b).map(|x| x.0), Some(8));
        assert_eq!(rq.complete(b).map(|x| x.0), None);
        assert_eq!(rq.outstanding(), 1);
        assert_eq!(rq.complete(a).map(|x| x.0), Some(7));
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }
}
