//! Every RoCEv2 packet in the real-NIC captures (`testdata/rocev2-captures`) parses, verifies its
//! ICRC, and re-serialises byte for byte; a corrupted one is caught.

use std::path::PathBuf;

use rdmx_roce_proto::pcap::{check, read_capture, Summary};
use rdmx_roce_proto::{Opcode, RoceFrame};

fn captures_dir() -> PathBuf {
    std::env::var_os("RDMX_CAPTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/rocev2-captures")
        })
}

fn load(name: &str) -> Vec<rdmx_roce_proto::pcap::Captured> {
    let path = captures_dir().join(name);
    let f = std::fs::File::open(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (the captures live in testdata/rocev2-captures; RDMX_CAPTURES overrides)",
            path.display()
        )
    });
    read_capture(f).unwrap()
}

fn summary(name: &str) -> Summary {
    let s = check(&load(name));
    assert!(s.bad.is_empty(), "{name}: {:?}", s.bad);
    s
}

#[test]
fn hns_rc_send_capture() {
    let s = summary("hns_roce_rc_send_oferby_proxy.pcap");
    assert_eq!(s.frames, 123);
    let n = |op| s.ok.get(&op).copied().unwrap_or(0);
    assert_eq!(n(Opcode::SEND_FIRST), 33);
    assert_eq!(n(Opcode::SEND_LAST_WITH_IMMEDIATE), 33);
    assert_eq!(n(Opcode::SEND_ONLY_WITH_IMMEDIATE), 2);
    assert_eq!(n(Opcode::ACKNOWLEDGE), 37);
    assert_eq!(s.ok.values().sum::<usize>(), 105);
    assert_eq!(s.not_roce, 18);
}

#[test]
fn cx4_cnp_capture() {
    let frames = load("cx4lx_cnp_scapy_test.pcap");
    let s = check(&frames);
    assert!(s.bad.is_empty());
    assert_eq!(s.ok.get(&Opcode::CNP), Some(&1));
    let f = RoceFrame::parse(&frames[0].data).unwrap().unwrap();
    assert!(f.packet.bth.becn);
    assert_eq!(f.packet.bth.dest_qp, 0x118);
    assert_eq!(f.icrc.to_le_bytes(), [0x82, 0xfd, 0x00, 0x2a]);
}

#[test]
fn rxe_read_request_capture() {
    let frames = load("rxe_read_request_pcapplusplus_test.pcap");
    let s = check(&frames);
    assert!(s.bad.is_empty());
    assert_eq!(s.ok.get(&Opcode::RDMA_READ_REQUEST), Some(&1));
    let f = RoceFrame::parse(&frames[0].data).unwrap().unwrap();
    let reth = f.packet.reth.unwrap();
    assert_eq!((f.packet.bth.dest_qp, f.packet.bth.psn), (0x11, 0x54cb63));
    assert!(f.packet.bth.ack_req);
    assert_eq!(
        (reth.va, reth.rkey, reth.dma_len),
        (0x7fee_260f_b000, 0x2b8, 0x10000)
    );
    assert_eq!(f.icrc.to_le_bytes(), [0x08, 0xc6, 0x15, 0x4a]);
}

#[test]
fn native_infiniband_capture_is_not_rocev2() {
    // ERF-encapsulated native IB: no RoCEv2 packets, and nothing misread as one.
    let s = check(&load("native_ib_erf_2008_infiniband.pcap"));
    assert_eq!(s.frames, 43);
    assert!(s.ok.is_empty() && s.bad.is_empty());
}

#[test]
fn corrupted_packets_are_caught() {
    let frames = load("hns_roce_rc_send_oferby_proxy.pcap");
    let roce: Vec<_> = frames
        .iter()
        .filter(|c| RoceFrame::parse(&c.data).ok().flatten().is_some())
        .collect();
    for (i, c) in roce.iter().enumerate().take(20) {
        let mut bad = (*c).clone();
        // Flip one bit somewhere after the UDP header (inside what the ICRC covers).
        let pos = 42 + (i * 7) % (bad.data.len() - 46);
        bad.data[pos] ^= 1 << (i % 8);
        let s = check(&[bad]);
        assert_eq!(s.bad.len(), 1, "flipped byte {pos} of frame {i} not caught");
    }
}

