//! The point-to-point suite, written once and run in-process (tests/p2p.rs) and as separate
//! processes under the launcher (tests/multiprocess.rs), on each TCP backend.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use ferrocomm::{Comm, Deadline, Error, Source, TagMatch, World};

/// Sizes that cross the eager/rendezvous switch (default 64 KiB), the shared-memory ring (256 KiB)
/// and the rendezvous chunk (512 KiB).
pub(crate) const SIZES: &[usize] =
    &[0, 1, 8, 16 * 1024 + 1, 64 * 1024 - 1, 64 * 1024, 64 * 1024 + 1, 300_000, 512 * 1024 + 3, 3 << 20];

pub(crate) fn pattern(len: usize, seed: u32) -> Bytes {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed).to_le_bytes()[1])
        .collect::<Vec<u8>>()
        .into()
}

const T: Duration = Duration::from_secs(60);

/// Ring of sends of every size, wildcard storm into rank 0, one large transfer, barrier.
pub(crate) async fn ring_storm_rendezvous(w: &World) {
    let (r, n) = (w.rank(), w.size());
    for (i, &len) in SIZES.iter().enumerate() {
        let rx = w.recv((r + n - 1) % n, i as u64);
        w.send((r + 1) % n, i as u64, pattern(len, r)).timeout(T).await.unwrap();
        let m = rx.timeout(T).await.unwrap();
        assert_eq!((m.source, m.tag, m.data.len()), ((r + n - 1) % n, i as u64, len));
        assert_eq!(m.data, pattern(len, (r + n - 1) % n), "size {len}");
    }
    // Wildcard storm: everyone fires at rank 0, which takes them in any order.
    const PER_RANK: u32 = 50;
    if r == 0 {
        let mut seen = vec![0u32; n as usize];
        for _ in 0..PER_RANK * (n - 1) {
            let m = w.recv(Source::Any, TagMatch::Any).timeout(T).await.unwrap();
            assert_eq!(m.tag as u32, seen[m.source as usize], "non-overtaking from rank {}", m.source);
            assert_eq!(m.data, pattern(m.tag as usize * 1999 % 150_000, m.source));
            seen[m.source as usize] += 1;
        }
    } else {
        let sends: Vec<_> =
            (0..PER_RANK).map(|i| w.send(0, i as u64, pattern(i as usize * 1999 % 150_000, r))).collect();
        for s in futures::future::join_all(sends).await {
            s.unwrap();
        }
    }
    w.barrier().timeout(T).await.unwrap();
}

/// Receives of many kinds at rank 0 from all others: specific tags out of order, sources in order.
pub(crate) async fn matching_semantics(w: &World) {
    let (r, n) = (w.rank(), w.size());
    if n < 2 {
        return;
    }
    if r != 0 {
        // All at once: a rendezvous send completes only when its receive is posted.
        let sends: Vec<_> = (0..20u64)
            .map(|tag| {
                let len = if tag % 3 == 0 { 100_000 } else { 10 };
                w.send(0, tag % 4, pattern(len, r * 1000 + tag as u32))
            })
            .collect();
        for s in futures::future::join_all(sends).await {
            s.unwrap();
        }
    } else {
        for src in 1..n {
            // Tag 3 first: messages 3, 7, 11, ... in order, then any tag: the rest in order.
            let mut expect: Vec<u64> = (0..20).filter(|t| t % 4 == 3).collect();
            expect.extend((0..20).filter(|t| t % 4 != 3));
            for (i, &t) in expect.iter().enumerate() {
                let sel = if i < 5 { TagMatch::Exact(3) } else { TagMatch::Any };
                let m = w.recv(src, sel).timeout(T).await.unwrap();
                let len = if t % 3 == 0 { 100_000 } else { 10 };
                assert_eq!(m.data, pattern(len, src * 1000 + t as u32), "from {src}, message {t}");
            }
        }
    }
    w.barrier().timeout(T).await.unwrap();
}

