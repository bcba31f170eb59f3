//! Connections and their operations.

use std::fmt;
use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::caps::Capabilities;
use crate::error::{Error, Result};
use crate::memory::{AtomicOp, Domain, LocalSlice, MemoryRegion, RemoteRegion};
use crate::shared_deadline::SharedDeadline;
use crate::stats::{Stats, StatsSnapshot};

/// A boxed, sendable future (what transports return).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Something that arrived on a connection's receive side.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Incoming {
    /// A two-sided message, boundaries preserved.
    Message(Bytes),
    /// The peer's write-with-immediate landed: `len` bytes are in our region.
    WriteImm {
        /// The 32-bit immediate value the writer attached.
        imm: u32,
        /// Bytes written.
        len: u64,
    },
}

impl Incoming {
    /// The message payload, or an error if this was a write notice.
    pub fn into_message(self) -> Result<Bytes> {
        match self {
            Incoming::Message(b) => Ok(b),
            Incoming::WriteImm { imm, .. } => Err(Error::InvalidArgument(format!(
                "expected a message, got a write-with-immediate notice (imm {imm})"
            ))),
        }
    }
}

/// What a connection is, and how it came to be.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConnectionInfo {
    /// Transport actually carrying data (`"tcp"`, `"soft-roce"`, `"rdma"`).
    pub transport: String,
    /// Provider detail (e.g. device name for RDMA, `"kernel-tcp"` for TCP).
    pub provider: String,
    /// Why the connection is not using the transport the URL asked for, if it is not.
    pub fallback_reason: Option<String>,
    /// Our socket address.
    pub local_addr: Option<SocketAddr>,
    /// The peer's socket address.
    pub peer_addr: Option<SocketAddr>,
    /// Capabilities negotiated for this connection.
    pub capabilities: Capabilities,
    /// True if shared-secret authentication succeeded on this connection.
    pub authenticated: bool,
    /// Set on a transport connection that is one lane of a larger connection
    /// (as its handshake agreed); `None` otherwise.
    #[serde(default)]
    pub lane: Option<crate::lanes::LaneTag>,
    /// Lanes this connection carries its operations over (1 unless striped;
    /// see [`crate::lanes`]).
    #[serde(default = "one_lane")]
    pub lanes: u16,
}

fn one_lane() -> u16 {
    1
}

