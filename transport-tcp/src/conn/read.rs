//! The read side of a connection: the reader task, which reads frames
//! (payloads straight into a registered region or a read's sink where it
//! can), serves the peer's requests on this side's memory, completes ours,
//! and delivers messages.

use super::*;

/// How much room a socket read of frames gets, by the size of the last
/// frame (the next is most likely like it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReadRoom {
    /// Grow the buffer first if it has less room than this.
    min: usize,
    /// Grow it by this much (or by `min`, if that is more).
    grow: usize,
    /// Read at most this much.
    max: usize,
}

impl ReadRoom {
    /// After small frames: the buffer's rest, grown by a chunk when 4 KiB
    /// or less is left.
    const SMALL: ReadRoom = ReadRoom {
        min: READ_MIN_ROOM,
        grow: READ_CHUNK,
        max: usize::MAX,
    };

    /// The room after a frame of `total` bytes. Medium frames (up to
    /// [`DIRECT_MIN`]) get a chunk of room at least, and the buffer grows by
    /// [`READ_BULK`]: several frames to a read. After a large frame, whose
    /// payload went from the socket straight to its place, a read takes at
    /// most a chunk: what it reads of the next large payload is copied from
    /// the buffer.
    fn after(total: usize) -> ReadRoom {
        if total >= DIRECT_MIN {
            ReadRoom {
                min: READ_MIN_ROOM,
                grow: READ_CHUNK,
                max: READ_CHUNK,
            }
        } else if total > READ_MIN_ROOM {
            ReadRoom {
                min: READ_CHUNK,
                grow: READ_BULK,
                max: usize::MAX,
            }
        } else {
            ReadRoom::SMALL
        }
    }

    /// This room for a read of a frame that still owes `rest` bytes.
    fn for_rest(self, rest: usize) -> ReadRoom {
        ReadRoom {
            min: self.min.max(rest),
            grow: self.grow,
            max: self.max.max(rest),
        }
    }
}

/// The largest receive low-water mark set while a large payload arrives: a
/// 1 MiB message wakes its reader once (measured against 256 KiB and 512
/// KiB: 1 MiB streaming reads and sends 15-20% faster). The kernel grows the
/// receive buffer to honour the mark, and wakes the reader anyway when the
/// buffer or the window runs short (`tcp_epollin_ready`), so a mark it cannot
/// hold costs nothing but the wake-ups it would have had.
const LOWAT_MAX: usize = 1 << 20;

/// The receive low-water mark for a payload that still owes `left` bytes:
/// the default (1) for a short rest, else as much of it as `LOWAT_MAX`.
fn lowat_for(left: usize) -> usize {
    if left < READ_CHUNK {
        1
    } else {
        left.min(LOWAT_MAX)
    }
}

/// Set `stream`'s receive low-water mark; false (mark unchanged) if the
/// kernel refuses, which only costs wake-ups.
fn set_recv_lowat(stream: &TcpStream, bytes: usize) -> bool {
    use std::os::fd::AsFd;
    match crate::lowat::set_recv_lowat(stream.as_fd(), bytes) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!("SO_RCVLOWAT {bytes}: {e}");
            false
        }
    }
}

