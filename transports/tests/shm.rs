//! The shared-memory transport between real processes.
//!
//! Each test (the parent, rank 0) re-executes this test binary as rank 1 (`--exact child`, with
//! [`ROLE`] naming what the child does; without it the `child` test returns at once). The two
//! exchange their descriptors through files in a temporary directory. The parent checks the child's
//! exit status and that no segment file of the job is left in /dev/shm.

#![cfg(target_os = "linux")]

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm_transports::shm::{Doorbell, ShmConfig, ShmEndpoint, ShmError, ShmTransport, SingleCopy};
use ferrocomm_transports::{Header, Kind, Limits, Rank, Sink, Transport, TransportError, WireError};

mod common;
use common::{DISCARD, check_frames, data, eager, pattern};

const ROLE: &str = "FERROCOMM_SHM_TEST_ROLE";
const JOB: &str = "FERROCOMM_SHM_TEST_JOB";
const DIR: &str = "FERROCOMM_SHM_TEST_DIR";
const CFG: &str = "FERROCOMM_SHM_TEST_CFG";

const KIB: usize = 1024;
const MIB: usize = 1 << 20;
const EAGER: usize = 64 * KIB;
const DATA_LEN: usize = 16 * MIB;

fn limits() -> Limits {
    Limits { world_size: 2, eager_limit: EAGER, chunk: 4 * MIB, max_message: 64 * MIB }
}

/// `ring=N,cma=auto|off|deny,bell=auto|socket` (any subset); single copy from 16 KiB.
fn config(s: &str) -> ShmConfig {
    let mut c = ShmConfig { cma_threshold: 16 * KIB, ..ShmConfig::default() };
    for kv in s.split(',').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').expect("key=value");
        match k {
            "ring" => c.ring_capacity = v.parse().unwrap(),
            "cma" => {
                c.single_copy = match v {
                    "auto" => SingleCopy::Auto,
                    "off" => SingleCopy::Off,
                    "deny" => SingleCopy::SimulateDenied,
                    _ => panic!("cma={v}"),
                }
            }
            "bell" => c.doorbell = if v == "socket" { Doorbell::Socket } else { Doorbell::Auto },
            _ => panic!("unknown setting {k}"),
        }
    }
    c
}

fn fnv(b: &[u8]) -> u64 {
    b.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x100_0000_01b3))
}

/// Records frames; `Data` payloads land in `data` at offset `h.aux` and are hashed on arrival.
/// `Credit` frames are the goodbyes of [`Node::finish`] and only counted.
struct TestSink {
    frames: Vec<(Rank, Header, Bytes)>,
    /// Hash of each `Data` frame's destination when it was delivered (0 for other frames).
    hashes: Vec<u64>,
    byes: usize,
    lost: Vec<(Rank, TransportError)>,
    data: Vec<u8>,
}

// SAFETY: `data` is allocated once and never resized while a transport may write into it.
unsafe impl Sink for TestSink {
    fn data_dest(&mut self, _peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        if h.seq == DISCARD {
            return Ok(None);
        }
        Ok(Some(&mut self.data[h.aux as usize..][..h.len as usize]))
    }
    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        match h.kind {
            Kind::Credit => self.byes += 1,
            Kind::Data if h.seq != DISCARD => {
                self.hashes.push(fnv(&self.data[h.aux as usize..][..h.len as usize]));
                self.frames.push((peer, h, payload));
            }
            _ => {
                self.hashes.push(0);
                self.frames.push((peer, h, payload));
            }
        }
    }
    fn peer_lost(&mut self, peer: Rank, err: TransportError) {
        self.lost.push((peer, err));
    }
}

/// Checks that `sink` received `sent` (from `from`), in order, with the right content.
fn check_received(sink: &TestSink, from: Rank, sent: &[(Header, Bytes)]) {
    check_frames(&sink.frames, from, sent, |i, _, want| sink.hashes[i] == fnv(want));
}

struct Node {
    // Dropped first: before the sink it writes into and the runtime it is registered with.
    t: ShmTransport,
    s: TestSink,
    me: Rank,
    rt: tokio::runtime::Runtime,
}

impl Node {
    fn peer(&self) -> Rank {
        1 - self.me
    }

