//! `rdmx perf`: like perftest's ib_write_bw / ib_read_lat, for any transport.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use hdrhistogram::Histogram;
use rdmx_core::{
    Access, Connection, Error, Incoming, LocalSlice, MemoryRegion, Options, RemoteRegion,
    Transports,
};
use serde::Serialize;
use tokio::net::TcpListener;

use crate::counters::RdmaCounters;
use crate::raw::{self, RawClient};

/// Message tag: echo this message back.
const PING: u8 = 1;
/// Message tag: consume silently (bandwidth traffic).
const SINK: u8 = 0;

/// Arguments of `rdmx perf`.
#[derive(clap::Args, Debug)]
#[command(
    after_help = "Columns: p50_us/p99_us/p99.9_us are rdmx's latency percentiles in microseconds \
    (one operation at a time); MB/s and ops/s are rdmx's bandwidth with --window operations \
    in flight. With --baseline raw-tcp the same request/response shape also runs over a \
    plain TCP socket with an 8-byte header and nothing else, interleaved with rdmx in the \
    same run: raw_p50 and raw_MB/s are its figures, lat_x = rdmx p50 / raw p50 (below 1: \
    rdmx is faster) and bw_x = rdmx MB/s / raw MB/s (above 1: rdmx is faster). cpu_us is \
    this process's CPU time per operation, every thread (with --loopback both ends run here; \
    of the bandwidth run when there is one), and cpu_x the same ratio to the baseline's \
    (below 1: rdmx costs less). Sizes take \
    k, m, g suffixes in powers of 1024 (4k = 4096 bytes).\n\n\
    Examples:\n  rdmx perf --loopback --baseline raw-tcp\n  \
    rdmx perf server --listen 0.0.0.0:7471 --raw-baseline --metrics 127.0.0.1:9471\n  \
    rdmx perf client tcp://198.18.0.1:7471 --op write,read --json --baseline raw-tcp\n  \
    rdmx perf --perftest 198.18.0.2 --op write --mode bw --sizes 64k --iters 1000   \
    (against `ib_write_bw -x 1 -s 65536 -n 1000` there)\n\n\
    With --raw-baseline the server also serves the raw-TCP baseline on the next port \
    (7472 for 7471), behind the same --secret."
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
    /// Message sizes (comma-separated; k/m/g = KiB/MiB/GiB). cas and faa always use 8.
    #[arg(long, value_delimiter = ',', default_value = "8,64,512,4k,32k,256k,1m")]
    sizes: Vec<String>,
    /// What to measure: lat, bw or both.
    #[arg(long, default_value = "both", value_parser = ["lat", "bw", "both"])]
    mode: String,
    /// Latency iterations per point (fewer for large sizes).
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Bandwidth run length per point, in milliseconds.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    duration_ms: u64,
    /// Operations kept in flight for bandwidth runs.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    window: u32,
    /// Buffer slots that the operations in flight cycle through, on each
    /// side (default: --window, one per operation in flight). 1 puts every
    /// operation on the same buffer, as ucx_perftest's and perftest's
    /// bandwidth tests do: a smaller working set for the caches to hold.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
    slots: Option<u32>,
    /// Print one JSON object per result instead of a table.
    #[arg(long)]
    json: bool,
    /// Draw latency and bandwidth against size into this SVG file.
    #[arg(long)]
    svg: Option<String>,
    /// Client: also measure this baseline in the same run and print ratios
    /// (raw-tcp: the same shapes over a plain TCP socket).
    #[arg(long, value_parser = ["raw-tcp"])]
    baseline: Option<String>,
    /// Server: also serve the raw-TCP baseline on the next port (behind --secret).
    #[arg(long)]
    raw_baseline: bool,
    /// Server: total bytes of regions lent to all clients at once (k/m/g).
    #[arg(long, default_value = "4g")]
    max_memory: String,
    /// Server: serve Prometheus metrics (GET /metrics) on this address.
    #[arg(long)]
    metrics: Option<String>,
    /// Client: reads land in a registered region of this process
    /// (`Connection::read_into`, a slot per operation in flight), as
    /// ib_read_bw's do; without it each read returns new owned bytes.
    #[arg(long)]
    into_region: bool,
    /// Busy-poll sockets for this many microseconds before sleeping (rdmx and baseline).
    #[arg(long)]
    busy_poll_us: Option<u64>,
    /// Client: lanes per connection (TCP connections or RC queue pairs that
    /// large reads and writes are split across; the server takes what the
    /// client asks for).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    lanes: u16,
    /// Shared secret for authentication (both ends; the raw baseline too).
    #[arg(long)]
    secret: Option<String>,
    /// Transport policy: require, prefer, tcp-only.
    #[arg(long, default_value = "prefer")]
    policy: String,
    /// Write every RoCEv2 packet the soft engine sends during the run to this
    /// pcap file (check it with `rdmx pcap check`, decode it with tshark).
    /// Only for RDMA runs.
    #[arg(long)]
    capture: Option<String>,
    /// Run against unmodified perftest on HOST instead (ib_write_bw, ib_read_bw,
    /// ib_send_bw, ib_atomic_bw or ib_write_lat waiting there as a server), on
    /// the soft RoCEv2 engine: one --op (write, read, send, faa, cas) with
    /// --mode bw, or write with --mode lat; one size; --iters as perftest's -n.
    #[arg(long, value_name = "HOST", conflicts_with = "perftest_server")]
    perftest: Option<String>,
    /// Wait for a perftest client (`ib_write_bw HOST` and the others) instead.
    #[arg(long)]
    perftest_server: bool,
    /// TCP port of perftest's exchange (perftest -p).
    #[arg(long, default_value_t = 18515)]
    perftest_port: u16,
}

