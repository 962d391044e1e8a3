//! `rma`: one-sided communication, ferrocomm against `ucx_perftest` (UCX's UCP put/get/atomics,
//! Debian `ucx-utils`) over shared memory, on the same two pinned CPUs, in one invocation.
//!
//! * **Put latency, 8 B**: `ucp_put_lat`'s method: each side puts a counter into the other's
//!   memory and spins on its own until the peer's put has landed; the one-way time is half the
//!   round trip.
//! * **Get latency, 8 B**: a loop of gets, each awaited (`ucp_get`: a stream of gets).
//! * Latencies are medians of samples of 64 operations (`ucx_perftest` reports the median of its
//!   per-iteration times; on a shared machine the mean is dominated by preempted iterations); the
//!   means are in the JSON. Over an RDMA device (`rma-verbs`) each operation is timed, as
//!   perftest times them.
//! * **Put and get bandwidth, 64 KiB and 4 MiB**: a loop of transfers into (from) one remote
//!   buffer, then a fence (`ucp_put_bw`, `ucp_get`), after a warm-up of a tenth of the loop (at
//!   most 10,000), as `ucx_perftest`'s; MB/s is 10^6 bytes per second on both sides
//!   (`ucx_perftest` prints MiB/s, converted). Two figures each: over the whole loop
//!   (`ucx_perftest`'s "overall"), and the size over the median time of one transfer
//!   (`ucx_perftest`'s 50th percentile): on a shared machine the first measures mostly how much
//!   CPU the run got, the second the transfer itself.
//! * **Fetch-add**: one initiator's rate against `ucp_fadd`; then AOS's experiment, every rank of
//!   `--atomic-ranks` hitting one word of rank 0 (centralized) against each rank targeting another
//!   rank's word at each step (spread), aggregate operations per second.
//!
//! Each side runs `--runs` times, alternately; the report gives medians. UCX runs a server and a
//! client process pinned to the two CPUs (`taskset`) with `UCX_TLS=posix,cma`; ferrocomm runs a
//! job of two ranks pinned the same way, busy-polling, its segments mapped by the peer. With
//! `--transports tcp` the ferrocomm side uses TCP (requests served by the target's progress) for
//! an idea of the emulated path (UCX still over shared memory).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use ferrocomm::{Access, SegmentId, World};
use ferrorun::{LaunchOptions, run_local};
use serde_json::{Value, json};

use crate::{Result, affinity, cli, process, sweep};

pub(crate) const JOB_COMMAND: &str = "rma-job";
pub(crate) const RANK_COMMAND: &str = "rma-rank";

const LAT_ITERS: u64 = 200_000;
/// How often an idle target looks whether the initiator is done ([`idle_until_done`]).
const IDLE_LOOK: Duration = Duration::from_millis(20);
const BW_BYTES: usize = 1 << 30;
const ATOMIC_ITERS: u64 = 200_000;
const SIZES: [usize; 2] = [64 << 10, 4 << 20];
/// Operations per timed sample of the latency tests.
const BATCH: u64 = 64;
const PAGE: usize = 4096;
/// Looks at its word between two yields of a device ping-pong's spin ([`spin_until`]).
const YIELD_EVERY: u32 = 64;
/// The word of rank 1's segment where rank 0 marks the end of its tests over the device.
const DONE: usize = 24;

/// One-sided put/get latency and bandwidth and fetch-add vs ucx_perftest over shared memory;
/// fetch-add to one target vs spread.
///
/// ferrocomm one-sided operations against ucx_perftest (UCP, UCX_TLS=posix,cma) over shared
/// memory: put and get latency at 8 B, put and get bandwidth at 64 KiB and 4 MiB, fetch-add
/// rate; and fetch-add from every rank to one target against spread across targets.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct Options {
    /// The two CPUs
    #[arg(long, value_name = "A,B", default_value = "0,1", value_parser = cli::cpu_pair)]
    cpus: [usize; 2],
    /// Runs of each side, alternated; medians reported
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = cli::at_least_one)]
    runs: usize,
    /// Ranks of the centralized/spread fetch-add experiment
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u32).range(2..))]
    atomic_ranks: u32,
    /// ferrocomm side: auto (shared memory) or tcp (`rma-verbs` runs it over verbs)
    #[arg(long, default_value = "auto", value_parser = ["auto", "tcp"])]
    transports: String,
    /// ferrocomm alone
    #[arg(long)]
    no_peer: bool,
    /// Write the results as JSON
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
}

