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

use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::future::try_join_all;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};

use super::proto::{self, cflag, cmd, errno, info, opt, rep, tflag, Request};
use crate::fabric::{BlockError, Initiator};
use crate::nvme::identify::MAX_TRANSFER;
use crate::nvme::status::Status;

/// Largest READ or WRITE payload (INFO_BLOCK_SIZE maximum), as qemu-nbd.
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Largest option data accepted during negotiation.
const MAX_OPTION: u32 = 64 << 10;
/// Requests in flight per connection.
const MAX_INFLIGHT: usize = 64;
/// Options a client may send before it must choose an export.
const MAX_OPTIONS: usize = 64;

/// The export.
#[derive(Clone, Debug)]
pub struct NbdConfig {
    /// Export name ("" always works too).
    pub export: String,
    /// Description (INFO_DESCRIPTION).
    pub description: String,
}

impl Default for NbdConfig {
    fn default() -> Self {
        NbdConfig {
            export: "rdmx".into(),
            description: "an rdmx NVMe-oF namespace".into(),
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
                tokio::spawn(async move {
                    match connection(s, d, c).await {
                        Ok(()) => tracing::debug!(%peer, "NBD connection closed"),
                        Err(e) => tracing::info!(%peer, error = %e, "NBD connection ended"),
                    }
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
    transmission(rd, wr, dev, session).await
}

fn bad(msg: &str) -> std::io::Error {
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

/// A finished request, for the writer.
struct Reply {
    cookie: u64,
    kind: u16,
    offset: u64,
    result: Result<Option<Bytes>, (u32, String)>,
}

async fn transmission<R, W>(
    mut rd: BufReader<R>,
    wr: BufWriter<W>,
    dev: Arc<Initiator>,
    s: Session,
) -> std::io::Result<()>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    let structured = s.structured;
    let writer = tokio::spawn(write_loop(wr, rx, structured, s.meta));
    let slots = Arc::new(Semaphore::new(MAX_INFLIGHT));
    let size = dev.blocks() * u64::from(dev.block_size());
    let bs = u64::from(dev.block_size());
    let result = loop {
        let mut hdr = [0u8; Request::LEN];
        match rd.read_exact(&mut hdr).await {
            Ok(_) => {}
            // fio ends with a plain EOF, no DISC.
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(e),
        }
        let Some(r) = Request::parse(&hdr) else {
            break Err(bad("request without its magic"));
        };
        if r.kind == cmd::DISC {
            break Ok(());
        }
        let fail = |e: u32, m: &str| Reply {
            cookie: r.cookie,
            kind: r.kind,
            offset: r.offset,
            result: Err((e, m.to_string())),
        };
        // WRITE's payload is read now, whatever happens to the request.
        let mut payload = Bytes::new();
        if r.kind == cmd::WRITE {
            if r.length > MAX_PAYLOAD {
                let mut left = u64::from(r.length);
                let mut sink = vec![0u8; 1 << 20];
                while left > 0 {
                    let n = left.min(sink.len() as u64) as usize;
                    rd.read_exact(&mut sink[..n]).await?;
                    left -= n as u64;
                }
                let _ = tx.send(fail(errno::EOVERFLOW, "write above the maximum payload"));
                continue;
            }
            let mut b = BytesMut::zeroed(r.length as usize);
            rd.read_exact(&mut b).await?;
            payload = b.freeze();
        }
        if let Err((e, m)) = check(&r, size, bs, s.meta.is_some()) {
            let _ = tx.send(fail(e, m));
            continue;
        }
        let permit = slots.clone().acquire_owned().await.expect("never closed");
        let (dev, tx) = (dev.clone(), tx.clone());
        tokio::spawn(async move {
            let result = run(&dev, &r, payload, size).await;
            let _ = tx.send(Reply {
                cookie: r.cookie,
                kind: r.kind,
                offset: r.offset,
                result,
            });
            drop(permit);
        });
    };
    // DISC (or EOF): answer what is outstanding, then close.
    let _ = slots.acquire_many(MAX_INFLIGHT as u32).await;
    drop(tx);
    let _ = writer.await;
    result
}

/// Check a request against the export and the negotiated flags (NBD
/// "Request types" and "Size constraints").
fn check(r: &Request, size: u64, bs: u64, meta: bool) -> Result<(), (u32, &'static str)> {
    let allowed = match r.kind {
        cmd::READ => cflag::DF,
        cmd::WRITE | cmd::TRIM => cflag::FUA,
        cmd::WRITE_ZEROES => cflag::FUA | cflag::NO_HOLE | cflag::FAST_ZERO,
        cmd::BLOCK_STATUS => cflag::REQ_ONE,
        cmd::FLUSH | cmd::CACHE => 0,
        _ => return Err((errno::EINVAL, "unknown command")),
    };
    if r.flags & !allowed != 0 {
        return Err((errno::EINVAL, "flag not valid for this command"));
    }
    if r.kind == cmd::FLUSH {
        return Ok(());
    }
    if r.kind == cmd::BLOCK_STATUS && !meta {
        return Err((errno::EINVAL, "no metadata context selected"));
    }
    if r.kind == cmd::READ && r.length > MAX_PAYLOAD {
        return Err((errno::EOVERFLOW, "read above the maximum payload"));
    }
    let end = r.offset.checked_add(u64::from(r.length));
    if end.is_none_or(|e| e > size) {
        let e = if r.kind == cmd::WRITE || r.kind == cmd::WRITE_ZEROES {
            errno::ENOSPC
        } else {
            errno::EINVAL
        };
        return Err((e, "past the end of the export"));
    }
    if r.kind != cmd::BLOCK_STATUS
        && r.kind != cmd::CACHE
        && (r.offset % bs != 0 || u64::from(r.length) % bs != 0)
    {
        return Err((errno::EINVAL, "not aligned to the minimum block size"));
    }
    Ok(())
}

fn nbd_errno(e: &BlockError) -> (u32, String) {
    let code = match e {
        BlockError::Invalid(_) => errno::EINVAL,
        BlockError::Nvme(s) if *s == Status::LBA_OUT_OF_RANGE => errno::EINVAL,
        BlockError::Nvme(s) if s.sct == 0 && matches!(s.sc, 0x01 | 0x02) => errno::EINVAL,
        BlockError::Transport(_) => errno::ESHUTDOWN,
        _ => errno::EIO,
    };
    (code, e.to_string())
}

/// Run one request on the Initiator, in NVMe commands of at most MDTS.
async fn run(
    dev: &Initiator,
    r: &Request,
    payload: Bytes,
    size: u64,
) -> Result<Option<Bytes>, (u32, String)> {
    let bs = u64::from(dev.block_size());
    let lba = r.offset / bs;
    let fua = r.flags & cflag::FUA != 0;
    let step = u64::from(MAX_TRANSFER) / bs;
    let pieces = |total: u64, max: u64| {
        (0..total.div_ceil(max)).map(move |i| (i * max, max.min(total - i * max)))
    };
    let blocks = u64::from(r.length) / bs;
    let e = |err: BlockError| nbd_errno(&err);
    match r.kind {
        cmd::READ => {
            if blocks == 0 {
                return Ok(Some(Bytes::new()));
            }
            let parts =
                try_join_all(pieces(blocks, step).map(|(at, n)| dev.read(lba + at, n as u32)))
                    .await
                    .map_err(e)?;
            if parts.len() == 1 {
                return Ok(parts.into_iter().next());
            }
            let mut out = BytesMut::with_capacity(r.length as usize);
            for p in parts {
                out.put_slice(&p);
            }
            Ok(Some(out.freeze()))
        }
        cmd::WRITE => {
            try_join_all(pieces(blocks, step).map(|(at, n)| {
                let d = payload.slice((at * bs) as usize..((at + n) * bs) as usize);
                dev.write(lba + at, d, fua)
            }))
            .await
            .map_err(e)?;
            Ok(None)
        }
        cmd::FLUSH => dev.flush().await.map(|_| None).map_err(e),
        cmd::TRIM => {
            try_join_all(pieces(blocks, 1 << 22).map(|(at, n)| dev.trim(lba + at, n as u32)))
                .await
                .map_err(e)?;
            if fua {
                dev.flush().await.map_err(e)?;
            }
            Ok(None)
        }
        cmd::WRITE_ZEROES => {
            try_join_all(
                pieces(blocks, 1 << 16).map(|(at, n)| dev.write_zeroes(lba + at, n as u32, fua)),
            )
            .await
            .map_err(e)?;
            Ok(None)
        }
        cmd::CACHE => Ok(None),
        cmd::BLOCK_STATUS => {
            // base:allocation: all allocated data (status 0 is always true).
            let len = u64::from(r.length).min(size - r.offset) as u32;
            let mut b = BytesMut::with_capacity(12);
            b.put_u32(1);
            b.put_u32(len);
            b.put_u32(0);
            Ok(Some(b.freeze()))
        }
        _ => Err((errno::EINVAL, "unknown command".into())),
    }
}

async fn write_loop<W: tokio::io::AsyncWrite + Unpin>(
    wr: BufWriter<W>,
    mut rx: mpsc::UnboundedReceiver<Reply>,
    structured: bool,
    _meta: Option<u32>,
) -> std::io::Result<()> {
    let mut wr = wr;
    let mut h = BytesMut::with_capacity(64);
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(rep) = next.take() {
            h.clear();
            match (rep.kind, rep.result) {
                (cmd::READ, Ok(Some(data))) if structured => {
                    wr.write_all(&proto::read_chunk_header(
                        rep.cookie,
                        rep.offset,
                        data.len(),
                    ))
                    .await?;
                    wr.write_all(&data).await?;
                }
                (cmd::READ, Ok(Some(data))) => {
                    proto::simple_reply(&mut h, 0, rep.cookie);
                    wr.write_all(&h).await?;
                    wr.write_all(&data).await?;
                }
                (cmd::BLOCK_STATUS, Ok(Some(extents))) => {
                    proto::chunk_header(
                        &mut h,
                        proto::chunk::FLAG_DONE,
                        proto::chunk::BLOCK_STATUS,
                        rep.cookie,
                        extents.len() as u32,
                    );
                    h.put_slice(&extents);
                    wr.write_all(&h).await?;
                }
                (_, Ok(_)) => {
                    proto::simple_reply(&mut h, 0, rep.cookie);
                    wr.write_all(&h).await?;
                }
                (kind, Err((code, msg))) => {
                    if structured && (kind == cmd::READ || kind == cmd::BLOCK_STATUS) {
                        proto::error_chunk(&mut h, rep.cookie, code, &msg);
                    } else {
                        proto::simple_reply(&mut h, code, rep.cookie);
                    }
                    wr.write_all(&h).await?;
                }
            }
            next = rx.try_recv().ok();
        }
        wr.flush().await?;
    }
    wr.flush().await
}
