//! From an operation call to a running [`Machine`], and from its final blocks to the result.
//!
//! Each function here plans one operation for one rank: it picks the schedule of the chosen
//! algorithm (planned once per call shape and thread, then shared: see `planned`), lays the
//! caller's data out as blocks, and says how to read the result back. Data is shared (`Bytes`),
//! never copied, on the way in; results are zero-copy when they are one block.

use std::cell::RefCell;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use crate::algorithms::{
    allgather, allreduce, alltoall, barrier, bcast, gather, reduce, reduce_scatter, scan, scatter,
};
use crate::schedule::{Blocks, Machine, Schedule};
use crate::select::Algorithm;
use crate::{CollError, Reducer};

/// Cuts `data` into `parts` nearly equal pieces on `elem`-byte boundaries (zero-copy).
pub fn split(data: &Bytes, parts: u32, elem: usize) -> Vec<Bytes> {
    let elems = data.len() / elem.max(1);
    let (base, extra) = (elems / parts as usize, elems % parts as usize);
    let mut at = 0;
    (0..parts as usize)
        .map(|i| {
            let len = (base + usize::from(i < extra)) * elem;
            let piece = data.slice(at..at + len);
            at += len;
            piece
        })
        .collect()
}

/// How many planned schedules a thread keeps (calls of a few shapes repeat in a loop).
const PLANNED: usize = 64;

/// What a schedule depends on: (algorithm, rank, size, root, segments).
type Shape = (&'static str, u32, u32, u32, u32);

thread_local! {
    /// The schedules this thread planned, most recent last.
    static CACHE: RefCell<Vec<(Shape, Arc<Schedule>)>> = const { RefCell::new(Vec::new()) };
}

/// The schedule of algorithm `name` for rank `r` of `n` with root `root`, planned by `plan` once
/// per thread and shared by later calls of the same shape. A schedule is a pure function of those
/// four, and planning one (a few small allocations) would be about a fifth of an 8 B broadcast
/// (`perf`, 2 ranks over shared memory).
fn planned(name: &'static str, r: u32, n: u32, root: u32, plan: impl FnOnce() -> Schedule) -> Arc<Schedule> {
    planned_in(name, r, n, root, 0, plan)
}

/// [`planned`] for a schedule that also depends on how many segments the data is cut into.
fn planned_in(
    name: &'static str,
    r: u32,
    n: u32,
    root: u32,
    segments: u32,
    plan: impl FnOnce() -> Schedule,
) -> Arc<Schedule> {
    let key = (name, r, n, root, segments);
    CACHE.with(|c| {
        let mut c = c.borrow_mut();
        if let Some((_, s)) = c.iter().rev().find(|(k, _)| *k == key) {
            return s.clone();
        }
        let s = Arc::new(plan());
        if c.len() == PLANNED {
            c.remove(0);
        }
        c.push((key, s.clone()));
        s
    })
}

/// The blocks `ids` laid end to end (zero-copy for a single block).
pub fn concat(blocks: &Blocks, ids: impl IntoIterator<Item = u32>) -> Result<Bytes, CollError> {
    let mut ids = ids.into_iter().peekable();
    let first = ids.next();
    // One block (the common case of small calls): no list of parts either.
    if let (Some(id), None) = (first, ids.peek()) {
        return block(blocks, id).cloned();
    }
    Ok(join(parts(blocks, first.into_iter().chain(ids))?))
}

/// `parts` laid end to end (zero-copy for a single part).
pub fn join(mut parts: Vec<Bytes>) -> Bytes {
    if parts.len() == 1 {
        return parts.pop().expect("one part");
    }
    let mut out = BytesMut::with_capacity(parts.iter().map(Bytes::len).sum());
    parts.iter().for_each(|p| out.extend_from_slice(p));
    out.freeze()
}

fn bad(alg: Algorithm, what: &str) -> CollError {
    CollError::Invalid(format!("{alg} does not implement {what}"))
}

fn rel(r: u32, root: u32, n: u32) -> u32 {
    (r + n - root) % n
}

/// Rank `r`'s machine for a barrier of `n` ranks.
pub fn barrier(r: u32, n: u32, alg: Algorithm) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Dissemination => planned("barrier::dissemination", r, n, 0, || barrier::dissemination(r, n)),
        Algorithm::Linear => planned("barrier::linear", r, n, 0, || barrier::linear(r, n)),
        _ => return Err(bad(alg, "barrier")),
    };
    Ok(Machine::new(s, Blocks::new(), None))
}

