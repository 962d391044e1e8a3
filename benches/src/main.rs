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
//! [`ferrorun::run_local`], so each rank is its own process. Each rank pins itself to one
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
mod cli;
mod coll_ranks;
mod collectives;
mod hosts;
mod mcast;
mod mpi_pingpong;
mod netpipe;
mod osu;
mod perftest;
mod pingpong;
mod plot;
mod process;
mod rails;
mod ranks;
mod reference;
mod report;
mod rma;
mod rma_verbs;
mod sim_scale;
mod sweep;
mod transport;
mod ud_rc;
#[cfg(feature = "verbs")]
mod verbs_transport;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Errors end the program with a message; none is expected to be handled.
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// ferrocomm measured side by side with reference peers (NetPIPE, Open MPI, MPICH, perftest) on
/// the same machine, CPUs and message sizes. `ferrocomm-bench <benchmark> --help` for each
/// benchmark's options; sizes take `K`, `M` and `G` suffixes everywhere (`64K`, `8M`).
#[derive(Debug, Parser)]
#[command(name = "ferrocomm-bench", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    Pingpong(pingpong::Options),
    ShmTransport(transport::Options),
    #[cfg(feature = "verbs")]
    VerbsTransport(verbs_transport::Options),
    Collectives(collectives::Options),
    Hosts(hosts::Options),
    Burst(burst::Options),
    Multicast(mcast::Options),
    Rma(rma::Options),
    RmaVerbs(rma_verbs::Options),
    SimScale(sim_scale::Options),
    Rails(rails::Options),
    UdVsRc(ud_rc::Options),
    // The processes the benchmarks start: this binary again, with these hidden subcommands.
    #[command(name = ranks::JOB_COMMAND, hide = true)]
    PingpongJob(ranks::JobSpec),
    #[command(name = ranks::RANK_COMMAND, hide = true)]
    PingpongRank(ranks::JobSpec),
    #[command(name = perftest::STREAM_JOB, hide = true)]
    StreamJob(perftest::StreamSpec),
    #[command(name = perftest::STREAM_RANK, hide = true)]
    StreamRank(perftest::StreamSpec),
    #[command(name = coll_ranks::JOB_COMMAND, hide = true)]
    CollectivesJob(coll_ranks::JobSpec),
    #[command(name = coll_ranks::RANK_COMMAND, hide = true)]
    CollectivesRank(coll_ranks::JobSpec),
    #[command(name = hosts::JOB_COMMAND, hide = true)]
    HostsJob(coll_ranks::JobSpec),
    #[command(name = hosts::RANK_COMMAND, hide = true)]
    HostsRank(coll_ranks::JobSpec),
    #[command(name = mcast::JOB_COMMAND, hide = true)]
    MulticastJob(mcast::Options),
    #[command(name = mcast::RANK_COMMAND, hide = true)]
    MulticastRank(mcast::Options),
    #[command(name = transport::RANK_COMMAND, hide = true)]
    ShmTransportRank(transport::RankSpec),
    #[command(name = rma::JOB_COMMAND, hide = true)]
    RmaJob(rma::JobSpec),
    #[command(name = rma::RANK_COMMAND, hide = true)]
    RmaRank(rma::JobSpec),
    #[command(name = rails::RANK_COMMAND, hide = true)]
    RailsRank(rails::RankSpec),
    #[command(name = ud_rc::JOB_COMMAND, hide = true)]
    UdVsRcJob(ud_rc::JobSpec),
    #[command(name = ud_rc::RANK_COMMAND, hide = true)]
    UdVsRcRank(ud_rc::JobSpec),
}

