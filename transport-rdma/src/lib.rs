//! # rdmx-transport-rdma
//!
//! rdmx over RDMA verbs: every send, write, read and atomic travels on an RC
//! queue pair; a TCP connection bootstraps it (version, authentication, QPN,
//! PSN, GID, MTU, credits) and stays as a small control channel.
//!
//! - [`verbs`]: the provider trait (PD, MR, CQ with an event fd, RC QP).
//! - [`soft`]: the userspace RoCEv2 provider over UDP port 4791 — it runs on any
//!   host, wire-compatible with NICs.
//! - [`sysfs`]: RDMA devices, ports and GID tables as the kernel lists them,
//!   and the RoCEv2 GID choice for a connection.
//! - [`control`]: the bytes of the TCP side channel after the handshake (the
//!   PARAMS each end sends about its QP, then the control messages).
//! - [`bundle`]: several small messages in one SEND, for a peer that takes them.
//!
//! ```no_run
//! # async fn demo() -> rdmx_core::Result<()> {
//! use rdmx_core::{Options, Transport};
//! let rdma = rdmx_transport_rdma::RdmaTransport::new();
//! let conn = rdma.connect("127.0.0.1:7000", &Options::default()).await?;
//! println!("{}", conn.info().provider); // "soft-roce:4791 (QPN ..., MTU 4096, selective repeat, 128 READs/atomics outstanding)"
//! # Ok(()) }
//! ```

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(unsafe_code)]

pub mod bundle;
mod conn;
pub mod control;
pub mod hw;
mod pending;
pub mod soft;
mod sys;
pub mod sysfs;
pub mod verbs;

use std::sync::Arc;

use rdmx_core::{BoxFuture, Capabilities, Connection, Error, Listener, Options, Result, Transport};
use rdmx_transport_tcp::handshake::{self, Limits};
use tokio::net::{TcpListener, TcpStream};

pub use conn::MAX_RDMA_SIZE;
pub use control::RDMA_VERSION;
pub use soft::{SoftConfig, SoftRoce};
use verbs::{Provider, QpOptions};

/// Which provider an [`RdmaTransport`] uses.
#[derive(Clone)]
enum Choice {
    /// Decided on first use: a NIC if one is usable, else the soft engine.
    Auto,
    /// This one.
    Fixed(Arc<dyn Provider>),
}

/// The rdmx transport over RDMA verbs (URL scheme `rdma://`).
#[derive(Clone)]
pub struct RdmaTransport {
    choice: Choice,
    qp: QpOptions,
}

impl std::fmt::Debug for RdmaTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = match &self.choice {
            Choice::Auto => "auto".to_string(),
            Choice::Fixed(p) => p.device_name(),
        };
        f.debug_struct("RdmaTransport")
            .field("provider", &p)
            .finish()
    }
}

impl Default for RdmaTransport {
    fn default() -> Self {
        RdmaTransport::new()
    }
}

impl RdmaTransport {
    /// RDMA on the best provider available: the process-wide soft RoCE device
    /// (UDP 4791) unless a NIC provider is built in and usable.
    pub fn new() -> RdmaTransport {
        RdmaTransport {
            choice: Choice::Auto,
            qp: QpOptions::default(),
        }
    }

    /// RDMA on a given provider (e.g. a [`SoftRoce`] on another port).
    pub fn with_provider(p: Arc<dyn Provider>) -> RdmaTransport {
        RdmaTransport {
            choice: Choice::Fixed(p),
            qp: QpOptions::default(),
        }
    }

    /// RDMA on a soft RoCE device of its own, configured by `cfg` (another
    /// port, go-back-N only, no ACK hold...).
    pub fn on_soft_device(cfg: SoftConfig) -> Result<RdmaTransport> {
        Ok(RdmaTransport::with_provider(Arc::new(SoftRoce::new(cfg)?)))
    }

    /// Queue pair timers and limits for new connections.
    pub fn qp_options(mut self, qp: QpOptions) -> RdmaTransport {
        self.qp = qp;
        self
    }

    /// The provider new connections use. `Auto` takes a NIC when the `hw`
    /// feature is built in and a device opens (see [`hardware`]), else the
    /// process-wide soft RoCE device. `RDMX_RDMA_PROVIDER=soft|hw` forces one.
    pub fn provider(&self) -> Result<Arc<dyn Provider>> {
        match &self.choice {
            Choice::Fixed(p) => Ok(p.clone()),
            Choice::Auto => {
                let want = std::env::var("RDMX_RDMA_PROVIDER").unwrap_or_default();
                match want.as_str() {
                    "soft" => Ok(SoftRoce::global()? as Arc<dyn Provider>),
                    "hw" => hardware(),
                    "" | "auto" => hardware().or_else(|e| {
                        tracing::debug!(reason = %e, "no NIC provider: using soft RoCE");
                        Ok(SoftRoce::global()? as Arc<dyn Provider>)
                    }),
                    other => Err(Error::InvalidArgument(format!(
                        "RDMX_RDMA_PROVIDER={other}: use soft, hw or auto"
                    ))),
                }
            }
        }
    }
}

