//! One rdmx connection over an RC queue pair, bootstrapped over TCP.
//!
//! ```text
//! TCP:  handshake (magic, version, limits, auth)  ─> PARAMS (version 2, 40 B: QPN, PSN, GID,
//!       UDP port, MTU, SR, bundles, ACK timeout, retry and RNR retry counts, READ/atomic
//!       depth; both ends use the smaller MTU and depth and the more patient timers)
//!       ─> READY; then the TCP stream stays as the control channel:
//!       CREDIT (receives re-posted), CLASSIFY (why was an access refused?),
//!       RESET / RESET_ACK / NEED_RESET (replace a QP that went to ERROR), CLOSE.
//! RC QP: every send, write, read and atomic; a batch of small messages
//!       (`send_many`) as bundles, several to a SEND, for a peer that takes them.
//! ```
//!
//! The bytes of PARAMS and of each control message are in `control.rs`;
//! `conn/setup.rs` runs the exchange and starts the control channel's tasks,
//! `conn/ctl.rs` handles the control messages and replaces a failed QP, and
//! this file runs the connection: posting, completions, credits.
//!
//! A remote access violation puts both QPs in ERROR (IBTA 9.9.3, class C
//! errors), as on any NIC. The connection then replaces its QP: the peers
//! exchange new QPNs/PSNs and how far each responder executed, so flushed
//! requests that never ran are re-posted, and ones that ran complete
//! (an atomic whose answer was lost reports [`Error::Indeterminate`]).

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use rdmx_core::stats::new_stats;
use rdmx_core::waiters::Waiters;
use rdmx_core::{
    Access, AccessError, AtomicOp, BoxFuture, Capabilities, ConnectionInfo, Domain, Error,
    Incoming, RawConnection, RemoteRegion, Result, Stats, Support, WriteThenSend,
};
use rdmx_transport_tcp::handshake::{Agreed, Limits};
use rustc_hash::FxHashMap;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot, Notify, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, info_span, warn, Instrument};

