//! The soft RoCEv2 device: the sans-IO engine (`rdmx-roce-proto`) driven over
//! UDP by two tasks on the application's tokio runtime.
//!
//! ```text
//!  app tasks ── post_send/post_recv ──> SoftQp (engine under a mutex) ──> per-QP UDP socket
//!                                          ^                              (own source port)
//!  rx task: UDP :4791 ─────────────────────┘ handle_packet, ACKs, completions ──> SoftCq
//!  timer task ──────────────────────────── handle_timeout (ACK timeout, RNR, pacing),
//!                                           after taking what waits in the rx sockets
//! ```
//!
//! The tasks run where the application runs (no thread of its own): a worker
//! that posts a request and then waits finds the answer without a cross-thread
//! wake-up, which on small VMs costs more than the whole protocol.
//!
//! Packets are RoCEv2 as NICs send them (BTH … ICRC in UDP to port 4791,
//! rocev2-reference §1); data packets carry ECT(0) and received CE marks feed
//! DCQCN. Sends are batched with UDP GSO and gathered (headers and ICRC from
//! a scratch buffer, payloads from where they are: soft/gather.rs), and
//! receives with GRO and recvmmsg where the kernel has them.
//!
//! Here: the device (sockets, receive queues, counters, capture) and its
//! protection domains. The queue pairs are in `device/qp.rs`, the two tasks
//! in `device/tasks.rs`, the datagrams' headers and ICRC sealing in
//! `soft/datagram.rs`, the settings in `soft/config.rs`.

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSliceMut};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::clock::PreciseTimer;
use super::timer::TimerTarget;
use bytes::{Bytes, BytesMut};
use parking_lot::{Mutex, MutexGuard, RwLock};
use quinn_udp::{EcnCodepoint, RecvMeta, Transmit, UdpSocketState};
use rdmx_core::Stats;
use rdmx_core::{Access, AtomicOp, Domain, Error, LocalSlice, MemoryRegion, Result};
use rdmx_roce_proto::icrc::{self, Ipv4IdSolver};
use rdmx_roce_proto::memory::{Atomic, MemError, Memory, Need, PayloadSource};
use rdmx_roce_proto::pcap::CaptureWriter;
use rdmx_roce_proto::{
    Completion, FramePath, Packet, Qp, QpConfig, QpStats, RoceFrame, Timeouts, WorkRequest,
};
use rustc_hash::FxHashMap;
use tokio::io::unix::AsyncFd;
use tokio::sync::Notify;
use tracing::{debug, warn};

