//! TCP-specific behaviour: handshake (version, authentication), malformed
//! frames, and run-time transport selection with fallback.

use std::future::IntoFuture;
use std::sync::atomic::Ordering;
use std::time::Duration;

use rdmx_core::{Access, Error, Options, Policy, Transport, Transports};
use rdmx_transport_tcp::frame::{Header, Kind, HEADER_LEN};
use rdmx_transport_tcp::handshake::{self, Limits, VERSION};
use rdmx_transport_tcp::TcpTransport;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn limits() -> Limits {
    let o = Options::default();
    Limits {
        credits: o.recv_credits,
        window: o.recv_window,
        max_message: o.max_message,
    }
}

async fn listen(opts: &Options) -> (rdmx_core::Listener, String) {
    let l = TcpTransport::new()
        .listen("127.0.0.1:0", opts)
        .await
        .unwrap();
    let a = l.local_addr().to_string();
    (l, a)
}

async fn both(
    client: Options,
    server: Options,
) -> (
    rdmx_core::Result<rdmx_core::Connection>,
    rdmx_core::Result<rdmx_core::Connection>,
) {
    let (mut l, addr) = listen(&server).await;
    let t = TcpTransport::new();
    let (c, s) = tokio::join!(t.connect(&addr, &client), l.accept());
    (c, s)
}

#[tokio::test]
async fn shared_secret_authenticates_both_ways() {
    let (c, s) = both(
        Options::default().secret("s3cret"),
        Options::default().secret("s3cret"),
    )
    .await;
    let (c, s) = (c.unwrap(), s.unwrap());
    assert!(c.info().authenticated && s.info().authenticated);
    c.send(&b"hi"[..]).await.unwrap();
    assert_eq!(&s.recv_message().await.unwrap()[..], b"hi");
}

#[tokio::test]
async fn wrong_secret_fails_on_both_sides() {
    let (c, s) = both(
        Options::default().secret("alpha"),
        Options::default().secret("bravo"),
    )
    .await;
    // The client checks the server's proof first and gives up.
    assert!(
        matches!(c, Err(Error::AuthFailed(ref m)) if m.contains("server's proof")),
        "{c:?}"
    );
    assert!(
        matches!(s, Err(Error::Disconnected(_)) | Err(Error::AuthFailed(_))),
        "{s:?}"
    );
}

#[tokio::test]
async fn missing_secret_fails_on_both_sides() {
    let (c, s) = both(Options::default(), Options::default().secret("needed")).await;
    assert!(
        matches!(c, Err(Error::AuthFailed(ref m)) if m.contains("requires a shared secret")),
        "{c:?}"
    );
    assert!(
        matches!(s, Err(Error::AuthFailed(ref m)) if m.contains("no credentials")),
        "{s:?}"
    );

    let (c, s) = both(Options::default().secret("mine"), Options::default()).await;
    assert!(
        matches!(c, Err(Error::AuthFailed(ref m)) if m.contains("server has no secret")),
        "{c:?}"
    );
    assert!(matches!(s, Err(Error::Disconnected(_))), "{s:?}");
}

#[tokio::test]
async fn secret_never_crosses_the_wire() {
    // A fake server records everything the client sends during the handshake.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let spy = tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut seen = Vec::new();
        let _ = tokio::time::timeout(Duration::from_millis(500), s.read_to_end(&mut seen)).await;
        seen
    });
    let opts = Options {
        connect_timeout: Duration::from_millis(300),
        ..Options::default()
    }
    .secret("TOPSECRETVALUE");
    let r = TcpTransport::new().connect(&addr, &opts).await;
    assert!(matches!(r, Err(Error::TimedOut(_))), "{r:?}");
    let seen = spy.await.unwrap();
    assert_eq!(&seen[..4], b"RDMX");
    assert!(!seen.windows(14).any(|w| w == b"TOPSECRETVALUE"));
}

#[tokio::test]
async fn version_mismatch_reported_by_server() {
    let (mut l, addr) = listen(&Options::default()).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    let mut hello = b"RDMX".to_vec();
    hello.extend_from_slice(&(VERSION + 1).to_le_bytes());
    hello.resize(44, 0);
    s.write_all(&hello).await.unwrap();
    let mut welcome = [0u8; 8];
    s.read_exact(&mut welcome).await.unwrap();
    assert_eq!(&welcome[..4], b"RDMX");
    assert_eq!(u16::from_le_bytes([welcome[4], welcome[5]]), VERSION);
    assert_eq!(
        u16::from_le_bytes([welcome[6], welcome[7]]),
        1,
        "status: version"
    );
    let err = l.accept().await.unwrap_err();
    assert!(
        matches!(err, Error::VersionMismatch { local, peer } if local == VERSION && peer == VERSION + 1),
        "{err}"
    );
}

