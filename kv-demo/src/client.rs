//! The cluster client: consistent (rendezvous) hashing over a static list of
//! nodes, GETs by one-sided reads with a bounded number of retries before an
//! RPC GET, writes by RPC, and failover: a node whose operations fail or time
//! out is marked down, its keys go to the next node by the hash, and it is
//! probed with backoff until it answers again (with fresh region keys).

use std::future::IntoFuture;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::future::join_all;
use parking_lot::RwLock;
use rdmx_core::{Connection, Options, RemoteRegion, Transports};
use rdmx_rpc::{CallOptions, RpcError};
use serde_bytes::ByteBuf;
use xxhash_rust::xxh3::xxh3_64;

use crate::layout::{key_hash, tag_of, verify_item, Entry, Torn, BUCKET_BYTES, WAYS};
use crate::node::{now_ms, NodeInfo, SetReq, SetResp, Ttl, METHODS, SERVICE, VERSION};
use crate::pointers::PointerCache;
use crate::store::Cond;

/// One-sided readers treat an item that expires within this many
/// milliseconds of the node's estimated clock as expired already: clocks are
/// compared through an offset measured at connect, so this margin absorbs
/// that measurement's error (half a round trip) and drift. Errs towards a miss.
pub const SKEW_MARGIN_MS: u64 = 10;

/// How a GET reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GetPath {
    /// Read the bucket and the item one-sidedly; fall back to RPC after
    /// [`ClientConfig::read_retries`] torn reads.
    OneSided,
    /// Ask the node by RPC.
    Rpc,
}

/// Errors of cache operations.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// The node refused (value too large, not an integer, overflow...).
    #[error("{0}")]
    Refused(String),
    /// The node owning the key failed during the call; it is marked down and
    /// its keys go to the next node from now on.
    #[error("node {url} failed: {why}")]
    NodeFailed {
        /// The node.
        url: String,
        /// What happened.
        why: String,
    },
    /// No node is up.
    #[error("no cache node is reachable ({0} configured)")]
    NoNodes(usize),
}

/// Client settings.
#[derive(Clone, Debug)]
pub struct ClientConfig {
    /// Node URLs (`tcp://` or `rdma://`).
    pub nodes: Vec<String>,
    /// Connection options (secret, policy); `op_timeout` bounds every call.
    pub options: Options,
    /// Torn one-sided reads retried before falling back to RPC.
    pub read_retries: u32,
    /// First wait before probing a down node again (doubles up to 5 s).
    pub probe_backoff: Duration,
}

impl ClientConfig {
    /// Defaults for `nodes`: 1 s per operation, 3 read retries.
    pub fn new(nodes: Vec<String>) -> ClientConfig {
        ClientConfig {
            nodes,
            options: Options {
                op_timeout: Duration::from_secs(1),
                connect_timeout: Duration::from_secs(2),
                ..Options::default()
            },
            read_retries: 3,
            probe_backoff: Duration::from_millis(100),
        }
    }
}

/// Counters of a client, per path.
#[derive(Debug, Default)]
pub struct ClientCounters {
    /// One-sided GETs that found a value.
    pub one_sided_hits: AtomicU64,
    /// One-sided GETs that found none.
    pub one_sided_misses: AtomicU64,
    /// One-sided reads retried (torn, overwritten or reused slots).
    pub one_sided_retries: AtomicU64,
    /// READs the one-sided path issued (index buckets and items): a hit on a
    /// remembered pointer takes one, a first look two.
    pub one_sided_reads: AtomicU64,
    /// One-sided GETs that gave up and asked by RPC.
    pub one_sided_fallbacks: AtomicU64,
    /// RPC GETs that found a value.
    pub rpc_hits: AtomicU64,
    /// RPC GETs that found none.
    pub rpc_misses: AtomicU64,
    /// Times a node was marked down.
    pub nodes_marked_down: AtomicU64,
    /// Times a node came back.
    pub nodes_back: AtomicU64,
}

/// Keys whose index entry a client remembers per node (then a GET hit is one
/// read, of the item): at most this many, in a set-associative
/// [`PointerCache`] of 4 MiB per node.
pub const POINTER_CACHE: usize = 1 << 18;

