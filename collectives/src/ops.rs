//! From an operation call to a running [`Machine`], and from its final blocks to the result.
//!
//! Each function here plans one operation for one rank: it picks the schedule of the chosen
//! algorithm, lays the caller's data out as blocks, and says how to read the result back. Data is
//! shared (`Bytes`), never copied, on the way in; results are zero-copy when they are one block.

use bytes::{Bytes, BytesMut};

use crate::algorithms::{
    allgather, allreduce, alltoall, barrier, bcast, gather, reduce, reduce_scatter, scan, scatter,
};
use crate::schedule::{Blocks, Machine};
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

/// The blocks `ids` laid end to end (zero-copy for a single block).
pub fn concat(blocks: &Blocks, ids: impl IntoIterator<Item = u32>) -> Result<Bytes, CollError> {
    let parts: Vec<&Bytes> = ids
        .into_iter()
        .map(|id| blocks.get(&id).ok_or_else(|| CollError::Invalid(format!("block {id} missing at the end"))))
        .collect::<Result<_, _>>()?;
    if let [one] = parts[..] {
        return Ok(one.clone());
    }
    let mut out = BytesMut::with_capacity(parts.iter().map(|p| p.len()).sum());
    parts.iter().for_each(|p| out.extend_from_slice(p));
    Ok(out.freeze())
}

fn bad(alg: Algorithm, what: &str) -> CollError {
    CollError::Invalid(format!("{alg} does not implement {what}"))
}

fn rel(r: u32, root: u32, n: u32) -> u32 {
    (r + n - root) % n
}

pub fn barrier(r: u32, n: u32, alg: Algorithm) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Dissemination => barrier::dissemination(r, n),
        Algorithm::Linear => barrier::linear(r, n),
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
            if alg == Algorithm::Linear { bcast::linear(r, n, root) } else { bcast::binomial(r, n, root) }
        }
        Algorithm::ScatterAllgather => {
            if let Some(d) = data {
                blocks.extend((0..n).zip(split(&d, n, elem)));
            }
            bcast::scatter_allgather(r, n, root)
        }
        _ => return Err(bad(alg, "bcast")),
    };
    Ok(Machine::new(s, blocks, None))
}

pub fn bcast_result(blocks: &Blocks, n: u32, alg: Algorithm) -> Result<Bytes, CollError> {
    match alg {
        Algorithm::ScatterAllgather => concat(blocks, 0..n),
        _ => concat(blocks, [0]),
    }
}

/// Reduction of `data` to `root`; the result is block 0 at the root.
pub fn reduce(r: u32, n: u32, root: u32, alg: Algorithm, data: Bytes, op: Reducer) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Binomial if op.is_commutative() => reduce::binomial(r, n, root, 0..1),
        Algorithm::Binomial => reduce::binomial_ordered(r, n, root, 0..1),
        Algorithm::Linear => reduce::linear(r, n, root, 0..1),
        _ => return Err(bad(alg, "reduce")),
    };
    Ok(Machine::new(s, Blocks::from([(0, data)]), Some(op)))
}

/// All-reduce of `data`; the result is [`allreduce_result`].
pub fn allreduce(r: u32, n: u32, alg: Algorithm, data: Bytes, op: Reducer) -> Result<Machine, CollError> {
    let elem = op.element_size();
    let (s, blocks) = match alg {
        Algorithm::RecursiveDoubling => (allreduce::recursive_doubling(r, n), Blocks::from([(0, data)])),
        Algorithm::Linear => (allreduce::linear(r, n), Blocks::from([(0, data)])),
        Algorithm::Rabenseifner => {
            let k = allreduce::rabenseifner_segments(n);
            (allreduce::rabenseifner(r, n), (0..k).zip(split(&data, k, elem)).collect())
        }
        Algorithm::Ring => (allreduce::ring(r, n), (0..n).zip(split(&data, n, elem)).collect()),
        _ => return Err(bad(alg, "allreduce")),
    };
    Ok(Machine::new(s, blocks, Some(op)))
}

