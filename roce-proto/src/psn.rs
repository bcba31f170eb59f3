//! 24-bit packet sequence numbers (rocev2-reference §6).

/// PSNs wrap at 2^24.
pub const PSN_MASK: u32 = 0x00FF_FFFF;

/// `a + n` modulo 2^24.
pub fn add(a: u32, n: u32) -> u32 {
    a.wrapping_add(n) & PSN_MASK
}

/// Signed distance `a − b` in the 24-bit space (rxe `psn_compare`):
/// positive when `a` is after `b`, within a half window of 2^23.
pub fn diff(a: u32, b: u32) -> i32 {
    (a.wrapping_sub(b) << 8) as i32 >> 8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps() {
        assert_eq!(add(PSN_MASK, 1), 0);
        assert_eq!(add(PSN_MASK - 1, 5), 3);
        assert_eq!(diff(3, PSN_MASK - 1), 5);
        assert_eq!(diff(PSN_MASK - 1, 3), -5);
        assert_eq!(diff(7, 7), 0);
        assert_eq!(diff(1 << 22, 0), 1 << 22);
    }
}
