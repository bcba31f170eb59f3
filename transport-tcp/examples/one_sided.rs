//! One-sided remote memory access: the server registers a region and tells the
//! client its descriptor; the client then writes, reads and runs atomics on it
//! with no server code involved, and sends a burst of writes each followed by
//! a message announcing it (`write_then_send_many`), and reads several
//! places as one unit (`read_many`).
//!
//! `cargo run -p rdmx-transport-tcp --example one_sided`

use bytes::Bytes;
use rdmx_core::{Access, Incoming, Options, RemoteRegion, Transport, WriteThenSend};

// Keep `region` alive for as long as the client uses its key: dropping the
// MemoryRegion deregisters it (see the end of this example).
use rdmx_transport_tcp::TcpTransport;

#[tokio::main]
async fn main() -> rdmx_core::Result<()> {
    let tcp = TcpTransport::new();
    let server_opts = Options::default();
    let region = server_opts.domain.register(4096, Access::ALL);
    let mut listener = tcp.listen("127.0.0.1:0", &server_opts).await?;
    let addr = listener.local_addr().to_string();

    let client = tcp.connect(&addr, &Options::default()).await?;
    let server = listener.accept().await?;
    // Tell the client where the region is (any channel works; here, a message).
    server.send_region(&region).await?;

    let remote = client.recv_region().await?;
    client
        .write(&b"written remotely"[..], remote.slice(0, 16)?)
        .await?;
    let back = client.read(remote.slice(0, 16)?).await?;
    println!("read back: {:?}", String::from_utf8_lossy(&back));

    let counter = remote.word(64)?;
    for _ in 0..10 {
        client.fetch_and_add(counter, 1).await?;
    }
    let old = client.compare_and_swap(counter, 10, 100).await?;
    println!("counter was {old}, now {}", region.load_u64(64));

    // Write-with-immediate: the server learns that the write landed.
    client
        .write_with_imm(&b"ping"[..], remote.slice(128, 4)?, 42)
        .await?;
    if let Incoming::WriteImm { imm, len } = server.recv().await? {
        println!("server notified: imm {imm}, {len} bytes at offset 128");
    }

    // Data, then the message that announces it, for a burst at once (a
    // storage target answering reads): every WRITE goes first, and each
    // message arrives only after its data is in place.
    let burst = (0..4u64)
        .map(|i| -> rdmx_core::Result<WriteThenSend> {
            Ok(WriteThenSend {
                dst: remote.slice(256 + i * 16, 16)?,
                data: Bytes::from(format!("block {i}, payload")),
                msg: Bytes::from(format!("block {i} ready")),
            })
        })
        .collect::<rdmx_core::Result<Vec<_>>>()?;
    client.write_then_send_many(burst).await?;
    for _ in 0..4 {
        let note = server.recv_message().await?;
        println!("server: {}", String::from_utf8_lossy(&note));
    }

    // Several reads as one unit (a multi-key lookup): their requests leave
    // together, and the data comes back in the order asked.
    let blocks = (0..4u64)
        .rev()
        .map(|i| remote.slice(256 + i * 16, 16))
        .collect::<rdmx_core::Result<Vec<_>>>()?;
    for data in client.read_many(blocks).await? {
        println!("read_many: {}", String::from_utf8_lossy(&data));
    }
    println!(
        "the blocks, in place: {:?}",
        String::from_utf8_lossy(&region.read()[256..320])
    );

    // Wrong key, out of bounds, or deregistered: a clear error, memory untouched.
    let tail = client.read(remote.slice(4090, 6)?).await?;
    println!(
        "the region's last 6 bytes (4090..4096) are inside it: read {} bytes",
        tail.len()
    );
    let beyond = RemoteRegion {
        len: 4097,
        ..remote
    };
    println!(
        "reading past the region: {}",
        client.read(beyond).await.unwrap_err()
    );
    region.deregister();
    println!(
        "after deregistration: {}",
        client.read(remote.slice(0, 8)?).await.unwrap_err()
    );
    Ok(())
}
