//! The node-leader decomposition of a communicator spanning several hosts: a communicator per
//! host and one of the hosts' leaders, derived without communication.

use super::*;

/// The node-leader decomposition of a communicator spanning several hosts.
pub(crate) struct Hierarchy {
    /// The ranks of this communicator on this host (rank 0 of it is the node's leader).
    pub(super) node: Comm,
    /// The leaders, one per host; `None` on ranks that are not leaders.
    pub(super) leaders: Option<Comm>,
    /// The node index of each rank of the communicator.
    pub(super) node_of: Vec<u32>,
    /// For each node index, the rank (in the communicator) of its leader.
    pub(super) leader_rank: Vec<Rank>,
}

impl Hierarchy {
    /// Whether the hierarchy saves network traffic: some host has several ranks.
    pub(super) fn worth_it(&self) -> bool {
        let mut per_node = vec![0u32; self.leader_rank.len()];
        self.node_of.iter().for_each(|&n| per_node[n as usize] += 1);
        per_node.iter().any(|&c| c > 1)
    }

    /// The rank, in the leaders' communicator, of node `node`'s leader.
    pub(super) fn leader_position(&self, node: u32) -> Rank {
        self.leader_rank.iter().take(node as usize).filter(|&&r| r != Rank::MAX).count() as Rank
    }
}

/// The rank of `r` (a rank of the parent communicator) within its node's communicator.
pub(super) fn node_rank_of(h: &Hierarchy, r: Rank) -> Rank {
    let node = h.node_of[r as usize];
    h.node_of[..r as usize].iter().filter(|&&n| n == node).count() as Rank
}

impl Comm {
    /// The node-leader decomposition, if this communicator spans more than one host.
    pub(super) fn hierarchy(&self) -> Option<&Hierarchy> {
        let h = self.coll().hierarchy.get_or_init(|| {
            let nodes = &self.inner().nodes;
            let node_of: Vec<u32> = (0..self.size()).map(|r| nodes[self.world_rank(r) as usize]).collect();
            let mut leader_rank: Vec<Rank> = vec![Rank::MAX; node_of.iter().max().map_or(0, |m| *m as usize + 1)];
            for (r, &n) in node_of.iter().enumerate().rev() {
                leader_rank[n as usize] = r as Rank;
            }
            let me = self.rank();
            let mine = node_of[me as usize];
            // Derived without communication: every member computes the same groups and contexts.
            let sub = |members: Vec<Rank>, context: u32| {
                let world: Vec<Rank> = members.iter().map(|&r| self.world_rank(r)).collect();
                let mut c = self.with_context(context);
                c.group = Some(Arc::new(Group::new(world, self.world_rank(me))));
                c
            };
            let node_context = derive_context(derive_context(self.context(), u32::MAX - 1), mine);
            let node = sub((0..self.size()).filter(|&r| node_of[r as usize] == mine).collect(), node_context);
            let leaders = (leader_rank[mine as usize] == me).then(|| {
                let members = leader_rank.iter().copied().filter(|&r| r != Rank::MAX).collect();
                sub(members, derive_context(self.context(), u32::MAX - 2))
            });
            Hierarchy { node, leaders, node_of, leader_rank }
        });
        (h.leader_rank.iter().filter(|&&r| r != Rank::MAX).count() > 1).then_some(h)
    }
}
