//! The whole choice of a collective's algorithm, as one pure function of the call, the facts the
//! caller knows about its communicator's members, and the selection [`Table`]: the tiers that do
//! not send messages (the shared-memory board, single copy), the ones that need a setting or a
//! topology (multicast, node-leader hierarchy), then the table's size thresholds.
//!
//! The facts are asked lazily, in the order the tiers need them (a fact can cost the caller work
//! the first time, such as building a communicator's node-leader decomposition), so
//! [`Topology`] is a trait; [`Facts`] is its plain form for tests and simulators.

use crate::select::{Algorithm, Call, Operation, Table};
use crate::shared;

/// What the caller knows about its communicator's members. Every member must answer alike (the
/// facts come from what every rank announced), so that all choose the same algorithm.
pub trait Topology {
    /// Whether every member is on this host and reached through shared memory.
    fn on_one_host(&self) -> bool;
    /// Whether every member busy-polls (the board's and single copy's waits spin: a sleeping
    /// rank would see them late, so by default those tiers serve busy-polling ranks only).
    fn all_busy(&self) -> bool;
    /// Whether every member may read the others' memory (the kernel's rules for its user).
    fn all_single_copy(&self) -> bool;
    /// The node-leader decomposition: `None` if the members are on one host, else whether it
    /// saves network traffic (some host has several members).
    fn hosts(&self) -> Option<bool>;
    /// Whether a broadcast may go by reliable multicast: multicast is enabled and the members
    /// span several hosts (on one host there is no network for it to save). The table's
    /// [`Table::multicast_bcast_ranks`] decides whether it does. Default: no.
    fn multicast(&self) -> bool {
        false
    }
    /// Whether every other member is reached over RDMA verbs (the RDMA tier's condition).
    fn all_verbs(&self) -> bool {
        false
    }
}

/// The facts as plain values.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// See [`Topology::on_one_host`].
    pub on_one_host: bool,
    /// See [`Topology::all_busy`].
    pub all_busy: bool,
    /// See [`Topology::all_single_copy`].
    pub all_single_copy: bool,
    /// See [`Topology::hosts`].
    pub hosts: Option<bool>,
    /// See [`Topology::multicast`].
    pub multicast: bool,
    /// See [`Topology::all_verbs`].
    pub all_verbs: bool,
}

impl Topology for Facts {
    fn on_one_host(&self) -> bool {
        self.on_one_host
    }
    fn all_busy(&self) -> bool {
        self.all_busy
    }
    fn all_single_copy(&self) -> bool {
        self.all_single_copy
    }
    fn hosts(&self) -> Option<bool> {
        self.hosts
    }
    fn multicast(&self) -> bool {
        self.multicast
    }
    fn all_verbs(&self) -> bool {
        self.all_verbs
    }
}

