//! The transport-neutral target: one NVM subsystem with its namespaces, the
//! discovery subsystem, dynamic controllers, and the command state machine
//! every transport drives (as SPDK's nvmf target separates `ctrlr.c` from
//! its transports).
//!
//! A transport hands each queue's commands here: [`Target::connect`] for
//! the Fabrics Connect that binds a queue to a controller, then
//! [`Target::execute`] for everything else, with the host-to-controller
//! data already gathered; the [`Completion`] carries the controller-to-host
//! data back. [`Target::queue_closed`] ends a queue.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

use crate::backend::Backend;
use crate::metrics::{IoOp, NamespaceStats, TargetStats};
use crate::nvme::command::{admin, fabrics, io, Completion, Sqe};
use crate::nvme::identify::{self, DiscoveryEntry, DISCOVERY_NQN, MAX_CMD, MAX_TRANSFER};
use crate::nvme::status::Status;

/// I/O queues a controller may have (granted by Set Features 07h).
pub const MAX_IO_QUEUES: u16 = 16;
/// CAP: MQES 127 (0's based), CQR, TO 15 (7.5 s), CSS NVM, MPSMIN 0
/// (NVMe Base 2.0 §3.1.3.1; the reference's suggested value).
pub const CAP: u64 = 0x0000_0020_0F01_007F;

/// Controller register offsets (NVMe Base 2.0 §3.1.3).
mod reg {
    pub(super) const CAP: u32 = 0x00;
    pub(super) const VS: u32 = 0x08;
    pub(super) const CC: u32 = 0x14;
    pub(super) const CSTS: u32 = 0x1C;
}

/// A namespace: blocks on a backend.
pub struct Namespace {
    nsid: u32,
    backend: Arc<dyn Backend>,
    lba_shift: u8,
    blocks: u64,
    nguid: [u8; 16],
    /// Its counters.
    pub stats: NamespaceStats,
}

impl Namespace {
    /// The namespace ID.
    pub fn nsid(&self) -> u32 {
        self.nsid
    }

    /// Size in logical blocks.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// Logical block size in bytes.
    pub fn block_size(&self) -> u32 {
        1 << self.lba_shift
    }

    /// Run `f` on the backend, off the async workers when it blocks.
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Backend) -> std::io::Result<T> + Send + 'static,
    ) -> std::io::Result<T> {
        let b = self.backend.clone();
        if b.volatile() {
            tokio::task::spawn_blocking(move || f(&*b))
                .await
                .map_err(std::io::Error::other)?
        } else {
            f(&*b)
        }
    }

    /// Check `[slba, slba + nlb)` and return its byte offset and length.
    fn range(&self, slba: u64, nlb: u64) -> Result<(u64, u64), Status> {
        match slba.checked_add(nlb) {
            Some(end) if end <= self.blocks => Ok((slba << self.lba_shift, nlb << self.lba_shift)),
            _ => Err(Status::LBA_OUT_OF_RANGE),
        }
    }
}

/// How to build a target.
#[derive(Clone, Debug)]
pub struct TargetConfig {
    /// The NVM subsystem's NQN.
    pub nqn: String,
    /// Serial number reported in Identify Controller.
    pub serial: String,
    /// log2 of the logical block size of new namespaces (9: 512 B, 12: 4 KiB).
    pub lba_shift: u8,
}

impl Default for TargetConfig {
    fn default() -> Self {
        TargetConfig {
            nqn: "nqn.2026-11.io.rdmx:block".into(),
            serial: "rdmx0001".into(),
            lba_shift: 9,
        }
    }
}

#[derive(Clone, Copy, Default)]
struct Regs {
    cc: u32,
    csts: u32,
}

/// A controller: the state one host's admin queue created (dynamic model).
pub struct Controller {
    cntlid: u16,
    discovery: bool,
    subnqn: String,
    hostnqn: String,
    hostid: [u8; 16],
    regs: Mutex<Regs>,
    kato_ms: AtomicU32,
    last_keep_alive: Mutex<Instant>,
    /// A command came on one of its queues since the keep-alive timer last
    /// looked (Traffic Based Keep Alive: it counts as a Keep Alive).
    traffic: AtomicBool,
    granted_queues: AtomicU16,
    connected: Mutex<BTreeSet<u16>>,
    aers: AtomicU32,
    aec: AtomicU32,
    dead: watch::Sender<bool>,
}

