//! A connection over several lanes (see [`crate::lanes`]): large one-sided
//! operations are split across the lanes, everything else keeps the order a
//! single connection gives.
//!
//! **Placement.** Remote memory is cut into [`STRIPE_UNIT`]-byte units by
//! address; unit `u` belongs to lane `u % lanes`. A read, write or atomic
//! goes, piece by piece, to the lanes owning the units it touches, so two
//! operations on the same bytes always travel on the same lane, in the order
//! they were issued (an RC queue pair's order, IBTA 9.5, or one TCP stream's).
//! An operation inside one unit (any small one) is not split.
//!
//! **Messages.** Sends, and writes with an immediate (whole, on lane 0, so
//! the notice's length is the write's), travel on lane 0, as do writes sent
//! whole (see below). Before one is
//! posted, every earlier write or atomic on another lane must have completed:
//! a message still arrives after the data written before it, as on one queue
//! pair. A read, write or atomic on another lane likewise waits for earlier
//! writes sent whole, which may cover its bytes.
//!
//! **Refusals.** A refused write stores nothing, as on one connection: a
//! write is split only inside a range of its remote key that an earlier
//! write (sent whole, on lane 0) was allowed to cover; a region is
//! contiguous, so every piece of such a write passes the bounds check. (A
//! region deregistered while a split write is in flight may take some of
//! its pieces and refuse the others.) Receiving is lane 0's.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::conn::{BoxFuture, Connection, ConnectionInfo, Incoming, RawConnection};
use crate::error::{Error, Result};
use crate::memory::{AtomicOp, Domain, RemoteRegion};
use crate::pool::ReadSink;
use crate::stats::{Stats, StatsSnapshot};

/// Remote keys whose writable range a connection remembers (forgotten all
/// at once beyond this).
const WRITABLE_KEYS: usize = 1024;

/// Bytes of remote address space per placement unit (256 KiB: a 1 MiB
/// aligned transfer over four lanes is one piece per lane).
pub const STRIPE_UNIT: u64 = 256 << 10;

/// Operations in flight that later ones must wait for.
#[derive(Default)]
struct Fence {
    state: Mutex<FenceState>,
    done: Notify,
}

#[derive(Default)]
struct FenceState {
    /// Tickets handed out so far.
    issued: u64,
    /// Tickets whose operation has not finished.
    open: BTreeSet<u64>,
}

/// An open ticket; the operation it stands for is over when it drops.
struct Ticket {
    fence: Arc<Fence>,
    id: u64,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.fence.state.lock().open.remove(&self.id);
        self.fence.done.notify_waiters();
    }
}

impl Fence {
    fn open(self: &Arc<Self>) -> Ticket {
        let mut s = self.state.lock();
        let id = s.issued;
        s.issued += 1;
        s.open.insert(id);
        Ticket {
            fence: self.clone(),
            id,
        }
    }

    /// Tickets issued so far: what an operation starting now must wait for.
    fn mark(&self) -> u64 {
        self.state.lock().issued
    }

    /// Wait until every ticket below `mark` is closed.
    async fn wait(&self, mark: u64) {
        loop {
            let notified = self.done.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.state.lock().open.first().is_none_or(|&id| id >= mark) {
                return;
            }
            notified.await;
        }
    }
}

/// One piece of a split operation: the lane and the byte range of the
/// operation it covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Piece {
    lane: usize,
    offset: u64,
    len: u64,
}

/// Cut `[addr, addr + len)` at unit boundaries, each piece on its unit's lane.
fn pieces(addr: u64, len: u64, lanes: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut off = 0;
    while off < len {
        let at = addr.wrapping_add(off);
        let unit_end = (at / STRIPE_UNIT + 1).saturating_mul(STRIPE_UNIT);
        let n = (unit_end - at).min(len - off);
        out.push(Piece {
            lane: ((at / STRIPE_UNIT) % lanes as u64) as usize,
            offset: off,
            len: n,
        });
        off += n;
    }
    if out.is_empty() {
        out.push(Piece {
            lane: ((addr / STRIPE_UNIT) % lanes as u64) as usize,
            offset: 0,
            len: 0,
        });
    }
    out
}

