//! `multicast`: reliable multicast against point-to-point, on one root and `--ranks - 1` receivers,
//! each rank its own process on this machine (multicast on the loopback interface).
//!
//! * **Broadcast**, sizes 8 B to 1 MiB (powers of 4): a stream of `iters` broadcasts from rank 0,
//!   by the reliable multicast [`Channel`] and by a binomial tree of point-to-point sends on the
//!   same ranks. The time runs from the root's first send until every receiver has told the root
//!   (a 0-byte point-to-point message) that it got the last one; reported per broadcast.
//! * **Barrier**, the dissertation's method (chapter 7): average latency without skew, and the
//!   synchronization delay with one rank (the highest) delayed by `--delay-us` of busy looping:
//!   the delayed rank starts a timer as it enters, every rank sends it a 0-byte message as soon
//!   as it leaves, the delay is the time of the last of those minus one point-to-point latency
//!   (median of 100 barriers).
//!   Token barrier ([`TokenBarrier`]) against the dissemination barrier ([`ferrocomm::Comm::barrier`]).
//!
//! With `--netns` every rank is a host of its own instead: a network namespace with its own address
//! on a Linux bridge (9000-byte MTU) and its own `FERROCOMM_HOST_ID`, point-to-point over TCP
//! between them, multicast over the bridge; the benchmark process starts the ranks itself.
//!
//! As for `pingpong`, the benchmark process starts a job process (`multicast-job`) whose output
//! it reads; the job launches the ranks (`multicast-rank`) with [`run_local`]. Rank 0 prints the
//! broadcast results and the delayed rank the barrier results, one JSON line each.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm::multicast::{Channel, TokenBarrier, broadcast};
use ferrocomm::{Comm, Rank};
use ferrorun::{LaunchOptions, run_local};
use serde_json::{Value, json};

use crate::process::sh;
use crate::{Result, cli, plot, process};

/// Runs per size and method (median reported).
const RUNS: usize = 3;

pub(crate) const JOB_COMMAND: &str = "multicast-job";
pub(crate) const RANK_COMMAND: &str = "multicast-rank";

/// Reliable multicast vs point-to-point: broadcast 8 B..1 MiB to 8 receivers; token vs
/// dissemination barrier with one rank late.
///
/// One root to --ranks - 1 receivers, each a process on this machine, multicast on loopback
/// (needs `ip link set lo multicast on`): broadcast by reliable multicast vs a point-to-point
/// binomial tree, 8 B to --max; token barrier vs dissemination barrier, latency and
/// synchronization delay with the last rank delayed.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Ranks, root included
    #[arg(long, value_name = "N", default_value_t = 9, value_parser = clap::value_parser!(u32).range(2..))]
    ranks: u32,
    /// Largest broadcast
    #[arg(long, value_name = "BYTES", default_value = "1M", value_parser = cli::bytes)]
    max: usize,
    /// Busy loop of the delayed rank before each barrier, microseconds
    #[arg(long, value_name = "D", default_value_t = 2000)]
    delay_us: u64,
    /// Multicast datagram size (loopback's MTU is 64 KiB)
    #[arg(long, value_name = "BYTES", default_value = "60000", value_parser = cli::bytes)]
    datagram: usize,
    /// ferrocomm progress mode of the ranks (blocking: more ranks than cores)
    #[arg(long, default_value = "blocking", value_parser = cli::progress)]
    progress: String,
    /// Point-to-point between the ranks: auto (shared memory), tcp, or verbs (then multicast
    /// goes over a UD multicast group and the binomial tree over RC queue pairs)
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp", "verbs"])]
    transports: String,
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Write the broadcast latency against size as SVG
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Stream comparison: this many messages of 1 B to 60 KiB (log-uniform) from rank 0, by
    /// multicast and by a windowed binomial broadcast, at 0% loss and at --loss on half the
    /// receivers (0: skip)
    #[arg(long, value_name = "N", default_value_t = 20_000)]
    stream: usize,
    /// Only the stream comparison (no size sweep, no barrier)
    #[arg(long)]
    stream_only: bool,
    /// Runs of the stream comparison per loss setting (median reported)
    #[arg(long, value_name = "N", default_value_t = 3)]
    stream_runs: usize,
    /// Injected receive loss on half the receivers (the odd ranks) in the lossy stream runs
    #[arg(long, value_name = "P", default_value_t = 0.2)]
    loss: f64,
    /// Internal: the receive loss of this job's odd ranks
    #[arg(long, hide = true, default_value_t = 0.0)]
    drop: f64,
    /// Each rank a host of its own: a network namespace with its own address on a Linux bridge
    /// (links of 9000-byte MTU: use --datagram 8972 or less) and its own FERROCOMM_HOST_ID;
    /// point-to-point over TCP between them, multicast over the bridge (needs root)
    #[arg(long)]
    netns: bool,
}

