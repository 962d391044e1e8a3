//! End-to-end tests of `ferrorun`: output forwarding, failure propagation,
//! clean-up of every process of a job, and the bootstrap path a real rank
//! takes (environment detection and address exchange through the store).

use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use ferrocomm::bootstrap::{env, kv::KvClient};

const FERRORUN: &str = env!("CARGO_BIN_EXE_ferrorun");

fn ferrorun(args: &[&str]) -> Command {
    let mut c = Command::new(FERRORUN);
    c.args(args).stdin(Stdio::null());
    c
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// A `sleep` duration unique to this test process and call, so that the
/// sleepers of one test can be found in /proc.
fn unique_sleep() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!("30.{}{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed))
}

/// Pids of live `sleep DURATION` processes.
fn sleepers(duration: &str) -> Vec<u32> {
    let mut found = Vec::new();
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return found;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let argv: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
        let is_sleep = argv.first().is_some_and(|a| a.ends_with(b"sleep"));
        if is_sleep && argv.get(1) == Some(&duration.as_bytes()) {
            found.push(pid);
        }
    }
    found
}

fn wait_for_sleepers(duration: &str, count: usize) {
    let start = Instant::now();
    while sleepers(duration).len() < count {
        assert!(start.elapsed() < Duration::from_secs(60), "ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_no_sleepers(duration: &str) {
    let start = Instant::now();
    while !sleepers(duration).is_empty() {
        assert!(start.elapsed() < Duration::from_secs(30), "sleepers left behind: {:?}", sleepers(duration));
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_with_deadline(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("ferrorun did not exit within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn output_is_prefixed_and_success_is_zero() {
    let out =
        ferrorun(&["-n", "3", "sh", "-c", "echo hi $FERROCOMM_RANK; echo err $FERROCOMM_RANK >&2"]).output().unwrap();
    let stdout = text(&out.stdout);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{:?}\n{stdout}\n{stderr}", out.status);
    let mut lines: Vec<&str> = stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["[0] hi 0", "[1] hi 1", "[2] hi 2"]);
    let mut err_lines: Vec<&str> = stderr.lines().collect();
    err_lines.sort();
    assert_eq!(err_lines, ["[0] err 0", "[1] err 1", "[2] err 2"]);
}

#[test]
fn ranks_get_the_job_variables() {
    let out = ferrorun(&[
        "-n",
        "2",
        "--env",
        "EXTRA=yes",
        "sh",
        "-c",
        "echo $FERROCOMM_SIZE $FERROCOMM_LAUNCHER $EXTRA ${#FERROCOMM_TOKEN} $FERROCOMM_COORD",
    ])
    .output()
    .unwrap();
    assert!(out.status.success());
    let stdout = text(&out.stdout);
    let tokens: Vec<&str> = stdout.lines().map(|l| l.split_once("] ").unwrap().1).collect();
    assert_eq!(tokens.len(), 2);
    assert_eq!(tokens[0], tokens[1], "ranks disagree: {stdout}");
    let fields: Vec<&str> = tokens[0].split(' ').collect();
    assert_eq!(fields[..4], ["2", "ferrorun", "yes", "64"]);
    assert!(fields[4].starts_with("127.0.0.1:"), "{stdout}");
}

#[test]
fn a_failed_rank_stops_the_job() {
    let sleep = unique_sleep();
    let script = format!("if [ $FERROCOMM_RANK = 1 ]; then exit 3; fi; sleep {sleep}");
    let start = Instant::now();
    let out: Output = ferrorun(&["-n", "3", "sh", "-c", &script]).output().unwrap();
    let elapsed = start.elapsed();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(elapsed < Duration::from_secs(15), "took {elapsed:?}");
    assert!(stderr.contains("ferrorun: rank 1 exited with code 3; stopping the job"), "{stderr}");
    wait_no_sleepers(&sleep);
}

#[test]
fn a_rank_killed_by_a_signal_gives_128_plus_signal() {
    let out = ferrorun(&[
        "-n",
        "2",
        "--grace",
        "0.2",
        "sh",
        "-c",
        "if [ $FERROCOMM_RANK = 0 ]; then kill -9 $$; fi; sleep 20",
    ])
    .output()
    .unwrap();
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 9), "{stderr}");
    assert!(stderr.contains("rank 0 exited with signal 9"), "{stderr}");
}

#[test]
fn sigterm_kills_the_job() {
    let sleep = unique_sleep();
    let mut child = ferrorun(&["-n", "2", "sh", "-c", &format!("sleep {sleep}; true")])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_sleepers(&sleep, 2);
    // SAFETY: kill(2) has no memory-safety preconditions.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
    let status = wait_with_deadline(&mut child, Duration::from_secs(10));
    assert_eq!(status.code(), Some(128 + libc::SIGTERM));
    wait_no_sleepers(&sleep);
}

#[test]
fn ranks_die_with_a_killed_launcher() {
    let sleep = unique_sleep();
    let mut child =
        ferrorun(&["-n", "2", "sleep", &sleep]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    wait_for_sleepers(&sleep, 2);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    wait_no_sleepers(&sleep);
}

#[test]
fn bad_arguments_print_usage() {
    for args in [&[][..], &["-n", "0", "true"], &["sh"], &["-n", "2", "--what", "true"]] {
        let out = ferrorun(args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(text(&out.stderr).contains("Usage: ferrorun [OPTIONS] -n <N> <PROGRAM>"), "{args:?}");
    }
    let out = ferrorun(&["-n", "1", "/nonexistent/ferrocomm-nothing"]).output().unwrap();
    assert_eq!(out.status.code(), Some(127));
    assert!(text(&out.stderr).contains("cannot start rank 0"));
}

/// Each rank of `ranks_exchange_addresses`: run by ferrorun, not directly.
#[test]
fn rank_child() {
    if std::env::var_os("FERROCOMM_TEST_CHILD").is_none() {
        return;
    }
    let job = env::detect().unwrap();
    assert_eq!(job.launcher, env::Launcher::Ferrorun);
    assert!(!job.host_store);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let t = Duration::from_secs(10);
        let mut kv = KvClient::connect(&job.coordinator, &job.token, t).await.unwrap();
        kv.put(&format!("addr/{}", job.rank), format!("address-of-{}", job.rank).as_bytes()).await.unwrap();
        for r in 0..job.size {
            let v = kv.get(&format!("addr/{r}"), t).await.unwrap();
            assert_eq!(v, format!("address-of-{r}").into_bytes());
        }
    });
    println!("rank {} of {} saw every peer", job.rank, job.size);
}

#[test]
fn ranks_exchange_addresses() {
    let me = std::env::current_exe().unwrap();
    let out = ferrorun(&[
        "-n",
        "4",
        "--env",
        "FERROCOMM_TEST_CHILD=1",
        me.to_str().unwrap(),
        "--exact",
        "rank_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .output()
    .unwrap();
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", text(&out.stderr));
    for r in 0..4 {
        // The test harness prints "test rank_child ... " before the line.
        let (prefix, said) = (format!("[{r}] "), format!("rank {r} of 4 saw every peer"));
        assert!(stdout.lines().any(|l| l.starts_with(&prefix) && l.ends_with(&said)), "missing {said:?} in\n{stdout}");
    }
}
