//! Real RDMA NICs through libibverbs (cargo feature `hw`).
//!
//! The decisions ([`plan`]), the work-request registry ([`track`]) and the
//! registered buffer pool ([`slab`]) are plain Rust and tested on every
//! host; only `ibv` (feature `hw`) makes verbs calls, through `sideway` and
//! `rdma-mummy-sys`, which load libibverbs at run time: a binary built with
//! `hw` starts on hosts without it and reports "no RDMA devices".

pub mod plan;
pub mod slab;
pub mod track;

#[cfg(feature = "hw")]
mod ibv;
#[cfg(feature = "hw")]
pub use ibv::{HwConfig, HwProvider};
