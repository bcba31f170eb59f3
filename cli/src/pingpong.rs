//! `rdmx pingpong`: the peer of rdma-core's `ibv_rc_pingpong`, on rdmx's soft
//! RoCEv2 engine, so an unmodified verbs program (and the kernel's rxe or a
//! NIC under it) can be checked against rdmx and the other way round.
//!
//! It speaks rc_pingpong's out-of-band exchange over TCP (port 18515): each
//! side sends `"LID:QPN:PSN:GID"` as `%04x:%06x:%06x:` and the 16 GID bytes in
//! hex, 52 bytes with the NUL; the server connects its QP before it answers,
//! and the client ends with `"done"`. Then the client SENDs first and each side
//! SENDs again once its last SEND completed and a message arrived, `iters`
//! times each way. rc_pingpong sends from the buffer it receives into, so it
//! echoes: this side sends a different pattern each time and checks that the
//! next message it gets is exactly the last one it sent.
//!
//! ```text
//! ibv_rc_pingpong -d rxe0 -g 1 -s 4096 -n 100           # server (guest)
//! rdmx pingpong 198.18.0.2 --size 4096 --iters 100       # client (this host)
//! ```

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Instant;

use bytes::Bytes;
use rdmx_core::{Domain, Error};

use crate::oob::{connect_or_accept, padded, verbs_peer_engine, HexFields};
use rdmx_transport_rdma::verbs::{
    CqWaiter, Provider as _, QpOptions, QpPeer, QpTimers, SendOp, SendWr, WcOpcode, WcStatus,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Arguments of `rdmx pingpong` (named as ibv_rc_pingpong's options).
#[derive(clap::Args, Debug)]
pub(crate) struct PingpongArgs {
    /// The server to connect to; without it, wait for a client.
    server: Option<String>,
    /// TCP port of the exchange (ibv_rc_pingpong -p).
    #[arg(long, short, default_value_t = 18515)]
    port: u16,
    /// Message size in bytes (-s).
    #[arg(long, short, default_value_t = 4096)]
    size: usize,
    /// Messages each way (-n).
    #[arg(long, short = 'n', default_value_t = 1000)]
    iters: u64,
    /// Path MTU (-m): 256, 512, 1024, 2048 or 4096.
    #[arg(long, short, default_value_t = 1024)]
    mtu: u32,
    /// Receives kept posted (-r).
    #[arg(long, short, default_value_t = 500)]
    rx_depth: u32,
    /// Server: address to listen on.
    #[arg(long, default_value = "0.0.0.0")]
    listen: IpAddr,
    /// Send each message with immediate data (its number): SEND_*_WITH_IMMEDIATE
    /// on the wire, which rc_pingpong receives like any other message.
    #[arg(long)]
    imm: bool,
}

/// The exchange message: `LID:QPN:PSN:GID`, NUL-terminated (52 bytes).
const MSG_LEN: usize = 52;

/// One side's address in rc_pingpong's exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Dest {
    lid: u16,
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
}

impl Dest {
    fn encode(&self) -> [u8; MSG_LEN] {
        let gid: String = self.gid.iter().map(|b| format!("{b:02x}")).collect();
        padded(&format!(
            "{:04x}:{:06x}:{:06x}:{gid}",
            self.lid, self.qpn, self.psn
        ))
    }

    fn decode(m: &[u8]) -> Result<Dest, Error> {
        let mut f = HexFields::new(m, "an rc_pingpong address")?;
        let lid = f.hex(16)? as u16;
        let qpn = f.hex(24)? as u32;
        let psn = f.hex(24)? as u32;
        // 32 hex digits and nothing else (rc_pingpong's `gid_to_wire_gid`):
        // checked as bytes first, so that no slice below splits a character.
        let hex = f.text()?.as_bytes();
        if hex.len() != 32 || !hex.iter().all(u8::is_ascii_hexdigit) {
            return Err(f.error());
        }
        let digit = |c: u8| (c as char).to_digit(16).expect("checked above") as u8;
        let mut gid = [0u8; 16];
        for (b, pair) in gid.iter_mut().zip(hex.chunks_exact(2)) {
            *b = digit(pair[0]) << 4 | digit(pair[1]);
        }
        Ok(Dest { lid, qpn, psn, gid })
    }
}

/// The bytes sent in message `k`.
fn pattern(k: u64, size: usize) -> Bytes {
    (0..size)
        .map(|i| (k as usize).wrapping_mul(131).wrapping_add(i * 7) as u8)
        .collect::<Vec<u8>>()
        .into()
}

pub(crate) async fn run(a: PingpongArgs) -> Result<(), Error> {
    if !matches!(a.mtu, 256 | 512 | 1024 | 2048 | 4096) {
        return Err(Error::InvalidArgument(format!(
            "--mtu {}: use 256, 512, 1024, 2048 or 4096",
            a.mtu
        )));
    }
    if a.iters == 0 || a.rx_depth == 0 {
        return Err(Error::InvalidArgument(
            "--iters and --rx-depth must be at least 1".into(),
        ));
    }
    let dev = verbs_peer_engine()?;
    let mut stream = connect_or_accept(a.server.as_deref(), a.listen, a.port, "pingpong").await?;
    let local = stream
        .local_addr()
        .map_err(|e| Error::Connect(e.to_string()))?
        .ip()
        .to_canonical();
    let gid = match local {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let pd = dev.alloc_pd(&Domain::new())?;
    let cq = dev.create_cq((a.rx_depth + 16) as usize)?;
    let qp = pd.create_qp(
        &cq,
        QpOptions {
            max_send_wr: 16,
            ..QpOptions::default()
        },
    )?;
    for i in 0..a.rx_depth {
        qp.post_recv(u64::from(i), a.size)?;
    }
    let mine = Dest {
        lid: 0,
        qpn: qp.qpn(),
        psn: rand::random::<u32>() & 0xFF_FFFF,
        gid: gid.octets(),
    };
    println!(
        "  local address:  LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {gid}",
        mine.lid, mine.qpn, mine.psn
    );
    let io = |e: std::io::Error| Error::Disconnected(format!("rc_pingpong exchange: {e}"));
    let mut buf = [0u8; MSG_LEN];
    // rc_pingpong's QP attributes: timeout 14, retry 7, RNR retry 7.
    let connect = |peer: &Dest| {
        let ip = Ipv6Addr::from(peer.gid).to_canonical();
        qp.connect(
            QpPeer {
                local,
                qpn: peer.qpn,
                psn: peer.psn,
                addr: SocketAddr::new(ip, rdmx_transport_rdma::soft::ROCEV2_PORT),
                mtu: a.mtu,
                selective_repeat: false,
                timers: QpTimers {
                    timeout: 14,
                    retry_cnt: 7,
                    rnr_retry: 7,
                },
                // rc_pingpong sets max_rd_atomic 1 and sends no READs.
                max_rd_atomic: 1,
            },
            mine.psn,
        )
    };
    let peer = if a.server.is_some() {
        stream.write_all(&mine.encode()).await.map_err(io)?;
        stream.read_exact(&mut buf).await.map_err(io)?;
        let peer = Dest::decode(&buf)?;
        connect(&peer)?;
        stream.write_all(b"done\0").await.map_err(io)?;
        peer
    } else {
        stream.read_exact(&mut buf).await.map_err(io)?;
        let peer = Dest::decode(&buf)?;
        connect(&peer)?;
        stream.write_all(&mine.encode()).await.map_err(io)?;
        let mut done = [0u8; 5];
        stream.read_exact(&mut done).await.map_err(io)?;
        peer
    };
    println!(
        "  remote address: LID {:#06x}, QPN {:#08x}, PSN {:#08x}, GID {}",
        peer.lid,
        peer.qpn,
        peer.psn,
        Ipv6Addr::from(peer.gid)
    );

    let client = a.server.is_some();
    let send = |k: u64| {
        qp.post_send(SendWr {
            wr_id: 1 << 40 | k,
            op: SendOp::Send {
                sg: vec![pattern(k, a.size)],
                imm: a.imm.then_some(k as u32),
            },
        })
    };
    let t0 = Instant::now();
    let (mut sent, mut got, mut done) = (0u64, 0u64, 0u64);
    // rc_pingpong's rule: send when the last send completed and a message came.
    let (mut send_busy, mut awaiting) = (false, true);
    if client {
        send(0)?;
        sent = 1;
        send_busy = true;
    }
    let mut waiter = CqWaiter::new(cq.clone())?;
    let mut wcs = Vec::new();
    while got < a.iters || done < a.iters {
        wcs.clear();
        let deadline = tokio::time::Duration::from_secs(30);
        tokio::time::timeout(deadline, waiter.next(&mut wcs, 64))
            .await
            .map_err(|_| Error::TimedOut(deadline))??;
        for wc in wcs.drain(..) {
            if wc.status != WcStatus::Success {
                return Err(Error::Protocol(format!(
                    "completion {:?} of {:?}: {}",
                    wc.status,
                    wc.opcode,
                    wc.status.hint()
                )));
            }
            match wc.opcode {
                WcOpcode::Send => {
                    done += 1;
                    send_busy = false;
                }
                WcOpcode::Recv => {
                    // It echoes what it received last: our last message. The
                    // server's first message is whatever rc_pingpong's buffer
                    // held, unchecked.
                    let echo_of = if client {
                        Some(got)
                    } else {
                        got.checked_sub(1)
                    };
                    if let Some(k) = echo_of {
                        if wc.data != pattern(k, a.size) {
                            return Err(Error::Protocol(format!(
                                "message {got} is not the echo of our message {k}"
                            )));
                        }
                    }
                    got += 1;
                    awaiting = false;
                    qp.post_recv(wc.wr_id, a.size)?;
                }
                other => return Err(Error::Protocol(format!("unexpected completion {other:?}"))),
            }
        }
        if !send_busy && !awaiting && sent < a.iters {
            send(sent)?;
            sent += 1;
            send_busy = true;
            awaiting = true;
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let bytes = a.size as u64 * a.iters * 2;
    println!(
        "{bytes} bytes in {secs:.2} seconds = {:.2} Mbit/sec",
        bytes as f64 * 8.0 / secs / 1e6
    );
    println!(
        "{} iters in {secs:.2} seconds = {:.2} usec/iter",
        a.iters,
        secs * 1e6 / a.iters as f64
    );
    println!("every echo checked: {} messages each way", a.iters);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exchange_message_is_rc_pingpongs() {
        let d = Dest {
            lid: 0,
            qpn: 0x11,
            psn: 0xabcdef,
            gid: "::ffff:198.18.0.2".parse::<Ipv6Addr>().unwrap().octets(),
        };
        let m = d.encode();
        assert_eq!(
            &m[..51],
            b"0000:000011:abcdef:00000000000000000000ffffc6120002"
        );
        assert_eq!(m[51], 0);
        assert_eq!(Dest::decode(&m).unwrap(), d);
        assert!(Dest::decode(b"0000:1000000:000001:00").is_err());
        assert!(Dest::decode(b"garbage").is_err());
        assert!(Dest::decode(&[0xff; 52]).is_err());
    }

    /// A GID field of 32 bytes that are not 32 hex digits (here a two-byte
    /// character straddling a digit pair) is an error, not a panic.
    #[test]
    fn a_gid_of_other_characters_is_an_error() {
        let gid = format!("a\u{e9}{}", "0".repeat(29));
        assert_eq!(gid.len(), 32);
        let m = padded::<MSG_LEN>(&format!("0000:000011:abcdef:{gid}"));
        assert!(Dest::decode(&m).is_err());
        let m = padded::<MSG_LEN>(&format!("0000:000011:abcdef:+f{}", "0".repeat(30)));
        assert!(Dest::decode(&m).is_err());
    }
}
