//! Model check of the ring and doorbell protocol with shuttle: the real [`Outbox`] and [`Inbox`]
//! code over rings in heap memory, atomics that are scheduling points, and eventfd-like doorbells
//! made of a mutex and a condition variable. Two producers write frames (some larger than the ring,
//! some single-copy descriptors) to one consumer; everyone sleeps whenever it cannot move. A lost
//! wake-up shows as a deadlock, a torn or reordered frame as a content mismatch, a single-copy
//! source released too early as a failed liveness assertion.
//!
//! Shuttle's memory is sequentially consistent, so it cannot see a missing fence; the smaller
//! [`weak_memory`] model runs the same code under loom, whose weak memory model can.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use shuttle::sync::atomic::AtomicU64;
use shuttle::sync::{Arc, Condvar, Mutex};

use super::ring::{Atomics, Ctl, Inbox, Line, Outbox, Remote, Ring, RingHdr, Word};
use crate::wire::{Header, Kind, Limits, Rank, WireError};
use crate::{Sink, TransportError};

struct Model;

/// The ring's [`Word`] on a model checker's `AtomicU64`, and [`Bell`], an eventfd made of its
/// mutex and condition variable: shuttle and loom have the same API, so both models declare
/// them by this macro.
macro_rules! model_primitives {
    () => {
        impl Word for AtomicU64 {
            fn load(&self, o: Ordering) -> u64 {
                AtomicU64::load(self, o)
            }
            fn store(&self, v: u64, o: Ordering) {
                AtomicU64::store(self, v, o)
            }
            fn swap(&self, v: u64, o: Ordering) -> u64 {
                AtomicU64::swap(self, v, o)
            }
            fn cas(&self, current: u64, new: u64) -> Result<u64, u64> {
                AtomicU64::compare_exchange(self, current, new, Ordering::AcqRel, Ordering::Acquire)
            }
        }

        /// An eventfd: a counter that wakes its reader.
        #[derive(Default)]
        struct Bell {
            count: Mutex<u64>,
            cv: Condvar,
        }

        impl Bell {
            fn ring(&self) {
                *self.count.lock().unwrap() += 1;
                self.cv.notify_all();
            }
            fn wait(&self) {
                let mut c = self.count.lock().unwrap();
                while *c == 0 {
                    c = self.cv.wait(c).unwrap();
                }
                *c = 0;
            }
        }
    };
}

model_primitives!();

impl Atomics for Model {
    type W = AtomicU64;
    fn fence() {
        shuttle::sync::atomic::fence(Ordering::SeqCst)
    }
    fn before_copy() {
        shuttle::thread::yield_now();
    }
}

const THRESHOLD: u64 = 128;
/// The consumer's stamp key.
const KEY: u64 = 0x5eed_f00d_1234_5678;
const PRODUCERS: Rank = 2;

/// A ring in heap memory, shared by its two threads.
struct HeapRing {
    hdr: RingHdr<AtomicU64>,
    data: std::cell::UnsafeCell<Vec<u8>>,
    /// The ring's words as the model's atomics (frame stamps live there).
    words: Vec<AtomicU64>,
}

// SAFETY: the data bytes are handed between the threads by the ring protocol under test.
unsafe impl Sync for HeapRing {}
// SAFETY: as above.
unsafe impl Send for HeapRing {}

impl HeapRing {
    fn new(cap: usize) -> HeapRing {
        let w = || AtomicU64::new(0);
        HeapRing {
            hdr: RingHdr {
                head: Line(w()),
                tail: Line(w()),
                prod_wait: Line(w()),
                ctl: Ctl {
                    closed: w(),
                    ready: AtomicU64::new(1),
                    cma_threshold: AtomicU64::new(THRESHOLD),
                    stamp_key: AtomicU64::new(KEY),
                },
            },
            data: std::cell::UnsafeCell::new(vec![0; cap]),
            words: (0..cap / 8).map(|_| w()).collect(),
        }
    }

