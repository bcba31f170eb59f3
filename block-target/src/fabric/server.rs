//! The target side of NVMe over rdmx.

use std::future::IntoFuture;
use std::sync::atomic::{AtomicI64, AtomicU32, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use futures_util::stream::{FuturesUnordered, StreamExt};
use futures_util::FutureExt;
use rdmx_core::{Connection, Cork, Error, Listener, RemoteRegion, WriteThenSend};

use crate::nvme::command::{fabrics, sgl, Completion, Direction, Sqe, SQE_LEN};
use crate::nvme::identify::{MAX_IN_CAPSULE, MAX_TRANSFER};
use crate::nvme::status::Status;
use crate::target::{Queue, Target};

/// Serve NVMe over rdmx on `listener` until the process ends; a failed
/// accept (a bad peer's handshake) never stops it.
pub async fn serve(mut listener: Listener, target: Arc<Target>) {
    loop {
        match listener.accept().await {
            Ok(conn) => {
                let t = target.clone();
                tokio::spawn(async move {
                    t.stats.connections.fetch_add(1, Relaxed);
                    t.stats.connections_total.fetch_add(1, Relaxed);
                    let peer = conn.info().peer_addr;
                    let r = queue(conn, t.clone()).await;
                    t.stats.connections.fetch_sub(1, Relaxed);
                    if let Err(e) = r {
                        tracing::info!(peer = ?peer, error = %e, "NVMe over rdmx queue ended");
                    }
                });
            }
            Err(e) => {
                tracing::info!(error = %e, "NVMe over rdmx: accept failed");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }
}

/// Serve one queue (one connection) until the host closes it, breaks the
/// protocol, or its controller goes.
///
/// The queue's task runs its commands itself, many at once (no task per
/// command): a command's completion leaves without a hop between tasks.
/// Capsules that arrive together are answered together: while further
/// capsules are already received, the connection stays corked, and the
/// answers of the whole burst leave in one `writev` (on TCP) before the task
/// waits again. Commands that finish together are answered as one unit:
/// their read data WRITEs, then their responses
/// ([`Connection::write_then_send_many`]; on RDMA, one run of WRITE
/// packets and one bundled SEND).
pub async fn queue(conn: Connection, target: Arc<Target>) -> Result<(), Error> {
    let conn = Arc::new(conn);
    let mut q = Queue::new(None);
    let mut queue: Option<Arc<Queue>> = None;
    let mut inflight = FuturesUnordered::new();
    // Batches of answers being sent (they end when the host acknowledges).
    let mut answering = FuturesUnordered::new();
    let mut finished: Vec<Answer> = Vec::new();
    let sqhd = Arc::new(AtomicU32::new(0));
    let mut cork: Option<Cork<'_>> = None;
    let result = loop {
        // Let every command that can go on run (a write's READ of the host's
        // data gets posted); those that finish are answered at the lull.
        while let Some(Some(a)) = inflight.next().now_or_never() {
            finished.push(a);
        }
        // recv_message is cancel-safe: a message is taken whole or not at all.
        let ready = if finished.len() < ANSWER_BATCH {
            conn.recv_message().into_future().now_or_never()
        } else {
            None
        };
        let msg = match ready {
            Some(m) => m,
            None => {
                // Nothing more has come (or a batch is full): the burst's
                // answers leave now, together.
                let batch = (!finished.is_empty()).then(|| conn.cork());
                if batch.is_some() {
                    let answers = std::mem::take(&mut finished);
                    answering.push(answer(conn.clone(), target.clone(), answers));
                }
                // Posts a new batch (it then waits for its
                // acknowledgements); on TCP its frames leave with the cork.
                while let Some(Some(())) = answering.next().now_or_never() {}
                drop(batch);
                cork = None;
                let gone = Queue::controller_gone(queue.as_deref());
                tokio::select! {
                    biased;
                    Some(a) = inflight.next(), if !inflight.is_empty() => {
                        finished.push(a);
                        continue;
                    }
                    Some(()) = answering.next(), if !answering.is_empty() => continue,
                    m = conn.recv_message() => m,
                    _ = gone => break Ok(()),
                }
            }
        };
        let msg = match msg {
            Ok(m) => m,
            Err(Error::Disconnected(_)) => break Ok(()),
            Err(e) => break Err(e),
        };
        if cork.is_none() && queue.is_some() {
            cork = Some(conn.cork());
        }
        if msg.len() < SQE_LEN || msg.len() > SQE_LEN + MAX_IN_CAPSULE as usize {
            target.stats.protocol_errors.fetch_add(1, Relaxed);
            break Err(Error::Protocol(format!(
                "a {}-byte message is not a command capsule (64 bytes and up to {} of data)",
                msg.len(),
                MAX_IN_CAPSULE
            )));
        }
        let sqe = Sqe::parse(msg[..SQE_LEN].try_into().expect("64"));
        let data = msg.slice(SQE_LEN..);
        let Some(qa) = queue.clone() else {
            let c = if sqe.is_fabrics() && sqe.fctype() == fabrics::CONNECT {
                let c = match in_capsule(&sqe, &data) {
                    Ok(()) => target.connect(&mut q, &sqe, &data),
                    Err(s) => Completion::error(s),
                };
                if c.status.is_success() {
                    let connected = std::mem::replace(&mut q, Queue::new(None));
                    queue = Some(Arc::new(connected));
                }
                c
            } else {
                Completion::error(Status::COMMAND_SEQUENCE_ERROR)
            };
            let entries = queue.as_ref().map_or(1, |q| u32::from(q.sqsize) + 1);
            respond(&conn, &sqhd, entries, q_id(&queue), sqe.cid, &c).await?;
            continue;
        };
        if inflight.len() >= 2 * (usize::from(qa.sqsize) + 1) {
            target.stats.protocol_errors.fetch_add(1, Relaxed);
            break Err(Error::Protocol(format!(
                "more than {} commands outstanding on a queue of {}",
                inflight.len(),
                u32::from(qa.sqsize) + 1
            )));
        }
        let (t, c, h) = (target.clone(), conn.clone(), sqhd.clone());
        inflight.push(async move {
            let busy = Busy::new(&t.stats.inflight);
            let (done, push) = command(&t, &c, &qa, &sqe, data).await;
            drop(busy);
            let entries = u32::from(qa.sqsize) + 1;
            let cqe = response(&h, entries, qa.qid, sqe.cid, &done);
            match push {
                None => Answer::Response(cqe),
                // The read data by one-sided WRITE, the response behind it on
                // the same connection: the host receives the response only
                // after the data is in its memory (NVMe RDMA binding; RC
                // order).
                Some((data, dst)) => Answer::Push(WriteThenSend {
                    dst,
                    data,
                    msg: cqe,
                }),
            }
        });
    };
    // Commands still running are dropped with the queue (the host's
    // connection is gone or broke the protocol).
    drop(cork);
    drop(inflight);
    drop(answering);
    match &queue {
        Some(qa) => target.queue_closed(qa),
        None => target.queue_closed(&q),
    }
    result
}

/// Answers a queue sends as one unit at most (then it takes further
/// capsules).
const ANSWER_BATCH: usize = 64;

/// How a finished command is answered.
enum Answer {
    /// The response capsule alone.
    Response(Bytes),
    /// Read data to WRITE into the host's memory, then the response.
    Push(WriteThenSend),
}

/// Send one batch of answers: the responses in one `send_many`, the pushes
/// in one `write_then_send_many`, both posted at once.
async fn answer(conn: Arc<Connection>, t: Arc<Target>, batch: Vec<Answer>) {
    let mut responses = Vec::new();
    let mut pushes = Vec::new();
    for a in batch {
        match a {
            Answer::Response(cqe) => responses.push(cqe),
            Answer::Push(p) => pushes.push(p),
        }
    }
    let sends = async {
        if responses.is_empty() {
            return;
        }
        if let Err(e) = conn.send_many(responses).await {
            tracing::debug!(error = %e, "response not sent");
        }
    };
    let writes = async {
        if pushes.is_empty() {
            return;
        }
        match conn.write_then_send_many(pushes).await {
            Ok(()) => {}
            Err(e @ Error::RemoteAccess(_)) => {
                // The host named memory it does not lend us. A response may
                // have gone out behind the refused WRITE, so end the queue,
                // as an RDMA queue pair in error would.
                t.stats.protocol_errors.fetch_add(1, Relaxed);
                tracing::info!(error = %e, "WRITE of read data refused; closing the queue");
                let _ = conn.close().await;
            }
            Err(e) => tracing::debug!(error = %e, "read data or response not sent"),
        }
    };
    tokio::join!(sends, writes);
}

/// Counts a command as in flight while it lives (dropped commands too).
struct Busy<'a>(&'a AtomicI64);

impl<'a> Busy<'a> {
    fn new(n: &'a AtomicI64) -> Self {
        n.fetch_add(1, Relaxed);
        Busy(n)
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Relaxed);
    }
}

fn q_id(q: &Option<Arc<Queue>>) -> u16 {
    q.as_ref().map_or(0, |q| q.qid)
}

/// In-capsule data must be what SGL1 describes (an offset-0 Data Block).
fn in_capsule(sqe: &Sqe, data: &Bytes) -> Result<(), Status> {
    if sqe.sgl.id != sgl::DATA_BLOCK_OFFSET {
        return Err(Status::SGL_TYPE_INVALID);
    }
    if sqe.sgl.addr != 0 {
        return Err(Status::SGL_OFFSET_INVALID);
    }
    if sqe.sgl.len as usize != data.len() {
        return Err(Status::SGL_LENGTH_INVALID);
    }
    Ok(())
}

/// Gather a command's data and run it: its completion, and the result data
/// to push into the host's memory (by one-sided WRITE, before the response).
async fn command(
    t: &Target,
    conn: &Connection,
    q: &Queue,
    sqe: &Sqe,
    in_cap: Bytes,
) -> (Completion, Option<(Bytes, RemoteRegion)>) {
    let mut c = gather_and_execute(t, conn, q, sqe, in_cap).await;
    if !c.status.is_success() || c.data.is_empty() {
        return (c, None);
    }
    let Some(remote) = keyed_region(sqe) else {
        return (Completion::error(Status::SGL_TYPE_INVALID), None);
    };
    let n = c.data.len().min(remote.len as usize);
    let out = c.data.slice(..n);
    c.data = Bytes::new();
    (c, Some((out, remote.slice(0, n as u64).expect("in range"))))
}

/// The host's memory a Keyed SGL Data Block descriptor names (NVMe Base
/// specification, SGL descriptors: address, 24-bit length, key), or `None`
/// for another descriptor type.
fn keyed_region(sqe: &Sqe) -> Option<RemoteRegion> {
    matches!(sqe.sgl.id, sgl::KEYED_ADDRESS | sgl::KEYED_INVALIDATE).then_some(RemoteRegion {
        addr: sqe.sgl.addr,
        len: u64::from(sqe.sgl.len),
        rkey: sqe.sgl.key,
    })
}

/// Pull a command's data (in the capsule, or by one-sided READ) and run it.
async fn gather_and_execute(
    t: &Target,
    conn: &Connection,
    q: &Queue,
    sqe: &Sqe,
    in_cap: Bytes,
) -> Completion {
    let remote = keyed_region(sqe);
    let keyed = remote.is_some();
    let fail = Completion::error;
    if sqe.sgl.len > MAX_TRANSFER {
        return fail(Status::INVALID_FIELD);
    }
    let data = match (sqe.direction(), sqe.sgl.id) {
        (_, sgl::DATA_BLOCK_OFFSET) => match in_capsule(sqe, &in_cap) {
            Ok(()) => in_cap,
            Err(s) => return fail(s),
        },
        _ if !in_cap.is_empty() => return fail(Status::SGL_OFFSET_INVALID),
        (Direction::HostToController, _) if remote.is_some_and(|r| r.len > 0) => {
            // Pull the host's data with a one-sided READ.
            match conn.read(remote.expect("keyed")).await {
                Ok(d) => d,
                Err(e) => {
                    tracing::info!(error = %e, cid = sqe.cid, "READ of the host's data failed");
                    return fail(Status::DATA_TRANSFER_ERROR);
                }
            }
        }
        (_, _) if keyed || sqe.sgl.len == 0 => Bytes::new(),
        _ => return fail(Status::SGL_TYPE_INVALID),
    };
    t.execute(q, sqe, data).await
}

/// SEND the response capsule.
async fn respond(
    conn: &Connection,
    sqhd: &AtomicU32,
    entries: u32,
    qid: u16,
    cid: u16,
    c: &Completion,
) -> Result<(), Error> {
    conn.send(response(sqhd, entries, qid, cid, c)).await
}

/// The response capsule: the CQE, SQ head advanced by one.
fn response(sqhd: &AtomicU32, entries: u32, qid: u16, cid: u16, c: &Completion) -> Bytes {
    let head = sqhd.fetch_add(1, Relaxed).wrapping_add(1) % entries.max(1);
    let mut b = BytesMut::with_capacity(16);
    b.put_slice(&c.cqe(head as u16, qid, cid));
    b.freeze()
}
