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
    // Masked copies of the headers on the stack (IPv4 options make it up to 60 B).
    let mut h = crc32fast::Hasher::new();
    h.update(&[0xFF; 8]);
    let mut iph = [0u8; 60];
    let n = ip.len().min(60);
    iph[..n].copy_from_slice(&ip[..n]);
    match ip.first().map(|b| b >> 4) {
        Some(6) if n >= 40 => mask_ipv6(&mut iph[..n]),
        _ if n >= 12 => mask_ipv4(&mut iph[..n]),
        _ => {}
    }
    h.update(&iph[..n]);
    let mut u = [0u8; 8];
    let un = udp.len().min(8);
    u[..un].copy_from_slice(&udp[..un]);
    u[6] = 0xFF; // UDP checksum
    u[7] = 0xFF;
    h.update(&u);
    let tn = transport.len().min(12);
    let mut t = [0u8; 12];
    t[..tn].copy_from_slice(&transport[..tn]);
    if tn > 4 {
        t[4] = 0xFF; // BTH FECN | BECN | resv6a
    }
    h.update(&t[..tn]);
    if transport.len() > 12 {
        h.update(&transport[12..]);
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
#[derive(Debug, Default)]
pub struct Ipv4IdSolver {
    /// Per number of bytes after the Identification field: the 16 basis vectors.
    basis: std::collections::HashMap<usize, [u32; 16]>,
}

impl Ipv4IdSolver {
    /// A solver with an empty cache.
    pub fn new() -> Ipv4IdSolver {
        Ipv4IdSolver::default()
    }

    fn basis_for(&mut self, after: usize) -> [u32; 16] {
        *self.basis.entry(after).or_insert_with(|| {
            let zeros = vec![0u8; after + 2];
            let z = crc32fast::hash(&zeros);
            let mut b = [0u32; 16];
            let mut m = zeros.clone();
            for (i, v) in b.iter_mut().enumerate() {
                // Bit i of the 16-bit field (big endian on the wire).
                m[0] = 0;
                m[1] = 0;
                let bit = 1u16 << i;
                m[..2].copy_from_slice(&bit.to_be_bytes());
                *v = crc32fast::hash(&m) ^ z;
            }
            b
        })
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
        // Bytes after the Identification field: rest of the IP header (from
        // offset 6), UDP header, transport bytes.
        let after = (ip.len() - 6) + udp.len() + transport.len();
        let basis = self.basis_for(after);
        solve_gf2(&basis, c0 ^ wire_icrc)
    }
}

/// Find `x` with `⊕ { basis[i] : bit i of x }` = `target` (Gaussian elimination).
fn solve_gf2(basis: &[u32; 16], target: u32) -> Option<u16> {
    // Rows: (vector, combination of original indices that produced it).
    let mut rows: Vec<(u32, u16)> = basis
        .iter()
        .enumerate()
        .map(|(i, &v)| (v, 1u16 << i))
        .collect();
    let mut t = (target, 0u16);
    let mut pivot_rows: Vec<(u32, u16)> = Vec::with_capacity(16);
    for bit in (0..32).rev() {
        let mask = 1u32 << bit;
        let Some(p) = rows.iter().position(|r| r.0 & mask != 0) else {
            continue;
        };
        let pr = rows.swap_remove(p);
        for r in rows.iter_mut() {
            if r.0 & mask != 0 {
                r.0 ^= pr.0;
                r.1 ^= pr.1;
            }
        }
        pivot_rows.push(pr);
    }
    for &(v, c) in &pivot_rows {
        let top = 31 - v.leading_zeros();
        if t.0 & (1 << top) != 0 {
            t.0 ^= v;
            t.1 ^= c;
        }
    }
    (t.0 == 0).then_some(t.1)
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
}
