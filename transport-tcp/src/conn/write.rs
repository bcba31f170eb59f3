//! The write side of a connection: frames queued, corked and batched, the
//! socket's write side taken by whoever finds it idle, the writer task that
//! drains the queue under load, held acknowledgements riding along, and the
//! `writev` calls themselves.

use super::*;

impl Shared {
    /// Take the socket's write side, or (if someone else holds it, a cork
    /// is in, or held acknowledgements wait to ride along) queue the frames
    /// `add` puts in, atomically. Returns true if the caller now writes.
    fn claim_or_queue(&self, add: impl FnOnce(&mut VecDeque<OutFrame>)) -> Result<bool> {
        let mut q = self.wq.lock();
        if q.closed {
            drop(q);
            return Err(self.disconnected());
        }
        if q.busy || q.corks > 0 {
            add(&mut q.frames);
            self.send_if_overfull(q);
            return Ok(false);
        }
        if !q.frames.is_empty() {
            // Only held acknowledgements: they ride along.
            add(&mut q.frames);
            self.send_queued(q);
            return Ok(false);
        }
        q.busy = true;
        Ok(true)
    }

    /// Hold a write's success answer back until another frame leaves (or
    /// [`ACK_DELAY`] passes): see [`FLAG_ACK_LATER`].
    pub(super) fn hold_ack(&self, frame: OutFrame) -> Result<()> {
        self.count_answer(&frame);
        let mut q = self.wq.lock();
        if q.closed {
            drop(q);
            return Err(self.disconnected());
        }
        q.frames.push_back(frame);
        q.held += 1;
        if q.held >= MAX_HELD {
            q.held = 0;
            if q.corks == 0 {
                self.send_queued(q);
            }
        }
        Ok(())
    }

    /// Send held acknowledgements now (their delay is up).
    pub(super) fn send_held(&self) {
        let mut q = self.wq.lock();
        if q.corks == 0 {
            q.held = 0;
            self.send_queued(q);
        }
    }

    /// Hold frames back (the reader, while it serves a burst of buffered
    /// requests; the application, see [`Shared::corks`]).
    pub(super) fn cork(&self) {
        self.wq.lock().corks += 1;
    }

    /// End one cork; the last one sends what was queued meanwhile, in as few
    /// `writev`s as the socket takes (Redis's "write before sleep": nothing
    /// waits on a socket read while answers sit in the queue).
    pub(super) fn uncork(&self) {
        let mut q = self.wq.lock();
        q.corks = q.corks.saturating_sub(1);
        if q.corks > 0 {
            return;
        }
        self.send_queued(q);
    }

    /// A cork holds at most one `writev`'s worth of frames: past that, what
    /// is queued leaves at once (cork or not).
    fn send_if_overfull(&self, q: parking_lot::MutexGuard<'_, WriteQueue>) {
        if q.corks > 0 && q.frames.len() >= MAX_IOV {
            self.send_queued(q);
        }
    }

    /// Send what is queued (unless it is only held acknowledgements, or
    /// someone else holds the write side).
    fn send_queued(&self, mut q: parking_lot::MutexGuard<'_, WriteQueue>) {
        if q.busy || q.closed || q.frames.len() <= q.held {
            return;
        }
        q.busy = true;
        q.held = 0;
        let mut batch = std::mem::take(&mut q.frames);
        drop(q);
        let res = write_some(&self.stream, &self.stats, &self.answers_queued, &mut batch);
        self.release_direct(batch.into_iter(), res);
    }

    /// Queue a request made while others are in flight; the writer task sends
    /// it with every other request made in the same scheduler tick, in one
    /// `writev` (a lone request goes out at once, by [`Shared::enqueue`]).
    pub(super) fn enqueue_deferred(&self, frame: OutFrame) -> Result<()> {
        self.enqueue_deferred_many(std::iter::once(frame))
    }

    /// [`Shared::enqueue_deferred`] for several frames, kept together in order.
    pub(super) fn enqueue_deferred_many(
        &self,
        frames: impl IntoIterator<Item = OutFrame>,
    ) -> Result<()> {
        let mut q = self.wq.lock();
        if q.closed {
            drop(q);
            return Err(self.disconnected());
        }
        q.frames.extend(frames);
        if q.busy || q.corks > 0 {
            self.send_if_overfull(q);
            return Ok(());
        }
        q.busy = true;
        q.deferred = true;
        drop(q);
        self.writer_wake.notify_one();
        Ok(())
    }

