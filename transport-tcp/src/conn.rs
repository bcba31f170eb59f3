//! One TCP connection: a reader task that serves the peer's requests and
//! completes ours, and a write path that writes directly when the socket is idle
//! and batches frames through a writer task under load.
//!
//! Here: the connection's state and the operations it starts (requests,
//! credits, close). The reader task and the serving of the peer's requests
//! are in `conn/read.rs`; the write path in `conn/write.rs`.

use std::collections::VecDeque;
use std::io::{self, IoSlice};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use rdmx_core::stats::Stats;
use rdmx_core::waiters::Waiters;
use rdmx_core::{
    AccessError, AtomicOp, BoxFuture, Capabilities, ConnectionInfo, Domain, Error, Incoming,
    LocalSlice, RawConnection, RemoteRegion, Result, Support,
};
use rustc_hash::FxHashMap;
use smallvec::SmallVec;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::sync::{oneshot, Notify, Semaphore, SemaphorePermit};
use tokio::task::JoinHandle;
use tracing::Instrument;

use crate::frame::{
    Header, Kind, OutFrame, FLAG_ACK_LATER, FLAG_FAA, FLAG_IMM, FLAG_LAST, HEADER_LEN, MAX_PIECE,
    STATUS_OK,
};
use crate::handshake::{Agreed, Limits};
use crate::slice_sink::SliceSink;
use rdmx_core::pool::{self, ReadSink};

mod read;
mod write;

/// Frames carried by one `writev`.
const MAX_IOV: usize = 64;
/// How long a held write acknowledgement ([`FLAG_ACK_LATER`]) waits for
/// another frame to leave with, at most.
const ACK_DELAY: Duration = Duration::from_millis(1);
/// Held acknowledgements that leave on their own, without waiting longer.
const MAX_HELD: usize = 32;
/// Read bytes one connection may have outstanding. This bounds what the peer
/// must queue for our read responses, as RDMA bounds outstanding READs
/// (the QP attribute max_rd_atomic), so no responder needs to stop reading its socket.
const READ_OUTSTANDING: usize = 64 << 20;
/// Bytes of answers queued for a peer past which it is taken to be not
/// reading them (above what a peer of ours can have outstanding).
const MAX_ANSWERS_QUEUED: usize = READ_OUTSTANDING + (16 << 20);
/// Payloads at least this large are read from the socket straight into their
/// destination: the target region (writes) or a pooled buffer (messages,
/// read responses).
const DIRECT_MIN: usize = 64 << 10;
/// Socket read buffer growth step.
const READ_CHUNK: usize = 64 << 10;
/// After small frames, the read buffer grows (by [`READ_CHUNK`]) only when
/// less room than this is left: small frames are read into the rest of the
/// buffer they share. (Growing to a whole chunk of room before every read
/// cost a fresh 64 KiB buffer per message while the last one's payload was
/// still held: 1,000 of the 14,500 user-space instructions of an 8 B send
/// round trip, both ends counted, by callgrind.) See `read::ReadRoom`.
const READ_MIN_ROOM: usize = 4 << 10;
/// Read buffer growth step after medium frames (see `read::ReadRoom`).
const READ_BULK: usize = 4 * READ_CHUNK;

/// Largest single read/write operation.
pub(crate) const MAX_RDMA_SIZE: u64 = 1 << 31;

struct WriteQueue {
    frames: VecDeque<OutFrame>,
    /// Of `frames`, acknowledgements held back to leave with the next frame
    /// sent ([`FLAG_ACK_LATER`]); alone, they do not make anyone write
    /// until [`ACK_DELAY`] passes.
    held: usize,
    /// Someone (a direct writer or the writer task) owns the socket's write side.
    busy: bool,
    /// Corks held: the reader's while it answers a burst of buffered
    /// requests, and the application's ([`Connection::cork`]). While any is
    /// held, frames queue and leave together when the last one ends
    /// ([`Shared::uncork`]).
    ///
    /// [`Connection::cork`]: rdmx_core::Connection::cork
    corks: u32,
    /// The writer task was woken to flush requests queued behind others in
    /// flight: it lets the scheduler tick finish first, so that every request
    /// made in that tick leaves in the same `writev`.
    deferred: bool,
    closed: bool,
}

struct Credits {
    msgs: u64,
    bytes: u64,
}

struct RecvState {
    queue: VecDeque<Incoming>,
    /// Consumed since the last credit return.
    consumed_msgs: u64,
    consumed_bytes: u64,
    /// What the peer may still send us (to detect a peer overrunning credits).
    peer_msgs_left: u64,
    peer_bytes_left: u64,
    /// Receivers waiting for a message (`RecvWait`); a delivery wakes the first.
    waiters: Waiters,
}

/// A response to one request.
struct Resp {
    status: u8,
    value: u64,
    payload: Bytes,
    /// Payload bytes the reader received straight into the request's
    /// [`ReadSink`] instead of into `payload`.
    filled: usize,
}

pub(crate) struct Shared {
    stream: TcpStream,
    domain: Domain,
    stats: Arc<Stats>,
    info: ConnectionInfo,
    ours: Limits,
    peer: Limits,
    busy_poll: Option<Duration>,

    wq: Mutex<WriteQueue>,
    writer_wake: Notify,
    write_drained: Notify,

