//! File namespaces with `O_DIRECT`: the kernel has the flag set, bytes written
//! from unaligned memory come back exact (through the backend, and in the
//! file itself read through the page cache), unaligned ranges are refused
//! with an error, and a namespace whose block size does not keep the
//! backend's alignment is refused.
//!
//! The files live under cargo's per-target temporary directory (on the disk
//! the build uses), not in `/tmp`, which may be a tmpfs.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use rdmx_block::backend::{Backend, FileBackend, FileOptions, RamBackend};
use rdmx_block::target::{Target, TargetConfig};

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rdmx-direct-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Bytes derived from their position and `seed`.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).rotate_left(7) as u8 ^ seed)
        .collect()
}

#[test]
fn direct_file_namespace_reads_what_was_written() {
    let dir = scratch("rw");
    let path = dir.join("ns.img");
    let direct = FileOptions { direct: true };
    let b = FileBackend::open_with(&path, Some(1 << 20), direct).unwrap();
    let align = b.direct().expect("opened for direct I/O");
    assert!(b.is_direct().unwrap(), "O_DIRECT is not set on the file");
    assert_eq!(b.block_align(), align.offset);
    assert!(b.describe().contains("O_DIRECT"), "{}", b.describe());
    let unit = 4096usize.max(align.offset as usize);

    // From memory one byte past an aligned address: copied once, written.
    let mut src = vec![0u8; 2 * unit + 1];
    src[1..].copy_from_slice(&pattern(3, 2 * unit));
    let data = &src[1..];
    b.write(unit as u64, data, false).unwrap();
    // From aligned memory (the read's own buffer): written as it is.
    let aligned = b.read(unit as u64, 2 * unit).unwrap();
    assert!(aligned[..] == *data, "direct read differs from the write");
    b.write(4 * unit as u64, &aligned, true).unwrap();
    assert!(b.read(4 * unit as u64, 2 * unit).unwrap()[..] == *data);

    // Write Zeroes over the second block of the first write.
    b.zero(2 * unit as u64, unit as u64, false).unwrap();
    let r = b.read(unit as u64, 2 * unit).unwrap();
    assert!(r[..unit] == data[..unit]);
    assert!(r[unit..].iter().all(|&x| x == 0), "zeroed block not zero");
    b.flush().unwrap();

    // Unaligned ranges: an error, no panic, nothing written.
    if align.offset > 1 {
        let odd = u64::from(align.offset) / 2;
        assert!(b.read(odd, unit).is_err());
        assert!(b.write(odd, &vec![9u8; unit], false).is_err());
        assert!(b.read(0, unit + 1).is_err());
    }
    drop(b);

    // The file itself, read through the page cache, holds the same bytes.
    let file = std::fs::read(&path).unwrap();
    assert_eq!(file.len(), 1 << 20);
    assert!(file[unit..2 * unit] == data[..unit]);
    assert!(file[2 * unit..3 * unit].iter().all(|&x| x == 0));
    assert!(file[4 * unit..6 * unit] == *data);
    assert!(file[..unit].iter().all(|&x| x == 0));

    // Opened again for direct I/O: the size comes from the file.
    let again = FileBackend::open_with(&path, None, direct).unwrap();
    assert_eq!(again.len(), 1 << 20);
    assert!(again.read(4 * unit as u64, 2 * unit).unwrap()[..] == *data);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn direct_file_of_unaligned_size_is_refused() {
    let dir = scratch("size");
    let path = dir.join("odd.img");
    std::fs::write(&path, vec![1u8; 4096 + 1]).unwrap();
    let e = FileBackend::open_with(&path, None, FileOptions { direct: true })
        .err()
        .expect("a 4097-byte file cannot be served by direct I/O");
    assert!(e.to_string().contains("alignment"), "{e}");
    // A size that would grow the file to an unaligned length is refused
    // before the file grows.
    let e = FileBackend::open_with(&path, Some(8192 + 7), FileOptions { direct: true })
        .err()
        .expect("an 8199-byte size cannot be served by direct I/O");
    assert!(e.to_string().contains("alignment"), "{e}");
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        4096 + 1,
        "the file grew"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A backend that asks for 4 KiB alignment (as direct I/O on a 4Kn disk
/// does), over memory.
struct Aligned4k(RamBackend);

impl Backend for Aligned4k {
    fn len(&self) -> u64 {
        self.0.len()
    }
    fn read(&self, offset: u64, len: usize) -> std::io::Result<Bytes> {
        self.0.read(offset, len)
    }
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> std::io::Result<()> {
        self.0.write(offset, data, fua)
    }
    fn flush(&self) -> std::io::Result<()> {
        self.0.flush()
    }
    fn zero(&self, offset: u64, len: u64, fua: bool) -> std::io::Result<()> {
        self.0.zero(offset, len, fua)
    }
    fn volatile(&self) -> bool {
        false
    }
    fn describe(&self) -> String {
        "ram, 4 KiB aligned".into()
    }
    fn block_align(&self) -> u32 {
        4096
    }
}

#[test]
fn a_block_size_below_the_backends_alignment_is_refused() {
    let small = Target::new(TargetConfig {
        lba_shift: 9,
        ..TargetConfig::default()
    });
    let e = small
        .add_namespace(Arc::new(Aligned4k(RamBackend::new(1 << 20).unwrap())))
        .unwrap_err();
    assert!(e.contains("4096-byte alignment"), "{e}");
    let large = Target::new(TargetConfig {
        lba_shift: 12,
        ..TargetConfig::default()
    });
    assert_eq!(
        large
            .add_namespace(Arc::new(Aligned4k(RamBackend::new(1 << 20).unwrap())))
            .unwrap(),
        1
    );
}
