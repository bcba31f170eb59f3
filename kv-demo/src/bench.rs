//! `rdmx kv bench`: the native client under a YCSB-style load: keys chosen
//! by a Zipf distribution (YCSB's default constant 0.99) over `keys` keys, a
//! GET/SET mix (95/5 is YCSB-B), fixed-size values, GETs by one-sided reads
//! or by RPC. Reports throughput, latency percentiles, the hit ratio, and the
//! nodes' CPU seconds per million GETs (from the nodes' own `stats`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use rand::SeedableRng;
use rand_distr::{Distribution, Zipf};
use serde::Serialize;

use crate::client::{Client, GetPath, KvError};
use crate::node::Ttl;
use crate::store::Cond;

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Distinct keys.
    pub keys: u64,
    /// Zipf constant (0: uniform).
    pub zipf: f64,
    /// Share of GETs (the rest are SETs).
    pub get_ratio: f64,
    /// Value size in bytes.
    pub value: usize,
    /// GET path.
    pub path: GetPath,
    /// How long to run (after loading).
    pub duration: Duration,
    /// Operations in flight.
    pub concurrency: usize,
    /// Keys loaded before the run (the hottest first).
    pub load: u64,
}

/// What a run measured.
#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    /// "one-sided" or "rpc".
    pub path: String,
    /// Value size.
    pub value: usize,
    /// GET share.
    pub get_ratio: f64,
    /// Operations per second.
    pub ops_per_s: f64,
    /// GETs done.
    pub gets: u64,
    /// SETs done.
    pub sets: u64,
    /// GET latency p50, µs.
    pub get_p50_us: f64,
    /// GET latency p99, µs.
    pub get_p99_us: f64,
    /// SET latency p50, µs (0 without SETs).
    pub set_p50_us: f64,
    /// GETs that found a value.
    pub hit_ratio: f64,
    /// Node CPU seconds (all nodes) per million GETs, over the run.
    pub node_cpu_s_per_m_gets: f64,
    /// One-sided reads retried (torn or moving items).
    pub retries: u64,
    /// READs per one-sided GET (1: every hit found by a remembered pointer).
    pub reads_per_get: f64,
}

/// The key of rank `rank`: `key:` and the rank in at least ten digits,
/// written without the formatting machinery below 10^10 (it was 2.5% of
/// the one-sided bench client's CPU, on both paths alike: key writing is
/// no part of what the bench measures).
fn key(rank: u64) -> Vec<u8> {
    if rank >= 10_000_000_000 {
        return format!("key:{rank}").into_bytes();
    }
    let mut k = b"key:0000000000".to_vec();
    let mut r = rank;
    for d in k[4..].iter_mut().rev() {
        *d = b'0' + (r % 10) as u8;
        r /= 10;
    }
    k
}

fn value(rank: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (rank as usize).wrapping_mul(31).wrapping_add(i) as u8)
        .collect()
}

/// Load the hottest `cfg.load` keys.
pub async fn load(client: &Client, cfg: &BenchConfig) -> Result<(), KvError> {
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let tasks = (0..cfg.concurrency.max(1)).map(|_| {
        let (c, next, n, len) = (client.clone(), next.clone(), cfg.load, cfg.value);
        tokio::spawn(async move {
            loop {
                let r = next.fetch_add(1, Ordering::Relaxed);
                if r >= n {
                    return Ok::<_, KvError>(());
                }
                c.set(&key(r), &value(r, len), Ttl::Never, Cond::Always)
                    .await?;
            }
        })
    });
    for t in futures_util::future::join_all(tasks).await {
        t.expect("load task")?;
    }
    Ok(())
}