/// A message longer than the posted buffer is an error on both paths; the next one still arrives.
pub(crate) async fn truncation(w: &World) {
    let (r, n) = (w.rank(), w.size());
    if n < 2 || r > 1 {
        return w.barrier().timeout(T).await.unwrap();
    }
    for len in [100usize, 100_000] {
        if r == 0 {
            let res = w.send(1, 5, pattern(len, 0)).timeout(T).await;
            if len > w.settings().eager_limit {
                assert!(matches!(res, Err(Error::RemoteTruncated { rank: 1 })), "{res:?}");
            } else {
                res.unwrap();
            }
            w.send(1, 6, pattern(10, 1)).timeout(T).await.unwrap();
        } else {
            let res = w.recv_into(0, 5u64, BytesMut::zeroed(50)).timeout(T).await;
            assert!(matches!(res, Err(Error::Truncated { len: l, capacity: 50 }) if l == len), "{res:?}");
            let (buf, st) = w.recv_into(0, 6u64, BytesMut::zeroed(50)).timeout(T).await.unwrap();
            assert_eq!((&buf[..], st.len), (&pattern(10, 1)[..], 10));
        }
    }
    w.barrier().timeout(T).await.unwrap();
}

/// A dropped receive is withdrawn; an expired deadline cancels cleanly; probe and sendrecv work.
pub(crate) async fn cancel_deadline_probe(w: &World) {
    let (r, n) = (w.rank(), w.size());
    if n < 2 || r > 1 {
        w.barrier().timeout(T).await.unwrap();
        return w.barrier().timeout(T).await.unwrap();
    }
    if r == 1 {
        drop(w.recv(0, 1u64));
        let t0 = Instant::now();
        let res = w.recv(0, 2u64).timeout(Duration::from_millis(200)).await;
        assert!(matches!(res, Err(Error::Timeout)), "{res:?}");
        // The deadline ends the wait (a bound on liveness, not a timing: a loaded machine may
        // leave a busy-polling rank off the CPU for seconds).
        assert!(t0.elapsed() < T, "the 200 ms deadline did not end the receive");
    }
    w.barrier().timeout(T).await.unwrap();
    if r == 0 {
        w.send(1, 1, pattern(30, 7)).timeout(T).await.unwrap();
        w.send(1, 2, pattern(100_000, 8)).timeout(T).await.unwrap();
    } else {
        let st = w.probe(0, 1u64).timeout(T).await.unwrap();
        assert_eq!((st.source, st.tag, st.len), (0, 1, 30));
        assert_eq!(w.recv(0, 1u64).timeout(T).await.unwrap().data, pattern(30, 7), "the dropped receive took nothing");
        assert_eq!(w.recv(0, 2u64).timeout(T).await.unwrap().data, pattern(100_000, 8));
        assert!(w.iprobe(0, 1u64).is_none() && w.iprobe(0, 2u64).is_none(), "nothing left over");
    }
    // sendrecv in both directions at once, rendezvous size.
    let other = 1 - r;
    let m = w.sendrecv(other, 9, pattern(200_000, r), other, 9u64).timeout(T).await.unwrap();
    assert_eq!(m.data, pattern(200_000, other));
    w.barrier().timeout(T).await.unwrap();
}

