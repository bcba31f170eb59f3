//! `rdmx doctor`: what this host offers rdmx, for a person (or `--json`).
//! RDMA devices, ports, GIDs, which provider a connection would use and why,
//! memlock, ECN/DCQCN settings, the port counters that reveal fabric trouble,
//! how long this host takes to wake a thread on the same and on another
//! CPU (what every hop between processes pays, see [`crate::wakeup`]), and
//! for each finding one line of advice.

use std::path::{Path, PathBuf};

use rdmx_core::Error;
use rdmx_transport_rdma::sysfs::{self, Device, GidKind};
use serde::Serialize;

/// Arguments of `rdmx doctor`.
#[derive(clap::Args, Debug)]
pub(crate) struct DoctorArgs {
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Root of sysfs (tests use fake trees).
    #[arg(long, default_value = "/sys")]
    sysfs: PathBuf,
    /// Root of procfs.
    #[arg(long, default_value = "/proc")]
    procfs: PathBuf,
    /// Skip the wake-up probe (4000 round trips: a fraction of a second).
    #[arg(long)]
    no_wake_probe: bool,
}

/// One thing worth knowing, with advice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct Finding {
    /// "ok", "warn" or "info".
    pub(crate) level: &'static str,
    /// What was found.
    pub(crate) what: String,
    /// What to do about it.
    pub(crate) advice: String,
}

/// Everything `rdmx doctor` reports.
#[derive(Debug, Serialize)]
pub(crate) struct Report {
    pub(crate) devices: Vec<Device>,
    pub(crate) provider: String,
    pub(crate) memlock_bytes: Option<u64>,
    pub(crate) rmem_max: Option<u64>,
    /// How idle CPUs wait: the cpuidle driver (`haltpoll` in a KVM guest
    /// that has it).
    pub(crate) cpuidle_driver: Option<String>,
    /// With the haltpoll driver: how long an idle vCPU polls before it
    /// halts (0: at once, and every wake-up is a VM exit and entry).
    pub(crate) guest_halt_poll_ns: Option<u64>,
    /// TCP's congestion control in this network namespace
    /// (`net.ipv4.tcp_congestion_control`), which every `tcp://` connection
    /// and TCP baseline runs under.
    pub(crate) tcp_congestion_control: Option<String>,
    /// The algorithms a network namespace other than the host's may choose
    /// (`net.ipv4.tcp_allowed_congestion_control`).
    pub(crate) tcp_allowed_congestion_control: Option<String>,
    /// The wake-up probe's figures (absent when skipped or failed).
    pub(crate) wake: Option<crate::wakeup::WakeCost>,
    pub(crate) findings: Vec<Finding>,
}

fn read(p: &Path) -> Option<String> {
    std::fs::read_to_string(p)
        .ok()
        .map(|s| s.trim().to_string())
}

/// The soft "Max locked memory" limit from `<proc>/self/limits` (None: unlimited/unknown).
fn memlock(procfs: &Path) -> Option<u64> {
    let limits = read(&procfs.join("self/limits"))?;
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max locked memory"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

/// Counters that reveal fabric trouble, and what they mean.
const TROUBLE: &[(&str, &str)] = &[
    (
        "out_of_sequence",
        "packets arrived out of order or were lost: check for drops (PFC off? buffers?)",
    ),
    (
        "packet_seq_err",
        "PSN sequence errors NAKed: loss on the path",
    ),
    (
        "local_ack_timeout_err",
        "ACK timeouts: loss, a wrong GID/route, or an overloaded peer",
    ),
    (
        "rnr_nak_retry_err",
        "the receiver had no receive buffers posted in time",
    ),
    (
        "implied_nak_seq_err",
        "READ/atomic responses missing: loss on the path",
    ),
    (
        "np_cnp_sent",
        "this host's receivers saw ECN marks (congestion); DCQCN is acting",
    ),
    (
        "rp_cnp_handled",
        "this host's senders were told to slow down (DCQCN rate cuts)",
    ),
];

/// Build the report from `sysfs` and `procfs` roots.
/// What the NIC provider of this build can do on this host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Hw {
    /// Built without the `hw` feature.
    NotBuilt,
    /// Built in, but no device opens (why).
    Unusable(String),
    /// Built in; this device opens.
    Opened(String),
}

