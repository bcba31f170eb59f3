//! Recycled receive buffers for large payloads (shared by the transports).
//!
//! A fresh multi-megabyte allocation per received message costs page faults and
//! page zeroing on every receive (they dominated profiles of 1 MiB transfers).
//! Large payloads are read into buffers from this pool instead, and handed to
//! the user as [`Bytes`] whose owner returns the buffer here when dropped.

use std::sync::OnceLock;

use bytes::Bytes;
use parking_lot::Mutex;

/// Smallest pooled size class.
const MIN_CLASS: usize = 64 << 10;
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
    let size = len.max(MIN_CLASS).next_power_of_two();
    (size <= MAX_CLASS).then(|| (size / MIN_CLASS).trailing_zeros() as usize)
}

/// A buffer of at least `len` initialised bytes, from the pool when possible.
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
        assert_eq!(take(100).len(), MIN_CLASS);
        assert_eq!(take(MAX_CLASS + 1).len(), MAX_CLASS + 1);
    }
}
