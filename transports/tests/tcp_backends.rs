//! The same checks against both TCP backends (and across them), over real loopback sockets.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm_transports::tcp::{self, Backend};
use ferrocomm_transports::{Header, Kind, Limits, Rank, Transport, TransportError, WireError};

mod common;
use common::{DISCARD, REFUSE, TestSink, check_frames, data, eager, socket_pair};

const EAGER: usize = 64 * 1024;
const MIB: usize = 1 << 20;

fn limits() -> Limits {
    Limits { world_size: 2, eager_limit: EAGER, chunk: 8 * MIB, max_message: 64 * MIB }
}

struct Node {
    // Declared first, so dropped before the sink whose buffer it may write into.
    t: Box<dyn Transport>,
    s: TestSink,
}

impl Node {
    fn new(backend: Backend, conns: Vec<Option<TcpStream>>, data_len: usize) -> Node {
        let t = tcp::build(backend, conns, limits(), EAGER).expect("build transport");
        let want = if backend == Backend::Uring { "tcp-uring" } else { "tcp-portable" };
        assert_eq!(t.name(), want);
        Node { t, s: TestSink::with_data(data_len) }
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap()
}

/// Rank 0 and rank 1, connected.
fn pair(rt: &tokio::runtime::Runtime, b0: Backend, b1: Backend, data_len: usize) -> (Node, Node) {
    let _g = rt.enter();
    let (a, b) = socket_pair();
    (Node::new(b0, vec![None, Some(a)], data_len), Node::new(b1, vec![Some(b), None], data_len))
}

/// Rank 0 on `backend`, and a raw socket playing rank 1.
fn with_raw_peer(rt: &tokio::runtime::Runtime, backend: Backend, data_len: usize) -> (Node, TcpStream) {
    let _g = rt.enter();
    let (a, b) = socket_pair();
    (Node::new(backend, vec![None, Some(a)], data_len), b)
}

/// Calls `progress` on every node until `done`, panicking after a deadline.
fn run_until(nodes: &mut [&mut Node], what: &str, mut done: impl FnMut(&[&mut Node]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let mut work = 0;
        for n in nodes.iter_mut() {
            work += n.t.progress(&mut n.s);
        }
        if done(nodes) {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        if work == 0 {
            std::thread::yield_now();
        }
    }
}

/// Progresses for a while (lets bytes already sent arrive and be consumed).
fn spin(node: &mut Node) {
    for _ in 0..50 {
        node.t.progress(&mut node.s);
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Checks that `sink` received exactly `sent`, in order, with the right content.
fn check_received(sink: &TestSink, from: Rank, sent: &[(Header, Bytes)]) {
    check_frames(&sink.frames, from, sent, |_, h, want| &sink.data[h.aux as usize..][..h.len as usize] == want);
}

/// Sends `frames` from `a` (rank 0) to `b` (rank 1) and waits for all of them.
fn exchange(a: &mut Node, b: &mut Node, frames: &[(Header, Bytes)]) {
    for (h, p) in frames {
        a.t.send(1, *h, p.clone());
    }
    run_until(&mut [a, b], "frames", |n| n[1].s.frames.len() >= frames.len() && !n[0].t.has_pending_output());
    check_received(&b.s, 0, frames);
    assert!(a.s.lost.is_empty() && b.s.lost.is_empty(), "unexpected loss");
}

fn eager_in_order(b0: Backend, b1: Backend) {
    let rt = runtime();
    let (mut a, mut b) = pair(&rt, b0, b1, 0);
    let sizes = [0, 1, 7, 47, 48, 49, 1000, 4095, 4096, 4097, 65535, EAGER];
    let frames: Vec<_> = (0..300).map(|i| eager(0, i as u64, sizes[i % sizes.len()])).collect();
    exchange(&mut a, &mut b, &frames);
    // And back the other way.
    let back: Vec<_> = (0..50).map(|i| eager(1, 1000 + i as u64, sizes[i % sizes.len()])).collect();
    for (h, p) in &back {
        b.t.send(0, *h, p.clone());
    }
    run_until(&mut [&mut a, &mut b], "frames back", |n| n[0].s.frames.len() >= back.len());
    check_received(&a.s, 1, &back);
}

fn data_in_place(b0: Backend, b1: Backend) {
    let rt = runtime();
    let (mut a, mut b) = pair(&rt, b0, b1, 16 * MIB);
    let frames = vec![
        eager(0, 1, 100),
        data(0, 2, 0, 5 * MIB),
        data(0, 3, 5 * MIB, 3 * MIB + 17),
        eager(0, 4, 0),
        data(0, DISCARD, 0, 2 * MIB),
        data(0, 5, 9 * MIB, 6 * MIB),
        eager(0, 6, EAGER),
        data(0, 7, 15 * MIB, 1),
    ];
    exchange(&mut a, &mut b, &frames);
}

fn interleaved_volume(b0: Backend, b1: Backend) {
    let rt = runtime();
    let (mut a, mut b) = pair(&rt, b0, b1, 32 * MIB);
    let mut seed = 12345u64;
    let mut make = |src: Rank| -> Vec<(Header, Bytes)> {
        (0..1200u64)
            .map(|i| {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let tag = (src as u64) << 32 | i;
                if i % 40 == 20 {
                    let k = (i / 40) as usize;
                    data(src, tag, k * MIB, MIB - (seed >> 50) as usize)
                } else {
                    eager(src, tag, (seed >> 33) as usize % (EAGER + 1))
                }
            })
            .collect()
    };
    let (to_b, to_a) = (make(0), make(1));
    // Queue everything at once: the socket buffers fill, so sends are partial.
    for (h, p) in &to_b {
        a.t.send(1, *h, p.clone());
    }
    for (h, p) in &to_a {
        b.t.send(0, *h, p.clone());
    }
    assert!(a.t.has_pending_output() && b.t.has_pending_output());
    run_until(&mut [&mut a, &mut b], "both directions", |n| {
        n[0].s.frames.len() >= to_a.len()
            && n[1].s.frames.len() >= to_b.len()
            && !n[0].t.has_pending_output()
            && !n[1].t.has_pending_output()
    });
    check_received(&b.s, 0, &to_b);
    check_received(&a.s, 1, &to_a);
    assert!(a.s.lost.is_empty() && b.s.lost.is_empty());
}

/// Keeps progressing a little and checks that `peer_lost` came exactly once.
fn expect_lost_once(node: &mut Node, what: &str) -> TransportError {
    run_until(&mut [&mut *node], what, |n| !n[0].s.lost.is_empty());
    for _ in 0..100 {
        node.t.progress(&mut node.s);
    }
    assert_eq!(node.s.lost.len(), 1, "{what}: reported exactly once: {:?}", node.s.lost);
    assert!(!node.t.has_pending_output());
    // Sends to a lost peer are dropped.
    node.t.send(1, Header { src: 0, ..Header::new(Kind::Credit) }, Bytes::new());
    assert!(!node.t.has_pending_output());
    node.s.lost[0].clone().1
}

fn peer_closes(backend: Backend) {
    let rt = runtime();
    // A whole frame, then EOF.
    let (mut node, mut raw) = with_raw_peer(&rt, backend, 0);
    let (h, p) = eager(1, 9, 300);
    raw.write_all(&h.encode()).unwrap();
    raw.write_all(&p).unwrap();
    drop(raw);
    let err = expect_lost_once(&mut node, "EOF");
    assert!(matches!(err, TransportError::Closed), "{err:?}");
    check_received(&node.s, 1, &[(h, p)]);

    // EOF in the middle of a data frame that is being received in place.
    let (mut node, mut raw) = with_raw_peer(&rt, backend, 4 * MIB);
    let (h, p) = data(1, 1, 0, 4 * MIB);
    raw.write_all(&h.encode()).unwrap();
    raw.write_all(&p[..MIB]).unwrap();
    spin(&mut node);
    drop(raw);
    let err = expect_lost_once(&mut node, "EOF mid-frame");
    assert!(matches!(err, TransportError::Closed), "{err:?}");
    assert!(node.s.frames.is_empty());

    // The peer vanishes while we have lots to send it.
    let (mut node, raw) = with_raw_peer(&rt, backend, 0);
    for i in 0..400 {
        let (h, p) = eager(0, i, EAGER);
        node.t.send(1, h, p);
    }
    for _ in 0..20 {
        node.t.progress(&mut node.s);
    }
    drop(raw);
    let err = expect_lost_once(&mut node, "reset while sending");
    assert!(matches!(err, TransportError::Closed | TransportError::Io(_)), "{err:?}");
}

/// The peer sends a last frame and goes away without reading what it was sent, so its kernel
/// resets the connection: our sends to it fail, yet the frame it sent before is delivered, and
/// only then the loss reported (a goodbye or a loss notice from a rank that then exits is not lost
/// to the failure of our send).
fn last_words_before_a_reset(backend: Backend) {
    let rt = runtime();
    let (mut node, mut raw) = with_raw_peer(&rt, backend, 0);
    // Output the peer never reads: the socket buffers fill, the rest stays queued.
    for i in 0..400 {
        let (h, p) = eager(0, i, EAGER);
        node.t.send(1, h, p);
    }
    for _ in 0..20 {
        node.t.progress(&mut node.s);
    }
    assert!(node.t.has_pending_output());
    let (h, p) = eager(1, 9, 300);
    raw.write_all(&h.encode()).unwrap();
    raw.write_all(&p).unwrap();
    // Closed with unread input: the kernel answers with a reset.
    drop(raw);
    let err = expect_lost_once(&mut node, "reset after a last frame");
    assert!(matches!(err, TransportError::Closed | TransportError::Io(_)), "{err:?}");
    check_received(&node.s, 1, &[(h, p)]);
}

fn garbage(backend: Backend) {
    let rt = runtime();
    let (mut node, mut raw) = with_raw_peer(&rt, backend, 0);
    raw.write_all(&[0xAB; 48]).unwrap();
    let err = expect_lost_once(&mut node, "bad magic");
    assert!(matches!(err, TransportError::Wire(WireError::BadMagic(_))), "{err:?}");
    // The connection is closed on our side: the peer sees EOF (or a reset).
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(matches!(raw.read(&mut [0; 16]), Ok(0) | Err(_)));

    // A data frame the receiver refuses.
    let (mut node, mut raw) = with_raw_peer(&rt, backend, 0);
    let (h, p) = data(1, REFUSE, 0, 1000);
    raw.write_all(&h.encode()).unwrap();
    raw.write_all(&p).unwrap();
    let err = expect_lost_once(&mut node, "refused data");
    assert!(matches!(err, TransportError::Wire(WireError::Unexpected(Kind::Data))), "{err:?}");
}

/// Sleeps on `node`'s `poll_ready` while a thread writes `frame` to `raw` after `delay`; asserts
/// that the frame woke the sleeper, and gives the socket back.
fn woken_by(
    rt: &tokio::runtime::Runtime,
    node: &mut Node,
    mut raw: TcpStream,
    frame: (Header, Bytes),
    delay: Duration,
    what: &str,
) -> TcpStream {
    let (h, p) = frame;
    let writer = std::thread::spawn(move || {
        std::thread::sleep(delay);
        raw.write_all(&h.encode()).unwrap();
        raw.write_all(&p).unwrap();
        raw
    });
    let t = &mut node.t;
    let woke = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), std::future::poll_fn(|cx| t.poll_ready(cx))).await
    });
    assert!(woke.is_ok(), "{what}");
    writer.join().unwrap()
}

