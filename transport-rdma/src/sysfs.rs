//! RDMA devices as the kernel describes them under
//! `/sys/class/infiniband/<dev>/ports/<n>/` (state, link layer, active MTU,
//! GID table with types and net devices, counters), and the RoCEv2 GID choice
//! for a connection. Everything takes the sysfs root as a parameter, so tests
//! run against fake trees.

use std::fs;
use std::net::{IpAddr, Ipv6Addr};
use std::path::{Path, PathBuf};

use serde::Serialize;

/// What a GID table entry is for (`gid_attrs/types/<i>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum GidKind {
    /// "RoCE v2": routable, UDP 4791 — what rdmx uses.
    RoceV2,
    /// "IB/RoCE v1": link-local Ethernet type 0x8915; never chosen.
    RoceV1OrIb,
    /// Something else.
    Other,
}

/// One GID table entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Gid {
    /// Index in the port's table (what `ibv_modify_qp` takes as `sgid_index`).
    pub index: u32,
    /// The GID as an address (RoCE GIDs are IPv4-mapped or IPv6 addresses).
    pub addr: IpAddr,
    /// Its type.
    pub kind: GidKind,
    /// The net device it belongs to (`gid_attrs/ndevs/<i>`), if any.
    pub netdev: Option<String>,
}

/// One port of a device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Port {
    /// Port number (from 1).
    pub num: u32,
    /// `state`, e.g. "ACTIVE".
    pub state: String,
    /// `link_layer`: "Ethernet" for RoCE, "InfiniBand" for IB.
    pub link_layer: String,
    /// Active MTU in bytes (256..=4096): the `active_mtu` file where a tree
    /// has one; the kernel's has none, so it is derived from the MTU of the
    /// port's net device as RoCE drivers do ([`roce_mtu`]). The NIC provider
    /// asks the device itself (`ibv_query_port`).
    pub active_mtu: Option<u32>,
    /// Valid (non-zero) GIDs.
    pub gids: Vec<Gid>,
    /// Counters under `counters/` and `hw_counters/`, by name.
    pub counters: Vec<(String, u64)>,
}

impl Port {
    /// True if the port is up.
    pub fn is_active(&self) -> bool {
        self.state.contains("ACTIVE")
    }
}

/// An RDMA device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Device {
    /// Name, e.g. "mlx5_0".
    pub name: String,
    /// Its ports.
    pub ports: Vec<Port>,
}

fn read(p: &Path) -> Option<String> {
    fs::read_to_string(p).ok().map(|s| s.trim().to_string())
}

/// Parse a sysfs GID ("fe80:0000:...:0001", eight groups of four hex digits).
pub fn parse_gid(s: &str) -> Option<Ipv6Addr> {
    let groups: Vec<u16> = s
        .trim()
        .split(':')
        .map(|g| u16::from_str_radix(g, 16).ok())
        .collect::<Option<_>>()?;
    let g: [u16; 8] = groups.try_into().ok()?;
    Some(Ipv6Addr::from(g))
}

/// Parse `active_mtu` ("4096 (5)" or "1024").
pub fn parse_mtu(s: &str) -> Option<u32> {
    let n: u32 = s.split_whitespace().next()?.parse().ok()?;
    matches!(n, 256 | 512 | 1024 | 2048 | 4096).then_some(n)
}

/// The RoCE MTU an Ethernet MTU allows: the largest IB MTU (256..4096) that
/// fits with 80 bytes of RoCEv2 headers (rxe's `RXE_MAX_HDR_LENGTH`; 1500 →
/// 1024, 4200 → 4096). `None` below 336.
pub fn roce_mtu(ethernet_mtu: u32) -> Option<u32> {
    let room = ethernet_mtu.checked_sub(80)?;
    [4096, 2048, 1024, 512, 256]
        .into_iter()
        .find(|&m| m <= room)
}

fn sorted_dir(p: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(p)
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default();
    v.sort_by_key(|p| {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        (name.parse::<u64>().unwrap_or(u64::MAX), name)
    });
    v
}

fn counters(dir: &Path, out: &mut Vec<(String, u64)>) {
    for p in sorted_dir(dir) {
        if let (Some(name), Some(v)) = (
            p.file_name().map(|n| n.to_string_lossy().into_owned()),
            read(&p).and_then(|s| s.parse::<u64>().ok()),
        ) {
            out.push((name, v));
        }
    }
}

