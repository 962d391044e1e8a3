//! ferrocomm on a simulated network: thousands of ranks in one thread, in virtual time.
//!
//! Each rank is the real protocol code, unchanged: the point-to-point [`Engine`] over a
//! [`SimTransport`] (the in-memory transport of `ferrocomm_transports::sim`), the collectives'
//! [`Machine`]s on top of it, and the reliable multicast [`McastCore`] over the simulated datagram
//! path with its control messages on the engine. What this crate adds is only the glue that the
//! facade's drivers are in a real job (`src/driver.rs`, `Comm::run` in `src/collective/mod.rs`,
//! `src/multicast.rs`): posting what a core asks for and feeding back what arrives, with the same
//! contexts, tags and receive patterns. The ranks are [`Process`]es that [`run`] steps one at a
//! time, only when something reached them or a timer of theirs is due, and time jumps from one
//! event to the next: no thread per rank, no clock, the same run for the same seed.
//!
//! ```
//! use bytes::Bytes;
//! use ferrocomm_collectives::{Algorithm, ReduceOp, ops};
//! use ferrocomm_sim::coll::run_calls;
//! use ferrocomm_sim::{Link, NetConfig, SimNet};
//!
//! let n = 256;
//! let link = Link::default().with_loss(0.01).with_jitter(5_000);
//! let net = SimNet::new(n, NetConfig { seed: 7, link, ..NetConfig::default() });
//! let input = |r: u32| Bytes::from((r as u64 + 1).to_le_bytes().to_vec());
//! let alg = Algorithm::RecursiveDoubling;
//! let calls = |r: u32| vec![ops::allreduce(r, n, alg, input(r), ReduceOp::<u64>::Sum.erase()).unwrap()];
//! let (report, ranks) = run_calls(&net, calls, 60_000_000_000).expect("no deadlock");
//! let want = (1..=n as u64).sum::<u64>().to_le_bytes();
//! for r in &ranks {
//!     assert_eq!(r.error, None);
//!     assert_eq!(&ops::allreduce_result(&r.results[0], n, alg).unwrap()[..], &want[..]);
//! }
//! assert!(report.time > 8 * 2_000, "8 steps of at least the link latency");
//! ```
//!
//! What this shows and what it does not: protocol behaviour at scale (every message matched,
//! results bit-exact, no deadlock, no stall under loss), and time as the network model makes it
//! (latency, serialization at both ports, incast, retransmission delays). Time spent computing in
//! the ranks (matching, copies, reductions) is not modelled: see `docs/simulation.md`.
//!
//! [`Engine`]: ferrocomm::p2p::engine::Engine
//! [`SimTransport`]: ferrocomm_transports::sim::SimTransport
//! [`Machine`]: ferrocomm_collectives::Machine
//! [`McastCore`]: ferrocomm_multicast::McastCore

pub mod cluster;
pub mod coll;
pub mod mcast;
pub mod model;
pub mod p2p;
pub mod scale;

pub use cluster::{Node, Process, Report, run};
pub use ferrocomm_transports::sim::{Link, NetConfig, NetStats, SimNet, Time};

/// Why a simulated run could not finish.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SimError {
    /// Nothing is in flight and no timer is set, but these ranks are not done.
    #[error("deadlock at {at} ns: {} ranks wait with nothing in flight (first: {:?})", .waiting.len(), &.waiting[..(.waiting.len().min(8))])]
    Deadlock { at: Time, waiting: Vec<u32> },
    /// Virtual time passed the run's limit with these ranks not done.
    #[error("time limit of {limit} ns passed: {} ranks not done (first: {:?})", .waiting.len(), &.waiting[..(.waiting.len().min(8))])]
    TimeLimit { limit: Time, waiting: Vec<u32> },
}
