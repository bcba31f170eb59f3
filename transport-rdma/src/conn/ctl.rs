//! The control channel's messages (CREDIT, CLASSIFY, RESET, RESET_ACK,
//! NEED_RESET, CLOSE) and what they drive: replacing a QP that went to
//! ERROR. The peers exchange new QPNs and PSNs and how far each responder
//! executed; flushed requests that never ran are posted again, ones that
//! ran complete (IBTA 9.9.3: a remote access violation is a class C error,
//! both QPs go to ERROR).

use super::*;

impl Shared {
    /// Our QP is in ERROR: start replacing it (the client leads, the server asks).
    pub(super) fn begin_reset(&self, st: &mut State) {
        if st.resetting || self.is_dead.load(Ordering::Acquire) {
            return;
        }
        st.resetting = true;
        st.qp.to_error();
        debug!(gen = st.gen, "QP in error; replacing it");
        if self.server {
            let _ = self.ctl.send(Ctl::NeedReset { gen: st.gen });
            return;
        }
        match self.fresh_qp(st) {
            Ok((qp, psn)) => {
                let m = Ctl::Reset {
                    gen: st.gen + 1,
                    qpn: qp.qpn(),
                    psn,
                    epsn: st.qp.expected_psn(),
                };
                st.fresh = Some((qp, psn));
                let _ = self.ctl.send(m);
            }
            Err(e) => warn!(error = %e, "cannot create a replacement QP"),
        }
    }

    fn fresh_qp(&self, st: &mut State) -> Result<(Arc<dyn QueuePair>, u32)> {
        let qp = self.pd.create_qp(&self.cq, self.qp_opts)?;
        qp.attach_stats(self.stats.clone());
        let n = self.ours.credits.saturating_sub(st.buffered);
        post_receives(&*qp, &mut st.next_recv, n, self.ours.max_message)?;
        Ok((qp, random_psn()))
    }

    pub(super) fn on_ctl(&self, m: Ctl) {
        match m {
            Ctl::Close => {}
            Ctl::Credit { msgs, bytes } => {
                let mut c = self.credits.lock();
                c.msgs = c.msgs.saturating_add(msgs);
                c.bytes = c.bytes.saturating_add(bytes);
                drop(c);
                self.credit_notify.notify_waiters();
            }
            Ctl::Classify {
                id,
                rkey,
                addr,
                len,
                need,
            } => {
                let code = match self
                    .domain
                    .check_access(rkey, addr, len, Access::from_bits(need))
                {
                    Ok(()) => 0,
                    Err(e) => e.code(),
                };
                let _ = self.ctl.send(Ctl::Classified { id, code });
            }
            Ctl::Classified { id, code } => {
                let reply = self.st.lock().classifying.remove(&id);
                if let Some(r) = reply {
                    // Code 0: the peer allows it by now (a region registered in
                    // between); report the refusal as an unknown key.
                    let a = AccessError::from_code(code).unwrap_or(AccessError::UnknownKey);
                    let _ = r.send(Err(Error::RemoteAccess(a)));
                }
            }
            Ctl::NeedReset { gen } => {
                let mut st = self.st.lock();
                if gen == st.gen && !self.server {
                    if st.resetting {
                        return;
                    }
                    self.begin_reset(&mut st);
                }
            }
            Ctl::Reset {
                gen,
                qpn,
                psn,
                epsn,
            } => {
                self.drain_cq();
                let mut st = self.st.lock();
                if !self.server || gen != st.gen + 1 {
                    drop(st);
                    self.die(Error::Protocol(format!("unexpected QP reset {gen}")));
                    return;
                }
                st.resetting = true;
                st.qp.to_error();
                drop(st);
                self.drain_cq();
                let mut st = self.st.lock();
                let (qp, my_psn) = match self.fresh_qp(&mut st) {
                    Ok(x) => x,
                    Err(e) => {
                        drop(st);
                        self.die(e);
                        return;
                    }
                };
                let Some(mut st) = self.connect_fresh(st, &*qp, my_psn, qpn, psn) else {
                    return;
                };
                let _ = self.ctl.send(Ctl::ResetAck {
                    gen,
                    qpn: qp.qpn(),
                    psn: my_psn,
                    epsn: st.qp.expected_psn(),
                });
                self.finish_reset(&mut st, qp, my_psn, epsn, gen);
            }
            Ctl::ResetAck {
                gen,
                qpn,
                psn,
                epsn,
            } => {
                self.drain_cq();
                let mut st = self.st.lock();
                let Some((qp, my_psn)) = st.fresh.take() else {
                    drop(st);
                    self.die(Error::Protocol("QP reset answer without a request".into()));
                    return;
                };
                let Some(mut st) = self.connect_fresh(st, &*qp, my_psn, qpn, psn) else {
                    return;
                };
                self.finish_reset(&mut st, qp, my_psn, epsn, gen);
            }
        }
    }

