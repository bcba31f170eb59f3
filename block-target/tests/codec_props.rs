//! Property tests of the NVMe and NVMe/TCP codecs: encodings round-trip, and
//! whatever header a peer sends, the checker answers without panicking and
//! lays out only what fits in PLEN and the data limit.

use proptest::prelude::*;
use rdmx_block::nbd::proto::{InfoRequest, Request};
use rdmx_block::nvme::command::{Completion, Sgl, Sqe};
use rdmx_block::nvme::status::Status;
use rdmx_block::tcp::pdu::{self, CommonHeader, Digests, IcReq};

fn arb_sgl() -> impl Strategy<Value = Sgl> {
    (any::<u64>(), any::<u32>(), any::<u32>(), any::<u8>()).prop_map(|(addr, len, key, id)| {
        if id >> 4 == 4 {
            Sgl {
                addr,
                len: len & 0xFF_FFFF,
                key,
                id,
            }
        } else {
            Sgl {
                addr,
                len,
                key: 0,
                id,
            }
        }
    })
}

proptest! {
    #[test]
    fn sqe_round_trips(
        opcode: u8, flags: u8, cid: u16, nsid: u32, cdw2: u32, cdw3: u32, mptr: u64,
        sgl in arb_sgl(), cdw: [u32; 6],
    ) {
        let s = Sqe { opcode, flags, cid, nsid, cdw2, cdw3, mptr, sgl, cdw };
        prop_assert_eq!(Sqe::parse(&s.encode()), s);
    }

    #[test]
    fn any_64_bytes_parse_and_reencode_the_same_fields(b in proptest::collection::vec(any::<u8>(), 64)) {
        let s = Sqe::parse(b[..].try_into().unwrap());
        prop_assert_eq!(Sqe::parse(&s.encode()), s);
    }

    #[test]
    fn cqe_status_round_trips(sct in 0u8..8, sc: u8, dnr: bool, dw0: u32, sqhd: u16, cid: u16) {
        let st = Status { sct, sc, dnr };
        let c = Completion { dw0, status: st, ..Completion::default() }.cqe(sqhd, 1, cid);
        prop_assert_eq!(Status::from_cqe_word(u16::from_le_bytes([c[14], c[15]])), st);
        prop_assert_eq!(u16::from_le_bytes([c[8], c[9]]), sqhd);
        prop_assert_eq!(u16::from_le_bytes([c[12], c[13]]), cid);
    }

    #[test]
    fn host_headers_are_laid_out_within_plen(
        ch: [u8; 8], header: bool, data: bool, max in 0u32..(2 << 20),
    ) {
        let c = CommonHeader::parse(&ch);
        prop_assert_eq!(c.encode(), ch);
        if let Ok(l) = pdu::h2c_layout(&c, Digests { header, data }, max) {
            let total = 8 + l.rest_of_header + l.pad + l.data
                + 4 * usize::from(l.data_digest) + l.trailer;
            prop_assert_eq!(total, c.plen as usize);
            prop_assert!(l.data as u64 <= u64::from(max));
            prop_assert!(l.rest_of_header + 8 >= c.hlen as usize);
        }
    }

    #[test]
    fn nbd_request_round_trips(flags: u16, kind: u16, cookie: u64, offset: u64, length: u32) {
        let r = Request { flags, kind, cookie, offset, length };
        prop_assert_eq!(Request::parse(&r.encode()), Some(r));
    }

    #[test]
    fn nbd_info_request_round_trips(name in "[a-z0-9:]{0,40}", reqs in proptest::collection::vec(any::<u16>(), 0..8)) {
        let mut d = (name.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(name.as_bytes());
        d.extend_from_slice(&(reqs.len() as u16).to_be_bytes());
        for r in &reqs {
            d.extend_from_slice(&r.to_be_bytes());
        }
        let got = InfoRequest::parse(&d).unwrap();
        prop_assert_eq!(got.name, name);
        prop_assert_eq!(got.requests, reqs);
        // Any cut of it is refused, never misread.
        for cut in 0..d.len() {
            prop_assert!(InfoRequest::parse(&d[..cut]).is_none());
        }
    }

    #[test]
    fn icreq_round_trips(hpda in 0u8..32, dgst in 0u8..4, maxr2t: u32) {
        let r = IcReq { pfv: 0, hpda, dgst, maxr2t };
        prop_assert_eq!(IcReq::parse(&r.encode()), Ok(r));
    }
}
