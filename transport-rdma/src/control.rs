//! The wire formats of an rdma:// connection's TCP side channel (see
//! `conn.rs` for the sequence): the PARAMS each side sends once its QP
//! exists, and the control messages that follow for the life of the
//! connection. Both come from a peer, so both decoders take any bytes and
//! answer with a value or a clear error (fuzzed: `fuzz/fuzz_targets/control.rs`).

use std::net::IpAddr;

use bytes::{Buf, BufMut};
use rdmx_core::{Error, Result};

use crate::verbs::QpTimers;

/// Version of the RDMA bootstrap (PARAMS and control messages).
pub const RDMA_VERSION: u16 = 2;
/// The first four bytes of PARAMS.
pub const PARAMS_MAGIC: &[u8; 4] = b"RDMA";
/// Bytes of a version-2 PARAMS.
pub const PARAMS_LEN: usize = 40;
/// PARAMS flag: the sender runs selective repeat (soft RoCE engines).
pub const FLAG_SR: u16 = 1;
/// The sender of these PARAMS takes bundles of messages (bundle.rs).
pub const FLAG_BUNDLES: u16 = 2;

/// What each side tells the other about its QP (the PARAMS message).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Params {
    /// Bootstrap version ([`RDMA_VERSION`]).
    pub version: u16,
    /// Runs selective repeat.
    pub selective_repeat: bool,
    /// Takes several messages in one SEND (bundle.rs).
    pub bundles: bool,
    /// The sender's QP number (24 bits).
    pub qpn: u32,
    /// The first PSN the sender's requester uses (24 bits).
    pub psn: u32,
    /// UDP port its RoCEv2 packets come from and go to (4791 on a NIC).
    pub udp_port: u16,
    /// Path MTU it offers (256, 512, 1024, 2048 or 4096).
    pub mtu: u32,
    /// Its GID, as an address (IPv4 when the GID is IPv4-mapped).
    pub gid: IpAddr,
    /// ACK timeout and retry counts it asks for.
    pub timers: QpTimers,
    /// READ/atomic requests this end keeps outstanding and serves
    /// outstanding (1..=255; the path takes the smaller of the two).
    pub max_rd_atomic: u8,
}

/// The READ/atomic depth of a version-2 peer built before PARAMS carried
/// one (its last byte was zero then, and both ends used this).
const LEGACY_MAX_RD_ATOMIC: u8 = 16;

