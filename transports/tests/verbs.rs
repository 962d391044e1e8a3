//! The verbs transport on a real device (Soft-RoCE `rxe0` in the VM of scripts/verbs-vm.sh):
//! two endpoints in one process, connected to each other through the device.
//!
//! Without an RDMA device every test prints that it is skipped and passes, unless
//! `FERROCOMM_REQUIRE_VERBS` is set (the VM run sets it).

#![cfg(feature = "verbs")]

use std::task::Poll;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm_transports::verbs::{Eager, Rendezvous, VerbsConfig, VerbsEndpoint, VerbsTransport, device_names};
use ferrocomm_transports::{Header, Kind, Limits, Transport, TransportError};

mod common;
use common::{TestSink, eager, pattern, socket_pair};

const KIB: usize = 1024;
const MIB: usize = 1 << 20;
const EAGER: usize = 8 * KIB;
const CHUNK: usize = 512 * KIB;

fn limits() -> Limits {
    Limits { world_size: 2, eager_limit: EAGER, chunk: CHUNK, max_message: 64 * MIB }
}

fn device_here(test: &str) -> bool {
    let here = !device_names().is_empty();
    if !here {
        assert!(std::env::var_os("FERROCOMM_REQUIRE_VERBS").is_none(), "{test}: no RDMA device");
        eprintln!("{test}: skipped, no RDMA device here (scripts/verbs-vm.sh runs it over Soft-RoCE)");
    }
    here
}

struct Pair {
    // Dropped before the sinks they write into, and before the runtime they are registered with.
    t: [VerbsTransport; 2],
    s: [TestSink; 2],
    rt: tokio::runtime::Runtime,
}

fn pair(rendezvous: Rendezvous, slots: u32) -> Pair {
    pair_with(VerbsConfig { rendezvous, slots, ..VerbsConfig::default() })
}

fn pair_with(cfg: VerbsConfig) -> Pair {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (e0, d0) = VerbsEndpoint::create(0, limits(), cfg.clone()).unwrap();
    let (e1, d1) = VerbsEndpoint::create(1, limits(), cfg).unwrap();
    let (a, b) = socket_pair();
    let _g = rt.enter();
    let t0 = e0.connect(vec![(1, d1)], vec![None, Some(a)], limits()).unwrap();
    let t1 = e1.connect(vec![(0, d0)], vec![Some(b), None], limits()).unwrap();
    drop(_g);
    Pair { t: [t0, t1], s: [TestSink::default(), TestSink::default()], rt }
}

impl Pair {
    /// Progresses both sides until `done`.
    fn run_until(&mut self, what: &str, mut done: impl FnMut(&[TestSink; 2]) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done(&self.s) {
            for i in 0..2 {
                self.t[i].progress(&mut self.s[i]);
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}: {:?} {:?} lost {:?} {:?} frames {} {}",
                self.t[0].stats(),
                self.t[1].stats(),
                self.s[0].lost,
                self.s[1].lost,
                self.s[0].frames.len(),
                self.s[1].frames.len()
            );
        }
    }

    /// Progresses only side `i`, sleeping in `poll_ready` (completion channel) when idle.
    fn sleep_until(&mut self, i: usize, what: &str, mut done: impl FnMut(&TestSink) -> bool) {
        let Pair { t, s, rt } = self;
        let (t, s) = (&mut t[i], &mut s[i]);
        let fut = std::future::poll_fn(|cx| {
            loop {
                while t.progress(s) > 0 {}
                if done(s) {
                    return Poll::Ready(());
                }
                if t.poll_ready(cx).is_pending() {
                    return Poll::Pending;
                }
            }
        });
        let r = rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), fut).await });
        assert!(r.is_ok(), "stalled waiting for {what}");
    }
}

