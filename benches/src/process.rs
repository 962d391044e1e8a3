//! Small helpers for the child processes the benchmark starts.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// How often a deadline wait checks on its child: first after 1 ms, then ever less often, up to
/// this (a bench's children run for seconds; each check wakes a CPU that a rank may be spinning
/// on, which under software emulation costs that rank tens of microseconds).
const POLL: Duration = Duration::from_millis(100);

/// Waits for `child` until `deadline`; past it, kills the child (ours, by its handle) and fails
/// with `TimedOut`.
pub(crate) fn wait_until(child: &mut Child, deadline: Instant) -> io::Result<ExitStatus> {
    let mut poll = Duration::from_millis(1);
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        std::thread::sleep(poll.min(deadline.saturating_duration_since(Instant::now())));
        poll = (poll * 2).min(POLL);
    }
}

/// The executable `name` in `PATH`, if any.
pub(crate) fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether some socket listens on TCP `port` (IPv4 or IPv6), read from `/proc/net/tcp*` so that
/// nothing connects to the listener. `None` when the tables cannot be read.
pub(crate) fn tcp_listening(port: u16) -> Option<bool> {
    let mut readable = false;
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        readable = true;
        let wanted = format!(":{port:04X}");
        // Fields: sl local_address rem_address st ...; state 0A is LISTEN.
        let found = text.lines().skip(1).any(|line| {
            let mut f = line.split_whitespace().skip(1);
            let (Some(local), Some(_), Some(state)) = (f.next(), f.next(), f.next()) else { return false };
            local.ends_with(&wanted) && state == "0A"
        });
        if found {
            return Some(true);
        }
    }
    readable.then_some(false)
}

/// A TCP port that was free a moment ago.
pub(crate) fn free_port() -> io::Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}

/// Watches the benchmark's CPUs for work that is not the benchmark's: CPU time used on them
/// (user, system, and time stolen by the hypervisor, from `/proc/stat`) minus the CPU time of
/// this process and its waited-for children (`getrusage`). Interrupt time is left out, since the
/// benchmark's own network traffic is partly accounted there.
pub(crate) struct Interference {
    cpus: Vec<usize>,
    busy: f64,
    ours: f64,
    since: Instant,
}

impl Interference {
    /// Starts watching `cpus`; `None` when `/proc/stat` cannot be read.
    pub(crate) fn start(cpus: &[usize]) -> Option<Interference> {
        let mut cpus = cpus.to_vec();
        cpus.sort_unstable();
        cpus.dedup();
        Some(Interference { busy: busy_seconds(&cpus)?, ours: our_cpu_seconds(), since: Instant::now(), cpus })
    }

    /// The share (0 to 1) of the CPUs' time that other work used since [`Interference::start`].
    pub(crate) fn share(&self) -> Option<f64> {
        let busy = busy_seconds(&self.cpus)? - self.busy;
        let ours = our_cpu_seconds() - self.ours;
        let capacity = self.since.elapsed().as_secs_f64() * self.cpus.len() as f64;
        Some(((busy - ours) / capacity).clamp(0.0, 1.0))
    }
}

/// User, system and steal time of `cpus` since boot, seconds.
fn busy_seconds(cpus: &[usize]) -> Option<f64> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    // SAFETY: sysconf has no memory-safety preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let ticks = if ticks > 0 { ticks as f64 } else { 100.0 };
    let mut jiffies = 0u64;
    let mut found = 0;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("cpu") else { continue };
        let mut f = rest.split_whitespace();
        let Some(Ok(n)) = f.next().map(str::parse::<usize>) else { continue };
        if !cpus.contains(&n) {
            continue;
        }
        // user nice system idle iowait irq softirq steal (guest time is already in user).
        let v: Vec<u64> = f.take(8).map(|x| x.parse().unwrap_or(0)).collect();
        if v.len() < 8 {
            return None;
        }
        jiffies += v[0] + v[1] + v[2] + v[7];
        found += 1;
    }
    (found == cpus.len()).then(|| jiffies as f64 / ticks)
}

/// CPU time of this process and of its children that have been waited for, seconds.
pub(crate) fn our_cpu_seconds() -> f64 {
    let usage = |who| {
        // SAFETY: all-zero is a valid rusage, and getrusage writes only into it.
        let mut u: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: `u` is a valid, writable rusage.
        if unsafe { libc::getrusage(who, &mut u) } != 0 {
            return 0.0;
        }
        let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
        secs(u.ru_utime) + secs(u.ru_stime)
    };
    usage(libc::RUSAGE_SELF) + usage(libc::RUSAGE_CHILDREN)
}

/// Runs `cmd` with its standard output piped until it exits or `timeout` passes; returns its exit
/// status and its output lines (standard error is inherited).
pub(crate) fn run_lines(mut cmd: std::process::Command, timeout: Duration) -> io::Result<(ExitStatus, Vec<String>)> {
    use std::io::BufRead;
    let mut child = cmd.stdin(std::process::Stdio::null()).stdout(std::process::Stdio::piped()).spawn()?;
    let out = child.stdout.take().ok_or_else(|| io::Error::other("the child's output is not piped"))?;
    let reader = std::thread::spawn(move || io::BufReader::new(out).lines().map_while(|l| l.ok()).collect::<Vec<_>>());
    let status = wait_until(&mut child, Instant::now() + timeout)?;
    let lines = reader.join().map_err(|_| io::Error::other("the output reader panicked"))?;
    Ok((status, lines))
}

/// Runs `args` (the program, then its arguments); an error with its stderr when it fails.
pub(crate) fn sh(args: &[&str]) -> crate::Result<()> {
    let out = std::process::Command::new(args[0]).args(&args[1..]).output()?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()).into())
    }
}
