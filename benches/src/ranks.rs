//! The ferrocomm side of `pingpong`: two ranks, each its own process.
//!
//! Three processes take part, all this binary:
//!
//! 1. the benchmark ([`run_sweep`]) starts `ferrocomm-bench pingpong-job ...` with its standard
//!    output piped, so that it can read the ranks' output (which [`run_local`] forwards to the
//!    standard output of the process calling it);
//! 2. the job ([`job_main`]) calls [`run_local`] for two ranks of `ferrocomm-bench pingpong-rank
//!    ...`, with the progress mode and TCP backend in their environment;
//! 3. each rank ([`rank_main`]) pins itself to its CPU, joins the job, and runs the sweep: rank 0
//!    measures and prints one JSON line (`[0] {...}` once forwarded), rank 1 echoes.
//!
//! Rank 0 steers rank 1 with control messages: before each batch, `(size, count)` on
//! [`TAG_CONTROL`]; rank 1 posts its first receive, acknowledges on [`TAG_ACK`], and echoes `count`
//! messages of `size` bytes on [`TAG_DATA`]. A count of 0 ends the sweep. The timed part of a batch
//! starts after the acknowledgement, so it holds only ping-pong traffic.
//!
//! Payloads are received with [`Comm::recv`](ferrocomm::Comm::recv) (a buffer per message), or with
//! `--recv-into` by [`Comm::recv_into`](ferrocomm::Comm::recv_into) into one buffer per rank,
//! allocated once and reused.
//!
//! With an idle gap ([`JobSpec::idle_gap_us`]) rank 0 measures single 8-byte round trips instead of
//! a sweep, sleeping the gap before each, so that rank 1 has been waiting that long when the ping
//! arrives: in adaptive mode it has stopped spinning and sleeps (its CPU idle), and the ping must
//! wake it through its doorbell. Each round trip is timed alone; rank 0 reports them all.

use std::ffi::OsString;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use ferrocomm::{Message, Op, Rank, Status, World};
use ferrorun::{LaunchOptions, run_local};
use serde_json::{Value, json};

use crate::sweep::{self, MIN_ITERATIONS, MIN_WARMUP, STOP_AFTER, WARMUP};
use crate::{Result, affinity, cli, process};

/// Hidden subcommand: the job, which launches the ranks.
pub(crate) const JOB_COMMAND: &str = "pingpong-job";
/// Hidden subcommand: one rank.
pub(crate) const RANK_COMMAND: &str = "pingpong-rank";

/// Ping-pong payloads.
const TAG_DATA: u64 = 1;
/// `(size, count)` from rank 0 before each batch, as two little-endian u64.
const TAG_CONTROL: u64 = 2;
/// Rank 1's answer to a control message: its first receive is posted.
const TAG_ACK: u64 = 3;
/// Timed slices of a batch whose median is the "median" round trip (a multiple of [`TRIALS`]).
const SUB_BATCHES: u64 = 15;
/// NetPIPE's trials per size: it reports the best trial's mean (Debian's NetPIPE 3.7 is built
/// with 3: a run's trials can be counted from its repetitions and its time). A batch's best
/// third is the like-for-like figure.
const TRIALS: u64 = 3;

/// How long a job warms up at its first size before the sweep.
const JOB_WARMUP: Duration = Duration::from_millis(50);
/// Round trip assumed for the warm-up of the first size.
const FIRST_GUESS: Duration = Duration::from_millis(1);
/// The longest a whole ferrocomm sweep may take.
const JOB_TIMEOUT: Duration = Duration::from_secs(300);