/// The process-wide NIC provider (opened once, configured from the
/// environment: `RDMX_RDMA_DEVICE`, `RDMX_HW_*`). Fails with
/// `Error::Unsupported("no RDMA devices …")` on hosts without a NIC or
/// libibverbs, and when built without the `hw` feature.
pub fn hardware() -> Result<Arc<dyn Provider>> {
    #[cfg(feature = "hw")]
    {
        static HW: std::sync::OnceLock<std::result::Result<Arc<hw::HwProvider>, Error>> =
            std::sync::OnceLock::new();
        HW.get_or_init(|| hw::HwProvider::open(hw::HwConfig::from_env()))
            .clone()
            .map(|p| p as Arc<dyn Provider>)
    }
    #[cfg(not(feature = "hw"))]
    {
        Err(Error::Unsupported(
            "no RDMA devices: rdmx was built without the `hw` feature".into(),
        ))
    }
}

async fn establish(
    stream: TcpStream,
    opts: Options,
    provider: Arc<dyn Provider>,
    qp: QpOptions,
    server: bool,
) -> Result<Connection> {
    let _ = stream.set_nodelay(true);
    // The control connection outlives the handshake: keepalive probes on it
    // fail a connection whose peer died silently, which an idle queue pair
    // would never notice (it sends nothing).
    if let Err(e) = rdmx_transport_tcp::detect_silent_peer(&stream) {
        tracing::debug!(error = %e, "TCP keepalive not set on the control connection");
    }
    let mut ours = Limits::from_options(&opts)?;
    // NICs pin one `max_message` buffer per receive credit.
    ours.credits = provider.recv_credits(ours.credits, ours.max_message);
    let mut stream = stream;
    let secret = opts.secret.as_deref();
    let hs = async {
        if server {
            handshake::server(&mut stream, ours, secret, handshake::Speaks::Rdma).await
        } else {
            handshake::client(
                &mut stream,
                ours,
                secret,
                handshake::Speaks::Rdma,
                opts.lane_tag,
            )
            .await
        }
    };
    let agreed = match tokio::time::timeout(opts.connect_timeout, hs).await {
        Ok(Ok(a)) => a,
        Ok(Err(e)) => {
            rdmx_core::stats::global().add(|s| &s.handshake_failures, 1);
            // A client returns the error to its caller; a server logs it
            // (its accept loop goes on).
            if server {
                tracing::warn!(error = %e, "refused a client: handshake failed");
            } else {
                tracing::debug!(error = %e, "handshake failed");
            }
            return Err(e);
        }
        Err(_) => return Err(Error::TimedOut(opts.connect_timeout)),
    };
    let raw = conn::start(conn::Setup {
        stream,
        domain: opts.domain.clone(),
        provider,
        qp_opts: qp,
        agreed,
        max_inflight: opts.max_inflight,
        connect_timeout: opts.connect_timeout,
        busy_poll: opts.busy_poll,
        server,
    })
    .await?;
    Ok(Connection::new(Arc::new(raw), opts.op_timeout))
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn capabilities(&self) -> Capabilities {
        let o = Options::default();
        conn::capabilities(o.max_message, o.max_inflight, o.recv_credits)
    }

    fn available(&self) -> std::result::Result<(), String> {
        match &self.choice {
            // The soft engine needs nothing but a runtime and a UDP port; a
            // failure to get them is reported by connect/listen.
            Choice::Auto => Ok(()),
            Choice::Fixed(_) => Ok(()),
        }
    }

    fn connect(&self, addr: &str, opts: &Options) -> BoxFuture<'static, Result<Connection>> {
        let addr = addr.to_string();
        let opts = opts.clone();
        let this = self.clone();
        Box::pin(async move {
            let provider = this.provider()?;
            let stream = tokio::time::timeout(opts.connect_timeout, TcpStream::connect(&addr))
                .await
                .map_err(|_| Error::TimedOut(opts.connect_timeout))?
                .map_err(|e| Error::Connect(format!("{addr}: {e}")))?;
            establish(stream, opts, provider, this.qp, false).await
        })
    }

    fn listen(&self, addr: &str, opts: &Options) -> BoxFuture<'static, Result<Listener>> {
        let addr = addr.to_string();
        let opts = opts.clone();
        let this = self.clone();
        Box::pin(async move {
            let provider = this.provider()?;
            Limits::from_options(&opts)?;
            let l = TcpListener::bind(&addr)
                .await
                .map_err(|e| Error::Connect(format!("listen on {addr}: {e}")))?;
            let name = provider.device_name();
            let qp = this.qp;
            let listener = rdmx_core::tcp_listener(l, move |stream| {
                establish(stream, opts.clone(), provider.clone(), qp, true)
            })?;
            tracing::info!(local = %listener.local_addr(), provider = %name, "rdma listener ready");
            Ok(listener)
        })
    }
}
