//! The algorithm menu, each as a schedule builder for one rank.
//!
//! Sources: Thakur, Rabenseifner and Gropp, "Optimization of collective communication operations
//! in MPICH" (2005); Bruck et al. (1997) for the logarithmic all-to-all and all-gather; Hensgen,
//! Finkel and Manber (1988) for the dissemination barrier; van de Geijn's scatter + all-gather
//! broadcast; the summary in 003_a035e2f81f3329c3.txt. Round counts are checked against the
//! formulas in [`rounds`] by the simulator tests.
//!
//! Block ids: a rank's contribution or segment is named by a rank index, *relative* to the root
//! for rooted operations (`v = (rank - root) mod n`) and absolute otherwise; all-to-all blocks are
//! `source * n + destination`.

use std::ops::Range;

use crate::schedule::{Apply, Schedule, Select};

/// Sends the blocks `ids`: bare when it is one block (both ends of every caller know the range,
/// see [`crate::schedule::Form::Bare`]), framed otherwise.
fn send_range(s: &mut Schedule, round: u32, to: u32, ids: Range<u32>) {
    if ids.len() == 1 {
        s.send_bare(round, to, Some(ids.start));
    } else {
        s.send(round, to, ids);
    }
}

/// The receive that matches [`send_range`] of the same `ids`.
fn recv_range(s: &mut Schedule, round: u32, from: u32, ids: &Range<u32>, apply: Apply) {
    if ids.len() == 1 {
        s.recv_bare(round, from, Some(ids.start), apply);
    } else {
        s.recv(round, from, apply);
    }
}

/// ceil(log2 n), 0 for n <= 1.
pub fn log2_ceil(n: u32) -> u32 {
    n.max(1).next_power_of_two().trailing_zeros()
}

fn rel(r: u32, root: u32, n: u32) -> u32 {
    (r + n - root) % n
}

fn abs(v: u32, root: u32, n: u32) -> u32 {
    (v + root) % n
}

/// The binomial tree on relative ranks: the parent of `v` and the masks of its children, with the
/// round in which each edge is used when data flows *down* (root first). Flowing up, edge rounds are
/// mirrored (`levels - 1 - round`).
struct Binomial {
    levels: u32,
    parent: Option<(u32, u32)>,
    children: Vec<(u32, u32, u32)>, // (child, subtree end, round)
}

impl Binomial {
    fn new(v: u32, n: u32) -> Binomial {
        let levels = log2_ceil(n);
        let low = if v == 0 { 1u64 << levels } else { 1u64 << v.trailing_zeros() };
        let parent = (v != 0).then(|| (v - low as u32, levels - 1 - low.trailing_zeros()));
        let mut children = Vec::new();
        let mut m = low >> 1;
        while m >= 1 {
            let c = v as u64 + m;
            if c < n as u64 {
                let end = (c + m).min(n as u64) as u32;
                children.push((c as u32, end, levels - 1 - m.trailing_zeros()));
            }
            m >>= 1;
        }
        Binomial { levels, parent, children }
    }
}

/// Barrier schedules.
pub mod barrier {
    use super::*;

    /// Dissemination: in round k, signal r + 2^k and wait for r - 2^k. ceil(log2 n) rounds.
    pub fn dissemination(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        for k in 0..log2_ceil(n) {
            let d = 1u32 << k;
            s.send_bare(k, (r + d) % n, None).recv_bare(k, (r + n - d) % n, None, Apply::Store);
        }
        s
    }

    /// Everyone signals rank 0, which then releases everyone: 2 rounds, n-1 messages each way.
    pub fn linear(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        if n == 1 {
            return s;
        }
        if r == 0 {
            (1..n).for_each(|i| _ = s.recv_bare(0, i, None, Apply::Store));
            (1..n).for_each(|i| _ = s.send_bare(1, i, None));
        } else {
            s.send_bare(0, 0, None).recv_bare(1, 0, None, Apply::Store);
        }
        s
    }
}

/// Broadcast schedules.
pub mod bcast {
    use super::*;

    /// Binomial tree carrying block 0. ceil(log2 n) rounds.
    pub fn binomial(r: u32, n: u32, root: u32) -> Schedule {
        let t = Binomial::new(rel(r, root, n), n);
        let mut s = Schedule::new();
        if let Some((p, round)) = t.parent {
            s.recv_bare(round, abs(p, root, n), Some(0), Apply::Store);
        }
        for &(c, _, round) in &t.children {
            s.send_bare(round, abs(c, root, n), Some(0));
        }
        s
    }