/// The RDMA devices under `root` (normally `/sys`); empty if there are none.
pub fn devices(root: &Path) -> Vec<Device> {
    let base = root.join("class/infiniband");
    let mut out = Vec::new();
    for dev in sorted_dir(&base) {
        let name = dev
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut ports = Vec::new();
        for p in sorted_dir(&dev.join("ports")) {
            let Some(num) = p.file_name().and_then(|n| n.to_str()?.parse().ok()) else {
                continue;
            };
            let mut gids = Vec::new();
            for g in sorted_dir(&p.join("gids")) {
                let Some(index) = g.file_name().and_then(|n| n.to_str()?.parse::<u32>().ok())
                else {
                    continue;
                };
                let Some(addr) = read(&g).as_deref().and_then(parse_gid) else {
                    continue;
                };
                if addr.is_unspecified() {
                    continue;
                }
                let kind = match read(&p.join(format!("gid_attrs/types/{index}"))).as_deref() {
                    Some(t) if t.contains("v2") => GidKind::RoceV2,
                    Some(t) if t.contains("v1") || t.contains("IB") => GidKind::RoceV1OrIb,
                    _ => GidKind::Other,
                };
                let netdev =
                    read(&p.join(format!("gid_attrs/ndevs/{index}"))).filter(|s| !s.is_empty());
                gids.push(Gid {
                    index,
                    addr: IpAddr::V6(addr).to_canonical(),
                    kind,
                    netdev,
                });
            }
            let mut c = Vec::new();
            counters(&p.join("counters"), &mut c);
            counters(&p.join("hw_counters"), &mut c);
            ports.push(Port {
                num,
                state: read(&p.join("state")).unwrap_or_default(),
                link_layer: read(&p.join("link_layer")).unwrap_or_default(),
                active_mtu: read(&p.join("active_mtu"))
                    .as_deref()
                    .and_then(parse_mtu)
                    .or_else(|| {
                        let dev = gids.iter().find_map(|g| g.netdev.as_deref())?;
                        let mtu = read(&root.join(format!("class/net/{dev}/mtu")))?;
                        roce_mtu(mtu.parse().ok()?)
                    }),
                gids,
                counters: c,
            });
        }
        out.push(Device { name, ports });
    }
    out
}

/// Where a connection from `local_ip` should send from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GidChoice {
    /// Device name.
    pub device: String,
    /// Port number.
    pub port: u32,
    /// GID index.
    pub index: u32,
    /// The GID.
    pub addr: IpAddr,
    /// The port's active MTU.
    pub mtu: Option<u32>,
}

impl GidChoice {
    fn of(d: &Device, p: &Port, g: &Gid) -> GidChoice {
        GidChoice {
            device: d.name.clone(),
            port: p.num,
            index: g.index,
            addr: g.addr,
            mtu: p.active_mtu,
        }
    }
}

/// The RoCEv2 GID whose address is `local_ip` (the address of the interface
/// that routes to the peer) on an active Ethernet port. Never a RoCE v1 GID,
/// never a link-local one unless `local_ip` itself is link-local. `None` if no
/// port carries that address.
pub fn choose_gid(devs: &[Device], local_ip: IpAddr) -> Option<GidChoice> {
    let want = local_ip.to_canonical();
    let link_local = |a: &IpAddr| match a {
        IpAddr::V6(v6) => (v6.segments()[0] & 0xffc0) == 0xfe80,
        IpAddr::V4(v4) => v4.is_link_local(),
    };
    devs.iter()
        .flat_map(|d| d.ports.iter().map(move |p| (d, p)))
        .filter(|(_, p)| p.is_active() && p.link_layer.eq_ignore_ascii_case("Ethernet"))
        .flat_map(|(d, p)| p.gids.iter().map(move |g| (d, p, g)))
        .filter(|(_, _, g)| g.kind == GidKind::RoceV2 && g.addr == want)
        .find(|(_, _, g)| !link_local(&g.addr) || link_local(&want))
        .map(|(d, p, g)| GidChoice::of(d, p, g))
}