/// Sends a rendezvous message of `len` bytes from 0 to 1 the way the engine does (RTS, CTS,
/// data chunks) out of `src`, and checks it arrived whole.
fn rendezvous(p: &mut Pair, msg: u64, src: &Bytes) {
    let len = src.len();
    p.s[1].data = vec![0u8; len];
    let base = p.s[1].frames.len();
    p.t[0].send(1, Header { seq: msg, aux: len as u64, ..Header::new(Kind::Rts) }, Bytes::new());
    p.run_until("RTS", |s| s[1].frames.len() > base);
    let cts_base = p.s[0].frames.len();
    p.t[1].send(0, Header { seq: msg, aux: 5, ..Header::new(Kind::Cts) }, Bytes::new());
    p.run_until("CTS", |s| s[0].frames.len() > cts_base);
    let (_, cts, _) = &p.s[0].frames[cts_base];
    assert_eq!((cts.kind, cts.seq, cts.aux), (Kind::Cts, msg, 5));
    let mut off = 0;
    while off < len {
        let n = CHUNK.min(len - off);
        let h = Header { seq: 5, aux: off as u64, len: n as u32, ..Header::new(Kind::Data) };
        p.t[0].send(1, h, src.slice(off..off + n));
        off += n;
    }
    let chunks = len.div_ceil(CHUNK);
    p.run_until("data", |s| s[1].frames.len() >= base + 1 + chunks);
    let got: usize = p.s[1].frames[base + 1..].iter().map(|(_, h, _)| h.len as usize).sum();
    assert_eq!(got, len);
    assert!(p.s[1].data == src[..], "rendezvous data differs");
    // Until the sender has its chunks back (read: DONE arrived; write: completions polled).
    let deadline = Instant::now() + Duration::from_secs(60);
    while p.t[0].in_flight() > 0 || p.t[1].in_flight() > 0 {
        for i in 0..2 {
            p.t[i].progress(&mut p.s[i]);
        }
        assert!(Instant::now() < deadline, "sender never got its chunks back");
    }
}

/// Eager frames over `p`: far more than slot credits one way while the receiver idles, then
/// both ways at once, all in order and intact.
fn eager_traffic(p: &mut Pair, slots: u64) {
    // Far more frames than slots, while the receiver is idle: the sender stalls on slot credits.
    let sent: Vec<_> = (0..200u64).map(|i| eager(0, i, [0, 1, 100, EAGER][i as usize % 4])).collect();
    let posted = p.t[0].stats().slots_sent;
    for (i, (h, b)) in sent.iter().enumerate() {
        p.t[0].send(1, *h, b.clone());
        if i == 0 {
            // Nothing before it: posted at once, with no progress round (in flight, not queued).
            let now = p.t[0].stats().slots_sent;
            assert!(!p.t[0].has_queued_output() && now == posted + 1, "first frame not posted at once");
        }
    }
    for _ in 0..50 {
        p.t[0].progress(&mut p.s[0]);
    }
    assert!(p.t[0].has_pending_output(), "{slots} slots cannot hold 200 frames");
    assert!(p.t[0].stats().slots_sent <= slots);
    p.run_until("200 frames", |s| s[1].frames.len() == 200);
    for (i, ((peer, h, b), (wh, wb))) in p.s[1].frames.iter().zip(&sent).enumerate() {
        assert_eq!((*peer, h, b), (0, wh, wb), "frame {i}");
    }
    assert!(p.t[1].stats().credit_updates > 0, "one-way traffic needs explicit credit updates");
    // Both ways at once, both sides stalled on slots: the reserved slot carries the credit.
    let (n0, n1) = (p.s[0].frames.len(), p.s[1].frames.len());
    for i in 0..300u64 {
        for from in 0..2u32 {
            let (h, b) = eager(from, 1000 + i, [0, 1, 100, EAGER][i as usize % 4]);
            p.t[from as usize].send(1 - from, h, b);
        }
    }
    p.run_until("300 frames each way", |s| s[0].frames.len() == n0 + 300 && s[1].frames.len() == n1 + 300);
    for (i, (_, h, _)) in p.s[0].frames[n0..].iter().enumerate() {
        assert_eq!((h.src, h.tag), (1, 1000 + i as u64), "order, 1 to 0");
    }
}

