//! The point-to-point suite with all ranks in this process, over real TCP on loopback (both
//! backends) and over shared memory, in each progress mode.

mod common;

use std::time::Duration;

use ferrocomm::{ProgressMode, Settings, TcpBackend, TransportChoice, testing};

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
    Settings { transports: TransportChoice::Tcp, tcp_backend: backend, progress, ..Settings::default() }
}

fn shm(progress: ProgressMode) -> Settings {
    Settings { transports: TransportChoice::Auto, progress, ..Settings::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_tcp_portable() {
    for n in [1, 2, 4] {
        run_suite(n, tcp(TcpBackend::Portable, ADAPTIVE), "tcp-portable").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_tcp_uring() {
    for n in [1, 2, 4] {
        run_suite(n, tcp(TcpBackend::Uring, ADAPTIVE), "tcp-uring").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_shared_memory() {
    for n in [1, 2, 4] {
        run_suite(n, shm(ADAPTIVE), "shm").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn suite_blocking_and_busy_modes() {
    run_suite(3, tcp(TcpBackend::Uring, ProgressMode::Blocking), "tcp-uring").await;
    run_suite(3, tcp(TcpBackend::Portable, ProgressMode::BusyPoll), "tcp-portable").await;
    run_suite(3, shm(ProgressMode::Blocking), "shm").await;
    run_suite(3, shm(ProgressMode::BusyPoll), "shm").await;
}

/// More ranks than cores, every one busy-polling: must not livelock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversubscribed_busy_poll() {
    for settings in [tcp(TcpBackend::Auto, ProgressMode::BusyPoll), shm(ProgressMode::BusyPoll)] {
        testing::run(8, settings, |w| async move {
            common::ring_storm_rendezvous(&w).await;
        })
        .await
        .unwrap();
    }
}
