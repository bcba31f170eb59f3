//! Soft device behaviour that the conformance suite cannot see: packets with a
//! bad ICRC, for unknown QPs, or that do not decode are dropped and counted,
//! and the connection they aim at keeps working with exact data.

use std::future::IntoFuture;
use std::net::UdpSocket;
use std::sync::Arc;
use std::time::Duration;

use rdmx_conformance::{Pair, Suite};
use rdmx_core::Access;
use rdmx_roce_proto::{Bth, Opcode, Packet, Reth};
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};

/// Held by the tests that time the device (a held-up thread, a stream of
/// bursts), so that they do not run beside each other: a 128 MiB stream on
/// the two cores delayed the loopback delivery the other one waits for.
static TIMED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A soft device on a free port, and a connected pair over it.
async fn soft_pair() -> (Arc<SoftRoce>, Pair) {
    soft_pair_with(SoftConfig::default()).await
}

/// [`soft_pair`] on a device of configuration `cfg` (its port aside).
async fn soft_pair_with(cfg: SoftConfig) -> (Arc<SoftRoce>, Pair) {
    let dev = Arc::new(SoftRoce::new(SoftConfig { port: 0, ..cfg }).unwrap());
    let p = Suite::new(
        Arc::new(RdmaTransport::with_provider(dev.clone())),
        "127.0.0.1:0",
    )
    .pair()
    .await;
    (dev, p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_packets_are_dropped_and_counted() {
    let (dev, p) = soft_pair().await;
    let c = &p.client;
    let mr = p.server_opts.domain.register(4096, Access::ALL);
    let qpn = |info: &str| {
        // "soft-roce:PORT (QPN 0xA -> 0xB, ...)": the server's QPN is B for the client.
        let arrow = info.split("-> 0x").nth(1).unwrap();
        u32::from_str_radix(arrow.split(',').next().unwrap(), 16).unwrap()
    };
    let server_qpn = qpn(&c.info().provider);
    let before = dev.stats();

    // A well-formed RDMA WRITE to the server's QP and region, with a wrong ICRC.
    let mut p = Packet::new(Bth::new(Opcode::RDMA_WRITE_ONLY, server_qpn, 0));
    p.reth = Some(Reth {
        va: mr.remote().addr,
        rkey: mr.rkey(),
        dma_len: 4,
    });
    p.payload = bytes::Bytes::from_static(b"evil");
    p.finish();
    let mut wire = Vec::new();
    p.encode(&mut wire);
    wire.extend_from_slice(&0xdead_beefu32.to_le_bytes());
    let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
    let to = ("127.0.0.1", dev.port());
    tx.send_to(&wire, to).unwrap();
    // Garbage, and a valid-looking packet for a QP that does not exist.
    tx.send_to(&[0xFFu8; 40], to).unwrap();
    tx.send_to(&[1u8, 2, 3], to).unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let after = dev.stats();
    assert!(after.icrc_errors >= before.icrc_errors + 2, "{after:?}");
    assert!(after.malformed > before.malformed, "{after:?}");
    assert_eq!(&mr.read()[..4], &[0u8; 4], "a bad packet was acted on");

    // The connection is unaffected.
    c.write(vec![7u8; 4096], mr.remote()).await.unwrap();
    assert!(mr.read().iter().all(|&b| b == 7));
    assert_eq!(&c.read(mr.remote()).await.unwrap()[..], &[7u8; 4096][..]);
}

/// Work requests posted together leave together: requests posted while
/// others are outstanding go out at the end of the scheduler tick in one GSO
/// batch, and the responder acknowledges a received batch in one; before,
/// each request took a send system call of its own. One thread makes the
/// count independent of the machine's speed (as in the TCP transport's test).
#[tokio::test(flavor = "current_thread")]
async fn requests_posted_together_share_send_calls() {
    const N: u64 = 64;
    let (dev, p) = soft_pair().await;
    let c = &p.client;
    let mr = p.server_opts.domain.register(8 * N as usize, Access::ALL);
    let before = dev.stats();
    let writes = (0..N).map(|i| {
        c.write(
            (9000 + i).to_le_bytes().to_vec(),
            mr.remote().word(8 * i).unwrap(),
        )
        .into_future()
    });
    for r in futures_util::future::join_all(writes).await {
        r.unwrap();
    }
    let after = dev.stats();
    for i in 0..N {
        assert_eq!(mr.load_u64(8 * i as usize), 9000 + i, "word {i}");
    }
    // Client and server share this device: requests and acknowledgements.
    let calls = after.tx_calls - before.tx_calls;
    let packets = after.tx_packets - before.tx_packets;
    eprintln!("{N} writes: {packets} packets in {calls} send calls");
    assert!(packets > N, "{packets} packets for {N} writes");
    assert!(calls <= N / 8, "{calls} send calls for {N} writes");
}

/// `read_many` posts its READs together: their request packets leave in
/// a few GSO batches, and the responses (one per READ) likewise; every
/// read's bytes come back in the order asked.
#[tokio::test(flavor = "current_thread")]
async fn read_many_posts_its_reads_together() {
    const N: u64 = 64;
    let (dev, p) = soft_pair().await;
    let c = &p.client;
    let mr = p.server_opts.domain.register(64 * N as usize, Access::ALL);
    for i in 0..N {
        mr.store_u64(64 * i as usize, 5000 + i);
    }
    let srcs = (0..N)
        .map(|i| mr.remote().slice(64 * i, 64).unwrap())
        .collect();
    let before = dev.stats();
    let got = c.read_many(srcs).await.unwrap();
    let after = dev.stats();
    for (i, g) in got.iter().enumerate() {
        assert_eq!(g.len(), 64);
        assert_eq!(
            u64::from_le_bytes(g[..8].try_into().unwrap()),
            5000 + i as u64,
            "read {i}"
        );
    }
    // Client and server share this device: requests and responses.
    let calls = after.tx_calls - before.tx_calls;
    let packets = after.tx_packets - before.tx_packets;
    eprintln!("{N} reads: {packets} packets in {calls} send calls");
    assert!(packets >= 2 * N, "{packets} packets for {N} reads");
    assert!(calls <= N / 4, "{calls} send calls for {N} reads");
    // Awaited one by one, each READ and each response takes a call.
    let before = dev.stats();
    for i in 0..N {
        c.read(mr.remote().slice(64 * i, 64).unwrap())
            .await
            .unwrap();
    }
    let one_by_one = dev.stats().tx_calls - before.tx_calls;
    assert!(one_by_one >= 2 * N, "{one_by_one} send calls, one by one");
}

/// A requester whose thread was held up (a long send burst, a busy
/// application task) past its retransmission interval while the peer
/// answered: when the thread runs again, the device takes the answer that
/// waits in its socket before its timers fire, so nothing times out and
/// nothing is resent. One thread, shared by both ends, makes the hold-up
/// cover the responder too: its ACK is sent only once the thread runs.
#[tokio::test(flavor = "current_thread")]
async fn a_held_up_requester_takes_waiting_answers_before_its_timer_fires() {
    let _timed = TIMED.lock().await;
    let (_dev, p) = soft_pair().await;
    let c = &p.client;
    let mr = p.server_opts.domain.register(4096, Access::ALL);
    let before = c.stats();
    for round in 0..20u8 {
        let mut write = Box::pin(c.write(vec![round; 4096], mr.remote()).into_future());
        // Posted (and sent) by the first poll; then the only thread stops
        // for 20 timer floors (1 ms).
        assert!(futures_util::FutureExt::now_or_never(&mut write).is_none());
        std::thread::sleep(std::time::Duration::from_millis(20));
        write.await.unwrap();
        assert!(mr.read().iter().all(|&b| b == round), "round {round}");
    }
    let after = c.stats();
    // Without the drain every round timed out and resent (20 of 20). A
    // round may still, rarely: the kernel can defer the loopback delivery
    // of the responder's ACK (ksoftirqd) past the drain.
    let timeouts = after.retransmit_timeouts - before.retransmit_timeouts;
    let resent = after.retransmits - before.retransmits;
    assert!(timeouts <= 2 && resent <= 2, "{after:?}");
}

/// A burst listens between its sends only after the peer reported a loss:
/// on loopback the receive queue holds the peer's packets too, and taking
/// them from the sending thread cut 1 MiB write streams (16 in flight)
/// from 3.2-3.7 to 2.3-2.4 GB/s. The retransmission timer and tail probes
/// firing for nothing on a busy machine (they do, here) are no loss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_without_losses_leaves_receiving_to_the_receive_task() {
    let _timed = TIMED.lock().await;
    let (dev, p) = soft_pair().await;
    let c = &p.client;
    const MIB: usize = 1 << 20;
    let mr = p.server_opts.domain.register(16 * MIB, Access::ALL);
    let before = dev.stats();
    let c0 = c.stats();
    for round in 0..8u8 {
        let writes = (0..16u64).map(|i| {
            let dst = mr.remote().slice(i * MIB as u64, MIB as u64).unwrap();
            c.write(vec![round ^ i as u8; MIB], dst).into_future()
        });
        for r in futures_util::future::join_all(writes).await {
            r.unwrap();
        }
    }
    let data = mr.read();
    for i in 0..16 {
        assert!(
            data[i * MIB..(i + 1) * MIB]
                .iter()
                .all(|&b| b == 7 ^ i as u8),
            "slot {i}"
        );
    }
    let (after, c1) = (dev.stats(), c.stats());
    assert_eq!(c1.naks, c0.naks, "a loss on loopback: {c1:?}");
    assert_eq!(after.rx_while_sending, before.rx_while_sending, "{after:?}");
}

/// The server of `p` sends back each of the next `n` messages it receives.
fn echo(p: &Pair, n: u64) -> tokio::task::JoinHandle<()> {
    let server = p.server.clone();
    tokio::spawn(async move {
        for _ in 0..n {
            let m = server.recv_message().await.unwrap();
            server.send(m).await.unwrap();
        }
    })
}

/// Ping-pong of small sends: each end answers what it receives, so the ACK
/// of a delivered message waits for the answer and leaves right behind it in
/// the same send call. Two send calls per round trip (the request with the
/// ACK of the last answer, the answer with the ACK of the request) instead
/// of four, which is what the same ping-pong costs with the hold off; every
/// message arrives exact and in order either way. Returns send calls per
/// round trip.
async fn ping_pong_send_calls(flavor: &str, hold: Duration) -> f64 {
    const N: u64 = 300;
    let (dev, p) = soft_pair_with(SoftConfig {
        ack_hold: hold,
        ..SoftConfig::default()
    })
    .await;
    let echo = echo(&p, N);
    let c = &p.client;
    // Warm up: both ends learn that the other answers.
    for i in 0..10u64 {
        c.send(i.to_le_bytes().to_vec()).await.unwrap();
        assert_eq!(c.recv_message().await.unwrap()[..], i.to_le_bytes());
    }
    let before = dev.stats();
    for i in 10..N {
        let msg = rdmx_conformance::pattern(i, 8 + i as usize % 24);
        c.send(msg.clone()).await.unwrap();
        assert_eq!(c.recv_message().await.unwrap()[..], msg[..], "message {i}");
    }
    echo.await.unwrap();
    let after = dev.stats();
    let rounds = N - 10;
    let calls = after.tx_calls - before.tx_calls;
    let packets = after.tx_packets - before.tx_packets;
    eprintln!(
        "{flavor}, hold {hold:?}: {rounds} round trips: {packets} packets in {calls} send calls; \
         ACKs held {}, released alone {}",
        after.acks_held - before.acks_held,
        after.acks_released - before.acks_released
    );
    // Two messages and two ACKs each round trip (a retransmission adds).
    assert!(packets >= 4 * rounds - 2, "{packets} packets");
    if hold.is_zero() {
        assert_eq!(after.acks_held, before.acks_held);
    }
    calls as f64 / rounds as f64
}

const HOLD: Duration = Duration::from_micros(500);

/// One thread for both ends: every answer is sent in the tick of the
/// delivery it answers.
#[tokio::test(flavor = "current_thread")]
async fn acks_leave_with_the_answer_on_one_thread() {
    let held = ping_pong_send_calls("current_thread", HOLD).await;
    let alone = ping_pong_send_calls("current_thread", Duration::ZERO).await;
    assert!(held <= 2.5, "{held:.2} send calls per round trip");
    assert!(alone >= 3.5, "{alone:.2} send calls per round trip");
}

/// Two workers that call `soft::on_thread_park` when they run dry (as the
/// `rdmx` command line's do), both ends on them (the body of a
/// `#[tokio::test]` runs on `block_on`'s thread, which a worker wakes from
/// outside). Now and then the answer is sent from the other worker after
/// the first one let the ACK go.
#[test]
fn acks_leave_with_the_answer_on_two_workers_that_call_the_park_hook() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .on_thread_park(rdmx_transport_rdma::soft::on_thread_park)
        .enable_all()
        .build()
        .unwrap();
    let held = rt
        .block_on(rt.spawn(ping_pong_send_calls("hooked", HOLD)))
        .unwrap();
    let alone = rt
        .block_on(rt.spawn(ping_pong_send_calls("hooked", Duration::ZERO)))
        .unwrap();
    assert!(held <= 3.0, "{held:.2} send calls per round trip");
    assert!(alone >= 3.5, "{alone:.2} send calls per round trip");
}

