//! The driver of the shared-memory board (`ferrocomm_collectives::shared`): it maps one segment
//! per communicator and turns the board's calls into futures.
//!
//! The segment is a file in /dev/shm named after the job, the communicator's first member and its
//! context by `mapping::shared_file_name`, like the shared-memory transport's segments, so
//! `shm::remove_leftovers` covers it. Every member opens it with `O_CREAT` and gives it the same
//! length, so whoever comes first creates it and nobody has to initialise it (fresh pages are zero:
//! "nothing posted"); the last member to attach removes the name, so no file outlives a job whose
//! ranks all made a call there.
//!
//! A waiting call spins inside the reactor's loop ([`Reactor::poll_until`]): transports keep
//! progressing, spinning ranks yield when the host is oversubscribed, and a lost peer that the
//! call waits for fails it with [`Error::PeerLost`], as does any loss that revoked the
//! communicator (a call is not even made then: see [`HostBoard::gate`]); a departed peer fails it
//! only while the call waits for a word it never posted. Nothing rings a rank when a board counter
//! moves, so a rank that would sleep (adaptive and blocking modes) looks again every [`NAP`]; the
//! default table therefore picks the board only for busy-polling ranks.
//!
//! Single-copy calls ([`Lending`]) use the board for their synchronisation and copy the data
//! straight from the other ranks' memory with `process_vm_readv`. Unlike the board's other calls
//! they progress only while their future is polled: the copies go into the caller's buffer. Their
//! later steps are *held* on the board; the communicator's later calls pass them (up to the
//! board's [`SLOTS`](ferrocomm_collectives::shared::SLOTS)), so awaiting later calls while a
//! single-copy future sits unpolled works, up to that many.

use std::fs::OpenOptions;
use std::future::Future;
use std::ops::{Deref, Range};
use std::os::unix::fs::OpenOptionsExt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::BytesMut;
use ferrocomm_collectives::CollError;
use ferrocomm_collectives::shared::{Board, Data, Kind as BoardOp, Lent, Queue, Waiting, board_bytes};
use ferrocomm_reactor::{ProgressMode, Reactor, Wait};
use ferrocomm_transports::Rank;
use ferrocomm_transports::mapping::{Mapping, shared_file_path};
use smallvec::SmallVec;

use crate::api::world::Comm;
use crate::error::{Error, Result};
use crate::p2p::driver::Driver;

/// Tells a board's file from the shared-memory transport's (random nonces) in the job's names;
/// the low half is the communicator's context.
const BOARD_NONCE: u64 = 0xc011_0000_0000_0000;
/// How often a rank that does not spin looks at the board again.
const NAP: Duration = Duration::from_millis(1);
/// Looks at the board alone (no reactor lock, no transport) before the reactor's spin loop takes
/// over: the partner's post usually lands within these (a look costs tens of nanoseconds).
const BOARD_LOOKS: u32 = 64;

/// A shared mapping of a board's file, seen as words.
struct Words(Mapping);

impl Deref for Words {
    type Target = [AtomicU64];
    fn deref(&self) -> &[AtomicU64] {
        // SAFETY: page-aligned and alive as long as `self`; atomics tolerate the other processes'
        // concurrent access.
        unsafe { std::slice::from_raw_parts(self.0.ptr().cast::<AtomicU64>(), self.0.len() / 8) }
    }
}

/// A communicator's board and this rank's calls on it.
pub(crate) struct HostBoard {
    board: Board<Words>,
    /// Taken on every look at the board: the reactor's lock, released by a plain store.
    queue: ferrocomm_reactor::Mutex<Queue>,
    /// World rank of each member (lost peers are known by world rank).
    members: Vec<Rank>,
    reactor: Reactor<Driver>,
    /// The communicator's context: a loss that revokes it fails the calls.
    context: u32,
    /// The world's count of departures and losses ([`crate::api::world::Inner::changes`]).
    changes: Arc<std::sync::atomic::AtomicU32>,
}

