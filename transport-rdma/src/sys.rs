//! The crate's `unsafe` code, seven small blocks: registering a
//! completion-event fd and a UDP socket with tokio's reactor, waiting for a
//! borrowed socket to take writes, steering received packets to
//! receive queues by destination QP (a classic-BPF reuseport program, the RSS a
//! NIC does in hardware), reading the kernel's path MTU towards a peer, and
//! sending several UDP messages in one `sendmmsg`.
//! Each is exercised by the tests below and by every connection.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use tokio::io::unix::AsyncFd;

/// Wrap an owned event fd for readiness waits under the current runtime.
pub(crate) fn register_fd(fd: OwnedFd) -> io::Result<AsyncFd<OwnedFd>> {
    // SAFETY: `fd` is an `OwnedFd`: valid and open, moved into the `AsyncFd`,
    // which is its only owner, so it stays open and keeps the same number until
    // the `AsyncFd` is dropped (an `OwnedFd` always returns the same raw fd).
    unsafe { AsyncFd::register(fd) }.map_err(io::Error::from)
}

/// Wrap a non-blocking UDP socket for read-readiness waits under the
/// current runtime (the soft device's receive queues clear readiness
/// themselves). Read interest only: a UDP socket reports "writable" again
/// each time the kernel frees one of its sent datagrams, and with write
/// interest each of those would wake the thread waiting in `epoll`.
pub(crate) fn register_udp(sock: std::net::UdpSocket) -> io::Result<AsyncFd<std::net::UdpSocket>> {
    sock.set_nonblocking(true)?;
    // SAFETY: the socket is moved into the `AsyncFd`, its only owner: its fd
    // is valid and open, and `std::net::UdpSocket` returns the same raw fd
    // until it is dropped with the `AsyncFd`.
    unsafe { AsyncFd::register_with_interest(sock, tokio::io::Interest::READABLE) }
        .map_err(io::Error::from)
}

/// Wait until `sock` (a non-blocking socket, not otherwise registered with
/// the reactor) takes writes again. The socket is registered for write
/// interest only while this waits: senders whose buffer never fills leave
/// no write interest behind (see [`register_udp`] for why that matters).
pub(crate) async fn writable(sock: &impl AsFd) -> io::Result<()> {
    let fd = sock.as_fd();
    // SAFETY: `fd` borrows `sock`, which this function borrows for as long as
    // the `AsyncFd` lives (it is dropped, and the fd deregistered, before
    // the function returns), so the fd stays open and names the same socket;
    // a `BorrowedFd` returns the same raw fd every time. The socket must not
    // be registered with this reactor elsewhere (epoll refuses a second
    // registration of one fd; the error is returned).
    let w = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::WRITABLE) }
        .map_err(io::Error::from)?;
    let mut ready = w.writable().await?;
    ready.retain_ready();
    Ok(())
}

/// `SO_ATTACH_REUSEPORT_CBPF` (asm-generic/socket.h; libc only exports it for Android).
#[cfg(all(
    target_os = "linux",
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc64",
        target_arch = "powerpc",
        target_arch = "powerpc64"
    ))
))]
const SO_ATTACH_REUSEPORT_CBPF: libc::c_int = 51;

/// Steer each datagram of `sock`'s SO_REUSEPORT group to socket
/// `dest_qp % queues` (in bind order), reading the BTH DestQP (bytes 5..8 of
/// the UDP payload, IBTA 9.2). Packets too short to carry a BTH go to queue 0.
#[cfg(all(
    target_os = "linux",
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc64",
        target_arch = "powerpc",
        target_arch = "powerpc64"
    ))
))]
pub(crate) fn steer_by_qpn(sock: &impl AsRawFd, queues: u32) -> io::Result<()> {
    const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS: A = payload[k..k+4], big endian
    const AND_K: u16 = 0x54; // BPF_ALU | BPF_AND | BPF_K
    const MOD_K: u16 = 0x94; // BPF_ALU | BPF_MOD | BPF_K
    const RET_A: u16 = 0x16; // BPF_RET | BPF_A
    let ins = |code, k| libc::sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    };
    let mut prog = [
        ins(LD_W_ABS, 4),
        ins(AND_K, 0x00FF_FFFF),
        ins(MOD_K, queues.max(1)),
        ins(RET_A, 0),
    ];
    let fprog = libc::sock_fprog {
        len: prog.len() as libc::c_ushort,
        filter: prog.as_mut_ptr(),
    };
    // SAFETY: `fprog` points at `prog`, a valid 4-instruction program that
    // outlives the call (the kernel copies it); the option length is the size
    // of `sock_fprog`; `sock` is an open socket borrowed for the call.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            SO_ATTACH_REUSEPORT_CBPF,
            (&fprog as *const libc::sock_fprog).cast(),
            std::mem::size_of::<libc::sock_fprog>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Elsewhere the kernel's flow hash spreads packets instead.