struct Link {
    rpc: rdmx_rpc::Client,
    info: NodeInfo,
    /// Node clock minus ours, in milliseconds, measured at connect.
    offset_ms: i64,
    /// Key hash → the entry that led to the key's item last time
    /// (FaRM/Pilaf-style pointer cache). A stale pointer fails verification:
    /// the node clears a freed slot's magic, and a reused slot holds another
    /// key or version; so does another key with the same hash bits, as the
    /// item holds its key. Keyed by hash, a lookup touches no key bytes, and
    /// one cache line of the table.
    pointers: parking_lot::Mutex<PointerCache>,
}

/// A key's owner in a multi-key operation: the node's index, its link, and
/// the key's hash under that node's seed.
type Owner = Result<(usize, Arc<Link>, u64), KvError>;

/// One node's share of a one-sided MGET's first batch.
struct Remembered {
    /// The node's index.
    node: usize,
    link: Arc<Link>,
    /// (key index, the remembered entry) for each item read.
    picked: Vec<(usize, Entry)>,
    /// Where each item is, in the same order (taken when the batch is posted).
    at: Vec<RemoteRegion>,
}

impl Link {
    /// Remember where the item of the key hashing to `h` is.
    fn remember(&self, h: u64, e: Entry) {
        self.pointers.lock().insert(h, e);
    }
}

enum State {
    Up(Arc<Link>),
    Down {
        retry_at: Instant,
        backoff: Duration,
    },
}

struct Slot {
    url: String,
    /// The node's identity for rendezvous hashing (a hash of its URL).
    id: u64,
    state: RwLock<State>,
    probing: tokio::sync::Mutex<()>,
    /// Whether it has been up before (so coming up again counts as "back").
    was_up: std::sync::atomic::AtomicBool,
}

struct Inner {
    cfg: ClientConfig,
    transports: Transports,
    slots: Vec<Slot>,
    counters: ClientCounters,
}

/// A cache client; cheap to clone.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("nodes", &self.inner.cfg.nodes)
            .finish()
    }
}

fn transport_err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Whether an RPC error means the node (not the request) failed.
fn node_failed(e: &RpcError) -> bool {
    !matches!(e, RpcError::App(_))
}

impl Client {
    /// Connect to every node (those that do not answer start as down and
    /// are probed in the background).
    pub async fn connect(cfg: ClientConfig) -> Client {
        let transports = Transports::new()
            .with(rdmx_transport_tcp::TcpTransport::new())
            .with(rdmx_transport_rdma::RdmaTransport::new());
        Client::with_transports(cfg, transports).await
    }

    /// [`Client::connect`] with the transports to use.
    pub async fn with_transports(cfg: ClientConfig, transports: Transports) -> Client {
        let slots = cfg
            .nodes
            .iter()
            .map(|url| Slot {
                url: url.clone(),
                id: xxh3_64(url.as_bytes()),
                state: RwLock::new(State::Down {
                    retry_at: Instant::now(),
                    backoff: cfg.probe_backoff,
                }),
                probing: tokio::sync::Mutex::new(()),
                was_up: std::sync::atomic::AtomicBool::new(false),
            })
            .collect();
        let inner = Arc::new(Inner {
            cfg,
            transports,
            slots,
            counters: ClientCounters::default(),
        });
        join_all((0..inner.slots.len()).map(|i| probe(&inner, i))).await;
        tokio::spawn(prober(Arc::downgrade(&inner)));
        Client { inner }
    }

    /// The client's counters.
    pub fn counters(&self) -> &ClientCounters {
        &self.inner.counters
    }

    /// Nodes up now, by URL.
    pub fn nodes_up(&self) -> Vec<String> {
        self.inner
            .slots
            .iter()
            .filter(|s| matches!(*s.state.read(), State::Up(_)))
            .map(|s| s.url.clone())
            .collect()
    }

    /// The up node that owns `key`: the highest rendezvous score among the
    /// nodes up (adding or removing one node moves about 1/N of the keys).
    fn owner(&self, key: &[u8]) -> Result<(usize, Arc<Link>), KvError> {
        let h = xxh3_64(key);
        let mut best: Option<(u64, usize, Arc<Link>)> = None;
        for (i, s) in self.inner.slots.iter().enumerate() {
            let sc = score(h, s.id);
            if best.as_ref().is_some_and(|(b, _, _)| *b > sc) {
                continue;
            }
            if let State::Up(l) = &*s.state.read() {
                best = Some((sc, i, l.clone()));
            }
        }
        best.map(|(_, i, l)| (i, l))
            .ok_or(KvError::NoNodes(self.inner.slots.len()))
    }

