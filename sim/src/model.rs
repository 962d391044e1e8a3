//! The textbook alpha-beta cost of each algorithm, to set beside the simulated time.
//!
//! A message of `n` bytes costs `alpha + n * beta`: `alpha` the start-up (one-way latency, plus
//! the header's serialization), `beta` the time per byte (the link's serialization). `p` ranks.
//! These are the formulas of Thakur, Rabenseifner and Gropp (2005) for powers of two, without the
//! reduction's compute term (the simulator does not model computation either). Where the
//! simulated time departs from them, the difference is the engine's or the network's doing: a
//! message above the eager limit first sends an RTS and waits for the CTS (two more `alpha` per
//! step), non-powers of two add two steps to the recursive algorithms, and a rank that sends
//! several messages at once serializes them one after another on its port.

use ferrocomm_collectives::Algorithm;
use ferrocomm_transports::sim::Link;
use ferrocomm_transports::wire::HEADER_LEN;

/// The two parameters of the model, in nanoseconds and nanoseconds per byte.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AlphaBeta {
    /// Per-message cost (latency and header), ns.
    pub alpha: f64,
    /// Per-byte cost, ns/B.
    pub beta: f64,
}

impl AlphaBeta {
    /// The model of a uniform simulated network of links `link`.
    pub fn of(link: &Link) -> AlphaBeta {
        AlphaBeta { alpha: (link.latency + link.serialize(HEADER_LEN)) as f64, beta: link.byte_ps as f64 / 1000.0 }
    }
}

/// The collective operations the scale curves cover, with the algorithm that runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// A barrier.
    Barrier(Algorithm),
    /// A broadcast.
    Bcast(Algorithm),
    /// An allreduce.
    Allreduce(Algorithm),
    /// A broadcast by reliable multicast (one message from the root).
    McastBcast,
}

impl Op {
    /// `operation/algorithm`, as the curves are labelled.
    pub fn name(&self) -> String {
        match self {
            Op::Barrier(a) => format!("barrier/{a}"),
            Op::Bcast(a) => format!("bcast/{a}"),
            Op::Allreduce(a) => format!("allreduce/{a}"),
            Op::McastBcast => "bcast/multicast".into(),
        }
    }

    /// The model's formula, for the table's caption.
    pub fn formula(&self) -> &'static str {
        match self {
            Op::Barrier(_) => "lg(p) a",
            Op::Bcast(Algorithm::ScatterAllgather) => "(lg(p) + p - 1) a + 2 (p-1)/p n b",
            Op::Bcast(_) => "lg(p) (a + n b)",
            Op::Allreduce(Algorithm::Rabenseifner) => "2 lg(p) a + 2 (p-1)/p n b",
            Op::Allreduce(Algorithm::Ring) => "2 (p-1) a + 2 (p-1)/p n b",
            Op::Allreduce(_) => "lg(p) (a + n b)",
            Op::McastBcast => "a + n b",
        }
    }

    /// Predicted time in nanoseconds for `p` ranks and `n` bytes (the vector, or the message).
    pub fn predict(&self, m: AlphaBeta, p: u32, n: usize) -> f64 {
        if p <= 1 {
            return 0.0;
        }
        let (a, b, n, pf) = (m.alpha, m.beta, n as f64, p as f64);
        let lg = f64::from(p.next_power_of_two().trailing_zeros());
        let frac = (pf - 1.0) / pf;
        match self {
            Op::Barrier(_) => lg * a,
            Op::Bcast(Algorithm::ScatterAllgather) => (lg + pf - 1.0) * a + 2.0 * frac * n * b,
            Op::Bcast(_) => lg * (a + n * b),
            Op::Allreduce(Algorithm::Rabenseifner) => 2.0 * lg * a + 2.0 * frac * n * b,
            Op::Allreduce(Algorithm::Ring) => 2.0 * (pf - 1.0) * a + 2.0 * frac * n * b,
            Op::Allreduce(_) => lg * (a + n * b),
            Op::McastBcast => a + n * b,
        }
    }
}