impl HostBoard {
    /// Opens (or creates) the board of `comm`; `job` names the job's shared-memory files.
    pub(crate) fn open(comm: &Comm, job: &str) -> Result<HostBoard> {
        let n = comm.size() as usize;
        let members: Vec<Rank> = (0..comm.size()).map(|r| comm.world_rank(r)).collect();
        let path = shared_file_path(job, members[0], BOARD_NONCE | u64::from(comm.context()));
        let fail = |e: &dyn std::fmt::Display| {
            Error::Collective(CollError::Invalid(format!("shared board {}: {e}", path.display())))
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(&path)
            .map_err(|e| fail(&e))?;
        let bytes = board_bytes(n);
        // Every member sets the same length; growing a file adds zeroed pages.
        if file.metadata().map_err(|e| fail(&e))?.len() < bytes as u64 {
            file.set_len(bytes as u64).map_err(|e| fail(&e))?;
        }
        let map = Words(Mapping::new(&file, bytes).map_err(|e| fail(&e))?);
        let (board, attached) = Board::attach(map, n, comm.rank() as usize).map_err(|e| fail(&e))?;
        if attached == n {
            // Everyone has it mapped: the name is no longer needed.
            let _ = std::fs::remove_file(&path);
        }
        let inner = comm.inner();
        Ok(HostBoard {
            board,
            queue: ferrocomm_reactor::Mutex::new(Queue::default()),
            members,
            reactor: inner.reactor.clone(),
            context: comm.context(),
            changes: inner.changes.clone(),
        })
    }

    /// Whether no rank has departed or been lost (then [`HostBoard::gate`] has nothing to say).
    #[inline(always)]
    fn untouched(&self) -> bool {
        self.changes.load(std::sync::atomic::Ordering::Acquire) == 0
    }

    /// Why a call cannot be made: a loss revoked the communicator.
    fn gate(&self) -> Result<()> {
        if self.untouched() {
            return Ok(());
        }
        self.reactor.with(|d| d.engine.gate(self.context)).map_or(Ok(()), Err)
    }

    /// The call of a broadcast's root whose data (`input`) it can post at once and be done
    /// ([`Queue::root_now`]), or of a gather's or reduce's other rank with its part; `false` if it
    /// cannot, and then [`HostBoard::call`] makes it. Inlined
    /// into its caller, so that little is stored and read back between the post and the return.
    /// Here rather than at the top of `HostBoard::call`, which every board call takes: there it
    /// costs the barrier more than it gains (`collectives-job --ranks 2 -o bcast,allreduce,barrier
    /// -s 8 -i 100000`).
    #[inline]
    pub(crate) fn root_now(&self, input: &[u8]) -> bool {
        // After a departure or loss, the call goes through `call`, which may refuse it.
        self.untouched() && self.queue.lock().root_now(&self.board, input)
    }

    /// [`HostBoard::root_now`] for a scatter's root ([`Queue::scatter_root_now`]).
    #[inline]
    pub(crate) fn scatter_root_now(&self, input: &[u8]) -> bool {
        self.untouched() && self.queue.lock().scatter_root_now(&self.board, input)
    }

    /// Enqueues a call (described in full: it may run before its future is first polled), split
    /// into pieces of at most the board's capacity, cut on `elem`-byte element boundaries.
    /// `input`: the root's data (broadcast), this rank's contribution (all-reduce), or nothing.
    pub(crate) fn call(self: &Arc<HostBoard>, kind: BoardOp, len: usize, input: &[u8], elem: usize) -> Result<Made> {
        self.gate()?;
        let mut q = self.queue.lock();
        if len <= self.board.capacity() {
            // Posted now, and often complete now: then just the result.
            return Ok(match q.call_now(&self.board, kind, len, input)? {
                (_, Some(result)) => Made::Done(result?),
                (seq, None) => Made::Waiting(self.wait(seq..seq + 1, None)),
            });
        }
        // (Divisions cost tens of cycles: kept off the small calls' path.)
        let piece = (self.board.capacity() / elem.max(1) * elem.max(1)).max(1);
        let pieces = len.div_ceil(piece);
        let mut seqs: Option<Range<u64>> = None;
        for k in 0..pieces {
            let range = k * piece..((k + 1) * piece).min(len);
            let data = input.get(range.clone()).map_or_else(Vec::new, <[u8]>::to_vec);
            match q.push(&self.board, kind.clone(), range.len(), data) {
                Ok(seq) => seqs.get_or_insert(seq..seq).end = seq + 1,
                Err(e) => {
                    if let Some(queued) = seqs {
                        q.abandon(queued);
                    }
                    return Err(e.into());
                }
            }
        }
        let seqs = seqs.expect("at least one piece");
        Ok(Made::Waiting(self.wait(seqs, None)))
    }

    /// The future of calls `seqs`; `single`: the single-copy call they are steps of, if any.
    fn wait(self: &Arc<HostBoard>, seqs: Range<u64>, single: Option<SingleCopy>) -> BoardCall {
        BoardCall { seg: Some(self.clone()), seqs, parts: Pieces::new(), wait: Wait::default(), nap: None, single }
    }

    /// This rank leaves calls `seqs` before their end (a future dropped or failed): it first
    /// withdraws the memory it lent for the single-copy call `single`, then abandons the calls,
    /// which releases held ones (so nothing of them posts before the withdrawal), and posts what
    /// it can of them now ([`Queue::leave`]): its next calls may not be on the board, and the
    /// other ranks wait for these posts (a single-copy call's, to find the memory withdrawn).
    fn leave(&self, seqs: Range<u64>, single: Option<SingleCopy>) {
        if seqs.is_empty() {
            return;
        }
        if let Some(SingleCopy { first, lends: true }) = single {
            self.board.withdraw(first);
        }
        self.queue.lock().leave(&self.board, seqs);
    }

    /// Starts a single-copy call: its first step exchanges what is lent (`kind`: a broadcast of the
    /// root's [`Lent`], or an all-gather of every rank's), then come the `held` steps, each posted
    /// when the rank gets to it ([`Lending::next`]).
    pub(crate) fn lend(self: &Arc<HostBoard>, kind: BoardOp, lent: Option<Lent>, held: &[BoardOp]) -> Result<Lending> {
        self.lend_each(kind, 1, lent.as_slice(), held)
    }

    /// [`HostBoard::lend`] where every lending rank lends `count` pieces of memory (`lent`: this
    /// rank's, none if it lends nothing), described one after the other.
    pub(crate) fn lend_each(
        self: &Arc<HostBoard>,
        kind: BoardOp,
        count: usize,
        lent: &[Lent],
        held: &[BoardOp],
    ) -> Result<Lending> {
        self.gate()?;
        let mut q = self.queue.lock();
        let input = lent.iter().flat_map(Lent::encode).collect();
        let first = q.push(&self.board, kind, count * Lent::BYTES, input)?;
        for k in held {
            q.push_held(k.clone());
        }
        let steps = first..first + 1 + held.len() as u64;
        Ok(Lending { seg: self.clone(), first, steps, lends: !lent.is_empty(), kept: None })
    }

    /// Advances every call; collects the finished pieces of `seqs` in order into `parts`; ready
    /// when all are in, or on the loss of a peer the next piece waits for, or (steps of the
    /// single-copy call `single`) when that peer withdrew from the call.
    fn check(
        &self,
        seqs: &mut Range<u64>,
        parts: &mut Pieces,
        single: Option<SingleCopy>,
        driver: Option<&Driver>,
    ) -> Poll<Result<()>> {
        let mut q = self.queue.lock();
        // The last piece alone in the queue: finished at once, or still waiting (then nothing
        // else in the queue can move either).
        let lone = if seqs.end - seqs.start == 1 { q.finish_now(&self.board, seqs.start) } else { None };
        match lone {
            Some(Some(r)) => {
                seqs.start += 1;
                return Poll::Ready(r.map(|part| parts.push(part)).map_err(Into::into));
            }
            Some(None) => {}
            None => {
                q.advance(&self.board);
                while let Some(r) = q.take(seqs.start) {
                    seqs.start += 1;
                    match r {
                        Ok(part) => parts.push(part),
                        Err(e) => return Poll::Ready(Err(e.into())),
                    }
                    if seqs.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                }
            }
        }
        // Only where a driver is at hand: a look without one would ask for nothing.
        if let Some(d) = driver {
            // A peer that left the single-copy call may not post its part until it uses the
            // board again, which it may never do.
            if let Some(single) = single
                && let Some(rank) = q.awaits_withdrawn(&self.board, seqs.start, single.first)
            {
                return Poll::Ready(Err(Error::Collective(CollError::Withdrawn { rank })));
            }
            // Revoked by a loss, whether or not the call waits for the lost rank itself.
            if d.engine.failures().any_lost()
                && let Some(e) = d.engine.revoked(self.context)
            {
                return Poll::Ready(Err(e));
            }
            if let Some(Waiting::Rank(r)) = q.waiting(&self.board, seqs.start) {
                let rank = self.members[r as usize];
                if let Some(reason) = d.engine.lost(rank) {
                    return Poll::Ready(Err(Error::PeerLost { rank, reason: reason.clone() }));
                }
            }
        }
        Poll::Pending
    }
}

/// A call on the board as made: complete at once (a broadcast's root, the last rank to arrive),
/// with its one result and nothing built around it, or waiting. Why not a finished
/// [`BoardCall`]: a call complete when made has just posted to a line that another rank is
/// usually reading, and until that line comes back the stores that follow wait in the CPU's
/// store buffer; a full buffer stops the caller (see `Queue::root_now` in
/// `ferrocomm_collectives::shared`), so the fewer bytes are moved after the post, the better
/// (the barrier about 10% faster than with a finished future: `collectives-job --ranks 2 -o
/// barrier,bcast,allreduce -s 8 -i 50000`).
pub(crate) enum Made {
    Done(Data),
    Waiting(BoardCall),
}

impl Made {
    /// The call as a future of its pieces, complete or not.
    pub(crate) fn into_future(self) -> BoardCall {
        match self {
            Made::Done(result) => BoardCall::done(result),
            Made::Waiting(call) => call,
        }
    }
}

/// The future of one call on the board: its pieces' results, in order. Dropping it abandons
/// what is left of the call: this rank still does its part whenever a later call of the
/// communicator is driven, and the results are discarded.
pub(crate) struct BoardCall {
    /// `None` once complete when made.
    seg: Option<Arc<HostBoard>>,
    /// The pieces not collected yet.
    seqs: Range<u64>,
    parts: Pieces,
    wait: Wait,
    nap: Option<Pin<Box<tokio::time::Sleep>>>,
    /// See [`HostBoard::wait`].
    single: Option<SingleCopy>,
}

/// The single-copy call that a [`BoardCall`]'s calls are steps of.
#[derive(Clone, Copy, Debug)]
struct SingleCopy {
    /// Its first step, which names it for withdrawal.
    first: u64,
    /// Whether this rank lent memory in it (withdrawn if the call is left early).
    lends: bool,
}

/// A [`BoardCall`] in a box, so that the future of every small collective stays small; the box
/// is reused from one call to the next on a thread (one spare), not allocated per call. Why: a
/// broadcast, all-reduce or barrier on the board returns one future type, moved (copied word by
/// word) after the call is made, and a call complete when made has just posted to a line another
/// rank is reading: until that line comes back, the stores that follow wait in the CPU's store
/// queue, and once it is full the caller stops. With the call's 120 bytes inline the future
/// takes 136 bytes; boxed, 48 (barrier and all-reduce about 5% faster in the host's slow phase:
/// `collectives-job --ranks 2 -o barrier,bcast,allreduce -s 8 -i 100000`). A box allocated per
/// call would make the waiting ranks slower by more than the roots gain.
pub(crate) struct BoxedCall(Option<Box<Option<BoardCall>>>);

thread_local! {
    /// A finished call's box (empty), kept for the next waiting call on this thread.
    static SPARE: std::cell::Cell<Option<Box<Option<BoardCall>>>> = const { std::cell::Cell::new(None) };
}

impl BoxedCall {
    /// `call` in this thread's spare box, or in a new one.
    pub(crate) fn new(call: BoardCall) -> BoxedCall {
        let spare = SPARE.try_with(std::cell::Cell::take).ok().flatten();
        BoxedCall(Some(match spare {
            Some(mut b) => {
                *b = Some(call);
                b
            }
            None => Box::new(Some(call)),
        }))
    }

