//! The node's memory: a fixed arena of slab classes and a fixed index, both
//! registered with the node's domain for REMOTE_READ, so clients GET with
//! one-sided reads while every write goes through this module (by RPC).
//!
//! Nothing grows past `memory`: the index takes about 1/16 of it, the arena
//! the rest, cut into pages (memory / 64, from 64 KiB to 1 MiB) that slab
//! classes (sizes 64 B × 1.25^k up to a page) take as they need them. When a class has no free slot and no free
//! page is left, it evicts by CLOCK over its own slots (an item set or read by
//! RPC since the hand last passed keeps its place once); a class with no page
//! at all takes one from the class with the most pages, evicting that page's
//! items. The index is 8-way set-associative: a new key whose bucket is full
//! evicts that bucket's oldest item. Expired items are misses everywhere and
//! their memory is reclaimed lazily: when touched, and first in CLOCK.
//!
//! One-sided GETs do not run node code, so they do not set CLOCK's reference
//! bit: recency here is what writes and RPC reads show (documented trade-off).
//!
//! A superseded or deleted item's magic is cleared just before the index
//! stops pointing at it, so a client reading through a cached pointer sees
//! a superseded item only while the write that superseded it is in progress,
//! and never after any reader has seen the write.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rdmx_core::{Access, Domain, MemoryRegion, RemoteRegion};

use crate::layout::{
    decode_header, encode_item, key_hash, tag_of, Entry, Header, BUCKET_BYTES, HEADER, MAX_KEY,
    WAYS,
};

/// Largest arena page: the unit slab classes take (memory / 64, a power of
/// two from 64 KiB to 1 MiB, so every class can have pages even when
/// `memory` is small). The largest item is one page.
pub const MAX_PAGE: u64 = 1 << 20;
/// Smallest arena page.
pub const MIN_PAGE: u64 = 64 << 10;
/// Smallest `memory` a node accepts.
pub const MIN_MEMORY: u64 = 4 << 20;

const LIVE: u8 = 1;
const REFERENCED: u8 = 2;

/// Counters a node exports.
#[derive(Debug, Default)]
pub struct KvCounters {
    /// Items evicted to make room (CLOCK, page moves, full buckets).
    pub evictions: AtomicU64,
    /// Expired items reclaimed.
    pub expirations: AtomicU64,
    /// RPC GETs that found a live item.
    pub rpc_hits: AtomicU64,
    /// RPC GETs that found nothing (or an expired item).
    pub rpc_misses: AtomicU64,
    /// Items stored (SET and its variants, INCR).
    pub sets: AtomicU64,
    /// Pages moved from one slab class to another.
    pub page_moves: AtomicU64,
}

/// Why a write was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The item does not fit the largest slab class.
    #[error(
        "value is too large for this cache (an item holds at most {max} bytes of key and value)"
    )]
    TooLarge {
        /// Bytes of key and value an item can hold.
        max: usize,
    },
    /// The key is too long.
    #[error("key is too long for this cache ({0} bytes; at most {MAX_KEY})")]
    BadKey(usize),
    /// The stored value is not a 64-bit integer.
    #[error("value is not an integer or out of range")]
    NotAnInteger,
    /// The increment overflows 64 bits.
    #[error("increment or decrement would overflow")]
    Overflow,
}

/// When an item expires.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Expiry {
    /// Never.
    Never,
    /// At this node-clock time (Unix milliseconds).
    At(u64),
    /// Keep the current item's expiry (SET KEEPTTL, INCR).
    Keep,
}

/// SET's condition.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Cond {
    /// Store unconditionally.
    Always,
    /// Only if the key has no live item (NX).
    IfAbsent,
    /// Only if the key has a live item (XX).
    IfPresent,
}

/// What a node tells clients so they can read it one-sidedly.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Geometry {
    /// The index region.
    pub index: RemoteRegion,
    /// The arena region.
    pub arena: RemoteRegion,
    /// Buckets in the index (a power of two).
    pub buckets: u64,
    /// Seed of the key hash and the item checksum.
    pub seed: u64,
}

struct Class {
    size: u64,
    pages: Vec<u32>,
    free: Vec<u64>,
    /// CLOCK hand: index into `pages`, slot within that page.
    hand: (usize, u64),
}

/// The live item of a key.
#[derive(Clone, Copy, Debug)]
struct Found {
    bucket: u64,
    way: usize,
    entry: Entry,
    header: Header,
}

/// What [`Store::set`] did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetOutcome {
    /// Whether the value was stored (NX / XX may refuse).
    pub stored: bool,
    /// The previous value, if the key had one.
    pub old: Option<Vec<u8>>,
    /// The index entry of the new item (`None` when not stored).
    pub entry: Option<Entry>,
}

