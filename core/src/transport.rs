//! The pluggable transport trait and run-time selection from a URL.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use crate::caps::Capabilities;
use crate::conn::{BoxFuture, Connection, DEFAULT_OP_TIMEOUT};
use crate::error::{Error, Result};
use crate::memory::Domain;
use crate::stats;

/// Which transports a connection may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Policy {
    /// Use RDMA or fail with the reason it cannot be had.
    RequireRdma,
    /// Use RDMA when possible, else fall back to TCP (logged and counted, and
    /// visible through [`Connection::fallback_reason`]).
    #[default]
    PreferRdma,
    /// Use TCP even for `rdma://` URLs.
    TcpOnly,
}

impl FromStr for Policy {
    type Err = Error;
    fn from_str(s: &str) -> Result<Policy> {
        match s {
            "require" | "require-rdma" => Ok(Policy::RequireRdma),
            "prefer" | "prefer-rdma" => Ok(Policy::PreferRdma),
            "tcp" | "tcp-only" => Ok(Policy::TcpOnly),
            _ => Err(Error::InvalidArgument(format!(
                "unknown policy {s:?} (require, prefer, tcp-only)"
            ))),
        }
    }
}

/// Settings for connecting and listening.
#[derive(Clone)]
pub struct Options {
    /// Regions served to the peer (one-sided operations address this domain).
    /// [`Domain::global`] by default; set a [`Domain::new`] to keep a
    /// connection's regions apart from the rest of the process.
    pub domain: Domain,
    /// Default deadline of each operation.
    pub op_timeout: Duration,
    /// Deadline for connecting and for the handshake.
    pub connect_timeout: Duration,
    /// Shared secret for challenge–response authentication; both ends must agree.
    pub secret: Option<Arc<[u8]>>,
    /// Messages the peer may send before we consume them (receive credits).
    pub recv_credits: u32,
    /// Bytes of unconsumed messages the peer may have outstanding.
    pub recv_window: u64,
    /// Largest message accepted.
    pub max_message: u64,
    /// Operations kept in flight per connection before new ones wait.
    pub max_inflight: u32,
    /// Spin this long on an idle socket before sleeping (`None`: never spin).
    /// Lowers latency at the cost of CPU while traffic flows.
    pub busy_poll: Option<Duration>,
    /// Transport policy for [`Transports::connect`].
    pub policy: Policy,
    /// Lanes a connection made by [`Transports::connect`] or
    /// [`crate::lanes::connect`] asks for (several TCP connections or RC
    /// queue pairs carrying one connection's operations; large reads and
    /// writes use them all). 1 is a plain connection.
    pub lanes: u16,
    /// The lane a transport's `connect` announces in its handshake; set by
    /// [`crate::lanes::connect`] for each lane it opens, `None` otherwise.
    pub lane_tag: Option<crate::lanes::LaneTag>,
}

/// The default options serve the process-wide [`Domain::global`], so regions
/// registered through any default `Options` are reachable over every
/// connection made with default options.
impl Default for Options {
    fn default() -> Self {
        Options {
            domain: Domain::global(),
            op_timeout: DEFAULT_OP_TIMEOUT,
            connect_timeout: Duration::from_secs(10),
            secret: None,
            recv_credits: 256,
            recv_window: 64 << 20,
            max_message: 16 << 20,
            max_inflight: 4096,
            busy_poll: None,
            policy: Policy::default(),
            lanes: 1,
            lane_tag: None,
        }
    }
}

impl fmt::Debug for Options {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Options")
            .field("domain", &self.domain)
            .field("op_timeout", &self.op_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("secret", &self.secret.as_ref().map(|_| "<set>"))
            .field("recv_credits", &self.recv_credits)
            .field("recv_window", &self.recv_window)
            .field("max_message", &self.max_message)
            .field("max_inflight", &self.max_inflight)
            .field("busy_poll", &self.busy_poll)
            .field("policy", &self.policy)
            .field("lanes", &self.lanes)
            .finish()
    }
}

impl Options {
    /// Options serving `domain`.
    pub fn with_domain(domain: Domain) -> Options {
        Options {
            domain,
            ..Options::default()
        }
    }

    /// Set the shared secret.
    pub fn secret(mut self, secret: impl AsRef<[u8]>) -> Options {
        self.secret = Some(Arc::from(secret.as_ref()));
        self
    }
}

