//! One single-producer/single-consumer byte ring, and the framing that runs over it.
//!
//! The ring is a byte stream: `head` and `tail` are monotonic u64 byte counters (never reduced
//! modulo the capacity, so "full" and "empty" are never ambiguous), each on its own cache line. The
//! producer copies bytes in and publishes them with a release store of `head`; the consumer reads
//! them after an acquire load of `head` and gives the space back with a release store of `tail`.
//! Frames are header + payload, contiguous in the stream and wrapping at the end of the buffer, so
//! a frame of any size passes through a ring of any size: [`Inbox`] takes partial payloads.
//!
//! A `Data` frame of at least the consumer's single-copy threshold travels as header + 16-byte
//! descriptor (source address and length in the producer's memory); the consumer copies the
//! payload straight into the sink's buffer (`pull`). The producer keeps the source alive until
//! `tail` passes the descriptor, which the consumer only allows once its copy is finished: the
//! tail counter doubles as the acknowledgement.
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

use std::collections::VecDeque;
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::{self, Acquire, Relaxed, Release};

use bytes::{Bytes, BytesMut};

use crate::wire::{HEADER_LEN, Header, Kind, Limits, Rank, WireError};
use crate::{Sink, TransportError};

/// Size of the descriptor that replaces the payload of a single-copy `Data` frame.
pub(crate) const DESC_LEN: usize = 16;

/// A 64-bit atomic word (std's in shared memory, the model checker's in tests).
pub(crate) trait Word {
    fn load(&self, o: Ordering) -> u64;
    fn store(&self, v: u64, o: Ordering);
    fn swap(&self, v: u64, o: Ordering) -> u64;
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
}

impl Atomics for Std {
    type W = AtomicU64;
    /// A full barrier. On x86-64 a locked read-modify-write (here of the word at the stack
    /// pointer, or-ing in nothing) orders every earlier load and store before every later one,
    /// as `mfence` does for ordinary write-back memory (which is all the rings use), at a fraction
    /// of its cost: 8 against 33 ns measured on the machine of the README. Linux's `smp_mb()` is
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
    cap: u64,
}

// SAFETY: the pointers refer to shared memory (or the model's heap) that outlives the ring, and
// all concurrent access goes through atomics or through byte ranges the protocol hands over.
unsafe impl<A: Atomics> Send for Ring<A> {}

impl<A: Atomics> Ring<A> {
    /// # Safety
    /// `hdr` must point to a valid `RingHdr` and `data` to `cap` bytes (a power of two), both
    /// valid for as long as the ring is used.
    pub unsafe fn new(hdr: *const RingHdr<A::W>, data: *mut u8, cap: usize) -> Ring<A> {
        debug_assert!(cap.is_power_of_two());
        Ring { hdr, data, cap: cap as u64 }
    }

    #[inline]
    pub fn hdr(&self) -> &RingHdr<A::W> {
        // SAFETY: see `new`.
        unsafe { &*self.hdr }
    }

    /// Whether either side closed the connection.
    pub fn closed(&self) -> bool {
        self.hdr().ctl.closed.load(Acquire) != 0
    }

    /// Marks the connection closed (seen by both sides).
    pub fn close(&self) {
        self.hdr().ctl.closed.store(1, Release);
    }

    /// Hints the processor to fetch the cache line of stream position `pos` (no memory access in
    /// the language's sense: a prefetch cannot fault or race).
    #[inline(always)]
    fn prefetch(&self, pos: u64) {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch has no architectural effect; the address lies inside the ring anyway.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            _mm_prefetch::<_MM_HINT_T0>(self.data.add((pos & (self.cap - 1)) as usize) as *const i8);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = pos;
    }

    /// Copies `src` to stream position `pos` (wrapping).
    #[inline]
    fn write_at(&self, pos: u64, src: &[u8]) {
        A::before_copy();
        let off = (pos & (self.cap - 1)) as usize;
        let first = src.len().min(self.cap as usize - off);
        // SAFETY: `off + first <= cap` and `src.len() - first <= cap - first`; the range lies in
        // the free part of the ring, which the consumer does not read.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), self.data.add(off), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), self.data, src.len() - first);
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
    /// Decided when the first byte is written: travels as a descriptor.
    desc: bool,
}

impl Item {
    fn desc_bytes(&self) -> [u8; DESC_LEN] {
        let mut d = [0u8; DESC_LEN];
        d[..8].copy_from_slice(&(self.payload.as_ptr() as u64).to_le_bytes());
        d[8..].copy_from_slice(&(self.payload.len() as u64).to_le_bytes());
        d
    }