/// The interface a transport implements for one connection.
///
/// Users call [`Connection`], which adds deadlines, counters and tracing on top.
/// Every future returned must be `'static` and own what it needs: dropping it at
/// any await point must leave the connection usable and must not let the
/// transport touch memory the caller may reuse.
pub trait RawConnection: Send + Sync + 'static {
    /// Static facts about the connection.
    fn info(&self) -> ConnectionInfo;
    /// The connection's counters.
    fn stats(&self) -> &Arc<Stats>;
    /// A copy of the counters (a striped connection sums its lanes').
    fn snapshot(&self) -> StatsSnapshot {
        self.stats().snapshot()
    }
    /// The counters of each lane (one entry unless striped).
    fn lane_snapshots(&self) -> Vec<StatsSnapshot> {
        vec![self.snapshot()]
    }
    /// The domain whose regions this connection serves to the peer.
    fn domain(&self) -> &Domain;
    /// Send one message; waits for a receive credit.
    fn send(&self, msg: Bytes) -> BoxFuture<'static, Result<()>>;
    /// Send one message, returning once it is posted (in order behind
    /// everything posted before it) rather than when it completes (on RDMA,
    /// when the peer acknowledges it). A failure after posting is not
    /// reported here: the transport fails the connection, so later
    /// operations (the receive of an answer) see it. The default waits for
    /// the completion, as [`RawConnection::send`].
    fn post_send(&self, msg: Bytes) -> BoxFuture<'static, Result<()>> {
        self.send(msg)
    }
    /// Send several messages in order, as one unit where the transport can
    /// (one `writev` for TCP). The default starts every send at once, in
    /// order (each posted before the next one is polled), and waits for all.
    fn send_many(&self, msgs: Vec<Bytes>) -> BoxFuture<'static, Result<()>> {
        all_in_order(msgs.into_iter().map(|m| self.send(m)).collect())
    }
    /// Receive the next message or write-with-immediate notice.
    fn recv(&self) -> BoxFuture<'static, Result<Incoming>>;
    /// Read the remote range; the returned bytes are owned by the caller.
    fn read(&self, src: RemoteRegion) -> BoxFuture<'static, Result<Bytes>>;
    /// Several reads posted as one unit (RDMA's chained work requests behind
    /// one doorbell; one `writev` of requests for TCP), their data returned
    /// in the order asked; the first error ends the batch. The default
    /// starts every read at once, in order, and waits for all.
    fn read_many(&self, srcs: Vec<RemoteRegion>) -> BoxFuture<'static, Result<Vec<Bytes>>> {
        collect_in_order(srcs.into_iter().map(|s| self.read(s)).collect())
    }
    /// Read the remote range into `dst`, a local registered slice of the
    /// same length (checked by the caller). While the read is in flight the
    /// slice's bytes are unspecified, as with an RDMA READ into a registered
    /// buffer; once the returned future completes, fails or is dropped, the
    /// transport never writes the slice again. The default reads, then
    /// copies; a transport that can receive into the slice directly
    /// overrides it.
    fn read_into(&self, src: RemoteRegion, dst: LocalSlice) -> BoxFuture<'static, Result<()>> {
        let read = self.read(src);
        Box::pin(async move { dst.fill_from(&read.await?) })
    }
    /// Read the remote range into `sink` at `offset`: one part of a larger
    /// read assembled in place (a read split over lanes). The default reads,
    /// then copies; a transport that can receive into the sink directly
    /// overrides it.
    fn read_part(
        &self,
        src: RemoteRegion,
        sink: crate::pool::ReadSink,
        offset: usize,
    ) -> BoxFuture<'static, Result<()>> {
        let read = self.read(src);
        Box::pin(async move {
            let data = read.await?;
            sink.fill(offset, &data).await
        })
    }
    /// Write `data` to the remote range (`data.len() == dst.len`), optionally with an
    /// immediate that the peer receives through `recv` after the data landed.
    fn write(
        &self,
        dst: RemoteRegion,
        data: Bytes,
        imm: Option<u32>,
    ) -> BoxFuture<'static, Result<()>>;
    /// Write `data` to `dst`, then send `msg`, which the peer receives only
    /// after the write's data is in place. A transport that keeps its
    /// operations in order (an RDMA queue pair, IBTA 9.5; one TCP stream)
    /// posts both at once, so the message does not wait for the write's
    /// acknowledgement; the default waits for the write, then sends. If the
    /// write fails, the error is the write's, and whether the message was
    /// delivered depends on the transport.
    fn write_then_send(
        &self,
        dst: RemoteRegion,
        data: Bytes,
        msg: Bytes,
    ) -> BoxFuture<'static, Result<()>> {
        let write = self.write(dst, data, None);
        let send = self.send(msg);
        Box::pin(async move {
            write.await?;
            send.await
        })
    }
    /// Several [`RawConnection::write_then_send`]s as one unit: every
    /// WRITE, then every message, in order. Each message still arrives after
    /// its own WRITE's data is in place, and the messages keep their order;
    /// a message may arrive after the WRITEs of later pairs too (what lets
    /// a transport send the WRITEs together and the messages together: on
    /// RDMA, one run of WRITE packets and one bundled SEND). The default
    /// starts every pair at once, in order, and waits for all.
    fn write_then_send_many(&self, pairs: Vec<WriteThenSend>) -> BoxFuture<'static, Result<()>> {
        all_in_order(
            pairs
                .into_iter()
                .map(|p| self.write_then_send(p.dst, p.data, p.msg))
                .collect(),
        )
    }
    /// Run an atomic on the remote 8-byte word; returns the old value.
    fn atomic(&self, dst: RemoteRegion, op: AtomicOp) -> BoxFuture<'static, Result<u64>>;
    /// Close gracefully: the peer sees a clean disconnect.
    fn close(&self) -> BoxFuture<'static, Result<()>>;
    /// Hold what is posted from now on until the matching
    /// [`RawConnection::uncork`], so that it leaves together (TCP: one
    /// `writev`, as Linux's `TCP_CORK`). Corks nest. A transport that
    /// cannot hold its operations (the default) ignores it.
    fn cork(&self) {}
    /// End one [`RawConnection::cork`]; the last one sends what was held.
    fn uncork(&self) {}
}