fn poll_ready_wakes(backend: Backend) {
    let rt = runtime();
    let (mut node, raw) = with_raw_peer(&rt, backend, 0);
    // Arm everything until idle; then nothing is ready.
    spin(&mut node);
    while node.t.progress(&mut node.s) > 0 {}
    let mut cx = Context::from_waker(std::task::Waker::noop());
    assert!(node.t.poll_ready(&mut cx).is_pending(), "idle transport is not ready");

    let _raw = woken_by(
        &rt,
        &mut node,
        raw,
        eager(1, 5, 1234),
        Duration::from_millis(200),
        "poll_ready did not wake when data arrived",
    );
    run_until(&mut [&mut node], "frame after wake-up", |n| !n[0].s.frames.is_empty());
    check_received(&node.s, 1, &[eager(1, 5, 1234)]);

    // Sleep/wake cycles: poll_ready + progress alone drive a conversation to completion.
    let (mut a, mut b) = pair(&rt, backend, backend, 0);
    let frames: Vec<_> = (0..200).map(|i| eager(0, i, (i as usize * 977) % EAGER)).collect();
    for (h, p) in &frames {
        a.t.send(1, *h, p.clone());
    }
    let done = rt.block_on(async {
        let converse = std::future::poll_fn(|cx| {
            for n in [&mut a, &mut b] {
                while n.t.progress(&mut n.s) > 0 {}
            }
            if b.s.frames.len() == frames.len() {
                return Poll::Ready(());
            }
            // Register with both; stay pending only if neither is ready.
            if a.t.poll_ready(cx).is_ready() | b.t.poll_ready(cx).is_ready() {
                cx.waker().wake_by_ref();
            }
            Poll::Pending
        });
        tokio::time::timeout(Duration::from_secs(20), converse).await
    });
    assert!(done.is_ok(), "conversation stalled");
    check_received(&b.s, 0, &frames);
}

