//! The hardware provider's decisions, kept apart from the verbs calls so they
//! are tested on hosts without a NIC: which device, which queue-pair
//! attributes for INIT → RTR → RTS, which requests are signaled or inline,
//! how atomic replies are laid out, and how much receive memory to pin.

use std::net::IpAddr;

use rdmx_core::{Error, Result};

#[cfg(test)]
use crate::verbs::QpTimers;
use crate::verbs::{QpOptions, QpPeer, SendOp};

/// UDP destination port of RoCEv2 (IANA; IBTA Annex A17, RoCEv2).
pub const ROCEV2_PORT: u16 = 4791;

/// Environment variable naming the RDMA device rdmx should use (`mlx5_0`).
pub const DEVICE_ENV: &str = "RDMX_RDMA_DEVICE";

/// `enum ibv_mtu` code for a path MTU in bytes (the IBTA MTU encoding of the
/// PortInfo MTU fields, vol. 1 ch. 14: 1 = 256 … 5 = 4096).
pub fn ibv_mtu(bytes: u32) -> Result<u32> {
    match bytes {
        256 => Ok(1),
        512 => Ok(2),
        1024 => Ok(3),
        2048 => Ok(4),
        4096 => Ok(5),
        other => Err(Error::InvalidArgument(format!(
            "path MTU {other} is not an IBTA MTU (256, 512, 1024, 2048 or 4096)"
        ))),
    }
}

/// Pick the device to open from what `ibv_get_device_list` gave: an error
/// and an empty list both mean "no RDMA" (the same binary runs on hosts
/// without libibverbs); `wanted` (from [`DEVICE_ENV`]) must name a device.
pub fn choose_device(
    list: std::result::Result<Vec<String>, String>,
    wanted: Option<&str>,
) -> Result<String> {
    let names = match list {
        Err(e) => {
            return Err(Error::Unsupported(format!(
                "no RDMA devices (libibverbs: {e})"
            )))
        }
        Ok(n) if n.is_empty() => return Err(Error::Unsupported("no RDMA devices".into())),
        Ok(n) => n,
    };
    match wanted.filter(|w| !w.is_empty()) {
        Some(w) if names.iter().any(|n| n == w) => Ok(w.to_string()),
        Some(w) => Err(Error::InvalidArgument(format!(
            "{DEVICE_ENV}={w}, but the RDMA devices are: {}",
            names.join(", ")
        ))),
        None => Ok(names[0].clone()),
    }
}

/// The GID of a RoCEv2 peer address: IPv4 addresses are IPv4-mapped
/// (`::ffff:a.b.c.d`, IBTA Annex A17), IPv6 addresses are the GID.
pub fn gid_of(ip: IpAddr) -> [u8; 16] {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// Remote rights the responder of every rdmx QP grants: what a region allows
/// is decided per region by its R_Key (IBTA vol. 1 ch. 10, memory
/// protection), the QP allows all.
/// Values are `ibv_access_flags`.
pub const QP_ACCESS: u32 =
    ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC;
/// `IBV_ACCESS_LOCAL_WRITE`.
pub const ACCESS_LOCAL_WRITE: u32 = 1;
/// `IBV_ACCESS_REMOTE_WRITE`.
pub const ACCESS_REMOTE_WRITE: u32 = 2;
/// `IBV_ACCESS_REMOTE_READ`.
pub const ACCESS_REMOTE_READ: u32 = 4;
/// `IBV_ACCESS_REMOTE_ATOMIC`.
pub const ACCESS_REMOTE_ATOMIC: u32 = 8;

/// `ibv_access_flags` for a region with rdmx rights `a`. Local write is
/// always set: NICs require it with remote write or atomic rights.
pub fn mr_access(a: rdmx_core::Access) -> u32 {
    use rdmx_core::Access;
    let mut f = ACCESS_LOCAL_WRITE;
    if a.contains(Access::REMOTE_READ) {
        f |= ACCESS_REMOTE_READ;
    }
    if a.contains(Access::REMOTE_WRITE) {
        f |= ACCESS_REMOTE_WRITE;
    }
    if a.contains(Access::REMOTE_ATOMIC) {
        f |= ACCESS_REMOTE_ATOMIC;
    }
    f
}

/// Attributes of the RESET → INIT transition (IBTA vol. 1 ch. 11 Modify QP, `ibv_modify_qp`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InitAttrs {
    /// Physical port.
    pub port: u8,
    /// P_Key index (0 on RoCE).
    pub pkey_index: u16,
    /// Remote rights of the responder (`ibv_access_flags`).
    pub access: u32,
}

