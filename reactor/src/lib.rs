//! The completion engine: it knows nothing of networking.
//!
//! A rank's whole protocol state (transports, protocol cores, in-flight operations) sits behind one
//! lock ([`lock`]: cheap to release) as a [`Progress`] implementation. Two kinds of callers drive
//! it through the same routine, [`Progress::progress`]:
//!
//! * futures awaiting an operation, inline, according to the [`ProgressMode`]: busy-poll spins on
//!   the completion sources (lowest latency, burns a core), adaptive spins for a bounded time and
//!   then sleeps (waking early when its waits have been regular: [`pacer`]), blocking sleeps at
//!   once;
//! * a background task on the reactor's own thread, so that ACKs, rendezvous replies and other ranks'
//!   steps advance while the application computes. It sleeps on every source's readiness (sockets,
//!   io_uring eventfd, doorbells) and on the next timer, and stays out of the way while a caller is
//!   spinning inline, so the two never fight over one core.
//!
//! In-flight operations live in an [`Ops`] slab: a completion carries the slab key, so dispatch is
//! a lookup, never a search.
//!
//! The inline spin is the latency-critical loop (a shared-memory round trip is a fraction of a
//! microsecond), so it stays cheap while it is young: no clock read per poll, no `sched_yield`
//! until it has spun for `YIELD_AFTER` (20 us) without its completion (a system call costs more than a
//! shared-memory round trip under KVM), and several rounds per taking of the lock. Past
//! `YIELD_AFTER` it yields every few dozen rounds, so that more busy ranks than cores still
//! progress. Nor does it `pause` between rounds (MPI's progress loops do not either): a round is
//! a whole progress call, not a one-load spin, and a `pause` only delays the round that would see
//! the completion (about 10 ns one way on the 8 B shared-memory ping-pong). Its limits count
//! rounds.

mod alarm;
mod clock;
pub mod lock;
mod ops;
pub mod pacer;
mod spins;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use clock::ClockPace;
pub use clock::cycles;
use futures::task::AtomicWaker;
pub use lock::{Mutex, MutexGuard, RawLock};
pub use ops::{OpKey, Ops};
pub use pacer::Pacer;
use spins::Spins;

/// How an awaiting caller makes progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressMode {
    /// Spin on the completion sources until done (yielding the CPU now and then, so more ranks
    /// than cores still progress).
    BusyPoll,
    /// Spin for at most this long per operation, then sleep until woken; when the rank's recent
    /// long waits were regular, wake just before the next is due to end and spin through its end
    /// (hybrid polling, [`pacer`]).
    Adaptive(Duration),
    /// Sleep at once; the background task wakes the caller.
    Blocking,
}

impl std::str::FromStr for ProgressMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "busy" | "busy-poll" | "busypoll" => Ok(ProgressMode::BusyPoll),
            "blocking" | "block" => Ok(ProgressMode::Blocking),
            "adaptive" => Ok(ProgressMode::Adaptive(Duration::from_micros(50))),
            _ => match s.strip_prefix("adaptive:").and_then(|us| us.parse().ok()) {
                Some(us) => Ok(ProgressMode::Adaptive(Duration::from_micros(us))),
                None => Err(format!("unknown progress mode {s:?} (busy, adaptive[:US], blocking)")),
            },
        }
    }
}

/// A rank's protocol state, as the reactor sees it.
pub trait Progress: Send + 'static {
    /// Does whatever can be done without blocking; returns how much happened (0 = idle).
    fn progress(&mut self) -> usize;
    /// `Ready` if [`Progress::progress`] has work, else registers `cx` with every completion source.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()>;
    /// The background task woke from a sleep that [`Progress::poll_ready`] prepared; or a caller
    /// that a hybrid-polling alarm woke is about to spin, and the reactor calls the background
    /// task back at once (it stands aside while the caller spins, then prepares its sleep anew).
    fn awake(&mut self) {}
    /// The background task stands aside for callers spinning inline and will not sleep on the
    /// completion sources until it prepares a sleep anew: whatever it left watching them (armed
    /// doorbells) should stop waking it.
    fn stand_aside(&mut self) {}
    /// When a protocol timer next needs [`Progress::progress`] (retransmission, heartbeat, ...).
    fn next_timeout(&self) -> Option<Instant> {
        None
    }
}

