//! A segment's memory and every operation on it.
//!
//! The memory is an anonymous shared file (a memfd: never named in /dev/shm, freed when the last
//! process that maps it unmaps it), mapped by its owner and, over shared memory, by the peers that
//! attach to it, which fetch the owner's descriptor with `pidfd_getfd`. It starts with a header:
//!
//! * page 0: fixed fields (magic, id, a nonce that the attach reply carries, the data length,
//!   rights, kind, data offset), then one cache line each for the state (open / unpublished),
//!   the notification counter, the owner's "waiting" flags, and a queue's head and tail;
//! * from page 1: the data.
//!
//! Loads, stores and atomics go straight to the mapping, whoever does them (the owner's progress
//! applying a request that came over TCP, or a peer on the same host). Bytes are copied through
//! raw pointers and never lent out as references: the memory is shared with other processes by
//! design, and conflicting accesses that no atomic orders (a put racing a local write of the same
//! bytes) leave unspecified bytes, as in MPI's one-sided model. Words used as atomics are only
//! ever touched through `AtomicU64`.
//!
//! A peer that maps the segment can corrupt its content and header like any writer of shared
//! memory (same user, same host); nothing read from the mapping is trusted beyond that: queue
//! positions are masked to the capacity, and lengths come from the attach, not the header.
//!
//! Unpublishing ([`SegMem::close`]) marks the header closed; every operation looks at the state
//! first ([`SegMem::check_open`]) and backs out untouched once it is closed. Memory is never
//! freed under anyone: the file's pages live until its last mapping goes, so an operation that
//! passed the look just before the close writes into pages that still exist and that nobody can
//! observe any more (the owner's handle is gone with the unpublish; every other peer's next look
//! fails). Such an operation is indistinguishable from one that completed before the unpublish,
//! so the owner need not wait for it, and operations pay one load of a read-mostly line instead of
//! counting themselves in and out (two locked instructions, which took an 8-byte put on a mapping
//! from about 10 to 25-30 ns here).

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering::*};

use ferrocomm_transports::mapping::Mapping;

use super::geometry::{Geometry, Layout};
use super::{Access, RmaError, SegmentId};

const MAGIC: u64 = u64::from_le_bytes(*b"FCRMA001");
const OPEN: u64 = 1;
const CLOSED: u64 = 2;

const F_MAGIC: usize = 0;
const F_ID: usize = 8;
const F_NONCE: usize = 16;
const F_LEN: usize = 24;
const F_ACCESS: usize = 32;
const F_KIND: usize = 40;
const F_RECORD: usize = 48;
const F_CAPACITY: usize = 56;
const F_DATA: usize = 72;
const L_STATE: usize = 128;
const L_NOTIFY: usize = 192;
const L_WAITING: usize = 256;
const L_HEAD: usize = 320;
const L_TAIL: usize = 384;
const LINE: usize = 64;
const PAGE: usize = 4096;

/// Largest record of a remote queue, and largest queue.
pub(crate) const MAX_RECORD: usize = 4096;
pub(crate) const MAX_CAPACITY: usize = 1 << 20;

/// Bits of the owner's "waiting" flags: set while its application sleeps on the notification
/// counter or an empty queue, so that a peer writing through its mapping knows to ring it.
pub(crate) const WAIT_NOTIFY: u64 = 1;
pub(crate) const WAIT_QUEUE: u64 = 2;

/// Whether a queue of `capacity` records of `record` bytes can be made.
pub(crate) fn queue_shape_ok(record: usize, capacity: usize) -> bool {
    (1..=MAX_RECORD).contains(&record) && capacity.is_power_of_two() && capacity <= MAX_CAPACITY
}

/// What a segment holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SegmentKind {
    /// Bytes for put, get and atomics.
    Window,
    /// A remote queue of `capacity` records of `record` bytes.
    Queue { record: usize, capacity: usize },
}

/// A remote atomic operation on a 64-bit word; every one yields the word's previous value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AtomicOp {
    FetchAdd(u64),
    CompareSwap { current: u64, new: u64 },
    Swap(u64),
}