use crate::bundle;
use crate::pending::ByWrId;
use crate::verbs::{
    CompletionHandler, CompletionQueue, CqWaiter, ProtectionDomain, Provider, ProviderKind,
    QpOptions, QpPeer, QpTimers, QueuePair, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

mod ctl;
mod setup;

pub(crate) use setup::start;
use setup::{post_receives, random_psn};

use crate::control::{Ctl, Params, PARAMS_LEN, RDMA_VERSION};
const RECV_BIT: u64 = 1 << 63;
/// Largest single READ/WRITE (the RETH DMA length is 32 bits; 2^31 as rxe).
pub const MAX_RDMA_SIZE: u64 = 1 << 31;

async fn read_ctl(r: &mut OwnedReadHalf) -> std::io::Result<Ctl> {
    let mut h = [0u8; 2];
    r.read_exact(&mut h).await?;
    let mut body = vec![0u8; usize::from(h[1])];
    r.read_exact(&mut body).await?;
    Ctl::decode(h[0], &body).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

pub(crate) fn capabilities(max_message: u64, max_inflight: u32, credits: u32) -> Capabilities {
    Capabilities {
        transport: "rdma".into(),
        rdma: true,
        send: Support::Native,
        write: Support::Native,
        read: Support::Native,
        atomics: Support::Native,
        write_with_imm: Support::Native,
        max_message_size: max_message,
        max_rdma_size: MAX_RDMA_SIZE,
        max_inflight,
        recv_credits: credits,
        counts_remote_ops: true,
    }
}

type Reply = oneshot::Sender<Result<WorkCompletion>>;

struct Pending {
    op: SendOp,
    /// QP it is posted on (0: parked, waiting for a QP reset to finish).
    qpn: u32,
    first_psn: u32,
    npkts: u32,
    /// Who waits for its completion. `None`: posted by
    /// [`RawConnection::post_send`], so a failure of it fails the
    /// connection instead (a reply is only taken when the operation leaves
    /// `pending`).
    reply: Option<Reply>,
    /// Its place among the connection's `max_inflight` (and the send queue).
    _permit: OwnedSemaphorePermit,
}

struct State {
    qp: Arc<dyn QueuePair>,
    gen: u32,
    next_psn: u32,
    next_wr: u64,
    next_recv: u64,
    pending: ByWrId<Pending>,
    resetting: bool,
    /// Client side of a reset: the new QP and its PSN, until RESET_ACK.
    fresh: Option<(Arc<dyn QueuePair>, u32)>,
    /// Messages delivered to the app and not yet consumed.
    buffered: u32,
    /// Consumed since the last CREDIT message.
    consumed: (u32, u64),
    classifying: FxHashMap<u64, Reply>,
}

/// Messages delivered to the application and not yet taken, with the
/// receivers waiting for them ([`RecvWait`]). Locked after `State` where
/// both are held.
struct Inbox {
    queue: VecDeque<Delivery>,
    waiters: Waiters,
    /// The connection died: nothing more arrives (what is queued still
    /// goes to receivers).
    closed: bool,
}

impl Inbox {
    /// Queue `d` for the application; returns the receiver to wake.
    fn deliver(&mut self, d: Delivery) -> Option<std::task::Waker> {
        if self.closed {
            return None;
        }
        self.queue.push_back(d);
        self.waiters.pop_first()
    }
}

/// Waits for the next message or write-with-immediate notice
/// (`RawConnection::recv`): looking in the [`Inbox`] and registering to wait
/// take its one lock. Cancel-safe: a waiter dropped after a delivery woke
/// it, without taking the message, passes the wake-up on.
struct RecvWait {
    sh: Arc<Shared>,
    /// Our registration among the inbox's waiters.
    waiter: Option<u64>,
}

impl std::future::Future for RecvWait {
    type Output = Result<Incoming>;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = &mut *self;
        let got = {
            let mut inbox = this.sh.inbox.lock();
            match inbox.queue.pop_front() {
                Some(d) => {
                    inbox.waiters.remove(&mut this.waiter);
                    Some(d)
                }
                None if inbox.closed => None,
                None => {
                    inbox.waiters.register(&mut this.waiter, cx.waker());
                    return std::task::Poll::Pending;
                }
            }
        };
        std::task::Poll::Ready(match got {
            Some(Delivery { inc, release }) => {
                if let Some(bytes) = release {
                    this.sh.consumed(bytes);
                }
                Ok(inc)
            }
            None => Err(this.sh.dead_error()),
        })
    }
}

impl Drop for RecvWait {
    fn drop(&mut self) {
        if self.waiter.is_none() {
            return;
        }
        let next = {
            let mut inbox = self.sh.inbox.lock();
            let queued = !inbox.queue.is_empty();
            // Woken by a delivery whose message we never took: pass it on.
            inbox.waiters.leave(&mut self.waiter, queued)
        };
        if let Some(w) = next {
            w.wake();
        }
    }
}

/// A message (or write-with-immediate notice) for the application, and the
/// receive it came in: `release` is the receive's byte count when the
/// application taking this one frees it (a bundle's last message), `None`
/// while later messages of its bundle still wait.
struct Delivery {
    inc: Incoming,
    release: Option<u64>,
}

struct Credits {
    msgs: u32,
    bytes: u64,
}

/// What both ends agreed for this connection.
pub(crate) struct Setup {
    pub(crate) stream: TcpStream,
    pub(crate) domain: Domain,
    pub(crate) provider: Arc<dyn Provider>,
    pub(crate) qp_opts: QpOptions,
    /// What both ends announced (our limits are `agreed.ours`).
    pub(crate) agreed: Agreed,
    pub(crate) max_inflight: u32,
    pub(crate) connect_timeout: std::time::Duration,
    pub(crate) busy_poll: Option<std::time::Duration>,
    pub(crate) server: bool,
}

pub(crate) struct Shared {
    /// Keeps the provider (and a soft device's tasks) alive with the connection.
    _provider: Arc<dyn Provider>,
    info: ConnectionInfo,
    stats: Arc<Stats>,
    domain: Domain,
    pd: Arc<dyn ProtectionDomain>,
    cq: Arc<dyn CompletionQueue>,
    qp_opts: QpOptions,
    server: bool,
    ours: Limits,
    peer_limits: Limits,
    /// Path parameters reused for replacement QPs.
    path: QpPeer,
    st: Mutex<State>,
    ctl: mpsc::UnboundedSender<Ctl>,
    inbox: Mutex<Inbox>,
    /// The peer takes bundles of messages (bundle.rs).
    peer_bundles: bool,
    credits: Mutex<Credits>,
    credit_notify: Notify,
    /// Sends and writes with immediate post in the order they were first
    /// polled (a FIFO lock held from the credit to the post): without it, a
    /// send that finds a credit returned while an earlier one waits on the
    /// credit notice would overtake it.
    send_order: tokio::sync::Mutex<()>,
    /// One permit per operation in flight (`Options::max_inflight`, also the
    /// send queue depth): later operations wait, as the capabilities say.
    inflight: Arc<Semaphore>,
    /// Permits `inflight` was made with (all free: nothing in flight).
    inflight_max: u32,
    dead: Mutex<Option<Error>>,
    is_dead: AtomicBool,
    stop: Notify,
    /// Held while completions are polled and handed out (keeps them in order
    /// when a provider task and the drive task both take them); the list
    /// they are polled into, empty between turns, so a turn allocates nothing.
    dispatching: Mutex<Vec<WorkCompletion>>,
}

impl CompletionHandler for Shared {
    fn completions_ready(&self) {
        self.dispatch(false);
    }
}

/// The connection handle; dropping the last one closes the connection.
pub(crate) struct RdmaConnection {
    sh: Arc<Shared>,
}

impl Drop for RdmaConnection {
    fn drop(&mut self) {
        let _ = self.sh.ctl.send(Ctl::Close);
        self.sh
            .die(Error::Disconnected("connection closed locally".into()));
    }
}

fn status_error(s: WcStatus) -> Error {
    match s {
        WcStatus::RetryExceeded
        | WcStatus::RnrRetryExceeded
        | WcStatus::ResponseTimeout
        | WcStatus::Fatal => Error::Disconnected(s.hint().to_string()),
        _ => Error::Protocol(format!("{s:?}: {}", s.hint())),
    }
}

impl Shared {
    fn dead_error(&self) -> Error {
        self.dead
            .lock()
            .clone()
            .unwrap_or_else(|| Error::Disconnected("connection closed".into()))
    }

    /// Fail everything and stop: the connection cannot be used any more.
    fn die(&self, e: Error) {
        if self.is_dead.swap(true, Ordering::AcqRel) {
            return;
        }
        debug!(error = %e, "RDMA connection down");
        *self.dead.lock() = Some(e.clone());
        let (replies, qp) = {
            let mut st = self.st.lock();
            let receivers = {
                let mut inbox = self.inbox.lock();
                inbox.closed = true;
                inbox.waiters.take_all()
            };
            for w in receivers {
                w.wake();
            }
            let mut replies: Vec<Reply> = st
                .pending
                .values_mut()
                .filter_map(|p| p.reply.take())
                .collect();
            st.pending.clear();
            replies.extend(st.classifying.drain().map(|(_, r)| r));
            (replies, st.qp.clone())
        };
        for r in replies {
            let _ = r.send(Err(e.clone()));
        }
        qp.to_error();
        self.inflight.close();
        self.credit_notify.notify_waiters();
        self.stop.notify_one();
    }

    /// A message must fit the peer's receive buffers.
    fn check_message(&self, len: u64) -> Result<()> {
        if len > self.peer_limits.max_message {
            return Err(Error::ResourceExhausted(format!(
                "message of {len} bytes exceeds the peer's limit of {}",
                self.peer_limits.max_message
            )));
        }
        Ok(())
    }

    /// Wait for a place among the operations in flight.
    async fn permit(&self) -> Result<OwnedSemaphorePermit> {
        self.inflight
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| self.dead_error())
    }

    /// Post `op` (or park it while the QP is being replaced).
    fn submit(
        &self,
        op: SendOp,
        permit: OwnedSemaphorePermit,
    ) -> Result<oneshot::Receiver<Result<WorkCompletion>>> {
        let (tx, rx) = oneshot::channel();
        self.submit_with(op, permit, Some(tx))?;
        Ok(rx)
    }

    /// Post a SEND of `msg` in order among the connection's sends, once a
    /// place in flight and a receive credit are free; `reply` gets its
    /// completion (`None`: detached).
    async fn post_message(&self, msg: Bytes, reply: Option<Reply>) -> Result<()> {
        self.check_message(msg.len() as u64)?;
        let order = self.send_order.lock().await;
        self.post_in_order(msg, None, reply).await?;
        drop(order);
        Ok(())
    }

    /// Post a SEND of `msg` (with `imm`) once a place in flight and a
    /// receive credit are free; the caller holds `send_order`.
    async fn post_in_order(
        &self,
        msg: Bytes,
        imm: Option<u32>,
        reply: Option<Reply>,
    ) -> Result<()> {
        let len = msg.len() as u64;
        self.check_message(len)?;
        let permit = self.permit().await?;
        self.take_credit(len).await?;
        self.submit_with(SendOp::Send { sg: vec![msg], imm }, permit, reply)
    }

    /// Send `msgs` in order, small ones bundled several to a SEND where
    /// the peer takes bundles (bundle.rs); waits for every completion.
    async fn post_many(&self, msgs: Vec<Bytes>) -> Result<()> {
        let order = self.send_order.lock().await;
        let waits = self.post_bundled(msgs).await?;
        drop(order);
        for rx in waits {
            wait(rx, self).await?;
        }
        Ok(())
    }

    /// Post `msgs` in order, bundled where the peer takes bundles; the
    /// caller holds `send_order`. Returns the SENDs' completions.
    async fn post_bundled(
        &self,
        msgs: Vec<Bytes>,
    ) -> Result<Vec<oneshot::Receiver<Result<WorkCompletion>>>> {
        let posts = if self.peer_bundles {
            bundle::plan(msgs, self.peer_limits.max_message as usize)
        } else {
            msgs.into_iter().map(bundle::Post::Single).collect()
        };
        let mut waits = Vec::with_capacity(posts.len());
        for post in posts {
            let (msg, imm) = match post {
                bundle::Post::Single(m) => (m, None),
                bundle::Post::Bundle { payload, .. } => {
                    self.stats.add(|s| &s.bundles_sent, 1);
                    (payload, Some(bundle::BUNDLE_IMM))
                }
            };
            let (tx, rx) = oneshot::channel();
            self.post_in_order(msg, imm, Some(tx)).await?;
            waits.push(rx);
        }
        Ok(waits)
    }

    /// Post `op` with `reply` for its completion (`None`: detached, see
    /// [`Pending::reply`]).
    fn submit_with(
        &self,
        op: SendOp,
        permit: OwnedSemaphorePermit,
        reply: Option<Reply>,
    ) -> Result<()> {
        let mut st = self.st.lock();
        // Checked under the state lock: `die` takes the same lock after
        // marking the connection dead, so an operation is either in `pending`
        // when it fails them all, or sees the mark here. (Checked before the
        // lock, an operation could slip in after `die`, when nobody polls the
        // completion queue any more, and wait for its deadline.)
        if self.is_dead.load(Ordering::Acquire) {
            drop(st);
            return Err(self.dead_error());
        }
        let wr_id = st.next_wr;
        st.next_wr += 1;
        let mut p = Pending {
            op,
            qpn: 0,
            first_psn: 0,
            npkts: 0,
            reply,
            _permit: permit,
        };
        if !st.resetting {
            Self::post(&mut st, self.path.mtu, wr_id, &mut p)?;
        }
        st.pending.insert(wr_id, p);
        Ok(())
    }

    fn post(st: &mut State, mtu: u32, wr_id: u64, p: &mut Pending) -> Result<()> {
        p.qpn = st.qp.qpn();
        p.first_psn = st.next_psn;
        p.npkts = p.op.psn_count(mtu);
        st.qp.post_send(SendWr {
            wr_id,
            op: p.op.clone(),
        })?;
        // Only a posted request takes PSNs (a refused post sends nothing).
        st.next_psn = (st.next_psn + p.npkts) & 0xFF_FFFF;
        Ok(())
    }

    fn on_completion(&self, wc: WorkCompletion) {
        let mut st = self.st.lock();
        if wc.qpn != st.qp.qpn() {
            return; // from a QP that was replaced: settled by the reset
        }
        if wc.wr_id & RECV_BIT != 0 {
            match wc.status {
                WcStatus::Success => {
                    // The receive's credit is its message's bytes (a
                    // write-with-immediate notice takes none).
                    let release = match wc.opcode {
                        WcOpcode::RecvWriteImm => Some(0),
                        _ => Some(wc.byte_len),
                    };
                    // One message, or a bundle's several (the receive's
                    // credit goes back with the last).
                    let bundle = match wc.opcode {
                        WcOpcode::RecvWriteImm => None,
                        _ if wc.imm == Some(bundle::BUNDLE_IMM) => match bundle::split(&wc.data) {
                            Ok(parts) => Some(parts),
                            Err(why) => {
                                drop(st);
                                self.die(Error::Protocol(format!("peer sent {why}")));
                                return;
                            }
                        },
                        _ => None,
                    };
                    st.buffered += 1;
                    self.stats.add(|s| &s.bytes_received, wc.byte_len);
                    let mut inbox = self.inbox.lock();
                    match bundle {
                        Some(parts) => {
                            let last = parts.len() - 1;
                            let mut wake = Vec::new();
                            for (i, m) in parts.into_iter().enumerate() {
                                let release = if i == last { release } else { None };
                                let inc = Incoming::Message(m);
                                wake.extend(inbox.deliver(Delivery { inc, release }));
                            }
                            drop(inbox);
                            wake.into_iter().for_each(std::task::Waker::wake);
                        }
                        None => {
                            let inc = match wc.opcode {
                                WcOpcode::RecvWriteImm => Incoming::WriteImm {
                                    imm: wc.imm.unwrap_or(0),
                                    len: wc.byte_len,
                                },
                                _ => Incoming::Message(wc.data),
                            };
                            // One message: no list of receivers to wake.
                            let first = inbox.deliver(Delivery { inc, release });
                            drop(inbox);
                            if let Some(w) = first {
                                w.wake();
                            }
                        }
                    }
                }
                WcStatus::Flushed => self.begin_reset(&mut st),
                s => {
                    drop(st);
                    self.die(status_error(s));
                }
            }
            return;
        }
        let Some(p) = st.pending.get(&wc.wr_id) else {
            return;
        };
        if p.qpn != wc.qpn {
            return;
        }
        match wc.status {
            WcStatus::Success => {
                let mut p = st.pending.remove(&wc.wr_id).expect("present");
                drop(st);
                match wc.opcode {
                    WcOpcode::Send | WcOpcode::Write => {
                        self.stats.add(|s| &s.bytes_sent, wc.byte_len)
                    }
                    WcOpcode::Read => self.stats.add(|s| &s.bytes_received, wc.byte_len),
                    _ => {}
                }
                if let Some(r) = p.reply.take() {
                    let _ = r.send(Ok(wc));
                }
            }
            WcStatus::Flushed => self.begin_reset(&mut st),
            WcStatus::RemoteAccess | WcStatus::RemoteInvalidRequest => {
                let mut p = st.pending.remove(&wc.wr_id).expect("present");
                if p.reply.is_none() {
                    drop(st);
                    self.die(status_error(wc.status));
                    return;
                }
                let reply = p.reply.take();
                let target = match p.op {
                    SendOp::Write { dst, .. } => Some((dst, Access::REMOTE_WRITE)),
                    SendOp::Read { src } => Some((src, Access::REMOTE_READ)),
                    SendOp::CompareSwap { dst, .. } | SendOp::FetchAdd { dst, .. } => {
                        Some((dst, Access::REMOTE_ATOMIC))
                    }
                    SendOp::Send { .. } => None,
                };
                match (target, reply) {
                    (Some((r, need)), Some(reply)) => {
                        // The NAK says "refused", not why: ask the peer's domain.
                        let id = wc.wr_id;
                        st.classifying.insert(id, reply);
                        let _ = self.ctl.send(Ctl::Classify {
                            id,
                            rkey: r.rkey,
                            addr: r.addr,
                            len: r.len,
                            need: need.bits(),
                        });
                    }
                    (None, Some(reply)) => {
                        let _ = reply.send(Err(status_error(wc.status)));
                    }
                    _ => {}
                }
                self.begin_reset(&mut st);
            }
            WcStatus::RetryExceeded | WcStatus::RnrRetryExceeded => {
                drop(st);
                self.die(status_error(wc.status));
            }
            s => {
                let mut p = st.pending.remove(&wc.wr_id).expect("present");
                if p.reply.is_none() {
                    drop(st);
                    self.die(status_error(s));
                    return;
                }
                if let Some(r) = p.reply.take() {
                    let _ = r.send(Err(status_error(s)));
                }
                self.begin_reset(&mut st);
            }
        }
    }

    /// Collect completions already queued (flushes of the old QP) before settling.
    fn drain_cq(&self) {
        let mut wcs = self.dispatching.lock();
        while self.cq.poll(&mut wcs, 256) > 0 {
            for wc in wcs.drain(..) {
                self.on_completion(wc);
            }
        }
    }

    /// Take every completion waiting, in order: one caller at a time polls
    /// and hands out; a caller that finds another doing it leaves them to it
    /// (which looks again once done, so none is left behind), or with
    /// `wait`, waits for its turn (the drive task: it would only come back).
    fn dispatch(&self, wait: bool) {
        loop {
            let mut wcs = if wait {
                self.dispatching.lock()
            } else {
                match self.dispatching.try_lock() {
                    Some(t) => t,
                    None => return,
                }
            };
            while self.cq.poll(&mut wcs, 64) > 0 {
                for wc in wcs.drain(..) {
                    self.on_completion(wc);
                }
            }
            drop(wcs);
            if self.cq.pending().unwrap_or(0) == 0 {
                return;
            }
        }
    }

    /// Take one send credit (a receive posted at the peer) and `bytes` of its window.
    async fn take_credit(&self, bytes: u64) -> Result<()> {
        // Most sends find a credit: take it without registering for the
        // wake-up (the registration locks the notifier's waiter list, and
        // its drop again).
        if self.try_take_credit(bytes)? {
            return Ok(());
        }
        let mut stalled = false;
        loop {
            let notified = self.credit_notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.try_take_credit(bytes)? {
                return Ok(());
            }
            if !stalled {
                stalled = true;
                self.stats.add(|s| &s.credit_stalls, 1);
            }
            notified.await;
        }
    }

    /// Take one send credit and `bytes` of the window if they are there now.
    fn try_take_credit(&self, bytes: u64) -> Result<bool> {
        if self.is_dead.load(Ordering::Acquire) {
            return Err(self.dead_error());
        }
        let mut c = self.credits.lock();
        if c.msgs >= 1 && c.bytes >= bytes {
            c.msgs -= 1;
            c.bytes -= bytes;
            return Ok(true);
        }
        Ok(false)
    }

    /// The app consumed a message: re-post its receive, return credits in batches.
    fn consumed(&self, bytes: u64) {
        let mut st = self.st.lock();
        st.buffered = st.buffered.saturating_sub(1);
        if !st.resetting && !self.is_dead.load(Ordering::Acquire) {
            let qp = st.qp.clone();
            let mut next = st.next_recv;
            if let Err(e) = post_receives(&*qp, &mut next, 1, self.ours.max_message) {
                debug!(error = %e, "re-posting a receive");
            }
            st.next_recv = next;
        }
        st.consumed.0 += 1;
        st.consumed.1 += bytes;
        let (m, b) = st.consumed;
        if m >= (self.ours.credits / 4).max(1) || b >= self.ours.window / 4 {
            st.consumed = (0, 0);
            let _ = self.ctl.send(Ctl::Credit { msgs: m, bytes: b });
        }
    }
}

