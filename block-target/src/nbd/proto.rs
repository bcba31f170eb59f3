//! The NBD protocol's wire format (NetworkBlockDevice `doc/proto.md`):
//! fixed-newstyle negotiation, options and their replies, transmission
//! requests, simple and structured replies. All fields big-endian.

use bytes::{BufMut, Bytes, BytesMut};

/// "NBDMAGIC", the first 8 bytes a server sends.
pub const NBDMAGIC: u64 = 0x4E42_444D_4147_4943;
/// "IHAVEOPT": starts the negotiation and every option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of an option reply.
pub const REPLY_MAGIC: u64 = 0x0003_E889_0455_65A9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668E_33EF;

/// Handshake flags (server): fixed newstyle, no zeroes.
pub const HANDSHAKE_FLAGS: u16 = 0x0003;
/// Client flags this server understands.
pub const CLIENT_FLAGS_KNOWN: u32 = 0x0003;
/// Client flag: no 124 zero bytes after EXPORT_NAME's reply.
pub const CLIENT_NO_ZEROES: u32 = 0x0002;

/// Options (proto.md "Option types").
pub mod opt {
    /// Choose an export, old style: no option reply.
    pub const EXPORT_NAME: u32 = 1;
    /// End the negotiation.
    pub const ABORT: u32 = 2;
    /// List the exports.
    pub const LIST: u32 = 3;
    /// TLS (not offered).
    pub const STARTTLS: u32 = 5;
    /// Describe an export.
    pub const INFO: u32 = 6;
    /// Describe and choose an export.
    pub const GO: u32 = 7;
    /// Structured replies to READ.
    pub const STRUCTURED_REPLY: u32 = 8;
    /// List metadata contexts.
    pub const LIST_META_CONTEXT: u32 = 9;
    /// Select metadata contexts.
    pub const SET_META_CONTEXT: u32 = 10;
}

/// Option reply types.
pub mod rep {
    /// Done.
    pub const ACK: u32 = 1;
    /// An export (LIST).
    pub const SERVER: u32 = 2;
    /// Information (INFO, GO).
    pub const INFO: u32 = 3;
    /// A metadata context.
    pub const META_CONTEXT: u32 = 4;
    /// Unsupported option.
    pub const ERR_UNSUP: u32 = 0x8000_0001;
    /// Refused by policy.
    pub const ERR_POLICY: u32 = 0x8000_0002;
    /// Invalid option data.
    pub const ERR_INVALID: u32 = 0x8000_0003;
    /// Unknown export.
    pub const ERR_UNKNOWN: u32 = 0x8000_0006;
    /// The option's data is too large.
    pub const ERR_TOO_BIG: u32 = 0x8000_0009;
}

/// Information types.
pub mod info {
    /// Size and transmission flags.
    pub const EXPORT: u16 = 0;
    /// The export's name.
    pub const NAME: u16 = 1;
    /// A description.
    pub const DESCRIPTION: u16 = 2;
    /// Minimum, preferred and maximum block sizes.
    pub const BLOCK_SIZE: u16 = 3;
}

/// Transmission flags.
pub mod tflag {
    /// Always set.
    pub const HAS_FLAGS: u16 = 1 << 0;
    /// FLUSH is supported.
    pub const SEND_FLUSH: u16 = 1 << 2;
    /// FUA is supported.
    pub const SEND_FUA: u16 = 1 << 3;
    /// TRIM is supported.
    pub const SEND_TRIM: u16 = 1 << 5;
    /// WRITE_ZEROES is supported.
    pub const SEND_WRITE_ZEROES: u16 = 1 << 6;
    /// The DF command flag is supported.
    pub const SEND_DF: u16 = 1 << 7;
    /// A FLUSH on any connection covers writes completed on all of them.
    pub const CAN_MULTI_CONN: u16 = 1 << 8;
    /// CACHE is supported.
    pub const SEND_CACHE: u16 = 1 << 10;
    /// The FAST_ZERO command flag is supported.
    pub const SEND_FAST_ZERO: u16 = 1 << 11;
}

/// Command flags.
pub mod cflag {
    /// Force unit access.
    pub const FUA: u16 = 1 << 0;
    /// WRITE_ZEROES must allocate.
    pub const NO_HOLE: u16 = 1 << 1;
    /// READ: one data chunk only.
    pub const DF: u16 = 1 << 2;
    /// BLOCK_STATUS: one extent.
    pub const REQ_ONE: u16 = 1 << 3;
    /// WRITE_ZEROES: fail rather than be slow.
    pub const FAST_ZERO: u16 = 1 << 4;
}

