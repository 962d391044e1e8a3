//! Choosing an algorithm by operation, message size and rank count.
//!
//! Latency-bound algorithms (binomial, recursive doubling, Bruck) win below the thresholds,
//! bandwidth-bound ones (scatter + all-gather, Rabenseifner, ring, pairwise) above. Any operation can
//! be pinned to one algorithm with the `FERROCOMM_COLL` setting, e.g.
//! `allreduce=ring,bcast=binomial`; an algorithm that cannot serve a call (a non-commutative operator
//! on the ring, recursive-doubling all-gather on a non-power of two) falls back to the table's
//! order-preserving choice.
//!
//! The thresholds of [`Table::default`] are the sizes where one algorithm stops beating the next,
//! on a 2-CPU machine with 2 and 4 ranks over shared memory, busy-polling. The message-based ones
//! come from pinning each algorithm in turn; the board's limits ([`Table::shared_limit`]) and the
//! single-copy thresholds ([`Table::single_copy_from`]) from the same runs with the operation
//! pinned to `shared-memory` or `single-copy` against the table without them:
//!
//! ```sh
//! target/release/ferrocomm-bench collectives --sweep --ranks 2,4 --step 2 --runs 3
//! target/release/ferrocomm-bench collectives --ranks 2,4 --no-mpi --step 2 --env FERROCOMM_COLL=bcast=single-copy
//! ```
//!
//! With 4 ranks on 2 CPUs those figures are oversubscribed; re-measure on the target machine
//! (scatter + all-gather broadcast is expected to win at large sizes with more ranks).

use std::fmt;
use std::str::FromStr;

/// The collective operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operation {
    /// Every rank waits for all.
    Barrier,
    /// The root's data to every rank.
    Bcast,
    /// Every rank's data combined at the root.
    Reduce,
    /// Every rank's data combined, the result at every rank.
    Allreduce,
    /// Every rank's block to the root.
    Gather,
    /// One block of the root's to each rank.
    Scatter,
    /// Every rank's block to every rank.
    Allgather,
    /// Block `j` of rank `i` to rank `j`, for all pairs.
    Alltoall,
    /// Every rank's data combined, then cut into one block per rank.
    ReduceScatter,
    /// Inclusive prefix reduction in rank order.
    Scan,
}

impl Operation {
    /// Every operation, in declaration order (`op as usize` indexes it).
    pub const ALL: [Operation; 10] = {
        use Operation::*;
        [Barrier, Bcast, Reduce, Allreduce, Gather, Scatter, Allgather, Alltoall, ReduceScatter, Scan]
    };
}

const _: () = {
    let mut i = 0;
    while i < Operation::ALL.len() {
        assert!(Operation::ALL[i] as usize == i, "Operation::ALL is in declaration order");
        i += 1;
    }
};

/// Every algorithm of the menu. Which operations each serves is in [`Algorithm::serves`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Algorithm {
    /// Straight to or from one rank (or each pair): n-1 messages at one rank.
    Linear,
    /// Dissemination: ceil(log2 n) rounds of one message each (barrier).
    Dissemination,
    /// A binomial tree: ceil(log2 n) rounds.
    Binomial,
    /// Broadcast as a binomial scatter then a ring allgather (large messages).
    ScatterAllgather,
    /// Broadcast down a chain of ranks in segments, every link busy at once (large messages).
    Pipeline,
    /// Recursive doubling: ceil(log2 n) pairwise exchange rounds.
    RecursiveDoubling,
    /// Rabenseifner's allreduce: recursive-halving reduce-scatter, recursive-doubling allgather.
    Rabenseifner,
    /// A ring: n-1 rounds between neighbours (bandwidth-optimal for large messages).
    Ring,
    /// Bruck's algorithm: ceil(log2 n) rounds of rotated blocks.
    Bruck,
    /// Pairwise exchange: in step s, send to r+s and receive from r-s.
    Pairwise,
    /// A reduce to rank 0, then a scatter of the result.
    ReduceThenScatter,
    /// Node-leader hierarchy (intra-node step over shared memory, leaders over the network).
    Hierarchical,
    /// Reliable multicast (when a multicast group is confirmed).
    Multicast,
    /// Flags and data on a board in shared memory (every rank on one host; see [`crate::shared`]).
    SharedMemory,
    /// Each rank copies straight from the others' memory (cross-memory attach), synchronised on
    /// the shared-memory board (every rank on one host; see [`crate::shared`]).
    SingleCopy,
    /// Each rank RDMA-writes its blocks straight into the peers' registered receive buffers,
    /// then a completion flag (every member reached over verbs; all-gather and all-to-all).
    Rdma,
}

