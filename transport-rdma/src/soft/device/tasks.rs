//! The device's two tasks, on the application's runtime: the receive task
//! of each receive queue (GRO/recvmmsg batches, ICRC checked, the engine
//! fed, the QPs it touched pumped, their ACKs held for the applications'
//! answers), and the timer task (each QP's ACK timeout, RNR wait, pacing and
//! probes, after taking what waits in the receive sockets).

use super::*;

use smallvec::SmallVec;

/// The QPs one receive batch reached, or whose ACK a pass held: few (one
/// per connection the batch had packets for), so on the stack.
pub(super) type QpList = SmallVec<[Arc<SoftQp>; 4]>;

pub(super) const RX_BATCH: usize = 32;
const RX_BUF: usize = 64 * 1024;

/// A receive slot's buffer, already in `bytes`' reference-counted form (a
/// split puts it there). Each batch's datagrams are slices of it: a buffer
/// still in its first, plain form allocates that shared state at a batch's
/// first slice, and frees it again when the slot takes the buffer back
/// (2.2 allocations per 8 B send round trip). In the shared form from the
/// start, the slot gets it back in that form, and slicing allocates nothing.
pub(super) fn rx_slot() -> BytesMut {
    let mut b = BytesMut::zeroed(RX_BUF);
    drop(b.split_off(RX_BUF));
    b
}