    fn send(&mut self, frames: &[(Header, Bytes)]) {
        let peer = self.peer();
        for (h, p) in frames {
            self.t.send(peer, *h, p.clone());
        }
    }

    /// Busy-polls `progress` until `done`.
    fn run_until(&mut self, what: &str, mut done: impl FnMut(&ShmTransport, &TestSink) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let work = self.t.progress(&mut self.s);
            if done(&self.t, &self.s) {
                return;
            }
            assert!(Instant::now() < deadline, "rank {}: timed out waiting for {what}", self.me);
            if work == 0 {
                std::thread::yield_now();
            }
        }
    }

    /// Like `run_until`, but sleeps in `poll_ready` whenever `progress` has nothing to do.
    fn sleep_until(&mut self, what: &str, mut done: impl FnMut(&ShmTransport, &TestSink) -> bool) {
        let Node { t, s, rt, me } = self;
        let fut = std::future::poll_fn(|cx| {
            loop {
                while t.progress(s) > 0 {}
                if done(t, s) {
                    return Poll::Ready(());
                }
                if t.poll_ready(cx).is_pending() {
                    return Poll::Pending;
                }
            }
        });
        let r = rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), fut).await });
        assert!(r.is_ok(), "rank {me}: stalled waiting for {what}");
    }

    /// Waits until our output is consumed and the peer said goodbye too, so that neither side
    /// closes the connection while the other still reads.
    fn finish(&mut self) {
        let bye = Header { src: self.me, ..Header::new(Kind::Credit) };
        self.t.send(self.peer(), bye, Bytes::new());
        self.run_until("goodbye", |t, s| s.byes > 0 && !t.has_pending_output());
    }
}

fn publish(dir: &Path, rank: Rank, desc: &[u8]) {
    let tmp = dir.join(format!("desc-{rank}.tmp"));
    fs::write(&tmp, desc).unwrap();
    fs::rename(&tmp, dir.join(format!("desc-{rank}"))).unwrap();
}

fn fetch(dir: &Path, rank: Rank) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(d) = fs::read(dir.join(format!("desc-{rank}"))) {
            return d;
        }
        assert!(Instant::now() < deadline, "no descriptor from rank {rank}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Rank `me` of the two-rank job: creates, publishes, fetches the peer's descriptor, connects.
fn setup(me: Rank, job: &str, dir: &Path, cfg: ShmConfig) -> Node {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (ep, desc) = ShmEndpoint::create(job, me, &[0, 1], cfg).unwrap();
    publish(dir, me, &desc);
    let theirs = fetch(dir, 1 - me);
    let t = {
        let _g = rt.enter();
        ep.connect(vec![(1 - me, theirs)], limits()).unwrap()
    };
    assert_eq!(t.name(), "shm");
    let s = TestSink { frames: Vec::new(), hashes: Vec::new(), byes: 0, lost: Vec::new(), data: vec![0; DATA_LEN] };
    Node { t, s, me, rt }
}

/// Segment files of `job` in /dev/shm.
fn leftovers(job: &str) -> Vec<String> {
    let prefix = format!("ferrocomm-{job}-");
    fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// How the parent expects the child to end.
#[derive(PartialEq)]
enum ChildEnd {
    Success,
    Killed,
}

/// Runs `body` as rank 0 with a child process as rank 1 doing `role`.
/// Two busy-polling processes per test: on a small machine, one test at a time.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn two_processes(role: &str, parent_cfg: &str, child_cfg: &str, body: impl FnOnce(&mut Node, &mut Child) -> ChildEnd) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let job = format!("t{}-{role}", std::process::id());
    let dir = std::env::temp_dir().join(format!("ferrocomm-{job}"));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    let log = File::create(dir.join("child.log")).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child", "--nocapture", "--test-threads", "1"])
        .env(ROLE, role)
        .env(JOB, &job)
        .env(DIR, &dir)
        .env(CFG, child_cfg)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut node = setup(0, &job, &dir, config(parent_cfg));
        let end = body(&mut node, &mut child);
        drop(node);
        end
    }));
    if result.is_err() {
        let _ = child.kill();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let log = fs::read_to_string(dir.join("child.log")).unwrap_or_default();
    match result {
        Err(p) => {
            eprintln!("--- child ({role}) log ---\n{log}");
            std::panic::resume_unwind(p)
        }
        Ok(ChildEnd::Success) => assert!(status.success(), "child ({role}) failed: {status}\n{log}"),
        Ok(ChildEnd::Killed) => assert!(!status.success(), "child ({role}) should have been killed"),
    }
    let left = leftovers(&job);
    assert!(left.is_empty(), "files left in /dev/shm: {left:?}");
    let _ = fs::remove_dir_all(&dir);
}

