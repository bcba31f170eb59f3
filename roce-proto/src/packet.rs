//! The InfiniBand transport packet carried in UDP: BTH, extension headers,
//! payload and pad (rocev2-reference §2–§4, §8). All fields big-endian.
//!
//! Decoding keeps every bit as received (reserved fields, pad bytes), so a
//! decoded packet encodes back to the same bytes.

use std::ops::Range;
use std::sync::Arc;

use bytes::{BufMut, Bytes};

use crate::memory::PayloadSource;
use crate::opcode::Opcode;

/// BTH length.
pub const BTH_LEN: usize = 12;
/// ICRC length.
pub const ICRC_LEN: usize = 4;

/// Base transport header (rocev2-reference §2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bth {
    /// Opcode (byte 0).
    pub opcode: Opcode,
    /// Solicited event (byte 1 bit 7).
    pub se: bool,
    /// MigReq (byte 1 bit 6); NICs differ, receivers ignore it.
    pub migreq: bool,
    /// Pad bytes before the ICRC (byte 1 bits 5:4).
    pub pad_count: u8,
    /// Transport header version (byte 1 bits 3:0), always 0.
    pub tver: u8,
    /// Partition key (bytes 2–3).
    pub pkey: u16,
    /// Forward ECN (byte 4 bit 7).
    pub fecn: bool,
    /// Backward ECN (byte 4 bit 6), set in CNPs.
    pub becn: bool,
    /// Reserved (byte 4 bits 5:0), kept as received.
    pub resv6a: u8,
    /// Destination QP number (24 bits).
    pub dest_qp: u32,
    /// Acknowledge request (byte 8 bit 7).
    pub ack_req: bool,
    /// Reserved (byte 8 bits 6:0), kept as received.
    pub resv7: u8,
    /// Packet sequence number (24 bits).
    pub psn: u32,
}

impl Bth {
    /// A BTH with the defaults real NICs send: P_Key 0xFFFF, everything else 0.
    pub fn new(opcode: Opcode, dest_qp: u32, psn: u32) -> Bth {
        Bth {
            opcode,
            se: false,
            migreq: false,
            pad_count: 0,
            tver: 0,
            pkey: 0xFFFF,
            fecn: false,
            becn: false,
            resv6a: 0,
            dest_qp: dest_qp & 0x00FF_FFFF,
            ack_req: false,
            resv7: 0,
            psn: psn & 0x00FF_FFFF,
        }
    }

    fn decode(b: &[u8]) -> Bth {
        Bth {
            opcode: Opcode(b[0]),
            se: b[1] & 0x80 != 0,
            migreq: b[1] & 0x40 != 0,
            pad_count: (b[1] >> 4) & 3,
            tver: b[1] & 0x0F,
            pkey: u16::from_be_bytes([b[2], b[3]]),
            fecn: b[4] & 0x80 != 0,
            becn: b[4] & 0x40 != 0,
            resv6a: b[4] & 0x3F,
            dest_qp: u32::from_be_bytes([0, b[5], b[6], b[7]]),
            ack_req: b[8] & 0x80 != 0,
            resv7: b[8] & 0x7F,
            psn: u32::from_be_bytes([0, b[9], b[10], b[11]]),
        }
    }

    fn encode(&self, out: &mut Vec<u8>) {
        out.put_u8(self.opcode.0);
        out.put_u8(
            (self.se as u8) << 7
                | (self.migreq as u8) << 6
                | (self.pad_count & 3) << 4
                | (self.tver & 0x0F),
        );
        out.put_u16(self.pkey);
        out.put_u32(
            (self.fecn as u32) << 31
                | (self.becn as u32) << 30
                | u32::from(self.resv6a & 0x3F) << 24
                | (self.dest_qp & 0x00FF_FFFF),
        );
        out.put_u32(
            (self.ack_req as u32) << 31
                | u32::from(self.resv7 & 0x7F) << 24
                | (self.psn & 0x00FF_FFFF),
        );
    }
}

