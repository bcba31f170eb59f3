//! `rdmx kv` as the README walks through it: two nodes, a gateway, and
//! unmodified `redis-cli`; metrics scraped from a node and the gateway; the
//! gateway's node list reloaded on SIGHUP.

mod common;

use std::process::Command;

use common::{metric, scrape, Spawned};

fn port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .args(["-p", &port.to_string()])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
#[cfg_attr(
    rdmx_missing_redis,
    ignore = "needs redis-cli (apt-get install redis-tools); CI runs it"
)]
fn two_nodes_a_gateway_and_redis_cli() {
    let (n1, n2, gw, m1, mg) = (port(), port(), port(), port(), port());
    let u1 = format!("tcp://127.0.0.1:{n1}");
    let u2 = format!("rdma://127.0.0.1:{n2}");
    let _a = Spawned::start(
        &[
            "kv",
            "server",
            "--listen",
            &u1,
            "--memory",
            "16m",
            "--metrics",
            &format!("127.0.0.1:{m1}"),
        ],
        "bytes for items",
    );
    let _b = Spawned::start(
        &["kv", "server", "--listen", &u2, "--memory", "16m"],
        "bytes for items",
    );
    // The gateway starts with one node from a file, then gets both on SIGHUP.
    let file = std::env::temp_dir().join(format!("rdmx-kv-nodes-{}", std::process::id()));
    std::fs::write(&file, format!("# cache nodes\n{u1}\n")).unwrap();
    let g = Spawned::start(
        &[
            "kv",
            "resp",
            "--listen",
            &format!("127.0.0.1:{gw}"),
            "--nodes-file",
            file.to_str().unwrap(),
            "--metrics",
            &format!("127.0.0.1:{mg}"),
        ],
        "node(s) up",
    );
    assert!(g.log.lock().unwrap().contains("for 1 node(s) up"));
    for i in 0..50 {
        assert_eq!(
            cli(gw, &["set", &format!("k{i}"), &format!("v{i}")]),
            "OK\n"
        );
    }
    let node = scrape(&format!("127.0.0.1:{m1}"));
    assert_eq!(metric(&node, "rdmx_kv_items"), 50.0, "{node}");
    std::fs::write(&file, format!("{u1}\n{u2}\n")).unwrap();
    let status = Command::new("kill")
        .args(["-HUP", &g.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    g.wait_for("nodes reloaded");
    assert!(metric(&scrape(&format!("127.0.0.1:{mg}")), "rdmx_kv_nodes_up") == 2.0);
    // About half the keys now belong to the new, empty node: misses, not errors.
    let mut hits = 0;
    for i in 0..50 {
        let v = cli(gw, &["get", &format!("k{i}")]);
        if v == format!("v{i}\n") {
            hits += 1;
        } else {
            assert_eq!(v, "\n", "a miss prints an empty line in raw mode");
        }
    }
    assert!(
        (10..50).contains(&hits),
        "{hits} of 50 stayed on the first node"
    );
    assert_eq!(cli(gw, &["incrby", "n", "5"]), "5\n");
    let gwm = scrape(&format!("127.0.0.1:{mg}"));
    assert!(
        metric(&gwm, "rdmx_kv_one_sided_hits_total") >= hits as f64,
        "{gwm}"
    );
    assert!(
        metric(&gwm, "rdmx_kv_gateway_commands_total") >= 101.0,
        "{gwm}"
    );
    let _ = std::fs::remove_file(&file);
}

/// `rdmx kv bench` against two nodes: a loading run, then a run after a
/// warm-up in a new process. Every GET finds its value (all keys loaded),
/// the counts add up, and a one-sided GET takes one READ (the pointer the
/// client remembered) or two (bucket, then item), never more.
#[test]
fn kv_bench_loads_warms_up_and_reports() {
    let (n1, n2) = (port(), port());
    let (u1, u2) = (
        format!("tcp://127.0.0.1:{n1}"),
        format!("tcp://127.0.0.1:{n2}"),
    );
    let _a = Spawned::start(
        &["kv", "server", "--listen", &u1, "--memory", "16m"],
        "bytes for items",
    );
    let _b = Spawned::start(
        &["kv", "server", "--listen", &u2, "--memory", "16m"],
        "bytes for items",
    );
    let nodes = format!("{u1},{u2}");
    let bench = |extra: &[&str]| -> serde_json::Value {
        let out = common::rdmx()
            .args(["kv", "bench", "--nodes", &nodes, "--keys", "500"])
            .args(["--get-percent", "100", "--duration-ms", "300", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", common::explain(&out));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    for r in [
        bench(&["--load", "500"]),
        bench(&["--no-load", "--warmup-ms", "300"]),
        bench(&["--no-load", "--path", "rpc"]),
    ] {
        let gets = r["gets"].as_u64().unwrap();
        assert!(gets > 0, "{r}");
        assert_eq!(r["sets"].as_u64(), Some(0), "{r}");
        assert_eq!(r["hit_ratio"].as_f64(), Some(1.0), "{r}");
        let reads = r["reads_per_get"].as_f64().unwrap();
        if r["path"] == "one-sided" {
            assert!((1.0..=2.0).contains(&reads), "{r}");
        } else {
            assert_eq!(reads, 0.0, "{r}");
        }
    }
}