impl Hw {
    /// Ask the real NIC provider.
    pub(crate) fn probe() -> Hw {
        if !cfg!(feature = "hw") {
            return Hw::NotBuilt;
        }
        match rdmx_transport_rdma::hardware() {
            Ok(p) => Hw::Opened(p.device_name()),
            Err(e) => Hw::Unusable(e.to_string()),
        }
    }
}

pub(crate) fn report(sysfs_root: &Path, procfs: &Path, hw: Hw) -> Report {
    let devices = sysfs::devices(sysfs_root);
    let mut findings = Vec::new();
    let mut f = |level, what: String, advice: &str| {
        findings.push(Finding {
            level,
            what,
            advice: advice.to_string(),
        })
    };
    let provider = match (devices.is_empty(), hw) {
        (true, hw) => {
            let nic = match hw {
                Hw::NotBuilt => "this build has no NIC provider (feature hw)".to_string(),
                Hw::Unusable(why) => format!("the NIC provider says: {why}"),
                Hw::Opened(dev) => format!("yet the NIC provider opened {dev}"),
            };
            f(
                "info",
                "no RDMA devices".into(),
                &format!(
                    "rdma:// runs on rdmx's soft RoCE provider (userspace RoCEv2 over UDP 4791); \
                     policy `prefer` falls back to TCP only if that fails; {nic}"
                ),
            );
            "soft-roce (no RDMA devices on this host)".to_string()
        }
        (false, Hw::NotBuilt) => {
            f(
                "warn",
                format!(
                    "{} RDMA device(s), but no NIC provider in this build",
                    devices.len()
                ),
                "rebuild with `--features hw` (needs cmake and libclang) to use the NIC; \
                 rdma:// uses soft RoCE meanwhile",
            );
            "soft-roce (NIC provider not built in: build with --features hw)".to_string()
        }
        (false, Hw::Unusable(why)) => {
            f(
                "warn",
                format!("{} RDMA device(s), but the NIC provider cannot open one", devices.len()),
                &format!("{why}; rdma:// uses soft RoCE meanwhile (check libibverbs and the provider package, e.g. ibverbs-providers)"),
            );
            "soft-roce (NIC provider failed to open a device)".to_string()
        }
        (false, Hw::Opened(dev)) => {
            f(
                "info",
                format!("{} RDMA device(s); rdma:// uses {dev}", devices.len()),
                "pick another with RDMX_RDMA_DEVICE=<name>, or force soft RoCE with RDMX_RDMA_PROVIDER=soft",
            );
            format!("hw ({dev}, through libibverbs)")
        }
    };
    for d in &devices {
        for p in &d.ports {
            let name = format!("{} port {}", d.name, p.num);
            if !p.is_active() {
                f(
                    "warn",
                    format!("{name} is {}", p.state),
                    "bring the link up (cable, switch port, `ip link set ... up`)",
                );
                continue;
            }
            if !p.link_layer.eq_ignore_ascii_case("Ethernet") {
                f(
                    "info",
                    format!("{name} is {} (not RoCE)", p.link_layer),
                    "rdmx's RoCE path needs an Ethernet port",
                );
                continue;
            }
            let v2 = p.gids.iter().filter(|g| g.kind == GidKind::RoceV2).count();
            if v2 == 0 {
                f(
                    "warn",
                    format!("{name} has no RoCE v2 GID"),
                    "assign an IP address to its net device; RoCE v1 GIDs are not routable",
                );
            }
            if let Some(m) = p.active_mtu {
                if m < 4096 {
                    f(
                        "info",
                        format!("{name} active MTU {m}"),
                        "raise the Ethernet MTU (≥ 4200 for RoCE MTU 4096) for large transfers",
                    );
                }
            }
            for (c, meaning) in TROUBLE {
                if let Some((_, v)) = p.counters.iter().find(|(n, v)| n == c && *v > 0) {
                    f("warn", format!("{name}: {c} = {v}"), meaning);
                }
            }
            let mut netdevs: Vec<&str> =
                p.gids.iter().filter_map(|g| g.netdev.as_deref()).collect();
            netdevs.sort_unstable();
            netdevs.dedup();
            for nd in netdevs {
                for (side, what) in [
                    ("roce_np", "CNP generation"),
                    ("roce_rp", "DCQCN rate control"),
                ] {
                    let dir = sysfs_root.join(format!("class/net/{nd}/ecn/{side}/enable"));
                    let on: Vec<String> = std::fs::read_dir(&dir)
                        .map(|r| {
                            r.flatten()
                                .filter(|e| read(&e.path()).as_deref() == Some("1"))
                                .map(|e| e.file_name().to_string_lossy().into_owned())
                                .collect()
                        })
                        .unwrap_or_default();
                    if dir.exists() && on.is_empty() {
                        f("warn", format!("{nd}: {what} ({side}) is off on every priority"), "enable it for the RoCE priority: echo 1 > .../ecn/{side}/enable/<prio>");
                    }
                }
            }
        }
    }
    let memlock_bytes = memlock(procfs);
    if let Some(m) = memlock_bytes {
        // Each NIC connection pins its receive budget (64 MiB by default,
        // RDMX_HW_RECV_BUDGET) plus the registered regions and staging buffers.
        let budget = rdmx_transport_rdma::hw::plan::recv_budget();
        if !devices.is_empty() && m < budget + (16 << 20) {
            f(
                "warn",
                format!(
                    "memlock limit is {} KiB: less than one NIC connection's receive budget ({} MiB) plus staging buffers",
                    m >> 10,
                    budget >> 20
                ),
                "NIC memory registration pins pages: raise it (ulimit -l unlimited, or LimitMEMLOCK= in the unit)",
            );
        }
    }
    let rmem_max = read(&procfs.join("sys/net/core/rmem_max")).and_then(|s| s.parse().ok());
    let cpuidle_driver = read(&sysfs_root.join("devices/system/cpu/cpuidle/current_driver"));
    let guest_halt_poll_ns =
        read(&sysfs_root.join("module/haltpoll/parameters/guest_halt_poll_ns"))
            .and_then(|s| s.parse().ok());
    if let Some(r) = rmem_max {
        if r < 8 << 20 {
            f(
                "warn",
                format!("net.core.rmem_max is {} KiB", r >> 10),
                "soft RoCE asks for 16 MiB socket receive buffers; the kernel caps them here: sysctl -w net.core.rmem_max=16777216",
            );
        }
    }
    let tcp_congestion_control = read(&procfs.join("sys/net/ipv4/tcp_congestion_control"));
    let tcp_allowed_congestion_control =
        read(&procfs.join("sys/net/ipv4/tcp_allowed_congestion_control"));
    if let Some(cc) = tcp_congestion_control.as_deref() {
        if let Some(finding) = congestion_finding(cc, tcp_allowed_congestion_control.as_deref()) {
            findings.push(finding);
        }
    }
    Report {
        devices,
        provider,
        memlock_bytes,
        rmem_max,
        cpuidle_driver,
        guest_halt_poll_ns,
        tcp_congestion_control,
        tcp_allowed_congestion_control,
        wake: None,
        findings,
    }
}

