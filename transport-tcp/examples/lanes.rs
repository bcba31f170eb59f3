//! One connection over four lanes (four TCP connections here; RC queue pairs
//! on the rdma transport): a large write and read split across them, and
//! each lane's share in its counters.
//!
//! `cargo run -p rdmx-transport-tcp --example lanes`

use rdmx_core::{Access, Options, Transports};
use rdmx_transport_tcp::TcpTransport;

#[tokio::main]
async fn main() -> rdmx_core::Result<()> {
    let transports = Transports::new().with(TcpTransport::new());
    let mut listener = transports
        .listen("tcp://127.0.0.1:0", &Options::default())
        .await?;
    let url = format!("tcp://{}", listener.local_addr());
    // The server takes as many lanes as the client asks for.
    let server = tokio::spawn(async move { listener.accept().await });

    let opts = Options {
        lanes: 4,
        ..Options::default()
    };
    let conn = transports.connect(&url, &opts).await?;
    let _server = server.await.expect("accept task")?;
    println!("{} lanes over {}", conn.info().lanes, conn.transport());

    // A region of this process, served to the peer: write 8 MiB into it
    // through the connection, then read it back.
    let mr = opts.domain.register(8 << 20, Access::ALL);
    let data: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
    conn.write(data.clone(), mr.remote()).await?; // whole: learns the range is writable
    conn.write(data.clone(), mr.remote()).await?; // split over the four lanes
    let back = conn.read(mr.remote()).await?;
    assert_eq!(back, data);
    for (i, s) in conn.lane_stats().iter().enumerate() {
        println!(
            "lane {i}: {} bytes sent, {} received",
            s.bytes_sent, s.bytes_received
        );
    }
    Ok(())
}
