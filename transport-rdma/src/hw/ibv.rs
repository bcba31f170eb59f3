//! The verbs calls of the hardware provider: `sideway` for devices, PDs,
//! MRs, CQs and QPs, `rdma-mummy-sys` for what sideway does not wrap
//! (`ibv_req_notify_cq`, `ibv_get_cq_event`/`ibv_ack_cq_events`, and a raw
//! `ibv_poll_cq` that returns the QP number and flags of each completion).
//!
//! Everything this module decides is decided in [`super::plan`],
//! [`super::track`] and [`super::slab`], which are tested without a NIC.
//! What is left here are the calls themselves; each `unsafe` block says why
//! it is sound.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::io::IoSlice;
use std::net::{IpAddr, Ipv6Addr};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;
use rdmx_core::{
    Access, DeviceMemory, DeviceRegistration, Domain, Error, MemoryRegion, Result, Stats,
};
use sideway::ibverbs::address::{AddressHandleAttribute, Gid};
use sideway::ibverbs::completion::{BasicCompletionQueue, CompletionChannel, CompletionQueue as _};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::protection_domain::ProtectionDomain as IbvPd;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair as _, QueuePairAttribute, QueuePairAttributeMask,
    QueuePairState, SetInlineData, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;

use super::plan::{self, AtomicReply, DataPath, LocalPort};
use super::slab::{BufPool, Registrar, Slot};
use super::track::{RecvTrack, SendTrack};
use crate::sysfs;
use crate::verbs::{
    CompletionQueue, PortInfo, ProtectionDomain, Provider, ProviderKind, QpOptions, QpPeer,
    QpState, QueuePair, SendOp, SendWr, WcOpcode, WcStatus, WorkCompletion,
};

/// Bit set in the wr_id of receives (send ids never reach it).
const RECV_TAG: u64 = 1 << 63;

/// How the hardware provider is set up. [`HwConfig::from_env`] reads the
/// environment; every field can be set in code too.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HwConfig {
    /// Device to open (`mlx5_0`); the first one if `None` (`RDMX_RDMA_DEVICE`).
    pub device: Option<String>,
    /// IP traffic class of our packets, DSCP << 2 (`RDMX_HW_TRAFFIC_CLASS`;
    /// e.g. 106 for DSCP 26, a common lossless class).
    pub traffic_class: u8,
    /// Largest SEND/WRITE copied into the work request itself.
    pub max_inline: u32,
    /// Largest send queue per QP (the connection asks for `max_inflight`;
    /// the device's `max_qp_wr` caps it too).
    pub sq_depth: u32,
    /// In a batch, signal at least every this many requests.
    pub signal_every: usize,
    /// Receive memory a connection may pin (`RDMX_HW_RECV_BUDGET`, bytes).
    pub recv_budget: u64,
    /// The sysfs mount that lists RDMA devices under `class/infiniband`
    /// (for GID and MTU selection): `/sys`, or `RDMX_SYSFS_ROOT`.
    pub sysfs_root: PathBuf,
    /// Atomic reply layout override (`RDMX_HW_ATOMIC_REPLY=host|be`).
    pub atomic_reply: Option<String>,
    /// Use this GID index instead of choosing one (`RDMX_RDMA_GID_INDEX`).
    pub gid_index: Option<u32>,
    /// With `gid_index`: on this port (`RDMX_RDMA_PORT`).
    pub port: Option<u32>,
}

impl HwConfig {
    /// Defaults, overridden by the `RDMX_*` environment variables.
    pub fn from_env() -> HwConfig {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        HwConfig {
            device: var(plan::DEVICE_ENV),
            traffic_class: var("RDMX_HW_TRAFFIC_CLASS")
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            max_inline: 64,
            sq_depth: 16384,
            signal_every: 32,
            recv_budget: plan::recv_budget(),
            sysfs_root: PathBuf::from(var("RDMX_SYSFS_ROOT").unwrap_or_else(|| "/sys".into())),
            atomic_reply: var("RDMX_HW_ATOMIC_REPLY"),
            gid_index: var("RDMX_RDMA_GID_INDEX").and_then(|v| v.parse().ok()),
            port: var("RDMX_RDMA_PORT").and_then(|v| v.parse().ok()),
        }
    }
}

fn verbs_err(what: &str, e: impl std::fmt::Display) -> Error {
    Error::ResourceExhausted(format!("{what}: {e}"))
}

/// A real RDMA NIC (RoCEv2), opened through libibverbs.
pub struct HwProvider {
    ctx: Arc<DeviceContext>,
    name: String,
    cfg: HwConfig,
    reply: AtomicReply,
    max_rd_atomic: u32,
    pds: Mutex<HashMap<u64, Weak<HwPd>>>,
}