    /// Linear: the root sends to everyone in one round.
    pub fn linear(r: u32, n: u32, root: u32) -> Schedule {
        let mut s = Schedule::new();
        if r == root {
            (0..n).filter(|&i| i != root).for_each(|i| _ = s.send_bare(0, i, Some(0)));
        } else {
            s.recv_bare(0, root, Some(0), Apply::Store);
        }
        s
    }

    /// Van de Geijn: binomial scatter of n segments (relative ids), then a ring all-gather.
    /// ceil(log2 n) + n - 1 rounds, about 2x the data volume of one copy instead of log2(n) copies.
    pub fn scatter_allgather(r: u32, n: u32, root: u32) -> Schedule {
        let mut s = super::scatter::binomial(r, n, root);
        s.then(super::allgather::ring_relative(rel(r, root, n), n, root), log2_ceil(n));
        s
    }

    /// A pipelined chain: the data, cut into `segments` blocks (ids `0..segments`), flows down
    /// the chain of relative ranks 0 -> 1 -> ... -> n-1. Rank v receives segment j in round
    /// j + v - 1 and passes it on in round j + v, so every link of the chain carries a segment at
    /// once and each link moves the data once (Open MPI's tuned "pipeline" broadcast).
    /// segments + n - 2 rounds.
    pub fn pipeline(r: u32, n: u32, root: u32, segments: u32) -> Schedule {
        let v = rel(r, root, n);
        let mut s = Schedule::new();
        if n < 2 {
            return s;
        }
        let (prev, next) = (abs(v + n - 1, root, n), (v + 1 < n).then(|| abs(v + 1, root, n)));
        // Rank v is busy from round v - 1 (its first receive) to round v + segments - 1 (its last send).
        for t in v.saturating_sub(1)..v + segments {
            if let Some(next) = next
                && t >= v
            {
                s.send_bare(t, next, Some(t - v));
            }
            if v > 0 && t + 1 - v < segments {
                s.recv_bare(t, prev, Some(t + 1 - v), Apply::Store);
            }
        }
        s
    }
}

/// Scatter schedules.
pub mod scatter {
    use super::*;

    /// Binomial scatter of blocks named by relative rank. ceil(log2 n) rounds.
    pub fn binomial(r: u32, n: u32, root: u32) -> Schedule {
        let t = Binomial::new(rel(r, root, n), n);
        let mut s = Schedule::new();
        if let Some((p, round)) = t.parent {
            s.recv(round, abs(p, root, n), Apply::Store);
        }
        for &(c, end, round) in &t.children {
            s.send(round, abs(c, root, n), c..end);
        }
        s
    }

    /// The root sends each rank its block in one round.
    pub fn linear(r: u32, n: u32, root: u32) -> Schedule {
        let mut s = Schedule::new();
        if r == root {
            (1..n).for_each(|v| _ = s.send(0, abs(v, root, n), [v]));
        } else {
            s.recv(0, root, Apply::Store);
        }
        s
    }
}

/// Gather schedules.
pub mod gather {
    use super::*;

    /// Binomial gather of blocks named by relative rank (the mirror of the binomial scatter).
    pub fn binomial(r: u32, n: u32, root: u32) -> Schedule {
        let v = rel(r, root, n);
        let t = Binomial::new(v, n);
        let up = |round: u32| t.levels - 1 - round;
        let mut s = Schedule::new();
        for &(c, _, round) in t.children.iter().rev() {
            s.recv(up(round), abs(c, root, n), Apply::Store);
        }
        if let Some((p, round)) = t.parent {
            let end = (v + (1 << v.trailing_zeros())).min(n);
            s.send(up(round), abs(p, root, n), v..end);
        }
        s
    }

    /// Everyone sends its block to the root in one round.
    pub fn linear(r: u32, n: u32, root: u32) -> Schedule {
        let mut s = Schedule::new();
        if r == root {
            (1..n).for_each(|v| _ = s.recv(0, abs(v, root, n), Apply::Store));
        } else {
            s.send(0, root, [rel(r, root, n)]);
        }
        s
    }
}

/// Reduce schedules.
pub mod reduce {
    use super::*;