#[tokio::test]
async fn version_mismatch_reported_by_client() {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut hello = [0u8; 44];
        s.read_exact(&mut hello).await.unwrap();
        let mut w = b"RDMX".to_vec();
        w.extend_from_slice(&7u16.to_le_bytes());
        w.resize(80, 0);
        s.write_all(&w).await.unwrap();
        tokio::time::sleep(Duration::from_secs(1)).await;
    });
    let err = TcpTransport::new()
        .connect(&addr, &Options::default())
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::VersionMismatch { local, peer: 7 } if local == VERSION),
        "{err}"
    );
    assert!(err.to_string().contains("version mismatch"));
}

#[tokio::test]
async fn not_an_rdmx_peer() {
    let (mut l, addr) = listen(&Options::default()).await;
    let mut s = TcpStream::connect(&addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let err = l.accept().await.unwrap_err();
    assert!(
        matches!(err, Error::Protocol(ref m) if m.contains("not an rdmx peer")),
        "{err}"
    );
}

/// A raw client that completed the handshake, speaking frames by hand.
async fn raw_client(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    handshake::client(&mut s, limits(), None, handshake::Speaks::Tcp, None)
        .await
        .unwrap();
    s
}

async fn expect_closed(s: &mut TcpStream) {
    let mut buf = vec![0u8; 1024];
    let r = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(r.is_ok(), "server did not close the connection");
}

#[tokio::test]
async fn malformed_frames_close_only_that_connection() {
    let opts = Options::default();
    let mr = opts.domain.register(64, Access::ALL);
    mr.write().copy_from_slice(&[0x11; 64]);
    let (mut l, addr) = listen(&opts).await;

    // A healthy connection that must survive everything below.
    let t = TcpTransport::new();
    let (good, good_srv) = tokio::join!(t.connect(&addr, &Options::default()), l.accept());
    let (good, good_srv) = (good.unwrap(), good_srv.unwrap());

    let mut oversized = Header::new(Kind::Send);
    oversized.payload_len = (opts.max_message + 1) as u32;
    let mut bad_piece = Header::new(Kind::Write);
    bad_piece.payload_len = 16;
    bad_piece.a = 8;
    let mut unknown = Header::new(Kind::Send).encode();
    unknown[0] = 0xEE;
    let mut reserved = Header::new(Kind::Credit).encode();
    reserved[3] = 1;
    let mut payload_on_read = Header::new(Kind::Read);
    payload_on_read.payload_len = 4;
    let mut overrun = Vec::new();
    // More messages than the server granted credits for.
    for _ in 0..=opts.recv_credits {
        overrun.extend_from_slice(&Header::new(Kind::Send).encode());
    }
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "oversized",
            oversized.encode().to_vec(),
            "exceeds the limit",
        ),
        (
            "piece outside op",
            bad_piece.encode().to_vec(),
            "piece outside",
        ),
        ("unknown kind", unknown.to_vec(), "unknown frame kind"),
        ("reserved byte", reserved.to_vec(), "reserved header byte"),
        (
            "payload on read",
            payload_on_read.encode().to_vec(),
            "exceeds the limit",
        ),
        ("credit overrun", overrun, "beyond its receive credits"),
    ];
    for (name, bytes, why) in cases {
        let mut s = raw_client(&addr).await;
        let srv = l.accept().await.unwrap();
        s.write_all(&bytes).await.unwrap();
        expect_closed(&mut s).await;
        // Messages that arrived within credits are still delivered, then the error.
        let mut delivered = 0;
        let err = loop {
            match srv.recv().await {
                Ok(m) => {
                    assert_eq!(m, rdmx_core::Incoming::Message(Default::default()));
                    delivered += 1;
                }
                Err(e) => break e,
            }
        };
        assert!(
            delivered <= opts.recv_credits,
            "{name}: {delivered} delivered"
        );
        assert!(
            matches!(err, Error::Protocol(ref m) if m.contains(why)),
            "{name}: {err}"
        );
    }

    // Truncated frame then EOF: a clean disconnect, no protocol confusion.
    let mut s = raw_client(&addr).await;
    let srv = l.accept().await.unwrap();
    s.write_all(&Header::new(Kind::Send).encode()[..HEADER_LEN / 2])
        .await
        .unwrap();
    s.shutdown().await.unwrap();
    drop(s);
    assert!(matches!(
        srv.recv().await.unwrap_err(),
        Error::Disconnected(_)
    ));

    // The healthy connection and the region are untouched.
    assert!(mr.read().iter().all(|&b| b == 0x11));
    let r = mr.remote();
    good.write(vec![0x22; 8], r.slice(0, 8).unwrap())
        .await
        .unwrap();
    assert_eq!(
        &good.read(r.slice(0, 16).unwrap()).await.unwrap()[..],
        &[[0x22u8; 8], [0x11; 8]].concat()[..]
    );
    good_srv.send(&b"alive"[..]).await.unwrap();
    assert_eq!(&good.recv_message().await.unwrap()[..], b"alive");
}