    /// Waiters by request id (ids are ours, never a peer's: a fast hash).
    pending: Mutex<FxHashMap<u64, oneshot::Sender<Resp>>>,
    /// Read pieces whose responses go straight into a [`ReadSink`], at an
    /// offset (the reader takes the sink's buffer while it receives a piece
    /// into its place: no buffer per piece, no copy to join them).
    sinks: Mutex<FxHashMap<u64, (ReadSink, usize)>>,
    /// Reads whose responses go straight into the caller's registered slice
    /// (`read_into`).
    slice_sinks: Mutex<FxHashMap<u64, Arc<SliceSink>>>,
    next_id: AtomicU64,
    inflight: Semaphore,
    read_budget: Semaphore,
    /// Bytes of answers to the peer's requests queued but not yet written.
    answers_queued: AtomicUsize,

    send_order: tokio::sync::Mutex<()>,
    /// Senders holding or waiting for their turn ([`SendTurn`]): while any
    /// is, a new send queues for its turn too; while none is, a send with
    /// credit at hand posts at once, taking no turn.
    turns: AtomicUsize,
    credits: Mutex<Credits>,
    credit_wake: Notify,

    recv: Mutex<RecvState>,
    /// Woken (all waiters) when the connection is marked dead.
    closed_wake: Notify,

    closed: Mutex<Option<Error>>,
}

/// Waits for the next received message or notice (`RawConnection::recv`).
///
/// Looking in the queue and registering to wait take the queue's one lock,
/// so a message that arrives in between finds the waiter. Cancel-safe: a
/// waiter dropped after a delivery woke it, without taking the message,
/// passes the wake-up on to the next waiter.
struct RecvWait {
    shared: Arc<Shared>,
    /// Our id among `RecvState::waiters`, once registered.
    waiter: Option<u64>,
}

impl std::future::Future for RecvWait {
    type Output = Result<Incoming>;

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let taken = {
            let mut r = this.shared.recv.lock();
            let got = this.shared.take_queued(&mut r);
            match got {
                Some(_) => {
                    r.waiters.remove(&mut this.waiter);
                }
                None => r.waiters.register(&mut this.waiter, cx.waker()),
            }
            got
        };
        if let Some((item, credit)) = taken {
            this.shared.grant(credit);
            return Poll::Ready(Ok(item));
        }
        // Registered first, then looked: `fail` marks the connection closed
        // before it wakes the registered receivers.
        match this.shared.closed_error() {
            Some(e) => Poll::Ready(Err(e)),
            None => Poll::Pending,
        }
    }
}

impl Drop for RecvWait {
    fn drop(&mut self) {
        if self.waiter.is_none() {
            return;
        }
        let next = {
            let mut r = self.shared.recv.lock();
            let queued = !r.queue.is_empty();
            // Woken by a delivery whose message we never took: pass it on.
            r.waiters.leave(&mut self.waiter, queued)
        };
        if let Some(w) = next {
            w.wake();
        }
    }
}

/// The [`RawConnection`] for TCP. Dropping it tears the connection down.
pub(crate) struct TcpConnection {
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
}

impl Drop for TcpConnection {
    fn drop(&mut self) {
        self.shared
            .fail(Error::Disconnected("connection dropped locally".into()));
        for t in &self.tasks {
            t.abort();
        }
    }
}

pub(crate) struct Setup {
    pub(crate) stream: TcpStream,
    pub(crate) domain: Domain,
    /// What both ends announced (our limits are `agreed.ours`).
    pub(crate) agreed: Agreed,
    pub(crate) max_inflight: u32,
    pub(crate) busy_poll: Option<Duration>,
}

pub(crate) fn capabilities(max_message: u64, max_inflight: u32, credits: u32) -> Capabilities {
    Capabilities {
        transport: "tcp".into(),
        rdma: false,
        send: Support::Native,
        write: Support::Emulated,
        read: Support::Emulated,
        atomics: Support::Emulated,
        write_with_imm: Support::Emulated,
        max_message_size: max_message,
        max_rdma_size: MAX_RDMA_SIZE,
        max_inflight,
        recv_credits: credits,
        counts_remote_ops: true,
    }
}

