//! The NBD server at the byte level, driven by a client written here from
//! proto.md (unmodified clients run in `cli/tests/block.rs` and the
//! testbed): negotiation replies, structured and simple replies with data
//! checked, errors for bad requests that keep the stream in sync, and a
//! connection dropped (others unharmed) for what breaks the framing.

use std::sync::Arc;

use rdmx_block::backend::RamBackend;
use rdmx_block::fabric::{Initiator, InitiatorConfig};
use rdmx_block::nbd::proto::{self, cflag, cmd, errno, opt, rep, Request};
use rdmx_block::nbd::NbdConfig;
use rdmx_block::target::{Target, TargetConfig};
use rdmx_core::{Options, Transports};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const SIZE: u64 = 64 << 20;

async fn start() -> std::net::SocketAddr {
    let t = Target::new(TargetConfig::default());
    t.add_namespace(Arc::new(RamBackend::new(SIZE).unwrap()))
        .unwrap();
    let ts = Transports::new().with(rdmx_transport_tcp::TcpTransport::new());
    let l = ts
        .listen("tcp://127.0.0.1:0", &Options::default())
        .await
        .unwrap();
    let url = format!("tcp://{}", l.local_addr());
    tokio::spawn(rdmx_block::fabric::serve(l, t));
    let dev = Initiator::connect(&ts, &url, InitiatorConfig::default())
        .await
        .unwrap();
    let nl = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = nl.local_addr().unwrap();
    tokio::spawn(rdmx_block::nbd::serve(
        nl,
        Arc::new(dev),
        NbdConfig::default(),
    ));
    addr
}

struct Client {
    s: TcpStream,
}

impl Client {
    /// Connect and read the greeting; send the client flags.
    async fn open(addr: std::net::SocketAddr, flags: u32) -> Client {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let mut hello = [0u8; 18];
        s.read_exact(&mut hello).await.unwrap();
        assert_eq!(&hello[..8], b"NBDMAGIC");
        assert_eq!(&hello[8..16], b"IHAVEOPT");
        assert_eq!(u16::from_be_bytes([hello[16], hello[17]]), 3);
        s.write_all(&flags.to_be_bytes()).await.unwrap();
        Client { s }
    }

    async fn option(&mut self, option: u32, data: &[u8]) {
        let mut b = Vec::new();
        b.extend_from_slice(&proto::IHAVEOPT.to_be_bytes());
        b.extend_from_slice(&option.to_be_bytes());
        b.extend_from_slice(&(data.len() as u32).to_be_bytes());
        b.extend_from_slice(data);
        self.s.write_all(&b).await.unwrap();
    }