/// One region per connection is lent at most this much.
pub(crate) const MAX_REGION: u64 = 1 << 30;

/// An operation `rdmx perf` measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PerfOp {
    Send,
    Write,
    Read,
    Cas,
    Faa,
}

impl PerfOp {
    const ALL: [PerfOp; 5] = [
        PerfOp::Send,
        PerfOp::Write,
        PerfOp::Read,
        PerfOp::Cas,
        PerfOp::Faa,
    ];

    fn name(self) -> &'static str {
        match self {
            PerfOp::Send => "send",
            PerfOp::Write => "write",
            PerfOp::Read => "read",
            PerfOp::Cas => "cas",
            PerfOp::Faa => "faa",
        }
    }

    fn parse(s: &str) -> Result<PerfOp, Error> {
        PerfOp::ALL
            .into_iter()
            .find(|o| o.name() == s.trim())
            .ok_or_else(|| {
                Error::InvalidArgument(format!("unknown --op {s:?} (send, write, read, cas, faa)"))
            })
    }

    fn atomic(self) -> bool {
        matches!(self, PerfOp::Cas | PerfOp::Faa)
    }
}

/// Everything a client run needs, checked before connecting.
#[derive(Debug)]
struct Plan {
    ops: Vec<PerfOp>,
    sizes: Vec<u64>,
    lat: bool,
    bw: bool,
    baseline: bool,
    /// Buffer slots of the largest size in the borrowed (and local) region.
    slots: u32,
    region_len: u64,
}

fn plan(a: &PerfArgs) -> Result<Plan, Error> {
    let ops =
        a.op.iter()
            .map(|o| PerfOp::parse(o))
            .collect::<Result<Vec<_>, _>>()?;
    if ops.is_empty() {
        return Err(Error::InvalidArgument("--op names no operation".into()));
    }
    let sizes = a
        .sizes
        .iter()
        .map(|s| parse_size(s))
        .collect::<Result<Vec<_>, _>>()?;
    if sizes.is_empty() && ops.iter().any(|o| !o.atomic()) {
        return Err(Error::InvalidArgument("--sizes names no size".into()));
    }
    let max = sizes.iter().copied().max().unwrap_or(8).max(8);
    let (slots, slots_from) = match a.slots {
        Some(n) => (n, "--slots"),
        None => (a.window, "--window"),
    };
    let region_len = max
        .checked_mul(u64::from(slots))
        .filter(|&n| n <= MAX_REGION)
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the largest size ({max} bytes) times {slots_from} ({slots}) needs a larger \
                 region than the {MAX_REGION}-byte (1 GiB) limit a perf server lends one client; \
                 lower one"
            ))
        })?;
    check_transport(&a.transport)?;
    a.policy.parse::<rdmx_core::Policy>()?;
    Ok(Plan {
        ops,
        sizes,
        lat: a.mode != "bw",
        bw: a.mode != "lat",
        baseline: a.baseline.is_some(),
        slots,
        region_len,
    })
}
/// The baseline's figures for one point.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Baseline {
    pub(crate) name: String,
    pub(crate) p50_us: Option<f64>,
    pub(crate) p99_us: Option<f64>,
    pub(crate) mb_per_s: Option<f64>,
    pub(crate) ops_per_s: Option<f64>,
    /// CPU time of this process per operation, µs (see
    /// [`PerfResult::cpu_us_per_op`]).
    pub(crate) cpu_us_per_op: Option<f64>,
}

