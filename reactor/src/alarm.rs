//! Precise alarms for hybrid polling ([`crate::pacer`]): wake a sleeping caller at an instant,
//! to within microseconds.
//!
//! tokio's timers round up to the millisecond, which is as long as the waits hybrid polling is
//! for. So the reactor's thread runs one more task, which sleeps on a `timerfd` (Linux; timer
//! slack does not apply to it) armed for the earliest alarm, and wakes the alarms' callers when
//! they are due. Elsewhere it falls back to tokio's timer: alarms then ring late, which costs the
//! caller the spin it would have saved, never a completion.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Poll, Waker};
use std::time::Instant;

use futures::task::AtomicWaker;

/// Alarms set by sleeping callers, and the handle that calls the alarm task back.
#[derive(Default)]
pub(crate) struct Alarms {
    pending: Mutex<Vec<(u64, Instant, Waker)>>,
    next_id: AtomicU64,
    task: AtomicWaker,
    changed: AtomicBool,
}

impl Alarms {
    /// Wakes `waker` at `at`; returns the alarm's id, for [`Alarms::cancel`].
    pub(crate) fn set(&self, at: Instant, waker: Waker) -> u64 {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).push((id, at, waker));
        self.changed.store(true, Ordering::Release);
        self.task.wake();
        id
    }

    /// Whether alarm `id` has rung (or was withdrawn).
    pub(crate) fn rang(&self, id: u64) -> bool {
        !self.pending.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|a| a.0 == id)
    }

    /// Calls the alarm task back (to see `stop`).
    pub(crate) fn kick(&self) {
        self.task.wake();
    }

    /// Withdraws alarm `id` (already rung: nothing happens).
    pub(crate) fn cancel(&self, id: u64) {
        self.pending.lock().unwrap_or_else(|e| e.into_inner()).retain(|a| a.0 != id);
    }

    /// Wakes the callers whose alarms are due; returns when the next one is.
    fn ring_due(&self) -> Option<Instant> {
        let now = Instant::now();
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let mut due = Vec::new();
        pending.retain(|(_, at, w)| {
            if *at <= now {
                due.push(w.clone());
                false
            } else {
                true
            }
        });
        let next = pending.iter().map(|a| a.1).min();
        drop(pending);
        due.into_iter().for_each(Waker::wake);
        next
    }
}

/// The alarm task: runs on the reactor's thread until `stop`.
pub(crate) async fn run(alarms: &Alarms, stop: &AtomicBool) {
    let mut timer = match Timer::new() {
        Ok(t) => t,
        Err(e) => {
            // Without a timer, alarms never ring: callers sleep until their completion, as they
            // did before hybrid polling. Say so once.
            eprintln!("ferrocomm: no timer for hybrid polling ({e}); adaptive callers sleep without alarms");
            return;
        }
    };
    loop {
        // Nothing due (or a timer that cannot be set): wait for a new alarm only.
        let armed = alarms.ring_due().is_some_and(|at| timer.set(at));
        std::future::poll_fn(|cx| {
            alarms.task.register(cx.waker());
            if stop.load(Ordering::Acquire) || alarms.changed.swap(false, Ordering::AcqRel) {
                return Poll::Ready(());
            }
            if armed { timer.poll(cx) } else { Poll::Pending }
        })
        .await;
        if stop.load(Ordering::Acquire) {
            return;
        }
    }
}

#[cfg(target_os = "linux")]
mod timer {
    use std::io;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::task::{Context, Poll};
    use std::time::Instant;

    use tokio::io::unix::AsyncFd;

    /// A `timerfd` watched by the reactor thread's runtime.
    pub(crate) struct Timer {
        fd: AsyncFd<OwnedFd>,
    }

    impl Timer {
        pub(crate) fn new() -> io::Result<Timer> {
            // SAFETY: plain system call; the descriptor it returns is owned at once.
            let raw = unsafe { libc::timerfd_create(libc::CLOCK_MONOTONIC, libc::TFD_NONBLOCK | libc::TFD_CLOEXEC) };
            if raw < 0 {
                return Err(io::Error::last_os_error());
            }
            // SAFETY: `raw` is a fresh descriptor nobody else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            // SAFETY: the descriptor is owned by the `AsyncFd` and stays open as long as it lives.
            let fd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }?;
            Ok(Timer { fd })
        }

        /// Sets the timer to ring at `at` (at once if it has passed); false if it cannot be set.
        pub(crate) fn set(&mut self, at: Instant) -> bool {
            // A zero value would disarm the timer: one nanosecond rings at once.
            let left = at.saturating_duration_since(Instant::now()).max(std::time::Duration::from_nanos(1));
            let spec = libc::itimerspec {
                it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
                it_value: libc::timespec { tv_sec: left.as_secs() as _, tv_nsec: left.subsec_nanos() as _ },
            };
            // SAFETY: a valid descriptor and a valid specification; no old value asked for.
            unsafe { libc::timerfd_settime(self.fd.as_raw_fd(), 0, &spec, std::ptr::null_mut()) == 0 }
        }

        /// Ready once the time [`Timer::set`] has passed.
        pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
            loop {
                let mut guard = match self.fd.poll_read_ready(cx) {
                    Poll::Pending => return Poll::Pending,
                    // A broken timer rings at once: the caller wakes early, nothing is lost.
                    Poll::Ready(Err(_)) => return Poll::Ready(()),
                    Poll::Ready(Ok(g)) => g,
                };
                let mut expirations = [0u8; 8];
                // SAFETY: reads at most 8 bytes into an 8-byte buffer.
                if unsafe { libc::read(self.fd.as_raw_fd(), expirations.as_mut_ptr().cast(), 8) } == 8 {
                    return Poll::Ready(());
                }
                guard.clear_ready();
            }
        }
    }
}

#[cfg(not(target_os = "linux"))]
mod timer {
    use std::future::Future;
    use std::io;
    use std::pin::Pin;
    use std::task::{Context, Poll};
    use std::time::Instant;

    /// tokio's timer (millisecond granularity).
    pub(crate) struct Timer {
        sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    }

    impl Timer {
        pub(crate) fn new() -> io::Result<Timer> {
            Ok(Timer { sleep: None })
        }

        pub(crate) fn set(&mut self, at: Instant) -> bool {
            self.sleep = Some(Box::pin(tokio::time::sleep_until(at.into())));
            true
        }

        pub(crate) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<()> {
            self.sleep.as_mut().map_or(Poll::Ready(()), |s| s.as_mut().poll(cx))
        }
    }
}

use timer::Timer;