/// A node's items.
pub struct Store {
    seed: u64,
    page: u64,
    arena: MemoryRegion,
    index: MemoryRegion,
    buckets: u64,
    page_class: Vec<Option<u8>>,
    free_pages: Vec<u32>,
    classes: Vec<Class>,
    /// Slot flags per page (LIVE, REFERENCED), one byte per slot.
    flags: Vec<Vec<u8>>,
    next_version: u64,
    items: u64,
    item_bytes: u64,
    counters: Arc<KvCounters>,
    /// Tests: copy both regions after every index write.
    #[cfg(test)]
    record_index_writes: bool,
    /// Tests: (index, arena) as a remote reader could see them right after
    /// each index write.
    #[cfg(test)]
    index_writes: Vec<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("items", &self.items)
            .field("buckets", &self.buckets)
            .field("pages", &self.page_class.len())
            .finish()
    }
}

/// Slab class sizes: 64 B growing by 1.25 (8-byte aligned) up to a page.
fn class_sizes(page: u64) -> Vec<u64> {
    let mut v = vec![64u64];
    while *v.last().expect("one") < page {
        let next = (v.last().expect("one") * 5 / 4).div_ceil(8) * 8;
        v.push(next.min(page));
    }
    v
}

/// The page size for `memory`: memory / 64 as a power of two, 64 KiB to 1 MiB.
pub fn page_for(memory: u64) -> u64 {
    let p = (memory / 64).clamp(MIN_PAGE, MAX_PAGE);
    1 << (63 - p.leading_zeros())
}

impl Store {
    /// A store of `memory` bytes in all (index and arena), registered in `domain`.
    pub fn new(domain: &Domain, memory: u64) -> Result<Store, String> {
        if memory < MIN_MEMORY {
            return Err(format!(
                "--memory must be at least {MIN_MEMORY} bytes (4 MiB)"
            ));
        }
        // About 1/16 for the index, as a power of two of buckets.
        let want = (memory / 16 / BUCKET_BYTES).max(64);
        let buckets = if want.is_power_of_two() {
            want
        } else {
            want.next_power_of_two() / 2
        };
        let index_len = buckets * BUCKET_BYTES;
        let page = page_for(memory);
        let pages = (memory - index_len) / page;
        let arena_len = pages * page;
        let index = domain.register(index_len as usize, Access::REMOTE_READ);
        let arena = domain.register(arena_len as usize, Access::REMOTE_READ);
        let classes = class_sizes(page)
            .into_iter()
            .map(|size| Class {
                size,
                pages: Vec::new(),
                free: Vec::new(),
                hand: (0, 0),
            })
            .collect();
        Ok(Store {
            seed: rand::random(),
            page,
            arena,
            index,
            buckets,
            page_class: vec![None; pages as usize],
            free_pages: (0..pages as u32).rev().collect(),
            classes,
            flags: vec![Vec::new(); pages as usize],
            next_version: 1,
            items: 0,
            item_bytes: 0,
            counters: Arc::default(),
            #[cfg(test)]
            record_index_writes: false,
            #[cfg(test)]
            index_writes: Vec::new(),
        })
    }

    /// Where clients read.
    pub fn geometry(&self) -> Geometry {
        Geometry {
            index: self.index.remote(),
            arena: self.arena.remote(),
            buckets: self.buckets,
            seed: self.seed,
        }
    }

    /// The counters (shared with the metrics exporter).
    pub fn counters(&self) -> Arc<KvCounters> {
        self.counters.clone()
    }

    /// Live items (expired ones not yet reclaimed included).
    pub fn items(&self) -> u64 {
        self.items
    }

    /// Bytes of live items (headers, keys and values).
    pub fn item_bytes(&self) -> u64 {
        self.item_bytes
    }

    /// Registered bytes: index and arena, the whole memory footprint of items.
    pub fn registered_bytes(&self) -> u64 {
        (self.index.len() + self.arena.len()) as u64
    }

    /// Bytes of key and value one item can hold.
    pub fn max_payload(&self) -> usize {
        self.page as usize - HEADER
    }

    fn entry_at(&self, bucket: u64, way: usize) -> Option<Entry> {
        let at = (bucket * BUCKET_BYTES) as usize + way * 16;
        Entry::decode(&self.index.read()[at..at + 16])
    }

    fn set_entry(&mut self, bucket: u64, way: usize, e: Option<Entry>) {
        let at = (bucket * BUCKET_BYTES) as usize + way * 16;
        let (w0, w1) = e.map_or((0, 0), |e| e.words());
        {
            let mut idx = self.index.write();
            idx[at..at + 8].copy_from_slice(&w0.to_le_bytes());
            idx[at + 8..at + 16].copy_from_slice(&w1.to_le_bytes());
        }
        #[cfg(test)]
        if self.record_index_writes {
            let seen = (self.index.read().to_vec(), self.arena.read().to_vec());
            self.index_writes.push(seen);
        }
    }

    fn header_at(&self, offset: u64) -> Option<Header> {
        let a = self.arena.read();
        decode_header(&a[offset as usize..offset as usize + HEADER])
    }

    fn key_at(&self, offset: u64, h: &Header) -> Vec<u8> {
        let a = self.arena.read();
        let s = offset as usize + HEADER;
        a[s..s + h.key_len as usize].to_vec()
    }

