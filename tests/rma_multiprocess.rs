//! The one-sided suite with ranks as separate processes started by `ferrorun`: over shared memory
//! (peers map each other's segments), over TCP (both backends), and mixed (one rank on TCP alone
//! among shared-memory ranks); and a target killed with SIGKILL while its peers have operations
//! in flight on its segments.
//!
//! The ranks are this test binary, re-run by `ferrorun` with `--exact rma_rank_process` and the
//! scenario in `FERROCOMM_RMA_SCENARIO`; without that variable `rma_rank_process` does nothing.

mod rma_suite;

mod common;

use std::time::{Duration, Instant};

use ferrocomm::{Access, Deadline, Error, SegmentId};

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");
const SCENARIO: &str = "FERROCOMM_RMA_SCENARIO";

/// Runs `scenario` on `n` ranks over `transport` (`shm`, `uring`, `portable`), with extra
/// variables.
fn launch(n: u32, scenario: &str, transport: &str, env: &[&str]) -> (Option<i32>, String, Duration) {
    common::Job { ferrorun: FERRORUN, rank_test: "rma_rank_process", scenario_var: SCENARIO, grace_s: 10 }
        .run(n, scenario, transport, env)
}

fn said(text: &str, r: u32, what: &str) -> bool {
    text.lines().any(|l| l.starts_with(&format!("[{r}] ")) && l.contains(what))
}

#[test]
fn rma_suite_under_ferrorun() {
    for (transport, n) in [("shm", 2), ("shm", 4), ("uring", 2), ("uring", 4), ("portable", 3)] {
        let (code, text, took) = launch(n, "suite", transport, &[]);
        assert_eq!(code, Some(0), "{transport}, {n} ranks:\n{text}");
        for r in 0..n {
            assert!(said(&text, r, "RMA-OK"), "{transport} rank {r}:\n{text}");
        }
        println!("one-sided suite, {transport}, {n} ranks: {took:?}");
    }
}

/// Rank 1 uses TCP alone: the others reach it by requests, and map each other's segments.
#[test]
fn rma_mixed_routes() {
    let (code, text, _) = launch(3, "suite", "shm", &["FERROCOMM_RMA_TCP_RANK=1"]);
    assert_eq!(code, Some(0), "{text}");
    for r in 0..3 {
        assert!(said(&text, r, "RMA-OK"), "rank {r}:\n{text}");
    }
}

/// Rank 2 owns a window and a queue that the others are using, and dies by SIGKILL: their
/// operations in flight (awaited fetch-adds, puts on an event, an enqueue waiting for room in the
/// full queue) fail with a typed peer-lost error within the peer timeout, later ones at once;
/// nothing is left in /dev/shm by the segments (their memory is a memfd).
#[test]
fn rma_target_killed() {
    for transport in ["shm", "uring"] {
        let (code, text, took) = launch(4, "kill", transport, &[]);
        assert_ne!(code, Some(0), "the launcher reports the killed rank:\n{text}");
        for r in [0, 1, 3] {
            assert!(said(&text, r, "RMA-PEER-LOST-OK"), "{transport} rank {r}:\n{text}");
        }
        assert!(took < Duration::from_secs(60), "{took:?}");
        println!("{transport}: {took:?}");
    }
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.contains("rma"))
        .collect();
    assert!(left.is_empty(), "left in /dev/shm: {left:?}");
}