/// The arguments of the hidden job and rank commands: `KIND RANKS CPUS TRANSPORTS`.
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct JobSpec {
    /// `pair`, `atomics`, or one latency test over the device: `put-lat`, `get-lat`, `fadd-lat`.
    #[arg(value_parser = ["pair", "atomics", "put-lat", "get-lat", "fadd-lat"])]
    kind: String,
    ranks: u32,
    #[arg(value_parser = cli::cpu_pair)]
    cpus: [usize; 2],
    transports: String,
}

impl JobSpec {
    fn to_args(&self) -> Vec<String> {
        vec![
            self.kind.clone(),
            self.ranks.to_string(),
            format!("{},{}", self.cpus[0], self.cpus[1]),
            self.transports.clone(),
        ]
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// One ferrocomm job: `kind` is `pair` (latency, bandwidth, one initiator's fetch-add),
/// `atomics` (centralized against spread), or one device latency test ([`device_lat`]); returns
/// rank 0's JSON line.
fn ferrocomm_job(o: &Options, kind: &str, ranks: u32) -> Result<Value> {
    pair_job(kind, ranks, o.cpus, &o.transports)
}

/// One ferrocomm job of `ranks` ranks pinned to `cpus`, over `transports` (`auto`, `tcp`,
/// `verbs`); returns rank 0's JSON line.
pub(crate) fn pair_job(kind: &str, ranks: u32, cpus: [usize; 2], transports: &str) -> Result<Value> {
    let exe = std::env::current_exe()?;
    let spec = JobSpec { kind: kind.into(), ranks, cpus, transports: transports.into() };
    let mut cmd = Command::new(&exe);
    cmd.arg(JOB_COMMAND).args(spec.to_args()).stderr(Stdio::inherit());
    let (status, lines) = process::run_lines(cmd, Duration::from_secs(600))?;
    let mut result = None;
    for line in lines {
        match line.strip_prefix("[0] ").and_then(|l| serde_json::from_str::<Value>(l).ok()) {
            Some(v) if result.is_none() => result = Some(v),
            _ => eprintln!("  {line}"),
        }
    }
    if !status.success() {
        return Err(format!("the {kind} job failed ({status})").into());
    }
    result.ok_or_else(|| format!("the {kind} job printed no result").into())
}

/// `rma-job KIND RANKS CPUS TRANSPORTS`: launches the ranks.
pub(crate) fn job_main(spec: JobSpec) -> Result<()> {
    let exe = std::env::current_exe()?;
    let rank_args: Vec<OsString> =
        std::iter::once(RANK_COMMAND.to_string()).chain(spec.to_args()).map(OsString::from).collect();
    let opts = LaunchOptions {
        env: vec![("FERROCOMM_PROGRESS".into(), "busy".into()), ("FERROCOMM_TRANSPORTS".into(), spec.transports)],
        ..LaunchOptions::default()
    };
    match run_local(spec.ranks, &exe, &rank_args, &opts)? {
        0 => Ok(()),
        code => Err(format!("the ranks failed (job exit code {code})").into()),
    }
}

/// `rma-rank`: one rank; rank 0 prints the results as one JSON line.
pub(crate) fn rank_main(spec: JobSpec) -> Result<()> {
    let JobSpec { kind, cpus, .. } = spec;
    let rank: usize = std::env::var("FERROCOMM_RANK")?.parse()?;
    affinity::pin_current_thread(cpus[rank % 2])?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let w = ferrocomm::init().await?;
        let out = match kind.as_str() {
            "pair" => pair(&w).await?,
            "atomics" => atomics(&w).await?,
            "put-lat" | "get-lat" | "fadd-lat" => device_lat(&w, &kind).await?,
            other => return Err(format!("unknown job {other}").into()),
        };
        if w.rank() == 0 {
            println!("{out}");
        }
        w.finalize().await?;
        Ok(())
    })
}

/// Publishes a segment of `len` bytes at every rank and attaches to all of them.
async fn segments(w: &World, len: usize) -> Result<(ferrocomm::Segment, Vec<ferrocomm::RemoteSegment>)> {
    let seg = w.publish(len, Access::WINDOW)?;
    let ids = w.allgather(&[seg.id().to_u64()]).await?;
    let mut remotes = Vec::new();
    for id in ids {
        remotes.push(w.attach(SegmentId::from_u64(id)).await?);
    }
    Ok((seg, remotes))
}

