//! The invariant CRC (rocev2-reference §9): CRC-32 (IEEE, as zlib/Ethernet)
//! over `8 × 0xFF ‖ IP header ‖ UDP header ‖ BTH … pad`, with the fields that
//! change in flight masked to ones, stored least-significant byte first.

/// IPv4 header bytes with TOS, TTL and checksum masked to ones.
fn mask_ipv4(m: &mut [u8]) {
    m[1] = 0xFF; // TOS: DSCP + ECN
    m[8] = 0xFF; // TTL
    m[10] = 0xFF; // header checksum
    m[11] = 0xFF;
}

/// IPv6 header bytes with traffic class, flow label and hop limit masked to ones.
fn mask_ipv6(m: &mut [u8]) {
    m[0] |= 0x0F; // traffic class high nibble (version kept)
    m[1] = 0xFF; // traffic class low nibble + flow label
    m[2] = 0xFF;
    m[3] = 0xFF;
    m[7] = 0xFF; // hop limit
}

/// The ICRC value of a packet: `ip` is the IP header (20+ bytes for IPv4, 40 for
/// IPv6), `udp` the 8-byte UDP header, `transport` the BTH through the pad
/// (without ICRC). On the wire it is stored as `value.to_le_bytes()`.
pub fn compute(ip: &[u8], udp: &[u8], transport: &[u8]) -> u32 {
    compute_parts(ip, udp, &[transport])
}

/// [`compute`] with the transport bytes (BTH through pad) given in parts, as
/// a gathered send holds them (headers, payload, pad): the same value as
/// over their concatenation.
pub fn compute_parts(ip: &[u8], udp: &[u8], transport: &[&[u8]]) -> u32 {
    // The masked prefix (8 × 0xFF, IP header, UDP header, BTH) gathered on
    // the stack and hashed in one update: a hash update per header costs
    // more than the bytes do. IPv4 options make the IP header up to 60 B.
    let mut pre = [0u8; 8 + 60 + 8 + 12];
    pre[..8].fill(0xFF);
    let n = ip.len().min(60);
    let iph = &mut pre[8..8 + n];
    iph.copy_from_slice(&ip[..n]);
    match ip.first().map(|b| b >> 4) {
        Some(6) if n >= 40 => mask_ipv6(iph),
        _ if n >= 12 => mask_ipv4(iph),
        _ => {}
    }
    let mut at = 8 + n;
    let un = udp.len().min(8);
    pre[at..at + un].copy_from_slice(&udp[..un]);
    if un < 8 {
        pre[at + un..at + 8].fill(0);
    }
    pre[at + 6] = 0xFF; // UDP checksum
    pre[at + 7] = 0xFF;
    at += 8;
    // The BTH (the first 12 transport bytes, wherever the parts split it).
    let bth = at;
    for p in transport {
        let take = (bth + 12 - at).min(p.len());
        pre[at..at + take].copy_from_slice(&p[..take]);
        at += take;
        if at == bth + 12 {
            break;
        }
    }
    if at > bth + 4 {
        pre[bth + 4] = 0xFF; // BTH FECN | BECN | resv6a
    }
    let mut h = crc32fast::Hasher::new();
    h.update(&pre[..at]);
    let mut skip = 12;
    for p in transport {
        if skip >= p.len() {
            skip -= p.len();
            continue;
        }
        h.update(&p[skip..]);
        skip = 0;
    }
    h.finalize()
}