impl Controller {
    /// Restart the keep-alive timer for a Keep Alive (or a new KATO).
    fn keep_alive_received(&self) {
        let since = std::mem::replace(&mut *self.last_keep_alive.lock(), Instant::now());
        tracing::debug!(
            cntlid = self.cntlid,
            since_ms = since.elapsed().as_millis() as u64,
            "keep alive"
        );
    }

    /// Its controller ID.
    pub fn cntlid(&self) -> u16 {
        self.cntlid
    }

    /// Whether it is the discovery controller.
    pub fn is_discovery(&self) -> bool {
        self.discovery
    }

    /// Resolves when the controller is gone (keep-alive expired, its admin
    /// queue closed): transports then close its queues.
    pub fn gone(&self) -> watch::Receiver<bool> {
        self.dead.subscribe()
    }

    fn ready(&self) -> bool {
        let r = self.regs.lock();
        r.cc & 1 == 1 && r.csts & 1 == 1
    }
}

/// One queue as a transport connection sees it.
pub struct Queue {
    /// Queue ID (0: admin).
    pub qid: u16,
    /// Submission queue size, 0's based, from Connect.
    pub sqsize: u16,
    /// The controller, once connected.
    pub ctrl: Option<Arc<Controller>>,
    /// The local address the host reached (discovery log entries for
    /// wildcard ports name it).
    pub local: Option<SocketAddr>,
}

impl Queue {
    /// Resolves when the controller of `queue` goes (keep-alive expired, its
    /// admin queue closed); never for a queue not yet connected.
    pub async fn controller_gone(queue: Option<&Queue>) {
        match queue.and_then(|q| q.ctrl.as_ref()) {
            Some(c) => {
                let _ = c.gone().wait_for(|&x| x).await;
            }
            None => std::future::pending::<()>().await,
        }
    }

    /// A queue not yet connected.
    pub fn new(local: Option<SocketAddr>) -> Queue {
        Queue {
            qid: 0,
            sqsize: 0,
            ctrl: None,
            local,
        }
    }
}

/// The target: a subsystem, its namespaces, the discovery service.
pub struct Target {
    cfg: TargetConfig,
    namespaces: RwLock<Vec<Arc<Namespace>>>,
    controllers: Mutex<HashMap<u16, Arc<Controller>>>,
    next_cntlid: AtomicU16,
    ports: RwLock<Vec<SocketAddr>>,
    genctr: AtomicU64,
    /// Target-wide counters.
    pub stats: TargetStats,
}

impl Target {
    /// A target with no namespaces yet.
    pub fn new(cfg: TargetConfig) -> Arc<Target> {
        Arc::new(Target {
            cfg,
            namespaces: RwLock::new(Vec::new()),
            controllers: Mutex::new(HashMap::new()),
            next_cntlid: AtomicU16::new(1),
            ports: RwLock::new(Vec::new()),
            genctr: AtomicU64::new(1),
            stats: TargetStats::default(),
        })
    }

    /// The subsystem NQN.
    pub fn nqn(&self) -> &str {
        &self.cfg.nqn
    }

    /// Add a namespace on `backend`; returns its NSID. Its NGUID derives
    /// from the subsystem NQN and the NSID, so it is stable across restarts.
    pub fn add_namespace(&self, backend: Arc<dyn Backend>) -> Result<u32, String> {
        let shift = self.cfg.lba_shift;
        if !matches!(shift, 9 | 12) {
            return Err(format!("block size 2^{shift}: use 512 or 4096"));
        }
        let align = backend.block_align().max(1);
        if (1u32 << shift) % align != 0 {
            return Err(format!(
                "{}: its I/O must keep {align}-byte alignment, which {}-byte blocks do not \
                 (use a {align}-byte block size, or no direct I/O)",
                backend.describe(),
                1u32 << shift
            ));
        }
        let blocks = backend.len() >> shift;
        if blocks == 0 {
            return Err(format!(
                "{}: smaller than one {}-byte block",
                backend.describe(),
                1u32 << shift
            ));
        }
        let mut ns = self.namespaces.write();
        let nsid = ns.len() as u32 + 1;
        let mut nguid = [0u8; 16];
        let a = crc32c::crc32c(self.cfg.nqn.as_bytes());
        let b = crc32c::crc32c_append(a, &nsid.to_le_bytes());
        nguid[0..4].copy_from_slice(b"rdmx");
        nguid[4..8].copy_from_slice(&a.to_be_bytes());
        nguid[8..12].copy_from_slice(&b.to_be_bytes());
        nguid[12..16].copy_from_slice(&nsid.to_be_bytes());
        ns.push(Arc::new(Namespace {
            nsid,
            backend,
            lba_shift: shift,
            blocks,
            nguid,
            stats: NamespaceStats::default(),
        }));
        self.genctr.fetch_add(1, Relaxed);
        Ok(nsid)
    }

