//! The host side of NVMe over rdmx: [`Initiator`], an async block device
//! on a remote namespace with many commands in flight.

use std::sync::atomic::{AtomicU16, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use rdmx_core::{Access, Connection, MemoryRegion, Options, Transports};
use rustc_hash::FxHashMap;
use tokio::sync::{oneshot, OwnedSemaphorePermit, Semaphore};

use crate::nvme::command::{admin, fabrics, io, sgl, Sgl, Sqe, CQE_LEN, SQE_LEN};
use crate::nvme::identify::{MAX_IN_CAPSULE, MAX_TRANSFER};
use crate::nvme::status::Status;

/// Why an [`Initiator`] call failed.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The target completed the command with an error status.
    #[error("NVMe status {0:?}")]
    Nvme(Status),
    /// The connection failed.
    #[error("transport: {0}")]
    Transport(#[from] rdmx_core::Error),
    /// The target answered something the host cannot use.
    #[error("protocol: {0}")]
    Protocol(String),
    /// The request itself is out of bounds (checked before sending).
    #[error("invalid request: {0}")]
    Invalid(String),
}

/// How an [`Initiator`] connects.
#[derive(Clone, Debug)]
pub struct InitiatorConfig {
    /// The subsystem NQN.
    pub nqn: String,
    /// This host's NQN.
    pub hostnqn: String,
    /// This host's 128-bit identifier.
    pub hostid: [u8; 16],
    /// The namespace to use.
    pub nsid: u32,
    /// I/O queues (one connection each).
    pub queues: u16,
    /// Commands in flight per I/O queue.
    pub queue_depth: u16,
    /// Keep-alive timeout asked for at Connect (Keep Alive goes every half).
    pub kato: Duration,
    /// Options of every connection.
    pub options: Options,
}

impl Default for InitiatorConfig {
    fn default() -> Self {
        InitiatorConfig {
            nqn: "nqn.2026-11.io.rdmx:block".into(),
            hostnqn: format!("nqn.2014-08.org.nvmexpress:uuid:rdmx-{:016x}", rand_id()),
            hostid: rand_id().to_le_bytes().repeat(2).try_into().expect("16"),
            nsid: 1,
            queues: 2,
            queue_depth: 64,
            kato: Duration::from_secs(10),
            options: Options::default(),
        }
    }
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}

/// What a command returned.
struct Cqe {
    dw0: u32,
    status: Status,
}

/// A command waiting for its response, with the memory it lent the target
/// and its queue slot: both stay taken until the response, even when the
/// caller drops the command (the target still runs it).
struct Waiter {
    tx: oneshot::Sender<(Cqe, Lent)>,
    lent: Lent,
    _slot: OwnedSemaphorePermit,
}

/// Memory a command lends the target until its response arrives.
enum Lent {
    /// None (in-capsule data, or no data).
    Nothing,
    /// A pooled buffer the target WRITEs read data into.
    ReadBuffer(MemoryRegion),
    /// Write data the target READs (held only to stay registered).
    WriteData(#[allow(dead_code)] MemoryRegion),
}

/// Registered buffers the target WRITEs read data into, kept for reuse:
/// registering per command costs a memory registration (on a NIC, a
/// system call and page pinning). Buffers are powers of two from 4 KiB to
/// MDTS; at most [`BufferPool::MAX_BYTES`] stay pooled.
#[derive(Default)]
struct BufferPool {
    free: Mutex<Vec<MemoryRegion>>,
}

impl BufferPool {
    const MAX_BYTES: usize = 8 << 20;

    fn class(len: usize) -> usize {
        len.next_power_of_two().max(4096)
    }

    /// A buffer of at least `len` bytes the peer may write.
    fn take(&self, domain: &rdmx_core::Domain, len: usize) -> MemoryRegion {
        let want = Self::class(len);
        let mut free = self.free.lock();
        match free.iter().position(|m| m.len() == want) {
            Some(i) => free.swap_remove(i),
            None => {
                drop(free);
                domain.register(want, Access::REMOTE_WRITE)
            }
        }
    }

    /// Give a buffer back (deregistered instead when the pool is full).
    fn put(&self, mr: MemoryRegion) {
        let mut free = self.free.lock();
        let pooled: usize = free.iter().map(|m| m.len()).sum();
        if pooled + mr.len() <= Self::MAX_BYTES {
            free.push(mr);
        }
    }
}

/// One queue: a connection, its outstanding commands by CID.
///
/// No task of its own reads the responses: a command waiting for its
/// response takes the receive side (one at a time), reads responses and
/// hands each to its command until its own arrives. At queue depth 1 the
/// response wakes the very task that waits for it.
struct QueueConn {
    conn: Arc<Connection>,
    pending: Mutex<FxHashMap<u16, Waiter>>,
    /// Registered buffers for read data, reused across commands.
    buffers: BufferPool,
    /// Held by the command currently reading responses.
    receiving: tokio::sync::Mutex<()>,
    /// Why the queue stopped (a failed receive or a bad response).
    closed: Mutex<Option<String>>,
    next_cid: AtomicU16,
    /// One permit per command the queue may have outstanding (its depth).
    slots: Arc<Semaphore>,
}

impl QueueConn {
    async fn open(
        ts: &Transports,
        url: &str,
        opts: &Options,
        depth: u16,
    ) -> Result<QueueConn, BlockError> {
        let conn = Arc::new(ts.connect(url, opts).await?);
        Ok(QueueConn {
            conn,
            pending: Mutex::default(),
            buffers: BufferPool::default(),
            receiving: tokio::sync::Mutex::new(()),
            closed: Mutex::default(),
            next_cid: AtomicU16::new(0),
            slots: Arc::new(Semaphore::new(usize::from(depth))),
        })
    }

    fn closed_error(&self) -> Option<BlockError> {
        self.closed.lock().clone().map(BlockError::Protocol)
    }

    /// Stop the queue: every command still waiting fails.
    fn close(&self, why: String) {
        tracing::warn!(why = %why, "NVMe over rdmx queue closed");
        self.closed.lock().get_or_insert(why);
        // Dropping the senders fails their commands.
        self.pending.lock().clear();
    }

    /// Read one response and hand it to its command (a response capsule is
    /// a 16-byte CQE, matched by CID).
    async fn receive_one(&self) -> Result<(), BlockError> {
        // recv_message is cancel-safe: a message is taken whole or not at
        // all. No deadline: a command waits as long as the connection lives.
        let m = match self.conn.recv_message().await {
            Ok(m) => m,
            Err(e) => {
                self.close(format!("receive failed: {e}"));
                return Err(e.into());
            }
        };
        if m.len() != CQE_LEN {
            let why = format!("a {}-byte message is not a response capsule", m.len());
            self.close(why.clone());
            return Err(BlockError::Protocol(why));
        }
        let cid = u16::from_le_bytes([m[12], m[13]]);
        let cqe = Cqe {
            dw0: u32::from_le_bytes(m[0..4].try_into().expect("4")),
            status: Status::from_cqe_word(u16::from_le_bytes([m[14], m[15]])),
        };
        let waiter = self.pending.lock().remove(&cid);
        if let Some(w) = waiter {
            // A command whose caller is gone: its buffer is free now that
            // the target has answered (data before response), so reuse it.
            if let Err((_, Lent::ReadBuffer(mr))) = w.tx.send((cqe, w.lent)) {
                self.buffers.put(mr);
            }
        }
        Ok(())
    }

    /// A free queue slot. Slots come back as responses are read; when no
    /// command is reading them (every slot may belong to commands whose
    /// callers dropped them), the command waiting for a slot reads them.
    async fn slot(&self) -> Result<OwnedSemaphorePermit, BlockError> {
        loop {
            if let Some(e) = self.closed_error() {
                return Err(e);
            }
            tokio::select! {
                biased;
                p = self.slots.clone().acquire_owned() => {
                    return p.map_err(|_| BlockError::Protocol("queue closed".into()));
                }
                _turn = self.receiving.lock() => {
                    if let Ok(p) = self.slots.clone().try_acquire_owned() {
                        return Ok(p);
                    }
                    self.receive_one().await?;
                }
            }
        }
    }

    /// Send a capsule and wait for its response. `lent` is memory the
    /// command lets the target access: it stays registered until the
    /// response arrives, even if this future is dropped first, and comes
    /// back with the response.
    async fn submit(
        &self,
        mut sqe: Sqe,
        in_capsule: &[u8],
        lent: Lent,
    ) -> Result<(Cqe, Lent), BlockError> {
        let slot = self.slot().await?;
        if let Some(e) = self.closed_error() {
            return Err(e);
        }
        let (tx, mut rx) = oneshot::channel();
        let mut waiter = Some(Waiter {
            tx,
            lent,
            _slot: slot,
        });
        let cid = loop {
            let c = self.next_cid.fetch_add(1, Relaxed);
            let mut p = self.pending.lock();
            if let std::collections::hash_map::Entry::Vacant(e) = p.entry(c) {
                e.insert(waiter.take().expect("inserted once"));
                break c;
            }
        };
        // If this future is dropped, the CID stays taken until its response
        // comes (a late response never reaches a newer command).
        sqe.cid = cid;
        sqe.flags = 0x40; // PSDT: SGL
        let mut b = BytesMut::with_capacity(SQE_LEN + in_capsule.len());
        b.put_slice(&sqe.encode());
        b.put_slice(in_capsule);
        // Posted, not acknowledged: the response proves delivery, and a
        // send failing after posting fails the connection (and this wait).
        if let Err(e) = self.conn.post_send(b.freeze()).await {
            self.pending.lock().remove(&cid);
            return Err(e.into());
        }
        let gone = || {
            self.closed_error().unwrap_or_else(|| {
                BlockError::Protocol("connection closed before the response".into())
            })
        };
        tokio::select! {
            biased;
            r = &mut rx => r.map_err(|_| gone()),
            _turn = self.receiving.lock() => {
                // Ours may have come while we waited for the turn.
                loop {
                    match rx.try_recv() {
                        Ok(c) => return Ok(c),
                        Err(oneshot::error::TryRecvError::Closed) => return Err(gone()),
                        Err(oneshot::error::TryRecvError::Empty) => {}
                    }
                    self.receive_one().await?;
                }
            }
        }
    }

    async fn run(&self, sqe: Sqe, in_capsule: &[u8]) -> Result<u32, BlockError> {
        let (c, _) = self.submit(sqe, in_capsule, Lent::Nothing).await?;
        if c.status.is_success() {
            Ok(c.dw0)
        } else {
            Err(BlockError::Nvme(c.status))
        }
    }
}

/// Holds an [`Initiator`]'s outgoing capsules while it lives (see
/// [`Initiator::cork`]).
#[must_use = "a cork holds capsules only while it lives"]
pub struct InitiatorCork<'a> {
    _queues: Vec<rdmx_core::Cork<'a>>,
    /// The initiator's burst queue, and the value this cork set in it.
    burst: (&'a AtomicUsize, usize),
}

impl Drop for InitiatorCork<'_> {
    fn drop(&mut self) {
        // A later cork that chose its own queue keeps it.
        let (burst, mine) = self.burst;
        let _ = burst.compare_exchange(mine, 0, Relaxed, Relaxed);
    }
}

/// A remote namespace as an async block device, over NVMe over rdmx.
///
/// ```no_run
/// # async fn f(ts: rdmx_core::Transports) -> Result<(), rdmx_block::fabric::BlockError> {
/// use rdmx_block::fabric::{Initiator, InitiatorConfig};
/// let dev = Initiator::connect(&ts, "rdma://198.18.0.1:4430", InitiatorConfig::default()).await?;
/// dev.write(0, bytes::Bytes::from(vec![7u8; 4096]), false).await?;
/// assert_eq!(&dev.read(0, 8).await?[..], &[7u8; 4096][..]);
/// dev.flush().await?;
/// # Ok(()) }
/// ```
pub struct Initiator {
    admin: Arc<QueueConn>,
    io: Vec<QueueConn>,
    next: AtomicUsize,
    /// While corked: 1 + the queue the burst's commands go to (0: none).
    burst: AtomicUsize,
    nsid: u32,
    lba_shift: u8,
    blocks: u64,
    cntlid: u16,
    keep_alive: tokio::task::JoinHandle<()>,
}

impl Drop for Initiator {
    fn drop(&mut self) {
        self.keep_alive.abort();
    }
}

fn connect_sqe(qid: u16, sqsize: u16, kato_ms: u32) -> Sqe {
    Sqe {
        opcode: fabrics::OPCODE,
        nsid: u32::from(fabrics::CONNECT),
        sgl: Sgl {
            len: 1024,
            id: sgl::DATA_BLOCK_OFFSET,
            ..Sgl::default()
        },
        cdw: [u32::from(qid) << 16, u32::from(sqsize), kato_ms, 0, 0, 0],
        ..Sqe::default()
    }
}

fn connect_data(cfg: &InitiatorConfig, cntlid: u16) -> Result<Vec<u8>, BlockError> {
    if cfg.nqn.len() > 223 || cfg.hostnqn.len() > 223 {
        return Err(BlockError::Invalid("NQNs are at most 223 bytes".into()));
    }
    let mut d = vec![0u8; 1024];
    d[0..16].copy_from_slice(&cfg.hostid);
    d[16..18].copy_from_slice(&cntlid.to_le_bytes());
    d[256..256 + cfg.nqn.len()].copy_from_slice(cfg.nqn.as_bytes());
    d[512..512 + cfg.hostnqn.len()].copy_from_slice(cfg.hostnqn.as_bytes());
    Ok(d)
}

fn prop(set: Option<u32>, offset: u32) -> Sqe {
    Sqe {
        opcode: fabrics::OPCODE,
        nsid: u32::from(if set.is_some() {
            fabrics::PROPERTY_SET
        } else {
            fabrics::PROPERTY_GET
        }),
        sgl: Sgl {
            id: sgl::KEYED_ADDRESS,
            ..Sgl::default()
        },
        cdw: [0, offset, set.unwrap_or(0), 0, 0, 0],
        ..Sqe::default()
    }
}

impl Initiator {
    /// Connect to the target at `url` (rdma:// or tcp://): the admin queue
    /// (Connect, enable, Identify, Number of Queues), then the I/O queues.
    pub async fn connect(
        ts: &Transports,
        url: &str,
        cfg: InitiatorConfig,
    ) -> Result<Initiator, BlockError> {
        if cfg.queues == 0 || cfg.queue_depth < 2 || cfg.queue_depth > 128 {
            return Err(BlockError::Invalid(
                "queues ≥ 1 and a queue depth of 2 to 128".into(),
            ));
        }
        let admin = Arc::new(QueueConn::open(ts, url, &cfg.options, 32).await?);
        let kato_ms = cfg.kato.as_millis().min(u128::from(u32::MAX)) as u32;
        let dw0 = admin
            .run(connect_sqe(0, 31, kato_ms), &connect_data(&cfg, 0xFFFF)?)
            .await?;
        // The target's keep-alive timer runs from here (NVMe Base 2.0 §3.9),
        // however long the rest of the setup takes.
        let kato_armed = tokio::time::Instant::now();
        let cntlid = dw0 as u16;
        // CC: IOSQES 6, IOCQES 4, EN; then wait for CSTS.RDY.
        admin.run(prop(Some(0x0046_0001), 0x14), &[]).await?;
        let mut ready = false;
        for _ in 0..100 {
            if admin.run(prop(None, 0x1C), &[]).await? & 1 == 1 {
                ready = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if !ready {
            return Err(BlockError::Protocol(
                "the controller never became ready".into(),
            ));
        }
        let want = u32::from(cfg.queues - 1);
        let granted = admin
            .run(
                Sqe {
                    opcode: admin::SET_FEATURES,
                    cdw: [0x07, want | want << 16, 0, 0, 0, 0],
                    ..Sqe::default()
                },
                &[],
            )
            .await?;
        let queues = (granted & 0xFFFF).min(granted >> 16) as u16 + 1;
        // Identify Namespace: its size and block size, read into our memory.
        let id = Self::identify(&admin, cfg.nsid).await?;
        let blocks = u64::from_le_bytes(id[0..8].try_into().expect("8"));
        let lba_shift = id[128 + 4 * usize::from(id[26] & 0xF) + 2];
        if blocks == 0 || !(9..=16).contains(&lba_shift) {
            return Err(BlockError::Protocol(format!(
                "namespace {}: {blocks} blocks of 2^{lba_shift} bytes",
                cfg.nsid
            )));
        }
        let mut io = Vec::new();
        for qid in 1..=cfg.queues.min(queues) {
            let q = QueueConn::open(ts, url, &cfg.options, cfg.queue_depth).await?;
            q.run(
                connect_sqe(qid, cfg.queue_depth - 1, 0),
                &connect_data(&cfg, cntlid)?,
            )
            .await?;
            io.push(q);
        }
        let a = admin.clone();
        // Keep Alive every KATO/2 from the admin Connect, on a fixed
        // cadence: a slow answer delays no later one. A KATO of 0 turns the
        // timer off: no Keep Alive then.
        let every = cfg.kato / 2;
        let keep_alive = tokio::spawn(async move {
            if every.is_zero() {
                return;
            }
            let mut ticks = tokio::time::interval_at(kato_armed + every, every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let ka = Sqe {
                    opcode: admin::KEEP_ALIVE,
                    ..Sqe::default()
                };
                let sent = std::time::Instant::now();
                if let Err(e) = a.run(ka, &[]).await {
                    tracing::warn!(error = %e, "keep alive failed");
                    return;
                }
                tracing::debug!(
                    took_us = sent.elapsed().as_micros() as u64,
                    "keep alive answered"
                );
            }
        });
        Ok(Initiator {
            admin,
            io,
            next: AtomicUsize::new(0),
            burst: AtomicUsize::new(0),
            nsid: cfg.nsid,
            lba_shift,
            blocks,
            cntlid,
            keep_alive,
        })
    }

    async fn identify(admin: &QueueConn, nsid: u32) -> Result<Bytes, BlockError> {
        let mr = admin.conn.domain().register(4096, Access::REMOTE_WRITE);
        let r = mr.remote();
        admin
            .run(
                Sqe {
                    opcode: admin::IDENTIFY,
                    nsid,
                    sgl: Sgl {
                        addr: r.addr,
                        len: 4096,
                        key: r.rkey,
                        id: sgl::KEYED_ADDRESS,
                    },
                    cdw: [0, 0, 0, 0, 0, 0],
                    ..Sqe::default()
                },
                &[],
            )
            .await?;
        let out = Bytes::copy_from_slice(&mr.read());
        Ok(out)
    }

    /// The namespace's size in logical blocks.
    pub fn blocks(&self) -> u64 {
        self.blocks
    }

    /// The logical block size in bytes.
    pub fn block_size(&self) -> u32 {
        1 << self.lba_shift
    }

    /// The controller ID the target gave this host.
    pub fn cntlid(&self) -> u16 {
        self.cntlid
    }

    /// The transport the queues run on ("rdma", "tcp") and its provider.
    pub fn transport(&self) -> (String, String) {
        let i = self.admin.conn.info();
        (i.transport.clone(), i.provider.clone())
    }

    /// I/O queues in use.
    pub fn queues(&self) -> usize {
        self.io.len()
    }

    /// Each I/O queue's rdmx connection counters (messages and bytes sent
    /// and received, socket writes, errors), in queue order.
    pub fn queue_stats(&self) -> Vec<rdmx_core::StatsSnapshot> {
        self.io.iter().map(|q| q.conn.stats()).collect()
    }

    /// I/O commands sent and not yet answered, over all queues (commands
    /// whose callers dropped them included: the target still runs them).
    /// Never more than `queues × queue_depth`.
    pub fn outstanding(&self) -> usize {
        self.io.iter().map(|q| q.pending.lock().len()).sum()
    }

    /// Hold the capsules of the commands posted from now on until the
    /// returned guard drops, then send them together (one `writev` per
    /// queue on TCP; see [`rdmx_core::Connection::cork`]). A command posts
    /// its capsule when its future is first polled: poll the commands of a
    /// burst once while corked, and await them only after the guard is gone
    /// (a command awaited inside the cork waits for a capsule it holds).
    ///
    /// The burst's commands go to one queue (the one with the most free
    /// slots) while it has room, rather than in turn to every queue: a
    /// burst of a few commands then leaves in one `writev`, not one per
    /// queue, and its answers come back together (the NBD export at queue
    /// depth 32 took most of its requests two at a time, and spent a
    /// `writev` on each queue for them).
    pub fn cork(&self) -> InitiatorCork<'_> {
        // Ties go to the queues in turn (the first in turn from `start`).
        let start = self.next.fetch_add(1, Relaxed);
        let n = self.io.len();
        let mut chosen = start % n;
        for k in 1..n {
            let i = (start + k) % n;
            if self.io[i].slots.available_permits() > self.io[chosen].slots.available_permits() {
                chosen = i;
            }
        }
        self.burst.store(chosen + 1, Relaxed);
        InitiatorCork {
            _queues: self.io.iter().map(|q| q.conn.cork()).collect(),
            burst: (&self.burst, chosen + 1),
        }
    }

    /// The queue for the next command: the burst's while corked and it has
    /// a free slot, else each queue in turn.
    fn queue(&self) -> &QueueConn {
        if let Some(q) = self.burst.load(Relaxed).checked_sub(1).map(|i| &self.io[i]) {
            if q.slots.available_permits() > 0 {
                return q;
            }
        }
        let i = self.next.fetch_add(1, Relaxed) % self.io.len();
        &self.io[i]
    }

    fn check(&self, lba: u64, blocks: u64) -> Result<u32, BlockError> {
        let bytes = blocks << self.lba_shift;
        if blocks == 0 || blocks > 1 << 16 || bytes > u64::from(MAX_TRANSFER) {
            return Err(BlockError::Invalid(format!(
                "{blocks} blocks: one command moves 1 to {} blocks",
                MAX_TRANSFER >> self.lba_shift
            )));
        }
        if lba.checked_add(blocks).is_none_or(|end| end > self.blocks) {
            return Err(BlockError::Invalid(format!(
                "blocks {lba}..{} are past the end ({})",
                lba.saturating_add(blocks),
                self.blocks
            )));
        }
        Ok(bytes as u32)
    }

    fn rw(&self, opcode: u8, lba: u64, blocks: u64, sgl: Sgl, fua: bool) -> Sqe {
        Sqe {
            opcode,
            nsid: self.nsid,
            sgl,
            cdw: [
                lba as u32,
                (lba >> 32) as u32,
                (blocks - 1) as u32 | u32::from(fua) << 30,
                0,
                0,
                0,
            ],
            ..Sqe::default()
        }
    }

    /// Read `blocks` blocks at `lba`: the target WRITEs them into a buffer
    /// registered for the queue (reused; lent until the response arrives,
    /// so dropping this future never lets the target write into memory
    /// that was handed to another command).
    pub async fn read(&self, lba: u64, blocks: u32) -> Result<Bytes, BlockError> {
        let len = self.check(lba, u64::from(blocks))?;
        let q = self.queue();
        let mr = q.buffers.take(q.conn.domain(), len as usize);
        let r = mr.remote();
        let sgl = Sgl {
            addr: r.addr,
            len,
            key: r.rkey,
            id: sgl::KEYED_ADDRESS,
        };
        let sqe = self.rw(io::READ, lba, u64::from(blocks), sgl, false);
        let (c, lent) = q.submit(sqe, &[], Lent::ReadBuffer(mr)).await?;
        let Lent::ReadBuffer(mr) = lent else {
            unreachable!("the lent buffer comes back with the response")
        };
        let out = c
            .status
            .is_success()
            .then(|| Bytes::copy_from_slice(&mr.read()[..len as usize]));
        q.buffers.put(mr);
        out.ok_or(BlockError::Nvme(c.status))
    }

    /// Write `data` (whole blocks) at `lba`; with `fua`, durably before it
    /// completes. Up to 8 KiB goes in the capsule; more is READ by the target
    /// from a region lent for this command.
    pub async fn write(&self, lba: u64, data: Bytes, fua: bool) -> Result<(), BlockError> {
        if data.len() % self.block_size() as usize != 0 {
            return Err(BlockError::Invalid(format!(
                "{} bytes is not a whole number of {}-byte blocks",
                data.len(),
                self.block_size()
            )));
        }
        let blocks = (data.len() >> self.lba_shift) as u64;
        let len = self.check(lba, blocks)?;
        let q = self.queue();
        if len <= MAX_IN_CAPSULE {
            let sgl = Sgl {
                len,
                id: sgl::DATA_BLOCK_OFFSET,
                ..Sgl::default()
            };
            q.run(self.rw(io::WRITE, lba, blocks, sgl, fua), &data)
                .await?;
            return Ok(());
        }
        let mr = q.conn.domain().register_bytes(data);
        let r = mr.remote();
        let sgl = Sgl {
            addr: r.addr,
            len,
            key: r.rkey,
            id: sgl::KEYED_ADDRESS,
        };
        // Lent until the response, even if this future is dropped.
        let (c, _) = q
            .submit(
                self.rw(io::WRITE, lba, blocks, sgl, fua),
                &[],
                Lent::WriteData(mr),
            )
            .await?;
        if c.status.is_success() {
            Ok(())
        } else {
            Err(BlockError::Nvme(c.status))
        }
    }

    /// Make every completed write durable (NVMe Flush).
    pub async fn flush(&self) -> Result<(), BlockError> {
        let sqe = Sqe {
            opcode: io::FLUSH,
            nsid: self.nsid,
            sgl: Sgl {
                id: sgl::KEYED_ADDRESS,
                ..Sgl::default()
            },
            ..Sqe::default()
        };
        self.queue().run(sqe, &[]).await.map(|_| ())
    }

    /// Make `blocks` blocks at `lba` read as zeroes (Write Zeroes).
    pub async fn write_zeroes(&self, lba: u64, blocks: u32, fua: bool) -> Result<(), BlockError> {
        if blocks == 0 || blocks > 1 << 16 {
            return Err(BlockError::Invalid(
                "Write Zeroes takes 1 to 65536 blocks".into(),
            ));
        }
        if lba
            .checked_add(u64::from(blocks))
            .is_none_or(|e| e > self.blocks)
        {
            return Err(BlockError::Invalid("past the end of the namespace".into()));
        }
        let sgl = Sgl {
            id: sgl::KEYED_ADDRESS,
            ..Sgl::default()
        };
        let sqe = self.rw(io::WRITE_ZEROES, lba, u64::from(blocks), sgl, fua);
        self.queue().run(sqe, &[]).await.map(|_| ())
    }

    /// Deallocate `blocks` blocks at `lba` (Dataset Management, AD): they
    /// then read as zeroes.
    pub async fn trim(&self, lba: u64, blocks: u32) -> Result<(), BlockError> {
        if blocks == 0
            || lba
                .checked_add(u64::from(blocks))
                .is_none_or(|e| e > self.blocks)
        {
            return Err(BlockError::Invalid(
                "trim range past the end or empty".into(),
            ));
        }
        let mut range = [0u8; 16];
        range[4..8].copy_from_slice(&blocks.to_le_bytes());
        range[8..16].copy_from_slice(&lba.to_le_bytes());
        let sqe = Sqe {
            opcode: io::DSM,
            nsid: self.nsid,
            sgl: Sgl {
                len: 16,
                id: sgl::DATA_BLOCK_OFFSET,
                ..Sgl::default()
            },
            cdw: [0, 4, 0, 0, 0, 0],
            ..Sqe::default()
        };
        self.queue().run(sqe, &range).await.map(|_| ())
    }

    /// Shut the controller down (CC.SHN) and close the queues.
    pub async fn close(self) -> Result<(), BlockError> {
        self.admin.run(prop(Some(0x0046_4001), 0x14), &[]).await?;
        Ok(())
    }
}
