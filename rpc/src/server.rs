//! The server side: a [`Service`] of async handler functions, served on any
//! rdmx connection with a per-connection concurrency limit, deadlines,
//! cancellation, rendezvous for large bodies and graceful shutdown.

use std::collections::HashMap;
use std::fmt::Display;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use rdmx_core::{Connection, Listener, MemoryRegion, RemoteRegion};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::{Notify, Semaphore};
use tokio::task::{AbortHandle, JoinSet};
use tracing::{debug, info_span, warn, Instrument};

use crate::error::RpcError;
use crate::outbox::Outbox;
use crate::stats::RpcStats;
use crate::wire::{self, Frame, Kind, Status, FLAG_RENDEZVOUS};

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Handler = Arc<dyn Fn(Bytes) -> BoxFuture<Result<Bytes, RpcError>> + Send + Sync>;

/// A named, versioned set of methods.
#[derive(Clone)]
pub struct Service {
    name: String,
    version: u32,
    methods: HashMap<u32, (String, Handler)>,
}

impl std::fmt::Debug for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&str> = self.methods.values().map(|(n, _)| n.as_str()).collect();
        names.sort_unstable();
        f.debug_struct("Service")
            .field("name", &self.name)
            .field("version", &self.version)
            .field("methods", &names)
            .finish()
    }
}

impl Service {
    /// An empty service `name`, version `version` (clients must match both).
    pub fn new(name: &str, version: u32) -> Service {
        Service {
            name: name.to_string(),
            version,
            methods: HashMap::new(),
        }
    }

    /// Add a typed method: requests and responses are serde types (bincode);
    /// an `Err` from the handler reaches the caller as [`RpcError::App`].
    pub fn method<Req, Resp, E, F, Fut>(mut self, name: &str, f: F) -> Service
    where
        Req: DeserializeOwned + Send + 'static,
        Resp: Serialize + Send + 'static,
        E: Display + Send + 'static,
        F: Fn(Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Resp, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        let h: Handler = Arc::new(move |body: Bytes| {
            let f = f.clone();
            Box::pin(async move {
                let req: Req = bincode::deserialize(&body)
                    .map_err(|e| RpcError::Codec(format!("request: {e}")))?;
                let resp = f(req).await.map_err(|e| RpcError::App(e.to_string()))?;
                bincode::serialize(&resp)
                    .map(Bytes::from)
                    .map_err(|e| RpcError::Codec(format!("response: {e}")))
            })
        });
        self.methods
            .insert(wire::method_id(&self.name, name), (name.to_string(), h));
        self
    }

    /// Add a method on raw payloads: `Bytes` in, `Bytes` out, no encoding.
    pub fn method_bytes<E, F, Fut>(mut self, name: &str, f: F) -> Service
    where
        E: Display + Send + 'static,
        F: Fn(Bytes) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Bytes, E>> + Send + 'static,
    {
        let f = Arc::new(f);
        let h: Handler = Arc::new(move |body: Bytes| {
            let f = f.clone();
            Box::pin(async move { f(body).await.map_err(|e| RpcError::App(e.to_string())) })
        });
        self.methods
            .insert(wire::method_id(&self.name, name), (name.to_string(), h));
        self
    }

    /// The service name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Server limits.
#[derive(Clone, Copy, Debug)]
pub struct ServerOptions {
    /// Calls one connection may have running at once (also the client's credits).
    pub max_in_flight: u32,
    /// Bodies larger than this travel by rendezvous (one-sided read) instead of
    /// inside messages.
    pub rendezvous_threshold: usize,
    /// How long a rendezvous response waits to be pulled before it is dropped.
    pub rendezvous_hold: Duration,
    /// Answers ready at once leave together (one `writev` on TCP); off, each
    /// answer is sent as soon as it is ready (one send each).
    pub coalesce: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_in_flight: 128,
            rendezvous_threshold: 64 << 10,
            rendezvous_hold: Duration::from_secs(30),
            coalesce: true,
        }
    }
}