impl Algorithm {
    /// Every algorithm, in declaration order.
    pub const ALL: [Algorithm; 16] = [
        Algorithm::Linear,
        Algorithm::Dissemination,
        Algorithm::Binomial,
        Algorithm::ScatterAllgather,
        Algorithm::Pipeline,
        Algorithm::RecursiveDoubling,
        Algorithm::Rabenseifner,
        Algorithm::Ring,
        Algorithm::Bruck,
        Algorithm::Pairwise,
        Algorithm::ReduceThenScatter,
        Algorithm::Hierarchical,
        Algorithm::Multicast,
        Algorithm::SharedMemory,
        Algorithm::SingleCopy,
        Algorithm::Rdma,
    ];

    /// The flat (non-hierarchical) algorithms implemented for `op`.
    pub fn for_operation(op: Operation) -> &'static [Algorithm] {
        use Algorithm::*;
        match op {
            Operation::Barrier => &[Dissemination, Linear],
            Operation::Bcast => &[Binomial, ScatterAllgather, Pipeline, Linear],
            Operation::Reduce => &[Binomial, Linear],
            Operation::Allreduce => &[RecursiveDoubling, Rabenseifner, Ring, Linear],
            Operation::Gather | Operation::Scatter => &[Binomial, Linear],
            Operation::Allgather => &[Bruck, RecursiveDoubling, Ring, Linear],
            Operation::Alltoall => &[Bruck, Pairwise, Linear],
            Operation::ReduceScatter => &[Ring, ReduceThenScatter],
            Operation::Scan => &[RecursiveDoubling],
        }
    }

    /// Whether this is one of the flat algorithms implemented for `op`.
    pub fn serves(self, op: Operation) -> bool {
        Algorithm::for_operation(op).contains(&self)
    }

    /// The operations the shared-memory board serves (every rank on one host).
    pub fn shared_memory_serves(op: Operation) -> bool {
        matches!(
            op,
            Operation::Barrier
                | Operation::Bcast
                | Operation::Reduce
                | Operation::Allreduce
                | Operation::Allgather
                | Operation::Alltoall
                | Operation::Gather
                | Operation::Scatter
                | Operation::ReduceScatter
                | Operation::Scan
        )
    }

    /// The operations served by single copy (every rank on one host).
    pub fn single_copy_serves(op: Operation) -> bool {
        matches!(
            op,
            Operation::Bcast
                | Operation::Allreduce
                | Operation::Reduce
                | Operation::Allgather
                | Operation::Alltoall
                | Operation::Gather
                | Operation::Scatter
                | Operation::ReduceScatter
                | Operation::Scan
        )
    }

    /// The operations served by RDMA writes into the peers' buffers (every member over verbs).
    pub fn rdma_serves(op: Operation) -> bool {
        matches!(op, Operation::Allgather | Operation::Alltoall)
    }
}

impl fmt::Display for Algorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Algorithm::Linear => "linear",
            Algorithm::Dissemination => "dissemination",
            Algorithm::Binomial => "binomial",
            Algorithm::ScatterAllgather => "scatter-allgather",
            Algorithm::Pipeline => "pipeline",
            Algorithm::RecursiveDoubling => "recursive-doubling",
            Algorithm::Rabenseifner => "rabenseifner",
            Algorithm::Ring => "ring",
            Algorithm::Bruck => "bruck",
            Algorithm::Pairwise => "pairwise",
            Algorithm::ReduceThenScatter => "reduce-scatter-linear",
            Algorithm::Hierarchical => "hierarchical",
            Algorithm::Multicast => "multicast",
            Algorithm::SharedMemory => "shared-memory",
            Algorithm::SingleCopy => "single-copy",
            Algorithm::Rdma => "rdma",
        };
        f.write_str(s)
    }
}

