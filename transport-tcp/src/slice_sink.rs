//! A read's destination in the caller's registered memory
//! (`Connection::read_into`): the connection's reader receives the answer
//! from its socket straight into the slice, one non-blocking socket read at a
//! time under the region's lock, with no buffer in between (a read into a
//! pooled buffer and a copy into the slice cost a second pass over every
//! byte).
//!
//! The caller's guarantee, as for an RDMA READ into a registered buffer:
//! while the read is in flight the slice's bytes are unspecified; once its
//! operation has completed, failed or been dropped, nothing lands in the
//! slice again. The reader receives each part under the sink's lock and
//! looks at `closed` first; closing takes the same lock, so it waits for a
//! socket read in progress and every later one goes to scratch (the bytes
//! are still consumed from the stream, which stays in step).

use std::io;
use std::sync::Arc;

use parking_lot::Mutex;
use rdmx_core::LocalSlice;

/// Most bytes taken from the socket per read once they go to scratch.
const SCRATCH_CHUNK: usize = 64 << 10;

/// Where one read's answer goes (see the module doc).
#[derive(Debug)]
pub(crate) struct SliceSink {
    slice: LocalSlice,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// The read's operation is over: no byte may land in the slice.
    closed: bool,
    /// The slice's region was deregistered while the answer came.
    revoked: bool,
}

impl SliceSink {
    /// A sink for a read of `slice.len()` bytes into `slice`.
    pub(crate) fn new(slice: LocalSlice) -> Arc<SliceSink> {
        Arc::new(SliceSink {
            slice,
            state: Mutex::default(),
        })
    }

    /// The read's length.
    pub(crate) fn len(&self) -> usize {
        self.slice.len()
    }

    /// Run `read` on bytes `at..at + len` of the slice (it returns how many it
    /// filled), or, once the sink is closed or its region gone, on a scratch
    /// buffer whose bytes are dropped.
    pub(crate) fn receive(
        &self,
        at: usize,
        len: usize,
        scratch: &mut Vec<u8>,
        read: impl FnOnce(&mut [u8]) -> io::Result<usize>,
    ) -> io::Result<usize> {
        let mut state = self.state.lock();
        let mut read = Some(read);
        if !state.closed && !state.revoked {
            let into_slice = self.slice.fill_with(at, len, |dst| {
                let read = read.take().expect("called once");
                read(dst)
            });
            match into_slice {
                Ok(n) => return n,
                Err(_) => state.revoked = true,
            }
        }
        scratch.resize(len.clamp(1, SCRATCH_CHUNK), 0);
        let read = read.take().expect("not called yet");
        read(&mut scratch[..])
    }

    /// Copy `data` (bytes of the answer that came buffered with earlier
    /// frames) in at `at`, unless the sink is closed or its region gone.
    pub(crate) fn put(&self, at: usize, data: &[u8]) {
        let mut state = self.state.lock();
        if state.closed || state.revoked {
            return;
        }
        let copied = self
            .slice
            .fill_with(at, data.len(), |dst| dst.copy_from_slice(data));
        if copied.is_err() {
            state.revoked = true;
        }
    }

    /// The read's operation is over: once this returns, nothing lands in
    /// the slice.
    pub(crate) fn close(&self) {
        self.state.lock().closed = true;
    }

    /// Whether the slice's region was found deregistered (the read failed).
    pub(crate) fn revoked(&self) -> bool {
        self.state.lock().revoked
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdmx_core::{Access, Domain};

    #[test]
    fn parts_land_in_place_until_closed_then_go_to_scratch() {
        let d = Domain::new();
        let mr = d.register(16, Access::ALL);
        let sink = SliceSink::new(mr.slice(4, 8).unwrap());
        assert_eq!(sink.len(), 8);
        let mut scratch = Vec::new();
        let n = sink
            .receive(0, 8, &mut scratch, |dst| {
                assert_eq!(dst.len(), 8, "the rest of the slice");
                dst[..3].copy_from_slice(b"abc");
                Ok(3)
            })
            .unwrap();
        assert_eq!(n, 3);
        sink.put(3, b"de");
        sink.receive(5, 3, &mut scratch, |dst| {
            dst.copy_from_slice(b"fgh");
            Ok(3)
        })
        .unwrap();
        assert_eq!(&mr.read()[4..12], b"abcdefgh");
        // Dropped: the bytes still come off the socket, but not into memory.
        sink.close();
        let n = sink
            .receive(0, 8, &mut scratch, |dst| {
                dst.fill(b'!');
                Ok(dst.len())
            })
            .unwrap();
        assert_eq!(n, 8);
        sink.put(0, b"XY");
        assert_eq!(&mr.read()[..], b"\0\0\0\0abcdefgh\0\0\0\0");
        assert!(!sink.revoked());
    }

    #[test]
    fn a_deregistered_region_fails_the_read_and_is_not_written() {
        let d = Domain::new();
        let mr = d.register(8, Access::ALL);
        let sink = SliceSink::new(mr.slice(0, 8).unwrap());
        drop(mr);
        let mut scratch = Vec::new();
        let n = sink
            .receive(0, 8, &mut scratch, |dst| {
                dst.fill(1);
                Ok(dst.len())
            })
            .unwrap();
        assert_eq!(n, 8, "consumed into scratch");
        assert!(sink.revoked());
    }

    #[test]
    fn socket_errors_pass_through() {
        let d = Domain::new();
        let mr = d.register(8, Access::ALL);
        let sink = SliceSink::new(mr.slice(0, 8).unwrap());
        let e = sink
            .receive(0, 8, &mut Vec::new(), |_| {
                Err(io::Error::from(io::ErrorKind::WouldBlock))
            })
            .unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
    }
}
