//! RESP2, the Redis serialization protocol, as a Redis 7 server speaks it:
//! requests (multibulk arrays of bulk strings, or inline lines) decoded with
//! every length bounded before anything is kept, and replies encoded.
//!
//! Limits and errors follow Redis's `processMultibulkBuffer` and
//! `processInlineBuffer` (networking.c): a count or length that is not a
//! number, or beyond the limit, is a protocol error; the server replies
//! `-ERR Protocol error: …` and closes the connection. Nothing is allocated
//! by a size the peer claims: bytes are kept only as they arrive.

use bytes::{Buf, Bytes, BytesMut};

/// The longest request line (count or length header, inline command): 64 KiB.
pub const MAX_LINE: usize = 64 << 10;
/// The most arguments one request may have.
pub const MAX_ARGS: i64 = 1 << 20;

/// A request the connection cannot continue after: the text is Redis's.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("Protocol error: {0}")]
pub struct ProtocolError(pub String);

fn err(s: &str) -> ProtocolError {
    ProtocolError(s.to_string())
}

/// Redis's `string2ll` (see `store::parse_i64`).
fn number(line: &[u8]) -> Option<i64> {
    crate::store::parse_i64(line)
}

/// Find `\r\n` in `b`, returning the line before it. Looks for the `\r`
/// bytes alone (a plain byte loop), which costs less than comparing every
/// two-byte window.
fn line(b: &[u8]) -> Option<&[u8]> {
    let mut from = 0;
    while let Some(i) = b[from..].iter().position(|&c| c == b'\r') {
        let i = from + i;
        match b.get(i + 1) {
            Some(b'\n') => return Some(&b[..i]),
            Some(_) => from = i + 1,
            None => return None,
        }
    }
    None
}

/// Arguments whose places the first walk over a request keeps, so that a
/// request of at most this many (GET, SET with options, a short MGET) is
/// walked once; a longer one is walked again to take its arguments.
const KEPT_SPANS: usize = 8;

/// Decode one request from `buf`, consuming it: `Ok(None)` if more bytes are
/// needed (nothing is consumed then), `Ok(Some(args))` for a request (an empty
/// `args` for an empty line or `*0`, which Redis ignores).
/// `max_bulk` bounds each argument.
pub fn decode(buf: &mut BytesMut, max_bulk: usize) -> Result<Option<Vec<Bytes>>, ProtocolError> {
    if buf.is_empty() {
        return Ok(None);
    }
    if buf[0] != b'*' {
        return decode_inline(buf);
    }
    let Some(head) = line(&buf[..buf.len().min(MAX_LINE + 2)]) else {
        if buf.len() > MAX_LINE {
            return Err(err("too big mbulk count string"));
        }
        return Ok(None);
    };
    let count = number(&head[1..])
        .filter(|&n| n <= MAX_ARGS)
        .ok_or_else(|| err("invalid multibulk length"))?;
    let mut at = head.len() + 2;
    if count <= 0 {
        buf.advance(at);
        return Ok(Some(Vec::new()));
    }
    let count = count as usize;
    // First find where every argument ends (checking each header); consume
    // only a whole request. The first few places are kept on the stack.
    let first = at;
    let mut kept = [(0usize, 0usize); KEPT_SPANS];
    for i in 0..count {
        match bulk_at(buf, at, max_bulk)? {
            Some(span) => {
                if let Some(k) = kept.get_mut(i) {
                    *k = (span.start, span.end);
                }
                at = span.end + 2;
            }
            None => return Ok(None),
        }
    }
    // Then take them: one allocation per request (the argument list).
    let all = buf.split_to(at).freeze();
    let mut args = Vec::with_capacity(count);
    if count <= KEPT_SPANS {
        args.extend(kept[..count].iter().map(|&(s, e)| all.slice(s..e)));
        return Ok(Some(args));
    }
    // A longer request is walked again (the headers passed: this walk
    // cannot fail).
    let mut at = first;
    while at < all.len() {
        let span = bulk_at(&all, at, max_bulk)?.ok_or_else(|| err("truncated request"))?;
        at = span.end + 2;
        args.push(all.slice(span));
    }
    Ok(Some(args))
}

