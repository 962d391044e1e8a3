//! `ferrocomm-bench rails`: multi-rail striping between two hosts, in one invocation.
//!
//! The hosts are two network namespaces joined by two veth pairs (10.89.1.0/24 and 10.89.2.0/24);
//! `tc tbf` on both ends of a pair sets its rate. Each scenario is a job of two ranks (this binary,
//! `rails-rank`, one per namespace): rank 0 sends `--reps` messages of `--size` bytes to rank 1,
//! which answers the last with one byte; bandwidth = bytes / time from the first send to that
//! answer. Scenarios:
//!
//! * **unequal**: rail 1 at `--fast`, rail 2 at `--slow`; striped over both against rail 1 alone
//!   (goal: at least 1.15x);
//! * **equal**: both at `--fast`; striped against one (goal: at least 1.7x);
//! * **equal, unshaped**: both veth pairs at full speed (CPU-bound on a small machine);
//! * **cut**: striped at `--fast` on both, and one rail's link taken down 200 ms into the
//!   transfer, once rail 1 (the second veth pair) and once rail 0 (the first pair, which carries
//!   the bootstrap connection and the control frames until it fails): every message must arrive
//!   whole (checked byte for byte), and the time is reported. The job's store sits on the pair
//!   that stays up.
//!
//! * **proxy routes** (also alone, `--proxy-only`): three hosts, A and C joined by a direct link
//!   at `--slow-direct` and each joined to B at `--fast`; rank 1 (A) streams `--route-size`
//!   messages to rank 2 (C) with proxies off (the direct link), then with proxies on, the costs from
//!   the start-up probe and then from the calibration file this bench measures (goal: at least
//!   1.5x); then the same over an unshaped direct link (goal: the route chosen is direct).
//!
//! Needs root (namespaces, tc). Each scenario is run `--runs` times; the median is reported.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::process::sh;
use crate::{Result, cli};

pub(crate) const RANK_COMMAND: &str = "rails-rank";

#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// Message size
    #[arg(long, default_value = "16M", value_parser = cli::bytes)]
    size: usize,
    /// Messages per run
    #[arg(long, default_value_t = 4, value_parser = cli::at_least_one)]
    reps: usize,
    /// Runs per scenario (median reported)
    #[arg(long, default_value_t = 3, value_parser = cli::at_least_one)]
    runs: usize,
    /// tc rate of the fast rail (and of both, in the equal scenario)
    #[arg(long, default_value = "800mbit")]
    fast: String,
    /// tc rate of the slow rail
    #[arg(long, default_value = "400mbit")]
    slow: String,
    /// tc rate of the slow direct link in the proxy scenarios (the hops through the proxy run at
    /// `--fast`)
    #[arg(long, default_value = "100mbit")]
    slow_direct: String,
    /// Message size of the proxy scenarios
    #[arg(long, default_value = "4M", value_parser = cli::bytes)]
    route_size: usize,
    /// Where the measured calibration file is written
    #[arg(long, value_name = "FILE")]
    costs: Option<std::path::PathBuf>,
    /// Only the proxy route scenarios (not the striping ones)
    #[arg(long)]
    proxy_only: bool,
}

/// One rank of a scenario (hidden subcommand).
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct RankSpec {
    #[arg(long)]
    size: usize,
    #[arg(long)]
    reps: usize,
    /// `stream` (rank `from` sends to rank `to`) or `calibrate` (every directly connected pair)
    #[arg(long, default_value = "stream")]
    mode: String,
    #[arg(long, default_value_t = 0)]
    from: u32,
    #[arg(long, default_value_t = 1)]
    to: u32,
}

struct Hosts {
    a: String,
    b: String,
}

impl Drop for Hosts {
    fn drop(&mut self) {
        let _ = sh(&["ip", "netns", "del", &self.a]);
        let _ = sh(&["ip", "netns", "del", &self.b]);
    }
}

