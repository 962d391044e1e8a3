//! `pingpong`: options, the runs (ferrocomm and NPtcp, alternating), and the report.

use std::path::PathBuf;
use std::time::Instant;

use serde_json::json;

use crate::netpipe::NetPipe;
use crate::perftest::{self, Perftest};
use crate::ranks::{self, JobSpec};
use crate::report::{self, Meta, Row};
use crate::{Result, affinity, plot, process, sweep};

/// Other work above this share of the benchmark's CPUs, during a run, earns a warning.
const LOAD_WARNING: f64 = 0.05;

pub const USAGE: &str = "\
usage: ferrocomm-bench pingpong [options]

Ping-pong latency and throughput of ferrocomm against NPtcp (NetPIPE), NetPIPE method: sizes 1 B
and powers of two up to --max, each also at -3 and +3 bytes; medians over --runs runs.

options:
  --transport T             transport to measure: tcp (default), shm (use with --no-peer), or
                            verbs (build with --features verbs; the peer is then perftest's
                            ib_send_lat at 8 B and ib_write_bw at 1 MiB on the same device)
  --device D                RDMA device for verbs (default: the first one)
  --gid-index N             GID index for verbs (default: the first RoCE v2 IPv4 entry)
  --backend B               ferrocomm TCP backend: auto, uring or portable (default auto)
  --progress P              ferrocomm progress: busy, adaptive[:US] or blocking (default busy)
  --max BYTES               largest power of two measured, e.g. 65536, 64K, 8M (default 8M)
  --runs K                  runs per side; the report gives medians (default 3)
  --cpus A,B                CPUs of rank 0 / NPtcp transmitter and rank 1 / receiver (default 0,1)
  --json FILE               write the results as JSON
  --plot FILE.svg           write throughput and latency plots as SVG
  --no-peer                 measure ferrocomm alone (no NPtcp needed)
  --recv-into               ferrocomm receives with recv_into into one reused buffer per rank
                            instead of recv (a buffer per message)";

/// The options of `pingpong`.
#[derive(Clone, Debug)]
pub struct Options {
    pub backend: String,
    pub progress: String,
    pub max: usize,
    pub runs: usize,
    pub cpus: [usize; 2],
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub peer: bool,
    pub recv_into: bool,
    pub device: Option<String>,
    pub gid_index: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            backend: "auto".into(),
            progress: "busy".into(),
            max: 8 << 20,
            runs: 3,
            cpus: [0, 1],
            json: None,
            plot: None,
            peer: true,
            recv_into: false,
            device: None,
            gid_index: None,
        }
    }
}

impl Options {
    /// Parses `args`; `None` when help was asked for.
    pub fn parse(args: &[String]) -> Result<Option<Options>> {
        let mut o = Options::default();
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
                _ => (arg.as_str(), None),
            };
            let mut value = || inline.clone().or_else(|| it.next().cloned()).ok_or(format!("{flag} needs a value"));
            match flag {
                "-h" | "--help" => return Ok(None),
                "--transport" => {
                    match value()?.as_str() {
                        "tcp" => {}
                        // Shared memory between the two local ranks (no NetPIPE peer for it yet).
                        "shm" => o.backend = "shm".into(),
                        // RDMA verbs between the two local ranks (perftest is the peer).
                        "verbs" => o.backend = "verbs".into(),
                        t => return Err(format!("--transport {t}: tcp, shm or verbs").into()),
                    }
                }
                "--backend" => {
                    let b = value()?;
                    b.parse::<ferrocomm::TcpBackend>().map_err(|e| format!("--backend: {e}"))?;
                    o.backend = b;
                }
                "--progress" => {
                    let p = value()?;
                    p.parse::<ferrocomm::ProgressMode>().map_err(|e| format!("--progress: {e}"))?;
                    o.progress = p;
                }
                "--max" => o.max = parse_bytes(&value()?)?,
                "--runs" => {
                    o.runs = value()?.parse().map_err(|e| format!("--runs: {e}"))?;
                    if o.runs == 0 {
                        return Err("--runs must be at least 1".into());
                    }
                }
                "--cpus" => o.cpus = parse_cpus(&value()?)?,
                "--json" => o.json = Some(value()?.into()),
                "--plot" => o.plot = Some(value()?.into()),
                "--no-peer" => o.peer = false,
                "--device" => o.device = Some(value()?),
                "--gid-index" => o.gid_index = Some(value()?.parse().map_err(|e| format!("--gid-index: {e}"))?),
                "--recv-into" => o.recv_into = true,
                other => return Err(format!("unknown option {other:?}\n{USAGE}").into()),
            }
        }
        Ok(Some(o))
    }
}

fn receive_call(recv_into: bool) -> &'static str {
    if recv_into { "recv_into (one reused buffer)" } else { "recv" }
}

/// `A,B`: two CPU numbers.
pub fn parse_cpus(s: &str) -> Result<[usize; 2]> {
    let parsed: Option<Vec<usize>> = s.split(',').map(|c| c.trim().parse().ok()).collect();
    match parsed.as_deref() {
        Some(&[a, b]) => Ok([a, b]),
        _ => Err(format!("--cpus {s:?}: expected two CPU numbers, A,B").into()),
    }
}