async fn pair(w: &World) -> Result<Value> {
    let me = w.rank() as usize;
    let peer = 1 - me;
    let (seg, remotes) = segments(w, (4 << 20) + PAGE).await?;
    let remote = &remotes[peer];
    let word = seg.word(0)?;
    // Requests (TCP) need the notification to learn that a put landed; a mapping or the RDMA
    // device writes straight into the peer's memory, which spins on its word (`ib_write_lat`'s
    // method too).
    let device = remote.is_device();
    let tcp = !remote.is_mapped() && !device;
    let lat_iters = if tcp || device { LAT_ITERS / 100 } else { LAT_ITERS };
    // Put latency: ping-pong through each other's memory. Over a mapping each side spins on its
    // own word, as `ucp_put_lat` does; over requests the puts carry a notification that each side
    // awaits (its wait runs the progress that applies the peer's put: a busy-polling rank's own
    // calls serve requests, its progress thread stays aside while they spin). Over the device,
    // `ib_write_lat`'s loop ([`device_put_lat`]).
    w.barrier().await?;
    let mut device_put = json!({});
    let (put_med, put_mean) = if device {
        for (name, yielding) in [("spin", false), ("yield", true)] {
            device_put[name] = device_put_lat(w, remote, word, lat_iters, yielding).await?;
            w.barrier().await?;
        }
        (
            device_put["spin"]["lat_us"].as_f64().unwrap_or(f64::NAN) * 1e-6,
            device_put["spin"]["mean_us"].as_f64().unwrap_or(f64::NAN) * 1e-6,
        )
    } else {
        // Samples of BATCH round trips; the report takes their median, as `ucx_perftest` takes
        // the median of its per-iteration times (on a shared machine a preempted batch is an
        // outlier).
        let mut samples = Vec::new();
        let mut i = 0u64;
        let t_all = Instant::now();
        while i < lat_iters {
            let t0 = Instant::now();
            for _ in 0..BATCH {
                i += 1;
                if me == 0 {
                    if tcp {
                        w.put_notify(remote, 0, &i.to_le_bytes()).await?;
                    } else {
                        w.put(remote, 0, &i.to_le_bytes()).await?;
                    }
                }
                if tcp {
                    seg.wait_notifications(i).await?;
                } else {
                    spin_until(word, i, false);
                }
                if me == 1 {
                    if tcp {
                        w.put_notify(remote, 0, &i.to_le_bytes()).await?;
                    } else {
                        w.put(remote, 0, &i.to_le_bytes()).await?;
                    }
                }
            }
            samples.push(t0.elapsed().as_secs_f64() / BATCH as f64 / 2.0);
        }
        (median(samples), t_all.elapsed().as_secs_f64() / i as f64 / 2.0)
    };
    w.barrier().await?;
    // Over the device, rank 1 idles through rank 0's one-sided tests, as perftest's server does:
    // Soft-RoCE answers reads and atomics with kernel work on these CPUs, which a rank spinning
    // in a barrier competes with. Rank 0 ends the wait with a put into its word at DONE.
    if device && me == 1 {
        idle_until_done(&seg).await?;
    }
    let mut out = json!({"mapped": remote.is_mapped(), "device": device, "transport": w.transport_for(peer as u32),
                         "put_lat_us": put_med * 1e6, "put_lat_mean_us": put_mean * 1e6});
    if device {
        out["put"] = device_put;
    }
    if me == 0 {
        let (med, mean) = timed(lat_iters, device, || async {
            let mut b = [0u8; 8];
            w.get(remote, 8, &mut b).await?;
            Ok(())
        })
        .await?;
        out["get_lat_us"] = json!(med * 1e6);
        out["get_lat_mean_us"] = json!(mean * 1e6);
        // Page-aligned buffers on both sides, as ucx_perftest's.
        let mut src_buf = vec![7u8; (4 << 20) + PAGE];
        let mut dst_buf = vec![1u8; (4 << 20) + PAGE];
        let src = aligned(&mut src_buf);
        let dst = aligned(&mut dst_buf);
        for size in SIZES {
            let n = (BW_BYTES / size / if tcp || device { 16 } else { 1 }).max(4);
            // Warm-up as `ucx_perftest`'s (`ucx_perf_set_warmup`: a tenth of the iterations
            // rounded up, at most 10,000), so that both timed loops start with warm caches.
            let warm = n.div_ceil(10).min(10_000);
            let mut times = Vec::with_capacity(warm + n);
            let mut t0 = Instant::now();
            for i in 0..warm + n {
                if i == warm {
                    w.fence(remote).await?;
                    // The first put, into pages (mostly) not written before: what publishing and
                    // attaching prefault.
                    out[format!("put_first_{size}_us")] = json!(times[0] * 1e6);
                    times.clear();
                    t0 = Instant::now();
                }
                let t = Instant::now();
                w.put(remote, PAGE, &src[..size]).await?;
                times.push(t.elapsed().as_secs_f64());
            }
            w.fence(remote).await?;
            bw_entries(&mut out, "put", size, t0.elapsed().as_secs_f64(), &times);
            times.clear();
            for i in 0..warm + n {
                if i == warm {
                    times.clear();
                    t0 = Instant::now();
                }
                let t = Instant::now();
                w.get(remote, PAGE, &mut dst[..size]).await?;
                times.push(t.elapsed().as_secs_f64());
            }
            bw_entries(&mut out, "get", size, t0.elapsed().as_secs_f64(), &times);
        }
        let iters = if tcp || device { ATOMIC_ITERS / 100 } else { ATOMIC_ITERS };
        let (med, mean) = timed(iters, device, || async {
            w.fetch_add(remote, 16, 1).await?;
            Ok(())
        })
        .await?;
        out["fadd_lat_us"] = json!(med * 1e6);
        out["fadd_lat_mean_us"] = json!(mean * 1e6);
        if device {
            w.put(remote, DONE, &1u64.to_le_bytes()).await?;
        }
    }
    w.barrier().await?;
    seg.unpublish().await?;
    Ok(out)
}