/// Datagram extended transport header of UD packets (IBTA 9.3.3): the
/// receiver's Q_Key and the sender's QP.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deth {
    /// Queue key.
    pub qkey: u32,
    /// Reserved byte, kept as received.
    pub resv8: u8,
    /// Source QP number (24 bits).
    pub src_qp: u32,
}

/// RDMA extended transport header: target of a WRITE or READ (rocev2-reference §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reth {
    /// Remote virtual address.
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Total length of the message (DMA length).
    pub dma_len: u32,
}

/// ACK extended transport header (rocev2-reference §4, §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Aeth {
    /// Syndrome: bits 6:5 type (ACK, RNR NAK, NAK), bits 4:0 value.
    pub syndrome: u8,
    /// Message sequence number (24 bits).
    pub msn: u32,
}

/// What an AETH syndrome says (rocev2-reference §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Syndrome {
    /// Positive acknowledgement with a credit count code (0x1F: unlimited/invalid).
    Ack {
        /// Credit count code.
        credits: u8,
    },
    /// Receiver not ready; retry after the timer code's delay.
    RnrNak {
        /// RNR timer code (see [`rnr_delay_us`]).
        timer: u8,
    },
    /// Negative acknowledgement.
    Nak(NakCode),
    /// The reserved type (0x40).
    Reserved(u8),
}

/// NAK codes (rocev2-reference §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NakCode {
    /// 0x60: PSN sequence error; the requester retransmits from the NAK's PSN.
    PsnSequenceError,
    /// 0x61: invalid request.
    InvalidRequest,
    /// 0x62: remote access error (R_Key, range, rights).
    RemoteAccessError,
    /// 0x63: remote operational error.
    RemoteOperationalError,
    /// Another value.
    Other(u8),
}

impl Aeth {
    /// The syndrome, decoded.
    pub fn kind(&self) -> Syndrome {
        let value = self.syndrome & 0x1F;
        match self.syndrome & 0x60 {
            0x00 => Syndrome::Ack { credits: value },
            0x20 => Syndrome::RnrNak { timer: value },
            0x60 => Syndrome::Nak(match value {
                0 => NakCode::PsnSequenceError,
                1 => NakCode::InvalidRequest,
                2 => NakCode::RemoteAccessError,
                3 => NakCode::RemoteOperationalError,
                v => NakCode::Other(v),
            }),
            _ => Syndrome::Reserved(self.syndrome),
        }
    }
}

/// RNR NAK timer code → microseconds to wait (rocev2-reference §5, rxe `rnrnak_usec`).
pub fn rnr_delay_us(code: u8) -> u32 {
    const TABLE: [u32; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1280, 1920, 2560, 3840,
        5120, 7680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880, 163_840,
        245_760, 327_680, 491_520,
    ];
    TABLE[(code & 0x1F) as usize]
}

/// Atomic extended transport header (rocev2-reference §4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtomicEth {
    /// Remote virtual address (8-byte aligned).
    pub va: u64,
    /// Remote key.
    pub rkey: u32,
    /// Swap value (compare-and-swap) or addend (fetch-and-add).
    pub swap_add: u64,
    /// Compare value (compare-and-swap).
    pub compare: u64,
}

/// A payload that stays in registered memory until its packet is sent: a
/// range of a [`PayloadSource`] (several packets of one READ response share
/// the source).
#[derive(Clone, Debug)]
pub struct Deferred {
    /// The memory.
    pub source: Arc<dyn PayloadSource>,
    /// This packet's bytes of it.
    pub range: Range<usize>,
}

impl PartialEq for Deferred {
    fn eq(&self, other: &Deferred) -> bool {
        Arc::ptr_eq(&self.source, &other.source) && self.range == other.range
    }
}

impl Eq for Deferred {}

