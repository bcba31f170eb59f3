//! A sleep with microsecond precision for the soft device's timer task.
//!
//! tokio's timer wheel has a one-millisecond tick and rounds every sleep up
//! to it. The engine's deadlines are finer than that: selective repeat
//! probes after two round trips plus 100 µs (a few hundred µs on a LAN),
//! and DCQCN paces packets microseconds apart. Rounded up to 1–2 ms, a
//! probe came as late as the retransmission timer it exists to beat: at 5%
//! loss over veth the simulator's 0.78× of lossless goodput was 0.45× on
//! the wire. A `timerfd` (CLOCK_MONOTONIC, an hrtimer) registered with the
//! runtime's reactor fires when asked.

use std::io;
use std::os::fd::OwnedFd;
use std::time::Duration;

use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
    Timespec,
};
use tokio::io::unix::AsyncFd;

/// A one-shot timer on a `timerfd`.
pub(crate) struct PreciseTimer {
    fd: AsyncFd<OwnedFd>,
}

impl PreciseTimer {
    /// A disarmed timer; needs a runtime with I/O enabled.
    pub(crate) fn new() -> io::Result<PreciseTimer> {
        let fd = timerfd_create(
            TimerfdClockId::Monotonic,
            TimerfdFlags::NONBLOCK | TimerfdFlags::CLOEXEC,
        )?;
        Ok(PreciseTimer {
            fd: crate::sys::register_fd(fd)?,
        })
    }

    /// Sleep for `d`: [`PreciseTimer::arm`], then [`PreciseTimer::fired`].
    #[cfg(test)]
    pub(crate) async fn sleep(&self, d: Duration) -> io::Result<()> {
        self.arm(d)?;
        self.fired().await
    }

    /// Arm the timer to fire once, `d` from now (at least 1 ns: a zero time
    /// would disarm it), replacing any earlier arming. Re-arming also
    /// clears an expiry nobody read (the kernel resets the count).
    pub(crate) fn arm(&self, d: Duration) -> io::Result<()> {
        let value = Timespec {
            tv_sec: d.as_secs() as _,
            tv_nsec: d.subsec_nanos().max(u32::from(d.as_secs() == 0)) as _,
        };
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let spec = Itimerspec {
            it_interval: zero,
            it_value: value,
        };
        timerfd_settime(self.fd.get_ref(), TimerfdTimerFlags::empty(), &spec)?;
        Ok(())
    }

    /// Wait until the armed timer fires (for ever if it is not armed).
    /// Cancel-safe: dropping the future leaves the timer armed.
    pub(crate) async fn fired(&self) -> io::Result<()> {
        loop {
            let mut ready = self.fd.readable().await?;
            let fired = self.drain()?;
            // Read or not, the fd is not readable now: the timer is one-shot
            // and is armed again only by `arm`, after this returns.
            ready.clear_ready();
            if fired {
                return Ok(());
            }
        }
    }

    /// Read the expiry count if there is one; true if the timer had fired.
    fn drain(&self) -> io::Result<bool> {
        let mut buf = [0u8; 8];
        match rustix::io::read(self.fd.get_ref(), &mut buf) {
            Ok(_) => Ok(true),
            Err(rustix::io::Errno::AGAIN) => Ok(false),
            Err(e) => Err(e.into()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Sleeps well below tokio's millisecond tick are not rounded up to it:
    /// of 50 sleeps of 200 µs none ends early and the quickest ends within
    /// a millisecond (tokio's own sleep never does for the same request; the
    /// quickest, not the median, so that a loaded CI host cannot fail it).
    #[tokio::test(flavor = "current_thread")]
    async fn sub_millisecond_sleeps_are_not_rounded_up() {
        let t = PreciseTimer::new().unwrap();
        let mut took: Vec<Duration> = Vec::new();
        for _ in 0..50 {
            let start = Instant::now();
            t.sleep(Duration::from_micros(200)).await.unwrap();
            took.push(start.elapsed());
        }
        took.sort();
        let median = took[took.len() / 2];
        assert!(
            took[0] >= Duration::from_micros(200),
            "woke early: {:?}",
            took[0]
        );
        assert!(took[0] < Duration::from_millis(1), "quickest {:?}", took[0]);
        let start = Instant::now();
        tokio::time::sleep(Duration::from_micros(200)).await;
        eprintln!(
            "timerfd median {median:?}; tokio's sleep {:?}",
            start.elapsed()
        );
    }

    /// A sleep dropped before it fires leaves nothing behind that would end
    /// the next sleep early.
    #[tokio::test(flavor = "current_thread")]
    async fn a_cancelled_sleep_does_not_end_the_next_one() {
        let t = PreciseTimer::new().unwrap();
        let _ = tokio::time::timeout(
            Duration::from_micros(50),
            t.sleep(Duration::from_micros(300)),
        )
        .await;
        std::thread::sleep(Duration::from_millis(1)); // the old expiry passes
        let start = Instant::now();
        t.sleep(Duration::from_millis(3)).await.unwrap();
        assert!(
            start.elapsed() >= Duration::from_millis(3),
            "{:?}",
            start.elapsed()
        );
    }
}