impl Hosts {
    fn new() -> Result<Hosts> {
        let p = format!("fcbr{}", std::process::id() % 100_000);
        let hosts = Hosts { a: format!("{p}a"), b: format!("{p}b") };
        for n in [&hosts.a, &hosts.b] {
            let _ = sh(&["ip", "netns", "del", n]);
            sh(&["ip", "netns", "add", n])?;
            sh(&["ip", "-n", n, "link", "set", "lo", "up"])?;
        }
        for rail in 1..=2 {
            let (ea, eb) = (format!("r{rail}a"), format!("r{rail}b"));
            sh(&["ip", "-n", &hosts.a, "link", "add", &ea, "type", "veth", "peer", "name", &eb, "netns", &hosts.b])?;
            sh(&["ip", "-n", &hosts.a, "addr", "add", &format!("10.89.{rail}.1/24"), "dev", &ea])?;
            sh(&["ip", "-n", &hosts.b, "addr", "add", &format!("10.89.{rail}.2/24"), "dev", &eb])?;
        }
        hosts.up(2)?;
        hosts.up(1)?;
        Ok(hosts)
    }

    fn up(&self, rail: u32) -> Result<()> {
        sh(&["ip", "-n", &self.a, "link", "set", &format!("r{rail}a"), "up"])?;
        sh(&["ip", "-n", &self.b, "link", "set", &format!("r{rail}b"), "up"])
    }

    /// `rate`: a tc rate, or `None` for the veth's own speed.
    fn shape(&self, rail: u32, rate: Option<&str>) -> Result<()> {
        for (ns, dev) in [(&self.a, format!("r{rail}a")), (&self.b, format!("r{rail}b"))] {
            let _ = sh(&["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", &dev, "root"]);
            if let Some(rate) = rate {
                sh(&[
                    "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", &dev, "root", "tbf", "rate", rate, "burst",
                    "256kb", "latency", "50ms",
                ])?;
            }
        }
        Ok(())
    }
}

/// What rank 0 reports about one run.
struct Run {
    secs: f64,
    stats: String,
}

/// Runs one job: rails on or off; with `cut = Some(n)`, veth pair `n` goes down 200 ms into the
/// transfer (1: rail 0, 2: rail 1).
fn job(h: &Hosts, o: &Options, rails: bool, cut: Option<u32>, port: u16) -> Result<Run> {
    let store = if cut == Some(1) { 2 } else { 1 };
    let exe = std::env::current_exe()?;
    let token: String = (0..32u8).map(|i| format!("{:02x}", (port as u8).wrapping_add(i.wrapping_mul(13)))).collect();
    let mut children = Vec::new();
    for (rank, ns, host) in [(0, &h.a, 1), (1, &h.b, 2)] {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", ns]).arg(&exe).arg(RANK_COMMAND);
        c.args(["--size", &o.size.to_string(), "--reps", &o.reps.to_string()]);
        c.env("FERROCOMM_RANK", rank.to_string())
            .env("FERROCOMM_SIZE", "2")
            .env("FERROCOMM_COORD", format!("10.89.{store}.1:{port}"))
            .env("FERROCOMM_TOKEN", &token)
            .env("FERROCOMM_HOST_STORE", if rank == 0 { "1" } else { "0" })
            .env("FERROCOMM_BIND", format!("10.89.1.{host}"))
            .env("FERROCOMM_RAILS", if rails { format!("10.89.1.{host},10.89.2.{host}") } else { "off".into() })
            .env("FERROCOMM_RAIL_STALL_MS", "300")
            .env("FERROCOMM_TRANSPORTS", "tcp")
            .env_remove("FERROCOMM_LAUNCHER");
        c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
        children.push(c.spawn()?);
    }
    let out0 = children[0].stdout.take().expect("piped");
    let ns_a = h.a.clone();
    let reader = std::thread::spawn(move || -> std::result::Result<String, String> {
        let mut text = String::new();
        for line in BufReader::new(out0).lines().map_while(std::result::Result::ok) {
            if let Some(n) = cut.filter(|_| line.starts_with("START")) {
                std::thread::sleep(Duration::from_millis(200));
                sh(&["ip", "-n", &ns_a, "link", "set", &format!("r{n}a"), "down"]).map_err(|e| e.to_string())?;
            }
            text += &line;
            text.push('\n');
        }
        Ok(text)
    });
    let deadline = Instant::now() + Duration::from_secs(300);
    for (rank, c) in children.iter_mut().enumerate() {
        let status = crate::process::wait_until(c, deadline)?;
        if !status.success() {
            let mut err = String::new();
            if let Some(mut e) = c.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            return Err(format!("rank {rank} failed ({status}):\n{err}").into());
        }
    }
    let text = reader.join().map_err(|_| "reader panicked")??;
    if let Some(n) = cut {
        h.up(n)?;
    }
    let line = text.lines().find(|l| l.starts_with("RESULT")).ok_or_else(|| format!("no result in:\n{text}"))?;
    let secs = line.split_whitespace().find_map(|w| w.strip_prefix("secs=")).ok_or("no secs=")?.parse()?;
    let stats = line.split_once("rails:").map_or(String::new(), |(_, s)| s.trim().to_string());
    Ok(Run { secs, stats })
}

