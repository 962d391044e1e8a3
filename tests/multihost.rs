//! Several hosts on one machine: 3 hosts, each a network namespace with its own 10.88.S.x
//! address on a bridge and a host name of its own (tests/common/netns.rs), 2 ranks on each,
//! started by the test under `ferrorun` and under the real launchers:
//!
//! * **ferrorun**: `ferrorun --store-addr <gateway>` in the root namespace, each rank started
//!   through `place.sh`, which moves it onto the host of its rank;
//! * **mpirun** (Open MPI): `--host A:2,B:2,C:2` with a remote shell (`--mca plm_rsh_agent
//!   agent.sh`) whose "remote" hosts are the namespaces: Open MPI starts one `orted` per host
//!   and each starts its ranks there; no ferrocomm variable: rank 0 shares its address through
//!   Open MPI's PMIx;
//! * **mpiexec** (MPICH Hydra): `-launcher rsh -launcher-exec agent.sh -hosts A:2,B:2,C:2`, one
//!   `hydra_pmi_proxy` per host; no ferrocomm variable: rank 0 shares its address through
//!   Hydra's PMI;
//! * **srun** (Slurm, one node brought up by scripts/slurm-local.sh): `srun place.sh ...`; no
//!   ferrocomm variable at all: the store's host is the step's first node, whose name resolves to
//!   host 0 inside the namespaces.
//!
//! Every rank ([`multihost_rank`]) checks, before anything else, that it runs where the job says:
//! each peer on its own host is reached over shared memory and every other peer over TCP, and
//! the collectives take the node-leader (hierarchical) algorithms. Then point-to-point (a ring of
//! every size across the eager and rendezvous switches, a wildcard storm, matching, rendezvous
//! orders), every collective against a sequential reference (tests/coll), reliable multicast
//! across the bridge from a root on host 0 and one on host 1 (the group confirmed: real IP
//! multicast), and one-sided put, get (strided and 3-D), fetch-add and compare-and-swap, mapped
//! within a host and served by the target's progress across hosts (tests/rma_suite). The same
//! job under every launcher.
//!
//! A link cut between such hosts (survivors fail with `PeerLost` within the peer timeout) is
//! `link_cut_between_namespace_hosts` in tests/faults.rs.
//!
//! Needs root (namespaces); without it the tests say so loudly and pass. The real launchers come
//! from scripts/slurm-local.sh (run by the tests, idempotent).

#[path = "common/netns.rs"]
mod netns;

mod coll;
mod common;
mod rma_suite;

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm::multicast::Channel;
use ferrocomm::{Algorithm, Deadline, Error, Operation, World};

use netns::Hosts;

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");
/// Set (to `full`) for [`multihost_rank`] to run.
const SCENARIO: &str = "MULTIHOST_SCENARIO";
const HOSTS: usize = 3;
const PER_HOST: u32 = 2;
const RANKS: u32 = HOSTS as u32 * PER_HOST;
/// How long one job may take before its launcher is killed.
const JOB_LIMIT: Duration = Duration::from_secs(240);
const T: Duration = Duration::from_secs(90);

/// One job at a time: each is 6 ranks on this machine's CPUs.
static ONE_JOB: Mutex<()> = Mutex::new(());

/// Printed to the real stderr, past the harness's capture: a skip must be seen.
fn loud(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "\n!!!!!!!! {msg} !!!!!!!!\n");
}

fn prerequisites(test: &str) -> bool {
    if !netns::is_root() {
        loud(&format!("SKIPPED {test}: network namespaces need root; run the suite as root (scripts/test.sh does)"));
        return false;
    }
    for (tool, flag) in [("ip", "-V"), ("unshare", "--version")] {
        let found = Command::new(tool).arg(flag).output().is_ok_and(|o| o.status.success());
        assert!(found, "{tool} is missing (Debian: iproute2, util-linux)");
    }
    true
}

/// Runs scripts/slurm-local.sh once (installs Open MPI, MPICH and Slurm, brings Slurm up): Ok
/// when done, Err with the reason to skip.
fn launchers() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        // This test belongs to the ferrorun package (launch/): the scripts are one level up.
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../scripts/slurm-local.sh");
        let out = Command::new("bash").arg(&script).stdin(Stdio::null()).output().expect("bash runs");
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        match out.status.code() {
            Some(0) => Ok(()),
            Some(77) => Err(format!("scripts/slurm-local.sh cannot install the launchers: {}", said.trim())),
            _ => panic!("scripts/slurm-local.sh failed ({}):\n{said}", out.status),
        }
    })
    .clone()
}

