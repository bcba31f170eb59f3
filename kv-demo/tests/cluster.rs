//! The cache end to end, over TCP and soft RoCE: nodes, the cluster client,
//! one-sided GETs, the torn-read hammer, eviction under a small cap, TTL,
//! INCR atomicity across clients, and a node killed and restarted.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmx_core::{Options, Transports};
use rdmx_kv::{Client, ClientConfig, Cond, GetPath, Node, Ttl};
use tokio::task::JoinHandle;

fn transports() -> Transports {
    Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new())
}

struct Running {
    url: String,
    node: Arc<Node>,
    task: JoinHandle<()>,
}

impl Running {
    /// Kill: stop serving and drop every connection at once.
    fn kill(self) {
        self.task.abort();
    }
}

async fn start(scheme: &str, addr: &str, memory: u64) -> Running {
    let (node, listener) = Node::listen(
        &transports(),
        &format!("{scheme}://{addr}"),
        memory,
        Options::default(),
    )
    .await
    .unwrap();
    assert_eq!(listener.fallback_reason(), None);
    let url = format!("{scheme}://{}", listener.local_addr());
    let n = node.clone();
    let task = tokio::spawn(async move {
        let _ = n.serve(listener).await;
    });
    Running { url, node, task }
}

async fn client(urls: &[&str]) -> Client {
    let c = Client::with_transports(
        ClientConfig::new(urls.iter().map(|s| s.to_string()).collect()),
        transports(),
    )
    .await;
    assert_eq!(c.nodes_up().len(), urls.len());
    c
}

/// A value derived from a counter, whose size and content check themselves:
/// 8 bytes of counter, then bytes that depend on it.
fn self_checking(n: u64) -> Vec<u8> {
    let len = 8 + (n * 7919 % 3000) as usize;
    let mut v = n.to_le_bytes().to_vec();
    v.extend((8..len).map(|i| (n as usize * 31 + i) as u8));
    v
}

fn check_self(v: &[u8]) -> u64 {
    let n = u64::from_le_bytes(v[..8].try_into().unwrap());
    assert_eq!(v, &self_checking(n)[..], "torn value");
    n
}

fn cnt_reads(c: &Client) -> u64 {
    c.counters().one_sided_reads.load(Ordering::Relaxed)
}

