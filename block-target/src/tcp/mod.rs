//! NVMe/TCP (NVMe/TCP Transport Specification 1.0): the PDU codec and the
//! controller side of the connections.

pub mod pdu;
pub mod server;

pub use server::{connection, serve};