use super::config::{SoftConfig, ROCEV2_PORT};
use super::cq::SoftCq;
use super::datagram::{encode, gso_run_end, headers, reseal_icrc, seal_regions, GsoRun, RawTx};
use super::gather::{self, Batch, Gathered, Payload};
use crate::verbs::{
    CompletionQueue, PortInfo, ProtectionDomain, Provider, ProviderKind, QpCounters, QpOptions,
    QpPeer, QpState, QueuePair, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

mod qp;
mod tasks;

use qp::*;
pub use tasks::on_thread_park;
use tasks::{count_pumped, pump_touched, receive_batch, rx_loop, rx_slot, timer_loop, RX_BATCH};

/// Whether a QP's socket (bound to `local`) may be connected to its peer
/// at `peer` ([`gather::connect`]): only when its datagrams travel as IPv6.
/// An IPv4 datagram from a connected socket carries the socket's own
/// Identification counter (ip_select_ident_segs: random at connect, one up
/// per datagram), and the ICRC covers that field (rocev2-reference §9):
/// unconnected, a DF datagram carries 0, which is what the engine seals
/// with. A NIC checks the ICRC exactly (rxe dropped every packet of a
/// connected IPv4 socket, silently); only our own receivers, which solve for
/// the Identification, took them. IPv6 has no such field.
fn may_connect(local: SocketAddr, peer: SocketAddr) -> bool {
    gather::wire_is_ipv6(local, peer)
}

/// Turn off the receive timestamps quinn-udp's `UdpSocketState::new`
/// turns on for every socket it wraps (`SO_TIMESTAMPNS`). Nothing here
/// reads them, and while any socket asks for them the kernel reads the
/// clock for every packet it receives (`net_timestamp_check` in
/// `netif_rx`) and copies the stamp out with each datagram (`put_cmsg`).
/// Measured on loopback, three rounds: an 8 B round trip's CPU 3-9% lower
/// with them off. A socket that refuses keeps them (it still works).
fn without_rx_timestamps(sock: &std::net::UdpSocket) {
    use nix::sys::socket::{setsockopt, sockopt::ReceiveTimestampns};
    if let Err(e) = setsockopt(sock, ReceiveTimestampns, &false) {
        debug!(error = %e, "soft RoCE: receive timestamps stay on");
    }
}

/// Device-wide packet counters.
#[derive(Debug, Default)]
struct Counters {
    rx_packets: AtomicU64,
    rx_bytes: AtomicU64,
    tx_packets: AtomicU64,
    tx_bytes: AtomicU64,
    icrc_errors: AtomicU64,
    malformed: AtomicU64,
    unknown_qp: AtomicU64,
    wrong_source: AtomicU64,
    ce_marked: AtomicU64,
    tx_blocked: AtomicU64,
    tx_calls: AtomicU64,
    rx_while_sending: AtomicU64,
    acks_held: AtomicU64,
    acks_released: AtomicU64,
    timer_passes: AtomicU64,
}

/// A snapshot of a soft device's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceStats {
    /// RoCEv2 packets received (after GRO splitting).
    pub rx_packets: u64,
    /// UDP payload bytes received.
    pub rx_bytes: u64,
    /// Packets sent.
    pub tx_packets: u64,
    /// UDP payload bytes sent.
    pub tx_bytes: u64,
    /// Packets dropped because their ICRC did not verify (never acted on).
    pub icrc_errors: u64,
    /// Packets dropped because they did not decode.
    pub malformed: u64,
    /// Packets for a QP number that does not exist.
    pub unknown_qp: u64,
    /// Packets for a QP from an address that is not its peer.
    pub wrong_source: u64,
    /// Packets that arrived with ECN Congestion Experienced.
    pub ce_marked: u64,
    /// Times a send found the socket buffer full (the rest waited for space).
    pub tx_blocked: u64,
    /// Send system calls (one carries a GSO batch of packets where the kernel has GSO).
    pub tx_calls: u64,
    /// Datagrams a QP's send burst took from the receive queues between
    /// its sends (it does so for a while after the peer reported a loss).
    pub rx_while_sending: u64,
    /// ACKs a receive task held for the application's answer (see
    /// [`SoftConfig::ack_hold`]).
    pub acks_held: u64,
    /// Of those, ACKs that had no answer to go with when the receive
    /// task's tick was over, and left alone.
    pub acks_released: u64,
    /// Passes of the timer task over the QPs' deadlines (each one a wake-up
    /// of that task).
    pub timer_passes: u64,
}

struct Capture {
    writer: CaptureWriter<std::io::BufWriter<std::fs::File>>,
    frames: u64,
}

pub(crate) struct Device {
    cfg: SoftConfig,
    handle: tokio::runtime::Handle,
    rx: Vec<RxQueue>,
    /// Receive batches that took packets, counted once the QPs they touched
    /// are pumped (what they caused to be sent is then in a socket): the
    /// timer's drain passes until a whole pass saw this unchanged.
    rx_batches_pumped: AtomicU64,
    /// Tests: how long a receive task waits between its batch and the
    /// pumping of the QPs it touched (a task that lost its core there).
    #[cfg(test)]
    pump_delay_ms: AtomicU64,
    port: u16,
    qps: RwLock<FxHashMap<u32, Arc<SoftQp>>>,
    next_qpn: AtomicU32,
    epoch: Instant,
    /// Wakes the timer task where there is no [`PreciseTimer`].
    timer: Notify,
    /// The timer task's `timerfd`, which queue pairs arm themselves when a
    /// deadline of theirs comes first (`None` where the kernel gives none:
    /// then they wake the task through `timer`, and it sleeps on tokio's
    /// millisecond timer).
    precise: Option<PreciseTimer>,
    timer_target: TimerTarget,
    counters: Counters,
    capture: Mutex<Option<Capture>>,
    capturing: std::sync::atomic::AtomicBool,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device").field("port", &self.port).finish()
    }
}

impl Device {
    /// Make the timer task run at `at` (device nanoseconds) at the latest:
    /// arm its timerfd from here where there is one (no task woken now;
    /// it runs when that fires), else wake it to rescan.
    fn wake_timer_by(&self, at: u64) {
        if let Some(p) = &self.precise {
            match p.arm_by(self.epoch + Duration::from_nanos(at)) {
                Ok(()) => return,
                Err(e) => debug!("soft RoCE timerfd: {e}"),
            }
        }
        self.timer.notify_one();
    }

    fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    fn record(&self, from: SocketAddr, to: SocketAddr, pkt: &Packet, ecn: u8) {
        let mut cap = self.capture.lock();
        let Some(c) = cap.as_mut() else { return };
        let path = FramePath {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            src: from.ip(),
            dst: to.ip(),
            sport: from.port(),
            ecn,
            flow_label: 0,
        };
        let mut f = RoceFrame::new(&path, pkt.clone());
        if to.port() != ROCEV2_PORT {
            f.udp.dport = to.port();
            f.finalize();
        }
        if c.writer.write(self.epoch.elapsed(), &f.to_bytes()).is_ok() {
            c.frames += 1;
        }
    }
}

/// The userspace RoCEv2 provider: one UDP port, any number of RC QPs.
#[derive(Debug)]
pub struct SoftRoce {
    dev: Arc<Device>,
}

impl Drop for SoftRoce {
    fn drop(&mut self) {
        for t in self.dev.tasks.lock().drain(..) {
            t.abort();
        }
    }
}

/// Bind the receive queues: `cfg.rx_queues` sockets sharing one port through
/// SO_REUSEPORT, which the kernel spreads by flow hash like a NIC's RSS (each
/// QP's packets always land in the same queue). The port is first probed
/// without SO_REUSEPORT, so a port another device (or program) holds is never
/// joined: the device falls back to a free port instead.
fn bind_rx(cfg: &SoftConfig) -> io::Result<Vec<std::net::UdpSocket>> {
    let queues = cfg.rx_queues.clamp(1, 16);
    let bind = |port: u16, reuse: bool| -> io::Result<std::net::UdpSocket> {
        let addr = SocketAddr::new(cfg.bind, port);
        let s = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::DGRAM,
            Some(socket2::Protocol::UDP),
        )?;
        if cfg.bind.is_ipv6() {
            s.set_only_v6(false)?;
        }
        if reuse {
            s.set_reuse_port(true)?;
        }
        s.bind(&addr.into())?;
        s.set_nonblocking(true)?;
        Ok(s.into())
    };
    let port = if cfg.port == 0 {
        0
    } else {
        match bind(cfg.port, false) {
            Ok(probe) => {
                drop(probe);
                cfg.port
            }
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && cfg.port_fallback => {
                warn!(
                    port = cfg.port,
                    "soft RoCE: UDP port in use (another soft device on this host?); using a free \
                     port, which rdmx peers learn at connect (real NICs need {ROCEV2_PORT})"
                );
                0
            }
            Err(e) => return Err(e),
        }
    };
    let first = bind(port, queues > 1)?;
    let port = first.local_addr()?.port();
    let mut all = vec![first];
    for _ in 1..queues {
        all.push(bind(port, true)?);
    }
    if queues > 1 {
        // RSS by destination QP: each QP's packets always reach the same queue,
        // and a connection's two QPs (consecutive numbers) different ones.
        if let Err(e) = crate::sys::steer_by_qpn(&all[0], queues as u32) {
            debug!("soft RoCE: no QP steering ({e}); the kernel's flow hash spreads packets");
        }
    }
    Ok(all)
}

/// One receive queue.
struct RxQueue {
    /// An `AsyncFd`, not a tokio `UdpSocket`: the receive loop clears
    /// readiness itself when a batch comes back short, instead of asking the
    /// kernel once more only to hear "would block".
    sock: AsyncFd<std::net::UdpSocket>,
    state: UdpSocketState,
    /// The receive side's buffers, taken by whoever receives: the queue's
    /// receive task, or the timer task draining the socket before it
    /// declares a peer silent (see `tasks::drain_before_timers`). One at a time,
    /// so datagrams reach the engine in the order the socket gave them.
    work: Mutex<RxWork>,
    /// Held for a whole receive pass of the queue's task or the timer's:
    /// the batch (under `work`) and the pumping of the QPs it touched
    /// (with `work` let go, see `tasks::receive_pass`). The timer task waits
    /// for it before it declares a peer silent: an answer taken but not yet
    /// pumped on (the ACK a loopback peer sends for a write it has just
    /// applied) is not in any socket yet.
    pass: Mutex<()>,
}

/// What one receive pass works with.
struct RxWork {
    bufs: Vec<BytesMut>,
    metas: Vec<RecvMeta>,
    solver: Ipv4IdSolver,
}

