//! [`RdmxStream`]: an rdmx connection as a tokio byte stream.
//!
//! Writes land in a buffer shared with the stream's sender task (one copy:
//! the caller's bytes are borrowed). A flush does not wait for the peer's
//! acknowledgement, as a flush to a TCP socket does not wait for the peer's
//! ACK. A flush that finds the sender idle and at most [`DirectSends`]'
//! bytes buffered posts its send itself (no task hop for a small message,
//! and none when the peer acknowledges it: `Connection::post_send`), up to
//! its count per tick until the stream's task reads again; otherwise the
//! sender lets the scheduler tick finish first, so that everything written
//! in that tick (HTTP/2 flushes after every 16 KiB frame) leaves as one
//! message of up to [`CHUNK`] bytes. Over RDMA only small flushes go
//! directly (each message is a SEND and its ACK, so coalescing pays); over
//! a byte stream (the TCP transport) every flush does, as a flush to a TCP
//! socket does (a message there is a `writev`, and the task hop cost more
//! than the messages coalescing saved).
//! The sender keeps up to [`MAX_SENDS`] messages ([`MAX_SENDING`] bytes) in
//! flight, in order. A writer more than [`MAX_BUFFERED`] bytes ahead waits.
//! A failed send fails the next write or flush.

use std::collections::VecDeque;
use std::future::{poll_fn, Future, IntoFuture};
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use parking_lot::Mutex;
use rdmx_core::{Connection, Error, OpFuture};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Largest message the sender makes; a buffer this full is sent at once.
pub(crate) const CHUNK: usize = 256 << 10;
/// Messages a stream has in flight at most: the writer never waits a round
/// trip per message (on RDMA a send completes when the peer acknowledges it).
pub(crate) const MAX_SENDS: usize = 16;
/// Bytes a stream has in flight at most.
pub(crate) const MAX_SENDING: usize = 4 << 20;
/// Bytes a writer may have buffered ahead of the sender.
pub(crate) const MAX_BUFFERED: usize = 4 << 20;

/// Which flushes post their send themselves (when the sender is idle)
/// instead of handing the bytes to the sender task, which coalesces the
/// rest of the scheduler tick's writes with them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DirectSends {
    /// Most bytes a flush sends itself; more go to the sender.
    pub(crate) max_bytes: usize,
    /// Flushes that send themselves between two reads of the stream's task
    /// (HTTP/2 flushes a frame header and a chained data frame apart);
    /// later ones go to the sender.
    pub(crate) per_tick: usize,
}

impl DirectSends {
    /// Over RDMA a message is a SEND and its ACK: flushes above 8 KiB (HTTP/2
    /// writes a large message as 16 KiB frames, a flush each) are coalesced,
    /// which measured faster than sending each (tonic echo over soft RoCE,
    /// 64 KiB, 64 in flight: 7095 and 6481 calls/s coalesced, 5681 and 5554
    /// direct). Over a byte stream a message is one `writev` that finishes at
    /// once, and the hop to the sender task was the cost: 64 KiB, one in
    /// flight, over the TCP transport 3549 and 3028 calls/s coalesced, 4916
    /// and 4045 direct (fewer thread switches per call: 5.1-5.8 -> 3.0-3.2).
    pub(crate) fn for_connection(conn: &Connection) -> DirectSends {
        if conn.capabilities().rdma {
            DirectSends {
                max_bytes: 8 << 10,
                per_tick: 4,
            }
        } else {
            DirectSends {
                max_bytes: CHUNK,
                per_tick: 16,
            }
        }
    }
}

/// What the writer and the sender task share.
#[derive(Default)]
struct Outgoing {
    buf: BytesMut,
    /// The writer flushed: send `buf` even if it is short.
    flush: bool,
    /// The writer shut down: close after the last byte.
    close: bool,
    /// Why the sender stopped, if a send failed.
    failed: Option<Error>,
    /// The sender task, waiting for bytes.
    sender: Option<Waker>,
    /// The writer, waiting for room.
    writer: Option<Waker>,
    /// The sender is parked with nothing in flight: a flush may send itself
    /// (no task hop for a lone message).
    idle: bool,
    /// The writer is starting a send itself: the sender takes nothing
    /// meanwhile (so the two cannot start sends out of order).
    writer_sending: bool,
    /// Times the sender task was woken (tests count them).
    sender_wakes: u64,
    /// Sends the writer started itself since its task last read or waited
    /// to read (at most [`DirectSends::per_tick`]; further flushes go to the
    /// sender, which coalesces a tick's writes).
    direct_sends: usize,
    /// Sends the writer started that did not finish at once; the sender
    /// drives them from here on.
    adopted: VecDeque<(usize, BoxFuture<rdmx_core::Result<()>>)>,
}