/// Commands.
pub mod cmd {
    /// Read.
    pub const READ: u16 = 0;
    /// Write.
    pub const WRITE: u16 = 1;
    /// Disconnect.
    pub const DISC: u16 = 2;
    /// Flush.
    pub const FLUSH: u16 = 3;
    /// Trim.
    pub const TRIM: u16 = 4;
    /// Prefetch hint.
    pub const CACHE: u16 = 5;
    /// Write zeroes.
    pub const WRITE_ZEROES: u16 = 6;
    /// Block status.
    pub const BLOCK_STATUS: u16 = 7;
}

/// Error values in replies.
pub mod errno {
    /// Write to a read-only export.
    pub const EPERM: u32 = 1;
    /// I/O error.
    pub const EIO: u32 = 5;
    /// Out of memory.
    pub const ENOMEM: u32 = 12;
    /// Invalid request.
    pub const EINVAL: u32 = 22;
    /// Past the end.
    pub const ENOSPC: u32 = 28;
    /// Request too large.
    pub const EOVERFLOW: u32 = 75;
    /// Not supported (FAST_ZERO).
    pub const ENOTSUP: u32 = 95;
    /// Server shutting down.
    pub const ESHUTDOWN: u32 = 108;
}

/// Structured reply chunk types.
pub mod chunk {
    /// No payload.
    pub const NONE: u16 = 0;
    /// Data at an offset.
    pub const OFFSET_DATA: u16 = 1;
    /// Block status extents.
    pub const BLOCK_STATUS: u16 = 5;
    /// An error.
    pub const ERROR: u16 = 0x8001;
    /// Flag: the last chunk of a reply.
    pub const FLAG_DONE: u16 = 1;
}

/// The metadata context this server offers.
pub const BASE_ALLOCATION: &str = "base:allocation";

/// A transmission request (28 bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    /// Command flags.
    pub flags: u16,
    /// Command type.
    pub kind: u16,
    /// Opaque cookie, echoed in the reply.
    pub cookie: u64,
    /// Byte offset.
    pub offset: u64,
    /// Byte length.
    pub length: u32,
}

impl Request {
    /// Length of a request header.
    pub const LEN: usize = 28;

    /// Decode; `None` when the magic is wrong (the stream is lost).
    pub fn parse(b: &[u8; Request::LEN]) -> Option<Request> {
        if u32::from_be_bytes(b[0..4].try_into().expect("4")) != REQUEST_MAGIC {
            return None;
        }
        Some(Request {
            flags: u16::from_be_bytes([b[4], b[5]]),
            kind: u16::from_be_bytes([b[6], b[7]]),
            cookie: u64::from_be_bytes(b[8..16].try_into().expect("8")),
            offset: u64::from_be_bytes(b[16..24].try_into().expect("8")),
            length: u32::from_be_bytes(b[24..28].try_into().expect("4")),
        })
    }

