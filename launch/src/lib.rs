//! `ferrorun`, the local launcher of ferrocomm jobs: start N ranks of a program on this machine.
//!
//! This is a library ([`run_local`]) so that both the `ferrorun` binary and
//! examples, tests or benchmarks can start a job without an MPI installation. It plays
//! the part `mpirun` plays elsewhere:
//!
//! * it runs the job's key-value store ([`KvServer`]) on `127.0.0.1` (or
//!   [`LaunchOptions::store_addr`]), with a
//!   fresh random token, and tells every rank where it is through
//!   `FERROCOMM_RANK`, `FERROCOMM_SIZE`, `FERROCOMM_COORD`, `FERROCOMM_TOKEN`
//!   and `FERROCOMM_LAUNCHER=ferrorun` (read back by
//!   `ferrocomm::bootstrap::env::detect`);
//! * it forwards each rank's output line by line with a `[rank] ` prefix,
//!   stdout to stdout and stderr to stderr;
//! * it turns one rank's failure into the job's failure: it tells the other
//!   ranks which rank ended (through the store, see
//!   `bootstrap/notices.rs`; they fail what needs it at once, even
//!   during their bootstrap), gives them [`LaunchOptions::grace`] to exit on
//!   their own, then kills them; the job's exit code is the failed rank's;
//! * it leaves no processes behind: each rank runs in its own process group,
//!   which is killed as a whole (so a rank's own children go too), and each
//!   rank gets `PR_SET_PDEATHSIG=SIGKILL` on Linux so it dies with the
//!   launcher even when the launcher is killed with `-9`. (A rank's own
//!   children are beyond that last reach: the kernel does not pass the
//!   setting on through `fork`.)
//!
//! Ranks get no standard input (`/dev/null`): they run in process groups of
//! their own, which may not read the terminal.

use std::ffi::OsString;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWriteExt, BufReader};
use tokio::process::Command;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio::time::{Instant, sleep_until, timeout};

use ferrocomm::bootstrap::env::{MAX_SIZE, to_hex};
use ferrocomm::bootstrap::kv::KvServer;

/// A forwarded line longer than this is passed on in pieces.
const MAX_LINE: usize = 64 * 1024;
/// How long output may keep flowing after every rank has exited.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// How [`run_local`] runs a job.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// How long the other ranks get to exit on their own after one rank
    /// failed, before they are killed.
    pub grace: Duration,
    /// Extra environment variables for every rank. They cannot override the
    /// `FERROCOMM_*` variables the launcher sets.
    pub env: Vec<(String, String)>,
    /// The address the job's store listens on (`127.0.0.1` by default). Ranks that a wrapper
    /// places on other hosts (network namespaces, containers) reach the store there.
    pub store_addr: IpAddr,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions { grace: Duration::from_secs(3), env: Vec::new(), store_addr: IpAddr::V4(Ipv4Addr::LOCALHOST) }
    }
}

/// Makes a program its own launcher. Outside a job (no `FERROCOMM_RANK` in the environment) it
/// runs `ranks` copies of this executable with the same arguments ([`run_local`]) and exits the
/// process with the job's code; inside a job it returns at once and the program goes on as its
/// rank. The examples start this way: `cargo run --example NAME` is a whole local job.
pub fn launch_self(ranks: u32) -> io::Result<()> {
    if std::env::var_os("FERROCOMM_RANK").is_some() {
        return Ok(());
    }
    let exe = std::env::current_exe()?;
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let code = run_local(ranks, &exe, &args, &LaunchOptions::default())?;
    std::process::exit(code)
}

/// Runs `n` ranks of `program args...` on this machine and waits for them.
///
/// Returns 0 when every rank exits with 0. When a rank fails, returns its
/// exit code, or 128 + the signal that killed it. When the launcher itself
/// gets SIGINT or SIGTERM, kills the ranks and returns 128 + that signal.
/// An `Err` means the job could not be started at all (for example
/// `program` does not exist); ranks already started are killed then.
///
/// Builds its own single-threaded tokio runtime, so it must not be called
/// from inside one. It installs tokio's SIGINT and SIGTERM handlers, which
/// stay installed for the rest of the process.
pub fn run_local(n: u32, program: &Path, args: &[OsString], opts: &LaunchOptions) -> io::Result<i32> {
    if n == 0 || n > MAX_SIZE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("the number of ranks must be in 1..={MAX_SIZE}, not {n}"),
        ));
    }
    // Single-threaded on purpose: PR_SET_PDEATHSIG fires when the *thread*
    // that forked a child exits, so every child is forked from this thread,
    // which lives until the job is over.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(run_job(n, program, args, opts))
}

