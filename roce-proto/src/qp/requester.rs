//! The requester: turns posted work requests into request packets within
//! the window, congestion control and retransmission timers (rxe's req.c),
//! go-back-N rewinds (rocev2-reference §7).

use super::*;

impl Qp {
    /// The smallest congestion window.
    const MIN_CWND: u32 = 8;

    /// The current retransmission interval, as TCP computes it (RFC 6298
    /// §2, §5): 1.5 × the measured round trip (the longest recent one),
    /// never under the fast timer doubled per timeout in a row, nor under a
    /// timeout's backed-off interval until a packet sent once is
    /// acknowledged (Karn's rule); at most [`Qp::full_rto_ns`] (`None`:
    /// timer disabled). A peer that answers in milliseconds (rxe in a VM, a
    /// READ queued behind another) is not sent a duplicate request every
    /// fast tick; a NIC that answers in microseconds keeps the fast timer.
    pub(super) fn rto_ns(&self) -> Option<u64> {
        let fast = self.fast_rto_ns()?;
        let full = self.full_rto_ns()?;
        Some(
            fast.max(self.round_trip_margin_ns().unwrap_or(0))
                .max(self.karn_rto_ns.unwrap_or(0))
                .min(full),
        )
    }

    /// 1.5 × the measured round trip: how long a packet sent now may take
    /// to be answered (`None` before the first sample).
    fn round_trip_margin_ns(&self) -> Option<u64> {
        self.srtt_ns.map(|s| s.saturating_add(s / 2))
    }

    /// The fast timer doubled per timeout in a row, up to
    /// [`Qp::full_rto_ns`]: when it reaches that, a timeout uses up a retry.
    pub(super) fn fast_rto_ns(&self) -> Option<u64> {
        let full = self.full_rto_ns()?;
        if self.fast_timeout == 0 || self.fast_timeout >= self.cfg.timeout {
            return Some(full);
        }
        let fast = 4096u64 << self.fast_timeout;
        Some(fast.saturating_mul(1u64 << self.backoff.min(31)).min(full))
    }

    /// The longest retransmission interval, whose expiry uses up a retry:
    /// the ACK timeout, or 64 × the fast timer if that is longer.
    pub(super) fn full_rto_ns(&self) -> Option<u64> {
        let ack = self.cfg.ack_timeout_ns()?;
        if self.fast_timeout == 0 || self.fast_timeout >= self.cfg.timeout {
            return Some(ack);
        }
        Some(ack.max(4096u64 << (u32::from(self.fast_timeout) + 6)))
    }

