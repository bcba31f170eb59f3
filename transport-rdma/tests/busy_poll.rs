//! Connections with adaptive busy polling (`Options::busy_poll`) move the
//! same bytes as sleeping ones.

use std::sync::Arc;
use std::time::Duration;

use rdmx_conformance::{pattern, Suite};
use rdmx_core::{Access, Options};
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_connection_moves_exact_bytes() {
    let dev = SoftRoce::new(SoftConfig {
        port: 0,
        ..SoftConfig::default()
    })
    .unwrap();
    let suite = Suite::new(
        Arc::new(RdmaTransport::with_provider(Arc::new(dev))),
        "127.0.0.1:0",
    );
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