/// What the ferrocomm side is asked to do: the arguments of the hidden `pingpong-job` and
/// `pingpong-rank` subcommands ([`JobSpec::to_args`]).
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct JobSpec {
    /// `FERROCOMM_TCP_BACKEND` for the ranks.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// `FERROCOMM_PROGRESS` for the ranks.
    #[arg(long, default_value = "busy")]
    pub progress: String,
    /// The sweep's `--max`.
    #[arg(long, default_value_t = 0)]
    pub max: usize,
    /// The sizes to measure, in this order (one slice of the sweep); none: every size of the
    /// sweep up to `max` ([`sweep::sizes`]).
    #[arg(long, value_delimiter = ',')]
    pub sizes: Vec<usize>,
    /// CPU of rank 0 and of rank 1.
    #[arg(long, default_value = "0,1", value_parser = cli::cpu_pair)]
    pub cpus: [usize; 2],
    /// Receive into one preallocated buffer (`recv_into`) instead of `recv`.
    #[arg(long)]
    pub recv_into: bool,
    /// Send with `send_from` a borrowed slice instead of `send` of a shared handle.
    #[arg(long)]
    pub send_from: bool,
    /// Not 0: measure [`IDLE_PINGS`] single 8-byte round trips, this many microseconds apart.
    #[arg(long = "idle-gap", default_value_t = 0)]
    pub idle_gap_us: u64,
    /// With an idle gap: draw each gap at random between half and one and a half of it, so that
    /// the peer cannot foresee the pings (hybrid polling has nothing to go on).
    #[arg(long)]
    pub idle_jitter: bool,
    /// How long the timed batch of each size lasts, milliseconds ([`sweep::TARGET`] by default;
    /// longer where a round trip is slow, as under emulation, for enough round trips per size).
    #[arg(long, default_value_t = sweep::TARGET.as_millis() as u64)]
    pub target_ms: u64,
    /// Time each round trip alone (cycle counter), for a median round trip like perftest's and
    /// latency percentiles; otherwise [`SUB_BATCHES`] slices of each batch.
    #[arg(long)]
    pub time_each: bool,
    /// Extra environment of the job and its ranks (verbs device, GID index); not an argument.
    #[arg(skip)]
    pub env: Vec<(String, String)>,
}

/// Round trips measured with an idle gap.
pub(crate) const IDLE_PINGS: u64 = 2000;

impl JobSpec {
    /// The sizes this job measures.
    pub(crate) fn size_list(&self) -> Vec<usize> {
        if self.sizes.is_empty() { sweep::sizes(self.max) } else { self.sizes.clone() }
    }

    fn to_args(&self) -> Vec<String> {
        let s = |v: &str| v.to_string();
        let mut args = vec![
            s("--backend"),
            s(&self.backend),
            s("--progress"),
            s(&self.progress),
            s("--max"),
            self.max.to_string(),
            s("--cpus"),
            format!("{},{}", self.cpus[0], self.cpus[1]),
            s("--idle-gap"),
            self.idle_gap_us.to_string(),
            s("--target-ms"),
            self.target_ms.to_string(),
        ];
        if !self.sizes.is_empty() {
            args.push(s("--sizes"));
            args.push(self.sizes.iter().map(usize::to_string).collect::<Vec<_>>().join(","));
        }
        if self.recv_into {
            args.push(s("--recv-into"));
        }
        if self.send_from {
            args.push(s("--send-from"));
        }
        if self.idle_jitter {
            args.push(s("--idle-jitter"));
        }
        if self.time_each {
            args.push(s("--time-each"));
        }
        args
    }
}

/// One size as rank 0 measured it.
#[derive(Clone, Debug)]
pub(crate) struct Sample {
    pub bytes: usize,
    /// Timed iterations (round trips).
    pub iterations: u64,
    /// Round trip / 2, seconds: the batch's mean (NetPIPE).
    pub one_way: f64,
    /// The median round trip / 2, seconds: of the round trips each timed alone
    /// ([`JobSpec::time_each`]), or over the batch's timed slices of their mean round trip
    /// (insensitive to rare stalls of a noisy or emulated machine).
    pub median_one_way: f64,
    /// NetPIPE's method: the batch cut into [`TRIALS`] consecutive trials, the best trial's mean
    /// round trip / 2, seconds.
    pub best_trial_one_way: f64,
    /// With every round trip timed ([`JobSpec::time_each`]): the one-way [`sweep::PERCENTILES`]
    /// (round trip / 2), seconds.
    pub percentiles: Option<[f64; 3]>,
}

/// One ferrocomm sweep.
#[derive(Clone, Debug)]
pub(crate) struct SweepResult {
    /// The transport the ranks ended up with (e.g. `tcp-uring`).
    pub transport: String,
    pub samples: Vec<Sample>,
}

/// Runs one ferrocomm sweep as a job of two ranks and collects rank 0's measurements.
pub(crate) fn run_sweep(spec: &JobSpec) -> Result<SweepResult> {
    parse_result(&run_job(spec)?.0)
}

