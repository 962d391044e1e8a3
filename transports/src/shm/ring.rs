//! One single-producer/single-consumer byte ring, and the framing that runs over it.
//!
//! The ring is a byte stream: `head` and `tail` are monotonic u64 byte counters (never reduced
//! modulo the capacity, so "full" and "empty" are never ambiguous), each on its own cache line. The
//! producer copies bytes in and publishes them with a release store of `head`; the consumer gives
//! the space back with a release store of `tail`. A frame of any size passes through a ring of any
//! size: a frame that does not fit streams through, and [`Inbox`] takes partial payloads.
//!
//! **Stamped frames.** Each frame is an 8-byte stamp, the header, then the payload. The stamp and
//! header never straddle two cache lines, so never the ring's end either ([`frame_start`]); a body
//! longer than a line starts on the next line ([`body_start`]). The stamp is stored last (release):
//! it names the frame's stream position (so no stale bytes of an earlier lap can pass for it, mixed
//! with a per-ring key so no payload can either) and says whether the whole frame is in the ring. A
//! waiting consumer polls the stamp where the next frame will start, not `head`: a small message
//! then costs one cache-line transfer (the frame's own), as in the "fast boxes" of MPI libraries,
//! instead of two (`head`, then the frame). `head` is still published after every write; the
//! consumer reads it only for a frame streaming through (stamped "partial", published in 32 KiB
//! pieces so that both sides copy at once) and before sleeping.
//!
//! **Lazy release.** The consumer publishes `tail` only when a quarter of the ring is consumed
//! unpublished, when it streamed a partial frame (the producer may be waiting for that space), or
//! when it consumed a single-copy descriptor; and fences (to see whether the producer sleeps) only
//! then. A producer that lacks space lacks less than a frame's start (at most 119 bytes), so by the
//! time the consumer has taken everything in the ring, more than a quarter is unpublished.
//!
//! A `Data` frame of at least the consumer's single-copy threshold travels as header + 32-byte
//! descriptor (source address and length in the producer's memory); the consumer copies the
//! payload straight into the sink's buffer ([`Remote::read`]), and for large ones the producer
//! copies the second half meanwhile ([`Split`], [`Outbox::help`]). The producer keeps the source
//! alive until `tail` passes the descriptor, which the consumer only allows once the copy is
//! finished: the tail counter doubles as the acknowledgement.
//!
//! Sleeping is Dekker-style, with a sequentially consistent fence on both sides:
//! * consumer: `sleeping = 1; fence; re-check head` — producer: `publish head; fence; read sleeping`;
//! * producer: `prod_wait = 1; fence; re-check tail` — consumer: `publish tail; fence; read prod_wait`.
//!
//! Either the sleeper sees the other side's progress, or the other side sees the flag and rings the
//! doorbell. Whoever swaps a flag from 1 to 0 rings, so a sleeper is rung once.
//!
//! Everything here is generic over [`Atomics`], so the model-checking test (`model.rs`) runs this
//! very code under a scheduler that explores interleavings.
//!
//! The small-message path (`parse`, `write_now` and their steps) is `#[inline(always)]`, so that
//! a progress round and a direct write are one function each: see the protocol engine's module
//! documentation for why.

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{self, AcqRel, Acquire, Relaxed, Release};

use bytes::{Bytes, BytesMut};

use super::stream;
use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, WireError};
use crate::{Sink, TransportError};

/// Size of the descriptor that replaces the payload of a single-copy `Data` frame: the source's
/// address and length in the producer's memory, then the split copy's two words (see [`Split`]).
pub(crate) const DESC_LEN: usize = 32;
/// Offsets in a descriptor of the destination of the split copy's second half, and of its state.
const DESC_DST: u64 = 16;
const DESC_STATE: u64 = 24;

crate::wire_enum! {
    /// States of a single-copy descriptor's split: large copies are done half by each side, at once
    /// (4 MiB between two processes: `process_vm_readv` alone about 10 GB/s, the receiver reading one
    /// half while the sender writes the other about 25 GB/s; `ferrocomm-bench shm-transport`).
    ///
    /// The consumer stores where the second half goes, then `Offered`, and copies the first half; then
    /// it takes the second half back (`Offered` -> `Mine`) unless the producer took it first (`Offered`
    /// -> `Claimed`, then `Done` or `Failed` once written). A claimed half is always being written by a
    /// running process, so the consumer waits for it (or for that process's death) before it lets go
    /// of the destination; nobody waits for a half nobody has claimed.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub(crate) enum Split: u64 {
        None = 0,
        Offered = 1,
        Mine = 2,
        Claimed = 3,
        Done = 4,
        Failed = 5,
    }
}

/// Bytes of a frame's stamp, which comes before its header.
const STAMP_LEN: u64 = 8;
/// A frame's stamp and header, which are always written and read whole.
const FRAME_HDR: u64 = STAMP_LEN + HEADER_LEN as u64;
/// The cache line a frame's stamp and header never straddle.
const LINE: u64 = 64;
/// A frame streaming through the ring is published in pieces of at most this many bytes.
const STREAM_PIECE: u64 = 32 * 1024;
/// Smallest ring: a frame's stamp and header fit in it.
pub(crate) const MIN_RING: usize = LINE as usize;

/// Where the frame after stream position `end` starts: 8-byte aligned (the stamp is an atomic
/// word), and with its stamp and header inside one cache line (so inside the ring, never
/// wrapping). Both sides compute it; the bytes skipped belong to the frame before.
#[inline]
pub(crate) fn frame_start(end: u64) -> u64 {
    let at = (end + 7) & !7;
    if LINE - at % LINE < FRAME_HDR { (at + LINE - 1) & !(LINE - 1) } else { at }
}

/// Where the body (payload or descriptor) of `len` bytes of the frame at `at` starts: right after
/// the header when small (an 8-byte body shares the header's line), else on the next cache line.
/// `memcpy` (`rep movsb`) copies from or to a misaligned ring several times slower (16 KiB bodies:
/// about 3x).
#[inline]
pub(crate) fn body_start(at: u64, len: u64) -> u64 {
    let after = at + FRAME_HDR;
    if len <= LINE { after } else { (after + LINE - 1) & !(LINE - 1) }
}

/// The stamp of the frame at stream position `at`: whole (payload in the ring too) or partial.
/// Never 0 (a fresh ring), never another position's, and masked by the ring's random key.
#[inline]
fn stamp(at: u64, whole: bool, key: u64) -> u64 {
    ((at << 2) | 2 | whole as u64) ^ (key & !3)
}

