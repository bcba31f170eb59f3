//! Where a namespace's blocks live: memory or a file.
//!
//! Backends are synchronous; the target runs file I/O on tokio's blocking
//! pool. Durability: a file namespace makes a write durable before it
//! completes when the command has FUA, and Flush syncs every completed write
//! (`fdatasync`), so data acknowledged after either survives a crash of the
//! target (NVMe Base 2.0 §6.7 Flush, NVM Command Set §3.2.6 FUA).
//!
//! A file namespace may bypass the page cache ([`FileOptions::direct`],
//! `O_DIRECT`), as SPDK's AIO bdev and the kernel's nvmet file backend with
//! `buffered_io=0` do: no second copy of the data in the host's memory, and
//! the device sees the writes when the host issues them. Direct I/O needs
//! the file offset, length and memory address aligned as the filesystem
//! reports (`statx` `STATX_DIOALIGN`, Linux 6.1); the namespace's block size
//! must be a multiple of the offset alignment ([`Backend::block_align`]), and
//! buffers are aligned here (a caller's unaligned bytes are copied once).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use bytes::Bytes;
use parking_lot::RwLock;

/// Storage behind a namespace. Offsets and lengths are in bytes and already
/// checked against [`Backend::len`] by the caller.
pub trait Backend: Send + Sync + 'static {
    /// Capacity in bytes.
    fn len(&self) -> u64;
    /// Whether the backend has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Read `len` bytes at `offset`.
    fn read(&self, offset: u64, len: usize) -> io::Result<Bytes>;
    /// Write `data` at `offset`; with `fua`, durably before returning.
    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()>;
    /// Make every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// Make `[offset, offset + len)` read as zeroes (Write Zeroes, deallocate).
    fn zero(&self, offset: u64, len: u64, fua: bool) -> io::Result<()>;
    /// Whether writes can be lost without a flush (the controller then reports
    /// a volatile write cache, and the host sends Flush and FUA).
    fn volatile(&self) -> bool;
    /// A short description for logs ("ram 1 GiB", "file /x").
    fn describe(&self) -> String;
    /// The granularity, in bytes, that every offset and length must keep
    /// (a namespace's block size must be a multiple of it): 1 unless the
    /// backend does direct I/O.
    fn block_align(&self) -> u32 {
        1
    }
}

/// A namespace in memory, lost when the process ends.
pub struct RamBackend {
    mem: RwLock<Vec<u8>>,
}

impl RamBackend {
    /// `len` bytes of zeroes (the pages are only touched when written).
    pub fn new(len: u64) -> io::Result<RamBackend> {
        let n = usize::try_from(len).map_err(|_| io::Error::other("size too large"))?;
        let mut v = Vec::new();
        v.try_reserve_exact(n)
            .map_err(|e| io::Error::new(io::ErrorKind::OutOfMemory, e.to_string()))?;
        v.resize(n, 0);
        Ok(RamBackend {
            mem: RwLock::new(v),
        })
    }
}

impl Backend for RamBackend {
    fn len(&self) -> u64 {
        self.mem.read().len() as u64
    }

    fn read(&self, offset: u64, len: usize) -> io::Result<Bytes> {
        let m = self.mem.read();
        let at = offset as usize;
        Ok(Bytes::copy_from_slice(&m[at..at + len]))
    }

    fn write(&self, offset: u64, data: &[u8], _fua: bool) -> io::Result<()> {
        let at = offset as usize;
        self.mem.write()[at..at + data.len()].copy_from_slice(data);
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    fn zero(&self, offset: u64, len: u64, _fua: bool) -> io::Result<()> {
        let at = offset as usize;
        self.mem.write()[at..at + len as usize].fill(0);
        Ok(())
    }

    fn volatile(&self) -> bool {
        false
    }

    fn describe(&self) -> String {
        format!("ram, {} bytes", self.len())
    }
}

/// A namespace in a file (or a block device), `len` bytes long.
pub struct FileBackend {
    file: File,
    len: u64,
    path: String,
    /// `O_DIRECT`'s alignment when the file was opened for direct I/O.
    direct: Option<DirectAlign>,
}

/// How [`FileBackend::open_with`] opens a file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FileOptions {
    /// Bypass the page cache (`O_DIRECT`).
    pub direct: bool,
}

