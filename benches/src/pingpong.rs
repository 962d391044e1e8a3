//! `pingpong`: options, the slices (ferrocomm and its peers, interleaved), and the report.
//!
//! The sizes of the sweep are cut into groups of `--slice-sizes` consecutive sizes; for each group
//! in turn, the sides take `--runs` turns each: a ferrocomm job measuring the group, then each
//! peer measuring the same sizes, then ferrocomm again, and so on. Each side's `k`-th value at a
//! size thus comes from the `k`-th round of slices, seconds apart from the others', and the
//! report gives at every size the median of the per-round ratios and their min-max
//! ([`report`](mod@report)).
//!
//! Before each side's slice a copy probe ([`reference::copy_pingpong`]) times the two CPUs passing
//! 1 MiB back and forth by `memcpy`, without sockets. On a virtual machine its speed follows the
//! host's placement of the two CPUs and can change severalfold within seconds; a large message's
//! round trip (a copy on each side) changes with it, whoever sends it. The report gives the
//! probe's spread and warns when it moved, and the JSON keeps it per slice.
//!
//! Over TCP the peers are `NPtcp` and `NPopenmpi` over Open MPI's TCP BTL; over shared memory (`--transport shm`) the peers are `NPopenmpi`
//! and `NPmpich2`, and the report adds what explains the numbers: the machine's limits
//! ([`reference`](mod@reference)), the shared-memory transport alone
//! ([`transport`](mod@transport)), and the latency to an idle peer in adaptive and busy-poll
//! mode ([`ranks::run_idle`]).

use std::path::PathBuf;
use std::time::Instant;

use serde_json::{Value, json};

use crate::mpi_pingpong::{self, MpiPingPong};
use crate::netpipe::{Flavour, NetPipe};
use crate::perftest::{self, Perftest};
use crate::ranks::{self, JobSpec};
use crate::report::{self, Meta, Row};
use crate::{Result, affinity, cli, plot, process, reference, sweep, transport};

/// Other work above this share of the benchmark's CPUs, during a run, earns a warning.
const LOAD_WARNING: f64 = 0.05;
/// Spread of the cross-core copy probe over a sweep above which the report warns.
const COPY_PROBE_WARNING: f64 = 1.3;

