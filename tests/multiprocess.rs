//! Ranks as separate processes started by `ferrorun`: the point-to-point suite on each TCP
//! backend and over shared memory, eight busy-polling ranks on two cores, adaptive mode's hybrid
//! polling, a rank killed with SIGKILL in the middle of a transfer, every collective, single-copy
//! calls dropped before their first poll, and ranks that differ (one adaptive among busy ones,
//! one without shared memory, one with other settings).
//!
//! The ranks are this very test binary, re-run by `ferrorun` with `--exact rank_process` and the
//! scenario in `FERROCOMM_TEST_SCENARIO`; without that variable `rank_process` has nothing to do.
//! `FERROCOMM_TEST_*_RANK=r` variables give rank `r` alone a different setting.

mod coll;
mod common;

use std::sync::{PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use ferrocomm::{Algorithm, Deadline, Error, Operation, Source, TagMatch};

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");
const SCENARIO: &str = "FERROCOMM_TEST_SCENARIO";

/// Runs `scenario` on `n` ranks over `transport`: `uring` or `portable` (TCP), `shm`, or `verbs`.
fn launch(n: u32, scenario: &str, transport: &str) -> (Option<i32>, String, Duration) {
    launch_env(n, scenario, transport, &[])
}

/// [`launch`] with extra `KEY=VALUE` variables for every rank.
fn launch_env(n: u32, scenario: &str, transport: &str, env: &[&str]) -> (Option<i32>, String, Duration) {
    common::Job { ferrorun: FERRORUN, rank_test: "rank_process", scenario_var: SCENARIO, grace_s: 5 }
        .run(n, scenario, transport, env)
}

/// The hybrid-polling test times waits, so it runs alone: it holds this lock for writing, and
/// every other test of this binary holds it for reading (their ranks would otherwise load both
/// cores and make the waits irregular).
static MACHINE: RwLock<()> = RwLock::new(());

fn sharing_the_machine() -> RwLockReadGuard<'static, ()> {
    MACHINE.read().unwrap_or_else(PoisonError::into_inner)
}

/// True if some line of rank `r`'s output contains `what`.
fn said(text: &str, r: u32, what: &str) -> bool {
    text.lines().any(|l| l.starts_with(&format!("[{r}] ")) && l.contains(what))
}

#[test]
fn suite_under_ferrorun_every_transport() {
    let _machine = sharing_the_machine();
    for transport in ["uring", "portable", "shm"] {
        let name = if transport == "shm" { "shm".to_string() } else { format!("tcp-{transport}") };
        for n in [2, 4] {
            let (code, text, _) = launch(n, "suite", transport);
            assert_eq!(code, Some(0), "{transport}, {n} ranks:\n{text}");
            for r in 0..n {
                assert!(said(&text, r, &format!("RANK-OK {name}")), "{transport} rank {r}:\n{text}");
            }
        }
    }
}

/// Adaptive mode between processes over shared memory: every message arrives, in order, and
/// regular 10 ms gaps get hybrid polling's alarms. The alarm count depends on how regular the
/// waits were, so the test runs alone and has three tries to see them (the pacer's rules are
/// unit-tested deterministically in the reactor).
#[test]
fn hybrid_polling_between_processes() {
    let _alone = MACHINE.write().unwrap_or_else(PoisonError::into_inner);
    let mut seen = Vec::new();
    for _ in 0..3 {
        let (code, text, _) = launch_env(2, "paced", "shm", &["FERROCOMM_PROGRESS=adaptive:50"]);
        assert_eq!(code, Some(0), "{text}");
        let alarms = text
            .lines()
            .filter(|l| l.starts_with("[1] "))
            .find_map(|l| l.split_once("PACED-OK alarms_set=")?.1.split_whitespace().next()?.parse::<u64>().ok())
            .unwrap_or_else(|| panic!("rank 1 did not report:\n{text}"));
        if alarms >= 5 {
            return;
        }
        seen.push(alarms);
    }
    panic!("hybrid polling set fewer than 5 alarms in each of 3 runs: {seen:?}");
}