/// The suite over RDMA verbs with 2 and 4 ranks as processes: puts and gets as RDMA writes and
/// reads, atomics as RDMA atomics (the suite checks that the device route is the one taken), in
/// each progress mode; then a target killed during operations.
#[cfg(feature = "verbs")]
#[test]
fn rma_suite_over_verbs() {
    if !common::verbs_here("rma_suite_over_verbs") {
        return;
    }
    for (n, progress) in [(2, "busy"), (4, "busy"), (2, "blocking")] {
        let (code, text, took) = launch(n, "suite", "verbs", &[&format!("FERROCOMM_PROGRESS={progress}")]);
        assert_eq!(code, Some(0), "verbs, {n} ranks, {progress}:\n{text}");
        for r in 0..n {
            assert!(said(&text, r, "RMA-OK"), "verbs, {progress}, rank {r}:\n{text}");
        }
        println!("one-sided suite over verbs, {n} ranks, {progress} progress: {took:?}");
    }
    let (code, text, took) = launch(4, "kill", "verbs", &[]);
    assert_ne!(code, Some(0), "the launcher reports the killed rank:\n{text}");
    for r in [0, 1, 3] {
        assert!(said(&text, r, "RMA-PEER-LOST-OK"), "verbs kill, rank {r}:\n{text}");
    }
    println!("one-sided over verbs, target killed: {took:?}");
}

/// All-gather and all-to-all by RDMA writes into the peers' buffers (`Algorithm::Rdma`) with 2,
/// 3 and 4 ranks as processes over verbs: by the default table (the RDMA tier from its
/// threshold) at 2 ranks, and pinned to `rdma` at every size at 3 and 4; each result against the sequential reference.
#[cfg(feature = "verbs")]
#[test]
fn rdma_collectives_over_verbs() {
    if !common::verbs_here("rdma_collectives_over_verbs") {
        return;
    }
    for (n, pin) in [(2, ""), (4, "allgather=rdma,alltoall=rdma"), (3, "allgather=rdma,alltoall=rdma")] {
        let env = format!("FERROCOMM_COLL={pin}");
        let (code, text, took) = launch(n, "rdma-coll", "verbs", &[env.as_str()]);
        assert_eq!(code, Some(0), "verbs, {n} ranks, pinned {pin:?}:\n{text}");
        for r in 0..n {
            assert!(said(&text, r, "RDMA-COLL-OK"), "verbs, {n} ranks, pinned {pin:?}, rank {r}:\n{text}");
        }
        println!("RDMA collectives over verbs, {n} ranks, pinned {pin:?}: {took:?}");
    }
    // Failures: a rank's buffers that do not fit the call, another block length, calls dropped
    // mid-way; each followed by calls that must succeed.
    for n in [4, 3] {
        let (code, text, took) = launch(n, "rdma-fail", "verbs", &["FERROCOMM_COLL=allgather=rdma,alltoall=rdma"]);
        assert_eq!(code, Some(0), "verbs, {n} ranks, failures:\n{text}");
        for r in 0..n {
            assert!(said(&text, r, "RDMA-FAIL-OK"), "verbs, {n} ranks, failures, rank {r}:\n{text}");
        }
        println!("RDMA collective failures over verbs, {n} ranks: {took:?}");
    }
}

/// The element `i` of rank `from`'s block for rank `to` (an all-gather's blocks have `to` 0).
fn element(from: u32, to: u32, i: usize) -> u64 {
    (u64::from(from) << 48) ^ (u64::from(to) << 32) ^ (i as u64).wrapping_mul(0x9e37_79b9)
}