    fn ring(&self) -> Ring<Model> {
        // SAFETY: the `HeapRing` (in an `Arc`) outlives the threads using the returned ring.
        unsafe {
            let data = &mut *self.data.get();
            Ring::new(&self.hdr, data.as_mut_ptr(), self.words.as_ptr(), data.len())
        }
    }
}

/// Single-copy sources still owned by a producer (address and length).
type Alive = Arc<std::sync::Mutex<HashSet<(u64, usize)>>>;

/// Bytes that deregister themselves when the producer frees them.
struct Tracked {
    data: Vec<u8>,
    alive: Alive,
}

impl AsRef<[u8]> for Tracked {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.alive.lock().unwrap().remove(&(self.data.as_ptr() as u64, self.data.len()));
    }
}

/// The other side's memory: sources checked against `alive` when read; destinations written.
struct ModelRemote {
    alive: Alive,
}

impl Remote for ModelRemote {
    fn read(&mut self, addr: u64, dst: &mut [u8]) -> Result<(), TransportError> {
        shuttle::thread::yield_now();
        let within = |&(start, len): &(u64, usize)| addr >= start && addr + dst.len() as u64 <= start + len as u64;
        assert!(self.alive.lock().unwrap().iter().any(within), "single-copy source freed before the copy");
        // SAFETY: the producer keeps the source alive (checked just above) until `tail` passes
        // the descriptor, which happens after this copy.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn write(&mut self, addr: u64, src: &[u8]) -> Result<(), TransportError> {
        shuttle::thread::yield_now();
        // SAFETY: the consumer offered `addr` (the second half of its destination, which lives as
        // long as the scenario) and does not let go of it before this write is done.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) };
        Ok(())
    }

    fn alive(&mut self) -> bool {
        true
    }
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len).map(|i| (seed as usize * 31 + i * 7) as u8).collect()
}

/// The frames producer `src` sends: sizes around and beyond the ring and the single-copy threshold.
/// What the producers send.
#[derive(Clone, Copy)]
enum Mix {
    /// Eager and `Data` frames, streamed and by descriptor.
    Mixed,
    /// Eager frames only, `n` times five (nothing makes the consumer publish `tail` at once).
    Eager(usize),
    /// Descriptors (split copies) among small eager frames, which wrap around the ring and may
    /// land where a descriptor was.
    Descriptors,
}

fn frames(src: Rank, mix: Mix) -> Vec<(Header, Vec<u8>)> {
    let eager = |tag: u64, len: usize| (Header { src, tag, len: len as u32, ..Header::new(Kind::Eager) }, len);
    let data =
        |seq: u64, aux: u64, len: usize| (Header { src, seq, aux, len: len as u32, ..Header::new(Kind::Data) }, len);
    let frames: Vec<_> = match mix {
        Mix::Mixed => vec![eager(1, 20), data(2, 0, 100), eager(3, 0), data(4, 100, 200), eager(5, 3)],
        Mix::Eager(n) => [eager(1, 20), eager(2, 40), eager(3, 0), eager(4, 8), eager(5, 3)].repeat(n),
        Mix::Descriptors => {
            vec![data(1, 0, 130), eager(2, 8), eager(3, 8), data(4, 130, 200), eager(5, 8), eager(6, 8), eager(7, 8)]
        }
    };
    frames.into_iter().map(|(h, len)| (h, pattern(h.tag + h.seq + src as u64 * 100, len))).collect()
}

struct ModelSink {
    got: Vec<(Rank, Header, Vec<u8>)>,
    /// Rendezvous destination of each producer.
    dest: Vec<Vec<u8>>,
}

// SAFETY: `dest` buffers are never resized while the consumer runs.
unsafe impl Sink for ModelSink {
    fn data_dest(&mut self, peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        Ok(Some(&mut self.dest[peer as usize - 1][h.aux as usize..][..h.len as usize]))
    }
    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        let body = if h.kind == Kind::Data {
            self.dest[peer as usize - 1][h.aux as usize..][..h.len as usize].to_vec()
        } else {
            payload.to_vec()
        };
        self.got.push((peer, h, body));
    }
    fn peer_lost(&mut self, peer: Rank, err: TransportError) {
        panic!("peer {peer} lost: {err}");
    }
}

