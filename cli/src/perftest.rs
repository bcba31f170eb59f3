//! `rdmx perf --perftest HOST` and `rdmx perf --perftest-server`: rdmx's soft
//! RoCEv2 engine as the peer of unmodified perftest (`ib_write_bw`,
//! `ib_read_bw`, `ib_send_bw`, `ib_atomic_bw`, `ib_write_lat`), the programs
//! RDMA users check a peer with.
//!
//! perftest's out-of-band exchange runs over TCP (port 18515). Every step is a
//! symmetric swap of one fixed-size message: the client writes first and then
//! reads, the server reads first and then writes (perftest's
//! `ctx_xchg_data_ethernet` and `ctx_hand_shake`). In order:
//!
//! 1. the version, 16 bytes of text (`exchange_versions`; perftest refuses
//!    peers below 5.70, and so does this side);
//! 2. the cycle buffer and the cache line size, 4-byte big-endian integers;
//!    both sides keep the larger (`check_sys_data`);
//! 3. the path MTU as the `ibv_mtu` number in two bytes of text ("3\0" for
//!    1024); both sides keep the smaller (`check_mtu`);
//! 4. handshakes of the QP's address, 108 bytes of text
//!    `lid:out_reads:qpn:psn:rkey:vaddr:` then the 16 GID bytes as `xx:` and
//!    `srqn:` (`KEY_PRINT_FMT_GID`), some before the QP is connected and some
//!    after, as many as the program does;
//! 5. after the run of the bandwidth tests a handshake and the client's report
//!    (size, iterations, then peak and average MB/s and Mpps as
//!    byte-swapped doubles), which the server prints; then a closing handshake
//!    and "done".
//!
//! Data checks, where perftest's traffic allows one: READs of the server's
//! buffer must all return the same bytes; fetch-and-add returns consecutive
//! values and compare-and-swap succeeds at each predicted value; every
//! ib_write_lat message is the peer's zeroed buffer with the iteration number
//! in its last byte; as a server, the words fetch-and-added grow by exactly
//! the client's iterations and every send arrives whole.
//!
//! ```text
//! ib_write_bw -d rxe0 -x 1 -s 65536 -n 1000            # server (guest)
//! rdmx perf --perftest 198.18.0.2 --op write --mode bw --sizes 64k --iters 1000
//! ```

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use rdmx_core::{Access, Domain, Error, MemoryRegion, RemoteRegion};
use rdmx_transport_rdma::verbs::{
    CqWaiter, Provider as _, QpOptions, QpPeer, QpTimers, QueuePair, SendOp, SendWr, WcOpcode,
    WcStatus, WorkCompletion,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::oob::{connect_or_accept, padded, verbs_peer_engine, HexFields};

/// The perftest protocol version this side speaks (perftest 4.5-0.17 sends
/// "6.06"); perftest only checks that it is at least 5.70.
const VERSION: &str = "6.06";
/// The oldest perftest whose exchange this side implements.
const MIN_VERSION: f64 = 5.70;
/// Length of the version message (`char version[16]`).
const VERSION_LEN: usize = 16;
/// Length of the address message with a GID (`KEY_MSG_SIZE_GID`).
const KEY_LEN: usize = 108;
/// perftest's default cycle buffer (a page) and cache line.
const CYCLE_BUFFER: u32 = 4096;
const CACHE_LINE: u32 = 64;
/// Outstanding READs/atomics this side accepts as a responder.
const OUT_READS: u16 = 16;
/// Receives a server keeps posted for ib_send_bw (perftest's `DEF_RX_SEND`).
const RX_DEPTH: u64 = 512;
/// The largest path MTU the engine sends; the smaller side decides.
const ENGINE_MTU: u32 = 4096;
/// How long any one step may take before the run fails.
const STEP_TIMEOUT: Duration = Duration::from_secs(120);

/// Which perftest program is on the other side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Test {
    /// `ib_write_bw`.
    WriteBw,
    /// `ib_read_bw`.
    ReadBw,
    /// `ib_send_bw`.
    SendBw,
    /// `ib_atomic_bw` (`-A CMP_AND_SWAP` when `cas`).
    AtomicBw { cas: bool },
    /// `ib_write_lat`.
    WriteLat,
}