impl std::fmt::Debug for HwProvider {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HwProvider")
            .field("device", &self.name)
            .finish()
    }
}

impl HwProvider {
    /// Open the configured device, once per configuration per process (later
    /// calls return the same provider). On a host without libibverbs or
    /// without RDMA devices this fails with `Error::Unsupported("no RDMA devices …")`.
    pub fn open(cfg: HwConfig) -> Result<Arc<HwProvider>> {
        // One provider (device context) per configuration per process, as
        // `hardware()` has: a domain binds to one protection domain per
        // device, so a second context of the same NIC would be refused by a
        // domain the first one bound (the process-wide default domain, say).
        static OPEN: Mutex<Vec<(HwConfig, Arc<HwProvider>)>> = Mutex::new(Vec::new());
        let mut open = OPEN.lock();
        if let Some((_, p)) = open.iter().find(|(c, _)| *c == cfg) {
            return Ok(p.clone());
        }
        let p = Self::open_new(cfg.clone())?;
        open.push((cfg, p.clone()));
        Ok(p)
    }

    fn open_new(cfg: HwConfig) -> Result<Arc<HwProvider>> {
        let list = DeviceList::new().map_err(|e| e.to_string());
        let names = list
            .as_ref()
            .map(|l| l.iter().map(|d| d.name()).collect::<Vec<_>>())
            .map_err(|e| e.clone());
        let name = plan::choose_device(names, cfg.device.as_deref())?;
        let list = list.map_err(|e| Error::Unsupported(format!("no RDMA devices ({e})")))?;
        let dev = list
            .iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::Unsupported(format!("RDMA device {name} went away")))?;
        let ctx = dev
            .open()
            .map_err(|e| Error::Unsupported(format!("cannot open RDMA device {name}: {e}")))?;
        let attr = ctx
            .query_device()
            .map_err(|e| verbs_err(&format!("{name}: ibv_query_device"), e))?;
        let max_qp_wr = attr.max_qp_wr().max(16) as u32;
        let max_rd_atomic = attr.max_qp_rd_atom().min(attr.max_qp_init_rd_atom()).max(1) as u32;
        let reply = AtomicReply::for_device(&name, cfg.atomic_reply.as_deref());
        tracing::info!(device = %name, ?reply, max_rd_atomic, "RDMA device opened");
        let cfg = HwConfig {
            sq_depth: cfg.sq_depth.min(max_qp_wr),
            ..cfg
        };
        Ok(Arc::new(HwProvider {
            ctx,
            name,
            cfg,
            reply,
            max_rd_atomic,
            pds: Mutex::new(HashMap::new()),
        }))
    }

    fn local_port(&self, local_ip: IpAddr) -> Result<(LocalPort, sysfs::GidChoice)> {
        local_port(&self.name, &self.cfg, self.max_rd_atomic, local_ip)
    }
}

impl Provider for HwProvider {
    fn kind(&self) -> ProviderKind {
        ProviderKind::Hardware
    }

    fn device_name(&self) -> String {
        self.name.clone()
    }

    fn port_for(&self, local_ip: IpAddr, _peer_ip: IpAddr) -> Result<PortInfo> {
        let (_, choice) = self.local_port(local_ip)?;
        // The kernel's sysfs has no active MTU (ibv_devinfo asks the device,
        // as here); sysfs only has one in test trees.
        let mtu = self
            .ctx
            .query_port(choice.port as u8)
            .ok()
            .map(|a| 128u32 << (a.active_mtu() as u32))
            .filter(|m| (256..=4096).contains(m))
            .or(choice.mtu)
            .unwrap_or(1024);
        Ok(PortInfo {
            gid: choice.addr,
            udp_port: plan::ROCEV2_PORT,
            mtu,
            max_rd_atomic: self.max_rd_atomic,
        })
    }

    fn selective_repeat(&self) -> bool {
        false
    }

    fn recv_credits(&self, credits: u32, max_message: u64) -> u32 {
        plan::hw_recv_credits(credits, max_message, self.cfg.recv_budget)
    }