#[cfg(not(all(
    target_os = "linux",
    not(any(
        target_arch = "mips",
        target_arch = "mips64",
        target_arch = "sparc64",
        target_arch = "powerpc",
        target_arch = "powerpc64"
    ))
)))]
pub(crate) fn steer_by_qpn(_sock: &impl AsRawFd, _queues: u32) -> io::Result<()> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "no reuseport BPF here",
    ))
}

/// The kernel's MTU for the route from `local` to `peer` (`IP_MTU` /
/// `IPV6_MTU` on a connected UDP socket; no packet is sent).
#[cfg(target_os = "linux")]
pub(crate) fn path_mtu(local: std::net::IpAddr, peer: std::net::IpAddr) -> io::Result<u32> {
    let sock = std::net::UdpSocket::bind((local, 0))?;
    sock.connect((peer, 9))?;
    let (level, name) = if peer.is_ipv4() {
        (libc::IPPROTO_IP, libc::IP_MTU)
    } else {
        (libc::IPPROTO_IPV6, libc::IPV6_MTU)
    };
    let mut mtu: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `mtu` and `len` are valid, writable and sized for an int option;
    // `sock` is an open socket for the duration of the call.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            level,
            name,
            (&mut mtu as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 && mtu > 0 {
        Ok(mtu as u32)
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Elsewhere: assume Ethernet.
#[cfg(not(target_os = "linux"))]
pub(crate) fn path_mtu(_local: std::net::IpAddr, _peer: std::net::IpAddr) -> io::Result<u32> {
    Ok(1500)
}

/// One message of a [`sendmmsg`]: its pieces and its control messages.
pub(crate) struct OutMsg<'a> {
    /// The datagram's (or GSO run's) bytes, in order.
    pub(crate) iov: &'a [std::io::IoSlice<'a>],
    /// Control messages as the kernel reads them (may be empty).
    pub(crate) control: &'a [u8],
}

/// Send `msgs` to `to` (`None`: where `sock` is connected) from `sock` in
/// one `sendmmsg(2)`, each message as
/// `sendmsg` would send it (its own datagram, or GSO run). Returns how many
/// the kernel took, from the first: fewer than all when one after the first
/// failed (an error only when the first did).
#[cfg(target_os = "linux")]
pub(crate) fn sendmmsg(
    sock: &impl AsRawFd,
    to: Option<&socket2::SockAddr>,
    msgs: &[OutMsg<'_>],
) -> io::Result<usize> {
    let mut hdrs: Vec<libc::mmsghdr> = msgs
        .iter()
        .map(|m| {
            // SAFETY: all-zero bytes are a valid `mmsghdr` (null pointers,
            // zero lengths); every field the kernel reads is set below.
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            if let Some(to) = to {
                h.msg_hdr.msg_name = to.as_ptr() as *mut libc::c_void;
                h.msg_hdr.msg_namelen = to.len();
            }
            // `IoSlice` is ABI-compatible with `iovec` on Unix (std's guarantee).
            h.msg_hdr.msg_iov = m.iov.as_ptr() as *mut libc::iovec;
            h.msg_hdr.msg_iovlen = m.iov.len() as _;
            if !m.control.is_empty() {
                h.msg_hdr.msg_control = m.control.as_ptr() as *mut libc::c_void;
                h.msg_hdr.msg_controllen = m.control.len() as _;
            }
            h
        })
        .collect();
    // SAFETY: every header points at memory borrowed for this call (the
    // address `to` when given, else no address, each message's iovecs and
    // the buffers they name, its control bytes), with the lengths of those
    // borrows; the kernel only reads them, and writes each header's
    // `msg_len`, inside `hdrs`. `sock` is an open socket for the duration
    // of the call.
    let r = unsafe {
        libc::sendmmsg(
            sock.as_raw_fd(),
            hdrs.as_mut_ptr(),
            hdrs.len() as libc::c_uint,
            0,
        )
    };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Elsewhere: not offered (callers send one message at a time).
#[cfg(not(target_os = "linux"))]
pub(crate) fn sendmmsg(
    _sock: &impl AsRawFd,
    _to: Option<&socket2::SockAddr>,
    _msgs: &[OutMsg<'_>],
) -> io::Result<usize> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "no sendmmsg here",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::UdpSocket;

    /// A socket whose buffer is full: `writable` waits until a reader
    /// drains its peer (a Unix datagram pair: its sender blocks on the
    /// receiver's queue, where UDP would drop), and the socket can be
    /// waited on again afterwards (the registration went with the wait).
    #[tokio::test]
    async fn writable_waits_for_room_and_leaves_no_registration() {
        let (a, b) = std::os::unix::net::UnixDatagram::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let mut sent = 0u64;
        while a.send(&[7u8; 1024]).is_ok() {
            sent += 1;
        }
        assert!(sent > 0);
        let wait = writable(&a);
        tokio::pin!(wait);
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), &mut wait)
                .await
                .is_err(),
            "a full socket is not writable"
        );
        let mut buf = [0u8; 2048];
        for _ in 0..sent {
            assert_eq!(b.recv(&mut buf).unwrap(), 1024);
        }
        tokio::time::timeout(std::time::Duration::from_secs(5), wait)
            .await
            .expect("writable once drained")
            .unwrap();
        // Registered only while waiting: a second wait registers afresh.
        tokio::time::timeout(std::time::Duration::from_secs(5), writable(&a))
            .await
            .expect("still writable")
            .unwrap();
    }

    fn reuseport_pair() -> (UdpSocket, UdpSocket) {
        let bind = |port: u16| {
            let s =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::DGRAM, None).unwrap();
            s.set_reuse_port(true).unwrap();
            s.bind(&std::net::SocketAddr::from(([127, 0, 0, 1], port)).into())
                .unwrap();
            UdpSocket::from(s)
        };
        let a = bind(0);
        let b = bind(a.local_addr().unwrap().port());
        (a, b)
    }

    /// Datagrams whose BTH names an even QP land in the first socket, odd ones
    /// in the second, whatever their source port.
    #[test]
    fn packets_are_steered_by_destination_qp() {
        let (a, b) = reuseport_pair();
        steer_by_qpn(&a, 2).unwrap();
        let to = a.local_addr().unwrap();
        for s in [&a, &b] {
            s.set_read_timeout(Some(std::time::Duration::from_secs(2)))
                .unwrap();
        }
        for i in 0..20u32 {
            let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
            let mut bth = [0u8; 12];
            let qpn = 0x1000 + i;
            bth[5..8].copy_from_slice(&qpn.to_be_bytes()[1..]);
            bth[4] = 0xC0; // FECN/BECN bits must not change the queue
            tx.send_to(&bth, to).unwrap();
            let mut buf = [0u8; 64];
            let (n, _) = if qpn % 2 == 0 { &a } else { &b }
                .recv_from(&mut buf)
                .unwrap();
            assert_eq!(&buf[..n], &bth[..], "QPN {qpn:#x} went to the wrong queue");
        }
    }

    #[test]
    fn loopback_path_mtu_is_the_lo_mtu() {
        let lo: u32 = std::fs::read_to_string("/sys/class/net/lo/mtu")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let ip = "127.0.0.1".parse().unwrap();
        // IPv4 caps a route MTU at 65535.
        assert_eq!(path_mtu(ip, ip).unwrap(), lo.min(65535));
    }

    /// A registered UDP socket reports readiness when a datagram arrives,
    /// and still reads as the same socket.
    #[tokio::test]
    async fn udp_socket_registers_and_wakes() {
        let rx = register_udp(UdpSocket::bind("127.0.0.1:0").unwrap()).unwrap();
        let to = rx.get_ref().local_addr().unwrap();
        UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .send_to(b"ping", to)
            .unwrap();
        let mut g = rx.readable().await.unwrap();
        let mut buf = [0u8; 8];
        let n = g.try_io(|s| s.get_ref().recv(&mut buf)).unwrap().unwrap();
        assert_eq!(&buf[..n], b"ping");
    }

    /// The event-fd registration works under a runtime (and fails cleanly on a
    /// closed runtime is not our business: tokio panics there by contract).
    #[tokio::test]
    async fn event_fd_registers() {
        let (x, _y) = std::os::unix::net::UnixDatagram::pair().unwrap();
        let fd = register_fd(OwnedFd::from(x)).unwrap();
        assert!(fd.get_ref().as_raw_fd() >= 0);
    }
}
