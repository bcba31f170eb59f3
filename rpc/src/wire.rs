//! RPC framing: every rdmx message carries one frame, a 24-byte header and a
//! body.
//!
//! ```text
//! kind u8 | flags u8 | status u16 | method u32 | call u64 | deadline_ms u32 | body_len u32
//! ```
//!
//! All little endian. HELLO/HELLO_OK bodies carry the protocol magic, version,
//! service name and method table, so a client for another service or version
//! gets a clear error at connect.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::RpcError;

/// Header length in bytes.
pub const HEADER_LEN: usize = 24;
/// Protocol magic in HELLO.
pub const MAGIC: &[u8; 4] = b"RRPC";
/// RPC protocol version.
pub const VERSION: u16 = 1;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Client → server: service, version, methods.
    Hello = 1,
    /// Server → client: accepted (limits) or refused (status + reason).
    HelloOk = 2,
    /// A call.
    Request = 3,
    /// Its answer.
    Response = 4,
    /// Client → server: the caller gave up on a call.
    Cancel = 5,
    /// Server → client: shutting down; no new calls, in-flight ones finish.
    GoAway = 6,
    /// Receiver → sender: a rendezvous body was pulled; its region can go.
    Release = 7,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Hello,
            2 => Kind::HelloOk,
            3 => Kind::Request,
            4 => Kind::Response,
            5 => Kind::Cancel,
            6 => Kind::GoAway,
            7 => Kind::Release,
            _ => return None,
        })
    }
}

/// Frame flag: the body is a 20-byte `RemoteRegion` to pull with a one-sided
/// read (rendezvous) instead of the payload itself.
pub const FLAG_RENDEZVOUS: u8 = 1;

/// Outcome carried in a response header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum Status {
    /// Success; the body is the encoded response.
    Ok = 0,
    /// The handler returned an error; the body is its message.
    AppError = 1,
    /// No such method on this service.
    UnknownMethod = 2,
    /// The deadline passed on the server.
    DeadlineExceeded = 3,
    /// Cancelled by the client.
    Cancelled = 4,
    /// The per-connection limit of calls in flight was reached.
    Overloaded = 5,
    /// The server is shutting down and takes no new calls.
    ShuttingDown = 6,
    /// The request body did not decode as the method's request type.
    BadRequest = 7,
    /// HELLO refused: different service, version or methods.
    Incompatible = 8,
}

impl Status {
    fn from_u16(v: u16) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::AppError,
            2 => Status::UnknownMethod,
            3 => Status::DeadlineExceeded,
            4 => Status::Cancelled,
            5 => Status::Overloaded,
            6 => Status::ShuttingDown,
            7 => Status::BadRequest,
            8 => Status::Incompatible,
            _ => return None,
        })
    }
}

/// A decoded frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Frame {
    /// Frame kind.
    pub kind: Kind,
    /// Flags (`FLAG_*`).
    pub flags: u8,
    /// Response status.
    pub status: Status,
    /// Method id (see [`method_id`]).
    pub method: u32,
    /// Call id, chosen by the client, unique per connection.
    pub call: u64,
    /// Remaining deadline in milliseconds (0: none).
    pub deadline_ms: u32,
    /// Body.
    pub body: Bytes,
}

impl Frame {
    /// A frame with an empty body and status OK.
    pub fn new(kind: Kind, method: u32, call: u64) -> Frame {
        Frame {
            kind,
            flags: 0,
            status: Status::Ok,
            method,
            call,
            deadline_ms: 0,
            body: Bytes::new(),
        }
    }

    /// Header and body in one buffer (one rdmx message).
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::with_capacity(HEADER_LEN + self.body.len());
        b.put_u8(self.kind as u8);
        b.put_u8(self.flags);
        b.put_u16_le(self.status as u16);
        b.put_u32_le(self.method);
        b.put_u64_le(self.call);
        b.put_u32_le(self.deadline_ms);
        b.put_u32_le(self.body.len() as u32);
        b.put_slice(&self.body);
        b.freeze()
    }

    /// Parse one message; the body is a zero-copy slice of it.
    pub fn decode(msg: Bytes) -> Result<Frame, RpcError> {
        if msg.len() < HEADER_LEN {
            return Err(RpcError::Protocol(format!(
                "frame of {} bytes is shorter than the {HEADER_LEN}-byte header",
                msg.len()
            )));
        }
        let mut h = &msg[..HEADER_LEN];
        let kind = h.get_u8();
        let kind = Kind::from_u8(kind)
            .ok_or_else(|| RpcError::Protocol(format!("unknown frame kind {kind}")))?;
        let flags = h.get_u8();
        let status = h.get_u16_le();
        let status = Status::from_u16(status)
            .ok_or_else(|| RpcError::Protocol(format!("unknown status {status}")))?;
        let method = h.get_u32_le();
        let call = h.get_u64_le();
        let deadline_ms = h.get_u32_le();
        let len = h.get_u32_le() as usize;
        if len != msg.len() - HEADER_LEN {
            return Err(RpcError::Protocol(format!(
                "frame says {len} body bytes, message has {}",
                msg.len() - HEADER_LEN
            )));
        }
        Ok(Frame {
            kind,
            flags,
            status,
            method,
            call,
            deadline_ms,
            body: msg.slice(HEADER_LEN..),
        })
    }
}