    fn alloc_pd(&self, domain: &Domain) -> Result<Arc<dyn ProtectionDomain>> {
        let mut pds = self.pds.lock();
        pds.retain(|_, w| w.strong_count() > 0);
        if let Some(pd) = pds.get(&domain.id()).and_then(Weak::upgrade) {
            return Ok(pd);
        }
        let pd = self
            .ctx
            .alloc_pd()
            .map_err(|e| verbs_err(&format!("{}: ibv_alloc_pd", self.name), e))?;
        let hw = Arc::new(HwPd {
            pool: BufPool::new(Arc::new(PdRegistrar(pd.clone()))),
            pd,
            name: self.name.clone(),
            ctx_provider: ProviderRef {
                name: self.name.clone(),
                cfg: self.cfg.clone(),
                max_rd_atomic: self.max_rd_atomic,
            },
        });
        // Every region of the domain, now and later, is registered with this PD.
        domain.bind_device(hw.clone())?;
        pds.insert(domain.id(), Arc::downgrade(&hw));
        Ok(hw)
    }

    fn create_cq(&self, depth: usize) -> Result<Arc<dyn CompletionQueue>> {
        let channel = CompletionChannel::new(&self.ctx)
            .map_err(|e| verbs_err(&format!("{}: ibv_create_comp_channel", self.name), e))?;
        channel
            .set_nonblocking(true)
            .map_err(|e| verbs_err("completion channel O_NONBLOCK", e))?;
        let cqe = (depth as u32).max(64) * 2 + self.cfg.sq_depth;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(cqe)
            .setup_comp_channel(&channel, 0)
            .build()
            .map_err(|e| verbs_err(&format!("{}: ibv_create_cq({cqe})", self.name), e))?;
        Ok(Arc::new(HwCq {
            cq,
            channel,
            qps: Mutex::new(HashMap::new()),
            reply: self.reply,
        }))
    }
}

/// Where `local_ip` is on NIC `name`: port, GID index and MTU, from sysfs
/// (the RoCEv2 GID of that address, or the configured GID index).
fn local_port(
    name: &str,
    cfg: &HwConfig,
    max_rd_atomic: u32,
    local_ip: IpAddr,
) -> Result<(LocalPort, sysfs::GidChoice)> {
    let devs = sysfs::devices(&cfg.sysfs_root);
    let choice = match cfg.gid_index {
        Some(i) => sysfs::gid_by_index(&devs, name, i, cfg.port).ok_or_else(|| {
            Error::Connect(format!(
                "{name} has no GID index {i} on an active port (RDMX_RDMA_GID_INDEX)"
            ))
        })?,
        None => sysfs::choose_gid(
            &devs
                .into_iter()
                .filter(|d| d.name == name)
                .collect::<Vec<_>>(),
            local_ip,
        )
        .ok_or_else(|| {
            Error::Connect(format!(
                "{name} has no active RoCEv2 GID for local address {local_ip}: connect through \
                 an address of the NIC's interface (`rdmx doctor` lists them), or name one \
                 with RDMX_RDMA_GID_INDEX"
            ))
        })?,
    };
    let port = LocalPort {
        port: choice.port as u8,
        gid_index: choice.index as u8,
        max_rd_atomic,
        traffic_class: cfg.traffic_class,
    };
    Ok((port, choice))
}

/// What PDs and QPs need of their provider (a copy: `alloc_pd` has only `&self`).
#[derive(Clone, Debug)]
struct ProviderRef {
    name: String,
    cfg: HwConfig,
    max_rd_atomic: u32,
}

struct PdRegistrar(Arc<IbvPd>);

impl Registrar for PdRegistrar {
    fn register(&self, addr: u64, len: usize) -> Result<(u32, Box<dyn Send + Sync>)> {
        // SAFETY: the buffer pool owns `[addr, addr + len)` and keeps it
        // allocated until the returned guard (the MR) is dropped (slab.rs
        // drops the MR before freeing the chunk).
        let mr = unsafe { self.0.reg_mr(addr as usize, len, AccessFlags::LocalWrite) }
            .map_err(|e| memlock_hint(len, e))?;
        Ok((mr.lkey(), Box::new(mr)))
    }
}

fn memlock_hint(len: usize, e: impl std::fmt::Display) -> Error {
    Error::ResourceExhausted(format!(
        "ibv_reg_mr of {len} bytes: {e} (raise the memlock limit: `ulimit -l unlimited`; \
         `rdmx doctor` shows it)"
    ))
}

/// A protection domain on the NIC serving one rdmx [`Domain`].
struct HwPd {
    pd: Arc<IbvPd>,
    pool: BufPool,
    name: String,
    ctx_provider: ProviderRef,
}

impl DeviceMemory for HwPd {
    fn name(&self) -> String {
        self.name.clone()
    }