/// ferrocomm vs NetPIPE: ping-pong latency and throughput (NetPIPE method).
///
/// Ping-pong latency and throughput of ferrocomm against NetPIPE (NPtcp and NPopenmpi over Open
/// MPI's TCP BTL over TCP; NPopenmpi and NPmpich2 over shared memory), NetPIPE method: sizes 1 B
/// and powers of two up to --max, each also at -3 and +3 bytes. The sides alternate in short
/// slices of a few sizes (--slice-sizes), --runs slices each at every size; the ratios are the
/// medians of the per-slice ratios, with their min-max. Over shared memory also: reference lines
/// (cache-line ping-pong, memcpy), the transport alone, and the latency to an idle peer
/// (adaptive vs busy-poll). With --time-each, every round trip is timed and the report adds its
/// latency percentiles (p50, p99, p99.9).
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Transport to measure: tcp, shm (shared memory) or verbs (build with --features verbs;
    /// the peer is then perftest's ib_send_lat at 8 B and ib_write_bw at 1 MiB on the same
    /// device)
    #[arg(long, default_value = "tcp", value_parser = ["tcp", "shm", "verbs"])]
    pub transport: String,
    /// RDMA device for verbs [default: the first one]
    #[arg(long, value_name = "D")]
    pub device: Option<String>,
    /// GID index for verbs [default: the first RoCE v2 IPv4 entry]
    #[arg(long, value_name = "N")]
    pub gid_index: Option<u32>,
    /// ferrocomm TCP backend: auto, uring or portable
    #[arg(long, default_value = "auto", value_parser = cli::backend)]
    pub backend: String,
    /// ferrocomm progress: busy, adaptive (adaptive:US spins at most US microseconds before
    /// sleeping) or blocking
    #[arg(long, default_value = "busy", value_parser = cli::progress)]
    pub progress: String,
    /// Largest power of two measured, e.g. 65536, 64K, 8M
    #[arg(long, value_name = "BYTES", default_value = "8M", value_parser = cli::bytes)]
    pub max: usize,
    /// Slices per side at every size: the sides take turns K times at each group of sizes; the
    /// report gives medians over the slices and the median (min-max) of the per-slice ratios
    #[arg(long, visible_alias = "slices", value_name = "K", default_value_t = 3, value_parser = cli::at_least_one)]
    pub runs: usize,
    /// Consecutive sizes of the sweep in one slice (0: the whole sweep, each side sweeping every
    /// size in turn; always so over verbs)
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub slice_sizes: usize,
    /// The peers [default: NPtcp,openmpi-tcp over TCP; NPopenmpi,NPmpich2 over shared memory].
    /// openmpi-tcp is benches/mpi/mpi_pingpong.c over Open MPI's TCP BTL (one mpirun a slice);
    /// NPopenmpi-tcp is NetPIPE over the same (one mpirun a size: much slower to run)
    #[arg(long, value_name = "P,...", value_delimiter = ',', value_parser = PEERS)]
    pub peers: Vec<String>,
    /// CPUs of rank 0 / the peer's transmitter and of rank 1 / its receiver
    #[arg(long, value_name = "A,B", default_value = "0,1", value_parser = cli::cpu_pair)]
    pub cpus: [usize; 2],
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Write throughput and latency plots as SVG
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
    /// Measure ferrocomm alone (no peer needed)
    #[arg(long)]
    pub no_peer: bool,
    /// ferrocomm receives with recv_into into one reused buffer per rank instead of recv (a
    /// buffer per message)
    #[arg(long)]
    pub recv_into: bool,
    /// ferrocomm sends with send_from (a borrowed slice, copied as MPI sends) instead of send
    /// (a shared handle)
    #[arg(long)]
    pub send_from: bool,
    /// shm: microseconds between the pings of the idle-peer measurement (0 skips it)
    #[arg(long = "idle-gap", value_name = "US", default_value_t = 1000)]
    pub idle_gap_us: u64,
    /// How long ferrocomm's timed batch of each size lasts, milliseconds (more where round
    /// trips are slow, as under emulation)
    #[arg(long, value_name = "MS", default_value_t = sweep::TARGET.as_millis() as u64, value_parser = cli::at_least_one_u64)]
    pub target_ms: u64,
    /// Time every ferrocomm round trip with the CPU's cycle counter, as ib_send_lat does: the
    /// median is then the median round trip like its t_typical, and the report adds p50, p99
    /// and p99.9 (the default with --transport verbs; otherwise the median is over 15 timed
    /// slices of each batch, the clock read once per slice)
    #[arg(long)]
    pub time_each: bool,
}

/// The peers `--peers` takes.
const PEERS: [&str; 5] = ["NPtcp", mpi_pingpong::NAME, "NPopenmpi-tcp", "NPopenmpi", "NPmpich2"];

/// A peer: a NetPIPE (run once per size) or `mpi_pingpong` (run once per slice).
enum Peer {
    NetPipe(NetPipe),
    Mpi(MpiPingPong),
}

impl Peer {
    /// The peer called `name` (of [`PEERS`]), its programs found (and built).
    fn find(name: &str, target_ms: u64) -> Result<Peer> {
        match Flavour::named(name) {
            Some(f) => Ok(Peer::NetPipe(NetPipe::find(f)?)),
            None if name == mpi_pingpong::NAME => Ok(Peer::Mpi(MpiPingPong::build(target_ms)?)),
            None => Err(format!("unknown peer {name:?}").into()),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Peer::NetPipe(p) => p.name(),
            Peer::Mpi(_) => mpi_pingpong::NAME,
        }
    }

    /// The command the peer runs, for the record.
    fn describe(&self, cpus: [usize; 2]) -> String {
        match self {
            Peer::NetPipe(p) => format!("{}  (once per size)", p.describe(cpus, "SIZE")),
            Peer::Mpi(p) => format!("{}  (once per slice)", p.describe(cpus)),
        }
    }