/// TCP under BBR: a finding for whoever measures `tcp://` (or any TCP
/// baseline) on this host. BBR paces every connection at the rate it
/// estimates, loopback and a short datacenter path included, and on the
/// VM this project is measured on that estimate settled by chance per
/// connection: a 1 MiB round trip took about 200 µs on one and about
/// 500 µs on the next, raw TCP and rdmx alike (BENCHMARKS.md's runs pin
/// cubic). `allowed` is the list a network namespace may choose from.
fn congestion_finding(cc: &str, allowed: Option<&str>) -> Option<Finding> {
    if cc != "bbr" {
        return None;
    }
    let in_namespace = match allowed {
        Some(list) if list.split_whitespace().any(|a| a == "cubic") => {
            "a network namespace may set its own the same way".to_string()
        }
        Some(list) => format!(
            "a network namespace may choose only \"{list}\" here, so pin it per route there \
             (ip route replace <route> congctl cubic)"
        ),
        None => {
            "a network namespace may need the route form (ip route replace <route> congctl cubic)"
                .into()
        }
    };
    Some(Finding {
        level: "info",
        what: "TCP congestion control is bbr".into(),
        advice: format!(
            "BBR paces even loopback at a rate each connection estimates, so large tcp:// \
             transfers and raw-TCP baselines can differ 2-3x from one connection to the next; \
             to compare runs, run every one under one algorithm \
             (sysctl -w net.ipv4.tcp_congestion_control=cubic); {in_namespace}"
        ),
    })
}

