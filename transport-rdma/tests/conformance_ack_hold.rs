//! The conformance suite again, unchanged, on a soft RoCE device whose ACKs
//! wait up to 50 µs for the application's answer (`SoftConfig::ack_hold`,
//! off by default): held ACKs must never cost a message, an order or a
//! completion.

use std::sync::Arc;
use std::time::Duration;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};

fn suite() -> Suite {
    let dev = SoftRoce::new(SoftConfig {
        port: 0,
        ack_hold: Duration::from_micros(50),
        ..SoftConfig::default()
    })
    .expect("soft device");
    Suite::new(
        Arc::new(RdmaTransport::with_provider(Arc::new(dev))),
        "127.0.0.1:0",
    )
}

rdmx_conformance::conformance_tests!(suite());
