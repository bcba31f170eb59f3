//! # rdmx-conformance
//!
//! One suite, generic over [`rdmx_core::Transport`], that every transport (TCP,
//! soft RoCE, hardware RDMA) must pass unchanged. A transport crate runs it with
//!
//! ```ignore
//! rdmx_conformance::conformance_tests!(Suite::new(Arc::new(MyTransport::new()), "127.0.0.1:0"));
//! ```
//!
//! which expands to one `#[tokio::test]` per case. Every case asserts on data
//! (exact bytes, hashes, exact totals), not only on `Ok`.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::future::IntoFuture;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use rdmx_core::{
    Access, AccessError, Connection, Error, Incoming, Listener, Options, RemoteRegion, Transport,
    WriteThenSend,
};
use sha2::{Digest, Sha256};

/// How many 16 MiB operations [`Suite::large_transfer`] keeps in flight:
/// enough to keep four lanes busy, few enough that the last one issued
/// finishes within its deadline on a slow device.
pub const LARGE_WINDOW: usize = 4;

/// A transport under test and where its listeners bind.
#[derive(Clone)]
pub struct Suite {
    /// The transport.
    pub transport: Arc<dyn Transport>,
    /// Listen address (`host:0` picks a free port).
    pub listen_addr: String,
}

/// A connected pair: `client` connected to `server`, whose domain is `server_opts.domain`.
pub struct Pair {
    /// Active side.
    pub client: Connection,
    /// Passive side.
    pub server: Connection,
    /// Options the client used.
    pub client_opts: Options,
    /// Options the server used (its domain serves the client's one-sided ops).
    pub server_opts: Options,
    /// The listener, kept so more clients can connect.
    pub listener: Listener,
}

/// Deterministic pseudo-random bytes (splitmix64), so failures reproduce.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ len as u64;
    while out.len() < len {
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        out.extend_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Poll a future exactly once (so it starts), whatever it returns.
async fn poll_once<F: std::future::Future>(mut f: std::pin::Pin<&mut F>) {
    std::future::poll_fn(|cx| {
        let _ = f.as_mut().poll(cx);
        std::task::Poll::Ready(())
    })
    .await
}

fn sha(b: &[u8]) -> [u8; 32] {
    Sha256::digest(b).into()
}

/// The timer of the TCP socket from `local` to `peer` as Linux shows it in
/// `/proc/net/tcp` or `/proc/net/tcp6` ("tr:tm->when": which timer is armed,
/// and when it is due in USER_HZ ticks), or `None` if no such socket is listed.
fn tcp_timer(local: SocketAddr, peer: SocketAddr) -> Option<(u8, u64)> {
    let (l, r) = (proc_net_addrs(local), proc_net_addrs(peer));
    for file in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 6 || !l.iter().any(|a| a == f[1]) || !r.iter().any(|a| a == f[2]) {
                continue;
            }
            let (tr, when) = f[5].split_once(':')?;
            return Some((
                u8::from_str_radix(tr, 16).ok()?,
                u64::from_str_radix(when, 16).ok()?,
            ));
        }
    }
    None
}

/// The ways `/proc/net/tcp{,6}` may print `a`: each 32-bit word of the
/// address in host byte order in hex, then the port in hex; an IPv4 address
/// also as IPv4-mapped IPv6 (a dual-stack socket's).
fn proc_net_addrs(a: SocketAddr) -> Vec<String> {
    let words = |b: &[u8]| -> String {
        b.chunks(4)
            .map(|w| format!("{:08X}", u32::from_ne_bytes([w[0], w[1], w[2], w[3]])))
            .collect()
    };
    let port = a.port();
    match a.ip() {
        IpAddr::V4(v4) => vec![
            format!("{}:{port:04X}", words(&v4.octets())),
            format!("{}:{port:04X}", words(&v4.to_ipv6_mapped().octets())),
        ],
        IpAddr::V6(v6) => vec![format!("{}:{port:04X}", words(&v6.octets()))],
    }
}

fn denied(r: rdmx_core::Result<impl std::fmt::Debug>) -> AccessError {
    match r {
        Err(Error::RemoteAccess(a)) => a,
        other => panic!("expected a remote access error, got {other:?}"),
    }
}

impl Suite {
    /// A suite for `transport`, listening on `listen_addr`. With
    /// `RDMX_TEST_LOG` set (a `tracing` filter such as `rdmx_transport_rdma=debug`),
    /// the transports' log is printed with each case's output.
    pub fn new(transport: Arc<dyn Transport>, listen_addr: &str) -> Suite {
        if let Ok(filter) = std::env::var("RDMX_TEST_LOG") {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
                .with_test_writer()
                .try_init();
        }
        Suite {
            transport,
            listen_addr: listen_addr.to_string(),
        }
    }

    /// Connect a client to a fresh listener.
    pub async fn pair_with(&self, client_opts: Options, server_opts: Options) -> Pair {
        let mut listener = self
            .transport
            .listen(&self.listen_addr, &server_opts)
            .await
            .expect("listen");
        let addr = listener.local_addr().to_string();
        let (client, server) = tokio::join!(
            self.transport.connect(&addr, &client_opts),
            listener.accept()
        );
        let client = client.expect("connect");
        let server = server.expect("accept");
        assert_eq!(client.transport(), self.transport.name());
        assert_eq!(server.transport(), self.transport.name());
        assert_eq!(client.fallback_reason(), None);
        Pair {
            client,
            server,
            client_opts,
            server_opts,
            listener,
        }
    }

    /// A pair with default options.
    pub async fn pair(&self) -> Pair {
        self.pair_with(Options::default(), Options::default()).await
    }

    /// Another client to `pair`'s listener (accepted on the server side too).
    pub async fn another_client(&self, pair: &mut Pair) -> (Connection, Connection) {
        let addr = pair.listener.local_addr().to_string();
        let (c, s) = tokio::join!(
            self.transport.connect(&addr, &Options::default()),
            pair.listener.accept()
        );
        (c.expect("connect"), s.expect("accept"))
    }