/// Three hosts for the proxy scenarios: A and C joined by a direct veth pair (10.89.13.0/24,
/// rate-limited), and each joined to B (10.89.11.0/24, 10.89.12.0/24) at `--fast`; B does not
/// forward. Rank 0 runs on B (it hosts the store), 1 on A, 2 on C.
struct Triangle {
    names: [String; 3],
}

impl Drop for Triangle {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = sh(&["ip", "netns", "del", n]);
        }
    }
}

impl Triangle {
    fn new(fast: &str) -> Result<Triangle> {
        let p = format!("fcbp{}", std::process::id() % 100_000);
        let t = Triangle { names: [format!("{p}A"), format!("{p}B"), format!("{p}C")] };
        for n in &t.names {
            let _ = sh(&["ip", "netns", "del", n]);
            sh(&["ip", "netns", "add", n])?;
            sh(&["ip", "-n", n, "link", "set", "lo", "up"])?;
        }
        let [a, b, c] = &t.names;
        for (x, dx, y, dy) in [(a, "ab", b, "ba"), (c, "cb", b, "bc"), (a, "ac", c, "ca")] {
            sh(&["ip", "-n", x, "link", "add", dx, "type", "veth", "peer", "name", dy, "netns", y])?;
        }
        for (ns, dev, addr) in [
            (a, "ab", "10.89.11.1/24"),
            (b, "ba", "10.89.11.2/24"),
            (b, "bc", "10.89.12.2/24"),
            (c, "cb", "10.89.12.3/24"),
            (a, "ac", "10.89.13.1/24"),
            (c, "ca", "10.89.13.3/24"),
        ] {
            sh(&["ip", "-n", ns, "addr", "add", addr, "dev", dev])?;
            sh(&["ip", "-n", ns, "link", "set", dev, "up"])?;
        }
        // C reaches the store (B's 10.89.11.2) through B; B reaches rank 1's address on A.
        sh(&["ip", "-n", c, "route", "add", "10.89.11.0/24", "via", "10.89.12.2"])?;
        sh(&["ip", "-n", b, "route", "add", "10.89.13.1/32", "via", "10.89.11.1"])?;
        sh(&["ip", "netns", "exec", b, "sysctl", "-qw", "net.ipv4.ip_forward=0"])?;
        for (ns, dev) in [(a, "ab"), (b, "ba"), (b, "bc"), (c, "cb")] {
            shape_dev(ns, dev, Some(fast))?;
        }
        Ok(t)
    }

    fn direct(&self, rate: Option<&str>) -> Result<()> {
        shape_dev(&self.names[0], "ac", rate)?;
        shape_dev(&self.names[2], "ca", rate)
    }