/// Runs `cmd` (a launcher) in a process group of its own, killed as a whole past [`JOB_LIMIT`];
/// checks that it succeeded and that every rank reported from the host its rank belongs on.
/// Returns the output and the wall time.
fn run_job(test: &str, hosts: &Hosts, mut cmd: Command) -> (String, Duration) {
    let _one = ONE_JOB.lock().unwrap_or_else(|p| p.into_inner());
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("FERROCOMM_") {
            cmd.env_remove(&*k);
        }
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let start = Instant::now();
    let child = cmd.spawn().unwrap_or_else(|e| panic!("{test}: cannot start {cmd:?}: {e}"));
    let pgid = child.id() as i32;
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if done_rx.recv_timeout(JOB_LIMIT).is_ok() {
            return false;
        }
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(-pgid, libc::SIGTERM) };
        std::thread::sleep(Duration::from_secs(5));
        // SAFETY: as above.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        true
    });
    let out = child.wait_with_output().unwrap();
    let _ = done_tx.send(());
    let killed = watchdog.join().unwrap();
    let took = start.elapsed();
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(!killed, "{test}: the job did not finish within {JOB_LIMIT:?}:\n{text}");
    assert!(out.status.success(), "{test}: {} after {took:.1?}:\n{text}", out.status);
    for r in 0..RANKS {
        let mark = format!("MULTIHOST-OK rank={r} ");
        let line = text
            .split(&mark)
            .nth(1)
            .and_then(|rest| rest.lines().next())
            .unwrap_or_else(|| panic!("{test}: rank {r} did not report:\n{text}"));
        let host = hosts.of_rank(r, PER_HOST);
        assert!(line.starts_with(&format!("host={} ", host.name)), "{test}: rank {r} ran elsewhere: {line}\n{text}");
        println!("{test}: rank {r} {line}");
    }
    let _ = writeln!(std::io::stderr().lock(), "{test}: {RANKS} ranks on {HOSTS} namespace hosts in {took:.1?}");
    (text, took)
}

/// The test binary as a rank: `PROGRAM --exact multihost_rank ...`.
fn rank_args(cmd: &mut Command) {
    cmd.arg(std::env::current_exe().unwrap()).args(["--exact", "multihost_rank", "--nocapture", "--test-threads=1"]);
}

#[test]
fn ferrorun_across_namespace_hosts() {
    if !prerequisites("ferrorun_across_namespace_hosts") {
        return;
    }
    let hosts = Hosts::new('f', HOSTS).unwrap();
    let place = hosts.place(PER_HOST).unwrap();
    let mut cmd = Command::new(FERRORUN);
    cmd.args(["-n", &RANKS.to_string(), "--grace", "10", "--store-addr", &hosts.gateway])
        .args(["--env", &format!("{SCENARIO}=full")])
        .arg(&place);
    rank_args(&mut cmd);
    run_job("ferrorun", &hosts, cmd);
}

#[test]
fn mpirun_across_namespace_hosts() {
    if !prerequisites("mpirun_across_namespace_hosts") {
        return;
    }
    if let Err(why) = launchers() {
        return loud(&format!("SKIPPED mpirun_across_namespace_hosts: {why}"));
    }
    let hosts = Hosts::new('o', HOSTS).unwrap();
    let agent = hosts.agent().unwrap();
    let list: Vec<String> = hosts.hosts.iter().map(|h| format!("{}:{PER_HOST}", h.addr)).collect();
    let mut cmd = Command::new("mpirun.openmpi");
    cmd.args(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-n", &RANKS.to_string()])
        .args(["--host", &list.join(",")])
        .args(["--mca", "plm_rsh_agent", &agent.display().to_string()])
        // The daemons start their ranks themselves (no daemon starts another from a namespace).
        .args(["--mca", "plm_rsh_no_tree_spawn", "1"])
        // mpirun and its daemons talk over the bridge, the one network they share.
        .args(["--mca", "oob_tcp_if_include", &hosts.subnet])
        .args(["-x", &format!("{SCENARIO}=full")]);
    rank_args(&mut cmd);
    let (text, _) = run_job("mpirun", &hosts, cmd);
    // The store was found at host 0's address, which rank 0 shared through PMIx.
    assert!(text.contains(&format!("store={}:", hosts.hosts[0].addr)), "{text}");
}

#[test]
fn mpiexec_across_namespace_hosts() {
    if !prerequisites("mpiexec_across_namespace_hosts") {
        return;
    }
    if let Err(why) = launchers() {
        return loud(&format!("SKIPPED mpiexec_across_namespace_hosts: {why}"));
    }
    let hosts = Hosts::new('m', HOSTS).unwrap();
    let agent = hosts.agent().unwrap();
    let list: Vec<String> = hosts.hosts.iter().map(|h| format!("{}:{PER_HOST}", h.addr)).collect();
    let mut cmd = Command::new("mpiexec.mpich");
    cmd.args(["-launcher", "rsh", "-launcher-exec", &agent.display().to_string()])
        .args(["-hosts", &list.join(","), "-n", &RANKS.to_string()])
        // The proxies reach mpiexec at its address on the bridge.
        .args(["-localhost", &hosts.gateway])
        .args(["-genv", SCENARIO, "full"]);
    rank_args(&mut cmd);
    let (text, _) = run_job("mpiexec", &hosts, cmd);
    // The store was found at host 0's address, which rank 0 shared through Hydra's PMI.
    assert!(text.contains(&format!("store={}:", hosts.hosts[0].addr)), "{text}");
}

#[test]
fn srun_across_namespace_hosts() {
    if !prerequisites("srun_across_namespace_hosts") {
        return;
    }
    if let Err(why) = launchers() {
        return loud(&format!("SKIPPED srun_across_namespace_hosts: {why}"));
    }
    let hosts = Hosts::new('s', HOSTS).unwrap();
    let place = hosts.place(PER_HOST).unwrap();
    let mut cmd = Command::new("srun");
    cmd.args(["--overcommit", "-n", &RANKS.to_string(), "--time=5", "--kill-on-bad-exit=1"])
        .env(SCENARIO, "full")
        .arg(&place);
    rank_args(&mut cmd);
    let (text, _) = run_job("srun", &hosts, cmd);
    // The store was found from Slurm's node list alone: the node's name, at host 0.
    assert!(text.contains(&format!("store={}:", netns::hostname())), "{text}");
}

// ---------------------------------------------------------------- the ranks --

/// One rank, when a test above starts this binary under a launcher; otherwise nothing.
#[test]
fn multihost_rank() {
    let Ok(scenario) = std::env::var(SCENARIO) else { return };
    let job = ferrocomm::bootstrap::env::detect().expect("the launcher's variables");
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async {
        let w = ferrocomm::init().await.expect("ferrocomm::init");
        let (r, n) = (w.rank(), w.size());
        assert_eq!(n, RANKS);
        assert_eq!(scenario, "full");
        placement(&w);
        let t0 = Instant::now();
        common::ring_storm_rendezvous(&w).await;
        common::rendezvous_orders(&w).await;
        common::matching_semantics(&w).await;
        common::dup_isolation(&w).await;
        let p2p = t0.elapsed();
        coll::operations(&w, &coll::TABLE_COUNTS, "multi-host").await;
        let colls = t0.elapsed() - p2p;
        multicast(&w, 100).await;
        rma_suite::fetch_add_sums(&w).await;
        rma_suite::geometries(&w).await;
        rma_suite::cas_lock(&w).await;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        println!(
            "MULTIHOST-OK rank={r} host={} launcher={} store={} p2p={p2p:.1?} collectives={colls:.1?} all={:.1?}",
            host.trim(),
            job.launcher,
            job.coordinator,
            t0.elapsed()
        );
        w.finalize().timeout(T).await.unwrap();
    });
}

