//! Collective operations on a [`Comm`]: the thin driver between the sans-IO machines of
//! `ferrocomm-collectives` and the point-to-point layer, plus communicator splitting.
//!
//! Every collective is planned when it is *called*: the algorithm is chosen and the call takes its
//! sequence number on the communicator right away, so several collectives may be outstanding on
//! one communicator (held, `join!`ed) and still pair up across ranks, as long as every rank calls
//! them in the same order. Collective traffic travels on the communicator's collective context
//! with tag `sequence << 16 | round`, so it never mixes with the application's messages or with
//! another call's.
//!
//! Cancellation: dropping a collective's future withdraws its pending receives and sends. Ranks
//! that still wait for this rank's part of that call do not complete it: they fail at their own
//! deadline ([`Error::Timeout`]) or are dropped in turn. The communicator stays usable: later calls
//! have later sequence numbers, and the cancelled call's stray messages are never matched (they stay
//! in the unexpected queue, bounded by that call's size, until the communicator's world ends).
//! Calls on the shared-memory board ([`shared`]) differ: they are described in full when made, so
//! a dropped call still does this rank's part whenever a later call of the communicator is driven,
//! and the other ranks complete it. Single-copy calls (large calls on one host,
//! [`shared::Lending`]) read the other ranks' memory: dropping one withdraws what this rank lent,
//! and the others' call fails with `CollError::Withdrawn` rather than keep what it read.
//!
//! Failures: a loss of a member revokes the communicator, which fails every rank's pending and later
//! calls naming the lost rank, on every path (messages, board, multicast, node-leader); a departed
//! member fails only the steps that wait for what it never sent (see `docs/failure.md`).

pub(crate) mod shared;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};

use bytes::{Bytes, BytesMut};
use ferrocomm_collectives::CollError;
use ferrocomm_collectives::select::Call;
use ferrocomm_collectives::shared::{Kind, Lent, MAX_RANKS as BOARD_RANKS};
use ferrocomm_collectives::{Action, Algorithm, Blocks, Element, Machine, Operation, ReduceOp, ops};
use ferrocomm_reactor::Wait;
use ferrocomm_transports::Rank;
use smallvec::SmallVec;

use crate::driver::Driver;
use crate::error::{Error, Result};
use crate::multicast::{Channel, TokenBarrier};
use crate::p2p::Status;
use crate::world::{COLLECTIVE_BIT, Comm, Group, Message, Op, derive_context};

/// One call's place on its communicator: where its messages go and the sequence number that keeps
/// them apart from other calls'.
struct Slot {
    comm: Arc<Comm>,
    seq: u64,
    /// The calling communicator's buffer pool.
    pool: Arc<Pool>,
    /// Why the call cannot run, as known when it was made: a member lost or departed. (Decided
    /// then, not when a later phase of the call starts: by then a member may have finished the
    /// whole call and left, which is no reason to fail.)
    refused: Option<Error>,
}

/// A posted receive of a collective: of any length, or into a buffer of the announced length.
enum Incoming {
    Plain(Op<Message>),
    Into(Op<(BytesMut, Status)>),
}

impl Incoming {
    fn is_ready(&self) -> bool {
        match self {
            Incoming::Plain(op) => op.is_ready(),
            Incoming::Into(op) => op.is_ready(),
        }
    }

    fn harvest(&mut self, d: &mut Driver, cx: Option<&mut Context<'_>>) -> bool {
        match self {
            Incoming::Plain(op) => op.harvest(d, cx),
            Incoming::Into(op) => op.harvest(d, cx),
        }
    }

    /// The received bytes of a ready receive ([`Incoming::is_ready`]).
    fn take(&mut self) -> Result<Bytes> {
        let mut cx = Context::from_waker(Waker::noop());
        let r = match self {
            Incoming::Plain(op) => Pin::new(op).poll(&mut cx).map_ok(|m| m.data),
            Incoming::Into(op) => Pin::new(op).poll(&mut cx).map_ok(|(b, _)| b.freeze()),
        };
        match r {
            Poll::Ready(r) => r,
            Poll::Pending => Err(Error::Invalid("a collective receive taken before it completed".into())),
        }
    }
}

/// A collective's driving future ([`Comm::drive`]).
type Drive = Pin<Box<dyn Future<Output = Result<Blocks>> + Send>>;

/// A call's sends in flight: a handful at a time (inline, no allocation).
type Sends = SmallVec<[Op<()>; 4]>;

/// A call's posted receives: `(from, round, part, receive)`.
type Recvs = SmallVec<[(u32, u32, u32, Incoming); 4]>;

/// Drops the completed sends (their results were harvested: no lock is taken); the first failure
/// is returned.
fn take_sends(sends: &mut Sends) -> Result<()> {
    let mut cx = Context::from_waker(Waker::noop());
    let mut failed = None;
    sends.retain(|op| {
        if !op.is_ready() {
            return true;
        }
        if let Poll::Ready(Err(e)) = Pin::new(op).poll(&mut cx) {
            failed.get_or_insert(e);
        }
        false
    });
    failed.map_or(Ok(()), Err)
}

/// The node-leader decomposition of a communicator spanning several hosts.
pub(crate) struct Hierarchy {
    /// The ranks of this communicator on this host (rank 0 of it is the node's leader).
    node: Comm,
    /// The leaders, one per host; `None` on ranks that are not leaders.
    leaders: Option<Comm>,
    /// The node index of each rank of the communicator.
    node_of: Vec<u32>,
    /// For each node index, the rank (in the communicator) of its leader.
    leader_rank: Vec<Rank>,
}

fn to_bytes<T: Element>(data: &[T]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(data))
}

/// Large buffers reused across the collective calls of a communicator. A fresh multi-megabyte
/// allocation is zeroed and faults in a page per 4 KiB on first touch, which dominated large
/// collectives (a 1 MiB broadcast into fresh buffers runs at a fraction of the transport's speed:
/// `ferrocomm-bench collectives --ops bcast --no-mpi`). Bounded in count and bytes; small buffers are not kept.
#[derive(Default)]
pub(crate) struct Pool {
    bufs: parking_lot::Mutex<Vec<BytesMut>>,
}

impl Pool {
    /// Buffers below this size come from the allocator.
    const MIN: usize = 32 << 10;
    const MAX_BUFFERS: usize = 16;
    const MAX_BYTES: usize = 256 << 20;

    /// A buffer of `len` initialized bytes (contents unspecified).
    fn take(&self, len: usize) -> BytesMut {
        if len >= Pool::MIN {
            let mut bufs = self.bufs.lock();
            // The smallest buffer that fits, if it is not absurdly larger.
            let best = (bufs.iter().enumerate())
                .filter(|(_, b)| b.len() >= len && b.len() <= len.saturating_mul(4))
                .min_by_key(|(_, b)| b.len())
                .map(|(i, _)| i);
            if let Some(i) = best {
                let mut b = bufs.remove(i);
                b.truncate(len);
                return b;
            }
        }
        BytesMut::zeroed(len)
    }

    fn give(&self, buf: BytesMut) {
        if buf.len() < Pool::MIN {
            return;
        }
        let mut bufs = self.bufs.lock();
        // Full: make room by dropping the oldest buffers (the sizes in use drift with the workload).
        while !bufs.is_empty()
            && (bufs.len() >= Pool::MAX_BUFFERS
                || bufs.iter().map(BytesMut::len).sum::<usize>() + buf.len() > Pool::MAX_BYTES)
        {
            bufs.remove(0);
        }
        if buf.len() <= Pool::MAX_BYTES {
            bufs.push(buf);
        }
    }

    /// `data` copied into a pooled buffer.
    fn copy<T: Element>(&self, data: &[T]) -> Bytes {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mut b = self.take(bytes.len());
        b.copy_from_slice(bytes);
        b.freeze()
    }

    /// Takes back the blocks of a finished collective that nothing else holds.
    fn recycle(&self, blocks: Blocks) {
        blocks.into_values().filter_map(|b| b.try_into_mut().ok()).for_each(|b| self.give(b));
    }
}

fn to_vec<T: Element>(b: &Bytes) -> Result<Vec<T>> {
    if !b.len().is_multiple_of(size_of::<T>()) {
        return Err(Error::Invalid(format!("{} bytes are not a whole number of {}", b.len(), T::NAME)));
    }
    Ok(bytemuck::pod_collect_to_vec(b))
}

