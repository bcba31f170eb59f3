//! Capabilities as plain data (in the spirit of UCX's `uct_iface_attr`).

use serde::{Deserialize, Serialize};

/// How a transport provides an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Support {
    /// Done by the hardware or the wire protocol itself (e.g. RDMA WRITE on a NIC).
    Native,
    /// Done in software by the peer's rdmx runtime, with the same semantics.
    Emulated,
    /// Not available.
    Unsupported,
}

/// What a transport (or one connection over it) can do, and its limits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    /// Transport name (`"tcp"`, `"soft-roce"`, `"rdma"`).
    pub transport: String,
    /// True if data moves over RDMA (hardware or the soft RoCE engine).
    pub rdma: bool,
    /// Two-sided send/recv.
    pub send: Support,
    /// One-sided write.
    pub write: Support,
    /// One-sided read.
    pub read: Support,
    /// Compare-and-swap and fetch-and-add.
    pub atomics: Support,
    /// Write with immediate (the peer is notified through `recv`).
    pub write_with_imm: Support,
    /// Largest two-sided message, in bytes.
    pub max_message_size: u64,
    /// Largest single one-sided read or write, in bytes.
    pub max_rdma_size: u64,
    /// Operations one connection keeps in flight before new ones wait.
    pub max_inflight: u32,
    /// Receive credits (messages the peer may send before we consume them).
    pub recv_credits: u32,
    /// One-sided operations the peer runs on our memory are counted in
    /// `remote_ops_served`. False on RDMA NICs: they serve them without the
    /// CPU and count them per port (`rdmx doctor`), not per connection.
    pub counts_remote_ops: bool,
}
