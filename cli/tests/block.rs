//! `rdmx block`: the NBD export of an rdmx namespace under unmodified NBD
//! clients (nbdinfo, qemu-io, qemu-img, nbdcopy, fio's nbd engine), over
//! NVMe over rdmx on TCP and on soft RoCE, with every byte compared; and
//! durability: data acknowledged after Flush or FUA survives `kill -9` of
//! the target and a restart, checked through the Initiator and through NBD.

mod common;

use std::process::Command;
use std::sync::Arc;

use common::{explain, free_port, metric, rdmx, scrape, Spawned};
use rdmx_block::fabric::{Initiator, InitiatorConfig};

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {}", explain(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn random_file(path: &std::path::Path, len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let data: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    std::fs::write(path, &data).unwrap();
    data
}

struct Stack {
    _target: Spawned,
    nbd: Spawned,
    uri: String,
    /// The export's NBD address and its metrics endpoint.
    listen: String,
    metrics: String,
}

fn stack(scheme: &str, namespace: &[&str]) -> Stack {
    let (tcp, fab, nbd) = (free_port(), free_port(), free_port());
    let fab_url = format!("{scheme}://127.0.0.1:{fab}");
    let mut args = vec!["block", "serve"];
    args.extend_from_slice(namespace);
    let tcp_addr = format!("127.0.0.1:{tcp}");
    args.extend_from_slice(&["--nvme-tcp", &tcp_addr, "--rdmx", &fab_url]);
    let target = Spawned::start(&args, "NVMe over rdmx on");
    let listen = format!("127.0.0.1:{nbd}");
    let metrics = format!("127.0.0.1:{}", free_port());
    let n = Spawned::start(
        &[
            "block",
            "nbd",
            "--listen",
            &listen,
            "--target",
            &fab_url,
            "--metrics",
            &metrics,
        ],
        "export \"rdmx\"",
    );
    Stack {
        _target: target,
        nbd: n,
        uri: format!("nbd://{listen}/rdmx"),
        listen,
        metrics,
    }
}