    pub(crate) fn get(&mut self) -> &mut BoardCall {
        self.0.as_deref_mut().and_then(Option::as_mut).expect("present until dropped")
    }
}

impl Drop for BoxedCall {
    fn drop(&mut self) {
        if let Some(mut b) = self.0.take() {
            // Ends the call (see `BoardCall`'s drop) and keeps the box.
            *b = None;
            let _ = SPARE.try_with(|s| s.set(Some(b)));
        }
    }
}

/// The results of a call's pieces, in order: usually one (inline, no allocation).
pub(crate) type Pieces = SmallVec<[Data; 1]>;

impl Future for BoardCall {
    type Output = Result<Pieces>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Pieces>> {
        let this = &mut *self;
        let Some(seg) = this.seg.as_deref().filter(|_| !this.seqs.is_empty()) else {
            // Complete when made (`Queue::call_now`).
            return Poll::Ready(Ok(std::mem::take(&mut this.parts)));
        };
        // Busy ranks look at the board alone first: the latency-critical wait. Where ranks share
        // CPUs they yield between looks (the rank this one waits for may need this CPU) on every
        // poll; elsewhere they spin on the first poll only.
        let busy = seg.reactor.mode() == ProgressMode::BusyPoll;
        let crowded = busy && seg.reactor.is_oversubscribed();
        let looks = if crowded || (busy && this.wait.is_fresh()) { BOARD_LOOKS } else { 1 };
        let mut r = Poll::Pending;
        for _ in 0..looks {
            r = seg.check(&mut this.seqs, &mut this.parts, None, None);
            if r.is_ready() {
                break;
            }
            if crowded {
                std::thread::yield_now();
            } else {
                // A look is little more than a load of the awaited line: the classic spin.
                std::hint::spin_loop();
            }
        }
        if r.is_pending() {
            let (seqs, parts, single) = (&mut this.seqs, &mut this.parts, this.single);
            r = seg.reactor.poll_until(cx, &mut this.wait, |d, _| seg.check(seqs, parts, single, Some(d)));
        }
        if let Poll::Ready(r) = r {
            // Failed: what is left is abandoned (on drop).
            return Poll::Ready(r.map(|()| std::mem::take(&mut this.parts)));
        }
        if !busy {
            let nap = this.nap.get_or_insert_with(|| Box::pin(tokio::time::sleep(NAP)));
            if nap.as_mut().poll(cx).is_ready() {
                this.nap = None;
                cx.waker().wake_by_ref();
            }
        }
        Poll::Pending
    }
}

impl Drop for BoardCall {
    fn drop(&mut self) {
        if let Some(seg) = &self.seg {
            seg.leave(self.seqs.clone(), self.single);
        }
    }
}

impl BoardCall {
    /// A call complete when made, with its one result.
    fn done(result: Data) -> BoardCall {
        let parts = Pieces::from_buf([result]);
        BoardCall { seg: None, seqs: 0..0, parts, wait: Wait::default(), nap: None, single: None }
    }
}

/// A single-copy call in progress: its steps on the board, taken in order. Dropped before its last
/// step, it withdraws the memory this rank lent (the readers discard what they copied from it) and
/// abandons the rest, so the communicator's later calls go on.
pub(crate) struct Lending {
    seg: Arc<HostBoard>,
    /// The call's first step, which names it for withdrawal.
    first: u64,
    /// The steps not taken yet.
    steps: Range<u64>,
    /// Whether this rank lent memory that others read.
    lends: bool,
    /// The lent memory, where the call owns it (a copy of a caller's slice that the call does not
    /// borrow): freed only after the withdrawal, or given back once the call is over.
    kept: Option<BytesMut>,
}

impl Lending {
    /// Posts the next step (this rank is done with what the previous ones allowed) and waits for
    /// it; its result (for the first step: what was lent).
    pub(crate) async fn next(&mut self) -> Result<Data> {
        let seq = self.steps.start;
        self.seg.queue.lock().release(seq);
        let mut parts = self.seg.wait(seq..seq + 1, Some(self.single())).await?;
        self.steps.start += 1;
        Ok(parts.pop().unwrap_or_default())
    }