/// How long the background task keeps off the completion sources once it saw an inline spin (it
/// looks again after that long, or when a caller that stops spinning hands over). While callers
/// keep spinning, each look that finds them at it doubles the time to the next, up to
/// [`MAX_INLINE_QUIET`]: a rank that spins all the time is not woken a thousand times a second
/// for nothing (under software emulation such a wake-up took a tenth of the CPU from the spinning
/// caller). The price: once callers stop spinning without handing over (their operations done,
/// the application computing), the background task takes over only at a look that finds no spin
/// started since the last, up to 16 ms (two looks) later; an application whose operations
/// complete while spinning, and come less than 8 ms apart, is served by those spins alone (each
/// progresses everything, as MPI's calls do). Backing off only for a caller spinning at the very
/// moment of the look, or coming back by halves, cost the busy verbs ping-pong under emulation
/// 10-25% (its caller is between two waits at many looks).
const INLINE_QUIET: Duration = Duration::from_millis(1);
const MAX_INLINE_QUIET: Duration = Duration::from_millis(8);
/// Reads of the clock per poll of a spinning future before it yields to the executor, at
/// [`CLOCK_ROUNDS`] rounds between looks (where every look reads it: 256 rounds); more where looks
/// are closer (oversubscribed adaptive callers: a look every [`LOCKED_ROUNDS`]), so that a poll
/// spans about as many rounds.
const READS_PER_POLL: u32 = 4;
/// Where the clock is slow, a poll also ends after this many looks per read it was allotted.
const LOOKS_PER_READ: u32 = 8;
/// Spin rounds between two looks at the clock (spin budget) and, once yielding, two yields (where
/// the clock is slow, a look reads it only now and then: [`clock`]).
const CLOCK_ROUNDS: u32 = 64;
/// An inline spin gives the CPU away (`sched_yield`) only once it has waited this long: before
/// that it makes no system call at all.
const YIELD_AFTER: Duration = Duration::from_micros(20);
/// Spin rounds per taking of the lock.
const LOCKED_ROUNDS: u32 = 8;

struct Shared<P> {
    state: Mutex<P>,
    mode: ProgressMode,
    /// Callers spinning now, and spins started.
    spins: Spins,
    /// A caller stopped spinning and is going to sleep: the background task must take over now.
    handover: AtomicBool,
    background: AtomicWaker,
    stop: AtomicBool,
    /// Spinning callers yield the CPU once they have waited this long (nanoseconds):
    /// [`YIELD_AFTER`], or zero when the host has more busy ranks than CPUs.
    yield_after_ns: AtomicU64,
    /// Adaptive mode: the callers' recent long waits (hybrid polling).
    pacer: std::sync::Mutex<Pacer>,
    /// Whether a spin's look at the clock reads it.
    clock: ClockPace,
    alarms: alarm::Alarms,
    /// Hybrid polling's alarms set, and the waits that completed after theirs rang.
    alarms_set: AtomicU64,
    completed_after_alarm: AtomicU64,
}

/// What hybrid polling did so far ([`Reactor::hybrid_stats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HybridStats {
    /// Alarms set by callers going to sleep with a foreseeable wait.
    pub alarms_set: u64,
    /// Waits that completed after their alarm had rung (spinning, if it rang in time).
    pub completed_after_alarm: u64,
}

/// Handle to a rank's progress state and its background task. Cloning is cheap.
pub struct Reactor<P> {
    shared: Arc<Shared<P>>,
}

impl<P> Clone for Reactor<P> {
    fn clone(&self) -> Self {
        Reactor { shared: self.shared.clone() }
    }
}

/// A thread running a single-threaded tokio runtime: the home of a rank's background progress task,
/// of its sockets' readiness, and of small service tasks (accepting connections).
pub struct ReactorThread {
    handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl ReactorThread {
    /// Starts the thread.
    pub fn spawn(name: &str) -> std::io::Result<ReactorThread> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let handle = rt.handle().clone();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name(name.to_string()).spawn(move || {
            rt.block_on(async {
                let _ = rx.await;
            });
            rt.shutdown_timeout(Duration::from_millis(100));
        })?;
        Ok(ReactorThread { handle, stop: Some(tx), thread: Some(thread) })
    }

