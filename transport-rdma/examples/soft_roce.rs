//! RDMA without an RDMA NIC: two rdmx endpoints talk RoCEv2 over UDP through
//! the soft provider; a 16 MiB write and read are checked byte for byte, then
//! a ping-pong of small messages, whose ACKs leave with the answers (the
//! runtime calls `soft::on_thread_park`, so a worker that runs dry sends
//! the ACKs no answer took along).
//!
//! ```text
//! cargo run --release -p rdmx-transport-rdma --example soft_roce
//! ```

use rdmx_core::{Access, Options, Transport};
use rdmx_transport_rdma::{RdmaTransport, SoftRoce};

fn main() -> rdmx_core::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .on_thread_park(rdmx_transport_rdma::soft::on_thread_park)
        .enable_all()
        .build()
        .expect("tokio runtime")
        .block_on(async { tokio::spawn(run()).await.expect("the example's task") })
}

async fn run() -> rdmx_core::Result<()> {
    let rdma = RdmaTransport::new();
    let server_opts = Options::default();
    let mut listener = rdma.listen("127.0.0.1:0", &server_opts).await?;
    let addr = listener.local_addr().to_string();
    let (client, server) =
        tokio::join!(rdma.connect(&addr, &Options::default()), listener.accept());
    let (client, server) = (client?, server?);
    println!("provider: {}", client.info().provider);

    let size = 16 << 20;
    let region = server_opts.domain.register(size, Access::ALL);
    let data: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
    let t0 = std::time::Instant::now();
    client.write(data.clone(), region.remote()).await?;
    let w = t0.elapsed();
    let t0 = std::time::Instant::now();
    let back = client.read(region.remote()).await?;
    let r = t0.elapsed();
    assert_eq!(&back[..], &data[..], "read back differs");
    assert_eq!(&region.read()[..], &data[..], "region differs");
    let mbs = |d: std::time::Duration| size as f64 / d.as_secs_f64() / 1e6;
    println!(
        "16 MiB write {:.0} MB/s, read {:.0} MB/s, data verified",
        mbs(w),
        mbs(r)
    );

    // Ping-pong: the server echoes each message; its ACK rides the echo.
    let dev = SoftRoce::global()?;
    let echo = tokio::spawn(async move {
        for _ in 0..1000 {
            let m = server.recv_message().await?;
            server.send(m).await?;
        }
        rdmx_core::Result::Ok(())
    });
    let before = dev.stats();
    let t0 = std::time::Instant::now();
    for i in 0..1000u64 {
        client.send(i.to_le_bytes().to_vec()).await?;
        assert_eq!(&client.recv_message().await?[..], &i.to_le_bytes());
    }
    let rt = t0.elapsed() / 1000;
    echo.await.expect("echo task")?;
    let after = dev.stats();
    println!(
        "1000 echoed messages, {rt:?} per round trip, {:.1} send calls per round trip, \
         {} ACKs waited for an answer",
        (after.tx_calls - before.tx_calls) as f64 / 1000.0,
        after.acks_held - before.acks_held
    );
    println!("device: {:?}", dev.stats());
    Ok(())
}
