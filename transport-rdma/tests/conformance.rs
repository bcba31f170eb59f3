//! The rdmx conformance suite, unchanged, run against the RDMA transport on the
//! soft RoCEv2 provider (real UDP packets over loopback, port 4791 or a free one).

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::RdmaTransport;

rdmx_conformance::conformance_tests!(Suite::new(Arc::new(RdmaTransport::new()), "127.0.0.1:0"));
