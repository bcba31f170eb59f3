//! Protection domains, registered memory regions and remote descriptors.
//!
//! A [`Domain`] is a protection domain: the set of regions a connection's peer may
//! reach with one-sided operations. [`Domain::register`] returns a [`MemoryRegion`],
//! the local owner handle, whose [`MemoryRegion::remote`] descriptor
//! ([`RemoteRegion`], `{addr, len, rkey}`) can be sent to a peer.
//!
//! Remote keys are random 32-bit values, never reused within a domain, so a peer
//! cannot guess them. Dropping (or [`MemoryRegion::deregister`]ing) a region revokes
//! remote access at once: an access that has not started yet fails with
//! [`AccessError::Revoked`], and deregistration waits for an access already in
//! progress to finish, so no remote access touches the memory afterwards.
//!
//! The `remote_*` methods on [`Domain`] perform one-sided accesses *as the passive
//! side*, with exactly the checks an RDMA NIC makes (key, bounds, permission,
//! revocation, atomic alignment). Software transports (TCP, the soft RoCE engine)
//! serve their peers through them.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::ops::BitOr;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use bytes::Bytes;
use parking_lot::{
    MappedRwLockReadGuard, MappedRwLockWriteGuard, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard,
};
use serde::{Deserialize, Serialize};

use crate::error::{AccessError, Error, Result};

/// Access rights of a registered region (like `ibv_access_flags`).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
pub struct Access(u8);

impl Access {
    /// Local access only: the peer can reach nothing.
    pub const LOCAL: Access = Access(0);
    /// The peer may read the region with one-sided reads.
    pub const REMOTE_READ: Access = Access(1);
    /// The peer may write the region with one-sided writes.
    pub const REMOTE_WRITE: Access = Access(2);
    /// The peer may run compare-and-swap and fetch-and-add on the region's words.
    pub const REMOTE_ATOMIC: Access = Access(4);
    /// All remote rights.
    pub const ALL: Access = Access(7);

    /// True if every right in `other` is granted by `self`.
    pub fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// Flags from raw bits (unknown bits are ignored).
    pub fn from_bits(bits: u8) -> Access {
        Access(bits & Access::ALL.0)
    }

    /// The flags as bits (see [`Access::from_bits`]).
    pub fn bits(self) -> u8 {
        self.0
    }
}

impl BitOr for Access {
    type Output = Access;
    fn bitor(self, rhs: Access) -> Access {
        Access(self.0 | rhs.0)
    }
}

impl fmt::Debug for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        if self.contains(Access::REMOTE_READ) {
            names.push("REMOTE_READ");
        }
        if self.contains(Access::REMOTE_WRITE) {
            names.push("REMOTE_WRITE");
        }
        if self.contains(Access::REMOTE_ATOMIC) {
            names.push("REMOTE_ATOMIC");
        }
        if names.is_empty() {
            names.push("LOCAL");
        }
        write!(f, "Access({})", names.join(" | "))
    }
}

/// First bytes of [`RemoteRegion::to_message`].
const REGION_TAG: &[u8; 4] = b"RGN1";

/// A descriptor of a peer's registered region, sent between processes so the
/// receiver can read, write or run atomics on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RemoteRegion {
    /// Virtual address of the first byte (as on RDMA NICs).
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// Remote key granting access.
    pub rkey: u32,
}

impl RemoteRegion {
    /// Size of [`RemoteRegion::to_bytes`]'s encoding.
    pub const ENCODED_LEN: usize = 20;

    /// The sub-range `[offset, offset + len)` of this region.
    pub fn slice(&self, offset: u64, len: u64) -> Result<RemoteRegion> {
        let end = offset
            .checked_add(len)
            .ok_or_else(|| Error::InvalidArgument("slice range overflows".into()))?;
        if end > self.len {
            return Err(Error::InvalidArgument(format!(
                "slice {offset}+{len} exceeds remote region of {} bytes",
                self.len
            )));
        }
        Ok(RemoteRegion {
            addr: self.addr + offset,
            len,
            rkey: self.rkey,
        })
    }

    /// The 8-byte word at `offset`, the target of an atomic operation.
    pub fn word(&self, offset: u64) -> Result<RemoteRegion> {
        self.slice(offset, 8)
    }

    /// Compact little-endian encoding: addr (8) | len (8) | rkey (4).
    pub fn to_bytes(&self) -> [u8; Self::ENCODED_LEN] {
        let mut out = [0u8; Self::ENCODED_LEN];
        out[0..8].copy_from_slice(&self.addr.to_le_bytes());
        out[8..16].copy_from_slice(&self.len.to_le_bytes());
        out[16..20].copy_from_slice(&self.rkey.to_le_bytes());
        out
    }

    /// The descriptor as one tagged message (`"RGN1"` then [`RemoteRegion::to_bytes`]),
    /// what [`crate::Connection::send_region`] sends.
    pub fn to_message(&self) -> Vec<u8> {
        let mut msg = Vec::with_capacity(REGION_TAG.len() + Self::ENCODED_LEN);
        msg.extend_from_slice(REGION_TAG);
        msg.extend_from_slice(&self.to_bytes());
        msg
    }

    /// Decode [`RemoteRegion::to_message`]; any other message is an
    /// [`Error::Protocol`] that says what arrived instead.
    pub fn from_message(m: &[u8]) -> Result<RemoteRegion> {
        m.strip_prefix(REGION_TAG)
            .and_then(RemoteRegion::from_bytes)
            .ok_or_else(|| {
                Error::Protocol(format!(
                    "expected a region descriptor ({} bytes starting \"RGN1\"), got a {}-byte message",
                    REGION_TAG.len() + Self::ENCODED_LEN,
                    m.len()
                ))
            })
    }

    /// Decode [`RemoteRegion::to_bytes`]; `None` if `b` is not exactly 20 bytes.
    pub fn from_bytes(b: &[u8]) -> Option<RemoteRegion> {
        if b.len() != Self::ENCODED_LEN {
            return None;
        }
        Some(RemoteRegion {
            addr: u64::from_le_bytes(b[0..8].try_into().ok()?),
            len: u64::from_le_bytes(b[8..16].try_into().ok()?),
            rkey: u32::from_le_bytes(b[16..20].try_into().ok()?),
        })
    }
}

