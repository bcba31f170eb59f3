//! An NBD server whose export is a remote namespace reached through the
//! [`Initiator`]: unmodified nbd-client, qemu-img, qemu-io, nbdinfo,
//! nbdcopy and fio's `nbd` engine use an rdmx namespace.
//!
//! Negotiation (fixed newstyle): EXPORT_NAME, ABORT, LIST, INFO and GO with
//! block sizes, STRUCTURED_REPLY, LIST_ and SET_META_CONTEXT
//! (`base:allocation`). Transmission: READ, WRITE, FLUSH, TRIM, CACHE,
//! WRITE_ZEROES (fast zero included), BLOCK_STATUS and DISC, with many
//! requests in flight and replies in any order. Requests above the maximum
//! payload (32 MiB) get EOVERFLOW, their data read and dropped;
//! WRITE_ZEROES and TRIM carry no payload and are split into NVMe commands
//! whatever their length. Every connection shares one Initiator, so a FLUSH
//! on any of them covers writes completed on all (CAN_MULTI_CONN).

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

use super::proto::{self, info, opt, rep, tflag};
use super::stats::NbdStats;
use super::transmission::transmission;
use crate::fabric::Initiator;

/// Largest READ or WRITE payload (INFO_BLOCK_SIZE maximum), as qemu-nbd.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Largest option data accepted during negotiation.
const MAX_OPTION: u32 = 64 << 10;
/// Requests in flight per connection.
pub(super) const MAX_INFLIGHT: usize = 64;
/// Options a client may send before it must choose an export.
const MAX_OPTIONS: usize = 64;

/// The export.
#[derive(Clone, Debug)]
pub struct NbdConfig {
    /// Export name ("" always works too).
    pub export: String,
    /// Description (INFO_DESCRIPTION).
    pub description: String,
    /// Where the export counts connections and requests (shared by every
    /// connection; render with [`NbdStats::render`]).
    pub stats: Arc<NbdStats>,
}

impl Default for NbdConfig {
    fn default() -> Self {
        NbdConfig {
            export: "rdmx".into(),
            description: "an rdmx NVMe-oF namespace".into(),
            stats: Arc::default(),
        }
    }
}

