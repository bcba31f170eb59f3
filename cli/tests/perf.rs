//! `rdmx perf` as a user runs it: in loopback, and as two separate processes.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{explain, free_port, rdmx};

/// The JSON rows a successful `rdmx perf --json` printed, one per line.
fn json_rows(out: &std::process::Output) -> Vec<serde_json::Value> {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone())
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
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
    let rows = json_rows(&out);
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
        // Protocol counters are RDMA's (see netns.rs: perf_reports_what_loss_cost).
        assert!(r.get("rdma").is_none(), "{r}");
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
        // CPU per operation, for rdmx and for the baseline, and their ratio.
        let cpu = r["cpu_us_per_op"].as_f64().unwrap();
        let cpu_b = r["baseline"]["cpu_us_per_op"].as_f64().unwrap();
        assert!(cpu > 0.0 && cpu_b > 0.0, "{r}");
        let cpu_x = r["cpu_ratio"].as_f64().unwrap();
        assert!((cpu_x - cpu / cpu_b).abs() < 1e-9, "{r}");
        // Every operation runs on the CPU for a while, and no more than the
        // process's threads can give it: a figure off by a unit would fail.
        let wall_us = 1e6 / r["ops_per_s"].as_f64().unwrap();
        assert!(
            cpu < wall_us * 16.0,
            "{cpu} µs of CPU per {wall_us} µs op: {r}"
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
        .args([
            "perf",
            "server",
            "--raw-baseline",
            "--listen",
            &format!("127.0.0.1:{port}"),
        ])
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
        stdout.contains("over tcp (provider kernel-tcp, 1 lane)"),
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

/// The real-NIC captures kept in the repo (`RDMX_CAPTURES` overrides, as in
/// roce-proto's capture tests).
fn captures() -> std::path::PathBuf {
    std::env::var_os("RDMX_CAPTURES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/rocev2-captures")
        })
}