#[tokio::test]
async fn a_peer_that_never_reads_its_answers_is_cut_off() {
    // Read requests are small; their answers are not: a peer that sends
    // them and never reads would have the server queue copies without end.
    let opts = Options::default();
    let mr = opts.domain.register(32 << 10, Access::ALL);
    mr.write().fill(0x5a);
    let r = mr.remote();
    let (mut l, addr) = listen(&opts).await;
    let t = TcpTransport::new();
    let (good, good_srv) = tokio::join!(t.connect(&addr, &Options::default()), l.accept());
    let (good, _good_srv) = (good.unwrap(), good_srv.unwrap());

    let mut s = raw_client(&addr).await;
    let srv = l.accept().await.unwrap();
    let mut req = Header::new(Kind::Read);
    req.addr = r.addr;
    req.rkey = r.rkey;
    req.a = r.len;
    req.imm = r.len as u32;
    // 200 MiB of answers asked for, none read.
    let mut burst = Vec::new();
    for id in 1..=6400u64 {
        req.id = id;
        burst.extend_from_slice(&req.encode());
    }
    let writer = tokio::spawn(async move {
        // The server stops reading once it gives up: the write may not finish.
        let _ = s.write_all(&burst).await;
        s
    });
    let err = tokio::time::timeout(Duration::from_secs(20), srv.recv())
        .await
        .expect("the server kept serving a peer that reads nothing")
        .unwrap_err();
    assert!(
        matches!(err, Error::Protocol(ref m) if m.contains("does not read the answers")),
        "{err}"
    );
    assert!(srv.stats().remote_ops_served < 6400);
    writer.abort();
    // Others are served as before.
    assert_eq!(
        &good.read(r.slice(0, 64).unwrap()).await.unwrap()[..],
        &[0x5a; 64][..]
    );
}

#[tokio::test]
async fn selection_policy_and_fallback() {
    let ts = Transports::new().with(TcpTransport::new());
    let (mut l, addr) = listen(&Options::default()).await;
    let before = rdmx_core::stats::global().fallbacks.load(Ordering::Relaxed);
    let rdma_url = format!("rdma://{addr}");
    let tcp_url = format!("tcp://{addr}");
    let dflt = Options::default();

    // prefer RDMA: falls back to TCP, says why, counts it.
    let (c, s) = tokio::join!(ts.connect(&rdma_url, &dflt), l.accept());
    let c = c.unwrap();
    s.unwrap();
    assert_eq!(c.transport(), "tcp");
    let why = c.fallback_reason().expect("fallback reason");
    assert!(why.contains("no RDMA transport"), "{why}");
    assert!(rdmx_core::stats::global().fallbacks.load(Ordering::Relaxed) > before);

    // require RDMA: clear error, no connection.
    let opts = Options {
        policy: Policy::RequireRdma,
        ..Options::default()
    };
    let err = ts.connect(&rdma_url, &opts).await.unwrap_err();
    assert!(
        matches!(err, Error::RdmaUnavailable(ref m) if m.contains("no RDMA transport")),
        "{err}"
    );
    let err = ts.connect(&tcp_url, &opts).await.unwrap_err();
    assert!(matches!(err, Error::RdmaUnavailable(_)), "{err}");

    // tcp-only: uses TCP and says it was the policy.
    let opts = Options {
        policy: Policy::TcpOnly,
        ..Options::default()
    };
    let (c, s) = tokio::join!(ts.connect(&rdma_url, &opts), l.accept());
    s.unwrap();
    assert_eq!(c.unwrap().fallback_reason(), Some("policy is tcp-only"));

    // Plain tcp:// is not a fallback.
    let (c, s) = tokio::join!(ts.connect(&tcp_url, &dflt), l.accept());
    s.unwrap();
    assert_eq!(c.unwrap().fallback_reason(), None);

    assert!(matches!(
        ts.connect(&format!("bogus://{addr}"), &Options::default())
            .await,
        Err(Error::InvalidArgument(_))
    ));
    let l2 = ts
        .listen("rdma://127.0.0.1:0", &Options::default())
        .await
        .unwrap();
    assert_eq!(l2.transport(), "tcp");
    let why = l2
        .fallback_reason()
        .expect("the listener says why it is TCP");
    assert!(why.contains("no RDMA transport"), "{why}");
    assert_ne!(l2.local_addr().port(), 0);
    let l3 = ts
        .listen("tcp://127.0.0.1:0", &Options::default())
        .await
        .unwrap();
    assert_eq!((l3.transport(), l3.fallback_reason()), ("tcp", None));
    // A listen failure names the address and says "listen".
    let taken = format!("tcp://{}", l3.local_addr());
    let err = ts.listen(&taken, &Options::default()).await.unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("listen on {}", l3.local_addr())),
        "{err}"
    );
}