/// One idle-gap measurement ([`run_idle`]).
pub(crate) struct IdleRun {
    /// One-way times, seconds.
    pub samples: Vec<f64>,
    /// The share of one CPU the waiting peer (rank 1, all its threads) used meanwhile.
    pub peer_cpu_share: Option<f64>,
}

/// Runs the idle-gap measurement ([`JobSpec::idle_gap_us`] must not be 0): one-way times in
/// seconds, one per round trip.
pub(crate) fn run_idle(spec: &JobSpec) -> Result<IdleRun> {
    let (line, peer) = run_job(spec)?;
    let peer_cpu_share =
        peer.and_then(|p| serde_json::from_str::<Value>(&p).ok()).and_then(|v| v["peer_cpu_share"].as_f64());
    let v: Value = serde_json::from_str(&line).map_err(|e| format!("rank 0's result is not JSON ({e}): {line}"))?;
    let samples: Vec<f64> = v["idle_one_way_s"]
        .as_array()
        .ok_or("rank 0's result has no idle samples")?
        .iter()
        .filter_map(Value::as_f64)
        .collect();
    if samples.is_empty() { Err("no idle samples".into()) } else { Ok(IdleRun { samples, peer_cpu_share }) }
}

/// Runs the job of two ranks; returns the JSON line rank 0 printed, and rank 1's if it printed one.
fn run_job(spec: &JobSpec) -> Result<(String, Option<String>)> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(&exe);
    cmd.arg(JOB_COMMAND).args(spec.to_args()).envs(spec.env.iter().map(|(k, v)| (k, v))).stderr(Stdio::inherit());
    let (status, lines) = process::run_lines(cmd, JOB_TIMEOUT).map_err(|e| {
        format!("the ferrocomm job ({}) failed or did not finish within {JOB_TIMEOUT:?}: {e}", exe.display())
    })?;
    let (mut result, mut peer) = (None, None);
    for line in lines {
        // The first JSON line of each rank; anything else the ranks print is passed on.
        let json = |rank: &str| line.strip_prefix(rank).filter(|l| l.starts_with('{')).map(str::to_string);
        match (json("[0] "), json("[1] ")) {
            (Some(j), _) if result.is_none() => result = Some(j),
            (_, Some(j)) if peer.is_none() => peer = Some(j),
            _ => eprintln!("  {line}"),
        }
    }
    if !status.success() {
        return Err(format!("the ferrocomm job failed ({status})").into());
    }
    Ok((result.ok_or("rank 0 printed no result")?, peer))
}

fn parse_result(line: &str) -> Result<SweepResult> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("rank 0's result is not JSON ({e}): {line}"))?;
    let transport = v["transport"].as_str().unwrap_or("?").to_string();
    let rows = v["rows"].as_array().ok_or("rank 0's result has no rows")?;
    let samples = rows
        .iter()
        .map(|r| {
            Some(Sample {
                bytes: r["bytes"].as_u64()? as usize,
                iterations: r["iterations"].as_u64()?,
                one_way: r["one_way_s"].as_f64()?,
                median_one_way: r["median_one_way_s"].as_f64()?,
                best_trial_one_way: r["best_trial_one_way_s"].as_f64()?,
                percentiles: r["percentiles_one_way_s"]
                    .as_array()
                    .and_then(|p| Some([p.first()?.as_f64()?, p.get(1)?.as_f64()?, p.get(2)?.as_f64()?])),
            })
        })
        .collect::<Option<Vec<_>>>()
        .ok_or("a malformed row in rank 0's result")?;
    Ok(SweepResult { transport, samples })
}

/// `pingpong-job`: launches the two ranks and waits for them.
pub(crate) fn job_main(spec: JobSpec) -> Result<()> {
    let transports = match spec.backend.as_str() {
        "shm" => "auto",
        "verbs" => "verbs",
        _ => "tcp",
    };
    let env = vec![
        // Both ranks share this host: they talk through shared memory unless TCP (or verbs) is
        // forced.
        ("FERROCOMM_TRANSPORTS".into(), transports.into()),
        ("FERROCOMM_TCP_BACKEND".into(), if transports == "tcp" { &spec.backend } else { "auto" }.into()),
        ("FERROCOMM_PROGRESS".into(), spec.progress.clone()),
    ];
    launch(2, RANK_COMMAND, spec.to_args(), env)
}