    fn len(&self) -> usize {
        HEADER_LEN + if self.desc { DESC_LEN } else { self.payload.len() }
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

/// The producer side of one ring: the ordered output queue and the write cursor.
#[derive(Default)]
pub(crate) struct Outbox {
    queue: VecDeque<Item>,
    /// Bytes of the front item already in the ring.
    sent: usize,
    /// Next write position (published at the end of each flush).
    head: u64,
    /// Last `tail` read from the consumer.
    tail: u64,
    /// `None` until the consumer is ready; then its single-copy threshold (0: none).
    threshold: Option<u64>,
    /// Single-copy sources the consumer may still be reading: (stream end of the descriptor, bytes).
    inflight: VecDeque<(u64, Bytes)>,
}

impl Outbox {
    pub fn push(&mut self, h: &Header, payload: Bytes) {
        self.queue.push_back(Item { header: h.encode(), is_data: h.kind == Kind::Data, payload, desc: false });
    }

    /// Frames not yet (wholly) in the ring.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Frames not yet in the ring, or sources the consumer may still be copying.
    pub fn pending(&self) -> bool {
        !self.queue.is_empty() || !self.inflight.is_empty()
    }

    fn refresh_tail<A: Atomics>(&mut self, ring: &Ring<A>) -> Result<(), TransportError> {
        let t = ring.hdr().tail.0.load(Acquire);
        if t < self.tail || t > self.head || self.head - t > ring.cap {
            return Err(corrupt("tail"));
        }
        self.tail = t;
        Ok(())
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

    /// Whether the consumer has connected; learns its single-copy threshold.
    fn ready<A: Atomics>(&mut self, ring: &Ring<A>) -> bool {
        if self.threshold.is_none() && ring.hdr().ctl.ready.load(Acquire) != 0 {
            self.threshold = Some(ring.hdr().ctl.cma_threshold.load(Relaxed));
        }
        self.threshold.is_some()
    }

    /// Writes as much of the queue as fits and publishes it; releases single-copy sources the
    /// consumer is done with. `sleeping` is the consumer's sleeping flag.
    pub fn flush<A: Atomics>(&mut self, ring: &Ring<A>, sleeping: &A::W) -> Result<Flushed, TransportError> {
        let mut out = Flushed { work: self.release(ring)?, ..Flushed::default() };
        if self.queue.is_empty() || !self.ready(ring) {
            return Ok(out);
        }
        let threshold = self.threshold.unwrap_or(0);
        let start = self.head;
        let mut free = ring.cap - (self.head - self.tail);
        while !self.queue.is_empty() {
            if free == 0 {
                self.refresh_tail(ring)?;
                free = ring.cap - (self.head - self.tail);
                if free == 0 {
                    break;
                }
            }
            let item = self.queue.front_mut().expect("not empty");
            if self.sent == 0 {
                item.desc = item.is_data && threshold > 0 && item.payload.len() as u64 >= threshold;
            }
            let desc = item.desc_bytes();
            let parts: [&[u8]; 2] = [&item.header, if item.desc { &desc } else { &item.payload }];
            let mut skip = self.sent;
            for part in parts {
                if skip >= part.len() {
                    skip -= part.len();
                    continue;
                }
                let n = (part.len() - skip).min(free as usize);
                ring.write_at(self.head, &part[skip..skip + n]);
                self.head += n as u64;
                self.sent += n;
                free -= n as u64;
                skip = 0;
                if free == 0 {
                    break;
                }
            }
            if self.sent < item.len() {
                continue;
            }
            let item = self.queue.pop_front().expect("front item");
            self.sent = 0;
            if item.desc {
                out.descs += 1;
                self.inflight.push_back((self.head, item.payload));
            } else if item.is_data {
                out.streamed += 1;
            }
        }
        if self.head != start {
            ring.hdr().head.0.store(self.head, Release);
            A::fence();
            out.ring = take_flag(sleeping);
            out.work += 1;
        }
        Ok(out)
    }

    /// Before sleeping: asks the consumer to ring when it frees space (if anything is pending).
    pub fn announce_sleep<A: Atomics>(&self, ring: &Ring<A>) -> bool {
        let wait = self.pending();
        if wait {
            ring.hdr().prod_wait.0.store(1, Relaxed);
        }
        wait
    }

    /// After the sleep announcement and the fence: whether a flush would do something now.
    pub fn can_progress<A: Atomics>(&mut self, ring: &Ring<A>) -> bool {
        if !self.pending() {
            return false;
        }
        if !self.queue.is_empty() && !self.ready(ring) {
            return false;
        }
        let t = ring.hdr().tail.0.load(Acquire);
        // Space for the queue, or a descriptor released (or a corrupt value: let flush report it).
        (!self.queue.is_empty() && self.head - t.min(self.head) < ring.cap)
            || self.inflight.front().is_some_and(|(end, _)| *end <= t)
            || t < self.tail
            || t > self.head
    }

    /// Drops everything queued (the connection is gone).
    pub fn clear(&mut self) {
        self.queue.clear();
        self.inflight.clear();
        self.sent = 0;
    }
}

enum State {
    /// `got` bytes of a header are in `buf`.
    Header { got: usize, buf: [u8; HEADER_LEN] },
    /// An owned payload (eager and control frames).
    Owned { h: Header, buf: BytesMut },
    /// A streamed `Data` payload going into the sink's buffer; `got` bytes are in.
    Direct { h: Header, got: usize, discard: bool },
    /// The descriptor of a single-copy `Data` frame.
    Desc { h: Header, got: usize, buf: [u8; DESC_LEN] },
}

/// Copies a single-copy payload: `(header, source address, destination)`.
pub(crate) type Pull<'a> = dyn FnMut(&Header, u64, &mut [u8]) -> Result<(), TransportError> + 'a;

/// What one [`Inbox::parse`] did.
#[derive(Default, Debug)]
pub(crate) struct Parsed {
    /// Frames delivered.
    pub frames: usize,
    /// Whether `tail` moved (the producer may be waiting for space).
    pub released: bool,
}

/// The consumer side of one ring: the read cursor and the frame parser.
pub(crate) struct Inbox {
    peer: Rank,
    limits: Limits,
    /// `Data` frames of at least this many bytes arrive by descriptor (0: none).
    threshold: u64,
    /// Bytes consumed.
    tail: u64,
    /// Last `head` read.
    head: u64,
    state: State,
}

/// Most frames one parse delivers (fairness between peers).
const FRAME_BUDGET: usize = 256;

impl Inbox {
    pub fn new(peer: Rank, limits: Limits, threshold: u64) -> Inbox {
        Inbox { peer, limits, threshold, tail: 0, head: 0, state: State::Header { got: 0, buf: [0; HEADER_LEN] } }
    }

    fn refresh_head<A: Atomics>(&mut self, ring: &Ring<A>) -> Result<u64, TransportError> {
        // Ask for the line the next frame starts in while `head` is being fetched: the two misses
        // then overlap instead of following each other.
        ring.prefetch(self.tail);
        let h = ring.hdr().head.0.load(Acquire);
        if h < self.head || h - self.tail > ring.cap {
            return Err(corrupt("head"));
        }
        self.head = h;
        Ok(h - self.tail)
    }

    /// Whether the ring holds bytes not consumed yet (after the sleep announcement and fence).
    pub fn has_input<A: Atomics>(&self, ring: &Ring<A>) -> bool {
        ring.hdr().head.0.load(Acquire) != self.tail
    }

    /// Delivers the frames the ring holds (a bounded number); publishes the space consumed.
    pub fn parse<A: Atomics>(
        &mut self,
        ring: &Ring<A>,
        sink: &mut dyn Sink,
        pull: &mut Pull<'_>,
    ) -> Result<Parsed, TransportError> {
        let start = self.tail;
        let mut out = Parsed::default();
        let r = self.parse_inner(ring, sink, pull, &mut out);
        if self.tail != start {
            ring.hdr().tail.0.store(self.tail, Release);
            out.released = true;
        }
        r.map(|()| out)
    }

    fn parse_inner<A: Atomics>(
        &mut self,
        ring: &Ring<A>,
        sink: &mut dyn Sink,
        pull: &mut Pull<'_>,
        out: &mut Parsed,
    ) -> Result<(), TransportError> {
        let peer = self.peer;
        let mut budget_bytes = 4 * ring.cap;
        loop {
            let mut avail = self.head - self.tail;
            if avail == 0 {
                if out.frames >= FRAME_BUDGET || budget_bytes == 0 {
                    return Ok(());
                }
                if self.tail != ring.hdr().tail.0.load(Relaxed) {
                    // Hand the space back early, so a streaming producer can go on meanwhile.
                    ring.hdr().tail.0.store(self.tail, Release);
                }
                avail = self.refresh_head(ring)?;
                if avail == 0 {
                    return Ok(());
                }
                budget_bytes = budget_bytes.saturating_sub(avail);
            }
            match &mut self.state {
                State::Header { got, buf } => {
                    let n = (avail as usize).min(HEADER_LEN - *got);
                    ring.read_at(self.tail, &mut buf[*got..*got + n]);
                    self.tail += n as u64;
                    *got += n;
                    if *got < HEADER_LEN {
                        continue;
                    }
                    let h = Header::decode(buf, &self.limits)?;
                    if h.src != peer {
                        return Err(WireError::WrongSource { expected: peer, got: h.src }.into());
                    }
                    let whole = (h.kind != Kind::Data && self.head - self.tail >= h.len as u64)
                        .then(|| ring.bytes_at(self.tail, h.len as usize))
                        .flatten();
                    self.state = if let Some(payload) = whole {
                        // The whole payload is there in one piece: lend it, no allocation.
                        sink.frame_ref(peer, h, payload);
                        self.tail += h.len as u64;
                        out.frames += 1;
                        State::Header { got: 0, buf: [0; HEADER_LEN] }
                    } else if h.len == 0 {
                        sink.frame(peer, h, Bytes::new());
                        out.frames += 1;
                        State::Header { got: 0, buf: [0; HEADER_LEN] }
                    } else if h.kind == Kind::Data {
                        if self.threshold > 0 && h.len as u64 >= self.threshold {
                            State::Desc { h, got: 0, buf: [0; DESC_LEN] }
                        } else {
                            let discard = sink.data_dest(peer, &h)?.is_none();
                            State::Direct { h, got: 0, discard }
                        }
                    } else {
                        State::Owned { h, buf: BytesMut::with_capacity(h.len as usize) }
                    };
                }
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
                    self.state = State::Header { got: 0, buf: [0; HEADER_LEN] };
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
                    self.state = State::Header { got: 0, buf: [0; HEADER_LEN] };
                    sink.frame(peer, h, Bytes::new());
                    out.frames += 1;
                }
                State::Desc { h, got, buf } => {
                    let n = (avail as usize).min(DESC_LEN - *got);
                    ring.read_at(self.tail, &mut buf[*got..*got + n]);
                    *got += n;
                    // The descriptor's bytes are consumed, but `tail` is not published before
                    // the copy below is done: the producer keeps the source until then.
                    self.tail += n as u64;
                    if *got < DESC_LEN {
                        continue;
                    }
                    let addr = u64::from_le_bytes(buf[..8].try_into().unwrap());
                    let len = u64::from_le_bytes(buf[8..].try_into().unwrap());
                    if len != h.len as u64 || addr == 0 {
                        return Err(corrupt("descriptor"));
                    }
                    let h = *h;
                    if let Some(d) = sink.data_dest(peer, &h)? {
                        if d.len() != h.len as usize {
                            return Err(WireError::Unexpected(Kind::Data).into());
                        }
                        pull(&h, addr, d)?;
                    }
                    self.state = State::Header { got: 0, buf: [0; HEADER_LEN] };
                    sink.frame(peer, h, Bytes::new());
                    out.frames += 1;
                }
            }
        }
    }

    /// Before sleeping is announced by the caller; after the fence, tells whether the producer
    /// waits for space and must be rung. Call after a parse that released space.
    pub fn producer_waits<A: Atomics>(&self, ring: &Ring<A>) -> bool {
        A::fence();
        take_flag(&ring.hdr().prod_wait.0)
    }
}

/// The sink's destination for a streamed `Data` frame; it must be exactly `h.len` bytes.
fn dest<'s>(sink: &'s mut dyn Sink, peer: Rank, h: &Header) -> Result<&'s mut [u8], TransportError> {
    match sink.data_dest(peer, h)? {
        Some(d) if d.len() == h.len as usize => Ok(d),
        _ => Err(WireError::Unexpected(Kind::Data).into()),
    }
}