    /// A loss (go-back-N only): shrink the window (RFC 5681 §3.1).
    pub(super) fn cc_loss(&mut self, timeout: bool) {
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
    pub(super) fn cc_acked(&mut self) {
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

    pub(super) fn next_request(&mut self, now: u64) -> Option<Packet> {
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
            // Those sent, less the finished ones at the head (rarely any:
            // finished WQEs leave the head as they finish).
            let finished_at_head = self
                .sq
                .iter()
                .take(self.tx_wqe)
                .take_while(|w| w.done.is_some())
                .filter(|w| w.needs_response())
                .count();
            let outstanding = self.responses_sent - finished_at_head;
            debug_assert_eq!(
                outstanding,
                self.sq
                    .iter()
                    .take(self.tx_wqe)
                    .skip_while(|w| w.done.is_some())
                    .filter(|w| w.needs_response())
                    .count()
            );
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
        let margin = self.pause_margin_ns();
        if self.cfg.selective_repeat && !matches!(wqe.wr, WorkRequest::Read { .. }) {
            self.tail_recheck_at.get_or_insert(now + margin);
        }
        self.account_sent(now, &pkt);
        self.sent_at = now;
        // Selective repeat: a READ request queued behind other READs'
        // responses times the responder's queue, not the path: a pipeline
        // of READs let the "least" round trip creep up by a sixteenth per
        // sample to milliseconds, and the silence checks with it. (Go-back-N
        // keeps such samples: its timer must learn how long a READ behind
        // others takes, see `retransmission_timer_learns_a_slow_peers_round_trip`.)
        let clean_probe = !self.cfg.selective_repeat
            || !matches!(self.sq[self.tx_wqe].wr, WorkRequest::Read { .. })
            || self.sq.iter().take(self.tx_wqe).all(|w| w.done.is_some());
        let wqe = &mut self.sq[self.tx_wqe];
        if idx < wqe.sent_upto {
            self.stats.retransmits += 1;
        } else {
            // A READ request covers its whole chunk of responses.
            wqe.sent_upto = idx + advance;
            if self.cfg.selective_repeat && matches!(wqe.wr, WorkRequest::Read { .. }) {
                wqe.read_active_at = now;
                self.tail_recheck_at.get_or_insert(now + margin);
            }
            if self.rtt_probe.is_none() && clean_probe {
                self.rtt_probe = Some((psn, now));
            }
        }
        self.tx_pkt += advance;
        if self.tx_pkt >= wqe.npkts {
            if wqe.needs_response() {
                self.responses_sent += 1;
            }
            self.tx_wqe += 1;
            self.tx_pkt = 0;
        }
        Some(pkt)
    }

    /// DCQCN byte counting and pacing for a packet about to leave.
    pub(super) fn account_sent(&mut self, now: u64, pkt: &Packet) {
        if let Some(rp) = self.rp.as_mut() {
            // Bytes on the wire: Ethernet + IPv4 + UDP (42) + transport + ICRC.
            let wire = (42 + pkt.encoded_len() + 4) as u64;
            rp.on_sent(now, wire);
            self.next_send_at = self.next_send_at.max(now) + rp.pace_ns(wire);
        }
    }

    /// The request packet for packet `idx` of WQE `wi`, and how many PSNs it
    /// covers (a READ request covers its chunk of responses).
    pub(super) fn build_request(&self, wi: usize, idx: u32) -> (Packet, u32) {
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
    /// `nak_at` is when a NAK asked for it (`None`: the timer did, which
    /// always resends).
    pub(super) fn recover(&mut self, now: u64, psn: u32, nak_at: Option<u64>) {
        // A cumulative ACK after a loss would time the repair, not the path.
        self.rtt_probe = None;
        if self.cfg.selective_repeat && self.ask_missing_responses(now, psn, u32::MAX) {
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
                if let (Some(now), Some(&Resend { at, .. }), Some(margin)) = (
                    nak_at,
                    self.resent_at.get(&psn),
                    self.round_trip_margin_ns(),
                ) {
                    // The resend takes a round trip to show at the responder:
                    // look again then.
                    let due = at.saturating_add(margin);
                    if now < due {
                        self.stats.naks_before_resend += 1;
                        if !self.retx_due.iter().any(|&(q, _, _)| q == psn) {
                            self.retx_due.push((psn, at, due));
                        }
                        return;
                    }
                }
                if !self.retx.contains(&psn) {
                    self.retx.push_back(psn);
                }
                return;
            }
        }
        self.rewind(psn);
    }

    /// Round-trip samples after an acknowledgement: the probe packet's, if
    /// it is now acknowledged and was never resent (Karn's rule: an ACK
    /// after a resend could answer either copy), and the repair time of
    /// resent packets now acknowledged.
    /// Returns whether a sample was taken.
    pub(super) fn sample_rtt(&mut self, now: u64) -> bool {
        let una = self.una;
        let mut sample = None;
        if let Some((p, sent)) = self.rtt_probe {
            if psn::diff(una, p) > 0 {
                self.rtt_probe = None;
                if !self.resent_at.contains_key(&p) {
                    let clean = now.saturating_sub(sent);
                    sample = Some(clean);
                    // The path's own round trip: the least clean sample,
                    // let up by 1/16 per sample so it follows a slower path.
                    self.min_rtt_ns =
                        Some(self.min_rtt_ns.map_or(clean, |m| clean.min(m + m / 16)));
                }
            }
        }
        if !self.resent_at.is_empty() {
            // The shortest repair among resent packets now acknowledged,
            // from the first resend: what a resend has to wait for (behind
            // the window already queued); one resent again (too early, or
            // lost twice) times long rather than short.
            let repair = self
                .resent_at
                .iter()
                .filter(|&(&q, _)| psn::diff(q, una) < 0)
                .map(|(_, r)| now.saturating_sub(r.first))
                .min();
            sample = sample.max(repair);
            self.resent_at.retain(|&q, _| psn::diff(q, una) >= 0);
        }
        let Some(sample) = sample else {
            return false;
        };
        // Up at once, down slowly: the longest recent round trip (queueing
        // behind the window included) is the one a resend may wait for.
        self.srtt_ns = Some(match self.srtt_ns {
            None => sample,
            Some(s) => sample.max(s - s / 8),
        });
        true
    }

    /// Count `responses_sent` afresh (after `tx_wqe` moved back).
    fn count_responses_sent(&mut self) {
        self.responses_sent = self
            .sq
            .iter()
            .take(self.tx_wqe)
            .filter(|w| w.needs_response())
            .count();
    }

    /// Go back to `psn` and resend everything from there (rocev2-reference §7).
    pub(super) fn rewind(&mut self, psn: u32) {
        self.stats.rewinds += 1;
        self.rtt_probe = None;
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
            self.count_responses_sent();
            return;
        };
        self.tx_wqe = i;
        self.count_responses_sent();
        let w = &mut self.sq[i];
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
}
