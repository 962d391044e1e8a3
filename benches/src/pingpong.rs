//! `pingpong`: options, the runs (ferrocomm and its peers, alternating), and the report.
//!
//! Over TCP the peer is `NPtcp`; over shared memory (`--transport shm`) the peers are `NPopenmpi`
//! and `NPmpich2`, and the report adds what explains the numbers: the machine's limits
//! ([`reference`](mod@reference)), the shared-memory transport alone
//! ([`transport`](mod@transport)), and the latency to an idle peer in adaptive and busy-poll
//! mode ([`ranks::run_idle`]).

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{Value, json};

use crate::netpipe::{Flavour, NetPipe};
use crate::perftest::{self, Perftest};
use crate::ranks::{self, JobSpec};
use crate::report::{self, Meta, Row};
use crate::{Result, affinity, plot, process, reference, sweep, transport};

/// Other work above this share of the benchmark's CPUs, during a run, earns a warning.
const LOAD_WARNING: f64 = 0.05;

pub(crate) const USAGE: &str = "\
usage: ferrocomm-bench pingpong [options]

Ping-pong latency and throughput of ferrocomm against NetPIPE (NPtcp over TCP; NPopenmpi and
NPmpich2 over shared memory), NetPIPE method: sizes 1 B and powers of two up to --max, each also
at -3 and +3 bytes; medians over --runs runs. Over shared memory also: reference lines (cache-line
ping-pong, memcpy), the transport alone, and the latency to an idle peer (adaptive vs busy-poll).

options:
  --transport T             transport to measure: tcp (default), shm (shared memory) or verbs
                            (build with --features verbs; the peer is then perftest's
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
                            instead of recv (a buffer per message)
  --send-from               ferrocomm sends with send_from (a borrowed slice, copied as MPI
                            sends) instead of send (a shared handle)
  --idle-gap US             shm: microseconds between the pings of the idle-peer measurement
                            (default 1000; 0 skips it)
  --target-ms MS            how long ferrocomm's timed batch of each size lasts (default 30;
                            more where round trips are slow, as under emulation)
  --time-each               time every ferrocomm round trip with the CPU's cycle counter, as
                            ib_send_lat does, so that the median is the median round trip like
                            its t_typical (the default with --transport verbs; otherwise the
                            median is over 15 timed slices of each batch, the clock read once
                            per slice)";

/// The options of `pingpong`.
#[derive(Clone, Debug)]
pub(crate) struct Options {
    /// `tcp` or `shm`.
    pub transport: String,
    pub backend: String,
    pub progress: String,
    pub max: usize,
    pub runs: usize,
    pub cpus: [usize; 2],
    pub json: Option<PathBuf>,
    pub plot: Option<PathBuf>,
    pub peer: bool,
    pub recv_into: bool,
    pub send_from: bool,
    pub idle_gap_us: u64,
    pub target_ms: u64,
    /// Time each round trip (see `--time-each`).
    pub time_each: bool,
    pub device: Option<String>,
    pub gid_index: Option<u32>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            transport: "tcp".into(),
            backend: "auto".into(),
            progress: "busy".into(),
            max: 8 << 20,
            runs: 3,
            cpus: [0, 1],
            json: None,
            plot: None,
            peer: true,
            recv_into: false,
            send_from: false,
            idle_gap_us: 1000,
            target_ms: sweep::TARGET.as_millis() as u64,
            time_each: false,
            device: None,
            gid_index: None,
        }
    }
}

impl Options {
    /// Parses `args`; `None` when help was asked for.
    pub(crate) fn parse(args: &[String]) -> Result<Option<Options>> {
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
                "--transport" => match value()?.as_str() {
                    t @ ("tcp" | "shm" | "verbs") => o.transport = t.into(),
                    t => return Err(format!("--transport {t}: tcp, shm or verbs").into()),
                },
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
                "--send-from" => o.send_from = true,
                "--time-each" => o.time_each = true,
                "--idle-gap" => o.idle_gap_us = value()?.parse().map_err(|e| format!("--idle-gap: {e}"))?,
                "--target-ms" => {
                    o.target_ms = value()?.parse().map_err(|e| format!("--target-ms: {e}"))?;
                    if o.target_ms == 0 {
                        return Err("--target-ms must be at least 1".into());
                    }
                }
                other => return Err(format!("unknown option {other:?}\n{USAGE}").into()),
            }
        }
        // perftest's latency is the median of round trips each timed alone.
        o.time_each |= o.transport == "verbs";
        Ok(Some(o))
    }
}