#[test]
fn eager_frames_in_order_with_credits_and_sleep() {
    if !device_here("eager_frames_in_order_with_credits_and_sleep") {
        return;
    }
    for eager in [Eager::Ring, Eager::SharedQueue] {
        let mut p = pair_with(VerbsConfig { slots: 4, eager, ..VerbsConfig::default() });
        eager_traffic(&mut p, 4);
        sleep_and_wake(&mut p);
        let (s0, s1) = (p.t[0].stats(), p.t[1].stats());
        assert_eq!(s1.srq_buffers, if eager == Eager::Ring { 0 } else { 4 }, "{eager:?}");
        println!("{eager:?}: sender {s0:?}\nreceiver {s1:?}");
    }
}

/// A shared receive queue with fewer buffers than the sender has credits: bursts find the pool
/// empty, the device holds the sender back (RNR) until buffers are reposted, nothing is lost.
#[test]
fn shared_queue_smaller_than_the_credits_delays_but_loses_nothing() {
    if !device_here("shared_queue_smaller_than_the_credits_delays_but_loses_nothing") {
        return;
    }
    let mut p =
        pair_with(VerbsConfig { slots: 16, eager: Eager::SharedQueue, srq_buffers: 2, ..VerbsConfig::default() });
    assert_eq!(p.t[1].stats().srq_buffers, 2);
    let t = Instant::now();
    eager_traffic(&mut p, 16);
    println!("800 frames through a pool of 2 buffers (16 credits) in {:?}", t.elapsed());
    assert!(p.s[0].lost.is_empty() && p.s[1].lost.is_empty());
}

/// Sleeping on the completion channel: 1 sleeps, 0 sends.
fn sleep_and_wake(p: &mut Pair) {
    let (h, b) = eager(0, 999, 10);
    p.t[0].send(1, h, b);
    p.t[0].progress(&mut p.s[0]);
    let n1 = p.s[1].frames.len();
    p.sleep_until(1, "a frame while asleep", |s| s.frames.len() == n1 + 1);
    assert!(p.s[0].lost.is_empty() && p.s[1].lost.is_empty());
}

#[test]
fn rendezvous_by_rdma_write_and_by_rdma_read() {
    if !device_here("rendezvous_by_rdma_write_and_by_rdma_read") {
        return;
    }
    for (mode, eager) in [
        (Rendezvous::Write, Eager::Ring),
        (Rendezvous::Read, Eager::Ring),
        (Rendezvous::Write, Eager::SharedQueue),
        (Rendezvous::Read, Eager::SharedQueue),
    ] {
        let mut p = pair_with(VerbsConfig { rendezvous: mode, slots: 8, eager, ..VerbsConfig::default() });
        for (msg, len) in [(1u64, EAGER + 1), (2, CHUNK), (3, 3 * MIB + 3)] {
            let src = Bytes::from(pattern(msg, len));
            rendezvous(&mut p, msg, &src);
        }
        let (s0, s1) = (p.t[0].stats(), p.t[1].stats());
        let chunks = 1 + 1 + 7;
        match mode {
            Rendezvous::Write => assert_eq!((s0.rdma_writes, s1.rdma_reads), (chunks, 0), "{mode:?}"),
            Rendezvous::Read => assert_eq!((s0.rdma_writes, s1.rdma_reads), (0, chunks), "{mode:?}"),
        }
        println!("{mode:?}, {eager:?}: sender {s0:?}\nreceiver {s1:?}");
    }
}

