//! The socket's receive low-water mark (`SO_RCVLOWAT`, socket(7)): while a
//! large payload is being received, the kernel wakes the reader only once
//! this many bytes are queued (or the peer closes), instead of at every
//! segment. On loopback and busy hosts a wake-up is paid by the sender (the
//! receive path runs in its context) and costs an inter-processor interrupt:
//! a 1 MiB message arriving in 64 KiB pieces cost a dozen of them.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Set the receive low-water mark of `sock` to `bytes` (1 restores the
/// default: readable as soon as anything is queued).
pub(crate) fn set_recv_lowat(sock: BorrowedFd<'_>, bytes: usize) -> io::Result<()> {
    let v = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    // SAFETY: `sock` is an open descriptor for the whole call (borrowed);
    // the option value points to a c_int that lives across the call, and its
    // size is the length passed.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The receive low-water mark of `sock`.
#[cfg(test)]
pub(crate) fn recv_lowat(sock: BorrowedFd<'_>) -> io::Result<usize> {
    let mut v: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `sock` is open for the call; `v` and `len` are live, writable
    // and `len` holds the size of `v`.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&mut v as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    if r == 0 {
        Ok(v.max(0) as usize)
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::fd::AsFd;

    /// The mark is set and read back, and a reader with the mark set is not
    /// readable until that many bytes are queued.
    #[test]
    fn the_mark_holds_readiness_back_until_enough_is_queued() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (mut rx, _) = l.accept().unwrap();
        assert_eq!(recv_lowat(rx.as_fd()).unwrap(), 1);
        set_recv_lowat(rx.as_fd(), 1000).unwrap();
        assert_eq!(recv_lowat(rx.as_fd()).unwrap(), 1000);
        let readable = |s: &std::net::TcpStream| {
            let p = libc_poll(s);
            p.revents != 0
        };
        tx.write_all(&[7u8; 600]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(!readable(&rx), "readable below the mark");
        tx.write_all(&[8u8; 600]).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(readable(&rx), "not readable above the mark");
        set_recv_lowat(rx.as_fd(), 1).unwrap();
        let mut got = vec![0u8; 1200];
        rx.read_exact(&mut got).unwrap();
        assert!(got[..600].iter().all(|&b| b == 7) && got[600..].iter().all(|&b| b == 8));
    }

    fn libc_poll(s: &std::net::TcpStream) -> libc::pollfd {
        let mut p = libc::pollfd {
            fd: s.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one live pollfd, count 1, no wait.
        let r = unsafe { libc::poll(&mut p, 1, 0) };
        assert!(r >= 0);
        p
    }
}