/// A decoded transport packet (BTH through pad; the ICRC is handled by [`crate::icrc`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Packet {
    /// Base transport header.
    pub bth: Bth,
    /// DETH, for UD packets.
    pub deth: Option<Deth>,
    /// RETH, for WRITE FIRST/ONLY and READ REQUEST.
    pub reth: Option<Reth>,
    /// AtomicETH, for COMPARE_SWAP and FETCH_ADD.
    pub atomic_eth: Option<AtomicEth>,
    /// AETH, for ACK, ATOMIC_ACK and READ RESPONSE FIRST/LAST/ONLY.
    pub aeth: Option<Aeth>,
    /// Original remote value, for ATOMIC_ACKNOWLEDGE.
    pub atomic_ack: Option<u64>,
    /// Immediate data.
    pub imm: Option<u32>,
    /// R_Key to invalidate.
    pub ieth: Option<u32>,
    /// The 16 reserved bytes of a CNP, kept as received.
    pub cnp_reserved: Option<[u8; 16]>,
    /// Payload (without pad).
    pub payload: Bytes,
    /// A payload still in memory, read when the packet is sent (a READ
    /// response's data, when [`crate::Memory::read_source`] gives one);
    /// `payload` is then empty. Decoded packets never have one.
    pub deferred: Option<Deferred>,
    /// Pad bytes as received (`bth.pad_count` of them; zero when we send).
    pub pad: [u8; 3],
}

/// Why transport bytes are not a valid packet.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Too short for the BTH, the opcode's headers, pad and ICRC.
    #[error("packet of {len} bytes is too short for {opcode} (needs {need})")]
    Truncated {
        /// The opcode.
        opcode: Opcode,
        /// Bytes present.
        len: usize,
        /// Bytes needed.
        need: usize,
    },
    /// An opcode this codec does not know.
    #[error("unknown opcode {0:?}")]
    UnknownOpcode(Opcode),
    /// TVer is not 0.
    #[error("transport header version {0} (must be 0)")]
    BadTver(u8),
    /// An opcode that carries no payload has bytes after its headers.
    #[error("{opcode} carries {len} unexpected payload bytes")]
    UnexpectedPayload {
        /// The opcode.
        opcode: Opcode,
        /// Stray bytes.
        len: usize,
    },
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_be_bytes(b[o..o + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], o: usize) -> u64 {
    u64::from_be_bytes(b[o..o + 8].try_into().expect("8 bytes"))
}

impl Packet {
    /// A packet with `bth` and nothing else (set the headers its opcode needs).
    pub fn new(bth: Bth) -> Packet {
        Packet {
            bth,
            deth: None,
            reth: None,
            atomic_eth: None,
            aeth: None,
            atomic_ack: None,
            imm: None,
            ieth: None,
            cnp_reserved: None,
            payload: Bytes::new(),
            deferred: None,
            pad: [0; 3],
        }
    }

    /// Length of the payload, deferred or not (without pad).
    pub fn payload_len(&self) -> usize {
        self.deferred
            .as_ref()
            .map_or(self.payload.len(), |d| d.range.len())
    }

    /// Decode transport bytes (BTH … pad), *without* the trailing ICRC. The
    /// payload is copied out of `b`.
    pub fn decode(b: &[u8]) -> Result<Packet, DecodeError> {
        Packet::decode_with(b, |r| Bytes::copy_from_slice(&b[r]))
    }

    /// [`Packet::decode`] of bytes already in a [`Bytes`]: the payload is a
    /// slice of `b`, not a copy (a receive buffer's datagram goes to the
    /// engine without being copied first; whoever keeps the payload keeps
    /// the buffer).
    pub fn decode_shared(b: &Bytes) -> Result<Packet, DecodeError> {
        Packet::decode_with(b, |r| b.slice(r))
    }

    /// [`Packet::decode_shared`] of the bytes of `b` in `within` (one
    /// datagram of a receive buffer that holds several, its ICRC left
    /// out), without a [`Bytes`] of its own for them: the payload is the
    /// one slice taken. A range past the end of `b` is cut at the end.
    pub fn decode_shared_in(
        b: &Bytes,
        within: std::ops::Range<usize>,
    ) -> Result<Packet, DecodeError> {
        let end = within.end.min(b.len());
        let start = within.start.min(end);
        Packet::decode_with(&b[start..end], |r| b.slice(start + r.start..start + r.end))
    }

