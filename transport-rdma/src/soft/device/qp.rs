//! A soft queue pair: the sans-IO engine under a mutex, its socket, and
//! the work around it: posting, transmitting (GSO runs, gathered sends, the
//! backlog of a full socket buffer), receiving, timers (guards, pacing),
//! completions, and the `QueuePair` the verbs layer sees.

use super::*;

pub(super) struct Tx {
    /// Non-blocking and not registered with the reactor: sends go straight
    /// to the kernel, and only the flusher of a full buffer waits for room
    /// ([`crate::sys::writable`]). Registered, every datagram the kernel
    /// frees would report "writable" and wake the thread in `epoll`.
    pub(super) sock: std::net::UdpSocket,
    pub(super) state: UdpSocketState,
    pub(super) local: SocketAddr,
    /// The peer `sock` is connected to ([`gather::connect`]): gathered
    /// sends there name no address. `None` when connecting failed (sends
    /// then name the address each time, as before).
    connected_to: Option<SocketAddr>,
    /// `sock` marks everything it sends ECT(0) itself, so gathered sends
    /// carry no ECN control message.
    ecn_on_socket: bool,
    /// Exact IPv4 mode (see [`SoftConfig::exact_ipv4`]).
    raw: Option<RawTx>,
    /// Gathered sends are off ([`SoftConfig::gathered_sends`]) or the kernel
    /// refused one: sends go from one buffer through quinn-udp (see
    /// `SoftQp::send_batch`).
    gather_refused: AtomicBool,
}

pub(super) struct Inner {
    pub(super) qp: Qp,
    pub(super) peer: Option<QpPeer>,
    pub(super) tx: Option<Arc<Tx>>,
    /// Datagrams that found the socket buffer full, with their GSO segment size.
    pub(super) backlog: VecDeque<(Vec<u8>, usize)>,
    pub(super) flushing: bool,
    /// Scratch of the batch being sent: each datagram's headers, then its
    /// pad and ICRC (the payloads stay where the engine holds them).
    pub(super) out: Vec<u8>,
    /// Sizes of the batch's datagrams.
    pub(super) segs: Vec<usize>,
    /// The batch's datagrams, as pieces of `out` and their payloads.
    pub(super) grams: Vec<Gathered>,
    /// Datagrams of the batch (index in `grams`, IP Identification) whose
    /// payload is in a region: their ICRC is computed when they are sent.
    pub(super) unsealed: Vec<(usize, u16)>,
    /// NAKs the engine had received, plus duplicates it had seen, when last
    /// published: a change means packets were lost on the path (the peer
    /// saw ours lost, or asked again for what we sent). Our own timers can
    /// fire for nothing on a loaded machine, so they do not count.
    pub(super) losses_seen: u64,
    /// Until when (device ns) bursts listen between their sends
    /// ([`SoftQp::listen_while_sending`]): a while after the last loss.
    pub(super) listen_until: u64,
    /// Whether the guard timers run on time or [`GUARD_SLACK_NS`] late.
    pub(super) guards: GuardPace,
}

/// How long after a loss a QP's bursts listen between their sends. Without
/// losses they do not: on a loopback path the receive queue holds the
/// peer's data too, and taking it from the sending thread halved 1 MiB
/// write streams (3.2-3.7 -> 2.3-2.4 GB/s) by doing on one core what the
/// receive task does on the other.
const LISTEN_AFTER_LOSS_NS: u64 = 100_000_000;

/// How much later than due a QP with no recent loss runs its guard timers
/// (the retransmission timer, selective repeat's tail probe; see
/// [`SoftQp::update_deadline`]). A first tail loss after a calm spell is
/// found this much later; from then on, for [`PROMPT_GUARDS_NS`], on time.
pub(super) const GUARD_SLACK_NS: u64 = 1_000_000;

/// How long after a NAK or a resend a QP's guard timers run on time: a
/// path that lost a packet lately loses more, and on such a path a QP that
/// sends now and then (an answer per operation) would otherwise find each
/// of its tail losses late. Not longer: while prompt, a guard per operation
/// wakes the timer task every few round trips, and small operations right
/// after a bulk phase that lost a packet (a loopback socket buffer
/// overflowing) took twice as long for as long as this lasted (8 B writes
/// 44-57 µs instead of 30-34 at 10 s). At 0.1-5% loss through a veth the
/// losses come far more often than this, so the guards stay prompt there
/// (goodput unchanged, three interleaved rounds).
pub(super) const PROMPT_GUARDS_NS: u64 = 100_000_000;

/// Whether a QP's guard timers may run late: not for [`PROMPT_GUARDS_NS`]
/// after the engine counted a NAK or a resend (timers that fired for
/// nothing on a loaded machine count too: they only cost wake-ups).
#[derive(Debug, Default)]
pub(super) struct GuardPace {
    /// The engine's NAKs received and packets resent, when last looked at.
    naks: u64,
    pub(super) resent: u64,
    /// Until when (device ns) the guards run on time.
    prompt_until: u64,
}

