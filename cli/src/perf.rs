//! `rdmx perf`: like perftest's ib_write_bw / ib_read_lat, for any transport.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use hdrhistogram::Histogram;
use rdmx_core::{Access, Connection, Error, Incoming, Options, RemoteRegion, Transports};
use serde::Serialize;
use tokio::net::TcpListener;

use crate::raw::{self, RawClient};

/// Message tag: echo this message back.
const PING: u8 = 1;
/// Message tag: consume silently (bandwidth traffic).
const SINK: u8 = 0;

/// Arguments of `rdmx perf`.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Examples:\n  rdmx perf --loopback --baseline raw-tcp\n  \
    rdmx perf server --listen 0.0.0.0:7471\n  rdmx perf client tcp://198.18.0.1:7471 --op write,read --json\n\n\
    The server also serves the raw-TCP baseline on the next port (7472 for 7471)."
)]
pub(crate) struct PerfArgs {
    /// `server` or `client` (omit with --loopback).
    role: Option<String>,
    /// URL of the server, for `client` (e.g. tcp://198.18.0.1:7471).
    url: Option<String>,
    /// Run server and client in this process, over the loopback interface.
    #[arg(long)]
    loopback: bool,
    /// Server: address to listen on.
    #[arg(long, default_value = "127.0.0.1:7471")]
    listen: String,
    /// Transport for the server and --loopback: tcp, or rdma (a NIC, else the
    /// soft RoCEv2 engine over UDP 4791).
    #[arg(long, default_value = "tcp")]
    transport: String,
    /// Operations: send, write, read, cas, faa (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "send,write,read,cas,faa")]
    op: Vec<String>,
    /// Message sizes (comma-separated; k/m suffixes). cas and faa always use 8.
    #[arg(long, value_delimiter = ',', default_value = "8,64,512,4k,32k,256k,1m")]
    sizes: Vec<String>,
    /// What to measure: lat, bw or both.
    #[arg(long, default_value = "both")]
    mode: String,
    /// Latency iterations per point (fewer for large sizes).
    #[arg(long, default_value_t = 2000)]
    iters: u64,
    /// Bandwidth run length per point, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    duration_ms: u64,
    /// Operations kept in flight for bandwidth runs.
    #[arg(long, default_value_t = 16)]
    window: usize,
    /// Print one JSON object per result instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw latency and bandwidth against size into this SVG file.
    #[arg(long)]
    svg: Option<String>,
    /// Also measure a baseline in the same run and print ratios (raw-tcp).
    #[arg(long)]
    baseline: Option<String>,
    /// Busy-poll sockets for this many microseconds before sleeping (rdmx and baseline).
    #[arg(long)]
    busy_poll_us: Option<u64>,
    /// Shared secret for authentication (both ends).
    #[arg(long)]
    secret: Option<String>,
    /// Transport policy: require, prefer, tcp-only.
    #[arg(long, default_value = "prefer")]
    policy: String,
    /// Write every RoCEv2 packet the soft engine sends during the run to this
    /// pcap file (check it with `rdmx pcap check`, decode it with tshark).
    #[arg(long)]
    capture: Option<String>,
}

/// The baseline's figures for one point.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Baseline {
    pub(crate) name: String,
    pub(crate) p50_us: Option<f64>,
    pub(crate) p99_us: Option<f64>,
    pub(crate) mb_per_s: Option<f64>,
    pub(crate) ops_per_s: Option<f64>,
}

/// One measured point.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct PerfResult {
    pub(crate) transport: String,
    pub(crate) provider: String,
    pub(crate) op: String,
    pub(crate) size: u64,
    pub(crate) iters: u64,
    pub(crate) p50_us: Option<f64>,
    pub(crate) p99_us: Option<f64>,
    pub(crate) p999_us: Option<f64>,
    pub(crate) mb_per_s: Option<f64>,
    pub(crate) ops_per_s: Option<f64>,
    pub(crate) busy_poll: bool,
    pub(crate) baseline: Option<Baseline>,
    /// rdmx p50 latency / baseline p50 latency (lower is better).
    pub(crate) lat_ratio: Option<f64>,
    /// rdmx bandwidth / baseline bandwidth (higher is better).
    pub(crate) bw_ratio: Option<f64>,
}

