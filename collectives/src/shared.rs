//! Small collectives through one shared segment per communicator, when all its ranks share a host.
//!
//! Why: a message-based collective pays, per step, a frame through a ring, the point-to-point
//! engine's matching and an operation's completion on each side; that is most of a small
//! collective's cost (about 2 us for an 8 B broadcast on 2 ranks, where the transport alone moves
//! 8 B in 0.1-0.3 us). Here a rank publishes its part in its own cache line of a shared *board* and
//! the others read it there: a barrier, an 8 B broadcast or an 8 B all-reduce costs a few
//! cache-line transfers, as in the shared-memory collectives of MPI libraries (Open MPI's coll/sm,
//! UCC's shared-memory team). Served: barrier, broadcast, reduce, all-reduce, gather, scatter, all-gather,
//! all-to-all, reduce-scatter and scans ([`Kind`]).
//!
//! The board has [`SLOTS`] slots used in turn by the communicator's calls (call `s` uses slot
//! `s % SLOTS`). In each slot every rank owns a cache line (a counter, a length and up to 48 bytes
//! of data; the lines of all slots sit together). Larger data goes to [`AREAS`] data areas of
//! [`capacity`] bytes per rank, also used in turn (call `s` uses area `s % AREAS`; a call larger
//! still is split into several). Fewer areas than slots: the areas are what costs memory, and
//! only small calls need many in flight. Each rank also owns one more line:
//! * `posted = s + 1` in its slot line: the rank's part of call `s` is in place (release; readers
//!   acquire);
//! * `finished = s + 1` in its own line: the rank is done with calls `0..=s` and reads none of
//!   their slots again.
//!
//! Rules, each rank for itself, which make a slot's reuse safe without locks:
//! 1. a rank posts its calls in call order and finishes them in call order, so `posted >= s + 1`
//!    in slot `s % SLOTS` means "posted call `s`", and `finished` is one number. One exception:
//!    a call may post before earlier calls of its rank that are *held* (their caller has not
//!    given its part yet, see below), as long as it is less than [`SLOTS`] calls after the first
//!    unposted one: the slots differ, so the meaning of `posted` stands. Its result can then be
//!    collected once read, before it finishes in call order (which it does later, as an
//!    abandoned call does);
//! 2. a rank writes data into a slot only once every rank's `finished` has passed the slot's
//!    previous call, and into an area only once it has passed the area's previous call. It
//!    remembers the `finished` values it has seen, so it reads another rank's line only every
//!    few calls, not on every call (for small calls, about once in `SLOTS` calls).
//!
//! A broadcast's receivers post nothing (nobody reads their part of it): an 8 B broadcast costs
//! the root one line written and each receiver one line read. A scatter's root leaves its own
//! block out (nobody reads it), a rank of an all-to-all reads only its own block of each
//! rank's data, and on 2 ranks a reduce-scatter's rank posts only the other rank's segment.
//!
//! Calls are described in full when they are made ([`Call`]: the root's data, the rank's
//! contribution) and kept in a [`Queue`] that any poll advances, so a call whose future is held
//! but not polled, or dropped, still does its part as long as the rank drives any later call of
//! the communicator: nothing waits on a future nobody polls. A call with nothing queued before it
//! goes further at once ([`Queue::call_now`], and for a broadcast's root [`Queue::root_now`]): it
//! posts when made, and completes when made if what it needs is already posted (a broadcast's
//! root; the last rank to arrive), with no queue entry and no copy of its input. Nothing here
//! blocks or does I/O: the root crate maps the segment and drives [`Queue::advance`].
//!
//! Reductions combine the ranks' contributions in rank order on every rank, so non-commutative
//! operators work and every rank gets bit-identical floating-point results.
//!
//! **Single copy** (large calls): copying through the board is two passes over the data (in, then
//! out), where the receiver could read the sender's memory once with
//! cross-memory attach (`process_vm_readv`). Then the board carries only where the data is
//! ([`Lent`]: process, address, length) and when it may be read or released, in *held* calls
//! ([`Queue::push_held`]): a held call takes its place in the call order when made but posts only
//! when the caller [`Queue::release`]s it, that is once this rank has read what it needed (a
//! [`Kind::Fanin`] to the broadcast's root, a barrier between the phases of an all-reduce). A rank
//! that lent its memory and leaves the call early (its future dropped, or failed) first marks the
//! call *withdrawn* ([`Board::withdraw`]); a reader checks the mark after every copy
//! ([`Board::withdrawn`]), seqlock-style, so it never keeps data that may have changed under it.
//! The leaving rank posts what it can of the call at once ([`Queue::leave`]), since it may not
//! use the board again for long, and a rank still waiting for the part of one that withdrew
//! fails rather than wait for it ([`Queue::awaits_withdrawn`]).
//! A reader may also offer the owner, who would otherwise only wait, to write the second half of
//! its copy while it reads the first ([`Offer`]; the broadcast's root does): two CPUs copying. A
//! reader of several owners opens a *push* to each instead ([`Board::open_push`]: a gather's
//! root, and a 2-rank reduce's root, whose other rank combines half and writes it), and ranks
//! that go down a chain (a scan) publish how far their part is done ([`Board::progress`]).

use std::collections::VecDeque;
use std::ops::{Deref, Range};
use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed, Release, SeqCst};
use std::sync::atomic::{AtomicU64, fence};

use smallvec::SmallVec;

use crate::{CollError, Reducer};

/// A call's result, or a rank's part read from the board: up to 16 bytes inline, so that the
/// smallest calls allocate nothing (and it is no larger than a `Vec`, which futures move).
pub type Data = SmallVec<[u8; 16]>;

/// Slots of the board: small calls that may be in flight on one communicator before the next
/// waits for the oldest to finish everywhere. A slot is one line per rank. Why 32: a rank that
/// writes learns that a slot is free by reading the other ranks' `finished` counters, a cache
/// line each that their owners write on every call, so each such read costs a line transfer and
/// the owner's next write another; with 32 slots that happens once in about 30 of the
/// communicator's calls, with 8 once in 7 (8 B broadcast and all-reduce on 2 ranks a few percent
/// faster with 32: `collectives-job --ranks 2 -o barrier,bcast,allreduce -s 8 -i 100000`).
pub const SLOTS: u64 = 32;
/// Data areas of the board (see [`capacity`]): calls with more than a line's worth of data that
/// may be in flight before the next waits for the oldest to finish everywhere.
pub const AREAS: u64 = 8;
/// Largest communicator served (the board grows with the rank count).
pub const MAX_RANKS: usize = 256;
/// Bytes each rank may publish per call (see [`capacity`]): at most this much...
const MAX_CAPACITY: usize = 64 << 10;
/// ... at least this much ...
const MIN_CAPACITY: usize = 4 << 10;
/// ... and all slots of all ranks together at most this much.
const BUDGET: usize = 16 << 20;

const LINE: usize = 8;
/// Where data of up to [`INLINE`] bytes sits in a rank's line: right after its counter and length
/// (one line transfer for a small call; the lines of all slots and ranks are packed together).
const INLINE_AT: usize = 2;
const INLINE: usize = (LINE - INLINE_AT) * 8;
/// Header words: magic, rank count, attach count, padding to a line.
const HEADER: usize = LINE;
/// Larger data goes to the data areas, which start on a page.
const PAGE: usize = 512;
const MAGIC: u64 = u64::from_le_bytes(*b"FCBOARD1");

const POSTED: usize = 0;
const LEN: usize = 1;
/// Words of a rank's own line: calls finished, and the last call it withdrew its memory from; then
/// its offer to split a single copy ([`Offer`]): state, destination, process.
const FINISHED: usize = 0;
const WITHDRAWN: usize = 1;
const OFFER: usize = 2;
const OFFER_DST: usize = 3;
const OFFER_PID: usize = 4;
/// ... and the state of the push into a reader's memory that the reader opened to this rank
/// ([`Board::open_push`]).
const PUSH: usize = 5;
/// ... and how far it got in a chained single-copy call ([`Board::progress`]).
const PROGRESS: usize = 6;
/// Bits of [`PROGRESS`] that count pieces; the call's tag sits above them.
const PROGRESS_BITS: u32 = 24;
/// The most pieces [`Board::progress`] counts.
pub const MAX_PIECES: u64 = (1 << PROGRESS_BITS) - 1;

/// A reader's offer to split its copy of a single-copy call with the memory's owner: the reader
/// copies the first half while the owner, who would otherwise only wait, writes the second half
/// straight into the reader's destination (two CPUs copying at once; one `process_vm_readv` of 1
/// MiB alone takes about 90 us on a 2-CPU VM). The state word holds the call and the phase
/// together, so an owner can only claim an offer made for its own call. The reader takes the half
/// back when it is done with its own unless the owner claimed it first; a claimed half is being
/// written by a running process, so the reader waits for it (or for that process's death).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offer {
    /// Made by the reader.
    Open,
    /// Taken back by the reader: it copies the half itself.
    TakenBack,
    /// Claimed by the owner, who is writing it.
    Claimed,
    /// Written by the owner.
    Written,
    /// The owner could not write it: the reader copies it itself.
    Failed,
}

impl Offer {
    fn word(self, call: u64) -> u64 {
        ((call + 1) << 3) | self as u64
    }

    fn of(word: u64, call: u64) -> Option<Offer> {
        if word >> 3 != call + 1 {
            return None;
        }
        [Offer::Open, Offer::TakenBack, Offer::Claimed, Offer::Written, Offer::Failed].get((word & 7) as usize).copied()
    }
}

/// Bytes each of `ranks` ranks may publish per call: 64 KiB up to 32 ranks, less beyond (the
/// board stays within 16 MiB), never below 4 KiB. A larger call is split into calls of this size.
pub fn capacity(ranks: usize) -> usize {
    (BUDGET / (AREAS as usize * ranks.max(1))).clamp(MIN_CAPACITY, MAX_CAPACITY) / MIN_CAPACITY * MIN_CAPACITY
}

/// Where the data areas start (in words): after the header, every rank's `finished` line and
/// every slot's and rank's line.
fn data_start(ranks: usize) -> usize {
    (HEADER + ranks * LINE + SLOTS as usize * ranks * LINE).div_ceil(PAGE) * PAGE
}

/// Size in bytes of the board of `ranks` ranks.
pub fn board_bytes(ranks: usize) -> usize {
    8 * data_start(ranks) + AREAS as usize * ranks * capacity(ranks)
}

/// One rank's view of a board: `words` is the shared memory (zeroed when created).
pub struct Board<M> {
    words: M,
    ranks: usize,
    me: usize,
    /// [`capacity`] and [`data_start`] of `ranks`.
    capacity: usize,
    data_start: usize,
}

impl<M: Deref<Target = [AtomicU64]>> Board<M> {
    /// Checks (or, on fresh zeroed memory, writes) the header; returns how many ranks have attached,
    /// this one included (the last one may remove the segment's name).
    pub fn attach(words: M, ranks: usize, me: usize) -> Result<(Board<M>, usize), CollError> {
        if ranks == 0 || ranks > MAX_RANKS || me >= ranks || words.len() * 8 < board_bytes(ranks) {
            return Err(CollError::Invalid(format!("a board of {} bytes for rank {me} of {ranks}", words.len() * 8)));
        }
        let found = match words[0].compare_exchange(0, MAGIC, Relaxed, Relaxed) {
            Ok(_) => MAGIC,
            Err(v) => v,
        };
        let n = match words[1].compare_exchange(0, ranks as u64, Relaxed, Relaxed) {
            Ok(_) => ranks as u64,
            Err(v) => v,
        };
        if found != MAGIC || n != ranks as u64 {
            return Err(CollError::Invalid(format!("the shared board holds {n:#x} ranks under magic {found:#x}")));
        }
        let attached = words[2].fetch_add(1, Relaxed) as usize + 1;
        let (capacity, data_start) = (capacity(ranks), data_start(ranks));
        Ok((Board { words, ranks, me, capacity, data_start }, attached))
    }

    /// Ranks that share the board.
    pub fn ranks(&self) -> usize {
        self.ranks
    }

    /// This rank.
    pub fn me(&self) -> usize {
        self.me
    }

    /// Bytes a rank may publish per call ([`capacity`]).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Rank `rank`'s `finished` counter.
    fn finished(&self, rank: usize) -> &AtomicU64 {
        self.own(rank, FINISHED)
    }

    /// Marks the single-copy call that began with call `seq` withdrawn: this rank's lent memory may
    /// change from now on. Before anything else this rank posts for that call, and before the
    /// memory is given back to its owner.
    pub fn withdraw(&self, seq: u64) {
        self.own(self.me, WITHDRAWN).fetch_max(seq + 1, SeqCst);
    }