/// The reactor's cycle: a sleeper announces itself (`poll_ready`), wakes (`awake`), callers spin
/// (`progress` alone, which must need no doorbell), and the next sleeper is woken again by what
/// arrives while it sleeps. Messages go both ways, so receives re-armed after a completion and
/// replies share the rounds in every order.
fn sleep_wake_spin_cycles(backend: Backend) {
    let rt = runtime();
    let (mut node, mut raw) = with_raw_peer(&rt, backend, 0);
    for round in 0..20u64 {
        // Spin: the peer's frame arrives and is answered by progress calls alone.
        let (h, p) = eager(1, round, 100 + round as usize);
        raw.write_all(&h.encode()).unwrap();
        raw.write_all(&p).unwrap();
        run_until(&mut [&mut node], "frame while spinning", |n| n[0].s.frames.len() == 2 * round as usize + 1);
        let (rh, rp) = eager(0, round, 50);
        node.t.send(1, rh, rp.clone());
        run_until(&mut [&mut node], "reply written", |n| !n[0].t.has_pending_output());
        let mut got = vec![0u8; rh.encode().len() + rp.len()];
        raw.read_exact(&mut got).unwrap();
        assert_eq!(&got[..48], &rh.encode()[..]);
        assert_eq!(&got[48..], &rp[..]);

        // Sleep: idle first, then a frame arrives and must wake the sleeper.
        while node.t.progress(&mut node.s) > 0 {}
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(node.t.poll_ready(&mut cx).is_pending(), "idle transport is not ready (round {round})");
        let what = format!("sleeper not woken (round {round})");
        raw = woken_by(&rt, &mut node, raw, eager(1, 1000 + round, 10), Duration::from_millis(20), &what);
        node.t.awake();
        run_until(&mut [&mut node], "frame after wake-up", |n| n[0].s.frames.len() == 2 * round as usize + 2);
    }
    let want: Vec<_> = (0..20u64).flat_map(|r| [eager(1, r, 100 + r as usize), eager(1, 1000 + r, 10)]).collect();
    check_received(&node.s, 1, &want);
    assert!(node.s.lost.is_empty());
}