/// The bulk string whose `$len\r\n` header starts at `at` in `buf`: the
/// range of its bytes, or `None` while it has not all arrived (its `\r\n`
/// included).
fn bulk_at(
    buf: &[u8],
    at: usize,
    max_bulk: usize,
) -> Result<Option<std::ops::Range<usize>>, ProtocolError> {
    let rest = &buf[at..];
    if rest.is_empty() {
        return Ok(None);
    }
    if rest[0] != b'$' {
        return Err(ProtocolError(format!(
            "expected '$', got '{}'",
            rest[0] as char
        )));
    }
    let Some(l) = line(&rest[..rest.len().min(MAX_LINE + 2)]) else {
        if rest.len() > MAX_LINE {
            return Err(err("too big bulk count string"));
        }
        return Ok(None);
    };
    let len = number(&l[1..])
        .filter(|&n| n >= 0 && n as u64 <= max_bulk as u64)
        .ok_or_else(|| err("invalid bulk length"))? as usize;
    let start = at + l.len() + 2;
    if buf.len() < start + len + 2 {
        return Ok(None);
    }
    Ok(Some(start..start + len))
}

/// An inline request: one line, arguments separated by spaces (what telnet
/// users type). Quotes are not interpreted.
fn decode_inline(buf: &mut BytesMut) -> Result<Option<Vec<Bytes>>, ProtocolError> {
    let Some(pos) = buf[..buf.len().min(MAX_LINE + 1)]
        .iter()
        .position(|&b| b == b'\n')
    else {
        if buf.len() > MAX_LINE {
            return Err(err("too big inline request"));
        }
        return Ok(None);
    };
    let line = buf.split_to(pos + 1).freeze();
    let text = line.slice(..pos);
    let text = text
        .strip_suffix(b"\r")
        .map_or(text.clone(), |t| line.slice_ref(t));
    let args = text
        .split(|b| *b == b' ' || *b == b'\t')
        .filter(|a| !a.is_empty())
        .map(|a| line.slice_ref(a))
        .collect();
    Ok(Some(args))
}

/// A reply, encoded into `out`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reply {
    /// `+text`
    Simple(&'static str),
    /// `-text` (the text carries its prefix: `ERR …`, `WRONGTYPE …`).
    Error(String),
    /// `:n`
    Int(i64),
    /// `$len` and the bytes.
    Bulk(Bytes),
    /// `$-1`
    Nil,
    /// `*n` and the items.
    Array(Vec<Reply>),
}

impl Reply {
    /// `-ERR text`.
    pub fn err(text: impl std::fmt::Display) -> Reply {
        Reply::Error(format!("ERR {text}"))
    }

    /// Append the wire form.
    pub fn encode(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Simple(s) => {
                out.push(b'+');
                out.extend_from_slice(s.as_bytes());
            }
            Reply::Error(s) => {
                out.push(b'-');
                // Redis replaces newlines in error texts so a reply stays one line.
                out.extend(
                    s.bytes()
                        .map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
                );
            }
            Reply::Int(n) => {
                out.push(b':');
                out.extend_from_slice(n.to_string().as_bytes());
            }
            Reply::Bulk(b) => {
                out.push(b'$');
                out.extend_from_slice(b.len().to_string().as_bytes());
                out.extend_from_slice(b"\r\n");
                out.extend_from_slice(b);
            }
            Reply::Nil => out.extend_from_slice(b"$-1"),
            Reply::Array(items) => {
                out.push(b'*');
                out.extend_from_slice(items.len().to_string().as_bytes());
                out.extend_from_slice(b"\r\n");
                for i in items {
                    i.encode(out);
                }
                return;
            }
        }
        out.extend_from_slice(b"\r\n");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn dec(b: &[u8]) -> Result<Option<Vec<Bytes>>, ProtocolError> {
        decode(&mut BytesMut::from(b), 1 << 20)
    }