/// One started rank.
struct Rank {
    /// Its pid, which is also its process group id.
    pid: i32,
    /// Whether it has been reaped.
    exited: bool,
    /// Tasks forwarding its stdout and stderr.
    forwarders: Vec<JoinHandle<()>>,
}

impl Rank {
    /// Kills the rank's process group while that group certainly is ours:
    /// the rank has not been reaped (so its pid is not free for reuse), or
    /// its output pipes are still open (so someone in the group lives).
    fn kill_group(&self) {
        let pipes_open = self.forwarders.iter().any(|f| !f.is_finished());
        if self.pid > 0 && (!self.exited || pipes_open) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe {
                libc::kill(-self.pid, libc::SIGKILL);
            }
        }
    }
}

async fn run_job(n: u32, program: &Path, args: &[OsString], opts: &LaunchOptions) -> io::Result<i32> {
    let mut token = [0u8; 32];
    getrandom::fill(&mut token).map_err(|e| io::Error::other(format!("cannot generate the job token: {e}")))?;
    let store = KvServer::start(SocketAddr::new(opts.store_addr, 0), token).await?;
    let coord = store.addr().to_string();
    let token_hex = to_hex(&token);

    // Signals first, so that an interrupt during start-up is not lost.
    let mut sigint = signal(SignalKind::interrupt())?;
    let mut sigterm = signal(SignalKind::terminate())?;

    let (out_tx, out_writer) = writer(tokio::io::stdout());
    let (err_tx, err_writer) = writer(tokio::io::stderr());

    let mut ranks: Vec<Rank> = Vec::with_capacity(n as usize);
    let mut waits: JoinSet<(u32, io::Result<ExitStatus>)> = JoinSet::new();
    for r in 0..n {
        let mut cmd = Command::new(program);
        cmd.args(args)
            .envs(opts.env.iter().map(|(k, v)| (k, v)))
            .env("FERROCOMM_RANK", r.to_string())
            .env("FERROCOMM_SIZE", n.to_string())
            .env("FERROCOMM_COORD", &coord)
            .env("FERROCOMM_TOKEN", &token_hex)
            .env("FERROCOMM_LAUNCHER", "ferrorun")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .process_group(0);
        set_parent_death_signal(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                for rank in &ranks {
                    rank.kill_group();
                }
                return Err(io::Error::new(e.kind(), format!("cannot start rank {r} ({}): {e}", program.display())));
            }
        };
        let pid = child.id().map_or(0, |p| p as i32);
        let mut forwarders = Vec::with_capacity(2);
        if let Some(out) = child.stdout.take() {
            forwarders.push(tokio::spawn(forward(out, r, out_tx.clone())));
        }
        if let Some(err) = child.stderr.take() {
            forwarders.push(tokio::spawn(forward(err, r, err_tx.clone())));
        }
        waits.spawn(async move { (r, child.wait().await) });
        ranks.push(Rank { pid, exited: false, forwarders });
    }

    let say = |msg: String| {
        let tx = err_tx.clone();
        async move {
            let _ = tx.send(format!("ferrorun: {msg}\n").into_bytes()).await;
        }
    };

    let mut result: Option<i32> = None;
    let mut kill_at: Option<Instant> = None;
    let mut killed = false;
    let mut running = n;
    while running > 0 {
        tokio::select! {
            joined = waits.join_next() => {
                let Some(joined) = joined else { break };
                let (r, status) = match joined {
                    Ok(done) => done,
                    // The wait task cannot panic; treat it as lost.
                    Err(e) => {
                        say(format!("lost track of a rank: {e}")).await;
                        running -= 1;
                        continue;
                    }
                };
                running -= 1;
                ranks[r as usize].exited = true;
                let (code, what) = match &status {
                    Ok(s) => describe(s),
                    Err(e) => (1, format!("an error while waiting for it ({e})")),
                };
                if code == 0 || killed {
                    continue;
                }
                if result.is_none() {
                    result = Some(code);
                    // A rank that said goodbye first (finalize) and then failed is no loss to the
                    // others: they ignore the report then.
                    store.report_dead(r, &format!("exited with {what}"));
                    say(format!("rank {r} exited with {what}; stopping the job")).await;
                    kill_at = Some(Instant::now() + opts.grace);
                } else {
                    say(format!("rank {r} exited with {what}")).await;
                }
            }
            _ = sleep_until(kill_at.unwrap_or_else(Instant::now)), if kill_at.is_some() => {
                kill_at = None;
                killed = true;
                if running > 0 {
                    say(format!("killing the {running} rank(s) still running")).await;
                }
                for rank in &ranks {
                    rank.kill_group();
                }
            }
            Some(()) = sigint.recv() => {
                interrupted(&ranks, &mut result, &mut killed, libc::SIGINT, "SIGINT", &say).await;
            }
            Some(()) = sigterm.recv() => {
                interrupted(&ranks, &mut result, &mut killed, libc::SIGTERM, "SIGTERM", &say).await;
            }
        }
    }

    // Every rank has exited; take down what its children left behind so
    // the output pipes close, and pass on what is left of the output.
    for rank in &ranks {
        rank.kill_group();
    }
    // Shared-memory files of ranks that died before every peer mapped them (the job's files are
    // named by a value derived from its token).
    #[cfg(target_os = "linux")]
    match ferrocomm_transports::shm::remove_leftovers(&ferrocomm_transports::auth::JobSecret::new(token).shm_name()) {
        Ok(0) => {}
        Ok(k) => say(format!("removed {k} shared-memory file(s) left by the job")).await,
        Err(e) => say(format!("could not look for shared-memory files left by the job: {e}")).await,
    }
    let drain_deadline = Instant::now() + DRAIN_TIMEOUT;
    for rank in &mut ranks {
        for f in rank.forwarders.drain(..) {
            let abort = f.abort_handle();
            if timeout(drain_deadline.saturating_duration_since(Instant::now()), f).await.is_err() {
                abort.abort();
            }
        }
    }
    drop(out_tx);
    drop(err_tx);
    let _ = out_writer.await;
    let _ = err_writer.await;
    drop(store);
    Ok(result.unwrap_or(0))
}

