//! `sim-scale`: each collective's time on the simulated network against rank count and size,
//! beside the alpha-beta model of its algorithm ([`ferrocomm_sim::model`]).
//!
//! Every point is one run of the real engine and collective machines (or multicast cores) for
//! every rank, in one thread, in virtual time ([`ferrocomm_sim::scale::measure`]): the figures are
//! exact for the model of the network (a uniform network of `--latency-ns` and `--gbit` links,
//! ports that serialize), not measurements of this machine, so one run is enough and the host's
//! load does not change them. Points whose data would exceed `--max-bytes` in total (ranks x size)
//! are skipped: each rank holds its own copy; so is the scatter + all-gather broadcast above 1,024
//! ranks (its ring all-gather sends p^2 messages).
//!
//! It also looks for the rank count above which a broadcast by reliable multicast finishes before
//! a binomial broadcast, for each size: the time is from the root's first send until the last rank
//! has read the message (the multicast group test before it is not counted); and the same for a
//! stream of 16 broadcasts back to back, where the root's port, not the latency, sets the pace.

use std::fmt::Write as _;
use std::time::Instant;

use ferrocomm::Algorithm;
use ferrocomm_sim::model::{AlphaBeta, Op};
use ferrocomm_sim::scale::{Point, broadcast_stream, curve_ops, measure};
use ferrocomm_sim::{Link, NetConfig};

/// Collectives on the simulated network, 64 to 4,096 ranks, against the alpha-beta model of each
/// algorithm.
///
/// Every point is one run of the real engine and collective machines for every rank, in one
/// thread, in virtual time: exact for the modelled network, independent of this machine's load.
/// Also finds, per size, the rank count above which a broadcast by reliable multicast beats a
/// binomial one.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Rank counts
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "64,256,1024,4096",
          value_parser = clap::value_parser!(u32).range(2..))]
    ranks: Vec<u32>,
    /// Bytes per rank's vector or per broadcast
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "8,64K,1M", value_parser = crate::cli::bytes)]
    sizes: Vec<usize>,
    /// Operations: barrier, bcast, mcast, allreduce
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "barrier,bcast,mcast,allreduce",
          value_parser = ["barrier", "bcast", "mcast", "allreduce"])]
    ops: Vec<String>,
    /// One-way link latency, nanoseconds
    #[arg(long, value_name = "N", default_value_t = 2000)]
    latency_ns: u64,
    /// Link bandwidth in Gbit/s
    #[arg(long, value_name = "G", default_value_t = 10.0)]
    gbit: f64,
    /// Skip points with ranks x size above this many bytes
    #[arg(long, value_name = "BYTES", default_value = "256M", value_parser = crate::cli::total_bytes)]
    max_bytes: usize,
    /// Skip the multicast vs binomial broadcast search
    #[arg(long)]
    no_crossover: bool,
    /// Write every point as JSON
    #[arg(long, value_name = "FILE")]
    json: Option<String>,
    /// Write the report to FILE as well
    #[arg(long, value_name = "FILE")]
    text: Option<String>,
}

/// Broadcasts per stream in the multicast vs binomial comparison.
const STREAM: usize = 16;

/// Above this many ranks the scatter + all-gather broadcast (p^2 messages) is not simulated.
const RING_MAX: u32 = 1024;