pub(crate) fn transports() -> Transports {
    Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new())
}

/// A byte count with an optional k, m or g suffix (powers of 1024).
pub(crate) fn parse_size(s: &str) -> Result<u64, Error> {
    let s = s.trim().to_ascii_lowercase();
    let (num, mul) = match s.as_bytes().last() {
        Some(b'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some(b'm') => (&s[..s.len() - 1], 1 << 20),
        Some(b'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s.as_str(), 1),
    };
    num.parse::<u64>()
        .map(|n| n * mul)
        .map_err(|_| Error::InvalidArgument(format!("bad size {s:?}")))
}

fn options(a: &PerfArgs) -> Result<Options, Error> {
    let mut o = Options {
        busy_poll: a.busy_poll_us.map(Duration::from_micros),
        policy: a.policy.parse()?,
        ..Options::default()
    };
    if let Some(s) = &a.secret {
        o = o.secret(s);
    }
    Ok(o)
}

fn err(e: impl std::fmt::Display) -> Error {
    Error::Connect(e.to_string())
}

fn raw_addr_for(rdmx_addr: &str) -> Result<String, Error> {
    let (host, port) = rdmx_addr
        .rsplit_once(':')
        .ok_or_else(|| Error::InvalidArgument(format!("{rdmx_addr} has no port")))?;
    let port: u16 = port
        .parse()
        .map_err(|_| Error::InvalidArgument(format!("bad port in {rdmx_addr}")))?;
    Ok(format!("{host}:{}", port.wrapping_add(1)))
}

pub(crate) async fn run(a: PerfArgs) -> Result<(), Error> {
    let ts = transports();
    if ts.get(&a.transport).is_none() {
        return Err(Error::Unsupported(format!(
            "transport {:?} is not built into this rdmx (available: {ts:?})",
            a.transport
        )));
    }
    if a.loopback {
        let opts = options(&a)?;
        let url = format!("{}://127.0.0.1:0", a.transport);
        let (listener, _) = ts.listen(&url, &opts).await?;
        let addr = listener.local_addr();
        tokio::spawn(serve(listener));
        let raw_l = TcpListener::bind("127.0.0.1:0").await.map_err(err)?;
        let raw_addr = raw_l.local_addr().map_err(err)?.to_string();
        tokio::spawn(raw::serve(raw_l, a.busy_poll_us.map(Duration::from_micros)));
        return client(&a, &format!("{}://{addr}", a.transport), &raw_addr).await;
    }
    match a.role.as_deref() {
        Some("server") => {
            let opts = options(&a)?;
            let raw_addr = raw_addr_for(&a.listen)?;
            let raw_l = TcpListener::bind(&raw_addr).await.map_err(err)?;
            tokio::spawn(raw::serve(raw_l, a.busy_poll_us.map(Duration::from_micros)));
            let (listener, fallback) = ts
                .listen(&format!("{}://{}", a.transport, a.listen), &opts)
                .await?;
            if let Some(f) = fallback {
                eprintln!("rdmx perf: listening on TCP instead ({f})");
            }
            eprintln!(
                "rdmx perf server: {} on {}, raw-tcp baseline on {raw_addr}",
                a.transport,
                listener.local_addr()
            );
            serve(listener).await;
            Ok(())
        }
        Some("client") => {
            let url = a
                .url
                .clone()
                .ok_or_else(|| Error::InvalidArgument("client needs a URL".into()))?;
            let ep: rdmx_core::Endpoint = url.parse()?;
            let raw_addr = raw_addr_for(&ep.addr)?;
            client(&a, &url, &raw_addr).await
        }
        _ => Err(Error::InvalidArgument(
            "use `rdmx perf server`, `rdmx perf client URL` or `rdmx perf --loopback`".into(),
        )),
    }
}

/// The server: per connection, register the region the client asks for, tell
/// it the descriptor, echo PING messages, and serve one-sided ops (the transport
/// does that by itself).
async fn serve(mut listener: rdmx_core::Listener) {
    loop {
        match listener.accept().await {
            Ok(conn) => {
                tokio::spawn(async move {
                    if let Err(e) = serve_conn(conn).await {
                        if !matches!(e, Error::Disconnected(_)) {
                            eprintln!("rdmx perf server: {e}");
                        }
                    }
                });
            }
            Err(e) => eprintln!("rdmx perf server: {e}"),
        }
    }
}

async fn serve_conn(conn: Connection) -> Result<(), Error> {
    let want = conn.recv_message().await?;
    let size = u64::from_le_bytes(
        want[..]
            .try_into()
            .map_err(|_| Error::Protocol("bad perf hello".into()))?,
    );
    if size > 1 << 30 {
        return Err(Error::ResourceExhausted(format!(
            "region of {size} bytes asked"
        )));
    }
    let mr = conn.domain().register(size as usize, Access::ALL);
    conn.send(mr.remote().to_bytes().to_vec()).await?;
    loop {
        match conn.recv().await? {
            Incoming::Message(m) if m.first() == Some(&PING) => conn.send(m).await?,
            _ => {}
        }
    }
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

fn us(h: &Histogram<u64>, q: f64) -> Option<f64> {
    (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0)
}

fn lat_iters(a: &PerfArgs, size: u64) -> u64 {
    // Bound the bytes moved per point to ~256 MiB.
    a.iters.min(((256u64 << 20) / size.max(1)).max(50))
}

async fn one_op(
    c: &Connection,
    op: &str,
    region: RemoteRegion,
    payload: &Bytes,
) -> Result<(), Error> {
    match op {
        "send" => {
            c.send(payload.clone()).await?;
            c.recv_message().await?;
        }
        "write" => c.write(payload.clone(), region).await?,
        "read" => {
            c.read(region).await?;
        }
        "cas" => {
            c.compare_and_swap(region, 0, 0).await?;
        }
        "faa" => {
            c.fetch_and_add(region, 1).await?;
        }
        other => return Err(Error::InvalidArgument(format!("unknown op {other:?}"))),
    }
    Ok(())
}

/// Request/response bytes of the raw baseline that mirror `op`.
fn raw_shape(op: &str, size: u64) -> (usize, usize) {
    let s = size as usize;
    match op {
        "send" => (s, s),
        "write" => (s, 1),
        "read" => (0, s),
        "cas" => (24, 8),
        _ => (16, 8),
    }
}

fn payload(op: &str, size: u64, tag: u8) -> Bytes {
    let mut v = vec![0x42u8; size as usize];
    if op == "send" {
        v[0] = tag;
    }
    Bytes::from(v)
}

async fn client(a: &PerfArgs, url: &str, raw_addr: &str) -> Result<(), Error> {
    let capture = match &a.capture {
        Some(path) => {
            let dev = rdmx_transport_rdma::SoftRoce::global()?;
            dev.start_capture(std::path::Path::new(path))?;
            Some((dev, path.clone()))
        }
        None => None,
    };
    let r = measure(a, url, raw_addr).await;
    if let Some((dev, path)) = capture {
        let frames = dev.stop_capture();
        eprintln!("rdmx perf: wrote {frames} RoCEv2 frames to {path}");
    }
    r
}

async fn measure(a: &PerfArgs, url: &str, raw_addr: &str) -> Result<(), Error> {
    let opts = options(a)?;
    let ts = transports();
    let conn = ts.connect(url, &opts).await?;
    let mut sizes = Vec::new();
    for s in &a.sizes {
        sizes.push(parse_size(s)?);
    }
    let max = sizes.iter().copied().max().unwrap_or(8).max(8);
    let region_len = max * a.window.max(1) as u64;
    conn.send(region_len.to_le_bytes().to_vec()).await?;
    let theirs = RemoteRegion::from_bytes(&conn.recv_message().await?)
        .ok_or_else(|| Error::Protocol("bad region descriptor from perf server".into()))?;
    if !a.json {
        println!(
            "# rdmx perf: {url} over {} (provider {}){}{}",
            conn.transport(),
            conn.info().provider,
            conn.fallback_reason()
                .map(|r| format!(", fell back: {r}"))
                .unwrap_or_default(),
            if a.busy_poll_us.is_some() {
                ", busy-poll"
            } else {
                ""
            }
        );
    }
    let baseline = match a.baseline.as_deref() {
        None => false,
        Some("raw-tcp") => true,
        Some(other) => {
            return Err(Error::InvalidArgument(format!(
                "unknown baseline {other:?} (raw-tcp)"
            )))
        }
    };
    let busy = a.busy_poll_us.map(Duration::from_micros);
    let (do_lat, do_bw) = match a.mode.as_str() {
        "lat" => (true, false),
        "bw" => (false, true),
        _ => (true, true),
    };
    let mut results = Vec::new();
    if !a.json {
        println!(
            "{:<10} {:<5} {:>8} {:>9} {:>9} {:>9} {:>10} {:>11} {:>9} {:>9} {:>10} {:>8}",
            "transport",
            "op",
            "size",
            "p50_us",
            "p99_us",
            "p99.9_us",
            "MB/s",
            "ops/s",
            "raw_p50",
            "lat_x",
            "raw_MB/s",
            "bw_x"
        );
    }
    for op in &a.op {
        let op_sizes: Vec<u64> = if op == "cas" || op == "faa" {
            vec![8]
        } else {
            sizes.clone()
        };
        for &size in &op_sizes {
            if op == "send" && size == 0 {
                continue;
            }
            let region = theirs.slice(0, size)?;
            let mut r = PerfResult {
                transport: conn.transport().to_string(),
                provider: conn.info().provider.clone(),
                op: op.clone(),
                size,
                iters: 0,
                p50_us: None,
                p99_us: None,
                p999_us: None,
                mb_per_s: None,
                ops_per_s: None,
                busy_poll: busy.is_some(),
                baseline: None,
                lat_ratio: None,
                bw_ratio: None,
            };
            let mut base = Baseline {
                name: "raw-tcp".into(),
                p50_us: None,
                p99_us: None,
                mb_per_s: None,
                ops_per_s: None,
            };
            if do_lat {
                let iters = lat_iters(a, size);
                let p = payload(op, size, PING);
                let (req, resp) = raw_shape(op, size);
                let mut rc = match baseline {
                    true => Some(RawClient::connect(raw_addr, busy).await.map_err(err)?),
                    false => None,
                };
                // Interleave rdmx and baseline in blocks so both see the same
                // machine conditions; the first block of each is warm-up.
                let (mut h, mut hb) = (hist(), hist());
                let blocks = 11;
                let per = iters.div_ceil(10).max(1);
                for b in 0..blocks {
                    for _ in 0..per {
                        let t = Instant::now();
                        one_op(&conn, op, region, &p).await?;
                        if b > 0 {
                            h.record(t.elapsed().as_nanos() as u64).expect("in bounds");
                        }
                    }
                    if let Some(rc) = rc.as_mut() {
                        for _ in 0..per {
                            let t = Instant::now();
                            rc.round_trip(req, resp).await.map_err(err)?;
                            if b > 0 {
                                hb.record(t.elapsed().as_nanos() as u64).expect("in bounds");
                            }
                        }
                    }
                }
                r.iters = per * 10;
                r.p50_us = us(&h, 0.5);
                r.p99_us = us(&h, 0.99);
                r.p999_us = us(&h, 0.999);
                base.p50_us = us(&hb, 0.5);
                base.p99_us = us(&hb, 0.99);
            }
            if do_bw {
                let dur = Duration::from_millis(a.duration_ms);
                let (ops, elapsed) = bandwidth(&conn, op, theirs, size, a.window, dur).await?;
                let secs = elapsed.as_secs_f64();
                r.ops_per_s = Some(ops as f64 / secs);
                r.mb_per_s = Some(ops as f64 * size as f64 / secs / 1e6);
                if baseline {
                    let (req, resp) = raw_shape(op, size);
                    let (req, resp) = if op == "send" { (req, 0) } else { (req, resp) };
                    let rc = RawClient::connect(raw_addr, busy).await.map_err(err)?;
                    let (n, el) = rc.stream(req, resp, a.window, dur).await.map_err(err)?;
                    let secs = el.as_secs_f64();
                    base.ops_per_s = Some(n as f64 / secs);
                    base.mb_per_s = Some(n as f64 * size as f64 / secs / 1e6);
                }
            }
            if baseline {
                r.lat_ratio = r.p50_us.zip(base.p50_us).map(|(x, b)| x / b);
                r.bw_ratio = r.mb_per_s.zip(base.mb_per_s).map(|(x, b)| x / b);
                r.baseline = Some(base);
            }
            print_result(a, &r);
            results.push(r);
        }
    }
    if let Some(path) = &a.svg {
        crate::plot::draw(path, &results).map_err(err)?;
        if !a.json {
            println!("# wrote {path}");
        }
    }
    let _ = conn.close().await;
    Ok(())
}

fn print_result(a: &PerfArgs, r: &PerfResult) {
    if a.json {
        println!("{}", serde_json::to_string(r).expect("serialisable"));
        return;
    }
    let f = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    let b = r.baseline.as_ref();
    println!(
        "{:<10} {:<5} {:>8} {:>9} {:>9} {:>9} {:>10} {:>11} {:>9} {:>9} {:>10} {:>8}",
        r.transport,
        r.op,
        r.size,
        f(r.p50_us, 2),
        f(r.p99_us, 2),
        f(r.p999_us, 2),
        f(r.mb_per_s, 1),
        f(r.ops_per_s, 0),
        f(b.and_then(|b| b.p50_us), 2),
        f(r.lat_ratio, 2),
        f(b.and_then(|b| b.mb_per_s), 1),
        f(r.bw_ratio, 2),
    );
}

/// Keep `window` operations in flight for `dur`; returns (completed, elapsed).
async fn bandwidth(
    c: &Connection,
    op: &str,
    theirs: RemoteRegion,
    size: u64,
    window: usize,
    dur: Duration,
) -> Result<(u64, Duration), Error> {
    let start = Instant::now();
    let mut done = 0u64;
    if op == "send" {
        // Sends complete locally once queued (credits pace them); a final PING
        // round trip proves every message arrived.
        let p = payload(op, size, SINK);
        while start.elapsed() < dur {
            c.send(p.clone()).await?;
            done += 1;
        }
        c.send(vec![PING]).await?;
        c.recv_message().await?;
        return Ok((done, start.elapsed()));
    }
    let p = payload(op, size, SINK);
    let mut inflight = FuturesUnordered::new();
    let mut slot = 0u64;
    let mut issue = |inflight: &mut FuturesUnordered<_>| -> Result<(), Error> {
        // Each in-flight op gets its own slot of the region.
        let region = theirs.slice((slot % window as u64) * size.max(8), size)?;
        slot += 1;
        let c = c.clone();
        let p = p.clone();
        let op = op.to_string();
        inflight.push(async move { one_op(&c, &op, region, &p).await });
        Ok(())
    };
    for _ in 0..window {
        issue(&mut inflight)?;
    }
    while let Some(res) = inflight.next().await {
        res?;
        done += 1;
        if start.elapsed() < dur {
            issue(&mut inflight)?;
        }
    }
    Ok((done, start.elapsed()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert!(parse_size("x").is_err());
        assert_eq!(raw_addr_for("127.0.0.1:7471").unwrap(), "127.0.0.1:7472");
    }
}
