//! The raw-TCP baseline: the same request/response shapes as each rdmx
//! operation, over a plain socket with a 8-byte header and nothing else, so
//! `--baseline raw-tcp` shows what rdmx's framing, flow control and
//! bookkeeping cost.
//!
//! Once per connection the server sends a 16-byte nonce and the client
//! answers with `HMAC-SHA256(secret, "rdmx-perf-raw" | nonce)` (zeros without
//! a secret); a server with a secret closes on a wrong proof, so the baseline
//! is no easier to reach than the rdmx port beside it. This costs one round
//! trip at connect, nothing per request.
//!
//! Request: `req_len u32 | resp_len u32 | req_len bytes`; the server answers
//! with `resp_len` bytes (none when `resp_len` is 0). Both lengths are bounded
//! by [`MAX_LEN`] and the server never allocates by them: payloads are read
//! into and answered from fixed buffers.
//!
//! Both ends read as a plain TCP server or client written with care does:
//! into a buffer, as much as the socket holds per receive call (a request's
//! header and payload in one call; every answer that has come in one call),
//! the server writes the small answers to the requests it has read together
//! with one call, and the client writes the requests its window allows (or
//! its stream of one-way messages) with one call. rdmx does all of this
//! (`rdmx perf` corks the operations it replaces together), so a baseline
//! that did not would make rdmx look better than it is.

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// The largest request or answer one baseline request may name (the perf
/// server's region limit, so every rdmx size has its baseline).
pub(crate) const MAX_LEN: usize = 1 << 30;

/// The buffer the server streams payloads through.
const CHUNK: usize = 1 << 20;

const LABEL: &[u8] = b"rdmx-perf-raw";

fn proof(secret: Option<&[u8]>, nonce: &[u8; 16]) -> [u8; 32] {
    match secret {
        None => [0; 32],
        Some(k) => {
            let mut m =
                <Hmac<Sha256> as Mac>::new_from_slice(k).expect("HMAC takes any key length");
            m.update(LABEL);
            m.update(nonce);
            m.finalize().into_bytes().into()
        }
    }
}

/// Serve raw baseline connections until the task is dropped (busy-polling
/// like the client when `busy_poll` is set, so both baselines are in the same
/// polling mode as rdmx). A failed connection never stops the loop.
pub(crate) async fn serve(l: TcpListener, busy_poll: Option<Duration>, secret: Option<Arc<[u8]>>) {
    loop {
        let s = match l.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                tracing::warn!(error = %e, "raw-tcp baseline: accept failed; still accepting");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let _ = s.set_nodelay(true);
        let secret = secret.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_one(s, busy_poll, secret.as_deref()).await {
                if e.kind() != io::ErrorKind::UnexpectedEof {
                    tracing::warn!(error = %e, "raw-tcp baseline: connection closed");
                }
            }
        });
    }
}

async fn serve_one(
    mut s: TcpStream,
    busy: Option<Duration>,
    secret: Option<&[u8]>,
) -> io::Result<()> {
    let nonce: [u8; 16] = rand::random();
    s.write_all(&nonce).await?;
    let mut got = [0u8; 32];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut got))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "no proof within 10 s"))??;
    if let Some(k) = secret {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(k).expect("HMAC takes any key length");
        m.update(LABEL);
        m.update(&nonce);
        if m.verify_slice(&got).is_err() {
            s.write_all(&[1]).await?;
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "client's proof does not match our secret",
            ));
        }
    }
    s.write_all(&[0]).await?;
    let mut inbox = Inbox::new(CHUNK);
    let answer = vec![0x5au8; CHUNK];
    // Small answers to requests that came in together leave together, as a
    // server that serves everything it has read before writing does.
    let mut out: Vec<u8> = Vec::with_capacity(OUT_MAX);
    loop {
        // Answers wait only while the next whole request is already here:
        // before any receive that could wait, what is gathered leaves.
        if !out.is_empty() && !inbox.has_request() {
            write_full(&s, &out).await?;
            out.clear();
        }
        let hdr = inbox.take(&s, 8, busy).await?;
        let req = u32::from_le_bytes(hdr[..4].try_into().expect("4")) as usize;
        let rlen = u32::from_le_bytes(hdr[4..].try_into().expect("4")) as usize;
        if req > MAX_LEN || rlen > MAX_LEN {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("request names {req}/{rlen} bytes, over the {MAX_LEN}-byte limit"),
            ));
        }
        inbox.skip(&s, req, busy).await?;
        if out.len() + rlen <= OUT_MAX {
            out.extend_from_slice(&answer[..rlen]);
            continue;
        }
        write_full(&s, &out).await?;
        out.clear();
        let mut left = rlen;
        while left > 0 {
            let n = left.min(CHUNK);
            write_full(&s, &answer[..n]).await?;
            left -= n;
        }
    }
}