    /// After a direct write: queue what did not fit (first, to keep order) and
    /// hand the write side to the writer task if frames are waiting.
    fn release_direct(&self, rest: impl DoubleEndedIterator<Item = OutFrame>, res: io::Result<()>) {
        if let Err(e) = res {
            if e.kind() != io::ErrorKind::WouldBlock {
                self.fail(Error::Disconnected(format!("write failed: {e}")));
                return;
            }
        }
        let mut q = self.wq.lock();
        for f in rest.rev() {
            q.frames.push_front(f);
        }
        if q.frames.len() <= q.held {
            // Nothing, or only acknowledgements held meanwhile.
            q.busy = false;
        } else {
            q.held = 0;
            drop(q);
            self.writer_wake.notify_one();
        }
    }

    /// Count an answer's bytes until they are written ([`write_some`]).
    fn count_answer(&self, frame: &OutFrame) {
        if frame.answer {
            self.answers_queued
                .fetch_add(frame.remaining(), Ordering::Relaxed);
        }
    }

    /// Refuse to serve a peer that sends requests but does not read the
    /// answers: they would queue (copies of read data among them) without
    /// bound. A peer of ours never has more than [`READ_OUTSTANDING`] bytes
    /// of read answers, and a bounded number of small ones, outstanding.
    pub(super) fn check_answers_read(&self) -> Result<()> {
        let queued = self.answers_queued.load(Ordering::Relaxed);
        if queued > MAX_ANSWERS_QUEUED {
            return Err(Error::Protocol(format!(
                "peer does not read the answers to its requests ({queued} bytes of them wait)"
            )));
        }
        Ok(())
    }

    /// Queue a frame; writes it at once if nobody else is writing.
    /// A frame once queued goes out whole, even if the caller is dropped.
    pub(super) fn enqueue(&self, frame: OutFrame) -> Result<()> {
        self.count_answer(&frame);
        let mut slot = Some(frame);
        if !self.claim_or_queue(|q| q.push_back(slot.take().expect("frame")))? {
            return Ok(());
        }
        let mut frame = slot.take().expect("frame");
        let res = write_one(&self.stream, &self.stats, &self.answers_queued, &mut frame);
        let rest = (frame.remaining() > 0).then_some(frame);
        self.release_direct(rest.into_iter(), res);
        Ok(())
    }

    /// [`Shared::enqueue`] for several frames in order: one `writev` when the
    /// socket is idle.
    pub(super) fn enqueue_many(&self, frames: Vec<OutFrame>) -> Result<()> {
        if frames.is_empty() {
            return Ok(());
        }
        let mut slot = Some(frames);
        if !self.claim_or_queue(|q| q.extend(slot.take().expect("frames")))? {
            return Ok(());
        }
        let mut batch = VecDeque::from(slot.take().expect("frames"));
        let res = write_some(&self.stream, &self.stats, &self.answers_queued, &mut batch);
        self.release_direct(batch.into_iter(), res);
        Ok(())
    }

    pub(super) async fn writer(self: Arc<Self>) {
        let mut batch: VecDeque<OutFrame> = VecDeque::new();
        loop {
            self.writer_wake.notified().await;
            if std::mem::take(&mut self.wq.lock().deferred) {
                tokio::task::yield_now().await;
            }
            loop {
                {
                    let mut q = self.wq.lock();
                    if q.closed {
                        return;
                    }
                    q.held = 0;
                    while batch.len() < MAX_IOV {
                        match q.frames.pop_front() {
                            Some(f) => batch.push_back(f),
                            None => break,
                        }
                    }
                    if batch.is_empty() {
                        q.busy = false;
                        drop(q);
                        self.write_drained.notify_waiters();
                        break;
                    }
                }
                self.write_drained.notify_waiters();
                while !batch.is_empty() {
                    match write_some(&self.stream, &self.stats, &self.answers_queued, &mut batch) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            if let Err(e) = self.stream.writable().await {
                                self.fail(Error::Disconnected(format!("write failed: {e}")));
                                return;
                            }
                        }
                        Err(e) => {
                            self.fail(Error::Disconnected(format!("write failed: {e}")));
                            return;
                        }
                    }
                }
            }
        }
    }

    /// Wait until everything queued is on the socket (used by graceful close).
    pub(super) async fn flush(&self) {
        loop {
            let notified = self.write_drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let q = self.wq.lock();
                if q.closed || (!q.busy && q.frames.is_empty()) {
                    return;
                }
            }
            notified.await;
        }
    }
}