    /// The runtime handle: sockets created under `handle().enter()` are watched by this thread.
    pub fn handle(&self) -> &tokio::runtime::Handle {
        &self.handle
    }

    /// Starts the background progress task for `state` on this thread.
    pub fn run<P: Progress>(&self, state: P, mode: ProgressMode) -> Reactor<P> {
        let shared = Arc::new(Shared {
            state: Mutex::new(state),
            mode,
            spins: Spins::default(),
            handover: AtomicBool::new(false),
            background: AtomicWaker::new(),
            stop: AtomicBool::new(false),
            yield_after_ns: AtomicU64::new(YIELD_AFTER.as_nanos() as u64),
            pacer: Default::default(),
            clock: ClockPace::new(match mode {
                ProgressMode::Adaptive(d) => Some(d),
                _ => None,
            }),
            alarms: Default::default(),
            alarms_set: AtomicU64::new(0),
            completed_after_alarm: AtomicU64::new(0),
        });
        self.handle.spawn(background(shared.clone()));
        if matches!(mode, ProgressMode::Adaptive(_)) {
            let shared = shared.clone();
            self.handle.spawn(async move { alarm::run(&shared.alarms, &shared.stop).await });
        }
        Reactor { shared }
    }
}

impl Drop for ReactorThread {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take()
            && t.thread().id() != std::thread::current().id()
        {
            let _ = t.join();
        }
    }
}

/// The background progress task.
async fn background<P: Progress>(shared: Arc<Shared<P>>) {
    // The spin count last seen: a change means a caller spun meanwhile.
    let mut seen = 0;
    let mut quiet_for = INLINE_QUIET;
    // Whether the sources were told that this task stands aside since it last slept on them.
    let mut aside = false;
    loop {
        if shared.stop.load(Ordering::Acquire) {
            return;
        }
        if shared.inline_active(&mut seen) {
            if !aside {
                // A doorbell armed for the last sleep keeps ringing (waking this thread onto the
                // spinning caller's CPU) until it is taken down.
                shared.state.lock().stand_aside();
                aside = true;
            }
            // A caller is spinning: it sees completions first. Check back shortly, or when kicked.
            let quiet = tokio::time::sleep(quiet_for);
            quiet_for = (quiet_for * 2).min(MAX_INLINE_QUIET);
            tokio::pin!(quiet);
            std::future::poll_fn(|cx| {
                shared.background.register(cx.waker());
                if shared.stop.load(Ordering::Acquire) || shared.handover.load(Ordering::Acquire) {
                    return Poll::Ready(());
                }
                quiet.as_mut().poll(cx)
            })
            .await;
            continue;
        }
        quiet_for = INLINE_QUIET;
        aside = false;
        let (work, timeout) = {
            let mut st = shared.state.lock();
            (st.progress(), st.next_timeout())
        };
        if work > 0 {
            tokio::task::yield_now().await;
            continue;
        }
        let timer = timeout.map(|t| Box::pin(tokio::time::sleep_until(t.into())));
        let mut timer = timer;
        std::future::poll_fn(|cx| {
            shared.background.register(cx.waker());
            if shared.stop.load(Ordering::Acquire) || shared.spinning() {
                return Poll::Ready(());
            }
            if let Some(t) = timer.as_mut()
                && t.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(());
            }
            shared.state.lock().poll_ready(cx)
        })
        .await;
        shared.state.lock().awake();
    }
}

impl<P> Shared<P> {
    /// Whether a caller spins inline right now.
    fn spinning(&self) -> bool {
        self.spins.read().0 > 0
    }

    /// Whether a caller spins now or started a spin since the last call (`seen` remembers the
    /// count). A caller that handed over (it is going to sleep) does not count.
    fn inline_active(&self, seen: &mut u32) -> bool {
        let (now, ever) = self.spins.read();
        let started = ever != *seen;
        *seen = ever;
        if self.handover.swap(false, Ordering::AcqRel) {
            return now > 0;
        }
        now > 0 || started
    }
}

