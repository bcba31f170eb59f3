//! The rdmx conformance suite, unchanged, over the TCP transport with every
//! connection striped over four lanes (four TCP connections).

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_core::lanes::WithLanes;
use rdmx_transport_tcp::TcpTransport;

rdmx_conformance::conformance_tests!(Suite::new(
    Arc::new(WithLanes::new(Arc::new(TcpTransport::new()), 4)),
    "127.0.0.1:0"
));
