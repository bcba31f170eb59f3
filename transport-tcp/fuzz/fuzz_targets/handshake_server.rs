//! The server side of the handshake fed arbitrary client bytes: never panics,
//! never hangs, and only a well-formed hello can succeed.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rdmx_transport_tcp::handshake::{self, Limits};
use tokio::io::AsyncWriteExt;

fuzz_target!(|data: &[u8]| {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
    rt.block_on(async {
        let (mut ours, mut theirs) = tokio::io::duplex(1 << 16);
        theirs.write_all(data).await.unwrap();
        drop(theirs.shutdown().await);
        let limits = Limits { credits: 16, window: 1 << 20, max_message: 1 << 18 };
        let res = handshake::server(&mut ours, limits, Some(b"k"), handshake::Speaks::Tcp).await;
        if res.is_ok() {
            assert!(data.len() >= 44 + 32 && &data[..4] == b"RDMX");
        }
    });
});
