//! Hybrid polling for adaptive mode: sleep through most of a wait whose length is predictable,
//! wake a little before it is due to end, and spin through the end.
//!
//! An adaptive caller spins for its window, then sleeps until a doorbell wakes it. Waking an idle
//! CPU costs tens of microseconds (15-50 us on a virtual machine), which a busy-polling
//! caller never pays. But many long waits are regular (a time step, a periodic request, a peer
//! that computes for as long each round), and a regular wait's end can be foreseen. So the reactor
//! remembers the lengths of its callers' last long waits: when they agree, a caller going to sleep
//! arms an alarm for [`Window::wake_after`] (the shortest of them, less a lead) and, once woken,
//! spins until [`Window::spin_until`] (the longest, plus the lead). The wake-up is paid while
//! nothing is due. The lead follows the wake-up delays the alarms actually saw. Waits that
//! disagree give no window: the caller sleeps until a doorbell wakes it.
//!
//! Linux's block layer does the same for I/O completions (hybrid polling: sleep for half the mean
//! completion time, then poll). This module is the bookkeeping only, with no clock and no I/O.

use std::time::Duration;

/// Long waits remembered.
const HISTORY: usize = 8;
/// Long waits needed before predicting.
const MIN_HISTORY: usize = 4;
/// Waits agree when the longest exceeds the shortest by at most a quarter of the shortest, or by
/// this much, whichever is more.
const MIN_SPREAD: Duration = Duration::from_micros(50);
/// The longest spin a window may ask for (from its wake-up to its end): waits that disagree by
/// more than this are left to sleep, and the lead is cut to fit.
const MAX_SPIN: Duration = Duration::from_millis(2);
/// The lead before any alarm was seen late: two idle-CPU wake-ups (the alarm's thread, then the
/// caller's) with room to spare.
const FIRST_LEAD: Duration = Duration::from_micros(200);
/// Bounds of the lead.
const LEAD_RANGE: (Duration, Duration) = (Duration::from_micros(20), Duration::from_millis(2));

/// When a caller that is about to sleep should be woken, and how long it should spin then, both
/// measured from the start of its wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    /// Wake the caller this long after its wait began.
    pub wake_after: Duration,
    /// Spin (once woken) until this long after its wait began, then sleep until a doorbell wakes it.
    pub spin_until: Duration,
}

/// The recent long waits of a rank's callers, and how late their alarms woke them.
#[derive(Debug, Default)]
pub struct Pacer {
    waits: [Duration; HISTORY],
    recorded: usize,
    /// How late the recent alarms reached their caller (the largest of the last few, decaying).
    late: Option<Duration>,
}

impl Pacer {
    /// A wait that outlasted the caller's spin window ended after `waited`.
    pub fn record_wait(&mut self, waited: Duration) {
        self.waits[self.recorded % HISTORY] = waited;
        self.recorded += 1;
        // A lead too wide for any window sets no alarm, so no alarm would ever narrow it again:
        // it narrows with every long wait too.
        self.late = self.late.map(|l| l - l / 8);
    }

    /// An alarm reached its caller `late` after it was due.
    pub fn record_late(&mut self, late: Duration) {
        // The largest recent delay, decaying by an eighth per alarm and per long wait: one slow
        // wake-up widens the lead at once, and it narrows again over a few waits.
        self.late = Some(match self.late {
            Some(l) => late.max(l - l / 8),
            None => late,
        });
    }

    /// How far ahead of a foreseen end the caller must be woken.
    pub fn lead(&self) -> Duration {
        match self.late {
            Some(l) => (2 * l + LEAD_RANGE.0).clamp(LEAD_RANGE.0, LEAD_RANGE.1),
            None => FIRST_LEAD,
        }
    }