/// One READ or WRITE moves at most [`MAX_RDMA_SIZE`] bytes.
fn check_rdma_size(what: &str, len: u64) -> Result<()> {
    if len > MAX_RDMA_SIZE {
        return Err(Error::InvalidArgument(format!(
            "a {what} of {len} bytes exceeds {MAX_RDMA_SIZE}"
        )));
    }
    Ok(())
}

/// How long a graceful close waits for posted operations to complete.
const CLOSE_DRAIN: std::time::Duration = std::time::Duration::from_secs(5);

async fn wait(
    rx: oneshot::Receiver<Result<WorkCompletion>>,
    sh: &Shared,
) -> Result<WorkCompletion> {
    match rx.await {
        Ok(r) => r,
        Err(_) => Err(sh.dead_error()),
    }
}

impl RawConnection for RdmaConnection {
    fn info(&self) -> ConnectionInfo {
        self.sh.info.clone()
    }

    fn stats(&self) -> &Arc<Stats> {
        &self.sh.stats
    }

    fn domain(&self) -> &Domain {
        &self.sh.domain
    }

    fn send(&self, msg: Bytes) -> BoxFuture<'static, Result<()>> {
        let sh = self.sh.clone();
        Box::pin(async move {
            let (tx, rx) = oneshot::channel();
            sh.post_message(msg, Some(tx)).await?;
            wait(rx, &sh).await.map(|_| ())
        })
    }

    fn send_many(&self, msgs: Vec<Bytes>) -> BoxFuture<'static, Result<()>> {
        let sh = self.sh.clone();
        Box::pin(async move { sh.post_many(msgs).await })
    }

    fn post_send(&self, msg: Bytes) -> BoxFuture<'static, Result<()>> {
        let sh = self.sh.clone();
        // No receiver for the completion: its ACK wakes nobody (a caller
        // that waits for an answer is woken by the answer alone).
        Box::pin(async move { sh.post_message(msg, None).await })
    }

    fn recv(&self) -> BoxFuture<'static, Result<Incoming>> {
        Box::pin(RecvWait {
            sh: self.sh.clone(),
            waiter: None,
        })
    }

    fn read(&self, src: RemoteRegion) -> BoxFuture<'static, Result<Bytes>> {
        let sh = self.sh.clone();
        Box::pin(async move {
            check_rdma_size("read", src.len)?;
            let permit = sh.permit().await?;
            let rx = sh.submit(SendOp::Read { src }, permit)?;
            Ok(wait(rx, &sh).await?.data)
        })
    }

    fn read_many(&self, srcs: Vec<RemoteRegion>) -> BoxFuture<'static, Result<Vec<Bytes>>> {
        let sh = self.sh.clone();
        Box::pin(async move {
            for src in &srcs {
                check_rdma_size("read", src.len)?;
            }
            // Every READ posted before the first completion is awaited: one
            // chain of work requests, which the engine sends as one run of
            // request packets (a verbs provider: back-to-back posts before
            // the CQ is polled). More reads than places in flight wait for
            // the batch's own earlier ones, which complete without us.
            let mut waits = Vec::with_capacity(srcs.len());
            for src in srcs {
                let permit = sh.permit().await?;
                waits.push(sh.submit(SendOp::Read { src }, permit)?);
            }
            let mut out = Vec::with_capacity(waits.len());
            for rx in waits {
                out.push(wait(rx, &sh).await?.data);
            }
            Ok(out)
        })
    }

    fn write(
        &self,
        dst: RemoteRegion,
        data: Bytes,
        imm: Option<u32>,
    ) -> BoxFuture<'static, Result<()>> {
        let sh = self.sh.clone();
        Box::pin(async move {
            check_rdma_size("write", dst.len)?;
            // The immediate consumes a receive at the peer, in order with sends.
            let order = match imm {
                Some(_) => Some(sh.send_order.lock().await),
                None => None,
            };
            let permit = sh.permit().await?;
            if imm.is_some() {
                sh.take_credit(0).await?;
            }
            let rx = sh.submit(
                SendOp::Write {
                    sg: vec![data],
                    dst,
                    imm,
                },
                permit,
            )?;
            drop(order);
            wait(rx, &sh).await.map(|_| ())
        })
    }

    fn write_then_send(
        &self,
        dst: RemoteRegion,
        data: Bytes,
        msg: Bytes,
    ) -> BoxFuture<'static, Result<()>> {
        let sh = self.sh.clone();
        Box::pin(async move {
            check_rdma_size("write", dst.len)?;
            let len = msg.len() as u64;
            sh.check_message(len)?;
            // WRITE then SEND back to back on the one send queue: the
            // responder places the WRITE before it consumes a receive for
            // the SEND (IBTA 9.5, RC ordering), so the SEND need not wait
            // for the WRITE's ACK.
            let order = sh.send_order.lock().await;
            let write_permit = sh.permit().await?;
            let send_permit = sh.permit().await?;
            sh.take_credit(len).await?;
            let wrote = sh.submit(
                SendOp::Write {
                    sg: vec![data],
                    dst,
                    imm: None,
                },
                write_permit,
            )?;
            let sent = sh.submit(
                SendOp::Send {
                    sg: vec![msg],
                    imm: None,
                },
                send_permit,
            )?;
            drop(order);
            let (w, s) = tokio::join!(wait(wrote, &sh), wait(sent, &sh));
            w?;
            s.map(|_| ())
        })
    }

    fn write_then_send_many(&self, pairs: Vec<WriteThenSend>) -> BoxFuture<'static, Result<()>> {
        let sh = self.sh.clone();
        Box::pin(async move {
            for p in &pairs {
                check_rdma_size("write", p.dst.len)?;
                sh.check_message(p.msg.len() as u64)?;
            }
            // Every WRITE, then the messages (bundled where the peer takes
            // bundles) on the one send queue: each message follows its WRITE
            // (IBTA 9.5, RC ordering), and the WRITEs, one size, leave as one
            // run of datagrams.
            let mut msgs = Vec::with_capacity(pairs.len());
            let mut waits = Vec::with_capacity(pairs.len() + 1);
            let order = sh.send_order.lock().await;
            for p in pairs {
                let permit = sh.permit().await?;
                let op = SendOp::Write {
                    sg: vec![p.data],
                    dst: p.dst,
                    imm: None,
                };
                waits.push(sh.submit(op, permit)?);
                msgs.push(p.msg);
            }
            waits.extend(sh.post_bundled(msgs).await?);
            drop(order);
            for rx in waits {
                wait(rx, &sh).await?;
            }
            Ok(())
        })
    }

    fn atomic(&self, dst: RemoteRegion, op: AtomicOp) -> BoxFuture<'static, Result<u64>> {
        let sh = self.sh.clone();
        Box::pin(async move {
            // An atomic's address must be 8-byte aligned (IBTA 9.4.5; the
            // responder NAKs it as an invalid request). Some verbs stacks
            // refuse to post it at all (rxe: EINVAL), so tell it here, the
            // same way on every provider, without a round trip.
            if dst.addr % 8 != 0 {
                return Err(Error::RemoteAccess(AccessError::Misaligned));
            }
            let op = match op {
                AtomicOp::CompareAndSwap { expected, new } => SendOp::CompareSwap {
                    dst,
                    compare: expected,
                    swap: new,
                },
                AtomicOp::FetchAndAdd { add } => SendOp::FetchAdd { dst, add },
            };
            let permit = sh.permit().await?;
            let rx = sh.submit(op, permit)?;
            Ok(wait(rx, &sh).await?.atomic_orig.unwrap_or(0))
        })
    }

    fn close(&self) -> BoxFuture<'static, Result<()>> {
        let sh = self.sh.clone();
        Box::pin(async move {
            // What was posted reaches the peer first (a post_send returns
            // before its acknowledgement), as TCP delivers what close()
            // finds in its send buffer: every permit free means every
            // posted operation completed. A dead connection closes the
            // semaphore (the wait ends at once); a peer that stops
            // acknowledging is waited for at most CLOSE_DRAIN.
            let _ =
                tokio::time::timeout(CLOSE_DRAIN, sh.inflight.acquire_many(sh.inflight_max)).await;
            let _ = sh.ctl.send(Ctl::Close);
            sh.die(Error::Disconnected("connection closed locally".into()));
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::setup::read_params;
    use super::*;
    use crate::control::PARAMS_MAGIC;

    #[tokio::test]
    async fn an_older_peer_gets_a_version_mismatch_not_a_hang() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let old_peer = tokio::spawn(async move {
            let mut s = TcpStream::connect(addr).await.unwrap();
            // A version-1 PARAMS was 36 bytes; then it waits for ours.
            let mut v1 = [0u8; 36];
            v1[..4].copy_from_slice(PARAMS_MAGIC);
            v1[4..6].copy_from_slice(&1u16.to_le_bytes());
            s.write_all(&v1).await.unwrap();
            let mut b = [0u8; 1];
            let _ = s.read(&mut b).await;
        });
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = [0u8; PARAMS_LEN];
        let r = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            read_params(&mut s, &mut buf),
        )
        .await
        .expect("no hang");
        assert!(matches!(
            r,
            Err(Error::VersionMismatch { local: 2, peer: 1 })
        ));
        drop(s);
        old_peer.await.unwrap();
    }

    #[test]
    fn every_ibv_wc_status_has_an_error_and_a_hint() {
        let mut hints = std::collections::HashSet::new();
        for code in 0..=23u32 {
            let s = WcStatus::from_ibv(code);
            let hint = s.hint();
            assert!(hint.len() > 10, "{code}: {hint}");
            hints.insert(hint);
            let e = status_error(s).to_string();
            assert!(e.contains(hint), "{code}: {e}");
        }
        // Distinct advice for the statuses people meet on RoCE fabrics.
        assert!(WcStatus::from_ibv(12)
            .hint()
            .contains("wrong GID, or MTU mismatch"));
        assert!(WcStatus::from_ibv(10).hint().contains("R_Key"));
        assert!(WcStatus::from_ibv(13).hint().contains("receive"));
        assert!(WcStatus::from_ibv(5).hint().contains("error state"));
        assert!(matches!(
            status_error(WcStatus::from_ibv(12)),
            Error::Disconnected(_)
        ));
        assert!(hints.len() >= 20, "{}", hints.len());
        assert_eq!(WcStatus::from_ibv(99), WcStatus::Other(99));
    }

    #[test]
    fn psn_arithmetic_wraps() {
        use rdmx_roce_proto::psn::diff;
        assert_eq!(diff(0, 0xFF_FFFF), 1);
        assert_eq!(diff(0xFF_FFFF, 0), -1);
        assert_eq!(diff(10, 5), 5);
    }
}
