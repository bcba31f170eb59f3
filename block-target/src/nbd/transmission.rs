//! The transmission phase of the NBD server (NBD `doc/proto.md`,
//! "Transmission"): one task per client reads requests, runs them on the
//! Initiator concurrently (replies in any order, as the protocol allows) and
//! writes each reply as its request completes.
//!
//! The task itself drives the requests in flight (no task per request, no
//! writer task), so a completion reaches the client socket without a hop
//! between tasks: at queue depth 1 the NVMe response wakes the very task
//! that writes the NBD reply.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures_util::future::try_join_all;
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};

use super::proto::{self, cflag, cmd, errno, Request};
use super::server::{bad, MAX_INFLIGHT, MAX_PAYLOAD};
use super::stats::NbdStats;
use crate::fabric::{BlockError, Initiator};
use crate::nvme::identify::MAX_TRANSFER;
use crate::nvme::status::Status;

/// A request's outcome: data to return (READ, BLOCK_STATUS) or an NBD
/// error number and message.
type Outcome = Result<Option<Bytes>, (u32, String)>;

/// One reply to write.
struct Reply {
    cookie: u64,
    kind: u16,
    offset: u64,
    /// Bytes of the export the request covers (counted if it succeeded).
    length: u32,
    /// From the request read to its outcome.
    took: Duration,
    result: Outcome,
}

/// A request being served, counted in [`NbdStats::inflight`] until it is
/// answered or dropped with its connection.
struct Serving(Arc<NbdStats>);

impl Serving {
    fn new(stats: &Arc<NbdStats>) -> Serving {
        stats.inflight.fetch_add(1, Relaxed);
        Serving(stats.clone())
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Relaxed);
    }
}

/// What the client sent next.
enum Next {
    /// A request, with its payload (WRITE).
    Request(Request, Bytes),
    /// A WRITE above [`MAX_PAYLOAD`]: its payload is being dropped.
    Oversize(Request),
    /// The client closed the connection between requests.
    End,
}

/// Reads requests; cancel-safe (every byte read stays in `buf` until a
/// whole request is taken), so the serving loop can wait for a request and
/// for completions at once.
struct RequestReader<R> {
    rd: R,
    buf: BytesMut,
    /// Bytes of an oversize WRITE's payload still to drop.
    skip: u64,
}

impl<R: AsyncRead + Unpin> RequestReader<R> {
    /// Read more into `buf`; false at end of stream.
    async fn fill(&mut self) -> std::io::Result<bool> {
        if self.buf.capacity() - self.buf.len() < 16 << 10 {
            self.buf.reserve(64 << 10);
        }
        Ok(self.rd.read_buf(&mut self.buf).await? > 0)
    }

    async fn next(&mut self) -> std::io::Result<Next> {
        loop {
            if self.skip > 0 {
                let n = self.skip.min(self.buf.len() as u64);
                self.buf.advance(n as usize);
                self.skip -= n;
            }
            if self.skip == 0 && self.buf.len() >= Request::LEN {
                let hdr: &[u8; Request::LEN] = self.buf[..Request::LEN].try_into().expect("len");
                let Some(r) = Request::parse(hdr) else {
                    return Err(bad("request without its magic"));
                };
                if r.kind != cmd::WRITE {
                    self.buf.advance(Request::LEN);
                    return Ok(Next::Request(r, Bytes::new()));
                }
                if r.length > MAX_PAYLOAD {
                    // Its data is read and dropped; the error goes out at once.
                    self.buf.advance(Request::LEN);
                    self.skip = u64::from(r.length);
                    return Ok(Next::Oversize(r));
                }
                let total = Request::LEN + r.length as usize;
                if self.buf.len() >= total {
                    let mut frame = self.buf.split_to(total);
                    frame.advance(Request::LEN);
                    return Ok(Next::Request(r, frame.freeze()));
                }
                self.buf.reserve(total - self.buf.len());
            }
            if !self.fill().await? {
                return if self.buf.is_empty() && self.skip == 0 {
                    Ok(Next::End)
                } else {
                    Err(std::io::ErrorKind::UnexpectedEof.into())
                };
            }
        }
    }
}