/// Ranks in different progress modes agree on every collective's algorithm (they choose alike
/// from what each announced at bootstrap; were the busy ones to take the shared-memory board and
/// the adaptive one messages, the first collective would hang). Ranks whose collective selection
/// settings differ fail at init with an error that says so.
#[test]
fn ranks_agree_on_collective_algorithms() {
    let _machine = sharing_the_machine();
    for transport in ["shm", "uring"] {
        let env = ["FERROCOMM_PROGRESS=busy", "FERROCOMM_TEST_ADAPTIVE_RANK=1"];
        let (code, text, _) = launch_env(3, "collectives", transport, &env);
        assert_eq!(code, Some(0), "{transport}:\n{text}");
        assert!((0..3).all(|r| said(&text, r, "RANK-OK")), "{transport}:\n{text}");
    }
    let (code, text, took) = launch_env(3, "collectives", "shm", &["FERROCOMM_TEST_PIN_RANK=2"]);
    assert_ne!(code, Some(0), "{text}");
    assert!(text.contains("settings differ from rank"), "{text}");
    assert!(took < Duration::from_secs(60), "{took:?}");
}

/// A scatter and a gather into buffers between busy-polling processes on one host take the board
/// for small blocks and single copy for large ones (each rank reads its block from the root's
/// process; the root reads each rank's data where it is) by default, with right results either
/// side of each switch, and when pinned to each tier.
#[test]
fn rooted_into_tiers_between_processes() {
    let _machine = sharing_the_machine();
    for n in [2, 3, 4] {
        let (code, text, _) = launch_env(n, "scatter-tiers", "shm", &["FERROCOMM_PROGRESS=busy"]);
        assert_eq!(code, Some(0), "{n} ranks:\n{text}");
        assert!((0..n).all(|r| said(&text, r, "RANK-OK")), "{n} ranks:\n{text}");
    }
}

/// Single-copy calls that rank 1 drops before their first poll, between adaptive processes on one
/// host (each rank reads the others' memory in their processes): the others fail promptly with
/// `CollError::Withdrawn` where they read rank 1's memory, though rank 1's next call is not on the
/// board, and the next calls work ([`coll::lending_calls_dropped`]; 5 ranks take the split scan,
/// which lends two regions a rank).
#[test]
fn lending_calls_dropped_between_processes() {
    let _machine = sharing_the_machine();
    for n in [2, 5] {
        let (code, text, _) = launch_env(n, "coll-drop-lending", "shm", &["FERROCOMM_PROGRESS=adaptive:20"]);
        assert_eq!(code, Some(0), "{n} ranks:\n{text}");
        assert!((0..n).all(|r| said(&text, r, "RANK-OK")), "{n} ranks:\n{text}");
    }
}

/// A rank whose kernel refuses `pidfd_open` (old kernels, some container sandboxes, valgrind)
/// cannot run the shared-memory transport: its peers on the host reach it over TCP, the others
/// still use shared memory among themselves, and the point-to-point suite and every collective
/// pass (all ranks must agree that the job no longer shares memory as a whole: the board's
/// collectives are out). The refusal is real: a seccomp filter in rank 1's process makes the
/// kernel answer ENOSYS.
#[test]
fn rank_without_shared_memory_is_reached_over_tcp() {
    let _machine = sharing_the_machine();
    // The same holds for a rank told to use TCP alone (`FERROCOMM_TRANSPORTS=tcp` on that rank).
    for setting in ["FERROCOMM_TEST_DENY_PIDFD=1", "FERROCOMM_TEST_TCP_RANK=1"] {
        for scenario in ["suite", "collectives"] {
            let (code, text, _) = launch_env(3, scenario, "shm", &[setting]);
            assert_eq!(code, Some(0), "{setting} {scenario}:\n{text}");
            // Each rank reports its transport to the next one.
            for (r, want) in [(0, "RANK-OK tcp-"), (1, "RANK-OK tcp-"), (2, "RANK-OK shm")] {
                assert!(said(&text, r, want), "{setting} {scenario}, rank {r}:\n{text}");
            }
        }
    }
}

