//! Where a namespace's blocks live: memory or a file.
//!
//! Backends are synchronous; the target runs file I/O on tokio's blocking
//! pool. Durability: a file namespace makes a write durable before it
//! completes when the command has FUA, and Flush syncs every completed write
//! (`fdatasync`), so data acknowledged after either survives a crash of the
//! target (NVMe Base 2.0 §6.7 Flush, NVM Command Set §3.2.6 FUA).

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
}

impl FileBackend {
    /// Open `path`, creating it with `size` bytes if it does not exist; an
    /// existing file keeps its data and gives its size (unless `size` is
    /// given and larger, then it grows).
    pub fn open(path: &Path, size: Option<u64>) -> io::Result<FileBackend> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(size.is_some())
            .truncate(false)
            .open(path)?;
        let mut len = file.metadata()?.len();
        if let Some(s) = size {
            if s > len {
                file.set_len(s)?;
                len = s;
            }
        }
        if len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{}: empty; give a size to create it", path.display()),
            ));
        }
        Ok(FileBackend {
            file,
            len,
            path: path.display().to_string(),
        })
    }
}

impl Backend for FileBackend {
    fn len(&self) -> u64 {
        self.len
    }

    fn read(&self, offset: u64, len: usize) -> io::Result<Bytes> {
        let mut buf = vec![0u8; len];
        self.file.read_exact_at(&mut buf, offset)?;
        Ok(Bytes::from(buf))
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> io::Result<()> {
        self.file.write_all_at(data, offset)?;
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
            let zeros = vec![0u8; CHUNK.min(len) as usize];
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
        format!("file {}, {} bytes", self.path, self.len)
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
