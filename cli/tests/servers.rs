//! Every server the CLI runs (`rdmx perf server`, `rdmx soak server`) keeps
//! serving whatever one peer does: an HTTP probe, a client of the other
//! transport, a wrong secret, an absurd region request. Each refusal is logged
//! and counted, and the counters are scraped from `--metrics` as Prometheus
//! text.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rdmx_core::{Options, Transport};
use rdmx_transport_tcp::TcpTransport;

fn rdmx() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rdmx"))
}

/// Status, stdout and stderr of a finished command, for assertion messages.
fn explain(out: &Output) -> String {
    format!(
        "status {}\n--- stdout\n{}\n--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn free_port() -> u16 {
    loop {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < 65000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}

/// A server process whose stderr is kept (and drained, so it never blocks).
struct Spawned {
    child: Child,
    log: Arc<Mutex<String>>,
}

impl Drop for Spawned {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Spawned {
    fn start(args: &[&str], ready: &str) -> Spawned {
        let mut child = rdmx()
            .args(args)
            .env("RDMX_LOG", "warn")
            .stderr(Stdio::piped())
            .stdout(Stdio::null())
            .spawn()
            .unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let err = child.stderr.take().unwrap();
        let l2 = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut l = l2.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        let s = Spawned { child, log };
        s.wait_for(ready);
        s
    }

    fn wait_for(&self, text: &str) {
        let t = Instant::now();
        while !self.log.lock().unwrap().contains(text) {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "no {text:?} in the server's stderr:\n{}",
                self.log.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn alive(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

/// Send `bytes` and read until the peer closes (or 5 s pass).
fn probe(addr: &str, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

/// GET a URL path from a metrics endpoint.
fn scrape(addr: &str) -> String {
    let out = probe(addr, b"GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n");
    let text = String::from_utf8(out).unwrap();
    assert!(text.starts_with("HTTP/1.1 200 OK"), "{text}");
    text
}

/// The value of an unlabelled metric.
fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("no {name} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn perf_server_survives_bad_peers_and_exports_metrics() {
    let port = free_port();
    let mport = free_port();
    let (addr, raw, maddr) = (
        format!("127.0.0.1:{port}"),
        format!("127.0.0.1:{}", port + 1),
        format!("127.0.0.1:{mport}"),
    );
    let mut server = Spawned::start(
        &[
            "perf",
            "server",
            "--listen",
            &addr,
            "--secret",
            "s3cret",
            "--raw-baseline",
            "--metrics",
            &maddr,
        ],
        "raw-tcp baseline on",
    );
    // An HTTP probe at the rdmx port: refused, logged, still serving.
    let answer = probe(&addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    assert!(answer.len() < 200, "{answer:?}");
    server.wait_for("not an rdmx peer");
    // The raw baseline without the secret: refused (verdict 1, closed).
    let answer = probe(&raw, &[0u8; 32]);
    assert_eq!(answer.len(), 17, "a nonce, then the refusal: {answer:?}");
    assert_eq!(answer[16], 1);
    // A client with the secret asking for a 1 TiB region: told why, not served.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let refusal = rt.block_on(async {
        let c = TcpTransport::new()
            .connect(&addr, &Options::default().secret("s3cret"))
            .await
            .unwrap();
        c.send((1u64 << 40).to_le_bytes().to_vec()).await.unwrap();
        c.recv_message().await.unwrap()
    });
    let refusal = String::from_utf8_lossy(&refusal).to_string();
    assert!(
        refusal.starts_with("ERR ") && refusal.contains("at most 1073741824 bytes per client"),
        "{refusal}"
    );
    // A client without the secret: refused.
    let out = rdmx()
        .args([
            "perf",
            "client",
            &format!("tcp://{addr}"),
            "--op",
            "faa",
            "--iters",
            "5",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", explain(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("authentication failed"),
        "{}",
        explain(&out)
    );
    assert!(server.alive());

    // And a proper client, baseline included, still gets a full run.
    let out = rdmx()
        .args([
            "perf",
            "client",
            &format!("tcp://{addr}"),
            "--secret",
            "s3cret",
        ])
        .args([
            "--op",
            "write,send",
            "--sizes",
            "64",
            "--iters",
            "20",
            "--duration-ms",
            "30",
        ])
        .args(["--baseline", "raw-tcp"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", explain(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("tcp ")).count(),
        2,
        "{}",
        explain(&out)
    );
    assert!(
        stdout.contains("lat_x = p50 / raw_p50"),
        "{}",
        explain(&out)
    );

    // The scrape counts the refusals and shows the live connection's counters.
    let text = scrape(&maddr);
    assert!(metric(&text, "rdmx_accept_errors_total") >= 2, "{text}");
    assert!(
        metric(&text, "rdmx_handshake_failures_total") >= 2,
        "{text}"
    );
    assert!(metric(&text, "rdmx_connections_total") >= 2, "{text}");
    assert!(
        text.contains("# TYPE rdmx_connection_bytes_received_total counter"),
        "{text}"
    );
    assert!(server.alive());
}

#[test]
fn soak_server_survives_bad_peers() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let mut server = Spawned::start(
        &["soak", "server", "--listen", &addr, "--transport", "tcp"],
        "rdmx soak server: tcp on",
    );
    let _ = probe(&addr, b"GET / HTTP/1.1\r\n\r\n");
    let _ = probe(&addr, &[0xff; 64]);
    // An rdma:// client at this TCP-only server: falls back at once, says why.
    let out = rdmx()
        .args([
            "soak",
            "client",
            &format!("rdma://{addr}"),
            "--bytes",
            "3m",
            "--chunk",
            "1m",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", explain(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("tcp over kernel-tcp: ok: 3145728 bytes (3 MiB) verified"),
        "{}",
        explain(&out)
    );
    assert!(
        !stdout.contains("retransmits"),
        "no RDMA counters on a TCP run: {stdout}"
    );
    assert!(server.alive());
    server.wait_for("not an rdmx peer");
    // A chunk the server cannot lend is refused before any traffic.
    let out = rdmx()
        .args([
            "soak",
            "client",
            &format!("tcp://{addr}"),
            "--chunk",
            "129m",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("134217728 bytes (128 MiB"),
        "{}",
        explain(&out)
    );
    // Sends larger than the peer's message limit go as several messages.
    let out = rdmx()
        .args([
            "soak",
            "client",
            &format!("tcp://{addr}"),
            "--bytes",
            "96m",
            "--chunk",
            "32m",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", explain(&out));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["bytes"], 96u64 << 20, "{r}");
    assert_eq!(r["chunk"], 32u64 << 20);
    assert!(r.get("rdma").is_none(), "{r}");
    assert!(server.alive());
}
