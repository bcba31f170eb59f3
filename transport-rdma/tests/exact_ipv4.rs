//! With `exact_ipv4`, the soft provider's IPv4 packets carry the ICRC of the
//! header the kernel really sends: a capture of the loopback interface (taken by
//! dumpcap, so with the kernel's own IP headers) verifies packet by packet.
//! Needs root and dumpcap (tshark's capture tool); skips elsewhere, fails in CI.

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use rdmx_conformance::Suite;
use rdmx_core::Access;
use rdmx_roce_proto::pcap::{check, read_capture};
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};

fn skip(why: &str) {
    assert!(std::env::var_os("CI").is_none(), "cannot run in CI: {why}");
    // Straight to stderr: libtest does not capture it, so the skip shows.
    let _ = std::io::Write::write_all(
        &mut std::io::stderr(),
        format!("SKIPPED ipv4_icrc_matches_the_kernel_header: {why}\n").as_bytes(),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[cfg_attr(
    rdmx_missing_dumpcap,
    ignore = "needs root and dumpcap (apt-get install tshark); CI runs it"
)]
async fn ipv4_icrc_matches_the_kernel_header() {
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
    });
    if !root {
        return skip("not root");
    }
    if Command::new("dumpcap").arg("-v").output().is_err() {
        return skip("dumpcap (tshark) is not installed");
    }
    let dev = SoftRoce::new(SoftConfig {
        exact_ipv4: true,
        port_fallback: false,
        ..SoftConfig::default()
    });
    let Ok(dev) = dev else {
        return skip("UDP 4791 is taken on this host");
    };
    let dev = Arc::new(dev);
    let dir = std::env::temp_dir().join(format!("rdmx-exact-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pcap = dir.join("lo.pcapng");
    let mut cap = Command::new("dumpcap")
        .args(["-q", "-i", "lo", "-f", "udp port 4791", "-w"])
        .arg(&pcap)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1500)).await;

    let p = Suite::new(
        Arc::new(RdmaTransport::with_provider(dev.clone())),
        "127.0.0.1:0",
    )
    .pair()
    .await;
    let c = &p.client;
    let mr = p.server_opts.domain.register(64 << 10, Access::ALL);
    let data: Vec<u8> = (0..64u32 << 10).map(|i| (i % 241) as u8).collect();
    for _ in 0..10 {
        c.write(data.clone(), mr.remote()).await.unwrap();
        assert_eq!(&c.read(mr.remote()).await.unwrap()[..], &data[..]);
        c.fetch_and_add(mr.remote().word(0).unwrap(), 1)
            .await
            .unwrap();
    }
    let sent = dev.stats().tx_packets;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let _ = Command::new("kill")
        .arg("-INT")
        .arg(cap.id().to_string())
        .status();
    let _ = cap.wait();
    let frames = read_capture(std::fs::File::open(&pcap).unwrap()).unwrap();
    let s = check(&frames);
    assert!(
        s.bad.is_empty(),
        "bad ICRCs against the kernel's headers: {:?}",
        s.bad
    );
    let ok: usize = s.ok.values().sum();
    assert!(
        ok as u64 >= sent / 2 && ok > 100,
        "captured {ok} RoCE packets of {sent} sent"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