impl RxWork {
    fn new() -> RxWork {
        RxWork {
            bufs: (0..RX_BATCH).map(|_| rx_slot()).collect(),
            metas: vec![RecvMeta::default(); RX_BATCH],
            solver: Ipv4IdSolver::new(),
        }
    }
}

/// Who takes a receive batch, and so what becomes of an ACK the engine holds
/// for the application's answer (`QpConfig::ack_hold_ns`).
#[derive(Clone, Copy)]
enum Taker<'a> {
    /// The queue's receive task: the QP is pumped inline, a held ACK stays
    /// held until the task's scheduler tick is over (`RxWork::held`).
    Task,
    /// The timer task before it fires: pumped inline, nothing held.
    Timer,
    /// A QP's own burst ([`SoftQp::listen_while_sending`]): that QP sends on
    /// (and publishes) itself; others are pumped as a post would pump them.
    /// Nothing is held.
    Burst(&'a Arc<SoftQp>),
}

impl SoftRoce {
    /// Start a soft device: binds its UDP port and starts its thread.
    pub fn new(cfg: SoftConfig) -> Result<SoftRoce> {
        if !matches!(cfg.mtu, 256 | 512 | 1024 | 2048 | 4096) {
            return Err(Error::InvalidArgument(format!(
                "soft RoCE MTU {} is not one of 256, 512, 1024, 2048, 4096",
                cfg.mtu
            )));
        }
        let std_rx = bind_rx(&cfg).map_err(|e| {
            Error::RdmaUnavailable(format!("soft RoCE cannot bind UDP {}: {e}", cfg.port))
        })?;
        let port = std_rx[0]
            .local_addr()
            .map_err(|e| Error::RdmaUnavailable(format!("soft RoCE socket: {e}")))?
            .port();
        let handle = tokio::runtime::Handle::try_current().map_err(|_| {
            Error::RdmaUnavailable(
                "the soft RoCE device runs on a tokio runtime; start it inside one".into(),
            )
        })?;
        let mut rx = Vec::new();
        let precise;
        {
            let _g = handle.enter();
            // Microsecond sleeps where the kernel gives a timerfd (see
            // clock.rs); tokio's millisecond timer otherwise.
            precise = PreciseTimer::new()
                .inspect_err(|e| {
                    warn!("soft RoCE: no timerfd ({e}); timers round up to a millisecond")
                })
                .ok();
            let e = |e: io::Error| Error::RdmaUnavailable(format!("soft RoCE socket: {e}"));
            for s in std_rx {
                let state = UdpSocketState::new((&s).into()).map_err(e)?;
                without_rx_timestamps(&s);
                let _ = state.set_recv_buffer_size((&s).into(), cfg.recv_buffer);
                let sock = crate::sys::register_udp(s).map_err(e)?;
                rx.push(RxQueue {
                    sock,
                    state,
                    work: Mutex::new(RxWork::new()),
                    pass: Mutex::new(()),
                });
            }
        }
        let first_qpn = rand::random_range(0x100..0x80_0000u32);
        let dev = Arc::new(Device {
            cfg,
            handle: handle.clone(),
            rx,
            rx_batches_pumped: AtomicU64::new(0),
            #[cfg(test)]
            pump_delay_ms: AtomicU64::new(0),
            port,
            qps: RwLock::default(),
            next_qpn: AtomicU32::new(first_qpn),
            epoch: Instant::now(),
            timer: Notify::new(),
            precise,
            timer_target: TimerTarget::new(),
            counters: Counters::default(),
            capture: Mutex::new(None),
            capturing: std::sync::atomic::AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
        });
        let mut tasks = vec![handle.spawn(timer_loop(dev.clone())).abort_handle()];
        for q in 0..dev.rx.len() {
            tasks.push(handle.spawn(rx_loop(dev.clone(), q)).abort_handle());
        }
        dev.tasks.lock().extend(tasks);
        debug!(port, "soft RoCE device started");
        Ok(SoftRoce { dev })
    }

