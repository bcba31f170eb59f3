//! Counters users can read: per connection and process-wide.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use serde::{Deserialize, Serialize};

macro_rules! counters {
    ($(#[doc = $doc:literal] $name:ident),* $(,)?) => {
        /// Live counters, updated with relaxed atomics.
        #[derive(Debug, Default)]
        pub struct Stats {
            $(#[doc = $doc] pub $name: AtomicU64,)*
        }

        /// A point-in-time copy of [`Stats`].
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
        pub struct StatsSnapshot {
            $(#[doc = $doc] pub $name: u64,)*
        }

        impl Stats {
            /// Copy all counters.
            pub fn snapshot(&self) -> StatsSnapshot {
                StatsSnapshot { $($name: self.$name.load(Ordering::Relaxed),)* }
            }
        }

        impl StatsSnapshot {
            /// Add every counter of `other` to this one (a connection's lanes).
            pub fn add(&mut self, other: &StatsSnapshot) {
                $(self.$name += other.$name;)*
            }

            /// Every counter as (name, help text, value), in declaration order.
            pub fn fields(&self) -> Vec<(&'static str, &'static str, u64)> {
                vec![$((stringify!($name), $doc.trim(), self.$name),)*]
            }
        }
    };
}

counters! {
    /// Payload bytes this side sent (messages and one-sided data).
    bytes_sent,
    /// Payload bytes this side received.
    bytes_received,
    /// Messages sent.
    sends,
    /// Messages (and write-with-immediate notices) received.
    recvs,
    /// One-sided reads completed.
    reads,
    /// One-sided writes completed.
    writes,
    /// Atomics completed.
    atomics,
    /// Operations that failed.
    errors,
    /// Operations that hit their deadline.
    timeouts,
    /// One-sided accesses from the peer that were served.
    remote_ops_served,
    /// One-sided accesses from the peer that were refused.
    remote_access_denied,
    /// Times a send waited because the peer had no receive credits left.
    credit_stalls,
    /// Packets retransmitted (RDMA transports).
    retransmits,
    /// NAKs received (RDMA transports).
    naks,
    /// Retransmission timer expiries (RDMA transports; soft RoCE counts them).
    retransmit_timeouts,
    /// Tail-loss probes sent after the peer fell silent (soft RoCE, selective repeat).
    tail_probes,
    /// RNR NAKs received (RDMA transports).
    rnr_naks,
    /// Congestion notification packets handled (RDMA transports).
    cnps,
    /// Connections that fell back from RDMA to TCP.
    fallbacks,
    /// Handshakes that failed (version, auth, malformed).
    handshake_failures,
    /// Incoming connections a server refused or failed to set up (it kept accepting).
    accept_errors,
    /// Connections opened.
    connections,
    /// Write system calls on the socket (TCP transport): operations per call show the coalescing.
    socket_writes,
    /// Read system calls on the socket (TCP transport), those that found nothing included.
    socket_reads,
    /// SENDs that carried several messages (RDMA transports): `sends` per bundle shows the bundling.
    bundles_sent,
}

impl Stats {
    /// Add `n` to a counter of this set and of the process-wide set.
    ///
    /// Inlined across crates, so that `pick` becomes a field access (every
    /// transport counts several of these per operation; out of line it was
    /// a call and an indirect call each, 1-3% of soft RoCE's CPU).
    #[inline]
    pub fn add(&self, pick: fn(&Stats) -> &AtomicU64, n: u64) {
        pick(self).fetch_add(n, Ordering::Relaxed);
        let g = global();
        if !std::ptr::eq(self, g) {
            pick(g).fetch_add(n, Ordering::Relaxed);
        }
    }
}

/// Process-wide counters (the sum over all connections, plus fallbacks).
pub fn global() -> &'static Stats {
    static GLOBAL: OnceLock<Stats> = OnceLock::new();
    GLOBAL.get_or_init(Stats::default)
}

/// A fresh per-connection counter set.
pub fn new_stats() -> Arc<Stats> {
    Arc::new(Stats::default())
}
