//! Recycled receive buffers for large payloads (shared by the transports).
//!
//! A fresh multi-megabyte allocation per received message costs page faults and
//! page zeroing on every receive (they dominated profiles of 1 MiB transfers).
//! Large payloads are read into buffers from this pool instead, and handed to
//! the user as [`Bytes`] whose owner returns the buffer here when dropped.

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use parking_lot::Mutex;

use crate::{Error, Result};

/// Smallest pooled size class.
const MIN_CLASS: usize = 64 << 10;
/// Requests below this size get a buffer of their own size, not a pooled
/// one: a small allocation is cheap and reused by the allocator, while a
/// [`MIN_CLASS`] buffer per small read (the soft RoCE engine gathers every
/// READ response through [`take`]) kept 64 KiB alive per 100-byte value,
/// emptied the pool under many reads in flight, and faulted in fresh zeroed
/// pages for the rest (8% of a KV gateway's CPU at 800 GETs in flight).
const POOLED_MIN: usize = MIN_CLASS / 4;
/// Largest pooled size class; bigger buffers are allocated and freed normally.
const MAX_CLASS: usize = 32 << 20;
/// Bytes kept idle per size class.
const KEEP_PER_CLASS: usize = 64 << 20;

const CLASSES: usize = (MAX_CLASS / MIN_CLASS).trailing_zeros() as usize + 1;

fn classes() -> &'static [Mutex<Vec<Vec<u8>>>; CLASSES] {
    static POOL: OnceLock<[Mutex<Vec<Vec<u8>>>; CLASSES]> = OnceLock::new();
    POOL.get_or_init(|| std::array::from_fn(|_| Mutex::new(Vec::new())))
}

fn class_of(len: usize) -> Option<usize> {
    if len < POOLED_MIN {
        return None;
    }
    let size = len.max(MIN_CLASS).next_power_of_two();
    (size <= MAX_CLASS).then(|| (size / MIN_CLASS).trailing_zeros() as usize)
}

/// A buffer of at least `len` initialised bytes, from the pool when possible
/// (a small one, below 16 KiB, is allocated at its size and never pooled).
pub fn take(len: usize) -> Vec<u8> {
    if let Some(c) = class_of(len) {
        if let Some(v) = classes()[c].lock().pop() {
            return v;
        }
        return vec![0u8; MIN_CLASS << c];
    }
    vec![0u8; len]
}

fn give_back(v: Vec<u8>) {
    let Some(c) = class_of(v.len()) else { return };
    if v.len() != MIN_CLASS << c {
        return;
    }
    let mut slot = classes()[c].lock();
    if (slot.len() + 1) * v.len() <= KEEP_PER_CLASS.max(2 * v.len()) {
        slot.push(v);
    }
}

struct Pooled {
    buf: Vec<u8>,
    len: usize,
}

impl AsRef<[u8]> for Pooled {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        give_back(std::mem::take(&mut self.buf));
    }
}

/// The first `len` bytes of `buf` as [`Bytes`]; `buf` returns to the pool when
/// the last clone is dropped.
pub fn freeze(buf: Vec<u8>, len: usize) -> Bytes {
    Bytes::from_owner(Pooled { buf, len })
}

/// One pooled buffer that the reads of several parts fill in place, each at
/// its offset: the destination of a read split over pieces or lanes, joined
/// without a copy. Clones share the buffer.
///
/// A connection's reader takes the buffer out while it receives a part into
/// it straight from its socket ([`ReadSink::take`]); a part that arrived
/// elsewhere meanwhile waits for it to come back to be copied in
/// ([`ReadSink::fill`]).
#[derive(Clone, Debug)]
pub struct ReadSink {
    shared: Arc<SinkShared>,
    len: usize,
}

#[derive(Debug)]
struct SinkShared {
    buf: Mutex<SinkBuf>,
    back: tokio::sync::Notify,
}

#[derive(Debug)]
enum SinkBuf {
    In(Vec<u8>),
    Out,
    Finished,
}

impl ReadSink {
    /// A sink for a read of `len` bytes.
    pub fn new(len: usize) -> ReadSink {
        ReadSink {
            shared: Arc::new(SinkShared {
                buf: Mutex::new(SinkBuf::In(take(len))),
                back: tokio::sync::Notify::new(),
            }),
            len,
        }
    }

