//! Identify data structures (NVMe Base 2.0 §5.17.2) and the log pages the
//! Linux host and nvme-cli read (§5.16.1), built as the 6.1 host checks them
//! (the reference's interop checklist, §0 and §4.3 to §4.9).

use bytes::{BufMut, Bytes, BytesMut};

/// Size of every Identify data structure.
pub const IDENTIFY_LEN: usize = 4096;

/// The NVMe version the target reports (1.3: the host requires CNS 03h).
pub const VERSION: u32 = 0x0001_0300;
/// MDTS: 2^8 × 4 KiB = 1 MiB per command.
pub const MDTS: u8 = 8;
/// Largest transfer of one command, from MDTS.
pub const MAX_TRANSFER: u32 = 4096 << MDTS;
/// I/O capsule size in 16-byte units: the 64-byte SQE and 8 KiB in-capsule.
pub const IOCCSZ: u32 = (64 + 8192) / 16;
/// In-capsule data accepted on any queue.
pub const MAX_IN_CAPSULE: u32 = IOCCSZ * 16 - 64;
/// Maximum outstanding commands per queue (MAXCMD and CAP.MQES + 1).
pub const MAX_CMD: u16 = 128;
/// Asynchronous Event Requests kept at once (AERL, 0's based).
pub const AERL: u8 = 3;

/// What Identify Controller says about a controller.
#[derive(Clone, Debug)]
pub struct ControllerInfo {
    /// Controller ID (equals the Connect result).
    pub cntlid: u16,
    /// Serial number (ASCII, at most 20).
    pub serial: String,
    /// Model (ASCII, at most 40).
    pub model: String,
    /// Firmware revision (ASCII, at most 8).
    pub firmware: String,
    /// Subsystem NQN.
    pub subnqn: String,
    /// Highest namespace ID.
    pub nn: u32,
    /// A discovery controller (CNTRLTYPE 2) rather than an I/O one.
    pub discovery: bool,
    /// Volatile write cache present: the host sends Flush and FUA.
    pub volatile_cache: bool,
}

fn put_ascii(b: &mut [u8], s: &str) {
    b.fill(b' ');
    let n = s.len().min(b.len());
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
}