impl Options {
    fn to_args(&self) -> Vec<String> {
        vec![
            "--ranks".into(),
            self.ranks.to_string(),
            "--max".into(),
            self.max.to_string(),
            "--delay-us".into(),
            self.delay_us.to_string(),
            "--datagram".into(),
            self.datagram.to_string(),
            "--progress".into(),
            self.progress.clone(),
            "--transports".into(),
            self.transports.clone(),
            "--stream".into(),
            self.stream.to_string(),
            "--stream-runs".into(),
            self.stream_runs.to_string(),
            "--drop".into(),
            self.drop.to_string(),
        ]
        .into_iter()
        .chain(self.stream_only.then(|| "--stream-only".to_string()))
        .collect()
    }
}

/// Hosts for `--netns`: one network namespace per rank, each joined by a veth pair to a bridge
/// in a hub namespace of its own (multicast snooping off: the bridge floods the group to every
/// port, as a switch without IGMP snooping does). Rank r is `10.90.S.(r+1)`. Removed on drop.
struct NetnsHosts {
    names: Vec<String>,
    ranks: Vec<(String, String)>,
}

impl Drop for NetnsHosts {
    fn drop(&mut self) {
        for n in self.names.iter().rev() {
            let _ = sh(&["ip", "netns", "del", n]);
        }
    }
}