/// One measured point.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct PerfResult {
    pub(crate) transport: String,
    pub(crate) provider: String,
    /// Lanes the connection carried its operations over.
    pub(crate) lanes: u16,
    /// Buffer slots a bandwidth run's operations cycled through (`--slots`).
    pub(crate) slots: u32,
    pub(crate) op: String,
    pub(crate) size: u64,
    pub(crate) iters: u64,
    pub(crate) p50_us: Option<f64>,
    pub(crate) p99_us: Option<f64>,
    pub(crate) p999_us: Option<f64>,
    pub(crate) mb_per_s: Option<f64>,
    pub(crate) ops_per_s: Option<f64>,
    pub(crate) busy_poll: bool,
    /// CPU time of this process per operation, µs, every thread counted:
    /// with `--loopback` both ends run here, so it is what the operation
    /// costs the host; as a client, the client's share alone. Latency runs
    /// count their measured blocks, bandwidth runs the whole window run.
    pub(crate) cpu_us_per_op: Option<f64>,
    pub(crate) baseline: Option<Baseline>,
    /// rdmx p50 latency / baseline p50 latency (lower is better).
    pub(crate) lat_ratio: Option<f64>,
    /// rdmx bandwidth / baseline bandwidth (higher is better).
    pub(crate) bw_ratio: Option<f64>,
    /// rdmx CPU per operation / the baseline's (lower is better; of the
    /// bandwidth run when there is one, else of the latency run).
    pub(crate) cpu_ratio: Option<f64>,
    /// What the bandwidth run cost in protocol terms over RDMA
    /// (retransmissions, timer expiries, NAKs...): why a lossy path's
    /// goodput is what it is.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) rdma: Option<RdmaCounters>,
}

pub(crate) fn transports() -> Transports {
    Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new())
}

/// A byte count with an optional k, m or g suffix (KiB, MiB, GiB: powers of
/// 1024). Overflow is an error, never a wrapped number.
pub(crate) fn parse_size(s: &str) -> Result<u64, Error> {
    let t = s.trim().to_ascii_lowercase();
    let (num, mul) = match t.as_bytes().last() {
        Some(b'k') => (&t[..t.len() - 1], 1u64 << 10),
        Some(b'm') => (&t[..t.len() - 1], 1 << 20),
        Some(b'g') => (&t[..t.len() - 1], 1 << 30),
        _ => (t.as_str(), 1),
    };
    num.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mul))
        .ok_or_else(|| {
            Error::InvalidArgument(format!(
                "bad size {s:?} (a number with an optional k, m or g suffix, at most 2^64-1 bytes)"
            ))
        })
}

fn options(a: &PerfArgs) -> Result<Options, Error> {
    let mut o = Options {
        busy_poll: a.busy_poll_us.map(Duration::from_micros),
        policy: a.policy.parse()?,
        lanes: a.lanes,
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

/// Bind the raw baseline's listener, naming the address on failure.
async fn raw_listener(addr: &str) -> Result<TcpListener, Error> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Error::Connect(format!("listen on {addr} (raw-tcp baseline): {e}")))
}

/// The perftest run `--perftest`/`--perftest-server` and the other flags name.
fn perftest_run(a: &PerfArgs) -> Result<crate::perftest::PerftestRun, Error> {
    let [op] = a.op.as_slice() else {
        return Err(Error::InvalidArgument(
            "--perftest runs one --op at a time, as perftest does".into(),
        ));
    };
    let [size] = a.sizes.as_slice() else {
        return Err(Error::InvalidArgument(
            "--perftest runs one size (--sizes N, perftest's -s)".into(),
        ));
    };
    Ok(crate::perftest::PerftestRun {
        host: a.perftest.clone(),
        port: a.perftest_port,
        test: crate::perftest::Test::from_op(op.trim(), &a.mode)?,
        size: parse_size(size)?,
        iters: a.iters,
        window: a.window,
    })
}

/// Whether a run asks for RDMA (so `--capture` has packets to write).
fn is_rdma(scheme: &str) -> bool {
    scheme != "tcp"
}