/// Runs `n` ranks of this binary's `rank_command` with `args` and `env` through [`run_local`],
/// and waits for them.
pub(crate) fn launch(n: u32, rank_command: &str, args: Vec<String>, env: Vec<(String, String)>) -> Result<()> {
    let exe = std::env::current_exe()?;
    let rank_args: Vec<OsString> = std::iter::once(rank_command.to_string()).chain(args).map(OsString::from).collect();
    let opts = LaunchOptions { env, ..LaunchOptions::default() };
    match run_local(n, &exe, &rank_args, &opts)? {
        0 => Ok(()),
        code => Err(format!("the ranks failed (job exit code {code})").into()),
    }
}

/// `pingpong-rank`: one rank of the job.
pub(crate) fn rank_main(spec: JobSpec) -> Result<()> {
    let rt = pinned_pair_runtime(&spec.cpus)?;
    rt.block_on(async {
        let world = init_pair().await?;
        let sizes = spec.size_list();
        let payload = pattern(sizes.iter().copied().max().unwrap_or(1).max(8));
        let mut bufs = Buffers::new(spec.recv_into, spec.send_from, payload.len());
        world.barrier().await?;
        if world.rank() == 0 && spec.idle_gap_us > 0 {
            let gap = Duration::from_micros(spec.idle_gap_us);
            let samples = measure_idle(&world, &payload, &mut bufs, gap, spec.idle_jitter).await?;
            println!("{}", json!({"transport": world.transport_name(), "idle_one_way_s": samples}));
        } else if world.rank() == 0 {
            let target = Duration::from_millis(spec.target_ms.max(1));
            let samples = measure(&world, &payload, &mut bufs, &sizes, target, spec.time_each).await?;
            let rows: Vec<Value> = samples
                .iter()
                .map(|s| {
                    json!({"bytes": s.bytes, "iterations": s.iterations, "one_way_s": s.one_way,
                           "median_one_way_s": s.median_one_way, "best_trial_one_way_s": s.best_trial_one_way,
                           "percentiles_one_way_s": s.percentiles})
                })
                .collect();
            // One line of a few KiB, well under the launcher's 64 KiB line limit.
            println!("{}", json!({"transport": world.transport_name(), "rows": rows}));
        } else {
            let (cpu, wall) = (process::our_cpu_seconds(), Instant::now());
            echo(&world, &payload, &mut bufs).await?;
            if spec.idle_gap_us > 0 {
                let share = (process::our_cpu_seconds() - cpu) / wall.elapsed().as_secs_f64();
                println!("{}", json!({ "peer_cpu_share": share }));
            }
        }
        world.finalize().await?;
        Ok(())
    })
}