    fn decode_with(
        b: &[u8],
        payload: impl FnOnce(std::ops::Range<usize>) -> Bytes,
    ) -> Result<Packet, DecodeError> {
        if b.len() < BTH_LEN {
            return Err(DecodeError::Truncated {
                opcode: Opcode(b.first().copied().unwrap_or(0)),
                len: b.len(),
                need: BTH_LEN,
            });
        }
        let bth = Bth::decode(b);
        let layout = bth
            .opcode
            .layout()
            .ok_or(DecodeError::UnknownOpcode(bth.opcode))?;
        if bth.tver != 0 {
            return Err(DecodeError::BadTver(bth.tver));
        }
        let need = BTH_LEN + layout.ext_len() + bth.pad_count as usize;
        if b.len() < need {
            return Err(DecodeError::Truncated {
                opcode: bth.opcode,
                len: b.len(),
                need,
            });
        }
        let mut p = Packet::new(bth);
        let mut o = BTH_LEN;
        // Wire order (rocev2-reference §3): DETH | RETH | AtomicETH | AETH | AtomicAckETH | ImmDt | IETH.
        if layout.deth {
            p.deth = Some(Deth {
                qkey: u32_at(b, o),
                resv8: b[o + 4],
                src_qp: u32_at(b, o + 4) & 0x00FF_FFFF,
            });
            o += 8;
        }
        if layout.reth {
            p.reth = Some(Reth {
                va: u64_at(b, o),
                rkey: u32_at(b, o + 8),
                dma_len: u32_at(b, o + 12),
            });
            o += 16;
        }
        if layout.atomic_eth {
            p.atomic_eth = Some(AtomicEth {
                va: u64_at(b, o),
                rkey: u32_at(b, o + 8),
                swap_add: u64_at(b, o + 12),
                compare: u64_at(b, o + 20),
            });
            o += 28;
        }
        if layout.aeth {
            let w = u32_at(b, o);
            p.aeth = Some(Aeth {
                syndrome: (w >> 24) as u8,
                msn: w & 0x00FF_FFFF,
            });
            o += 4;
        }
        if layout.atomic_ack_eth {
            p.atomic_ack = Some(u64_at(b, o));
            o += 8;
        }
        if layout.imm {
            p.imm = Some(u32_at(b, o));
            o += 4;
        }
        if layout.ieth {
            p.ieth = Some(u32_at(b, o));
            o += 4;
        }
        if layout.cnp {
            p.cnp_reserved = Some(b[o..o + 16].try_into().expect("16 bytes"));
            o += 16;
        }
        let end = b.len() - bth.pad_count as usize;
        if !layout.payload && end > o {
            return Err(DecodeError::UnexpectedPayload {
                opcode: bth.opcode,
                len: end - o,
            });
        }
        p.payload = payload(o..end);
        p.pad[..bth.pad_count as usize].copy_from_slice(&b[end..]);
        Ok(p)
    }

    /// Transport bytes (BTH … pad) without the ICRC. The BTH's `pad_count` is
    /// written as stored; use [`Packet::finish`] to set it from the payload.
    pub fn encode(&self, out: &mut Vec<u8>) {
        self.encode_headers(out);
        match &self.deferred {
            Some(d) => d.source.append_to(d.range.clone(), out),
            None => out.put_slice(&self.payload),
        }
        out.put_slice(self.pad_bytes());
    }

