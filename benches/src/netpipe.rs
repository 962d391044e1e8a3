//! The peer side of `pingpong`: NetPIPE, over TCP (`NPtcp`, and `NPopenmpi` restricted to Open
//! MPI's TCP BTL) or over MPI's shared memory (`NPopenmpi`, `NPmpich2`).
//!
//! Every peer runs once per size (`-l n -u n -p 0`), so that it measures exactly the sizes
//! ferrocomm does; NetPIPE chooses its own repetitions and reports the best of its trials. Both
//! sides are pinned with `taskset -c` to the CPUs of ferrocomm's ranks 0 and 1:
//!
//! * `NPtcp`: a receiver (`NPtcp -P port ...`) and a transmitter (`-h 127.0.0.1 -o FILE`) on
//!   127.0.0.1;
//! * MPI: `mpirun -np 1 taskset -c A NP... : -np 1 taskset -c B NP...` with the MPI's own launcher
//!   (`mpirun.openmpi`, `mpirun.mpich`) and its binding switched off, so that `taskset` alone
//!   decides (Open MPI does not bind when oversubscribing, and binds in its own order otherwise).
//!   Two ranks of one host talk through the MPI's shared-memory transport (Open MPI's vader with
//!   its single-copy mechanism, MPICH's nemesis), as installed;
//! * `NPopenmpi-tcp`: `NPopenmpi` as above with `--mca pml ob1 --mca btl tcp,self --mca
//!   btl_tcp_if_include lo`, so that its two ranks talk through Open MPI's TCP BTL on the
//!   loopback interface: a TCP peer that busy-polls, as ferrocomm does, where `NPtcp` sleeps in
//!   `read`.
//!
//! The transmitter writes one line to `FILE`: `bytes`, throughput in NetPIPE's Mbps (2^20 bits per
//! second) and the one-way time in seconds (round trip / 2). The time is recomputed from the
//! throughput, which NetPIPE prints with more digits (the seconds column has a resolution of
//! 10 ns, a tenth of a shared-memory latency).

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::{Result, process};

/// How long the receiver gets to start listening.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one size may take (NetPIPE stops on its own after transfers of over a second).
const SIZE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long the receiver gets to exit once the transmitter is done.
const EXIT_TIMEOUT: Duration = Duration::from_secs(5);

/// Which NetPIPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flavour {
    Tcp,
    /// Open MPI over its TCP BTL on 127.0.0.1.
    OpenMpiTcp,
    OpenMpi,
    Mpich,
}

impl Flavour {
    /// The flavour called `name` (its [`Flavour::name`]).
    pub(crate) fn named(name: &str) -> Option<Flavour> {
        [Flavour::Tcp, Flavour::OpenMpiTcp, Flavour::OpenMpi, Flavour::Mpich].into_iter().find(|f| f.name() == name)
    }

    /// The name in reports: the executable's, with `-tcp` for Open MPI's TCP BTL.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Flavour::OpenMpiTcp => "NPopenmpi-tcp",
            _ => self.programs().0,
        }
    }

    /// NetPIPE's executable, the launcher (MPI only) and how to install them.
    fn programs(self) -> (&'static str, Option<&'static str>, &'static str) {
        match self {
            Flavour::Tcp => ("NPtcp", None, "apt-get install netpipe-tcp"),
            Flavour::OpenMpi | Flavour::OpenMpiTcp => {
                ("NPopenmpi", Some("mpirun.openmpi"), "apt-get install netpipe-openmpi openmpi-bin")
            }
            Flavour::Mpich => ("NPmpich2", Some("mpirun.mpich"), "apt-get install netpipe-mpich2 mpich"),
        }
    }
}

/// A NetPIPE peer and the tools to run it.
pub(crate) struct NetPipe {
    flavour: Flavour,
    np: PathBuf,
    mpirun: Option<PathBuf>,
    taskset: PathBuf,
    /// Scratch directory for output files; removed on drop.
    scratch: PathBuf,
}

