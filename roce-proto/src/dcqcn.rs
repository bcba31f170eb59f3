//! DCQCN congestion control (rocev2-reference §11; Zhu et al., SIGCOMM 2015):
//! the reaction point (the sender's rate limiter) and the CNP spacing of the
//! notification point. Time is the caller's nanosecond counter.

/// Parameters (defaults as in the reference: g = 1/256, K = 55 µs, increase
/// timer 55 µs, B = 10 MB, F = 5, R_AI = 40 Mb/s, R_HAI = 10 × R_AI, CNP
/// spacing N = 50 µs).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DcqcnConfig {
    /// Line rate in bit/s: the rate before any CNP and the ceiling afterwards.
    pub line_rate_bps: f64,
    /// Lowest rate a cut may reach, in bit/s.
    pub min_rate_bps: f64,
    /// α gain g.
    pub g: f64,
    /// α decay period K without CNPs (ns).
    pub alpha_period_ns: u64,
    /// Rate increase timer (ns).
    pub increase_period_ns: u64,
    /// Byte counter B for rate increase events.
    pub byte_counter: u64,
    /// Fast recovery stages F.
    pub fast_recovery_stages: u32,
    /// Additive increase step R_AI (bit/s).
    pub ai_rate_bps: f64,
    /// Hyper increase step R_HAI (bit/s).
    pub hai_rate_bps: f64,
    /// Notification point: at most one CNP per QP per this many ns (N).
    pub cnp_interval_ns: u64,
}

impl Default for DcqcnConfig {
    fn default() -> Self {
        DcqcnConfig {
            line_rate_bps: 10e9,
            min_rate_bps: 10e6,
            g: 1.0 / 256.0,
            alpha_period_ns: 55_000,
            increase_period_ns: 55_000,
            byte_counter: 10_000_000,
            fast_recovery_stages: 5,
            ai_rate_bps: 40e6,
            hai_rate_bps: 400e6,
            cnp_interval_ns: 50_000,
        }
    }
}

/// The reaction point of one QP.
#[derive(Clone, Debug)]
pub struct Dcqcn {
    cfg: DcqcnConfig,
    /// Current rate RC (bit/s).
    rc: f64,
    /// Target rate RT (bit/s).
    rt: f64,
    alpha: f64,
    /// Timer stage count T and byte stage count BC.
    t: u32,
    bc: u32,
    bytes: u64,
    /// Rate limiting is active (a CNP was received and the rate has not
    /// recovered to line rate).
    limited: bool,
    next_alpha: u64,
    next_increase: u64,
    cnps: u64,
}

impl Dcqcn {
    /// A reaction point at line rate with α = 1.
    pub fn new(cfg: DcqcnConfig) -> Dcqcn {
        Dcqcn {
            cfg,
            rc: cfg.line_rate_bps,
            rt: cfg.line_rate_bps,
            alpha: 1.0,
            t: 0,
            bc: 0,
            bytes: 0,
            limited: false,
            next_alpha: 0,
            next_increase: 0,
            cnps: 0,
        }
    }

    /// Current sending rate (bit/s); `None` when not limited (line rate).
    pub fn rate_bps(&self) -> Option<f64> {
        self.limited.then_some(self.rc)
    }

    /// Current α.
    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// CNPs handled.
    pub fn cnps(&self) -> u64 {
        self.cnps
    }

    /// A CNP arrived: cut the rate (`RT = RC; RC = RC·(1 − α/2); α = (1−g)·α + g`)
    /// and restart the increase stages.
    pub fn on_cnp(&mut self, now: u64) {
        self.advance(now);
        self.cnps += 1;
        self.rt = self.rc;
        self.rc = (self.rc * (1.0 - self.alpha / 2.0)).max(self.cfg.min_rate_bps);
        self.alpha = (1.0 - self.cfg.g) * self.alpha + self.cfg.g;
        self.t = 0;
        self.bc = 0;
        self.bytes = 0;
        self.limited = true;
        self.next_alpha = now + self.cfg.alpha_period_ns;
        self.next_increase = now + self.cfg.increase_period_ns;
    }

