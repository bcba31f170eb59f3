//! The crate's one `unsafe` block: registering a completion-event fd with
//! tokio's reactor. Exercised by `soft::cq::tests` (every completion seen once
//! through the fd) and by every connection of the RDMA transport.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::OwnedFd;

use tokio::io::unix::AsyncFd;

/// Wrap an owned event fd for readiness waits under the current runtime.
pub(crate) fn register(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: `fd` is an `OwnedFd`: valid and open, moved into the `AsyncFd`,
    // which is its only owner, so it stays open and keeps the same number until
    // the `AsyncFd` is dropped (an `OwnedFd` always returns the same raw fd).
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}
