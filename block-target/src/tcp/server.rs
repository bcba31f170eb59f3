//! The NVMe/TCP controller side (NVMe/TCP Transport Specification 1.0
//! §3.3 to §3.5): one TCP connection per queue, ICReq/ICResp, command
//! capsules with in-capsule data, R2T/H2CData for larger writes, C2HData for
//! reads, digests, and a C2HTermReq before closing on a protocol error.
//!
//! A connection reads PDUs in order; each command runs as its own task, so a
//! queue has many commands in flight (up to twice its size, as nvmet
//! allows). One writer task sends responses in completion order, coalescing
//! small ones into one write. A bad peer costs one connection: every length
//! it names is checked before anything is allocated, and the listener keeps
//! accepting.

use std::collections::HashMap;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::tcp::OwnedReadHalf;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;

use super::pdu::{self, fes, pdu_type, CommonHeader, Digests, Fatal, H2CData};
use crate::nvme::command::{fabrics, sgl, Completion, Direction, Sqe, SQE_LEN};
use crate::nvme::identify::{MAX_IN_CAPSULE, MAX_TRANSFER};
use crate::nvme::status::Status;
use crate::target::{Queue, Target};

/// Largest H2CData PDU accepted (ICResp MAXH2CDATA): one command's worth.
pub const MAX_H2C_DATA: u32 = MAX_TRANSFER;
/// How long a new connection may take to send its ICReq.
const IC_TIMEOUT: Duration = Duration::from_secs(10);

