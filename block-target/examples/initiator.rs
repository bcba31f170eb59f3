//! NVMe over rdmx from a Rust program: a target with a RAM namespace and the
//! Initiator, in one process, over the TCP transport or soft RoCE.
//!
//! ```text
//! cargo run -p rdmx-block --example initiator            # tcp://
//! cargo run -p rdmx-block --example initiator -- rdma    # rdma:// (soft RoCE)
//! ```
//!
//! The Initiator writes 4 MiB as 64 KiB commands, 32 in flight over two
//! queues (the target pulls each one's data with a one-sided READ), flushes,
//! reads it all back (the target pushes it with one-sided WRITEs) and
//! compares CRC32C checksums; then zeroes and trims a range and checks it
//! reads as zeros. It prints the target's per-operation counters. A
//! mismatch exits with an error.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::stream::{self, StreamExt, TryStreamExt};
use rdmx_block::backend::RamBackend;
use rdmx_block::fabric::{Initiator, InitiatorConfig};
use rdmx_block::metrics::IoOp;
use rdmx_block::target::{Target, TargetConfig};
use rdmx_core::{Options, Transports};

const NQN: &str = "nqn.2026-11.io.rdmx:example";
const NAMESPACE: u64 = 64 << 20;
const CHUNK: usize = 64 << 10;
const CHUNKS: u64 = 64;

fn transports() -> Transports {
    Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new())
}

/// The bytes of chunk `i`: a multiplicative hash of each byte's position
/// in the namespace, so that no two chunks (or blocks) are alike.
fn chunk(i: u64) -> Bytes {
    let base = i * CHUNK as u64;
    let byte = |j: u64| ((base + j).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8;
    (0..CHUNK as u64).map(byte).collect::<Vec<u8>>().into()
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scheme = std::env::args().nth(1).unwrap_or_else(|| "tcp".into());
    let target = Target::new(TargetConfig {
        nqn: NQN.into(),
        ..TargetConfig::default()
    });
    target.add_namespace(Arc::new(RamBackend::new(NAMESPACE)?))?;
    let listener = transports()
        .listen(&format!("{scheme}://127.0.0.1:0"), &Options::default())
        .await?;
    let url = format!("{scheme}://{}", listener.local_addr());
    tokio::spawn(rdmx_block::fabric::serve(listener, target.clone()));

    let dev = Initiator::connect(
        &transports(),
        &url,
        InitiatorConfig {
            nqn: NQN.into(),
            queues: 2,
            queue_depth: 32,
            ..InitiatorConfig::default()
        },
    )
    .await?;
    let (transport, provider) = dev.transport();
    println!(
        "connected to {url} over {transport} ({provider}): {} blocks of {} B, {} queues",
        dev.blocks(),
        dev.block_size(),
        dev.queues()
    );
    let per_chunk = (CHUNK / dev.block_size() as usize) as u64;

    let data: Vec<Bytes> = (0..CHUNKS).map(chunk).collect();
    let written = data.iter().fold(0, |c, b| crc32c::crc32c_append(c, b));
    let t = Instant::now();
    stream::iter(data.into_iter().enumerate())
        .map(|(i, d)| dev.write(i as u64 * per_chunk, d, false))
        .buffered(32)
        .try_collect::<Vec<()>>()
        .await?;
    dev.flush().await?;
    let w = t.elapsed();

    let t = Instant::now();
    let back: Vec<Bytes> = stream::iter(0..CHUNKS)
        .map(|i| dev.read(i * per_chunk, per_chunk as u32))
        .buffered(32)
        .try_collect()
        .await?;
    let r = t.elapsed();
    let read = back.iter().fold(0, |c, b| crc32c::crc32c_append(c, b));
    let mb = (CHUNKS * CHUNK as u64) as f64 / 1e6;
    println!(
        "wrote {mb:.1} MB in {:.1} ms, read it back in {:.1} ms: crc32c {written:08x} / {read:08x}",
        w.as_secs_f64() * 1e3,
        r.as_secs_f64() * 1e3
    );
    if read != written {
        return Err("the data read back differs from the data written".into());
    }

    // Write Zeroes on the first chunk, deallocate the second: zeros either way.
    dev.write_zeroes(0, per_chunk as u32, false).await?;
    dev.trim(per_chunk, per_chunk as u32).await?;
    let z = dev.read(0, 2 * per_chunk as u32).await?;
    if z.iter().any(|&b| b != 0) {
        return Err("zeroed and trimmed blocks do not read as zeros".into());
    }
    let third = dev.read(2 * per_chunk, per_chunk as u32).await?;
    if third != chunk(2) {
        return Err("a block next to the trimmed range changed".into());
    }

    let s = &target.namespaces()[0].stats;
    for op in [IoOp::Read, IoOp::Write] {
        println!(
            "target: {op:?} {} commands, {} bytes",
            s.ops(op),
            s.bytes(op)
        );
    }
    dev.close().await?;
    println!("ok");
    Ok(())
}