async fn basics(scheme: &str) {
    let a = start(scheme, "127.0.0.1:0", 16 << 20).await;
    let b = start(scheme, "127.0.0.1:0", 16 << 20).await;
    let c = client(&[&a.url, &b.url]).await;
    for i in 0..200u32 {
        let k = format!("key:{i}");
        assert!(c
            .set(
                k.as_bytes(),
                &self_checking(i as u64),
                Ttl::Never,
                Cond::Always
            )
            .await
            .unwrap());
    }
    // The SETs told the client where each item is: every GET is one READ.
    let reads = || cnt_reads(&c);
    let reads0 = reads();
    for i in 0..200u32 {
        let k = format!("key:{i}");
        let v = c.get(k.as_bytes()).await.unwrap().expect("hit");
        assert_eq!(
            reads() - reads0,
            u64::from(i) + 1,
            "a remembered GET is one READ"
        );
        assert_eq!(check_self(&v), i as u64);
        let r = c
            .get_with(k.as_bytes(), GetPath::Rpc)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(r, v);
    }
    // A key never seen: its index bucket, nothing more.
    let before = reads();
    assert_eq!(c.get(b"absent").await.unwrap(), None);
    assert_eq!(reads() - before, 1);
    let cnt = c.counters();
    assert_eq!(cnt.one_sided_hits.load(Ordering::Relaxed), 200);
    assert_eq!(cnt.rpc_hits.load(Ordering::Relaxed), 200);
    assert_eq!(cnt.one_sided_misses.load(Ordering::Relaxed), 1);
    // Both nodes hold keys.
    assert_eq!(c.dbsize().await.unwrap(), 200);
    // MGET across both nodes: remembered keys one READ each, the absent
    // one its bucket.
    let mut keys: Vec<Vec<u8>> = (0..10).map(|i| format!("key:{i}").into_bytes()).collect();
    keys.push(b"absent".to_vec());
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let before = reads();
    let mut got = c.mget(&refs, GetPath::OneSided).await;
    assert_eq!(reads() - before, 11);
    assert_eq!(got.pop().unwrap().unwrap(), None);
    for (i, g) in got.into_iter().enumerate() {
        assert_eq!(check_self(&g.unwrap().unwrap()), i as u64);
    }
    // Another client moves key:3 (a new item of another size): the place
    // this client remembers fails verification in the MGET's batch, and the
    // key takes the single-key path (its bucket, then the new item).
    let other = client(&[&a.url, &b.url]).await;
    assert!(other
        .set(b"key:3", b"moved", Ttl::Never, Cond::Always)
        .await
        .unwrap());
    let before = reads();
    let got = c.mget(&[&b"key:3"[..], b"key:4"], GetPath::OneSided).await;
    assert_eq!(&got[0].as_ref().unwrap().as_ref().unwrap()[..], b"moved");
    assert_eq!(check_self(got[1].as_ref().unwrap().as_ref().unwrap()), 4);
    assert_eq!(
        reads() - before,
        4,
        "two in the batch, then bucket and item"
    );
    assert_eq!(
        c.exists(&[&b"key:1"[..], b"key:1", b"nope"]).await.unwrap(),
        2
    );
    assert_eq!(c.del(&[&b"key:1"[..], b"nope"]).await.unwrap(), 1);
    assert_eq!(c.get(b"key:1").await.unwrap(), None);
    // NX / XX and the previous value.
    assert!(!c
        .set(b"key:2", b"x", Ttl::Never, Cond::IfAbsent)
        .await
        .unwrap());
    let (ok, old) = c
        .set_get(b"key:2", b"new", Ttl::Never, Cond::IfPresent)
        .await
        .unwrap();
    assert!(ok);
    assert_eq!(check_self(&old.unwrap()), 2);
    assert_eq!(&c.get(b"key:2").await.unwrap().unwrap()[..], b"new");
    // Too large: refused with the limit, nothing stored.
    let huge = vec![0u8; 2 << 20];
    let e = c
        .set(b"huge", &huge, Ttl::Never, Cond::Always)
        .await
        .unwrap_err();
    assert!(e.to_string().contains("too large"), "{e}");
    assert_eq!(c.get(b"huge").await.unwrap(), None);
    c.flush().await.unwrap();
    assert_eq!(c.dbsize().await.unwrap(), 0);
    a.kill();
    b.kill();
}

/// Writers overwrite a few keys with self-checking values while readers GET
/// one-sidedly: never a torn value, never another key's, and never older
/// than the last value the reader itself saw (per key, values only move
/// forward, so a reader is stale by at most the writes racing its read).
async fn torn_read_hammer(scheme: &str) {
    let n = start(scheme, "127.0.0.1:0", 16 << 20).await;
    let c = client(&[&n.url]).await;
    let keys = 4u64;
    for k in 0..keys {
        c.set(
            format!("h{k}").as_bytes(),
            &self_checking(k),
            Ttl::Never,
            Cond::Always,
        )
        .await
        .unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut tasks = Vec::new();
    // Writer w owns keys w and w + 2, so each key's counter only grows.
    for w in 0..2u64 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut step = 1u64;
            let mut writes = 0u64;
            while Instant::now() < deadline {
                for k in [w, w + 2] {
                    let v = k + keys * step;
                    c.set(
                        format!("h{k}").as_bytes(),
                        &self_checking(v),
                        Ttl::Never,
                        Cond::Always,
                    )
                    .await
                    .unwrap();
                    writes += 1;
                }
                step += 1;
            }
            (writes, 0u64)
        }));
    }
    for _ in 0..3 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            let mut last = vec![0u64; keys as usize];
            let mut reads = 0u64;
            while Instant::now() < deadline {
                for k in 0..keys {
                    let v = c
                        .get(format!("h{k}").as_bytes())
                        .await
                        .unwrap()
                        .expect("always present");
                    let n = check_self(&v);
                    assert_eq!(n % keys, k, "another key's value");
                    assert!(
                        n >= last[k as usize],
                        "went back from {} to {n}",
                        last[k as usize]
                    );
                    reads += 1;
                    last[k as usize] = n;
                }
            }
            (0u64, reads)
        }));
    }
    let mut writes = 0;
    let mut reads = 0;
    for t in tasks {
        let (w, r) = t.await.unwrap();
        writes += w;
        reads += r;
    }
    let cnt = c.counters();
    eprintln!(
        "{scheme}: {writes} writes, {reads} one-sided reads, {} retries, {} RPC fallbacks",
        cnt.one_sided_retries.load(Ordering::Relaxed),
        cnt.one_sided_fallbacks.load(Ordering::Relaxed)
    );
    assert!(
        writes > 100 && reads > 100,
        "{writes} writes, {reads} reads"
    );
    n.kill();
}