fn put_nqn(b: &mut [u8], s: &str) {
    b.fill(0);
    let n = s.len().min(b.len() - 1);
    b[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// Identify Controller (CNS 01h), NVMe Base 2.0 Figure 275; offsets per the
/// reference §4.3.
pub fn controller(c: &ControllerInfo) -> Bytes {
    let mut b = vec![0u8; IDENTIFY_LEN];
    put_ascii(&mut b[4..24], &c.serial);
    put_ascii(&mut b[24..64], &c.model);
    put_ascii(&mut b[64..72], &c.firmware);
    b[72] = 6; // RAB
    b[76] = if c.discovery { 0 } else { 0x02 }; // CMIC: several controllers
    b[77] = MDTS;
    b[78..80].copy_from_slice(&c.cntlid.to_le_bytes());
    b[80..84].copy_from_slice(&VERSION.to_le_bytes());
    // OAES 0: no events, so the 6.1 host sends no AEC Set Features.
    // CTRATT: bit 0 128-bit host ID; bit 6 TBKAS, Traffic Based Keep Alive
    // (every command restarts the keep-alive timer, see target.rs).
    b[96..100].copy_from_slice(&(1u32 | 1 << 6).to_le_bytes());
    b[111] = if c.discovery { 2 } else { 1 }; // CNTRLTYPE
    b[258] = 3; // ACL
    b[259] = AERL;
    b[260] = 0x03; // FRMW: slot 1 read-only, one slot
    b[261] = 0x04; // LPA: extended Get Log Page
    b[262] = 0; // ELPE: one error log entry
    b[320..322].copy_from_slice(&10u16.to_le_bytes()); // KAS: 1 s
    b[512] = 0x66; // SQES
    b[513] = 0x44; // CQES
    b[514..516].copy_from_slice(&MAX_CMD.to_le_bytes());
    b[516..520].copy_from_slice(&c.nn.to_le_bytes());
    if !c.discovery {
        b[520..522].copy_from_slice(&0x000Cu16.to_le_bytes()); // ONCS: DSM, Write Zeroes
        b[525] = u8::from(c.volatile_cache); // VWC
    }
    b[536..540].copy_from_slice(&0x0010_0001u32.to_le_bytes()); // SGLS
    put_nqn(&mut b[768..1024], &c.subnqn);
    b[1792..1796].copy_from_slice(&IOCCSZ.to_le_bytes());
    b[1796..1800].copy_from_slice(&1u32.to_le_bytes()); // IORCSZ
                                                        // ICDOFF 0, FCATT 0 (dynamic controllers)
    b[1803] = 1; // MSDBD
    Bytes::from(b)
}

/// What Identify Namespace says about a namespace.
#[derive(Clone, Copy, Debug)]
pub struct NamespaceInfo {
    /// Size in logical blocks.
    pub blocks: u64,
    /// log2 of the block size (9 or 12).
    pub lba_shift: u8,
    /// Namespace Globally Unique Identifier, stable across restarts.
    pub nguid: [u8; 16],
    /// Shared by several controllers (NMIC bit 0).
    pub shared: bool,
}

/// Identify Namespace (CNS 00h), NVM Command Set 1.0 Figure 97.
pub fn namespace(n: &NamespaceInfo) -> Bytes {
    let mut b = vec![0u8; IDENTIFY_LEN];
    for off in [0, 8, 16] {
        // NSZE, NCAP, NUSE (NCAP 0 would make the host drop the namespace)
        b[off..off + 8].copy_from_slice(&n.blocks.to_le_bytes());
    }
    b[25] = 0; // NLBAF: one format
    b[26] = 0; // FLBAS: format 0, no metadata
    b[30] = u8::from(n.shared); // NMIC
    b[33] = 0x01; // DLFEAT: deallocated blocks read as zeroes
    b[104..120].copy_from_slice(&n.nguid);
    // LBAF0: MS 0, LBADS, RP 0
    b[130] = n.lba_shift;
    Bytes::from(b)
}

/// Active Namespace ID list (CNS 02h): the IDs above `after`, ascending.
pub fn active_namespaces(ids: impl Iterator<Item = u32>, after: u32) -> Bytes {
    let mut b = BytesMut::zeroed(IDENTIFY_LEN);
    let mut at = 0;
    for id in ids.filter(|&id| id > after).take(IDENTIFY_LEN / 4) {
        b[at..at + 4].copy_from_slice(&id.to_le_bytes());
        at += 4;
    }
    b.freeze()
}

/// Namespace Identification Descriptor list (CNS 03h): NGUID and the
/// command set (NVM), then the terminating zero descriptor.
pub fn namespace_descriptors(nguid: &[u8; 16]) -> Bytes {
    let mut b = BytesMut::with_capacity(IDENTIFY_LEN);
    b.put_slice(&[2, 16, 0, 0]); // NIDT 2 NGUID, NIDL 16
    b.put_slice(nguid);
    b.put_slice(&[4, 1, 0, 0, 0]); // NIDT 4 CSI, NIDL 1, NVM
    b.resize(IDENTIFY_LEN, 0);
    b.freeze()
}

/// The discovery NQN (NVMe-oF 1.1 §7.2).
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// One entry of the discovery log: an NVMe/TCP port of a subsystem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveryEntry {
    /// Subsystem NQN.
    pub subnqn: String,
    /// Transport address (ASCII IP).
    pub traddr: String,
    /// Transport service (ASCII port).
    pub trsvcid: String,
    /// IPv6 rather than IPv4.
    pub ipv6: bool,
    /// Port ID.
    pub portid: u16,
    /// Subsystem type: 2 NVM subsystem, 3 this discovery subsystem.
    pub subtype: u8,
}

/// The discovery log page (LID 70h, NVMe-oF 1.1 Figure 19 and 20): a
/// 1024-byte header, then 1024 bytes per entry.
pub fn discovery_log(genctr: u64, entries: &[DiscoveryEntry]) -> Bytes {
    let mut b = vec![0u8; 1024 * (entries.len() + 1)];
    b[0..8].copy_from_slice(&genctr.to_le_bytes());
    b[8..16].copy_from_slice(&(entries.len() as u64).to_le_bytes());
    for (i, e) in entries.iter().enumerate() {
        let r = &mut b[1024 * (i + 1)..1024 * (i + 2)];
        r[0] = 3; // TRTYPE TCP
        r[1] = if e.ipv6 { 2 } else { 1 };
        r[2] = e.subtype;
        r[3] = 0; // TREQ: secure channel not specified (libnvme 1.3)
        r[4..6].copy_from_slice(&e.portid.to_le_bytes());
        r[6..8].copy_from_slice(&0xFFFFu16.to_le_bytes()); // dynamic CNTLID
        r[8..10].copy_from_slice(&32u16.to_le_bytes()); // ASQSZ
        put_nqn(&mut r[32..64], &e.trsvcid);
        put_nqn(&mut r[256..512], &e.subnqn);
        put_nqn(&mut r[512..768], &e.traddr);
        // TSAS: SECTYPE 0, none
    }
    Bytes::from(b)
}

/// Commands Supported and Effects (LID 05h): CSUPP for what this target
/// runs, and LBCC (logical block content change) for writes.
pub fn command_effects(admin_ops: &[u8], io_ops: &[(u8, bool)]) -> Bytes {
    let mut b = vec![0u8; 4096];
    for &op in admin_ops {
        b[usize::from(op) * 4] = 1;
    }
    for &(op, changes) in io_ops {
        b[1024 + usize::from(op) * 4] = 1 | u8::from(changes) << 1;
    }
    Bytes::from(b)
}

/// SMART / Health Information (LID 02h): the data units (thousands of
/// 512-byte units, rounded up) and commands read and written.
pub fn smart_log(bytes_read: u64, bytes_written: u64, reads: u64, writes: u64) -> Bytes {
    let mut b = vec![0u8; 512];
    // Composite temperature: 0 K reads badly, report 300 K (27 °C): there is
    // no sensor, and hwmon only needs a number.
    b[1..3].copy_from_slice(&300u16.to_le_bytes());
    b[3] = 100; // available spare
    b[4] = 10; // spare threshold
    let units = |bytes: u64| bytes.div_ceil(512 * 1000) as u128;
    b[32..48].copy_from_slice(&units(bytes_read).to_le_bytes());
    b[48..64].copy_from_slice(&units(bytes_written).to_le_bytes());
    b[64..80].copy_from_slice(&u128::from(reads).to_le_bytes());
    b[80..96].copy_from_slice(&u128::from(writes).to_le_bytes());
    Bytes::from(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn controller_fields_sit_where_the_host_reads_them() {
        let b = controller(&ControllerInfo {
            cntlid: 7,
            serial: "rdmx0001".into(),
            model: "rdmx".into(),
            firmware: "0.1.0".into(),
            subnqn: "nqn.2026-11.io.rdmx:t".into(),
            nn: 1,
            discovery: false,
            volatile_cache: true,
        });
        assert_eq!(&b[4..12], b"rdmx0001");
        assert_eq!(b[23], b' ');
        assert_eq!(u16::from_le_bytes([b[78], b[79]]), 7);
        assert_eq!(b[111], 1);
        assert_ne!(u16::from_le_bytes([b[320], b[321]]), 0, "KAS");
        assert_eq!(u32::from_le_bytes(b[1792..1796].try_into().unwrap()), 516);
        assert_eq!(u16::from_le_bytes([b[1800], b[1801]]), 0, "ICDOFF");
        assert_eq!(&b[768..789], b"nqn.2026-11.io.rdmx:t");
        assert_eq!(b[789], 0);
        assert_eq!(MAX_IN_CAPSULE, 8192);
        assert_eq!(MAX_TRANSFER, 1 << 20);
    }

    #[test]
    fn namespace_list_and_descriptors() {
        let l = active_namespaces([1u32, 2, 5].into_iter(), 1);
        assert_eq!(&l[..12], &[2, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0]);
        let d = namespace_descriptors(&[9; 16]);
        assert_eq!(&d[..4], &[2, 16, 0, 0]);
        assert_eq!(&d[20..25], &[4, 1, 0, 0, 0]);
        assert!(d[25..].iter().all(|&x| x == 0));
    }

    #[test]
    fn discovery_log_layout() {
        let e = DiscoveryEntry {
            subnqn: "nqn.x".into(),
            traddr: "198.18.0.1".into(),
            trsvcid: "4420".into(),
            ipv6: false,
            portid: 1,
            subtype: 2,
        };
        let b = discovery_log(5, &[e]);
        assert_eq!(b.len(), 2048);
        assert_eq!(u64::from_le_bytes(b[8..16].try_into().unwrap()), 1);
        assert_eq!(&b[1024..1027], &[3, 1, 2]);
        assert_eq!(&b[1024 + 32..1024 + 37], b"4420\0");
        assert_eq!(&b[1024 + 512..1024 + 522], b"198.18.0.1");
    }
}
