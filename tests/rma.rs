//! The one-sided suite with all ranks in this process: over shared memory (peers map each
//! other's segments) and over TCP on loopback, both backends (requests served by the target's
//! progress), in each progress mode.

mod rma_suite;

use std::time::Duration;

use ferrocomm::{ProgressMode, Settings, TcpBackend, TransportChoice, testing};

const ADAPTIVE: ProgressMode = ProgressMode::Adaptive(Duration::from_micros(50));

async fn run(n: u32, settings: Settings) {
    testing::run(n, settings, |w| async move {
        rma_suite::suite(&w).await;
        w.finalize().await.unwrap();
    })
    .await
    .unwrap();
}

fn tcp(backend: TcpBackend, progress: ProgressMode) -> Settings {
    Settings::builder().transports(TransportChoice::Tcp).tcp_backend(backend).progress(progress).build()
}

fn shm(progress: ProgressMode) -> Settings {
    Settings::builder().transports(TransportChoice::Auto).progress(progress).build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rma_shared_memory() {
    for n in [1, 2, 4] {
        run(n, shm(ADAPTIVE)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rma_tcp_uring() {
    for n in [2, 4] {
        run(n, tcp(TcpBackend::Uring, ADAPTIVE)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rma_tcp_portable() {
    for n in [1, 3] {
        run(n, tcp(TcpBackend::Portable, ADAPTIVE)).await;
    }
}

/// Blocking progress: only the background task serves the targets' requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rma_blocking_and_busy_modes() {
    run(3, tcp(TcpBackend::Uring, ProgressMode::Blocking)).await;
    run(3, shm(ProgressMode::Blocking)).await;
    run(2, tcp(TcpBackend::Portable, ProgressMode::BusyPoll)).await;
}