/// Attributes of INIT → RTR: where the peer is and how it starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtrAttrs {
    /// `enum ibv_mtu` code of the path MTU.
    pub path_mtu: u32,
    /// The peer's QPN.
    pub dest_qpn: u32,
    /// The PSN the peer starts with (our expected PSN).
    pub rq_psn: u32,
    /// READ/atomic requests we accept outstanding (responder resources).
    pub max_dest_rd_atomic: u8,
    /// RNR NAK timer code (IBTA Table 45; 12 = 0.64 ms).
    pub min_rnr_timer: u8,
    /// Destination GID (the peer's address, IPv4-mapped for IPv4).
    pub dgid: [u8; 16],
    /// Our GID table index (the RoCEv2 GID of the routed interface).
    pub sgid_index: u8,
    /// IP TTL / hop limit.
    pub hop_limit: u8,
    /// IP traffic class (DSCP << 2; the NIC sets ECN).
    pub traffic_class: u8,
    /// Physical port.
    pub port: u8,
}

/// Attributes of RTR → RTS: our sending side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RtsAttrs {
    /// First PSN we send.
    pub sq_psn: u32,
    /// Local ACK timeout exponent (4.096 µs × 2^timeout).
    pub timeout: u8,
    /// Retries on timeout or sequence NAK.
    pub retry_cnt: u8,
    /// Retries on RNR NAK (7 = infinite).
    pub rnr_retry: u8,
    /// READ/atomic requests we keep outstanding (initiator depth).
    pub max_rd_atomic: u8,
}

/// The whole RC connection plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpPlan {
    /// RESET → INIT.
    pub init: InitAttrs,
    /// INIT → RTR.
    pub rtr: RtrAttrs,
    /// RTR → RTS.
    pub rts: RtsAttrs,
}

/// Where our end of a path is on the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalPort {
    /// Physical port number.
    pub port: u8,
    /// GID table index.
    pub gid_index: u8,
    /// The device's limit on outstanding READ/atomics per QP
    /// (`max_qp_rd_atom`, `max_qp_init_rd_atom`; the smaller).
    pub max_rd_atomic: u32,
    /// IP traffic class for our packets.
    pub traffic_class: u8,
}

/// Plan the transitions of an RC QP towards `peer` (IBTA vol. 1 ch. 11 Modify QP; the
/// RC rules of 9.7).
/// Fails with a clear error on values the NIC would refuse.
/// The timers are the ones both ends agreed on (`peer.timers`); the
/// READ/atomic depth is the path's (`peer.max_rd_atomic`), within `opts`
/// and the device's limit.
pub fn qp_plan(peer: &QpPeer, sq_psn: u32, opts: &QpOptions, local: &LocalPort) -> Result<QpPlan> {
    let t = peer.timers;
    if t.timeout > 31 || t.retry_cnt > 7 || t.rnr_retry > 7 {
        return Err(Error::InvalidArgument(format!(
            "QP timers out of range: timeout {} (<= 31), retry_cnt {} (<= 7), rnr_retry {} (<= 7)",
            t.timeout, t.retry_cnt, t.rnr_retry
        )));
    }
    if peer.qpn > 0xFF_FFFF || peer.psn > 0xFF_FFFF || sq_psn > 0xFF_FFFF {
        return Err(Error::InvalidArgument("QPN and PSNs are 24-bit".into()));
    }
    let rd = opts
        .max_rd_atomic
        .min(local.max_rd_atomic)
        .min(peer.max_rd_atomic)
        .clamp(1, 255) as u8;
    Ok(QpPlan {
        init: InitAttrs {
            port: local.port,
            pkey_index: 0,
            access: QP_ACCESS,
        },
        rtr: RtrAttrs {
            path_mtu: ibv_mtu(peer.mtu)?,
            dest_qpn: peer.qpn,
            rq_psn: peer.psn,
            max_dest_rd_atomic: rd,
            min_rnr_timer: 12,
            dgid: gid_of(peer.addr.ip()),
            sgid_index: local.gid_index,
            hop_limit: 64,
            traffic_class: local.traffic_class,
            port: local.port,
        },
        rts: RtsAttrs {
            sq_psn,
            timeout: t.timeout,
            retry_cnt: t.retry_cnt,
            rnr_retry: t.rnr_retry,
            max_rd_atomic: rd,
        },
    })
}