/// The algorithm for `call` on a communicator described by `topology`, with `table`'s thresholds
/// and overrides: the board, then single copy, then RDMA writes (every member over verbs), then
/// multicast, then the node-leader hierarchy, then [`Table::choose`].
pub fn choose(call: Call, topology: &impl Topology, table: &Table) -> Algorithm {
    let Call { op, ranks, bytes, commutative } = call;
    let pinned = table.overrides.get(&op).copied();
    // The board and single copy need every member on this host, and the board's room for them.
    let local = || (2..=shared::MAX_RANKS as u32).contains(&ranks) && topology.on_one_host();
    // An all-to-all is not split into pieces: all of a rank's data must fit the board at once;
    // nor is a scatter (the root's data, a block per rank) or a reduce-scatter (`bytes`: the
    // whole vector).
    let room = shared::capacity(ranks as usize);
    let fits = match op {
        Operation::Alltoall | Operation::Scatter => bytes.saturating_mul(ranks as usize) <= room,
        Operation::ReduceScatter => bytes <= room,
        _ => true,
    };
    if Algorithm::shared_memory_serves(op) && fits && local() {
        let board = match pinned {
            Some(pinned) => pinned == Algorithm::SharedMemory,
            None => topology.all_busy() && bytes <= table.shared_limit(op, ranks),
        };
        if board {
            return Algorithm::SharedMemory;
        }
    }
    if Algorithm::single_copy_serves(op) && local() && topology.all_single_copy() {
        let single = match pinned {
            Some(pinned) => pinned == Algorithm::SingleCopy,
            None => topology.all_busy() && bytes >= table.single_copy_from(op, ranks),
        };
        if single {
            return Algorithm::SingleCopy;
        }
    }
    // RDMA writes into the peers' registered buffers: every other member reached over verbs.
    if Algorithm::rdma_serves(op) && ranks >= 2 && topology.all_verbs() {
        let rdma = match pinned {
            Some(pinned) => pinned == Algorithm::Rdma,
            None => bytes >= table.rdma_min,
        };
        if rdma {
            return Algorithm::Rdma;
        }
    }
    // Reliable multicast serves broadcast and barrier when pinned; unpinned, a broadcast on
    // more ranks than the simulated network's crossover, where a group serves the members (it
    // pays off across hosts, not within one; see docs/multicast.md).
    if pinned == Some(Algorithm::Multicast) && matches!(op, Operation::Bcast | Operation::Barrier) {
        return Algorithm::Multicast;
    }
    if op == Operation::Bcast
        && pinned.is_none()
        && ranks > table.multicast_bcast_ranks
        && bytes <= table.multicast_bcast_max
        && topology.multicast()
    {
        return Algorithm::Multicast;
    }
    let forced = pinned == Some(Algorithm::Hierarchical);
    let hierarchical = matches!(op, Operation::Barrier | Operation::Bcast | Operation::Allreduce)
        && commutative
        && topology.hosts().is_some_and(|worth_it| forced || worth_it);
    if hierarchical && (forced || pinned.is_none()) {
        return Algorithm::Hierarchical;
    }
    // Across hosts, a large broadcast down the pipelined chain (see `Table::bcast_pipeline`), on
    // a few ranks (`Table::bcast_chain_ranks`).
    if op == Operation::Bcast
        && pinned.is_none()
        && (3..=table.bcast_chain_ranks).contains(&ranks)
        && bytes >= table.bcast_pipeline
        && !topology.on_one_host()
    {
        return Algorithm::Pipeline;
    }
    table.choose(call)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Busy-polling ranks on one host that may read each other's memory.
    const HOST: Facts = Facts {
        on_one_host: true,
        all_busy: true,
        all_single_copy: true,
        hosts: None,
        multicast: false,
        all_verbs: false,
    };
    /// Two hosts with several ranks each.
    const HOSTS: Facts = Facts {
        on_one_host: false,
        all_busy: true,
        all_single_copy: true,
        hosts: Some(true),
        multicast: false,
        all_verbs: false,
    };

    fn call(op: Operation, ranks: u32, bytes: usize) -> Call {
        Call { op, ranks, bytes, commutative: true }
    }

    fn pinned(spec: &str) -> Table {
        Table::default().with_overrides(spec).unwrap()
    }

    #[test]
    fn small_calls_on_one_host_take_the_board() {
        let t = Table::default();
        assert_eq!(choose(call(Operation::Barrier, 4, 0), &HOST, &t), Algorithm::SharedMemory);
        assert_eq!(choose(call(Operation::Bcast, 4, 8), &HOST, &t), Algorithm::SharedMemory);
        assert_eq!(choose(call(Operation::Allreduce, 4, t.shared_allreduce_max), &HOST, &t), Algorithm::SharedMemory);
        // One rank is no board call, nor are more ranks than the board holds.
        assert_ne!(choose(call(Operation::Bcast, 1, 8), &HOST, &t), Algorithm::SharedMemory);
        let many = shared::MAX_RANKS as u32 + 1;
        assert_eq!(choose(call(Operation::Bcast, many, 8), &HOST, &t), Algorithm::Binomial);
    }

    #[test]
    fn sleeping_ranks_take_the_board_only_when_pinned() {
        let sleepy = Facts { all_busy: false, ..HOST };
        assert_eq!(choose(call(Operation::Bcast, 4, 8), &sleepy, &Table::default()), Algorithm::Binomial);
        assert_eq!(
            choose(call(Operation::Bcast, 4, 8), &sleepy, &pinned("bcast=shared-memory")),
            Algorithm::SharedMemory
        );
    }

    #[test]
    fn large_calls_on_one_host_copy_once() {
        let t = Table::default();
        let big = 2 * t.single_copy_min;
        assert_eq!(choose(call(Operation::Bcast, 4, big), &HOST, &t), Algorithm::SingleCopy);
        // An all-reduce leaves the board for single copy, on 2 ranks as on more.
        let ar = t.single_copy_allreduce_min;
        for ranks in [2, 4] {
            assert_eq!(choose(call(Operation::Allreduce, ranks, ar), &HOST, &t), Algorithm::SingleCopy);
            assert_eq!(choose(call(Operation::Allreduce, ranks, ar - 1), &HOST, &t), Algorithm::SharedMemory);
        }
        // A reduce stays on the board up to its limit, then copies once.
        let reduce = t.shared_limit(Operation::Reduce, 2);
        assert_eq!(choose(call(Operation::Reduce, 2, reduce), &HOST, &t), Algorithm::SharedMemory);
        assert_eq!(choose(call(Operation::Reduce, 2, reduce + 1), &HOST, &t), Algorithm::SingleCopy);
        // Not where the kernel forbids it, nor across hosts.
        let denied = Facts { all_single_copy: false, ..HOST };
        assert_ne!(choose(call(Operation::Bcast, 4, big), &denied, &t), Algorithm::SingleCopy);
        assert_ne!(choose(call(Operation::Bcast, 4, big), &HOSTS, &t), Algorithm::SingleCopy);
    }

    #[test]
    fn an_alltoall_takes_the_board_only_if_it_fits_at_once() {
        let t = pinned("alltoall=shared-memory");
        let room = shared::capacity(4);
        assert_eq!(choose(call(Operation::Alltoall, 4, room / 4), &HOST, &t), Algorithm::SharedMemory);
        assert_ne!(choose(call(Operation::Alltoall, 4, room / 4 + 1), &HOST, &t), Algorithm::SharedMemory);
    }

    #[test]
    fn gathers_scans_and_reduce_scatters_take_the_tiers_on_one_host() {
        let t = Table::default();
        for op in [Operation::Gather, Operation::Scatter, Operation::Scan, Operation::ReduceScatter] {
            assert_eq!(choose(call(op, 4, 8), &HOST, &t), Algorithm::SharedMemory, "{op}");
            let above = t.shared_limit(op, 4) + 1;
            assert!(!matches!(choose(call(op, 4, above), &HOST, &t), Algorithm::SharedMemory), "{op}");
            assert_eq!(choose(call(op, 4, t.single_copy_from(op, 4)), &HOST, &t), Algorithm::SingleCopy, "{op}");
        }
        // A scatter's blocks must fit the board at once, even pinned.
        let p = pinned("scatter=shared-memory");
        let room = shared::capacity(4);
        assert_eq!(choose(call(Operation::Scatter, 4, room / 4), &HOST, &p), Algorithm::SharedMemory);
        assert_ne!(choose(call(Operation::Scatter, 4, room / 4 + 1), &HOST, &p), Algorithm::SharedMemory);
        // On 2 ranks a reduce-scatter takes the board up to its capacity there (each rank posts
        // the other's half), single copy right above; on more ranks the general limits.
        let (rs, pair) = (Operation::ReduceScatter, shared::capacity(2));
        assert_eq!(t.shared_limit(rs, 2), pair);
        assert_eq!(choose(call(rs, 2, 16 << 10), &HOST, &t), Algorithm::SharedMemory);
        assert_eq!(choose(call(rs, 2, pair), &HOST, &t), Algorithm::SharedMemory);
        assert_eq!(choose(call(rs, 2, pair + 4), &HOST, &t), Algorithm::SingleCopy);
        assert_ne!(choose(call(rs, 3, 16 << 10), &HOST, &t), Algorithm::SharedMemory);
        assert_eq!(choose(call(rs, 3, pair), &HOST, &t), Algorithm::SingleCopy);
        // A reduce-scatter's whole vector must fit the board at once, even pinned.
        let p = pinned("reduce_scatter=shared-memory");
        let room = shared::capacity(4);
        assert_eq!(choose(call(Operation::ReduceScatter, 4, room), &HOST, &p), Algorithm::SharedMemory);
        assert_ne!(choose(call(Operation::ReduceScatter, 4, room + 1), &HOST, &p), Algorithm::SharedMemory);
    }

    #[test]
    fn multicast_serves_broadcast_and_barrier_when_pinned() {
        let t = pinned("bcast=multicast,barrier=multicast");
        assert_eq!(choose(call(Operation::Bcast, 8, 1 << 20), &HOSTS, &t), Algorithm::Multicast);
        assert_eq!(choose(call(Operation::Barrier, 8, 0), &HOSTS, &t), Algorithm::Multicast);
        assert_eq!(choose(call(Operation::Bcast, 8, 1 << 20), &HOSTS, &Table::default()), Algorithm::Hierarchical);
    }

    #[test]
    fn broadcast_takes_multicast_above_the_crossover_only() {
        let t = Table::default();
        let group = Facts { multicast: true, ..HOSTS };
        let (above, at) = (t.multicast_bcast_ranks + 1, t.multicast_bcast_ranks);
        assert_eq!(choose(call(Operation::Bcast, above, 8), &group, &t), Algorithm::Multicast);
        assert_eq!(choose(call(Operation::Bcast, above, t.multicast_bcast_max), &group, &t), Algorithm::Multicast);
        // Not at or below the crossover, nor above the size it holds for, nor without a group.
        assert_eq!(choose(call(Operation::Bcast, at, 8), &group, &t), Algorithm::Hierarchical);
        assert_ne!(choose(call(Operation::Bcast, above, t.multicast_bcast_max + 1), &group, &t), Algorithm::Multicast);
        assert_ne!(choose(call(Operation::Bcast, above, 8), &HOSTS, &t), Algorithm::Multicast);
        // Nor for another collective, nor against a pin, nor on one host.
        assert_ne!(choose(call(Operation::Barrier, above, 0), &group, &t), Algorithm::Multicast);
        assert_eq!(choose(call(Operation::Bcast, above, 8), &group, &pinned("bcast=binomial")), Algorithm::Binomial);
        let local = Facts { multicast: true, ..HOST };
        assert_ne!(choose(call(Operation::Bcast, above, 8), &local, &t), Algorithm::Multicast);
        // The threshold is the table's: a table that never takes multicast.
        let never = Table { multicast_bcast_ranks: u32::MAX, ..Table::default() };
        assert_ne!(choose(call(Operation::Bcast, 1 << 20, 8), &group, &never), Algorithm::Multicast);
    }

    #[test]
    fn several_hosts_go_through_node_leaders() {
        let t = Table::default();
        for op in [Operation::Barrier, Operation::Bcast, Operation::Allreduce] {
            assert_eq!(choose(call(op, 8, 64), &HOSTS, &t), Algorithm::Hierarchical, "{op}");
        }
        // Not for a non-commutative reduction, nor when every host has one rank (unless pinned),
        // nor for the operations without a node-leader form.
        let ordered = Call { commutative: false, ..call(Operation::Allreduce, 8, 64) };
        assert_eq!(choose(ordered, &HOSTS, &t), Algorithm::RecursiveDoubling);
        let spread = Facts { hosts: Some(false), ..HOSTS };
        assert_eq!(choose(call(Operation::Bcast, 8, 64), &spread, &t), Algorithm::Binomial);
        assert_eq!(
            choose(call(Operation::Bcast, 8, 64), &spread, &pinned("bcast=hierarchical")),
            Algorithm::Hierarchical
        );
        assert_eq!(choose(call(Operation::Allgather, 8, 64), &HOSTS, &t), Algorithm::Bruck);
        // Another pin wins over the hierarchy.
        assert_eq!(choose(call(Operation::Bcast, 8, 64), &HOSTS, &pinned("bcast=binomial")), Algorithm::Binomial);
    }

    #[test]
    fn rdma_serves_large_gathers_over_verbs_only() {
        let t = Table::default();
        let verbs = Facts { all_verbs: true, ..HOSTS };
        for op in [Operation::Allgather, Operation::Alltoall] {
            assert_eq!(choose(call(op, 4, t.rdma_min), &verbs, &t), Algorithm::Rdma, "{op}");
            assert_ne!(choose(call(op, 4, t.rdma_min - 1), &verbs, &t), Algorithm::Rdma, "{op}");
            // Not without verbs to every member, nor on one rank.
            assert_ne!(choose(call(op, 4, t.rdma_min), &HOSTS, &t), Algorithm::Rdma, "{op}");
            assert_ne!(choose(call(op, 1, t.rdma_min), &verbs, &t), Algorithm::Rdma, "{op}");
        }
        // Pinned: at any size; another pin wins; other operations never.
        let p = pinned("alltoall=rdma");
        assert_eq!(choose(call(Operation::Alltoall, 4, 8), &verbs, &p), Algorithm::Rdma);
        assert_eq!(choose(call(Operation::Alltoall, 4, 8), &HOSTS, &p), Algorithm::Bruck);
        let other = pinned("alltoall=pairwise");
        assert_eq!(choose(call(Operation::Alltoall, 4, 1 << 20), &verbs, &other), Algorithm::Pairwise);
        assert_ne!(choose(call(Operation::Allreduce, 4, 1 << 20), &verbs, &t), Algorithm::Rdma);
    }

    #[test]
    fn otherwise_the_table_decides() {
        let t = Table::default();
        let apart = Facts { hosts: Some(false), ..Facts::default() };
        // Across hosts, the pipelined chain from its size up, past scatter + all-gather's (which
        // the table keeps where the members' places are not known), on 3 or more ranks (a chain
        // of 2 is binomial's single message) up to its rank count; not on one host, nor pinned.
        let (at, most) = (t.bcast_pipeline, t.bcast_chain_ranks);
        assert_eq!(most, 7);
        assert_eq!(choose(call(Operation::Bcast, most, at - 1), &apart, &t), Algorithm::Binomial);
        assert_eq!(choose(call(Operation::Bcast, 3, at), &apart, &t), Algorithm::Pipeline);
        assert_eq!(choose(call(Operation::Bcast, most, t.bcast_large - 1), &apart, &t), Algorithm::Pipeline);
        assert_eq!(choose(call(Operation::Bcast, 4, t.bcast_large), &apart, &t), Algorithm::Pipeline);
        assert_eq!(choose(call(Operation::Bcast, most, 64 << 20), &apart, &t), Algorithm::Pipeline);
        assert_eq!(t.choose(call(Operation::Bcast, 8, t.bcast_large)), Algorithm::ScatterAllgather);
        assert_eq!(choose(call(Operation::Bcast, 2, at), &apart, &t), Algorithm::Binomial);
        assert_eq!(choose(call(Operation::Bcast, 2, 64 << 20), &apart, &t), Algorithm::Binomial);
        // More ranks than the chain serves: the table's sizes (binomial, then scatter + all-gather).
        assert_eq!(choose(call(Operation::Bcast, most + 1, at), &apart, &t), Algorithm::Binomial);
        assert_eq!(choose(call(Operation::Bcast, most + 1, t.bcast_large), &apart, &t), Algorithm::ScatterAllgather);
        assert_eq!(choose(call(Operation::Bcast, 64, 64 << 20), &apart, &t), Algorithm::ScatterAllgather);
        let sleepy_host = Facts { on_one_host: true, all_busy: false, ..HOST };
        assert_eq!(choose(call(Operation::Bcast, 4, at), &sleepy_host, &t), Algorithm::Binomial);
        assert_eq!(choose(call(Operation::Bcast, 4, at), &apart, &pinned("bcast=binomial")), Algorithm::Binomial);
        assert_eq!(choose(call(Operation::Allreduce, 8, t.allreduce_ring), &apart, &t), Algorithm::Ring);
        assert_eq!(choose(call(Operation::Alltoall, 8, 1 << 20), &apart, &t), Algorithm::Pairwise);
    }
}