    fn register(&self, addr: u64, len: usize, access: Access) -> Result<DeviceRegistration> {
        let flags = AccessFlags::from(plan::mr_access(access) as i32);
        // SAFETY: `Domain` keeps the region's memory allocated at `addr` until
        // it drops the registration, which it does before freeing the memory
        // (core memory.rs, `revoke_now`).
        let mr = unsafe { self.pd.reg_mr(addr as usize, len, flags) }
            .map_err(|e| memlock_hint(len, e))?;
        Ok(DeviceRegistration {
            rkey: mr.rkey(),
            lkey: mr.lkey(),
            guard: Box::new(mr),
        })
    }
}

impl ProtectionDomain for HwPd {
    fn register(&self, mr: &MemoryRegion) -> Result<u32> {
        // The domain is bound to this PD: its key is the NIC's R_Key.
        Ok(mr.rkey())
    }

    fn create_qp(
        &self,
        cq: &Arc<dyn CompletionQueue>,
        opts: QpOptions,
    ) -> Result<Arc<dyn QueuePair>> {
        let hcq: Arc<HwCq> = cq
            .clone()
            .as_any()
            .downcast::<HwCq>()
            .map_err(|_| Error::InvalidArgument("CQ of another provider".into()))?;
        let cfg = &self.ctx_provider.cfg;
        let depth = opts.max_send_wr.clamp(16, cfg.sq_depth);
        let build = |inline: u32| {
            let mut b = self.pd.create_qp_builder();
            b.setup_max_send_wr(depth)
                .setup_max_recv_wr(4096)
                .setup_max_send_sge(1)
                .setup_max_recv_sge(1)
                .setup_max_inline_data(inline)
                .setup_send_cq(hcq.cq.clone())
                .setup_recv_cq(hcq.cq.clone());
            b.build()
        };
        // Some devices take less inline data than asked: then go without.
        let (qp, max_inline) = match build(cfg.max_inline) {
            Ok(qp) => (qp, cfg.max_inline),
            Err(e) if cfg.max_inline > 0 => {
                tracing::debug!(error = %e, "QP with inline data refused; creating one without");
                let qp =
                    build(0).map_err(|e| verbs_err(&format!("{}: ibv_create_qp", self.name), e))?;
                (qp, 0)
            }
            Err(e) => return Err(verbs_err(&format!("{}: ibv_create_qp", self.name), e)),
        };
        let qpn = qp.qp_number();
        let track = Arc::new(Mutex::new(Tracks {
            sends: SendTrack::new(depth as usize),
            recvs: RecvTrack::default(),
        }));
        hcq.qps.lock().insert(qpn, track.clone());
        Ok(Arc::new(HwQp {
            qp: Mutex::new(Some(qp)),
            qpn,
            pool: self.pool.clone(),
            cq: hcq,
            track,
            opts,
            max_inline,
            prov: self.ctx_provider.clone(),
            early_recvs: Mutex::new(Some(Vec::new())),
        }))
    }
}

/// The registries of one QP, shared with its CQ.
struct Tracks {
    sends: SendTrack<Option<Slot>>,
    recvs: RecvTrack<Slot>,
}

/// A completion queue with its completion channel.
struct HwCq {
    cq: Arc<BasicCompletionQueue>,
    channel: Arc<CompletionChannel>,
    qps: Mutex<HashMap<u32, Arc<Mutex<Tracks>>>>,
    reply: AtomicReply,
}

fn opcode_of(op: &SendOp) -> WcOpcode {
    match op {
        SendOp::Send { .. } => WcOpcode::Send,
        SendOp::Write { .. } => WcOpcode::Write,
        SendOp::Read { .. } => WcOpcode::Read,
        SendOp::CompareSwap { .. } => WcOpcode::CompareSwap,
        SendOp::FetchAdd { .. } => WcOpcode::FetchAdd,
    }
}

