//! `hosts`: collectives between hosts over TCP alone, ferrocomm next to Open MPI's TCP BTL.
//!
//! What a cluster of one rank per node sees, on one machine and the same CPUs: every rank is a
//! host of its own as far as ferrocomm knows (`FERROCOMM_HOST_ID=bench-host-<rank>`, with
//! `FERROCOMM_TRANSPORTS=tcp`), so every peer is reached over TCP and the collectives take the
//! algorithms of a job without shared memory (no node-leader step, no board); Open MPI runs
//! `benches/mpi/osu_coll.c` with `--mca pml ob1 --mca btl tcp,self` (no shared memory, no UCX),
//! over the loopback interface like ferrocomm (`btl_tcp_if_include lo`). Both sides run the OSU
//! method of `collectives` ([`coll_ranks`] for ferrocomm: the same flags, the same `result`
//! lines), rank r on the (r mod count)-th CPU of `--cpus`, alternating run after run; the report
//! gives medians over runs and the ratio ferrocomm / Open MPI (below 1: ferrocomm is faster): the
//! median of each run's ratio, with their min-max.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;

use crate::coll_ranks::{self, JobSpec};
use crate::osu::{self, Measurement, Mpi, Schedule};
use crate::sweep::median;
use crate::{Result, cli, process};

/// Hidden subcommand: the ferrocomm job, which launches the ranks.
pub(crate) const JOB_COMMAND: &str = "hosts-job";
/// Hidden subcommand: one ferrocomm rank, a host of its own.
pub(crate) const RANK_COMMAND: &str = "hosts-rank";
/// The longest one job of either side may take.
const JOB_TIMEOUT: Duration = Duration::from_secs(600);

/// ferrocomm vs Open MPI's TCP BTL: collectives between hosts over TCP (OSU method).
///
/// Every ferrocomm rank is a host of its own (distinct FERROCOMM_HOST_ID, FERROCOMM_TRANSPORTS=tcp);
/// Open MPI runs benches/mpi/osu_coll.c with --mca pml ob1 --mca btl tcp,self over the loopback
/// interface. Same CPUs, same schedule, alternating runs, medians, ratios ferrocomm / Open MPI.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Ranks (hosts)
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..))]
    pub ranks: u32,
    /// Operations, of bcast, allreduce, reduce, allgather, alltoall, barrier
    #[arg(long, value_name = "OP,...", value_delimiter = ',', default_value = "allreduce,bcast",
          value_parser = osu::OPS)]
    pub ops: Vec<String>,
    /// Sizes (bytes per rank)
    #[arg(long, value_name = "BYTES,...", value_delimiter = ',', default_value = "8,1M", value_parser = cli::bytes)]
    pub sizes: Vec<usize>,
    /// Timed iterations per size up to 8 KiB (OSU's default)
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = cli::at_least_one_u64)]
    pub iters: u64,
    /// Warm-up iterations per size up to 8 KiB
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub warmup: u64,
    /// Timed iterations per size above 8 KiB
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = cli::at_least_one_u64)]
    pub iters_large: u64,
    /// Warm-up iterations per size above 8 KiB
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub warmup_large: u64,
    /// Runs per side; the report gives medians
    #[arg(long, value_name = "K", default_value_t = 3, value_parser = cli::at_least_one)]
    pub runs: usize,
    /// Rank r runs on the (r mod count)-th CPU, on both sides
    #[arg(long, value_name = "A,B,...", value_delimiter = ',', default_value = "0,1")]
    pub cpus: Vec<usize>,
    /// ferrocomm progress mode
    #[arg(long, default_value = "busy", value_parser = cli::progress)]
    pub progress: String,
    /// ferrocomm alone (no Open MPI)
    #[arg(long)]
    pub no_peer: bool,
    /// Ranks per host: rank r is host r / N. Above 1, the ranks of a host share memory (no
    /// FERROCOMM_TRANSPORTS=tcp) and the collectives take the node-leader hierarchy: shared memory
    /// inside a host, TCP between; compare with a flat algorithm pinned by --pin (Open MPI stays
    /// on TCP alone, so its column is no like-for-like peer then)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub per_host: u32,
    /// Algorithm overrides for ferrocomm (op=algorithm,...), e.g. bcast=binomial to compare a flat
    /// algorithm with the hierarchy
    #[arg(long, value_name = "OP=ALG,...")]
    pub pin: Option<String>,
    /// Extra environment of the ferrocomm ranks (KEY=VALUE), e.g. FERROCOMM_COLL=...
    #[arg(long, value_name = "KEY=VALUE", value_parser = cli::key_value)]
    pub env: Vec<String>,
    /// Write the results as JSON here
    #[arg(long, value_name = "FILE")]
    pub json: Option<std::path::PathBuf>,
}

