//! The NVMe/TCP target over real sockets, driven by a small host written
//! here from the specification (the Linux kernel's own host runs against it
//! in `testbed/tests.sh nvme-tcp`): the Linux connect sequence, data round
//! trips through in-capsule writes, R2T/H2CData and C2HData with and without
//! digests, NVMe statuses for bad commands, and termination of connections
//! that break the protocol while the listener keeps serving.

use std::sync::Arc;

use bytes::{BufMut, BytesMut};
use rdmx_block::backend::RamBackend;
use rdmx_block::nvme::command::{admin, fabrics, io, sgl, Sgl, Sqe};
use rdmx_block::nvme::identify::DISCOVERY_NQN;
use rdmx_block::nvme::status::Status;
use rdmx_block::target::{Target, TargetConfig};
use rdmx_block::tcp::pdu::{self, pdu_type, CommonHeader, Digests, IcReq};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const NQN: &str = "nqn.2026-11.io.rdmx:test";
const HOSTNQN: &str = "nqn.2014-08.org.nvmexpress:uuid:00000000-0000-0000-0000-000000000001";
const NS_BYTES: u64 = 8 << 20;

async fn start() -> (std::net::SocketAddr, Arc<Target>) {
    let t = Target::new(TargetConfig {
        nqn: NQN.into(),
        ..TargetConfig::default()
    });
    t.add_namespace(Arc::new(RamBackend::new(NS_BYTES).unwrap()))
        .unwrap();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    tokio::spawn(rdmx_block::tcp::serve(l, t.clone(), true));
    (a, t)
}

/// One queue of a host.
struct Host {
    s: TcpStream,
    d: Digests,
    cid: u16,
}

/// What a command returned.
#[derive(Debug)]
struct Done {
    status: Status,
    dw0: u32,
    sqhd: u16,
    data: Vec<u8>,
}

impl Host {
    async fn open(addr: std::net::SocketAddr, d: Digests) -> Host {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let req = IcReq {
            pfv: 0,
            hpda: 0,
            dgst: u8::from(d.header) | u8::from(d.data) << 1,
            maxr2t: 0,
        };
        s.write_all(&req.encode()).await.unwrap();
        let mut resp = [0u8; 128];
        s.read_exact(&mut resp).await.unwrap();
        assert_eq!(&resp[..8], &[1, 0, 128, 0, 128, 0, 0, 0], "ICResp header");
        assert_eq!(resp[10], 0, "CPDA");
        assert_eq!(resp[11], req.dgst, "digests granted as asked");
        let maxh2c = u32::from_le_bytes(resp[12..16].try_into().unwrap());
        assert!(maxh2c >= 4096 && maxh2c % 4 == 0);
        Host { s, d, cid: 0 }
    }

    /// Send a capsule; `data` goes in-capsule when given.
    async fn capsule(&mut self, mut sqe: Sqe, data: &[u8]) -> u16 {
        self.cid = self.cid.wrapping_add(1);
        sqe.cid = self.cid;
        sqe.flags = 0x40;
        let hd = self.d.hd();
        let mut b = BytesMut::new();
        let (pdo, plen) = if data.is_empty() {
            (0, 72 + hd)
        } else {
            (72 + hd, 72 + hd + data.len() + self.d.dd())
        };
        let mut f = if self.d.header { pdu::flags::HDGST } else { 0 };
        if !data.is_empty() && self.d.data {
            f |= pdu::flags::DDGST;
        }
        b.put_slice(
            &CommonHeader {
                ptype: pdu_type::CAPSULE_CMD,
                flags: f,
                hlen: 72,
                pdo: pdo as u8,
                plen: plen as u32,
            }
            .encode(),
        );
        b.put_slice(&sqe.encode());
        if self.d.header {
            let c = pdu::digest(&b[..72]);
            b.put_u32_le(c);
        }
        b.put_slice(data);
        if !data.is_empty() && self.d.data {
            b.put_u32_le(pdu::digest(data));
        }
        self.s.write_all(&b).await.unwrap();
        self.cid
    }

