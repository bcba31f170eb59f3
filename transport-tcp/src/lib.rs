//! # rdmx-transport-tcp
//!
//! rdmx over TCP: the fallback that does everything. Two-sided messages go as
//! frames with credit-based flow control; one-sided reads, writes and atomics are
//! served by the passive side's rdmx runtime against its registered regions, with
//! the same checks an RDMA NIC makes, and no application code on that side.
//!
//! ```no_run
//! # async fn demo() -> rdmx_core::Result<()> {
//! use rdmx_core::{Options, Transport};
//! let tcp = rdmx_transport_tcp::TcpTransport::new();
//! let mut listener = tcp.listen("127.0.0.1:0", &Options::default()).await?;
//! let addr = listener.local_addr().to_string();
//! let client = tcp.connect(&addr, &Options::default()).await?;
//! let server = listener.accept().await?;
//! client.send(&b"ping"[..]).await?;
//! assert_eq!(&server.recv_message().await?[..], b"ping");
//! # Ok(()) }
//! ```
//!
//! Fast paths: `TCP_NODELAY`; a lone request is written directly by the caller;
//! requests made while others are in flight leave together at the end of the
//! scheduler tick, and answers to a burst of buffered requests in one `writev`;
//! payloads are `Bytes` handed to the kernel without copies; a large read
//! answer is received straight into its destination (the read's buffer, or
//! the caller's registered slice for `read_into`); the rest of a
//! large payload is awaited under a receive low-water mark (one wake-up per
//! message, not per segment); optional busy
//! polling ([`rdmx_core::Options::busy_poll`]) for latency-critical users.

#![deny(unsafe_op_in_unsafe_fn)]
#![deny(unsafe_code)]

mod conn;
pub mod frame;
pub mod handshake;
mod lowat;
mod slice_sink;

use std::sync::Arc;
use std::time::Duration;

use rdmx_core::{BoxFuture, Capabilities, Connection, Error, Listener, Options, Result, Transport};
use tokio::net::{TcpListener, TcpStream};

use crate::conn::{Setup, TcpConnection};
use crate::handshake::Limits;

/// The TCP transport.
#[derive(Clone, Debug, Default)]
pub struct TcpTransport {}

impl TcpTransport {
    /// A TCP transport.
    pub fn new() -> TcpTransport {
        TcpTransport {}
    }
}

fn tune(s: &TcpStream) {
    let _ = s.set_nodelay(true);
    let _ = detect_silent_peer(s);
}

/// TCP keepalive on a connection's stream: after [`KEEPALIVE_IDLE`] without
/// traffic the kernel probes the peer every [`KEEPALIVE_INTERVAL`], and
/// [`KEEPALIVE_PROBES`] unanswered probes fail the socket. A peer that died
/// silently (no FIN or RST: power lost, cable pulled, a VM's network gone)
/// then ends every wait on the connection, a `recv` with no deadline
/// included, within 10 + 3 × 2 = 16 s. The RDMA transport sets it on its
/// control connection too: an idle queue pair sends nothing, so it would
/// never notice.
pub fn detect_silent_peer(s: &TcpStream) -> std::io::Result<()> {
    let ka = socket2::TcpKeepalive::new()
        .with_time(KEEPALIVE_IDLE)
        .with_interval(KEEPALIVE_INTERVAL)
        .with_retries(KEEPALIVE_PROBES);
    socket2::SockRef::from(s).set_tcp_keepalive(&ka)
}

/// Idle time before the first keepalive probe ([`detect_silent_peer`]).
pub const KEEPALIVE_IDLE: Duration = Duration::from_secs(10);
/// Time between keepalive probes ([`detect_silent_peer`]).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(2);
/// Unanswered keepalive probes that fail the connection ([`detect_silent_peer`]).
pub const KEEPALIVE_PROBES: u32 = 3;

async fn establish(
    mut stream: TcpStream,
    opts: Options,
    ours: Limits,
    server: bool,
) -> Result<Connection> {
    tune(&stream);
    let secret = opts.secret.as_deref();
    let agreed = handshake::with_deadline(opts.connect_timeout, async {
        if server {
            handshake::server(&mut stream, ours, secret, handshake::Speaks::Tcp).await
        } else {
            handshake::client(
                &mut stream,
                ours,
                secret,
                handshake::Speaks::Tcp,
                opts.lane_tag,
            )
            .await
        }
    })
    .await;
    let agreed = match agreed {
        Ok(a) => a,
        Err(e) => {
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
    };
    let raw = TcpConnection::start(Setup {
        stream,
        domain: opts.domain.clone(),
        agreed,
        max_inflight: opts.max_inflight,
        busy_poll: opts.busy_poll,
    });
    Ok(Connection::new(Arc::new(raw), opts.op_timeout))
}

impl Transport for TcpTransport {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn capabilities(&self) -> Capabilities {
        let o = Options::default();
        conn::capabilities(o.max_message, o.max_inflight, o.recv_credits)
    }

    fn connect(&self, addr: &str, opts: &Options) -> BoxFuture<'static, Result<Connection>> {
        let addr = addr.to_string();
        let opts = opts.clone();
        Box::pin(async move {
            let ours = Limits::from_options(&opts)?;
            let stream = tokio::time::timeout(opts.connect_timeout, TcpStream::connect(&addr))
                .await
                .map_err(|_| Error::TimedOut(opts.connect_timeout))?
                .map_err(|e| Error::Connect(format!("{addr}: {e}")))?;
            establish(stream, opts, ours, false).await
        })
    }

    fn listen(&self, addr: &str, opts: &Options) -> BoxFuture<'static, Result<Listener>> {
        let addr = addr.to_string();
        let opts = opts.clone();
        Box::pin(async move {
            let ours = Limits::from_options(&opts)?;
            let l = TcpListener::bind(&addr)
                .await
                .map_err(|e| Error::Connect(format!("listen on {addr}: {e}")))?;
            let listener = rdmx_core::tcp_listener(l, move |stream| {
                establish(stream, opts.clone(), ours, true)
            })?;
            tracing::info!(local = %listener.local_addr(), "tcp listener ready");
            Ok(listener)
        })
    }
}