async fn interrupted<F, Fut>(
    ranks: &[Rank],
    result: &mut Option<i32>,
    killed: &mut bool,
    signo: i32,
    name: &str,
    say: &F,
) where
    F: Fn(String) -> Fut,
    Fut: Future<Output = ()>,
{
    if !*killed {
        say(format!("got {name}; killing the job")).await;
    }
    *killed = true;
    if result.is_none() {
        *result = Some(128 + signo);
    }
    for rank in ranks {
        rank.kill_group();
    }
}

/// The exit code to report for `status`, and a description of it.
fn describe(status: &ExitStatus) -> (i32, String) {
    if let Some(code) = status.code() {
        (code, format!("code {code}"))
    } else if let Some(sig) = status.signal() {
        (128 + sig, format!("signal {sig} ({})", signal_name(sig)))
    } else {
        (1, format!("{status}"))
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "unknown",
    }
}

#[cfg(target_os = "linux")]
fn set_parent_death_signal(cmd: &mut Command) {
    // SAFETY: getpid is async-signal-safe and has no preconditions.
    let parent = unsafe { libc::getpid() };
    // SAFETY: the closure runs between fork and exec and calls only
    // async-signal-safe functions (prctl, getppid) without allocating.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) != 0 {
                return Err(io::Error::last_os_error());
            }
            // The launcher died before the setting took effect.
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn set_parent_death_signal(_cmd: &mut Command) {}