    /// Read one PDU: its header (digest checked) and data.
    async fn pdu(&mut self) -> (CommonHeader, Vec<u8>, Vec<u8>) {
        let mut ch = [0u8; 8];
        self.s.read_exact(&mut ch).await.unwrap();
        let c = CommonHeader::parse(&ch);
        let term = c.ptype == pdu_type::C2H_TERM_REQ;
        let hd = if self.d.header && !term { 4 } else { 0 };
        let mut head = vec![0u8; c.hlen as usize + hd];
        head[..8].copy_from_slice(&ch);
        self.s.read_exact(&mut head[8..]).await.unwrap();
        if hd == 4 {
            assert_eq!(c.flags & pdu::flags::HDGST, pdu::flags::HDGST);
            let hl = c.hlen as usize;
            let got = u32::from_le_bytes(head[hl..].try_into().unwrap());
            assert_eq!(got, pdu::digest(&head[..hl]), "header digest");
            head.truncate(hl);
        }
        let rest = c.plen as usize - c.hlen as usize - hd;
        let mut data = vec![0u8; rest];
        self.s.read_exact(&mut data).await.unwrap();
        if c.ptype == pdu_type::C2H_DATA && self.d.data {
            let dg = data.split_off(data.len() - 4);
            assert_eq!(
                u32::from_le_bytes(dg.try_into().unwrap()),
                pdu::digest(&data),
                "data digest"
            );
        }
        (c, head, data)
    }

    /// Run one command to its CapsuleResp, answering R2Ts with `out` and
    /// gathering C2HData.
    async fn run(&mut self, sqe: Sqe, in_capsule: &[u8], out: &[u8]) -> Done {
        let cid = self.capsule(sqe, in_capsule).await;
        let mut data = Vec::new();
        loop {
            let (c, head, body) = self.pdu().await;
            match c.ptype {
                pdu_type::C2H_DATA => {
                    assert_eq!(u16::from_le_bytes([head[8], head[9]]), cid);
                    let datao = u32::from_le_bytes(head[12..16].try_into().unwrap());
                    assert_eq!(datao as usize, data.len(), "C2HData in order");
                    data.extend_from_slice(&body);
                }
                pdu_type::R2T => {
                    assert_eq!(u16::from_le_bytes([head[8], head[9]]), cid);
                    let ttag = u16::from_le_bytes([head[10], head[11]]);
                    let off = u32::from_le_bytes(head[12..16].try_into().unwrap()) as usize;
                    let len = u32::from_le_bytes(head[16..20].try_into().unwrap()) as usize;
                    // Answer in 16 KiB H2CData PDUs, LAST on the final one.
                    let mut at = off;
                    while at < off + len {
                        let n = (off + len - at).min(16 << 10);
                        self.h2c_data(cid, ttag, at as u32, &out[at..at + n], at + n == off + len)
                            .await;
                        at += n;
                    }
                }
                pdu_type::CAPSULE_RESP => {
                    let cqe = &head[8..24];
                    assert_eq!(u16::from_le_bytes([cqe[12], cqe[13]]), cid);
                    return Done {
                        status: Status::from_cqe_word(u16::from_le_bytes([cqe[14], cqe[15]])),
                        dw0: u32::from_le_bytes(cqe[0..4].try_into().unwrap()),
                        sqhd: u16::from_le_bytes([cqe[8], cqe[9]]),
                        data,
                    };
                }
                other => panic!("unexpected PDU type {other}"),
            }
        }
    }

    async fn h2c_data(&mut self, cid: u16, ttag: u16, datao: u32, data: &[u8], last: bool) {
        let hd = self.d.hd();
        let mut f = if last { pdu::flags::LAST_PDU } else { 0 };
        if self.d.header {
            f |= pdu::flags::HDGST;
        }
        if self.d.data {
            f |= pdu::flags::DDGST;
        }
        let pdo = 24 + hd;
        let mut b = BytesMut::new();
        b.put_slice(
            &CommonHeader {
                ptype: pdu_type::H2C_DATA,
                flags: f,
                hlen: 24,
                pdo: pdo as u8,
                plen: (pdo + data.len() + self.d.dd()) as u32,
            }
            .encode(),
        );
        b.put_u16_le(cid);
        b.put_u16_le(ttag);
        b.put_u32_le(datao);
        b.put_u32_le(data.len() as u32);
        b.put_u32_le(0);
        if self.d.header {
            let c = pdu::digest(&b[..24]);
            b.put_u32_le(c);
        }
        b.put_slice(data);
        if self.d.data {
            b.put_u32_le(pdu::digest(data));
        }
        self.s.write_all(&b).await.unwrap();
    }

    /// Fabrics Connect (NVMe-oF 1.1 §3.3), KATO 5 s on the admin queue.
    async fn connect(&mut self, qid: u16, subnqn: &str, cntlid: u16) -> Done {
        self.connect_kato(qid, subnqn, cntlid, if qid == 0 { 5000 } else { 0 })
            .await
    }

