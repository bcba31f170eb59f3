//! The conformance suite, unchanged, on a real RDMA NIC.
//!
//! It needs a host with a RoCE NIC, so it is `#[ignore]`d by default. Run it
//! there with the address of the NIC's interface (client and server both
//! run in this process, connected through the NIC):
//!
//! ```text
//! RDMX_TEST_RDMA_ADDR=192.0.2.10 RDMX_RDMA_DEVICE=mlx5_0 \
//!     cargo test -p rdmx-transport-rdma --features hw --test conformance_hw -- --ignored
//! ```
#![cfg(feature = "hw")]

use std::sync::Arc;

use rdmx_conformance::Suite;
use rdmx_transport_rdma::hw::{HwConfig, HwProvider};
use rdmx_transport_rdma::RdmaTransport;

fn suite() -> Suite {
    let addr = std::env::var("RDMX_TEST_RDMA_ADDR")
        .expect("set RDMX_TEST_RDMA_ADDR to an IP address of the NIC's interface");
    let nic = HwProvider::open(HwConfig::from_env()).expect("open the RDMA device");
    Suite::new(
        Arc::new(RdmaTransport::with_provider(nic)),
        &format!("{addr}:0"),
    )
}

/// The path MTU is the port's active MTU as the device reports it (sysfs
/// has none): `RDMX_TEST_EXPECT_MTU` says what it must be (rxe on a 1500-byte
/// Ethernet: 1024; the fake libibverbs: 2048).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs a RoCE NIC: set RDMX_TEST_RDMA_ADDR and RDMX_TEST_EXPECT_MTU, run with --ignored"]
async fn path_mtu_is_the_ports_active_mtu() {
    let want = std::env::var("RDMX_TEST_EXPECT_MTU").expect("set RDMX_TEST_EXPECT_MTU");
    let p = suite().pair().await;
    let info = p.client.info();
    assert!(
        info.provider.contains(&format!(", MTU {want},")),
        "expected MTU {want}: {}",
        info.provider
    );
}

rdmx_conformance::conformance_tests!(
    suite(),
    ignore = "needs a RoCE NIC: set RDMX_TEST_RDMA_ADDR (and RDMX_RDMA_DEVICE), run with --ignored"
);

/// The same cases with every connection striped over four RC queue pairs.
mod four_lanes {
    use super::*;
    use rdmx_core::lanes::WithLanes;

    fn suite() -> Suite {
        let plain = super::suite();
        Suite::new(
            Arc::new(WithLanes::new(plain.transport, 4)),
            &plain.listen_addr,
        )
    }

    rdmx_conformance::conformance_tests!(
        suite(),
        ignore =
            "needs a RoCE NIC: set RDMX_TEST_RDMA_ADDR (and RDMX_RDMA_DEVICE), run with --ignored"
    );

    /// Lanes negotiated, split transfers and message order on the NIC.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "needs a RoCE NIC: set RDMX_TEST_RDMA_ADDR (and RDMX_RDMA_DEVICE), run with --ignored"]
    async fn lanes() {
        super::suite().lanes().await;
    }
}

/// Without a NIC, run the same cases against a fake libibverbs
/// (`tests/fake-verbs/fake_verbs.c`: one in-process device whose queue pairs
/// reach each other through memory, checking keys, bounds, rights and state
/// as a NIC does). It exercises every verbs call of the provider — device
/// open, PD, MR registration, CQ with its completion channel, QP state
/// transitions, posting, polling, flushing — but not a wire: the RoCEv2
/// packets themselves are the soft engine's business. The cases run in a
/// child process because libibverbs is loaded when a process starts.
#[test]
#[cfg_attr(
    rdmx_missing_fake_verbs,
    ignore = "needs cc and libibverbs-dev to build the fake libibverbs; CI runs it"
)]
fn conformance_on_a_fake_libibverbs() {
    if std::env::var_os("RDMX_TEST_RDMA_ADDR").is_some() {
        return; // on a NIC host the real cases above run instead
    }
    let ci = std::env::var_os("CI").is_some();
    let dir = std::env::temp_dir().join(format!("rdmx-fake-verbs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fake-verbs/fake_verbs.c");
    let built = std::process::Command::new("cc")
        .args(["-O1", "-Wall", "-shared", "-fPIC", "-o"])
        .arg(dir.join("libibverbs.so.1"))
        .arg(src)
        .status();
    if !matches!(built, Ok(s) if s.success()) {
        assert!(
            !ci,
            "cannot build the fake libibverbs (needs cc and libibverbs-dev)"
        );
        eprintln!("skipped: cannot build the fake libibverbs (needs cc and libibverbs-dev)");
        return;
    }
    // The device as sysfs lists it: one active Ethernet port, MTU 4096, a
    // RoCE v2 GID for 127.0.0.1 at index 1 (and a v1 one at 0 to skip).
    let sys = dir.join("sys");
    rdmx_transport_rdma::sysfs::fake::port(
        &sys,
        "fake0",
        1,
        "4: ACTIVE",
        "Ethernet",
        "", // like the kernel's: the MTU comes from ibv_query_port
        &[
            (
                0,
                "0000:0000:0000:0000:0000:ffff:7f00:0001",
                "IB/RoCE v1",
                "lo",
            ),
            (
                1,
                "0000:0000:0000:0000:0000:ffff:7f00:0001",
                "RoCE v2",
                "lo",
            ),
        ],
    );
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--test-threads=2"])
        .env("LD_LIBRARY_PATH", &dir)
        .env("RDMX_TEST_RDMA_ADDR", "127.0.0.1")
        .env("RDMX_TEST_EXPECT_MTU", "2048")
        .env("RDMX_RDMA_DEVICE", "fake0")
        .env("RDMX_SYSFS_ROOT", &sys)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success() && stdout.contains("test result: ok. 36 passed"),
        "conformance on the fake libibverbs failed:\n{stdout}\n{stderr}"
    );
}
