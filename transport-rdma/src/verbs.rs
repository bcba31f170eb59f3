//! The verbs-level provider trait: what the rdmx RDMA transport needs from an
//! RDMA stack, implemented by the userspace RoCEv2 engine ([`crate::soft`]) and
//! by real NICs (the `hw` feature).
//!
//! The shapes follow libibverbs (protection domain, memory registration,
//! completion queue with an event fd, RC queue pair, post send/recv, poll/arm)
//! with owned buffers: a posted work request owns its data (`Bytes`) until its
//! completion, so nothing a caller can drop or reuse is ever touched by the NIC.

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use bytes::Bytes;
use rdmx_core::{Domain, MemoryRegion, RemoteRegion, Result};
use tokio::io::unix::AsyncFd;

/// Which kind of provider carries a connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderKind {
    /// The userspace RoCEv2 engine over a UDP socket.
    Soft,
    /// A real RDMA NIC through libibverbs.
    Hardware,
}

impl fmt::Display for ProviderKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProviderKind::Soft => "soft-roce",
            ProviderKind::Hardware => "hw",
        })
    }
}

/// The local end of a path: what the peer needs to reach our QPs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortInfo {
    /// Our GID as an IP address (RoCEv2 GIDs are IPv4-mapped or IPv6 addresses).
    pub gid: IpAddr,
    /// UDP port the provider receives RoCEv2 on (4791 on NICs).
    pub udp_port: u16,
    /// Active path MTU in bytes (256..=4096).
    pub mtu: u32,
    /// READ/atomic requests a QP on this port can keep outstanding and
    /// serve outstanding (a NIC's `max_qp_rd_atom`; the soft engine's
    /// limit is the wire's, 255).
    pub max_rd_atomic: u32,
}

/// What an RC queue pair is connected to (the INIT → RTR → RTS parameters).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpPeer {
    /// Our own address on the path (the local GID): packets leave from it.
    pub local: IpAddr,
    /// The peer's QP number.
    pub qpn: u32,
    /// The PSN the peer starts sending with (our receive PSN).
    pub psn: u32,
    /// Where the peer receives RoCEv2 packets.
    pub addr: SocketAddr,
    /// Path MTU both ends use (the minimum of the two).
    pub mtu: u32,
    /// Use selective repeat (both ends support it) instead of go-back-N.
    pub selective_repeat: bool,
    /// Requester timers both ends agreed on (the larger of each side's).
    pub timers: QpTimers,
    /// READ/atomic requests outstanding on this path: the smaller of the
    /// two ends' limits, so neither requester sends more than the other's
    /// responder holds (IBTA 9.5, o9-21).
    pub max_rd_atomic: u32,
}

/// The requester's timers (`ibv_qp_attr` timeout, retry_cnt, rnr_retry),
/// exchanged in the bootstrap so both ends of a path use the same ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpTimers {
    /// Local ACK timeout exponent (4.096 µs × 2^timeout), 0..=31.
    pub timeout: u8,
    /// Retries on timeout / sequence NAK, 0..=7.
    pub retry_cnt: u8,
    /// Retries on RNR NAK, 0..=7 (7 = infinite).
    pub rnr_retry: u8,
}

impl QpTimers {
    /// The timers of `o`.
    pub fn of(o: &QpOptions) -> QpTimers {
        QpTimers {
            timeout: o.timeout,
            retry_cnt: o.retry_cnt,
            rnr_retry: o.rnr_retry,
        }
    }

    /// What both ends use: the more patient value of each (a long path
    /// configured on either side gets its timeout on both).
    pub fn agree(self, peer: QpTimers) -> QpTimers {
        QpTimers {
            timeout: self.timeout.max(peer.timeout),
            retry_cnt: self.retry_cnt.max(peer.retry_cnt),
            rnr_retry: self.rnr_retry.max(peer.rnr_retry),
        }
    }
}