    /// Encode (a client's side; tests use it).
    pub fn encode(&self) -> [u8; Request::LEN] {
        let mut b = [0u8; Request::LEN];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// An option reply.
pub fn option_reply(out: &mut BytesMut, option: u32, kind: u32, data: &[u8]) {
    out.put_u64(REPLY_MAGIC);
    out.put_u32(option);
    out.put_u32(kind);
    out.put_u32(data.len() as u32);
    out.put_slice(data);
}

/// A simple reply (16 bytes; READ data would follow).
pub fn simple_reply(out: &mut BytesMut, error: u32, cookie: u64) {
    out.put_u32(SIMPLE_REPLY_MAGIC);
    out.put_u32(error);
    out.put_u64(cookie);
}

/// A structured reply chunk header; `len` bytes of payload follow.
pub fn chunk_header(out: &mut BytesMut, flags: u16, kind: u16, cookie: u64, len: u32) {
    out.put_u32(STRUCTURED_REPLY_MAGIC);
    out.put_u16(flags);
    out.put_u16(kind);
    out.put_u64(cookie);
    out.put_u32(len);
}

/// A structured ERROR chunk (with DONE).
pub fn error_chunk(out: &mut BytesMut, cookie: u64, error: u32, msg: &str) {
    let m = &msg.as_bytes()[..msg.len().min(200)];
    chunk_header(
        out,
        chunk::FLAG_DONE,
        chunk::ERROR,
        cookie,
        6 + m.len() as u32,
    );
    out.put_u32(error);
    out.put_u16(m.len() as u16);
    out.put_slice(m);
}

/// The INFO/GO request data: export name and the information asked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InfoRequest {
    /// Export name.
    pub name: String,
    /// Information types asked for.
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Decode; `None` if the lengths do not add up.
    pub fn parse(d: &[u8]) -> Option<InfoRequest> {
        let n = u32::from_be_bytes(d.get(0..4)?.try_into().ok()?) as usize;
        let name = d.get(4..4usize.checked_add(n)?)?;
        let rest = &d[4 + n..];
        let count = u16::from_be_bytes(rest.get(0..2)?.try_into().ok()?) as usize;
        let list = rest.get(2..)?;
        if list.len() != count * 2 {
            return None;
        }
        Some(InfoRequest {
            name: String::from_utf8_lossy(name).into_owned(),
            requests: list
                .chunks_exact(2)
                .map(|c| u16::from_be_bytes([c[0], c[1]]))
                .collect(),
        })
    }
}

/// LIST_META_CONTEXT / SET_META_CONTEXT request data: an export and queries.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MetaRequest {
    /// Export name.
    pub name: String,
    /// Queries.
    pub queries: Vec<String>,
}

impl MetaRequest {
    /// Decode; `None` if the lengths do not add up.
    pub fn parse(d: &[u8]) -> Option<MetaRequest> {
        let n = u32::from_be_bytes(d.get(0..4)?.try_into().ok()?) as usize;
        let name = d.get(4..4usize.checked_add(n)?)?;
        let mut at = 4 + n;
        let count = u32::from_be_bytes(d.get(at..at + 4)?.try_into().ok()?) as usize;
        at += 4;
        let mut queries = Vec::new();
        for _ in 0..count {
            let l = u32::from_be_bytes(d.get(at..at + 4)?.try_into().ok()?) as usize;
            at += 4;
            let q = d.get(at..at.checked_add(l)?)?;
            at += l;
            queries.push(String::from_utf8_lossy(q).into_owned());
        }
        if at != d.len() {
            return None;
        }
        Some(MetaRequest {
            name: String::from_utf8_lossy(name).into_owned(),
            queries,
        })
    }
}

/// Bytes of a READ chunk: OFFSET_DATA with DONE, header and offset.
pub fn read_chunk_header(cookie: u64, offset: u64, len: usize) -> Bytes {
    let mut b = BytesMut::with_capacity(28);
    chunk_header(
        &mut b,
        chunk::FLAG_DONE,
        chunk::OFFSET_DATA,
        cookie,
        8 + len as u32,
    );
    b.put_u64(offset);
    b.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips_and_checks_its_magic() {
        let r = Request {
            flags: cflag::FUA,
            kind: cmd::WRITE,
            cookie: 0x0102_0304_0506_0708,
            offset: 4096,
            length: 512,
        };
        let b = r.encode();
        assert_eq!(&b[..4], &[0x25, 0x60, 0x95, 0x13]);
        assert_eq!(Request::parse(&b), Some(r));
        let mut bad = b;
        bad[0] = 0;
        assert_eq!(Request::parse(&bad), None);
    }

    #[test]
    fn info_and_meta_requests_decode_and_refuse_bad_lengths() {
        let mut d = vec![0, 0, 0, 3];
        d.extend_from_slice(b"exp");
        d.extend_from_slice(&[0, 2, 0, 3, 0, 1]);
        assert_eq!(
            InfoRequest::parse(&d),
            Some(InfoRequest {
                name: "exp".into(),
                requests: vec![3, 1]
            })
        );
        assert_eq!(InfoRequest::parse(&d[..d.len() - 1]), None);
        assert_eq!(InfoRequest::parse(&[0xff, 0xff, 0xff, 0xff]), None);
        let mut m = vec![0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0, 15];
        m.extend_from_slice(BASE_ALLOCATION.as_bytes());
        assert_eq!(
            MetaRequest::parse(&m).unwrap().queries,
            vec![BASE_ALLOCATION.to_string()]
        );
        assert_eq!(MetaRequest::parse(&m[..m.len() - 2]), None);
        m.push(0);
        assert_eq!(MetaRequest::parse(&m), None, "trailing bytes");
    }
}