impl TcpConnection {
    pub(crate) fn start(s: Setup) -> TcpConnection {
        let local_addr = s.stream.local_addr().ok();
        let peer_addr = s.stream.peer_addr().ok();
        let info = ConnectionInfo {
            transport: "tcp".into(),
            provider: "kernel-tcp".into(),
            fallback_reason: None,
            local_addr,
            peer_addr,
            capabilities: capabilities(
                s.agreed.peer.max_message,
                s.max_inflight,
                s.agreed.peer.credits,
            ),
            authenticated: s.agreed.authenticated,
            lane: s.agreed.lane,
            lanes: 1,
        };
        let stats = rdmx_core::stats::new_stats();
        stats.add(|s| &s.connections, 1);
        let peer = s.agreed.peer;
        let shared = Arc::new(Shared {
            stream: s.stream,
            domain: s.domain,
            stats,
            info,
            ours: s.agreed.ours,
            peer,
            busy_poll: s.busy_poll,
            wq: Mutex::new(WriteQueue {
                frames: VecDeque::new(),
                held: 0,
                busy: false,
                corks: 0,
                deferred: false,
                closed: false,
            }),
            writer_wake: Notify::new(),
            write_drained: Notify::new(),
            pending: Mutex::default(),
            sinks: Mutex::default(),
            slice_sinks: Mutex::default(),
            next_id: AtomicU64::new(1),
            inflight: Semaphore::new(s.max_inflight as usize),
            read_budget: Semaphore::new(READ_OUTSTANDING),
            answers_queued: AtomicUsize::new(0),
            send_order: tokio::sync::Mutex::new(()),
            turns: AtomicUsize::new(0),
            credits: Mutex::new(Credits {
                msgs: u64::from(peer.credits),
                bytes: peer.window,
            }),
            credit_wake: Notify::new(),
            recv: Mutex::new(RecvState {
                queue: VecDeque::new(),
                consumed_msgs: 0,
                consumed_bytes: 0,
                peer_msgs_left: u64::from(s.agreed.ours.credits),
                peer_bytes_left: s.agreed.ours.window,
                waiters: Waiters::new(),
            }),
            closed_wake: Notify::new(),
            closed: Mutex::new(None),
        });
        let span = tracing::info_span!(
            "rdmx.conn",
            transport = "tcp",
            local = ?local_addr,
            peer = ?peer_addr
        );
        tracing::debug!(parent: &span, "connection established");
        let reader = tokio::spawn(shared.clone().reader().instrument(span.clone()));
        let writer = tokio::spawn(shared.clone().writer().instrument(span));
        TcpConnection {
            shared,
            tasks: vec![reader, writer],
        }
    }
}

impl Shared {
    fn closed_error(&self) -> Option<Error> {
        self.closed.lock().clone()
    }

    /// Mark the connection dead with `err` (first error wins), fail everything
    /// waiting, and shut the socket so the peer notices at once.
    fn fail(&self, err: Error) {
        {
            let mut c = self.closed.lock();
            if c.is_some() {
                return;
            }
            tracing::debug!(error = %err, "connection closed");
            *c = Some(err);
        }
        self.wq.lock().closed = true;
        // Dropping the senders wakes every waiting operation with the close error.
        self.pending.lock().clear();
        self.sinks.lock().clear();
        self.slice_sinks.lock().clear();
        self.credit_wake.notify_waiters();
        // Registered receivers look at `closed` once woken (a later one
        // looks right after registering).
        let receivers = self.recv.lock().waiters.take_all();
        for w in receivers {
            w.wake();
        }
        self.writer_wake.notify_one();
        self.write_drained.notify_waiters();
        self.closed_wake.notify_waiters();
        let _ = socket2::SockRef::from(&self.stream).shutdown(std::net::Shutdown::Both);
    }

    fn disconnected(&self) -> Error {
        self.closed_error()
            .unwrap_or_else(|| Error::Disconnected("connection closed".into()))
    }

    // ------------------------------------------------------------- requesting

    /// Send a request frame and wait for its response.
    async fn request(self: &Arc<Self>, h: Header, payload: Bytes) -> Result<Resp> {
        self.request_into(h, payload, None, None).await
    }

