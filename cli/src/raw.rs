//! The raw-TCP baseline: the same request/response shapes as each rdmx
//! operation, over a plain socket with a 8-byte header and nothing else, so
//! `--baseline raw-tcp` shows what rdmx's framing, flow control and
//! bookkeeping cost.
//!
//! Request: `req_len u32 | resp_len u32 | req_len bytes`; the server answers
//! with `resp_len` bytes (none when `resp_len` is 0).

use std::io;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Serve raw baseline connections forever (busy-polling like the client when
/// `busy_poll` is set, so both baselines are in the same polling mode as rdmx).
pub(crate) async fn serve(l: TcpListener, busy_poll: Option<Duration>) {
    loop {
        let Ok((s, _)) = l.accept().await else {
            continue;
        };
        let _ = s.set_nodelay(true);
        tokio::spawn(async move {
            let _ = serve_one(s, busy_poll).await;
        });
    }
}

async fn serve_one(s: TcpStream, busy: Option<Duration>) -> io::Result<()> {
    let mut hdr = [0u8; 8];
    let mut buf = vec![0u8; 1 << 20];
    let mut resp = Vec::new();
    loop {
        read_full(&s, &mut hdr, busy).await?;
        let req = u32::from_le_bytes(hdr[..4].try_into().expect("4")) as usize;
        let rlen = u32::from_le_bytes(hdr[4..].try_into().expect("4")) as usize;
        let mut left = req;
        while left > 0 {
            let n = left.min(buf.len());
            read_full(&s, &mut buf[..n], busy).await?;
            left -= n;
        }
        if rlen > 0 {
            resp.resize(rlen, 0x5a);
            write_full(&s, &resp).await?;
        }
    }
}

/// Fill `buf` from the socket, spinning up to `busy` before sleeping.
async fn read_full(s: &TcpStream, buf: &mut [u8], busy: Option<Duration>) -> io::Result<()> {
    let mut got = 0;
    let mut spin: Option<Instant> = None;
    while got < buf.len() {
        match s.try_read(&mut buf[got..]) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(k) => {
                got += k;
                spin = None;
            }
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
    pub(crate) async fn connect(addr: &str, busy_poll: Option<Duration>) -> io::Result<RawClient> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
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

    /// Pipelined transfer for `dur`, `window` requests outstanding; returns
    /// (completed requests, elapsed).
    pub(crate) async fn stream(
        self,
        req: usize,
        resp: usize,
        window: usize,
        dur: Duration,
    ) -> io::Result<(u64, Duration)> {
        let (mut r, mut w) = self.s.into_split();
        // The server answers every request; a 1-byte answer paces streams of
        // requests whose real answer is empty (writes), like an RDMA ACK.
        let answer = resp.max(1);
        let sem = Arc::new(Semaphore::new(window));
        let reader = {
            let sem = sem.clone();
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
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < dur {
            sem.acquire().await.expect("open").forget();
            w.write_all(&frame).await?;
            sent += 1;
        }
        // Wait for every answer.
        let _ = sem.acquire_many(window as u32).await.expect("open");
        let elapsed = start.elapsed();
        drop(w);
        reader.abort();
        Ok((sent, elapsed))
    }
}