/// Makes the kernel refuse `pidfd_open` with ENOSYS in this thread and the threads it starts.
fn deny_pidfd_open() {
    use libc::{BPF_ABS, BPF_JEQ, BPF_JMP, BPF_K, BPF_LD, BPF_RET, BPF_W, sock_filter, sock_fprog};
    let op = |code: u32, jt: u8, jf: u8, k: u32| sock_filter { code: code as u16, jt, jf, k };
    let filter = [
        // The syscall number is the first word of `seccomp_data`.
        op(BPF_LD | BPF_W | BPF_ABS, 0, 0, 0),
        op(BPF_JMP | BPF_JEQ | BPF_K, 0, 1, libc::SYS_pidfd_open as u32),
        op(BPF_RET | BPF_K, 0, 0, libc::SECCOMP_RET_ERRNO | libc::ENOSYS as u32),
        op(BPF_RET | BPF_K, 0, 0, libc::SECCOMP_RET_ALLOW),
    ];
    let prog = sock_fprog { len: filter.len() as u16, filter: filter.as_ptr().cast_mut() };
    // SAFETY: the filter outlives the call (the kernel copies it); no new privileges first, as
    // an unprivileged filter requires.
    unsafe {
        assert_eq!(libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), 0);
        let r = libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const sock_fprog, 0, 0);
        assert_eq!(r, 0, "seccomp: {}", std::io::Error::last_os_error());
    }
}

/// Eight ranks on two cores over shared memory, busy-polling: no livelock.
#[test]
fn oversubscribed_shared_memory() {
    let _machine = sharing_the_machine();
    let (code, text, took) = launch(8, "ring", "shm");
    assert_eq!(code, Some(0), "{text}");
    assert!((0..8).all(|r| said(&text, r, "RANK-OK shm")), "{text}");
    println!("8 busy-polling ranks on 2 cores: {took:?}");
}

#[test]
fn killed_rank_fails_its_peers_operations_promptly() {
    let _machine = sharing_the_machine();
    for backend in ["uring", "portable", "shm"] {
        let (code, text, took) = launch(4, "kill", backend);
        assert_ne!(code, Some(0), "the launcher reports the killed rank:\n{text}");
        for r in [0, 1, 3] {
            assert!(said(&text, r, "PEER-LOST-OK"), "{backend} rank {r}:\n{text}");
        }
        assert!(!said(&text, 2, "RANK-OK"), "{text}");
        assert!(took < Duration::from_secs(30), "{took:?}");
    }
}

/// Every collective operation and algorithm, ranks as processes, over TCP and shared memory, at
/// 1-9 ranks on both and 16 over TCP (16 ranks over shared memory run in-process, in
/// tests/collectives.rs: 16 busy-polling processes on two CPUs add minutes and no other path).
#[test]
fn collectives_under_ferrorun() {
    let _machine = sharing_the_machine();
    for (transport, most) in [("uring", 16), ("shm", 9)] {
        for n in (1..=9).chain([16]).filter(|&n| n <= most) {
            let (code, text, took) = launch(n, "collectives", transport);
            assert_eq!(code, Some(0), "{transport}, {n} ranks:\n{text}");
            assert!((0..n).all(|r| said(&text, r, "RANK-OK")), "{transport} {n}:\n{text}");
            println!("collectives, {transport}, {n} ranks: {took:?}");
        }
    }
}

