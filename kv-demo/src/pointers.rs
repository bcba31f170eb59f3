//! The client's pointer cache: where a key's item was last found on a node
//! (FaRM/Pilaf-style), so that a GET hit is one READ of the item instead of
//! two (bucket, then item).
//!
//! Set-associative, like a CPU cache: the key's hash picks one 64-byte line
//! of [`WAYS`] entries, and a lookup touches that line and nothing else
//! (a hash map's lookup, control bytes then bucket, missed the CPU cache
//! twice per GET: a tenth of the RESP gateway's CPU at 16 pipelined
//! commands). An entry is the node's own 16-byte index entry, whose 32-bit
//! tag comes from the hash's high half; the line comes from the low bits,
//! so a hit matches 32 bits plus the line's of the hash (48 for 2^18
//! entries). A wrong hit costs one READ:
//! the item holds its key, and its verification fails.
//!
//! A newcomer takes the way of its own tag if there is one, else an empty
//! way, else the way named by two more bits of its hash (random
//! replacement). The memory is fixed at creation and never grows.

use crate::layout::Entry;

/// Entries per line (four 16-byte entries fill a 64-byte cache line).
pub const WAYS: usize = 4;

/// One cache line of entries, each as the two words the node stores
/// (`0, _` is empty: a stored entry's first word holds a non-zero length).
#[derive(Clone, Copy, Default)]
#[repr(C, align(64))]
struct Line([[u64; 2]; WAYS]);

/// A fixed-size set-associative map from key hash to index entry.
pub struct PointerCache {
    lines: Box<[Line]>,
    /// `lines.len() - 1` (a power of two minus one).
    mask: usize,
}

impl std::fmt::Debug for PointerCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PointerCache")
            .field("capacity", &self.capacity())
            .finish()
    }
}

/// The hash bits that pick a line start here (the tag is bits 32..64).
const LINE_SHIFT: u32 = 0;

/// The two hash bits that pick the way a newcomer evicts (below the tag's,
/// above any line's: caches of up to 2^28 lines).
const VICTIM_SHIFT: u32 = 30;

impl PointerCache {
    /// A cache of at least `entries` entries (rounded up to whole lines, a
    /// power of two of them).
    pub fn new(entries: usize) -> PointerCache {
        let lines = entries.div_ceil(WAYS).max(1).next_power_of_two();
        assert!(
            lines <= 1 << (VICTIM_SHIFT - LINE_SHIFT),
            "{entries} entries"
        );
        PointerCache {
            lines: vec![Line::default(); lines].into_boxed_slice(),
            mask: lines - 1,
        }
    }

    /// How many entries it holds at most.
    pub fn capacity(&self) -> usize {
        self.lines.len() * WAYS
    }

    fn line(&self, h: u64) -> usize {
        (h >> LINE_SHIFT) as usize & self.mask
    }

    /// The entry remembered for the key hashing to `h`.
    pub fn get(&self, h: u64) -> Option<Entry> {
        let tag = crate::layout::tag_of(h);
        self.lines[self.line(h)]
            .0
            .iter()
            .filter_map(|w| decode(*w))
            .find(|e| e.tag == tag)
    }

    /// Load the line of the key hashing to `h` into the CPU cache ahead of
    /// [`get`](Self::get): loads of a batch's lines issued back to back
    /// wait for memory together, where lookups one after another (each
    /// between other work) wait once each.
    pub fn touch(&self, h: u64) {
        std::hint::black_box(self.lines[self.line(h)].0[0][0]);
    }

    /// Remember `e` (whose tag is `h`'s) for the key hashing to `h`.
    pub fn insert(&mut self, h: u64, e: Entry) {
        debug_assert_eq!(e.tag, crate::layout::tag_of(h));
        let i = self.line(h);
        let line = &mut self.lines[i].0;
        let way = line
            .iter()
            .position(|w| decode(*w).is_some_and(|x| x.tag == e.tag))
            .or_else(|| line.iter().position(|w| w[0] == 0))
            .unwrap_or((h >> VICTIM_SHIFT) as usize % WAYS);
        let (w0, w1) = e.words();
        line[way] = [w0, w1];
    }

