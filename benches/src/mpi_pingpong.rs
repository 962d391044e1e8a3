//! A peer of `pingpong` over Open MPI's TCP BTL: `benches/mpi/mpi_pingpong.c`, two ranks started
//! by `mpirun.openmpi` with `--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo`, so
//! that they talk over TCP on the loopback interface, polling as ferrocomm does (`NPtcp` sleeps in
//! `read`). `--mca mpi_yield_when_idle 0` keeps it polling although `--oversubscribe` is given
//! (needed to start as root in a container; the ranks pin themselves with `-p`).
//!
//! The program follows ferrocomm's schedule (a ~5 ms warm-up batch, then a timed batch of
//! `--target-ms`, its mean round trip halved), and one launch measures a whole slice of sizes, so
//! that a slice of this peer costs one `mpirun` and lasts about as long as ferrocomm's.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{Result, process};

/// The C program, compiled by [`MpiPingPong::build`].
const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/mpi/mpi_pingpong.c");
/// The longest one slice may take.
const TIMEOUT: Duration = Duration::from_secs(300);
/// The peer's name in reports.
pub(crate) const NAME: &str = "openmpi-tcp";

/// `mpi_pingpong` built against Open MPI.
pub(crate) struct MpiPingPong {
    exe: PathBuf,
    target_ms: u64,
}

impl MpiPingPong {
    /// Builds `mpi_pingpong` with `mpicc.openmpi` under the directory of this executable (once;
    /// again when the source is newer). Timed batches last `target_ms`.
    pub(crate) fn build(target_ms: u64) -> Result<MpiPingPong> {
        for tool in ["mpicc.openmpi", "mpirun.openmpi"] {
            if process::find_in_path(tool).is_none() {
                return Err(format!(
                    "{tool} not found (Debian: openmpi-bin libopenmpi-dev); or choose other --peers, or --no-peer"
                )
                .into());
            }
        }
        let dir = std::env::current_exe()?.parent().ok_or("the executable has no directory")?.join("osu_coll");
        std::fs::create_dir_all(&dir)?;
        let exe = dir.join("mpi_pingpong-openmpi");
        let modified = |p: &Path| p.metadata().and_then(|m| m.modified()).ok();
        if modified(&exe).is_none() || modified(&exe) < modified(Path::new(SOURCE)) {
            let out = Command::new("mpicc.openmpi").args(["-O2", "-o"]).arg(&exe).arg(SOURCE).output()?;
            if !out.status.success() {
                return Err(format!("mpicc.openmpi {SOURCE} failed:\n{}", String::from_utf8_lossy(&out.stderr)).into());
            }
        }
        Ok(MpiPingPong { exe, target_ms })
    }

    fn args(&self, sizes: &str, cpus: [usize; 2]) -> Vec<String> {
        let mut a: Vec<String> = [
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
            "--mca",
            "mpi_yield_when_idle",
            "0",
            "-np",
            "2",
        ]
        .map(String::from)
        .into();
        a.push(self.exe.display().to_string());
        a.extend(["-s".into(), sizes.into(), "-t".into(), self.target_ms.to_string()]);
        a.extend(["-p".into(), format!("{},{}", cpus[0], cpus[1])]);
        a
    }

    /// The command of one slice, for the record.
    pub(crate) fn describe(&self, cpus: [usize; 2]) -> String {
        format!("mpirun.openmpi {}", self.args("SIZE,...", cpus).join(" "))
    }

    /// One slice: the one-way time of each of `sizes`, seconds, in order.
    pub(crate) fn measure(&self, sizes: &[usize], cpus: [usize; 2]) -> Result<Vec<f64>> {
        let list = sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(",");
        let mut cmd = Command::new("mpirun.openmpi");
        cmd.args(self.args(&list, cpus));
        let (status, lines) = process::run_lines(cmd, TIMEOUT).map_err(|e| format!("{NAME} at {list} B: {e}"))?;
        if !status.success() {
            return Err(format!("{NAME} failed at {list} B ({status})").into());
        }
        let found = parse(&lines);
        sizes
            .iter()
            .map(|b| {
                found
                    .iter()
                    .find(|(fb, _)| fb == b)
                    .map(|&(_, t)| t)
                    .ok_or_else(|| format!("{NAME} printed no result for {b} B: {}", lines.join(" | ")).into())
            })
            .collect()
    }
}

/// The `(bytes, one-way seconds)` of the `result` lines among `lines`.
fn parse(lines: &[String]) -> Vec<(usize, f64)> {
    lines
        .iter()
        .filter_map(|l| {
            let f: Vec<&str> = l.strip_prefix("result ")?.split_whitespace().collect();
            match f[..] {
                [bytes, iterations, seconds] => {
                    iterations.parse::<u64>().ok()?;
                    Some((bytes.parse().ok()?, seconds.parse().ok()?))
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
    fn parses_result_lines() {
        let lines: Vec<String> =
            ["result 8 1555 1.163506285e-06", "noise", "result 65536 134 4.3e-05", "result 7 x 1e-6", "result 9 1 0"]
                .map(String::from)
                .into();
        assert_eq!(parse(&lines), vec![(8, 1.163506285e-06), (65536, 4.3e-05)]);
    }
}