fn copy_into<T: Element>(out: &mut [T], b: &Bytes) -> Result<()> {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    if bytes.len() != b.len() {
        return Err(Error::Invalid(format!("expected {} bytes, the collective produced {}", bytes.len(), b.len())));
    }
    bytes.copy_from_slice(b);
    Ok(())
}

/// Lays `parts` end to end into `out`, which must be exactly as long.
fn copy_parts<T: Element, P: AsRef<[u8]>>(out: &mut [T], parts: &[P]) -> Result<()> {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    let total: usize = parts.iter().map(|p| p.as_ref().len()).sum();
    if total != bytes.len() {
        return Err(Error::Invalid(format!("expected {} bytes, the collective produced {total}", bytes.len())));
    }
    let mut at = 0;
    for p in parts {
        let p = p.as_ref();
        bytes[at..at + p.len()].copy_from_slice(p);
        at += p.len();
    }
    Ok(())
}

/// The future of a broadcast, all-reduce or barrier: on the board (a small call where the ranks
/// share a host), the call (in a reused box, see `shared::BoxedCall`) and where its result goes;
/// on any other path, that path's future, boxed (and within it, the rare large paths boxed
/// again, so the common message path's box stays small). Why: the board serves the calls whose
/// latency is a few hundred nanoseconds, where a future holding every path's state (416-560
/// bytes, copied each time the future moves) costs a measurable share; the other paths cost
/// microseconds, which one allocation does not change. 48 bytes in all.
///
/// A board call complete when made (a broadcast's root, the last rank to arrive) has already
/// written its result into the caller's buffer when the call returns, before its future is
/// polled; dropping that future changes nothing (the other ranks have their results too).
enum Collective<'a> {
    /// Complete (or failed) when made: a broadcast's root, the last rank to arrive.
    Ready(Option<Result<()>>),
    /// A board call; its result is copied into `out` (nothing for a broadcast's root or a
    /// barrier), as `ranks` blocks (see [`deliver`]).
    Board {
        call: shared::BoxedCall,
        out: Option<&'a mut [u8]>,
        ranks: u32,
    },
    Boxed(Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>),
}

impl<'a> Collective<'a> {
    fn board(call: Result<shared::Made>, out: Option<&'a mut [u8]>) -> Collective<'a> {
        Collective::board_gathered(call, out, 1)
    }

    /// [`Collective::board`] for a call whose result is `ranks` blocks (an all-gather's).
    fn board_gathered(call: Result<shared::Made>, out: Option<&'a mut [u8]>, ranks: u32) -> Collective<'a> {
        match call {
            Ok(shared::Made::Done(result)) => Collective::Ready(Some(deliver(out, &[result], ranks))),
            Ok(shared::Made::Waiting(call)) => Collective::Board { call: shared::BoxedCall::new(call), out, ranks },
            Err(e) => Collective::Ready(Some(Err(e))),
        }
    }

    fn boxed(f: impl Future<Output = Result<()>> + Send + 'a) -> Collective<'a> {
        Collective::Boxed(Box::pin(f))
    }
}

/// A board call's result into the caller's buffer, if it has one there: its pieces end to end, or
/// for an all-gather of `ranks` ranks, laid out by rank ([`copy_gathered`]).
fn deliver(out: Option<&mut [u8]>, parts: &[ferrocomm_collectives::shared::Data], ranks: u32) -> Result<()> {
    match out {
        None => Ok(()),
        Some(out) if ranks > 1 => copy_gathered(out, parts, ranks as usize),
        Some(out) => copy_parts(out, parts),
    }
}

impl Future for Collective<'_> {
    type Output = Result<()>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        match self.get_mut() {
            Collective::Board { call, out, ranks } => {
                let parts = std::task::ready!(Pin::new(call.get()).poll(cx))?;
                Poll::Ready(deliver(out.take(), &parts, *ranks))
            }
            Collective::Ready(r) => Poll::Ready(r.take().unwrap_or_else(|| Err(Error::Invalid("polled again".into())))),
            Collective::Boxed(f) => f.as_mut().poll(cx),
        }
    }
}

/// Lays out an all-gather that came in pieces: piece `k` holds every rank's `k`-th piece in rank
/// order; `out` gets every rank's whole part in rank order.
fn copy_gathered<T: Element, P: AsRef<[u8]>>(out: &mut [T], pieces: &[P], ranks: usize) -> Result<()> {
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
    let pieces = || pieces.iter().map(AsRef::as_ref);
    let total: usize = pieces().map(<[u8]>::len).sum();
    if total != bytes.len() || pieces().any(|p| !p.len().is_multiple_of(ranks)) {
        return Err(Error::Invalid(format!("expected {} bytes, the all-gather produced {total}", bytes.len())));
    }
    let block = total / ranks;
    let mut at = 0;
    for p in pieces().filter(|p| !p.is_empty()) {
        let len = p.len() / ranks;
        for (r, part) in p.chunks_exact(len).enumerate() {
            bytes[r * block + at..r * block + at + len].copy_from_slice(part);
        }
        at += len;
    }
    Ok(())
}

fn check_op<T: Element>(op: &ReduceOp<T>) -> Result<()> {
    if op.supported() { Ok(()) } else { Err(Error::Invalid(format!("{op:?} is not defined on {}", T::NAME))) }
}

impl Comm {
    /// Takes the next sequence number of this communicator for one collective call.
    fn slot(&self) -> Slot {
        let seq = self.sequence.collectives.fetch_add(1, Ordering::Relaxed);
        let comm =
            self.sequence.collective.get_or_init(|| Arc::new(self.with_context(self.context() | COLLECTIVE_BIT)));
        Slot { comm: comm.clone(), seq, pool: self.sequence.pool.clone(), refused: self.collective_gate().err() }
    }

    /// The algorithm this communicator uses for `op` with `bytes` per rank (and a commutative
    /// operator): what the selection table (and the hierarchy) decide.
    pub fn collective_algorithm(&self, op: Operation, bytes: usize) -> Algorithm {
        self.choose(op, bytes, true)
    }

    /// The algorithm for `op` with `bytes` per rank.
    fn choose(&self, op: Operation, bytes: usize, commutative: bool) -> Algorithm {
        if self.on_board(op, bytes) {
            Algorithm::SharedMemory
        } else if self.by_single_copy(op, bytes) {
            Algorithm::SingleCopy
        } else {
            self.choose_messages(op, bytes, commutative)
        }
    }

    /// Whether `op` with `bytes` per rank copies straight from the other ranks' memory: calls on
    /// one host where the kernel allows it, by default large ones of busy-polling ranks (their
    /// steps wait on the board), or any when pinned.
    fn by_single_copy(&self, op: Operation, bytes: usize) -> bool {
        if !(Algorithm::single_copy_serves(op) && self.on_one_host() && self.all_single_copy()) {
            return false;
        }
        let table = self.collective_table();
        match table.overrides.get(&op) {
            Some(pinned) => *pinned == Algorithm::SingleCopy,
            None => self.all_busy() && bytes >= table.single_copy_from(op, self.size()),
        }
    }

    /// Whether `op` with `bytes` per rank goes to the shared-memory board: calls on one host, by
    /// default small ones of busy-polling ranks (a sleeping rank is not woken by the board, see
    /// `shared`), or any that fit when pinned.
    fn on_board(&self, op: Operation, bytes: usize) -> bool {
        let table = self.collective_table();
        let n = self.size() as usize;
        // An all-to-all is not split into pieces: all of a rank's data must fit one.
        let fits = op != Operation::Alltoall || bytes.saturating_mul(n) <= ferrocomm_collectives::shared::capacity(n);
        if !(Algorithm::shared_memory_serves(op) && fits && self.on_one_host()) {
            return false;
        }
        match table.overrides.get(&op) {
            Some(pinned) => *pinned == Algorithm::SharedMemory,
            None => self.all_busy() && bytes <= table.shared_limit(op, self.size()),
        }
    }

    /// The algorithm for `op` with `bytes` per rank among those that send messages.
    fn choose_messages(&self, op: Operation, bytes: usize, commutative: bool) -> Algorithm {
        let call = Call { op, ranks: self.size(), bytes, commutative };
        let table = self.collective_table();
        // Reliable multicast serves broadcast and barrier when pinned (it needs a multicast group,
        // and pays off across hosts, not within one; see docs/multicast.md).
        if table.overrides.get(&op) == Some(&Algorithm::Multicast)
            && matches!(op, Operation::Bcast | Operation::Barrier)
        {
            return Algorithm::Multicast;
        }
        let forced = table.overrides.get(&op) == Some(&Algorithm::Hierarchical);
        let hierarchical = matches!(op, Operation::Barrier | Operation::Bcast | Operation::Allreduce)
            && commutative
            && self.hierarchy().is_some_and(|h| forced || h.worth_it());
        if hierarchical && (forced || !table.overrides.contains_key(&op)) {
            return Algorithm::Hierarchical;
        }
        table.choose(call)
    }

