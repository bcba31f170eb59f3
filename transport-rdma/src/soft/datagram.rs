//! How a RoCEv2 packet becomes a UDP datagram the way a NIC would send it:
//! the IP and UDP headers its ICRC covers, the ICRC sealed over them, the
//! IPv4 Identification each datagram of a GSO send gets (so the ICRC is
//! exact without a raw socket), and exact IPv4 through a raw socket.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;

use rdmx_roce_proto::icrc;
use rdmx_roce_proto::Packet;

use super::gather::{self, Gathered};

/// The IP and UDP headers a packet travels with, as the ICRC sees them
/// (rocev2-reference §9). IPv4: Identification 0 and DF; a UDP socket cannot
/// choose the Identification, so receivers recover it ([`Ipv4IdSolver`]).
pub(super) fn headers(
    src: SocketAddr,
    dst: SocketAddr,
    udp_len: usize,
    id: u16,
) -> (IpHeader, [u8; 8]) {
    let mut ip = IpHeader {
        bytes: [0u8; 40],
        len: 40,
    };
    match (src.ip(), dst.ip()) {
        (IpAddr::V4(s), IpAddr::V4(d)) => {
            ip.len = 20;
            let h = &mut ip.bytes;
            h[0] = 0x45;
            h[2..4].copy_from_slice(&((20 + udp_len) as u16).to_be_bytes());
            h[4..6].copy_from_slice(&id.to_be_bytes());
            h[6] = 0x40;
            h[8] = 64;
            h[9] = 17;
            h[12..16].copy_from_slice(&s.octets());
            h[16..20].copy_from_slice(&d.octets());
        }
        (s, d) => {
            let v6 = |a: IpAddr| match a {
                IpAddr::V6(a) => a,
                IpAddr::V4(a) => a.to_ipv6_mapped(),
            };
            let h = &mut ip.bytes;
            h[0] = 0x60;
            h[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
            h[6] = 17;
            h[7] = 64;
            h[8..24].copy_from_slice(&v6(s).octets());
            h[24..40].copy_from_slice(&v6(d).octets());
        }
    }
    let mut udp = [0u8; 8];
    udp[0..2].copy_from_slice(&src.port().to_be_bytes());
    udp[2..4].copy_from_slice(&dst.port().to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    (ip, udp)
}

/// An IPv4 (20 B) or IPv6 (40 B) header built on the stack.
pub(super) struct IpHeader {
    bytes: [u8; 40],
    len: usize,
}

impl std::ops::Deref for IpHeader {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Where the GSO run starting at `segs[i]` ends (exclusive): datagrams of
/// equal size, and one shorter last one (what `UDP_SEGMENT` sends in one call).
pub(super) fn gso_run_end(segs: &[usize], i: usize) -> usize {
    let size = segs[i];
    let mut j = i + 1;
    while j < segs.len() && segs[j] == size {
        j += 1;
    }
    if j < segs.len() && segs[j] < size {
        j += 1;
    }
    j
}

/// The IPv4 Identification Linux gives each datagram of a batch sent from an
/// unconnected UDP socket with DF (`IP_PMTUDISC_PROBE` or `_DO`): 0 for a
/// datagram sent alone, and 0, 1, 2… for the segments of one GSO send
/// (`ip_select_ident_segs`, then `inet_gso_segment` numbering the segments).
/// Knowing it before sending, the ICRC over it is exact with no raw socket.
/// The runs follow [`gso_run_end`].
#[derive(Debug, Default)]
pub(super) struct GsoRun {
    /// Size of the run's datagrams (0: no run yet).
    size: usize,
    /// Datagrams in the run so far.
    count: u16,
    /// A shorter datagram ended the run.
    closed: bool,
}

impl GsoRun {
    /// The Identification of the next datagram, of `size` bytes.
    pub(super) fn next_id(&mut self, size: usize) -> u16 {
        let joins = self.count > 0 && !self.closed && size <= self.size;
        if !joins {
            *self = GsoRun {
                size,
                count: 0,
                closed: false,
            };
        }
        self.closed = size < self.size;
        let id = self.count;
        self.count += 1;
        id
    }
}

/// Write the ICRC into the last 4 bytes of RoCEv2 UDP payload `d` (BTH …
/// pad, ICRC), computed for IPv4 Identification `id` (rocev2-reference §9).
pub(super) fn reseal_icrc(d: &mut [u8], src: SocketAddr, dst: SocketAddr, id: u16) {
    let n = d.len() - 4;
    let (ip, udp) = headers(src, dst, 8 + d.len(), id);
    let crc = icrc::compute(&ip, &udp, &d[..n]);
    d[n..].copy_from_slice(&crc.to_le_bytes());
}

/// Write the ICRCs of the batch's region payloads (`unsealed`: index in
/// `grams` and IP Identification), read under `held`, into their trailers
/// in `out` (rocev2-reference §2: the ICRC covers the masked IP and UDP
/// headers, BTH … pad).
pub(super) fn seal_regions(
    out: &mut [u8],
    grams: &[Gathered],
    held: &[gather::Held<'_>],
    unsealed: &[(usize, u16)],
    src: SocketAddr,
    dst: SocketAddr,
) {
    for &(k, id) in unsealed {
        let g = &grams[k];
        let (ip, udp) = headers(src, dst, 8 + g.len(), id);
        let t = g.at + g.headers;
        let pad = &out[t..t + g.trailer - 4];
        let crc = icrc::compute_parts(&ip, &udp, &[&out[g.at..t], g.payload(&held[k]), pad]);
        out[t + g.trailer - 4..t + g.trailer].copy_from_slice(&crc.to_le_bytes());
    }
}

/// Append `pkt` as a RoCEv2 UDP payload (BTH … pad, ICRC) to `out`, its ICRC
/// computed for an IPv4 Identification of `id`.
pub(super) fn encode(pkt: &Packet, src: SocketAddr, dst: SocketAddr, id: u16, out: &mut Vec<u8>) {
    let start = out.len();
    pkt.encode(out);
    out.extend_from_slice(&[0; 4]);
    reseal_icrc(&mut out[start..], src, dst, id);
}

/// Exact IPv4 sending: our own IP header through a raw socket (IPPROTO_RAW,
/// send-only, header included), so the Identification the ICRC covers is the
/// one on the wire. Needs CAP_NET_RAW.
pub(super) struct RawTx {
    sock: socket2::Socket,
    next_id: std::sync::atomic::AtomicU16,
}

impl RawTx {
    pub(super) fn new() -> io::Result<RawTx> {
        let sock = socket2::Socket::new(
            socket2::Domain::IPV4,
            socket2::Type::RAW,
            Some(socket2::Protocol::from(libc::IPPROTO_RAW)),
        )?;
        sock.set_nonblocking(true)?;
        Ok(RawTx {
            sock,
            next_id: std::sync::atomic::AtomicU16::new(rand::random::<u16>() | 1),
        })
    }

    /// A nonzero Identification (the kernel replaces 0 with its own).
    pub(super) fn id(&self) -> u16 {
        loop {
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            if id != 0 {
                return id;
            }
        }
    }

    /// Send one RoCEv2 UDP payload (BTH … ICRC) with header Identification `id`.
    pub(super) fn send(
        &self,
        src: SocketAddr,
        dst: SocketAddr,
        id: u16,
        ecn: u8,
        payload: &[u8],
    ) -> io::Result<()> {
        let (mut ip, udp) = headers(src, dst, 8 + payload.len(), id);
        ip.bytes[1] = ecn & 3;
        let sum = rdmx_roce_proto::wire::ipv4_checksum(&ip);
        ip.bytes[10..12].copy_from_slice(&sum.to_be_bytes());
        let mut d = Vec::with_capacity(28 + payload.len());
        d.extend_from_slice(&ip);
        d.extend_from_slice(&udp);
        d.extend_from_slice(payload);
        let to = SocketAddr::new(dst.ip(), 0);
        self.sock.send_to(&d, &to.into()).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Identifications the ICRCs are computed with are those the kernel
    /// gives: the index of each datagram in the GSO send that carries it.
    #[test]
    fn gso_ids_follow_the_runs_send_batch_makes() {
        let mut seed = 0x9e37_79b9_u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        for _ in 0..2000 {
            let n = 1 + (next() % 40) as usize;
            // Few distinct sizes, so that runs, shorter tails and restarts all occur.
            let segs: Vec<usize> = (0..n)
                .map(|_| [1100, 1100, 1100, 60, 300, 1100][(next() % 6) as usize])
                .collect();
            let mut run = GsoRun::default();
            let ids: Vec<u16> = segs.iter().map(|&s| run.next_id(s)).collect();
            let mut want = Vec::new();
            let mut i = 0;
            while i < segs.len() {
                let j = gso_run_end(&segs, i);
                want.extend((0..(j - i) as u16).collect::<Vec<_>>());
                i = j;
            }
            assert_eq!(ids, want, "sizes {segs:?}");
        }
        // The plain cases, spelled out.
        let ids = |s: &[usize]| {
            let mut r = GsoRun::default();
            s.iter().map(|&x| r.next_id(x)).collect::<Vec<_>>()
        };
        assert_eq!(ids(&[1100, 1100, 1100]), [0, 1, 2]);
        assert_eq!(ids(&[1100, 1100, 60, 1100]), [0, 1, 2, 0]);
        assert_eq!(ids(&[60, 1100, 1100]), [0, 0, 1]);
        assert_eq!(ids(&[1100, 60, 60]), [0, 1, 0]);
    }

    #[test]
    fn resealed_icrc_is_the_one_for_that_identification() {
        let src: SocketAddr = "198.18.0.1:50000".parse().unwrap();
        let dst: SocketAddr = "198.18.0.2:4791".parse().unwrap();
        let body: Vec<u8> = (0..64u8).collect();
        let seal = |id: u16| {
            let mut d = body.clone();
            let (ip, udp) = headers(src, dst, 8 + d.len() + 4, id);
            let crc = icrc::compute(&ip, &udp, &d);
            d.extend_from_slice(&crc.to_le_bytes());
            d
        };
        let mut d = seal(3);
        assert_ne!(d, seal(0));
        reseal_icrc(&mut d, src, dst, 0);
        assert_eq!(d, seal(0));
    }
}
