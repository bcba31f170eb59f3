//! A sans-IO RC queue pair: requester, responder and completer (the split of
//! Linux rxe), driven by the caller with packets, time and work requests.
//!
//! ```text
//! post_send / post_recv  ─┐                 ┌─> poll_completion
//! handle_packet(now, ..) ─┼─>  Qp  (state) ─┼─> poll_transmit(now)
//! handle_timeout(now)    ─┘                 └─> poll_timeout()
//! ```
//!
//! Time is a caller-supplied nanosecond counter; the engine has no clock.
//! Loss recovery is go-back-N (rocev2-reference §7).

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use crate::dcqcn::{Dcqcn, DcqcnConfig};
use crate::memory::{Atomic, MemError, Memory, Need};
use crate::opcode::Opcode;
use crate::packet::{rnr_delay_us, Aeth, AtomicEth, Bth, NakCode, Packet, Reth, Syndrome};
use crate::psn;

/// Queue pair states (the verbs state machine, reduced to what RC uses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    /// Just created.
    Reset,
    /// Receives may be posted.
    Init,
    /// Ready to receive: the responder runs.
    Rtr,
    /// Ready to send: requester and responder run.
    Rts,
    /// Failed: everything outstanding was flushed.
    Error,
}

/// Connection parameters (what `ibv_modify_qp` sets).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QpConfig {
    /// Path MTU: 256, 512, 1024, 2048 or 4096 (rocev2-reference §8).
    pub pmtu: u32,
    /// Local ACK timeout exponent: 4.096 µs × 2^timeout; 0 disables (§7).
    pub timeout: u8,
    /// Retries on timeout or sequence NAK before failing (3 bits; 7 is counted
    /// like any other value, unlike rxe's quirk, rocev2-reference §7).
    pub retry_cnt: u8,
    /// Retries on RNR NAK before failing; 7 = infinite (3 bits).
    pub rnr_retry: u8,
    /// RNR timer code the responder puts in its RNR NAKs (§5).
    pub min_rnr_timer: u8,
    /// Outstanding READ/atomic requests (max_rd_atomic).
    pub max_rd_atomic: u32,
    /// Unacknowledged PSNs before the requester pauses (rxe: 128).
    pub max_unacked: u32,
    /// The requester asks for an ACK at least every this many packets (rxe: 64).
    pub ack_every: u32,
    /// DCQCN congestion control; `None` disables the sender's rate limiter
    /// (CNPs are still sent for CE-marked packets, as NICs do).
    pub dcqcn: Option<DcqcnConfig>,
    /// Selective repeat instead of go-back-N (rdmx peers only; see [`Qp::set_selective_repeat`]).
    pub selective_repeat: bool,
}

impl Default for QpConfig {
    fn default() -> Self {
        QpConfig {
            pmtu: 1024,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            min_rnr_timer: 1,
            max_rd_atomic: 16,
            max_unacked: 128,
            ack_every: 64,
            dcqcn: Some(DcqcnConfig::default()),
            selective_repeat: false,
        }
    }
}

impl QpConfig {
    /// The local ACK timeout in nanoseconds (`None` when disabled).
    pub fn ack_timeout_ns(&self) -> Option<u64> {
        (self.timeout != 0).then(|| 4096u64 << self.timeout.min(31))
    }
}

/// A send-queue work request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum WorkRequest {
    /// Two-sided send, optionally with immediate data or an R_Key to invalidate.
    Send {
        /// Message.
        data: Bytes,
        /// Immediate data.
        imm: Option<u32>,
        /// R_Key for the peer to invalidate.
        invalidate: Option<u32>,
    },
    /// RDMA WRITE (with immediate: consumes a receive at the peer).
    Write {
        /// Data.
        data: Bytes,
        /// Remote address.
        va: u64,
        /// Remote key.
        rkey: u32,
        /// Immediate data.
        imm: Option<u32>,
    },
    /// RDMA READ; the data comes back in the completion.
    Read {
        /// Remote address.
        va: u64,
        /// Remote key.
        rkey: u32,
        /// Bytes to read.
        len: u32,
    },
    /// Atomic on a remote 8-byte word; the original value comes back.
    Atomic {
        /// Remote address (8-byte aligned).
        va: u64,
        /// Remote key.
        rkey: u32,
        /// The operation.
        op: Atomic,
    },
}

/// Completion status (a subset of `ibv_wc_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcStatus {
    /// Done.
    Success,
    /// A message did not fit the posted receive.
    LocalLengthError,
    /// The peer NAKed the request as invalid (0x61).
    RemoteInvalidRequest,
    /// The peer refused the memory access (0x62).
    RemoteAccessError,
    /// The peer failed to execute (0x63).
    RemoteOperationalError,
    /// No ACK after `retry_cnt` retries: peer unreachable, wrong address, or MTU mismatch.
    RetryExceeded,
    /// The peer had no receive posted after `rnr_retry` retries.
    RnrRetryExceeded,
    /// Flushed because the QP went to the error state.
    Flushed,
}

/// What a completion completes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WcOpcode {
    /// A send.
    Send,
    /// An RDMA WRITE.
    Write,
    /// An RDMA READ.
    Read,
    /// A compare-and-swap.
    CompareSwap,
    /// A fetch-and-add.
    FetchAdd,
    /// A received message.
    Recv,
    /// A received write-with-immediate.
    RecvWriteImm,
}

/// A work completion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The work request's id.
    pub wr_id: u64,
    /// Outcome.
    pub status: WcStatus,
    /// Kind.
    pub opcode: WcOpcode,
    /// Bytes moved.
    pub byte_len: u64,
    /// Received message, or read data.
    pub data: Bytes,
    /// Immediate data received.
    pub imm: Option<u32>,
    /// R_Key the sender asked us to invalidate.
    pub invalidate: Option<u32>,
    /// Original value of an atomic.
    pub atomic_orig: Option<u64>,
}

impl Completion {
    fn new(wr_id: u64, status: WcStatus, opcode: WcOpcode) -> Completion {
        Completion {
            wr_id,
            status,
            opcode,
            byte_len: 0,
            data: Bytes::new(),
            imm: None,
            invalidate: None,
            atomic_orig: None,
        }
    }
}

/// Why a call was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum QpError {
    /// The QP is not in a state that allows this.
    #[error("QP is in state {0:?}")]
    State(QpState),
    /// A write-with-immediate or read larger than 2^31 bytes.
    #[error("message too large")]
    TooLarge,
    /// Not a path MTU IBTA allows.
    #[error("path MTU {0} is not one of 256, 512, 1024, 2048, 4096")]
    BadMtu(u32),
}

/// Counters of protocol events.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpStats {
    /// Packets sent (including retransmissions).
    pub packets_sent: u64,
    /// Packets retransmitted.
    pub retransmits: u64,
    /// Go-back-N rewinds (timeouts and sequence NAKs).
    pub rewinds: u64,
    /// Local ACK timeouts.
    pub timeouts: u64,
    /// Go-back-N congestion window reductions ([`Qp::cwnd`]).
    pub cwnd_cuts: u64,
    /// NAKs received.
    pub naks_received: u64,
    /// RNR NAKs received.
    pub rnr_naks_received: u64,
    /// NAKs sent.
    pub naks_sent: u64,
    /// RNR NAKs sent.
    pub rnr_naks_sent: u64,
    /// Duplicate requests seen by the responder.
    pub duplicates: u64,
    /// Packets dropped as out of place (wrong PSN or opcode for the state).
    pub dropped: u64,
    /// CE-marked packets received.
    pub ce_received: u64,
    /// CNPs sent (notification point).
    pub cnps_sent: u64,
    /// CNPs received and handled (reaction point).
    pub cnps_received: u64,
    /// Selective repeat: packets the responder kept out of order.
    pub out_of_order_kept: u64,
    /// Remote WRITEs, READs and atomics this responder executed (not duplicates).
    pub remote_ops: u64,
    /// Remote accesses this responder refused (NAK remote access / invalid request).
    pub remote_denied: u64,
}

// ------------------------------------------------------------------ requester

#[derive(Debug)]
struct SendWqe {
    wr_id: u64,
    wr: WorkRequest,
    first_psn: u32,
    /// PSNs the request occupies (READ: one per response packet).
    npkts: u32,
    /// READ data so far (taken from the QP's buffer source on the first response).
    read_buf: Vec<u8>,
    read_len: usize,
    read_next: u32,
    /// PSN of the READ request currently answering (a resumed read starts later).
    round_start: u32,
    done: Option<(WcStatus, Option<u64>)>,
    /// Highest packet index sent so far (to count retransmissions).
    sent_upto: u32,
    /// A READ already asked again in this round after a gap in its responses.
    gap_asked: bool,
    /// Selective repeat: which response packets of a READ arrived.
    read_got: Vec<bool>,
    read_count: u32,
    /// Selective repeat: one past the highest response index received, and
    /// where `read_next` must reach before holes are asked for again.
    read_hi: u32,
    asked_upto: u32,
}

impl SendWqe {
    fn last_psn(&self) -> u32 {
        psn::add(self.first_psn, self.npkts - 1)
    }

    fn needs_response(&self) -> bool {
        matches!(
            self.wr,
            WorkRequest::Read { .. } | WorkRequest::Atomic { .. }
        )
    }