struct Shared {
    service: Service,
    opts: ServerOptions,
    stopping: AtomicBool,
    stop: Notify,
    stats: Arc<RpcStats>,
}

/// Serves a [`Service`]; clones share the service, limits and shutdown.
#[derive(Clone)]
pub struct Server {
    sh: Arc<Shared>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("service", &self.sh.service)
            .finish()
    }
}

impl Server {
    /// A server for `service`.
    pub fn new(service: Service, opts: ServerOptions) -> Server {
        Server {
            sh: Arc::new(Shared {
                service,
                opts,
                stopping: AtomicBool::new(false),
                stop: Notify::new(),
                stats: Arc::new(RpcStats::default()),
            }),
        }
    }

    /// Calls, errors, bytes and handler latency of everything this server ran.
    pub fn stats(&self) -> Arc<RpcStats> {
        self.sh.stats.clone()
    }

    /// Graceful shutdown: stop accepting connections and calls (clients get
    /// GOAWAY, then `ShuttingDown` for new calls); calls in flight finish.
    /// [`Server::serve`] returns once they have.
    pub fn shutdown(&self) {
        self.sh.stopping.store(true, Ordering::Release);
        self.sh.stop.notify_waiters();
    }

    /// Accept connections from `listener` until [`Server::shutdown`], serving
    /// each; returns when every connection has drained. A connection attempt
    /// that fails its handshake is logged and counted, and accepting goes on.
    pub async fn serve(&self, mut listener: Listener) -> Result<(), RpcError> {
        let mut conns = JoinSet::new();
        loop {
            let stop = self.sh.stop.notified();
            tokio::pin!(stop);
            stop.as_mut().enable();
            if self.sh.stopping.load(Ordering::Acquire) {
                break;
            }
            tokio::select! {
                c = listener.accept() => match c {
                    Ok(conn) => {
                        let s = self.clone();
                        conns.spawn(async move {
                            if let Err(e) = s.serve_connection(conn).await {
                                debug!(error = %e, "rpc connection ended");
                            }
                        });
                    }
                    // The listener is gone: stop. Anything else is one
                    // connection attempt that failed (a port scanner, another
                    // transport, a wrong secret): log, count, keep accepting.
                    Err(e) if e.is_listener_stopped() => return Err(e.into()),
                    Err(e) => {
                        rdmx_core::stats::global().add(|s| &s.accept_errors, 1);
                        warn!(error = %e, "rpc server refused a connection; still accepting");
                    }
                },
                _ = &mut stop => break,
            }
        }
        drop(listener);
        while conns.join_next().await.is_some() {}
        Ok(())
    }

