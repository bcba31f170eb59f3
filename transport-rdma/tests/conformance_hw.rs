//! The conformance suite, unchanged, on a real RDMA NIC.
//!
//! It needs a host with a RoCE NIC, so it is `#[ignore]`d by default. Run it
//! there with the address of the NIC's interface (client and server both
//! run in this process, connected through the NIC):
//!
//! ```text
//! RDMX_TEST_RDMA_ADDR=192.0.2.10 RDMX_RDMA_DEVICE=mlx5_0 \
//!     cargo test -p rdmx-transport-rdma --features hw --test conformance_hw -- --ignored
//! ```
#![cfg(feature = "hw")]

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::hw::{HwConfig, HwProvider};
use rdmx_transport_rdma::RdmaTransport;

fn suite() -> Suite {
    let addr = std::env::var("RDMX_TEST_RDMA_ADDR")
        .expect("set RDMX_TEST_RDMA_ADDR to an IP address of the NIC's interface");
    let nic = HwProvider::open(HwConfig::from_env()).expect("open the RDMA device");
    Suite::new(
        Arc::new(RdmaTransport::with_provider(nic)),
        &format!("{addr}:0"),
    )
}

rdmx_conformance::conformance_tests!(
    suite(),
    ignore = "needs a RoCE NIC: set RDMX_TEST_RDMA_ADDR (and RDMX_RDMA_DEVICE), run with --ignored"
);
