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
//! Here: the device (sockets, receive queues, counters, capture), its
//! protection domains and QPs. The two tasks are in `device/tasks.rs`, the
//! datagrams' headers and ICRC sealing in `soft/datagram.rs`, the settings
//! in `soft/config.rs`.

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

mod tasks;

pub use tasks::on_thread_park;
use tasks::{count_pumped, pump_touched, receive_batch, rx_loop, timer_loop, RX_BATCH, RX_BUF};

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
            bufs: (0..RX_BATCH).map(|_| BytesMut::zeroed(RX_BUF)).collect(),
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

struct Tx {
    /// Non-blocking and not registered with the reactor: sends go straight
    /// to the kernel, and only the flusher of a full buffer waits for room
    /// ([`crate::sys::writable`]). Registered, every datagram the kernel
    /// frees would report "writable" and wake the thread in `epoll`.
    sock: std::net::UdpSocket,
    state: UdpSocketState,
    local: SocketAddr,
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

struct Inner {
    qp: Qp,
    peer: Option<QpPeer>,
    tx: Option<Arc<Tx>>,
    /// Datagrams that found the socket buffer full, with their GSO segment size.
    backlog: VecDeque<(Vec<u8>, usize)>,
    flushing: bool,
    /// Scratch of the batch being sent: each datagram's headers, then its
    /// pad and ICRC (the payloads stay where the engine holds them).
    out: Vec<u8>,
    /// Sizes of the batch's datagrams.
    segs: Vec<usize>,
    /// The batch's datagrams, as pieces of `out` and their payloads.
    grams: Vec<Gathered>,
    /// Datagrams of the batch (index in `grams`, IP Identification) whose
    /// payload is in a region: their ICRC is computed when they are sent.
    unsealed: Vec<(usize, u16)>,
    /// NAKs the engine had received, plus duplicates it had seen, when last
    /// published: a change means packets were lost on the path (the peer
    /// saw ours lost, or asked again for what we sent). Our own timers can
    /// fire for nothing on a loaded machine, so they do not count.
    losses_seen: u64,
    /// Until when (device ns) bursts listen between their sends
    /// ([`SoftQp::listen_while_sending`]): a while after the last loss.
    listen_until: u64,
    /// Whether the guard timers run on time or [`GUARD_SLACK_NS`] late.
    guards: GuardPace,
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
const GUARD_SLACK_NS: u64 = 1_000_000;

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
const PROMPT_GUARDS_NS: u64 = 100_000_000;

/// Whether a QP's guard timers may run late: not for [`PROMPT_GUARDS_NS`]
/// after the engine counted a NAK or a resend (timers that fired for
/// nothing on a loaded machine count too: they only cost wake-ups).
#[derive(Debug, Default)]
struct GuardPace {
    /// The engine's NAKs received and packets resent, when last looked at.
    naks: u64,
    resent: u64,
    /// Until when (device ns) the guards run on time.
    prompt_until: u64,
}

impl GuardPace {
    /// How late the guards may run now, given the engine's counters.
    fn slack(&mut self, st: &QpStats, now: u64) -> u64 {
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
fn wake_times(t: Timeouts, slack: u64) -> (u64, u64) {
    let guard = t.guard.map(|g| g.saturating_add(slack));
    let urgent = [t.prompt, guard].into_iter().flatten().min();
    let deadline = [urgent, t.ack_hold].into_iter().flatten().min();
    (deadline.unwrap_or(u64::MAX), urgent.unwrap_or(u64::MAX))
}

pub(crate) struct SoftQp {
    dev: Arc<Device>,
    qpn: u32,
    cq: Arc<SoftCq>,
    domain: Domain,
    inner: Mutex<Inner>,
    /// When the engine next needs `handle_timeout` (device clock ns; MAX = never).
    deadline: AtomicU64,
    /// Where protocol events are counted, and what was counted so far.
    sink: Mutex<Option<(Arc<Stats>, QpStats)>>,
    /// A pump is scheduled for the end of this scheduler tick
    /// ([`SoftQp::pump_soon`]).
    pump_due: AtomicBool,
}

/// Responder access to the domain's regions (the engine's memory trait).
struct DomainMemory<'a>(&'a Domain);

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
struct RegionSource(LocalSlice);

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
    fn update_deadline(&self, inner: &mut Inner) {
        let slack = inner.guards.slack(&inner.qp.stats(), self.dev.now());
        let (d, urgent) = wake_times(inner.qp.timeouts(), slack);
        // SeqCst: the timer task's scan and `TimerTarget` rely on one order.
        self.deadline.store(d, Ordering::SeqCst);
        if let Some(at) = self.dev.timer_target.lower_lazily(d, urgent) {
            self.dev.wake_timer_by(at);
        }
    }

