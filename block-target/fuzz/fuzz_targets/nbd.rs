//! NBD decoders: transmission requests and the INFO/GO and meta context
//! option data. Any bytes: an answer, no panic; what decodes re-encodes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmx_block::nbd::proto::{InfoRequest, MetaRequest, Request};

fuzz_target!(|data: &[u8]| {
    if data.len() >= Request::LEN {
        if let Some(r) = Request::parse(data[..Request::LEN].try_into().unwrap()) {
            assert_eq!(Request::parse(&r.encode()), Some(r));
        }
    }
    if let Some(i) = InfoRequest::parse(data) {
        assert!(i.name.len() <= data.len() * 3);
        assert!(i.requests.len() * 2 <= data.len());
    }
    if let Some(m) = MetaRequest::parse(data) {
        assert!(m.queries.len() * 4 <= data.len());
    }
});
