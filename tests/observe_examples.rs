//! The web service and observability examples (examples/web_service.rs, examples/observability.rs)
//! run as separate processes under `ferrorun`, with the test talking HTTP to the ranks while they
//! run:
//! * the web service answers `/health` while its background all-reduces run; once a rank is
//!   killed, the others answer `503 degraded` naming the lost rank, do not crash, log the loss on
//!   stderr without having installed a subscriber, and leave when told;
//! * the observability example's Prometheus endpoint, scraped at every rank, has peer-labelled
//!   counters that match the traffic the example sent (exactly for the rendezvous message, and
//!   for every peer equal to `World::stats`), described counters, per-collective calls and
//!   latencies; its `tracing` log shows a span per collective call.
//!
//! The ranks are this test binary, re-run by `ferrorun` (`tests/common`'s `Job`) with
//! `--exact observe_rank` and `FERROCOMM_OBSERVE_RUN` naming the example; the examples' code is
//! compiled into it.

mod common;
#[allow(dead_code)]
#[path = "../examples/observability.rs"]
mod observability;
#[allow(dead_code)]
#[path = "../examples/web_service.rs"]
mod web_service;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");
const SCENARIO: &str = "FERROCOMM_OBSERVE_RUN";
/// How long a condition may take before the test gives up (a bound against hangs, not a
/// measurement).
const PATIENCE: Duration = Duration::from_secs(120);

fn job() -> common::Job<'static> {
    // Survivors of a killed rank keep serving: the launcher must not kill them meanwhile.
    common::Job { ferrorun: FERRORUN, rank_test: "observe_rank", scenario_var: SCENARIO, grace_s: 600 }
}

/// A running job: its output as it comes, and the launcher, killed (with its ranks) if the test
/// ends before it does.
struct Running {
    child: Child,
    output: Arc<Mutex<String>>,
}

impl Running {
    fn start(n: u32, example: &str, transport: &str, env: &[&str]) -> Running {
        let mut child = job().spawn(n, example, transport, env);
        let output = Arc::new(Mutex::new(String::new()));
        let pipes: [Box<dyn Read + Send>; 2] =
            [Box::new(child.stdout.take().unwrap()), Box::new(child.stderr.take().unwrap())];
        for pipe in pipes {
            let output = output.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let mut o = output.lock().unwrap();
                    o.push_str(&line);
                    o.push('\n');
                }
            });
        }
        Running { child, output }
    }

    fn text(&self) -> String {
        self.output.lock().unwrap().clone()
    }

    /// Waits until `done` holds of the output so far; returns what it gave.
    fn wait_for<T>(&self, what: &str, mut done: impl FnMut(&str) -> Option<T>) -> T {
        let t0 = Instant::now();
        loop {
            if let Some(v) = done(&self.text()) {
                return v;
            }
            assert!(t0.elapsed() < PATIENCE, "no {what} after {PATIENCE:?}:\n{}", self.text());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits for the launcher to exit; returns its exit code and the whole output.
    fn finish(mut self) -> (Option<i32>, String) {
        let t0 = Instant::now();
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s;
            }
            assert!(t0.elapsed() < PATIENCE, "the job did not end:\n{}", self.text());
            std::thread::sleep(Duration::from_millis(50));
        };
        // The output threads end with the pipes; give them their last lines.
        std::thread::sleep(Duration::from_millis(200));
        (status.code(), self.text())
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        // The ranks die with the launcher (PR_SET_PDEATHSIG).
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The value after `label ` in `line`, up to the next space.
fn field<'a>(line: &'a str, label: &str) -> &'a str {
    let rest = line.split(label).nth(1).unwrap_or_else(|| panic!("no {label:?} in {line}"));
    rest.split_whitespace().next().unwrap_or_default()
}