/// The stable id of `service/method`: 32-bit FNV-1a of the full name.
pub fn method_id(service: &str, method: &str) -> u32 {
    let mut h: u32 = 0x811c_9dc5;
    for b in service
        .bytes()
        .chain(std::iter::once(b'/'))
        .chain(method.bytes())
    {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    h
}

/// HELLO body: magic, protocol version, service version, service name, method ids.
pub fn hello_body(service: &str, version: u32, methods: &[u32]) -> Bytes {
    let mut b = BytesMut::new();
    b.put_slice(MAGIC);
    b.put_u16_le(VERSION);
    b.put_u32_le(version);
    b.put_u16_le(service.len() as u16);
    b.put_slice(service.as_bytes());
    b.put_u32_le(methods.len() as u32);
    for m in methods {
        b.put_u32_le(*m);
    }
    b.freeze()
}

/// A parsed HELLO.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Protocol version.
    pub proto: u16,
    /// Service version.
    pub version: u32,
    /// Service name.
    pub service: String,
    /// Method ids the client will call.
    pub methods: Vec<u32>,
}

/// Parse a HELLO body.
pub fn parse_hello(mut b: &[u8]) -> Result<Hello, RpcError> {
    let short = || RpcError::Protocol("truncated HELLO".into());
    if b.len() < 12 || &b[..4] != MAGIC {
        return Err(RpcError::Protocol(
            "not an rdmx-rpc peer (bad HELLO magic)".into(),
        ));
    }
    b.advance(4);
    let proto = b.get_u16_le();
    let version = b.get_u32_le();
    let n = b.get_u16_le() as usize;
    if b.len() < n + 4 {
        return Err(short());
    }
    let service = String::from_utf8(b[..n].to_vec())
        .map_err(|_| RpcError::Protocol("service name is not UTF-8".into()))?;
    b.advance(n);
    let count = b.get_u32_le() as usize;
    if b.len() != count * 4 {
        return Err(short());
    }
    let methods = (0..count).map(|_| b.get_u32_le()).collect();
    Ok(Hello {
        proto,
        version,
        service,
        methods,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn frames_round_trip(kind in 1u8..=7, flags: u8, status in 0u16..=8, method: u32,
                             call: u64, deadline: u32, body in proptest::collection::vec(any::<u8>(), 0..300)) {
            let f = Frame {
                kind: Kind::from_u8(kind).unwrap(),
                flags,
                status: Status::from_u16(status).unwrap(),
                method,
                call,
                deadline_ms: deadline,
                body: body.into(),
            };
            prop_assert_eq!(Frame::decode(f.encode()).unwrap(), f);
        }

        /// Arbitrary bytes never panic the decoder: a frame or a clear error.
        #[test]
        fn arbitrary_bytes_decode_or_fail_cleanly(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = Frame::decode(b.clone().into());
            let _ = parse_hello(&b);
        }
    }

    #[test]
    fn hello_round_trip_and_bad_magic() {
        let b = hello_body("kv", 3, &[1, 2, 3]);
        let h = parse_hello(&b).unwrap();
        assert_eq!(
            (h.service.as_str(), h.version, h.methods),
            ("kv", 3, vec![1, 2, 3])
        );
        assert!(parse_hello(b"NOPE00000000").is_err());
        assert!(parse_hello(&b[..b.len() - 1]).is_err());
    }

    #[test]
    fn method_ids_are_stable_and_distinct() {
        assert_eq!(method_id("kv", "get"), method_id("kv", "get"));
        assert_ne!(method_id("kv", "get"), method_id("kv", "put"));
        assert_ne!(method_id("kv", "get"), method_id("kv2", "get"));
    }
}
