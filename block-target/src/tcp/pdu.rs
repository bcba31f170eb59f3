//! NVMe/TCP PDUs (NVMe/TCP Transport Specification 1.0 §3.6): the common
//! header, connection initialization, and the PDUs a controller sends and
//! receives, with CRC32C header and data digests (§3.6.2.1 to §3.6.2.3).

use bytes::{BufMut, Bytes, BytesMut};

/// PDU types (§3.6.1, Figure 7).
pub mod pdu_type {
    /// ICReq (host to controller).
    pub const IC_REQ: u8 = 0x00;
    /// ICResp (controller to host).
    pub const IC_RESP: u8 = 0x01;
    /// H2CTermReq.
    pub const H2C_TERM_REQ: u8 = 0x02;
    /// C2HTermReq.
    pub const C2H_TERM_REQ: u8 = 0x03;
    /// CapsuleCmd.
    pub const CAPSULE_CMD: u8 = 0x04;
    /// CapsuleResp.
    pub const CAPSULE_RESP: u8 = 0x05;
    /// H2CData.
    pub const H2C_DATA: u8 = 0x06;
    /// C2HData.
    pub const C2H_DATA: u8 = 0x07;
    /// R2T.
    pub const R2T: u8 = 0x09;
}

/// Common header flags (§3.6.1).
pub mod flags {
    /// A header digest follows the header.
    pub const HDGST: u8 = 0x01;
    /// A data digest follows the data.
    pub const DDGST: u8 = 0x02;
    /// Last data PDU of a transfer (H2CData, C2HData).
    pub const LAST_PDU: u8 = 0x04;
    /// C2HData: the command succeeded, no CapsuleResp follows.
    pub const SUCCESS: u8 = 0x08;
}

/// Fatal error status of a termination request (§3.6.2.4, Figure 12).
pub mod fes {
    /// Invalid PDU header field (FEI: byte offset of the field).
    pub const INVALID_HEADER_FIELD: u16 = 0x01;
    /// PDU sequence error.
    pub const SEQUENCE_ERROR: u16 = 0x02;
    /// Header digest error.
    pub const HEADER_DIGEST: u16 = 0x03;
    /// Data transfer out of range.
    pub const OUT_OF_RANGE: u16 = 0x04;
    /// Data transfer limit exceeded (C2HTermReq).
    pub const LIMIT_EXCEEDED: u16 = 0x05;
    /// Unsupported parameter (FEI: byte offset).
    pub const UNSUPPORTED: u16 = 0x06;
}

/// Length of the common header.
pub const CH_LEN: usize = 8;
/// Length of ICReq and ICResp.
pub const IC_LEN: usize = 128;
/// Header length of CapsuleCmd (CH and the 64-byte SQE).
pub const CMD_HLEN: u8 = 72;
/// Header length of CapsuleResp, H2CData, C2HData, R2T and the TermReqs.
pub const SHORT_HLEN: u8 = 24;

/// A protocol error that ends the connection with a C2HTermReq.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fatal {
    /// Fatal error status.
    pub fes: u16,
    /// Fatal error information (a byte offset for FES 1 and 6).
    pub fei: u32,
}

impl Fatal {
    /// An invalid header field at byte `offset`.
    pub fn field(offset: u32) -> Fatal {
        Fatal {
            fes: fes::INVALID_HEADER_FIELD,
            fei: offset,
        }
    }

    /// A fatal error without a field.
    pub fn status(fes: u16) -> Fatal {
        Fatal { fes, fei: 0 }
    }
}

/// The common header of every PDU (§3.6.1, Figure 6).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CommonHeader {
    /// PDU type.
    pub ptype: u8,
    /// Flags.
    pub flags: u8,
    /// Header length (without the header digest).
    pub hlen: u8,
    /// Offset of the data from the PDU's start (0: no data).
    pub pdo: u8,
    /// Total PDU length.
    pub plen: u32,
}

impl CommonHeader {
    /// Decode 8 bytes.
    pub fn parse(b: &[u8; CH_LEN]) -> CommonHeader {
        CommonHeader {
            ptype: b[0],
            flags: b[1],
            hlen: b[2],
            pdo: b[3],
            plen: u32::from_le_bytes(b[4..8].try_into().expect("4")),
        }
    }