impl Options {
    fn schedule(&self) -> Schedule {
        Schedule {
            ops: self.ops.clone(),
            sizes: self.sizes.clone(),
            iters: self.iters,
            warmup: self.warmup,
            iters_large: self.iters_large,
            warmup_large: self.warmup_large,
            large: 8192,
            cpus: self.cpus.clone(),
        }
    }
}

/// The environment variable that tells the hidden subcommands how many ranks share a host.
const PER_HOST: &str = "FERROCOMM_BENCH_PER_HOST";

/// The hidden subcommands' arguments for `spec` (what [`JobSpec`] parses).
fn job_args(spec: &JobSpec) -> Vec<String> {
    let mut a = vec!["--ranks".into(), spec.ranks.to_string(), "--progress".into(), spec.progress.clone()];
    if let Some(p) = &spec.pin {
        a.extend(["--pin".into(), p.clone()]);
    }
    for e in &spec.env {
        a.extend(["--env".into(), e.clone()]);
    }
    a.extend(spec.schedule.to_args());
    a
}

/// Open MPI's launcher arguments: TCP alone, over the loopback interface.
const OPEN_MPI_TCP: [&str; 10] =
    ["--mca", "pml", "ob1", "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo", "--bind-to"];

fn open_mpi_command(exe: &std::path::Path, n: u32, s: &Schedule) -> Command {
    let mut cmd = Command::new("mpirun.openmpi");
    // Root in the container; more ranks than cores allowed; osu_coll pins itself (-p).
    cmd.args(["--allow-run-as-root", "--oversubscribe"]).args(OPEN_MPI_TCP).arg("none");
    cmd.args(["-np", &n.to_string()]).arg(exe).args(s.to_args());
    cmd
}

/// One Open MPI run.
fn run_open_mpi(exe: &std::path::Path, n: u32, s: &Schedule) -> Result<Vec<Measurement>> {
    let cmd = open_mpi_command(exe, n, s);
    let (status, lines) = process::run_lines(cmd, JOB_TIMEOUT).map_err(|e| format!("Open MPI: {e}"))?;
    if !status.success() {
        return Err(format!("Open MPI on {n} ranks failed ({status})").into());
    }
    Ok(osu::collect(&lines))
}

/// One ferrocomm run; returns the transport rank 0 reported and its measurements.
fn run_ferrocomm(spec: &JobSpec) -> Result<(String, Vec<Measurement>)> {
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg(JOB_COMMAND).args(job_args(spec)).stderr(Stdio::inherit());
    let (status, lines) = process::run_lines(cmd, JOB_TIMEOUT).map_err(|e| format!("ferrocomm: {e}"))?;
    if !status.success() {
        return Err(format!("the ferrocomm job on {} ranks failed ({status})", spec.ranks).into());
    }
    let transport =
        lines.iter().find_map(|l| l.strip_prefix("[0] # transport ").map(String::from)).unwrap_or_else(|| "?".into());
    Ok((transport, osu::collect(&lines)))
}

