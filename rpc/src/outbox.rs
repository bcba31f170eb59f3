//! Coalescing of outgoing frames: when many calls are in flight, their small
//! frames leave together in one [`Connection::send_many`] (one `writev` on
//! TCP) instead of one send, and one system call, each.
//!
//! Two ways a batch forms:
//! - **at the end of a scheduler tick** (clients, spawned handlers): the first
//!   frame queued makes its sender the flusher; it yields until the runtime
//!   has run every other ready task (`tokio::task::yield_now` defers to the
//!   worker's idle point), so the callers woken by the same burst of answers
//!   add theirs, then sends the lot;
//! - **before the server's loop waits** (handlers run inline): frames are only
//!   queued while the loop polls a call, and the loop flushes when no further
//!   request is ready (as Redis writes its replies before it sleeps).
//!
//! A sender with nothing else in flight sends directly: a lone call pays no
//! extra hop. Coalescing can be switched off (every frame is then sent at
//! once, one send each), to measure what it buys.

use std::future::IntoFuture;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use rdmx_core::{BoxFuture, Connection};

use crate::error::RpcError;
use crate::stats::RpcStats;

/// Frames one flush sends at most; the server loop flushes when it has this many.
const MAX_BATCH: usize = 64;
/// Bytes one batch holds at most: past this, batching saves no system call
/// worth having and only holds data back (a batch of 64 answers of 64 KiB
/// kept the client waiting for 4 MiB: 40% fewer calls per second).
const MAX_BATCH_BYTES: usize = 128 << 10;
/// A frame this large is sent on its own when nothing is queued before it.
const COALESCE_BELOW: usize = 16 << 10;

struct Queue {
    frames: Vec<Bytes>,
    /// Bytes in `frames`.
    bytes: usize,
    /// The server loop is polling a call inline: it flushes what is queued
    /// before it next waits, so senders only queue.
    deferred: bool,
}

/// One connection's outgoing frames (see the module doc).
pub(crate) struct Outbox {
    conn: Connection,
    queue: Mutex<Queue>,
    /// Coalescing on (the default); off, every frame is sent at once.
    coalesce: AtomicBool,
    stats: Arc<RpcStats>,
}

impl Outbox {
    /// An outbox for `conn`, counting its batches in `stats`.
    pub(crate) fn new(conn: Connection, stats: Arc<RpcStats>) -> Arc<Outbox> {
        Arc::new(Outbox {
            conn,
            queue: Mutex::new(Queue {
                frames: Vec::new(),
                bytes: 0,
                deferred: false,
            }),
            coalesce: AtomicBool::new(true),
            stats,
        })
    }

    /// Send `frame`: directly when `batch` is false and nothing is queued;
    /// otherwise it joins a batch that leaves at the end of this scheduler
    /// tick (or before the server loop waits). Frames queued by this call
    /// go out even if the caller is dropped meanwhile.
    pub(crate) async fn send(self: &Arc<Self>, frame: Bytes, batch: bool) -> Result<(), RpcError> {
        let coalesce = self.coalesce();
        let direct = {
            let mut q = self.queue.lock();
            if coalesce && (q.deferred || !q.frames.is_empty()) {
                // The loop, or the sender that queued first, flushes it.
                q.push(frame);
                return Ok(());
            }
            if batch && coalesce && frame.len() < COALESCE_BELOW {
                q.push(frame);
                None
            } else {
                Some(frame)
            }
        };
        if let Some(frame) = direct {
            // Posted, not acknowledged: the answer proves delivery, and the
            // peer's acknowledgement (held to ride with that answer on soft
            // RoCE) then wakes nobody but the task that reads the answer
            // (two tasks woken by one batch make tokio hand one to another
            // worker). A send failing after posting fails the connection.
            return Ok(self.conn.post_send(frame).await?);
        }
        // This sender queued first: it flushes once the tick's other ready
        // tasks have had their turn to add frames.
        let mut flusher = Flusher {
            outbox: self.clone(),
            sending: None,
            done: false,
        };
        tokio::task::yield_now().await;
        flusher.run().await
    }

    /// Queue `frame` without sending it: for the server loop itself, which
    /// flushes before it waits.
    pub(crate) fn push(&self, frame: Bytes) {
        self.queue.lock().push(frame);
    }

    /// Switch coalescing on or off.
    pub(crate) fn set_coalesce(&self, on: bool) {
        self.coalesce.store(on, Ordering::Relaxed);
    }

    /// Whether frames are coalesced.
    pub(crate) fn coalesce(&self) -> bool {
        self.coalesce.load(Ordering::Relaxed)
    }

    /// Frames waiting to be sent.
    pub(crate) fn queued(&self) -> usize {
        self.queue.lock().frames.len()
    }

    /// The queue holds a full batch: send it before queueing more.
    pub(crate) fn full(&self) -> bool {
        let q = self.queue.lock();
        q.frames.len() >= MAX_BATCH || q.bytes >= MAX_BATCH_BYTES
    }

    /// While `on` (the server loop polls a call inline), senders only queue.
    pub(crate) fn set_deferred(&self, on: bool) {
        self.queue.lock().deferred = on;
    }

    /// Send everything queued, in order.
    pub(crate) async fn flush(self: &Arc<Self>) -> Result<(), RpcError> {
        Flusher {
            outbox: self.clone(),
            sending: None,
            done: false,
        }
        .run()
        .await
    }

    /// Take the queue and start sending it.
    fn take_batch(&self) -> Option<BoxFuture<'static, Result<(), RpcError>>> {
        let frames = {
            let mut q = self.queue.lock();
            q.bytes = 0;
            std::mem::take(&mut q.frames)
        };
        if frames.is_empty() {
            return None;
        }
        self.stats.record_batch(frames.len());
        let send = self.conn.send_many(frames).into_future();
        Some(Box::pin(async move { Ok(send.await?) }))
    }
}

impl Queue {
    fn push(&mut self, frame: Bytes) {
        self.bytes += frame.len();
        self.frames.push(frame);
    }
}

/// Sends an outbox's queue; if dropped before it finished, finishes in a task
/// of its own, so frames of other callers it took are never lost.
struct Flusher {
    outbox: Arc<Outbox>,
    /// The batch being sent.
    sending: Option<BoxFuture<'static, Result<(), RpcError>>>,
    /// `run` finished: nothing left to do on drop.
    done: bool,
}

impl Flusher {
    async fn run(&mut self) -> Result<(), RpcError> {
        self.sending = self.outbox.take_batch();
        let res = match self.sending.as_mut() {
            Some(f) => f.await,
            None => Ok(()),
        };
        self.sending = None;
        self.done = true;
        res
    }
}

impl Drop for Flusher {
    fn drop(&mut self) {
        // Finished: any later frame has a flusher of its own. Dropped
        // mid-way: finish the batch, or take it.
        if self.done {
            return;
        }
        if let Some(f) = self.sending.take() {
            tokio::spawn(f);
        } else if self.outbox.queued() > 0 {
            let outbox = self.outbox.clone();
            tokio::spawn(async move { outbox.flush().await });
        }
    }
}
