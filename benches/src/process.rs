//! Small helpers for the child processes the benchmark starts.

use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus};
use std::time::{Duration, Instant};

/// How often a deadline wait checks on its child.
const POLL: Duration = Duration::from_millis(5);

/// Waits for `child` until `deadline`; past it, kills the child (ours, by its handle) and fails
/// with `TimedOut`.
pub fn wait_until(child: &mut Child, deadline: Instant) -> io::Result<ExitStatus> {
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Err(io::Error::new(io::ErrorKind::TimedOut, "timed out"));
        }
        std::thread::sleep(POLL);
    }
}

/// The executable `name` in `PATH`, if any.
pub fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    p.metadata().is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// Whether some socket listens on TCP `port` (IPv4 or IPv6), read from `/proc/net/tcp*` so that
/// nothing connects to the listener. `None` when the tables cannot be read.
pub fn tcp_listening(port: u16) -> Option<bool> {
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
pub fn free_port() -> io::Result<u16> {
    Ok(std::net::TcpListener::bind(("127.0.0.1", 0))?.local_addr()?.port())
}
