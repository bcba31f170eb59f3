//! The frame header decoder on arbitrary bytes: never panics, and whatever it
//! accepts re-encodes to the same bytes and respects the limits.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmx_transport_tcp::frame::{Header, Kind, HEADER_LEN, MAX_PIECE};

fuzz_target!(|data: &[u8]| {
    let max_message = 1 << 20;
    if let Ok(h) = Header::decode(data, max_message) {
        assert!(data.len() >= HEADER_LEN);
        assert_eq!(&h.encode()[..], &data[..HEADER_LEN]);
        let len = u64::from(h.payload_len);
        match h.kind {
            Kind::Send => assert!(len <= max_message),
            Kind::Write | Kind::Resp => assert!(len <= MAX_PIECE),
            _ => assert_eq!(len, 0),
        }
    }
});
