//! Selective repeat, rdmx's negotiated extension (IRN, SIGCOMM'18): the
//! responder NAKs each gap, the requester resends only what is missing, and
//! READ responses are accepted out of order and re-asked by range.

use super::*;

impl Qp {
    /// Selective repeat, at a timer tick: resent packets whose resend should
    /// have shown by now (a round trip and a half) and that are still
    /// unacknowledged and not resent since were lost again: queue them to go
    /// once more. Entries go either way, so [`Qp::poll_timeout`] never
    /// reports a time already past.
    pub(super) fn promote_due_resends(&mut self, now: u64) {
        let una = self.una;
        let mut i = 0;
        while i < self.retx_due.len() {
            let (p, at, due) = self.retx_due[i];
            if psn::diff(p, una) < 0 || self.resent_at.get(&p).map(|r| r.0) != Some(at) {
                self.retx_due.swap_remove(i);
            } else if due <= now {
                self.retx_due.swap_remove(i);
                if !self.retx.contains(&p) {
                    self.retx.push_back(p);
                }
            } else {
                i += 1;
            }
        }
    }

    /// Selective repeat: the next single packet to resend, if any.
    pub(super) fn selective_resend(&mut self, now: u64) -> Option<Packet> {
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
            let first = self.resent_at.get(&p).map_or(now, |r| r.1);
            self.resent_at.insert(p, (now, first));
            return Some(pkt);
        }
        None
    }

    /// Selective repeat: take a READ response wherever it falls in the front
    /// READ, and ask again for just the holes below the highest one received.
    pub(super) fn read_response_sr(&mut self, now: u64, pkt: &Packet, len: u32) {
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
    pub(super) fn ask_missing_responses(&mut self, psn: u32, upto: u32) -> bool {
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

    /// NAK the first missing PSN (standard sequence-error NAK, which also
    /// acknowledges everything before it). With selective repeat, also name
    /// further missing PSNs (up to `max_holes`) below the highest one kept, with the rdmx
    /// selective NAK (syndrome 0x60 | SR_HOLE, a code IBTA reserves; only
    /// sent to peers that negotiated selective repeat), so one round trip
    /// repairs every hole, as IRN's NACKs do.
    pub(super) fn nak_gaps(&mut self, max_holes: usize) {
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
}