    #[test]
    fn requests_and_partial_requests() {
        let args = dec(b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n").unwrap().unwrap();
        assert_eq!(args, vec![Bytes::from("GET"), Bytes::from("k")]);
        assert_eq!(dec(b"*2\r\n$3\r\nGET\r\n$1\r\n").unwrap(), None);
        assert_eq!(dec(b"*2\r\n$3\r\nGE").unwrap(), None);
        assert_eq!(
            dec(b"PING\r\n").unwrap().unwrap(),
            vec![Bytes::from("PING")]
        );
        assert_eq!(dec(b"set  a   b\n").unwrap().unwrap().len(), 3);
        assert_eq!(dec(b"\r\n").unwrap().unwrap(), Vec::<Bytes>::new());
        assert_eq!(dec(b"*0\r\n").unwrap().unwrap(), Vec::<Bytes>::new());
        assert_eq!(dec(b"*-1\r\n").unwrap().unwrap(), Vec::<Bytes>::new());
    }

    #[test]
    fn malformed_requests_get_redis_errors() {
        assert_eq!(dec(b"*x\r\n").unwrap_err().0, "invalid multibulk length");
        assert_eq!(
            dec(b"*99999999999\r\n").unwrap_err().0,
            "invalid multibulk length"
        );
        assert_eq!(dec(b"*1\r\n+x\r\n").unwrap_err().0, "expected '$', got '+'");
        assert_eq!(dec(b"*1\r\n$-5\r\n").unwrap_err().0, "invalid bulk length");
        // A claimed length beyond the limit is refused before any byte of it.
        assert_eq!(
            dec(b"*1\r\n$2000000000\r\n").unwrap_err().0,
            "invalid bulk length"
        );
        assert_eq!(
            dec(&vec![b'*'; MAX_LINE + 10]).unwrap_err().0,
            "too big mbulk count string"
        );
        assert_eq!(
            dec(&vec![b'a'; MAX_LINE + 10]).unwrap_err().0,
            "too big inline request"
        );
    }

    #[test]
    fn replies_encode_as_redis_sends_them() {
        let mut o = Vec::new();
        Reply::Array(vec![
            Reply::Simple("OK"),
            Reply::Int(-3),
            Reply::Bulk(Bytes::from("hi")),
            Reply::Nil,
            Reply::err("bad\r\nthing"),
            Reply::Array(vec![]),
        ])
        .encode(&mut o);
        assert_eq!(
            o,
            b"*6\r\n+OK\r\n:-3\r\n$2\r\nhi\r\n$-1\r\n-ERR bad  thing\r\n*0\r\n"
        );
    }

    proptest! {
        /// Any request survives encoding, arrival in two pieces, and decoding
        /// (up to 20 arguments: walked once up to `KEPT_SPANS`, twice beyond).
        #[test]
        fn round_trip_in_pieces(args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..300), 1..20), cut in any::<proptest::sample::Index>()) {
            let mut wire = format!("*{}\r\n", args.len()).into_bytes();
            for a in &args {
                wire.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                wire.extend_from_slice(a);
                wire.extend_from_slice(b"\r\n");
            }
            wire.extend_from_slice(b"*1\r\n$4\r\nPING\r\n");
            let cut = cut.index(wire.len());
            let mut buf = BytesMut::from(&wire[..cut]);
            let mut got = Vec::new();
            while let Some(r) = decode(&mut buf, 1 << 20).unwrap() { got.push(r); }
            buf.extend_from_slice(&wire[cut..]);
            while let Some(r) = decode(&mut buf, 1 << 20).unwrap() { got.push(r); }
            prop_assert!(buf.is_empty());
            prop_assert_eq!(got.len(), 2);
            prop_assert_eq!(got[0].iter().map(|b| b.to_vec()).collect::<Vec<_>>(), args);
        }

        /// `line` finds the first `\r\n`, as comparing every two-byte window
        /// does (bytes drawn mostly from `\r`, `\n` and one letter).
        #[test]
        fn line_is_the_first_crlf(b in proptest::collection::vec(prop_oneof![Just(b'\r'), Just(b'\n'), Just(b'a'), any::<u8>()], 0..40)) {
            let want = b.windows(2).position(|w| w == b"\r\n").map(|i| &b[..i]);
            prop_assert_eq!(line(&b), want);
        }

        /// Garbage never panics and never keeps more than it was given.
        #[test]
        fn garbage_is_an_error_or_a_wait(bytes in proptest::collection::vec(any::<u8>(), 0..2000)) {
            let mut buf = BytesMut::from(&bytes[..]);
            for _ in 0..bytes.len() + 1 {
                match decode(&mut buf, 1 << 16) {
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                }
            }
            prop_assert!(buf.len() <= bytes.len());
        }
    }
}