/// Per rank: the field after `label` in the line `rank R <marker> ...` of every rank, once all
/// `n` have printed theirs.
fn per_rank(text: &str, n: u32, marker: &str, label: &str) -> Option<Vec<String>> {
    (0..n)
        .map(|r| {
            let prefix = format!("rank {r} {marker}");
            text.lines()
                .find_map(|l| l.split_once(&prefix).map(|(_, rest)| field(&format!(" {rest}"), label).to_string()))
        })
        .collect()
}

/// One HTTP/1.1 request; the status and the body.
fn http(addr: &str, method: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connect {addr}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).unwrap();
    let status = response.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

#[test]
fn web_service_answers_while_collectives_run_and_degrades_when_a_peer_is_lost() {
    let job = Running::start(3, "web_service", "shm", &[]);
    let addrs = job.wait_for("addresses", |t| per_rank(t, 3, "serving", "http://"));
    let pids = job.wait_for("pids", |t| per_rank(t, 3, "serving", "pid"));
    // Healthy: the background all-reduces go on (every rank adds rank + 1: 1 + 2 + 3).
    for addr in &addrs {
        job.wait_for("rounds", |_| {
            let (status, body) = http(addr, "GET", "/health");
            assert_eq!(status, 200, "{body}");
            assert!(body.starts_with("ok rounds="), "{body}");
            let rounds: u64 = field(&body, "rounds=").parse().unwrap();
            (rounds >= 3).then(|| assert_eq!(field(&body, "sum="), "6", "{body}"))
        });
    }
    // Rank 2 dies.
    let pid: i32 = pids[2].parse().unwrap();
    // SAFETY: a plain signal to a process of this job.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    for addr in &addrs[..2] {
        let body = job.wait_for("degraded health", |_| {
            let (status, body) = http(addr, "GET", "/health");
            (status == 503).then_some(body)
        });
        assert!(body.starts_with("degraded: rank 2 is lost"), "{body}");
        let (status, stats) = http(addr, "GET", "/stats");
        assert_eq!(status, 200);
        assert!(stats.lines().any(|l| l.starts_with("peer 2 ") && l.contains("Lost(")), "{stats}");
        let peer_1_or_0 = stats.lines().find(|l| l.starts_with("peer 1 ") || l.starts_with("peer 0 ")).unwrap();
        assert!(peer_1_or_0.contains("Alive"), "{stats}");
    }
    // Still serving, and still degraded: a failure is a state, not a crash.
    assert_eq!(http(&addrs[0], "GET", "/health").0, 503);
    // The library's own log, with no subscriber installed by the program: the loss, on stderr.
    job.wait_for("a logged warning", |t| {
        t.lines().any(|l| l.starts_with("[0] ") && l.contains("WARN") && l.contains("ferrocomm")).then_some(())
    });
    for addr in &addrs[..2] {
        assert_eq!(http(addr, "POST", "/quit"), (200, "bye\n".to_string()));
    }
    let (code, text) = job.finish();
    println!("{text}");
    assert!(text.contains("rank 0 leaves") && text.contains("rank 1 leaves"), "{text}");
    assert!(!text.contains("panicked"), "{text}");
    assert_ne!(code, Some(0), "a rank was killed: the job failed\n{text}");
}

/// Prometheus text: `name{labels} value` by `name{labels}`, and the `# HELP`/`# TYPE` lines.
fn parse_prometheus(text: &str) -> (HashMap<String, f64>, Vec<String>) {
    let mut values = HashMap::new();
    let mut meta = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') {
            meta.push(line.to_string());
        } else if let Some((key, value)) = line.rsplit_once(' ') {
            values.insert(key.to_string(), value.parse().unwrap_or(f64::NAN));
        }
    }
    (values, meta)
}

/// The sum of the series of `name` whose labels include every one of `labels` (`k="v"`).
fn sum(values: &HashMap<String, f64>, name: &str, labels: &[&str]) -> f64 {
    values
        .iter()
        .filter(|(k, _)| {
            k.split_once('{').is_some_and(|(n, l)| n == name && labels.iter().all(|want| l.contains(want)))
        })
        .map(|(_, v)| v)
        .sum()
}

