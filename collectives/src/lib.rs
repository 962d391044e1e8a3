//! Collective operations as sans-IO state machines.
//!
//! Each operation is planned as a [`Schedule`] of rounds of block sends and receives (see
//! [`schedule`]), chosen from the algorithm menu in [`algorithms`] by the [`select::Table`], and run
//! by a [`Machine`] that consumes "message arrived" events and emits sends. Nothing here does I/O:
//! the same machines run over every transport through the root crate's driver, and in the seeded
//! in-memory simulator of [`sim`] with a thousand ranks in one process. Small barriers,
//! broadcasts and all-reduces among ranks of one host can instead go through the shared-memory
//! board of [`shared`]: flags and data in shared memory, no messages.

pub mod algorithms;
pub mod ops;
pub mod plan;
pub mod reduce;
pub mod schedule;
pub mod select;
pub mod shared;
pub mod sim;

pub use reduce::{Element, ReduceOp, Reducer, bf16, f16};
pub use schedule::{Action, Apply, Blocks, Form, Machine, Schedule};
pub use select::{Algorithm, Operation, Table};

/// Why a collective could not proceed. Every variant names the peer at fault where there is one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CollError {
    /// A message that does not decode as the schedule expects.
    #[error("malformed collective message from rank {from}: {why}")]
    Malformed {
        /// The sender.
        from: u32,
        /// What is wrong with it.
        why: &'static str,
    },
    /// A message the schedule does not expect from that rank in that round.
    #[error("unexpected collective message from rank {from} for round {round}")]
    Unexpected {
        /// The sender.
        from: u32,
        /// The round it was tagged with.
        round: u32,
    },
    /// Arguments or state that do not fit the collective (an algorithm that does not implement
    /// it, a wrong number of blocks or bytes, a shared board that does not match the call).
    #[error("{0}")]
    Invalid(String),
    /// A single-copy call: rank `rank` left it (its future was dropped or failed) while its memory
    /// was lent, so what was read from it is not kept.
    #[error("rank {rank} left the single-copy collective before its memory was read")]
    Withdrawn {
        /// The rank that left.
        rank: u32,
    },
    /// An RDMA call (all-gather or all-to-all by RDMA writes): rank `rank` cannot take part in
    /// it (its set-up failed: the device refused its buffer, or its buffers do not fit the call)
    /// or its blocks are of another length than this rank's. Every member's call fails with it.
    #[error("rank {rank} cannot take part in the RDMA collective: {why}")]
    Refused {
        /// The rank that refused (or whose blocks differ).
        rank: u32,
        /// Why.
        why: &'static str,
    },
    /// A single-copy call: the kernel refused to copy from rank `rank`'s memory.
    #[error(
        "single copy from rank {rank} failed: {reason} (cross-memory attach needs ptrace permission; pinning \
         other algorithms avoids it: FERROCOMM_COLL=bcast=binomial,allreduce=rabenseifner,reduce=binomial,\
         allgather=ring,alltoall=pairwise)"
    )]
    SingleCopy {
        /// The rank whose memory could not be read.
        rank: u32,
        /// The kernel's error.
        reason: String,
    },
}

/// The dissemination barrier schedule, kept for callers that only need the exchange pattern.
pub use algorithms::barrier::dissemination;