impl FromStr for Algorithm {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Algorithm::ALL.into_iter().find(|a| a.to_string() == s).ok_or_else(|| format!("unknown algorithm {s:?}"))
    }
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Operation::Barrier => "barrier",
            Operation::Bcast => "bcast",
            Operation::Reduce => "reduce",
            Operation::Allreduce => "allreduce",
            Operation::Gather => "gather",
            Operation::Scatter => "scatter",
            Operation::Allgather => "allgather",
            Operation::Alltoall => "alltoall",
            Operation::ReduceScatter => "reduce_scatter",
            Operation::Scan => "scan",
        })
    }
}

impl FromStr for Operation {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Operation::ALL.into_iter().find(|o| o.to_string() == s).ok_or_else(|| format!("unknown collective {s:?}"))
    }
}

/// What a call looks like to the selector.
#[derive(Clone, Copy, Debug)]
pub struct Call {
    /// The operation.
    pub op: Operation,
    /// Ranks in the communicator.
    pub ranks: u32,
    /// Bytes per rank: the vector for reductions and broadcast, one rank's block otherwise.
    pub bytes: usize,
    /// Whether the reduction operator is commutative (true when there is none).
    pub commutative: bool,
}

/// The selection table: size thresholds plus per-operation overrides.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    /// Broadcast switches from binomial to scatter + all-gather at this size (with >= 4 ranks),
    /// where the members are not known to span hosts (across hosts the pipelined chain takes
    /// every size from [`Table::bcast_pipeline`]: see [`crate::plan::choose`]).
    pub bcast_large: usize,
    /// Across hosts (not every member on this one), broadcast switches from binomial to the
    /// pipelined chain ([`Algorithm::Pipeline`]) at this size, at every larger size (on 3 to
    /// [`Table::bcast_chain_ranks`] ranks; see [`crate::plan::choose`]), in
    /// [`Table::bcast_chain_segments`] segments. With 4 ranks on 2 CPUs, each a host of its own
    /// over TCP, against Open MPI's TCP BTL in the same invocation (`ferrocomm-bench hosts --ops
    /// bcast --sizes 256K,512K,1M,2M,4M` pinning `bcast=pipeline` at several segment sizes, and
    /// `bcast=binomial`; 3 invocations of 3 runs, loaded): the chain in one or two segments took
    /// 1.06-1.25x Open MPI's time at 1 MiB, 1.17-1.53x at 2 MiB and 1.26-1.54x at 4 MiB, where
    /// 64 KiB segments took 1.26-1.40x, 1.70-2.45x and 2.20-2.63x, binomial 1.18-2.10x,
    /// 1.36-2.08x and 1.43-1.75x, and scatter + all-gather 3.2-4.0x at 1 MiB. Every segment
    /// passes between ranks that take turns on a CPU, so on such a host many segments cost more
    /// hand-overs than their overlap gains; Open MPI's own table takes an unsegmented chain for 4
    /// to 7 ranks from 1 MiB.
    pub bcast_pipeline: usize,
    /// The pipelined chain serves up to this many ranks; more go by [`Table::choose`] (binomial,
    /// scatter + all-gather from [`Table::bcast_large`]). An unsegmented chain
    /// ([`Table::bcast_chain_segments`]) of n ranks passes the whole data n - 1 times one after
    /// the other, where a binomial tree takes ceil(log2 n) steps: 7 against 3 on 8 ranks. Open
    /// MPI's table takes the unsegmented chain on 4 to 7 ranks, as this one does.
    pub bcast_chain_ranks: u32,
    /// The pipelined chain's smallest segment (see [`Table::bcast_segment_for`]).
    pub bcast_segment: usize,
    /// How many segments the pipelined chain cuts a broadcast into, each at least
    /// [`Table::bcast_segment`] long (see [`Table::bcast_segment_for`]). Segments above the
    /// eager limit go by rendezvous; their receives are posted ahead
    /// ([`crate::schedule::Machine::with_lookahead`]), so each lands in place as it comes.
    ///
    /// One: the whole data down the chain, as Open MPI's table does on 4 to 7 ranks. With 4
    /// ranks on 2 CPUs, each a host of its own over TCP, one segment took 0.88-1.05x Open MPI's
    /// time at 1 MiB where two took 1.11-1.33x and four 1.31-1.52x (3 and 2 invocations), and at
    /// 2 and 4 MiB one took 0.97x and 0.90x where two took 1.38x and 1.00x (`ferrocomm-bench
    /// hosts --runs 3 --ops bcast --sizes 1M` and `2M`, `4M`, the segment count forced; each
    /// figure one invocation's median ratio, loaded, no LTO): each segment is one more hand-over between ranks that take turns on a
    /// CPU, which costs more than the overlap of the chain's links gains.
    pub bcast_chain_segments: u32,
    /// All-reduce switches from recursive doubling to Rabenseifner at this size.
    pub allreduce_large: usize,
    /// ... and from Rabenseifner to the ring at this size.
    pub allreduce_ring: usize,
    /// All-gather switches from Bruck to the ring at this total size.
    pub allgather_large: usize,
    /// All-to-all uses Bruck up to this block size, pairwise exchange above.
    pub alltoall_small: usize,
    /// Groups up to this size use the linear algorithms for gather and scatter.
    pub linear_ranks: u32,
    /// All-gather and all-to-all up to this many bytes (per rank; a block for all-to-all) use the
    /// shared-memory board when every rank of the communicator is on one host and the ranks
    /// busy-poll (barrier always does); see [`Table::shared_limit`].
    pub shared_max: usize,
    /// ... broadcast up to this many: on 2 ranks the board takes 0.50x, 0.64x and 0.67x Open
    /// MPI's time at 16, 32 and 64 KiB where the binomial tree takes 1.03x, 1.32x and 1.17x (one
    /// quiet run each, `ferrocomm-bench collectives --ranks 2 --ops bcast --max 128K --step 2`,
    /// default and `FERROCOMM_COLL=bcast=binomial`; single copy from 128 KiB); on 4 it is
    /// 0.4-0.6x at 32 KiB ...
    pub shared_bcast_max: usize,
    /// ... all-reduce up to this many: on 2 ranks the board beats recursive doubling up to 32 KiB
    /// (0.4-0.6x Open MPI at 16-32 KiB, loaded, against 1.4x by messages), on 4 it is 0.4x at
    /// 32 KiB ...
    pub shared_allreduce_max: usize,
    /// ... reduce up to this many ...
    pub shared_reduce_max: usize,
    /// ... gather and scatter up to this many (a rank's block) ...
    pub shared_rooted_max: usize,
    /// ... reduce-scatter and scan up to this many (the whole vector) ...
    pub shared_scan_max: usize,
    /// ... and reduce-scatter on 2 ranks up to this many (the whole vector, at most the board's
    /// capacity on 2 ranks): there each rank posts only the other's half of the vector and
    /// combines the other's post with its own half. With 8, 16 and 32 KiB blocks (16-64 KiB
    /// vectors) the board took 4.2-6.4, 5.8-10.7 and 42-53 us where single copy took 12-14,
    /// 22-26 and 71-84 us (`ferrocomm-bench collectives-job --ranks 2 -o reduce_scatter -s
    /// 8192,16384,32768`, default and `FERROCOMM_COLL=reduce_scatter=single-copy`, three runs
    /// each, loaded, no LTO: `reduce_scatter_block`, which returns a new vector and so lends a
    /// copy by single copy), and 0.25-0.33x Open MPI's time at 8 KiB blocks where the ring took
    /// 0.46-0.56x (`ferrocomm-bench collectives --ranks 2 --runs 7 --ops reduce_scatter --max
    /// 32K`, two invocations each, loaded). Into a buffer (`reduce_scatter_block_into`, single
    /// copy reading the callers' data in place) the board took 0.29-0.52x Open MPI's time at
    /// 8 KiB blocks and 0.43-0.85x at 32 KiB, single copy 0.80-0.83x and 0.43-0.61x (the same
    /// command with `--runs 5`, and `--env FERROCOMM_COLL=reduce_scatter=single-copy`, two
    /// invocations each, loaded). Single copy takes over right above (see
    /// [`Table::single_copy_from`]).
    pub shared_reduce_scatter_pair_max: usize,
    /// Broadcast from this many bytes copies straight from the root's memory
    /// ([`Algorithm::SingleCopy`]) under the same conditions as the board ...
    pub single_copy_min: usize,
    /// ... all-reduce from this many: right above the board's limit, where single copy meets
    /// Open MPI on 2 and 4 ranks (0.4-0.9x from 64 KiB, loaded) and the message-based
    /// algorithms do not (recursive doubling 1.5x at 128 KiB on 2 ranks, Rabenseifner 2x on 4) ...
    pub single_copy_allreduce_min: usize,
    /// ... reduce, all-gather and all-to-all (a rank's block) from this many: right above the
    /// board's limit (a reduce's board goes on to [`Table::shared_reduce_max`]), where single copy
    /// meets Open MPI on 2 and 4 ranks (all-gather and all-to-all 0.4-1.0x from 16 KiB, loaded)
    /// and the ring and pairwise exchange do not (1.3-3.3x at 32-128 KiB) ...
    pub single_copy_gather_min: usize,
    /// ... gather (a rank's block) from this many ...
    pub single_copy_rooted_min: usize,
    /// ... scatter (a rank's block) from this many: right above the board's limit, where each
    /// rank's copy of its block from the root's memory meets Open MPI on 2 and 4 ranks (0.4-0.8x
    /// from 16 KiB, loaded) and the linear and binomial scatters do not (2.5x and 7.7x at
    /// 32 KiB) ...
    pub single_copy_scatter_min: usize,
    /// ... and reduce-scatter and scan (the whole vector) from this many; see
    /// [`Table::single_copy_from`].
    pub single_copy_scan_min: usize,
    /// Broadcast goes by reliable multicast on more than this many ranks, where a multicast
    /// group serves the communicator ([`crate::plan::Topology::multicast`]): the rank count above
    /// which the simulated network has multicast beat a binomial broadcast
    /// (`ferrocomm-bench sim-scale`; [`MULTICAST_BCAST_RANKS`]).
    pub multicast_bcast_ranks: u32,
    /// ... for broadcasts up to this many bytes.
    pub multicast_bcast_max: usize,
    /// All-gather and all-to-all from this many bytes (a rank's block) RDMA-write straight into
    /// the peers' buffers ([`Algorithm::Rdma`]) when every member is reached over verbs.
    pub rdma_min: usize,
    /// Operations pinned to one algorithm.
    pub overrides: Overrides,
}