impl Shared {
    /// Read more into `buf`, waiting as needed, with the `room` it gives.
    async fn read_more(&self, buf: &mut BytesMut, room: ReadRoom) -> io::Result<()> {
        let mut spin_start: Option<Instant> = None;
        loop {
            if buf.capacity() - buf.len() < room.min {
                buf.reserve(room.grow.max(room.min));
            }
            // A read that leaves room in the buffer emptied the socket's
            // receive queue: readiness is cleared now, instead of by one more
            // read that would only return EAGAIN (one system call less per
            // message that arrives alone). The readiness event is taken
            // before the read, so data arriving after it is not missed
            // (tokio clears only the event it gave out).
            let space = (buf.capacity() - buf.len()).min(room.max);
            let mut got = 0;
            let r = self.stream.try_io(Interest::READABLE, || {
                self.stats.add(|s| &s.socket_reads, 1);
                got = self.stream.try_read_buf(&mut (&mut *buf).limit(space))?;
                if got > 0 && got < space {
                    return Err(io::ErrorKind::WouldBlock.into());
                }
                Ok(got)
            });
            match r {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && got > 0 => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.wait_readable(&mut spin_start).await?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Read payload bytes `pos..need` from the socket with `read(pos)` (a
    /// non-blocking read into the destination at `pos`), waiting as needed.
    async fn read_rest(
        &self,
        mut pos: usize,
        need: usize,
        mut read: impl FnMut(usize) -> io::Result<usize>,
    ) -> Result<()> {
        let mut spin: Option<Instant> = None;
        // The receive low-water mark in force (1: the socket's default).
        let mut lowat = 1;
        while pos < need {
            // (`try_io` runs the read only when the socket may be readable,
            // so the count is of system calls.)
            let r = self.stream.try_io(Interest::READABLE, || {
                self.stats.add(|s| &s.socket_reads, 1);
                read(pos)
            });
            match r {
                Ok(0) => return Err(Error::Disconnected("peer closed the connection".into())),
                Ok(n) => {
                    pos += n;
                    spin = None;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    // Sleeping on an empty socket with much of the payload
                    // still to come: be woken once a good part of it is
                    // queued, not at every segment. The mark never exceeds
                    // what the payload still owes, so it is always reached
                    // (or the peer closes, which wakes the reader too).
                    if self.busy_poll.is_none() {
                        let want = lowat_for(need - pos);
                        if want != lowat && set_recv_lowat(&self.stream, want) {
                            lowat = want;
                        }
                    }
                    self.wait_readable(&mut spin)
                        .await
                        .map_err(|e| Error::Disconnected(format!("read failed: {e}")))?
                }
                Err(e) => return Err(Error::Disconnected(format!("read failed: {e}"))),
            }
        }
        if lowat != 1 {
            set_recv_lowat(&self.stream, 1);
        }
        Ok(())
    }

    /// Receive a large payload into a pooled buffer (no fresh allocation, no
    /// copy beyond the kernel's for the part not yet buffered).
    async fn read_pooled(&self, need: usize, buf: &mut BytesMut) -> Result<Bytes> {
        let have = buf.len();
        let mut dst = pool::take(need);
        dst[..have].copy_from_slice(&buf.split_to(have));
        self.read_rest(have, need, |pos| self.stream.try_read(&mut dst[pos..need]))
            .await?;
        Ok(pool::freeze(dst, need))
    }

    /// Receive a large read response straight into the caller's registered
    /// slice, if its read has one of the response's length; `false` if not
    /// (the caller then receives it as any payload, and the read copies it
    /// in or fails on its length).
    async fn read_into_slice(&self, h: &Header, buf: &mut BytesMut) -> Result<bool> {
        let need = h.payload_len as usize;
        let Some(sink) = self.slice_sinks.lock().remove(&h.id) else {
            return Ok(false);
        };
        if sink.len() != need {
            return Ok(false);
        }
        let have = buf.len().min(need);
        sink.put(0, &buf.split_to(have));
        let mut scratch = Vec::new();
        self.read_rest(have, need, |pos| {
            sink.receive(pos, need - pos, &mut scratch, |dst| {
                self.stream.try_read(dst)
            })
        })
        .await?;
        // (A read dropped meanwhile: the rest of its bytes went to scratch.)
        self.answer_filled(h, need);
        Ok(true)
    }

    /// A large read response of `need` bytes was received in place: count
    /// it and tell its waiter. A response whose read was dropped finds no
    /// waiter (its bytes went where nobody reads them).
    fn answer_filled(&self, h: &Header, need: usize) {
        self.stats.add(|s| &s.bytes_received, need as u64);
        if let Some(tx) = self.pending.lock().remove(&h.id) {
            let _ = tx.send(Resp {
                status: h.status,
                value: h.a,
                payload: Bytes::new(),
                filled: need,
            });
        }
    }

    /// Receive a large read response straight into its read's [`ReadSink`],
    /// if it has one that the payload fits; `false` if not (the caller then
    /// receives it as any payload, and the read checks its length).
    async fn read_into_sink(&self, h: &Header, buf: &mut BytesMut) -> Result<bool> {
        let need = h.payload_len as usize;
        let Some((sink, off)) = self.sinks.lock().remove(&h.id) else {
            return Ok(false);
        };
        if !sink.fits(off, need) {
            return Ok(false);
        }
        // Out: another lane's reader is filling it; this part comes the
        // ordinary way and is copied in when the buffer is back.
        let Some(mut dst) = sink.take() else {
            return Ok(false);
        };
        let have = buf.len().min(need);
        dst[off..off + have].copy_from_slice(&buf.split_to(have));
        self.read_rest(have, need, |pos| {
            self.stream.try_read(&mut dst[off + pos..off + need])
        })
        .await?;
        drop(dst);
        self.answer_filled(h, need);
        Ok(true)
    }

    /// Receive a large write piece straight into the target region: what is
    /// already buffered is copied, the rest goes from the socket to the region
    /// with no intermediate buffer. A refused piece is drained and discarded.
    async fn write_direct(&self, h: &Header, buf: &mut BytesMut) -> Result<()> {
        let need = h.payload_len as usize;
        let have = buf.len();
        let head = buf.split_to(have);
        let mut res = self.domain.remote_write(h.rkey, h.addr, h.a, h.b, &head);
        let mut scratch = Vec::new();
        self.read_rest(have, need, |pos| {
            let left = (need - pos) as u64;
            if res.is_ok() {
                let at = h.b + pos as u64;
                match self
                    .domain
                    .remote_write_with(h.rkey, h.addr, h.a, at, left, |dst| {
                        self.stream.try_read(dst)
                    }) {
                    Ok(r) => return r,
                    Err(e) => res = Err(e),
                }
            }
            scratch.resize(left.min(READ_CHUNK as u64) as usize, 0);
            self.stream.try_read(&mut scratch)
        })
        .await?;
        self.stats.add(|s| &s.bytes_received, need as u64);
        self.finish_write(h, res)
    }

    /// Wait for the socket to become readable, spinning first in busy-poll mode.
    async fn wait_readable(&self, spin: &mut Option<Instant>) -> io::Result<()> {
        if let Some(budget) = self.busy_poll {
            let start = *spin.get_or_insert_with(Instant::now);
            if start.elapsed() < budget {
                tokio::task::yield_now().await;
                return Ok(());
            }
        }
        if self.wq.lock().held == 0 {
            return self.stream.readable().await;
        }
        // Held acknowledgements leave on their own if nothing else goes
        // before their delay is up.
        match tokio::time::timeout(ACK_DELAY, self.stream.readable()).await {
            Ok(r) => r,
            Err(_) => {
                self.send_held();
                Ok(())
            }
        }
    }

    pub(super) async fn reader(self: Arc<Self>) {
        let err = match self.read_loop().await {
            Ok(()) => Error::Disconnected("peer closed the connection".into()),
            Err(e) => e,
        };
        self.fail(err);
    }

    async fn read_loop(&self) -> Result<()> {
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        // Answers are corked while further requests are already buffered, and
        // leave together before the reader waits on the socket again.
        let mut corked = false;
        // Room to read into, by the size of the last frame.
        let mut room = ReadRoom::SMALL;
        let uncork = |corked: &mut bool| {
            if std::mem::take(corked) {
                self.uncork();
            }
        };
        loop {
            if buf.len() < HEADER_LEN {
                uncork(&mut corked);
            }
            while buf.len() < HEADER_LEN {
                if let Err(e) = self.read_more(&mut buf, room).await {
                    return read_error(e);
                }
            }
            let h = Header::decode(&buf[..HEADER_LEN], self.ours.max_message)
                .map_err(|e| Error::Protocol(e.to_string()))?;
            let total = HEADER_LEN + h.payload_len as usize;
            room = ReadRoom::after(total);
            if h.payload_len as usize >= DIRECT_MIN && buf.len() < total {
                uncork(&mut corked);
                buf.advance(HEADER_LEN);
                if h.kind == Kind::Resp
                    && (self.read_into_slice(&h, &mut buf).await?
                        || self.read_into_sink(&h, &mut buf).await?)
                {
                    continue;
                }
                if h.kind == Kind::Write {
                    self.check_answers_read()?;
                    self.write_direct(&h, &mut buf).await?;
                    continue;
                }
                let payload = self.read_pooled(h.payload_len as usize, &mut buf).await?;
                let message = h.kind == Kind::Send;
                if !self.handle(h, payload).await? {
                    return Ok(());
                }
                if message {
                    // Let the receiver take this message (and give its buffer
                    // back to the pool) before the next one arrives: a reader
                    // that runs ahead fills a fresh pooled buffer per message,
                    // up to the receive window, and copies into memory that has
                    // left the CPU cache. 1 MiB sends, 16 in flight, two
                    // processes of one thread: 4.7-5.1 GB/s and 87 MB resident
                    // without this yield, 6.2-7.3 GB/s and 17 MB with it. (Not
                    // after a read's answer: its waiter is woken anyway, and
                    // the yield cost a lone 1 MiB read 5% of its round trip.)
                    tokio::task::yield_now().await;
                }
                continue;
            }
            if buf.len() < total {
                uncork(&mut corked);
                while buf.len() < total {
                    let rest = room.for_rest(total - buf.len());
                    if let Err(e) = self.read_more(&mut buf, rest).await {
                        return read_error(e);
                    }
                }
            }
            let mut frame = buf.split_to(total);
            frame.advance(HEADER_LEN);
            let payload = frame.freeze();
            // A large read is answered straight from the region, uncorked
            // (a corked answer would be copied).
            let large_read = h.kind == Kind::Read && h.imm as usize >= DIRECT_MIN;
            if large_read {
                uncork(&mut corked);
            } else if buf.len() >= HEADER_LEN && !corked {
                self.cork();
                corked = true;
            }
            if !self.handle(h, payload).await? {
                return Ok(());
            }
        }
    }

    /// Act on one frame. Returns false when the peer closed gracefully.
    async fn handle(&self, h: Header, payload: Bytes) -> Result<bool> {
        if matches!(h.kind, Kind::Read | Kind::Write | Kind::Atomic) {
            self.check_answers_read()?;
        }
        match h.kind {
            Kind::Send => {
                let len = payload.len() as u64;
                self.stats.add(|s| &s.bytes_received, len);
                self.deliver(Incoming::Message(payload), len)?;
            }
            Kind::Credit => {
                let mut c = self.credits.lock();
                c.msgs += h.a;
                c.bytes += h.b;
                drop(c);
                self.credit_wake.notify_waiters();
            }
            Kind::Write => {
                self.stats.add(|s| &s.bytes_received, payload.len() as u64);
                let res = self.domain.remote_write(h.rkey, h.addr, h.a, h.b, &payload);
                self.finish_write(&h, res)?;
            }
            Kind::Read => {
                let (len, mut resp) = (u64::from(h.imm), Header::new(Kind::Resp));
                resp.id = h.id;
                if h.a == 0 {
                    // Zero-length: no checks, as on RDMA NICs (rocev2-reference §4; rxe check_rkey).
                    self.served(Ok(()));
                    self.enqueue(OutFrame::new(resp, Bytes::new()))?;
                    return Ok(true);
                }
                // A large answer is written straight from the region when its
                // turn comes (no copy, however long it queues); a small one
                // is copied (cheap, and it may ride in a `writev` with others).
                let res = if len as usize >= DIRECT_MIN {
                    self.domain
                        .remote_read_source(h.rkey, h.addr, h.a, h.b, len)
                        .map(|src| self.enqueue(OutFrame::from_source(resp, src)))
                } else {
                    self.domain
                        .remote_read(h.rkey, h.addr, h.a, h.b, len)
                        .map(|data| self.enqueue(OutFrame::new(resp, data)))
                };
                match res {
                    Ok(sent) => {
                        self.served(Ok(()));
                        self.stats.add(|s| &s.bytes_sent, len);
                        sent?;
                    }
                    Err(e) => self.respond(h.id, Err(e))?,
                }
            }
            Kind::Atomic => {
                let op = if h.flags & FLAG_FAA != 0 {
                    AtomicOp::FetchAndAdd { add: h.a }
                } else {
                    AtomicOp::CompareAndSwap {
                        expected: h.a,
                        new: h.b,
                    }
                };
                let res = self.domain.remote_atomic(h.rkey, h.addr, op);
                self.respond(h.id, res.map(|v| (v, Bytes::new())))?;
            }
            Kind::Resp => {
                self.stats.add(|s| &s.bytes_received, payload.len() as u64);
                // A response whose operation was dropped finds no waiter: discarded.
                if let Some(tx) = self.pending.lock().remove(&h.id) {
                    let _ = tx.send(Resp {
                        status: h.status,
                        value: h.a,
                        payload,
                        filled: 0,
                    });
                }
            }
            Kind::Close => return Ok(false),
        }
        Ok(true)
    }

    /// Queue an incoming message or notice for `recv`, charging the peer's credits.
    fn deliver(&self, item: Incoming, len: u64) -> Result<()> {
        let mut r = self.recv.lock();
        if r.peer_msgs_left == 0 || r.peer_bytes_left < len {
            return Err(Error::Protocol(
                "peer sent beyond its receive credits".into(),
            ));
        }
        r.peer_msgs_left -= 1;
        r.peer_bytes_left -= len;
        r.queue.push_back(item);
        let first = r.waiters.pop_first();
        drop(r);
        if let Some(w) = first {
            w.wake();
        }
        Ok(())
    }

    /// Count a served or refused remote access.
    fn served(&self, res: std::result::Result<(), AccessError>) {
        match res {
            Ok(()) => self.stats.add(|s| &s.remote_ops_served, 1),
            Err(e) => {
                self.stats.add(|s| &s.remote_access_denied, 1);
                tracing::debug!(error = %e, "refused remote access");
            }
        }
    }

    fn respond(&self, id: u64, res: std::result::Result<(u64, Bytes), AccessError>) -> Result<()> {
        let mut h = Header::new(Kind::Resp);
        h.id = id;
        self.served(res.as_ref().map(|_| ()).map_err(|e| *e));
        let payload = match res {
            Ok((value, payload)) => {
                h.a = value;
                payload
            }
            Err(e) => {
                h.status = e.code();
                Bytes::new()
            }
        };
        self.enqueue(OutFrame::new(h, payload))
    }

    /// After a write piece: deliver the immediate if this was the last piece of
    /// a write-with-immediate, and answer the requester.
    fn finish_write(&self, h: &Header, res: std::result::Result<(), AccessError>) -> Result<()> {
        if res.is_ok() && h.flags & FLAG_IMM != 0 && h.flags & FLAG_LAST != 0 {
            self.deliver(
                Incoming::WriteImm {
                    imm: h.imm,
                    len: h.a,
                },
                0,
            )?;
        }
        if res.is_ok() && h.flags & FLAG_ACK_LATER != 0 {
            self.served(Ok(()));
            let mut ack = Header::new(Kind::Resp);
            ack.id = h.id;
            return self.hold_ack(OutFrame::new(ack, Bytes::new()));
        }
        self.respond(h.id, res.map(|()| (0, Bytes::new())))
    }
}

fn read_error(e: io::Error) -> Result<()> {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        Ok(())
    } else {
        Err(Error::Disconnected(format!("read failed: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads after small frames use the buffer's rest; after medium ones
    /// they get a chunk of room at least; after a large frame (its payload
    /// received in place) they take at most a chunk, so that little of the
    /// next large payload is read into the buffer and copied out (up to 256
    /// KiB of each 1 MiB write was when they took all the room there was).
    #[test]
    fn read_room_follows_the_last_frame() {
        assert_eq!(ReadRoom::after(HEADER_LEN + 8), ReadRoom::SMALL);
        assert_eq!(ReadRoom::after(READ_MIN_ROOM), ReadRoom::SMALL);
        let medium = ReadRoom::after(32 << 10);
        assert_eq!(
            (medium.min, medium.grow, medium.max),
            (READ_CHUNK, READ_BULK, usize::MAX)
        );
        let large = ReadRoom::after(1 << 20);
        assert_eq!(
            (large.min, large.grow, large.max),
            (READ_MIN_ROOM, READ_CHUNK, READ_CHUNK)
        );
        let rest = ReadRoom::SMALL.for_rest(20 << 10);
        assert_eq!(
            (rest.min, rest.grow, rest.max),
            (20 << 10, READ_CHUNK, usize::MAX)
        );
        let rest = large.for_rest(100);
        assert_eq!(
            (rest.min, rest.grow, rest.max),
            (READ_MIN_ROOM, READ_CHUNK, READ_CHUNK)
        );
    }
}