/// Operations submitted by a thread that then exits are cancelled by the kernel (io_uring); the
/// transport must re-arm them from whichever thread calls `progress` next.
fn progress_from_exited_thread(backend: Backend) {
    let rt = runtime();
    let (mut node, mut raw) = with_raw_peer(&rt, backend, 0);
    for i in 0..50 {
        let (h, p) = eager(0, i, 1000);
        node.t.send(1, h, p);
    }
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..5 {
                node.t.progress(&mut node.s);
            }
        });
    });
    let (h, p) = eager(1, 77, 5000);
    raw.write_all(&h.encode()).unwrap();
    raw.write_all(&p).unwrap();
    run_until(&mut [&mut node], "frame after thread exit", |n| {
        !n[0].s.frames.is_empty() && !n[0].t.has_pending_output()
    });
    check_received(&node.s, 1, &[(h, p)]);
    assert!(node.s.lost.is_empty());
    // Everything we queued reached the peer.
    let mut got = vec![0u8; 50 * (48 + 1000)];
    raw.read_exact(&mut got).unwrap();
    for (i, frame) in got.chunks(48 + 1000).enumerate() {
        let (h, p) = eager(0, i as u64, 1000);
        assert_eq!(&frame[..48], &h.encode()[..]);
        assert_eq!(&frame[48..], &p[..]);
    }
}