/// Broadcast of `data` (present at the root) cut on `elem`-byte boundaries.
pub fn bcast(
    r: u32,
    n: u32,
    root: u32,
    alg: Algorithm,
    data: Option<Bytes>,
    elem: usize,
) -> Result<Machine, CollError> {
    let mut blocks = Blocks::new();
    let s = match alg {
        Algorithm::Binomial | Algorithm::Linear => {
            if let Some(d) = data {
                blocks.insert(0, d);
            }
            if alg == Algorithm::Linear {
                planned("bcast::linear", r, n, root, || bcast::linear(r, n, root))
            } else {
                planned("bcast::binomial", r, n, root, || bcast::binomial(r, n, root))
            }
        }
        Algorithm::ScatterAllgather => {
            if let Some(d) = data {
                blocks.extend((0..n).zip(split(&d, n, elem)));
            }
            planned("bcast::scatter_allgather", r, n, root, || bcast::scatter_allgather(r, n, root))
        }
        // The segment count depends on the length, which non-roots learn only from the caller.
        Algorithm::Pipeline => return Err(bad(alg, "bcast without the length (see bcast_pipeline)")),
        _ => return Err(bad(alg, "bcast")),
    };
    Ok(Machine::new(s, blocks, None))
}

/// The most segments a pipelined broadcast cuts its data into (round numbers stay small).
pub const PIPELINE_MAX_SEGMENTS: u32 = 1024;

/// How many rounds ahead a pipelined broadcast's receives are posted
/// ([`Machine::with_lookahead`]): every segment of a default-table call (two, see
/// [`crate::Table::bcast_chain_segments`]) and of a pinned chain in up to 64 segments, so that
/// each lands in its own buffer as it comes.
pub const PIPELINE_LOOKAHEAD: usize = 64;

/// How many segments a pipelined broadcast of `len` bytes cuts its data into: pieces of at most
/// `segment` bytes (but no more than [`PIPELINE_MAX_SEGMENTS`]), at least one.
pub fn pipeline_segments(len: usize, segment: usize) -> u32 {
    len.div_ceil(segment.max(1)).clamp(1, PIPELINE_MAX_SEGMENTS as usize) as u32
}

/// Broadcast of `data` (present at the root) down a pipelined chain ([`Algorithm::Pipeline`]),
/// cut into `segments` pieces on `elem`-byte boundaries: every rank passes the same `segments`
/// ([`pipeline_segments`] of the length every rank knows; [`Machine::with_segment_lens`] tells
/// the machine the pieces' lengths). The result is [`bcast_result`].
pub fn bcast_pipeline(
    r: u32,
    n: u32,
    root: u32,
    data: Option<Bytes>,
    segments: u32,
    elem: usize,
) -> Result<Machine, CollError> {
    if !(1..=PIPELINE_MAX_SEGMENTS).contains(&segments) {
        return Err(CollError::Invalid(format!("a pipelined broadcast of {segments} segments")));
    }
    let mut blocks = Blocks::new();
    if let Some(d) = data {
        blocks.extend((0..segments).zip(split(&d, segments, elem)));
    }
    let s = planned_in("bcast::pipeline", r, n, root, segments, || bcast::pipeline(r, n, root, segments));
    Ok(Machine::new(s, blocks, None))
}

