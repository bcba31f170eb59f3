//! Serve one RAM namespace over NVMe/TCP, with a discovery controller.
//!
//! ```text
//! cargo run -p rdmx-block --example nvme_tcp_ram -- 0.0.0.0 64m
//! nvme discover -t tcp -a 127.0.0.1 -s 8009
//! nvme connect -t tcp -a 127.0.0.1 -s 4420 -n nqn.2026-11.io.rdmx:block
//! ```

use std::sync::Arc;

use rdmx_block::backend::RamBackend;
use rdmx_block::target::{Target, TargetConfig};

#[tokio::main]
async fn main() -> std::io::Result<()> {
    // RDMX_LOG=debug shows every failed command and why a connection ended.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RDMX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let mut args = std::env::args().skip(1);
    let ip = args.next().unwrap_or_else(|| "127.0.0.1".into());
    let mib: u64 = args
        .next()
        .and_then(|s| s.trim_end_matches('m').parse().ok())
        .unwrap_or(64);
    let target = Target::new(TargetConfig::default());
    target
        .add_namespace(Arc::new(RamBackend::new(mib << 20)?))
        .expect("namespace");
    let io = tokio::net::TcpListener::bind((ip.as_str(), 4420)).await?;
    let disc = tokio::net::TcpListener::bind((ip.as_str(), 8009)).await?;
    println!(
        "serving {} ({mib} MiB) on {ip}:4420, discovery on 8009",
        target.nqn()
    );
    tokio::spawn(rdmx_block::tcp::serve(disc, target.clone(), false));
    rdmx_block::tcp::serve(io, target, true).await;
    Ok(())
}
