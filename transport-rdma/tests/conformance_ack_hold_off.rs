//! The conformance suite again, unchanged, on a soft RoCE device whose ACKs
//! never wait for the application's answer (`SoftConfig::ack_hold` zero;
//! the default holds them up to 500 µs, which the other soft RoCE suites
//! run with): both ways must deliver every message, in order, with every
//! completion.

use std::sync::Arc;
use std::time::Duration;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::{RdmaTransport, SoftConfig};

fn suite() -> Suite {
    let rdma = RdmaTransport::on_soft_device(SoftConfig {
        port: 0,
        ack_hold: Duration::ZERO,
        ..SoftConfig::default()
    });
    Suite::new(Arc::new(rdma.expect("soft device")), "127.0.0.1:0")
}

rdmx_conformance::conformance_tests!(suite());
