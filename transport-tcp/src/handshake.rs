//! Connection handshake: magic, version, limits, and optional mutual
//! challenge–response authentication with a shared secret (HMAC-SHA256; the
//! secret itself never crosses the wire).
//!
//! ```text
//! client -> server  HELLO    magic "RDMX" | version u16 | flags u16 | credits u32 |
//!                            window u64 | max_message u64 | nonce_c [16]        (44 B)
//! server -> client  WELCOME  magic | version u16 | status u16 | flags u16 | pad u16 |
//!                            credits u32 | window u64 | max_message u64 |
//!                            nonce_s [16] | proof_s [32]                        (80 B)
//! client -> server  AUTH     proof_c [32]
//! server -> client  VERDICT  status u16 | pad u16                               (4 B)
//! proof_s = HMAC(secret, "rdmx-server" | nonce_c | nonce_s)
//! proof_c = HMAC(secret, "rdmx-client" | nonce_s | nonce_c)
//! ```
//!
//! A server that refuses (version, authentication) says why in WELCOME or
//! VERDICT and closes; both sides report a clear error.
//!
//! The same handshake opens the TCP transport and the RDMA transport's
//! bootstrap, so HELLO and WELCOME say which one each end speaks (flag
//! `RDMA`). A client that reaches an endpoint of the other kind learns it from
//! WELCOME at once (status `TRANSPORT`) instead of waiting for a message that
//! never comes: an `rdma://` client falls back to TCP (or fails under
//! `require`) in one round trip.

use std::time::Duration;

use bytes::{Buf, BufMut};
use hmac::{Hmac, Mac};
use rdmx_core::{Error, LaneTag, Options, Result};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// Wire magic.
pub const MAGIC: &[u8; 4] = b"RDMX";
/// Protocol version spoken by this build.
pub const VERSION: u16 = 1;

const HELLO_LEN: usize = 44;
const WELCOME_LEN: usize = 80;
const FLAG_AUTH: u16 = 1;
/// The sender speaks the RDMA bootstrap after the handshake (not TCP frames).
const FLAG_RDMA: u16 = 2;
/// HELLO: a lane tag follows the 44 bytes; WELCOME: the server took it.
const FLAG_LANE: u16 = 4;
/// A lane tag after HELLO: group u64 | index u16 | count u16.
const LANE_TAG_LEN: usize = 12;

const ST_OK: u16 = 0;
const ST_VERSION: u16 = 1;
const ST_AUTH: u16 = 2;
const ST_LIMITS: u16 = 3;
const ST_TRANSPORT: u16 = 4;

/// What an endpoint speaks once the handshake is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Speaks {
    /// The TCP transport's frames (`tcp://`).
    Tcp,
    /// The RDMA transport's bootstrap, then RC queue pairs (`rdma://`).
    Rdma,
}

impl Speaks {
    fn flag(self) -> u16 {
        match self {
            Speaks::Tcp => 0,
            Speaks::Rdma => FLAG_RDMA,
        }
    }

    fn of(flags: u16) -> Speaks {
        if flags & FLAG_RDMA != 0 {
            Speaks::Rdma
        } else {
            Speaks::Tcp
        }
    }

    fn scheme(self) -> &'static str {
        match self {
            Speaks::Tcp => "tcp://",
            Speaks::Rdma => "rdma://",
        }
    }
}

/// The error both ends report when they speak different transports.
fn wrong_transport(client: Speaks, server: Speaks, we_are_server: bool) -> Error {
    let text = format!(
        "transport mismatch: the client speaks {} and the server listens with {}",
        client.scheme(),
        server.scheme()
    );
    match (we_are_server, server) {
        // The client asked for RDMA and the server has only TCP: a fallback
        // (under the `prefer` policy) can reach it.
        (false, Speaks::Tcp) => Error::RdmaUnavailable(format!(
            "{text}; connect with tcp:// (the prefer policy does so by itself)"
        )),
        (false, Speaks::Rdma) => Error::Protocol(format!("{text}; connect with rdma://")),
        (true, _) => Error::Protocol(text),
    }
}
/// The limits each end announces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Receive credits (messages).
    pub credits: u32,
    /// Receive window (bytes).
    pub window: u64,
    /// Largest message accepted.
    pub max_message: u64,
}

