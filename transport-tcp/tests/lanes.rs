//! Lanes over the TCP transport: one connection over four TCP connections.

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_tcp::TcpTransport;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_lanes() {
    Suite::new(Arc::new(TcpTransport::new()), "127.0.0.1:0")
        .lanes()
        .await;
}