pub fn allreduce_result(blocks: &Blocks, n: u32, alg: Algorithm) -> Result<Bytes, CollError> {
    match alg {
        Algorithm::Rabenseifner => concat(blocks, 0..allreduce::rabenseifner_segments(n)),
        Algorithm::Ring => concat(blocks, 0..n),
        _ => concat(blocks, [0]),
    }
}

/// Gather of one block per rank (sizes may differ) to `root`; see [`gather_result`].
pub fn gather(r: u32, n: u32, root: u32, alg: Algorithm, data: Bytes) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Binomial => gather::binomial(r, n, root),
        Algorithm::Linear => gather::linear(r, n, root),
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
        Algorithm::Binomial => scatter::binomial(r, n, root),
        Algorithm::Linear => scatter::linear(r, n, root),
        _ => return Err(bad(alg, "scatter")),
    };
    let blocks = parts.map(|p| p.into_iter().enumerate().map(|(i, b)| (rel(i as u32, root, n), b)).collect());
    Ok(Machine::new(s, blocks.unwrap_or_default(), None))
}

pub fn scatter_result(blocks: &Blocks, r: u32, n: u32, root: u32) -> Result<Bytes, CollError> {
    concat(blocks, [rel(r, root, n)])
}

/// All-gather of one block per rank (sizes may differ); see [`allgather_result`].
pub fn allgather(r: u32, n: u32, alg: Algorithm, data: Bytes) -> Result<Machine, CollError> {
    let s = match alg {
        Algorithm::Bruck => allgather::bruck(r, n),
        Algorithm::Ring => allgather::ring(r, n),
        Algorithm::RecursiveDoubling if n.is_power_of_two() => allgather::recursive_doubling(r, n),
        Algorithm::Linear => allgather::linear(r, n),
        _ => return Err(bad(alg, "allgather")),
    };
    Ok(Machine::new(s, Blocks::from([(r, data)]), None))
}

pub fn allgather_result(blocks: &Blocks, n: u32) -> Result<Vec<Bytes>, CollError> {
    (0..n).map(|i| concat(blocks, [i])).collect()
}

/// All-to-all: `parts[i]` goes to rank i; see [`alltoall_result`].
pub fn alltoall(r: u32, n: u32, alg: Algorithm, parts: Vec<Bytes>) -> Result<Machine, CollError> {
    if parts.len() != n as usize {
        return Err(CollError::Invalid(format!("all-to-all needs {n} parts, got {}", parts.len())));
    }
    let s = match alg {
        Algorithm::Bruck => alltoall::bruck(r, n),
        Algorithm::Pairwise => alltoall::pairwise(r, n),
        Algorithm::Linear => alltoall::linear(r, n),
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
        Algorithm::Ring if op.is_commutative() => reduce_scatter::ring(r, n),
        Algorithm::ReduceThenScatter => reduce_scatter::reduce_then_scatter(r, n),
        _ => return Err(bad(alg, "reduce_scatter with this operator")),
    };
    Ok(Machine::new(s, (0..n).zip(segments).collect(), Some(op)))
}

pub fn reduce_scatter_result(blocks: &Blocks, r: u32) -> Result<Bytes, CollError> {
    concat(blocks, [r])
}

/// Inclusive (or exclusive) prefix reduction; see [`scan_result`].
pub fn scan(r: u32, n: u32, data: Bytes, op: Reducer, inclusive: bool) -> Machine {
    let mut blocks = Blocks::from([(0, data.clone())]);
    if inclusive {
        blocks.insert(1, data);
    }
    Machine::new(scan::recursive_doubling(r, n), blocks, Some(op))
}

/// The prefix result; `None` for rank 0 of an exclusive scan.
pub fn scan_result(blocks: &Blocks) -> Option<Bytes> {
    blocks.get(&1).cloned()
}