/// The target's part of a device test: it sleeps until the initiator's put marks [`DONE`] in its
/// segment, as perftest's server idles (Soft-RoCE answers reads and atomics with kernel work on
/// these CPUs, which a rank spinning in a barrier competes with).
///
/// It looks every [`IDLE_LOOK`]: each look is a timer interrupt, a wakeup and a few clock reads
/// on the target's CPU, which under software emulation (HPET as the clock, every read a system
/// call and an emulated device access) are tens of microseconds each; looking every millisecond
/// kept the VM's second CPU busy through the whole loop, where perftest's server sleeps in a
/// socket read.
async fn idle_until_done(seg: &ferrocomm::Segment) -> Result<()> {
    let done = seg.word(DONE)?;
    while done.load(Ordering::Acquire) == 0 {
        tokio::time::sleep(IDLE_LOOK).await;
    }
    Ok(())
}

/// One 8 B latency test over the device, for `rma-verbs`, which runs each test and its perftest
/// counterpart back to back: `put-lat` ([`device_put_lat`], `ib_write_lat`'s loop), `get-lat`
/// (awaited gets, `ib_read_lat`) or `fadd-lat` (awaited fetch-adds, `ib_atomic_lat`), each
/// operation timed ([`timed_each`]) while the target idles.
async fn device_lat(w: &World, kind: &str) -> Result<Value> {
    let me = w.rank() as usize;
    let peer = 1 - me;
    let (seg, remotes) = segments(w, PAGE).await?;
    let remote = &remotes[peer];
    if !remote.is_device() {
        return Err(format!("rank {peer}'s segment is not reached over the device").into());
    }
    let iters = LAT_ITERS / 100;
    let mut out = json!({"transport": w.transport_for(peer as u32), "test": kind});
    w.barrier().await?;
    match kind {
        "put-lat" => {
            let word = seg.word(0)?;
            for (name, yielding) in [("spin", false), ("yield", true)] {
                out[name] = device_put_lat(w, remote, word, iters, yielding).await?;
                w.barrier().await?;
            }
            out["lat_us"] = out["spin"]["lat_us"].clone();
        }
        _ if me == 1 => idle_until_done(&seg).await?,
        "get-lat" => {
            out = timed_each(iters, out, || async {
                let mut b = [0u8; 8];
                let op = w.get(remote, 8, &mut b);
                let (now, called) = (op.is_complete(), sweep::stamp());
                op.await?;
                Ok((now, called))
            })
            .await?;
        }
        _ => {
            out = timed_each(iters, out, || async {
                let op = w.fetch_add(remote, 16, 1);
                let (now, called) = (op.is_complete(), sweep::stamp());
                op.await?;
                Ok((now, called))
            })
            .await?;
        }
    }
    if me == 0 && kind != "put-lat" {
        w.put(remote, DONE, &1u64.to_le_bytes()).await?;
    }
    w.barrier().await?;
    seg.unpublish().await?;
    Ok(out)
}

