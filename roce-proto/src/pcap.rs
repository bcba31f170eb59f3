//! Reading and writing captures (pcap and pcapng) of RoCEv2 traffic, and the
//! check behind `rdmx pcap check`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::time::Duration;

use pcap_file::pcap::PcapParser;
use pcap_file::pcapng::blocks::enhanced_packet::EnhancedPacketBlock;
use pcap_file::pcapng::blocks::interface_description::InterfaceDescriptionBlock;
use pcap_file::pcapng::blocks::section_header::{SectionHeaderBlock, SectionHeaderOption};
use pcap_file::pcapng::{Block, PcapNgParser, PcapNgWriter};
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

/// A capture's frames, and the RoCEv2 UDP port rdmx recorded in it (when rdmx
/// wrote the file: its engine may run on another port than 4791).
#[derive(Clone, Debug, Default)]
pub struct CaptureFile {
    /// Every frame, in order.
    pub frames: Vec<Captured>,
    /// The port from rdmx's section comment (`rdmx-roce-port=N`), if present.
    pub roce_port: Option<u16>,
}

/// The section comment rdmx writes: `rdmx-roce-port=<port>`.
const PORT_COMMENT: &str = "rdmx-roce-port=";

/// Read every frame of a pcap or pcapng capture.
pub fn read_capture(r: impl Read) -> Result<Vec<Captured>, String> {
    read_capture_file(r).map(|c| c.frames)
}

/// Read a pcap or pcapng capture with rdmx's port note. A damaged file is an
/// error that names the frame (from 1) and the byte offset where reading stopped.
pub fn read_capture_file(mut r: impl Read) -> Result<CaptureFile, String> {
    let mut all = Vec::new();
    r.read_to_end(&mut all).map_err(|e| e.to_string())?;
    let magic = all.get(..4).ok_or("file too short for a capture")?;
    let at = |rest: &[u8]| all.len() - rest.len();
    let mut out = CaptureFile::default();
    if magic == [0x0A, 0x0D, 0x0D, 0x0A] {
        let (mut rest, mut parser) =
            PcapNgParser::new(&all[..]).map_err(|e| format!("pcapng section header: {e}"))?;
        let mut links = Vec::new();
        let note = |opts: &[SectionHeaderOption<'_>]| {
            opts.iter().find_map(|o| match o {
                SectionHeaderOption::Comment(c) => {
                    c.strip_prefix(PORT_COMMENT)?.trim().parse().ok()
                }
                _ => None,
            })
        };
        out.roce_port = note(&parser.section().options);
        while !rest.is_empty() {
            let offset = at(rest);
            let (next, block) = parser.next_block(rest).map_err(|e| {
                format!(
                    "pcapng: block after frame {} is damaged or truncated at byte offset {offset}: {e}",
                    out.frames.len()
                )
            })?;
            rest = next;
            let frame = out.frames.len() + 1;
            match block {
                Block::SectionHeader(h) => {
                    links.clear();
                    out.roce_port = note(&h.options).or(out.roce_port);
                }
                Block::InterfaceDescription(i) => links.push(i.linktype),
                Block::EnhancedPacket(p) => out.frames.push(Captured {
                    link: *links.get(p.interface_id as usize).ok_or_else(|| {
                        format!(
                            "frame {frame} (byte offset {offset}) is on an undeclared interface"
                        )
                    })?,
                    timestamp: p.timestamp,
                    data: p.data.into_owned(),
                }),
                Block::SimplePacket(p) => out.frames.push(Captured {
                    link: *links.first().ok_or_else(|| {
                        format!("frame {frame} (byte offset {offset}) comes before any interface")
                    })?,
                    timestamp: Duration::ZERO,
                    data: p.data.into_owned(),
                }),
                _ => {}
            }
        }
    } else {
        let (mut rest, parser) =
            PcapParser::new(&all[..]).map_err(|e| format!("pcap file header: {e}"))?;
        let link = parser.header().datalink;
        while !rest.is_empty() {
            let offset = at(rest);
            let (next, p) = parser.next_packet(rest).map_err(|e| {
                format!(
                    "pcap: frame {} is truncated or damaged at byte offset {offset} ({} bytes left in the file): {e}",
                    out.frames.len() + 1,
                    rest.len()
                )
            })?;
            rest = next;
            out.frames.push(Captured {
                link,
                timestamp: p.timestamp,
                data: p.data.into_owned(),
            });
        }
    }
    Ok(out)
}

/// Writes Ethernet frames as a pcapng file (what `--capture` produces), with
/// the engine's RoCEv2 UDP port in the section comment so `rdmx pcap check`
/// knows which port to decode.
pub struct CaptureWriter<W: Write> {
    inner: PcapNgWriter<W>,
}

impl<W: Write> CaptureWriter<W> {
    /// Start a pcapng file: one Ethernet interface, `port` noted.
    pub fn new(w: W, port: u16) -> Result<CaptureWriter<W>, String> {
        let section = SectionHeaderBlock {
            options: vec![
                SectionHeaderOption::Comment(format!("{PORT_COMMENT}{port}").into()),
                SectionHeaderOption::UserApplication("rdmx".into()),
            ],
            ..SectionHeaderBlock::default()
        };
        let mut inner = PcapNgWriter::with_section_header(w, section).map_err(|e| e.to_string())?;
        inner
            .write_pcapng_block(InterfaceDescriptionBlock {
                linktype: DataLink::ETHERNET,
                snaplen: 0,
                options: Vec::new(),
            })
            .map_err(|e| e.to_string())?;
        Ok(CaptureWriter { inner })
    }