    /// Binomial reduction of the listed blocks towards relative rank 0. Children hold higher
    /// relative ranks, so operands combine in relative rank order. ceil(log2 n) rounds.
    pub fn binomial(r: u32, n: u32, root: u32, blocks: Range<u32>) -> Schedule {
        let t = Binomial::new(rel(r, root, n), n);
        let up = |round: u32| t.levels - 1 - round;
        let mut s = Schedule::new();
        for &(c, _, round) in t.children.iter().rev() {
            recv_range(&mut s, up(round), abs(c, root, n), &blocks, Apply::Reduce { incoming_first: false });
        }
        if let Some((p, round)) = t.parent {
            send_range(&mut s, up(round), abs(p, root, n), blocks);
        }
        s
    }

    /// Binomial reduction in absolute rank order (rooted at 0), then a hand-off to `root`: correct
    /// for non-commutative operators. ceil(log2 n) rounds, plus one when root != 0.
    pub fn binomial_ordered(r: u32, n: u32, root: u32, blocks: Range<u32>) -> Schedule {
        let mut s = binomial(r, n, 0, blocks.clone());
        if root != 0 {
            let mut hand = Schedule::new();
            if r == 0 {
                send_range(&mut hand, 0, root, blocks);
            } else if r == root {
                // The root's own contribution must not be combined again: replace it.
                recv_range(&mut hand, 0, 0, &blocks, Apply::Store);
            }
            s.then(hand, log2_ceil(n));
        }
        s
    }

    /// Everyone sends to the root, which combines in rank order. One round.
    pub fn linear(r: u32, n: u32, root: u32, blocks: Range<u32>) -> Schedule {
        let mut s = Schedule::new();
        if r == root {
            (0..root).rev().for_each(|i| recv_range(&mut s, 0, i, &blocks, Apply::Reduce { incoming_first: true }));
            (root + 1..n).for_each(|i| recv_range(&mut s, 0, i, &blocks, Apply::Reduce { incoming_first: false }));
        } else {
            send_range(&mut s, 0, root, blocks);
        }
        s
    }
}

/// Allreduce schedules.
pub mod allreduce {
    use super::*;

    /// Ranks that take part in the power-of-two core of recursive doubling/halving, MPICH style:
    /// of the first 2*rem ranks only the odd ones stay (each after absorbing its even neighbour).
    struct Fold {
        rem: u32,
        core: u32,
        new_rank: Option<u32>,
    }

    impl Fold {
        fn new(r: u32, n: u32) -> Fold {
            let core = if n.is_power_of_two() { n } else { n.next_power_of_two() / 2 };
            let rem = n - core;
            let new_rank = if r < 2 * rem { (r % 2 == 1).then_some(r / 2) } else { Some(r - rem) };
            Fold { rem, core, new_rank }
        }

        fn real(&self, v: u32) -> u32 {
            if v < self.rem { 2 * v + 1 } else { v + self.rem }
        }

        /// Round 0: even ranks of the first 2*rem hand their data to their odd neighbour.
        fn pre(&self, r: u32, s: &mut Schedule, blocks: Range<u32>) {
            if r < 2 * self.rem {
                if r.is_multiple_of(2) {
                    send_range(s, 0, r + 1, blocks);
                } else {
                    recv_range(s, 0, r - 1, &blocks, Apply::Reduce { incoming_first: true });
                }
            }
        }

        /// The last round: odd ranks give the result back.
        fn post(&self, r: u32, s: &mut Schedule, round: u32, blocks: Range<u32>) {
            if r < 2 * self.rem {
                if r % 2 == 1 {
                    send_range(s, round, r - 1, blocks);
                } else {
                    recv_range(s, round, r + 1, &blocks, Apply::Store);
                }
            }
        }
    }

    /// Recursive doubling on block 0: log2 n rounds for powers of two, floor(log2 n) + 2 otherwise.
    /// Keeps rank order, so it serves non-commutative operators.
    pub fn recursive_doubling(r: u32, n: u32) -> Schedule {
        let f = Fold::new(r, n);
        let k = f.core.trailing_zeros();
        let mut s = Schedule::new();
        f.pre(r, &mut s, 0..1);
        if let Some(v) = f.new_rank {
            for j in 0..k {
                let p = f.real(v ^ (1 << j));
                s.send_bare(1 + j, p, Some(0)).recv_bare(1 + j, p, Some(0), Apply::Reduce { incoming_first: p < r });
            }
        }
        f.post(r, &mut s, k + 1, 0..1);
        s
    }

