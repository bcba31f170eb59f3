//! rdmx on a real RDMA device (feature `hw`): the NIC provider opens the
//! device through libibverbs, and a client and a server in this process
//! connect through it (RC queue pairs on the device, a TCP side channel for
//! the bootstrap). A 1 MiB write and read, a compare-and-swap, a
//! fetch-and-add and a ping-pong of messages, each checked.
//!
//! Run it with an IP address of the device's interface (a RoCEv2 GID) and,
//! if the host has several devices, the one to use. On a NIC, or on the
//! kernel's rxe (`rdma link add rxe0 type rxe netdev eth0`):
//!
//! ```text
//! RDMX_RDMA_DEVICE=rxe0 cargo run --release -p rdmx-transport-rdma \
//!     --features hw --example nic -- 198.18.0.2
//! ```
//!
//! A host without a device (or without libibverbs) gets the provider's
//! error and exit status 2. testbed/tests.sh `nic-example` runs this on rxe.

use rdmx_core::{Access, Options, Transport};
use rdmx_transport_rdma::RdmaTransport;

fn main() {
    let Some(addr) = std::env::args().nth(1) else {
        eprintln!(
            "usage: nic IP-ADDRESS-OF-THE-DEVICE'S-INTERFACE (RDMX_RDMA_DEVICE picks the device)"
        );
        std::process::exit(2);
    };
    let nic = match rdmx_transport_rdma::hardware() {
        Ok(nic) => nic,
        Err(e) => {
            eprintln!("nic: no RDMA device to use: {e}");
            std::process::exit(2);
        }
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime");
    let run =
        rt.block_on(async { tokio::spawn(run(RdmaTransport::with_provider(nic), addr)).await });
    if let Err(e) = run.expect("the example's task") {
        eprintln!("nic: {e}");
        std::process::exit(1);
    }
}

async fn run(rdma: RdmaTransport, addr: String) -> rdmx_core::Result<()> {
    let server_opts = Options::default();
    let mut listener = rdma.listen(&format!("{addr}:0"), &server_opts).await?;
    let at = listener.local_addr().to_string();
    let (client, server) = tokio::join!(rdma.connect(&at, &Options::default()), listener.accept());
    let (client, server) = (client?, server?);
    println!("provider: {}", client.info().provider);

    // One-sided: the server's CPU takes no part (the device places the data).
    let size = 1 << 20;
    let region = server_opts.domain.register(size + 16, Access::ALL);
    let data: Vec<u8> = (0..size).map(|i| (i * 131 % 251) as u8).collect();
    let buffer = region.remote().slice(0, size as u64)?;
    let t0 = std::time::Instant::now();
    client.write(data.clone(), buffer).await?;
    let back = client.read(buffer).await?;
    let took = t0.elapsed();
    assert_eq!(
        &back[..],
        &data[..],
        "read back differs from what was written"
    );
    assert_eq!(
        &region.read()[..size],
        &data[..],
        "the server's memory differs"
    );
    println!("1 MiB written and read back in {took:?}: identical, and so is the server's memory");

    let word = region.remote().word(size as u64)?;
    let old = client.compare_and_swap(word, 0, 0xfeed).await?;
    let added = client.fetch_and_add(word, 0x10).await?;
    let now = u64::from_le_bytes(region.read()[size..size + 8].try_into().expect("8 bytes"));
    assert_eq!((old, added, now), (0, 0xfeed, 0xfeed + 0x10), "atomics");
    println!("compare-and-swap 0 -> {old:#x}, fetch-and-add -> {added:#x}, word now {now:#x}");

    // Two-sided: the server echoes each message back.
    let echo = tokio::spawn(async move {
        for _ in 0..100 {
            let m = server.recv_message().await?;
            server.send(m).await?;
        }
        rdmx_core::Result::Ok(())
    });
    let t0 = std::time::Instant::now();
    for i in 0..100u32 {
        let m: Vec<u8> = (0..=i).map(|k| (k ^ i) as u8).collect();
        client.send(m.clone()).await?;
        assert_eq!(client.recv_message().await?[..], m[..], "echo {i}");
    }
    let rt = t0.elapsed() / 100;
    echo.await.expect("echo task")?;
    println!("100 messages of 1..100 bytes echoed intact, {rt:?} per round trip");
    Ok(())
}
