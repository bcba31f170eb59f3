//! Choosing a transport at run time from a URL, with a policy, and seeing
//! which transport a connection really uses and why.
//!
//! `cargo run -p rdmx-transport-tcp --example fallback`

use rdmx_core::{Options, Policy, Transports};
use rdmx_transport_tcp::TcpTransport;

#[tokio::main]
async fn main() -> rdmx_core::Result<()> {
    // A program links in the transports it wants; this one only has TCP.
    let transports = Transports::new().with(TcpTransport::new());
    let mut listener = transports
        .listen("rdma://127.0.0.1:0", &Options::default())
        .await?;
    println!(
        "listening on {} over {} (fallback: {:?})",
        listener.local_addr(),
        listener.transport(),
        listener.fallback_reason()
    );
    let url = format!("rdma://{}", listener.local_addr());
    tokio::spawn(async move {
        // Keep accepted connections open for the life of the program.
        let mut open = Vec::new();
        while let Ok(c) = listener.accept().await {
            open.push(c);
        }
    });

    let conn = transports.connect(&url, &Options::default()).await?;
    println!(
        "prefer RDMA -> {} because {:?}",
        conn.transport(),
        conn.fallback_reason()
    );

    let strict = Options {
        policy: Policy::RequireRdma,
        ..Options::default()
    };
    match transports.connect(&url, &strict).await {
        Ok(_) => println!("require RDMA -> connected"),
        Err(e) => println!("require RDMA -> {e}"),
    }
    println!(
        "fallbacks so far: {}",
        rdmx_core::stats::global().snapshot().fallbacks
    );
    Ok(())
}
