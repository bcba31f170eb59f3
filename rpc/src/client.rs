//! The client side: typed calls multiplexed over one rdmx connection, bounded
//! by the server's credits, with deadlines, cancel-on-drop, and rendezvous for
//! large bodies; [`Pool`] adds connection reuse and reconnect.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use parking_lot::Mutex;
use rdmx_core::{Connection, MemoryRegion, Options, RemoteRegion, Transports};
use rustc_hash::FxHashMap;
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{oneshot, Semaphore};
use tracing::{info_span, Instrument};

use crate::error::RpcError;
use crate::outbox::Outbox;
use crate::stats::RpcStats;
use crate::wire::{self, Frame, Kind, Status, FLAG_RENDEZVOUS};

struct Inner {
    conn: Connection,
    /// Requests of concurrent calls leave together (see `outbox`).
    outbox: Arc<Outbox>,
    service: String,
    pending: Mutex<FxHashMap<u64, oneshot::Sender<Frame>>>,
    /// Request bodies lent by rendezvous, until the server pulled them.
    lent: Mutex<FxHashMap<u64, MemoryRegion>>,
    next: AtomicU64,
    credits: Arc<Semaphore>,
    threshold: usize,
    goaway: AtomicBool,
    dead: Mutex<Option<RpcError>>,
    stats: Arc<RpcStats>,
}

/// A client of one service over one connection. Cheap to clone; clones share
/// the connection and may call concurrently.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("service", &self.inner.service)
            .field("transport", &self.inner.conn.transport())
            .finish()
    }
}

/// Per-call options.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallOptions {
    /// Give up (and cancel the call on the server) after this long.
    pub deadline: Option<Duration>,
}

impl Client {
    /// Say HELLO for `service` version `version` with the `methods` this client
    /// will call; fails with [`RpcError::Incompatible`] if the server differs.
    pub async fn connect(
        conn: Connection,
        service: &str,
        version: u32,
        methods: &[&str],
    ) -> Result<Client, RpcError> {
        let ids: Vec<u32> = methods
            .iter()
            .map(|m| wire::method_id(service, m))
            .collect();
        let mut hello = Frame::new(Kind::Hello, 0, 0);
        hello.body = wire::hello_body(service, version, &ids);
        conn.send(hello.encode()).await?;
        let ok = Frame::decode(conn.recv_message().await?)?;
        if ok.kind != Kind::HelloOk {
            return Err(RpcError::Protocol("expected HELLO_OK".into()));
        }
        if ok.status != Status::Ok {
            return Err(RpcError::Incompatible(
                String::from_utf8_lossy(&ok.body).into_owned(),
            ));
        }
        if ok.body.len() != 12 {
            return Err(RpcError::Protocol("bad HELLO_OK".into()));
        }
        let mut b = &ok.body[..];
        let credits = b.get_u32_le().max(1);
        let threshold = b.get_u64_le() as usize;
        let stats = Arc::new(RpcStats::default());
        let inner = Arc::new(Inner {
            outbox: Outbox::new(conn.clone(), stats.clone()),
            conn,
            service: service.to_string(),
            pending: Mutex::default(),
            lent: Mutex::default(),
            next: AtomicU64::new(1),
            credits: Arc::new(Semaphore::new(credits as usize)),
            threshold,
            goaway: AtomicBool::new(false),
            dead: Mutex::new(None),
            stats,
        });
        tokio::spawn(reader(Arc::downgrade(&inner), inner.conn.clone()));
        Ok(Client { inner })
    }

    /// Calls, errors, bytes and latency seen by this client.
    pub fn stats(&self) -> Arc<RpcStats> {
        self.inner.stats.clone()
    }

    /// Let requests of concurrent calls leave together (one `writev` on
    /// TCP); on by default. Off, each request is sent at once, one send each.
    pub fn set_coalescing(&self, on: bool) {
        self.inner.outbox.set_coalesce(on);
    }

    /// The connection underneath.
    pub fn connection(&self) -> &Connection {
        &self.inner.conn
    }

    /// False once the connection failed or the server said GOAWAY.
    pub fn is_usable(&self) -> bool {
        self.inner.dead.lock().is_none() && !self.inner.goaway.load(Ordering::Acquire)
    }

