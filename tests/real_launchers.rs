//! One ferrocomm job under each real launcher: Slurm's `srun` on a one-node cluster, Open MPI's
//! `mpirun` (with no variable, and with a host-name coordinator), and MPICH's Hydra `mpiexec`. No
//! ferrocomm variable is set: each rank finds its rank, size, store and token in what the launcher
//! gives it. Every rank runs [`rank_job`] (this test binary, started by the launcher): a ring of
//! point-to-point messages, an all-reduce checked against the sequential sum, a barrier; a wrong
//! result fails the rank, and the launcher's exit code fails the test.
//!
//! `scripts/slurm-local.sh` installs the launchers and brings Slurm up (idempotently; the tests
//! run it once). Without root, or where it cannot install them, the tests say loudly that they
//! were skipped.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm::ReduceOp;
use ferrocomm::bootstrap::env::{self, EnvError};
use ferrocomm::{Deadline, World};

const RANKS: u32 = 4;
/// How long a whole job may take before the launcher is killed.
const JOB_LIMIT: Duration = Duration::from_secs(240);
/// Elements of the all-reduce: 1 MiB of u64, above the eager limit.
const ELEMENTS: usize = 1 << 17;

/// One job at a time: each is 4 ranks on this machine's CPUs.
static ONE_JOB: Mutex<()> = Mutex::new(());

/// Printed to the real stderr, past the test harness's capture: a skip must be seen.
fn loud(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "\n!!!!!!!! {msg} !!!!!!!!\n");
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// Runs scripts/slurm-local.sh once: Ok when the launchers are installed and Slurm is up, Err
/// with the reason to skip.
fn bring_up() -> Result<(), String> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        if !is_root() {
            return Err("not root: the launchers cannot be installed nor Slurm's daemons started; run the \
                        suite as root (scripts/test.sh does)"
                .to_string());
        }
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/slurm-local.sh");
        let start = Instant::now();
        let out = Command::new("bash").arg(&script).stdin(Stdio::null()).output().expect("bash runs");
        let said = String::from_utf8_lossy(&out.stderr).into_owned();
        let _ = writeln!(std::io::stderr().lock(), "{said}slurm-local.sh: {:.1?}", start.elapsed());
        match out.status.code() {
            Some(0) => Ok(()),
            Some(77) => Err(format!("scripts/slurm-local.sh cannot install the launchers: {}", said.trim())),
            _ => panic!("scripts/slurm-local.sh failed ({}):\n{said}", out.status),
        }
    })
    .clone()
}

/// Runs `launcher args... <this binary> <rank_job>` without any ferrocomm variable and checks
/// that every rank reported a correct job under `expect_launcher`. Returns the ranks' lines.
fn run_job(test: &str, launcher: &str, args: &[&str], expect_launcher: &str) -> Option<Vec<String>> {
    if let Err(why) = bring_up() {
        loud(&format!("SKIPPED {test}: {why}"));
        return None;
    }
    let _one = ONE_JOB.lock().unwrap_or_else(|p| p.into_inner());
    let me = std::env::current_exe().unwrap();
    let mut cmd = Command::new(launcher);
    cmd.args(args).arg(&me).args(["--exact", "rank_job", "--ignored", "--nocapture", "--test-threads=1"]);
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("FERROCOMM_") {
            cmd.env_remove(&*k);
        }
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
    let start = Instant::now();
    let child = cmd.spawn().unwrap_or_else(|e| panic!("{test}: cannot start {launcher}: {e}"));
    let pgid = child.id() as i32;
    // The watchdog kills the launcher's process group if the job outlives JOB_LIMIT.
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        if done_rx.recv_timeout(JOB_LIMIT).is_err() {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe {
                libc::kill(-pgid, libc::SIGTERM);
            }
            std::thread::sleep(Duration::from_secs(5));
            // SAFETY: as above.
            unsafe {
                libc::kill(-pgid, libc::SIGKILL);
            }
            true
        } else {
            false
        }
    });
    let out = child.wait_with_output().unwrap();
    let _ = done_tx.send(());
    let killed = watchdog.join().unwrap();
    let took = start.elapsed();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let shown =
        format!("{launcher} {args:?}: {} after {took:.1?}\n--- stdout\n{stdout}\n--- stderr\n{stderr}", out.status);
    assert!(!killed, "{test}: the job did not finish within {JOB_LIMIT:?}: {shown}");
    assert!(out.status.success(), "{test}: {shown}");
    let lines = reports(test, &stdout, expect_launcher, &shown);
    let _ = writeln!(std::io::stderr().lock(), "{test}: {RANKS} ranks under {launcher} in {took:.1?}");
    Some(lines)
}

