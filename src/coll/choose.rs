//! The facts a choice of algorithm needs (members' hosts, progress modes, permissions), gathered
//! once per communicator; the choice itself is `ferrocomm_collectives::plan::choose`.

use ferrocomm_collectives::plan::{self, Topology};

use super::*;

impl Comm {
    /// The algorithm this communicator uses for `op` with `bytes` per rank (and a commutative
    /// operator): what the selection table (and the hierarchy) decide.
    pub fn collective_algorithm(&self, op: Operation, bytes: usize) -> Algorithm {
        self.choose(op, bytes, true)
    }

    /// The algorithm for `op` with `bytes` per rank: [`plan::choose`] on this communicator's facts.
    pub(super) fn choose(&self, op: Operation, bytes: usize, commutative: bool) -> Algorithm {
        let call = Call { op, ranks: self.size(), bytes, commutative };
        plan::choose(call, &Members(self), self.collective_table())
    }

    /// The algorithm for `op` with `bytes` per rank among those that send messages: the
    /// selection table's, for the calls that the board and single copy do not serve (lengths
    /// that differ between ranks).
    pub(super) fn choose_messages(&self, op: Operation, bytes: usize, commutative: bool) -> Algorithm {
        match self.choose(op, bytes, commutative) {
            Algorithm::SharedMemory | Algorithm::SingleCopy => {
                self.collective_table().choose(Call { op, ranks: self.size(), bytes, commutative })
            }
            alg => alg,
        }
    }

    /// Whether every member busy-polls: the default table's condition for the board and single
    /// copy (whose waits a sleeping rank would only see every `NAP`). Decided from what every
    /// rank announced, so all members choose alike even when their progress modes differ.
    pub(super) fn all_busy(&self) -> bool {
        *self.coll().all_busy.get_or_init(|| self.every_member(|w| self.inner().busy[w]))
    }

    /// Whether every member may read the others' memory (the kernel's ptrace rules for its user),
    /// from what each announced: single copy needs all of them.
    pub(super) fn all_single_copy(&self) -> bool {
        *self.coll().all_single_copy.get_or_init(|| self.every_member(|w| self.inner().single_copy[w]))
    }

    /// Whether every other member is reached over verbs (the RDMA tier), from this rank's
    /// routes: a job over verbs reaches every peer alike, so all members choose alike.
    pub(super) fn all_verbs(&self) -> bool {
        *self.coll().all_verbs.get_or_init(|| {
            let inner = self.inner();
            self.size() > 1
                && inner.reactor.with(|d| {
                    self.every_member(|w| w as Rank == inner.rank || d.transport.name_for(w as Rank) == "verbs")
                })
        })
    }

    /// Whether a broadcast may go by reliable multicast ([`Topology::multicast`]): multicast is on
    /// (`FERROCOMM_MCAST`, which every rank shares: bootstrap refuses ranks that differ), the
    /// members span several hosts, and none of them busy-polls, from what every rank announced,
    /// so all members choose alike. The channel's datagrams arrive through the reactor's socket
    /// readiness, which busy-polling ranks that share CPUs leave waiting: with 4 busy ranks on 2
    /// CPUs, each a host of its own, an 8 B broadcast by multicast takes 7.5 ms against 35 us
    /// binomial, and the other collectives slow as much once the channel exists
    /// (`ferrocomm-bench hosts --sizes 8 --env FERROCOMM_COLL=bcast=multicast`).
    /// Whether the group's multicast test confirms is not part of it: that is each root's own
    /// finding, at run time, and a channel whose group does not confirm delivers over
    /// point-to-point (`docs/multicast.md`).
    pub(super) fn multicast_capable(&self) -> bool {
        *self.coll().multicast_capable.get_or_init(|| {
            let inner = self.inner();
            let first = inner.nodes[self.world_rank(0) as usize];
            inner.settings.multicast.enabled
                && !self.every_member(|w| inner.nodes[w] == first)
                && self.every_member(|w| !inner.busy[w])
        })
    }

    /// Whether `holds(world rank)` for every member.
    pub(super) fn every_member(&self, holds: impl Fn(usize) -> bool) -> bool {
        (0..self.size()).all(|r| holds(self.world_rank(r) as usize))
    }

    /// Whether every member is on this host and reached through shared memory.
    pub(super) fn on_one_host(&self) -> bool {
        *self.coll().on_one_host.get_or_init(|| {
            let inner = self.inner();
            let here = inner.domains[inner.rank as usize];
            inner.shm_job.is_some() && self.every_member(|w| inner.domains[w] == here)
        })
    }
}

/// A communicator's members as the choice of algorithm sees them; each fact is gathered on first
/// use and kept by the communicator.
struct Members<'a>(&'a Comm);

impl Topology for Members<'_> {
    fn on_one_host(&self) -> bool {
        self.0.on_one_host()
    }
    fn all_busy(&self) -> bool {
        self.0.all_busy()
    }
    fn all_single_copy(&self) -> bool {
        self.0.all_single_copy()
    }
    fn hosts(&self) -> Option<bool> {
        self.0.hierarchy().map(|h| h.worth_it())
    }
    fn all_verbs(&self) -> bool {
        self.0.all_verbs()
    }
    fn multicast(&self) -> bool {
        self.0.multicast_capable()
    }
}