    /// The shared soft device of the current tokio runtime, on the default
    /// configuration (UDP 4791, or a free port if something else holds it).
    /// Started on first use; it lives while connections or handles use it.
    pub fn global() -> Result<Arc<SoftRoce>> {
        type Registry = HashMap<tokio::runtime::Id, std::sync::Weak<SoftRoce>>;
        static DEVICES: std::sync::OnceLock<Mutex<Registry>> = std::sync::OnceLock::new();
        let id = tokio::runtime::Handle::try_current()
            .map_err(|_| {
                Error::RdmaUnavailable("the soft RoCE device runs on a tokio runtime".into())
            })?
            .id();
        let mut devs = DEVICES.get_or_init(|| Mutex::new(HashMap::new())).lock();
        if let Some(d) = devs.get(&id).and_then(|w| w.upgrade()) {
            return Ok(d);
        }
        devs.retain(|_, w| w.strong_count() > 0);
        let d = Arc::new(SoftRoce::new(SoftConfig::default())?);
        devs.insert(id, Arc::downgrade(&d));
        Ok(d)
    }

    /// The UDP port this device receives on.
    pub fn port(&self) -> u16 {
        self.dev.port
    }

    /// Device counters.
    pub fn stats(&self) -> DeviceStats {
        let c = &self.dev.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        DeviceStats {
            rx_packets: l(&c.rx_packets),
            rx_bytes: l(&c.rx_bytes),
            tx_packets: l(&c.tx_packets),
            tx_bytes: l(&c.tx_bytes),
            icrc_errors: l(&c.icrc_errors),
            malformed: l(&c.malformed),
            unknown_qp: l(&c.unknown_qp),
            wrong_source: l(&c.wrong_source),
            ce_marked: l(&c.ce_marked),
            tx_blocked: l(&c.tx_blocked),
            tx_calls: l(&c.tx_calls),
            rx_while_sending: l(&c.rx_while_sending),
            acks_held: l(&c.acks_held),
            acks_released: l(&c.acks_released),
            timer_passes: l(&c.timer_passes),
        }
    }

    /// Write every packet this device sends from now on to a pcap file (Ethernet/IP/UDP headers rebuilt around the exact RoCEv2 bytes;
    /// decode it with `tshark` or check it with `rdmx pcap check`).
    pub fn start_capture(&self, path: &std::path::Path) -> Result<()> {
        let f = std::fs::File::create(path)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", path.display())))?;
        let writer = CaptureWriter::new(std::io::BufWriter::new(f), self.dev.port)
            .map_err(|e| Error::InvalidArgument(format!("{}: {e}", path.display())))?;
        *self.dev.capture.lock() = Some(Capture { writer, frames: 0 });
        self.dev.capturing.store(true, Ordering::Release);
        Ok(())
    }

    /// Stop capturing; returns the number of frames written.
    pub fn stop_capture(&self) -> u64 {
        self.dev.capturing.store(false, Ordering::Release);
        match self.dev.capture.lock().take() {
            Some(c) => {
                let frames = c.frames;
                drop(c.writer);
                frames
            }
            None => 0,
        }
    }
}

impl Provider for SoftRoce {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Soft
    }

    fn device_name(&self) -> String {
        format!("soft-roce:{}", self.dev.port)
    }

    fn port_for(&self, local_ip: IpAddr, peer_ip: IpAddr) -> Result<PortInfo> {
        let (local, peer) = (local_ip.to_canonical(), peer_ip.to_canonical());
        // The largest IBTA MTU whose biggest packet (IP + UDP + BTH + RETH +
        // ImmDt + payload + ICRC) fits the route, like a NIC's active_mtu
        // (1024 on a 1500-byte Ethernet, rocev2-reference §8).
        let ip_hdr = if local.is_ipv4() && peer.is_ipv4() {
            20
        } else {
            40
        };
        let link = crate::sys::path_mtu(local, peer).unwrap_or(1500);
        let mtu = [4096u32, 2048, 1024, 512, 256]
            .into_iter()
            .filter(|&m| m <= self.dev.cfg.mtu)
            .find(|&m| m + ip_hdr + 8 + 12 + 16 + 4 + 4 <= link)
            .unwrap_or(256);
        Ok(PortInfo {
            gid: local,
            udp_port: self.dev.port,
            mtu,
            // The engine keeps any number outstanding; the bootstrap's byte
            // carries at most this.
            max_rd_atomic: u32::from(u8::MAX),
        })
    }

    fn selective_repeat(&self) -> bool {
        self.dev.cfg.selective_repeat
    }

    fn alloc_pd(&self, domain: &Domain) -> Result<Arc<dyn ProtectionDomain>> {
        Ok(Arc::new(SoftPd {
            dev: self.dev.clone(),
            domain: domain.clone(),
        }))
    }

    fn create_cq(&self, _depth: usize) -> Result<Arc<dyn CompletionQueue>> {
        Ok(Arc::new(SoftCq::new()?))
    }
}