/// `hosts`: both sides, run after run, and the report.
pub(crate) fn main(o: Options) -> Result<()> {
    let s = o.schedule();
    let mut env = o.env.clone();
    if o.per_host > 1 {
        env.push(format!("{PER_HOST}={}", o.per_host));
    }
    let spec = JobSpec { ranks: o.ranks, progress: o.progress.clone(), pin: o.pin.clone(), env, schedule: s.clone() };
    // osu_coll built against Open MPI, where `collectives` builds it too (osu::Mpi::build names
    // it osu_coll-openmpi).
    let dir = std::env::current_exe()?.parent().ok_or("the executable has no directory")?.join("osu_coll");
    let peer = if o.no_peer {
        None
    } else {
        Mpi::build("openmpi", &dir)?;
        Some(dir.join("osu_coll-openmpi"))
    };
    let (layout, transports, host) = match o.per_host {
        1 => ("each a host of its own over TCP".to_string(), "FERROCOMM_TRANSPORTS=tcp ", "<rank>".to_string()),
        n => (format!("{n} per host (shared memory inside, TCP between)"), "", format!("<rank / {n}>")),
    };
    println!(
        "hosts: {} ranks, {layout}; {:?} at {:?} B; OSU method ({} iterations after {} \
         warm-up, {} after {} above 8 KiB); median of {} run(s); ranks on CPUs {:?}",
        o.ranks, o.ops, o.sizes, o.iters, o.warmup, o.iters_large, o.warmup_large, o.runs, o.cpus
    );
    println!(
        "  ferrocomm: {transports}FERROCOMM_HOST_ID=bench-host-{host} FERROCOMM_PROGRESS={} \
         ferrocomm-bench {JOB_COMMAND} {}",
        o.progress,
        job_args(&spec).join(" ")
    );
    if let Some(exe) = &peer {
        println!("  Open MPI:  {:?}", open_mpi_command(exe, o.ranks, &s));
    }
    // (op, bytes) -> side -> avg latency of each run, us.
    let mut samples: BTreeMap<(String, usize), BTreeMap<&str, Vec<f64>>> = BTreeMap::new();
    let mut algorithms: BTreeMap<(String, usize), String> = BTreeMap::new();
    let mut transport = String::new();
    for run in 0..o.runs {
        // Alternate which side goes first, so that a drifting machine hits both alike.
        let mut sides: Vec<&str> = vec!["ferrocomm"];
        if peer.is_some() {
            sides.push("Open MPI");
        }
        if run % 2 == 1 {
            sides.reverse();
        }
        for side in sides {
            let found = if side == "ferrocomm" {
                let (t, m) = run_ferrocomm(&spec)?;
                transport = t;
                m
            } else {
                run_open_mpi(peer.as_ref().expect("a peer"), o.ranks, &s)?
            };
            for m in found {
                if let Some(a) = &m.algorithm {
                    algorithms.insert((m.op.clone(), m.bytes), a.clone());
                }
                samples.entry((m.op.clone(), m.bytes)).or_default().entry(side).or_default().push(m.avg_us);
            }
        }
        eprintln!("  run {}/{} done", run + 1, o.runs);
    }
    println!("\nferrocomm transport: {transport}");
    println!(
        "{:<10} {:>9} {:>14} {:>14} {:>20}  ferrocomm algorithm",
        "op", "bytes", "ferrocomm us", "Open MPI us", "ratio (min-max)"
    );
    let mut rows = Vec::new();
    for ((op, bytes), sides) in &samples {
        let (ours, theirs) = (sides.get("ferrocomm"), sides.get("Open MPI"));
        // The ratio of each run's two sides (taken back to back), then their median and spread:
        // the host's phase moves both sides of a run alike, and the spread shows how far it moves.
        let paired: Vec<f64> = match (ours, theirs) {
            (Some(a), Some(b)) => a.iter().zip(b).map(|(x, y)| x / y).collect(),
            _ => Vec::new(),
        };
        let ratio = median(&paired);
        let lo = paired.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = paired.iter().copied().fold(0.0, f64::max);
        let (ours, theirs) = (ours.and_then(|v| median(v)), theirs.and_then(|v| median(v)));
        let alg = algorithms.get(&(op.clone(), *bytes)).cloned().unwrap_or_default();
        let show = |v: Option<f64>| v.map_or("-".to_string(), |x| format!("{x:.2}"));
        println!(
            "{op:<10} {bytes:>9} {:>14} {:>14} {:>20}  {alg}",
            show(ours),
            show(theirs),
            ratio.map_or("-".to_string(), |r| format!("{r:.2}x ({lo:.2}-{hi:.2})"))
        );
        rows.push(json!({"op": op, "bytes": bytes, "ferrocomm_us": ours, "open_mpi_us": theirs, "ratio": ratio,
                         "ratio_min": ratio.map(|_| lo), "ratio_max": ratio.map(|_| hi), "algorithm": alg,
                         "runs": {"ferrocomm": sides.get("ferrocomm"), "open_mpi": sides.get("Open MPI")}}));
    }
    if let Some(path) = &o.json {
        let doc = json!({
            "benchmark": "hosts",
            "ranks": o.ranks,
            "cpus": o.cpus,
            "progress": o.progress,
            "transport": transport,
            "open_mpi": peer.as_ref().map(|exe| format!("{:?}", open_mpi_command(exe, o.ranks, &s))),
            "rows": rows,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// `hosts-job`: launches the ranks, TCP only (or, with several ranks per host, shared memory
/// inside a host).
pub(crate) fn job_main(spec: JobSpec) -> Result<()> {
    let mut env: Vec<(String, String)> = vec![("FERROCOMM_PROGRESS".into(), spec.progress.clone())];
    for e in &spec.env {
        let (k, v) = e.split_once('=').ok_or_else(|| format!("--env {e:?}: expected KEY=VALUE"))?;
        env.push((k.into(), v.into()));
    }
    if !env.iter().any(|(k, _)| k == PER_HOST) {
        env.push(("FERROCOMM_TRANSPORTS".into(), "tcp".into()));
    }
    crate::ranks::launch(spec.ranks, RANK_COMMAND, job_args(&spec), env)
}

/// `hosts-rank`: one rank, on a host of its own (or of `FERROCOMM_BENCH_PER_HOST` ranks); then the
/// OSU measurement of `collectives`.
pub(crate) fn rank_main(spec: JobSpec) -> Result<()> {
    let rank: u32 = std::env::var("FERROCOMM_RANK")
        .map_err(|_| "FERROCOMM_RANK is not set: hosts-rank runs under the benchmark's launcher")?
        .parse()
        .map_err(|e| format!("FERROCOMM_RANK: {e}"))?;
    let per_host: u32 = std::env::var(PER_HOST).ok().and_then(|v| v.parse().ok()).unwrap_or(1).max(1);
    // SAFETY: no other thread runs yet in this process (the runtime starts in rank_main).
    unsafe { std::env::set_var("FERROCOMM_HOST_ID", format!("bench-host-{}", rank / per_host)) };
    coll_ranks::rank_main(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_args_round_trip() {
        let spec = JobSpec {
            ranks: 4,
            progress: "blocking".into(),
            pin: None,
            env: vec!["A=b".into()],
            schedule: Schedule { sizes: vec![8, 1 << 20], ops: vec!["allreduce".into()], ..Schedule::default() },
        };
        let line = format!("{JOB_COMMAND} {}", job_args(&spec).join(" "));
        let crate::Command::HostsJob(back) = crate::tests::parse(&line).unwrap() else { panic!("{line}") };
        assert_eq!((back.ranks, back.progress.as_str(), &back.env), (4, "blocking", &spec.env));
        assert_eq!(back.schedule, spec.schedule);
        assert!(crate::tests::parse("hosts --sizes 8,1M --ops allreduce,bcast --runs 3 --json h.json").is_ok());
    }
}