    /// One slice: the one-way time of each of `sizes`, seconds, in order.
    fn measure(&self, sizes: &[usize], cpus: [usize; 2]) -> Result<Vec<f64>> {
        match self {
            Peer::NetPipe(p) => sizes.iter().map(|&b| p.measure(b, cpus)).collect(),
            Peer::Mpi(p) => p.measure(sizes, cpus),
        }
    }
}

impl Options {
    /// Whether the peer runs (not `--no-peer`).
    pub(crate) fn peer(&self) -> bool {
        !self.no_peer
    }
}

fn receive_call(recv_into: bool) -> &'static str {
    if recv_into { "recv_into (one reused buffer)" } else { "recv" }
}

fn send_call(send_from: bool) -> &'static str {
    if send_from { "send_from (a borrowed slice)" } else { "send" }
}

/// `ferrocomm-bench pingpong`.
pub(crate) fn main(mut opts: Options) -> Result<()> {
    // perftest's latency is the median of round trips each timed alone.
    opts.time_each |= opts.transport == "verbs";
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
    let chosen: Vec<String> = match (opts.peer() && !verbs, shm) {
        (false, _) => vec![],
        (true, _) if !opts.peers.is_empty() => opts.peers.clone(),
        (true, false) => vec!["NPtcp".into(), mpi_pingpong::NAME.into()],
        (true, true) => vec!["NPopenmpi".into(), "NPmpich2".into()],
    };
    let peers = chosen.iter().map(|p| Peer::find(p, opts.target_ms)).collect::<Result<Vec<_>>>()?;
    let mut names: Vec<&str> = peers.iter().map(Peer::name).collect();
    // Over verbs the peer is perftest on the same device (peer 0 of the rows).
    let mut env = Vec::new();
    let mut perf = None;
    if verbs {
        let device = opts.device.clone().or_else(perftest::first_device).ok_or("--transport verbs: no RDMA device")?;
        let gid = opts.gid_index.unwrap_or_else(|| perftest::default_gid_index(&device));
        env.push(("FERROCOMM_VERBS_DEVICE".to_string(), device.clone()));
        env.push(("FERROCOMM_VERBS_GID_INDEX".to_string(), gid.to_string()));
        if opts.peer() {
            perf = Some(Perftest::find(&device, gid)?);
            names.push("perftest");
        }
    }
    let spec = JobSpec {
        backend: if shm || verbs { opts.transport.clone() } else { opts.backend.clone() },
        progress: opts.progress.clone(),
        max: opts.max,
        sizes: vec![],
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
    // perftest runs once per slice of ferrocomm's at 8 B and 1 MiB: one group of every size.
    let per_slice = if verbs || opts.slice_sizes == 0 { sizes.len() } else { opts.slice_sizes };
    let groups: Vec<&[usize]> = sizes.chunks(per_slice).collect();
    let mut rows: Vec<Row> =
        sizes.iter().map(|&bytes| Row { bytes, peers: vec![Vec::new(); names.len()], ..Row::default() }).collect();

    let medium = match opts.transport.as_str() {
        "shm" => "shared memory (two processes on this host)",
        "verbs" => "RDMA verbs (two processes on this host's RDMA device)",
        _ => "TCP on 127.0.0.1",
    };
    println!(
        "pingpong over {medium}, NetPIPE method: {} sizes from 1 to {} bytes, {} interleaved slice(s) per side of {} \
         size(s) each (ratios: median (min-max) of the per-slice ratios), CPUs {},{}",
        sizes.len(),
        sweep::largest(opts.max),
        opts.runs,
        per_slice,
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
        "ferrocomm: {backend} FERROCOMM_PROGRESS={}, 2 ranks via ferrorun::run_local, receives with {}, sends with {}, median {}",
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
        peers.iter().map(|p| (p.name().to_string(), p.describe(opts.cpus))).collect();
    if let Some(p) = &perf {
        described.push(("perftest".to_string(), p.describe()));
    }
    for (name, command) in &described {
        println!("peer {name}: {command}");
    }

    let mut transport_name = String::from("?");
    let mut perf_typical = Vec::new();
    let mut stream_mbps = Vec::new();
    let mut busiest = 0.0_f64;
    let mut interference = Vec::new();
    // Other work on the benchmark's CPUs during one side's sweep, noted and warned about.
    // Steps of a run: ferrocomm's sweep, its streaming bandwidth (verbs), each peer's sizes,
    // perftest.
    let streams = perf.is_some() && opts.max >= 1 << 20;
    let steps = groups.len() * (1 + usize::from(streams) + usize::from(perf.is_some())) + peers.len() * rows.len();
    let bar = cli::Progress::new((opts.runs * steps) as u64, "pingpong");
    let mut probes = Vec::new();
    let mut watch = |meter: Option<process::Interference>, probe_us: f64, run: usize, side: &str, group: &[usize]| {
        probes.push(probe_us);
        let share = meter.and_then(|m| m.share());
        if let Some(share) = share {
            busiest = busiest.max(share);
            if share > LOAD_WARNING {
                bar.note(format!(
                    "warning: other work took {:.0}% of the CPUs during slice {run} of {side} ({}-{} B)",
                    share * 100.0,
                    group[0],
                    group[group.len() - 1]
                ));
            }
        }
        interference.push(
            json!({"slice": run, "sizes": group, "side": side, "share": share, "copy_probe_one_way_us": probe_us}),
        );
    };
    // A ferrocomm one-way time above STOP_AFTER ends the sweep after its group.
    let mut stop = false;
    for group in &groups {
        let (lo, hi) = (group[0], group[group.len() - 1]);
        let spec = JobSpec { sizes: group.to_vec(), ..spec.clone() };
        for run in 1..=opts.runs {
            bar.step(format!("{lo}-{hi} B, slice {run}: ferrocomm"));
            let probe = reference::copy_pingpong(opts.cpus)?;
            let meter = process::Interference::start(&opts.cpus);
            let t = Instant::now();
            let result = ranks::run_sweep(&spec)?;
            bar.inc();
            // The sizes ferrocomm measured in this slice: the peers measure the same.
            let mut measured = Vec::new();
            for s in &result.samples {
                if let Some(row) = rows.iter_mut().find(|r| r.bytes == s.bytes) {
                    row.ferrocomm.push(s.one_way);
                    row.ferrocomm_median.push(s.median_one_way);
                    row.ferrocomm_best_trial.push(s.best_trial_one_way);
                    row.ferrocomm_percentiles.extend(s.percentiles);
                    measured.push(s.bytes);
                }
                stop |= s.one_way > sweep::STOP_AFTER.as_secs_f64();
            }
            let iterations: u64 = result.samples.iter().map(|s| s.iterations).sum();
            let mut line = format!(
                "{lo}-{hi} B, slice {run}/{}: ferrocomm ({}) {} sizes, {iterations} round trips, {:.1} s",
                opts.runs,
                result.transport,
                result.samples.len(),
                t.elapsed().as_secs_f64()
            );
            transport_name = result.transport;
            watch(meter, probe, run, "ferrocomm", group);
            line += &format!(" (copy probe {probe:.0} us)");
            if streams {
                bar.step(format!("slice {run}: ferrocomm streaming"));
                let t = Instant::now();
                let mbps = perftest::stream_bw(&opts.progress, opts.cpus, 1 << 20, &spec.env)?;
                bar.inc();
                stream_mbps.push(mbps);
                bar.note(format!(
                    "slice {run}/{}: ferrocomm streaming 1 MiB, window {}: {mbps:.1} MB/s, {:.1} s",
                    opts.runs,
                    perftest::WINDOW,
                    t.elapsed().as_secs_f64()
                ));
            }
            for (i, peer) in peers.iter().enumerate() {
                bar.step(format!("{lo}-{hi} B, slice {run}: {}", peer.name()));
                let probe = reference::copy_pingpong(opts.cpus)?;
                let meter = process::Interference::start(&opts.cpus);
                let t = Instant::now();
                let times = peer.measure(&measured, opts.cpus)?;
                for (bytes, one_way) in measured.iter().zip(times) {
                    if let Some(row) = rows.iter_mut().find(|r| r.bytes == *bytes) {
                        row.peers[i].push(one_way);
                    }
                }
                for _ in group.iter() {
                    bar.inc();
                }
                watch(meter, probe, run, peer.name(), group);
                line += &format!("; {} {:.1} s (copy probe {probe:.0} us)", peer.name(), t.elapsed().as_secs_f64());
            }
            bar.note(line);
            if let Some(p) = &perf {
                // perftest's figures go into the rows of their sizes, as one-way times.
                bar.step(format!("slice {run}: perftest"));
                let t = Instant::now();
                let (lat, typical) = p.send_lat(8, opts.cpus)?;
                perf_typical.push(typical);
                // Only a sweep that reaches 1 MiB has a row for ib_write_bw (an 8 B run then pairs
                // ferrocomm and ib_send_lat a few seconds apart, not ten).
                let bw = if opts.max >= 1 << 20 { Some(p.write_bw(1 << 20, opts.cpus)?) } else { None };
                bar.inc();
                let last = names.len() - 1;
                let bw_one_way = bw.map(|bw| (1 << 20, (1 << 20) as f64 / (bw * 1e6)));
                for (bytes, one_way) in std::iter::once((8, lat)).chain(bw_one_way) {
                    if let Some(row) = rows.iter_mut().find(|r| r.bytes == bytes) {
                        row.peers[last].push(one_way);
                    }
                }
                let ours = report::row(&rows, 8).and_then(|r| r.ferrocomm_median.last().copied());
                bar.note(format!(
                    "slice {run}/{}: perftest: ib_send_lat 8 B mean {:.2} us (median {:.2} us), ib_write_bw 1 MiB {}, {:.1} s; \
                     this slice's 8 B medians: ferrocomm / ib_send_lat = {}",
                    opts.runs,
                    lat * 1e6,
                    typical * 1e6,
                    bw.map_or("not run (--max below 1 MiB)".into(), |bw| format!("{bw:.1} MB/s")),
                    t.elapsed().as_secs_f64(),
                    ours.map_or("-".into(), |o| format!("{:.2} / {:.2} us = {:.3}", o * 1e6, typical * 1e6, o / typical)),
                ));
            }
        }
        if stop {
            bar.note(format!(
                "ferrocomm took over {:?} one way at {hi} B or below: the sweep ends here",
                sweep::STOP_AFTER
            ));
            break;
        }
    }
    drop(bar);
    let extra = if shm { shm_extras(&opts, &rows)? } else { Value::Null };

    if busiest > LOAD_WARNING {
        println!(
            "warning: other work took up to {:.0}% of CPUs {},{} during a sweep; the results are noisy",
            busiest * 100.0,
            opts.cpus[0],
            opts.cpus[1]
        );
    }
    let (fastest, slowest) = probes.iter().fold((f64::MAX, 0.0_f64), |(lo, hi), &p| (lo.min(p), hi.max(p)));
    if !probes.is_empty() {
        println!(
            "host: cross-core copy ping-pong of {} B (no sockets; two copies one way) before each side's slice: \
             median {:.0} us, {fastest:.0}-{slowest:.0} us",
            reference::COPY_PROBE_BYTES,
            sweep::median(&probes).unwrap_or(f64::NAN)
        );
        if slowest > COPY_PROBE_WARNING * fastest {
            println!(
                "warning: the host's cross-core copy speed changed {:.1}x during the sweep; large-message times of a \
                 slice follow it (a copy on each side), so ratios between slices taken at different speeds are noisy",
                slowest / fastest
            );
        }
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
        slice_sizes: per_slice,
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
            "{backend} ({transport_name}), progress {}, receives with {}, sends with {}, CPUs {},{}, median of {} slice(s)",
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
                    sizes: vec![],
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
            "adaptive_p99_us": adaptive.p99_us,
            "busy_p99_us": busy.p99_us,
            "adaptive_random_gaps_p99_us": random.p99_us,
            "adaptive_p99_9_us": adaptive.p999_us,
            "busy_p99_9_us": busy.p999_us,
            "adaptive_random_gaps_p99_9_us": random.p999_us,
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

/// One idle-peer run, summed up (one-way times, µs, from the HDR histogram of its pings).
#[derive(Clone, Copy, Default)]
struct IdleStats {
    median_us: f64,
    p90_us: f64,
    p99_us: f64,
    p999_us: f64,
    /// Share of one CPU the waiting peer used.
    peer_cpu: f64,
}

impl IdleStats {
    fn of(r: &ranks::IdleRun) -> IdleStats {
        let q = sweep::quantiles(&r.samples, &[0.9, 0.99, 0.999]).unwrap_or_else(|| vec![f64::NAN; 3]);
        IdleStats {
            median_us: sweep::median(&r.samples).unwrap_or(f64::NAN) * 1e6,
            p90_us: q[0] * 1e6,
            p99_us: q[1] * 1e6,
            p999_us: q[2] * 1e6,
            peer_cpu: r.peer_cpu_share.unwrap_or(f64::NAN),
        }
    }

    /// Field by field, the median over runs.
    fn median_of(runs: &[IdleStats]) -> IdleStats {
        let m = |f: fn(&IdleStats) -> f64| sweep::median(&runs.iter().map(f).collect::<Vec<_>>()).unwrap_or(f64::NAN);
        IdleStats {
            median_us: m(|s| s.median_us),
            p90_us: m(|s| s.p90_us),
            p99_us: m(|s| s.p99_us),
            p999_us: m(|s| s.p999_us),
            peer_cpu: m(|s| s.peer_cpu),
        }
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
            "idle peer percentiles (one way, p50 / p99 / p99.9 us): adaptive {:.3} / {:.3} / {:.3}; busy-poll {:.3} / {:.3} / {:.3}; \
             adaptive with random gaps {:.3} / {:.3} / {:.3}",
            f("adaptive_us"),
            f("adaptive_p99_us"),
            f("adaptive_p99_9_us"),
            f("busy_us"),
            f("busy_p99_us"),
            f("busy_p99_9_us"),
            f("adaptive_random_gaps_us"),
            f("adaptive_random_gaps_p99_us"),
            f("adaptive_random_gaps_p99_9_us"),
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

    fn options(line: &str) -> std::result::Result<Options, clap::Error> {
        match crate::tests::parse(&format!("pingpong {line}"))? {
            crate::Command::Pingpong(o) => Ok(o),
            other => panic!("not pingpong: {other:?}"),
        }
    }

    #[test]
    fn options_parse() {
        let o = options("--backend uring --progress=adaptive:20 --max 64K --runs 5 --cpus 1,0 --no-peer").unwrap();
        assert_eq!(
            (o.backend.as_str(), o.progress.as_str(), o.max, o.runs, o.cpus),
            ("uring", "adaptive:20", 65536, 5, [1, 0])
        );
        assert!(!o.peer());
        let o = options("--transport shm --idle-gap 200").unwrap();
        assert_eq!((o.transport.as_str(), o.idle_gap_us, o.max, o.target_ms), ("shm", 200, 8 << 20, 30));
        assert!(o.peer() && !o.time_each);
        let v = options("--transport verbs --device rxe0 --gid-index 1 --max 4M --target-ms 300").unwrap();
        assert_eq!((v.transport.as_str(), v.device.as_deref(), v.gid_index), ("verbs", Some("rxe0"), Some(1)));
        assert_eq!(options("--max 1G").unwrap().max, 1 << 30);
        for bad in [
            "--backend rdma",
            "--transport udp",
            "--gid-index x",
            "--runs 0",
            "--target-ms 0",
            "--max",
            "--max 2G",
            "--cpus 1",
            "--frobnicate",
        ] {
            assert!(options(bad).is_err(), "{bad}");
        }
    }
}
