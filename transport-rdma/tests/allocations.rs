//! How often the soft RoCE path allocates: 8 B send round trips (a SEND
//! each way, each ACKed, the ACK riding the answer) on a current-thread
//! runtime, so that every task of both ends (the applications, the device's
//! receive and timer tasks) runs on the thread whose allocations are
//! counted.
//!
//! This test counted 33.1 allocations per round trip before the receive
//! path, the transmit path and the completion hand-off stopped making a
//! list per batch or send, and 15.1 after (dhat on `rdmx perf`: 36.7 and
//! 14.6). What remains is per message: the buffer it arrives in, its
//! scatter list (twice), the send's boxed future and reply channel, and
//! here the test's own message.

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};

/// Round trips counted (after as many to warm up).
const ROUNDS: u64 = 2000;

#[test]
fn an_8_byte_send_round_trip_allocates_little() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (c, echo) = rt.block_on(async {
        let cfg = SoftConfig {
            port: 0,
            ..SoftConfig::default()
        };
        let dev = Arc::new(SoftRoce::new(cfg).unwrap());
        let p = Suite::new(Arc::new(RdmaTransport::with_provider(dev)), "127.0.0.1:0")
            .pair()
            .await;
        let s = p.server.clone();
        let echo = tokio::spawn(async move {
            for _ in 0..2 * ROUNDS {
                let m = s.recv_message().await.unwrap();
                s.send(m).await.unwrap();
            }
        });
        (p.client.clone(), echo)
    });
    let rounds = |from: u64| {
        let c = c.clone();
        async move {
            for i in from..from + ROUNDS {
                let msg = bytes::Bytes::from(i.to_le_bytes().to_vec());
                c.send(msg.clone()).await.unwrap();
                assert_eq!(c.recv_message().await.unwrap(), msg, "round trip {i}");
            }
        }
    };
    rt.block_on(rounds(0));
    let info = allocation_counter::measure(|| rt.block_on(rounds(ROUNDS)));
    rt.block_on(echo).unwrap();
    // Each round trip's own message (`Bytes::from(Vec)`) is one of them.
    let per_round = info.count_total as f64 / ROUNDS as f64;
    println!("{per_round:.1} allocations per 8 B send round trip (both ends)");
    assert!(
        per_round <= 16.0,
        "{per_round:.1} allocations per round trip"
    );
}
