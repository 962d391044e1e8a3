//! The peer side of `pingpong`: NetPIPE's `NPtcp` over TCP on 127.0.0.1.
//!
//! For each size `n` a receiver (`NPtcp -P port -l n -u n -p 0`) and a transmitter (the same with
//! `-h 127.0.0.1 -o FILE`) run pinned with `taskset -c` to the CPUs of ferrocomm's ranks 1 and 0.
//! The transmitter writes one line to `FILE`: `bytes`, throughput in NetPIPE's Mbps (2^20 bits per
//! second), and the one-way time in seconds (round trip / 2); only the first and last are used.
//! Running NPtcp once per size measures exactly ferrocomm's sizes; NPtcp chooses its own
//! repetitions and reports the best of its trials.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Result, process};

/// How long the receiver gets to start listening.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one size may take (NPtcp stops on its own after transfers of over a second).
const SIZE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the receiver gets to exit once the transmitter is done.
const EXIT_TIMEOUT: Duration = Duration::from_secs(5);

/// What to tell a user without NPtcp.
pub const INSTALL_HINT: &str = "NPtcp (NetPIPE's TCP module) is not installed or not in PATH; \
     install it with `apt-get install netpipe-tcp`, or pass --no-peer to measure ferrocomm alone";

/// The NPtcp and taskset executables.
pub struct NetPipe {
    nptcp: PathBuf,
    taskset: PathBuf,
    /// Scratch directory for output files; removed on drop.
    scratch: PathBuf,
}

impl NetPipe {
    /// Finds `NPtcp` and `taskset` in `PATH`.
    pub fn find() -> Result<NetPipe> {
        let nptcp = process::find_in_path("NPtcp").ok_or(INSTALL_HINT)?;
        let taskset = process::find_in_path("taskset")
            .ok_or("taskset is not installed or not in PATH (it comes with util-linux); it pins NPtcp to CPUs")?;
        let scratch = std::env::temp_dir().join(format!("ferrocomm-bench-{}", std::process::id()));
        std::fs::create_dir_all(&scratch)?;
        Ok(NetPipe { nptcp, taskset, scratch })
    }

    /// The two commands run for size `bytes`, for the record (`PORT` and `FILE` vary).
    pub fn describe(&self, cpus: [usize; 2], bytes: &str) -> String {
        let common = format!("-P PORT -l {bytes} -u {bytes} -p 0");
        format!(
            "taskset -c {} NPtcp {common} -o /dev/null & taskset -c {} NPtcp -h 127.0.0.1 {common} -o FILE",
            cpus[1], cpus[0]
        )
    }

    /// One NPtcp measurement of `bytes`: the one-way time in seconds.
    pub fn measure(&self, bytes: usize, cpus: [usize; 2]) -> Result<f64> {
        let port = process::free_port()?;
        let n = bytes.to_string();
        let common = ["-P", &port.to_string(), "-l", &n, "-u", &n, "-p", "0"].map(String::from);
        let pinned = |cpu: usize| {
            let mut c = Command::new(&self.taskset);
            c.arg("-c").arg(cpu.to_string()).arg(&self.nptcp).args(&common).current_dir(&self.scratch);
            c.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
            c
        };

        let mut receiver = pinned(cpus[1]).args(["-o", "/dev/null"]).spawn()?;
        let started = Instant::now();
        loop {
            match process::tcp_listening(port) {
                Some(true) => break,
                // No /proc: give the receiver a moment instead.
                None if started.elapsed() > Duration::from_millis(200) => break,
                _ => {}
            }
            if let Some(status) = receiver.try_wait()? {
                return Err(format!("the NPtcp receiver exited before listening ({status})").into());
            }
            if started.elapsed() > LISTEN_TIMEOUT {
                let _ = receiver.kill();
                let _ = receiver.wait();
                return Err(
                    format!("the NPtcp receiver did not listen on port {port} within {LISTEN_TIMEOUT:?}").into()
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }

        let file = self.scratch.join(format!("np-{bytes}.out"));
        let mut transmitter = pinned(cpus[0]).args(["-h", "127.0.0.1", "-o"]).arg(&file).spawn()?;
        let status = process::wait_until(&mut transmitter, Instant::now() + SIZE_TIMEOUT);
        let _ = process::wait_until(&mut receiver, Instant::now() + EXIT_TIMEOUT);
        let status = status.map_err(|e| format!("NPtcp at {bytes} bytes: {e}"))?;
        if !status.success() {
            return Err(format!("the NPtcp transmitter failed at {bytes} bytes ({status})").into());
        }
        let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let _ = std::fs::remove_file(&file);
        parse_output(&text)
            .into_iter()
            .find(|&(b, _)| b == bytes)
            .map(|(_, t)| t)
            .ok_or_else(|| format!("NPtcp's output has no line for {bytes} bytes: {text:?}").into())
    }
}

impl Drop for NetPipe {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

/// The `(bytes, one-way seconds)` pairs of an NPtcp output file; malformed lines are skipped.
pub fn parse_output(text: &str) -> Vec<(usize, f64)> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f[..] {
                [bytes, _mbps, seconds, ..] => Some((bytes.parse().ok()?, seconds.parse().ok()?)),
                _ => None,
            }
        })
        .filter(|&(_, t): &(usize, f64)| t > 0.0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_nptcp_output() {
        let text = "       1 0.247594   0.00003081\n 8388608 28119.265552   0.00227602\n\ngarbage\n";
        assert_eq!(parse_output(text), vec![(1, 0.00003081), (8388608, 0.00227602)]);
    }
}