    /// Mark node `i` down if `link` is still its current link.
    fn failed(&self, i: usize, link: &Arc<Link>, why: String) -> KvError {
        let slot = &self.inner.slots[i];
        let mut st = slot.state.write();
        if matches!(&*st, State::Up(l) if Arc::ptr_eq(l, link)) {
            tracing::warn!(node = %slot.url, %why, "cache node marked down");
            self.inner
                .counters
                .nodes_marked_down
                .fetch_add(1, Ordering::Relaxed);
            *st = State::Down {
                retry_at: Instant::now() + self.inner.cfg.probe_backoff,
                backoff: self.inner.cfg.probe_backoff,
            };
        }
        KvError::NodeFailed {
            url: slot.url.clone(),
            why,
        }
    }

    async fn call<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        i: usize,
        link: &Arc<Link>,
        method: &str,
        req: &Req,
    ) -> Result<Resp, KvError> {
        let opts = CallOptions {
            deadline: Some(self.inner.cfg.options.op_timeout),
        };
        match link.rpc.call_with(method, req, opts).await {
            Ok(r) => Ok(r),
            Err(RpcError::App(why)) => Err(KvError::Refused(why)),
            Err(e) if node_failed(&e) => Err(self.failed(i, link, e.to_string())),
            Err(e) => Err(KvError::Refused(e.to_string())),
        }
    }

    /// GET by one-sided reads (see [`GetPath`]).
    pub async fn get(&self, key: &[u8]) -> Result<Option<Bytes>, KvError> {
        self.get_with(key, GetPath::OneSided).await
    }

    /// GET by the chosen path.
    pub async fn get_with(&self, key: &[u8], path: GetPath) -> Result<Option<Bytes>, KvError> {
        let (i, link) = self.owner(key)?;
        let h = key_hash(key, link.info.geometry.seed);
        self.get_on(i, link, key, h, path).await
    }

    /// GET from node `i` through `link`, its owner's; `h` is the key's hash
    /// under that node's seed.
    async fn get_on(
        &self,
        i: usize,
        link: Arc<Link>,
        key: &[u8],
        h: u64,
        path: GetPath,
    ) -> Result<Option<Bytes>, KvError> {
        let c = &self.inner.counters;
        if path == GetPath::OneSided {
            match self.read_one_sided(&link, key, h).await {
                Ok(Some(found)) => {
                    self.count_one_sided(&found);
                    return Ok(found);
                }
                Ok(None) => {
                    c.one_sided_fallbacks.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => return Err(self.failed(i, &link, transport_err(e))),
            }
        }
        let r: Option<(ByteBuf, u32)> = self.call(i, &link, "get", &ByteBuf::from(key)).await?;
        let counter = if r.is_some() {
            &c.rpc_hits
        } else {
            &c.rpc_misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok(r.map(|(v, _)| Bytes::from(v.into_vec())))
    }

    /// Count a one-sided answer as a hit or a miss.
    fn count_one_sided(&self, found: &Option<Bytes>) {
        let c = &self.inner.counters;
        let counter = if found.is_some() {
            &c.one_sided_hits
        } else {
            &c.one_sided_misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// The answer a verified item gives: its value, or a miss once it has
    /// expired on the node's clock.
    fn answer_of(link: &Link, item: &Bytes, expiry_ms: u64, value: Range<usize>) -> Option<Bytes> {
        if Self::expired(link, expiry_ms) {
            None
        } else {
            Some(item.slice(value))
        }
    }

    /// Whether an item's expiry has passed on the node's clock (estimated,
    /// with [`SKEW_MARGIN_MS`] towards "expired").
    fn expired(link: &Link, expiry_ms: u64) -> bool {
        if expiry_ms == 0 {
            // Never expires: no need to read the clock.
            return false;
        }
        let node_now = (now_ms() as i64 + link.offset_ms) as u64;
        expiry_ms <= node_now.saturating_add(SKEW_MARGIN_MS)
    }

    /// One-sided GET: `Ok(Some(answer))`, or `Ok(None)` when every retry
    /// met a torn or moving item (ask by RPC then). A remembered pointer
    /// makes a hit one read; otherwise the bucket, then the item. `h` is
    /// the key's hash under the node's seed.
    async fn read_one_sided(
        &self,
        link: &Link,
        key: &[u8],
        h: u64,
    ) -> rdmx_core::Result<Option<Option<Bytes>>> {
        let g = link.info.geometry;
        let conn: &Connection = link.rpc.connection();
        let reads = &self.inner.counters.one_sided_reads;
        let cached = link.pointers.lock().get(h);
        if let Some(e) = cached {
            if let Ok(at) = g.arena.slice(e.offset, u64::from(e.len)) {
                reads.fetch_add(1, Ordering::Relaxed);
                let item = conn.read(at).await?;
                if let Ok((hd, vr)) = verify_item(&item, &e, key, g.seed) {
                    return Ok(Some(Self::answer_of(link, &item, hd.expiry_ms, vr)));
                }
            }
            link.pointers.lock().remove(h);
        }
        let b = h & (g.buckets - 1);
        let tag = tag_of(h);
        for attempt in 0..=self.inner.cfg.read_retries {
            if attempt > 0 {
                self.inner
                    .counters
                    .one_sided_retries
                    .fetch_add(1, Ordering::Relaxed);
            }
            reads.fetch_add(1, Ordering::Relaxed);
            let bucket = conn
                .read(g.index.slice(b * BUCKET_BYTES, BUCKET_BYTES)?)
                .await?;
            let mut torn = false;
            let mut answer = None;
            for w in 0..WAYS {
                let Some(e) = Entry::decode(&bucket[w * 16..w * 16 + 16]) else {
                    continue;
                };
                if e.tag != tag {
                    continue;
                }
                // A torn entry may name a range outside the arena.
                let Ok(at) = g.arena.slice(e.offset, u64::from(e.len)) else {
                    torn = true;
                    continue;
                };
                reads.fetch_add(1, Ordering::Relaxed);
                let item = conn.read(at).await?;
                match verify_item(&item, &e, key, g.seed) {
                    Ok((hd, vr)) => {
                        answer = Some(Self::answer_of(link, &item, hd.expiry_ms, vr));
                        link.remember(h, e);
                        break;
                    }
                    // Another key with the same tag: keep looking.
                    Err(Torn::OtherKey) => {}
                    Err(_) => torn = true,
                }
            }
            if let Some(a) = answer {
                return Ok(Some(a));
            }
            if !torn {
                return Ok(Some(None));
            }
        }
        Ok(None)
    }

    /// MGET: every key's GET at once, across nodes. One-sided, the items
    /// whose place the client remembers are read first, one
    /// [`Connection::read_many`] per node (a chain of READs posted as one
    /// unit); every other key, and every item that did not verify, then
    /// takes the single-key path.
    pub async fn mget(&self, keys: &[&[u8]], path: GetPath) -> Vec<Result<Option<Bytes>, KvError>> {
        // Each key's owner and its hash under that node's seed, once.
        let owners: Vec<Owner> = keys
            .iter()
            .map(|k| {
                self.owner(k).map(|(i, link)| {
                    let h = key_hash(k, link.info.geometry.seed);
                    (i, link, h)
                })
            })
            .collect();
        let mut found: Vec<Option<Result<Option<Bytes>, KvError>>> =
            keys.iter().map(|_| None).collect();
        if path == GetPath::OneSided {
            self.read_remembered(keys, &owners, &mut found).await;
        }
        // Collected into a list sized for every key first: a GET's future
        // is large, and `join_all` over an iterator of unknown length (a
        // filter) grew its list by doubling, copying the futures each step.
        let mut rest = Vec::with_capacity(keys.len());
        for ((k, o), f) in keys.iter().zip(owners).zip(&found) {
            if f.is_none() {
                rest.push(async move {
                    let (i, link, h) = o?;
                    self.get_on(i, link, k, h, path).await
                });
            }
        }
        let mut rest = join_all(rest).await.into_iter();
        found
            .into_iter()
            .map(|f| f.unwrap_or_else(|| rest.next().expect("one answer per key left")))
            .collect()
    }

    /// The first part of a one-sided MGET: per node, one batch of reads of
    /// the items the pointer cache remembers (under one lock of it), each
    /// verified as [`Client::read_one_sided`] does. Fills `found` for the
    /// keys answered; a batch that fails marks its node down and fails its
    /// keys, as a single GET's failed read does (rather than waiting for the
    /// node's deadline once more on the single-key path).
    async fn read_remembered(
        &self,
        keys: &[&[u8]],
        owners: &[Owner],
        found: &mut [Option<Result<Option<Bytes>, KvError>>],
    ) {
        let mut batches: Vec<Remembered> = Vec::new();
        for n in 0..self.inner.slots.len() {
            let mine: Vec<(usize, u64)> = owners
                .iter()
                .enumerate()
                .filter_map(|(j, o)| match o {
                    Ok((i, _, h)) if *i == n => Some((j, *h)),
                    _ => None,
                })
                .collect();
            let Some(&(first, _)) = mine.first() else {
                continue;
            };
            let link = owners[first].as_ref().expect("owned").1.clone();
            let arena = link.info.geometry.arena;
            let (mut picked, mut at) = (Vec::new(), Vec::new());
            {
                let mut p = link.pointers.lock();
                // Every line's load at once (see PointerCache::touch).
                for &(_, h) in &mine {
                    p.touch(h);
                }
                for &(j, h) in &mine {
                    let Some(e) = p.get(h) else { continue };
                    if let Ok(r) = arena.slice(e.offset, u64::from(e.len)) {
                        picked.push((j, e));
                        at.push(r);
                    }
                }
            }
            if !picked.is_empty() {
                batches.push(Remembered {
                    node: n,
                    link,
                    picked,
                    at,
                });
            }
        }
        let asked: usize = batches.iter().map(|b| b.picked.len()).sum();
        self.inner
            .counters
            .one_sided_reads
            .fetch_add(asked as u64, Ordering::Relaxed);
        let reads = join_all(batches.iter_mut().map(|b| {
            b.link
                .rpc
                .connection()
                .read_many(std::mem::take(&mut b.at))
                .into_future()
        }))
        .await;
        for (b, items) in batches.iter().zip(reads) {
            let Remembered {
                node, link, picked, ..
            } = b;
            let items = match items {
                Ok(items) => items,
                Err(e) => {
                    let why = transport_err(e);
                    for (j, _) in picked {
                        found[*j] = Some(Err(self.failed(*node, link, why.clone())));
                    }
                    continue;
                }
            };
            let seed = link.info.geometry.seed;
            for ((j, e), item) in picked.iter().zip(items) {
                match verify_item(&item, e, keys[*j], seed) {
                    Ok((hd, vr)) => {
                        let answer = Self::answer_of(link, &item, hd.expiry_ms, vr);
                        self.count_one_sided(&answer);
                        found[*j] = Some(Ok(answer));
                    }
                    Err(_) => {
                        let h = owners[*j].as_ref().expect("owned").2;
                        link.pointers.lock().remove(h);
                    }
                }
            }
        }
    }

    /// SET with options; returns whether it was stored.
    pub async fn set(
        &self,
        key: &[u8],
        value: &[u8],
        ttl: Ttl,
        cond: Cond,
    ) -> Result<bool, KvError> {
        Ok(self.set_with(key, value, ttl, cond, false).await?.0)
    }

    /// SET … GET: also returns the previous value (only this form carries
    /// it back from the node).
    pub async fn set_get(
        &self,
        key: &[u8],
        value: &[u8],
        ttl: Ttl,
        cond: Cond,
    ) -> Result<(bool, Option<Bytes>), KvError> {
        self.set_with(key, value, ttl, cond, true).await
    }

    async fn set_with(
        &self,
        key: &[u8],
        value: &[u8],
        ttl: Ttl,
        cond: Cond,
        want_old: bool,
    ) -> Result<(bool, Option<Bytes>), KvError> {
        let (i, link) = self.owner(key)?;
        let req = SetReq {
            key: ByteBuf::from(key),
            value: ByteBuf::from(value),
            flags: 0,
            ttl,
            cond,
            want_old,
        };
        let (ok, old, placed): SetResp = self.call(i, &link, "set", &req).await?;
        if let Some(p) = placed {
            // The next GET of this key reads the item at once (the node
            // answered after the index pointed at it).
            let h = key_hash(key, link.info.geometry.seed);
            link.remember(
                h,
                Entry {
                    offset: p.offset,
                    len: p.len,
                    tag: tag_of(h),
                    version: p.version,
                },
            );
        }
        Ok((ok, old.map(|o| Bytes::from(o.into_vec()))))
    }

    /// Run a multi-key method per owning node and add up the answers.
    async fn per_node_sum(&self, method: &str, keys: &[&[u8]]) -> Result<u64, KvError> {
        let mut groups: Vec<(usize, Arc<Link>, Vec<ByteBuf>)> = Vec::new();
        for k in keys {
            let (i, link) = self.owner(k)?;
            match groups.iter_mut().find(|g| g.0 == i) {
                Some(g) => g.2.push(ByteBuf::from(*k)),
                None => groups.push((i, link, vec![ByteBuf::from(*k)])),
            }
        }
        let answers = join_all(
            groups
                .iter()
                .map(|(i, link, ks)| self.call::<_, u64>(*i, link, method, ks)),
        )
        .await;
        answers.into_iter().try_fold(0, |acc, r| Ok(acc + r?))
    }

    /// DEL: how many keys had a value.
    pub async fn del(&self, keys: &[&[u8]]) -> Result<u64, KvError> {
        self.per_node_sum("del", keys).await
    }

    /// EXISTS: how many of the keys have a value (repeats count).
    pub async fn exists(&self, keys: &[&[u8]]) -> Result<u64, KvError> {
        self.per_node_sum("exists", keys).await
    }

    /// TOUCH: how many of the keys have a value.
    pub async fn touch(&self, keys: &[&[u8]]) -> Result<u64, KvError> {
        self.per_node_sum("touch", keys).await
    }

    /// INCRBY (atomic on the owning node); the new value.
    pub async fn incr(&self, key: &[u8], delta: i64) -> Result<i64, KvError> {
        let (i, link) = self.owner(key)?;
        self.call(i, &link, "incr", &(ByteBuf::from(key), delta))
            .await
    }

    /// Set the expiry to `ms` from now (`None`: remove it; `<= 0`: delete).
    /// Whether the key had a value.
    pub async fn expire(&self, key: &[u8], ms: Option<i64>) -> Result<bool, KvError> {
        let (i, link) = self.owner(key)?;
        self.call(i, &link, "expire", &(ByteBuf::from(key), ms))
            .await
    }

    /// Milliseconds to live: `-2` no value, `-1` no expiry.
    pub async fn pttl(&self, key: &[u8]) -> Result<i64, KvError> {
        let (i, link) = self.owner(key)?;
        self.call(i, &link, "pttl", &ByteBuf::from(key)).await
    }

    async fn all_up<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
    ) -> Result<Vec<T>, KvError> {
        let links: Vec<(usize, Arc<Link>)> = self
            .inner
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match &*s.state.read() {
                State::Up(l) => Some((i, l.clone())),
                State::Down { .. } => None,
            })
            .collect();
        if links.is_empty() {
            return Err(KvError::NoNodes(self.inner.slots.len()));
        }
        join_all(
            links
                .iter()
                .map(|(i, l)| self.call::<_, T>(*i, l, method, &())),
        )
        .await
        .into_iter()
        .collect()
    }

    /// Remove every item on every node that is up.
    pub async fn flush(&self) -> Result<(), KvError> {
        self.all_up::<()>("flush").await.map(|_| ())
    }

    /// Each up node's own report, by URL.
    pub async fn node_stats(&self) -> Result<Vec<(String, crate::node::NodeStats)>, KvError> {
        let urls: Vec<String> = self.nodes_up();
        let stats = self.all_up::<crate::node::NodeStats>("stats").await?;
        Ok(urls.into_iter().zip(stats).collect())
    }

    /// Items on the nodes that are up.
    pub async fn dbsize(&self) -> Result<u64, KvError> {
        Ok(self.all_up::<u64>("dbsize").await?.into_iter().sum())
    }

    /// The largest key + value one item holds (the smallest over nodes up).
    pub fn max_payload(&self) -> u64 {
        self.inner
            .slots
            .iter()
            .filter_map(|s| match &*s.state.read() {
                State::Up(l) => Some(l.info.max_payload),
                State::Down { .. } => None,
            })
            .min()
            .unwrap_or(u64::MAX)
    }
}

/// Rendezvous (highest random weight) score of a key for a node.
fn score(key_hash: u64, node: u64) -> u64 {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&key_hash.to_le_bytes());
    b[8..].copy_from_slice(&node.to_le_bytes());
    xxh3_64(&b)
}