/// Every rank's report line in `output`, each checked: under `expect_launcher`, every result ok.
fn reports(test: &str, output: &str, expect_launcher: &str, shown: &str) -> Vec<String> {
    let mut lines = Vec::new();
    for r in 0..RANKS {
        let mark = format!("FERROCOMM-RANK {r}/{RANKS} ");
        let line = output
            .split(&mark)
            .nth(1)
            .and_then(|rest| rest.lines().next())
            .unwrap_or_else(|| panic!("{test}: rank {r} did not report: {shown}"));
        assert!(line.contains(&format!("launcher={expect_launcher};")), "{test}: rank {r}: {line}\n{shown}");
        assert!(line.ends_with("ring=ok allreduce=ok barrier=ok"), "{test}: rank {r}: {line}\n{shown}");
        lines.push(line.to_string());
    }
    lines
}

#[test]
fn srun_starts_a_job_with_no_ferrocomm_variable() {
    // 4 tasks on fewer CPUs than that need --overcommit: the cluster declares the real CPU count.
    let Some(lines) =
        run_job("srun", "srun", &["--overcommit", "-n", "4", "--time=5", "--kill-on-bad-exit=1"], "Slurm")
    else {
        return;
    };
    // The store is at the first host of the step's node list: this host, by name.
    let host = hostname();
    for line in &lines {
        assert!(line.contains(&format!("store={host}:")), "{line}");
    }
}

/// The sbatch script of docs/deployment.md: a batch job whose script runs the ranks with srun.
#[test]
fn sbatch_script_runs_its_ranks_with_srun() {
    if let Err(why) = bring_up() {
        loud(&format!("SKIPPED sbatch: {why}"));
        return;
    }
    let _one = ONE_JOB.lock().unwrap_or_else(|p| p.into_inner());
    let dir = std::env::temp_dir().join(format!("ferrocomm-sbatch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (script, output) = (dir.join("job.sbatch"), dir.join("job.out"));
    let me = std::env::current_exe().unwrap();
    std::fs::write(
        &script,
        format!(
            "#!/bin/bash\n\
             #SBATCH --job-name=ferrocomm-test\n\
             #SBATCH --ntasks={RANKS}\n\
             #SBATCH --overcommit\n\
             #SBATCH --time=5\n\
             #SBATCH --output={}\n\
             export FERROCOMM_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')\n\
             srun {} --exact rank_job --ignored --nocapture --test-threads=1\n",
            output.display(),
            me.display()
        ),
    )
    .unwrap();
    let start = Instant::now();
    let mut cmd = Command::new("sbatch");
    cmd.arg("--wait").arg(&script).stdin(Stdio::null());
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy();
        if k.starts_with("FERROCOMM_") {
            cmd.env_remove(&*k);
        }
    }
    let out = cmd.output().expect("sbatch runs");
    let took = start.elapsed();
    let job_output = std::fs::read_to_string(&output).unwrap_or_default();
    let shown = format!(
        "sbatch --wait: {} after {took:.1?}\n{}{}\n--- job output\n{job_output}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{shown}");
    reports("sbatch", &job_output, "Slurm", &shown);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = writeln!(std::io::stderr().lock(), "sbatch: {RANKS} ranks in a batch job in {took:.1?}");
}

#[test]
fn mpirun_starts_a_job_with_no_ferrocomm_variable() {
    run_job("mpirun", "mpirun.openmpi", &["--allow-run-as-root", "--oversubscribe", "-n", "4"], "Open MPI");
}

#[test]
fn mpirun_with_a_host_name_coordinator() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let coord = format!("FERROCOMM_COORD=localhost:{port}");
    let Some(lines) = run_job(
        "mpirun with a host-name coordinator",
        "mpirun.openmpi",
        &["--allow-run-as-root", "--oversubscribe", "-n", "4", "-x", &coord],
        "Open MPI",
    ) else {
        return;
    };
    for line in &lines {
        assert!(line.contains(&format!("store=localhost:{port};")), "{line}");
    }
}

#[test]
fn hydra_mpiexec_starts_a_job_with_no_ferrocomm_variable() {
    run_job("mpiexec.mpich", "mpiexec.mpich", &["-n", "4"], "MPICH Hydra");
}

/// Starts the ranks by hand, as a user does on several hosts: `vars(rank)` is each rank's
/// environment (nothing else of ferrocomm's is set). Checks every rank's report, as [`run_job`].
fn run_by_hand(test: &str, vars: impl Fn(u32) -> Vec<(String, String)>, expect_launcher: &str) {
    let _one = ONE_JOB.lock().unwrap_or_else(|p| p.into_inner());
    let me = std::env::current_exe().unwrap();
    let start = Instant::now();
    let children: Vec<_> = (0..RANKS)
        .map(|r| {
            let mut cmd = Command::new(&me);
            cmd.args(["--exact", "rank_job", "--ignored", "--nocapture", "--test-threads=1"]);
            for (k, _) in std::env::vars_os() {
                let k = k.to_string_lossy();
                if k.starts_with("FERROCOMM_") {
                    cmd.env_remove(&*k);
                }
            }
            cmd.envs(vars(r)).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            cmd.spawn().unwrap()
        })
        .collect();
    for (r, child) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let shown =
            format!("{}\n--- stdout\n{stdout}\n--- stderr\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{test}: rank {r}: {shown}");
        let line = stdout.split(&format!("FERROCOMM-RANK {r}/{RANKS} ")).nth(1).and_then(|l| l.lines().next());
        let line = line.unwrap_or_else(|| panic!("{test}: rank {r} did not report: {shown}"));
        assert!(line.contains(&format!("launcher={expect_launcher};")), "{test}: rank {r}: {line}");
        assert!(line.ends_with("ring=ok allreduce=ok barrier=ok"), "{test}: rank {r}: {line}");
    }
    let _ = writeln!(std::io::stderr().lock(), "{test}: {RANKS} ranks by hand in {:.1?}", start.elapsed());
}

