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
//! Loss recovery is go-back-N (rocev2-reference §7), or selective repeat
//! where both ends are rdmx and agreed on it.
//!
//! This module holds the types, the state machine and the public API; the
//! work is in `requester` (requests, window, timers, congestion control),
//! `responder` (executing requests, ACK/NAK), `completer` (retiring work
//! requests into completions) and `selective` (selective repeat).

mod completer;
mod requester;
mod responder;
mod selective;

use std::collections::{HashMap, VecDeque};

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
    /// How long the ACK of a delivered message may wait for the answer the
    /// application sends back, to leave with it (0: never waits). It waits
    /// only while this end answers what it receives (see [`Qp::answering`]).
    /// IBTA lets a responder coalesce ACKs (9.7.5.1.3); this bound stays far
    /// below any requester's ACK timeout.
    pub ack_hold_ns: u64,
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
            ack_hold_ns: 0,
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
    /// Selective repeat: WRITE packets kept out of order whose payload went
    /// to memory on arrival (see `Qp::place_ahead`).
    pub placed_ahead: u64,
    /// Remote WRITEs, READs and atomics this responder executed (not duplicates).
    pub remote_ops: u64,
    /// Remote accesses this responder refused (NAK remote access / invalid request).
    pub remote_denied: u64,
    /// Selective repeat: NAKs for a packet resent less than a round trip
    /// before (its resend may still be on the way): the packet is resent
    /// again only if still missing a round trip after the last resend.
    pub naks_before_resend: u64,
    /// Selective repeat: resends seen lost by a selective NAK that a packet
    /// sent after them prompted (resent again at once).
    pub resends_lost: u64,
    /// Selective repeat: tail probes, the oldest unacknowledged and the last
    /// packet sent resent after the responder fell silent (see
    /// `Qp::recheck_write_tail`; READ re-asks count as retransmits).
    pub tail_probes: u64,
    /// ACKs that waited for the application's answer and left right behind
    /// it (see [`QpConfig::ack_hold_ns`]).
    pub acks_with_answer: u64,
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
    /// Selective repeat: one past the highest response index received.
    read_hi: u32,
    /// Selective repeat: when each response packet was last asked for again
    /// (device clock ns; 0: never).
    read_asked: Vec<u64>,
    /// Selective repeat: the last time this READ's responses arrived or it
    /// asked for some (see [`Qp::recheck_read`]).
    read_active_at: u64,
    /// Selective repeat: the last time a response of this READ arrived.
    read_heard_at: u64,
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
        self.wr.wc_opcode()
    }
}