/// Try to (re)connect node `i`: a fresh connection, the node's geometry and
/// clock. Up on success; down with a doubled backoff otherwise.
async fn probe(inner: &Arc<Inner>, i: usize) {
    let slot = &inner.slots[i];
    let Ok(_guard) = slot.probing.try_lock() else {
        return;
    };
    let attempt = async {
        let conn = inner
            .transports
            .connect(&slot.url, &inner.cfg.options)
            .await
            .map_err(|e| e.to_string())?;
        let rpc = rdmx_rpc::Client::connect(conn, SERVICE, VERSION, METHODS)
            .await
            .map_err(|e| e.to_string())?;
        let t0 = now_ms();
        let info: NodeInfo = rpc.call("info", &()).await.map_err(|e| e.to_string())?;
        let t1 = now_ms();
        let offset_ms = info.now_ms as i64 - ((t0 + t1) / 2) as i64;
        Ok::<_, String>(Link {
            rpc,
            info,
            offset_ms,
            pointers: parking_lot::Mutex::new(PointerCache::new(POINTER_CACHE)),
        })
    };
    let result = tokio::time::timeout(inner.cfg.options.connect_timeout, attempt)
        .await
        .unwrap_or_else(|_| Err("connect timed out".into()));
    let mut st = slot.state.write();
    match result {
        Ok(link) => {
            if matches!(&*st, State::Down { .. }) && slot.was_up.swap(true, Ordering::Relaxed) {
                inner.counters.nodes_back.fetch_add(1, Ordering::Relaxed);
                tracing::info!(node = %slot.url, epoch = link.info.epoch, "cache node back");
            }
            *st = State::Up(Arc::new(link));
        }
        Err(why) => {
            let backoff = match &*st {
                State::Down { backoff, .. } => (*backoff * 2).min(Duration::from_secs(5)),
                State::Up(_) => inner.cfg.probe_backoff,
            };
            tracing::debug!(node = %slot.url, %why, ?backoff, "cache node still down");
            *st = State::Down {
                retry_at: Instant::now() + backoff,
                backoff,
            };
        }
    }
}