struct SoftPd {
    dev: Arc<Device>,
    domain: Domain,
}

impl ProtectionDomain for SoftPd {
    fn register(&self, mr: &MemoryRegion) -> Result<u32> {
        // The engine reaches regions through the domain: its keys are the R_Keys.
        Ok(mr.rkey())
    }

    fn create_qp(
        &self,
        cq: &Arc<dyn CompletionQueue>,
        opts: QpOptions,
    ) -> Result<Arc<dyn QueuePair>> {
        // The soft QP pushes completions itself, so it needs the concrete CQ.
        let cq: Arc<SoftCq> = soft_cq(cq)?;
        let dev = &self.dev;
        let qpn = loop {
            let n = dev.next_qpn.fetch_add(1, Ordering::Relaxed) & 0xFF_FFFF;
            if n > 1 && !dev.qps.read().contains_key(&n) {
                break n;
            }
        };
        let cfg = QpConfig {
            pmtu: dev.cfg.mtu,
            timeout: opts.timeout,
            retry_cnt: opts.retry_cnt,
            rnr_retry: opts.rnr_retry,
            max_rd_atomic: opts.max_rd_atomic,
            dcqcn: dev.cfg.dcqcn,
            max_unacked: dev.cfg.window,
            ack_hold_ns: dev.cfg.ack_hold.as_nanos().min(u128::from(u64::MAX)) as u64,
            ..QpConfig::default()
        };
        let mut engine = Qp::new(cfg, qpn);
        engine.set_read_buffers(rdmx_roce_proto::ReadBuffers {
            take: rdmx_core::pool::take,
            freeze: rdmx_core::pool::freeze,
        });
        engine
            .to_init()
            .map_err(|e| Error::Protocol(format!("soft QP: {e}")))?;
        let qp = Arc::new(SoftQp {
            dev: dev.clone(),
            qpn,
            cq,
            domain: self.domain.clone(),
            inner: Mutex::new(Inner {
                qp: engine,
                peer: None,
                tx: None,
                backlog: VecDeque::new(),
                flushing: false,
                out: Vec::new(),
                segs: Vec::new(),
                grams: Vec::new(),
                unsealed: Vec::new(),
                losses_seen: 0,
                listen_until: 0,
                guards: GuardPace::default(),
            }),
            deadline: AtomicU64::new(u64::MAX),
            sink: Mutex::new(None),
            pump_due: AtomicBool::new(false),
        });
        dev.qps.write().insert(qpn, qp.clone());
        Ok(Arc::new(SoftQpHandle(qp)))
    }
}