/// The child side of every test (rank 1). Does nothing unless started by [`two_processes`].
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else { return };
    let job = std::env::var(JOB).unwrap();
    let dir = PathBuf::from(std::env::var(DIR).unwrap());
    let cfg = config(&std::env::var(CFG).unwrap());
    // A metrics recorder of our own: the fallback counter is checked in this process.
    let recorder = metrics_util::debugging::DebuggingRecorder::new();
    let snapshot = recorder.snapshotter();
    recorder.install().unwrap();
    let mut node = setup(1, &job, &dir, cfg.clone());
    match role.as_str() {
        "eager" => exchange_eager(&mut node),
        "data" => {
            let want = data_frames(0);
            node.run_until("data frames", |_, s| s.frames.len() >= want.len());
            check_received(&node.s, 0, &want);
            let st = node.t.stats();
            let (fallbacks, pulled) = match cfg.single_copy {
                SingleCopy::Auto => (0, SINGLE_COPY_FRAMES),
                SingleCopy::Off => (0, 0),
                SingleCopy::SimulateDenied => (1, 0),
            };
            assert_eq!((st.cma_fallbacks, st.single_copy_received), (fallbacks, pulled), "{st:?}");
            // From 64 KiB the sender is offered the second half of the copy (whether it takes it
            // depends on timing; the contents are checked above either way).
            let split = if pulled > 0 { SPLIT_FRAMES } else { 0 };
            assert_eq!(st.single_copy_split, split, "{st:?}");
            let counter = snapshot
                .snapshot()
                .into_vec()
                .into_iter()
                .find(|(k, ..)| k.key().name() == "ferrocomm_shm_cma_fallback")
                .map(|(.., v)| v);
            let want_counter = (fallbacks > 0).then_some(metrics_util::debugging::DebugValue::Counter(fallbacks));
            assert_eq!(counter, want_counter, "metrics counter ferrocomm_shm_cma_fallback");
            node.finish();
        }
        "back_pressure" => {
            let frames = flood_frames(1, 120);
            node.send(&frames);
            // The parent does not read until told: the ring fills and the rest stays queued.
            for _ in 0..10_000 {
                node.t.progress(&mut node.s);
            }
            assert!(node.t.has_pending_output(), "a producer far ahead keeps its frames queued");
            fs::write(dir.join("ring-full"), b"").unwrap();
            node.run_until("the parent to drain", |t, _| !t.has_pending_output());
            node.finish();
        }
        "sleeping" => {
            std::thread::sleep(Duration::from_millis(300));
            node.send(&[eager(1, 1, 100)]);
            node.run_until("first frame out", |t, _| !t.has_pending_output());
            // Ping-pong, both sides sleeping whenever idle.
            for i in 0..PINGS {
                node.sleep_until("ping", |_, s| s.frames.len() > i);
                assert_eq!(node.s.frames[i].1.tag, 1000 + i as u64);
                node.send(&[eager(1, 2000 + i as u64, (i * 37) % 3000)]);
            }
            // Bulk through a small ring: the producer sleeps on a full ring and is rung.
            node.send(&flood_frames(1, 60));
            node.sleep_until("bulk sent", |t, _| !t.has_pending_output());
            assert!(node.t.stats().doorbells_rung > 0);
            node.finish();
        }
        "flood" => {
            // Sends until killed, a few frames at a time.
            let mut next = 0;
            loop {
                if !node.t.has_pending_output() {
                    node.send(&(next..next + 4).map(|i| flood_frame(1, i)).collect::<Vec<_>>());
                    next += 4;
                }
                node.t.progress(&mut node.s);
            }
        }
        "idle" => {
            node.send(&[eager(1, 1, 10), eager(1, 2, 20), eager(1, 3, 30)]);
            node.run_until("frames out", |t, _| !t.has_pending_output());
            // Never reads again; waits to be killed.
            loop {
                std::thread::sleep(Duration::from_secs(1));
            }
        }
        "disconnected" => {
            let want: Vec<_> = (0..5).map(|i| eager(0, i, 100)).collect();
            node.sleep_until("the parent to disconnect", |_, s| !s.lost.is_empty());
            check_received(&node.s, 0, &want);
            assert_eq!(node.s.lost.len(), 1);
            assert!(matches!(node.s.lost[0], (0, TransportError::Closed)), "{:?}", node.s.lost);
        }
        r => panic!("unknown role {r}"),
    }
}

