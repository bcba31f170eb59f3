//! A cache node: a [`Store`] served over rdmx-rpc (writes, RPC reads, and the
//! geometry clients need for one-sided reads), with Prometheus metrics.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;
use rdmx_core::{Domain, Listener, Options, Transports};
use rdmx_rpc::{Server, ServerOptions, Service};
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use crate::store::{Cond, Expiry, Geometry, Store};

/// The RPC service name and version.
pub const SERVICE: &str = "rdmx-kv";
/// Version of the node protocol.
pub const VERSION: u32 = 2;
/// Every method a node serves.
pub const METHODS: &[&str] = &[
    "info", "get", "set", "del", "exists", "incr", "expire", "pttl", "touch", "flush", "dbsize",
    "stats",
];

/// What a node reports about itself (for benchmarks and operators).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeStats {
    /// CPU seconds the node process has used (user + system, all threads).
    pub cpu_seconds: f64,
    /// Items stored.
    pub items: u64,
    /// RPC GETs served.
    pub rpc_gets: u64,
    /// One-sided reads served by this process (software transports count them).
    pub one_sided_reads: u64,
}

/// CPU seconds of this process, from `/proc/self/stat` (utime + stime, in
/// the kernel's USER_HZ = 100 ticks per second that Linux exports there).
pub fn process_cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 0.0;
    };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after ')'.
    (tick(11) + tick(12)) as f64 / 100.0
}

/// The node's clock: Unix milliseconds.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// What a client learns at connect.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// Where to read one-sidedly.
    pub geometry: Geometry,
    /// The node's clock when it answered.
    pub now_ms: u64,
    /// Random per node start: a restarted node has another epoch.
    pub epoch: u64,
    /// Bytes of key and value one item holds.
    pub max_payload: u64,
}

/// A relative expiry, as clients send it (no clock skew involved).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Ttl {
    /// No expiry.
    Never,
    /// Expire this many milliseconds from now.
    In(u64),
    /// Keep the current expiry.
    Keep,
}

/// A SET request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SetReq {
    /// The key.
    pub key: ByteBuf,
    /// The value.
    pub value: ByteBuf,
    /// Opaque flags stored with the value.
    pub flags: u32,
    /// Expiry.
    pub ttl: Ttl,
    /// NX / XX.
    pub cond: Cond,
    /// Send the previous value back (SET … GET); plain SETs do not pay for
    /// carrying it.
    pub want_old: bool,
}

/// A SET answer: stored, the previous value (for SET … GET), and where the
/// new item is (for the client's pointer cache; `None` when not stored).
pub type SetResp = (bool, Option<ByteBuf>, Option<Placed>);

/// Where a SET put its item: the index entry's item offset, length and
/// version (low 32 bits), as a one-sided reader would find them in the
/// index (see [`crate::layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placed {
    /// Item offset in the arena.
    pub offset: u64,
    /// Item length in bytes.
    pub len: u32,
    /// Low 32 bits of the item's version.
    pub version: u32,
}

/// A running node.
pub struct Node {
    store: Arc<Mutex<Store>>,
    server: Server,
    epoch: u64,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("epoch", &self.epoch).finish()
    }
}

fn expiry(ttl: Ttl, now: u64) -> Expiry {
    match ttl {
        Ttl::Never => Expiry::Never,
        Ttl::In(ms) => Expiry::At(now.saturating_add(ms.max(1))),
        Ttl::Keep => Expiry::Keep,
    }
}

impl Node {
    /// A node holding at most `memory` bytes of items (index and arena),
    /// registered in `domain` (the domain its listener must serve).
    pub fn new(domain: &Domain, memory: u64) -> Result<Node, String> {
        let store = Arc::new(Mutex::new(Store::new(domain, memory)?));
        let epoch: u64 = rand::random();
        let service = service(store.clone(), epoch);
        Ok(Node {
            store,
            server: Server::new(service, ServerOptions::default()),
            epoch,
        })
    }

    /// Listen on `url` with `opts` (its domain replaced by the node's) and
    /// serve until [`Node::shutdown`]. Returns the listener's address first
    /// through `ready`.
    pub async fn listen(
        transports: &Transports,
        url: &str,
        memory: u64,
        opts: Options,
    ) -> rdmx_core::Result<(Arc<Node>, Listener)> {
        let domain = Domain::new();
        let node = Node::new(&domain, memory).map_err(rdmx_core::Error::InvalidArgument)?;
        let listener = transports.listen(url, &Options { domain, ..opts }).await?;
        Ok((Arc::new(node), listener))
    }

    /// Serve connections from `listener` until [`Node::shutdown`].
    pub async fn serve(&self, listener: Listener) -> Result<(), rdmx_rpc::RpcError> {
        self.server.serve(listener).await
    }

    /// Stop accepting and drain.
    pub fn shutdown(&self) {
        self.server.shutdown();
    }

