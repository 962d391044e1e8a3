//! `ud-vs-rc`: what reliable multicast over one UD queue pair per rank costs against reaching
//! every peer over its own RC connection, as the rank count grows (the Soft-RoCE VM of
//! scripts/verbs-vm.sh).
//!
//! Measured, for each rank count: each rank starts over verbs (its RC connections to every peer:
//! the time of `init`, the connection set-up included), opens a reliable multicast channel (its
//! UD queue pair in the group), and then counts, in the device's resource tables (`rdma -j
//! resource show qp` / `mr`, its own process id), its queue pairs by type and its registered
//! memory. The launching process fits per-peer costs to the counts (the last rank count against
//! the first) and extends them to thousands of ranks: RC needs a queue pair and its buffers per
//! peer, UD one queue pair and one receive pool whatever the rank count.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferrocomm::multicast::Channel;
use ferrorun::{LaunchOptions, run_local};
use serde_json::{Value, json};

use crate::{Result, process};

/// The job's hidden subcommand and its ranks'.
pub(crate) const JOB_COMMAND: &str = "ud-vs-rc-job";
pub(crate) const RANK_COMMAND: &str = "ud-vs-rc-rank";

/// UD multicast against RC point-to-point: queue pairs, registered memory and set-up time per
/// rank against the rank count, measured on the verbs device and extended by a linear model.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Rank counts measured
    #[arg(long, value_name = "N,M,...", value_delimiter = ',', default_value = "2,3,4",
          value_parser = clap::value_parser!(u32).range(2..))]
    ranks: Vec<u32>,
    /// Rank counts the model is extended to
    #[arg(long, value_name = "N,M,...", value_delimiter = ',', default_value = "64,1024,4096,16384")]
    model: Vec<u64>,
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// One job's ranks.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct JobSpec {
    /// Ranks
    #[arg(long)]
    n: u32,
}

/// A rank's own resources, from the device's tables.
#[derive(Debug, Default)]
struct Own {
    rc: u64,
    ud: u64,
    mrs: u64,
    mr_bytes: u64,
}

