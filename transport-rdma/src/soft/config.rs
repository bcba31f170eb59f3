//! How a soft RoCE device is set up ([`SoftConfig`]): the address and UDP
//! port it receives on, path MTU, ECN and DCQCN, selective repeat and its
//! windows, timers, socket buffers and receive queues, and how sends leave.

use std::net::{IpAddr, Ipv6Addr};
use std::time::Duration;

use rdmx_roce_proto::dcqcn::DcqcnConfig;

/// The standard RoCEv2 UDP port (IANA; rocev2-reference §1).
pub const ROCEV2_PORT: u16 = 4791;

/// How a soft device is set up.
#[derive(Clone, Debug)]
pub struct SoftConfig {
    /// Address to receive on (`::` = every address, IPv4 included).
    pub bind: IpAddr,
    /// UDP port to receive on; 0 = any free port (the peer learns it at bootstrap).
    pub port: u16,
    /// If `port` is taken (another process runs a soft device), use a free port
    /// instead of failing. Peers learn the port at bootstrap; real NICs need 4791.
    pub port_fallback: bool,
    /// Path MTU offered (256..=4096).
    pub mtu: u32,
    /// Mark data packets ECT(0) so switches can set CE instead of dropping.
    pub ecn: bool,
    /// DCQCN for the sender (`None`: no rate limiting; CNPs are still sent).
    pub dcqcn: Option<DcqcnConfig>,
    /// Offer selective repeat to rdmx peers (NIC peers always get go-back-N).
    pub selective_repeat: bool,
    /// Socket receive buffer to ask for (the kernel caps it at `net.core.rmem_max`).
    pub recv_buffer: usize,
    /// Receive queues (sockets sharing the port; packets steered by QPN).
    pub rx_queues: usize,
    /// Unacknowledged packets a QP may have in flight under selective repeat
    /// (1024 × 4 KiB = 4 MiB on loopback; also the chunk of responses one
    /// READ request asks for). At 1 MiB (256) a lone QP's writes were held
    /// to a window per round trip: 1 MiB writes, 16 in flight, on loopback
    /// went 2.1 -> 4.0 GB/s at 1024.
    pub window: u32,
    /// The same under go-back-N (NIC peers, and rdmx peers that do not
    /// agree to selective repeat): a loss there resends everything after
    /// it, so a smaller window keeps each loss cheaper (1% and 5% loss
    /// through a veth: 103 and 26 MB/s at 256 against 84 and 10 at 1024).
    pub window_go_back_n: u32,
    /// The retransmission timer's floor as an exponent (8: 1 ms); above it
    /// the timer follows the measured round trip, doubles per timeout, and
    /// stops at the agreed ACK timeout (or 64 × this): a software path
    /// recovers a lost last packet faster than a NIC's default would, a slow
    /// peer (rxe in a VM) is not asked twice for what it is still sending,
    /// and still gets the agreed timeout × retry count
    /// ([`Qp::set_fast_timeout`](rdmx_roce_proto::Qp::set_fast_timeout)).
    /// While a QP has seen no NAK and resent nothing for 100 ms, this timer
    /// and selective repeat's tail probe run up to 1 ms late: they almost
    /// never fire then, and waking for each of them cost a thread hand-off
    /// per operation.
    pub max_ack_timeout: u8,
    /// Exact IPv4 ICRCs for NIC peers: send IPv4 through a raw socket with our
    /// own header (needs CAP_NET_RAW; no GSO batching). Without it the kernel
    /// picks the IPv4 Identification after the ICRC was computed (with 0): rdmx
    /// receivers recover it, NICs would drop the packet. IPv6 is always exact.
    /// Default: on if `RDMX_SOFT_EXACT_IPV4=1`.
    pub exact_ipv4: bool,
    /// Send each datagram from its pieces (headers and trailer from a
    /// scratch buffer, payload from where the engine holds it) in one
    /// `sendmsg` per GSO run, instead of copying it into one buffer first
    /// (soft/gather.rs). Either way the bytes on the wire are the same; a
    /// kernel that refuses the gathered form gets the other from then on.
    /// Default: on unless `RDMX_SOFT_GATHER=0`.
    pub gathered_sends: bool,
    /// How long the ACK of a delivered message may wait for the answer the
    /// application sends back, to leave right behind it in the same send
    /// (0: never waits; see `QpConfig::ack_hold_ns`). It waits only while
    /// the application answers what it receives within this time, and in
    /// practice far less: the receive task that took the message lets a held
    /// ACK go once its scheduler tick is over (the application it woke runs
    /// in that tick on the same thread), answered or not. A ping-pong of
    /// sends then costs two send calls per round trip instead of four. On
    /// a multi-thread runtime this needs the workers to call
    /// [`on_thread_park`](super::on_thread_park) (`Builder::on_thread_park`); without it the ACKs
    /// leave at the end of the receive pass, as with 0.
    /// Default: 500 µs, or `RDMX_SOFT_ACK_HOLD_US` microseconds.
    pub ack_hold: Duration,
}

impl Default for SoftConfig {
    fn default() -> Self {
        SoftConfig {
            bind: IpAddr::V6(Ipv6Addr::UNSPECIFIED),
            port: ROCEV2_PORT,
            port_fallback: true,
            mtu: 4096,
            ecn: true,
            dcqcn: Some(DcqcnConfig::default()),
            selective_repeat: true,
            recv_buffer: 16 << 20,
            rx_queues: std::thread::available_parallelism().map_or(1, |n| n.get().min(4)),
            window: 1024,
            window_go_back_n: 256,
            max_ack_timeout: 8,
            exact_ipv4: std::env::var("RDMX_SOFT_EXACT_IPV4").is_ok_and(|v| v == "1"),
            gathered_sends: std::env::var("RDMX_SOFT_GATHER").map_or(true, |v| v != "0"),
            ack_hold: Duration::from_micros(
                std::env::var("RDMX_SOFT_ACK_HOLD_US")
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(500),
            ),
        }
    }
}
