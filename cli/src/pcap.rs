//! `rdmx pcap check`: verify RoCEv2 captures (pcap or pcapng).

use rdmx_core::Error;
use rdmx_roce_proto::pcap::{check_frame_on, read_capture_file, Verdict};
use rdmx_roce_proto::{mad, RoceFrame, Transport};

/// Arguments of `rdmx pcap`.
#[derive(clap::Args, Debug)]
pub(crate) struct PcapArgs {
    #[command(subcommand)]
    cmd: PcapCmd,
}

#[derive(clap::Subcommand, Debug)]
enum PcapCmd {
    /// Parse every RoCEv2 packet, verify its ICRC and that it re-serialises byte
    /// for byte; print a per-opcode summary. Exits non-zero if any RoCEv2 packet
    /// is malformed or has a bad ICRC, if the file is damaged (the frame and
    /// byte offset are named), or if a file holds no RoCEv2 packet at all
    /// (nothing was verified) unless --allow-empty.
    Check {
        /// Capture files (pcap or pcapng).
        #[arg(required = true)]
        files: Vec<String>,
        /// Print every packet.
        #[arg(long, short)]
        verbose: bool,
        /// UDP port carrying RoCEv2. Default: the port rdmx noted in a capture
        /// it wrote (`rdmx perf --capture`), else 4791.
        #[arg(long)]
        port: Option<u16>,
        /// Succeed on a file with no RoCEv2 packet (nothing verified).
        #[arg(long)]
        allow_empty: bool,
    },
}

fn describe(data: &[u8]) -> String {
    match RoceFrame::parse(data) {
        Ok(Some(f)) => {
            let p = &f.packet;
            let (src, dst) = f.ip.addrs();
            let mut s = format!(
                "{src}:{} > {dst} {} qp={:#x} psn={} len={}",
                f.udp.sport,
                p.bth.opcode,
                p.bth.dest_qp,
                p.bth.psn,
                p.payload.len()
            );
            if p.bth.ack_req {
                s.push_str(" A");
            }
            if let Some(d) = p.deth {
                s.push_str(&format!(" qkey={:#x} srcqp={:#x}", d.qkey, d.src_qp));
            }
            if let Some(m) = mad::describe(p) {
                s.push_str(&format!(" {m}"));
            }
            if let Some(r) = p.reth {
                s.push_str(&format!(
                    " va={:#x} rkey={:#x} dlen={}",
                    r.va, r.rkey, r.dma_len
                ));
            }
            if let Some(a) = p.aeth {
                s.push_str(&format!(" aeth={:?} msn={}", a.kind(), a.msn));
            }
            if let Some(a) = p.atomic_eth {
                s.push_str(&format!(
                    " va={:#x} rkey={:#x} swap/add={} cmp={}",
                    a.va, a.rkey, a.swap_add, a.compare
                ));
            }
            if let Some(v) = p.atomic_ack {
                s.push_str(&format!(" orig={v}"));
            }
            if let Some(v) = p.imm {
                s.push_str(&format!(" imm={v:#x}"));
            }
            if let Some(v) = p.ieth {
                s.push_str(&format!(" inv_rkey={v:#x}"));
            }
            if p.bth.becn {
                s.push_str(" BECN");
            }
            s
        }
        _ => String::new(),
    }
}

pub(crate) fn run(a: PcapArgs) -> Result<(), Error> {
    let PcapCmd::Check {
        files,
        verbose,
        port,
        allow_empty,
    } = a.cmd;
    let mut failed = 0;
    let mut empty = Vec::new();
    for file in &files {
        let f = std::fs::File::open(file)
            .map_err(|e| Error::InvalidArgument(format!("{file}: {e}")))?;
        let cap =
            read_capture_file(f).map_err(|e| Error::InvalidArgument(format!("{file}: {e}")))?;
        let port = port
            .or(cap.roce_port)
            .unwrap_or(rdmx_roce_proto::ROCEV2_PORT);
        let frames = cap.frames;
        let mut ok = std::collections::BTreeMap::new();
        let (mut other, mut bad) = (0, 0);
        for (i, c) in frames.iter().enumerate() {
            match check_frame_on(c, port) {
                Verdict::Ok(op) => {
                    // Datagrams to QP1 are management MADs (the CM of rdma_cm
                    // and perftest -R): counted by message.
                    let mad = (op.transport() == Transport::Ud)
                        .then(|| RoceFrame::parse_on(&c.data, port).ok().flatten())
                        .flatten()
                        .and_then(|f| mad::describe(&f.packet));
                    *ok.entry((op, mad)).or_insert(0usize) += 1;
                    if verbose {
                        println!("{file} #{}: {} icrc ok", i + 1, describe(&c.data));
                    }
                }
                Verdict::NotRoce => other += 1,
                Verdict::Bad(why) => {
                    bad += 1;
                    println!("{file} #{}: BAD: {why} {}", i + 1, describe(&c.data));
                }
            }
        }
        let roce: usize = ok.values().sum::<usize>() + bad;
        println!(
            "{file}: {} frames, {roce} RoCEv2 ({} ok, {bad} bad), {other} other (RoCEv2 on UDP {port})",
            frames.len(),
            roce - bad
        );
        if roce == 0 {
            empty.push(file.as_str());
        }
        for ((op, mad), n) in &ok {
            let label = match mad {
                Some(m) => format!("{op} ({m})"),
                None => op.to_string(),
            };
            println!("  {label:<48} {n:>6}");
        }
        failed += bad;
    }
    if failed > 0 {
        return Err(Error::Protocol(format!(
            "{failed} RoCEv2 packet(s) failed the check"
        )));
    }
    if !empty.is_empty() && !allow_empty {
        return Err(Error::InvalidArgument(format!(
            "nothing verified: no RoCEv2 packet in {} (not Ethernet/IP/UDP to the RoCEv2 port; \
             try --port, or --allow-empty to accept)",
            empty.join(", ")
        )));
    }
    Ok(())
}
