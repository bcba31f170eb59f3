//! The RoCEv2 engine without any I/O: two RC queue pairs joined by a loop
//! that carries their packets as Ethernet/IPv4/UDP frames (ICRC included)
//! and drops every seventh one.
//!
//! ```text
//! cargo run -p rdmx-roce-proto --example sans_io
//! ```
//!
//! The engine never reads a clock or touches a socket: the caller gives it
//! the time (`now`, nanoseconds), asks it for packets (`poll_transmit`),
//! hands it what arrived (`handle_packet`), runs its timers when
//! `poll_timeout` says (`handle_timeout`), and collects completions
//! (`poll_completion`). This loop is what a provider (a socket, a TAP, a
//! simulator) writes around it. Here A sends a message, writes, reads and
//! runs both atomics against B's memory; the data is checked byte for byte
//! and the example fails if any differs.

use bytes::Bytes;
use rdmx_roce_proto::{
    Atomic, Completion, FramePath, Memory, Qp, QpConfig, RoceFrame, VecMemory, WcOpcode, WcStatus,
    WorkRequest,
};

const B_KEY: u32 = 0x0B0B;
const B_VA: u64 = 0x4000_0000;
const REGION: usize = 64 << 10;
/// One-way delay of the simulated link.
const DELAY_NS: u64 = 5_000;

/// One end: its queue pair, its registered memory, its frames' addresses.
struct End {
    qp: Qp,
    mem: VecMemory,
    path: FramePath,
    done: Vec<Completion>,
}