impl Outgoing {
    fn wake_sender(&mut self) {
        if let Some(w) = self.sender.take() {
            self.sender_wakes += 1;
            w.wake();
        }
    }
}

/// An rdmx connection as a byte stream (`AsyncRead + AsyncWrite`); see the
/// module doc for how writes travel.
pub struct RdmxStream {
    conn: Connection,
    /// Unread rest of the last message received.
    pending: Bytes,
    /// The receive in progress: the connection's own future, held here
    /// (no box of ours around it, no clone of the connection per message).
    recv: Option<OpFuture<Bytes>>,
    out: Arc<Mutex<Outgoing>>,
    eof: bool,
    /// Which flushes send themselves.
    direct: DirectSends,
}

impl std::fmt::Debug for RdmxStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RdmxStream")
            .field("transport", &self.conn.transport())
            .finish()
    }
}

fn io_err(e: Error) -> io::Error {
    let kind = match e {
        Error::Disconnected(_) => io::ErrorKind::ConnectionReset,
        Error::TimedOut(_) => io::ErrorKind::TimedOut,
        _ => io::ErrorKind::Other,
    };
    io::Error::new(kind, e)
}

impl RdmxStream {
    /// Wrap `conn` (use one connection per stream). Starts the stream's
    /// sender task on the current tokio runtime.
    pub fn new(conn: Connection) -> RdmxStream {
        let out = Arc::new(Mutex::new(Outgoing::default()));
        tokio::spawn(sender(conn.clone(), out.clone()));
        RdmxStream {
            direct: DirectSends::for_connection(&conn),
            conn,
            pending: Bytes::new(),
            recv: None,
            out,
            eof: false,
        }
    }

    /// The rdmx connection underneath.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// Buffer `bufs`, waiting while the writer is [`MAX_BUFFERED`] ahead.
    fn poll_buffer(
        &mut self,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let mut o = self.out.lock();
        if let Some(e) = o.failed.clone() {
            return Poll::Ready(Err(io_err(e)));
        }
        if o.close {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the stream was shut down",
            )));
        }
        if o.buf.len() >= MAX_BUFFERED {
            o.writer = Some(cx.waker().clone());
            o.wake_sender();
            return Poll::Pending;
        }
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(MAX_BUFFERED - o.buf.len());
            if take == 0 {
                break;
            }
            o.buf.extend_from_slice(&b[..take]);
            n += take;
        }
        if o.buf.len() >= CHUNK {
            o.wake_sender();
        }
        Poll::Ready(Ok(n))
    }
}

/// Take the next message from `out`: a full [`CHUNK`], or (once the
/// scheduler tick that flushed is over) whatever a flush left.
fn take(out: &Mutex<Outgoing>, tick_over: bool) -> Option<Bytes> {
    let mut o = out.lock();
    if o.writer_sending {
        return None;
    }
    let full = o.buf.len() >= CHUNK;
    let flushed = o.flush && tick_over && !o.buf.is_empty();
    if !(full || flushed) {
        return None;
    }
    let n = o.buf.len().min(CHUNK);
    let msg = o.buf.split_to(n).freeze();
    if o.buf.is_empty() {
        o.flush = false;
    }
    if let Some(w) = o.writer.take() {
        w.wake();
    }
    Some(msg)
}

/// Where the sender is in waiting out a flush's scheduler tick.
enum Tick {
    Idle,
    Yielding(BoxFuture<()>),
    Over,
}

