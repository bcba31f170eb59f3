//! Every server the CLI runs (`rdmx perf server`, `rdmx soak server`) keeps
//! serving whatever one peer does: an HTTP probe, a client of the other
//! transport, a wrong secret, an absurd region request. Each refusal is logged
//! and counted, and the counters are scraped from `--metrics` as Prometheus
//! text.

mod common;

use common::{explain, free_port, metric, probe, rdmx, scrape, Spawned};
use rdmx_core::{Options, Transport};
use rdmx_transport_tcp::TcpTransport;

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
    assert!(metric(&text, "rdmx_accept_errors_total") >= 2.0, "{text}");
    assert!(
        metric(&text, "rdmx_handshake_failures_total") >= 2.0,
        "{text}"
    );
    assert!(metric(&text, "rdmx_connections_total") >= 2.0, "{text}");
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

/// A soak whose server dies mid-run reports what it verified before failing.
#[test]
fn soak_reports_partial_progress_when_the_server_dies() {
    let port = free_port();
    let addr = format!("127.0.0.1:{port}");
    let server = Spawned::start(
        &["soak", "server", "--listen", &addr, "--transport", "tcp"],
        "rdmx soak server: tcp on",
    );
    let client = rdmx()
        .args([
            "soak",
            "client",
            &format!("tcp://{addr}"),
            "--bytes",
            "64g",
            "--chunk",
            "1m",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    drop(server);
    let out = client.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", explain(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.contains("FAILED after"))
        .unwrap_or_else(|| panic!("{}", explain(&out)));
    let bytes: u64 = line
        .split("FAILED after ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!(bytes >= 1 << 20, "{line}");
    assert!(stdout.contains("error: "), "{}", explain(&out));
}

/// `rdmx doctor | head -1`: when the reader goes away the tool stops quietly
/// with SIGPIPE's shell status, 141, and no panic.
#[test]
fn a_closed_stdout_ends_the_tool_quietly() {
    let (reader, writer) = std::io::pipe().expect("pipe");
    drop(reader);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_rdmx"))
        .arg("doctor")
        .stdout(writer)
        .stderr(std::process::Stdio::piped())
        .output()
        .expect("run rdmx");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "stderr: {stderr}");
}