    /// Encode as 8 bytes.
    pub fn encode(&self) -> [u8; CH_LEN] {
        let mut b = [0u8; CH_LEN];
        b[0] = self.ptype;
        b[1] = self.flags;
        b[2] = self.hlen;
        b[3] = self.pdo;
        b[4..8].copy_from_slice(&self.plen.to_le_bytes());
        b
    }
}

/// Which digests a connection uses (negotiated in ICReq/ICResp).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Digests {
    /// Header digest (HDGST) on every PDU type that allows one.
    pub header: bool,
    /// Data digest (DDGST) on every PDU that carries data.
    pub data: bool,
}

impl Digests {
    /// Bytes of header digest.
    pub fn hd(self) -> usize {
        if self.header {
            4
        } else {
            0
        }
    }

    /// Bytes of data digest.
    pub fn dd(self) -> usize {
        if self.data {
            4
        } else {
            0
        }
    }
}

/// CRC32C as NVMe/TCP digests use it (§3.6.2.1; the crate applies the
/// standard initial value and final complement).
pub fn digest(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// ICReq fields (§3.6.2.2, Figure 13).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version (0).
    pub pfv: u16,
    /// Host PDU data alignment (0's based dwords).
    pub hpda: u8,
    /// Digests asked for: bit 0 header, bit 1 data.
    pub dgst: u8,
    /// Maximum outstanding R2Ts per command (0's based).
    pub maxr2t: u32,
}

impl IcReq {
    /// Decode and check the 128 bytes that must open a connection.
    pub fn parse(b: &[u8; IC_LEN]) -> Result<IcReq, Fatal> {
        let ch = CommonHeader::parse(b[..8].try_into().expect("8"));
        if ch.ptype != pdu_type::IC_REQ {
            return Err(Fatal::status(fes::SEQUENCE_ERROR));
        }
        if ch.hlen as usize != IC_LEN {
            return Err(Fatal::field(2));
        }
        if ch.pdo != 0 {
            return Err(Fatal::field(3));
        }
        if ch.plen as usize != IC_LEN {
            return Err(Fatal::field(4));
        }
        let req = IcReq {
            pfv: u16::from_le_bytes([b[8], b[9]]),
            hpda: b[10],
            dgst: b[11],
            maxr2t: u32::from_le_bytes(b[12..16].try_into().expect("4")),
        };
        if req.pfv != 0 {
            return Err(Fatal {
                fes: fes::UNSUPPORTED,
                fei: 8,
            });
        }
        if req.hpda > 31 {
            return Err(Fatal {
                fes: fes::UNSUPPORTED,
                fei: 10,
            });
        }
        Ok(req)
    }

    /// The digests asked for.
    pub fn digests(&self) -> Digests {
        Digests {
            header: self.dgst & 1 != 0,
            data: self.dgst & 2 != 0,
        }
    }

    /// Encode (a host's side; tests use it).
    pub fn encode(&self) -> [u8; IC_LEN] {
        let mut b = [0u8; IC_LEN];
        b[..8].copy_from_slice(
            &CommonHeader {
                ptype: pdu_type::IC_REQ,
                flags: 0,
                hlen: IC_LEN as u8,
                pdo: 0,
                plen: IC_LEN as u32,
            }
            .encode(),
        );
        b[8..10].copy_from_slice(&self.pfv.to_le_bytes());
        b[10] = self.hpda;
        b[11] = self.dgst;
        b[12..16].copy_from_slice(&self.maxr2t.to_le_bytes());
        b
    }
}

/// ICResp (§3.6.2.3, Figure 14): the digests granted (the ones asked for),
/// CPDA 0, and the largest H2CData PDU the controller takes.
pub fn ic_resp(d: Digests, max_h2c_data: u32) -> [u8; IC_LEN] {
    let mut b = [0u8; IC_LEN];
    b[..8].copy_from_slice(
        &CommonHeader {
            ptype: pdu_type::IC_RESP,
            flags: 0,
            hlen: IC_LEN as u8,
            pdo: 0,
            plen: IC_LEN as u32,
        }
        .encode(),
    );
    b[10] = 0; // CPDA
    b[11] = u8::from(d.header) | u8::from(d.data) << 1;
    b[12..16].copy_from_slice(&max_h2c_data.to_le_bytes());
    b
}