/// Two producers send the frames of [`frames`] through rings of `cap` bytes.
fn scenario(cap: usize, mix: Mix, direct: bool) {
    let rings: Vec<Arc<HeapRing>> = (0..PRODUCERS).map(|_| Arc::new(HeapRing::new(cap))).collect();
    let sleeping = Arc::new(AtomicU64::new(0));
    let consumer_bell = Arc::new(Bell::default());
    let producer_bells: Vec<Arc<Bell>> = (0..PRODUCERS).map(|_| Arc::new(Bell::default())).collect();
    let alive: Alive = Arc::new(std::sync::Mutex::new(HashSet::new()));

    let mut threads = Vec::new();
    for i in 0..PRODUCERS as usize {
        let (hr, sleeping, cbell, pbell, alive) =
            (rings[i].clone(), sleeping.clone(), consumer_bell.clone(), producer_bells[i].clone(), alive.clone());
        threads.push(shuttle::thread::spawn(move || {
            let ring = hr.ring();
            let mut out = Outbox::default();
            let mut remote = ModelRemote { alive: alive.clone() };
            for (h, p) in frames(i as Rank + 1, mix) {
                alive.lock().unwrap().insert((p.as_ptr() as u64, p.len()));
                let payload = Bytes::from_owner(Tracked { data: p, alive: alive.clone() });
                if !direct {
                    out.push(&h, payload);
                    continue;
                }
                // As `ShmTransport::send`: straight into the ring when nothing is queued and it
                // fits, else queued and flushed.
                let f = match out.write_now(&ring, &*sleeping, &h, &payload) {
                    Some(f) => f.unwrap(),
                    None => {
                        out.push(&h, payload);
                        out.flush(&ring, &*sleeping).unwrap()
                    }
                };
                if f.ring {
                    cbell.ring();
                }
            }
            loop {
                out.help(&ring, &mut remote);
                let f = out.flush(&ring, &*sleeping).unwrap();
                if f.ring {
                    cbell.ring();
                }
                if !out.pending() {
                    return;
                }
                // As `ShmTransport::poll_ready`: announce, fence, look again, sleep.
                assert!(out.announce_sleep(&ring));
                Model::fence();
                if !out.can_progress(&ring) {
                    pbell.wait();
                }
                ring.hdr().prod_wait.0.store(0, Ordering::Relaxed);
            }
        }));
    }

    let consumer = {
        let (rings, sleeping, cbell, pbells, alive) =
            (rings.clone(), sleeping.clone(), consumer_bell.clone(), producer_bells.clone(), alive.clone());
        shuttle::thread::spawn(move || {
            let limits = Limits { world_size: PRODUCERS + 1, eager_limit: 64, chunk: 1024, max_message: 4096 };
            let views: Vec<Ring<Model>> = rings.iter().map(|r| r.ring()).collect();
            // Single copies are split (the 200-byte one): the producers may write its second half.
            let new = |p| Inbox::new(p, limits, THRESHOLD, KEY, THRESHOLD);
            let mut inboxes: Vec<Inbox> = (1..=PRODUCERS).map(new).collect();
            let mut sink = ModelSink { got: Vec::new(), dest: vec![vec![0; 400]; PRODUCERS as usize] };
            let mut remote = ModelRemote { alive };
            let total = PRODUCERS as usize * frames(1, mix).len();
            loop {
                for (k, inbox) in inboxes.iter_mut().enumerate() {
                    let p = inbox.parse(&views[k], &mut sink, &mut remote).unwrap();
                    if p.released && inbox.producer_waits(&views[k]) {
                        pbells[k].ring();
                    }
                }
                if sink.got.len() == total {
                    return sink.got;
                }
                sleeping.store(1, Ordering::Relaxed);
                Model::fence();
                if !inboxes.iter().zip(&views).any(|(ib, r)| ib.has_input(r)) {
                    cbell.wait();
                }
                sleeping.store(0, Ordering::Relaxed);
            }
        })
    };

    for t in threads {
        t.join().unwrap();
    }
    let got = consumer.join().unwrap();
    for src in 1..=PRODUCERS {
        let mine: Vec<_> = got.iter().filter(|(p, ..)| *p == src).map(|(_, h, b)| (*h, b.clone())).collect();
        assert_eq!(mine, frames(src, mix), "frames of producer {src}: order and content");
    }
    assert!(alive.lock().unwrap().is_empty(), "every single-copy source is released at the end");
}

