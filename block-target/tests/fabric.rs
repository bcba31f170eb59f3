//! NVMe over rdmx, the same tests over TCP and over the soft RoCEv2 engine:
//! the Initiator against the target, with data checked byte for byte,
//! many commands in flight across queues, NVMe statuses for bad requests,
//! and a target that survives a peer sending garbage.

use std::sync::Arc;

use bytes::Bytes;
use futures_util::future::join_all;
use rdmx_block::backend::RamBackend;
use rdmx_block::fabric::{BlockError, Initiator, InitiatorConfig};
use rdmx_block::nvme::status::Status;
use rdmx_block::target::{Target, TargetConfig};
use rdmx_core::{Options, Transports};

const NQN: &str = "nqn.2026-11.io.rdmx:fabric-test";
const BYTES: u64 = 16 << 20;

fn transports() -> Transports {
    Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new())
}

async fn start(scheme: &str) -> (String, Arc<Target>) {
    let t = Target::new(TargetConfig {
        nqn: NQN.into(),
        ..TargetConfig::default()
    });
    t.add_namespace(Arc::new(RamBackend::new(BYTES).unwrap()))
        .unwrap();
    let l = transports()
        .listen(&format!("{scheme}://127.0.0.1:0"), &Options::default())
        .await
        .unwrap();
    let url = format!("{scheme}://{}", l.local_addr());
    tokio::spawn(rdmx_block::fabric::serve(l, t.clone()));
    (url, t)
}

fn cfg() -> InitiatorConfig {
    InitiatorConfig {
        nqn: NQN.into(),
        queues: 2,
        queue_depth: 32,
        ..InitiatorConfig::default()
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

async fn round_trips(scheme: &str) {
    let (url, t) = start(scheme).await;
    let dev = Initiator::connect(&transports(), &url, cfg())
        .await
        .unwrap();
    assert_eq!(dev.blocks(), BYTES / 512);
    assert_eq!(dev.block_size(), 512);
    assert_eq!(dev.queues(), 2);
    let (transport, provider) = dev.transport();
    assert_eq!(transport, scheme, "no fallback ({provider})");
    // In-capsule (4 KiB), then READ by the target (64 KiB, 1 MiB).
    for (lba, len, seed) in [
        (0u64, 4096usize, 1u64),
        (64, 64 << 10, 2),
        (4096, 1 << 20, 3),
    ] {
        let data = Bytes::from(pattern(seed, len));
        dev.write(lba, data.clone(), seed == 3).await.unwrap();
        let back = dev.read(lba, (len / 512) as u32).await.unwrap();
        assert!(back == data, "{scheme}: {len} bytes at {lba} differ");
    }
    dev.flush().await.unwrap();
    dev.write_zeroes(64, 64, false).await.unwrap();
    dev.trim(128, 64).await.unwrap();
    let z = dev.read(64, 128).await.unwrap();
    assert!(z.iter().all(|&b| b == 0), "zeroed and trimmed read as zero");
    let first = dev.read(0, 8).await.unwrap();
    assert!(first == pattern(1, 4096), "untouched blocks kept");
    // Many commands in flight over both queues, each checked.
    let writes = (0..64u64).map(|i| {
        let dev = &dev;
        async move {
            let d = Bytes::from(pattern(100 + i, 8192 + 512 * (i as usize % 8)));
            let lba = 10_000 + i * 64;
            dev.write(lba, d.clone(), false).await.unwrap();
            (lba, d)
        }
    });
    let written = join_all(writes).await;
    let reads = written.iter().map(|(lba, d)| {
        let dev = &dev;
        async move {
            let got = dev.read(*lba, (d.len() / 512) as u32).await.unwrap();
            assert!(got == *d, "{scheme}: block {lba} differs");
        }
    });
    join_all(reads).await;
    let s = &t.namespaces()[0].stats;
    assert_eq!(s.ops(rdmx_block::metrics::IoOp::Write), 3 + 64);
    dev.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_round_trips_over_tcp() {
    round_trips("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initiator_round_trips_over_soft_roce() {
    round_trips("rdma").await;
}

async fn bad_requests(scheme: &str) {
    let (url, _t) = start(scheme).await;
    let dev = Initiator::connect(&transports(), &url, cfg())
        .await
        .unwrap();
    // Checked before sending.
    assert!(matches!(
        dev.read(dev.blocks() - 1, 2).await,
        Err(BlockError::Invalid(_))
    ));
    assert!(matches!(
        dev.read(0, 4096).await,
        Err(BlockError::Invalid(_))
    ));
    assert!(matches!(
        dev.write(0, Bytes::from_static(&[1, 2, 3]), false).await,
        Err(BlockError::Invalid(_))
    ));
    // The target's own checks: an unknown subsystem and namespace.
    let wrong = InitiatorConfig {
        nqn: "nqn.2026-11.io.rdmx:missing".into(),
        ..cfg()
    };
    match Initiator::connect(&transports(), &url, wrong).await {
        Err(BlockError::Nvme(s)) => assert_eq!(s, Status::CONNECT_INVALID_PARAMETERS),
        other => panic!("connected to a missing subsystem: {:?}", other.err()),
    }
    let ns9 = InitiatorConfig { nsid: 9, ..cfg() };
    match Initiator::connect(&transports(), &url, ns9).await {
        Err(BlockError::Nvme(s)) => assert_eq!(s, Status::INVALID_NAMESPACE),
        other => panic!("namespace 9 exists? {:?}", other.err()),
    }
    // A peer that sends garbage loses its connection; others carry on.
    let junk = transports()
        .connect(&url, &Options::default())
        .await
        .unwrap();
    // (The send itself may already see the hang-up.)
    let _ = junk.send(Bytes::from_static(b"not a capsule")).await;
    assert!(junk.recv_message().await.is_err(), "the target hung up");
    dev.write(8, Bytes::from(vec![9u8; 512]), false)
        .await
        .unwrap();
    assert_eq!(&dev.read(8, 1).await.unwrap()[..], &[9u8; 512][..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_over_tcp() {
    bad_requests("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_over_soft_roce() {
    bad_requests("rdma").await;
}
