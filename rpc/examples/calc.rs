//! A typed RPC service over rdmx: `add` and `checksum` handlers as plain async
//! functions, a client with many calls in flight, a large payload by
//! rendezvous, and a deadline. Runs over TCP, or soft RoCE with `rdma`:
//!
//! ```text
//! cargo run -p rdmx-rpc --example calc          # tcp
//! cargo run -p rdmx-rpc --example calc -- rdma  # soft RoCE
//! ```

use std::time::Duration;

use bytes::Bytes;
use rdmx_core::{Options, Transports};
use rdmx_rpc::{CallOptions, Client, RpcError, Server, ServerOptions, Service};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), RpcError> {
    let scheme = std::env::args().nth(1).unwrap_or_else(|| "tcp".into());
    let ts = Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new());
    let service = Service::new("calc", 1)
        .method("add", |(a, b): (i64, i64)| async move {
            a.checked_add(b).ok_or("overflow")
        })
        .method_bytes("checksum", |b: Bytes| async move {
            let sum: u64 = b.iter().map(|&x| u64::from(x)).sum();
            Ok::<_, String>(Bytes::copy_from_slice(&sum.to_le_bytes()))
        });
    let server = Server::new(service, ServerOptions::default());
    let listener = ts
        .listen(&format!("{scheme}://127.0.0.1:0"), &Options::default())
        .await?;
    let url = format!("{scheme}://{}", listener.local_addr());
    let srv = server.clone();
    tokio::spawn(async move { srv.serve(listener).await });

    let conn = ts.connect(&url, &Options::default()).await?;
    println!(
        "connected over {} ({})",
        conn.transport(),
        conn.info().provider
    );
    let client = Client::connect(conn, "calc", 1, &["add", "checksum"]).await?;

    let sum: i64 = client.call("add", &(40i64, 2i64)).await?;
    assert_eq!(sum, 42);
    match client.call::<_, i64>("add", &(i64::MAX, 1i64)).await {
        Err(RpcError::App(why)) => println!("application error, as expected: {why}"),
        other => panic!("{other:?}"),
    }
    let calls = (0..1000i64).map(|i| {
        let c = client.clone();
        tokio::spawn(async move { c.call::<_, i64>("add", &(i, i)).await })
    });
    for (i, call) in calls.enumerate() {
        assert_eq!(call.await.unwrap()?, 2 * i as i64);
    }
    let big = Bytes::from(vec![3u8; 8 << 20]);
    let opts = CallOptions {
        deadline: Some(Duration::from_secs(5)),
    };
    let sum = client.call_bytes_with("checksum", big, opts).await?;
    assert_eq!(
        u64::from_le_bytes(sum[..].try_into().unwrap()),
        3 * (8 << 20)
    );
    // 1 + 1 + 1000 adds and one checksum; the overflow is the one error.
    let st = client.stats().snapshot();
    assert_eq!((st.calls, st.errors), (1003, 1));
    println!(
        "{} calls checked ({} failed as intended), one of them an 8 MiB body sent by \
         rendezvous; {} answer bytes received, p50 {:.0} µs, p99 {:.0} µs",
        st.calls, st.errors, st.bytes, st.p50_us, st.p99_us
    );
    server.shutdown();
    Ok(())
}
