//! `collectives`: OSU-style collective latency of ferrocomm next to Open MPI and MPICH, in one
//! invocation; and `--sweep`, which pins each algorithm in turn to find the selection table's
//! switch points.
//!
//! The sides take turns in short slices: for every rank count and every group of `--slice-ops`
//! operations (one by default), ferrocomm ([`coll_ranks`]) and each MPI running
//! `benches/mpi/osu_coll.c` ([`osu::Mpi`]) measure the group at every size with the same schedule
//! (sizes, warm-up and timed iterations, CPU of each rank), `--runs` times each, the order of the
//! sides rotating from round to round. The report gives, per size, each side's median over its
//! slices of the OSU average latency (mean over ranks of each rank's mean), and the ratio ferrocomm
//! / MPI (below 1: ferrocomm is faster) as the median of the per-round ratios with their min-max:
//! the sides of a round run seconds apart, so a phase of the host that slows both cancels.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use ferrocomm::{Algorithm, Operation};
use serde_json::{Value, json};

use crate::coll_ranks::{self, JobSpec};
use crate::osu::{self, Measurement, Mpi, Schedule};
use crate::sweep::median;
use crate::{Result, affinity, cli, plot, process};

/// Other work above this share of the benchmark's CPUs, during a run, earns a warning.
const LOAD_WARNING: f64 = 0.05;
/// The side name of ferrocomm in rows and JSON.
const OURS: &str = "ferrocomm";

/// ferrocomm vs Open MPI and MPICH: collective latency (OSU method, shared memory).
///
/// OSU-style latency (warm-up, then timed iterations each followed by a barrier; per-rank mean,
/// averaged over ranks) of barrier, broadcast, all-reduce (f32 sum), all-gather and all-to-all,
/// for ferrocomm over shared memory and for Open MPI and MPICH running benches/mpi/osu_coll.c
/// (built here with mpicc.openmpi and mpicc.mpich), in interleaved slices (one operation at
/// every size, each side in turn, --runs rounds); ratios are medians (min-max) of the per-round
/// ratios.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Rank counts
    #[arg(long, value_name = "N,M,...", value_delimiter = ',', default_value = "2,4",
          value_parser = clap::value_parser!(u32).range(2..))]
    pub ranks: Vec<u32>,
    /// Operations, of barrier,bcast,allreduce,allgather,alltoall (the default), reduce, gather,
    /// scatter, reduce_scatter, scan and sendrecv
    #[arg(long, value_name = "OP,...", value_delimiter = ',', default_value = "barrier,bcast,allreduce,allgather,alltoall",
          value_parser = osu::OPS)]
    pub ops: Vec<String>,
    /// Largest size; sizes are 8 B times --step while below, and --max
    #[arg(long, value_name = "BYTES", default_value = "1M", value_parser = cli::bytes)]
    pub max: usize,
    /// Size factor (2 for every power of two)
    #[arg(long, value_name = "K", default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..))]
    pub step: u32,
    /// Timed iterations per size up to --large bytes (OSU's default)
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = cli::at_least_one_u64)]
    pub iters: u64,
    /// Warm-up iterations per size up to --large bytes
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub warmup: u64,
    /// Timed iterations per size above --large bytes
    #[arg(long, value_name = "N", default_value_t = 100, value_parser = cli::at_least_one_u64)]
    pub iters_large: u64,
    /// Warm-up iterations per size above --large bytes
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub warmup_large: u64,
    /// Where the large sizes begin
    #[arg(long, value_name = "BYTES", default_value = "8K", value_parser = cli::bytes)]
    pub large: usize,
    /// Slices per side (rounds): the report gives medians over them, and the median (min-max) of
    /// the per-round ratios
    #[arg(long, visible_alias = "slices", value_name = "K", default_value_t = 3, value_parser = cli::at_least_one)]
    pub runs: usize,
    /// Operations measured in one slice (0: all of them, each side running the whole schedule
    /// in turn)
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub slice_ops: usize,
    /// Rank r runs on the (r mod count)-th CPU, on every side
    #[arg(long, value_name = "A,B,...", value_delimiter = ',', default_value = "0,1")]
    pub cpus: Vec<usize>,
    /// ferrocomm progress mode (busy, as MPI busy-polls)
    #[arg(long, default_value = "busy", value_parser = cli::progress)]
    pub progress: String,
    /// MPIs to compare with
    #[arg(long, value_name = "M,...", value_delimiter = ',', default_value = "openmpi,mpich",
          value_parser = Mpi::KEYS)]
    pub mpi: Vec<String>,
    /// ferrocomm alone (no MPI)
    #[arg(long)]
    pub no_mpi: bool,
    /// Extra environment of the ferrocomm ranks only (repeatable), e.g. GLIBC_TUNABLES=... to
    /// try allocator settings
    #[arg(long, value_name = "KEY=VALUE", value_parser = cli::key_value)]
    pub env: Vec<String>,
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write latency against size as SVG, one panel per operation and rank count (with --sweep:
    /// one curve per algorithm)
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Instead: ferrocomm alone, each algorithm of each operation pinned in turn
    /// (Comm::with_collective_table), to find the selection table's switch points
    #[arg(long)]
    pub sweep: bool,
}