    /// Fabrics Connect with this keep-alive timeout (ms).
    async fn connect_kato(&mut self, qid: u16, subnqn: &str, cntlid: u16, kato_ms: u32) -> Done {
        let mut data = vec![0u8; 1024];
        data[0] = 0x42; // host ID
        data[16..18].copy_from_slice(&cntlid.to_le_bytes());
        data[256..256 + subnqn.len()].copy_from_slice(subnqn.as_bytes());
        data[512..512 + HOSTNQN.len()].copy_from_slice(HOSTNQN.as_bytes());
        let sqe = Sqe {
            opcode: fabrics::OPCODE,
            nsid: u32::from(fabrics::CONNECT),
            sgl: Sgl {
                len: 1024,
                id: sgl::DATA_BLOCK_OFFSET,
                ..Sgl::default()
            },
            cdw: [
                u32::from(qid) << 16,
                if qid == 0 { 31 } else { 63 },
                kato_ms,
                0,
                0,
                0,
            ],
            ..Sqe::default()
        };
        self.run(sqe, &data, &[]).await
    }

    async fn prop(&mut self, set: Option<u32>, offset: u32, eight: bool) -> Done {
        let sqe = Sqe {
            opcode: fabrics::OPCODE,
            nsid: u32::from(if set.is_some() {
                fabrics::PROPERTY_SET
            } else {
                fabrics::PROPERTY_GET
            }),
            sgl: Sgl {
                id: sgl::TRANSPORT_DATA_BLOCK,
                ..Sgl::default()
            },
            cdw: [u32::from(eight), offset, set.unwrap_or(0), 0, 0, 0],
            ..Sqe::default()
        };
        self.run(sqe, &[], &[]).await
    }
}

fn cmd(opcode: u8, nsid: u32, len: u32, cdw: [u32; 6]) -> Sqe {
    Sqe {
        opcode,
        nsid,
        sgl: Sgl {
            len,
            id: sgl::TRANSPORT_DATA_BLOCK,
            ..Sgl::default()
        },
        cdw,
        ..Sqe::default()
    }
}

