//! Connection options that shape the data path: adaptive busy polling
//! (`Options::busy_poll`) moves the same bytes as sleeping, and operations
//! beyond `Options::max_inflight` wait instead of failing.

use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::{FuturesUnordered, StreamExt};
use rdmx_conformance::{pattern, Suite};
use rdmx_core::{Access, Options};
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};

/// A soft RoCE device of its own (a free port).
fn soft_suite() -> Suite {
    let dev = SoftRoce::new(SoftConfig {
        port: 0,
        ..SoftConfig::default()
    })
    .unwrap();
    Suite::new(
        Arc::new(RdmaTransport::with_provider(Arc::new(dev))),
        "127.0.0.1:0",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_connection_moves_exact_bytes() {
    let suite = soft_suite();
    let spin = || Options {
        busy_poll: Some(Duration::from_micros(50)),
        ..Options::default()
    };
    let p = suite.pair_with(spin(), spin()).await;
    let mr = p.server.domain().register(1 << 16, Access::ALL);
    let r = mr.remote();
    let mut last = Vec::new();
    for i in 0..200u64 {
        let data = pattern(i, 1 + (i as usize * 331) % (1 << 16));
        let dst = r.slice(0, data.len() as u64).unwrap();
        p.client.write(data.clone(), dst).await.unwrap();
        assert_eq!(p.client.read(dst).await.unwrap(), data);
        p.client.send(data.clone()).await.unwrap();
        assert_eq!(p.server.recv_message().await.unwrap(), data);
        last = data;
    }
    let word = u64::from_ne_bytes(last[..8].try_into().unwrap());
    let faa = p.client.fetch_and_add(r.word(0).unwrap(), 5).await.unwrap();
    assert_eq!(faa, word);
    assert_eq!(mr.load_u64(0), word.wrapping_add(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_beyond_max_inflight_wait() {
    let suite = soft_suite();
    let four = Options {
        max_inflight: 4,
        ..Options::default()
    };
    let p = suite.pair_with(four, Options::default()).await;
    assert_eq!(p.client.capabilities().max_inflight, 4);
    let mr = p.server.domain().register(300 * 8, Access::ALL);
    let r = mr.remote();
    let mut ops: FuturesUnordered<_> = (0..300u64)
        .map(|i| {
            let c = p.client.clone();
            async move {
                let w = r.word(i * 8).unwrap();
                c.write(i.to_ne_bytes().to_vec(), w).await?;
                c.fetch_and_add(w, 1000).await
            }
        })
        .collect();
    let mut olds = Vec::new();
    while let Some(r) = ops.next().await {
        olds.push(r.expect("waits for a place, never fails"));
    }
    olds.sort();
    assert_eq!(olds, (0..300u64).collect::<Vec<_>>());
    for i in 0..300 {
        assert_eq!(mr.load_u64(i * 8), i as u64 + 1000);
    }
}
