//! The responder: executes incoming requests against memory in PSN order,
//! ACKs, NAKs (sequence, RNR, access, invalid), READ/atomic responses and
//! duplicate handling (rxe's resp.c, IBTA 9.7.4 and 9.9).

use super::*;
use crate::packet::Deferred;
use std::collections::HashSet;

impl Qp {
    /// The rdmx selective NAK for the missing `hole`, prompted by the arrival
    /// of `trigger` (carried in the MSN field, see [`SR_HOLE`]).
    pub(super) fn hole_nak(&mut self, hole: u32, trigger: u32) {
        self.stats.naks_sent += 1;
        let mut nak = self.ack_packet(hole, 0x60 | SR_HOLE);
        if let Some(a) = nak.aeth.as_mut() {
            a.msn = trigger & psn::PSN_MASK;
        }
        self.resp_tx.push_back(nak);
    }

    pub(super) fn ack_packet(&self, psn: u32, syndrome: u8) -> Packet {
        let mut p = Packet::new(Bth::new(Opcode::ACKNOWLEDGE, self.remote_qpn, psn));
        p.aeth = Some(Aeth {
            syndrome,
            msn: self.msn & psn::PSN_MASK,
        });
        p
    }

    /// Notification point: answer CE marks with a CNP to the sender, at most one
    /// per `cnp_interval_ns` (rocev2-reference §10, §11: N = 50 µs).
    pub(super) fn notify_congestion(&mut self, now: u64) {
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

    pub(super) fn send_nak(&mut self, code: NakCode, fatal: bool) {
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
    pub(super) fn send_rnr_nak(&mut self, psn: u32) {
        self.stats.rnr_naks_sent += 1;
        let rnr = self.ack_packet(psn, 0x20 | (self.cfg.min_rnr_timer & 0x1F));
        self.resp_tx.push_back(rnr);
    }

    pub(super) fn responder(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        let d = psn::diff(pkt.bth.psn, self.epsn);
        if d > 0 {
            // A gap: NAK once until the expected packet arrives (§5, §6). With
            // selective repeat the packet is kept (within the requester's
            // window) and executed in order once the gap fills.
            if self.cfg.selective_repeat && d < 2 * self.cfg.max_unacked.max(1) as i32 {
                let had_kept = !self.ooo.is_empty();
                let end = psn::add(pkt.bth.psn, self.kept_span(pkt));
                // A copy of one kept already (its resend crossed the NAK):
                // the first one stands.
                if !self.ooo.contains_key(&pkt.bth.psn) {
                    // A hole filled behind the first one (a resend, sent
                    // after the first hole's own resend, if any): name the
                    // first hole again, with this packet as the trigger.
                    if self.nak_sent && had_kept && psn::diff(pkt.bth.psn, self.ooo_end) < 0 {
                        self.hole_nak(self.epsn, pkt.bth.psn);
                    }
                    let placed = self.place_ahead(pkt, d as u32, mem);
                    // Kept with a payload of its own, if any: a payload
                    // sliced from a receive buffer (Packet::decode_shared)
                    // would hold the whole buffer for as long as the gap
                    // lasts.
                    let mut kept = pkt.clone();
                    kept.payload = match placed {
                        Some(_) => Bytes::new(),
                        None => Bytes::copy_from_slice(&pkt.payload),
                    };
                    self.ooo.insert(pkt.bth.psn, Kept { pkt: kept, placed });
                    self.stats.out_of_order_kept += 1;
                }
                // A hole above those already named (the requester's burst
                // goes on after the first NAK): name it now, so that its
                // resend can go during the burst instead of one more round
                // trip after the first hole fills, as IRN NACKs each
                // out-of-order arrival.
                if self.nak_sent && had_kept {
                    self.nak_new_holes(pkt.bth.psn, 32);
                }
                if !had_kept || psn::diff(end, self.ooo_end) > 0 {
                    self.ooo_end = end;
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
                self.nak_gaps(32, pkt.bth.psn);
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
            match next.placed {
                Some(len) => self.write_packet(&next.pkt, len, true, mem),
                None => self.execute(&next.pkt, mem),
            }
            ran = true;
        }
        // Drop anything the executed requests overtook (a READ covers many PSNs).
        let epsn = self.epsn;
        self.ooo.retain(|&p, _| psn::diff(p, epsn) > 0);
        if ran {
            self.pending_ack = Some(self.ack_psn);
        }
        if !self.ooo.is_empty() && self.state != QpState::Error {
            // Another gap: say where at once, and name the next few holes
            // again in case their resends were lost.
            self.nak_sent = true;
            self.since_nak = 0;
            self.nak_gaps(4, pkt.bth.psn);
        }
    }

    /// Execute the request at ePSN.
    pub(super) fn execute(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
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
    pub(super) fn accepted(&mut self, pkt: &Packet, message_done: bool) {
        self.epsn = psn::add(self.epsn, 1);
        self.since_ack = self.since_ack.saturating_add(1);
        self.ack_psn = pkt.bth.psn;
        if message_done {
            self.msn = psn::add(self.msn, 1);
        }
        if pkt.bth.ack_req {
            self.pending_ack = Some(pkt.bth.psn);
        }
    }

    pub(super) fn recv_send(&mut self, pkt: &Packet) {
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
            // A SEND_ONLY's one packet is all of it; a longer message gets
            // the room the last one needed, never more than the receive
            // can take (a peer cannot make this end reserve past that).
            let room = match op {
                Opcode::SEND_FIRST => self.last_send_len.max(2 * pkt.payload.len()),
                _ => pkt.payload.len(),
            };
            let buf = BytesMut::with_capacity(room.min(wqe.max_len));
            self.open = Some(OpenMessage::Send { wqe, buf });
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
            // A LAST: the message took several packets.
            if !starts {
                self.last_send_len = buf.len();
            }
            let mut c = Completion::new(wqe.wr_id, WcStatus::Success, WcOpcode::Recv);
            c.byte_len = buf.len() as u64;
            c.data = buf.freeze();
            c.imm = pkt.imm;
            c.invalidate = pkt.ieth;
            self.completions.push_back(c);
            self.delivered = true;
        }
        self.accepted(pkt, ends);
    }

    /// FIRST/MIDDLE carry exactly one PMTU, LAST 1..PMTU, ONLY 0..PMTU (§8).
    pub(super) fn length_ok(&self, op: Opcode, len: usize) -> bool {
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

    /// Selective repeat: a WRITE packet `d` PSNs ahead of ePSN that belongs to
    /// the open WRITE message (its first packet executed: R_Key, bounds and
    /// rights are checked for the whole range) goes to memory on arrival, as
    /// IRN places packets that arrive out of order (SIGCOMM'18 §4.2); only
    /// its header waits for the gap. A loss then costs no copy of the
    /// packets behind it (at 1% loss with a full window, nine in ten arrive
    /// behind a hole). Placed only where a valid message has the packet: a
    /// MIDDLE of a full MTU that ends before the message does, or the LAST
    /// (without immediate: that one needs a receive, taken in order) that
    /// ends it; the packets between are then MIDDLEs of a full MTU each.
    /// Never a later message's packets: one still missing in between may
    /// write the same bytes, and in order the later one wins (the
    /// proptest's model caught that). Returns the length placed, or
    /// `None`: the packet is kept whole and executed in order, where
    /// whatever is wrong with it is answered.
    pub(super) fn place_ahead(
        &mut self,
        pkt: &Packet,
        d: u32,
        mem: &mut dyn Memory,
    ) -> Option<usize> {
        let Some(OpenMessage::Write { reth, offset }) = &self.open else {
            return None;
        };
        let pmtu = u64::from(self.cfg.pmtu);
        let len = pkt.payload.len() as u64;
        let off = offset + u64::from(d) * pmtu;
        let end = off + len;
        let total = u64::from(reth.dma_len);
        let fits = match pkt.bth.opcode {
            Opcode::RDMA_WRITE_MIDDLE => len == pmtu && end < total,
            Opcode::RDMA_WRITE_LAST => (1..=pmtu).contains(&len) && end == total,
            _ => false,
        };
        if !fits {
            return None;
        }
        mem.write(reth.rkey, reth.va + off, &pkt.payload).ok()?;
        self.stats.placed_ahead += 1;
        Some(len as usize)
    }

    pub(super) fn recv_write(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        self.write_packet(pkt, pkt.payload.len(), false, mem);
    }

    /// Execute a WRITE packet of `len` payload bytes, written to memory here
    /// unless `placed` on arrival already.
    pub(super) fn write_packet(
        &mut self,
        pkt: &Packet,
        len: usize,
        placed: bool,
        mem: &mut dyn Memory,
    ) {
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
        if !self.length_ok(op, len) {
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
        let end = off + len as u64;
        if end > u64::from(reth.dma_len) || (ends && end != u64::from(reth.dma_len)) {
            self.open = None;
            return self.send_nak(NakCode::InvalidRequest, true);
        }
        if !placed && !pkt.payload.is_empty() {
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

    pub(super) fn remember(&mut self, r: Resource) {
        self.resources.push_back(r);
        while self.resources.len() > self.cfg.max_rd_atomic.max(1) as usize * 2 {
            self.resources.pop_front();
        }
    }

    /// Queue the responses to a READ of `reth` whose request had PSN `first`:
    /// FIRST/MIDDLE/LAST or ONLY (rocev2-reference §3, §8), data re-read from
    /// memory each time (a duplicate READ is re-executed, §6).
    pub(super) fn read_responses(
        &mut self,
        first: u32,
        reth: Reth,
        mem: &mut dyn Memory,
    ) -> Result<(), MemError> {
        let pmtu = u64::from(self.cfg.pmtu);
        let len = u64::from(reth.dma_len);
        let npkts = len.div_ceil(pmtu).max(1) as u32;
        // One lookup of the whole range, not one per packet: a source the
        // transmitter reads each response's slice from as it leaves (no
        // copy here), or else one load that each response slices.
        let (source, all) = if len == 0 {
            (None, Bytes::new())
        } else {
            match mem.read_source(reth.rkey, reth.va, len)? {
                Some(src) => (Some(src), Bytes::new()),
                None => (None, mem.read(reth.rkey, reth.va, len)?),
            }
        };
        for i in 0..npkts {
            let off = u64::from(i) * pmtu;
            let n = pmtu.min(len - off.min(len));
            let range = off as usize..(off + n) as usize;
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
            match &source {
                Some(src) => {
                    p.deferred = Some(Deferred {
                        source: src.clone(),
                        range,
                    })
                }
                None => p.payload = all.slice(range),
            }
            p.finish();
            self.resp_tx.push_back(p);
        }
        Ok(())
    }

    pub(super) fn recv_read(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
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

    pub(super) fn recv_atomic(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
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

    pub(super) fn atomic_ack(&mut self, psn: u32, orig: u64) {
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
    pub(super) fn duplicate(&mut self, pkt: &Packet, mem: &mut dyn Memory) {
        let p = pkt.bth.psn;
        match pkt.bth.opcode {
            Opcode::RDMA_READ_REQUEST => {
                let Some(reth) = pkt.reth else { return };
                // Replay only a READ we executed, asked again whole or as the
                // tail that a resuming requester still misses: same R_Key,
                // range inside the original, VA consistent with the PSN (§6).
                let pmtu = u64::from(self.cfg.pmtu);
                let sr = self.cfg.selective_repeat;
                let served = self.resources.iter().rev().find_map(|r| match *r {
                    Resource::Read {
                        first_psn,
                        npkts,
                        reth: orig,
                    } => {
                        let k = psn::diff(p, first_psn);
                        let orig_end = orig.va + u64::from(orig.dma_len);
                        // A peer names any VA and length: one past the end
                        // of the address space is no range we executed.
                        let end = reth.va.checked_add(u64::from(reth.dma_len))?;
                        if k < 0
                            || k >= npkts as i32
                            || orig.rkey != reth.rkey
                            || reth.va != orig.va + k as u64 * pmtu
                        {
                            return None;
                        }
                        if end == orig_end || (sr && end <= orig_end) {
                            return Some(reth.dma_len);
                        }
                        // Selective repeat asks again for just the responses
                        // it misses, as one range over PSNs that this side
                        // may have executed as several READs (the requester's
                        // one-packet probe of a chunk whose request was lost
                        // runs as a READ of its own, and the rest of the
                        // chunk follows as another): serve the part this
                        // READ covers; the requester asks again for the rest,
                        // at a PSN where the next READ (or ePSN) begins.
                        // Dropping it instead left the requester asking for
                        // the same range until its retries ran out.
                        sr.then(|| (orig_end - reth.va) as u32)
                    }
                    Resource::Atomic { .. } => None,
                });
                let Some(dma_len) = served else {
                    self.stats.dropped += 1;
                    return;
                };
                let reth = Reth { dma_len, ..reth };
                let n = u64::from(reth.dma_len).div_ceil(pmtu).max(1) as i32;
                let in_range = |q: &Packet| {
                    let d = psn::diff(q.bth.psn, p);
                    q.bth.opcode.is_read_response() && d >= 0 && d < n
                };
                // Responses of the range still queued from an earlier pass.
                let mut queued = HashSet::new();
                if sr {
                    // Selective repeat names the responses it misses and
                    // takes them in any order: those still queued go once.
                    queued.extend(
                        self.resp_tx
                            .iter()
                            .filter(|q| in_range(q))
                            .map(|q| q.bth.psn),
                    );
                } else {
                    // A go-back-N requester starts again at `p`: it lost a
                    // response and takes the rest in order only. Responses
                    // of an earlier pass still queued would reach it behind
                    // the gap and cost one more retry each (a storm of
                    // re-served copies against a slow peer): restart the
                    // stream instead, as rxe's responder does (resp.c
                    // `duplicate_request` moves the replayed resource's
                    // cursor to the PSN asked for).
                    self.resp_tx.retain(|q| !in_range(q));
                }
                let at = self.resp_tx.len();
                if self.read_responses(p, reth, mem).is_err() {
                    return self.send_nak(NakCode::RemoteAccessError, true);
                }
                if sr {
                    // The requester waits on exactly these: with several
                    // READs in flight, behind the responses still queued (a
                    // READ or two of new ones, milliseconds on a slow path)
                    // they came so late that it asked again and again, and
                    // its window stayed shut behind the hole (16 READs of
                    // 1 MiB through a veth at 1% loss: a tenth of the
                    // lossless rate). They go ahead of every queued READ
                    // response (IRN resends first too); ACKs and atomic
                    // responses keep their order.
                    let fresh: Vec<Packet> = self
                        .resp_tx
                        .drain(at..)
                        .filter(|q| !queued.contains(&q.bth.psn))
                        .collect();
                    let front = self
                        .resp_tx
                        .iter()
                        .position(|q| q.bth.opcode.is_read_response())
                        .unwrap_or(self.resp_tx.len());
                    // One by one: `VecDeque::insert` moves the shorter side,
                    // here the few packets ahead of `front` (splitting the
                    // queue off and appending it back moved the whole
                    // window of queued responses per re-ask: 5% loss, 16
                    // READs of 1 MiB through a veth, a quarter slower).
                    for (k, q) in fresh.into_iter().enumerate() {
                        self.resp_tx.insert(front + k, q);
                    }
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
                // SEND/WRITE: not re-executed; ACK again, naming the last
                // SEND/WRITE executed, never a READ's or atomic's PSN
                // (IBTA 9.7.5.1.2, C9-105; rxe resp.c `duplicate_request`
                // acks `ack_psn - 1`, which READs do not move).
                self.pending_ack = Some(self.ack_psn);
            }
        }
    }
}