    /// Call `method` with a serde request; decode the serde response.
    pub async fn call<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        method: &str,
        req: &Req,
    ) -> Result<Resp, RpcError> {
        self.call_with(method, req, CallOptions::default()).await
    }

    /// [`Client::call`] with options (deadline).
    pub async fn call_with<Req: Serialize, Resp: DeserializeOwned>(
        &self,
        method: &str,
        req: &Req,
        opts: CallOptions,
    ) -> Result<Resp, RpcError> {
        let body = bincode::serialize(req)
            .map(Bytes::from)
            .map_err(|e| RpcError::Codec(format!("request: {e}")))?;
        let resp = self.call_bytes_with(method, body, opts).await?;
        bincode::deserialize(&resp).map_err(|e| RpcError::Codec(format!("response: {e}")))
    }

    /// Call a raw-payload method (`Service::method_bytes`).
    pub async fn call_bytes(&self, method: &str, body: Bytes) -> Result<Bytes, RpcError> {
        self.call_bytes_with(method, body, CallOptions::default())
            .await
    }

    /// [`Client::call_bytes`] with options.
    pub async fn call_bytes_with(
        &self,
        method: &str,
        body: Bytes,
        opts: CallOptions,
    ) -> Result<Bytes, RpcError> {
        let inner = &self.inner;
        let id = wire::method_id(&inner.service, method);
        let span = info_span!("rpc.call", service = %inner.service, method, bytes = body.len());
        let t0 = Instant::now();
        let work = async {
            let res = self.call_inner(id, body, opts).await;
            let n = res.as_ref().map_or(0, |b| b.len() as u64);
            inner.stats.record(t0.elapsed(), n, res.is_err());
            res
        };
        work.instrument(span).await
    }

    async fn call_inner(
        &self,
        method: u32,
        body: Bytes,
        opts: CallOptions,
    ) -> Result<Bytes, RpcError> {
        let inner = &self.inner;
        if let Some(e) = inner.dead.lock().clone() {
            return Err(e);
        }
        if inner.goaway.load(Ordering::Acquire) {
            return Err(RpcError::ShuttingDown);
        }
        let deadline = opts.deadline.map(|d| Instant::now() + d);
        // Credits: at most the server's per-connection limit in flight.
        let permit = match deadline {
            Some(t) => tokio::time::timeout_at(t.into(), inner.credits.clone().acquire_owned())
                .await
                .map_err(|_| RpcError::DeadlineExceeded)?,
            None => inner.credits.clone().acquire_owned().await,
        }
        .map_err(|_| RpcError::Protocol("client closed".into()))?;
        let call = inner.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        // With other calls in flight, this request may leave with theirs.
        let batch = {
            let mut p = inner.pending.lock();
            p.insert(call, tx);
            p.len() > 1
        };
        let mut guard = CancelGuard {
            inner: self.inner.clone(),
            call,
            method,
            armed: true,
        };
        let mut req = Frame::new(Kind::Request, method, call);
        if let Some(t) = deadline {
            let left = t.saturating_duration_since(Instant::now());
            req.deadline_ms = left.as_millis().clamp(1, u128::from(u32::MAX)) as u32;
        }
        if body.len() > inner.threshold {
            // Rendezvous: lend the body (no copy); the server pulls it with a read.
            let mr = inner.conn.domain().register_bytes(body);
            req.flags = FLAG_RENDEZVOUS;
            req.body = Bytes::copy_from_slice(&mr.remote().to_bytes());
            inner.lent.lock().insert(call, mr);
        } else {
            req.body = body;
        }
        inner.outbox.send(req.encode(), batch).await?;
        let resp = match deadline {
            Some(t) => tokio::time::timeout_at(t.into(), rx)
                .await
                .map_err(|_| RpcError::DeadlineExceeded)?,
            None => rx.await,
        };
        let resp = match resp {
            Ok(f) => f,
            Err(_) => {
                guard.armed = false;
                return Err(inner
                    .dead
                    .lock()
                    .clone()
                    .unwrap_or_else(|| RpcError::Protocol("connection closed".into())));
            }
        };
        guard.armed = false;
        drop(permit);
        inner.lent.lock().remove(&call);
        match resp.status {
            Status::Ok if resp.flags & FLAG_RENDEZVOUS != 0 => {
                let src = RemoteRegion::from_bytes(&resp.body)
                    .ok_or_else(|| RpcError::Protocol("bad rendezvous descriptor".into()))?;
                let body = inner.conn.read(src).await?;
                let rel = Frame::new(Kind::Release, method, call);
                inner.conn.post_send(rel.encode()).await?;
                Ok(body)
            }
            Status::Ok => Ok(resp.body),
            Status::AppError => Err(RpcError::App(
                String::from_utf8_lossy(&resp.body).into_owned(),
            )),
            Status::UnknownMethod => Err(RpcError::UnknownMethod(method)),
            Status::DeadlineExceeded => Err(RpcError::DeadlineExceeded),
            Status::Cancelled => Err(RpcError::Cancelled),
            Status::Overloaded => Err(RpcError::Overloaded),
            Status::ShuttingDown => Err(RpcError::ShuttingDown),
            Status::BadRequest => Err(RpcError::Codec(
                String::from_utf8_lossy(&resp.body).into_owned(),
            )),
            Status::Incompatible => Err(RpcError::Incompatible(
                String::from_utf8_lossy(&resp.body).into_owned(),
            )),
        }
    }
}

