//! Selective repeat, rdmx's negotiated extension (IRN, SIGCOMM'18): the
//! responder NAKs each gap, the requester resends only what is missing, and
//! READ responses are accepted out of order and re-asked by range. Losses
//! that leave nothing behind them (a last packet, a last ACK, a READ
//! request, a re-ask or its answer) are found by the responder's silence:
//! after a pause of two clean round trips the requester probes (IRN's
//! RTO_low, RFC 8985's tail loss probe) instead of waiting for the
//! retransmission timer.

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
            if psn::diff(p, una) < 0 || self.resent_at.get(&p).map(|r| r.at) != Some(at) {
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
            let first = self.resent_at.get(&p).map_or(now, |r| r.first);
            let next_new = self.next_new_psn();
            self.resent_at.insert(
                p,
                Resend {
                    at: now,
                    first,
                    next_new,
                },
            );
            return Some(pkt);
        }
        None
    }

    /// The PSN of the next packet sent for the first time.
    pub(super) fn next_new_psn(&self) -> u32 {
        match self.sq.get(self.tx_wqe) {
            None => self.next_psn,
            Some(w) => psn::add(w.first_psn, self.tx_pkt),
        }
    }

    /// Selective repeat: a selective NAK names `hole`, prompted by the
    /// arrival of `trigger`. If `hole` was resent and `trigger` left after
    /// that resend (sent for the first time then, or resent since), the
    /// resend should have arrived first on a path that keeps order: it was
    /// lost too. Resend it now, instead of a round trip and a half after
    /// the resend (with a full window queued on the path, milliseconds in
    /// which the window stays shut on the hole: 16 writes of 1 MiB at 5%
    /// loss in the simulator, 0.48-0.73 of the lossless goodput).
    /// Returns whether the resend was seen lost (it is then queued, once:
    /// a second NAK naming it before it leaves changes nothing).
    pub(super) fn resend_overtaken(&mut self, hole: u32, trigger: u32) -> bool {
        let Some(r) = self.resent_at.get(&hole).copied() else {
            return false;
        };
        let next = self.next_new_psn();
        let sent_new_after = psn::diff(trigger, r.next_new) >= 0 && psn::diff(trigger, next) < 0;
        let resent_after = self.resent_at.get(&trigger).is_some_and(|t| t.at > r.at);
        if trigger == hole || !(sent_new_after || resent_after) {
            return false;
        }
        if !self.retx.contains(&hole) {
            self.stats.resends_lost += 1;
            self.retx.push_back(hole);
        }
        true
    }

    /// Selective repeat: take a READ response wherever it falls in the front
    /// READ, and ask again for just the holes below the highest one received.
    pub(super) fn read_response_sr(&mut self, now: u64, pkt: &Packet) {
        let p = pkt.bth.psn;
        let pmtu = self.cfg.pmtu as usize;
        let Some(front) = self.sq.iter().position(|w| w.done.is_none()) else {
            return;
        };
        // The READ whose responses these are: the front one, or one behind
        // it whose requests went out while the front one still misses some
        // (with a window of several READ chunks, a loss in one READ must not
        // throw away the next one's responses: they would be asked again
        // and lost again behind the same hole).
        let Some(i) = (front..self.sq.len()).find(|&k| {
            let w = &self.sq[k];
            let d = psn::diff(p, w.first_psn);
            w.done.is_none()
                && matches!(w.wr, WorkRequest::Read { .. })
                && d >= 0
                && d < w.npkts as i32
        }) else {
            self.stats.dropped += 1;
            return;
        };
        let WorkRequest::Read { len, .. } = self.sq[i].wr else {
            unreachable!("found as a READ")
        };
        let w = &mut self.sq[i];
        let d = psn::diff(p, w.first_psn);
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
        // Any response of this READ, a copy included, shows the responder
        // still sending to us (see `recheck_read`).
        w.read_active_at = now;
        w.read_heard_at = now;
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
        let prev_hi = w.read_hi;
        w.read_hi = w.read_hi.max(idx + 1);
        let mut n = psn::diff(w.read_next, w.first_psn) as u32;
        let before = n;
        while n < w.npkts && w.read_got[n as usize] {
            n += 1;
        }
        w.read_next = psn::add(w.first_psn, n);
        let (count, npkts) = (w.read_count, w.npkts);
        // Responses come in order: the ones this one jumped over are lost.
        // Ask for them at once (each is asked again only if the responses
        // stop coming while it is still missing), in this READ or in one
        // behind the front: with several READs in flight, the next ones'
        // holes waited for the front one to finish, then for a pause, and
        // the window stayed shut meanwhile (16 READs of 1 MiB through a
        // veth at 1% loss: a tenth of the lossless rate).
        if count < npkts && idx > prev_hi.max(n) {
            self.ask_read_holes(i, now, prev_hi.max(n), idx, None);
        }
        if i != front {
            // Kept for when the READs ahead finish (completions stay in
            // order; `una` moves past it then, in `una_past_done`).
            if count == npkts {
                self.sq[i].done = Some((WcStatus::Success, None));
            }
            // What the response acknowledged implicitly ahead of the front
            // READ (`read_response`) completes now.
            self.deliver_done();
            return;
        }
        if count == npkts {
            let w = &mut self.sq[i];
            w.done = Some((WcStatus::Success, None));
            self.una = psn::add(w.last_psn(), 1);
            self.una_past_done(i + 1);
        } else {
            self.una = self.sq[i].read_next;
            self.tail_recheck_at = Some(now + self.pause_margin_ns());
        }
        if n != before || self.sq[i].done.is_some() {
            self.progress(now);
        }
    }

    /// After the work requests ahead finished: move `una` past those from
    /// `from` on that finished already (READs whose responses all came while
    /// it still missed some), and into the next READ as far as its responses
    /// arrived in order.
    pub(super) fn una_past_done(&mut self, from: usize) {
        for w in self.sq.iter().skip(from) {
            if w.done.is_some() {
                let past = psn::add(w.last_psn(), 1);
                if psn::diff(past, self.una) > 0 {
                    self.una = past;
                }
                continue;
            }
            if matches!(w.wr, WorkRequest::Read { .. }) && psn::diff(w.read_next, self.una) > 0 {
                self.una = w.read_next;
            }
            break;
        }
    }

    /// How long the responder may fall silent before what it has not
    /// answered is taken for lost: it answers back to back, so a pause of
    /// two clean round trips of the path plus 100 µs (a software peer's
    /// scheduling jitter: with 20 µs, a lossless soak over veth asked again
    /// 60% more often, for nothing) means the rest is not on its way. Before
    /// a round trip is measured, the retransmission timer's interval.
    pub(super) fn pause_margin_ns(&self) -> u64 {
        match self.min_rtt_ns {
            Some(r) => 2 * r + 100_000,
            None => self.rto_ns().unwrap_or(1_000_000),
        }
    }

    /// Selective repeat, at a timer tick: if the front READ's responses
    /// have paused for [`Qp::pause_margin_ns`] (none arrived, none was asked
    /// for), ask again for the holes below the highest response received
    /// and for the last response of each chunk above it (see below), those
    /// not asked for within that margin.
    /// This repairs a lost last response, a lost re-ask and a lost answer to
    /// one in about a round trip and a half, where the retransmission timer
    /// (a millisecond at least on the soft device) would wait far longer.
    pub(super) fn recheck_read(&mut self, now: u64) {
        let Some(at) = self.tail_recheck_at else {
            return;
        };
        if now < at {
            return;
        }
        self.tail_recheck_at = None;
        if !self.cfg.selective_repeat || self.state != QpState::Rts {
            return;
        }
        let Some(i) = self.sq.iter().position(|w| w.done.is_none()) else {
            return;
        };
        let w = &self.sq[i];
        if !matches!(w.wr, WorkRequest::Read { .. }) || w.sent_upto == 0 {
            return;
        }
        let margin = self.pause_margin_ns() << self.unanswered_probes.min(10);
        if now.saturating_sub(w.read_active_at) >= margin {
            let from = psn::diff(w.read_next, w.first_psn).max(0) as u32;
            let hi = w.read_hi.max(from);
            let to = w.sent_upto.min(w.npkts);
            // The holes below the highest response: lost for sure.
            let mut asked = self.ask_read_holes(i, now, from, hi, Some(margin));
            // Above it, one response per chunk asked for (a probe): the last
            // of a chunk that has begun to arrive (the responder answers in
            // order, so if the rest was merely slow it comes first and this
            // costs one packet; if it was lost, this one's arrival shows
            // the gap, asked for at once), the first of a chunk with nothing
            // yet (its request may be lost: a one-packet READ at the PSN the
            // responder expects, which it executes in order).
            let c = self.cfg.max_unacked.max(1);
            let mut k = hi;
            while k < to {
                let start = k / c * c;
                let end = (start + c).min(to);
                let w = &self.sq[i];
                let begun = w
                    .read_got
                    .get(start as usize..end as usize)
                    .is_some_and(|g| g.contains(&true));
                let probe = if begun { end - 1 } else { start.max(from) };
                asked += self.ask_read_holes(i, now, probe, probe + 1, Some(margin));
                k = end;
            }
            if asked > 0 {
                self.sq[i].read_active_at = now;
                self.unanswered_probes += 1;
            }
        }
        let w = &self.sq[i];
        if w.done.is_none() {
            self.tail_recheck_at = Some(w.read_active_at.max(now.saturating_sub(margin)) + margin);
        }
    }

    /// Selective repeat, at a timer tick: the oldest unfinished request is a
    /// SEND, WRITE or atomic (a duplicate atomic is answered from the
    /// responder's saved result, never run twice), no new packet may go (all sent, or the window is
    /// full), and neither an answer came nor a packet left for
    /// [`Qp::pause_margin_ns`] (or half the recent round trip, whichever is
    /// longer): the last packets, a resend or their ACKs were lost, and
    /// nothing later will make the responder say so. Send the oldest
    /// unacknowledged packet and the last one sent again (a tail loss
    /// probe, RFC 8985 §7.3): the responder acknowledges them, or NAKs the
    /// holes below the last, in about a round trip, where the
    /// retransmission timer (a millisecond at least on the soft device)
    /// would wait far longer. Unanswered probes back off (doubling); the
    /// timer still decides when the peer is dead.
    pub(super) fn recheck_write_tail(&mut self, now: u64) {
        if !self.cfg.selective_repeat || self.state != QpState::Rts {
            return;
        }
        let Some(front) = self.sq.iter().find(|w| w.done.is_none()) else {
            return;
        };
        if matches!(front.wr, WorkRequest::Read { .. }) {
            return; // `recheck_read`
        }
        // The next new packet, if the window lets it go.
        let next = self.next_new_psn();
        if self.tx_wqe < self.sq.len() && psn::diff(next, self.una) < self.cfg.max_unacked as i32 {
            return; // new packets still go: they make the responder speak
        }
        // ACKs come for every few packets, and packets sent may still wait
        // in queues on the way: at least the round trip seen lately.
        let margin = self.pause_margin_ns().max(self.srtt_ns.unwrap_or(0) / 2)
            << self.unanswered_probes.min(10);
        let quiet_since = self.answered_at.max(self.sent_at);
        if now.saturating_sub(quiet_since) >= margin {
            // The oldest unacknowledged packet (its resend may have been
            // lost too) and the last one sent (the responder NAKs every hole
            // below it).
            let last = psn::add(next, psn::PSN_MASK);
            for p in [self.una, last] {
                // Not one resent within the margin: that resend is on its way.
                let recent = self
                    .resent_at
                    .get(&p)
                    .is_some_and(|r| now.saturating_sub(r.at) < margin);
                if !recent && !self.retx.contains(&p) {
                    self.retx.push_back(p);
                }
            }
            self.stats.tail_probes += 1;
            self.unanswered_probes += 1;
            self.sent_at = now;
        }
        let next = self.answered_at.max(self.sent_at) + margin;
        self.tail_recheck_at = Some(match self.tail_recheck_at {
            Some(t) if t > now => t.min(next),
            _ => next,
        });
    }

    /// Queue READ requests for the missing responses of WQE `wi` in packet
    /// indexes `[from, to)`, one per run of missing ones inside one chunk,
    /// skipping those asked for within `min_age` (with `None`, those asked
    /// at all). Returns the number of packets asked for.
    pub(super) fn ask_read_holes(
        &mut self,
        wi: usize,
        now: u64,
        from: u32,
        to: u32,
        min_age: Option<u64>,
    ) -> u32 {
        let c = self.cfg.max_unacked.max(1);
        let w = &mut self.sq[wi];
        let to = to.min(w.npkts);
        if w.read_got.is_empty() {
            w.read_got = vec![false; w.npkts as usize];
        }
        if w.read_asked.is_empty() {
            w.read_asked = vec![0; w.npkts as usize];
        }
        let due = |asked: u64| match min_age {
            _ if asked == 0 => true,
            Some(age) => now.saturating_sub(asked) >= age,
            None => false,
        };
        let mut runs = Vec::new();
        let mut asked = 0;
        let mut idx = from;
        while idx < to {
            let k = idx as usize;
            if w.read_got[k] || !due(w.read_asked[k]) {
                idx += 1;
                continue;
            }
            let chunk_end = ((idx / c + 1) * c).min(to);
            let mut e = idx;
            while e < chunk_end && !w.read_got[e as usize] && due(w.read_asked[e as usize]) {
                w.read_asked[e as usize] = now;
                e += 1;
            }
            asked += e - idx;
            runs.push((w.first_psn, idx, e));
            idx = e;
        }
        for r in runs {
            if !self.read_retx.contains(&r) {
                self.read_retx.push_back(r);
            }
        }
        asked
    }

    /// Selective repeat: queue READ requests for the missing responses of the
    /// front READ (if `psn` falls in it) below packet index `upto`, one per
    /// missing run, each inside its original chunk; a chunk with nothing
    /// received is asked for whole (its request itself may have been lost).
    /// Returns false if the front WQE is not such a READ.
    pub(super) fn ask_missing_responses(&mut self, now: u64, psn: u32, upto: u32) -> bool {
        let c = self.cfg.max_unacked.max(1);
        let margin = self.pause_margin_ns();
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
        if w.read_asked.is_empty() {
            w.read_asked = vec![0; w.npkts as usize];
        }
        w.read_active_at = now;
        let end = upto.min(w.sent_upto).min(w.npkts);
        let mut idx = psn::diff(w.read_next, w.first_psn).max(0) as u32;
        let mut runs = Vec::new();
        // What was asked for within the margin is on its way: a NAK the
        // responder repeats, or one that crossed the answer, asks no more.
        let recent = |asked: u64| asked != 0 && now.saturating_sub(asked) < margin;
        while idx < end {
            if w.read_got[idx as usize] || recent(w.read_asked[idx as usize]) {
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
                while e < chunk_end.min(end)
                    && !w.read_got[e as usize]
                    && !recent(w.read_asked[e as usize])
                {
                    e += 1;
                }
                (idx, e)
            };
            runs.push((w.first_psn, s, e));
            for a in &mut w.read_asked[s as usize..e as usize] {
                *a = now;
            }
            idx = e.max(idx + 1);
            if runs.len() == 32 {
                break;
            }
        }
        if !runs.is_empty() {
            self.tail_recheck_at = Some(now + self.pause_margin_ns());
        }
        for r in runs {
            if !self.read_retx.contains(&r) {
                self.read_retx.push_back(r);
            }
        }
        true
    }

    /// PSNs a packet kept out of order occupies: one, or a READ request's
    /// response packets.
    pub(super) fn kept_span(&self, p: &Packet) -> u32 {
        match (p.bth.opcode, p.reth) {
            (Opcode::RDMA_READ_REQUEST, Some(r)) => u64::from(r.dma_len)
                .div_ceil(u64::from(self.cfg.pmtu))
                .max(1) as u32,
            _ => 1,
        }
    }

    /// Selective repeat, a packet at `psn` kept while a gap is open: name
    /// with the rdmx selective NAK each PSN between the highest one kept
    /// before it and `psn` (up to `max_holes`): holes that opened after the
    /// first NAK.
    pub(super) fn nak_new_holes(&mut self, psn: u32, max_holes: u32) {
        let from = self.ooo_end;
        let n = psn::diff(psn, from);
        if n <= 0 || psn::diff(from, self.epsn) <= 0 {
            return;
        }
        for k in 0..(n as u32).min(max_holes) {
            self.hole_nak(psn::add(from, k), psn);
        }
    }

    /// NAK the first missing PSN (standard sequence-error NAK, which also
    /// acknowledges everything before it). With selective repeat, also name
    /// further missing PSNs (up to `max_holes`) below the highest one kept, with the rdmx
    /// selective NAK (syndrome 0x60 | SR_HOLE, a code IBTA reserves; only
    /// sent to peers that negotiated selective repeat), so one round trip
    /// repairs every hole, as IRN's NACKs do. The first missing PSN is named
    /// by a selective NAK too, which carries `trigger` (the PSN whose
    /// arrival prompted this): that tells the requester whether a resend of
    /// it was overtaken.
    pub(super) fn nak_gaps(&mut self, max_holes: usize, trigger: u32) {
        self.send_nak(NakCode::PsnSequenceError, false);
        if !self.cfg.selective_repeat {
            return;
        }
        let epsn = self.epsn;
        // Kept packets in PSN order, each with the PSNs it occupies (a READ
        // request one per response packet).
        let mut kept: Vec<(i32, u32)> = self
            .ooo
            .values()
            .map(|k| (psn::diff(k.pkt.bth.psn, epsn), self.kept_span(&k.pkt)))
            .collect();
        kept.sort_unstable();
        let mut next = 0i32;
        let mut holes = Vec::new();
        for (d, span) in kept {
            while next < d && holes.len() < max_holes {
                holes.push(psn::add(epsn, next as u32));
                next += 1;
            }
            next = next.max(d + span as i32);
        }
        for p in holes {
            self.hole_nak(p, trigger);
        }
    }
}
