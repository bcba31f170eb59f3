//! The RESP request decoder on arbitrary bytes, arriving in arbitrary
//! pieces: it never panics, never keeps more than it was given, and whatever
//! it decodes re-encodes to a request that decodes to the same arguments.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use rdmx_kv::resp::decode;

fuzz_target!(|data: &[u8]| {
    let Some((&cut, data)) = data.split_first() else {
        return;
    };
    let cut = (cut as usize).min(data.len());
    let mut buf = BytesMut::new();
    let mut given = 0;
    for piece in [&data[..cut], &data[cut..]] {
        buf.extend_from_slice(piece);
        given += piece.len();
        loop {
            match decode(&mut buf, 1 << 16) {
                Ok(Some(args)) => {
                    let mut wire = format!("*{}\r\n", args.len()).into_bytes();
                    for a in &args {
                        wire.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
                        wire.extend_from_slice(a);
                        wire.extend_from_slice(b"\r\n");
                    }
                    let mut again = BytesMut::from(&wire[..]);
                    if !args.is_empty() {
                        let back = decode(&mut again, 1 << 16).unwrap().unwrap();
                        assert_eq!(back, args);
                        assert!(again.is_empty());
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
        assert!(buf.len() <= given);
    }
});