/// Cancels the call on the server if the caller drops it or its deadline hits.
struct CancelGuard {
    inner: Arc<Inner>,
    call: u64,
    method: u32,
    armed: bool,
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        self.inner.pending.lock().remove(&self.call);
        self.inner.lent.lock().remove(&self.call);
        let outbox = self.inner.outbox.clone();
        let f = Frame::new(Kind::Cancel, self.method, self.call);
        // Queued behind the request if that has not left yet.
        tokio::spawn(async move {
            let _ = outbox.send(f.encode(), true).await;
        });
    }
}

/// Dispatch responses to their callers; fail everyone when the connection ends.
async fn reader(inner: std::sync::Weak<Inner>, conn: Connection) {
    let err = loop {
        let msg = match conn.recv_message().await {
            Ok(m) => m,
            Err(e) => break RpcError::Transport(e),
        };
        let Some(inner) = inner.upgrade() else { return };
        let f = match Frame::decode(msg) {
            Ok(f) => f,
            Err(e) => break e,
        };
        match f.kind {
            Kind::Response => {
                if let Some(tx) = inner.pending.lock().remove(&f.call) {
                    let _ = tx.send(f);
                }
            }
            Kind::Release => {
                inner.lent.lock().remove(&f.call);
            }
            Kind::GoAway => inner.goaway.store(true, Ordering::Release),
            k => break RpcError::Protocol(format!("unexpected {k:?} from the server")),
        }
    };
    if let Some(inner) = inner.upgrade() {
        *inner.dead.lock() = Some(err);
        inner.pending.lock().clear();
        inner.credits.close();
    }
}

/// Clients to one server, created on demand and replaced when they fail
/// (reconnect), handed out round robin.
pub struct Pool {
    transports: Transports,
    url: String,
    opts: Options,
    service: String,
    version: u32,
    methods: Vec<String>,
    clients: tokio::sync::Mutex<Vec<Option<Client>>>,
    next: AtomicU64,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool").field("url", &self.url).finish()
    }
}

impl Pool {
    /// A pool of up to `size` connections to `url` for `service`.
    pub fn new(
        transports: Transports,
        url: &str,
        opts: Options,
        service: &str,
        version: u32,
        methods: &[&str],
        size: usize,
    ) -> Pool {
        Pool {
            transports,
            url: url.to_string(),
            opts,
            service: service.to_string(),
            version,
            methods: methods.iter().map(|m| m.to_string()).collect(),
            clients: tokio::sync::Mutex::new(vec![None; size.max(1)]),
            next: AtomicU64::new(0),
        }
    }

    /// A usable client: the next one round robin, (re)connected if needed.
    pub async fn get(&self) -> Result<Client, RpcError> {
        let mut slots = self.clients.lock().await;
        let i = self.next.fetch_add(1, Ordering::Relaxed) as usize % slots.len();
        if let Some(c) = &slots[i] {
            if c.is_usable() {
                return Ok(c.clone());
            }
        }
        let conn = self.transports.connect(&self.url, &self.opts).await?;
        let methods: Vec<&str> = self.methods.iter().map(String::as_str).collect();
        let c = Client::connect(conn, &self.service, self.version, &methods).await?;
        slots[i] = Some(c.clone());
        Ok(c)
    }
}