const SIZES: [usize; 14] = [0, 1, 7, 47, 48, 49, 56, 1000, 4095, 4096, 4097, 16383, 40000, EAGER];

fn eager_frames(src: Rank) -> Vec<(Header, Bytes)> {
    (0..400).map(|i| eager(src, (src as u64) << 32 | i as u64, SIZES[i % SIZES.len()])).collect()
}

/// Both ranks send eager frames of many sizes (up to 16 times the ring) at once and check them.
fn exchange_eager(node: &mut Node) {
    node.send(&eager_frames(node.me));
    let want = eager_frames(node.peer());
    node.run_until("eager frames", |_, s| s.frames.len() >= want.len());
    check_received(&node.s, node.peer(), &want);
    assert!(node.s.lost.is_empty());
    node.finish();
}

#[test]
fn eager_frames_in_order_both_ways() {
    two_processes("eager", "ring=4096", "ring=4096", |node, _| {
        exchange_eager(node);
        ChildEnd::Success
    });
}

/// `Data` frames of lengths below, at and above the single-copy threshold and the ring, with
/// eager frames in between; one discarded by the receiver.
fn data_frames(src: Rank) -> Vec<(Header, Bytes)> {
    let mut frames = Vec::new();
    let mut off = 0;
    for (i, len) in [1, 1000, 16 * KIB - 1, 16 * KIB, 100 * KIB, 512 * KIB, MIB + 17, 3 * MIB].into_iter().enumerate() {
        frames.push(data(src, 10 + i as u64, off, len));
        frames.push(eager(src, 100 + i as u64, i * 100));
        off += len;
    }
    frames.push(data(src, DISCARD, 0, 600 * KIB));
    frames.push(data(src, 30, off, 5));
    frames
}

/// Frames of [`data_frames`] that go by single copy when it is allowed (at least 16 KiB), and of
/// those, the ones split with the sender (at least 64 KiB).
const SINGLE_COPY_FRAMES: u64 = 5;
const SPLIT_FRAMES: u64 = 4;

fn send_data(node: &mut Node, single_copy: bool) {
    node.send(&data_frames(0));
    node.finish();
    let st = node.t.stats();
    let want = if single_copy { (SINGLE_COPY_FRAMES + 1, 4) } else { (0, 10) };
    assert_eq!((st.single_copy_sent, st.streamed_data_sent), want, "{st:?}");
    assert!(st.single_copy_halves_written <= SPLIT_FRAMES, "{st:?}");
    if single_copy {
        eprintln!("halves of single copies written by the sender: {} of {SPLIT_FRAMES}", st.single_copy_halves_written);
    }
}

#[test]
fn data_single_copy() {
    two_processes("data", "", "cma=auto", |node, _| {
        send_data(node, true);
        ChildEnd::Success
    });
}

#[test]
fn data_streamed_through_a_smaller_ring() {
    two_processes("data", "", "cma=off,ring=65536", |node, _| {
        send_data(node, false);
        ChildEnd::Success
    });
}

#[test]
fn data_forced_single_copy_fallback() {
    two_processes("data", "", "cma=deny", |node, _| {
        send_data(node, false);
        ChildEnd::Success
    });
}

/// Eager frames and 512 KiB `Data` frames, alternating; `Data` offsets cycle through the buffer.
fn flood_frames(src: Rank, n: usize) -> Vec<(Header, Bytes)> {
    (0..n).map(|i| flood_frame(src, i)).collect()
}

