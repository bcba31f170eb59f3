//! Submission and completion queue entries (NVMe Base 2.0 §4.2, §4.6) and
//! the SGL descriptor (§4.4), little-endian as on the wire.

use bytes::{BufMut, Bytes, BytesMut};

use super::status::Status;

/// Size of a submission queue entry.
pub const SQE_LEN: usize = 64;
/// Size of a completion queue entry.
pub const CQE_LEN: usize = 16;

/// Admin command opcodes (NVMe Base 2.0 Figure 139).
pub mod admin {
    /// Get Log Page.
    pub const GET_LOG_PAGE: u8 = 0x02;
    /// Identify.
    pub const IDENTIFY: u8 = 0x06;
    /// Abort.
    pub const ABORT: u8 = 0x08;
    /// Set Features.
    pub const SET_FEATURES: u8 = 0x09;
    /// Get Features.
    pub const GET_FEATURES: u8 = 0x0A;
    /// Asynchronous Event Request.
    pub const ASYNC_EVENT: u8 = 0x0C;
    /// Keep Alive.
    pub const KEEP_ALIVE: u8 = 0x18;
}

/// NVM command set I/O opcodes (NVM Command Set 1.0 Figure 18).
pub mod io {
    /// Flush.
    pub const FLUSH: u8 = 0x00;
    /// Write.
    pub const WRITE: u8 = 0x01;
    /// Read.
    pub const READ: u8 = 0x02;
    /// Write Zeroes.
    pub const WRITE_ZEROES: u8 = 0x08;
    /// Dataset Management.
    pub const DSM: u8 = 0x09;
}

/// The Fabrics command opcode and its command types (NVMe-oF 1.1 §3).
pub mod fabrics {
    /// Opcode of every Fabrics command.
    pub const OPCODE: u8 = 0x7F;
    /// Property Set.
    pub const PROPERTY_SET: u8 = 0x00;
    /// Connect.
    pub const CONNECT: u8 = 0x01;
    /// Property Get.
    pub const PROPERTY_GET: u8 = 0x04;
    /// Authentication Send.
    pub const AUTH_SEND: u8 = 0x05;
    /// Authentication Receive.
    pub const AUTH_RECV: u8 = 0x06;
    /// Disconnect.
    pub const DISCONNECT: u8 = 0x08;
}

/// SGL descriptor identifiers (byte 15) the NVMe/TCP and RDMA hosts send.
pub mod sgl {
    /// Data Block, subtype Offset: in-capsule data.
    pub const DATA_BLOCK_OFFSET: u8 = 0x01;
    /// Transport SGL Data Block: data moves by C2HData or R2T/H2CData.
    pub const TRANSPORT_DATA_BLOCK: u8 = 0x5A;
    /// Keyed Data Block, subtype Address (RDMA).
    pub const KEYED_ADDRESS: u8 = 0x40;
    /// Keyed Data Block, subtype Invalidate Key (RDMA).
    pub const KEYED_INVALIDATE: u8 = 0x4F;
}

/// Which way a command's data moves (the opcode's two low bits, NVMe Base
/// 2.0 §5 "data transfer" field).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    /// No data.
    None,
    /// Host to controller (writes).
    HostToController,
    /// Controller to host (reads).
    ControllerToHost,
}

/// An SGL descriptor (NVMe Base 2.0 §4.4).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sgl {
    /// Address (in-capsule: offset into the capsule's data).
    pub addr: u64,
    /// Length in bytes (24 bits for keyed descriptors).
    pub len: u32,
    /// Key (keyed descriptors only).
    pub key: u32,
    /// Descriptor type and subtype (byte 15).
    pub id: u8,
}

impl Sgl {
    /// Decode the 16 bytes of SGL1.
    pub fn parse(b: &[u8; 16]) -> Sgl {
        let id = b[15];
        let addr = u64::from_le_bytes(b[0..8].try_into().expect("8"));
        if id >> 4 == 0x4 {
            // Keyed: 24-bit length, 32-bit key.
            Sgl {
                addr,
                len: u32::from_le_bytes([b[8], b[9], b[10], 0]),
                key: u32::from_le_bytes(b[11..15].try_into().expect("4")),
                id,
            }
        } else {
            Sgl {
                addr,
                len: u32::from_le_bytes(b[8..12].try_into().expect("4")),
                key: 0,
                id,
            }
        }
    }