/// Recovers the IPv4 Identification field from a packet's ICRC.
///
/// The ICRC covers the IPv4 Identification field (rocev2-reference §9), which a
/// UDP socket neither lets its sender choose nor shows its receiver. CRC-32 is
/// affine over GF(2), so the ICRC of the packet with identification `x` is
/// `icrc(x = 0) ⊕ Σ xᵢ·Bᵢ` where `Bᵢ` depends only on the bytes that follow the
/// field. Solving that 32 × 16 system finds the one `x` (if any) under which the
/// wire ICRC verifies. A packet corrupted elsewhere still fails unless its error
/// happens to lie in the 16-dimensional span: probability 2⁻¹⁶ instead of 2⁻³².
/// IPv6 has no such field and is verified exactly.
#[derive(Debug)]
pub struct Ipv4IdSolver {
    /// Per number of bytes after the Identification field: the system's
    /// basis, already eliminated (the work per packet is then a reduction).
    echelons: std::collections::HashMap<usize, Echelon>,
    /// The lengths looked up last and their echelons, searched first. A
    /// stream's datagrams mostly come in a few lengths, alternating: a send
    /// ping-pong brings each end its peer's ACK and its peer's message in
    /// turn, and a one-entry cache missed on every packet, a hash lookup and
    /// two copies of the echelon each (1.5% of such a run's CPU).
    recent: [(usize, Echelon); RECENT],
    /// The `recent` slot the next miss replaces (round robin).
    next: usize,
}

/// Lengths [`Ipv4IdSolver`] keeps at hand without a hash lookup.
const RECENT: usize = 4;

impl Default for Ipv4IdSolver {
    fn default() -> Ipv4IdSolver {
        Ipv4IdSolver {
            echelons: std::collections::HashMap::new(),
            recent: [(usize::MAX, Echelon::default()); RECENT],
            next: 0,
        }
    }
}

/// Lengths a solver keeps eliminated bases for; past that the cache starts
/// over (a peer choosing lengths cannot grow it without bound).
const MAX_CACHED_LENGTHS: usize = 4096;

/// A basis of 16 vectors over GF(2)³² in echelon form: rows with distinct
/// leading bits, the highest first, each with the combination of original
/// basis vectors (bit i: vector i) that sums to it.
#[derive(Clone, Copy, Debug, Default)]
struct Echelon {
    rows: [(u32, u16); 16],
    len: usize,
}

impl Echelon {
    /// Gaussian elimination of `basis`, pivoting on the highest bit first.
    fn of(basis: &[u32; 16]) -> Echelon {
        let mut rest: [(u32, u16); 16] = std::array::from_fn(|i| (basis[i], 1u16 << i));
        let mut left = 16;
        let mut e = Echelon {
            rows: [(0, 0); 16],
            len: 0,
        };
        for bit in (0..32).rev() {
            let mask = 1u32 << bit;
            let Some(p) = rest[..left].iter().position(|r| r.0 & mask != 0) else {
                continue;
            };
            let pivot = rest[p];
            left -= 1;
            rest.swap(p, left);
            for r in rest[..left].iter_mut() {
                if r.0 & mask != 0 {
                    r.0 ^= pivot.0;
                    r.1 ^= pivot.1;
                }
            }
            e.rows[e.len] = pivot;
            e.len += 1;
        }
        e
    }

    /// Find `x` with `⊕ { basis[i] : bit i of x }` = `target`, if there is one.
    fn solve(&self, target: u32) -> Option<u16> {
        let (mut t, mut x) = (target, 0u16);
        for &(v, c) in &self.rows[..self.len] {
            let top = 31 - v.leading_zeros();
            if t & (1 << top) != 0 {
                t ^= v;
                x ^= c;
            }
        }
        (t == 0).then_some(x)
    }
}

impl Ipv4IdSolver {
    /// A solver with an empty cache.
    pub fn new() -> Ipv4IdSolver {
        Ipv4IdSolver::default()
    }

    /// The 16 basis vectors for `after` bytes following the field: the ICRC
    /// change that setting each bit of the field makes.
    fn basis(after: usize) -> [u32; 16] {
        let zeros = vec![0u8; after + 2];
        let z = crc32fast::hash(&zeros);
        let mut b = [0u32; 16];
        let mut m = zeros;
        for (i, v) in b.iter_mut().enumerate() {
            // Bit i of the 16-bit field (big endian on the wire).
            m[..2].copy_from_slice(&(1u16 << i).to_be_bytes());
            *v = crc32fast::hash(&m) ^ z;
        }
        b
    }

