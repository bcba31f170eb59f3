//! The framed wire protocol after the handshake.
//!
//! Every frame is a fixed 48-byte little-endian header followed by
//! `payload_len` bytes:
//!
//! ```text
//!  0 u8  kind        1 u8 flags      2 u8 status    3 u8 reserved (0)
//!  4 u32 payload_len
//!  8 u64 id          request id, echoed by the response
//! 16 u64 addr        remote address of the whole operation
//! 24 u32 rkey
//! 28 u32 imm         write: immediate; read: piece length
//! 32 u64 a           write/read: operation length; atomic: compare or add;
//!                    credit: messages; response: atomic's old value
//! 40 u64 b           write/read: piece offset; atomic: swap; credit: bytes
//! ```
//!
//! A large read or write travels as pieces of at most [`MAX_PIECE`] bytes, each
//! carrying the whole operation's range so the passive side checks the complete
//! access before storing any byte (as an RDMA NIC checks the RETH).

use bytes::{BufMut, Bytes};
use rdmx_core::LocalSlice;

/// Header length in bytes.
pub const HEADER_LEN: usize = 48;
/// Largest read/write piece carried by one frame.
pub const MAX_PIECE: u64 = 4 << 20;

/// What a frame is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Two-sided message; payload is the message.
    Send = 1,
    /// Receive credits returned to the sender (`a` messages, `b` bytes).
    Credit = 2,
    /// One-sided write piece; payload is the data.
    Write = 3,
    /// One-sided read request for one piece.
    Read = 4,
    /// Atomic request (flag [`FLAG_FAA`] selects fetch-and-add, else compare-and-swap).
    Atomic = 5,
    /// Response to a write, read or atomic; payload is read data.
    Resp = 6,
    /// Graceful close.
    Close = 7,
}

/// Write: the immediate in `imm` is delivered after the last piece lands.
pub const FLAG_IMM: u8 = 1;
/// Write: this is the operation's last piece.
pub const FLAG_LAST: u8 = 2;
/// Atomic: fetch-and-add (otherwise compare-and-swap).
pub const FLAG_FAA: u8 = 4;
/// Write: the requester does not wait on this piece's acknowledgement (a
/// message follows it, as in `write_then_send`), so the responder may hold a
/// success answer back until it sends something else, for at most
/// 1 ms (an RC responder's coalesced ACKs, IBTA 9.7.5.1).
/// A refusal is answered at once. A peer that ignores the flag answers at
/// once, as before.
pub const FLAG_ACK_LATER: u8 = 8;

/// Response status: success.
pub const STATUS_OK: u8 = 0;

/// A decoded header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// Frame kind.
    pub kind: Kind,
    /// Kind-specific flags.
    pub flags: u8,
    /// Response status ([`STATUS_OK`] or an [`rdmx_core::AccessError`] code).
    pub status: u8,
    /// Bytes following the header.
    pub payload_len: u32,
    /// Request id.
    pub id: u64,
    /// Operation address.
    pub addr: u64,
    /// Remote key.
    pub rkey: u32,
    /// Immediate or piece length.
    pub imm: u32,
    /// See the module docs.
    pub a: u64,
    /// See the module docs.
    pub b: u64,
}

/// Why a header was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer than [`HEADER_LEN`] bytes.
    #[error("truncated header ({0} bytes)")]
    Truncated(usize),
    /// Unknown frame kind.
    #[error("unknown frame kind {0}")]
    UnknownKind(u8),
    /// Reserved byte not zero.
    #[error("reserved header byte is {0:#x}, must be 0")]
    Reserved(u8),
    /// Payload larger than allowed for this kind.
    #[error("{kind:?} frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Frame kind.
        kind: Kind,
        /// Announced payload length.
        len: u32,
        /// The limit.
        max: u64,
    },
    /// A field is inconsistent with the frame kind.
    #[error("malformed {0:?} frame: {1}")]
    Malformed(Kind, &'static str),
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Send,
            2 => Kind::Credit,
            3 => Kind::Write,
            4 => Kind::Read,
            5 => Kind::Atomic,
            6 => Kind::Resp,
            7 => Kind::Close,
            _ => return None,
        })
    }
}

impl Header {
    /// A header of `kind` with every other field zero.
    pub fn new(kind: Kind) -> Header {
        Header {
            kind,
            flags: 0,
            status: 0,
            payload_len: 0,
            id: 0,
            addr: 0,
            rkey: 0,
            imm: 0,
            a: 0,
            b: 0,
        }
    }

