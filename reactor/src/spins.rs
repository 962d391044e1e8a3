//! Who spins inline right now, counted without an atomic read-modify-write per spin.
//!
//! The background task stands aside while callers spin (see the crate's docs): it needs the number
//! of callers spinning now, and whether a spin started since it last looked. One shared counter
//! would give both, by an atomic add at each spin's start and an atomic subtract at its end; but
//! the subtract sits between a receive's completion and whatever the caller does next: on the 8 B
//! shared-memory ping-pong, between a message and its reply (3 ns one way:
//! `ferrocomm-bench pingpong --transport shm --runs 10 --recv-into --send-from --max 8 --target-ms 100 --idle-gap 0 --no-peer`). So each
//! thread counts in a cache line of its own, by plain stores, and the background task, which
//! looks every millisecond or so while callers spin, adds the lines up. Threads beyond the lines
//! share an atomic counter.

use std::cell::Cell;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Threads that count in a line of their own (the rest share one counter).
const LINES: usize = 32;

/// One spin: the low 32 bits count callers spinning now, the high 32 the spins started.
const ONE: u64 = 1 << 32 | 1;

/// A counter on a cache line pair of its own (the adjacent-line prefetcher fetches pairs).
#[repr(align(128))]
#[derive(Default)]
struct Line(AtomicU64);

/// The spin counts of one reactor.
pub(crate) struct Spins {
    /// `lines[i]` is written by the thread holding line index `i` only.
    lines: Box<[Line]>,
    /// Threads without a line of their own.
    shared: AtomicU64,
}

impl Default for Spins {
    fn default() -> Spins {
        Spins { lines: (0..LINES).map(|_| Line::default()).collect(), shared: AtomicU64::new(0) }
    }
}

impl Spins {
    /// Counts the calling thread as spinning until the guard is dropped.
    #[inline]
    pub(crate) fn start(&self) -> Spin<'_> {
        match thread_line() {
            Some(i) => {
                let w = &self.lines[i].0;
                // Only this thread writes `w`: a load and a store, no locked instruction.
                w.store(w.load(Ordering::Relaxed).wrapping_add(ONE), Ordering::Release);
                Spin { w, own: true }
            }
            None => {
                self.shared.fetch_add(ONE, Ordering::AcqRel);
                Spin { w: &self.shared, own: false }
            }
        }
    }

    /// Callers spinning now, and spins started ever (wrapping).
    pub(crate) fn read(&self) -> (u32, u32) {
        let words = self.lines.iter().map(|l| &l.0).chain([&self.shared]);
        words
            .map(|w| w.load(Ordering::Acquire))
            .fold((0u32, 0u32), |(now, ever), v| (now.wrapping_add(v as u32), ever.wrapping_add((v >> 32) as u32)))
    }
}

/// A caller spinning, for as long as it lives.
pub(crate) struct Spin<'a> {
    w: &'a AtomicU64,
    own: bool,
}

impl Drop for Spin<'_> {
    #[inline]
    fn drop(&mut self) {
        if self.own {
            self.w.store(self.w.load(Ordering::Relaxed).wrapping_sub(1), Ordering::Release);
        } else {
            self.w.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The line indices: how many were ever handed out, and those given back by threads that ended.
struct Pool {
    issued: usize,
    free: Vec<usize>,
}

static POOL: Mutex<Pool> = Mutex::new(Pool { issued: 0, free: Vec::new() });

/// A thread's line index, given back when the thread ends.
struct Held(Option<usize>);

impl Held {
    fn take() -> Held {
        let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = pool.free.pop() {
            return Held(Some(i));
        }
        if pool.issued == LINES {
            return Held(None);
        }
        pool.issued += 1;
        Held(Some(pool.issued - 1))
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(i) = self.0 {
            // Spins in other thread-local destructors, after this one, share the counter.
            let _ = INDEX.try_with(|c| c.set(LINES));
            POOL.lock().unwrap_or_else(|e| e.into_inner()).free.push(i);
        }
    }
}

thread_local! {
    static HELD: Held = Held::take();
    /// `HELD`'s index, read without the lazy initialisation's check (`usize::MAX`: not yet).
    static INDEX: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The calling thread's line, if it has one.
#[inline]
fn thread_line() -> Option<usize> {
    let i = INDEX.with(Cell::get);
    if i != usize::MAX {
        return (i < LINES).then_some(i);
    }
    // `LINES` itself: no line (all taken); also while the thread's locals are being destroyed.
    let i = HELD.try_with(|h| h.0.unwrap_or(LINES)).unwrap_or(LINES);
    let _ = INDEX.try_with(|c| c.set(i));
    (i < LINES).then_some(i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_spins_now_and_ever_across_threads() {
        let _alone = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let spins = Spins::default();
        assert_eq!(spins.read(), (0, 0));
        {
            let _a = spins.start();
            let _b = spins.start();
            assert_eq!(spins.read(), (2, 2), "nested spins on one thread");
        }
        assert_eq!(spins.read(), (0, 2));
        // More threads at once than there are lines: the rest share the counter.
        let n = LINES + 8;
        let barrier = std::sync::Barrier::new(n + 1);
        std::thread::scope(|s| {
            for _ in 0..n {
                s.spawn(|| {
                    let _spin = spins.start();
                    barrier.wait();
                    barrier.wait();
                });
            }
            barrier.wait();
            assert_eq!(spins.read(), (n as u32, n as u32 + 2), "every thread spinning");
            barrier.wait();
        });
        assert_eq!(spins.read(), (0, n as u32 + 2));
    }

    #[test]
    fn lines_of_ended_threads_are_used_again() {
        let _alone = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        // Twice as many threads as lines, one after the other: each gets one given back.
        for i in 0..2 * LINES {
            let line = std::thread::spawn(thread_line).join().unwrap();
            assert!(line.is_some(), "thread {i} found no line free");
        }
    }

    /// The tests that hold many lines at once, one at a time.
    static SERIAL: Mutex<()> = Mutex::new(());
}
