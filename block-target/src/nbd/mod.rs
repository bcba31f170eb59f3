//! An NBD export of a remote namespace (NBD protocol, `doc/proto.md` of
//! NetworkBlockDevice/nbd): the wire format and the server.

pub mod proto;
pub mod server;
pub mod stats;
mod transmission;

pub use server::{connection, serve, NbdConfig, MAX_PAYLOAD};
pub use stats::NbdStats;