/// What direct I/O on a file must keep aligned (`statx` `STATX_DIOALIGN`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectAlign {
    /// Alignment of the memory read into or written from.
    pub memory: usize,
    /// Alignment of file offsets and lengths.
    pub offset: u32,
}

impl FileBackend {
    /// Open `path`, creating it with `size` bytes if it does not exist; an
    /// existing file keeps its data and gives its size (unless `size` is
    /// given and larger, then it grows).
    pub fn open(path: &Path, size: Option<u64>) -> io::Result<FileBackend> {
        FileBackend::open_with(path, size, FileOptions::default())
    }

    /// [`FileBackend::open`] with options: with `direct`, the file is opened
    /// with `O_DIRECT`, and a filesystem that cannot do direct I/O is an
    /// error (rather than a namespace silently served through the cache).
    pub fn open_with(path: &Path, size: Option<u64>, opts: FileOptions) -> io::Result<FileBackend> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut o = std::fs::OpenOptions::new();
        o.read(true)
            .write(true)
            .create(size.is_some())
            .truncate(false);
        if opts.direct {
            o.custom_flags(rustix::fs::OFlags::DIRECT.bits() as i32);
        }
        let file = o.open(path).map_err(|e| {
            if opts.direct && e.kind() == io::ErrorKind::InvalidInput {
                io::Error::new(
                    e.kind(),
                    format!("{}: this filesystem refuses O_DIRECT ({e})", path.display()),
                )
            } else {
                e
            }
        })?;
        let direct = if opts.direct {
            Some(
                direct_align(&file)
                    .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))?,
            )
        } else {
            None
        };
        let mut len = file.metadata()?.len();
        let grow_to = size.filter(|&s| s > len);
        if let Some(s) = grow_to {
            len = s;
        }
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: empty; give a size to create it", path.display()),
            ));
        }
        // Checked before the file grows: a refused size leaves it as it was.
        if let Some(a) = direct {
            if len % u64::from(a.offset) != 0 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "{}: {len} bytes is not a multiple of the {}-byte direct I/O alignment",
                        path.display(),
                        a.offset
                    ),
                ));
            }
        }
        if let Some(s) = grow_to {
            file.set_len(s)?;
        }
        Ok(FileBackend {
            file,
            len,
            path: path.display().to_string(),
            direct,
        })
    }

    /// The direct I/O alignment, if the file was opened with `O_DIRECT`.
    pub fn direct(&self) -> Option<DirectAlign> {
        self.direct
    }

    /// Whether the kernel has `O_DIRECT` set on the open file (`F_GETFL`).
    pub fn is_direct(&self) -> io::Result<bool> {
        let flags = rustix::fs::fcntl_getfl(&self.file)?;
        Ok(flags.contains(rustix::fs::OFlags::DIRECT))
    }

    /// Refuse a direct I/O range that is not aligned (the target's block
    /// size keeps them aligned; this keeps a wrong caller from an `EINVAL`
    /// deep in the kernel).
    fn check_aligned(&self, offset: u64, len: u64) -> io::Result<()> {
        match self.direct {
            Some(a) if offset % u64::from(a.offset) != 0 || len % u64::from(a.offset) != 0 => {
                Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "direct I/O at {offset}+{len}: not aligned to {} bytes",
                        a.offset
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

/// The file's direct I/O alignment (`statx` with `STATX_DIOALIGN`).
fn direct_align(file: &File) -> io::Result<DirectAlign> {
    use rustix::fs::{statx, AtFlags, StatxFlags};
    let st = statx(file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN)?;
    let reported = StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::DIOALIGN);
    if !reported || st.stx_dio_offset_align == 0 || st.stx_dio_mem_align == 0 {
        return Err(io::Error::new(
            io::ErrorKind::Unsupported,
            "the kernel reports no direct I/O alignment for this file (direct I/O unsupported here)",
        ));
    }
    Ok(DirectAlign {
        memory: st.stx_dio_mem_align as usize,
        offset: st.stx_dio_offset_align,
    })
}

/// `len` bytes of zeroes starting at an `align`-aligned address: the vector
/// and the index where they start.
fn aligned_buffer(len: usize, align: usize) -> (Vec<u8>, usize) {
    let v = vec![0u8; len + align];
    let start = v.as_ptr().align_offset(align);
    (v, start)
}

impl Backend for FileBackend {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, len: usize) -> io::Result<Bytes> {
        let Some(a) = self.direct else {
            let mut buf = vec![0u8; len];
            self.file.read_exact_at(&mut buf, offset)?;
            return Ok(Bytes::from(buf));
        };
        self.check_aligned(offset, len as u64)?;
        let (mut buf, start) = aligned_buffer(len, a.memory);
        self.file
            .read_exact_at(&mut buf[start..start + len], offset)?;
        Ok(Bytes::from(buf).slice(start..start + len))
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.check_aligned(offset, data.len() as u64)?;
        match self.direct {
            Some(a) if data.as_ptr().align_offset(a.memory) != 0 => {
                let (mut buf, start) = aligned_buffer(data.len(), a.memory);
                buf[start..start + data.len()].copy_from_slice(data);
                self.file
                    .write_all_at(&buf[start..start + data.len()], offset)?;
            }
            _ => self.file.write_all_at(data, offset)?,
        }
        if fua {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn zero(&self, offset: u64, len: u64, fua: bool) -> io::Result<()> {
        use rustix::fs::{fallocate, FallocateFlags};
        let punched = fallocate(
            &self.file,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            offset,
            len,
        );
        if punched.is_err() {
            // No hole punching here (some filesystems, block devices): write zeroes.
            const CHUNK: u64 = 1 << 20;
            self.check_aligned(offset, len)?;
            let align = self.direct.map_or(1, |a| a.memory);
            let (zeros, start) = aligned_buffer(CHUNK.min(len) as usize, align);
            let zeros = &zeros[start..];
            let mut at = 0;
            while at < len {
                let n = CHUNK.min(len - at) as usize;
                self.file.write_all_at(&zeros[..n], offset + at)?;
                at += n as u64;
            }
        }
        if fua {
            self.file.sync_data()?;
        }
        Ok(())
    }

    fn volatile(&self) -> bool {
        true
    }

    fn describe(&self) -> String {
        match self.direct {
            Some(a) => format!(
                "file {}, {} bytes, O_DIRECT ({}-byte offsets, {}-byte memory)",
                self.path, self.len, a.offset, a.memory
            ),
            None => format!("file {}, {} bytes", self.path, self.len),
        }
    }

    fn block_align(&self) -> u32 {
        self.direct.map_or(1, |a| a.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exercise(b: &dyn Backend) {
        b.write(4096, &[7u8; 8192], false).unwrap();
        assert_eq!(&b.read(4096, 8192).unwrap()[..], &[7u8; 8192][..]);
        b.zero(4096 + 4096, 4096, true).unwrap();
        let r = b.read(4096, 8192).unwrap();
        assert!(r[..4096].iter().all(|&x| x == 7));
        assert!(r[4096..].iter().all(|&x| x == 0));
        b.flush().unwrap();
    }

    #[test]
    fn ram_reads_what_was_written_and_zeroes() {
        exercise(&RamBackend::new(1 << 20).unwrap());
    }

    #[test]
    fn file_reads_what_was_written_and_keeps_it() {
        let dir = std::env::temp_dir().join(format!("rdmx-block-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ns.img");
        let _ = std::fs::remove_file(&path);
        exercise(&FileBackend::open(&path, Some(1 << 20)).unwrap());
        let again = FileBackend::open(&path, None).unwrap();
        assert_eq!(again.len(), 1 << 20);
        assert_eq!(&again.read(4096, 16).unwrap()[..], &[7u8; 16][..]);
        assert!(FileBackend::open(&dir.join("missing"), None).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