/// Runs `op` `iters` times, stamping each start with the cycle counter as `ib_read_lat` and
/// `ib_atomic_lat` do; `op` returns whether the operation was complete when its call returned
/// and the stamp taken then. Adds to `out`: the median (`lat_us`, perftest's `t_typical`), mean,
/// 10th and 90th percentiles and minimum of the operations' times, the median time of the call
/// alone (`call_us`) and the share of operations complete in their call.
async fn timed_each<F, Fut>(iters: u64, mut out: Value, mut op: F) -> Result<Value>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(bool, u64)>>,
{
    let mut stamps = Vec::with_capacity(iters as usize + 1);
    let mut calls = Vec::with_capacity(iters as usize);
    let mut in_call = 0u64;
    let t_all = Instant::now();
    for _ in 0..iters {
        let s = sweep::stamp();
        stamps.push(s);
        let (now, called) = op().await?;
        in_call += u64::from(now);
        calls.push(called.wrapping_sub(s));
    }
    stamps.push(sweep::stamp());
    let all = t_all.elapsed().as_secs_f64();
    let times = sweep::trips(&stamps, all);
    let span = stamps.last().zip(stamps.first()).map_or(1, |(l, f)| l.wrapping_sub(*f).max(1));
    let per_unit = all / span as f64;
    let q = sweep::quantiles(&times, &[0.0, 0.1, 0.9]).unwrap_or_default();
    let us = |i: usize| q.get(i).map_or(f64::NAN, |v| v * 1e6);
    out["lat_us"] = json!(median(times) * 1e6);
    out["mean_us"] = json!(all / iters.max(1) as f64 * 1e6);
    out["min_us"] = json!(us(0));
    out["p10_us"] = json!(us(1));
    out["p90_us"] = json!(us(2));
    out["call_us"] = json!(median(calls.iter().map(|&c| c as f64 * per_unit).collect()) * 1e6);
    out["complete_in_call"] = json!(in_call as f64 / iters.max(1) as f64);
    Ok(out)
}

