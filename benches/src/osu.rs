//! The OSU measurement shared by both sides of `collectives`: its schedule (operations, sizes,
//! iteration counts, CPUs), given to the ferrocomm ranks and to `benches/mpi/osu_coll.c` as the
//! same flags; the `result` lines both print; and building and running the C program against each
//! MPI.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::{Result, process};

/// The C program, compiled by [`Mpi::build`].
const SOURCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/mpi/osu_coll.c");
/// The longest one MPI run may take.
const MPI_TIMEOUT: Duration = Duration::from_secs(600);

/// The operations measured, by their `osu_coll` names (ferrocomm's [`ferrocomm::Operation`]
/// names), in report order. Those outside [`DEFAULT_OPS`] and `sendrecv` (an exchange with rank
/// r^1, the point-to-point baseline) are measured only when asked for.
pub(crate) const OPS: [&str; 11] = [
    "barrier",
    "bcast",
    "reduce",
    "allreduce",
    "gather",
    "scatter",
    "allgather",
    "alltoall",
    "reduce_scatter",
    "scan",
    "sendrecv",
];
/// The operations measured by default.
const DEFAULT_OPS: [&str; 5] = ["barrier", "bcast", "allreduce", "allgather", "alltoall"];

/// What to measure and how often: the OSU method's parameters, as the flags `osu_coll` takes
/// ([`Schedule::to_args`]); the ferrocomm ranks parse the same flags.
#[derive(Clone, Debug, PartialEq, clap::Args)]
pub(crate) struct Schedule {
    /// Operations, of [`OPS`].
    #[arg(short = 'o', value_delimiter = ',', required = true)]
    pub ops: Vec<String>,
    /// Bytes per rank (see `osu_coll.c` for what that means per operation).
    #[arg(short = 's', value_delimiter = ',', required = true)]
    pub sizes: Vec<usize>,
    #[arg(short = 'i', default_value_t = 1000)]
    pub iters: u64,
    #[arg(short = 'w', default_value_t = 200)]
    pub warmup: u64,
    /// Counts for sizes above `large` bytes.
    #[arg(short = 'I', default_value_t = 100)]
    pub iters_large: u64,
    #[arg(short = 'W', default_value_t = 10)]
    pub warmup_large: u64,
    #[arg(short = 'L', default_value_t = 8192)]
    pub large: usize,
    /// Rank r runs on `cpus[r % len]`; none: not pinned.
    #[arg(short = 'p', value_delimiter = ',')]
    pub cpus: Vec<usize>,
}

impl Default for Schedule {
    /// OSU's defaults: 1000 iterations after 200 warm-up ones, 100 after 10 above 8 KiB.
    fn default() -> Schedule {
        Schedule {
            ops: DEFAULT_OPS.iter().map(|s| s.to_string()).collect(),
            sizes: sizes(1 << 20, 4),
            iters: 1000,
            warmup: 200,
            iters_large: 100,
            warmup_large: 10,
            large: 8192,
            cpus: vec![0, 1],
        }
    }
}

/// 8 bytes, times `step` while at most `max`, and `max` itself.
pub(crate) fn sizes(max: usize, step: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut s = 8;
    while s <= max {
        out.push(s);
        s = s.saturating_mul(step.max(2));
    }
    if out.last() != Some(&max) && max >= 8 {
        out.push(max);
    }
    out
}

fn list<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join(",")
}

impl Schedule {
    /// The flags `osu_coll` takes (the ferrocomm ranks take the same).
    pub(crate) fn to_args(&self) -> Vec<String> {
        let mut a = vec![
            "-o".into(),
            self.ops.join(","),
            "-s".into(),
            list(&self.sizes),
            "-i".into(),
            self.iters.to_string(),
            "-w".into(),
            self.warmup.to_string(),
            "-I".into(),
            self.iters_large.to_string(),
            "-W".into(),
            self.warmup_large.to_string(),
            "-L".into(),
            self.large.to_string(),
        ];
        if !self.cpus.is_empty() {
            a.extend(["-p".into(), list(&self.cpus)]);
        }
        a
    }

    /// Warm-up and timed iterations for `bytes`.
    pub(crate) fn counts(&self, bytes: usize) -> (u64, u64) {
        if bytes > self.large { (self.warmup_large, self.iters_large) } else { (self.warmup, self.iters) }
    }
}

/// One `result` line: an operation at one size, averaged over ranks.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Measurement {
    pub op: String,
    pub bytes: usize,
    pub iterations: u64,
    /// Mean over ranks of each rank's mean latency, microseconds.
    pub avg_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    /// The algorithm ferrocomm chose (the MPI side does not say).
    pub algorithm: Option<String>,
}

impl Measurement {
    /// The line both sides print.
    pub(crate) fn line(&self) -> String {
        let mut s = format!(
            "result {} {} {} {:.4} {:.4} {:.4}",
            self.op, self.bytes, self.iterations, self.avg_us, self.min_us, self.max_us
        );
        if let Some(a) = &self.algorithm {
            s += &format!(" {a}");
        }
        s
    }

    /// Parses a `result` line; `None` for any other line.
    pub(crate) fn parse(line: &str) -> Option<Measurement> {
        let mut f = line.strip_prefix("result ")?.split_whitespace();
        Some(Measurement {
            op: f.next()?.to_string(),
            bytes: f.next()?.parse().ok()?,
            iterations: f.next()?.parse().ok()?,
            avg_us: f.next()?.parse().ok()?,
            min_us: f.next()?.parse().ok()?,
            max_us: f.next()?.parse().ok()?,
            algorithm: f.next().map(String::from),
        })
    }
}