/// `len` bytes of a recognisable pattern.
/// For one rank of a two-rank job under the benchmark's launcher: pins this thread to the rank's
/// CPU of `cpus` (first of all, so that every thread started from here on, tokio's and
/// ferrocomm's progress thread, inherits it) and builds the rank's runtime.
pub(crate) fn pinned_pair_runtime(cpus: &[usize]) -> Result<tokio::runtime::Runtime> {
    let rank: usize = std::env::var("FERROCOMM_RANK")
        .map_err(|_| "FERROCOMM_RANK is not set: this rank runs under the benchmark's launcher")?
        .parse()?;
    let cpu = *cpus.get(rank).ok_or("the job runs with exactly 2 ranks")?;
    affinity::pin_current_thread(cpu).map_err(|e| format!("rank {rank}: cannot pin to CPU {cpu}: {e}"))?;
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// Joins the job, which must have exactly two ranks.
pub(crate) async fn init_pair() -> Result<World> {
    let world = ferrocomm::init().await?;
    if world.size() != 2 {
        return Err("the job runs with exactly 2 ranks".into());
    }
    Ok(world)
}

fn pattern(len: usize) -> Bytes {
    (0..len).map(|i| (i % 251) as u8).collect::<Vec<u8>>().into()
}

/// A received payload, as far as checking goes: its length and last byte.
struct Got {
    len: usize,
    last: Option<u8>,
}

impl Got {
    /// Checks that the payload is the `len`-byte prefix of `payload`.
    fn check(&self, payload: &Bytes, len: usize) -> Result<()> {
        if self.len != len || self.last.as_ref() != payload.get(len - 1) {
            return Err(format!("received a wrong message: {} bytes, expected {len}", self.len).into());
        }
        Ok(())
    }
}

/// A posted payload receive.
enum Posted {
    Alloc(Op<Message>),
    Into(Op<(BytesMut, Status)>),
}

/// How a rank moves payloads: received by `recv`, or by `recv_into` its one reusable buffer;
/// sent by `send` of a shared handle, or by `send_from` a borrowed slice (copied, as MPI sends).
struct Buffers {
    into: bool,
    /// The buffer, while no receive holds it.
    buf: Option<BytesMut>,
    send_from: bool,
}

impl Buffers {
    fn new(into: bool, send_from: bool, capacity: usize) -> Buffers {
        Buffers { into, buf: into.then(|| BytesMut::zeroed(capacity)), send_from }
    }

    /// Sends `data` to `dest`.
    fn send(&self, world: &World, dest: Rank, data: &Bytes) -> ferrocomm::Op<()> {
        if self.send_from { world.send_from(dest, TAG_DATA, data) } else { world.send(dest, TAG_DATA, data.clone()) }
    }

    /// Posts the receive of a `len`-byte payload from `src`.
    fn post(&mut self, world: &World, src: Rank, len: usize) -> Result<Posted> {
        if !self.into {
            return Ok(Posted::Alloc(world.recv(src, TAG_DATA)));
        }
        let mut buf = self.buf.take().ok_or("the receive buffer was lost to a failed receive")?;
        // Within the capacity: no allocation, and zero-filling only when the size grows.
        buf.resize(len, 0);
        Ok(Posted::Into(world.recv_into(src, TAG_DATA, buf)))
    }

    /// Waits for a posted receive.
    async fn wait(&mut self, posted: Posted) -> Result<Got> {
        match posted {
            Posted::Alloc(op) => {
                let m = op.await?;
                Ok(Got { len: m.data.len(), last: m.data.last().copied() })
            }
            Posted::Into(op) => {
                let (buf, _) = op.await?;
                let got = Got { len: buf.len(), last: buf.last().copied() };
                self.buf = Some(buf);
                Ok(got)
            }
        }
    }
}

/// Rank 0: the sweep. Returns one sample per size measured.
async fn measure(
    world: &World,
    payload: &Bytes,
    bufs: &mut Buffers,
    sizes: &[usize],
    target: Duration,
    time_each: bool,
) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    let mut round_trip = FIRST_GUESS.as_secs_f64();
    // A fresh job (one per slice): connections, rings and first-touch page faults warm up at the
    // first size for JOB_WARMUP before anything is timed, else the first size of every slice
    // would carry them.
    if let Some(&first) = sizes.first() {
        let data = payload.slice(..first);
        let n = sweep::iterations(round_trip, WARMUP, MIN_WARMUP);
        round_trip = batch(world, payload, bufs, &data, n, false).await?.total.as_secs_f64() / n as f64;
        let n = sweep::iterations(round_trip, JOB_WARMUP, MIN_WARMUP);
        round_trip = batch(world, payload, bufs, &data, n, false).await?.total.as_secs_f64() / n as f64;
    }
    for &bytes in sizes {
        let data = payload.slice(..bytes);
        let warmup = sweep::iterations(round_trip, WARMUP, MIN_WARMUP);
        round_trip = batch(world, payload, bufs, &data, warmup, false).await?.total.as_secs_f64() / warmup as f64;
        let iterations = sweep::iterations(round_trip, target, MIN_ITERATIONS);
        let timed = batch(world, payload, bufs, &data, iterations, time_each).await?;
        round_trip = timed.total.as_secs_f64() / iterations as f64;
        let one_way = round_trip / 2.0;
        samples.push(Sample {
            bytes,
            iterations,
            one_way,
            median_one_way: timed.median / 2.0,
            best_trial_one_way: timed.best_trial / 2.0,
            percentiles: timed.percentiles.map(|p| p.map(|t| t / 2.0)),
        });
        if one_way > STOP_AFTER.as_secs_f64() {
            break;
        }
    }
    world.send(1, TAG_CONTROL, control(0, 0)).await?;
    Ok(samples)
}