/// Operations started at once, in order (each polled, and so posted,
/// before the next one is), finished when all are; the first error ends it.
fn all_in_order(ops: Vec<BoxFuture<'static, Result<()>>>) -> BoxFuture<'static, Result<()>> {
    let all = collect_in_order(ops);
    Box::pin(async move { all.await.map(|_| ()) })
}

/// [`all_in_order`] keeping each operation's value, in the operations' order.
fn collect_in_order<T: Send + 'static>(
    mut ops: Vec<BoxFuture<'static, Result<T>>>,
) -> BoxFuture<'static, Result<Vec<T>>> {
    let mut done: Vec<Option<T>> = ops.iter().map(|_| None).collect();
    Box::pin(std::future::poll_fn(move |cx| {
        let mut busy = false;
        for (op, done) in ops.iter_mut().zip(done.iter_mut()) {
            if done.is_some() {
                continue;
            }
            match op.as_mut().poll(cx) {
                std::task::Poll::Ready(Ok(v)) => *done = Some(v),
                std::task::Poll::Ready(Err(e)) => return std::task::Poll::Ready(Err(e)),
                std::task::Poll::Pending => busy = true,
            }
        }
        if busy {
            return std::task::Poll::Pending;
        }
        let values = done
            .iter_mut()
            .map(|v| v.take().expect("finished"))
            .collect();
        std::task::Poll::Ready(Ok(values))
    }))
}

/// One WRITE and the message that follows it
/// ([`Connection::write_then_send_many`]).
#[derive(Clone, Debug)]
pub struct WriteThenSend {
    /// Where the data goes (`data.len() == dst.len`).
    pub dst: RemoteRegion,
    /// The data to write.
    pub data: Bytes,
    /// The message the peer receives once the data is in place.
    pub msg: Bytes,
}

/// A write must fill its remote range exactly.
fn check_write_len(data: &Bytes, dst: &RemoteRegion) -> Result<()> {
    if data.len() as u64 != dst.len {
        return Err(Error::InvalidArgument(format!(
            "write of {} bytes to a {}-byte remote range",
            data.len(),
            dst.len
        )));
    }
    Ok(())
}

/// Default deadline for one operation.
pub const DEFAULT_OP_TIMEOUT: Duration = Duration::from_secs(10);

/// A connection to a peer, over whichever transport was selected.
///
/// Cheap to clone; clones share the connection, so many tasks can keep
/// operations in flight at once. The connection closes when the last clone drops.
#[derive(Clone)]
pub struct Connection {
    raw: Arc<dyn RawConnection>,
    info: Arc<ConnectionInfo>,
    op_timeout: Duration,
}

impl fmt::Debug for Connection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Connection")
            .field("transport", &self.info.transport)
            .field("peer", &self.info.peer_addr)
            .field("fallback_reason", &self.info.fallback_reason)
            .finish()
    }
}

/// Which kind of operation an [`Op`] is (for counters and spans).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    Send,
    Recv,
    Read,
    Write,
    Atomic,
    Close,
    /// A write and a send after it.
    WriteThenSend,
}

impl OpKind {
    fn as_str(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Atomic => "atomic",
            OpKind::Close => "close",
            OpKind::WriteThenSend => "write_then_send",
        }
    }
}

/// A pending operation. Await it (or call [`Op::timeout`] first to change its
/// deadline). Dropping it cancels the wait; see the crate docs for what
/// cancellation guarantees.
#[must_use = "operations do nothing unless awaited"]
pub struct Op<T> {
    fut: OpInner<T>,
    timeout: Option<Duration>,
    kind: OpKind,
    bytes: u64,
    /// Operations this one stands for in the counters (a batch of sends: several).
    count: u64,
    stats: Arc<Stats>,
}

/// What an [`Op`] awaits: the transport's future, or its receive and the
/// conversion of what arrives (a typed receive without a second boxed
/// future around the first).
enum OpInner<T> {
    Plain(BoxFuture<'static, Result<T>>),
    Received(
        BoxFuture<'static, Result<Incoming>>,
        fn(Incoming) -> Result<T>,
    ),
}

impl<T> OpInner<T> {
    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<Result<T>> {
        match self {
            OpInner::Plain(f) => f.as_mut().poll(cx),
            OpInner::Received(f, convert) => f.as_mut().poll(cx).map(|r| r.and_then(*convert)),
        }
    }
}

impl<T> Op<T> {
    /// Replace the deadline for this operation.
    pub fn timeout(mut self, d: Duration) -> Self {
        self.timeout = Some(d);
        self
    }

