//! rdmx-rpc behaviour, the same tests over the TCP transport and over soft RoCE.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rdmx_core::{Connection, Listener, Options, Transport};
use rdmx_rpc::{CallOptions, Client, RpcError, Server, ServerOptions, Service};
use serde::{Deserialize, Serialize};

#[derive(Serialize, Deserialize, Debug, PartialEq)]
struct Put {
    key: String,
    value: Vec<u8>,
}

/// Counts handler futures dropped before they finished (server-side cancel).
struct DropCounter(Arc<AtomicU64>, bool);

impl Drop for DropCounter {
    fn drop(&mut self) {
        if !self.1 {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}

fn service(cancelled: Arc<AtomicU64>) -> Service {
    Service::new("kv", 2)
        .method("echo", |p: Put| async move { Ok::<_, String>(p) })
        .method("len", |v: Vec<u8>| async move {
            Ok::<_, String>(v.len() as u64)
        })
        .method("fail", |msg: String| async move {
            Err::<u64, _>(format!("refused: {msg}"))
        })
        .method("sleep", move |ms: u64| {
            let cancelled = cancelled.clone();
            async move {
                let mut guard = DropCounter(cancelled, false);
                tokio::time::sleep(Duration::from_millis(ms)).await;
                guard.1 = true;
                Ok::<_, String>(ms)
            }
        })
        .method_bytes("blob", |b: Bytes| async move {
            // Answer with the body reversed (a large answer when the body is large).
            let mut v = b.to_vec();
            v.reverse();
            Ok::<_, String>(Bytes::from(v))
        })
}

const METHODS: &[&str] = &["echo", "len", "fail", "sleep", "blob"];

async fn pair(
    t: &dyn Transport,
    opts: ServerOptions,
) -> (Client, Server, Arc<AtomicU64>, tokio::task::JoinHandle<()>) {
    let cancelled = Arc::new(AtomicU64::new(0));
    let server = Server::new(service(cancelled.clone()), opts);
    let listener: Listener = t.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = listener.local_addr().to_string();
    let s = server.clone();
    let task = tokio::spawn(async move {
        s.serve(listener).await.unwrap();
    });
    let conn: Connection = t.connect(&addr, &Options::default()).await.unwrap();
    let client = Client::connect(conn, "kv", 2, METHODS).await.unwrap();
    (client, server, cancelled, task)
}

async fn typed_calls_many_in_flight(t: &dyn Transport) {
    let (c, server, _, _) = pair(t, ServerOptions::default()).await;
    let mut tasks = Vec::new();
    for task in 0..64u32 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..40u32 {
                let p = Put {
                    key: format!("{task}/{i}"),
                    value: (0..(i * 37 + task) % 3000)
                        .map(|x| (x % 251) as u8)
                        .collect(),
                };
                let back: Put = c.call("echo", &p).await.unwrap();
                assert_eq!(back, p);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let n: u64 = c.call("len", &vec![9u8; 1000]).await.unwrap();
    assert_eq!(n, 1000);
    assert_eq!(c.stats().snapshot().calls, 64 * 40 + 1);
    assert_eq!(server.stats().snapshot().calls, 64 * 40 + 1);
    assert_eq!(c.stats().snapshot().errors, 0);
}

async fn errors_are_distinct(t: &dyn Transport) {
    let (c, _, _, _) = pair(t, ServerOptions::default()).await;
    match c.call::<_, u64>("fail", &"x".to_string()).await {
        Err(RpcError::App(m)) => assert_eq!(m, "refused: x"),
        other => panic!("{other:?}"),
    }
    // A request that does not decode as the method's type is a codec error.
    match c.call::<_, u64>("len", &7u8).await {
        Err(RpcError::Codec(_)) => {}
        other => panic!("{other:?}"),
    }
    // A method the client did not declare is unknown to the server's table check
    // at HELLO only if declared; calling an undeclared one fails clearly.
    match c.call::<_, u64>("nope", &1u8).await {
        Err(RpcError::UnknownMethod(_)) => {}
        other => panic!("{other:?}"),
    }
    // Still usable.
    let n: u64 = c.call("len", &vec![1u8; 5]).await.unwrap();
    assert_eq!(n, 5);
    // Transport errors are their own kind.
    c.connection().close().await.unwrap();
    match c.call::<_, u64>("len", &vec![1u8; 5]).await {
        Err(RpcError::Transport(_)) => {}
        other => panic!("{other:?}"),
    }
}

async fn wrong_version_is_incompatible(t: &dyn Transport) {
    let (c, _, _, _) = pair(t, ServerOptions::default()).await;
    let addr = c.connection().info().peer_addr.unwrap().to_string();
    let conn = t.connect(&addr, &Options::default()).await.unwrap();
    match Client::connect(conn, "kv", 3, METHODS).await {
        Err(RpcError::Incompatible(why)) => assert!(why.contains("v3"), "{why}"),
        other => panic!("{other:?}"),
    }
    let conn = t.connect(&addr, &Options::default()).await.unwrap();
    match Client::connect(conn, "kv", 2, &["echo", "missing"]).await {
        Err(RpcError::Incompatible(why)) => assert!(why.contains("no method"), "{why}"),
        other => panic!("{other:?}"),
    }
}

async fn deadlines_and_cancellation_reach_the_server(t: &dyn Transport) {
    let (c, _, cancelled, _) = pair(t, ServerOptions::default()).await;
    let r = c
        .call_with::<_, u64>(
            "sleep",
            &5_000u64,
            CallOptions {
                deadline: Some(Duration::from_millis(100)),
            },
        )
        .await;
    assert!(matches!(r, Err(RpcError::DeadlineExceeded)), "{r:?}");
    // Dropping a call future cancels it on the server as well.
    let call = c.call::<_, u64>("sleep", &5_000u64);
    let _ = tokio::time::timeout(Duration::from_millis(100), call).await;
    let t0 = std::time::Instant::now();
    while cancelled.load(Ordering::SeqCst) < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(3),
            "handlers were not cancelled"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let n: u64 = c.call("sleep", &1u64).await.unwrap();
    assert_eq!(n, 1);
}

async fn large_bodies_go_by_rendezvous(t: &dyn Transport) {
    let (c, _, _, _) = pair(t, ServerOptions::default()).await;
    let reads_before = c.connection().stats().reads;
    let body: Vec<u8> = (0..(4u32 << 20) + 3)
        .map(|i| (i * 13 % 251) as u8)
        .collect();
    let back = c
        .call_bytes("blob", Bytes::from(body.clone()))
        .await
        .unwrap();
    let mut want = body.clone();
    want.reverse();
    assert!(back[..] == want[..], "reversed body differs");
    // The answer was pulled with a one-sided read, not sent as a message.
    assert!(c.connection().stats().reads > reads_before);
    // Typed calls with large bodies too.
    let p = Put {
        key: "big".into(),
        value: body,
    };
    let echoed: Put = c.call("echo", &p).await.unwrap();
    assert_eq!(echoed, p);
}

async fn graceful_shutdown_drains(t: &dyn Transport) {
    let (c, server, _, task) = pair(t, ServerOptions::default()).await;
    let slow = {
        let c = c.clone();
        tokio::spawn(async move { c.call::<_, u64>("sleep", &300u64).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    server.shutdown();
    assert_eq!(
        slow.await.unwrap().unwrap(),
        300,
        "in-flight call must finish"
    );
    // New calls are refused clearly (GOAWAY, or the drained connection closed).
    let r = c.call::<_, u64>("len", &vec![1u8]).await;
    assert!(
        matches!(r, Err(RpcError::ShuttingDown) | Err(RpcError::Transport(_))),
        "{r:?}"
    );
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("serve() returns after draining")
        .unwrap();
}

async fn credits_bound_calls_in_flight(t: &dyn Transport) {
    let opts = ServerOptions {
        max_in_flight: 2,
        ..ServerOptions::default()
    };
    let (c, _, _, _) = pair(t, opts).await;
    let t0 = std::time::Instant::now();
    let calls: Vec<_> = (0..6)
        .map(|_| {
            let c = c.clone();
            tokio::spawn(async move { c.call::<_, u64>("sleep", &100u64).await })
        })
        .collect();
    for call in calls {
        assert_eq!(call.await.unwrap().unwrap(), 100);
    }
    // 6 calls of 100 ms, 2 at a time: at least 300 ms, and none refused.
    assert!(
        t0.elapsed() >= Duration::from_millis(290),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(c.stats().snapshot().errors, 0);
}

/// Bad peers (an HTTP probe, bytes that are no handshake) do not stop the
/// server: the next client is served.
async fn bad_peers_do_not_stop_the_server(t: &dyn Transport) {
    let server = Server::new(
        service(Arc::new(AtomicU64::new(0))),
        ServerOptions::default(),
    );
    let listener: Listener = t.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = listener.local_addr().to_string();
    let s = server.clone();
    let task = tokio::spawn(async move { s.serve(listener).await });
    for junk in [&b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"[..], &[0xffu8; 64][..]] {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(junk).await.unwrap();
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut sink)).await;
    }
    let conn: Connection = t.connect(&addr, &Options::default()).await.unwrap();
    let c = Client::connect(conn, "kv", 2, METHODS).await.unwrap();
    let n: u64 = c.call("len", &vec![0u8; 5]).await.unwrap();
    assert_eq!(n, 5);
    assert!(!task.is_finished(), "the server is still accepting");
    server.shutdown();
}

/// Poll `f` once (in the test's task): `Ready` if it finished.
async fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> std::task::Poll<F::Output> {
    std::future::poll_fn(|cx| std::task::Poll::Ready(std::pin::Pin::new(&mut *f).poll(cx))).await
}

/// Calls made together leave together: with 64 callers in one runtime tick,
/// requests and answers go out in batches of several frames (one `writev` on
/// TCP), and every answer is still the right one.
async fn concurrent_calls_leave_in_batches(t: &dyn Transport) {
    let (c, server, _, _) = pair(t, ServerOptions::default()).await;
    let mut tasks = Vec::new();
    for task in 0..64u64 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..20u64 {
                let v = vec![(task * 31 + i) as u8; (task * 20 + i) as usize];
                let n: u64 = c.call("len", &v).await.unwrap();
                assert_eq!(n, task * 20 + i);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let (cs, ss) = (c.stats().snapshot(), server.stats().snapshot());
    assert_eq!((cs.calls, cs.errors), (64 * 20, 0));
    assert!(cs.batches > 0, "{cs:?}");
    assert!(cs.batched_frames >= 2 * cs.batches, "client: {cs:?}");
    assert!(ss.batches > 0, "{ss:?}");
    assert!(ss.batched_frames >= 2 * ss.batches, "server: {ss:?}");
}

/// A caller that queued the first request of a batch and is dropped before
/// the batch left does not strand the requests queued behind its own.
async fn a_dropped_batch_leader_strands_nothing(t: &dyn Transport) {
    let (c, _, _, _) = pair(t, ServerOptions::default()).await;
    // One call in flight, so the next ones batch.
    let mut slow = Box::pin(c.call::<_, u64>("sleep", &300u64));
    assert!(poll_once(&mut slow).await.is_pending());
    // The leader: queues its request and waits for the end of the tick.
    let (ten, twenty) = (vec![1u8; 10], vec![2u8; 20]);
    let mut leader = Box::pin(c.call::<_, u64>("len", &ten));
    assert!(poll_once(&mut leader).await.is_pending());
    // Queued behind it.
    let mut follower = Box::pin(c.call::<_, u64>("len", &twenty));
    assert!(poll_once(&mut follower).await.is_pending());
    drop(leader);
    let answer = tokio::time::timeout(Duration::from_secs(10), follower)
        .await
        .expect("the request queued behind a dropped leader never left");
    assert_eq!(answer.unwrap(), 20);
    assert_eq!(slow.await.unwrap(), 300);
    assert_eq!(c.stats().snapshot().errors, 0);
}

macro_rules! cases {
    ($modname:ident, $make:expr) => {
        mod $modname {
            use super::*;
            fn transport() -> Box<dyn Transport> {
                Box::new($make)
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn typed_calls_many_in_flight() {
                super::typed_calls_many_in_flight(&*transport()).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn errors_are_distinct() {
                super::errors_are_distinct(&*transport()).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn wrong_version_is_incompatible() {
                super::wrong_version_is_incompatible(&*transport()).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn deadlines_and_cancellation_reach_the_server() {
                super::deadlines_and_cancellation_reach_the_server(&*transport()).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn large_bodies_go_by_rendezvous() {
                super::large_bodies_go_by_rendezvous(&*transport()).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn graceful_shutdown_drains() {
                super::graceful_shutdown_drains(&*transport()).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn bad_peers_do_not_stop_the_server() {
                super::bad_peers_do_not_stop_the_server(&*transport()).await;
            }
            // One thread: all callers run in the same tick, deterministically.
            #[tokio::test]
            async fn concurrent_calls_leave_in_batches() {
                super::concurrent_calls_leave_in_batches(&*transport()).await;
            }
            #[tokio::test]
            async fn a_dropped_batch_leader_strands_nothing() {
                super::a_dropped_batch_leader_strands_nothing(&*transport()).await;
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn credits_bound_calls_in_flight() {
                super::credits_bound_calls_in_flight(&*transport()).await;
            }
        }
    };
}

cases!(tcp, rdmx_transport_tcp::TcpTransport::new());
cases!(soft_roce, rdmx_transport_rdma::RdmaTransport::new());

/// A pooled client whose connection died is replaced on the next `get`.
async fn pool_reconnects<T: Transport + Clone>(t: T, scheme: &str) {
    let (c, _, _, _) = pair(&t, ServerOptions::default()).await;
    let addr = c.connection().info().peer_addr.unwrap();
    let pool = rdmx_rpc::Pool::new(
        rdmx_core::Transports::new().with(t),
        &format!("{scheme}://{addr}"),
        Options::default(),
        "kv",
        2,
        METHODS,
        1,
    );
    let first = pool.get().await.unwrap();
    let n: u64 = first.call("len", &vec![0u8; 3]).await.unwrap();
    assert_eq!(n, 3);
    let first_local = first.connection().info().local_addr;
    first.connection().close().await.unwrap();
    let t0 = std::time::Instant::now();
    loop {
        let c = pool.get().await.unwrap();
        match c.call::<_, u64>("len", &vec![0u8; 4]).await {
            Ok(n) => {
                assert_eq!(n, 4);
                assert_ne!(
                    c.connection().info().local_addr,
                    first_local,
                    "a new connection"
                );
                break;
            }
            Err(RpcError::Transport(_)) => {}
            Err(e) => panic!("{e:?}"),
        }
        assert!(t0.elapsed() < Duration::from_secs(5), "no reconnect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_reconnects_over_tcp() {
    pool_reconnects(rdmx_transport_tcp::TcpTransport::new(), "tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_reconnects_over_soft_roce() {
    pool_reconnects(rdmx_transport_rdma::RdmaTransport::new(), "rdma").await;
}