/// Queue pair sizes and timers (the `ibv_qp_init_attr` / `ibv_qp_attr` subset rdmx uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpOptions {
    /// Local ACK timeout exponent (4.096 µs × 2^timeout). The default, 10
    /// (4.2 ms), suits data-center round trips; raise it for long paths.
    pub timeout: u8,
    /// Retries on timeout / sequence NAK.
    pub retry_cnt: u8,
    /// Retries on RNR NAK (7 = infinite).
    pub rnr_retry: u8,
    /// Outstanding READ/atomic requests this end offers (capped by the
    /// device, and on each path by the peer's offer). The default, 128, is
    /// rxe's limit; mlx5 NICs cap it at 16. At 16, two soft RoCE peers
    /// kept a KV gateway's 800 GETs in flight waiting 16 READs at a time.
    pub max_rd_atomic: u32,
    /// Send queue depth (the connection sets it to `Options::max_inflight`;
    /// NICs cap it at their `max_qp_wr`).
    pub max_send_wr: u32,
}

impl Default for QpOptions {
    fn default() -> Self {
        QpOptions {
            timeout: 10,
            retry_cnt: 7,
            rnr_retry: 7,
            max_rd_atomic: 128,
            max_send_wr: 4096,
        }
    }
}

/// A send-queue operation. Gather lists are owned `Bytes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SendOp {
    /// Two-sided send, optionally with immediate data.
    Send {
        /// Gather list.
        sg: Vec<Bytes>,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// RDMA WRITE to `dst` (with immediate: consumes a receive at the peer).
    Write {
        /// Gather list; its total length is `dst.len`.
        sg: Vec<Bytes>,
        /// Remote range.
        dst: RemoteRegion,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// RDMA READ of `src`; the data arrives in the completion.
    Read {
        /// Remote range.
        src: RemoteRegion,
    },
    /// Compare-and-swap on the remote 8-byte word.
    CompareSwap {
        /// Remote word.
        dst: RemoteRegion,
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// Fetch-and-add on the remote 8-byte word.
    FetchAdd {
        /// Remote word.
        dst: RemoteRegion,
        /// Addend.
        add: u64,
    },
}

impl SendOp {
    /// Bytes this operation moves on the wire (payload or read length).
    pub fn len(&self) -> u64 {
        match self {
            SendOp::Send { sg, .. } | SendOp::Write { sg, .. } => {
                sg.iter().map(|b| b.len() as u64).sum()
            }
            SendOp::Read { src } => src.len,
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => 8,
        }
    }

    /// True for operations that move no payload bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// PSNs the request occupies at path MTU `mtu` (IBTA 9.7.1: one per packet,
    /// READ: one per response packet, atomics: one).
    pub fn psn_count(&self, mtu: u32) -> u32 {
        match self {
            SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => 1,
            _ => self.len().div_ceil(u64::from(mtu)).max(1) as u32,
        }
    }
}

/// A send work request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SendWr {
    /// Caller's id, returned in the completion.
    pub wr_id: u64,
    /// The operation.
    pub op: SendOp,
}

/// Completion status, the `ibv_wc_status` values with a hint a person can act on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// Local length error (a message larger than the posted receive).
    LocalLength,
    /// Local QP operation error.
    LocalQpOperation,
    /// Local protection error (buffer not registered or wrong lkey).
    LocalProtection,
    /// Flushed: the QP went to ERROR before this request completed.
    Flushed,
    /// The peer NAKed with Invalid Request.
    RemoteInvalidRequest,
    /// The peer NAKed with Remote Access Error (R_Key, bounds or rights).
    RemoteAccess,
    /// The peer NAKed with Remote Operational Error.
    RemoteOperational,
    /// Local ACK timeout retries exhausted.
    RetryExceeded,
    /// RNR NAK retries exhausted (the peer posts no receives).
    RnrRetryExceeded,
    /// A memory window bind failed.
    MemoryWindowBind,
    /// The responder sent a response the requester cannot use (bad opcode).
    BadResponse,
    /// Local access error (e.g. a READ response into memory without local write).
    LocalAccess,
    /// The responder aborted the operation.
    RemoteAborted,
    /// The device itself failed.
    Fatal,
    /// No response to a request in time (RD QPs).
    ResponseTimeout,
    /// Provider-specific general error.
    General,
    /// Any other `ibv_wc_status` (its raw code; see [`WcStatus::hint`]).
    Other(u32),
}

