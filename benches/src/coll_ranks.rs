//! The ferrocomm side of `collectives`: the OSU measurement of `benches/mpi/osu_coll.c`, line for
//! line, on ferrocomm ranks (each its own process, started by [`run_local`](ferrorun::run_local) as in `pingpong`).
//!
//! Each rank pins itself (`-p`, rank r on the (r mod count)-th CPU), joins the job, and for each
//! operation and size runs the warm-up and timed iterations, timing each collective alone with an
//! untimed barrier after it (the barrier benchmark times barriers back to back). Each rank's mean
//! latency is reduced to rank 0 (min, max, sum, as `f64`), which prints the same `result` line as
//! the C program, plus the algorithm the communicator chose. The buffers are allocated once;
//! all-reduce and scan work in place, so their input is restored before each (untimed) iteration,
//! where MPI reads a separate send buffer. Gather, scatter and reduce-scatter go into
//! preallocated receive buffers (`gather_into`, `scatter_into`, `reduce_scatter_block_into`), as
//! MPI's do.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use ferrocomm::{Comm, Operation, ReduceOp, Table};

use crate::osu::{self, Measurement, Schedule};
use crate::{Result, affinity, process};

/// Hidden subcommand: the job, which launches the ranks.
pub(crate) const JOB_COMMAND: &str = "collectives-job";
/// Hidden subcommand: one rank.
pub(crate) const RANK_COMMAND: &str = "collectives-rank";

/// The longest a ferrocomm job may take.
const JOB_TIMEOUT: Duration = Duration::from_secs(600);

/// What a ferrocomm job is asked to do: the arguments of the hidden `collectives-job` and
/// `collectives-rank` subcommands ([`JobSpec::to_args`]).
#[derive(Clone, Debug, clap::Args)]
pub(crate) struct JobSpec {
    #[arg(long, default_value_t = 2)]
    pub ranks: u32,
    /// `FERROCOMM_PROGRESS` for the ranks.
    #[arg(long, default_value = "busy")]
    pub progress: String,
    /// Algorithm overrides (`op=algorithm,...`) applied with `Comm::with_collective_table`.
    #[arg(long)]
    pub pin: Option<String>,
    /// Extra environment of the ranks (`KEY=VALUE`), e.g. allocator tuning; not given to the MPIs.
    #[arg(long, value_parser = crate::cli::key_value)]
    pub env: Vec<String>,
    #[command(flatten)]
    pub schedule: Schedule,
}

impl JobSpec {
    fn to_args(&self) -> Vec<String> {
        let mut a = vec!["--ranks".into(), self.ranks.to_string(), "--progress".into(), self.progress.clone()];
        if let Some(p) = &self.pin {
            a.extend(["--pin".into(), p.clone()]);
        }
        for e in &self.env {
            a.extend(["--env".into(), e.clone()]);
        }
        a.extend(self.schedule.to_args());
        a
    }

    /// The command that runs this job, for the report.
    pub(crate) fn describe(&self) -> String {
        format!("FERROCOMM_TRANSPORTS=auto FERROCOMM_PROGRESS={} ferrocomm-bench {JOB_COMMAND} {}", self.progress, {
            self.to_args().join(" ")
        })
    }
}

/// The transport the ranks used and rank 0's measurements.
pub(crate) struct JobResult {
    pub transport: String,
    pub measurements: Vec<Measurement>,
}

/// Runs one ferrocomm job and collects rank 0's `result` lines.
pub(crate) fn run(spec: &JobSpec) -> Result<JobResult> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(&exe);
    cmd.arg(JOB_COMMAND).args(spec.to_args()).stderr(Stdio::inherit());
    let (status, lines) = process::run_lines(cmd, JOB_TIMEOUT)
        .map_err(|e| format!("the ferrocomm job failed or did not finish within {JOB_TIMEOUT:?}: {e}"))?;
    let transport =
        lines.iter().find_map(|l| l.strip_prefix("[0] # transport ").map(String::from)).unwrap_or_else(|| "?".into());
    let measurements = crate::osu::collect(&lines);
    if !status.success() {
        return Err(format!("the ferrocomm job on {} ranks failed ({status})", spec.ranks).into());
    }
    Ok(JobResult { transport, measurements })
}

