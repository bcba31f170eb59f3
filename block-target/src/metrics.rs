//! Counters users can read: per-namespace operations and bytes, a latency
//! histogram, errors by status, queue depth and connections, rendered as
//! Prometheus text.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use parking_lot::Mutex;

/// Upper bounds of the latency histogram buckets, in microseconds.
pub const LATENCY_BUCKETS_US: [u64; 12] = [
    25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 50_000, 250_000, 1_000_000,
];

/// A latency histogram over [`LATENCY_BUCKETS_US`], counted with atomics
/// and rendered as a Prometheus histogram in seconds.
#[derive(Default)]
pub struct LatencyHistogram {
    buckets: [AtomicU64; LATENCY_BUCKETS_US.len() + 1],
    sum_us: AtomicU64,
}

impl LatencyHistogram {
    /// Count one observation.
    pub fn record(&self, took: Duration) {
        let us = took.as_micros() as u64;
        let b = LATENCY_BUCKETS_US
            .iter()
            .position(|&le| us <= le)
            .unwrap_or(LATENCY_BUCKETS_US.len());
        self.buckets[b].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
    }

    /// Append the `_bucket`, `_sum` and `_count` lines of histogram `name`;
    /// `labels` (`nsid="1"`, or empty) go before each bucket's `le`.
    pub fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let mut cum = 0;
        for (i, le) in LATENCY_BUCKETS_US.iter().enumerate() {
            cum += self.buckets[i].load(Relaxed);
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{}\"}} {cum}",
                *le as f64 / 1e6
            );
        }
        cum += self.buckets[LATENCY_BUCKETS_US.len()].load(Relaxed);
        let _ = writeln!(
            out,
            "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {cum}\n\
             {name}_sum{braces} {}\n\
             {name}_count{braces} {cum}",
            self.sum_us.load(Relaxed) as f64 / 1e6
        );
    }
}

/// The I/O operations counted per namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoOp {
    /// Read.
    Read,
    /// Write.
    Write,
    /// Flush.
    Flush,
    /// Write Zeroes.
    WriteZeroes,
    /// Dataset Management (deallocate).
    Trim,
}

impl IoOp {
    /// Every operation, in label order.
    pub const ALL: [IoOp; 5] = [
        IoOp::Read,
        IoOp::Write,
        IoOp::Flush,
        IoOp::WriteZeroes,
        IoOp::Trim,
    ];

    /// The Prometheus label value.
    pub fn name(self) -> &'static str {
        match self {
            IoOp::Read => "read",
            IoOp::Write => "write",
            IoOp::Flush => "flush",
            IoOp::WriteZeroes => "write_zeroes",
            IoOp::Trim => "trim",
        }
    }
}

/// Counters of one namespace.
#[derive(Default)]
pub struct NamespaceStats {
    ops: [AtomicU64; 5],
    bytes: [AtomicU64; 5],
    latency: LatencyHistogram,
}

impl NamespaceStats {
    /// Count one finished operation of `bytes` that took `took`.
    pub fn record(&self, op: IoOp, bytes: u64, took: Duration) {
        let i = op as usize;
        self.ops[i].fetch_add(1, Relaxed);
        self.bytes[i].fetch_add(bytes, Relaxed);
        self.latency.record(took);
    }

    /// Operations of a kind so far.
    pub fn ops(&self, op: IoOp) -> u64 {
        self.ops[op as usize].load(Relaxed)
    }

    /// Bytes moved by operations of a kind so far.
    pub fn bytes(&self, op: IoOp) -> u64 {
        self.bytes[op as usize].load(Relaxed)
    }
}

/// Target-wide counters.
#[derive(Default)]
pub struct TargetStats {
    /// Commands being executed now (queue depth, all queues).
    pub inflight: AtomicI64,
    /// Transport connections open now.
    pub connections: AtomicI64,
    /// Connections accepted so far.
    pub connections_total: AtomicU64,
    /// Connections ended by a protocol error (a termination request sent).
    pub protocol_errors: AtomicU64,
    /// Controllers whose keep-alive timer expired.
    pub keep_alive_expired: AtomicU64,
    /// Connections that negotiated a header digest.
    pub header_digest_connections: AtomicU64,
    /// Connections that negotiated a data digest.
    pub data_digest_connections: AtomicU64,
    errors: Mutex<Vec<(&'static str, u64)>>,
}

impl TargetStats {
    /// Count a command that failed with status `name`.
    pub fn error(&self, name: &'static str) {
        let mut e = self.errors.lock();
        match e.iter_mut().find(|(n, _)| *n == name) {
            Some((_, c)) => *c += 1,
            None => e.push((name, 1)),
        }
    }