    /// Whether rank `rank` withdrew from the single-copy call that began with call `seq`. Checked
    /// after copying from its memory: `false` means the copy saw the memory as lent (a rank cannot
    /// leave such a call normally while another still reads, and withdrawing from a later call
    /// implies having left this one).
    pub fn withdrawn(&self, rank: usize, seq: u64) -> bool {
        fence(SeqCst);
        self.own(rank, WITHDRAWN).load(SeqCst) > seq
    }

    /// Word `word` of rank `rank`'s own line.
    fn own(&self, rank: usize, word: usize) -> &AtomicU64 {
        &self.words[HEADER + rank * LINE + word]
    }

    /// Offers the owner of the memory that single-copy call `call` reads to write the second half
    /// of this rank's copy at `dst` in this process (`pid`) (see [`Offer`]).
    pub fn offer(&self, call: u64, dst: u64, pid: u32) {
        self.own(self.me, OFFER_DST).store(dst, Relaxed);
        self.own(self.me, OFFER_PID).store(pid as u64, Relaxed);
        self.own(self.me, OFFER).store(Offer::Open.word(call), Release);
    }

    /// Takes this rank's offer for `call` back, unless the owner claimed it: the offer's state
    /// now (`TakenBack`, `Claimed`, `Written` or `Failed`; `None`: not an offer for `call`).
    pub fn take_back(&self, call: u64) -> Option<Offer> {
        let word = self.own(self.me, OFFER);
        match word.compare_exchange(Offer::Open.word(call), Offer::TakenBack.word(call), AcqRel, Acquire) {
            Ok(_) => Some(Offer::TakenBack),
            Err(now) => Offer::of(now, call),
        }
    }

    /// The state of this rank's offer for `call`.
    pub fn offered(&self, call: u64) -> Option<Offer> {
        Offer::of(self.own(self.me, OFFER).load(Acquire), call)
    }

    /// Claims rank `rank`'s open offer for `call`: where to write and the process (`None`: no
    /// open offer of that rank for that call).
    pub fn claim(&self, rank: usize, call: u64) -> Option<(u64, u32)> {
        let word = self.own(rank, OFFER);
        if word.load(Relaxed) != Offer::Open.word(call) {
            return None;
        }
        word.compare_exchange(Offer::Open.word(call), Offer::Claimed.word(call), AcqRel, Relaxed).ok()?;
        Some((self.own(rank, OFFER_DST).load(Relaxed), self.own(rank, OFFER_PID).load(Relaxed) as u32))
    }

    /// After [`Board::claim`]: the half is written (`true`) or could not be.
    pub fn written(&self, rank: usize, call: u64, ok: bool) {
        let done = if ok { Offer::Written } else { Offer::Failed };
        self.own(rank, OFFER).store(done.word(call), Release);
    }

    /// Opens a push to rank `rank` for single-copy call `call`: the reader (this rank) lets that
    /// owner write its part straight into the reader's memory, where the call says, while the
    /// reader copies other parts (see [`Offer`]; the state lives in the owner's line, one word
    /// per owner, so a reader of several owners splits with each). `false`: that owner has moved
    /// on to a later call's push (it left this call), so the reader copies the part itself.
    /// Only within one synchronous stretch of the reader that also takes every push back
    /// ([`Board::take_back_push`]) or sees it written: an opened push never outlives the
    /// reader's part in the call.
    pub fn open_push(&self, rank: usize, call: u64) -> bool {
        let word = self.own(rank, PUSH);
        let now = word.load(Acquire);
        // Only over a word of an earlier call: a later call's state is its owner's.
        now >> 3 < call + 1 && word.compare_exchange(now, Offer::Open.word(call), AcqRel, Acquire).is_ok()
    }

    /// Claims the push that a reader opened to this rank for `call`: `Some(true)` claimed (now
    /// write the part, then [`Board::pushed`]), `Some(false)` taken back by the reader (it
    /// copies the part itself), `None` not opened yet.
    pub fn claim_push(&self, call: u64) -> Option<bool> {
        let word = self.own(self.me, PUSH);
        // A plain look first: the owner looks often, and a failed exchange takes the line too.
        let now = word.load(Acquire);
        if now != Offer::Open.word(call) {
            return (now >> 3 == call + 1).then_some(false);
        }
        match word.compare_exchange(now, Offer::Claimed.word(call), AcqRel, Acquire) {
            Ok(_) => Some(true),
            Err(now) => (now >> 3 == call + 1).then_some(false),
        }
    }

    /// After [`Board::claim_push`]: the part is written (`true`) or could not be.
    pub fn pushed(&self, call: u64, ok: bool) {
        let done = if ok { Offer::Written } else { Offer::Failed };
        self.own(self.me, PUSH).store(done.word(call), Release);
    }

    /// Takes the push opened to rank `rank` for `call` back, unless the owner claimed it: the
    /// push's state now (`TakenBack`, `Claimed`, `Written` or `Failed`; `None`: no push of `call`).
    pub fn take_back_push(&self, rank: usize, call: u64) -> Option<Offer> {
        let word = self.own(rank, PUSH);
        match word.compare_exchange(Offer::Open.word(call), Offer::TakenBack.word(call), AcqRel, Acquire) {
            Ok(_) => Some(Offer::TakenBack),
            Err(now) => Offer::of(now, call),
        }
    }

    /// The state of the push opened to rank `rank` for `call`.
    pub fn push_state(&self, rank: usize, call: u64) -> Option<Offer> {
        Offer::of(self.own(rank, PUSH).load(Acquire), call)
    }

    /// Publishes that this rank has done the first `pieces` pieces of its part in chained
    /// single-copy call `call` (a scan whose ranks each wait for the one before: see
    /// [`Board::progressed`]). At most [`MAX_PIECES`].
    pub fn progress(&self, call: u64, pieces: u64) {
        let tag = (call + 1) << PROGRESS_BITS;
        self.own(self.me, PROGRESS).store(tag | pieces.min(MAX_PIECES), Release);
    }

    /// The pieces of chained call `call` that rank `rank` has published as done (0 before it
    /// began; the call's tag is kept modulo 2^40, far more calls than any rank is behind).
    pub fn progressed(&self, rank: usize, call: u64) -> u64 {
        let word = self.own(rank, PROGRESS).load(Acquire);
        let mask = (1u64 << (64 - PROGRESS_BITS)) - 1;
        let same = (word >> PROGRESS_BITS) == ((call + 1) & mask);
        if same { word & MAX_PIECES } else { 0 }
    }

    /// Rank `rank`'s line in call `seq`'s slot: `posted`, length and inline data.
    fn line(&self, seq: u64, rank: usize) -> &[AtomicU64] {
        let at = HEADER + (self.ranks + (seq % SLOTS) as usize * self.ranks + rank) * LINE;
        &self.words[at..at + LINE]
    }

    /// Rank `rank`'s data area in call `seq`'s slot.
    fn area(&self, seq: u64, rank: usize) -> &[AtomicU64] {
        let words = self.capacity / 8;
        let at = self.data_start + ((seq % AREAS) as usize * self.ranks + rank) * words;
        &self.words[at..at + words]
    }

    fn write(&self, seq: u64, data: &[u8]) {
        let line = self.line(seq, self.me);
        if data.len() <= INLINE {
            // Whole words as words (no call to `memcpy` for a few bytes), then the rest.
            let (words, rest) = data.as_chunks::<8>();
            let inline = &line[INLINE_AT..];
            for (w, c) in inline.iter().zip(words) {
                w.store(u64::from_le_bytes(*c), Relaxed);
            }
            if !rest.is_empty() {
                let mut b = [0u8; 8];
                b[..rest.len()].copy_from_slice(rest);
                inline[words.len()].store(u64::from_le_bytes(b), Relaxed);
            }
        } else {
            copy_in(self.area(seq, self.me), 0, data);
        }
        line[LEN].store(data.len() as u64, Relaxed);
    }

    /// Writes `data` without its bytes `skip` (the rest closed up): a scatter's root leaves out its
    /// own block, which nobody reads.
    fn write_except(&self, seq: u64, data: &[u8], skip: Range<usize>) {
        let (before, after) = (&data[..skip.start], &data[skip.end..]);
        let len = before.len() + after.len();
        if len <= INLINE {
            let mut buf = [0u8; INLINE];
            buf[..before.len()].copy_from_slice(before);
            buf[before.len()..len].copy_from_slice(after);
            return self.write(seq, &buf[..len]);
        }
        let area = self.area(seq, self.me);
        copy_in(area, 0, before);
        copy_in(area, before.len(), after);
        self.line(seq, self.me)[LEN].store(len as u64, Relaxed);
    }

    /// Rank `rank`'s data of call `seq` (after its `posted` was acquired).
    fn read(&self, seq: u64, rank: usize, out: &mut Data) -> Result<(), CollError> {
        let line = self.line(seq, rank);
        let len = line[LEN].load(Relaxed) as usize;
        if len > self.capacity {
            return Err(CollError::Malformed { from: rank as u32, why: "length beyond the board's capacity" });
        }
        if len <= 16 && !out.spilled() {
            // The common small call: two words straight into the result's inline buffer.
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&line[INLINE_AT].load(Relaxed).to_le_bytes());
            buf[8..].copy_from_slice(&line[INLINE_AT + 1].load(Relaxed).to_le_bytes());
            *out = Data::from_buf_and_len(buf, len);
            return Ok(());
        }
        out.clear();
        if len <= INLINE {
            // Whole words into a stack buffer, then one append (`SmallVec::resize` would first
            // fill the bytes one by one).
            let mut buf = [0u8; INLINE];
            let (words, _) = buf.as_chunks_mut::<8>();
            for (c, w) in words.iter_mut().zip(&line[INLINE_AT..]).take(len.div_ceil(8)) {
                *c = w.load(Relaxed).to_le_bytes();
            }
            out.extend_from_slice(&buf[..len]);
        } else {
            copy_out(self.area(seq, rank), out, len);
        }
        Ok(())
    }
}

impl<M: Deref<Target = [AtomicU64]>> Board<M> {
    /// Bytes `part` of rank `rank`'s data of call `seq` (after its `posted` was acquired), which
    /// must be `len` bytes long.
    fn read_part(
        &self,
        seq: u64,
        rank: usize,
        len: usize,
        part: Range<usize>,
        out: &mut Data,
    ) -> Result<(), CollError> {
        out.clear();
        self.append_part(seq, rank, len, part, out)
    }

    /// Combines rank `rank`'s data of call `seq` (after its `posted` was acquired), which must
    /// be `len` bytes long, into `acc` (as long): `acc = theirs ⊕ acc` if `theirs_first`, else
    /// `acc ⊕ theirs`. Data in an area is combined where it lies, with no copy first; `x` holds
    /// inline data meanwhile.
    #[allow(clippy::too_many_arguments)] // the call, whose data, how it combines, and where
    fn apply_part(
        &self,
        seq: u64,
        rank: usize,
        len: usize,
        op: &Reducer,
        acc: &mut [u8],
        theirs_first: bool,
        x: &mut Data,
    ) -> Result<(), CollError> {
        let posted = self.line(seq, rank)[LEN].load(Relaxed) as usize;
        if posted != len || len > self.capacity || acc.len() != len {
            return Err(CollError::Malformed { from: rank as u32, why: "length differs from this rank's" });
        }
        if len <= INLINE {
            self.read_part(seq, rank, len, 0..len, x)?;
            op.apply(acc, x, theirs_first);
            return Ok(());
        }
        let area = self.area(seq, rank);
        assert!(len <= area.len() * 8, "checked against the capacity");
        // SAFETY: as in `copy_out`: the area is valid for `area.len() * 8` bytes (`len` lie
        // within); its writer finished before the release of `posted` that the caller acquired
        // and does not write again before this rank is done with the slot (rule 2), so nothing
        // writes these bytes while the slice lives.
        let theirs = unsafe { std::slice::from_raw_parts(area.as_ptr().cast::<u8>(), len) };
        op.apply(acc, theirs, theirs_first);
        Ok(())
    }

    /// [`Board::read_part`] appended to `out` (its bytes so far kept): a gathered result grows
    /// rank by rank straight from the board, with no copy through a scratch buffer, and reads
    /// only the bytes it keeps (an all-to-all's block of each rank: a line transfer per 64 bytes
    /// of the other ranks' data, so half of them on 2 ranks).
    fn append_part(
        &self,
        seq: u64,
        rank: usize,
        len: usize,
        part: Range<usize>,
        out: &mut Data,
    ) -> Result<(), CollError> {
        let line = self.line(seq, rank);
        let posted = line[LEN].load(Relaxed) as usize;
        if posted != len || len > self.capacity || part.end > len || part.start > part.end {
            return Err(CollError::Malformed { from: rank as u32, why: "length differs from this rank's" });
        }
        if len <= INLINE {
            // Only the words that hold `part`, into a stack buffer, then one append.
            let mut buf = [0u8; INLINE];
            let (words, _) = buf.as_chunks_mut::<8>();
            let first = part.start / 8;
            for (c, w) in words.iter_mut().zip(&line[INLINE_AT..]).take(part.end.div_ceil(8)).skip(first) {
                *c = w.load(Relaxed).to_le_bytes();
            }
            out.extend_from_slice(&buf[part]);
        } else {
            append_out(self.area(seq, rank), out, part);
        }
        Ok(())
    }
}