impl WcStatus {
    /// What a person should check when they see this status.
    pub fn hint(self) -> &'static str {
        match self {
            WcStatus::Success => "the operation completed successfully",
            WcStatus::LocalLength => "a message was larger than the receive buffer posted for it",
            WcStatus::LocalQpOperation => {
                "local QP operation error: a work request the QP cannot execute"
            }
            WcStatus::LocalProtection => {
                "local buffer not registered, or registered without the needed access"
            }
            WcStatus::Flushed => {
                "flushed: the queue pair entered the error state before this request ran"
            }
            WcStatus::RemoteInvalidRequest => {
                "the peer rejected the request as invalid (opcode, length or alignment)"
            }
            WcStatus::RemoteAccess => {
                "the peer refused the access: wrong R_Key, out of bounds, or missing rights"
            }
            WcStatus::RemoteOperational => "the peer failed to execute the request",
            WcStatus::RetryExceeded => {
                "no response after all retries: peer unreachable, wrong GID, or MTU mismatch"
            }
            WcStatus::RnrRetryExceeded => {
                "the peer posted no receive buffer in time (receiver not ready)"
            }
            WcStatus::MemoryWindowBind => "a memory window could not be bound (rights or range)",
            WcStatus::BadResponse => {
                "the peer answered with an unexpected response: firmware or interoperability problem"
            }
            WcStatus::LocalAccess => {
                "local memory refused the access: READ/atomic target registered without local write"
            }
            WcStatus::RemoteAborted => "the peer aborted the operation",
            WcStatus::Fatal => "the RDMA device reported a fatal error: check dmesg and the NIC",
            WcStatus::ResponseTimeout => "no response in time: peer unreachable",
            WcStatus::General => "the provider reported a general error: check dmesg",
            WcStatus::Other(3) => "local end-to-end context error (RD, unused by rdmx)",
            WcStatus::Other(14) | WcStatus::Other(15) | WcStatus::Other(17) | WcStatus::Other(18) => {
                "reliable-datagram error (RD, unused by rdmx): provider or firmware problem"
            }
            WcStatus::Other(22) | WcStatus::Other(23) => {
                "tag-matching error (unused by rdmx): provider or firmware problem"
            }
            WcStatus::Other(_) => "unknown completion status: provider newer than rdmx",
        }
    }

    /// The status for a raw `ibv_wc_status` code (`enum ibv_wc_status` in
    /// `<infiniband/verbs.h>`, the IBTA completion errors of 11.6.2).
    pub fn from_ibv(code: u32) -> WcStatus {
        match code {
            0 => WcStatus::Success,
            1 => WcStatus::LocalLength,
            2 => WcStatus::LocalQpOperation,
            4 => WcStatus::LocalProtection,
            5 => WcStatus::Flushed,
            6 => WcStatus::MemoryWindowBind,
            7 => WcStatus::BadResponse,
            8 => WcStatus::LocalAccess,
            9 => WcStatus::RemoteInvalidRequest,
            10 => WcStatus::RemoteAccess,
            11 => WcStatus::RemoteOperational,
            12 => WcStatus::RetryExceeded,
            13 => WcStatus::RnrRetryExceeded,
            16 => WcStatus::RemoteAborted,
            19 => WcStatus::Fatal,
            20 => WcStatus::ResponseTimeout,
            21 => WcStatus::General,
            other => WcStatus::Other(other),
        }
    }
}

/// What a completion was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A send finished.
    Send,
    /// An RDMA WRITE finished.
    Write,
    /// An RDMA READ finished.
    Read,
    /// A compare-and-swap finished.
    CompareSwap,
    /// A fetch-and-add finished.
    FetchAdd,
    /// A receive got a message.
    Recv,
    /// A receive was consumed by a WRITE with immediate.
    RecvWriteImm,
}

/// A work completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkCompletion {
    /// The work request's id.
    pub wr_id: u64,
    /// The QP it belongs to.
    pub qpn: u32,
    /// Outcome.
    pub status: WcStatus,
    /// What finished.
    pub opcode: WcOpcode,
    /// Bytes moved.
    pub byte_len: u64,
    /// Received message or READ data.
    pub data: Bytes,
    /// Immediate data.
    pub imm: Option<u32>,
    /// The original remote value of an atomic.
    pub atomic_orig: Option<u64>,
}