impl HwCq {
    fn convert(&self, wc: &rdma_mummy_sys::ibv_wc, out: &mut Vec<WorkCompletion>) {
        let status = WcStatus::from_ibv(wc.status);
        let Some(track) = self.qps.lock().get(&wc.qp_num).cloned() else {
            return; // a QP already destroyed: its requests were settled then
        };
        let mut t = track.lock();
        if wc.wr_id & RECV_TAG != 0 {
            let Some((wr_id, slot)) = t.recvs.complete(wc.wr_id & !RECV_TAG) else {
                return;
            };
            let with_imm = wc.wc_flags & rdma_mummy_sys::ibv_wc_flags::IBV_WC_WITH_IMM.0 != 0;
            // SAFETY: reading the `imm_data` member of a C union of two u32s
            // is always defined; it is meaningful when IBV_WC_WITH_IMM is set.
            let imm = with_imm
                .then(|| u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data }));
            let ok = status == WcStatus::Success;
            out.push(WorkCompletion {
                wr_id,
                qpn: wc.qp_num,
                status,
                opcode: if wc.opcode == rdma_mummy_sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM {
                    WcOpcode::RecvWriteImm
                } else {
                    WcOpcode::Recv
                },
                byte_len: u64::from(wc.byte_len),
                data: if ok {
                    slot.freeze(wc.byte_len as usize)
                } else {
                    Default::default()
                },
                imm,
                atomic_orig: None,
            });
            return;
        }
        for (p, st) in t.sends.complete(wc.wr_id, status) {
            let ok = st == WcStatus::Success;
            let (data, atomic_orig) = match (p.opcode, p.buf) {
                (WcOpcode::Read, Some(slot)) if ok => (slot.freeze(p.len as usize), None),
                (WcOpcode::CompareSwap | WcOpcode::FetchAdd, Some(slot)) if ok => {
                    (Default::default(), Some(self.reply.decode(slot.word())))
                }
                _ => (Default::default(), None),
            };
            out.push(WorkCompletion {
                wr_id: p.wr_id,
                qpn: wc.qp_num,
                status: st,
                opcode: p.opcode,
                byte_len: p.len,
                data,
                imm: None,
                atomic_orig,
            });
        }
    }
}

impl CompletionQueue for HwCq {
    fn poll(&self, out: &mut Vec<WorkCompletion>, max: usize) -> usize {
        let before = out.len();
        const BATCH: usize = 32;
        // SAFETY: `ibv_wc` is plain old data (integers and a union of
        // integers); all-zero is a valid value.
        let mut wcs: [rdma_mummy_sys::ibv_wc; BATCH] = unsafe { std::mem::zeroed() };
        while out.len() - before < max {
            let want = (max - (out.len() - before)).min(BATCH) as i32;
            // SAFETY: the CQ is alive (we hold it); `wcs` has room for `want`
            // entries; the provider's poll is thread-safe per CQ.
            let n = unsafe {
                rdma_mummy_sys::ibv_poll_cq(self.cq.cq().as_ptr(), want, wcs.as_mut_ptr())
            };
            if n <= 0 {
                if n < 0 {
                    tracing::warn!(rc = n, "ibv_poll_cq failed");
                }
                break;
            }
            for wc in &wcs[..n as usize] {
                self.convert(wc, out);
            }
            if n < want {
                break;
            }
        }
        out.len() - before
    }

    fn req_notify(&self) -> Result<()> {
        // SAFETY: the CQ is alive; arming is thread-safe.
        let rc = unsafe { rdma_mummy_sys::ibv_req_notify_cq(self.cq.cq().as_ptr(), 0) };
        if rc != 0 {
            return Err(Error::Disconnected(format!(
                "ibv_req_notify_cq: {}",
                std::io::Error::from_raw_os_error(rc)
            )));
        }
        Ok(())
    }

    fn event_fd(&self) -> BorrowedFd<'_> {
        // SAFETY: the fd belongs to the completion channel, which lives as
        // long as `self` (the borrow's lifetime).
        unsafe { BorrowedFd::borrow_raw(self.channel.as_raw_fd()) }
    }

    fn ack_events(&self) {
        let mut n = 0u32;
        loop {
            let mut cq = std::ptr::null_mut();
            let mut ctx = std::ptr::null_mut();
            // SAFETY: the channel is alive and non-blocking, so this returns
            // -1 (EAGAIN) when no event is pending instead of sleeping.
            let rc = unsafe {
                rdma_mummy_sys::ibv_get_cq_event(
                    self.channel.comp_channel().as_ptr(),
                    &mut cq,
                    &mut ctx,
                )
            };
            if rc != 0 {
                break;
            }
            n += 1;
        }
        if n > 0 {
            // SAFETY: acknowledges exactly the `n` events taken above, on our CQ
            // (ibv_destroy_cq waits for all events to be acknowledged).
            unsafe { rdma_mummy_sys::ibv_ack_cq_events(self.cq.cq().as_ptr(), n) };
        }
    }

    fn as_any(self: Arc<Self>) -> Arc<dyn std::any::Any + Send + Sync> {
        self
    }
}

/// An RC queue pair on the NIC.
struct HwQp {
    qp: Mutex<Option<BasicQueuePair>>,
    qpn: u32,
    pool: BufPool,
    cq: Arc<HwCq>,
    track: Arc<Mutex<Tracks>>,
    opts: QpOptions,
    /// Inline bytes this QP takes (0 if the device refused inline data).
    max_inline: u32,
    prov: ProviderRef,
    /// Receives asked for while the QP is still in RESET, posted when it
    /// reaches INIT (`None` from then on). A QP in RESET refuses receives
    /// (IBTA C10-97.2.1; rxe answers EINVAL), but rdmx posts its receive
    /// credits before the bootstrap exchange, so that no SEND can arrive
    /// before they are there.
    early_recvs: Mutex<Option<Vec<(u64, usize)>>>,
}