    fn opcode(&self) -> WcOpcode {
        match &self.wr {
            WorkRequest::Send { .. } => WcOpcode::Send,
            WorkRequest::Write { .. } => WcOpcode::Write,
            WorkRequest::Read { .. } => WcOpcode::Read,
            WorkRequest::Atomic {
                op: Atomic::CompareSwap { .. },
                ..
            } => WcOpcode::CompareSwap,
            WorkRequest::Atomic { .. } => WcOpcode::FetchAdd,
        }
    }
}

// ------------------------------------------------------------------ responder

#[derive(Debug)]
struct RecvWqe {
    wr_id: u64,
    max_len: usize,
}

#[derive(Debug)]
enum OpenMessage {
    Send { wqe: RecvWqe, buf: BytesMut },
    Write { reth: Reth, offset: u64 },
}

#[derive(Clone, Debug)]
enum Resource {
    Read {
        first_psn: u32,
        npkts: u32,
        reth: Reth,
    },
    Atomic {
        psn: u32,
        orig: u64,
    },
}

/// Where READ data is gathered: `take(len)` gives a buffer of at least `len`
/// bytes, `freeze(buf, len)` hands its first `len` bytes to the user. A
/// transport plugs in a pool so large reads do not fault in fresh pages.
#[derive(Clone, Copy, Debug)]
pub struct ReadBuffers {
    /// A buffer of at least `len` initialised bytes.
    pub take: fn(usize) -> Vec<u8>,
    /// The first `len` bytes as `Bytes`.
    pub freeze: fn(Vec<u8>, usize) -> Bytes,
}

impl Default for ReadBuffers {
    fn default() -> Self {
        ReadBuffers {
            take: |len| vec![0; len],
            freeze: |mut v, len| {
                v.truncate(len);
                Bytes::from(v)
            },
        }
    }
}

/// An RC queue pair.
#[derive(Debug)]
pub struct Qp {
    cfg: QpConfig,
    read_buffers: ReadBuffers,
    state: QpState,
    local_qpn: u32,
    remote_qpn: u32,
    stats: QpStats,
    completions: VecDeque<Completion>,

    // requester
    sq: VecDeque<SendWqe>,
    next_psn: u32,
    /// Index in `sq` of the WQE being transmitted, and the packet within it.
    tx_wqe: usize,
    tx_pkt: u32,
    /// Oldest unacknowledged PSN.
    una: u32,
    pkts_since_ackreq: u32,
    retry_left: u8,
    rnr_left: u8,
    retry_deadline: Option<u64>,
    /// First retransmission timer exponent when below `cfg.timeout` (see
    /// [`Qp::set_fast_timeout`]); 0: none.
    fast_timeout: u8,
    /// Consecutive timeouts without progress.
    backoff: u32,
    /// Go-back-N congestion window (packets), see [`Qp::cwnd`].
    cwnd: u32,
    /// Its slow-start threshold.
    ssthresh: u32,
    /// Packets acknowledged towards the next additive increase.
    cwnd_acked: u32,
    /// `una` when the window last grew.
    cc_una: u32,
    rnr_until: Option<u64>,
    /// Selective repeat: single PSNs to resend before anything new.
    retx: VecDeque<u32>,
    /// Selective repeat: READ response ranges to ask for again
    /// (WQE first PSN, first and end packet index).
    read_retx: VecDeque<(u32, u32, u32)>,

    // responder
    epsn: u32,
    msn: u32,
    rq: VecDeque<RecvWqe>,
    open: Option<OpenMessage>,
    nak_sent: bool,
    /// Selective repeat: packets kept out of order since the last NAK.
    since_nak: u32,
    /// Selective repeat: packets that arrived ahead of ePSN, executed in order
    /// once the gap fills.
    ooo: std::collections::BTreeMap<u32, Packet>,
    resources: VecDeque<Resource>,
    pending_ack: Option<u32>,
    resp_tx: VecDeque<Packet>,

    // congestion control
    rp: Option<Dcqcn>,
    next_send_at: u64,
    pace_blocked: bool,
    last_cnp_sent: Option<u64>,
}

/// NAK code of the rdmx selective NAK ("this PSN is missing"; nothing is
/// acknowledged by it). IBTA reserves codes 5..=31; only sent to rdmx peers
/// that negotiated selective repeat.
const SR_HOLE: u8 = 0x1F;

fn mem_nak(e: MemError) -> NakCode {
    match e {
        MemError::Misaligned => NakCode::InvalidRequest,
        _ => NakCode::RemoteAccessError,
    }
}

fn nak_syndrome(code: NakCode) -> u8 {
    0x60 | match code {
        NakCode::PsnSequenceError => 0,
        NakCode::InvalidRequest => 1,
        NakCode::RemoteAccessError => 2,
        NakCode::RemoteOperationalError => 3,
        NakCode::Other(v) => v & 0x1F,
    }
}

impl Qp {
    /// A QP in the RESET state.
    pub fn new(cfg: QpConfig, local_qpn: u32) -> Qp {
        Qp {
            cfg,
            read_buffers: ReadBuffers::default(),
            state: QpState::Reset,
            local_qpn,
            remote_qpn: 0,
            stats: QpStats::default(),
            completions: VecDeque::new(),
            sq: VecDeque::new(),
            next_psn: 0,
            tx_wqe: 0,
            tx_pkt: 0,
            una: 0,
            pkts_since_ackreq: 0,
            retry_left: cfg.retry_cnt,
            rnr_left: cfg.rnr_retry,
            retry_deadline: None,
            fast_timeout: 0,
            backoff: 0,
            cwnd: cfg.max_unacked,
            ssthresh: cfg.max_unacked,
            cwnd_acked: 0,
            cc_una: 0,
            rnr_until: None,
            retx: VecDeque::new(),
            read_retx: VecDeque::new(),
            epsn: 0,
            msn: 0,
            rq: VecDeque::new(),
            open: None,
            nak_sent: false,
            since_nak: 0,
            ooo: std::collections::BTreeMap::new(),
            resources: VecDeque::new(),
            pending_ack: None,
            resp_tx: VecDeque::new(),
            rp: cfg.dcqcn.map(Dcqcn::new),
            next_send_at: 0,
            pace_blocked: false,
            last_cnp_sent: None,
        }
    }

    /// The sender's DCQCN rate in bit/s, when it is limiting (`None`: line rate
    /// or DCQCN disabled).
    pub fn rate_bps(&self) -> Option<f64> {
        self.rp.as_ref().and_then(|r| r.rate_bps())
    }

    /// RESET → INIT.
    pub fn to_init(&mut self) -> Result<(), QpError> {
        self.expect(QpState::Reset)?;
        self.state = QpState::Init;
        Ok(())
    }

    /// Set the path MTU before the QP is connected (`ibv_modify_qp` to RTR
    /// carries it): 256, 512, 1024, 2048 or 4096.
    pub fn set_pmtu(&mut self, pmtu: u32) -> Result<(), QpError> {
        if !matches!(self.state, QpState::Reset | QpState::Init) {
            return Err(QpError::State(self.state));
        }
        if !matches!(pmtu, 256 | 512 | 1024 | 2048 | 4096) {
            return Err(QpError::BadMtu(pmtu));
        }
        self.cfg.pmtu = pmtu;
        Ok(())
    }

    /// Set the requester's timers before the QP sends (`ibv_modify_qp` to RTS
    /// carries them, IBTA vol. 1 ch. 11): ACK timeout exponent (0..=31,
    /// 0 disables), retry count and RNR retry count (0..=7; 7 RNR = infinite).
    pub fn set_timers(&mut self, timeout: u8, retry_cnt: u8, rnr_retry: u8) -> Result<(), QpError> {
        if !matches!(self.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(QpError::State(self.state));
        }
        self.cfg.timeout = timeout.min(31);
        self.cfg.retry_cnt = retry_cnt.min(7);
        self.cfg.rnr_retry = rnr_retry.min(7);
        self.retry_left = self.cfg.retry_cnt;
        self.rnr_left = self.cfg.rnr_retry;
        Ok(())
    }

    /// Retransmit first after 4.096 µs × 2^`exp` when that is shorter than
    /// the ACK timeout, doubling on each timeout in a row up to the larger of
    /// the ACK timeout and 64 × the fast timer. Only timeouts of that full
    /// length use up a retry, so a peer is given at least `retry_cnt` × the
    /// ACK timeout it agreed to (as by a NIC with those timers) while a lost
    /// last packet is resent early. Purely local; 0 turns it off.
    pub fn set_fast_timeout(&mut self, exp: u8) {
        self.fast_timeout = exp.min(31);
    }

    /// The go-back-N congestion window in packets: the requester keeps at
    /// most this many PSNs unacknowledged (and never more than
    /// `max_unacked`). It starts at `max_unacked`, halves at each sequence
    /// NAK, falls to its floor at a timeout, and grows back per ACK (doubling
    /// per round trip up to half the window before the loss, then by one
    /// packet per window), as TCP's Reno does (RFC 5681). A go-back-N sender
    /// resends everything after a loss, so without it a slow peer (a NIC
    /// behind a busy host, rxe in a VM) that drops a burst is sent the same
    /// burst again. Selective repeat does not use it.
    pub fn cwnd(&self) -> u32 {
        self.cwnd
    }

    /// The smallest congestion window.
    const MIN_CWND: u32 = 8;

    /// The current retransmission interval: the fast timer doubled per
    /// timeout in a row, up to [`Qp::full_rto_ns`] (`None`: timer disabled).
    fn rto_ns(&self) -> Option<u64> {
        let full = self.full_rto_ns()?;
        if self.fast_timeout == 0 || self.fast_timeout >= self.cfg.timeout {
            return Some(full);
        }
        let fast = 4096u64 << self.fast_timeout;
        Some((fast << self.backoff.min(31)).min(full))
    }

