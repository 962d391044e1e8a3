//! `rma-verbs`: one-sided communication over RDMA verbs (the Soft-RoCE VM of
//! scripts/verbs-vm.sh), ferrocomm against perftest on the same device, in one invocation.
//!
//! * **Put latency, 8 B**: `ib_write_lat`'s loop. Rank 0 puts a counter into rank 1's segment
//!   by RDMA write and awaits its completion, then spins on its own word until rank 1's put has
//!   landed; rank 1 spins first, then puts. Each put's start is stamped by the cycle counter, and
//!   the latency is half of the median time between two stamps (`ib_write_lat`'s `t_typical`),
//!   against `ib_write_lat` (the same ping-pong of signaled RDMA writes, each side polling
//!   memory). The JSON also has the same loop with a spin that gives its CPU away every few
//!   dozen looks, how many puts completed within their call, and the median time of one put.
//! * **Get latency, 8 B**: a loop of awaited gets (RDMA reads), each timed, against
//!   `ib_read_lat`.
//! * **Fetch-add latency**: a loop of awaited fetch-adds (RDMA atomics), each timed, against
//!   `ib_atomic_lat -A FETCH_AND_ADD`.
//!
//! The target rank idles through the get and fetch-add loops (perftest's server idles too):
//! Soft-RoCE answers reads with kernel work on these CPUs, which a spinning rank competes with.
//!
//! Like for like: each side's figure is the median single operation (perftest's `t_typical`),
//! and each test runs as a ferrocomm job of its own right next to its perftest counterpart, the
//! order of the two alternating from run to run, so that a change of the emulated VM's speed
//! (2-4x between minutes) falls on both sides of a pair alike. The report gives the medians over
//! `--runs` runs with their range, the ratio ferrocomm / perftest as the median of the runs' own
//! ratios (1.0: as fast as perftest; each pair's two sides share the VM's speed of the moment)
//! and the range of those ratios; the JSON has every run's figures, the means,
//! and for gets and fetch-adds the share completed within their call and the median time of the
//! call alone.

use std::path::PathBuf;

use serde_json::json;

use crate::perftest::{Perftest, column, default_gid_index, first_device};
use crate::{Result, cli, process, rma};

/// Iterations of each perftest run.
const ITERS: u32 = 2000;

/// One-sided put/get/fetch-add latency over RDMA verbs against ib_write_lat, ib_read_lat and
/// ib_atomic_lat.
///
/// ferrocomm one-sided operations over the verbs transport (RDMA write, read and atomics on a
/// registered segment) against perftest on the same device and GID index: put latency vs
/// ib_write_lat, get latency vs ib_read_lat, fetch-add vs ib_atomic_lat, 8 B.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// The two CPUs
    #[arg(long, value_name = "A,B", default_value = "0,1", value_parser = cli::cpu_pair)]
    cpus: [usize; 2],
    /// Runs of each side, alternated; medians reported
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = cli::at_least_one)]
    runs: usize,
    /// ferrocomm alone
    #[arg(long)]
    no_peer: bool,
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The smallest and largest of `v`.
fn range(v: &[f64]) -> (f64, f64) {
    v.iter().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &x| (lo.min(x), hi.max(x)))
}

/// perftest's (t_typical, t_avg, t_min) at 8 B for `exe` with `extra` arguments, microseconds.
fn perftest_lat(p: &Perftest, exe: &str, extra: &[&str], cpus: [usize; 2]) -> Result<(f64, f64, f64)> {
    let path = process::find_in_path(exe).ok_or("perftest not in PATH: `apt-get install perftest`")?;
    let mut args: Vec<String> =
        ["-d", &p.device, "-x", &p.gid_index.to_string(), "-n", &ITERS.to_string(), "-F"].map(String::from).to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = p.pair(&path, &args, cpus)?;
    Ok((column(&out, 8, "t_typical")?, column(&out, 8, "t_avg")?, column(&out, 8, "t_min")?))
}

/// A ferrocomm job of one device latency test (`kind`, see [`rma::pair_job`]); its JSON line.
fn ferrocomm_lat(kind: &str, cpus: [usize; 2]) -> Result<serde_json::Value> {
    let v = rma::pair_job(kind, 2, cpus, "verbs")?;
    if v["transport"] != "verbs" {
        return Err(format!("the ferrocomm job ran over {} rather than verbs", v["transport"]).into());
    }
    Ok(v)
}