/// A UDP socket hides the IPv4 Identification, which the ICRC covers; the solver
/// recovers it from the ICRC alone. On real NIC traffic it must find exactly
/// the value on the wire, and refuse corrupted packets.
#[test]
fn ipv4_identification_is_recovered_from_the_icrc() {
    use rdmx_roce_proto::icrc::Ipv4IdSolver;
    use rdmx_roce_proto::wire::Ip;
    let mut solver = Ipv4IdSolver::new();
    let mut checked = 0;
    let mut ids = std::collections::HashSet::new();
    for name in [
        "hns_roce_rc_send_oferby_proxy.pcap",
        "cx4lx_cnp_scapy_test.pcap",
        "rxe_read_request_pcapplusplus_test.pcap",
    ] {
        for c in load(name) {
            let Some(f) = RoceFrame::parse(&c.data).unwrap() else {
                continue;
            };
            let Ip::V4(h) = &f.ip else { continue };
            let wire_id = u16::from_be_bytes([h[4], h[5]]);
            let mut t = Vec::new();
            f.packet.encode(&mut t);
            let mut hidden = h.clone();
            hidden[4] = 0x5a;
            hidden[5] = 0xa5;
            let udp = f.udp.bytes();
            assert_eq!(
                solver.solve(&hidden, &udp, &t, f.icrc),
                Some(wire_id),
                "{name}"
            );
            // A flipped payload or header bit no longer solves (2^-16 chance each).
            let last = t.len() - 1;
            t[last] ^= 0x10;
            assert_eq!(solver.solve(&hidden, &udp, &t, f.icrc), None, "{name}");
            ids.insert(wire_id);
            checked += 1;
        }
    }
    assert!(checked >= 100, "{checked}");
    // hns sends ID 0; the CX-4 and rxe frames carry real nonzero IDs.
    assert!(ids.iter().filter(|&&i| i != 0).count() >= 2, "{ids:?}");

    // Every one of the 65536 values is found: refinalize one frame per ID.
    let c = &load("rxe_read_request_pcapplusplus_test.pcap")[0];
    let mut f = RoceFrame::parse(&c.data).unwrap().unwrap();
    let mut t = Vec::new();
    f.packet.encode(&mut t);
    for id in 0..=u16::MAX {
        if let Ip::V4(h) = &mut f.ip {
            h[4..6].copy_from_slice(&id.to_be_bytes());
        }
        f.finalize();
        let mut hidden = f.ip.bytes().to_vec();
        hidden[4] = 0;
        hidden[5] = 0;
        assert_eq!(solver.solve(&hidden, &f.udp.bytes(), &t, f.icrc), Some(id));
    }
}

/// Frames of `name` decoded, every one a RoCEv2 packet that verified.
fn packets(name: &str) -> Vec<rdmx_roce_proto::Packet> {
    let frames = load(name);
    let s = check(&frames);
    assert!(s.bad.is_empty(), "{name}: {:?}", s.bad);
    assert_eq!(s.not_roce, 0, "{name}");
    frames
        .iter()
        .map(|c| RoceFrame::parse(&c.data).unwrap().unwrap().packet)
        .collect()
}

fn has_psn_sequence_nak(p: &[rdmx_roce_proto::Packet]) -> bool {
    p.iter().any(|p| {
        p.bth.opcode == Opcode::ACKNOWLEDGE
            && p.aeth.is_some_and(|a| {
                a.kind()
                    == rdmx_roce_proto::Syndrome::Nak(rdmx_roce_proto::NakCode::PsnSequenceError)
            })
    })
}

/// Linux 6.1 rxe against rxe (two QEMU guests, testbed/tests.sh captures):
/// perftest (RC, UC, UD, atomics, rdma_cm), ibv_rc_pingpong's library, rdmx
/// on both ends (writes with immediate), and a lossy run. Every ICRC, as rxe
/// computed it, verifies here.
#[test]
fn rxe_to_rxe_capture_has_every_transport() {
    let p = packets("rxe_rxe_linux61_perftest_rdmx.pcapng");
    assert_eq!(p.len(), 1247);
    let seen: std::collections::BTreeSet<Opcode> = p.iter().map(|p| p.bth.opcode).collect();
    for op in [
        Opcode::SEND_FIRST,
        Opcode::SEND_MIDDLE,
        Opcode::SEND_LAST,
        Opcode::SEND_ONLY,
        Opcode::RDMA_WRITE_FIRST,
        Opcode::RDMA_WRITE_MIDDLE,
        Opcode::RDMA_WRITE_LAST,
        Opcode::RDMA_WRITE_ONLY,
        Opcode::RDMA_WRITE_LAST_WITH_IMMEDIATE,
        Opcode::RDMA_READ_REQUEST,
        Opcode::RDMA_READ_RESPONSE_FIRST,
        Opcode::RDMA_READ_RESPONSE_MIDDLE,
        Opcode::RDMA_READ_RESPONSE_LAST,
        Opcode::RDMA_READ_RESPONSE_ONLY,
        Opcode::ACKNOWLEDGE,
        Opcode::ATOMIC_ACKNOWLEDGE,
        Opcode::COMPARE_SWAP,
        Opcode::FETCH_ADD,
        Opcode::UC_SEND_FIRST,
        Opcode::UC_SEND_MIDDLE,
        Opcode::UC_SEND_LAST,
        Opcode::UC_RDMA_WRITE_FIRST,
        Opcode::UC_RDMA_WRITE_MIDDLE,
        Opcode::UC_RDMA_WRITE_LAST,
        Opcode::UD_SEND_ONLY,
    ] {
        assert!(seen.contains(&op), "{op} missing");
    }
    // UD: DETH with the sender's QP; the CM's MADs go to QP1 with Q_Key 0x80010000.
    let cm: Vec<String> = p
        .iter()
        .filter_map(rdmx_roce_proto::mad::describe)
        .collect();
    for m in [
        "CM ConnectRequest",
        "CM ConnectReply",
        "CM ReadyToUse",
        "CM DisconnectRequest",
    ] {
        assert!(cm.iter().any(|c| c == m), "{m} missing from {cm:?}");
    }
    assert!(p
        .iter()
        .filter(|p| p.bth.dest_qp == 1)
        .all(|p| p.deth.is_some_and(|d| d.qkey == 0x8001_0000)));
    assert!(has_psn_sequence_nak(&p), "no sequence NAK in the lossy run");
}