    /// Append one frame.
    pub fn write(&mut self, timestamp: Duration, frame: &[u8]) -> Result<(), String> {
        self.inner
            .write_pcapng_block(EnhancedPacketBlock {
                interface_id: 0,
                timestamp,
                original_len: frame.len() as u32,
                data: frame.into(),
                options: Vec::new(),
            })
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

/// Check one captured frame (RoCEv2 on UDP port 4791).
pub fn check_frame(c: &Captured) -> Verdict {
    check_frame_on(c, crate::wire::ROCEV2_PORT)
}

/// Check one captured frame, taking UDP datagrams to `port` as RoCEv2.
pub fn check_frame_on(c: &Captured, port: u16) -> Verdict {
    if c.link != DataLink::ETHERNET {
        return Verdict::NotRoce;
    }
    match RoceFrame::parse_on(&c.data, port) {
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

/// Check every frame of a capture (RoCEv2 on UDP port 4791).
pub fn check(frames: &[Captured]) -> Summary {
    check_on(frames, crate::wire::ROCEV2_PORT)
}

/// Check every frame of a capture, taking UDP datagrams to `port` as RoCEv2.
pub fn check_on(frames: &[Captured], port: u16) -> Summary {
    let mut s = Summary {
        frames: frames.len(),
        ..Summary::default()
    };
    for (i, c) in frames.iter().enumerate() {
        match check_frame_on(c, port) {
            Verdict::Ok(op) => *s.ok.entry(op).or_default() += 1,
            Verdict::NotRoce => s.not_roce += 1,
            Verdict::Bad(why) => s.bad.push((i + 1, why)),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Bth, FramePath, Packet};

    fn frame_to(port: u16) -> Vec<u8> {
        let path = FramePath {
            src_mac: [2, 0, 0, 0, 0, 1],
            dst_mac: [2, 0, 0, 0, 0, 2],
            src: "198.18.0.1".parse().unwrap(),
            dst: "198.18.0.2".parse().unwrap(),
            sport: 0xc001,
            ecn: 2,
            flow_label: 0,
        };
        let mut f = RoceFrame::new(&path, Packet::new(Bth::new(Opcode::SEND_ONLY, 0x11, 7)));
        f.udp.dport = port;
        f.finalize();
        f.to_bytes()
    }

    /// A capture rdmx writes names its port; the check uses it, and a
    /// check on 4791 sees no RoCEv2 at all.
    #[test]
    fn capture_notes_its_port() {
        let mut file = Vec::new();
        let mut w = CaptureWriter::new(&mut file, 5791).unwrap();
        w.write(Duration::from_micros(1), &frame_to(5791)).unwrap();
        drop(w);
        let cap = read_capture_file(&file[..]).unwrap();
        assert_eq!(cap.roce_port, Some(5791));
        assert_eq!(cap.frames.len(), 1);
        let s = check_on(&cap.frames, 5791);
        assert_eq!((s.ok.get(&Opcode::SEND_ONLY), s.bad.len()), (Some(&1), 0));
        assert_eq!(check(&cap.frames).not_roce, 1);
    }

    /// A truncated file names the frame and the byte offset where it breaks.
    #[test]
    fn truncation_names_frame_and_offset() {
        let mut file = Vec::new();
        let mut w = CaptureWriter::new(&mut file, 4791).unwrap();
        for i in 0..3 {
            w.write(Duration::from_micros(i), &frame_to(4791)).unwrap();
        }
        drop(w);
        let whole = read_capture_file(&file[..]).unwrap();
        assert_eq!(whole.frames.len(), 3);
        let cut = &file[..file.len() - 10];
        let e = read_capture_file(cut).unwrap_err();
        assert!(
            e.contains("after frame 2") && e.contains("byte offset"),
            "{e}"
        );
        // Classic pcap: the same for a record cut short.
        let mut classic = vec![0xd4, 0xc3, 0xb2, 0xa1, 2, 0, 4, 0];
        classic.extend_from_slice(&[0; 8]);
        classic.extend_from_slice(&65535u32.to_le_bytes());
        classic.extend_from_slice(&1u32.to_le_bytes());
        let f = frame_to(4791);
        for _ in 0..2 {
            classic.extend_from_slice(&[0; 8]);
            classic.extend_from_slice(&(f.len() as u32).to_le_bytes());
            classic.extend_from_slice(&(f.len() as u32).to_le_bytes());
            classic.extend_from_slice(&f);
        }
        assert_eq!(read_capture(&classic[..]).unwrap().len(), 2);
        let e = read_capture(&classic[..classic.len() - 5]).unwrap_err();
        let second = 24 + 16 + f.len();
        assert!(
            e.contains("frame 2") && e.contains(&format!("byte offset {second}")),
            "{e}"
        );
    }
}
