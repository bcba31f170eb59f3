//! Lanes: one logical connection carried by several transport connections
//! (several TCP connections, or several RC queue pairs), so one large
//! operation can use them all at once.
//!
//! The active side asks for lanes with [`Options::lanes`]. It connects lane 0
//! with a [`LaneTag`] in its handshake (a random group id, the lane's index,
//! the lane count); a server that understands lanes echoes the tag, and the
//! client then connects the other lanes with the same group id. The server's
//! [`crate::Listener::accept`] holds the lanes of a group until all of them
//! have arrived and returns them as one [`Connection`]. A server that does not
//! echo the tag gets a single-lane connection, as if no lanes were asked for.
//!
//! How operations use the lanes, and what stays ordered, is in
//! [`crate::striped`].

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::conn::{BoxFuture, Connection};
use crate::error::{Error, Result};
use crate::striped::StripedConnection;
use crate::transport::{Listener, Options, Transport};

/// Most lanes one connection may have (a peer naming more is refused).
pub const MAX_LANES: u16 = 16;

/// Lane groups a listener holds half-assembled at once; a peer opening more
/// is refused, so half-open groups cannot pile up.
pub const MAX_PENDING_GROUPS: usize = 64;

/// Which lane of which group a transport connection is, as negotiated in
/// its handshake.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LaneTag {
    /// Random id shared by the lanes of one logical connection.
    pub group: u64,
    /// This lane's index, `0..count`.
    pub index: u16,
    /// How many lanes the group has (2..=[`MAX_LANES`]).
    pub count: u16,
}

impl LaneTag {
    /// `Ok` if a peer's tag is one we accept: 2..=[`MAX_LANES`] lanes and an
    /// index below the count.
    pub fn validate(&self) -> Result<()> {
        if self.count < 2 || self.count > MAX_LANES || self.index >= self.count {
            return Err(Error::Protocol(format!(
                "invalid lane tag: lane {} of {} (2..={MAX_LANES} lanes)",
                self.index, self.count
            )));
        }
        Ok(())
    }
}

/// Connect to `addr` over `transport` with `opts.lanes` lanes (one plain
/// connection when that is 0 or 1, or when the server does not take lanes).
pub async fn connect(
    transport: &Arc<dyn Transport>,
    addr: &str,
    opts: &Options,
) -> Result<Connection> {
    let count = opts.lanes;
    if count <= 1 {
        return transport.connect(addr, opts).await;
    }
    if count > MAX_LANES {
        return Err(Error::InvalidArgument(format!(
            "{count} lanes asked for; at most {MAX_LANES}"
        )));
    }
    let group: u64 = rand::random();
    let tagged = |index: u16| Options {
        lane_tag: Some(LaneTag {
            group,
            index,
            count,
        }),
        ..opts.clone()
    };
    let first = transport.connect(addr, &tagged(0)).await?;
    if first.info().lane.is_none() {
        tracing::debug!(addr, "the server does not take lanes; one lane");
        return Ok(first);
    }
    let rest: Vec<_> = (1..count)
        .map(|i| {
            let (t, o, a) = (transport.clone(), tagged(i), addr.to_string());
            tokio::spawn(async move { t.connect(&a, &o).await })
        })
        .collect();
    let mut lanes = vec![first];
    for r in rest {
        let conn = r
            .await
            .map_err(|e| Error::Connect(format!("lane task: {e}")))??;
        lanes.push(conn);
    }
    StripedConnection::assemble(lanes, opts.op_timeout)
}

/// A transport whose connections ask for a fixed number of lanes (unless
/// their options ask for several themselves): how the conformance suite runs
/// every case striped.
pub struct WithLanes {
    inner: Arc<dyn Transport>,
    lanes: u16,
}

impl WithLanes {
    /// `inner`, with `lanes` lanes per connection.
    pub fn new(inner: Arc<dyn Transport>, lanes: u16) -> WithLanes {
        WithLanes { inner, lanes }
    }
}

impl Transport for WithLanes {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> crate::caps::Capabilities {
        self.inner.capabilities()
    }

    fn available(&self) -> std::result::Result<(), String> {
        self.inner.available()
    }

    fn connect(&self, addr: &str, opts: &Options) -> BoxFuture<'static, Result<Connection>> {
        let mut opts = opts.clone();
        if opts.lanes <= 1 {
            opts.lanes = self.lanes;
        }
        let (inner, addr) = (self.inner.clone(), addr.to_string());
        Box::pin(async move { connect(&inner, &addr, &opts).await })
    }

    fn listen(&self, addr: &str, opts: &Options) -> BoxFuture<'static, Result<Listener>> {
        self.inner.listen(addr, opts)
    }
}

/// A half-assembled group on the listening side.
struct Pending {
    lanes: Vec<Option<Connection>>,
    since: Instant,
}

/// The listening side's lane groups, keyed by the peer's address and group id.
#[derive(Default)]
pub(crate) struct LaneGroups {
    pending: HashMap<(Option<IpAddr>, u64), Pending>,
}

/// How long a listener waits for the rest of a group's lanes.
const GROUP_DEADLINE: Duration = Duration::from_secs(10);

impl LaneGroups {
    /// Take an accepted connection that is a lane of a group: the assembled
    /// connection once the group is complete, `None` while lanes are missing.
    /// A bad tag (index out of range, lane seen twice, too many groups
    /// waiting) is an error for this connection only.
    pub(crate) fn add(&mut self, conn: Connection, tag: LaneTag) -> Result<Option<Connection>> {
        tag.validate()?;
        let now = Instant::now();
        self.pending.retain(|(ip, g), p| {
            let keep = now.duration_since(p.since) < GROUP_DEADLINE;
            if !keep {
                tracing::warn!(peer = ?ip, group = g, "gave up on a lane group that never completed");
            }
            keep
        });
        let key = (conn.info().peer_addr.map(|a| a.ip()), tag.group);
        if !self.pending.contains_key(&key) && self.pending.len() >= MAX_PENDING_GROUPS {
            return Err(Error::ResourceExhausted(format!(
                "{MAX_PENDING_GROUPS} lane groups are already waiting for lanes"
            )));
        }
        let op_timeout = conn.op_timeout();
        let p = self.pending.entry(key).or_insert_with(|| Pending {
            lanes: (0..tag.count).map(|_| None).collect(),
            since: now,
        });
        if p.lanes.len() != tag.count as usize || p.lanes[tag.index as usize].is_some() {
            let why = format!(
                "lane {} of {} does not fit its group (of {} lanes)",
                tag.index,
                tag.count,
                p.lanes.len()
            );
            self.pending.remove(&key);
            return Err(Error::Protocol(why));
        }
        p.lanes[tag.index as usize] = Some(conn);
        if p.lanes.iter().any(Option::is_none) {
            return Ok(None);
        }
        let p = self.pending.remove(&key).expect("present");
        let lanes = p.lanes.into_iter().map(|c| c.expect("complete")).collect();
        StripedConnection::assemble(lanes, op_timeout).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_outside_the_limits_are_refused() {
        let tag = |index, count| LaneTag {
            group: 7,
            index,
            count,
        };
        assert!(tag(0, 2).validate().is_ok());
        assert!(tag(15, 16).validate().is_ok());
        for (i, c) in [(0, 0), (0, 1), (2, 2), (0, 17), (16, 16)] {
            assert!(tag(i, c).validate().is_err(), "{i} of {c}");
        }
    }
}
