//! Half-precision reductions (`f16`, `bf16`) by every algorithm on the simulated network, against
//! a sequential `f64` reference.
//!
//! Stated tolerance: a sum of `n` ranks' values may be off by at most `γ(n−1) · Σ|xᵢ|` per element,
//! `γ(k) = k·u / (1 − k·u)`, `u` the unit roundoff (`2⁻¹¹` for `f16`, `2⁻⁸` for `bf16`): any
//! combination tree of `n` values has `n − 1` steps, each one correctly rounded half operation
//! (see `ferrocomm_collectives::reduce`). Also checked: each algorithm's result is the
//! same on every rank; `Min`/`Max` and sums that never round give the same bits by every
//! algorithm.

use bytes::Bytes;
use ferrocomm_collectives::ops;
use ferrocomm_collectives::sim::{self, Network, Outcome};
use ferrocomm_collectives::{Algorithm, Element, Machine, Operation, ReduceOp, bf16, f16};

const RANKS: [u32; 8] = [2, 3, 4, 5, 7, 8, 9, 16];
/// Element counts: one, fewer than the ranks, several per rank, and over the block size of the
/// half types' slice operations.
const COUNTS: [usize; 4] = [1, 5, 37, 700];

/// What the test needs of a half type beyond [`Element`].
trait Half: Element + std::fmt::Debug {
    /// Unit roundoff: half the spacing of values in [1, 2).
    const U: f64;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
    fn bits(self) -> u16;
}

impl Half for f16 {
    const U: f64 = 1.0 / 2048.0;
    fn from_f64(v: f64) -> Self {
        f16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        f16::to_f64(self)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
}

impl Half for bf16 {
    const U: f64 = 1.0 / 256.0;
    fn from_f64(v: f64) -> Self {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
    fn bits(self) -> u16 {
        self.to_bits()
    }
}

/// Rank r's input: values in (−4, 4) of both signs, distinct per rank and element (rounded to
/// the type; the reference sums these rounded values exactly).
fn input<T: Half>(r: u32, count: usize) -> Vec<T> {
    let mut x = (r as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..count)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            T::from_f64(((x >> 11) as f64 / (1u64 << 53) as f64 - 0.5) * 8.0)
        })
        .collect()
}

/// Small integers: every partial sum of up to 16 ranks is exact in both types.
fn integers<T: Half>(r: u32, count: usize) -> Vec<T> {
    (0..count).map(|i| T::from_f64(((r as usize * 7 + i * 3) % 15) as f64 - 7.0)).collect()
}

fn bytes_of<T: Half>(v: &[T]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(v))
}

fn values<T: Half>(b: &Bytes) -> Vec<T> {
    bytemuck::pod_collect_to_vec(b)
}

fn run(machines: Vec<Machine>, seed: u64) -> Outcome {
    sim::run(machines, Network { seed, max_latency: 8 }).expect("simulation completes")
}

/// The tolerance of a sum of `n` terms whose magnitudes add up to `abs`.
fn tolerance<T: Half>(n: u32, abs: f64) -> f64 {
    let k = (n - 1) as f64;
    k * T::U / (1.0 - k * T::U) * abs
}

/// Every all-reduce algorithm and every reduce algorithm (both roots) for `T` on `data`; returns
/// the result bits of each algorithm (the same on every rank, checked).
fn allreduce_all<T: Half>(
    n: u32,
    count: usize,
    op: &ReduceOp<T>,
    data: fn(u32, usize) -> Vec<T>,
) -> Vec<(String, Vec<T>)> {
    let mut out = Vec::new();
    for &alg in Algorithm::for_operation(Operation::Allreduce) {
        let ms = (0..n).map(|r| ops::allreduce(r, n, alg, bytes_of(&data(r, count)), op.erase()).unwrap());
        let o = run(ms.collect(), n as u64 * 31 + count as u64);
        let first: Vec<T> = values(&ops::allreduce_result(&o.blocks[0], n, alg).unwrap());
        for (r, b) in o.blocks.iter().enumerate() {
            let got: Vec<T> = values(&ops::allreduce_result(b, n, alg).unwrap());
            let same = got.iter().zip(&first).all(|(a, b)| a.bits() == b.bits());
            assert!(same && got.len() == count, "{} allreduce {alg} n={n} count={count}: rank {r} differs", T::NAME);
        }
        out.push((format!("allreduce {alg}"), first));
    }
    for &alg in Algorithm::for_operation(Operation::Reduce) {
        for root in [0, n - 1] {
            let ms = (0..n).map(|r| ops::reduce(r, n, root, alg, bytes_of(&data(r, count)), op.erase()).unwrap());
            let o = run(ms.collect(), n as u64 * 17 + count as u64);
            out.push((format!("reduce {alg} root {root}"), values(&o.blocks[root as usize][&0])));
        }
    }
    out
}