fn receive_call(recv_into: bool) -> &'static str {
    if recv_into { "recv_into (one reused buffer)" } else { "recv" }
}

fn send_call(send_from: bool) -> &'static str {
    if send_from { "send_from (a borrowed slice)" } else { "send" }
}

/// `A,B`: two CPU numbers.
pub(crate) fn parse_cpus(s: &str) -> Result<[usize; 2]> {
    let parsed: Option<Vec<usize>> = s.split(',').map(|c| c.trim().parse().ok()).collect();
    match parsed.as_deref() {
        Some(&[a, b]) => Ok([a, b]),
        _ => Err(format!("--cpus {s:?}: expected two CPU numbers, A,B").into()),
    }
}

/// A byte count: digits with an optional binary suffix (`K`, `M`, `G`, optionally `iB`/`B`).
pub(crate) fn parse_bytes(s: &str) -> Result<usize> {
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
pub(crate) fn main(args: &[String]) -> Result<()> {
    // The verbs streaming measurement runs its ranks through this subcommand.
    match args.first().map(String::as_str) {
        Some(perftest::STREAM_JOB) => return perftest::stream_job_main(&args[1..]),
        Some(perftest::STREAM_RANK) => return perftest::stream_rank_main(&args[1..]),
        _ => {}
    }
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
    let shm = opts.transport == "shm";
    let verbs = opts.transport == "verbs";
    let flavours: &[Flavour] = match (opts.peer && !verbs, shm) {
        (false, _) => &[],
        (true, false) => &[Flavour::Tcp],
        (true, true) => &[Flavour::OpenMpi, Flavour::Mpich],
    };
    let peers = flavours.iter().map(|&f| NetPipe::find(f)).collect::<Result<Vec<_>>>()?;
    let mut names: Vec<&str> = peers.iter().map(NetPipe::name).collect();
    // Over verbs the peer is perftest on the same device (peer 0 of the rows).
    let mut env = Vec::new();
    let mut perf = None;
    if verbs {
        let device = opts.device.clone().or_else(perftest::first_device).ok_or("--transport verbs: no RDMA device")?;
        let gid = opts.gid_index.unwrap_or_else(|| perftest::default_gid_index(&device));
        env.push(("FERROCOMM_VERBS_DEVICE".to_string(), device.clone()));
        env.push(("FERROCOMM_VERBS_GID_INDEX".to_string(), gid.to_string()));
        if opts.peer {
            perf = Some(Perftest::find(&device, gid)?);
            names.push("perftest");
        }
    }
    let spec = JobSpec {
        backend: if shm || verbs { opts.transport.clone() } else { opts.backend.clone() },
        progress: opts.progress.clone(),
        max: opts.max,
        cpus: opts.cpus,
        recv_into: opts.recv_into,
        send_from: opts.send_from,
        idle_gap_us: 0,
        idle_jitter: false,
        target_ms: opts.target_ms,
        time_each: opts.time_each,
        env,
    };
    let sizes = sweep::sizes(opts.max);
    let mut rows: Vec<Row> =
        sizes.iter().map(|&bytes| Row { bytes, peers: vec![Vec::new(); names.len()], ..Row::default() }).collect();

    let medium = match opts.transport.as_str() {
        "shm" => "shared memory (two processes on this host)",
        "verbs" => "RDMA verbs (two processes on this host's RDMA device)",
        _ => "TCP on 127.0.0.1",
    };
    println!(
        "pingpong over {medium}, NetPIPE method: {} sizes from 1 to {} bytes, median of {} run(s), CPUs {},{}",
        sizes.len(),
        sweep::largest(opts.max),
        opts.runs,
        opts.cpus[0],
        opts.cpus[1]
    );
    let backend = if shm {
        "FERROCOMM_TRANSPORTS=auto (shm)".to_string()
    } else if verbs {
        // Inherited by the ranks, as every FERROCOMM_ variable.
        let eager = std::env::var("FERROCOMM_VERBS_EAGER").unwrap_or_else(|_| "ring".into());
        format!("FERROCOMM_TRANSPORTS=verbs FERROCOMM_VERBS_EAGER={eager}")
    } else {
        format!("FERROCOMM_TCP_BACKEND={}", opts.backend)
    };
    println!(
        "ferrocomm: {backend} FERROCOMM_PROGRESS={}, 2 ranks via ferrocomm::launch::run_local, receives with {}, sends with {}, median {}",
        opts.progress,
        receive_call(opts.recv_into),
        send_call(opts.send_from),
        if opts.time_each {
            "of round trips each timed alone (cycle counter)"
        } else {
            "of 15 timed slices per batch; best of 3 trials for NetPIPE's method"
        }
    );
    let mut described: Vec<(String, String)> =
        peers.iter().map(|p| (p.name().to_string(), p.describe(opts.cpus, "SIZE"))).collect();
    if let Some(p) = &perf {
        described.push(("perftest".to_string(), p.describe()));
    }
    for (name, command) in &described {
        println!("peer {name}: {command}  (once per size)");
    }

    let mut transport_name = String::from("?");
    let mut perf_typical = Vec::new();
    let mut stream_mbps = Vec::new();
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
                row.ferrocomm_best_trial.push(s.best_trial_one_way);
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
        if perf.is_some() && opts.max >= 1 << 20 {
            let t = Instant::now();
            let mbps = perftest::stream_bw(&opts.progress, opts.cpus, 1 << 20, &spec.env)?;
            stream_mbps.push(mbps);
            eprintln!(
                "run {run}/{}: ferrocomm streaming 1 MiB, window {}: {mbps:.1} MB/s, {:.1} s",
                opts.runs,
                perftest::WINDOW,
                t.elapsed().as_secs_f64()
            );
        }
        for (i, np) in peers.iter().enumerate() {
            let meter = process::Interference::start(&opts.cpus);
            let t = Instant::now();
            for row in rows.iter_mut() {
                row.peers[i].push(np.measure(row.bytes, opts.cpus)?);
            }
            watch(meter, run, np.name());
            eprintln!(
                "run {run}/{}: {}: {} sizes, {:.1} s",
                opts.runs,
                np.name(),
                rows.len(),
                t.elapsed().as_secs_f64()
            );
        }
        if let Some(p) = &perf {
            // perftest's figures go into the rows of their sizes, as one-way times.
            let t = Instant::now();
            let (lat, typical) = p.send_lat(8, opts.cpus)?;
            perf_typical.push(typical);
            // Only a sweep that reaches 1 MiB has a row for ib_write_bw (an 8 B run then pairs
            // ferrocomm and ib_send_lat a few seconds apart, not ten).
            let bw = if opts.max >= 1 << 20 { Some(p.write_bw(1 << 20, opts.cpus)?) } else { None };
            let last = names.len() - 1;
            let bw_one_way = bw.map(|bw| (1 << 20, (1 << 20) as f64 / (bw * 1e6)));
            for (bytes, one_way) in std::iter::once((8, lat)).chain(bw_one_way) {
                if let Some(row) = rows.iter_mut().find(|r| r.bytes == bytes) {
                    row.peers[last].push(one_way);
                }
            }
            let ours = report::row(&rows, 8).and_then(|r| r.ferrocomm_median.last().copied());
            eprintln!(
                "run {run}/{}: perftest: ib_send_lat 8 B mean {:.2} us (median {:.2} us), ib_write_bw 1 MiB {}, {:.1} s; \
                 this run's 8 B medians: ferrocomm / ib_send_lat = {}",
                opts.runs,
                lat * 1e6,
                typical * 1e6,
                bw.map_or("not run (--max below 1 MiB)".into(), |bw| format!("{bw:.1} MB/s")),
                t.elapsed().as_secs_f64(),
                ours.map_or("-".into(), |o| format!("{:.2} / {:.2} us = {:.3}", o * 1e6, typical * 1e6, o / typical)),
            );
        }
    }
    let extra = if shm { shm_extras(&opts, &rows)? } else { Value::Null };

    if busiest > LOAD_WARNING {
        println!(
            "warning: other work took up to {:.0}% of CPUs {},{} during a sweep; the results are noisy",
            busiest * 100.0,
            opts.cpus[0],
            opts.cpus[1]
        );
    }
    println!();
    print!("{}", report::table(&rows, &names));
    println!();
    println!("{}", report::summary(&rows, &names));
    if shm {
        print_shm_extras(&extra, &rows, &names);
    }
    let verbs_ratios =
        perf.as_ref().map(|_| report::verbs_summary(&rows, names.len() - 1, &perf_typical, &stream_mbps));
    if let Some((line, _)) = &verbs_ratios {
        println!("{line}");
    }
    let dips = report::dips(&rows, Row::ferrocomm_mbps);
    if !dips.is_empty() {
        println!("ferrocomm throughput dips (>15% below the previous size): {}", dips.join(", "));
    }
    for (i, name) in names.iter().enumerate() {
        let dips = report::dips(&rows, |r| r.peer_mbps(i));
        if !dips.is_empty() {
            println!("{name} throughput dips (>15% below the previous size): {}", dips.join(", "));
        }
    }

    let meta = Meta {
        transport: &opts.transport,
        backend: &spec.backend,
        transport_name: &transport_name,
        progress: &opts.progress,
        receive: if opts.recv_into { "recv_into" } else { "recv" },
        send: if opts.send_from { "send_from" } else { "send" },
        peers: &described,
        interference: &interference,
        extra,
        runs: opts.runs,
        cpus: opts.cpus,
        max: opts.max,
    };
    if let Some(path) = &opts.json {
        let mut v = report::to_json(&meta, &rows);
        if let Some((_, ratios)) = &verbs_ratios {
            v["verbs_vs_perftest"] = ratios.clone();
            v["verbs_vs_perftest"]["commands"] = json!(perf.as_ref().map(|p| p.describe()));
        }
        let text = serde_json::to_string_pretty(&v)?;
        std::fs::write(path, text + "\n").map_err(|e| format!("{}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &opts.plot {
        let title = match names.is_empty() {
            true => format!("ferrocomm: ping-pong over {medium}"),
            false => format!("ferrocomm vs {}: ping-pong over {medium}", names.join(", ")),
        };
        let subtitle = format!(
            "{backend} ({transport_name}), progress {}, receives with {}, sends with {}, CPUs {},{}, median of {} run(s)",
            opts.progress,
            receive_call(opts.recv_into),
            send_call(opts.send_from),
            opts.cpus[0],
            opts.cpus[1],
            opts.runs
        );
        std::fs::write(path, plot::svg(&title, &subtitle, &rows, &names))
            .map_err(|e| format!("{}: {e}", path.display()))?;
        println!("wrote {}", path.display());
    }
    println!("total time {:.1} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// Shared memory only: the reference lines, the transport alone, and the idle-peer latency in
/// adaptive and busy-poll mode (one job each per run, alternating; medians of the per-run medians).
fn shm_extras(opts: &Options, rows: &[Row]) -> Result<Value> {
    let t = Instant::now();
    let refs = reference::measure(opts.cpus)?;
    let alone =
        ["off", "auto"].iter().map(|cma| transport::run(opts.cpus, cma, 4 << 20)).collect::<Result<Vec<_>>>()?;
    eprintln!("reference lines and the transport alone: {:.1} s", t.elapsed().as_secs_f64());
    let mut idle = Value::Null;
    if opts.idle_gap_us > 0 {
        // Regular gaps in adaptive and busy-poll mode, then gaps drawn at random in adaptive mode
        // (nothing for hybrid polling to foresee).
        let cases = [("adaptive", false), ("busy", false), ("adaptive", true)];
        let mut runs: [Vec<IdleStats>; 3] = Default::default();
        for run in 1..=opts.runs {
            for (k, &(progress, jitter)) in cases.iter().enumerate() {
                let spec = JobSpec {
                    backend: "shm".into(),
                    progress: progress.to_string(),
                    max: 8,
                    cpus: opts.cpus,
                    recv_into: opts.recv_into,
                    send_from: opts.send_from,
                    idle_gap_us: opts.idle_gap_us,
                    idle_jitter: jitter,
                    target_ms: opts.target_ms,
                    time_each: false,
                    env: vec![],
                };
                let t = Instant::now();
                let r = ranks::run_idle(&spec)?;
                let stats = IdleStats::of(&r);
                eprintln!(
                    "run {run}/{}: idle peer, {progress}{}: {} pings, median {:.2} us, p90 {:.2} us, peer CPU {:.0}%, {:.1} s",
                    opts.runs,
                    if jitter { ", random gaps" } else { "" },
                    r.samples.len(),
                    stats.median_us,
                    stats.p90_us,
                    stats.peer_cpu * 100.0,
                    t.elapsed().as_secs_f64()
                );
                runs[k].push(stats);
            }
        }
        let [adaptive, busy, random] = runs.map(|r| IdleStats::median_of(&r));
        let back_to_back = report::row(rows, report::HEADLINE_LATENCY).and_then(Row::ferrocomm_us);
        idle = json!({
            "gap_us": opts.idle_gap_us,
            "pings_per_run": ranks::IDLE_PINGS,
            "adaptive_us": adaptive.median_us,
            "busy_us": busy.median_us,
            "adaptive_random_gaps_us": random.median_us,
            "adaptive_p90_us": adaptive.p90_us,
            "busy_p90_us": busy.p90_us,
            "adaptive_random_gaps_p90_us": random.p90_us,
            "peer_cpu_share_adaptive": adaptive.peer_cpu,
            "peer_cpu_share_busy": busy.peer_cpu,
            "peer_cpu_share_adaptive_random_gaps": random.peer_cpu,
            "ratio_adaptive_to_busy_idle": adaptive.median_us / busy.median_us,
            "ratio_adaptive_random_gaps_to_busy_idle": random.median_us / busy.median_us,
            "ratio_adaptive_to_busy_back_to_back": back_to_back.map(|b| adaptive.median_us / b),
            // A peer that has gone to sleep cannot answer before it is woken: the machine's floor.
            "eventfd_wakeup_us": refs.wakeup_us,
            "ratio_adaptive_to_wakeup_floor": adaptive.median_us / refs.wakeup_us,
            "ratio_adaptive_random_gaps_to_wakeup_floor": random.median_us / refs.wakeup_us,
        });
    }
    Ok(json!({
        "reference": refs.to_json(),
        "transport_alone": alone.iter().map(transport::TransportResult::to_json).collect::<Vec<_>>(),
        "idle_peer": idle,
    }))
}

/// One idle-peer run, summed up.
#[derive(Clone, Copy, Default)]
struct IdleStats {
    median_us: f64,
    p90_us: f64,
    /// Share of one CPU the waiting peer used.
    peer_cpu: f64,
}

impl IdleStats {
    fn of(r: &ranks::IdleRun) -> IdleStats {
        let mut s = r.samples.clone();
        s.sort_by(f64::total_cmp);
        let p90 = s.get((s.len() * 9 / 10).min(s.len().saturating_sub(1))).copied().unwrap_or(f64::NAN);
        IdleStats {
            median_us: sweep::median(&s).unwrap_or(f64::NAN) * 1e6,
            p90_us: p90 * 1e6,
            peer_cpu: r.peer_cpu_share.unwrap_or(f64::NAN),
        }
    }

    /// Field by field, the median over runs.
    fn median_of(runs: &[IdleStats]) -> IdleStats {
        let m = |f: fn(&IdleStats) -> f64| sweep::median(&runs.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN);
        IdleStats { median_us: m(|s| s.median_us), p90_us: m(|s| s.p90_us), peer_cpu: m(|s| s.peer_cpu) }
    }
}

/// Prints what [`shm_extras`] measured, and the shared-memory transport's goals against it.
fn print_shm_extras(extra: &Value, rows: &[Row], names: &[&str]) {
    let r = &extra["reference"];
    println!(
        "reference: cache-line ping-pong between the two CPUs {:.3} us one way; memcpy of 4 MiB on one thread {:.1} GB/s",
        r["cacheline_pingpong_one_way_us"].as_f64().unwrap_or(f64::NAN),
        r["memcpy_GBps"].as_f64().unwrap_or(f64::NAN)
    );
    println!(
        "API alone (no transport): an 8 B send to itself plus its recv_into, awaited, busy-poll: {:.0} ns",
        r["api_self_send_recv_pair_ns"].as_f64().unwrap_or(f64::NAN)
    );
    for t in extra["transport_alone"].as_array().into_iter().flatten() {
        println!(
            "shm transport alone (no engine, no futures; cma={}): 8 B {:.3} us one way, through the engine \
             driven by hand (no reactor, no futures) {:.3} us; 4 MiB {:.2} GB/s",
            t["cma"].as_str().unwrap_or("?"),
            t["one_way_8B_us"].as_f64().unwrap_or(f64::NAN),
            t["engine_one_way_8B_us"].as_f64().unwrap_or(f64::NAN),
            t["bandwidth_GBps"].as_f64().unwrap_or(f64::NAN)
        );
    }
    let idle = &extra["idle_peer"];
    if !idle.is_null() {
        let f = |k: &str| idle[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "idle peer ({} us between pings, medians over runs): adaptive {:.3} us (p90 {:.3}, peer CPU {:.0}%), \
             busy-poll {:.3} us (p90 {:.3}, peer CPU {:.0}%) one way; adaptive / busy-poll {:.2} (same gaps), \
             {:.2} (vs back-to-back busy 8 B)",
            idle["gap_us"],
            f("adaptive_us"),
            f("adaptive_p90_us"),
            f("peer_cpu_share_adaptive") * 100.0,
            f("busy_us"),
            f("busy_p90_us"),
            f("peer_cpu_share_busy") * 100.0,
            f("ratio_adaptive_to_busy_idle"),
            f("ratio_adaptive_to_busy_back_to_back"),
        );
        println!(
            "idle peer, random gaps (0.5-1.5x): adaptive {:.3} us (p90 {:.3}, peer CPU {:.0}%): {:.2}x busy-poll, {:.2}x the wake-up floor",
            f("adaptive_random_gaps_us"),
            f("adaptive_random_gaps_p90_us"),
            f("peer_cpu_share_adaptive_random_gaps") * 100.0,
            f("ratio_adaptive_random_gaps_to_busy_idle"),
            f("ratio_adaptive_random_gaps_to_wakeup_floor"),
        );
        println!(
            "reference: waking a thread asleep on an eventfd on the idle other CPU takes {:.1} us (median); \
             the adaptive idle-peer latency is {:.2}x that floor",
            r["eventfd_wakeup_idle_cpu_us"].as_f64().unwrap_or(f64::NAN),
            idle["ratio_adaptive_to_wakeup_floor"].as_f64().unwrap_or(f64::NAN)
        );
    }
    let Some(ompi) = names.iter().position(|n| *n == "NPopenmpi") else { return };
    let verdict = |ok: Option<bool>| match ok {
        Some(true) => "met",
        Some(false) => "NOT met",
        None => "not measured",
    };
    let at = |b| report::row(rows, b);
    // Like-for-like: NetPIPE reports only its best trial (the batch means' ratio is given too).
    let lat = at(8).and_then(|r| r.best_trial_ratio(ompi));
    let lat_means = at(8).and_then(|r| r.latency_ratio(ompi));
    let bw64 = at(64 << 10).and_then(|r| r.bandwidth_ratio(ompi));
    let bw4 = at(4 << 20).and_then(|r| r.bandwidth_ratio(ompi));
    let idle_ratio = idle["ratio_adaptive_to_busy_idle"].as_f64();
    println!(
        "goals (issue 3): 8 B latency <= 0.9x NPopenmpi: {:.2}x by NetPIPE's method ({:.2}x by batch means), {}; \
         64 KiB bandwidth >= 1.0x: {:.2}x, {}; 4 MiB bandwidth >= 1.5x: {:.2}x, {}; \
         idle-peer adaptive <= 2x busy-poll: {:.2}x, {}",
        lat.unwrap_or(f64::NAN),
        lat_means.unwrap_or(f64::NAN),
        verdict(lat.map(|r| r <= 0.9)),
        bw64.unwrap_or(f64::NAN),
        verdict(bw64.map(|r| r >= 1.0)),
        bw4.unwrap_or(f64::NAN),
        verdict(bw4.map(|r| r >= 1.5)),
        idle_ratio.unwrap_or(f64::NAN),
        verdict(idle_ratio.map(|r| r <= 2.0)),
    );
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
        let o = Options::parse(&args("--transport shm --idle-gap 200")).unwrap().unwrap();
        assert_eq!((o.transport.as_str(), o.idle_gap_us), ("shm", 200));
        assert!(Options::parse(&args("--help")).unwrap().is_none());
        let v = Options::parse(&args("--transport verbs --device rxe0 --gid-index 1")).unwrap().unwrap();
        assert_eq!((v.transport.as_str(), v.device.as_deref(), v.gid_index), ("verbs", Some("rxe0"), Some(1)));
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