// SAFETY: the sideway QP is only touched under the mutex; libibverbs QPs
// may be used from any thread.
unsafe impl Send for HwQp {}
// SAFETY: as above.
unsafe impl Sync for HwQp {}

impl HwQp {
    fn modify(&self, attr: &QueuePairAttribute, what: &str) -> Result<()> {
        let mut g = self.qp.lock();
        let qp = g
            .as_mut()
            .ok_or_else(|| Error::Disconnected("QP destroyed".into()))?;
        qp.modify(attr).map_err(|e| {
            Error::Connect(format!(
                "{}: QP {:#x} {what}: {e}",
                self.prov.name, self.qpn
            ))
        })
    }

    /// Post one receive of up to `max_len` bytes now (the QP is past RESET).
    fn post_recv_now(&self, wr_id: u64, max_len: usize) -> Result<()> {
        let cap = receive_cap(max_len)?;
        let slot = self.pool.take(max_len.max(1))?;
        let (lkey, addr) = (slot.lkey(), slot.addr());
        let mut g = self.qp.lock();
        let qp = g
            .as_mut()
            .ok_or_else(|| Error::Disconnected("QP destroyed".into()))?;
        let mut t = self.track.lock();
        let id = t.recvs.push(wr_id, slot);
        let mut guard = qp.start_post_recv();
        let h = guard.construct_wr(id | RECV_TAG);
        // SAFETY: the slot is registered and stays in the registry until this
        // receive completes or the QP is destroyed.
        unsafe { h.setup_sge(lkey, addr, cap) };
        if let Err(e) = guard.post() {
            t.recvs.complete(id);
            return Err(Error::ResourceExhausted(format!("ibv_post_recv: {e}")));
        }
        Ok(())
    }

    /// Buffer and inline decision for one request.
    fn stage(&self, op: &SendOp) -> Result<(DataPath, Option<Slot>)> {
        let path = plan::data_path(op, self.max_inline);
        let slot = match (op, path) {
            (SendOp::Send { sg, .. } | SendOp::Write { sg, .. }, DataPath::Staged) => {
                let mut s = self.pool.take(op.len() as usize)?;
                s.fill(sg)?;
                Some(s)
            }
            (SendOp::Read { src }, _) => Some(self.pool.take(src.len as usize)?),
            (SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }, _) => Some(self.pool.take(8)?),
            _ => None,
        };
        Ok((path, slot))
    }
}

/// Attach a SEND's or WRITE's data: inline (copied into the work request)
/// or the staged slot.
fn attach_data<B: SetInlineData + SetScatterGatherEntry>(
    b: B,
    path: DataPath,
    sge: Option<(u32, u64)>,
    sg: &[bytes::Bytes],
    len: u32,
) {
    match (path, sge) {
        (DataPath::Inline, _) => {
            let io: Vec<IoSlice<'_>> = sg.iter().map(|s| IoSlice::new(s)).collect();
            b.setup_inline_data_list(&io);
        }
        // SAFETY: the staged slot is registered with this PD and stays in the
        // registry, unreused, until the completion of this request (or of a
        // later one) is polled.
        (_, Some((lkey, addr))) => unsafe { b.setup_sge(lkey, addr, len) },
        _ => {}
    }
}

/// A receive length as a work request takes it.
fn receive_cap(max_len: usize) -> Result<u32> {
    u32::try_from(max_len).map_err(|_| {
        Error::InvalidArgument(format!(
            "receive of {max_len} bytes: NICs take at most 4 GiB"
        ))
    })
}

fn mtu_enum(code: u32) -> Mtu {
    Mtu::from(code)
}

impl QueuePair for HwQp {
    fn qpn(&self) -> u32 {
        self.qpn
    }