impl Test {
    /// The test for `rdmx perf`'s `--op` and `--mode`.
    pub(crate) fn from_op(op: &str, mode: &str) -> Result<Test, Error> {
        Ok(match (op, mode) {
            ("write", "bw") => Test::WriteBw,
            ("read", "bw") => Test::ReadBw,
            ("send", "bw") => Test::SendBw,
            ("faa", "bw") => Test::AtomicBw { cas: false },
            ("cas", "bw") => Test::AtomicBw { cas: true },
            ("write", "lat") => Test::WriteLat,
            _ => {
                return Err(Error::InvalidArgument(format!(
                    "--perftest with --op {op} --mode {mode}: use one of --op write|read|send|faa|cas \
                     --mode bw (ib_write_bw, ib_read_bw, ib_send_bw, ib_atomic_bw [-A CMP_AND_SWAP]) \
                     or --op write --mode lat (ib_write_lat)"
                )))
            }
        })
    }

    /// The perftest program this test pairs with.
    pub(crate) fn program(self) -> &'static str {
        match self {
            Test::WriteBw => "ib_write_bw",
            Test::ReadBw => "ib_read_bw",
            Test::SendBw => "ib_send_bw",
            Test::AtomicBw { .. } => "ib_atomic_bw",
            Test::WriteLat => "ib_write_lat",
        }
    }

    /// Address handshakes before the QP is connected (write_lat.c does one
    /// more than the others).
    fn handshakes_before_connect(self) -> usize {
        if self == Test::WriteLat {
            2
        } else {
            1
        }
    }

    /// Address handshakes after it; send_bw.c adds one after the server
    /// posted its receives (the last one here).
    fn handshakes_after_connect(self) -> usize {
        if self == Test::SendBw {
            3
        } else {
            2
        }
    }

    /// Whether the client's report goes to the server after the run.
    fn exchanges_reports(self) -> bool {
        matches!(self, Test::WriteBw | Test::ReadBw | Test::AtomicBw { .. })
    }

    /// Whether the program ends with `ctx_close_connection`.
    fn closes(self) -> bool {
        self != Test::WriteLat
    }

    fn access(self) -> Access {
        match self {
            Test::WriteBw | Test::WriteLat => Access::REMOTE_WRITE,
            Test::ReadBw => Access::REMOTE_READ,
            Test::AtomicBw { .. } => Access::REMOTE_ATOMIC,
            Test::SendBw => Access::LOCAL,
        }
    }
}

/// What `rdmx perf` passes down.
pub(crate) struct PerftestRun {
    /// The perftest server to reach; `None`: wait for a perftest client.
    pub(crate) host: Option<String>,
    /// TCP port of the exchange (perftest `-p`).
    pub(crate) port: u16,
    /// The test both sides run.
    pub(crate) test: Test,
    /// Message size (perftest `-s`; atomics always 8).
    pub(crate) size: u64,
    /// Iterations (perftest `-n`).
    pub(crate) iters: u64,
    /// Operations in flight (perftest `-t`).
    pub(crate) window: u32,
}

/// One side's QP address in perftest's exchange (`struct pingpong_dest`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KeyMsg {
    lid: u16,
    out_reads: u16,
    qpn: u32,
    psn: u32,
    rkey: u32,
    vaddr: u64,
    gid: [u8; 16],
    srqn: u32,
}

impl KeyMsg {
    /// `KEY_PRINT_FMT_GID`, NUL-terminated, 108 bytes.
    fn encode(&self) -> [u8; KEY_LEN] {
        let mut s = format!(
            "{:04x}:{:04x}:{:06x}:{:06x}:{:08x}:{:016x}:",
            self.lid, self.out_reads, self.qpn, self.psn, self.rkey, self.vaddr
        );
        for b in self.gid {
            s.push_str(&format!("{b:02x}:"));
        }
        s.push_str(&format!("{:08x}:", self.srqn));
        padded(&s)
    }

    fn decode(m: &[u8]) -> Result<KeyMsg, Error> {
        let mut f = HexFields::new(m, "a perftest address message")?;
        let lid = f.hex(16)? as u16;
        let out_reads = f.hex(16)? as u16;
        let qpn = f.hex(24)? as u32;
        let psn = f.hex(24)? as u32;
        let rkey = f.hex(32)? as u32;
        let vaddr = f.hex(64)?;
        let mut gid = [0u8; 16];
        for b in gid.iter_mut() {
            *b = f.hex(8)? as u8;
        }
        let srqn = f.hex(32)? as u32;
        Ok(KeyMsg {
            lid,
            out_reads,
            qpn,
            psn,
            rkey,
            vaddr,
            gid,
            srqn,
        })
    }
}

/// A bandwidth report (`struct bw_report_data`, the fields perftest sends).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct BwReport {
    size: u64,
    iters: u64,
    bw_peak: f64,
    bw_avg: f64,
    msg_rate: f64,
}