/// An atomic operation on a remote 8-byte word (AtomicETH, rocev2-reference §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicOp {
    /// If the word equals `expected`, replace it with `new`. Returns the old value.
    CompareAndSwap {
        /// Value the word must hold for the swap to happen.
        expected: u64,
        /// Value written on a match.
        new: u64,
    },
    /// Add (wrapping) `add` to the word. Returns the old value.
    FetchAndAdd {
        /// Amount added.
        add: u64,
    },
}

/// Number of deregistered keys remembered so late accesses report `Revoked`
/// rather than `UnknownKey`.
const REVOKED_MEMORY: usize = 65_536;

struct RegionMem {
    /// Backing store; `u64` elements give 8-byte alignment for atomics.
    words: Box<[u64]>,
    /// Read-only regions lent from the caller's `Bytes` (no copy); copied into
    /// `words` the first time the owner writes locally.
    frozen: Option<Bytes>,
    /// Lent bytes replaced by a local write, kept until the region is freed:
    /// a NIC registration still points at them (a NIC peer keeps reading the
    /// lent bytes, documented in [`Domain::register_bytes`]).
    retired: Option<Bytes>,
    len: usize,
    revoked: bool,
}

impl RegionMem {
    fn bytes(&self) -> &[u8] {
        match &self.frozen {
            Some(b) => &b[..self.len],
            None => &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len],
        }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        if let Some(b) = self.frozen.take() {
            self.words = vec![0u64; len.div_ceil(8)].into_boxed_slice();
            bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..len].copy_from_slice(&b[..len]);
            self.retired = Some(b);
        }
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..len]
    }
}

pub(crate) struct RegionInner {
    /// The key peers use: the domain's own random key, or the NIC's R_Key once
    /// the domain is bound to a device ([`Domain::bind_device`]).
    rkey: AtomicU32,
    /// The key the region was registered under before a device binding gave
    /// it a NIC key (still accepted by software transports); 0 if none.
    alias: AtomicU32,
    /// The device's registration of this memory; dropped (deregistered from
    /// the NIC) when the region is revoked, before the memory is freed.
    device: parking_lot::Mutex<Option<DeviceRegistration>>,
    addr: u64,
    len: usize,
    access: Access,
    mem: RwLock<RegionMem>,
}

struct KeyTable {
    live: HashMap<u32, Arc<RegionInner>>,
    revoked: HashSet<u32>,
    revoked_order: VecDeque<u32>,
}

/// Every domain of the process (weakly), so a refused key can be traced to
/// the domain that does hold it.
fn all_domains() -> &'static Mutex<Vec<Weak<DomainInner>>> {
    static ALL: OnceLock<Mutex<Vec<Weak<DomainInner>>>> = OnceLock::new();
    ALL.get_or_init(|| Mutex::new(Vec::new()))
}

struct DomainInner {
    id: u64,
    table: RwLock<KeyTable>,
    registered_bytes: AtomicU64,
    /// The RDMA device every region is also registered with, if any.
    device: RwLock<Option<Arc<dyn DeviceMemory>>>,
}

/// An RDMA device that must know every region of a domain (a NIC's protection
/// domain). Software transports need none: they check accesses in the
/// [`Domain`] itself.
pub trait DeviceMemory: Send + Sync + 'static {
    /// Device name for messages (`"mlx5_0"`).
    fn name(&self) -> String;
    /// Register `len` bytes at `addr` with the rights `access` (`ibv_reg_mr`).
    ///
    /// The domain keeps the memory allocated, at the same address, until the
    /// returned registration is dropped.
    fn register(&self, addr: u64, len: usize, access: Access) -> Result<DeviceRegistration>;
}

/// A device's registration of one region: its keys, and a guard that
/// deregisters the memory from the device (`ibv_dereg_mr`) when dropped.
pub struct DeviceRegistration {
    /// Remote key peers put in their requests.
    pub rkey: u32,
    /// Local key for posting this memory in work requests.
    pub lkey: u32,
    /// Deregisters on drop.
    pub guard: Box<dyn Send + Sync>,
}

impl fmt::Debug for DeviceRegistration {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceRegistration")
            .field("rkey", &format_args!("{:#010x}", self.rkey))
            .field("lkey", &format_args!("{:#010x}", self.lkey))
            .finish()
    }
}

/// A protection domain: the regions one or more connections serve to their peers.
///
/// Cheap to clone; all clones are the same domain.
#[derive(Clone)]
pub struct Domain {
    inner: Arc<DomainInner>,
}

impl fmt::Debug for Domain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Domain")
            .field("id", &self.inner.id)
            .field("regions", &self.inner.table.read().live.len())
            .finish()
    }
}

impl Default for Domain {
    fn default() -> Self {
        Domain::new()
    }
}

