//! The lock around a rank's protocol state: taking it is one atomic swap, releasing it a plain
//! store.
//!
//! Why not `parking_lot::Mutex`: its release is a compare-and-swap (it must look for parked
//! waiters), and an atomic read-modify-write costs about 10 ns on x86-64, on
//! the latency path of every operation (an 8-byte shared-memory message takes about 100 ns one
//! way). This lock is held for short progress rounds and is rarely contended (the background task
//! stands aside while a caller spins inline), so a waiter spins briefly, then yields its CPU, then
//! naps, instead of parking: releasing never has anyone to wake.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Spins before a waiter starts yielding its CPU.
const SPINS: u32 = 64;
/// Yields before a waiter starts napping (the holder may be descheduled: more ranks than CPUs).
const YIELDS: u32 = 64;
/// A napping waiter's sleep between two attempts.
const NAP: Duration = Duration::from_micros(20);

/// A test-and-test-and-set lock with a spin, yield, nap back-off.
pub struct RawLock {
    locked: AtomicBool,
}

// SAFETY: `try_lock` and `lock` return only after swapping `locked` from false to true with
// acquire ordering, and `unlock` (called only by the holder) stores false with release ordering:
// at most one holder at a time, and each holder sees the previous holder's writes.
unsafe impl lock_api::RawMutex for RawLock {
    #[allow(clippy::declare_interior_mutable_const)]
    const INIT: RawLock = RawLock { locked: AtomicBool::new(false) };
    type GuardMarker = lock_api::GuardSend;

    #[inline]
    fn lock(&self) {
        if !self.try_lock() {
            self.lock_contended();
        }
    }

    #[inline]
    fn try_lock(&self) -> bool {
        // Read first: a waiter polling a held lock keeps the line shared instead of bouncing it.
        !self.locked.load(Ordering::Relaxed) && !self.locked.swap(true, Ordering::Acquire)
    }

    #[inline]
    unsafe fn unlock(&self) {
        self.locked.store(false, Ordering::Release);
    }

    #[inline]
    fn is_locked(&self) -> bool {
        self.locked.load(Ordering::Relaxed)
    }
}

impl RawLock {
    #[cold]
    fn lock_contended(&self) {
        use lock_api::RawMutex;
        let mut attempts = 0u32;
        loop {
            if self.try_lock() {
                return;
            }
            attempts = attempts.saturating_add(1);
            if attempts < SPINS {
                std::hint::spin_loop();
            } else if attempts < SPINS + YIELDS {
                std::thread::yield_now();
            } else {
                std::thread::sleep(NAP);
            }
        }
    }
}

/// A mutex over [`RawLock`].
pub type Mutex<T> = lock_api::Mutex<RawLock, T>;
/// The guard of a [`Mutex`].
pub type MutexGuard<'a, T> = lock_api::MutexGuard<'a, RawLock, T>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn excludes_and_hands_over_between_threads() {
        let m = Arc::new(Mutex::new(0u64));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        // A non-atomic read-modify-write: lost updates would show a broken lock.
                        let mut g = m.lock();
                        let v = *g;
                        std::hint::black_box(&mut *g);
                        *g = v + 1;
                    }
                })
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(*m.lock(), 80_000);
        assert!(m.try_lock().is_some());
    }
}