#[test]
fn prometheus_endpoint_has_peer_labelled_counters_that_match_the_traffic() {
    use observability::{LARGE, MESSAGES, ROUNDS, SMALL};
    let n = 3;
    let job = Running::start(n, "observability", "shm", &["RUST_LOG=info,ferrocomm::collective=debug"]);
    let addrs = job.wait_for("metrics addresses", |t| per_rank(t, n, "metrics at", "http://"));
    job.wait_for("every rank ready", |t| (0..n).all(|r| t.contains(&format!("rank {r} ready"))).then_some(()));
    let text = job.text();
    for r in 0..n {
        let addr = addrs[r as usize].trim_end_matches("/metrics");
        let (status, body) = http(addr, "GET", "/metrics");
        assert_eq!(status, 200);
        let (values, meta) = parse_prometheus(&body);
        let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
        let peer = |p: u32| format!("peer=\"{p}\"");
        let ctx = || format!("rank {r}:\n{body}");
        // The one rendezvous message each way, exactly.
        let rndv = "protocol=\"rendezvous\"";
        assert_eq!(sum(&values, "ferrocomm_messages_sent", &[&peer(next), rndv]), 1.0, "{}", ctx());
        assert_eq!(sum(&values, "ferrocomm_bytes_sent", &[&peer(next), rndv]), LARGE as f64, "{}", ctx());
        assert_eq!(sum(&values, "ferrocomm_messages_received", &[&peer(prev), rndv]), 1.0, "{}", ctx());
        assert_eq!(sum(&values, "ferrocomm_bytes_received", &[&peer(prev), rndv]), LARGE as f64, "{}", ctx());
        // The eager messages, among the collectives' own.
        let eager = "protocol=\"eager\"";
        assert!(sum(&values, "ferrocomm_messages_sent", &[&peer(next), eager]) >= MESSAGES as f64, "{}", ctx());
        assert!(sum(&values, "ferrocomm_bytes_sent", &[&peer(next), eager]) >= (MESSAGES as usize * SMALL) as f64);
        assert!(sum(&values, "ferrocomm_messages_received", &[&peer(prev), eager]) >= MESSAGES as f64);
        // Every peer's counters equal World::stats, printed by the rank once its traffic ended.
        for p in 0..n {
            let line = text
                .lines()
                .find(|l| l.contains(&format!("rank {r} peer {p} sent")))
                .unwrap_or_else(|| panic!("no stats of rank {r} peer {p}:\n{text}"));
            let pair = |label: &str| -> (f64, f64) {
                let (m, b) = field(line, label).split_once('/').unwrap();
                (m.parse().unwrap(), b.parse().unwrap())
            };
            let counters = |dir: &str| {
                (
                    sum(&values, &format!("ferrocomm_messages_{dir}"), &[&peer(p)]),
                    sum(&values, &format!("ferrocomm_bytes_{dir}"), &[&peer(p)]),
                )
            };
            assert_eq!(counters("sent"), pair("sent"), "{line}\n{}", ctx());
            assert_eq!(counters("received"), pair("received"), "{line}\n{}", ctx());
        }
        // Collectives: every call counted and timed, by operation and algorithm.
        let allreduce = "operation=\"allreduce\"";
        assert_eq!(sum(&values, "ferrocomm_collective_calls", &[allreduce]), ROUNDS as f64, "{}", ctx());
        assert_eq!(sum(&values, "ferrocomm_collective_seconds_count", &[allreduce]), ROUNDS as f64, "{}", ctx());
        assert_eq!(sum(&values, "ferrocomm_collective_bytes", &[allreduce]), (ROUNDS * 8) as f64, "{}", ctx());
        assert_eq!(sum(&values, "ferrocomm_collective_calls", &["operation=\"barrier\""]), 1.0, "{}", ctx());
        assert!(
            values.keys().any(|k| k.starts_with("ferrocomm_collective_calls{") && k.contains("algorithm=\"")),
            "{}",
            ctx()
        );
        // Described, with their types.
        for name in ["ferrocomm_messages_sent", "ferrocomm_bytes_received", "ferrocomm_collective_calls"] {
            assert!(meta.iter().any(|m| m.starts_with(&format!("# HELP {name} "))), "{name}: {}", ctx());
            assert!(meta.contains(&format!("# TYPE {name} counter")), "{name}: {}", ctx());
        }
    }
    // The env filter let the collective spans through: one closes per call.
    let spans = text.lines().filter(|l| l.contains("collective{operation=allreduce") && l.contains("close")).count();
    assert!(spans >= (ROUNDS * u64::from(n)) as usize, "{spans} allreduce spans:\n{text}");
    assert!(text.lines().any(|l| l.contains("sequence=") && l.contains("algorithm=")), "{text}");
    assert!(text.contains("point-to-point traffic done"), "the info events pass the filter:\n{text}");
    for addr in &addrs {
        assert_eq!(http(addr.trim_end_matches("/metrics"), "POST", "/quit").0, 200);
    }
    let (code, text) = job.finish();
    println!("{text}");
    assert_eq!(code, Some(0), "{text}");
}