/// One MPI implementation: its compiler wrapper and launcher, and `osu_coll` built against it.
#[derive(Clone, Debug)]
pub(crate) struct Mpi {
    /// `openmpi` or `mpich`.
    pub key: &'static str,
    pub name: &'static str,
    mpirun: &'static str,
    exe: PathBuf,
}

impl Mpi {
    /// The MPIs this benchmark knows, in report order.
    pub(crate) const KEYS: [&'static str; 2] = ["openmpi", "mpich"];

    /// Builds `osu_coll` against MPI `key` into `dir` (once; again when the source is newer).
    pub(crate) fn build(key: &str, dir: &Path) -> Result<Mpi> {
        let (key, name, mpicc, mpirun) = match key {
            "openmpi" => ("openmpi", "Open MPI", "mpicc.openmpi", "mpirun.openmpi"),
            "mpich" => ("mpich", "MPICH", "mpicc.mpich", "mpirun.mpich"),
            other => return Err(format!("unknown MPI {other:?}: openmpi or mpich").into()),
        };
        for tool in [mpicc, mpirun] {
            if process::find_in_path(tool).is_none() {
                return Err(format!("{tool} not found (Debian: openmpi-bin libopenmpi-dev, mpich libmpich-dev)").into());
            }
        }
        std::fs::create_dir_all(dir)?;
        let exe = dir.join(format!("osu_coll-{key}"));
        let modified = |p: &Path| p.metadata().and_then(|m| m.modified()).ok();
        if modified(&exe).is_none() || modified(&exe) < modified(Path::new(SOURCE)) {
            let out = Command::new(mpicc).args(["-O2", "-o"]).arg(&exe).arg(SOURCE).output()?;
            if !out.status.success() {
                return Err(format!("{mpicc} {SOURCE} failed:\n{}", String::from_utf8_lossy(&out.stderr)).into());
            }
        }
        Ok(Mpi { key, name, mpirun, exe })
    }

    /// The launcher's arguments for `n` ranks.
    fn launcher_args(&self, n: u32) -> Vec<String> {
        let mut a: Vec<String> = Vec::new();
        if self.key == "openmpi" {
            // Root in the container; more ranks than cores allowed; osu_coll pins itself (-p).
            a.extend(["--allow-run-as-root", "--oversubscribe", "--bind-to", "none"].map(String::from));
        }
        a.extend(["-np".into(), n.to_string()]);
        a
    }

    /// The command line, for the report.
    pub(crate) fn describe(&self, n: u32, schedule: &Schedule) -> String {
        let mut parts = vec![self.mpirun.to_string()];
        parts.extend(self.launcher_args(n));
        parts.push(self.exe.display().to_string());
        parts.extend(schedule.to_args());
        parts.join(" ")
    }

    /// Runs `osu_coll` on `n` ranks.
    pub(crate) fn run(&self, n: u32, schedule: &Schedule) -> Result<Vec<Measurement>> {
        let mut cmd = Command::new(self.mpirun);
        cmd.args(self.launcher_args(n)).arg(&self.exe).args(schedule.to_args());
        let (status, lines) =
            process::run_lines(cmd, MPI_TIMEOUT).map_err(|e| format!("{} on {n} ranks: {e}", self.name))?;
        let found = collect(&lines);
        if !status.success() {
            return Err(format!("{} on {n} ranks failed ({status})", self.name).into());
        }
        Ok(found)
    }
}

/// The `result` lines among `lines` (prefixed by the launcher's `[rank] ` or not); other lines
/// except comments are passed on to standard error.
pub(crate) fn collect(lines: &[String]) -> Vec<Measurement> {
    let mut out = Vec::new();
    for line in lines {
        let bare = match line.split_once("] ") {
            Some((head, rest)) if head.starts_with('[') => rest,
            _ => line.as_str(),
        };
        match Measurement::parse(bare) {
            Some(m) => out.push(m),
            None if bare.starts_with('#') => {}
            None => eprintln!("  {line}"),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_round_trips_through_flags() {
        let s = Schedule { ops: vec!["bcast".into()], sizes: vec![8, 64], cpus: vec![], ..Schedule::default() };
        let line = format!("collectives-rank {}", s.to_args().join(" "));
        let crate::Command::CollectivesRank(back) = crate::tests::parse(&line).unwrap() else { panic!("{line}") };
        assert_eq!(back.schedule, s);
        let pinned = Schedule { cpus: vec![1, 0, 1], ..s.clone() };
        let line = format!("collectives-rank {}", pinned.to_args().join(" "));
        let crate::Command::CollectivesRank(back) = crate::tests::parse(&line).unwrap() else { panic!("{line}") };
        assert_eq!(back.schedule, pinned);
        assert!(crate::tests::parse("collectives-rank -o bcast -s 8 --frobnicate 1").is_err());
        assert_eq!(s.counts(8), (200, 1000));
        assert_eq!(s.counts(16384), (10, 100));
    }

    #[test]
    fn sizes_end_at_max() {
        assert_eq!(sizes(1 << 20, 4).first(), Some(&8));
        assert_eq!(sizes(1 << 20, 4).last(), Some(&(1 << 20)));
        assert_eq!(sizes(64, 2), vec![8, 16, 32, 64]);
        assert_eq!(sizes(100, 4), vec![8, 32, 100]);
    }

    #[test]
    fn result_lines() {
        let m = Measurement {
            op: "allreduce".into(),
            bytes: 8,
            iterations: 1000,
            avg_us: 1.5,
            min_us: 1.25,
            max_us: 1.75,
            algorithm: Some("ring".into()),
        };
        assert_eq!(Measurement::parse(&m.line()), Some(m.clone()));
        let lines = vec!["[0] ".to_string() + &m.line(), "# header".into()];
        assert_eq!(collect(&lines), vec![m]);
        assert_eq!(Measurement::parse("result bcast x"), None);
    }
}