    /// Wait without a deadline (a dead peer is still reported when the transport
    /// notices the connection failing).
    pub fn no_timeout(mut self) -> Self {
        self.timeout = None;
        self
    }
}

impl<T: Send + 'static> IntoFuture for Op<T> {
    type Output = Result<T>;
    type IntoFuture = OpFuture<T>;

    fn into_future(self) -> OpFuture<T> {
        let Op {
            fut,
            timeout,
            kind,
            bytes,
            count,
            stats,
        } = self;
        OpFuture {
            fut: Some(fut),
            timeout,
            deadline: None,
            kind,
            count,
            stats,
            span: tracing::trace_span!("rdmx.op", op = kind.as_str(), bytes),
        }
    }
}

/// An [`Op`] being awaited: the transport's operation under its deadline,
/// counted when it ends. The deadline is armed only once the operation has
/// to wait (an operation that finishes on its first poll, a send queued on
/// TCP or a post, never reads the clock or joins a timer), and it fires at
/// most a tick of `d / 32` late (see [`crate::shared_deadline`]). A plain
/// struct rather than a boxed `async` block: no allocation of its own per
/// operation.
#[must_use = "futures do nothing unless polled"]
pub struct OpFuture<T> {
    /// The operation; dropped (cancelled, if unfinished) once this ends.
    fut: Option<OpInner<T>>,
    timeout: Option<Duration>,
    deadline: Option<SharedDeadline>,
    kind: OpKind,
    count: u64,
    stats: Arc<Stats>,
    span: tracing::Span,
}

impl<T> fmt::Debug for OpFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpFuture")
            .field("op", &self.kind.as_str())
            .field("timeout", &self.timeout)
            .field("done", &self.fut.is_none())
            .finish()
    }
}

impl<T> Future for OpFuture<T> {
    type Output = Result<T>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = &mut *self;
        let _entered = this.span.enter();
        let Some(fut) = this.fut.as_mut() else {
            panic!("an operation's future polled after it finished");
        };
        let res = match fut.poll(cx) {
            Poll::Ready(r) => r,
            Poll::Pending => {
                let Some(d) = this.timeout else {
                    return Poll::Pending;
                };
                let passed = match &mut this.deadline {
                    // Made with this poll's waker: nothing to update.
                    None => {
                        this.deadline = Some(SharedDeadline::new(d, cx.waker()));
                        false
                    }
                    Some(dl) => dl.poll(cx).is_ready(),
                };
                if !passed {
                    return Poll::Pending;
                }
                this.stats.add(|s| &s.timeouts, 1);
                Err(Error::TimedOut(d))
            }
        };
        this.fut = None;
        this.deadline = None;
        let (stats, count) = (&this.stats, this.count);
        match &res {
            Ok(_) => match this.kind {
                OpKind::Read => stats.add(|s| &s.reads, count),
                OpKind::Write => stats.add(|s| &s.writes, count),
                OpKind::Atomic => stats.add(|s| &s.atomics, count),
                OpKind::Send => stats.add(|s| &s.sends, count),
                OpKind::Recv => stats.add(|s| &s.recvs, count),
                OpKind::Close => {}
                OpKind::WriteThenSend => {
                    stats.add(|s| &s.writes, count);
                    stats.add(|s| &s.sends, count);
                }
            },
            Err(e) => {
                stats.add(|s| &s.errors, 1);
                tracing::debug!(error = %e, "operation failed");
            }
        }
        Poll::Ready(res)
    }
}

impl Connection {
    /// Wrap a transport's connection. `op_timeout` is the default deadline.
    pub fn new(raw: Arc<dyn RawConnection>, op_timeout: Duration) -> Connection {
        let info = Arc::new(raw.info());
        crate::metrics::track(&raw, &info);
        crate::deadline_anchor::ensure();
        Connection {
            raw,
            info,
            op_timeout,
        }
    }

    /// Wrap a connection made of other connections (lanes), which the
    /// per-connection metrics already list one by one.
    pub(crate) fn new_untracked(raw: Arc<dyn RawConnection>, op_timeout: Duration) -> Connection {
        let info = Arc::new(raw.info());
        Connection {
            raw,
            info,
            op_timeout,
        }
    }

    /// The transport's connection underneath.
    pub(crate) fn raw(&self) -> &Arc<dyn RawConnection> {
        &self.raw
    }