fn rw(opcode: u8, nsid: u32, slba: u64, blocks: u32) -> Sqe {
    cmd(
        opcode,
        nsid,
        blocks * 512,
        [slba as u32, (slba >> 32) as u32, blocks - 1, 0, 0, 0],
    )
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The admin sequence of the Linux 6.1 host (reference §6.1), then an I/O
/// queue; returns the admin and I/O queues.
async fn bring_up(addr: std::net::SocketAddr, d: Digests) -> (Host, Host) {
    let mut a = Host::open(addr, d).await;
    let c = a.connect(0, NQN, 0xFFFF).await;
    assert_eq!(c.status, Status::SUCCESS);
    assert_eq!(c.sqhd, 1, "SQHD after the first command");
    let cntlid = c.dw0 as u16;
    let cap = a.prop(None, 0, true).await;
    assert_eq!(cap.dw0 & 0xFFFF, 127, "MQES");
    assert_eq!(
        a.prop(Some(0x0046_0000), 0x14, false).await.status,
        Status::SUCCESS
    );
    assert_eq!(
        a.prop(Some(0x0046_0001), 0x14, false).await.status,
        Status::SUCCESS
    );
    assert_eq!(a.prop(None, 0x1C, false).await.dw0 & 1, 1, "CSTS.RDY");
    assert_eq!(a.prop(None, 0x08, false).await.dw0, 0x0001_0300);
    let id = a
        .run(cmd(admin::IDENTIFY, 0, 4096, [1, 0, 0, 0, 0, 0]), &[], &[])
        .await;
    assert_eq!(id.data.len(), 4096);
    assert_eq!(u16::from_le_bytes([id.data[78], id.data[79]]), cntlid);
    let nq = a
        .run(
            cmd(admin::SET_FEATURES, 0, 0, [7, 3 | 3 << 16, 0, 0, 0, 0]),
            &[],
            &[],
        )
        .await;
    assert_eq!(nq.dw0, 3 | 3 << 16, "four I/O queues granted");
    let ns = a
        .run(cmd(admin::IDENTIFY, 1, 4096, [0, 0, 0, 0, 0, 0]), &[], &[])
        .await;
    assert_eq!(
        u64::from_le_bytes(ns.data[0..8].try_into().unwrap()),
        NS_BYTES / 512
    );
    let mut q = Host::open(addr, d).await;
    assert_eq!(q.connect(1, NQN, cntlid).await.status, Status::SUCCESS);
    (a, q)
}

async fn round_trips(d: Digests) {
    let (addr, t) = start().await;
    let (_a, mut q) = bring_up(addr, d).await;
    // 4 KiB in-capsule, then 64 KiB and 1 MiB through R2T.
    let small = pattern(1, 4096);
    let w = rw(io::WRITE, 1, 8, 8);
    let w = Sqe {
        sgl: Sgl {
            len: 4096,
            id: sgl::DATA_BLOCK_OFFSET,
            ..Sgl::default()
        },
        ..w
    };
    assert_eq!(q.run(w, &small, &[]).await.status, Status::SUCCESS);
    let big = pattern(2, 64 << 10);
    assert_eq!(
        q.run(rw(io::WRITE, 1, 100, 128), &[], &big).await.status,
        Status::SUCCESS
    );
    let huge = pattern(3, 1 << 20);
    assert_eq!(
        q.run(rw(io::WRITE, 1, 4096, 2048), &[], &huge).await.status,
        Status::SUCCESS
    );
    assert_eq!(q.run(rw(io::READ, 1, 8, 8), &[], &[]).await.data, small);
    assert_eq!(q.run(rw(io::READ, 1, 100, 128), &[], &[]).await.data, big);
    assert_eq!(
        q.run(rw(io::READ, 1, 4096, 2048), &[], &[]).await.data,
        huge
    );
    assert_eq!(
        q.run(cmd(io::FLUSH, 1, 0, [0; 6]), &[], &[]).await.status,
        Status::SUCCESS
    );
    // Write Zeroes over the first half of the 64 KiB, deallocate the rest.
    let wz = cmd(io::WRITE_ZEROES, 1, 0, [100, 0, 63, 0, 0, 0]);
    assert_eq!(q.run(wz, &[], &[]).await.status, Status::SUCCESS);
    let mut range = vec![0u8; 16];
    range[4..8].copy_from_slice(&64u32.to_le_bytes());
    range[8..16].copy_from_slice(&164u64.to_le_bytes());
    let dsm = Sqe {
        sgl: Sgl {
            len: 16,
            id: sgl::DATA_BLOCK_OFFSET,
            ..Sgl::default()
        },
        ..cmd(io::DSM, 1, 16, [0, 4, 0, 0, 0, 0])
    };
    assert_eq!(q.run(dsm, &range, &[]).await.status, Status::SUCCESS);
    let back = q.run(rw(io::READ, 1, 100, 128), &[], &[]).await.data;
    assert!(back.iter().all(|&b| b == 0), "zeroed and deallocated");
    assert_eq!(q.run(rw(io::READ, 1, 8, 8), &[], &[]).await.data, small);
    // The target counted it.
    let s = &t.namespaces()[0].stats;
    assert_eq!(
        s.bytes(rdmx_block::metrics::IoOp::Write),
        4096 + (64 << 10) + (1 << 20)
    );
}

#[tokio::test]
async fn data_round_trips_without_digests() {
    round_trips(Digests::default()).await;
}

#[tokio::test]
async fn data_round_trips_with_header_and_data_digests() {
    round_trips(Digests {
        header: true,
        data: true,
    })
    .await;
}

#[tokio::test]
async fn bad_commands_get_nvme_statuses() {
    let (addr, t) = start().await;
    let (mut a, mut q) = bring_up(addr, Digests::default()).await;
    let blocks = NS_BYTES / 512;
    for (sqe, want) in [
        (rw(io::READ, 1, blocks - 1, 2), Status::LBA_OUT_OF_RANGE),
        (rw(io::READ, 1, u64::MAX, 1), Status::LBA_OUT_OF_RANGE),
        (rw(io::READ, 9, 0, 1), Status::INVALID_NAMESPACE),
        (cmd(0x55, 1, 0, [0; 6]), Status::INVALID_OPCODE),
        // Above MDTS (1 MiB): refused before any data is allocated.
        (rw(io::READ, 1, 0, 4096), Status::INVALID_FIELD),
        // The SGL says less than the blocks need.
        (
            cmd(io::READ, 1, 512, [0, 0, 7, 0, 0, 0]),
            Status::SGL_LENGTH_INVALID,
        ),
    ] {
        assert_eq!(q.run(sqe, &[], &[]).await.status, want, "{sqe:?}");
    }
    for (sqe, want) in [
        (
            cmd(admin::IDENTIFY, 0, 4096, [0x42, 0, 0, 0, 0, 0]),
            Status::INVALID_FIELD,
        ),
        (
            cmd(admin::IDENTIFY, 7, 4096, [0, 0, 0, 0, 0, 0]),
            Status::INVALID_NAMESPACE,
        ),
        (
            cmd(
                admin::GET_LOG_PAGE,
                0,
                4096,
                [0x42 | 1023 << 16, 0, 0, 0, 0, 0],
            ),
            Status::INVALID_LOG_PAGE,
        ),
        (cmd(0x80, 0, 0, [0; 6]), Status::INVALID_OPCODE),
    ] {
        assert_eq!(a.run(sqe, &[], &[]).await.status, want, "{sqe:?}");
    }
    assert_eq!(t.stats.errors("lba_out_of_range"), 2);
    // The queues still work.
    assert_eq!(
        q.run(rw(io::READ, 1, 0, 1), &[], &[]).await.data,
        vec![0u8; 512]
    );
}

#[tokio::test]
async fn connect_checks_the_subsystem_the_controller_and_the_order() {
    let (addr, _t) = start().await;
    let mut h = Host::open(addr, Digests::default()).await;
    // Nothing but Connect before Connect.
    let r = h
        .run(cmd(admin::IDENTIFY, 0, 4096, [1, 0, 0, 0, 0, 0]), &[], &[])
        .await;
    assert_eq!(r.status, Status::COMMAND_SEQUENCE_ERROR);
    // An unknown subsystem: Invalid Parameters, IATTR 1, IPO 256 (SUBNQN).
    let r = h.connect(0, "nqn.2026-11.io.rdmx:nope", 0xFFFF).await;
    assert_eq!(r.status, Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(r.dw0, 1 << 16 | 256);
    // An I/O queue for a controller that does not exist.
    let mut io_q = Host::open(addr, Digests::default()).await;
    let r = io_q.connect(1, NQN, 77).await;
    assert_eq!(r.status, Status::CONNECT_INVALID_PARAMETERS);
    assert_eq!(r.dw0, 1 << 16 | 16);
    // The discovery controller answers its log page.
    let mut disc = Host::open(addr, Digests::default()).await;
    assert_eq!(
        disc.connect(0, DISCOVERY_NQN, 0xFFFF).await.status,
        Status::SUCCESS
    );
    disc.prop(Some(1), 0x14, false).await;
    let log = disc
        .run(
            cmd(
                admin::GET_LOG_PAGE,
                0,
                2048,
                [0x70 | 511 << 16, 0, 0, 0, 0, 0],
            ),
            &[],
            &[],
        )
        .await;
    assert_eq!(log.status, Status::SUCCESS);
    assert_eq!(u64::from_le_bytes(log.data[8..16].try_into().unwrap()), 1);
    assert_eq!(
        &log.data[1024 + 256..1024 + 256 + NQN.len()],
        NQN.as_bytes()
    );
}

/// Send `bytes` on a fresh connection (after an ICReq unless `raw`) and
/// expect a C2HTermReq with `fes`, then the end of the connection.
async fn expect_termination(addr: std::net::SocketAddr, raw: bool, bytes: &[u8], fes: u16) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    if !raw {
        s.write_all(
            &IcReq {
                pfv: 0,
                hpda: 0,
                dgst: 0,
                maxr2t: 0,
            }
            .encode(),
        )
        .await
        .unwrap();
        let mut resp = [0u8; 128];
        s.read_exact(&mut resp).await.unwrap();
    }
    s.write_all(bytes).await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(5), s.read_to_end(&mut got))
        .await
        .expect("the target closes the connection")
        .unwrap();
    assert!(got.len() >= 24, "a C2HTermReq, got {got:?}");
    assert_eq!(got[0], pdu_type::C2H_TERM_REQ);
    assert_eq!(u16::from_le_bytes([got[8], got[9]]), fes, "{got:?}");
    assert_eq!(
        u32::from_le_bytes(got[4..8].try_into().unwrap()) as usize,
        got.len(),
        "PLEN covers the copied header"
    );
}

