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
//! ferrocomm's figures are medians of the operations' times, perftest's its `t_typical` (the
//! median); both means are in the JSON. Each side runs `--runs` times, alternately; the report
//! gives medians and the ratios ferrocomm / perftest (1.0: as fast as perftest).

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

/// perftest's (t_typical, t_avg) at 8 B for `exe` with `extra` arguments, microseconds.
fn perftest_lat(p: &Perftest, exe: &str, extra: &[&str], cpus: [usize; 2]) -> Result<(f64, f64)> {
    let path = process::find_in_path(exe).ok_or("perftest not in PATH: `apt-get install perftest`")?;
    let mut args: Vec<String> =
        ["-d", &p.device, "-x", &p.gid_index.to_string(), "-n", &ITERS.to_string(), "-F"].map(String::from).to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    let out = p.pair(&path, &args, cpus)?;
    Ok((column(&out, 8, "t_typical")?, column(&out, 8, "t_avg")?))
}

pub(crate) fn main(o: Options) -> Result<()> {
    let device = first_device().ok_or("no RDMA device (run inside scripts/verbs-vm.sh)")?;
    let gid = default_gid_index(&device);
    let perftest = if o.no_peer { None } else { Some(Perftest::find(&device, gid)?) };
    let tests: [(&str, &str, &str, &[&str]); 3] = [
        ("put", "put_lat_us", "ib_write_lat", &["-s", "8"]),
        ("get", "get_lat_us", "ib_read_lat", &["-s", "8"]),
        ("fetch-add", "fadd_lat_us", "ib_atomic_lat", &["-A", "FETCH_AND_ADD"]),
    ];
    let mut ours: Vec<Vec<f64>> = vec![Vec::new(); tests.len()];
    let mut theirs: Vec<Vec<f64>> = vec![Vec::new(); tests.len()];
    let mut runs_json = Vec::new();
    for run in 0..o.runs {
        let v = rma::pair_job("pair", 2, o.cpus, "verbs")?;
        if v["transport"] != "verbs" {
            return Err(format!("the ferrocomm job ran over {} rather than verbs", v["transport"]).into());
        }
        let mut peer = json!({});
        for (i, (name, key, exe, extra)) in tests.iter().enumerate() {
            ours[i].push(v[*key].as_f64().ok_or_else(|| format!("no {key} in {v}"))?);
            if let Some(p) = &perftest {
                let (typical, avg) = perftest_lat(p, exe, extra, o.cpus)?;
                theirs[i].push(typical);
                peer[*name] = json!({"t_typical_us": typical, "t_avg_us": avg});
            }
        }
        eprintln!("run {}/{}: ferrocomm {v}", run + 1, o.runs);
        runs_json.push(json!({"ferrocomm": v, "perftest": peer}));
    }
    println!("one-sided over verbs ({device}, GID index {gid}), 8 B, medians of {} runs:", o.runs);
    println!("{:<12} {:>14} {:>14} {:>8}", "", "ferrocomm us", "perftest us", "ratio");
    let mut summary = json!({});
    for (i, (name, _, exe, _)) in tests.iter().enumerate() {
        let f = median(ours[i].clone());
        let p = median(theirs[i].clone());
        let ratio = f / p;
        println!("{:<12} {f:>14.2} {p:>14.2} {ratio:>8.2}   (vs {exe})", format!("{name} lat"));
        summary[*name] = json!({"ferrocomm_us": f, "perftest_us": p, "ratio": ratio, "perftest": exe});
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