/// A completion queue whose events can be awaited through a file descriptor
/// (`ibv_comp_channel` on NICs).
pub trait CompletionQueue: Send + Sync + 'static {
    /// Move completions into `out` (about `max`: one NIC completion may also
    /// complete unsignaled requests before it); returns how many.
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize;
    /// Arm: make the event fd readable at the next completion (`ibv_req_notify_cq`).
    fn req_notify(&self) -> Result<()>;
    /// The event fd (non-blocking).
    fn event_fd(&self) -> BorrowedFd<'_>;
    /// Consume pending events (`ibv_get_cq_event` + `ibv_ack_cq_events`), without blocking.
    fn ack_events(&self);
    /// Providers that run in-process may wake a waiter directly instead of
    /// through the event fd: register `waker` for the next armed completion and
    /// return true. The default (NICs) returns false: use the fd.
    fn register_waker(&self, _waker: &std::task::Waker) -> bool {
        false
    }
    /// In-process providers may hand completions over where they produce
    /// them: after adding completions from a task of their own (a packet
    /// received, a timer), with none of their locks held, they call
    /// `handler` instead of waking the waiter, which saves a task hop per
    /// completion. Completions added from other contexts (an application's
    /// post) still wake the waiter. Returns false if the provider cannot
    /// (NICs, the default): use [`CqWaiter`].
    fn set_handler(&self, _handler: std::sync::Weak<dyn CompletionHandler>) -> bool {
        false
    }
    /// Completions waiting, if the provider can tell without taking them
    /// (`None`: it cannot, as with a NIC).
    fn pending(&self) -> Option<usize> {
        None
    }
    /// For providers to recover their concrete CQ type.
    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync>;
}

/// Takes completions where the provider produces them (see
/// [`CompletionQueue::set_handler`]).
pub trait CompletionHandler: Send + Sync + 'static {
    /// Completions wait in the queue: poll them now. Called from the
    /// provider's own task with none of the provider's locks held.
    fn completions_ready(&self);
}

/// QP state as the provider reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Created, not connected.
    Init,
    /// Connected and sending.
    Rts,
    /// Failed; posted requests are flushed.
    Error,
}

/// An RC queue pair.
pub trait QueuePair: Send + Sync + 'static {
    /// Our QP number.
    fn qpn(&self) -> u32;
    /// INIT → RTR → RTS towards `peer`, sending from PSN `sq_psn`.
    fn connect(&self, peer: QpPeer, sq_psn: u32) -> Result<()>;
    /// Post a send-queue request (always signaled).
    fn post_send(&self, wr: SendWr) -> Result<()>;
    /// Post several requests at once. NICs ring one doorbell for the batch
    /// and signal only its last request (and those returning data); every
    /// request still gets its completion. On a NIC a failed batch posts
    /// nothing.
    fn post_send_batch(&self, wrs: Vec<SendWr>) -> Result<()> {
        for wr in wrs {
            self.post_send(wr)?;
        }
        Ok(())
    }
    /// Post a receive able to hold `max_len` bytes.
    fn post_recv(&self, wr_id: u64, max_len: usize) -> Result<()>;
    /// Current state.
    fn state(&self) -> QpState;
    /// The PSN our responder expects next (what the peer's requests have
    /// executed up to); used to settle requests flushed by a QP reset.
    fn expected_psn(&self) -> u32;
    /// Move to ERROR (flushes everything posted).
    fn to_error(&self);
    /// Protocol counters, where the provider has them.
    fn counters(&self) -> QpCounters {
        QpCounters::default()
    }
    /// Add this QP's protocol events (retransmits, NAKs, RNR NAKs, CNPs,
    /// remote operations served and refused) to `stats` as they happen.
    fn attach_stats(&self, stats: Arc<rdmx_core::Stats>);
}

/// Per-QP protocol counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCounters {
    /// Packets retransmitted.
    pub retransmits: u64,
    /// NAKs received.
    pub naks: u64,
    /// RNR NAKs received.
    pub rnr_naks: u64,
    /// CNPs received (DCQCN reaction point).
    pub cnps: u64,
    /// Remote WRITE/READ/atomic requests our responder executed (0 where the
    /// NIC does not count them per QP).
    pub remote_ops: u64,
    /// Remote accesses our responder refused.
    pub remote_denied: u64,
}