impl Limits {
    /// Our limits from the connection options (validated).
    pub fn from_options(o: &Options) -> Result<Limits> {
        // Credits are returned once a quarter of the window is consumed, so a
        // message must fit in the remaining three quarters (see conn.rs).
        if o.recv_credits < 4 || o.max_message > o.recv_window / 4 * 3 {
            return Err(Error::InvalidArgument(format!(
                "need recv_credits >= 4 and max_message <= 3/4 of recv_window \
                 (credits {}, max_message {}, window {})",
                o.recv_credits, o.max_message, o.recv_window
            )));
        }
        Ok(Limits {
            credits: o.recv_credits,
            window: o.recv_window,
            max_message: o.max_message,
        })
    }

    /// What a lane other than lane 0 announces: it carries no messages
    /// (they all travel on lane 0), so it needs only the protocol's minimum
    /// of receive buffers (a NIC pins each of them).
    pub const EXTRA_LANE: Limits = Limits {
        credits: 4,
        window: 16 << 10,
        max_message: 4 << 10,
    };

    /// The limits to announce on `lane`: [`Limits::EXTRA_LANE`] for a lane
    /// other than lane 0, else these.
    fn for_lane(self, lane: Option<LaneTag>) -> Limits {
        match lane {
            Some(t) if t.index > 0 => Limits::EXTRA_LANE,
            _ => self,
        }
    }

    fn valid(&self) -> bool {
        self.credits >= 1 && self.window >= self.max_message
    }
}

/// What the handshake established.
#[derive(Clone, Copy, Debug)]
pub struct Agreed {
    /// The peer's limits (what we may send).
    pub peer: Limits,
    /// True if both sides proved the shared secret.
    pub authenticated: bool,
    /// The lane this connection is, if the client asked for lanes and the
    /// server took them (see `rdmx_core::lanes`).
    pub lane: Option<LaneTag>,
    /// Our limits as announced ([`Limits::EXTRA_LANE`] for a lane other
    /// than lane 0, else the ones we were given).
    pub ours: Limits,
}

fn proof(secret: &[u8], label: &[u8], first: &[u8; 16], second: &[u8; 16]) -> [u8; 32] {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(label);
    m.update(first);
    m.update(second);
    m.finalize().into_bytes().into()
}

fn verify(secret: &[u8], label: &[u8], first: &[u8; 16], second: &[u8; 16], got: &[u8]) -> bool {
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC takes any key length");
    m.update(label);
    m.update(first);
    m.update(second);
    m.verify_slice(got).is_ok()
}

fn io_err(stage: &str, e: std::io::Error) -> Error {
    if e.kind() == std::io::ErrorKind::UnexpectedEof {
        Error::Disconnected(format!(
            "peer closed the connection during the handshake ({stage})"
        ))
    } else {
        Error::Disconnected(format!("handshake {stage}: {e}"))
    }
}

fn check_magic(b: &[u8]) -> Result<()> {
    if &b[..4] != MAGIC {
        return Err(Error::Protocol(format!(
            "not an rdmx peer (magic {:02x?})",
            &b[..4]
        )));
    }
    Ok(())
}