    /// [`Lending::next`] for an owner that would only wait: meanwhile it writes the halves that
    /// readers of its lent memory offer to split ([`Helper::help`]): `in_place`, the caller's
    /// data lent where it is, or else the kept copy. `readers`: how many readers may offer (it
    /// looks closely until that many offers are written).
    pub(crate) async fn next_helping(&mut self, in_place: Option<&[u8]>, readers: usize) -> Result<Data> {
        let helper = self.helper();
        let mut helped = 0;
        self.next_while(|this| {
            helped += helper.help(in_place.unwrap_or(this.kept()));
            helped >= readers
        })
        .await
    }

    /// Ranks of the communicator.
    pub(crate) fn ranks(&self) -> usize {
        self.seg.board.ranks()
    }

    /// The kept memory ([`Lending::keep`]), empty if none.
    pub(crate) fn kept(&self) -> &[u8] {
        self.kept.as_deref().unwrap_or_default()
    }

    /// The call, for its steps' waits and for withdrawing on leaving early.
    fn single(&self) -> SingleCopy {
        SingleCopy { first: self.first, lends: self.lends }
    }

    /// Keeps `buf` (the lent memory) as long as the call needs it; see [`Lending::give_back`].
    pub(crate) fn keep(&mut self, buf: BytesMut) {
        self.kept = Some(buf);
    }