/// Spins until `word` holds `v`; `yielding`, it gives its CPU away every [`YIELD_EVERY`] looks,
/// as ferrocomm's own busy waits do once they have spun a while. `ib_write_lat` never yields, and
/// on Soft-RoCE an 8 B RDMA write needs no kernel work on the target's CPU: the poster's system
/// call writes the target's memory and takes the acknowledgement (both queue pairs on one
/// device). A yield is a system call, microseconds under software emulation, and a write that
/// lands during one waits for it.
fn spin_until(word: &std::sync::atomic::AtomicU64, v: u64, yielding: bool) {
    let mut looks = 0u32;
    while word.load(Ordering::Acquire) != v {
        looks = looks.wrapping_add(1);
        if yielding && looks.is_multiple_of(YIELD_EVERY) {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
}

/// `{op}_bw_{size}`: MB/s over the whole timed loop of `times.len()` operations, `secs` with
/// its fence (`ucx_perftest`'s "overall"), and `{op}_bw_{size}_p50`: `size` over the median time
/// of one operation (`ucx_perftest`'s 50th percentile), which preemption on a shared machine does
/// not drag down. Over a device or requests an operation's own time is its posting (the fence
/// waits for the data): only the overall figure means anything there.
fn bw_entries(out: &mut Value, op: &str, size: usize, secs: f64, times: &[f64]) {
    out[format!("{op}_bw_{size}")] = json!((times.len() * size) as f64 / secs / 1e6);
    out[format!("{op}_bw_{size}_p50")] = json!(size as f64 / median(times.to_vec()) / 1e6);
}

/// The page-aligned part of `buf`.
fn aligned(buf: &mut [u8]) -> &mut [u8] {
    let skip = buf.as_ptr().align_offset(PAGE);
    &mut buf[skip..]
}

/// Runs `op` `iters` times; returns (median time per operation, mean time per operation),
/// seconds. The median is over batches of [`BATCH`] operations, or over single operations with
/// `each` (`ib_read_lat` and `ib_atomic_lat` time each operation, by the cycle counter: over a
/// device an operation takes microseconds, and the batch's mean carries its preempted ones).
async fn timed<F, Fut>(iters: u64, each: bool, mut op: F) -> Result<(f64, f64)>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    if each {
        let mut stamps = Vec::with_capacity(iters as usize + 1);
        let t_all = Instant::now();
        for _ in 0..iters {
            stamps.push(sweep::stamp());
            op().await?;
        }
        stamps.push(sweep::stamp());
        let all = t_all.elapsed().as_secs_f64();
        let times = sweep::trips(&stamps, all);
        return Ok((median(times), all / iters.max(1) as f64));
    }
    let mut samples = Vec::new();
    let mut done = 0;
    let t_all = Instant::now();
    while done < iters {
        let t0 = Instant::now();
        for _ in 0..BATCH {
            op().await?;
        }
        done += BATCH;
        samples.push(t0.elapsed().as_secs_f64() / BATCH as f64);
    }
    Ok((median(samples), t_all.elapsed().as_secs_f64() / done as f64))
}

/// Put latency over the device, `ib_write_lat`'s loop: rank 0 puts, then spins on its word until
/// rank 1's put has landed; rank 1 spins first, then puts. Each side stamps each put's start
/// (the cycle counter); one iteration is a round trip, the latency half of it (median and mean
/// over the iterations, as `ib_write_lat`'s `t_typical` and `t_avg`). `yielding`: the spin gives
/// its CPU away every [`YIELD_EVERY`] looks. Also: how many puts completed in their call (their
/// completion collected right after posting), the median time of a put's call and await, and the
/// context switches of the rank's other threads (its progress thread) over the loop.
async fn device_put_lat(
    w: &World,
    remote: &ferrocomm::RemoteSegment,
    word: &std::sync::atomic::AtomicU64,
    iters: u64,
    yielding: bool,
) -> Result<Value> {
    let me = w.rank();
    let mut stamps = Vec::with_capacity(iters as usize + 1);
    let mut calls = Vec::with_capacity(iters as usize);
    let mut in_call = 0u64;
    let base = word.load(Ordering::Acquire);
    let switches = other_threads_switches();
    let t_all = Instant::now();
    for i in base + 1..=base + iters {
        if me == 1 {
            spin_until(word, i, yielding);
        }
        let s = sweep::stamp();
        stamps.push(s);
        let op = w.put(remote, 0, &i.to_le_bytes());
        in_call += u64::from(op.is_complete());
        op.await?;
        calls.push(sweep::stamp().wrapping_sub(s));
        if me == 0 {
            spin_until(word, i, yielding);
        }
    }
    stamps.push(sweep::stamp());
    let all = t_all.elapsed().as_secs_f64();
    let switches = other_threads_switches().saturating_sub(switches);
    let trips = sweep::trips(&stamps, all);
    let span = stamps.last().zip(stamps.first()).map_or(1, |(l, f)| l.wrapping_sub(*f).max(1));
    let per_unit = all / span as f64;
    let call = median(calls.iter().map(|&c| c as f64 * per_unit).collect());
    Ok(json!({"lat_us": median(trips) / 2.0 * 1e6, "mean_us": all / iters.max(1) as f64 / 2.0 * 1e6,
              "complete_in_call": in_call as f64 / iters.max(1) as f64, "call_us": call * 1e6,
              "other_thread_switches": switches}))
}

/// Context switches (voluntary and not) of this process's threads other than the caller's.
fn other_threads_switches() -> u64 {
    let count = |status: &str| -> u64 {
        status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().last()?.parse::<u64>().ok())
            .sum()
    };
    let own = std::fs::read_to_string("/proc/thread-self/status").map_or(0, |s| count(&s));
    let all: u64 = std::fs::read_dir("/proc/self/task")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path().join("status")).ok())
        .map(|s| count(&s))
        .sum();
    all.saturating_sub(own)
}