    /// Encode to the 48-byte wire form.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        let mut w = &mut out[..];
        w.put_u8(self.kind as u8);
        w.put_u8(self.flags);
        w.put_u8(self.status);
        w.put_u8(0);
        w.put_u32_le(self.payload_len);
        w.put_u64_le(self.id);
        w.put_u64_le(self.addr);
        w.put_u32_le(self.rkey);
        w.put_u32_le(self.imm);
        w.put_u64_le(self.a);
        w.put_u64_le(self.b);
        out
    }

    /// Decode and validate a header. `max_message` bounds `Send` payloads.
    pub fn decode(b: &[u8], max_message: u64) -> Result<Header, FrameError> {
        if b.len() < HEADER_LEN {
            return Err(FrameError::Truncated(b.len()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4"));
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8"));
        let kind = Kind::from_u8(b[0]).ok_or(FrameError::UnknownKind(b[0]))?;
        if b[3] != 0 {
            return Err(FrameError::Reserved(b[3]));
        }
        let h = Header {
            kind,
            flags: b[1],
            status: b[2],
            payload_len: u32_at(4),
            id: u64_at(8),
            addr: u64_at(16),
            rkey: u32_at(24),
            imm: u32_at(28),
            a: u64_at(32),
            b: u64_at(40),
        };
        let max = match kind {
            Kind::Send => max_message,
            Kind::Write | Kind::Resp => MAX_PIECE,
            Kind::Credit | Kind::Read | Kind::Atomic | Kind::Close => 0,
        };
        if u64::from(h.payload_len) > max {
            return Err(FrameError::TooLarge {
                kind,
                len: h.payload_len,
                max,
            });
        }
        match kind {
            Kind::Write => {
                let end = h.b.checked_add(u64::from(h.payload_len));
                if end.is_none_or(|e| e > h.a) {
                    return Err(FrameError::Malformed(kind, "piece outside the operation"));
                }
            }
            Kind::Read => {
                if u64::from(h.imm) > MAX_PIECE {
                    return Err(FrameError::Malformed(kind, "piece larger than the limit"));
                }
                let end = h.b.checked_add(u64::from(h.imm));
                if end.is_none_or(|e| e > h.a) {
                    return Err(FrameError::Malformed(kind, "piece outside the operation"));
                }
            }
            _ => {}
        }
        Ok(h)
    }
}

/// A frame queued for the socket: header bytes plus an owned payload.
#[derive(Debug)]
pub(crate) struct OutFrame {
    pub(crate) hdr: [u8; HEADER_LEN],
    pub(crate) hdr_pos: usize,
    pub(crate) payload: Bytes,
    /// A large read response's payload instead: the region bytes and how
    /// many of them are written, read from the region as they leave.
    pub(crate) source: Option<(LocalSlice, usize)>,
    /// An answer to the peer's request (a [`Kind::Resp`] frame): counted
    /// while queued, so that a peer that does not read them is caught.
    pub(crate) answer: bool,
}

impl OutFrame {
    pub(crate) fn new(mut h: Header, payload: Bytes) -> OutFrame {
        h.payload_len = u32::try_from(payload.len()).expect("payload checked by caller");
        OutFrame {
            hdr: h.encode(),
            hdr_pos: 0,
            payload,
            source: None,
            answer: h.kind == Kind::Resp,
        }
    }

    /// A frame whose payload is read from a region when it is written.
    pub(crate) fn from_source(mut h: Header, source: LocalSlice) -> OutFrame {
        h.payload_len = u32::try_from(source.len()).expect("piece size checked by decode");
        OutFrame {
            hdr: h.encode(),
            hdr_pos: 0,
            payload: Bytes::new(),
            source: Some((source, 0)),
            answer: h.kind == Kind::Resp,
        }
    }

    pub(crate) fn remaining(&self) -> usize {
        let source = self.source.as_ref().map_or(0, |(s, pos)| s.len() - pos);
        HEADER_LEN - self.hdr_pos + self.payload.len() + source
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_header() -> impl Strategy<Value = Header> {
        (
            1u8..=7,
            any::<u8>(),
            any::<u8>(),
            any::<u64>(),
            any::<u64>(),
            any::<u32>(),
            any::<(u32, u64, u64, u32)>(),
        )
            .prop_map(
                |(k, flags, status, id, addr, rkey, (imm, a, b, len))| Header {
                    kind: Kind::from_u8(k).unwrap(),
                    flags,
                    status,
                    payload_len: len,
                    id,
                    addr,
                    rkey,
                    imm,
                    a,
                    b,
                },
            )
    }

    proptest! {
        /// Every header that decodes re-encodes to the same bytes, and every
        /// header we encode either decodes to itself or is refused for a limit.
        #[test]
        fn roundtrip(h in arb_header()) {
            let bytes = h.encode();
            match Header::decode(&bytes, 16 << 20) {
                Ok(d) => {
                    prop_assert_eq!(d, h);
                    prop_assert_eq!(d.encode(), bytes);
                }
                Err(FrameError::TooLarge { .. }) | Err(FrameError::Malformed(..)) => {}
                Err(e) => prop_assert!(false, "unexpected {e}"),
            }
        }

        /// Arbitrary bytes never panic the decoder, and accepted ones respect limits.
        #[test]
        fn arbitrary_bytes(b in proptest::collection::vec(any::<u8>(), 0..64)) {
            if let Ok(h) = Header::decode(&b, 1024) {
                prop_assert!(b.len() >= HEADER_LEN);
                prop_assert_eq!(&h.encode()[..], &b[..HEADER_LEN]);
                match h.kind {
                    Kind::Send => prop_assert!(h.payload_len <= 1024),
                    Kind::Write | Kind::Resp => prop_assert!(u64::from(h.payload_len) <= MAX_PIECE),
                    _ => prop_assert_eq!(h.payload_len, 0),
                }
            }
        }
    }

    #[test]
    fn refusals_are_specific() {
        assert_eq!(Header::decode(&[1; 10], 0), Err(FrameError::Truncated(10)));
        let mut b = Header::new(Kind::Send).encode();
        b[0] = 99;
        assert_eq!(Header::decode(&b, 0), Err(FrameError::UnknownKind(99)));
        let mut b = Header::new(Kind::Send).encode();
        b[3] = 1;
        assert_eq!(Header::decode(&b, 0), Err(FrameError::Reserved(1)));
        let mut h = Header::new(Kind::Send);
        h.payload_len = 11;
        assert!(matches!(
            Header::decode(&h.encode(), 10),
            Err(FrameError::TooLarge {
                len: 11,
                max: 10,
                ..
            })
        ));
        let mut h = Header::new(Kind::Write);
        h.payload_len = 8;
        h.a = 8;
        h.b = 1;
        assert!(matches!(
            Header::decode(&h.encode(), 0),
            Err(FrameError::Malformed(Kind::Write, _))
        ));
    }
}