    /// Whether every member busy-polls: the default table's condition for the board and single
    /// copy (whose waits a sleeping rank would only see every `NAP`). Decided from what every
    /// rank announced, so all members choose alike even when their progress modes differ.
    fn all_busy(&self) -> bool {
        *self.sequence.all_busy.get_or_init(|| self.every_member(|w| self.inner().busy[w]))
    }

    /// Whether every member may read the others' memory (the kernel's ptrace rules for its user),
    /// from what each announced: single copy needs all of them.
    fn all_single_copy(&self) -> bool {
        *self.sequence.all_single_copy.get_or_init(|| self.every_member(|w| self.inner().single_copy[w]))
    }

    /// Whether `holds(world rank)` for every member.
    fn every_member(&self, holds: impl Fn(usize) -> bool) -> bool {
        (0..self.size()).all(|r| holds(self.world_rank(r) as usize))
    }

    /// Whether every member is on this host and reached through shared memory.
    fn on_one_host(&self) -> bool {
        *self.sequence.on_one_host.get_or_init(|| {
            let inner = self.inner();
            let here = inner.domains[inner.rank as usize];
            inner.shm_job.is_some()
                && (2..=BOARD_RANKS as u32).contains(&self.size())
                && self.every_member(|w| inner.domains[w] == here)
        })
    }

    /// Enqueues a call on this communicator's shared-memory board (opened on first use); see
    /// [`shared::Segment::call`].
    fn board_call(&self, kind: Kind, len: usize, input: &[u8], elem: usize) -> Result<shared::Made> {
        self.board()?.call(kind, len, input, elem)
    }

    /// [`Comm::board_call`] as a future of its pieces, complete or not (for the calls whose
    /// result is more than a copy into the caller's buffer).
    fn board_future(&self, kind: Kind, len: usize, input: &[u8], elem: usize) -> Result<shared::BoardCall> {
        self.board_call(kind, len, input, elem).map(shared::Made::into_future)
    }

    /// Starts a single-copy call on this communicator's board; see [`shared::Segment::lend`].
    fn lending(&self, kind: Kind, lent: Option<Lent>, held: &[Kind]) -> Result<shared::Lending> {
        self.board()?.lend(kind, lent, held)
    }

    /// Starts a gather-style single-copy call that lends `data` as `lend` says: every rank learns
    /// what the others lent, does its copies, then waits in a barrier until nobody reads what it
    /// lent any more.
    fn lend<T: Element>(&self, data: &[T], lend: Lend) -> Result<shared::Lending> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if let Lend::InPlace = lend {
            return self.lending(Kind::Allgather, Some(Lent::of(bytes)), &[Kind::Barrier]);
        }
        let mut copy = self.sequence.pool.take(bytes.len());
        copy.copy_from_slice(bytes);
        let mut call = self.lending(Kind::Allgather, Some(Lent::of(&copy)), &[Kind::Barrier])?;
        call.keep(copy);
        Ok(call)
    }

    /// This communicator's shared-memory board, opened on first use.
    fn board(&self) -> Result<&Arc<shared::Segment>> {
        let seg = self.sequence.board.get_or_init(|| {
            let job = self.inner().shm_job.as_deref().ok_or_else(|| Error::Invalid("no shared memory".into()))?;
            shared::Segment::open(self, job).map(Arc::new)
        });
        seg.as_ref().map_err(Clone::clone)
    }

    /// The node-leader decomposition, if this communicator spans more than one host.
    fn hierarchy(&self) -> Option<&Hierarchy> {
        let h = self.sequence.hierarchy.get_or_init(|| {
            let nodes = &self.inner().nodes;
            let node_of: Vec<u32> = (0..self.size()).map(|r| nodes[self.world_rank(r) as usize]).collect();
            let mut leader_rank: Vec<Rank> = vec![Rank::MAX; node_of.iter().max().map_or(0, |m| *m as usize + 1)];
            for (r, &n) in node_of.iter().enumerate().rev() {
                leader_rank[n as usize] = r as Rank;
            }
            let me = self.rank();
            let mine = node_of[me as usize];
            // Derived without communication: every member computes the same groups and contexts.
            let sub = |members: Vec<Rank>, context: u32| {
                let world: Vec<Rank> = members.iter().map(|&r| self.world_rank(r)).collect();
                let mut c = self.with_context(context);
                c.group = Some(Arc::new(Group::new(world, self.world_rank(me))));
                c
            };
            let node_context = derive_context(derive_context(self.context(), u32::MAX - 1), mine);
            let node = sub((0..self.size()).filter(|&r| node_of[r as usize] == mine).collect(), node_context);
            let leaders = (leader_rank[mine as usize] == me).then(|| {
                let members = leader_rank.iter().copied().filter(|&r| r != Rank::MAX).collect();
                sub(members, derive_context(self.context(), u32::MAX - 2))
            });
            Hierarchy { node, leaders, node_of, leader_rank }
        });
        (h.leader_rank.iter().filter(|&&r| r != Rank::MAX).count() > 1).then_some(h)
    }

    /// Runs `machine` on `slot`: posts what it asks, feeds it what arrives, until it is done and
    /// its sends have completed.
    ///
    /// One progress loop serves all of the call's operations: each wait spins once and looks at
    /// every posted receive (an [`Op`] awaited alone would spin on itself only, for up to a few
    /// hundred rounds, before the next one is looked at), and everything that arrived is delivered
    /// before the next wait.
    ///
    /// Boxed: the machine and the driving state stay put on the heap, so the futures of the calls
    /// that await it stay small (they are moved, i.e. copied, on every call; a future of several
    /// kilobytes is a measurable share of a small collective).
    fn drive(slot: Slot, m: Machine) -> Drive {
        Box::pin(Comm::run(slot, m))
    }

    async fn run(slot: Slot, m: Machine) -> Result<Blocks> {
        let Slot { comm, seq, pool, refused } = slot;
        // A member already lost or departed when the call was made, or lost since: the call
        // could never complete.
        if let Some(e) = refused.or_else(|| comm.revoked()) {
            return Err(e);
        }
        // A peer's message, or the blocks its header announces, cannot exceed what a receive takes.
        let mut m = m.with_max_message(comm.settings().max_message);
        let tag = |round: u32| (seq << 16) | u64::from(round);
        // A handful of operations at a time: inline vectors (no task allocations).
        let mut sends = Sends::new();
        let mut recvs = Recvs::new();
        loop {
            while let Some(a) = m.poll_action() {
                match a {
                    Action::Send { to, round, data } => sends.push(comm.send(to, tag(round), data)),
                    Action::Recv { from, round, part, len: Some(len) } if len >= Pool::MIN => {
                        // A block of known length: straight into a reused buffer.
                        let op = comm.recv_into(from, tag(round), pool.take(len));
                        recvs.push((from, round, part, Incoming::Into(op)));
                    }
                    Action::Recv { from, round, part, .. } => {
                        recvs.push((from, round, part, Incoming::Plain(comm.recv(from, tag(round)))));
                    }
                }
            }
            if m.is_done() {
                break;
            }
            if recvs.is_empty() {
                return Err(Error::Invalid("collective waits with nothing posted".into()));
            }
            if !recvs.iter().any(|r| r.3.is_ready()) {
                let mut wait = Wait::default();
                futures::future::poll_fn(|cx| {
                    comm.poll_progress(cx, &mut wait, |d, mut cx| {
                        let mut any = false;
                        for r in recvs.iter_mut() {
                            any |= r.3.harvest(d, cx.as_deref_mut());
                        }
                        sends.iter_mut().for_each(|s| _ = s.harvest(d, None));
                        if any { Poll::Ready(()) } else { Poll::Pending }
                    })
                })
                .await;
            }
            // Everything that has arrived, in posting order (the machine orders what it applies).
            let mut i = 0;
            while i < recvs.len() {
                if !recvs[i].3.is_ready() {
                    i += 1;
                    continue;
                }
                let (from, round, part, mut op) = recvs.remove(i);
                let data = op.take()?;
                m.deliver(from, round, part, data)?;
                m.take_spare().into_iter().for_each(|b| pool.give(b));
            }
            take_sends(&mut sends)?;
        }
        if !sends.iter().all(Op::is_ready) {
            let mut wait = Wait::default();
            futures::future::poll_fn(|cx| {
                comm.poll_progress(cx, &mut wait, |d, mut cx| {
                    // Every send is looked at (and, before a sleep, registers its waker).
                    let pending = sends.iter_mut().map(|s| s.harvest(d, cx.as_deref_mut())).filter(|&r| !r).count();
                    if pending == 0 { Poll::Ready(()) } else { Poll::Pending }
                })
            })
            .await;
        }
        take_sends(&mut sends)?;
        Ok(m.into_blocks())
    }