    /// Serve one connection until the peer goes away or the server stops.
    pub async fn serve_connection(&self, conn: Connection) -> Result<(), RpcError> {
        let sh = &self.sh;
        let hello = Frame::decode(conn.recv_message().await?)?;
        if hello.kind != Kind::Hello {
            return Err(RpcError::Protocol("expected HELLO".into()));
        }
        let h = wire::parse_hello(&hello.body)?;
        let refuse = if h.proto != wire::VERSION {
            Some(format!(
                "rpc protocol {} (server speaks {})",
                h.proto,
                wire::VERSION
            ))
        } else if h.service != sh.service.name || h.version != sh.service.version {
            Some(format!(
                "client wants {} v{}, server has {} v{}",
                h.service, h.version, sh.service.name, sh.service.version
            ))
        } else {
            h.methods
                .iter()
                .find(|m| !sh.service.methods.contains_key(m))
                .map(|m| format!("server {} has no method {m:#010x}", sh.service.name))
        };
        let mut ok = Frame::new(Kind::HelloOk, 0, 0);
        if let Some(why) = refuse {
            ok.status = Status::Incompatible;
            ok.body = Bytes::from(why.clone());
            conn.send(ok.encode()).await?;
            return Err(RpcError::Incompatible(why));
        }
        let mut b = BytesMut::new();
        b.put_u32_le(sh.opts.max_in_flight);
        b.put_u64_le(sh.opts.rendezvous_threshold as u64);
        ok.body = b.freeze();
        conn.send(ok.encode()).await?;

        let limit = Arc::new(Semaphore::new(sh.opts.max_in_flight as usize));
        let running: Arc<Mutex<HashMap<u64, AbortHandle>>> = Arc::default();
        let held: Arc<Mutex<HashMap<u64, MemoryRegion>>> = Arc::default();
        let mut tasks = JoinSet::new();
        let mut goaway_sent = false;
        // Answers of calls run inline wait here until no further request is
        // ready, then leave together (see `outbox`).
        let outbox = Outbox::new(conn.clone(), sh.stats.clone());
        outbox.set_coalesce(sh.opts.coalesce);
        let result = loop {
            if sh.stopping.load(Ordering::Acquire) && !goaway_sent {
                goaway_sent = true;
                outbox.push(Frame::new(Kind::GoAway, 0, 0).encode());
                outbox.flush().await?;
            }
            if goaway_sent && running.lock().is_empty() && tasks.is_empty() {
                break Ok(());
            }
            let stop = sh.stop.notified();
            tokio::pin!(stop);
            stop.as_mut().enable();
            let mut recv = conn.recv_message().into_future();
            // Flush queued answers before waiting (or when a batch is full);
            // while requests are ready, keep serving them first.
            if outbox.queued() > 0 && !sh.opts.coalesce {
                outbox.flush().await?;
            }
            let ready = if outbox.queued() > 0 {
                match poll_once(&mut recv).await {
                    Poll::Ready(m) => {
                        if outbox.full() {
                            outbox.flush().await?;
                        }
                        Some(m)
                    }
                    Poll::Pending => {
                        outbox.flush().await?;
                        None
                    }
                }
            } else {
                None
            };
            let msg = match ready {
                Some(m) => m,
                None => tokio::select! {
                    m = &mut recv => m,
                    _ = &mut stop, if !goaway_sent => continue,
                    Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
                },
            };
            let frame = match msg.map_err(RpcError::from).and_then(Frame::decode) {
                Ok(f) => f,
                Err(e) => break Err(e),
            };
            match frame.kind {
                Kind::Request => {
                    let reject = if goaway_sent {
                        Some(Status::ShuttingDown)
                    } else if !sh.service.methods.contains_key(&frame.method) {
                        Some(Status::UnknownMethod)
                    } else {
                        None
                    };
                    let permit = match reject {
                        Some(_) => None,
                        None => limit.clone().try_acquire_owned().ok(),
                    };
                    let Some(permit) = permit else {
                        let mut r = Frame::new(Kind::Response, frame.method, frame.call);
                        r.status = reject.unwrap_or(Status::Overloaded);
                        sh.stats.record_error();
                        outbox.push(r.encode());
                        continue;
                    };
                    let (_, handler) = sh.service.methods[&frame.method].clone();
                    let conn2 = conn.clone();
                    let outbox2 = outbox.clone();
                    let running2 = running.clone();
                    let held2 = held.clone();
                    let opts = sh.opts;
                    let stats = sh.stats.clone();
                    let call = frame.call;
                    let span = info_span!("rpc.serve", method = frame.method, call);
                    let mut call_fut: BoxFuture<()> = Box::pin(
                        async move {
                            let t0 = std::time::Instant::now();
                            let resp = run_call(&conn2, &handler, frame, &held2, opts).await;
                            let others = {
                                let mut r = running2.lock();
                                r.remove(&call);
                                !r.is_empty()
                            };
                            // Free the slot before answering: the client reuses
                            // its credit as soon as the answer arrives.
                            drop(permit);
                            if resp.flags & FLAG_RENDEZVOUS != 0 {
                                // An answer nobody pulls is dropped after a while.
                                let held3 = held2.clone();
                                tokio::spawn(async move {
                                    tokio::time::sleep(opts.rendezvous_hold).await;
                                    held3.lock().remove(&call);
                                });
                            }
                            stats.record(
                                t0.elapsed(),
                                resp.body.len() as u64,
                                resp.status != Status::Ok,
                            );
                            // Inline, this only queues the answer; in a task
                            // of its own, it leaves with others finishing now.
                            let _ = outbox2.send(resp.encode(), others).await;
                        }
                        .instrument(span),
                    );
                    // A short handler runs to its answer right here, without a
                    // task spawn and the wake-up that costs; one that waits is
                    // moved to a task of its own (it can be cancelled there).
                    outbox.set_deferred(sh.opts.coalesce);
                    let done = poll_once(&mut call_fut).await.is_ready();
                    outbox.set_deferred(false);
                    if done {
                        sh.stats.record_inline();
                        continue;
                    }
                    // Lock before spawning, so the task cannot finish and
                    // remove its entry before it is inserted.
                    let mut r = running.lock();
                    let handle = tasks.spawn(call_fut);
                    r.insert(call, handle);
                }
                Kind::Cancel => {
                    if let Some(h) = running.lock().remove(&frame.call) {
                        h.abort();
                    }
                }
                Kind::Release => {
                    held.lock().remove(&frame.call);
                }
                k => {
                    break Err(RpcError::Protocol(format!(
                        "unexpected {k:?} from a client"
                    )))
                }
            }
        };
        tasks.abort_all();
        let _ = outbox.flush().await;
        // A graceful close: answers that were posted but not yet
        // acknowledged (handlers post theirs, see `Outbox::send`) reach the
        // client before the connection ends.
        let _ = conn.close().await;
        result
    }
}

