//! `rdmx kv` as the README walks through it: two nodes, a gateway, and
//! unmodified `redis-cli`; metrics scraped from a node and the gateway; the
//! gateway's node list reloaded on SIGHUP.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn rdmx() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rdmx"))
}

fn port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Proc {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    fn start(args: &[&str], ready: &str) -> Proc {
        let mut child = rdmx()
            .args(args)
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (err, l2) = (child.stderr.take().unwrap(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                l2.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let p = Proc { child, log };
        p.wait_for(ready);
        p
    }

    fn wait_for(&self, text: &str) {
        let t = Instant::now();
        while !self.log.lock().unwrap().contains(text) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "no {text:?} in:\n{}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
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

fn scrape(port: u16) -> String {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .parse()
        .unwrap()
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
    let _a = Proc::start(
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
    let _b = Proc::start(
        &["kv", "server", "--listen", &u2, "--memory", "16m"],
        "bytes for items",
    );
    // The gateway starts with one node from a file, then gets both on SIGHUP.
    let file = std::env::temp_dir().join(format!("rdmx-kv-nodes-{}", std::process::id()));
    std::fs::write(&file, format!("# cache nodes\n{u1}\n")).unwrap();
    let g = Proc::start(
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
    let node = scrape(m1);
    assert_eq!(metric(&node, "rdmx_kv_items"), 50.0, "{node}");
    std::fs::write(&file, format!("{u1}\n{u2}\n")).unwrap();
    let status = Command::new("kill")
        .args(["-HUP", &g.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    g.wait_for("nodes reloaded");
    assert!(metric(&scrape(mg), "rdmx_kv_nodes_up") == 2.0);
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
    let gwm = scrape(mg);
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