impl BwReport {
    /// perftest's columns: `#bytes #iterations BW peak[MB/sec] BW
    /// average[MB/sec] MsgRate[Mpps]` (MB = 2^20 bytes).
    fn line(&self) -> String {
        format!(
            " {:<7}    {:<10}       {:<7.2}            {:<7.2}\t\t   {:<7.6}",
            self.size, self.iters, self.bw_peak, self.bw_avg, self.msg_rate
        )
    }
}

/// The TCP side channel, with perftest's write-first/read-first order.
struct Oob {
    stream: TcpStream,
    client: bool,
}

impl Oob {
    /// Swap one message of `mine.len()` bytes.
    async fn xchg(&mut self, mine: &[u8]) -> Result<Vec<u8>, Error> {
        let mut theirs = vec![0u8; mine.len()];
        let io = |e: std::io::Error| Error::Disconnected(format!("perftest exchange: {e}"));
        let step = async {
            if self.client {
                self.stream.write_all(mine).await.map_err(io)?;
                self.stream.read_exact(&mut theirs).await.map_err(io)?;
            } else {
                self.stream.read_exact(&mut theirs).await.map_err(io)?;
                self.stream.write_all(mine).await.map_err(io)?;
            }
            Ok::<(), Error>(())
        };
        tokio::time::timeout(STEP_TIMEOUT, step)
            .await
            .map_err(|_| Error::TimedOut(STEP_TIMEOUT))??;
        Ok(theirs)
    }

    async fn handshake(&mut self, mine: &KeyMsg) -> Result<KeyMsg, Error> {
        KeyMsg::decode(&self.xchg(&mine.encode()).await?)
    }

    /// `exchange_versions`: returns the peer's version number.
    async fn versions(&mut self) -> Result<f64, Error> {
        let mut mine = [0u8; VERSION_LEN];
        mine[..VERSION.len()].copy_from_slice(VERSION.as_bytes());
        let theirs = self.xchg(&mine).await?;
        let text = String::from_utf8_lossy(theirs.split(|&b| b == 0).next().unwrap_or(&[]));
        let v: f64 = text
            .trim()
            .parse()
            .ok()
            .filter(|v: &f64| v.is_finite())
            .ok_or_else(|| Error::Protocol(format!("perftest version {text:?} is not a number")))?;
        if v < MIN_VERSION {
            return Err(Error::Protocol(format!(
                "perftest version {v} is older than {MIN_VERSION}, whose exchange rdmx speaks"
            )));
        }
        Ok(v)
    }

    /// `check_sys_data`: the larger cycle buffer and cache line win.
    async fn sys_data(&mut self) -> Result<(u32, u32), Error> {
        let mut out = [0u32; 2];
        for (o, mine) in out.iter_mut().zip([CYCLE_BUFFER, CACHE_LINE]) {
            let theirs = self.xchg(&mine.to_be_bytes()).await?;
            let v = u32::from_be_bytes(theirs.try_into().expect("4 bytes"));
            *o = v.max(mine);
        }
        if out[0] > 1 << 30 || out[1] > 1 << 16 {
            return Err(Error::Protocol(format!(
                "perftest peer asks for a {}-byte cycle buffer and {}-byte cache lines",
                out[0], out[1]
            )));
        }
        Ok((out[0], out[1]))
    }

    /// `check_mtu`: the smaller of both sides' path MTUs.
    async fn mtu(&mut self, mine: u32) -> Result<u32, Error> {
        let code = |mtu: u32| (mtu / 256).trailing_zeros() + 1;
        let theirs = self.xchg(format!("{}\0", code(mine)).as_bytes()).await?;
        let text = String::from_utf8_lossy(theirs.split(|&b| b == 0).next().unwrap_or(&[]));
        let n: u32 = text
            .parse()
            .ok()
            .filter(|n| (1..=5).contains(n))
            .ok_or_else(|| Error::Protocol(format!("perftest MTU {text:?} is not 1 to 5")))?;
        Ok(mine.min(256 << (n - 1)))
    }

    /// `xchg_bw_reports`: five 8-byte fields, network order.
    async fn reports(&mut self, mine: &BwReport, peer_version: f64) -> Result<BwReport, Error> {
        let size = u64::from_be_bytes(self.word(&mine.size.to_be_bytes()).await?);
        let iters = if peer_version >= 5.33 {
            u64::from_be_bytes(self.word(&mine.iters.to_be_bytes()).await?)
        } else {
            let b = self.xchg(&(mine.iters as u32).to_be_bytes()).await?;
            u64::from(u32::from_be_bytes(b.try_into().expect("4 bytes")))
        };
        let mut f = [0f64; 3];
        for (o, v) in f.iter_mut().zip([mine.bw_peak, mine.bw_avg, mine.msg_rate]) {
            *o = f64::from_bits(u64::from_be_bytes(
                self.word(&v.to_bits().to_be_bytes()).await?,
            ));
        }
        Ok(BwReport {
            size,
            iters,
            bw_peak: f[0],
            bw_avg: f[1],
            msg_rate: f[2],
        })
    }