    /// The kept memory, taken out while this rank writes it: only before the step after which
    /// the others read it, and put back ([`Lending::keep`]) before that step.
    pub(crate) fn take_kept(&mut self) -> Option<BytesMut> {
        self.kept.take()
    }

    /// The kept memory, once the call's last step is over (nobody reads it any more).
    pub(crate) fn give_back(&mut self) -> Option<BytesMut> {
        self.steps.is_empty().then(|| self.kept.take()).flatten()
    }

    /// Copies `dst.len()` bytes from `offset` in what rank `owner` lent into `dst`.
    pub(crate) fn read(&self, owner: u32, lent: &Lent, offset: usize, dst: &mut [u8]) -> Result<()> {
        let board = &self.seg.board;
        let withdrawn = || Error::Collective(CollError::Withdrawn { rank: owner });
        if (offset + dst.len()) as u64 > lent.len {
            return Err(Error::Collective(CollError::Malformed { from: owner, why: "read beyond the lent memory" }));
        }
        if board.withdrawn(owner as usize, self.first) {
            return Err(withdrawn());
        }
        if let Err(e) = copy_from(lent.pid, lent.addr + offset as u64, dst) {
            if board.withdrawn(owner as usize, self.first) {
                return Err(withdrawn());
            }
            if e.raw_os_error() == Some(libc::ESRCH) {
                // The process is gone: the peer died during the call.
                let rank = self.seg.members[owner as usize];
                return Err(Error::PeerLost { rank, reason: ferrocomm_transports::TransportError::Closed });
            }
            let reason = e.to_string();
            return Err(Error::Collective(CollError::SingleCopy { rank: owner, reason }));
        }
        // Seqlock-style: valid only if the owner still lent it when the copy was over.
        if board.withdrawn(owner as usize, self.first) {
            return Err(withdrawn());
        }
        Ok(())
    }