/// Two workers that do not call the park hook: a held ACK leaves as soon as
/// the receive pass that held it is over (a yield there would cost
/// wake-ups), so the round trip is as without the hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_park_hook_two_workers_hold_no_ack_past_the_receive_pass() {
    let calls = tokio::spawn(ping_pong_send_calls("unhooked", HOLD))
        .await
        .unwrap();
    assert!(calls >= 3.5, "{calls:.2} send calls per round trip");
}

/// A ping-pong with nothing lost wakes the device's timer task about once
/// per [`GUARD_SLACK`]-sized stretch, not once per round trip: each send
/// arms a guard (the retransmission timer, the tail probe) that its ACK
/// moves or clears long before it comes, and those guards wait a
/// millisecond longer while the QP has seen no loss. (When each of them
/// woke the task, every 130 µs on this loopback, the task's wake-up on the
/// worker the application ran on handed the application to the other
/// worker: 8 B send round trips took 24-30 µs instead of 19-20.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_calm_ping_pong_does_not_wake_the_timer_per_round_trip() {
    /// The slack of the device's guard timers (1 ms).
    const GUARD_SLACK: Duration = Duration::from_millis(1);
    const N: u64 = 2000;
    let _timed = TIMED.lock().await;
    let (dev, p) = soft_pair().await;
    let echo = echo(&p, N);
    let c = &p.client;
    let before = dev.stats();
    let lost = || {
        c.stats().naks
            + c.stats().retransmits
            + p.server.stats().naks
            + p.server.stats().retransmits
    };
    let lost_before = lost();
    let start = std::time::Instant::now();
    for i in 0..N {
        let msg = rdmx_conformance::pattern(i, 8);
        c.send(msg.clone()).await.unwrap();
        assert_eq!(c.recv_message().await.unwrap()[..], msg[..], "message {i}");
    }
    let took = start.elapsed();
    echo.await.unwrap();
    let after = dev.stats();
    let passes = after.timer_passes - before.timer_passes;
    // A pass per slack-sized stretch, twice over for good measure, plus
    // some for the start; a pass per tail-probe margin (2 round trips +
    // 100 µs) would be several times as many.
    let allowed = 2 * took.as_micros() as u64 / GUARD_SLACK.as_micros() as u64 + 20;
    let lost = lost() - lost_before;
    eprintln!(
        "{N} round trips in {took:?}: {passes} timer passes (allowed {allowed}); \
         NAKs and resends {lost}"
    );
    // A resend (a timer that fired for nothing on a loaded host) makes the
    // guards prompt for a while: then there is nothing to check.
    if lost == 0 {
        assert!(passes <= allowed, "{passes} timer passes in {took:?}");
    }
}