pub(crate) async fn run(a: PerfArgs) -> Result<(), Error> {
    if a.perftest.is_some() || a.perftest_server {
        return crate::perftest::run(perftest_run(&a)?).await;
    }
    let secret: Option<Arc<[u8]>> = a.secret.as_deref().map(|s| Arc::from(s.as_bytes()));
    let busy = a.busy_poll_us.map(Duration::from_micros);
    if a.loopback {
        let p = plan(&a)?;
        if a.capture.is_some() && !is_rdma(&a.transport) {
            return Err(capture_needs_rdma());
        }
        let opts = options(&a)?;
        let ts = transports();
        let url = format!("{}://127.0.0.1:0", a.transport);
        let listener = ts.listen(&url, &opts).await?;
        let addr = listener.local_addr();
        tokio::spawn(serve(listener, Budget::new(MAX_REGION * 4)));
        let raw_l = raw_listener("127.0.0.1:0").await?;
        let raw_addr = raw_l.local_addr().map_err(err)?.to_string();
        tokio::spawn(raw::serve(raw_l, busy, secret));
        return client(&a, &p, &format!("{}://{addr}", a.transport), &raw_addr).await;
    }
    match a.role.as_deref() {
        Some("server") => {
            check_transport(&a.transport)?;
            let budget = Budget::new(parse_size(&a.max_memory)?);
            let opts = options(&a)?;
            if let Some(m) = &a.metrics {
                let at = rdmx_core::metrics::serve(m, None).await?;
                eprintln!("rdmx perf server: metrics on http://{at}/metrics");
            }
            let listener = transports()
                .listen(&format!("{}://{}", a.transport, a.listen), &opts)
                .await?;
            if let Some(f) = listener.fallback_reason() {
                eprintln!("rdmx perf server: listening on TCP instead ({f})");
            }
            let raw = if a.raw_baseline {
                let raw_addr = raw_addr_for(&a.listen)?;
                let raw_l = raw_listener(&raw_addr).await?;
                tokio::spawn(raw::serve(raw_l, busy, secret));
                format!(", raw-tcp baseline on {raw_addr}")
            } else {
                String::new()
            };
            eprintln!(
                "rdmx perf server: {} on {}{raw}",
                listener.transport(),
                listener.local_addr()
            );
            serve(listener, budget).await;
            Ok(())
        }
        Some("client") => {
            let url = a
                .url
                .clone()
                .ok_or_else(|| Error::InvalidArgument("client needs a URL".into()))?;
            let ep: rdmx_core::Endpoint = url.parse()?;
            let p = plan(&a)?;
            if a.capture.is_some() && !is_rdma(&ep.scheme) {
                return Err(capture_needs_rdma());
            }
            let raw_addr = raw_addr_for(&ep.addr)?;
            client(&a, &p, &url, &raw_addr).await
        }
        Some(other) => Err(Error::InvalidArgument(format!(
            "perf role {other:?}: use `rdmx perf server`, `rdmx perf client URL` or `rdmx perf --loopback`"
        ))),
        None => Err(Error::InvalidArgument(
            "use `rdmx perf server`, `rdmx perf client URL` or `rdmx perf --loopback`".into(),
        )),
    }
}

/// `name` must be a transport this binary has.
fn check_transport(name: &str) -> Result<(), Error> {
    let ts = transports();
    if ts.get(name).is_none() {
        return Err(Error::Unsupported(format!(
            "transport {name:?} is not built into this rdmx (available: {ts:?})"
        )));
    }
    Ok(())
}

fn capture_needs_rdma() -> Error {
    Error::InvalidArgument(
        "--capture writes the soft RoCE engine's packets; a tcp run has none (use --transport rdma or an rdma:// URL)"
            .into(),
    )
}

/// Region bytes lent to all clients of one server at once.
#[derive(Clone)]
pub(crate) struct Budget {
    left: Arc<std::sync::atomic::AtomicU64>,
    total: u64,
}

/// Bytes taken from a [`Budget`]; given back on drop.
pub(crate) struct Lent {
    left: Arc<std::sync::atomic::AtomicU64>,
    n: u64,
}