    /// The window for a caller about to sleep, when the recent long waits agree.
    pub fn window(&self) -> Option<Window> {
        if self.recorded < MIN_HISTORY {
            return None;
        }
        let waits = &self.waits[..self.recorded.min(HISTORY)];
        let shortest = *waits.iter().min()?;
        let longest = *waits.iter().max()?;
        let spread = longest - shortest;
        if spread > (shortest / 4).max(MIN_SPREAD) || spread + 2 * LEAD_RANGE.0 > MAX_SPIN {
            return None;
        }
        // The spin budget bounds the lead: alarms that arrive later than it allows cost their
        // wake-up again, but never more spinning.
        let lead = self.lead().min((MAX_SPIN - spread) / 2);
        Some(Window { wake_after: shortest.saturating_sub(lead), spin_until: longest + lead })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(n: u64) -> Duration {
        Duration::from_micros(n)
    }

    #[test]
    fn no_window_until_enough_waits() {
        let mut p = Pacer::default();
        for _ in 0..MIN_HISTORY - 1 {
            p.record_wait(us(1000));
            assert_eq!(p.window(), None);
        }
        p.record_wait(us(1000));
        assert_eq!(p.window(), Some(Window { wake_after: us(800), spin_until: us(1200) }));
    }

    #[test]
    fn window_spans_shortest_to_longest() {
        let mut p = Pacer::default();
        for w in [1000, 1040, 1010, 1100, 1020] {
            p.record_wait(us(w));
        }
        assert_eq!(p.window(), Some(Window { wake_after: us(800), spin_until: us(1300) }));
    }

    #[test]
    fn irregular_waits_give_no_window() {
        let mut p = Pacer::default();
        for w in [1000, 3000, 1000, 1000] {
            p.record_wait(us(w));
        }
        assert_eq!(p.window(), None);
        // Once the odd one has left the history, the waits agree again.
        for _ in 0..HISTORY {
            p.record_wait(us(1000));
        }
        assert!(p.window().is_some());
    }

    #[test]
    fn long_waits_that_disagree_by_more_than_a_spin_sleep() {
        // Ten-second waits a few milliseconds apart agree in proportion, but the spin would be long.
        let mut p = Pacer::default();
        for ms in [10_000, 10_005, 10_002, 10_001] {
            p.record_wait(Duration::from_millis(ms));
        }
        assert_eq!(p.window(), None);
        let mut q = Pacer::default();
        for us in [10_000_000, 10_000_900, 10_000_100, 10_000_000] {
            q.record_wait(Duration::from_micros(us));
        }
        assert_eq!(q.window().map(|w| w.spin_until - w.wake_after), Some(Duration::from_micros(1300)));
    }

    #[test]
    fn short_waits_spin_through() {
        // Waits shorter than the lead: wake at once (the caller keeps spinning) until past them.
        let mut p = Pacer::default();
        for w in [80, 90, 85, 80] {
            p.record_wait(us(w));
        }
        assert_eq!(p.window(), Some(Window { wake_after: Duration::ZERO, spin_until: us(290) }));
    }

    #[test]
    fn a_very_late_alarm_widens_the_lead_only_as_far_as_the_spin_budget() {
        let mut p = Pacer::default();
        for _ in 0..HISTORY {
            p.record_wait(us(1000));
        }
        p.record_late(Duration::from_millis(5));
        assert_eq!(p.window(), Some(Window { wake_after: Duration::ZERO, spin_until: us(2000) }));
        // Long waits narrow the lead again, alarms or not.
        for _ in 0..40 {
            p.record_wait(us(1000));
        }
        assert!(p.lead() < us(100), "{:?}", p.lead());
    }

    #[test]
    fn lead_follows_late_alarms() {
        let mut p = Pacer::default();
        assert_eq!(p.lead(), FIRST_LEAD);
        p.record_late(us(30));
        assert_eq!(p.lead(), us(80));
        // A slow wake-up widens it at once...
        p.record_late(us(100));
        assert_eq!(p.lead(), us(220));
        // ...and it narrows over the next alarms.
        for _ in 0..40 {
            p.record_late(us(10));
        }
        assert_eq!(p.lead(), us(40));
        // Bounded both ways.
        p.record_late(Duration::from_secs(1));
        assert_eq!(p.lead(), LEAD_RANGE.1);
        let mut q = Pacer::default();
        q.record_late(Duration::ZERO);
        assert_eq!(q.lead(), LEAD_RANGE.0);
    }
}