/// Most bytes of small answers the server gathers before writing them.
const OUT_MAX: usize = 64 << 10;

/// The server's receive buffer: each receive call takes as much as the
/// socket holds (a request's header and payload, and any requests behind
/// them, in one call), as a server that reads into a buffer does.
struct Inbox {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

impl Inbox {
    fn new(cap: usize) -> Inbox {
        Inbox {
            buf: vec![0; cap],
            start: 0,
            end: 0,
        }
    }

    /// Bytes received and not yet taken.
    fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Whether a whole request (header and payload) is buffered.
    fn has_request(&self) -> bool {
        let b = &self.buf[self.start..self.end];
        b.len() >= 8 && b.len() - 8 >= u32::from_le_bytes(b[..4].try_into().expect("4")) as usize
    }

    /// Receive more bytes after those buffered (moved to the front first
    /// when the buffer's tail is short).
    async fn fill(&mut self, s: &TcpStream, busy: Option<Duration>) -> io::Result<()> {
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        } else if self.buf.len() - self.end < self.buf.len() / 2 {
            self.buf.copy_within(self.start..self.end, 0);
            (self.start, self.end) = (0, self.end - self.start);
        }
        let end = self.end;
        let n = read_some(s, &mut self.buf[end..], busy).await?;
        self.end += n;
        Ok(())
    }

    /// The next `n` bytes (`n` at most the buffer's size), received as needed.
    async fn take(&mut self, s: &TcpStream, n: usize, busy: Option<Duration>) -> io::Result<&[u8]> {
        while self.buffered() < n {
            self.fill(s, busy).await?;
        }
        self.start += n;
        Ok(&self.buf[self.start - n..self.start])
    }

    /// Pass over the next `n` bytes, received as needed.
    async fn skip(
        &mut self,
        s: &TcpStream,
        mut n: usize,
        busy: Option<Duration>,
    ) -> io::Result<()> {
        loop {
            let k = n.min(self.buffered());
            self.start += k;
            n -= k;
            if n == 0 {
                return Ok(());
            }
            self.fill(s, busy).await?;
        }
    }
}

/// Receive at least one byte into `buf`, spinning up to `busy` before sleeping.
async fn read_some(s: &TcpStream, buf: &mut [u8], busy: Option<Duration>) -> io::Result<usize> {
    let mut spin: Option<Instant> = None;
    loop {
        match s.try_read(buf) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => return Ok(k),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if let Some(budget) = busy {
                    let t = *spin.get_or_insert_with(Instant::now);
                    if t.elapsed() < budget {
                        tokio::task::yield_now().await;
                        continue;
                    }
                }
                s.readable().await?;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Fill `buf` from the socket, spinning up to `busy` before sleeping.
async fn read_full(s: &TcpStream, buf: &mut [u8], busy: Option<Duration>) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        got += read_some(s, &mut buf[got..], busy).await?;
    }
    Ok(())
}

