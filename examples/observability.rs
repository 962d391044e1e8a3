//! Observability of a ferrocomm program: logs and spans through `tracing-subscriber` with an env
//! filter, metrics through `metrics-exporter-prometheus`, served over HTTP for Prometheus to
//! scrape, and the per-peer snapshot of [`ferrocomm::World::stats`].
//!
//! Each rank installs its log and its recorder *before* `ferrocomm::init` (the world registers
//! its metrics with the recorder in force when it is made, and leaves a subscriber already
//! installed alone), serves `GET /metrics` (Prometheus text format) and `POST /quit`, then
//! runs some traffic: to the next rank, `MESSAGES` eager messages of `SMALL` bytes and one
//! rendezvous message of `LARGE` bytes; `ROUNDS` all-reduces and a barrier. It prints its
//! stats per peer (`rank R peer P sent M/B received M/B`) and `rank R ready`, and then only
//! serves until `POST /quit`.
//!
//! ```text
//! cargo build --example observability
//! RUST_LOG=info,ferrocomm::collective=debug ferrorun -n 2 target/debug/examples/observability
//! curl http://127.0.0.1:PORT/metrics     # PORT: printed by each rank
//! ```
//!
//! With `ferrocomm::collective=debug`, every collective call is a span (`operation`,
//! `algorithm`, `bytes`, `sequence`, `context`), logged here when it closes, with its time.

use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::routing::{get, post};
use bytes::Bytes;
use ferrocomm::{ReduceOp, World};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::sync::Notify;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::FmtSpan;

/// Eager messages each rank sends to the next one.
pub(crate) const MESSAGES: u64 = 20;
/// Their size.
pub(crate) const SMALL: usize = 100;
/// The one rendezvous message's size (above the default 64 KiB eager limit).
pub(crate) const LARGE: usize = 200_000;
/// All-reduces each rank calls.
pub(crate) const ROUNDS: u64 = 5;

/// The log: `RUST_LOG`'s filter (default `info`), to stderr, spans logged when they close.
pub(crate) fn install_log() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(FmtSpan::CLOSE)
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
}

/// The Prometheus recorder, installed as the process's recorder; the handle renders its text.
pub(crate) fn install_metrics() -> PrometheusHandle {
    PrometheusBuilder::new().install_recorder().expect("no other recorder")
}

/// Any error of the example.
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Runs the traffic, then serves the metrics until `POST /quit`.
pub(crate) async fn run(world: World, metrics: PrometheusHandle) -> Result<(), BoxError> {
    let (r, n) = (world.rank(), world.size());
    // The recorder's upkeep (draining histogram samples), which this program schedules itself.
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(std::time::Duration::from_secs(5)).await;
            upkeep.run_upkeep();
        }
    });
    let quit = Arc::new(Notify::new());
    let router = Router::new()
        .route("/metrics", get(|State(h): State<PrometheusHandle>| async move { h.render() }))
        .route(
            "/quit",
            post({
                let quit = quit.clone();
                move || async move {
                    quit.notify_one();
                    "bye\n"
                }
            }),
        )
        .with_state(metrics);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    println!("rank {r} metrics at http://{addr}/metrics");
    let server = tokio::spawn(async move {
        axum::serve(listener, router).with_graceful_shutdown(async move { quit.notified().await }).await
    });

    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let incoming: Vec<_> = (0..=MESSAGES).map(|i| world.recv(prev, i)).collect();
    for i in 0..MESSAGES {
        world.send(next, i, Bytes::from(vec![r as u8; SMALL])).await?;
    }
    world.send(next, MESSAGES, Bytes::from(vec![r as u8; LARGE])).await?;
    for m in futures::future::join_all(incoming).await {
        m?;
    }
    tracing::info!(rank = r, "point-to-point traffic done");
    for _ in 0..ROUNDS {
        let mut v = [1u64];
        world.allreduce(&mut v, ReduceOp::Sum).await?;
        assert_eq!(v[0], u64::from(n));
    }
    world.barrier().await?;
    for p in world.stats() {
        println!(
            "rank {r} peer {} sent {}/{} received {}/{}",
            p.rank, p.messages_sent, p.bytes_sent, p.messages_received, p.bytes_received
        );
    }
    println!("rank {r} ready");
    server.await??;
    println!("rank {r} leaves");
    Ok(())
}

#[allow(dead_code)]
#[tokio::main]
async fn main() {
    install_log();
    let metrics = install_metrics();
    let res: Result<(), BoxError> = async { run(ferrocomm::init().await?, metrics).await }.await;
    if let Err(e) = res {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