/// `collectives-job`: launches the ranks and waits for them.
pub(crate) fn job_main(spec: JobSpec) -> Result<()> {
    // All ranks share this host: shared memory between every pair.
    let env =
        vec![("FERROCOMM_TRANSPORTS".into(), "auto".into()), ("FERROCOMM_PROGRESS".into(), spec.progress.clone())];
    let mut env: Vec<(String, String)> = env;
    for e in &spec.env {
        let (k, v) = e.split_once('=').ok_or_else(|| format!("--env {e:?}: expected KEY=VALUE"))?;
        env.push((k.into(), v.into()));
    }
    crate::ranks::launch(spec.ranks, RANK_COMMAND, spec.to_args(), env)
}

/// `collectives-rank`: one rank of the job.
pub(crate) fn rank_main(spec: JobSpec) -> Result<()> {
    let rank: usize = std::env::var("FERROCOMM_RANK")
        .map_err(|_| "FERROCOMM_RANK is not set: collectives-rank runs under the benchmark's launcher")?
        .parse()?;
    let cpus = &spec.schedule.cpus;
    if !cpus.is_empty() {
        let cpu = cpus[rank % cpus.len()];
        // Before any other thread starts, so that they all inherit the CPU.
        affinity::pin_current_thread(cpu).map_err(|e| format!("rank {rank}: cannot pin to CPU {cpu}: {e}"))?;
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let world = ferrocomm::init().await?;
        let comm = match &spec.pin {
            Some(p) => world.with_collective_table(Table::default().with_overrides(p)?),
            None => world.comm().clone(),
        };
        if comm.rank() == 0 {
            println!("# transport {}", world.transport_name());
        }
        measure(&comm, &spec.schedule).await?;
        world.finalize().await?;
        Ok(())
    })
}

/// Preallocated buffers, large enough for every size of the schedule.
struct Buffers {
    bytes: Vec<u8>,
    floats: Vec<f32>,
    /// The all-reduce input, restored before each iteration.
    input: Vec<f32>,
    /// Receive buffer of all-gather and all-to-all (MPI's recvbuf); `floats` is reduce's and
    /// reduce-scatter's.
    out: Vec<u8>,
    /// `sendrecv`'s send data and receive buffer, made once and reused as MPI reuses its buffers
    /// (a fresh megabyte per call measured page faults, not the exchange).
    exchange: (bytes::Bytes, Option<bytes::BytesMut>),
}

/// Every operation of `s`, every size.
async fn measure(comm: &Comm, s: &Schedule) -> Result<()> {
    let n = comm.size() as usize;
    let largest = s.sizes.iter().copied().max().unwrap_or(0);
    let input: Vec<f32> = (0..largest * n / 4).map(|k| (k % 7) as f32).collect();
    let mut b = Buffers {
        bytes: (0..largest * n).map(|k| k as u8).collect(),
        floats: input.clone(),
        input,
        out: vec![0; largest * n],
        exchange: (bytes::Bytes::from(vec![7u8; largest]), Some(bytes::BytesMut::zeroed(largest))),
    };
    comm.barrier().await?;
    if s.ops.iter().any(|o| o == "barrier") {
        for _ in 0..s.warmup {
            comm.barrier().await?;
        }
        let t = Instant::now();
        for _ in 0..s.iters {
            comm.barrier().await?;
        }
        let alg = comm.collective_algorithm(Operation::Barrier, 0).to_string();
        report(comm, "barrier", 0, s.iters, t.elapsed().as_secs_f64(), alg).await?;
    }
    for op in osu::OPS.iter().copied().filter(|&o| o != "barrier") {
        if !s.ops.iter().any(|o| o == op) {
            continue;
        }
        let operation: Option<Operation> = if op == "sendrecv" { None } else { Some(op.parse()?) };
        for &bytes in &s.sizes {
            let (warmup, iters) = s.counts(bytes);
            comm.barrier().await?;
            let mut total = 0.0;
            for i in 0..warmup + iters {
                let t = once(comm, op, bytes, &mut b).await?;
                if i >= warmup {
                    total += t;
                }
                comm.barrier().await?;
            }
            // The selector sees reduce-scatter's whole vector, n blocks.
            let selected = if op == "reduce_scatter" { bytes * comm.size() as usize } else { bytes };
            let alg = operation.map_or("p2p".into(), |o| comm.collective_algorithm(o, selected).to_string());
            report(comm, op, bytes, iters, total, alg).await?;
        }
    }
    Ok(())
}