/// The stream's sender task (see the module doc); closes the connection
/// gracefully after the last byte if the writer shut down.
async fn sender(conn: Connection, out: Arc<Mutex<Outgoing>>) {
    let mut sends: VecDeque<(usize, BoxFuture<rdmx_core::Result<()>>)> = VecDeque::new();
    let mut sending = 0usize;
    // A flush waits for the end of the scheduler tick it happened in.
    let mut tick = Tick::Idle;
    let res = poll_fn(|cx| loop {
        {
            let mut o = out.lock();
            o.idle = false;
            // Older than anything `take` gives next.
            while let Some((n, f)) = o.adopted.pop_front() {
                sending += n;
                sends.push_back((n, f));
            }
        }
        // Finished sends leave; the first failure ends the task.
        let mut i = 0;
        while i < sends.len() {
            match sends[i].1.as_mut().poll(cx) {
                Poll::Ready(r) => {
                    let (len, _) = sends.remove(i).expect("in range");
                    sending -= len;
                    if let Err(e) = r {
                        return Poll::Ready(Err(e));
                    }
                }
                Poll::Pending => i += 1,
            }
        }
        if sends.len() >= MAX_SENDS || sending >= MAX_SENDING {
            return Poll::Pending;
        }
        if let Tick::Yielding(t) = &mut tick {
            if t.as_mut().poll(cx).is_ready() {
                tick = Tick::Over;
            }
        }
        if let Some(msg) = take(&out, matches!(tick, Tick::Over)) {
            let n = msg.len();
            // Started (and so ordered) before the next one is.
            let mut f: BoxFuture<rdmx_core::Result<()>> = Box::pin(conn.send(msg).into_future());
            match f.as_mut().poll(cx) {
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) => {}
                Poll::Pending => {
                    sends.push_back((n, f));
                    sending += n;
                }
            }
            continue;
        }
        let mut o = out.lock();
        if !o.adopted.is_empty() {
            continue;
        }
        if o.writer_sending {
            // Woken when the writer is done.
            o.sender = Some(cx.waker().clone());
            return Poll::Pending;
        }
        if o.flush && !o.buf.is_empty() {
            // Flushed: send once the rest of this tick has written too.
            match tick {
                // Nothing in flight (nor posted by the writer since its
                // task last read, which a send in flight would have
                // shown): a lone flush goes at once, as a lone call does in
                // rdmx-rpc.
                Tick::Idle if sends.is_empty() && o.direct_sends == 0 => {
                    tick = Tick::Over;
                    drop(o);
                    continue;
                }
                Tick::Idle => {
                    tick = Tick::Yielding(Box::pin(tokio::task::yield_now()));
                    drop(o);
                    continue;
                }
                // Woken when the tick is over.
                Tick::Yielding(_) => return Poll::Pending,
                // Flushed again after the tick that let the last bytes go:
                // nothing to wait for, `take` sends it now.
                Tick::Over => {
                    drop(o);
                    continue;
                }
            }
        }
        tick = Tick::Idle;
        if o.close && o.buf.is_empty() {
            drop(o);
            return if sends.is_empty() {
                Poll::Ready(Ok(true))
            } else {
                Poll::Pending
            };
        }
        o.idle = sends.is_empty();
        o.sender = Some(cx.waker().clone());
        return Poll::Pending;
    })
    .await;
    match res {
        Ok(close) => {
            if close {
                let _ = conn.close().await;
            }
        }
        Err(e) => {
            tracing::debug!(error = %e, "rdmx stream: a send failed");
            let mut o = out.lock();
            o.failed = Some(e);
            if let Some(w) = o.writer.take() {
                w.wake();
            }
        }
    }
}

/// Dropping the stream sends what is buffered and then closes the
/// connection gracefully, as dropping a `TcpStream` does.
impl Drop for RdmxStream {
    fn drop(&mut self) {
        let mut o = self.out.lock();
        o.flush = true;
        o.close = true;
        o.wake_sender();
    }
}