    /// Forget the entry for the key hashing to `h`, if there is one.
    pub fn remove(&mut self, h: u64) {
        let tag = crate::layout::tag_of(h);
        let i = self.line(h);
        for w in self.lines[i].0.iter_mut() {
            if decode(*w).is_some_and(|x| x.tag == tag) {
                *w = [0, 0];
            }
        }
    }
}

fn decode(w: [u64; 2]) -> Option<Entry> {
    Entry::from_words(w[0], w[1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::tag_of;
    use std::collections::HashMap;

    fn entry(h: u64, n: u64) -> Entry {
        Entry {
            offset: n * 64,
            len: 100 + (n % 50) as u32,
            tag: tag_of(h),
            version: n as u32,
        }
    }

    fn mix(n: u64) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&n.to_le_bytes())
    }

    #[test]
    fn a_line_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Line>(), 64);
        assert_eq!(std::mem::align_of::<Line>(), 64);
    }

    /// Within capacity of one line, everything remembered is found as it
    /// was put, replaced when put again, and gone when removed.
    #[test]
    fn remembers_replaces_and_forgets() {
        let mut c = PointerCache::new(64);
        // Four keys that share a line, with different tags (and victim
        // bits: the fifth below evicts one way, whichever).
        let base = 5u64 << LINE_SHIFT;
        let hs: Vec<u64> = (1..=4u64)
            .map(|t| (t << 40) | (t << VICTIM_SHIFT) | base)
            .collect();
        for (n, &h) in hs.iter().enumerate() {
            c.insert(h, entry(h, n as u64));
        }
        for (n, &h) in hs.iter().enumerate() {
            assert_eq!(c.get(h), Some(entry(h, n as u64)));
        }
        c.insert(hs[2], entry(hs[2], 77));
        assert_eq!(c.get(hs[2]), Some(entry(hs[2], 77)));
        assert_eq!(
            c.get(hs[1]),
            Some(entry(hs[1], 1)),
            "a replacement keeps the others"
        );
        c.remove(hs[1]);
        assert_eq!(c.get(hs[1]), None);
        assert_eq!(c.get(hs[0]), Some(entry(hs[0], 0)));
        // A fifth tag in a full line evicts exactly one of the others.
        let h5 = (9u64 << 40) | base;
        c.insert(hs[1], entry(hs[1], 1));
        c.insert(h5, entry(h5, 5));
        assert_eq!(c.get(h5), Some(entry(h5, 5)));
        assert_eq!(hs.iter().filter(|&&h| c.get(h).is_some()).count(), 3);
        // Another line is untouched by all this.
        assert_eq!(c.get(hs[0] ^ (1 << LINE_SHIFT)), None);
    }

    /// Many more keys than entries: every hit is the entry last put for that
    /// key (never another key's), the cache keeps about its capacity, and
    /// its memory is what it was made with.
    #[test]
    fn overflow_evicts_and_never_confuses_keys() {
        let mut c = PointerCache::new(1 << 10);
        let cap = c.capacity();
        let mut last = HashMap::new();
        for round in 0..3u64 {
            for n in 0..(4 * cap as u64) {
                let h = mix(n);
                let e = entry(h, n * 3 + round);
                c.insert(h, e);
                last.insert(h, e);
            }
        }
        let mut hits = 0;
        for (&h, e) in &last {
            if let Some(got) = c.get(h) {
                assert_eq!(got, *e);
                hits += 1;
            }
        }
        assert!(hits <= cap, "{hits} hits from {cap} entries");
        assert!(hits >= cap * 3 / 4, "{hits} hits from {cap} entries");
        assert_eq!(c.capacity(), cap);
    }
}