    async fn word(&mut self, mine: &[u8; 8]) -> Result<[u8; 8], Error> {
        Ok(self.xchg(mine).await?.try_into().expect("8 bytes"))
    }

    /// `ctx_close_connection`: a last handshake, then both sides send "done".
    async fn close(mut self, mine: &KeyMsg) -> Result<(), Error> {
        self.handshake(mine).await?;
        let _ = self.stream.write_all(b"done\0").await;
        let mut done = [0u8; 5];
        let _ =
            tokio::time::timeout(Duration::from_secs(2), self.stream.read_exact(&mut done)).await;
        Ok(())
    }
}

/// The QP and everything it needs.
struct Side {
    qp: Arc<dyn QueuePair>,
    waiter: CqWaiter,
    region: MemoryRegion,
    remote: RemoteRegion,
}

impl Side {
    /// Wait for completions; any failure ends the run.
    async fn next(&mut self, wcs: &mut Vec<WorkCompletion>) -> Result<(), Error> {
        wcs.clear();
        tokio::time::timeout(STEP_TIMEOUT, self.waiter.next(wcs, 64))
            .await
            .map_err(|_| Error::TimedOut(STEP_TIMEOUT))??;
        if let Some(wc) = wcs.iter().find(|wc| wc.status != WcStatus::Success) {
            return Err(Error::Protocol(format!(
                "completion {:?} of {:?}: {}",
                wc.status,
                wc.opcode,
                wc.status.hint()
            )));
        }
        Ok(())
    }

    /// The byte at `offset` of the local buffer.
    fn byte(&self, offset: usize) -> u8 {
        self.region.read()[offset]
    }
}

