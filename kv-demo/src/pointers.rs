//! The client's pointer cache: where a key's item was last found on a node
//! (FaRM/Pilaf-style), so that a GET hit is one READ of the item instead of
//! two (bucket, then item).
//!
//! Set-associative, like a CPU cache: the key's hash picks one 64-byte line
//! of [`WAYS`] entries, and a lookup touches that line and nothing else
//! (a hash map's lookup, control bytes then bucket, missed the CPU cache
//! twice per GET: a tenth of the RESP gateway's CPU at 16 pipelined
//! commands). An entry is the node's own 16-byte index entry, whose 32-bit
//! tag comes from the hash's high half; the cache compares 31 of those bits
//! (the top one is the way's reference bit, below) and the line comes from
//! the low bits, so a hit matches 31 bits plus the line's of the hash (47
//! for 2^18 entries). A wrong hit costs one READ: the item holds its key,
//! and its verification fails.
//!
//! A newcomer takes the way of its own tag if there is one, else an empty
//! way, else one not read since the line last filled up (not-recently-used
//! replacement, a one-bit CLOCK per line): a hit sets its entry's reference
//! bit, a newcomer comes in without it. A key read once (a Zipf tail's)
//! thus displaces another such key, not a hot one; random replacement let
//! every newcomer evict a hot entry one time in four (`zipf_hit_ratio`
//! below: hits 0.686 of a Zipf(0.99) stream with random replacement, 0.755
//! with this). When every way of a full line has been read, all bits are
//! cleared and two more bits of the hash pick the victim. The memory is
//! fixed at creation and never grows.

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

/// The reference bit of a way, kept in the top bit of its tag (the tag is
/// compared on its other 31 bits; a wrong hit costs one READ, as above).
const REFERENCED: u64 = 1 << 63;

/// The tag bits a way is matched on.
const TAG_MASK: u32 = !(1 << 31);

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

    /// The entry remembered for the key hashing to `h` (marking it as
    /// referenced, to be kept over ways not read).
    pub fn get(&mut self, h: u64) -> Option<Entry> {
        let tag = crate::layout::tag_of(h);
        let i = self.line(h);
        let w = self.lines[i].0.iter_mut().find(|w| holds(**w, tag))?;
        w[1] |= REFERENCED;
        decode(*w).map(|e| Entry { tag, ..e })
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
        let (w0, w1) = e.words();
        if let Some(w) = line.iter_mut().find(|w| holds(**w, e.tag)) {
            // The same key moved: it keeps its reference bit.
            *w = [w0, (w1 & !REFERENCED) | (w[1] & REFERENCED)];
            return;
        }
        let start = (h >> VICTIM_SHIFT) as usize % WAYS;
        let way = line
            .iter()
            .position(|w| w[0] == 0)
            .or_else(|| {
                (0..WAYS)
                    .map(|k| (start + k) % WAYS)
                    .find(|&k| line[k][1] & REFERENCED == 0)
            })
            .unwrap_or_else(|| {
                // Every way was read since the line filled: a new period.
                for w in line.iter_mut() {
                    w[1] &= !REFERENCED;
                }
                start
            });
        line[way] = [w0, w1 & !REFERENCED];
    }

    /// Forget the entry for the key hashing to `h`, if there is one.
    pub fn remove(&mut self, h: u64) {
        let tag = crate::layout::tag_of(h);
        let i = self.line(h);
        for w in self.lines[i].0.iter_mut() {
            if holds(*w, tag) {
                *w = [0, 0];
            }
        }
    }
}

fn decode(w: [u64; 2]) -> Option<Entry> {
    Entry::from_words(w[0], w[1])
}

/// Whether way `w` holds an entry for `tag` (on the bits compared).
fn holds(w: [u64; 2], tag: u32) -> bool {
    w[0] != 0 && (w[1] >> 32) as u32 & TAG_MASK == tag & TAG_MASK
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

    /// Ways read since the line filled stay; a key seen once (inserted, never
    /// read) is what the next newcomer displaces.
    #[test]
    fn keys_read_once_do_not_displace_hot_ones() {
        let mut c = PointerCache::new(64);
        let base = 3u64 << LINE_SHIFT;
        let at = |t: u64, victim: u64| (t << 40) | (victim << VICTIM_SHIFT) | base;
        let hot: Vec<u64> = (1..=3u64).map(|t| at(t, t)).collect();
        for (n, &h) in hot.iter().enumerate() {
            c.insert(h, entry(h, n as u64));
            assert!(c.get(h).is_some());
        }
        // A stream of one-off keys, each aimed (by its victim bits) at every
        // way in turn: they take the fourth way, one after another.
        let mut last = 0;
        for n in 0..40u64 {
            last = at(100 + n, n % 4);
            c.insert(last, entry(last, n));
            for (k, &hh) in hot.iter().enumerate() {
                assert_eq!(c.get(hh), Some(entry(hh, k as u64)), "hot key {k} kept");
            }
        }
        assert_eq!(
            c.get(last),
            Some(entry(last, 39)),
            "the last newcomer is in"
        );
        // Every way has now been read: the line starts a new period and the
        // hash's victim bits choose again; exactly one way goes.
        let full = at(999, 0);
        c.insert(full, entry(full, 999));
        assert_eq!(c.get(full), Some(entry(full, 999)));
        let kept = hot.iter().filter(|&&h| c.get(h).is_some()).count();
        assert!(kept >= 2, "{kept} hot keys kept");
    }

    /// Under a Zipf(0.99) stream over many more keys than entries, a GET
    /// finds the pointer (one READ) far more often than with random
    /// replacement, which a hot key loses to any newcomer of its line.
    #[test]
    fn zipf_hit_ratio() {
        use rand::SeedableRng;
        use rand_distr::{Distribution, Zipf};
        let keys = 1u64 << 16;
        let mut c = PointerCache::new(1 << 13);
        let zipf = Zipf::new(keys as f64, 0.99).unwrap();
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (mut hits, mut gets) = (0u64, 0u64);
        for i in 0..400_000u64 {
            let h = mix(zipf.sample(&mut rng) as u64);
            let found = c.get(h).is_some();
            if !found {
                c.insert(h, entry(h, 1));
            }
            if i >= 100_000 {
                gets += 1;
                hits += u64::from(found);
            }
        }
        let ratio = hits as f64 / gets as f64;
        // With this seed: 0.755; random replacement 0.686. The top 8192 of
        // 65536 keys draw 0.81 of a Zipf(0.99) stream (a perfect cache of
        // the hottest keys).
        assert!(ratio > 0.72, "hit ratio {ratio:.3}");
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