/// The point-to-point suite over RDMA verbs with each eager path (rings written by RDMA, a shared
/// receive queue) paired with each rendezvous protocol (RDMA write into the receiver's announced
/// buffer, RDMA read of the sender's lent chunks), at 4 ranks and at 2.
#[cfg(feature = "verbs")]
#[test]
fn suite_over_verbs() {
    let _machine = sharing_the_machine();
    if !common::verbs_here("suite_over_verbs") {
        return;
    }
    // Every eager path with every rendezvous path; the shared receive queue, which several peers
    // share, at 4 ranks (the rings at 4 ranks in killed_rank_over_verbs). A 4-rank run costs
    // about three 2-rank ones in the VM (four busy-polling processes on two emulated CPUs).
    for (eager, rndv, n) in [("srq", "read", 4), ("ring", "write", 2), ("ring", "read", 2), ("srq", "write", 2)] {
        let env = [&format!("FERROCOMM_VERBS_EAGER={eager}") as &str, &format!("FERROCOMM_VERBS_RENDEZVOUS={rndv}")];
        let (code, text, took) = launch_env(n, "suite", "verbs", &env);
        assert_eq!(code, Some(0), "verbs ({eager}, {rndv}), {n} ranks:\n{text}");
        for r in 0..n {
            assert!(said(&text, r, "RANK-OK verbs"), "verbs ({eager}, {rndv}) rank {r}:\n{text}");
        }
        println!("verbs suite, eager by {eager}, rendezvous by {rndv}, {n} ranks: {took:?}");
    }
    // Blocking progress: only the background task drives the transport, woken by the completion
    // channel (a frame posted by the send itself is never pushed by anyone else).
    let env = ["FERROCOMM_PROGRESS=blocking"];
    let (code, text, took) = launch_env(2, "suite", "verbs", &env);
    assert_eq!(code, Some(0), "verbs, blocking progress, 2 ranks:\n{text}");
    for r in 0..2 {
        assert!(said(&text, r, "RANK-OK verbs"), "verbs, blocking progress, rank {r}:\n{text}");
    }
    println!("verbs suite, blocking progress, 2 ranks: {took:?}");
}

/// A rank killed with SIGKILL as a collective starts: the loss revokes the world, so every
/// survivor's call fails with `PeerLost` naming rank 2 (the lost rank, never a survivor that gave
/// up because of it; docs/failure.md), on TCP, on shared memory, on the shared-memory board (small
/// all-reduce pinned; and a barrier, which fans in to rank 0 there), and by single copy (1 MiB
/// all-reduce pinned; rank 2 dies with its memory lent, after its first poll of the call). Also a
/// 1 MiB single-copy broadcast whose root (rank 2) dies with its memory lent: the receivers, which
/// offer it half of their copy (split), fail the same way. The launcher names rank 2.
#[test]
fn killed_rank_fails_the_collective() {
    let _machine = sharing_the_machine();
    let board = format!("FERROCOMM_COLL={}", coll::BOARD);
    let single = format!("FERROCOMM_COLL={}", coll::SINGLE_COPY);
    for (transport, scenario, env) in [
        ("uring", "coll-kill", &[][..]),
        ("shm", "coll-kill", &[]),
        ("shm", "coll-kill-board", &[&board as &str]),
        ("shm", "coll-kill-board-barrier", &[&board as &str]),
        ("shm", "coll-kill-single-copy", &[&single as &str]),
        ("shm", "coll-kill-bcast-single-copy", &[&single as &str]),
    ] {
        let (code, text, took) = launch_env(4, scenario, transport, env);
        assert_ne!(code, Some(0), "the launcher reports the killed rank:\n{text}");
        assert!(text.contains("ferrorun: rank 2 exited with signal 9"), "{transport} {scenario}:\n{text}");
        for r in [0, 1, 3] {
            assert!(said(&text, r, "COLL-PEER-LOST-OK"), "{transport} {scenario} rank {r}:\n{text}");
        }
        assert!(took < Duration::from_secs(40), "{took:?}");
    }
}