impl<P: Progress> Reactor<P> {
    /// Runs `f` on the locked state.
    pub fn with<R>(&self, f: impl FnOnce(&mut P) -> R) -> R {
        f(&mut self.shared.state.lock())
    }

    /// Runs `f` on the locked state as one round of an inline spin: the background task stays
    /// aside, as it does while callers spin (a caller that collects its completion right after
    /// starting an operation needs no wakeup of that task for it).
    pub fn with_spinning<R>(&self, f: impl FnOnce(&mut P) -> R) -> R {
        let _spin = self.shared.spins.start();
        let mut st = self.shared.state.lock();
        f(&mut st)
    }

    /// Locks the state.
    pub fn lock(&self) -> MutexGuard<'_, P> {
        self.shared.state.lock()
    }

    /// Declares that this host runs more busy ranks than it has CPUs: spinning callers then yield
    /// the CPU at every look instead of after `YIELD_AFTER`, since the rank they
    /// wait for may need the very CPU they spin on (Open MPI's `mpi_yield_when_idle` does the same
    /// when oversubscribed), and adaptive callers do not spin at all: they sleep at once.
    pub fn set_oversubscribed(&self, yes: bool) {
        let ns = if yes { 0 } else { YIELD_AFTER.as_nanos() as u64 };
        self.shared.yield_after_ns.store(ns, Ordering::Relaxed);
    }

    /// Whether this host runs more busy ranks than it has CPUs ([`Reactor::set_oversubscribed`]).
    pub fn is_oversubscribed(&self) -> bool {
        self.shared.yield_after_ns.load(Ordering::Relaxed) == 0
    }

    /// What hybrid polling (adaptive mode) did so far.
    pub fn hybrid_stats(&self) -> HybridStats {
        HybridStats {
            alarms_set: self.shared.alarms_set.load(Ordering::Relaxed),
            completed_after_alarm: self.shared.completed_after_alarm.load(Ordering::Relaxed),
        }
    }

    /// The progress mode awaiting callers use.
    pub fn mode(&self) -> ProgressMode {
        self.shared.mode
    }

    /// Wakes the background task (new output it must watch, a new timer, shutdown).
    pub fn kick(&self) {
        self.shared.background.wake();
    }

    /// Stops the background task.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.kick();
        self.shared.alarms.kick();
    }

    /// Drives progress for an awaiting caller until `check` is ready, following the progress mode.
    /// `check(state, cx)` looks for the caller's completion; with `Some(cx)` it must also register
    /// the waker, since the caller is about to sleep. `wait` is the caller's place in its wait,
    /// kept between polls (adaptive mode spins for a bounded time per wait; busy callers yield
    /// after `YIELD_AFTER`).
    #[inline(always)]
    pub fn poll_until<T>(
        &self,
        cx: &mut Context<'_>,
        wait: &mut Wait,
        mut check: impl FnMut(&mut P, Option<&mut Context<'_>>) -> Poll<T>,
    ) -> Poll<T> {
        let shared = &*self.shared;
        let spin_for = match shared.mode {
            ProgressMode::BusyPoll => None,
            // On a host with more ranks than CPUs the rank this caller waits for needs its CPU:
            // an adaptive caller sleeps at once, as a blocking one does (6 ranks on 2 CPUs,
            // bursts of 8 B messages over TCP and shared memory: 1.3-3x slower spinning first).
            ProgressMode::Adaptive(_) if shared.yield_after_ns.load(Ordering::Relaxed) == 0 => Some(Duration::ZERO),
            ProgressMode::Adaptive(d) => Some(d),
            ProgressMode::Blocking => Some(Duration::ZERO),
        };
        let mut rung = false;
        if let Some(h) = wait.hybrid.as_deref_mut()
            && let Alarm::Set { id, at } = h.alarm
        {
            let now = Instant::now();
            if now >= at && shared.alarms.rang(id) {
                // Woken by the alarm (or by the completion, no earlier): how late it reached us.
                h.alarm = Alarm::Rang;
                shared.pacer().record_late(now - at);
                rung = true;
            }
        }
        // The clock is read lazily: a busy spin that completes within CLOCK_ROUNDS never reads it.
        let spinning = match (spin_for, wait.start) {
            (None, _) => true,
            (Some(d), None) => !d.is_zero(),
            (Some(d), Some(_)) => wait.may_spin(d, Instant::now()),
        };
        if spinning {
            let _spin = shared.spins.start();
            if rung {
                // The background task sleeps with the transports' doorbells armed, so a peer would
                // ring one (and wake that task onto this CPU) for the very message this caller is
                // about to spin for. Disarm them, and call the task back: seeing this spin, it
                // stands aside, and arms them again once callers stop.
                shared.state.lock().awake();
                self.kick();
            }
            let mut rounds = 0;
            let yield_after = shared.yield_after_ns.load(Ordering::Relaxed);
            // Oversubscribed: look (and yield) after every locked batch, so the rank this one
            // waits for gets the CPU within a few rounds, not a few microseconds. A busy caller
            // then yields at every look and needs no clock.
            let (look_every, clockless) = match yield_after {
                0 => (LOCKED_ROUNDS, spin_for.is_none()),
                _ => (CLOCK_ROUNDS, false),
            };
            let mut next_look = look_every;
            // A poll ends after as many clock reads as [`READS_PER_POLL`] allots to its look
            // spacing, or, where the clock is slow and most looks skip reading it, after
            // [`LOOKS_PER_READ`] times as many looks, the last of which reads it anyway: a poll
            // returns to its executor within a bounded number of rounds, and reads the clock at
            // least once, however the cycle counter behaves.
            let mut reads_left = READS_PER_POLL * CLOCK_ROUNDS / look_every;
            let mut looks_left = reads_left * LOOKS_PER_READ;
            while reads_left > 0 && looks_left > 0 {
                match shared.state.try_lock() {
                    Some(mut st) => {
                        // Several rounds per lock: taking and releasing it are two atomic
                        // read-modify-writes, about as costly as an idle round itself.
                        for _ in 0..LOCKED_ROUNDS {
                            st.progress();
                            if let Poll::Ready(v) = check(&mut st, None) {
                                drop(st);
                                return shared.done(wait, spin_for, v);
                            }
                        }
                        rounds += LOCKED_ROUNDS;
                    }
                    None => {
                        rounds += 1;
                        std::hint::spin_loop();
                    }
                }
                if rounds >= next_look {
                    next_look = rounds + look_every;
                    looks_left -= 1;
                    if clockless {
                        reads_left -= 1;
                        std::thread::yield_now();
                        continue;
                    }
                    // An adaptive spin reads the clock at its first look: its budget counts from there.
                    if looks_left > 0 && !shared.clock.due(&mut wait.last_read, spin_for.is_some()) {
                        if wait.yielding || yield_after == 0 {
                            std::thread::yield_now();
                        }
                        continue;
                    }
                    reads_left -= 1;
                    let now = Instant::now();
                    if spin_for.is_some_and(|d| !wait.may_spin(d, now)) {
                        break;
                    }
                    if (now - wait.begin(now)).as_nanos() as u64 >= yield_after {
                        // Let another rank on this core run (more ranks than cores must not
                        // livelock); from now on at every look.
                        wait.yielding = true;
                        std::thread::yield_now();
                    }
                }
            }
            if spin_for.is_none_or(|d| wait.may_spin(d, Instant::now())) {
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
        }
        // Going to sleep: register, and make sure the background task is watching the sources.
        let r = {
            let mut st = shared.state.lock();
            st.progress();
            check(&mut st, Some(cx))
        };
        if let Poll::Ready(v) = r {
            return shared.done(wait, spin_for, v);
        }
        if spin_for.is_some_and(|d| !d.is_zero()) {
            if wait.hybrid.is_none()
                && let Some(w) = shared.pacer().window()
            {
                // Hybrid polling: this wait is likely to end within the window; spin through it.
                let now = Instant::now();
                let start = wait.begin(now);
                let at = start + w.wake_after;
                let alarm = match at > now {
                    true => Alarm::Set { id: shared.alarms.set(at, cx.waker().clone()), at },
                    false => Alarm::None,
                };
                wait.hybrid = Some(Box::new(Hybrid { spin_until: start + w.spin_until, alarm }));
                if alarm == Alarm::None {
                    // Due already: spin on.
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                shared.alarms_set.fetch_add(1, Ordering::Relaxed);
            }
            // The background task may stand aside for our spinning: call it back now.
            shared.handover.store(true, Ordering::Release);
            self.kick();
        }
        Poll::Pending
    }
}

impl<P> Shared<P> {
    fn pacer(&self) -> std::sync::MutexGuard<'_, Pacer> {
        self.pacer.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The caller's wait ended: an adaptive wait that outlasted its spin window teaches the pacer,
    /// and its alarm, if any, is withdrawn.
    #[inline(always)]
    fn done<T>(&self, wait: &mut Wait, spin_for: Option<Duration>, v: T) -> Poll<T> {
        if let (Some(d), Some(start)) = (spin_for, wait.start)
            && !d.is_zero()
        {
            let waited = start.elapsed();
            if waited > d {
                self.pacer().record_wait(waited);
            }
            match wait.hybrid.as_deref().map(|h| h.alarm) {
                Some(Alarm::Set { id, .. }) => self.alarms.cancel(id),
                Some(Alarm::Rang) => _ = self.completed_after_alarm.fetch_add(1, Ordering::Relaxed),
                _ => {}
            }
            *wait = Wait::default();
        }
        Poll::Ready(v)
    }
}

/// An awaiting caller's place in its wait, kept in its future between polls of
/// [`Reactor::poll_until`].
#[derive(Debug, Default)]
pub struct Wait {
    /// When the wait began, as far as the spin knows: read lazily, at its first read of the clock
    /// (the first look, or where the clock is slow a later one, [`clock`]), so that a busy spin
    /// that completes before never reads it. Never set for a busy caller on an oversubscribed
    /// host, which yields at every look without the clock.
    start: Option<Instant>,
    /// Hybrid polling's state, for the waits that reach it (boxed: every operation's and
    /// collective's future carries a `Wait`, and is moved on every call).
    hybrid: Option<Box<Hybrid>>,
    /// Where the clock is slow: the cycle counter at the last read of the clock ([`clock`]).
    last_read: u64,
    /// The caller has waited past its [`YIELD_AFTER`]: it yields at every look.
    yielding: bool,
}

/// A wait's hybrid polling: set when the caller first goes to sleep with a window.
#[derive(Debug)]
struct Hybrid {
    /// Spin until then ([`pacer::Window::spin_until`]).
    spin_until: Instant,
    alarm: Alarm,
}

/// A hybrid wait's alarm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Alarm {
    /// None: the window was due when the caller would have slept, so it spun on.
    None,
    /// Set (its id, for [`alarm::Alarms`]) to ring at `at`.
    Set { id: u64, at: Instant },
    /// It rang.
    Rang,
}

impl Wait {
    /// Whether the caller has not read the clock in this wait yet (see [`Wait`]'s `start`).
    pub fn is_fresh(&self) -> bool {
        self.start.is_none()
    }

    /// When the wait began (`now`, if this is the first look at the clock).
    fn begin(&mut self, now: Instant) -> Instant {
        *self.start.get_or_insert(now)
    }

    /// Whether an adaptive caller spinning for `d` per wait may spin at `now`.
    fn may_spin(&mut self, d: Duration, now: Instant) -> bool {
        now - self.begin(now) < d || self.hybrid.as_ref().is_some_and(|h| now < h.spin_until)
    }
}

/// A future that completes when the reactor's state says so; see [`Reactor::poll_until`].
pub struct Until<P, F> {
    reactor: Reactor<P>,
    wait: Wait,
    check: F,
}

impl<P, F> Until<P, F> {
    /// A future that drives `reactor` until `check` (as for [`Reactor::poll_until`]) is ready.
    pub fn new(reactor: Reactor<P>, check: F) -> Self {
        Until { reactor, wait: Wait::default(), check }
    }
}

impl<P: Progress, T, F> Future for Until<P, F>
where
    F: FnMut(&mut P, Option<&mut Context<'_>>) -> Poll<T> + Unpin,
{
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let this = self.get_mut();
        this.reactor.poll_until(cx, &mut this.wait, &mut this.check)
    }
}
