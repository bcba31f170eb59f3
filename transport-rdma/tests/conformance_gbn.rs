//! The conformance suite again, unchanged, on a soft RoCE device that speaks
//! only go-back-N (what RoCE NICs speak) on a port of its own, and sends each
//! datagram from one buffer (the path taken where the kernel refuses gathered
//! sends; the default suite covers gathered ones).

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};

fn suite() -> Suite {
    let dev = SoftRoce::new(SoftConfig {
        port: 0,
        selective_repeat: false,
        gathered_sends: false,
        ..SoftConfig::default()
    })
    .expect("soft device");
    Suite::new(
        Arc::new(RdmaTransport::with_provider(Arc::new(dev))),
        "127.0.0.1:0",
    )
}

rdmx_conformance::conformance_tests!(suite());