#[tokio::test]
async fn connect_refused_and_timeouts_are_clear() {
    // A port nobody listens on.
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let err = TcpTransport::new()
        .connect(&format!("127.0.0.1:{port}"), &Options::default())
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Connect(_)), "{err}");

    // A server that accepts but never answers the handshake.
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let _hold = tokio::spawn(async move {
        let _s = l.accept().await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    });
    let opts = Options {
        connect_timeout: Duration::from_millis(200),
        ..Options::default()
    };
    let err = TcpTransport::new().connect(&addr, &opts).await.unwrap_err();
    assert!(matches!(err, Error::TimedOut(_)), "{err}");
}

#[tokio::test]
async fn invalid_limits_are_refused_locally() {
    let opts = Options {
        max_message: 64 << 20,
        recv_window: 64 << 20,
        ..Options::default()
    };
    let err = TcpTransport::new()
        .connect("127.0.0.1:1", &opts)
        .await
        .unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err}");
}

#[tokio::test]
async fn busy_poll_mode_works() {
    let opts = Options {
        busy_poll: Some(Duration::from_micros(50)),
        ..Options::default()
    };
    let mr = opts.domain.register(4096, Access::ALL);
    let (mut l, addr) = listen(&opts).await;
    let (c, s) = tokio::join!(TcpTransport::new().connect(&addr, &opts), l.accept());
    let (c, _s) = (c.unwrap(), s.unwrap());
    for i in 0..200u64 {
        assert_eq!(
            c.fetch_and_add(mr.remote().word(8).unwrap(), 1)
                .await
                .unwrap(),
            i
        );
    }
    assert_eq!(mr.load_u64(8), 200);
}

/// Operations issued together leave together: the requester sends the
/// requests made in one scheduler tick in one `writev`, and the responder
/// answers a burst of buffered requests in one `writev` too (before, each
/// took a system call of its own on each side).
///
/// On one thread the count is exact whatever the machine's speed: on a
/// multi-threaded runtime the writer task runs beside the caller and drains
/// whatever it finds, so how many requests share a write depends on timing
/// (a loaded CI machine once saw 42 writes for 128 operations there).
#[tokio::test(flavor = "current_thread")]
async fn concurrent_operations_share_system_calls() {
    const N: u64 = 64;
    let opts = Options::default();
    // Words 0..N are read, words N..2N incremented.
    let mr = opts.domain.register(16 * N as usize, Access::ALL);
    for i in 0..2 * N {
        mr.store_u64(8 * i as usize, 1000 + i);
    }
    let (mut l, addr) = listen(&opts).await;
    let (c, s) = tokio::join!(TcpTransport::new().connect(&addr, &opts), l.accept());
    let (c, s) = (c.unwrap(), s.unwrap());
    let (c0, s0) = (c.stats().socket_writes, s.stats().socket_writes);
    let reads = (0..N).map(|i| c.read(mr.remote().slice(8 * i, 8).unwrap()).into_future());
    let adds = (0..N).map(|i| {
        c.fetch_and_add(mr.remote().word(8 * (N + i)).unwrap(), i)
            .into_future()
    });
    let (got, old) = tokio::join!(
        futures_util::future::join_all(reads),
        futures_util::future::join_all(adds)
    );
    for i in 0..N {
        let v = u64::from_le_bytes(got[i as usize].as_ref().unwrap()[..].try_into().unwrap());
        assert_eq!(v, 1000 + i, "read {i}");
        assert_eq!(*old[i as usize].as_ref().unwrap(), 1000 + N + i, "faa {i}");
        assert_eq!(mr.load_u64(8 * (N + i) as usize), 1000 + N + 2 * i);
    }
    let client_writes = c.stats().socket_writes - c0;
    let server_writes = s.stats().socket_writes - s0;
    eprintln!(
        "{} operations: {client_writes} client writes, {server_writes} server writes",
        2 * N
    );
    assert!(
        client_writes <= 2 * N / 8,
        "client made {client_writes} writes"
    );
    assert!(
        server_writes <= 2 * N / 8,
        "server made {server_writes} writes"
    );
}