impl Drop for Lent {
    fn drop(&mut self) {
        self.left
            .fetch_add(self.n, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Budget {
    pub(crate) fn new(total: u64) -> Budget {
        Budget {
            left: Arc::new(std::sync::atomic::AtomicU64::new(total)),
            total,
        }
    }

    /// Take `n` bytes, or say why not (per-client cap and what is left).
    pub(crate) fn take(&self, n: u64, per_client: u64) -> Result<Lent, String> {
        use std::sync::atomic::Ordering;
        if n > per_client {
            return Err(format!(
                "a {n}-byte region was asked; this server lends at most {per_client} bytes per client"
            ));
        }
        self.left
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(n))
            .map_err(|left| {
                format!(
                    "a {n}-byte region was asked; {left} of this server's {} bytes are left (--max-memory)",
                    self.total
                )
            })?;
        Ok(Lent {
            left: self.left.clone(),
            n,
        })
    }
}

/// First bytes of a server's refusal, in place of a region descriptor.
const REFUSED: &[u8] = b"ERR ";

/// The server: per connection, lend the region the client asks for (within
/// the budget), tell it the descriptor, echo PING messages, and serve
/// one-sided ops (the transport does that by itself). Keeps accepting
/// whatever one client does.
async fn serve(listener: rdmx_core::Listener, budget: Budget) {
    listener
        .serve("rdmx perf", move |conn| serve_conn(conn, budget.clone()))
        .await
}

/// Read a client's 8-byte region request and lend it, or refuse with a
/// reason the client prints. Returns the region and its share of the budget.
pub(crate) async fn lend_region(
    conn: &Connection,
    budget: &Budget,
    what: &str,
    max_region: u64,
) -> Result<Option<(rdmx_core::MemoryRegion, Lent)>, Error> {
    let want = conn.recv_message().await?;
    let size = u64::from_le_bytes(want[..].try_into().map_err(|_| {
        Error::Protocol(format!(
            "bad {what} hello ({} bytes, expected 8)",
            want.len()
        ))
    })?);
    match budget.take(size, max_region) {
        Ok(lent) => {
            let mr = conn.domain().register(size as usize, Access::ALL);
            conn.send_region(&mr).await?;
            Ok(Some((mr, lent)))
        }
        Err(why) => {
            tracing::warn!(peer = ?conn.info().peer_addr, %why, "refused a region");
            let mut m = REFUSED.to_vec();
            m.extend_from_slice(why.as_bytes());
            conn.send(m).await?;
            Ok(None)
        }
    }
}

/// Ask the server for a region of `len` bytes.
pub(crate) async fn borrow_region(conn: &Connection, len: u64) -> Result<RemoteRegion, Error> {
    conn.send(len.to_le_bytes().to_vec()).await?;
    let m = conn.recv_message().await?;
    if let Some(why) = m.strip_prefix(REFUSED) {
        return Err(Error::ResourceExhausted(format!(
            "the server refused: {}",
            String::from_utf8_lossy(why)
        )));
    }
    RemoteRegion::from_message(&m)
}

async fn serve_conn(conn: Connection, budget: Budget) -> Result<(), Error> {
    let Some((_mr, _lent)) = lend_region(&conn, &budget, "perf", MAX_REGION).await? else {
        return Ok(());
    };
    loop {
        match conn.recv().await? {
            Incoming::Message(m) if m.first() == Some(&PING) => conn.send(m).await?,
            _ => {}
        }
    }
}

/// A latency histogram in nanoseconds, 1 ns to 60 s, three significant digits.
pub(crate) fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds")
}

/// Quantile `q` of `h` in microseconds (`None` when nothing was recorded).
pub(crate) fn us(h: &Histogram<u64>, q: f64) -> Option<f64> {
    (!h.is_empty()).then(|| h.value_at_quantile(q) as f64 / 1000.0)
}

fn lat_iters(a: &PerfArgs, size: u64) -> u64 {
    // Bound the bytes moved per point to ~256 MiB.
    a.iters.min(((256u64 << 20) / size.max(1)).max(50))
}

async fn one_op(
    c: &Connection,
    op: PerfOp,
    region: RemoteRegion,
    payload: &Bytes,
    into: Option<LocalSlice>,
) -> Result<(), Error> {
    match op {
        PerfOp::Read if into.is_some() => {
            let dst = into.expect("checked");
            c.read_into(region, dst).await?;
        }
        PerfOp::Send => {
            c.send(payload.clone()).await?;
            c.recv_message().await?;
        }
        PerfOp::Write => c.write(payload.clone(), region).await?,
        PerfOp::Read => {
            c.read(region).await?;
        }
        PerfOp::Cas => {
            c.compare_and_swap(region, 0, 0).await?;
        }
        PerfOp::Faa => {
            c.fetch_and_add(region, 1).await?;
        }
    }
    Ok(())
}

/// Request/response bytes of the raw baseline that mirror `op`.
fn raw_shape(op: PerfOp, size: u64) -> (usize, usize) {
    let s = size as usize;
    match op {
        PerfOp::Send => (s, s),
        PerfOp::Write => (s, 1),
        PerfOp::Read => (0, s),
        PerfOp::Cas => (24, 8),
        PerfOp::Faa => (16, 8),
    }
}

fn payload(op: PerfOp, size: u64, tag: u8) -> Bytes {
    let mut v = vec![0x42u8; size as usize];
    if op == PerfOp::Send {
        v[0] = tag;
    }
    Bytes::from(v)
}

async fn client(a: &PerfArgs, p: &Plan, url: &str, raw_addr: &str) -> Result<(), Error> {
    let capture = match &a.capture {
        Some(path) => {
            let dev = rdmx_transport_rdma::SoftRoce::global()?;
            dev.start_capture(std::path::Path::new(path))?;
            Some((dev, path.clone()))
        }
        None => None,
    };
    let r = measure(a, p, url, raw_addr).await;
    if let Some((dev, path)) = capture {
        let frames = dev.stop_capture();
        eprintln!(
            "rdmx perf: wrote {frames} RoCEv2 frames to {path} (UDP port {})",
            dev.port()
        );
    }
    r
}

async fn measure(a: &PerfArgs, p: &Plan, url: &str, raw_addr: &str) -> Result<(), Error> {
    let opts = options(a)?;
    let conn = transports().connect(url, &opts).await?;
    let limit = conn.capabilities().max_message_size;
    if p.ops.contains(&PerfOp::Send) {
        if let Some(&big) = p.sizes.iter().find(|&&s| s > limit) {
            return Err(Error::InvalidArgument(format!(
                "send of {big} bytes: the peer accepts messages of at most {limit} bytes"
            )));
        }
    }
    let theirs = borrow_region(&conn, p.region_len).await?;
    let local = a
        .into_region
        .then(|| conn.domain().register(p.region_len as usize, Access::LOCAL));
    let busy = a.busy_poll_us.map(Duration::from_micros);
    let secret = a.secret.as_deref().map(str::as_bytes);
    if p.baseline {
        // Reach the baseline before measuring anything, so a server without
        // one fails the run at once.
        RawClient::connect(raw_addr, busy, secret)
            .await
            .map_err(err)?;
    }
    if !a.json {
        println!(
            "# rdmx perf: {url} over {} (provider {}, {} lane{}){}{}",
            conn.transport(),
            conn.info().provider,
            conn.info().lanes,
            if conn.info().lanes == 1 { "" } else { "s" },
            conn.fallback_reason()
                .map(|r| format!(", fell back: {r}"))
                .unwrap_or_default(),
            if a.busy_poll_us.is_some() {
                ", busy-poll"
            } else {
                ""
            }
        );
        if p.baseline {
            println!(
                "# raw_* = the same request/response shape over a plain TCP socket, same run; \
                 lat_x = p50 / raw_p50 (< 1: rdmx faster), bw_x = MB/s / raw_MB/s (> 1: rdmx faster)"
            );
        }
        println!(
            "{:<10} {:<5} {:>8} {:>9} {:>9} {:>9} {:>10} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8} {:>6}",
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
            "bw_x",
            "cpu_us",
            "cpu_x"
        );
    }
    let mut results = Vec::new();
    for &op in &p.ops {
        let op_sizes: Vec<u64> = if op.atomic() {
            vec![8]
        } else {
            p.sizes.clone()
        };
        for &size in &op_sizes {
            if op == PerfOp::Send && size == 0 {
                continue;
            }
            let region = theirs.slice(0, size)?;
            let mut r = PerfResult {
                transport: conn.transport().to_string(),
                provider: conn.info().provider.clone(),
                lanes: conn.info().lanes,
                slots: p.slots,
                op: op.name().to_string(),
                size,
                iters: 0,
                p50_us: None,
                p99_us: None,
                p999_us: None,
                mb_per_s: None,
                ops_per_s: None,
                busy_poll: busy.is_some(),
                cpu_us_per_op: None,
                baseline: None,
                lat_ratio: None,
                bw_ratio: None,
                cpu_ratio: None,
                rdma: None,
            };
            let mut base = Baseline {
                name: "raw-tcp".into(),
                p50_us: None,
                p99_us: None,
                mb_per_s: None,
                ops_per_s: None,
                cpu_us_per_op: None,
            };
            if p.lat {
                let iters = lat_iters(a, size);
                let pl = payload(op, size, PING);
                let (req, resp) = raw_shape(op, size);
                let mut rc = match p.baseline {
                    true => Some(
                        RawClient::connect(raw_addr, busy, secret)
                            .await
                            .map_err(err)?,
                    ),
                    false => None,
                };
                // Interleave rdmx and baseline in blocks so both see the same
                // machine conditions; the first block of each is warm-up.
                let (mut h, mut hb) = (hist(), hist());
                let blocks = 11;
                let per = iters.div_ceil(10).max(1);
                let (mut cpu, mut cpu_b) = (Duration::ZERO, Duration::ZERO);
                // The destination of reads into a region is cut once, outside
                // the timed window.
                let into = local
                    .as_ref()
                    .map(|m| m.slice(0, size as usize))
                    .transpose()?;
                for b in 0..blocks {
                    let c0 = cpu_now();
                    for _ in 0..per {
                        let t = Instant::now();
                        one_op(&conn, op, region, &pl, into.clone()).await?;
                        if b > 0 {
                            h.record(t.elapsed().as_nanos() as u64).expect("in bounds");
                        }
                    }
                    if b > 0 {
                        cpu += cpu_now().saturating_sub(c0);
                    }
                    if let Some(rc) = rc.as_mut() {
                        let c0 = cpu_now();
                        for _ in 0..per {
                            let t = Instant::now();
                            rc.round_trip(req, resp).await.map_err(err)?;
                            if b > 0 {
                                hb.record(t.elapsed().as_nanos() as u64).expect("in bounds");
                            }
                        }
                        if b > 0 {
                            cpu_b += cpu_now().saturating_sub(c0);
                        }
                    }
                }
                r.iters = per * 10;
                r.cpu_us_per_op = per_op_us(cpu, r.iters);
                if rc.is_some() {
                    base.cpu_us_per_op = per_op_us(cpu_b, r.iters);
                }
                r.p50_us = us(&h, 0.5);
                r.p99_us = us(&h, 0.99);
                r.p999_us = us(&h, 0.999);
                base.p50_us = us(&hb, 0.5);
                base.p99_us = us(&hb, 0.99);
            }
            if p.bw {
                let dur = Duration::from_millis(a.duration_ms);
                let window = a.window as usize;
                let before = conn.stats();
                let c0 = cpu_now();
                let shape = BwShape {
                    size,
                    window,
                    slots: p.slots,
                    dur,
                };
                let (ops, elapsed) = bandwidth(&conn, op, theirs, local.as_ref(), shape).await?;
                r.cpu_us_per_op = per_op_us(cpu_now().saturating_sub(c0), ops);
                r.rdma = RdmaCounters::between(&conn, &before, &conn.stats());
                let secs = elapsed.as_secs_f64();
                r.ops_per_s = Some(ops as f64 / secs);
                r.mb_per_s = Some(ops as f64 * size as f64 / secs / 1e6);
                if p.baseline {
                    let (req, resp) = raw_shape(op, size);
                    let rc = RawClient::connect(raw_addr, busy, secret)
                        .await
                        .map_err(err)?;
                    // Same shape as rdmx's: sends are one-way messages
                    // proven by a final round trip; the rest keep `window`
                    // requests in flight.
                    let c0 = cpu_now();
                    let (n, el) = if op == PerfOp::Send {
                        rc.one_way(req, dur).await
                    } else {
                        rc.stream(req, resp, window, dur).await
                    }
                    .map_err(err)?;
                    base.cpu_us_per_op = per_op_us(cpu_now().saturating_sub(c0), n);
                    let secs = el.as_secs_f64();
                    base.ops_per_s = Some(n as f64 / secs);
                    base.mb_per_s = Some(n as f64 * size as f64 / secs / 1e6);
                }
            }
            if p.baseline {
                r.lat_ratio = r.p50_us.zip(base.p50_us).map(|(x, b)| x / b);
                r.bw_ratio = r.mb_per_s.zip(base.mb_per_s).map(|(x, b)| x / b);
                r.cpu_ratio = r.cpu_us_per_op.zip(base.cpu_us_per_op).map(|(x, b)| x / b);
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

/// The CPU time this process has used, every thread (in loopback mode both
/// ends of the connection).
fn cpu_now() -> Duration {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_PROCESS_CPUTIME_ID)
        .map(Duration::from)
        .unwrap_or_default()
}

/// `cpu` spread over `ops` operations, in µs (none without operations).
fn per_op_us(cpu: Duration, ops: u64) -> Option<f64> {
    (ops > 0).then(|| cpu.as_secs_f64() * 1e6 / ops as f64)
}

fn print_result(a: &PerfArgs, r: &PerfResult) {
    if a.json {
        println!("{}", serde_json::to_string(r).expect("serialisable"));
        return;
    }
    let f = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    let b = r.baseline.as_ref();
    println!(
        "{:<10} {:<5} {:>8} {:>9} {:>9} {:>9} {:>10} {:>11} {:>9} {:>9} {:>10} {:>8} {:>8} {:>6}",
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
        f(r.cpu_us_per_op, 2),
        f(r.cpu_ratio, 2),
    );
    if let Some(c) = &r.rdma {
        println!("#   {c}");
    }
}

/// The shape of a bandwidth run: operations of `size` bytes, `window` of
/// them in flight, their buffers taken in turn from `slots` slots of the
/// region (remote, and local for reads into a region), for `dur`.
#[derive(Clone, Copy, Debug)]
struct BwShape {
    size: u64,
    window: usize,
    slots: u32,
    dur: Duration,
}

/// Keep `shape.window` operations in flight for `shape.dur`; returns
/// (completed, elapsed).
async fn bandwidth(
    c: &Connection,
    op: PerfOp,
    theirs: RemoteRegion,
    local: Option<&MemoryRegion>,
    shape: BwShape,
) -> Result<(u64, Duration), Error> {
    let BwShape {
        size,
        window,
        slots,
        dur,
    } = shape;
    let start = Instant::now();
    let mut done = 0u64;
    if op == PerfOp::Send {
        // `window` sends in flight (over TCP a send completes once queued,
        // over RDMA at the peer's ACK; credits pace both); a final PING
        // round trip proves every message arrived.
        let p = payload(op, size, SINK);
        let mut inflight = FuturesUnordered::new();
        let send = |p: &Bytes| std::future::IntoFuture::into_future(c.send(p.clone()));
        for _ in 0..window {
            inflight.push(send(&p));
        }
        while let Some(res) = inflight.next().await {
            res?;
            done += 1;
            if start.elapsed() < dur {
                inflight.push(send(&p));
            }
            // Sends that completed together are replaced together: their
            // frames leave in one write, as raw TCP's batched writes do.
            let cork = c.cork();
            while let Some(Some(res)) = inflight.next().now_or_never() {
                res?;
                done += 1;
                if start.elapsed() < dur {
                    inflight.push(send(&p));
                }
            }
            drop(cork);
        }
        c.send(vec![PING]).await?;
        c.recv_message().await?;
        return Ok((done, start.elapsed()));
    }
    let p = payload(op, size, SINK);
    let mut inflight = FuturesUnordered::new();
    let mut slot = 0u64;
    let mut issue = |inflight: &mut FuturesUnordered<_>| -> Result<(), Error> {
        // Each in-flight op takes the next slot of the region (and of the
        // local one that reads land in, if any): its own while there are
        // as many slots as operations in flight.
        let at = slot_offset(slot, slots, size);
        let region = theirs.slice(at, size)?;
        let into = match local {
            Some(m) => Some(m.slice(at as usize, size as usize)?),
            None => None,
        };
        slot += 1;
        let c = c.clone();
        let p = p.clone();
        inflight.push(async move { one_op(&c, op, region, &p, into).await });
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
        // Operations that completed together are replaced together, corked:
        // their requests leave in one write, as raw TCP's batched writes do.
        let cork = c.cork();
        while let Some(Some(res)) = inflight.next().now_or_never() {
            res?;
            done += 1;
            if start.elapsed() < dur {
                issue(&mut inflight)?;
            }
        }
        drop(cork);
    }
    Ok((done, start.elapsed()))
}

/// Where the `n`th operation of a bandwidth run starts in a region of
/// `slots` slots of `size` bytes (at least 8, as the region is sized).
fn slot_offset(n: u64, slots: u32, size: u64) -> u64 {
    (n % u64::from(slots.max(1))) * size.max(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_cycle_through_the_slots() {
        let at: Vec<u64> = (0..5).map(|n| slot_offset(n, 3, 4096)).collect();
        assert_eq!(at, [0, 4096, 8192, 0, 4096]);
        assert!((0..100).all(|n| slot_offset(n, 1, 1 << 20) == 0));
        assert_eq!(
            slot_offset(3, 16, 0),
            24,
            "a 0-byte slot still takes 8 bytes"
        );
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8").unwrap(), 8);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert!(parse_size("x").is_err());
        assert_eq!(parse_size("16m").unwrap(), 16 << 20);
        assert!(parse_size("17179869184g").is_err(), "overflow is an error");
        assert_eq!(raw_addr_for("127.0.0.1:7471").unwrap(), "127.0.0.1:7472");
    }
}