/// A byte count: digits with an optional binary suffix (`K`, `M`, `G`, optionally `iB`/`B`).
pub fn parse_bytes(s: &str) -> Result<usize> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(digits);
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        _ => return Err(format!("{s:?}: not a byte count (e.g. 65536, 64K, 8M)").into()),
    };
    let n: usize = num.parse().map_err(|_| format!("{s:?}: not a byte count (e.g. 65536, 64K, 8M)"))?;
    match n.checked_mul(1 << shift) {
        Some(v) if (1..=1 << 30).contains(&v) => Ok(v),
        _ => Err(format!("{s:?}: must be between 1 byte and 1 GiB").into()),
    }
}

/// `ferrocomm-bench pingpong`.
pub fn main(args: &[String]) -> Result<()> {
    let Some(opts) = Options::parse(args)? else {
        println!("{USAGE}");
        return Ok(());
    };
    let started = Instant::now();
    let allowed = affinity::allowed_cpus()?;
    if let Some(c) = opts.cpus.iter().find(|c| !allowed.contains(c)) {
        return Err(format!("CPU {c} is not available to this process (available: {allowed:?}); see --cpus").into());
    }
    if opts.cpus[0] == opts.cpus[1] {
        eprintln!("warning: both sides on CPU {}: they will take turns, not run at once", opts.cpus[0]);
    }
    let verbs = opts.backend == "verbs";
    let mut env = Vec::new();
    let mut perf = None;
    if verbs {
        let device = opts.device.clone().or_else(perftest::first_device).ok_or("--transport verbs: no RDMA device")?;
        let gid = opts.gid_index.unwrap_or_else(|| perftest::default_gid_index(&device));
        env.push(("FERROCOMM_VERBS_DEVICE".to_string(), device.clone()));
        env.push(("FERROCOMM_VERBS_GID_INDEX".to_string(), gid.to_string()));
        if opts.peer {
            perf = Some(Perftest::find(&device, gid)?);
        }
    }
    let peer = if opts.peer && !verbs { Some(NetPipe::find()?) } else { None };
    let peer_name = peer.as_ref().map(|_| "NPtcp").or(perf.as_ref().map(|_| "perftest"));
    let spec = JobSpec {
        backend: opts.backend.clone(),
        progress: opts.progress.clone(),
        max: opts.max,
        cpus: opts.cpus,
        recv_into: opts.recv_into,
        env,
    };
    let sizes = sweep::sizes(opts.max);
    let mut rows: Vec<Row> = sizes.iter().map(|&bytes| Row { bytes, ..Row::default() }).collect();

    println!(
        "pingpong over TCP on 127.0.0.1, NetPIPE method: {} sizes from 1 to {} bytes, median of {} run(s), CPUs {},{}",
        sizes.len(),
        sweep::largest(opts.max),
        opts.runs,
        opts.cpus[0],
        opts.cpus[1]
    );
    println!(
        "ferrocomm: FERROCOMM_TCP_BACKEND={} FERROCOMM_PROGRESS={}, 2 ranks via ferrocomm::launch::run_local, receives with {}",
        opts.backend,
        opts.progress,
        receive_call(opts.recv_into)
    );
    if let Some(np) = &peer {
        println!("peer: {}  (once per size)", np.describe(opts.cpus, "SIZE"));
    }
    if let Some(p) = &perf {
        println!("peer: {}  (once per run)", p.describe());
    }

    let mut transport_name = String::from("?");
    let mut perf_typical = Vec::new();
    let mut busiest = 0.0_f64;
    let mut interference = Vec::new();
    // Other work on the benchmark's CPUs during one side's sweep, noted and warned about.
    let mut watch = |meter: Option<process::Interference>, run: usize, side: &str| {
        let share = meter.and_then(|m| m.share());
        if let Some(share) = share {
            busiest = busiest.max(share);
            if share > LOAD_WARNING {
                eprintln!("warning: other work took {:.0}% of the CPUs during run {run} of {side}", share * 100.0);
            }
        }
        interference.push(json!({"run": run, "side": side, "share": share}));
    };
    for run in 1..=opts.runs {
        let meter = process::Interference::start(&opts.cpus);
        let t = Instant::now();
        let result = ranks::run_sweep(&spec)?;
        for s in &result.samples {
            if let Some(row) = rows.iter_mut().find(|r| r.bytes == s.bytes) {
                row.ferrocomm.push(s.one_way);
                row.ferrocomm_median.push(s.median_one_way);
            }
        }
        let iterations: u64 = result.samples.iter().map(|s| s.iterations).sum();
        eprintln!(
            "run {run}/{}: ferrocomm ({}): {} sizes, {iterations} timed round trips, {:.1} s",
            opts.runs,
            result.transport,
            result.samples.len(),
            t.elapsed().as_secs_f64()
        );
        transport_name = result.transport;
        watch(meter, run, "ferrocomm");
        if let Some(np) = &peer {
            let meter = process::Interference::start(&opts.cpus);
            let t = Instant::now();
            for row in rows.iter_mut() {
                row.peer.push(np.measure(row.bytes, opts.cpus)?);
            }
            watch(meter, run, "NPtcp");
            eprintln!("run {run}/{}: NPtcp: {} sizes, {:.1} s", opts.runs, rows.len(), t.elapsed().as_secs_f64());
        }
        if let Some(p) = &perf {
            // The peer's figures go into the rows of their sizes, as one-way times.
            let t = Instant::now();
            let (lat, typical) = p.send_lat(8, opts.cpus)?;
            perf_typical.push(typical);
            let bw = p.write_bw(1 << 20, opts.cpus)?;
            for (bytes, one_way) in [(8, lat), (1 << 20, (1 << 20) as f64 / (bw * 1e6))] {
                if let Some(row) = rows.iter_mut().find(|r| r.bytes == bytes) {
                    row.peer.push(one_way);
                }
            }
            eprintln!(
                "run {run}/{}: perftest: ib_send_lat 8 B mean {:.2} us (median {:.2} us), ib_write_bw 1 MiB {bw:.1} MB/s, {:.1} s",
                opts.runs,
                lat * 1e6,
                typical * 1e6,
                t.elapsed().as_secs_f64()
            );
        }
    }

    if busiest > LOAD_WARNING {
        println!(
            "warning: other work took up to {:.0}% of CPUs {},{} during a sweep; the results are noisy",
            busiest * 100.0,
            opts.cpus[0],
            opts.cpus[1]
        );
    }
    println!();
    print!("{}", report::table(&rows));
    println!();
    println!("{}", report::summary(&rows, peer_name));
    let verbs_ratios = perf.as_ref().map(|_| report::verbs_summary(&rows, &perf_typical));
    if let Some((line, _)) = &verbs_ratios {
        println!("{line}");
    }
    let dips = report::dips(&rows, Row::ferrocomm_mbps);
    if !dips.is_empty() {
        println!("ferrocomm throughput dips (>15% below the previous size): {}", dips.join(", "));
    }
    if peer.is_some() {
        let dips = report::dips(&rows, Row::peer_mbps);
        if !dips.is_empty() {
            println!("NPtcp throughput dips (>15% below the previous size): {}", dips.join(", "));
        }
    }

    let meta = Meta {
        backend: &opts.backend,
        transport_name: &transport_name,
        progress: &opts.progress,
        receive: if opts.recv_into { "recv_into" } else { "recv" },
        peer: peer_name,
        interference: &interference,
        runs: opts.runs,
        cpus: opts.cpus,
        max: opts.max,
    };
    if let Some(path) = &opts.json {
        let mut v = report::to_json(&meta, &rows);
        if verbs {
            v["transport"] = json!("verbs");
        }
        if let Some((_, ratios)) = &verbs_ratios {
            v["verbs_vs_perftest"] = ratios.clone();
            v["verbs_vs_perftest"]["commands"] = json!(perf.as_ref().map(|p| p.describe()));
        }
        let text = serde_json::to_string_pretty(&v)?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &opts.plot {
        let what = if verbs { "verbs ping-pong on Soft-RoCE" } else { "TCP ping-pong on 127.0.0.1" };
        let title = match peer_name {
            Some(p) => format!("ferrocomm vs {p}: {what}"),
            None => format!("ferrocomm: {what}"),
        };
        let subtitle = format!(
            "backend {} ({transport_name}), progress {}, receives with {}, CPUs {},{}, median of {} run(s)",
            opts.backend,
            opts.progress,
            receive_call(opts.recv_into),
            opts.cpus[0],
            opts.cpus[1],
            opts.runs
        );
        std::fs::write(path, plot::svg(&title, &subtitle, &rows, peer_name))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("wrote {}", path.display());
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
        let o = Options::parse(&args("--backend uring --progress=adaptive:20 --max 64K --runs 5 --cpus 1,0 --no-peer"))
            .unwrap()
            .unwrap();
        assert_eq!(
            (o.backend.as_str(), o.progress.as_str(), o.max, o.runs, o.cpus),
            ("uring", "adaptive:20", 65536, 5, [1, 0])
        );
        assert!(!o.peer);
        assert!(Options::parse(&args("--help")).unwrap().is_none());
        let v = Options::parse(&args("--transport verbs --device rxe0 --gid-index 1")).unwrap().unwrap();
        assert_eq!((v.backend.as_str(), v.device.as_deref(), v.gid_index), ("verbs", Some("rxe0"), Some(1)));
        for bad in
            ["--backend rdma", "--transport udp", "--gid-index x", "--runs 0", "--max", "--cpus 1", "--frobnicate"]
        {
            assert!(Options::parse(&args(bad)).is_err(), "{bad}");
        }
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("8M").unwrap(), 8 << 20);
        assert_eq!(parse_bytes("8MiB").unwrap(), 8 << 20);
        assert_eq!(parse_bytes("4k").unwrap(), 4096);
        assert_eq!(parse_bytes("65536").unwrap(), 65536);
        assert!(parse_bytes("0").is_err() && parse_bytes("2G").is_err() && parse_bytes("x").is_err());
    }
}