impl Params {
    /// The 40 bytes on the wire.
    pub fn encode(&self) -> [u8; PARAMS_LEN] {
        let mut b = Vec::with_capacity(PARAMS_LEN);
        b.put_slice(PARAMS_MAGIC);
        b.put_u16_le(self.version);
        let flags = if self.selective_repeat { FLAG_SR } else { 0 }
            | if self.bundles { FLAG_BUNDLES } else { 0 };
        b.put_u16_le(flags);
        b.put_u32_le(self.qpn);
        b.put_u32_le(self.psn);
        b.put_u16_le(self.udp_port);
        b.put_u16_le(self.mtu as u16);
        let gid = match self.gid {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        b.put_slice(&gid.octets());
        b.put_u8(self.timers.timeout);
        b.put_u8(self.timers.retry_cnt);
        b.put_u8(self.timers.rnr_retry);
        b.put_u8(self.max_rd_atomic);
        b.try_into().expect("40 bytes")
    }

    /// Check magic and version (the first 6 bytes).
    pub fn check_header(b: &[u8]) -> Result<u16> {
        if b.len() < 6 {
            return Err(Error::Protocol(format!(
                "RDMA bootstrap parameters of {} bytes",
                b.len()
            )));
        }
        if &b[..4] != PARAMS_MAGIC {
            return Err(Error::Protocol(
                "the peer did not answer with RDMA bootstrap parameters (it is not an rdmx rdma:// endpoint)".into(),
            ));
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != RDMA_VERSION {
            return Err(Error::VersionMismatch {
                local: RDMA_VERSION,
                peer: version,
            });
        }
        Ok(version)
    }

    /// Parse a peer's PARAMS: wrong magic, another version, an MTU or
    /// timers outside their ranges are errors.
    pub fn decode(b: &[u8; PARAMS_LEN]) -> Result<Params> {
        let version = Self::check_header(&b[..6])?;
        let mut r = &b[6..];
        let flags = r.get_u16_le();
        let qpn = r.get_u32_le() & 0xFF_FFFF;
        let psn = r.get_u32_le() & 0xFF_FFFF;
        let udp_port = r.get_u16_le();
        let mtu = u32::from(r.get_u16_le());
        let mut g = [0u8; 16];
        r.copy_to_slice(&mut g);
        if !matches!(mtu, 256 | 512 | 1024 | 2048 | 4096) {
            return Err(Error::Protocol(format!("peer offered path MTU {mtu}")));
        }
        let timers = QpTimers {
            timeout: r.get_u8(),
            retry_cnt: r.get_u8(),
            rnr_retry: r.get_u8(),
        };
        if timers.timeout > 31 || timers.retry_cnt > 7 || timers.rnr_retry > 7 {
            return Err(Error::Protocol(format!(
                "peer offered QP timers {timers:?}"
            )));
        }
        let max_rd_atomic = match r.get_u8() {
            0 => LEGACY_MAX_RD_ATOMIC,
            n => n,
        };
        Ok(Params {
            version,
            selective_repeat: flags & FLAG_SR != 0,
            bundles: flags & FLAG_BUNDLES != 0,
            qpn,
            psn,
            udp_port,
            mtu,
            gid: IpAddr::V6(g.into()).to_canonical(),
            timers,
            max_rd_atomic,
        })
    }
}

/// Control-channel messages (after the bootstrap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ctl {
    /// The sender is closing the connection.
    Close,
    /// Receives re-posted: the sender may SEND this many more messages and bytes.
    Credit {
        /// Messages.
        msgs: u32,
        /// Bytes.
        bytes: u64,
    },
    /// A one-sided access was NAKed as refused: why? (The NAK does not say.)
    Classify {
        /// The asker's id for the question.
        id: u64,
        /// R_Key the access used.
        rkey: u32,
        /// Its remote address.
        addr: u64,
        /// Its length.
        len: u64,
        /// The access it needed (`rdmx_core::Access` bits).
        need: u8,
    },
    /// The answer to [`Ctl::Classify`].
    Classified {
        /// The question's id.
        id: u64,
        /// `rdmx_core::AccessError` code; 0 when the access is allowed by now.
        code: u8,
    },
    /// Client → server: replace the QP that went to ERROR with a new one.
    Reset {
        /// Reset generation (one more than the last).
        gen: u32,
        /// The sender's new QP number.
        qpn: u32,
        /// Its first PSN.
        psn: u32,
        /// The PSN its old responder expected next (what it executed).
        epsn: u32,
    },
    /// Server → client: the reset is done; its new QP.
    ResetAck {
        /// The generation answered.
        gen: u32,
        /// The server's new QP number.
        qpn: u32,
        /// Its first PSN.
        psn: u32,
        /// The PSN its old responder expected next.
        epsn: u32,
    },
    /// Server → client: my QP went to ERROR; please start a reset.
    NeedReset {
        /// The generation the server is at.
        gen: u32,
    },
}

impl Ctl {
    /// Append kind, body length and body to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.put_u8(0);
        out.put_u8(0);
        match *self {
            Ctl::Close => out[start] = 1,
            Ctl::Credit { msgs, bytes } => {
                out[start] = 2;
                out.put_u32_le(msgs);
                out.put_u64_le(bytes);
            }
            Ctl::Classify {
                id,
                rkey,
                addr,
                len,
                need,
            } => {
                out[start] = 3;
                out.put_u64_le(id);
                out.put_u32_le(rkey);
                out.put_u64_le(addr);
                out.put_u64_le(len);
                out.put_u8(need);
            }
            Ctl::Classified { id, code } => {
                out[start] = 4;
                out.put_u64_le(id);
                out.put_u8(code);
            }
            Ctl::Reset {
                gen,
                qpn,
                psn,
                epsn,
            }
            | Ctl::ResetAck {
                gen,
                qpn,
                psn,
                epsn,
            } => {
                out[start] = if matches!(self, Ctl::Reset { .. }) {
                    5
                } else {
                    6
                };
                out.put_u32_le(gen);
                out.put_u32_le(qpn);
                out.put_u32_le(psn);
                out.put_u32_le(epsn);
            }
            Ctl::NeedReset { gen } => {
                out[start] = 7;
                out.put_u32_le(gen);
            }
        }
        out[start + 1] = (out.len() - start - 2) as u8;
    }