/// How an atomic's original value comes back in the local buffer. The IBTA
/// AtomicAckETH is big-endian on the wire (IBTA 9.4); most NICs store it in host
/// order, but mlx5 devices store it as received (big-endian) on
/// little-endian hosts, as UCX and Open MPI work around.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicReply {
    /// Host byte order.
    Host,
    /// Big-endian.
    BigEndian,
}

impl AtomicReply {
    /// The layout for a device by its name (override with
    /// `RDMX_HW_ATOMIC_REPLY=host|be`).
    pub fn for_device(name: &str, env: Option<&str>) -> AtomicReply {
        match env {
            Some("be") => return AtomicReply::BigEndian,
            Some("host") => return AtomicReply::Host,
            _ => {}
        }
        if name.starts_with("mlx5") && cfg!(target_endian = "little") {
            AtomicReply::BigEndian
        } else {
            AtomicReply::Host
        }
    }

    /// Decode the 8 bytes the NIC stored.
    pub fn decode(self, b: [u8; 8]) -> u64 {
        match self {
            AtomicReply::Host => u64::from_ne_bytes(b),
            AtomicReply::BigEndian => u64::from_be_bytes(b),
        }
    }
}

/// How a send-queue request's local data reaches the NIC.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataPath {
    /// Copied into the work request itself (`IBV_SEND_INLINE`): no buffer,
    /// no DMA read; small SENDs and WRITEs.
    Inline,
    /// Copied into a pre-registered staging buffer.
    Staged,
    /// No local data: zero-length SEND/WRITE, READ and atomics (those two
    /// get a buffer for their result).
    None,
}

/// The data path for `op` when the QP takes `max_inline` inline bytes.
pub fn data_path(op: &SendOp, max_inline: u32) -> DataPath {
    match op {
        // A zero-length SEND or WRITE carries no scatter/gather entry at all.
        SendOp::Send { .. } | SendOp::Write { .. } if op.is_empty() => DataPath::None,
        SendOp::Send { .. } | SendOp::Write { .. } if op.len() <= u64::from(max_inline) => {
            DataPath::Inline
        }
        SendOp::Send { .. } | SendOp::Write { .. } => DataPath::Staged,
        _ => DataPath::None,
    }
}

/// Selective signaling for a batch posted with one doorbell: only the last
/// request, those that return data (READ, atomics) and every `max_run`-th
/// request generate a CQE. The send queue completes in order (IBTA vol. 1 ch. 10),
/// so a signaled completion also completes the unsignaled requests before it;
/// `max_run` bounds the send-queue slots a run can hold unacknowledged.
pub fn signal_plan<'a>(
    batch: impl ExactSizeIterator<Item = &'a SendOp>,
    max_run: usize,
) -> Vec<bool> {
    let mut run = 0;
    let last = batch.len().saturating_sub(1);
    batch
        .enumerate()
        .map(|(i, op)| {
            let data = matches!(
                op,
                SendOp::Read { .. } | SendOp::CompareSwap { .. } | SendOp::FetchAdd { .. }
            );
            run += 1;
            let signal = i == last || data || run >= max_run.max(1);
            if signal {
                run = 0;
            }
            signal
        })
        .collect()
}

