//! NVMe over rdmx, the same tests over TCP and over the soft RoCEv2 engine:
//! the Initiator against the target, with data checked byte for byte,
//! many commands in flight across queues, NVMe statuses for bad requests,
//! and a target that survives a peer sending garbage.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::future::join_all;
use rdmx_block::backend::RamBackend;
use rdmx_block::fabric::{BlockError, Initiator, InitiatorConfig};
use rdmx_block::nvme::command::{admin, fabrics, sgl, Sgl, Sqe};
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

/// One raw command capsule on `conn`; returns the response's status word.
async fn raw_command(conn: &rdmx_core::Connection, sqe: Sqe, data: &[u8]) -> Option<u16> {
    let mut capsule = sqe.encode().to_vec();
    capsule.extend_from_slice(data);
    conn.send(capsule).await.ok()?;
    let cqe = conn.recv_message().await.ok()?;
    Some(u16::from_le_bytes([cqe[14], cqe[15]]) >> 1)
}

/// A raw admin queue to the target at `url` (no Initiator): Connect as
/// `host`, then CC.EN, both checked to succeed.
async fn raw_admin_queue(url: &str, host: &[u8]) -> rdmx_core::Connection {
    let conn = transports()
        .connect(url, &Options::default())
        .await
        .unwrap();
    // Admin queue Connect (in-capsule data: host ID, cntlid FFFFh, NQNs).
    let mut data = vec![0u8; 1024];
    data[16..18].copy_from_slice(&0xFFFFu16.to_le_bytes());
    data[256..256 + NQN.len()].copy_from_slice(NQN.as_bytes());
    data[512..512 + host.len()].copy_from_slice(host);
    let connect = Sqe {
        opcode: fabrics::OPCODE,
        nsid: u32::from(fabrics::CONNECT),
        flags: 0x40,
        sgl: Sgl {
            len: 1024,
            id: sgl::DATA_BLOCK_OFFSET,
            ..Sgl::default()
        },
        cdw: [0, 31, 0, 0, 0, 0],
        ..Sqe::default()
    };
    assert_eq!(raw_command(&conn, connect, &data).await, Some(0));
    let enable = Sqe {
        opcode: fabrics::OPCODE,
        nsid: u32::from(fabrics::PROPERTY_SET),
        cid: 1,
        flags: 0x40,
        sgl: Sgl {
            id: sgl::KEYED_ADDRESS,
            ..Sgl::default()
        },
        cdw: [0, 0x14, 0x0046_0001, 0, 0, 0],
        ..Sqe::default()
    };
    assert_eq!(raw_command(&conn, enable, &[]).await, Some(0));
    conn
}