/// A receiver that does not receive: the sender stalls on credits, the receiver's memory for
/// unexpected messages stays within max_credit messages, and nothing is lost.
pub(crate) async fn flood_is_bounded(w: &World) {
    let (r, n) = (w.rank(), w.size());
    if n < 2 || r > 1 {
        return w.barrier().timeout(T).await.unwrap();
    }
    const COUNT: u64 = 1000;
    let credit = w.settings().max_credit as usize;
    if r == 0 {
        let sends: Vec<_> = (0..COUNT).map(|i| w.send(1, i, pattern(1000, i as u32))).collect();
        for s in futures::future::join_all(sends).await {
            s.unwrap();
        }
    } else {
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_millis(300) {
            assert!(w.unexpected_from(0) <= credit, "unexpected {} > {credit}", w.unexpected_from(0));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(w.unexpected_from(0) <= credit);
        for i in 0..COUNT {
            let m = w.recv(0, TagMatch::Any).timeout(T).await.unwrap();
            assert_eq!((m.tag, m.data), (i, pattern(1000, i as u32)));
        }
    }
    w.barrier().timeout(T).await.unwrap();
}

/// Messages on a duplicate never match receives on the original.
pub(crate) async fn dup_isolation(w: &World) {
    let (r, n) = (w.rank(), w.size());
    let d: Comm = w.dup().unwrap();
    assert_ne!(d.context(), w.context());
    let dst = (r + 1) % n;
    let src = (r + n - 1) % n;
    let on_world = w.recv(src, 1u64);
    d.send(dst, 1, pattern(10, 100 + r)).timeout(T).await.unwrap();
    w.send(dst, 1, pattern(10, r)).timeout(T).await.unwrap();
    assert_eq!(on_world.timeout(T).await.unwrap().data, pattern(10, src));
    assert_eq!(d.recv(src, 1u64).timeout(T).await.unwrap().data, pattern(10, 100 + src));
    d.barrier().timeout(T).await.unwrap();
}

/// Rendezvous in each of the three orders: the send before the receive is posted (the RTS
/// waits as an unexpected message), the receive before the send, and both at once.
pub(crate) async fn rendezvous_orders(w: &World) {
    let (r, n) = (w.rank(), w.size());
    if n < 2 || r > 1 {
        for _ in 0..3 {
            w.barrier().timeout(T).await.unwrap();
        }
        return;
    }
    const LEN: usize = 300_000;
    // 1. Sender first: the receive is posted only once the RTS has arrived.
    if r == 0 {
        w.send(1, 21, pattern(LEN, 21)).timeout(T).await.unwrap();
    } else {
        let st = w.probe(0, 21u64).timeout(T).await.unwrap();
        assert_eq!(st.len, LEN);
        let (buf, _) = w.recv_into(0, 21u64, BytesMut::zeroed(LEN)).timeout(T).await.unwrap();
        assert_eq!(&buf[..], &pattern(LEN, 21)[..], "sender first");
    }
    w.barrier().timeout(T).await.unwrap();
    // 2. Receiver first: the receive is posted before the send starts.
    if r == 1 {
        let rx = w.recv_into(0, 22u64, BytesMut::zeroed(LEN));
        w.barrier().timeout(T).await.unwrap();
        let (buf, _) = rx.timeout(T).await.unwrap();
        assert_eq!(&buf[..], &pattern(LEN, 22)[..], "receiver first");
    } else {
        w.barrier().timeout(T).await.unwrap();
        w.send(1, 22, pattern(LEN, 22)).timeout(T).await.unwrap();
    }
    // 3. Both at once, in both directions: each rank posts its send and its receive together.
    let other = 1 - r;
    let rx = w.recv_into(other, 23u64, BytesMut::zeroed(LEN + 5));
    let tx = w.send(other, 23, pattern(LEN + 5, 100 + r));
    let (res, sent) = futures::join!(rx.timeout(T), tx.timeout(T));
    sent.unwrap();
    assert_eq!(&res.unwrap().0[..], &pattern(LEN + 5, 100 + other)[..], "both at once");
    w.barrier().timeout(T).await.unwrap();
}

/// `send_from` copies: the sender overwrites its buffer as soon as each call returns, whether
/// the message went straight into the transport, waited for credit (a burst beyond the credits)
/// or travels by rendezvous; every size, to the next rank and to itself.
pub(crate) async fn send_from_copies(w: &World) {
    let (r, n) = (w.rank(), w.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    for (i, &len) in SIZES.iter().enumerate() {
        let rx = w.recv(prev, 100 + i as u64);
        let to_self = w.recv(r, 200 + i as u64);
        let mut buf = pattern(len, r).to_vec();
        let sent = w.send_from(next, 100 + i as u64, &buf);
        let sent_self = w.send_from(r, 200 + i as u64, &buf);
        buf.iter_mut().for_each(|b| *b = !*b);
        sent.timeout(T).await.unwrap();
        sent_self.timeout(T).await.unwrap();
        assert_eq!(rx.timeout(T).await.unwrap().data, pattern(len, prev), "size {len} from rank {prev}");
        assert_eq!(to_self.timeout(T).await.unwrap().data, pattern(len, r), "size {len} to itself");
    }
    const BURST: u64 = 300;
    let mut buf = [0u8; 16];
    let sends: Vec<_> = (0..BURST)
        .map(|i| {
            buf.fill(i as u8);
            w.send_from(next, 300, &buf)
        })
        .collect();
    buf.fill(0xff);
    let recvs = async {
        for i in 0..BURST {
            let m = w.recv(prev, 300u64).timeout(T).await.unwrap();
            assert_eq!(&m.data[..], &[i as u8; 16], "burst message {i}");
        }
    };
    let (sent, ()) = futures::join!(futures::future::join_all(sends), recvs);
    sent.into_iter().for_each(|s| s.unwrap());
    let bad = w.send_from(n, 1, b"x").timeout(T).await;
    assert!(matches!(bad, Err(Error::UnknownRank { rank, size }) if rank == n && size == n), "{bad:?}");
    // On a sub-communicator (the even ranks, in reverse order): its ranks, its context.
    let sub = w.split(Some(r % 2), n - r).await.unwrap().unwrap();
    let (me, size) = (sub.rank(), sub.size());
    let rx = sub.recv((me + size - 1) % size, 400u64);
    let plain = w.recv(Source::Any, 400u64);
    sub.send_from((me + 1) % size, 400, &[me as u8; 8]).timeout(T).await.unwrap();
    let m = rx.timeout(T).await.unwrap();
    assert_eq!((m.source, &m.data[..]), ((me + size - 1) % size, &[((me + size - 1) % size) as u8; 8][..]));
    let other = plain.timeout(Duration::from_millis(50)).await;
    assert!(matches!(other, Err(Error::Timeout)), "the world's receive matched another context's message: {other:?}");
    w.barrier().timeout(T).await.unwrap();
}

/// The whole suite, in order.
pub(crate) async fn suite(w: &World) {
    ring_storm_rendezvous(w).await;
    send_from_copies(w).await;
    rendezvous_orders(w).await;
    matching_semantics(w).await;
    truncation(w).await;
    cancel_deadline_probe(w).await;
    flood_is_bounded(w).await;
    dup_isolation(w).await;
}

/// A job of this test binary's rank function started under `ferrorun`: `n` ranks over
/// `transport` (`shm`, `verbs`, or a TCP backend: `uring`, `portable`), each told its scenario in
/// `scenario_var`, with `env` (`KEY=VALUE`) for every rank. Returns the launcher's exit code, the
/// ranks' output and the job's wall time.
pub(crate) struct Job<'a> {
    pub ferrorun: &'a str,
    pub rank_test: &'a str,
    pub scenario_var: &'a str,
    pub grace_s: u32,
}

impl Job<'_> {
    pub(crate) fn run(&self, n: u32, scenario: &str, transport: &str, env: &[&str]) -> (Option<i32>, String, Duration) {
        let t0 = Instant::now();
        let out = self.command(n, scenario, transport, env).stdin(std::process::Stdio::null()).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        (out.status.code(), text, t0.elapsed())
    }

    /// [`Job::run`] without waiting for the job: the launcher with its stdout and stderr piped,
    /// for a test that talks to the ranks while they run.
    pub(crate) fn spawn(&self, n: u32, scenario: &str, transport: &str, env: &[&str]) -> std::process::Child {
        use std::process::Stdio;
        let mut cmd = self.command(n, scenario, transport, env);
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap()
    }

    fn command(&self, n: u32, scenario: &str, transport: &str, env: &[&str]) -> std::process::Command {
        let (choice, backend) = match transport {
            "shm" => ("auto", "auto"),
            "verbs" => ("verbs", "auto"),
            _ => ("tcp", transport),
        };
        let mut cmd = std::process::Command::new(self.ferrorun);
        cmd.args(["-n", &n.to_string(), "--grace", &self.grace_s.to_string()])
            .args(["--env", &format!("{}={scenario}", self.scenario_var)])
            .args(["--env", &format!("FERROCOMM_TCP_BACKEND={backend}")])
            .args(["--env", &format!("FERROCOMM_TRANSPORTS={choice}")]);
        for e in env {
            cmd.args(["--env", e]);
        }
        cmd.arg(std::env::current_exe().unwrap()).args(["--exact", self.rank_test, "--nocapture", "--test-threads=1"]);
        cmd
    }
}

/// Whether an RDMA device is present (inside the Soft-RoCE VM of scripts/verbs-vm.sh). Without
/// one the verbs tests are skipped with a message, unless FERROCOMM_REQUIRE_VERBS is set (the
/// VM run sets it, so a missing device there fails).
#[cfg(feature = "verbs")]
pub(crate) fn verbs_here(test: &str) -> bool {
    let present = std::fs::read_dir("/sys/class/infiniband").map(|d| d.count() > 0).unwrap_or(false);
    if !present {
        assert!(std::env::var_os("FERROCOMM_REQUIRE_VERBS").is_none(), "{test}: no RDMA device");
        eprintln!("{test}: skipped, no RDMA device here (scripts/verbs-vm.sh runs it over Soft-RoCE)");
    }
    present
}