    /// Messages keep order and boundaries from 0 B to 16 MiB; a message larger
    /// than the peer accepts fails clearly and the connection stays usable.
    pub async fn message_order_and_boundaries(&self) {
        let p = self.pair().await;
        let sizes = [
            0usize,
            1,
            7,
            8,
            63,
            4095,
            4096,
            4097,
            65_537,
            1 << 20,
            3 << 20,
            16 << 20,
        ];
        let sender = {
            let c = p.client.clone();
            tokio::spawn(async move {
                for (i, &n) in sizes.iter().enumerate() {
                    c.send(pattern(i as u64, n)).await.expect("send");
                }
            })
        };
        for (i, &n) in sizes.iter().enumerate() {
            let m = p.server.recv_message().await.expect("recv");
            assert_eq!(m.len(), n, "message {i} size");
            assert_eq!(sha(&m), sha(&pattern(i as u64, n)), "message {i} bytes");
        }
        sender.await.unwrap();
        // Many small messages from several tasks: each task's order is kept.
        let mut tasks = Vec::new();
        for t in 0..4u8 {
            let c = p.client.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..500u32 {
                    let mut m = vec![t];
                    m.extend_from_slice(&i.to_le_bytes());
                    c.send(m).await.expect("send");
                }
            }));
        }
        let mut next = [0u32; 4];
        for _ in 0..2000 {
            let m = p.server.recv_message().await.unwrap();
            assert_eq!(m.len(), 5);
            let t = m[0] as usize;
            assert_eq!(u32::from_le_bytes(m[1..5].try_into().unwrap()), next[t]);
            next[t] += 1;
        }
        for t in tasks {
            t.await.unwrap();
        }
        let too_big = p.client.capabilities().max_message_size as usize + 1;
        match p.client.send(vec![0u8; too_big]).await {
            Err(Error::ResourceExhausted(_)) => {}
            other => panic!("oversized message: {other:?}"),
        }
        p.client.send(&b"still fine"[..]).await.unwrap();
        assert_eq!(&p.server.recv_message().await.unwrap()[..], b"still fine");
        // send_many: batches (of more messages than the receive credits, so
        // a batch waits for credits part-way) arrive in order, each message
        // whole, counted one send each.
        let sends_before = p.client.stats().sends;
        let batches: Vec<Vec<Bytes>> = (0..4u64)
            .map(|b| {
                (0..300u64)
                    .map(|i| {
                        Bytes::from(pattern(b * 1000 + i, ((b * 300 + i) * 13 % 5000) as usize))
                    })
                    .collect()
            })
            .collect();
        let sender = {
            let c = p.client.clone();
            let batches = batches.clone();
            tokio::spawn(async move {
                for b in batches {
                    c.send_many(b).await.expect("send_many");
                }
            })
        };
        for (b, batch) in batches.iter().enumerate() {
            for (i, want) in batch.iter().enumerate() {
                let m = p.server.recv_message().await.expect("recv");
                assert_eq!(sha(&m), sha(want), "batch {b} message {i}");
            }
        }
        sender.await.unwrap();
        assert_eq!(p.client.stats().sends - sends_before, 4 * 300);
        match p
            .client
            .send_many(vec![Bytes::new(), vec![0u8; too_big].into()])
            .await
        {
            Err(Error::ResourceExhausted(_)) => {}
            other => panic!("oversized message in a batch: {other:?}"),
        }
        // post_send (done when posted, not when acknowledged) keeps its
        // place among sends, through more messages than the receive credits
        // (so posting waits for credits part-way), each whole.
        let sends_before = p.client.stats().sends;
        let sender = {
            let c = p.client.clone();
            tokio::spawn(async move {
                for i in 0..600u64 {
                    let m = pattern(50_000 + i, (i * 37 % 9000) as usize);
                    if i % 3 == 0 {
                        c.send(m).await.expect("send");
                    } else {
                        c.post_send(m).await.expect("post_send");
                    }
                }
            })
        };
        for i in 0..600u64 {
            let m = p.server.recv_message().await.expect("recv");
            let want = pattern(50_000 + i, (i * 37 % 9000) as usize);
            assert_eq!(sha(&m), sha(&want), "posted message {i}");
        }
        sender.await.unwrap();
        assert_eq!(p.client.stats().sends - sends_before, 600);
        match p.client.post_send(vec![0u8; too_big]).await {
            Err(Error::ResourceExhausted(_)) => {}
            other => panic!("oversized posted message: {other:?}"),
        }
    }

    /// Reads and writes at region edges, unaligned, zero-length, last byte;
    /// through `Bytes` and through local registered slices.
    pub async fn read_write_edges(&self) {
        let p = self.pair().await;
        let mr = p
            .server_opts
            .domain
            .register(4096, Access::REMOTE_READ | Access::REMOTE_WRITE);
        let r = mr.remote();
        let mut model = vec![0u8; 4096];
        let cases: [(u64, usize); 7] = [
            (0, 1),
            (4095, 1),
            (3, 13),
            (0, 4096),
            (1000, 0),
            (4096, 0),
            (2047, 1025),
        ];
        for (i, &(off, len)) in cases.iter().enumerate() {
            let data = pattern(100 + i as u64, len);
            let dst = r.slice(off, len as u64).unwrap();
            p.client.write(data.clone(), dst).await.unwrap();
            model[off as usize..off as usize + len].copy_from_slice(&data);
            assert_eq!(&mr.read()[..], &model[..], "after write {off}+{len}");
            let back = p.client.read(dst).await.unwrap();
            assert_eq!(&back[..], &data[..], "read back {off}+{len}");
        }
        // Local registered slices as source and destination.
        let local = p.client_opts.domain.register(4096, Access::LOCAL);
        local.write()[..100].copy_from_slice(&pattern(7, 100));
        p.client
            .write_from(local.slice(0, 100).unwrap(), r.slice(3996, 100).unwrap())
            .await
            .unwrap();
        assert_eq!(&mr.read()[3996..], &pattern(7, 100)[..]);
        p.client
            .read_into(r.slice(0, 4096).unwrap(), local.slice(0, 4096).unwrap())
            .await
            .unwrap();
        assert_eq!(&local.read()[..], &mr.read()[..]);
        // Large reads into registered slices (where a transport receives
        // straight into the slice), unaligned, around its size thresholds
        // and over several pieces: every byte of the slice exact, every byte
        // around it untouched.
        const BIG: usize = (4 << 20) + 8192;
        let big = p
            .server_opts
            .domain
            .register_from(&pattern(11, BIG), Access::REMOTE_READ);
        let br = big.remote();
        let sink = p.client_opts.domain.register(BIG + 64, Access::LOCAL);
        for (i, &(at, size)) in [
            (5usize, 65_535usize),
            (0, 65_536),
            (4097, 65_537),
            (17, 300_001),
            (3, 1 << 20),
            (0, 4 << 20),
            (1, (4 << 20) + 4097),
        ]
        .iter()
        .enumerate()
        {
            sink.write().fill(0xEE);
            p.client
                .read_into(
                    br.slice(at as u64, size as u64).unwrap(),
                    sink.slice(32, size).unwrap(),
                )
                .await
                .unwrap_or_else(|e| panic!("read_into #{i} of {size} bytes: {e}"));
            let got = sink.read();
            assert!(
                got[32..32 + size] == big.read()[at..at + size],
                "read_into #{i} of {size} bytes at {at}: wrong bytes"
            );
            assert!(
                got[..32]
                    .iter()
                    .chain(&got[32 + size..])
                    .all(|&b| b == 0xEE),
                "read_into #{i} of {size} bytes wrote outside its slice"
            );
        }
        // Eight at once into neighbouring slices of one region.
        sink.write().fill(0);
        let reads = (0..8usize).map(|k| {
            p.client.read_into(
                br.slice((k * 131_075) as u64, 131_072).unwrap(),
                sink.slice(k * 131_072, 131_072).unwrap(),
            )
        });
        for r in futures_util::future::join_all(reads.map(IntoFuture::into_future)).await {
            r.unwrap();
        }
        for k in 0..8usize {
            assert!(
                sink.read()[k * 131_072..(k + 1) * 131_072]
                    == big.read()[k * 131_075..k * 131_075 + 131_072],
                "concurrent read_into #{k}: wrong bytes"
            );
        }
        // Length mismatches are refused locally.
        assert!(matches!(
            p.client.write(vec![1u8; 3], r.slice(0, 4).unwrap()).await,
            Err(Error::InvalidArgument(_))
        ));
    }

    /// `read_many`: every range's bytes in the order asked (small, empty,
    /// unaligned, the region's last byte, and a batch beyond what the
    /// connection keeps in flight and of reads larger than one piece); one
    /// bad range fails the batch and leaves the connection usable; a
    /// dropped batch leaves it usable too; each read counts once.
    pub async fn read_many(&self) {
        let p = self.pair().await;
        let size = 3 << 20;
        let mr = p
            .server_opts
            .domain
            .register_from(&pattern(41, size), Access::REMOTE_READ);
        let r = mr.remote();
        let want = pattern(41, size);
        let check = |ranges: &[(u64, u64)], got: Vec<Bytes>| {
            assert_eq!(got.len(), ranges.len(), "one answer per range");
            for (i, (&(off, len), g)) in ranges.iter().zip(&got).enumerate() {
                let w = &want[off as usize..(off + len) as usize];
                assert_eq!(sha(g), sha(w), "range {i} ({off}+{len})");
            }
        };
        let slices = |ranges: &[(u64, u64)]| -> Vec<RemoteRegion> {
            ranges
                .iter()
                .map(|&(o, l)| r.slice(o, l).unwrap())
                .collect()
        };
        // Small reads, the shape of a multi-key GET.
        let small: Vec<(u64, u64)> = (0..100u64)
            .map(|i| ((i * 7919) % (size as u64 - 300), 1 + (i * 37) % 300))
            .chain([(0, 0), (size as u64 - 1, 1), (13, 4096)])
            .collect();
        let reads_before = p.client.stats().reads;
        check(&small, p.client.read_many(slices(&small)).await.unwrap());
        assert_eq!(p.client.stats().reads - reads_before, small.len() as u64);
        // More reads than the connection keeps in flight.
        let cap = p.client.info().capabilities.max_inflight as u64;
        let many: Vec<(u64, u64)> = (0..cap + 9)
            .map(|i| ((i * 4099) % (size as u64 - 64), 64))
            .collect();
        check(&many, p.client.read_many(slices(&many)).await.unwrap());
        // Large reads (several pieces, several packets) among small ones.
        let large = [(5, 1 << 20), (1, 1), ((1 << 20) + 3, (2 << 20) - 9), (0, 8)];
        check(&large, p.client.read_many(slices(&large)).await.unwrap());
        assert!(p.client.read_many(Vec::new()).await.unwrap().is_empty());
        // A bad range in the middle fails the batch with its own error.
        let mut bad = slices(&small[..5]);
        bad.insert(
            2,
            RemoteRegion {
                rkey: r.rkey ^ 0x5a5a_5a5a,
                ..r.slice(0, 8).unwrap()
            },
        );
        assert_eq!(
            denied(p.client.read_many(bad).await),
            AccessError::UnknownKey
        );
        let past = vec![
            r.slice(0, 8).unwrap(),
            RemoteRegion {
                len: size as u64 + 1,
                ..r
            },
        ];
        assert_eq!(
            denied(p.client.read_many(past).await),
            AccessError::OutOfBounds
        );
        // A batch dropped while in flight: the connection carries on.
        let dropped = p.client.read_many(slices(&many));
        let _ = tokio::time::timeout(Duration::from_micros(1), dropped.into_future()).await;
        check(&small, p.client.read_many(slices(&small)).await.unwrap());
    }

    /// Every access violation kind is reported as such, stores nothing, and
    /// leaves the connection usable.
    pub async fn access_violations(&self) {
        let p = self.pair().await;
        let d = &p.server_opts.domain;
        let ro = d.register_from(&pattern(1, 256), Access::REMOTE_READ);
        let wo = d.register(256, Access::REMOTE_WRITE);
        let rw = d.register(
            256,
            Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
        );
        let c = &p.client;
        let before = (sha(&ro.read()), sha(&wo.read()), sha(&rw.read()));

        let bogus = RemoteRegion {
            rkey: ro.rkey() ^ 0x5a5a_5a5a,
            ..ro.remote()
        };
        assert_eq!(
            denied(c.read(bogus.slice(0, 8).unwrap()).await),
            AccessError::UnknownKey
        );
        assert_eq!(
            denied(c.write(vec![1; 8], bogus.slice(0, 8).unwrap()).await),
            AccessError::UnknownKey
        );
        assert_eq!(
            denied(c.fetch_and_add(bogus.word(0).unwrap(), 1).await),
            AccessError::UnknownKey
        );

        let past = RemoteRegion {
            len: 257,
            ..rw.remote()
        };
        assert_eq!(denied(c.read(past).await), AccessError::OutOfBounds);
        assert_eq!(
            denied(c.write(vec![9; 257], past).await),
            AccessError::OutOfBounds
        );
        let before_start = RemoteRegion {
            addr: rw.remote().addr - 8,
            len: 8,
            ..rw.remote()
        };
        assert_eq!(denied(c.read(before_start).await), AccessError::OutOfBounds);
        let beyond = RemoteRegion {
            addr: rw.remote().addr + 256,
            len: 8,
            ..rw.remote()
        };
        assert_eq!(
            denied(c.fetch_and_add(beyond, 1).await),
            AccessError::OutOfBounds
        );
        assert_eq!(
            denied(
                c.compare_and_swap(
                    RemoteRegion {
                        addr: rw.remote().addr + 4,
                        len: 8,
                        ..rw.remote()
                    },
                    0,
                    1
                )
                .await
            ),
            AccessError::Misaligned
        );

        assert_eq!(
            denied(c.write(vec![1; 8], ro.remote().slice(0, 8).unwrap()).await),
            AccessError::Permission
        );
        assert_eq!(
            denied(c.fetch_and_add(ro.remote().word(0).unwrap(), 1).await),
            AccessError::Permission
        );
        assert_eq!(
            denied(c.read(wo.remote().slice(0, 8).unwrap()).await),
            AccessError::Permission
        );
        assert_eq!(
            denied(c.compare_and_swap(wo.remote().word(8).unwrap(), 0, 1).await),
            AccessError::Permission
        );

        assert_eq!(
            (sha(&ro.read()), sha(&wo.read()), sha(&rw.read())),
            before,
            "a refused access stored data"
        );

        let gone = d.register(64, Access::ALL);
        let gone_r = gone.remote();
        c.write(vec![3; 64], gone_r).await.unwrap();
        gone.deregister();
        assert_eq!(denied(c.read(gone_r).await), AccessError::Revoked);
        assert_eq!(
            denied(c.write(vec![4; 64], gone_r).await),
            AccessError::Revoked
        );
        assert_eq!(
            denied(c.fetch_and_add(gone_r.word(0).unwrap(), 1).await),
            AccessError::Revoked
        );

        // Large refused operations store nothing and leave the stream in sync.
        let big_ro = d.register_from(&pattern(2, 8 << 20), Access::REMOTE_READ);
        let big_before = sha(&big_ro.read());
        let big = pattern(3, 6 << 20);
        assert_eq!(
            denied(
                c.write(
                    big.clone(),
                    big_ro.remote().slice(1 << 20, 6 << 20).unwrap()
                )
                .await
            ),
            AccessError::Permission
        );
        let big_rw = d.register(8 << 20, Access::REMOTE_READ | Access::REMOTE_WRITE);
        let past_end = RemoteRegion {
            addr: big_rw.remote().addr + (4 << 20),
            len: 6 << 20,
            ..big_rw.remote()
        };
        assert_eq!(
            denied(c.write(big.clone(), past_end).await),
            AccessError::OutOfBounds
        );
        assert!(
            big_rw.read().iter().all(|&b| b == 0),
            "a refused large write stored data"
        );
        assert_eq!(sha(&big_ro.read()), big_before);
        c.write(
            big.clone(),
            big_rw.remote().slice(2 << 20, 6 << 20).unwrap(),
        )
        .await
        .unwrap();
        assert_eq!(sha(&big_rw.read()[2 << 20..]), sha(&big));

        // Still usable afterwards, in both directions.
        c.write(vec![7; 16], rw.remote().slice(16, 16).unwrap())
            .await
            .unwrap();
        assert_eq!(&rw.read()[16..32], &[7u8; 16]);
        p.server.send(&b"ok"[..]).await.unwrap();
        assert_eq!(&c.recv_message().await.unwrap()[..], b"ok");
        assert!(p.client.stats().errors >= 15);
    }

    /// N connections × T tasks × M fetch-and-adds give an exact total and every
    /// old value exactly once; a CAS spin lock never loses an update.
    pub async fn atomics_under_contention(&self) {
        const CONNS: usize = 3;
        const TASKS: usize = 4;
        const M: u64 = 150;
        let mut p = self.pair().await;
        let mr = p.server_opts.domain.register(64, Access::ALL);
        let r = mr.remote();
        let mut conns = vec![p.client.clone()];
        let mut keep = Vec::new();
        for _ in 1..CONNS {
            let (c, s) = self.another_client(&mut p).await;
            conns.push(c);
            keep.push(s);
        }
        let counter = r.word(0).unwrap();
        let lock = r.word(8).unwrap();
        let guarded = r.slice(16, 8).unwrap();
        let mut tasks = Vec::new();
        for (ci, c) in conns.iter().enumerate() {
            for t in 0..TASKS {
                let c = c.clone();
                let me = (ci * TASKS + t + 1) as u64;
                tasks.push(tokio::spawn(async move {
                    let mut olds = Vec::new();
                    for _ in 0..M {
                        olds.push(c.fetch_and_add(counter, 1).await.unwrap());
                        // Spin lock: CAS 0 -> me, read-modify-write, CAS me -> 0.
                        while c.compare_and_swap(lock, 0, me).await.unwrap() != 0 {
                            tokio::task::yield_now().await;
                        }
                        let v = u64::from_ne_bytes(
                            c.read(guarded).await.unwrap()[..].try_into().unwrap(),
                        );
                        c.write((v + 1).to_ne_bytes().to_vec(), guarded)
                            .await
                            .unwrap();
                        assert_eq!(
                            c.compare_and_swap(lock, me, 0).await.unwrap(),
                            me,
                            "lock stolen"
                        );
                    }
                    olds
                }));
            }
        }
        let mut seen = HashSet::new();
        for t in tasks {
            for v in t.await.unwrap() {
                assert!(seen.insert(v), "old value {v} returned twice");
            }
        }
        let total = (CONNS * TASKS) as u64 * M;
        assert_eq!(mr.load_u64(0), total);
        assert_eq!(seen, (0..total).collect::<HashSet<_>>());
        assert_eq!(mr.load_u64(8), 0, "lock left held");
        assert_eq!(mr.load_u64(16), total, "CAS lock lost an update");
        // Wrapping add.
        mr.store_u64(24, u64::MAX);
        assert_eq!(
            p.client
                .fetch_and_add(r.word(24).unwrap(), 2)
                .await
                .unwrap(),
            u64::MAX
        );
        assert_eq!(mr.load_u64(24), 1);
    }

    /// A 256 MiB transfer, written and read back, checked by hash, in
    /// 16 MiB operations with [`LARGE_WINDOW`] of them in flight: an
    /// operation's deadline counts from when it is issued, so issuing all
    /// sixteen at once would ask a slow device (rxe in an emulated guest
    /// moves tens of MB/s) to move all 256 MiB within one deadline.
    pub async fn large_transfer(&self) {
        const LEN: usize = 256 << 20;
        const OP: usize = 16 << 20;
        let p = self.pair().await;
        let mr = p
            .server_opts
            .domain
            .register(LEN, Access::REMOTE_READ | Access::REMOTE_WRITE);
        let r = mr.remote();
        let data = Bytes::from(pattern(256, LEN));
        let want = sha(&data);
        let mut writes =
            std::pin::pin!(futures_util::stream::iter((0..LEN).step_by(OP).map(|off| {
                p.client
                    .write(
                        data.slice(off..off + OP),
                        r.slice(off as u64, OP as u64).unwrap(),
                    )
                    .into_future()
            }))
            .buffer_unordered(LARGE_WINDOW));
        while let Some(res) = writes.next().await {
            res.unwrap();
        }
        assert_eq!(
            sha(&mr.read()),
            want,
            "remote region after 256 MiB of writes"
        );
        mr.write()[..8].copy_from_slice(b"modified");
        let mut back = vec![0u8; LEN];
        let mut reads =
            std::pin::pin!(futures_util::stream::iter((0..LEN).step_by(OP).map(|off| {
                let f = p.client.read(r.slice(off as u64, OP as u64).unwrap());
                async move { (off, f.await) }
            }))
            .buffer_unordered(LARGE_WINDOW));
        while let Some((off, res)) = reads.next().await {
            back[off..off + OP].copy_from_slice(&res.unwrap());
        }
        let mut expect = data.to_vec();
        expect[..8].copy_from_slice(b"modified");
        assert_eq!(sha(&back), sha(&expect), "256 MiB read back");
        // One single 64 MiB operation each way, too.
        let one = r.slice(0, 64 << 20).unwrap();
        p.client.write(data.slice(0..64 << 20), one).await.unwrap();
        assert_eq!(
            sha(&p.client.read(one).await.unwrap()),
            sha(&data[..64 << 20])
        );
    }

    /// Over 1,000 operations in flight at once on one connection, all correct.
    pub async fn many_in_flight(&self) {
        const N: usize = 1500;
        let p = self.pair().await;
        let mr = p.server_opts.domain.register(N * 64 + 8, Access::ALL);
        let r = mr.remote();
        let ctr = r.word((N * 64) as u64).unwrap();
        let mut ops = FuturesUnordered::new();
        for i in 0..N {
            let c = p.client.clone();
            ops.push(async move {
                let slot = r.slice((i * 64) as u64, 64).unwrap();
                c.write(pattern(i as u64, 64), slot).await?;
                let back = c.read(slot).await?;
                let old = c.fetch_and_add(ctr, 1).await?;
                Ok::<_, Error>((i, back, old))
            });
        }
        let mut olds = HashSet::new();
        let mut done = 0;
        while let Some(res) = ops.next().await {
            let (i, back, old) = res.unwrap();
            assert_eq!(&back[..], &pattern(i as u64, 64)[..]);
            assert!(olds.insert(old));
            done += 1;
        }
        assert_eq!(done, N);
        assert_eq!(mr.load_u64(N * 64), N as u64);
        for i in 0..N {
            assert_eq!(&mr.read()[i * 64..i * 64 + 64], &pattern(i as u64, 64)[..]);
        }
    }

    /// Killing the peer mid-transfer fails in-flight and later operations with
    /// `Disconnected` well within the deadline; nothing hangs.
    pub async fn peer_killed_mid_transfer(&self) {
        let Pair {
            client,
            server,
            server_opts,
            listener,
            ..
        } = self.pair().await;
        let mr = server_opts.domain.register(64 << 20, Access::ALL);
        let r = mr.remote();
        let data = Bytes::from(pattern(9, 4 << 20));
        let mut ops = FuturesUnordered::new();
        for i in 0..64u64 {
            let dst = r.slice((i % 16) * (4 << 20), 4 << 20).unwrap();
            ops.push(client.write(data.clone(), dst).into_future());
        }
        let recv = tokio::spawn({
            let c = client.clone();
            async move { c.recv().await }
        });
        // Let some of the transfer happen, then kill the peer.
        let first = ops.next().await.expect("one op");
        first.expect("the first write completes before the kill");
        let started = Instant::now();
        drop(server);
        drop(listener);
        drop(mr);
        let mut failed = 0;
        while let Some(res) = ops.next().await {
            match res {
                Ok(()) => {}
                Err(Error::Disconnected(_)) => failed += 1,
                Err(e) => panic!("expected Disconnected, got {e}"),
            }
        }
        let after = client.read(r.slice(0, 8).unwrap()).await;
        assert!(matches!(after, Err(Error::Disconnected(_))), "{after:?}");
        assert!(matches!(recv.await.unwrap(), Err(Error::Disconnected(_))));
        assert!(
            started.elapsed() < client.op_timeout() / 2,
            "took {:?}",
            started.elapsed()
        );
        assert!(failed > 0 || client.stats().writes == 64);
    }

    /// Dropping in-flight futures in a loop never corrupts later operations or
    /// memory, and a dropped `read_into` never writes its slice.
    pub async fn drop_in_flight_futures(&self) {
        let p = self.pair().await;
        let mr = p.server_opts.domain.register(1 << 20, Access::ALL);
        let r = mr.remote();
        let local = p.client_opts.domain.register(1 << 20, Access::LOCAL);
        for i in 0..200u64 {
            let size = 1 + (i as usize * 7919) % (256 << 10);
            let dst = r.slice(0, size as u64).unwrap();
            // Poll each once (it starts), then drop it.
            let w = p.client.write(pattern(i, size), dst).into_future();
            let rd = p
                .client
                .read_into(dst, local.slice(0, size).unwrap())
                .into_future();
            let f = p
                .client
                .fetch_and_add(r.word((1 << 20) - 8).unwrap(), 1)
                .into_future();
            let s = p.client.send(pattern(i, 100)).into_future();
            let mut all = Box::pin(async move { tokio::join!(w, rd, f, s) });
            poll_once(all.as_mut()).await;
            drop(all);
            if i % 50 == 0 {
                tokio::task::yield_now().await;
            }
        }
        // A dropped read_into must never land in the local slice later.
        local.write().fill(0xAB);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            local.read().iter().all(|&b| b == 0xAB),
            "a dropped read wrote local memory"
        );
        // Everything still exact afterwards.
        for i in 0..20u64 {
            let size = 4096 * (i as usize + 1);
            let dst = r.slice(i * 512, size as u64).unwrap();
            let want = pattern(1000 + i, size);
            p.client.write(want.clone(), dst).await.unwrap();
            assert_eq!(&p.client.read(dst).await.unwrap()[..], &want[..]);
            assert_eq!(
                &mr.read()[(i * 512) as usize..(i * 512) as usize + size],
                &want[..]
            );
        }
        // Messages that were sent arrived whole and in order; a marker follows
        // them. The receiver reads while the marker is sent: the dropped sends
        // may hold every receive credit the peer offered (4 on NICs).
        let receive = async {
            let mut prev = None;
            loop {
                let m = p.server.recv_message().await.unwrap();
                if &m[..] == b"END" {
                    break;
                }
                let i = (0..200u64)
                    .find(|&i| pattern(i, 100) == m[..])
                    .expect("a torn or unknown message");
                assert!(prev.is_none_or(|p| i > p), "messages out of order");
                prev = Some(i);
            }
        };
        let (sent, ()) = tokio::join!(p.client.send(&b"END"[..]).into_future(), receive);
        sent.unwrap();
    }

    /// Receivers dropped while they wait lose no message. Each round, a
    /// receiver in this task registers first and one in a task of its own
    /// second; a message arrives, which wakes the first, and the first is
    /// dropped without taking it: the other, asleep in its task, must be
    /// woken for it and get it whole. Every other round the task's receiver
    /// is also joined by a second one dropped unpolled-again, and the
    /// spawned one registers first (the usual order). Afterwards every
    /// message arrives in order.
    pub async fn dropped_receivers_lose_no_message(&self) {
        let p = self.pair().await;
        let registered = || tokio::time::sleep(Duration::from_millis(20));
        for round in 0..16u64 {
            let msg = pattern(round, 64 + round as usize);
            let spawned_first = round % 2 == 1;
            let spawn = || {
                let server = p.server.clone();
                tokio::spawn(async move { server.recv_message().await })
            };
            let mut here = Vec::new();
            let mut other = None;
            if spawned_first {
                other = Some(spawn());
                registered().await;
            }
            for _ in 0..1 + round % 2 {
                let mut w = Box::pin(p.server.recv_message().into_future());
                poll_once(w.as_mut()).await;
                here.push(w);
            }
            let other = match other {
                Some(o) => o,
                None => {
                    let o = spawn();
                    registered().await;
                    o
                }
            };
            let before = p.server.stats().bytes_received;
            p.client.send(msg.clone()).await.unwrap();
            // Delivered (and a receiver woken) before any receiver is dropped.
            let t0 = Instant::now();
            while p.server.stats().bytes_received < before + msg.len() as u64 {
                assert!(t0.elapsed() < Duration::from_secs(10), "never delivered");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            drop(here);
            let got = tokio::time::timeout(Duration::from_secs(10), other)
                .await
                .unwrap_or_else(|_| panic!("round {round}: the message was lost"))
                .unwrap()
                .unwrap();
            assert_eq!(got, msg, "round {round}");
        }
        let send = async {
            for i in 0..50u64 {
                p.client.send(pattern(100 + i, 100)).await.unwrap();
            }
        };
        let receive = async {
            for i in 0..50u64 {
                assert_eq!(
                    p.server.recv_message().await.unwrap(),
                    pattern(100 + i, 100)
                );
            }
        };
        tokio::join!(send, receive);
    }

    /// A receiver that does not consume stalls the sender at its credits,
    /// without growing memory; consuming releases the sender, nothing is lost.
    pub async fn credits_stall_sender(&self) {
        let server_opts = Options {
            recv_credits: 8,
            recv_window: 1 << 20,
            max_message: 256 << 10,
            ..Options::default()
        };
        let p = self.pair_with(Options::default(), server_opts).await;
        assert_eq!(p.client.capabilities().recv_credits, 8);
        for i in 0..8u64 {
            p.client.send(pattern(i, 1000)).await.unwrap();
        }
        let stalled = p
            .client
            .send(pattern(8, 1000))
            .timeout(Duration::from_millis(300))
            .await;
        assert!(matches!(stalled, Err(Error::TimedOut(_))), "{stalled:?}");
        assert!(p.client.stats().credit_stalls >= 1);
        // The byte window stalls too: 4 × 256 KiB exceed 1 MiB minus what is queued.
        let sender = {
            let c = p.client.clone();
            tokio::spawn(async move {
                for i in 8..40u64 {
                    c.send(pattern(i, if i % 2 == 0 { 1000 } else { 200 << 10 }))
                        .await
                        .unwrap();
                }
            })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!sender.is_finished(), "sender must wait for credits");
        for i in 0..40u64 {
            let want = if i < 8 || i % 2 == 0 {
                pattern(i, 1000)
            } else {
                pattern(i, 200 << 10)
            };
            assert_eq!(
                &p.server.recv_message().await.unwrap()[..],
                &want[..],
                "message {i}"
            );
        }
        sender.await.unwrap();
    }

    /// Write-with-immediate: the notice arrives through `recv` after the data landed.
    pub async fn write_with_immediate(&self) {
        let p = self.pair().await;
        let mr = p.server_opts.domain.register(8 << 20, Access::REMOTE_WRITE);
        let r = mr.remote();
        for (i, len) in [0usize, 8, 5000, 6 << 20].into_iter().enumerate() {
            let data = pattern(i as u64 + 50, len);
            p.client
                .write_with_imm(
                    data.clone(),
                    r.slice(0, len as u64).unwrap(),
                    0xC0DE_0000 + i as u32,
                )
                .await
                .unwrap();
            match p.server.recv().await.unwrap() {
                Incoming::WriteImm { imm, len: l } => {
                    assert_eq!(imm, 0xC0DE_0000 + i as u32);
                    assert_eq!(l, len as u64);
                    assert_eq!(&mr.read()[..len], &data[..]);
                }
                other => panic!("expected a write notice, got {other:?}"),
            }
        }
        // Notices and messages share one ordered receive queue.
        p.client.send(&b"before"[..]).await.unwrap();
        p.client
            .write_with_imm(vec![1; 4], r.slice(0, 4).unwrap(), 7)
            .await
            .unwrap();
        p.client.send(&b"after"[..]).await.unwrap();
        assert_eq!(
            p.server.recv().await.unwrap(),
            Incoming::Message(Bytes::from_static(b"before"))
        );
        assert_eq!(
            p.server.recv().await.unwrap(),
            Incoming::WriteImm { imm: 7, len: 4 }
        );
        assert_eq!(
            p.server.recv().await.unwrap(),
            Incoming::Message(Bytes::from_static(b"after"))
        );
    }

    /// `write_then_send`: when the message arrives the written data is
    /// already in place (checked by its SHA-256 at that moment), one at a
    /// time and 64 at once; a refused write reports the refusal and leaves
    /// the connection in step.
    pub async fn write_then_send(&self) {
        let p = self.pair().await;
        let d = &p.server_opts.domain;
        let mr = d.register(8 << 20, Access::REMOTE_WRITE);
        let r = mr.remote();
        let before = p.client.stats();
        // The receiver checks on a thread of its own, so it runs while the
        // transport is still taking data in (a message that overtook its
        // write is caught, whatever the runtime's scheduling).
        let sizes = [0usize, 8, 5000, 64 << 10, 6 << 20];
        let server = p.server.clone();
        let checker = on_own_thread(move || async move {
            let mut wrong = Vec::new();
            for len in sizes {
                let msg = server.recv_message().await.unwrap();
                if msg[..] != sha(&mr.read()[..len])[..] {
                    wrong.push(len);
                }
                server.send(&b"next"[..]).await.unwrap();
            }
            (wrong, mr)
        });
        for (i, len) in sizes.into_iter().enumerate() {
            let data = pattern(i as u64 + 70, len);
            p.client
                .write_then_send(
                    data.clone(),
                    r.slice(0, len as u64).unwrap(),
                    sha(&data).to_vec(),
                )
                .await
                .unwrap();
            assert_eq!(&p.client.recv_message().await.unwrap()[..], b"next");
        }
        let (wrong, mr) = checker.join().expect("checker");
        assert!(
            wrong.is_empty(),
            "message before its data at sizes {wrong:?}"
        );
        let after = p.client.stats();
        assert_eq!(after.writes - before.writes, sizes.len() as u64);
        assert_eq!(after.sends - before.sends, sizes.len() as u64);

        // Many at once, each to its own 4 KiB: every message finds its data.
        let slot = 4096usize;
        let ops = (0..64u64).map(|i| {
            let data = pattern(1000 + i, slot);
            let mut msg = i.to_le_bytes().to_vec();
            msg.extend_from_slice(&sha(&data));
            p.client
                .write_then_send(data, r.slice(i * slot as u64, slot as u64).unwrap(), msg)
        });
        let check = async {
            for _ in 0..64 {
                let m = p.server.recv_message().await.unwrap();
                let i = u64::from_le_bytes(m[..8].try_into().unwrap()) as usize;
                let now = sha(&mr.read()[i * slot..(i + 1) * slot]);
                assert_eq!(&m[8..], &now[..], "slot {i}: message before data");
            }
        };
        let ops = ops.map(std::future::IntoFuture::into_future);
        let (results, ()) = tokio::join!(futures_util::future::join_all(ops), check);
        for r in results {
            r.unwrap();
        }

        // The same as one unit (`write_then_send_many`), messages of
        // several sizes (some large enough to travel alone on RDMA): they
        // arrive in order, each after its data, checked on a thread of its
        // own as above.
        let pairs: Vec<_> = (0..64u64)
            .map(|i| {
                let data = pattern(2000 + i, slot);
                let mut msg = i.to_le_bytes().to_vec();
                msg.extend_from_slice(&sha(&data));
                msg.resize(40 + (i as usize % 5) * 9000, i as u8);
                let dst = r.slice(i * slot as u64, slot as u64).unwrap();
                WriteThenSend {
                    dst,
                    data: data.into(),
                    msg: msg.into(),
                }
            })
            .collect();
        let server = p.server.clone();
        let checker = on_own_thread(move || async move {
            let mut wrong = Vec::new();
            for want in 0..64u64 {
                let m = server.recv_message().await.unwrap();
                let i = u64::from_le_bytes(m[..8].try_into().unwrap());
                let at = i as usize * slot;
                let expect_len = 40 + (i as usize % 5) * 9000;
                if i != want
                    || m.len() != expect_len
                    || m[8..40] != sha(&mr.read()[at..at + slot])[..]
                    || m[40..].iter().any(|&b| b != i as u8)
                {
                    wrong.push(want);
                }
            }
            (wrong, mr)
        });
        let before = p.client.stats();
        p.client.write_then_send_many(pairs).await.unwrap();
        let (wrong, _mr) = checker.join().expect("checker");
        assert!(
            wrong.is_empty(),
            "write_then_send_many: out of order or before its data: {wrong:?}"
        );
        let after = p.client.stats();
        assert_eq!(after.writes - before.writes, 64);
        assert_eq!(after.sends - before.sends, 64);

        // A refused write: the write's error; the message may have gone
        // (as documented), and the connection stays in step.
        let ro = d.register(64, Access::REMOTE_READ);
        assert_eq!(
            denied(
                p.client
                    .write_then_send(
                        vec![1; 8],
                        ro.remote().slice(0, 8).unwrap(),
                        &b"refused"[..]
                    )
                    .await
            ),
            AccessError::Permission
        );
        assert!(
            ro.read().iter().all(|&b| b == 0),
            "a refused write stored data"
        );
        p.client.send(&b"in step"[..]).await.unwrap();
        let mut m = p.server.recv_message().await.unwrap();
        if &m[..] == b"refused" {
            m = p.server.recv_message().await.unwrap();
        }
        assert_eq!(&m[..], b"in step");
    }

    /// A cork (`Connection::cork`): what is posted under it (sends, a
    /// write-then-send, nested corks) arrives whole and in order once the
    /// last cork drops, the written data before its message; a transport
    /// that cannot hold operations sends them at once, with the same result.
    pub async fn cork_holds_a_burst(&self) {
        use futures_util::FutureExt;
        let p = self.pair().await;
        let mr = p.server_opts.domain.register(4096, Access::REMOTE_WRITE);
        let data = pattern(91, 4096);
        let mut posted = Vec::new();
        {
            let outer = p.client.cork();
            for i in 0..8u8 {
                let inner = (i == 3).then(|| p.client.cork());
                // Post in order: each polled once, awaited after the cork.
                let mut op = p.client.send(vec![i; usize::from(i) + 1]).into_future();
                if (&mut op).now_or_never().is_none() {
                    posted.push(op);
                }
                drop(inner);
            }
            let mut op = p
                .client
                .write_then_send(data.clone(), mr.remote(), sha(&data).to_vec())
                .into_future();
            if let Some(r) = (&mut op).now_or_never() {
                r.unwrap();
            } else {
                posted.push(op);
            }
            drop(outer);
        }
        // Receive while the posted ones finish: a send may wait for a
        // credit the receiver returns only as it takes messages.
        let finish = async {
            for op in posted {
                op.await.unwrap();
            }
        };
        let receive = async {
            for i in 0..8u8 {
                let m = p.server.recv_message().await.unwrap();
                assert_eq!(&m[..], &vec![i; usize::from(i) + 1][..], "message {i}");
            }
            let m = p.server.recv_message().await.unwrap();
            assert_eq!(&m[..], &sha(&mr.read()[..])[..], "message before its data");
            assert_eq!(&m[..], &sha(&data)[..]);
        };
        tokio::join!(finish, receive);
        // Uncorked again: a lone send goes at once.
        p.client.send(&b"after"[..]).await.unwrap();
        assert_eq!(&p.server.recv_message().await.unwrap()[..], b"after");
    }

    /// Graceful close: the peer's receive ends with `Disconnected`, later
    /// operations on either side fail cleanly.
    pub async fn graceful_close(&self) {
        let p = self.pair().await;
        let mr = p.server_opts.domain.register(64, Access::ALL);
        p.client.send(&b"last words"[..]).await.unwrap();
        p.client.close().await.unwrap();
        assert_eq!(&p.server.recv_message().await.unwrap()[..], b"last words");
        assert!(matches!(p.server.recv().await, Err(Error::Disconnected(_))));
        assert!(matches!(
            p.client.read(mr.remote()).await,
            Err(Error::Disconnected(_))
        ));
        assert!(matches!(
            p.server.send(&b"x"[..]).await,
            Err(Error::Disconnected(_))
        ));
        // Messages posted (not yet acknowledged) right before a close still
        // arrive, all of them, before the disconnect. As many as the
        // receive credits allow: the server reads only after the close.
        let p = self.pair().await;
        let n = u64::from(p.client.capabilities().recv_credits.clamp(1, 100));
        for i in 0..n {
            p.client
                .post_send(pattern(i, 100 + i as usize))
                .await
                .unwrap();
        }
        p.client.close().await.unwrap();
        for i in 0..n {
            let m = p.server.recv_message().await.expect("posted before close");
            assert_eq!(
                sha(&m),
                sha(&pattern(i, 100 + i as usize)),
                "posted message {i}"
            );
        }
        assert!(matches!(p.server.recv().await, Err(Error::Disconnected(_))));
    }

    /// Per-call deadlines override the default, and counters count.
    pub async fn deadlines_and_counters(&self) {
        let opts = Options {
            op_timeout: Duration::from_millis(250),
            recv_credits: 4,
            max_message: 1024,
            recv_window: 4096,
            ..Options::default()
        };
        let p = self.pair_with(opts.clone(), opts).await;
        assert_eq!(p.client.op_timeout(), Duration::from_millis(250));
        for _ in 0..4 {
            p.client.send(vec![0u8; 10]).await.unwrap();
        }
        let t0 = Instant::now();
        let r = p.client.send(vec![0u8; 10]).await;
        assert!(
            matches!(r, Err(Error::TimedOut(d)) if d == Duration::from_millis(250)),
            "{r:?}"
        );
        assert!(t0.elapsed() >= Duration::from_millis(240));
        let r = p
            .client
            .send(vec![0u8; 10])
            .timeout(Duration::from_millis(20))
            .await;
        assert!(
            matches!(r, Err(Error::TimedOut(d)) if d == Duration::from_millis(20)),
            "{r:?}"
        );
        let s = p.client.stats();
        assert_eq!(s.sends, 4);
        assert_eq!(s.timeouts, 2);
        assert_eq!(s.bytes_sent, 40);
        let mr = p.server_opts.domain.register(64, Access::ALL);
        p.client.write(vec![1u8; 64], mr.remote()).await.unwrap();
        p.client.read(mr.remote()).await.unwrap();
        p.client
            .fetch_and_add(mr.remote().word(0).unwrap(), 1)
            .await
            .unwrap();
        let s = p.client.stats();
        assert_eq!((s.writes, s.reads, s.atomics), (1, 1, 1));
        if p.server.capabilities().counts_remote_ops {
            assert!(p.server.stats().remote_ops_served >= 3);
        }
    }

    /// A peer that dies silently (no FIN or RST: its host lost power, its
    /// network went away) must not leave an idle connection waiting for
    /// ever: an RC queue pair with nothing outstanding sends nothing, so it
    /// never notices. Every transport keeps a TCP stream per connection (the
    /// data over TCP, the control connection over RDMA) with keepalive
    /// probes on, which fail it, and with it every wait, a `recv` with no
    /// deadline included, within 16 s. Checked where the kernel shows it: on
    /// both ends, the stream's keepalive timer is armed and due within
    /// `rdmx-transport-tcp`'s 10 s idle time (Linux `/proc/net/tcp`, "tr" 2;
    /// without keepalive the timer is off, and the kernel's default idle time
    /// is two hours).
    pub async fn silent_peer_probed(&self) {
        let p = self.pair().await;
        // Some traffic first, then idle.
        p.client.send(vec![7u8; 16]).await.unwrap();
        assert_eq!(&p.server.recv_message().await.unwrap()[..], &[7u8; 16]);
        for (end, c) in [("client", &p.client), ("server", &p.server)] {
            let (local, peer) = (c.info().local_addr, c.info().peer_addr);
            let (Some(local), Some(peer)) = (local, peer) else {
                panic!("{end}: the connection names no TCP stream ({local:?} -> {peer:?})");
            };
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match tcp_timer(local, peer) {
                    // Due within the 10 s idle time (in USER_HZ ticks, 100 a second).
                    Some((2, due)) if due <= 10 * 100 => break,
                    other if Instant::now() > deadline => panic!(
                        "{end}: the stream {local} -> {peer} has no keepalive timer due within \
                         10 s: (timer, due in 1/100 s) = {other:?}"
                    ),
                    _ => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        }
    }

    /// Lanes (run on a plain transport; not part of [`conformance_tests!`]):
    /// four lanes negotiated and visible on both ends, large transfers split
    /// over all of them with exact data, a message still arriving after the
    /// data written before it, and a listener that refuses bad lane tags and
    /// half-open groups while it keeps accepting.
    pub async fn lanes(&self) {
        let client_opts = Options {
            lanes: 4,
            ..Options::default()
        };
        let mut listener = self
            .transport
            .listen(&self.listen_addr, &Options::default())
            .await
            .expect("listen");
        let addr = listener.local_addr().to_string();
        let (c, s) = tokio::join!(
            rdmx_core::lanes::connect(&self.transport, &addr, &client_opts),
            listener.accept()
        );
        let (c, s) = (c.expect("connect"), s.expect("accept"));
        assert_eq!((c.info().lanes, s.info().lanes), (4, 4));
        assert_eq!(c.lane_stats().len(), 4);

        // 16 MiB region: the first write goes whole (it tells whether the
        // range is writable), the next ones are split over every lane.
        let len = 16 << 20;
        let mr = Arc::new(Options::default().domain.register(len, Access::ALL));
        let before: Vec<u64> = c.lane_stats().iter().map(|l| l.bytes_sent).collect();
        for seed in 0..3u64 {
            let data = pattern(seed, len);
            c.write(data.clone(), mr.remote()).await.unwrap();
            assert_eq!(sha(&mr.read()), sha(&data), "write {seed}");
            let back = c.read(mr.remote()).await.unwrap();
            assert_eq!(sha(&back), sha(&data), "read {seed}");
        }
        let after: Vec<u64> = c.lane_stats().iter().map(|l| l.bytes_sent).collect();
        for (lane, (b, a)) in before.iter().zip(&after).enumerate() {
            assert!(
                a - b >= (len as u64 / 4) * 2,
                "lane {lane} sent {} bytes",
                a - b
            );
        }
        assert!(
            c.lane_stats()
                .iter()
                .all(|l| l.bytes_received >= len as u64 / 4 * 3),
            "every lane carried read data: {:?}",
            c.lane_stats()
        );
        assert_eq!(
            c.stats().bytes_sent,
            c.lane_stats().iter().map(|l| l.bytes_sent).sum::<u64>()
        );

        // A message posted right after a split write arrives after its data:
        // the receiver looks at the memory as soon as the message is there.
        let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
        let receiver = {
            let (s, mr) = (s.clone(), mr.clone());
            tokio::spawn(async move {
                for _ in 10..20 {
                    let got = s.recv_message().await.unwrap();
                    seen_tx.send((got, sha(&mr.read()))).unwrap();
                }
            })
        };
        for seed in 10..20u64 {
            let data = pattern(seed, len);
            let want = sha(&data);
            let (w, m) = tokio::join!(
                c.write(data, mr.remote()).into_future(),
                c.send(seed.to_le_bytes().to_vec()).into_future()
            );
            w.unwrap();
            m.unwrap();
            let (got, memory) = seen.recv().await.unwrap();
            assert_eq!(&got[..], &seed.to_le_bytes());
            assert_eq!(memory, want, "message {seed} overtook its data");
        }
        receiver.await.unwrap();

        // Bad tags are refused, a group that never completes holds nobody
        // up, and the listener goes on accepting.
        for (index, count) in [(0u16, 17u16), (3, 3), (0, 1)] {
            let bad = Options {
                lane_tag: Some(rdmx_core::LaneTag {
                    group: 99,
                    index,
                    count,
                }),
                ..Options::default()
            };
            let (r, a) = tokio::join!(
                self.transport.connect(&addr, &bad),
                tokio::time::timeout(Duration::from_millis(300), listener.accept())
            );
            assert!(r.is_err(), "lane {index} of {count} was taken");
            assert!(matches!(a, Ok(Err(_))), "lane {index} of {count}: {a:?}");
        }
        let half = Options {
            lane_tag: Some(rdmx_core::LaneTag {
                group: 7,
                index: 0,
                count: 2,
            }),
            ..Options::default()
        };
        let (lone, plain) = (
            self.transport.connect(&addr, &half).await.expect("lane 0"),
            self.transport.connect(&addr, &Options::default()),
        );
        let (plain, accepted) = tokio::join!(plain, listener.accept());
        let (plain, accepted) = (plain.unwrap(), accepted.unwrap());
        assert_eq!(accepted.info().lanes, 1);
        plain.send(&b"after"[..]).await.unwrap();
        assert_eq!(&accepted.recv_message().await.unwrap()[..], b"after");
        drop(lone);
    }
}

/// Run `make`'s future on a thread of its own, with a runtime of its own:
/// a check that runs while the transport is still taking data in, whatever
/// the test runtime's scheduling.
fn on_own_thread<F>(make: impl FnOnce() -> F + Send + 'static) -> std::thread::JoinHandle<F::Output>
where
    F: std::future::Future,
    F::Output: Send + 'static,
{
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
            .block_on(make())
    })
}