struct Inner {
    lanes: Vec<Arc<dyn RawConnection>>,
    info: ConnectionInfo,
    /// Writes and atomics in flight on lanes other than 0.
    remote_writes: Arc<Fence>,
    /// Writes in flight that go whole on lane 0 (with an immediate, or to a
    /// range not yet known to be writable).
    whole_writes: Arc<Fence>,
    /// Per remote key, a range that writes have succeeded in: a region is
    /// contiguous, so a write inside it is either wholly allowed or refused
    /// for a reason that refuses every piece (key, permission).
    writable: Mutex<HashMap<u32, (u64, u64)>>,
    /// Messages leave lane 0 in the order they were first polled.
    send_order: tokio::sync::Mutex<()>,
}

/// A connection striped over several lanes.
pub(crate) struct StripedConnection {
    inner: Arc<Inner>,
}

/// Poll `f` once; its result if it finished.
async fn poll_once<T>(f: &mut BoxFuture<'static, T>) -> Poll<T> {
    std::future::poll_fn(|cx| Poll::Ready(f.as_mut().poll(cx))).await
}

/// A piece of [`join_in_order`]: the future while it runs, then its value.
type Slot<T> = (Option<BoxFuture<'static, Result<T>>>, Option<T>);

/// Run every future, polled in order (so each is posted before the next),
/// and collect their results in order; the first error ends the wait.
fn join_in_order<T: Send + 'static>(
    futs: Vec<BoxFuture<'static, Result<T>>>,
) -> BoxFuture<'static, Result<Vec<T>>> {
    let mut slots: Vec<Slot<T>> = futs.into_iter().map(|f| (Some(f), None)).collect();
    Box::pin(std::future::poll_fn(move |cx: &mut Context<'_>| {
        let mut busy = false;
        for (fut, out) in slots.iter_mut() {
            if let Some(f) = fut {
                match f.as_mut().poll(cx) {
                    Poll::Ready(Ok(v)) => {
                        *out = Some(v);
                        *fut = None;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => busy = true,
                }
            }
        }
        if busy {
            return Poll::Pending;
        }
        Poll::Ready(Ok(slots
            .iter_mut()
            .map(|(_, out)| out.take().expect("finished"))
            .collect()))
    }))
}

impl StripedConnection {
    /// Make one connection of `lanes` (lane 0 first; all to the same peer).
    pub(crate) fn assemble(lanes: Vec<Connection>, op_timeout: Duration) -> Result<Connection> {
        let first = lanes
            .first()
            .ok_or_else(|| Error::InvalidArgument("no lanes".into()))?;
        let mut info = first.info().clone();
        info.lanes = lanes.len() as u16;
        info.lane = None;
        // The smallest limits of any lane hold for the whole.
        for l in &lanes[1..] {
            let c = &l.info().capabilities;
            info.capabilities.max_rdma_size = info.capabilities.max_rdma_size.min(c.max_rdma_size);
        }
        let raw: Vec<Arc<dyn RawConnection>> = lanes.iter().map(|c| c.raw().clone()).collect();
        tracing::debug!(lanes = raw.len(), peer = ?info.peer_addr, "lanes assembled");
        let striped = StripedConnection {
            inner: Arc::new(Inner {
                lanes: raw,
                info,
                remote_writes: Arc::default(),
                whole_writes: Arc::default(),
                writable: Mutex::default(),
                send_order: tokio::sync::Mutex::new(()),
            }),
        };
        Ok(Connection::new_untracked(Arc::new(striped), op_timeout))
    }
}

impl Inner {
    fn lane0(&self) -> &Arc<dyn RawConnection> {
        &self.lanes[0]
    }

    /// True if a write to `r` is known to be allowed as a whole.
    fn known_writable(&self, r: &RemoteRegion) -> bool {
        let end = r.addr.saturating_add(r.len);
        self.writable
            .lock()
            .get(&r.rkey)
            .is_some_and(|&(lo, hi)| lo <= r.addr && end <= hi)
    }

    /// A write to `r` succeeded (`true`) or was refused (`false`).
    fn learn_writable(&self, r: &RemoteRegion, ok: bool) {
        let mut w = self.writable.lock();
        if !ok {
            w.remove(&r.rkey);
            return;
        }
        if w.len() >= WRITABLE_KEYS && !w.contains_key(&r.rkey) {
            w.clear();
        }
        let end = r.addr.saturating_add(r.len);
        let e = w.entry(r.rkey).or_insert((r.addr, end));
        *e = (e.0.min(r.addr), e.1.max(end));
    }

