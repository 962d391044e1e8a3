//! The fault matrix: a rank killed with SIGKILL at a random point of every kind of operation,
//! over shared memory and over TCP, and a host cut off the network.
//!
//! * **kill matrix**: 4 ranks under `ferrorun` loop one operation kind (point-to-point eager and
//!   rendezvous, barrier, broadcast, all-reduce, all-gather, all-to-all, reduce, scan, a reliable
//!   multicast window, the shared-memory board's barrier and all-reduce, the node-leader
//!   all-reduce across pretend hosts) or start the job (the bootstrap). One rank, chosen by a
//!   seeded generator, runs a thread that kills its own process with SIGKILL after a random delay,
//!   so the kill lands anywhere in the loop. Every other rank must fail with
//!   [`Error::PeerLost`] naming the killed rank, whether or not it talks to it; the launcher must
//!   name it and exit with 137; no process of the job may be left running, and no file of the job
//!   in /dev/shm. The slowest survivor's failure, counted from the kill, must come within the
//!   bound: the peer timeout (2 s here) plus [`SLACK`].
//! * **link cut**: 6 ranks on 3 hosts (network namespaces on a bridge, 2 ranks each, shared memory
//!   within a host and TCP between hosts) loop a node-leader all-reduce; one host's link is set
//!   down. Every rank must fail within the bound: the cut host's ranks naming a rank of another
//!   host, the others naming a rank of the cut host; once with data in flight, once with every
//!   link idle. Needs root (without it the test says so loudly and passes).
//! * **after the failure**: every survivor's later world operations fail at once naming the
//!   killed rank, and a communicator of the survivors made before the kill still works.
//! * **departures**: a rank that finalizes early is no loss (a receive naming it fails with
//!   `Left`; the collectives it finished before leaving complete on the others, even when called
//!   after its goodbye; nothing else is touched), and a clean job logs no warning; a rank whose
//!   program panics is a loss to the others at once.
//!
//! The seed is printed with each case; `FERROCOMM_FAULT_SEED=n` replays a run,
//! `FERROCOMM_FAULT_ONLY=allreduce,scan` runs only those kinds. The ranks are this
//! test binary, re-run with `--exact fault_rank` and the case in `FERROCOMM_FAULT_*` variables;
//! without them `fault_rank` does nothing.

#[path = "common/netns.rs"]
mod netns;
use netns::{is_root, sh};
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use ferrocomm::{Deadline, Error, ReduceOp, World};

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");
/// The peer timeout every rank runs with.
const PEER_TIMEOUT: Duration = Duration::from_secs(2);
/// What the bound allows beyond the peer timeout: the keep-alive probe's granularity (1 s at
/// this timeout) and scheduling on a loaded machine.
const SLACK: Duration = Duration::from_secs(2);
/// A survivor that has not failed this long after starting its loop reports a hang.
const HANG: Duration = Duration::from_secs(40);

/// Operation kinds of the matrix: name, ranks, extra environment.
const KINDS: &[(&str, u32, &[&str])] = &[
    ("eager", 4, &[]),
    ("rendezvous", 4, &[]),
    ("barrier", 4, &[]),
    ("bcast", 4, &[]),
    ("allreduce", 4, &[]),
    ("allreduce-large", 4, &[]),
    ("allgather", 4, &[]),
    ("alltoall", 4, &[]),
    ("reduce", 4, &[]),
    ("scan", 4, &[]),
    ("multicast", 4, &["FERROCOMM_MCAST_CONFIRM_MS=500"]),
    ("bootstrap", 4, &[]),
];

/// Cases only shared memory has: the board (pinned), and the node-leader algorithms (pretend
/// hosts of 2 ranks: shared memory inside, TCP between).
const SHM_KINDS: &[(&str, u32, &[&str])] = &[
    ("board-barrier", 4, &["FERROCOMM_COLL=barrier=shared-memory"]),
    ("board-allreduce", 4, &["FERROCOMM_COLL=allreduce=shared-memory"]),
    ("hierarchical", 6, &[]),
];

fn now_ns() -> u128 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos()
}

/// xorshift64*: the matrix's choices, reproducible from the printed seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

fn base_seed() -> u64 {
    match std::env::var("FERROCOMM_FAULT_SEED") {
        Ok(s) => s.parse().expect("FERROCOMM_FAULT_SEED is a number"),
        Err(_) => (now_ns() as u64) | 1,
    }
}

/// What one rank printed: `FAULT-<WHAT> key=value ...`.
#[derive(Debug, Default)]
struct Said {
    fail: Option<(u128, Option<u32>, String)>,
    kill: Option<u128>,
    job: Option<String>,
}