fn path(src: u8, dst: u8) -> FramePath {
    FramePath {
        src_mac: [2, 0, 0, 0, 0, src],
        dst_mac: [2, 0, 0, 0, 0, dst],
        src: format!("198.18.0.{src}").parse().expect("address"),
        dst: format!("198.18.0.{dst}").parse().expect("address"),
        sport: 0xC000 | u16::from(src),
        ecn: 2,
        flow_label: 0,
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = QpConfig {
        selective_repeat: true,
        ..QpConfig::default()
    };
    let mut a = End {
        qp: Qp::new(cfg, 0x11),
        mem: VecMemory::default(),
        path: path(1, 2),
        done: Vec::new(),
    };
    let mut b = End {
        qp: Qp::new(cfg, 0x22),
        mem: VecMemory::default(),
        path: path(2, 1),
        done: Vec::new(),
    };
    // RESET → INIT → RTR → RTS, each side told the other's QPN and PSN (the
    // connection manager's job on a real NIC).
    a.qp.connect(0x22, 1000, 5000)?;
    b.qp.connect(0x11, 5000, 1000)?;
    // B's memory: a region A may write, read and run atomics on (the word
    // at +8 starts at 40). A's rkey/va would travel in a message in a real
    // program.
    let mut region = pattern(7, REGION);
    region[8..16].copy_from_slice(&40u64.to_le_bytes());
    b.mem.add(B_KEY, B_VA, region);
    b.qp.post_recv(100, 16 << 10)?;

    let message = Bytes::from(pattern(1, 10_000));
    let written = Bytes::from(pattern(2, 20_000));
    a.qp.post_send(
        1,
        WorkRequest::Send {
            data: message.clone(),
            imm: Some(0xCAFE),
            invalidate: None,
        },
    )?;
    a.qp.post_send(
        2,
        WorkRequest::Write {
            data: written.clone(),
            va: B_VA + 4096,
            rkey: B_KEY,
            imm: None,
        },
    )?;
    a.qp.post_send(
        3,
        WorkRequest::Read {
            va: B_VA + 4096,
            rkey: B_KEY,
            len: written.len() as u32,
        },
    )?;
    a.qp.post_send(
        4,
        WorkRequest::Atomic {
            va: B_VA + 8,
            rkey: B_KEY,
            op: Atomic::FetchAdd { add: 2 },
        },
    )?;
    a.qp.post_send(
        5,
        WorkRequest::Atomic {
            va: B_VA + 8,
            rkey: B_KEY,
            op: Atomic::CompareSwap {
                compare: 42,
                swap: 7,
            },
        },
    )?;

    // The event loop: frames in flight as (arrival time, to B?, bytes).
    let mut wire: Vec<(u64, bool, Vec<u8>)> = Vec::new();
    let (mut now, mut sent, mut dropped) = (0u64, 0u64, 0u64);
    while a.done.len() < 5 || b.done.is_empty() {
        for (end, to_b) in [(&mut a, true), (&mut b, false)] {
            while let Some(p) = end.qp.poll_transmit(now) {
                // The frame a soft RoCE provider puts on the wire.
                let frame = RoceFrame::new(&end.path, p).to_bytes();
                sent += 1;
                if sent % 7 == 0 {
                    dropped += 1;
                    continue;
                }
                wire.push((now + DELAY_NS, to_b, frame));
            }
        }
        // Next event: the earliest arrival or timer.
        let next = wire
            .iter()
            .map(|w| w.0)
            .chain(a.qp.poll_timeout())
            .chain(b.qp.poll_timeout())
            .min()
            .ok_or("nothing in flight and no timer, before every operation finished")?;
        now = now.max(next);
        let (arrived, later): (Vec<_>, Vec<_>) = wire.drain(..).partition(|w| w.0 <= now);
        wire = later;
        for (_, to_b, bytes) in arrived {
            let frame = RoceFrame::parse(&bytes)?.ok_or("not a RoCEv2 frame")?;
            frame.verify_icrc()?;
            let end = if to_b { &mut b } else { &mut a };
            end.qp
                .handle_packet(now, &frame.packet, false, &mut end.mem);
        }
        for end in [&mut a, &mut b] {
            end.qp.handle_timeout(now);
            while let Some(c) = end.qp.poll_completion() {
                end.done.push(c);
            }
        }
        if now > 10_000_000_000 {
            return Err("not finished after 10 s of simulated time".into());
        }
    }

    for c in a.done.iter().chain(&b.done) {
        println!(
            "wr {:>3} {:?} {:?}: {} bytes{}",
            c.wr_id,
            c.opcode,
            c.status,
            c.byte_len,
            c.atomic_orig
                .map(|o| format!(", original value {o}"))
                .unwrap_or_default()
        );
        if c.status != WcStatus::Success {
            return Err(format!("work request {} failed", c.wr_id).into());
        }
    }
    // Completions come in posting order, with exact data.
    let ids: Vec<u64> = a.done.iter().map(|c| c.wr_id).collect();
    if ids != [1, 2, 3, 4, 5] {
        return Err(format!("completions out of order: {ids:?}").into());
    }
    let recv = &b.done[0];
    if recv.opcode != WcOpcode::Recv || recv.data != message || recv.imm != Some(0xCAFE) {
        return Err("the message B received differs from the one A sent".into());
    }
    if b.mem
        .read(B_KEY, B_VA + 4096, written.len() as u64)
        .map_err(|e| format!("{e:?}"))?
        != written
    {
        return Err("B's memory does not hold what A wrote".into());
    }
    if a.done[2].data != written {
        return Err("A read back something else than it wrote".into());
    }
    // FAA saw 40 and left 42; CAS saw 42 (equal) and swapped in 7.
    if (a.done[3].atomic_orig, a.done[4].atomic_orig) != (Some(40), Some(42)) {
        return Err("atomics returned the wrong original values".into());
    }
    if b.mem
        .read(B_KEY, B_VA + 8, 8)
        .map_err(|e| format!("{e:?}"))?[..]
        != 7u64.to_le_bytes()
    {
        return Err("the atomic word does not hold 7".into());
    }
    let s = a.qp.stats();
    println!(
        "{sent} frames sent, {dropped} dropped; A resent {} packets ({} NAKs received), \
         finished at {:.1} µs of simulated time",
        s.retransmits,
        s.naks_received,
        now as f64 / 1e3
    );
    println!("ok");
    Ok(())
}