/// `read_many` sends its requests in one `writev` (64 reads: one system
/// call, where the same reads awaited one by one take one each), and every
/// read's bytes come back in the order asked.
#[tokio::test(flavor = "current_thread")]
async fn read_many_sends_its_requests_in_one_write() {
    const N: u64 = 64;
    let opts = Options::default();
    let mr = opts.domain.register(8 * N as usize, Access::ALL);
    for i in 0..N {
        mr.store_u64(8 * i as usize, 7000 + i);
    }
    let (mut l, addr) = listen(&opts).await;
    let (c, s) = tokio::join!(TcpTransport::new().connect(&addr, &opts), l.accept());
    let (c, _s) = (c.unwrap(), s.unwrap());
    // In reverse, so that the order of the answers is the order asked.
    let srcs = (0..N)
        .rev()
        .map(|i| mr.remote().slice(8 * i, 8).unwrap())
        .collect();
    let w0 = c.stats().socket_writes;
    let got = c.read_many(srcs).await.unwrap();
    let batch_writes = c.stats().socket_writes - w0;
    for (k, g) in got.iter().enumerate() {
        let i = N - 1 - k as u64;
        assert_eq!(
            u64::from_le_bytes(g[..].try_into().unwrap()),
            7000 + i,
            "read {i}"
        );
    }
    assert_eq!(batch_writes, 1, "{N} reads in {batch_writes} writes");
    let w0 = c.stats().socket_writes;
    for i in 0..N {
        c.read(mr.remote().slice(8 * i, 8).unwrap()).await.unwrap();
    }
    assert_eq!(c.stats().socket_writes - w0, N, "reads awaited one by one");
}

/// A lane other than lane 0 carries no messages, so both ends announce only
/// the protocol's minimum of receive buffers for it (a NIC pins each one);
/// lane 0, and a connection without lanes, announce what they were given.
#[tokio::test]
async fn extra_lanes_announce_the_minimum_receive_buffers() {
    for (index, expect) in [
        (0u16, limits()),
        (1, Limits::EXTRA_LANE),
        (3, Limits::EXTRA_LANE),
    ] {
        let tag = rdmx_core::LaneTag {
            group: 0x5eed,
            index,
            count: 4,
        };
        let (mut a, mut b) = tokio::io::duplex(4096);
        let (c, s) = tokio::join!(
            handshake::client(&mut a, limits(), None, handshake::Speaks::Tcp, Some(tag)),
            handshake::server(&mut b, limits(), None, handshake::Speaks::Tcp),
        );
        let (c, s) = (c.unwrap(), s.unwrap());
        assert_eq!(c.lane, Some(tag));
        assert_eq!(s.lane, Some(tag));
        assert_eq!(c.ours, expect, "client, lane {index}");
        assert_eq!(s.ours, expect, "server, lane {index}");
        assert_eq!(c.peer, expect, "what the client may send, lane {index}");
        assert_eq!(s.peer, expect, "what the server may send, lane {index}");
    }
    let (mut a, mut b) = tokio::io::duplex(4096);
    let (c, s) = tokio::join!(
        handshake::client(&mut a, limits(), None, handshake::Speaks::Tcp, None),
        handshake::server(&mut b, limits(), None, handshake::Speaks::Tcp),
    );
    assert_eq!(c.unwrap().peer, limits());
    assert_eq!(s.unwrap().ours, limits());
}