/// The broadcast data, from the blocks a finished bcast machine holds.
pub fn bcast_result(blocks: &Blocks, n: u32, alg: Algorithm) -> Result<Bytes, CollError> {
    if alg == Algorithm::Pipeline {
        return Ok(join(bcast_parts(blocks, n, alg)?));
    }
    concat(blocks, bcast_ids(n, alg))
}

/// The pieces of the broadcast data in order, shared (not laid end to end): for a caller that
/// copies them out anyway, one pass over the data instead of two.
pub fn bcast_parts(blocks: &Blocks, n: u32, alg: Algorithm) -> Result<Vec<Bytes>, CollError> {
    if alg == Algorithm::Pipeline {
        // Segments 0.. in order: a finished machine holds all of them and nothing else.
        return parts(blocks, 0..blocks.len() as u32);
    }
    parts(blocks, bcast_ids(n, alg))
}

fn bcast_ids(n: u32, alg: Algorithm) -> std::ops::Range<u32> {
    match alg {
        Algorithm::ScatterAllgather => 0..n,
        _ => 0..1,
    }
}

/// The blocks `ids`, in order, shared.
fn parts(blocks: &Blocks, ids: impl IntoIterator<Item = u32>) -> Result<Vec<Bytes>, CollError> {
    ids.into_iter().map(|id| block(blocks, id).cloned()).collect()
}

/// Block `id` of a finished call's result.
fn block(blocks: &Blocks, id: u32) -> Result<&Bytes, CollError> {
    blocks.get(&id).ok_or_else(|| CollError::Invalid(format!("block {id} missing at the end")))
}

/// Reduction of `data` to `root`; the result is block 0 at the root.
pub fn reduce(r: u32, n: u32, root: u32, alg: Algorithm, data: Bytes, op: Reducer) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Binomial if op.is_commutative() => {
            planned("reduce::binomial", r, n, root, || reduce::binomial(r, n, root, 0..1))
        }
        Algorithm::Binomial => {
            planned("reduce::binomial_ordered", r, n, root, || reduce::binomial_ordered(r, n, root, 0..1))
        }
        Algorithm::Linear => planned("reduce::linear", r, n, root, || reduce::linear(r, n, root, 0..1)),
        _ => return Err(bad(alg, "reduce")),
    };
    Ok(Machine::new(s, Blocks::from([(0, data)]), Some(op)))
}

/// All-reduce of `data`; the result is [`allreduce_result`].
pub fn allreduce(r: u32, n: u32, alg: Algorithm, data: Bytes, op: Reducer) -> Result<Machine, CollError> {
    let elem = op.element_size();
    let (s, blocks) = match alg {
        Algorithm::RecursiveDoubling => {
            let s = planned("allreduce::recursive_doubling", r, n, 0, || allreduce::recursive_doubling(r, n));
            (s, Blocks::from([(0, data)]))
        }
        Algorithm::Linear => {
            (planned("allreduce::linear", r, n, 0, || allreduce::linear(r, n)), Blocks::from([(0, data)]))
        }
        Algorithm::Rabenseifner => {
            let k = allreduce::rabenseifner_segments(n);
            let s = planned("allreduce::rabenseifner", r, n, 0, || allreduce::rabenseifner(r, n));
            (s, (0..k).zip(split(&data, k, elem)).collect())
        }
        Algorithm::Ring => {
            (planned("allreduce::ring", r, n, 0, || allreduce::ring(r, n)), (0..n).zip(split(&data, n, elem)).collect())
        }
        _ => return Err(bad(alg, "allreduce")),
    };
    Ok(Machine::new(s, blocks, Some(op)))
}

/// The reduced data, from the blocks a finished allreduce machine holds.
pub fn allreduce_result(blocks: &Blocks, n: u32, alg: Algorithm) -> Result<Bytes, CollError> {
    concat(blocks, allreduce_ids(n, alg))
}