/// The rank count above which a broadcast by reliable multicast finishes before a binomial one
/// on the simulated network (10 Gbit/s links of 2 us, 1400-byte datagrams, the default protocol
/// settings), for every size up to [`MULTICAST_BCAST_MAX`] (and on to 1 MiB): `ferrocomm-bench sim-scale` prints
/// it, and the `ferrocomm-sim` test `the_selection_tables_crossover_holds_on_the_simulated_network`
/// checks it.
pub const MULTICAST_BCAST_RANKS: u32 = 2;
/// The largest broadcast that goes by multicast. The simulated network has multicast winning up
/// to 1 MiB, but on real hosts every receiver copies and checks each datagram while TCP moves
/// 64 KiB per segment: over loopback TCP (`ferrocomm-bench multicast --transports tcp`, 9 ranks on
/// 2 CPUs, `results/multicast-tcp.txt`) multicast wins at every size up to 8 KiB in the median of
/// the bench runs (1.3-2.5x the binomial broadcast's speed) and loses from 32 KiB (0.9x; single
/// runs place the crossover anywhere from 4 to 300 KiB), so the table stops at 16 KiB.
pub const MULTICAST_BCAST_MAX: usize = 16 << 10;

/// Operations pinned to one algorithm: a slot per operation. Looked up several times per call, so
/// it is an array, not a hash map (whose SipHash showed in profiles of small calls: about 350
/// instructions of a broadcast's 4,500).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides([Option<Algorithm>; Operation::ALL.len()]);

