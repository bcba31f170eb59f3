//! A client and a server that speak different transports learn it from the
//! handshake at once: an `rdma://` client against a TCP-only server falls back
//! (or fails under `require`) in well under a second and says why; a `tcp://`
//! client against an RDMA server is told to use `rdma://`. The server keeps
//! accepting either way.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rdmx_core::{Error, Options, Policy, Transport, Transports};
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};
use rdmx_transport_tcp::TcpTransport;

fn rdma() -> RdmaTransport {
    let dev = SoftRoce::new(SoftConfig {
        port: 0,
        ..SoftConfig::default()
    })
    .unwrap();
    RdmaTransport::with_provider(Arc::new(dev))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rdma_client_at_a_tcp_server_falls_back_at_once() {
    let ts = Transports::new().with(TcpTransport::new()).with(rdma());
    let mut l = ts
        .listen("tcp://127.0.0.1:0", &Options::default())
        .await
        .unwrap();
    let url = format!("rdma://{}", l.local_addr());
    let dflt = Options::default();
    let t = Instant::now();
    let (c, s) = tokio::join!(ts.connect(&url, &dflt), async {
        // The refused RDMA attempt, then the TCP connection.
        let first = l.accept().await;
        (first, l.accept().await)
    });
    let took = t.elapsed();
    let c = c.unwrap();
    assert!(took < Duration::from_secs(1), "fallback took {took:?}");
    assert_eq!(c.transport(), "tcp");
    let why = c.fallback_reason().unwrap();
    assert!(
        why.contains("transport mismatch") && why.contains("listens with tcp://"),
        "{why}"
    );
    // The listener runs handshakes concurrently, so the refused attempt and
    // the TCP connection may come out of `accept` in either order.
    let (refused, accepted) = match s {
        (Err(e), Ok(c)) | (Ok(c), Err(e)) => (e, Ok::<_, Error>(c)),
        (a, b) => panic!("want one refusal and one connection, got {a:?} and {b:?}"),
    };
    assert!(
        refused.to_string().contains("the client speaks rdma://"),
        "{refused}"
    );
    let server = accepted.unwrap();
    c.send(&b"over tcp"[..]).await.unwrap();
    assert_eq!(&server.recv_message().await.unwrap()[..], b"over tcp");

    // Under `require` the same mismatch is an immediate, explained error.
    let strict = Options {
        policy: Policy::RequireRdma,
        ..Options::default()
    };
    let t = Instant::now();
    let (c, _) = tokio::join!(ts.connect(&url, &strict), l.accept());
    let err = c.unwrap_err();
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    assert!(
        matches!(err, Error::RdmaUnavailable(ref m) if m.contains("listens with tcp://")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_client_at_an_rdma_server_is_told_to_use_rdma() {
    let r = rdma();
    let mut l = r.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = l.local_addr().to_string();
    let t = Instant::now();
    let dflt = Options::default();
    let (c, s) = tokio::join!(TcpTransport::new().connect(&addr, &dflt), l.accept());
    assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
    let err = c.unwrap_err();
    assert!(
        err.to_string()
            .contains("the client speaks tcp:// and the server listens with rdma://")
            && err.to_string().contains("connect with rdma://"),
        "{err}"
    );
    assert!(s.is_err());
    // Still accepting: a proper RDMA client gets in.
    let (c, s) = tokio::join!(r.connect(&addr, &dflt), l.accept());
    let (c, s) = (c.unwrap(), s.unwrap());
    c.send(&b"rdma"[..]).await.unwrap();
    assert_eq!(&s.recv_message().await.unwrap()[..], b"rdma");
}