/// Recover the concrete soft CQ from the trait object.
fn soft_cq(cq: &Arc<dyn CompletionQueue>) -> Result<Arc<SoftCq>> {
    cq.clone()
        .as_any()
        .downcast::<SoftCq>()
        .map_err(|_| Error::InvalidArgument("a soft QP needs a soft CQ".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// QP sockets are connected only where no IPv4 Identification is on
    /// the wire for the ICRC to cover.
    #[test]
    fn only_ipv6_qp_sockets_are_connected() {
        let a = |s: &str| s.parse::<SocketAddr>().unwrap();
        assert!(!may_connect(a("198.18.0.1:0"), a("198.18.0.2:4791")));
        assert!(!may_connect(a("127.0.0.1:0"), a("127.0.0.1:4791")));
        assert!(!may_connect(
            a("[::ffff:198.18.0.1]:0"),
            a("[::ffff:198.18.0.2]:4791")
        ));
        assert!(!may_connect(a("[::]:0"), a("198.18.0.2:4791")));
        assert!(may_connect(a("[::1]:0"), a("[::1]:4791")));
        assert!(may_connect(a("[fd00::1]:0"), a("[fd00::2]:4791")));
    }

    /// A socket quinn-udp wrapped asks for no receive timestamps once the
    /// device has turned them off (the device's own sockets, rx queues and
    /// QPs, go through the same call).
    #[test]
    fn wrapped_sockets_ask_for_no_receive_timestamps() {
        use nix::sys::socket::{getsockopt, sockopt::ReceiveTimestampns};
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let _state = UdpSocketState::new((&s).into()).unwrap();
        without_rx_timestamps(&s);
        assert!(!getsockopt(&s, ReceiveTimestampns).unwrap());
    }

    /// READ responses whose data stays in its region: the responder hands
    /// the transmitter a source, not a copy; the gathered datagrams carry
    /// the region's bytes as they are when sent (a write after the
    /// responses were built shows), and their ICRCs, computed at send time,
    /// are those of the same packets encoded whole.
    #[test]
    fn read_responses_are_read_from_their_region_when_sent() {
        let domain = Domain::new();
        let mr = domain.register_from(
            &(0..10_000u32).map(|i| (i * 7) as u8).collect::<Vec<_>>(),
            Access::REMOTE_READ,
        );
        let r = mr.remote();
        let mem = DomainMemory(&domain);
        let src = mem
            .read_source(r.rkey, r.addr + 100, 9_000)
            .unwrap()
            .expect("the soft device lends its regions");
        assert_eq!(src.len(), 9_000);
        // Three responses of a 4096-byte path MTU, the last one padded.
        let pkts: Vec<Packet> = [(0usize, 4096usize), (4096, 8192), (8192, 9_000)]
            .into_iter()
            .enumerate()
            .map(|(i, (a, b))| {
                let mut p = Packet::new(rdmx_roce_proto::Bth::new(
                    rdmx_roce_proto::Opcode::RDMA_READ_RESPONSE_MIDDLE,
                    0x12,
                    i as u32,
                ));
                p.deferred = Some(rdmx_roce_proto::Deferred {
                    source: src.clone(),
                    range: a..b,
                });
                p.finish();
                p
            })
            .collect();
        assert_eq!(pkts[2].payload_len(), 808);
        assert!(
            pkts.iter().all(|p| p.payload.is_empty()),
            "nothing copied yet"
        );
        // Written after the responses were built, before they leave.
        mr.write()[100 + 5_000] = 0xAB;
        let (a, b): (SocketAddr, SocketAddr) = (
            "198.18.0.1:50000".parse().unwrap(),
            "198.18.0.2:4791".parse().unwrap(),
        );
        let mut out = Vec::new();
        let mut grams = Vec::new();
        let mut unsealed = Vec::new();
        for (k, p) in pkts.iter().enumerate() {
            let at = out.len();
            p.encode_headers(&mut out);
            let d = p.deferred.as_ref().unwrap();
            let r = d.source.as_any().downcast_ref::<RegionSource>().unwrap();
            let headers = out.len() - at;
            out.extend_from_slice(p.pad_bytes());
            out.extend_from_slice(&[0; 4]);
            let trailer = p.pad_bytes().len() + 4;
            unsealed.push((k, 7 + k as u16));
            grams.push(Gathered {
                at,
                headers,
                payload: Payload::Region(r.0.clone(), d.range.clone()),
                trailer,
            });
        }
        let held = gather::lock_all(&grams);
        seal_regions(&mut out, &grams, &held, &unsealed, a, b);
        for (k, p) in pkts.iter().enumerate() {
            assert_eq!(grams[k].len(), p.encoded_len() + 4, "datagram {k} size");
            let mut want = Vec::new();
            encode(p, a, b, 7 + k as u16, &mut want);
            assert_eq!(grams[k].to_vec(&out, &held[k]), want, "datagram {k}");
        }
        let second = grams[1].payload(&held[1]);
        assert_eq!(second[5_000 - 4_096], 0xAB, "read when sent");
        assert_eq!(second[0], ((100 + 4_096) * 7) as u8);
    }

    /// Guards wait [`GUARD_SLACK_NS`] longer while calm; a NAK or a resend
    /// makes them prompt for [`PROMPT_GUARDS_NS`], then calm again.
    #[test]
    fn guards_run_late_only_while_nothing_was_lost() {
        let mut g = GuardPace::default();
        let mut st = QpStats::default();
        assert_eq!(g.slack(&st, 1_000), GUARD_SLACK_NS, "calm from the start");
        st.naks_received = 1;
        assert_eq!(g.slack(&st, 2_000), 0, "a NAK");
        assert_eq!(g.slack(&st, 2_000 + PROMPT_GUARDS_NS - 1), 0);
        assert_eq!(g.slack(&st, 2_000 + PROMPT_GUARDS_NS), GUARD_SLACK_NS);
        let t = 5 * PROMPT_GUARDS_NS;
        st.retransmits = 3;
        assert_eq!(g.slack(&st, t), 0, "a resend (a probe, a timeout)");
        assert_eq!(g.slack(&st, t + PROMPT_GUARDS_NS), GUARD_SLACK_NS);
    }

    /// Only the guards are put off: pacing, RNR waits and resend checks
    /// keep their time, and a held ACK's release stays lazy.
    #[test]
    fn slack_moves_the_guards_and_nothing_else() {
        let guard = Timeouts {
            guard: Some(100),
            ..Timeouts::default()
        };
        assert_eq!(wake_times(guard, 0), (100, 100));
        assert_eq!(wake_times(guard, 50), (150, 150));
        let both = Timeouts {
            prompt: Some(120),
            guard: Some(100),
            ack_hold: None,
        };
        assert_eq!(wake_times(both, 50), (120, 120), "the paced wait first");
        let held = Timeouts {
            prompt: None,
            guard: Some(100),
            ack_hold: Some(130),
        };
        assert_eq!(wake_times(held, 50), (130, 150), "the hold: lazily");
        assert_eq!(
            wake_times(Timeouts::default(), 50),
            (u64::MAX, u64::MAX),
            "nothing to wait for"
        );
    }

    /// A receive task that lost its core in the middle of a batch (here: its
    /// queues' work held by another thread for 30 ms, far past the 1 ms
    /// timer floor) holds the answer to a write unread; the timer task
    /// waits for it and takes the answer before it fires, so nothing times
    /// out and nothing is resent. Skipping the busy queue fired the timer on
    /// a peer that had answered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn timers_wait_for_a_receive_task_held_up_mid_batch() {
        let (dev, p, mr) = written_pair().await;
        let before = p.client.stats();
        for round in 2..7u8 {
            let (held_tx, held) = std::sync::mpsc::channel();
            let d = dev.dev.clone();
            let holder = std::thread::spawn(move || {
                let guards: Vec<_> = d.rx.iter().map(|q| q.work.lock()).collect();
                held_tx.send(()).unwrap();
                std::thread::sleep(Duration::from_millis(30));
                drop(guards);
            });
            held.recv().unwrap();
            write_round(&p, &mr, round).await;
            holder.join().unwrap();
        }
        assert_nothing_resent(before, p.client.stats());
    }

    /// A receive task that lost its core after its batch, before pumping the
    /// QPs it touched (here: 5 ms, past the 1 ms timer floor), has applied a
    /// write whose ACK is in no socket yet; the timer task waits for the
    /// task's whole pass, so nothing times out and nothing is resent. The
    /// timer once waited for the batch only (the queue's `work` lock) and
    /// fired a tail probe on a peer that had answered (a CI run under load).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn timers_wait_for_a_receive_task_held_up_before_pumping() {
        let (dev, p, mr) = written_pair().await;
        let before = p.client.stats();
        dev.dev.pump_delay_ms.store(5, Ordering::Relaxed);
        for round in 2..12u8 {
            write_round(&p, &mr, round).await;
        }
        dev.dev.pump_delay_ms.store(0, Ordering::Relaxed);
        assert_nothing_resent(before, p.client.stats());
    }

    /// A soft device (one for both ends) with a connected pair and a 4 KiB
    /// region of the server's, written once.
    async fn written_pair() -> (
        Arc<SoftRoce>,
        rdmx_conformance::Pair,
        rdmx_core::MemoryRegion,
    ) {
        let dev = Arc::new(
            SoftRoce::new(SoftConfig {
                port: 0,
                ..SoftConfig::default()
            })
            .unwrap(),
        );
        let p = rdmx_conformance::Suite::new(
            Arc::new(crate::RdmaTransport::with_provider(dev.clone())),
            "127.0.0.1:0",
        )
        .pair()
        .await;
        let mr = p.server_opts.domain.register(4096, Access::ALL);
        p.client.write(vec![1u8; 4096], mr.remote()).await.unwrap();
        (dev, p, mr)
    }

    /// Write `round` over the region and check it landed.
    async fn write_round(p: &rdmx_conformance::Pair, mr: &rdmx_core::MemoryRegion, round: u8) {
        use std::future::IntoFuture;
        p.client
            .write(vec![round; 4096], mr.remote())
            .into_future()
            .await
            .unwrap();
        assert!(mr.read().iter().all(|&b| b == round), "round {round}");
    }

    fn assert_nothing_resent(before: rdmx_core::StatsSnapshot, after: rdmx_core::StatsSnapshot) {
        assert_eq!(
            after.retransmit_timeouts, before.retransmit_timeouts,
            "{after:?}"
        );
        assert_eq!(after.tail_probes, before.tail_probes, "{after:?}");
        assert_eq!(after.retransmits, before.retransmits, "{after:?}");
    }
}