/// One collective of `op` at `bytes`; returns its duration, seconds.
async fn once(comm: &Comm, op: &str, bytes: usize, b: &mut Buffers) -> Result<f64> {
    let n = comm.size() as usize;
    let floats = bytes / size_of::<f32>();
    if op == "allreduce" || op == "scan" {
        b.floats[..floats].copy_from_slice(&b.input[..floats]);
    }
    let t = Instant::now();
    match op {
        "bcast" => comm.broadcast(0, &mut b.bytes[..bytes]).await?,
        "allreduce" => comm.allreduce(&mut b.floats[..floats], ReduceOp::Sum).await?,
        // Into the root's reused buffer, as MPI's receive buffer.
        "reduce" => {
            let root = (comm.rank() == 0).then(|| &mut b.floats[..floats]);
            comm.reduce_into(0, &b.input[..floats], root, ReduceOp::Sum).await?
        }
        "gather" => {
            let root = (comm.rank() == 0).then(|| &mut b.out[..bytes * n]);
            comm.gather_into(0, &b.bytes[..bytes], root).await?
        }
        "scatter" => {
            let root = (comm.rank() == 0).then(|| &b.bytes[..bytes * n]);
            comm.scatter_into(0, root, &mut b.out[..bytes]).await?
        }
        // Each rank's result block is `bytes`: the vector is n blocks; into a reused buffer, as
        // MPI's receive buffer.
        "reduce_scatter" => {
            comm.reduce_scatter_block_into(&b.input[..floats * n], &mut b.floats[..floats], ReduceOp::Sum).await?
        }
        "scan" => comm.scan(&mut b.floats[..floats], ReduceOp::Sum).await?,
        // Into a preallocated receive buffer, as the MPI side does.
        "allgather" => comm.allgather_into(&b.bytes[..bytes], &mut b.out[..bytes * n]).await?,
        "alltoall" => comm.alltoall_into(&b.bytes[..bytes * n], &mut b.out[..bytes * n]).await?,
        // Exchange with rank r^1, the point-to-point baseline (recursive doubling on 2 ranks).
        "sendrecv" if (comm.rank() ^ 1) < comm.size() => {
            let peer = comm.rank() ^ 1;
            let (data, buf) = &mut b.exchange;
            let mut into = buf.take().expect("returned after each exchange");
            into.resize(bytes, 0);
            let recv = comm.recv_into(peer, 1, into);
            comm.send(peer, 1, data.slice(..bytes)).await?;
            *buf = Some(recv.await?.0);
        }
        "sendrecv" => {}
        other => return Err(format!("no such operation {other:?}").into()),
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Reduces each rank's mean latency to rank 0, which prints the `result` line.
async fn report(comm: &Comm, op: &str, bytes: usize, iters: u64, total: f64, alg: String) -> Result<()> {
    let mine = [total * 1e6 / iters.max(1) as f64];
    let lo = comm.reduce(0, &mine, ReduceOp::Min).await?;
    let hi = comm.reduce(0, &mine, ReduceOp::Max).await?;
    let sum = comm.reduce(0, &mine, ReduceOp::Sum).await?;
    if let (Some(lo), Some(hi), Some(sum)) = (lo, hi, sum) {
        let m = Measurement {
            op: op.into(),
            bytes,
            iterations: iters,
            avg_us: sum[0] / f64::from(comm.size()),
            min_us: lo[0],
            max_us: hi[0],
            algorithm: Some(alg),
        };
        println!("{}", m.line());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn job_args_round_trip() {
        let spec = JobSpec {
            ranks: 4,
            progress: "adaptive:20".into(),
            pin: Some("allreduce=ring".into()),
            env: vec!["A=b=c".into()],
            schedule: Schedule { sizes: vec![8, 1 << 20], ..Schedule::default() },
        };
        let line = format!("{JOB_COMMAND} {}", spec.to_args().join(" "));
        let crate::Command::CollectivesJob(back) = crate::tests::parse(&line).unwrap() else { panic!("{line}") };
        assert_eq!(
            (back.ranks, back.progress.as_str(), back.pin.as_deref()),
            (4, "adaptive:20", Some("allreduce=ring"))
        );
        assert_eq!(back.schedule, spec.schedule);
        assert_eq!(back.env, spec.env);
        assert!(crate::tests::parse(&format!("{JOB_COMMAND} --ranks")).is_err());
    }
}