impl GuardPace {
    /// How late the guards may run now, given the engine's counters.
    pub(super) fn slack(&mut self, st: &QpStats, now: u64) -> u64 {
        if (st.naks_received, st.retransmits) != (self.naks, self.resent) {
            self.naks = st.naks_received;
            self.resent = st.retransmits;
            self.prompt_until = now.saturating_add(PROMPT_GUARDS_NS);
        }
        if now < self.prompt_until {
            0
        } else {
            GUARD_SLACK_NS
        }
    }
}

/// When the timer must run for a QP whose engine has `t` (its guards
/// `slack` late): its deadline (what the timer task's scan compares), and
/// the part of it that must not wait for a held ACK's release (see
/// [`TimerTarget::lower_lazily`]); `u64::MAX` for none.
pub(super) fn wake_times(t: Timeouts, slack: u64) -> (u64, u64) {
    let guard = t.guard.map(|g| g.saturating_add(slack));
    let urgent = [t.prompt, guard].into_iter().flatten().min();
    let deadline = [urgent, t.ack_hold].into_iter().flatten().min();
    (deadline.unwrap_or(u64::MAX), urgent.unwrap_or(u64::MAX))
}

pub(crate) struct SoftQp {
    pub(super) dev: Arc<Device>,
    pub(super) qpn: u32,
    pub(super) cq: Arc<SoftCq>,
    pub(super) domain: Domain,
    pub(super) inner: Mutex<Inner>,
    /// When the engine next needs `handle_timeout` (device clock ns; MAX = never).
    pub(super) deadline: AtomicU64,
    /// Where protocol events are counted, and what was counted so far.
    pub(super) sink: Mutex<Option<(Arc<Stats>, QpStats)>>,
    /// A pump is scheduled for the end of this scheduler tick
    /// ([`SoftQp::pump_soon`]).
    pub(super) pump_due: AtomicBool,
}

/// Responder access to the domain's regions (the engine's memory trait).
pub(super) struct DomainMemory<'a>(pub(super) &'a Domain);

fn mem_err(e: rdmx_core::AccessError) -> MemError {
    use rdmx_core::AccessError as A;
    match e {
        A::UnknownKey => MemError::UnknownKey,
        A::OutOfBounds => MemError::OutOfBounds,
        A::Permission => MemError::Permission,
        A::Revoked => MemError::Revoked,
        A::Misaligned => MemError::Misaligned,
    }
}

impl Memory for DomainMemory<'_> {
    fn check(&self, rkey: u32, va: u64, len: u64, need: Need) -> Result<(), MemError> {
        let access = match need {
            Need::Read => Access::REMOTE_READ,
            Need::Write => Access::REMOTE_WRITE,
            Need::Atomic => Access::REMOTE_ATOMIC,
        };
        self.0.check_access(rkey, va, len, access).map_err(mem_err)
    }

    fn write(&mut self, rkey: u32, va: u64, data: &[u8]) -> Result<(), MemError> {
        self.0
            .remote_write(rkey, va, data.len() as u64, 0, data)
            .map_err(mem_err)
    }

    fn read(&self, rkey: u32, va: u64, len: u64) -> Result<Bytes, MemError> {
        self.0.remote_read(rkey, va, len, 0, len).map_err(mem_err)
    }

    fn read_source(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
    ) -> Result<Option<Arc<dyn PayloadSource>>, MemError> {
        let slice = self
            .0
            .remote_read_source(rkey, va, len, 0, len)
            .map_err(mem_err)?;
        Ok(Some(Arc::new(RegionSource(slice))))
    }

    fn atomic(&mut self, rkey: u32, va: u64, op: Atomic) -> Result<u64, MemError> {
        let op = match op {
            Atomic::CompareSwap { compare, swap } => AtomicOp::CompareAndSwap {
                expected: compare,
                new: swap,
            },
            Atomic::FetchAdd { add } => AtomicOp::FetchAndAdd { add },
        };
        self.0.remote_atomic(rkey, va, op).map_err(mem_err)
    }
}

/// A READ's data left in its region: the transmitter sends each response's
/// slice from the region itself ([`Payload::Region`]), with no copy before
/// the kernel's.
#[derive(Debug)]
pub(super) struct RegionSource(pub(super) LocalSlice);

impl PayloadSource for RegionSource {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn copy(&self, range: std::ops::Range<usize>) -> Bytes {
        Bytes::copy_from_slice(&self.0.lock()[range])
    }

    fn append_to(&self, range: std::ops::Range<usize>, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.0.lock()[range]);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn work_completion(qpn: u32, c: Completion) -> WorkCompletion {
    use rdmx_roce_proto::{WcOpcode as O, WcStatus as S};
    WorkCompletion {
        wr_id: c.wr_id,
        qpn,
        status: match c.status {
            S::Success => WcStatus::Success,
            S::LocalLengthError => WcStatus::LocalLength,
            S::Flushed => WcStatus::Flushed,
            S::RemoteInvalidRequest => WcStatus::RemoteInvalidRequest,
            S::RemoteAccessError => WcStatus::RemoteAccess,
            S::RemoteOperationalError => WcStatus::RemoteOperational,
            S::RetryExceeded => WcStatus::RetryExceeded,
            S::RnrRetryExceeded => WcStatus::RnrRetryExceeded,
        },
        opcode: match c.opcode {
            O::Send => WcOpcode::Send,
            O::Write => WcOpcode::Write,
            O::Read => WcOpcode::Read,
            O::CompareSwap => WcOpcode::CompareSwap,
            O::FetchAdd => WcOpcode::FetchAdd,
            O::Recv => WcOpcode::Recv,
            O::RecvWriteImm => WcOpcode::RecvWriteImm,
        },
        byte_len: c.byte_len,
        data: c.data,
        imm: c.imm,
        atomic_orig: c.atomic_orig,
    }
}

/// Send one transmit. Only a full socket buffer is an error: other send errors
/// (no route, peer port unreachable) lose the packet as a link would, and RC
/// recovery retransmits it or reports the peer unreachable.
fn try_send(tx: &Tx, t: &Transmit<'_>) -> io::Result<()> {
    match tx.state.try_send((&tx.sock).into(), t) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Err(e),
        Err(e) => {
            debug!(dst = %t.destination, "soft RoCE send: {e}");
            Ok(())
        }
        Ok(()) => Ok(()),
    }
}