    /// One option reply: (type, data).
    async fn reply(&mut self, option: u32) -> (u32, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).await.unwrap();
        assert_eq!(
            u64::from_be_bytes(h[..8].try_into().unwrap()),
            proto::REPLY_MAGIC
        );
        assert_eq!(u32::from_be_bytes(h[8..12].try_into().unwrap()), option);
        let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut d = vec![0u8; len];
        self.s.read_exact(&mut d).await.unwrap();
        (kind, d)
    }

    /// Replies up to and including the ACK (or an error).
    async fn replies(&mut self, option: u32) -> Vec<(u32, Vec<u8>)> {
        let mut all = Vec::new();
        loop {
            let r = self.reply(option).await;
            let end = r.0 == rep::ACK || r.0 & 0x8000_0000 != 0;
            all.push(r);
            if end {
                return all;
            }
        }
    }

    async fn go(addr: std::net::SocketAddr, structured: bool) -> Client {
        let mut c = Client::open(addr, 3).await;
        if structured {
            c.option(opt::STRUCTURED_REPLY, &[]).await;
            assert_eq!(c.replies(opt::STRUCTURED_REPLY).await[0].0, rep::ACK);
            let mut m = vec![0, 0, 0, 0, 0, 0, 0, 1];
            m.extend_from_slice(&(proto::BASE_ALLOCATION.len() as u32).to_be_bytes());
            m.extend_from_slice(proto::BASE_ALLOCATION.as_bytes());
            c.option(opt::SET_META_CONTEXT, &m).await;
            let r = c.replies(opt::SET_META_CONTEXT).await;
            assert_eq!(r[0].0, rep::META_CONTEXT);
            assert_eq!(&r[0].1[4..], proto::BASE_ALLOCATION.as_bytes());
        }
        c.option(opt::GO, &[0, 0, 0, 0, 0, 1, 0, 3]).await;
        let r = c.replies(opt::GO).await;
        assert_eq!(r.last().unwrap().0, rep::ACK);
        c
    }

    async fn request(
        &mut self,
        kind: u16,
        flags: u16,
        cookie: u64,
        offset: u64,
        length: u32,
        data: &[u8],
    ) {
        let r = Request {
            flags,
            kind,
            cookie,
            offset,
            length,
        };
        self.s.write_all(&r.encode()).await.unwrap();
        self.s.write_all(data).await.unwrap();
    }

    /// A simple reply: (error, cookie).
    async fn simple(&mut self) -> (u32, u64) {
        let mut h = [0u8; 16];
        self.s.read_exact(&mut h).await.unwrap();
        assert_eq!(
            u32::from_be_bytes(h[..4].try_into().unwrap()),
            proto::SIMPLE_REPLY_MAGIC
        );
        (
            u32::from_be_bytes(h[4..8].try_into().unwrap()),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
        )
    }

    /// A structured chunk: (flags, type, cookie, payload).
    async fn chunk(&mut self) -> (u16, u16, u64, Vec<u8>) {
        let mut h = [0u8; 20];
        self.s.read_exact(&mut h).await.unwrap();
        assert_eq!(
            u32::from_be_bytes(h[..4].try_into().unwrap()),
            proto::STRUCTURED_REPLY_MAGIC
        );
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut d = vec![0u8; len];
        self.s.read_exact(&mut d).await.unwrap();
        (
            u16::from_be_bytes([h[4], h[5]]),
            u16::from_be_bytes([h[6], h[7]]),
            u64::from_be_bytes(h[8..16].try_into().unwrap()),
            d,
        )
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negotiation_answers_every_option() {
    let addr = start().await;
    let mut c = Client::open(addr, 3).await;
    c.option(opt::LIST, &[]).await;
    let r = c.replies(opt::LIST).await;
    assert_eq!(r[0].0, rep::SERVER);
    assert_eq!(&r[0].1[4..], b"rdmx");
    assert_eq!(r[1].0, rep::ACK);
    // INFO for the default ("") export: size and flags, block sizes, name.
    c.option(opt::INFO, &[0, 0, 0, 0, 0, 1, 0, 1]).await;
    let r = c.replies(opt::INFO).await;
    let export = &r[0].1;
    assert_eq!(u16::from_be_bytes([export[0], export[1]]), 0);
    assert_eq!(u64::from_be_bytes(export[2..10].try_into().unwrap()), SIZE);
    let bs = &r[1].1;
    assert_eq!(
        (
            u32::from_be_bytes(bs[2..6].try_into().unwrap()),
            u32::from_be_bytes(bs[10..14].try_into().unwrap())
        ),
        (512, 32 << 20)
    );
    assert_eq!(&r[2].1[2..], b"rdmx");
    // Errors that keep the negotiation going.
    c.option(opt::INFO, &[0, 0, 0, 4, b'n', b'o', b'p', b'e', 0, 0])
        .await;
    assert_eq!(c.replies(opt::INFO).await[0].0, rep::ERR_UNKNOWN);
    c.option(opt::INFO, &[0xff; 3]).await;
    assert_eq!(c.replies(opt::INFO).await[0].0, rep::ERR_INVALID);
    c.option(opt::SET_META_CONTEXT, &[0, 0, 0, 0, 0, 0, 0, 0])
        .await;
    assert_eq!(
        c.replies(opt::SET_META_CONTEXT).await[0].0,
        rep::ERR_INVALID
    );
    c.option(99, &[]).await;
    assert_eq!(c.replies(99).await[0].0, rep::ERR_UNSUP);
    c.option(opt::STARTTLS, &[]).await;
    assert_eq!(c.replies(opt::STARTTLS).await[0].0, rep::ERR_POLICY);
    c.option(opt::ABORT, &[]).await;
    assert_eq!(c.replies(opt::ABORT).await[0].0, rep::ACK);
    // Unknown client flags: the server hangs up.
    let mut bad = Client::open(addr, 0x80).await;
    let mut rest = Vec::new();
    bad.s.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transmission_moves_data_and_refuses_bad_requests() {
    let addr = start().await;
    let mut c = Client::go(addr, true).await;
    let data: Vec<u8> = (0..65536u32).map(|i| (i * 7 % 253) as u8).collect();
    c.request(cmd::WRITE, cflag::FUA, 1, 4096, 65536, &data)
        .await;
    assert_eq!(c.simple().await, (0, 1));
    c.request(cmd::READ, 0, 2, 4096, 65536, &[]).await;
    let (flags, kind, cookie, payload) = c.chunk().await;
    assert_eq!(
        (flags, kind, cookie),
        (1, 1, 2),
        "one OFFSET_DATA chunk, DONE"
    );
    assert_eq!(u64::from_be_bytes(payload[..8].try_into().unwrap()), 4096);
    assert!(payload[8..] == data[..]);
    // Write zeroes larger than the payload limit and than one NVMe Write
    // Zeroes (40 MiB): split, no payload.
    c.request(cmd::WRITE, 0, 3, 16 << 20, 512, &[9u8; 512])
        .await;
    assert_eq!(c.simple().await, (0, 3));
    c.request(
        cmd::WRITE_ZEROES,
        cflag::FAST_ZERO,
        4,
        16 << 20,
        40 << 20,
        &[],
    )
    .await;
    assert_eq!(c.simple().await, (0, 4));
    c.request(cmd::READ, 0, 5, 16 << 20, 512, &[]).await;
    assert!(c.chunk().await.3[8..].iter().all(|&b| b == 0));
    c.request(cmd::BLOCK_STATUS, 0, 5, 0, 1 << 20, &[]).await;
    let (_, kind, _, ext) = c.chunk().await;
    assert_eq!(kind, 5);
    assert_eq!(&ext, &[0, 0, 0, 1, 0, 0x10, 0, 0, 0, 0, 0, 0]);
    // Bad requests: errors, and the stream stays in sync after each.
    c.request(cmd::READ, 0, 6, SIZE - 512, 1024, &[]).await;
    let (_, kind, cookie, e) = c.chunk().await;
    assert_eq!((kind, cookie), (proto::chunk::ERROR, 6));
    assert_eq!(
        u32::from_be_bytes(e[..4].try_into().unwrap()),
        errno::EINVAL
    );
    c.request(cmd::WRITE, 0, 7, 100, 512, &[0u8; 512]).await;
    assert_eq!(c.simple().await, (errno::EINVAL, 7), "unaligned");
    c.request(cmd::WRITE, 0, 8, SIZE, 512, &[0u8; 512]).await;
    assert_eq!(c.simple().await, (errno::ENOSPC, 8), "past the end");
    c.request(cmd::FLUSH, cflag::DF, 9, 0, 0, &[]).await;
    assert_eq!(c.simple().await, (errno::EINVAL, 9), "flag not allowed");
    c.request(42, 0, 10, 0, 0, &[]).await;
    assert_eq!(c.simple().await, (errno::EINVAL, 10), "unknown command");
    let big = vec![1u8; (32 << 20) + 512];
    c.request(cmd::WRITE, 0, 11, 0, big.len() as u32, &big)
        .await;
    assert_eq!(
        c.simple().await,
        (errno::EOVERFLOW, 11),
        "above the payload limit"
    );
    c.request(cmd::FLUSH, 0, 12, 0, 0, &[]).await;
    assert_eq!(c.simple().await, (0, 12));
    c.request(cmd::DISC, 0, 13, 0, 0, &[]).await;
    let mut rest = Vec::new();
    c.s.read_to_end(&mut rest).await.unwrap();
    assert!(rest.is_empty(), "nothing after DISC");
    // Without structured replies, READ gets a simple reply and the data.
    let mut s = Client::go(addr, false).await;
    s.request(cmd::READ, 0, 20, 4096 + 65536 - 512, 512, &[])
        .await;
    assert_eq!(s.simple().await, (0, 20));
    let mut d = vec![0u8; 512];
    s.s.read_exact(&mut d).await.unwrap();
    assert!(d == data[65536 - 512..]);
    // A request without its magic ends that connection only.
    s.s.write_all(&[0u8; 28]).await.unwrap();
    let mut rest = Vec::new();
    let _ = s.s.read_to_end(&mut rest).await;
    let mut again = Client::go(addr, true).await;
    again.request(cmd::READ, 0, 30, 4096, 512, &[]).await;
    assert!(again.chunk().await.3[8..] == data[..512]);
}

/// Requests pipelined far past the server's 64 in flight, replies read only
/// afterwards: every reply comes once, by cookie, each read with the bytes
/// its block was written with (writes and reads of one block are ordered by
/// waiting for the write replies first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_requests_all_answered_by_cookie() {
    let addr = start().await;
    let mut c = Client::go(addr, false).await;
    let blocks = 200u64;
    let block = |i: u64| -> Vec<u8> { (0..4096u64).map(|j| (i * 31 + j * 7) as u8).collect() };
    for i in 0..blocks {
        c.request(cmd::WRITE, 0, i, i * 8192, 4096, &block(i)).await;
    }
    let mut seen = std::collections::HashSet::new();
    for _ in 0..blocks {
        let (err, cookie) = c.simple().await;
        assert_eq!(err, 0, "write {cookie}");
        assert!(
            cookie < blocks && seen.insert(cookie),
            "cookie {cookie} twice or unknown"
        );
    }
    for i in 0..blocks {
        c.request(cmd::READ, 0, 1000 + i, i * 8192, 4096, &[]).await;
    }
    let mut read = std::collections::HashSet::new();
    for _ in 0..blocks {
        let (err, cookie) = c.simple().await;
        assert_eq!(err, 0, "read {cookie}");
        let i = cookie - 1000;
        assert!(
            i < blocks && read.insert(i),
            "cookie {cookie} twice or unknown"
        );
        let mut d = vec![0u8; 4096];
        c.s.read_exact(&mut d).await.unwrap();
        assert!(d == block(i), "block {i}");
    }
}
