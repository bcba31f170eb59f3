//! Lanes over the soft RoCE provider: one connection over four RC queue pairs.

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::RdmaTransport;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_lanes() {
    Suite::new(Arc::new(RdmaTransport::new()), "127.0.0.1:0")
        .lanes()
        .await;
}