    /// [`request`](Self::request), its response payload received into `sink`
    /// at an offset, or into the caller's `slice`, when it comes in large.
    async fn request_into(
        self: &Arc<Self>,
        mut h: Header,
        payload: Bytes,
        sink: Option<(ReadSink, usize)>,
        slice: Option<Arc<SliceSink>>,
    ) -> Result<Resp> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        h.id = id;
        let (tx, rx) = oneshot::channel();
        let has_sink = sink.is_some();
        if let Some(s) = sink {
            self.sinks.lock().insert(id, s);
        }
        if let Some(s) = &slice {
            self.slice_sinks.lock().insert(id, s.clone());
        }
        let others_in_flight = {
            let mut pending = self.pending.lock();
            pending.insert(id, tx);
            pending.len() > 1
        };
        // Removes the waiter if this future is dropped before the response.
        let mut guard = PendingGuard::new(self, id, 1, has_sink);
        guard.slice = slice;
        if let Some(e) = self.closed_error() {
            return Err(e);
        }
        self.stats.add(|s| &s.bytes_sent, payload.len() as u64);
        let frame = OutFrame::new(h, payload);
        if others_in_flight {
            self.enqueue_deferred(frame)?;
        } else {
            self.enqueue(frame)?;
        }
        let resp = rx.await.map_err(|_| self.disconnected())?;
        guard.answered();
        Ok(resp)
    }

    async fn read(self: Arc<Self>, src: RemoteRegion) -> Result<Bytes> {
        check_rdma_len(src.len)?;
        let _permit = self.inflight_permit().await?;
        if src.len <= MAX_PIECE {
            // One piece (the common case): no list of them to build.
            return self.read_piece(src, 0, src.len, None).await;
        }
        // Every piece lands in one buffer, in place.
        let sink = ReadSink::new(src.len as usize);
        self.read_pieces(src, &sink, 0).await?;
        sink.finish().ok_or_else(|| self.disconnected())
    }

    /// Several reads as one unit: their requests registered under one lock
    /// and queued together (one `writev`, or the tick's deferred one when
    /// other requests are in flight), one slot of the in-flight and read
    /// budgets each. A batch too large for that (a read of several pieces,
    /// more reads than the connection keeps in flight, more bytes than the
    /// read budget) goes read by read, all started at once.
    async fn read_many(self: Arc<Self>, srcs: Vec<RemoteRegion>) -> Result<Vec<Bytes>> {
        for s in &srcs {
            check_rdma_len(s.len)?;
        }
        let total: u64 = srcs.iter().map(|s| s.len.max(1)).sum();
        let max_inflight = self.info.capabilities.max_inflight as usize;
        if srcs.iter().any(|s| s.len > MAX_PIECE)
            || srcs.len() > max_inflight
            || total > READ_OUTSTANDING as u64
        {
            let reads = srcs.into_iter().map(|s| self.clone().read(s)).collect();
            return join_all(reads).await.into_iter().collect();
        }
        if srcs.is_empty() {
            return Ok(Vec::new());
        }
        let _permits = self
            .inflight
            .acquire_many(srcs.len() as u32)
            .await
            .map_err(|_| self.disconnected())?;
        let _budget = self
            .read_budget
            .acquire_many(total as u32)
            .await
            .map_err(|_| self.disconnected())?;
        let mut frames = Vec::with_capacity(srcs.len());
        let mut waits = Vec::with_capacity(srcs.len());
        // One block of ids, so one guard covers the batch.
        let count = srcs.len() as u64;
        let first = self.next_id.fetch_add(count, Ordering::Relaxed);
        let mut guard = PendingGuard::new(&self, first, count, false);
        let others_in_flight = {
            let mut pending = self.pending.lock();
            let before = pending.len();
            for (src, id) in srcs.iter().zip(first..) {
                let mut h = read_header(src, 0, src.len);
                h.id = id;
                let (tx, rx) = oneshot::channel();
                pending.insert(id, tx);
                waits.push(rx);
                frames.push(OutFrame::new(h, Bytes::new()));
            }
            before > 0
        };
        if let Some(e) = self.closed_error() {
            return Err(e);
        }
        if others_in_flight {
            self.enqueue_deferred_many(frames)?;
        } else {
            self.enqueue_many(frames)?;
        }
        let mut out = Vec::with_capacity(srcs.len());
        for (rx, src) in waits.into_iter().zip(&srcs) {
            let r = rx.await.map_err(|_| self.disconnected())?;
            status(r.status)?;
            self.check_read_response(r.payload.len(), src.len)?;
            out.push(r.payload);
        }
        guard.answered();
        Ok(out)
    }

    /// Read `src` into the caller's registered `dst` (same length): a
    /// response of one piece that comes in large is received straight from
    /// the socket into the slice; a small one is copied in, and a read of
    /// several pieces is assembled first, then copied.
    async fn read_into(self: Arc<Self>, src: RemoteRegion, dst: LocalSlice) -> Result<()> {
        check_rdma_len(src.len)?;
        if (src.len as usize) < DIRECT_MIN || src.len > MAX_PIECE {
            let data = self.read(src).await?;
            return dst.fill_from(&data);
        }
        let _permit = self.inflight_permit().await?;
        let sink = SliceSink::new(dst.clone());
        let r = self
            .request_read(src, 0, src.len, None, Some(sink.clone()))
            .await?;
        if !r.payload.is_empty() {
            // Came in with other frames (buffered whole): copied in.
            return dst.fill_from(&r.payload);
        }
        if sink.revoked() {
            return Err(Error::LocalAccess(AccessError::Revoked));
        }
        Ok(())
    }

    /// Read `src` into `sink` at `offset`, each piece's response received
    /// straight into its place.
    async fn read_part(
        self: Arc<Self>,
        src: RemoteRegion,
        sink: ReadSink,
        offset: usize,
    ) -> Result<()> {
        check_rdma_len(src.len)?;
        if !sink.fits(offset, src.len as usize) {
            return Err(Error::InvalidArgument(format!(
                "a read of {} bytes into a {}-byte read at offset {offset}",
                src.len,
                sink.len()
            )));
        }
        let _permit = self.inflight_permit().await?;
        self.read_pieces(src, &sink, offset).await
    }

    /// Read all of `src` into `sink` at `offset`, its pieces in flight at
    /// once, each received straight into its place.
    async fn read_pieces(
        self: &Arc<Self>,
        src: RemoteRegion,
        sink: &ReadSink,
        offset: usize,
    ) -> Result<()> {
        let futs: Vec<_> = pieces(src.len)
            .into_iter()
            .map(|(off, len)| self.read_piece(src, off, len, Some((sink, offset + off as usize))))
            .collect();
        for part in join_all(futs).await {
            part?;
        }
        Ok(())
    }

    /// A read response must carry exactly the bytes asked for; anything
    /// else is a broken peer, and fails the connection.
    fn check_read_response(&self, got: usize, want: u64) -> Result<()> {
        if got as u64 == want {
            return Ok(());
        }
        let e = Error::Protocol(format!(
            "read response of {got} bytes for a {want}-byte read"
        ));
        self.fail(e.clone());
        Err(e)
    }

    /// A slot of the connection's operations in flight.
    async fn inflight_permit(&self) -> Result<SemaphorePermit<'_>> {
        // A free slot is taken at once (tokio's semaphore hands released
        // permits to queued waiters first, so this never jumps the queue).
        if let Ok(p) = self.inflight.try_acquire() {
            return Ok(p);
        }
        self.inflight
            .acquire()
            .await
            .map_err(|_| self.disconnected())
    }

    /// `bytes` of the read budget ([`READ_OUTSTANDING`]), waiting while it is spent.
    async fn read_budget_permit(&self, bytes: u32) -> Result<SemaphorePermit<'_>> {
        if let Ok(p) = self.read_budget.try_acquire_many(bytes) {
            return Ok(p);
        }
        self.read_budget
            .acquire_many(bytes)
            .await
            .map_err(|_| self.disconnected())
    }

    /// Read `len` bytes at `off` of `src`: into a sink at the given offset
    /// (then the returned bytes are empty) or, without one, as the returned
    /// bytes.
    async fn read_piece(
        self: &Arc<Self>,
        src: RemoteRegion,
        off: u64,
        len: u64,
        sink: Option<(&ReadSink, usize)>,
    ) -> Result<Bytes> {
        let r = self
            .request_read(src, off, len, sink.map(|(s, at)| (s.clone(), at)), None)
            .await?;
        if let (Some((s, at)), false) = (sink, r.payload.is_empty()) {
            // Short enough to have come in with other frames: copied into place.
            s.fill(at, &r.payload).await?;
            return Ok(Bytes::new());
        }
        Ok(r.payload)
    }

    /// One read request of `len` bytes at `off` of `src`, under its share
    /// of the read budget, its answer received into `sink` or `slice` when
    /// it comes in large; the answer's status and length are checked.
    async fn request_read(
        self: &Arc<Self>,
        src: RemoteRegion,
        off: u64,
        len: u64,
        sink: Option<(ReadSink, usize)>,
        slice: Option<Arc<SliceSink>>,
    ) -> Result<Resp> {
        let _budget = self.read_budget_permit(len.max(1) as u32).await?;
        let h = read_header(&src, off, len);
        let r = self.request_into(h, Bytes::new(), sink, slice).await?;
        status(r.status)?;
        self.check_read_response(r.payload.len() + r.filled, len)?;
        Ok(r)
    }

    async fn write(
        self: Arc<Self>,
        dst: RemoteRegion,
        data: Bytes,
        imm: Option<u32>,
    ) -> Result<()> {
        check_rdma_len(dst.len)?;
        let _permit = self.inflight_permit().await?;
        if imm.is_some() {
            // A write-with-immediate consumes one of the peer's receive credits.
            let _order = self.send_turn().await;
            self.take_credit(0).await?;
        }
        if dst.len <= MAX_PIECE {
            // One piece (the common case): sent and awaited as is.
            let mut h = Header::new(Kind::Write);
            h.addr = dst.addr;
            h.rkey = dst.rkey;
            h.a = dst.len;
            h.flags |= FLAG_LAST;
            if let Some(v) = imm {
                h.flags |= FLAG_IMM;
                h.imm = v;
            }
            return status(self.request(h, data).await?.status);
        }
        let pieces = pieces(dst.len);
        let last = pieces.len() - 1;
        let futs: Vec<_> = pieces
            .into_iter()
            .enumerate()
            .map(|(i, (off, len))| {
                let mut h = Header::new(Kind::Write);
                h.addr = dst.addr;
                h.rkey = dst.rkey;
                h.a = dst.len;
                h.b = off;
                if i == last {
                    h.flags |= FLAG_LAST;
                    if let Some(v) = imm {
                        h.flags |= FLAG_IMM;
                        h.imm = v;
                    }
                }
                let piece = data.slice(off as usize..(off + len) as usize);
                let this = self.clone();
                async move { status(this.request(h, piece).await?.status) }
            })
            .collect();
        for r in join_all(futs).await {
            r?;
        }
        Ok(())
    }

    /// A write's frames and then a message's, queued together (one
    /// `writev` when the socket is idle): the peer's reader applies the
    /// write before it reads the message, so the message waits for no
    /// acknowledgement. Waits for the write's answers.
    async fn write_then_send(
        self: Arc<Self>,
        dst: RemoteRegion,
        data: Bytes,
        msg: Bytes,
    ) -> Result<()> {
        check_rdma_len(dst.len)?;
        let len = msg.len() as u64;
        self.check_message(len)?;
        let _permit = self.inflight_permit().await?;
        // FIFO with other senders; nothing is queued before the credit is ours.
        let order = self.send_turn().await;
        self.take_credit(len).await?;
        let mut frames = Vec::new();
        let mut waits = Vec::new();
        let parts = pieces(dst.len);
        let count = parts.len() as u64;
        let first = self.next_id.fetch_add(count, Ordering::Relaxed);
        let mut guard = PendingGuard::new(&self, first, count, false);
        for ((off, plen), id) in parts.into_iter().zip(first..) {
            let mut h = Header::new(Kind::Write);
            h.id = id;
            h.addr = dst.addr;
            h.rkey = dst.rkey;
            h.a = dst.len;
            h.b = off;
            // A message follows: nothing waits on the answer but this call.
            h.flags |= FLAG_ACK_LATER;
            if off + plen == dst.len {
                h.flags |= FLAG_LAST;
            }
            let (tx, rx) = oneshot::channel();
            self.pending.lock().insert(h.id, tx);
            waits.push(rx);
            self.stats.add(|s| &s.bytes_sent, plen);
            frames.push(OutFrame::new(
                h,
                data.slice(off as usize..(off + plen) as usize),
            ));
        }
        self.stats.add(|s| &s.bytes_sent, len);
        frames.push(OutFrame::new(Header::new(Kind::Send), msg));
        self.enqueue_many(frames)?;
        drop(order);
        for rx in waits {
            let r = rx.await.map_err(|_| self.disconnected())?;
            status(r.status)?;
        }
        guard.answered();
        Ok(())
    }

    async fn atomic(self: Arc<Self>, dst: RemoteRegion, op: AtomicOp) -> Result<u64> {
        let _permit = self.inflight_permit().await?;
        let mut h = Header::new(Kind::Atomic);
        h.addr = dst.addr;
        h.rkey = dst.rkey;
        match op {
            AtomicOp::CompareAndSwap { expected, new } => {
                h.a = expected;
                h.b = new;
            }
            AtomicOp::FetchAndAdd { add } => {
                h.flags = FLAG_FAA;
                h.a = add;
            }
        }
        let r = self.request(h, Bytes::new()).await?;
        status(r.status)?;
        Ok(r.value)
    }

    // --------------------------------------------------------------- two-sided

    /// A message must fit the peer's receive buffers.
    fn check_message(&self, len: u64) -> Result<()> {
        if len > self.peer.max_message {
            return Err(Error::ResourceExhausted(format!(
                "message of {len} bytes exceeds the peer's limit of {}",
                self.peer.max_message
            )));
        }
        Ok(())
    }

    /// Take one message credit and `bytes` of window if there are; no waiting.
    fn try_take_credit(&self, bytes: u64) -> bool {
        let mut c = self.credits.lock();
        if c.msgs >= 1 && c.bytes >= bytes {
            c.msgs -= 1;
            c.bytes -= bytes;
            return true;
        }
        false
    }

    /// Take one message credit and `bytes` of window, waiting while there are none.
    async fn take_credit(&self, bytes: u64) -> Result<()> {
        // The common case, credit at hand: no waiter registered.
        if self.closed.lock().is_none() && self.try_take_credit(bytes) {
            return Ok(());
        }
        let mut stalled = false;
        loop {
            let notified = self.credit_wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(e) = self.closed_error() {
                return Err(e);
            }
            {
                let mut c = self.credits.lock();
                if c.msgs >= 1 && c.bytes >= bytes {
                    c.msgs -= 1;
                    c.bytes -= bytes;
                    return Ok(());
                }
            }
            if !stalled {
                stalled = true;
                self.stats.add(|s| &s.credit_stalls, 1);
                tracing::trace!("send stalled: peer has no receive credits");
            }
            notified.await;
        }
    }

    async fn send(self: Arc<Self>, msg: Bytes) -> Result<()> {
        let len = msg.len() as u64;
        self.check_message(len)?;
        // Nobody else sending, and credit at hand (the common case): no turn
        // to take. (A closed connection is reported by `enqueue`.)
        if self.turns.load(Ordering::Acquire) > 0 || !self.try_take_credit(len) {
            // FIFO among concurrent senders; dropping while waiting sends nothing.
            let _order = self.send_turn().await;
            self.take_credit(len).await?;
        }
        self.stats.add(|s| &s.bytes_sent, len);
        self.enqueue(OutFrame::new(Header::new(Kind::Send), msg))
    }

    /// This sender's turn among concurrent ones (FIFO: a free lock is only
    /// taken at once when nobody queues for it).
    async fn send_turn(&self) -> SendTurn<'_> {
        take_turn(&self.send_order, &self.turns).await
    }

    /// Several messages in order, in as few `writev`s as credits allow: the
    /// frames that have credits go out together; when one must wait for
    /// credits, those before it are queued first (so no credit is ever taken
    /// for a frame that a cancelled caller then does not send).
    async fn send_many(self: Arc<Self>, msgs: Vec<Bytes>) -> Result<()> {
        for m in &msgs {
            self.check_message(m.len() as u64)?;
        }
        let _order = self.send_turn().await;
        let mut ready = Vec::with_capacity(msgs.len());
        for msg in msgs {
            let len = msg.len() as u64;
            if !self.try_take_credit(len) {
                self.enqueue_many(std::mem::take(&mut ready))?;
                self.take_credit(len).await?;
            }
            self.stats.add(|s| &s.bytes_sent, len);
            ready.push(OutFrame::new(Header::new(Kind::Send), msg));
        }
        self.enqueue_many(ready)
    }

    /// Take the next received message or notice from `r`, if one is
    /// queued, with the credit frame to send when a batch of credits is due
    /// back to the peer.
    fn take_queued(&self, r: &mut RecvState) -> Option<(Incoming, Option<Header>)> {
        let item = r.queue.pop_front()?;
        let len = match &item {
            Incoming::Message(b) => b.len() as u64,
            Incoming::WriteImm { .. } => 0,
        };
        r.consumed_msgs += 1;
        r.consumed_bytes += len;
        // Return credits in batches of a quarter window (see
        // Limits::from_options for why this cannot deadlock).
        let grant = r.consumed_msgs >= u64::from(self.ours.credits / 4)
            || r.consumed_bytes >= self.ours.window / 4;
        let frame = grant.then(|| {
            let mut h = Header::new(Kind::Credit);
            h.a = r.consumed_msgs;
            h.b = r.consumed_bytes;
            r.peer_msgs_left += r.consumed_msgs;
            r.peer_bytes_left += r.consumed_bytes;
            r.consumed_msgs = 0;
            r.consumed_bytes = 0;
            h
        });
        Some((item, frame))
    }

    /// Send a credit frame [`Shared::take_queued`] asked for.
    fn grant(&self, frame: Option<Header>) {
        if let Some(h) = frame {
            // Best effort: if the connection died, the next call says so.
            let _ = self.enqueue(OutFrame::new(h, Bytes::new()));
        }
    }

    async fn close(self: Arc<Self>) -> Result<()> {
        if self.closed_error().is_some() {
            return Ok(());
        }
        self.enqueue(OutFrame::new(Header::new(Kind::Close), Bytes::new()))?;
        self.flush().await;
        // Half-close, and let the reader take what the peer still sends
        // (credit returns for the messages it is reading) until the peer,
        // having read our Close, closes too. Shutting the read side at once
        // would make the kernel answer such data with a reset (RFC 1122
        // 4.2.2.13; Linux does so in FIN_WAIT), and the reset would throw
        // away what the peer had received but not yet read.
        let _ = socket2::SockRef::from(&self.stream).shutdown(std::net::Shutdown::Write);
        let deadline = Instant::now() + CLOSE_LINGER;
        loop {
            let gone = self.closed_wake.notified();
            tokio::pin!(gone);
            gone.as_mut().enable();
            if self.closed_error().is_some() {
                break;
            }
            if tokio::time::timeout_at(deadline.into(), gone)
                .await
                .is_err()
            {
                break;
            }
        }
        self.fail(Error::Disconnected("connection closed locally".into()));
        Ok(())
    }
}