impl SoftQp {
    /// Store when this QP needs its timer next, and make the timer task run
    /// by then. Guards (the retransmission timer, the tail probe) wait
    /// [`GUARD_SLACK_NS`] longer while the QP has seen no loss lately: they
    /// move or go away before they come unless something was lost, and a
    /// timer that fired for each of them (one per operation in a ping-pong)
    /// woke the timer task on the worker the application ran on, which
    /// handed the application to the other worker (8 B send round trips
    /// 24-30 µs instead of 19-20 on two workers).
    /// `now` is the pump's one reading of the device clock (the guards'
    /// slack changes on a scale of 100 ms).
    fn update_deadline(&self, inner: &mut Inner, now: u64) {
        let slack = inner.guards.slack(&inner.qp.stats(), now);
        let (d, urgent) = wake_times(inner.qp.timeouts(), slack);
        // SeqCst: the timer task's scan and `TimerTarget` rely on one order.
        self.deadline.store(d, Ordering::SeqCst);
        if let Some(at) = self.dev.timer_target.lower_lazily(d, urgent) {
            self.dev.wake_timer_by(at);
        }
    }

    /// Move the engine forward: send what it has (in order, under the lock),
    /// hand completions to the CQ, re-arm the timer.
    pub(super) fn pump(self: &Arc<Self>) {
        self.pump_for(false, false);
    }

    /// [`SoftQp::pump`] from the device's own tasks (packets received,
    /// timers), which hold no lock of the connection's: the connection takes
    /// its completions right here instead of in a task of its own.
    pub(super) fn pump_inline(self: &Arc<Self>) {
        self.pump_for(true, false);
        self.cq.run_handler();
    }

    /// [`SoftQp::pump_inline`] from a receive task, which releases an ACK
    /// the engine holds for the application's answer only once its tick is
    /// over. Returns whether one is held.
    pub(super) fn pump_inline_holding(self: &Arc<Self>) -> bool {
        let held = self.pump_for(true, true);
        self.cq.run_handler();
        held
    }

    /// Pump; unless `keep_held`, an ACK held for the application's answer
    /// leaves now, behind whatever else goes (with a backlog, the flusher
    /// sends it). Returns whether one is still held.
    fn pump_for(self: &Arc<Self>, handler_follows: bool, keep_held: bool) -> bool {
        let mut g = self.inner.lock();
        // One clock reading per pump, for the sends and the timer: a round
        // trip of small sends pumps four times, and its steps read the
        // clock eight times (a send and the ACK released behind it, and the
        // timer after them, each read it).
        let now = self.dev.now();
        self.publish(&mut g, handler_follows);
        if g.backlog.is_empty() {
            if keep_held {
                self.transmit(&mut g, handler_follows, now);
            } else {
                self.transmit_releasing(&mut g, handler_follows, now);
            }
        }
        self.update_deadline(&mut g, now);
        self.count(g.qp.stats());
        g.qp.ack_held()
    }

    /// Hand the engine's completions to the CQ, then its counters to the
    /// attached stats. Both come before the packets that acknowledge them: a
    /// peer that sees our ACK may act on it (even close) before we would
    /// otherwise have published the receive it acknowledges, and one that
    /// sees our response may read the counters (remote operations served).
    fn publish(&self, inner: &mut Inner, handler_follows: bool) {
        // Straight from the engine into the CQ (no list in between).
        if let Some(first) = inner.qp.poll_completion() {
            let rest = std::iter::from_fn(|| inner.qp.poll_completion());
            let qpn = self.qpn;
            let wcs = std::iter::once(first)
                .chain(rest)
                .map(|c| work_completion(qpn, c));
            self.cq.push(wcs, handler_follows);
        }
        let st = inner.qp.stats();
        // A NAK received, or a duplicate request (a READ asked again for
        // responses lost on the way: the responder gets no NAK) or
        // response: loss on the path.
        let losses = st.naks_received + st.duplicates;
        if losses != inner.losses_seen {
            inner.losses_seen = losses;
            inner.listen_until = self.dev.now().saturating_add(LISTEN_AFTER_LOSS_NS);
        }
        self.count(st);
    }