fn sums_within_tolerance<T: Half>() {
    let mut rounded = 0;
    for n in RANKS {
        for count in COUNTS {
            let inputs: Vec<Vec<T>> = (0..n).map(|r| input(r, count)).collect();
            let exact: Vec<f64> = (0..count).map(|i| inputs.iter().map(|x| x[i].to_f64()).sum()).collect();
            let abs: Vec<f64> = (0..count).map(|i| inputs.iter().map(|x| x[i].to_f64().abs()).sum()).collect();
            for (alg, got) in allreduce_all::<T>(n, count, &ReduceOp::Sum, input) {
                for i in 0..count {
                    let (g, e) = (got[i].to_f64(), exact[i]);
                    let tol = tolerance::<T>(n, abs[i]);
                    assert!((g - e).abs() <= tol, "{} {alg} n={n} [{i}]: {g} vs exact {e} (tolerance {tol})", T::NAME);
                    rounded += usize::from(g != e);
                }
            }
        }
    }
    // The inputs make the steps round (the check above is not vacuous).
    assert!(rounded > 1000, "{}: only {rounded} results differ from the exact sum", T::NAME);
}

#[test]
fn f16_sums_by_every_algorithm_are_within_the_stated_tolerance() {
    sums_within_tolerance::<f16>();
}

#[test]
fn bf16_sums_by_every_algorithm_are_within_the_stated_tolerance() {
    sums_within_tolerance::<bf16>();
}

/// A case that never rounds: its name, operator, inputs and the operator on `f64`.
type Exact<T> = (&'static str, ReduceOp<T>, fn(u32, usize) -> Vec<T>, fn(f64, f64) -> f64);

/// Where no step rounds, and for `Min`/`Max`, every algorithm gives the same bits: the exact
/// result.
fn exact_cases_agree<T: Half>() {
    for n in RANKS {
        for count in COUNTS {
            let cases: [Exact<T>; 3] = [
                ("sum of integers", ReduceOp::Sum, integers, |a, b| a + b),
                ("min", ReduceOp::Min, input, f64::min),
                ("max", ReduceOp::Max, input, f64::max),
            ];
            for (name, op, data, f) in cases {
                let want: Vec<f64> =
                    (0..count).map(|i| (0..n).map(|r| data(r, count)[i].to_f64()).reduce(f).expect("ranks")).collect();
                for (alg, got) in allreduce_all::<T>(n, count, &op, data) {
                    let got: Vec<f64> = got.iter().map(|v| v.to_f64()).collect();
                    assert_eq!(got, want, "{} {name} {alg} n={n} count={count}", T::NAME);
                }
            }
        }
    }
}

#[test]
fn exact_reductions_agree_across_algorithms() {
    exact_cases_agree::<f16>();
    exact_cases_agree::<bf16>();
}

/// Reduce-scatter and scan with `f16`: each rank's part against the reference, within the same
/// tolerance.
#[test]
fn reduce_scatter_and_scan_in_f16() {
    for n in [2, 3, 5, 8] {
        let count = 37;
        let seg = |r: u32, d: u32| input::<f16>(r * 31 + d, count);
        for &alg in Algorithm::for_operation(Operation::ReduceScatter) {
            let sum = ReduceOp::<f16>::Sum.erase();
            let ms = (0..n)
                .map(|r| ops::reduce_scatter(r, n, alg, (0..n).map(|d| bytes_of(&seg(r, d))).collect(), sum.clone()));
            let o = run(ms.map(Result::unwrap).collect(), n as u64);
            for d in 0..n {
                let got: Vec<f16> = values(&ops::reduce_scatter_result(&o.blocks[d as usize], d).unwrap());
                for (i, g) in got.iter().enumerate() {
                    let exact: f64 = (0..n).map(|r| seg(r, d)[i].to_f64()).sum();
                    let abs: f64 = (0..n).map(|r| seg(r, d)[i].to_f64().abs()).sum();
                    let tol = tolerance::<f16>(n, abs);
                    assert!((g.to_f64() - exact).abs() <= tol, "reduce_scatter {alg} n={n} rank {d} [{i}]");
                }
            }
        }
        let ms = (0..n).map(|r| ops::scan(r, n, bytes_of(&input::<f16>(r, count)), ReduceOp::<f16>::Sum.erase(), true));
        let o = run(ms.collect(), n as u64 + 1);
        for r in 0..n {
            let got: Vec<f16> = values(&ops::scan_result(&o.blocks[r as usize]).expect("inclusive"));
            for (i, g) in got.iter().enumerate() {
                let exact: f64 = (0..=r).map(|q| input::<f16>(q, count)[i].to_f64()).sum();
                let abs: f64 = (0..=r).map(|q| input::<f16>(q, count)[i].to_f64().abs()).sum();
                let tol = tolerance::<f16>(r + 1, abs);
                assert!((g.to_f64() - exact).abs() <= tol, "scan n={n} rank {r} [{i}]");
            }
        }
    }
}