impl NetPipe {
    /// Finds the programs of `flavour` and `taskset` in `PATH`.
    pub(crate) fn find(flavour: Flavour) -> Result<NetPipe> {
        let (np, launcher, install) = flavour.programs();
        let missing = |what: &str| {
            format!(
                "{what} is not installed or not in PATH; install it with `{install}`, or pass --no-peer to measure \
                 ferrocomm alone"
            )
        };
        let np = process::find_in_path(np).ok_or_else(|| missing(np))?;
        let mpirun = match launcher {
            Some(l) => Some(process::find_in_path(l).ok_or_else(|| missing(l))?),
            None => None,
        };
        let taskset = process::find_in_path("taskset")
            .ok_or("taskset is not installed or not in PATH (it comes with util-linux); it pins the peer to CPUs")?;
        let scratch = std::env::temp_dir().join(format!(
            "ferrocomm-bench-{}-{}",
            std::process::id(),
            flavour.name().to_lowercase()
        ));
        std::fs::create_dir_all(&scratch)?;
        Ok(NetPipe { flavour, np, mpirun, taskset, scratch })
    }

    /// The peer's name ([`Flavour::name`]).
    pub(crate) fn name(&self) -> &'static str {
        self.flavour.name()
    }

    /// The command run for size `bytes`, for the record (`PORT` and `FILE` vary).
    pub(crate) fn describe(&self, cpus: [usize; 2], bytes: &str) -> String {
        let np = self.flavour.programs().0;
        match self.flavour {
            Flavour::Tcp => {
                let common = format!("-P PORT -l {bytes} -u {bytes} -p 0");
                format!(
                    "taskset -c {} {np} {common} -o /dev/null & taskset -c {} {np} -h 127.0.0.1 {common} -o FILE",
                    cpus[1], cpus[0]
                )
            }
            _ => {
                let args = self.mpi_args(cpus, bytes, "FILE");
                format!("{} {}", self.flavour.programs().1.unwrap_or("mpirun"), args.join(" "))
            }
        }
    }

    /// The MPI launcher's arguments for one size.
    fn mpi_args(&self, cpus: [usize; 2], bytes: &str, file: &str) -> Vec<String> {
        let mut args: Vec<String> = match self.flavour {
            Flavour::OpenMpi => {
                ["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"].map(String::from).into()
            }
            Flavour::OpenMpiTcp => [
                "--allow-run-as-root",
                "--oversubscribe",
                "--bind-to",
                "none",
                "--mca",
                "pml",
                "ob1",
                "--mca",
                "btl",
                "tcp,self",
                "--mca",
                "btl_tcp_if_include",
                "lo",
            ]
            .map(String::from)
            .into(),
            _ => ["-bind-to", "none"].map(String::from).into(),
        };
        for (i, cpu) in cpus.iter().enumerate() {
            if i > 0 {
                args.push(":".into());
            }
            args.extend(["-np", "1", "taskset", "-c", &cpu.to_string()].map(String::from));
            args.push(self.np.display().to_string());
            args.extend(["-l", bytes, "-u", bytes, "-p", "0", "-o", file].map(String::from));
        }
        args
    }

    /// One measurement of `bytes`: the one-way time in seconds.
    pub(crate) fn measure(&self, bytes: usize, cpus: [usize; 2]) -> Result<f64> {
        let file = self.scratch.join(format!("np-{bytes}.out"));
        let _ = std::fs::remove_file(&file);
        match (&self.flavour, &self.mpirun) {
            (Flavour::Tcp, _) => self.run_tcp(bytes, cpus, &file)?,
            (_, Some(mpirun)) => {
                let mut c = Command::new(mpirun);
                c.args(self.mpi_args(cpus, &bytes.to_string(), &file.display().to_string()));
                c.current_dir(&self.scratch).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null());
                let mut child = c.spawn()?;
                let status = process::wait_until(&mut child, Instant::now() + SIZE_TIMEOUT)
                    .map_err(|e| format!("{} at {bytes} bytes: {e}", self.name()))?;
                if !status.success() {
                    return Err(format!("{} failed at {bytes} bytes ({status})", self.name()).into());
                }
            }
            (_, None) => unreachable!("MPI peers have a launcher"),
        }
        let text = std::fs::read_to_string(&file).map_err(|e| format!("{}: {e}", file.display()))?;
        let _ = std::fs::remove_file(&file);
        parse_output(&text)
            .into_iter()
            .find(|&(b, _)| b == bytes)
            .map(|(_, t)| t)
            .ok_or_else(|| format!("{}'s output has no line for {bytes} bytes: {text:?}", self.name()).into())
    }

    /// NPtcp: receiver first, then the transmitter, which writes `file`.
    fn run_tcp(&self, bytes: usize, cpus: [usize; 2], file: &std::path::Path) -> Result<()> {
        let port = process::free_port()?;
        let n = bytes.to_string();
        let common = ["-P", &port.to_string(), "-l", &n, "-u", &n, "-p", "0"].map(String::from);
        let pinned = |cpu: usize| {
            let mut c = Command::new(&self.taskset);
            c.arg("-c").arg(cpu.to_string()).arg(&self.np).args(&common).current_dir(&self.scratch);
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

        let mut transmitter = pinned(cpus[0]).args(["-h", "127.0.0.1", "-o"]).arg(file).spawn()?;
        let status = process::wait_until(&mut transmitter, Instant::now() + SIZE_TIMEOUT);
        let _ = process::wait_until(&mut receiver, Instant::now() + EXIT_TIMEOUT);
        let status = status.map_err(|e| format!("NPtcp at {bytes} bytes: {e}"))?;
        if !status.success() {
            return Err(format!("the NPtcp transmitter failed at {bytes} bytes ({status})").into());
        }
        Ok(())
    }
}

