//! `rdmx soak`: a data-integrity run over a path. The client moves a mix of
//! writes read back, writes with immediate (the server hashes what landed),
//! sends (the server hashes each) and atomics (fetch-and-add and
//! compare-and-swap, whose returned values the client predicts), 256 MiB by
//! default, and checks every byte by SHA-256; it reports the provider it ran
//! on, goodput and the protocol counters (retransmits, NAKs, CNPs), so the
//! same command measures a lossy or congested path.
//!
//! ```text
//! rdmx soak server --listen 198.18.0.2:7500 --transport rdma
//! rdmx soak client rdma://198.18.0.2:7500 --bytes 256m --json
//! ```

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmx_core::Incoming;
use rdmx_core::{Connection, Error, Options, Transports};
use rdmx_transport_rdma::verbs::{Provider as _, ProviderKind};
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};
use serde::Serialize;

use crate::counters::RdmaCounters;
use crate::perf::{borrow_region, lend_region, parse_size, Budget};
use sha2::{Digest, Sha256};

/// Arguments of `rdmx soak`.
#[derive(clap::Args, Debug)]
pub(crate) struct SoakArgs {
    /// `server` or `client`.
    role: String,
    /// Server URL, for `client` (e.g. rdma://198.18.0.2:7500).
    url: Option<String>,
    /// Server: address to listen on.
    #[arg(long, default_value = "127.0.0.1:7500")]
    listen: String,
    /// Server: transport (tcp or rdma).
    #[arg(long, default_value = "rdma")]
    transport: String,
    /// Bytes to move in total (k/m/g = KiB/MiB/GiB: 16m is 16 MiB, 16777216 bytes).
    #[arg(long, default_value = "256m")]
    bytes: String,
    /// Size of each write and read (k/m/g = KiB/MiB/GiB), at most 128 MiB; a
    /// send larger than the peer's message limit goes as several messages.
    /// Each operation may take 10 s plus a second per MiB.
    #[arg(long, default_value = "1m")]
    chunk: String,
    /// Server: total bytes of regions lent to all clients at once (k/m/g).
    #[arg(long, default_value = "4g")]
    max_memory: String,
    /// Server: serve Prometheus metrics (GET /metrics) on this address.
    #[arg(long)]
    metrics: Option<String>,
    /// Use a soft RoCE engine of this process in go-back-N mode instead of
    /// the provider the environment picks (go-back-N is what NICs speak; one
    /// end asking is enough).
    #[arg(long)]
    go_back_n: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Write/read slots the client's region holds.
const SLOTS: u64 = 8;

/// The largest chunk: [`SLOTS`] of them fill the 1 GiB a server lends a client.
const MAX_CHUNK: u64 = 128 << 20;

/// What a soak run measured (RDMA counters only on RDMA runs).
#[derive(Debug, Serialize)]
pub(crate) struct SoakReport {
    transport: String,
    provider: String,
    bytes: u64,
    chunk: u64,
    seconds: f64,
    goodput_mb_per_s: f64,
    ops: u64,
    verified: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    rdma: Option<RdmaCounters>,
    /// Set when the run stopped early: what failed (bytes/ops are what was verified before).
    #[serde(skip_serializing_if = "Option::is_none")]
    error: Option<String>,
}

impl SoakReport {
    fn print(&self, json: bool) {
        if json {
            println!("{}", serde_json::to_string(self).expect("serialisable"));
            return;
        }
        let head = if self.error.is_some() {
            "FAILED after"
        } else {
            "ok:"
        };
        print!(
            "{} over {}: {head} {} bytes ({} MiB) verified in {} ops of up to {} bytes, {:.2} s, {:.0} MB/s goodput",
            self.transport,
            self.provider,
            self.bytes,
            self.bytes >> 20,
            self.ops,
            self.chunk,
            self.seconds,
            self.goodput_mb_per_s
        );
        if let Some(r) = &self.rdma {
            print!("; {r}");
        }
        println!();
        if let Some(e) = &self.error {
            println!("error: {e}");
        }
    }
}

/// The transports. RDMA takes the provider the environment picks, as perf
/// does: a NIC when the `hw` feature is built in and one opens, else the soft
/// engine (`RDMX_RDMA_PROVIDER=soft|hw` forces one); `--go-back-n` asks for a
/// soft engine of its own in go-back-N mode. The soft device is returned too
/// (for its CE counter), and only made if this run uses RDMA, so a TCP soak
/// never takes UDP 4791 from an RDMA one on the same host.
fn transports(go_back_n: bool, rdma: bool) -> Result<(Transports, Option<Arc<SoftRoce>>), Error> {
    let ts = Transports::new().with(rdmx_transport_tcp::TcpTransport::new());
    if !rdma {
        return Ok((ts, None));
    }
    if go_back_n {
        let dev = Arc::new(SoftRoce::new(SoftConfig {
            selective_repeat: false,
            ..SoftConfig::default()
        })?);
        return Ok((
            ts.with(RdmaTransport::with_provider(dev.clone())),
            Some(dev),
        ));
    }
    let rdma = RdmaTransport::new();
    let provider = rdma.provider()?;
    tracing::info!(provider = %provider.device_name(), "soak: RDMA provider");
    let dev = match provider.kind() {
        ProviderKind::Soft => Some(SoftRoce::global()?),
        ProviderKind::Hardware => None,
    };
    Ok((ts.with(rdma), dev))
}

/// Deterministic test data for operation `i`.
fn data(i: u64, len: usize) -> Bytes {
    let mut out = Vec::with_capacity(len + 8);
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out.into()
}

pub(crate) async fn run(a: SoakArgs) -> Result<(), Error> {
    let rdma = match a.role.as_str() {
        "server" => a.transport != "tcp",
        _ => a.url.as_deref().is_some_and(|u| !u.starts_with("tcp://")),
    };
    // Check every size before touching the network.
    let total = parse_size(&a.bytes)?;
    let chunk = parse_size(&a.chunk)?;
    if chunk == 0 || chunk > MAX_CHUNK {
        return Err(Error::InvalidArgument(format!(
            "--chunk {} is {chunk} bytes; it must be 1 byte to {MAX_CHUNK} bytes (128 MiB: \
             {SLOTS} slots fill the 1 GiB region a server lends one client)",
            a.chunk
        )));
    }
    let budget = Budget::new(parse_size(&a.max_memory)?);
    let (ts, dev) = transports(a.go_back_n, rdma)?;
    let mut opts = Options::default();
    // A soak checks data, not speed: an operation may take its usual
    // deadline plus a second per MiB (a 16 MiB operation against rxe in an
    // emulated guest moves at a few MB/s, slower still on a loaded host).
    opts.op_timeout += Duration::from_secs(chunk >> 20);
    match a.role.as_str() {
        "server" => {
            if let Some(m) = &a.metrics {
                let at = rdmx_core::metrics::serve(m, None).await?;
                eprintln!("rdmx soak server: metrics on http://{at}/metrics");
            }
            let l = ts
                .listen(&format!("{}://{}", a.transport, a.listen), &opts)
                .await?;
            let provider = match (l.transport(), &dev) {
                ("rdma", Some(d)) => format!(" (provider {})", d.device_name()),
                ("rdma", None) => format!(
                    " (provider {})",
                    RdmaTransport::new().provider()?.device_name()
                ),
                _ => String::new(),
            };
            eprintln!(
                "rdmx soak server: {} on {}{provider}",
                l.transport(),
                l.local_addr()
            );
            l.serve("rdmx soak", move |conn| serve(conn, budget.clone()))
                .await;
            Ok(())
        }
        "client" => {
            let url = a
                .url
                .as_deref()
                .ok_or_else(|| Error::InvalidArgument("client needs a URL".into()))?;
            let conn = ts.connect(url, &opts).await?;
            let before = dev.as_ref().map(|d| d.stats());
            let mut report = client(&conn, total, chunk).await?;
            if let (Some(d), Some(b), Some(r)) = (&dev, before, report.rdma.as_mut()) {
                let after = d.stats();
                r.ce_marked = Some(after.ce_marked - b.ce_marked);
                r.rx_while_sending = Some(after.rx_while_sending - b.rx_while_sending);
            }
            report.print(a.json);
            match report.error {
                None => Ok(()),
                Some(e) => Err(Error::Protocol(format!("soak failed: {e}"))),
            }
        }
        r => Err(Error::InvalidArgument(format!(
            "soak role {r:?}: use `server` or `client URL`"
        ))),
    }
}

/// Bytes after the slots for the atomics: a fetch-and-add word, then a
/// compare-and-swap word (8-aligned: the slots fill a multiple of 8).
const ATOMIC_WORDS: u64 = 16;

/// Server: lend the client a region of [`SLOTS`] slots and the atomic words;
/// answer each message with its SHA-256, and each write-with-immediate with
/// the SHA-256 of the slot it names (the immediate) as it now is.
async fn serve(conn: Connection, budget: Budget) -> Result<(), Error> {
    let Some((mr, _lent)) =
        lend_region(&conn, &budget, "soak", SLOTS * MAX_CHUNK + ATOMIC_WORDS).await?
    else {
        return Ok(());
    };
    let slot = (mr.len() as u64).saturating_sub(ATOMIC_WORDS) / SLOTS;
    loop {
        let digest: [u8; 32] = match conn.recv().await? {
            Incoming::Message(m) => Sha256::digest(&m).into(),
            Incoming::WriteImm { imm, len } => {
                let at = u64::from(imm) * slot;
                if u64::from(imm) >= SLOTS || len > slot {
                    return Err(Error::Protocol(format!(
                        "write-with-immediate {imm} of {len} bytes names no slot (of {slot} bytes)"
                    )));
                }
                let g = mr.read();
                Sha256::digest(&g[at as usize..(at + len) as usize]).into()
            }
        };
        conn.send(digest.to_vec()).await?;
    }
}

/// Progress of a run: what has been verified so far.
#[derive(Default)]
struct Progress {
    moved: u64,
    ops: u64,
}

/// Client: writes, reads back and sends `total` bytes in `chunk`s, checking
/// all. A failure mid-run is reported with what was verified before it.
async fn client(conn: &Connection, total: u64, chunk: u64) -> Result<SoakReport, Error> {
    let region = borrow_region(conn, chunk * SLOTS + ATOMIC_WORDS).await?;
    let before = conn.stats();
    let t0 = Instant::now();
    let mut p = Progress::default();
    let res = run_mix(conn, region, total, chunk, &mut p).await;
    let secs = t0.elapsed().as_secs_f64();
    let after = conn.stats();
    let rdma = RdmaCounters::between(conn, &before, &after);
    Ok(SoakReport {
        transport: conn.transport().to_string(),
        provider: conn.info().provider.clone(),
        bytes: p.moved,
        chunk,
        seconds: secs,
        goodput_mb_per_s: p.moved as f64 / secs.max(1e-9) / 1e6,
        ops: p.ops,
        verified: res.is_ok(),
        rdma,
        error: res.err().map(|e| e.to_string()),
    })
}

async fn run_mix(
    conn: &Connection,
    region: rdmx_core::RemoteRegion,
    total: u64,
    chunk: u64,
    p: &mut Progress,
) -> Result<(), Error> {
    let max_msg = conn.capabilities().max_message_size.max(1);
    let faa = region.word(SLOTS * chunk)?;
    let cas = region.word(SLOTS * chunk + 8)?;
    // What the atomic words hold (the region starts zeroed).
    let (mut faa_now, mut cas_now) = (0u64, 0u64);
    let mut i = 0u64;
    while p.moved < total {
        let left = total - p.moved;
        let slot = i % SLOTS;
        // Six kinds in turn; a write and its read-back move 2 × len, so the
        // total is exact.
        match i % 6 {
            // Write, then read the same range back.
            0 | 3 if left >= 2 => {
                let len = chunk.min(left / 2) as usize;
                let payload = data(i, len);
                let dst = region.slice(slot * chunk, len as u64)?;
                conn.write(payload.clone(), dst).await?;
                let back = conn.read(dst).await?;
                if Sha256::digest(&back) != Sha256::digest(&payload) {
                    return Err(Error::Protocol(format!("op {i}: read back differs")));
                }
                p.moved += 2 * len as u64;
                p.ops += 2;
            }
            // Write with immediate: the server hashes the slot it landed in.
            1 => {
                let len = chunk.min(left) as usize;
                let payload = data(i, len);
                let dst = region.slice(slot * chunk, len as u64)?;
                conn.write_with_imm(payload.clone(), dst, slot as u32)
                    .await?;
                let digest = conn.recv_message().await?;
                if digest[..] != Sha256::digest(&payload)[..] {
                    return Err(Error::Protocol(format!(
                        "op {i}: the server saw other bytes after a write with immediate"
                    )));
                }
                p.moved += len as u64;
                p.ops += 1;
            }
            // Atomics: each returns what the word held, which this client knows.
            4 => {
                let was = conn.fetch_and_add(faa, i).await?;
                if was != faa_now {
                    return Err(Error::Protocol(format!(
                        "op {i}: fetch-and-add returned {was}, the word held {faa_now}"
                    )));
                }
                faa_now = faa_now.wrapping_add(i);
                // One compare-and-swap that must miss, one that must hit.
                let miss = conn.compare_and_swap(cas, cas_now ^ 1, u64::MAX).await?;
                let hit = conn.compare_and_swap(cas, cas_now, i).await?;
                if miss != cas_now || hit != cas_now {
                    return Err(Error::Protocol(format!(
                        "op {i}: compare-and-swap returned {miss} and {hit}, the word held {cas_now}"
                    )));
                }
                cas_now = i;
                p.ops += 3;
            }
            // Messages (the whole chunk, in pieces the peer accepts); the
            // server answers each with its digest.
            _ => {
                let len = chunk.min(left) as usize;
                let payload = data(i, len);
                for piece in payload.chunks(max_msg as usize) {
                    let msg = payload.slice_ref(piece);
                    conn.send(msg.clone()).await?;
                    let digest = conn.recv_message().await?;
                    if digest[..] != Sha256::digest(&msg)[..] {
                        return Err(Error::Protocol(format!("op {i}: message digest differs")));
                    }
                    p.moved += msg.len() as u64;
                    p.ops += 1;
                }
            }
        }
        i += 1;
    }
    Ok(())
}