    pub(crate) fn set_fallback_reason(&mut self, reason: String) {
        let mut info = (*self.info).clone();
        info.fallback_reason = Some(reason);
        self.info = Arc::new(info);
    }

    fn op<T>(&self, kind: OpKind, bytes: u64, fut: BoxFuture<'static, Result<T>>) -> Op<T> {
        self.op_of(kind, bytes, OpInner::Plain(fut))
    }

    /// A receive whose message `convert` turns into the result, without a
    /// deadline (as [`Connection::recv`]).
    fn typed_recv<T>(&self, convert: fn(Incoming) -> Result<T>) -> Op<T> {
        let mut op = self.op_of(OpKind::Recv, 0, OpInner::Received(self.raw.recv(), convert));
        op.timeout = None;
        op
    }

    fn op_of<T>(&self, kind: OpKind, bytes: u64, fut: OpInner<T>) -> Op<T> {
        Op {
            fut,
            timeout: Some(self.op_timeout),
            kind,
            bytes,
            count: 1,
            stats: self.raw.stats().clone(),
        }
    }

    /// Facts about this connection: transport, provider, fallback reason, peer.
    pub fn info(&self) -> &ConnectionInfo {
        &self.info
    }

    /// The transport really carrying data (`"tcp"`, `"soft-roce"`, `"rdma"`).
    pub fn transport(&self) -> &str {
        &self.info.transport
    }