/// Every size from one element to 512 KiB per block, each twice (the buffers alternate between
/// calls), sizes rising (the buffers grow) and falling; two calls held together; each result
/// against the reference.
async fn rdma_collectives(w: &ferrocomm::World) {
    use ferrocomm::{Algorithm, Operation};
    let (r, n) = (w.rank(), w.size());
    let pinned = std::env::var("FERROCOMM_COLL").is_ok_and(|v| v.contains("rdma"));
    let mut used = 0;
    for elems in [1usize, 1000, 2048, 4096, 65536, 4096, 1, 20000] {
        let bytes = elems * 8;
        let want = if pinned || bytes >= w.collective_table().rdma_min { Algorithm::Rdma } else { Algorithm::Bruck };
        for op in [Operation::Allgather, Operation::Alltoall] {
            let got = w.collective_algorithm(op, bytes);
            if want == Algorithm::Rdma {
                assert_eq!(got, Algorithm::Rdma, "{op} of {bytes} B on {n} ranks");
                used += 1;
            } else {
                assert_ne!(got, Algorithm::Rdma, "{op} of {bytes} B on {n} ranks");
            }
        }
        for _ in 0..2 {
            let mine: Vec<u64> = (0..elems).map(|i| element(r, 0, i)).collect();
            let all = w.allgather(&mine).await.unwrap();
            let reference: Vec<u64> = (0..n).flat_map(|j| (0..elems).map(move |i| element(j, 0, i))).collect();
            assert!(all == reference, "all-gather of {elems} elements on {n} ranks differs");
            let parts: Vec<u64> = (0..n).flat_map(|to| (0..elems).map(move |i| element(r, to, i))).collect();
            let got = w.alltoall(&parts).await.unwrap();
            let reference: Vec<u64> = (0..n).flat_map(|from| (0..elems).map(move |i| element(from, r, i))).collect();
            assert!(got == reference, "all-to-all of {elems} elements on {n} ranks differs");
        }
    }
    // Two calls made before either is awaited, driven together.
    let elems = 8192;
    let a: Vec<u64> = (0..elems).map(|i| element(r, 0, i)).collect();
    let b: Vec<u64> = (0..n).flat_map(|to| (0..elems).map(move |i| element(r, to, i))).collect();
    let (x, y) = futures::join!(w.allgather(&a), w.alltoall(&b));
    let rx: Vec<u64> = (0..n).flat_map(|j| (0..elems).map(move |i| element(j, 0, i))).collect();
    let ry: Vec<u64> = (0..n).flat_map(|from| (0..elems).map(move |i| element(from, r, i))).collect();
    assert!(x.unwrap() == rx && y.unwrap() == ry, "held calls on {n} ranks differ");
    if pinned || 32768 * 8 >= w.collective_table().rdma_min {
        into_caller_buffers(w, 32768).await;
        into_caller_buffers(w, 5).await;
    }
    assert!(used > 0);
    println!("RDMA-COLL-OK {n} ranks, {used} sizes by rdma");
}

/// The `_into` forms, which write straight into the caller's result buffer: the same buffers
/// again and again (the registration and the exchange kept), another buffer (exchanged anew),
/// the first one back, and a buffer freed and another allocated in its place (which may take the
/// same addresses with other pages: the kept registration must not serve it stale data). Every
/// round's values differ, so a block left from an earlier round shows.
async fn into_caller_buffers(w: &ferrocomm::World, elems: usize) {
    let (r, n) = (w.rank(), w.size() as usize);
    let value = |round: u64, from: u32, to: u32, i: usize| element(from, to, i) ^ (round << 40);
    let mut round = 0u64;
    let mut check = async |gathered: &mut Vec<u64>, exchanged: &mut Vec<u64>, what: &str| {
        round += 1;
        let mine: Vec<u64> = (0..elems).map(|i| value(round, r, 0, i)).collect();
        w.allgather_into(&mine, gathered).await.unwrap();
        let reference: Vec<u64> = (0..n as u32).flat_map(|j| (0..elems).map(move |i| value(round, j, 0, i))).collect();
        assert!(*gathered == reference, "all-gather into {what} ({elems} elements, round {round}) differs");
        let parts: Vec<u64> = (0..n as u32).flat_map(|to| (0..elems).map(move |i| value(round, r, to, i))).collect();
        w.alltoall_into(&parts, exchanged).await.unwrap();
        let reference: Vec<u64> =
            (0..n as u32).flat_map(|from| (0..elems).map(move |i| value(round, from, r, i))).collect();
        assert!(*exchanged == reference, "all-to-all into {what} ({elems} elements, round {round}) differs");
    };
    let (mut a, mut b) = (vec![0u64; elems * n], vec![0u64; elems * n]);
    for _ in 0..3 {
        check(&mut a, &mut b, "the same buffers").await;
    }
    let (mut c, mut d) = (vec![0u64; elems * n], vec![0u64; elems * n]);
    check(&mut c, &mut d, "other buffers").await;
    check(&mut a, &mut b, "the first buffers back").await;
    check(&mut a, &mut b, "the first buffers again").await;
    drop((a, b, c, d));
    for _ in 0..3 {
        let (mut a, mut b) = (vec![0u64; elems * n], vec![0u64; elems * n]);
        check(&mut a, &mut b, "a freed buffer's successor").await;
    }
}

