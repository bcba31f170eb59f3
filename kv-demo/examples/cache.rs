//! The cache from a Rust program: two nodes and a cluster client in one
//! process, over the TCP transport or soft RoCE.
//!
//! ```text
//! cargo run -p rdmx-kv --example cache            # tcp://
//! cargo run -p rdmx-kv --example cache -- rdma    # rdma:// (soft RoCE)
//! ```
//!
//! It stores values by RPC, reads them back with one-sided GETs (no node
//! code runs for them), compares them with GETs by RPC, batches an MGET
//! across both nodes, counts with INCR, lets a key expire, and prints the
//! client's counters. Every value read is checked against what was written;
//! a mismatch exits with an error.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rdmx_core::{Options, Transports};
use rdmx_kv::{Client, ClientConfig, Cond, GetPath, Node, Ttl};

fn transports() -> Transports {
    Transports::new()
        .with(rdmx_transport_tcp::TcpTransport::new())
        .with(rdmx_transport_rdma::RdmaTransport::new())
}

/// Start a node with `memory` bytes for items on an ephemeral port; its URL.
async fn start_node(scheme: &str, memory: u64) -> Result<String, Box<dyn std::error::Error>> {
    let (node, listener) = Node::listen(
        &transports(),
        &format!("{scheme}://127.0.0.1:0"),
        memory,
        Options::default(),
    )
    .await?;
    let url = format!("{scheme}://{}", listener.local_addr());
    tokio::spawn(async move {
        if let Err(e) = node.serve(listener).await {
            eprintln!("node stopped: {e}");
        }
    });
    Ok(url)
}

fn value_of(i: u32) -> Vec<u8> {
    format!("value {i} ")
        .repeat(1 + i as usize % 20)
        .into_bytes()
}

fn check(what: &str, got: Option<&[u8]>, want: Option<&[u8]>) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let scheme = std::env::args().nth(1).unwrap_or_else(|| "tcp".into());
    let nodes = vec![
        start_node(&scheme, 16 << 20).await?,
        start_node(&scheme, 16 << 20).await?,
    ];
    println!("nodes: {}", nodes.join(", "));
    let client = Client::with_transports(ClientConfig::new(nodes), transports()).await;
    println!("up: {}", client.nodes_up().len());

    // SET by RPC; the node answers with where it put the item, so the next
    // GET of the key is a single one-sided READ.
    for i in 0..100u32 {
        let key = format!("user:{i}");
        client
            .set(key.as_bytes(), &value_of(i), Ttl::Never, Cond::Always)
            .await?;
    }
    // GET one-sided, then by RPC: the same bytes.
    for i in 0..100u32 {
        let key = format!("user:{i}");
        let one_sided = client.get(key.as_bytes()).await?;
        let rpc = client.get_with(key.as_bytes(), GetPath::Rpc).await?;
        check(&key, one_sided.as_deref(), Some(&value_of(i)))?;
        check(&key, rpc.as_deref(), one_sided.as_deref())?;
    }
    // MGET: every key's reads at once, across both nodes.
    let keys: Vec<String> = (0..10u32).map(|i| format!("user:{i}")).collect();
    let mut refs: Vec<&[u8]> = keys.iter().map(|k| k.as_bytes()).collect();
    refs.push(b"nobody");
    let got = client.mget(&refs, GetPath::OneSided).await;
    for (i, r) in got.iter().enumerate() {
        let want = (i < 10).then(|| value_of(i as u32));
        let r = r.as_ref().map_err(|e| format!("mget: {e}"))?;
        check("mget", r.as_deref(), want.as_deref())?;
    }
    // Conditional SET, INCR, DEL.
    let stored = client
        .set(b"user:0", b"other", Ttl::Never, Cond::IfAbsent)
        .await?;
    if stored {
        return Err("SET NX replaced a live key".into());
    }
    for _ in 0..5 {
        client.incr(b"visits", 2).await?;
    }
    let visits = client.get(b"visits").await?;
    check("visits", visits.as_deref(), Some(b"10"))?;
    if client.del(&[b"user:1", b"user:2"]).await? != 2 {
        return Err("DEL did not remove two keys".into());
    }
    check("deleted", client.get(b"user:1").await?.as_deref(), None)?;
    // TTL: a miss for every reader once it has passed on the node's clock.
    client
        .set(b"session", b"token", Ttl::In(200), Cond::Always)
        .await?;
    check(
        "session",
        client.get(b"session").await?.as_deref(),
        Some(b"token"),
    )?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    check("expired", client.get(b"session").await?.as_deref(), None)?;
    println!("keys stored: {}", client.dbsize().await?);

    let c = client.counters();
    println!(
        "one-sided GETs: {} hits, {} misses, {} READs, {} retries, {} fell back to RPC",
        c.one_sided_hits.load(Ordering::Relaxed),
        c.one_sided_misses.load(Ordering::Relaxed),
        c.one_sided_reads.load(Ordering::Relaxed),
        c.one_sided_retries.load(Ordering::Relaxed),
        c.one_sided_fallbacks.load(Ordering::Relaxed),
    );
    println!(
        "RPC GETs: {} hits, {} misses",
        c.rpc_hits.load(Ordering::Relaxed),
        c.rpc_misses.load(Ordering::Relaxed)
    );
    println!("ok");
    Ok(())
}