/// Write as much of `frames` as the socket takes without blocking; fully
/// written frames are removed, a partly written one is advanced.
fn write_some(
    stream: &TcpStream,
    stats: &Stats,
    answers_queued: &AtomicUsize,
    frames: &mut VecDeque<OutFrame>,
) -> io::Result<()> {
    while !frames.is_empty() {
        // Up to MAX_IOV frames, ending at the first one read from a region:
        // its bytes are locked only for this one system call.
        let take = frames
            .iter()
            .take(MAX_IOV)
            .position(|f| f.source.is_some())
            .map_or(MAX_IOV, |i| i + 1);
        let guard = frames
            .iter()
            .take(take)
            .last()
            .and_then(|f| f.source.as_ref())
            .map(|(src, _)| src.lock());
        // Most writes carry a frame or two: their slices stay on the stack.
        let mut iov: SmallVec<[IoSlice<'_>; 8]> = SmallVec::new();
        for f in frames.iter().take(take) {
            push_slices(&mut iov, f, guard.as_deref());
        }
        let res = try_writev(stream, stats, &iov);
        drop(iov);
        drop(guard);
        let mut n = res?;
        while n > 0 {
            let f = frames.front_mut().expect("written bytes belong to a frame");
            consume(f, &mut n, answers_queued);
            if f.remaining() == 0 {
                frames.pop_front();
            }
        }
        // Drop frames that are fully written (zero-payload frames after the header).
        while frames.front().is_some_and(|f| f.remaining() == 0) {
            frames.pop_front();
        }
    }
    Ok(())
}

/// [`write_some`] for one frame, which stays the caller's (no queue to
/// build for the most common write, a lone small frame): written until done
/// or the socket is full.
fn write_one(
    stream: &TcpStream,
    stats: &Stats,
    answers_queued: &AtomicUsize,
    f: &mut OutFrame,
) -> io::Result<()> {
    while f.remaining() > 0 {
        let guard = f.source.as_ref().map(|(src, _)| src.lock());
        let mut iov: SmallVec<[IoSlice<'_>; 3]> = SmallVec::new();
        push_slices(&mut iov, f, guard.as_deref());
        let res = try_writev(stream, stats, &iov);
        drop(iov);
        drop(guard);
        let mut n = res?;
        consume(f, &mut n, answers_queued);
    }
    Ok(())
}

/// One counted `writev` of `iov` (non-blocking).
fn try_writev(stream: &TcpStream, stats: &Stats, iov: &[IoSlice<'_>]) -> io::Result<usize> {
    stats.add(|s| &s.socket_writes, 1);
    stream.try_write_vectored(iov)
}

/// The slices of `f` still to write: the rest of its header, its payload,
/// and the rest of its region source (`region`: that source's bytes, locked).
fn push_slices<'a, const N: usize>(
    iov: &mut SmallVec<[IoSlice<'a>; N]>,
    f: &'a OutFrame,
    region: Option<&'a [u8]>,
) where
    [IoSlice<'a>; N]: smallvec::Array<Item = IoSlice<'a>>,
{
    if f.hdr_pos < HEADER_LEN {
        iov.push(IoSlice::new(&f.hdr[f.hdr_pos..]));
    }
    if !f.payload.is_empty() {
        iov.push(IoSlice::new(&f.payload));
    }
    if let (Some((_, pos)), Some(g)) = (&f.source, region) {
        iov.push(IoSlice::new(&g[*pos..]));
    }
}

/// Mark up to `n` written bytes of `f` as sent, taking them off `n`.
fn consume(f: &mut OutFrame, n: &mut usize, answers_queued: &AtomicUsize) {
    let h = (HEADER_LEN - f.hdr_pos).min(*n);
    f.hdr_pos += h;
    *n -= h;
    let p = f.payload.len().min(*n);
    f.payload.advance(p);
    *n -= p;
    let mut taken = h + p;
    if let Some((src, pos)) = &mut f.source {
        let s = (src.len() - *pos).min(*n);
        *pos += s;
        *n -= s;
        taken += s;
    }
    if f.answer {
        answers_queued.fetch_sub(taken, Ordering::Relaxed);
    }
}