/// A failed RDMA call at rank `r`: rank 1 is the one at fault; with `own` its own error is
/// `own`'s, otherwise any refusal. The others' calls fail with a refusal naming rank 1 (never a
/// timeout: the hang guard).
fn refused_by_one(r: u32, got: Result<(), Error>, own: fn(&Error) -> bool, what: &str) {
    use ferrocomm::CollError;
    let e = got.expect_err(what);
    if r == 1 {
        let any_refusal = matches!(e, Error::Collective(CollError::Refused { .. }));
        assert!(own(&e) || any_refusal, "{what}, the rank at fault: {e:?}");
    } else {
        assert!(matches!(e, Error::Collective(CollError::Refused { rank: 1, .. })), "{what}, rank {r}: {e:?}");
    }
}

/// RDMA calls that fail (pinned to `rdma`): rank 1's result buffer one element off
/// (`allgather_into`, `alltoall_into`), rank 1's blocks of another length (`alltoall`); calls
/// every rank drops mid-way (after 0 to 80 ms, while writes are in flight; a call that completes
/// first is checked, one that fails must fail with a refusal). After each, correct calls on the
/// same communicator (into the buffer the failed calls used, and owned ones) give the reference
/// results: a failure reaches every rank, and leaves the connections sound.
async fn rdma_failures(w: &ferrocomm::World) {
    use ferrocomm::{CollError, InvalidArgument};
    let (r, n) = (w.rank(), w.size());
    let guard = Duration::from_secs(60);
    let (small, big) = (4096, 131072);
    let mine = |round: u64, elems: usize| (0..elems).map(|i| element(r, 0, i) ^ (round << 40)).collect::<Vec<u64>>();
    let parts = |round: u64, elems: usize| {
        (0..n).flat_map(|to| (0..elems).map(move |i| element(r, to, i) ^ (round << 40))).collect::<Vec<u64>>()
    };
    let gathered = |round: u64, elems: usize| {
        (0..n).flat_map(|j| (0..elems).map(move |i| element(j, 0, i) ^ (round << 40))).collect::<Vec<u64>>()
    };
    let exchanged = |round: u64, elems: usize| {
        (0..n).flat_map(|from| (0..elems).map(move |i| element(from, r, i) ^ (round << 40))).collect::<Vec<u64>>()
    };
    // Correct calls: into `g` (the buffer of the failed calls) and owned.
    let works = async |round: u64, what: &str, g: &mut Vec<u64>| {
        let elems = g.len() / n as usize;
        w.allgather_into(&mine(round, elems), g).timeout(guard).await.unwrap_or_else(|e| panic!("after {what}: {e:?}"));
        assert!(*g == gathered(round, elems), "all-gather after {what} differs");
        let got =
            w.alltoall(&parts(round, small)).timeout(guard).await.unwrap_or_else(|e| panic!("after {what}: {e:?}"));
        assert!(got == exchanged(round, small), "all-to-all after {what} differs");
    };
    let mut g = vec![0u64; small * n as usize];
    works(1, "nothing", &mut g).await;
    let mismatch = |e: &Error| matches!(e, Error::Invalid(InvalidArgument::LengthMismatch { .. }));

    // Rank 1's result buffer one element short, then one over.
    let extra = usize::from(r == 1);
    let mut short = vec![0u64; small * n as usize - extra];
    let got = w.allgather_into(&mine(0, small), &mut short).timeout(guard).await;
    refused_by_one(r, got, mismatch, "all-gather into a short buffer");
    works(2, "a refused all-gather", &mut g).await;
    let mut long = vec![0u64; small * n as usize + extra];
    let got = w.alltoall_into(&parts(0, small), &mut long).timeout(guard).await;
    refused_by_one(r, got, mismatch, "all-to-all into a long buffer");
    works(3, "a refused all-to-all", &mut g).await;
    // Rank 1's blocks one element longer than the others'.
    let got = w.alltoall(&parts(0, small + extra)).timeout(guard).await.map(drop);
    refused_by_one(r, got, |_| false, "all-to-all of another block length");
    works(4, "blocks of another length", &mut g).await;

    // Calls dropped mid-way (1 MiB blocks: tens of milliseconds of writes in the emulated VM).
    let mut dropped = 0;
    let mut into = vec![0u64; big * n as usize];
    let mut round = 10;
    for ms in [0, 2, 10, 30, 80] {
        let wait = Duration::from_millis(ms);
        round += 1;
        match tokio::time::timeout(wait, w.alltoall(&parts(round, big))).await {
            Err(_) => dropped += 1,
            Ok(Ok(got)) => assert!(got == exchanged(round, big), "an all-to-all not dropped differs"),
            Ok(Err(e)) => assert!(matches!(e, Error::Collective(CollError::Refused { .. })), "{e:?}"),
        }
        round += 1;
        works(round, "a dropped all-to-all", &mut g).await;
        round += 1;
        let mine_big = mine(round, big);
        match tokio::time::timeout(wait, w.allgather_into(&mine_big, &mut into)).await {
            Err(_) => dropped += 1,
            Ok(Ok(())) => assert!(into == gathered(round, big), "an all-gather not dropped differs"),
            Ok(Err(e)) => assert!(matches!(e, Error::Collective(CollError::Refused { .. })), "{e:?}"),
        }
        // The dropped call's buffer, in a call that runs to its end, then the small ones.
        round += 1;
        w.alltoall_into(&parts(round, big), &mut into).timeout(guard).await.unwrap();
        assert!(into == exchanged(round, big), "an all-to-all into a dropped call's buffer differs");
        round += 1;
        works(round, "a dropped all-gather", &mut g).await;
    }
    w.barrier().timeout(guard).await.unwrap();
    println!("RDMA-FAIL-OK {n} ranks, {dropped} calls dropped");
}