/// The pieces of the all-reduce result in order, shared (not laid end to end): for a caller that
/// copies them out anyway, one pass over the data instead of two.
pub fn allreduce_parts(blocks: &Blocks, n: u32, alg: Algorithm) -> Result<Vec<Bytes>, CollError> {
    parts(blocks, allreduce_ids(n, alg))
}

/// The blocks that make up the all-reduce result, in order.
fn allreduce_ids(n: u32, alg: Algorithm) -> std::ops::Range<u32> {
    match alg {
        Algorithm::Rabenseifner => 0..allreduce::rabenseifner_segments(n),
        Algorithm::Ring => 0..n,
        _ => 0..1,
    }
}

/// Gather of one block per rank (sizes may differ) to `root`; see [`gather_result`].
pub fn gather(r: u32, n: u32, root: u32, alg: Algorithm, data: Bytes) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Binomial => planned("gather::binomial", r, n, root, || gather::binomial(r, n, root)),
        Algorithm::Linear => planned("gather::linear", r, n, root, || gather::linear(r, n, root)),
        _ => return Err(bad(alg, "gather")),
    };
    Ok(Machine::new(s, Blocks::from([(rel(r, root, n), data)]), None))
}

/// The gathered blocks in rank order (at the root).
pub fn gather_result(blocks: &Blocks, n: u32, root: u32) -> Result<Vec<Bytes>, CollError> {
    (0..n).map(|i| concat(blocks, [rel(i, root, n)])).collect()
}

/// Scatter of `parts` (one per rank, at the root); see [`scatter_result`].
pub fn scatter(r: u32, n: u32, root: u32, alg: Algorithm, parts: Option<Vec<Bytes>>) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Binomial => planned("scatter::binomial", r, n, root, || scatter::binomial(r, n, root)),
        Algorithm::Linear => planned("scatter::linear", r, n, root, || scatter::linear(r, n, root)),
        _ => return Err(bad(alg, "scatter")),
    };
    let blocks = parts.map(|p| p.into_iter().enumerate().map(|(i, b)| (rel(i as u32, root, n), b)).collect());
    Ok(Machine::new(s, blocks.unwrap_or_default(), None))
}

/// Rank `r`'s block, from the blocks a finished scatter machine holds.
pub fn scatter_result(blocks: &Blocks, r: u32, n: u32, root: u32) -> Result<Bytes, CollError> {
    concat(blocks, [rel(r, root, n)])
}

/// All-gather of one block per rank (sizes may differ); see [`allgather_result`].
pub fn allgather(r: u32, n: u32, alg: Algorithm, data: Bytes) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Bruck => planned("allgather::bruck", r, n, 0, || allgather::bruck(r, n)),
        Algorithm::Ring => planned("allgather::ring", r, n, 0, || allgather::ring(r, n)),
        Algorithm::RecursiveDoubling if n.is_power_of_two() => {
            planned("allgather::recursive_doubling", r, n, 0, || allgather::recursive_doubling(r, n))
        }
        Algorithm::Linear => planned("allgather::linear", r, n, 0, || allgather::linear(r, n)),
        _ => return Err(bad(alg, "allgather")),
    };
    Ok(Machine::new(s, Blocks::from([(r, data)]), None))
}

/// Every rank's block in rank order, from the blocks a finished allgather machine holds.
pub fn allgather_result(blocks: &Blocks, n: u32) -> Result<Vec<Bytes>, CollError> {
    (0..n).map(|i| concat(blocks, [i])).collect()
}

/// All-to-all: `parts[i]` goes to rank i; see [`alltoall_result`].
pub fn alltoall(r: u32, n: u32, alg: Algorithm, parts: Vec<Bytes>) -> Result<Machine, CollError> {
    if parts.len() != n as usize {
        return Err(CollError::Invalid(format!("all-to-all needs {n} parts, got {}", parts.len())));
    }
    let s = match alg {
        Algorithm::Bruck => planned("alltoall::bruck", r, n, 0, || alltoall::bruck(r, n)),
        Algorithm::Pairwise => planned("alltoall::pairwise", r, n, 0, || alltoall::pairwise(r, n)),
        Algorithm::Linear => planned("alltoall::linear", r, n, 0, || alltoall::linear(r, n)),
        _ => return Err(bad(alg, "alltoall")),
    };
    Ok(Machine::new(s, (0..n).map(|i| r * n + i).zip(parts).collect(), None))
}

