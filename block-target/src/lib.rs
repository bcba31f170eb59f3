//! rdmx-block: an NVMe over Fabrics target that the Linux kernel's own
//! NVMe/TCP host connects to, formats and mounts.
//!
//! * [`target`]: the transport-neutral core (as SPDK's nvmf target): one NVM
//!   subsystem with RAM- or file-backed namespaces ([`backend`]), the
//!   discovery subsystem, dynamic controllers, and the admin, Fabrics and
//!   NVM I/O commands the Linux host needs, with NVMe statuses for bad input.
//! * [`tcp`]: NVMe/TCP — ICReq/ICResp, capsules, in-capsule data,
//!   R2T/H2CData, C2HData, header and data digests (CRC32C), and a discovery
//!   controller when served on port 8009.
//! * [`fabric`]: NVMe over rdmx — the NVMe-oF RDMA flow (command capsules
//!   by SEND, data by one-sided READ and WRITE into the host's registered
//!   memory) on any rdmx transport, and [`fabric::Initiator`], the host side
//!   as an async block device.
//! * [`nbd`]: an NBD server (fixed newstyle, GO/INFO with block sizes,
//!   structured replies, FLUSH, FUA, TRIM, WRITE_ZEROES, multi-conn) backed
//!   by the Initiator, for nbd-client, qemu-img, nbdcopy and fio.
//! * [`metrics`]: operations, bytes and latency per namespace, errors,
//!   queue depth and connections as Prometheus text.
//!
//! ```no_run
//! # async fn run() -> std::io::Result<()> {
//! use std::sync::Arc;
//! use rdmx_block::{backend::RamBackend, target::{Target, TargetConfig}};
//! let target = Target::new(TargetConfig::default());
//! target.add_namespace(Arc::new(RamBackend::new(1 << 30)?)).unwrap();
//! let io = tokio::net::TcpListener::bind("0.0.0.0:4420").await?;
//! let disc = tokio::net::TcpListener::bind("0.0.0.0:8009").await?;
//! tokio::spawn(rdmx_block::tcp::serve(disc, target.clone(), false));
//! rdmx_block::tcp::serve(io, target, true).await;
//! # Ok(()) }
//! ```

#![forbid(unsafe_code)]

pub mod backend;
pub mod fabric;
pub mod metrics;
pub mod nbd;
pub mod nvme;
pub mod target;
pub mod tcp;
