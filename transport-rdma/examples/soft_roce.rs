//! RDMA without an RDMA NIC: two rdmx endpoints talk RoCEv2 over UDP through
//! the soft provider; a 16 MiB write and read are checked byte for byte.
//!
//! ```text
//! cargo run --release -p rdmx-transport-rdma --example soft_roce
//! ```

use rdmx_core::{Access, Options, Transport};
use rdmx_transport_rdma::{RdmaTransport, SoftRoce};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> rdmx_core::Result<()> {
    let rdma = RdmaTransport::new();
    let server_opts = Options::default();
    let mut listener = rdma.listen("127.0.0.1:0", &server_opts).await?;
    let addr = listener.local_addr().to_string();
    let (client, server) =
        tokio::join!(rdma.connect(&addr, &Options::default()), listener.accept());
    let (client, _server) = (client?, server?);
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
    println!("device: {:?}", SoftRoce::global()?.stats());
    Ok(())
}