/// A message that arrives alone costs one read system call: a read that
/// leaves room in the buffer emptied the socket, so the reader does not ask
/// once more only to get EAGAIN (it did, two reads per message). Ping-pong
/// of 8-byte messages and 4 KiB reads (payload read apart from its header
/// at the other end), with every byte checked.
#[tokio::test(flavor = "current_thread")]
async fn a_message_that_arrives_alone_costs_one_read() {
    const N: u32 = 200;
    let opts = Options::default();
    let mr = opts.domain.register(4096, Access::ALL);
    mr.slice(0, 4096).unwrap().fill_from(&[7u8; 4096]).unwrap();
    let (mut l, addr) = listen(&opts).await;
    let (c, s) = tokio::join!(TcpTransport::new().connect(&addr, &opts), l.accept());
    let (c, s) = (c.unwrap(), s.unwrap());
    let (c0, s0) = (c.stats().socket_reads, s.stats().socket_reads);
    for i in 0..N {
        c.send(bytes::Bytes::copy_from_slice(&i.to_le_bytes()))
            .await
            .unwrap();
        let m = s.recv_message().await.unwrap();
        assert_eq!(&m[..], i.to_le_bytes());
        s.send(m).await.unwrap();
        assert_eq!(&c.recv_message().await.unwrap()[..], i.to_le_bytes());
    }
    let n = u64::from(N);
    let server_reads = s.stats().socket_reads - s0;
    let client_reads = c.stats().socket_reads - c0;
    eprintln!("{N} messages each way: {server_reads} server reads, {client_reads} client reads");
    assert!(
        server_reads <= n + n / 10,
        "server made {server_reads} reads"
    );
    assert!(
        client_reads <= n + n / 10,
        "client made {client_reads} reads"
    );
    let (c0, s0) = (c.stats().socket_reads, s.stats().socket_reads);
    for _ in 0..N {
        let got = c.read(mr.remote().slice(0, 4096).unwrap()).await.unwrap();
        assert!(got.len() == 4096 && got.iter().all(|&b| b == 7));
    }
    let reads = (c.stats().socket_reads - c0) + (s.stats().socket_reads - s0);
    eprintln!("{N} 4 KiB reads: {reads} read system calls on both ends");
    assert!(
        reads <= 2 * n + n / 5,
        "{reads} reads for {N} one-sided reads"
    );
}

/// A cork holds what is posted under it; dropping it sends the lot in one
/// `writev`, in order (40 messages: one system call, where uncorked they
/// take one each). Without the cork the same sends cost one write each.
#[tokio::test(flavor = "current_thread")]
async fn a_cork_sends_a_burst_in_one_write() {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    use futures_util::FutureExt;
    const N: u32 = 40;
    let opts = Options::default();
    let (mut l, addr) = listen(&opts).await;
    let (c, s) = tokio::join!(TcpTransport::new().connect(&addr, &opts), l.accept());
    let (c, s) = (c.unwrap(), s.unwrap());
    for corked in [true, false] {
        let w0 = c.stats().socket_writes;
        let mut sends: FuturesUnordered<_> = (0..N)
            .map(|i| c.send(i.to_le_bytes().to_vec()).into_future())
            .collect();
        let cork = corked.then(|| c.cork());
        while let Some(Some(r)) = sends.next().now_or_never() {
            r.unwrap();
        }
        if corked {
            assert_eq!(c.stats().socket_writes - w0, 0, "a frame left while corked");
        }
        drop(cork);
        while let Some(r) = sends.next().await {
            r.unwrap();
        }
        let writes = c.stats().socket_writes - w0;
        for i in 0..N {
            assert_eq!(&s.recv_message().await.unwrap()[..], i.to_le_bytes());
        }
        eprintln!("{N} sends, corked {corked}: {writes} writes");
        if corked {
            assert_eq!(writes, 1, "{N} corked sends took {writes} writes");
        } else {
            assert_eq!(writes, u64::from(N), "uncorked sends are not batched");
        }
    }
}

/// `write_then_send` asks for its write's acknowledgement later: the
/// receiver sends it with its next frame instead of on its own. A ping-pong
/// of write-then-send against a reply costs the receiver one write per
/// exchange (it took two: the acknowledgement, then the reply), every byte
/// checked. With nothing to ride with, the acknowledgement leaves on its
/// own after its delay, and a refused write is still answered at once.
#[tokio::test(flavor = "current_thread")]
async fn write_acknowledgements_ride_with_the_next_frame() {
    const N: u32 = 100;
    let opts = Options::default();
    let mr = opts.domain.register(4096, Access::ALL);
    let (mut l, addr) = listen(&opts).await;
    let (c, s) = tokio::join!(TcpTransport::new().connect(&addr, &opts), l.accept());
    let (c, s) = (c.unwrap(), s.unwrap());
    let dst = mr.remote().slice(0, 4096).unwrap();
    let w0 = s.stats().socket_writes;
    for i in 0..N {
        let data = vec![i as u8; 4096];
        let (wts, reply) = tokio::join!(
            c.write_then_send(data, dst, i.to_le_bytes().to_vec())
                .into_future(),
            async {
                let m = s.recv_message().await.unwrap();
                assert_eq!(&m[..], i.to_le_bytes());
                assert!(
                    mr.read().iter().all(|&b| b == i as u8),
                    "data after message"
                );
                s.send(m).await.unwrap();
                c.recv_message().await.unwrap()
            }
        );
        wts.unwrap();
        assert_eq!(&reply[..], i.to_le_bytes());
    }
    let writes = s.stats().socket_writes - w0;
    eprintln!("{N} write-then-send exchanges: {writes} writes by the receiver");
    assert!(
        writes <= u64::from(N) + u64::from(N) / 10,
        "the receiver made {writes} writes for {N} replies"
    );
    // Nothing to ride with: it completes after the delay, well within a second.
    let t = std::time::Instant::now();
    c.write_then_send(
        vec![9u8; 8],
        mr.remote().slice(0, 8).unwrap(),
        b"x".to_vec(),
    )
    .timeout(std::time::Duration::from_secs(1))
    .await
    .unwrap();
    assert_eq!(&s.recv_message().await.unwrap()[..], b"x");
    eprintln!("a lone write-then-send completed in {:?}", t.elapsed());
    // A refusal is not held.
    let ro = opts.domain.register(64, Access::REMOTE_READ);
    let e = c
        .write_then_send(
            vec![1u8; 8],
            ro.remote().slice(0, 8).unwrap(),
            b"y".to_vec(),
        )
        .timeout(std::time::Duration::from_millis(500))
        .await
        .unwrap_err();
    assert!(matches!(e, Error::RemoteAccess(_)), "refused write: {e}");
}