    /// The longest retransmission interval, whose expiry uses up a retry:
    /// the ACK timeout, or 64 × the fast timer if that is longer.
    fn full_rto_ns(&self) -> Option<u64> {
        let ack = self.cfg.ack_timeout_ns()?;
        if self.fast_timeout == 0 || self.fast_timeout >= self.cfg.timeout {
            return Some(ack);
        }
        Some(ack.max(4096u64 << (u32::from(self.fast_timeout) + 6)))
    }

    /// A loss (go-back-N only): shrink the window (RFC 5681 §3.1).
    fn cc_loss(&mut self, timeout: bool) {
        if self.cfg.selective_repeat {
            return;
        }
        self.ssthresh = (self.cwnd / 2).max(Self::MIN_CWND);
        self.cwnd = if timeout {
            Self::MIN_CWND
        } else {
            self.ssthresh
        };
        self.cwnd_acked = 0;
        self.stats.cwnd_cuts += 1;
    }

    /// `una` moved: grow the window by what was acknowledged.
    fn cc_acked(&mut self) {
        let acked = psn::diff(self.una, self.cc_una).max(0) as u32;
        self.cc_una = self.una;
        if self.cfg.selective_repeat || acked == 0 || self.cwnd >= self.cfg.max_unacked {
            return;
        }
        if self.cwnd < self.ssthresh {
            self.cwnd = (self.cwnd + acked).min(self.ssthresh);
        } else {
            self.cwnd_acked += acked;
            if self.cwnd_acked >= self.cwnd {
                self.cwnd_acked -= self.cwnd;
                self.cwnd += 1;
            }
        }
        self.cwnd = self.cwnd.min(self.cfg.max_unacked);
    }

    /// Gather READ data in buffers from `b` (e.g. a pool) instead of fresh allocations.
    pub fn set_read_buffers(&mut self, b: ReadBuffers) {
        self.read_buffers = b;
    }

    /// Loss recovery: selective repeat (both ends must be rdmx engines that
    /// agreed at connect) or go-back-N (the standard, and what NICs speak).
    pub fn set_selective_repeat(&mut self, on: bool) {
        self.cfg.selective_repeat = on;
    }

    /// INIT → RTR: the peer's QPN and the PSN it will start sending with.
    pub fn to_rtr(&mut self, remote_qpn: u32, rq_psn: u32) -> Result<(), QpError> {
        self.expect(QpState::Init)?;
        self.remote_qpn = remote_qpn & psn::PSN_MASK;
        self.epsn = rq_psn & psn::PSN_MASK;
        self.state = QpState::Rtr;
        Ok(())
    }

    /// RTR → RTS: the PSN we start sending with.
    pub fn to_rts(&mut self, sq_psn: u32) -> Result<(), QpError> {
        self.expect(QpState::Rtr)?;
        self.next_psn = sq_psn & psn::PSN_MASK;
        self.una = self.next_psn;
        self.cc_una = self.una;
        self.state = QpState::Rts;
        Ok(())
    }

    /// RESET → RTS in one step.
    pub fn connect(&mut self, remote_qpn: u32, sq_psn: u32, rq_psn: u32) -> Result<(), QpError> {
        self.to_init()?;
        self.to_rtr(remote_qpn, rq_psn)?;
        self.to_rts(sq_psn)
    }

    fn expect(&self, s: QpState) -> Result<(), QpError> {
        if self.state == s {
            Ok(())
        } else {
            Err(QpError::State(self.state))
        }
    }

    /// Current state.
    pub fn state(&self) -> QpState {
        self.state
    }

    /// Our QP number.
    pub fn qpn(&self) -> u32 {
        self.local_qpn
    }

    /// Protocol counters.
    pub fn stats(&self) -> QpStats {
        self.stats
    }

    /// The PSN the responder expects next (ePSN).
    pub fn expected_psn(&self) -> u32 {
        self.epsn
    }

    /// Work requests posted and not yet completed.
    pub fn outstanding(&self) -> usize {
        self.sq.len()
    }

    /// Post a receive able to hold `max_len` bytes.
    pub fn post_recv(&mut self, wr_id: u64, max_len: usize) -> Result<(), QpError> {
        match self.state {
            QpState::Init | QpState::Rtr | QpState::Rts => {
                self.rq.push_back(RecvWqe { wr_id, max_len });
                Ok(())
            }
            s => Err(QpError::State(s)),
        }
    }

    /// Post a send-queue work request.
    pub fn post_send(&mut self, wr_id: u64, wr: WorkRequest) -> Result<(), QpError> {
        self.expect(QpState::Rts)?;
        let pmtu = self.cfg.pmtu as usize;
        let segs = |len: usize| len.div_ceil(pmtu).max(1) as u32;
        let npkts = match &wr {
            WorkRequest::Send { data, .. } | WorkRequest::Write { data, .. } => {
                if data.len() > 1 << 31 {
                    return Err(QpError::TooLarge);
                }
                segs(data.len())
            }
            WorkRequest::Read { len, .. } => {
                if *len > 1 << 31 {
                    return Err(QpError::TooLarge);
                }
                segs(*len as usize)
            }
            WorkRequest::Atomic { .. } => 1,
        };
        let first_psn = self.next_psn;
        self.next_psn = psn::add(self.next_psn, npkts);
        self.sq.push_back(SendWqe {
            wr_id,
            wr,
            first_psn,
            npkts,
            read_buf: Vec::new(),
            read_len: 0,
            read_next: first_psn,
            round_start: first_psn,
            done: None,
            sent_upto: 0,
            gap_asked: false,
            read_got: Vec::new(),
            read_count: 0,
            read_hi: 0,
            asked_upto: 0,
        });
        Ok(())
    }