pub(crate) fn main(o: Options) -> Result<()> {
    let device = first_device().ok_or("no RDMA device (run inside scripts/verbs-vm.sh)")?;
    let gid = default_gid_index(&device);
    let perftest = if o.no_peer { None } else { Some(Perftest::find(&device, gid)?) };
    let tests: [(&str, &str, &str, &[&str]); 3] = [
        ("put", "put-lat", "ib_write_lat", &["-s", "8"]),
        ("get", "get-lat", "ib_read_lat", &["-s", "8"]),
        ("fetch-add", "fadd-lat", "ib_atomic_lat", &["-A", "FETCH_AND_ADD"]),
    ];
    let mut ours: Vec<Vec<f64>> = vec![Vec::new(); tests.len()];
    let mut theirs: Vec<Vec<f64>> = vec![Vec::new(); tests.len()];
    let mut pairs: Vec<Vec<(f64, f64)>> = vec![Vec::new(); tests.len()];
    let mut runs_json = Vec::new();
    for run in 0..o.runs {
        let mut run_json = json!({});
        for (i, (name, kind, exe, extra)) in tests.iter().enumerate() {
            // The two sides back to back, ferrocomm first in every other pair.
            let ferrocomm_first = (run + i) % 2 == 0;
            let mut v = json!(null);
            let mut peer = None;
            for side in if ferrocomm_first { [0, 1] } else { [1, 0] } {
                match (side, &perftest) {
                    (0, _) => v = ferrocomm_lat(kind, o.cpus)?,
                    (_, Some(p)) => peer = Some(perftest_lat(p, exe, extra, o.cpus)?),
                    _ => {}
                }
            }
            let lat = v["lat_us"].as_f64().ok_or_else(|| format!("no lat_us in {v}"))?;
            // perftest prints `inf` when its clock measurement fails: that pair is left out.
            let peer = peer.filter(|(typical, _, _)| typical.is_finite() && *typical > 0.0);
            ours[i].push(lat);
            let mut line = format!("run {}/{} {name}: ferrocomm {lat:.2} us", run + 1, o.runs);
            if let Some(x) = v["complete_in_call"].as_f64() {
                line += &format!(
                    " (p10-p90 {:.1}-{:.1}, call {:.1} us, complete in call {x:.2})",
                    v["p10_us"].as_f64().unwrap_or(f64::NAN),
                    v["p90_us"].as_f64().unwrap_or(f64::NAN),
                    v["call_us"].as_f64().unwrap_or(f64::NAN)
                );
            }
            let mut peer_json = json!(null);
            if let Some((typical, avg, min)) = peer {
                theirs[i].push(typical);
                pairs[i].push((lat, typical));
                line += &format!(
                    ", {exe} {typical:.2} us (avg {avg:.2}, min {min:.2}); ratio {:.2}; {} first",
                    lat / typical,
                    if ferrocomm_first { "ferrocomm" } else { "perftest" }
                );
                peer_json = json!({"t_typical_us": typical, "t_avg_us": avg, "t_min_us": min});
            }
            eprintln!("{line}");
            run_json[*name] = json!({"ferrocomm": v, "perftest": peer_json, "ferrocomm_first": ferrocomm_first});
        }
        runs_json.push(run_json);
    }
    println!(
        "one-sided over verbs ({device}, GID index {gid}), 8 B, medians of {} runs (range); each test's two sides back to back:",
        o.runs
    );
    println!("{:<14} {:>24} {:>24} {:>7} {:>14}", "", "ferrocomm us", "perftest us", "ratio", "runs' ratios");
    let mut summary = json!({});
    for (i, (name, _, exe, _)) in tests.iter().enumerate() {
        let f = median(ours[i].clone());
        let p = median(theirs[i].clone());
        let paired: Vec<f64> = pairs[i].iter().map(|(a, b)| a / b).collect();
        // The median of the pairs' own ratios: a change of the VM's speed between pairs cancels.
        let ratio = if paired.is_empty() { f / p } else { median(paired.clone()) };
        let (flo, fhi) = range(&ours[i]);
        let (plo, phi) = range(&theirs[i]);
        let (rlo, rhi) = range(&paired);
        let cell = |m: f64, lo: f64, hi: f64| format!("{m:.2} ({lo:.1}-{hi:.1})");
        let spread = if paired.is_empty() { "-".to_string() } else { format!("{rlo:.2}-{rhi:.2}") };
        println!(
            "{:<14} {:>24} {:>24} {ratio:>7.2} {spread:>14}   (vs {exe})",
            format!("{name} lat"),
            cell(f, flo, fhi),
            cell(p, plo, phi)
        );
        summary[*name] = json!({"ferrocomm_us": f, "perftest_us": p, "ratio": ratio, "perftest": exe,
                                "ferrocomm_runs_us": ours[i], "perftest_runs_us": theirs[i], "run_ratios": paired});
    }
    println!(
        "summary: ratios ferrocomm/perftest (latency; 1.0 = as fast): put {:.2}, get {:.2}, fetch-add {:.2}",
        summary["put"]["ratio"].as_f64().unwrap_or(f64::NAN),
        summary["get"]["ratio"].as_f64().unwrap_or(f64::NAN),
        summary["fetch-add"]["ratio"].as_f64().unwrap_or(f64::NAN)
    );
    if let Some(path) = &o.json {
        let doc = json!({"bench": "rma-verbs", "device": device, "gid_index": gid, "runs": runs_json,
                         "summary": summary, "perftest_iters": ITERS});
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)?;
    }
    Ok(())
}
