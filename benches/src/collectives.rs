//! `collectives`: OSU-style collective latency of ferrocomm next to Open MPI and MPICH, in one
//! invocation; and `--sweep`, which pins each algorithm in turn to find the selection table's
//! switch points.
//!
//! Each run measures, for every rank count, ferrocomm ([`coll_ranks`]) and each MPI running
//! `benches/mpi/osu_coll.c` ([`osu::Mpi`]) with the same schedule (operations, sizes, warm-up and
//! timed iterations, CPU of each rank); the order of the sides rotates from run to run so that a
//! drifting machine hits each side alike. The report gives, per size, the median over runs of the
//! OSU average latency (mean over ranks of each rank's mean) and the ratios ferrocomm / MPI
//! (below 1: ferrocomm is faster).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use ferrocomm::{Algorithm, Operation};
use serde_json::{Value, json};

use crate::coll_ranks::{self, JobSpec};
use crate::osu::{self, Measurement, Mpi, Schedule};
use crate::pingpong::parse_bytes;
use crate::sweep::median;
use crate::{Result, affinity, process};

/// Other work above this share of the benchmark's CPUs, during a run, earns a warning.
const LOAD_WARNING: f64 = 0.05;
/// The side name of ferrocomm in rows and JSON.
const OURS: &str = "ferrocomm";

pub(crate) const USAGE: &str = "\
usage: ferrocomm-bench collectives [options]

OSU-style latency (warm-up, then timed iterations each followed by a barrier; per-rank mean,
averaged over ranks) of barrier, broadcast, all-reduce (f32 sum), all-gather and all-to-all, for
ferrocomm over shared memory and for Open MPI and MPICH running benches/mpi/osu_coll.c (built here
with mpicc.openmpi and mpicc.mpich), alternating, medians over --runs runs.