/// A task that writes whole chunks to `out` one at a time, so that lines
/// from different ranks never interleave.
fn writer<W>(mut out: W) -> (mpsc::Sender<Vec<u8>>, JoinHandle<()>)
where
    W: tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (tx, mut rx) = mpsc::channel::<Vec<u8>>(256);
    let task = tokio::spawn(async move {
        let mut ok = true;
        while let Some(chunk) = rx.recv().await {
            // After a write error (say, `ferrorun ... | head`) keep reading,
            // so that ranks never block on a full pipe.
            if ok {
                ok = out.write_all(&chunk).await.is_ok() && out.flush().await.is_ok();
            }
        }
    });
    (tx, task)
}

/// Passes `input` on to `tx` line by line, each line prefixed with
/// `[rank] `. A last line without a newline gets one.
async fn forward<R: AsyncRead + Unpin>(input: R, rank: u32, tx: mpsc::Sender<Vec<u8>>) {
    let prefix = format!("[{rank}] ");
    let mut input = BufReader::new(input);
    let mut line: Vec<u8> = Vec::new();
    // A read error ends the stream like end-of-file does.
    while let Ok(available) = input.fill_buf().await {
        if available.is_empty() {
            break;
        }
        let room = MAX_LINE - line.len();
        let (take, complete) = match available.iter().take(room).position(|&b| b == b'\n') {
            Some(i) => (i + 1, true),
            None => {
                let t = available.len().min(room);
                (t, line.len() + t >= MAX_LINE)
            }
        };
        line.extend_from_slice(&available[..take]);
        input.consume(take);
        if complete {
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            if send_line(&tx, &prefix, &mut line).await.is_err() {
                return;
            }
        }
    }
    if !line.is_empty() {
        line.push(b'\n');
        let _ = send_line(&tx, &prefix, &mut line).await;
    }
}

async fn send_line(
    tx: &mpsc::Sender<Vec<u8>>,
    prefix: &str,
    line: &mut Vec<u8>,
) -> Result<(), mpsc::error::SendError<Vec<u8>>> {
    let mut chunk = Vec::with_capacity(prefix.len() + line.len());
    chunk.extend_from_slice(prefix.as_bytes());
    chunk.append(line);
    tx.send(chunk).await
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn forwarded(input: &[u8]) -> Vec<Vec<u8>> {
        let (tx, mut rx) = mpsc::channel(1024);
        forward(input, 4, tx).await;
        let mut out = Vec::new();
        while let Some(c) = rx.recv().await {
            out.push(c);
        }
        out
    }

    #[tokio::test]
    async fn lines_get_prefixes() {
        let out = forwarded(b"a\nbc\n\nlast").await;
        assert_eq!(out, vec![b"[4] a\n".to_vec(), b"[4] bc\n".to_vec(), b"[4] \n".to_vec(), b"[4] last\n".to_vec()]);
        assert!(forwarded(b"").await.is_empty());
    }

    #[tokio::test]
    async fn long_lines_are_split() {
        let mut input = vec![b'x'; MAX_LINE * 2 + 10];
        input.push(b'\n');
        let out = forwarded(&input).await;
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].len(), 4 + MAX_LINE + 1);
        assert!(out.iter().all(|c| c.starts_with(b"[4] ") && c.ends_with(b"\n")));
        let total: usize = out.iter().map(|c| c.len() - 5).sum();
        assert_eq!(total, MAX_LINE * 2 + 10);
    }

    #[test]
    fn exit_descriptions() {
        let (code, what) = describe(&ExitStatus::from_raw(3 << 8));
        assert_eq!((code, what.as_str()), (3, "code 3"));
        let (code, what) = describe(&ExitStatus::from_raw(libc::SIGKILL));
        assert_eq!(code, 128 + 9);
        assert!(what.contains("SIGKILL"));
    }

    #[test]
    fn zero_ranks_is_an_error() {
        let r = run_local(0, Path::new("true"), &[], &LaunchOptions::default());
        assert_eq!(r.unwrap_err().kind(), io::ErrorKind::InvalidInput);
    }

    #[test]
    fn missing_program_is_an_error() {
        let r = run_local(2, Path::new("/nonexistent/ferrocomm-no-such-program"), &[], &LaunchOptions::default());
        let e = r.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
        assert!(e.to_string().contains("cannot start rank 0"), "{e}");
    }
}