#[test]
fn pcap_check_passes_real_captures_and_fails_corrupt_ones() {
    let hns = captures().join("hns_roce_rc_send_oferby_proxy.pcap");
    let out = rdmx().args(["pcap", "check"]).arg(&hns).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", explain(&out));
    assert!(
        text.contains("123 frames, 105 RoCEv2 (105 ok, 0 bad), 18 other"),
        "{}",
        explain(&out)
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
    assert!(!out.status.success(), "{}", explain(&out));
    assert!(
        text.contains("ICRC mismatch") && text.contains("(104 ok, 1 bad)"),
        "{}",
        explain(&out)
    );
    std::fs::remove_file(bad).unwrap();
}

/// `rdmx perf --capture` over the soft RoCE transport writes the engine's real
/// packets: every one passes `rdmx pcap check` (ICRC included), and tshark
/// (when installed; required in CI) decodes the same opcodes, QPNs, PSNs and
/// UDP lengths that our own decoder reads from the file.
#[test]
#[cfg_attr(
    rdmx_missing_tshark,
    ignore = "needs tshark (apt-get install tshark); CI runs it"
)]
fn perf_capture_over_soft_roce_decodes_with_tshark() {
    let dir = std::env::temp_dir().join(format!("rdmx-cap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let pcap = dir.join("perf.pcap");
    let out = rdmx()
        .args([
            "perf",
            "--loopback",
            "--transport",
            "rdma",
            "--mode",
            "lat",
            "--iters",
            "20",
        ])
        .args(["--op", "send,write,read,cas,faa", "--sizes", "8,9000"])
        .arg("--capture")
        .arg(&pcap)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("soft-roce"));
    let check = rdmx().args(["pcap", "check"]).arg(&pcap).output().unwrap();
    assert!(
        check.status.success(),
        "{}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let cap =
        rdmx_roce_proto::pcap::read_capture_file(std::fs::File::open(&pcap).unwrap()).unwrap();
    let port = cap.roce_port.expect("rdmx notes the engine's port");
    let ours: Vec<(u8, u32, u32, u16)> = cap
        .frames
        .iter()
        .filter_map(|c| {
            rdmx_roce_proto::RoceFrame::parse_on(&c.data, port)
                .ok()
                .flatten()
        })
        .map(|f| {
            (
                f.packet.bth.opcode.0,
                f.packet.bth.dest_qp,
                f.packet.bth.psn,
                f.udp.len,
            )
        })
        .collect();
    assert!(ours.len() > 200, "{} frames", ours.len());
    let ops: std::collections::HashSet<u8> = ours.iter().map(|o| o.0).collect();
    for want in [0x04u8, 0x0A, 0x0C, 0x10, 0x11, 0x12, 0x13, 0x14] {
        assert!(ops.contains(&want), "no opcode {want:#x} in {ops:?}");
    }
    // The test is ignored where tshark is missing (see build.rs); here it is
    // required. The engine's port (noted in the capture) is decoded as RoCEv2.
    let out = Command::new("tshark")
        .arg("-r")
        .arg(&pcap)
        .args(["-d", &format!("udp.port=={port},infiniband")])
        .args([
            "-T",
            "fields",
            "-E",
            "separator=;",
            "-e",
            "infiniband.bth.opcode",
        ])
        .args(["-e", "infiniband.bth.destqp", "-e", "infiniband.bth.psn"])
        .args(["-e", "udp.length"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let num = |s: &str| -> u64 {
        let s = s.trim();
        match s.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).unwrap(),
            None => s.parse().unwrap(),
        }
    };
    let theirs: Vec<(u8, u32, u32, u16)> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| {
            let v: Vec<&str> = l.split(';').collect();
            (
                num(v[0]) as u8,
                num(v[1]) as u32,
                num(v[2]) as u32,
                num(v[3]) as u16,
            )
        })
        .collect();
    assert_eq!(theirs, ours, "tshark and rdmx disagree on the capture");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `rdmx doctor --json` on a fake sysfs tree: the device, its v2 GID and a
/// troubling counter appear, with advice; the wake-up probe's figures too,
/// unless skipped.
#[test]
fn doctor_reads_a_fake_sysfs_tree() {
    use rdmx_transport_rdma::sysfs::fake::{counter, port};
    let root = std::env::temp_dir().join(format!("rdmx-doctor-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    port(
        &root,
        "rxe0",
        1,
        "4: ACTIVE",
        "Ethernet",
        "4096 (5)",
        &[(
            1,
            "0000:0000:0000:0000:0000:ffff:c612:0001",
            "RoCE v2",
            "veth0",
        )],
    );
    counter(&root, "rxe0", 1, true, "out_of_sequence", 5);
    let out = rdmx()
        .args(["doctor", "--json", "--sysfs"])
        .arg(&root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["devices"][0]["name"], "rxe0");
    assert_eq!(j["devices"][0]["ports"][0]["gids"][0]["addr"], "198.18.0.1");
    assert_eq!(j["devices"][0]["ports"][0]["gids"][0]["kind"], "RoceV2");
    let findings = j["findings"].as_array().unwrap();
    assert!(findings
        .iter()
        .any(|f| f["what"].as_str().unwrap().contains("out_of_sequence = 5")));
    // The wake-up probe ran: its figures, and a finding that names them.
    assert_eq!(j["wake"]["rounds"], 2000);
    let same = j["wake"]["same_cpu_us"].as_f64().unwrap();
    assert!(same > 0.0, "{}", j["wake"]);
    assert!(findings
        .iter()
        .any(|f| f["what"].as_str().unwrap().starts_with("waking a thread: ")));
    // TCP's congestion control, as this host's procfs has it.
    let cc = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_congestion_control")
        .ok()
        .map(|s| s.trim().to_string());
    assert_eq!(
        j["tcp_congestion_control"].as_str().map(str::to_string),
        cc,
        "{}",
        j["tcp_congestion_control"]
    );
    // And it can be skipped.
    let out = rdmx()
        .args(["doctor", "--json", "--no-wake-probe", "--sysfs"])
        .arg(&root)
        .output()
        .unwrap();
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(j["wake"].is_null(), "{}", j["wake"]);
    let _ = std::fs::remove_dir_all(&root);
}

/// A capture with no RoCEv2 packet verifies nothing: that fails unless
/// `--allow-empty`; a truncated file names the frame and byte offset.
#[test]
fn pcap_check_refuses_empty_and_truncated_captures() {
    let ib = captures().join("native_ib_erf_2008_infiniband.pcap");
    let out = rdmx().args(["pcap", "check"]).arg(&ib).output().unwrap();
    assert!(!out.status.success(), "{}", explain(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nothing verified"),
        "{}",
        explain(&out)
    );
    let out = rdmx()
        .args(["pcap", "check", "--allow-empty"])
        .arg(&ib)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", explain(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("43 frames, 0 RoCEv2"),
        "{}",
        explain(&out)
    );
    // The real-NIC RoCEv2 capture, decoded on another port, verifies nothing.
    let hns = captures().join("hns_roce_rc_send_oferby_proxy.pcap");
    let out = rdmx()
        .args(["pcap", "check", "--port", "4792"])
        .arg(&hns)
        .output()
        .unwrap();
    assert!(!out.status.success(), "{}", explain(&out));
    // Cut the file inside its tenth record.
    let bytes = std::fs::read(&hns).unwrap();
    let mut at = 24;
    for _ in 0..9 {
        let incl = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        at += 16 + incl;
    }
    let cut = std::env::temp_dir().join(format!("rdmx-cut-{}.pcap", std::process::id()));
    std::fs::write(&cut, &bytes[..at + 30]).unwrap();
    let out = rdmx().args(["pcap", "check"]).arg(&cut).output().unwrap();
    std::fs::remove_file(&cut).unwrap();
    assert!(!out.status.success(), "{}", explain(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("frame 10") && err.contains(&format!("byte offset {at}")),
        "{}",
        explain(&out)
    );
}

/// Every option is checked before connecting, and the error names the value
/// and what is allowed.
#[test]
fn perf_refuses_bad_options_before_connecting() {
    let cases: [(&[&str], &str); 8] = [
        (&["--op", "writ"], "unknown --op \"writ\""),
        (&["--mode", "latency"], "invalid value 'latency'"),
        (&["--window", "0"], "--window"),
        (&["--sizes", "99999999999g"], "bad size \"99999999999g\""),
        (&["--sizes", "512m", "--window", "16"], "1 GiB"),
        (&["--slots", "0"], "--slots"),
        (
            &["--sizes", "512m", "--window", "1", "--slots", "4"],
            "times --slots (4)",
        ),
        (
            &["--transport", "tcp", "--capture", "x.pcap"],
            "a tcp run has none",
        ),
    ];
    for (args, want) in cases {
        let t = Instant::now();
        // A client URL nobody listens on: the check must come first.
        let out = rdmx()
            .args(["perf", "client", "tcp://127.0.0.1:9"])
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}: {}", explain(&out));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {}", explain(&out));
        assert!(
            !err.contains("connect failed"),
            "{args:?}: {}",
            explain(&out)
        );
        assert!(t.elapsed() < Duration::from_secs(5));
        assert_eq!(
            err.matches(want).count(),
            1,
            "printed once: {}",
            explain(&out)
        );
    }
    // A send larger than the peer takes: named, with the limit.
    let out = rdmx()
        .args([
            "perf",
            "--loopback",
            "--op",
            "send",
            "--sizes",
            "32m",
            "--window",
            "1",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("at most 16777216 bytes"),
        "{}",
        explain(&out)
    );
}

/// Logs carry no colour codes when stderr is not a terminal, and a failure
/// is printed once.
#[test]
fn errors_are_printed_once_without_colour() {
    let out = rdmx()
        .args(["perf", "client", "rdma://127.0.0.1:9", "--op", "faa"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains('\u{1b}'), "ANSI escape in {err:?}");
    assert_eq!(err.matches("Connection refused").count(), 1, "{err}");
    let help = rdmx().arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for sub in ["perf", "pcap", "soak", "doctor", "kv", "pingpong"] {
        assert!(
            help.contains(&format!("\n  {sub} ")),
            "{sub} missing from\n{help}"
        );
    }
}

/// `rdmx pingpong` refuses what ibv_rc_pingpong could not do, before touching
/// the network; the exchange itself runs against ibv_rc_pingpong on rxe in
/// the testbed (testbed/tests.sh pingpong).
#[test]
fn pingpong_refuses_bad_arguments() {
    for (args, want) in [
        (
            &["--mtu", "1000"][..],
            "--mtu 1000: use 256, 512, 1024, 2048 or 4096",
        ),
        (
            &["--iters", "0"][..],
            "--iters and --rx-depth must be at least 1",
        ),
    ] {
        let out = rdmx()
            .arg("pingpong")
            .arg("127.0.0.1")
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// `--into-region`: reads land in a registered region of the client
/// (`read_into`) on both transports, below and above the size where TCP
/// receives straight into the slice.
#[test]
fn reads_into_a_registered_region() {
    for transport in ["tcp", "rdma"] {
        let out = rdmx()
            .args(["perf", "--loopback", "--json", "--into-region"])
            .args(["--transport", transport, "--op", "read"])
            .args([
                "--sizes",
                "8,64k,1m",
                "--iters",
                "20",
                "--duration-ms",
                "60",
            ])
            .output()
            .unwrap();
        let rows = json_rows(&out);
        assert_eq!(rows.len(), 3, "{transport}: {rows:?}");
        for r in &rows {
            assert_eq!(r["op"], "read");
            assert!(r["p50_us"].as_f64().unwrap() > 0.0, "{r}");
            assert!(r["ops_per_s"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
}

/// `--slots 1`: every operation of a bandwidth run on one buffer of each
/// side (ucx_perftest's shape), on both transports, reads into a region
/// too; the rows say how many slots they used.
#[test]
fn operations_in_flight_can_share_one_slot() {
    for transport in ["tcp", "rdma"] {
        let out = rdmx()
            .args(["perf", "--loopback", "--json", "--mode", "bw"])
            .args(["--transport", transport, "--op", "write,read"])
            .args(["--sizes", "64k", "--window", "8", "--slots", "1"])
            .args(["--duration-ms", "60", "--into-region"])
            .output()
            .unwrap();
        let rows = json_rows(&out);
        assert_eq!(rows.len(), 2, "{transport}: {}", explain(&out));
        for r in &rows {
            assert_eq!(r["slots"], 1, "{r}");
            assert!(r["ops_per_s"].as_f64().unwrap() > 0.0, "{r}");
        }
    }
    let out = rdmx()
        .args([
            "perf",
            "--loopback",
            "--json",
            "--mode",
            "bw",
            "--op",
            "write",
        ])
        .args(["--sizes", "4k", "--window", "4", "--duration-ms", "30"])
        .output()
        .unwrap();
    let rows = json_rows(&out);
    assert_eq!(
        rows[0]["slots"], 4,
        "a slot per operation in flight by default"
    );
}