    /// Why this connection is not on the transport its URL asked for, if so.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.info.fallback_reason.as_deref()
    }

    /// Negotiated capabilities.
    pub fn capabilities(&self) -> &Capabilities {
        &self.info.capabilities
    }

    /// The domain whose regions this connection serves to its peer.
    pub fn domain(&self) -> &Domain {
        self.raw.domain()
    }

    /// This connection's counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.raw.snapshot()
    }

    /// The counters of each lane, lane 0 first (one entry unless the
    /// connection is striped over several; [`Connection::stats`] is their sum).
    pub fn lane_stats(&self) -> Vec<StatsSnapshot> {
        self.raw.lane_snapshots()
    }

    /// Default deadline of operations on this connection.
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// Send a message. Waits while the peer has no receive credit left.
    pub fn send(&self, msg: impl Into<Bytes>) -> Op<()> {
        let msg = msg.into();
        let len = msg.len() as u64;
        self.op(OpKind::Send, len, self.raw.send(msg))
    }

    /// Send a message and finish once it is posted, not when it completes:
    /// for a request whose answer proves its delivery (an RPC call), so the
    /// acknowledgement wakes nobody. A send that fails after posting fails
    /// the connection (see [`RawConnection::post_send`]).
    pub fn post_send(&self, msg: impl Into<Bytes>) -> Op<()> {
        let msg = msg.into();
        let len = msg.len() as u64;
        self.op(OpKind::Send, len, self.raw.post_send(msg))
    }

    /// A message must fit the peer's limit (checked before anything of a
    /// batch leaves).
    fn check_message_len(&self, msg: &Bytes) -> Result<()> {
        let limit = self.info.capabilities.max_message_size;
        if msg.len() as u64 > limit {
            return Err(Error::ResourceExhausted(format!(
                "message of {} bytes exceeds the peer's limit of {limit}",
                msg.len()
            )));
        }
        Ok(())
    }

    /// Send several messages in order, as one unit where the transport can
    /// (TCP: one `writev`): what a caller holding many small messages at once
    /// (an RPC server's answers to one burst of requests) should use. Counts as
    /// `msgs.len()` sends.
    pub fn send_many(&self, msgs: Vec<Bytes>) -> Op<()> {
        let len = msgs.iter().map(|m| m.len() as u64).sum();
        let n = msgs.len() as u64;
        // All or nothing for sizes: no message of a batch leaves if one is too big.
        let fut = match msgs.iter().try_for_each(|m| self.check_message_len(m)) {
            Err(e) => Box::pin(std::future::ready(Err(e))) as BoxFuture<'static, Result<()>>,
            Ok(()) => self.raw.send_many(msgs),
        };
        let mut op = self.op(OpKind::Send, len, fut);
        op.count = n;
        op
    }

    /// Receive the next message (or write-with-immediate notice). No deadline by
    /// default: a server waits for its clients; use [`Op::timeout`] to bound it.
    /// A closed or dead peer ends the wait with [`Error::Disconnected`].
    pub fn recv(&self) -> Op<Incoming> {
        let mut op = self.op(OpKind::Recv, 0, self.raw.recv());
        op.timeout = None;
        op
    }

    /// Receive the next two-sided message.
    pub fn recv_message(&self) -> Op<Bytes> {
        self.typed_recv(Incoming::into_message)
    }

    /// Tell the peer about one of our regions: sends its [`RemoteRegion`] as
    /// one tagged message, which the peer takes with
    /// [`Connection::recv_region`]. Borrowing the region is the point: it must
    /// outlive the peer's use of the descriptor.
    pub fn send_region(&self, mr: &MemoryRegion) -> Op<()> {
        self.send(mr.remote().to_message())
    }

    /// Receive a region descriptor the peer sent with
    /// [`Connection::send_region`]. Any other message is a
    /// [`Error::Protocol`] error that says what arrived instead. No deadline
    /// by default, like [`Connection::recv`].
    pub fn recv_region(&self) -> Op<RemoteRegion> {
        self.typed_recv(|m| RemoteRegion::from_message(&m.into_message()?))
    }

    /// One-sided read of the remote range into new owned bytes.
    pub fn read(&self, src: RemoteRegion) -> Op<Bytes> {
        self.op(OpKind::Read, src.len, self.raw.read(src))
    }

    /// Several one-sided reads posted as one unit (one doorbell for a chain
    /// of RDMA READs, one `writev` of requests for TCP): what a caller that
    /// holds many reads at once (a multi-key GET) should use. Returns each
    /// range's bytes in the order asked; one failed read fails the batch.
    /// Counts as `srcs.len()` reads, under one deadline.
    pub fn read_many(&self, srcs: Vec<RemoteRegion>) -> Op<Vec<Bytes>> {
        let n = srcs.len() as u64;
        let bytes = srcs.iter().map(|s| s.len).sum();
        let mut op = self.op(OpKind::Read, bytes, self.raw.read_many(srcs));
        op.count = n;
        op
    }

    /// One-sided read of the remote range into a local registered slice of the
    /// same length, as an RDMA READ into a registered buffer: while the read is
    /// in flight the slice's bytes are unspecified (a transport may receive
    /// straight into it, with no copy); once the operation has completed,
    /// failed or been dropped, the slice is never written again.
    pub fn read_into(&self, src: RemoteRegion, dst: LocalSlice) -> Op<()> {
        if src.len != dst.len() as u64 {
            return self.failed(
                OpKind::Read,
                Error::InvalidArgument(format!(
                    "read of {} bytes into a {}-byte slice",
                    src.len,
                    dst.len()
                )),
            );
        }
        self.op(OpKind::Read, src.len, self.raw.read_into(src, dst))
    }

    /// One-sided write of `data` to the remote range (lengths must match).
    pub fn write(&self, data: impl Into<Bytes>, dst: RemoteRegion) -> Op<()> {
        self.write_inner(data.into(), dst, None)
    }

    /// One-sided write from a local registered slice (its bytes are taken when
    /// the operation is created).
    pub fn write_from(&self, src: LocalSlice, dst: RemoteRegion) -> Op<()> {
        match src.to_bytes() {
            Ok(b) => self.write_inner(b, dst, None),
            Err(e) => self.failed(OpKind::Write, e),
        }
    }

    /// Write, then notify the peer: its `recv` yields [`Incoming::WriteImm`]
    /// with `imm` after the data is in place. Uses one of the peer's receive credits.
    pub fn write_with_imm(&self, data: impl Into<Bytes>, dst: RemoteRegion, imm: u32) -> Op<()> {
        self.write_inner(data.into(), dst, Some(imm))
    }

    fn write_inner(&self, data: Bytes, dst: RemoteRegion, imm: Option<u32>) -> Op<()> {
        if let Err(e) = check_write_len(&data, &dst) {
            return self.failed(OpKind::Write, e);
        }
        self.op(OpKind::Write, dst.len, self.raw.write(dst, data, imm))
    }

    /// One-sided write of `data` to `dst`, then `msg` as a message that the
    /// peer's `recv` yields only after the written data is in place: NVMe
    /// over Fabrics' "read data by RDMA WRITE, then the response capsule by
    /// SEND" (the NVMe RDMA transport binding, relying on the RC ordering of
    /// IBTA 9.5) in one operation. Where the transport keeps
    /// order (RDMA queue pairs, TCP) both are posted at once and the message
    /// does not wait a round trip for the write's acknowledgement. Waits for
    /// a receive credit like [`Connection::send`]. If the write fails the
    /// error is the write's and the message may already have been
    /// delivered: treat the peer as broken (its region was bad).
    pub fn write_then_send(
        &self,
        data: impl Into<Bytes>,
        dst: RemoteRegion,
        msg: impl Into<Bytes>,
    ) -> Op<()> {
        let (data, msg) = (data.into(), msg.into());
        if let Err(e) = check_write_len(&data, &dst) {
            return self.failed(OpKind::WriteThenSend, e);
        }
        let bytes = dst.len + msg.len() as u64;
        self.op(
            OpKind::WriteThenSend,
            bytes,
            self.raw.write_then_send(dst, data, msg),
        )
    }

    /// Several [`Connection::write_then_send`]s at once: every WRITE, then
    /// every message (see [`RawConnection::write_then_send_many`] for the
    /// order kept). What a server answering a burst of reads should use: on
    /// RDMA the WRITEs leave as one run and the messages as one bundle.
    /// Counts as `pairs.len()` operations; all or nothing for sizes.
    pub fn write_then_send_many(&self, pairs: Vec<WriteThenSend>) -> Op<()> {
        let n = pairs.len() as u64;
        let mut bytes = 0;
        for p in &pairs {
            let checked =
                check_write_len(&p.data, &p.dst).and_then(|()| self.check_message_len(&p.msg));
            if let Err(e) = checked {
                return self.failed(OpKind::WriteThenSend, e);
            }
            bytes += p.dst.len + p.msg.len() as u64;
        }
        let mut op = self.op(
            OpKind::WriteThenSend,
            bytes,
            self.raw.write_then_send_many(pairs),
        );
        op.count = n;
        op
    }

    /// Compare-and-swap on the remote 8-byte word `dst`; returns the old value
    /// (the swap happened iff it equals `expected`).
    pub fn compare_and_swap(&self, dst: RemoteRegion, expected: u64, new: u64) -> Op<u64> {
        self.atomic(dst, AtomicOp::CompareAndSwap { expected, new })
    }

    /// Fetch-and-add on the remote 8-byte word `dst`; returns the old value.
    pub fn fetch_and_add(&self, dst: RemoteRegion, add: u64) -> Op<u64> {
        self.atomic(dst, AtomicOp::FetchAndAdd { add })
    }

    fn atomic(&self, dst: RemoteRegion, op: AtomicOp) -> Op<u64> {
        if dst.len != 8 {
            return self.failed(
                OpKind::Atomic,
                Error::InvalidArgument(format!("atomic target must be 8 bytes, not {}", dst.len)),
            );
        }
        self.op(OpKind::Atomic, 8, self.raw.atomic(dst, op))
    }

    /// Hold what this connection sends from now on until the returned guard
    /// drops, then send it together: a server answering a burst of requests
    /// corks, posts every answer, and uncorks, paying one system call (TCP:
    /// one `writev`) for the burst instead of one per answer. Guards nest;
    /// the last one to drop sends.
    ///
    /// Only post while corked: an operation awaited to its end inside the
    /// cork waits for frames the cork holds (a write's acknowledgement, a
    /// credit the peer returns for a held message). Transports that cannot
    /// hold operations send them as usual. A cork holds at most one
    /// `writev`'s worth of frames (64 on TCP); more leave at once.
    ///
    /// An operation posts when its future is first polled, so poll the
    /// answers' futures while corked, as a server driving its handlers in a
    /// `FuturesUnordered` does:
    ///
    /// ```no_run
    /// # async fn f(conn: rdmx_core::Connection, answers: Vec<bytes::Bytes>) {
    /// use futures_util::{stream::FuturesUnordered, FutureExt, StreamExt};
    /// use std::future::IntoFuture;
    /// let mut sends: FuturesUnordered<_> =
    ///     answers.into_iter().map(|a| conn.send(a).into_future()).collect();
    /// let cork = conn.cork();
    /// // Post every send (polling each until it waits), then let them go.
    /// while let Some(Some(r)) = sends.next().now_or_never() {
    ///     r.unwrap();
    /// }
    /// drop(cork); // one writev on TCP
    /// while let Some(r) = sends.next().await {
    ///     r.unwrap();
    /// }
    /// # }
    /// ```
    pub fn cork(&self) -> Cork<'_> {
        self.raw.cork();
        Cork { conn: self }
    }

    /// Close gracefully. Other clones see [`Error::Disconnected`] afterwards.
    pub fn close(&self) -> Op<()> {
        self.op(OpKind::Close, 0, self.raw.close())
    }

    fn failed<T: Send + 'static>(&self, kind: OpKind, e: Error) -> Op<T> {
        self.op(kind, 0, Box::pin(async move { Err(e) }))
    }
}