impl WorkRequest {
    /// The opcode of this request's completion.
    fn wc_opcode(&self) -> WcOpcode {
        match self {
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

/// Selective repeat: a packet the responder keeps ahead of ePSN until the
/// gap below it fills.
#[derive(Debug)]
struct Kept {
    /// The packet, without its payload if that is in memory already.
    pkt: Packet,
    /// The payload's length if it was written to memory on arrival (see
    /// [`Qp::place_ahead`]): executed in order, the packet then only moves
    /// the message on.
    placed: Option<usize>,
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

/// When a queue pair needs [`Qp::handle_timeout`] next, by kind (device
/// nanoseconds; `None`: not for that). A driver may run the guards late:
/// they only ever fire when something was lost, and otherwise move or go
/// away before they come, so waking for each of them costs a wake-up per
/// operation for nothing; the prompt ones must come on time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Timeouts {
    /// Waits that end in sending: pacing (DCQCN), an RNR NAK's delay, and
    /// selective repeat's check that a resent packet got through.
    pub prompt: Option<u64>,
    /// Loss detection with nothing lost yet: the retransmission timer and
    /// selective repeat's tail probe.
    pub guard: Option<u64>,
    /// The release of an ACK held for the application's answer.
    pub ack_hold: Option<u64>,
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
    /// READs and atomics among `sq[..tx_wqe]` (sent whole), kept as
    /// `tx_wqe` moves so that the max_rd_atomic check before each new one
    /// does not walk every request in flight: with a hundred READs
    /// outstanding that walk was the soft device's hottest function in a
    /// cache gateway's profile.
    responses_sent: usize,
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
    /// The backed-off interval of the last timeout, kept until a packet
    /// sent once is acknowledged (Karn's rule, RFC 6298 §5.5-5.7).
    karn_rto_ns: Option<u64>,
    /// Go-back-N congestion window (packets), see [`Qp::cwnd`].
    cwnd: u32,
    /// Its slow-start threshold.
    ssthresh: u32,
    /// Packets acknowledged towards the next additive increase.
    cwnd_acked: u32,
    /// `una` when the window last grew.
    cc_una: u32,
    /// The RNR wait: nothing is sent before this instant.
    rnr_until: Option<u64>,
    /// The PSN the last RNR NAK named, until the requester makes progress
    /// past it. The responder answers the requests we had already sent
    /// behind it with a sequence NAK at this PSN: that NAK is the RNR NAK's
    /// echo, not a loss, and must not use up a retry.
    rnr_psn: Option<u32>,
    /// Selective repeat: single PSNs to resend before anything new.
    retx: VecDeque<u32>,
    /// Selective repeat: when each PSN still unacknowledged was last resent.
    /// A NAK naming it again sooner than a round trip later was sent before
    /// the resend could arrive: acting on it would send a duplicate.
    resent_at: HashMap<u32, Resend>,
    /// Selective repeat: packets named by such an early NAK (PSN, last
    /// resent at, due): resent once more when due if still unacknowledged
    /// and not resent since (the resend was lost too), so the last hole of
    /// a burst does not wait for the timer.
    retx_due: Vec<(u32, u64, u64)>,
    /// The packet timing the current round-trip sample (PSN, sent at).
    rtt_probe: Option<(u32, u64)>,
    /// Round trip (ns), queueing included: the longest recent sample (up at
    /// once, down by an eighth per sample), from clean packets (Karn's rule)
    /// and from repairs (first resend to ACK).
    srtt_ns: Option<u64>,
    /// The least recent clean round trip (ns): the path without queueing.
    min_rtt_ns: Option<u64>,
    /// Selective repeat: READ response ranges to ask for again
    /// (WQE first PSN, first and end packet index).
    read_retx: VecDeque<(u32, u32, u32)>,
    /// Selective repeat: when to look again at the front READ's missing
    /// responses or the front message's unacknowledged tail
    /// ([`Qp::recheck_read`], [`Qp::recheck_write_tail`]).
    tail_recheck_at: Option<u64>,
    /// When the responder last answered (any ACK, NAK or response), and
    /// when a request packet last left: a pause after both is a lost tail.
    answered_at: u64,
    sent_at: u64,
    /// Tail probes and READ re-asks sent since the peer last answered:
    /// each doubles the pause the next one waits for, so a dead peer is
    /// not flooded while the retransmission timer runs out.
    unanswered_probes: u32,

    // responder
    epsn: u32,
    msn: u32,
    rq: VecDeque<RecvWqe>,
    open: Option<OpenMessage>,
    /// Length of the last multi-packet SEND delivered: a new one starts
    /// with that much room (a stream of like-sized messages then copies
    /// each byte once, instead of again at every doubling of its buffer).
    last_send_len: usize,
    nak_sent: bool,
    /// Selective repeat: packets kept out of order since the last NAK.
    since_nak: u32,
    /// The responder delivered a message to a receive during the packet
    /// being handled (set by `recv_send`, taken by `handle_packet`).
    delivered: bool,
    /// When a message was last delivered to a receive.
    delivered_at: Option<u64>,
    /// This end sent a new request soon after a delivery the last time it
    /// could: it answers what it receives, so ACKs wait for the answers.
    answering: bool,
    /// A coalesced ACK waits for a request to leave with, until then.
    ack_hold_until: Option<u64>,
    /// Request packets accepted since an ACK last left: an ACK waits for the
    /// answer only while they are at most [`ACK_HOLD_MAX_PACKETS`].
    since_ack: u32,
    /// Selective repeat: packets that arrived ahead of ePSN, executed in order
    /// once the gap fills.
    ooo: std::collections::BTreeMap<u32, Kept>,
    /// The PSN just past the highest one `ooo` holds (a READ request
    /// holds its responses' PSNs); meaningful while `ooo` is not empty.
    ooo_end: u32,
    resources: VecDeque<Resource>,
    /// The newest PSN a plain ACK may name: the last SEND or WRITE packet
    /// executed. A READ's or atomic's PSNs are answered by their responses
    /// only: against rxe in the testbed, a re-ACK naming a READ's last PSN
    /// lost that READ's last response (rxe's requester took the READ as
    /// complete without it); rxe's responder keeps its `ack_psn` the same
    /// way (resp.c, IBTA 9.7.5.1.2).
    ack_psn: u32,
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
/// that negotiated selective repeat. Its AETH MSN field carries the PSN of
/// the packet whose arrival prompted it (24 bits, as a PSN): the requester
/// tells by it whether a packet sent after a resend of the hole arrived,
/// which on a path that keeps order means that resend was lost too (RFC
/// 8985's RACK, by send order).
const SR_HOLE: u8 = 0x1F;

/// Selective repeat: a packet resent and not yet acknowledged.
#[derive(Clone, Copy, Debug)]
struct Resend {
    /// When it was last resent.
    at: u64,
    /// When it was first resent.
    first: u64,
    /// The next new PSN to go when it was last resent: a packet at or past
    /// it was sent after that resend.
    next_new: u32,
}

/// An ACK waits for the application's answer ([`QpConfig::ack_hold_ns`])
/// only while it would acknowledge at most this many request packets: a
/// small message or two. Beyond that it leaves at once, so a sender with
/// a full window of large messages never waits for the answer to one.
pub const ACK_HOLD_MAX_PACKETS: u32 = 2;

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
            responses_sent: 0,
            una: 0,
            pkts_since_ackreq: 0,
            retry_left: cfg.retry_cnt,
            rnr_left: cfg.rnr_retry,
            retry_deadline: None,
            fast_timeout: 0,
            backoff: 0,
            karn_rto_ns: None,
            cwnd: cfg.max_unacked,
            ssthresh: cfg.max_unacked,
            cwnd_acked: 0,
            cc_una: 0,
            rnr_until: None,
            rnr_psn: None,
            retx: VecDeque::new(),
            resent_at: HashMap::new(),
            retx_due: Vec::new(),
            rtt_probe: None,
            srtt_ns: None,
            min_rtt_ns: None,
            read_retx: VecDeque::new(),
            tail_recheck_at: None,
            answered_at: 0,
            sent_at: 0,
            unanswered_probes: 0,
            epsn: 0,
            ack_psn: psn::PSN_MASK,
            msn: 0,
            rq: VecDeque::new(),
            open: None,
            last_send_len: 0,
            nak_sent: false,
            since_nak: 0,
            delivered: false,
            delivered_at: None,
            answering: false,
            ack_hold_until: None,
            since_ack: 0,
            ooo: std::collections::BTreeMap::new(),
            ooo_end: 0,
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
    /// the ACK timeout (or after 1.5 × the measured round trip, if longer),
    /// doubling on each timeout in a row up to the larger of the ACK timeout
    /// and 64 × the fast timer. Only timeouts once the fast timer has doubled
    /// to that full length use up a retry, so a peer is given at least
    /// `retry_cnt` × the ACK timeout it agreed to (as by a NIC with those
    /// timers) while a lost last packet is resent early. Purely local; 0
    /// turns it off.
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
    /// Unacknowledged packets this QP may have in flight (`max_unacked`,
    /// also the size of a READ request's chunk of responses), chosen once the
    /// loss recovery is known: before RTR, as the other connection
    /// attributes. The go-back-N congestion window starts there again.
    pub fn set_window(&mut self, packets: u32) -> Result<(), QpError> {
        if !matches!(self.state, QpState::Reset | QpState::Init) {
            return Err(QpError::State(self.state));
        }
        let n = packets.max(1);
        self.cfg.max_unacked = n;
        self.cwnd = n;
        self.ssthresh = n;
        Ok(())
    }
    /// How many READ/atomic requests may be outstanding on this path, set
    /// before the QP sends (`ibv_modify_qp` carries it as the initiator depth
    /// at RTS and the responder resources at RTR, IBTA vol. 1 ch. 11): the
    /// requester keeps at most `n` outstanding, and the responder keeps
    /// replay state for twice as many (IBTA 9.5, o9-21). Both ends must use
    /// a value no larger than the other's responder takes: the smaller of
    /// the two ends' limits.
    pub fn set_max_rd_atomic(&mut self, n: u32) -> Result<(), QpError> {
        if !matches!(self.state, QpState::Reset | QpState::Init | QpState::Rtr) {
            return Err(QpError::State(self.state));
        }
        self.cfg.max_rd_atomic = n.max(1);
        Ok(())
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
        self.ack_psn = psn::add(self.epsn, psn::PSN_MASK);
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
    /// In ERROR the receive is taken and completed at once, flushed.
    pub fn post_recv(&mut self, wr_id: u64, max_len: usize) -> Result<(), QpError> {
        match self.state {
            QpState::Init | QpState::Rtr | QpState::Rts => {
                self.rq.push_back(RecvWqe { wr_id, max_len });
                Ok(())
            }
            // IBTA vol. 1 C10-42: a receive posted in the Error state
            // completes with a flush error.
            QpState::Error => {
                self.completions.push_back(Completion::new(
                    wr_id,
                    WcStatus::Flushed,
                    WcOpcode::Recv,
                ));
                Ok(())
            }
            s => Err(QpError::State(s)),
        }
    }
    /// Post a send-queue work request. In ERROR the request is taken and
    /// completed at once, flushed, as by a NIC: a QP can go to ERROR on its
    /// own (a NAK, retries exhausted) between the owner's look at its state
    /// and the post.
    pub fn post_send(&mut self, wr_id: u64, wr: WorkRequest) -> Result<(), QpError> {
        // IBTA vol. 1 C10-97.2.1: send work requests posted in the Error
        // state complete with a flush error.
        if self.state == QpState::Error {
            let opcode = wr.wc_opcode();
            self.completions
                .push_back(Completion::new(wr_id, WcStatus::Flushed, opcode));
            return Ok(());
        }
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
            read_asked: Vec::new(),
            read_active_at: 0,
            read_heard_at: 0,
        });
        Ok(())
    }
    /// The next completion, in order per queue.
    pub fn poll_completion(&mut self) -> Option<Completion> {
        self.completions.pop_front()
    }
    /// When [`Qp::handle_timeout`] should be called next.
    pub fn poll_timeout(&self) -> Option<u64> {
        let t = self.timeouts();
        [t.prompt, t.guard, t.ack_hold].into_iter().flatten().min()
    }

    /// [`Qp::poll_timeout`] without a held ACK's release: a timer that
    /// runs late for that only delays an ACK the peer's timers allow for.
    pub fn poll_timeout_urgent(&self) -> Option<u64> {
        let t = self.timeouts();
        [t.prompt, t.guard].into_iter().flatten().min()
    }

    /// [`Qp::poll_timeout`] by kind, for a driver that would rather not wake
    /// for guards that almost never fire (see [`Timeouts`]).
    pub fn timeouts(&self) -> Timeouts {
        let pace = self.pace_blocked.then_some(self.next_send_at);
        let due = self.retx_due.iter().map(|&(_, _, due)| due).min();
        Timeouts {
            prompt: [self.rnr_until, pace, due].into_iter().flatten().min(),
            guard: [self.retry_deadline, self.tail_recheck_at]
                .into_iter()
                .flatten()
                .min(),
            ack_hold: self.ack_hold_until.filter(|_| self.pending_ack.is_some()),
        }
    }

    /// The next packet to send, if any (responses first, then requests).
    pub fn poll_transmit(&mut self, now: u64) -> Option<Packet> {
        if self.state == QpState::Reset {
            return None;
        }
        if let Some(p) = self.resp_tx.pop_front() {
            // A held ACK leaves behind the responses.
            self.ack_hold_until = None;
            self.stats.packets_sent += 1;
            return Some(p);
        }
        if self.state == QpState::Error {
            return None;
        }
        if self.pending_ack.is_some() && self.ack_hold_until.is_some_and(|t| now < t) {
            // Held for the application's answer: it leaves first, then the
            // ACK right behind it, in the same batch.
            let p = self.next_request_counted(now)?;
            self.ack_hold_until = None;
            self.stats.acks_with_answer += 1;
            return Some(p);
        }
        if let Some(psn) = self.pending_ack.take() {
            self.ack_hold_until = None;
            self.since_ack = 0;
            self.stats.packets_sent += 1;
            return Some(self.ack_packet(psn, 0x1F));
        }
        self.next_request_counted(now)
    }

    fn next_request_counted(&mut self, now: u64) -> Option<Packet> {
        if self.state != QpState::Rts {
            return None;
        }
        let new_request = self
            .sq
            .get(self.tx_wqe)
            .is_some_and(|w| self.tx_pkt == 0 && w.sent_upto == 0);
        let p = self.next_request(now)?;
        self.stats.packets_sent += 1;
        if self.retry_deadline.is_none() {
            self.retry_deadline = self.rto_ns().map(|t| now + t);
        }
        // A new request soon after a delivery: the application answers.
        if new_request {
            if let Some(at) = self.delivered_at.take() {
                self.answering =
                    self.cfg.ack_hold_ns > 0 && now.saturating_sub(at) < self.cfg.ack_hold_ns;
            }
        }
        Some(p)
    }

    /// Whether ACKs of delivered messages wait for the answer this end
    /// sends back (it answered the last delivery within
    /// [`QpConfig::ack_hold_ns`]; a hold that ran out ends it).
    pub fn answering(&self) -> bool {
        self.answering
    }
    /// Whether a coalesced ACK is held for the application's answer (see
    /// [`QpConfig::ack_hold_ns`]).
    pub fn ack_held(&self) -> bool {
        self.pending_ack.is_some() && self.ack_hold_until.is_some()
    }
    /// End the hold of a held ACK now (the caller knows the answer is not
    /// coming soon: its receive pass is over): it leaves with the next
    /// [`Qp::poll_transmit`]. As with a hold that runs out, the next
    /// deliveries do not wait until this end answers again: a receiver
    /// that stops answering (a stream of sends it only takes) must not have
    /// every ACK wait.
    pub fn release_ack(&mut self) {
        if self.ack_hold_until.take().is_some() && self.pending_ack.is_some() {
            self.answering = false;
        }
    }
    /// Whether a coalesced ACK waits to be sent.
    pub fn ack_pending(&self) -> bool {
        self.pending_ack.is_some()
    }
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
            if std::mem::take(&mut self.delivered) {
                self.delivered_at = Some(now);
                if self.answering
                    && self.pending_ack.is_some()
                    && self.ack_hold_until.is_none()
                    && self.since_ack <= ACK_HOLD_MAX_PACKETS
                {
                    self.ack_hold_until = Some(now.saturating_add(self.cfg.ack_hold_ns));
                }
            }
            if self.since_ack > ACK_HOLD_MAX_PACKETS {
                // More than a small answer's worth waits: acknowledge now,
                // as TCP's delayed ACK does after two full segments (RFC
                // 1122 4.2.3.2); a windowed sender must not stall on it.
                self.ack_hold_until = None;
            }
        } else if self.state == QpState::Rts {
            self.completer(now, pkt);
            // Selective repeat's silence checks, when due, also run as
            // responses arrive (as RACK runs on ACKs, RFC 8985 §6.2): a
            // stream of another READ's responses can keep a software
            // device's timer from running for milliseconds, and the front
            // READ's lost re-ask waited for the stream to end (5% loss,
            // 16 READs of 1 MiB through a veth: 6 ms per lost re-ask).
            if self.cfg.selective_repeat && self.tail_recheck_at.is_some_and(|t| now >= t) {
                self.recheck_read(now);
            }
        }
    }
    /// Handle expired timers.
    pub fn handle_timeout(&mut self, now: u64) {
        if self.ack_hold_until.is_some_and(|t| now >= t) {
            // No answer came in time: the ACK goes alone, and the next
            // ones do not wait until this end answers again.
            self.ack_hold_until = None;
            self.answering = false;
        }
        self.promote_due_resends(now);
        self.recheck_read(now);
        self.recheck_write_tail(now);
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
        // Selective repeat: a READ whose responses still arrive is not
        // stalled, however long its first hole takes to fill behind them;
        // `recheck_read` repairs it.
        if let (true, Some(rto)) = (self.cfg.selective_repeat, self.rto_ns()) {
            let front = self.sq.iter().find(|w| w.done.is_none());
            if let Some(w) = front.filter(|w| matches!(w.wr, WorkRequest::Read { .. })) {
                if now < w.read_heard_at.saturating_add(rto) {
                    self.retry_deadline = Some(w.read_heard_at + rto);
                    return;
                }
            }
        }
        self.stats.timeouts += 1;
        // A timer of the full ACK timeout is a retry (IBTA 9.7.6.1.4); the
        // fast timer's doublings before it (set_fast_timeout) are not.
        let full = self.fast_rto_ns() == self.full_rto_ns();
        if full {
            if self.retry_left == 0 {
                self.fail_front(WcStatus::RetryExceeded);
                return;
            }
            self.retry_left -= 1;
        }
        self.cc_loss(true);
        self.recover(now, self.una, None);
        let used = self.rto_ns();
        self.backoff += 1;
        self.karn_rto_ns = used.map(|t| t.saturating_mul(2));
        self.retry_deadline = self.rto_ns().map(|t| now + t);
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
        // Nothing is sent in ERROR: a pacing wait left set would make
        // poll_timeout report the same instant for ever.
        self.pace_blocked = false;
        // What was received and completed is still acknowledged (responses
        // leave in ERROR too): a coalesced ACK waiting for the end of a
        // batch must not be lost when the application destroys the QP right
        // after taking the last message (rc_pingpong then waits for ever).
        if let Some(psn) = self.pending_ack.take() {
            let ack = self.ack_packet(psn, 0x1F);
            self.resp_tx.push_back(ack);
        }
        self.retx.clear();
        self.resent_at.clear();
        self.retx_due.clear();
        self.read_retx.clear();
        self.ooo.clear();
    }
}