    /// The namespaces.
    pub fn namespaces(&self) -> Vec<Arc<Namespace>> {
        self.namespaces.read().clone()
    }

    /// Record a transport port (for the discovery log).
    pub fn add_port(&self, addr: SocketAddr) {
        self.ports.write().push(addr);
        self.genctr.fetch_add(1, Relaxed);
    }

    /// Prometheus text of the target's counters.
    pub fn metrics(&self, out: &mut String) {
        let ns = self.namespaces();
        let v: Vec<(u32, &NamespaceStats)> = ns.iter().map(|n| (n.nsid, &n.stats)).collect();
        crate::metrics::render(out, &self.stats, &v);
    }

    fn namespace(&self, nsid: u32) -> Option<Arc<Namespace>> {
        let ns = self.namespaces.read();
        nsid.checked_sub(1)
            .and_then(|i| ns.get(i as usize))
            .cloned()
    }

    /// Fabrics Connect (NVMe-oF 1.1 §3.3): bind `q` to a new controller
    /// (admin queue) or to the host's existing one (I/O queue).
    pub fn connect(self: &Arc<Self>, q: &mut Queue, sqe: &Sqe, data: &[u8]) -> Completion {
        let fail = |status: Status, in_data: bool, offset: u32| Completion {
            dw0: u32::from(in_data) << 16 | offset,
            status,
            ..Completion::default()
        };
        if q.ctrl.is_some() {
            return Completion::error(Status::COMMAND_SEQUENCE_ERROR);
        }
        if data.len() < 1024 {
            return Completion::error(Status::SGL_LENGTH_INVALID);
        }
        let recfmt = sqe.dw(10) & 0xFFFF;
        let qid = (sqe.dw(10) >> 16) as u16;
        let sqsize = (sqe.dw(11) & 0xFFFF) as u16;
        let kato = sqe.dw(12);
        if recfmt != 0 {
            return Completion::error(Status::CONNECT_INCOMPATIBLE_FORMAT);
        }
        if sqsize == 0 || sqsize >= MAX_CMD {
            return fail(Status::CONNECT_INVALID_PARAMETERS, false, 44);
        }
        let hostid: [u8; 16] = data[0..16].try_into().expect("16");
        let cntlid = u16::from_le_bytes([data[16], data[17]]);
        let cstr = |b: &[u8]| {
            let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
            String::from_utf8_lossy(&b[..end]).into_owned()
        };
        let subnqn = cstr(&data[256..512]);
        let hostnqn = cstr(&data[512..768]);
        if hostnqn.is_empty() {
            return fail(Status::CONNECT_INVALID_HOST, true, 512);
        }
        if qid == 0 {
            let discovery = subnqn == DISCOVERY_NQN;
            if !discovery && subnqn != self.cfg.nqn {
                tracing::info!(%subnqn, %hostnqn, "connect to an unknown subsystem");
                return fail(Status::CONNECT_INVALID_PARAMETERS, true, 256);
            }
            if cntlid != 0xFFFF {
                return fail(Status::CONNECT_INVALID_PARAMETERS, true, 16);
            }
            let Some(id) = self.allocate_cntlid() else {
                return Completion::error(Status::CONNECT_CONTROLLER_BUSY);
            };
            let ctrl = Arc::new(Controller {
                cntlid: id,
                discovery,
                subnqn,
                hostnqn,
                hostid,
                regs: Mutex::new(Regs::default()),
                kato_ms: AtomicU32::new(kato),
                last_keep_alive: Mutex::new(Instant::now()),
                traffic: AtomicBool::new(false),
                granted_queues: AtomicU16::new(0),
                connected: Mutex::new(BTreeSet::from([0])),
                aers: AtomicU32::new(0),
                aec: AtomicU32::new(0),
                dead: watch::channel(false).0,
            });
            self.controllers.lock().insert(id, ctrl.clone());
            if kato > 0 {
                if let Ok(rt) = tokio::runtime::Handle::try_current() {
                    rt.spawn(keep_alive_timer(Arc::downgrade(self), ctrl.clone()));
                }
            }
            tracing::info!(
                cntlid = id,
                host = %ctrl.hostnqn,
                discovery,
                kato_ms = kato,
                "controller created"
            );
            q.qid = 0;
            q.sqsize = sqsize;
            q.ctrl = Some(ctrl);
            return Completion::dw0(u32::from(id));
        }
        let Some(ctrl) = self.controllers.lock().get(&cntlid).cloned() else {
            return fail(Status::CONNECT_INVALID_PARAMETERS, true, 16);
        };
        if ctrl.subnqn != subnqn {
            return fail(Status::CONNECT_INVALID_PARAMETERS, true, 256);
        }
        if ctrl.hostnqn != hostnqn || ctrl.hostid != hostid {
            return fail(Status::CONNECT_INVALID_HOST, true, 512);
        }
        if ctrl.discovery || !ctrl.ready() {
            return Completion::error(Status::COMMAND_SEQUENCE_ERROR);
        }
        if qid > ctrl.granted_queues.load(Relaxed) {
            return fail(Status::CONNECT_INVALID_PARAMETERS, false, 42);
        }
        if !ctrl.connected.lock().insert(qid) {
            return Completion::error(Status::COMMAND_SEQUENCE_ERROR);
        }
        q.qid = qid;
        q.sqsize = sqsize;
        q.ctrl = Some(ctrl.clone());
        Completion::dw0(u32::from(ctrl.cntlid))
    }