#[tokio::test]
async fn protocol_errors_end_that_connection_only() {
    let (addr, t) = start().await;
    let hdr = |ptype, hlen, pdo, plen: u32| {
        CommonHeader {
            ptype,
            flags: 0,
            hlen,
            pdo,
            plen,
        }
        .encode()
    };
    // A capsule header of the wrong length.
    expect_termination(
        addr,
        false,
        &hdr(pdu_type::CAPSULE_CMD, 70, 0, 70),
        pdu::fes::INVALID_HEADER_FIELD,
    )
    .await;
    // 4 GiB of in-capsule data claimed: refused, nothing allocated.
    expect_termination(
        addr,
        false,
        &hdr(pdu_type::CAPSULE_CMD, 72, 72, u32::MAX),
        pdu::fes::LIMIT_EXCEEDED,
    )
    .await;
    // A PDU type a host never sends.
    expect_termination(
        addr,
        false,
        &hdr(pdu_type::C2H_DATA, 24, 0, 24),
        pdu::fes::INVALID_HEADER_FIELD,
    )
    .await;
    // A second ICReq.
    expect_termination(
        addr,
        false,
        &hdr(pdu_type::IC_REQ, 128, 0, 128),
        pdu::fes::SEQUENCE_ERROR,
    )
    .await;
    // Something other than an ICReq first (128 bytes of garbage).
    expect_termination(addr, true, &[0x5a; 128], pdu::fes::SEQUENCE_ERROR).await;
    // H2CData for a transfer tag nobody asked for.
    let mut h2c = hdr(pdu_type::H2C_DATA, 24, 24, 24 + 512).to_vec();
    h2c.extend_from_slice(&[0u8; 16]);
    h2c.extend_from_slice(&[0u8; 512]);
    expect_termination(addr, false, &h2c, pdu::fes::INVALID_HEADER_FIELD).await;
    assert_eq!(
        t.stats
            .protocol_errors
            .load(std::sync::atomic::Ordering::Relaxed),
        6
    );
    // The listener still serves: a whole bring-up and a read.
    let (_a, mut q) = bring_up(addr, Digests::default()).await;
    assert_eq!(
        q.run(rw(io::READ, 1, 0, 8), &[], &[]).await.data.len(),
        4096
    );
}