/// Rank 0: [`IDLE_PINGS`] round trips of 8 bytes, each after sleeping `gap` (the thread sleeps:
/// its CPU goes idle too) and timed alone. Returns one-way times in seconds.
async fn measure_idle(
    world: &World,
    payload: &Bytes,
    bufs: &mut Buffers,
    gap: Duration,
    jitter: bool,
) -> Result<Vec<f64>> {
    const BYTES: usize = 8;
    let data = payload.slice(..BYTES);
    world.send(1, TAG_CONTROL, control(BYTES, IDLE_PINGS)).await?;
    world.recv(1, TAG_ACK).await?;
    let mut samples = Vec::with_capacity(IDLE_PINGS as usize);
    // xorshift64: a fixed sequence of gaps, the same in every run.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for _ in 0..IDLE_PINGS {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let scale = if jitter { 0.5 + (x >> 11) as f64 / (1u64 << 53) as f64 } else { 1.0 };
        std::thread::sleep(gap.mul_f64(scale));
        let start = Instant::now();
        bufs.send(world, 1, &data).await?;
        let posted = bufs.post(world, 1, BYTES)?;
        bufs.wait(posted).await?.check(payload, BYTES)?;
        samples.push(start.elapsed().as_secs_f64() / 2.0);
    }
    world.send(1, TAG_CONTROL, control(0, 0)).await?;
    Ok(samples)
}

/// What a timed batch measured, round trips in seconds.
struct Timed {
    /// The whole batch.
    total: Duration,
    /// The median round trip (see [`batch`]).
    median: f64,
    /// NetPIPE's figure: the mean round trip of the best of [`TRIALS`] consecutive trials.
    best_trial: f64,
    /// With every round trip timed: its [`sweep::PERCENTILES`].
    percentiles: Option<[f64; 3]>,
}

/// Rank 0: `count` round trips of `data`, timed: the whole batch, the median round trip and the
/// best trial's mean.
///
/// Without `time_each`, the median of [`SUB_BATCHES`] consecutive slices' mean round trip: the
/// clock is read once per slice, not per round trip, since a read costs about 40 ns here, which
/// would show in an 8-byte latency of about 100 ns (NetPIPE too reads it once per trial). With
/// `time_each`, the median of the round trips themselves, each stamped by the CPU's cycle counter
/// as `ib_send_lat` stamps its iterations (its `t_typical` is that median); the counter is turned
/// into time by the batch's own length on the clock. The two medians differ where a machine is
/// noisy: a slice's mean carries its share of the stalls, a median round trip does not. The best
/// trial is NetPIPE's statistic (the lowest of its trials' means), for a like-for-like comparison
/// with the NetPIPE peers, which report nothing else.
async fn batch(
    world: &World,
    payload: &Bytes,
    bufs: &mut Buffers,
    data: &Bytes,
    count: u64,
    time_each: bool,
) -> Result<Timed> {
    world.send(1, TAG_CONTROL, control(data.len(), count)).await?;
    world.recv(1, TAG_ACK).await?;
    let round_trip = async |bufs: &mut Buffers| -> Result<()> {
        bufs.send(world, 1, data).await?;
        let posted = bufs.post(world, 1, data.len())?;
        bufs.wait(posted).await?.check(payload, data.len())
    };
    let start = Instant::now();
    if time_each {
        let mut stamps = Vec::with_capacity(count as usize + 1);
        stamps.push(sweep::stamp());
        for _ in 0..count {
            round_trip(bufs).await?;
            stamps.push(sweep::stamp());
        }
        let total = start.elapsed();
        let trips = sweep::trips(&stamps, total.as_secs_f64());
        let each: Vec<(f64, u64)> = trips.iter().map(|&t| (t, 1)).collect();
        let best_trial = best_trial(&each);
        let percentiles = sweep::percentiles(&trips);
        return Ok(Timed { total, median: sweep::median(&trips).unwrap_or(0.0), best_trial, percentiles });
    }
    // Each slice's (seconds, round trips).
    let per_slice = count.div_ceil(SUB_BATCHES).max(1);
    let mut slices = Vec::with_capacity(SUB_BATCHES as usize);
    let mut last = start;
    let mut left = count;
    while left > 0 {
        let n = per_slice.min(left);
        for _ in 0..n {
            round_trip(bufs).await?;
        }
        left -= n;
        let now = Instant::now();
        slices.push(((now - last).as_secs_f64(), n));
        last = now;
    }
    let means: Vec<f64> = slices.iter().map(|&(t, n)| t / n as f64).collect();
    Ok(Timed {
        total: start.elapsed(),
        median: sweep::median(&means).unwrap_or(0.0),
        best_trial: best_trial(&slices),
        percentiles: None,
    })
}