    /// Encode as 16 bytes.
    pub fn encode(&self) -> [u8; 16] {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        if self.id >> 4 == 0x4 {
            b[8..11].copy_from_slice(&self.len.to_le_bytes()[..3]);
            b[11..15].copy_from_slice(&self.key.to_le_bytes());
        } else {
            b[8..12].copy_from_slice(&self.len.to_le_bytes());
        }
        b[15] = self.id;
        b
    }
}

/// A submission queue entry (64 bytes).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sqe {
    /// Opcode (CDW0 7:0).
    pub opcode: u8,
    /// CDW0 15:8: FUSE (1:0) and PSDT (7:6).
    pub flags: u8,
    /// Command identifier.
    pub cid: u16,
    /// Namespace identifier (CDW1; Fabrics commands keep FCTYPE in its low byte).
    pub nsid: u32,
    /// CDW2 and CDW3.
    pub cdw2: u32,
    /// CDW3.
    pub cdw3: u32,
    /// Metadata pointer (CDW4-5).
    pub mptr: u64,
    /// Data pointer, SGL1 (CDW6-9).
    pub sgl: Sgl,
    /// CDW10 to CDW15.
    pub cdw: [u32; 6],
}

impl Sqe {
    /// Decode 64 bytes.
    pub fn parse(b: &[u8; SQE_LEN]) -> Sqe {
        let dw = |i: usize| u32::from_le_bytes(b[i * 4..i * 4 + 4].try_into().expect("4"));
        Sqe {
            opcode: b[0],
            flags: b[1],
            cid: u16::from_le_bytes([b[2], b[3]]),
            nsid: dw(1),
            cdw2: dw(2),
            cdw3: dw(3),
            mptr: u64::from_le_bytes(b[16..24].try_into().expect("8")),
            sgl: Sgl::parse(b[24..40].try_into().expect("16")),
            cdw: [dw(10), dw(11), dw(12), dw(13), dw(14), dw(15)],
        }
    }

    /// Encode as 64 bytes.
    pub fn encode(&self) -> [u8; SQE_LEN] {
        let mut b = [0u8; SQE_LEN];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.cid.to_le_bytes());
        b[4..8].copy_from_slice(&self.nsid.to_le_bytes());
        b[8..12].copy_from_slice(&self.cdw2.to_le_bytes());
        b[12..16].copy_from_slice(&self.cdw3.to_le_bytes());
        b[16..24].copy_from_slice(&self.mptr.to_le_bytes());
        b[24..40].copy_from_slice(&self.sgl.encode());
        for (i, d) in self.cdw.iter().enumerate() {
            b[40 + i * 4..44 + i * 4].copy_from_slice(&d.to_le_bytes());
        }
        b
    }

    /// CDW10..CDW15 by number (10 to 15).
    pub fn dw(&self, n: usize) -> u32 {
        self.cdw[n - 10]
    }

    /// The Fabrics command type (SQE byte 4), for opcode 0x7F.
    pub fn fctype(&self) -> u8 {
        self.nsid as u8
    }

    /// Whether this is a Fabrics command.
    pub fn is_fabrics(&self) -> bool {
        self.opcode == fabrics::OPCODE
    }

    /// The direction of its data. Fabrics Connect carries its data in the
    /// capsule; other Fabrics commands move none.
    pub fn direction(&self) -> Direction {
        if self.is_fabrics() {
            return if self.fctype() == fabrics::CONNECT {
                Direction::HostToController
            } else {
                Direction::None
            };
        }
        match self.opcode & 3 {
            1 => Direction::HostToController,
            2 => Direction::ControllerToHost,
            _ => Direction::None,
        }
    }

    /// Bytes of data the host describes in SGL1.
    pub fn data_len(&self) -> u32 {
        self.sgl.len
    }

    /// Starting LBA of a Read/Write/Write Zeroes (CDW10-11).
    pub fn slba(&self) -> u64 {
        u64::from(self.cdw[0]) | u64::from(self.cdw[1]) << 32
    }

    /// Number of logical blocks (CDW12 15:0 is 0's based).
    pub fn nlb(&self) -> u32 {
        (self.cdw[2] & 0xFFFF) + 1
    }

    /// Force Unit Access (CDW12 bit 30).
    pub fn fua(&self) -> bool {
        self.cdw[2] & 1 << 30 != 0
    }
}

