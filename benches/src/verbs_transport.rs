//! `verbs-transport`: the verbs transport alone, without the protocol engine and the async API
//! (cargo feature `verbs`).
//!
//! Why: `pingpong --transport verbs` compares the whole async API with `ib_send_lat`; this
//! splits the gap. Its ping-pong against `ib_send_lat` is what the transport's eager path costs
//! (a slot of header and payload by write-with-immediate or send, the receive reposted, credits),
//! and the difference to `pingpong` is what the layers above cost.
//!
//! Two endpoints in one process (as the device tests), each on its own thread pinned to its CPU,
//! connected through the device: rank 0 sends an 8-byte eager frame, rank 1 answers with one;
//! after a warm-up batch, `--batches` timed batches of `--pings` round trips. Each round trip is
//! stamped with the cycle counter, and a run's figure is the median round trip / 2, as
//! `ib_send_lat`'s `t_typical` is its median iteration (the median of batch means, also printed,
//! sits near the mean where round trips have a long tail, as under emulation). Once per eager
//! path asked for (`--eager`), `--runs` times, each run followed by `ib_send_lat` at 8 B on the
//! same device and CPUs (unless `--no-peer`): under emulation the VM's speed drifts within
//! minutes, so only ratios of runs taken side by side mean anything. Reported: medians over runs,
//! and their ratio.

use std::time::Instant;

use ferrocomm::transports::verbs::{Eager, VerbsConfig, VerbsEndpoint};
use ferrocomm::transports::{Limits, Rank};
use serde_json::json;

use crate::perftest::{self, Perftest};
use crate::transport::{CountSink, Node};
use crate::{Result, affinity, cli, sweep};

/// The verbs transport alone (no engine, no futures; build with --features verbs).
///
/// 8-byte eager frame ping-pong latency between two endpoints of one process on two pinned
/// threads, over the RDMA device, for each eager path (rings, shared receive queue).
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// CPUs of the two endpoints
    #[arg(long, value_name = "A,B", default_value = "0,1", value_parser = cli::cpu_pair)]
    pub cpus: [usize; 2],
    /// RDMA device [default: the first one]
    #[arg(long, value_name = "D")]
    pub device: Option<String>,
    /// Eager path: ring, srq or both
    #[arg(long, value_name = "P", default_value = "both")]
    pub eager: String,
    /// Round trips per timed batch
    #[arg(long, value_name = "N", default_value_t = 2000, value_parser = cli::at_least_one)]
    pub pings: usize,
    /// Timed batches; the median is reported
    #[arg(long, value_name = "N", default_value_t = 11, value_parser = cli::at_least_one)]
    pub batches: usize,
    /// Runs, each followed by ib_send_lat
    #[arg(long, value_name = "K", default_value_t = 3, value_parser = cli::at_least_one)]
    pub runs: usize,
    /// Without ib_send_lat
    #[arg(long)]
    pub no_peer: bool,
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    pub json: Option<String>,
}

