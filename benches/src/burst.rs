//! `burst`: many small messages in flight at once, as a service or a simulation's halo exchange
//! sends them, measured for each TCP backend and progress mode in one invocation.
//!
//! `--ranks` ranks (default 6) run in this process, each its own reactor thread with real TCP
//! connections on loopback (as separate processes would; [`ferrocomm::testing`]). Three patterns,
//! each with `--messages` 8 B messages per rank (default 2 500):
//! * `exchange`: every rank posts sends to every other rank, then receives all of them;
//! * `ring`: each rank sends to the next and receives from the previous, one message at a time;
//! * `storm`: every rank sends to rank 0, which receives with a wildcard.
//!
//! The configurations alternate within every run, so that the host's slow and fast phases hit all
//! of them alike; the report gives each one's median time over `--runs` with its spread (min-max),
//! and the ratio of adaptive to blocking progress for each backend.

use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm::{ProgressMode, Settings, Source, TcpBackend, TransportChoice, testing};

/// Bursts of 8 B messages among in-process ranks over TCP: each backend in adaptive and blocking
/// progress, alternated.
///
/// Three patterns: exchange (every rank to every other), ring, storm (every rank to rank 0, a
/// wildcard receive). Reports each configuration's median time over the runs with its spread,
/// and the ratio of adaptive to blocking progress for each backend.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Ranks in the job
    #[arg(long, value_name = "N", default_value_t = 6, value_parser = clap::value_parser!(u32).range(2..))]
    pub ranks: u32,
    /// 8 B messages each rank sends per pattern
    #[arg(long, value_name = "M", default_value_t = 2500)]
    pub messages: u32,
    /// Alternated runs of every configuration
    #[arg(long, value_name = "R", default_value_t = 5, value_parser = crate::cli::at_least_one)]
    pub runs: usize,
    /// Write every run's times as JSON
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,
}

const PATTERNS: [&str; 3] = ["exchange", "ring", "storm"];

struct Config {
    name: &'static str,
    backend: TcpBackend,
    progress: ProgressMode,
}

const CONFIGS: [Config; 4] = [
    Config {
        name: "portable adaptive",
        backend: TcpBackend::Portable,
        progress: ProgressMode::Adaptive(Duration::from_micros(50)),
    },
    Config { name: "portable blocking", backend: TcpBackend::Portable, progress: ProgressMode::Blocking },
    Config {
        name: "uring adaptive",
        backend: TcpBackend::Uring,
        progress: ProgressMode::Adaptive(Duration::from_micros(50)),
    },
    Config { name: "uring blocking", backend: TcpBackend::Uring, progress: ProgressMode::Blocking },
];

pub(crate) fn main(o: Options) -> crate::Result<()> {
    let Options { ranks, messages, runs, json } = o;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // times[pattern][config] = one time per run
    let mut times = vec![vec![Vec::new(); CONFIGS.len()]; PATTERNS.len()];
    let bar = crate::cli::Progress::new((runs * PATTERNS.len() * CONFIGS.len()) as u64, "burst");
    for run in 0..runs {
        for (p, pattern) in PATTERNS.iter().enumerate() {
            // Rotate the order of the configurations from run to run.
            for k in 0..CONFIGS.len() {
                let c = (k + run) % CONFIGS.len();
                bar.step(format!("run {}: {pattern}, {}", run + 1, CONFIGS[c].name));
                let t = rt.block_on(job(ranks, messages, pattern, &CONFIGS[c]))?;
                times[p][c].push(t.as_secs_f64());
                bar.inc();
            }
        }
        bar.note(format!("burst: run {}/{runs} done", run + 1));
    }
    drop(bar);
    println!("{ranks} ranks, {messages} messages of 8 B per rank, {runs} runs; median (min-max) in ms");
    println!(
        "{:<10} {:>26} {:>26} {:>26} {:>26} {:>16} {:>16}",
        "pattern", CONFIGS[0].name, CONFIGS[1].name, CONFIGS[2].name, CONFIGS[3].name, "portable a/b", "uring a/b"
    );
    let mut out = Vec::new();
    for (p, pattern) in PATTERNS.iter().enumerate() {
        let cell = |c: usize| {
            let (med, lo, hi) = spread(&times[p][c]);
            format!("{:.1} ({:.1}-{:.1})", med * 1e3, lo * 1e3, hi * 1e3)
        };
        let ratio = |a: usize, b: usize| spread(&times[p][a]).0 / spread(&times[p][b]).0;
        println!(
            "{:<10} {:>26} {:>26} {:>26} {:>26} {:>16.2} {:>16.2}",
            pattern,
            cell(0),
            cell(1),
            cell(2),
            cell(3),
            ratio(0, 1),
            ratio(2, 3)
        );
        let configs: Vec<_> = CONFIGS
            .iter()
            .enumerate()
            .map(|(c, cfg)| serde_json::json!({ "config": cfg.name, "seconds": times[p][c] }))
            .collect();
        out.push(serde_json::json!({
            "pattern": pattern,
            "configs": configs,
            "portable_adaptive_over_blocking": ratio(0, 1),
            "uring_adaptive_over_blocking": ratio(2, 3),
        }));
    }
    if let Some(path) = json {
        let doc = serde_json::json!({ "ranks": ranks, "messages": messages, "runs": runs, "patterns": out });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}

/// Median, min and max.
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    (s[s.len() / 2], s[0], s[s.len() - 1])
}

/// One job: every rank runs `pattern`; the slowest rank's time.
async fn job(ranks: u32, messages: u32, pattern: &str, cfg: &Config) -> crate::Result<Duration> {
    let settings =
        Settings::builder().transports(TransportChoice::Tcp).tcp_backend(cfg.backend).progress(cfg.progress).build();
    let pattern = pattern.to_string();
    let results = testing::run(ranks, settings, move |world| {
        let pattern = pattern.clone();
        async move {
            let (rank, size) = (world.rank(), world.size());
            let payload = Bytes::from(vec![rank as u8; 8]);
            world.barrier().await?;
            let t0 = Instant::now();
            match pattern.as_str() {
                "exchange" => {
                    let mut sends = Vec::new();
                    for i in 0..messages {
                        for p in (0..size).filter(|&p| p != rank) {
                            sends.push(world.send(p, u64::from(i), payload.clone()));
                        }
                    }
                    for i in 0..messages {
                        for p in (0..size).filter(|&p| p != rank) {
                            world.recv(p, u64::from(i)).await?;
                        }
                    }
                    for s in sends {
                        s.await?;
                    }
                }
                "ring" => {
                    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
                    for i in 0..messages {
                        let send = world.send(next, u64::from(i), payload.clone());
                        world.recv(prev, u64::from(i)).await?;
                        send.await?;
                    }
                }
                _ => {
                    if rank == 0 {
                        for _ in 0..messages * (size - 1) {
                            world.recv(Source::Any, 1u64).await?;
                        }
                    } else {
                        for _ in 0..messages {
                            world.send(0, 1, payload.clone()).await?;
                        }
                    }
                }
            }
            world.barrier().await?;
            let t = t0.elapsed();
            world.finalize().await?;
            Ok::<_, ferrocomm::Error>(t)
        }
    })
    .await?;
    let mut slowest = Duration::ZERO;
    for r in results {
        slowest = slowest.max(r?);
    }
    Ok(slowest)
}
