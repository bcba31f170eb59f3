//! Gathered UDP sends: each datagram's headers and trailer (pad, ICRC) sit
//! in the QP's scratch buffer and its payload stays where the engine holds
//! it, and one `sendmsg` hands the kernel the pieces (an iovec per piece),
//! as one UDP GSO send where the run allows. The payload is copied once, by
//! the kernel, instead of first into a staging buffer.

use std::io::{self, IoSlice};
use std::net::SocketAddr;
use std::ops::Range;

use std::net::UdpSocket;

use bytes::Bytes;
use rdmx_core::{LocalSlice, RegionReadGuard};
use smallvec::SmallVec;

/// Where a datagram's payload is.
#[derive(Debug)]
pub(crate) enum Payload {
    /// Bytes the engine holds.
    Bytes(Bytes),
    /// A range of a registered region (a READ response's data), read while
    /// the send runs, under the region's read lock ([`Gathered::lock`]), as
    /// a NIC's DMA reads it when it transmits.
    Region(LocalSlice, Range<usize>),
}

/// The read lock a [`Payload::Region`] datagram needs while it is sent.
pub(crate) type Held<'a> = Option<RegionReadGuard<'a>>;

/// One datagram of a gathered send.
#[derive(Debug)]
pub(crate) struct Gathered {
    /// Offset of its headers (BTH and extended headers) in the scratch buffer.
    pub(crate) at: usize,
    /// Length of the headers.
    pub(crate) headers: usize,
    /// The payload, not copied.
    pub(crate) payload: Payload,
    /// Length of the trailer (pad and ICRC) right after the headers in the
    /// scratch buffer.
    pub(crate) trailer: usize,
}

impl Gathered {
    /// Lock a region payload for reading (recursively: other datagrams of
    /// the batch may hold the same region) until the guard drops.
    pub(crate) fn lock(&self) -> Held<'_> {
        match &self.payload {
            Payload::Bytes(_) => None,
            Payload::Region(slice, _) => Some(slice.lock()),
        }
    }

    /// The payload's bytes, with `held` from [`Gathered::lock`].
    pub(crate) fn payload<'a>(&'a self, held: &'a Held<'_>) -> &'a [u8] {
        match (&self.payload, held) {
            (Payload::Bytes(b), _) => b,
            (Payload::Region(_, range), Some(g)) => &g[range.clone()],
            (Payload::Region(..), None) => unreachable!("a region payload read without its lock"),
        }
    }

    /// Its size on the wire (headers, payload, pad and ICRC).
    pub(crate) fn len(&self) -> usize {
        let payload = match &self.payload {
            Payload::Bytes(b) => b.len(),
            Payload::Region(_, range) => range.len(),
        };
        self.headers + payload + self.trailer
    }

    /// Its pieces in wire order, with `held` from [`Gathered::lock`].
    pub(crate) fn pieces<'a>(&'a self, scratch: &'a [u8], held: &'a Held<'_>) -> [&'a [u8]; 3] {
        let t = self.at + self.headers;
        [
            &scratch[self.at..t],
            self.payload(held),
            &scratch[t..t + self.trailer],
        ]
    }

    /// The datagram's bytes in one buffer (for the backlog of a full socket).
    pub(crate) fn to_vec(&self, scratch: &[u8], held: &Held<'_>) -> Vec<u8> {
        self.pieces(scratch, held).concat()
    }
}

/// Datagrams ready to send: their headers and trailers in `scratch`, and
/// what their payloads need to be read (`held`, one entry each).
#[derive(Clone, Copy)]
pub(crate) struct Batch<'a, 'g> {
    /// Headers and trailers.
    pub(crate) scratch: &'a [u8],
    /// The datagrams.
    pub(crate) grams: &'a [Gathered],
    /// [`Gathered::lock`] of each.
    pub(crate) held: &'a [Held<'g>],
}

impl<'a, 'g> Batch<'a, 'g> {
    /// The datagrams of `range`.
    pub(crate) fn part(&self, range: Range<usize>) -> Batch<'a, 'g> {
        Batch {
            scratch: self.scratch,
            grams: &self.grams[range.clone()],
            held: &self.held[range],
        }
    }

