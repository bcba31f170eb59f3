//! Pre-registered buffers for the hardware provider, so the hot path never
//! calls `ibv_reg_mr`: memory is allocated in page-aligned chunks, each
//! registered once, and carved into power-of-two slots (256 B and up).
//!
//! A [`Slot`] is owned by exactly one party at a time: the pool, a posted
//! work request (through the registry in [`super::track`]), or — after its
//! completion — a `Bytes` handed to the application ([`Slot::freeze`]), which
//! returns the slot to the pool when the last clone drops. This is the only
//! module of the provider that touches raw memory (besides the verbs calls).
#![allow(unsafe_code)]

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use bytes::Bytes;
use parking_lot::Mutex;
use rdmx_core::{Error, Result};

/// Registers memory with the NIC (`ibv_reg_mr` with local write).
pub trait Registrar: Send + Sync + 'static {
    /// Register `len` bytes at `addr`; returns the local key and a guard
    /// that deregisters on drop.
    fn register(&self, addr: u64, len: usize) -> Result<(u32, Box<dyn Send + Sync>)>;
}

/// Smallest slot.
const MIN_SLOT: usize = 256;
/// Chunks are at least this big (slots of up to this size share a chunk).
const CHUNK: usize = 2 << 20;
/// Largest slot (one message of rdmx's largest `max_message`).
const MAX_CLASS: usize = 23; // 256 << 23 = 2 GiB

/// One registered allocation.
struct Chunk {
    ptr: NonNull<u8>,
    layout: Layout,
    lkey: u32,
    mr: Mutex<Option<Box<dyn Send + Sync>>>,
}

// SAFETY: the chunk is plain memory; who may touch which bytes is decided by
// slot ownership (one owner per slot), never by the thread.
unsafe impl Send for Chunk {}
// SAFETY: as above; shared references only hand out the pointer.
unsafe impl Sync for Chunk {}

impl Chunk {
    fn new(len: usize, reg: &dyn Registrar) -> Result<Chunk> {
        let layout = Layout::from_size_align(len, 4096)
            .map_err(|e| Error::InvalidArgument(format!("buffer of {len} bytes: {e}")))?;
        // SAFETY: `layout` has a non-zero size (callers pass >= MIN_SLOT).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(|| {
            Error::ResourceExhausted(format!("out of memory for {len} bytes of RDMA buffers"))
        })?;
        let mut chunk = Chunk {
            ptr,
            layout,
            lkey: 0,
            mr: Mutex::new(None),
        };
        // If registration fails, dropping `chunk` frees the memory.
        let (lkey, mr) = reg.register(ptr.as_ptr() as u64, len)?;
        chunk.lkey = lkey;
        *chunk.mr.get_mut() = Some(mr);
        Ok(chunk)
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        // Deregister first: the NIC must be done with the memory before it is freed.
        drop(self.mr.get_mut().take());
        // SAFETY: allocated in `Chunk::new` with this layout, freed once.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

struct Free {
    chunk: Arc<Chunk>,
    off: usize,
}

struct PoolInner {
    reg: Arc<dyn Registrar>,
    classes: Vec<Mutex<Vec<Free>>>,
    registrations: AtomicU64,
    registered_bytes: AtomicU64,
}

/// A pool of registered buffers.
#[derive(Clone)]
pub struct BufPool {
    inner: Arc<PoolInner>,
}

impl std::fmt::Debug for BufPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BufPool")
            .field("registrations", &self.registrations())
            .field("registered_bytes", &self.registered_bytes())
            .finish()
    }
}

fn class_of(len: usize) -> Option<usize> {
    let size = len.max(MIN_SLOT).checked_next_power_of_two()?;
    let class = (size / MIN_SLOT).trailing_zeros() as usize;
    (class <= MAX_CLASS).then_some(class)
}

fn class_size(class: usize) -> usize {
    MIN_SLOT << class
}

impl BufPool {
    /// An empty pool registering through `reg`.
    pub fn new(reg: Arc<dyn Registrar>) -> BufPool {
        BufPool {
            inner: Arc::new(PoolInner {
                reg,
                classes: (0..=MAX_CLASS).map(|_| Mutex::new(Vec::new())).collect(),
                registrations: AtomicU64::new(0),
                registered_bytes: AtomicU64::new(0),
            }),
        }
    }