/// Asks for the cache line of `p` with intent to write (x86-64 `prefetchw`; nothing elsewhere).
#[inline(always)]
fn prefetch_for_write(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads and writes no memory and never faults, whatever the address;
    // `prefetchw` decodes as a no-op on processors without it.
    unsafe {
        std::arch::asm!("prefetchw [{0}]", in(reg) p, options(nostack, readonly, preserves_flags));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// A 64-bit atomic word (std's in shared memory, the model checker's in tests).
pub(crate) trait Word {
    fn load(&self, o: Ordering) -> u64;
    fn store(&self, v: u64, o: Ordering);
    fn swap(&self, v: u64, o: Ordering) -> u64;
    /// Compare and exchange, acquire-release.
    fn cas(&self, current: u64, new: u64) -> Result<u64, u64>;
}

/// The atomics the protocol is written against.
pub(crate) trait Atomics {
    type W: Word;
    /// A sequentially consistent fence.
    fn fence();
    /// Called before each copy into or out of the ring: lets the model checker switch threads
    /// there, so that bytes copied outside the protocol's window show up as torn frames.
    #[inline(always)]
    fn before_copy() {}
}

/// The real thing: std atomics living in the shared mapping.
pub(crate) struct Std;

impl Word for AtomicU64 {
    #[inline]
    fn load(&self, o: Ordering) -> u64 {
        AtomicU64::load(self, o)
    }
    #[inline]
    fn store(&self, v: u64, o: Ordering) {
        AtomicU64::store(self, v, o)
    }
    #[inline]
    fn swap(&self, v: u64, o: Ordering) -> u64 {
        AtomicU64::swap(self, v, o)
    }
    #[inline]
    fn cas(&self, current: u64, new: u64) -> Result<u64, u64> {
        AtomicU64::compare_exchange(self, current, new, AcqRel, Acquire)
    }
}

impl Atomics for Std {
    type W = AtomicU64;
    /// A full barrier. On x86-64 a locked read-modify-write (here of the word at the stack
    /// pointer, or-ing in nothing) orders every earlier load and store before every later one,
    /// as `mfence` does for ordinary write-back memory (which is all the rings use), at a fraction
    /// of its cost (8 against 33 ns on a 2-CPU VM). Linux's `smp_mb()` is
    /// the same instruction. The fence is on the latency path: a consumer fences after each
    /// release of ring space, a producer after each publication.
    #[inline(always)]
    fn fence() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: rewrites the word at the top of our own stack with its own value, atomically;
        // the asm may touch memory, so the compiler keeps every access on its side of it.
        unsafe {
            std::arch::asm!("lock or qword ptr [rsp], 0", options(nostack));
        }
        #[cfg(not(target_arch = "x86_64"))]
        std::sync::atomic::fence(Ordering::SeqCst)
    }
}

/// One word alone on a cache line (128 bytes: adjacent-line prefetchers pull pairs of 64).
#[repr(C, align(128))]
pub(crate) struct Line<W>(pub W);

/// Rarely written words of a ring, sharing one line.
#[repr(C, align(128))]
pub(crate) struct Ctl<W> {
    /// Nonzero once either side has closed the connection.
    pub closed: W,
    /// Set (release) by the consumer when it has connected; the producer writes nothing before.
    pub ready: W,
    /// Written before `ready`: `Data` frames of at least this many bytes go by descriptor; 0: none.
    pub cma_threshold: W,
    /// Written before `ready`: the random key that masks this ring's frame stamps.
    pub stamp_key: W,
}

/// The header of one ring; the `capacity` data bytes follow it.
#[repr(C)]
pub(crate) struct RingHdr<W> {
    /// Bytes ever published by the producer.
    pub head: Line<W>,
    /// Bytes ever released by the consumer.
    pub tail: Line<W>,
    /// The producer sleeps until `tail` moves.
    pub prod_wait: Line<W>,
    pub ctl: Ctl<W>,
}

/// Size of [`RingHdr`] in shared memory.
pub(crate) const RING_HDR_LEN: usize = 512;
const _: () = assert!(std::mem::size_of::<RingHdr<AtomicU64>>() == RING_HDR_LEN);

/// Where a ring lives. Plain pointers: the owner keeps the mapping alive as long as the `Ring`.
pub(crate) struct Ring<A: Atomics> {
    hdr: *const RingHdr<A::W>,
    data: *mut u8,
    /// The ring's 8-byte words as atomics: `data` itself in shared memory, a side array in the
    /// model checkers (whose atomics are not plain words).
    words: *const A::W,
    cap: u64,
}

// SAFETY: the pointers refer to shared memory (or the model's heap) that outlives the ring, and
// all concurrent access goes through atomics or through byte ranges the protocol hands over.
unsafe impl<A: Atomics> Send for Ring<A> {}

impl<A: Atomics> Ring<A> {
    /// # Safety
    /// `hdr` must point to a valid `RingHdr`, `data` to `cap` bytes (a power of two, at least
    /// [`MIN_RING`]) and `words` to `cap / 8` atomic words standing for them, all valid for as
    /// long as the ring is used.
    pub(super) unsafe fn new(hdr: *const RingHdr<A::W>, data: *mut u8, words: *const A::W, cap: usize) -> Ring<A> {
        debug_assert!(cap.is_power_of_two() && cap >= MIN_RING);
        Ring { hdr, data, words, cap: cap as u64 }
    }

    /// The word at stream position `at` (8-byte aligned): a frame's stamp, a descriptor's word.
    #[inline]
    fn word(&self, at: u64) -> &A::W {
        debug_assert!(at.is_multiple_of(8));
        // SAFETY: `at % cap / 8 < cap / 8` words (see `new`).
        unsafe { &*self.words.add(((at & (self.cap - 1)) / 8) as usize) }
    }

    #[inline]
    pub(super) fn hdr(&self) -> &RingHdr<A::W> {
        // SAFETY: see `new`.
        unsafe { &*self.hdr }
    }

    /// Whether either side closed the connection.
    pub(super) fn closed(&self) -> bool {
        self.hdr().ctl.closed.load(Acquire) != 0
    }

    /// Marks the connection closed (seen by both sides).
    pub(super) fn close(&self) {
        self.hdr().ctl.closed.store(1, Release);
    }

    /// Copies `src` to stream position `pos` (wrapping); with `nt`, by non-temporal stores,
    /// ordered before the caller's next store (the publishing one).
    #[inline]
    fn write_at(&self, pos: u64, src: &[u8], nt: bool) {
        A::before_copy();
        let off = (pos & (self.cap - 1)) as usize;
        let first = src.len().min(self.cap as usize - off);
        // SAFETY: `off + first <= cap` and `src.len() - first <= cap - first`; the range lies in
        // the free part of the ring, which the consumer does not read.
        unsafe {
            stream::copy(self.data.add(off), src.as_ptr(), first, nt);
            stream::copy(self.data, src.as_ptr().add(first), src.len() - first, nt);
        }
    }

    /// Writes a frame header at stream position `pos`: a fixed-size copy, inlined, since a header
    /// never wraps ([`frame_start`]).
    #[inline]
    fn write_header(&self, pos: u64, header: &[u8; HEADER_LEN]) {
        A::before_copy();
        let off = (pos & (self.cap - 1)) as usize;
        assert!(off + HEADER_LEN <= self.cap as usize, "a frame header never wraps");
        // SAFETY: in bounds (just checked), in the free part of the ring as in `write_at`.
        unsafe { std::ptr::copy_nonoverlapping(header.as_ptr(), self.data.add(off), HEADER_LEN) }
    }

    /// [`Ring::write_at`] for a body of 4 to 16 bytes that does not wrap, by two overlapping word
    /// copies inlined instead of calls to `memcpy` (the 8 B message's path); anything else by
    /// `write_at`.
    #[inline(always)]
    fn write_small(&self, pos: u64, src: &[u8]) {
        let off = (pos & (self.cap - 1)) as usize;
        let len = src.len();
        if !(4..=16).contains(&len) || off + len > self.cap as usize {
            return self.write_at(pos, src, false);
        }
        A::before_copy();
        // SAFETY: `off + len <= cap`; each word copy covers the first or the last 8 (or 4) of the
        // `len >= 8` (or `>= 4`) bytes of `src` and of the destination range, which lies in the
        // ring's free part as in `write_at`.
        unsafe {
            let dst = self.data.add(off);
            if len >= 8 {
                let (a, b) = (
                    (src.as_ptr() as *const u64).read_unaligned(),
                    (src.as_ptr().add(len - 8) as *const u64).read_unaligned(),
                );
                (dst as *mut u64).write_unaligned(a);
                (dst.add(len - 8) as *mut u64).write_unaligned(b);
            } else {
                let (a, b) = (
                    (src.as_ptr() as *const u32).read_unaligned(),
                    (src.as_ptr().add(len - 4) as *const u32).read_unaligned(),
                );
                (dst as *mut u32).write_unaligned(a);
                (dst.add(len - 4) as *mut u32).write_unaligned(b);
            }
        }
    }

    /// The `len` bytes at stream position `pos`, if they do not wrap around the end of the ring.
    /// The caller must own that range (published, not yet released) for as long as it is used.
    #[inline]
    fn bytes_at(&self, pos: u64, len: usize) -> Option<&[u8]> {
        let off = (pos & (self.cap - 1)) as usize;
        (off + len <= self.cap as usize).then(|| {
            A::before_copy();
            // SAFETY: `off + len <= cap`; the range is published and unreleased, so the producer
            // does not write it while the slice lives (the caller releases it only afterwards).
            unsafe { std::slice::from_raw_parts(self.data.add(off), len) }
        })
    }

    /// Copies from stream position `pos` (wrapping) into `dst`.
    #[inline]
    fn read_at(&self, pos: u64, dst: &mut [u8]) {
        A::before_copy();
        let off = (pos & (self.cap - 1)) as usize;
        let first = dst.len().min(self.cap as usize - off);
        // SAFETY: as in `write_at`; the range lies in the published, unreleased part.
        unsafe {
            std::ptr::copy_nonoverlapping(self.data.add(off), dst.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(self.data, dst.as_mut_ptr().add(first), dst.len() - first);
        }
    }
}

/// A counter in shared memory holds a value the protocol forbids.
fn corrupt(what: &'static str) -> TransportError {
    tracing::debug!("shared-memory ring corrupt: {what}");
    TransportError::Io(std::io::ErrorKind::InvalidData)
}

/// Takes a flag that a sleeper set: true if this caller must ring the sleeper's doorbell.
#[inline]
pub(crate) fn take_flag<W: Word>(flag: &W) -> bool {
    flag.load(Relaxed) != 0 && flag.swap(0, Relaxed) != 0
}

struct Item {
    header: [u8; HEADER_LEN],
    is_data: bool,
    payload: Bytes,
}

impl Item {
    fn desc_bytes(&self) -> [u8; DESC_LEN] {
        let mut d = [0u8; DESC_LEN];
        d[..8].copy_from_slice(&(self.payload.as_ptr() as u64).to_le_bytes());
        d[8..16].copy_from_slice(&(self.payload.len() as u64).to_le_bytes());
        d[DESC_STATE as usize..].copy_from_slice(&(Split::None as u64).to_le_bytes());
        d
    }

    /// Whether it travels as a descriptor, given the consumer's single-copy threshold.
    fn by_desc(&self, threshold: u64) -> bool {
        self.is_data && threshold > 0 && self.payload.len() as u64 >= threshold
    }

    /// Bytes after the header: the payload or its descriptor.
    fn body_len(&self, threshold: u64) -> u64 {
        if self.by_desc(threshold) { DESC_LEN as u64 } else { self.payload.len() as u64 }
    }

    /// Calls `f` with the bytes after the header.
    fn with_body<R>(&self, threshold: u64, f: impl FnOnce(&[u8]) -> R) -> R {
        if self.by_desc(threshold) { f(&self.desc_bytes()) } else { f(&self.payload) }
    }
}

/// What one [`Outbox::flush`] did.
#[derive(Default, Debug)]
pub(crate) struct Flushed {
    /// Steps of progress (bytes published, sources released).
    pub work: usize,
    /// The consumer is asleep: ring its doorbell.
    pub ring: bool,
    /// Frames sent by descriptor / streamed `Data` frames (statistics).
    pub descs: u64,
    pub streamed: u64,
}

/// What the consumer told the producer when it connected.
#[derive(Clone, Copy)]
struct Peer {
    /// `Data` frames of at least this many bytes go by descriptor (0: none).
    threshold: u64,
    key: u64,
}

/// The producer side of one ring: the ordered output queue and the write cursor.
#[derive(Default)]
pub(crate) struct Outbox {
    queue: VecDeque<Item>,
    /// Body bytes of the front item already in the ring, once its header is (`None`: not started).
    sent: Option<u64>,
    /// Next write position (published at the end of each flush).
    head: u64,
    /// Last `tail` read from the consumer.
    tail: u64,
    /// `None` until the consumer is ready.
    peer: Option<Peer>,
    /// Bodies of at least this many bytes are copied in with non-temporal stores (0: none).
    nt_min: usize,
    /// Single-copy sources the consumer may still be reading: (stream end of the descriptor, bytes).
    inflight: VecDeque<(u64, Bytes)>,
    /// Payload length of the last frame [`Outbox::write_now`] wrote: the guess at the next one's.
    last_len: u64,
}

impl Outbox {
    /// An empty outbox that copies bodies of at least `nt_min` bytes with non-temporal stores
    /// (0: none; see [`stream`]).
    pub(super) fn new(nt_min: usize) -> Outbox {
        Outbox { nt_min, ..Outbox::default() }
    }

    /// Whether a body of `len` bytes is copied in with non-temporal stores.
    fn nt(&self, len: usize) -> bool {
        self.nt_min != 0 && len >= self.nt_min
    }

    pub(super) fn push(&mut self, h: &Header, payload: Bytes) {
        self.queue.push_back(Item { header: h.encode(), is_data: h.kind == Kind::Data, payload });
    }

    /// Frames not yet (wholly) in the ring.
    pub(super) fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Frames not yet in the ring, or sources the consumer may still be copying.
    pub(super) fn pending(&self) -> bool {
        !self.queue.is_empty() || !self.inflight.is_empty()
    }

    #[inline(always)]
    fn refresh_tail<A: Atomics>(&mut self, ring: &Ring<A>) -> Result<(), TransportError> {
        let t = ring.hdr().tail.0.load(Acquire);
        if t < self.tail || t > self.head || self.head - t > ring.cap {
            return Err(corrupt("tail"));
        }
        self.tail = t;
        Ok(())
    }

    /// Free bytes in the ring; reads `tail` again if fewer than `want` seem free.
    #[inline(always)]
    fn free<A: Atomics>(&mut self, ring: &Ring<A>, want: u64) -> Result<u64, TransportError> {
        if ring.cap - (self.head - self.tail) < want {
            self.refresh_tail(ring)?;
        }
        Ok(ring.cap - (self.head - self.tail))
    }

    /// Bytes the next step of the front frame needs: its stamp and header with the padding
    /// around them, or one byte of its body.
    fn need(&self, peer: Peer) -> u64 {
        match (self.sent, self.queue.front()) {
            (None, Some(item)) => {
                let at = frame_start(self.head);
                body_start(at, item.body_len(peer.threshold)) - self.head
            }
            _ => 1,
        }
    }

    fn release<A: Atomics>(&mut self, ring: &Ring<A>) -> Result<usize, TransportError> {
        if self.inflight.is_empty() {
            return Ok(0);
        }
        self.refresh_tail(ring)?;
        let mut n = 0;
        while self.inflight.front().is_some_and(|(end, _)| *end <= self.tail) {
            self.inflight.pop_front();
            n += 1;
        }
        Ok(n)
    }

    /// Whether the consumer has connected; learns its single-copy threshold and stamp key.
    fn ready<A: Atomics>(&mut self, ring: &Ring<A>) -> Option<Peer> {
        if self.peer.is_none() && ring.hdr().ctl.ready.load(Acquire) != 0 {
            let ctl = &ring.hdr().ctl;
            self.peer = Some(Peer { threshold: ctl.cma_threshold.load(Relaxed), key: ctl.stamp_key.load(Relaxed) });
        }
        self.peer
    }

    /// The front frame is wholly in the ring: takes it off the queue.
    fn finish(&mut self, peer: Peer, out: &mut Flushed) {
        let item = self.queue.pop_front().expect("front item");
        self.sent = None;
        if item.by_desc(peer.threshold) {
            out.descs += 1;
            self.inflight.push_back((self.head, item.payload));
        } else if item.is_data {
            out.streamed += 1;
        }
    }

    /// Writes as much of the queue as fits and publishes it; releases single-copy sources the
    /// consumer is done with. `sleeping` is the consumer's sleeping flag.
    pub(super) fn flush<A: Atomics>(&mut self, ring: &Ring<A>, sleeping: &A::W) -> Result<Flushed, TransportError> {
        let mut out = Flushed { work: self.release(ring)?, ..Flushed::default() };
        if self.queue.is_empty() {
            return Ok(out);
        }
        let Some(peer) = self.ready(ring) else { return Ok(out) };
        let start = self.head;
        while !self.queue.is_empty() {
            let Some(done) = self.sent else {
                // Start the front frame: stamp and header always; the body too if it all fits.
                let item = self.queue.front().expect("not empty");
                let body = item.body_len(peer.threshold);
                let at = frame_start(self.head);
                let body_at = body_start(at, body);
                let need = body_at - self.head;
                let free = self.free(ring, need + body)?;
                if free < need {
                    break;
                }
                let item = self.queue.front().expect("not empty");
                ring.write_at(at + STAMP_LEN, &item.header, false);
                let whole = free >= need + body;
                if whole {
                    item.with_body(peer.threshold, |b| ring.write_at(body_at, b, self.nt(b.len())));
                }
                ring.word(at).store(stamp(at, whole, peer.key), Release);
                self.head = body_at;
                if whole {
                    self.head += body;
                    self.finish(peer, &mut out);
                } else {
                    self.sent = Some(0);
                }
                continue;
            };
            // Stream the front frame's body as space allows, publishing each piece so that the
            // consumer copies one while this side copies the next.
            let free = self.free(ring, 1)?;
            if free == 0 {
                break;
            }
            let item = self.queue.front().expect("not empty");
            let (n, len) = item.with_body(peer.threshold, |b| {
                let n = (b.len() as u64 - done).min(free).min(STREAM_PIECE);
                ring.write_at(self.head, &b[done as usize..(done + n) as usize], self.nt(n as usize));
                (n, b.len() as u64)
            });
            self.head += n;
            ring.hdr().head.0.store(self.head, Release);
            if done + n == len {
                self.finish(peer, &mut out);
            } else {
                self.sent = Some(done + n);
            }
        }
        if self.head != start {
            self.publish(ring, sleeping, &mut out);
        }
        Ok(out)
    }

    /// Publishes `head` after frames were written: the consumer may be about to sleep, so the
    /// caller must ring its doorbell if `out.ring`.
    #[inline(always)]
    fn publish<A: Atomics>(&self, ring: &Ring<A>, sleeping: &A::W, out: &mut Flushed) {
        ring.hdr().head.0.store(self.head, Release);
        A::fence();
        out.ring = take_flag(sleeping);
        out.work += 1;
    }

    /// The latency path: writes a small frame straight from `payload` into the ring and
    /// publishes it, when nothing is queued before it and the whole frame fits now. `None`:
    /// it was not written (the caller queues it with [`Outbox::push`]); so also before the
    /// consumer is known (its stamp key), for `Data` frames (streamed or by descriptor), for bodies
    /// due for non-temporal copies, and while single-copy sources are in flight (the queue's
    /// flush releases them).
    #[inline(always)]
    pub(super) fn write_now<A: Atomics>(
        &mut self,
        ring: &Ring<A>,
        sleeping: &A::W,
        h: &Header,
        payload: &[u8],
    ) -> Option<Result<Flushed, TransportError>> {
        let peer = self.peer?;
        if !self.queue.is_empty() || !self.inflight.is_empty() || h.kind == Kind::Data || self.nt(payload.len()) {
            return None;
        }
        let at = frame_start(self.head);
        let end = body_start(at, payload.len() as u64) + payload.len() as u64;
        match self.free(ring, end - self.head) {
            Ok(free) if free >= end - self.head => {}
            Ok(_) => return None,
            Err(e) => return Some(Err(e)),
        }
        ring.write_header(at + STAMP_LEN, &h.encode());
        ring.write_small(body_start(at, payload.len() as u64), payload);
        ring.word(at).store(stamp(at, true, peer.key), Release);
        self.head = end;
        self.last_len = payload.len() as u64;
        let mut out = Flushed::default();
        self.publish(ring, sleeping, &mut out);
        Some(Ok(out))
    }

    /// Asks for the cache line of the next frame in the exclusive state (see
    /// [`Outbox::next_line`]). Called when a frame came from the consumer: a reply is likely.
    ///
    /// The consumer, waiting for that reply, keeps polling the line, so the reply's first store
    /// would wait for the line to be taken back from it (a cross-core request), and the
    /// consumer's next look for the line to come back (a second one). Asked for now, the first
    /// request overlaps with the work before the reply (8 B one way through the async API about
    /// 11 ns faster: `ferrocomm-bench pingpong --transport shm --runs 10 --recv-into --send-from --max 8 --target-ms 100 --idle-gap 0 --no-peer`). Atomic
    /// read-modify-writes between it and the reply eat the gain: such an instruction apparently
    /// waits for the prefetch to complete, and the consumer takes the line back meanwhile; see
    /// `park` in the API.
    #[inline(always)]
    pub(super) fn prefetch_next<A: Atomics>(&self, ring: &Ring<A>) {
        if let Some(at) = self.next_line() {
            prefetch_for_write(ring.word(at) as *const A::W as *const u8);
        }
    }

    /// Where the next frame starts, if a frame as long as the last one [`Outbox::write_now`]
    /// wrote would lie whole in that cache line (payloads of up to 8 bytes) and nothing is queued
    /// before it. Frames of two lines or more are left alone: prefetching their lines makes 11-67 B
    /// about 20% slower one way, and prefetching only the first line, slower still when CPUs are
    /// slow to hand lines over.
    pub(super) fn next_line(&self) -> Option<u64> {
        let at = frame_start(self.head);
        let end = body_start(at, self.last_len) + self.last_len;
        (end <= (at & !(LINE - 1)) + LINE && self.queue.is_empty()).then_some(at)
    }

    /// Writes the second half of single copies the consumer offered to split (see [`Split`]);
    /// returns how many. Call often while descriptors are in flight: the consumer copies the
    /// first half meanwhile, and takes the second back if nobody has claimed it by then.
    /// Every progress round calls it, nearly always with nothing in flight: that test is inlined
    /// into the round, the search is not.
    #[inline(always)]
    pub(super) fn help<A: Atomics>(&self, ring: &Ring<A>, remote: &mut dyn Remote) -> u64 {
        if self.inflight.is_empty() { 0 } else { self.help_inflight(ring, remote) }
    }

    fn help_inflight<A: Atomics>(&self, ring: &Ring<A>, remote: &mut dyn Remote) -> u64 {
        let mut n = 0;
        // Only descriptors `tail` has not passed as far as this side knows: the space of the
        // others may hold new frames already.
        for (end, src) in self.inflight.iter().filter(|(end, _)| *end > self.tail) {
            let at = end - DESC_LEN as u64;
            let state = ring.word(at + DESC_STATE);
            if state.load(Acquire) != Split::Offered as u64
                || state.cas(Split::Offered as u64, Split::Claimed as u64).is_err()
            {
                continue;
            }
            let dst = ring.word(at + DESC_DST).load(Relaxed);
            let done = remote.write(dst, &src[src.len() / 2..]).is_ok();
            state.store(if done { Split::Done } else { Split::Failed } as u64, Release);
            n += 1;
        }
        n
    }

    /// Before sleeping: asks the consumer to ring when it frees space (if anything is pending).
    pub(super) fn announce_sleep<A: Atomics>(&self, ring: &Ring<A>) -> bool {
        let wait = self.pending();
        if wait {
            ring.hdr().prod_wait.0.store(1, Relaxed);
        }
        wait
    }

    /// After the sleep announcement and the fence: whether a flush would do something now.
    pub(super) fn can_progress<A: Atomics>(&mut self, ring: &Ring<A>) -> bool {
        if !self.pending() {
            return false;
        }
        let peer = self.ready(ring);
        if !self.queue.is_empty() && peer.is_none() {
            return false;
        }
        let t = ring.hdr().tail.0.load(Acquire);
        if t < self.tail || t > self.head {
            return true; // corrupt: let flush report it
        }
        // Space for the next step of the queue, or a descriptor released.
        peer.is_some_and(|p| !self.queue.is_empty() && ring.cap - (self.head - t) >= self.need(p))
            || self.inflight.front().is_some_and(|(end, _)| *end <= t)
    }

    /// Drops everything queued (the connection is gone).
    pub(super) fn clear(&mut self) {
        self.queue.clear();
        self.inflight.clear();
        self.sent = None;
    }
}

enum State {
    /// Waiting for the stamp of the frame after `tail`.
    Header,
    /// An owned payload (eager and control frames).
    Owned { h: Header, buf: BytesMut },
    /// A streamed `Data` payload going into the sink's buffer; `got` bytes are in.
    Direct { h: Header, got: usize, discard: bool },
    /// The descriptor of a single-copy `Data` frame.
    Desc { h: Header, got: usize, buf: [u8; DESC_LEN] },
}

/// The process at the other end of a ring, for single copies.
pub(crate) trait Remote {
    /// Copies `dst.len()` bytes at `addr` in the peer's memory into `dst`; fails if the peer may
    /// have freed them meanwhile (it died or closed the connection).
    fn read(&mut self, addr: u64, dst: &mut [u8]) -> Result<(), TransportError>;
    /// Copies `src` to `addr` in the peer's memory.
    fn write(&mut self, addr: u64, src: &[u8]) -> Result<(), TransportError>;
    /// Whether the peer still runs.
    fn alive(&mut self) -> bool;
}

/// What one [`Inbox::parse`] did.
#[derive(Default, Debug)]
pub(crate) struct Parsed {
    /// Frames delivered.
    pub frames: usize,
    /// Whether `tail` was published (the producer may be waiting for space).
    pub released: bool,
    /// Single copies made / offered to the producer to split (statistics).
    pub copies: u64,
    pub split: u64,
    /// The producer may be waiting for what was consumed: publish `tail` now.
    urgent: bool,
}

/// The consumer side of one ring: the read cursor and the frame parser.
pub(crate) struct Inbox {
    peer: Rank,
    limits: Limits,
    /// `Data` frames of at least this many bytes arrive by descriptor (0: none).
    threshold: u64,
    /// Masks the ring's stamps.
    key: u64,
    /// Single copies of at least this many bytes are offered to the producer to split (0: none).
    split_min: u64,
    /// Bytes consumed.
    tail: u64,
    /// Last `tail` published.
    published: u64,
    /// Last `head` read.
    head: u64,
    /// Bytes known to be in the ring: `head`, or the end of a whole frame seen by its stamp.
    end: u64,
    state: State,
}

/// Most frames one parse delivers (fairness between peers).
const FRAME_BUDGET: usize = 256;

impl Inbox {
    pub(super) fn new(peer: Rank, limits: Limits, threshold: u64, key: u64, split_min: u64) -> Inbox {
        let state = State::Header;
        Inbox { peer, limits, threshold, key, split_min, tail: 0, published: 0, head: 0, end: 0, state }
    }

    fn refresh_head<A: Atomics>(&mut self, ring: &Ring<A>) -> Result<u64, TransportError> {
        let h = ring.hdr().head.0.load(Acquire);
        if h < self.head || h.saturating_sub(self.published) > ring.cap {
            return Err(corrupt("head"));
        }
        self.head = h;
        self.end = self.end.max(h);
        // `head` may lag behind frames already taken by their stamps.
        Ok(self.end.saturating_sub(self.tail))
    }

    /// Whether the ring holds bytes not consumed yet (after the sleep announcement and fence).
    pub(super) fn has_input<A: Atomics>(&self, ring: &Ring<A>) -> bool {
        // A frame taken by its stamp before the producer published `head` does not count: the
        // producer publishes, fences and looks at the sleeping flag after stamping.
        ring.hdr().head.0.load(Acquire) > self.tail
    }

    /// How far `tail` may be published: never into a descriptor being read, whose words this
    /// side writes (a split) and whose source the producer keeps until `tail` passes it.
    fn releasable(&self) -> u64 {
        match self.state {
            State::Desc { got, .. } => self.tail - got as u64,
            _ => self.tail,
        }
    }

    /// Publishes what may be released, if anything new.
    fn publish<A: Atomics>(&mut self, ring: &Ring<A>, out: &mut Parsed) {
        let upto = self.releasable();
        if upto != self.published {
            ring.hdr().tail.0.store(upto, Release);
            self.published = upto;
            out.released = true;
        }
    }

    /// Delivers the frames the ring holds (a bounded number); publishes the space consumed when
    /// the producer may need it (see the module's "lazy release").
    #[inline(always)]
    pub(super) fn parse<A: Atomics>(
        &mut self,
        ring: &Ring<A>,
        sink: &mut dyn Sink,
        remote: &mut dyn Remote,
    ) -> Result<Parsed, TransportError> {
        let mut out = Parsed::default();
        let r = self.parse_inner(ring, sink, remote, &mut out);
        let lazy = (ring.cap / 4).min(ring.cap.saturating_sub(2 * LINE));
        if out.urgent || r.is_err() || self.tail - self.published >= lazy {
            self.publish(ring, &mut out);
        }
        r.map(|()| out)
    }

    #[inline(always)]
    fn parse_inner<A: Atomics>(
        &mut self,
        ring: &Ring<A>,
        sink: &mut dyn Sink,
        remote: &mut dyn Remote,
        out: &mut Parsed,
    ) -> Result<(), TransportError> {
        let peer = self.peer;
        let mut budget_bytes = 4 * ring.cap;
        loop {
            if let State::Header = self.state {
                if out.frames >= FRAME_BUDGET {
                    return Ok(());
                }
                let at = frame_start(self.tail);
                let seen = ring.word(at).load(Acquire);
                let whole = if seen == stamp(at, true, self.key) {
                    true
                } else if seen == stamp(at, false, self.key) {
                    false
                } else if self.head > at {
                    // Published, yet not stamped.
                    return Err(corrupt("stamp"));
                } else {
                    return Ok(());
                };
                let bytes = ring.bytes_at(at + STAMP_LEN, HEADER_LEN).expect("a frame header never wraps");
                let h = Header::decode(bytes.try_into().expect("header length"), &self.limits)?;
                if h.src != peer {
                    return Err(WireError::WrongSource { expected: peer, got: h.src }.into());
                }
                let desc = h.kind == Kind::Data && self.threshold > 0 && h.len as u64 >= self.threshold;
                self.tail = body_start(at, if desc { DESC_LEN as u64 } else { h.len as u64 });
                if whole {
                    let end = self.tail + if desc { DESC_LEN as u64 } else { h.len as u64 };
                    if end - self.published > ring.cap {
                        return Err(corrupt("frame length"));
                    }
                    self.end = self.end.max(end);
                }
                let lent = (whole && h.kind != Kind::Data).then(|| ring.bytes_at(self.tail, h.len as usize)).flatten();
                if let Some(payload) = lent {
                    // The whole payload is there in one piece: lend it, no allocation.
                    sink.frame_ref(peer, h, payload);
                    self.tail += h.len as u64;
                    out.frames += 1;
                } else if h.len == 0 {
                    sink.frame(peer, h, Bytes::new());
                    out.frames += 1;
                } else if desc {
                    self.state = State::Desc { h, got: 0, buf: [0; DESC_LEN] };
                } else if h.kind == Kind::Data {
                    let discard = sink.data_dest(peer, &h)?.is_none();
                    self.state = State::Direct { h, got: 0, discard };
                } else {
                    self.state = State::Owned { h, buf: BytesMut::with_capacity(h.len as usize) };
                }
                continue;
            }
            let mut avail = self.end.saturating_sub(self.tail);
            if avail == 0 {
                // A frame streaming through: follow `head`, and hand the space back early so
                // that the producer can go on meanwhile.
                if budget_bytes == 0 {
                    return Ok(());
                }
                out.urgent = true;
                self.publish(ring, out);
                avail = self.refresh_head(ring)?;
                if avail == 0 {
                    return Ok(());
                }
                budget_bytes = budget_bytes.saturating_sub(avail);
            }
            match &mut self.state {
                State::Header => unreachable!("handled above"),
                State::Owned { h, buf } => {
                    let n = (avail as usize).min(h.len as usize - buf.len());
                    let spare = &mut buf.spare_capacity_mut()[..n];
                    // SAFETY: `MaybeUninit<u8>` has the layout of `u8`; `read_at` only writes.
                    let dst = unsafe { &mut *(spare as *mut [std::mem::MaybeUninit<u8>] as *mut [u8]) };
                    ring.read_at(self.tail, dst);
                    // SAFETY: the `n` bytes after the length were just initialised.
                    unsafe { buf.set_len(buf.len() + n) };
                    self.tail += n as u64;
                    if buf.len() < h.len as usize {
                        continue;
                    }
                    let (h, payload) = (*h, std::mem::take(buf).freeze());
                    self.state = State::Header;
                    sink.frame(peer, h, payload);
                    out.frames += 1;
                }
                State::Direct { h, got, discard } => {
                    let n = (avail as usize).min(h.len as usize - *got);
                    if !*discard {
                        let dest = dest(sink, peer, h)?;
                        ring.read_at(self.tail, &mut dest[*got..*got + n]);
                    }
                    *got += n;
                    self.tail += n as u64;
                    if *got < h.len as usize {
                        continue;
                    }
                    let h = *h;
                    self.state = State::Header;
                    sink.frame(peer, h, Bytes::new());
                    out.frames += 1;
                }
                State::Desc { h, got, buf } => {
                    let n = (avail as usize).min(DESC_LEN - *got);
                    ring.read_at(self.tail, &mut buf[*got..*got + n]);
                    *got += n;
                    // The descriptor's bytes are consumed, but `tail` is not published past its
                    // start before the copy below is done (`releasable`).
                    self.tail += n as u64;
                    if *got < DESC_LEN {
                        continue;
                    }
                    let addr = u64::from_le_bytes(buf[..8].try_into().unwrap());
                    let len = u64::from_le_bytes(buf[8..16].try_into().unwrap());
                    if len != h.len as u64 || addr == 0 {
                        return Err(corrupt("descriptor"));
                    }
                    let h = *h;
                    if let Some(d) = sink.data_dest(peer, &h)? {
                        if d.len() != h.len as usize {
                            return Err(WireError::Unexpected(Kind::Data).into());
                        }
                        let at = self.tail - DESC_LEN as u64;
                        out.copies += 1;
                        if (d.len() as u64) < self.split_min || self.split_min == 0 {
                            remote.read(addr, d)?;
                        } else {
                            split_copy(ring, remote, at, addr, d)?;
                            out.split += 1;
                        }
                    }
                    self.state = State::Header;
                    out.urgent = true;
                    sink.frame(peer, h, Bytes::new());
                    out.frames += 1;
                }
            }
        }
    }

    /// Before sleeping is announced by the caller; after the fence, tells whether the producer
    /// waits for space and must be rung. Call after a parse that released space.
    pub(super) fn producer_waits<A: Atomics>(&self, ring: &Ring<A>) -> bool {
        A::fence();
        take_flag(&ring.hdr().prod_wait.0)
    }
}

/// Copies a single-copy payload of `addr` into `d`, half of it by the producer if it takes it in
/// time (see [`Split`]); `at` is the descriptor's stream position.
fn split_copy<A: Atomics>(
    ring: &Ring<A>,
    remote: &mut dyn Remote,
    at: u64,
    addr: u64,
    d: &mut [u8],
) -> Result<(), TransportError> {
    let half = d.len() / 2;
    let (first, second) = d.split_at_mut(half);
    let state = ring.word(at + DESC_STATE);
    ring.word(at + DESC_DST).store(second.as_mut_ptr() as u64, Relaxed);
    state.store(Split::Offered as u64, Release);
    let read = remote.read(addr, first);
    // Take the second half back, unless the producer is writing it: then wait until it is done
    // (or dead), since `d` must not be let go of meanwhile.
    let mut now = match state.cas(Split::Offered as u64, Split::Mine as u64) {
        Ok(_) => Split::Mine as u64,
        Err(v) => v,
    };
    let mut spins = 0u32;
    while now == Split::Claimed as u64 {
        std::hint::spin_loop();
        spins = spins.wrapping_add(1);
        if spins.is_multiple_of(4096) && !remote.alive() {
            return Err(TransportError::Closed);
        }
        now = state.load(Acquire);
    }
    read?;
    match Split::from_repr(now) {
        Some(Split::Done) => Ok(()),
        Some(Split::Mine | Split::Failed) => remote.read(addr + half as u64, second),
        _ => Err(corrupt("split state")),
    }
}

/// The sink's destination for a streamed `Data` frame; it must be exactly `h.len` bytes.
fn dest<'s>(sink: &'s mut dyn Sink, peer: Rank, h: &Header) -> Result<&'s mut [u8], TransportError> {
    match sink.data_dest(peer, h)? {
        Some(d) if d.len() == h.len as usize => Ok(d),
        _ => Err(WireError::Unexpected(Kind::Data).into()),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    /// A ring of `CAP` bytes in this process, one producer and one consumer driven by hand.
    const CAP: usize = 128;

    struct HeapRing {
        hdr: Box<RingHdr<AtomicU64>>,
        data: Vec<u64>,
    }

    impl HeapRing {
        fn new(threshold: u64) -> HeapRing {
            let w = || AtomicU64::new(0);
            let ctl =
                Ctl { closed: w(), ready: AtomicU64::new(1), cma_threshold: AtomicU64::new(threshold), stamp_key: w() };
            let hdr = Box::new(RingHdr { head: Line(w()), tail: Line(w()), prod_wait: Line(w()), ctl });
            HeapRing { hdr, data: vec![0; CAP / 8] }
        }

        fn ring(&mut self) -> Ring<Std> {
            let data = self.data.as_mut_ptr();
            // SAFETY: header and data live as long as `self`, which the tests keep past the ring.
            unsafe { Ring::new(&*self.hdr, data.cast(), data.cast::<AtomicU64>(), CAP) }
        }
    }

    /// A fresh heap ring with a sleeping flag and its consumer: `threshold` the single-copy
    /// threshold, `split_min` the split copy's.
    fn pair(threshold: u64, eager_limit: usize, split_min: u64) -> (HeapRing, AtomicU64, Inbox) {
        let limits = Limits { world_size: 2, eager_limit, chunk: 4096, max_message: 4096 };
        (HeapRing::new(threshold), AtomicU64::new(0), Inbox::new(1, limits, threshold, 0, split_min))
    }

    #[derive(Default)]
    struct Frames {
        got: Vec<(Header, Vec<u8>)>,
        dest: Vec<u8>,
    }

    // SAFETY: `dest` is not touched between `data_dest` and `frame`.
    unsafe impl Sink for Frames {
        fn data_dest(&mut self, _: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
            self.dest.resize(h.len as usize, 0);
            Ok(Some(&mut self.dest))
        }
        fn frame(&mut self, _: Rank, h: Header, payload: Bytes) {
            let body = if h.kind == Kind::Data { self.dest.clone() } else { payload.to_vec() };
            self.got.push((h, body));
        }
        fn peer_lost(&mut self, peer: Rank, err: TransportError) {
            panic!("peer {peer} lost: {err}");
        }
    }

    /// Both sides in this process: reads copy from the address; the producer never helps.
    struct Local;

    impl Remote for Local {
        fn read(&mut self, addr: u64, dst: &mut [u8]) -> Result<(), TransportError> {
            // SAFETY: the producer's outbox holds the source until `tail` passes its descriptor.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr(), dst.len()) };
            Ok(())
        }
        fn write(&mut self, _: u64, _: &[u8]) -> Result<(), TransportError> {
            unreachable!("help is not called here")
        }
        fn alive(&mut self) -> bool {
            true
        }
    }

    /// A descriptor that streams into a nearly full ring in pieces: while the consumer has read
    /// only part of it, `tail` stays at its start (the consumer will write its split words, and the
    /// producer must not cover them with new frames); then the whole single copy arrives.
    #[test]
    fn a_descriptor_read_in_pieces_keeps_its_space() {
        let (mut heap, sleeping, mut inbox) = pair(16, 64, 16);
        let ring = heap.ring();
        let (mut out, mut sink) = (Outbox::default(), Frames::default());
        let eager = |tag| (Header { src: 1, tag, len: 8, ..Header::new(Kind::Eager) }, Bytes::from(vec![tag as u8; 8]));
        let payload: Vec<u8> = (0..40).collect();
        let data = Header { src: 1, seq: 9, len: 40, ..Header::new(Kind::Data) };

        // Two 64-byte eager frames; the consumer takes the first only before the second is in.
        let (h, p) = eager(1);
        out.push(&h, p);
        out.flush(&ring, &sleeping).unwrap();
        inbox.parse(&ring, &mut sink, &mut Local).unwrap();
        assert_eq!(ring.hdr().tail.0.load(Acquire), 64);
        let (h, p) = eager(2);
        out.push(&h, p);
        out.push(&data, Bytes::from(payload.clone()));
        out.flush(&ring, &sleeping).unwrap();
        // The descriptor's header is in (at 128), and 8 of its 32 bytes.
        assert_eq!(ring.hdr().head.0.load(Acquire), 192);

        inbox.parse(&ring, &mut sink, &mut Local).unwrap();
        assert_eq!(sink.got.len(), 2, "both eager frames");
        assert_eq!(ring.hdr().tail.0.load(Acquire), 184, "released up to the descriptor, not into it");

        out.flush(&ring, &sleeping).unwrap();
        inbox.parse(&ring, &mut sink, &mut Local).unwrap();
        assert_eq!(sink.got.len(), 3);
        assert_eq!(sink.got[2], (data, payload), "the single copy, both halves by the consumer");
        assert_eq!(ring.hdr().tail.0.load(Acquire), 216, "released once copied");
        assert_eq!(out.flush(&ring, &sleeping).unwrap().work, 1, "the source is given back");
        assert!(!out.pending());
    }

    /// Bodies copied in with non-temporal stores arrive intact: whole ones, ones wrapping around
    /// the ring's end and ones streaming through it in pieces.
    #[test]
    fn non_temporal_bodies_arrive_intact() {
        let (mut heap, sleeping, mut inbox) = pair(0, 1000, 0);
        let ring = heap.ring();
        let (mut out, mut sink) = (Outbox::new(1), Frames::default());
        let lens = [0usize, 1, 8, 9, 63, 64, 65, 100, 17, 200, 300, 5, 999];
        let body = |i: usize, len: usize| (0..len).map(|k| (k * 31 + i * 7) as u8).collect::<Vec<u8>>();
        for (i, &len) in lens.iter().enumerate() {
            let h = Header { src: 1, tag: i as u64, len: len as u32, ..Header::new(Kind::Eager) };
            out.push(&h, Bytes::from(body(i, len)));
        }
        for _ in 0..1000 {
            out.flush(&ring, &sleeping).unwrap();
            inbox.parse(&ring, &mut sink, &mut Local).unwrap();
            if sink.got.len() == lens.len() {
                break;
            }
        }
        assert_eq!(sink.got.len(), lens.len());
        for (i, (h, got)) in sink.got.iter().enumerate() {
            assert_eq!((h.tag, got), (i as u64, &body(i, lens[i])), "frame {i}");
        }
    }

    /// The latency path writes a small frame straight into the ring only when that keeps the
    /// order and the frame fits whole: never before the consumer is known, past a queued frame,
    /// into a full ring, for `Data` frames or for bodies due for non-temporal copies. Frames sent
    /// either way arrive intact and in order, wrapping around the ring.
    #[test]
    fn direct_writes_keep_order_and_fit() {
        let (mut heap, sleeping, mut inbox) = pair(0, 1000, 0);
        let ring = heap.ring();
        let (mut out, mut sink) = (Outbox::new(32), Frames::default());
        let eager = |tag: u64, len: usize| Header { src: 1, tag, len: len as u32, ..Header::new(Kind::Eager) };
        let body = |tag: u64, len: usize| (0..len).map(|k| (k as u64 * 13 + tag) as u8).collect::<Vec<u8>>();
        let mut sent = Vec::new();
        let mut send = |out: &mut Outbox, tag: u64, len: usize| {
            let (h, b) = (eager(tag, len), body(tag, len));
            sent.push((h, b.clone()));
            let direct = out.write_now(&ring, &sleeping, &h, &b).map(|r| r.unwrap());
            if direct.is_none() {
                out.push(&h, Bytes::from(b));
            }
            direct.is_some()
        };

        assert!(!send(&mut out, 1, 8), "the consumer's stamp key is not known before a flush");
        out.flush(&ring, &sleeping).unwrap();
        assert!(send(&mut out, 2, 8), "ready, nothing queued, room: straight in");
        assert!(!send(&mut out, 3, 40), "no room for a second line");
        assert!(!send(&mut out, 4, 0), "behind a queued frame");
        inbox.parse(&ring, &mut sink, &mut Local).unwrap();
        out.flush(&ring, &sleeping).unwrap();
        inbox.parse(&ring, &mut sink, &mut Local).unwrap();
        out.flush(&ring, &sleeping).unwrap();
        assert!(!out.pending());
        assert!(!send(&mut out, 5, 32), "a body due for non-temporal copies is queued");
        out.flush(&ring, &sleeping).unwrap();
        let data = Header { src: 1, seq: 1, len: 8, ..Header::new(Kind::Data) };
        assert!(out.write_now(&ring, &sleeping, &data, &[0; 8]).is_none(), "Data frames are never direct");
        for tag in 6..40 {
            inbox.parse(&ring, &mut sink, &mut Local).unwrap();
            out.flush(&ring, &sleeping).unwrap();
            send(&mut out, tag, (tag as usize * 5) % 31);
        }
        for _ in 0..10 {
            inbox.parse(&ring, &mut sink, &mut Local).unwrap();
            out.flush(&ring, &sleeping).unwrap();
        }
        assert_eq!(sink.got, sent, "every frame, in order, intact");
    }

    /// The reply's line is prefetched only for one-line frames: where the next frame starts if
    /// one as long as the last would fit that line, and nothing behind a queued frame.
    #[test]
    fn next_line_only_for_frames_of_one_line() {
        let (mut heap, sleeping, mut inbox) = pair(0, 1000, 0);
        let ring = heap.ring();
        let (mut out, mut sink) = (Outbox::new(0), Frames::default());
        let eager = |len: usize| Header { src: 1, len: len as u32, ..Header::new(Kind::Eager) };
        out.push(&eager(0), Bytes::new());
        assert_eq!(out.next_line(), None, "behind a queued frame");
        out.flush(&ring, &sleeping).unwrap();
        assert_eq!(out.next_line(), Some(64), "after the first frame's line");
        let steps = [
            (8, Some(128)),
            (0, Some(192)),
            (8, Some(256)),
            (9, None),      // 65 bytes of body and header: two lines
            (8, None),      // starts 8 bytes into a line: would end in the next
            (0, Some(448)), // a header alone fits there
        ];
        for (len, next) in steps {
            inbox.parse(&ring, &mut sink, &mut Local).unwrap();
            assert!(out.write_now(&ring, &sleeping, &eager(len), &[7; 9][..len]).unwrap().is_ok());
            assert_eq!(out.next_line(), next, "after {len} bytes");
        }
    }

    /// Small bodies written by word copies land exactly, and nothing around them changes: every
    /// length around the 4-16 byte window, at every offset near the ring's end (wrapping or not).
    #[test]
    fn small_writes_land_exactly() {
        let (mut heap, ..) = pair(0, 64, 0);
        let ring = heap.ring();
        for len in 0..=20usize {
            for pos in (CAP as u64 - 24)..(CAP as u64 + 4) {
                let before: Vec<u8> = (0..CAP as u64).map(|i| i as u8 ^ 0x5a).collect();
                ring.write_at(0, &before, false);
                let src: Vec<u8> = (0..len).map(|i| 0xa0 + i as u8).collect();
                ring.write_small(pos, &src);
                let mut after = vec![0u8; CAP];
                ring.read_at(0, &mut after);
                let mut want = before.clone();
                for (i, b) in src.iter().enumerate() {
                    want[(pos as usize + i) % CAP] = *b;
                }
                assert_eq!(after, want, "{len} bytes at {pos}");
            }
        }
    }

    #[test]
    fn frame_starts_are_aligned_and_keep_stamp_and_header_in_one_line() {
        for end in 0..4 * LINE {
            let at = frame_start(end);
            assert!(at >= end && at < end + LINE, "{end} -> {at}");
            assert_eq!(at % 8, 0);
            assert_eq!(at / LINE, (at + FRAME_HDR - 1) / LINE, "{end} -> {at} splits the header");
            // The first 8-aligned place that keeps the header in one line.
            assert!((end..at).all(|p| p % 8 != 0 || p % LINE + FRAME_HDR > LINE));
        }
    }

    #[test]
    fn small_bodies_follow_the_header_and_large_ones_start_a_line() {
        for end in 0..2 * LINE {
            let at = frame_start(end);
            assert_eq!(body_start(at, 8), at + FRAME_HDR);
            let large = body_start(at, 16 * 1024);
            assert!(large.is_multiple_of(LINE) && large >= at + FRAME_HDR && large < at + FRAME_HDR + 8 + 1);
            // The most a frame's start asks for: see the module's "lazy release".
            assert!(large - end <= 119);
        }
    }

    #[test]
    fn stamps_name_one_position_and_are_never_zero() {
        let key = 0x0123_4567_89ab_cdef;
        for at in (0..1 << 12).step_by(8) {
            for whole in [false, true] {
                assert_ne!(stamp(at, whole, key), 0);
                assert_ne!(stamp(at, whole, key), stamp(at, !whole, key));
                assert_ne!(stamp(at, whole, key), stamp(at + (1 << 12), whole, key));
            }
        }
    }
}
