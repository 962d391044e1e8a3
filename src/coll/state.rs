//! A communicator's collective state: what its calls share (sequence numbers, buffers, the board,
//! the node-leader decomposition, the multicast channels), kept behind the one handle that the
//! point-to-point layer stores for the layers above it.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use ferrocomm_collectives::{Algorithm, Operation};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use super::board;
use super::hierarchy::Hierarchy;
use super::pool::Pool;
use crate::api::world::{Comm, Upper};
use crate::error::Result;
use crate::multicast::{Channel, TokenBarrier};
use crate::observe::coll::Observe;

/// The collective state of one communicator, shared by every handle on it.
#[derive(Default)]
pub(crate) struct CollState {
    /// Collective calls made so far: every rank numbers its calls alike (tags carry the number).
    pub calls: AtomicU64,
    /// Collective calls made so far, by every path (board, multicast and messages alike): the
    /// `sequence` of their spans, alike at every rank.
    pub observed: AtomicU64,
    /// Splits made so far (each derives its context from the count).
    pub splits: AtomicU32,
    /// Large buffers reused by this communicator's collectives.
    pub pool: Arc<Pool>,
    /// The reliable multicast channel and token barrier of pinned multicast collectives, made on
    /// first use.
    pub multicast: tokio::sync::OnceCell<Channel>,
    pub token_barrier: tokio::sync::OnceCell<TokenBarrier>,
    /// Sub-communicators for hierarchical collectives, made on first use.
    pub hierarchy: OnceLock<Hierarchy>,
    /// The handle on this communicator's collective context (every call's messages travel there),
    /// made on first use rather than per call; shared by the calls (one reference count each).
    pub collective: OnceLock<Arc<Comm>>,
    /// Whether every member shares this host over shared memory (the board can serve).
    pub on_one_host: OnceLock<bool>,
    /// Whether every member busy-polls.
    pub all_busy: OnceLock<bool>,
    /// Whether every member may read the others' memory.
    pub all_single_copy: OnceLock<bool>,
    /// Whether every other member is reached over verbs (the RDMA tier can serve).
    pub all_verbs: OnceLock<bool>,
    /// Whether a broadcast may go by reliable multicast (on, and the members span several hosts).
    pub multicast_capable: OnceLock<bool>,
    /// The RDMA tier's receive buffers and call order.
    pub rdma: super::rdma::RdmaState,
    /// The shared-memory board of small collectives, opened on first use.
    pub board: OnceLock<Result<Arc<board::HostBoard>>>,
}

impl Upper for CollState {
    fn drain<'a>(&'a self, comm: &'a Comm, limit: Duration) -> Pin<Box<dyn Future<Output = ()> + Send + 'a>> {
        Box::pin(crate::multicast::drain(comm.rank(), self.multicast.get(), self.token_barrier.get(), limit))
    }
}

impl Comm {
    /// Counts a collective call of `op` by `alg` with this rank's `bytes`, and opens its span
    /// and clock if it is timed (see `observe::coll`). Every public collective calls this once,
    /// when it is called.
    pub(super) fn observe(&self, op: Operation, alg: Algorithm, bytes: usize) -> Observe {
        let sequence = self.coll().observed.fetch_add(1, Ordering::Relaxed);
        self.inner().coll_meters.call(op, alg, bytes, sequence, self.context())
    }

    /// This communicator's collective state, made on first use.
    #[inline]
    pub(crate) fn coll(&self) -> &CollState {
        let upper: &dyn std::any::Any = &**self.state.upper.get_or_init(|| Box::new(CollState::default()));
        // Only this module stores the upper layers' state, always as a `CollState`.
        upper.downcast_ref().expect("the upper layers' state is the collective state")
    }
}