/// One rank of a scenario, when run by `ferrorun`.
#[test]
fn rma_rank_process() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let limit = Duration::from_secs(240);
    let what = scenario.clone();
    let body = async move {
        let mut settings = ferrocomm::Settings::from_env().unwrap();
        let me = std::env::var("FERROCOMM_RANK").unwrap();
        if std::env::var("FERROCOMM_RMA_TCP_RANK").is_ok_and(|r| r == me) {
            settings.transports = ferrocomm::TransportChoice::Tcp;
        }
        let w = ferrocomm::init_with(settings).await.unwrap();
        match scenario.as_str() {
            "suite" => {
                rma_suite::suite(&w).await;
                let routes: Vec<&str> = (0..w.size()).map(|p| w.transport_for(p)).collect();
                println!("RMA-OK {routes:?}");
                w.finalize().await.unwrap();
            }
            "kill" => kill_scenario(w).await,
            "rdma-coll" => {
                rdma_collectives(&w).await;
                w.finalize().await.unwrap();
            }
            "rdma-fail" => {
                rdma_failures(&w).await;
                w.finalize().await.unwrap();
            }
            other => panic!("unknown scenario {other}"),
        }
    };
    rt.block_on(async move {
        if tokio::time::timeout(limit, body).await.is_err() {
            panic!("scenario {what} took over {limit:?}");
        }
    });
}