    /// Their bytes in wire order, as one buffer.
    pub(crate) fn concat(&self, len: usize) -> Vec<u8> {
        let mut contents = Vec::with_capacity(len);
        for (g, h) in self.grams.iter().zip(self.held) {
            for piece in g.pieces(self.scratch, h) {
                contents.extend_from_slice(piece);
            }
        }
        contents
    }
}

/// Lock what `datagrams` need to be read ([`Gathered::lock`]), one entry each.
pub(crate) fn lock_all(datagrams: &[Gathered]) -> SmallVec<[Held<'_>; 8]> {
    datagrams.iter().map(Gathered::lock).collect()
}

/// The pieces of one send's datagrams (three at most each: headers,
/// payload, trailer), on the stack for a send of up to four datagrams.
type Iovs<'a> = SmallVec<[IoSlice<'a>; 12]>;

/// The control messages of one send, on the stack (two at most: 48 bytes
/// on 64-bit Linux). The kernel copies them into an aligned buffer of its
/// own before reading them (`____sys_sendmsg`), so this one needs no
/// alignment.
struct Control {
    buf: [u8; 64],
    len: usize,
}

impl Control {
    fn new() -> Control {
        Control {
            buf: [0; 64],
            len: 0,
        }
    }

    /// Append `bytes`, then `pad` zero bytes (the buffer starts zeroed).
    fn put(&mut self, bytes: &[u8], pad: usize) {
        self.buf[self.len..self.len + bytes.len()].copy_from_slice(bytes);
        self.len += bytes.len() + pad;
    }
}