    fn find(&self, key: &[u8]) -> Option<Found> {
        let h = key_hash(key, self.seed);
        let bucket = h & (self.buckets - 1);
        let tag = tag_of(h);
        let a = self.arena.read();
        (0..WAYS).find_map(|way| {
            let entry = self.entry_at(bucket, way)?;
            if entry.tag != tag {
                return None;
            }
            let o = entry.offset as usize;
            let header = decode_header(&a[o..o + HEADER])?;
            let k = &a[o + HEADER..o + HEADER + header.key_len as usize];
            (k == key).then_some(Found {
                bucket,
                way,
                entry,
                header,
            })
        })
    }

    fn slot_flags(&mut self, offset: u64) -> &mut u8 {
        let page = (offset / self.page) as usize;
        let class = self.page_class[page].expect("slot in a class page") as usize;
        let slot = ((offset % self.page) / self.classes[class].size) as usize;
        &mut self.flags[page][slot]
    }

    /// Remove a found item: the slot is freed (its magic cleared) before
    /// the index entry goes, so once a reader sees the entry gone no cached
    /// pointer can still read the item.
    fn unlink(&mut self, f: &Found) {
        self.release(f.entry.offset, f.header.item_len() as u64);
        self.set_entry(f.bucket, f.way, None);
    }

    /// Free a slot. Its magic is cleared at once, so a reader holding a
    /// cached pointer to it (see the client's pointer cache) fails
    /// verification instead of reading a superseded value. Callers release
    /// a superseded item *before* the index stops naming it: a reader that
    /// has seen the new entry (or none) must never read the old item
    /// through a pointer remembered earlier, or by another reader.
    fn release(&mut self, offset: u64, len: u64) {
        self.arena.write()[offset as usize..offset as usize + 4].fill(0);
        *self.slot_flags(offset) = 0;
        let page = (offset / self.page) as usize;
        let class = self.page_class[page].expect("class page") as usize;
        self.classes[class].free.push(offset);
        self.items -= 1;
        self.item_bytes -= len;
    }