    /// The next completion, in order per queue.
    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.completions.pop_front()
    }

    /// When [`Qp::handle_timeout`] should be called next.
    pub fn poll_timeout(&self) -> Option<u64> {
        let pace = self.pace_blocked.then_some(self.next_send_at);
        [self.retry_deadline, self.rnr_until, pace]
            .into_iter()
            .flatten()
            .min()
    }

    // ------------------------------------------------------------- transmit

    /// The next packet to send, if any (responses first, then requests).
    pub fn poll_transmit(&mut self, now: u64) -> Option<Packet> {
        if self.state == QpState::Reset {
            return None;
        }
        if let Some(p) = self.resp_tx.pop_front() {
            self.stats.packets_sent += 1;
            return Some(p);
        }
        if self.state == QpState::Error {
            return None;
        }
        if let Some(psn) = self.pending_ack.take() {
            self.stats.packets_sent += 1;
            return Some(self.ack_packet(psn, 0x1F));
        }
        if self.state != QpState::Rts {
            return None;
        }
        let p = self.next_request(now)?;
        self.stats.packets_sent += 1;
        if self.retry_deadline.is_none() {
            self.retry_deadline = self.rto_ns().map(|t| now + t);
        }
        Some(p)
    }

    fn ack_packet(&self, psn: u32, syndrome: u8) -> Packet {
        let mut p = Packet::new(Bth::new(Opcode::ACKNOWLEDGE, self.remote_qpn, psn));
        p.aeth = Some(Aeth {
            syndrome,
            msn: self.msn & psn::PSN_MASK,
        });
        p
    }

    fn next_request(&mut self, now: u64) -> Option<Packet> {
        if self.rnr_until.is_some_and(|t| now < t) {
            return None;
        }
        self.rnr_until = None;
        // DCQCN pacing (rocev2-reference §11): wait for the rate limiter.
        if let Some(rp) = self.rp.as_mut() {
            rp.advance(now);
            if rp.rate_bps().is_some() && now < self.next_send_at && self.tx_wqe < self.sq.len() {
                self.pace_blocked = true;
                return None;
            }
        }
        self.pace_blocked = false;
        if let Some(p) = self.selective_resend(now) {
            return Some(p);
        }
        let wqe = self.sq.get(self.tx_wqe)?;
        let psn = psn::add(wqe.first_psn, self.tx_pkt);
        // Window: unacknowledged PSNs (rxe RXE_MAX_UNACKED_PSNS), and the
        // congestion window in go-back-N.
        let window = if self.cfg.selective_repeat {
            self.cfg.max_unacked
        } else {
            self.cwnd.min(self.cfg.max_unacked)
        };
        if psn::diff(psn, self.una) >= window as i32 {
            return None;
        }
        // Outstanding READ/atomic limit (max_rd_atomic), counted before this
        // one from the oldest unfinished request: those that finished out of
        // order behind it count too, because the responder keeps replay state
        // for only its last max_rd_atomic of them (IBTA 9.5, o9-21), and the
        // oldest may still have to be asked again.
        if wqe.needs_response() && self.tx_pkt == 0 {
            let outstanding = self
                .sq
                .iter()
                .take(self.tx_wqe)
                .skip_while(|w| w.done.is_some())
                .filter(|w| w.needs_response())
                .count();
            if outstanding >= self.cfg.max_rd_atomic as usize {
                return None;
            }
        }
        let idx = self.tx_pkt;
        let (mut pkt, advance) = self.build_request(self.tx_wqe, idx);
        let wqe = &self.sq[self.tx_wqe];
        let last = idx + advance >= wqe.npkts;
        // AckReq on the last packet of a message and at least every `ack_every`
        // packets (rocev2-reference §6); reads and atomics are always answered.
        // In go-back-N the ACKs also clock the congestion window: ask at
        // least twice per window.
        self.pkts_since_ackreq += 1;
        let every = if self.cfg.selective_repeat {
            self.cfg.ack_every
        } else {
            self.cfg.ack_every.min((self.cwnd / 2).max(1))
        };
        if last || self.pkts_since_ackreq >= every || wqe.needs_response() {
            pkt.bth.ack_req = true;
            self.pkts_since_ackreq = 0;
        }
        self.account_sent(now, &pkt);
        let wqe = &mut self.sq[self.tx_wqe];
        if idx < wqe.sent_upto {
            self.stats.retransmits += 1;
        } else {
            // A READ request covers its whole chunk of responses.
            wqe.sent_upto = idx + advance;
        }
        self.tx_pkt += advance;
        if self.tx_pkt >= wqe.npkts {
            self.tx_wqe += 1;
            self.tx_pkt = 0;
        }
        Some(pkt)
    }

    /// DCQCN byte counting and pacing for a packet about to leave.
    fn account_sent(&mut self, now: u64, pkt: &Packet) {
        if let Some(rp) = self.rp.as_mut() {
            // Bytes on the wire: Ethernet + IPv4 + UDP (42) + transport + ICRC.
            let wire = (42 + pkt.encoded_len() + 4) as u64;
            rp.on_sent(now, wire);
            self.next_send_at = self.next_send_at.max(now) + rp.pace_ns(wire);
        }
    }

    /// Selective repeat: the next single packet to resend, if any.
    fn selective_resend(&mut self, now: u64) -> Option<Packet> {
        while let Some((first, start, end)) = self.read_retx.pop_front() {
            let Some(wi) = self
                .sq
                .iter()
                .position(|w| w.done.is_none() && w.first_psn == first)
            else {
                continue;
            };
            let (mut pkt, _) = self.build_request(wi, start);
            // Only the missing run: shorten the request (rdmx SR peers accept
            // any sub-range of a READ they executed).
            let pmtu = u64::from(self.cfg.pmtu);
            if let (Some(r), WorkRequest::Read { len, .. }) = (pkt.reth.as_mut(), &self.sq[wi].wr) {
                let from = u64::from(start) * pmtu;
                r.dma_len = (u64::from(end - start) * pmtu).min(u64::from(*len) - from) as u32;
            }
            pkt.bth.ack_req = true;
            self.account_sent(now, &pkt);
            self.stats.retransmits += 1;
            return Some(pkt);
        }
        while let Some(p) = self.retx.pop_front() {
            if psn::diff(p, self.una) < 0 {
                continue; // acknowledged meanwhile
            }
            let Some(wi) = self.sq.iter().position(|w| {
                w.done.is_none()
                    && psn::diff(p, w.first_psn) >= 0
                    && psn::diff(p, w.last_psn()) <= 0
            }) else {
                continue;
            };
            let idx = psn::diff(p, self.sq[wi].first_psn) as u32;
            if idx >= self.sq[wi].sent_upto {
                continue; // never sent: the normal path sends it
            }
            let (mut pkt, _) = self.build_request(wi, idx);
            pkt.bth.ack_req = true;
            self.account_sent(now, &pkt);
            self.stats.retransmits += 1;
            return Some(pkt);
        }
        None
    }

    /// The request packet for packet `idx` of WQE `wi`, and how many PSNs it
    /// covers (a READ request covers its chunk of responses).
    fn build_request(&self, wi: usize, idx: u32) -> (Packet, u32) {
        let wqe = &self.sq[wi];
        let psn = psn::add(wqe.first_psn, idx);
        let pmtu = self.cfg.pmtu as usize;
        let last = idx + 1 == wqe.npkts;
        let first = idx == 0;
        let mut pkt = Packet::new(Bth::new(Opcode::SEND_ONLY, self.remote_qpn, psn));
        let seg = |data: &Bytes| {
            let start = idx as usize * pmtu;
            data.slice(start..(start + pmtu).min(data.len()))
        };
        let mut advance = 1;
        match &wqe.wr {
            WorkRequest::Send {
                data,
                imm,
                invalidate,
            } => {
                pkt.bth.opcode = match (first, last, imm.is_some(), invalidate.is_some()) {
                    (true, true, true, _) => Opcode::SEND_ONLY_WITH_IMMEDIATE,
                    (true, true, _, true) => Opcode::SEND_ONLY_WITH_INVALIDATE,
                    (true, true, _, _) => Opcode::SEND_ONLY,
                    (true, false, ..) => Opcode::SEND_FIRST,
                    (false, false, ..) => Opcode::SEND_MIDDLE,
                    (false, true, true, _) => Opcode::SEND_LAST_WITH_IMMEDIATE,
                    (false, true, _, true) => Opcode::SEND_LAST_WITH_INVALIDATE,
                    (false, true, _, _) => Opcode::SEND_LAST,
                };
                if last {
                    pkt.imm = *imm;
                    pkt.ieth = if imm.is_none() { *invalidate } else { None };
                }
                pkt.payload = seg(data);
            }
            WorkRequest::Write {
                data,
                va,
                rkey,
                imm,
            } => {
                pkt.bth.opcode = match (first, last, imm.is_some()) {
                    (true, true, true) => Opcode::RDMA_WRITE_ONLY_WITH_IMMEDIATE,
                    (true, true, false) => Opcode::RDMA_WRITE_ONLY,
                    (true, false, _) => Opcode::RDMA_WRITE_FIRST,
                    (false, false, _) => Opcode::RDMA_WRITE_MIDDLE,
                    (false, true, true) => Opcode::RDMA_WRITE_LAST_WITH_IMMEDIATE,
                    (false, true, false) => Opcode::RDMA_WRITE_LAST,
                };
                if first {
                    pkt.reth = Some(Reth {
                        va: *va,
                        rkey: *rkey,
                        dma_len: data.len() as u32,
                    });
                }
                if last {
                    pkt.imm = *imm;
                }
                pkt.payload = seg(data);
            }
            WorkRequest::Read { va, rkey, len } => {
                // A READ is requested in chunks of at most `max_unacked` response
                // packets on a fixed grid from its first PSN, each chunk a READ
                // request of its own (rocev2-reference §6), so the responses of
                // one request never outrun the window the receiver can take. A
                // retried read resumes after the responses already received, up
                // to the end of its chunk: VA advanced, length reduced (§7, rxe
                // req_retry), so the responder recognises it as a duplicate.
                let c = self.cfg.max_unacked.max(1);
                let end = ((idx / c + 1) * c).min(wqe.npkts);
                let done = idx as u64 * pmtu as u64;
                let left = u64::from(*len) - done.min(u64::from(*len));
                pkt.bth.opcode = Opcode::RDMA_READ_REQUEST;
                pkt.reth = Some(Reth {
                    va: va + done,
                    rkey: *rkey,
                    dma_len: left.min(u64::from(end - idx) * pmtu as u64) as u32,
                });
                advance = end - idx;
            }
            WorkRequest::Atomic { va, rkey, op } => {
                let (opcode, swap_add, compare) = match *op {
                    Atomic::CompareSwap { compare, swap } => (Opcode::COMPARE_SWAP, swap, compare),
                    Atomic::FetchAdd { add } => (Opcode::FETCH_ADD, add, 0),
                };
                pkt.bth.opcode = opcode;
                pkt.atomic_eth = Some(AtomicEth {
                    va: *va,
                    rkey: *rkey,
                    swap_add,
                    compare,
                });
            }
        }
        pkt.finish();
        (pkt, advance)
    }

    /// Recover from a loss at `psn`: selective repeat resends just that packet
    /// of a SEND/WRITE (the responder kept what followed); go-back-N, and any
    /// READ/atomic, resend from there.
    fn recover(&mut self, psn: u32) {
        if self.cfg.selective_repeat && self.ask_missing_responses(psn, u32::MAX) {
            return;
        }
        if self.cfg.selective_repeat {
            let single = self.sq.iter().any(|w| {
                w.done.is_none()
                    && matches!(w.wr, WorkRequest::Send { .. } | WorkRequest::Write { .. })
                    && psn::diff(psn, w.first_psn) >= 0
                    && psn::diff(psn, w.last_psn()) <= 0
            });
            if single {
                if !self.retx.contains(&psn) {
                    self.retx.push_back(psn);
                }
                return;
            }
        }
        self.rewind(psn);
    }

    /// Go back to `psn` and resend everything from there (rocev2-reference §7).
    fn rewind(&mut self, psn: u32) {
        self.stats.rewinds += 1;
        let Some(i) = self.sq.iter().position(|w| {
            w.done.is_none()
                && psn::diff(psn, w.first_psn) >= 0
                && psn::diff(psn, w.last_psn()) <= 0
        }) else {
            // Nothing outstanding at that PSN: resume after the last done WQE.
            self.tx_wqe = self
                .sq
                .iter()
                .position(|w| w.done.is_none())
                .unwrap_or(self.sq.len());
            self.tx_pkt = 0;
            return;
        };
        let w = &mut self.sq[i];
        self.tx_wqe = i;
        self.tx_pkt = match w.wr {
            // A read resumes at its first missing response.
            WorkRequest::Read { .. } => {
                w.round_start = w.read_next;
                psn::diff(w.read_next, w.first_psn) as u32
            }
            WorkRequest::Atomic { .. } => 0,
            _ => psn::diff(psn, w.first_psn) as u32,
        };
    }

    // -------------------------------------------------------------- receive

    /// Process one received packet addressed to this QP. `ce` is true when its
    /// IP header carried ECN Congestion Experienced.
    pub fn handle_packet(&mut self, now: u64, pkt: &Packet, ce: bool, mem: &mut dyn Memory) {
        if pkt.bth.dest_qp != self.local_qpn {
            self.stats.dropped += 1;
            return;
        }
        match self.state {
            QpState::Rtr | QpState::Rts => {}
            _ => return,
        }
        if pkt.bth.opcode == Opcode::CNP {
            // Reaction point: cut the rate (rocev2-reference §10, §11).
            self.stats.cnps_received += 1;
            if let Some(rp) = self.rp.as_mut() {
                rp.on_cnp(now);
            }
            return;
        }
        if ce {
            self.stats.ce_received += 1;
            self.notify_congestion(now);
        }
        if pkt.bth.opcode.is_request() {
            self.responder(pkt, mem);
        } else if self.state == QpState::Rts {
            self.completer(now, pkt);
        }
    }

    /// Notification point: answer CE marks with a CNP to the sender, at most one
    /// per `cnp_interval_ns` (rocev2-reference §10, §11: N = 50 µs).
    fn notify_congestion(&mut self, now: u64) {
        let interval = self.cfg.dcqcn.unwrap_or_default().cnp_interval_ns;
        if self.last_cnp_sent.is_some_and(|t| now < t + interval) {
            return;
        }
        self.last_cnp_sent = Some(now);
        self.stats.cnps_sent += 1;
        let mut bth = Bth::new(Opcode::CNP, self.remote_qpn, 0);
        bth.becn = true;
        let mut cnp = Packet::new(bth);
        cnp.cnp_reserved = Some([0; 16]);
        self.resp_tx.push_back(cnp);
    }

    /// Handle expired timers.
    pub fn handle_timeout(&mut self, now: u64) {
        if self.rnr_until.is_some_and(|t| now >= t) {
            self.rnr_until = None;
        }
        let Some(deadline) = self.retry_deadline else {
            return;
        };
        if now < deadline || self.state != QpState::Rts {
            return;
        }
        if self.sq.iter().all(|w| w.done.is_some()) {
            self.retry_deadline = None;
            return;
        }
        self.stats.timeouts += 1;
        // A timer of the full ACK timeout is a retry (IBTA 9.7.6.1.4); a
        // shorter fast timer (set_fast_timeout) is not.
        let full = self.rto_ns() == self.full_rto_ns();
        if full {
            if self.retry_left == 0 {
                self.fail_front(WcStatus::RetryExceeded);
                return;
            }
            self.retry_left -= 1;
        }
        self.cc_loss(true);
        self.recover(self.una);
        self.backoff += 1;
        self.retry_deadline = self.rto_ns().map(|t| now + t);
    }

    // ------------------------------------------------------------ completer

    fn progress(&mut self, now: u64) {
        self.retry_left = self.cfg.retry_cnt;
        self.rnr_left = self.cfg.rnr_retry;
        self.backoff = 0;
        self.cc_acked();
        let outstanding = self.sq.iter().any(|w| w.done.is_none());
        self.retry_deadline = outstanding
            .then(|| self.rto_ns().map(|t| now + t))
            .flatten();
        self.deliver_done();
    }

    /// Move finished WQEs at the head of the send queue to the completion queue.
    fn deliver_done(&mut self) {
        while self.sq.front().is_some_and(|w| w.done.is_some()) {
            let w = self.sq.pop_front().expect("front");
            if self.tx_wqe > 0 {
                self.tx_wqe -= 1;
            } else {
                // We were (re)transmitting the WQE a late ACK just completed:
                // the next one starts at its first packet.
                self.tx_pkt = 0;
            }
            let (status, orig) = w.done.expect("done");
            let mut c = Completion::new(w.wr_id, status, w.opcode());
            c.atomic_orig = orig;
            c.byte_len = match &w.wr {
                WorkRequest::Send { data, .. } | WorkRequest::Write { data, .. } => {
                    data.len() as u64
                }
                WorkRequest::Read { len, .. } => u64::from(*len),
                WorkRequest::Atomic { .. } => 8,
            };
            if matches!(w.wr, WorkRequest::Read { .. }) {
                c.data = (self.read_buffers.freeze)(w.read_buf, w.read_len);
            }
            self.completions.push_back(c);
        }
    }

    /// Everything up to and including `psn` is acknowledged. Returns false if a
    /// READ/atomic in that range has no response yet (its response was lost).
    fn implicit_ack(&mut self, psn: u32) -> bool {
        if psn::diff(psn, self.una) < 0 {
            return true; // stale
        }
        for w in self.sq.iter_mut() {
            if w.done.is_some() {
                continue;
            }
            if psn::diff(psn, w.first_psn) < 0 {
                break;
            }
            if w.needs_response() {
                return false;
            }
            if psn::diff(psn, w.last_psn()) >= 0 {
                w.done = Some((WcStatus::Success, None));
                self.una = psn::add(w.last_psn(), 1);
            } else {
                self.una = psn::add(psn, 1);
                break;
            }
        }
        true
    }

    /// A NAK at `p` acknowledges everything before `p`. Returns true if that
    /// was progress (and resets the retry state accordingly).
    fn nak_acks(&mut self, now: u64, p: u32) -> bool {
        let before = self.una;
        self.implicit_ack(psn::add(p, psn::PSN_MASK));
        if self.una != before {
            self.progress(now);
            true
        } else {
            false
        }
    }

    fn completer(&mut self, now: u64, pkt: &Packet) {
        let p = pkt.bth.psn;
        let op = pkt.bth.opcode;
        match op {
            Opcode::ACKNOWLEDGE => {
                let Some(aeth) = pkt.aeth else { return };
                match aeth.kind() {
                    Syndrome::Ack { .. } => {
                        let before = self.una;
                        // An ACK beyond a READ/atomic still waiting for its response
                        // stops at it: over UDP the response may just be late
                        // (reordered); gap detection and the timer recover real loss.
                        self.implicit_ack(p);
                        if self.una != before {
                            self.progress(now);
                        }
                    }
                    Syndrome::RnrNak { timer } => {
                        self.stats.rnr_naks_received += 1;
                        self.nak_acks(now, p);
                        if self.rnr_left == 0 {
                            self.fail_front(WcStatus::RnrRetryExceeded);
                            return;
                        }
                        if self.cfg.rnr_retry != 7 {
                            self.rnr_left -= 1;
                        }
                        self.rnr_until = Some(now + u64::from(rnr_delay_us(timer)) * 1000);
                        self.rewind(p);
                        self.deliver_done();
                    }
                    Syndrome::Nak(NakCode::PsnSequenceError) => {
                        self.stats.naks_received += 1;
                        // A NAK that acknowledges new packets is progress. A NAK
                        // beyond a READ/atomic still in progress moves nothing but
                        // says nothing about the oldest request either. Only a NAK
                        // at our oldest unacknowledged PSN uses up a retry.
                        // Selective repeat: the responder repeats its NAK while a
                        // gap lasts (a resend may be in flight), so NAKs are not
                        // retries; the timer still bounds a dead peer.
                        if !self.nak_acks(now, p) && p == self.una && !self.cfg.selective_repeat {
                            if self.retry_left == 0 {
                                self.fail_front(WcStatus::RetryExceeded);
                                return;
                            }
                            self.retry_left -= 1;
                        }
                        self.cc_loss(false);
                        self.recover(p);
                    }
                    Syndrome::Nak(NakCode::Other(SR_HOLE)) if self.cfg.selective_repeat => {
                        // A hole the responder names: resend just that packet.
                        self.stats.naks_received += 1;
                        if psn::diff(p, self.una) > 0 {
                            self.recover(p);
                        }
                    }
                    Syndrome::Nak(code) => {
                        self.stats.naks_received += 1;
                        self.nak_acks(now, p);
                        let status = match code {
                            NakCode::InvalidRequest => WcStatus::RemoteInvalidRequest,
                            NakCode::RemoteAccessError => WcStatus::RemoteAccessError,
                            _ => WcStatus::RemoteOperationalError,
                        };
                        self.fail_front(status);
                    }
                    Syndrome::Reserved(_) => self.stats.dropped += 1,
                }
            }
            Opcode::ATOMIC_ACKNOWLEDGE => {
                if !self.implicit_ack(psn::add(p, psn::PSN_MASK)) {
                    // An earlier READ/atomic is still waiting; this answer is early
                    // (reordered). Drop it: the responder replays it on retry.
                    self.stats.dropped += 1;
                    return;
                }
                let Some(w) = self.sq.iter_mut().find(|w| w.done.is_none()) else {
                    self.stats.dropped += 1;
                    return;
                };
                if !matches!(w.wr, WorkRequest::Atomic { .. }) || w.first_psn != p {
                    self.stats.dropped += 1;
                    return;
                }
                w.done = Some((WcStatus::Success, pkt.atomic_ack));
                self.una = psn::add(p, 1);
                self.progress(now);
            }
            Opcode::RDMA_READ_RESPONSE_FIRST
            | Opcode::RDMA_READ_RESPONSE_MIDDLE
            | Opcode::RDMA_READ_RESPONSE_LAST
            | Opcode::RDMA_READ_RESPONSE_ONLY => self.read_response(now, pkt),
            _ => self.stats.dropped += 1,
        }
    }

    fn read_response(&mut self, now: u64, pkt: &Packet) {
        let p = pkt.bth.psn;
        let op = pkt.bth.opcode;
        let pmtu = self.cfg.pmtu as usize;
        // Responses implicitly acknowledge everything before the read.
        let front_read = self.sq.iter().position(|w| w.done.is_none());
        if let Some(i) = front_read {
            if !self.sq[i].needs_response() && !self.implicit_ack(psn::add(p, psn::PSN_MASK)) {
                self.stats.dropped += 1;
                return;
            }
        }
        let Some(w) = self.sq.iter_mut().find(|w| w.done.is_none()) else {
            self.stats.dropped += 1;
            return;
        };
        let WorkRequest::Read { len, .. } = w.wr else {
            self.stats.dropped += 1;
            return;
        };
        if self.cfg.selective_repeat {
            return self.read_response_sr(now, pkt, len);
        }
        if p != w.read_next || psn::diff(p, w.first_psn) < 0 || psn::diff(p, w.last_psn()) > 0 {
            // Out of place: a gap (loss or reordering) or a late copy from an
            // earlier round of this read. A response well beyond the one
            // expected (3 PSNs: reordering tolerance, as TCP's duplicate ACKs)
            // means a loss: ask again from the first missing response at once
            // (IBTA 9.7.5.1.5; rxe does the same on an out-of-sequence
            // response). Replayed responses reuse their PSNs, so a late copy
            // looks the same: ask at most once until the read progresses again;
            // the local ACK timeout covers the rest (rocev2-reference §7).
            self.stats.dropped += 1;
            let ahead = psn::diff(p, w.read_next) >= 3 && psn::diff(p, w.last_psn()) <= 0;
            if ahead && !w.gap_asked {
                w.gap_asked = true;
                let at = w.read_next;
                self.rewind(at);
            }
            return;
        }
        let idx = psn::diff(p, w.first_psn) as u32;
        let is_last = idx + 1 == w.npkts;
        // Opcodes count from the request that is answering: each chunk, and a
        // resumed read, start again with FIRST or ONLY.
        let c = self.cfg.max_unacked.max(1);
        let starts = p == w.round_start || idx % c == 0;
        let ends = is_last || (idx + 1) % c == 0;
        let expected = match (starts, ends) {
            (true, true) => Opcode::RDMA_READ_RESPONSE_ONLY,
            (true, false) => Opcode::RDMA_READ_RESPONSE_FIRST,
            (false, false) => Opcode::RDMA_READ_RESPONSE_MIDDLE,
            (false, true) => Opcode::RDMA_READ_RESPONSE_LAST,
        };
        let want_len = if is_last {
            len as usize - idx as usize * pmtu
        } else {
            pmtu
        };
        // A resumed read: IBTA has the replay start again with FIRST (as
        // rdmx and NICs do), but Linux rxe continues the original response's
        // sequence (MIDDLE … LAST, rxe_resp.c replaying its read resource).
        // Both carry the same bytes at the same PSNs: take either.
        let continued = match ends {
            false => Opcode::RDMA_READ_RESPONSE_MIDDLE,
            true => Opcode::RDMA_READ_RESPONSE_LAST,
        };
        let resumed = p == w.round_start && p != w.first_psn && idx % c != 0;
        let op_ok = op == expected || (resumed && op == continued);
        if !op_ok || pkt.payload.len() != want_len {
            self.stats.dropped += 1;
            return;
        }
        if w.read_buf.len() < len as usize {
            w.read_buf = (self.read_buffers.take)(len as usize);
        }
        let at = w.read_len;
        w.read_buf[at..at + pkt.payload.len()].copy_from_slice(&pkt.payload);
        w.read_len += pkt.payload.len();
        w.read_next = psn::add(p, 1);
        w.gap_asked = false;
        // Responses acknowledge their own PSNs (IBTA 9.7.5.1.3): the window moves.
        self.una = w.read_next;
        if is_last {
            w.done = Some((WcStatus::Success, None));
            self.una = psn::add(p, 1);
        }
        self.progress(now);
    }

    /// Selective repeat: take a READ response wherever it falls in the front
    /// READ, and ask again for just the holes below the highest one received.
    fn read_response_sr(&mut self, now: u64, pkt: &Packet, len: u32) {
        let p = pkt.bth.psn;
        let pmtu = self.cfg.pmtu as usize;
        let Some(i) = self.sq.iter().position(|w| w.done.is_none()) else {
            return;
        };
        let w = &mut self.sq[i];
        let d = psn::diff(p, w.first_psn);
        if d < 0 || d >= w.npkts as i32 {
            self.stats.dropped += 1;
            return;
        }
        let idx = d as u32;
        let is_last = idx + 1 == w.npkts;
        let want_len = if is_last {
            len as usize - idx as usize * pmtu
        } else {
            pmtu
        };
        let is_response = matches!(
            pkt.bth.opcode,
            Opcode::RDMA_READ_RESPONSE_FIRST
                | Opcode::RDMA_READ_RESPONSE_MIDDLE
                | Opcode::RDMA_READ_RESPONSE_LAST
                | Opcode::RDMA_READ_RESPONSE_ONLY
        );
        if !is_response || pkt.payload.len() != want_len {
            self.stats.dropped += 1;
            return;
        }
        if w.read_got.is_empty() {
            w.read_got = vec![false; w.npkts as usize];
        }
        if w.read_got[idx as usize] {
            self.stats.duplicates += 1;
            return;
        }
        if w.read_buf.len() < len as usize {
            w.read_buf = (self.read_buffers.take)(len as usize);
        }
        let at = idx as usize * pmtu;
        w.read_buf[at..at + want_len].copy_from_slice(&pkt.payload);
        w.read_len += want_len;
        w.read_got[idx as usize] = true;
        w.read_count += 1;
        w.read_hi = w.read_hi.max(idx + 1);
        let mut n = psn::diff(w.read_next, w.first_psn) as u32;
        let before = n;
        while n < w.npkts && w.read_got[n as usize] {
            n += 1;
        }
        w.read_next = psn::add(w.first_psn, n);
        if n >= w.asked_upto {
            w.gap_asked = false;
        }
        let holes = w.read_hi > n && !w.gap_asked;
        let hi = w.read_hi;
        if w.read_count == w.npkts {
            w.done = Some((WcStatus::Success, None));
            self.una = psn::add(w.last_psn(), 1);
        } else {
            self.una = w.read_next;
            if holes {
                let first = w.first_psn;
                self.ask_missing_responses(first, hi);
            }
        }
        if n != before || self.sq[i].done.is_some() {
            self.progress(now);
        }
    }

    /// Selective repeat: queue READ requests for the missing responses of the
    /// front READ (if `psn` falls in it) below packet index `upto`, one per
    /// missing run, each inside its original chunk; a chunk with nothing
    /// received is asked for whole (its request itself may have been lost).
    /// Returns false if the front WQE is not such a READ.
    fn ask_missing_responses(&mut self, psn: u32, upto: u32) -> bool {
        let c = self.cfg.max_unacked.max(1);
        let Some(w) = self.sq.iter_mut().find(|w| w.done.is_none()) else {
            return false;
        };
        if !matches!(w.wr, WorkRequest::Read { .. })
            || psn::diff(psn, w.first_psn) < 0
            || psn::diff(psn, w.last_psn()) > 0
        {
            return false;
        }
        if w.read_got.is_empty() {
            w.read_got = vec![false; w.npkts as usize];
        }
        let end = upto.min(w.sent_upto).min(w.npkts);
        let mut idx = psn::diff(w.read_next, w.first_psn).max(0) as u32;
        let mut runs = Vec::new();
        while idx < end {
            if w.read_got[idx as usize] {
                idx += 1;
                continue;
            }
            let chunk_start = idx / c * c;
            let chunk_end = (chunk_start + c).min(w.npkts);
            let untouched = !w.read_got[chunk_start as usize..chunk_end as usize]
                .iter()
                .any(|&g| g);
            let (s, e) = if untouched {
                (chunk_start, chunk_end)
            } else {
                let mut e = idx;
                while e < chunk_end.min(end) && !w.read_got[e as usize] {
                    e += 1;
                }
                (idx, e)
            };
            runs.push((w.first_psn, s, e));
            idx = e.max(idx + 1);
            if runs.len() == 32 {
                break;
            }
        }
        w.gap_asked = true;
        w.asked_upto = end;
        for r in runs {
            if !self.read_retx.contains(&r) {
                self.read_retx.push_back(r);
            }
        }
        true
    }

    /// Complete the oldest outstanding WQE with `status`, then go to ERROR.
    fn fail_front(&mut self, status: WcStatus) {
        if let Some(w) = self.sq.iter_mut().find(|w| w.done.is_none()) {
            w.done = Some((status, None));
        }
        self.deliver_done();
        self.enter_error();
    }

    /// Move to ERROR: flush every outstanding work request (rocev2-reference §7).
    pub fn enter_error(&mut self) {
        if self.state == QpState::Error {
            return;
        }
        self.state = QpState::Error;
        for w in self.sq.iter_mut() {
            if w.done.is_none() {
                w.done = Some((WcStatus::Flushed, None));
            }
        }
        self.deliver_done();
        if let Some(OpenMessage::Send { wqe, .. }) = self.open.take() {
            self.completions.push_back(Completion::new(
                wqe.wr_id,
                WcStatus::Flushed,
                WcOpcode::Recv,
            ));
        }
        while let Some(r) = self.rq.pop_front() {
            self.completions
                .push_back(Completion::new(r.wr_id, WcStatus::Flushed, WcOpcode::Recv));
        }
        self.retry_deadline = None;
        self.rnr_until = None;
        self.pending_ack = None;
        self.retx.clear();
        self.read_retx.clear();
        self.ooo.clear();
    }

    // ------------------------------------------------------------ responder

    fn send_nak(&mut self, code: NakCode, fatal: bool) {
        self.stats.naks_sent += 1;
        if matches!(code, NakCode::RemoteAccessError | NakCode::InvalidRequest) {
            self.stats.remote_denied += 1;
        }
        let nak = self.ack_packet(self.epsn, nak_syndrome(code));
        self.resp_tx.push_back(nak);
        if fatal {
            // Class C errors (rocev2-reference §5): the responder QP goes to
            // ERROR; queued responses, this NAK included, still go out.
            self.enter_error();
        }
    }

    /// No receive posted: RNR NAK with our timer code; the PSN is not consumed,
    /// the requester retries it after the delay (rocev2-reference §5).
    fn send_rnr_nak(&mut self, psn: u32) {
        self.stats.rnr_naks_sent += 1;
        let rnr = self.ack_packet(psn, 0x20 | (self.cfg.min_rnr_timer & 0x1F));
        self.resp_tx.push_back(rnr);
    }

    fn responder(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        let d = psn::diff(pkt.bth.psn, self.epsn);
        if d > 0 {
            // A gap: NAK once until the expected packet arrives (§5, §6). With
            // selective repeat the packet is kept (within the requester's
            // window) and executed in order once the gap fills.
            if self.cfg.selective_repeat && d < 2 * self.cfg.max_unacked.max(1) as i32 {
                if self.ooo.insert(pkt.bth.psn, pkt.clone()).is_none() {
                    self.stats.out_of_order_kept += 1;
                }
                // The gap persists while packets keep coming: say so again
                // every 16 of them, in case the NAK or the resent packet was
                // lost (TCP's duplicate ACKs do the same), instead of leaving
                // it to the requester's timeout.
                self.since_nak += 1;
                if self.nak_sent && self.since_nak >= (self.cfg.max_unacked / 4).max(16) {
                    // Repeat only the first hole; the others were named.
                    self.since_nak = 0;
                    self.send_nak(NakCode::PsnSequenceError, false);
                }
            } else {
                self.stats.dropped += 1;
            }
            if !self.nak_sent {
                self.nak_sent = true;
                self.since_nak = 0;
                self.nak_gaps(32);
            }
            return;
        }
        if d < 0 {
            self.stats.duplicates += 1;
            self.duplicate(pkt, mem);
            return;
        }
        self.nak_sent = false;
        self.execute(pkt, mem);
        if self.ooo.is_empty() {
            return;
        }
        // Selective repeat: run what was kept, in order, up to the next gap.
        let mut ran = false;
        while self.state != QpState::Error {
            let Some(next) = self.ooo.remove(&self.epsn) else {
                break;
            };
            self.execute(&next, mem);
            ran = true;
        }
        // Drop anything the executed requests overtook (a READ covers many PSNs).
        let epsn = self.epsn;
        self.ooo.retain(|&p, _| psn::diff(p, epsn) > 0);
        if ran {
            self.pending_ack = Some(psn::add(self.epsn, psn::PSN_MASK));
        }
        if !self.ooo.is_empty() && self.state != QpState::Error {
            // Another gap: say where at once, and name the next few holes
            // again in case their resends were lost.
            self.nak_sent = true;
            self.since_nak = 0;
            self.nak_gaps(4);
        }
    }

    /// NAK the first missing PSN (standard sequence-error NAK, which also
    /// acknowledges everything before it). With selective repeat, also name
    /// further missing PSNs (up to `max_holes`) below the highest one kept, with the rdmx
    /// selective NAK (syndrome 0x60 | SR_HOLE, a code IBTA reserves; only
    /// sent to peers that negotiated selective repeat), so one round trip
    /// repairs every hole, as IRN's NACKs do.
    fn nak_gaps(&mut self, max_holes: usize) {
        self.send_nak(NakCode::PsnSequenceError, false);
        if !self.cfg.selective_repeat {
            return;
        }
        let epsn = self.epsn;
        let pmtu = u64::from(self.cfg.pmtu);
        // Kept packets in PSN order, each with the PSNs it occupies (a READ
        // request one per response packet).
        let mut kept: Vec<(i32, u32)> = self
            .ooo
            .values()
            .map(|p| {
                let span = match (p.bth.opcode, p.reth) {
                    (Opcode::RDMA_READ_REQUEST, Some(r)) => {
                        u64::from(r.dma_len).div_ceil(pmtu).max(1) as u32
                    }
                    _ => 1,
                };
                (psn::diff(p.bth.psn, epsn), span)
            })
            .collect();
        kept.sort_unstable();
        let mut next = 1i32; // epsn itself was NAKed above
        let mut holes = Vec::new();
        for (d, span) in kept {
            while next < d && holes.len() < max_holes {
                holes.push(psn::add(epsn, next as u32));
                next += 1;
            }
            next = next.max(d + span as i32);
        }
        for p in holes {
            self.stats.naks_sent += 1;
            let hole = self.ack_packet(p, 0x60 | SR_HOLE);
            self.resp_tx.push_back(hole);
        }
    }

    /// Execute the request at ePSN.
    fn execute(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        let op = pkt.bth.opcode;
        match op {
            Opcode::SEND_FIRST
            | Opcode::SEND_MIDDLE
            | Opcode::SEND_LAST
            | Opcode::SEND_LAST_WITH_IMMEDIATE
            | Opcode::SEND_LAST_WITH_INVALIDATE
            | Opcode::SEND_ONLY
            | Opcode::SEND_ONLY_WITH_IMMEDIATE
            | Opcode::SEND_ONLY_WITH_INVALIDATE => self.recv_send(pkt),
            Opcode::RDMA_WRITE_FIRST
            | Opcode::RDMA_WRITE_MIDDLE
            | Opcode::RDMA_WRITE_LAST
            | Opcode::RDMA_WRITE_LAST_WITH_IMMEDIATE
            | Opcode::RDMA_WRITE_ONLY
            | Opcode::RDMA_WRITE_ONLY_WITH_IMMEDIATE => self.recv_write(pkt, mem),
            Opcode::RDMA_READ_REQUEST => self.recv_read(pkt, mem),
            Opcode::COMPARE_SWAP | Opcode::FETCH_ADD => self.recv_atomic(pkt, mem),
            _ => self.stats.dropped += 1,
        }
    }

    /// After executing a SEND/WRITE packet: advance ePSN and ACK if asked (coalesced).
    fn accepted(&mut self, pkt: &Packet, message_done: bool) {
        self.epsn = psn::add(self.epsn, 1);
        if message_done {
            self.msn = psn::add(self.msn, 1);
        }
        if pkt.bth.ack_req {
            self.pending_ack = Some(pkt.bth.psn);
        }
    }

    fn recv_send(&mut self, pkt: &Packet) {
        let op = pkt.bth.opcode;
        let starts = matches!(
            op,
            Opcode::SEND_FIRST
                | Opcode::SEND_ONLY
                | Opcode::SEND_ONLY_WITH_IMMEDIATE
                | Opcode::SEND_ONLY_WITH_INVALIDATE
        );
        let ends = !matches!(op, Opcode::SEND_FIRST | Opcode::SEND_MIDDLE);
        // Opcode sequence (rocev2-reference §3).
        match (&self.open, starts) {
            (None, true) | (Some(OpenMessage::Send { .. }), false) => {}
            _ => return self.send_nak(NakCode::InvalidRequest, true),
        }
        if !self.length_ok(op, pkt.payload.len()) {
            return self.send_nak(NakCode::InvalidRequest, true);
        }
        if starts {
            let Some(wqe) = self.rq.pop_front() else {
                return self.send_rnr_nak(pkt.bth.psn);
            };
            self.open = Some(OpenMessage::Send {
                wqe,
                buf: BytesMut::new(),
            });
        }
        let Some(OpenMessage::Send { wqe, buf }) = &mut self.open else {
            unreachable!("checked above")
        };
        buf.extend_from_slice(&pkt.payload);
        if buf.len() > wqe.max_len {
            let wr_id = wqe.wr_id;
            self.open = None;
            self.completions.push_back(Completion::new(
                wr_id,
                WcStatus::LocalLengthError,
                WcOpcode::Recv,
            ));
            return self.send_nak(NakCode::InvalidRequest, true);
        }
        if ends {
            let Some(OpenMessage::Send { wqe, buf }) = self.open.take() else {
                unreachable!("checked above")
            };
            let mut c = Completion::new(wqe.wr_id, WcStatus::Success, WcOpcode::Recv);
            c.byte_len = buf.len() as u64;
            c.data = buf.freeze();
            c.imm = pkt.imm;
            c.invalidate = pkt.ieth;
            self.completions.push_back(c);
        }
        self.accepted(pkt, ends);
    }

    /// FIRST/MIDDLE carry exactly one PMTU, LAST 1..PMTU, ONLY 0..PMTU (§8).
    fn length_ok(&self, op: Opcode, len: usize) -> bool {
        let pmtu = self.cfg.pmtu as usize;
        match op {
            Opcode::SEND_FIRST
            | Opcode::SEND_MIDDLE
            | Opcode::RDMA_WRITE_FIRST
            | Opcode::RDMA_WRITE_MIDDLE => len == pmtu,
            Opcode::SEND_ONLY
            | Opcode::SEND_ONLY_WITH_IMMEDIATE
            | Opcode::SEND_ONLY_WITH_INVALIDATE
            | Opcode::RDMA_WRITE_ONLY
            | Opcode::RDMA_WRITE_ONLY_WITH_IMMEDIATE => len <= pmtu,
            _ => (1..=pmtu).contains(&len),
        }
    }

    fn recv_write(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        let op = pkt.bth.opcode;
        let starts = matches!(
            op,
            Opcode::RDMA_WRITE_FIRST
                | Opcode::RDMA_WRITE_ONLY
                | Opcode::RDMA_WRITE_ONLY_WITH_IMMEDIATE
        );
        let ends = !matches!(op, Opcode::RDMA_WRITE_FIRST | Opcode::RDMA_WRITE_MIDDLE);
        let with_imm = matches!(
            op,
            Opcode::RDMA_WRITE_LAST_WITH_IMMEDIATE | Opcode::RDMA_WRITE_ONLY_WITH_IMMEDIATE
        );
        match (&self.open, starts) {
            (None, true) | (Some(OpenMessage::Write { .. }), false) => {}
            _ => return self.send_nak(NakCode::InvalidRequest, true),
        }
        if !self.length_ok(op, pkt.payload.len()) {
            return self.send_nak(NakCode::InvalidRequest, true);
        }
        // A write with immediate needs a receive; check before touching memory.
        if with_imm && self.rq.is_empty() {
            return self.send_rnr_nak(pkt.bth.psn);
        }
        if starts {
            let Some(reth) = pkt.reth else {
                return self.send_nak(NakCode::InvalidRequest, true);
            };
            // The whole range is checked at the first packet (R_Key, bounds, rights).
            if reth.dma_len > 0 {
                if let Err(e) = mem.check(reth.rkey, reth.va, u64::from(reth.dma_len), Need::Write)
                {
                    return self.send_nak(mem_nak(e), true);
                }
            }
            self.open = Some(OpenMessage::Write { reth, offset: 0 });
        }
        let Some(OpenMessage::Write { reth, offset }) = &mut self.open else {
            unreachable!("checked above")
        };
        let (reth, off) = (*reth, *offset);
        let end = off + pkt.payload.len() as u64;
        if end > u64::from(reth.dma_len) || (ends && end != u64::from(reth.dma_len)) {
            self.open = None;
            return self.send_nak(NakCode::InvalidRequest, true);
        }
        if !pkt.payload.is_empty() {
            if let Err(e) = mem.write(reth.rkey, reth.va + off, &pkt.payload) {
                self.open = None;
                return self.send_nak(mem_nak(e), true);
            }
        }
        if let Some(OpenMessage::Write { offset, .. }) = &mut self.open {
            *offset = end;
        }
        if ends {
            self.open = None;
            self.stats.remote_ops += 1;
            if with_imm {
                let r = self.rq.pop_front().expect("checked above");
                let mut c = Completion::new(r.wr_id, WcStatus::Success, WcOpcode::RecvWriteImm);
                c.byte_len = u64::from(reth.dma_len);
                c.imm = pkt.imm;
                self.completions.push_back(c);
            }
        }
        self.accepted(pkt, ends);
    }

    fn remember(&mut self, r: Resource) {
        self.resources.push_back(r);
        while self.resources.len() > self.cfg.max_rd_atomic.max(1) as usize * 2 {
            self.resources.pop_front();
        }
    }

    /// Queue the responses to a READ of `reth` whose request had PSN `first`:
    /// FIRST/MIDDLE/LAST or ONLY (rocev2-reference §3, §8), data re-read from
    /// memory each time (a duplicate READ is re-executed, §6).
    fn read_responses(
        &mut self,
        first: u32,
        reth: Reth,
        mem: &mut dyn Memory,
    ) -> Result<(), MemError> {
        let pmtu = u64::from(self.cfg.pmtu);
        let len = u64::from(reth.dma_len);
        let npkts = len.div_ceil(pmtu).max(1) as u32;
        for i in 0..npkts {
            let off = u64::from(i) * pmtu;
            let n = pmtu.min(len - off.min(len));
            let data = if n == 0 {
                Bytes::new()
            } else {
                mem.read(reth.rkey, reth.va + off, n)?
            };
            let opcode = match (i == 0, i + 1 == npkts) {
                (true, true) => Opcode::RDMA_READ_RESPONSE_ONLY,
                (true, false) => Opcode::RDMA_READ_RESPONSE_FIRST,
                (false, false) => Opcode::RDMA_READ_RESPONSE_MIDDLE,
                (false, true) => Opcode::RDMA_READ_RESPONSE_LAST,
            };
            let mut p = Packet::new(Bth::new(opcode, self.remote_qpn, psn::add(first, i)));
            if opcode != Opcode::RDMA_READ_RESPONSE_MIDDLE {
                p.aeth = Some(Aeth {
                    syndrome: 0x1F,
                    msn: self.msn & psn::PSN_MASK,
                });
            }
            p.payload = data;
            p.finish();
            self.resp_tx.push_back(p);
        }
        Ok(())
    }

    fn recv_read(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        if self.open.is_some() {
            return self.send_nak(NakCode::InvalidRequest, true);
        }
        let Some(reth) = pkt.reth else {
            return self.send_nak(NakCode::InvalidRequest, true);
        };
        if reth.dma_len > 0 {
            if let Err(e) = mem.check(reth.rkey, reth.va, u64::from(reth.dma_len), Need::Read) {
                return self.send_nak(mem_nak(e), true);
            }
        }
        let first = self.epsn;
        let npkts = u64::from(reth.dma_len)
            .div_ceil(u64::from(self.cfg.pmtu))
            .max(1) as u32;
        self.msn = psn::add(self.msn, 1);
        if let Err(e) = self.read_responses(first, reth, mem) {
            return self.send_nak(mem_nak(e), true);
        }
        self.stats.remote_ops += 1;
        self.remember(Resource::Read {
            first_psn: first,
            npkts,
            reth,
        });
        self.epsn = psn::add(first, npkts);
    }

    fn recv_atomic(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        if self.open.is_some() {
            return self.send_nak(NakCode::InvalidRequest, true);
        }
        let Some(a) = pkt.atomic_eth else {
            return self.send_nak(NakCode::InvalidRequest, true);
        };
        let op = if pkt.bth.opcode == Opcode::COMPARE_SWAP {
            Atomic::CompareSwap {
                compare: a.compare,
                swap: a.swap_add,
            }
        } else {
            Atomic::FetchAdd { add: a.swap_add }
        };
        let orig = match mem.atomic(a.rkey, a.va, op) {
            Ok(v) => v,
            Err(e) => return self.send_nak(mem_nak(e), true),
        };
        self.msn = psn::add(self.msn, 1);
        self.stats.remote_ops += 1;
        self.atomic_ack(pkt.bth.psn, orig);
        self.remember(Resource::Atomic {
            psn: pkt.bth.psn,
            orig,
        });
        self.epsn = psn::add(self.epsn, 1);
    }

    fn atomic_ack(&mut self, psn: u32, orig: u64) {
        let mut p = Packet::new(Bth::new(Opcode::ATOMIC_ACKNOWLEDGE, self.remote_qpn, psn));
        p.aeth = Some(Aeth {
            syndrome: 0x1F,
            msn: self.msn & psn::PSN_MASK,
        });
        p.atomic_ack = Some(orig);
        self.resp_tx.push_back(p);
    }

    /// A request below ePSN (rocev2-reference §6): re-ACK SEND/WRITE, re-execute
    /// READs from the saved range, replay saved atomic results.
    fn duplicate(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        let p = pkt.bth.psn;
        match pkt.bth.opcode {
            Opcode::RDMA_READ_REQUEST => {
                let Some(reth) = pkt.reth else { return };
                // Replay only a READ we executed, asked again whole or as the
                // tail that a resuming requester still misses: same R_Key,
                // range inside the original, VA consistent with the PSN (§6).
                let pmtu = u64::from(self.cfg.pmtu);
                let sr = self.cfg.selective_repeat;
                let ok = self.resources.iter().rev().any(|r| match *r {
                    Resource::Read {
                        first_psn,
                        npkts,
                        reth: orig,
                    } => {
                        let k = psn::diff(p, first_psn);
                        k >= 0
                            && k < npkts as i32
                            && orig.rkey == reth.rkey
                            && reth.va == orig.va + k as u64 * pmtu
                            && (reth.va + u64::from(reth.dma_len)
                                == orig.va + u64::from(orig.dma_len)
                                // Selective repeat asks again for just the
                                // responses it misses: any sub-range.
                                || (sr && reth.va + u64::from(reth.dma_len)
                                    <= orig.va + u64::from(orig.dma_len)))
                    }
                    Resource::Atomic { .. } => false,
                });
                if !ok {
                    self.stats.dropped += 1;
                } else if self.read_responses(p, reth, mem).is_err() {
                    self.send_nak(NakCode::RemoteAccessError, true);
                }
            }
            Opcode::COMPARE_SWAP | Opcode::FETCH_ADD => {
                let saved = self.resources.iter().rev().find_map(|r| match *r {
                    Resource::Atomic { psn, orig } if psn == p => Some(orig),
                    _ => None,
                });
                match saved {
                    Some(orig) => self.atomic_ack(p, orig),
                    None => self.stats.dropped += 1,
                }
            }
            _ => {
                // SEND/WRITE: not re-executed; ACK everything received so far.
                self.pending_ack = Some(psn::add(self.epsn, psn::PSN_MASK));
            }
        }
    }
}