impl NetnsHosts {
    fn new(n: u32) -> Result<NetnsHosts> {
        let id = std::process::id();
        let (prefix, subnet) = (format!("fcmb{}", id % 100_000), 100 + id % 100);
        let mut h = NetnsHosts { names: Vec::new(), ranks: Vec::new() };
        let add = |h: &mut NetnsHosts, name: String| -> Result<String> {
            let _ = sh(&["ip", "netns", "del", &name]);
            sh(&["ip", "netns", "add", &name])?;
            h.names.push(name.clone());
            sh(&["ip", "-n", &name, "link", "set", "lo", "up"])?;
            Ok(name)
        };
        let hub = add(&mut h, format!("{prefix}h"))?;
        sh(&["ip", "-n", &hub, "link", "add", "br0", "mtu", "9000", "type", "bridge", "mcast_snooping", "0"])?;
        sh(&["ip", "-n", &hub, "link", "set", "br0", "up"])?;
        for r in 0..n {
            let name = add(&mut h, format!("{prefix}r{r}"))?;
            let port = format!("v{r}");
            sh(&[
                "ip", "-n", &hub, "link", "add", &port, "mtu", "9000", "type", "veth", "peer", "name", "eth0", "netns",
                &name,
            ])?;
            sh(&["ip", "-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
            let addr = format!("10.90.{subnet}.{}", r + 1);
            sh(&["ip", "-n", &name, "addr", "add", &format!("{addr}/24"), "dev", "eth0"])?;
            // The peer's MTU is its own (1500 unless set): without this, every datagram above
            // 1472 bytes leaves the host in IP fragments.
            sh(&["ip", "-n", &name, "link", "set", "eth0", "mtu", "9000", "up"])?;
            sh(&["ip", "-n", &name, "route", "add", "224.0.0.0/4", "dev", "eth0"])?;
            h.ranks.push((name, addr));
        }
        Ok(h)
    }
}

/// UDP receive-buffer overflows of namespace `ns`.
fn rcvbuf_errors_in(ns: &str) -> Option<u64> {
    let out = Command::new("ip").args(["netns", "exec", ns, "cat", "/proc/net/snmp"]).output().ok()?;
    snmp_rcvbuf_errors(&String::from_utf8_lossy(&out.stdout))
}

/// `--netns`: every rank in its namespace, started directly (a launcher would start them all in
/// this one); returns their JSON lines, echoing the others, and the UDP receive-buffer overflows.
fn run_netns_job(o: &Options) -> Result<(Vec<Value>, Option<u64>)> {
    let hosts = NetnsHosts::new(o.ranks)?;
    let exe = std::env::current_exe()?;
    let token: String = (0..32u32).map(|i| format!("{:02x}", (std::process::id() + i * 29) as u8)).collect();
    let coord = format!("{}:29600", hosts.ranks[0].1);
    let mut children = Vec::new();
    for (r, (ns, addr)) in hosts.ranks.iter().enumerate() {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(&exe).arg(RANK_COMMAND).args(o.to_args());
        c.env("FERROCOMM_RANK", r.to_string())
            .env("FERROCOMM_SIZE", o.ranks.to_string())
            .env("FERROCOMM_COORD", &coord)
            .env("FERROCOMM_TOKEN", &token)
            .env("FERROCOMM_HOST_STORE", if r == 0 { "1" } else { "0" })
            .env("FERROCOMM_BIND", addr)
            .env("FERROCOMM_HOST_ID", format!("mcast-bench-host-{r}"))
            .env("FERROCOMM_TRANSPORTS", "tcp")
            .env("FERROCOMM_PROGRESS", &o.progress)
            .env("FERROCOMM_MCAST_DATAGRAM", o.datagram.to_string())
            .env("FERROCOMM_MCAST_IF", addr)
            .env_remove("FERROCOMM_LAUNCHER");
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::inherit());
        children.push(c.spawn()?);
    }
    let readers: Vec<_> = children
        .iter_mut()
        .map(|c| {
            let out = c.stdout.take().expect("piped");
            std::thread::spawn(move || BufReader::new(out).lines().map_while(|l| l.ok()).collect::<Vec<_>>())
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(1200);
    let mut failed = None;
    for (r, c) in children.iter_mut().enumerate() {
        let status = process::wait_until(c, deadline).map_err(|e| format!("rank {r} did not finish: {e}"))?;
        if !status.success() && failed.is_none() {
            failed = Some(format!("rank {r} failed ({status})"));
        }
    }
    let mut values = Vec::new();
    for reader in readers {
        for line in reader.join().map_err(|_| "an output reader panicked")? {
            match serde_json::from_str::<Value>(&line).ok().filter(|_| line.starts_with('{')) {
                Some(v) => values.push(v),
                None => eprintln!("  {line}"),
            }
        }
    }
    if let Some(f) = failed {
        return Err(f.into());
    }
    let overflows = hosts.ranks.iter().map(|(ns, _)| rcvbuf_errors_in(ns)).sum::<Option<u64>>();
    Ok((values, overflows))
}

/// Runs one job (`multicast-job`) and returns its JSON lines, echoing the others.
fn run_job(o: &Options) -> Result<Vec<Value>> {
    if o.netns {
        return run_netns_job(o).map(|(v, _)| v);
    }
    let exe = std::env::current_exe()?;
    let mut child = Command::new(&exe)
        .arg(JOB_COMMAND)
        .args(o.to_args())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?;
    let out = child.stdout.take().ok_or("the job's output is not piped")?;
    let reader = std::thread::spawn(move || BufReader::new(out).lines().map_while(|l| l.ok()).collect::<Vec<_>>());
    let status = process::wait_until(&mut child, Instant::now() + Duration::from_secs(1200))
        .map_err(|e| format!("the multicast job did not finish: {e}"))?;
    let lines = reader.join().map_err(|_| "the output reader panicked")?;
    let mut values = Vec::new();
    for line in &lines {
        let json = line.split_once("] ").map(|(_, j)| j).filter(|j| j.starts_with('{'));
        match json.and_then(|j| serde_json::from_str::<Value>(j).ok()) {
            Some(v) => values.push(v),
            None => eprintln!("  {line}"),
        }
    }
    if !status.success() {
        return Err(format!("the multicast job failed ({status})").into());
    }
    Ok(values)
}

/// UDP receive-buffer overflows of this network namespace (`RcvbufErrors` of /proc/net/snmp).
fn rcvbuf_errors() -> Option<u64> {
    snmp_rcvbuf_errors(&std::fs::read_to_string("/proc/net/snmp").ok()?)
}

/// `RcvbufErrors` of the text of /proc/net/snmp.
fn snmp_rcvbuf_errors(snmp: &str) -> Option<u64> {
    let mut udp = snmp.lines().filter(|l| l.starts_with("Udp:"));
    let (names, values) = (udp.next()?, udp.next()?);
    let i = names.split_whitespace().position(|n| n == "RcvbufErrors")?;
    values.split_whitespace().nth(i)?.parse().ok()
}

/// Median and spread (min, max) of `v`.
fn spread(v: &[f64]) -> (f64, f64, f64) {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    (v.get(v.len() / 2).copied().unwrap_or(0.0), v.first().copied().unwrap_or(0.0), v.last().copied().unwrap_or(0.0))
}

/// The stream comparison: 0% and `--loss` on half the receivers, one job each.
fn stream_report(o: &Options) -> Result<Value> {
    let mut phases = Vec::new();
    for drop in [0.0, o.loss] {
        let job = Options { drop, stream_only: true, ..o.clone() };
        let (values, overflows) = if o.netns {
            // Fresh namespaces per job: their counters start at zero.
            run_netns_job(&job)?
        } else {
            let before = rcvbuf_errors();
            let values = run_job(&job)?;
            (values, rcvbuf_errors().zip(before).map(|(a, b)| a.saturating_sub(b)))
        };
        let runs: Vec<&Value> = values.iter().filter(|v| v.get("stream_run").is_some()).collect();
        let stats: Vec<&Value> = values.iter().filter(|v| v.get("stream_stats").is_some()).collect();
        let col = |k: &str| runs.iter().filter_map(|r| r["stream_run"][k].as_f64()).collect::<Vec<_>>();
        let (m, p) = (col("mcast_mbs"), col("p2p_mbs"));
        let ratios: Vec<f64> = m.iter().zip(&p).map(|(m, p)| m / p).collect();
        phases.push(json!({"drop": drop, "mcast_mbs": m, "p2p_mbs": p, "ratios": ratios,
                           "rcvbuf_errors": overflows, "stats": stats}));
    }
    let bytes = stream_bytes(o.stream);
    println!(
        "stream: {} messages of 1 B..60 KiB ({:.1} MB) from rank 0 to {} receivers{}, datagram {} B, {} runs; \
         MB/s median [min, max]",
        o.stream,
        bytes as f64 / 1e6,
        o.ranks - 1,
        if o.netns { " (each rank a namespace host, point-to-point over TCP)" } else { "" },
        o.datagram,
        o.stream_runs
    );
    println!("{:>22} {:>24} {:>24} {:>22}", "loss", "multicast MB/s", "binomial MB/s", "multicast/binomial");
    let mut zero = 0.0;
    for ph in &phases {
        let get = |k: &str| ph[k].as_array().map(|a| a.iter().filter_map(Value::as_f64).collect::<Vec<_>>());
        let (m, p, r) = (
            spread(&get("mcast_mbs").unwrap_or_default()),
            spread(&get("p2p_mbs").unwrap_or_default()),
            spread(&get("ratios").unwrap_or_default()),
        );
        let drop = ph["drop"].as_f64().unwrap_or(0.0);
        if drop == 0.0 {
            zero = m.0;
        }
        let loss = if drop == 0.0 { "0%".to_string() } else { format!("{:.0}% on odd ranks", drop * 100.0) };
        println!(
            "{loss:>22} {:>9.1} [{:>5.1}, {:>5.1}] {:>9.1} [{:>5.1}, {:>5.1}] {:>8.2}x [{:.2}, {:.2}]",
            m.0, m.1, m.2, p.0, p.1, p.2, r.0, r.1, r.2
        );
        // In rank order (the ranks print in any order).
        let mut nacks: Vec<(u64, u64)> = ph["stats"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["rank"].as_u64() != Some(0))
            .filter_map(|s| Some((s["rank"].as_u64()?, s["stream_stats"]["nacks_sent"].as_u64()?)))
            .collect();
        nacks.sort_unstable();
        let nacks: Vec<u64> = nacks.into_iter().map(|(_, n)| n).collect();
        let root = ph["stats"].as_array().into_iter().flatten().find(|s| s["rank"].as_u64() == Some(0));
        let rs = |k: &str| root.and_then(|r| r["stream_stats"][k].as_u64()).unwrap_or(0);
        println!(
            "{:>22} NACKs per receiver (ranks 1..) {:?}, root: window full {} times, {} retransmissions; UDP receive-buffer overflows {}",
            "",
            nacks,
            rs("window_stalls"),
            rs("retransmissions"),
            ph["rcvbuf_errors"]
        );
        if drop > 0.0 && zero > 0.0 {
            println!("{:>22} multicast at {loss} / multicast at 0%: {:.2}x the time", "", zero / m.0);
        }
    }
    Ok(json!({"messages": o.stream, "bytes": bytes, "phases": phases}))
}

/// Length of stream message `i`: log-uniform in 1 B..60 KiB (deterministic).
fn stream_len(i: usize) -> usize {
    let x = ((i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 11) as f64 / (1u64 << 53) as f64;
    (61_440f64.powf(x) as usize).clamp(1, 61_440)
}

fn stream_bytes(n: usize) -> usize {
    (0..n).map(stream_len).sum()
}

/// `multicast`: runs the jobs, prints the report.
pub(crate) fn main(o: Options) -> Result<()> {
    // Namespace hosts reach each other over TCP only.
    let o = if o.netns { Options { transports: "tcp".into(), ..o } } else { o };
    let stream = if o.stream > 0 { Some(stream_report(&o)?) } else { None };
    if o.stream_only {
        if let (Some(path), Some(stream)) = (&o.json, &stream) {
            let all = json!({ "ranks": o.ranks, "datagram": o.datagram, "progress": o.progress,
                              "transports": o.transports, "stream": stream });
            std::fs::write(path, serde_json::to_string_pretty(&all)? + "\n")?;
            println!("wrote {}", path.display());
        }
        return Ok(());
    }
    let values = run_job(&Options { stream: 0, ..o.clone() })?;
    let bcast = values.iter().find(|v| v.get("bcast").is_some()).cloned();
    let barrier = values.iter().find(|v| v.get("barrier").is_some()).cloned();
    let bcast = bcast.ok_or("rank 0 printed no broadcast results")?;
    let barrier = barrier.ok_or("the delayed rank printed no barrier results")?;
    println!(
        "reliable multicast, 1 root -> {} receivers, {} progress, point-to-point {}, datagram {} B, group confirmed: {}",
        o.ranks - 1,
        o.progress,
        o.transports,
        o.datagram,
        bcast["confirmed"]
    );
    println!("{:>9} {:>7} {:>14} {:>14} {:>10}", "bytes", "iters", "multicast us", "binomial us", "p2p/mcast");
    for r in bcast["bcast"].as_array().ok_or("no rows")? {
        let (m, p) = (r["mcast_us"].as_f64().unwrap_or(0.0), r["p2p_us"].as_f64().unwrap_or(0.0));
        let (bytes, iters) = (r["bytes"].as_u64().unwrap_or(0), r["iters"].as_u64().unwrap_or(0));
        println!("{bytes:>9} {iters:>7} {m:>14.1} {p:>14.1} {:>9.2}x", p / m);
    }
    let b = &barrier["barrier"];
    let f = |k: &str| b[k].as_f64().unwrap_or(0.0);
    println!("barrier, {} ranks, rank {} delayed by {} us:", o.ranks, o.ranks - 1, o.delay_us);
    println!(
        "  average latency (no skew): token {:.1} us, dissemination {:.1} us",
        f("token_latency_us"),
        f("diss_latency_us")
    );
    println!(
        "  synchronization delay: token {:.1} us, dissemination {:.1} us: dissemination/token = {:.2}x (p2p latency {:.1} us subtracted)",
        f("token_sync_us"),
        f("diss_sync_us"),
        f("diss_sync_us") / f("token_sync_us"),
        f("p2p_us")
    );
    if let Some(path) = &o.plot {
        let rows = bcast["bcast"].as_array().ok_or("no rows")?;
        let curve = |name: &str, key: &str| plot::Series {
            name: name.into(),
            points: rows.iter().filter_map(|r| Some((r["bytes"].as_f64()?, r[key].as_f64()?))).collect(),
        };
        let panel = plot::Panel {
            title: "Broadcast latency vs message size".into(),
            ylabel: "latency (µs)".into(),
            y: plot::YAxis::Log,
            series: vec![curve("reliable multicast", "mcast_us"), curve("binomial tree (point-to-point)", "p2p_us")],
        };
        let subtitle = format!(
            "1 root -> {} receivers, {} progress, point-to-point {}, datagram {} B; median of {RUNS} runs",
            o.ranks - 1,
            o.progress,
            o.transports,
            o.datagram
        );
        plot::write(path, &plot::figure("ferrocomm: reliable multicast vs binomial broadcast", &subtitle, &[panel]))?;
    }
    if let Some(path) = &o.json {
        let all = json!({ "ranks": o.ranks, "datagram": o.datagram, "progress": o.progress, "delay_us": o.delay_us,
                          "transports": o.transports,
                          "bcast": bcast, "barrier": barrier, "stream": stream });
        std::fs::write(path, serde_json::to_string_pretty(&all)? + "\n")?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// `multicast-job`: launches the ranks.
pub(crate) fn job_main(o: Options) -> Result<()> {
    let exe = std::env::current_exe()?;
    let rank_args: Vec<OsString> =
        std::iter::once(RANK_COMMAND.to_string()).chain(o.to_args()).map(OsString::from).collect();
    let opts = LaunchOptions {
        env: vec![
            ("FERROCOMM_PROGRESS".into(), o.progress.clone()),
            ("FERROCOMM_TRANSPORTS".into(), o.transports.clone()),
            ("FERROCOMM_MCAST_DATAGRAM".into(), o.datagram.to_string()),
            ("FERROCOMM_MCAST_IF".into(), "127.0.0.1".into()),
            ("FERROCOMM_BIND".into(), "127.0.0.1".into()),
        ],
        ..LaunchOptions::default()
    };
    match run_local(o.ranks, &exe, &rank_args, &opts)? {
        0 => Ok(()),
        code => Err(format!("the ranks failed (job exit code {code})").into()),
    }
}

/// Binomial-tree broadcast over point-to-point: the reference the multicast is measured against.
async fn binomial(comm: &Comm, root: Rank, tag: u64, data: Option<Bytes>) -> ferrocomm::Result<Bytes> {
    let (me, n) = (comm.rank(), comm.size());
    let vr = (me + n - root) % n;
    let mut data = data;
    let mut mask = 1;
    while mask < n {
        if vr & mask != 0 {
            data = Some(comm.recv((me + n - mask) % n, tag).await?.data);
            break;
        }
        mask <<= 1;
    }
    let data = data.expect("the root has the data");
    let mut sends = Vec::new();
    mask >>= 1;
    while mask > 0 {
        if vr + mask < n {
            sends.push(comm.send((me + mask) % n, tag, data.clone()));
        }
        mask >>= 1;
    }
    for s in sends {
        s.await?;
    }
    Ok(data)
}

fn sizes(max: usize) -> Vec<usize> {
    let mut v = vec![8];
    while v.last().is_some_and(|&s| s * 4 <= max) {
        v.push(v.last().unwrap() * 4);
    }
    if v.last() != Some(&max) && max > 8 {
        v.push(max);
    }
    v
}

fn spin(d: Duration) {
    let t = Instant::now();
    while t.elapsed() < d {
        std::hint::spin_loop();
    }
}

/// The stream comparison on one rank: `--stream-runs` runs, each the multicast stream then the
/// windowed binomial stream; rank 0 prints each run's throughput, every rank its counters.
async fn stream_rank(o: &Options, w: &ferrocomm::World, chan: &Channel, p2p: &Comm) -> Result<()> {
    let (me, n) = (w.rank(), w.size());
    let window = w.settings().multicast.window;
    let buf: Bytes = (0..61_440).map(|i| (i % 251) as u8).collect::<Vec<u8>>().into();
    let bytes = stream_bytes(o.stream) as f64;
    let mut tag = 3u64 << 40;
    for run in 0..o.stream_runs {
        let mut mbs = [0.0f64; 2];
        for (m, mbs) in mbs.iter_mut().enumerate() {
            w.barrier().await?;
            let t0 = Instant::now();
            if m == 0 {
                for i in 0..o.stream {
                    if me == 0 {
                        chan.send(buf.slice(..stream_len(i))).await?;
                    } else {
                        let got = chan.recv(0).await?;
                        if got.len() != stream_len(i) {
                            return Err(format!("rank {me}: message {i} has {} bytes", got.len()).into());
                        }
                    }
                }
            } else {
                // Up to `window` broadcasts in flight, as the multicast window allows.
                let mut q: std::collections::VecDeque<(usize, tokio::task::JoinHandle<ferrocomm::Result<Bytes>>)> =
                    std::collections::VecDeque::new();
                for i in 0..=o.stream {
                    if q.len() >= window || i == o.stream {
                        while let Some((k, h)) = q.pop_front() {
                            let got: Bytes = h.await.map_err(|e| e.to_string())??;
                            if got.len() != stream_len(k) {
                                return Err(format!("rank {me}: message {k} has {} bytes", got.len()).into());
                            }
                            if i < o.stream {
                                break;
                            }
                        }
                    }
                    if i == o.stream {
                        break;
                    }
                    tag += 1;
                    let data = (me == 0).then(|| buf.slice(..stream_len(i)));
                    let (c, t) = (p2p.clone(), tag);
                    q.push_back((i, tokio::spawn(async move { binomial(&c, 0, t, data).await })));
                }
            }
            tag += 1;
            if me == 0 {
                for _ in 1..n {
                    w.recv(ferrocomm::Source::Any, tag).await?;
                }
                *mbs = bytes / t0.elapsed().as_secs_f64() / 1e6;
            } else {
                w.send(0, tag, Bytes::new()).await?;
            }
        }
        if me == 0 {
            println!("{}", json!({"stream_run": {"run": run, "mcast_mbs": mbs[0], "p2p_mbs": mbs[1]}}));
        }
    }
    chan.flush().await?;
    let s = chan.stats();
    println!(
        "{}",
        json!({"rank": me, "stream_stats": {"nacks_sent": s.nacks_sent, "nacks_received": s.nacks_received,
               "retransmissions": s.retransmissions, "false_retransmissions": s.false_retransmissions,
               "window_stalls": s.window_stalls, "duplicates": s.duplicates, "out_of_window": s.out_of_window,
               "acks_sent": s.acks_sent, "acks_at_root": s.acks_at_root, "datagrams_sent": s.datagrams_sent,
               "copies_sent": s.copies_sent, "malformed": s.malformed, "unauthenticated": s.unauthenticated}})
    );
    Ok(())
}

/// `multicast-rank`: one rank.
pub(crate) fn rank_main(o: Options) -> Result<()> {
    // One thread: the channel's driver task and the rank's code wake each other without a
    // cross-thread hand-off (9 ranks share 2 cores here).
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        // Injected loss (the driver's test hook, on received datagrams) on the odd ranks only.
        let mut settings = ferrocomm::Settings::from_env()?;
        let rank: u32 = std::env::var("FERROCOMM_RANK").ok().and_then(|r| r.parse().ok()).unwrap_or(0);
        if o.drop > 0.0 && rank % 2 == 1 {
            settings.multicast.test_drop = o.drop;
        }
        let w = ferrocomm::init_with(settings).await?;
        let (me, n) = (w.rank(), w.size());
        let chan = Channel::new(w.comm()).await?;
        let token = TokenBarrier::new(w.comm()).await?;
        let p2p = w.dup()?;
        let confirmed =
            chan.wait_group(Duration::from_secs(10)).await & token.channel().wait_group(Duration::from_secs(10)).await;
        w.barrier().await?;

        if o.stream > 0 {
            stream_rank(&o, &w, &chan, &p2p).await?;
            if o.stream_only {
                w.barrier().await?;
                drop(token);
                drop(chan);
                w.finalize().await?;
                return Ok(());
            }
        }

        // Broadcast.
        let buf: Bytes = (0..o.max).map(|i| (i % 251) as u8).collect::<Vec<u8>>().into();
        let mut rows = Vec::new();
        let mut tag = 0u64;
        for size in sizes(o.max) {
            let iters = (8usize << 20).div_ceil(size).clamp(10, 300);
            let payload = buf.slice(..size);
            // Runs alternate the two methods; the report takes the median of RUNS.
            let mut times = [Vec::new(), Vec::new()];
            for _ in 0..RUNS {
                for (m, time) in times.iter_mut().enumerate() {
                    for (warm, count) in [(true, iters.div_ceil(10)), (false, iters)] {
                        w.barrier().await?;
                        let t0 = Instant::now();
                        for _ in 0..count {
                            tag += 1;
                            let data = (me == 0).then(|| payload.clone());
                            let got = if m == 0 {
                                broadcast(&chan, 0, data).await?
                            } else {
                                binomial(&p2p, 0, tag, data).await?
                            };
                            if got.len() != size {
                                return Err(format!("rank {me}: got {} bytes, not {size}", got.len()).into());
                            }
                        }
                        tag += 1;
                        if me == 0 {
                            for _ in 1..n {
                                w.recv(ferrocomm::Source::Any, tag).await?;
                            }
                            if !warm {
                                time.push(t0.elapsed().as_secs_f64() / count as f64 * 1e6);
                            }
                        } else {
                            w.send(0, tag, Bytes::new()).await?;
                        }
                    }
                }
            }
            let times = times.map(|mut v| {
                v.sort_by(f64::total_cmp);
                v.get(v.len() / 2).copied().unwrap_or(0.0)
            });
            rows.push(json!({"bytes": size, "iters": iters, "mcast_us": times[0], "p2p_us": times[1]}));
        }
        chan.flush().await?;
        if me == 0 {
            println!("{}", json!({"bcast": rows, "confirmed": confirmed, "stats": format!("{:?}", chan.stats())}));
        }

        // Barriers: latency without skew.
        let target = n - 1;
        const LAT_ITERS: u32 = 300;
        let mut lat = [0.0f64; 2];
        for (m, l) in lat.iter_mut().enumerate() {
            w.barrier().await?;
            let t0 = Instant::now();
            for _ in 0..LAT_ITERS {
                if m == 0 { token.wait().await? } else { p2p.barrier().await? }
            }
            *l = t0.elapsed().as_secs_f64() / f64::from(LAT_ITERS) * 1e6;
        }
        // Point-to-point latency between the delayed rank and rank 0 (half a round trip).
        w.barrier().await?;
        let mut p2p_us = 0.0;
        if me == 0 || me == target {
            let other = if me == 0 { target } else { 0 };
            let t0 = Instant::now();
            for i in 0..200u64 {
                if me == 0 {
                    w.send(other, 1 << 40 | i, Bytes::new()).await?;
                    w.recv(other, 1 << 40 | i).await?;
                } else {
                    w.recv(other, 1 << 40 | i).await?;
                    w.send(other, 1 << 40 | i, Bytes::new()).await?;
                }
            }
            p2p_us = t0.elapsed().as_secs_f64() / 400.0 * 1e6;
        }
        // Synchronization delay with the last rank late.
        const SYNC_ITERS: u64 = 100;
        let mut sync = [0.0f64; 2];
        for (m, s) in sync.iter_mut().enumerate() {
            let mut delays = Vec::new();
            for i in 0..SYNC_ITERS {
                let tag = 2 << 40 | (m as u64) << 32 | i;
                w.barrier().await?;
                if me == target {
                    spin(Duration::from_micros(o.delay_us));
                    let t0 = Instant::now();
                    if m == 0 {
                        token.wait().await?
                    } else {
                        p2p.barrier().await?
                    }
                    for _ in 0..n - 1 {
                        w.recv(ferrocomm::Source::Any, tag).await?;
                    }
                    delays.push(t0.elapsed().as_secs_f64() * 1e6 - p2p_us);
                } else {
                    if m == 0 {
                        token.wait().await?
                    } else {
                        p2p.barrier().await?
                    }
                    w.send(target, tag, Bytes::new()).await?;
                }
            }
            // The median: a 2-core machine running 9 ranks has outliers.
            delays.sort_by(f64::total_cmp);
            *s = delays.get(delays.len() / 2).copied().unwrap_or(0.0);
        }
        if me == target {
            println!(
                "{}",
                json!({"barrier": {"token_latency_us": lat[0], "diss_latency_us": lat[1], "token_sync_us": sync[0],
                        "diss_sync_us": sync[1], "p2p_us": p2p_us, "delay_us": o.delay_us,
                        "release_stats": format!("{:?}", token.channel().stats())}})
            );
        }
        w.barrier().await?;
        drop(token);
        drop(chan);
        w.finalize().await?;
        Ok(())
    })
}