/// A completion: what a command returns (NVMe Base 2.0 §4.6), plus the data
/// the controller sends back to the host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    /// Command specific DW0.
    pub dw0: u32,
    /// Command specific DW1.
    pub dw1: u32,
    /// Status.
    pub status: Status,
    /// Controller-to-host data (reads, Identify, logs).
    pub data: Bytes,
}

impl Completion {
    /// Success with no result.
    pub fn ok() -> Completion {
        Completion::default()
    }

    /// Success with data.
    pub fn with_data(data: Bytes) -> Completion {
        Completion {
            data,
            ..Completion::default()
        }
    }

    /// Success with DW0.
    pub fn dw0(dw0: u32) -> Completion {
        Completion {
            dw0,
            ..Completion::default()
        }
    }

    /// A failure.
    pub fn error(status: Status) -> Completion {
        Completion {
            status,
            ..Completion::default()
        }
    }

    /// The 16-byte CQE for command `cid` at SQ head `sqhd` on queue `sqid`.
    pub fn cqe(&self, sqhd: u16, sqid: u16, cid: u16) -> [u8; CQE_LEN] {
        let mut b = BytesMut::with_capacity(CQE_LEN);
        b.put_u32_le(self.dw0);
        b.put_u32_le(self.dw1);
        b.put_u16_le(sqhd);
        b.put_u16_le(sqid);
        b.put_u16_le(cid);
        // Status field bits 15:1; the phase bit means nothing on fabrics.
        b.put_u16_le(self.status.word() << 1);
        b[..].try_into().expect("16 bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 4 KiB read capsule of the reference's worked example (§6.3).
    #[test]
    fn read_capsule_decodes() {
        let mut b = [0u8; 64];
        b[..4].copy_from_slice(&[0x02, 0x40, 0x05, 0x10]);
        b[4] = 1;
        b[33] = 0x10;
        b[39] = 0x5a;
        b[48] = 7;
        let s = Sqe::parse(&b);
        assert_eq!((s.opcode, s.cid, s.nsid), (io::READ, 0x1005, 1));
        assert_eq!(s.sgl.id, sgl::TRANSPORT_DATA_BLOCK);
        assert_eq!((s.data_len(), s.slba(), s.nlb()), (4096, 0, 8));
        assert_eq!(s.direction(), Direction::ControllerToHost);
        assert_eq!(s.encode(), b);
    }

    #[test]
    fn keyed_sgl_has_a_24_bit_length_and_a_key() {
        let s = Sgl {
            addr: 0x1122_3344_5566_7788,
            len: 0xABCDEF,
            key: 0xDEAD_BEEF,
            id: sgl::KEYED_INVALIDATE,
        };
        let b = s.encode();
        assert_eq!(&b[8..11], &[0xEF, 0xCD, 0xAB]);
        assert_eq!(Sgl::parse(&b), s);
    }

    #[test]
    fn cqe_matches_the_reference() {
        // CapsuleResp of §6.3: SQHD 2, SQID 1, CID 0x1005, status 0.
        let c = Completion::ok().cqe(2, 1, 0x1005);
        assert_eq!(c, [0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 1, 0, 5, 0x10, 0, 0]);
        let e = Completion::error(Status::LBA_OUT_OF_RANGE).cqe(0, 1, 1);
        assert_eq!(u16::from_le_bytes([e[14], e[15]]), 0x8100);
    }
}