/// Random schedules, then schedules of shuttle's PCT search (depth 3).
fn explore(f: fn(), iterations: usize) {
    shuttle::check_random(f, iterations);
    shuttle::check_pct(f, iterations, 3);
}

/// Two cache lines: frames start at either, whole or streaming through; `tail` is published
/// after every parse.
#[test]
fn ring_and_doorbells() {
    explore(|| scenario(128, Mix::Mixed, false), 3000);
}

/// A ring large enough for the consumer to publish `tail` lazily (every 128 bytes), and whole
/// eager frames only: the producers fill it and must be rung when space comes back.
#[test]
fn lazy_release() {
    explore(|| scenario(512, Mix::Eager(4), false), 1000);
}

/// Descriptors that may stream through a full ring in pieces, with frames after them: the
/// consumer must not release a descriptor's space while it uses the descriptor's words.
#[test]
fn descriptors_in_a_full_ring() {
    explore(|| scenario(128, Mix::Descriptors, false), 3000);
}

/// Frames written straight into the ring ([`Outbox::write_now`], the latency path) as they come,
/// among frames that had to be queued (the ring full, or a frame queued before them): order,
/// content and wake-ups as with the queue alone.
#[test]
fn direct_writes_among_queued_frames() {
    explore(|| scenario(128, Mix::Mixed, true), 3000);
    explore(|| scenario(512, Mix::Eager(4), true), 1000);
}

/// The same protocol under loom, which (unlike shuttle) models weak memory: the sleeping flags
/// and their SeqCst fences must prevent lost wake-ups even when stores are seen late. One frame
/// larger than the ring, so the producer also has to sleep until the consumer frees space; and
/// a frame queued then one written directly ([`Outbox::write_now`], the latency path), each
/// published to a consumer that may be going to sleep.
mod weak_memory {
    use std::sync::atomic::Ordering;

    use bytes::Bytes;
    use loom::sync::atomic::AtomicU64;
    use loom::sync::{Arc, Condvar, Mutex};

    use super::super::ring::{Atomics, Ctl, Inbox, Line, Outbox, Ring, RingHdr, Word};
    use super::ModelSink;
    use crate::wire::{Header, Kind, Limits};

    struct Loom;

    model_primitives!();
    impl Atomics for Loom {
        type W = AtomicU64;
        fn fence() {
            loom::sync::atomic::fence(Ordering::SeqCst)
        }
    }

    const CAP: usize = 128;

    struct Shared {
        hdr: RingHdr<AtomicU64>,
        data: std::cell::UnsafeCell<[u8; CAP]>,
        words: [AtomicU64; CAP / 8],
        sleeping: AtomicU64,
        consumer_bell: Bell,
        producer_bell: Bell,
    }

    // SAFETY: the data bytes are handed between the threads by the ring protocol under test.
    unsafe impl Sync for Shared {}
    // SAFETY: as above.
    unsafe impl Send for Shared {}

    impl Shared {
        fn ring(&self) -> Ring<Loom> {
            // SAFETY: `Shared` (in an `Arc`) outlives both threads' rings.
            unsafe { Ring::new(&self.hdr, self.data.get().cast(), self.words.as_ptr(), CAP) }
        }
    }

    fn frame(tag: u64, len: u8) -> (Header, Bytes) {
        let h = Header { src: 1, tag, len: len as u32, ..Header::new(Kind::Eager) };
        (h, Bytes::from((0..len).collect::<Vec<_>>()))
    }