/// A sender's turn ([`Shared::send_turn`]): holds the order lock, and
/// counts itself in [`Shared::turns`] from before it waits for the lock
/// until it is dropped.
struct SendTurn<'a> {
    _turn: tokio::sync::MutexGuard<'a, ()>,
    _counted: TurnCount<'a>,
}

/// A turn of `order`, counted in `turns` from before it waits.
async fn take_turn<'a>(order: &'a tokio::sync::Mutex<()>, turns: &'a AtomicUsize) -> SendTurn<'a> {
    let counted = TurnCount::new(turns);
    let turn = match order.try_lock() {
        Ok(turn) => turn,
        Err(_) => order.lock().await,
    };
    SendTurn {
        _turn: turn,
        _counted: counted,
    }
}

/// One in [`Shared::turns`] while it lives (dropped with a cancelled wait
/// for the turn, too).
struct TurnCount<'a>(&'a AtomicUsize);

impl<'a> TurnCount<'a> {
    fn new(turns: &'a AtomicUsize) -> TurnCount<'a> {
        turns.fetch_add(1, Ordering::AcqRel);
        TurnCount(turns)
    }
}

impl Drop for TurnCount<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// How long a graceful close waits for the peer to close its side.
const CLOSE_LINGER: Duration = Duration::from_secs(2);

/// Removes the waiters of requests `first..first + count` (and their
/// [`ReadSink`]s) when their operation ends before every response came:
/// it was dropped, or it failed part-way. Once every response has come, the
/// reader has removed each waiter as it answered it: nothing is left to
/// take, so an answered operation does not lock the table again.
struct PendingGuard<'a> {
    shared: &'a Shared,
    first: u64,
    count: u64,
    /// The requests registered [`ReadSink`]s too.
    sink: bool,
    /// The request's answer goes into the caller's slice: closed on drop, so
    /// that nothing lands in it once the operation is over.
    slice: Option<Arc<SliceSink>>,
    /// Every response came ([`PendingGuard::answered`]).
    answered: bool,
}