fn parse(text: &str) -> HashMap<u32, Said> {
    let mut out: HashMap<u32, Said> = HashMap::new();
    for line in text.lines() {
        let Some(rest) = line.split("FAULT-").nth(1) else { continue };
        let field =
            |k: &str| rest.split_whitespace().find_map(|w| w.strip_prefix(&format!("{k}="))).map(str::to_string);
        let Some(rank) = field("rank").and_then(|r| r.parse().ok()) else { continue };
        let said = out.entry(rank).or_default();
        let at = || field("at").and_then(|a| a.parse().ok()).unwrap();
        if rest.starts_with("FAIL") {
            let lost = field("lost").and_then(|l| l.parse().ok());
            let err = rest.split_once("err=").map_or(String::new(), |(_, e)| e.to_string());
            said.fail = Some((at(), lost, err));
        } else if rest.starts_with("KILL") {
            said.kill = Some(at());
        } else if rest.starts_with("JOB") {
            said.job = field("job");
        }
    }
    out
}

/// Processes whose environment holds `marker` (the job's ranks).
fn running_with(marker: &str) -> Vec<u32> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
        if let Ok(env) = std::fs::read(entry.path().join("environ"))
            && env.split(|&b| b == 0).any(|v| v == marker.as_bytes())
        {
            found.push(pid);
        }
    }
    found
}

/// Files of job `job` in /dev/shm.
fn shm_files(job: &str) -> Vec<String> {
    let prefix = format!("ferrocomm-{job}-");
    std::fs::read_dir("/dev/shm")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// Who starts the ranks of a kill case.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Launch {
    /// `ferrorun`, which hosts the store and reports the rank whose process ends.
    Ferrorun,
    /// The test, with `FERROCOMM_*` variables as a user would set them (as under `mpirun` or
    /// `srun`): rank 0 hosts the store, and no launcher reports anything.
    ByHand,
}

/// Runs the `n` ranks of a case with `vars` (`KEY=VALUE`) and checks how they ended (the killed
/// rank by SIGKILL, and the launcher's report of it or the survivors' own exits); returns what
/// they printed.
///
/// By hand, in the bootstrap, this test kills the victim itself, once every rank's address is in
/// the store (each rank makes its watch there first): the store can report only a rank that
/// reached it, and only to ranks that reached it (a rank killed before that is a launcher's
/// business: `mpirun` and `srun --kill-on-bad-exit` end the job).
fn start(launch: Launch, n: u32, victim: u32, vars: &[&str], what: &str, bootstrap_kill: Option<Duration>) -> String {
    let exe = std::env::current_exe().unwrap();
    let rank_args = ["--exact", "fault_rank", "--nocapture", "--test-threads=1"];
    if launch == Launch::Ferrorun {
        let mut cmd = Command::new(FERRORUN);
        cmd.args(["-n", &n.to_string(), "--grace", "20"]);
        for v in vars {
            cmd.args(["--env", v]);
        }
        let out = cmd.arg(exe).args(rank_args).stdin(Stdio::null()).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(137), "{what}: the launcher exits with the killed rank's status\n{text}");
        assert!(
            text.contains(&format!("ferrorun: rank {victim} exited with signal 9 (SIGKILL)")),
            "{what}: the launcher names the killed rank\n{text}"
        );
        return text;
    }
    // Below Linux's ephemeral range, so that no connection of another case takes it meanwhile;
    // cases started in the same microsecond (the matrix starts them on threads at once) differ
    // by their turn.
    static TURN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let turn = TURN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let port = 20_000 + ((now_ns() / 1000 + u128::from(turn) * 997) % 12_000) as u16;
    let token: String = (0..32).map(|i| format!("{:02x}", (now_ns() as u8).wrapping_add(i * 7))).collect();
    let (tx, rx) = mpsc::channel::<(u32, String)>();
    let mut children = Vec::new();
    for r in 0..n {
        let mut c = Command::new(&exe);
        if r == victim && bootstrap_kill.is_some() {
            c.env("FERROCOMM_FAULT_KILLED_BY_TEST", "1");
        }
        c.args(rank_args)
            .env("FERROCOMM_RANK", r.to_string())
            .env("FERROCOMM_SIZE", n.to_string())
            .env("FERROCOMM_COORD", format!("127.0.0.1:{port}"))
            .env("FERROCOMM_TOKEN", &token)
            .env_remove("FERROCOMM_LAUNCHER")
            .env_remove("FERROCOMM_HOST_STORE");
        for v in vars {
            let (k, v) = v.split_once('=').unwrap();
            c.env(k, v);
        }
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let _ = tx.send((r, line));
                }
            });
        }
        children.push(child);
    }
    if let Some(delay) = bootstrap_kill {
        let token_bytes: Vec<u8> = (0..32).map(|i| u8::from_str_radix(&token[2 * i..2 * i + 2], 16).unwrap()).collect();
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let put = rt.block_on(async {
            let t = Duration::from_secs(30);
            let coord = format!("127.0.0.1:{port}");
            let mut kv =
                ferrocomm::bootstrap::kv::KvClient::connect(&coord, &token_bytes.try_into().unwrap(), t).await?;
            for r in 0..n {
                kv.get(&format!("addr/{r}"), t).await?;
            }
            Ok::<_, ferrocomm::bootstrap::kv::KvError>(())
        });
        assert!(put.is_ok(), "{what}: the ranks' addresses never came: {put:?}");
        std::thread::sleep(delay);
        let _ = tx.send((victim, format!("FAULT-KILL rank={victim} at={}", now_ns())));
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(children[victim as usize].id() as i32, libc::SIGKILL) };
    }
    drop(tx);
    // No launcher stops the survivors: each must end on its own (the hang limit is theirs).
    let deadline = Instant::now() + HANG + Duration::from_secs(30);
    let mut statuses = Vec::new();
    for c in children.iter_mut() {
        let status = loop {
            if let Some(status) = c.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                let _ = c.kill();
                let _ = c.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        statuses.push(status);
    }
    let text: String = rx.iter().map(|(r, line)| format!("[{r}] {line}\n")).collect();
    use std::os::unix::process::ExitStatusExt;
    for (r, status) in statuses.iter().enumerate() {
        let status = status.unwrap_or_else(|| panic!("{what}: rank {r} still ran at the deadline\n{text}"));
        if r as u32 == victim {
            assert_eq!(status.signal(), Some(libc::SIGKILL), "{what}: the victim was killed\n{text}");
        } else {
            assert!(status.success(), "{what}: rank {r} ended with {status}\n{text}");
        }
    }
    text
}