/// Holds a [`Connection`]'s outgoing frames while it lives (see
/// [`Connection::cork`]); dropping it sends them.
#[must_use = "a cork holds frames only while it lives"]
pub struct Cork<'a> {
    conn: &'a Connection,
}

impl fmt::Debug for Cork<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cork").field("conn", self.conn).finish()
    }
}

impl Drop for Cork<'_> {
    fn drop(&mut self) {
        self.conn.raw.uncork();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Sets its flag when dropped (the operation was cancelled or ended).
    struct DropFlag(Arc<AtomicBool>);

    impl Drop for DropFlag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn op<T: Send + 'static>(fut: OpInner<T>, kind: OpKind, timeout: Option<Duration>) -> Op<T> {
        Op {
            fut,
            timeout,
            kind,
            bytes: 8,
            count: 3,
            stats: crate::stats::new_stats(),
        }
    }

    /// An operation still waiting at its deadline ends with `TimedOut`,
    /// counted, and is dropped (cancelled) right then, not only when its
    /// future is.
    #[tokio::test(start_paused = true)]
    async fn a_deadline_cancels_the_operation_and_counts() {
        let dropped = Arc::new(AtomicBool::new(false));
        let flag = DropFlag(dropped.clone());
        let never: BoxFuture<'static, Result<()>> = Box::pin(async move {
            let _flag = flag;
            std::future::pending::<()>().await;
            Ok(())
        });
        let op = op(
            OpInner::Plain(never),
            OpKind::Send,
            Some(Duration::from_millis(40)),
        );
        let stats = op.stats.clone();
        let mut fut = op.into_future();
        let t0 = tokio::time::Instant::now();
        let res = (&mut fut).await;
        assert!(matches!(res, Err(Error::TimedOut(d)) if d == Duration::from_millis(40)));
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(40), "{waited:?}");
        assert!(waited <= Duration::from_millis(42), "{waited:?}");
        assert!(
            dropped.load(Ordering::SeqCst),
            "the operation outlived its deadline"
        );
        let s = stats.snapshot();
        assert_eq!((s.timeouts, s.errors, s.sends), (1, 1, 0));
        drop(fut);
    }

    /// A finished operation counts as many operations as it stands for; a
    /// typed receive converts what arrives, and a wrong kind is an error,
    /// counted as one.
    #[tokio::test]
    async fn finished_operations_count_and_receives_convert() {
        let sent: BoxFuture<'static, Result<()>> = Box::pin(async { Ok(()) });
        let op1 = op(
            OpInner::Plain(sent),
            OpKind::Send,
            Some(Duration::from_secs(1)),
        );
        let stats = op1.stats.clone();
        op1.await.unwrap();
        assert_eq!(stats.snapshot().sends, 3);

        let message: BoxFuture<'static, Result<Incoming>> =
            Box::pin(async { Ok(Incoming::Message(Bytes::from_static(b"abc"))) });
        let op2 = op(
            OpInner::Received(message, Incoming::into_message),
            OpKind::Recv,
            None,
        );
        let stats = op2.stats.clone();
        assert_eq!(&op2.await.unwrap()[..], b"abc");
        assert_eq!(stats.snapshot().recvs, 3);

        let notice: BoxFuture<'static, Result<Incoming>> =
            Box::pin(async { Ok(Incoming::WriteImm { imm: 7, len: 0 }) });
        let op3 = op(
            OpInner::Received(notice, Incoming::into_message),
            OpKind::Recv,
            None,
        );
        let stats = op3.stats.clone();
        assert!(matches!(op3.await, Err(Error::InvalidArgument(_))));
        let s = stats.snapshot();
        assert_eq!((s.recvs, s.errors), (0, 1));
    }
}
