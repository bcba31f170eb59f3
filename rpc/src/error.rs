//! Errors of an RPC call: what the application said, and what went wrong on
//! the way, as distinct variants.

use thiserror::Error;

/// Why a call failed.
#[derive(Debug, Clone, Error)]
pub enum RpcError {
    /// The handler ran and returned an error (its message).
    #[error("application error: {0}")]
    App(String),
    /// The connection failed underneath (rdmx transport error).
    #[error("transport: {0}")]
    Transport(#[from] rdmx_core::Error),
    /// The call's deadline passed (on the client or the server).
    #[error("deadline exceeded")]
    DeadlineExceeded,
    /// The call was cancelled.
    #[error("cancelled")]
    Cancelled,
    /// The server has no such method.
    #[error("unknown method {0:#010x}")]
    UnknownMethod(u32),
    /// The server's per-connection limit of calls in flight was reached.
    #[error("server overloaded (too many calls in flight on this connection)")]
    Overloaded,
    /// The server is shutting down and takes no new calls.
    #[error("server is shutting down")]
    ShuttingDown,
    /// Client and server disagree on the service (name, version or methods).
    #[error("incompatible service: {0}")]
    Incompatible(String),
    /// A request or response did not (de)serialise.
    #[error("codec: {0}")]
    Codec(String),
    /// The peer broke the RPC protocol.
    #[error("protocol: {0}")]
    Protocol(String),
}

impl RpcError {
    /// True if the error came from the application's handler, not the system.
    pub fn is_app(&self) -> bool {
        matches!(self, RpcError::App(_))
    }
}
