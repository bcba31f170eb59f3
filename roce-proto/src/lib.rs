//! # rdmx-roce-proto
//!
//! Sans-IO RoCEv2 (no tokio, no sockets, no clock): a wire-exact codec for the
//! RC transport (rocev2-reference §1–§10) and the framing needed to read and
//! write captures.

#![deny(unsafe_op_in_unsafe_fn)]
#![forbid(unsafe_code)]

pub mod icrc;
pub mod opcode;
pub mod packet;
pub mod pcap;
pub mod wire;

pub use opcode::Opcode;
pub use packet::{Aeth, AtomicEth, Bth, DecodeError, NakCode, Packet, Reth, Syndrome};
pub use wire::{FrameError, FramePath, IcrcMismatch, RoceFrame, ROCEV2_PORT};