/// Expand to one `#[tokio::test]` per conformance case for the suite built by `$make`.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@all $make; []);
    };
    // The same cases, `#[ignore]`d with a reason (hardware that may be absent).
    ($make:expr, ignore = $why:literal) => {
        $crate::conformance_tests!(@all $make; [#[ignore = $why]]);
    };
    (@all $make:expr; $attrs:tt) => {
        $crate::conformance_tests!(@cases $make; $attrs;
            message_order_and_boundaries, read_write_edges, read_many, access_violations,
            atomics_under_contention, large_transfer, many_in_flight,
            peer_killed_mid_transfer, drop_in_flight_futures, dropped_receivers_lose_no_message,
            credits_stall_sender,
            write_with_immediate, write_then_send, cork_holds_a_burst, graceful_close,
            deadlines_and_counters, silent_peer_probed);
    };
    (@cases $make:expr; $attrs:tt; $case:ident $(, $rest:ident)*) => {
        $crate::conformance_tests!(@one $make; $attrs; $case);
        $crate::conformance_tests!(@cases $make; $attrs; $($rest),*);
    };
    (@cases $make:expr; $attrs:tt;) => {};
    (@one $make:expr; [$(#[$m:meta])*]; $case:ident) => {
        $(#[$m])*
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $case() {
            let suite: $crate::Suite = $make;
            tokio::time::timeout(std::time::Duration::from_secs(300), suite.$case())
                .await
                .expect("conformance case hung");
        }
    };
}