    /// Pump once the scheduler tick's other ready tasks have run: a work
    /// request posted while others are outstanding leaves with every request
    /// posted in that tick, in one GSO batch, instead of one datagram and one
    /// system call each (the TCP transport batches its requests the same way).
    fn pump_soon(self: &Arc<Self>) {
        if self.pump_due.swap(true, Ordering::AcqRel) {
            return;
        }
        let qp = self.clone();
        self.dev.handle.spawn(async move {
            tokio::task::yield_now().await;
            // Cleared before pumping: a request posted after this point
            // schedules a pump of its own, one posted before it is sent now.
            qp.pump_due.store(false, Ordering::Release);
            qp.pump();
        });
    }

    /// [`SoftQp::transmit`], then an ACK still held for the application's
    /// answer, alone: a held ACK leaves behind anything sent with it (its
    /// answer), never before.
    fn transmit_releasing(
        self: &Arc<Self>,
        g: &mut MutexGuard<'_, Inner>,
        handler_follows: bool,
        now: u64,
    ) {
        self.transmit(g, handler_follows, now);
        if g.qp.ack_held() && g.backlog.is_empty() {
            g.qp.release_ack();
            self.transmit(g, handler_follows, now);
        }
    }

    /// Send what the engine has, `now` being the device clock's reading
    /// (taken again after a burst listened for the peer's packets).
    fn transmit(self: &Arc<Self>, g: &mut MutexGuard<'_, Inner>, handler_follows: bool, now: u64) {
        let inner = &mut **g;
        let (Some(tx), Some(peer)) = (inner.tx.clone(), inner.peer) else {
            // Not connected: drop anything the engine queued (e.g. flush-time ACKs).
            while inner.qp.poll_transmit(now).is_some() {}
            return;
        };
        if let Some(raw) = &tx.raw {
            let ecn = if self.dev.cfg.ecn { 2 } else { 0 };
            while let Some(p) = inner.qp.poll_transmit(now) {
                let id = raw.id();
                inner.out.clear();
                encode(&p, tx.local, peer.addr, id, &mut inner.out);
                if self.dev.capturing.load(Ordering::Relaxed) {
                    self.dev.record(tx.local, peer.addr, &p, ecn);
                }
                let c = &self.dev.counters;
                c.tx_calls.fetch_add(1, Ordering::Relaxed);
                match raw.send(tx.local, peer.addr, id, ecn, &inner.out) {
                    Ok(()) => {
                        c.tx_packets.fetch_add(1, Ordering::Relaxed);
                        c.tx_bytes
                            .fetch_add(inner.out.len() as u64, Ordering::Relaxed);
                    }
                    // A full raw socket loses the packet, as a full link would;
                    // RC recovery resends it.
                    Err(e) => {
                        c.tx_blocked.fetch_add(1, Ordering::Relaxed);
                        debug!("soft RoCE raw send: {e}");
                    }
                }
            }
            return;
        }
        let max_segs = tx.state.max_gso_segments().clamp(1, 64);
        let mut now = now;
        let mut inner = &mut **g;
        inner.out.clear();
        inner.segs.clear();
        inner.grams.clear();
        inner.unsealed.clear();
        let mut batch = 0;
        let mut run = GsoRun::default();
        loop {
            let pkt = inner.qp.poll_transmit(now);
            if let Some(p) = &pkt {
                // Headers, then pad and ICRC, in the scratch buffer; the
                // payload is sent from where it is (soft/gather.rs).
                let at = inner.out.len();
                p.encode_headers(&mut inner.out);
                let hlen = inner.out.len() - at;
                let pad = p.pad_bytes();
                let size = hlen + p.payload_len() + pad.len() + 4;
                // The Identification the kernel will give this datagram.
                let id = run.next_id(size);
                let payload = match &p.deferred {
                    // A READ response's data stays in its region: read,
                    // and its ICRC computed, while the send runs
                    // ([`seal_regions`]).
                    Some(d) => match d.source.as_any().downcast_ref::<RegionSource>() {
                        Some(r) => Payload::Region(r.0.clone(), d.range.clone()),
                        None => Payload::Bytes(d.source.copy(d.range.clone())),
                    },
                    None => Payload::Bytes(p.payload.clone()),
                };
                if let Payload::Bytes(b) = &payload {
                    let (ip, udp) = headers(tx.local, peer.addr, 8 + size, id);
                    let crc = icrc::compute_parts(&ip, &udp, &[&inner.out[at..], b, pad]);
                    inner.out.extend_from_slice(pad);
                    inner.out.extend_from_slice(&crc.to_le_bytes());
                } else {
                    inner.out.extend_from_slice(pad);
                    inner.out.extend_from_slice(&[0; 4]);
                    inner.unsealed.push((inner.grams.len(), id));
                }
                inner.grams.push(Gathered {
                    at,
                    headers: hlen,
                    payload,
                    trailer: pad.len() + 4,
                });
                inner.segs.push(size);
                batch += size;
                if self.dev.capturing.load(Ordering::Relaxed) {
                    let ecn = if self.dev.cfg.ecn { 2 } else { 0 };
                    self.dev.record(tx.local, peer.addr, p, ecn);
                }
            }
            let full = inner.segs.len() >= max_segs || batch >= 60_000;
            if (pkt.is_none() || full) && !inner.segs.is_empty() {
                if !self.send_batch(&tx, peer.addr, inner) {
                    return;
                }
                inner.out.clear();
                inner.segs.clear();
                inner.grams.clear();
                inner.unsealed.clear();
                batch = 0;
                run = GsoRun::default();
                if pkt.is_some() && now < inner.listen_until {
                    let took = self.listen_while_sending(g);
                    inner = &mut **g;
                    if took {
                        self.publish(inner, handler_follows);
                        now = self.dev.now();
                    }
                }
            }
            if pkt.is_none() {
                return;
            }
        }
    }