    /// Append the headers (BTH and extended headers) without the payload
    /// and pad: with [`Packet::payload`] and [`Packet::pad_bytes`] after
    /// them, the bytes [`Packet::encode`] writes (for gathered sends that
    /// do not copy the payload).
    pub fn encode_headers(&self, out: &mut Vec<u8>) {
        self.bth.encode(out);
        if let Some(d) = &self.deth {
            out.put_u32(d.qkey);
            out.put_u32(u32::from(d.resv8) << 24 | (d.src_qp & 0x00FF_FFFF));
        }
        if let Some(r) = &self.reth {
            out.put_u64(r.va);
            out.put_u32(r.rkey);
            out.put_u32(r.dma_len);
        }
        if let Some(a) = &self.atomic_eth {
            out.put_u64(a.va);
            out.put_u32(a.rkey);
            out.put_u64(a.swap_add);
            out.put_u64(a.compare);
        }
        if let Some(a) = &self.aeth {
            out.put_u32(u32::from(a.syndrome) << 24 | (a.msn & 0x00FF_FFFF));
        }
        if let Some(v) = self.atomic_ack {
            out.put_u64(v);
        }
        if let Some(v) = self.imm {
            out.put_u32(v);
        }
        if let Some(v) = self.ieth {
            out.put_u32(v);
        }
        if let Some(r) = &self.cnp_reserved {
            out.put_slice(r);
        }
    }

    /// The pad bytes after the payload (`pad_count` of them).
    pub fn pad_bytes(&self) -> &[u8] {
        &self.pad[..usize::from(self.bth.pad_count).min(3)]
    }

    /// Set `pad_count` for the payload (rocev2-reference §8: `(−len) & 3`) with zero pad.
    pub fn finish(&mut self) {
        self.bth.pad_count = (self.payload_len().wrapping_neg() & 3) as u8;
        self.pad = [0; 3];
    }