fn pairs(list: &[(&str, String)]) -> Vec<(String, String)> {
    list.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

/// The variables a user sets on each host by hand: rank 0 hosts the store with nothing else said.
#[test]
fn plain_variables_by_hand_rank_0_hosts_the_store() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let token: String = (0..32).map(|i| format!("{:02x}", i * 7 + 1)).collect();
    run_by_hand(
        "plain variables by hand",
        |r| {
            pairs(&[
                ("FERROCOMM_RANK", r.to_string()),
                ("FERROCOMM_SIZE", RANKS.to_string()),
                ("FERROCOMM_COORD", format!("localhost:{port}")),
                ("FERROCOMM_TOKEN", token.clone()),
            ])
        },
        "explicit FERROCOMM_* variables",
    );
}

/// torchrun's variables, with MASTER_PORT held by another program (as torchrun's own store holds
/// it): rank 0 hosts the store on the next candidate port and the other ranks find it there.
#[test]
fn torchrun_variables_with_master_port_taken() {
    // Accepts connections (the kernel's backlog) and never answers: not this job's store.
    let stranger = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = stranger.local_addr().unwrap().port();
    run_by_hand(
        "torchrun variables, MASTER_PORT taken",
        |r| {
            pairs(&[
                ("RANK", r.to_string()),
                ("WORLD_SIZE", RANKS.to_string()),
                ("LOCAL_RANK", r.to_string()),
                ("LOCAL_WORLD_SIZE", RANKS.to_string()),
                ("MASTER_ADDR", "localhost".to_string()),
                ("MASTER_PORT", port.to_string()),
            ])
        },
        "torchrun",
    );
    drop(stranger);
}

fn hostname() -> String {
    let out = Command::new("hostname").arg("-s").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// One rank of the jobs above, started by the launcher (not on its own: it is ignored by
/// default, and does nothing outside a launcher).
#[test]
#[ignore = "a rank of the real-launcher tests, started by srun, mpirun or mpiexec"]
fn rank_job() {
    let job = match env::detect() {
        Err(EnvError::NotLaunched) => {
            eprintln!("rank_job runs under a launcher only (tests/real_launchers.rs starts it)");
            return;
        }
        other => other.expect("the launcher's variables"),
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let line = rt.block_on(async {
        let world = ferrocomm::init().await.expect("ferrocomm::init under the launcher");
        let line = work(&world).await;
        world.finalize().await.expect("finalize");
        line
    });
    let local = match (job.local_rank, job.local_size) {
        (Some(r), Some(s)) => format!("{r}/{s}"),
        _ => "unknown".to_string(),
    };
    println!(
        "FERROCOMM-RANK {}/{} launcher={}; local={local}; store={}; {line}",
        job.rank, job.size, job.launcher, job.coordinator
    );
}

/// The ring, the all-reduce and the barrier, each checked; panics on a wrong result.
async fn work(world: &World) -> String {
    let limit = Duration::from_secs(60);
    let (rank, size) = (world.rank(), world.size());
    assert_eq!(size, RANKS, "the job's size");

    // Ring: each rank sends its number to the next and checks what the previous one sent.
    let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
    let sent = world.send(next, 7, Bytes::from(format!("from rank {rank}")));
    let got = world.recv(prev, 7u64);
    let (sent, got) = tokio::join!(sent.timeout(limit), got.timeout(limit));
    sent.expect("ring send");
    let got = got.expect("ring receive");
    assert_eq!((got.source, &got.data[..]), (prev, format!("from rank {prev}").as_bytes()), "ring");

    // All-reduce against the sequential sum of what every rank contributes.
    let contribution = |r: u32, i: usize| (i as u64).wrapping_mul(u64::from(r) + 1) ^ u64::from(r);
    let mut v: Vec<u64> = (0..ELEMENTS).map(|i| contribution(rank, i)).collect();
    world.allreduce(&mut v, ReduceOp::Sum).timeout(limit).await.expect("allreduce");
    for (i, &x) in v.iter().enumerate() {
        let expect = (0..size).map(|r| contribution(r, i)).fold(0u64, u64::wrapping_add);
        assert_eq!(x, expect, "allreduce element {i}");
    }

    world.barrier().timeout(limit).await.expect("barrier");
    "ring=ok allreduce=ok barrier=ok".to_string()
}