/// What each rank sent to `r`, in rank order.
pub fn alltoall_result(blocks: &Blocks, r: u32, n: u32) -> Result<Vec<Bytes>, CollError> {
    (0..n).map(|i| concat(blocks, [i * n + r])).collect()
}

/// Reduce-scatter: `segments[i]` is this rank's contribution to rank i's result.
pub fn reduce_scatter(r: u32, n: u32, alg: Algorithm, segments: Vec<Bytes>, op: Reducer) -> Result<Machine, CollError> {
    if segments.len() != n as usize {
        return Err(CollError::Invalid(format!("reduce-scatter needs {n} segments, got {}", segments.len())));
    }
    let s = match alg {
        Algorithm::Ring if op.is_commutative() => {
            planned("reduce_scatter::ring", r, n, 0, || reduce_scatter::ring(r, n))
        }
        Algorithm::ReduceThenScatter => {
            planned("reduce_scatter::reduce_then_scatter", r, n, 0, || reduce_scatter::reduce_then_scatter(r, n))
        }
        _ => return Err(bad(alg, "reduce_scatter with this operator")),
    };
    Ok(Machine::new(s, (0..n).zip(segments).collect(), Some(op)))
}

/// Rank `r`'s reduced segment, from the blocks a finished reduce-scatter machine holds.
pub fn reduce_scatter_result(blocks: &Blocks, r: u32) -> Result<Bytes, CollError> {
    concat(blocks, [r])
}

/// Inclusive (or exclusive) prefix reduction; see [`scan_result`].
pub fn scan(r: u32, n: u32, data: Bytes, op: Reducer, inclusive: bool) -> Machine {
    let mut blocks = Blocks::from([(0, data.clone())]);
    if inclusive {
        blocks.insert(1, data);
    }
    Machine::new(planned("scan::recursive_doubling", r, n, 0, || scan::recursive_doubling(r, n)), blocks, Some(op))
}

/// The prefix result; `None` for rank 0 of an exclusive scan.
pub fn scan_result(blocks: &Blocks) -> Option<Bytes> {
    blocks.get(&1).cloned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn planned_schedules_are_shared_per_shape_and_bounded() {
        let a = planned("test::binomial", 1, 4, 0, || bcast::binomial(1, 4, 0));
        let b = planned("test::binomial", 1, 4, 0, || unreachable!("planned already"));
        assert!(Arc::ptr_eq(&a, &b));
        let c = planned("test::binomial", 2, 4, 0, || bcast::binomial(2, 4, 0));
        assert!(!Arc::ptr_eq(&a, &c));
        assert_eq!(*c, bcast::binomial(2, 4, 0));
        for r in 0..2 * PLANNED as u32 {
            planned("test::empty", r, 1 << 20, 0, Schedule::new);
        }
        CACHE.with(|c| assert_eq!(c.borrow().len(), PLANNED));
    }

    #[test]
    fn concat_of_one_block_shares_it() {
        let blocks = Blocks::from([(0, Bytes::from_static(b"abc")), (1, Bytes::from_static(b"de"))]);
        assert_eq!(concat(&blocks, [1]).unwrap().as_ptr(), blocks[&1].as_ptr());
        assert_eq!(&concat(&blocks, 0..2).unwrap()[..], b"abcde");
        assert!(matches!(concat(&blocks, [2]), Err(CollError::Invalid(_))));
        assert!(concat(&blocks, 0..0).unwrap().is_empty());
    }
}