    /// Move the engine forward: send what it has (in order, under the lock),
    /// hand completions to the CQ, re-arm the timer.
    fn pump(self: &Arc<Self>) {
        self.pump_for(false, false);
    }

    /// [`SoftQp::pump`] from the device's own tasks (packets received,
    /// timers), which hold no lock of the connection's: the connection takes
    /// its completions right here instead of in a task of its own.
    fn pump_inline(self: &Arc<Self>) {
        self.pump_for(true, false);
        self.cq.run_handler();
    }

    /// [`SoftQp::pump_inline`] from a receive task, which releases an ACK
    /// the engine holds for the application's answer only once its tick is
    /// over. Returns whether one is held.
    fn pump_inline_holding(self: &Arc<Self>) -> bool {
        let held = self.pump_for(true, true);
        self.cq.run_handler();
        held
    }

    /// Pump; unless `keep_held`, an ACK held for the application's answer
    /// leaves now, behind whatever else goes (with a backlog, the flusher
    /// sends it). Returns whether one is still held.
    fn pump_for(self: &Arc<Self>, handler_follows: bool, keep_held: bool) -> bool {
        let mut g = self.inner.lock();
        self.publish(&mut g, handler_follows);
        if g.backlog.is_empty() {
            if keep_held {
                self.transmit(&mut g, handler_follows);
            } else {
                self.transmit_releasing(&mut g, handler_follows);
            }
        }
        self.update_deadline(&mut g);
        self.count(g.qp.stats());
        g.qp.ack_held()
    }

    /// Hand the engine's completions to the CQ, then its counters to the
    /// attached stats. Both come before the packets that acknowledge them: a
    /// peer that sees our ACK may act on it (even close) before we would
    /// otherwise have published the receive it acknowledges, and one that
    /// sees our response may read the counters (remote operations served).
    fn publish(&self, inner: &mut Inner, handler_follows: bool) {
        let mut wcs = Vec::new();
        while let Some(c) = inner.qp.poll_completion() {
            wcs.push(work_completion(self.qpn, c));
        }
        if !wcs.is_empty() {
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
    fn transmit_releasing(self: &Arc<Self>, g: &mut MutexGuard<'_, Inner>, handler_follows: bool) {
        self.transmit(g, handler_follows);
        if g.qp.ack_held() && g.backlog.is_empty() {
            g.qp.release_ack();
            self.transmit(g, handler_follows);
        }
    }

    fn transmit(self: &Arc<Self>, g: &mut MutexGuard<'_, Inner>, handler_follows: bool) {
        let inner = &mut **g;
        let (Some(tx), Some(peer)) = (inner.tx.clone(), inner.peer) else {
            // Not connected: drop anything the engine queued (e.g. flush-time ACKs).
            while inner.qp.poll_transmit(self.dev.now()).is_some() {}
            return;
        };
        let now = self.dev.now();
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
    fn listen_while_sending(self: &Arc<Self>, g: &mut MutexGuard<'_, Inner>) -> bool {
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
                    qp.transmit_releasing(&mut g, false);
                    qp.update_deadline(&mut g);
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

    fn on_timer(self: &Arc<Self>, now: u64) {
        self.inner.lock().qp.handle_timeout(now);
        self.pump_inline();
    }

    /// Feed one verified packet to the engine (the caller pumps afterwards).
    fn receive(&self, now: u64, from: SocketAddr, pkt: &Packet, ce: bool) {
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
struct SoftQpHandle(Arc<SoftQp>);

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
