//! # rdmx-core
//!
//! The pluggable transport API of rdmx: connections with two-sided messages and
//! one-sided remote memory access (read, write, compare-and-swap, fetch-and-add)
//! on registered memory regions, over TCP, the soft RoCE engine, or RDMA NICs.
//!
//! ```no_run
//! # async fn demo(transports: rdmx_core::Transports) -> rdmx_core::Result<()> {
//! use rdmx_core::{Access, Options};
//! let opts = Options::default();
//! let conn = transports.connect("rdma://198.18.0.2:7471", &opts).await?;
//! println!("using {} (fallback: {:?})", conn.transport(), conn.fallback_reason());
//! // Tell the peer about a region of ours...
//! let mr = opts.domain.register(4096, Access::REMOTE_READ | Access::REMOTE_WRITE);
//! conn.send(mr.remote().to_bytes().to_vec()).await?;
//! // ...and use one the peer told us about.
//! let theirs = rdmx_core::RemoteRegion::from_bytes(&conn.recv_message().await?).unwrap();
//! conn.write(&b"hello"[..], theirs.slice(0, 5)?).await?;
//! let old = conn.fetch_and_add(theirs.word(8)?, 1).await?;
//! # let _ = old; Ok(()) }
//! ```
//!
//! ## Buffer ownership and cancellation
//!
//! Every operation owns what it touches until it completes:
//!
//! * data to send or write is a [`bytes::Bytes`] (or a [`LocalSlice`] copied when
//!   the operation is created), owned by the transport until it is on the wire;
//! * data read comes back as owned [`bytes::Bytes`]; [`Connection::read_into`]
//!   may receive straight into its [`LocalSlice`] while the read is in flight
//!   (the slice's bytes are unspecified meanwhile, as with an RDMA READ into a
//!   registered buffer), and never writes it once the operation has
//!   completed, failed or been dropped;
//! * a [`LocalSlice`] keeps its region's memory alive, so memory under a transfer
//!   is never freed.
//!
//! Therefore **dropping an operation's future at any await point is memory-safe**:
//! the transport never writes into memory the caller got back, a message or
//! write already queued goes out whole (so later operations on the connection are
//! not corrupted), and a read whose future was dropped never lands. What a dropped
//! operation did *remotely* is unknown (a dropped write may or may not have
//! landed), as with any RDMA work request whose completion was not seen.
//!
//! ## Remote access
//!
//! A connection serves one-sided accesses from its peer against the regions of
//! its [`Domain`], with the checks an RDMA NIC makes (key, bounds, permission,
//! revocation, atomic alignment), and no application code on the passive side.
//! A refused access fails on the requester with [`Error::RemoteAccess`] and
//! leaves the memory untouched. Zero-length reads and writes always succeed.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

pub mod caps;
pub mod conn;
pub mod deadline_anchor;
pub mod error;
pub mod lanes;
pub mod memory;
pub mod metrics;
pub mod pool;
mod shared_deadline;
pub mod stats;
pub mod striped;
pub mod transport;
pub mod waiters;

pub use caps::{Capabilities, Support};
pub use conn::{
    BoxFuture, Connection, ConnectionInfo, Cork, Incoming, Op, OpFuture, RawConnection,
    WriteThenSend, DEFAULT_OP_TIMEOUT,
};
pub use error::{AccessError, Error, Result};
pub use lanes::LaneTag;
pub use memory::{
    Access, AtomicOp, DeviceMemory, DeviceRegistration, Domain, LocalSlice, MemoryRegion,
    RegionReadGuard, RemoteRegion,
};
pub use stats::{Stats, StatsSnapshot};
pub use transport::{
    tcp_listener, Endpoint, Listener, Options, Policy, RawListener, Transport, Transports,
};