    /// Copies all of what `owner` lent into `dst` (the same length), half of it by the owner if it
    /// claims the offer in time ([`Helper::help`]).
    pub(crate) fn read_split(&self, owner: u32, lent: &Lent, dst: &mut [u8]) -> Result<()> {
        use ferrocomm_collectives::shared::Offer;
        if dst.len() < SPLIT_MIN {
            return self.read(owner, lent, 0, dst);
        }
        let board = &self.seg.board;
        let half = dst.len() / 2;
        let (first, second) = dst.split_at_mut(half);
        board.offer(self.first, second.as_mut_ptr() as u64, std::process::id());
        let read = self.read(owner, lent, 0, first);
        // Take the second half back, unless the owner is writing it: then wait until it is done,
        // since `dst` must not be let go of meanwhile (or until the owner is gone).
        let mut now = board.take_back(self.first);
        let mut spins = 0u32;
        while now == Some(Offer::Claimed) {
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) && !process_alive(lent.pid) {
                let rank = self.seg.members[owner as usize];
                return Err(Error::PeerLost { rank, reason: ferrocomm_transports::TransportError::Closed });
            }
            now = board.offered(self.first);
        }
        read?;
        match now {
            Some(Offer::Written) => Ok(()),
            Some(Offer::TakenBack | Offer::Failed) => self.read(owner, lent, half, second),
            _ => Err(Error::Collective(CollError::Malformed { from: owner, why: "split copy state" })),
        }
    }