impl Domain {
    /// A new, empty protection domain, separate from every other one: its
    /// keys mean nothing to connections serving another domain. Most programs
    /// want [`Domain::global`] (what [`crate::Options::default`] uses).
    pub fn new() -> Domain {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let d = Domain {
            inner: Arc::new(DomainInner {
                id: NEXT.fetch_add(1, Ordering::Relaxed),
                table: RwLock::new(KeyTable {
                    live: HashMap::new(),
                    revoked: HashSet::new(),
                    revoked_order: VecDeque::new(),
                }),
                registered_bytes: AtomicU64::new(0),
                device: RwLock::new(None),
            }),
        };
        let mut all = all_domains().lock();
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(&d.inner));
        d
    }

    /// The process-wide domain: what [`crate::Options::default`] serves, so a
    /// region registered through one default `Options` is reachable through
    /// connections made with any other (as one ibverbs protection domain per
    /// process usually is). Use [`Domain::new`] to keep regions apart.
    pub fn global() -> Domain {
        static GLOBAL: OnceLock<Domain> = OnceLock::new();
        GLOBAL.get_or_init(Domain::new).clone()
    }

    /// The live domain of this process, other than `self`, that holds `rkey`.
    fn other_holder_of(&self, rkey: u32) -> Option<u64> {
        let all = all_domains().lock();
        all.iter().filter_map(Weak::upgrade).find_map(|d| {
            (d.id != self.inner.id && d.table.read().live.contains_key(&rkey)).then_some(d.id)
        })
    }

    /// Bind this domain to an RDMA device: every region, present and future,
    /// is registered with it too, and [`MemoryRegion::remote`] hands out the
    /// device's R_Key from then on (the key the NIC checks). Keys given out
    /// before the binding keep working over software transports, not over the
    /// NIC, so take descriptors after connecting. Binding again to the same
    /// device is a no-op; a domain serves one device at most.
    pub fn bind_device(&self, dev: Arc<dyn DeviceMemory>) -> Result<()> {
        let mut bound = self.inner.device.write();
        if let Some(d) = bound.as_ref() {
            if Arc::ptr_eq(d, &dev) {
                return Ok(());
            }
            return Err(Error::InvalidArgument(format!(
                "domain #{} is already bound to RDMA device {} (its keys are that device's); \
                 a connection through {} needs a Domain of its own: \
                 Options::with_domain(Domain::new()) (the default Options share Domain::global())",
                self.inner.id,
                d.name(),
                dev.name()
            )));
        }
        let regions: Vec<Arc<RegionInner>> = {
            let table = self.inner.table.read();
            let mut v: Vec<_> = table.live.values().cloned().collect();
            v.sort_by_key(|r| Arc::as_ptr(r) as usize);
            v.dedup_by(|a, b| Arc::ptr_eq(a, b));
            v
        };
        for r in regions.iter().filter(|r| r.len > 0) {
            self.attach(&*dev, r)?;
        }
        *bound = Some(dev);
        Ok(())
    }

    /// Register `r` with `dev` and make the device's key its key (the old
    /// one stays valid as an alias). Retries on the rare key collision.
    /// Zero-length regions are never registered: NICs skip the R_Key check
    /// for zero-length accesses (IBTA 9.7.4.1.5).
    fn attach(&self, dev: &dyn DeviceMemory, r: &Arc<RegionInner>) -> Result<()> {
        if r.device.lock().is_some() {
            return Ok(()); // a registration racing the binding got there first
        }
        for _ in 0..8 {
            let reg = dev.register(r.addr, r.len, r.access)?;
            let mut table = self.inner.table.write();
            let key = reg.rkey;
            let taken = table.revoked.contains(&key)
                || table.live.get(&key).is_some_and(|o| !Arc::ptr_eq(o, r));
            if taken || key == 0 {
                continue; // dropping `reg` deregisters it; ask again
            }
            let old = r.rkey.swap(key, Ordering::AcqRel);
            if old != key {
                r.alias.store(old, Ordering::Release);
            }
            table.live.insert(key, r.clone());
            *r.device.lock() = Some(reg);
            return Ok(());
        }
        Err(Error::ResourceExhausted(format!(
            "{}: no usable R_Key after 8 registrations",
            dev.name()
        )))
    }

    /// The device's local key for `[addr, addr + len)` if it lies inside one
    /// region of this domain registered with the bound device (for zero-copy
    /// work requests).
    pub fn device_lkey(&self, rkey: u32, addr: u64, len: u64) -> Option<u32> {
        let table = self.inner.table.read();
        let r = table.live.get(&rkey)?;
        let off = addr.checked_sub(r.addr)?;
        if off.checked_add(len)? > r.len as u64 {
            return None;
        }
        let lkey = r.device.lock().as_ref().map(|d| d.lkey);
        lkey
    }

    /// A number identifying this domain within the process (never reused).
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// True if both handles name the same domain.
    pub fn same(&self, other: &Domain) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Register `len` zeroed bytes with the given rights.
    pub fn register(&self, len: usize, access: Access) -> MemoryRegion {
        let words = vec![0u64; len.div_ceil(8).max(1)].into_boxed_slice();
        self.register_words(words, len, access)
    }

    /// Register a copy of `data` with the given rights.
    pub fn register_from(&self, data: &[u8], access: Access) -> MemoryRegion {
        let mr = self.register(data.len(), access);
        mr.write().copy_from_slice(data);
        mr
    }

    /// Lend `data` for remote reads without copying it: the region is
    /// REMOTE_READ only (writes and atomics by peers are refused) and keeps
    /// `data` alive until deregistered. A later local write through
    /// [`MemoryRegion::write`] copies it first (the caller's `Bytes` never
    /// changes); peers reading through a NIC (a domain bound with
    /// [`Domain::bind_device`]) keep seeing the lent bytes, software
    /// transports see the write. What RPC rendezvous uses for large bodies.
    pub fn register_bytes(&self, data: Bytes) -> MemoryRegion {
        let len = data.len();
        let addr = data.as_ptr() as u64;
        self.register_mem(Box::new([]), Some(data), len, Access::REMOTE_READ, addr)
    }

    fn register_words(&self, words: Box<[u64]>, len: usize, access: Access) -> MemoryRegion {
        let addr = words.as_ptr() as u64;
        self.register_mem(words, None, len, access, addr)
    }

    fn register_mem(
        &self,
        words: Box<[u64]>,
        frozen: Option<Bytes>,
        len: usize,
        access: Access,
        addr: u64,
    ) -> MemoryRegion {
        let mut table = self.inner.table.write();
        let rkey = loop {
            let k: u32 = rand::random();
            if k != 0 && !table.live.contains_key(&k) && !table.revoked.contains(&k) {
                break k;
            }
        };
        let inner = Arc::new(RegionInner {
            rkey: AtomicU32::new(rkey),
            alias: AtomicU32::new(0),
            device: parking_lot::Mutex::new(None),
            addr,
            len,
            access,
            mem: RwLock::new(RegionMem {
                words,
                frozen,
                retired: None,
                len,
                revoked: false,
            }),
        });
        table.live.insert(rkey, inner.clone());
        drop(table);
        self.inner
            .registered_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        let device = self.inner.device.read().clone();
        if let Some(dev) = device.filter(|_| len > 0) {
            if let Err(e) = self.attach(&*dev, &inner) {
                // Software transports can still serve it; the NIC cannot.
                tracing::warn!(device = %dev.name(), error = %e, len, "region not registered with the RDMA device");
            }
        }
        let rkey = inner.rkey.load(Ordering::Acquire);
        tracing::debug!(
            rkey = format_args!("{rkey:#010x}"),
            len,
            ?access,
            "region registered"
        );
        MemoryRegion {
            inner,
            domain: Arc::downgrade(&self.inner),
        }
    }

    /// Number of live regions.
    pub fn region_count(&self) -> usize {
        let t = self.inner.table.read();
        // A region bound to a device is listed under its old key too.
        t.live
            .iter()
            .filter(|(k, r)| r.rkey.load(Ordering::Acquire) == **k)
            .count()
    }

    /// Bytes currently registered.
    pub fn registered_bytes(&self) -> u64 {
        self.inner.registered_bytes.load(Ordering::Relaxed)
    }

    fn lookup(&self, rkey: u32) -> Result<Arc<RegionInner>, AccessError> {
        let table = self.inner.table.read();
        match table.live.get(&rkey) {
            Some(r) => Ok(r.clone()),
            None if table.revoked.contains(&rkey) => {
                tracing::debug!(
                    rkey = format_args!("{rkey:#010x}"),
                    domain = self.inner.id,
                    "refused an access under a revoked key (its MemoryRegion was dropped or deregistered)"
                );
                Err(AccessError::Revoked)
            }
            None => {
                drop(table);
                match self.other_holder_of(rkey) {
                    Some(other) => tracing::warn!(
                        rkey = format_args!("{rkey:#010x}"),
                        serving_domain = self.inner.id,
                        key_domain = other,
                        "refused an access: the key belongs to domain #{other}, but this \
                         connection serves domain #{}; register the region in the Domain \
                         of the Options you listen or connect with",
                        self.inner.id
                    ),
                    None => tracing::debug!(
                        rkey = format_args!("{rkey:#010x}"),
                        domain = self.inner.id,
                        "refused an access under an unknown key"
                    ),
                }
                Err(AccessError::UnknownKey)
            }
        }
    }

    /// Check, without moving data, that a remote access of `len` bytes at `addr`
    /// under `rkey` needing `need` would be allowed (what a NIC checks on the
    /// first packet of a request, rocev2-reference §4).
    pub fn check_access(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(), AccessError> {
        if need.contains(Access::REMOTE_ATOMIC) && addr % 8 != 0 {
            return Err(AccessError::Misaligned);
        }
        self.check(rkey, addr, len, need).map(|_| ())
    }

    /// Resolve and check a remote access of `len` bytes at `addr` needing `need`.
    /// Returns the region and the byte offset of `addr` inside it.
    fn check(
        &self,
        rkey: u32,
        addr: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<RegionInner>, usize), AccessError> {
        let region = self.lookup(rkey)?;
        if !region.access.contains(need) {
            return Err(AccessError::Permission);
        }
        let off = addr
            .checked_sub(region.addr)
            .ok_or(AccessError::OutOfBounds)?;
        let end = off.checked_add(len).ok_or(AccessError::OutOfBounds)?;
        if end > region.len as u64 {
            return Err(AccessError::OutOfBounds);
        }
        Ok((region, off as usize))
    }

    /// Passive side of a one-sided write: store `data` at `piece_offset` within
    /// the operation `[op_addr, op_addr + op_len)`.
    ///
    /// A transport may split one write into pieces; the whole operation's range
    /// is checked before any byte is stored, so a refused operation stores
    /// nothing. A zero-length operation succeeds without checks, as on RDMA NICs
    /// (rocev2-reference §4: a zero-length RETH need not carry a valid VA/R_Key;
    /// rxe `check_rkey` skips the lookup).
    pub fn remote_write(
        &self,
        rkey: u32,
        op_addr: u64,
        op_len: u64,
        piece_offset: u64,
        data: &[u8],
    ) -> Result<(), AccessError> {
        if op_len == 0 && data.is_empty() {
            return Ok(());
        }
        self.remote_write_with(
            rkey,
            op_addr,
            op_len,
            piece_offset,
            data.len() as u64,
            |dst| dst.copy_from_slice(data),
        )
    }

    /// Zero-copy form of [`Domain::remote_write`]: after the same checks, run `f`
    /// on the `len` destination bytes while the region is locked (a transport
    /// can read a socket straight into them). Keep `f` short and non-blocking.
    pub fn remote_write_with<R>(
        &self,
        rkey: u32,
        op_addr: u64,
        op_len: u64,
        piece_offset: u64,
        len: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, AccessError> {
        let (region, start) = self.check_piece(
            rkey,
            op_addr,
            op_len,
            piece_offset,
            len,
            Access::REMOTE_WRITE,
        )?;
        let mut mem = region.mem.write();
        if mem.revoked {
            return Err(AccessError::Revoked);
        }
        Ok(f(&mut mem.bytes_mut()[start..start + len as usize]))
    }

    /// Passive side of a one-sided read of `len` bytes at `piece_offset` within the
    /// operation `[op_addr, op_addr + op_len)`; the whole range is checked.
    pub fn remote_read(
        &self,
        rkey: u32,
        op_addr: u64,
        op_len: u64,
        piece_offset: u64,
        len: u64,
    ) -> Result<Bytes, AccessError> {
        if op_len == 0 && len == 0 {
            return Ok(Bytes::new());
        }
        let src = self.remote_read_source(rkey, op_addr, op_len, piece_offset, len)?;
        let bytes = Bytes::copy_from_slice(&src.lock());
        Ok(bytes)
    }

    /// Deferred form of [`Domain::remote_read`]: after the same checks, a
    /// handle on the `len` source bytes that a transport reads when the
    /// response actually leaves (as a NIC reads memory when it sends, not
    /// when the request arrives), so a response queued behind others is not
    /// copied meanwhile. The handle keeps the memory alive; a region
    /// deregistered after the check still yields its last bytes, as a NIC
    /// finishes a transfer it began.
    pub fn remote_read_source(
        &self,
        rkey: u32,
        op_addr: u64,
        op_len: u64,
        piece_offset: u64,
        len: u64,
    ) -> Result<LocalSlice, AccessError> {
        let (region, start) = self.check_piece(
            rkey,
            op_addr,
            op_len,
            piece_offset,
            len,
            Access::REMOTE_READ,
        )?;
        if region.mem.read().revoked {
            return Err(AccessError::Revoked);
        }
        Ok(LocalSlice {
            region,
            offset: start,
            len: len as usize,
        })
    }

    /// Check the whole operation, then locate the piece inside the region.
    fn check_piece(
        &self,
        rkey: u32,
        op_addr: u64,
        op_len: u64,
        piece_offset: u64,
        len: u64,
        need: Access,
    ) -> Result<(Arc<RegionInner>, usize), AccessError> {
        let (region, off) = self.check(rkey, op_addr, op_len, need)?;
        if piece_offset.checked_add(len).is_none_or(|e| e > op_len) {
            return Err(AccessError::OutOfBounds);
        }
        Ok((region, off + piece_offset as usize))
    }

    /// Passive side of a remote atomic on the 8-byte word at `addr`.
    ///
    /// Atomic with respect to every other remote atomic on the same domain,
    /// whichever connection carries it. The word is in native byte order.
    pub fn remote_atomic(&self, rkey: u32, addr: u64, op: AtomicOp) -> Result<u64, AccessError> {
        // Atomics need an 8-byte-aligned VA; rxe NAKs others as Invalid Request
        // (rocev2-reference §4).
        if addr % 8 != 0 {
            return Err(AccessError::Misaligned);
        }
        let (region, off) = self.check(rkey, addr, 8, Access::REMOTE_ATOMIC)?;
        let mut mem = region.mem.write();
        if mem.revoked {
            return Err(AccessError::Revoked);
        }
        let word = &mut mem.words[off / 8];
        let old = *word;
        match op {
            AtomicOp::CompareAndSwap { expected, new } => {
                if old == expected {
                    *word = new;
                }
            }
            AtomicOp::FetchAndAdd { add } => *word = old.wrapping_add(add),
        }
        Ok(old)
    }

    /// Revoke `rkey`, counting `len` bytes as no longer registered.
    fn revoke(&self, rkey: u32, len: usize) {
        let mut table = self.inner.table.write();
        if table.live.remove(&rkey).is_some() {
            self.inner
                .registered_bytes
                .fetch_sub(len as u64, Ordering::Relaxed);
            table.revoked.insert(rkey);
            table.revoked_order.push_back(rkey);
            if table.revoked_order.len() > REVOKED_MEMORY {
                if let Some(old) = table.revoked_order.pop_front() {
                    table.revoked.remove(&old);
                }
            }
        }
    }
}

/// A registered region: the local owner handle.
///
/// Dropping it deregisters the region (see [`MemoryRegion::deregister`]): peers
/// holding its [`RemoteRegion`] get [`AccessError::Revoked`] from then on. Keep
/// it alive for as long as peers use its key; in particular
/// `domain.register(..).remote()` drops the region at the end of the statement.
#[must_use = "dropping a MemoryRegion deregisters it at once; keep it while peers use its key"]
pub struct MemoryRegion {
    inner: Arc<RegionInner>,
    domain: Weak<DomainInner>,
}

impl fmt::Debug for MemoryRegion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryRegion")
            .field("addr", &format_args!("{:#x}", self.inner.addr))
            .field("len", &self.inner.len)
            .field("rkey", &format_args!("{:#010x}", self.rkey()))
            .field("access", &self.inner.access)
            .finish()
    }
}