/// A protection domain: the memory a peer may reach through our QPs.
pub trait ProtectionDomain: Send + Sync + 'static {
    /// Register `mr` for remote access; returns its remote key.
    fn register(&self, mr: &MemoryRegion) -> Result<u32>;
    /// Create an RC queue pair whose completions go to `cq`.
    fn create_qp(
        &self,
        cq: &Arc<dyn CompletionQueue>,
        opts: QpOptions,
    ) -> Result<Arc<dyn QueuePair>>;
}

/// An RDMA stack: the soft RoCEv2 engine or a NIC.
pub trait Provider: Send + Sync + 'static {
    /// Soft or hardware.
    fn kind(&self) -> ProviderKind;
    /// Device name for people (`"soft-roce:4791"`, `"mlx5_0"`).
    fn device_name(&self) -> String;
    /// Our address on the path from `local_ip` to `peer_ip` (GID, UDP port,
    /// and the largest IBTA MTU the path carries).
    fn port_for(&self, local_ip: IpAddr, peer_ip: IpAddr) -> Result<PortInfo>;
    /// Selective repeat supported (only rdmx engines; NICs do go-back-N).
    fn selective_repeat(&self) -> bool;
    /// Receive credits to offer when each posted receive must hold
    /// `max_message` bytes: NICs pin that memory, so they may offer fewer
    /// than asked. The default offers all.
    fn recv_credits(&self, credits: u32, _max_message: u64) -> u32 {
        credits
    }
    /// A protection domain over `domain`'s regions.
    fn alloc_pd(&self, domain: &Domain) -> Result<Arc<dyn ProtectionDomain>>;
    /// A completion queue.
    fn create_cq(&self, depth: usize) -> Result<Arc<dyn CompletionQueue>>;
}

/// Waits for completions of one CQ under tokio, without losing any: poll; if
/// empty, arm, poll again (a completion may have raced the arm), then wait on
/// the event fd, consume its events, and repeat.
pub struct CqWaiter {
    cq: Arc<dyn CompletionQueue>,
    fd: AsyncFd<OwnedFd>,
    spin: Option<AdaptiveSpin>,
}

/// Adaptive busy polling: before sleeping on the event fd, poll the CQ for
/// up to a budget. A spin that finds nothing halves the budget (idle links
/// stop burning CPU); a sleep that ends sooner than the maximum doubles it
/// (completions come fast, so spinning would have caught them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdaptiveSpin {
    max: std::time::Duration,
    budget: std::time::Duration,
}

impl AdaptiveSpin {
    /// Spin for up to `max` at a time.
    pub fn new(max: std::time::Duration) -> AdaptiveSpin {
        AdaptiveSpin { max, budget: max }
    }

    /// How long to spin now.
    pub fn budget(&self) -> std::time::Duration {
        self.budget
    }

    /// A spin of the current budget found nothing.
    pub fn missed(&mut self) {
        self.budget /= 2;
        if self.budget < std::time::Duration::from_micros(1) {
            self.budget = std::time::Duration::ZERO;
        }
    }

    /// A spin found a completion.
    pub fn hit(&mut self) {
        self.budget = self.budget.max(self.max / 4);
    }

    /// A sleep on the event fd lasted `slept`.
    pub fn woke_after(&mut self, slept: std::time::Duration) {
        if slept < self.max {
            self.budget = (self.budget * 2).clamp(self.max / 8, self.max);
        }
    }
}

impl fmt::Debug for CqWaiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CqWaiter")
            .field("fd", &self.fd.get_ref().as_raw_fd())
            .finish()
    }
}

impl CqWaiter {
    /// Register `cq`'s event fd with the current tokio runtime.
    pub fn new(cq: Arc<dyn CompletionQueue>) -> Result<CqWaiter> {
        let fd = cq
            .event_fd()
            .try_clone_to_owned()
            .and_then(crate::sys::register_fd)
            .map_err(|e| rdmx_core::Error::ResourceExhausted(format!("CQ event fd: {e}")))?;
        Ok(CqWaiter { cq, fd, spin: None })
    }