    /// Failed commands with status `name` so far.
    pub fn errors(&self, name: &str) -> u64 {
        self.errors
            .lock()
            .iter()
            .find(|(n, _)| *n == name)
            .map_or(0, |(_, c)| *c)
    }
}

/// Render the counters as Prometheus text.
pub fn render(out: &mut String, t: &TargetStats, namespaces: &[(u32, &NamespaceStats)]) {
    let _ = writeln!(
        out,
        "# HELP rdmx_block_ops_total I/O commands completed, per namespace and operation.\n\
         # TYPE rdmx_block_ops_total counter"
    );
    for (nsid, s) in namespaces {
        for op in IoOp::ALL {
            let _ = writeln!(
                out,
                "rdmx_block_ops_total{{nsid=\"{nsid}\",op=\"{}\"}} {}",
                op.name(),
                s.ops(op)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP rdmx_block_bytes_total Bytes moved by I/O commands, per namespace and operation.\n\
         # TYPE rdmx_block_bytes_total counter"
    );
    for (nsid, s) in namespaces {
        for op in IoOp::ALL {
            let _ = writeln!(
                out,
                "rdmx_block_bytes_total{{nsid=\"{nsid}\",op=\"{}\"}} {}",
                op.name(),
                s.bytes(op)
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP rdmx_block_latency_seconds I/O command service time in the target.\n\
         # TYPE rdmx_block_latency_seconds histogram"
    );
    for (nsid, s) in namespaces {
        s.latency.render(
            out,
            "rdmx_block_latency_seconds",
            &format!("nsid=\"{nsid}\""),
        );
    }
    let _ = writeln!(
        out,
        "# HELP rdmx_block_queue_depth Commands being executed now.\n\
         # TYPE rdmx_block_queue_depth gauge\n\
         rdmx_block_queue_depth {}\n\
         # HELP rdmx_block_connections Transport connections open now.\n\
         # TYPE rdmx_block_connections gauge\n\
         rdmx_block_connections {}\n\
         # HELP rdmx_block_connections_total Transport connections accepted.\n\
         # TYPE rdmx_block_connections_total counter\n\
         rdmx_block_connections_total {}\n\
         # HELP rdmx_block_protocol_errors_total Connections ended by a protocol error.\n\
         # TYPE rdmx_block_protocol_errors_total counter\n\
         rdmx_block_protocol_errors_total {}\n\
         # HELP rdmx_block_keep_alive_expired_total Controllers dropped by their keep-alive timer.\n\
         # TYPE rdmx_block_keep_alive_expired_total counter\n\
         rdmx_block_keep_alive_expired_total {}\n\
         # HELP rdmx_block_digest_connections_total Connections with CRC32C digests, by kind.\n\
         # TYPE rdmx_block_digest_connections_total counter\n\
         rdmx_block_digest_connections_total{{kind=\"header\"}} {}\n\
         rdmx_block_digest_connections_total{{kind=\"data\"}} {}",
        t.inflight.load(Relaxed),
        t.connections.load(Relaxed),
        t.connections_total.load(Relaxed),
        t.protocol_errors.load(Relaxed),
        t.keep_alive_expired.load(Relaxed),
        t.header_digest_connections.load(Relaxed),
        t.data_digest_connections.load(Relaxed),
    );
    let _ = writeln!(
        out,
        "# HELP rdmx_block_errors_total Commands completed with an error status.\n\
         # TYPE rdmx_block_errors_total counter"
    );
    for (name, c) in t.errors.lock().iter() {
        let _ = writeln!(out, "rdmx_block_errors_total{{status=\"{name}\"}} {c}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let s = NamespaceStats::default();
        s.record(IoOp::Read, 4096, Duration::from_micros(30));
        s.record(IoOp::Read, 4096, Duration::from_millis(2));
        s.record(IoOp::Write, 512, Duration::from_secs(3));
        let t = TargetStats::default();
        t.error("lba_out_of_range");
        let mut out = String::new();
        render(&mut out, &t, &[(1, &s)]);
        assert!(out.contains("rdmx_block_ops_total{nsid=\"1\",op=\"read\"} 2"));
        assert!(out.contains("rdmx_block_bytes_total{nsid=\"1\",op=\"read\"} 8192"));
        assert!(out.contains("rdmx_block_latency_seconds_bucket{nsid=\"1\",le=\"0.00005\"} 1"));
        assert!(out.contains("rdmx_block_latency_seconds_bucket{nsid=\"1\",le=\"0.0025\"} 2"));
        assert!(out.contains("rdmx_block_latency_seconds_bucket{nsid=\"1\",le=\"+Inf\"} 3"));
        assert!(out.contains("rdmx_block_latency_seconds_count{nsid=\"1\"} 3"));
        assert!(out.contains("rdmx_block_latency_seconds_sum{nsid=\"1\"} 3.00203"));
        assert!(out.contains("rdmx_block_errors_total{status=\"lba_out_of_range\"} 1"));
    }
}