/// A large message that trickles in (the reader sleeps on a receive
/// low-water mark while it is owed) arrives whole, and a small message right
/// behind it arrives at once: the mark is put back once the payload is in.
#[tokio::test]
async fn a_message_after_a_slow_large_one_is_not_held_back() {
    let opts = Options::default();
    let (mut l, addr) = listen(&opts).await;
    let mut s = raw_client(&addr).await;
    let srv = l.accept().await.unwrap();
    let big: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    let mut h = Header::new(Kind::Send);
    h.payload_len = big.len() as u32;
    s.write_all(&h.encode()).await.unwrap();
    for piece in big.chunks(96 << 10) {
        s.write_all(piece).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let got = tokio::time::timeout(Duration::from_secs(5), srv.recv_message())
        .await
        .expect("the large message never arrived")
        .unwrap();
    assert!(got[..] == big[..], "the large message arrived changed");
    let mut small = Header::new(Kind::Send);
    small.payload_len = 5;
    s.write_all(&small.encode()).await.unwrap();
    s.write_all(b"after").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(2), srv.recv_message())
        .await
        .expect("a small message behind a large one was held back")
        .unwrap();
    assert_eq!(&got[..], b"after");
}

/// A read of several pieces comes back byte for byte whatever its length and
/// offset (each piece's response lands in place in one buffer), and reads
/// dropped partway leave the connection answering the next reads exactly.
#[tokio::test]
async fn multi_piece_reads_land_every_byte_in_place() {
    use rdmx_transport_tcp::frame::MAX_PIECE;
    let opts = Options::default();
    let (c, s) = both(opts.clone(), opts.clone()).await;
    let (c, _s) = (c.unwrap(), s.unwrap());
    let len = 2 * MAX_PIECE as usize + 4099;
    let data: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
    let mr = opts.domain.register_from(&data, Access::REMOTE_READ);
    let whole = c.read(mr.remote()).await.unwrap();
    assert!(whole[..] == data[..], "a {len}-byte read came back changed");
    let part = mr.remote().slice(1, len as u64 - 1).unwrap();
    let got = c.read(part).await.unwrap();
    assert!(got[..] == data[1..], "a read at offset 1 came back changed");
    for micros in [1u64, 100, 400, 1500] {
        let dropped =
            tokio::time::timeout(Duration::from_micros(micros), c.read(mr.remote())).await;
        if let Ok(r) = dropped {
            assert!(r.unwrap()[..] == data[..]);
        }
        let again = c.read(mr.remote()).await.unwrap();
        assert!(
            again[..] == data[..],
            "a read after one dropped at {micros} µs came back changed"
        );
    }
}

