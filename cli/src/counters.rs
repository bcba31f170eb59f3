//! Protocol counters of an RDMA run (retransmissions, timer expiries, tail
//! probes, NAKs, CNPs), as `rdmx soak` and `rdmx perf` report them: what a
//! lossy or congested path cost, beside the goodput it left.

use rdmx_core::{Connection, StatsSnapshot};
use serde::Serialize;

/// Protocol counters of an RDMA run.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct RdmaCounters {
    pub(crate) retransmits: u64,
    pub(crate) retransmit_timeouts: u64,
    pub(crate) tail_probes: u64,
    pub(crate) naks: u64,
    pub(crate) rnr_naks: u64,
    pub(crate) cnps: u64,
    /// Packets that arrived CE-marked (a soft RoCE device counter: absent
    /// where the run did not read the device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ce_marked: Option<u64>,
    /// Datagrams this end's send bursts took from its receive queues (soft
    /// RoCE: it listens while sending after the peer reported a loss; a
    /// device counter, as `ce_marked`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) rx_while_sending: Option<u64>,
}

impl RdmaCounters {
    /// What a run moved on `conn`'s counters between two snapshots; `None`
    /// over TCP, which has no such protocol.
    pub(crate) fn between(
        conn: &Connection,
        before: &StatsSnapshot,
        after: &StatsSnapshot,
    ) -> Option<RdmaCounters> {
        (conn.transport() != "tcp").then(|| RdmaCounters {
            retransmits: after.retransmits - before.retransmits,
            retransmit_timeouts: after.retransmit_timeouts - before.retransmit_timeouts,
            tail_probes: after.tail_probes - before.tail_probes,
            naks: after.naks - before.naks,
            rnr_naks: after.rnr_naks - before.rnr_naks,
            cnps: after.cnps - before.cnps,
            ce_marked: None,
            rx_while_sending: None,
        })
    }
}

impl std::fmt::Display for RdmaCounters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "retransmits {} ({} timer expiries, {} tail probes), NAKs {}, RNR NAKs {}, CNPs {}",
            self.retransmits,
            self.retransmit_timeouts,
            self.tail_probes,
            self.naks,
            self.rnr_naks,
            self.cnps
        )?;
        if let Some(n) = self.ce_marked {
            write!(f, ", CE-marked {n}")?;
        }
        if let Some(n) = self.rx_while_sending {
            write!(f, ", taken while sending {n}")?;
        }
        Ok(())
    }
}