/// Each peer on this rank's host over shared memory, every other one over TCP; the node-leader
/// algorithms for the collectives, which group the ranks by host.
fn placement(w: &World) {
    let me = w.rank();
    for p in (0..w.size()).filter(|&p| p != me) {
        let t = w.transport_for(p);
        if p / PER_HOST == me / PER_HOST {
            assert_eq!(t, "shm", "rank {me}: rank {p} is on this host");
        } else {
            assert!(t.starts_with("tcp"), "rank {me}: rank {p} is on another host, reached over {t}");
        }
    }
    for op in [Operation::Barrier, Operation::Bcast, Operation::Allreduce] {
        for bytes in [8, 1 << 20] {
            // A broadcast across hosts goes by reliable multicast (docs/multicast.md).
            let want = if op == Operation::Bcast { Algorithm::Multicast } else { Algorithm::Hierarchical };
            assert_eq!(w.collective_algorithm(op, bytes), want, "{op} of {bytes} B");
        }
    }
}

fn payload(root: u32, i: usize) -> Bytes {
    let len = (i * 7919 + root as usize * 131) % 20_000;
    (0..len).map(|k| (k as u32 ^ (i as u32).wrapping_mul(2_654_435_761) ^ root) as u8).collect::<Vec<u8>>().into()
}

/// Reliable multicast over the bridge: a root on host 0 and one on host 1 each send `count`
/// messages of up to 20 kB; every other rank gets each exactly once, in order. The group must be
/// confirmed: the datagrams really crossed the bridge as IP multicast.
async fn multicast(w: &World, count: usize) {
    const ROOTS: [u32; 2] = [0, PER_HOST + 1];
    let me = w.rank();
    let chan = Channel::new(w.comm()).await.unwrap();
    assert!(chan.wait_group(Duration::from_secs(20)).await, "rank {me}: the multicast group was not confirmed");
    w.barrier().timeout(T).await.unwrap();
    let sending = async {
        if ROOTS.contains(&me) {
            for i in 0..count {
                chan.send(payload(me, i)).timeout(T).await.unwrap();
            }
        }
    };
    let receiving = async {
        for root in ROOTS.into_iter().filter(|&r| r != me) {
            for i in 0..count {
                let m = chan.recv(root).timeout(T).await.unwrap();
                assert!(m == payload(root, i), "rank {me}: message {i} of root {root} altered or out of order");
            }
        }
    };
    futures::join!(sending, receiving);
    chan.flush().timeout(T).await.unwrap();
    w.barrier().timeout(T).await.unwrap();
    for root in ROOTS.into_iter().filter(|&r| r != me) {
        let extra = chan.recv(root).timeout(Duration::from_millis(100)).await;
        assert!(matches!(extra, Err(Error::Timeout)), "rank {me}: extra message from {root}: {extra:?}");
    }
    w.barrier().timeout(T).await.unwrap();
}
