//! Reading and writing captures (pcap and pcapng) of RoCEv2 traffic, and the
//! check behind `rdmx pcap check`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Duration;

use pcap_file::pcap::{PcapHeader, PcapPacket, PcapReader, PcapWriter};
use pcap_file::pcapng::{Block, PcapNgReader};
use pcap_file::DataLink;

use crate::opcode::Opcode;
use crate::wire::RoceFrame;

/// One captured link-layer frame.
#[derive(Clone, Debug)]
pub struct Captured {
    /// Link type of the interface it was captured on.
    pub link: DataLink,
    /// Capture timestamp.
    pub timestamp: Duration,
    /// Frame bytes.
    pub data: Vec<u8>,
}

/// Read every frame of a pcap or pcapng capture.
pub fn read_capture(mut r: impl Read) -> Result<Vec<Captured>, String> {
    let mut all = Vec::new();
    r.read_to_end(&mut all).map_err(|e| e.to_string())?;
    let magic = all.get(..4).ok_or("file too short for a capture")?;
    let mut out = Vec::new();
    if magic == [0x0A, 0x0D, 0x0D, 0x0A] {
        let mut rd = PcapNgReader::new(&all[..]).map_err(|e| format!("pcapng: {e}"))?;
        let mut links = Vec::new();
        while let Some(block) = rd.next_block() {
            match block.map_err(|e| format!("pcapng: {e}"))? {
                Block::InterfaceDescription(i) => links.push(i.linktype),
                Block::EnhancedPacket(p) => out.push(Captured {
                    link: *links
                        .get(p.interface_id as usize)
                        .ok_or("packet on an undeclared interface")?,
                    timestamp: p.timestamp,
                    data: p.data.into_owned(),
                }),
                Block::SimplePacket(p) => out.push(Captured {
                    link: *links.first().ok_or("packet before any interface")?,
                    timestamp: Duration::ZERO,
                    data: p.data.into_owned(),
                }),
                _ => {}
            }
        }
    } else {
        let mut rd = PcapReader::new(&all[..]).map_err(|e| format!("pcap: {e}"))?;
        let link = rd.header().datalink;
        while let Some(p) = rd.next_packet() {
            let p = p.map_err(|e| format!("pcap: {e}"))?;
            out.push(Captured {
                link,
                timestamp: p.timestamp,
                data: p.data.into_owned(),
            });
        }
    }
    Ok(out)
}

/// Writes Ethernet frames as a pcap file (what `--capture` produces).
pub struct CaptureWriter<W: Write> {
    inner: PcapWriter<W>,
}

impl<W: Write> CaptureWriter<W> {
    /// Start a pcap file with Ethernet link type.
    pub fn new(w: W) -> Result<CaptureWriter<W>, String> {
        let header = PcapHeader {
            datalink: DataLink::ETHERNET,
            ..PcapHeader::default()
        };
        Ok(CaptureWriter {
            inner: PcapWriter::with_header(w, header).map_err(|e| e.to_string())?,
        })
    }

    /// Append one frame.
    pub fn write(&mut self, timestamp: Duration, frame: &[u8]) -> Result<(), String> {
        let p = PcapPacket::new(timestamp, frame.len() as u32, frame);
        self.inner
            .write_packet(&p)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// What happened to one frame in [`check`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// A RoCEv2 packet that parsed, verified its ICRC and re-serialised byte for byte.
    Ok(Opcode),
    /// Not a RoCEv2 packet (other protocol or link type).
    NotRoce,
    /// A RoCEv2 packet that failed; the text says how.
    Bad(String),
}

/// Check one captured frame.
pub fn check_frame(c: &Captured) -> Verdict {
    if c.link != DataLink::ETHERNET {
        return Verdict::NotRoce;
    }
    match RoceFrame::parse(&c.data) {
        Ok(None) => Verdict::NotRoce,
        Err(e) => Verdict::Bad(format!("malformed: {e}")),
        Ok(Some(f)) => {
            if let Err(e) = f.verify_icrc() {
                return Verdict::Bad(e.to_string());
            }
            if f.to_bytes() != c.data {
                return Verdict::Bad("does not re-serialise to the same bytes".into());
            }
            Verdict::Ok(f.packet.bth.opcode)
        }
    }
}

/// Summary of a capture check.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Frames read.
    pub frames: usize,
    /// RoCEv2 packets that passed, per opcode.
    pub ok: BTreeMap<Opcode, usize>,
    /// Frames that were not RoCEv2.
    pub not_roce: usize,
    /// RoCEv2 packets that failed: (frame number from 1, reason).
    pub bad: Vec<(usize, String)>,
}

/// Check every frame of a capture.
pub fn check(frames: &[Captured]) -> Summary {
    let mut s = Summary {
        frames: frames.len(),
        ..Summary::default()
    };
    for (i, c) in frames.iter().enumerate() {
        match check_frame(c) {
            Verdict::Ok(op) => *s.ok.entry(op).or_default() += 1,
            Verdict::NotRoce => s.not_roce += 1,
            Verdict::Bad(why) => s.bad.push((i + 1, why)),
        }
    }
    s
}
