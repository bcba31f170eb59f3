//! Counters and a latency histogram per client or server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use serde::Serialize;

/// RPC counters (calls, errors, bytes) and call latency.
#[derive(Debug)]
pub struct RpcStats {
    calls: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
    inline: AtomicU64,
    batches: AtomicU64,
    batched_frames: AtomicU64,
    latency_ns: Mutex<Histogram<u64>>,
}

impl Default for RpcStats {
    fn default() -> Self {
        RpcStats {
            calls: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            inline: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batched_frames: AtomicU64::new(0),
            latency_ns: Mutex::new(
                Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("histogram bounds"),
            ),
        }
    }
}

/// A copy of [`RpcStats`] at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct RpcStatsSnapshot {
    /// Calls finished (successfully or not).
    pub calls: u64,
    /// Calls that failed.
    pub errors: u64,
    /// Body bytes answered (server) or received (client).
    pub bytes: u64,
    /// Calls a server answered inline, in the connection's own task (the
    /// handler finished at its first poll), rather than in a task of their own.
    pub inline: u64,
    /// Batches of frames sent together (one `send_many`: one `writev` on
    /// TCP), because several calls or answers were ready at once.
    pub batches: u64,
    /// Frames those batches carried (`batched_frames / batches`: frames per send).
    pub batched_frames: u64,
    /// Median call latency, microseconds.
    pub p50_us: f64,
    /// 99th percentile call latency, microseconds.
    pub p99_us: f64,
}

impl RpcStats {
    /// Count one finished call.
    pub fn record(&self, took: Duration, bytes: u64, failed: bool) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        if failed {
            self.errors.fetch_add(1, Ordering::Relaxed);
        }
        let _ = self
            .latency_ns
            .lock()
            .record((took.as_nanos() as u64).max(1));
    }

    /// Count a call refused before it ran.
    pub fn record_error(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a call a server answered inline (without a task of its own).
    pub fn record_inline(&self) {
        self.inline.fetch_add(1, Ordering::Relaxed);
    }

    /// Count one batch of `frames` frames sent together.
    pub fn record_batch(&self, frames: usize) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.batched_frames
            .fetch_add(frames as u64, Ordering::Relaxed);
    }

    /// The current values.
    pub fn snapshot(&self) -> RpcStatsSnapshot {
        let h = self.latency_ns.lock();
        let q = |q: f64| {
            if h.is_empty() {
                0.0
            } else {
                h.value_at_quantile(q) as f64 / 1000.0
            }
        };
        RpcStatsSnapshot {
            calls: self.calls.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            inline: self.inline.load(Ordering::Relaxed),
            batches: self.batches.load(Ordering::Relaxed),
            batched_frames: self.batched_frames.load(Ordering::Relaxed),
            p50_us: q(0.5),
            p99_us: q(0.99),
        }
    }
}