    /// The live item of `key` at `now`, reclaiming it if it expired.
    fn live(&mut self, key: &[u8], now: u64) -> Option<Found> {
        let f = self.find(key)?;
        if f.header.expiry_ms != 0 && f.header.expiry_ms <= now {
            self.unlink(&f);
            self.counters.expirations.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        Some(f)
    }

    fn class_for(&self, len: usize) -> usize {
        self.classes
            .iter()
            .position(|c| c.size >= len as u64)
            .expect("len <= page")
    }

    /// A free slot of class `c`: from its free list, a free page, CLOCK, or a
    /// page taken from another class, in that order.
    fn alloc(&mut self, c: usize, now: u64) -> u64 {
        loop {
            if let Some(o) = self.classes[c].free.pop() {
                return o;
            }
            if let Some(p) = self.free_pages.pop() {
                self.give_page(p, c);
                continue;
            }
            if !self.classes[c].pages.is_empty() {
                if let Some(o) = self.clock(c, now) {
                    return o;
                }
                continue;
            }
            self.move_page_to(c, now);
        }
    }

    fn give_page(&mut self, p: u32, c: usize) {
        let size = self.classes[c].size;
        let n = self.page / size;
        self.page_class[p as usize] = Some(c as u8);
        self.flags[p as usize] = vec![0; n as usize];
        let base = u64::from(p) * self.page;
        let class = &mut self.classes[c];
        class.pages.push(p);
        class.free.extend((0..n).rev().map(|i| base + i * size));
    }

    /// Advance class `c`'s CLOCK hand to an evictable slot and evict it.
    fn clock(&mut self, c: usize, now: u64) -> Option<u64> {
        let size = self.classes[c].size;
        let per_page = self.page / size;
        // Two full turns clear every reference bit.
        let turns = 2 * self.classes[c].pages.len() as u64 * per_page + 1;
        for _ in 0..turns {
            let (pi, slot) = self.classes[c].hand;
            let page = self.classes[c].pages[pi % self.classes[c].pages.len()];
            let offset = u64::from(page) * self.page + slot * size;
            self.classes[c].hand = if slot + 1 >= per_page {
                ((pi + 1) % self.classes[c].pages.len(), 0)
            } else {
                (pi, slot + 1)
            };
            let fl = self.flags[page as usize][slot as usize];
            if fl & LIVE == 0 {
                continue;
            }
            let header = self.header_at(offset).expect("a live slot holds an item");
            let expired = header.expiry_ms != 0 && header.expiry_ms <= now;
            if fl & REFERENCED != 0 && !expired {
                self.flags[page as usize][slot as usize] = LIVE;
                continue;
            }
            self.evict_at(offset, &header, expired);
            // `release` pushed it on the free list; take it back.
            let taken = self.classes[c].free.pop();
            debug_assert_eq!(taken, Some(offset));
            return taken;
        }
        None
    }

    fn evict_at(&mut self, offset: u64, header: &Header, expired: bool) {
        let key = self.key_at(offset, header);
        let f = self
            .find(&key)
            .filter(|f| f.entry.offset == offset)
            .expect("a live slot is indexed");
        self.unlink(&f);
        let counter = if expired {
            &self.counters.expirations
        } else {
            &self.counters.evictions
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Give class `c` a page taken from the class holding the most pages,
    /// evicting that page's items.
    fn move_page_to(&mut self, c: usize, now: u64) {
        let donor = (0..self.classes.len())
            .filter(|&d| d != c)
            .max_by_key(|&d| self.classes[d].pages.len())
            .expect("more than one class");
        let pi = self.classes[donor].hand.0 % self.classes[donor].pages.len();
        let page = self.classes[donor].pages[pi];
        let size = self.classes[donor].size;
        for slot in 0..self.flags[page as usize].len() {
            if self.flags[page as usize][slot] & LIVE != 0 {
                let offset = u64::from(page) * self.page + slot as u64 * size;
                let h = self.header_at(offset).expect("live");
                let expired = h.expiry_ms != 0 && h.expiry_ms <= now;
                self.evict_at(offset, &h, expired);
            }
        }
        let lo = u64::from(page) * self.page;
        let hi = lo + self.page;
        let d = &mut self.classes[donor];
        d.free.retain(|&o| o < lo || o >= hi);
        d.pages.remove(pi);
        d.hand = (0, 0);
        self.counters.page_moves.fetch_add(1, Ordering::Relaxed);
        self.give_page(page, c);
    }

    /// The value and flags of `key` (an RPC GET: sets the reference bit).
    pub fn get(&mut self, key: &[u8], now: u64) -> Option<(Vec<u8>, u32)> {
        let Some(f) = self.live(key, now) else {
            self.counters.rpc_misses.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        *self.slot_flags(f.entry.offset) |= REFERENCED;
        self.counters.rpc_hits.fetch_add(1, Ordering::Relaxed);
        let a = self.arena.read();
        let s = f.entry.offset as usize + HEADER + f.header.key_len as usize;
        Some((
            a[s..s + f.header.value_len as usize].to_vec(),
            f.header.flags,
        ))
    }

    /// Store `value` under `key` if `cond` holds; returns whether it was
    /// stored, the previous value (SET … GET) and the index entry of the
    /// item it wrote (a client remembers it, so that its next GET of the key
    /// is one read).
    pub fn set(
        &mut self,
        key: &[u8],
        value: &[u8],
        flags: u32,
        expiry: Expiry,
        cond: Cond,
        now: u64,
    ) -> Result<SetOutcome, StoreError> {
        self.fits(key, value.len())?;
        let current = self.live(key, now);
        let old = current.map(|f| {
            let a = self.arena.read();
            let s = f.entry.offset as usize + HEADER + f.header.key_len as usize;
            a[s..s + f.header.value_len as usize].to_vec()
        });
        let go = match cond {
            Cond::Always => true,
            Cond::IfAbsent => current.is_none(),
            Cond::IfPresent => current.is_some(),
        };
        if !go {
            return Ok(SetOutcome {
                stored: false,
                old,
                entry: None,
            });
        }
        let expiry_ms = match expiry {
            Expiry::Never => 0,
            Expiry::At(t) => t.max(1),
            Expiry::Keep => current.map_or(0, |f| f.header.expiry_ms),
        };
        let entry = self.write_item(key, value, flags, expiry_ms, now);
        Ok(SetOutcome {
            stored: true,
            old,
            entry: Some(entry),
        })
    }

    /// Whether an item of `key` and `value_len` bytes fits a page.
    fn fits(&self, key: &[u8], value_len: usize) -> Result<(), StoreError> {
        if key.len() > MAX_KEY {
            return Err(StoreError::BadKey(key.len()));
        }
        if HEADER + key.len() + value_len > self.page as usize {
            return Err(StoreError::TooLarge {
                max: self.max_payload(),
            });
        }
        Ok(())
    }

    /// Write a new item for `key` and point the index at it; the previous
    /// item (if any) is freed just before the swap.
    /// Write a new item for `key` and point the index at it; returns the
    /// index entry.
    fn write_item(
        &mut self,
        key: &[u8],
        value: &[u8],
        flags: u32,
        expiry_ms: u64,
        now: u64,
    ) -> Entry {
        let len = HEADER + key.len() + value.len();
        let c = self.class_for(len);
        let offset = self.alloc(c, now);
        let version = self.next_version;
        self.next_version += 1;
        let header = Header {
            key_len: key.len() as u16,
            value_len: value.len() as u32,
            flags,
            version,
            expiry_ms,
        };
        {
            let mut a = self.arena.write();
            encode_item(
                &mut a[offset as usize..offset as usize + len],
                &header,
                key,
                value,
                self.seed,
            );
        }
        *self.slot_flags(offset) = LIVE | REFERENCED;
        self.items += 1;
        self.item_bytes += len as u64;
        let h = key_hash(key, self.seed);
        let bucket = h & (self.buckets - 1);
        let entry = Entry {
            offset,
            len: len as u32,
            tag: tag_of(h),
            version: version as u32,
        };
        // Allocation may have evicted anything, this key's item included:
        // look again now.
        let way = match self.find(key) {
            Some(f) => {
                // Old item dead first, then the swap (see `release`).
                self.release(f.entry.offset, f.header.item_len() as u64);
                self.set_entry(bucket, f.way, Some(entry));
                f.way
            }
            None => {
                let free = (0..WAYS).find(|&w| self.entry_at(bucket, w).is_none());
                match free {
                    Some(w) => w,
                    None => {
                        // A full set: the oldest item in it goes.
                        let w = (0..WAYS)
                            .min_by_key(|&w| {
                                let e = self.entry_at(bucket, w).expect("full");
                                self.header_at(e.offset).map_or(0, |h| h.version)
                            })
                            .expect("8 ways");
                        let e = self.entry_at(bucket, w).expect("full");
                        let h = self.header_at(e.offset).expect("indexed item");
                        self.release(e.offset, h.item_len() as u64);
                        self.counters.evictions.fetch_add(1, Ordering::Relaxed);
                        w
                    }
                }
            }
        };
        if self.entry_at(bucket, way).map(|e| e.offset) != Some(offset) {
            self.set_entry(bucket, way, Some(entry));
        }
        self.counters.sets.fetch_add(1, Ordering::Relaxed);
        entry
    }

    /// Delete keys; returns how many had a live item.
    pub fn del(&mut self, keys: &[impl AsRef<[u8]>], now: u64) -> u64 {
        let mut n = 0;
        for k in keys {
            if let Some(f) = self.live(k.as_ref(), now) {
                self.unlink(&f);
                n += 1;
            }
        }
        n
    }

    /// How many of `keys` have a live item (a key named twice counts twice).
    pub fn exists(&mut self, keys: &[impl AsRef<[u8]>], now: u64) -> u64 {
        keys.iter()
            .filter(|k| self.live(k.as_ref(), now).is_some())
            .count() as u64
    }

    /// Add `delta` to the integer stored at `key` (absent: 0); keeps the
    /// expiry. Returns the new value.
    pub fn incr(&mut self, key: &[u8], delta: i64, now: u64) -> Result<i64, StoreError> {
        // The longest result, "-9223372036854775808", is 20 bytes.
        self.fits(key, 20)?;
        let cur = self.live(key, now);
        let (n, expiry) = match cur {
            None => (0, 0),
            Some(f) => {
                let a = self.arena.read();
                let s = f.entry.offset as usize + HEADER + f.header.key_len as usize;
                let v = &a[s..s + f.header.value_len as usize];
                (
                    parse_i64(v).ok_or(StoreError::NotAnInteger)?,
                    f.header.expiry_ms,
                )
            }
        };
        let new = n.checked_add(delta).ok_or(StoreError::Overflow)?;
        let flags = cur.map_or(0, |f| f.header.flags);
        self.write_item(key, new.to_string().as_bytes(), flags, expiry, now);
        Ok(new)
    }

    /// Set (or with `None`, remove) the expiry of `key`; an expiry at or
    /// before `now` deletes it. Returns whether the key had a live item.
    pub fn expire(&mut self, key: &[u8], at: Option<u64>, now: u64) -> bool {
        let Some(f) = self.live(key, now) else {
            return false;
        };
        match at {
            Some(t) if t <= now => {
                self.unlink(&f);
                return true;
            }
            _ => {}
        }
        let (value, flags) = {
            let a = self.arena.read();
            let s = f.entry.offset as usize + HEADER + f.header.key_len as usize;
            (
                a[s..s + f.header.value_len as usize].to_vec(),
                f.header.flags,
            )
        };
        self.write_item(key, &value, flags, at.unwrap_or(0), now);
        true
    }

    /// Milliseconds `key` has left: `-2` without a live item, `-1` without expiry.
    pub fn pttl(&mut self, key: &[u8], now: u64) -> i64 {
        match self.live(key, now) {
            None => -2,
            Some(f) if f.header.expiry_ms == 0 => -1,
            Some(f) => (f.header.expiry_ms - now) as i64,
        }
    }

    /// Mark keys recently used (TOUCH); returns how many exist.
    pub fn touch(&mut self, keys: &[impl AsRef<[u8]>], now: u64) -> u64 {
        let mut n = 0;
        for k in keys {
            if let Some(f) = self.live(k.as_ref(), now) {
                *self.slot_flags(f.entry.offset) |= REFERENCED;
                n += 1;
            }
        }
        n
    }

    /// Remove every item.
    pub fn flush(&mut self) {
        self.index.write().fill(0);
        // Dead items everywhere: cached pointers must not find them.
        self.arena.write().fill(0);
        for c in &mut self.classes {
            c.pages.clear();
            c.free.clear();
            c.hand = (0, 0);
        }
        let pages = self.page_class.len();
        self.page_class = vec![None; pages];
        self.flags = vec![Vec::new(); pages];
        self.free_pages = (0..pages as u32).rev().collect();
        self.items = 0;
        self.item_bytes = 0;
    }
}

/// Redis's integer rule (`string2ll`): optional `-`, no `+`, no leading
/// zeros, no spaces, at most 20 characters, within i64.
pub fn parse_i64(v: &[u8]) -> Option<i64> {
    if v.is_empty() || v.len() > 20 {
        return None;
    }
    if v == b"0" {
        return Some(0);
    }
    let (neg, digits) = match v[0] {
        b'-' => (true, &v[1..]),
        _ => (false, v),
    };
    if digits.is_empty() || !(b'1'..=b'9').contains(&digits[0]) {
        return None;
    }
    // The magnitude in u64 (i64::MIN's fits); 20 digits can overflow it,
    // and such a number is beyond i64 anyway.
    let mut n: u64 = 0;
    for &d in digits {
        if !d.is_ascii_digit() {
            return None;
        }
        n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
    }
    if neg {
        0i64.checked_sub_unsigned(n)
    } else {
        i64::try_from(n).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::verify_item;

    fn store(mb: u64) -> Store {
        Store::new(&Domain::new(), mb << 20).unwrap()
    }

    /// Read `key` the way a remote client does: bucket, entry, item, verify.
    fn one_sided(s: &Store, key: &[u8]) -> Option<Vec<u8>> {
        let g = s.geometry();
        let h = key_hash(key, g.seed);
        let b = h & (g.buckets - 1);
        let idx = s.index.read();
        let bucket = &idx[(b * BUCKET_BYTES) as usize..((b + 1) * BUCKET_BYTES) as usize];
        let a = s.arena.read();
        for w in 0..WAYS {
            let Some(e) = Entry::decode(&bucket[w * 16..w * 16 + 16]) else {
                continue;
            };
            if e.tag != tag_of(h) {
                continue;
            }
            let item = &a[e.offset as usize..e.offset as usize + e.len as usize];
            if let Ok((_, vr)) = verify_item(item, &e, key, g.seed) {
                return Some(item[vr].to_vec());
            }
        }
        None
    }

    #[test]
    fn set_get_overwrite_delete() {
        let mut s = store(8);
        assert_eq!(
            s.set(b"k", b"v1", 3, Expiry::Never, Cond::Always, 1)
                .map(|o| (o.stored, o.old))
                .unwrap(),
            (true, None)
        );
        assert_eq!(s.get(b"k", 1), Some((b"v1".to_vec(), 3)));
        assert_eq!(one_sided(&s, b"k"), Some(b"v1".to_vec()));
        let SetOutcome {
            stored: ok, old, ..
        } = s
            .set(b"k", b"second", 0, Expiry::Never, Cond::IfPresent, 2)
            .unwrap();
        assert!(ok);
        assert_eq!(old, Some(b"v1".to_vec()));
        assert_eq!(one_sided(&s, b"k"), Some(b"second".to_vec()));
        assert!(
            !s.set(b"k", b"x", 0, Expiry::Never, Cond::IfAbsent, 3)
                .unwrap()
                .stored
        );
        assert_eq!(s.items(), 1);
        assert_eq!(s.del(&[&b"k"[..], b"k", b"nope"], 4), 1);
        assert_eq!(one_sided(&s, b"k"), None);
        assert_eq!(s.items(), 0);
        assert_eq!(s.item_bytes(), 0);
    }

    /// The entry `key` has in an index image, if any.
    fn entry_in(index: &[u8], s: &Store, key: &[u8]) -> Option<Entry> {
        let h = key_hash(key, s.seed);
        let b = ((h & (s.buckets - 1)) * BUCKET_BYTES) as usize;
        (0..WAYS)
            .filter_map(|w| Entry::decode(&index[b + w * 16..b + w * 16 + 16]))
            .find(|e| e.tag == tag_of(h))
    }

    /// Whether a client holding pointer `e` would accept what `arena` holds.
    fn pointer_reads(arena: &[u8], e: &Entry, key: &[u8], seed: u64) -> bool {
        let item = &arena[e.offset as usize..(e.offset + u64::from(e.len)) as usize];
        verify_item(item, e, key, seed).is_ok()
    }

    /// At every index write a remote reader could observe, once the index
    /// no longer names the old item (overwritten or deleted), a pointer to
    /// the old item cached earlier fails verification: a reader that has
    /// seen the write can never read the older value again (the kv cluster
    /// test `torn_read_hammer` saw 1228 and then 1224 when the old item
    /// was killed only after the swap).
    #[test]
    fn a_cached_pointer_dies_before_the_index_moves_on() {
        let mut s = store(8);
        s.set(b"k", b"old", 0, Expiry::Never, Cond::Always, 1)
            .unwrap();
        let old = entry_in(&s.index.read(), &s, b"k").expect("indexed");
        s.record_index_writes = true;
        s.set(b"k", b"new", 0, Expiry::Never, Cond::Always, 2)
            .unwrap();
        let new = entry_in(&s.index.read(), &s, b"k").expect("indexed");
        assert_ne!(new, old);
        assert_eq!(one_sided(&s, b"k"), Some(b"new".to_vec()));
        assert_eq!(s.del(&[&b"k"[..]], 3), 1);
        let writes = std::mem::take(&mut s.index_writes);
        assert!(writes.len() >= 2, "{} index writes", writes.len());
        for (i, (index, arena)) in writes.iter().enumerate() {
            let now = entry_in(index, &s, b"k");
            if now != Some(old) {
                assert!(
                    !pointer_reads(arena, &old, b"k", s.seed),
                    "index write {i}: the index names {now:?}, the old item still verifies"
                );
            }
            if now.is_none() {
                assert!(
                    !pointer_reads(arena, &new, b"k", s.seed),
                    "index write {i}: deleted, the last item still verifies"
                );
            }
        }
    }

    #[test]
    fn expiry_is_a_miss_and_reclaimed() {
        let mut s = store(8);
        s.set(b"t", b"v", 0, Expiry::At(100), Cond::Always, 50)
            .unwrap();
        assert_eq!(s.pttl(b"t", 60), 40);
        assert_eq!(s.get(b"t", 99).map(|v| v.0), Some(b"v".to_vec()));
        assert_eq!(s.get(b"t", 100), None);
        assert_eq!(s.items(), 0);
        assert_eq!(s.counters.expirations.load(Ordering::Relaxed), 1);
        assert_eq!(s.pttl(b"t", 100), -2);
        s.set(b"p", b"v", 0, Expiry::Never, Cond::Always, 0)
            .unwrap();
        assert_eq!(s.pttl(b"p", 0), -1);
        assert!(s.expire(b"p", Some(500), 10));
        assert_eq!(s.pttl(b"p", 10), 490);
        // KEEPTTL and INCR keep it.
        s.set(b"p", b"7", 0, Expiry::Keep, Cond::Always, 20)
            .unwrap();
        assert_eq!(s.incr(b"p", 3, 30).unwrap(), 10);
        assert_eq!(s.pttl(b"p", 30), 470);
        assert!(s.expire(b"p", Some(5), 40), "an expiry in the past deletes");
        assert_eq!(s.pttl(b"p", 40), -2);
    }

    #[test]
    fn incr_follows_redis_integer_rules() {
        let mut s = store(8);
        assert_eq!(s.incr(b"n", 5, 0).unwrap(), 5);
        assert_eq!(s.incr(b"n", -7, 0).unwrap(), -2);
        for bad in [
            &b"1.5"[..],
            b" 1",
            b"+1",
            b"01",
            b"-0",
            b"",
            b"abc",
            b"99999999999999999999",
        ] {
            s.set(b"b", bad, 0, Expiry::Never, Cond::Always, 0).unwrap();
            assert_eq!(s.incr(b"b", 1, 0), Err(StoreError::NotAnInteger), "{bad:?}");
        }
        s.set(
            b"m",
            i64::MAX.to_string().as_bytes(),
            0,
            Expiry::Never,
            Cond::Always,
            0,
        )
        .unwrap();
        assert_eq!(s.incr(b"m", 1, 0), Err(StoreError::Overflow));
        assert_eq!(parse_i64(b"-9223372036854775808"), Some(i64::MIN));
        assert_eq!(parse_i64(b"9223372036854775808"), None);
    }

    /// `parse_i64` against the cases Redis's own unit test gives
    /// `string2ll` (src/unit/test_util.c), and the early exits of its
    /// source (util.c): a lone `-`, `-0`, the empty string, over 20 bytes.
    /// An independent check of the rules the proptest below restates.
    #[test]
    fn parse_i64_matches_redis_string2ll_cases() {
        let cases: &[(&str, Option<i64>)] = &[
            ("+1", None),
            (" 1", None),
            ("1 ", None),
            ("01", None),
            ("-1", Some(-1)),
            ("0", Some(0)),
            ("1", Some(1)),
            ("99", Some(99)),
            ("-99", Some(-99)),
            ("-9223372036854775808", Some(i64::MIN)),
            ("-9223372036854775809", None),
            ("9223372036854775807", Some(i64::MAX)),
            ("9223372036854775808", None),
            ("-", None),
            ("-0", None),
            ("", None),
            ("000000000000000000001", None),
        ];
        for &(text, want) in cases {
            assert_eq!(parse_i64(text.as_bytes()), want, "{text:?}");
        }
    }

    proptest::proptest! {
        /// `parse_i64` is Redis's `string2ll`: any i64 written out parses
        /// back; any text parses exactly when its i128 reading (same
        /// syntax) is within i64.
        #[test]
        fn parse_i64_is_string2ll(n in proptest::prelude::any::<i64>(), t in "-?[0-9]{0,21}|[+ 0-9a]{0,4}") {
            proptest::prop_assert_eq!(parse_i64(n.to_string().as_bytes()), Some(n));
            let b = t.as_bytes();
            let digits = b.strip_prefix(b"-").unwrap_or(b);
            let syntax = !b.is_empty() && b.len() <= 20 && (b == b"0" || (!digits.is_empty()
                && (b'1'..=b'9').contains(&digits[0]) && digits.iter().all(u8::is_ascii_digit)));
            let want = syntax.then(|| t.parse::<i128>().ok()).flatten().and_then(|v| i64::try_from(v).ok());
            proptest::prop_assert_eq!(parse_i64(b), want);
        }
    }

    /// Far more data than memory: no SET fails, memory never grows, the most
    /// recent items are there and read back exactly.
    #[test]
    fn eviction_keeps_memory_fixed() {
        let mut s = store(4);
        let before = s.registered_bytes();
        let value = |i: u32, len: usize| -> Vec<u8> {
            (0..len).map(|j| (i as usize * 31 + j) as u8).collect()
        };
        for i in 0..40_000u32 {
            let len = [100, 1000, 4000, 30_000][i as usize % 4];
            let key = format!("key{i}");
            s.set(
                key.as_bytes(),
                &value(i, len),
                0,
                Expiry::Never,
                Cond::Always,
                0,
            )
            .unwrap();
            assert!(s.item_bytes() <= s.registered_bytes());
        }
        assert_eq!(s.registered_bytes(), before);
        assert!(s.counters.evictions.load(Ordering::Relaxed) > 30_000);
        let mut hits = 0;
        for i in 39_900..40_000u32 {
            let len = [100, 1000, 4000, 30_000][i as usize % 4];
            if let Some(v) = one_sided(&s, format!("key{i}").as_bytes()) {
                assert_eq!(v, value(i, len));
                hits += 1;
            }
        }
        assert!(hits > 50, "only {hits} of the last 100 survived");
        // Every indexed item is whole.
        let mut found = 0u64;
        for i in 0..40_000u32 {
            let key = format!("key{i}");
            if let Some(v) = one_sided(&s, key.as_bytes()) {
                assert_eq!(v.len(), [100, 1000, 4000, 30_000][i as usize % 4]);
                found += 1;
            }
        }
        assert_eq!(found, s.items());
    }

    /// Items of many sizes in a small node: every class gets pages without
    /// taking them from another, so nothing is evicted while memory is free.
    #[test]
    fn many_classes_fit_a_small_node() {
        let mut s = store(16);
        let val = |n: u64| vec![n as u8; 8 + (n * 7919 % 3000) as usize];
        for i in 0..2000u64 {
            s.set(
                format!("key:{i}").as_bytes(),
                &val(i),
                0,
                Expiry::Never,
                Cond::Always,
                0,
            )
            .unwrap();
        }
        for i in 0..2000u64 {
            assert_eq!(
                one_sided(&s, format!("key:{i}").as_bytes()),
                Some(val(i)),
                "key:{i}"
            );
        }
        assert_eq!(s.counters.evictions.load(Ordering::Relaxed), 0);
        assert_eq!(s.counters.page_moves.load(Ordering::Relaxed), 0);
        assert_eq!(page_for(16 << 20), 256 << 10);
        assert_eq!(page_for(256 << 20), 1 << 20);
        assert_eq!(page_for(4 << 20), 64 << 10);
    }

    #[test]
    fn limits_are_errors() {
        let mut s = store(8);
        let big = vec![0u8; s.page as usize];
        assert!(matches!(
            s.set(b"k", &big, 0, Expiry::Never, Cond::Always, 0),
            Err(StoreError::TooLarge { .. })
        ));
        assert!(
            s.set(b"", b"empty key", 0, Expiry::Never, Cond::Always, 0)
                .unwrap()
                .stored
        );
        assert_eq!(s.get(b"", 0).unwrap().0, b"empty key");
        let long = vec![b'k'; MAX_KEY + 1];
        assert_eq!(
            s.set(&long, b"v", 0, Expiry::Never, Cond::Always, 0),
            Err(StoreError::BadKey(MAX_KEY + 1))
        );
        assert_eq!(s.incr(&long, 1, 0), Err(StoreError::BadKey(MAX_KEY + 1)));
        let just = vec![1u8; s.max_payload() - 1];
        assert!(
            s.set(b"k", &just, 0, Expiry::Never, Cond::Always, 0)
                .unwrap()
                .stored
        );
        assert_eq!(one_sided(&s, b"k"), Some(just));
        assert!(Store::new(&Domain::new(), 1 << 20).is_err());
    }

    #[test]
    fn flush_empties_everything() {
        let mut s = store(8);
        for i in 0..100 {
            s.set(
                format!("{i}").as_bytes(),
                b"v",
                0,
                Expiry::Never,
                Cond::Always,
                0,
            )
            .unwrap();
        }
        s.flush();
        assert_eq!((s.items(), s.item_bytes()), (0, 0));
        assert_eq!(one_sided(&s, b"5"), None);
        s.set(b"5", b"again", 0, Expiry::Never, Cond::Always, 0)
            .unwrap();
        assert_eq!(one_sided(&s, b"5"), Some(b"again".to_vec()));
    }
}