impl<'a> PendingGuard<'a> {
    fn new(shared: &'a Shared, first: u64, count: u64, sink: bool) -> Self {
        PendingGuard {
            shared,
            first,
            count,
            sink,
            slice: None,
            answered: false,
        }
    }

    /// Every request's response came (the reader took each waiter out).
    fn answered(&mut self) {
        self.answered = true;
    }
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        let ids = self.first..self.first + self.count;
        if !self.answered {
            let mut pending = self.shared.pending.lock();
            for id in ids.clone() {
                pending.remove(&id);
            }
        }
        // A sink stays registered when its response came small (with other
        // frames, copied in by the waiter): always removed here.
        if self.sink {
            let mut sinks = self.shared.sinks.lock();
            for id in ids {
                sinks.remove(&id);
            }
        }
        if let Some(s) = self.slice.take() {
            self.shared.slice_sinks.lock().remove(&self.first);
            s.close();
        }
    }
}

fn status(code: u8) -> Result<()> {
    if code == STATUS_OK {
        return Ok(());
    }
    Err(match AccessError::from_code(code) {
        Some(a) => Error::RemoteAccess(a),
        None => Error::Protocol(format!("unknown response status {code}")),
    })
}

fn check_rdma_len(len: u64) -> Result<()> {
    if len > MAX_RDMA_SIZE {
        return Err(Error::InvalidArgument(format!(
            "one-sided operation of {len} bytes exceeds the limit of {MAX_RDMA_SIZE}"
        )));
    }
    Ok(())
}