/// What a transport implements for a listening endpoint.
pub trait RawListener: Send + 'static {
    /// The next connection whose handshake finished. A failed handshake is
    /// returned as an error; the listener stays usable.
    fn accept(&mut self) -> BoxFuture<'_, Result<Connection>>;
    /// The bound address.
    fn local_addr(&self) -> SocketAddr;
}

/// A listening endpoint.
pub struct Listener {
    raw: Box<dyn RawListener>,
    transport: &'static str,
    fallback_reason: Option<String>,
    groups: crate::lanes::LaneGroups,
}

impl fmt::Debug for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Listener")
            .field("local_addr", &self.raw.local_addr())
            .field("transport", &self.transport)
            .field("fallback_reason", &self.fallback_reason)
            .finish()
    }
}

impl Listener {
    /// Wrap a transport's listener.
    pub fn new(raw: Box<dyn RawListener>) -> Listener {
        Listener {
            raw,
            transport: "",
            fallback_reason: None,
            groups: Default::default(),
        }
    }

    /// The transport serving this listener (`"tcp"`, `"rdma"`...; empty for
    /// a listener made with [`Listener::new`] outside [`Transports`]).
    pub fn transport(&self) -> &str {
        self.transport
    }

    /// Why this listener is not serving the transport its URL asked for (an
    /// `rdma://` URL served over TCP under the `prefer` policy), if it is not.
    pub fn fallback_reason(&self) -> Option<&str> {
        self.fallback_reason.as_deref()
    }

    /// Accept connections until the listener stops, running `handler` for
    /// each in its own task. A failed handshake (a port scanner, a client of
    /// another transport, a wrong secret) is logged and counted
    /// ([`crate::stats::global`]`().accept_errors`) and the loop keeps
    /// accepting; so is a handler's error other than a disconnect. This is
    /// the loop every rdmx server should run.
    pub async fn serve<F, Fut>(mut self, name: &'static str, handler: F)
    where
        F: Fn(Connection) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Result<()>> + Send + 'static,
    {
        let handler = Arc::new(handler);
        loop {
            match self.accept().await {
                Ok(conn) => {
                    let handler = handler.clone();
                    let peer = conn.info().peer_addr;
                    tokio::spawn(async move {
                        match handler(conn).await {
                            Ok(()) | Err(Error::Disconnected(_)) => {}
                            Err(e) => {
                                tracing::warn!(server = name, ?peer, error = %e, "connection ended with an error")
                            }
                        }
                    });
                }
                Err(e) if e.is_listener_stopped() => return,
                Err(e) => {
                    stats::global().add(|s| &s.accept_errors, 1);
                    tracing::warn!(server = name, error = %e, "refused a connection; still accepting");
                }
            }
        }
    }

    /// Wait for the next connection. Errors are per connection attempt (for
    /// example a client with the wrong secret); keep calling `accept`.
    /// The lanes of a client that asked for several arrive as one
    /// connection once all of them are there (see [`crate::lanes`]).
    pub async fn accept(&mut self) -> Result<Connection> {
        loop {
            let conn = self.raw.accept().await?;
            let Some(tag) = conn.info().lane else {
                return Ok(conn);
            };
            if let Some(whole) = self.groups.add(conn, tag)? {
                return Ok(whole);
            }
        }
    }

    /// The bound address (useful after binding port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.raw.local_addr()
    }
}

/// A transport: TCP, soft RoCE, or hardware RDMA.
pub trait Transport: Send + Sync + 'static {
    /// Short name, also the URL scheme it serves (`"tcp"`, `"soft-roce"`, `"rdma"`).
    fn name(&self) -> &'static str;
    /// What connections over this transport can do.
    fn capabilities(&self) -> Capabilities;
    /// `Ok` if the transport can run on this host, else why not.
    fn available(&self) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Connect to `addr` (`host:port`).
    fn connect(&self, addr: &str, opts: &Options) -> BoxFuture<'static, Result<Connection>>;
    /// Listen on `addr` (`host:port`, port 0 picks one).
    fn listen(&self, addr: &str, opts: &Options) -> BoxFuture<'static, Result<Listener>>;
}