/// rdmx's soft engine (host) against Linux 6.1 rxe under rdmx's NIC provider
/// (guest): `rdmx soak` at 1000 B, 4097 B and, with 10% loss, 32 KiB per
/// operation. Both sides' ICRCs verify: rxe drops packets whose ICRC does
/// not, so the soft engine's IPv4 ICRCs are exact on the wire.
#[test]
fn soft_to_rxe_capture() {
    let p = packets("soft_rxe_linux61_rdmx_soak.pcapng");
    assert_eq!(p.len(), 419);
    let seen: std::collections::BTreeSet<Opcode> = p.iter().map(|p| p.bth.opcode).collect();
    for op in [
        Opcode::SEND_ONLY,
        Opcode::RDMA_WRITE_ONLY,
        Opcode::RDMA_WRITE_LAST_WITH_IMMEDIATE,
        Opcode::RDMA_READ_REQUEST,
        Opcode::RDMA_READ_RESPONSE_ONLY,
        Opcode::RDMA_READ_RESPONSE_MIDDLE,
        Opcode::ATOMIC_ACKNOWLEDGE,
        Opcode::COMPARE_SWAP,
        Opcode::FETCH_ADD,
    ] {
        assert!(seen.contains(&op), "{op} missing");
    }
    assert!(has_psn_sequence_nak(&p), "no sequence NAK in the lossy run");
}

/// rdmx's soft engine (host) against unmodified verbs programs on Linux 6.1
/// rxe (guest): `ib_send_bw -r 2` with `rdmx perf --perftest` keeping 64
/// sends in flight (rxe answers with RNR NAKs), then `ibv_rc_pingpong`
/// against `rdmx pingpong --imm` at 64 B and 3000 B (sends with immediate).
#[test]
fn soft_to_rxe_verbs_capture_has_rnr_naks_and_immediates() {
    use rdmx_roce_proto::Syndrome;
    let p = packets("soft_rxe_linux61_perftest_pingpong.pcapng");
    assert_eq!(p.len(), 1255);
    let seen: std::collections::BTreeSet<Opcode> = p.iter().map(|p| p.bth.opcode).collect();
    for op in [
        Opcode::SEND_FIRST,
        Opcode::SEND_MIDDLE,
        Opcode::SEND_LAST,
        Opcode::SEND_ONLY,
        Opcode::SEND_LAST_WITH_IMMEDIATE,
        Opcode::SEND_ONLY_WITH_IMMEDIATE,
        Opcode::ACKNOWLEDGE,
    ] {
        assert!(seen.contains(&op), "{op} missing");
    }
    // RNR NAKs carry perftest's min_rnr_timer (12), and the soft engine sends
    // each NAK'd PSN again afterwards.
    let rnr: Vec<(usize, u32)> = p
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            p.aeth
                .is_some_and(|a| matches!(a.kind(), Syndrome::RnrNak { .. }))
        })
        .map(|(i, p)| {
            assert_eq!(p.aeth.unwrap().kind(), Syndrome::RnrNak { timer: 12 });
            (i, p.bth.psn)
        })
        .collect();
    assert!(rnr.len() >= 10, "only {} RNR NAKs", rnr.len());
    for (i, psn) in &rnr {
        assert!(
            p[i + 1..]
                .iter()
                .any(|q| q.bth.opcode == Opcode::SEND_ONLY && q.bth.psn == *psn),
            "RNR-NAK'd PSN {psn:#x} (frame {i}) never sent again"
        );
    }
    assert!(has_psn_sequence_nak(&p));
    // rdmx pingpong --imm numbers its messages: immediates 0..9 in each run.
    for op in [
        Opcode::SEND_ONLY_WITH_IMMEDIATE,
        Opcode::SEND_LAST_WITH_IMMEDIATE,
    ] {
        let imms: std::collections::BTreeSet<u32> = p
            .iter()
            .filter(|q| q.bth.opcode == op)
            .map(|q| q.imm.expect("ImmDt"))
            .collect();
        assert_eq!(imms, (0..10).collect(), "{op}");
    }
}