/// Run the mix for `cfg.duration` (load first with [`load`]).
pub async fn run(client: &Client, cfg: &BenchConfig) -> Result<BenchReport, KvError> {
    let before = client.node_stats().await?;
    let retries0 = client.counters().one_sided_retries.load(Ordering::Relaxed);
    let reads0 = client.counters().one_sided_reads.load(Ordering::Relaxed);
    // One histogram of each kind for every task, locked per sample (an
    // uncontended lock on one worker): a histogram per task (about 220 KiB
    // each at these bounds) cost a cache miss per sample once 32 of them
    // were in use: 2.1% of the one-sided client's CPU, 0.24% with one.
    let hist = || Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
    let gets_h = Arc::new(Mutex::new(hist()));
    let sets_h = Arc::new(Mutex::new(hist()));
    let hits = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let zipf = Zipf::new(cfg.keys as f64, cfg.zipf.max(0.0))
        .map_err(|e| KvError::Refused(e.to_string()))?;
    let t0 = Instant::now();
    let tasks = (0..cfg.concurrency.max(1)).map(|w| {
        let (c, gets_h, sets_h, hits, stop) = (
            client.clone(),
            gets_h.clone(),
            sets_h.clone(),
            hits.clone(),
            stop.clone(),
        );
        let cfg = cfg.clone();
        tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(w as u64 + 1);
            let mut h = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let rank = zipf.sample(&mut rng) as u64 - 1;
                let t = Instant::now();
                if rand::Rng::random_bool(&mut rng, cfg.get_ratio.clamp(0.0, 1.0)) {
                    if c.get_with(&key(rank), cfg.path).await?.is_some() {
                        h += 1;
                    }
                    let ns = t.elapsed().as_nanos() as u64;
                    gets_h.lock().record(ns).expect("in bounds");
                } else {
                    c.set(
                        &key(rank),
                        &value(rank, cfg.value),
                        Ttl::Never,
                        Cond::Always,
                    )
                    .await?;
                    let ns = t.elapsed().as_nanos() as u64;
                    sets_h.lock().record(ns).expect("in bounds");
                }
            }
            hits.fetch_add(h, Ordering::Relaxed);
            Ok::<_, KvError>(())
        })
    });
    let tasks: Vec<_> = tasks.collect();
    tokio::time::sleep(cfg.duration).await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.expect("bench task")?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let after = client.node_stats().await?;
    let cpu: f64 = after.iter().map(|(_, s)| s.cpu_seconds).sum::<f64>()
        - before.iter().map(|(_, s)| s.cpu_seconds).sum::<f64>();
    let (g, s) = (gets_h.lock().clone(), sets_h.lock().clone());
    let us = |h: &Histogram<u64>, q: f64| {
        if h.is_empty() {
            0.0
        } else {
            h.value_at_quantile(q) as f64 / 1000.0
        }
    };
    let gets = g.len();
    Ok(BenchReport {
        path: match cfg.path {
            GetPath::OneSided => "one-sided".into(),
            GetPath::Rpc => "rpc".into(),
        },
        value: cfg.value,
        get_ratio: cfg.get_ratio,
        ops_per_s: (gets + s.len()) as f64 / secs,
        gets,
        sets: s.len(),
        get_p50_us: us(&g, 0.5),
        get_p99_us: us(&g, 0.99),
        set_p50_us: us(&s, 0.5),
        hit_ratio: hits.load(Ordering::Relaxed) as f64 / gets.max(1) as f64,
        node_cpu_s_per_m_gets: cpu / (gets.max(1) as f64 / 1e6),
        retries: client.counters().one_sided_retries.load(Ordering::Relaxed) - retries0,
        reads_per_get: match cfg.path {
            GetPath::OneSided => {
                (client.counters().one_sided_reads.load(Ordering::Relaxed) - reads0) as f64
                    / gets.max(1) as f64
            }
            GetPath::Rpc => 0.0,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::key;

    #[test]
    fn keys_are_the_rank_in_ten_digits_or_more() {
        assert_eq!(key(0), b"key:0000000000");
        assert_eq!(key(42), b"key:0000000042");
        assert_eq!(key(9_999_999_999), b"key:9999999999");
        assert_eq!(key(10_000_000_000), b"key:10000000000");
        assert_eq!(key(u64::MAX), b"key:18446744073709551615");
    }
}