/// Probe down nodes when their backoff has passed, while the client lives.
async fn prober(inner: Weak<Inner>) {
    loop {
        tokio::time::sleep(Duration::from_millis(50)).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let due: Vec<usize> = inner
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                matches!(&*s.state.read(), State::Down { retry_at, .. } if *retry_at <= Instant::now())
                    || matches!(&*s.state.read(), State::Up(l) if !l.rpc.is_usable())
            })
            .map(|(i, _)| i)
            .collect();
        join_all(due.into_iter().map(|i| probe(&inner, i))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Adding a node moves about 1/N of the keys, all of them to the new node.
    #[test]
    fn rendezvous_moves_one_nth() {
        let ids: Vec<u64> = (0..5)
            .map(|i| xxh3_64(format!("tcp://n{i}:1").as_bytes()))
            .collect();
        let owner = |k: u64, n: usize| (0..n).max_by_key(|&i| score(k, ids[i])).unwrap();
        let keys: Vec<u64> = (0..20_000u64).map(|i| xxh3_64(&i.to_le_bytes())).collect();
        let moved: Vec<usize> = keys
            .iter()
            .filter(|&&k| owner(k, 4) != owner(k, 5))
            .map(|&k| owner(k, 5))
            .collect();
        assert!(
            moved.iter().all(|&o| o == 4),
            "keys move only to the new node"
        );
        let share = moved.len() as f64 / keys.len() as f64;
        assert!((0.15..0.25).contains(&share), "moved {share}");
    }
}
