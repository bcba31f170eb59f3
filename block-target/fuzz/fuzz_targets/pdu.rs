//! NVMe/TCP host PDU headers: whatever the bytes, the checker answers (no
//! panic), and what it admits is laid out within PLEN and the data limit.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmx_block::tcp::pdu::{self, CommonHeader, Digests, H2CData, IcReq};

fuzz_target!(|data: &[u8]| {
    if data.len() < 9 {
        return;
    }
    let d = Digests {
        header: data[0] & 1 != 0,
        data: data[0] & 2 != 0,
    };
    let ch = CommonHeader::parse(data[1..9].try_into().unwrap());
    let max = 8192;
    if let Ok(l) = pdu::h2c_layout(&ch, d, max) {
        let total = 8 + l.rest_of_header + l.pad + l.data + 4 * usize::from(l.data_digest) + l.trailer;
        assert_eq!(total, ch.plen as usize);
        assert!(l.data <= max as usize);
    }
    let rest = &data[9..];
    if rest.len() >= 16 {
        let _ = H2CData::parse(&rest[..16]);
    }
    if rest.len() >= pdu::IC_LEN {
        if let Ok(r) = IcReq::parse(rest[..pdu::IC_LEN].try_into().unwrap()) {
            assert_eq!(IcReq::parse(&r.encode()), Ok(r));
        }
    }
});
