//! A tokio web service (axum) whose ranks answer HTTP while a background task runs collectives,
//! and which reports itself degraded, without crashing, when a peer is lost.
//!
//! Every rank serves, on an address of its own (printed at start):
//! * `GET /health`: `200 ok rounds=N sum=S` while the background all-reduces succeed;
//!   `503 degraded: ERROR` once one failed (a peer lost: the error names it);
//! * `GET /stats`: this rank's traffic with each peer ([`ferrocomm::World::stats`]);
//! * `POST /quit`: the rank stops serving and leaves the job.
//!
//! The background task is the shape of a service that keeps a job-wide aggregate up to date: an
//! all-reduce every few milliseconds, its result published to the handlers through a lock that
//! is never held across an await. When a collective fails, the task records why and stops; the
//! HTTP side keeps answering, and the failure is a status, not a panic.
//!
//! The program installs no `tracing` subscriber: under `ferrorun` the library logs its warnings
//! (the peer lost) to stderr by itself.
//!
//! ```text
//! cargo build --example web_service
//! ferrorun -n 3 --grace 600 target/debug/examples/web_service
//! curl http://127.0.0.1:PORT/health      # PORT: printed by each rank
//! ```

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::{get, post};
use ferrocomm::{Deadline, ReduceOp, World};
use parking_lot::Mutex;
use tokio::sync::Notify;

/// What the handlers report: the background task's progress, or why it stopped.
#[derive(Default)]
struct Health {
    rounds: u64,
    sum: u64,
    degraded: Option<String>,
}

#[derive(Clone)]
struct App {
    world: World,
    health: Arc<Mutex<Health>>,
    quit: Arc<Notify>,
}

async fn health(State(app): State<App>) -> (StatusCode, String) {
    let h = app.health.lock();
    match &h.degraded {
        None => (StatusCode::OK, format!("ok rounds={} sum={}\n", h.rounds, h.sum)),
        Some(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("degraded: {why}\n")),
    }
}

async fn stats(State(app): State<App>) -> String {
    app.world
        .stats()
        .iter()
        .map(|p| {
            format!(
                "peer {} {} {:?}: sent {} messages {} bytes, received {} messages {} bytes\n",
                p.rank, p.transport, p.state, p.messages_sent, p.bytes_sent, p.messages_received, p.bytes_received
            )
        })
        .collect()
}

async fn quit(State(app): State<App>) -> &'static str {
    app.quit.notify_one();
    "bye\n"
}

/// Every rank contributes `rank + 1`, so every round's sum is `n (n + 1) / 2`.
async fn aggregate(world: World, health: Arc<Mutex<Health>>) {
    loop {
        let mut v = [u64::from(world.rank()) + 1];
        match world.allreduce(&mut v, ReduceOp::Sum).timeout(Duration::from_secs(30)).await {
            Ok(()) => {
                let mut h = health.lock();
                h.rounds += 1;
                h.sum = v[0];
            }
            Err(e) => {
                health.lock().degraded = Some(e.to_string());
                return;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Serves until `POST /quit`. Prints `rank R serving http://ADDR pid PID` once listening.
pub(crate) async fn run(world: World) -> std::io::Result<()> {
    let health = Arc::new(Mutex::new(Health::default()));
    let quit_signal = Arc::new(Notify::new());
    let app = App { world: world.clone(), health: health.clone(), quit: quit_signal.clone() };
    let router = Router::new()
        .route("/health", get(self::health))
        .route("/stats", get(self::stats))
        .route("/quit", post(self::quit))
        .with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("rank {} serving http://{} pid {}", world.rank(), listener.local_addr()?, std::process::id());
    let background = tokio::spawn(aggregate(world.clone(), health));
    axum::serve(listener, router).with_graceful_shutdown(async move { quit_signal.notified().await }).await?;
    background.abort();
    println!("rank {} leaves", world.rank());
    Ok(())
}

#[allow(dead_code)]
#[tokio::main]
async fn main() {
    let world = match ferrocomm::init().await {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = run(world).await {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