/// Copies `data` into the memory of `words` from byte `at` with `memcpy`. Word by word atomic
/// stores cost a read-for-ownership per cache line, which the other core holds from its last read;
/// a bulk copy writes whole lines (a 32 KiB broadcast takes about 4x longer word by word).
fn copy_in(words: &[AtomicU64], at: usize, data: &[u8]) {
    assert!(at + data.len() <= words.len() * 8, "checked against the capacity");
    // SAFETY: the destination is `words`' own memory, valid for `words.len() * 8` bytes (`at +
    // data.len()` lie within), and atomics are `UnsafeCell`s, so it may be written through a
    // pointer taken from `&[AtomicU64]`. No other access overlaps: a rank writes its part of a
    // slot only once every rank is done with the slot's previous call (rule 2), and readers look
    // only after the release of `posted`.
    unsafe {
        let dst = words.as_ptr().cast::<u8>().cast_mut().add(at);
        std::ptr::copy_nonoverlapping(data.as_ptr(), dst, data.len());
    }
}

/// Sets `out` (empty) to the first `len` bytes of `words`, with one `memcpy` (no zero-filling
/// first: `SmallVec::resize` fills byte by byte).
fn copy_out(words: &[AtomicU64], out: &mut Data, len: usize) {
    assert!(len <= words.len() * 8 && out.is_empty(), "checked against the capacity");
    out.reserve_exact(len);
    // SAFETY: the source is valid for `words.len() * 8` bytes; its writer finished before the
    // release of `posted` that the caller acquired, and does not write again before this rank is
    // done with the slot (rule 2). `out` has room for `len` bytes, all written before `set_len`.
    unsafe {
        std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>(), out.as_mut_ptr(), len);
        out.set_len(len);
    }
}

/// Appends bytes `part` of `words` to `out`, with one `memcpy`.
fn append_out(words: &[AtomicU64], out: &mut Data, part: Range<usize>) {
    assert!(part.end <= words.len() * 8 && part.start <= part.end, "checked against the capacity");
    out.reserve(part.len());
    let at = out.len();
    // SAFETY: as in `copy_out`: the source is valid for `words.len() * 8` bytes (`part` lies
    // within), its writer finished before the release of `posted` that the caller acquired and
    // does not write again before this rank is done with the slot; `out` has room for
    // `part.len()` more bytes after its `at`, all written before `set_len`.
    unsafe {
        let dst = out.as_mut_ptr().add(at);
        std::ptr::copy_nonoverlapping(words.as_ptr().cast::<u8>().add(part.start), dst, part.len());
        out.set_len(at + part.len());
    }
}

/// What a call does.
#[derive(Clone, Debug)]
pub enum Kind {
    /// Every rank waits for all. No data.
    Barrier,
    /// The root's data is its input (the other ranks give none); the root's result is empty.
    Bcast {
        /// The broadcasting rank.
        root: u32,
    },
    /// Every rank's data combined with the reducer, in rank order; the result at every rank.
    Allreduce(Reducer),
    /// Every rank's part (all of one length), laid end to end in rank order.
    Allgather,
    /// Every rank's data holds one block per rank; the result is this rank's block of every rank's
    /// data, in rank order. Not split into pieces: the whole data must fit one call.
    Alltoall,
    /// Combined in rank order at the root (empty result elsewhere).
    Reduce {
        /// The rank that receives the result.
        root: u32,
        /// The reduction.
        op: Reducer,
    },
    /// Every rank tells the root it is there; only the root waits (for all). No data.
    Fanin {
        /// The rank that waits.
        root: u32,
    },
    /// Every rank's part (all of one length), laid end to end in rank order at the root (empty
    /// result elsewhere): a reduction's shape, without the combining.
    Gather {
        /// The rank that receives the parts.
        root: u32,
    },
    /// The root's data (its input, the call's whole length) holds one block per rank in rank
    /// order; every other rank gets its block (the root gets nothing: it has its data), reading
    /// only that block. Only the root posts, as in a broadcast, every block but its own (the
    /// blocks after it close up). Not split into pieces: the whole data must fit one call.
    Scatter {
        /// The rank whose data is scattered.
        root: u32,
    },
    /// Prefix reduction: this rank's result combines, in rank order, the data of the ranks before
    /// it and, if `inclusive`, its own; it waits for those ranks only. An exclusive scan's rank 0
    /// gets an empty result.
    Scan {
        /// The reduction.
        op: Reducer,
        /// Whether this rank's own data is part of its result.
        inclusive: bool,
    },
    /// Every rank's data combined in rank order over the bytes `part` only: this rank's segment
    /// of a reduce-scatter (each rank names its own). Not split into pieces: the whole data must
    /// fit one call. On 2 ranks the segments are each other's complement, so a rank posts only
    /// the other's (half the bytes: a 64-byte vector's other half fits its line) and keeps its
    /// own to combine with what it reads.
    ReduceScatter {
        /// The reduction.
        op: Reducer,
        /// This rank's bytes of the data.
        part: Range<usize>,
    },
}

/// Where a call stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Post,
    Wait,
    Finish,
    Done,
}

/// One collective call on the board.
#[derive(Debug)]
pub struct Call {
    seq: u64,
    kind: Kind,
    /// Bytes of the call's data (per rank; all of an all-to-all's blocks), the same on every rank.
    len: usize,
    /// What this rank publishes.
    input: Vec<u8>,
    phase: Phase,
    result: Result<Data, CollError>,
    /// Its future is gone: drop the result when done.
    abandoned: bool,
    /// Posts only once released ([`Queue::push_held`]).
    held: bool,
    /// This rank's own data that it does not post but needs for its result (a 2-rank
    /// reduce-scatter's own segment; see [`Call::left_out`]).
    own: Data,
}

/// What a waiting call waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Rank `r` has not posted its part yet, or not finished with the slot's previous call.
    Rank(u32),
    /// An earlier call of this rank (calls post and finish in call order).
    Earlier,
    /// This rank's caller, to release the call ([`Queue::push_held`]).
    Caller,
}

impl Call {
    /// Whether rank `me` publishes data in this call.
    fn writes(&self, me: usize) -> bool {
        match &self.kind {
            Kind::Barrier | Kind::Fanin { .. } => false,
            Kind::Bcast { root } | Kind::Scatter { root } => *root as usize == me,
            Kind::Allreduce(_)
            | Kind::Allgather
            | Kind::Alltoall
            | Kind::Reduce { .. }
            | Kind::Gather { .. }
            | Kind::Scan { .. }
            | Kind::ReduceScatter { .. } => true,
        }
    }

    /// Whether rank `me` posts in this call (everyone but a broadcast's receivers).
    fn posts(&self, me: usize) -> bool {
        !matches!(self.kind, Kind::Bcast { root } | Kind::Scatter { root } if root as usize != me)
    }

    /// The bytes of the call's data that its writer leaves out on `ranks` ranks: a scatter's root
    /// its own block (its caller has it), so the other blocks close up, and on 2 ranks a block of
    /// up to a line's data goes inline (one line transfer, where the whole data took two); on 2
    /// ranks a reduce-scatter's rank its own segment (nobody else reads it), so it posts exactly
    /// the other rank's.
    fn left_out(&self, ranks: usize) -> Range<usize> {
        match self.kind {
            Kind::Scatter { root } if self.len.is_multiple_of(ranks) => {
                let block = self.len / ranks;
                root as usize * block..(root as usize + 1) * block
            }
            Kind::ReduceScatter { ref part, .. } if ranks == 2 && part.start <= part.end && part.end <= self.len => {
                part.clone()
            }
            _ => 0..0,
        }
    }

    /// Keeps what this rank needs of its own `input` for its result and does not post: a 2-rank
    /// reduce-scatter's own segment ([`Call::left_out`]); inline up to 16 bytes.
    fn keep_own(&mut self, ranks: usize, input: &[u8]) {
        if matches!(self.kind, Kind::ReduceScatter { .. }) && input.len() == self.len {
            let own = self.left_out(ranks);
            if !own.is_empty() {
                self.own = Data::from_slice(&input[own]);
            }
        }
    }

    /// Bytes the writer publishes ([`Call::left_out`] left out).
    fn written(&self, ranks: usize) -> usize {
        self.len - self.left_out(ranks).len()
    }
}

/// This rank's own progress through the calls (rule 1) and what it knows of the others' (rule 2).
#[derive(Debug, Default)]
struct Order {
    /// Calls before this one have posted.
    posted: u64,
    /// Calls after `posted` that have posted (passing held ones): bit `i` is call `posted + i`.
    ahead: u64,
    /// Every earlier call that has not posted is held: the call being looked at may pass them.
    passable: bool,
    /// Calls before this one have finished.
    finished: u64,
    /// The highest `finished` seen of each rank.
    seen: Vec<u64>,
}

impl Order {
    /// Call `seq` has posted; `posted` moves past every call that has.
    fn mark_posted(&mut self, seq: u64) {
        self.ahead |= 1 << (seq - self.posted);
        while self.ahead & 1 == 1 {
            self.ahead >>= 1;
            self.posted += 1;
        }
    }
}

/// The calls of one communicator on this rank, oldest first.
#[derive(Debug, Default)]
pub struct Queue {
    next: u64,
    calls: VecDeque<Call>,
    order: Order,
    /// Some abandoned call may have finished: sweep it out.
    sweep: bool,
    /// Where reductions and all-gathers read the other ranks' parts (kept: no allocation per call).
    scratch: Data,
}

impl Queue {
    /// Enqueues a call on `board` and returns its number. `input` is the root's data (broadcast) or
    /// this rank's contribution (all-reduce, all-gather), `len` bytes that every rank must agree
    /// on, at most the board's [`capacity`].
    pub fn push<M>(&mut self, board: &Board<M>, kind: Kind, len: usize, input: Vec<u8>) -> Result<u64, CollError> {
        fits(board, len, input.len())?;
        let mut call = self.next_call(kind, len);
        call.keep_own(board.ranks, &input);
        call.input = input;
        let seq = call.seq;
        self.calls.push_back(call);
        Ok(seq)
    }

    /// The next call, in its first phase, without input.
    fn next_call(&mut self, kind: Kind, len: usize) -> Call {
        let seq = self.next;
        self.next += 1;
        let (phase, result) = (Phase::Post, Ok(Data::new()));
        Call { seq, kind, len, input: Vec::new(), phase, result, abandoned: false, held: false, own: Data::new() }
    }

    /// Makes a call at once when none is queued before it: posts it (copying `input` straight to
    /// the board) if its slot is free, and completes it if what it needs is already posted.
    /// Returns its number and, if it completed, its result; otherwise it is queued in the phase it
    /// reached, as if [`Queue::push`]ed and advanced. The latency path of small calls: no copy of
    /// the input, and usually one queue entry less (a late rank; a broadcast's root, when
    /// [`Queue::root_now`] could not).
    #[allow(clippy::type_complexity)]
    pub fn call_now<M: Deref<Target = [AtomicU64]>>(
        &mut self,
        board: &Board<M>,
        kind: Kind,
        len: usize,
        input: &[u8],
    ) -> Result<(u64, Option<Result<Data, CollError>>), CollError> {
        if !self.calls.is_empty() {
            return Ok((self.push(board, kind, len, input.to_vec())?, None));
        }
        fits(board, len, input.len())?;
        let mut call = self.next_call(kind, len);
        call.keep_own(board.ranks, input);
        let seq = call.seq;
        // Nothing queued: every earlier call has posted and finished (rule 1).
        self.order.passable = true;
        if blocker(board, &call, &mut self.order).is_some() {
            // The slot is still in use (rule 2): queued, with its input.
            call.input = input.to_vec();
            self.calls.push_back(call);
            return Ok((seq, None));
        }
        post(board, &call, input, &mut self.order);
        call.phase = Phase::Wait;
        step(board, &mut call, &mut self.order, &mut self.scratch);
        if call.phase == Phase::Done {
            return Ok((seq, Some(call.result)));
        }
        self.calls.push_back(call);
        Ok((seq, None))
    }

