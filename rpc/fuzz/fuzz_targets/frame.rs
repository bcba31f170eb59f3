//! The rdmx-rpc frame and HELLO decoders on arbitrary bytes, as a peer could
//! send them: never a panic; an accepted frame encodes to exactly the
//! message it came from, and an accepted HELLO of this protocol version to
//! exactly its body.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rdmx_rpc::wire::{hello_body, parse_hello, Frame, VERSION};

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = Frame::decode(Bytes::copy_from_slice(data)) {
        assert_eq!(&f.encode()[..], data);
    }
    if let Ok(h) = parse_hello(data) {
        if h.proto == VERSION {
            assert_eq!(&hello_body(&h.service, h.version, &h.methods)[..], data);
        }
    }
});
