//! A deterministic network for two queue pairs: simulated clock, and knobs for
//! delay, jitter (reordering), bandwidth, loss, duplication and ECN CE marks. Every
//! packet is encoded to bytes and decoded again on arrival, so the codec is on
//! the path. Same seed, same run.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::memory::VecMemory;
use crate::packet::Packet;
use crate::qp::{Completion, Qp, QpConfig};
use crate::wire::{FramePath, RoceFrame};

/// Link behaviour, the same in both directions.
#[derive(Clone, Copy, Debug)]
pub struct Link {
    /// One-way propagation delay (ns).
    pub delay_ns: u64,
    /// Extra random delay up to this much (ns): reorders packets.
    pub jitter_ns: u64,
    /// Serialisation rate in bytes per nanosecond (1.25 = 10 Gb/s).
    pub bytes_per_ns: f64,
    /// Probability a packet is lost.
    pub loss: f64,
    /// Probability a packet is delivered twice.
    pub dup: f64,
    /// Probability a packet arrives marked ECN Congestion Experienced.
    pub ce: f64,
    /// Packets the sender's link queue holds (0: unlimited); a packet that
    /// finds it full is dropped, as by a switch buffer or a slow receiver's
    /// ring.
    pub queue_packets: usize,
    /// Bytes a sender may have waiting on its link before it stops taking
    /// packets from its QP (0: unlimited, every packet the QP has is queued
    /// at once). A socket's send buffer: a software device hands the kernel
    /// what fits and keeps the rest in the QP, where what is more urgent (an
    /// answer to a READ asked again) can still go ahead of it.
    pub send_buffer_bytes: usize,
}

impl Default for Link {
    fn default() -> Self {
        Link {
            delay_ns: 2_000,
            jitter_ns: 0,
            bytes_per_ns: 1.25,
            loss: 0.0,
            dup: 0.0,
            ce: 0.0,
            queue_packets: 0,
            send_buffer_bytes: 0,
        }
    }
}

/// Counters of what the network did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Packets handed to the network.
    pub sent: u64,
    /// Packets dropped (at random or by a full queue).
    pub lost: u64,
    /// Of those, dropped by a full queue ([`Link::queue_packets`]).
    pub queue_drops: u64,
    /// Extra copies delivered.
    pub duplicated: u64,
    /// Packets delivered.
    pub delivered: u64,
    /// Bytes handed to the network (transport bytes + 4 ICRC).
    pub bytes: u64,
}

/// A packet on the wire: ordered by arrival time, then by send order.
#[derive(PartialEq, Eq, PartialOrd, Ord)]
struct InFlight {
    at: u64,
    seq: u64,
    to_b: bool,
    bytes: Vec<u8>,
    ce: bool,
}

/// Two connected QPs (`a`, `b`), their memories, and the network between them.
pub struct Sim {
    /// Side A.
    pub a: Qp,
    /// Side B.
    pub b: Qp,
    /// A's registered memory (what B's one-sided operations reach).
    pub mem_a: VecMemory,
    /// B's registered memory.
    pub mem_b: VecMemory,
    /// Completions A reported, in order.
    pub done_a: Vec<Completion>,
    /// Completions B reported, in order.
    pub done_b: Vec<Completion>,
    /// Simulated time (ns).
    pub now: u64,
    /// Network counters.
    pub net: NetStats,
    link: Link,
    rng: u64,
    seq: u64,
    queue: BinaryHeap<Reverse<InFlight>>,
    free_at: [u64; 2],
    capture: Option<Vec<(u64, RoceFrame)>>,
}

impl Sim {
    /// QPs 0x11 (A) and 0x22 (B), connected with PSNs just below the 24-bit wrap.
    pub fn new(cfg_a: QpConfig, cfg_b: QpConfig, link: Link, seed: u64) -> Sim {
        let mut a = Qp::new(cfg_a, 0x11);
        let mut b = Qp::new(cfg_b, 0x22);
        let (pa, pb) = (0xFF_FFF0, 0xFF_FF80);
        a.connect(0x22, pa, pb).expect("fresh QP");
        b.connect(0x11, pb, pa).expect("fresh QP");
        Sim {
            a,
            b,
            mem_a: VecMemory::default(),
            mem_b: VecMemory::default(),
            done_a: Vec::new(),
            done_b: Vec::new(),
            now: 0,
            net: NetStats::default(),
            link,
            rng: seed ^ 0x9E37_79B9_7F4A_7C15,
            seq: 0,
            queue: BinaryHeap::new(),
            free_at: [0, 0],
            capture: None,
        }
    }

    /// Start recording every packet either side sends, as the Ethernet/IPv4/UDP
    /// frame a soft RoCE provider would put on the wire (A = 198.18.0.1,
    /// B = 198.18.0.2, ECT(0)), with the send time.
    pub fn start_capture(&mut self) {
        self.capture = Some(Vec::new());
    }

    /// The frames recorded since [`Sim::start_capture`], with send times (ns).
    pub fn captured(&self) -> &[(u64, RoceFrame)] {
        self.capture.as_deref().unwrap_or(&[])
    }