fn size_name(b: usize) -> String {
    match b {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

pub(crate) fn main(o: Options) -> crate::Result<()> {
    let Options { ranks, sizes, ops: kinds, latency_ns: latency, gbit, max_bytes, json, text, .. } = o;
    let crossover = !o.no_crossover;
    if ranks.iter().any(|&p| p < 2) || gbit <= 0.0 {
        return Err("rank counts must be at least 2 and the bandwidth positive".into());
    }
    let cfg = NetConfig { link: Link::new(latency, gbit), ..NetConfig::default() };
    let m = AlphaBeta::of(&cfg.link);
    let ops: Vec<Op> = curve_ops()
        .into_iter()
        .filter(|op| {
            let k = match op {
                Op::Barrier(_) => "barrier",
                Op::Bcast(_) => "bcast",
                Op::McastBcast => "mcast",
                Op::Allreduce(_) => "allreduce",
            };
            kinds.iter().any(|x| x == k)
        })
        .collect();

    let mut out = String::new();
    let started = Instant::now();
    writeln!(
        out,
        "sim-scale: simulated time (virtual; {latency} ns, {gbit} Gbit/s links, eager limit {} KiB) beside the alpha-beta \
         model, a = {:.0} ns (latency + header), b = {:.3} ns/B",
        cfg.eager_limit >> 10,
        m.alpha,
        m.beta
    )?;
    let mut points: Vec<(Point, f64)> = Vec::new();
    for op in &ops {
        writeln!(out, "\n{}   model: {}", op.name(), op.formula())?;
        writeln!(
            out,
            "{:>6} {:>9} {:>13} {:>13} {:>7} {:>10} {:>9}",
            "ranks", "size", "sim us", "model us", "sim/model", "frames", "host s"
        )?;
        let op_sizes: &[usize] = if matches!(op, Op::Barrier(_)) { &[0] } else { &sizes };
        for &n in op_sizes {
            for &p in &ranks {
                if p as usize * n.max(8) > max_bytes {
                    continue;
                }
                if matches!(op, Op::Bcast(Algorithm::ScatterAllgather)) && p > RING_MAX {
                    writeln!(out, "{p:>6} {:>9}  skipped: its ring all-gather sends p^2 messages", size_name(n))?;
                    continue;
                }
                let t0 = Instant::now();
                let pt = measure(*op, p, n, &cfg).map_err(|e| format!("{} on {p} ranks, {n} B: {e}", op.name()))?;
                let host = t0.elapsed().as_secs_f64();
                writeln!(
                    out,
                    "{:>6} {:>9} {:>13.2} {:>13.2} {:>9.2} {:>10} {:>9.2}",
                    p,
                    if matches!(op, Op::Barrier(_)) { "-".into() } else { size_name(n) },
                    pt.sim_ns as f64 / 1e3,
                    pt.model_ns / 1e3,
                    pt.sim_ns as f64 / pt.model_ns.max(1.0),
                    pt.frames + pt.datagrams,
                    host
                )?;
                eprint!(".");
                points.push((pt, host));
            }
        }
    }
    let mut crossings = Vec::new();
    let mut streams = Vec::new();
    if crossover {
        writeln!(
            out,
            "\nmulticast vs binomial broadcast (time from the root's first send to the last rank's read; \
             acked: until the root's window is empty)"
        )?;
        writeln!(
            out,
            "{:>9} {:>6} {:>13} {:>13} {:>17}  multicast faster",
            "size", "ranks", "binomial us", "multicast us", "mcast acked us"
        )?;
        for &n in &sizes {
            let mut first = None;
            let mut p = 2u32;
            while p <= *ranks.iter().max().unwrap_or(&4096) {
                if p as usize * n.max(8) > max_bytes {
                    break;
                }
                let b = measure(Op::Bcast(Algorithm::Binomial), p, n, &cfg)?;
                let mc = measure(Op::McastBcast, p, n, &cfg)?;
                let faster = mc.sim_ns < b.sim_ns;
                writeln!(
                    out,
                    "{:>9} {:>6} {:>13.2} {:>13.2} {:>17.2}  {}",
                    size_name(n),
                    p,
                    b.sim_ns as f64 / 1e3,
                    mc.sim_ns as f64 / 1e3,
                    mc.acked_ns.unwrap_or(0) as f64 / 1e3,
                    if faster { "yes" } else { "no" }
                )?;
                eprint!(".");
                if faster && first.is_none() {
                    first = Some(p);
                } else if !faster {
                    first = None;
                }
                p *= 2;
            }
            crossings.push((n, first));
        }
        writeln!(out, "\nstreams of {STREAM} back-to-back broadcasts (until the last rank read the last message):")?;
        writeln!(out, "{:>9} {:>6} {:>13} {:>13}  multicast faster", "size", "ranks", "binomial us", "multicast us")?;
        for &n in &sizes {
            for &p in &ranks {
                if p as usize * n.max(8) * STREAM > max_bytes {
                    continue;
                }
                let b = broadcast_stream(p, n, STREAM, false, &cfg)?;
                let mc = broadcast_stream(p, n, STREAM, true, &cfg)?;
                writeln!(
                    out,
                    "{:>9} {:>6} {:>13.2} {:>13.2}  {}",
                    size_name(n),
                    p,
                    b as f64 / 1e3,
                    mc as f64 / 1e3,
                    if mc < b { "yes" } else { "no" }
                )?;
                eprint!(".");
                streams.push(
                    serde_json::json!({"bytes": n, "ranks": p, "count": STREAM, "binomial_ns": b, "multicast_ns": mc}),
                );
            }
        }
        for (n, first) in &crossings {
            match first {
                Some(p) => writeln!(
                    out,
                    "{}, one broadcast: multicast is faster from {p} ranks on (up to the largest count tried)",
                    size_name(*n)
                )?,
                None => writeln!(
                    out,
                    "{}, one broadcast: multicast is not faster at the largest count tried",
                    size_name(*n)
                )?,
            }
        }
    }
    eprintln!();
    writeln!(out, "\nhost time for the whole sweep: {:.1} s", started.elapsed().as_secs_f64())?;
    print!("{out}");
    if let Some(path) = text {
        std::fs::write(path, &out)?;
    }
    if let Some(path) = json {
        let pts: Vec<serde_json::Value> = points
            .iter()
            .map(|(p, host)| {
                serde_json::json!({
                    "op": p.op.name(), "ranks": p.ranks, "bytes": p.bytes, "sim_ns": p.sim_ns,
                    "model_ns": p.model_ns, "acked_ns": p.acked_ns, "frames": p.frames, "datagrams": p.datagrams, "host_s": host,
                })
            })
            .collect();
        let cross: Vec<serde_json::Value> =
            crossings.iter().map(|(n, p)| serde_json::json!({"bytes": n, "multicast_faster_from_ranks": p})).collect();
        let doc = serde_json::json!({
            "benchmark": "sim-scale",
            "network": {"latency_ns": latency, "gbit_s": gbit, "eager_limit": cfg.eager_limit, "alpha_ns": m.alpha, "beta_ns_per_byte": m.beta},
            "points": pts,
            "multicast_vs_binomial": cross,
            "broadcast_streams": streams,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