    /// Waits until every rank of the communicator has entered the barrier (dissemination:
    /// ceil(log2 n) rounds; node-leader when the communicator spans several hosts).
    pub fn barrier(&self) -> impl Future<Output = Result<()>> + Send + use<> {
        let alg = self.choose(Operation::Barrier, 0, true);
        if alg == Algorithm::SharedMemory {
            return Collective::board(self.board_call(Kind::Barrier, 0, &[], 1), None);
        }
        let multicast = (alg == Algorithm::Multicast).then(|| self.clone());
        let plan = if alg == Algorithm::Multicast {
            // Takes its sequence number like any call, but runs on the multicast channel.
            self.slot();
            None
        } else if alg == Algorithm::Hierarchical {
            let h = self.hierarchy().expect("chosen");
            let (n, l) = (&h.node, h.leaders.as_ref());
            let (nr, nn) = (n.rank(), n.size());
            let up = (n.slot(), ops::gather(nr, nn, 0, Algorithm::Binomial, Bytes::new()));
            let mid = l.map(|l| (l.slot(), ops::barrier(l.rank(), l.size(), Algorithm::Dissemination)));
            let down = (n.slot(), ops::bcast(nr, nn, 0, Algorithm::Binomial, (nr == 0).then(Bytes::new), 1));
            Some(Err(Box::new((up, mid, down))))
        } else {
            let slot = self.slot();
            Some(Ok(ops::barrier(self.rank(), self.size(), alg).map(|m| Comm::drive(slot, m))))
        };
        Collective::boxed(async move {
            if let Some(comm) = multicast {
                // The skew-tolerant token barrier of the reliable multicast layer. Boxed, as
                // every rare path here: its set-up future is large, and would otherwise size
                // (and be copied with) every message-based barrier's future.
                return Box::pin(async move {
                    comm.collective_gate()?;
                    let barrier = comm.sequence.token_barrier.get_or_try_init(|| TokenBarrier::new(&comm)).await?;
                    barrier.wait().await
                })
                .await;
            }
            match plan {
                None => Err(Error::Invalid("a multicast barrier without its channel".into())),
                Some(Ok(run)) => run?.await.map(drop),
                Some(Err(hier)) => {
                    Box::pin(async move {
                        let (up, mid, down) = *hier;
                        Comm::drive(up.0, up.1?).await?;
                        if let Some((s, m)) = mid {
                            Comm::drive(s, m?).await?;
                        }
                        Comm::drive(down.0, down.1?).await.map(drop)
                    })
                    .await
                }
            }
        })
    }