    /// Post `make()` on lane 0 after every earlier remote write or atomic on
    /// the other lanes has completed, in first-poll order among messages.
    async fn fenced<T>(
        self: Arc<Self>,
        make: impl FnOnce(&Arc<dyn RawConnection>) -> BoxFuture<'static, Result<T>>,
    ) -> Result<T> {
        let mark = self.remote_writes.mark();
        let order = self.send_order.lock().await;
        self.remote_writes.wait(mark).await;
        let mut f = make(self.lane0());
        let first = poll_once(&mut f).await;
        drop(order);
        match first {
            Poll::Ready(r) => r,
            Poll::Pending => f.await,
        }
    }

    /// Start the pieces of a read, write or atomic at the first poll. An
    /// operation with pieces on lanes other than 0 waits for earlier writes
    /// with an immediate, and holds a ticket of `remote_writes` until it
    /// finishes if it mutates.
    fn spread<T: Send + 'static>(
        self: &Arc<Self>,
        pieces: Vec<Piece>,
        mutates: bool,
        mut make: impl FnMut(&Arc<dyn RawConnection>, Piece) -> BoxFuture<'static, Result<T>>
            + Send
            + 'static,
    ) -> BoxFuture<'static, Result<Vec<T>>> {
        let this = self.clone();
        Box::pin(async move {
            let off_lane = pieces.iter().any(|p| p.lane != 0);
            // Opened before any wait, so a message issued after this
            // operation waits for it.
            let ticket = (mutates && off_lane).then(|| this.remote_writes.open());
            if off_lane {
                let mark = this.whole_writes.mark();
                this.whole_writes.wait(mark).await;
            }
            let futs: Vec<BoxFuture<'static, Result<T>>> = pieces
                .into_iter()
                .map(|p| make(&this.lanes[p.lane], p))
                .collect();
            let r = join_in_order(futs).await;
            drop(ticket);
            r
        })
    }
}

impl RawConnection for StripedConnection {
    fn info(&self) -> ConnectionInfo {
        self.inner.info.clone()
    }

    fn stats(&self) -> &Arc<Stats> {
        self.inner.lane0().stats()
    }

    fn snapshot(&self) -> StatsSnapshot {
        let mut sum = StatsSnapshot::default();
        for l in &self.inner.lanes {
            sum.add(&l.snapshot());
        }
        sum
    }

    fn lane_snapshots(&self) -> Vec<StatsSnapshot> {
        self.inner.lanes.iter().map(|l| l.snapshot()).collect()
    }

    fn domain(&self) -> &Domain {
        self.inner.lane0().domain()
    }