    /// Connect a replacement QP to the peer's `qpn`/`psn` on the same path.
    /// On failure the state lock is released (`die` takes it) and the
    /// connection dies; `None` tells the caller to stop.
    fn connect_fresh<'a>(
        &'a self,
        st: parking_lot::MutexGuard<'a, State>,
        qp: &dyn QueuePair,
        my_psn: u32,
        qpn: u32,
        psn: u32,
    ) -> Option<parking_lot::MutexGuard<'a, State>> {
        let path = QpPeer {
            qpn,
            psn,
            ..self.path
        };
        match qp.connect(path, my_psn) {
            Ok(()) => Some(st),
            Err(e) => {
                drop(st);
                self.die(e);
                None
            }
        }
    }

    /// Switch to the new QP. Requests of the old one that the peer executed
    /// (below its responder's ePSN) complete; the rest are posted again, in
    /// order, followed by those parked during the reset.
    fn finish_reset(
        &self,
        st: &mut State,
        qp: Arc<dyn QueuePair>,
        sq_psn: u32,
        peer_epsn: u32,
        gen: u32,
    ) {
        let old = st.qp.qpn();
        let mut done = Vec::new();
        let ids: Vec<u64> = st.pending.keys().copied().collect();
        for id in &ids {
            let p = st.pending.get_mut(id).expect("present");
            if p.qpn != old {
                continue;
            }
            let last = (p.first_psn + p.npkts - 1) & 0xFF_FFFF;
            let executed = rdmx_roce_proto::psn::diff(last, peer_epsn) < 0;
            if !executed {
                continue;
            }
            match p.op {
                SendOp::Send { .. } | SendOp::Write { .. } => {
                    let mut p = st.pending.remove(id).expect("present");
                    let op = match p.op {
                        SendOp::Send { .. } => WcOpcode::Send,
                        _ => WcOpcode::Write,
                    };
                    if let Some(r) = p.reply.take() {
                        done.push((
                            r,
                            Ok(WorkCompletion {
                                wr_id: *id,
                                qpn: old,
                                status: WcStatus::Success,
                                opcode: op,
                                byte_len: p.op.len(),
                                data: Bytes::new(),
                                imm: None,
                                atomic_orig: None,
                            }),
                        ));
                    }
                }
                SendOp::Read { .. } => {} // re-read: idempotent
                SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. } => {
                    let mut p = st.pending.remove(id).expect("present");
                    if let Some(r) = p.reply.take() {
                        done.push((
                            r,
                            Err(Error::Indeterminate(
                                "the atomic ran at the peer but its answer was lost when the \
                                 queue pair was reset"
                                    .into(),
                            )),
                        ));
                    }
                }
            }
        }
        st.qp = qp;
        st.gen = gen;
        st.next_psn = sq_psn;
        st.resetting = false;
        // Re-post what is left in order, as one batch (one doorbell on a NIC).
        let mtu = self.path.mtu;
        let qpn = st.qp.qpn();
        let mut psn = st.next_psn;
        let mut wrs = Vec::with_capacity(st.pending.len());
        for (id, p) in st.pending.iter_mut() {
            p.qpn = qpn;
            p.first_psn = psn;
            p.npkts = p.op.psn_count(mtu);
            psn = (psn + p.npkts) & 0xFF_FFFF;
            wrs.push(SendWr {
                wr_id: *id,
                op: p.op.clone(),
            });
        }
        let mut lost_detached = None;
        match st.qp.post_send_batch(wrs) {
            Ok(()) => st.next_psn = psn,
            Err(e) => {
                for (_, mut p) in std::mem::take(&mut st.pending) {
                    match p.reply.take() {
                        Some(r) => done.push((r, Err(e.clone()))),
                        None => lost_detached = Some(e.clone()),
                    }
                }
            }
        }
        debug!(gen, qpn = st.qp.qpn(), "QP replaced");
        for (r, v) in done {
            let _ = r.send(v);
        }
        if let Some(e) = lost_detached {
            // A message nobody waits for could not be posted again: the
            // connection cannot keep its promise of order and delivery.
            self.die(e);
        }
    }
}