/// The GID a person named (`RDMX_RDMA_GID_INDEX`, optionally with
/// `RDMX_RDMA_PORT`) on device `dev`, whatever its type or address: an
/// override for fabrics the automatic choice gets wrong. `None` if that
/// index does not exist on an active port.
pub fn gid_by_index(
    devs: &[Device],
    dev: &str,
    index: u32,
    port: Option<u32>,
) -> Option<GidChoice> {
    devs.iter()
        .filter(|d| d.name == dev)
        .flat_map(|d| d.ports.iter().map(move |p| (d, p)))
        .filter(|(_, p)| p.is_active() && port.is_none_or(|n| n == p.num))
        .flat_map(|(d, p)| p.gids.iter().map(move |g| (d, p, g)))
        .find(|(_, _, g)| g.index == index)
        .map(|(d, p, g)| GidChoice::of(d, p, g))
}

/// Test helper and documentation of the layout: write a fake sysfs device.
pub mod fake {
    use std::fs;
    use std::path::Path;

    /// A GID entry for [`port`]: (index, sysfs GID text, type text, netdev).
    pub type FakeGid<'a> = (u32, &'a str, &'a str, &'a str);

    /// Create `<root>/class/infiniband/<dev>/ports/<num>` with the given files
    /// (`mtu` empty: no `active_mtu` file, as in the kernel's sysfs).
    pub fn port(
        root: &Path,
        dev: &str,
        num: u32,
        state: &str,
        link: &str,
        mtu: &str,
        gids: &[FakeGid<'_>],
    ) {
        let p = root.join(format!("class/infiniband/{dev}/ports/{num}"));
        for d in [
            "gids",
            "gid_attrs/types",
            "gid_attrs/ndevs",
            "counters",
            "hw_counters",
        ] {
            fs::create_dir_all(p.join(d)).unwrap();
        }
        fs::write(p.join("state"), format!("{state}\n")).unwrap();
        fs::write(p.join("link_layer"), format!("{link}\n")).unwrap();
        // Linux has no such file (the MTU comes from ibv_query_port); an
        // empty `mtu` leaves it out, as on a real host.
        if !mtu.is_empty() {
            fs::write(p.join("active_mtu"), format!("{mtu}\n")).unwrap();
        }
        for (i, gid, kind, ndev) in gids {
            fs::write(p.join(format!("gids/{i}")), format!("{gid}\n")).unwrap();
            fs::write(p.join(format!("gid_attrs/types/{i}")), format!("{kind}\n")).unwrap();
            fs::write(p.join(format!("gid_attrs/ndevs/{i}")), format!("{ndev}\n")).unwrap();
        }
    }

    /// Write a counter file.
    pub fn counter(root: &Path, dev: &str, num: u32, hw: bool, name: &str, v: u64) {
        let p = root.join(format!(
            "class/infiniband/{dev}/ports/{num}/{}/{name}",
            if hw { "hw_counters" } else { "counters" }
        ));
        fs::write(p, format!("{v}\n")).unwrap();
    }
}

#[cfg(test)]
mod tests {
    use super::fake::{counter, port};
    use super::*;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rdmx-sysfs-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    const LL: &str = "fe80:0000:0000:0000:0a00:27ff:fe12:3456";
    const V4: &str = "0000:0000:0000:0000:0000:ffff:c612:0001"; // 198.18.0.1
    const V4B: &str = "0000:0000:0000:0000:0000:ffff:c612:0101"; // 198.18.1.1
    const V6: &str = "2001:0002:0000:0000:0000:0000:0000:0001"; // 2001:2::1

    #[test]
    fn roce_mtu_as_the_kernel_derives_it() {
        assert_eq!(roce_mtu(1500), Some(1024));
        assert_eq!(roce_mtu(4200), Some(4096));
        assert_eq!(roce_mtu(9000), Some(4096));
        assert_eq!(roce_mtu(2100), Some(1024));
        assert_eq!(roce_mtu(2128), Some(2048));
        assert_eq!(roce_mtu(335), None);
        assert_eq!(roce_mtu(336), Some(256));
    }

    #[test]
    fn parses_gids_and_mtus() {
        assert_eq!(
            parse_gid(V4).map(|a| IpAddr::V6(a).to_canonical()),
            Some("198.18.0.1".parse().unwrap())
        );
        assert_eq!(parse_gid("zz"), None);
        assert_eq!(parse_mtu("4096 (5)"), Some(4096));
        assert_eq!(parse_mtu("1024"), Some(1024));
        assert_eq!(parse_mtu("1500"), None);
    }

    #[test]
    fn no_devices_is_an_empty_list() {
        let root = tmp("none");
        assert!(devices(&root).is_empty());
        assert!(devices(&root.join("missing")).is_empty());
        assert_eq!(choose_gid(&[], "198.18.0.1".parse().unwrap()), None);
    }