/// A header of `hlen` bytes from `body` (bytes 8.. of the header), with the
/// common header and, if negotiated, the header digest appended.
fn header(out: &mut BytesMut, ch: CommonHeader, body: &[u8], d: Digests) {
    let start = out.len();
    out.put_slice(&ch.encode());
    out.put_slice(body);
    debug_assert_eq!(out.len() - start, ch.hlen as usize);
    if d.header {
        let crc = digest(&out[start..]);
        out.put_u32_le(crc);
    }
}

/// CapsuleResp (§3.6.2.6) carrying a 16-byte CQE.
pub fn capsule_resp(out: &mut BytesMut, cqe: &[u8; 16], d: Digests) {
    let hd = d.hd() as u32;
    header(
        out,
        CommonHeader {
            ptype: pdu_type::CAPSULE_RESP,
            flags: if d.header { flags::HDGST } else { 0 },
            hlen: SHORT_HLEN,
            pdo: 0,
            plen: u32::from(SHORT_HLEN) + hd,
        },
        cqe,
        d,
    );
}

/// The header of a C2HData PDU (§3.6.2.8) for `len` bytes at `datao` of
/// command `cid`; the data (and its digest, [`digest`] of it, if
/// negotiated) follow it on the wire. Data starts right after the header:
/// the Linux host ignores PDO and HPDA is 0 there.
pub fn c2h_data_header(out: &mut BytesMut, cid: u16, datao: u32, len: u32, last: bool, d: Digests) {
    let hd = d.hd() as u32;
    let pdo = u32::from(SHORT_HLEN) + hd;
    let mut body = [0u8; 16];
    body[0..2].copy_from_slice(&cid.to_le_bytes());
    body[4..8].copy_from_slice(&datao.to_le_bytes());
    body[8..12].copy_from_slice(&len.to_le_bytes());
    let f = if d.header { flags::HDGST } else { 0 }
        | if d.data { flags::DDGST } else { 0 }
        | if last { flags::LAST_PDU } else { 0 };
    header(
        out,
        CommonHeader {
            ptype: pdu_type::C2H_DATA,
            flags: f,
            hlen: SHORT_HLEN,
            pdo: pdo as u8,
            plen: pdo + len + d.dd() as u32,
        },
        &body,
        d,
    );
}

/// R2T (§3.6.2.9): ask for `len` bytes at `offset` of command `cid`.
pub fn r2t(out: &mut BytesMut, cid: u16, ttag: u16, offset: u32, len: u32, d: Digests) {
    let mut body = [0u8; 16];
    body[0..2].copy_from_slice(&cid.to_le_bytes());
    body[2..4].copy_from_slice(&ttag.to_le_bytes());
    body[4..8].copy_from_slice(&offset.to_le_bytes());
    body[8..12].copy_from_slice(&len.to_le_bytes());
    header(
        out,
        CommonHeader {
            ptype: pdu_type::R2T,
            flags: if d.header { flags::HDGST } else { 0 },
            hlen: SHORT_HLEN,
            pdo: 0,
            plen: u32::from(SHORT_HLEN) + d.hd() as u32,
        },
        &body,
        d,
    );
}

/// C2HTermReq (§3.6.2.4): FES, FEI (at byte 10, per the specification and
/// SPDK), and up to 128 bytes of the offending header.
pub fn c2h_term_req(f: Fatal, offending: &[u8]) -> Bytes {
    let copy = &offending[..offending.len().min(128)];
    let mut out = BytesMut::with_capacity(24 + copy.len());
    out.put_slice(
        &CommonHeader {
            ptype: pdu_type::C2H_TERM_REQ,
            flags: 0,
            hlen: SHORT_HLEN,
            pdo: 0,
            plen: 24 + copy.len() as u32,
        }
        .encode(),
    );
    out.put_u16_le(f.fes);
    out.put_u32_le(f.fei);
    out.put_bytes(0, 10);
    out.put_slice(copy);
    out.freeze()
}

/// The fields of an H2CData header (§3.6.2.7).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct H2CData {
    /// The command's CID.
    pub cccid: u16,
    /// The R2T's transfer tag.
    pub ttag: u16,
    /// Offset into the command's data.
    pub datao: u32,
    /// Bytes in this PDU.
    pub datal: u32,
}

impl H2CData {
    /// Decode bytes 8..24 of an H2CData header.
    pub fn parse(b: &[u8]) -> H2CData {
        H2CData {
            cccid: u16::from_le_bytes([b[0], b[1]]),
            ttag: u16::from_le_bytes([b[2], b[3]]),
            datao: u32::from_le_bytes(b[4..8].try_into().expect("4")),
            datal: u32::from_le_bytes(b[8..12].try_into().expect("4")),
        }
    }
}

