//! A receiver that takes each large message as it arrives gets them in the
//! same few pooled buffers: the connection's reader lets it run between
//! messages, instead of reading ahead into a fresh (cache-cold) buffer for
//! each one while the receiver waits its turn. (A test binary of its own:
//! the buffer pool is per process, and other tests' buffers would mix in.)

use std::collections::HashSet;
use std::sync::Arc;

use bytes::Bytes;
use rdmx_conformance::{pattern, Suite};
use rdmx_transport_tcp::TcpTransport;

#[tokio::test(flavor = "current_thread")]
async fn a_prompt_receiver_gets_large_messages_in_the_same_few_buffers() {
    const MESSAGES: usize = 48;
    const LEN: usize = 384 << 10;
    let pair = Suite::new(Arc::new(TcpTransport::new()), "127.0.0.1:0")
        .pair()
        .await;
    // Every message queued at once (the credits allow 18 MiB), so the
    // socket always holds more than one for the reader to run ahead into.
    let client = pair.client.clone();
    let sender = tokio::spawn(async move {
        for i in 0..MESSAGES {
            client
                .send(Bytes::from(pattern(i as u64, LEN)))
                .await
                .expect("send");
        }
    });
    let mut buffers = HashSet::new();
    for i in 0..MESSAGES {
        let m = pair.server.recv_message().await.expect("recv");
        assert!(m == pattern(i as u64, LEN), "message {i} arrived changed");
        buffers.insert(m.as_ptr() as usize);
    }
    sender.await.expect("sender");
    assert!(
        buffers.len() <= 4,
        "{MESSAGES} messages taken one by one arrived in {} distinct buffers",
        buffers.len()
    );
}