/// INCR from many clients at once: the exact total.
async fn incr_is_atomic(scheme: &str) {
    let n = start(scheme, "127.0.0.1:0", 8 << 20).await;
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let c = client(&[&n.url]).await;
        tasks.push(tokio::spawn(async move {
            for _ in 0..250 {
                c.incr(b"counter", 3).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let c = client(&[&n.url]).await;
    assert_eq!(&c.get(b"counter").await.unwrap().unwrap()[..], b"6000");
    assert_eq!(c.incr(b"counter", -6000).await.unwrap(), 0);
    c.set(b"text", b"abc", Ttl::Never, Cond::Always)
        .await
        .unwrap();
    let e = c.incr(b"text", 1).await.unwrap_err();
    assert_eq!(e.to_string(), "value is not an integer or out of range");
    n.kill();
}

/// Items expire for one-sided and RPC readers alike; TTLs count down.
async fn ttl_expiry(scheme: &str) {
    let n = start(scheme, "127.0.0.1:0", 8 << 20).await;
    let c = client(&[&n.url]).await;
    c.set(b"brief", b"v", Ttl::In(300), Cond::Always)
        .await
        .unwrap();
    c.set(b"long", b"v", Ttl::In(60_000), Cond::Always)
        .await
        .unwrap();
    let p = c.pttl(b"brief").await.unwrap();
    assert!((1..=300).contains(&p), "{p}");
    assert!(c.get(b"brief").await.unwrap().is_some());
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(
        c.get(b"brief").await.unwrap(),
        None,
        "one-sided sees it expired"
    );
    assert_eq!(c.get_with(b"brief", GetPath::Rpc).await.unwrap(), None);
    assert_eq!(c.pttl(b"brief").await.unwrap(), -2);
    assert!(c.get(b"long").await.unwrap().is_some());
    assert!(
        c.expire(b"long", Some(0)).await.unwrap(),
        "expire in the past deletes"
    );
    assert_eq!(c.get(b"long").await.unwrap(), None);
    n.kill();
}

/// A data set ten times the memory cap: every SET succeeds, memory stays
/// fixed, recent keys hit.
async fn eviction_under_a_small_cap(scheme: &str) {
    let n = start(scheme, "127.0.0.1:0", 4 << 20).await;
    let c = client(&[&n.url]).await;
    let value = vec![7u8; 1000];
    for i in 0..40_000u32 {
        c.set(format!("e{i}").as_bytes(), &value, Ttl::Never, Cond::Always)
            .await
            .unwrap();
    }
    let mut hits = 0;
    for i in 39_000..40_000u32 {
        if c.get(format!("e{i}").as_bytes()).await.unwrap().is_some() {
            hits += 1;
        }
    }
    let mut text = String::new();
    n.node.metrics(&mut text);
    eprintln!("{scheme}: hit ratio of the last 1000 keys {}%", hits / 10);
    assert!(text.contains("rdmx_kv_memory_bytes 4"), "{text}");
    assert!(hits > 500, "{hits}");
    let evictions: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("rdmx_kv_evictions_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(evictions > 30_000, "{evictions}");
    n.kill();
}

/// A node dies mid-run: its in-flight operations fail, then its keys go to
/// the other node (misses, not errors); it restarts on the same address and
/// is taken back with its new region keys.
async fn node_killed_and_restarted(scheme: &str) {
    let a = start(scheme, "127.0.0.1:0", 8 << 20).await;
    let b = start(scheme, "127.0.0.1:0", 8 << 20).await;
    let a_addr = a.url.split("://").nth(1).unwrap().to_string();
    let c = client(&[&a.url, &b.url]).await;
    for i in 0..100u32 {
        c.set(format!("k{i}").as_bytes(), b"v", Ttl::Never, Cond::Always)
            .await
            .unwrap();
    }
    let a_url = a.url.clone();
    a.kill();
    let t = Instant::now();
    // An MGET's batch to the dead node fails its keys at once and marks the
    // node down; the next MGET answers every key (the dead node's as misses).
    // The kill takes effect as the aborted tasks are dropped: until then the
    // node's transport may still serve reads, and an MGET succeeds whole.
    let keys: Vec<Vec<u8>> = (0..100u32).map(|i| format!("k{i}").into_bytes()).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    let first = loop {
        let got = c.mget(&refs, GetPath::OneSided).await;
        if got.iter().any(|r| r.is_err()) {
            break got;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "reads never failed");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let failed = first.iter().filter(|r| r.is_err()).count();
    assert!(failed > 10, "the dead node's keys fail ({failed})");
    for r in first.iter().filter_map(|r| r.as_ref().ok()) {
        assert_eq!(&r.as_ref().expect("the live node's keys hit")[..], b"v");
    }
    assert_eq!(c.nodes_up(), vec![b.url.clone()]);
    let second = c.mget(&refs, GetPath::OneSided).await;
    let misses = second
        .iter()
        .filter(|r| r.as_ref().unwrap().is_none())
        .count();
    assert_eq!(misses, failed, "the dead node's keys are misses now");
    // Whatever was in flight may fail; after that every call answers.
    let mut errors = 0;
    let mut misses = 0;
    for i in 0..100u32 {
        match c.get(format!("k{i}").as_bytes()).await {
            Ok(Some(_)) => {}
            Ok(None) => misses += 1,
            Err(_) => errors += 1,
        }
    }
    assert!(errors <= 2, "{errors} errors after the node died");
    assert!(
        misses > 10,
        "the dead node's keys are misses now ({misses})"
    );
    assert_eq!(c.nodes_up(), vec![b.url.clone()]);
    for i in 0..100u32 {
        c.set(format!("k{i}").as_bytes(), b"w", Ttl::Never, Cond::Always)
            .await
            .unwrap();
        assert_eq!(
            &c.get(format!("k{i}").as_bytes()).await.unwrap().unwrap()[..],
            b"w"
        );
    }
    // Restart on the same address; the client takes it back.
    let a2 = start(scheme, &a_addr, 8 << 20).await;
    assert_eq!(a2.url, a_url);
    while c.nodes_up().len() < 2 {
        assert!(t.elapsed() < Duration::from_secs(20), "node not taken back");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for i in 0..100u32 {
        c.set(format!("k{i}").as_bytes(), b"x", Ttl::Never, Cond::Always)
            .await
            .unwrap();
        assert_eq!(
            &c.get(format!("k{i}").as_bytes()).await.unwrap().unwrap()[..],
            b"x"
        );
    }
    assert!(c.counters().nodes_back.load(Ordering::Relaxed) >= 1);
    a2.kill();
    b.kill();
}

macro_rules! over {
    ($m:ident, $scheme:expr) => {
        mod $m {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn basics() {
                super::basics($scheme).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn torn_read_hammer() {
                super::torn_read_hammer($scheme).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn incr_is_atomic() {
                super::incr_is_atomic($scheme).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn ttl_expiry() {
                super::ttl_expiry($scheme).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn eviction_under_a_small_cap() {
                super::eviction_under_a_small_cap($scheme).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn node_killed_and_restarted() {
                super::node_killed_and_restarted($scheme).await;
            }
        }
    };
}

over!(tcp, "tcp");
over!(soft_roce, "rdma");