    /// `n` bytes were sent: the byte counter may trigger increase events.
    pub fn on_sent(&mut self, now: u64, n: u64) {
        self.advance(now);
        if !self.limited {
            return;
        }
        self.bytes += n;
        while self.bytes >= self.cfg.byte_counter {
            self.bytes -= self.cfg.byte_counter;
            self.bc += 1;
            self.increase();
        }
    }

    /// Run the α decay and the increase timer up to `now` (lazily, so no
    /// wake-ups are needed while idle).
    pub fn advance(&mut self, now: u64) {
        if !self.limited {
            return;
        }
        while now >= self.next_alpha {
            self.alpha *= 1.0 - self.cfg.g;
            self.next_alpha += self.cfg.alpha_period_ns;
        }
        while self.limited && now >= self.next_increase {
            self.next_increase += self.cfg.increase_period_ns;
            self.t += 1;
            self.increase();
        }
    }

    /// One rate increase event: fast recovery, additive or hyper increase.
    fn increase(&mut self) {
        let f = self.cfg.fast_recovery_stages;
        let (lo, hi) = (self.t.min(self.bc), self.t.max(self.bc));
        if hi <= f {
            // Fast recovery: halfway back to the target.
        } else if lo > f {
            self.rt += f64::from(lo - f) * self.cfg.hai_rate_bps;
        } else {
            self.rt += self.cfg.ai_rate_bps;
        }
        self.rt = self.rt.min(self.cfg.line_rate_bps);
        self.rc = ((self.rt + self.rc) / 2.0).min(self.cfg.line_rate_bps);
        if self.cfg.line_rate_bps - self.rc < 1.0 {
            self.rc = self.cfg.line_rate_bps;
            self.limited = false;
        }
    }

    /// Nanoseconds the rate allows for `bytes` on the wire (0 when not limited).
    pub fn pace_ns(&self, bytes: u64) -> u64 {
        match self.rate_bps() {
            Some(r) => (bytes as f64 * 8.0 * 1e9 / r) as u64,
            None => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cut_then_recover_to_line_rate() {
        let cfg = DcqcnConfig::default();
        let mut d = Dcqcn::new(cfg);
        assert_eq!(d.rate_bps(), None);
        d.on_cnp(0);
        // α = 1: the first cut halves the rate.
        assert_eq!(d.rate_bps(), Some(5e9));
        assert!(
            (d.alpha() - 1.0).abs() < 1e-12,
            "α stays 1 after (1−g)·1 + g"
        );
        // Fast recovery: five timer stages each halve the gap to RT = 10 Gb/s.
        d.advance(5 * cfg.increase_period_ns);
        let gap = 10e9 - d.rate_bps().unwrap();
        assert!((gap - 5e9 / 32.0).abs() < 1.0, "gap {gap}");
        // α decays while no CNP comes.
        assert!(d.alpha() < 1.0);
        d.advance(100 * cfg.increase_period_ns);
        assert_eq!(d.rate_bps(), None, "back at line rate");
        assert_eq!(d.cnps(), 1);
    }

    #[test]
    fn repeated_cnps_drive_alpha_up_and_rate_down() {
        let cfg = DcqcnConfig::default();
        let mut d = Dcqcn::new(cfg);
        let mut now = 0;
        for _ in 0..20 {
            d.on_cnp(now);
            now += 10_000;
        }
        assert!(d.rate_bps().unwrap() < 1e8, "{:?}", d.rate_bps());
        assert!(d.rate_bps().unwrap() >= cfg.min_rate_bps);
        assert!(d.alpha() > 0.9);
        // Pacing follows the rate: 1000 bytes at the current rate.
        let r = d.rate_bps().unwrap();
        assert_eq!(d.pace_ns(1000), (8000.0 * 1e9 / r) as u64);
    }

    #[test]
    fn byte_counter_triggers_increases() {
        let cfg = DcqcnConfig {
            byte_counter: 1000,
            ..DcqcnConfig::default()
        };
        let mut d = Dcqcn::new(cfg);
        d.on_cnp(0);
        let after_cut = d.rate_bps().unwrap();
        d.on_sent(1, 3000);
        assert!(d.rate_bps().unwrap_or(cfg.line_rate_bps) > after_cut);
    }
}