/// A [`Listener`] over a TCP socket for transports that bootstrap over TCP:
/// each accepted socket is set up by `establish` in its own task (so a slow or
/// hostile client cannot hold up others) and the results are what
/// [`Listener::accept`] returns. Dropping the listener stops accepting.
pub fn tcp_listener<F, Fut>(l: tokio::net::TcpListener, establish: F) -> Result<Listener>
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<Connection>> + Send + 'static,
{
    let local = l
        .local_addr()
        .map_err(|e| Error::Connect(format!("listener address: {e}")))?;
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let task = tokio::spawn(async move {
        loop {
            let stream = match l.accept().await {
                Ok((s, _)) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let tx = tx.clone();
            let setup = establish(stream);
            tokio::spawn(async move {
                let _ = tx.send(setup.await).await;
            });
        }
    });
    Ok(Listener::new(Box::new(TcpAccepts { rx, local, task })))
}

/// What [`Listener::accept`] reports once a listener has stopped for good.
pub(crate) const LISTENER_STOPPED: &str = "listener stopped";

struct TcpAccepts {
    rx: tokio::sync::mpsc::Receiver<Result<Connection>>,
    local: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TcpAccepts {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RawListener for TcpAccepts {
    fn accept(&mut self) -> BoxFuture<'_, Result<Connection>> {
        Box::pin(async move {
            self.rx
                .recv()
                .await
                .unwrap_or_else(|| Err(Error::Disconnected(LISTENER_STOPPED.into())))
        })
    }

    fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

/// A parsed `scheme://host:port` endpoint URL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// `tcp`, `rdma`, `soft-roce`, ...
    pub scheme: String,
    /// `host:port`.
    pub addr: String,
}

impl FromStr for Endpoint {
    type Err = Error;
    fn from_str(url: &str) -> Result<Endpoint> {
        let (scheme, rest) = url.split_once("://").ok_or_else(|| {
            Error::InvalidArgument(format!("{url:?} is not a URL like tcp://host:port"))
        })?;
        let addr = rest.trim_end_matches('/');
        let port_ok = addr
            .rsplit_once(':')
            .is_some_and(|(h, p)| !h.is_empty() && p.parse::<u16>().is_ok());
        if scheme.is_empty() || !port_ok {
            return Err(Error::InvalidArgument(format!(
                "{url:?} is not a URL like tcp://host:port"
            )));
        }
        Ok(Endpoint {
            scheme: scheme.to_ascii_lowercase(),
            addr: addr.to_string(),
        })
    }
}

/// RDMA transports to try, and why the others cannot be used.
type Plan = (Vec<Arc<dyn Transport>>, Vec<String>);

/// The transports a program links in, and the policy-driven choice among them.
#[derive(Clone, Default)]
pub struct Transports {
    list: Vec<Arc<dyn Transport>>,
}

impl fmt::Debug for Transports {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.list.iter().map(|t| t.name()))
            .finish()
    }
}

impl Transports {
    /// No transports yet.
    pub fn new() -> Transports {
        Transports::default()
    }

    /// Add a transport.
    pub fn with(mut self, t: impl Transport) -> Transports {
        self.list.push(Arc::new(t));
        self
    }

    /// The transport named `name`.
    pub fn get(&self, name: &str) -> Option<&Arc<dyn Transport>> {
        self.list.iter().find(|t| t.name() == name)
    }

    fn tcp(&self) -> Result<&Arc<dyn Transport>> {
        self.get("tcp")
            .ok_or_else(|| Error::Unsupported("no tcp transport is linked in".into()))
    }

    /// For a non-`tcp://` URL: the RDMA transports to try, in order, and the
    /// reasons the others cannot be used.
    fn rdma_plan(&self, ep: &Endpoint, policy: Policy) -> Result<Plan> {
        if policy == Policy::TcpOnly {
            return Ok((Vec::new(), vec!["policy is tcp-only".into()]));
        }
        if ep.scheme != "rdma" && self.get(&ep.scheme).is_none() {
            return Err(Error::InvalidArgument(format!(
                "unknown URL scheme {:?}",
                ep.scheme
            )));
        }
        let mut plan = Vec::new();
        let mut reasons = Vec::new();
        let candidates = self
            .list
            .iter()
            .filter(|t| t.capabilities().rdma && (ep.scheme == "rdma" || t.name() == ep.scheme));
        for t in candidates {
            match t.available() {
                Ok(()) => plan.push(t.clone()),
                Err(why) => reasons.push(format!("{}: {why}", t.name())),
            }
        }
        if plan.is_empty() && reasons.is_empty() {
            reasons.push("no RDMA transport is linked in".into());
        }
        Ok((plan, reasons))
    }