/// `ferrocomm-bench verbs-transport`.
pub(crate) fn main(o: Options) -> Result<()> {
    let Options { cpus, device, pings, batches, runs: runs_wanted, json: json_path, .. } = o;
    let peer = !o.no_peer;
    let paths = match o.eager.as_str() {
        "both" => vec![Eager::Ring, Eager::SharedQueue],
        p => vec![p.parse::<Eager>()?],
    };
    let perf = match peer {
        true => {
            let dev = device.clone().or_else(perftest::first_device).ok_or("no RDMA device")?;
            let gid = perftest::default_gid_index(&dev);
            Some(Perftest::find(&dev, gid)?)
        }
        false => None,
    };
    // Per eager path, then ib_send_lat: one-way medians (us) of each run.
    let mut alone = vec![Vec::new(); paths.len()];
    let mut reference = Vec::new();
    for run_no in 1..=runs_wanted {
        for (k, &eager) in paths.iter().enumerate() {
            let cfg = VerbsConfig { device: device.clone(), eager, ..VerbsConfig::default() };
            let (batches_us, median) = run(cpus, cfg, pings, batches)?;
            let batch_median = sweep::median(&batches_us).ok_or("no batches")?;
            println!(
                "run {run_no}: transport alone, eager {eager:?}: 8 B one-way {median:.2} us (median round trip; \
                 median of batch means {batch_median:.2} us)"
            );
            alone[k].push(median);
        }
        if let Some(p) = &perf {
            let (_, typical) = p.send_lat(8, cpus)?;
            println!("run {run_no}: ib_send_lat 8 B t_typical {:.2} us", typical * 1e6);
            reference.push(typical * 1e6);
        }
    }
    let reference_us = sweep::median(&reference);
    let mut results = Vec::new();
    for (k, eager) in paths.iter().enumerate() {
        let median = sweep::median(&alone[k]).ok_or("no runs")?;
        let ratio = reference_us.map(|r| median / r);
        match (reference_us, ratio) {
            (Some(r), Some(q)) => println!(
                "verbs transport alone (eager {eager:?}): 8 B one-way {median:.2} us / ib_send_lat {r:.2} us = \
                 {q:.2} (medians of {runs_wanted} runs side by side)"
            ),
            _ => println!("verbs transport alone (eager {eager:?}): 8 B one-way {median:.2} us"),
        }
        results.push(json!({"eager": format!("{eager:?}"), "one_way_8B_us": median, "runs_us": alone[k],
                            "ratio_to_ib_send_lat": ratio}));
    }
    if let Some(path) = json_path {
        let doc = json!({"bench": "verbs-transport", "cpus": cpus, "pings": pings, "batches": batches,
                         "ib_send_lat_us": reference_us, "ib_send_lat_runs_us": reference,
                         "ib_send_lat_command": perf.as_ref().map(|p| p.describe()), "runs": results});
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n").map_err(|e| format!("{path}: {e}"))?;
        println!("wrote {path}");
    }
    Ok(())
}

/// One ping-pong run; returns rank 0's one-way time per batch and the median round trip's half,
/// in microseconds.
fn run(cpus: [usize; 2], cfg: VerbsConfig, pings: usize, batches: usize) -> Result<(Vec<f64>, f64)> {
    let limits = Limits { world_size: 2, eager_limit: 64 << 10, chunk: 512 << 10, max_message: 1 << 30 };
    // The completion channel is registered with a runtime, though nobody sleeps here.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let (e0, d0) = VerbsEndpoint::create(0, limits, cfg.clone())?;
    let (e1, d1) = VerbsEndpoint::create(1, limits, cfg)?;
    let (t0, t1) = {
        let _g = rt.enter();
        (e0.connect(vec![(1, d1)], vec![None, None], limits)?, e1.connect(vec![(0, d0)], vec![None, None], limits)?)
    };
    let node = |t, me: Rank| Node { t, s: CountSink { frames: 0, data: Vec::new(), lost: None }, me };
    let (mut n0, mut n1) = (node(t0, 0), node(t1, 1));
    let total = pings * (batches + 1);
    std::thread::scope(|scope| -> Result<(Vec<f64>, f64)> {
        let answer = scope.spawn(move || -> std::result::Result<(), String> {
            affinity::pin_current_thread(cpus[1]).map_err(|e| e.to_string())?;
            for i in 0..total {
                n1.spin_until(i + 1).map_err(|e| e.to_string())?;
                n1.eager(i as u64);
            }
            n1.finish().map_err(|e| e.to_string())
        });
        affinity::pin_current_thread(cpus[0])?;
        let mut out = Vec::new();
        // Cycle stamps of the timed round trips, and the clock over the same span to scale them.
        let mut stamps = Vec::with_capacity(pings * batches + 1);
        let mut timed = None;
        for b in 0..=batches {
            let start = Instant::now();
            if b == 1 {
                timed = Some(start);
                stamps.push(sweep::stamp());
            }
            for i in b * pings..(b + 1) * pings {
                n0.eager(i as u64);
                n0.spin_until(i + 1)?;
                if b > 0 {
                    stamps.push(sweep::stamp());
                }
            }
            // Batch 0 is the warm-up.
            if b > 0 {
                out.push(start.elapsed().as_secs_f64() * 1e6 / (2 * pings) as f64);
            }
        }
        let elapsed = timed.map_or(0.0, |t| t.elapsed().as_secs_f64());
        n0.finish()?;
        answer.join().map_err(|_| "the answering thread panicked")??;
        let median_trip = sweep::median(&sweep::trips(&stamps, elapsed)).unwrap_or(0.0);
        Ok((out, median_trip * 1e6 / 2.0))
    })
}