    /// The length of the read it assembles.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it assembles an empty read.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `len` bytes at `offset` lie within the read.
    pub fn fits(&self, offset: usize, len: usize) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }

    /// Copy a part that arrived elsewhere in at `offset`, once the buffer is
    /// in (a reader may be filling another part).
    pub async fn fill(&self, offset: usize, data: &[u8]) -> Result<()> {
        if !self.fits(offset, data.len()) {
            return Err(Error::Protocol(format!(
                "a read part of {} bytes at offset {offset} does not fit a {}-byte read",
                data.len(),
                self.len
            )));
        }
        loop {
            let back = self.shared.back.notified();
            tokio::pin!(back);
            back.as_mut().enable();
            match &mut *self.shared.buf.lock() {
                SinkBuf::In(b) => {
                    b[offset..offset + data.len()].copy_from_slice(data);
                    return Ok(());
                }
                SinkBuf::Finished => {
                    return Err(Error::Disconnected("the read was finished".into()))
                }
                SinkBuf::Out => {}
            }
            back.await;
        }
    }

    /// Take the buffer out, to receive a part into it straight from a socket
    /// without holding a lock; it comes back when the guard drops. `None`
    /// if it is out already (or finished).
    pub fn take(&self) -> Option<SinkGuard<'_>> {
        let mut g = self.shared.buf.lock();
        match std::mem::replace(&mut *g, SinkBuf::Out) {
            SinkBuf::In(buf) => Some(SinkGuard {
                sink: self,
                buf: Some(buf),
            }),
            other => {
                *g = other;
                None
            }
        }
    }

    /// The assembled read, once every part is in (`None` if the buffer is
    /// out or was finished already).
    pub fn finish(&self) -> Option<Bytes> {
        let mut g = self.shared.buf.lock();
        match std::mem::replace(&mut *g, SinkBuf::Finished) {
            SinkBuf::In(b) => Some(freeze(b, self.len)),
            other => {
                *g = other;
                None
            }
        }
    }
}

/// A [`ReadSink`]'s buffer, taken out; back in the sink when dropped.
#[derive(Debug)]
pub struct SinkGuard<'a> {
    sink: &'a ReadSink,
    buf: Option<Vec<u8>>,
}

impl std::ops::Deref for SinkGuard<'_> {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        let b = self.buf.as_ref().expect("held until dropped");
        &b[..self.sink.len]
    }
}

impl std::ops::DerefMut for SinkGuard<'_> {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.sink.len;
        let b = self.buf.as_mut().expect("held until dropped");
        &mut b[..len]
    }
}

impl Drop for SinkGuard<'_> {
    fn drop(&mut self) {
        if let Some(b) = self.buf.take() {
            *self.sink.shared.buf.lock() = SinkBuf::In(b);
            self.sink.shared.back.notify_waiters();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_recycled_and_sized() {
        let a = take(1 << 20);
        assert_eq!(a.len(), 1 << 20);
        let ptr = a.as_ptr();
        let b = freeze(a, 1000);
        assert_eq!(b.len(), 1000);
        let c = b.slice(10..20);
        drop(b);
        assert_eq!(c.len(), 10);
        drop(c);
        // The same allocation comes back for the same class.
        let again = take((1 << 20) - 5);
        assert_eq!(again.as_ptr(), ptr);
        // Small buffers are exact and never pooled.
        assert_eq!(take(100).len(), 100);
        assert_eq!(take(POOLED_MIN - 1).len(), POOLED_MIN - 1);
        assert_eq!(take(POOLED_MIN).len(), MIN_CLASS);
        let small = freeze(take(100), 100);
        drop(small);
        assert!(classes()[0].lock().iter().all(|v| v.len() == MIN_CLASS));
        assert_eq!(take(MAX_CLASS + 1).len(), MAX_CLASS + 1);
    }

    #[tokio::test]
    async fn a_read_sink_assembles_parts_in_place_and_refuses_misfits() {
        let s = ReadSink::new(10);
        s.fill(6, b"6789").await.unwrap();
        let mut g = s.take().unwrap();
        assert!(s.take().is_none(), "taken twice");
        assert!(s.finish().is_none(), "finished while out");
        // A part that arrives meanwhile waits for the buffer to come back.
        let s2 = s.clone();
        let waiting = tokio::spawn(async move { s2.fill(0, b"0").await });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        g[1..6].copy_from_slice(b"12345");
        drop(g);
        waiting.await.unwrap().unwrap();
        assert!(s.fill(8, b"789").await.is_err(), "a part past the end");
        assert!(
            s.fill(usize::MAX, b"9").await.is_err(),
            "an offset that overflows"
        );
        assert_eq!(&s.clone().finish().unwrap()[..], b"0123456789");
        assert!(s.finish().is_none(), "finished twice");
        assert!(s.fill(0, b"0").await.is_err(), "filled after finishing");
    }
}