/// Serve requests until DISC or end of stream, then answer what is
/// outstanding.
pub(super) async fn transmission<R, W>(
    rd: BufReader<R>,
    mut wr: BufWriter<W>,
    dev: Arc<Initiator>,
    structured: bool,
    meta: bool,
    stats: Arc<NbdStats>,
) -> std::io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let st = &*stats;
    let size = dev.blocks() * u64::from(dev.block_size());
    let bs = u64::from(dev.block_size());
    // What negotiation left buffered comes first.
    let mut reader = RequestReader {
        buf: BytesMut::from(rd.buffer()),
        rd: rd.into_inner(),
        skip: 0,
    };
    let mut inflight = FuturesUnordered::new();
    let mut reading = true;
    // Held while requests keep coming: their NVMe capsules leave together.
    let mut cork = None;
    loop {
        // Requests already read (buffered, or readable at once) are taken
        // without waiting.
        let ready = if reading && inflight.len() < MAX_INFLIGHT {
            reader.next().now_or_never()
        } else {
            None
        };
        let next = match ready {
            Some(next) => next,
            None => {
                // A lull: replies and capsules of the burst leave now.
                while let Some(Some(rep)) = inflight.next().now_or_never() {
                    write_reply(&mut wr, rep, structured, st).await?;
                }
                cork = None;
                wr.flush().await?;
                tokio::select! {
                    biased;
                    Some(first) = inflight.next(), if !inflight.is_empty() => {
                        write_reply(&mut wr, first, structured, st).await?;
                        continue;
                    }
                    next = reader.next(), if reading && inflight.len() < MAX_INFLIGHT => next,
                    else => break,
                }
            }
        };
        if cork.is_none() {
            cork = Some(dev.cork());
        }
        let (r, payload) = match next {
            Ok(Next::Request(r, _)) if r.kind == cmd::DISC => {
                reading = false;
                continue;
            }
            Ok(Next::Request(r, p)) => (r, p),
            Ok(Next::Oversize(r)) => {
                let rep = failed(&r, errno::EOVERFLOW, "write above the maximum payload");
                write_reply(&mut wr, rep, structured, st).await?;
                continue;
            }
            // fio ends with a plain EOF, no DISC.
            Ok(Next::End) => {
                reading = false;
                continue;
            }
            Err(e) => {
                // Answer what is in flight, then report.
                drop(cork);
                while let Some(rep) = inflight.next().await {
                    write_reply(&mut wr, rep, structured, st).await?;
                }
                wr.flush().await?;
                return Err(e);
            }
        };
        if let Err((e, m)) = check(&r, size, bs, meta) {
            write_reply(&mut wr, failed(&r, e, m), structured, st).await?;
            continue;
        }
        let dev2 = dev.clone();
        let serving = Serving::new(&stats);
        let t0 = Instant::now();
        inflight.push(async move {
            let result = run(&dev2, &r, payload, size).await;
            drop(serving);
            Reply {
                cookie: r.cookie,
                kind: r.kind,
                offset: r.offset,
                length: r.length,
                took: t0.elapsed(),
                result,
            }
        });
        // Post its capsule (into the cork), and take what has finished.
        while let Some(Some(rep)) = inflight.next().now_or_never() {
            write_reply(&mut wr, rep, structured, st).await?;
        }
    }
    drop(cork);
    wr.flush().await
}

/// The error reply to a request refused before it ran.
fn failed(r: &Request, code: u32, msg: &str) -> Reply {
    Reply {
        cookie: r.cookie,
        kind: r.kind,
        offset: r.offset,
        length: r.length,
        took: Duration::ZERO,
        result: Err((code, msg.to_string())),
    }
}

/// Write one reply (simple, or structured where negotiated) into `wr`, and
/// count it.
async fn write_reply<W: AsyncWrite + Unpin>(
    wr: &mut BufWriter<W>,
    rep: Reply,
    structured: bool,
    stats: &NbdStats,
) -> std::io::Result<()> {
    let covered = match (rep.kind, &rep.result) {
        (_, Err(_)) | (cmd::FLUSH | cmd::BLOCK_STATUS, _) => 0,
        _ => u64::from(rep.length),
    };
    stats.record(rep.kind, covered, rep.result.is_err(), rep.took);
    let mut h = BytesMut::with_capacity(64);
    match (rep.kind, rep.result) {
        (cmd::READ, Ok(Some(data))) if structured => {
            wr.write_all(&proto::read_chunk_header(
                rep.cookie,
                rep.offset,
                data.len(),
            ))
            .await?;
            wr.write_all(&data).await
        }
        (cmd::READ, Ok(Some(data))) => {
            proto::simple_reply(&mut h, 0, rep.cookie);
            wr.write_all(&h).await?;
            wr.write_all(&data).await
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
            wr.write_all(&h).await
        }
        (_, Ok(_)) => {
            proto::simple_reply(&mut h, 0, rep.cookie);
            wr.write_all(&h).await
        }
        (kind, Err((code, msg))) => {
            if structured && (kind == cmd::READ || kind == cmd::BLOCK_STATUS) {
                proto::error_chunk(&mut h, rep.cookie, code, &msg);
            } else {
                proto::simple_reply(&mut h, code, rep.cookie);
            }
            wr.write_all(&h).await
        }
    }
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
