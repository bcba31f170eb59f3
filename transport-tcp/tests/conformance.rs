//! The rdmx conformance suite, run against the TCP transport.

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_tcp::TcpTransport;

rdmx_conformance::conformance_tests!(Suite::new(Arc::new(TcpTransport::new()), "127.0.0.1:0"));