    /// Memory registrations made so far (each one an `ibv_reg_mr`).
    pub fn registrations(&self) -> u64 {
        self.inner.registrations.load(Ordering::Relaxed)
    }

    /// Bytes registered so far.
    pub fn registered_bytes(&self) -> u64 {
        self.inner.registered_bytes.load(Ordering::Relaxed)
    }

    fn class(len: usize) -> Result<usize> {
        class_of(len).ok_or_else(|| {
            Error::InvalidArgument(format!("RDMA buffer of {len} bytes is too large"))
        })
    }

    /// Make sure `count` slots of at least `len` bytes are free, registering
    /// now (at setup) so that [`BufPool::take`] does not later.
    pub fn reserve(&self, len: usize, count: usize) -> Result<()> {
        let class = Self::class(len)?;
        while self.inner.classes[class].lock().len() < count {
            self.grow(class)?;
        }
        Ok(())
    }

    fn grow(&self, class: usize) -> Result<()> {
        let size = class_size(class);
        let bytes = size.max(CHUNK);
        let chunk = Arc::new(Chunk::new(bytes, &*self.inner.reg)?);
        self.inner.registrations.fetch_add(1, Ordering::Relaxed);
        self.inner
            .registered_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        let mut free = self.inner.classes[class].lock();
        free.extend((0..bytes / size).map(|i| Free {
            chunk: chunk.clone(),
            off: i * size,
        }));
        Ok(())
    }

    /// A slot of at least `len` bytes (registering a new chunk only if the
    /// class ran dry).
    pub fn take(&self, len: usize) -> Result<Slot> {
        let class = Self::class(len)?;
        loop {
            if let Some(f) = self.inner.classes[class].lock().pop() {
                return Ok(Slot {
                    free: Some(f),
                    class,
                    pool: Arc::downgrade(&self.inner),
                });
            }
            self.grow(class)?;
        }
    }
}

/// A registered buffer, returned to its pool when dropped.
pub struct Slot {
    free: Option<Free>,
    class: usize,
    pool: Weak<PoolInner>,
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("addr", &format_args!("{:#x}", self.addr()))
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Slot {
    fn free(&self) -> &Free {
        self.free.as_ref().expect("slot present until drop")
    }

    /// Address for the scatter/gather entry.
    pub fn addr(&self) -> u64 {
        let f = self.free();
        f.chunk.ptr.as_ptr() as u64 + f.off as u64
    }

    /// Local key for the scatter/gather entry.
    pub fn lkey(&self) -> u32 {
        self.free().lkey()
    }

    /// Bytes the slot holds.
    pub fn capacity(&self) -> usize {
        class_size(self.class)
    }

    /// Copy `parts` into the slot, one after another; returns the length.
    /// Fails if they do not fit.
    pub fn fill(&mut self, parts: &[Bytes]) -> Result<usize> {
        let total: usize = parts.iter().map(|p| p.len()).sum();
        if total > self.capacity() {
            return Err(Error::InvalidArgument(format!(
                "{total} bytes do not fit a {} byte buffer",
                self.capacity()
            )));
        }
        let dst = self.bytes_mut();
        let mut at = 0;
        for p in parts {
            dst[at..at + p.len()].copy_from_slice(p);
            at += p.len();
        }
        Ok(total)
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        let (addr, cap) = (self.addr(), self.capacity());
        // SAFETY: the slot's range lies inside its chunk, which outlives it
        // (the slot holds an Arc). `&mut self` is the only owner: the slot is
        // neither in the pool nor posted to the NIC while a caller holds it.
        unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, cap) }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: as in `bytes_mut`; the NIC has finished writing (its
        // completion was polled) and nothing writes while `&self` exists.
        unsafe { std::slice::from_raw_parts(self.addr() as *const u8, self.capacity()) }
    }

    /// The first 8 bytes (an atomic's original value).
    pub fn word(&self) -> [u8; 8] {
        self.bytes()[..8]
            .try_into()
            .expect("slots hold at least 256 bytes")
    }

    /// The first `len` bytes as `Bytes`, without copying: the slot goes back
    /// to the pool when the last clone is dropped.
    pub fn freeze(self, len: usize) -> Bytes {
        let len = len.min(self.capacity());
        Bytes::from_owner(Filled { slot: self, len })
    }
}