    /// The call of a broadcast's root (`input`: its data, as long as the call) when nothing is
    /// queued (so every earlier call has posted and finished, rule 1) and its slot is known to be
    /// free (rule 2, from the `finished` counters seen so far): it waits for nobody, so it posts
    /// and finishes at once, without building a [`Call`] and stepping it through its phases. The
    /// same for a rank that only gives its part to a root (`input`: that part), a gather's or a
    /// reduce's other ranks: the root reads the part and checks its length.
    /// Returns whether it did; if not (or if `input` is larger than a slot's), the caller makes
    /// the call with [`Queue::call_now`], which rereads the counters and queues the call if it
    /// must wait. Tried first by the root crate, before anything else is built for the call: it
    /// takes about a quarter off an 8 B broadcast's root on 2 ranks (`collectives-job --ranks 2
    /// -o bcast -s 8 -i 100000`).
    ///
    /// The board is written last, after this rank's own bookkeeping, so that little follows the
    /// post (and the driver returns a call complete when made as its result alone, not as a
    /// finished future): the slot's line is usually being read by a waiting receiver, so taking
    /// it back costs a cache-line round trip, and the stores that follow wait in the CPU's store
    /// buffer meanwhile; once it is full (a few dozen stores), the caller stops until the line
    /// comes.
    #[inline]
    pub fn root_now<M: Deref<Target = [AtomicU64]>>(&mut self, board: &Board<M>, input: &[u8]) -> bool {
        self.post_alone(board, input, 0..0)
    }

    /// [`Queue::root_now`] for a scatter's root (`input`: its whole data, a block per rank): it
    /// writes every block but its own, as the scatter's readers expect ([`Kind::Scatter`]).
    #[inline]
    pub fn scatter_root_now<M: Deref<Target = [AtomicU64]>>(&mut self, board: &Board<M>, input: &[u8]) -> bool {
        if !input.len().is_multiple_of(board.ranks) {
            return false;
        }
        let block = input.len() / board.ranks;
        self.post_alone(board, input, board.me * block..(board.me + 1) * block)
    }

    /// Posts `input` without its bytes `skip` and finishes, if nothing is queued and the slot is
    /// known to be free ([`Queue::root_now`]).
    #[inline(always)]
    fn post_alone<M: Deref<Target = [AtomicU64]>>(
        &mut self,
        board: &Board<M>,
        input: &[u8],
        skip: Range<usize>,
    ) -> bool {
        let seq = self.next;
        let need = freed_at(seq, input.len() - skip.len());
        let o = &mut self.order;
        let free = o.seen.len() == board.ranks && o.seen.iter().all(|&f| f >= need);
        if !self.calls.is_empty() || !free || input.len() > board.capacity {
            return false;
        }
        self.next += 1;
        o.mark_posted(seq);
        if skip.is_empty() {
            board.write(seq, input);
        } else {
            board.write_except(seq, input, skip);
        }
        board.line(seq, board.me)[POSTED].store(seq + 1, Release);
        finished(board, seq, o);
        true
    }

    /// Call `seq` when it is the only call queued and has posted (the usual wait of a small
    /// call): `Some(None)` while a part it needs is not posted, `Some(Some(result))` once it has
    /// gathered and finished (it leaves the queue); `None` when the queue holds anything else,
    /// for [`Queue::advance`] and [`Queue::take`]. The same steps as theirs, without walking the
    /// queue or asking which phase the call is in: a look that finds nothing is a load or two,
    /// and one that finds the call's parts goes straight to its result. Why: on 2 ranks the
    /// waits that complete here are on the critical path of every call (a broadcast's receiver
    /// until it returns, the root's barrier until it broadcasts again); a completed wait costs a
    /// third fewer instructions this way (callgrind on `collectives-job --ranks 2 -o
    /// barrier,bcast,allreduce -s 8 -i 50000`).
    #[inline]
    pub fn finish_now<M: Deref<Target = [AtomicU64]>>(
        &mut self,
        board: &Board<M>,
        seq: u64,
    ) -> Option<Option<Result<Data, CollError>>> {
        // Alone in the queue, so every earlier call has finished (rule 1).
        if self.calls.len() != 1 || self.sweep {
            return None;
        }
        let c = self.calls.front_mut().filter(|c| c.seq == seq && c.phase == Phase::Wait && !c.abandoned)?;
        if earlier_unfinished(c, &self.order) {
            return None;
        }
        if unposted(board, c).is_some() {
            return Some(None);
        }
        let own = std::mem::take(&mut c.own);
        let result = gather(board, c, own, &mut self.scratch);
        finished(board, seq, &mut self.order);
        self.calls.clear();
        Some(Some(result))
    }

    /// Enqueues a call without data (a barrier or a fan-in) that posts only once [`Queue::release`]d
    /// (or abandoned): its place in the call order is taken now, its meaning ("this rank has read
    /// what it needed") comes later. Later calls post after it (rule 1).
    pub fn push_held(&mut self, kind: Kind) -> u64 {
        let call = Call { held: true, ..self.next_call(kind, 0) };
        let seq = call.seq;
        self.calls.push_back(call);
        seq
    }

    /// Lets held call `seq` post.
    pub fn release(&mut self, seq: u64) {
        self.calls.iter_mut().filter(|c| c.seq == seq).for_each(|c| c.held = false);
    }

    /// Advances every call as far as the board allows.
    pub fn advance<M: Deref<Target = [AtomicU64]>>(&mut self, board: &Board<M>) {
        let mut passable = true;
        for call in self.calls.iter_mut() {
            self.order.passable = passable;
            step(board, call, &mut self.order, &mut self.scratch);
            passable &= call.phase != Phase::Post || call.held;
        }
        if self.sweep {
            self.sweep_abandoned();
        }
    }

    /// Drops finished calls nobody will collect.
    fn sweep_abandoned(&mut self) {
        self.calls.retain(|c| !(c.abandoned && c.phase == Phase::Done));
        self.sweep = self.calls.iter().any(|c| c.abandoned);
    }

    /// The result of call `seq` once it has read what it needs: it leaves the queue if done, or
    /// finishes later in call order (after earlier calls that are held) as an abandoned call.
    pub fn take(&mut self, seq: u64) -> Option<Result<Data, CollError>> {
        let ready = |c: &Call| c.seq == seq && !c.abandoned && matches!(c.phase, Phase::Finish | Phase::Done);
        // Usually the oldest, and done: taken from the front without a search (which, with
        // `remove`, costs about 50 instructions more per call, and 4% of a 2-rank 8 B broadcast).
        if self.calls.front().is_some_and(|c| ready(c) && c.phase == Phase::Done) {
            return self.calls.pop_front().map(|c| c.result);
        }
        let i = self.calls.iter().position(ready)?;
        if self.calls[i].phase == Phase::Done {
            return self.calls.remove(i).map(|c| c.result);
        }
        let c = &mut self.calls[i];
        (c.abandoned, self.sweep) = (true, true);
        Some(std::mem::replace(&mut c.result, Ok(Data::new())))
    }

    /// What call `seq` waits for, if it is not done.
    pub fn waiting<M: Deref<Target = [AtomicU64]>>(&mut self, board: &Board<M>, seq: u64) -> Option<Waiting> {
        let call = self.calls.iter().find(|c| c.seq == seq && c.phase != Phase::Done)?;
        let mut earlier = self.calls.iter().take_while(|c| c.seq < seq);
        self.order.passable = earlier.all(|c| c.phase != Phase::Post || c.held);
        Some(blocker(board, call, &mut self.order).unwrap_or(Waiting::Earlier))
    }

    /// The future of calls `seqs` was dropped: the calls still do their part (other ranks may
    /// depend on it; held calls are released), and their results are dropped.
    pub fn abandon(&mut self, seqs: Range<u64>) {
        self.calls.iter_mut().filter(|c| seqs.contains(&c.seq)).for_each(|c| (c.abandoned, c.held) = (true, false));
        self.sweep_abandoned();
    }

    /// [`Queue::abandon`], then posts at once what the board allows of them (and of every other
    /// call): a rank that leaves a call may not use the board again for a long time (its next
    /// collectives may take other algorithms), and the others wait for its posts meanwhile. A
    /// single-copy call's rank withdraws first ([`Board::withdraw`]), so that the others, seeing
    /// its part posted, go on to find the memory withdrawn rather than wait for it.
    pub fn leave<M: Deref<Target = [AtomicU64]>>(&mut self, board: &Board<M>, seqs: Range<u64>) {
        self.abandon(seqs);
        self.advance(board);
    }

    /// The rank that call `seq` waits for (its post, or its finishing an earlier call with the
    /// slot) if that rank withdrew from the single-copy call that began with call `first`: it
    /// left that call, so whatever of it this rank still waits for, the call fails
    /// ([`CollError::Withdrawn`]) rather than wait until that rank drives the board again, which
    /// it may never do.
    pub fn awaits_withdrawn<M: Deref<Target = [AtomicU64]>>(
        &mut self,
        board: &Board<M>,
        seq: u64,
        first: u64,
    ) -> Option<u32> {
        match self.waiting(board, seq)? {
            Waiting::Rank(r) if board.withdrawn(r as usize, first) => Some(r),
            _ => None,
        }
    }

    /// Calls not collected yet (abandoned ones included).
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether no call is left to collect.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }
}

/// Refuses a call of `len` bytes (per rank), with `input` bytes of this rank's, that does not fit
/// `board`.
fn fits<M>(board: &Board<M>, len: usize, input: usize) -> Result<(), CollError> {
    let cap = board.capacity;
    if len > cap || input > cap {
        return Err(CollError::Invalid(format!("{len} bytes do not fit the shared board ({cap})")));
    }
    // Rule 2 goes by `len` (whether the data needs an area): a rank's part is never longer.
    if input > len {
        return Err(CollError::Invalid(format!("{input} bytes given for a call of {len}")));
    }
    Ok(())
}

/// Rule 2: call `seq`, writing `len` bytes, may write once every rank's `finished` has reached
/// this: they are done with its slot's previous call, and if the data goes to an area (more than
/// fits a line), with its area's.
fn freed_at(seq: u64, len: usize) -> u64 {
    (seq + 1).saturating_sub(if len > INLINE { AREAS } else { SLOTS })
}

/// The first thing call `c` waits for in its current phase, or `None` if it can move.
fn blocker<M: Deref<Target = [AtomicU64]>>(b: &Board<M>, c: &Call, o: &mut Order) -> Option<Waiting> {
    match c.phase {
        Phase::Post => {
            if c.held {
                return Some(Waiting::Caller);
            }
            // Rule 1, passing only held calls, and only within a board's worth of slots.
            if o.posted != c.seq && !(o.passable && c.seq < o.posted + SLOTS) {
                return Some(Waiting::Earlier);
            }
            // A fanned-in barrier: rank 0 posts last, once every other rank has.
            if b.me == 0 && fans_in(b, c) {
                let late = |r: usize| b.line(c.seq, r)[POSTED].load(Acquire) <= c.seq;
                if let Some(r) = (1..b.ranks).find(|&r| late(r)) {
                    return Some(Waiting::Rank(r as u32));
                }
            }
            if c.writes(b.me) {
                // Rule 2: every rank is done with the slot's previous call.
                let need = freed_at(c.seq, c.written(b.ranks));
                o.seen.resize(b.ranks, 0);
                for r in 0..b.ranks {
                    if o.seen[r] < need {
                        o.seen[r] = b.finished(r).load(Acquire);
                        if o.seen[r] < need {
                            return Some(Waiting::Rank(r as u32));
                        }
                    }
                }
            }
            None
        }
        Phase::Wait => unposted(b, c).map(|r| Waiting::Rank(r as u32)),
        Phase::Finish => earlier_unfinished(c, o).then_some(Waiting::Earlier),
        Phase::Done => None,
    }
}

/// The first rank whose part call `c` needs to gather and that has not posted it, if any.
#[inline]
fn unposted<M: Deref<Target = [AtomicU64]>>(b: &Board<M>, c: &Call) -> Option<usize> {
    let need = c.seq + 1;
    let late = |r: usize| b.line(c.seq, r)[POSTED].load(Acquire) < need;
    match c.kind {
        Kind::Bcast { root } | Kind::Scatter { root } => late(root as usize).then_some(root as usize),
        // A scan waits for the ranks before this one (and its own post, if inclusive).
        Kind::Scan { inclusive, .. } => (0..b.me + usize::from(inclusive)).find(|&r| late(r)),
        // Rank 0 posted last (see `Phase::Post`): its post says that all have. Until then, the
        // rank waited for is the first that has not posted (it may be lost).
        Kind::Barrier if fans_in(b, c) => late(0).then(|| (1..b.ranks).find(|&r| late(r)).unwrap_or(0)),
        // Only the root reads a reduction.
        Kind::Reduce { root, .. } | Kind::Fanin { root } | Kind::Gather { root } if root as usize != b.me => None,
        Kind::Barrier
        | Kind::Gather { .. }
        | Kind::ReduceScatter { .. }
        | Kind::Allreduce(_)
        | Kind::Allgather
        | Kind::Alltoall
        | Kind::Reduce { .. }
        | Kind::Fanin { .. } => (0..b.ranks).find(|&r| late(r)),
    }
}

