//! The memory layout one-sided readers rely on: the index (a set-associative
//! hash table of 8-way buckets) and the items (a self-verifying header, the
//! key, the value), both in regions the node registers for REMOTE_READ.
//!
//! ```text
//! index bucket (128 B) = 8 entries of 16 B, little-endian:
//!   w0 = item offset in the arena << 24 | item length (bytes, < 16 MiB)   (0: empty)
//!   w1 = key tag (hash >> 32, never 0) << 32 | item version (low 32 bits)
//!
//! item = header (40 B) | key | value
//!   0  magic "KVI1"   4  key_len u16   6  reserved u16   8  value_len u32
//!   12 flags u32      16 version u64   24 expiry_ms u64 (node clock, 0 = never)
//!   32 checksum u64 = xxh3(header[0..32] | key | value, seed)
//! ```
//!
//! A writer never changes an item a reader may be reading: it writes the new
//! item into a free slot, checksum included, and only then points the index
//! entry at it (write-new-then-swap-index, as Pilaf and FaRM do), then frees
//! the old slot. A reader that raced with a writer sees one of: the old entry
//! and the old item (still valid: it was current when the entry was read), an
//! entry whose two words disagree, or a slot already reused for another
//! item. The last two fail the check (version, key or checksum) and the read
//! is retried. The checksum is over the whole item, so a read torn by a
//! concurrent reuse of the slot is caught too.

use xxhash_rust::xxh3::{xxh3_64_with_seed, Xxh3};

/// Bytes of an index bucket.
pub const BUCKET_BYTES: u64 = 128;
/// Entries per bucket.
pub const WAYS: usize = 8;
/// Bytes of an item header.
pub const HEADER: usize = 40;
/// Item magic.
pub const MAGIC: &[u8; 4] = b"KVI1";
/// Largest item (header + key + value) the length field can describe.
pub const MAX_ITEM_LEN: u64 = (1 << 24) - 1;
/// Largest key: what the header's 16-bit length holds (an item must also
/// fit one arena page).
pub const MAX_KEY: usize = u16::MAX as usize;

/// The hash of a key under a node's seed: picks the bucket and the tag.
pub fn key_hash(key: &[u8], seed: u64) -> u64 {
    xxh3_64_with_seed(key, seed)
}

/// The tag stored in an entry (never 0, so 0 can mean "empty").
pub fn tag_of(hash: u64) -> u32 {
    ((hash >> 32) as u32).max(1)
}

/// One index entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Entry {
    /// Offset of the item in the arena.
    pub offset: u64,
    /// Item length in bytes (header, key and value).
    pub len: u32,
    /// Key tag.
    pub tag: u32,
    /// Low 32 bits of the item's version.
    pub version: u32,
}

impl Entry {
    /// Decode 16 bytes; `None` for an empty entry (or fewer bytes).
    pub fn decode(b: &[u8]) -> Option<Entry> {
        let w0 = u64::from_le_bytes(b.get(0..8)?.try_into().ok()?);
        let w1 = u64::from_le_bytes(b.get(8..16)?.try_into().ok()?);
        Entry::from_words(w0, w1)
    }

    /// The entry two stored words hold (the inverse of [`Entry::words`]);
    /// `None` for an empty entry.
    pub fn from_words(w0: u64, w1: u64) -> Option<Entry> {
        (w0 != 0).then_some(Entry {
            offset: w0 >> 24,
            len: (w0 & 0xFF_FFFF) as u32,
            tag: (w1 >> 32) as u32,
            version: w1 as u32,
        })
    }

    /// The two words, as stored.
    pub fn words(&self) -> (u64, u64) {
        (
            (self.offset << 24) | u64::from(self.len),
            (u64::from(self.tag) << 32) | u64::from(self.version),
        )
    }
}

/// An item's header fields.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Key length.
    pub key_len: u16,
    /// Value length.
    pub value_len: u32,
    /// Opaque flags the client stores with the value.
    pub flags: u32,
    /// Version (unique per node run, increasing).
    pub version: u64,
    /// Absolute expiry on the node's clock, Unix milliseconds; 0 = never.
    pub expiry_ms: u64,
}

impl Header {
    /// Total item length.
    pub fn item_len(&self) -> usize {
        HEADER + self.key_len as usize + self.value_len as usize
    }
}

fn checksum(head: &[u8], key: &[u8], value: &[u8], seed: u64) -> u64 {
    let mut h = Xxh3::with_seed(seed);
    h.update(&head[..32]);
    h.update(key);
    h.update(value);
    h.digest()
}

/// Write a complete item (checksum last in the computation, first in use).
pub fn encode_item(out: &mut [u8], h: &Header, key: &[u8], value: &[u8], seed: u64) {
    debug_assert_eq!(out.len(), h.item_len());
    out[0..4].copy_from_slice(MAGIC);
    out[4..6].copy_from_slice(&h.key_len.to_le_bytes());
    out[6..8].copy_from_slice(&[0, 0]);
    out[8..12].copy_from_slice(&h.value_len.to_le_bytes());
    out[12..16].copy_from_slice(&h.flags.to_le_bytes());
    out[16..24].copy_from_slice(&h.version.to_le_bytes());
    out[24..32].copy_from_slice(&h.expiry_ms.to_le_bytes());
    out[HEADER..HEADER + key.len()].copy_from_slice(key);
    out[HEADER + key.len()..].copy_from_slice(value);
    let sum = checksum(&out[..32], key, value, seed);
    out[32..40].copy_from_slice(&sum.to_le_bytes());
}

