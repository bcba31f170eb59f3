//! `rdmx pcap check`: verify RoCEv2 captures (pcap or pcapng).

use rdmx_core::Error;
use rdmx_roce_proto::pcap::{check_frame, read_capture, Verdict};
use rdmx_roce_proto::RoceFrame;

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
    /// is malformed or has a bad ICRC.
    Check {
        /// Capture files (pcap or pcapng).
        #[arg(required = true)]
        files: Vec<String>,
        /// Print every packet.
        #[arg(long, short)]
        verbose: bool,
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
    let PcapCmd::Check { files, verbose } = a.cmd;
    let mut failed = 0;
    for file in &files {
        let f = std::fs::File::open(file)
            .map_err(|e| Error::InvalidArgument(format!("{file}: {e}")))?;
        let frames = read_capture(f).map_err(|e| Error::InvalidArgument(format!("{file}: {e}")))?;
        let mut ok = std::collections::BTreeMap::new();
        let (mut other, mut bad) = (0, 0);
        for (i, c) in frames.iter().enumerate() {
            match check_frame(c) {
                Verdict::Ok(op) => {
                    *ok.entry(op).or_insert(0usize) += 1;
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
            "{file}: {} frames, {roce} RoCEv2 ({} ok, {bad} bad), {other} other",
            frames.len(),
            roce - bad
        );
        for (op, n) in &ok {
            println!("  {:<34} {n:>6}", op.to_string());
        }
        failed += bad;
    }
    if failed > 0 {
        return Err(Error::Protocol(format!(
            "{failed} RoCEv2 packet(s) failed the check"
        )));
    }
    Ok(())
}