/// Whether call `c` is a barrier that fans in to rank 0 and out from it: on more than 2 ranks.
/// Rank 0 posts once every other rank has, and the others leave on rank 0's post, so rank 0
/// leaves first, as in the shared-memory barriers of Open MPI (coll/sm) and MPICH
/// (release-gather). Why: where ranks outnumber CPUs a rank leaves a barrier only once it is
/// scheduled, and when every rank reads every line the last to arrive leaves first; a broadcast
/// from rank 0 right after the barrier then waits for rank 0 to be scheduled. Fanning in, the
/// barrier takes that wait and the broadcast does not (4 ranks on 2 CPUs, 8 B: about 0.17 us
/// against over 1 us; `ferrocomm-bench collectives --ranks 4 --ops barrier,bcast --max 8 --no-mpi`).
/// On 2 ranks every rank reading every line is one exchange, a cache-line transfer before
/// either leaves, where fanning in takes two: kept there.
fn fans_in<M>(b: &Board<M>, c: &Call) -> bool {
    matches!(c.kind, Kind::Barrier) && b.ranks > 2
}

fn step<M: Deref<Target = [AtomicU64]>>(b: &Board<M>, c: &mut Call, o: &mut Order, scratch: &mut Data) {
    while c.phase != Phase::Done && blocker(b, c, o).is_none() {
        match c.phase {
            Phase::Post => {
                post(b, c, &c.input, o);
                c.phase = Phase::Wait;
            }
            Phase::Wait => {
                let own = std::mem::take(&mut c.own);
                c.result = gather(b, c, own, scratch);
                c.phase = Phase::Finish;
                // Straight on when nothing earlier is unfinished: a round of the loop would ask
                // `blocker` the same (a call of it costs about 80 instructions here).
                if !earlier_unfinished(c, o) {
                    finish(b, c, o);
                }
            }
            Phase::Finish => finish(b, c, o),
            Phase::Done => {}
        }
    }
}

/// Rule 1: call `c` finishes only after every earlier call of this rank.
fn earlier_unfinished(c: &Call, o: &Order) -> bool {
    o.finished != c.seq
}

/// Call `c` is done.
fn finish<M: Deref<Target = [AtomicU64]>>(b: &Board<M>, c: &mut Call, o: &mut Order) {
    finished(b, c.seq, o);
    c.phase = Phase::Done;
}

/// This rank is done with call `seq`'s slot, and with every earlier call's.
fn finished<M: Deref<Target = [AtomicU64]>>(b: &Board<M>, seq: u64, o: &mut Order) {
    o.finished = seq + 1;
    b.finished(b.me).store(o.finished, Release);
}

/// Publishes this rank's part of call `c` (its data `input`), once nothing blocks it.
fn post<M: Deref<Target = [AtomicU64]>>(b: &Board<M>, c: &Call, input: &[u8], o: &mut Order) {
    if c.writes(b.me) {
        match c.left_out(b.ranks) {
            skip if skip.is_empty() => b.write(c.seq, input),
            // Not the whole data: nothing, which the readers refuse (`written` bytes expected).
            _ if input.len() != c.len => b.write(c.seq, &[]),
            skip => b.write_except(c.seq, input, skip),
        }
    }
    if c.posts(b.me) {
        b.line(c.seq, b.me)[POSTED].store(c.seq + 1, Release);
    }
    o.mark_posted(c.seq);
}

/// Reads what call `c` needs from the board, once every part it needs is posted (`own`: what
/// this rank kept of its own data, [`Call::keep_own`]).
fn gather<M: Deref<Target = [AtomicU64]>>(b: &Board<M>, c: &Call, own: Data, x: &mut Data) -> Result<Data, CollError> {
    let mut out = Data::new();
    match &c.kind {
        Kind::Barrier | Kind::Fanin { .. } => {}
        // The root has its data: it gets nothing back.
        Kind::Bcast { root } if *root as usize == b.me => return Ok(out),
        Kind::Bcast { root } => b.read(c.seq, *root as usize, &mut out)?,
        Kind::Scatter { root } if *root as usize == b.me => return Ok(out),
        Kind::Scatter { root } => {
            if !c.len.is_multiple_of(b.ranks) {
                return Err(CollError::Invalid(format!("{} bytes do not split into {} blocks", c.len, b.ranks)));
            }
            // The root left its own block out: the blocks after it moved up by one.
            let block = c.len / b.ranks;
            let k = b.me - usize::from(b.me > *root as usize);
            b.read_part(c.seq, *root as usize, c.written(b.ranks), k * block..(k + 1) * block, &mut out)?;
            return Ok(out);
        }
        Kind::Reduce { root, .. } | Kind::Gather { root } if *root as usize != b.me => return Ok(out),
        Kind::Scan { op, inclusive } => {
            let upto = b.me + usize::from(*inclusive);
            if upto == 0 {
                return Ok(out);
            }
            b.read(c.seq, 0, &mut out)?;
            for r in 1..upto {
                b.read(c.seq, r, x)?;
                if x.len() != out.len() || !x.len().is_multiple_of(op.element_size()) {
                    return Err(CollError::Malformed { from: r as u32, why: "scan length differs" });
                }
                op.apply(&mut out, x, false);
            }
        }
        Kind::ReduceScatter { op, part } => {
            if part.end > c.len || !part.len().is_multiple_of(op.element_size()) {
                return Err(CollError::Invalid(format!("segment {part:?} of a {}-byte reduction", c.len)));
            }
            if b.ranks == 2 {
                // The other rank posted exactly this rank's segment (its own left out).
                let other = 1 - b.me;
                if own.len() != part.len() {
                    return Err(CollError::Invalid(format!("segment {part:?} of a {}-byte reduction", c.len)));
                }
                out = own;
                b.apply_part(c.seq, other, part.len(), op, &mut out, other < b.me, x)?;
                return Ok(out);
            }
            b.read_part(c.seq, 0, c.len, part.clone(), &mut out)?;
            for r in 1..b.ranks {
                b.read_part(c.seq, r, c.len, part.clone(), x)?;
                op.apply(&mut out, x, false);
            }
            return Ok(out);
        }
        Kind::Allreduce(op) | Kind::Reduce { op, .. } => {
            b.read(c.seq, 0, &mut out)?;
            for r in 1..b.ranks {
                b.read(c.seq, r, x)?;
                if x.len() != out.len() {
                    return Err(CollError::Malformed { from: r as u32, why: "all-reduce length differs" });
                }
                if !x.len().is_multiple_of(op.element_size()) {
                    return Err(CollError::Malformed { from: r as u32, why: "a partial element" });
                }
                op.apply(&mut out, x, false);
            }
        }
        Kind::Allgather | Kind::Gather { .. } => {
            out.reserve(c.len * b.ranks);
            for r in 0..b.ranks {
                b.append_part(c.seq, r, c.len, 0..c.len, &mut out)?;
            }
            return Ok(out);
        }
        Kind::Alltoall => {
            if !c.len.is_multiple_of(b.ranks) {
                return Err(CollError::Invalid(format!("{} bytes do not split into {} blocks", c.len, b.ranks)));
            }
            // This rank's block of every rank's data, and nothing more of it.
            let block = c.len / b.ranks;
            out.reserve(c.len);
            for r in 0..b.ranks {
                b.append_part(c.seq, r, c.len, b.me * block..(b.me + 1) * block, &mut out)?;
            }
            return Ok(out);
        }
    }
    if out.len() != c.len {
        let from = match c.kind {
            Kind::Bcast { root } | Kind::Scatter { root } => root,
            _ => 0,
        };
        return Err(CollError::Malformed { from, why: "length differs from this rank's" });
    }
    Ok(out)
}

/// Memory a rank lends to the others for a single-copy call: where it is, in which process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lent {
    /// The lending process.
    pub pid: u32,
    /// The memory's address in that process.
    pub addr: u64,
    /// The memory's length in bytes.
    pub len: u64,
}

impl Lent {
    /// Bytes of a [`Lent`] on the board (inline in a rank's line).
    pub const BYTES: usize = 24;

    /// `data`, in this process.
    pub fn of(data: &[u8]) -> Lent {
        Lent { pid: std::process::id(), addr: data.as_ptr() as u64, len: data.len() as u64 }
    }

