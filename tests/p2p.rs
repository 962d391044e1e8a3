//! The point-to-point suite with all ranks in this process, over real TCP on loopback (both
//! backends) and over shared memory, in each progress mode.

mod common;

use std::time::Duration;

use ferrocomm::{Error, ProgressMode, Settings, TcpBackend, TransportChoice, TransportError, testing};

/// The hybrid-polling test times waits, so it runs alone: it holds this lock for writing, and
/// every other test of this file holds it for reading (eight busy-polling ranks next to it made
/// its waits irregular and failed it in CI).
static MACHINE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

const ADAPTIVE: ProgressMode = ProgressMode::Adaptive(Duration::from_micros(50));

async fn run_suite(n: u32, settings: Settings, want: &'static str) {
    let names = testing::run(n, settings, |w| async move {
        common::suite(&w).await;
        let names: Vec<_> = (0..w.size()).filter(|&p| p != w.rank()).map(|p| w.transport_for(p)).collect();
        w.finalize().await.unwrap();
        names
    })
    .await
    .unwrap();
    assert!(names.iter().flatten().all(|&t| t == want), "{names:?}");
}

fn tcp(backend: TcpBackend, progress: ProgressMode) -> Settings {
    Settings::builder().transports(TransportChoice::Tcp).tcp_backend(backend).progress(progress).build()
}

fn shm(progress: ProgressMode) -> Settings {
    Settings::builder().transports(TransportChoice::Auto).progress(progress).build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_tcp_portable() {
    let _machine = MACHINE.read().await;
    for n in [1, 2, 4] {
        run_suite(n, tcp(TcpBackend::Portable, ADAPTIVE), "tcp-portable").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_tcp_uring() {
    let _machine = MACHINE.read().await;
    for n in [1, 2, 4] {
        run_suite(n, tcp(TcpBackend::Uring, ADAPTIVE), "tcp-uring").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_shared_memory() {
    let _machine = MACHINE.read().await;
    for n in [1, 2, 4] {
        run_suite(n, shm(ADAPTIVE), "shm").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_blocking_and_busy_modes() {
    let _machine = MACHINE.read().await;
    run_suite(3, tcp(TcpBackend::Uring, ProgressMode::Blocking), "tcp-uring").await;
    run_suite(3, tcp(TcpBackend::Portable, ProgressMode::BusyPoll), "tcp-portable").await;
    run_suite(3, shm(ProgressMode::Blocking), "shm").await;
    run_suite(3, shm(ProgressMode::BusyPoll), "shm").await;
}

/// More ranks than cores, every one busy-polling: must not livelock.
/// Dropping the last handle on a world ends the job for that rank at once: also right after an
/// awaited receive, whose reference to the world is dropped late (see `Op`'s poll), and with an
/// operation still in flight, which then fails with `Shutdown` instead of waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_last_handle_ends_the_rank() {
    let _machine = MACHINE.read().await;
    for progress in [ProgressMode::BusyPoll, ADAPTIVE, ProgressMode::Blocking] {
        testing::run(2, shm(progress), |w| async move {
            let limit = Duration::from_secs(20);
            if w.rank() == 0 {
                w.send(1, 1, vec![1u8; 8]).await.unwrap();
                let echo = w.recv(1, 2).await.unwrap();
                assert_eq!(echo.data.len(), 8);
                let never = w.recv(1, 3);
                drop(w);
                let r = tokio::time::timeout(limit, never).await.expect("the pending receive hangs");
                // Shutdown, or rank 1's goodbye if it finalized first: either way it ends.
                let left = matches!(r, Err(Error::PeerLost { rank: 1, reason: TransportError::Left }));
                assert!(matches!(r, Err(Error::Shutdown)) || left, "{r:?}");
            } else {
                let m = w.recv(0, 1).await.unwrap();
                w.send(0, 2, m.data).await.unwrap();
                // Rank 0 never calls finalize: its goodbye comes from dropping its handle.
                let r = tokio::time::timeout(limit, w.recv(0, 4)).await.expect("rank 0 never left");
                assert!(matches!(r, Err(Error::PeerLost { rank: 0, reason: TransportError::Left })), "{r:?}");
                w.finalize().await.unwrap();
            }
        })
        .await
        .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversubscribed_busy_poll() {
    let _machine = MACHINE.read().await;
    for settings in [tcp(TcpBackend::Auto, ProgressMode::BusyPoll), shm(ProgressMode::BusyPoll)] {
        testing::run(8, settings, |w| async move {
            common::ring_storm_rendezvous(&w).await;
        })
        .await
        .unwrap();
    }
}

/// Rank 0 sends `gaps.len()` numbered messages, pausing before each for its gap; rank 1 receives
/// them in adaptive mode. Returns rank 1's hybrid-polling figures.
async fn paced(gaps: Vec<Duration>) -> ferrocomm::HybridStats {
    let stats = testing::run(2, shm(ADAPTIVE), move |w| {
        let gaps = gaps.clone();
        async move {
            let n = gaps.len() as u64;
            let mut stats = None;
            if w.rank() == 0 {
                for (i, gap) in gaps.into_iter().enumerate() {
                    tokio::time::sleep(gap).await;
                    w.send(1, 7, (i as u64).to_le_bytes().to_vec()).await.unwrap();
                }
            } else {
                for i in 0..n {
                    let m = w.recv(0, 7u64).await.unwrap();
                    assert_eq!(m.data[..], i.to_le_bytes(), "message {i} out of order or corrupt");
                }
                stats = Some(w.hybrid_stats());
            }
            w.finalize().await.unwrap();
            stats
        }
    })
    .await
    .unwrap();
    stats.into_iter().flatten().next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adaptive_mode_wakes_ahead_of_regular_messages() {
    let _alone = MACHINE.write().await;
    // Regular 10 ms waits: after a few, the receiver sets an alarm before the next ones and spins
    // through their end (hybrid polling); every message arrives, in order. How many alarms depends
    // on how regular the waits really were on a shared machine, so three tries to see them.
    let mut seen = Vec::new();
    for _ in 0..3 {
        let s = paced(vec![Duration::from_millis(10); 40]).await;
        seen.push(s);
        if s.alarms_set >= 5 {
            break;
        }
    }
    assert!(seen.last().unwrap().alarms_set >= 5, "fewer than 5 alarms in each of 3 runs: {seen:?}");
    // Waits of 2 and 30 ms in turn disagree: no alarm, the receiver sleeps until woken.
    let gaps = (0..16).map(|i| Duration::from_millis(if i % 2 == 0 { 2 } else { 30 })).collect();
    let s = paced(gaps).await;
    assert_eq!(s.alarms_set, 0, "{s:?}");
}