    /// Between the sends of a long burst (a 1 MiB write is 16 GSO sends of
    /// 64 KiB, each a tenth of a millisecond or more through a veth): take
    /// what waits in the receive queues, with this QP's lock let go. The
    /// peer's NAKs name holes while the burst is still going; read only
    /// after it, each hole stayed open for the rest of the burst and was
    /// repaired a round trip after it (on two cores the receive task seldom
    /// runs while this thread and the peer's both have one). What the
    /// packets taken ask of this QP (resends first) goes in its next send;
    /// other QPs they touch are pumped as an application's post would be
    /// (their waiters woken, no handler run here). Returns whether anything
    /// was taken (the caller then publishes completions before sending on).
    pub(super) fn listen_while_sending(self: &Arc<Self>, g: &mut MutexGuard<'_, Inner>) -> bool {
        thread_local! {
            static LISTENING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        }
        if LISTENING.with(|l| l.replace(true)) {
            return false;
        }
        let mut took = 0;
        MutexGuard::unlocked_fair(g, || {
            for rx in &self.dev.rx {
                // A queue its receive task is working on: that task takes
                // this QP's lock next (given to it fairly here).
                // The QPs touched are pumped with the queue still held:
                // this thread is in no pass of its own the timer could wait
                // for (see `RxQueue::pass`).
                let Some(mut w) = rx.work.try_lock() else {
                    continue;
                };
                if let Ok((n, touched)) = receive_batch(&self.dev, rx, &mut w) {
                    pump_touched(&self.dev, touched, Taker::Burst(self));
                    count_pumped(&self.dev, n);
                    took += n;
                }
            }
        });
        LISTENING.with(|l| l.set(false));
        self.dev
            .counters
            .rx_while_sending
            .fetch_add(took as u64, Ordering::Relaxed);
        took > 0
    }

    /// Send the batch (datagrams `inner.grams`, of sizes `inner.segs`) with
    /// GSO where sizes allow. Returns false if the socket was full (the rest
    /// is in the backlog).
    ///
    /// Each GSO run goes gathered (soft/gather.rs). A run the kernel refuses
    /// (any error but a full socket) goes again as one buffer through
    /// quinn-udp, which retries without ECN on EINVAL and stops segmenting on
    /// EIO; after a refusal of the form itself (EINVAL, EIO, EOPNOTSUPP,
    /// EMSGSIZE) all later sends of this socket go that way too. Nothing is
    /// dropped for being gathered.
    fn send_batch(self: &Arc<Self>, tx: &Arc<Tx>, dst: SocketAddr, inner: &mut Inner) -> bool {
        let segs = std::mem::take(&mut inner.segs);
        let all = std::mem::take(&mut inner.grams);
        // Region payloads are read under their locks from here until they
        // have left (or been copied to the backlog), and their ICRCs
        // computed over exactly what leaves.
        let held = gather::lock_all(&all);
        seal_regions(&mut inner.out, &all, &held, &inner.unsealed, tx.local, dst);
        inner.unsealed.clear();
        let sent_all = self.send_held(tx, dst, inner, &segs, &all, &held);
        drop(held);
        inner.grams = all;
        inner.segs = segs;
        if !sent_all {
            self.spawn_flusher(inner);
        }
        sent_all
    }