impl std::ops::Deref for Control {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

/// `UDP_SEGMENT` (linux/udp.h): the GSO segment size of one send.
const UDP_SEGMENT: libc::c_int = 103;
/// ECN field value ECT(0) (RFC 3168), what RoCEv2 data packets carry.
const ECT0: libc::c_int = 2;

/// Append one control message to `out` as the kernel reads it (struct
/// cmsghdr of include/linux/socket.h: a `size_t` length counting header and
/// data, level and type as ints, then the data, padded to the alignment of
/// `size_t`).
fn put_cmsg(out: &mut Control, level: libc::c_int, kind: libc::c_int, data: &[u8]) {
    const ALIGN: usize = std::mem::size_of::<usize>();
    const HEADER: usize = (ALIGN + 8).div_ceil(ALIGN) * ALIGN;
    let len = HEADER + data.len();
    out.put(&len.to_ne_bytes(), 0);
    out.put(&level.to_ne_bytes(), 0);
    out.put(&kind.to_ne_bytes(), HEADER - ALIGN - 8);
    out.put(data, len.div_ceil(ALIGN) * ALIGN - len);
}

/// The control messages of one send: ECT(0) when `ecn` (IP_TOS for IPv4,
/// IPV6_TCLASS for IPv6, as ints: ip_cmsg_send, ip6_datagram_send_ctl), and
/// the GSO segment size when the send carries several datagrams (a u16:
/// udp_cmsg_send).
fn control(ipv6: bool, ecn: bool, segment: Option<u16>) -> Control {
    let mut c = Control::new();
    if ecn {
        let (level, kind) = if ipv6 {
            (libc::IPPROTO_IPV6, libc::IPV6_TCLASS)
        } else {
            (libc::IPPROTO_IP, libc::IP_TOS)
        };
        put_cmsg(&mut c, level, kind, &ECT0.to_ne_bytes());
    }
    if let Some(s) = segment {
        put_cmsg(&mut c, libc::SOL_UDP, UDP_SEGMENT, &s.to_ne_bytes());
    }
    c
}

/// Send the datagrams of `batch` from `sock`
/// (bound to `local`) to `dst` in one `sendmsg`: as GSO segments of
/// `segment` bytes (every datagram but the last exactly that long, the last
/// no longer) when given, else exactly one datagram. `WouldBlock` when the
/// socket buffer is full. `ecn` marks them ECT(0) by control message (a
/// socket that marks all it sends takes false); `connected`: `sock` is
/// connected to `dst` ([`connect`]), so the send names no address.
pub(crate) fn send(
    sock: &UdpSocket,
    local: SocketAddr,
    dst: SocketAddr,
    ecn: bool,
    connected: bool,
    batch: Batch<'_, '_>,
    segment: Option<usize>,
) -> io::Result<()> {
    let mut iov = Iovs::with_capacity(batch.grams.len() * 3);
    push_pieces(&mut iov, batch);
    let segment = segment_u16(segment)?;
    let (addr, ipv6) = destination(local, dst);
    let ctl = control(ipv6, ecn, segment);
    let mut msg = socket2::MsgHdr::new().with_buffers(&iov);
    if !connected {
        msg = msg.with_addr(&addr);
    }
    if !ctl.is_empty() {
        msg = msg.with_control(&ctl);
    }
    let sock = socket2::SockRef::from(sock);
    again_if_refused(connected, || sock.sendmsg(&msg, 0)).map(|_| ())
}

/// Run `send` once more if it failed with `ECONNREFUSED` on a connected
/// socket: that error is an earlier datagram's ICMP port unreachable, which
/// the kernel keeps on a connected UDP socket and hands to the next send
/// instead of sending it (`__udp4_lib_err` sets `sk_err`; the send's
/// allocation reports and clears it). The datagram that met it was not
/// sent; the peer's port being closed then is a loss like any other, which
/// the protocol's retransmission covers.
fn again_if_refused<T>(connected: bool, mut send: impl FnMut() -> io::Result<T>) -> io::Result<T> {
    match send() {
        Err(e) if connected && e.raw_os_error() == Some(libc::ECONNREFUSED) => send(),
        r => r,
    }
}

/// Connect `sock` (bound to `local`) to `dst` and, when `ecn`, make it mark
/// everything it sends ECT(0) (IP_TOS, or IPV6_TCLASS for IPv6 on the
/// wire). Sends to `dst` then name no address and carry no IP-level control
/// message, so the kernel uses the route it cached at connect instead of
/// looking one up per datagram (udp_sendmsg: `connected`; a soft RoCE 8 B
/// round trip was 3% faster so). Only for IPv6 on the wire: see
/// `may_connect` in device.rs for what connecting does to IPv4's
/// Identification. Returns whether the socket marks ECT(0) itself (false:
/// sends must ask per datagram).
pub(crate) fn connect(
    sock: &UdpSocket,
    local: SocketAddr,
    dst: SocketAddr,
    ecn: bool,
) -> io::Result<bool> {
    let (addr, ipv6) = destination(local, dst);
    let s = socket2::SockRef::from(sock);
    s.connect(&addr)?;
    if !ecn {
        return Ok(false);
    }
    let set = if ipv6 {
        s.set_tclass_v6(ECT0 as u32)
    } else {
        s.set_tos(ECT0 as u32)
    };
    Ok(set.is_ok())
}

/// Several runs of [`send`] (`runs`: each a range of `datagrams` and its
/// GSO segment size, as [`send`] takes them) in one `sendmmsg`. Returns how
/// many runs the kernel took, from the first (an error only when it took
/// none): the caller sends the rest as it would have.
pub(crate) fn send_runs(
    sock: &UdpSocket,
    local: SocketAddr,
    dst: SocketAddr,
    ecn: bool,
    connected: bool,
    batch: Batch<'_, '_>,
    runs: &[(Range<usize>, Option<usize>)],
) -> io::Result<usize> {
    let (addr, ipv6) = destination(local, dst);
    let mut iov = Iovs::with_capacity(batch.grams.len() * 3);
    let mut bounds = Vec::with_capacity(runs.len());
    let mut controls = Vec::with_capacity(runs.len());
    for (range, segment) in runs {
        let start = iov.len();
        push_pieces(&mut iov, batch.part(range.clone()));
        bounds.push(start..iov.len());
        controls.push(control(ipv6, ecn, segment_u16(*segment)?));
    }
    let msgs: Vec<crate::sys::OutMsg<'_>> = bounds
        .into_iter()
        .zip(&controls)
        .map(|(b, c)| crate::sys::OutMsg {
            iov: &iov[b],
            control: &c[..],
        })
        .collect();
    let to = (!connected).then_some(&addr);
    again_if_refused(connected, || crate::sys::sendmmsg(sock, to, &msgs))
}

/// Append the non-empty pieces of `batch`, in wire order.
fn push_pieces<'a>(iov: &mut Iovs<'a>, batch: Batch<'a, '_>) {
    for (d, h) in batch.grams.iter().zip(batch.held) {
        for p in d.pieces(batch.scratch, h) {
            if !p.is_empty() {
                iov.push(IoSlice::new(p));
            }
        }
    }
}