    /// Connect to `url` (`tcp://host:port`, `rdma://host:port`, ...) under
    /// `opts.policy`. A fallback to TCP is logged, counted
    /// ([`crate::stats::global`]`().fallbacks`) and reported by
    /// [`Connection::fallback_reason`].
    pub async fn connect(&self, url: &str, opts: &Options) -> Result<Connection> {
        let ep: Endpoint = url.parse()?;
        if ep.scheme == "tcp" {
            require_allows_tcp(opts.policy)?;
            return crate::lanes::connect(self.tcp()?, &ep.addr, opts).await;
        }
        let (plan, mut reasons) = self.rdma_plan(&ep, opts.policy)?;
        for t in plan {
            match crate::lanes::connect(&t, &ep.addr, opts).await {
                Ok(c) => return Ok(c),
                Err(e) => {
                    // The reason travels on: into the fallback reason, or
                    // into the error under `require`; logged once there.
                    tracing::debug!(transport = t.name(), error = %e, "RDMA connect failed");
                    reasons.push(format!("{}: {e}", t.name()));
                }
            }
        }
        let reason = reasons.join("; ");
        if opts.policy == Policy::RequireRdma {
            return Err(Error::RdmaUnavailable(reason));
        }
        let mut conn = crate::lanes::connect(self.tcp()?, &ep.addr, opts).await?;
        tracing::warn!(url, %reason, "falling back to TCP");
        stats::global().add(|s| &s.fallbacks, 1);
        conn.set_fallback_reason(reason);
        Ok(conn)
    }

    /// Listen on `url` under `opts.policy`, with the same fallback rules as
    /// [`Transports::connect`]; a fallback's reason is
    /// [`Listener::fallback_reason`]. An error names the address and says
    /// that listening failed.
    pub async fn listen(&self, url: &str, opts: &Options) -> Result<Listener> {
        let ep: Endpoint = url.parse()?;
        let named = |t: &Arc<dyn Transport>, mut l: Listener, reason: Option<String>| {
            l.transport = t.name();
            l.fallback_reason = reason;
            l
        };
        if ep.scheme == "tcp" {
            require_allows_tcp(opts.policy)?;
            let tcp = self.tcp()?;
            let l = tcp
                .listen(&ep.addr, opts)
                .await
                .map_err(|e| listen_error(url, e))?;
            return Ok(named(tcp, l, None));
        }
        let (plan, mut reasons) = self.rdma_plan(&ep, opts.policy)?;
        for t in plan {
            match t.listen(&ep.addr, opts).await {
                Ok(l) => return Ok(named(&t, l, None)),
                Err(e) => reasons.push(format!("{}: {e}", t.name())),
            }
        }
        let reason = reasons.join("; ");
        if opts.policy == Policy::RequireRdma {
            return Err(Error::RdmaUnavailable(format!("listen on {url}: {reason}")));
        }
        let tcp = self.tcp()?;
        let l = tcp
            .listen(&ep.addr, opts)
            .await
            .map_err(|e| listen_error(url, e))?;
        tracing::warn!(url, %reason, "listening on TCP instead of RDMA");
        stats::global().add(|s| &s.fallbacks, 1);
        Ok(named(tcp, l, Some(reason)))
    }
}

/// A listen failure that names what could not be listened on.
fn listen_error(url: &str, e: Error) -> Error {
    match e {
        Error::Connect(m) if !m.contains("listen") => {
            Error::Connect(format!("listen on {url}: {m}"))
        }
        other => other,
    }
}

fn require_allows_tcp(policy: Policy) -> Result<()> {
    if policy == Policy::RequireRdma {
        return Err(Error::RdmaUnavailable(
            "policy requires RDMA but the URL is tcp://".into(),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_urls() {
        let ep: Endpoint = "rdma://10.0.0.1:7471".parse().unwrap();
        assert_eq!(ep.scheme, "rdma");
        assert_eq!(ep.addr, "10.0.0.1:7471");
        let ep: Endpoint = "TCP://[::1]:80/".parse().unwrap();
        assert_eq!((ep.scheme.as_str(), ep.addr.as_str()), ("tcp", "[::1]:80"));
        for bad in [
            "10.0.0.1:7",
            "tcp://host",
            "tcp://:80",
            "://h:1",
            "tcp://h:99999",
        ] {
            assert!(bad.parse::<Endpoint>().is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_policies() {
        assert_eq!("require".parse::<Policy>().unwrap(), Policy::RequireRdma);
        assert_eq!("prefer".parse::<Policy>().unwrap(), Policy::PreferRdma);
        assert_eq!("tcp-only".parse::<Policy>().unwrap(), Policy::TcpOnly);
        assert!("maybe".parse::<Policy>().is_err());
    }
}
