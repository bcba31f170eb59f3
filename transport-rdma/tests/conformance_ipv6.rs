//! The rdmx conformance suite, unchanged, run against the RDMA transport on the
//! soft RoCEv2 provider over IPv6 loopback: RoCEv2 packets in IPv6, whose QP
//! sockets are connected to their peer (IPv4's are not; see `may_connect`
//! in the soft device), with the ICRC over the IPv6 header's fields.

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::RdmaTransport;

rdmx_conformance::conformance_tests!(Suite::new(Arc::new(RdmaTransport::new()), "[::1]:0"));