fn disconnect_and_drop(backend: Backend) {
    let rt = runtime();
    // Disconnect while a receive into the posted buffer is in flight: the loss is reported once,
    // with our reason, and after that the buffer is ours again.
    let (mut node, mut raw) = with_raw_peer(&rt, backend, 2 * MIB);
    let (h, p) = data(1, 1, 0, 2 * MIB);
    raw.write_all(&h.encode()).unwrap();
    raw.write_all(&p[..1000]).unwrap();
    spin(&mut node);
    assert_eq!(node.s.data[..1000], p[..1000]);
    node.t.disconnect(1, TransportError::Wire(WireError::Unexpected(Kind::Rts)));
    let err = expect_lost_once(&mut node, "disconnect");
    assert!(matches!(err, TransportError::Wire(WireError::Unexpected(Kind::Rts))), "{err:?}");
    node.s.data.iter_mut().for_each(|b| *b = 0);
    let _ = raw.write_all(&p[1000..]);
    spin(&mut node);
    assert!(node.s.data.iter().all(|&b| b == 0), "nothing writes into the buffer after peer_lost");
    assert!(node.s.frames.is_empty());
    raw.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert!(matches!(raw.read(&mut [0; 16]), Ok(0) | Err(_)), "the peer sees the connection end");

    // Dropping with receives and sends in flight neither hangs nor crashes.
    let (mut a, mut b) = pair(&rt, backend, backend, 8 * MIB);
    for i in 0..100 {
        let (h, p) = data(0, i, 0, MIB);
        a.t.send(1, h, p);
    }
    for _ in 0..20 {
        a.t.progress(&mut a.s);
        b.t.progress(&mut b.s);
    }
    let t0 = Instant::now();
    drop(a);
    drop(b);
    assert!(t0.elapsed() < Duration::from_secs(2), "drop took {:?}", t0.elapsed());
}

/// One test per backend (and a cross-backend run where two transports talk).
macro_rules! both {
    ($name:ident) => {
        mod $name {
            use super::*;
            #[test]
            fn portable() {
                super::$name(Backend::Portable)
            }
            #[test]
            fn uring() {
                super::$name(Backend::Uring)
            }
        }
    };
    ($name:ident, pair) => {
        mod $name {
            use super::*;
            #[test]
            fn portable() {
                super::$name(Backend::Portable, Backend::Portable)
            }
            #[test]
            fn uring() {
                super::$name(Backend::Uring, Backend::Uring)
            }
            #[test]
            fn uring_to_portable() {
                super::$name(Backend::Uring, Backend::Portable)
            }
            #[test]
            fn portable_to_uring() {
                super::$name(Backend::Portable, Backend::Uring)
            }
        }
    };
}

both!(eager_in_order, pair);
both!(data_in_place, pair);
both!(interleaved_volume, pair);
both!(peer_closes);
both!(last_words_before_a_reset);
both!(garbage);
both!(poll_ready_wakes);
both!(sleep_wake_spin_cycles);
both!(progress_from_exited_thread);
both!(disconnect_and_drop);