impl Overrides {
    /// The algorithm `op` is pinned to.
    pub fn get(&self, op: &Operation) -> Option<&Algorithm> {
        self.0[*op as usize].as_ref()
    }

    /// Pins `op` to `alg`; returns what it was pinned to before.
    pub fn insert(&mut self, op: Operation, alg: Algorithm) -> Option<Algorithm> {
        self.0[op as usize].replace(alg)
    }

    /// Whether `op` is pinned.
    pub fn contains_key(&self, op: &Operation) -> bool {
        self.0[*op as usize].is_some()
    }
}

impl Default for Table {
    fn default() -> Table {
        Table {
            bcast_large: 2 << 20,
            bcast_pipeline: 256 << 10,
            bcast_chain_ranks: 7,
            bcast_segment: 64 << 10,
            bcast_chain_segments: 1,
            allreduce_large: 64 << 10,
            allreduce_ring: 2 << 20,
            allgather_large: 64 << 10,
            alltoall_small: 8 << 10,
            linear_ranks: 2,
            shared_max: 8 << 10,
            shared_bcast_max: 64 << 10,
            shared_allreduce_max: 32 << 10,
            shared_reduce_max: 32 << 10,
            shared_rooted_max: 8 << 10,
            shared_scan_max: 8 << 10,
            shared_reduce_scatter_pair_max: 64 << 10,
            single_copy_min: 64 << 10,
            single_copy_allreduce_min: (32 << 10) + 1,
            single_copy_gather_min: (8 << 10) + 1,
            single_copy_rooted_min: 64 << 10,
            single_copy_scatter_min: (8 << 10) + 1,
            single_copy_scan_min: 64 << 10,
            multicast_bcast_ranks: MULTICAST_BCAST_RANKS,
            multicast_bcast_max: MULTICAST_BCAST_MAX,
            rdma_min: 128 << 10,
            overrides: Overrides::default(),
        }
    }
}

