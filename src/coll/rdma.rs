//! All-gather and all-to-all by RDMA writes ([`Algorithm::Rdma`]), when every member is reached
//! over verbs: each rank writes its blocks straight into the peers' registered receive buffers
//! with the one-sided machinery (`World::put`: the device's RDMA write), then sends each peer a
//! completion flag (an empty message on the call's tag). A rank's data is in place once every
//! peer's flag has arrived: a flag is sent only after that peer's writes completed (RC: the
//! responder has placed the data), so no message round trip sits between the data and its use,
//! unlike a rendezvous per block.
//!
//! * **Buffers.** Each rank publishes two segments (PUT access; registered with the device when
//!   published) and exchanges their ids with the communicator's members once, on the first call
//!   that needs them, and again only when a call needs larger ones (every rank decides alike:
//!   the calls and their sizes are the same everywhere). Peers attach them once (cached).
//! * **Two buffers, alternating by call.** A peer that finished call `k` may already write call
//!   `k + 1`'s blocks while this rank still copies call `k`'s out: they land in the other buffer.
//!   It cannot write call `k + 2`'s before this rank finished `k` (it needs this rank's flag of
//!   `k + 1`, sent after `k` completed here).
//! * **Order.** A communicator's RDMA calls run one at a time, in call order (each waits for the
//!   previous one to finish or be dropped): the alternation above needs it. Calls held together
//!   must all be polled (`join!`): awaiting a later call alone, before an earlier one ran, waits.
//! * **Failures.** A lost peer fails the writes to it and the wait for its flag; a revoked
//!   communicator fails the call when made, as on every path.

use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::oneshot;

use super::run::Slot;
use super::*;
use crate::rma::{Access, RemoteSegment, Segment, SegmentId};

/// What a call does with the source: the same block to every peer (all-gather) or block `j` to
/// peer `j` (all-to-all).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Shape {
    Allgather,
    Alltoall,
}

/// A communicator's RDMA tier: its buffers and the order of its calls.
#[derive(Default)]
pub(crate) struct RdmaState {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    /// Calls made so far (a call's buffer is its number's parity) and the previous call's end.
    order: Mutex<(u64, Option<oneshot::Receiver<()>>)>,
    bufs: Mutex<Option<Arc<Buffers>>>,
}

/// This rank's two receive buffers and the members' (by communicator rank; none for itself).
struct Buffers {
    cap: usize,
    mine: [Segment; 2],
    peers: Vec<Option<[RemoteSegment; 2]>>,
}

/// A call's place in the RDMA order, taken when the call is made.
pub(super) struct Turn {
    prev: Option<oneshot::Receiver<()>>,
    /// Dropped when the call ends (or is dropped): the next call may go.
    _done: oneshot::Sender<()>,
    parity: usize,
    shared: Arc<Shared>,
}

impl RdmaState {
    /// The next call's turn.
    pub(super) fn turn(&self) -> Turn {
        let (tx, rx) = oneshot::channel();
        let mut order = self.shared.order.lock();
        let parity = (order.0 % 2) as usize;
        order.0 += 1;
        let prev = order.1.replace(rx);
        Turn { prev, _done: tx, parity, shared: self.shared.clone() }
    }
}

/// Runs one call: `src` holds the block every peer gets (all-gather) or the `n` blocks in rank
/// order (all-to-all); every peer's block lands at `out[j * block..]` (this rank's own block is
/// the caller's to place).
pub(super) async fn run(slot: Slot, turn: Turn, shape: Shape, src: Bytes, block: usize, out: &mut [u8]) -> Result<()> {
    let Slot { comm, seq, refused, .. } = slot;
    if let Some(e) = refused.or_else(|| comm.revoked()) {
        return Err(e);
    }
    let Turn { prev, _done, parity, shared } = turn;
    if let Some(prev) = prev {
        // Either way the previous call is over (ended, or dropped).
        let _ = prev.await;
    }
    let (r, n) = (comm.rank() as usize, comm.size() as usize);
    if block == 0 || n < 2 {
        return Ok(());
    }
    let tag = |round: u64| (seq << 16) | round;
    let bufs = buffers(&comm, &shared, n * block, tag(1)).await?;
    let world = comm.world();
    let peers = || (0..n).filter(move |&j| j != r);
    let puts: Vec<_> = peers()
        .map(|j| {
            let part = match shape {
                Shape::Allgather => &src[..block],
                Shape::Alltoall => &src[j * block..(j + 1) * block],
            };
            let dst = &bufs.peers[j].as_ref().expect("a peer's buffers")[parity];
            world.put(dst, r * block, part)
        })
        .collect();
    futures::future::try_join_all(puts).await?;
    let flags: Vec<_> = peers().map(|j| comm.send(j as Rank, tag(2), Bytes::new())).collect();
    let arrived: Vec<_> = peers().map(|j| comm.recv(j as Rank, tag(2))).collect();
    futures::future::try_join(futures::future::try_join_all(flags), futures::future::try_join_all(arrived)).await?;
    for j in peers() {
        bufs.mine[parity].read(j * block, &mut out[j * block..(j + 1) * block])?;
    }
    Ok(())
}

/// The communicator's buffers, of at least `need` bytes each: the current ones, or new ones
/// published and exchanged with every member (messages on `tag`).
async fn buffers(comm: &Comm, shared: &Shared, need: usize, tag: u64) -> Result<Arc<Buffers>> {
    if let Some(b) = shared.bufs.lock().clone()
        && b.cap >= need
    {
        return Ok(b);
    }
    // The old buffers go once every member has new ones: no peer writes into them any more
    // (their last call completed here) and none attached to them is needed again.
    let cap = need.next_power_of_two().max(64 << 10);
    let world = comm.world();
    let mine = [world.publish(cap, Access::PUT)?, world.publish(cap, Access::PUT)?];
    let mut ids = Vec::with_capacity(16);
    ids.extend_from_slice(&mine[0].id().to_u64().to_le_bytes());
    ids.extend_from_slice(&mine[1].id().to_u64().to_le_bytes());
    let ids = Bytes::from(ids);
    let (r, n) = (comm.rank(), comm.size());
    let sends: Vec<_> = (0..n).filter(|&j| j != r).map(|j| comm.send(j, tag, ids.clone())).collect();
    let recvs: Vec<_> = (0..n).filter(|&j| j != r).map(|j| comm.recv(j, tag)).collect();
    let (_, got) =
        futures::future::try_join(futures::future::try_join_all(sends), futures::future::try_join_all(recvs)).await?;
    let mut peers: Vec<Option<[RemoteSegment; 2]>> = (0..n).map(|_| None).collect();
    for (j, m) in (0..n).filter(|&j| j != r).zip(got) {
        let owner = comm.world_rank(j);
        let id = |k: usize| {
            let word = m.data.get(k * 8..k * 8 + 8).and_then(|w| w.try_into().ok()).map(u64::from_le_bytes);
            word.map(SegmentId::from_u64).filter(|id| id.owner() == owner && m.data.len() == 16)
        };
        let (Some(a), Some(b)) = (id(0), id(1)) else {
            return Err(CollError::Malformed { from: j, why: "RDMA buffer announcement" }.into());
        };
        let pair = [world.attach(a).await?, world.attach(b).await?];
        if pair.iter().any(|s| s.len() < need || !s.access().contains(Access::PUT)) {
            return Err(CollError::Malformed { from: j, why: "RDMA buffers smaller than announced need" }.into());
        }
        peers[j as usize] = Some(pair);
    }
    let b = Arc::new(Buffers { cap, mine, peers });
    *shared.bufs.lock() = Some(b.clone());
    Ok(b)
}
