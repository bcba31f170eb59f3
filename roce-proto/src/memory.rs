//! The responder's view of registered memory: a small trait, so the engine
//! stays sans-IO and tests use plain `Vec`-backed regions.

use std::any::Any;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;

/// Access a remote operation needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// RDMA READ.
    Read,
    /// RDMA WRITE.
    Write,
    /// Atomics.
    Atomic,
}

/// Why memory refused an access; all but `Misaligned` become NAK Remote Access
/// Error (0x62), `Misaligned` becomes NAK Invalid Request (0x61)
/// (rocev2-reference §4–§5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemError {
    /// No region has this R_Key.
    UnknownKey,
    /// The range leaves the region.
    OutOfBounds,
    /// The region lacks the access right.
    Permission,
    /// The region was deregistered.
    Revoked,
    /// An atomic target that is not 8-byte aligned.
    Misaligned,
}

/// An atomic operation (rocev2-reference §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Atomic {
    /// `if *va == compare { *va = swap }`.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// New value.
        swap: u64,
    },
    /// `*va += add`.
    FetchAdd {
        /// Addend.
        add: u64,
    },
}

/// Bytes of registered memory that a packet carries by reference
/// ([`crate::Packet::deferred`]), read when the packet is sent.
pub trait PayloadSource: Send + Sync + fmt::Debug {
    /// Length in bytes.
    fn len(&self) -> usize;
    /// True when zero-length.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The bytes of `range` (within `0..len()`), copied as they are now.
    fn copy(&self, range: Range<usize>) -> Bytes;
    /// Append the bytes of `range` to `out` (one copy; the default goes
    /// through [`PayloadSource::copy`]).
    fn append_to(&self, range: Range<usize>, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.copy(range));
    }
    /// The concrete source, for a transmitter that reads its own kind in
    /// place instead of copying.
    fn as_any(&self) -> &dyn Any;
}

/// Registered memory as the responder reaches it.
pub trait Memory {
    /// Check that `[va, va + len)` under `rkey` allows `need` (no data moves).
    fn check(&self, rkey: u32, va: u64, len: u64, need: Need) -> Result<(), MemError>;
    /// Store `data` at `va`.
    fn write(&mut self, rkey: u32, va: u64, data: &[u8]) -> Result<(), MemError>;
    /// Load `len` bytes at `va`.
    fn read(&self, rkey: u32, va: u64, len: u64) -> Result<Bytes, MemError>;
    /// The `len` bytes at `va` as a source the transmitter reads when each
    /// response leaves (a NIC's DMA reads a READ's data as it sends it,
    /// not when the request arrives), or `None` to have [`Memory::read`]
    /// copy them now (the default).
    fn read_source(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
    ) -> Result<Option<Arc<dyn PayloadSource>>, MemError> {
        let _ = (rkey, va, len);
        Ok(None)
    }
    /// Run an atomic on the 8-byte word at `va`; returns the original value.
    fn atomic(&mut self, rkey: u32, va: u64, op: Atomic) -> Result<u64, MemError>;
}

/// One `Vec`-backed region, for tests and simulations.
#[derive(Clone, Debug)]
pub struct VecRegion {
    /// Remote key.
    pub rkey: u32,
    /// Virtual address of byte 0.
    pub va: u64,
    /// Contents.
    pub data: Vec<u8>,
    /// Remote read allowed.
    pub read: bool,
    /// Remote write allowed.
    pub write: bool,
    /// Remote atomics allowed.
    pub atomic: bool,
}

/// A set of [`VecRegion`]s implementing [`Memory`].
#[derive(Clone, Debug, Default)]
pub struct VecMemory {
    /// The regions.
    pub regions: Vec<VecRegion>,
    /// Answer [`Memory::read_source`] with a source (a copy taken at the
    /// request, read again as each response leaves), so READ responses go
    /// through the engine with deferred payloads, as a transport that sends
    /// from registered memory has them; otherwise responses carry bytes.
    pub lend_reads: bool,
}

/// The bytes a [`VecMemory`] lends for a READ.
#[derive(Debug)]
struct LentBytes(Bytes);

impl PayloadSource for LentBytes {
    fn len(&self) -> usize {
        self.0.len()
    }

    fn copy(&self, range: Range<usize>) -> Bytes {
        self.0.slice(range)
    }

    fn append_to(&self, range: Range<usize>, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.0[range]);
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

impl VecMemory {
    /// Add a region with all rights; returns its index.
    pub fn add(&mut self, rkey: u32, va: u64, data: Vec<u8>) -> usize {
        self.regions.push(VecRegion {
            rkey,
            va,
            data,
            read: true,
            write: true,
            atomic: true,
        });
        self.regions.len() - 1
    }

    fn find(&self, rkey: u32, va: u64, len: u64, need: Need) -> Result<(usize, usize), MemError> {
        let (i, r) = self
            .regions
            .iter()
            .enumerate()
            .find(|(_, r)| r.rkey == rkey)
            .ok_or(MemError::UnknownKey)?;
        let ok = match need {
            Need::Read => r.read,
            Need::Write => r.write,
            Need::Atomic => r.atomic,
        };
        if !ok {
            return Err(MemError::Permission);
        }
        let off = va.checked_sub(r.va).ok_or(MemError::OutOfBounds)?;
        if off.checked_add(len).is_none_or(|e| e > r.data.len() as u64) {
            return Err(MemError::OutOfBounds);
        }
        Ok((i, off as usize))
    }
}

impl Memory for VecMemory {
    fn check(&self, rkey: u32, va: u64, len: u64, need: Need) -> Result<(), MemError> {
        self.find(rkey, va, len, need).map(|_| ())
    }

    fn write(&mut self, rkey: u32, va: u64, data: &[u8]) -> Result<(), MemError> {
        let (i, off) = self.find(rkey, va, data.len() as u64, Need::Write)?;
        self.regions[i].data[off..off + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn read(&self, rkey: u32, va: u64, len: u64) -> Result<Bytes, MemError> {
        let (i, off) = self.find(rkey, va, len, Need::Read)?;
        Ok(Bytes::copy_from_slice(
            &self.regions[i].data[off..off + len as usize],
        ))
    }

    fn read_source(
        &self,
        rkey: u32,
        va: u64,
        len: u64,
    ) -> Result<Option<Arc<dyn PayloadSource>>, MemError> {
        if !self.lend_reads {
            return Ok(None);
        }
        let bytes = self.read(rkey, va, len)?;
        Ok(Some(Arc::new(LentBytes(bytes))))
    }

    fn atomic(&mut self, rkey: u32, va: u64, op: Atomic) -> Result<u64, MemError> {
        if va % 8 != 0 {
            return Err(MemError::Misaligned);
        }
        let (i, off) = self.find(rkey, va, 8, Need::Atomic)?;
        let w = &mut self.regions[i].data[off..off + 8];
        let old = u64::from_ne_bytes(w.try_into().expect("8 bytes"));
        let new = match op {
            Atomic::CompareSwap { compare, swap } => {
                if old == compare {
                    swap
                } else {
                    old
                }
            }
            Atomic::FetchAdd { add } => old.wrapping_add(add),
        };
        w.copy_from_slice(&new.to_ne_bytes());
        Ok(old)
    }
}