/// Receive loop: GRO/recvmmsg batches → verify ICRC → engine → pump touched QPs.
pub(super) async fn rx_loop(d: Arc<Device>, queue: usize) {
    let rx = &d.rx[queue];
    loop {
        let Ok(mut ready) = rx.sock.readable().await else {
            return;
        };
        loop {
            // The queue's lock is let go before the QPs are pumped: a QP
            // whose pump sends a long burst (a READ's responses, milliseconds
            // through a veth) then takes what arrives meanwhile from this
            // queue between its sends (`listen_while_sending`), instead of
            // leaving it unread until the burst ends (the peer's re-asks of
            // lost responses waited behind whole READs: 5% loss, 16 READs of
            // 1 MiB, a twentieth of the lossless rate).
            match receive_pass(&d, rx, Taker::Task) {
                Ok((n, held)) => {
                    // After every batch, not once the socket is empty: a
                    // stream of full batches would hold the ACKs for as long
                    // as it lasts.
                    release_held_acks(&d, held).await;
                    // A short batch emptied the socket. Readiness is cleared
                    // only if no datagram was reported since `readable`
                    // returned (tokio compares the event's tick), so none
                    // waits unseen.
                    if n < RX_BATCH {
                        ready.clear_ready();
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    ready.clear_ready();
                    break;
                }
                Err(e) => {
                    debug!("soft RoCE receive: {e}");
                    break;
                }
            }
        }
    }
}

/// The ACKs this receive task held for the applications' answers leave
/// once its scheduler tick is over. An application woken by a delivery runs
/// on this thread right after this task, and what it sends back carries the
/// ACK behind it in the same GSO send (one `sendmsg`, not two, and one
/// wake-up of the peer's receiver); one that has not answered by then gets
/// its ACK alone. IBTA lets a responder coalesce ACKs (9.7.5.1.3); the wait
/// is one tick, far below any ACK timeout.
///
/// The tick is over when the worker thread runs out of tasks: on a runtime
/// that calls [`on_thread_park`] (`Builder::on_thread_park`) the held ACKs
/// wait in a list of the thread's, released there (or when this task comes
/// back to the thread with more, if the thread never ran out of work). On a
/// current-thread runtime this task yields once and releases them when it
/// runs again. On other runtimes they leave at once: there the yield costs
/// wake-ups (tokio puts the yielded task next to what the worker's I/O poll
/// woke, and hands one of the two to an idle worker; 8 B send round trips
/// took 47-54 µs instead of 35-39 on two workers).
async fn release_held_acks(d: &Device, held: QpList) {
    if held.is_empty() {
        return;
    }
    if PARK_HOOK.with(|h| h.get()) {
        let earlier = PARKED_HELD.with(|h| {
            let mut h = h.borrow_mut();
            let earlier: QpList = h
                .drain(..)
                .filter(|q| !held.iter().any(|n| Arc::ptr_eq(n, q)))
                .collect();
            h.extend(held);
            earlier
        });
        release(&earlier);
        return;
    }
    if d.handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread {
        tokio::task::yield_now().await;
    }
    release(&held);
}

/// Send the ACKs of `held` that still wait (their answer did not come).
fn release(held: &[Arc<SoftQp>]) {
    for qp in held {
        if qp.inner.lock().qp.ack_held() {
            qp.dev
                .counters
                .acks_released
                .fetch_add(1, Ordering::Relaxed);
            qp.pump_inline();
        }
    }
}

thread_local! {
    /// ACKs receive tasks on this thread hold until it parks.
    static PARKED_HELD: std::cell::RefCell<Vec<Arc<SoftQp>>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// This worker thread calls [`on_thread_park`] when it runs out of tasks.
    static PARK_HOOK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// For `tokio::runtime::Builder::on_thread_park`: the soft RoCE receive
/// tasks on this worker hold the ACKs of what they delivered until the
/// worker runs out of tasks, so the answers the applications send carry
/// them (see `SoftConfig::ack_hold`); this sends those still waiting.
/// Without it, on a runtime of several workers the ACKs are not held (a
/// yield in their place costs wake-ups); the `rdmx` command line installs it.
pub fn on_thread_park() {
    PARK_HOOK.with(|h| h.set(true));
    // Drained, not taken: the list keeps its room for the next tick.
    let held: QpList = PARKED_HELD.with(|h| h.borrow_mut().drain(..).collect());
    release(&held);
}

/// One receive call on `rx` (up to [`RX_BATCH`] datagrams, GRO runs split),
/// each datagram verified and given to its QP. Returns how many receive
/// slots were filled and the QPs the datagrams went to, for
/// [`pump_touched`] (once the caller lets the queue go, or at once).
pub(super) fn receive_batch(
    d: &Arc<Device>,
    rx: &RxQueue,
    w: &mut RxWork,
) -> io::Result<(usize, QpList)> {
    let RxWork {
        bufs,
        metas,
        solver,
    } = w;
    let n = {
        // One slice per receive slot, on the stack (the queue has exactly
        // RX_BATCH slots).
        let mut slots = bufs.iter_mut();
        let mut iovs: [IoSliceMut<'_>; RX_BATCH] = std::array::from_fn(|_| {
            IoSliceMut::new(&mut slots.next().expect("RX_BATCH receive slots")[..])
        });
        rx.state.recv(rx.sock.get_ref().into(), &mut iovs, metas)?
    };
    let now = d.now();
    let mut touched = QpList::new();
    for (meta, slot) in metas.iter().zip(bufs.iter_mut()).take(n) {
        // The engine gets each datagram as a slice of the buffer (no copy
        // before it applies the payload), then the buffer goes back to its
        // slot, unless something kept a slice of it: then the slot gets a
        // fresh one.
        let full = std::mem::take(slot).freeze();
        let stride = meta.stride.max(1);
        let mut at = 0;
        while at < meta.len {
            let end = (at + stride).min(meta.len);
            // The datagram as a range of the buffer, not a `Bytes` of its
            // own: the engine takes the one slice it keeps (the payload).
            // Each reference taken and let go is an atomic operation on the
            // buffer's count; this takes one per datagram instead of three.
            handle_datagram(d, solver, now, meta, &full, at..end, &mut touched);
            at = end;
        }
        *slot = full.try_into_mut().unwrap_or_else(|_| rx_slot());
    }
    Ok((n, touched))
}

/// One receive pass on `rx`, under its `pass` lock: a batch taken under the
/// queue's `work` lock, then the QPs it touched pumped with `work` let go.
/// Returns how many receive slots were filled and the QPs whose ACK is held
/// for the application's answer (see [`pump_touched`]).
fn receive_pass(d: &Arc<Device>, rx: &RxQueue, taker: Taker<'_>) -> io::Result<(usize, QpList)> {
    let _pass = rx.pass.lock();
    let batch = receive_batch(d, rx, &mut rx.work.lock());
    let (n, touched) = batch?;
    #[cfg(test)]
    if matches!(taker, Taker::Task) && n > 0 {
        std::thread::sleep(Duration::from_millis(
            d.pump_delay_ms.load(Ordering::Relaxed),
        ));
    }
    let held = pump_touched(d, touched, taker);
    count_pumped(d, n);
    Ok((n, held))
}

/// Count a batch of `n` taken packets once the QPs it touched are pumped:
/// what [`drain_before_timers`] watches to know a pass saw everything.
pub(super) fn count_pumped(d: &Device, n: usize) {
    if n > 0 {
        d.rx_batches_pumped.fetch_add(1, Ordering::SeqCst);
    }
}

/// Pump the QPs a receive batch touched (the receive queue's lock let go).
/// Returns the QPs whose ACK a receive task's pass held for the
/// application's answer (released when its scheduler tick is over, see
/// [`rx_loop`]).
pub(super) fn pump_touched(d: &Device, touched: QpList, taker: Taker<'_>) -> QpList {
    let mut held = QpList::new();
    for qp in touched {
        match taker {
            // From a QP's own burst: it sends on (and publishes) itself,
            // the ACK behind its next request or after its last.
            Taker::Burst(s) if Arc::ptr_eq(s, &qp) => {}
            Taker::Burst(_) => qp.pump(),
            Taker::Timer => qp.pump_inline(),
            Taker::Task => {
                if qp.pump_inline_holding() && !held.iter().any(|h| Arc::ptr_eq(h, &qp)) {
                    d.counters.acks_held.fetch_add(1, Ordering::Relaxed);
                    held.push(qp);
                }
            }
        }
    }
    held
}

/// Before timers fire: take what waits in the receive sockets. A sender
/// whose burst kept its thread in `sendmsg` for milliseconds (a 1 MiB write
/// through a veth, on a VM with two cores) has the peer's ACKs queued
/// unread when its timer task runs next; without this the retransmission
/// timer or a tail probe fired on a peer that had answered, and a lossless
/// 256 MiB soak resent about 80 operations' first packets for nothing. The
/// sockets are read until a pass over all of them finds nothing (what the
/// packets taken cause to be sent on a loopback path is back in one of them
/// at once, possibly one already read), up to [`DRAIN_BATCHES`] calls.
///
/// A queue its receive task is working on is waited for, not skipped: on
/// two busy cores that task can lose its core in the middle of a batch,
/// with the answers it has taken not yet applied, for milliseconds; the
/// timers fired meanwhile asked a READ's whole range again while its
/// responses were arriving (a lossless 256 MiB soak had 5-24 timer
/// expiries, with the wait 0-8). The timer task holds no lock while it
/// waits.
fn drain_before_timers(d: &Arc<Device>) {
    let mut calls = 0;
    // Whole passes over the queues until one in which nobody (this task, or a
    // receive task it waited for) finished a batch that took packets: what a
    // packet taken from one queue causes to be sent (a loopback peer's ACK)
    // can land in a queue the pass has already emptied. Batches are counted
    // once pumped, not packets once taken: a receive task that took the
    // peer's write before this pass began may send its ACK, to a queue
    // already passed, only while this pass waits for its queue.
    while calls < DRAIN_BATCHES {
        let seen = d.rx_batches_pumped.load(Ordering::SeqCst);
        for rx in &d.rx {
            while calls < DRAIN_BATCHES {
                calls += 1;
                if !matches!(receive_pass(d, rx, Taker::Timer), Ok((n, _)) if n > 0) {
                    break;
                }
            }
        }
        if d.rx_batches_pumped.load(Ordering::SeqCst) == seen {
            break;
        }
    }
}

/// Receive calls a timer pass makes at most (over all queues) before it fires.
const DRAIN_BATCHES: usize = 32;

fn handle_datagram(
    d: &Arc<Device>,
    solver: &mut Ipv4IdSolver,
    now: u64,
    meta: &RecvMeta,
    buf: &Bytes,
    range: std::ops::Range<usize>,
    touched: &mut QpList,
) {
    let c = &d.counters;
    let dgram = &buf[range.clone()];
    c.rx_packets.fetch_add(1, Ordering::Relaxed);
    c.rx_bytes.fetch_add(dgram.len() as u64, Ordering::Relaxed);
    if dgram.len() < 16 {
        c.malformed.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let (t, crc) = dgram.split_at(dgram.len() - 4);
    let wire = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
    let from = SocketAddr::new(meta.addr.ip().to_canonical(), meta.addr.port());
    let to_ip = meta
        .dst_ip
        .map(|a| a.to_canonical())
        .unwrap_or_else(|| d.cfg.bind.to_canonical());
    let to = SocketAddr::new(to_ip, d.port);
    // ICRC first: a packet that fails it is dropped and counted, never acted on
    // (rocev2-reference §9).
    let (ip, udp) = headers(from, to, dgram.len() + 8, 0);
    let ok = if from.is_ipv4() && to.is_ipv4() {
        solver.solve(&ip, &udp, t, wire).is_some()
    } else {
        icrc::compute(&ip, &udp, t) == wire
    };
    if !ok {
        c.icrc_errors.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let pkt = match Packet::decode_shared_in(buf, range.start..range.start + t.len()) {
        Ok(p) => p,
        Err(_) => {
            c.malformed.fetch_add(1, Ordering::Relaxed);
            return;
        }
    };
    let ce = meta.ecn == Some(EcnCodepoint::Ce);
    if ce {
        c.ce_marked.fetch_add(1, Ordering::Relaxed);
    }
    let qpn = pkt.bth.dest_qp;
    if let Some(qp) = touched.iter().find(|q| q.qpn == qpn) {
        qp.receive(now, from, &pkt, ce);
        return;
    }
    let Some(qp) = d.qps.read().get(&qpn).cloned() else {
        c.unknown_qp.fetch_add(1, Ordering::Relaxed);
        return;
    };
    qp.receive(now, from, &pkt, ce);
    touched.push(qp);
}

/// Timer loop: ACK timeouts, RNR waits and DCQCN pacing of every QP.
pub(super) async fn timer_loop(d: Arc<Device>) {
    loop {
        d.counters.timer_passes.fetch_add(1, Ordering::Relaxed);
        // Reset before the scan, so that a deadline it misses wakes us
        // (soft/timer.rs).
        d.timer_target.begin_scan();
        let qps: Vec<Arc<SoftQp>> = d.qps.read().values().cloned().collect();
        if qps
            .iter()
            .any(|qp| qp.deadline.load(Ordering::SeqCst) <= d.now())
        {
            drain_before_timers(&d);
        }
        let now = d.now();
        let mut next = u64::MAX;
        for qp in qps {
            if qp.deadline.load(Ordering::SeqCst) <= now {
                qp.on_timer(now);
            }
            next = next.min(qp.deadline.load(Ordering::SeqCst));
        }
        let next = d.timer_target.end_scan(next);
        let sleep = (next != u64::MAX).then(|| d.epoch + Duration::from_nanos(next));
        // The timerfd is armed again only for an earlier instant than it is
        // armed for: one armed earlier than needed (the deadline it was
        // armed for went away, or moved later) just fires into a scan that
        // re-arms it. A deadline per operation (its ACK timeout) would
        // otherwise cost a system call per operation.
        // The timerfd when this task (or a QP since) could arm it; tokio's
        // millisecond timer where there is none, or arming failed.
        let precise = d.precise.as_ref().filter(|p| match sleep {
            Some(t) => p
                .arm_by(t)
                .inspect_err(|e| debug!("soft RoCE timerfd: {e}"))
                .is_ok(),
            None => true,
        });
        let wait = async {
            match (precise, sleep) {
                (Some(p), _) => {
                    if let Err(e) = p.fired().await {
                        debug!("soft RoCE timerfd: {e}");
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
                (None, Some(t)) => tokio::time::sleep_until(t.into()).await,
                (None, None) => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = wait => {}
            _ = d.timer.notified() => {}
        }
    }
}
