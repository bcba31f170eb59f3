//! NVMe over rdmx: the NVMe-oF RDMA flow (NVMe over Fabrics 1.1 §7.3, the
//! RDMA transport binding) on rdmx connections, so it runs over RDMA NICs,
//! the soft RoCEv2 engine and TCP alike.
//!
//! * One rdmx connection per queue, as one RC QP per queue in NVMe/RDMA.
//! * The host SENDs a command capsule: the 64-byte SQE, then any in-capsule
//!   data (small writes, Connect's 1 KiB), in one message.
//! * SGL1 is a Keyed Data Block naming a region of the host's (address,
//!   24-bit length, R_Key). The target pulls write data with a one-sided
//!   READ of it and pushes read data with a one-sided WRITE into it, before
//!   it SENDs the 16-byte response capsule (the CQE).
//! * No PDUs, no digests: the transport's own integrity applies (ICRC on
//!   RoCE, TCP checksums). A capsule that cannot be a capsule ends the
//!   connection, as a transport error does in NVMe/RDMA.

mod initiator;
mod server;

pub use initiator::{BlockError, Initiator, InitiatorConfig, InitiatorCork};
pub use server::{queue, serve};
