//! The text the verbs tools exchange out of band (rc_pingpong's and
//! perftest's QP addresses): fixed-size NUL-padded messages of hex fields
//! separated by colons.

use std::net::IpAddr;
use std::sync::Arc;

use rdmx_core::Error;
use rdmx_transport_rdma::{SoftConfig, SoftRoce};
use tokio::net::{TcpListener, TcpStream};

/// The soft RoCEv2 engine as the peer of a verbs program: on UDP 4791, where
/// a NIC or rxe sends (no other port), go-back-N as RC NICs expect.
pub(crate) fn verbs_peer_engine() -> Result<Arc<SoftRoce>, Error> {
    Ok(Arc::new(SoftRoce::new(SoftConfig {
        port_fallback: false,
        selective_repeat: false,
        ..SoftConfig::default()
    })?))
}

/// The exchange's TCP connection: to `host` when given, else the first
/// client on `listen:port` (`who` names the waiting command on stderr).
pub(crate) async fn connect_or_accept(
    host: Option<&str>,
    listen: IpAddr,
    port: u16,
    who: &str,
) -> Result<TcpStream, Error> {
    match host {
        Some(host) => TcpStream::connect((host, port))
            .await
            .map_err(|e| Error::Connect(format!("{host}:{port}: {e}"))),
        None => {
            let l = TcpListener::bind((listen, port))
                .await
                .map_err(|e| Error::Connect(format!("listen on {listen}:{port}: {e}")))?;
            eprintln!("rdmx {who}: waiting on {listen}:{port}");
            Ok(l.accept()
                .await
                .map_err(|e| Error::Connect(e.to_string()))?
                .0)
        }
    }
}

/// `s` in a zero-filled buffer of `N` bytes (the tools send whole buffers).
pub(crate) fn padded<const N: usize>(s: &str) -> [u8; N] {
    let mut out = [0u8; N];
    let n = s.len().min(N - 1);
    out[..n].copy_from_slice(&s.as_bytes()[..n]);
    out
}

/// The colon-separated fields of a received message, up to its first NUL.
pub(crate) struct HexFields<'a> {
    fields: std::str::Split<'a, char>,
    raw: &'a [u8],
    what: &'static str,
}

impl<'a> HexFields<'a> {
    /// Split message `m` (of the kind `what`, for errors).
    pub(crate) fn new(m: &'a [u8], what: &'static str) -> Result<HexFields<'a>, Error> {
        let text = m.split(|&b| b == 0).next().unwrap_or(m);
        let text = std::str::from_utf8(text).map_err(|_| bad(m, what))?;
        Ok(HexFields {
            fields: text.split(':'),
            raw: m,
            what,
        })
    }

    /// The next field as a hex number of at most `bits` bits.
    pub(crate) fn hex(&mut self, bits: u32) -> Result<u64, Error> {
        self.fields
            .next()
            .and_then(|x| u64::from_str_radix(x, 16).ok())
            .filter(|&v| bits >= 64 || v < 1u64 << bits)
            .ok_or_else(|| bad(self.raw, self.what))
    }

    /// The next field as text.
    pub(crate) fn text(&mut self) -> Result<&'a str, Error> {
        self.fields.next().ok_or_else(|| bad(self.raw, self.what))
    }

    /// An error naming this message.
    pub(crate) fn error(&self) -> Error {
        bad(self.raw, self.what)
    }
}

fn bad(m: &[u8], what: &str) -> Error {
    Error::Protocol(format!("not {what}: {:?}", String::from_utf8_lossy(m)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_bounded_hex() {
        let m: [u8; 16] = padded("0a:ffff:zz");
        assert_eq!(m[10], 0);
        let mut f = HexFields::new(&m, "a test message").unwrap();
        assert_eq!(f.hex(8).unwrap(), 10);
        assert!(f.hex(8).is_err(), "0xffff is wider than 8 bits");
        assert!(f.hex(8).is_err(), "zz is not hex");
        assert!(f.text().is_err(), "no more fields");
        assert!(HexFields::new(&[0xff, 0], "x").is_err());
    }
}