/// The value of `name{command="command"}`.
fn per_command(text: &str, name: &str, command: &str) -> f64 {
    let key = format!("{name}{{command=\"{command}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .unwrap_or_else(|| panic!("no {key} in\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Scrape until `ok` holds (the export counts a connection's end when it
/// notices it), or fail after 5 s with the last scrape.
fn scrape_until(addr: &str, ok: impl Fn(&str) -> bool) -> String {
    let t0 = std::time::Instant::now();
    loop {
        let text = scrape(addr);
        if ok(&text) {
            return text;
        }
        assert!(t0.elapsed().as_secs() < 5, "{text}");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// The export's counters after the clients of `clients_against`: at least
/// the bytes they moved, every command they used, no errors, every
/// connection closed, a histogram that counts every request; then a client
/// that breaks the negotiation is counted as a protocol error.
fn check_metrics(s: &Stack) {
    let text = scrape_until(&s.metrics, |t| metric(t, "rdmx_nbd_connections") == 0.0);
    let c = |name: &str, command: &str| per_command(&text, name, command);
    // nbdcopy and qemu-img each read the whole 64 MiB export.
    assert!(
        c("rdmx_nbd_bytes_total", "read") >= (128 << 20) as f64,
        "{text}"
    );
    // nbdcopy 8 MiB, qemu-img 8 MiB, fio 16 MiB, qemu-io 64 KiB.
    assert!(
        c("rdmx_nbd_bytes_total", "write") >= ((32 << 20) + (64 << 10)) as f64,
        "{text}"
    );
    for command in ["write_zeroes", "trim", "flush"] {
        assert!(
            c("rdmx_nbd_requests_total", command) >= 1.0,
            "{command}: {text}"
        );
    }
    assert!(
        c("rdmx_nbd_bytes_total", "write_zeroes") >= (1 << 20) as f64,
        "{text}"
    );
    assert!(
        c("rdmx_nbd_bytes_total", "trim") >= (1 << 20) as f64,
        "{text}"
    );
    let commands = [
        "read",
        "write",
        "flush",
        "trim",
        "cache",
        "write_zeroes",
        "block_status",
        "other",
    ];
    let errors: f64 = commands.iter().map(|k| c("rdmx_nbd_errors_total", k)).sum();
    assert_eq!(errors, 0.0, "{text}");
    let requests: f64 = commands
        .iter()
        .map(|k| c("rdmx_nbd_requests_total", k))
        .sum();
    assert_eq!(metric(&text, "rdmx_nbd_latency_seconds_count"), requests);
    assert_eq!(metric(&text, "rdmx_nbd_inflight"), 0.0);
    assert_eq!(metric(&text, "rdmx_nbd_protocol_errors_total"), 0.0);
    // nbdinfo, qemu-io, nbdcopy (twice), qemu-img (twice), fio.
    assert!(metric(&text, "rdmx_nbd_connections_total") >= 7.0, "{text}");
    // The Initiator's connections to the target: admin and I/O queues.
    assert!(metric(&text, "rdmx_connections_open") >= 3.0, "{text}");
    // A client that sends an option without IHAVEOPT.
    {
        use std::io::{Read, Write};
        let mut t = std::net::TcpStream::connect(&s.listen).unwrap();
        let mut hello = [0u8; 18];
        t.read_exact(&mut hello).unwrap();
        assert_eq!(&hello[..8], b"NBDMAGIC");
        t.write_all(&0u32.to_be_bytes()).unwrap();
        t.write_all(&[0x55; 16]).unwrap();
        let mut rest = Vec::new();
        let _ = t.read_to_end(&mut rest);
    }
    let before = metric(&text, "rdmx_nbd_connections_total");
    scrape_until(&s.metrics, |t| {
        metric(t, "rdmx_nbd_protocol_errors_total") == 1.0
            && metric(t, "rdmx_nbd_connections_total") == before + 1.0
            && metric(t, "rdmx_nbd_connections") == 0.0
    });
}

fn clients_against(scheme: &str) {
    let s = stack(scheme, &["--ram", "64m"]);
    let dir = std::env::temp_dir().join(format!("rdmx-nbd-{scheme}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The export runs on the transport asked for (no fallback).
    let log = s.nbd.log.lock().unwrap().clone();
    assert!(log.contains(&format!("({scheme}, ")), "{log}");
    let info = run(Command::new("nbdinfo").arg(&s.uri));
    assert!(info.contains("export-size: 67108864"), "{info}");
    assert!(info.contains("block_size_maximum: 33554432"), "{info}");
    // qemu-io: patterns written and read back, zeroes, discard, flush.
    let io = run(Command::new("qemu-io").args([
        "-f",
        "raw",
        "-c",
        "write -P 0xab 0 64k",
        "-c",
        "read -P 0xab 0 64k",
        "-c",
        "write -z 1M 1M",
        "-c",
        "read -P 0 1M 1M",
        "-c",
        "discard 2M 1M",
        "-c",
        "flush",
        &s.uri,
    ]));
    assert!(!io.contains("failed"), "{io}");
    assert_eq!(io.matches("read 65536/65536").count(), 1, "{io}");
    // nbdcopy both ways (several connections, multi-conn), 8 MiB random.
    let src = dir.join("src.img");
    let data = random_file(&src, 8 << 20, 7);
    run(Command::new("nbdcopy").arg(&src).arg(&s.uri).arg("--flush"));
    let out = dir.join("out.img");
    run(Command::new("nbdcopy").arg(&s.uri).arg(&out));
    let back = std::fs::read(&out).unwrap();
    assert_eq!(back.len(), 64 << 20);
    assert!(back[..8 << 20] == data[..], "nbdcopy read back other bytes");
    // qemu-img convert both ways (block status, 2 MiB requests).
    let data2 = random_file(&src, 8 << 20, 11);
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(&s.uri));
    run(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(&s.uri)
        .arg(&out));
    let back = std::fs::read(&out).unwrap();
    assert!(
        back[..8 << 20] == data2[..],
        "qemu-img read back other bytes"
    );
    // fio's nbd engine: random writes verified with crc32c.
    run(Command::new("fio").args([
        "--name=nbdverify",
        "--ioengine=nbd",
        &format!("--uri={}", s.uri),
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--size=16M",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
        // No verify state file left in the working directory.
        "--verify_state_save=0",
    ]));
    check_metrics(&s);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
#[cfg_attr(
    rdmx_missing_nbdtools,
    ignore = "needs qemu-img, qemu-io, nbdinfo, nbdcopy and fio with its nbd engine (apt-get install qemu-utils libnbd-bin fio); CI runs it"
)]
fn nbd_clients_over_nvme_over_rdmx_on_tcp() {
    clients_against("tcp");
}

#[test]
#[cfg_attr(
    rdmx_missing_nbdtools,
    ignore = "needs qemu-img, qemu-io, nbdinfo, nbdcopy and fio with its nbd engine (apt-get install qemu-utils libnbd-bin fio); CI runs it"
)]
fn nbd_clients_over_nvme_over_rdmx_on_soft_roce() {
    clients_against("rdma");
}

/// Flushed (and FUA) data survives `kill -9` of the target: written by the
/// Initiator (one part flushed, one with FUA) and through NBD (nbdcopy
/// --flush), read back after the target restarts on the same file.
#[test]
#[cfg_attr(
    rdmx_missing_nbdtools,
    ignore = "needs qemu-img, qemu-io, nbdinfo, nbdcopy and fio with its nbd engine (apt-get install qemu-utils libnbd-bin fio); CI runs it"
)]
fn flushed_data_survives_kill_9_of_the_target() {
    flushed_data_survives_kill_9(false);
}

/// The same with the namespace file opened `O_DIRECT` (`--direct`), in
/// cargo's temporary directory on the build's disk (`/tmp` may be a tmpfs).
#[test]
#[cfg_attr(
    rdmx_missing_nbdtools,
    ignore = "needs qemu-img, qemu-io, nbdinfo, nbdcopy and fio with its nbd engine (apt-get install qemu-utils libnbd-bin fio); CI runs it"
)]
fn flushed_data_survives_kill_9_of_a_direct_io_target() {
    flushed_data_survives_kill_9(true);
}