/// The request frame for `len` bytes at `off` of `src` (the whole range's
/// length rides along: the peer checks the piece against it).
fn read_header(src: &RemoteRegion, off: u64, len: u64) -> Header {
    let mut h = Header::new(Kind::Read);
    h.addr = src.addr;
    h.rkey = src.rkey;
    h.a = src.len;
    h.b = off;
    h.imm = len as u32;
    h
}

/// Split an operation into (offset, len) pieces of at most [`MAX_PIECE`] bytes.
fn pieces(len: u64) -> Vec<(u64, u64)> {
    if len == 0 {
        return vec![(0, 0)];
    }
    (0..len.div_ceil(MAX_PIECE))
        .map(|i| {
            let off = i * MAX_PIECE;
            (off, MAX_PIECE.min(len - off))
        })
        .collect()
}

/// Await all futures concurrently, keeping their order.
async fn join_all<F: std::future::Future>(futs: Vec<F>) -> Vec<F::Output> {
    use std::pin::Pin;
    use std::task::Poll;
    let mut futs: Vec<Pin<Box<F>>> = futs.into_iter().map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = futs.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (f, slot) in futs.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                match f.as_mut().poll(cx) {
                    Poll::Ready(v) => *slot = Some(v),
                    Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    out.into_iter().map(|v| v.expect("all ready")).collect()
}

impl RawConnection for TcpConnection {
    fn info(&self) -> ConnectionInfo {
        self.shared.info.clone()
    }

    fn stats(&self) -> &Arc<Stats> {
        &self.shared.stats
    }

    fn domain(&self) -> &Domain {
        &self.shared.domain
    }

    fn send(&self, msg: Bytes) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.shared.clone().send(msg))
    }

    fn send_many(&self, msgs: Vec<Bytes>) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.shared.clone().send_many(msgs))
    }

    fn recv(&self) -> BoxFuture<'static, Result<Incoming>> {
        Box::pin(RecvWait {
            shared: self.shared.clone(),
            waiter: None,
        })
    }

    fn read(&self, src: RemoteRegion) -> BoxFuture<'static, Result<Bytes>> {
        Box::pin(self.shared.clone().read(src))
    }

    fn read_many(&self, srcs: Vec<RemoteRegion>) -> BoxFuture<'static, Result<Vec<Bytes>>> {
        Box::pin(self.shared.clone().read_many(srcs))
    }

    fn read_into(&self, src: RemoteRegion, dst: LocalSlice) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.shared.clone().read_into(src, dst))
    }

    fn read_part(
        &self,
        src: RemoteRegion,
        sink: ReadSink,
        offset: usize,
    ) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.shared.clone().read_part(src, sink, offset))
    }

    fn write(
        &self,
        dst: RemoteRegion,
        data: Bytes,
        imm: Option<u32>,
    ) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.shared.clone().write(dst, data, imm))
    }

    fn write_then_send(
        &self,
        dst: RemoteRegion,
        data: Bytes,
        msg: Bytes,
    ) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.shared.clone().write_then_send(dst, data, msg))
    }

    fn atomic(&self, dst: RemoteRegion, op: AtomicOp) -> BoxFuture<'static, Result<u64>> {
        Box::pin(self.shared.clone().atomic(dst, op))
    }

    fn close(&self) -> BoxFuture<'static, Result<()>> {
        Box::pin(self.shared.clone().close())
    }

    fn cork(&self) {
        self.shared.cork();
    }

    fn uncork(&self) {
        self.shared.uncork();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sender counts in `turns` from before it waits for its turn until it
    /// is done, a cancelled wait included: while one waits, a send with
    /// credit at hand may not post past it (`Shared::send`).
    #[tokio::test]
    async fn turns_count_holders_and_waiters_until_they_go() {
        use std::future::Future;
        let order = tokio::sync::Mutex::new(());
        let turns = AtomicUsize::new(0);
        let count = || turns.load(Ordering::Acquire);
        let first = take_turn(&order, &turns).await;
        assert_eq!(count(), 1);
        let mut waiting = Box::pin(take_turn(&order, &turns));
        let noop = std::task::Waker::noop();
        assert!(waiting
            .as_mut()
            .poll(&mut std::task::Context::from_waker(noop))
            .is_pending());
        assert_eq!(count(), 2, "a waiter counts before it has the turn");
        drop(waiting);
        assert_eq!(count(), 1, "a cancelled wait leaves no count behind");
        let mut next = Box::pin(take_turn(&order, &turns));
        assert!(next
            .as_mut()
            .poll(&mut std::task::Context::from_waker(noop))
            .is_pending());
        drop(first);
        let second = next.await;
        assert_eq!(count(), 1, "the turn passed on");
        drop(second);
        assert_eq!(count(), 0);
    }

    #[test]
    fn pieces_cover_exactly() {
        assert_eq!(pieces(0), vec![(0, 0)]);
        assert_eq!(pieces(5), vec![(0, 5)]);
        let p = pieces(2 * MAX_PIECE + 3);
        assert_eq!(
            p,
            vec![(0, MAX_PIECE), (MAX_PIECE, MAX_PIECE), (2 * MAX_PIECE, 3)]
        );
    }
}
