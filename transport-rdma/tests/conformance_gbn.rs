//! The conformance suite again, unchanged, on a soft RoCE device that speaks
//! only go-back-N (what RoCE NICs speak) on a port of its own, with gathered
//! sends off (`SoftConfig::gathered_sends`, on by default): this suite covers
//! the one-buffer send path, the default suite the gathered one.

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::{RdmaTransport, SoftConfig};

fn suite() -> Suite {
    let rdma = RdmaTransport::on_soft_device(SoftConfig {
        port: 0,
        selective_repeat: false,
        gathered_sends: false,
        ..SoftConfig::default()
    });
    Suite::new(Arc::new(rdma.expect("soft device")), "127.0.0.1:0")
}

rdmx_conformance::conformance_tests!(suite());