/// A GSO segment size as `UDP_SEGMENT` takes it.
fn segment_u16(segment: Option<usize>) -> io::Result<Option<u16>> {
    segment
        .map(|s| {
            u16::try_from(s)
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "GSO segment over 64 KiB"))
        })
        .transpose()
}

/// A socket of one family sends to that family (the QP's socket is bound to
/// the local address of its path): an IPv4 peer of an IPv6 socket is
/// addressed as v4-mapped.
fn family_of(local: SocketAddr, dst: SocketAddr) -> SocketAddr {
    match (local, dst) {
        (SocketAddr::V6(_), SocketAddr::V4(v4)) => {
            SocketAddr::new(v4.ip().to_ipv6_mapped().into(), v4.port())
        }
        _ => dst,
    }
}

/// `dst` as a socket bound to `local` addresses it ([`family_of`]), and
/// whether the datagrams travel as IPv6 (a v4-mapped peer is IPv4 on the
/// wire, with IPv4's control messages).
fn destination(local: SocketAddr, dst: SocketAddr) -> (socket2::SockAddr, bool) {
    let dst = family_of(local, dst);
    let ipv6 = dst.is_ipv6() && !is_v4_mapped(&dst);
    (socket2::SockAddr::from(dst), ipv6)
}

/// Whether datagrams from a socket bound to `local` travel to `dst` as
/// IPv6 on the wire (not IPv4, v4-mapped or not), as [`destination`] sees it.
pub(crate) fn wire_is_ipv6(local: SocketAddr, dst: SocketAddr) -> bool {
    destination(local, dst).1
}