    fn connect(&self, peer: QpPeer, sq_psn: u32) -> Result<()> {
        let (local, _) = local_port(
            &self.prov.name,
            &self.prov.cfg,
            self.prov.max_rd_atomic,
            peer.local,
        )?;
        let p = plan::qp_plan(&peer, sq_psn, &self.opts, &local)?;
        let mut init = QueuePairAttribute::new();
        init.setup_state(QueuePairState::Init)
            .setup_pkey_index(p.init.pkey_index)
            .setup_port(p.init.port)
            .setup_access_flags(AccessFlags::from(p.init.access as i32));
        self.modify(&init, "RESET -> INIT")?;
        // Now the receive queue takes work requests: post those asked for
        // in RESET, still before RTR, so they are there for the first SEND.
        let early = self.early_recvs.lock().take().unwrap_or_default();
        for (wr_id, max_len) in early {
            self.post_recv_now(wr_id, max_len)?;
        }
        let mut ah = AddressHandleAttribute::new();
        ah.setup_dest_lid(0).setup_port(p.rtr.port).setup_grh(
            &Gid::from(Ipv6Addr::from(p.rtr.dgid)),
            0,
            p.rtr.sgid_index,
            p.rtr.hop_limit,
            p.rtr.traffic_class,
        );
        let mut rtr = QueuePairAttribute::new();
        rtr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu_enum(p.rtr.path_mtu))
            .setup_dest_qp_num(p.rtr.dest_qpn)
            .setup_rq_psn(p.rtr.rq_psn)
            .setup_max_dest_read_atomic(p.rtr.max_dest_rd_atomic)
            .setup_min_rnr_timer(p.rtr.min_rnr_timer)
            .setup_address_vector(&ah);
        self.modify(
            &rtr,
            "INIT -> RTR (check the peer's GID, the route and the MTU)",
        )?;
        let mut rts = QueuePairAttribute::new();
        rts.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(p.rts.sq_psn)
            .setup_timeout(p.rts.timeout)
            .setup_retry_cnt(p.rts.retry_cnt)
            .setup_rnr_retry(p.rts.rnr_retry)
            .setup_max_read_atomic(p.rts.max_rd_atomic);
        self.modify(&rts, "RTR -> RTS")?;
        tracing::debug!(
            qpn = self.qpn,
            peer_qpn = peer.qpn,
            mtu = peer.mtu,
            "hw QP connected"
        );
        Ok(())
    }

    fn post_send(&self, wr: SendWr) -> Result<()> {
        self.post_send_batch(vec![wr])
    }

    fn post_send_batch(&self, wrs: Vec<SendWr>) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let signals = plan::signal_plan(wrs.iter().map(|w| &w.op), self.prov.cfg.signal_every);
        let mut staged = Vec::with_capacity(wrs.len());
        for w in &wrs {
            staged.push(self.stage(&w.op)?);
        }
        let mut g = self.qp.lock();
        let qp = g
            .as_mut()
            .ok_or_else(|| Error::Disconnected("QP destroyed".into()))?;
        let mut t = self.track.lock();
        if !t.sends.has_room(wrs.len()) {
            return Err(Error::ResourceExhausted(format!(
                "send queue full ({} requests outstanding)",
                t.sends.outstanding()
            )));
        }
        let mut ids = Vec::with_capacity(wrs.len());
        let mut guard = qp.start_post_send();
        for ((w, (path, slot)), signaled) in wrs.into_iter().zip(staged).zip(signals) {
            let sge = slot.as_ref().map(|s| (s.lkey(), s.addr()));
            let flags = if signaled {
                WorkRequestFlags::Signaled
            } else {
                WorkRequestFlags::none()
            };
            let len = w.op.len();
            let id = t.sends.push(w.wr_id, opcode_of(&w.op), len, signaled, slot);
            ids.push(id);
            let h = guard.construct_wr(id, flags);
            // SAFETY (every `setup_sge` below): as in `attach_data`.
            match w.op {
                SendOp::Send { sg, imm } => {
                    let b = match imm {
                        Some(i) => h.setup_send_imm(i.to_be()),
                        None => h.setup_send(),
                    };
                    attach_data(b, path, sge, &sg, len as u32);
                }
                SendOp::Write { sg, dst, imm } => {
                    let b = match imm {
                        Some(i) => h.setup_write_imm(dst.rkey, dst.addr, i.to_be()),
                        None => h.setup_write(dst.rkey, dst.addr),
                    };
                    attach_data(b, path, sge, &sg, len as u32);
                }
                SendOp::Read { src } => {
                    let b = h.setup_read(src.rkey, src.addr);
                    if let Some((lkey, addr)) = sge {
                        unsafe { b.setup_sge(lkey, addr, src.len as u32) };
                    }
                }
                SendOp::CompareSwap { dst, compare, swap } => {
                    let b = h.setup_atomic_compare_swap(dst.rkey, dst.addr, compare, swap);
                    if let Some((lkey, addr)) = sge {
                        unsafe { b.setup_sge(lkey, addr, 8) };
                    }
                }
                SendOp::FetchAdd { dst, add } => {
                    let b = h.setup_atomic_fetch_add(dst.rkey, dst.addr, add);
                    if let Some((lkey, addr)) = sge {
                        unsafe { b.setup_sge(lkey, addr, 8) };
                    }
                }
            }
        }
        if let Err(e) = guard.post() {
            if let [id] = ids[..] {
                // One request refused: the NIC never saw it.
                t.sends.unpush(id);
                return Err(Error::ResourceExhausted(format!("ibv_post_send: {e}")));
            }
            // Part of a batch may be on the NIC (ibv_post_send stops at the
            // bad request): keep every buffer registered and flush the QP, so
            // nothing is freed under a DMA.
            drop(t);
            drop(g);
            self.to_error();
            return Err(Error::Disconnected(format!(
                "ibv_post_send of a batch failed ({e}); queue pair flushed"
            )));
        }
        Ok(())
    }

    fn post_recv(&self, wr_id: u64, max_len: usize) -> Result<()> {
        let mut early = self.early_recvs.lock();
        if let Some(list) = early.as_mut() {
            receive_cap(max_len)?;
            list.push((wr_id, max_len));
            return Ok(());
        }
        drop(early);
        self.post_recv_now(wr_id, max_len)
    }

    fn state(&self) -> QpState {
        let g = self.qp.lock();
        let Some(qp) = g.as_ref() else {
            return QpState::Error;
        };
        match qp.query(QueuePairAttributeMask::State) {
            Ok((a, _)) => match a.state() {
                QueuePairState::ReadyToSend | QueuePairState::SendQueueDrain => QpState::Rts,
                QueuePairState::Error | QueuePairState::SendQueueError => QpState::Error,
                _ => QpState::Init,
            },
            Err(_) => QpState::Error,
        }
    }

    fn expected_psn(&self) -> u32 {
        let g = self.qp.lock();
        g.as_ref()
            .and_then(|qp| {
                qp.query(QueuePairAttributeMask::ReceiveQueuePacketSequenceNumber)
                    .ok()
            })
            .map(|(a, _)| a.rq_psn())
            .unwrap_or(0)
    }

    fn to_error(&self) {
        let mut a = QueuePairAttribute::new();
        a.setup_state(QueuePairState::Error);
        if let Err(e) = self.modify(&a, "-> ERROR") {
            tracing::debug!(error = %e, "QP to ERROR");
        }
    }

    fn attach_stats(&self, _stats: Arc<Stats>) {
        // NICs count retransmits, NAKs and CNPs per port, not per QP:
        // `rdmx doctor` shows those counters.
    }
}