    /// [`SoftQp::send_batch`] with the payloads readable (`held`); false
    /// when the socket buffer filled (what did not leave is in the backlog).
    fn send_held(
        &self,
        tx: &Arc<Tx>,
        dst: SocketAddr,
        inner: &mut Inner,
        segs: &[usize],
        all: &[Gathered],
        held: &[gather::Held<'_>],
    ) -> bool {
        let mut i = self.send_runs_at_once(
            tx,
            dst,
            Batch {
                scratch: &inner.out,
                grams: all,
                held,
            },
            segs,
        );
        while i < segs.len() {
            let size = segs[i];
            let j = gso_run_end(segs, i);
            let len: usize = segs[i..j].iter().sum();
            let gso = (j - i > 1).then_some(size);
            let c = &self.dev.counters;
            let batch = Batch {
                scratch: &inner.out,
                grams: &all[i..j],
                held: &held[i..j],
            };
            let sent = if tx.gather_refused.load(Ordering::Relaxed) {
                self.send_flat(tx, dst, batch, len, gso)
            } else {
                c.tx_calls.fetch_add(1, Ordering::Relaxed);
                let ecn = self.dev.cfg.ecn && !tx.ecn_on_socket;
                let connected = tx.connected_to == Some(dst);
                match gather::send(&tx.sock, tx.local, dst, ecn, connected, batch, gso) {
                    Err(e) if e.kind() != io::ErrorKind::WouldBlock => {
                        // The form itself refused (bad argument, no offload
                        // on the path), not this send: stop gathering.
                        let form = matches!(
                            e.raw_os_error(),
                            Some(libc::EINVAL | libc::EIO | libc::EOPNOTSUPP | libc::EMSGSIZE)
                        );
                        if form && !tx.gather_refused.swap(true, Ordering::Relaxed) {
                            warn!(%dst, "soft RoCE: gathered send refused ({e}); sending from one buffer from now on");
                        }
                        self.send_flat(tx, dst, batch, len, gso)
                    }
                    sent => sent,
                }
            };
            match sent {
                Ok(()) => {
                    c.tx_packets.fetch_add((j - i) as u64, Ordering::Relaxed);
                    c.tx_bytes.fetch_add(len as u64, Ordering::Relaxed);
                }
                Err(_) => {
                    // Socket buffer full: keep the rest, in order, for when it drains.
                    c.tx_blocked.fetch_add(1, Ordering::Relaxed);
                    // Each goes alone later, so with Identification 0: those
                    // that were not first in their run get their ICRC again.
                    let mut run_start = i;
                    for k in i..segs.len() {
                        let mut d = all[k].to_vec(&inner.out, &held[k]);
                        if k > run_start {
                            reseal_icrc(&mut d, tx.local, dst, 0);
                        }
                        inner.backlog.push_back((d, segs[k]));
                        if k + 1 == gso_run_end(segs, run_start) {
                            run_start = k + 1;
                        }
                    }
                    return false;
                }
            }
            i = j;
        }
        true
    }

    /// Send a batch of several GSO runs (datagrams of different sizes: a
    /// WRITE's full packets and the SEND behind it, an ACK and an answer) in
    /// one `sendmmsg` instead of a `sendmsg` each. Returns the index of the
    /// first datagram not sent (0: nothing was, including when the batch is
    /// one run or gathered sends were refused); [`SoftQp::send_batch`] sends
    /// the rest, one run at a time, and handles a full socket.
    fn send_runs_at_once(
        &self,
        tx: &Tx,
        dst: SocketAddr,
        batch: Batch<'_, '_>,
        segs: &[usize],
    ) -> usize {
        // Most batches are one run: nothing to build for them.
        if tx.gather_refused.load(Ordering::Relaxed)
            || segs.is_empty()
            || gso_run_end(segs, 0) == segs.len()
        {
            return 0;
        }
        let mut runs = Vec::new();
        let mut i = 0;
        while i < segs.len() {
            let j = gso_run_end(segs, i);
            runs.push((i..j, (j - i > 1).then_some(segs[i])));
            i = j;
        }
        let c = &self.dev.counters;
        c.tx_calls.fetch_add(1, Ordering::Relaxed);
        let ecn = self.dev.cfg.ecn && !tx.ecn_on_socket;
        let connected = tx.connected_to == Some(dst);
        let sent = match gather::send_runs(&tx.sock, tx.local, dst, ecn, connected, batch, &runs) {
            Ok(n) => n,
            Err(_) => return 0,
        };
        let Some(last) = sent.checked_sub(1) else {
            return 0;
        };
        let end = runs[last].0.end;
        c.tx_packets.fetch_add(end as u64, Ordering::Relaxed);
        c.tx_bytes
            .fetch_add(segs[..end].iter().sum::<usize>() as u64, Ordering::Relaxed);
        end
    }

    /// Send one GSO run (`grams`, `len` bytes in all) from one buffer through
    /// quinn-udp: the path when gathered sends are off or were refused.
    /// quinn-udp retries without ECN on EINVAL and stops segmenting on EIO.
    fn send_flat(
        &self,
        tx: &Tx,
        dst: SocketAddr,
        batch: Batch<'_, '_>,
        len: usize,
        gso: Option<usize>,
    ) -> io::Result<()> {
        let contents = batch.concat(len);
        let t = Transmit {
            destination: dst,
            ecn: self.dev.cfg.ecn.then_some(EcnCodepoint::Ect0),
            contents: &contents,
            segment_size: gso,
            src_ip: None,
        };
        self.dev.counters.tx_calls.fetch_add(1, Ordering::Relaxed);
        try_send(tx, &t)
    }

    fn spawn_flusher(self: &Arc<Self>, inner: &mut Inner) {
        if inner.flushing {
            return;
        }
        inner.flushing = true;
        let qp = Arc::downgrade(self);
        self.dev.handle.spawn(async move {
            loop {
                let Some(qp) = qp.upgrade() else { return };
                let Some(tx) = qp.inner.lock().tx.clone() else {
                    return;
                };
                if crate::sys::writable(&tx.sock).await.is_err() {
                    return;
                }
                let mut g = qp.inner.lock();
                let inner = &mut *g;
                let dst = match inner.peer {
                    Some(p) => p.addr,
                    None => return,
                };
                let ecn = qp.dev.cfg.ecn.then_some(EcnCodepoint::Ect0);
                while let Some((d, _)) = inner.backlog.front() {
                    let t = Transmit {
                        destination: dst,
                        ecn,
                        contents: d,
                        segment_size: None,
                        src_ip: None,
                    };
                    qp.dev.counters.tx_calls.fetch_add(1, Ordering::Relaxed);
                    match try_send(&tx, &t) {
                        Ok(()) => {
                            let c = &qp.dev.counters;
                            c.tx_packets.fetch_add(1, Ordering::Relaxed);
                            c.tx_bytes.fetch_add(d.len() as u64, Ordering::Relaxed);
                            inner.backlog.pop_front();
                        }
                        Err(_) => break,
                    }
                }
                if inner.backlog.is_empty() {
                    inner.flushing = false;
                    let now = qp.dev.now();
                    qp.transmit_releasing(&mut g, false, now);
                    qp.update_deadline(&mut g, now);
                    return;
                }
            }
        });
    }

    /// Add what happened since the last call to the attached rdmx counters.
    fn count(&self, now: QpStats) {
        let mut sink = self.sink.lock();
        let Some((stats, last)) = sink.as_mut() else {
            return;
        };
        if now == *last {
            return;
        }
        // Only the counters that moved are added to: usually just one
        // (`remote_ops_served`), and each add is an atomic read-modify-write
        // on this connection's counters and on the global ones.
        type Pick = fn(&Stats) -> &AtomicU64;
        let moved: [(Pick, u64, u64); 8] = [
            (|s| &s.retransmits, now.retransmits, last.retransmits),
            (|s| &s.naks, now.naks_received, last.naks_received),
            (|s| &s.retransmit_timeouts, now.timeouts, last.timeouts),
            (|s| &s.tail_probes, now.tail_probes, last.tail_probes),
            (
                |s| &s.rnr_naks,
                now.rnr_naks_received,
                last.rnr_naks_received,
            ),
            (|s| &s.cnps, now.cnps_received, last.cnps_received),
            (|s| &s.remote_ops_served, now.remote_ops, last.remote_ops),
            (
                |s| &s.remote_access_denied,
                now.remote_denied,
                last.remote_denied,
            ),
        ];
        for (pick, now, last) in moved {
            if now > last {
                stats.add(pick, now - last);
            }
        }
        *last = now;
    }

    pub(super) fn on_timer(self: &Arc<Self>, now: u64) {
        self.inner.lock().qp.handle_timeout(now);
        self.pump_inline();
    }

    /// Feed one verified packet to the engine (the caller pumps afterwards).
    pub(super) fn receive(&self, now: u64, from: SocketAddr, pkt: &Packet, ce: bool) {
        let mut g = self.inner.lock();
        match g.peer {
            Some(p) if p.addr.ip() == from.ip() => {}
            _ => {
                self.dev
                    .counters
                    .wrong_source
                    .fetch_add(1, Ordering::Relaxed);
                return;
            }
        }
        g.qp.handle_packet(now, pkt, ce, &mut DomainMemory(&self.domain));
    }
}

/// The handle users hold; dropping it destroys the QP.
pub(super) struct SoftQpHandle(pub(super) Arc<SoftQp>);

impl Drop for SoftQpHandle {
    fn drop(&mut self) {
        let qp = &self.0;
        {
            let mut g = qp.inner.lock();
            debug!(qpn = qp.qpn, stats = ?g.qp.stats(), "soft RoCE QP closed");
            g.qp.enter_error();
        }
        qp.pump();
        qp.dev.qps.write().remove(&qp.qpn);
    }
}

fn op_to_wr(op: SendOp) -> WorkRequest {
    let join = |sg: Vec<Bytes>| -> Bytes {
        match sg.len() {
            0 => Bytes::new(),
            1 => sg.into_iter().next().expect("one"),
            _ => {
                let mut v = Vec::with_capacity(sg.iter().map(|b| b.len()).sum());
                for b in &sg {
                    v.extend_from_slice(b);
                }
                v.into()
            }
        }
    };
    match op {
        SendOp::Send { sg, imm } => WorkRequest::Send {
            data: join(sg),
            imm,
            invalidate: None,
        },
        SendOp::Write { sg, dst, imm } => WorkRequest::Write {
            data: join(sg),
            va: dst.addr,
            rkey: dst.rkey,
            imm,
        },
        SendOp::Read { src } => WorkRequest::Read {
            va: src.addr,
            rkey: src.rkey,
            len: src.len.min(u64::from(u32::MAX)) as u32,
        },
        SendOp::CompareSwap { dst, compare, swap } => WorkRequest::Atomic {
            va: dst.addr,
            rkey: dst.rkey,
            op: Atomic::CompareSwap { compare, swap },
        },
        SendOp::FetchAdd { dst, add } => WorkRequest::Atomic {
            va: dst.addr,
            rkey: dst.rkey,
            op: Atomic::FetchAdd { add },
        },
    }
}

fn qp_err(e: rdmx_roce_proto::QpError) -> Error {
    match e {
        rdmx_roce_proto::QpError::TooLarge => Error::InvalidArgument(e.to_string()),
        rdmx_roce_proto::QpError::BadMtu(_) => Error::InvalidArgument(e.to_string()),
        rdmx_roce_proto::QpError::State(_) => {
            Error::Disconnected(format!("queue pair not usable: {e}"))
        }
    }
}

impl QueuePair for SoftQpHandle {
    fn qpn(&self) -> u32 {
        self.0.qpn
    }