/// Shared read access to a region's bytes; remote writes wait while it is held.
pub type RegionReadGuard<'a> = MappedRwLockReadGuard<'a, [u8]>;
/// Exclusive access to a region's bytes; remote accesses wait while it is held.
pub type RegionWriteGuard<'a> = MappedRwLockWriteGuard<'a, [u8]>;

impl MemoryRegion {
    /// The descriptor a peer needs to access the whole region. It is valid
    /// only while this `MemoryRegion` lives: keep the region, hand out the
    /// descriptor (for example with [`crate::Connection::send_region`]).
    pub fn remote(&self) -> RemoteRegion {
        RemoteRegion {
            addr: self.inner.addr,
            len: self.inner.len as u64,
            rkey: self.rkey(),
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.inner.len
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// The remote key.
    pub fn rkey(&self) -> u32 {
        self.inner.rkey.load(Ordering::Acquire)
    }

    /// The access rights given at registration.
    pub fn access(&self) -> Access {
        self.inner.access
    }

    /// Lock the bytes for reading. Hold it briefly: remote writes wait meanwhile.
    pub fn read(&self) -> RegionReadGuard<'_> {
        RwLockReadGuard::map(self.inner.mem.read(), |m| m.bytes())
    }

    /// Lock the bytes for writing. Hold it briefly: remote accesses wait meanwhile.
    pub fn write(&self) -> RegionWriteGuard<'_> {
        RwLockWriteGuard::map(self.inner.mem.write(), |m| m.bytes_mut())
    }