/// The header length a host-to-controller PDU type must have.
pub fn h2c_hlen(ptype: u8) -> Option<u8> {
    match ptype {
        pdu_type::CAPSULE_CMD => Some(CMD_HLEN),
        pdu_type::H2C_DATA | pdu_type::H2C_TERM_REQ => Some(SHORT_HLEN),
        _ => None,
    }
}

/// Check a host-to-controller common header against the connection's
/// digests and size limits (`max_data`: the most data this PDU type may
/// carry), before any of its bytes are allocated.
pub fn check_h2c_header(ch: &CommonHeader, d: Digests, max_data: u32) -> Result<(), Fatal> {
    if ch.ptype == pdu_type::IC_REQ {
        return Err(Fatal::status(fes::SEQUENCE_ERROR));
    }
    let Some(hlen) = h2c_hlen(ch.ptype) else {
        return Err(Fatal::field(0));
    };
    if ch.hlen != hlen {
        return Err(Fatal::field(2));
    }
    let term = ch.ptype == pdu_type::H2C_TERM_REQ;
    // A TermReq never has digests; everything else has the negotiated ones.
    let want_hd = d.header && !term;
    if (ch.flags & flags::HDGST != 0) != want_hd {
        return Err(Fatal::field(1));
    }
    let hd = if want_hd { 4 } else { 0 };
    let head = u32::from(hlen) + hd;
    if term {
        if ch.plen < u32::from(hlen) || ch.plen > u32::from(hlen) + 128 {
            return Err(Fatal::field(4));
        }
        return Ok(());
    }
    if ch.pdo == 0 {
        // No data: exactly the header.
        if ch.flags & flags::DDGST != 0 || ch.plen != head {
            return Err(Fatal::field(4));
        }
        if ch.ptype == pdu_type::H2C_DATA {
            return Err(Fatal::field(3));
        }
        return Ok(());
    }
    if (ch.flags & flags::DDGST != 0) != d.data {
        return Err(Fatal::field(1));
    }
    // CPDA 0: data may start right after the header (and digest), at a
    // dword boundary.
    if u32::from(ch.pdo) < head || ch.pdo % 4 != 0 {
        return Err(Fatal::field(3));
    }
    let dd = d.dd() as u32;
    let Some(data) = ch.plen.checked_sub(u32::from(ch.pdo) + dd) else {
        return Err(Fatal::field(4));
    };
    if data > max_data {
        return Err(Fatal::status(fes::LIMIT_EXCEEDED));
    }
    Ok(())
}

/// Where the parts of a checked host PDU lie, in bytes after its common
/// header: the rest of the header (with its digest), padding, data, data
/// digest. Every length here was bounded by [`check_h2c_header`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Header bytes after the common header, header digest included.
    pub rest_of_header: usize,
    /// Whether a header digest ends the header.
    pub header_digest: bool,
    /// Padding between the header and the data.
    pub pad: usize,
    /// Data bytes.
    pub data: usize,
    /// Whether a data digest follows the data.
    pub data_digest: bool,
    /// Bytes of a TermReq's copied header (read and dropped).
    pub trailer: usize,
}