    /// Its [`Lent::BYTES`] bytes on the board: pid, address, length, little-endian words.
    pub fn encode(&self) -> Vec<u8> {
        [u64::from(self.pid), self.addr, self.len].iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    /// Reads what rank `from` lent for a call of `len` bytes; refuses what cannot be it.
    pub fn decode(from: u32, b: &[u8], len: usize) -> Result<Lent, CollError> {
        let bad = |why| Err(CollError::Malformed { from, why });
        if b.len() != Lent::BYTES {
            return bad("lent memory described in the wrong size");
        }
        let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let (pid, addr, n) = (w(0), w(1), w(2));
        if pid == 0 || pid > u64::from(i32::MAX as u32) || addr.checked_add(n).is_none() {
            return bad("lent memory not in a process");
        }
        if n != len as u64 {
            return bad("length differs from this rank's");
        }
        Ok(Lent { pid: pid as u32, addr, len: n })
    }
}

/// Part `i` of `len` bytes cut into `ranks` parts on `elem`-byte element boundaries (the first
/// parts one element longer where the elements do not divide evenly).
pub fn part(len: usize, elem: usize, ranks: usize, i: usize) -> Range<usize> {
    let (elems, elem) = (len / elem.max(1), elem.max(1));
    let (base, extra) = (elems / ranks, elems % ranks);
    let start = i * base + i.min(extra);
    let end = start + base + usize::from(i < extra);
    start * elem..end * elem
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::ReduceOp;

    /// A board in this process's memory, shared by threads posing as ranks.
    #[derive(Clone)]
    struct Mem(Arc<[AtomicU64]>);

    impl Deref for Mem {
        type Target = [AtomicU64];
        fn deref(&self) -> &[AtomicU64] {
            &self.0
        }
    }

    fn mem(ranks: usize) -> Mem {
        Mem((0..board_bytes(ranks) / 8).map(|_| AtomicU64::new(0)).collect())
    }

    /// Runs `rank(me, board)` for every rank of an `n`-rank board, each on its own thread.
    fn on_ranks(n: usize, rank: impl Fn(usize, Board<Mem>) + Send + Sync + 'static) {
        let (m, rank) = (mem(n), Arc::new(rank));
        let threads: Vec<_> = (0..n)
            .map(|me| {
                let (m, rank) = (m.clone(), rank.clone());
                std::thread::spawn(move || rank(me, Board::attach(m, n, me).unwrap().0))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
    }

    /// Drives the queue until call `seq` is done, as the root crate's futures do: each look tries
    /// [`Queue::finish_now`] first. Gives up after a minute: a rank whose thread panicked never
    /// posts again, and the others must fail rather than spin on forever.
    fn run(q: &mut Queue, b: &Board<Mem>, seq: u64) -> Result<Vec<u8>, CollError> {
        run_with(q, b, seq, true)
    }

    /// [`run`], with or without [`Queue::finish_now`] (`fast`).
    fn run_with(q: &mut Queue, b: &Board<Mem>, seq: u64, fast: bool) -> Result<Vec<u8>, CollError> {
        let start = std::time::Instant::now();
        loop {
            match if fast { q.finish_now(b, seq) } else { None } {
                Some(Some(r)) => return r.map(|d| d.to_vec()),
                Some(None) => {}
                None => {
                    q.advance(b);
                    if let Some(r) = q.take(seq) {
                        return r.map(|d| d.to_vec());
                    }
                }
            }
            assert!(start.elapsed() < std::time::Duration::from_secs(60), "call {seq} never finished");
            std::thread::yield_now();
        }
    }

    fn sum() -> Reducer {
        ReduceOp::<u64>::Sum.erase()
    }

    fn words(v: &[u64]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    /// Found by reading with the `coll_board` fuzz target in mind (the `coll_schedule` target
    /// found the same in the message path): parts of equal length that are not whole elements
    /// (3 bytes of `u32`, as a rank writing garbage on the board may publish) reached the operator,
    /// which panicked. The call now fails with a typed error.
    #[test]
    fn parts_of_partial_elements_are_refused() {
        let m = mem(2);
        let boards: Vec<Board<Mem>> = (0..2).map(|me| Board::attach(m.clone(), 2, me).unwrap().0).collect();
        let mut queues: Vec<Queue> = (0..2).map(|_| Queue::default()).collect();
        let op = || Kind::Allreduce(ReduceOp::<u32>::Sum.erase());
        let seqs: Vec<u64> = (0..2).map(|r| queues[r].push(&boards[r], op(), 3, vec![1, 2, 3]).unwrap()).collect();
        for (r, q) in queues.iter_mut().enumerate() {
            q.advance(&boards[r]);
        }
        for (r, q) in queues.iter_mut().enumerate() {
            q.advance(&boards[r]);
            let got = q.take(seqs[r]).expect("every part is posted");
            assert!(matches!(got, Err(CollError::Malformed { .. })), "{got:?}");
        }
    }

    /// Every rank count 1..=9: many rounds of every kind of call
    /// (more calls than slots, so slots are reused), checked against the sequential result.
    #[test]
    fn rounds_on_threads_match_the_reference() {
        for n in 1..=9usize {
            on_ranks(n, move |me, b| {
                let mut q = Queue::default();
                for round in 0..40u64 {
                    let s = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                    assert!(run(&mut q, &b, s).unwrap().is_empty());
                    let root = (round as usize) % n;
                    let data = words(&[round * 1000 + root as u64, round]);
                    let input = if me == root { data.clone() } else { Vec::new() };
                    let s = q.push(&b, Kind::Bcast { root: root as u32 }, 16, input).unwrap();
                    let want = if me == root { Vec::new() } else { data };
                    assert_eq!(run(&mut q, &b, s).unwrap(), want, "n={n} round={round}");
                    let len = (round as usize * 37) % (capacity(n) / 8);
                    let mine: Vec<u64> = (0..len as u64).map(|i| i * (me as u64 + 1) + round).collect();
                    let s = q.push(&b, Kind::Allreduce(sum()), len * 8, words(&mine)).unwrap();
                    let want: Vec<u64> =
                        (0..len as u64).map(|i| (0..n as u64).map(|r| i * (r + 1) + round).sum::<u64>()).collect();
                    assert_eq!(run(&mut q, &b, s).unwrap(), words(&want), "n={n} round={round}");
                    // 48 bytes: past the 40 that fit in a rank's line.
                    let s = q.push(&b, Kind::Allgather, 48, words(&[me as u64, round, 1, 2, 3, 4])).unwrap();
                    let all: Vec<u64> = (0..n as u64).flat_map(|r| [r, round, 1, 2, 3, 4]).collect();
                    assert_eq!(run(&mut q, &b, s).unwrap(), words(&all), "n={n} round={round}");
                    // Block d of rank s's data: s * 100 + d.
                    let mine: Vec<u64> = (0..n as u64).map(|d| me as u64 * 100 + d + round).collect();
                    let s = q.push(&b, Kind::Alltoall, 8 * n, words(&mine)).unwrap();
                    let want: Vec<u64> = (0..n as u64).map(|s| s * 100 + me as u64 + round).collect();
                    assert_eq!(run(&mut q, &b, s).unwrap(), words(&want), "n={n} round={round}");
                    let root = (round as usize + 1) % n;
                    let op = sum();
                    let s = q.push(&b, Kind::Reduce { root: root as u32, op }, 8, words(&[me as u64 + round])).unwrap();
                    let total: u64 = (0..n as u64).map(|r| r + round).sum();
                    let want = if me == root { words(&[total]) } else { Vec::new() };
                    assert_eq!(run(&mut q, &b, s).unwrap(), want, "n={n} round={round}");
                }
                assert!(q.is_empty());
            });
        }
    }

    /// Every length around the small reads (up to 16 bytes straight into the result's inline
    /// buffer, then the general path): each receiver gets exactly the root's bytes, whatever a
    /// longer earlier call left in the line.
    #[test]
    fn small_parts_of_every_length_arrive_whole() {
        for n in [2, 3] {
            on_ranks(n, move |me, b| {
                let mut q = Queue::default();
                for len in (0..=48).rev().chain(0..=20) {
                    let data: Vec<u8> = (0..len as u8).map(|i| i.wrapping_mul(37) ^ len as u8).collect();
                    let input = if me == 0 { data.clone() } else { Vec::new() };
                    let s = q.push(&b, Kind::Bcast { root: 0 }, len, input).unwrap();
                    let want = if me == 0 { Vec::new() } else { data };
                    assert_eq!(run(&mut q, &b, s).unwrap(), want, "n={n} len={len}");
                }
            });
        }
    }

    /// Blocks of any byte length, in a line or an area: a scatter's root leaves its own block out
    /// (on 2 ranks a block of up to a line's data then goes inline), an all-to-all reads only this
    /// rank's block of each rank, a gather lays the parts end to end; every rank gets its bytes.
    #[test]
    fn blocks_of_every_length_reach_their_ranks() {
        for n in [2, 3] {
            on_ranks(n, move |me, b| {
                let mut q = Queue::default();
                // The next call's number (a call made at once gets no number back).
                let mut posted = 0u64;
                let byte = |from: usize, to: usize, i: usize| (from * 31 + to * 7 + i) as u8;
                for block in [0, 1, 5, 8, 13, 24, 47, 48, 49, 100, 4000] {
                    let len = block * n;
                    for root in 0..n {
                        let all: Vec<u8> = (0..n).flat_map(|to| (0..block).map(move |i| byte(root, to, i))).collect();
                        let input = if me == root { all.clone() } else { Vec::new() };
                        // The root as the root crate makes it: done at once if it can, else queued.
                        let s = if me == root && q.scatter_root_now(&b, &input) {
                            posted += 1;
                            posted - 1
                        } else {
                            let s = q.push(&b, Kind::Scatter { root: root as u32 }, len, input).unwrap();
                            let want = if me == root { Vec::new() } else { all[me * block..(me + 1) * block].to_vec() };
                            assert_eq!(run(&mut q, &b, s).unwrap(), want, "scatter n={n} block={block} root={root}");
                            s
                        };
                        if me == root {
                            // Every block but the root's.
                            assert_eq!(b.line(s, me)[LEN].load(Relaxed) as usize, len - block);
                        }
                        let s = q.push(&b, Kind::Gather { root: root as u32 }, block, all[..block].to_vec()).unwrap();
                        let got = run(&mut q, &b, s).unwrap();
                        posted = s + 1;
                        if me == root {
                            let want: Vec<u8> = (0..n).flat_map(|_| all[..block].to_vec()).collect();
                            assert_eq!(got, want, "gather n={n} block={block}");
                        }
                    }
                    let mine: Vec<u8> = (0..n).flat_map(|to| (0..block).map(move |i| byte(me, to, i))).collect();
                    let s = q.push(&b, Kind::Alltoall, len, mine).unwrap();
                    let want: Vec<u8> = (0..n).flat_map(|from| (0..block).map(move |i| byte(from, me, i))).collect();
                    assert_eq!(run(&mut q, &b, s).unwrap(), want, "all-to-all n={n} block={block}");
                    posted = s + 1;
                }
            });
        }
    }

    /// A barrier lets no rank leave before every rank has arrived, whether every rank reads every
    /// line (2 ranks) or the ranks fan in to rank 0 (more).
    #[test]
    fn barriers_hold_every_rank_until_all_arrive() {
        for n in 1..=9usize {
            let arrived = Arc::new(AtomicU64::new(0));
            on_ranks(n, move |_, b| {
                let mut q = Queue::default();
                for round in 0..200u64 {
                    arrived.fetch_add(1, SeqCst);
                    let s = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                    run(&mut q, &b, s).unwrap();
                    assert!(arrived.load(SeqCst) >= (round + 1) * n as u64, "n={n}: left round {round} early");
                }
            });
        }
    }

    /// Above 2 ranks a barrier fans in to rank 0: rank 0 leaves once all have arrived, and before
    /// any other rank; on 2 ranks the last to arrive leaves at once.
    #[test]
    fn rank_0_leaves_a_fanned_in_barrier_first() {
        for n in [2usize, 3, 5] {
            let m = mem(n);
            let boards: Vec<Board<Mem>> = (0..n).map(|me| Board::attach(m.clone(), n, me).unwrap().0).collect();
            let mut queues: Vec<Queue> = (0..n).map(|_| Queue::default()).collect();
            let mut arrive = |me: usize| queues[me].call_now(&boards[me], Kind::Barrier, 0, &[]).unwrap().1.is_some();
            for me in 0..n - 1 {
                assert!(!arrive(me), "n={n}: rank {me} left before all arrived");
            }
            assert_eq!(arrive(n - 1), n == 2, "n={n}: the last to arrive");
            let mut left = |me: usize| {
                queues[me].advance(&boards[me]);
                queues[me].take(0).is_some()
            };
            if n > 2 {
                assert!((1..n).all(|me| !left(me)), "n={n}: a rank left before rank 0");
            }
            assert!(left(0), "n={n}: rank 0");
            assert!((1..n - 1).all(&mut left), "n={n}: the others");
        }
    }

    /// Broadcasts made as the root crate makes them ([`Queue::root_now`] at the root, else
    /// [`Queue::call_now`]), the root running far ahead of receivers that are late: the root's
    /// calls complete when made while their slots (small calls) or areas (larger ones) are free,
    /// and wait (queued) once they are all in use; every receiver reads every broadcast's data
    /// (those already posted when it calls, at once).
    #[test]
    fn a_root_running_ahead_waits_for_the_slots() {
        for (n, words_per_call, free) in
            [(2usize, 2, SLOTS), (3, 2, SLOTS), (5, 2, SLOTS), (2, 8, AREAS), (3, 8, AREAS)]
        {
            // The receivers start reading once the root has made its calls (a sleep would not
            // do on a loaded machine, where the root's thread may be off the CPU longer).
            let made = Arc::new(std::sync::Barrier::new(n));
            on_ranks(n, move |me, b| {
                let mut q = Queue::default();
                let calls = 3 * free;
                let len = words_per_call * 8;
                let data =
                    move |k: u64| words(&(0..words_per_call as u64).map(|w| k * 1000 + 7 + w).collect::<Vec<_>>());
                for round in 0..4u64 {
                    let root = (round as usize) % n;
                    if me != root {
                        // Late: the root makes its calls before anyone reads.
                        made.wait();
                    }
                    let mut pending = Vec::new();
                    let mut made_done = 0;
                    for k in 0..calls {
                        let input = if me == root { data(k) } else { Vec::new() };
                        if me == root && q.root_now(&b, &input) {
                            made_done += 1;
                            continue;
                        }
                        let (seq, now) = q.call_now(&b, Kind::Bcast { root: root as u32 }, len, &input).unwrap();
                        let want = if me == root { Vec::new() } else { data(k) };
                        match now {
                            Some(r) => {
                                assert_eq!(r.unwrap().to_vec(), want, "n={n} round={round} k={k}");
                                made_done += 1;
                            }
                            None => pending.push((k, seq)),
                        }
                    }
                    if me == root {
                        made.wait();
                        assert!(
                            made_done <= free as usize,
                            "n={n} len={len}: {made_done} calls overwrote slots in use"
                        );
                    }
                    for (k, seq) in pending {
                        let want = if me == root { Vec::new() } else { data(k) };
                        assert_eq!(run(&mut q, &b, seq).unwrap(), want, "n={n} round={round} k={k}");
                    }
                    let s = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                    run(&mut q, &b, s).unwrap();
                }
                assert!(q.is_empty());
            });
        }
    }

    /// More calls in flight than slots, completed in reverse order, one of them dropped unpolled:
    /// advancing any call advances them all, in order, and every result is right.
    #[test]
    fn held_and_abandoned_calls_still_do_their_part() {
        let n = 3;
        on_ranks(n, move |me, b| {
            let mut q = Queue::default();
            let calls = 3 * SLOTS as usize + 1;
            let seqs: Vec<u64> = (0..calls)
                .map(|k| q.push(&b, Kind::Allreduce(sum()), 8, words(&[(me * calls + k) as u64])).unwrap())
                .collect();
            q.abandon(seqs[5]..seqs[5] + 1);
            for (k, &s) in seqs.iter().enumerate().rev().filter(|(k, _)| *k != 5) {
                let want: u64 = (0..n).map(|r| (r * calls + k) as u64).sum();
                assert_eq!(run(&mut q, &b, s).unwrap(), words(&[want]));
            }
            assert!(q.is_empty(), "the abandoned call finished and left: {q:?}");
        });
    }

    /// A small deterministic generator (the same sequence on every rank for the same seed).
    fn next(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// Random schedules: every rank enqueues the same random calls (every kind, roots, lengths
    /// from inline to several pages) in random batches of up to 12 (more than the slots),
    /// collects each batch in its own random order and abandons some calls; every collected result
    /// matches the sequential reference, and the abandoned calls finish.
    #[test]
    fn random_schedules_in_random_orders() {
        for (n, seed) in [(2, 1u64), (3, 7), (5, 11), (8, 23)] {
            on_ranks(n, move |me, b| {
                let mut shared = seed; // same on every rank: the calls
                let mut local = seed * 1000 + me as u64 + 1; // this rank's order and abandons
                let mut q = Queue::default();
                for _ in 0..30 {
                    let batch = 1 + (next(&mut shared) % 12) as usize;
                    let mut calls = Vec::new();
                    for _ in 0..batch {
                        let words_n = [0usize, 1, 6, 7, 100, 1500][(next(&mut shared) % 6) as usize];
                        let root = (next(&mut shared) % n as u64) as usize;
                        let salt = next(&mut shared);
                        let part = |r: usize| -> Vec<u64> {
                            (0..words_n as u64).map(|i| salt ^ (r as u64 * 31 + i)).collect()
                        };
                        let sum_of = |ranks: std::ops::Range<usize>| -> Vec<u64> {
                            (0..words_n)
                                .map(|i| ranks.clone().map(|r| part(r)[i]).fold(0u64, u64::wrapping_add))
                                .collect()
                        };
                        let (kind, input, want) = match next(&mut shared) % 11 {
                            0 => (Kind::Barrier, Vec::new(), Vec::new()),
                            1 => {
                                let want = if me == root { Vec::new() } else { words(&part(root)) };
                                let input = if me == root { words(&part(root)) } else { Vec::new() };
                                (Kind::Bcast { root: root as u32 }, input, want)
                            }
                            2 => {
                                let total: Vec<u64> = (0..words_n)
                                    .map(|i| (0..n).map(|r| part(r)[i]).fold(0u64, u64::wrapping_add))
                                    .collect();
                                (Kind::Allreduce(sum()), words(&part(me)), words(&total))
                            }
                            3 => {
                                let all: Vec<u64> = (0..n).flat_map(part).collect();
                                (Kind::Allgather, words(&part(me)), words(&all))
                            }
                            4 => {
                                // Block d of rank r's data: part(r * n + d), cut so that all blocks fit
                                // one call.
                                let block = |r: usize, d: usize| part(r * n + d)[..words_n.min(500)].to_vec();
                                let mine: Vec<u64> = (0..n).flat_map(|d| block(me, d)).collect();
                                let got: Vec<u64> = (0..n).flat_map(|r| block(r, me)).collect();
                                (Kind::Alltoall, words(&mine), words(&got))
                            }
                            5 => {
                                let op = sum();
                                let total: Vec<u64> = (0..words_n)
                                    .map(|i| (0..n).map(|r| part(r)[i]).fold(0u64, u64::wrapping_add))
                                    .collect();
                                let want = if me == root { words(&total) } else { Vec::new() };
                                (Kind::Reduce { root: root as u32, op }, words(&part(me)), want)
                            }
                            6 => {
                                let all: Vec<u64> = (0..n).flat_map(part).collect();
                                let want = if me == root { words(&all) } else { Vec::new() };
                                (Kind::Gather { root: root as u32 }, words(&part(me)), want)
                            }
                            7 => {
                                (Kind::Scan { op: sum(), inclusive: true }, words(&part(me)), words(&sum_of(0..me + 1)))
                            }
                            8 => {
                                let want = if me == 0 { Vec::new() } else { words(&sum_of(0..me)) };
                                (Kind::Scan { op: sum(), inclusive: false }, words(&part(me)), want)
                            }
                            9 => {
                                // This rank's segment: words `me * words_n / n ..` of the vector.
                                let seg = |r: usize| r * words_n / n..(r + 1) * words_n / n;
                                let want = words(&sum_of(0..n)[seg(me)]);
                                let bytes = seg(me).start * 8..seg(me).end * 8;
                                (Kind::ReduceScatter { op: sum(), part: bytes }, words(&part(me)), want)
                            }
                            _ => {
                                // Block d of the root's data: part(n + d), cut so that all blocks
                                // fit one call.
                                let block = |d: usize| part(n + d)[..words_n.min(500)].to_vec();
                                let all: Vec<u64> = (0..n).flat_map(block).collect();
                                let want = if me == root { Vec::new() } else { words(&block(me)) };
                                let input = if me == root { words(&all) } else { Vec::new() };
                                (Kind::Scatter { root: root as u32 }, input, want)
                            }
                        };
                        let len = match kind {
                            Kind::Barrier => 0,
                            Kind::Alltoall | Kind::Scatter { .. } => words_n.min(500) * 8 * n,
                            _ => words_n * 8,
                        };
                        // Half the calls made at once (posted, perhaps complete), half queued.
                        let (seq, done) = if next(&mut local).is_multiple_of(2) {
                            let (seq, done) = q.call_now(&b, kind, len, &input).unwrap();
                            (seq, done.map(|r| r.map(|d| d.to_vec())))
                        } else {
                            (q.push(&b, kind, len, input).unwrap(), None)
                        };
                        calls.push((seq, want, done));
                    }
                    // This rank's own order; about one call in six abandoned.
                    while !calls.is_empty() {
                        let i = (next(&mut local) % calls.len() as u64) as usize;
                        let (seq, want, done) = calls.swap_remove(i);
                        if next(&mut local).is_multiple_of(6) {
                            if done.is_none() {
                                q.abandon(seq..seq + 1);
                            }
                        } else {
                            let fast = next(&mut local).is_multiple_of(2);
                            let got = done.unwrap_or_else(|| run_with(&mut q, &b, seq, fast));
                            assert_eq!(got, Ok(want), "n={n} seed={seed} seq={seq} rank {me}");
                        }
                    }
                }
                // Abandoned calls finish as later ones are driven; the last ones with a barrier.
                let s = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                run(&mut q, &b, s).unwrap();
                for _ in 0..1000 {
                    q.advance(&b);
                    if q.is_empty() {
                        break;
                    }
                    std::thread::yield_now();
                }
                assert!(q.is_empty(), "abandoned calls finish: {q:?}");
            });
        }
    }

    /// [`Queue::finish_now`] takes only the one queued call, once posted, and waits while a part
    /// it needs is missing; once it has finished, its slot is free for the root's next lap (rule
    /// 2 reads the `finished` counter it published).
    #[test]
    fn finishing_now_takes_only_the_lone_posted_call() {
        let m = mem(2);
        let (root, _) = Board::attach(m.clone(), 2, 0).unwrap();
        let (other, _) = Board::attach(m, 2, 1).unwrap();
        let (mut qr, mut qo) = (Queue::default(), Queue::default());
        let bcast = Kind::Bcast { root: 0 };
        // Queued unposted (pushed, not advanced), then waiting for the root.
        let s = qo.push(&other, bcast.clone(), 8, Vec::new()).unwrap();
        assert!(qo.finish_now(&other, s).is_none(), "not posted yet");
        qo.advance(&other);
        assert!(qo.finish_now(&other, s + 1).is_none(), "another call");
        assert!(matches!(qo.finish_now(&other, s), Some(None)), "the root has not posted");
        // A second call behind it: the general path only.
        let s2 = qo.push(&other, Kind::Barrier, 0, Vec::new()).unwrap();
        assert!(qo.finish_now(&other, s).is_none(), "two calls queued");
        let (_, done) = qr.call_now(&root, bcast.clone(), 8, &words(&[42])).unwrap();
        assert!(done.is_some(), "the root waits for nobody");
        assert_eq!(run_with(&mut qo, &other, s, false).unwrap(), words(&[42]));
        // Driving the broadcast posted rank 1's barrier too: the root's completes when made.
        let (_, done) = qr.call_now(&root, Kind::Barrier, 0, &[]).unwrap();
        assert!(done.is_some());
        assert_eq!(run(&mut qo, &other, s2).unwrap(), Vec::<u8>::new());
        // Laps of the board: every call of rank 1 finishes through `finish_now`, and the root
        // can post again only because those finishes were published.
        for k in 0..3 * SLOTS {
            let (s, done) = qo.call_now(&other, bcast.clone(), 8, &[]).unwrap();
            assert!(done.is_none());
            // `root_now` goes by the counters seen so far; `call_now` reads them again.
            let posted = qr.root_now(&root, &words(&[k]))
                || qr.call_now(&root, bcast.clone(), 8, &words(&[k])).unwrap().1.is_some();
            assert!(posted, "slot of call {s} free");
            assert!(matches!(qo.finish_now(&other, s), Some(Some(Ok(d))) if d.to_vec() == words(&[k])));
            assert!(qo.is_empty());
        }
        // An abandoned call is the general path's.
        let (s, _) = qo.call_now(&other, bcast, 8, &[]).unwrap();
        qo.abandon(s..s + 1);
        assert!(qo.finish_now(&other, s).is_none());
    }

    /// A user operator that is not commutative is applied in rank order on every rank.
    #[test]
    fn rank_order_for_non_commutative_operators() {
        let concat = || ReduceOp::<u64>::custom(|a, x| a.iter_mut().zip(x).for_each(|(a, x)| *a = *a * 10 + x), false);
        on_ranks(4, move |me, b| {
            let mut q = Queue::default();
            let s = q.push(&b, Kind::Allreduce(concat().erase()), 8, words(&[me as u64 + 1])).unwrap();
            assert_eq!(run(&mut q, &b, s).unwrap(), words(&[1234]));
        });
    }

    /// A 2-rank reduce-scatter: each rank posts only the other's segment (its line's length word
    /// says so) and combines it with the segment it kept of its own, in rank order (a
    /// non-commutative operator), for uneven segments inline and in a data area, made at once
    /// ([`Queue::call_now`], the rank's own segment kept though it waits) or queued behind
    /// another call ([`Queue::push`]).
    #[test]
    fn two_rank_reduce_scatter_posts_only_the_other_segment() {
        let concat = || ReduceOp::<u64>::custom(|a, x| a.iter_mut().zip(x).for_each(|(a, x)| *a = *a * 10 + x), false);
        on_ranks(2, move |me, b| {
            let mut q = Queue::default();
            // Words of the vector: rank 0's segment takes `cut` of them, rank 1's the rest.
            for (total, cut) in [(2usize, 1usize), (8, 3), (8, 0), (8, 8), (1000, 499)] {
                for queued in [false, true] {
                    let data: Vec<u64> = (0..total as u64).map(|i| (me as u64 + 1) * 1000 + i).collect();
                    let seg = if me == 0 { 0..cut } else { cut..total };
                    let kind = Kind::ReduceScatter { op: concat().erase(), part: seg.start * 8..seg.end * 8 };
                    let want: Vec<u64> = seg.clone().map(|i| (1000 + i as u64) * 10 + 2000 + i as u64).collect();
                    let (bytes, input) = (total * 8, words(&data));
                    let got = if queued {
                        let barrier = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                        let s = q.push(&b, kind, bytes, input).unwrap();
                        run(&mut q, &b, barrier).unwrap();
                        run(&mut q, &b, s)
                    } else {
                        match q.call_now(&b, kind, bytes, &input).unwrap() {
                            (_, Some(r)) => r.map(|d| d.to_vec()),
                            (s, None) => run(&mut q, &b, s),
                        }
                    };
                    assert_eq!(got.unwrap(), words(&want), "rank {me} total={total} cut={cut} queued={queued}");
                    let other = if me == 0 { total - cut } else { cut };
                    let posted = b.line(q.next - 1, me)[LEN].load(Relaxed) as usize;
                    assert_eq!(posted, other * 8, "rank {me} posts the other's segment only");
                }
            }
            assert!(q.is_empty());
        });
    }

    /// Single copy's steps on the board: a lent descriptor broadcast, then a held fan-in that
    /// posts only once released; a later call passes it meanwhile and completes; the root's
    /// fan-in waits for every rank's release; withdrawal is seen by the others.
    #[test]
    fn held_calls_post_when_released() {
        for n in 1..=5usize {
            on_ranks(n, move |me, b| {
                let mut q = Queue::default();
                let lent = Lent { pid: 1234, addr: 0x7000_0000, len: 100 };
                let input = if me == 0 { lent.encode() } else { Vec::new() };
                let s0 = q.push(&b, Kind::Bcast { root: 0 }, Lent::BYTES, input).unwrap();
                let s1 = q.push_held(Kind::Fanin { root: 0 });
                let s2 = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                let got = run(&mut q, &b, s0).unwrap();
                if me != 0 {
                    assert_eq!(Lent::decode(0, &got, 100), Ok(lent));
                }
                q.advance(&b);
                assert_eq!(q.waiting(&b, s1), Some(Waiting::Caller));
                // The barrier behind the held fan-in passes it, and its result can be collected
                // before it finishes in call order.
                run(&mut q, &b, s2).unwrap();
                q.release(s1);
                assert!(run(&mut q, &b, s1).unwrap().is_empty());
                // An abandoned held call is released: the others' barrier completes.
                let s3 = q.push_held(Kind::Barrier);
                if me == n - 1 {
                    q.abandon(s3..s3 + 1);
                    b.withdraw(s3);
                } else {
                    q.release(s3);
                    run(&mut q, &b, s3).unwrap();
                    assert!(b.withdrawn(n - 1, s3), "rank {me} sees rank {} withdrawn", n - 1);
                    assert!(b.withdrawn(n - 1, s0), "leaving a later call implies leaving this one");
                    assert!(!b.withdrawn(n - 1, s3 + 1), "a later call is not withdrawn");
                }
                let s4 = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                run(&mut q, &b, s4).unwrap();
                assert!(q.is_empty());
            });
        }
    }

    /// A rank that leaves a single-copy call before driving it (its future dropped before its
    /// first poll) posts its part of every step at once ([`Queue::leave`]): the others get its
    /// lent descriptors and pass the held steps though it never drives its queue again. A rank
    /// whose part has not posted is named by [`Queue::awaits_withdrawn`] once it has withdrawn
    /// from the call, and not before. Three ranks, two regions lent each (48 bytes, a line's).
    #[test]
    fn a_rank_leaving_a_lending_call_posts_at_once() {
        let n = 3;
        let m = mem(n);
        let b: Vec<Board<Mem>> = (0..n).map(|me| Board::attach(m.clone(), n, me).unwrap().0).collect();
        let mut q: Vec<Queue> = (0..n).map(|_| Queue::default()).collect();
        let lent = |me: usize, k: u64| Lent { pid: 100 + me as u32, addr: 0x1000 * (k + 1), len: 64 };
        let start = |q: &mut Queue, me: usize| {
            let input: Vec<u8> = [lent(me, 0), lent(me, 1)].iter().flat_map(Lent::encode).collect();
            let first = q.push(&b[me], Kind::Allgather, 2 * Lent::BYTES, input).unwrap();
            for _ in 0..2 {
                q.push_held(Kind::Barrier);
            }
            first
        };
        let firsts: Vec<u64> = (0..n).map(|me| start(&mut q[me], me)).collect();
        let f = firsts[1];
        assert!(firsts.iter().all(|&s| s == f));
        // Rank 1 withdraws and leaves, and is not driven again until the end.
        b[1].withdraw(f);
        q[1].leave(&b[1], f..f + 3);
        let want: Vec<u8> = (0..n).flat_map(|me| [lent(me, 0), lent(me, 1)]).flat_map(|l| l.encode()).collect();
        let others = [0, 2];
        for _ in 0..2 {
            for &r in &others {
                q[r].advance(&b[r]);
            }
        }
        for &r in &others {
            assert_eq!(q[r].take(f).map(|d| d.map(|d| d.to_vec())), Some(Ok(want.clone())), "rank {r}");
            assert!(b[r].withdrawn(1, f), "rank {r} finds rank 1's memory withdrawn");
        }
        // The held steps, released one after the other, pass with rank 1's posts.
        for step in [f + 1, f + 2] {
            for &r in &others {
                q[r].release(step);
            }
            for _ in 0..3 {
                for &r in &others {
                    q[r].advance(&b[r]);
                }
            }
            for &r in &others {
                assert_eq!(q[r].take(step).map(|d| d.map(|d| d.to_vec())), Some(Ok(Vec::new())), "rank {r}");
            }
        }
        assert!(others.iter().all(|&r| q[r].is_empty()));
        // The next call: ranks 0 and 1 post their descriptors, rank 2 has not yet.
        let g = start(&mut q[0], 0);
        assert_eq!(start(&mut q[1], 1), g);
        q[0].advance(&b[0]);
        q[1].advance(&b[1]);
        assert_eq!(q[0].waiting(&b[0], g), Some(Waiting::Rank(2)));
        assert_eq!(q[0].awaits_withdrawn(&b[0], g, g), None, "rank 2 has not withdrawn");
        // Rank 2 withdraws (say its post waits for a slot): the others' step names it.
        assert_eq!(start(&mut q[2], 2), g);
        b[2].withdraw(g);
        assert_eq!(q[0].awaits_withdrawn(&b[0], g, g), Some(2));
        assert_eq!(q[1].awaits_withdrawn(&b[1], g, g), Some(2));
        // Left, its steps post: everything finishes, rank 1's abandoned calls included.
        q[2].leave(&b[2], g..g + 3);
        for &r in &[0, 1] {
            q[r].abandon(g..g + 3);
        }
        for _ in 0..4 {
            for r in 0..n {
                q[r].advance(&b[r]);
            }
        }
        assert!(q.iter().all(Queue::is_empty), "{q:?}");
    }

    /// Calls pass a held call only within a board's worth of slots: with call `h` held, calls up
    /// to `h + SLOTS - 1` post and complete, `h + SLOTS` waits; released, everything finishes in
    /// order and the queue empties.
    #[test]
    fn calls_pass_held_ones_within_the_slots() {
        on_ranks(3, |me, b| {
            let mut q = Queue::default();
            let first = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
            run(&mut q, &b, first).unwrap();
            let h = q.push_held(Kind::Barrier);
            let later: Vec<u64> =
                (1..SLOTS).map(|k| q.push(&b, Kind::Allreduce(sum()), 8, words(&[me as u64 + k])).unwrap()).collect();
            for (k, &s) in (1..SLOTS).zip(&later) {
                assert_eq!(run(&mut q, &b, s).unwrap(), words(&[3 * k + 3]), "call {s} passes held {h}");
            }
            let too_far = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
            q.advance(&b);
            assert_eq!(q.waiting(&b, too_far), Some(Waiting::Earlier), "its slot is the held call's");
            q.release(h);
            run(&mut q, &b, h).unwrap();
            run(&mut q, &b, too_far).unwrap();
            assert!(q.is_empty(), "{q:?}");
        });
    }

    #[test]
    fn parts_and_lent_descriptors() {
        for (len, elem, ranks) in [(0, 4, 3), (4, 4, 3), (100, 4, 3), (1 << 20, 8, 7), (12, 1, 12), (13, 2, 4)] {
            let parts: Vec<_> = (0..ranks).map(|i| part(len, elem, ranks, i)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[ranks - 1].end, len / elem * elem);
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert!(w[0].len() >= w[1].len() && w[0].len() - w[1].len() <= elem);
            }
            assert!(parts.iter().all(|p| p.start % elem == 0));
        }
        let lent = Lent { pid: 42, addr: 0x1000, len: 64 };
        assert_eq!(Lent::decode(3, &lent.encode(), 64), Ok(lent));
        assert!(matches!(Lent::decode(3, &lent.encode(), 65), Err(CollError::Malformed { from: 3, .. })));
        assert!(Lent::decode(3, &lent.encode()[..16], 64).is_err());
        assert!(Lent::decode(3, &Lent { pid: 0, ..lent }.encode(), 64).is_err());
        assert!(Lent::decode(3, &Lent { addr: u64::MAX, ..lent }.encode(), 64).is_err());
    }

    #[test]
    fn every_length_round_trips_through_a_line_and_an_area() {
        let m = mem(2);
        let (b0, _) = Board::attach(m.clone(), 2, 0).unwrap();
        let (b1, _) = Board::attach(m, 2, 1).unwrap();
        let mut out = Data::new();
        for (seq, len) in (0..=INLINE + 17).chain([4096, capacity(2)]).enumerate() {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
            b0.write(seq as u64, &data);
            b1.read(seq as u64, 0, &mut out).unwrap();
            assert_eq!(&out[..], &data[..], "length {len}");
        }
    }

    #[test]
    fn refusals() {
        let m = mem(2);
        assert!(Board::attach(m.clone(), 3, 0).is_err(), "too small for 3 ranks");
        let (b, attached) = Board::attach(m.clone(), 2, 0).unwrap();
        assert_eq!(attached, 1);
        assert!(Board::attach(m.clone(), 1, 0).is_err(), "rank count differs from the board's");
        assert!(Board::attach(m.clone(), 2, 2).is_err(), "no such rank");
        let mut q = Queue::default();
        assert!(q.push(&b, Kind::Barrier, capacity(2) + 1, Vec::new()).is_err());
        // The root publishes 8 bytes, rank 1 expects 16: a typed error, the slot still finishes.
        let (b1, _) = Board::attach(m.clone(), 2, 1).unwrap();
        let mut q1 = Queue::default();
        let s0 = q.push(&b, Kind::Bcast { root: 0 }, 8, vec![1; 8]).unwrap();
        let s1 = q1.push(&b1, Kind::Bcast { root: 0 }, 16, Vec::new()).unwrap();
        assert!(run(&mut q, &b, s0).unwrap().is_empty(), "the root gets nothing back");
        assert!(matches!(run(&mut q1, &b1, s1), Err(CollError::Malformed { from: 0, .. })));
        // A length word beyond the capacity (a corrupt board) is refused, not followed.
        b.line(s0 + 1, 0)[LEN].store(u64::MAX, Relaxed);
        let mut out = Data::new();
        assert!(b1.read(s0 + 1, 0, &mut out).is_err());
        // Waiting names the rank that has not posted.
        let s = q1.push(&b1, Kind::Barrier, 0, Vec::new()).unwrap();
        q1.advance(&b1);
        assert_eq!(q1.waiting(&b1, s), Some(Waiting::Rank(0)));
    }

    /// Split offers: the owner claims only an open offer of its own call; the reader takes back
    /// an offer nobody claimed, and sees a claimed one through to written or failed. Rank 1 offers
    /// for calls 0..200 while rank 0 tries to claim each (and some of the previous call's).
    #[test]
    fn split_offers_are_claimed_or_taken_back_once() {
        on_ranks(2, |me, b| {
            let mut q = Queue::default();
            for call in 0..200u64 {
                if me == 1 {
                    assert_eq!(b.offered(call), None);
                    b.offer(call, 0x1000 + call, 42);
                    std::thread::yield_now();
                    let mut now = b.take_back(call).expect("an offer of this call");
                    while now == Offer::Claimed {
                        std::thread::yield_now();
                        now = b.offered(call).unwrap();
                    }
                    assert!(matches!(now, Offer::TakenBack | Offer::Written | Offer::Failed), "{now:?}");
                } else {
                    assert_eq!(b.claim(1, call + 1), None, "an offer of another call");
                    for _ in 0..50 {
                        if let Some((dst, pid)) = b.claim(1, call) {
                            assert_eq!((dst, pid), (0x1000 + call, 42));
                            assert_eq!(b.claim(1, call), None, "claimed once");
                            b.written(1, call, call % 3 != 0);
                            break;
                        }
                        std::thread::yield_now();
                    }
                }
                // Both ranks end each round together.
                let s = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                run(&mut q, &b, s).unwrap();
            }
        });
    }

    /// Pushes: rank 0 opens one to each other rank for calls 0..200 and takes each back unless
    /// claimed, seeing a claimed one through to written or failed; each owner claims at most once
    /// and only its own call's push; an owner that moved on to a later call keeps its state.
    #[test]
    fn pushes_are_claimed_or_taken_back_once() {
        on_ranks(4, |me, b| {
            let mut q = Queue::default();
            for call in 0..200u64 {
                if me == 0 {
                    for k in 1..4 {
                        assert_eq!(b.push_state(k, call), None);
                        assert!(b.open_push(k, call));
                    }
                    std::thread::yield_now();
                    for k in 1..4 {
                        let mut now = b.take_back_push(k, call).expect("a push of this call");
                        while now == Offer::Claimed {
                            std::thread::yield_now();
                            now = b.push_state(k, call).unwrap();
                        }
                        assert!(matches!(now, Offer::TakenBack | Offer::Written | Offer::Failed), "{now:?}");
                    }
                } else {
                    assert_eq!(b.claim_push(call + 1), None, "a push of another call");
                    for _ in 0..50 {
                        match b.claim_push(call) {
                            Some(true) => {
                                assert_eq!(b.claim_push(call), Some(false), "claimed once");
                                b.pushed(call, call % 3 != 0);
                                break;
                            }
                            Some(false) => break,
                            None => std::thread::yield_now(),
                        }
                    }
                }
                let s = q.push(&b, Kind::Barrier, 0, Vec::new()).unwrap();
                run(&mut q, &b, s).unwrap();
            }
            // A later call's state is not taken over by an earlier call's push.
            if me == 1 {
                b.own(1, PUSH).store(Offer::Claimed.word(500), Release);
                assert!(!b.open_push(1, 400));
                assert_eq!(b.take_back_push(1, 400), None);
            }
        });
    }
}
