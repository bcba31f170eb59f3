//! The bundle splitter (a SEND carrying several messages) on arbitrary
//! bytes: never panics, never hands out more than the bundle holds, and
//! whatever it accepts bundles again into the same bytes.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use rdmx_transport_rdma::bundle::{plan, split, Post, BUNDLE_MAX};

fuzz_target!(|data: &[u8]| {
    let payload = Bytes::copy_from_slice(data);
    let Ok(parts) = split(&payload) else {
        return;
    };
    assert!(!parts.is_empty() && payload.len() <= BUNDLE_MAX);
    let held: usize = parts.iter().map(|p| p.len() + 4).sum();
    assert_eq!(held, payload.len());
    // Planned again under a limit it fits, the parts make one bundle of the
    // same bytes, unless one of them is large enough to go alone.
    let posts = plan(parts.clone(), BUNDLE_MAX);
    if parts.len() >= 2
        && parts
            .iter()
            .all(|p| p.len() < rdmx_transport_rdma::bundle::PART_MAX)
    {
        assert_eq!(posts.len(), 1);
        match &posts[0] {
            Post::Bundle {
                payload: again,
                parts: n,
            } => {
                assert_eq!(*n, parts.len());
                assert_eq!(again, &payload);
            }
            Post::Single(_) => panic!("several small parts must bundle"),
        }
    }
});
