//! A server the way rdmx servers are written: `Listener::serve` accepts and
//! spawns a handler per connection (a failed handshake is logged and counted,
//! and accepting goes on), regions travel with `send_region`/`recv_region`,
//! and `rdmx_core::metrics::serve` exports every counter as Prometheus text.
//!
//! `cargo run -p rdmx-transport-tcp --example server`

use rdmx_core::{Access, Options, Transports};
use rdmx_transport_tcp::TcpTransport;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::main]
async fn main() -> rdmx_core::Result<()> {
    let ts = Transports::new().with(TcpTransport::new());
    let listener = ts.listen("tcp://127.0.0.1:0", &Options::default()).await?;
    let url = format!("tcp://{}", listener.local_addr());
    let metrics = rdmx_core::metrics::serve("127.0.0.1:0", None).await?;
    tokio::spawn(listener.serve("example", |conn| async move {
        // Lend each client a counter and keep it until the client leaves.
        let mr = conn.domain().register(8, Access::ALL);
        conn.send_region(&mr).await?;
        conn.recv_message().await?; // "done"
        println!("server: the counter reads {}", mr.load_u64(0));
        Ok(())
    }));

    // Something that is not an rdmx client: refused and counted; the server goes on.
    let mut junk = tokio::net::TcpStream::connect(&url["tcp://".len()..])
        .await
        .expect("connect");
    junk.write_all(b"GET / HTTP/1.0\r\n\r\n")
        .await
        .expect("write");

    let conn = ts.connect(&url, &Options::default()).await?;
    let counter = conn.recv_region().await?;
    for _ in 0..5 {
        conn.fetch_and_add(counter, 1).await?;
    }
    conn.send(&b"done"[..]).await?;
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;

    let mut http = tokio::net::TcpStream::connect(metrics)
        .await
        .expect("metrics");
    http.write_all(b"GET /metrics HTTP/1.1\r\n\r\n")
        .await
        .expect("write");
    let mut text = String::new();
    http.read_to_string(&mut text).await.expect("read");
    for line in text.lines().filter(|l| {
        l.starts_with("rdmx_atomics_total")
            || l.starts_with("rdmx_accept_errors_total")
            || l.starts_with("rdmx_connections_open")
    }) {
        println!("metrics: {line}");
    }
    Ok(())
}
