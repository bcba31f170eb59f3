//! Counters of an NBD export users can read (`rdmx block nbd --metrics`):
//! client connections, requests and bytes per command, error replies, a
//! latency histogram of requests as the export serves them (from the whole
//! request read to its outcome known, before the reply is written),
//! rendered as Prometheus text.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use super::proto::cmd;
use crate::metrics::LatencyHistogram;

/// The label of each counted command, by NBD command number (NBD
/// `doc/proto.md`, "Request types"); anything else counts as `other`.
const COMMANDS: [&str; 8] = [
    "read",
    "write",
    "disc",
    "flush",
    "trim",
    "cache",
    "write_zeroes",
    "block_status",
];
const OTHER: usize = COMMANDS.len();

fn slot(kind: u16) -> usize {
    usize::from(kind).min(OTHER)
}

/// Counters of one NBD export (all its client connections).
#[derive(Default)]
pub struct NbdStats {
    /// Client connections accepted.
    pub connections_total: AtomicU64,
    /// Client connections open now (negotiating or transmitting).
    pub connections: AtomicI64,
    /// Connections ended by the client breaking the protocol (negotiation
    /// or a request without its magic).
    pub protocol_errors: AtomicU64,
    /// Requests being served now.
    pub inflight: AtomicI64,
    requests: [AtomicU64; OTHER + 1],
    bytes: [AtomicU64; OTHER + 1],
    errors: [AtomicU64; OTHER + 1],
    latency: LatencyHistogram,
}

impl std::fmt::Debug for NbdStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdStats")
            .field("connections_total", &self.connections_total)
            .field("connections", &self.connections)
            .field(
                "requests",
                &self.requests.iter().map(|r| r.load(Relaxed)).sum::<u64>(),
            )
            .finish()
    }
}

impl NbdStats {
    /// Count one answered request of command `kind`: the bytes of the export
    /// it covered (0 if it failed), whether it failed, and how long it took.
    pub fn record(&self, kind: u16, bytes: u64, failed: bool, took: Duration) {
        let i = slot(kind);
        self.requests[i].fetch_add(1, Relaxed);
        self.bytes[i].fetch_add(bytes, Relaxed);
        if failed {
            self.errors[i].fetch_add(1, Relaxed);
        }
        self.latency.record(took);
    }

    /// Requests of command `kind` answered so far.
    pub fn requests(&self, kind: u16) -> u64 {
        self.requests[slot(kind)].load(Relaxed)
    }

    /// Bytes moved by requests of command `kind` so far.
    pub fn bytes(&self, kind: u16) -> u64 {
        self.bytes[slot(kind)].load(Relaxed)
    }

    /// Error replies to requests of command `kind` so far.
    pub fn errors(&self, kind: u16) -> u64 {
        self.errors[slot(kind)].load(Relaxed)
    }

    /// Append the counters as Prometheus text.
    pub fn render(&self, out: &mut String) {
        let per_command = |out: &mut String, name: &str, help: &str, v: &[AtomicU64]| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (i, c) in v.iter().enumerate() {
                // DISC is never answered: no line for it.
                if i == usize::from(cmd::DISC) {
                    continue;
                }
                let label = COMMANDS.get(i).copied().unwrap_or("other");
                let _ = writeln!(out, "{name}{{command=\"{label}\"}} {}", c.load(Relaxed));
            }
        };
        per_command(
            out,
            "rdmx_nbd_requests_total",
            "NBD requests answered, per command.",
            &self.requests,
        );
        per_command(
            out,
            "rdmx_nbd_bytes_total",
            "Bytes of the export covered by NBD requests answered without error \
             (read, written, zeroed, trimmed, cached), per command.",
            &self.bytes,
        );
        per_command(
            out,
            "rdmx_nbd_errors_total",
            "NBD requests answered with an error, per command.",
            &self.errors,
        );
        let _ = writeln!(
            out,
            "# HELP rdmx_nbd_latency_seconds NBD request service time in the export.\n\
             # TYPE rdmx_nbd_latency_seconds histogram"
        );
        self.latency.render(out, "rdmx_nbd_latency_seconds", "");
        let _ = writeln!(
            out,
            "# HELP rdmx_nbd_inflight NBD requests being served now.\n\
             # TYPE rdmx_nbd_inflight gauge\n\
             rdmx_nbd_inflight {}\n\
             # HELP rdmx_nbd_connections NBD client connections open now.\n\
             # TYPE rdmx_nbd_connections gauge\n\
             rdmx_nbd_connections {}\n\
             # HELP rdmx_nbd_connections_total NBD client connections accepted.\n\
             # TYPE rdmx_nbd_connections_total counter\n\
             rdmx_nbd_connections_total {}\n\
             # HELP rdmx_nbd_protocol_errors_total NBD connections ended by a client breaking the protocol.\n\
             # TYPE rdmx_nbd_protocol_errors_total counter\n\
             rdmx_nbd_protocol_errors_total {}",
            self.inflight.load(Relaxed),
            self.connections.load(Relaxed),
            self.connections_total.load(Relaxed),
            self.protocol_errors.load(Relaxed),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_render_per_command_and_cumulatively() {
        let s = NbdStats::default();
        s.record(cmd::READ, 4096, false, Duration::from_micros(30));
        s.record(cmd::READ, 8192, false, Duration::from_millis(2));
        s.record(cmd::WRITE, 512, true, Duration::from_secs(3));
        s.record(99, 0, true, Duration::ZERO);
        s.connections_total.fetch_add(2, Relaxed);
        s.connections.fetch_add(1, Relaxed);
        assert_eq!((s.requests(cmd::READ), s.bytes(cmd::READ)), (2, 12288));
        assert_eq!((s.errors(cmd::WRITE), s.errors(77)), (1, 1));
        let mut out = String::new();
        s.render(&mut out);
        for line in [
            "rdmx_nbd_requests_total{command=\"read\"} 2",
            "rdmx_nbd_bytes_total{command=\"read\"} 12288",
            "rdmx_nbd_errors_total{command=\"write\"} 1",
            "rdmx_nbd_errors_total{command=\"other\"} 1",
            "rdmx_nbd_requests_total{command=\"flush\"} 0",
            "rdmx_nbd_latency_seconds_bucket{le=\"0.00005\"} 2",
            "rdmx_nbd_latency_seconds_bucket{le=\"0.0025\"} 3",
            "rdmx_nbd_latency_seconds_bucket{le=\"+Inf\"} 4",
            "rdmx_nbd_latency_seconds_count 4",
            "rdmx_nbd_connections 1",
            "rdmx_nbd_connections_total 2",
        ] {
            assert!(out.lines().any(|l| l == line), "{line} in\n{out}");
        }
        assert!(!out.contains("command=\"disc\""), "{out}");
    }
}