fn flood_frame(src: Rank, i: usize) -> (Header, Bytes) {
    if i.is_multiple_of(2) {
        eager(src, i as u64, (i * 997) % EAGER)
    } else {
        data(src, i as u64, (i % 16) * 512 * KIB, 512 * KIB)
    }
}

#[test]
fn back_pressure_keeps_a_fast_producer_queued() {
    two_processes("back_pressure", "ring=16384", "ring=16384,cma=off", |node, _| {
        // Not a single progress call until the child has seen its ring full.
        let dir = std::env::temp_dir().join(format!("ferrocomm-t{}-back_pressure", std::process::id()));
        let deadline = Instant::now() + Duration::from_secs(60);
        while !dir.join("ring-full").exists() {
            assert!(Instant::now() < deadline, "the child never filled its ring");
            std::thread::sleep(Duration::from_millis(5));
        }
        let want = flood_frames(1, 120);
        node.run_until("flood", |_, s| s.frames.len() >= want.len());
        check_received(&node.s, 1, &want);
        node.finish();
        ChildEnd::Success
    });
}

const PINGS: usize = 300;

fn sleeping(bell: &str) {
    let cfg = format!("ring=16384,cma=off,bell={bell}");
    two_processes("sleeping", &cfg, &cfg, |node, _| {
        while node.t.progress(&mut node.s) > 0 {}
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(node.t.poll_ready(&mut cx).is_pending(), "an idle transport is not ready");
        let t0 = Instant::now();
        node.sleep_until("the first frame", |_, s| !s.frames.is_empty());
        assert!(t0.elapsed() > Duration::from_millis(100), "woke before the frame was sent");
        for i in 0..PINGS {
            node.send(&[eager(0, 1000 + i as u64, (i * 53) % 5000)]);
            node.sleep_until("pong", |_, s| s.frames.len() > i + 1);
            assert_eq!(node.s.frames[i + 1].1.tag, 2000 + i as u64);
        }
        let mut want = vec![eager(1, 1, 100)];
        want.extend((0..PINGS).map(|i| eager(1, 2000 + i as u64, (i * 37) % 3000)));
        want.extend(flood_frames(1, 60));
        node.sleep_until("bulk", |_, s| s.frames.len() >= want.len());
        check_received(&node.s, 1, &want);
        let st = node.t.stats();
        assert!(st.doorbells_rung > 0, "{st:?}");
        assert_eq!(st.socket_doorbells, (bell == "socket") as u64, "{st:?}");
        node.finish();
        ChildEnd::Success
    });
}

#[test]
fn sleeping_consumer_woken_by_eventfd_doorbell() {
    sleeping("auto");
}

#[test]
fn sleeping_consumer_woken_by_socket_doorbell() {
    sleeping("socket");
}

/// Reads some of the child's flood, kills it, and expects exactly one `peer_lost(Closed)`.
fn killed_mid_transfer(cfg: &str, single_copy: bool) {
    two_processes("flood", cfg, cfg, |node, child| {
        node.run_until("a few frames", |_, s| s.frames.len() >= 9);
        if single_copy {
            // Wait until the child has put its next frames (with descriptors) in the ring (on a
            // loaded machine it may take a while to be scheduled), then make it disappear: the
            // single copy fails at once, before any periodic liveness check.
            let deadline = Instant::now() + Duration::from_secs(20);
            let mut cx = Context::from_waker(std::task::Waker::noop());
            while node.t.poll_ready(&mut cx).is_pending() {
                assert!(Instant::now() < deadline, "the child put nothing more in the ring");
                std::thread::sleep(Duration::from_millis(5));
            }
            node.t.awake();
            child.kill().unwrap();
            child.wait().unwrap();
            let checks = node.t.stats().liveness_checks;
            node.t.progress(&mut node.s);
            assert!(!node.s.lost.is_empty(), "a single-copy read from a dead process fails");
            assert_eq!(node.t.stats().liveness_checks, checks, "found by the read, not by the pidfd");
        } else {
            // The child is streaming 512 KiB frames through a 64 KiB ring: killed mid-frame.
            child.kill().unwrap();
            node.run_until("the loss", |_, s| !s.lost.is_empty());
        }
        let frames = node.s.frames.len();
        for _ in 0..1000 {
            node.t.progress(&mut node.s);
        }
        assert_eq!(node.s.lost.len(), 1, "reported once: {:?}", node.s.lost);
        assert!(matches!(node.s.lost[0], (1, TransportError::Closed)), "{:?}", node.s.lost);
        assert_eq!(node.s.frames.len(), frames, "nothing after the loss");
        // Whatever arrived is whole and correct.
        let want = flood_frames(1, frames);
        check_received(&node.s, 1, &want);
        node.send(&[eager(0, 1, 10)]);
        assert!(!node.t.has_pending_output(), "sends to a lost peer are dropped");
        ChildEnd::Killed
    });
}