/// Decode just the header (no checksum check): what the node reads of its
/// own, consistent memory.
pub fn decode_header(b: &[u8]) -> Option<Header> {
    if b.len() < HEADER || &b[0..4] != MAGIC {
        return None;
    }
    Some(Header {
        key_len: u16::from_le_bytes([b[4], b[5]]),
        value_len: u32::from_le_bytes(b[8..12].try_into().ok()?),
        flags: u32::from_le_bytes(b[12..16].try_into().ok()?),
        version: u64::from_le_bytes(b[16..24].try_into().ok()?),
        expiry_ms: u64::from_le_bytes(b[24..32].try_into().ok()?),
    })
}

/// Why a one-sided read of an item is not usable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Torn {
    /// Not an item (magic), or lengths that do not fit what was read.
    Garbage,
    /// Another key's item (the slot was reused).
    OtherKey,
    /// Not the version the index entry named (overwritten meanwhile).
    Version,
    /// Checksum mismatch: read while being written.
    Checksum,
}

/// Verify an item read one-sidedly against the entry that led to it and the
/// key asked for. Returns the header and the value's range in `b`.
pub fn verify_item(
    b: &[u8],
    entry: &Entry,
    key: &[u8],
    seed: u64,
) -> Result<(Header, std::ops::Range<usize>), Torn> {
    let h = decode_header(b).ok_or(Torn::Garbage)?;
    if h.item_len() != b.len() {
        return Err(Torn::Garbage);
    }
    let k = &b[HEADER..HEADER + h.key_len as usize];
    if k != key {
        return Err(Torn::OtherKey);
    }
    if h.version as u32 != entry.version {
        return Err(Torn::Version);
    }
    let vr = HEADER + key.len()..b.len();
    let want = u64::from_le_bytes(b[32..40].try_into().expect("8"));
    if checksum(&b[..32], k, &b[vr.clone()], seed) != want {
        return Err(Torn::Checksum);
    }
    Ok((h, vr))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn entries_round_trip(offset in 0u64..(1 << 40), len in 1u32..(1 << 24), tag in 1u32.., version: u32) {
            let e = Entry { offset, len, tag, version };
            let (w0, w1) = e.words();
            let mut b = [0u8; 16];
            b[..8].copy_from_slice(&w0.to_le_bytes());
            b[8..].copy_from_slice(&w1.to_le_bytes());
            prop_assert_eq!(Entry::decode(&b), Some(e));
            prop_assert_eq!(Entry::from_words(w0, w1), Some(e));
        }

        /// An intact item verifies; any single flipped bit is caught.
        #[test]
        fn items_verify_and_catch_corruption(key in proptest::collection::vec(any::<u8>(), 1..64),
                                             value in proptest::collection::vec(any::<u8>(), 0..512),
                                             flip in any::<proptest::sample::Index>(), bit in 0u8..8) {
            let h = Header { key_len: key.len() as u16, value_len: value.len() as u32, flags: 7, version: 0x1_0000_0005, expiry_ms: 99 };
            let mut b = vec![0u8; h.item_len()];
            encode_item(&mut b, &h, &key, &value, 42);
            let e = Entry { offset: 0, len: b.len() as u32, tag: 1, version: 5 };
            let (got, vr) = verify_item(&b, &e, &key, 42).unwrap();
            prop_assert_eq!(got, h);
            prop_assert_eq!(&b[vr], &value[..]);
            let i = flip.index(b.len());
            b[i] ^= 1 << bit;
            prop_assert!(verify_item(&b, &e, &key, 42).is_err());
        }
    }

    proptest! {
        /// Whatever a node's memory holds (a bad or restarting node), the
        /// check answers without panicking, and an item it accepts is
        /// exactly what encoding its header, key and value gives.
        #[test]
        fn any_bytes_verify_or_fail_cleanly(b in proptest::collection::vec(any::<u8>(), 0..200),
                                            key in proptest::collection::vec(any::<u8>(), 0..8),
                                            version: u32, seed in 0u64..4) {
            let e = Entry { offset: 0, len: b.len() as u32, tag: 1, version };
            if let Ok((h, vr)) = verify_item(&b, &e, &key, seed) {
                let mut again = vec![0u8; h.item_len()];
                encode_item(&mut again, &h, &key, &b[vr], seed);
                prop_assert_eq!(&again, &b);
            }
            let _ = Entry::decode(&b);
        }
    }

    #[test]
    fn empty_entries_decode_as_none() {
        assert_eq!(Entry::decode(&[0u8; 16]), None);
        assert_eq!(Entry::decode(&[1u8; 15]), None, "too short");
        assert_eq!(tag_of(0), 1);
    }
}