    fn send(&self, msg: Bytes) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.inner.clone().fenced(move |l| l.send(msg)))
    }

    fn send_many(&self, msgs: Vec<Bytes>) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.inner.clone().fenced(move |l| l.send_many(msgs)))
    }

    fn recv(&self) -> BoxFuture<'static, Result<Incoming>> {
        self.inner.lane0().recv()
    }

    fn read(&self, src: RemoteRegion) -> BoxFuture<'static, Result<Bytes>> {
        let ps = pieces(src.addr, src.len, self.inner.lanes.len());
        let part = move |p: &Piece| RemoteRegion {
            addr: src.addr.wrapping_add(p.offset),
            len: p.len,
            rkey: src.rkey,
        };
        if ps.len() == 1 {
            let parts = self.inner.spread(ps, false, move |l, p| l.read(part(&p)));
            return Box::pin(async move { Ok(parts.await?.pop().expect("one part")) });
        }
        // Every lane's part lands in place in one buffer.
        let sink = ReadSink::new(src.len as usize);
        let s = sink.clone();
        let parts = self.inner.spread(ps, false, move |l, p| {
            l.read_part(part(&p), s.clone(), p.offset as usize)
        });
        Box::pin(async move {
            parts.await?;
            sink.finish()
                .ok_or_else(|| Error::Disconnected("the read's buffer is gone".into()))
        })
    }

    fn write(
        &self,
        dst: RemoteRegion,
        data: Bytes,
        imm: Option<u32>,
    ) -> BoxFuture<'static, Result<()>> {
        let ps = pieces(dst.addr, dst.len, self.inner.lanes.len());
        // Whole, on lane 0, after the writes before it (later pieces on
        // other lanes wait for it: its bytes may be theirs): a write with an
        // immediate (the notice names its whole length), and a split write
        // to a range not yet known to be writable (a refused write must
        // store nothing, and the first one tells).
        if imm.is_some() || (ps.len() > 1 && !self.inner.known_writable(&dst)) {
            let inner = self.inner.clone();
            return Box::pin(async move {
                let ticket = inner.whole_writes.open();
                let r = inner.clone().fenced(move |l| l.write(dst, data, imm)).await;
                drop(ticket);
                match &r {
                    Ok(()) => inner.learn_writable(&dst, true),
                    Err(Error::RemoteAccess(_)) => inner.learn_writable(&dst, false),
                    Err(_) => {}
                }
                r
            });
        }
        let inner = self.inner.clone();
        let done = self.inner.spread(ps, true, move |l, p| {
            let piece = RemoteRegion {
                addr: dst.addr.wrapping_add(p.offset),
                len: p.len,
                rkey: dst.rkey,
            };
            l.write(
                piece,
                data.slice(p.offset as usize..(p.offset + p.len) as usize),
                None,
            )
        });
        Box::pin(async move {
            let r = done.await.map(|_| ());
            if let Err(Error::RemoteAccess(_)) = &r {
                inner.learn_writable(&dst, false);
            }
            r
        })
    }

    fn write_then_send(
        &self,
        dst: RemoteRegion,
        data: Bytes,
        msg: Bytes,
    ) -> BoxFuture<'static, Result<()>> {
        // The write's pieces are posted first; the message then waits for
        // those on other lanes and follows those on lane 0.
        let write = self.write(dst, data, None);
        let send = self.send(msg);
        Box::pin(async move { join_in_order(vec![write, send]).await.map(|_| ()) })
    }

    fn atomic(&self, dst: RemoteRegion, op: AtomicOp) -> BoxFuture<'static, Result<u64>> {
        let ps = pieces(dst.addr, dst.len, self.inner.lanes.len());
        let lane = ps[0].lane;
        let one = vec![Piece {
            lane,
            offset: 0,
            len: dst.len,
        }];
        let done = self.inner.spread(one, true, move |l, _| l.atomic(dst, op));
        Box::pin(async move { Ok(done.await?[0]) })
    }

    fn close(&self) -> BoxFuture<'static, Result<()>> {
        let lanes = self.inner.lanes.clone();
        Box::pin(async move {
            // Lane 0 last: its close is what the peer's receive sees.
            let mut result = Ok(());
            for l in lanes.iter().skip(1).chain(lanes.first()) {
                if let Err(e) = l.close().await {
                    if result.is_ok() {
                        result = Err(e);
                    }
                }
            }
            result
        })
    }

    fn cork(&self) {
        for l in self.inner.lanes.iter() {
            l.cork();
        }
    }

    fn uncork(&self) {
        for l in self.inner.lanes.iter() {
            l.uncork();
        }
    }
}

/// Poll helper kept for tests of the fence.
#[cfg(test)]
fn now_or_never<F: std::future::Future>(f: F) -> Option<F::Output> {
    let mut f = Box::pin(f);
    let waker = std::task::Waker::noop();
    match f.as_mut().poll(&mut Context::from_waker(waker)) {
        Poll::Ready(v) => Some(v),
        Poll::Pending => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_follow_unit_boundaries_and_lanes() {
        let u = STRIPE_UNIT;
        // Inside one unit: one piece, on that unit's lane.
        assert_eq!(
            pieces(3 * u + 10, 100, 4),
            vec![Piece {
                lane: 3,
                offset: 0,
                len: 100
            }]
        );
        // 1 MiB aligned over 4 lanes: a unit per lane.
        let p = pieces(8 * u, 4 * u, 4);
        assert_eq!(
            p.iter()
                .map(|p| (p.lane, p.offset, p.len))
                .collect::<Vec<_>>(),
            vec![(0, 0, u), (1, u, u), (2, 2 * u, u), (3, 3 * u, u)]
        );
        // Unaligned: the cuts fall on unit boundaries, covering every byte once.
        let p = pieces(u - 5, u + 10, 2);
        assert_eq!(
            p.iter()
                .map(|p| (p.lane, p.offset, p.len))
                .collect::<Vec<_>>(),
            vec![(0, 0, 5), (1, 5, u), (0, u + 5, 5)]
        );
        // Zero length: one empty piece.
        assert_eq!(pieces(u, 0, 4).len(), 1);
    }

    #[test]
    fn fence_waits_for_earlier_tickets_only() {
        let f = Arc::new(Fence::default());
        let a = f.open();
        let mark = f.mark();
        let b = f.open();
        assert!(now_or_never(f.wait(mark)).is_none(), "a is open");
        drop(a);
        assert!(now_or_never(f.wait(mark)).is_some(), "b came later");
        assert!(now_or_never(f.wait(f.mark())).is_none(), "b is open");
        drop(b);
        assert!(now_or_never(f.wait(f.mark())).is_some());
    }
}
