//! A closed-loop load generator for memcached's text protocol, shaped like
//! `redis-benchmark -t set,get`: `-c` connections, `-P` requests pipelined
//! per connection, values of `-d` bytes, keys drawn uniformly from `-r`.
//! It measures memcached (the baseline the KV benchmark compares with) the
//! way redis-benchmark measures Redis and the rdmx gateway, and prints one
//! JSON object per test: requests per second, p50 and p99 in milliseconds.
//!
//! `cargo run --release -p rdmx-kv --example memcached_load -- 127.0.0.1:11211 -c 50 -d 100 -r 100000 -n 200000 -P 1`

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hdrhistogram::Histogram;
use parking_lot::Mutex;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

struct Args {
    addr: String,
    conns: usize,
    size: usize,
    keys: u64,
    requests: u64,
    pipeline: usize,
}

fn args() -> Args {
    let mut a = Args {
        addr: "127.0.0.1:11211".into(),
        conns: 50,
        size: 100,
        keys: 100_000,
        requests: 100_000,
        pipeline: 1,
    };
    let v: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < v.len() {
        let next = || {
            v.get(i + 1)
                .expect("a value after the flag")
                .parse::<u64>()
                .expect("a number")
        };
        match v[i].as_str() {
            "-c" => a.conns = next() as usize,
            "-d" => a.size = next() as usize,
            "-r" => a.keys = next(),
            "-n" => a.requests = next(),
            "-P" => a.pipeline = next() as usize,
            addr => {
                a.addr = addr.to_string();
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    a
}

/// Read one reply: `STORED` for a set; `VALUE … END` or `END` for a get.
async fn reply(
    r: &mut BufReader<tokio::net::tcp::OwnedReadHalf>,
    line: &mut String,
) -> std::io::Result<()> {
    line.clear();
    r.read_line(line).await?;
    if let Some(rest) = line.strip_prefix("VALUE ") {
        let len: usize = rest
            .split_whitespace()
            .nth(2)
            .and_then(|n| n.parse().ok())
            .expect("VALUE length");
        let mut skip = vec![0u8; len + 2];
        r.read_exact(&mut skip).await?;
        line.clear();
        r.read_line(line).await?;
        assert_eq!(line.trim_end(), "END");
    } else {
        assert!(
            line.starts_with("STORED") || line.starts_with("END"),
            "unexpected reply {line:?}"
        );
    }
    Ok(())
}

async fn test(a: &Args, set: bool) -> (f64, f64, f64) {
    let left = Arc::new(AtomicU64::new(a.requests));
    let hist = Arc::new(Mutex::new(
        Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds"),
    ));
    let value = vec![b'x'; a.size];
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..a.conns {
        let (left, hist, value, addr, keys, depth) = (
            left.clone(),
            hist.clone(),
            value.clone(),
            a.addr.clone(),
            a.keys,
            a.pipeline,
        );
        tasks.push(tokio::spawn(async move {
            let s = TcpStream::connect(&addr)
                .await
                .expect("connect to memcached");
            s.set_nodelay(true).expect("nodelay");
            let (r, mut w) = s.into_split();
            let mut r = BufReader::new(r);
            let mut rng = rand::rngs::StdRng::seed_from_u64(c as u64);
            let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("bounds");
            let (mut req, mut line) = (Vec::new(), String::new());
            loop {
                let n = (0..depth)
                    .take_while(|_| {
                        left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                            l.checked_sub(1)
                        })
                        .is_ok()
                    })
                    .count();
                if n == 0 {
                    break;
                }
                req.clear();
                for _ in 0..n {
                    let k = rng.random_range(0..keys);
                    if set {
                        req.extend_from_slice(
                            format!("set key:{k:012} 0 0 {}\r\n", value.len()).as_bytes(),
                        );
                        req.extend_from_slice(&value);
                        req.extend_from_slice(b"\r\n");
                    } else {
                        req.extend_from_slice(format!("get key:{k:012}\r\n").as_bytes());
                    }
                }
                let t = Instant::now();
                w.write_all(&req).await.expect("write");
                for _ in 0..n {
                    reply(&mut r, &mut line).await.expect("reply");
                }
                // Each request of a pipelined batch took the batch's time, as
                // redis-benchmark counts it.
                let ns = t.elapsed().as_nanos() as u64;
                h.record_n(ns.max(1), n as u64).expect("in bounds");
            }
            hist.lock().add(&h).expect("same bounds");
        }));
    }
    for t in tasks {
        t.await.expect("load task");
    }
    let secs = t0.elapsed().as_secs_f64();
    let h = hist.lock();
    (
        a.requests as f64 / secs,
        h.value_at_quantile(0.5) as f64 / 1e6,
        h.value_at_quantile(0.99) as f64 / 1e6,
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let a = args();
    for (name, set) in [("SET", true), ("GET", false)] {
        let (rps, p50, p99) = test(&a, set).await;
        println!(
            "{{\"test\":\"{name}\",\"rps\":{rps:.1},\"p50_ms\":{p50:.3},\"p99_ms\":{p99:.3},\"conns\":{},\"pipeline\":{},\"size\":{}}}",
            a.conns, a.pipeline, a.size
        );
    }
}