async fn write_full(s: &TcpStream, mut buf: &[u8]) -> io::Result<()> {
    while !buf.is_empty() {
        match s.try_write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => s.writable().await?,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// A raw baseline client connection.
pub(crate) struct RawClient {
    s: TcpStream,
    busy_poll: Option<Duration>,
    req: Vec<u8>,
    resp: Vec<u8>,
}

impl RawClient {
    /// Connect and prove the shared secret (if any).
    pub(crate) async fn connect(
        addr: &str,
        busy_poll: Option<Duration>,
        secret: Option<&[u8]>,
    ) -> io::Result<RawClient> {
        let mut s = TcpStream::connect(addr).await.map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "raw-tcp baseline at {addr}: {e} (a perf server serves it only when started with --raw-baseline)"
                ),
            )
        })?;
        s.set_nodelay(true)?;
        let mut nonce = [0u8; 16];
        s.read_exact(&mut nonce).await?;
        s.write_all(&proof(secret, &nonce)).await?;
        let mut verdict = [0u8; 1];
        s.read_exact(&mut verdict).await?;
        if verdict[0] != 0 {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "raw-tcp baseline at {addr} refused our secret (pass the server's --secret)"
                ),
            ));
        }
        Ok(RawClient {
            s,
            busy_poll,
            req: Vec::new(),
            resp: Vec::new(),
        })
    }

    fn frame(&mut self, req: usize, resp: usize) {
        self.req.clear();
        self.req.extend_from_slice(&(req as u32).to_le_bytes());
        self.req.extend_from_slice(&(resp as u32).to_le_bytes());
        self.req.resize(8 + req, 0xa5);
    }

    /// One request/response round trip.
    pub(crate) async fn round_trip(&mut self, req: usize, resp: usize) -> io::Result<()> {
        self.frame(req, resp);
        write_full(&self.s, &self.req).await?;
        self.resp.resize(resp, 0);
        read_full(&self.s, &mut self.resp, self.busy_poll).await
    }

    /// One-way messages of `req` bytes for `dur`, paced only by TCP's own flow
    /// control, then one round trip that proves every message arrived: the
    /// shape of rdmx's send bandwidth run (messages complete once queued,
    /// credits pace them, a final PING). Returns (messages, elapsed).
    pub(crate) async fn one_way(
        mut self,
        req: usize,
        dur: Duration,
    ) -> io::Result<(u64, Duration)> {
        let mut frame = Vec::with_capacity(8 + req);
        frame.extend_from_slice(&(req as u32).to_le_bytes());
        frame.extend_from_slice(&0u32.to_le_bytes());
        frame.resize(8 + req, 0xa5);
        // Buffered: small messages leave many to a send call, as a program
        // streaming messages over TCP writes them (rdmx coalesces too).
        let mut out = tokio::io::BufWriter::with_capacity(64 << 10, &mut self.s);
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < dur {
            out.write_all(&frame).await?;
            sent += 1;
        }
        out.flush().await?;
        self.round_trip(0, 1).await?;
        Ok((sent, start.elapsed()))
    }

    /// Pipelined transfer for `dur`, `window` requests outstanding; returns
    /// (completed requests, elapsed).
    pub(crate) async fn stream(
        self,
        req: usize,
        resp: usize,
        window: usize,
        dur: Duration,
    ) -> io::Result<(u64, Duration)> {
        let (r, mut w) = self.s.into_split();
        // The server answers every request; a 1-byte answer paces streams of
        // requests whose real answer is empty (writes), like an RDMA ACK.
        let answer = resp.max(1);
        let sem = Arc::new(Semaphore::new(window));
        let reader = {
            let sem = sem.clone();
            // Buffered: one receive call takes every answer that has come.
            let mut r = tokio::io::BufReader::with_capacity(64 << 10, r);
            tokio::spawn(async move {
                let mut buf = vec![0u8; answer];
                let mut n = 0u64;
                loop {
                    if r.read_exact(&mut buf).await.is_err() {
                        return n;
                    }
                    n += 1;
                    sem.add_permits(1);
                }
            })
        };
        let mut frame = Vec::with_capacity(8 + req);
        frame.extend_from_slice(&(req as u32).to_le_bytes());
        frame.extend_from_slice(&(answer as u32).to_le_bytes());
        frame.resize(8 + req, 0xa5);
        // Every request the window allows leaves in one send call (a
        // pipelining client writes what it may send together).
        let mut batch = Vec::with_capacity(frame.len().min(64 << 10));
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < dur {
            sem.acquire().await.expect("open").forget();
            let mut k = 1;
            while batch.len() + 2 * frame.len() <= 64 << 10
                && sem.try_acquire().is_ok_and(|p| {
                    p.forget();
                    true
                })
            {
                k += 1;
                batch.extend_from_slice(&frame);
            }
            if k == 1 {
                w.write_all(&frame).await?;
            } else {
                batch.extend_from_slice(&frame);
                w.write_all(&batch).await?;
                batch.clear();
            }
            sent += k;
        }
        // Wait for every answer.
        let _ = sem.acquire_many(window as u32).await.expect("open");
        let elapsed = start.elapsed();
        drop(w);
        reader.abort();
        Ok((sent, elapsed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn server(secret: Option<&'static [u8]>) -> String {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        tokio::spawn(serve(l, None, secret.map(Arc::from)));
        addr
    }

    #[tokio::test]
    async fn secret_is_required_and_checked() {
        let addr = server(Some(b"s3cret")).await;
        let mut c = RawClient::connect(&addr, None, Some(b"s3cret"))
            .await
            .unwrap();
        c.round_trip(5, 7).await.unwrap();
        assert_eq!(c.resp.len(), 7);
        for wrong in [None, Some(&b"nope"[..])] {
            let e = RawClient::connect(&addr, None, wrong).await.err().unwrap();
            assert!(e.to_string().contains("refused our secret"), "{e}");
        }
    }

    /// A request naming 4 GiB - 1 of answer is refused (the connection is
    /// closed) without the server allocating it; the server keeps serving.
    #[tokio::test]
    async fn oversized_requests_close_that_connection_only() {
        let addr = server(None).await;
        let mut c = RawClient::connect(&addr, None, None).await.unwrap();
        c.frame(0, u32::MAX as usize);
        write_full(&c.s, &c.req).await.unwrap();
        let mut b = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(5), c.s.read(&mut b))
            .await
            .unwrap()
            .unwrap_or(0);
        assert_eq!(n, 0, "the server closes instead of answering");
        let mut c = RawClient::connect(&addr, None, None).await.unwrap();
        c.round_trip(3, 3).await.unwrap();
        let (n, _) = c.one_way(100, Duration::from_millis(20)).await.unwrap();
        assert!(n > 0);
    }

    /// Requests of mixed sizes written together (headers and payloads split
    /// across receive calls, small answers gathered, large ones written from
    /// the answer buffer) get exactly their answers, in order, and no more.
    #[tokio::test]
    async fn pipelined_requests_get_exactly_their_answers() {
        let addr = server(None).await;
        let mut c = RawClient::connect(&addr, None, None).await.unwrap();
        let shape = [
            (5, 3),
            (0, 0),
            (70_000, 1),
            (7, 100_000),
            (0, 65_536),
            (1, 2),
        ];
        let mut all = Vec::new();
        for &(req, resp) in &shape {
            c.frame(req, resp);
            all.extend_from_slice(&c.req);
        }
        write_full(&c.s, &all).await.unwrap();
        let want: usize = shape.iter().map(|&(_, r)| r).sum();
        let mut got = vec![0u8; want];
        read_full(&c.s, &mut got, None).await.unwrap();
        assert!(got.iter().all(|&b| b == 0x5a));
        // Nothing beyond the answers: the next round trip's answer is its own.
        c.round_trip(0, 4).await.unwrap();
        assert_eq!(c.resp, [0x5a; 4]);
        let mut extra = [0u8; 1];
        let more = tokio::time::timeout(Duration::from_millis(50), c.s.read(&mut extra)).await;
        assert!(more.is_err(), "no bytes beyond the answers");
    }

    /// The pipelined client and the one-way stream complete against the
    /// batching server: every request answered (a window of 16 runs dry
    /// otherwise and `stream` never returns), every message counted.
    #[tokio::test]
    async fn batched_streams_complete() {
        let addr = server(None).await;
        for (req, resp) in [(8, 0), (0, 8), (5000, 1), (0, 70_000)] {
            let c = RawClient::connect(&addr, None, None).await.unwrap();
            let run = c.stream(req, resp, 16, Duration::from_millis(30));
            let (n, _) = tokio::time::timeout(Duration::from_secs(10), run)
                .await
                .expect("every answer comes")
                .unwrap();
            assert!(n > 16, "{req}/{resp}: {n} requests");
        }
        let c = RawClient::connect(&addr, None, None).await.unwrap();
        let (n, _) = c.one_way(8, Duration::from_millis(20)).await.unwrap();
        assert!(n > 0);
    }
}