/// The wake-up probe's finding: its figures, and a warning where waking a
/// thread on another CPU is slow, with what helps (busy polling, fewer
/// CPUs, and in a KVM guest whose idle vCPUs halt at once, letting them
/// poll first: `r`'s cpuidle settings).
pub(crate) fn wake_finding(c: &crate::wakeup::WakeCost, r: &Report) -> Finding {
    let same = format!(
        "waking a thread: {:.1} µs per round trip on one CPU",
        c.same_cpu_us
    );
    let across = |x: f64| format!("{same}, {x:.1} µs across CPUs (median of {})", c.rounds);
    match c.cross_cpu_us {
        Some(x) if x > crate::wakeup::SLOW_CROSS_CPU_US => {
            let mut advice = format!(
                "every hop between processes on different CPUs pays about {:.0} µs here (two \
                 hops per request and reply): latency-bound chains (client -> gateway -> node, \
                 fio -> NBD export -> target) gain from --busy-poll-us, or from running on fewer \
                 CPUs; hosts that keep their CPUs out of deep idle states take a few µs",
                x / 2.0
            );
            advice.push_str(&halt_poll_hint(r));
            Finding {
                level: "warn",
                what: across(x),
                advice,
            }
        }
        Some(x) => Finding {
            level: "ok",
            what: across(x),
            advice: "nothing to do".into(),
        },
        None => Finding {
            level: "info",
            what: format!("{same} (median of {}); one CPU to run on", c.rounds),
            advice: "every process shares that CPU: a hop between them is a context switch".into(),
        },
    }
}

/// In a KVM guest whose idle vCPUs halt at once: how to let them poll.
fn halt_poll_hint(r: &Report) -> String {
    match (r.cpuidle_driver.as_deref(), r.guest_halt_poll_ns) {
        (Some("haltpoll"), Some(0)) => "; this KVM guest halts idle vCPUs at once \
            (cpuidle haltpoll, guest_halt_poll_ns 0), so each wake-up is a VM exit and entry: \
            echo 200000 > /sys/module/haltpoll/parameters/guest_halt_poll_ns lets them poll \
            200 µs first (idle CPU time for wake-ups)"
            .into(),
        _ => String::new(),
    }
}