    /// This run's epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Prometheus text of the node's own families (the rdmx counters come
    /// from `rdmx_core::metrics`).
    pub fn metrics(&self, out: &mut String) {
        use std::fmt::Write as _;
        let (items, bytes, memory, c) = {
            let s = self.store.lock();
            (
                s.items(),
                s.item_bytes(),
                s.registered_bytes(),
                s.counters(),
            )
        };
        let rpc = self.server.stats().snapshot();
        let mut gauge = |name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP rdmx_kv_{name} {help}\n# TYPE rdmx_kv_{name} gauge\nrdmx_kv_{name} {v}"
            );
        };
        gauge(
            "items",
            "Items stored (expired ones not yet reclaimed included).",
            items,
        );
        gauge(
            "item_bytes",
            "Bytes of items: headers, keys and values.",
            bytes,
        );
        gauge(
            "memory_bytes",
            "Registered memory for items: index and arena (the --memory cap).",
            memory,
        );
        let mut counter = |name: &str, help: &str, v: u64| {
            let _ = writeln!(out, "# HELP rdmx_kv_{name}_total {help}\n# TYPE rdmx_kv_{name}_total counter\nrdmx_kv_{name}_total {v}");
        };
        let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        counter("evictions", "Items evicted to make room.", l(&c.evictions));
        counter("expirations", "Expired items reclaimed.", l(&c.expirations));
        counter(
            "rpc_hits",
            "GETs by RPC that found a live item.",
            l(&c.rpc_hits),
        );
        counter(
            "rpc_misses",
            "GETs by RPC that found none.",
            l(&c.rpc_misses),
        );
        counter(
            "sets",
            "Items written (SET and variants, INCR, EXPIRE).",
            l(&c.sets),
        );
        counter(
            "page_moves",
            "Arena pages moved between slab classes.",
            l(&c.page_moves),
        );
        counter("rpc_calls", "RPC calls served.", rpc.calls);
        let _ = writeln!(
            out,
            "# HELP rdmx_kv_process_cpu_seconds_total CPU seconds of the node process (user and system).\n# TYPE rdmx_kv_process_cpu_seconds_total counter\nrdmx_kv_process_cpu_seconds_total {:.2}",
            process_cpu_seconds()
        );
        let _ = writeln!(
            out,
            "# HELP rdmx_kv_one_sided_reads_total One-sided reads of the index and arena served (software transports count them; NICs do not).\n# TYPE rdmx_kv_one_sided_reads_total counter\nrdmx_kv_one_sided_reads_total {}",
            rdmx_core::stats::global().snapshot().remote_ops_served
        );
    }
}

fn keys(v: Vec<ByteBuf>) -> Vec<Vec<u8>> {
    v.into_iter().map(ByteBuf::into_vec).collect()
}

/// An RPC handler that runs `f` on the store, under its lock, at the node's
/// current time. Every store operation is short and never waits, so the
/// handler answers at once.
fn on_store<Req, Resp>(
    store: &Arc<Mutex<Store>>,
    f: impl Fn(&mut Store, Req, u64) -> Result<Resp, String> + Send + Sync + 'static,
) -> impl Fn(Req) -> std::future::Ready<Result<Resp, String>> + Send + Sync + 'static {
    let store = store.clone();
    move |req| std::future::ready(f(&mut store.lock(), req, now_ms()))
}

/// The node's RPC service over `store`.
fn service(store: Arc<Mutex<Store>>, epoch: u64) -> Service {
    let s = &store;
    Service::new(SERVICE, VERSION)
        .method(
            "info",
            on_store(s, move |st, (), now| {
                Ok(NodeInfo {
                    geometry: st.geometry(),
                    now_ms: now,
                    epoch,
                    max_payload: st.max_payload() as u64,
                })
            }),
        )
        .method(
            "get",
            on_store(s, |st, key: ByteBuf, now| {
                Ok(st.get(&key, now).map(|(v, f)| (ByteBuf::from(v), f)))
            }),
        )
        .method(
            "set",
            on_store(s, |st, r: SetReq, now| {
                let done = st
                    .set(&r.key, &r.value, r.flags, expiry(r.ttl, now), r.cond, now)
                    .map_err(|e| e.to_string())?;
                let placed = done.entry.map(|e| Placed {
                    offset: e.offset,
                    len: e.len,
                    version: e.version,
                });
                let old = done.old.filter(|_| r.want_old).map(ByteBuf::from);
                Ok::<SetResp, _>((done.stored, old, placed))
            }),
        )
        .method(
            "del",
            on_store(s, |st, k: Vec<ByteBuf>, now| Ok(st.del(&keys(k), now))),
        )
        .method(
            "exists",
            on_store(s, |st, k: Vec<ByteBuf>, now| Ok(st.exists(&keys(k), now))),
        )
        .method(
            "incr",
            on_store(s, |st, (k, d): (ByteBuf, i64), now| {
                st.incr(&k, d, now).map_err(|e| e.to_string())
            }),
        )
        .method(
            "expire",
            // Milliseconds from now; `None` removes the expiry; <= 0 deletes.
            on_store(s, |st, (k, ms): (ByteBuf, Option<i64>), now| {
                let at = ms.map(|ms| {
                    if ms <= 0 {
                        now
                    } else {
                        now.saturating_add(ms as u64)
                    }
                });
                Ok(st.expire(&k, at, now))
            }),
        )
        .method(
            "pttl",
            on_store(s, |st, k: ByteBuf, now| Ok(st.pttl(&k, now))),
        )
        .method(
            "touch",
            on_store(s, |st, k: Vec<ByteBuf>, now| Ok(st.touch(&keys(k), now))),
        )
        .method(
            "flush",
            on_store(s, |st, (), _| {
                st.flush();
                Ok(())
            }),
        )
        .method("dbsize", on_store(s, |st, (), _| Ok(st.items())))
        .method(
            "stats",
            on_store(s, |st, (), _| {
                let c = st.counters();
                Ok(NodeStats {
                    cpu_seconds: process_cpu_seconds(),
                    items: st.items(),
                    rpc_gets: c.rpc_hits.load(Ordering::Relaxed)
                        + c.rpc_misses.load(Ordering::Relaxed),
                    one_sided_reads: rdmx_core::stats::global().snapshot().remote_ops_served,
                })
            }),
        )
}