/// A buffer the program frees while it is registered is never read through the stale
/// registration: the next buffer (often at the very same address) is read with its own.
#[test]
fn freed_buffer_is_never_read_through_a_stale_registration() {
    if !device_here("freed_buffer_is_never_read_through_a_stale_registration") {
        return;
    }
    let mut p = pair(Rendezvous::Read, 8);
    let mut same_address = 0;
    let rounds = 20u64;
    for round in 0..rounds {
        let a = Bytes::from(pattern(round, MIB));
        let addr = a.as_ptr();
        rendezvous(&mut p, 2 * round, &a);
        drop(a); // freed while the cache holds its registration
        p.t[0].sweep_registrations();
        let b = Bytes::from(pattern(1000 + round, MIB));
        same_address += u32::from(b.as_ptr() == addr);
        rendezvous(&mut p, 2 * round + 1, &b); // checks the receiver got b's bytes
    }
    let c = p.t[0].stats().cache;
    // The second chunk of each message hits the registration its first chunk made.
    assert_eq!(c.hits, 2 * rounds, "{c:?}");
    assert_eq!(c.misses, 2 * rounds, "one registration per message: {c:?}");
    assert!(c.invalidations >= rounds, "{c:?}");
    println!("new buffer at the freed buffer's address in {same_address} of {rounds} rounds; cache {c:?}");
    // The same buffer sent twice is registered once.
    let a = Bytes::from(pattern(7, MIB));
    rendezvous(&mut p, 100, &a);
    rendezvous(&mut p, 101, &a);
    assert_eq!(p.t[0].stats().cache.hits, 2 * rounds + 3, "the resent buffer hits");
}

#[test]
fn a_peer_that_goes_away_is_reported() {
    if !device_here("a_peer_that_goes_away_is_reported") {
        return;
    }
    for eager in [Eager::Ring, Eager::SharedQueue] {
        peer_goes_away(pair_with(VerbsConfig { slots: 8, eager, ..VerbsConfig::default() }));
    }
}

fn peer_goes_away(mut p: Pair) {
    let (h, b) = eager(0, 1, 10);
    p.t[0].send(1, h, b);
    p.run_until("a frame", |s| s[1].frames.len() == 1);
    // Rank 1 waits for a rendezvous from 0 with its buffer announced, then 0 disappears.
    p.s[1].data = vec![0u8; MIB];
    p.t[0].send(1, Header { seq: 1, aux: MIB as u64, ..Header::new(Kind::Rts) }, Bytes::new());
    p.run_until("RTS", |s| s[1].frames.len() == 2);
    p.t[1].send(0, Header { seq: 1, aux: 0, ..Header::new(Kind::Cts) }, Bytes::new());
    p.run_until("CTS", |s| !s[0].frames.is_empty());
    let Pair { t: [t0, mut t1], mut s, rt } = p;
    let t0_start = Instant::now();
    drop(t0);
    let [_, s1] = &mut s;
    let deadline = Instant::now() + Duration::from_secs(20);
    let _g = rt.enter();
    while s1.lost.is_empty() {
        t1.progress(s1);
        assert!(Instant::now() < deadline, "peer loss not reported");
    }
    assert!(matches!(s1.lost[..], [(0, TransportError::Closed)]), "{:?}", s1.lost);
    println!("loss reported after {:?}", t0_start.elapsed());
    drop(t1);
}

/// Ranks that disagree on the eager path cannot talk: connecting says so instead of hanging.
#[test]
fn ranks_with_different_eager_paths_are_refused() {
    if !device_here("ranks_with_different_eager_paths_are_refused") {
        return;
    }
    let _rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let _g = _rt.enter();
    let (e0, _) = VerbsEndpoint::create(0, limits(), VerbsConfig::default()).unwrap();
    let srq = VerbsConfig { eager: Eager::SharedQueue, ..VerbsConfig::default() };
    let (_e1, d1) = VerbsEndpoint::create(1, limits(), srq).unwrap();
    let e = e0.connect(vec![(1, d1)], vec![None, None], limits()).err().expect("refused");
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    assert!(e.to_string().contains("eager path differs"), "{e}");
}
