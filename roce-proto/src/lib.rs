//! # rdmx-roce-proto
//!
//! Sans-IO RoCEv2 (no tokio, no sockets, no clock): a wire-exact codec for the
//! RC transport (rocev2-reference §1–§10), the framing needed to read and write
//! captures, and an RC queue pair engine ([`Qp`]) driven by packets, time and
//! work requests, with a deterministic network simulator ([`sim`]) for tests.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

pub mod dcqcn;
pub mod icrc;
pub mod mad;
pub mod memory;
pub mod opcode;
pub mod packet;
pub mod pcap;
pub mod psn;
pub mod qp;
pub mod sim;
pub mod wire;

pub use memory::{Atomic, MemError, Memory, Need, PayloadSource, VecMemory};
pub use opcode::{Opcode, Transport};
pub use packet::{
    Aeth, AtomicEth, Bth, DecodeError, Deferred, Deth, NakCode, Packet, Reth, Syndrome,
};
pub use qp::{
    Completion, Qp, QpConfig, QpError, QpState, QpStats, ReadBuffers, Timeouts, WcOpcode, WcStatus,
    WorkRequest, ACK_HOLD_MAX_PACKETS,
};
pub use wire::{FrameError, FramePath, IcrcMismatch, RoceFrame, ROCEV2_PORT};