/// Client side of the handshake; `lane` is the lane tag to announce, if
/// this connection is one lane of several.
pub async fn client<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    ours: Limits,
    secret: Option<&[u8]>,
    speaks: Speaks,
    lane: Option<LaneTag>,
) -> Result<Agreed> {
    let ours = ours.for_lane(lane);
    let nonce_c: [u8; 16] = rand::random();
    let mut hello = Vec::with_capacity(HELLO_LEN + LANE_TAG_LEN);
    hello.put_slice(MAGIC);
    hello.put_u16_le(VERSION);
    let lane_flag = if lane.is_some() { FLAG_LANE } else { 0 };
    hello.put_u16_le(if secret.is_some() { FLAG_AUTH } else { 0 } | speaks.flag() | lane_flag);
    hello.put_u32_le(ours.credits);
    hello.put_u64_le(ours.window);
    hello.put_u64_le(ours.max_message);
    hello.put_slice(&nonce_c);
    if let Some(t) = lane {
        hello.put_u64_le(t.group);
        hello.put_u16_le(t.index);
        hello.put_u16_le(t.count);
    }
    s.write_all(&hello).await.map_err(|e| io_err("hello", e))?;

    let mut w = [0u8; WELCOME_LEN];
    s.read_exact(&mut w[..8])
        .await
        .map_err(|e| io_err("welcome", e))?;
    check_magic(&w)?;
    let mut r = &w[4..8];
    let version = r.get_u16_le();
    let status = r.get_u16_le();
    if version != VERSION || status == ST_VERSION {
        return Err(Error::VersionMismatch {
            local: VERSION,
            peer: version,
        });
    }
    s.read_exact(&mut w[8..])
        .await
        .map_err(|e| io_err("welcome", e))?;
    let mut r = &w[8..];
    let flags = r.get_u16_le();
    r.advance(2);
    let peer = Limits {
        credits: r.get_u32_le(),
        window: r.get_u64_le(),
        max_message: r.get_u64_le(),
    };
    let nonce_s: [u8; 16] = r[..16].try_into().expect("16");
    let proof_s = &r[16..48];
    match status {
        ST_OK => {}
        ST_TRANSPORT => return Err(wrong_transport(speaks, Speaks::of(flags), false)),
        ST_LIMITS => return Err(Error::Protocol("server refused our limits".into())),
        other => {
            return Err(Error::Protocol(format!(
                "server refused with status {other}"
            )))
        }
    }
    if !peer.valid() {
        return Err(Error::Protocol(format!(
            "server announced invalid limits {peer:?}"
        )));
    }
    let server_auth = flags & FLAG_AUTH != 0;
    let proof_c = match (secret, server_auth) {
        (Some(k), true) => {
            if !verify(k, b"rdmx-server", &nonce_c, &nonce_s, proof_s) {
                return Err(Error::AuthFailed(
                    "server's proof does not match our secret".into(),
                ));
            }
            proof(k, b"rdmx-client", &nonce_s, &nonce_c)
        }
        (Some(_), false) => {
            return Err(Error::AuthFailed(
                "we require authentication but the server has no secret".into(),
            ))
        }
        // The server will refuse us in its verdict; send an empty proof.
        (None, _) => [0u8; 32],
    };
    s.write_all(&proof_c).await.map_err(|e| io_err("auth", e))?;
    let mut v = [0u8; 4];
    s.read_exact(&mut v)
        .await
        .map_err(|e| io_err("verdict", e))?;
    match u16::from_le_bytes([v[0], v[1]]) {
        ST_OK => Ok(Agreed {
            peer,
            authenticated: secret.is_some(),
            // A server that does not take lanes does not echo the flag.
            lane: lane.filter(|_| flags & FLAG_LANE != 0),
            ours,
        }),
        ST_AUTH => Err(Error::AuthFailed(if secret.is_none() {
            "the server requires a shared secret and we have none".into()
        } else {
            "the server rejected our proof (secrets differ)".into()
        })),
        other => Err(Error::Protocol(format!(
            "server refused with status {other}"
        ))),
    }
}