/// `World::stats` in-process: messages and bytes each way by peer, rendezvous apart, self
/// traffic on the own entry, the transport, and a peer that said goodbye shown departed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_stats_count_each_peers_traffic_and_state() {
    use ferrocomm::{PeerState, Settings};
    let mut worlds = ferrocomm::testing::cluster(3, Settings::default()).await.unwrap();
    let large = worlds[0].settings().eager_limit + 1;
    let (w0, w1) = (&worlds[0], &worlds[1]);
    let recvs: Vec<_> = (0..3u64).map(|t| w1.recv(0, t)).collect();
    w0.send(1, 0, vec![1u8; 10]).await.unwrap();
    w0.send(1, 1, vec![2u8; 10]).await.unwrap();
    w0.send(1, 2, vec![3u8; large]).await.unwrap();
    for r in recvs {
        r.await.unwrap();
    }
    w0.send(0, 9, vec![4u8; 5]).await.unwrap();
    w0.recv(0, 9u64).await.unwrap();
    let s0 = w0.stats();
    assert_eq!(s0.len(), 3);
    let p1 = &s0[1];
    assert_eq!((p1.rank, p1.state.clone()), (1, PeerState::Alive));
    assert_eq!((p1.messages_sent, p1.bytes_sent, p1.rendezvous_sent), (3, 20 + large as u64, 1));
    assert_eq!((p1.messages_received, p1.bytes_received), (0, 0));
    assert_eq!(p1.transport, w0.transport_for(1));
    let own = &s0[0];
    assert_eq!((own.transport, own.messages_sent, own.messages_received, own.bytes_received), ("self", 1, 1, 5));
    assert_eq!((s0[2].messages_sent, s0[2].messages_received), (0, 0));
    let from0 = &w1.stats()[0];
    assert_eq!((from0.messages_received, from0.bytes_received, from0.rendezvous_received), (3, 20 + large as u64, 1));
    // Rank 2 leaves in order: the others see it departed.
    worlds.pop().unwrap().finalize().await.unwrap();
    let t0 = Instant::now();
    while worlds[0].stats()[2].state != PeerState::Departed {
        assert!(t0.elapsed() < PATIENCE, "{:?}", worlds[0].stats()[2]);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// One rank of an example, when run by `ferrorun`.
#[test]
fn observe_rank() {
    let Some(example) = std::env::var_os(SCENARIO) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    match example.to_str() {
        Some("web_service") => rt.block_on(async {
            let world = ferrocomm::init().await.unwrap();
            web_service::run(world).await.unwrap();
        }),
        Some("observability") => {
            observability::install_log();
            let metrics = observability::install_metrics();
            rt.block_on(async {
                let world = ferrocomm::init().await.unwrap();
                observability::run(world, metrics).await.unwrap();
            })
        }
        other => panic!("no example {other:?}"),
    }
}