/// Traffic Based Keep Alive (NVMe Base 2.0 §3.9): Identify Controller
/// advertises TBKAS, I/O commands alone keep a controller alive well past
/// its KATO, and silence past KATO still ends it.
#[tokio::test]
async fn io_traffic_keeps_the_controller_alive_and_silence_ends_it() {
    use std::sync::atomic::Ordering::Relaxed;
    use std::time::{Duration, Instant};
    let (addr, t) = start().await;
    let d = Digests::default();
    let mut a = Host::open(addr, d).await;
    let c = a.connect_kato(0, NQN, 0xFFFF, 1000).await;
    assert_eq!(c.status, Status::SUCCESS);
    let cntlid = c.dw0 as u16;
    assert_eq!(
        a.prop(Some(0x0046_0001), 0x14, false).await.status,
        Status::SUCCESS
    );
    assert_eq!(a.prop(None, 0x1C, false).await.dw0 & 1, 1, "CSTS.RDY");
    let id = a
        .run(cmd(admin::IDENTIFY, 0, 4096, [1, 0, 0, 0, 0, 0]), &[], &[])
        .await;
    let ctratt = u32::from_le_bytes(id.data[96..100].try_into().unwrap());
    assert_eq!(ctratt & (1 << 6), 1 << 6, "CTRATT.TBKAS");
    let nq = a
        .run(cmd(admin::SET_FEATURES, 0, 0, [7, 0, 0, 0, 0, 0]), &[], &[])
        .await;
    assert_eq!(nq.status, Status::SUCCESS);
    let mut q = Host::open(addr, d).await;
    assert_eq!(q.connect(1, NQN, cntlid).await.status, Status::SUCCESS);
    // Three KATOs of reads and no Keep Alive.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        let r = q.run(rw(io::READ, 1, 0, 8), &[], &[]).await;
        assert_eq!(r.status, Status::SUCCESS);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(t.stats.keep_alive_expired.load(Relaxed), 0);
    // Silence: the timer (whole seconds, checked twice a second) expires.
    let silent = Instant::now();
    while t.stats.keep_alive_expired.load(Relaxed) == 0 {
        assert!(
            silent.elapsed() < Duration::from_secs(10),
            "keep-alive timer never expired"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        silent.elapsed() >= Duration::from_secs(1),
        "expired before a KATO of silence"
    );
}
