//! The meters and span of collective calls: per world, one set of handles for each operation and
//! algorithm, registered at the first call that uses them; per call, a counted call and its bytes,
//! and (when timed) a span and a latency measurement around the call's future.
//!
//! Why timing is conditional: reading the clock twice costs about as much as a small collective
//! over the shared-memory board (tens to a hundred nanoseconds each on a virtual machine). A call
//! is timed when its span is enabled (a subscriber wants `ferrocomm::collective` at DEBUG) or when
//! a metrics recorder was in force when the world was made.

use std::future::Future;
use std::pin::Pin;
use std::sync::OnceLock;
use std::task::{Context, Poll};
use std::time::Instant;

use ferrocomm_collectives::{Algorithm, Operation};
use metrics::{Counter, Histogram};

/// The handles of one operation and algorithm.
struct Meter {
    calls: Counter,
    bytes: Counter,
    seconds: Histogram,
}

/// A world's collective meters.
pub(crate) struct CollMeters {
    /// By `op as usize * Algorithm::ALL.len() + alg as usize`.
    meters: Box<[OnceLock<Meter>]>,
    /// Whether calls are timed for the latency histogram even when their span is disabled.
    timed: bool,
}

impl Default for CollMeters {
    fn default() -> CollMeters {
        let n = Operation::ALL.len() * Algorithm::ALL.len();
        CollMeters { meters: (0..n).map(|_| OnceLock::new()).collect(), timed: recorder_installed() }
    }
}

/// Whether a metrics recorder is in force. `metrics` cannot be asked; the no-op recorder it falls
/// back on is zero-sized, and a recorder that records anything holds state (the Prometheus
/// exporter's, the debugging recorder's), so its size tells them apart.
fn recorder_installed() -> bool {
    metrics::with_recorder(|r| size_of_val(r) != 0)
}

impl CollMeters {
    fn meter(&self, op: Operation, alg: Algorithm) -> &Meter {
        // Both lists are in declaration order (`ferrocomm_collectives::select`).
        debug_assert_eq!(Algorithm::ALL[alg as usize], alg);
        self.meters[op as usize * Algorithm::ALL.len() + alg as usize].get_or_init(|| {
            let labels = [("operation", op.to_string()), ("algorithm", alg.to_string())];
            Meter {
                calls: metrics::counter!(super::COLLECTIVE_CALLS, &labels),
                bytes: metrics::counter!(super::COLLECTIVE_BYTES, &labels),
                seconds: metrics::histogram!(super::COLLECTIVE_SECONDS, &labels),
            }
        })
    }

    /// Counts a call of `op` by `alg` with `bytes` at this rank, number `sequence` of its
    /// communicator, and opens its span and clock if the call is timed.
    pub(crate) fn call(&self, op: Operation, alg: Algorithm, bytes: usize, sequence: u64, context: u32) -> Observe {
        let m = self.meter(op, alg);
        m.calls.increment(1);
        m.bytes.increment(bytes as u64);
        let span = tracing::debug_span!(
            target: "ferrocomm::collective",
            "collective",
            operation = %op,
            algorithm = %alg,
            bytes,
            sequence,
            context,
        );
        if span.is_disabled() && !self.timed {
            return Observe(None);
        }
        Observe(Some(Box::new(Timing { start: Instant::now(), seconds: m.seconds.clone(), span })))
    }
}

struct Timing {
    start: Instant,
    seconds: Histogram,
    span: tracing::Span,
}

/// A call's span and clock, if it is timed ([`CollMeters::call`]).
pub(crate) struct Observe(Option<Box<Timing>>);

impl Observe {
    /// No span and no clock: for a path whose call is observed further in (so that every path
    /// of a collective returns the same future type).
    pub(crate) const ELSEWHERE: Observe = Observe(None);

    /// `f`, the call's future, inside the call's span and clock.
    pub(crate) fn wrap<F: Future>(self, f: F) -> Observed<F> {
        Observed { inner: f, timing: self.0 }
    }
}

/// A collective's future, polled inside its span; its completion is timed. One word larger than
/// the future it wraps (the timing is boxed, and absent when the call is not timed).
pub(crate) struct Observed<F> {
    inner: F,
    timing: Option<Box<Timing>>,
}

impl<F: Future> Future for Observed<F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        // SAFETY: `inner` is pinned with `self` (structural pinning: it is never moved out, and
        // `Observed` has no `Drop` that could move it); `timing` is not pinned and may be taken.
        let this = unsafe { self.get_unchecked_mut() };
        // SAFETY: as above: `inner` stays where it is for as long as `self` is pinned.
        let inner = unsafe { Pin::new_unchecked(&mut this.inner) };
        let Some(t) = &this.timing else { return inner.poll(cx) };
        let r = t.span.in_scope(|| inner.poll(cx));
        if r.is_ready() {
            t.seconds.record(t.start.elapsed());
            this.timing = None;
        }
        r
    }
}