options:
  --ranks N,M,...      rank counts (default 2,4)
  --ops OP,...         of barrier,bcast,allreduce,allgather,alltoall (default all), also reduce
                       and sendrecv
  --max BYTES          largest size (default 1M); sizes are 8 B times --step while below, and --max
  --step K             size factor (default 4; 2 for every power of two)
  --iters N --warmup N             per size up to --large bytes (default 1000, 200: OSU's)
  --iters-large N --warmup-large N above --large (default 100, 10: OSU's)
  --large BYTES        (default 8192)
  --runs K             runs per side; the report gives medians (default 3)
  --cpus A,B,...       rank r runs on the (r mod count)-th CPU, on every side (default 0,1)
  --progress P         ferrocomm progress mode (default busy, as MPI busy-polls)
  --mpi M,...          of openmpi,mpich (default both); --no-mpi for ferrocomm alone
  --env KEY=VALUE      extra environment of the ferrocomm ranks only (repeatable), e.g.
                       GLIBC_TUNABLES=... to try allocator settings
  --json FILE          write the results as JSON
  --sweep              instead: ferrocomm alone, each algorithm of each operation pinned in turn
                       (Comm::with_collective_table), to find the selection table's switch points";

/// The options of `collectives`.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub ranks: Vec<u32>,
    pub schedule: Schedule,
    pub max: usize,
    pub step: usize,
    pub runs: usize,
    pub progress: String,
    pub mpis: Vec<String>,
    pub json: Option<PathBuf>,
    pub sweep: bool,
    /// `--env KEY=VALUE`: extra environment of the ferrocomm ranks.
    pub env: Vec<String>,
}

impl Options {
    /// Parses `args`; `None` when help was asked for.
    pub(crate) fn parse(args: &[String]) -> Result<Option<Options>> {
        let mut o = Options {
            ranks: vec![2, 4],
            schedule: Schedule::default(),
            max: 1 << 20,
            step: 4,
            runs: 3,
            progress: "busy".into(),
            mpis: Mpi::KEYS.iter().map(|s| s.to_string()).collect(),
            json: None,
            sweep: false,
            env: Vec::new(),
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
                _ => (arg.as_str(), None),
            };
            let mut value = || inline.clone().or_else(|| it.next().cloned()).ok_or(format!("{flag} needs a value"));
            let s = &mut o.schedule;
            match flag {
                "-h" | "--help" => return Ok(None),
                "--ranks" => {
                    o.ranks = value()?.split(',').map(|r| r.trim().parse()).collect::<std::result::Result<_, _>>()?;
                    if o.ranks.iter().any(|&r| r < 2) {
                        return Err("--ranks: at least 2".into());
                    }
                }
                "--ops" => {
                    let ops: Vec<String> = value()?.split(',').map(String::from).collect();
                    if let Some(bad) = ops.iter().find(|op| !osu::OPS.contains(&op.as_str())) {
                        return Err(format!("--ops: unknown operation {bad:?}").into());
                    }
                    s.ops = ops;
                }
                "--max" => o.max = parse_bytes(&value()?)?,
                "--step" => o.step = value()?.parse::<usize>().map_err(|e| format!("--step: {e}"))?.max(2),
                "--iters" => s.iters = value()?.parse()?,
                "--warmup" => s.warmup = value()?.parse()?,
                "--iters-large" => s.iters_large = value()?.parse()?,
                "--warmup-large" => s.warmup_large = value()?.parse()?,
                "--large" => s.large = parse_bytes(&value()?)?,
                "--runs" => {
                    o.runs = value()?.parse().map_err(|e| format!("--runs: {e}"))?;
                    if o.runs == 0 {
                        return Err("--runs must be at least 1".into());
                    }
                }
                "--cpus" => {
                    s.cpus = value()?.split(',').map(|c| c.trim().parse()).collect::<std::result::Result<_, _>>()?;
                }
                "--progress" => {
                    let p = value()?;
                    p.parse::<ferrocomm::ProgressMode>().map_err(|e| format!("--progress: {e}"))?;
                    o.progress = p;
                }
                "--mpi" => o.mpis = value()?.split(',').map(String::from).collect(),
                "--no-mpi" => o.mpis.clear(),
                "--json" => o.json = Some(value()?.into()),
                "--sweep" => o.sweep = true,
                "--env" => {
                    let e = value()?;
                    if !e.contains('=') {
                        return Err(format!("--env {e:?}: expected KEY=VALUE").into());
                    }
                    o.env.push(e);
                }
                other => return Err(format!("unknown option {other:?}\n{USAGE}").into()),
            }
        }
        if o.schedule.iters == 0 || o.schedule.iters_large == 0 {
            return Err("--iters and --iters-large must be at least 1".into());
        }
        o.schedule.sizes = osu::sizes(o.max, o.step);
        Ok(Some(o))
    }
}

/// Every run's latency of each side at one (ranks, operation, size).
#[derive(Clone, Debug, Default)]
struct Row {
    /// Side -> average latency of each run, microseconds.
    runs: BTreeMap<String, Vec<f64>>,
    /// The algorithm ferrocomm chose.
    algorithm: Option<String>,
}

impl Row {
    fn median(&self, side: &str) -> Option<f64> {
        self.runs.get(side).and_then(|v| median(v))
    }
    fn ratio(&self, side: &str) -> Option<f64> {
        Some(self.median(OURS)? / self.median(side)?)
    }
}

/// (ranks, operation index in [`osu::OPS`], bytes): rows in report order.
type Key = (u32, usize, usize);

fn key(n: u32, m: &Measurement) -> Key {
    (n, osu::OPS.iter().position(|o| *o == m.op).unwrap_or(usize::MAX), m.bytes)
}

fn num(v: Option<f64>) -> String {
    match v {
        Some(v) if v >= 1000.0 => format!("{v:.0}"),
        Some(v) if v >= 10.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.2}"),
        None => "-".into(),
    }
}

/// Notes other work on the CPUs during one side's run.
struct Watch {
    busiest: f64,
    log: Vec<Value>,
}