/// Receive memory one NIC connection may pin: `RDMX_HW_RECV_BUDGET` bytes,
/// 64 MiB if unset.
pub fn recv_budget() -> u64 {
    std::env::var("RDMX_HW_RECV_BUDGET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64 << 20)
}

/// Receive credits for a connection over a NIC: each posted receive pins a
/// `max_message` buffer, so the credits are cut to fit `budget` bytes (never
/// below the protocol minimum of 4, never above what was asked).
pub fn hw_recv_credits(credits: u32, max_message: u64, budget: u64) -> u32 {
    let fit = budget / max_message.max(1);
    (fit.min(u64::from(credits)) as u32).max(4.min(credits))
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use rdmx_core::{Access, RemoteRegion};
    use std::net::SocketAddr;

    #[test]
    fn mtu_codes() {
        for (bytes, code) in [(256, 1), (512, 2), (1024, 3), (2048, 4), (4096, 5)] {
            assert_eq!(ibv_mtu(bytes).unwrap(), code);
        }
        assert!(ibv_mtu(1500).unwrap_err().to_string().contains("1500"));
    }

    #[test]
    fn no_rdma_from_an_error_or_an_empty_list() {
        let e = choose_device(Err("libibverbs.so.1: not found".into()), None).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)));
        assert!(e.to_string().contains("no RDMA devices"), "{e}");
        let e = choose_device(Ok(vec![]), Some("mlx5_0")).unwrap_err();
        assert_eq!(
            e.to_string(),
            Error::Unsupported("no RDMA devices".into()).to_string()
        );
        let two = || Ok(vec!["mlx5_0".to_string(), "mlx5_1".to_string()]);
        assert_eq!(choose_device(two(), None).unwrap(), "mlx5_0");
        assert_eq!(choose_device(two(), Some("mlx5_1")).unwrap(), "mlx5_1");
        assert_eq!(choose_device(two(), Some("")).unwrap(), "mlx5_0");
        let e = choose_device(two(), Some("bnxt_re0"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RDMX_RDMA_DEVICE=bnxt_re0") && e.contains("mlx5_0, mlx5_1"),
            "{e}"
        );
    }

    fn peer(ip: &str, mtu: u32) -> QpPeer {
        QpPeer {
            local: "198.18.0.1".parse().unwrap(),
            qpn: 0x1234,
            psn: 0xABCDEF,
            addr: SocketAddr::new(ip.parse().unwrap(), ROCEV2_PORT),
            mtu,
            selective_repeat: false,
            timers: QpTimers::of(&QpOptions::default()),
            max_rd_atomic: 128,
        }
    }

    const PORT: LocalPort = LocalPort {
        port: 1,
        gid_index: 3,
        max_rd_atomic: 16,
        traffic_class: 106,
    };

    #[test]
    fn qp_plan_carries_the_bootstrap_values() {
        let opts = QpOptions {
            max_rd_atomic: 64,
            ..QpOptions::default()
        };
        let p = qp_plan(&peer("198.18.0.2", 1024), 0x42, &opts, &PORT).unwrap();
        assert_eq!(
            p.init,
            InitAttrs {
                port: 1,
                pkey_index: 0,
                access: 15
            }
        );
        assert_eq!(p.rtr.path_mtu, 3);
        assert_eq!((p.rtr.dest_qpn, p.rtr.rq_psn), (0x1234, 0xABCDEF));
        assert_eq!(
            p.rtr.dgid,
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 198, 18, 0, 2],
            "IPv4-mapped GID"
        );
        assert_eq!(
            (p.rtr.sgid_index, p.rtr.port, p.rtr.traffic_class),
            (3, 1, 106)
        );
        assert_eq!(p.rts.sq_psn, 0x42);
        assert_eq!(
            (p.rts.timeout, p.rts.retry_cnt, p.rts.rnr_retry),
            (10, 7, 7)
        );
        assert_eq!(
            (p.rtr.max_dest_rd_atomic, p.rts.max_rd_atomic),
            (16, 16),
            "device limit"
        );
        let slow_peer = QpPeer {
            max_rd_atomic: 4,
            ..peer("198.18.0.2", 1024)
        };
        let p = qp_plan(&slow_peer, 0x42, &opts, &PORT).unwrap();
        assert_eq!(
            (p.rtr.max_dest_rd_atomic, p.rts.max_rd_atomic),
            (4, 4),
            "the path's agreed depth"
        );
        let v6 = qp_plan(&peer("2001:db8::7", 4096), 1, &opts, &PORT).unwrap();
        assert_eq!(
            v6.rtr.dgid,
            "2001:db8::7"
                .parse::<std::net::Ipv6Addr>()
                .unwrap()
                .octets()
        );
        assert_eq!(v6.rtr.path_mtu, 5);
    }

    #[test]
    fn qp_plan_refuses_what_a_nic_would() {
        let bad_mtu = qp_plan(&peer("198.18.0.2", 1500), 0, &QpOptions::default(), &PORT);
        assert!(bad_mtu.unwrap_err().to_string().contains("1500"));
        let mut t = peer("198.18.0.2", 1024);
        t.timers.timeout = 32;
        assert!(qp_plan(&t, 0, &QpOptions::default(), &PORT).is_err());
        let mut r = peer("198.18.0.2", 1024);
        r.timers.retry_cnt = 8;
        assert!(qp_plan(&r, 0, &QpOptions::default(), &PORT).is_err());
        assert!(qp_plan(
            &peer("198.18.0.2", 1024),
            1 << 24,
            &QpOptions::default(),
            &PORT
        )
        .is_err());
    }

    #[test]
    fn region_rights_become_ibv_access_flags() {
        assert_eq!(mr_access(Access::LOCAL), ACCESS_LOCAL_WRITE);
        assert_eq!(mr_access(Access::REMOTE_READ), 1 | 4);
        assert_eq!(mr_access(Access::REMOTE_WRITE), 1 | 2);
        assert_eq!(mr_access(Access::ALL), 15);
    }

    #[test]
    fn atomic_replies_by_device() {
        let v = 0x0102_0304_0506_0708u64;
        let be = AtomicReply::for_device("mlx5_0", None);
        if cfg!(target_endian = "little") {
            assert_eq!(be, AtomicReply::BigEndian);
        }
        assert_eq!(be.decode(v.to_be_bytes()), v);
        let host = AtomicReply::for_device("bnxt_re0", None);
        assert_eq!(host, AtomicReply::Host);
        assert_eq!(host.decode(v.to_ne_bytes()), v);
        assert_eq!(
            AtomicReply::for_device("mlx5_0", Some("host")),
            AtomicReply::Host
        );
        assert_eq!(
            AtomicReply::for_device("rxe0", Some("be")),
            AtomicReply::BigEndian
        );
    }

    fn send(n: usize) -> SendOp {
        SendOp::Send {
            sg: vec![Bytes::from(vec![7u8; n])],
            imm: None,
        }
    }

    #[test]
    fn small_sends_go_inline() {
        assert_eq!(data_path(&send(64), 64), DataPath::Inline);
        assert_eq!(data_path(&send(65), 64), DataPath::Staged);
        assert_eq!(data_path(&send(0), 0), DataPath::None);
        assert_eq!(data_path(&send(0), 64), DataPath::None);
        assert_eq!(
            data_path(&send(1), 0),
            DataPath::Staged,
            "device without inline"
        );
        let r = RemoteRegion {
            addr: 0,
            len: 8,
            rkey: 1,
        };
        assert_eq!(data_path(&SendOp::Read { src: r }, 64), DataPath::None);
        assert_eq!(
            data_path(&SendOp::FetchAdd { dst: r, add: 1 }, 64),
            DataPath::None
        );
    }

    #[test]
    fn selective_signaling_plan() {
        let r = RemoteRegion {
            addr: 0,
            len: 8,
            rkey: 1,
        };
        let batch: Vec<SendOp> = (0..10).map(|_| send(8)).collect();
        let p = signal_plan(batch.iter(), 4);
        assert_eq!(
            p,
            [false, false, false, true, false, false, false, true, false, true]
        );
        let mixed = [send(8), SendOp::Read { src: r }, send(8), send(8)];
        assert_eq!(signal_plan(mixed.iter(), 64), [false, true, false, true]);
        assert_eq!(signal_plan([send(1)].iter(), 64), [true]);
        assert!(signal_plan([].iter(), 64).is_empty());
    }

    #[test]
    fn receive_credits_fit_the_pinned_budget() {
        assert_eq!(hw_recv_credits(256, 16 << 20, 64 << 20), 4);
        assert_eq!(hw_recv_credits(256, 64 << 10, 64 << 20), 256);
        assert_eq!(hw_recv_credits(256, 1 << 20, 64 << 20), 64);
        assert_eq!(
            hw_recv_credits(256, 1 << 30, 64 << 20),
            4,
            "protocol minimum"
        );
        assert_eq!(
            hw_recv_credits(2, 1 << 30, 64 << 20),
            2,
            "never above the ask"
        );
    }
}