/// `read_into` receives a large answer straight into the caller's slice, and
/// a read dropped while its answer is still coming writes nothing more: the
/// peer here is driven by hand, so that the answer's tail is sent only after
/// the read was dropped. The connection then reads the next answer exactly.
#[tokio::test]
async fn a_dropped_read_into_lands_nothing_after_the_drop() {
    let opts = Options::default();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (client, peer) = tokio::join!(TcpTransport::new().connect(&addr, &opts), async {
        let (mut s, _) = l.accept().await.unwrap();
        handshake::server(&mut s, limits(), None, handshake::Speaks::Tcp)
            .await
            .unwrap();
        s
    });
    let (c, mut peer) = (client.unwrap(), peer);
    let len = 1usize << 20;
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 253) as u8).collect();
    let remote = rdmx_core::RemoteRegion {
        addr: 0x1000,
        len: len as u64,
        rkey: 42,
    };
    let local = opts.domain.register(len, Access::LOCAL);
    local.write().fill(0xAB);
    // The peer's answer to the read it gets: the header and the first
    // `head` bytes now, the rest when told.
    async fn answer_start(peer: &mut TcpStream, data: &[u8], head: usize) -> Header {
        let mut hb = [0u8; HEADER_LEN];
        peer.read_exact(&mut hb).await.unwrap();
        let req = Header::decode(&hb, u64::MAX).unwrap();
        assert_eq!(req.kind, Kind::Read);
        let mut resp = Header::new(Kind::Resp);
        resp.id = req.id;
        resp.payload_len = data.len() as u32;
        peer.write_all(&resp.encode()).await.unwrap();
        peer.write_all(&data[..head]).await.unwrap();
        req
    }
    let head = 256 << 10;
    // Boxed, so that dropping it drops the operation (a `pin!`ned future
    // would live on to the end of the scope).
    let mut read = c
        .read_into(remote, local.slice(0, len).unwrap())
        .into_future();
    let started = async {
        answer_start(&mut peer, &data, head).await;
        // Wait until the reader has taken the head in.
        let t0 = std::time::Instant::now();
        while local.read()[head - 1] != data[head - 1] {
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "the head never landed"
            );
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::select! {
        r = &mut read => panic!("the read finished without its tail: {r:?}"),
        () = started => {}
    }
    assert!(
        local.read()[..head] == data[..head],
        "received straight into the slice"
    );
    drop(read);
    // Now the tail: consumed off the stream, written nowhere.
    peer.write_all(&data[head..]).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        local.read()[head..].iter().all(|&b| b == 0xAB),
        "a dropped read_into wrote its slice after the drop"
    );
    // The stream stayed in step: the next read comes back exact.
    local.write().fill(0);
    let again = c.read_into(remote, local.slice(0, len).unwrap());
    let (r, _) = tokio::join!(again.into_future(), async {
        answer_start(&mut peer, &data, 1000).await;
        peer.write_all(&data[1000..]).await.unwrap();
    });
    r.unwrap();
    assert!(
        local.read()[..] == data[..],
        "the next read_into came back changed"
    );
}

/// Small messages that arrive one at a time share the reader's buffer while
/// the receiver holds them: each follows the one before it in memory (a
/// fresh buffer per message, as when the reader grew its buffer before every
/// read, cost an allocation and a cold 64 KiB of cache per message). Every
/// byte is checked.
#[tokio::test]
async fn held_small_messages_share_the_read_buffer() {
    let (c, s) = both(Options::default(), Options::default()).await;
    let (c, s) = (c.unwrap(), s.unwrap());
    const N: usize = 100;
    let mut held = Vec::with_capacity(N);
    for i in 0..N {
        let msg = (i as u64).to_le_bytes();
        c.send(msg.to_vec()).await.unwrap();
        let got = s.recv_message().await.unwrap();
        assert_eq!(&got[..], &msg[..]);
        held.push(got);
        // One message at a time: the next is sent once this one is held.
        s.send(&b"k"[..]).await.unwrap();
        assert_eq!(&c.recv_message().await.unwrap()[..], b"k");
    }
    let adjacent = held
        .windows(2)
        .filter(|w| w[1].as_ptr() as usize == w[0].as_ptr() as usize + 8 + HEADER_LEN)
        .count();
    assert!(
        adjacent >= N - 1 - N / 10,
        "only {adjacent} of {} messages follow the one before in the read buffer",
        N - 1
    );
}

/// Messages of tens of KiB arrive several to a socket read: after a large
/// frame every read has a chunk of room at least (when the buffer grew only
/// to the rest of the frame in hand, each 32 KiB message took a read or
/// more). Every byte is checked.
#[tokio::test]
async fn medium_messages_arrive_several_to_a_read() {
    let (c, s) = both(Options::default(), Options::default()).await;
    let (c, s) = (c.unwrap(), s.unwrap());
    const N: u64 = 200;
    let msg = |i: u64| -> Vec<u8> { (0..32u64 << 10).map(|j| (i * 31 + j * 7) as u8).collect() };
    let reads_before = s.stats().socket_reads;
    let sender = {
        let c = c.clone();
        tokio::spawn(async move {
            for i in 0..N {
                c.send(msg(i)).await.unwrap();
            }
        })
    };
    for i in 0..N {
        let got = s.recv_message().await.unwrap();
        assert!(got[..] == msg(i)[..], "message {i} arrived changed");
    }
    sender.await.unwrap();
    let reads = s.stats().socket_reads - reads_before;
    assert!(
        reads * 10 <= N * 6,
        "{reads} socket reads for {N} messages of 32 KiB"
    );
}