#[test]
fn killed_peer_mid_stream() {
    killed_mid_transfer("ring=65536,cma=off", false);
}

#[test]
fn killed_peer_mid_single_copy() {
    killed_mid_transfer("ring=65536,cma=auto", true);
}

#[test]
fn killed_peer_wakes_a_sleeper_and_frees_its_ring() {
    two_processes("idle", "ring=65536", "ring=65536", |node, child| {
        // The child never reads: our ring to it fills up.
        node.send(&flood_frames(0, 20));
        node.run_until("the child's frames", |_, s| s.frames.len() >= 3);
        assert!(node.t.has_pending_output());
        let pid = child.id() as i32;
        let killer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: plain syscall on our own child.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        });
        let t0 = Instant::now();
        node.sleep_until("the loss", |_, s| !s.lost.is_empty());
        assert!(t0.elapsed() >= Duration::from_millis(250), "woke before the kill");
        killer.join().unwrap();
        assert_eq!(node.s.lost.len(), 1);
        assert!(matches!(node.s.lost[0], (1, TransportError::Closed)), "{:?}", node.s.lost);
        assert!(!node.t.has_pending_output(), "output to a dead peer is dropped");
        check_received(&node.s, 1, &[eager(1, 1, 10), eager(1, 2, 20), eager(1, 3, 30)]);
        ChildEnd::Killed
    });
}

#[test]
fn disconnect_reports_once_and_tells_the_peer() {
    two_processes("disconnected", "", "", |node, _| {
        node.send(&(0..5).map(|i| eager(0, i, 100)).collect::<Vec<_>>());
        node.run_until("frames out", |t, _| !t.has_pending_output());
        std::thread::sleep(Duration::from_millis(200));
        let reason = TransportError::Wire(WireError::Unexpected(Kind::Rts));
        node.t.disconnect(1, reason);
        node.send(&[eager(0, 9, 10)]);
        assert!(!node.t.has_pending_output());
        node.run_until("the loss", |_, s| !s.lost.is_empty());
        for _ in 0..1000 {
            node.t.progress(&mut node.s);
        }
        assert_eq!(node.s.lost.len(), 1);
        assert!(matches!(node.s.lost[0], (1, TransportError::Wire(WireError::Unexpected(Kind::Rts)))));
        ChildEnd::Success
    });
}

fn shm_error(e: std::io::Error) -> ShmError {
    e.get_ref().and_then(|e| e.downcast_ref::<ShmError>()).cloned().unwrap_or_else(|| panic!("not a ShmError: {e}"))
}