impl AsyncRead for RdmxStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        while this.pending.is_empty() {
            if this.eof {
                return Poll::Ready(Ok(()));
            }
            let conn = &this.conn;
            let fut = this
                .recv
                .get_or_insert_with(|| conn.recv_message().into_future());
            // This task reads (its peer answered) or waits to read: what it
            // wrote before was flushed, so its next flushes may send
            // themselves again.
            this.out.lock().direct_sends = 0;
            match ready!(Pin::new(fut).poll(cx)) {
                Ok(m) => this.pending = m,
                // The peer closed: end of stream.
                Err(Error::Disconnected(_)) => this.eof = true,
                Err(e) => {
                    this.recv = None;
                    return Poll::Ready(Err(io_err(e)));
                }
            }
            this.recv = None;
        }
        let n = this.pending.len().min(buf.remaining());
        buf.put_slice(&this.pending.split_to(n));
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for RdmxStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_buffer(cx, &[io::IoSlice::new(data)])
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        self.poll_buffer(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    /// Asks the sender task to send what is buffered; does not wait for the peer.
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut o = self.out.lock();
        if let Some(e) = o.failed.clone() {
            return Poll::Ready(Err(io_err(e)));
        }
        if o.buf.is_empty() {
            return Poll::Ready(Ok(()));
        }
        o.flush = true;
        if !o.idle
            || o.writer_sending
            || o.close
            || o.buf.len() > self.direct.max_bytes
            || o.direct_sends >= self.direct.per_tick
        {
            o.wake_sender();
            return Poll::Ready(Ok(()));
        }
        // The sender is parked with nothing in flight: start this send here
        // (no task hop); the sender drives it if it does not finish at once.
        o.idle = false;
        o.writer_sending = true;
        o.direct_sends += 1;
        let n = o.buf.len().min(CHUNK);
        let msg = o.buf.split_to(n).freeze();
        if o.buf.is_empty() {
            o.flush = false;
        }
        drop(o);
        // Posted, not awaited until the peer acknowledges it: on RDMA a send
        // completes on the peer's ACK, and that completion woke the sender
        // task twice per message (to adopt the send, then to finish it),
        // two more tasks made ready beside the one reading the answer, which
        // tokio handed to the other worker. The stream's bytes are delivered
        // all the same, or the connection fails.
        let mut f: BoxFuture<rdmx_core::Result<()>> =
            Box::pin(self.conn.post_send(msg).into_future());
        let r = f.as_mut().poll(cx);
        let mut o = self.out.lock();
        o.writer_sending = false;
        let res = match r {
            Poll::Ready(Ok(())) => Ok(()),
            Poll::Ready(Err(e)) => {
                o.failed = Some(e.clone());
                Err(io_err(e))
            }
            Poll::Pending => {
                o.adopted.push_back((n, f));
                Ok(())
            }
        };
        if res.is_ok() && o.adopted.is_empty() && o.buf.is_empty() && !o.close {
            // Done, and nothing is left: the sender, which takes nothing
            // while the writer sends, still has nothing in flight and stays
            // parked, without a wake-up (on a multi-threaded runtime, often
            // a whole thread woken for nothing).
            o.idle = true;
        } else {
            // It adopts the send, sends the rest, or closes.
            o.wake_sender();
        }
        Poll::Ready(res)
    }

    /// Sends what is buffered, then closes the connection gracefully.
    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let mut o = self.out.lock();
        o.flush = true;
        o.close = true;
        o.wake_sender();
        Poll::Ready(Ok(()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmx_core::{Options, Transport};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// Request and response, each small and flushed (a unary gRPC call),
    /// `n` times over `c` and `s`: each flush sends from the writing task and
    /// leaves the sender task asleep (every one of them woke it before: a
    /// thread woken for nothing on a multi-threaded runtime; on RDMA, where
    /// a send completes on the peer's ACK, twice: to adopt the send and to
    /// finish it). Every byte is checked. Returns the sender wake-ups.
    async fn ping_pong_sender_wakes(c: Connection, s: Connection, n: u32) -> u64 {
        let (mut a, mut b) = (RdmxStream::new(c), RdmxStream::new(s));
        let wakes = |x: &RdmxStream| x.out.lock().sender_wakes;
        let (a0, b0) = (wakes(&a), wakes(&b));
        for i in 0..n {
            let mut got = [0u8; 4];
            a.write_all(&i.to_le_bytes()).await.unwrap();
            a.flush().await.unwrap();
            b.read_exact(&mut got).await.unwrap();
            assert_eq!(got, i.to_le_bytes());
            b.write_all(&got).await.unwrap();
            b.flush().await.unwrap();
            a.read_exact(&mut got).await.unwrap();
            assert_eq!(got, i.to_le_bytes());
        }
        let woken = wakes(&a) - a0 + wakes(&b) - b0;
        eprintln!("{} flushes woke the sender tasks {woken} times", 2 * n);
        woken
    }

    async fn pair(t: &dyn Transport, at: &str) -> (Connection, Connection) {
        let mut l = t.listen(at, &Options::default()).await.unwrap();
        let addr = l.local_addr().to_string();
        let (c, s) = tokio::join!(t.connect(&addr, &Options::default()), l.accept());
        (c.unwrap(), s.unwrap())
    }

    /// A soft RoCE transport on an ephemeral UDP port.
    fn soft_roce_transport() -> rdmx_transport_rdma::RdmaTransport {
        let dev = std::sync::Arc::new(
            rdmx_transport_rdma::SoftRoce::new(rdmx_transport_rdma::SoftConfig {
                port: 0,
                ..Default::default()
            })
            .unwrap(),
        );
        rdmx_transport_rdma::RdmaTransport::with_provider(dev)
    }

    /// Fails if the sender tasks were woken more than `limit` times.
    fn assert_sender_mostly_asleep(woken: u64, limit: u32, flushes: u32) {
        assert!(
            woken <= u64::from(limit),
            "{woken} wake-ups for {flushes} flushes"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_leaves_the_sender_asleep() {
        const N: u32 = 200;
        let (c, s) = pair(&rdmx_transport_tcp::TcpTransport::new(), "127.0.0.1:0").await;
        let woken = ping_pong_sender_wakes(c, s, N).await;
        assert_sender_mostly_asleep(woken, N / 5, 2 * N);
    }

    /// The same over soft RoCE: a flush posts its send, so the peer's ACK
    /// wakes no sender task (it woke one twice per flush before).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ping_pong_over_soft_roce_leaves_the_sender_asleep() {
        const N: u32 = 200;
        let t = soft_roce_transport();
        let (c, s) = pair(&t, "127.0.0.1:0").await;
        let woken = ping_pong_sender_wakes(c, s, N).await;
        assert_sender_mostly_asleep(woken, N / 5, 2 * N);
    }

    /// Over the TCP transport, a 64 KiB body written as HTTP/2 writes it
    /// (16 KiB frames, a flush each) leaves from the writing task: the
    /// sender task is not woken for it. Every byte is checked.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_flushes_over_tcp_leave_the_sender_asleep() {
        const N: u32 = 50;
        let (c, s) = pair(&rdmx_transport_tcp::TcpTransport::new(), "127.0.0.1:0").await;
        let (mut a, mut b) = (RdmxStream::new(c), RdmxStream::new(s));
        assert_eq!(a.direct.max_bytes, CHUNK);
        let body: Vec<u8> = (0..64u32 << 10).map(|i| (i * 7 + i / 251) as u8).collect();
        let wakes = |x: &RdmxStream| x.out.lock().sender_wakes;
        let a0 = wakes(&a);
        for _ in 0..N {
            for frame in body.chunks(16 << 10) {
                a.write_all(frame).await.unwrap();
                a.flush().await.unwrap();
            }
            let mut got = vec![0u8; body.len()];
            b.read_exact(&mut got).await.unwrap();
            assert!(got == body, "the body arrived changed");
            // The answer, as a reply's read ends the writer's tick.
            b.write_all(&[1]).await.unwrap();
            b.flush().await.unwrap();
            let mut ack = [0u8; 1];
            a.read_exact(&mut ack).await.unwrap();
        }
        let woken = wakes(&a) - a0;
        assert_sender_mostly_asleep(woken, N / 5, 4 * N);
    }

    /// Over RDMA only flushes of at most 8 KiB send themselves, and the
    /// rest is coalesced by the sender; over a byte stream every flush up to
    /// a whole chunk does.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn direct_sends_follow_the_transport() {
        let (c, _s) = pair(&rdmx_transport_tcp::TcpTransport::new(), "127.0.0.1:0").await;
        assert_eq!(
            DirectSends::for_connection(&c),
            DirectSends {
                max_bytes: CHUNK,
                per_tick: 16
            }
        );
        let t = soft_roce_transport();
        let (c, _s) = pair(&t, "127.0.0.1:0").await;
        assert_eq!(
            DirectSends::for_connection(&c),
            DirectSends {
                max_bytes: 8 << 10,
                per_tick: 4
            }
        );
    }
}
