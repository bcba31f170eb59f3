//! `rdmx perf` as a user runs it: in loopback, and as two separate processes.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn rdmx() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rdmx"))
}

fn free_port() -> u16 {
    // Two consecutive free ports: rdmx on p, the raw baseline on p + 1.
    loop {
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let p = a.local_addr().unwrap().port();
        if p < 65000 && std::net::TcpListener::bind(("127.0.0.1", p + 1)).is_ok() {
            return p;
        }
    }
}

#[test]
fn loopback_json_and_svg() {
    let svg = std::env::temp_dir().join(format!("rdmx-perf-{}.svg", std::process::id()));
    let out = rdmx()
        .args([
            "perf",
            "--loopback",
            "--json",
            "--baseline",
            "raw-tcp",
            "--iters",
            "40",
        ])
        .args(["--duration-ms", "60", "--sizes", "8,4k,64k", "--svg"])
        .arg(&svg)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    // 3 sizes for send, write, read; 1 for cas and faa.
    assert_eq!(rows.len(), 11);
    for r in &rows {
        for key in [
            "transport",
            "op",
            "size",
            "p50_us",
            "p99_us",
            "mb_per_s",
            "ops_per_s",
        ] {
            assert!(r.get(key).is_some(), "{key} missing in {r}");
        }
        assert_eq!(r["transport"], "tcp");
        let p50 = r["p50_us"].as_f64().unwrap();
        let p99 = r["p99_us"].as_f64().unwrap();
        assert!(p50 > 0.0 && p99 >= p50, "{r}");
        assert!(r["ops_per_s"].as_f64().unwrap() > 0.0);
        assert!(r["baseline"]["p50_us"].as_f64().unwrap() > 0.0);
        let ratio = r["lat_ratio"].as_f64().unwrap();
        let expect = p50 / r["baseline"]["p50_us"].as_f64().unwrap();
        assert!(
            (ratio - expect).abs() < 1e-9,
            "ratio is computed from the two p50s"
        );
    }
    let ops: std::collections::BTreeSet<&str> =
        rows.iter().map(|r| r["op"].as_str().unwrap()).collect();
    assert_eq!(
        ops,
        ["cas", "faa", "read", "send", "write"]
            .into_iter()
            .collect()
    );
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    assert!(svg_text.starts_with("<svg") && svg_text.contains("bandwidth"));
    std::fs::remove_file(svg).unwrap();
}

struct Server(std::process::Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(port: u16) -> Server {
    let mut child = rdmx()
        .args(["perf", "server", "--listen", &format!("127.0.0.1:{port}")])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait for the ready line.
    let mut line = String::new();
    BufReader::new(child.stderr.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("rdmx perf server"), "{line}");
    Server(child)
}

#[test]
fn server_and_client_as_separate_processes() {
    let port = free_port();
    let _server = start_server(port);
    let out = rdmx()
        .args([
            "perf",
            "client",
            &format!("tcp://127.0.0.1:{port}"),
            "--op",
            "write,read,faa",
        ])
        .args([
            "--sizes",
            "8,1m",
            "--iters",
            "30",
            "--duration-ms",
            "50",
            "--baseline",
            "raw-tcp",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{}",
        stdout,
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("over tcp (provider kernel-tcp)"),
        "{stdout}"
    );
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("tcp ")).count(),
        5,
        "{stdout}"
    );
}

#[test]
fn killed_server_fails_the_client_quickly() {
    let port = free_port();
    let mut server = start_server(port);
    let client = rdmx()
        .args([
            "perf",
            "client",
            &format!("tcp://127.0.0.1:{port}"),
            "--op",
            "write",
        ])
        .args(["--sizes", "1m", "--mode", "bw", "--duration-ms", "30000"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    server.0.kill().unwrap();
    let t = Instant::now();
    let out = client.wait_with_output().unwrap();
    assert!(!out.status.success());
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "took {:?}",
        t.elapsed()
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("disconnected"), "{err}");
}

#[test]
fn unknown_transport_is_a_clear_error() {
    let out = rdmx()
        .args(["perf", "--loopback", "--transport", "warp"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not built into this rdmx"));
}

fn captures() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/rocev2-captures")
}

#[test]
fn pcap_check_passes_real_captures_and_fails_corrupt_ones() {
    let hns = captures().join("hns_roce_rc_send_oferby_proxy.pcap");
    let out = rdmx().args(["pcap", "check"]).arg(&hns).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("123 frames, 105 RoCEv2 (105 ok, 0 bad), 18 other"),
        "{text}"
    );
    assert!(text.contains("SEND_LAST_WITH_IMMEDIATE"));

    // Flip one payload bit of the first RoCEv2 frame: the ICRC must catch it.
    let mut bytes = std::fs::read(&hns).unwrap();
    let frames = rdmx_roce_proto::pcap::read_capture(&bytes[..]).unwrap();
    let first = frames
        .iter()
        .position(|c| {
            rdmx_roce_proto::RoceFrame::parse(&c.data)
                .ok()
                .flatten()
                .is_some()
        })
        .unwrap();
    // Locate that frame's bytes in the file and flip a bit inside its BTH payload area.
    let needle = &frames[first].data;
    let at = bytes
        .windows(needle.len())
        .position(|w| w == &needle[..])
        .unwrap();
    bytes[at + needle.len() - 10] ^= 0x04;
    let bad = std::env::temp_dir().join(format!("rdmx-bad-{}.pcap", std::process::id()));
    std::fs::write(&bad, &bytes).unwrap();
    let out = rdmx().args(["pcap", "check"]).arg(&bad).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("ICRC mismatch") && text.contains("(104 ok, 1 bad)"),
        "{text}"
    );
    std::fs::remove_file(bad).unwrap();
}