impl Table {
    /// Applies `op=algorithm,...` overrides (the `FERROCOMM_COLL` setting).
    pub fn with_overrides(mut self, spec: &str) -> Result<Table, String> {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (op, alg) = item.split_once('=').ok_or_else(|| format!("expected op=algorithm, got {item:?}"))?;
            let (op, alg): (Operation, Algorithm) = (op.trim().parse()?, alg.trim().parse()?);
            let special = matches!(alg, Algorithm::Hierarchical | Algorithm::Multicast)
                || (alg == Algorithm::SharedMemory && Algorithm::shared_memory_serves(op))
                || (alg == Algorithm::SingleCopy && Algorithm::single_copy_serves(op))
                || (alg == Algorithm::Rdma && Algorithm::rdma_serves(op));
            if !alg.serves(op) && !special {
                return Err(format!("{alg} does not implement {op}"));
            }
            self.overrides.insert(op, alg);
        }
        Ok(self)
    }

    /// Up to how many bytes (per rank) `op` uses the shared-memory board by default, where it
    /// can (the same on every rank count the board serves, but reduce-scatter's on 2 ranks).
    pub fn shared_limit(&self, op: Operation, ranks: u32) -> usize {
        match op {
            Operation::ReduceScatter if ranks == 2 => self.shared_reduce_scatter_pair_max,
            Operation::Barrier => usize::MAX,
            Operation::Bcast => self.shared_bcast_max,
            Operation::Allreduce => self.shared_allreduce_max,
            Operation::Reduce => self.shared_reduce_max,
            Operation::Gather | Operation::Scatter => self.shared_rooted_max,
            Operation::ReduceScatter | Operation::Scan => self.shared_scan_max,
            _ if Algorithm::shared_memory_serves(op) => self.shared_max,
            _ => 0,
        }
    }

    /// From how many bytes (per rank) `op` copies straight from the other ranks' memory by
    /// default, where it can (`usize::MAX`: never; the same on every rank count, but
    /// reduce-scatter's on 2 ranks, right above its board's limit).
    pub fn single_copy_from(&self, op: Operation, ranks: u32) -> usize {
        match op {
            Operation::ReduceScatter if ranks == 2 => {
                self.single_copy_scan_min.max(self.shared_reduce_scatter_pair_max.saturating_add(1))
            }
            Operation::Bcast => self.single_copy_min,
            Operation::Allreduce => self.single_copy_allreduce_min,
            Operation::Reduce | Operation::Allgather | Operation::Alltoall => self.single_copy_gather_min,
            Operation::Gather => self.single_copy_rooted_min,
            Operation::Scatter => self.single_copy_scatter_min,
            Operation::ReduceScatter | Operation::Scan => self.single_copy_scan_min,
            _ => usize::MAX,
        }
    }

    /// The pipelined chain's segment for a broadcast of `bytes`: [`Table::bcast_chain_segments`]
    /// pieces, but none shorter than [`Table::bcast_segment`].
    pub fn bcast_segment_for(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.bcast_chain_segments.max(1) as usize).max(self.bcast_segment).max(1)
    }

    /// The algorithm for a call: the override if it can serve the call, else the table's choice.
    pub fn choose(&self, c: Call) -> Algorithm {
        if let Some(&a) = self.overrides.get(&c.op)
            && usable(a, c)
        {
            return a;
        }
        self.by_size(c)
    }

    fn by_size(&self, c: Call) -> Algorithm {
        use Algorithm::*;
        match c.op {
            Operation::Barrier => Dissemination,
            Operation::Bcast if c.bytes >= self.bcast_large && c.ranks >= 4 => ScatterAllgather,
            Operation::Bcast => Binomial,
            Operation::Reduce => Binomial,
            Operation::Allreduce if !c.commutative => RecursiveDoubling,
            Operation::Allreduce if c.bytes >= self.allreduce_ring && c.ranks > 2 => Ring,
            Operation::Allreduce if c.bytes >= self.allreduce_large && c.ranks > 2 => Rabenseifner,
            Operation::Allreduce => RecursiveDoubling,
            Operation::Gather | Operation::Scatter if c.ranks <= self.linear_ranks => Linear,
            Operation::Gather | Operation::Scatter => Binomial,
            Operation::Allgather if c.bytes.saturating_mul(c.ranks as usize) >= self.allgather_large => Ring,
            Operation::Allgather => Bruck,
            Operation::Alltoall if c.bytes <= self.alltoall_small => Bruck,
            Operation::Alltoall => Pairwise,
            Operation::ReduceScatter if c.commutative => Ring,
            Operation::ReduceScatter => ReduceThenScatter,
            Operation::Scan => RecursiveDoubling,
        }
    }
}