/// `FERROCOMM_COLL` pins algorithms for the whole job; results stay right.
#[test]
fn setting_pins_collective_algorithms() {
    let _machine = sharing_the_machine();
    let pins = "FERROCOMM_COLL=allreduce=ring,bcast=scatter-allgather,alltoall=linear,allgather=ring";
    let (code, text, _) = launch_env(5, "pinned", "shm", &[pins]);
    assert_eq!(code, Some(0), "{text}");
    assert!((0..5).all(|r| said(&text, r, "RANK-OK pinned")), "{text}");
}

/// Six processes posing as three hosts of two ranks (`FERROCOMM_HOST_ID`): shared memory inside a
/// "host", TCP between them, the node-leader algorithms chosen for barrier and all-reduce and
/// reliable multicast for broadcast, with correct results.
#[test]
fn hierarchical_collectives_across_pretend_hosts() {
    let _machine = sharing_the_machine();
    // Over TCP alone too: the node-leader algorithms follow hosts, not shared memory.
    for transport in ["shm", "uring"] {
        let (code, text, _) = launch(6, "hierarchy", transport);
        assert_eq!(code, Some(0), "{transport}:\n{text}");
        assert!((0..6).all(|r| said(&text, r, "RANK-OK hierarchical")), "{transport}:\n{text}");
    }
}

/// Processes each posing as a host of its own (`FERROCOMM_HOST_ID`) over TCP, as
/// `ferrocomm-bench hosts` runs them: broadcasts from 256 KiB up, beyond scatter + all-gather's
/// size too, take the pipelined chain (the data whole, above the eager limit, its receive
/// posted ahead), with correct results from every root on a chain of even and odd length; every
/// other operation with the default table as well.
#[test]
fn pipelined_broadcast_across_pretend_hosts() {
    let _machine = sharing_the_machine();
    for n in [4, 5] {
        let (code, text, _) = launch(n, "apart", "uring");
        assert_eq!(code, Some(0), "{n} ranks:\n{text}");
        assert!((0..n).all(|r| said(&text, r, "RANK-OK apart")), "{n} ranks:\n{text}");
    }
}

/// A rank killed with SIGKILL in the middle of an RDMA transfer, for each rendezvous protocol
/// (RDMA write with the rings, RDMA read with the shared receive queue).
#[cfg(feature = "verbs")]
#[test]
fn killed_rank_over_verbs() {
    let _machine = sharing_the_machine();
    if !common::verbs_here("killed_rank_over_verbs") {
        return;
    }
    for (eager, rndv) in [("ring", "write"), ("srq", "read")] {
        let env = [&format!("FERROCOMM_VERBS_EAGER={eager}") as &str, &format!("FERROCOMM_VERBS_RENDEZVOUS={rndv}")];
        let (code, text, took) = launch_env(4, "kill", "verbs", &env);
        assert_ne!(code, Some(0), "the launcher reports the killed rank:\n{text}");
        for r in [0, 1, 3] {
            assert!(said(&text, r, "PEER-LOST-OK"), "verbs ({eager}, {rndv}) rank {r}:\n{text}");
        }
        assert!(!said(&text, 2, "RANK-OK"), "{text}");
        assert!(took < Duration::from_secs(60), "{took:?}");
        println!("verbs kill ({eager}, {rndv}): {took:?}");
    }
}

/// Whether `var` names this rank (`FERROCOMM_TEST_*_RANK=r`: rank `r` alone gets a setting).
fn for_this_rank(var: &str) -> bool {
    matches!((std::env::var(var), std::env::var("FERROCOMM_RANK")), (Ok(a), Ok(b)) if a == b)
}

