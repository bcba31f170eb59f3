//! Two-sided messages with credit-based flow control.
//!
//! `cargo run -p rdmx-transport-tcp --example messages`

use rdmx_core::{Options, Transport};
use rdmx_transport_tcp::TcpTransport;

#[tokio::main]
async fn main() -> rdmx_core::Result<()> {
    let tcp = TcpTransport::new();
    let mut listener = tcp.listen("127.0.0.1:0", &Options::default()).await?;
    let addr = listener.local_addr().to_string();

    let server = tokio::spawn(async move {
        let conn = listener.accept().await?;
        // Echo until the client closes.
        while let Ok(msg) = conn.recv_message().await {
            conn.send(msg).await?;
        }
        rdmx_core::Result::Ok(())
    });

    let conn = tcp.connect(&addr, &Options::default()).await?;
    println!(
        "connected over {} to {:?}",
        conn.transport(),
        conn.info().peer_addr
    );
    for word in ["hello", "rdmx", "world"] {
        conn.send(word.as_bytes().to_vec()).await?;
        let echo = conn.recv_message().await?;
        assert_eq!(&echo[..], word.as_bytes());
        println!("echoed {:?}", String::from_utf8_lossy(&echo));
    }
    conn.close().await?;
    server.await.expect("server task")?;
    println!("stats: {:?}", conn.stats());
    Ok(())
}
