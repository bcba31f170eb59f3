//! An NBD export of an rdmx namespace from a Rust program: a target with a
//! RAM namespace, the Initiator connected to it over the TCP transport or
//! soft RoCE, and `rdmx_block::nbd::serve` in front of the Initiator.
//!
//! ```text
//! cargo run -p rdmx-block --example nbd_export                 # tcp://, checks itself
//! cargo run -p rdmx-block --example nbd_export -- rdma         # rdma:// (soft RoCE)
//! cargo run -p rdmx-block --example nbd_export -- tcp 127.0.0.1:10809
//!     # serves until Ctrl-C: qemu-img info nbd://127.0.0.1:10809/rdmx
//! ```
//!
//! Without an address it checks itself by speaking NBD as a client would
//! (NBD `doc/proto.md`: fixed newstyle handshake, NBD_OPT_GO, then simple
//! replies): it writes 1 MiB, flushes, reads it back and compares, and
//! prints the export's counters (what `rdmx block nbd --metrics` serves).

use std::sync::Arc;

use rdmx_block::backend::RamBackend;
use rdmx_block::fabric::{Initiator, InitiatorConfig};
use rdmx_block::nbd::proto::{self, cmd, opt, Request};
use rdmx_block::nbd::{NbdConfig, NbdStats};
use rdmx_block::target::{Target, TargetConfig};
use rdmx_core::{Options, Transports};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NQN: &str = "nqn.2026-11.io.rdmx:example";
const SIZE: u64 = 64 << 20;

fn transports() -> Transports {
    Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new())
}

type Error = Box<dyn std::error::Error>;

/// The client side of the handshake: flags, then NBD_OPT_GO for the export
/// "rdmx" with no information requests; the export's size from its INFO.
async fn go(s: &mut TcpStream) -> Result<u64, Error> {
    let mut hello = [0u8; 18];
    s.read_exact(&mut hello).await?;
    if hello[..8] != proto::NBDMAGIC.to_be_bytes() || hello[8..16] != proto::IHAVEOPT.to_be_bytes()
    {
        return Err("not a fixed-newstyle NBD server".into());
    }
    s.write_all(&proto::CLIENT_NO_ZEROES.to_be_bytes()).await?;
    let name = b"rdmx";
    let mut o = Vec::new();
    o.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
    o.extend_from_slice(&opt::GO.to_be_bytes());
    o.extend_from_slice(&(4 + name.len() as u32 + 2).to_be_bytes());
    o.extend_from_slice(&(name.len() as u32).to_be_bytes());
    o.extend_from_slice(name);
    o.extend_from_slice(&0u16.to_be_bytes());
    s.write_all(&o).await?;
    let mut size = None;
    loop {
        // Option reply: magic, option, type, length, data.
        let mut h = [0u8; 20];
        s.read_exact(&mut h).await?;
        let kind = u32::from_be_bytes(h[12..16].try_into()?);
        let mut data = vec![0u8; u32::from_be_bytes(h[16..20].try_into()?) as usize];
        s.read_exact(&mut data).await?;
        match kind {
            proto::rep::ACK => break,
            proto::rep::INFO if data.len() >= 10 && data[..2] == [0, 0] => {
                size = Some(u64::from_be_bytes(data[2..10].try_into()?));
            }
            proto::rep::INFO => {}
            other => return Err(format!("NBD_OPT_GO refused: reply type {other:#x}").into()),
        }
    }
    size.ok_or_else(|| "no export size in the INFO replies".into())
}

/// One request and its simple reply; the reply's data if `read` bytes come.
async fn request(
    s: &mut TcpStream,
    r: Request,
    payload: &[u8],
    read: usize,
) -> Result<Vec<u8>, Error> {
    s.write_all(&r.encode()).await?;
    s.write_all(payload).await?;
    let mut h = [0u8; 16];
    s.read_exact(&mut h).await?;
    let error = u32::from_be_bytes(h[4..8].try_into()?);
    if h[..4] != proto::SIMPLE_REPLY_MAGIC.to_be_bytes() || h[8..16] != r.cookie.to_be_bytes() {
        return Err("a reply out of step".into());
    }
    if error != 0 {
        return Err(format!("request {} failed: NBD error {error}", r.kind).into());
    }
    let mut data = vec![0u8; read];
    s.read_exact(&mut data).await?;
    Ok(data)
}

async fn check_itself(at: std::net::SocketAddr, stats: &NbdStats) -> Result<(), Error> {
    let mut s = TcpStream::connect(at).await?;
    let size = go(&mut s).await?;
    println!("NBD client: export \"rdmx\" of {size} bytes");
    let data: Vec<u8> = (0..1u32 << 20)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    let at_offset = size / 2;
    let req = |kind, cookie, length| Request {
        flags: 0,
        kind,
        cookie,
        offset: at_offset,
        length,
    };
    let len = data.len() as u32;
    request(&mut s, req(cmd::WRITE, 1, len), &data, 0).await?;
    request(&mut s, req(cmd::FLUSH, 2, 0), &[], 0).await?;
    let back = request(&mut s, req(cmd::READ, 3, len), &[], data.len()).await?;
    s.write_all(&req(cmd::DISC, 4, 0).encode()).await?;
    if back != data {
        return Err("the export read back other bytes".into());
    }
    println!(
        "NBD client: wrote, flushed and read back {} bytes at {at_offset}: equal",
        data.len()
    );
    let mut text = String::new();
    stats.render(&mut text);
    for line in text.lines().filter(|l| {
        l.starts_with("rdmx_nbd_requests_total") && !l.ends_with(" 0")
            || l.starts_with("rdmx_nbd_bytes_total") && !l.ends_with(" 0")
            || l.starts_with("rdmx_nbd_latency_seconds_count")
    }) {
        println!("export: {line}");
    }
    if stats.bytes(cmd::READ) != data.len() as u64 || stats.bytes(cmd::WRITE) != data.len() as u64 {
        return Err("the export's counters disagree with what was sent".into());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let mut args = std::env::args().skip(1);
    let scheme = args.next().unwrap_or_else(|| "tcp".into());
    let serve_at = args.next();

    let target = Target::new(TargetConfig {
        nqn: NQN.into(),
        ..TargetConfig::default()
    });
    target.add_namespace(Arc::new(RamBackend::new(SIZE)?))?;
    let listener = transports()
        .listen(&format!("{scheme}://127.0.0.1:0"), &Options::default())
        .await?;
    let url = format!("{scheme}://{}", listener.local_addr());
    tokio::spawn(rdmx_block::fabric::serve(listener, target));
    let dev = Initiator::connect(
        &transports(),
        &url,
        InitiatorConfig {
            nqn: NQN.into(),
            ..InitiatorConfig::default()
        },
    )
    .await?;
    let (transport, provider) = dev.transport();
    println!("Initiator: {url} over {transport} ({provider})");

    let nbd = TcpListener::bind(serve_at.as_deref().unwrap_or("127.0.0.1:0")).await?;
    let at = nbd.local_addr()?;
    let cfg = NbdConfig::default();
    let stats = cfg.stats.clone();
    let server = tokio::spawn(rdmx_block::nbd::serve(nbd, Arc::new(dev), cfg));
    println!("NBD export: nbd://{at}/rdmx");
    if serve_at.is_some() {
        return Ok(server.await?);
    }
    check_itself(at, &stats).await?;
    println!("ok");
    Ok(())
}
