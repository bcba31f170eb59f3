//! The rdma:// side channel's decoders on arbitrary bytes, as a peer could
//! send them: PARAMS and control messages never panic; accepted PARAMS
//! encode to bytes that decode to the same value, and an accepted control
//! message encodes to exactly the kind and body it came from.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmx_transport_rdma::control::{Ctl, Params, PARAMS_LEN};

fuzz_target!(|data: &[u8]| {
    if let Ok(b) = <&[u8; PARAMS_LEN]>::try_from(data) {
        if let Ok(p) = Params::decode(b) {
            assert_eq!(Params::decode(&p.encode()).unwrap(), p);
        }
    }
    let _ = Params::check_header(data);
    if let Some((&kind, body)) = data.split_first() {
        if let Ok(m) = Ctl::decode(kind, body) {
            let mut again = Vec::new();
            m.encode(&mut again);
            assert_eq!(again[0], kind);
            assert_eq!(usize::from(again[1]), body.len());
            assert_eq!(&again[2..], body);
        }
    }
});