    /// A fresh ring whose consumer has connected (stamp key 0).
    fn shared() -> Arc<Shared> {
        let w = || AtomicU64::new(0);
        Arc::new(Shared {
            hdr: RingHdr {
                head: Line(w()),
                tail: Line(w()),
                prod_wait: Line(w()),
                ctl: Ctl { closed: w(), ready: AtomicU64::new(1), cma_threshold: w(), stamp_key: w() },
            },
            data: std::cell::UnsafeCell::new([0; CAP]),
            words: std::array::from_fn(|_| w()),
            sleeping: w(),
            consumer_bell: Bell::default(),
            producer_bell: Bell::default(),
        })
    }

    /// The producer's side of `ShmTransport`: flushes what `out` holds, sleeping whenever the
    /// ring is full, until all of it is in.
    fn drain(sh: &Shared, ring: &Ring<Loom>, out: &mut Outbox) {
        loop {
            if out.flush(ring, &sh.sleeping).unwrap().ring {
                sh.consumer_bell.ring();
            }
            if !out.pending() {
                return;
            }
            out.announce_sleep(ring);
            Loom::fence();
            if !out.can_progress(ring) {
                sh.producer_bell.wait();
            }
            ring.hdr().prod_wait.0.store(0, Ordering::Relaxed);
        }
    }

    /// The consumer's side: parses until `n` frames are in, sleeping whenever the ring is empty.
    fn consume(sh: &Shared, n: usize) -> Vec<(crate::wire::Rank, Header, Vec<u8>)> {
        let ring = sh.ring();
        let limits = Limits { world_size: 2, eager_limit: 256, chunk: 64, max_message: 256 };
        let mut inbox = Inbox::new(1, limits, 0, 0, 0);
        let mut sink = ModelSink { got: Vec::new(), dest: vec![Vec::new()] };
        let mut remote = super::ModelRemote { alive: Default::default() };
        loop {
            let p = inbox.parse(&ring, &mut sink, &mut remote).unwrap();
            if p.released && inbox.producer_waits(&ring) {
                sh.producer_bell.ring();
            }
            if sink.got.len() == n {
                return sink.got;
            }
            sh.sleeping.store(1, Ordering::Relaxed);
            Loom::fence();
            if !inbox.has_input(&ring) {
                sh.consumer_bell.wait();
            }
            sh.sleeping.store(0, Ordering::Relaxed);
        }
    }

    fn model(f: impl Fn() + Sync + Send + 'static) {
        let mut b = loom::model::Builder::new();
        b.preemption_bound = Some(2);
        b.check(f);
    }

    #[test]
    fn no_lost_wake_up_under_weak_memory() {
        // Larger than the ring: it streams through.
        let big = || frame(7, 200);
        model(move || {
            let sh = shared();
            let p = sh.clone();
            let producer = loom::thread::spawn(move || {
                let (ring, mut out) = (p.ring(), Outbox::default());
                let (h, payload) = big();
                out.push(&h, payload);
                drain(&p, &ring, &mut out);
            });
            let got = consume(&sh, 1);
            producer.join().unwrap();
            let (h, payload) = big();
            assert_eq!(got, vec![(1, h, payload.to_vec())]);
        });
    }

    #[test]
    fn direct_write_wakes_the_consumer_under_weak_memory() {
        model(|| {
            let sh = shared();
            let p = sh.clone();
            let producer = loom::thread::spawn(move || {
                let (ring, mut out) = (p.ring(), Outbox::default());
                // Queued first (the producer learns the consumer's stamp key from it), then
                // straight into the ring: the two 56-byte frames fit in its two lines whatever
                // the consumer has taken.
                let (h, payload) = frame(1, 8);
                out.push(&h, payload);
                drain(&p, &ring, &mut out);
                let (h, payload) = frame(2, 8);
                let direct = out.write_now(&ring, &p.sleeping, &h, &payload).expect("written directly");
                if direct.unwrap().ring {
                    p.consumer_bell.ring();
                }
            });
            let got = consume(&sh, 2);
            producer.join().unwrap();
            let expect: Vec<_> = [frame(1, 8), frame(2, 8)].into_iter().map(|(h, p)| (1, h, p.to_vec())).collect();
            assert_eq!(got, expect);
        });
    }
}