/// Whether `a` can serve call `c`.
pub fn usable(a: Algorithm, c: Call) -> bool {
    use Algorithm::*;
    let order_safe = c.commutative || !matches!((c.op, a), (Operation::Allreduce, Rabenseifner | Ring));
    let shape_ok = !(c.op == Operation::Allgather && a == RecursiveDoubling && !c.ranks.is_power_of_two());
    let rs_ok = !(c.op == Operation::ReduceScatter && a == Ring && !c.commutative);
    a.serves(c.op) && order_safe && shape_ok && rs_ok
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_parse_and_fall_back() {
        let t = Table::default().with_overrides("allreduce=ring, bcast=binomial").unwrap();
        let call = Call { op: Operation::Allreduce, ranks: 5, bytes: 8, commutative: true };
        assert_eq!(t.choose(call), Algorithm::Ring);
        assert_eq!(t.choose(Call { commutative: false, ..call }), Algorithm::RecursiveDoubling);
        assert!(Table::default().with_overrides("allreduce=bruck").is_err());
        assert!(Table::default().with_overrides("frobnicate=ring").is_err());
        assert!(Table::default().with_overrides("bcast").is_err());
        for op in [Operation::Barrier, Operation::Scan] {
            for a in Algorithm::for_operation(op) {
                assert_eq!(a.to_string().parse::<Algorithm>().unwrap(), *a);
            }
        }
    }

    #[test]
    fn sizes_switch_algorithms() {
        let t = Table::default();
        let c = |op, bytes| Call { op, ranks: 8, bytes, commutative: true };
        assert_eq!(t.choose(c(Operation::Allreduce, 8)), Algorithm::RecursiveDoubling);
        assert_eq!(t.choose(c(Operation::Allreduce, 32 << 10)), Algorithm::RecursiveDoubling);
        assert_eq!(t.choose(c(Operation::Allreduce, 64 << 10)), Algorithm::Rabenseifner);
        assert_eq!(t.choose(c(Operation::Allreduce, 8 << 20)), Algorithm::Ring);
        assert_eq!(t.choose(c(Operation::Bcast, 1 << 20)), Algorithm::Binomial);
        assert_eq!(t.choose(c(Operation::Bcast, 4 << 20)), Algorithm::ScatterAllgather);
        assert!(Table::default().with_overrides("bcast=pipeline").is_ok());
        // The chain's segment: the whole data, none below the smallest segment.
        let min = t.bcast_segment;
        assert_eq!((min, t.bcast_chain_segments), (64 << 10, 1));
        assert_eq!(t.bcast_segment_for(1 << 20), 1 << 20);
        assert_eq!(t.bcast_segment_for(t.bcast_pipeline), t.bcast_pipeline);
        // In two pieces, none below the smallest segment: the switch from the smallest segment
        // to half the data is at twice the smallest.
        let two = Table { bcast_chain_segments: 2, ..Table::default() };
        assert_eq!(two.bcast_segment_for(0), min);
        assert_eq!(two.bcast_segment_for(8), min);
        assert_eq!(two.bcast_segment_for(2 * min), min);
        assert_eq!(two.bcast_segment_for(2 * min + 2), min + 1);
        assert_eq!(two.bcast_segment_for(1 << 20), 512 << 10);
        assert_eq!(two.bcast_segment_for((4 << 20) + 1), (2 << 20) + 1);
        let none = Table { bcast_chain_segments: 0, bcast_segment: 0, ..Table::default() };
        assert_eq!((none.bcast_segment_for(0), none.bcast_segment_for(5)), (1, 5));
        assert!(Table::default().with_overrides("allreduce=pipeline").is_err());
        assert_eq!(t.choose(c(Operation::Alltoall, 8)), Algorithm::Bruck);
        assert_eq!(t.choose(c(Operation::Alltoall, 4096)), Algorithm::Bruck);
        assert_eq!(t.choose(c(Operation::Alltoall, 16384)), Algorithm::Pairwise);
        // The board's limits (where the communicator can use it).
        assert_eq!(t.shared_limit(Operation::Barrier, 2), usize::MAX);
        assert_eq!(t.shared_limit(Operation::Bcast, 2), 64 << 10);
        assert_eq!(t.shared_limit(Operation::Bcast, 4), 64 << 10);
        assert_eq!(t.shared_limit(Operation::Allreduce, 4), 32 << 10);
        assert_eq!(t.shared_limit(Operation::Allreduce, 2), 32 << 10);
        assert_eq!(t.shared_limit(Operation::Allgather, 4), 8 << 10);
        assert_eq!(t.shared_limit(Operation::Reduce, 2), 32 << 10);
        assert_eq!(t.shared_limit(Operation::Alltoall, 2), 8 << 10);
        assert_eq!(t.shared_limit(Operation::Gather, 4), 8 << 10);
        assert_eq!(t.shared_limit(Operation::Scan, 4), 8 << 10);
        assert!(Table::default().with_overrides("alltoall=shared-memory").is_ok());
        assert!(Table::default().with_overrides("gather=shared-memory,scan=shared-memory").is_ok());
        assert!(Table::default().with_overrides("allreduce=single-copy").is_ok());
        assert_eq!(t.single_copy_from(Operation::Bcast, 4), 64 << 10);
        // Single copy takes over right above the board's limit, except for gather.
        for ranks in [2, 3, 4] {
            for op in [Operation::Allreduce, Operation::Allgather, Operation::Alltoall, Operation::Scatter] {
                assert_eq!(t.single_copy_from(op, ranks), t.shared_limit(op, ranks) + 1, "{op} on {ranks}");
            }
        }
        assert_eq!(t.single_copy_from(Operation::Allreduce, 2), (32 << 10) + 1);
        assert_eq!(t.single_copy_from(Operation::Alltoall, 3), (8 << 10) + 1);
        assert_eq!(t.single_copy_from(Operation::Scatter, 4), (8 << 10) + 1);
        assert_eq!(t.single_copy_from(Operation::Gather, 3), 64 << 10);
        // A reduce-scatter on 2 ranks keeps the board up to 64 KiB (the whole vector), single
        // copy right above; on more ranks the board up to 8 KiB, single copy from 64 KiB.
        assert_eq!(t.shared_limit(Operation::ReduceScatter, 2), 64 << 10);
        assert_eq!(t.single_copy_from(Operation::ReduceScatter, 2), (64 << 10) + 1);
        assert_eq!(t.shared_limit(Operation::ReduceScatter, 3), 8 << 10);
        assert_eq!(t.single_copy_from(Operation::ReduceScatter, 4), 64 << 10);
        assert_eq!(t.single_copy_from(Operation::Barrier, 3), usize::MAX);
        assert!(Table::default().with_overrides("gather=single-copy,reduce_scatter=single-copy").is_ok());
        assert!(Table::default().with_overrides("alltoall=rdma,allgather=rdma").is_ok());
        assert!(Table::default().with_overrides("bcast=rdma").is_err());
    }
}