    /// Runs a job of three ranks with `env` added; returns each rank's output.
    fn job(&self, args: &[String], env: &[(&str, String)], port: u16) -> Result<Vec<String>> {
        let exe = std::env::current_exe()?;
        let token: String =
            (0..32u8).map(|i| format!("{:02x}", (port as u8).wrapping_add(i.wrapping_mul(11)))).collect();
        let mut children = Vec::new();
        for (rank, ns, bind) in
            [(0, &self.names[1], "0.0.0.0"), (1, &self.names[0], "10.89.13.1"), (2, &self.names[2], "10.89.12.3")]
        {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", ns]).arg(&exe).arg(RANK_COMMAND).args(args);
            c.env("FERROCOMM_RANK", rank.to_string())
                .env("FERROCOMM_SIZE", "3")
                .env("FERROCOMM_COORD", format!("10.89.11.2:{port}"))
                .env("FERROCOMM_TOKEN", &token)
                .env("FERROCOMM_HOST_STORE", if rank == 0 { "1" } else { "0" })
                .env("FERROCOMM_BIND", bind)
                .env("FERROCOMM_TRANSPORTS", "tcp")
                .env_remove("FERROCOMM_LAUNCHER");
            for (k, v) in env {
                c.env(k, v);
            }
            c.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
            children.push(c.spawn()?);
        }
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut outs = Vec::new();
        for (rank, mut c) in children.into_iter().enumerate() {
            crate::process::wait_until(&mut c, deadline)?;
            let out = c.wait_with_output()?;
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            if !out.status.success() {
                return Err(format!(
                    "rank {rank} failed ({}):\n{text}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                )
                .into());
            }
            outs.push(text);
        }
        Ok(outs)
    }
}

fn shape_dev(ns: &str, dev: &str, rate: Option<&str>) -> Result<()> {
    let _ = sh(&["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"]);
    if let Some(rate) = rate {
        sh(&[
            "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
            "latency", "50ms",
        ])?;
    }
    Ok(())
}

/// Measures every direct hop and writes the calibration file; returns its text.
fn calibrate(t: &Triangle, path: &std::path::Path, port: u16) -> Result<String> {
    let args: Vec<String> =
        ["--mode", "calibrate", "--size", "1", "--reps", "1"].iter().map(|s| s.to_string()).collect();
    // No probe: every hop is measured over its direct connection.
    let env = [
        ("FERROCOMM_PROXY", "on".to_string()),
        ("FERROCOMM_DIRECT_TIMEOUT_MS", DIRECT_TIMEOUT_MS.into()),
        ("FERROCOMM_ROUTE_PROBE_BYTES", "0".into()),
    ];
    let outs = t.job(&args, &env, port)?;
    let mut text = String::from("# from to latency_us bandwidth_MBps (measured by ferrocomm-bench rails)\n");
    for line in outs.iter().flat_map(|o| o.lines()).filter_map(|l| l.strip_prefix("HOP ")) {
        text += line;
        text.push('\n');
    }
    std::fs::write(path, &text)?;
    Ok(text)
}

/// Rank 1 streams `--reps` messages of `--route-size` to rank 2: (MB/s, the route it took).
fn route_run(t: &Triangle, o: &Options, env: &[(&str, String)], port: u16) -> Result<(f64, String)> {
    let args: Vec<String> = [
        "--mode",
        "stream",
        "--from",
        "1",
        "--to",
        "2",
        "--size",
        &o.route_size.to_string(),
        "--reps",
        &o.reps.to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let outs = t.job(&args, env, port)?;
    let line =
        outs[1].lines().find(|l| l.starts_with("RESULT")).ok_or_else(|| format!("no result in:\n{}", outs[1]))?;
    let secs: f64 = line.split_whitespace().find_map(|w| w.strip_prefix("secs=")).ok_or("no secs=")?.parse()?;
    let route = line.split_whitespace().find_map(|w| w.strip_prefix("route=")).unwrap_or("?").to_string();
    Ok(((o.route_size * o.reps) as f64 / secs / 1e6, route))
}

/// Every pair of the triangle connects directly: the timeout for a missing path never runs out,
/// and a long one keeps a loaded machine from taking a slow connect for a missing path.
const DIRECT_TIMEOUT_MS: &str = "10000";

/// The proxy scenarios: rank 1 (A) streams to rank 2 (C) with proxies off (the direct link),
/// then with proxies on and the costs from the start-up probe, then from the calibration file.
fn proxy_scenarios(o: &Options, port: &mut u16) -> Result<()> {
    let t = Triangle::new(&o.fast)?;
    let path = o.costs.clone().unwrap_or_else(|| std::env::temp_dir().join("ferrocomm-route-costs.txt"));
    let proxy_env = |costs: bool| {
        let mut e =
            vec![("FERROCOMM_PROXY", "on".to_string()), ("FERROCOMM_DIRECT_TIMEOUT_MS", DIRECT_TIMEOUT_MS.to_string())];
        if costs {
            e.push(("FERROCOMM_ROUTE_COSTS", path.display().to_string()));
        }
        e
    };
    let mut next = || {
        *port += 1;
        *port
    };
    let median_run = |env: &[(&str, String)], next: &mut dyn FnMut() -> u16| -> Result<(f64, String)> {
        let mut runs = Vec::new();
        for _ in 0..o.runs {
            runs.push(route_run(&t, o, env, next())?);
        }
        runs.sort_by(|a, b| a.0.total_cmp(&b.0));
        Ok(runs[runs.len() / 2].clone())
    };
    t.direct(Some(&o.slow_direct))?;
    let costs = calibrate(&t, &path, next())?;
    println!(
        "proxy routes: A - B - C at {}, direct A - C at {}; calibration ({}):",
        o.fast,
        o.slow_direct,
        path.display()
    );
    print!("{costs}");
    let (direct, droute) = median_run(&[], &mut next)?;
    for (costs, from) in [(false, "probe"), (true, "file")] {
        let (staged, sroute) = median_run(&proxy_env(costs), &mut next)?;
        let r = staged / direct;
        let verdict = if r >= 1.5 { "meets" } else { "MISSES" };
        println!(
            "{:<44} direct {:>8.1} ({droute})  chosen {:>8.1} ({sroute})  {r:>5.2}x ({verdict} 1.5x)",
            format!("{} B, slow direct link, costs: {from}", o.route_size),
            direct,
            staged
        );
    }
    t.direct(None)?;
    let costs = calibrate(&t, &path, next())?;
    print!("healthy direct link, recalibrated:\n{costs}");
    let (direct, droute) = median_run(&[], &mut next)?;
    for (costs, from) in [(false, "probe"), (true, "file")] {
        let (chosen, croute) = median_run(&proxy_env(costs), &mut next)?;
        let verdict = if croute == "Direct" { "direct chosen" } else { "PROXY CHOSEN" };
        println!(
            "{:<44} direct {:>8.1} ({droute})  chosen {:>8.1} ({croute})  {:>5.2}x, {verdict}",
            format!("{} B, healthy direct link, costs: {from}", o.route_size),
            direct,
            chosen,
            chosen / direct
        );
    }
    Ok(())
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub(crate) fn main(o: Options) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("the rails benchmark needs root (network namespaces, tc)".into());
    }
    let mut port = 29800u16;
    if o.proxy_only {
        return proxy_scenarios(&o, &mut port);
    }
    let h = Hosts::new()?;
    let bytes = (o.size * o.reps) as f64;
    let mut measure = |rails: bool, cut: Option<u32>| -> Result<(f64, String)> {
        let mut bw = Vec::new();
        let mut stats = String::new();
        for _ in 0..o.runs {
            port += 1;
            let r = job(&h, &o, rails, cut, port)?;
            bw.push(bytes / r.secs / 1e6);
            stats = r.stats;
        }
        Ok((median(bw), stats))
    };
    println!("ferrocomm-bench rails: {} x {} B per run, {} runs, median MB/s", o.reps, o.size, o.runs);
    let ratio = |name: &str, goal: f64, one: (f64, String), two: (f64, String)| {
        let r = two.0 / one.0;
        let verdict = if r >= goal { "meets" } else { "MISSES" };
        println!("{name:<34} one rail {:>8.1}  striped {:>8.1}  {r:>5.2}x ({verdict} {goal}x)", one.0, two.0);
        println!("{:<34} rails: {}", "", two.1);
    };
    h.shape(1, Some(&o.fast))?;
    h.shape(2, Some(&o.slow))?;
    let (one, two) = (measure(false, None)?, measure(true, None)?);
    ratio(&format!("unequal ({} + {})", o.fast, o.slow), 1.15, one, two);
    h.shape(2, Some(&o.fast))?;
    let (one, two) = (measure(false, None)?, measure(true, None)?);
    ratio(&format!("equal ({} + {})", o.fast, o.fast), 1.7, one, two);
    for (rail, veth) in [(1, 2), (0, 1)] {
        let cut = measure(true, Some(veth))?;
        println!(
            "{:<34} striped, veth {veth} down 200 ms in: {:>8.1} MB/s, every message whole; rails: {}",
            format!("rail {rail} killed mid-transfer"),
            cut.0,
            cut.1
        );
    }
    h.shape(1, None)?;
    h.shape(2, None)?;
    let (one, two) = (measure(false, None)?, measure(true, None)?);
    ratio("equal, unshaped veth", 1.7, one, two);
    drop(h);
    proxy_scenarios(&o, &mut port)
}

/// A rank of one job. `stream`: rank `from` sends, rank `to` checks every message and answers
/// the last. `calibrate`: each directly connected pair in turn measures its latency (8 B round
/// trips) and bandwidth (4 MiB messages), and the lower rank prints `HOP a b LATENCY_US MBPS`.
pub(crate) fn rank_main(s: RankSpec) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    rt.block_on(async {
        let w = ferrocomm::init().await?;
        if s.mode == "calibrate" {
            measure_hops(&w).await?;
            w.finalize().await?;
            return Ok(());
        }
        let c = w.comm();
        let data: Bytes = (0..s.size).map(|i| (i as u32).wrapping_mul(2_654_435_761) as u8 ^ (i >> 12) as u8).collect();
        c.barrier().await?;
        if w.rank() == s.from {
            println!("START");
            let t0 = Instant::now();
            for i in 0..s.reps {
                c.send(s.to, i as u64, data.clone()).await?;
            }
            c.recv(s.to, 999u64).await?;
            let secs = t0.elapsed().as_secs_f64();
            let rails: Vec<String> = w
                .rail_stats(s.to)
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    r.map(|r| {
                        format!(
                            "rail{i} up={} carried={}MB est={:.0}MB/s{}",
                            r.up,
                            r.carried >> 20,
                            r.bandwidth / 1e6,
                            if r.control { " (control)" } else { "" }
                        )
                    })
                })
                .collect();
            println!("RESULT secs={secs} route={:?} rails: {}", w.route_for(s.to, s.size), rails.join(", "));
        } else if w.rank() == s.to {
            for i in 0..s.reps {
                let m = c.recv(s.from, i as u64).await?;
                if m.data != data {
                    return Err(format!("message {i} arrived altered").into());
                }
            }
            c.send(s.from, 999, Bytes::from_static(b"k")).await?;
        }
        c.barrier().await?;
        w.finalize().await?;
        Ok::<_, Box<dyn std::error::Error>>(())
    })
}

