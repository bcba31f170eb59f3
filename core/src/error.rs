//! Errors a user can act on.

use std::time::Duration;

use thiserror::Error;

/// Why a remote (or local) memory access was refused.
///
/// These mirror the checks an RDMA NIC performs on every one-sided access
/// (R_Key, range and access rights; a violation is NAK 0x62, rocev2-reference §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error, serde::Serialize, serde::Deserialize)]
pub enum AccessError {
    /// The remote key names no region registered in the peer's domain.
    #[error("unknown remote key (no region with it in the domain the peer serves: was it registered in the Domain of the Options the peer listens or connects with?)")]
    UnknownKey,
    /// The access reaches outside the registered region.
    #[error("access out of bounds")]
    OutOfBounds,
    /// The region was registered without the access right this operation needs.
    #[error("permission denied by region access flags")]
    Permission,
    /// The region was deregistered; its key no longer grants access.
    #[error("region was deregistered (key revoked: its MemoryRegion was dropped or deregistered)")]
    Revoked,
    /// Atomics need an 8-byte, 8-byte-aligned remote word.
    #[error("atomic target is not an aligned 8-byte word")]
    Misaligned,
}

impl AccessError {
    /// Stable wire code (1..=5) used by software transports.
    pub fn code(self) -> u8 {
        match self {
            AccessError::UnknownKey => 1,
            AccessError::OutOfBounds => 2,
            AccessError::Permission => 3,
            AccessError::Revoked => 4,
            AccessError::Misaligned => 5,
        }
    }

    /// Inverse of [`AccessError::code`].
    pub fn from_code(code: u8) -> Option<Self> {
        Some(match code {
            1 => AccessError::UnknownKey,
            2 => AccessError::OutOfBounds,
            3 => AccessError::Permission,
            4 => AccessError::Revoked,
            5 => AccessError::Misaligned,
            _ => return None,
        })
    }
}

/// Every failure an rdmx operation can report.
#[derive(Debug, Clone, Error)]
pub enum Error {
    /// The peer refused a one-sided access to its memory.
    #[error("remote access denied: {0}")]
    RemoteAccess(AccessError),
    /// A local region slice could not be used (deregistered, or out of its bounds).
    #[error("local access error: {0}")]
    LocalAccess(AccessError),
    /// The connection is gone (peer closed, crashed, or the link failed).
    #[error("disconnected: {0}")]
    Disconnected(String),
    /// The operation did not complete within its deadline.
    #[error("operation timed out after {0:?}")]
    TimedOut(Duration),
    /// The peer sent something the protocol does not allow; the connection is closed.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// The two ends speak different protocol versions.
    #[error("protocol version mismatch: local {local}, peer {peer}")]
    VersionMismatch {
        /// Our version.
        local: u16,
        /// The peer's version.
        peer: u16,
    },
    /// Shared-secret authentication failed (wrong or missing secret on one side).
    #[error("authentication failed: {0}")]
    AuthFailed(String),
    /// A limit was reached (message too large for the peer's buffers, too many regions...).
    #[error("resource exhausted: {0}")]
    ResourceExhausted(String),
    /// The caller passed an argument no transport could accept.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// RDMA was required by policy but cannot be had; the reason says why.
    #[error("RDMA unavailable: {0}")]
    RdmaUnavailable(String),
    /// The transport cannot perform this operation.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The operation was interrupted in a way that leaves its outcome unknown:
    /// it may or may not have taken effect at the peer (e.g. an atomic whose
    /// answer was lost when an RDMA queue pair was reset). Not retried for you.
    #[error("outcome unknown: {0}")]
    Indeterminate(String),
    /// Establishing the connection failed (resolve, connect, listen).
    #[error("connect failed: {0}")]
    Connect(String),
}

impl Error {
    /// True if [`crate::Listener::accept`] failed because the listener stopped
    /// for good (every other accept error is about one connection attempt:
    /// log it and keep accepting).
    pub fn is_listener_stopped(&self) -> bool {
        matches!(self, Error::Disconnected(why) if why == crate::transport::LISTENER_STOPPED)
    }

    /// True if the error means the connection can no longer be used.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::Disconnected(_)
                | Error::Protocol(_)
                | Error::VersionMismatch { .. }
                | Error::AuthFailed(_)
        )
    }
}

/// Result alias used throughout rdmx.
pub type Result<T, E = Error> = std::result::Result<T, E>;