/// A segment's mapped memory (the owner's, or a peer's mapping of it).
pub(crate) struct SegMem {
    map: Mapping,
    /// The file behind the mapping: the owner's descriptor is what peers fetch.
    file: File,
    pub id: SegmentId,
    pub nonce: u64,
    /// Data bytes (for a queue: its slots).
    pub len: usize,
    pub access: Access,
    pub kind: SegmentKind,
    data: usize,
    /// Bytes per queue slot (a sequence word, then the record).
    slot: usize,
    /// Enqueues from peers waiting at this (owner) rank for room: a dequeue that sees some
    /// calls the progress task to let them in. Local to this process, not in the mapping.
    pub held: AtomicU64,
}

fn round_up(v: usize, to: usize) -> Option<usize> {
    v.checked_add(to - 1).map(|x| x / to * to)
}

/// Layout numbers of a segment: (data offset, data bytes, slot bytes), or `None` if they overflow.
fn layout(len: usize, kind: SegmentKind) -> Option<(usize, usize, usize)> {
    match kind {
        SegmentKind::Window => Some((PAGE, len, 0)),
        SegmentKind::Queue { record, capacity } => {
            let slot = round_up(record.checked_add(8)?, LINE)?;
            Some((PAGE, slot.checked_mul(capacity)?, slot))
        }
    }
}

/// Faults in every page of `map` (`len` bytes) for writing, best effort (older kernels lack
/// `MADV_POPULATE_WRITE`; a page left out faults on first use as usual). A segment's pages are
/// otherwise allocated by the first store to each and then, in every other process that maps
/// them, entered into its page table by its first touch: one fault per 4 KiB page, which made
/// the first 4 MiB put into a fresh segment about ten times slower than the next (1,024 faults,
/// a few milliseconds against a few hundred microseconds of copying). Publishing and attaching
/// take that time instead, once, in proportion to the length.
fn prefault(map: &Mapping, len: usize) {
    #[cfg(target_os = "linux")]
    map.populate(0, len);
    #[cfg(not(target_os = "linux"))]
    let _ = (map, len);
}

impl SegMem {
    /// New memory for segment `id` of `len` data bytes (ignored for a queue, whose slots make its
    /// length).
    pub(crate) fn create(
        id: SegmentId,
        len: usize,
        access: Access,
        kind: SegmentKind,
        nonce: u64,
    ) -> io::Result<SegMem> {
        let too_large = || io::Error::new(io::ErrorKind::InvalidInput, "segment too large");
        let (data, len, slot) = layout(len, kind).ok_or_else(too_large)?;
        let total = data.checked_add(len).ok_or_else(too_large)?;
        let file = super::sys::shared_file(total)?;
        let map = Mapping::new(&file, total.max(1))?;
        // Every page now, zeroed by the kernel at once (see `prefault`).
        prefault(&map, total);
        let (record, capacity) = match kind {
            SegmentKind::Window => (0, 0),
            SegmentKind::Queue { record, capacity } => (record, capacity),
        };
        let m = SegMem { map, file, id, nonce, len, access, kind, data, slot, held: AtomicU64::new(0) };
        for (at, v) in [
            (F_ID, id.to_u64()),
            (F_NONCE, nonce),
            (F_LEN, len as u64),
            (F_ACCESS, access.bits() as u64),
            (F_KIND, matches!(kind, SegmentKind::Queue { .. }) as u64),
            (F_RECORD, record as u64),
            (F_CAPACITY, capacity as u64),
            (F_DATA, data as u64),
        ] {
            m.hdr(at).store(v, Relaxed);
        }
        for i in 0..capacity {
            m.seq(i as u64).store(i as u64, Relaxed);
        }
        m.hdr(L_STATE).store(OPEN, Relaxed);
        m.hdr(F_MAGIC).store(MAGIC, Release);
        Ok(m)
    }