    /// Busy-poll adaptively for up to `max` before sleeping (`None`: never).
    pub fn with_busy_poll(mut self, max: Option<std::time::Duration>) -> CqWaiter {
        self.spin = max.filter(|d| !d.is_zero()).map(AdaptiveSpin::new);
        self
    }

    /// Wait until at least one completion is available and move up to `max` into `out`.
    pub async fn next(&mut self, out: &mut Vec<WorkCompletion>, max: usize) -> Result<usize> {
        loop {
            let n = self.cq.poll(out, max);
            if n > 0 {
                return Ok(n);
            }
            if let Some(spin) = self.spin.as_mut() {
                let budget = spin.budget();
                if !budget.is_zero() {
                    let until = std::time::Instant::now() + budget;
                    while std::time::Instant::now() < until {
                        tokio::task::yield_now().await;
                        let n = self.cq.poll(out, max);
                        if n > 0 {
                            spin.hit();
                            return Ok(n);
                        }
                    }
                    spin.missed();
                }
            }
            let slept = std::time::Instant::now();
            // In-process providers wake this task directly (no fd round trip,
            // and the wake stays on the current worker).
            let cq = &self.cq;
            let mut armed_err = None;
            let direct = std::future::poll_fn(|cx| {
                if !cq.register_waker(cx.waker()) {
                    return std::task::Poll::Ready(None);
                }
                if let Err(e) = cq.req_notify() {
                    armed_err = Some(e);
                    return std::task::Poll::Ready(Some(0));
                }
                match cq.poll(out, max) {
                    0 => std::task::Poll::Pending,
                    n => std::task::Poll::Ready(Some(n)),
                }
            })
            .await;
            if let Some(e) = armed_err {
                return Err(e);
            }
            match direct {
                Some(0) => continue,
                Some(n) => {
                    if let Some(s) = self.spin.as_mut() {
                        s.woke_after(slept.elapsed());
                    }
                    return Ok(n);
                }
                None => {}
            }
            self.cq.req_notify()?;
            let n = self.cq.poll(out, max);
            if n > 0 {
                return Ok(n);
            }
            let mut guard = self
                .fd
                .readable()
                .await
                .map_err(|e| rdmx_core::Error::Disconnected(format!("CQ event fd: {e}")))?;
            self.cq.ack_events();
            guard.clear_ready();
            if let Some(s) = self.spin.as_mut() {
                s.woke_after(slept.elapsed());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timers_agree_on_the_more_patient_values() {
        let a = QpTimers {
            timeout: 10,
            retry_cnt: 7,
            rnr_retry: 3,
        };
        let b = QpTimers {
            timeout: 18,
            retry_cnt: 2,
            rnr_retry: 7,
        };
        let t = QpTimers {
            timeout: 18,
            retry_cnt: 7,
            rnr_retry: 7,
        };
        assert_eq!(a.agree(b), t);
        assert_eq!(b.agree(a), t, "symmetric: both ends compute the same");
        assert_eq!(
            QpTimers::of(&QpOptions::default()),
            QpTimers {
                timeout: 10,
                retry_cnt: 7,
                rnr_retry: 7
            }
        );
    }

    #[test]
    fn busy_polling_adapts_to_traffic() {
        let max = Duration::from_micros(64);
        let mut s = AdaptiveSpin::new(max);
        assert_eq!(s.budget(), max);
        // An idle link: every spin misses, the budget drains to nothing.
        for _ in 0..10 {
            s.missed();
        }
        assert_eq!(s.budget(), Duration::ZERO);
        // A slow sleep (idle) leaves it off.
        s.woke_after(Duration::from_millis(5));
        assert_eq!(s.budget(), Duration::ZERO);
        // Completions arrive soon after sleeping: spinning comes back, and grows.
        s.woke_after(Duration::from_micros(10));
        assert_eq!(s.budget(), max / 8);
        s.woke_after(Duration::from_micros(10));
        assert_eq!(s.budget(), max / 4);
        for _ in 0..5 {
            s.woke_after(Duration::from_micros(10));
        }
        assert_eq!(s.budget(), max, "capped");
        s.missed();
        s.hit();
        assert_eq!(s.budget(), max / 2);
    }
}