/// One case of the kill matrix; returns the slowest survivor's time from the kill to its failure.
fn kill_case(launch: Launch, kind: &str, n: u32, transport: &str, env: &[&str], seed: u64) -> Duration {
    let mut rng = Rng(seed);
    let victim = (rng.next() % u64::from(n)) as u32;
    let delay_us = if kind == "bootstrap" { rng.next() % 80_000 } else { 20_000 + rng.next() % 250_000 };
    let what = format!("{transport} {kind} ({launch:?}): seed {seed}, rank {victim} killed after {delay_us} us");
    let marker = format!("FERROCOMM_FAULT_RUN={}-{transport}-{kind}-{seed}-{launch:?}", std::process::id());
    let transports = match transport {
        "tcp" | "verbs" => transport,
        _ => "auto",
    };
    let vars = [
        format!("FERROCOMM_FAULT_KIND={kind}"),
        format!("FERROCOMM_FAULT_VICTIM={victim}"),
        format!("FERROCOMM_FAULT_DELAY_US={delay_us}"),
        format!("FERROCOMM_TRANSPORTS={transports}"),
        format!("FERROCOMM_PEER_TIMEOUT_MS={}", PEER_TIMEOUT.as_millis()),
        marker.clone(),
    ];
    let vars: Vec<&str> = vars.iter().map(String::as_str).chain(env.iter().copied()).collect();
    let t0 = Instant::now();
    let bootstrap_kill = (launch == Launch::ByHand && kind == "bootstrap").then(|| Duration::from_micros(delay_us / 4));
    let text = start(launch, n, victim, &vars, &what, bootstrap_kill);
    let said = parse(&text);
    let kill = said.get(&victim).and_then(|s| s.kill).unwrap_or_else(|| panic!("{what}: no kill time\n{text}"));
    let mut slowest = Duration::ZERO;
    for r in (0..n).filter(|&r| r != victim) {
        let Some((at, lost, err)) = said.get(&r).and_then(|s| s.fail.clone()) else {
            panic!("{what}: rank {r} did not fail\n{text}")
        };
        assert_eq!(lost, Some(victim), "{what}: rank {r}'s error names the killed rank: {err}\n{text}");
        assert!(
            text.lines().any(|l| l.contains(&format!("FAULT-LATER rank={r} ok"))),
            "{what}: rank {r}'s later operations\n{text}"
        );
        slowest = slowest.max(Duration::from_nanos(at.saturating_sub(kill) as u64));
    }
    assert!(
        slowest <= PEER_TIMEOUT + SLACK,
        "{what}: the slowest survivor failed {slowest:?} after the kill, beyond the bound\n{text}"
    );
    let left = running_with(&marker);
    assert!(left.is_empty(), "{what}: processes of the job still run: {left:?}");
    if let Some(job) = said.values().find_map(|s| s.job.clone()) {
        let files = shm_files(&job);
        assert!(files.is_empty(), "{what}: files left in /dev/shm: {files:?}");
    }
    if std::env::var("FERROCOMM_FAULT_VERBOSE").is_ok() {
        println!("{text}");
    }
    println!("{what}: slowest survivor {slowest:?} after the kill; job {:?}", t0.elapsed());
    slowest
}