impl Watch {
    fn note(&mut self, meter: Option<process::Interference>, run: usize, ranks: u32, side: &str) {
        let share = meter.and_then(|m| m.share());
        if let Some(share) = share {
            self.busiest = self.busiest.max(share);
            if share > LOAD_WARNING {
                eprintln!("warning: other work took {:.0}% of the CPUs during run {run} of {side}", share * 100.0);
            }
        }
        self.log.push(json!({"run": run, "ranks": ranks, "side": side, "share": share}));
    }
}

/// `ferrocomm-bench collectives`.
pub(crate) fn main(args: &[String]) -> Result<()> {
    let Some(opts) = Options::parse(args)? else {
        println!("{USAGE}");
        return Ok(());
    };
    let allowed = affinity::allowed_cpus()?;
    if let Some(c) = opts.schedule.cpus.iter().find(|c| !allowed.contains(c)) {
        return Err(format!("CPU {c} is not available to this process (available: {allowed:?}); see --cpus").into());
    }
    if opts.sweep { sweep(&opts) } else { compare(&opts) }
}

fn spec(opts: &Options, ranks: u32, schedule: &Schedule, pin: Option<String>) -> JobSpec {
    JobSpec { ranks, progress: opts.progress.clone(), pin, env: opts.env.clone(), schedule: schedule.clone() }
}