/// Serve NBD on `listener` until the process ends.
pub async fn serve(listener: TcpListener, dev: Arc<Initiator>, cfg: NbdConfig) {
    let cfg = Arc::new(cfg);
    loop {
        match listener.accept().await {
            Ok((s, peer)) => {
                let (d, c) = (dev.clone(), cfg.clone());
                let stats = cfg.stats.clone();
                stats.connections_total.fetch_add(1, Relaxed);
                stats.connections.fetch_add(1, Relaxed);
                tokio::spawn(async move {
                    match connection(s, d, c).await {
                        Ok(()) => tracing::debug!(%peer, "NBD connection closed"),
                        Err(e) => {
                            if e.kind() == std::io::ErrorKind::InvalidData {
                                stats.protocol_errors.fetch_add(1, Relaxed);
                            }
                            tracing::info!(%peer, error = %e, "NBD connection ended")
                        }
                    }
                    stats.connections.fetch_sub(1, Relaxed);
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

fn transmission_flags() -> u16 {
    tflag::HAS_FLAGS
        | tflag::SEND_FLUSH
        | tflag::SEND_FUA
        | tflag::SEND_TRIM
        | tflag::SEND_WRITE_ZEROES
        | tflag::SEND_DF
        | tflag::CAN_MULTI_CONN
        | tflag::SEND_CACHE
        | tflag::SEND_FAST_ZERO
}

/// What the negotiation settled.
struct Session {
    structured: bool,
    meta: Option<u32>,
}

/// Serve one client.
pub async fn connection(
    stream: TcpStream,
    dev: Arc<Initiator>,
    cfg: Arc<NbdConfig>,
) -> std::io::Result<()> {
    let _ = stream.set_nodelay(true);
    let (rd, wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(256 << 10, rd);
    let mut wr = BufWriter::with_capacity(256 << 10, wr);
    let Some(session) = negotiate(&mut rd, &mut wr, &dev, &cfg).await? else {
        return Ok(());
    };
    let meta = session.meta.is_some();
    transmission(rd, wr, dev, session.structured, meta, cfg.stats.clone()).await
}

pub(super) fn bad(msg: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg.to_string())
}

async fn negotiate<R, W>(
    rd: &mut R,
    wr: &mut W,
    dev: &Initiator,
    cfg: &NbdConfig,
) -> std::io::Result<Option<Session>>
where
    R: AsyncReadExt + Unpin,
    W: AsyncWriteExt + Unpin,
{
    let size = dev.blocks() * u64::from(dev.block_size());
    let mut hello = BytesMut::with_capacity(18);
    hello.put_u64(proto::NBDMAGIC);
    hello.put_u64(proto::IHAVEOPT);
    hello.put_u16(proto::HANDSHAKE_FLAGS);
    wr.write_all(&hello).await?;
    wr.flush().await?;
    let client = rd.read_u32().await?;
    if client & !proto::CLIENT_FLAGS_KNOWN != 0 {
        return Err(bad("unknown client flags"));
    }
    let no_zeroes = client & proto::CLIENT_NO_ZEROES != 0;
    let mut s = Session {
        structured: false,
        meta: None,
    };
    let ours = |name: &str| name.is_empty() || name == cfg.export;
    for _ in 0..MAX_OPTIONS {
        if rd.read_u64().await? != proto::IHAVEOPT {
            return Err(bad("option without IHAVEOPT"));
        }
        let option = rd.read_u32().await?;
        let len = rd.read_u32().await?;
        if len > MAX_OPTION {
            // Not read into memory: the connection ends.
            let mut out = BytesMut::new();
            proto::option_reply(&mut out, option, rep::ERR_TOO_BIG, b"option data too large");
            wr.write_all(&out).await?;
            wr.flush().await?;
            return Err(bad("option data too large"));
        }
        let mut data = vec![0u8; len as usize];
        rd.read_exact(&mut data).await?;
        let mut out = BytesMut::new();
        let mut reply = |kind: u32, d: &[u8]| proto::option_reply(&mut out, option, kind, d);
        match option {
            opt::EXPORT_NAME => {
                let name = String::from_utf8_lossy(&data);
                if !ours(&name) {
                    return Err(bad("unknown export"));
                }
                let mut b = BytesMut::new();
                b.put_u64(size);
                b.put_u16(transmission_flags());
                if !no_zeroes {
                    b.put_bytes(0, 124);
                }
                wr.write_all(&b).await?;
                wr.flush().await?;
                return Ok(Some(s));
            }
            opt::ABORT => {
                reply(rep::ACK, &[]);
                wr.write_all(&out).await?;
                wr.flush().await?;
                return Ok(None);
            }
            opt::LIST => {
                if !data.is_empty() {
                    reply(rep::ERR_INVALID, b"LIST takes no data");
                } else {
                    let mut d = Vec::new();
                    d.extend_from_slice(&(cfg.export.len() as u32).to_be_bytes());
                    d.extend_from_slice(cfg.export.as_bytes());
                    reply(rep::SERVER, &d);
                    reply(rep::ACK, &[]);
                }
            }
            opt::INFO | opt::GO => match proto::InfoRequest::parse(&data) {
                None => reply(rep::ERR_INVALID, b"malformed INFO/GO request"),
                Some(r) if !ours(&r.name) => reply(rep::ERR_UNKNOWN, b"no such export"),
                Some(r) => {
                    let mut e = Vec::new();
                    e.extend_from_slice(&info::EXPORT.to_be_bytes());
                    e.extend_from_slice(&size.to_be_bytes());
                    e.extend_from_slice(&transmission_flags().to_be_bytes());
                    reply(rep::INFO, &e);
                    let mut b = Vec::new();
                    b.extend_from_slice(&info::BLOCK_SIZE.to_be_bytes());
                    b.extend_from_slice(&dev.block_size().to_be_bytes());
                    b.extend_from_slice(&4096u32.max(dev.block_size()).to_be_bytes());
                    b.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
                    reply(rep::INFO, &b);
                    if r.requests.contains(&info::NAME) {
                        let mut n = info::NAME.to_be_bytes().to_vec();
                        n.extend_from_slice(cfg.export.as_bytes());
                        reply(rep::INFO, &n);
                    }
                    if r.requests.contains(&info::DESCRIPTION) {
                        let mut n = info::DESCRIPTION.to_be_bytes().to_vec();
                        n.extend_from_slice(cfg.description.as_bytes());
                        reply(rep::INFO, &n);
                    }
                    reply(rep::ACK, &[]);
                    if option == opt::GO {
                        wr.write_all(&out).await?;
                        wr.flush().await?;
                        return Ok(Some(s));
                    }
                }
            },
            opt::STRUCTURED_REPLY => {
                if data.is_empty() {
                    s.structured = true;
                    reply(rep::ACK, &[]);
                } else {
                    reply(rep::ERR_INVALID, b"STRUCTURED_REPLY takes no data");
                }
            }
            opt::LIST_META_CONTEXT | opt::SET_META_CONTEXT => {
                let set = option == opt::SET_META_CONTEXT;
                match proto::MetaRequest::parse(&data) {
                    None => reply(rep::ERR_INVALID, b"malformed meta context request"),
                    Some(_) if set && !s.structured => {
                        reply(rep::ERR_INVALID, b"structured replies first")
                    }
                    Some(m) if !ours(&m.name) => reply(rep::ERR_UNKNOWN, b"no such export"),
                    Some(m) => {
                        let matches = if m.queries.is_empty() {
                            !set
                        } else {
                            m.queries.iter().any(|q| {
                                q == proto::BASE_ALLOCATION
                                    || (!set && (q == "base:" || q.is_empty()))
                            })
                        };
                        if set {
                            s.meta = matches.then_some(1);
                        }
                        if matches {
                            let mut d = (if set { 1u32 } else { 0 }).to_be_bytes().to_vec();
                            d.extend_from_slice(proto::BASE_ALLOCATION.as_bytes());
                            reply(rep::META_CONTEXT, &d);
                        }
                        reply(rep::ACK, &[]);
                    }
                }
            }
            opt::STARTTLS => reply(rep::ERR_POLICY, b"TLS is not offered"),
            _ => reply(rep::ERR_UNSUP, b"unsupported option"),
        }
        wr.write_all(&out).await?;
        wr.flush().await?;
    }
    Err(bad("too many options"))
}
