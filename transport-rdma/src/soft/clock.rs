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
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use rustix::time::{
    timerfd_create, timerfd_settime, Itimerspec, TimerfdClockId, TimerfdFlags, TimerfdTimerFlags,
    Timespec,
};
use tokio::io::unix::AsyncFd;

/// A one-shot timer on a `timerfd`, armed from any thread: the timer task
/// waits on it, and a queue pair whose deadline comes before the one it is
/// armed for arms it itself, with no wake-up of the timer task.
pub(crate) struct PreciseTimer {
    fd: AsyncFd<OwnedFd>,
    /// When the timer fires next (`None`: disarmed, or fired and read).
    /// Held while arming and while reading an expiry, so that the two never
    /// interleave: an arming that comes after the expiry it replaces resets
    /// the kernel's count, and [`PreciseTimer::fired`] keeps waiting.
    armed: Mutex<Option<Instant>>,
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
            armed: Mutex::new(None),
        })
    }

    /// Sleep for `d`: [`PreciseTimer::arm_by`], then [`PreciseTimer::fired`].
    #[cfg(test)]
    pub(crate) async fn sleep(&self, d: Duration) -> io::Result<()> {
        self.arm_by(Instant::now() + d)?;
        self.fired().await
    }

    /// Make the timer fire at `at` at the latest: arm it for `at` unless it
    /// is armed for that or earlier already (one system call only when the
    /// instant moves earlier). An instant already past fires at once.
    pub(crate) fn arm_by(&self, at: Instant) -> io::Result<()> {
        let mut armed = self.armed.lock();
        if armed.is_some_and(|a| a <= at) {
            return Ok(());
        }
        self.set(at.saturating_duration_since(Instant::now()))?;
        *armed = Some(at);
        Ok(())
    }

    /// When the timer is armed to fire (`None`: it is not).
    #[cfg(test)]
    pub(crate) fn armed(&self) -> Option<Instant> {
        *self.armed.lock()
    }

    /// Arm the kernel's timer to fire once, `d` from now (at least 1 ns: a
    /// zero time would disarm it), replacing any earlier arming. Re-arming
    /// also clears an expiry nobody read (the kernel resets the count).
    fn set(&self, d: Duration) -> io::Result<()> {
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

    /// Wait until the armed timer fires (for ever if it is not armed);
    /// then it is disarmed. Cancel-safe: dropping the future leaves the
    /// timer armed.
    pub(crate) async fn fired(&self) -> io::Result<()> {
        loop {
            let mut ready = self.fd.readable().await?;
            let fired = {
                let mut armed = self.armed.lock();
                let fired = self.drain()?;
                if fired {
                    *armed = None;
                }
                fired
            };
            // Read or not, the fd is not readable now (an arming since
            // reset the count). An expiry after this point is a new event,
            // which `clear_ready` leaves alone (tokio compares the tick).
            ready.clear_ready();
            if fired {
                return Ok(());
            }
        }
    }

    /// Read an expiry if there is one.
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

    /// Arming only ever moves the timer earlier; a fire disarms it, so the
    /// next arming counts from scratch. A later instant than the armed one
    /// leaves the timer alone (one system call per earlier instant, none
    /// per later one), and the timer fires at the earliest asked for.
    #[tokio::test(flavor = "current_thread")]
    async fn arming_only_moves_earlier_and_a_fire_disarms() {
        let t = PreciseTimer::new().unwrap();
        let start = Instant::now();
        let first = start + Duration::from_millis(50);
        t.arm_by(first).unwrap();
        t.arm_by(start + Duration::from_millis(100)).unwrap();
        assert_eq!(t.armed(), Some(first), "a later instant changes nothing");
        let soon = start + Duration::from_micros(300);
        t.arm_by(soon).unwrap();
        assert_eq!(t.armed(), Some(soon));
        t.fired().await.unwrap();
        let took = start.elapsed();
        assert!(took >= Duration::from_micros(300), "woke early: {took:?}");
        assert!(
            took < Duration::from_millis(50),
            "fired at the first arming's time, not the earlier one: {took:?}"
        );
        assert_eq!(t.armed(), None, "a fire disarms");
        // Armed again from scratch: it does not fire before this instant.
        let start = Instant::now();
        t.sleep(Duration::from_millis(3)).await.unwrap();
        assert!(
            start.elapsed() >= Duration::from_millis(3),
            "{:?}",
            start.elapsed()
        );
    }

    /// Another thread arms the timer while a task waits on it: the task
    /// wakes when it fires (the queue pairs arm it from the worker they
    /// run on, the timer task waits wherever it was last polled).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_timer_armed_from_another_thread_wakes_its_waiter() {
        let t = std::sync::Arc::new(PreciseTimer::new().unwrap());
        let armer = t.clone();
        let start = Instant::now();
        let th = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            armer
                .arm_by(Instant::now() + Duration::from_micros(200))
                .unwrap();
        });
        tokio::time::timeout(Duration::from_secs(10), t.fired())
            .await
            .expect("the waiter woke")
            .unwrap();
        th.join().unwrap();
        assert!(start.elapsed() >= Duration::from_millis(2));
        assert_eq!(t.armed(), None);
    }
}