/// ferrocomm and the MPIs, side by side.
fn compare(opts: &Options) -> Result<()> {
    let started = Instant::now();
    let dir = std::env::current_exe()?.parent().ok_or("the executable has no directory")?.join("osu_coll");
    let mpis = opts.mpis.iter().map(|k| Mpi::build(k, &dir)).collect::<Result<Vec<_>>>()?;
    let s = &opts.schedule;
    println!(
        "collectives, OSU method: {} sizes from {} to {} B, {} iterations after {} warm-up ({} after {} above {} B), \
         median of {} run(s), ranks on CPUs {:?}",
        s.sizes.len(),
        s.sizes.first().unwrap_or(&0),
        s.sizes.last().unwrap_or(&0),
        s.iters,
        s.warmup,
        s.iters_large,
        s.warmup_large,
        s.large,
        opts.runs,
        s.cpus
    );
    let mut commands = Vec::new();
    for &n in &opts.ranks {
        commands.push(spec(opts, n, s, None).describe());
        commands.extend(mpis.iter().map(|m| m.describe(n, s)));
    }
    for c in &commands {
        println!("  {c}");
    }

    let mut rows: BTreeMap<Key, Row> = BTreeMap::new();
    let mut transport = String::from("?");
    let mut watch = Watch { busiest: 0.0, log: Vec::new() };
    let sides = 1 + mpis.len();
    for run in 1..=opts.runs {
        for &n in &opts.ranks {
            // Rotate the order of the sides from run to run.
            for i in 0..sides {
                let side = (i + run - 1) % sides;
                let meter = process::Interference::start(&s.cpus);
                let t = Instant::now();
                let (name, found) = if side == 0 {
                    let r = coll_ranks::run(&spec(opts, n, s, None))?;
                    transport = r.transport;
                    (OURS, r.measurements)
                } else {
                    let m = &mpis[side - 1];
                    (m.key, m.run(n, s)?)
                };
                watch.note(meter, run, n, name);
                eprintln!("run {run}/{}: {n} ranks: {name}: {:.1} s", opts.runs, t.elapsed().as_secs_f64());
                for m in found {
                    let row = rows.entry(key(n, &m)).or_default();
                    row.runs.entry(name.to_string()).or_default().push(m.avg_us);
                    if m.algorithm.is_some() {
                        row.algorithm = m.algorithm;
                    }
                }
            }
        }
    }
    if watch.busiest > LOAD_WARNING {
        println!(
            "warning: other work took up to {:.0}% of the CPUs during a run; the results are noisy",
            watch.busiest * 100.0
        );
    }
    println!("\nferrocomm transport: {transport}; latencies in us (median over runs); ratio = ferrocomm / MPI\n");
    print!("{}", table(&rows, &mpis));
    println!();
    for line in goal(&rows, &opts.ranks) {
        println!("{line}");
    }
    if let Some(path) = &opts.json {
        let doc = to_json(opts, &rows, &mpis, &transport, &commands, &watch.log);
        write_json(path, &doc)?;
    }
    println!("total time {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

fn table(rows: &BTreeMap<Key, Row>, mpis: &[Mpi]) -> String {
    let mut out = format!("{:>5} {:>9} {:>8} {:>18} {:>10}", "ranks", "op", "bytes", "algorithm", OURS);
    for m in mpis {
        out += &format!(" {:>10}", m.key);
    }
    for m in mpis {
        out += &format!(" {:>10}", format!("/{}", m.key));
    }
    out.push('\n');
    for (&(n, op, bytes), r) in rows {
        out += &format!(
            "{:>5} {:>9} {:>8} {:>18} {:>10}",
            n,
            osu::OPS.get(op).unwrap_or(&"?"),
            bytes,
            r.algorithm.as_deref().unwrap_or("-"),
            num(r.median(OURS))
        );
        for m in mpis {
            out += &format!(" {:>10}", num(r.median(m.key)));
        }
        for m in mpis {
            out += &format!(" {:>10}", num(r.ratio(m.key)));
        }
        out.push('\n');
    }
    out
}

/// The goal: all-reduce and broadcast at or below Open MPI's latency at 8 B and 1 MiB.
fn goal(rows: &BTreeMap<Key, Row>, ranks: &[u32]) -> Vec<String> {
    let mut out = Vec::new();
    for &n in ranks {
        for op in ["allreduce", "bcast"] {
            let i = osu::OPS.iter().position(|o| *o == op).expect("known");
            for bytes in [8, 1 << 20] {
                let Some(r) = rows.get(&(n, i, bytes)).and_then(|r| r.ratio("openmpi")) else { continue };
                let verdict = if r <= 1.0 { "met" } else { "NOT met" };
                out.push(format!("goal {op} {bytes} B, {n} ranks: ferrocomm / Open MPI = {r:.2} ({verdict})"));
            }
        }
    }
    out
}

fn to_json(
    opts: &Options,
    rows: &BTreeMap<Key, Row>,
    mpis: &[Mpi],
    transport: &str,
    commands: &[String],
    interference: &[Value],
) -> Value {
    let rows: Vec<Value> = rows
        .iter()
        .map(|(&(n, op, bytes), r)| {
            let mut v = json!({
                "ranks": n,
                "op": osu::OPS.get(op).unwrap_or(&"?"),
                "bytes": bytes,
                "algorithm": r.algorithm,
                "ferrocomm_us": r.median(OURS),
                "runs_us": r.runs,
            });
            for m in mpis {
                v[format!("{}_us", m.key)] = json!(r.median(m.key));
                v[format!("ratio_{}", m.key)] = json!(r.ratio(m.key));
            }
            v
        })
        .collect();
    let s = &opts.schedule;
    json!({
        "bench": "collectives",
        "method": "OSU: warm-up, timed iterations each followed by a barrier; per-rank mean latency, averaged over ranks",
        "transport": transport,
        "progress": opts.progress,
        "ferrocomm_env": opts.env,
        "peers": mpis.iter().map(|m| m.name).collect::<Vec<_>>(),
        "runs": opts.runs,
        "statistic": "median over runs",
        "iterations": {"small": s.iters, "warmup": s.warmup, "large": s.iters_large, "warmup_large": s.warmup_large, "large_above_bytes": s.large},
        "cpus": s.cpus,
        "commands": commands,
        "interference": interference,
        "rows": rows,
    })
}

fn write_json(path: &std::path::Path, v: &Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v)? + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
    println!("wrote {}", path.display());
    Ok(())
}

/// ferrocomm alone, each algorithm pinned in turn.
fn sweep(opts: &Options) -> Result<()> {
    let started = Instant::now();
    // (ranks, op, bytes) -> algorithm -> run latencies.
    let mut found: BTreeMap<Key, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    let mut watch = Watch { busiest: 0.0, log: Vec::new() };
    let mut commands = Vec::new();
    for run in 1..=opts.runs {
        for &n in &opts.ranks {
            for op in &opts.schedule.ops {
                let operation: Operation = op.parse()?;
                let schedule = Schedule { ops: vec![op.clone()], ..opts.schedule.clone() };
                for alg in Algorithm::for_operation(operation) {
                    let job = spec(opts, n, &schedule, Some(format!("{operation}={alg}")));
                    if run == 1 {
                        commands.push(job.describe());
                    }
                    let meter = process::Interference::start(&schedule.cpus);
                    let result = coll_ranks::run(&job)?;
                    watch.note(meter, run, n, &format!("{op}={alg}"));
                    for m in result.measurements {
                        // The pin does not hold when the algorithm cannot serve the call.
                        let used = m.algorithm.clone().unwrap_or_default();
                        if used != alg.to_string() {
                            continue;
                        }
                        found.entry(key(n, &m)).or_default().entry(used).or_default().push(m.avg_us);
                    }
                }
            }
            eprintln!("run {run}/{}: {n} ranks done, {:.0} s", opts.runs, started.elapsed().as_secs_f64());
        }
    }
    let mut out = String::new();
    let mut last: Option<(u32, usize)> = None;
    let mut doc = Vec::new();
    for (&(n, op, bytes), algs) in &found {
        if last != Some((n, op)) {
            out += &format!("\n{n} ranks, {}:\n", osu::OPS.get(op).unwrap_or(&"?"));
            last = Some((n, op));
        }
        let medians: Vec<(String, f64)> = algs.iter().filter_map(|(a, v)| Some((a.clone(), median(v)?))).collect();
        let best = medians.iter().min_by(|a, b| a.1.total_cmp(&b.1)).map(|b| b.0.clone()).unwrap_or_default();
        out += &format!("{bytes:>9} B  best {best:<20}");
        for (a, v) in &medians {
            out += &format!(" {a} {}", num(Some(*v)));
        }
        out.push('\n');
        doc.push(json!({"ranks": n, "op": osu::OPS.get(op), "bytes": bytes, "best": best, "median_us": medians.iter().cloned().collect::<BTreeMap<_, _>>()}));
    }
    print!("{out}");
    if let Some(path) = &opts.json {
        let v = json!({
            "bench": "collectives --sweep",
            "progress": opts.progress,
            "runs": opts.runs,
            "statistic": "median over runs",
            "commands": commands,
            "interference": watch.log,
            "rows": doc,
        });
        write_json(path, &v)?;
    }
    println!("total time {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn options() {
        let o = Options::parse(&args("--ranks 2,3 --ops bcast,allreduce --max 64K --step 2 --runs 5 --no-mpi"))
            .unwrap()
            .unwrap();
        assert_eq!(o.ranks, vec![2, 3]);
        assert_eq!(o.schedule.ops, vec!["bcast", "allreduce"]);
        assert_eq!(o.schedule.sizes.last(), Some(&65536));
        assert_eq!(o.schedule.sizes.len(), 14);
        assert!(o.mpis.is_empty() && o.runs == 5 && !o.sweep);
        assert!(Options::parse(&args("--help")).unwrap().is_none());
        for bad in ["--ranks 1", "--ops scan", "--runs 0", "--iters 0", "--frobnicate"] {
            assert!(Options::parse(&args(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn ratios_and_goal() {
        let mut rows = BTreeMap::new();
        let mut r = Row::default();
        r.runs.insert(OURS.into(), vec![1.0, 3.0, 2.0]);
        r.runs.insert("openmpi".into(), vec![4.0]);
        let allreduce = osu::OPS.iter().position(|o| *o == "allreduce").unwrap();
        rows.insert((2, allreduce, 8), r);
        assert_eq!(rows[&(2, allreduce, 8)].ratio("openmpi"), Some(0.5));
        assert_eq!(rows[&(2, allreduce, 8)].ratio("mpich"), None);
        let g = goal(&rows, &[2]);
        assert_eq!(g.len(), 1);
        assert!(g[0].contains("allreduce 8 B") && g[0].ends_with("(met)"), "{g:?}");
    }
}