    fn connect(&self, peer: QpPeer, sq_psn: u32) -> Result<()> {
        let qp = &self.0;
        let local = SocketAddr::new(peer.local, 0);
        let std_tx = std::net::UdpSocket::bind(local)
            .and_then(|s| s.set_nonblocking(true).map(|()| s))
            .map_err(|e| Error::Connect(format!("soft RoCE QP socket on {local}: {e}")))?;
        let tx = {
            let _g = qp.dev.handle.enter();
            let state = UdpSocketState::new((&std_tx).into())
                .map_err(|e| Error::Connect(format!("soft RoCE QP socket: {e}")))?;
            without_rx_timestamps(&std_tx);
            let _ = state.set_send_buffer_size((&std_tx).into(), 4 << 20);
            let local = std_tx
                .local_addr()
                .map_err(|e| Error::Connect(format!("soft RoCE QP socket: {e}")))?;
            let sock = std_tx;
            let (connected_to, ecn_on_socket) = if !may_connect(local, peer.addr) {
                (None, false)
            } else {
                match gather::connect(&sock, local, peer.addr, qp.dev.cfg.ecn) {
                    Ok(ecn_on_socket) => (Some(peer.addr), ecn_on_socket),
                    Err(e) => {
                        debug!(peer = %peer.addr, error = %e, "soft RoCE: QP socket not connected; sends name the peer each time");
                        (None, false)
                    }
                }
            };
            let raw = match (
                qp.dev.cfg.exact_ipv4,
                local.ip(),
                peer.addr.ip().to_canonical(),
            ) {
                (true, IpAddr::V4(_), IpAddr::V4(_)) => match RawTx::new() {
                    Ok(r) => Some(r),
                    Err(e) => {
                        warn!("soft RoCE: exact IPv4 needs CAP_NET_RAW ({e}); sending through UDP");
                        None
                    }
                },
                _ => None,
            };
            Tx {
                sock,
                state,
                local,
                connected_to,
                ecn_on_socket,
                raw,
                gather_refused: AtomicBool::new(!qp.dev.cfg.gathered_sends),
            }
        };
        let mut g = qp.inner.lock();
        g.qp.set_pmtu(peer.mtu).map_err(qp_err)?;
        let t = peer.timers;
        g.qp.set_timers(t.timeout, t.retry_cnt, t.rnr_retry)
            .map_err(qp_err)?;
        g.qp.set_fast_timeout(qp.dev.cfg.max_ack_timeout);
        g.qp.set_selective_repeat(peer.selective_repeat);
        g.qp.set_max_rd_atomic(peer.max_rd_atomic).map_err(qp_err)?;
        let window = match peer.selective_repeat {
            true => qp.dev.cfg.window,
            false => qp.dev.cfg.window_go_back_n,
        };
        g.qp.set_window(window).map_err(qp_err)?;
        g.qp.to_rtr(peer.qpn, peer.psn).map_err(qp_err)?;
        g.qp.to_rts(sq_psn).map_err(qp_err)?;
        let mut peer = peer;
        peer.addr = SocketAddr::new(peer.addr.ip().to_canonical(), peer.addr.port());
        g.peer = Some(peer);
        g.tx = Some(Arc::new(tx));
        Ok(())
    }