    /// Rabenseifner: reduce-scatter by recursive halving, then all-gather by recursive doubling,
    /// over `core` segments (ids 0..core). 2 log2 n rounds (+2 for non-powers of two), and each rank
    /// sends about 2x the vector instead of log2(n) times it. Commutative operators only.
    pub fn rabenseifner(r: u32, n: u32) -> Schedule {
        let f = Fold::new(r, n);
        let k = f.core.trailing_zeros();
        let all = 0..f.core;
        let mut s = Schedule::new();
        f.pre(r, &mut s, all.clone());
        if let Some(v) = f.new_rank {
            let (mut lo, mut hi) = (0, f.core);
            for j in 0..k {
                let mask = f.core >> (j + 1);
                let p = f.real(v ^ mask);
                let mid = lo + (hi - lo) / 2;
                let (keep, give) = if v & mask == 0 { ((lo, mid), mid..hi) } else { ((mid, hi), lo..mid) };
                s.send(1 + j, p, give).recv(1 + j, p, Apply::Reduce { incoming_first: p < r });
                (lo, hi) = keep;
            }
            for j in 0..k {
                let mask = 1u32 << j;
                let p = f.real(v ^ mask);
                s.send(1 + k + j, p, lo..hi).recv(1 + k + j, p, Apply::Store);
                let width = hi - lo;
                if v & mask == 0 { hi += width } else { lo -= width }
            }
        }
        f.post(r, &mut s, 2 * k + 1, all);
        s
    }

    /// Ring: reduce-scatter then all-gather around the ring, n segments (ids 0..n). 2(n-1) rounds,
    /// each moving 1/n of the vector: bandwidth-optimal for large vectors. Commutative only.
    pub fn ring(r: u32, n: u32) -> Schedule {
        let mut s = super::reduce_scatter::ring(r, n);
        s.then(super::allgather::ring(r, n), n.saturating_sub(1));
        s
    }

    /// Linear reduction at rank 0 (in rank order) and linear broadcast: 2 rounds.
    pub fn linear(r: u32, n: u32) -> Schedule {
        let mut s = super::reduce::linear(r, n, 0, 0..1);
        s.then(super::bcast::linear(r, n, 0), 1);
        s
    }

    /// Blocks a vector is cut into by [`rabenseifner`] on n ranks.
    pub fn rabenseifner_segments(n: u32) -> u32 {
        if n.is_power_of_two() { n } else { n.next_power_of_two() / 2 }
    }
}

/// Reduce-scatter schedules.
pub mod reduce_scatter {
    use super::*;

    /// Ring reduce-scatter of n segments: in step s, send segment r-s-1 to the right and combine
    /// segment r-s-2 from the left; rank r ends with segment r complete. n-1 rounds. Commutative only.
    pub fn ring(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        let (right, left) = ((r + 1) % n, (r + n - 1) % n);
        for step in 0..n.saturating_sub(1) {
            s.send(step, right, [(r + 2 * n - step - 1) % n]).recv(step, left, Apply::Reduce { incoming_first: false });
        }
        s
    }

    /// Binomial reduction of all segments to rank 0 (in rank order), then a binomial scatter.
    /// 2 ceil(log2 n) rounds; works for any operator.
    pub fn reduce_then_scatter(r: u32, n: u32) -> Schedule {
        let mut s = super::reduce::binomial(r, n, 0, 0..n);
        s.then(super::scatter::binomial(r, n, 0), log2_ceil(n));
        s
    }
}

/// Allgather schedules.
pub mod allgather {
    use super::*;

    /// Ring on absolute ids: in step s, pass block r-s right. n-1 rounds.
    pub fn ring(r: u32, n: u32) -> Schedule {
        ring_relative(r, n, 0)
    }

    /// Ring where `v` is a relative rank and ids are relative (used after a rooted scatter).
    pub(super) fn ring_relative(v: u32, n: u32, root: u32) -> Schedule {
        let mut s = Schedule::new();
        let (right, left) = (abs((v + 1) % n, root, n), abs((v + n - 1) % n, root, n));
        for step in 0..n.saturating_sub(1) {
            s.send(step, right, [(v + n - step) % n]).recv(step, left, Apply::Store);
        }
        s
    }

    /// Bruck: in round k, send the 2^k blocks gathered so far to r - 2^k. ceil(log2 n) rounds for
    /// any n; the choice for small blocks.
    pub fn bruck(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        for k in 0..log2_ceil(n) {
            let d = 1u32 << k;
            let count = d.min(n - d);
            s.send(k, (r + n - d) % n, (0..count).map(|i| (r + i) % n)).recv(k, (r + d) % n, Apply::Store);
        }
        s
    }

