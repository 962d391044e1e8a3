//! When a spinning caller may read the clock.
//!
//! A spin looks at the clock now and then: for its budget (adaptive mode) and to know when to
//! start yielding (busy mode). Where the clock is the TSC read through the vDSO, a read costs tens
//! of nanoseconds, and the spin reads it every [`CLOCK_ROUNDS`](super::CLOCK_ROUNDS) rounds. Where
//! it is a system call that reads an emulated device (a VM under software emulation, with HPET as
//! its clock source: 5-11 us a read, against 70 ns for `rdtsc`), such reads took a quarter of the
//! CPU time of a busy verbs ping-pong, and a completion that arrives during one waits for it. There
//! the spin asks the CPU's cycle counter first, which is cheap everywhere, and reads the clock only
//! once [`READS_APART`] reads' worth of cycles have passed since its last read. The cycle counter
//! is only compared with itself (never turned into time), so a counter that is not synchronised
//! between CPUs makes a read come early or late, never wrong. Where there is no such counter, or
//! the clock is cheap, every look reads the clock.

use std::time::{Duration, Instant};

/// Reads of the clock are kept at least this many reads' worth of time apart: reading it then
/// costs a spin at most about 1/32 of its time.
pub(crate) const READS_APART: u32 = 32;
/// A clock read costing less than this is cheap: every look reads it.
const CHEAP: Duration = Duration::from_nanos(500);

/// Whether a look at the clock is due (shared by a rank's callers; immutable once calibrated).
#[derive(Debug)]
pub(crate) struct ClockPace {
    /// Cycles between two reads of the clock, or 0: read at every look.
    gap: u64,
}

impl ClockPace {
    /// Calibrates: what a read of the clock costs here, in time and in cycles. An adaptive spin
    /// of `budget` keeps its reads at most a quarter of it apart, and reads at its first look (see
    /// [`ClockPace::due`]), so it overruns its budget by at most a quarter.
    pub(crate) fn new(budget: Option<Duration>) -> ClockPace {
        let Some(first) = cycles() else { return ClockPace { gap: 0 } };
        // The best of a few batches: the first read of a process may fault the vDSO's page in.
        const BATCH: u32 = 8;
        let (mut read, mut read_cycles) = (Duration::MAX, u64::MAX);
        let mut c0 = first;
        for _ in 0..3 {
            let t0 = Instant::now();
            for _ in 1..BATCH {
                std::hint::black_box(Instant::now());
            }
            // `took` spans BATCH reads; the cycles, the BATCH + 1 reads between `c0` and `c1`.
            let took = t0.elapsed();
            let c1 = cycles().unwrap_or(c0);
            if took / BATCH < read {
                read = took / BATCH;
                read_cycles = c1.wrapping_sub(c0) / u64::from(BATCH + 1);
            }
            c0 = c1;
        }
        Self::from_cost(read, read_cycles, budget)
    }

    /// The pace for a clock read costing `read`, that is `read_cycles` cycles.
    fn from_cost(read: Duration, read_cycles: u64, budget: Option<Duration>) -> ClockPace {
        if read < CHEAP {
            return ClockPace { gap: 0 };
        }
        let mut gap = read_cycles.saturating_mul(u64::from(READS_APART));
        if let Some(b) = budget {
            let per_ns = read_cycles as f64 / read.as_nanos() as f64;
            gap = gap.min((b.as_nanos() as f64 / 4.0 * per_ns) as u64);
        }
        ClockPace { gap }
    }

    /// Whether a spin whose last read of the clock was at cycle `last` (0: none yet) reads it at
    /// this look. The first look of a wait reads it only if `first_reads` (a spin with a budget,
    /// which counts from there); otherwise it only notes the cycle, so that a busy wait shorter
    /// than a gap never reads the clock.
    pub(crate) fn due(&self, last: &mut u64, first_reads: bool) -> bool {
        if self.gap == 0 {
            return true;
        }
        let Some(now) = cycles() else { return true };
        let now = now.max(1);
        if *last != 0 && now.wrapping_sub(*last) < self.gap {
            return false;
        }
        let first = *last == 0;
        *last = now;
        !first || first_reads
    }
}

/// The CPU's cycle counter, where reading it is a plain instruction (`None` elsewhere). Only
/// differences taken on one CPU mean anything.
pub fn cycles() -> Option<u64> {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `rdtsc` exists on every x86-64 CPU and only reads the time-stamp counter.
        Some(unsafe { core::arch::x86_64::_rdtsc() })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cheap_clock_is_read_at_every_look() {
        let pace = ClockPace::from_cost(Duration::from_nanos(25), 75, None);
        assert_eq!(pace.gap, 0);
        let mut last = 0;
        assert!(pace.due(&mut last, false) && pace.due(&mut last, false));
        // This machine's own clock (the vDSO's TSC on a host; under emulation it may be slow).
        let here = ClockPace::new(None);
        let t0 = Instant::now();
        std::hint::black_box(Instant::now());
        if t0.elapsed() < Duration::from_nanos(100) {
            assert_eq!(here.gap, 0, "{here:?}");
        }
    }

    #[test]
    fn a_slow_clock_is_read_once_enough_cycles_passed() {
        // 10 us a read, 30,000 cycles: reads at least 960,000 cycles apart.
        let pace = ClockPace::from_cost(Duration::from_micros(10), 30_000, None);
        assert_eq!(pace.gap, 30_000 * u64::from(READS_APART));
        if cycles().is_none() {
            return;
        }
        // Reads hours of cycles apart: no preemption of this test makes one due by itself.
        let pace = ClockPace::from_cost(Duration::from_secs(1), 1 << 40, None);
        let mut last = 0;
        // A busy wait's first look notes the cycle; the next, at once, is not due.
        assert!(!pace.due(&mut last, false));
        assert_ne!(last, 0);
        assert!(!pace.due(&mut last, false));
        // Long after: due, and not again at once.
        last = last.wrapping_sub(pace.gap + 1);
        assert!(pace.due(&mut last, false));
        assert!(!pace.due(&mut last, false));
        // A spin with a budget reads at its first look.
        let mut last = 0;
        assert!(pace.due(&mut last, true));
        assert!(!pace.due(&mut last, true));
    }

    #[test]
    fn an_adaptive_budget_caps_the_gap_at_a_quarter_of_it() {
        // 3 cycles a nanosecond; a budget of 40 us is 120,000 cycles, a quarter 30,000.
        let pace = ClockPace::from_cost(Duration::from_micros(10), 30_000, Some(Duration::from_micros(40)));
        assert_eq!(pace.gap, 30_000);
    }
}