fn flushed_data_survives_kill_9(direct: bool) {
    let base = if direct {
        std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
    } else {
        std::env::temp_dir()
    };
    let dir = base.join(format!("rdmx-kill9-{}-{direct}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let img = dir.join("ns.img");
    let img_s = img.to_str().unwrap().to_string();
    let mut ns = vec!["--file", img_s.as_str(), "--size", "32m"];
    if direct {
        ns.push("--direct");
    }
    let rt = tokio::runtime::Runtime::new().unwrap();
    let ts = || {
        rdmx_core::Transports::new()
            .with(rdmx_transport_tcp::TcpTransport::new())
            .with(rdmx_transport_rdma::RdmaTransport::new())
    };
    let a = random_file(&dir.join("a"), 1 << 20, 3);
    let b = random_file(&dir.join("b"), 1 << 20, 5);
    let src = dir.join("c.img");
    let c = random_file(&src, 4 << 20, 9);
    let (tcp, fab) = (free_port(), free_port());
    let url = format!("tcp://127.0.0.1:{fab}");
    let tcp_addr = format!("127.0.0.1:{tcp}");
    let serve = |ns: &[&str]| {
        let mut args = vec!["block", "serve"];
        args.extend_from_slice(ns);
        args.extend_from_slice(&["--nvme-tcp", &tcp_addr, "--rdmx", &url]);
        Spawned::start(&args, "NVMe over rdmx on")
    };
    {
        let target = serve(&ns);
        if direct {
            // The namespace line names the flag and the file's alignment.
            target.wait_for(", O_DIRECT (");
        }
        rt.block_on(async {
            let cfg = InitiatorConfig {
                nqn: "nqn.2026-11.io.rdmx:block".into(),
                ..InitiatorConfig::default()
            };
            let dev = Arc::new(Initiator::connect(&ts(), &url, cfg).await.unwrap());
            dev.write(0, a.clone().into(), false).await.unwrap();
            dev.flush().await.unwrap();
            dev.write(2048, b.clone().into(), true).await.unwrap();
        });
        // Through NBD too: nbdcopy with --flush.
        let nbd = free_port();
        let listen = format!("127.0.0.1:{nbd}");
        let n = Spawned::start(
            &["block", "nbd", "--listen", &listen, "--target", &url],
            "export \"rdmx\"",
        );
        let uri = format!("nbd://{listen}/rdmx");
        // nbdcopy writes the whole export: a 32 MiB file with c at 8 MiB.
        let mut full = vec![0u8; 32 << 20];
        full[..1 << 20].copy_from_slice(&a);
        full[1 << 20..2 << 20].copy_from_slice(&b);
        full[8 << 20..12 << 20].copy_from_slice(&c);
        std::fs::write(&src, &full).unwrap();
        run(Command::new("nbdcopy").arg(&src).arg(&uri).arg("--flush"));
        drop(n);
        // kill -9 (Spawned's drop sends SIGKILL).
        drop(target);
    }
    let target = serve(&ns);
    if direct {
        target.wait_for(", O_DIRECT (");
    }
    rt.block_on(async {
        let cfg = InitiatorConfig {
            nqn: "nqn.2026-11.io.rdmx:block".into(),
            ..InitiatorConfig::default()
        };
        let dev = Initiator::connect(&ts(), &url, cfg).await.unwrap();
        assert!(
            dev.read(0, 2048).await.unwrap() == a[..],
            "flushed write lost"
        );
        assert!(
            dev.read(2048, 2048).await.unwrap() == b[..],
            "FUA write lost"
        );
        let got = dev.read(16384, 2048).await.unwrap();
        assert!(got == c[..1 << 20], "nbdcopy --flush data lost");
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--direct` names what it cannot apply to, and a file the filesystem
/// cannot serve by direct I/O (a size that is not a multiple of its
/// alignment) is refused with the reason, before anything listens.
#[test]
fn direct_io_misuse_is_refused_clearly() {
    let out = rdmx()
        .args([
            "block",
            "serve",
            "--ram",
            "1m",
            "--direct",
            "--nvme-tcp",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--direct applies to --file namespaces"),
        "{}",
        explain(&out)
    );
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rdmx-direct-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let odd = dir.join("odd.img");
    std::fs::write(&odd, vec![0u8; 4097]).unwrap();
    let out = rdmx()
        .args([
            "block",
            "serve",
            "--direct",
            "--nvme-tcp",
            "127.0.0.1:0",
            "--file",
        ])
        .arg(&odd)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("direct I/O alignment"),
        "{}",
        explain(&out)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