/// Poll `f` once with the caller's context: `Ready` if it finished.
async fn poll_once<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *f).poll(cx))).await
}

/// Run one call: pull a rendezvous body, apply the deadline, encode the answer
/// (large answers by rendezvous).
async fn run_call(
    conn: &Connection,
    handler: &Handler,
    frame: Frame,
    held: &Mutex<HashMap<u64, MemoryRegion>>,
    opts: ServerOptions,
) -> Frame {
    let mut resp = Frame::new(Kind::Response, frame.method, frame.call);
    let deadline = (frame.deadline_ms > 0).then(|| Duration::from_millis(frame.deadline_ms.into()));
    let work = async {
        let body = if frame.flags & FLAG_RENDEZVOUS != 0 {
            let src = RemoteRegion::from_bytes(&frame.body)
                .ok_or_else(|| RpcError::Protocol("bad rendezvous descriptor".into()))?;
            let b = conn.read(src).await?;
            let mut rel = Frame::new(Kind::Release, frame.method, frame.call);
            rel.status = Status::Ok;
            conn.send(rel.encode()).await?;
            b
        } else {
            frame.body.clone()
        };
        handler(body).await
    };
    let out = match deadline {
        Some(d) => tokio::time::timeout(d, work)
            .await
            .unwrap_or(Err(RpcError::DeadlineExceeded)),
        None => work.await,
    };
    match out {
        Ok(body) if body.len() > opts.rendezvous_threshold => {
            // Large answer: lent without a copy; the client pulls it with a
            // one-sided read, then releases it; unpulled ones are dropped after
            // `rendezvous_hold`.
            let mr = conn.domain().register_bytes(body);
            resp.flags = FLAG_RENDEZVOUS;
            resp.body = Bytes::copy_from_slice(&mr.remote().to_bytes());
            held.lock().insert(frame.call, mr);
            resp
        }
        Ok(body) => {
            resp.body = body;
            resp
        }
        Err(e) => {
            resp.status = match e {
                RpcError::DeadlineExceeded => Status::DeadlineExceeded,
                RpcError::Codec(_) => Status::BadRequest,
                _ => Status::AppError,
            };
            resp.body = Bytes::from(match e {
                RpcError::App(m) => m,
                other => other.to_string(),
            });
            resp
        }
    }
}
