//! The facts a choice of algorithm needs (members' hosts, progress modes, permissions), gathered
//! once per communicator; the choice itself is `ferrocomm_collectives::plan::choose`.

use super::*;

impl Comm {
    /// The algorithm this communicator uses for `op` with `bytes` per rank (and a commutative
    /// operator): what the selection table (and the hierarchy) decide.
    pub fn collective_algorithm(&self, op: Operation, bytes: usize) -> Algorithm {
        self.choose(op, bytes, true)
    }

    /// The algorithm for `op` with `bytes` per rank.
    pub(super) fn choose(&self, op: Operation, bytes: usize, commutative: bool) -> Algorithm {
        if self.on_board(op, bytes) {
            Algorithm::SharedMemory
        } else if self.by_single_copy(op, bytes) {
            Algorithm::SingleCopy
        } else {
            self.choose_messages(op, bytes, commutative)
        }
    }

    /// Whether `op` with `bytes` per rank copies straight from the other ranks' memory: calls on
    /// one host where the kernel allows it, by default large ones of busy-polling ranks (their
    /// steps wait on the board), or any when pinned.
    pub(super) fn by_single_copy(&self, op: Operation, bytes: usize) -> bool {
        if !(Algorithm::single_copy_serves(op) && self.on_one_host() && self.all_single_copy()) {
            return false;
        }
        let table = self.collective_table();
        match table.overrides.get(&op) {
            Some(pinned) => *pinned == Algorithm::SingleCopy,
            None => self.all_busy() && bytes >= table.single_copy_from(op, self.size()),
        }
    }

    /// Whether `op` with `bytes` per rank goes to the shared-memory board: calls on one host, by
    /// default small ones of busy-polling ranks (a sleeping rank is not woken by the board, see
    /// `shared`), or any that fit when pinned.
    pub(super) fn on_board(&self, op: Operation, bytes: usize) -> bool {
        let table = self.collective_table();
        let n = self.size() as usize;
        // An all-to-all is not split into pieces: all of a rank's data must fit one.
        let fits = op != Operation::Alltoall || bytes.saturating_mul(n) <= ferrocomm_collectives::shared::capacity(n);
        if !(Algorithm::shared_memory_serves(op) && fits && self.on_one_host()) {
            return false;
        }
        match table.overrides.get(&op) {
            Some(pinned) => *pinned == Algorithm::SharedMemory,
            None => self.all_busy() && bytes <= table.shared_limit(op, self.size()),
        }
    }

    /// The algorithm for `op` with `bytes` per rank among those that send messages.
    pub(super) fn choose_messages(&self, op: Operation, bytes: usize, commutative: bool) -> Algorithm {
        let call = Call { op, ranks: self.size(), bytes, commutative };
        let table = self.collective_table();
        // Reliable multicast serves broadcast and barrier when pinned (it needs a multicast group,
        // and pays off across hosts, not within one; see docs/multicast.md).
        if table.overrides.get(&op) == Some(&Algorithm::Multicast)
            && matches!(op, Operation::Bcast | Operation::Barrier)
        {
            return Algorithm::Multicast;
        }
        let forced = table.overrides.get(&op) == Some(&Algorithm::Hierarchical);
        let hierarchical = matches!(op, Operation::Barrier | Operation::Bcast | Operation::Allreduce)
            && commutative
            && self.hierarchy().is_some_and(|h| forced || h.worth_it());
        if hierarchical && (forced || !table.overrides.contains_key(&op)) {
            return Algorithm::Hierarchical;
        }
        table.choose(call)
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

    /// Whether `holds(world rank)` for every member.
    pub(super) fn every_member(&self, holds: impl Fn(usize) -> bool) -> bool {
        (0..self.size()).all(|r| holds(self.world_rank(r) as usize))
    }

    /// Whether every member is on this host and reached through shared memory.
    pub(super) fn on_one_host(&self) -> bool {
        *self.coll().on_one_host.get_or_init(|| {
            let inner = self.inner();
            let here = inner.domains[inner.rank as usize];
            inner.shm_job.is_some()
                && (2..=BOARD_RANKS as u32).contains(&self.size())
                && self.every_member(|w| inner.domains[w] == here)
        })
    }
}