/// Check a host PDU's common header ([`check_h2c_header`]) and lay it out.
pub fn h2c_layout(ch: &CommonHeader, d: Digests, max_data: u32) -> Result<Layout, Fatal> {
    check_h2c_header(ch, d, max_data)?;
    let term = ch.ptype == pdu_type::H2C_TERM_REQ;
    let hd = if d.header && !term { 4 } else { 0 };
    let head = ch.hlen as usize + hd;
    let mut l = Layout {
        rest_of_header: head - CH_LEN,
        header_digest: hd == 4,
        pad: 0,
        data: 0,
        data_digest: false,
        trailer: 0,
    };
    if term {
        l.trailer = ch.plen as usize - ch.hlen as usize;
    } else if ch.pdo != 0 {
        l.pad = ch.pdo as usize - head;
        l.data = ch.plen as usize - ch.pdo as usize - d.dd();
        l.data_digest = d.data;
    }
    Ok(l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_values() {
        // The reference's values: "123456789" and 4096 zero bytes.
        assert_eq!(digest(b"123456789"), 0xE306_9283);
        assert_eq!(digest(&[0u8; 4096]), 0x98F9_4189);
    }

    #[test]
    fn ic_resp_is_the_reference_bytes() {
        let b = ic_resp(Digests::default(), 0x40_0000);
        assert_eq!(
            &b[..16],
            &[1, 0, 0x80, 0, 0x80, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x40, 0]
        );
        assert!(b[16..].iter().all(|&x| x == 0));
        let req = IcReq::parse(
            &IcReq {
                pfv: 0,
                hpda: 0,
                dgst: 3,
                maxr2t: 0,
            }
            .encode(),
        )
        .unwrap();
        assert_eq!(
            req.digests(),
            Digests {
                header: true,
                data: true
            }
        );
    }

    #[test]
    fn header_digest_of_the_worked_example() {
        // §6.3 variant (b): the 4 KiB read capsule as printed there has the
        // header digest b6 94 1e 67 over its 72 bytes.
        let mut cap = [0u8; 72];
        cap[..8].copy_from_slice(&[0x04, 0x00, 0x48, 0x00, 0x48, 0, 0, 0]);
        cap[8..12].copy_from_slice(&[0x02, 0x40, 0x05, 0x10]);
        cap[12] = 1;
        cap[41] = 0x10;
        cap[47] = 0x5a;
        cap[56] = 7;
        assert_eq!(digest(&cap).to_le_bytes(), [0xb6, 0x94, 0x1e, 0x67]);
    }

    #[test]
    fn responses_and_r2t_have_their_lengths() {
        let d = Digests {
            header: true,
            data: true,
        };
        let mut b = BytesMut::new();
        capsule_resp(&mut b, &[0; 16], d);
        assert_eq!(b.len(), 28);
        assert_eq!(&b[..8], &[5, 1, 24, 0, 28, 0, 0, 0]);
        assert_eq!(
            u32::from_le_bytes(b[24..28].try_into().unwrap()),
            digest(&b[..24])
        );
        b.clear();
        c2h_data_header(&mut b, 0x1005, 0, 4096, true, Digests::default());
        assert_eq!(
            &b[..],
            &[
                7, 4, 24, 24, 0x18, 0x10, 0, 0, 5, 0x10, 0, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0,
                0
            ]
        );
        b.clear();
        r2t(&mut b, 1, 2, 0, 4096, Digests::default());
        assert_eq!(&b[..8], &[9, 0, 24, 0, 24, 0, 0, 0]);
        let t = c2h_term_req(Fatal::field(2), &[4, 0, 99, 0, 72, 0, 0, 0]);
        assert_eq!(t.len(), 32);
        assert_eq!(&t[8..14], &[1, 0, 2, 0, 0, 0]);
    }

    #[test]
    fn bad_headers_are_refused_before_allocation() {
        let d = Digests::default();
        let cmd = |hlen, pdo, plen, f| CommonHeader {
            ptype: pdu_type::CAPSULE_CMD,
            flags: f,
            hlen,
            pdo,
            plen,
        };
        assert!(check_h2c_header(&cmd(72, 0, 72, 0), d, 8192).is_ok());
        assert!(check_h2c_header(&cmd(72, 72, 72 + 8192, 0), d, 8192).is_ok());
        assert_eq!(
            check_h2c_header(&cmd(72, 72, u32::MAX, 0), d, 8192),
            Err(Fatal::status(fes::LIMIT_EXCEEDED))
        );
        assert_eq!(
            check_h2c_header(&cmd(70, 0, 70, 0), d, 8192),
            Err(Fatal::field(2))
        );
        assert_eq!(
            check_h2c_header(&cmd(72, 0, 72, flags::HDGST), d, 8192),
            Err(Fatal::field(1))
        );
        assert_eq!(
            check_h2c_header(&cmd(72, 72, 10, 0), d, 8192),
            Err(Fatal::field(4))
        );
        assert_eq!(
            check_h2c_header(&cmd(72, 73, 100, 0), d, 8192),
            Err(Fatal::field(3))
        );
        let mut ic = cmd(128, 0, 128, 0);
        ic.ptype = pdu_type::IC_REQ;
        assert_eq!(
            check_h2c_header(&ic, d, 8192),
            Err(Fatal::status(fes::SEQUENCE_ERROR))
        );
    }
}
