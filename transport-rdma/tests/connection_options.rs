//! Connection options that shape the data path: adaptive busy polling
//! (`Options::busy_poll`) moves the same bytes as sleeping, operations
//! beyond `Options::max_inflight` wait instead of failing, and bundles
//! (several small messages in one SEND, src/bundle.rs) under a small
//! receive window (`Options::recv_window`) arrive whole and in order and
//! return every credit they take (a leak would stall a transfer many times
//! the window), with fewer SENDs than messages, also behind the WRITEs of
//! `write_then_send_many`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use futures_util::stream::{FuturesUnordered, StreamExt};
use rdmx_conformance::{pattern, Suite};
use rdmx_core::{Access, Options, WriteThenSend};
use rdmx_transport_rdma::{RdmaTransport, SoftConfig, SoftRoce};

/// A soft RoCE device of its own (a free port).
fn soft_suite() -> Suite {
    let dev = SoftRoce::new(SoftConfig {
        port: 0,
        ..SoftConfig::default()
    })
    .unwrap();
    Suite::new(
        Arc::new(RdmaTransport::with_provider(Arc::new(dev))),
        "127.0.0.1:0",
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn busy_polling_connection_moves_exact_bytes() {
    let suite = soft_suite();
    let spin = || Options {
        busy_poll: Some(Duration::from_micros(50)),
        ..Options::default()
    };
    let p = suite.pair_with(spin(), spin()).await;
    let mr = p.server.domain().register(1 << 16, Access::ALL);
    let r = mr.remote();
    let mut last = Vec::new();
    for i in 0..200u64 {
        let data = pattern(i, 1 + (i as usize * 331) % (1 << 16));
        let dst = r.slice(0, data.len() as u64).unwrap();
        p.client.write(data.clone(), dst).await.unwrap();
        assert_eq!(p.client.read(dst).await.unwrap(), data);
        p.client.send(data.clone()).await.unwrap();
        assert_eq!(p.server.recv_message().await.unwrap(), data);
        last = data;
    }
    let word = u64::from_ne_bytes(last[..8].try_into().unwrap());
    let faa = p.client.fetch_and_add(r.word(0).unwrap(), 5).await.unwrap();
    assert_eq!(faa, word);
    assert_eq!(mr.load_u64(0), word.wrapping_add(5));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_beyond_max_inflight_wait() {
    let suite = soft_suite();
    let four = Options {
        max_inflight: 4,
        ..Options::default()
    };
    let p = suite.pair_with(four, Options::default()).await;
    assert_eq!(p.client.capabilities().max_inflight, 4);
    let mr = p.server.domain().register(300 * 8, Access::ALL);
    let r = mr.remote();
    let mut ops: FuturesUnordered<_> = (0..300u64)
        .map(|i| {
            let c = p.client.clone();
            async move {
                let w = r.word(i * 8).unwrap();
                c.write(i.to_ne_bytes().to_vec(), w).await?;
                c.fetch_and_add(w, 1000).await
            }
        })
        .collect();
    let mut olds = Vec::new();
    while let Some(r) = ops.next().await {
        olds.push(r.expect("waits for a place, never fails"));
    }
    olds.sort();
    assert_eq!(olds, (0..300u64).collect::<Vec<_>>());
    for i in 0..300 {
        assert_eq!(mr.load_u64(i * 8), i as u64 + 1000);
    }
}

/// Batch `b`'s message `i`: mostly small (bundled), every 17th past the
/// bundling limit (sent alone), some empty.
fn message(b: u64, i: u64) -> Bytes {
    let len = if i % 17 == 16 {
        20_000 + (i as usize * 7) % 3000
    } else {
        ((b * 131 + i * 977) % 3000) as usize
    };
    Bytes::from(pattern(b * 10_000 + i, len))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_bundle_small_messages_and_return_every_credit() {
    let suite = soft_suite();
    // A small window: 8 receives and 96 KiB, returned a quarter at a time.
    let small = Options {
        recv_credits: 8,
        recv_window: 96 << 10,
        max_message: 72 << 10,
        ..Options::default()
    };
    let p = suite.pair_with(Options::default(), small).await;
    const BATCHES: u64 = 300;
    const PER_BATCH: u64 = 40;
    let sender = {
        let c = p.client.clone();
        tokio::spawn(async move {
            for b in 0..BATCHES {
                let batch = (0..PER_BATCH).map(|i| message(b, i)).collect();
                c.send_many(batch).await.expect("send_many");
            }
        })
    };
    let mut bytes = 0u64;
    let got_all = tokio::time::timeout(Duration::from_secs(120), async {
        for b in 0..BATCHES {
            for i in 0..PER_BATCH {
                let m = p.server.recv_message().await.expect("recv");
                assert_eq!(m, message(b, i), "batch {b} message {i}");
                bytes += m.len() as u64;
            }
        }
    })
    .await;
    assert!(
        got_all.is_ok(),
        "stalled: a bundle's credits were not returned"
    );
    sender.await.unwrap();
    assert!(
        bytes > 100 * (96 << 10),
        "the transfer ({bytes} bytes) must dwarf the window"
    );
    let c = p.client.stats();
    let total = BATCHES * PER_BATCH;
    assert_eq!(c.sends, total, "each message counts as a send");
    assert_eq!(p.server.stats().recvs, total);
    // Per batch: two or three messages past the limit go alone, and the
    // small ones between them share a SEND.
    assert!(
        c.bundles_sent >= BATCHES && c.bundles_sent <= BATCHES * 4,
        "{} bundles for {BATCHES} batches",
        c.bundles_sent
    );
    // The connection is still whole: a plain send after all that.
    p.client.send(&b"after"[..]).await.unwrap();
    assert_eq!(&p.server.recv_message().await.unwrap()[..], b"after");
}

/// `write_then_send_many`: the WRITEs go first and the responses that follow
/// them share one SEND (a bundle), as a block target answers a burst of
/// reads; every response arrives, in order, after its data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_then_send_many_bundles_the_messages() {
    let suite = soft_suite();
    let p = suite.pair().await;
    let mr = p
        .server_opts
        .domain
        .register(16 << 12, Access::REMOTE_WRITE);
    let pairs = (0..16u64)
        .map(|i| WriteThenSend {
            dst: mr.remote().slice(i << 12, 4096).unwrap(),
            data: Bytes::from(pattern(500 + i, 4096)),
            msg: Bytes::from(i.to_le_bytes().to_vec()),
        })
        .collect();
    let before = p.client.stats();
    p.client.write_then_send_many(pairs).await.unwrap();
    for i in 0..16u64 {
        let m = p.server.recv_message().await.unwrap();
        assert_eq!(m, Bytes::from(i.to_le_bytes().to_vec()), "response {i}");
        let at = (i as usize) << 12;
        assert_eq!(
            mr.read()[at..at + 4096],
            pattern(500 + i, 4096)[..],
            "data {i}"
        );
    }
    let after = p.client.stats();
    assert_eq!(after.writes - before.writes, 16);
    assert_eq!(after.sends - before.sends, 16);
    assert_eq!(
        after.bundles_sent - before.bundles_sent,
        1,
        "one SEND for 16 responses"
    );
}

/// The READ/atomic depth is agreed at connect: each end offers its own
/// (`QpOptions::max_rd_atomic`) in the bootstrap and the path takes the
/// smaller, so a requester never keeps more outstanding than the other
/// end's responder serves. Far more reads and atomics than that depth,
/// posted at once, all complete exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_atomic_depth_is_the_smaller_offer_and_many_more_complete() {
    use rdmx_core::Transport;
    use rdmx_transport_rdma::verbs::QpOptions;
    let dev = Arc::new(
        SoftRoce::new(SoftConfig {
            port: 0,
            ..SoftConfig::default()
        })
        .unwrap(),
    );
    let deep = RdmaTransport::with_provider(dev.clone());
    let shallow = RdmaTransport::with_provider(dev).qp_options(QpOptions {
        max_rd_atomic: 5,
        ..QpOptions::default()
    });
    for (client_t, server_t) in [(&shallow, &deep), (&deep, &shallow), (&deep, &deep)] {
        let want = if std::ptr::eq(client_t, server_t) {
            128
        } else {
            5
        };
        let mut listener = server_t
            .listen("127.0.0.1:0", &Options::default())
            .await
            .unwrap();
        let addr = listener.local_addr().to_string();
        let (client, server) = tokio::join!(
            client_t.connect(&addr, &Options::default()),
            listener.accept()
        );
        let (client, server) = (client.unwrap(), server.unwrap());
        let depth = format!(", {want} READs/atomics outstanding)");
        for c in [&client, &server] {
            assert!(c.info().provider.ends_with(&depth), "{}", c.info().provider);
        }
        let all: Vec<u8> = (0..400u64).flat_map(|i| pattern(i, 64)).collect();
        let mr = server.domain().register_from(&all, Access::ALL);
        let r = mr.remote();
        let mut ops: FuturesUnordered<_> = (0..400u64)
            .map(|i| {
                let c = client.clone();
                async move {
                    let at = r.slice(i * 64, 64).unwrap();
                    let got = c.read(at).await?;
                    let old = c.fetch_and_add(r.word(i * 64 + 56)?, 1).await?;
                    Ok::<_, rdmx_core::Error>((i, got, old))
                }
            })
            .collect();
        let mut done = 0;
        while let Some(r) = ops.next().await {
            let (i, got, old) = r.unwrap();
            let data = pattern(i, 64);
            assert_eq!(got, data, "read {i}");
            assert_eq!(old.to_ne_bytes(), data[56..64], "atomic {i}");
            done += 1;
        }
        assert_eq!(done, 400);
        for i in 0..400u64 {
            let word = u64::from_ne_bytes(pattern(i, 64)[56..64].try_into().unwrap());
            assert_eq!(mr.load_u64(i as usize * 64 + 56), word.wrapping_add(1));
        }
    }
}
