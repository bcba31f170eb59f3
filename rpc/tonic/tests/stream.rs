//! `RdmxStream` as a byte stream: every byte arrives once and in order
//! whatever the write sizes and flushes, a shutdown reaches the peer as end of
//! stream after the last byte, and writes flushed in one scheduler tick leave
//! as few messages; over the TCP transport and soft RoCE.

use std::sync::Arc;

use rdmx_core::{Options, Transport};
use rdmx_rpc_tonic::RdmxStream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Deterministic pseudo-random bytes and chunk sizes (xorshift).
fn rng(seed: &mut u64) -> u64 {
    *seed ^= *seed << 13;
    *seed ^= *seed >> 7;
    *seed ^= *seed << 17;
    *seed
}

async fn pair(t: Arc<dyn Transport>) -> (RdmxStream, RdmxStream) {
    let mut l = t.listen("127.0.0.1:0", &Options::default()).await.unwrap();
    let addr = l.local_addr().to_string();
    let (c, s) = tokio::join!(t.connect(&addr, &Options::default()), l.accept());
    (RdmxStream::new(c.unwrap()), RdmxStream::new(s.unwrap()))
}

async fn bytes_arrive_exactly(t: Arc<dyn Transport>) {
    let (mut w, mut r) = pair(t).await;
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let total = 12 << 20;
    let data: Vec<u8> = (0..total).map(|_| rng(&mut seed) as u8).collect();
    let expect = data.clone();
    let writer = tokio::spawn(async move {
        let mut at = 0;
        let mut chunks = 0u64;
        let mut seed = 7u64;
        while at < data.len() {
            // 1 B to 300 KiB, so chunks straddle the 256 KiB message size.
            let n = (1 + rng(&mut seed) as usize % (300 << 10)).min(data.len() - at);
            w.write_all(&data[at..at + n]).await.unwrap();
            if rng(&mut seed) % 3 != 0 {
                w.flush().await.unwrap();
            }
            // Now and then let the sender go idle, so that the next flush
            // starts its send itself: both paths, in order.
            if rng(&mut seed) % 8 == 0 {
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            at += n;
            chunks += 1;
        }
        w.shutdown().await.unwrap();
        (chunks, w)
    });
    let mut got = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(60), r.read_to_end(&mut got))
        .await
        .expect("end of stream after the last byte")
        .unwrap();
    // End of stream came after every send finished (the close follows them).
    let (chunks, w) = writer.await.unwrap();
    let sends = w.connection().stats().sends;
    assert_eq!(got.len(), expect.len());
    assert!(got == expect, "bytes differ");
    eprintln!("{chunks} writes left as {sends} messages");
    assert!(sends < chunks, "{sends} messages for {chunks} writes");
}

/// Small writes, each flushed, in one go: they share messages.
async fn flushed_small_writes_coalesce(t: Arc<dyn Transport>) {
    let (mut w, mut r) = pair(t).await;
    let before = w.connection().stats().sends;
    for i in 0..1000u32 {
        w.write_all(&i.to_le_bytes()).await.unwrap();
        w.flush().await.unwrap();
    }
    w.shutdown().await.unwrap();
    let mut got = Vec::new();
    r.read_to_end(&mut got).await.unwrap();
    assert_eq!(got.len(), 4000);
    for (i, c) in got.chunks(4).enumerate() {
        assert_eq!(c, (i as u32).to_le_bytes(), "word {i}");
    }
    let sends = w.connection().stats().sends - before;
    eprintln!("1000 flushed writes left as {sends} messages");
    assert!(sends <= 100, "{sends} messages for 1000 flushed writes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_arrive_exactly_over_tcp() {
    bytes_arrive_exactly(Arc::new(rdmx_transport_tcp::TcpTransport::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_arrive_exactly_over_soft_roce() {
    bytes_arrive_exactly(Arc::new(rdmx_transport_rdma::RdmaTransport::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_small_writes_coalesce_over_tcp() {
    flushed_small_writes_coalesce(Arc::new(rdmx_transport_tcp::TcpTransport::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushed_small_writes_coalesce_over_soft_roce() {
    flushed_small_writes_coalesce(Arc::new(rdmx_transport_rdma::RdmaTransport::new())).await;
}

/// A dropped stream still delivers what was written, then end of stream; a
/// writer whose peer went away gets an error, not a hang.
async fn drop_and_peer_loss(t: Arc<dyn Transport>) {
    let (mut w, mut r) = pair(t.clone()).await;
    w.write_all(&[5u8; 100_000]).await.unwrap();
    drop(w);
    let mut got = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(20), r.read_to_end(&mut got))
        .await
        .expect("end of stream after a drop")
        .unwrap();
    assert!(got.len() == 100_000 && got.iter().all(|&b| b == 5));

    let (mut w, r) = pair(t).await;
    drop(r);
    let failed = tokio::time::timeout(std::time::Duration::from_secs(30), async {
        loop {
            let r = async {
                w.write_all(&[1u8; 4096]).await?;
                w.flush().await
            }
            .await;
            if let Err(e) = r {
                return e;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("a write to a peer that went away fails");
    eprintln!("writing to a closed peer: {failed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_and_peer_loss_over_tcp() {
    drop_and_peer_loss(Arc::new(rdmx_transport_tcp::TcpTransport::new())).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_and_peer_loss_over_soft_roce() {
    drop_and_peer_loss(Arc::new(rdmx_transport_rdma::RdmaTransport::new())).await;
}