impl Drop for NetPipe {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.scratch);
    }
}

/// The `(bytes, one-way seconds)` pairs of a NetPIPE output file; malformed lines are skipped.
/// The time comes from the throughput column (2^20 bits per second), more precise than the
/// seconds column, which serves only when the throughput is missing.
pub(crate) fn parse_output(text: &str) -> Vec<(usize, f64)> {
    text.lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f[..] {
                [bytes, mbps, seconds, ..] => {
                    let bytes: usize = bytes.parse().ok()?;
                    let mbps: f64 = mbps.parse().ok()?;
                    let t = if mbps > 0.0 { bytes as f64 * 8.0 / (mbps * 1048576.0) } else { seconds.parse().ok()? };
                    Some((bytes, t))
                }
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
    fn flavours_by_name() {
        for name in ["NPtcp", "NPopenmpi-tcp", "NPopenmpi", "NPmpich2"] {
            assert_eq!(Flavour::named(name).map(Flavour::name), Some(name));
        }
        assert_eq!(Flavour::named("NPopenmpi-tcp"), Some(Flavour::OpenMpiTcp));
        assert_eq!(Flavour::OpenMpiTcp.programs().0, "NPopenmpi");
        assert_eq!(Flavour::named("NPudp"), None);
    }

    #[test]
    fn parses_nptcp_output() {
        let text = "       1 0.247594   0.00003081\n 8388608 28119.265552   0.00227602\n       8 594.494592   0.00000010\n\ngarbage\n";
        let got = parse_output(text);
        let want = [(1, 0.00003081), (8388608, 0.00227602), (8, 1.0267e-7)];
        assert_eq!(got.len(), want.len());
        for ((b, t), (wb, wt)) in got.iter().zip(want) {
            assert_eq!(*b, wb);
            assert!((t / wt - 1.0).abs() < 1e-3, "{b} bytes: {t} vs {wt}");
        }
    }
}