    /// Read the 8-byte word at `offset` (native byte order, as atomics see it).
    pub fn load_u64(&self, offset: usize) -> u64 {
        let b = self.read();
        u64::from_ne_bytes(b[offset..offset + 8].try_into().expect("8 bytes"))
    }

    /// Store the 8-byte word at `offset` (native byte order).
    pub fn store_u64(&self, offset: usize, value: u64) {
        self.write()[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
    }

    /// A local slice `[offset, offset + len)` to use as the source or destination
    /// of an operation ([`crate::Connection::write_from`], [`crate::Connection::read_into`]).
    pub fn slice(&self, offset: usize, len: usize) -> Result<LocalSlice> {
        if offset.checked_add(len).is_none_or(|e| e > self.inner.len) {
            return Err(Error::LocalAccess(AccessError::OutOfBounds));
        }
        Ok(LocalSlice {
            region: self.inner.clone(),
            offset,
            len,
        })
    }

    /// Deregister now: revoke the key so no new remote access starts, and wait for
    /// accesses in progress to finish. The memory itself is freed once no
    /// [`LocalSlice`] refers to it.
    pub fn deregister(self) {
        // Drop does the work.
    }

    fn revoke_now(&self) {
        // Mark revoked under the write lock: waits for any access holding the lock.
        self.inner.mem.write().revoked = true;
        let rkey = self.rkey();
        if let Some(d) = self.domain.upgrade() {
            let d = Domain { inner: d };
            d.revoke(rkey, self.inner.len);
            let alias = self.inner.alias.load(Ordering::Acquire);
            if alias != 0 {
                d.revoke(alias, 0);
            }
        }
        // Deregister from the NIC (`ibv_dereg_mr` returns once the device no
        // longer touches the memory) before the memory can be freed.
        drop(self.inner.device.lock().take());
        tracing::debug!(rkey = format_args!("{rkey:#010x}"), "region deregistered");
    }
}

impl Drop for MemoryRegion {
    fn drop(&mut self) {
        self.revoke_now();
    }
}

/// A byte range of a local registered region, owned by an operation until it
/// completes. Holding it keeps the memory alive (never freed under a transfer).
#[derive(Clone)]
pub struct LocalSlice {
    region: Arc<RegionInner>,
    offset: usize,
    len: usize,
}

impl fmt::Debug for LocalSlice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LocalSlice")
            .field(
                "rkey",
                &format_args!("{:#010x}", self.region.rkey.load(Ordering::Relaxed)),
            )
            .field("offset", &self.offset)
            .field("len", &self.len)
            .finish()
    }
}

