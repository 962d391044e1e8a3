//! The point-to-point suite with all ranks in this process (real TCP on loopback), on both
//! TCP backends and in each progress mode.

mod common;

use ferrocomm::{ProgressMode, Settings, TcpBackend, testing};

async fn run_suite(n: u32, backend: TcpBackend, progress: ProgressMode) {
    let settings = Settings { tcp_backend: backend, progress, ..Settings::default() };
    let names = testing::run(n, settings, |w| async move {
        common::suite(&w).await;
        let name = w.transport_name();
        w.finalize().await.unwrap();
        name
    })
    .await
    .unwrap();
    let want = if backend == TcpBackend::Uring { "tcp-uring" } else { "tcp-portable" };
    assert!(n == 1 || names.iter().all(|&t| t == want), "{names:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_portable() {
    for n in [1, 2, 4] {
        run_suite(n, TcpBackend::Portable, ProgressMode::Adaptive(std::time::Duration::from_micros(50))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_uring() {
    for n in [1, 2, 4] {
        run_suite(n, TcpBackend::Uring, ProgressMode::Adaptive(std::time::Duration::from_micros(50))).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_blocking_and_busy_modes() {
    run_suite(3, TcpBackend::Uring, ProgressMode::Blocking).await;
    run_suite(3, TcpBackend::Portable, ProgressMode::BusyPoll).await;
}

/// More ranks than cores, every one busy-polling: must not livelock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversubscribed_busy_poll() {
    let settings = Settings { progress: ProgressMode::BusyPoll, ..Settings::default() };
    testing::run(8, settings, |w| async move {
        common::ring_storm_rendezvous(&w).await;
    })
    .await
    .unwrap();
}