fn is_v4_mapped(a: &SocketAddr) -> bool {
    matches!(a, SocketAddr::V6(v6) if v6.ip().to_ipv4_mapped().is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A receiving socket (with quinn-udp's state to read GRO batches and
    /// ECN) and a non-blocking sending one, on `ip`.
    fn sockets(ip: &str) -> (std::net::UdpSocket, quinn_udp::UdpSocketState, UdpSocket) {
        let rx = std::net::UdpSocket::bind((ip, 0)).unwrap();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let state = quinn_udp::UdpSocketState::new((&rx).into()).unwrap();
        let tx = UdpSocket::bind((ip, 0)).unwrap();
        tx.set_nonblocking(true).unwrap();
        (rx, state, tx)
    }

    /// Datagrams of the given (headers, payload, trailer) lengths, headers
    /// and trailers in one scratch buffer, payloads separate, every byte
    /// derived from its datagram's index; and each datagram's bytes whole.
    fn datagrams(shapes: &[(usize, usize, usize)]) -> (Vec<u8>, Vec<Gathered>, Vec<Vec<u8>>) {
        let mut scratch = Vec::new();
        let mut grams = Vec::new();
        let mut want = Vec::new();
        for (i, &(headers, plen, trailer)) in shapes.iter().enumerate() {
            let at = scratch.len();
            scratch.extend((0..headers).map(|k: usize| (k + i) as u8));
            scratch.extend((0..trailer).map(|k: usize| (k * 7 + i) as u8));
            let payload = Bytes::from(
                (0..plen)
                    .map(|k: usize| (k * 3 + i) as u8)
                    .collect::<Vec<_>>(),
            );
            let g = Gathered {
                at,
                headers,
                payload: Payload::Bytes(payload),
                trailer,
            };
            want.push(g.to_vec(&scratch, &None));
            grams.push(g);
        }
        (scratch, grams, want)
    }

    /// What the receiving socket sees: every datagram whole and in order
    /// (GSO split them where the receiver does not coalesce), with the ECN
    /// codepoint asked for.
    #[tokio::test]
    async fn a_gathered_gso_send_arrives_as_its_datagrams() {
        for ip in ["127.0.0.1", "::1"] {
            let (rx, state, tx) = sockets(ip);
            // Three datagrams of 1100 bytes and a shorter last one; the
            // payloads are separate buffers, one of them empty.
            let (scratch, grams, want) =
                datagrams(&[(12, 1000, 88), (13, 1000, 87), (1000, 0, 100), (15, 300, 4)]);
            assert_eq!(
                want.iter().map(Vec::len).collect::<Vec<_>>(),
                [1100, 1100, 1100, 319]
            );
            crate::sys::writable(&tx).await.unwrap();
            send(
                &tx,
                tx.local_addr().unwrap(),
                rx.local_addr().unwrap(),
                true,
                false,
                Batch {
                    scratch: &scratch,
                    grams: &grams,
                    held: &lock_all(&grams),
                },
                Some(1100),
            )
            .unwrap();
            // (Loopback hands a GSO send over whole, and the receiver is
            // told no ECN codepoint for it, for quinn-udp's sends alike.)
            let got = recv_datagrams(&state, &rx, 4);
            for (i, w) in want.iter().enumerate() {
                assert_eq!(&got[i].0[..], &w[..], "{ip}: datagram {i}");
            }
            // A lone datagram with ECT(0), and one without.
            for (ecn, i, want_ecn) in [
                (true, 3, Some(quinn_udp::EcnCodepoint::Ect0)),
                (false, 1, None),
            ] {
                let dst = rx.local_addr().unwrap();
                send(
                    &tx,
                    tx.local_addr().unwrap(),
                    dst,
                    ecn,
                    false,
                    Batch {
                        scratch: &scratch,
                        grams: &grams[i..i + 1],
                        held: &[None],
                    },
                    None,
                )
                .unwrap();
                let got = recv_datagrams(&state, &rx, 1);
                assert_eq!(&got[0].0[..], &want[i][..], "{ip}: lone datagram {i}");
                assert_eq!(got[0].1, want_ecn, "{ip}: lone datagram {i}");
            }
        }
    }

    /// Runs of different sizes in one `sendmmsg` (a GSO run of two full
    /// datagrams and a short last one, a lone small one, another run): the
    /// receiver sees every datagram whole and in order.
    #[tokio::test]
    async fn runs_sent_at_once_arrive_as_their_datagrams_in_order() {
        for ip in ["127.0.0.1", "::1"] {
            let (rx, state, tx) = sockets(ip);
            // Sizes 1000, 1000, 600 | 40 | 700, 700.
            let (scratch, grams, want) = datagrams(&[
                (28, 968, 4),
                (28, 968, 4),
                (28, 568, 4),
                (40, 0, 0),
                (12, 684, 4),
                (12, 684, 4),
            ]);
            assert_eq!(
                want.iter().map(Vec::len).collect::<Vec<_>>(),
                [1000, 1000, 600, 40, 700, 700]
            );
            let runs = [(0..3, Some(1000)), (3..4, None), (4..6, Some(700))];
            crate::sys::writable(&tx).await.unwrap();
            let sent = send_runs(
                &tx,
                tx.local_addr().unwrap(),
                rx.local_addr().unwrap(),
                false,
                false,
                Batch {
                    scratch: &scratch,
                    grams: &grams,
                    held: &lock_all(&grams),
                },
                &runs,
            )
            .unwrap();
            assert_eq!(sent, 3, "{ip}: every run taken");
            let got = recv_datagrams(&state, &rx, want.len());
            for (i, w) in want.iter().enumerate() {
                assert_eq!(&got[i].0[..], &w[..], "{ip}: datagram {i}");
            }
        }
    }

    /// A socket connected to its peer sends without naming it, one datagram
    /// or runs at once, and marks ECT(0) itself: what arrives is what was
    /// sent, with the codepoint, though no send asked for it.
    #[tokio::test]
    async fn a_connected_socket_sends_to_its_peer_and_marks_ect0_itself() {
        for ip in ["127.0.0.1", "::1"] {
            let (rx, state, tx) = sockets(ip);
            let (local, dst) = (tx.local_addr().unwrap(), rx.local_addr().unwrap());
            assert!(
                connect(&tx, local, dst, true).unwrap(),
                "{ip}: ECT(0) on the socket"
            );
            let (scratch, grams, want) = datagrams(&[(28, 968, 4), (28, 968, 4), (40, 0, 0)]);
            crate::sys::writable(&tx).await.unwrap();
            let one = Batch {
                scratch: &scratch,
                grams: &grams[2..],
                held: &[None],
            };
            send(&tx, local, dst, false, true, one, None).unwrap();
            let got = recv_datagrams(&state, &rx, 1);
            assert_eq!(&got[0].0[..], &want[2][..], "{ip}: lone datagram");
            assert_eq!(got[0].1, Some(quinn_udp::EcnCodepoint::Ect0), "{ip}");
            let all = Batch {
                scratch: &scratch,
                grams: &grams,
                held: &lock_all(&grams),
            };
            let runs = [(0..2, Some(1000)), (2..3, None)];
            assert_eq!(
                send_runs(&tx, local, dst, false, true, all, &runs).unwrap(),
                2
            );
            let got = recv_datagrams(&state, &rx, 3);
            for (i, w) in want.iter().enumerate() {
                assert_eq!(&got[i].0[..], &w[..], "{ip}: datagram {i} of the runs");
            }
        }
    }

    /// A connected socket whose peer's port was closed holds the ICMP
    /// error for its next send; that send goes again and arrives once the
    /// port is open, instead of failing for an earlier datagram.
    #[tokio::test]
    async fn a_send_after_port_unreachable_is_made_again() {
        for ip in ["127.0.0.1", "::1"] {
            let (rx, _, tx) = sockets(ip);
            let (local, dst) = (tx.local_addr().unwrap(), rx.local_addr().unwrap());
            connect(&tx, local, dst, false).unwrap();
            drop(rx);
            let (scratch, grams, want) = datagrams(&[(40, 8, 4)]);
            let lone = || Batch {
                scratch: &scratch,
                grams: &grams,
                held: &[None],
            };
            // The kernel answers a datagram to the closed port with ICMP
            // port unreachable, which a connected socket keeps as its error.
            send(&tx, local, dst, false, true, lone(), None).unwrap();
            let kept = tx.take_error().unwrap().map(|e| e.raw_os_error());
            assert_eq!(
                kept,
                Some(Some(libc::ECONNREFUSED)),
                "{ip}: the error is kept"
            );
            send(&tx, local, dst, false, true, lone(), None).unwrap();
            let rx = std::net::UdpSocket::bind(dst).unwrap();
            rx.set_read_timeout(Some(std::time::Duration::from_secs(2)))
                .unwrap();
            let state = quinn_udp::UdpSocketState::new((&rx).into()).unwrap();
            send(&tx, local, dst, false, true, lone(), None).unwrap();
            let got = recv_datagrams(&state, &rx, 1);
            assert_eq!(
                &got[0].0[..],
                &want[0][..],
                "{ip}: sent once the port is open"
            );
        }
    }

    /// `n` datagrams from `rx` (GRO may hand several over in one buffer).
    fn recv_datagrams(
        state: &quinn_udp::UdpSocketState,
        rx: &std::net::UdpSocket,
        n: usize,
    ) -> Vec<(Vec<u8>, Option<quinn_udp::EcnCodepoint>)> {
        let mut out = Vec::new();
        while out.len() < n {
            let mut buf = vec![0u8; 65536];
            let mut meta = [quinn_udp::RecvMeta::default()];
            state
                .recv(rx.into(), &mut [io::IoSliceMut::new(&mut buf)], &mut meta)
                .unwrap();
            let m = &meta[0];
            for d in buf[..m.len].chunks(m.stride.max(1)) {
                out.push((d.to_vec(), m.ecn));
            }
        }
        assert_eq!(out.len(), n, "more datagrams than sent");
        out
    }

    /// The control message layout the kernel expects on 64-bit Linux.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn control_messages_are_laid_out_as_the_kernel_reads_them() {
        let c = control(false, true, Some(1100));
        let mut want = Vec::new();
        want.extend_from_slice(&20usize.to_ne_bytes()); // CMSG_LEN(sizeof(int))
        want.extend_from_slice(&libc::IPPROTO_IP.to_ne_bytes());
        want.extend_from_slice(&libc::IP_TOS.to_ne_bytes());
        want.extend_from_slice(&2i32.to_ne_bytes());
        want.extend_from_slice(&[0; 4]); // CMSG_SPACE pads to 24
        want.extend_from_slice(&18usize.to_ne_bytes()); // CMSG_LEN(sizeof(u16))
        want.extend_from_slice(&libc::SOL_UDP.to_ne_bytes());
        want.extend_from_slice(&103i32.to_ne_bytes());
        want.extend_from_slice(&1100u16.to_ne_bytes());
        want.extend_from_slice(&[0; 6]);
        assert_eq!(&c[..], &want[..]);
    }
}
