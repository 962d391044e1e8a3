//! `ferrocomm-bench`: ferrocomm measured side by side with a reference peer, on the same machine,
//! the same CPUs and the same message sizes, in one invocation.
//!
//! # `pingpong`: the NetPIPE method
//!
//! Two processes bounce a message back and forth; the time of one round trip halved is the
//! one-way time `t(n)` of an `n`-byte message. Following NetPIPE:
//!
//! * **Sizes** grow exponentially: 1 byte, then every power of two up to `--max`, each also probed
//!   3 bytes below and 3 bytes above ([`sweep::sizes`]). The perturbed sizes expose dips at protocol
//!   switch points (eager/rendezvous limit, chunk sizes, socket buffers, page boundaries).
//! * **Repetitions**: each size is warmed up first (a short batch, ~5 ms), and the warm-up's round
//!   trip sets the number of timed iterations so that the timed batch lasts ~30 ms (`--target-ms`):
//!   far above the timer's resolution, at least 10 iterations, at most 2 000 000
//!   ([`sweep::iterations`]). A sweep stops early once one transfer takes over a second.
//! * **Results**: latency = round trip / 2, throughput MB/s = bytes / one-way time / 10^6. Each
//!   of `--runs` runs is a whole sweep; the report gives, per size, the median over runs. The
//!   NetPIPE peers report the best of their trials (3 per size, each about 0.1-0.2 s); ferrocomm's
//!   8 B latency is also given by that method (each batch cut into 3 trials), like for like.
//!
//! The ferrocomm side ([`ranks`]): the binary re-executes itself as a job of two ranks through
//! [`ferrocomm::launch::run_local`], so each rank is its own process. Each rank pins itself to one
//! CPU (`--cpus`, default 0 and 1) before anything else starts, so that ferrocomm's progress thread
//! shares the rank's CPU. Rank 0 sends then receives, rank 1 receives then sends, both from one
//! preallocated [`bytes::Bytes`] payload (sliced, never copied); receives use `recv` (or, with
//! `--recv-into`, `recv_into` one reused buffer). Rank 0 prints its measurements as one JSON line,
//! which the launching process parses.
//!
//! The peer side ([`netpipe`]): NetPIPE, pinned with `taskset` to the same two CPUs, run once per
//! size (`-l n -u n -p 0`) so that it measures exactly the sizes ferrocomm does; it picks its own
//! repetitions (~0.1 s per trial) and reports the best of its 3 trials, which favours the peer
//! slightly against ferrocomm's one timed batch per run. Over TCP (`--transport tcp`, the default)
//! the peer is `NPtcp` (Debian `netpipe-tcp`) on 127.0.0.1; over shared memory (`--transport shm`)
//! the peers are `NPopenmpi` and `NPmpich2` (Debian `netpipe-openmpi`, `netpipe-mpich2`), two ranks
//! started by their MPI's own `mpirun`.
//!
//! Over shared memory the report adds the machine's limits ([`reference`](mod@reference): cache-line ping-pong
//! between the two CPUs, memcpy bandwidth), the transport alone ([`transport`], also a benchmark
//! of its own: `shm-transport`), and the latency to an idle peer in adaptive and busy-poll mode.
//!
//! Runs alternate (ferrocomm sweep, then each peer's sweep, run after run) so that slow drifts of a noisy
//! machine hit both sides alike. Before each run the two CPUs are watched for a moment; other work
//! on them (or time stolen by the hypervisor) above 10% earns a warning, since it makes the numbers
//! noisy. Output: a table with every side and the ratios, a summary (8 B latency ratio, 64 KiB
//! and 4 MiB bandwidth ratios), optionally JSON (`--json`) and an SVG plot (`--plot`, throughput
//! and latency against size).

mod affinity;
mod burst;
mod coll_ranks;
mod collectives;
mod mcast;
mod netpipe;
mod osu;
mod perftest;
mod pingpong;
mod plot;
mod process;
mod ranks;
mod reference;
mod report;
mod rma;
mod sim_scale;
mod sweep;
mod transport;
#[cfg(feature = "verbs")]
mod verbs_transport;

use std::process::ExitCode;

/// Errors end the program with a message; none is expected to be handled.
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const USAGE: &str = "\
usage: ferrocomm-bench <benchmark> [options]

benchmarks:
  pingpong    ferrocomm vs NetPIPE ping-pong latency and throughput (NetPIPE method): NPtcp
              over TCP, NPopenmpi and NPmpich2 over shared memory (--transport shm);
              `ferrocomm-bench pingpong --help` for its options
  shm-transport
              the shared-memory transport alone (no engine, no futures): 8 B latency and
              bandwidth between two pinned processes; and the 8 B latency through the
              protocol engine driven by hand (no reactor, no futures)
  verbs-transport
              the verbs transport alone (build with --features verbs): 8 B latency of each
              eager path (rings, shared receive queue) between two pinned endpoints
  collectives ferrocomm vs Open MPI and MPICH collective latency (OSU method, shared memory);
              `ferrocomm-bench collectives --help` for its options
  burst       bursts of 8 B messages among 6 ranks over TCP: each backend in adaptive and
              blocking progress, alternated; `ferrocomm-bench burst --help`
  multicast   reliable multicast vs point-to-point: broadcast 8 B..1 MiB to 8 receivers, token
              vs dissemination barrier with one rank late; `ferrocomm-bench multicast --help`
  rma         one-sided put/get latency and bandwidth and fetch-add vs ucx_perftest over shared
              memory; fetch-add to one target vs spread; `ferrocomm-bench rma --help`
  sim-scale   collectives on the simulated network, 64 to 4,096 ranks, against the alpha-beta
              model of each algorithm; `ferrocomm-bench sim-scale --help`";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (command, rest) = match args.split_first() {
        Some((c, rest)) => (c.as_str(), rest),
        None => ("--help", &[][..]),
    };
    let result = match command {
        "pingpong" => pingpong::main(rest),
        "burst" => burst::main(rest),
        "collectives" => collectives::main(rest),
        coll_ranks::JOB_COMMAND => coll_ranks::job_main(rest),
        coll_ranks::RANK_COMMAND => coll_ranks::rank_main(rest),
        "multicast" => mcast::main(rest),
        "sim-scale" => sim_scale::main(rest),
        mcast::JOB_COMMAND => mcast::job_main(rest),
        mcast::RANK_COMMAND => mcast::rank_main(rest),
        ranks::JOB_COMMAND => ranks::job_main(rest),
        ranks::RANK_COMMAND => ranks::rank_main(rest),
        "rma" => rma::main(rest),
        rma::JOB_COMMAND => rma::job_main(rest),
        rma::RANK_COMMAND => rma::rank_main(rest),
        "shm-transport" => transport::main(rest),
        transport::RANK_COMMAND => transport::rank_main(rest),
        #[cfg(feature = "verbs")]
        "verbs-transport" => verbs_transport::main(rest),
        "-h" | "--help" | "help" => {
            println!("{USAGE}");
            Ok(())
        }
        other => {
            eprintln!("ferrocomm-bench: unknown benchmark {other:?}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferrocomm-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