    /// As on Linux: no `active_mtu` file, the net device's MTU says it.
    #[test]
    fn active_mtu_from_the_net_device() {
        let root = tmp("netmtu");
        port(
            &root,
            "rxe0",
            1,
            "4: ACTIVE",
            "Ethernet",
            "",
            &[(1, V4, "RoCE v2", "eth0")],
        );
        assert_eq!(devices(&root)[0].ports[0].active_mtu, None);
        fs::create_dir_all(root.join("class/net/eth0")).unwrap();
        fs::write(root.join("class/net/eth0/mtu"), "1500\n").unwrap();
        assert_eq!(devices(&root)[0].ports[0].active_mtu, Some(1024));
        fs::write(root.join("class/net/eth0/mtu"), "9000\n").unwrap();
        assert_eq!(devices(&root)[0].ports[0].active_mtu, Some(4096));
    }

    /// Two devices, mixed v1/v2, IPv4 and IPv6, a down port, an IB port: the
    /// choice is the v2 GID of the address that routes to the peer.
    #[test]
    fn chooses_the_rocev2_gid_of_the_routing_address() {
        let root = tmp("mixed");
        port(
            &root,
            "mlx5_0",
            1,
            "4: ACTIVE",
            "Ethernet",
            "1024 (3)",
            &[
                (0, LL, "IB/RoCE v1", "eth0"),
                (1, LL, "RoCE v2", "eth0"),
                (2, V4, "IB/RoCE v1", "eth0"),
                (3, V4, "RoCE v2", "eth0"),
                (4, V6, "RoCE v2", "eth0"),
                (5, "0000:0000:0000:0000:0000:0000:0000:0000", "", ""),
            ],
        );
        port(
            &root,
            "mlx5_1",
            1,
            "1: DOWN",
            "Ethernet",
            "4096 (5)",
            &[(3, V4B, "RoCE v2", "eth1")],
        );
        port(
            &root,
            "mlx5_2",
            1,
            "4: ACTIVE",
            "InfiniBand",
            "4096 (5)",
            &[(0, V4B, "RoCE v2", "")],
        );
        counter(&root, "mlx5_0", 1, true, "out_of_sequence", 7);
        counter(&root, "mlx5_0", 1, true, "np_cnp_sent", 3);
        let devs = devices(&root);
        assert_eq!(devs.len(), 3);
        let p = &devs[0].ports[0];
        assert_eq!(p.gids.len(), 5, "the all-zero GID is skipped");
        assert_eq!(p.active_mtu, Some(1024));
        assert!(p.counters.contains(&("out_of_sequence".into(), 7)));

        let c = choose_gid(&devs, "198.18.0.1".parse().unwrap()).unwrap();
        assert_eq!(
            (c.device.as_str(), c.port, c.index, c.mtu),
            ("mlx5_0", 1, 3, Some(1024))
        );
        let c = choose_gid(&devs, "2001:2::1".parse().unwrap()).unwrap();
        assert_eq!(c.index, 4);
        // IPv4-mapped local addresses match too.
        let c = choose_gid(&devs, "::ffff:198.18.0.1".parse().unwrap()).unwrap();
        assert_eq!(c.index, 3);
        // The down port and the IB port are never chosen.
        assert_eq!(choose_gid(&devs, "198.18.1.1".parse().unwrap()), None);
        // A link-local GID only for a link-local local address, and then v2 only.
        let c = choose_gid(&devs, "fe80::a00:27ff:fe12:3456".parse().unwrap()).unwrap();
        assert_eq!(c.index, 1);
        assert_eq!(choose_gid(&devs, "198.18.9.9".parse().unwrap()), None);

        // Overrides take the named index as it is (even a v1 GID), on an
        // active port of the named device only.
        let c = gid_by_index(&devs, "mlx5_0", 2, None).unwrap();
        assert_eq!(
            (c.port, c.index, c.addr),
            (1, 2, "198.18.0.1".parse().unwrap())
        );
        assert_eq!(gid_by_index(&devs, "mlx5_0", 4, Some(1)).unwrap().index, 4);
        assert_eq!(gid_by_index(&devs, "mlx5_0", 4, Some(2)), None, "no port 2");
        assert_eq!(gid_by_index(&devs, "mlx5_0", 9, None), None);
        assert_eq!(gid_by_index(&devs, "mlx5_1", 3, None), None, "port down");
    }
}
