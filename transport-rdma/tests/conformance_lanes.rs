//! The rdmx conformance suite, unchanged, over the RDMA transport on the soft
//! RoCEv2 provider with every connection striped over four lanes (four RC
//! queue pairs).

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_core::lanes::WithLanes;
use rdmx_transport_rdma::RdmaTransport;

rdmx_conformance::conformance_tests!(Suite::new(
    Arc::new(WithLanes::new(Arc::new(RdmaTransport::new()), 4)),
    "127.0.0.1:0"
));