    /// Encoded length without the ICRC.
    pub fn encoded_len(&self) -> usize {
        BTH_LEN
            + self.bth.opcode.layout().map_or(0, |l| l.ext_len())
            + self.payload_len()
            + self.bth.pad_count as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_packet() -> impl Strategy<Value = Packet> {
        (
            proptest::sample::select(Opcode::ALL),
            any::<(bool, bool, u16, bool, bool, u32, bool, u32)>(),
            any::<(u64, u32, u32, u64, u64, u8, u32)>(),
            proptest::collection::vec(any::<u8>(), 0..300),
        )
            .prop_map(
                |(
                    op,
                    (se, m, pkey, fecn, becn, qp, a, psn),
                    (va, rkey, len, x, y, syn, imm),
                    data,
                )| {
                    let mut bth = Bth::new(op, qp, psn);
                    (
                        bth.se,
                        bth.migreq,
                        bth.pkey,
                        bth.fecn,
                        bth.becn,
                        bth.ack_req,
                    ) = (se, m, pkey, fecn, becn, a);
                    let l = op.layout().unwrap();
                    let mut p = Packet::new(bth);
                    p.deth = l.deth.then_some(Deth {
                        qkey: rkey,
                        resv8: syn,
                        src_qp: imm & 0xFF_FFFF,
                    });
                    p.reth = l.reth.then_some(Reth {
                        va,
                        rkey,
                        dma_len: len,
                    });
                    p.atomic_eth = l.atomic_eth.then_some(AtomicEth {
                        va,
                        rkey,
                        swap_add: x,
                        compare: y,
                    });
                    p.aeth = l.aeth.then_some(Aeth {
                        syndrome: syn,
                        msn: imm & 0xFF_FFFF,
                    });
                    p.atomic_ack = l.atomic_ack_eth.then_some(x);
                    p.imm = l.imm.then_some(imm);
                    p.ieth = l.ieth.then_some(rkey);
                    p.cnp_reserved = l.cnp.then_some([0; 16]);
                    if l.payload {
                        p.payload = Bytes::from(data);
                    }
                    p.finish();
                    p
                },
            )
    }

    proptest! {
        #[test]
        fn roundtrip(p in arb_packet()) {
            let mut b = Vec::new();
            p.encode(&mut b);
            prop_assert_eq!(b.len(), p.encoded_len());
            prop_assert_eq!(b.len() % 4, 0, "pad makes the packet 4-byte aligned");
            let d = Packet::decode(&b).unwrap();
            prop_assert_eq!(&d, &p);
            let mut again = Vec::new();
            d.encode(&mut again);
            prop_assert_eq!(&again, &b);
            // The shared decode gives the same packet, its payload a slice
            // of the buffer decoded (behind the headers, not a copy).
            let shared = Bytes::from(b);
            let s = Packet::decode_shared(&shared).unwrap();
            prop_assert_eq!(&s, &p);
            if !s.payload.is_empty() {
                let at = s.payload.as_ptr() as usize - shared.as_ptr() as usize;
                prop_assert!(at + s.payload.len() <= shared.len());
                prop_assert_eq!(&shared[at..at + s.payload.len()], &p.payload[..]);
            }
        }

        /// A packet amid other bytes (a datagram of a GRO buffer, its
        /// ICRC behind it) decodes in place as it does alone, its payload
        /// a slice of the buffer at the packet's own place.
        #[test]
        fn decodes_in_place_within_a_buffer(
            p in arb_packet(),
            before in proptest::collection::vec(any::<u8>(), 0..64),
            after in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut b = before.clone();
            p.encode(&mut b);
            let end = b.len();
            b.extend_from_slice(&after);
            let shared = Bytes::from(b);
            let s = Packet::decode_shared_in(&shared, before.len()..end).unwrap();
            prop_assert_eq!(&s, &p);
            if !s.payload.is_empty() {
                let at = s.payload.as_ptr() as usize - shared.as_ptr() as usize;
                prop_assert!(at >= before.len() && at + s.payload.len() <= end);
            }
            // Cut short, it fails as the shorter buffer alone would.
            let short = before.len()..end - 1;
            prop_assert_eq!(
                Packet::decode_shared_in(&shared, short.clone()).is_ok(),
                Packet::decode(&shared[short]).is_ok()
            );
        }

        #[test]
        fn arbitrary_bytes_never_panic(b in proptest::collection::vec(any::<u8>(), 0..128)) {
            if let Ok(p) = Packet::decode(&b) {
                let mut again = Vec::new();
                p.encode(&mut again);
                prop_assert_eq!(again, b);
            }
        }
    }

    #[test]
    fn syndromes() {
        let k = |s| {
            Aeth {
                syndrome: s,
                msn: 0,
            }
            .kind()
        };
        assert_eq!(k(0x1F), Syndrome::Ack { credits: 31 });
        assert_eq!(k(0x2E), Syndrome::RnrNak { timer: 14 });
        assert_eq!(rnr_delay_us(14), 1280);
        assert_eq!(k(0x60), Syndrome::Nak(NakCode::PsnSequenceError));
        assert_eq!(k(0x62), Syndrome::Nak(NakCode::RemoteAccessError));
        assert_eq!(k(0x40), Syndrome::Reserved(0x40));
    }

    #[test]
    fn refusals() {
        assert!(matches!(
            Packet::decode(&[0; 5]),
            Err(DecodeError::Truncated { .. })
        ));
        let mut b = vec![0u8; 12];
        b[0] = 0x15;
        assert_eq!(
            Packet::decode(&b),
            Err(DecodeError::UnknownOpcode(Opcode(0x15)))
        );
        b[0] = 0x11; // ACK needs an AETH
        assert!(matches!(
            Packet::decode(&b),
            Err(DecodeError::Truncated { need: 16, .. })
        ));
        b[1] = 0x01; // TVer 1
        assert_eq!(Packet::decode(&b), Err(DecodeError::BadTver(1)));
        let mut ack = vec![0x11, 0, 0xff, 0xff, 0, 0, 0, 1, 0, 0, 0, 1, 0x1f, 0, 0, 0];
        ack.extend_from_slice(&[1, 2]);
        assert_eq!(
            Packet::decode(&ack),
            Err(DecodeError::UnexpectedPayload {
                opcode: Opcode::ACKNOWLEDGE,
                len: 2
            })
        );
    }
}