/// Runs `rdma -j resource show <what>` and keeps the entries of process `pid`.
fn resources(what: &str, pid: u32) -> Result<Vec<Value>> {
    let out = Command::new("rdma").args(["-j", "-d", "resource", "show", what]).output()?;
    if !out.status.success() {
        return Err(format!("rdma resource show {what}: {}", String::from_utf8_lossy(&out.stderr)).into());
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let all = v.as_array().cloned().unwrap_or_default();
    Ok(all.into_iter().filter(|e| e["pid"].as_u64() == Some(u64::from(pid))).collect())
}

fn own() -> Result<Own> {
    let pid = std::process::id();
    let qps = resources("qp", pid)?;
    let mrs = resources("mr", pid)?;
    let ty = |t: &str| qps.iter().filter(|q| q["type"].as_str() == Some(t)).count() as u64;
    Ok(Own {
        rc: ty("RC"),
        ud: ty("UD"),
        mrs: mrs.len() as u64,
        mr_bytes: mrs.iter().filter_map(|m| m["mrlen"].as_u64()).sum(),
    })
}

pub(crate) fn main(o: Options) -> Result<()> {
    let exe = std::env::current_exe()?;
    let mut rows = Vec::new();
    println!(
        "ranks  init_ms  RC_QPs  UD_QPs  MRs  RC_reg_KiB  UD_reg_KiB  (per rank, mean over ranks; UD: the multicast channel)"
    );
    for &n in &o.ranks {
        let mut child = Command::new(&exe)
            .args([JOB_COMMAND, "--n", &n.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let out = child.stdout.take().ok_or("the job's output is not piped")?;
        let reader = std::thread::spawn(move || BufReader::new(out).lines().map_while(|l| l.ok()).collect::<Vec<_>>());
        let status = process::wait_until(&mut child, Instant::now() + Duration::from_secs(300))
            .map_err(|e| format!("the ud-vs-rc job did not finish: {e}"))?;
        let lines = reader.join().map_err(|_| "the output reader panicked")?;
        if !status.success() {
            return Err(format!("the ud-vs-rc job of {n} ranks failed ({status}): {lines:?}").into());
        }
        let ranks: Vec<Value> = lines
            .iter()
            .filter_map(|l| l.split_once("] ").map(|(_, j)| j))
            .filter_map(|j| serde_json::from_str::<Value>(j).ok())
            .collect();
        let mean = |k: &str| ranks.iter().filter_map(|r| r[k].as_f64()).sum::<f64>() / ranks.len().max(1) as f64;
        let row = json!({"ranks": n, "init_ms": mean("init_ms"), "rc_qps": mean("rc"), "ud_qps": mean("ud"),
                         "mrs": mean("mrs"), "mr_bytes": mean("mr_bytes"), "ud_mr_bytes": mean("ud_mr_bytes"),
                         "per_rank": ranks});
        println!(
            "{n:>5}  {:>7.1}  {:>6.1}  {:>6.1}  {:>3.0}  {:>10.0}  {:>10.0}",
            mean("init_ms"),
            mean("rc"),
            mean("ud"),
            mean("mrs"),
            mean("mr_bytes") / 1024.0,
            mean("ud_mr_bytes") / 1024.0
        );
        rows.push(row);
    }
    // Per-peer costs: the difference between the largest and the smallest rank count measured.
    let (first, last) = (rows.first().cloned().unwrap_or_default(), rows.last().cloned().unwrap_or_default());
    let peers = (last["ranks"].as_f64().unwrap_or(0.0) - first["ranks"].as_f64().unwrap_or(0.0)).max(1.0);
    let slope = |k: &str| (last[k].as_f64().unwrap_or(0.0) - first[k].as_f64().unwrap_or(0.0)) / peers;
    let base = |k: &str, s: f64| first[k].as_f64().unwrap_or(0.0) - s * (first["ranks"].as_f64().unwrap_or(0.0) - 1.0);
    let (qp_slope, mem_slope, init_slope) = (slope("rc_qps"), slope("mr_bytes"), slope("init_ms"));
    let (qp_base, mem_base, init_base) =
        (base("rc_qps", qp_slope), base("mr_bytes", mem_slope), base("init_ms", init_slope));
    // Set-up time at 2-4 ranks is mostly fixed costs and scheduling: a slope that does not grow
    // is not a per-peer cost, and is not extrapolated.
    let setup_grows = init_slope > 0.0;
    let per_peer_setup =
        if setup_grows { format!("{init_slope:.2} ms of set-up") } else { "no set-up growth measurable".to_string() };
    println!(
        "\nper peer: {qp_slope:.2} RC queue pairs, {:.1} KiB registered, {per_peer_setup}; \
         fixed: {qp_base:.1} queue pairs, {:.1} KiB, {init_base:.1} ms",
        mem_slope / 1024.0,
        mem_base / 1024.0
    );
    let ud_bytes = last["ud_mr_bytes"].as_f64().unwrap_or(0.0);
    println!("model (per rank): RC to every peer vs one UD queue pair in the group (its pool does not grow)");
    println!(
        "{:>7}  {:>8}  {:>14}  {:>12}  {:>6}  {:>8}",
        "ranks", "RC QPs", "RC MiB", "RC set-up s", "UD QPs", "UD MiB"
    );
    let mut model = Vec::new();
    for &n in &o.model {
        let p = (n - 1) as f64;
        let (qps, mem, init) = (qp_base + qp_slope * p, mem_base + mem_slope * p, (init_base + init_slope * p) / 1e3);
        let mib = |b: f64| b / (1 << 20) as f64;
        let init = setup_grows.then_some(init);
        let shown = init.map_or("-".to_string(), |s| format!("{s:.2}"));
        println!("{n:>7}  {qps:>8.0}  {:>14.1}  {shown:>12}  {:>6}  {:>8.1}", mib(mem), 1, mib(ud_bytes));
        model.push(json!({"ranks": n, "rc_qps": qps, "rc_mr_bytes": mem, "rc_setup_s": init, "ud_qps": 1,
                          "ud_mr_bytes": ud_bytes}));
    }
    if let Some(path) = &o.json {
        let v = json!({"bench": "ud-vs-rc", "measured": rows, "per_peer": {"rc_qps": qp_slope, "mr_bytes": mem_slope,
                       "init_ms": init_slope}, "model": model});
        std::fs::write(path, serde_json::to_string_pretty(&v)?)?;
    }
    Ok(())
}

pub(crate) fn job_main(s: JobSpec) -> Result<()> {
    let exe = std::env::current_exe()?;
    let args: Vec<OsString> = [RANK_COMMAND, "--n", &s.n.to_string()].into_iter().map(OsString::from).collect();
    let opts = LaunchOptions {
        env: vec![
            ("FERROCOMM_TRANSPORTS".into(), "verbs".into()),
            ("FERROCOMM_PROGRESS".into(), "blocking".into()),
            ("FERROCOMM_BIND".into(), "127.0.0.1".into()),
        ],
        ..LaunchOptions::default()
    };
    match run_local(s.n, &exe, &args, &opts)? {
        0 => Ok(()),
        code => Err(format!("the ranks failed (job exit code {code})").into()),
    }
}

pub(crate) fn rank_main(_: JobSpec) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let t0 = Instant::now();
        let w = ferrocomm::init().await?;
        w.barrier().await?;
        let init_ms = t0.elapsed().as_secs_f64() * 1e3;
        let before = own()?;
        let chan = Channel::new(w.comm()).await?;
        let confirmed = chan.wait_group(Duration::from_secs(10)).await;
        w.barrier().await?;
        let after = own()?;
        // The point-to-point half before the channel; the channel's UD group is the difference.
        println!(
            "{}",
            json!({"rank": w.rank(), "init_ms": init_ms, "network": chan.network(), "confirmed": confirmed,
                   "rc": before.rc, "ud": after.ud - before.ud, "mrs": before.mrs, "mr_bytes": before.mr_bytes,
                   "ud_mr_bytes": after.mr_bytes.saturating_sub(before.mr_bytes)})
        );
        w.barrier().await?;
        drop(chan);
        w.finalize().await?;
        Ok(())
    })
}