impl Free {
    fn lkey(&self) -> u32 {
        self.chunk.lkey
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let (Some(f), Some(pool)) = (self.free.take(), self.pool.upgrade()) {
            pool.classes[self.class].lock().push(f);
        }
    }
}

struct Filled {
    slot: Slot,
    len: usize,
}

impl AsRef<[u8]> for Filled {
    fn as_ref(&self) -> &[u8] {
        &self.slot.bytes()[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Counts registrations and checks every deregistration matches one.
    #[derive(Default)]
    struct Counting {
        live: Arc<Mutex<HashSet<u64>>>,
    }

    struct Guard(Arc<Mutex<HashSet<u64>>>, u64);
    impl Drop for Guard {
        fn drop(&mut self) {
            assert!(self.0.lock().remove(&self.1), "deregistered twice");
        }
    }

    impl Registrar for Counting {
        fn register(&self, addr: u64, len: usize) -> Result<(u32, Box<dyn Send + Sync>)> {
            assert_eq!(addr % 4096, 0, "page aligned");
            assert!(len >= CHUNK);
            self.live.lock().insert(addr);
            Ok((
                addr as u32 ^ 0x5a5a,
                Box::new(Guard(self.live.clone(), addr)),
            ))
        }
    }

    #[test]
    fn slots_are_registered_once_and_reused() {
        let reg = Arc::new(Counting::default());
        let pool = BufPool::new(reg.clone());
        pool.reserve(4096, 16).unwrap();
        assert_eq!(
            pool.registrations(),
            1,
            "one 2 MiB chunk holds 512 slots of 4 KiB"
        );
        let mut seen = HashSet::new();
        let slots: Vec<Slot> = (0..16).map(|_| pool.take(3000).unwrap()).collect();
        for s in &slots {
            assert_eq!(s.capacity(), 4096);
            assert!(seen.insert(s.addr()), "distinct slots");
            let chunk = reg
                .live
                .lock()
                .iter()
                .copied()
                .find(|&a| (a..a + CHUNK as u64).contains(&s.addr()));
            assert_eq!(
                Some(s.lkey()),
                chunk.map(|a| a as u32 ^ 0x5a5a),
                "the chunk's key"
            );
        }
        drop(slots);
        for _ in 0..1000 {
            drop(pool.take(4096).unwrap());
        }
        assert_eq!(pool.registrations(), 1, "the hot path never registers");
        let big = pool.take(5 << 20).unwrap();
        assert_eq!(big.capacity(), 8 << 20);
        assert_eq!(pool.registrations(), 2);
        drop(big);
        drop(pool);
        assert!(
            reg.live.lock().is_empty(),
            "all deregistered when the pool goes"
        );
    }

    #[test]
    fn filled_slots_become_bytes_without_copying() {
        let pool = BufPool::new(Arc::new(Counting::default()));
        let mut s = pool.take(300).unwrap();
        let addr = s.addr();
        let n = s
            .fill(&[Bytes::from_static(b"hello "), Bytes::from_static(b"world")])
            .unwrap();
        assert_eq!(n, 11);
        let b = s.freeze(n);
        assert_eq!(&b[..], b"hello world");
        assert_eq!(b.as_ptr() as u64, addr, "no copy");
        let tail = b.slice(6..);
        drop(b);
        assert_eq!(&tail[..], b"world", "a clone keeps the slot");
        // The slot comes back only after the last clone is gone.
        let again = pool.take(300).unwrap();
        assert_ne!(again.addr(), addr);
        drop(tail);
        let mut held = vec![again];
        let found = (0..8192).any(|_| {
            let t = pool.take(300).unwrap();
            let hit = t.addr() == addr;
            held.push(t); // keep it out of the pool
            hit
        });
        assert!(found, "the returned slot is handed out again");
    }

    #[test]
    fn too_big_or_overfull_is_an_error() {
        let pool = BufPool::new(Arc::new(Counting::default()));
        let mut s = pool.take(256).unwrap();
        assert!(s.fill(&[Bytes::from(vec![0u8; 257])]).is_err());
        assert_eq!(s.fill(&[Bytes::from(vec![9u8; 256])]).unwrap(), 256);
        assert_eq!(s.word(), [9u8; 8]);
        assert!(pool.take(usize::MAX).is_err());
        assert!(class_of(256 << 24).is_none());
    }
}