async fn atomics(w: &World) -> Result<Value> {
    let (me, n) = (w.rank(), w.size());
    let (seg, remotes) = segments(w, 64).await?;
    let tcp = remotes.iter().any(|r| !r.is_mapped());
    let iters = if tcp { ATOMIC_ITERS / 100 } else { ATOMIC_ITERS / u64::from(n) };
    let mut out = json!({"ranks": n, "mapped": !tcp, "iters_per_rank": iters});
    for mode in ["centralized", "spread"] {
        w.barrier().await?;
        let t0 = Instant::now();
        for i in 0..iters {
            let target = if mode == "centralized" { 0 } else { (me as u64 + i) % u64::from(n) } as usize;
            w.fetch_add(&remotes[target], 0, 1).await?;
            if i % 256 == 0 {
                // More ranks than CPUs: let the others on.
                tokio::task::yield_now().await;
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let all = w.allgather(&[secs]).await?;
        let slowest = all.iter().copied().fold(0.0, f64::max);
        out[format!("{mode}_Mops")] = json!((iters * u64::from(n)) as f64 / slowest / 1e6);
    }
    w.barrier().await?;
    // Every fetch-add landed: the words sum to both modes' operations.
    let words = w.allgather(&[seg.word(0)?.load(Ordering::Acquire)]).await?;
    let sum: u64 = words.iter().sum();
    if sum != 2 * iters * u64::from(n) {
        return Err(format!("the words sum to {sum}, not {}", 2 * iters * u64::from(n)).into());
    }
    w.barrier().await?;
    seg.unpublish().await?;
    Ok(out)
}

/// `ucx_perftest` at the two CPUs: the client's final line, as (50th percentile latency us,
/// average latency us, overall bandwidth MB/s, overall message rate /s).
fn ucx(perftest: &PathBuf, cpus: [usize; 2], test: &str, size: usize, iters: u64) -> Result<[f64; 4]> {
    let port = process::free_port()?.to_string();
    let args = ["-t", test, "-s", &size.to_string(), "-n", &iters.to_string(), "-p", &port];
    let pin = |cpu: usize| {
        let mut c = Command::new("taskset");
        c.args(["-c", &cpu.to_string()]).arg(perftest).args(args).env("UCX_TLS", "posix,cma");
        c
    };
    let mut server = pin(cpus[1]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::null()).spawn()?;
    let start = Instant::now();
    let out = loop {
        std::thread::sleep(Duration::from_millis(200));
        let out = pin(cpus[0]).args(["-f", "127.0.0.1"]).stdin(Stdio::null()).output()?;
        if out.status.success() {
            break String::from_utf8_lossy(&out.stdout).into_owned();
        }
        if start.elapsed() > Duration::from_secs(10) {
            let _ = server.kill();
            let _ = server.wait();
            return Err(format!("ucx_perftest {test} failed: {}", String::from_utf8_lossy(&out.stderr)).into());
        }
    };
    process::wait_until(&mut server, Instant::now() + Duration::from_secs(60))?;
    let row: Vec<f64> = out
        .lines()
        .rev()
        .find_map(|l| {
            let v: Option<Vec<f64>> = l.split_whitespace().map(|w| w.parse().ok()).collect();
            v.filter(|v| v.len() == 8)
        })
        .ok_or_else(|| format!("no result row from ucx_perftest {test}:\n{out}"))?;
    // Columns: iterations, latency 50%/average/overall (us), bandwidth average/overall (MiB/s),
    // message rate average/overall.
    Ok([row[1], row[2], row[5] * 1.048_576, row[7]])
}

/// `rma`: runs both sides, prints the report.
pub(crate) fn main(o: Options) -> Result<()> {
    let perftest = if !o.no_peer {
        Some(
            process::find_in_path("ucx_perftest")
                .ok_or("ucx_perftest not in PATH: install it with `apt-get install ucx-utils` (or pass --no-peer)")?,
        )
    } else {
        None
    };
    let mut ours: Vec<Value> = Vec::new();
    let mut theirs: Vec<Value> = Vec::new();
    let mut spread: Vec<Value> = Vec::new();
    let bar = cli::Progress::new((o.runs * (1 + usize::from(perftest.is_some()))) as u64, "rma");
    for run in 0..o.runs {
        bar.step(format!("run {}/{}: ferrocomm", run + 1, o.runs));
        ours.push(ferrocomm_job(&o, "pair", 2)?);
        spread.push(ferrocomm_job(&o, "atomics", o.atomic_ranks)?);
        bar.inc();
        if let Some(p) = &perftest {
            bar.step(format!("run {}/{}: ucx_perftest", run + 1, o.runs));
            let put_lat = ucx(p, o.cpus, "ucp_put_lat", 8, LAT_ITERS)?;
            let get_lat = ucx(p, o.cpus, "ucp_get", 8, LAT_ITERS)?;
            let mut v = json!({"put_lat_us": put_lat[0], "put_lat_avg_us": put_lat[1], "get_lat_us": get_lat[0]});
            for size in SIZES {
                let n = (BW_BYTES / size) as u64;
                for (op, test) in [("put", "ucp_put_bw"), ("get", "ucp_get")] {
                    let r = ucx(p, o.cpus, test, size, n)?;
                    v[format!("{op}_bw_{size}")] = json!(r[2]);
                    v[format!("{op}_bw_{size}_p50")] = json!(size as f64 / r[0]);
                }
            }
            let fadd = ucx(p, o.cpus, "ucp_fadd", 8, ATOMIC_ITERS)?;
            v["fadd_lat_us"] = json!(fadd[0]);
            theirs.push(v);
            bar.inc();
        }
    }
    drop(bar);
    let med = |side: &[Value], key: &str| median(side.iter().filter_map(|v| v[key].as_f64()).collect());
    let mapped = ours[0]["mapped"].as_bool().unwrap_or(false);
    println!(
        "one-sided, 2 ranks pinned to CPUs {},{}: ferrocomm over {} ({}), {}; medians of {} runs",
        o.cpus[0],
        o.cpus[1],
        ours[0]["transport"].as_str().unwrap_or("?"),
        if mapped { "segments mapped by the peer" } else { "requests served by the target's progress" },
        if !o.no_peer { "ucx_perftest with UCX_TLS=posix,cma" } else { "no peer" },
        o.runs
    );
    println!("{:<24} {:>14} {:>14} {:>10}", "", "ferrocomm", "ucx_perftest", "ratio");
    let mut summary = serde_json::Map::new();
    let rows: Vec<(String, String, &str, bool)> =
        [("put_lat_us", "put latency 8 B", "us", true), ("get_lat_us", "get latency 8 B", "us", true)]
            .into_iter()
            .map(|(k, l, u, lat)| (k.to_string(), l.to_string(), u, lat))
            .chain(SIZES.iter().flat_map(|&s| {
                [("put", s, ""), ("get", s, ""), ("put", s, "_p50"), ("get", s, "_p50")].map(|(op, s, p50)| {
                    let label = if p50.is_empty() {
                        format!("{op} bandwidth {} KiB", s >> 10)
                    } else {
                        format!("{op} {} KiB, median op", s >> 10)
                    };
                    (format!("{op}_bw_{s}{p50}"), label, "MB/s", false)
                })
            }))
            .chain([("fadd_lat_us".to_string(), "fetch-add 8 B".to_string(), "us", true)])
            .collect();
    for (key, label, unit, lat) in rows {
        let a = med(&ours, &key);
        let b = if theirs.is_empty() { f64::NAN } else { med(&theirs, &key) };
        // Latency: ferrocomm / UCX (lower is better); bandwidth: ferrocomm / UCX (higher is better).
        let ratio = a / b;
        let fmt = |x: f64| match () {
            _ if x.is_nan() => "-".to_string(),
            _ if lat => format!("{x:.3} {unit}"),
            _ => format!("{x:.0} {unit}"),
        };
        let shown = if ratio.is_nan() { "-".to_string() } else { format!("{ratio:.2}x") };
        println!("{label:<24} {:>14} {:>14} {shown:>10}", fmt(a), fmt(b));
        summary.insert(key, json!({"ferrocomm": a, "ucx": b, "ratio": ratio}));
    }
    let c = med(&spread, "centralized_Mops");
    let s = med(&spread, "spread_Mops");
    println!(
        "fetch-add, {} ranks on 2 CPUs{}: every rank to one target {c:.2} M ops/s, spread across targets {s:.2} M ops/s ({:.2}x)",
        o.atomic_ranks,
        if o.atomic_ranks > 2 { " (oversubscribed)" } else { "" },
        s / c
    );
    if let Some(path) = &o.json {
        let all = json!({"summary": summary, "ferrocomm": ours, "ucx": theirs, "atomics": spread,
                         "cpus": o.cpus, "runs": o.runs, "transports": o.transports});
        std::fs::write(path, serde_json::to_string_pretty(&all)? + "\n")?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