/// Both ranks in this process: a quick smoke test, and the segment files are gone after connect.
#[test]
fn same_process_pair_and_unlink() {
    let job = format!("t{}-same", std::process::id());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let (e0, d0) = ShmEndpoint::create(&job, 0, &[0, 1], config("")).unwrap();
    let (e1, d1) = ShmEndpoint::create(&job, 1, &[1, 0], config("")).unwrap();
    assert_eq!(leftovers(&job).len(), 2);
    let _g = rt.enter();
    let t0 = e0.connect(vec![(1, d1)], limits()).unwrap();
    assert!(!t0.is_unlinked(), "rank 1 has not mapped rank 0's segment yet");
    let t1 = e1.connect(vec![(0, d0)], limits()).unwrap();
    assert!(leftovers(&job).is_empty(), "every segment is mapped by every peer: no file left");
    let mk = || TestSink { frames: Vec::new(), hashes: Vec::new(), byes: 0, lost: Vec::new(), data: vec![0; DATA_LEN] };
    let (mut t0, mut t1, mut s0, mut s1) = (t0, t1, mk(), mk());
    let frames = data_frames(0);
    for (h, p) in &frames {
        t0.send(1, *h, p.clone());
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while s1.frames.len() < frames.len() {
        t0.progress(&mut s0);
        t1.progress(&mut s1);
        assert!(Instant::now() < deadline, "frames did not arrive");
    }
    check_received(&s1, 0, &frames);
    assert_eq!(t1.stats().single_copy_received, SINGLE_COPY_FRAMES);
    // Dropping one side: the other sees the connection closed, once.
    while t0.has_pending_output() {
        t0.progress(&mut s0);
    }
    drop(t0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while s1.lost.is_empty() {
        t1.progress(&mut s1);
        assert!(Instant::now() < deadline, "loss not seen");
    }
    for _ in 0..1000 {
        t1.progress(&mut s1);
    }
    assert!(matches!(s1.lost[..], [(0, TransportError::Closed)]), "{:?}", s1.lost);
}

#[test]
fn bad_descriptors_are_typed_errors() {
    let job = format!("t{}-baddesc", std::process::id());
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let cfg = ShmConfig::default();
    let (_e1, good) = ShmEndpoint::create(&job, 1, &[0, 1], cfg.clone()).unwrap();
    let try_connect = |peers: Vec<(Rank, Vec<u8>)>, in_runtime: bool| {
        let (e0, _) = ShmEndpoint::create(&job, 0, &[0, 1], cfg.clone()).unwrap();
        let _g = in_runtime.then(|| rt.enter());
        shm_error(e0.connect(peers, limits()).err().expect("connect must fail"))
    };
    let with = |at: usize, bytes: &[u8]| {
        let mut d = good.clone();
        d[at..at + bytes.len()].copy_from_slice(bytes);
        vec![(1, d)]
    };
    assert_eq!(try_connect(vec![(1, good.clone())], false), ShmError::NoRuntime);
    assert_eq!(try_connect(vec![], true), ShmError::MissingPeer(1));
    assert_eq!(try_connect(vec![(1, good.clone()), (1, good.clone())], true), ShmError::DuplicatePeer(1));
    assert_eq!(try_connect(vec![(5, good.clone())], true), ShmError::UnexpectedPeer(5));
    assert!(matches!(try_connect(vec![(1, good[..20].to_vec())], true), ShmError::BadDescriptor { rank: 1, .. }));
    assert!(matches!(try_connect(vec![(1, pattern(7, 200))], true), ShmError::BadDescriptor { rank: 1, .. }));
    assert!(matches!(try_connect(with(12, &0u32.to_le_bytes()), true), ShmError::BadDescriptor { .. }), "rank");
    assert!(matches!(try_connect(with(40, &[0xAA; 8]), true), ShmError::BadSegment { rank: 1, .. }), "nonce");
    assert_eq!(try_connect(with(16, &0x7fff_fff0u32.to_le_bytes()), true), ShmError::PeerGone(1), "pid");
    // Our own stdin is not the peer's eventfd: never written to.
    assert!(
        matches!(try_connect(with(20, &0u32.to_le_bytes()), true), ShmError::BadDescriptor { what: "eventfd", .. }),
        "eventfd"
    );
    assert!(matches!(try_connect(with(64, &[1; 8]), true), ShmError::BadDescriptor { .. }), "probe");
    assert!(ShmEndpoint::create("a/b", 0, &[0, 1], cfg.clone()).is_err());
    drop(_e1);
    assert!(leftovers(&job).is_empty(), "failed set-ups leave no file: {:?}", leftovers(&job));
}

#[test]
fn leftovers_of_a_crashed_set_up_can_be_removed() {
    let job = format!("t{}-leftover", std::process::id());
    let (e, _) = ShmEndpoint::create(&job, 3, &[1, 3], ShmConfig::default()).unwrap();
    std::mem::forget(e); // as if the process had died before its peers mapped the segment
    assert_eq!(leftovers(&job).len(), 1);
    assert_eq!(ferrocomm_transports::shm::remove_leftovers(&job).unwrap(), 1);
    assert!(leftovers(&job).is_empty());
}