    /// The frame path of packets sent by A (`from_a`) or B.
    pub fn path(from_a: bool) -> FramePath {
        let (a, b) = (
            "198.18.0.1".parse().expect("ip"),
            "198.18.0.2".parse().expect("ip"),
        );
        let (src, dst) = if from_a { (a, b) } else { (b, a) };
        FramePath {
            src_mac: [2, 0, 0, 0, 0, if from_a { 0xa } else { 0xb }],
            dst_mac: [2, 0, 0, 0, 0, if from_a { 0xb } else { 0xa }],
            src,
            dst,
            sport: if from_a { 0xC011 } else { 0xC022 },
            ecn: 2,
            flow_label: 0,
        }
    }

    fn rand(&mut self) -> f64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    fn send(&mut self, from_a: bool, p: Packet) {
        if let Some(cap) = self.capture.as_mut() {
            cap.push((self.now, RoceFrame::new(&Sim::path(from_a), p.clone())));
        }
        let mut bytes = Vec::with_capacity(p.encoded_len());
        p.encode(&mut bytes);
        self.net.sent += 1;
        self.net.bytes += bytes.len() as u64 + 4;
        let dir = usize::from(!from_a);
        // Serialise on the sender's link, then propagate.
        let start = self.free_at[dir].max(self.now);
        let tx = ((bytes.len() + 4 + 58) as f64 / self.link.bytes_per_ns) as u64;
        // Tail drop: the queue ahead of this packet, in packets of its size.
        let ahead = (start - self.now) / tx.max(1);
        if self.link.queue_packets > 0 && ahead >= self.link.queue_packets as u64 {
            self.net.lost += 1;
            self.net.queue_drops += 1;
            return;
        }
        self.free_at[dir] = start + tx;
        if self.rand() < self.link.loss {
            self.net.lost += 1;
            return;
        }
        let copies = if self.rand() < self.link.dup { 2 } else { 1 };
        self.net.duplicated += copies - 1;
        for _ in 0..copies {
            let jitter = if self.link.jitter_ns > 0 {
                (self.rand() * self.link.jitter_ns as f64) as u64
            } else {
                0
            };
            self.seq += 1;
            let ce = self.rand() < self.link.ce;
            self.queue.push(Reverse(InFlight {
                at: start + tx + self.link.delay_ns + jitter,
                seq: self.seq,
                // A packet from A goes to B.
                to_b: from_a,
                bytes: bytes.clone(),
                ce,
            }));
        }
    }

    /// The link's behaviour.
    pub fn link(&self) -> Link {
        self.link
    }

    /// Change the link's behaviour from now on.
    pub fn set_link(&mut self, link: Link) {
        self.link = link;
    }

    /// When the sender on link `dir` (0: A's) has room for more under
    /// [`Link::send_buffer_bytes`]: now, or when enough has left the link.
    fn room_at(&self, dir: usize) -> u64 {
        let buffer = self.link.send_buffer_bytes;
        if buffer == 0 {
            return self.now;
        }
        let drain = (buffer as f64 / self.link.bytes_per_ns) as u64;
        self.free_at[dir].saturating_sub(drain).max(self.now)
    }

    /// Advance to the next event. Returns false when nothing is left to do.
    pub fn step(&mut self) -> bool {
        let now = self.now;
        while self.room_at(0) <= now {
            let Some(p) = self.a.poll_transmit(now) else {
                break;
            };
            self.send(true, p);
        }
        while self.room_at(1) <= now {
            let Some(p) = self.b.poll_transmit(now) else {
                break;
            };
            self.send(false, p);
        }
        let next_arrival = self.queue.peek().map(|Reverse(e)| e.at);
        // A sender stopped by a full send buffer takes more once it drains.
        let room = [0, 1]
            .map(|dir| Some(self.room_at(dir)).filter(|&t| t > now))
            .into_iter()
            .flatten()
            .min();
        let next = [
            next_arrival,
            room,
            self.a.poll_timeout(),
            self.b.poll_timeout(),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(t) = next else {
            return false;
        };
        self.now = self.now.max(t);
        while self.queue.peek().is_some_and(|Reverse(e)| e.at <= self.now) {
            let Reverse(InFlight {
                to_b, bytes, ce, ..
            }) = self.queue.pop().expect("peeked");
            self.net.delivered += 1;
            let pkt = Packet::decode(&bytes).expect("the simulator carries valid packets");
            if to_b {
                self.b.handle_packet(self.now, &pkt, ce, &mut self.mem_b);
            } else {
                self.a.handle_packet(self.now, &pkt, ce, &mut self.mem_a);
            }
        }
        self.a.handle_timeout(self.now);
        self.b.handle_timeout(self.now);
        while let Some(c) = self.a.poll_completion() {
            self.done_a.push(c);
        }
        while let Some(c) = self.b.poll_completion() {
            self.done_b.push(c);
        }
        true
    }

    /// Step until `done(self)` or `max_ns` of simulated time pass. Returns
    /// whether `done` became true.
    pub fn run_until(&mut self, max_ns: u64, mut done: impl FnMut(&Sim) -> bool) -> bool {
        while !done(self) {
            if self.now > max_ns || !self.step() {
                return done(self);
            }
        }
        true
    }
}