    /// Maps `file`, a peer's segment memory, which must be segment `id` with `nonce` (as its
    /// owner's attach reply said) and `len` data bytes of `kind`.
    pub(crate) fn open(
        file: File,
        id: SegmentId,
        nonce: u64,
        len: usize,
        access: Access,
        kind: SegmentKind,
    ) -> Result<SegMem, &'static str> {
        if let SegmentKind::Queue { record, capacity } = kind
            && !queue_shape_ok(record, capacity)
        {
            return Err("bad queue shape");
        }
        let size = file.metadata().map_err(|_| "cannot stat the segment")?.len();
        if size < PAGE as u64 || size > isize::MAX as u64 {
            return Err("segment file of the wrong size");
        }
        let map = Mapping::new(&file, size as usize).map_err(|_| "cannot map the segment")?;
        prefault(&map, size as usize);
        let word = |at: usize| {
            // SAFETY: `at` is a word inside page 0 of a mapping of at least a page.
            unsafe { &*map.ptr().add(at).cast::<AtomicU64>() }.load(Acquire)
        };
        if word(F_MAGIC) != MAGIC || word(F_ID) != id.to_u64() || word(F_NONCE) != nonce {
            return Err("not the segment its owner described");
        }
        let data = usize::try_from(word(F_DATA)).map_err(|_| "bad data offset")?;
        let (want_data, want_len, slot) = layout(len, kind).ok_or("bad layout")?;
        if data != want_data || want_len != len || word(F_LEN) != len as u64 {
            return Err("segment layout differs from its description");
        }
        if data.checked_add(len).is_none_or(|end| end as u64 > size) {
            return Err("segment shorter than its description");
        }
        Ok(SegMem { map, file, id, nonce, len, access, kind, data, slot, held: AtomicU64::new(0) })
    }

    /// The descriptor number of the file in this process (for a peer's `pidfd_getfd`).
    #[cfg(unix)]
    pub(crate) fn raw_fd(&self) -> i32 {
        use std::os::fd::AsRawFd;
        self.file.as_raw_fd()
    }

    /// A header word (`at` is one of the layout constants: inside the mapping).
    #[inline(always)]
    fn hdr(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at + 8 <= self.data && at.is_multiple_of(8));
        // SAFETY: in the header, 8-aligned (the mapping is page-aligned), alive as long as `self`.
        unsafe { &*self.map.ptr().add(at).cast::<AtomicU64>() }
    }

    #[inline(always)]
    fn base(&self) -> *mut u8 {
        // SAFETY: `data` is inside the mapping (checked at create and open).
        unsafe { self.map.ptr().add(self.data) }
    }

    /// The data's first byte.
    pub(crate) fn data_ptr(&self) -> *mut u8 {
        self.base()
    }

    /// Whether the segment is still published.
    pub(crate) fn is_open(&self) -> bool {
        self.hdr(L_STATE).load(SeqCst) == OPEN
    }

    /// Marks the segment unpublished: operations that look from now on back out.
    pub(crate) fn close(&self) {
        self.hdr(L_STATE).store(CLOSED, SeqCst);
    }

    /// Fails once the segment is unpublished (see the module's documentation for why a look
    /// suffices).
    #[inline]
    pub(crate) fn check_open(&self) -> Result<(), RmaError> {
        if self.hdr(L_STATE).load(Acquire) != OPEN {
            return Err(RmaError::Unpublished { id: self.id });
        }
        Ok(())
    }

    /// Rights and bounds of `needed` over `span` (first byte, length).
    pub(crate) fn check(&self, needed: Access, span: (usize, usize)) -> Result<(), RmaError> {
        RmaError::check(needed, self.access, span.0 as u64, span.1 as u64, self.len as u64)
    }

    /// Copies `src` to data offset `off` (the caller checked the range).
    #[inline]
    pub(crate) fn write_at(&self, off: usize, src: &[u8]) {
        assert!(off.checked_add(src.len()).is_some_and(|e| e <= self.len));
        // SAFETY: inside the data (asserted); the source may be anywhere, even in this mapping.
        unsafe { std::ptr::copy(src.as_ptr(), self.base().add(off), src.len()) };
    }

    /// Copies from data offset `off` into `dst` (the caller checked the range).
    #[inline]
    pub(crate) fn read_at(&self, off: usize, dst: &mut [u8]) {
        assert!(off.checked_add(dst.len()).is_some_and(|e| e <= self.len));
        // SAFETY: inside the data (asserted); `dst` is exclusively ours.
        unsafe { std::ptr::copy(self.base().add(off), dst.as_mut_ptr(), dst.len()) };
    }

    /// A put of `g` from `src` (both sides checked by the caller).
    pub(crate) fn put(&self, g: &Geometry, src: &[u8]) {
        for (l, r) in g.runs() {
            self.write_at(r, &src[l..l + g.block]);
        }
    }

    /// A get of `g` into `dst` (both sides checked by the caller).
    pub(crate) fn get(&self, g: &Geometry, dst: &mut [u8]) {
        for (l, r) in g.runs() {
            self.read_at(r, &mut dst[l..l + g.block]);
        }
    }

    /// Writes `data`, stream bytes `start..start + data.len()` of `layout` (checked by the caller).
    pub(crate) fn put_stream(&self, layout: &Layout, start: usize, data: &[u8]) {
        for (off, s, len) in layout.pieces(start..start + data.len()) {
            self.write_at(off, &data[s - start..s - start + len]);
        }
    }

    /// Reads stream bytes `start..start + out.len()` of `layout` into `out` (checked by the caller).
    pub(crate) fn get_stream(&self, layout: &Layout, start: usize, out: &mut [u8]) {
        for (off, s, len) in layout.pieces(start..start + out.len()) {
            self.read_at(off, &mut out[s - start..s - start + len]);
        }
    }

    /// The data word at `off` (checked aligned and inside by the caller).
    #[inline]
    pub(crate) fn word(&self, off: usize) -> &AtomicU64 {
        assert!(off.is_multiple_of(8) && off.checked_add(8).is_some_and(|e| e <= self.len));
        // SAFETY: an aligned word inside the data (asserted; the data starts page-aligned).
        unsafe { &*self.base().add(off).cast::<AtomicU64>() }
    }

    /// Applies `op` to the word at `off` (checked by the caller); returns its previous value.
    #[inline]
    pub(crate) fn atomic(&self, op: AtomicOp, off: usize) -> u64 {
        let w = self.word(off);
        match op {
            AtomicOp::FetchAdd(v) => w.fetch_add(v, SeqCst),
            AtomicOp::Swap(v) => w.swap(v, SeqCst),
            AtomicOp::CompareSwap { current, new } => match w.compare_exchange(current, new, SeqCst, SeqCst) {
                Ok(v) | Err(v) => v,
            },
        }
    }

    /// Adds `n` to the notification counter; true if the owner sleeps on it and must be rung.
    pub(crate) fn notify(&self, n: u64) -> bool {
        self.hdr(L_NOTIFY).fetch_add(n, SeqCst);
        self.hdr(L_WAITING).load(SeqCst) & WAIT_NOTIFY != 0
    }

    /// The notification counter.
    pub(crate) fn notified(&self) -> u64 {
        self.hdr(L_NOTIFY).load(Acquire)
    }

    /// The owner goes to sleep on `what` (a `WAIT_*` bit): writers through mappings ring it.
    pub(crate) fn set_waiting(&self, what: u64) {
        self.hdr(L_WAITING).fetch_or(what, SeqCst);
    }

    /// The owner was rung: nobody sleeps any more until [`SegMem::set_waiting`] again.
    pub(crate) fn clear_waiting(&self) {
        self.hdr(L_WAITING).store(0, SeqCst);
    }

    /// Whether the owner sleeps on `what`: for a writer that has just made what it waits for
    /// visible (the fence orders that store before this load, against the owner's flag-then-look).
    pub(crate) fn waiting(&self, what: u64) -> bool {
        std::sync::atomic::fence(SeqCst);
        self.hdr(L_WAITING).load(SeqCst) & what != 0
    }

    /// (record bytes, capacity) of a queue.
    pub(crate) fn queue_shape(&self) -> Option<(usize, usize)> {
        match self.kind {
            SegmentKind::Queue { record, capacity } => Some((record, capacity)),
            SegmentKind::Window => None,
        }
    }

    /// The sequence word of queue slot `i` (masked to the capacity, so in range whatever `i`).
    #[inline]
    fn seq(&self, i: u64) -> &AtomicU64 {
        let (_, capacity) = self.queue_shape().expect("a queue");
        let i = (i as usize) & (capacity - 1);
        // SAFETY: slot `i` (< capacity) starts inside the data, 8-aligned (slots are whole lines).
        unsafe { &*self.base().add(i * self.slot).cast::<AtomicU64>() }
    }

    /// Appends `record` (exactly the record length) unless the queue is full. Many producers,
    /// through any mapping, may enqueue at once (a bounded multi-producer queue in the style of
    /// Vyukov's: a slot is claimed only once free, so no producer waits while holding one).
    pub(crate) fn try_enqueue(&self, record: &[u8]) -> bool {
        let (rlen, capacity) = self.queue_shape().expect("a queue");
        assert_eq!(record.len(), rlen);
        let tail = self.hdr(L_TAIL);
        let mut t = tail.load(Relaxed);
        loop {
            let seq = self.seq(t).load(Acquire);
            match seq.wrapping_sub(t) as i64 {
                0 => match tail.compare_exchange_weak(t, t.wrapping_add(1), Relaxed, Relaxed) {
                    Ok(_) => {
                        let at = (t as usize & (capacity - 1)) * self.slot + 8;
                        self.write_at(at, record);
                        self.seq(t).store(t.wrapping_add(1), Release);
                        return true;
                    }
                    Err(now) => t = now,
                },
                d if d < 0 => return false,
                _ => t = tail.load(Relaxed),
            }
        }
    }

    /// Takes the oldest record into `out` (the record length) if there is one.
    pub(crate) fn try_dequeue(&self, out: &mut [u8]) -> bool {
        let (rlen, capacity) = self.queue_shape().expect("a queue");
        assert_eq!(out.len(), rlen);
        let head = self.hdr(L_HEAD);
        let mut h = head.load(Relaxed);
        loop {
            let seq = self.seq(h).load(Acquire);
            match seq.wrapping_sub(h.wrapping_add(1)) as i64 {
                0 => match head.compare_exchange_weak(h, h.wrapping_add(1), Relaxed, Relaxed) {
                    Ok(_) => {
                        let at = (h as usize & (capacity - 1)) * self.slot + 8;
                        self.read_at(at, out);
                        self.seq(h).store(h.wrapping_add(capacity as u64), Release);
                        return true;
                    }
                    Err(now) => h = now,
                },
                d if d < 0 => return false,
                _ => h = head.load(Relaxed),
            }
        }
    }

    /// Records in the queue now (approximate while producers are active).
    pub(crate) fn queued(&self) -> u64 {
        self.hdr(L_TAIL).load(Acquire).wrapping_sub(self.hdr(L_HEAD).load(Acquire))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window(len: usize, access: Access) -> SegMem {
        SegMem::create(SegmentId::new(0, 1), len, access, SegmentKind::Window, 99).unwrap()
    }

    #[test]
    fn atomics_semantics() {
        let m = window(64, Access::WINDOW);
        assert_eq!(m.atomic(AtomicOp::FetchAdd(5), 8), 0);
        assert_eq!(m.atomic(AtomicOp::FetchAdd(u64::MAX), 8), 5, "wraps");
        assert_eq!(m.word(8).load(SeqCst), 4);
        assert_eq!(m.atomic(AtomicOp::CompareSwap { current: 3, new: 9 }, 8), 4, "failed: old value back");
        assert_eq!(m.word(8).load(SeqCst), 4, "unchanged");
        assert_eq!(m.atomic(AtomicOp::CompareSwap { current: 4, new: 9 }, 8), 4);
        assert_eq!(m.atomic(AtomicOp::Swap(1), 8), 9);
        assert_eq!(m.word(8).load(SeqCst), 1);
        assert_eq!(m.word(0).load(SeqCst), 0, "neighbour untouched");
    }

    #[test]
    fn concurrent_fetch_add_sums_exactly() {
        let m = std::sync::Arc::new(window(8, Access::WINDOW));
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let m = m.clone();
                std::thread::spawn(move || (0..10_000).for_each(|_| _ = m.atomic(AtomicOp::FetchAdd(1), 0)))
            })
            .collect();
        threads.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(m.word(0).load(SeqCst), 40_000);
    }

    #[test]
    fn a_peer_mapping_sees_the_same_memory() {
        let m = window(4096, Access::WINDOW);
        let file = m.file.try_clone().unwrap();
        let peer = SegMem::open(file, m.id, m.nonce, 4096, m.access, m.kind).unwrap();
        peer.write_at(100, b"hello");
        let mut got = [0u8; 5];
        m.read_at(100, &mut got);
        assert_eq!(&got, b"hello");
        peer.atomic(AtomicOp::FetchAdd(3), 0);
        assert_eq!(m.word(0).load(SeqCst), 3);
        // Wrong id, nonce or length: refused.
        let f = || m.file.try_clone().unwrap();
        assert!(SegMem::open(f(), SegmentId::new(0, 2), m.nonce, 4096, m.access, m.kind).is_err());
        assert!(SegMem::open(f(), m.id, 1, 4096, m.access, m.kind).is_err());
        assert!(SegMem::open(f(), m.id, m.nonce, 8192, m.access, m.kind).is_err());
    }

    #[test]
    fn late_operations_back_out() {
        let m = window(64, Access::WINDOW);
        let file = m.file.try_clone().unwrap();
        let peer = SegMem::open(file, m.id, m.nonce, 64, m.access, m.kind).unwrap();
        assert!(peer.check_open().is_ok());
        m.close();
        assert!(matches!(peer.check_open(), Err(RmaError::Unpublished { .. })), "the peer's mapping sees it");
        drop(m);
        // The owner's mapping is gone; the peer's pages are still there.
        peer.write_at(0, &[1; 64]);
    }

    #[test]
    fn queue_order_full_and_empty() {
        let q =
            SegMem::create(SegmentId::new(0, 3), 0, Access::QUEUE, SegmentKind::Queue { record: 12, capacity: 4 }, 1)
                .unwrap();
        let mut out = [0u8; 12];
        assert!(!q.try_dequeue(&mut out), "empty");
        for i in 0..4u8 {
            assert!(q.try_enqueue(&[i; 12]));
        }
        assert!(!q.try_enqueue(&[9; 12]), "full: a whole queue ahead");
        assert_eq!(q.queued(), 4);
        for round in 0..10u8 {
            assert!(q.try_dequeue(&mut out));
            assert_eq!(out, [round; 12], "in order");
            assert!(q.try_enqueue(&[round + 4; 12]), "a freed slot is reused");
        }
    }

    #[test]
    fn queue_many_producers_one_consumer() {
        let q = std::sync::Arc::new(
            SegMem::create(SegmentId::new(0, 4), 0, Access::QUEUE, SegmentKind::Queue { record: 16, capacity: 8 }, 1)
                .unwrap(),
        );
        const PER: u64 = 5000;
        let producers: Vec<_> = (0..3u64)
            .map(|p| {
                let q = q.clone();
                std::thread::spawn(move || {
                    for i in 0..PER {
                        let mut rec = [0u8; 16];
                        rec[..8].copy_from_slice(&p.to_le_bytes());
                        rec[8..].copy_from_slice(&i.to_le_bytes());
                        while !q.try_enqueue(&rec) {
                            std::thread::yield_now();
                        }
                    }
                })
            })
            .collect();
        let mut next = [0u64; 3];
        let mut out = [0u8; 16];
        let mut got = 0;
        while got < 3 * PER {
            if !q.try_dequeue(&mut out) {
                std::thread::yield_now();
                continue;
            }
            let p = u64::from_le_bytes(out[..8].try_into().unwrap()) as usize;
            let i = u64::from_le_bytes(out[8..].try_into().unwrap());
            assert_eq!(i, next[p], "each producer's records arrive in its order, none lost or doubled");
            next[p] += 1;
            got += 1;
        }
        producers.into_iter().for_each(|t| t.join().unwrap());
        assert_eq!(next, [PER; 3]);
    }
}
