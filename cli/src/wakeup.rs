//! What this host charges to wake a sleeping thread: `rdmx doctor`'s
//! wake-up probe.
//!
//! Every hop between processes (application → transport → peer process)
//! ends in the kernel waking a thread blocked in `epoll_wait` or `read`. On
//! bare metal that costs a few microseconds; on some virtual machines a
//! wake-up on another CPU costs tens (an inter-processor interrupt the
//! hypervisor delivers), and then it, not rdmx or the network, bounds every
//! latency that crosses processes. The probe measures it the way those hops
//! pay it: two threads ping-pong one byte over a Unix socket pair, each
//! blocked in `read` until the other writes, once with both threads on one
//! CPU and once on two.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use core_affinity::CoreId;
use serde::Serialize;

/// Round trips before the measured ones (caches, page faults, frequency).
const WARMUP: usize = 200;

/// What the probe found.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct WakeCost {
    /// Round trips measured per placement.
    pub(crate) rounds: usize,
    /// Median round trip (two wake-ups) with both threads on one CPU, µs.
    pub(crate) same_cpu_us: f64,
    /// Median round trip with the threads on two CPUs, µs (`None` with one
    /// CPU to run on).
    pub(crate) cross_cpu_us: Option<f64>,
}

/// The median round trip of `rounds` one-byte ping-pongs between a thread
/// on `ping` and one on `pong` (each blocked in `read` until the other
/// writes). Fails if a byte comes back other than sent.
fn round_trip_us(ping: CoreId, pong: CoreId, rounds: usize) -> io::Result<f64> {
    let (mut a, mut b) = UnixStream::pair()?;
    let total = WARMUP + rounds;
    let echo = std::thread::spawn(move || -> io::Result<()> {
        core_affinity::set_for_current(pong);
        let mut byte = [0u8];
        for _ in 0..total {
            b.read_exact(&mut byte)?;
            b.write_all(&byte)?;
        }
        Ok(())
    });
    let pinger = std::thread::spawn(move || -> io::Result<f64> {
        core_affinity::set_for_current(ping);
        // Nanoseconds, in the histogram `rdmx perf` keeps its latencies in.
        let mut took = crate::perf::hist();
        let mut back = [0u8];
        for i in 0..total {
            let sent = [i as u8];
            let t = Instant::now();
            a.write_all(&sent)?;
            a.read_exact(&mut back)?;
            let ns = t.elapsed().as_nanos() as u64;
            if back != sent {
                return Err(io::Error::other(format!(
                    "round trip {i}: sent {} and got {} back",
                    sent[0], back[0]
                )));
            }
            if i >= WARMUP {
                took.saturating_record(ns.max(1));
            }
        }
        crate::perf::us(&took, 0.5)
            .ok_or_else(|| io::Error::other("the probe measured no round trip"))
    });
    let median = pinger
        .join()
        .map_err(|_| io::Error::other("the probe's ping thread panicked"))??;
    echo.join()
        .map_err(|_| io::Error::other("the probe's echo thread panicked"))??;
    Ok(median)
}

/// Probe this host with `rounds` round trips per placement: the first CPU
/// this process may run on for both threads, then the first two.
pub(crate) fn probe(rounds: usize) -> io::Result<WakeCost> {
    let cores = core_affinity::get_core_ids().unwrap_or_default();
    let Some(&first) = cores.first() else {
        return Err(io::Error::other("no CPU to pin the probe's threads to"));
    };
    let same_cpu_us = round_trip_us(first, first, rounds)?;
    let cross_cpu_us = match cores.get(1) {
        Some(&second) => Some(round_trip_us(first, second, rounds)?),
        None => None,
    };
    Ok(WakeCost {
        rounds,
        same_cpu_us,
        cross_cpu_us,
    })
}

/// A cross-CPU round trip above this (µs) gets a warning: hosts that keep
/// their CPUs out of deep idle states take a few µs.
pub(crate) const SLOW_CROSS_CPU_US: f64 = 30.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_probe_measures_real_round_trips() {
        let c = probe(300).unwrap();
        assert_eq!(c.rounds, 300);
        assert!(c.same_cpu_us.is_finite() && c.same_cpu_us > 0.0, "{c:?}");
        // Two wake-ups cannot take longer than the whole test budget.
        assert!(c.same_cpu_us < 1e6, "{c:?}");
        if core_affinity::get_core_ids().unwrap_or_default().len() > 1 {
            let x = c.cross_cpu_us.expect("two CPUs: a cross-CPU figure");
            assert!(x.is_finite() && x > 0.0 && x < 1e6, "{c:?}");
        } else {
            assert!(c.cross_cpu_us.is_none());
        }
    }
}
