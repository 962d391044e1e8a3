//! When a bulk wait stops spinning (see [`super::VerbsConfig::nap_after`]). Sans-IO: the caller
//! says what each progress call did and supplies the clock; this says when to sleep.
//!
//! Spinning while the device moves a large transfer gains nothing: the completion that ends the
//! wait comes hundreds of microseconds later, and waking on the completion channel costs a few.
//! On Soft-RoCE it even costs the transfer, whose "NIC" is the kernel on the same CPUs.

use std::time::{Duration, Instant};

/// Idle progress calls between two looks at the clock (the spin loop stays free of clock reads).
pub const CHECK_EVERY: u32 = 32;

/// The idle state of one transport's progress calls.
#[derive(Clone, Debug)]
pub struct Nap {
    after: Option<Duration>,
    calls: u32,
    since: Option<Instant>,
}

impl Nap {
    /// Naps once bulk waits have lasted `after`; never with `None`.
    pub fn new(after: Option<Duration>) -> Nap {
        Nap { after, calls: 0, since: None }
    }

    /// One progress call that did some work (`true`) or none. For idle calls, every
    /// [`CHECK_EVERY`]th asks `bulk` (is the device moving bulk data for us?) and then `now`;
    /// returns whether to nap: a bulk wait, idle for at least `after` since the first such look.
    pub fn call(&mut self, work: bool, bulk: impl FnOnce() -> bool, now: impl FnOnce() -> Instant) -> bool {
        let Some(after) = self.after else { return false };
        if work {
            self.calls = 0;
            self.since = None;
            return false;
        }
        self.calls += 1;
        if self.calls < CHECK_EVERY {
            return false;
        }
        self.calls = 0;
        if !bulk() {
            self.since = None;
            return false;
        }
        let now = now();
        now.duration_since(*self.since.get_or_insert(now)) >= after
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Drives `n` idle calls at time `t`; returns how many said nap and how many read the clock.
    fn idle(nap: &mut Nap, n: u32, bulk: bool, t: Instant) -> (u32, u32) {
        let (mut naps, mut reads) = (0, 0);
        for _ in 0..n {
            naps += u32::from(nap.call(
                false,
                || bulk,
                || {
                    reads += 1;
                    t
                },
            ));
        }
        (naps, reads)
    }

    #[test]
    fn naps_only_in_a_bulk_wait_that_lasted() {
        let t0 = Instant::now();
        let ms = Duration::from_millis(1);
        let mut nap = Nap::new(Some(ms));
        // The first look starts the wait; the clock is read once per CHECK_EVERY idle calls.
        assert_eq!(idle(&mut nap, 4 * CHECK_EVERY, true, t0), (0, 4));
        assert_eq!(idle(&mut nap, CHECK_EVERY, true, t0 + ms), (1, 1));
        // Work restarts the wait.
        assert!(!nap.call(true, || true, || t0));
        assert_eq!(idle(&mut nap, CHECK_EVERY, true, t0 + 2 * ms), (0, 1));
        assert_eq!(idle(&mut nap, CHECK_EVERY, true, t0 + 3 * ms), (1, 1));
        // Waiting for small messages (no bulk transfer) never naps, and forgets the wait.
        assert_eq!(idle(&mut nap, 10 * CHECK_EVERY, false, t0 + 9 * ms), (0, 0));
        assert_eq!(idle(&mut nap, CHECK_EVERY, true, t0 + 10 * ms), (0, 1));
        // Disabled: never.
        let mut off = Nap::new(None);
        assert_eq!(idle(&mut off, 100 * CHECK_EVERY, true, t0 + 100 * ms), (0, 0));
    }
}
