//! # rdmx-rpc
//!
//! Typed RPC over any rdmx transport — TCP, soft RoCE or a NIC. Handlers are
//! ordinary async functions over serde types (bincode on the wire):
//!
//! ```no_run
//! # async fn demo(conn: rdmx_core::Connection, listener: rdmx_core::Listener) -> Result<(), rdmx_rpc::RpcError> {
//! use rdmx_rpc::{Client, Server, ServerOptions, Service};
//! let service = Service::new("calc", 1)
//!     .method("add", |(a, b): (u64, u64)| async move { Ok::<_, String>(a + b) });
//! let server = Server::new(service, ServerOptions::default());
//! tokio::spawn(async move { server.serve(listener).await });
//! let client = Client::connect(conn, "calc", 1, &["add"]).await?;
//! let sum: u64 = client.call("add", &(2u64, 3u64)).await?;
//! # Ok(()) }
//! ```
//!
//! - Many calls in flight per connection, multiplexed by call id; the server
//!   runs them concurrently up to a per-connection limit, which is also the
//!   client's credit count, so a flood cannot grow server memory.
//! - Deadlines travel with requests; a call that times out or is dropped is
//!   cancelled on the server too. Application errors ([`RpcError::App`]) and
//!   system errors (transport, deadline, overload, ...) are distinct variants.
//! - Bodies above a threshold (64 KiB by default) travel by rendezvous: the
//!   sender lends its `Bytes` to its domain without copying
//!   (`Domain::register_bytes`) and the receiver pulls them with one one-sided
//!   READ (UCX's GET protocol), over RDMA or TCP's emulated path alike.
//! - [`Pool`] reuses and reconnects clients; [`Server::shutdown`] drains.
//! - `tracing` spans per call and [`RpcStats`] (calls, errors, bytes, latency).

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

mod client;
mod error;
mod outbox;
mod server;
mod stats;
pub mod wire;

pub use client::{CallOptions, Client, Pool};
pub use error::RpcError;
pub use server::{Server, ServerOptions, Service};
pub use stats::{RpcStats, RpcStatsSnapshot};