    fn echelon_for(&mut self, after: usize) -> &Echelon {
        if let Some(i) = self.recent.iter().position(|(n, _)| *n == after) {
            return &self.recent[i].1;
        }
        if self.echelons.len() >= MAX_CACHED_LENGTHS {
            self.echelons.clear();
        }
        let e = *self
            .echelons
            .entry(after)
            .or_insert_with(|| Echelon::of(&Self::basis(after)));
        let slot = self.next;
        self.next = (slot + 1) % RECENT;
        self.recent[slot] = (after, e);
        &self.recent[slot].1
    }

    /// The Identification value under which `wire_icrc` is the packet's ICRC,
    /// given its IPv4 header `ip` (any Identification), UDP header and transport
    /// bytes; `None` if there is none (the packet is corrupt).
    pub fn solve(
        &mut self,
        ip: &[u8],
        udp: &[u8],
        transport: &[u8],
        wire_icrc: u32,
    ) -> Option<u16> {
        let mut h = [0u8; 60];
        let n = ip.len().min(60);
        h[..n].copy_from_slice(&ip[..n]);
        h[4] = 0;
        h[5] = 0;
        let c0 = compute(&h[..n], udp, transport);
        if c0 == wire_icrc {
            // Identification 0, what an unconnected sender's DF datagrams
            // carry (every soft device's): no system to look up and reduce.
            return Some(0);
        }
        // Bytes after the Identification field: rest of the IP header (from
        // offset 6), UDP header, transport bytes.
        let after = (ip.len() - 6) + udp.len() + transport.len();
        self.echelon_for(after).solve(c0 ^ wire_icrc)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.chars().filter(|c| c.is_ascii_hexdigit()).collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    /// The ConnectX-4 Lx CNP worked vector (rocev2-reference §9).
    #[test]
    fn cx4_cnp_vector() {
        let f = hex("e41d2dab2bc2 7cfe90643b32 0800 45c2003c718c400040119161 0a001101 0a001201 000012b700280000 8100ffff 40000118 00000000 00000000000000000000000000000000 82fd002a");
        let (ip, udp, t) = (&f[14..34], &f[34..42], &f[42..f.len() - 4]);
        let v = compute(ip, udp, t);
        assert_eq!(v, 0x2a00_fd82);
        assert_eq!(v.to_le_bytes(), [0x82, 0xfd, 0x00, 0x2a]);
    }

    /// The crafted WRITE ONLY vector (rocev2-reference §9), and its twin with
    /// FECN, ECN and TTL changed: the same ICRC.
    #[test]
    fn crafted_write_vector_and_invariance() {
        let f = hex("020000000002 020000000001 0800 4502004c 0000 4000 4011 269d 0a000001 0a000002 c123 12b7 0038 0000 0a30ffff 00000123 80fffffe 00007f0012345000 a1b2c3d4 0000000d 68656c6c6f2c2072646d612121 000000 57d282f0");
        let (ip, udp, t) = (&f[14..34], &f[34..42], &f[42..f.len() - 4]);
        assert_eq!(compute(ip, udp, t).to_le_bytes(), [0x57, 0xd2, 0x82, 0xf0]);
        let mut ip2 = ip.to_vec();
        ip2[1] = 0x03; // ECN CE
        ip2[8] = 0x01; // TTL
        let mut t2 = t.to_vec();
        t2[4] |= 0x80; // FECN
        let mut udp2 = udp.to_vec();
        udp2[6] = 0x12;
        assert_eq!(compute(&ip2, &udp2, &t2), compute(ip, udp, t));
        t2[11] ^= 1; // the PSN is covered
        assert_ne!(compute(&ip2, &udp2, &t2), compute(ip, udp, t));
    }

    /// Lengths that come back after others took the recent slots, in
    /// turn and out of turn, are solved as on their first look.
    #[test]
    fn lengths_cycling_through_the_recent_slots_solve_alike() {
        let mut ip = hex("4502004c 0000 4000 4011 0000 0a000001 0a000002");
        let udp = hex("c123 12b7 0038 0000");
        let mut solver = Ipv4IdSolver::new();
        let lengths = [12, 20, 12, 40, 60, 80, 100, 20, 12, 100, 13];
        for (k, &n) in lengths.iter().cycle().take(5 * lengths.len()).enumerate() {
            let t: Vec<u8> = (0..n).map(|i| (i * 31 + k) as u8).collect();
            let id = (k as u16).wrapping_mul(40503);
            ip[4..6].copy_from_slice(&id.to_be_bytes());
            let wire = compute(&ip, &udp, &t);
            ip[4..6].copy_from_slice(&[0xde, 0xad]);
            assert_eq!(
                solver.solve(&ip, &udp, &t, wire),
                Some(id),
                "length {n}, round {k}"
            );
        }
    }

    /// A packet sealed under Identification 0 (every unconnected sender's
    /// DF datagrams) is verified by its ICRC alone, whatever the header
    /// shows, without eliminating a system for its length; one corrupted
    /// elsewhere still goes through the system and fails.
    #[test]
    fn identification_zero_needs_no_system() {
        let mut ip = hex("4502004c 0000 4000 4011 0000 0a000001 0a000002");
        let udp = hex("c123 12b7 0038 0000");
        let t: Vec<u8> = (0..100u8).collect();
        let wire = compute(&ip, &udp, &t);
        ip[4..6].copy_from_slice(&[0x12, 0x34]);
        let mut solver = Ipv4IdSolver::new();
        assert_eq!(solver.solve(&ip, &udp, &t, wire), Some(0));
        assert!(solver.echelons.is_empty());
        let mut bad = t.clone();
        bad[50] ^= 0x80;
        assert_eq!(solver.solve(&ip, &udp, &bad, wire), None);
        assert_eq!(solver.echelons.len(), 1);
    }

    proptest::proptest! {
        /// Any Identification under which a packet was sealed is recovered
        /// from its ICRC, whatever the header says and whatever solves came
        /// before it (the cache of eliminated bases is per length).
        #[test]
        fn the_sealing_identification_is_recovered(
            id in proptest::prelude::any::<u16>(),
            shown in proptest::prelude::any::<u16>(),
            t in proptest::collection::vec(proptest::prelude::any::<u8>(), 12..600),
            earlier in proptest::collection::vec(12usize..600, 0..3 * RECENT),
        ) {
            let mut ip = hex("4502004c 0000 4000 4011 0000 0a000001 0a000002");
            let udp = hex("c123 12b7 0038 0000");
            let mut solver = Ipv4IdSolver::new();
            for n in earlier {
                // Sealed under a non-zero Identification, so that each
                // fills the solver's cache (zero takes a shortcut).
                let other = vec![7u8; n];
                let other_id = (n as u16).wrapping_mul(40503) | 1;
                ip[4..6].copy_from_slice(&other_id.to_be_bytes());
                let c = compute(&ip, &udp, &other);
                ip[4..6].copy_from_slice(&[0, 0]);
                proptest::prop_assert_eq!(solver.solve(&ip, &udp, &other, c), Some(other_id));
            }
            ip[4..6].copy_from_slice(&id.to_be_bytes());
            let wire = compute(&ip, &udp, &t);
            ip[4..6].copy_from_slice(&shown.to_be_bytes());
            proptest::prop_assert_eq!(solver.solve(&ip, &udp, &t, wire), Some(id));
        }
    }

    proptest::proptest! {
        /// Split anywhere, the transport bytes give the ICRC of their whole.
        #[test]
        fn parts_give_the_icrc_of_their_concatenation(
            t in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..200),
            cuts in proptest::collection::vec(0usize..200, 0..4),
        ) {
            let ip = hex("4502004c 1234 4000 4011 0000 0a000001 0a000002");
            let udp = hex("c123 12b7 0038 0000");
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(t.len())).collect();
            cuts.sort_unstable();
            let mut parts = Vec::new();
            let mut at = 0;
            for c in cuts {
                parts.push(&t[at..c]);
                at = c;
            }
            parts.push(&t[at..]);
            proptest::prop_assert_eq!(compute_parts(&ip, &udp, &parts), compute(&ip, &udp, &t));
        }
    }
}