    /// Broadcasts the root's `buf` into every rank's `buf` (all ranks pass the same length).
    pub fn broadcast<'a, T: Element>(
        &self,
        root: Rank,
        buf: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let (bytes, me) = (size_of_val(buf), self.rank());
        let alg = self.choose(Operation::Bcast, bytes, true);
        if root < self.size() && alg == Algorithm::SharedMemory {
            let input = if me == root { bytemuck::cast_slice(buf) } else { &[] };
            if me == root && self.board().is_ok_and(|seg| seg.root_now(input)) {
                return Collective::Ready(Some(Ok(())));
            }
            let call = self.board_call(Kind::Bcast { root }, bytes, input, size_of::<T>());
            return Collective::board(call, (me != root).then(|| bytemuck::cast_slice_mut(buf)));
        }
        let direct = (root < self.size() && alg == Algorithm::SingleCopy).then(|| {
            let lent = (me == root).then(|| Lent::of(bytemuck::cast_slice(buf)));
            self.lending(Kind::Bcast { root }, lent, &[Kind::Fanin { root }])
        });
        let run = direct.is_none().then(|| {
            let pool = self.sequence.pool.clone();
            let data = (me == root).then(|| pool.copy(buf));
            (self.bcast_with(root, data, alg, size_of::<T>(), Some(bytes)), pool)
        });
        Collective::boxed(async move {
            let Some((run, pool)) = run else {
                let call = direct.expect("one of the two")?;
                return Box::pin(bcast_single_copy(call, root, me, bytemuck::cast_slice_mut(buf))).await;
            };
            let parts = run.await?;
            if me != root {
                copy_parts(buf, &parts)?;
            }
            // The received (or sent) buffers serve the next large calls.
            parts.into_iter().filter_map(|b| b.try_into_mut().ok()).for_each(|b| pool.give(b));
            Ok(())
        })
    }

    /// Broadcasts bytes whose length only the root knows (binomial tree).
    pub fn broadcast_bytes(
        &self,
        root: Rank,
        data: Option<Bytes>,
    ) -> impl Future<Output = Result<Bytes>> + Send + use<> {
        let early = match (&data, self.rank() == root) {
            (None, true) => Some(Error::Invalid("the root must provide the data".into())),
            _ => None,
        };
        let run = self.bcast_with(root, data.filter(|_| self.rank() == root), Algorithm::Binomial, 1, None);
        async move {
            match early {
                Some(e) => Err(e),
                // Binomial: one part, shared as it came.
                None => Ok(ops::join(run.await?)),
            }
        }
    }

    /// `len`: the length every rank knows the data has, if they do. The data comes back in pieces
    /// (one, except for scatter + all-gather), to be copied out or joined by the caller.
    fn bcast_with(
        &self,
        root: Rank,
        data: Option<Bytes>,
        alg: Algorithm,
        elem: usize,
        len: Option<usize>,
    ) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        let (r, n) = (self.rank(), self.size());
        let early = self.check_root(root);
        let multicast = (alg == Algorithm::Multicast && early.is_none()).then(|| (self.clone(), data.clone()));
        let plan = if early.is_some() || multicast.is_some() {
            None
        } else if alg == Algorithm::Hierarchical {
            // Root -> its node's leader -> every leader -> every node.
            let h = self.hierarchy().expect("chosen");
            let (node, root_node) = (&h.node, h.node_of[root as usize]);
            let mine = h.node_of[r as usize] == root_node;
            let node_root = node_rank_of(h, root);
            let at = |c: &Comm, root: Rank| (c.slot(), c.rank(), c.size(), root);
            let first = mine.then(|| at(node, node_root));
            let leaders = h.leaders.as_ref().map(|l| at(l, h.leader_position(root_node)));
            let last = (!mine).then(|| at(node, 0));
            Some(Err(Box::new((data, [first, leaders, last]))))
        } else {
            let m = ops::bcast(r, n, root, alg, data, elem).map(|m| match len {
                Some(len) => m.with_block_len(len),
                None => m,
            });
            let slot = self.slot();
            Some(Ok((m.map(|m| Comm::drive(slot, m)), alg, n)))
        };
        async move {
            if let Some((comm, data)) = multicast {
                // Boxed, as in the barrier: a large future kept out of every broadcast's.
                return Box::pin(async move {
                    comm.collective_gate()?;
                    let chan = comm.sequence.multicast.get_or_try_init(|| Channel::new(&comm)).await?;
                    crate::multicast::broadcast(chan, root, data).await.map(|b| vec![b])
                })
                .await;
            }
            match plan {
                None => Err(early.expect("set")),
                Some(Ok((run, alg, n))) => Ok(ops::bcast_parts(&run?.await?, n, alg)?),
                Some(Err(hier)) => {
                    Box::pin(async move {
                        // Root's node, then the leaders, then the other nodes; each step's root
                        // holds the data by the time it starts.
                        let (mut have, steps) = *hier;
                        for (slot, r, n, root) in steps.into_iter().flatten() {
                            let data = if r == root { have.clone() } else { None };
                            let m = ops::bcast(r, n, root, Algorithm::Binomial, data, elem)?;
                            have = Some(ops::bcast_result(&Comm::drive(slot, m).await?, n, Algorithm::Binomial)?);
                        }
                        have.map(|b| vec![b])
                            .ok_or_else(|| Error::Invalid("hierarchical broadcast ended without data".into()))
                    })
                    .await
                }
            }
        }
    }

    fn check_root(&self, root: Rank) -> Option<Error> {
        (root >= self.size()).then(|| Error::UnknownRank { rank: root, size: self.size() })
    }

    /// Combines every rank's `data` with `op` at `root`: `Some(result)` there, `None` elsewhere.
    /// The future borrows `data`: by single copy (large calls on one host) the root reads it where
    /// it is.
    pub fn reduce<'a, T: Element>(
        &self,
        root: Rank,
        data: &'a [T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Option<Vec<T>>>> + Send + use<'a, T> {
        let alg = self.choose(Operation::Reduce, size_of_val(data), op.is_commutative());
        let early = self.check_root(root).or_else(|| check_op(&op).err());
        let (r, n) = (self.rank(), self.size());
        let len = size_of_val(data);
        let board = (early.is_none() && alg == Algorithm::SharedMemory).then(|| {
            let kind = Kind::Reduce { root, op: op.erase() };
            self.board_future(kind, len, bytemuck::cast_slice(data), size_of::<T>())
        });
        let direct = (early.is_none() && alg == Algorithm::SingleCopy).then(|| self.lend(data, Lend::InPlace));
        let plan = (early.is_none() && board.is_none() && direct.is_none()).then(|| {
            let m = ops::reduce(r, n, root, alg, to_bytes(data), op.erase()).map(|m| m.with_block_len(len));
            (self.slot(), m)
        });
        let pool = self.sequence.pool.clone();
        async move {
            if let Some(call) = direct {
                // The root combines every rank's data straight from its memory, its own from
                // `data`, which the future borrows (the others' calls lend theirs in place too).
                let own: &[u8] = bytemuck::cast_slice(data);
                return gather_single_copy(call?, n, len, &pool, |call, lent| {
                    let mut out = (r == root).then(|| vec![T::zeroed(); len / size_of::<T>()]);
                    if let Some(out) = out.as_mut() {
                        let dst = bytemuck::cast_slice_mut(out);
                        combine(call, lent, r as usize, &op.erase(), 0, Some(own), dst, &pool)?;
                    }
                    Ok(out)
                })
                .await;
            }
            if let Some(call) = board {
                let pieces = call?.await?;
                if r != root {
                    return Ok(None);
                }
                let mut out = vec![T::zeroed(); len / size_of::<T>()];
                copy_parts(&mut out, &pieces)?;
                return Ok(Some(out));
            }
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            let blocks = Comm::drive(slot, m?).await?;
            if r != root {
                return Ok(None);
            }
            to_vec(&ops::concat(&blocks, [0])?).map(Some)
        }
    }

    /// Combines every rank's `buf` with `op` and leaves the result in every rank's `buf`.
    pub fn allreduce<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let alg = self.choose(Operation::Allreduce, size_of_val(buf), op.is_commutative());
        let early = check_op(&op).err();
        let (r, n) = (self.rank(), self.size());
        if early.is_none() && alg == Algorithm::SharedMemory {
            let kind = Kind::Allreduce(op.erase());
            let call = self.board_call(kind, size_of_val(buf), bytemuck::cast_slice(buf), size_of::<T>());
            return Collective::board(call, Some(bytemuck::cast_slice_mut(buf)));
        }
        let direct = (early.is_none() && alg == Algorithm::SingleCopy).then(|| {
            let lent = Lent::of(bytemuck::cast_slice(buf));
            self.lending(Kind::Allgather, Some(lent), &[Kind::Barrier, Kind::Barrier])
        });
        let pool = self.sequence.pool.clone();
        let data = if direct.is_none() { pool.copy(buf) } else { Bytes::new() };
        let plan = if early.is_some() || direct.is_some() {
            None
        } else if alg == Algorithm::Hierarchical {
            let h = self.hierarchy().expect("chosen");
            let node = &h.node;
            let up = (node.slot(), ops::reduce(node.rank(), node.size(), 0, Algorithm::Binomial, data, op.erase()));
            let mid = h.leaders.as_ref().map(|l| {
                let a = l.choose(Operation::Allreduce, size_of_val(buf), true);
                (l.slot(), l.size(), a, op.erase())
            });
            let down = node.slot();
            let (nr, nn) = (node.rank(), node.size());
            Some(Err(Box::new((up, mid, down, nr, nn))))
        } else {
            let (bytes, slot) = (size_of_val(buf), self.slot());
            Some(Ok(ops::allreduce(r, n, alg, data, op.erase()).map(|m| Comm::drive(slot, m.with_block_len(bytes)))))
        };
        Collective::boxed(async move {
            if let Some(call) = direct {
                let buf = bytemuck::cast_slice_mut(buf);
                return Box::pin(allreduce_single_copy(call?, buf, op.erase(), r, n, &pool)).await;
            }
            let out = match plan {
                None => return Err(early.expect("set")),
                Some(Ok(run)) => {
                    let blocks = run?.await?;
                    // Segments straight into `buf` (not laid end to end first).
                    copy_parts(buf, &ops::allreduce_parts(&blocks, n, alg)?)?;
                    pool.recycle(blocks);
                    return Ok(());
                }
                Some(Err(hier)) => {
                    Box::pin(async move {
                        let (up, mid, down, nr, nn) = *hier;
                        let partial = ops::concat(&Comm::drive(up.0, up.1?).await?, [0])?;
                        let mut have = (nr == 0).then_some(partial);
                        if let (Some((slot, ln, a, reducer)), Some(d)) = (mid, have.take()) {
                            let lr = slot.comm.rank();
                            let m = ops::allreduce(lr, ln, a, d, reducer)?;
                            have = Some(ops::allreduce_result(&Comm::drive(slot, m).await?, ln, a)?);
                        }
                        let m = ops::bcast(nr, nn, 0, Algorithm::Binomial, have, size_of::<T>())?;
                        Ok::<_, Error>(ops::bcast_result(&Comm::drive(down, m).await?, nn, Algorithm::Binomial)?)
                    })
                    .await?
                }
            };
            copy_into(buf, &out)
        })
    }

    /// Gathers every rank's `data` (all of one length) at `root`, concatenated in rank order.
    pub fn gather<T: Element>(
        &self,
        root: Rank,
        data: &[T],
    ) -> impl Future<Output = Result<Option<Vec<T>>>> + Send + use<T> {
        let run = self.gather_plan(root, to_bytes(data), size_of_val(data));
        async move {
            let Some(parts) = run.await? else { return Ok(None) };
            let mut out = Vec::new();
            for p in &parts {
                out.extend(to_vec::<T>(p)?);
            }
            Ok(Some(out))
        }
    }

    /// Gathers every rank's `data` (lengths may differ) at `root`: one vector per rank.
    pub fn gatherv<T: Element>(
        &self,
        root: Rank,
        data: &[T],
    ) -> impl Future<Output = Result<Option<Vec<Vec<T>>>>> + Send + use<T> {
        let run = self.gather_bytes(root, to_bytes(data));
        async move {
            let Some(parts) = run.await? else { return Ok(None) };
            parts.iter().map(to_vec).collect::<Result<Vec<_>>>().map(Some)
        }
    }

    /// Gathers one message per rank at `root` (any lengths).
    pub fn gather_bytes(
        &self,
        root: Rank,
        data: Bytes,
    ) -> impl Future<Output = Result<Option<Vec<Bytes>>>> + Send + use<> {
        // Lengths may differ between ranks, so the choice may not depend on them.
        self.gather_plan(root, data, 0)
    }

    fn gather_plan(
        &self,
        root: Rank,
        data: Bytes,
        bytes: usize,
    ) -> impl Future<Output = Result<Option<Vec<Bytes>>>> + Send + use<> {
        let alg = self.choose(Operation::Gather, bytes, true);
        let (r, n) = (self.rank(), self.size());
        let early = self.check_root(root);
        let plan = early.is_none().then(|| (self.slot(), ops::gather(r, n, root, alg, data)));
        async move {
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            let blocks = Comm::drive(slot, m?).await?;
            if r != root {
                return Ok(None);
            }
            Ok(Some(ops::gather_result(&blocks, n, root)?))
        }
    }

    /// Splits the root's `data` into equal parts, one per rank in rank order, and returns this
    /// rank's part. Other ranks pass `None`.
    pub fn scatter<T: Element>(
        &self,
        root: Rank,
        data: Option<&[T]>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let n = self.size() as usize;
        let parts = match data {
            Some(d) if !d.len().is_multiple_of(n) => {
                Err(Error::Invalid(format!("{} elements do not split into {n} parts", d.len())))
            }
            Some(d) => {
                let k = d.len() / n;
                Ok(Some((0..n).map(|i| to_bytes(&d[i * k..(i + 1) * k])).collect()))
            }
            None => Ok(None),
        };
        self.scatter_bytes_typed::<T>(root, parts)
    }

    /// Sends `parts[i]` of the root to rank i (lengths may differ); returns this rank's part.
    pub fn scatterv<T: Element>(
        &self,
        root: Rank,
        parts: Option<&[Vec<T>]>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        self.scatter_bytes_typed::<T>(root, Ok(parts.map(|p| p.iter().map(|v| to_bytes(v)).collect())))
    }

    fn scatter_bytes_typed<T: Element>(
        &self,
        root: Rank,
        parts: Result<Option<Vec<Bytes>>>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let run = parts.map(|p| self.scatter_bytes(root, p));
        async move { to_vec(&run?.await?) }
    }

    /// Sends message `parts[i]` of the root to rank i; returns this rank's.
    pub fn scatter_bytes(
        &self,
        root: Rank,
        parts: Option<Vec<Bytes>>,
    ) -> impl Future<Output = Result<Bytes>> + Send + use<> {
        let alg = self.choose(Operation::Scatter, 0, true);
        let (r, n) = (self.rank(), self.size());
        let early = self.check_root(root).or_else(|| match (&parts, r == root) {
            (Some(p), true) if p.len() != n as usize => {
                Some(Error::Invalid(format!("{} parts for {n} ranks", p.len())))
            }
            (None, true) => Some(Error::Invalid("the root must provide the parts".into())),
            _ => None,
        });
        let plan = early.is_none().then(|| (self.slot(), ops::scatter(r, n, root, alg, parts.filter(|_| r == root))));
        async move {
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            Ok(ops::scatter_result(&Comm::drive(slot, m?).await?, r, n, root)?)
        }
    }

    /// Every rank's `data` (all of one length), concatenated in rank order, at every rank.
    pub fn allgather<T: Element>(&self, data: &[T]) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let mut out = vec![T::zeroed(); data.len() * self.size() as usize];
        let run = self.allgather_plan(data, &mut out, Lend::Copy);
        async move {
            run(&mut out).await?;
            Ok(out)
        }
    }

    /// [`Comm::allgather`] into `out` (`size` times the length of `data`), like `MPI_Allgather`.
    /// The future borrows `data`: by single copy (large calls on one host) the other ranks read it
    /// where it is.
    pub fn allgather_into<'a, T: Element>(
        &self,
        data: &'a [T],
        out: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        // On the board: the blocks straight into `out`, with nothing boxed (as a broadcast).
        if self.choose(Operation::Allgather, size_of_val(data), true) == Algorithm::SharedMemory {
            let call = self.board_call(Kind::Allgather, size_of_val(data), bytemuck::cast_slice(data), size_of::<T>());
            return Collective::board_gathered(call, Some(bytemuck::cast_slice_mut(out)), self.size());
        }
        let run = self.allgather_plan(data, out, Lend::InPlace);
        Collective::boxed(lending_in_place(data, run(out)))
    }

    /// Plans an all-gather of `data` into `out` (this rank's own block goes in now, by single
    /// copy); the returned closure runs the rest into the same `out`. `lend`: see [`Lend`].
    fn allgather_plan<T: Element>(
        &self,
        data: &[T],
        out: &mut [T],
        lend: Lend,
    ) -> impl FnOnce(&mut [T]) -> futures::future::BoxFuture<'_, Result<()>> + use<T> {
        let alg = self.choose(Operation::Allgather, size_of_val(data), true);
        let (r, n) = (self.rank(), self.size());
        let pool = self.sequence.pool.clone();
        let bytes = bytemuck::cast_slice(data);
        let len = bytes.len();
        let board =
            (alg == Algorithm::SharedMemory).then(|| self.board_future(Kind::Allgather, len, bytes, size_of::<T>()));
        let direct = (alg == Algorithm::SingleCopy).then(|| {
            let out: &mut [u8] = bytemuck::cast_slice_mut(out);
            if out.len() != n as usize * len {
                return Err(Error::Invalid(format!("all-gather of {len} bytes into {}", out.len())));
            }
            out[r as usize * len..(r as usize + 1) * len].copy_from_slice(bytes);
            self.lend(data, lend)
        });
        let plan =
            (board.is_none() && direct.is_none()).then(|| (self.slot(), ops::allgather(r, n, alg, pool.copy(data))));
        move |out: &mut [T]| {
            Box::pin(async move {
                if let Some(call) = direct {
                    // Every other block straight from its rank's memory into `out`.
                    let out: &mut [u8] = bytemuck::cast_slice_mut(out);
                    return gather_single_copy(call?, n, len, &pool, |call, lent| {
                        for (i, block) in out.chunks_exact_mut(len.max(1)).enumerate().take(n as usize) {
                            if i != r as usize {
                                call.read(i as Rank, &lent[i], 0, block)?;
                            }
                        }
                        Ok(())
                    })
                    .await;
                }
                let Some(plan) = plan else {
                    let pieces = board.expect("one of the two")?.await?;
                    return copy_gathered(out, &pieces, n as usize);
                };
                let blocks = Comm::drive(plan.0, plan.1?).await?;
                copy_parts(out, &ops::allgather_result(&blocks, n)?)?;
                pool.recycle(blocks);
                Ok(())
            })
        }
    }

    /// Every rank's `data` (lengths may differ), one vector per rank, at every rank.
    pub fn allgatherv<T: Element>(&self, data: &[T]) -> impl Future<Output = Result<Vec<Vec<T>>>> + Send + use<T> {
        let run = self.allgather_bytes(to_bytes(data));
        async move { run.await?.iter().map(to_vec).collect() }
    }

    /// Every rank's message (any lengths) at every rank.
    pub fn allgather_bytes(&self, data: Bytes) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        // Lengths differ between ranks: not for the board, whose all-gather parts are all alike.
        let alg = self.choose_messages(Operation::Allgather, 0, true);
        self.allgather_with(data, alg)
    }

    fn allgather_with(&self, data: Bytes, alg: Algorithm) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        let (r, n) = (self.rank(), self.size());
        let (slot, m) = (self.slot(), ops::allgather(r, n, alg, data));
        async move { Ok(ops::allgather_result(&Comm::drive(slot, m?).await?, n)?) }
    }

    /// All-to-all: `data` holds one equal part per rank in rank order; the result holds what each
    /// rank sent to this one, in rank order.
    pub fn alltoall<T: Element>(&self, data: &[T]) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let mut out = vec![T::zeroed(); data.len()];
        let run = self.alltoall_plan(data, &mut out, Lend::Copy);
        async move {
            run(&mut out).await?;
            Ok(out)
        }
    }

    /// [`Comm::alltoall`] into `out` (as long as `data`), like `MPI_Alltoall`. The future borrows
    /// `data`: by single copy (large calls on one host) the other ranks read it where it is.
    pub fn alltoall_into<'a, T: Element>(
        &self,
        data: &'a [T],
        out: &'a mut [T],
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        // On the board (always one piece): this rank's block of every rank's data, in rank order,
        // straight into `out`, with nothing boxed.
        let part = size_of_val(data) / self.size() as usize;
        if alltoall_misfit(data, out, self.size()).is_none()
            && self.choose(Operation::Alltoall, part, true) == Algorithm::SharedMemory
        {
            let call = self.board_call(Kind::Alltoall, size_of_val(data), bytemuck::cast_slice(data), size_of::<T>());
            return Collective::board(call, Some(bytemuck::cast_slice_mut(out)));
        }
        let run = self.alltoall_plan(data, out, Lend::InPlace);
        Collective::boxed(lending_in_place(data, run(out)))
    }

    /// Plans an all-to-all of `data` into `out`. This rank's own part goes from `data` to `out`
    /// now, directly: only the parts that travel are copied into the call's buffers (and only
    /// received ones copied out), one pass over the own part instead of two. The returned
    /// closure runs the rest into the same `out`. `lend`: see [`Lend`].
    fn alltoall_plan<T: Element>(
        &self,
        data: &[T],
        out: &mut [T],
        lend: Lend,
    ) -> impl FnOnce(&mut [T]) -> futures::future::BoxFuture<'_, Result<()>> + use<T> {
        let (r, n) = (self.rank(), self.size());
        let early = alltoall_misfit(data, out, n);
        let elems = data.len() / n as usize;
        let part = elems * size_of::<T>();
        let pool = self.sequence.pool.clone();
        let mine = r as usize * elems..(r as usize + 1) * elems;
        let alg = self.choose(Operation::Alltoall, part, true);
        let board = (early.is_none() && alg == Algorithm::SharedMemory)
            .then(|| self.board_future(Kind::Alltoall, size_of_val(data), bytemuck::cast_slice(data), size_of::<T>()));
        let direct = (early.is_none() && alg == Algorithm::SingleCopy).then(|| self.lend(data, lend));
        if early.is_none() && board.is_none() {
            // Messages and single copy alike: the own part does not travel.
            out[mine.clone()].copy_from_slice(&data[mine.clone()]);
        }
        let plan = (early.is_none() && board.is_none() && direct.is_none()).then(|| {
            let travel = (0..n as usize).filter(|&i| i != r as usize).map(|i| &data[i * elems..(i + 1) * elems]);
            let mut all = pool.take(part * (n as usize - 1));
            for (chunk, src) in all.chunks_mut(part.max(1)).zip(travel) {
                chunk.copy_from_slice(bytemuck::cast_slice(src));
            }
            let all = all.freeze();
            // The own part is an empty block: it never travels (no algorithm sends a rank's own
            // block) and is not read back. Part i > r sits at i - 1 in `all`.
            let parts = (0..n as usize)
                .map(|i| match i.cmp(&(r as usize)) {
                    std::cmp::Ordering::Less => all.slice(i * part..(i + 1) * part),
                    std::cmp::Ordering::Equal => Bytes::new(),
                    std::cmp::Ordering::Greater => all.slice((i - 1) * part..i * part),
                })
                .collect();
            (self.slot(), ops::alltoall(r, n, alg, parts))
        });
        move |out: &mut [T]| {
            Box::pin(async move {
                if let Some(call) = direct {
                    // Block `r` of every rank's data straight from its memory (the own one is in).
                    let out: &mut [u8] = bytemuck::cast_slice_mut(out);
                    return gather_single_copy(call?, n, part * n as usize, &pool, |call, lent| {
                        for (i, block) in out.chunks_exact_mut(part.max(1)).enumerate().take(n as usize) {
                            if i != r as usize {
                                call.read(i as Rank, &lent[i], r as usize * part, block)?;
                            }
                        }
                        Ok(())
                    })
                    .await;
                }
                if let Some(call) = board {
                    return copy_parts(out, &call?.await?);
                }
                let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
                let blocks = Comm::drive(slot, m?).await?;
                let got = ops::alltoall_result(&blocks, r, n)?;
                let bytes: &mut [u8] = bytemuck::cast_slice_mut(out);
                for (i, b) in got.iter().enumerate().filter(|&(i, _)| i != r as usize) {
                    if b.len() != part {
                        return Err(Error::Invalid(format!(
                            "all-to-all part of {} bytes from rank {i}, not {part}",
                            b.len()
                        )));
                    }
                    bytes[i * part..(i + 1) * part].copy_from_slice(b);
                }
                pool.recycle(blocks);
                Ok(())
            })
        }
    }

    /// All-to-all with parts of any lengths: `parts[i]` goes to rank i.
    pub fn alltoallv<T: Element>(&self, parts: &[Vec<T>]) -> impl Future<Output = Result<Vec<Vec<T>>>> + Send + use<T> {
        let run = self.alltoall_bytes(parts.iter().map(|p| to_bytes(p)).collect());
        async move { run.await?.iter().map(to_vec).collect() }
    }

    /// All-to-all of messages: `parts[i]` goes to rank i (pairwise exchange: lengths may differ).
    pub fn alltoall_bytes(&self, parts: Vec<Bytes>) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        let table = self.collective_table();
        // Lengths differ between ranks: a pinned algorithm if it can take that, pairwise otherwise.
        let pinned = table.overrides.get(&Operation::Alltoall).copied();
        let alg = pinned.filter(|a| a.serves(Operation::Alltoall)).unwrap_or(Algorithm::Pairwise);
        self.alltoall_with(parts, alg)
    }

    fn alltoall_with(
        &self,
        parts: Vec<Bytes>,
        alg: Algorithm,
    ) -> impl Future<Output = Result<Vec<Bytes>>> + Send + use<> {
        let (r, n) = (self.rank(), self.size());
        let (slot, m) = (self.slot(), ops::alltoall(r, n, alg, parts));
        async move { Ok(ops::alltoall_result(&Comm::drive(slot, m?).await?, r, n)?) }
    }

    /// Reduces `data` element-wise over all ranks and scatters the result: rank i gets
    /// `counts[i]` elements (in order). Every rank passes the same `counts`.
    pub fn reduce_scatter<T: Element>(
        &self,
        data: &[T],
        counts: &[usize],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let n = self.size() as usize;
        let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)).unwrap_or(usize::MAX);
        let early = if counts.len() != n || total != data.len() {
            Some(Error::Invalid(format!(
                "{} counts summing to {total} for {n} ranks and {} elements",
                counts.len(),
                data.len()
            )))
        } else {
            check_op(&op).err()
        };
        let mut at = 0usize;
        let segments: Vec<Bytes> = counts
            .iter()
            .map(|&c| {
                let end = at.saturating_add(c).min(data.len());
                let s = to_bytes(&data[at.min(end)..end]);
                at = end;
                s
            })
            .collect();
        let alg = self.choose(Operation::ReduceScatter, size_of_val(data), op.is_commutative());
        let (r, n) = (self.rank(), self.size());
        let plan = early.is_none().then(|| (self.slot(), ops::reduce_scatter(r, n, alg, segments, op.erase())));
        async move {
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            to_vec(&ops::reduce_scatter_result(&Comm::drive(slot, m?).await?, r)?)
        }
    }

    /// [`Comm::reduce_scatter`] with equal counts: `data.len() / size` elements per rank.
    pub fn reduce_scatter_block<T: Element>(
        &self,
        data: &[T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Vec<T>>> + Send + use<T> {
        let n = self.size() as usize;
        // A length that does not divide leaves counts that do not sum up: reported as invalid.
        let counts = vec![data.len() / n; n];
        self.reduce_scatter(data, &counts, op)
    }

    /// Inclusive prefix reduction: rank r's `buf` becomes `data_0 ⊕ ... ⊕ data_r`.
    pub fn scan<'a, T: Element>(
        &self,
        buf: &'a mut [T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<()>> + Send + use<'a, T> {
        let run = self.scan_with(to_bytes(buf), op, true);
        async move {
            let out = run.await?.ok_or_else(|| Error::Invalid("scan produced nothing".into()))?;
            copy_into(buf, &out)
        }
    }

    /// Exclusive prefix reduction: `data_0 ⊕ ... ⊕ data_(r-1)`, `None` at rank 0.
    pub fn exscan<T: Element>(
        &self,
        data: &[T],
        op: ReduceOp<T>,
    ) -> impl Future<Output = Result<Option<Vec<T>>>> + Send + use<T> {
        let run = self.scan_with(to_bytes(data), op, false);
        async move { run.await?.map(|b| to_vec(&b)).transpose() }
    }

    fn scan_with<T: Element>(
        &self,
        data: Bytes,
        op: ReduceOp<T>,
        inclusive: bool,
    ) -> impl Future<Output = Result<Option<Bytes>>> + Send + use<T> {
        let early = check_op(&op).err();
        let plan =
            early.is_none().then(|| (self.slot(), ops::scan(self.rank(), self.size(), data, op.erase(), inclusive)));
        async move {
            let (slot, m) = plan.ok_or_else(|| early.expect("set"))?;
            Ok(ops::scan_result(&Comm::drive(slot, m).await?))
        }
    }

    /// Splits the communicator: ranks passing the same `color` form a new communicator, ordered by
    /// `key` (then by rank here); `None` takes no part and gets `None`. Collective.
    pub async fn split(&self, color: Option<u32>, key: u32) -> Result<Option<Comm>> {
        let n = self.sequence.splits.fetch_add(1, Ordering::Relaxed);
        let mine = [color.map_or(u64::MAX, u64::from), u64::from(key)];
        let all = self.allgather_with(to_bytes(&mine), Algorithm::Bruck).await?;
        let Some(color) = color else { return Ok(None) };
        let mut members: Vec<(u64, Rank)> = Vec::new();
        for (r, b) in all.iter().enumerate() {
            let v: Vec<u64> = to_vec(b)?;
            if v.len() != 2 {
                return Err(Error::Invalid(format!("rank {r} sent a malformed split request")));
            }
            if v[0] == u64::from(color) {
                members.push((v[1], r as Rank));
            }
        }
        members.sort();
        let world: Vec<Rank> = members.iter().map(|&(_, r)| self.world_rank(r)).collect();
        let context = derive_context(derive_context(self.context(), (1 << 30) | n), color);
        Ok(Some(self.with_members(context, world)))
    }
}

impl Hierarchy {
    /// Whether the hierarchy saves network traffic: some host has several ranks.
    fn worth_it(&self) -> bool {
        let mut per_node = vec![0u32; self.leader_rank.len()];
        self.node_of.iter().for_each(|&n| per_node[n as usize] += 1);
        per_node.iter().any(|&c| c > 1)
    }

    /// The rank, in the leaders' communicator, of node `node`'s leader.
    fn leader_position(&self, node: u32) -> Rank {
        self.leader_rank.iter().take(node as usize).filter(|&&r| r != Rank::MAX).count() as Rank
    }
}

/// The rank of `r` (a rank of the parent communicator) within its node's communicator.
fn node_rank_of(h: &Hierarchy, r: Rank) -> Rank {
    let node = h.node_of[r as usize];
    h.node_of[..r as usize].iter().filter(|&&n| n == node).count() as Rank
}

/// Broadcast by single copy: each receiver copies the root's buffer straight into its own; the root
/// returns once every receiver has (the fan-in), so its buffer is not needed after that. Meanwhile
/// the root, which would only wait, writes half of the copies that receivers offer to split.
async fn bcast_single_copy(mut call: shared::Lending, root: Rank, me: Rank, buf: &mut [u8]) -> Result<()> {
    let got = call.next().await?;
    if me != root {
        let lent = Lent::decode(root, &got, buf.len())?;
        call.read_split(root, &lent, buf)?;
        return call.next().await.map(drop);
    }
    let helper = call.helper();
    let mut fanin = std::pin::pin!(call.next());
    std::future::poll_fn(|cx| {
        helper.help(buf);
        fanin.as_mut().poll(cx)
    })
    .await
    .map(drop)
}

/// Why an all-to-all of `data` into `out` over `n` ranks cannot be made, if it cannot.
fn alltoall_misfit<T>(data: &[T], out: &[T], n: u32) -> Option<Error> {
    if !data.len().is_multiple_of(n as usize) {
        Some(Error::Invalid(format!("{} elements do not split into {n} parts", data.len())))
    } else if out.len() != data.len() {
        Some(Error::Invalid(format!("all-to-all of {} elements into {}", data.len(), out.len())))
    } else {
        None
    }
}

/// What a gather-style single-copy call lends of the caller's input.
#[derive(Clone, Copy)]
enum Lend {
    /// A copy, which the call keeps: for futures that do not borrow the input.
    Copy,
    /// The input where it is: only for a future that borrows it until its end
    /// ([`lending_in_place`]); one copy of the data less.
    InPlace,
}

/// The future of a call that lent `data` in place ([`Lend::InPlace`]): it holds the borrow of
/// `data` for as long as the call may be read, so the caller cannot change it meanwhile; dropped
/// early, the call withdraws the memory before the borrow ends.
async fn lending_in_place<T: Element>(data: &[T], call: impl Future<Output = Result<()>> + Send) -> Result<()> {
    let _lent = data;
    call.await
}

/// A gather-style call by single copy (reduce, all-gather, all-to-all; see [`Comm::lend`]):
/// learns what every rank lent (`len` bytes each), makes this rank's `copies`, then waits until
/// nobody reads this rank's copy any more and gives it back to `pool`.
async fn gather_single_copy<R>(
    mut call: shared::Lending,
    n: Rank,
    len: usize,
    pool: &Pool,
    copies: impl FnOnce(&shared::Lending, &[Lent]) -> Result<R>,
) -> Result<R> {
    let lent = lent_by_all(&call.next().await?, n as usize, len)?;
    let r = copies(&call, &lent)?;
    call.next().await?;
    call.give_back().into_iter().for_each(|b| pool.give(b));
    Ok(r)
}

/// Bytes of a reduction's piece: a piece of each rank's part and the partial result stay in cache
/// (L2 is 1 MiB a core here), and each `process_vm_readv` moves a piece (a call has a fixed cost:
/// the kernel pins the remote pages). 256 KiB pieces beat 64 KiB ones by 10-15% on a 1 MiB
/// all-reduce (`ferrocomm-bench collectives --ranks 4,2 --ops allreduce --max 1M --no-mpi
/// --iters-large 40`). The scratch is reused across calls: a fresh allocation above the
/// allocator's mmap threshold would fault its pages in on every call.
const REDUCE_PIECE: usize = 256 << 10;

/// What every rank lent for a call of `len` bytes each (the first step's all-gather).
fn lent_by_all(all: &[u8], n: usize, len: usize) -> Result<Vec<Lent>> {
    if all.len() != n * Lent::BYTES {
        return Err(Error::Collective(CollError::Malformed { from: 0, why: "lent memory of every rank" }));
    }
    let each = all.chunks(Lent::BYTES).enumerate().map(|(r, b)| Lent::decode(r as Rank, b, len));
    Ok(each.collect::<std::result::Result<_, _>>()?)
}

/// Combines bytes `at..at + dst.len()` of every rank's lent memory in rank order into `dst`, in
/// place, piece by piece (a piece of each rank and the partial result stay in cache). This rank's
/// bytes come from `own`, or are in `dst` already (`None`); from them the result grows outwards:
/// the ranks before this one are applied on the left, nearest first, then the ranks after it on
/// the right, so `x0 ⊕ (x1 ⊕ ... ⊕ xme) ⊕ ... ⊕ xn-1` keeps rank order for any associative operator.
/// The pieces are read into a scratch buffer from `pool` (kept between calls: a fresh one faults
/// its pages in on every call).
#[allow(clippy::too_many_arguments)] // the call, what it reads, how it combines, where it goes
fn combine(
    call: &shared::Lending,
    lent: &[Lent],
    me: usize,
    op: &ferrocomm_collectives::Reducer,
    at: usize,
    own: Option<&[u8]>,
    dst: &mut [u8],
    pool: &Pool,
) -> Result<()> {
    let piece = (REDUCE_PIECE / op.element_size() * op.element_size()).max(1);
    let mut x = pool.take(piece.min(dst.len()));
    for start in (0..dst.len()).step_by(piece) {
        let p = start..(start + piece).min(dst.len());
        let (k, result) = (p.len(), &mut dst[p.clone()]);
        if let Some(own) = own {
            result.copy_from_slice(&own[p]);
        }
        let before = lent[..me].iter().enumerate().rev().map(|(r, l)| (r, l, true));
        let after = lent.iter().enumerate().skip(me + 1).map(|(r, l)| (r, l, false));
        for (r, theirs, on_the_left) in before.chain(after) {
            call.read(r as Rank, theirs, at + start, &mut x[..k])?;
            op.apply(result, &x[..k], on_the_left);
        }
    }
    pool.give(x);
    Ok(())
}

/// All-reduce by single copy, in place, as a reduce-scatter and an all-gather straight between the
/// ranks' buffers: rank `me` combines part `me` of every rank's buffer in rank order and leaves it
/// in its own; after a barrier, it copies every other part from the rank that computed it; after
/// another, nobody reads its buffer any more. Each part is computed once, so every rank gets the
/// same bits, and rank order keeps non-commutative operators right.
async fn allreduce_single_copy(
    mut call: shared::Lending,
    buf: &mut [u8],
    op: ferrocomm_collectives::Reducer,
    me: Rank,
    n: Rank,
    pool: &Pool,
) -> Result<()> {
    use ferrocomm_collectives::shared::part;
    let (elem, len, n, me) = (op.element_size(), buf.len(), n as usize, me as usize);
    let lent = lent_by_all(&call.next().await?, n, len)?;
    let mine = part(len, elem, n, me);
    combine(&call, &lent, me, &op, mine.start, None, &mut buf[mine], pool)?;
    call.next().await?;
    for r in (0..n).filter(|&r| r != me) {
        let theirs = part(len, elem, n, r);
        call.read(r as Rank, &lent[r], theirs.start, &mut buf[theirs])?;
    }
    call.next().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    /// The small collectives' future stays small: it is moved after a call complete when made has
    /// posted, and every word moved then may wait behind the post (see `shared::BoxedCall`).
    #[test]
    fn the_small_collectives_future_stays_small() {
        assert!(size_of::<super::Collective<'static>>() <= 48, "{}", size_of::<super::Collective<'static>>());
    }
}
