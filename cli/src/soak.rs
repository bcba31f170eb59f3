//! `rdmx soak`: a data-integrity run over a path. The client moves a mix of
//! writes, reads and sends (256 MiB by default) and checks every byte by
//! SHA-256; it reports goodput and the protocol counters (retransmits, NAKs,
//! CNPs), so the same command measures a lossy or congested path.
//!
//! ```text
//! rdmx soak server --listen 198.18.0.2:7500 --transport rdma
//! rdmx soak client rdma://198.18.0.2:7500 --bytes 256m --json
//! ```

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use rdmx_core::{Access, Connection, Error, Options, RemoteRegion, Transports};
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};
use serde::Serialize;

use crate::perf::parse_size;
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
    /// Bytes to move in total (k/m/g suffixes).
    #[arg(long, default_value = "256m")]
    bytes: String,
    /// Size of each operation (k/m suffixes).
    #[arg(long, default_value = "1m")]
    chunk: String,
    /// Soft RoCE: use go-back-N instead of selective repeat (what NICs speak;
    /// one end asking is enough).
    #[arg(long)]
    go_back_n: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// What a soak run measured.
#[derive(Debug, Serialize)]
pub(crate) struct SoakReport {
    transport: String,
    provider: String,
    bytes: u64,
    seconds: f64,
    goodput_mb_per_s: f64,
    ops: u64,
    verified: bool,
    retransmits: u64,
    naks: u64,
    rnr_naks: u64,
    cnps: u64,
    ce_marked: u64,
}

/// The transports; a soft RoCE device only if this run uses RDMA (so a TCP
/// soak never takes UDP 4791 from an RDMA one on the same host).
fn transports(go_back_n: bool, rdma: bool) -> Result<(Transports, Option<Arc<SoftRoce>>), Error> {
    let ts = Transports::new().with(rdmx_transport_tcp::TcpTransport::new());
    if !rdma {
        return Ok((ts, None));
    }
    let dev = if go_back_n {
        Arc::new(SoftRoce::new(SoftConfig {
            selective_repeat: false,
            ..SoftConfig::default()
        })?)
    } else {
        SoftRoce::global()?
    };
    Ok((
        ts.with(RdmaTransport::with_provider(dev.clone())),
        Some(dev),
    ))
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
    let (ts, dev) = transports(a.go_back_n, rdma)?;
    let opts = Options::default();
    match a.role.as_str() {
        "server" => {
            let (mut l, _) = ts
                .listen(&format!("{}://{}", a.transport, a.listen), &opts)
                .await?;
            eprintln!("rdmx soak server: {} on {}", a.transport, l.local_addr());
            loop {
                let conn = l.accept().await?;
                tokio::spawn(async move {
                    match serve(conn).await {
                        Err(Error::Disconnected(_)) | Ok(()) => {}
                        Err(e) => eprintln!("rdmx soak server: {e}"),
                    }
                });
            }
        }
        "client" => {
            let url = a
                .url
                .as_deref()
                .ok_or_else(|| Error::InvalidArgument("client needs a URL".into()))?;
            let conn = ts.connect(url, &opts).await?;
            let before = dev.as_ref().map_or(0, |d| d.stats().ce_marked);
            let mut report = client(&conn, parse_size(&a.bytes)?, parse_size(&a.chunk)?).await?;
            if let Some(d) = &dev {
                report.ce_marked = d.stats().ce_marked - before;
            }
            if a.json {
                println!(
                    "{}",
                    serde_json::to_string(&report).map_err(|e| Error::Protocol(e.to_string()))?
                );
            } else {
                println!(
                    "{} over {}: {} bytes in {:.2} s, {:.0} MB/s goodput, {} ops verified; \
                     retransmits {}, NAKs {}, RNR NAKs {}, CNPs {}, CE-marked {}",
                    report.transport,
                    report.provider,
                    report.bytes,
                    report.seconds,
                    report.goodput_mb_per_s,
                    report.ops,
                    report.retransmits,
                    report.naks,
                    report.rnr_naks,
                    report.cnps,
                    report.ce_marked
                );
            }
            Ok(())
        }
        r => Err(Error::InvalidArgument(format!(
            "soak role {r:?}: use `server` or `client URL`"
        ))),
    }
}

/// Server: give the client a region; answer each message with its SHA-256.
async fn serve(conn: Connection) -> Result<(), Error> {
    let len = u64::from_le_bytes(
        conn.recv_message().await?[..]
            .try_into()
            .map_err(|_| Error::Protocol("bad soak hello".into()))?,
    );
    if len > 1 << 30 {
        return Err(Error::ResourceExhausted(format!("{len}-byte region asked")));
    }
    let mr = conn.domain().register(len as usize, Access::ALL);
    conn.send(mr.remote().to_bytes().to_vec()).await?;
    loop {
        let m = conn.recv_message().await?;
        let digest: [u8; 32] = Sha256::digest(&m).into();
        conn.send(digest.to_vec()).await?;
    }
}

/// Client: writes, reads back and sends `total` bytes in `chunk`s, checking all.
async fn client(conn: &Connection, total: u64, chunk: u64) -> Result<SoakReport, Error> {
    let chunk = chunk.clamp(1, 8 << 20);
    let slots = 8u64;
    conn.send((chunk * slots).to_le_bytes().to_vec()).await?;
    let region = RemoteRegion::from_bytes(&conn.recv_message().await?)
        .ok_or_else(|| Error::Protocol("bad region from soak server".into()))?;
    let before = conn.stats();
    let t0 = Instant::now();
    let (mut moved, mut ops, mut i) = (0u64, 0u64, 0u64);
    while moved < total {
        let len = chunk.min(total - moved) as usize;
        let payload = data(i, len);
        match i % 3 {
            // Write, then read the same range back.
            0 | 1 => {
                let dst = region.slice((i % slots) * chunk, len as u64)?;
                conn.write(payload.clone(), dst).await?;
                let back = conn.read(dst).await?;
                if Sha256::digest(&back) != Sha256::digest(&payload) {
                    return Err(Error::Protocol(format!("op {i}: read back differs")));
                }
                moved += 2 * len as u64;
                ops += 2;
            }
            // A message; the server answers with its digest.
            _ => {
                let len = len.min(conn.capabilities().max_message_size as usize);
                let msg = payload.slice(..len);
                conn.send(msg.clone()).await?;
                let digest = conn.recv_message().await?;
                if digest[..] != Sha256::digest(&msg)[..] {
                    return Err(Error::Protocol(format!("op {i}: message digest differs")));
                }
                moved += len as u64;
                ops += 1;
            }
        }
        i += 1;
    }
    let secs = t0.elapsed().as_secs_f64();
    let after = conn.stats();
    Ok(SoakReport {
        transport: conn.transport().to_string(),
        provider: conn.info().provider.clone(),
        bytes: moved,
        seconds: secs,
        goodput_mb_per_s: moved as f64 / secs / 1e6,
        ops,
        verified: true,
        retransmits: after.retransmits - before.retransmits,
        naks: after.naks - before.naks,
        rnr_naks: after.rnr_naks - before.rnr_naks,
        cnps: after.cnps - before.cnps,
        ce_marked: 0,
    })
}
