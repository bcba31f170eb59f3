//! The completer: ACKs, NAKs and READ/atomic responses retire send work
//! requests in order into completions (rxe's comp.c, IBTA 9.7.5).

use super::*;

impl Qp {
    pub(super) fn progress(&mut self, now: u64) {
        // Karn's rule (RFC 6298 §5.7): a backed-off timer stays backed off
        // until a round trip is measured on a packet sent once; progress
        // made by resent packets alone says nothing of the round trip.
        if self.sample_rtt(now) {
            self.karn_rto_ns = None;
        }
        self.backoff = 0;
        self.retry_left = self.cfg.retry_cnt;
        self.rnr_left = self.cfg.rnr_retry;
        self.rnr_psn = None;
        self.cc_acked();
        let outstanding = self.sq.iter().any(|w| w.done.is_none());
        self.retry_deadline = outstanding
            .then(|| self.rto_ns().map(|t| now + t))
            .flatten();
        if !outstanding {
            // Nothing left to probe for: no timer tick for nothing (the
            // device's timer would otherwise wake once per operation).
            self.tail_recheck_at = None;
        }
        self.deliver_done();
    }

    /// Move finished WQEs at the head of the send queue to the completion queue.
    pub(super) fn deliver_done(&mut self) {
        while self.sq.front().is_some_and(|w| w.done.is_some()) {
            let w = self.sq.pop_front().expect("front");
            // Finished is acknowledged: `una` goes past it. (Selective
            // repeat: a READ that finished behind an atomic still waiting
            // for its response was popped with `una` left at its first PSN
            // when the atomic's response came; the timer then asked for a
            // PSN no request held until the retries ran out.)
            let past = psn::add(w.last_psn(), 1);
            if psn::diff(past, self.una) > 0 {
                self.una = past;
            }
            if self.tx_wqe > 0 {
                self.tx_wqe -= 1;
                if w.needs_response() {
                    self.responses_sent -= 1;
                }
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
    pub(super) fn implicit_ack(&mut self, psn: u32) -> bool {
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
        // Selective repeat: READs behind may have finished already.
        if self.cfg.selective_repeat {
            self.una_past_done(0);
        }
        true
    }

    /// A NAK at `p` acknowledges everything before `p`. Returns true if that
    /// was progress (and resets the retry state accordingly).
    pub(super) fn nak_acks(&mut self, now: u64, p: u32) -> bool {
        let before = self.una;
        self.implicit_ack(psn::add(p, psn::PSN_MASK));
        if self.una != before {
            self.progress(now);
            true
        } else {
            false
        }
    }

    pub(super) fn completer(&mut self, now: u64, pkt: &Packet) {
        let p = pkt.bth.psn;
        let op = pkt.bth.opcode;
        // The responder speaks (see `recheck_write_tail`).
        self.answered_at = now;
        self.unanswered_probes = 0;
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
                        self.rnr_psn = Some(p);
                        // An RNR NAK is the responder answering: the ACK
                        // timer measures silence, so it starts again with
                        // the resend (rocev2-reference §7: rnr_retry 7 waits
                        // for ever, however long the receiver takes).
                        self.retry_deadline = None;
                        self.rewind(p);
                        self.deliver_done();
                    }
                    Syndrome::Nak(NakCode::PsnSequenceError) => {
                        self.stats.naks_received += 1;
                        let acked = self.nak_acks(now, p);
                        if !acked && self.rnr_psn == Some(p) {
                            // The echo of an RNR NAK: the responder refused
                            // the requests we had sent behind the one it could
                            // not take (rxe and our responder NAK them once).
                            // Nothing was lost, and the RNR rewind already
                            // resends from `p`.
                            return;
                        }
                        // A NAK that acknowledges new packets is progress. A NAK
                        // beyond a READ/atomic still in progress moves nothing but
                        // says nothing about the oldest request either. Only a NAK
                        // at our oldest unacknowledged PSN uses up a retry.
                        // Selective repeat: the responder repeats its NAK while a
                        // gap lasts (a resend may be in flight), so NAKs are not
                        // retries; the timer still bounds a dead peer.
                        if !acked && p == self.una && !self.cfg.selective_repeat {
                            if self.retry_left == 0 {
                                self.fail_front(WcStatus::RetryExceeded);
                                return;
                            }
                            self.retry_left -= 1;
                        }
                        self.cc_loss(false);
                        self.recover(now, p, Some(now));
                    }
                    Syndrome::Nak(NakCode::Other(SR_HOLE)) if self.cfg.selective_repeat => {
                        // A hole the responder names: resend just that packet
                        // (at once if a packet sent after its resend
                        // arrived: see `resend_overtaken`).
                        self.stats.naks_received += 1;
                        let trigger = aeth.msn & psn::PSN_MASK;
                        if psn::diff(p, self.una) >= 0 && !self.resend_overtaken(p, trigger) {
                            self.recover(now, p, Some(now));
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

    pub(super) fn read_response(&mut self, now: u64, pkt: &Packet) {
        let p = pkt.bth.psn;
        let op = pkt.bth.opcode;
        let pmtu = self.cfg.pmtu as usize;
        // Responses implicitly acknowledge everything before the read.
        let front_read = self.sq.iter().position(|w| w.done.is_none());
        if let Some(i) = front_read {
            let before = self.una;
            if !self.sq[i].needs_response() && !self.implicit_ack(psn::add(p, psn::PSN_MASK)) {
                self.stats.dropped += 1;
                return;
            }
            // Selective repeat: the response may be a copy, or one of a READ
            // behind the front one; what it acknowledged completes now.
            if self.cfg.selective_repeat && self.una != before {
                self.progress(now);
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
            return self.read_response_sr(now, pkt);
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

    /// Complete the oldest outstanding WQE with `status`, then go to ERROR.
    pub(super) fn fail_front(&mut self, status: WcStatus) {
        if let Some(w) = self.sq.iter_mut().find(|w| w.done.is_none()) {
            w.done = Some((status, None));
        }
        self.deliver_done();
        self.enter_error();
    }
}