/// Runs the cases two at a time (the machine may have two cores) and prints the slowest
/// survivor of each.
fn matrix(transport: &str, kinds: &[(&'static str, u32, &'static [&'static str])]) {
    matrix_under(Launch::Ferrorun, transport, kinds)
}

fn matrix_under(launch: Launch, transport: &str, kinds: &[(&'static str, u32, &'static [&'static str])]) {
    let seed = base_seed();
    println!("{transport} kill matrix, base seed {seed}");
    // `FERROCOMM_FAULT_ONLY=kind,kind`: just those.
    let only = std::env::var("FERROCOMM_FAULT_ONLY").ok();
    let cases: Vec<_> = (kinds.iter().enumerate())
        .filter(|(_, k)| only.as_deref().is_none_or(|o| o.split(',').any(|x| x == k.0)))
        .map(|(i, k)| (*k, seed.wrapping_add(i as u64 * 7919) | 1))
        .collect();
    let mut results = Vec::new();
    for pair in cases.chunks(2) {
        let handles: Vec<_> = pair
            .iter()
            .map(|&((kind, n, env), s)| {
                let transport = transport.to_string();
                std::thread::spawn(move || (kind, kill_case(launch, kind, n, &transport, env, s)))
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(r) => results.push(r),
                Err(e) => std::panic::resume_unwind(e),
            }
        }
    }
    for (kind, slowest) in results {
        println!(
            "FAULT-MATRIX {transport:<4} {kind:<16} {:<9} slowest survivor {:>9.1} ms",
            format!("{launch:?}"),
            slowest.as_secs_f64() * 1e3
        );
    }
}

#[test]
fn kill_matrix_shared_memory() {
    matrix("shm", KINDS);
    matrix("shm", SHM_KINDS);
}

#[test]
fn kill_matrix_tcp() {
    matrix("tcp", KINDS);
}

/// Over RDMA verbs (every peer through the verbs transport, its TCP connections kept as liveness
/// channels): the kinds that do not need shared memory. Needs an RDMA device: scripts/verbs-vm.sh
/// runs it over Soft-RoCE in a VM (elsewhere it says it skipped, unless `FERROCOMM_REQUIRE_VERBS`
/// is set).
#[cfg(feature = "verbs")]
#[test]
fn kill_matrix_verbs() {
    let present = std::fs::read_dir("/sys/class/infiniband").map(|d| d.count() > 0).unwrap_or(false);
    if !present {
        assert!(std::env::var_os("FERROCOMM_REQUIRE_VERBS").is_none(), "kill_matrix_verbs: no RDMA device");
        eprintln!("kill_matrix_verbs: skipped, no RDMA device here (scripts/verbs-vm.sh runs it over Soft-RoCE)");
        return;
    }
    // Multicast needs a multicast route, which the VM's dummy interface has not.
    let kinds: Vec<_> = KINDS.iter().copied().filter(|k| k.0 != "multicast").collect();
    matrix("verbs", &kinds);
}

/// Without `ferrorun` (as under `mpirun` or `srun`: rank 0 hosts the store, no launcher reports
/// a death), on both transports: the bootstrap, where only the store sees a rank die (the others
/// would wait for it until the connect timeout), and a collective and point-to-point loop.
#[test]
fn kill_matrix_store_hosted_by_rank_0() {
    const BY_HAND: &[(&str, u32, &[&str])] = &[("bootstrap", 4, &[]), ("allreduce", 4, &[]), ("eager", 4, &[])];
    matrix_under(Launch::ByHand, "shm", BY_HAND);
    matrix_under(Launch::ByHand, "tcp", BY_HAND);
}

// ---------------------------------------------------------------- the link cut --

/// Network namespaces deleted when dropped.
struct Netns(Vec<String>);

impl Drop for Netns {
    fn drop(&mut self) {
        for n in self.0.iter().rev() {
            let _ = sh(&["ip", "netns", "del", n]);
        }
    }
}

impl Netns {
    fn add(&mut self, name: String) -> Result<String, String> {
        let _ = sh(&["ip", "netns", "del", &name]);
        sh(&["ip", "netns", "add", &name])?;
        self.0.push(name.clone());
        sh(&["ip", "-n", &name, "link", "set", "lo", "up"])?;
        Ok(name)
    }
}

/// 3 hosts of 2 ranks on a bridge; one host's link goes down while they loop node-leader
/// all-reduces (data in flight: TCP's user timeout sees it), then while they all wait for a message
/// that never comes (idle links: keep-alive probing sees it).
#[test]
fn link_cut_between_namespace_hosts() {
    if !is_root() {
        eprintln!("\n!!!!!!!! SKIPPED link_cut_between_namespace_hosts: network namespaces need root !!!!!!!!\n");
        return;
    }
    assert!(Command::new("ip").arg("-V").output().is_ok_and(|o| o.status.success()), "ip (iproute2) is missing");
    let seed = base_seed();
    let mut results = Vec::new();
    for (i, kind) in ["hierarchical", "idle"].into_iter().enumerate() {
        results.push((kind, link_cut(kind, seed.wrapping_add(i as u64 * 7919) | 1)));
    }
    for (kind, slowest) in results {
        println!("FAULT-MATRIX netns link-cut {kind:<12} slowest survivor {:>9.1} ms", slowest.as_secs_f64() * 1e3);
    }
}

/// One link cut while the ranks run `kind`; returns the slowest rank's time from the cut to its
/// failure.
fn link_cut(kind: &str, seed: u64) -> Duration {
    let mut rng = Rng(seed);
    let cut = (rng.next() % 3) as u32;
    let delay = Duration::from_millis(100 + rng.next() % 400);
    let what = format!("link cut during {kind}: seed {seed}, host {cut} cut {delay:?} into the loop");
    let prefix = format!("fcf{}{}", std::process::id() % 100_000, &kind[..1]);
    let mut ns = Netns(Vec::new());
    let hub = ns.add(format!("{prefix}h")).unwrap();
    sh(&["ip", "-n", &hub, "link", "add", "br0", "type", "bridge"]).unwrap();
    sh(&["ip", "-n", &hub, "link", "set", "br0", "up"]).unwrap();
    let mut hosts = Vec::new();
    for h in 0..3 {
        let name = ns.add(format!("{prefix}n{h}")).unwrap();
        let port = format!("v{h}");
        sh(&["ip", "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &name]).unwrap();
        sh(&["ip", "-n", &hub, "link", "set", &port, "master", "br0", "up"]).unwrap();
        let addr = format!("10.79.0.{}", h + 1);
        sh(&["ip", "-n", &name, "addr", "add", &format!("{addr}/24"), "dev", "eth0"]).unwrap();
        sh(&["ip", "-n", &name, "link", "set", "eth0", "up"]).unwrap();
        hosts.push((name, addr));
    }
    let exe = std::env::current_exe().unwrap();
    let token: String = (0..32).map(|i| format!("{:02x}", (seed as u8).wrapping_mul(31).wrapping_add(i))).collect();
    let coord = format!("{}:29533", hosts[0].1);
    let marker = format!("FERROCOMM_FAULT_RUN={}-cut-{kind}-{seed}", std::process::id());
    let (tx, rx) = mpsc::channel::<(u32, String)>();
    let mut children = Vec::new();
    for r in 0..6u32 {
        let (ns_name, addr) = &hosts[r as usize / 2];
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns_name]).arg(&exe).args(["--exact", "fault_rank", "--nocapture", "--test-threads=1"]);
        c.env("FERROCOMM_FAULT_KIND", kind)
            .env("FERROCOMM_FAULT_VICTIM", "none")
            .env("FERROCOMM_RANK", r.to_string())
            .env("FERROCOMM_SIZE", "6")
            .env("FERROCOMM_COORD", &coord)
            .env("FERROCOMM_TOKEN", &token)
            .env("FERROCOMM_HOST_STORE", if r == 0 { "1" } else { "0" })
            .env("FERROCOMM_BIND", addr)
            .env("FERROCOMM_HOST_ID", format!("fault-host-{}", r / 2))
            .env("FERROCOMM_PROGRESS", "blocking")
            .env("FERROCOMM_PEER_TIMEOUT_MS", PEER_TIMEOUT.as_millis().to_string())
            .env(marker.split_once('=').unwrap().0, marker.split_once('=').unwrap().1)
            .env_remove("FERROCOMM_LAUNCHER");
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        for pipe in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let tx = tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    let _ = tx.send((r, line));
                }
            });
        }
        children.push(child);
    }
    drop(tx);
    // Every rank in its loop, then the cut after the delay.
    let mut text = String::new();
    let mut ready = 0;
    let start = Instant::now();
    while ready < 6 {
        let (r, line) =
            rx.recv_timeout(Duration::from_secs(60)).unwrap_or_else(|_| panic!("{what}: ranks not ready\n{text}"));
        text += &format!("[{r}] {line}\n");
        ready += usize::from(line.contains("FAULT-READY"));
        assert!(start.elapsed() < Duration::from_secs(90), "{what}: ranks not ready\n{text}");
    }
    std::thread::sleep(delay);
    let cut_at = now_ns();
    sh(&["ip", "-n", &hub, "link", "set", &format!("v{cut}"), "down"]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    for (r, c) in children.iter_mut().enumerate() {
        while c.try_wait().unwrap().is_none() {
            if Instant::now() > deadline {
                let _ = c.kill();
                text += &format!("rank {r} killed: still running\n");
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    while let Ok((r, line)) = rx.recv_timeout(Duration::from_secs(2)) {
        text += &format!("[{r}] {line}\n");
    }
    let said = parse(&text);
    let mut slowest = Duration::ZERO;
    for r in 0..6u32 {
        let Some((at, lost, err)) = said.get(&r).and_then(|s| s.fail.clone()) else {
            panic!("{what}: rank {r} did not fail\n{text}")
        };
        let lost = lost.unwrap_or_else(|| panic!("{what}: rank {r} failed without naming a lost rank: {err}\n{text}"));
        let on_cut = |x: u32| x / 2 == cut;
        assert_ne!(on_cut(lost), on_cut(r), "{what}: rank {r} names rank {lost}: {err}\n{text}");
        slowest = slowest.max(Duration::from_nanos(at.saturating_sub(cut_at) as u64));
    }
    assert!(slowest <= PEER_TIMEOUT + SLACK, "{what}: the slowest rank failed {slowest:?} after the cut\n{text}");
    let left = running_with(&marker);
    assert!(left.is_empty(), "{what}: processes still run: {left:?}");
    if std::env::var("FERROCOMM_FAULT_VERBOSE").is_ok() {
        println!("{text}");
    }
    println!("{what}: every rank failed; slowest {slowest:?} after the cut");
    slowest
}

// ---------------------------------------------------------------- the ranks --

/// One rank of a case, when run by the tests above.
#[test]
fn fault_rank() {
    let Ok(kind) = std::env::var("FERROCOMM_FAULT_KIND") else { return };
    let rank: u32 = std::env::var("FERROCOMM_RANK").unwrap().parse().unwrap();
    let victim: Option<u32> = std::env::var("FERROCOMM_FAULT_VICTIM").ok().and_then(|v| v.parse().ok());
    let delay = Duration::from_micros(std::env::var("FERROCOMM_FAULT_DELAY_US").map_or(0, |d| d.parse().unwrap()));
    if let Ok(token) = std::env::var("FERROCOMM_TOKEN") {
        println!("FAULT-JOB rank={rank} job={}", &token[..16]);
    }
    if kind == "hierarchical" && std::env::var("FERROCOMM_HOST_ID").is_err() {
        // SAFETY: set before any other thread of this process reads the environment.
        unsafe { std::env::set_var("FERROCOMM_HOST_ID", format!("pretend-host-{}", rank / 2)) };
    }
    let killer = move || {
        std::thread::spawn(move || {
            std::thread::sleep(delay);
            println!("FAULT-KILL rank={rank} at={}", now_ns());
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        });
    };
    // Warnings on stderr: a clean end must print none.
    let _ = tracing_subscriber::fmt()
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .with_writer(std::io::stderr)
        .try_init();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    if kind == "departure" {
        return rt.block_on(departure());
    }
    rt.block_on(async move {
        if kind == "bootstrap" && victim == Some(rank) && std::env::var("FERROCOMM_FAULT_KILLED_BY_TEST").is_err() {
            killer();
        }
        let fail = |e: Error| {
            let lost = match &e {
                Error::PeerLost { rank, .. } => rank.to_string(),
                _ => "none".into(),
            };
            println!("FAULT-FAIL rank={rank} at={} lost={lost} err={e}", now_ns());
        };
        let w = match ferrocomm::init().await {
            Ok(w) => w,
            Err(e) => {
                fail(e);
                return println!("FAULT-LATER rank={rank} ok (no world)");
            }
        };
        let t = Duration::from_secs(30);
        // The survivors' own communicator, made before the kill: the loss must not touch it.
        let rest = async {
            w.barrier().timeout(t).await?;
            w.split(victim.map(|v| u32::from(v == rank)), rank).timeout(t).await
        };
        let rest = match rest.await {
            Ok(rest) => rest,
            Err(e) => {
                fail(e);
                later(&w, None, victim).await;
                return;
            }
        };
        // The paths the kind is meant to cover are the ones taken.
        let alg = w.collective_algorithm(ferrocomm::Operation::Allreduce, 8);
        match kind.as_str() {
            "hierarchical" => assert_eq!(alg, ferrocomm::Algorithm::Hierarchical),
            "board-allreduce" => assert_eq!(alg, ferrocomm::Algorithm::SharedMemory),
            "board-barrier" => {
                assert_eq!(w.collective_algorithm(ferrocomm::Operation::Barrier, 0), ferrocomm::Algorithm::SharedMemory)
            }
            _ => {}
        }
        println!("FAULT-READY rank={rank}");
        if kind != "bootstrap" && victim == Some(rank) {
            killer();
        }
        match run(&w, &kind).timeout(HANG).await {
            Ok(()) => unreachable!("the loop ends in an error"),
            Err(Error::Timeout) => {
                println!(
                    "FAULT-FAIL rank={rank} at={} lost=none err=no failure after {HANG:?}: the rank hangs",
                    now_ns()
                )
            }
            Err(e) => fail(e),
        }
        // (Where the kill may land in the split itself, not every survivor has the communicator.)
        later(&w, rest.as_ref().filter(|_| kind != "bootstrap"), victim).await;
        let _ = w.finalize().timeout(t).await;
    });
}

/// After the failure: later operations on the world fail at once, naming the killed rank, and the
/// survivors' own communicator still works. Prints `FAULT-LATER ok` or what went wrong.
async fn later(w: &World, rest: Option<&ferrocomm::Comm>, victim: Option<u32>) {
    let Some(victim) = victim else { return };
    let rank = w.rank();
    let names = |r: &ferrocomm::Result<()>| matches!(r, Err(Error::PeerLost { rank, .. }) if *rank == victim);
    let quick = Duration::from_secs(1);
    let barrier = w.barrier().timeout(quick).await;
    let send = w.send((rank + 1) % w.size(), 5, vec![1u8]).timeout(quick).await;
    let mut problems = Vec::new();
    if !names(&barrier) {
        problems.push(format!("barrier: {barrier:?}"));
    }
    if !names(&send) {
        problems.push(format!("send: {send:?}"));
    }
    if let Some(rest) = rest {
        let mut v = [1u64];
        match rest.allreduce(&mut v, ReduceOp::Sum).timeout(Duration::from_secs(20)).await {
            Ok(()) if v[0] == u64::from(w.size() - 1) => {}
            other => problems.push(format!("survivors' all-reduce: {other:?} {v:?}")),
        }
    }
    if problems.is_empty() {
        println!("FAULT-LATER rank={rank} ok");
    } else {
        println!("FAULT-LATER rank={rank} bad: {}", problems.join("; "));
    }
}

/// Loops the operation `kind` until it fails (or reports a hang).
async fn run(w: &World, kind: &str) -> ferrocomm::Result<()> {
    let (r, n) = (w.rank(), w.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let chan = match kind {
        "multicast" => Some(ferrocomm::multicast::Channel::new(w.comm()).await?),
        _ => None,
    };
    let big = Bytes::from(vec![7u8; 256 << 10]);
    for i in 0u64.. {
        match kind {
            "eager" | "rendezvous" => {
                let data = if kind == "eager" { Bytes::from(i.to_le_bytes().to_vec()) } else { big.clone() };
                let rx = w.recv(prev, i);
                w.send(next, i, data).await?;
                rx.await?;
            }
            "barrier" | "bootstrap" | "board-barrier" => w.barrier().await?,
            "bcast" => {
                let mut v = [i; 4];
                w.broadcast((i % u64::from(n)) as u32, &mut v).await?;
            }
            "allreduce" | "board-allreduce" | "hierarchical" => {
                let mut v = [1u64];
                w.allreduce(&mut v, ReduceOp::Sum).await?;
            }
            "allreduce-large" => {
                let mut v = vec![1u32; 64 << 10];
                w.allreduce(&mut v, ReduceOp::Sum).await?;
            }
            "allgather" => _ = w.allgather(&[r as u64, i]).await?,
            "alltoall" => _ = w.alltoall(&vec![i; n as usize * 2]).await?,
            "reduce" => _ = w.reduce((i % u64::from(n)) as u32, &[i], ReduceOp::Max).await?,
            "scan" => {
                let mut v = [1u64];
                w.scan(&mut v, ReduceOp::Sum).await?;
            }
            "multicast" => {
                let chan = chan.as_ref().expect("made");
                chan.send(Bytes::from(i.to_le_bytes().to_vec())).await?;
                for root in (0..n).filter(|&x| x != r) {
                    chan.recv(root).await?;
                }
            }
            "idle" => {
                // Nothing is ever sent: the loss is seen by keep-alive probing alone.
                let m = w.recv(ferrocomm::Source::Any, u64::MAX).await?;
                panic!("a message nobody sent: {m:?}");
            }
            other => panic!("unknown kind {other}"),
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- departures --

/// Rank 0 finalizes early; the others then see a departure, not a loss: a receive naming rank 0
/// fails with `Left`, the collectives rank 0 finished before it left (its broadcast, its scan)
/// complete on the others even when called after its goodbye, and everything else goes on
/// (point-to-point between the others on the world, their own communicator). Every rank ends with
/// finalize, and nobody logs a warning.
#[test]
fn finalize_is_a_quiet_departure() {
    for transport in ["shm", "tcp"] {
        let transports = if transport == "tcp" { "tcp" } else { "auto" };
        let out = Command::new(FERRORUN)
            .args(["-n", "4", "--env", "FERROCOMM_FAULT_KIND=departure"])
            .args(["--env", &format!("FERROCOMM_TRANSPORTS={transports}")])
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "fault_rank", "--nocapture", "--test-threads=1"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{transport}:\n{text}");
        for r in 1..4 {
            assert!(text.contains(&format!("FAULT-DEPARTURE-OK rank={r}")), "{transport}: rank {r}\n{text}");
        }
        assert!(!text.contains("WARN"), "{transport}: a clean job logs no warning\n{text}");
        println!("{transport}: departures are quiet, and what the departed rank finished completes after it left");
    }
}

async fn departure() {
    let t = Duration::from_secs(20);
    let w = ferrocomm::init().await.unwrap();
    let (rank, n) = (w.rank(), w.size());
    let rest = w.split(Some(u32::from(rank == 0)), rank).await.unwrap().unwrap();
    w.barrier().timeout(t).await.unwrap();
    // Collectives that rank 0 can finish before the others have even called them: it roots a
    // broadcast, and is first in a scan. It finalizes right after.
    if rank == 0 {
        let mut b = [7u64, 8];
        w.broadcast(0, &mut b).timeout(t).await.unwrap();
        let mut s = [1u64];
        w.scan(&mut s, ReduceOp::Sum).timeout(t).await.unwrap();
        assert_eq!(s[0], 1);
        return w.finalize().await.unwrap();
    }
    let left = |r: &ferrocomm::Result<()>| {
        matches!(r, Err(Error::PeerLost { rank: 0, reason: ferrocomm::TransportError::Left }))
    };
    // A receive naming rank 0 fails once its goodbye is here...
    let r = w.recv(0, 9u64).timeout(t).await.map(drop);
    assert!(left(&r), "{r:?}");
    // ... yet the collectives it finished before leaving complete here, called after its
    // goodbye: a departure refuses nothing that the departed rank already did its part of.
    let mut b = [0u64, 0];
    w.broadcast(0, &mut b).timeout(t).await.unwrap();
    assert_eq!(b, [7, 8]);
    let mut s = [1u64];
    w.scan(&mut s, ReduceOp::Sum).timeout(t).await.unwrap();
    assert_eq!(s[0], u64::from(rank) + 1);
    // Nothing else is touched: the others still talk on the world, and on their own communicator.
    let (next, prev) = (rank % (n - 1) + 1, (rank + n - 3) % (n - 1) + 1);
    let rx = w.recv(prev, 3u64);
    w.send(next, 3, vec![rank as u8]).timeout(t).await.unwrap();
    assert_eq!(rx.timeout(t).await.unwrap().data[0] as u32, prev);
    let mut v = [1u64];
    rest.allreduce(&mut v, ReduceOp::Sum).timeout(t).await.unwrap();
    assert_eq!(v[0], u64::from(n - 1));
    rest.barrier().timeout(t).await.unwrap();
    println!("FAULT-DEPARTURE-OK rank={rank}");
    w.finalize().await.unwrap();
}

/// A rank whose program panics while it holds its world aborts: the others learn of it as a loss
/// at once and fail what they were doing, whether or not it involved that rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_rank_is_lost_at_once() {
    let mut worlds = ferrocomm::testing::cluster(3, ferrocomm::Settings::default()).await.unwrap();
    let (w2, w1, w0) = (worlds.pop().unwrap(), worlds.pop().unwrap(), worlds.pop().unwrap());
    let t = Duration::from_secs(10);
    let from2 = w0.recv(2, 1u64);
    let barrier = w2.barrier();
    let gives_up = tokio::spawn(async move {
        let _w = w1;
        panic!("rank 1 gives up (this panic is part of the test)");
    });
    assert!(gives_up.await.is_err());
    let r = from2.timeout(t).await;
    assert!(matches!(r, Err(Error::PeerLost { rank: 1, reason: ferrocomm::TransportError::Aborted })), "{r:?}");
    let r = barrier.timeout(t).await;
    assert!(matches!(r, Err(Error::PeerLost { rank: 1, .. })), "{r:?}");
}