    /// Copies every other rank's part into `dst` (`len` bytes a rank, part `k` at `k * len`;
    /// `data[k]`: what rank `k` lent) and this rank's from `own`, letting the owners push their
    /// parts while this rank copies (see `ferrocomm_collectives::shared::Board::open_push`): it
    /// opens a push to every owner, copies its own part (meanwhile the owners that wait claim
    /// theirs), then copies each part whose push nobody claimed, and waits until every claimed
    /// one is written (or its writer is gone). With several owners, more CPUs copy than the
    /// reader's alone. Synchronous from the first push opened to the last one settled, so `dst`
    /// is never let go of while an owner may write into it.
    pub(crate) fn read_pushed(&self, data: &[Lent], dst: &mut [u8], len: usize, own: &[u8]) -> Result<()> {
        use ferrocomm_collectives::shared::Offer;
        let (board, me) = (&self.seg.board, self.seg.board.me());
        let opened: SmallVec<[bool; 16]> = (0..data.len()).map(|k| k != me && board.open_push(k, self.first)).collect();
        let parts = dst.chunks_exact_mut(len.max(1));
        let mut first_error = None;
        let mut claimed: SmallVec<[usize; 16]> = SmallVec::new();
        for (k, part) in parts.enumerate().take(data.len()) {
            if k == me {
                part.copy_from_slice(own);
                continue;
            }
            let now = if opened[k] { board.take_back_push(k, self.first) } else { Some(Offer::TakenBack) };
            match now {
                Some(Offer::TakenBack) if first_error.is_none() => {
                    if let Err(e) = self.read(k as Rank, &data[k], 0, part) {
                        first_error = Some(e);
                    }
                }
                Some(Offer::TakenBack) => {}
                Some(_) => claimed.push(k),
                None => first_error = first_error.or(Some(malformed(k))),
            }
        }
        for k in claimed {
            let mut now = board.push_state(k, self.first);
            let mut spins = 0u32;
            while now == Some(Offer::Claimed) {
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(64) {
                    // The writer may share this CPU.
                    std::thread::yield_now();
                }
                if spins.is_multiple_of(4096) && !process_alive(data[k].pid) {
                    now = None;
                    let rank = self.seg.members[k];
                    first_error = first_error
                        .or(Some(Error::PeerLost { rank, reason: ferrocomm_transports::TransportError::Closed }));
                    break;
                }
                now = board.push_state(k, self.first);
            }
            match now {
                Some(Offer::Written) => {}
                Some(Offer::Failed) if first_error.is_none() => {
                    if let Err(e) = self.read(k as Rank, &data[k], 0, &mut dst[k * len..(k + 1) * len]) {
                        first_error = Some(e);
                    }
                }
                _ => first_error = first_error.or(Some(malformed(k))),
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// [`Lending::next`] for an owner whose reader may open a push to it
    /// ([`Lending::read_pushed`]): when the reader opens it, this rank writes `src` at `at` in the
    /// reader's memory `dst`. `in_place`: the caller's data lent where it is, or else the kept
    /// copy.
    pub(crate) async fn next_pushing(&mut self, dst: &Lent, at: usize, in_place: Option<&[u8]>) -> Result<Data> {
        self.next_while(|this| this.push(dst, at, in_place.unwrap_or(this.kept()))).await
    }

    /// [`Lending::next`] that meanwhile does `work` (which says whether it is done): until it is,
    /// the rank looks at the step and does the work in turn, closely (an offer or push opened now
    /// is taken within a look, not after a poll's spin of the wait), for at most [`HELP_LOOKS`]
    /// looks; then it waits for the step as [`Lending::next`] does, working once a poll.
    async fn next_while(&mut self, mut work: impl FnMut(&Lending) -> bool) -> Result<Data> {
        let seq = self.steps.start;
        self.seg.queue.lock().release(seq);
        let (mut seqs, mut parts) = (seq..seq + 1, Pieces::new());
        let crowded = self.seg.reactor.mode() == ProgressMode::BusyPoll && self.seg.reactor.is_oversubscribed();
        let mut done = false;
        for _ in 0..HELP_LOOKS {
            done = work(self);
            if let Poll::Ready(r) = self.seg.check(&mut seqs, &mut parts, None, None) {
                r?;
                self.steps.start += 1;
                return Ok(parts.pop().unwrap_or_default());
            }
            if done {
                break;
            }
            if crowded {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let mut wait = std::pin::pin!(self.seg.wait(seqs, Some(self.single())));
        let this = &*self;
        let mut parts = std::future::poll_fn(|cx| {
            if !done {
                done = work(this);
            }
            wait.as_mut().poll(cx)
        })
        .await?;
        self.steps.start += 1;
        Ok(parts.pop().unwrap_or_default())
    }

    /// [`Lending::next`] for an owner whose reader may open a push to it: when the reader opens
    /// it, this rank claims it, runs `push` (which writes into the reader's memory, with
    /// [`Lending::write`], and says whether all of it went) and marks it written or failed.
    pub(crate) async fn next_serving_push(&mut self, mut push: impl FnMut(&Lending) -> bool) -> Result<Data> {
        self.next_while(|this| match this.seg.board.claim_push(this.first) {
            Some(true) => {
                let ok = push(this);
                this.seg.board.pushed(this.first, ok);
                true
            }
            Some(false) => true,
            None => false,
        })
        .await
    }

    /// Writes `src` at `offset` in what the reader lent (`dst`), within a push it opened to this
    /// rank and this rank claimed.
    pub(crate) fn write(&self, dst: &Lent, offset: usize, src: &[u8]) -> Result<()> {
        if (offset + src.len()) as u64 > dst.len {
            return Err(Error::Collective(CollError::Malformed { from: 0, why: "write beyond the lent memory" }));
        }
        copy_to(dst.pid, dst.addr + offset as u64, src)
            .map_err(|e| Error::Collective(CollError::SingleCopy { rank: 0, reason: e.to_string() }))
    }

    /// Opens a push to rank `owner` (see [`Lending::settle_push`]); `false`: it has moved on.
    pub(crate) fn open_push(&self, owner: u32) -> bool {
        self.seg.board.open_push(owner as usize, self.first)
    }

    /// Takes the push opened to rank `owner` (process `pid`) back or sees it through: `true` if
    /// the owner wrote it, `false` if this rank must do that work itself. Called in the same
    /// synchronous stretch as [`Lending::open_push`], whatever else failed meanwhile.
    pub(crate) fn settle_push(&self, owner: u32, pid: u32) -> Result<bool> {
        use ferrocomm_collectives::shared::Offer;
        let board = &self.seg.board;
        let mut now = board.take_back_push(owner as usize, self.first);
        let mut spins = 0u32;
        while now == Some(Offer::Claimed) {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            }
            if spins.is_multiple_of(4096) && !process_alive(pid) {
                let rank = self.seg.members[owner as usize];
                return Err(Error::PeerLost { rank, reason: ferrocomm_transports::TransportError::Closed });
            }
            now = board.push_state(owner as usize, self.first);
        }
        match now {
            Some(Offer::Written) => Ok(true),
            Some(Offer::TakenBack | Offer::Failed) => Ok(false),
            _ => Err(malformed(owner as usize)),
        }
    }

    /// Writes `src` at `at` in the reader's memory `dst` if the reader opened a push to this rank
    /// and it is claimed here; whether the push is settled (written, failed or taken back).
    fn push(&self, dst: &Lent, at: usize, src: &[u8]) -> bool {
        let board = &self.seg.board;
        match board.claim_push(self.first) {
            Some(true) => {
                let fits = (at + src.len()) as u64 <= dst.len;
                board.pushed(self.first, fits && copy_to(dst.pid, dst.addr + at as u64, src).is_ok());
                true
            }
            Some(false) => true,
            None => false,
        }
    }

    /// Publishes that this rank has done the first `pieces` pieces of its part of a chained call
    /// ([`Lending::wait_progress`]).
    pub(crate) fn progress(&self, pieces: u64) {
        self.seg.board.progress(self.first, pieces);
    }

    /// Waits until rank `owner` (whose lent memory is `lent`) has published `pieces` pieces of
    /// this chained call: spins for a while on each poll (yielding where ranks share CPUs), and
    /// fails if the owner withdrew from the call or its process is gone.
    pub(crate) async fn wait_progress(&self, owner: u32, lent: &Lent, pieces: u64) -> Result<()> {
        let board = &self.seg.board;
        let crowded = self.seg.reactor.mode() == ProgressMode::BusyPoll && self.seg.reactor.is_oversubscribed();
        std::future::poll_fn(|cx| {
            for _ in 0..HELP_LOOKS {
                if board.progressed(owner as usize, self.first) >= pieces {
                    return Poll::Ready(Ok(()));
                }
                if board.withdrawn(owner as usize, self.first) {
                    return Poll::Ready(Err(Error::Collective(CollError::Withdrawn { rank: owner })));
                }
                if crowded {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            if !process_alive(lent.pid) {
                let rank = self.seg.members[owner as usize];
                return Poll::Ready(Err(Error::PeerLost {
                    rank,
                    reason: ferrocomm_transports::TransportError::Closed,
                }));
            }
            cx.waker().wake_by_ref();
            Poll::Pending
        })
        .await
    }

    /// The kept memory, written in place while lent: only where the readers read nothing of it
    /// before this rank publishes it done ([`Lending::progress`]).
    pub(crate) fn kept_mut(&mut self) -> &mut [u8] {
        self.kept.as_deref_mut().unwrap_or_default()
    }

    /// A handle for writing what readers offer to split while the call waits ([`Helper::help`]).
    pub(crate) fn helper(&self) -> Helper {
        Helper { seg: self.seg.clone(), first: self.first }
    }
}

/// A single copy at least this large is split with the memory's owner (see
/// `ferrocomm_collectives::shared::Offer`): below, the second system call and the wait for the
/// owner to notice cost more than half the copy.
const SPLIT_MIN: usize = 64 << 10;

/// How many times an owner that helps looks for work and at the step in turn before it waits as
/// usual ([`Lending::next_while`]): long enough for a reader that copies its own part first (tens
/// of microseconds), short enough to go back to the executor soon.
const HELP_LOOKS: u32 = 1024;

/// A push's state that breaks the protocol (a corrupt board).
fn malformed(k: usize) -> Error {
    Error::Collective(CollError::Malformed { from: k as u32, why: "push state" })
}

/// The owner's side of a single-copy call, apart from its [`Lending`] (which its waits borrow).
pub(crate) struct Helper {
    seg: Arc<HostBoard>,
    first: u64,
}

impl Helper {
    /// Writes the second half of the copies that readers of this rank's lent memory `src` offered
    /// to split ([`Lending::read_split`]); returns how many. For an owner that would only wait.
    pub(crate) fn help(&self, src: &[u8]) -> usize {
        let board = &self.seg.board;
        let mut n = 0;
        for r in (0..board.ranks()).filter(|&r| r != board.me()) {
            if let Some((dst, pid)) = board.claim(r, self.first) {
                let half = src.len() / 2;
                board.written(r, self.first, copy_to(pid, dst, &src[half..]).is_ok());
                n += 1;
            }
        }
        n
    }
}

/// Whether process `pid` still exists.
fn process_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists (and may be signalled).
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

impl Drop for Lending {
    fn drop(&mut self) {
        self.seg.leave(self.steps.clone(), Some(self.single()));
    }
}

#[cfg(target_os = "linux")]
fn copy_from(pid: u32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    ferrocomm_transports::shm::copy_from_process(pid as i32, addr, dst)
}

#[cfg(not(target_os = "linux"))]
fn copy_from(_: u32, _: u64, _: &mut [u8]) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}

#[cfg(target_os = "linux")]
fn copy_to(pid: u32, addr: u64, src: &[u8]) -> std::io::Result<()> {
    ferrocomm_transports::shm::copy_to_process(pid as i32, addr, src)
}

#[cfg(not(target_os = "linux"))]
fn copy_to(_: u32, _: u64, _: &[u8]) -> std::io::Result<()> {
    Err(std::io::ErrorKind::Unsupported.into())
}