pub(crate) fn run(a: DoctorArgs) -> Result<(), Error> {
    let mut r = report(&a.sysfs, &a.procfs, Hw::probe());
    if !a.no_wake_probe {
        match crate::wakeup::probe(2000) {
            Ok(c) => {
                let f = wake_finding(&c, &r);
                r.findings.push(f);
                r.wake = Some(c);
            }
            Err(e) => r.findings.push(Finding {
                level: "info",
                what: format!("the wake-up probe failed: {e}"),
                advice: "run with --no-wake-probe to skip it".into(),
            }),
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&r).map_err(|e| Error::Protocol(e.to_string()))?
        );
        return Ok(());
    }
    println!("provider a connection would use: {}", r.provider);
    for d in &r.devices {
        for p in &d.ports {
            println!(
                "{} port {}: {}, {}, active MTU {}",
                d.name,
                p.num,
                p.state,
                p.link_layer,
                p.active_mtu.map_or("?".into(), |m| m.to_string())
            );
            for g in &p.gids {
                println!(
                    "  GID[{}] {} {:?}{}",
                    g.index,
                    g.addr,
                    g.kind,
                    g.netdev
                        .as_deref()
                        .map(|n| format!(" on {n}"))
                        .unwrap_or_default()
                );
            }
        }
    }
    match r.memlock_bytes {
        Some(m) => println!("memlock limit: {} KiB", m >> 10),
        None => println!("memlock limit: unlimited"),
    }
    for f in &r.findings {
        println!("[{}] {}\n       -> {}", f.level, f.what, f.advice);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmx_transport_rdma::sysfs::fake::{counter, port};

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rdmx-doctor-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn proc_tree(root: &Path, memlock_kib: u64, rmem: u64) {
        std::fs::create_dir_all(root.join("self")).unwrap();
        std::fs::create_dir_all(root.join("sys/net/core")).unwrap();
        std::fs::write(
            root.join("self/limits"),
            format!(
                "Limit                     Soft Limit           Hard Limit           Units\n\
                 Max locked memory         {} {} bytes\n",
                memlock_kib << 10,
                memlock_kib << 10
            ),
        )
        .unwrap();
        std::fs::write(root.join("sys/net/core/rmem_max"), format!("{rmem}\n")).unwrap();
    }

    #[test]
    fn a_host_without_rdma_names_the_fallback() {
        let (s, p) = (tmp("s0"), tmp("p0"));
        proc_tree(&p, 8192, 212_992);
        let r = report(&s, &p, Hw::NotBuilt);
        assert!(r.devices.is_empty());
        assert!(r.provider.contains("no RDMA devices"));
        assert!(r
            .findings
            .iter()
            .any(|f| f.what == "no RDMA devices" && f.advice.contains("UDP 4791")));
        assert!(
            r.findings.iter().any(|f| f.what.contains("rmem_max")),
            "{:?}",
            r.findings
        );
        assert!(
            !r.findings.iter().any(|f| f.what.contains("memlock")),
            "memlock only matters with a NIC"
        );
    }

    #[test]
    fn bbr_gets_a_note_on_pacing_and_how_to_pin_one_algorithm() {
        let (s, p) = (tmp("s3"), tmp("p3"));
        proc_tree(&p, 8192, 16 << 20);
        let ipv4 = p.join("sys/net/ipv4");
        std::fs::create_dir_all(&ipv4).unwrap();
        std::fs::write(ipv4.join("tcp_congestion_control"), "bbr\n").unwrap();
        std::fs::write(ipv4.join("tcp_allowed_congestion_control"), "reno bbr\n").unwrap();
        let r = report(&s, &p, Hw::NotBuilt);
        assert_eq!(r.tcp_congestion_control.as_deref(), Some("bbr"));
        assert_eq!(
            r.tcp_allowed_congestion_control.as_deref(),
            Some("reno bbr")
        );
        let f = r
            .findings
            .iter()
            .find(|f| f.what == "TCP congestion control is bbr")
            .expect("a finding for bbr");
        assert_eq!(f.level, "info");
        assert!(
            f.advice.contains("net.ipv4.tcp_congestion_control=cubic"),
            "{f:?}"
        );
        assert!(
            f.advice.contains("only \"reno bbr\"") && f.advice.contains("congctl cubic"),
            "{f:?}"
        );

        // cubic allowed in namespaces: no route detour in the advice.
        std::fs::write(
            ipv4.join("tcp_allowed_congestion_control"),
            "reno cubic bbr\n",
        )
        .unwrap();
        let r = report(&s, &p, Hw::NotBuilt);
        let f = r.findings.iter().find(|f| f.what.contains("bbr")).unwrap();
        assert!(!f.advice.contains("congctl"), "{f:?}");

        // Another algorithm: nothing to say.
        std::fs::write(ipv4.join("tcp_congestion_control"), "cubic\n").unwrap();
        let r = report(&s, &p, Hw::NotBuilt);
        assert_eq!(r.tcp_congestion_control.as_deref(), Some("cubic"));
        assert!(
            !r.findings.iter().any(|f| f.what.contains("congestion")),
            "{:?}",
            r.findings
        );
    }

    #[test]
    fn a_troubled_nic_gets_advice() {
        let (s, p) = (tmp("s1"), tmp("p1"));
        proc_tree(&p, 64, 16 << 20);
        port(
            &s,
            "mlx5_0",
            1,
            "4: ACTIVE",
            "Ethernet",
            "1024 (3)",
            &[(
                0,
                "fe80:0000:0000:0000:0a00:27ff:fe12:3456",
                "IB/RoCE v1",
                "eth0",
            )],
        );
        port(&s, "mlx5_1", 1, "1: DOWN", "Ethernet", "4096 (5)", &[]);
        counter(&s, "mlx5_0", 1, true, "local_ack_timeout_err", 12);
        counter(&s, "mlx5_0", 1, true, "np_cnp_sent", 0);
        std::fs::create_dir_all(s.join("class/net/eth0/ecn/roce_np/enable")).unwrap();
        std::fs::write(s.join("class/net/eth0/ecn/roce_np/enable/3"), "0\n").unwrap();
        let r = report(&s, &p, Hw::NotBuilt);
        let has = |w: &str| r.findings.iter().any(|f| f.what.contains(w));
        assert!(has("mlx5_1 port 1 is 1: DOWN"));
        assert!(has("no RoCE v2 GID"));
        assert!(has("active MTU 1024"));
        assert!(has("local_ack_timeout_err = 12"));
        assert!(!has("np_cnp_sent"), "zero counters are not findings");
        assert!(has("CNP generation (roce_np) is off"));
        assert!(has("memlock limit is 64 KiB"));
        assert!(!has("rmem_max"));
        // JSON serialises.
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["devices"].as_array().unwrap().len(), 2);
        assert!(
            r.provider.contains("build with --features hw"),
            "{}",
            r.provider
        );
        // The same host with the NIC provider built in, failing or working.
        let r = report(&s, &p, Hw::Unusable("no RDMA devices (ENOSYS)".into()));
        assert!(r.provider.contains("failed to open"), "{}", r.provider);
        assert!(r.findings.iter().any(|f| f.advice.contains("ENOSYS")));
        let r = report(&s, &p, Hw::Opened("mlx5_0".into()));
        assert_eq!(r.provider, "hw (mlx5_0, through libibverbs)");
        assert!(r
            .findings
            .iter()
            .any(|f| f.advice.contains("RDMX_RDMA_DEVICE")));
    }

    #[test]
    fn the_wake_up_finding_warns_only_when_another_cpu_is_slow() {
        use crate::wakeup::WakeCost;
        let (s, p) = (tmp("wake-sys"), tmp("wake-proc"));
        proc_tree(&p, 1 << 20, 16 << 20);
        let r = report(&s, &p, Hw::NotBuilt);
        assert_eq!(r.cpuidle_driver, None);
        let slow_cost = WakeCost {
            rounds: 2000,
            same_cpu_us: 6.1,
            cross_cpu_us: Some(91.3),
        };
        let slow = wake_finding(&slow_cost, &r);
        assert_eq!(slow.level, "warn");
        assert_eq!(
            slow.what,
            "waking a thread: 6.1 µs per round trip on one CPU, 91.3 µs across CPUs (median of 2000)"
        );
        assert!(slow.advice.contains("about 46 µs"), "{}", slow.advice);
        assert!(!slow.advice.contains("haltpoll"), "{}", slow.advice);
        let fast = wake_finding(
            &WakeCost {
                rounds: 10,
                same_cpu_us: 3.0,
                cross_cpu_us: Some(12.0),
            },
            &r,
        );
        assert_eq!(fast.level, "ok");
        let one = wake_finding(
            &WakeCost {
                rounds: 10,
                same_cpu_us: 3.0,
                cross_cpu_us: None,
            },
            &r,
        );
        assert_eq!(one.level, "info");
        assert!(one.what.contains("one CPU to run on"), "{}", one.what);
        // A KVM guest whose idle vCPUs halt at once is told how to let them
        // poll; one that polls already is not.
        let idle = s.join("devices/system/cpu/cpuidle");
        let knob = s.join("module/haltpoll/parameters");
        std::fs::create_dir_all(&idle).unwrap();
        std::fs::create_dir_all(&knob).unwrap();
        std::fs::write(idle.join("current_driver"), "haltpoll\n").unwrap();
        std::fs::write(knob.join("guest_halt_poll_ns"), "0\n").unwrap();
        let r = report(&s, &p, Hw::NotBuilt);
        assert_eq!(r.cpuidle_driver.as_deref(), Some("haltpoll"));
        assert_eq!(r.guest_halt_poll_ns, Some(0));
        let slow = wake_finding(&slow_cost, &r);
        assert!(
            slow.advice.contains("guest_halt_poll_ns 0") && slow.advice.contains("echo 200000"),
            "{}",
            slow.advice
        );
        std::fs::write(knob.join("guest_halt_poll_ns"), "200000\n").unwrap();
        let r = report(&s, &p, Hw::NotBuilt);
        assert!(!wake_finding(&slow_cost, &r).advice.contains("haltpoll"));
        let _ = std::fs::remove_dir_all(&s);
        let _ = std::fs::remove_dir_all(&p);
    }
}