    fn allocate_cntlid(&self) -> Option<u16> {
        let ctrls = self.controllers.lock();
        for _ in 0..0xFFF0 {
            let id = self.next_cntlid.fetch_add(1, Relaxed);
            if id == 0 || id > 0xFFEF {
                self.next_cntlid.store(1, Relaxed);
                continue;
            }
            if !ctrls.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }

    /// A queue's connection ended. Closing the admin queue ends the
    /// controller and with it every I/O queue it had.
    pub fn queue_closed(&self, q: &Queue) {
        let Some(ctrl) = &q.ctrl else { return };
        ctrl.connected.lock().remove(&q.qid);
        if q.qid == 0 {
            self.remove_controller(ctrl);
        }
    }

    fn remove_controller(&self, ctrl: &Controller) {
        if self.controllers.lock().remove(&ctrl.cntlid).is_some() {
            tracing::info!(cntlid = ctrl.cntlid, "controller removed");
        }
        let _ = ctrl.dead.send(true);
    }

    /// Execute a command other than Connect on `q`, whose host-to-controller
    /// data is `data`.
    pub async fn execute(&self, q: &Queue, sqe: &Sqe, data: Bytes) -> Completion {
        let c = self.execute_inner(q, sqe, data).await;
        if !c.status.is_success() {
            self.stats.error(c.status.name());
            tracing::debug!(
                qid = q.qid,
                opcode = sqe.opcode,
                cid = sqe.cid,
                status = ?c.status,
                "command failed"
            );
        }
        c
    }

    async fn execute_inner(&self, q: &Queue, sqe: &Sqe, data: Bytes) -> Completion {
        let Some(ctrl) = q.ctrl.clone() else {
            // Only Connect is allowed before Connect.
            return Completion::error(Status::COMMAND_SEQUENCE_ERROR);
        };
        // Traffic Based Keep Alive (CTRATT.TBKAS, NVMe Base 2.0 §3.9): any
        // command restarts the keep-alive timer, as nvmet does. A flag the
        // timer task reads, so the hot path only stores when it is clear.
        if !ctrl.traffic.load(Relaxed) {
            ctrl.traffic.store(true, Relaxed);
        }
        if sqe.flags & 0x03 != 0 {
            // Fused operations are not supported.
            return Completion::error(Status::INVALID_FIELD);
        }
        if sqe.is_fabrics() {
            return self.fabrics(q, &ctrl, sqe);
        }
        if sqe.flags & 0xC0 != 0x40 {
            // Fabrics require SGLs (PSDT 01b).
            return Completion::error(Status::INVALID_FIELD);
        }
        if !ctrl.ready() {
            return Completion::error(Status::COMMAND_SEQUENCE_ERROR);
        }
        if q.qid == 0 {
            self.admin(q, &ctrl, sqe, data).await
        } else {
            self.io(sqe, data).await
        }
    }

    /// Fabrics commands after Connect: Property Get/Set (admin queue only).
    fn fabrics(&self, q: &Queue, ctrl: &Controller, sqe: &Sqe) -> Completion {
        match sqe.fctype() {
            fabrics::PROPERTY_GET if q.qid == 0 => {
                let eight = sqe.dw(10) & 7 == 1;
                let v: u64 = match sqe.dw(11) {
                    reg::CAP => CAP,
                    reg::VS => u64::from(identify::VERSION),
                    reg::CC => u64::from(ctrl.regs.lock().cc),
                    reg::CSTS => u64::from(ctrl.regs.lock().csts),
                    _ => return Completion::error(Status::INVALID_FIELD),
                };
                let v = if eight { v } else { v & 0xFFFF_FFFF };
                Completion {
                    dw0: v as u32,
                    dw1: (v >> 32) as u32,
                    ..Completion::default()
                }
            }
            fabrics::PROPERTY_SET if q.qid == 0 => {
                if sqe.dw(11) != reg::CC || sqe.dw(10) & 7 != 0 {
                    return Completion::error(Status::INVALID_FIELD);
                }
                self.set_cc(ctrl, sqe.dw(12));
                Completion::ok()
            }
            fabrics::CONNECT => Completion::error(Status::COMMAND_SEQUENCE_ERROR),
            _ => Completion::error(Status::INVALID_OPCODE),
        }
    }

    /// CC writes (NVMe Base 2.0 §3.1.3.5, §3.5): enable, disable, shutdown.
    fn set_cc(&self, ctrl: &Controller, cc: u32) {
        let mut r = ctrl.regs.lock();
        let was = r.cc;
        r.cc = cc;
        if cc >> 14 & 3 != 0 {
            // Shutdown: complete at once (SHST 10b), not ready any more.
            r.csts = (r.csts & !0x0D) | 0b10 << 2;
            return;
        }
        if cc & 1 == 1 && was & 1 == 0 {
            let mps = cc >> 7 & 0xF;
            let ams = cc >> 11 & 7;
            let css = cc >> 4 & 7;
            let (iosqes, iocqes) = (cc >> 16 & 0xF, cc >> 20 & 0xF);
            let queues_ok = ctrl.discovery || (iosqes == 6 && iocqes == 4);
            if mps == 0 && ams == 0 && css == 0 && queues_ok {
                r.csts = (r.csts & !0x0E) | 1;
            } else {
                r.csts |= 2; // CFS
                tracing::warn!(
                    cntlid = ctrl.cntlid,
                    cc,
                    "unsupported controller configuration"
                );
            }
        } else if cc & 1 == 0 {
            r.csts &= !0x0D;
        }
    }

    async fn admin(&self, q: &Queue, ctrl: &Controller, sqe: &Sqe, data: Bytes) -> Completion {
        let want = sqe.data_len() as usize;
        let clip = |b: Bytes| b.slice(..want.min(b.len()));
        match sqe.opcode {
            admin::IDENTIFY => {
                let cns = sqe.dw(10) & 0xFF;
                match (cns, ctrl.discovery) {
                    (0x01, _) => Completion::with_data(clip(identify::controller(
                        &identify::ControllerInfo {
                            cntlid: ctrl.cntlid,
                            serial: self.cfg.serial.clone(),
                            model: "rdmx block target".into(),
                            firmware: env!("CARGO_PKG_VERSION").into(),
                            subnqn: ctrl.subnqn.clone(),
                            nn: self.namespaces.read().len() as u32,
                            discovery: ctrl.discovery,
                            volatile_cache: self.namespaces().iter().any(|n| n.backend.volatile()),
                        },
                    ))),
                    (_, true) => Completion::error(Status::INVALID_FIELD),
                    (0x00, false) => match self.namespace(sqe.nsid) {
                        Some(ns) => Completion::with_data(clip(identify::namespace(
                            &identify::NamespaceInfo {
                                blocks: ns.blocks,
                                lba_shift: ns.lba_shift,
                                nguid: ns.nguid,
                                shared: true,
                            },
                        ))),
                        None => Completion::error(Status::INVALID_NAMESPACE),
                    },
                    (0x02, false) => {
                        let ids: Vec<u32> = self.namespaces().iter().map(|n| n.nsid).collect();
                        Completion::with_data(clip(identify::active_namespaces(
                            ids.into_iter(),
                            sqe.nsid,
                        )))
                    }
                    (0x03, false) => match self.namespace(sqe.nsid) {
                        Some(ns) => {
                            Completion::with_data(clip(identify::namespace_descriptors(&ns.nguid)))
                        }
                        None => Completion::error(Status::INVALID_NAMESPACE),
                    },
                    _ => Completion::error(Status::INVALID_FIELD),
                }
            }
            admin::GET_LOG_PAGE => self.get_log_page(q, ctrl, sqe),
            admin::SET_FEATURES => self.set_features(ctrl, sqe),
            admin::GET_FEATURES => self.get_features(ctrl, sqe),
            admin::KEEP_ALIVE => {
                if ctrl.kato_ms.load(Relaxed) == 0 {
                    return Completion::error(Status::KEEP_ALIVE_INVALID);
                }
                ctrl.keep_alive_received();
                Completion::ok()
            }
            admin::ABORT => Completion::dw0(1), // not aborted
            admin::ASYNC_EVENT => {
                if ctrl.aers.fetch_add(1, Relaxed) > u32::from(identify::AERL) {
                    ctrl.aers.fetch_sub(1, Relaxed);
                    return Completion::error(Status::AER_LIMIT_EXCEEDED);
                }
                // No event is ever raised (OAES 0): it stays outstanding until
                // the controller goes, then the transport closes the queue.
                let mut gone = ctrl.gone();
                let _ = gone.wait_for(|&g| g).await;
                ctrl.aers.fetch_sub(1, Relaxed);
                Completion::error(Status::INTERNAL_ERROR)
            }
            _ => {
                let _ = data;
                Completion::error(Status::INVALID_OPCODE)
            }
        }
    }

    fn get_log_page(&self, q: &Queue, ctrl: &Controller, sqe: &Sqe) -> Completion {
        let lid = sqe.dw(10) & 0xFF;
        let numd = (u64::from(sqe.dw(11) & 0xFFFF) << 16 | u64::from(sqe.dw(10) >> 16)) + 1;
        let len = numd * 4;
        let offset = u64::from(sqe.dw(12)) | u64::from(sqe.dw(13)) << 32;
        if offset % 4 != 0 || len > u64::from(MAX_TRANSFER) || len > u64::from(sqe.data_len()) {
            return Completion::error(Status::INVALID_FIELD);
        }
        let log: Bytes = match (lid, ctrl.discovery) {
            (0x70, true) => {
                identify::discovery_log(self.genctr.load(Relaxed), &self.discovery_entries(q.local))
            }
            (0x01, _) => Bytes::from(vec![0u8; 64]),
            (0x02, false) => {
                let ns = self.namespaces();
                let sum = |op: IoOp, bytes: bool| {
                    ns.iter()
                        .map(|n| {
                            if bytes {
                                n.stats.bytes(op)
                            } else {
                                n.stats.ops(op)
                            }
                        })
                        .sum::<u64>()
                };
                identify::smart_log(
                    sum(IoOp::Read, true),
                    sum(IoOp::Write, true),
                    sum(IoOp::Read, false),
                    sum(IoOp::Write, false),
                )
            }
            (0x03, false) => Bytes::from(vec![0u8; 512]),
            (0x05, false) => identify::command_effects(
                &[
                    admin::GET_LOG_PAGE,
                    admin::IDENTIFY,
                    admin::ABORT,
                    admin::SET_FEATURES,
                    admin::GET_FEATURES,
                    admin::ASYNC_EVENT,
                    admin::KEEP_ALIVE,
                ],
                &[
                    (io::FLUSH, false),
                    (io::WRITE, true),
                    (io::READ, false),
                    (io::WRITE_ZEROES, true),
                    (io::DSM, true),
                ],
            ),
            _ => return Completion::error(Status::INVALID_LOG_PAGE),
        };
        // The requested window, zero-filled past the log's end.
        let mut out = vec![0u8; len as usize];
        if offset < log.len() as u64 {
            let from = &log[offset as usize..];
            let n = from.len().min(out.len());
            out[..n].copy_from_slice(&from[..n]);
        }
        Completion::with_data(Bytes::from(out))
    }

    fn discovery_entries(&self, local: Option<SocketAddr>) -> Vec<DiscoveryEntry> {
        self.ports
            .read()
            .iter()
            .enumerate()
            .map(|(i, p)| {
                // A wildcard port is reached at the address this host used.
                let ip = match (p.ip().is_unspecified(), local) {
                    (true, Some(l)) => l.ip(),
                    _ => p.ip(),
                };
                DiscoveryEntry {
                    subnqn: self.cfg.nqn.clone(),
                    traddr: ip.to_canonical().to_string(),
                    trsvcid: p.port().to_string(),
                    ipv6: ip.to_canonical().is_ipv6(),
                    portid: i as u16 + 1,
                    subtype: 2,
                }
            })
            .collect()
    }

    fn set_features(&self, ctrl: &Controller, sqe: &Sqe) -> Completion {
        let v = sqe.dw(11);
        match sqe.dw(10) & 0xFF {
            0x07 if !ctrl.discovery => {
                let (nsq, ncq) = (v & 0xFFFF, v >> 16);
                if nsq == 0xFFFF || ncq == 0xFFFF {
                    return Completion::error(Status::INVALID_FIELD);
                }
                // Grant what was asked up to our limit (0's based values).
                let g = nsq.min(ncq).min(u32::from(MAX_IO_QUEUES) - 1);
                ctrl.granted_queues.store(g as u16 + 1, Relaxed);
                Completion::dw0(g | g << 16)
            }
            0x0F => {
                ctrl.kato_ms.store(v, Relaxed);
                ctrl.keep_alive_received();
                Completion::ok()
            }
            0x0B => {
                ctrl.aec.store(v, Relaxed);
                Completion::dw0(v)
            }
            0x06 if !ctrl.discovery => Completion::ok(),
            _ => Completion::error(Status::INVALID_FIELD),
        }
    }

    fn get_features(&self, ctrl: &Controller, sqe: &Sqe) -> Completion {
        match sqe.dw(10) & 0xFF {
            0x07 if !ctrl.discovery => {
                let g = u32::from(ctrl.granted_queues.load(Relaxed).max(1) - 1);
                Completion::dw0(g | g << 16)
            }
            0x06 if !ctrl.discovery => Completion::dw0(u32::from(
                self.namespaces().iter().any(|n| n.backend.volatile()),
            )),
            0x0F => Completion::dw0(ctrl.kato_ms.load(Relaxed)),
            0x0B => Completion::dw0(ctrl.aec.load(Relaxed)),
            0x81 if sqe.dw(11) & 1 == 1 => {
                Completion::with_data(Bytes::copy_from_slice(&ctrl.hostid))
            }
            _ => Completion::error(Status::INVALID_FIELD),
        }
    }

    /// NVM command set I/O (NVM Command Set 1.0 §3.2).
    async fn io(&self, sqe: &Sqe, data: Bytes) -> Completion {
        let Some(ns) = self.namespace(sqe.nsid) else {
            return Completion::error(Status::INVALID_NAMESPACE);
        };
        let t0 = Instant::now();
        let media = |e: std::io::Error, s: Status| {
            tracing::warn!(nsid = ns.nsid, error = %e, "backend I/O failed");
            Completion::error(s)
        };
        let (op, bytes, c) = match sqe.opcode {
            io::READ | io::WRITE => {
                let (off, len) = match ns.range(sqe.slba(), u64::from(sqe.nlb())) {
                    Ok(r) => r,
                    Err(s) => return Completion::error(s),
                };
                if len > u64::from(MAX_TRANSFER) {
                    return Completion::error(Status::INVALID_FIELD);
                }
                if u64::from(sqe.data_len()) != len {
                    return Completion::error(Status::SGL_LENGTH_INVALID);
                }
                if sqe.opcode == io::READ {
                    let c = match ns.run(move |b| b.read(off, len as usize)).await {
                        Ok(d) => Completion::with_data(d),
                        Err(e) => media(e, Status::UNRECOVERED_READ_ERROR),
                    };
                    (IoOp::Read, len, c)
                } else {
                    if data.len() as u64 != len {
                        return Completion::error(Status::SGL_LENGTH_INVALID);
                    }
                    let fua = sqe.fua();
                    let c = match ns.run(move |b| b.write(off, &data, fua)).await {
                        Ok(()) => Completion::ok(),
                        Err(e) => media(e, Status::WRITE_FAULT),
                    };
                    (IoOp::Write, len, c)
                }
            }
            io::FLUSH => {
                let c = match ns.run(|b| b.flush()).await {
                    Ok(()) => Completion::ok(),
                    Err(e) => media(e, Status::WRITE_FAULT),
                };
                (IoOp::Flush, 0, c)
            }
            io::WRITE_ZEROES => {
                let (off, len) = match ns.range(sqe.slba(), u64::from(sqe.nlb())) {
                    Ok(r) => r,
                    Err(s) => return Completion::error(s),
                };
                let fua = sqe.fua();
                let c = match ns.run(move |b| b.zero(off, len, fua)).await {
                    Ok(()) => Completion::ok(),
                    Err(e) => media(e, Status::WRITE_FAULT),
                };
                (IoOp::WriteZeroes, len, c)
            }
            io::DSM => {
                let nr = (sqe.dw(10) & 0xFF) as usize + 1;
                if data.len() < nr * 16 {
                    return Completion::error(Status::SGL_LENGTH_INVALID);
                }
                if sqe.dw(11) & 4 == 0 {
                    // Only attributes (IDR/IDW) hints: nothing to do.
                    return Completion::ok();
                }
                // Ranges: CATTR u32, NLB u32 (1's based), SLBA u64.
                let mut ranges = Vec::with_capacity(nr);
                for r in data[..nr * 16].chunks_exact(16) {
                    let nlb = u32::from_le_bytes(r[4..8].try_into().expect("4"));
                    let slba = u64::from_le_bytes(r[8..16].try_into().expect("8"));
                    match ns.range(slba, u64::from(nlb)) {
                        Ok(r) => ranges.push(r),
                        Err(s) => return Completion::error(s),
                    }
                }
                let total = ranges.iter().map(|r| r.1).sum();
                let c = match ns
                    .run(move |b| ranges.iter().try_for_each(|&(o, l)| b.zero(o, l, false)))
                    .await
                {
                    Ok(()) => Completion::ok(),
                    Err(e) => media(e, Status::WRITE_FAULT),
                };
                (IoOp::Trim, total, c)
            }
            _ => return Completion::error(Status::INVALID_OPCODE),
        };
        if c.status.is_success() {
            ns.stats.record(op, bytes, t0.elapsed());
        }
        c
    }
}

/// Drop a controller whose host stopped sending Keep Alive within KATO
/// (rounded up to whole seconds, as nvmet does; NVMe Base 2.0 §3.9). Any
/// other command counts as a Keep Alive too (TBKAS, which Identify
/// Controller advertises): a host whose I/O flows stays connected even when
/// its admin queue is slow.
async fn keep_alive_timer(target: std::sync::Weak<Target>, ctrl: Arc<Controller>) {
    let mut gone = ctrl.gone();
    loop {
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = gone.wait_for(|&g| g) => return,
        }
        let kato = ctrl.kato_ms.load(Relaxed);
        if kato == 0 {
            continue;
        }
        let limit = Duration::from_secs(u64::from(kato).div_ceil(1000));
        if ctrl.traffic.swap(false, Relaxed) {
            *ctrl.last_keep_alive.lock() = Instant::now();
        }
        if ctrl.last_keep_alive.lock().elapsed() > limit {
            let Some(t) = target.upgrade() else { return };
            tracing::warn!(
                cntlid = ctrl.cntlid,
                kato_ms = kato,
                "keep-alive timer expired"
            );
            t.stats.keep_alive_expired.fetch_add(1, Relaxed);
            ctrl.regs.lock().csts |= 2; // CFS
            t.remove_controller(&ctrl);
            return;
        }
    }
}