    /// Recursive doubling (powers of two only): exchange everything held with r ^ 2^k.
    pub fn recursive_doubling(r: u32, n: u32) -> Schedule {
        assert!(n.is_power_of_two(), "recursive doubling all-gather needs a power of two");
        let mut s = Schedule::new();
        for k in 0..n.trailing_zeros() {
            let d = 1u32 << k;
            let base = r & !(d - 1);
            s.send(k, r ^ d, base..base + d).recv(k, r ^ d, Apply::Store);
        }
        s
    }

    /// Everyone sends its block to everyone: one round, n-1 messages per rank.
    pub fn linear(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        for i in (0..n).filter(|&i| i != r) {
            s.send(0, i, [r]).recv(0, i, Apply::Store);
        }
        s
    }
}

/// All-to-all schedules.
pub mod alltoall {
    use super::*;

    /// Pairwise exchange: in step s (1..n), send to r+s and receive from r-s. n-1 rounds, each
    /// message one block: the choice for large blocks.
    pub fn pairwise(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        for step in 1..n {
            let (to, from) = ((r + step) % n, (r + n - step) % n);
            s.send(step - 1, to, [r * n + to]).recv(step - 1, from, Apply::Store);
        }
        s
    }

    /// Bruck: ceil(log2 n) rounds; in round k a block moves 2^k further when bit k of its remaining
    /// distance is set. About (n/2) log2 n blocks per rank: the choice for small blocks.
    pub fn bruck(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        for k in 0..log2_ceil(n) {
            let d = 1u32 << k;
            s.send_selected(k, (r + d) % n, Select::DistanceBit { me: r, n, bit: k }).recv(
                k,
                (r + n - d) % n,
                Apply::Store,
            );
        }
        s
    }

    /// Everyone sends to everyone in one round.
    pub fn linear(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        for i in (0..n).filter(|&i| i != r) {
            s.send(0, i, [r * n + i]).recv(0, i, Apply::Store);
        }
        s
    }
}

/// Inclusive scan schedules.
pub mod scan {
    use super::*;

    /// Hillis-Steele recursive doubling: block 0 is the running partial (a contiguous range of
    /// ranks ending here), block 1 the result. In round k, pass the partial to r + 2^k; incoming
    /// partials come from lower ranks and combine on the left. ceil(log2 n) rounds.
    pub fn recursive_doubling(r: u32, n: u32) -> Schedule {
        let mut s = Schedule::new();
        for k in 0..log2_ceil(n) {
            let d = 1u32 << k;
            if r + d < n {
                s.send_bare(k, r + d, Some(0));
            }
            if r >= d {
                s.recv_bare(k, r - d, Some(0), Apply::ReduceInto { into: vec![0, 1] });
            }
        }
        s
    }
}

/// Round counts (latency terms) of each algorithm, as the simulator must observe them.
pub mod rounds {
    use super::log2_ceil;

    /// The dissemination barrier's.
    pub fn dissemination(n: u32) -> u32 {
        log2_ceil(n)
    }
    /// A binomial tree's (broadcast, scatter, gather, reduce).
    pub fn binomial(n: u32) -> u32 {
        log2_ceil(n)
    }
    /// Broadcast as a binomial scatter then a ring allgather.
    pub fn scatter_allgather(n: u32) -> u32 {
        if n == 1 { 0 } else { log2_ceil(n) + n - 1 }
    }
    /// A pipelined chain broadcast of `segments` segments.
    pub fn pipeline(n: u32, segments: u32) -> u32 {
        if n < 2 { 0 } else { segments + n - 2 }
    }
    /// Recursive-doubling allreduce (two more rounds off a power of two).
    pub fn recursive_doubling_allreduce(n: u32) -> u32 {
        let k = if n.is_power_of_two() { n.trailing_zeros() } else { n.ilog2() + 2 };
        if n == 1 { 0 } else { k }
    }
    /// Rabenseifner's allreduce: recursive halving then doubling.
    pub fn rabenseifner(n: u32) -> u32 {
        if n == 1 {
            0
        } else if n.is_power_of_two() {
            2 * n.trailing_zeros()
        } else {
            2 * n.ilog2() + 2
        }
    }
    /// Ring allreduce: a ring reduce-scatter then a ring allgather.
    pub fn ring_allreduce(n: u32) -> u32 {
        2 * (n - 1)
    }
    /// A ring's (allgather, reduce-scatter).
    pub fn ring(n: u32) -> u32 {
        n - 1
    }
    /// Bruck's allgather.
    pub fn bruck(n: u32) -> u32 {
        log2_ceil(n)
    }
}