async fn measure_hops(w: &ferrocomm::World) -> Result<()> {
    let c = w.comm();
    let (me, n) = (w.rank(), w.size());
    let big: Bytes = vec![7u8; 4 << 20].into();
    for a in 0..n {
        for b in a + 1..n {
            c.barrier().await?;
            let peer = if me == a {
                b
            } else if me == b {
                a
            } else {
                continue;
            };
            if w.route_for(peer, 1) != ferrocomm::transports::relay::Route::Direct {
                continue;
            }
            const ROUND_TRIPS: u32 = 200;
            const MESSAGES: u64 = 4;
            let t0 = Instant::now();
            for i in 0..ROUND_TRIPS {
                if me == a {
                    c.send(peer, u64::from(i), Bytes::from_static(b"12345678")).await?;
                    c.recv(peer, u64::from(i)).await?;
                } else {
                    let m = c.recv(peer, u64::from(i)).await?;
                    c.send(peer, u64::from(i), m.data).await?;
                }
            }
            let latency = t0.elapsed().as_secs_f64() / f64::from(ROUND_TRIPS) / 2.0;
            let t0 = Instant::now();
            for i in 0..MESSAGES {
                if me == a {
                    c.send(peer, 1000 + i, big.clone()).await?;
                } else {
                    c.recv(peer, 1000 + i).await?;
                }
            }
            if me == a {
                c.recv(peer, 2000u64).await?;
                let secs = t0.elapsed().as_secs_f64();
                let mbps = (MESSAGES as f64 * big.len() as f64) / secs / 1e6;
                println!("HOP {a} {b} {:.1} {mbps:.1}", latency * 1e6);
            } else {
                c.send(peer, 2000, Bytes::from_static(b"k")).await?;
            }
        }
    }
    c.barrier().await?;
    Ok(())
}