async fn kill_scenario(w: ferrocomm::World) {
    let t = Duration::from_secs(30);
    let r = w.rank();
    let owned = (r == 2).then(|| (w.publish(1 << 16, Access::WINDOW).unwrap(), w.publish_queue(8, 2).unwrap()));
    // Rank 0's segment outlives rank 2: the survivors keep using it.
    let kept = (r == 0).then(|| w.publish(64, Access::ATOMIC).unwrap());
    let mine = match (&owned, &kept) {
        (Some((s, q)), _) => [s.id().to_u64(), q.id().to_u64(), 0],
        (_, Some(k)) => [0, 0, k.id().to_u64()],
        _ => [0; 3],
    };
    let ids = w.allgather(&mine).timeout(t).await.unwrap();
    let (win, queue) = (SegmentId::from_u64(ids[6]), SegmentId::from_u64(ids[7]));
    let survivor = w.attach(SegmentId::from_u64(ids[2])).timeout(t).await.unwrap();
    if r == 2 {
        w.barrier().timeout(t).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // SAFETY: ends this process, as a crash would.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        unreachable!();
    }
    let s = w.attach(win).timeout(t).await.unwrap();
    let q = w.attach(queue).timeout(t).await.unwrap();
    rma_suite::check_route(&w, &s);
    // Rank 0 fills the queue (nobody dequeues); its next enqueue waits for room.
    let waiting = if r == 0 {
        for i in 0..2u64 {
            w.enqueue(&q, &i.to_le_bytes()).timeout(t).await.unwrap();
        }
        Some(w.enqueue(&q, &[9; 8]))
    } else {
        None
    };
    w.barrier().timeout(t).await.unwrap();
    let ev = w.event();
    let t0 = Instant::now();
    let hammer = async {
        loop {
            tokio::task::yield_now().await;
            w.put(&s, 64 * r as usize, &[r as u8; 64]).on(&ev);
            match w.fetch_add(&s, 0, 1).timeout(t).await {
                Ok(_) => continue,
                Err(e) => return e,
            }
        }
    };
    let (err, waited) = match waiting {
        Some(op) => {
            let (e, w) = futures::join!(hammer, op.timeout(t));
            (e, Some(w))
        }
        None => (hammer.await, None),
    };
    assert!(matches!(err, Error::PeerLost { rank: 2, .. }), "{err:?}");
    if let Some(res) = waited {
        assert!(matches!(res, Err(Error::PeerLost { rank: 2, .. })), "the waiting enqueue: {res:?}");
    }
    ev.wait_all().timeout(t).await.ok();
    if let Some(e) = ev.error() {
        assert!(matches!(e, Error::PeerLost { rank: 2, .. }), "{e:?}");
    }
    // Later operations fail at once.
    let later = w.fetch_add(&s, 0, 1).timeout(t).await;
    assert!(matches!(later, Err(Error::PeerLost { rank: 2, .. })), "{later:?}");
    let mut b = [0u8; 8];
    let later = w.get(&s, 0, &mut b).timeout(t).await;
    assert!(matches!(later, Err(Error::PeerLost { rank: 2, .. })), "{later:?}");
    let lost_after = t0.elapsed();
    // One-sided traffic among the survivors goes on: ranks 1 and 3 count themselves in at rank 0,
    // which waits for them (reading its own memory) before it leaves.
    if let Some(k) = &kept {
        let word = k.word(0).unwrap();
        while word.load(std::sync::atomic::Ordering::Acquire) != 2 {
            assert!(t0.elapsed() < t, "the survivors' fetch-adds did not come");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    } else {
        w.fetch_add(&survivor, 0, 1).timeout(t).await.unwrap();
    }
    println!("RMA-PEER-LOST-OK after {lost_after:?}");
}