/// Serve NVMe/TCP on `listener` until the process ends. `advertise` lists
/// the port in the discovery log (I/O ports; not the discovery port).
pub async fn serve(listener: TcpListener, target: Arc<Target>, advertise: bool) {
    if advertise {
        if let Ok(a) = listener.local_addr() {
            target.add_port(a);
        }
    }
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let t = target.clone();
                tokio::spawn(async move {
                    t.stats.connections.fetch_add(1, Relaxed);
                    t.stats.connections_total.fetch_add(1, Relaxed);
                    let r = connection(stream, t.clone()).await;
                    t.stats.connections.fetch_sub(1, Relaxed);
                    match r {
                        Ok(()) => tracing::debug!(%peer, "NVMe/TCP connection closed"),
                        Err(e) => tracing::info!(%peer, error = %e, "NVMe/TCP connection ended"),
                    }
                });
            }
            Err(e) => {
                // Out of descriptors and the like: keep the listener.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
pub enum ConnError {
    /// The socket failed or the host closed it.
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    /// The host broke the protocol; a C2HTermReq was sent.
    #[error("protocol error (FES {:#x}, FEI {})", .0.fes, .0.fei)]
    Protocol(Fatal),
    /// The host sent H2CTermReq.
    #[error("the host terminated the connection (FES {0:#x})")]
    HostTerminated(u16),
    /// No ICReq in time.
    #[error("no ICReq within {0:?}")]
    NoIcReq(Duration),
}

/// What the reader hands the writer.
enum Out {
    /// Bytes ready to send (ICResp, R2T, C2HTermReq).
    Raw(Bytes),
    /// A command's completion.
    Done { cid: u16, c: Completion },
}

/// A write waiting for its H2CData.
struct PendingWrite {
    cid: u16,
    sqe: Sqe,
    buf: BytesMut,
    want: usize,
    digest_failed: bool,
}

/// Serve one connection (one queue).
pub async fn connection(stream: TcpStream, target: Arc<Target>) -> Result<(), ConnError> {
    let _ = stream.set_nodelay(true);
    let local = stream.local_addr().ok();
    let (rd, mut wr) = stream.into_split();
    let mut rd = BufReader::with_capacity(64 << 10, rd);

    // §3.3: ICReq first.
    let mut ic = [0u8; pdu::IC_LEN];
    tokio::time::timeout(IC_TIMEOUT, rd.read_exact(&mut ic))
        .await
        .map_err(|_| ConnError::NoIcReq(IC_TIMEOUT))??;
    let req = match pdu::IcReq::parse(&ic) {
        Ok(r) => r,
        Err(f) => {
            target.stats.protocol_errors.fetch_add(1, Relaxed);
            wr.write_all(&pdu::c2h_term_req(f, &ic[..8])).await?;
            return Err(ConnError::Protocol(f));
        }
    };
    let d = req.digests();
    if d.header {
        target.stats.header_digest_connections.fetch_add(1, Relaxed);
    }
    if d.data {
        target.stats.data_digest_connections.fetch_add(1, Relaxed);
    }
    if req.hpda != 0 {
        // Our C2HData puts data right after the header (as the Linux host
        // expects); a host that wants it aligned elsewhere is not served.
        target.stats.protocol_errors.fetch_add(1, Relaxed);
        let f = Fatal {
            fes: fes::UNSUPPORTED,
            fei: 10,
        };
        wr.write_all(&pdu::c2h_term_req(f, &ic[..8])).await?;
        return Err(ConnError::Protocol(f));
    }
    wr.write_all(&pdu::ic_resp(d, MAX_H2C_DATA)).await?;

    // PDUs are read by their own task: a read cut off half-way would lose
    // the stream's framing, so the loop below only waits on a channel.
    let (pdu_tx, mut pdus) = mpsc::channel(4);
    let reader = tokio::spawn(async move {
        loop {
            let p = read_pdu(&mut rd, d).await;
            let stop = p.is_err();
            if pdu_tx.send(p).await.is_err() || stop {
                return;
            }
        }
    });
    let (tx, rx) = mpsc::unbounded_channel::<Out>();
    let sq = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let writer = tokio::spawn(write_loop(wr, rx, d, sq.clone()));
    let mut q = Queue::new(local);
    let mut queue: Option<Arc<Queue>> = None;
    let mut tasks: JoinSet<()> = JoinSet::new();
    let mut pending: HashMap<u16, PendingWrite> = HashMap::new();
    let mut next_ttag: u16 = 0;
    let result = loop {
        let gone = Queue::controller_gone(queue.as_deref());
        let pdu = tokio::select! {
            p = pdus.recv() => match p {
                Some(p) => p,
                None => break Ok(()),
            },
            _ = gone => break Ok(()),
        };
        let (ch, head, data, data_ok) = match pdu {
            Ok(p) => p,
            Err(ReadError::Io(e)) => break Err(ConnError::Io(e)),
            Err(ReadError::Fatal(f, head)) => {
                target.stats.protocol_errors.fetch_add(1, Relaxed);
                let _ = tx.send(Out::Raw(pdu::c2h_term_req(f, &head)));
                break Err(ConnError::Protocol(f));
            }
        };
        match ch.ptype {
            pdu_type::H2C_TERM_REQ => {
                let fes = u16::from_le_bytes([head[8], head[9]]);
                break Err(ConnError::HostTerminated(fes));
            }
            pdu_type::CAPSULE_CMD => {
                let sqe = Sqe::parse(head[8..8 + SQE_LEN].try_into().expect("64"));
                let cid = sqe.cid;
                if !data_ok {
                    // §3.6.2.3: a data digest error fails the command.
                    let _ = tx.send(Out::Done {
                        cid,
                        c: Completion::error(Status::DATA_TRANSFER_ERROR),
                    });
                    continue;
                }
                let Some(qa) = queue.clone() else {
                    // Before Connect only Connect is allowed.
                    let c = if sqe.is_fabrics() && sqe.fctype() == fabrics::CONNECT {
                        let c = target.connect(&mut q, &sqe, &data);
                        if c.status.is_success() {
                            sq.store(u32::from(q.qid) << 16 | (u32::from(q.sqsize) + 1), Relaxed);
                            let connected = std::mem::replace(&mut q, Queue::new(local));
                            queue = Some(Arc::new(connected));
                        }
                        c
                    } else {
                        Completion::error(Status::COMMAND_SEQUENCE_ERROR)
                    };
                    let _ = tx.send(Out::Done { cid, c });
                    continue;
                };
                // The host keeps at most SQSIZE+1 commands outstanding
                // (finished tasks are reaped first: they no longer count).
                while tasks.try_join_next().is_some() {}
                let limit = 2 * (usize::from(qa.sqsize) + 1);
                if tasks.len() + pending.len() >= limit {
                    target.stats.protocol_errors.fetch_add(1, Relaxed);
                    let f = Fatal::status(fes::SEQUENCE_ERROR);
                    let _ = tx.send(Out::Raw(pdu::c2h_term_req(f, &head)));
                    break Err(ConnError::Protocol(f));
                }
                match data_plan(&sqe, data.len()) {
                    Err(status) => {
                        let _ = tx.send(Out::Done {
                            cid,
                            c: Completion::error(status),
                        });
                    }
                    Ok(Plan::Run) => {
                        spawn(&mut tasks, &target, &qa, &tx, sqe, data);
                    }
                    Ok(Plan::AskForData(len)) => {
                        // One R2T for the whole transfer (MAXR2T 0).
                        let ttag = loop {
                            next_ttag = next_ttag.wrapping_add(1);
                            if !pending.contains_key(&next_ttag) {
                                break next_ttag;
                            }
                        };
                        pending.insert(
                            ttag,
                            PendingWrite {
                                cid,
                                sqe,
                                buf: BytesMut::with_capacity(len),
                                want: len,
                                digest_failed: false,
                            },
                        );
                        let mut b = BytesMut::new();
                        pdu::r2t(&mut b, cid, ttag, 0, len as u32, d);
                        let _ = tx.send(Out::Raw(b.freeze()));
                    }
                }
            }
            pdu_type::H2C_DATA => {
                let h = H2CData::parse(&head[8..24]);
                let bad = |fei: u32| Fatal::field(fei);
                let fatal = match pending.get_mut(&h.ttag) {
                    None => Some(bad(10)),
                    Some(p) if p.cid != h.cccid => Some(bad(8)),
                    Some(p) if h.datao as usize != p.buf.len() => Some(Fatal {
                        fes: fes::OUT_OF_RANGE,
                        fei: 12,
                    }),
                    Some(p)
                        if h.datal as usize != data.len() || p.buf.len() + data.len() > p.want =>
                    {
                        Some(Fatal {
                            fes: fes::OUT_OF_RANGE,
                            fei: 16,
                        })
                    }
                    Some(p) => {
                        p.buf.extend_from_slice(&data);
                        p.digest_failed |= !data_ok;
                        None
                    }
                };
                if let Some(f) = fatal {
                    target.stats.protocol_errors.fetch_add(1, Relaxed);
                    let _ = tx.send(Out::Raw(pdu::c2h_term_req(f, &head)));
                    break Err(ConnError::Protocol(f));
                }
                let done = pending.get(&h.ttag).is_some_and(|p| p.buf.len() == p.want);
                if done {
                    let p = pending.remove(&h.ttag).expect("present");
                    if p.digest_failed {
                        let _ = tx.send(Out::Done {
                            cid: p.cid,
                            c: Completion::error(Status::DATA_TRANSFER_ERROR),
                        });
                    } else if let Some(qa) = &queue {
                        spawn(&mut tasks, &target, qa, &tx, p.sqe, p.buf.freeze());
                    }
                }
            }
            _ => unreachable!("check_h2c_header admits only host PDU types"),
        }
    };
    // The queue ends: its commands are dropped with it.
    reader.abort();
    tasks.abort_all();
    if let Some(qa) = &queue {
        target.queue_closed(qa);
    } else {
        target.queue_closed(&q);
    }
    drop(tx);
    let _ = writer.await;
    result
}

/// How a command's data arrives.
enum Plan {
    /// Everything is here: run it.
    Run,
    /// Ask for this many bytes with an R2T first.
    AskForData(usize),
}

/// Check SGL1 against the capsule (NVMe/TCP §3.3.2, NVMe Base §4.4) and
/// decide how the data comes.
fn data_plan(sqe: &Sqe, in_capsule: usize) -> Result<Plan, Status> {
    let len = sqe.sgl.len as usize;
    match sqe.sgl.id {
        sgl::DATA_BLOCK_OFFSET => {
            if sqe.direction() != Direction::HostToController {
                return Err(Status::SGL_TYPE_INVALID);
            }
            if sqe.sgl.addr != 0 {
                return Err(Status::SGL_OFFSET_INVALID);
            }
            if len != in_capsule {
                return Err(Status::SGL_LENGTH_INVALID);
            }
            Ok(Plan::Run)
        }
        sgl::TRANSPORT_DATA_BLOCK => {
            if in_capsule != 0 {
                return Err(Status::SGL_OFFSET_INVALID);
            }
            if len as u64 > u64::from(MAX_TRANSFER) {
                return Err(Status::INVALID_FIELD);
            }
            if sqe.direction() == Direction::HostToController && len > 0 {
                Ok(Plan::AskForData(len))
            } else {
                Ok(Plan::Run)
            }
        }
        _ => Err(Status::SGL_TYPE_INVALID),
    }
}

fn spawn(
    tasks: &mut JoinSet<()>,
    target: &Arc<Target>,
    q: &Arc<Queue>,
    tx: &mpsc::UnboundedSender<Out>,
    sqe: Sqe,
    data: Bytes,
) {
    let (t, q, tx) = (target.clone(), q.clone(), tx.clone());
    tasks.spawn(async move {
        t.stats.inflight.fetch_add(1, Relaxed);
        let c = t.execute(&q, &sqe, data).await;
        t.stats.inflight.fetch_sub(1, Relaxed);
        let _ = tx.send(Out::Done { cid: sqe.cid, c });
    });
}

enum ReadError {
    Io(std::io::Error),
    /// A protocol error, with the offending header bytes.
    Fatal(Fatal, Vec<u8>),
}

impl From<std::io::Error> for ReadError {
    fn from(e: std::io::Error) -> Self {
        ReadError::Io(e)
    }
}

/// Read one host PDU: its header (checked, digest verified) and its data
/// (with whether the data digest matched).
async fn read_pdu(
    rd: &mut BufReader<OwnedReadHalf>,
    d: Digests,
) -> Result<(CommonHeader, Vec<u8>, Bytes, bool), ReadError> {
    let mut chb = [0u8; pdu::CH_LEN];
    rd.read_exact(&mut chb).await?;
    let ch = CommonHeader::parse(&chb);
    let max_data = match ch.ptype {
        pdu_type::CAPSULE_CMD => MAX_IN_CAPSULE,
        _ => MAX_H2C_DATA,
    };
    let l = pdu::h2c_layout(&ch, d, max_data).map_err(|f| ReadError::Fatal(f, chb.to_vec()))?;
    let mut head = vec![0u8; pdu::CH_LEN + l.rest_of_header];
    head[..8].copy_from_slice(&chb);
    rd.read_exact(&mut head[8..]).await?;
    let hl = ch.hlen as usize;
    if l.header_digest {
        let got = u32::from_le_bytes(head[hl..hl + 4].try_into().expect("4"));
        if got != pdu::digest(&head[..hl]) {
            head.truncate(hl);
            return Err(ReadError::Fatal(Fatal::status(fes::HEADER_DIGEST), head));
        }
    }
    head.truncate(hl);
    if l.trailer > 0 {
        // A TermReq's copy of our header: read and dropped.
        let mut rest = vec![0u8; l.trailer];
        rd.read_exact(&mut rest).await?;
    }
    if l.pad > 0 {
        let mut p = vec![0u8; l.pad];
        rd.read_exact(&mut p).await?;
    }
    let mut data = BytesMut::zeroed(l.data);
    rd.read_exact(&mut data).await?;
    let mut ok = true;
    if l.data_digest {
        let mut g = [0u8; 4];
        rd.read_exact(&mut g).await?;
        ok = u32::from_le_bytes(g) == pdu::digest(&data);
    }
    Ok((ch, head, data.freeze(), ok))
}

/// Send what the reader and the command tasks produce, in order; flush
/// when nothing else is waiting, so small responses share a write.
async fn write_loop(
    wr: tokio::net::tcp::OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Out>,
    d: Digests,
    sq_entries: Arc<std::sync::atomic::AtomicU32>,
) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(64 << 10, wr);
    let mut sqhd: u32 = 0;
    let mut head = BytesMut::with_capacity(64);
    while let Some(first) = rx.recv().await {
        let mut next = Some(first);
        while let Some(o) = next.take() {
            match o {
                Out::Raw(b) => w.write_all(&b).await?,
                Out::Done { cid, c } => {
                    head.clear();
                    if c.status.is_success() && !c.data.is_empty() {
                        pdu::c2h_data_header(&mut head, cid, 0, c.data.len() as u32, true, d);
                        w.write_all(&head).await?;
                        w.write_all(&c.data).await?;
                        if d.data {
                            w.write_all(&pdu::digest(&c.data).to_le_bytes()).await?;
                        }
                        head.clear();
                    }
                    // SQ flow control: the head moves one entry per command.
                    // (The shared word: queue ID above, SQ entries below.)
                    let ids = sq_entries.load(Relaxed);
                    let (qid, n) = ((ids >> 16) as u16, (ids & 0xFFFF).max(1));
                    sqhd = (sqhd + 1) % n;
                    pdu::capsule_resp(&mut head, &c.cqe(sqhd as u16, qid, cid), d);
                    w.write_all(&head).await?;
                }
            }
            next = rx.try_recv().ok();
        }
        w.flush().await?;
    }
    w.flush().await
}