    fn post_send(&self, wr: SendWr) -> Result<()> {
        let others_outstanding = {
            let mut g = self.0.inner.lock();
            g.qp.post_send(wr.wr_id, op_to_wr(wr.op)).map_err(qp_err)?;
            g.qp.outstanding() > 1
        };
        // A lone request goes out at once; one posted behind others joins
        // the batch of this scheduler tick.
        if others_outstanding {
            self.0.pump_soon();
        } else {
            self.0.pump();
        }
        Ok(())
    }

    fn post_recv(&self, wr_id: u64, max_len: usize) -> Result<()> {
        let flushed = {
            let mut g = self.0.inner.lock();
            g.qp.post_recv(wr_id, max_len).map_err(qp_err)?;
            g.qp.state() == rdmx_roce_proto::QpState::Error
        };
        // In ERROR the receive completed at once (flushed): deliver it.
        if flushed {
            self.0.pump();
        }
        Ok(())
    }

    fn state(&self) -> QpState {
        match self.0.inner.lock().qp.state() {
            rdmx_roce_proto::QpState::Rts => QpState::Rts,
            rdmx_roce_proto::QpState::Error => QpState::Error,
            _ => QpState::Init,
        }
    }

    fn expected_psn(&self) -> u32 {
        self.0.inner.lock().qp.expected_psn()
    }

    fn to_error(&self) {
        self.0.inner.lock().qp.enter_error();
        self.0.pump();
    }

    fn attach_stats(&self, stats: Arc<Stats>) {
        let now = self.0.inner.lock().qp.stats();
        *self.0.sink.lock() = Some((stats, now));
    }

    fn counters(&self) -> QpCounters {
        let s = self.0.inner.lock().qp.stats();
        QpCounters {
            retransmits: s.retransmits,
            naks: s.naks_received,
            rnr_naks: s.rnr_naks_received,
            cnps: s.cnps_received,
            remote_ops: s.remote_ops,
            remote_denied: s.remote_denied,
        }
    }
}