    /// Parse the body of a message of `kind` (the first byte on the wire;
    /// the second is the body's length, which the reader used).
    pub fn decode(kind: u8, mut b: &[u8]) -> Result<Ctl> {
        let need = |n: usize, b: &[u8]| {
            if b.len() == n {
                Ok(())
            } else {
                Err(Error::Protocol(format!(
                    "control message {kind} has {} bytes, expected {n}",
                    b.len()
                )))
            }
        };
        Ok(match kind {
            1 => {
                need(0, b)?;
                Ctl::Close
            }
            2 => {
                need(12, b)?;
                Ctl::Credit {
                    msgs: b.get_u32_le(),
                    bytes: b.get_u64_le(),
                }
            }
            3 => {
                need(29, b)?;
                Ctl::Classify {
                    id: b.get_u64_le(),
                    rkey: b.get_u32_le(),
                    addr: b.get_u64_le(),
                    len: b.get_u64_le(),
                    need: b.get_u8(),
                }
            }
            4 => {
                need(9, b)?;
                Ctl::Classified {
                    id: b.get_u64_le(),
                    code: b.get_u8(),
                }
            }
            5 | 6 => {
                need(16, b)?;
                let (gen, qpn, psn, epsn) = (
                    b.get_u32_le(),
                    b.get_u32_le(),
                    b.get_u32_le(),
                    b.get_u32_le(),
                );
                if kind == 5 {
                    Ctl::Reset {
                        gen,
                        qpn,
                        psn,
                        epsn,
                    }
                } else {
                    Ctl::ResetAck {
                        gen,
                        qpn,
                        psn,
                        epsn,
                    }
                }
            }
            7 => {
                need(4, b)?;
                Ctl::NeedReset {
                    gen: b.get_u32_le(),
                }
            }
            k => return Err(Error::Protocol(format!("unknown control message {k}"))),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn any_params() -> impl Strategy<Value = Params> {
        (
            (
                any::<bool>(),
                any::<bool>(),
                0u32..1 << 24,
                0u32..1 << 24,
                any::<u16>(),
            ),
            prop::sample::select(vec![256u32, 512, 1024, 2048, 4096]),
            prop_oneof![
                any::<[u8; 4]>().prop_map(IpAddr::from),
                any::<[u8; 16]>().prop_map(|a| IpAddr::from(a).to_canonical()),
            ],
            (0u8..=31, 0u8..=7, 0u8..=7, 1u8..=255),
        )
            .prop_map(
                |((sr, bundles, qpn, psn, udp_port), mtu, gid, (t, r, rnr, depth))| Params {
                    version: RDMA_VERSION,
                    selective_repeat: sr,
                    bundles,
                    qpn,
                    psn,
                    udp_port,
                    mtu,
                    gid,
                    timers: QpTimers {
                        timeout: t,
                        retry_cnt: r,
                        rnr_retry: rnr,
                    },
                    max_rd_atomic: depth,
                },
            )
    }

    fn any_ctl() -> impl Strategy<Value = Ctl> {
        prop_oneof![
            Just(Ctl::Close),
            (any::<u32>(), any::<u64>()).prop_map(|(msgs, bytes)| Ctl::Credit { msgs, bytes }),
            (
                any::<u64>(),
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
                any::<u8>()
            )
                .prop_map(|(id, rkey, addr, len, need)| Ctl::Classify {
                    id,
                    rkey,
                    addr,
                    len,
                    need
                }),
            (any::<u64>(), any::<u8>()).prop_map(|(id, code)| Ctl::Classified { id, code }),
            any::<[u32; 4]>().prop_map(|[gen, qpn, psn, epsn]| Ctl::Reset {
                gen,
                qpn,
                psn,
                epsn
            }),
            any::<[u32; 4]>().prop_map(|[gen, qpn, psn, epsn]| Ctl::ResetAck {
                gen,
                qpn,
                psn,
                epsn
            }),
            any::<u32>().prop_map(|gen| Ctl::NeedReset { gen }),
        ]
    }

    proptest! {
        /// Every valid PARAMS comes back as it went.
        #[test]
        fn any_params_round_trip(p in any_params()) {
            prop_assert_eq!(Params::decode(&p.encode()).unwrap(), p);
        }

        /// A peer's 40 bytes: a value or an error, never a panic; what is
        /// accepted encodes to bytes that decode to the same value (flags
        /// this version does not know, and bits above a 24-bit QPN or PSN,
        /// are dropped).
        #[test]
        fn any_forty_bytes_decode_or_fail_cleanly(mut b in any::<[u8; PARAMS_LEN]>(), genuine: bool) {
            if genuine {
                b[..4].copy_from_slice(PARAMS_MAGIC);
                b[4..6].copy_from_slice(&RDMA_VERSION.to_le_bytes());
                b[18..20].copy_from_slice(&1024u16.to_le_bytes());
                b[36] %= 32;
                b[37] %= 8;
                b[38] %= 8;
                prop_assert!(Params::decode(&b).is_ok());
            }
            if let Ok(p) = Params::decode(&b) {
                prop_assert_eq!(Params::decode(&p.encode()).unwrap(), p);
            }
        }

        /// Every control message comes back as it went, and its length
        /// byte counts its body.
        #[test]
        fn any_control_message_round_trips(m in any_ctl()) {
            let mut b = vec![0xAA];
            m.encode(&mut b);
            prop_assert_eq!(usize::from(b[2]), b.len() - 3);
            prop_assert_eq!(Ctl::decode(b[1], &b[3..]).unwrap(), m);
        }

        /// Any kind and body: a message or an error; what is accepted is
        /// exactly those bytes again.
        #[test]
        fn any_control_bytes_decode_or_fail_cleanly(kind: u8, body in prop::collection::vec(any::<u8>(), 0..40)) {
            if let Ok(m) = Ctl::decode(kind, &body) {
                let mut b = Vec::new();
                m.encode(&mut b);
                prop_assert_eq!(b[0], kind);
                prop_assert_eq!(&b[2..], &body[..]);
            }
        }
    }

    #[test]
    fn a_short_header_is_an_error() {
        let whole = [b'R', b'D', b'M', b'A', 2, 0];
        assert_eq!(Params::check_header(&whole).unwrap(), RDMA_VERSION);
        for n in 0..whole.len() {
            assert!(matches!(
                Params::check_header(&whole[..n]),
                Err(Error::Protocol(_))
            ));
        }
    }

    #[test]
    fn params_round_trip_and_reject() {
        let p = Params {
            version: RDMA_VERSION,
            selective_repeat: true,
            bundles: true,
            qpn: 0x12345,
            psn: 0xABCDEF,
            udp_port: 4791,
            mtu: 4096,
            gid: "198.18.0.1".parse().unwrap(),
            timers: QpTimers {
                timeout: 14,
                retry_cnt: 6,
                rnr_retry: 7,
            },
            max_rd_atomic: 128,
        };
        let b = p.encode();
        assert_eq!(b[39], 128, "the depth is the last byte");
        assert_eq!(Params::decode(&b).unwrap(), p);
        let mut legacy = b;
        legacy[39] = 0;
        assert_eq!(
            Params::decode(&legacy).unwrap().max_rd_atomic,
            LEGACY_MAX_RD_ATOMIC,
            "a peer that sent no depth used 16"
        );
        let mut bad = b;
        bad[0] = b'X';
        assert!(matches!(Params::decode(&bad), Err(Error::Protocol(_))));
        let mut v1 = b;
        v1[4] = 1;
        assert!(matches!(
            Params::decode(&v1),
            Err(Error::VersionMismatch { local: 2, peer: 1 })
        ));
        assert!(matches!(
            Params::check_header(&v1[..6]),
            Err(Error::VersionMismatch { local: 2, peer: 1 })
        ));
        let mut mtu = b;
        mtu[18..20].copy_from_slice(&1500u16.to_le_bytes());
        assert!(matches!(Params::decode(&mtu), Err(Error::Protocol(_))));
        for (at, v) in [(36, 32u8), (37, 8), (38, 8)] {
            let mut t = b;
            t[at] = v;
            assert!(
                matches!(Params::decode(&t), Err(Error::Protocol(_))),
                "{at}"
            );
        }
    }

    #[test]
    fn control_messages_round_trip() {
        let all = [
            Ctl::Close,
            Ctl::Credit {
                msgs: 7,
                bytes: 1 << 40,
            },
            Ctl::Classify {
                id: 9,
                rkey: 0xdead,
                addr: u64::MAX,
                len: 5,
                need: 4,
            },
            Ctl::Classified { id: 9, code: 3 },
            Ctl::Reset {
                gen: 1,
                qpn: 2,
                psn: 3,
                epsn: 4,
            },
            Ctl::ResetAck {
                gen: 5,
                qpn: 6,
                psn: 7,
                epsn: 8,
            },
            Ctl::NeedReset { gen: 9 },
        ];
        for m in all {
            let mut b = Vec::new();
            m.encode(&mut b);
            assert_eq!(usize::from(b[1]), b.len() - 2);
            assert_eq!(Ctl::decode(b[0], &b[2..]).unwrap(), m);
            // Truncated bodies and unknown kinds are clear errors.
            if b.len() > 2 {
                assert!(Ctl::decode(b[0], &b[2..b.len() - 1]).is_err());
            }
        }
        assert!(Ctl::decode(99, &[]).is_err());
    }
}