/// A host that names memory it does not lend for read data: the target's
/// one-sided WRITE is refused, and the target ends that queue (as an RDMA
/// queue pair in error would: the response may already have gone out
/// behind the WRITE), counts it, and serves everyone else.
async fn host_naming_memory_it_does_not_lend(scheme: &str) {
    let (url, t) = start(scheme).await;
    // Then Identify Controller into a region that does not exist.
    let conn = raw_admin_queue(&url, b"nqn.2014-08.org.nvmexpress:uuid:raw-host").await;
    let errors = t.stats.protocol_errors.load(Relaxed);
    let identify = Sqe {
        opcode: admin::IDENTIFY,
        cid: 2,
        flags: 0x40,
        sgl: Sgl {
            addr: 0x1000,
            len: 4096,
            key: 0x5EED_0BAD,
            id: sgl::KEYED_ADDRESS,
        },
        cdw: [1, 0, 0, 0, 0, 0],
        ..Sqe::default()
    };
    let _ = conn.send(identify.encode().to_vec()).await;
    // Whatever came first, the queue ends.
    let ended = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while conn.recv_message().await.is_ok() {}
    })
    .await;
    assert!(ended.is_ok(), "the queue stayed open");
    assert_eq!(t.stats.protocol_errors.load(Relaxed), errors + 1);
    // Everyone else is served.
    let dev = Initiator::connect(&transports(), &url, cfg())
        .await
        .unwrap();
    dev.write(0, Bytes::from(pattern(5, 4096)), false)
        .await
        .unwrap();
    assert_eq!(&dev.read(0, 8).await.unwrap()[..], &pattern(5, 4096)[..]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_naming_memory_it_does_not_lend_over_tcp() {
    host_naming_memory_it_does_not_lend("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_naming_memory_it_does_not_lend_over_soft_roce() {
    host_naming_memory_it_does_not_lend("rdma").await;
}

/// Reads dropped right after their capsule went out: the buffer the target
/// WRITEs into stays lent until the response (so the target's WRITE is never
/// refused and the queue lives on), and later reads get exact data.
async fn dropped_reads_leave_the_queue_whole(scheme: &str) {
    use futures_util::FutureExt;
    let (url, t) = start(scheme).await;
    let one_queue = InitiatorConfig { queues: 1, ..cfg() };
    let dev = Initiator::connect(&transports(), &url, one_queue)
        .await
        .unwrap();
    let data = pattern(11, 128 << 10);
    dev.write(0, Bytes::from(data.clone()), false)
        .await
        .unwrap();
    let errors = t.stats.protocol_errors.load(Relaxed);
    // The namespace as the reads see it: the data, then zeros.
    let mut disk = data.clone();
    disk.resize(448 * 512, 0);
    // A read whose response came within its one poll (a busy host can
    // take that long) is checked and another is tried: 32 must be dropped
    // while waiting.
    let mut dropped = 0;
    let mut i = 0u64;
    while dropped < 32 && i < 10_000 {
        // Polled once (the command is sent), then dropped.
        let lba = i % 4 * 64;
        match dev.read(lba, 256).now_or_never() {
            None => dropped += 1,
            Some(r) => {
                let at = (lba * 512) as usize;
                assert!(r.unwrap()[..] == disk[at..at + (128 << 10)], "read {i}");
            }
        }
        i += 1;
    }
    assert!(dropped > 0, "no read was still waiting when dropped");
    for i in 0..8u64 {
        let got = dev.read(i * 32, 32).await.unwrap();
        let at = (i * 32 * 512) as usize;
        assert!(
            got[..] == data[at..at + 16384],
            "read {i} after the dropped ones"
        );
    }
    assert_eq!(
        t.stats.protocol_errors.load(Relaxed),
        errors,
        "the target saw a refused WRITE"
    );
}

/// A dropped command keeps its queue slot until its response: the queue
/// never has more commands outstanding than its depth (the target may end a
/// queue that overfills), and when dropped commands hold every slot, the
/// next command reads their responses to free one instead of waiting for
/// ever.
async fn dropped_commands_keep_their_slot(scheme: &str) {
    use futures_util::FutureExt;
    let (url, t) = start(scheme).await;
    let depth = 2;
    let small = InitiatorConfig {
        queues: 1,
        queue_depth: depth,
        ..cfg()
    };
    let dev = Initiator::connect(&transports(), &url, small)
        .await
        .unwrap();
    let data = pattern(12, 64 << 10);
    dev.write(0, Bytes::from(data.clone()), false)
        .await
        .unwrap();
    let errors = t.stats.protocol_errors.load(Relaxed);
    for i in 0..32u64 {
        // Polled once, then dropped: only `depth` of them hold a slot.
        let _ = dev.read(i % 4 * 16, 16).now_or_never();
        assert!(
            dev.outstanding() <= usize::from(depth),
            "{} commands outstanding on a queue of {depth}",
            dev.outstanding()
        );
    }
    for i in 0..8u64 {
        let got = tokio::time::timeout(Duration::from_secs(20), dev.read(i * 16, 16))
            .await
            .expect("a read waited for ever behind dropped ones")
            .unwrap();
        let at = (i * 16 * 512) as usize;
        assert!(got[..] == data[at..at + 8192], "read {i}");
    }
    assert_eq!(t.stats.protocol_errors.load(Relaxed), errors);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_commands_keep_their_slot_over_tcp() {
    dropped_commands_keep_their_slot("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_commands_keep_their_slot_over_soft_roce() {
    dropped_commands_keep_their_slot("rdma").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_reads_leave_the_queue_whole_over_tcp() {
    dropped_reads_leave_the_queue_whole("tcp").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_reads_leave_the_queue_whole_over_soft_roce() {
    dropped_reads_leave_the_queue_whole("rdma").await;
}

/// A counter of the target's side of the connection from `host` (its
/// per-connection counter, from the process's metrics text).
fn target_counter(host: &rdmx_core::Connection, name: &str) -> u64 {
    let peer = host.info().local_addr.expect("local address").to_string();
    let text = rdmx_core::metrics::text(None);
    let prefix = format!("rdmx_connection_{name}_total{{");
    let line = text
        .lines()
        .find(|l| l.starts_with(&prefix) && l.contains(&format!("peer=\"{peer}\"")))
        .expect("the target's side of the connection");
    line.rsplit(' ').next().unwrap().parse().unwrap()
}

/// The socket writes the target made on the connection from `host`.
fn target_socket_writes(host: &rdmx_core::Connection) -> u64 {
    target_counter(host, "socket_writes")
}

/// Post `n` Identify Controller commands on an admin queue at once, each
/// naming its own 4 KiB of `r` for the data; then check every answer and
/// every slot's data (the subsystem NQN at bytes 768..1024).
async fn identify_burst(conn: &rdmx_core::Connection, n: u16) {
    use futures_util::FutureExt;
    use std::future::IntoFuture;
    let mr = Options::default()
        .domain
        .register(usize::from(n) * 4096, rdmx_core::Access::REMOTE_WRITE);
    let r = mr.remote();
    {
        let _cork = conn.cork();
        for cid in 0..n {
            let identify = Sqe {
                opcode: admin::IDENTIFY,
                cid,
                flags: 0x40,
                sgl: Sgl {
                    addr: r.addr + u64::from(cid) * 4096,
                    len: 4096,
                    key: r.rkey,
                    id: sgl::KEYED_ADDRESS,
                },
                cdw: [1, 0, 0, 0, 0, 0],
                ..Sqe::default()
            };
            let post = conn.post_send(identify.encode().to_vec()).into_future();
            post.now_or_never()
                .expect("a send with credits posts at once")
                .unwrap();
        }
    }
    let mut seen = vec![false; usize::from(n)];
    for _ in 0..n {
        let cqe = conn.recv_message().await.unwrap();
        let cid = u16::from_le_bytes([cqe[12], cqe[13]]);
        assert_eq!(u16::from_le_bytes([cqe[14], cqe[15]]) >> 1, 0, "cid {cid}");
        seen[usize::from(cid)] = true;
    }
    assert!(seen.iter().all(|&s| s));
    let mem = mr.read();
    for cid in 0..usize::from(n) {
        let nqn = &mem[cid * 4096 + 768..cid * 4096 + 768 + NQN.len()];
        assert_eq!(nqn, NQN.as_bytes(), "slot {cid}");
    }
}

/// Capsules that arrive together are answered together: 16 Identify
/// commands in one burst get their 16 data WRITEs and 16 responses in one
/// `writev` (the queue corks while further capsules are already received),
/// where it took one per command. Every answer is checked.
#[tokio::test(flavor = "current_thread")]
async fn a_burst_of_commands_is_answered_in_one_write() {
    let (url, _t) = start("tcp").await;
    let conn = raw_admin_queue(&url, b"nqn.2014-08.org.nvmexpress:uuid:burst-host").await;
    const N: u16 = 16;
    let w0 = target_socket_writes(&conn);
    identify_burst(&conn, N).await;
    let writes = target_socket_writes(&conn) - w0;
    eprintln!("{N} commands in one burst: {writes} target writes");
    assert!(writes <= 2, "{N} commands took {writes} target writes");
}

/// The same over soft RoCE: the burst's data WRITEs go first and its
/// responses share SENDs (`write_then_send_many`, bundles), where each
/// response was a SEND of its own. Every answer is checked.
#[tokio::test(flavor = "current_thread")]
async fn a_burst_of_commands_is_answered_in_bundles_over_soft_roce() {
    let (url, _t) = start("rdma").await;
    let conn = raw_admin_queue(&url, b"nqn.2014-08.org.nvmexpress:uuid:burst-host-rdma").await;
    const N: u16 = 16;
    let b0 = target_counter(&conn, "bundles_sent");
    identify_burst(&conn, N).await;
    let bundles = target_counter(&conn, "bundles_sent") - b0;
    eprintln!("{N} commands in one burst: {bundles} bundled SENDs from the target");
    assert!(bundles >= 1, "{N} responses went as {N} SENDs");
}

/// The commands of a corked burst go to one I/O queue (where each queue
/// took them in turn, a burst of two cost a capsule `writev` on each), and
/// the bursts spread over the queues. Every read is checked.
async fn a_burst_goes_to_one_queue(scheme: &str) {
    use futures_util::stream::{FuturesUnordered, StreamExt};
    use futures_util::FutureExt;
    let (url, _t) = start(scheme).await;
    let dev = Initiator::connect(&transports(), &url, cfg())
        .await
        .unwrap();
    assert_eq!(dev.queues(), 2);
    let data = Bytes::from(pattern(7, 64 << 10));
    dev.write(0, data.clone(), false).await.unwrap();
    let sent =
        |dev: &Initiator| -> Vec<u64> { dev.queue_stats().iter().map(|s| s.sends).collect() };
    for burst in 0..4 {
        let before = sent(&dev);
        let mut reads: FuturesUnordered<_> = (0..8u64)
            .map(|i| {
                let dev = &dev;
                async move { (i as usize, dev.read(i * 16, 16).await) }
            })
            .collect();
        {
            let _cork = dev.cork();
            // Each read posts its capsule when first polled.
            assert!(reads.next().now_or_never().is_none());
        }
        let mut n = 0;
        while let Some((i, r)) = reads.next().await {
            let got = r.unwrap();
            assert!(
                got == data[i * 8192..(i + 1) * 8192],
                "{scheme}: read {i} differs"
            );
            n += 1;
        }
        assert_eq!(n, 8);
        let used: Vec<u64> = sent(&dev).iter().zip(&before).map(|(a, b)| a - b).collect();
        assert!(
            used.contains(&8) && used.contains(&0),
            "{scheme}: burst {burst} spread over the queues: {used:?}"
        );
    }
    dev.close().await.unwrap();
}

#[tokio::test]
async fn a_burst_goes_to_one_queue_over_tcp() {
    a_burst_goes_to_one_queue("tcp").await;
}

#[tokio::test]
async fn a_burst_goes_to_one_queue_over_soft_roce() {
    a_burst_goes_to_one_queue("rdma").await;
}

/// An idle Initiator keeps its controller: Keep Alive every KATO/2 from the
/// admin Connect (KATO 1 s here, three of them idle).
#[tokio::test]
async fn an_idle_initiator_keeps_its_controller() {
    let (url, t) = start("tcp").await;
    let short = InitiatorConfig {
        kato: Duration::from_secs(1),
        ..cfg()
    };
    let dev = Initiator::connect(&transports(), &url, short)
        .await
        .unwrap();
    dev.write(0, Bytes::from(pattern(7, 4096)), false)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(t.stats.keep_alive_expired.load(Relaxed), 0);
    assert!(dev.read(0, 8).await.unwrap() == pattern(7, 4096));
    dev.close().await.unwrap();
}