/// Server side of the handshake.
pub async fn server<S: AsyncRead + AsyncWrite + Unpin>(
    s: &mut S,
    ours: Limits,
    secret: Option<&[u8]>,
    speaks: Speaks,
) -> Result<Agreed> {
    let mut h = [0u8; HELLO_LEN];
    s.read_exact(&mut h[..6])
        .await
        .map_err(|e| io_err("hello", e))?;
    check_magic(&h)?;
    let version = u16::from_le_bytes([h[4], h[5]]);
    let nonce_s: [u8; 16] = rand::random();
    let mut welcome = Vec::with_capacity(WELCOME_LEN);
    let send_welcome =
        |status: u16, proof_s: [u8; 32], lane_flag: u16, ours: Limits, welcome: &mut Vec<u8>| {
            welcome.clear();
            welcome.put_slice(MAGIC);
            welcome.put_u16_le(VERSION);
            welcome.put_u16_le(status);
            welcome.put_u16_le(
                if secret.is_some() { FLAG_AUTH } else { 0 } | speaks.flag() | lane_flag,
            );
            welcome.put_u16_le(0);
            welcome.put_u32_le(ours.credits);
            welcome.put_u64_le(ours.window);
            welcome.put_u64_le(ours.max_message);
            welcome.put_slice(&nonce_s);
            welcome.put_slice(&proof_s);
        };
    if version != VERSION {
        send_welcome(ST_VERSION, [0; 32], 0, ours, &mut welcome);
        let _ = s.write_all(&welcome).await;
        let _ = s.shutdown().await;
        return Err(Error::VersionMismatch {
            local: VERSION,
            peer: version,
        });
    }
    s.read_exact(&mut h[6..])
        .await
        .map_err(|e| io_err("hello", e))?;
    let mut r = &h[6..];
    let flags = r.get_u16_le();
    let peer = Limits {
        credits: r.get_u32_le(),
        window: r.get_u64_le(),
        max_message: r.get_u64_le(),
    };
    let nonce_c: [u8; 16] = r[..16].try_into().expect("16");
    let lane = if flags & FLAG_LANE != 0 {
        let mut t = [0u8; LANE_TAG_LEN];
        s.read_exact(&mut t).await.map_err(|e| io_err("hello", e))?;
        let mut r = &t[..];
        Some(LaneTag {
            group: r.get_u64_le(),
            index: r.get_u16_le(),
            count: r.get_u16_le(),
        })
    } else {
        None
    };
    let ours = ours.for_lane(lane);
    if Speaks::of(flags) != speaks {
        send_welcome(ST_TRANSPORT, [0; 32], 0, ours, &mut welcome);
        let _ = s.write_all(&welcome).await;
        let _ = s.shutdown().await;
        return Err(wrong_transport(Speaks::of(flags), speaks, true));
    }
    if !peer.valid() {
        send_welcome(ST_LIMITS, [0; 32], 0, ours, &mut welcome);
        let _ = s.write_all(&welcome).await;
        return Err(Error::Protocol(format!(
            "client announced invalid limits {peer:?}"
        )));
    }
    if let Some(Err(e)) = lane.map(|t| t.validate()) {
        send_welcome(ST_LIMITS, [0; 32], 0, ours, &mut welcome);
        let _ = s.write_all(&welcome).await;
        return Err(e);
    }
    let proof_s = secret.map_or([0; 32], |k| proof(k, b"rdmx-server", &nonce_c, &nonce_s));
    send_welcome(
        ST_OK,
        proof_s,
        if lane.is_some() { FLAG_LANE } else { 0 },
        ours,
        &mut welcome,
    );
    s.write_all(&welcome)
        .await
        .map_err(|e| io_err("welcome", e))?;

    let mut proof_c = [0u8; 32];
    s.read_exact(&mut proof_c)
        .await
        .map_err(|e| io_err("auth", e))?;
    let verdict = match secret {
        None => Ok(()),
        Some(_) if flags & FLAG_AUTH == 0 => Err(Error::AuthFailed(
            "client presented no credentials but a shared secret is required".into(),
        )),
        Some(k) if !verify(k, b"rdmx-client", &nonce_s, &nonce_c, &proof_c) => Err(
            Error::AuthFailed("client's proof does not match our secret".into()),
        ),
        Some(_) => Ok(()),
    };
    let status = if verdict.is_ok() { ST_OK } else { ST_AUTH };
    let mut v = Vec::with_capacity(4);
    v.put_u16_le(status);
    v.put_u16_le(0);
    s.write_all(&v).await.map_err(|e| io_err("verdict", e))?;
    verdict?;
    Ok(Agreed {
        peer,
        authenticated: secret.is_some(),
        lane,
        ours,
    })
}

/// Run `f` with the handshake deadline.
pub(crate) async fn with_deadline<T>(
    d: Duration,
    f: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(d, f)
        .await
        .map_err(|_| Error::TimedOut(d))?
}