fn main() -> ExitCode {
    let result = match Cli::parse().command {
        Command::Pingpong(o) => pingpong::main(o),
        Command::ShmTransport(o) => transport::main(o),
        #[cfg(feature = "verbs")]
        Command::VerbsTransport(o) => verbs_transport::main(o),
        Command::Collectives(o) => collectives::main(o),
        Command::Hosts(o) => hosts::main(o),
        Command::Burst(o) => burst::main(o),
        Command::Multicast(o) => mcast::main(o),
        Command::Rma(o) => rma::main(o),
        Command::RmaVerbs(o) => rma_verbs::main(o),
        Command::SimScale(o) => sim_scale::main(o),
        Command::Rails(o) => rails::main(o),
        Command::UdVsRc(o) => ud_rc::main(o),
        Command::UdVsRcJob(s) => ud_rc::job_main(s),
        Command::UdVsRcRank(s) => ud_rc::rank_main(s),
        Command::RailsRank(s) => rails::rank_main(s),
        Command::PingpongJob(s) => ranks::job_main(s),
        Command::PingpongRank(s) => ranks::rank_main(s),
        Command::StreamJob(s) => perftest::stream_job_main(s),
        Command::StreamRank(s) => perftest::stream_rank_main(s),
        Command::CollectivesJob(s) => coll_ranks::job_main(s),
        Command::CollectivesRank(s) => coll_ranks::rank_main(s),
        Command::HostsJob(s) => hosts::job_main(s),
        Command::HostsRank(s) => hosts::rank_main(s),
        Command::MulticastJob(o) => mcast::job_main(o),
        Command::MulticastRank(o) => mcast::rank_main(o),
        Command::ShmTransportRank(s) => transport::rank_main(s),
        Command::RmaJob(s) => rma::job_main(s),
        Command::RmaRank(s) => rma::rank_main(s),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ferrocomm-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    /// The command line is consistent (no clashing flags, defaults that parse).
    #[test]
    fn command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    /// Parses `line` (without the program name) into its command.
    pub(crate) fn parse(line: &str) -> std::result::Result<Command, clap::Error> {
        Cli::try_parse_from(std::iter::once("ferrocomm-bench").chain(line.split_whitespace())).map(|c| c.command)
    }

    /// The command lines of scripts/bench.sh and scripts/verbs-vm.sh (variables filled in), and
    /// those the docs show.
    #[test]
    fn the_scripts_command_lines_parse() {
        let ops = "barrier,bcast,reduce,allreduce,gather,scatter,allgather,alltoall,reduce_scatter,scan";
        for line in [
            "pingpong --transport shm --progress busy --runs 3 --recv-into --max 4M --json a.json --plot a.svg".to_string(),
            "pingpong --backend uring --runs 3 --recv-into --max 4M --json c.json --plot c.svg".into(),
            "pingpong --backend portable --runs 3 --recv-into --max 4M --json c.json --plot c.svg".into(),
            "pingpong --slices 5 --slice-sizes 0 --peers NPtcp,openmpi-tcp,NPopenmpi-tcp --max 64K".into(),
            format!("collectives --ranks 2 --runs 3 --mpi openmpi --ops {ops} --max 4M --json d.json --plot d.svg"),
            format!(
                "collectives --ranks 4 --runs 3 --mpi openmpi --iters 100 --warmup 20 --iters-large 20 --warmup-large 5 \
                 --ops {ops} --max 4M --json e.json --plot e.svg"
            ),
            "collectives --slices 3 --slice-ops 0 --ops bcast,scan".into(),
            "multicast --json f.json --plot f.svg".into(),
            "collectives --sweep --ranks 4 --step 2 --runs 3".into(),
            "pingpong --transport shm --runs 10 --recv-into --send-from --max 8 --target-ms 100 --idle-gap 0 --no-peer".into(),
            "sim-scale --json results/sim-scale.json --text results/sim-scale.txt".into(),
            "sim-scale --ranks 64,4096 --sizes 8,64K,1M --ops bcast,mcast --max-bytes 4G --no-crossover".into(),
            "rma --cpus 0,1 --runs 3 --atomic-ranks 4 --transports tcp --no-peer --json r.json".into(),
            "burst --ranks 6 --messages 2500 --runs 5 --json b.json".into(),
            "rma-verbs --runs 3 --json rv.json".into(),
            "shm-transport --cpus 0,1 --cma auto --message 4M --json s.json".into(),
            "multicast --transports tcp --json g.json --plot g.svg".into(),
            "pingpong --transport verbs --progress blocking --recv-into --runs 3 --max 4M --target-ms 300 --json h.json \
             --plot h.svg"
                .into(),
        ] {
            assert!(parse(&line).is_ok(), "{line}: {}", parse(&line).unwrap_err());
        }
        // verbs-vm.sh's transport-alone run exists with the feature only.
        assert_eq!(parse("verbs-transport --json v.json").is_ok(), cfg!(feature = "verbs"));
    }

    #[test]
    fn unknown_benchmarks_and_options_are_refused() {
        assert!(parse("frobnicate").is_err());
        assert!(parse("pingpong --frobnicate").is_err());
        assert!(parse("").is_err());
    }
}
