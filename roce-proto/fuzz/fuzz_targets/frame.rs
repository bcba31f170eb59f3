//! The RoCEv2 frame decoder on arbitrary bytes: never panics; every frame it
//! accepts re-serialises to exactly the input; ICRC checking never panics; and
//! a finalized frame always verifies.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmx_roce_proto::RoceFrame;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some(mut f)) = RoceFrame::parse(data) {
        assert_eq!(f.to_bytes(), data);
        let _ = f.verify_icrc();
        f.finalize();
        f.verify_icrc().expect("a finalized frame verifies");
        let again = RoceFrame::parse(&f.to_bytes()).unwrap().unwrap();
        assert_eq!(again, f);
    }
});