impl Drop for HwQp {
    fn drop(&mut self) {
        // Destroy the QP first: after ibv_destroy_qp the NIC no longer
        // touches its buffers, which may then go back to the pool.
        drop(self.qp.lock().take());
        self.cq.qps.lock().remove(&self.qpn);
        let mut t = self.track.lock();
        drop(t.sends.flush_all());
        drop(t.recvs.drain());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_host_has_no_rdma_devices() {
        // No RDMA NIC and no RDMA in this kernel: opening fails cleanly,
        // whether libibverbs is installed (empty list) or not (error).
        let e = HwProvider::open(HwConfig::from_env()).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)), "{e:?}");
        assert!(e.to_string().contains("no RDMA devices"), "{e}");
    }

    #[test]
    fn wc_status_codes_match_libibverbs() {
        use rdma_mummy_sys::ibv_wc_status as s;
        for (code, status) in [
            (s::IBV_WC_SUCCESS, WcStatus::Success),
            (s::IBV_WC_LOC_LEN_ERR, WcStatus::LocalLength),
            (s::IBV_WC_LOC_PROT_ERR, WcStatus::LocalProtection),
            (s::IBV_WC_WR_FLUSH_ERR, WcStatus::Flushed),
            (s::IBV_WC_REM_ACCESS_ERR, WcStatus::RemoteAccess),
            (s::IBV_WC_RETRY_EXC_ERR, WcStatus::RetryExceeded),
            (s::IBV_WC_RNR_RETRY_EXC_ERR, WcStatus::RnrRetryExceeded),
            (s::IBV_WC_FATAL_ERR, WcStatus::Fatal),
            (s::IBV_WC_GENERAL_ERR, WcStatus::General),
        ] {
            assert_eq!(WcStatus::from_ibv(code), status, "code {code}");
        }
        assert_eq!(
            plan::ibv_mtu(4096).unwrap(),
            sideway::ibverbs::device_context::Mtu::Mtu4096 as u32
        );
        assert_eq!(
            plan::QP_ACCESS,
            (AccessFlags::LocalWrite
                | AccessFlags::RemoteWrite
                | AccessFlags::RemoteRead
                | AccessFlags::RemoteAtomic)
                .bits() as u32
        );
    }
}