impl LocalSlice {
    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when zero-length.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Lock the slice's bytes for reading (local and remote writes to the
    /// region wait meanwhile; hold it briefly, for one socket write at most).
    /// A region deregistered meanwhile still shows its last bytes, as a NIC
    /// finishes a transfer it began. Recursive: a holder of another guard on
    /// the same region cannot deadlock against a waiting writer.
    pub fn lock(&self) -> RegionReadGuard<'_> {
        let (start, len) = (self.offset, self.len);
        RwLockReadGuard::map(self.region.mem.read_recursive(), move |m| {
            &m.bytes()[start..start + len]
        })
    }

    /// Copy the slice's bytes out (fails if the region was deregistered).
    pub fn to_bytes(&self) -> Result<Bytes> {
        let mem = self.region.mem.read();
        if mem.revoked {
            return Err(Error::LocalAccess(AccessError::Revoked));
        }
        Ok(Bytes::copy_from_slice(
            &mem.bytes()[self.offset..self.offset + self.len],
        ))
    }

    /// Run `f` on `len` bytes of the slice from `offset`, under the region's
    /// write lock (local and remote accesses to the region wait meanwhile:
    /// keep `f` short and non-blocking, one socket read at most). A transport
    /// receives a read's answer straight into its destination this way.
    /// Fails if the range is outside the slice or the region was
    /// deregistered.
    pub fn fill_with<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R> {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::LocalAccess(AccessError::OutOfBounds));
        }
        let mut mem = self.region.mem.write();
        if mem.revoked {
            return Err(Error::LocalAccess(AccessError::Revoked));
        }
        let start = self.offset + offset;
        Ok(f(&mut mem.bytes_mut()[start..start + len]))
    }

    /// Store `data` (exactly `len` bytes) into the slice.
    pub fn fill_from(&self, data: &[u8]) -> Result<()> {
        if data.len() != self.len {
            return Err(Error::InvalidArgument(format!(
                "{} bytes for a {}-byte slice",
                data.len(),
                self.len
            )));
        }
        let mut mem = self.region.mem.write();
        if mem.revoked {
            return Err(Error::LocalAccess(AccessError::Revoked));
        }
        mem.bytes_mut()[self.offset..self.offset + self.len].copy_from_slice(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_random_and_unique() {
        let d = Domain::new();
        let regions: Vec<_> = (0..64).map(|_| d.register(16, Access::ALL)).collect();
        let keys: HashSet<u32> = regions.iter().map(|r| r.rkey()).collect();
        assert_eq!(keys.len(), 64);
        let sorted: Vec<u32> = regions.iter().map(|r| r.rkey()).collect();
        // Sequential keys would differ by small constants; random ones almost never do.
        let seq = sorted
            .windows(2)
            .filter(|w| w[1].wrapping_sub(w[0]) < 16)
            .count();
        assert!(seq < 4, "keys look sequential: {sorted:?}");
    }

    #[test]
    fn read_source_is_checked_then_read_when_locked_and_outlives_its_region() {
        let d = Domain::new();
        let mr = d.register_from(&(0..64u8).collect::<Vec<_>>(), Access::ALL);
        let r = mr.remote();
        let no_read = d.register(64, Access::REMOTE_WRITE);
        assert_eq!(
            d.remote_read_source(no_read.rkey(), no_read.remote().addr, 8, 0, 8)
                .err(),
            Some(AccessError::Permission)
        );
        assert_eq!(
            d.remote_read_source(r.rkey, r.addr + 60, 8, 0, 8).err(),
            Some(AccessError::OutOfBounds)
        );
        // Piece 16..48 of the operation at 8..56.
        let src = d
            .remote_read_source(r.rkey, r.addr + 8, 48, 16, 32)
            .unwrap();
        assert_eq!(src.len(), 32);
        // Read when locked, not when checked: a later local write shows.
        mr.write()[24] = 0xee;
        {
            let a = src.lock();
            // Recursive: a second guard while one is held does not block.
            let b = src.lock();
            let mut want: Vec<u8> = (24..56).collect();
            want[0] = 0xee;
            assert_eq!(&a[..], &want[..]);
            assert_eq!(&a[..], &b[..]);
        }
        // Deregistered: no new source, but the one taken keeps the memory.
        let key = r.rkey;
        drop(mr);
        assert_eq!(
            d.remote_read_source(key, r.addr, 8, 0, 8).err(),
            Some(AccessError::Revoked)
        );
        assert_eq!(src.lock()[1], 25);
    }

    #[test]
    fn checks_match_rdma_rules() {
        let d = Domain::new();
        let mr = d.register(64, Access::REMOTE_READ | Access::REMOTE_ATOMIC);
        let r = mr.remote();
        assert_eq!(r.addr % 8, 0);
        assert_eq!(
            d.remote_write(r.rkey, r.addr, 1, 0, b"x"),
            Err(AccessError::Permission)
        );
        assert_eq!(
            d.remote_read(r.rkey ^ 1, r.addr, 1, 0, 1),
            Err(AccessError::UnknownKey)
        );
        assert_eq!(
            d.remote_read(r.rkey, r.addr + 60, 5, 0, 5),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            d.remote_read(r.rkey, r.addr - 1, 1, 0, 1),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            d.remote_atomic(r.rkey, r.addr + 4, AtomicOp::FetchAndAdd { add: 1 }),
            Err(AccessError::Misaligned)
        );
        assert_eq!(
            d.remote_atomic(r.rkey, r.addr + 64, AtomicOp::FetchAndAdd { add: 1 }),
            Err(AccessError::OutOfBounds)
        );
        assert_eq!(
            d.remote_atomic(r.rkey, r.addr + 8, AtomicOp::FetchAndAdd { add: 5 }),
            Ok(0)
        );
        assert_eq!(mr.load_u64(8), 5);
        assert_eq!(
            d.remote_atomic(
                r.rkey,
                r.addr + 8,
                AtomicOp::CompareAndSwap {
                    expected: 4,
                    new: 9
                }
            ),
            Ok(5)
        );
        assert_eq!(mr.load_u64(8), 5, "failed CAS must not store");
        let rkey = r.rkey;
        mr.deregister();
        assert_eq!(
            d.remote_read(rkey, r.addr, 1, 0, 1),
            Err(AccessError::Revoked)
        );
        assert_eq!(d.region_count(), 0);
        assert_eq!(d.registered_bytes(), 0);
    }

    #[test]
    fn refused_write_stores_nothing() {
        let d = Domain::new();
        let mr = d.register(16, Access::ALL);
        let r = mr.remote();
        // Whole op [addr+8, addr+24) is out of bounds even though the first piece fits.
        assert_eq!(
            d.remote_write(r.rkey, r.addr + 8, 16, 0, &[1u8; 8]),
            Err(AccessError::OutOfBounds)
        );
        assert!(mr.read().iter().all(|&b| b == 0));
    }

    #[test]
    fn remote_region_codec_and_slices() {
        let r = RemoteRegion {
            addr: 0x1122_3344_5566_7788,
            len: 4096,
            rkey: 0xdead_beef,
        };
        assert_eq!(RemoteRegion::from_bytes(&r.to_bytes()), Some(r));
        assert_eq!(RemoteRegion::from_bytes(&[0; 19]), None);
        let s = r.slice(100, 50).unwrap();
        assert_eq!((s.addr, s.len, s.rkey), (r.addr + 100, 50, r.rkey));
        assert!(r.slice(4000, 97).is_err());
        assert!(r.slice(u64::MAX, 2).is_err());
        let json = serde_json::to_string(&r).unwrap();
        assert_eq!(serde_json::from_str::<RemoteRegion>(&json).unwrap(), r);
    }

    #[test]
    fn local_slice_outlives_region_handle_safely() {
        let d = Domain::new();
        let mr = d.register_from(b"hello world", Access::ALL);
        let s = mr.slice(6, 5).unwrap();
        assert_eq!(&s.to_bytes().unwrap()[..], b"world");
        drop(mr);
        assert!(matches!(
            s.to_bytes(),
            Err(Error::LocalAccess(AccessError::Revoked))
        ));
    }

    #[test]
    fn fill_with_writes_its_part_of_the_slice_and_nothing_else() {
        let d = Domain::new();
        let mr = d.register_from(b"hello world", Access::ALL);
        let s = mr.slice(6, 5).unwrap();
        // Bytes 1..4 of the slice ("orl"), as a socket read into them would.
        let n = s.fill_with(1, 3, |dst| {
            dst.copy_from_slice(b"ORL");
            dst.len()
        });
        assert_eq!(n.unwrap(), 3);
        assert_eq!(&mr.read()[..], b"hello wORLd");
        // Past the slice's end (not the region's): refused, nothing written.
        assert!(matches!(
            s.fill_with(3, 3, |dst| dst.fill(0)),
            Err(Error::LocalAccess(AccessError::OutOfBounds))
        ));
        assert!(matches!(
            s.fill_with(usize::MAX, 2, |dst| dst.fill(0)),
            Err(Error::LocalAccess(AccessError::OutOfBounds))
        ));
        assert_eq!(&mr.read()[..], b"hello wORLd");
        drop(mr);
        assert!(matches!(
            s.fill_with(0, 1, |dst| dst.fill(0)),
            Err(Error::LocalAccess(AccessError::Revoked))
        ));
    }

    proptest::proptest! {
        #[test]
        fn bounds_check_never_panics(addr_off in -100i64..200, len in 0u64..300, key_ok: bool) {
            let d = Domain::new();
            let mr = d.register(128, Access::ALL);
            let r = mr.remote();
            let addr = (r.addr as i64 + addr_off) as u64;
            let key = if key_ok { r.rkey } else { r.rkey.wrapping_add(1) };
            let res = d.remote_read(key, addr, len, 0, len);
            let in_bounds = addr_off >= 0 && (addr_off as u64 + len) <= 128;
            if len == 0 {
                proptest::prop_assert!(res.is_ok());
            } else if !key_ok {
                proptest::prop_assert_eq!(res, Err(AccessError::UnknownKey));
            } else if in_bounds {
                proptest::prop_assert_eq!(res.unwrap().len() as u64, len);
            } else {
                proptest::prop_assert_eq!(res, Err(AccessError::OutOfBounds));
            }
        }
    }

    /// `register_bytes` lends the caller's buffer without copying it, for
    /// remote reads only; a local write copies first and leaves it untouched.
    #[test]
    fn registered_bytes_are_lent_read_only() {
        let d = Domain::new();
        let data = Bytes::from((0..10_000u32).map(|i| i as u8).collect::<Vec<u8>>());
        let mr = d.register_bytes(data.clone());
        assert_eq!(mr.read().as_ptr(), data.as_ptr(), "no copy");
        let r = mr.remote();
        assert_eq!(r.addr, data.as_ptr() as u64);
        assert_eq!(
            d.remote_read(r.rkey, r.addr, r.len, 0, r.len).unwrap(),
            data
        );
        assert_eq!(
            d.remote_write(r.rkey, r.addr, 4, 0, b"evil"),
            Err(AccessError::Permission)
        );
        assert_eq!(
            d.remote_atomic(r.rkey, r.addr, AtomicOp::FetchAndAdd { add: 1 }),
            Err(AccessError::Permission)
        );
        mr.write()[..4].copy_from_slice(b"mine");
        assert_eq!(&mr.read()[..4], b"mine");
        assert_eq!(data[..4], [0, 1, 2, 3], "the lent Bytes never change");
        mr.deregister();
        assert_eq!(
            d.remote_read(r.rkey, r.addr, 4, 0, 4),
            Err(AccessError::Revoked)
        );
    }

    /// A fake NIC: hands out the keys it is told to, records what is registered.
    struct FakeNic {
        keys: parking_lot::Mutex<VecDeque<u32>>,
        live: Arc<parking_lot::Mutex<Vec<(u64, usize, u32)>>>,
    }

    struct FakeMr {
        live: Arc<parking_lot::Mutex<Vec<(u64, usize, u32)>>>,
        rkey: u32,
    }

    impl Drop for FakeMr {
        fn drop(&mut self) {
            self.live.lock().retain(|e| e.2 != self.rkey);
        }
    }

    impl DeviceMemory for FakeNic {
        fn name(&self) -> String {
            "fake0".into()
        }
        fn register(&self, addr: u64, len: usize, _a: Access) -> Result<DeviceRegistration> {
            let rkey = self.keys.lock().pop_front().expect("test ran out of keys");
            self.live.lock().push((addr, len, rkey));
            Ok(DeviceRegistration {
                rkey,
                lkey: rkey ^ 0xFFFF,
                guard: Box::new(FakeMr {
                    live: self.live.clone(),
                    rkey,
                }),
            })
        }
    }

    fn fake_nic(keys: &[u32]) -> Arc<FakeNic> {
        Arc::new(FakeNic {
            keys: parking_lot::Mutex::new(keys.iter().copied().collect()),
            live: Arc::default(),
        })
    }

    #[test]
    fn device_binding_gives_regions_nic_keys() {
        let d = Domain::new();
        let before = d.register_from(b"registered before the NIC", Access::ALL);
        let old_key = before.rkey();
        let empty = d.register(0, Access::ALL);
        let other = d.register(8, Access::ALL);
        // The first key the NIC offers was used by a region deregistered
        // earlier: it must not be reused, so the region is registered again.
        let gone = d.register(8, Access::ALL).rkey();
        let nic = fake_nic(&[gone, 0x1111_0001, 0x2222_0002, 0x3333_0003]);
        d.bind_device(nic.clone()).unwrap();
        d.bind_device(nic.clone()).unwrap(); // same device: no-op
        let err = d.bind_device(fake_nic(&[])).unwrap_err().to_string();
        assert!(err.contains("already bound to RDMA device fake0"), "{err}");

        // Every non-empty region is on the NIC, under the NIC's key.
        let live = nic.live.lock().clone();
        assert_eq!(live.len(), 2, "{live:?}");
        assert!(live.iter().all(|e| e.2 != gone), "revoked key skipped");
        let mut got = [before.rkey(), other.rkey()];
        got.sort();
        assert_eq!(got, [0x1111_0001, 0x2222_0002]);
        assert!(live
            .iter()
            .any(|e| e.2 == before.rkey() && e.0 == before.remote().addr));
        assert_eq!(before.remote().rkey, before.rkey());
        assert_ne!(before.rkey(), old_key);
        assert_eq!(empty.remote().len, 0);
        // Old and new keys both reach the same bytes through the domain.
        let r = before.remote();
        for key in [old_key, r.rkey] {
            assert_eq!(
                d.remote_read(key, r.addr, r.len, 0, r.len).unwrap(),
                &b"registered before the NIC"[..]
            );
        }
        // Lkeys for zero-copy posting, bounds-checked.
        assert_eq!(d.device_lkey(r.rkey, r.addr + 2, 5), Some(r.rkey ^ 0xFFFF));
        assert_eq!(d.device_lkey(r.rkey, r.addr + 2, r.len), None);

        // New regions are registered at once and take the NIC's key.
        let after = d.register(64, Access::ALL);
        assert_eq!(after.rkey(), 0x3333_0003);
        assert_eq!(nic.live.lock().len(), 3);

        // Deregistering revokes both keys and the NIC registration.
        drop(before);
        assert_eq!(
            d.remote_read(old_key, r.addr, 1, 0, 1),
            Err(AccessError::Revoked)
        );
        assert_eq!(
            d.remote_read(r.rkey, r.addr, 1, 0, 1),
            Err(AccessError::Revoked)
        );
        assert!(nic.live.lock().iter().all(|e| e.2 != r.rkey));
        assert_eq!(d.region_count(), 3, "other, empty, after");
        assert_eq!(d.registered_bytes(), 8 + 64);
    }
}