/// Run one perftest test against the peer.
pub(crate) async fn run(r: PerftestRun) -> Result<(), Error> {
    let size = match r.test {
        Test::AtomicBw { .. } => 8,
        _ => r.size,
    };
    if r.iters == 0 || (size == 0 && r.test != Test::SendBw) {
        return Err(Error::InvalidArgument(
            "--perftest needs --iters of at least 1 and a size of at least 1 byte".into(),
        ));
    }
    if size > 1 << 30 {
        return Err(Error::InvalidArgument(
            "--perftest sizes stop at 1 GiB".into(),
        ));
    }
    let dev = verbs_peer_engine()?;
    let client = r.host.is_some();
    let who = format!("perf (for {})", r.test.program());
    let stream = connect_or_accept(r.host.as_deref(), IpAddr::from([0u8; 4]), r.port, &who).await?;
    let _ = stream.set_nodelay(true);
    let local = stream
        .local_addr()
        .map_err(|e| Error::Connect(e.to_string()))?
        .ip()
        .to_canonical();
    let mut oob = Oob { stream, client };
    let peer_version = oob.versions().await?;
    let (cycle, _cache_line) = oob.sys_data().await?;
    let mtu = oob.mtu(ENGINE_MTU).await?;

    // perftest's BUFF_SIZE: remote addresses cycle inside max(size, cycle buffer).
    let buf_len = size.max(u64::from(cycle)) as usize;
    let domain = Domain::new();
    let pd = dev.alloc_pd(&domain)?;
    let region = domain.register(buf_len, r.test.access());
    let rkey = pd.register(&region)?;
    let cq = dev.create_cq(RX_DEPTH as usize + r.window as usize + 64)?;
    let qp = pd.create_qp(
        &cq,
        QpOptions {
            max_send_wr: r.window.max(16),
            ..QpOptions::default()
        },
    )?;
    let gid = match local {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let mine = KeyMsg {
        lid: 0,
        out_reads: OUT_READS,
        qpn: qp.qpn(),
        psn: rand::random::<u32>() & 0xFF_FFFF,
        rkey,
        vaddr: region.remote().addr,
        gid: gid.octets(),
        srqn: 0,
    };
    let mut peer = mine;
    for _ in 0..r.test.handshakes_before_connect() {
        peer = oob.handshake(&mine).await?;
    }
    // perftest's RC attributes: timeout 14, retry 7, RNR retry 7.
    let ip = Ipv6Addr::from(peer.gid).to_canonical();
    qp.connect(
        QpPeer {
            local,
            qpn: peer.qpn,
            psn: peer.psn,
            addr: SocketAddr::new(ip, rdmx_transport_rdma::soft::ROCEV2_PORT),
            mtu,
            selective_repeat: false,
            timers: QpTimers {
                timeout: 14,
                retry_cnt: 7,
                rnr_retry: 7,
            },
            // perftest keeps its peer's out_reads outstanding and serves its
            // own: the smaller serves both directions.
            max_rd_atomic: u32::from(OUT_READS.min(peer.out_reads).max(1)),
        },
        mine.psn,
    )?;
    print_addresses(r.test, &mine, &peer, mtu);
    let remote = RemoteRegion {
        addr: peer.vaddr,
        len: buf_len as u64,
        rkey: peer.rkey,
    };
    let mut side = Side {
        waiter: CqWaiter::new(cq.clone())?,
        qp,
        region,
        remote,
    };
    // Before the last handshake: after it, a perftest client starts at once.
    let atomic_before = word_sum(&side);
    let n_after = r.test.handshakes_after_connect();
    for i in 0..n_after {
        if i + 1 == n_after && !client && r.test == Test::SendBw {
            // send_bw.c: the server posts its receives before the last one.
            for k in 0..RX_DEPTH.min(r.iters) {
                side.qp.post_recv(k, size as usize)?;
            }
        }
        oob.handshake(&mine).await?;
    }

    if r.test == Test::WriteLat {
        let rtts = write_lat(&mut side, client, size, r.iters).await?;
        print_lat(size, r.iters, &rtts);
        return Ok(());
    }
    let report = if client {
        let rep = client_bw(&mut side, r.test, size, r.iters, r.window).await?;
        println!("{}", RESULT_FMT);
        println!("{}", rep.line());
        rep
    } else if r.test == Test::SendBw {
        let rep = server_send(&mut side, size, r.iters).await?;
        println!("{}", RESULT_FMT);
        println!("{}", rep.line());
        rep
    } else {
        // Passive: perftest's client works on our memory and tells us when done.
        BwReport::default()
    };
    if r.test.exchanges_reports() {
        oob.handshake(&mine).await?;
        let theirs = oob.reports(&report, peer_version).await?;
        if !client {
            println!("{}", RESULT_FMT);
            println!("{}", theirs.line());
            if r.test == (Test::AtomicBw { cas: false }) {
                let added = word_sum(&side).wrapping_sub(atomic_before);
                if added != theirs.iters {
                    return Err(Error::Protocol(format!(
                        "{} fetch-and-adds of 1 were reported but the words grew by {added}",
                        theirs.iters
                    )));
                }
                println!(" checked: the words fetch-and-added grew by exactly {added}");
            }
        }
    }
    if r.test.closes() {
        oob.close(&mine).await?;
    }
    Ok(())
}

/// perftest's bandwidth column header.
const RESULT_FMT: &str =
    " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]";

fn print_addresses(test: Test, mine: &KeyMsg, peer: &KeyMsg, mtu: u32) {
    println!(
        " {} peer, RC, MTU {mtu}, rdmx soft RoCEv2 engine",
        test.program()
    );
    for (side, k) in [("local", mine), ("remote", peer)] {
        println!(
            " {side} address: LID {:#06x} QPN {:#08x} PSN {:#08x} RKey {:#010x} VAddr {:#018x} OUT {} GID {}",
            k.lid,
            k.qpn,
            k.psn,
            k.rkey,
            k.vaddr,
            k.out_reads,
            Ipv6Addr::from(k.gid)
        );
    }
}

/// The wrapping sum of the local buffer's 8-byte words (the atomics' target).
fn word_sum(side: &Side) -> u64 {
    let b = side.region.read();
    b.chunks_exact(8)
        .map(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")))
        .fold(0u64, u64::wrapping_add)
}

/// Bandwidth from `iters` operations of `size` bytes whose completions
/// arrived at `done` (peak: the fastest `window` consecutive completions).
fn bw_report(size: u64, iters: u64, t0: Instant, done: &[Instant], window: usize) -> BwReport {
    const MB: f64 = 1048576.0;
    let secs = done
        .last()
        .map_or(0.0, |t| t.duration_since(t0).as_secs_f64())
        .max(1e-9);
    let w = window.clamp(1, done.len().max(1));
    let mut best = secs;
    let mut best_ops = done.len();
    if done.len() > w {
        for i in w..done.len() {
            let d = done[i].duration_since(done[i - w]).as_secs_f64();
            if d > 0.0 && d / w as f64 * done.len() as f64 <= best {
                best = d;
                best_ops = w;
            }
        }
    }
    BwReport {
        size,
        iters,
        bw_peak: size as f64 * best_ops as f64 / best / MB,
        bw_avg: size as f64 * iters as f64 / secs / MB,
        msg_rate: iters as f64 / secs / 1e6,
    }
}

/// The client's side of ib_write_bw, ib_read_bw, ib_send_bw and ib_atomic_bw.
async fn client_bw(
    side: &mut Side,
    test: Test,
    size: u64,
    iters: u64,
    window: u32,
) -> Result<BwReport, Error> {
    let payload = Bytes::from(
        (0..size)
            .map(|i| (i as u8).wrapping_mul(31))
            .collect::<Vec<u8>>(),
    );
    let target = side.remote.slice(0, size)?;
    let word = side.remote.slice(0, 8.min(side.remote.len))?;
    // compare-and-swap: learn the word first, then predict every value.
    let mut cas_base = 0u64;
    let mut wcs = Vec::new();
    if test == (Test::AtomicBw { cas: true }) {
        side.qp.post_send(SendWr {
            wr_id: 0,
            op: SendOp::CompareSwap {
                dst: word,
                compare: 0,
                swap: 0,
            },
        })?;
        side.next(&mut wcs).await?;
        cas_base = wcs[0].atomic_orig.unwrap_or(0);
    }
    let first = u64::from(test == (Test::AtomicBw { cas: true }));
    let op = |k: u64| match test {
        Test::WriteBw => SendOp::Write {
            sg: vec![payload.clone()],
            dst: target,
            imm: None,
        },
        Test::ReadBw => SendOp::Read { src: target },
        Test::SendBw => SendOp::Send {
            sg: vec![payload.clone()],
            imm: None,
        },
        Test::AtomicBw { cas: false } => SendOp::FetchAdd { dst: word, add: 1 },
        Test::AtomicBw { cas: true } => {
            let v = cas_base.wrapping_add(k - 1);
            SendOp::CompareSwap {
                dst: word,
                compare: v,
                swap: v.wrapping_add(1),
            }
        }
        Test::WriteLat => unreachable!("write_lat is not a bandwidth test"),
    };
    let t0 = Instant::now();
    let mut done_at = Vec::with_capacity(iters as usize);
    let (mut posted, mut done) = (first, first);
    let mut read_ref: Option<Bytes> = None;
    let mut faa_base: Option<u64> = None;
    while done < iters {
        while posted < iters && posted - done < u64::from(window) {
            side.qp.post_send(SendWr {
                wr_id: posted,
                op: op(posted),
            })?;
            posted += 1;
        }
        side.next(&mut wcs).await?;
        for wc in wcs.drain(..) {
            let k = wc.wr_id;
            match (test, wc.opcode) {
                (Test::ReadBw, WcOpcode::Read) => {
                    if wc.data.len() as u64 != size {
                        return Err(Error::Protocol(format!(
                            "READ {k} returned {} bytes for {size}",
                            wc.data.len()
                        )));
                    }
                    match &read_ref {
                        None => read_ref = Some(wc.data.clone()),
                        Some(r) if *r != wc.data => {
                            return Err(Error::Protocol(format!(
                            "READ {k} of the unchanged buffer returned other bytes than the first"
                        )))
                        }
                        Some(_) => {}
                    }
                }
                (Test::AtomicBw { cas }, WcOpcode::CompareSwap | WcOpcode::FetchAdd) => {
                    let got = wc.atomic_orig.unwrap_or(u64::MAX);
                    let want = if cas {
                        cas_base.wrapping_add(k - 1)
                    } else {
                        faa_base.get_or_insert(got.wrapping_sub(k)).wrapping_add(k)
                    };
                    if got != want {
                        return Err(Error::Protocol(format!(
                            "atomic {k} returned {got:#x}, expected {want:#x}"
                        )));
                    }
                }
                (Test::WriteBw, WcOpcode::Write) | (Test::SendBw, WcOpcode::Send) => {}
                (_, other) => {
                    return Err(Error::Protocol(format!("unexpected completion {other:?}")))
                }
            }
            done += 1;
            done_at.push(Instant::now());
        }
    }
    let checked = match test {
        Test::ReadBw => "every READ returned the same bytes",
        Test::AtomicBw { cas: false } => "fetch-and-add returned consecutive values",
        Test::AtomicBw { cas: true } => "every compare-and-swap succeeded at its predicted value",
        _ => "every completion succeeded",
    };
    println!(" checked: {checked} ({iters} operations)");
    Ok(bw_report(size, iters, t0, &done_at, window as usize))
}

/// The server's side of ib_send_bw: receive `iters` messages of `size` bytes.
async fn server_send(side: &mut Side, size: u64, iters: u64) -> Result<BwReport, Error> {
    let mut wcs = Vec::new();
    let mut posted = RX_DEPTH.min(iters);
    let mut got = 0u64;
    let mut t0 = None;
    let mut done_at = Vec::with_capacity(iters as usize);
    while got < iters {
        side.next(&mut wcs).await?;
        for wc in wcs.drain(..) {
            if wc.opcode != WcOpcode::Recv || wc.byte_len != size {
                return Err(Error::Protocol(format!(
                    "message {got}: {:?} of {} bytes, expected a {size}-byte send",
                    wc.opcode, wc.byte_len
                )));
            }
            let now = Instant::now();
            t0.get_or_insert(now);
            done_at.push(now);
            got += 1;
            if posted < iters {
                side.qp.post_recv(posted, size as usize)?;
                posted += 1;
            }
        }
    }
    println!(" checked: {iters} sends of {size} bytes arrived whole");
    Ok(bw_report(
        size,
        iters,
        t0.unwrap_or_else(Instant::now),
        &done_at,
        RX_DEPTH as usize,
    ))
}

/// ib_write_lat's ping-pong: each side WRITEs `size` bytes into the other's
/// buffer, the iteration number in the last byte; the server goes first.
/// Returns the round trips the client (or server) saw.
async fn write_lat(
    side: &mut Side,
    client: bool,
    size: u64,
    iters: u64,
) -> Result<Vec<Duration>, Error> {
    let last = size as usize - 1;
    let dst = side.remote.slice(0, size)?;
    let mut wcs = Vec::new();
    let mut rtts = Vec::with_capacity(iters as usize);
    let message = |k: u64| {
        let mut m = vec![0u8; size as usize];
        m[last] = k as u8;
        Bytes::from(m)
    };
    let mut sent_at = None;
    let (mut sent, mut got) = (0u64, 0u64);
    while got < iters || sent < iters {
        // The server sends its first message without waiting.
        if got < iters && (client || sent > 0) {
            let want = (got + 1) as u8;
            let deadline = Instant::now() + STEP_TIMEOUT;
            let mut spins = 0u32;
            while side.byte(last) != want {
                if Instant::now() > deadline {
                    return Err(Error::TimedOut(STEP_TIMEOUT));
                }
                spins += 1;
                if spins < 1000 {
                    tokio::task::yield_now().await;
                } else {
                    tokio::time::sleep(Duration::from_micros(20)).await;
                }
            }
            got += 1;
            if let Some(t) = sent_at.take() {
                rtts.push(Instant::now().duration_since(t));
            }
            // The peer's buffer is zeroed but for the counter byte.
            let region = side.region.read();
            if let Some(i) = region[..last].iter().position(|&b| b != 0) {
                return Err(Error::Protocol(format!(
                    "write_lat message {got}: byte {i} is {:#x}, perftest's buffer is zero there",
                    region[i]
                )));
            }
        }
        if sent < iters {
            sent += 1;
            sent_at = Some(Instant::now());
            side.qp.post_send(SendWr {
                wr_id: sent,
                op: SendOp::Write {
                    sg: vec![message(sent)],
                    dst,
                    imm: None,
                },
            })?;
            side.next(&mut wcs).await?;
        }
    }
    println!(" checked: {iters} messages each way, each the peer's zeroed buffer and its counter");
    Ok(rtts)
}

/// perftest's latency line for a run of `iters`: half round trips, in
/// microseconds, over the round trips measured (the last message has none).
fn print_lat(size: u64, iters: u64, rtts: &[Duration]) {
    let mut us: Vec<f64> = rtts.iter().map(|d| d.as_secs_f64() * 1e6 / 2.0).collect();
    us.sort_by(f64::total_cmp);
    if us.is_empty() {
        return;
    }
    let pct = |p: f64| us[((us.len() as f64 * p) as usize).min(us.len() - 1)];
    let avg = us.iter().sum::<f64>() / us.len() as f64;
    let var = us.iter().map(|x| (x - avg).powi(2)).sum::<f64>() / us.len() as f64;
    println!(
        " #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]   99% percentile[usec]   99.9% percentile[usec]"
    );
    println!(
        " {:<7} {:<10} {:<14.2} {:<14.2} {:<16.2} {:<14.2} {:<16.2} {:<22.2} {:.2}",
        size,
        iters,
        us[0],
        us[us.len() - 1],
        pct(0.5),
        avg,
        var.sqrt(),
        pct(0.99),
        pct(0.999)
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::TcpListener;

    #[test]
    fn address_message_is_perftests() {
        // As perftest 4.5 sent it (captured from ib_write_bw on rxe).
        let mut wire = b"0000:0001:000011:7541ab:000002e8:00005646fb53a000:\
00:00:00:00:00:00:00:00:00:00:ff:ff:c6:12:00:03:00000000:"
            .to_vec();
        wire.resize(KEY_LEN, 0);
        let k = KeyMsg::decode(&wire).unwrap();
        assert_eq!(
            k,
            KeyMsg {
                lid: 0,
                out_reads: 1,
                qpn: 0x11,
                psn: 0x7541ab,
                rkey: 0x2e8,
                vaddr: 0x5646_fb53_a000,
                gid: "::ffff:198.18.0.3".parse::<Ipv6Addr>().unwrap().octets(),
                srqn: 0,
            }
        );
        assert_eq!(k.encode().to_vec(), wire);
        assert!(KeyMsg::decode(b"0000:0001:1000000:").is_err());
        assert!(KeyMsg::decode(&[0xff; KEY_LEN]).is_err());
        assert!(KeyMsg::decode(b"").is_err());
    }

    #[test]
    fn tests_follow_the_programs_handshakes() {
        assert_eq!(Test::from_op("write", "lat").unwrap(), Test::WriteLat);
        assert_eq!(
            Test::from_op("cas", "bw").unwrap(),
            Test::AtomicBw { cas: true }
        );
        assert!(Test::from_op("read", "lat").is_err());
        assert!(Test::from_op("write", "both").is_err());
        // write_lat.c: 2 + 2, no report, no close; send_bw.c: 1 + 3, close.
        assert_eq!(
            (
                Test::WriteLat.handshakes_before_connect(),
                Test::WriteLat.handshakes_after_connect(),
                Test::WriteLat.closes()
            ),
            (2, 2, false)
        );
        assert_eq!(Test::SendBw.handshakes_after_connect(), 3);
        assert!(!Test::SendBw.exchanges_reports());
        assert!(Test::ReadBw.exchanges_reports());
    }

    #[test]
    fn bandwidth_is_bytes_over_time() {
        let t0 = Instant::now();
        let done: Vec<Instant> = (1..=4)
            .map(|i| t0 + Duration::from_millis(250 * i))
            .collect();
        let r = bw_report(1 << 20, 4, t0, &done, 1);
        assert!((r.bw_avg - 4.0).abs() < 1e-9, "{r:?}");
        assert!((r.msg_rate - 4e-6).abs() < 1e-12, "{r:?}");
        assert!(r.bw_peak >= r.bw_avg, "{r:?}");
    }

    /// Both ends of the exchange, over a real socket: the ordering rules
    /// must let a client and a server of ours meet without deadlock.
    #[tokio::test]
    async fn exchange_meets_itself() {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let stream = l.accept().await.unwrap().0;
            let mut o = Oob {
                stream,
                client: false,
            };
            let v = o.versions().await.unwrap();
            let sys = o.sys_data().await.unwrap();
            let mtu = o.mtu(1024).await.unwrap();
            let rep = o.reports(&BwReport::default(), v).await.unwrap();
            (v, sys, mtu, rep)
        });
        let mut o = Oob {
            stream: TcpStream::connect(addr).await.unwrap(),
            client: true,
        };
        assert_eq!(o.versions().await.unwrap(), 6.06);
        assert_eq!(o.sys_data().await.unwrap(), (4096, 64));
        assert_eq!(o.mtu(4096).await.unwrap(), 1024);
        let mine = BwReport {
            size: 65536,
            iters: 1000,
            bw_peak: 1234.5,
            bw_avg: 1000.25,
            msg_rate: 0.016,
        };
        assert_eq!(o.reports(&mine, 6.06).await.unwrap(), BwReport::default());
        let (v, sys, mtu, rep) = server.await.unwrap();
        assert_eq!((v, sys, mtu), (6.06, (4096, 64), 1024));
        assert_eq!(rep, mine);
    }

    /// A version that is not a finite number ("nan" parses as an f64) is
    /// refused with the text the peer sent.
    #[tokio::test]
    async fn a_version_that_is_not_a_number_is_refused() {
        for bad in ["nan", "inf", "six"] {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = l.local_addr().unwrap();
            let peer = tokio::spawn(async move {
                let mut s = l.accept().await.unwrap().0;
                s.write_all(&padded::<VERSION_LEN>(bad)).await.unwrap();
                let mut theirs = [0u8; VERSION_LEN];
                s.read_exact(&mut theirs).await.unwrap();
            });
            let mut o = Oob {
                stream: TcpStream::connect(addr).await.unwrap(),
                client: true,
            };
            let e = o.versions().await.unwrap_err().to_string();
            assert!(e.contains(&format!("{bad:?} is not a number")), "{e}");
            peer.await.unwrap();
        }
    }
}