impl Options {
    /// The OSU schedule these options ask for.
    pub(crate) fn schedule(&self) -> Schedule {
        Schedule {
            ops: self.ops.clone(),
            sizes: osu::sizes(self.max, self.step as usize),
            iters: self.iters,
            warmup: self.warmup,
            iters_large: self.iters_large,
            warmup_large: self.warmup_large,
            large: self.large,
            cpus: self.cpus.clone(),
        }
    }

    /// The MPIs to run (none with --no-mpi).
    pub(crate) fn mpis(&self) -> &[String] {
        if self.no_mpi { &[] } else { &self.mpi }
    }
}

/// Every slice's latency of each side at one (ranks, operation, size).
#[derive(Clone, Debug, Default)]
struct Row {
    /// Side -> average latency of each slice, microseconds; the `k`-th of every side come from
    /// the same round.
    runs: BTreeMap<String, Vec<f64>>,
    /// The algorithm ferrocomm chose.
    algorithm: Option<String>,
}

impl Row {
    fn median(&self, side: &str) -> Option<f64> {
        self.runs.get(side).and_then(|v| median(v))
    }
    /// ferrocomm's latency over `side`'s, round by round.
    fn slice_ratios(&self, side: &str) -> Vec<f64> {
        let (Some(ours), Some(theirs)) = (self.runs.get(OURS), self.runs.get(side)) else { return vec![] };
        ours.iter().zip(theirs).filter(|&(&a, &b)| a > 0.0 && b > 0.0).map(|(a, b)| a / b).collect()
    }
    /// The median of [`Row::slice_ratios`].
    fn ratio(&self, side: &str) -> Option<f64> {
        median(&self.slice_ratios(side))
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
pub(crate) fn main(opts: Options) -> Result<()> {
    let schedule = opts.schedule();
    if schedule.sizes.is_empty() {
        return Err("--max must be at least 8 bytes".into());
    }
    let allowed = affinity::allowed_cpus()?;
    if let Some(c) = schedule.cpus.iter().find(|c| !allowed.contains(c)) {
        return Err(format!("CPU {c} is not available to this process (available: {allowed:?}); see --cpus").into());
    }
    if opts.sweep { sweep(&opts, &schedule) } else { compare(&opts, &schedule) }
}

fn spec(opts: &Options, ranks: u32, schedule: &Schedule, pin: Option<String>) -> JobSpec {
    JobSpec { ranks, progress: opts.progress.clone(), pin, env: opts.env.clone(), schedule: schedule.clone() }
}

/// ferrocomm and the MPIs, side by side.
fn compare(opts: &Options, s: &Schedule) -> Result<()> {
    let started = Instant::now();
    let dir = std::env::current_exe()?.parent().ok_or("the executable has no directory")?.join("osu_coll");
    let mpis = opts.mpis().iter().map(|k| Mpi::build(k, &dir)).collect::<Result<Vec<_>>>()?;
    println!(
        "collectives, OSU method: {} sizes from {} to {} B, {} iterations after {} warm-up ({} after {} above {} B), \
         {} slice(s) per side, one slice = {} operation(s) at every size, ranks on CPUs {:?}",
        s.sizes.len(),
        s.sizes.first().unwrap_or(&0),
        s.sizes.last().unwrap_or(&0),
        s.iters,
        s.warmup,
        s.iters_large,
        s.warmup_large,
        s.large,
        opts.runs,
        if opts.slice_ops == 0 { s.ops.len() } else { opts.slice_ops },
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
    let per_slice = if opts.slice_ops == 0 { s.ops.len() } else { opts.slice_ops };
    let groups: Vec<&[String]> = s.ops.chunks(per_slice).collect();
    let bar = cli::Progress::new((opts.runs * opts.ranks.len() * groups.len() * sides) as u64, "collectives");
    for &n in &opts.ranks {
        for group in &groups {
            let schedule = Schedule { ops: group.to_vec(), ..s.clone() };
            let what = group.join(",");
            for run in 1..=opts.runs {
                // Rotate the order of the sides from round to round.
                let mut line = format!("{n} ranks, {what}, slice {run}/{}:", opts.runs);
                for i in 0..sides {
                    let side = (i + run - 1) % sides;
                    let name = if side == 0 { OURS } else { mpis[side - 1].key };
                    bar.step(format!("{n} ranks, {what}, slice {run}: {name}"));
                    let meter = process::Interference::start(&s.cpus);
                    let t = Instant::now();
                    let found = if side == 0 {
                        let r = coll_ranks::run(&spec(opts, n, &schedule, None))?;
                        transport = r.transport;
                        r.measurements
                    } else {
                        mpis[side - 1].run(n, &schedule)?
                    };
                    bar.suspend(|| watch.note(meter, run, n, &format!("{name} {what}")));
                    bar.inc();
                    line += &format!(" {name} {:.1} s", t.elapsed().as_secs_f64());
                    for m in found {
                        let row = rows.entry(key(n, &m)).or_default();
                        row.runs.entry(name.to_string()).or_default().push(m.avg_us);
                        if m.algorithm.is_some() {
                            row.algorithm = m.algorithm;
                        }
                    }
                }
                bar.note(line);
            }
        }
    }
    drop(bar);
    if watch.busiest > LOAD_WARNING {
        println!(
            "warning: other work took up to {:.0}% of the CPUs during a run; the results are noisy",
            watch.busiest * 100.0
        );
    }
    println!(
        "\nferrocomm transport: {transport}; latencies in us (median over slices); ratio = ferrocomm / MPI, the median \
         (min-max) of the per-round ratios\n"
    );
    print!("{}", table(&rows, &mpis));
    println!();
    for line in goal(&rows, &opts.ranks) {
        println!("{line}");
    }
    if let Some(path) = &opts.json {
        let doc = to_json(opts, &rows, &mpis, &transport, &commands, &watch.log);
        write_json(path, &doc)?;
    }
    if let Some(path) = &opts.plot {
        // One panel per (ranks, operation): ferrocomm and each MPI.
        let sides: Vec<&str> = std::iter::once(OURS).chain(mpis.iter().map(|m| m.key)).collect();
        let panels = panels(&rows, |r| sides.iter().map(|&side| (side.to_string(), r.median(side))).collect());
        let title = match mpis.is_empty() {
            true => "ferrocomm: collective latency".to_string(),
            false => format!(
                "ferrocomm vs {}: collective latency",
                mpis.iter().map(|m| m.name).collect::<Vec<_>>().join(", ")
            ),
        };
        let subtitle = format!(
            "OSU method over shared memory ({transport}), progress {}, CPUs {:?}, median of {} slice(s)",
            opts.progress, s.cpus, opts.runs
        );
        plot::write(path, &plot::figure(&title, &subtitle, &panels))?;
    }
    println!("total time {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// One latency panel per (ranks, operation) of `rows` with a size axis (the barrier has none);
/// `curves` gives a row's named values (median latency in µs, `None` where not measured).
fn panels<R>(rows: &BTreeMap<Key, R>, curves: impl Fn(&R) -> Vec<(String, Option<f64>)>) -> Vec<plot::Panel> {
    let mut panels: Vec<plot::Panel> = Vec::new();
    let mut last = None;
    for (&(n, op, bytes), r) in rows {
        if bytes == 0 {
            continue;
        }
        if last != Some((n, op)) {
            last = Some((n, op));
            panels.push(plot::Panel {
                title: format!("{}, {n} ranks", osu::OPS.get(op).unwrap_or(&"?")),
                ylabel: "latency (µs)".into(),
                y: plot::YAxis::Log,
                series: Vec::new(),
            });
        }
        let panel = panels.last_mut().expect("pushed");
        for (name, v) in curves(r) {
            let Some(v) = v else { continue };
            match panel.series.iter_mut().find(|s| s.name == name) {
                Some(s) => s.points.push((bytes as f64, v)),
                None => panel.series.push(plot::Series { name, points: vec![(bytes as f64, v)] }),
            }
        }
    }
    panels
}

fn table(rows: &BTreeMap<Key, Row>, mpis: &[Mpi]) -> String {
    let mut out = format!("{:>5} {:>9} {:>8} {:>18} {:>10}", "ranks", "op", "bytes", "algorithm", OURS);
    for m in mpis {
        out += &format!(" {:>10}", m.key);
    }
    for m in mpis {
        out += &format!(" {:>18}", format!("/{} (min-max)", m.key));
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
            out += &format!(" {:>18}", crate::report::ratio_text(&r.slice_ratios(m.key)));
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
                "slices_us": r.runs,
            });
            for m in mpis {
                v[format!("{}_us", m.key)] = json!(r.median(m.key));
                v[format!("ratio_{}", m.key)] = json!(r.ratio(m.key));
                v[format!("ratio_{}_spread", m.key)] = crate::report::ratio_json(&r.slice_ratios(m.key));
            }
            v
        })
        .collect();
    let s = &opts.schedule();
    json!({
        "bench": "collectives",
        "method": "OSU: warm-up, timed iterations each followed by a barrier; per-rank mean latency, averaged over ranks",
        "transport": transport,
        "progress": opts.progress,
        "ferrocomm_env": opts.env,
        "peers": mpis.iter().map(|m| m.name).collect::<Vec<_>>(),
        "slices": opts.runs,
        "ops_per_slice": opts.slice_ops,
        "statistic": "per size, each side: the median over its slices; ratio: ferrocomm's latency over the MPI's in each round of slices (run back to back), median and min-max (ratio_<mpi>_spread) over the rounds",
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
fn sweep(opts: &Options, s: &Schedule) -> Result<()> {
    let started = Instant::now();
    // (ranks, op, bytes) -> algorithm -> run latencies.
    let mut found: BTreeMap<Key, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
    let mut watch = Watch { busiest: 0.0, log: Vec::new() };
    let mut commands = Vec::new();
    // Over verbs, the RDMA tier is one more curve where it serves.
    let verbs = opts.env.iter().any(|e| e == "FERROCOMM_TRANSPORTS=verbs");
    let menu = |o: Operation| {
        let mut algs = Algorithm::for_operation(o).to_vec();
        if verbs && Algorithm::rdma_serves(o) {
            algs.push(Algorithm::Rdma);
        }
        algs
    };
    let algorithms: usize = s.ops.iter().map(|op| op.parse::<Operation>().map_or(0, |o| menu(o).len())).sum();
    let bar = cli::Progress::new((opts.runs * opts.ranks.len() * algorithms) as u64, "collectives --sweep");
    for run in 1..=opts.runs {
        for &n in &opts.ranks {
            for op in &s.ops {
                let operation: Operation = op.parse()?;
                let schedule = Schedule { ops: vec![op.clone()], ..s.clone() };
                for alg in menu(operation) {
                    bar.step(format!("run {run}: {n} ranks: {op}={alg}"));
                    let job = spec(opts, n, &schedule, Some(format!("{operation}={alg}")));
                    if run == 1 {
                        commands.push(job.describe());
                    }
                    let meter = process::Interference::start(&schedule.cpus);
                    let result = coll_ranks::run(&job)?;
                    bar.suspend(|| watch.note(meter, run, n, &format!("{op}={alg}")));
                    bar.inc();
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
            bar.note(format!("run {run}/{}: {n} ranks done, {:.0} s", opts.runs, started.elapsed().as_secs_f64()));
        }
    }
    drop(bar);
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
    if let Some(path) = &opts.plot {
        // One panel per (ranks, operation), one curve per algorithm.
        let panels = panels(&found, |algs| algs.iter().map(|(a, v)| (a.clone(), median(v))).collect());
        let subtitle = format!(
            "each algorithm pinned in turn, progress {}, CPUs {:?}, median of {} run(s)",
            opts.progress, s.cpus, opts.runs
        );
        plot::write(path, &plot::figure("ferrocomm: collective latency by algorithm", &subtitle, &panels))?;
    }
    println!("total time {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(line: &str) -> std::result::Result<Options, clap::Error> {
        match crate::tests::parse(&format!("collectives {line}"))? {
            crate::Command::Collectives(o) => Ok(o),
            other => panic!("not collectives: {other:?}"),
        }
    }

    #[test]
    fn options_parse() {
        let o = options("--ranks 2,3 --ops bcast,allreduce --max 64K --step 2 --runs 5 --no-mpi --large 16K").unwrap();
        let s = o.schedule();
        assert_eq!(o.ranks, vec![2, 3]);
        assert_eq!(s.ops, vec!["bcast", "allreduce"]);
        assert_eq!(s.sizes.last(), Some(&65536));
        assert_eq!(s.sizes.len(), 14);
        assert_eq!(s.large, 16384);
        assert!(o.mpis().is_empty() && o.runs == 5 && !o.sweep);
        let d = options("--env A=1 --env B=2=3").unwrap();
        assert_eq!(
            (d.mpis(), d.env.as_slice()),
            (&["openmpi".to_string(), "mpich".into()][..], &["A=1".to_string(), "B=2=3".into()][..])
        );
        assert_eq!(d.schedule(), Schedule::default());
        assert_eq!(options("--ops gather,scatter,reduce_scatter,scan").unwrap().ops.len(), 4);
        for bad in ["--ranks 1", "--ops exscan", "--runs 0", "--iters 0", "--mpi lam", "--env X", "--frobnicate"] {
            assert!(options(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ratios_and_goal() {
        let mut rows = BTreeMap::new();
        let mut r = Row::default();
        // Round 2 is a slow phase for both sides: the per-round ratios are unmoved by it.
        r.runs.insert(OURS.into(), vec![1.0, 6.0, 2.0]);
        r.runs.insert("openmpi".into(), vec![2.0, 12.0, 5.0]);
        let allreduce = osu::OPS.iter().position(|o| *o == "allreduce").unwrap();
        rows.insert((2, allreduce, 8), r);
        assert_eq!(rows[&(2, allreduce, 8)].slice_ratios("openmpi"), vec![0.5, 0.5, 0.4]);
        assert_eq!(rows[&(2, allreduce, 8)].ratio("openmpi"), Some(0.5));
        assert!(table(&rows, &[]).contains("allreduce"));
        assert_eq!(rows[&(2, allreduce, 8)].ratio("mpich"), None);
        let g = goal(&rows, &[2]);
        assert_eq!(g.len(), 1);
        assert!(g[0].contains("allreduce 8 B") && g[0].ends_with("(met)"), "{g:?}");
    }
}