/// One rank of a scenario, when run by `ferrorun`.
#[test]
fn rank_process() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    let what = scenario.clone();
    if for_this_rank("FERROCOMM_TEST_DENY_PIDFD") {
        // Before any thread starts: they all inherit the filter.
        deny_pidfd_open();
    }
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // A scenario that hangs (ranks that disagree on a collective's algorithm, say) fails its
    // test instead of stalling the suite.
    let limit = Duration::from_secs(300);
    let body = async move {
        let mut settings = ferrocomm::Settings::from_env().unwrap();
        if for_this_rank("FERROCOMM_TEST_ADAPTIVE_RANK") {
            settings.progress = ferrocomm::ProgressMode::Adaptive(Duration::from_micros(50));
        }
        if for_this_rank("FERROCOMM_TEST_TCP_RANK") {
            settings.transports = ferrocomm::TransportChoice::Tcp;
        }
        if for_this_rank("FERROCOMM_TEST_PIN_RANK") {
            settings.collectives = settings.collectives.with_overrides("allreduce=ring").unwrap();
        }
        if scenario == "ring" {
            settings.progress = ferrocomm::ProgressMode::BusyPoll;
        }
        if scenario == "hierarchy" {
            let rank: u32 = std::env::var("FERROCOMM_RANK").unwrap().parse().unwrap();
            // SAFETY: set before any other thread of this process reads the environment.
            unsafe { std::env::set_var("FERROCOMM_HOST_ID", format!("pretend-host-{}", rank / 2)) };
        }
        if scenario == "apart" {
            let rank: u32 = std::env::var("FERROCOMM_RANK").unwrap().parse().unwrap();
            // SAFETY: set before any other thread of this process reads the environment.
            unsafe { std::env::set_var("FERROCOMM_HOST_ID", format!("apart-host-{rank}")) };
        }
        let w = ferrocomm::init_with(settings).await.unwrap();
        match scenario.as_str() {
            "suite" => {
                common::suite(&w).await;
                println!("RANK-OK {}", w.transport_for((w.rank() + 1) % w.size()));
                w.finalize().await.unwrap();
            }
            "kill" => kill_scenario(w).await,
            "paced" => {
                const N: u64 = 40;
                if w.rank() == 0 {
                    for i in 0..N {
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        w.send(1, 3, i.to_le_bytes().to_vec()).await.unwrap();
                    }
                } else {
                    for i in 0..N {
                        let m = w.recv(0u32, 3u64).await.unwrap();
                        assert_eq!(m.data[..], i.to_le_bytes(), "message {i}");
                    }
                    let s = w.hybrid_stats();
                    println!("PACED-OK alarms_set={} completed_after_alarm={}", s.alarms_set, s.completed_after_alarm);
                }
                w.finalize().await.unwrap();
            }
            "collectives" => {
                coll::operations(&w, &coll::TABLE_COUNTS, "table").await;
                coll::every_algorithm(&w).await;
                println!("RANK-OK {}", w.transport_for((w.rank() + 1) % w.size()));
                w.finalize().await.unwrap();
            }
            "scatter-tiers" => {
                assert_eq!(w.collective_algorithm(Operation::Scatter, 8 << 10), Algorithm::SharedMemory);
                assert_eq!(w.collective_algorithm(Operation::Scatter, 64 << 10), Algorithm::SingleCopy);
                coll::rooted_into_thresholds(&w, "default").await;
                coll::rooted_into_thresholds(&coll::on_board(&w), "board").await;
                coll::rooted_into_thresholds(&coll::single_copy(&w), "single-copy").await;
                println!("RANK-OK {}", w.transport_for((w.rank() + 1) % w.size()));
                w.finalize().await.unwrap();
            }
            "coll-drop-lending" => {
                coll::lending_calls_dropped(&w).await;
                println!("RANK-OK {}", w.transport_for((w.rank() + 1) % w.size()));
                w.finalize().await.unwrap();
            }
            "coll-kill-bcast-single-copy" => {
                let mut v = vec![7u8; 1 << 20];
                assert_eq!(w.collective_algorithm(Operation::Bcast, v.len()), Algorithm::SingleCopy);
                ready_for_the_kill(&w).await;
                if w.rank() == 2 {
                    // Lend its memory (the call's first poll), then die.
                    let mut call = Box::pin(w.broadcast(2, &mut v));
                    assert!(futures::FutureExt::now_or_never(&mut call).is_none());
                    std::thread::sleep(Duration::from_millis(5));
                    // SAFETY: kill has no memory-safety preconditions (this process ends here, on purpose).
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                let res = w.broadcast(2, &mut v).timeout(Duration::from_secs(30)).await;
                assert!(matches!(res, Err(Error::PeerLost { rank: 2, .. })), "{res:?}");
                println!("COLL-PEER-LOST-OK");
            }
            "coll-kill-board-barrier" => {
                assert_eq!(w.collective_algorithm(Operation::Barrier, 0), Algorithm::SharedMemory);
                ready_for_the_kill(&w).await;
                if w.rank() == 2 {
                    // SAFETY: kill has no memory-safety preconditions (this process ends here, on purpose).
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                let res = w.barrier().timeout(Duration::from_secs(30)).await;
                assert!(matches!(res, Err(Error::PeerLost { rank: 2, .. })), "{res:?}");
                println!("COLL-PEER-LOST-OK");
            }
            "coll-kill" | "coll-kill-board" | "coll-kill-single-copy" => {
                let len = if scenario == "coll-kill-board" { 8 } else { 1 << 17 };
                if scenario == "coll-kill-board" {
                    assert_eq!(w.collective_algorithm(Operation::Allreduce, len * 8), Algorithm::SharedMemory);
                }
                if scenario == "coll-kill-single-copy" {
                    assert_eq!(w.collective_algorithm(Operation::Allreduce, len * 8), Algorithm::SingleCopy);
                }
                ready_for_the_kill(&w).await;
                let mut v = vec![1.0f64; len];
                let single = scenario == "coll-kill-single-copy";
                if w.rank() == 2 {
                    if single {
                        // Lend its memory (the call's first poll, before the others have called:
                        // the call cannot complete), then die.
                        let mut call = Box::pin(w.allreduce(&mut v, ferrocomm::ReduceOp::Sum));
                        assert!(futures::FutureExt::now_or_never(&mut call).is_none());
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    // SAFETY: kill has no memory-safety preconditions (this process ends here, on purpose).
                    unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
                }
                if single {
                    // After rank 2 has lent its memory.
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                let res = w.allreduce(&mut v, ferrocomm::ReduceOp::Sum).timeout(Duration::from_secs(30)).await;
                // Rank 2's loss revokes the world: the call fails naming rank 2, also where a
                // survivor that gave up first withdrew the memory it lent.
                assert!(matches!(res, Err(Error::PeerLost { rank: 2, .. })), "{res:?}");
                println!("COLL-PEER-LOST-OK");
            }
            "pinned" => {
                for (op, alg) in [
                    (Operation::Allreduce, Algorithm::Ring),
                    (Operation::Bcast, Algorithm::ScatterAllgather),
                    (Operation::Alltoall, Algorithm::Linear),
                    (Operation::Allgather, Algorithm::Ring),
                    (Operation::Barrier, Algorithm::Dissemination),
                ] {
                    assert_eq!(w.collective_algorithm(op, 8), alg, "{op}");
                }
                coll::operations(&w, &coll::TABLE_COUNTS, "pinned").await;
                println!("RANK-OK pinned");
                w.finalize().await.unwrap();
            }
            "hierarchy" => {
                let r = w.rank();
                let peer = r ^ 1;
                let tcp_only = std::env::var("FERROCOMM_TRANSPORTS").as_deref() == Ok("tcp");
                assert_eq!(w.transport_for(peer).starts_with("tcp"), tcp_only);
                assert!(w.transport_for((r + 2) % 6).starts_with("tcp"));
                for op in [Operation::Barrier, Operation::Bcast, Operation::Allreduce] {
                    assert_eq!(w.collective_algorithm(op, 1 << 20), Algorithm::Hierarchical, "{op}");
                }
                // A broadcast across hosts up to the table's multicast size goes by reliable
                // multicast (docs/multicast.md).
                assert_eq!(w.collective_algorithm(Operation::Bcast, 8), Algorithm::Multicast);
                coll::operations(&w, &coll::TABLE_COUNTS, "hierarchical").await;
                println!("RANK-OK hierarchical");
                w.finalize().await.unwrap();
            }
            "apart" => {
                let (r, n) = (w.rank(), w.size());
                let table = w.collective_table().clone();
                let at = table.bcast_pipeline;
                assert_eq!(w.collective_algorithm(Operation::Bcast, at - 8), Algorithm::Binomial);
                for bytes in [at, 1 << 20, table.bcast_large, 8 << 20] {
                    assert_eq!(w.collective_algorithm(Operation::Bcast, bytes), Algorithm::Pipeline, "{bytes} B");
                }
                // u64 counts either side of the chain's size and past scatter + all-gather's
                // size, one odd.
                let counts = [at / 8 - 1, at / 8, (1 << 20) / 8, table.bcast_large / 8 + 1, 300_001];
                for count in counts {
                    for root in [0, n / 2, n - 1] {
                        let mut buf = if r == root { coll::input(root, count) } else { vec![0u64; count] };
                        w.broadcast(root, &mut buf).await.unwrap();
                        assert!(buf == coll::input(root, count), "apart n={n} root={root} count={count} rank {r}");
                    }
                }
                coll::operations(&w, &coll::TABLE_COUNTS, "apart").await;
                println!("RANK-OK apart");
                w.finalize().await.unwrap();
            }
            "ring" => {
                common::ring_storm_rendezvous(&w).await;
                println!("RANK-OK {}", w.transport_for((w.rank() + 1) % w.size()));
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

/// The start of a kill scenario: a barrier, after which every rank but 2 tells rank 2 that its
/// barrier is over. Rank 2's loss revokes the world and fails every pending call there, the
/// barrier included, so rank 2 must not die while another rank is still in it.
async fn ready_for_the_kill(w: &ferrocomm::World) {
    const READY: u64 = 0x5EAD;
    w.barrier().timeout(Duration::from_secs(30)).await.unwrap();
    if w.rank() == 2 {
        for r in (0..w.size()).filter(|&r| r != 2) {
            w.recv(r, READY).timeout(Duration::from_secs(30)).await.unwrap();
        }
    } else {
        w.send(2, READY, Vec::new()).timeout(Duration::from_secs(30)).await.unwrap();
    }
}

/// Rank 1 streams 256 MiB to rank 2; rank 2 kills itself with SIGKILL mid-receive. Everyone with
/// an operation involving rank 2 (including a wildcard receive) must get a peer-lost error, fast.
async fn kill_scenario(w: ferrocomm::World) {
    let r = w.rank();
    if r == 2 {
        let _rx = w.recv_into(1, 1u64, BytesMut::zeroed(256 << 20));
        ready_for_the_kill(&w).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        // SAFETY: kill has no memory-safety preconditions (this process ends here, on purpose).
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        unreachable!();
    }
    // Everything is posted before the barrier, so it is pending when rank 2 dies.
    let data = vec![5u8; 256 << 20];
    let from2 = w.recv(2, TagMatch::Any);
    let any = w.recv(Source::Any, 77u64);
    ready_for_the_kill(&w).await;
    let send = (r == 1).then(|| w.send(2, 1, data));
    let t0 = Instant::now();
    let res = from2.timeout(Duration::from_secs(20)).await;
    assert!(matches!(res, Err(Error::PeerLost { rank: 2, .. })), "{res:?}");
    let res = any.timeout(Duration::from_secs(20)).await;
    assert!(matches!(res, Err(Error::PeerLost { rank: 2, .. })), "wildcard: {res:?}");
    if let Some(send) = send {
        // Either all data left before the kill, or the send fails: never a hang.
        let res = send.timeout(Duration::from_secs(20)).await;
        assert!(matches!(res, Ok(()) | Err(Error::PeerLost { rank: 2, .. })), "{res:?}");
    }
    println!("PEER-LOST-OK after {:?}", t0.elapsed());
}