/// NetPIPE's statistic over consecutive timed parts of a batch, each `(seconds, round trips)`:
/// cut into [`TRIALS`] trials of as many parts each as can be (the last may be shorter), the
/// lowest trial mean round trip. 0 for no parts.
fn best_trial(parts: &[(f64, u64)]) -> f64 {
    let per_trial = parts.len().div_ceil(TRIALS as usize).max(1);
    parts
        .chunks(per_trial)
        .map(|trial| {
            let (t, n) = trial.iter().fold((0.0, 0), |(t, n), &(dt, dn)| (t + dt, n + dn));
            t / n.max(1) as f64
        })
        .reduce(f64::min)
        .unwrap_or(0.0)
}

/// Rank 1: echoes batches until told to stop.
async fn echo(world: &World, payload: &Bytes, bufs: &mut Buffers) -> Result<()> {
    loop {
        let c = world.recv(0, TAG_CONTROL).await?;
        let (bytes, count) = parse_control(&c.data)?;
        if count == 0 {
            return Ok(());
        }
        if bytes == 0 || bytes > payload.len() {
            return Err(format!("asked to echo {bytes} bytes, at most {} prepared", payload.len()).into());
        }
        let data = payload.slice(..bytes);
        // The first receive is posted before rank 0 hears that the batch may start.
        let mut first = Some(bufs.post(world, 0, bytes)?);
        world.send(0, TAG_ACK, Bytes::new()).await?;
        for _ in 0..count {
            let posted = match first.take() {
                Some(p) => p,
                None => bufs.post(world, 0, bytes)?,
            };
            bufs.wait(posted).await?.check(payload, bytes)?;
            bufs.send(world, 0, &data).await?;
        }
    }
}

fn control(bytes: usize, count: u64) -> Bytes {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&(bytes as u64).to_le_bytes());
    b.extend_from_slice(&count.to_le_bytes());
    b.into()
}

fn parse_control(data: &[u8]) -> Result<(usize, u64)> {
    let (Some(bytes), Some(count)) = (data.get(..8), data.get(8..16)) else {
        return Err(format!("a malformed control message of {} bytes", data.len()).into());
    };
    let word = |s: &[u8]| u64::from_le_bytes(s.try_into().expect("8 bytes"));
    Ok((word(bytes) as usize, word(count)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_trial_is_netpipes_statistic() {
        // Fifteen slices of 10 round trips: trials of five slices; the middle one is fastest.
        let mut parts = vec![(20e-6, 10); 15];
        for p in &mut parts[5..10] {
            p.0 = 10e-6;
        }
        parts[7].0 = 40e-6; // one stalled slice weighs in its trial's mean
        assert!((best_trial(&parts) - 16e-7).abs() < 1e-12, "{}", best_trial(&parts));
        // Round trips each timed alone: three trials of a third each.
        let trips: Vec<(f64, u64)> = [3.0, 3.0, 1.0, 2.0, 2.0, 2.0].iter().map(|&t| (t, 1)).collect();
        assert_eq!(best_trial(&trips), 1.5);
        assert_eq!(best_trial(&[]), 0.0);
    }

    #[test]
    fn control_round_trip() {
        assert_eq!(parse_control(&control(12345, 678)).unwrap(), (12345, 678));
        assert!(parse_control(b"short").is_err());
    }

    #[test]
    fn job_args_round_trip() {
        let spec = JobSpec {
            backend: "uring".into(),
            progress: "adaptive:20".into(),
            max: 4096,
            sizes: vec![5, 7, 8],
            cpus: [1, 0],
            recv_into: true,
            send_from: true,
            idle_gap_us: 500,
            idle_jitter: true,
            target_ms: 300,
            time_each: true,
            env: vec![],
        };
        let line = format!("{JOB_COMMAND} {}", spec.to_args().join(" "));
        let crate::Command::PingpongJob(back) = crate::tests::parse(&line).unwrap() else { panic!("{line}") };
        assert!(back.idle_jitter && back.time_each && back.send_from);
        assert_eq!(
            (back.backend.as_str(), back.progress.as_str(), back.max, back.cpus, back.recv_into, back.idle_gap_us),
            ("uring", "adaptive:20", 4096, [1, 0], true, 500)
        );
        assert_eq!(back.target_ms, 300);
        assert_eq!(back.size_list(), vec![5, 7, 8]);
        assert_eq!(JobSpec { sizes: vec![], ..back }.size_list(), sweep::sizes(4096));
    }
}
