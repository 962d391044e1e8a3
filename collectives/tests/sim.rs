//! Every operation and every algorithm, checked against a sequential reference on the simulated
//! network for 1..=9 and 16 ranks and sizes from empty to several segments per rank, plus 1024
//! ranks for barrier, broadcast, all-reduce and all-gather with round counts checked against the
//! algorithms' formulas.

use bytes::Bytes;
use ferrocomm_collectives::algorithms::rounds;
use ferrocomm_collectives::ops;
use ferrocomm_collectives::sim::{self, Network, Outcome};
use ferrocomm_collectives::{Algorithm, Machine, Operation, ReduceOp};

const RANKS: [u32; 10] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16];
/// Element counts: empty, one, fewer than the ranks, and several per rank.
const COUNTS: [usize; 5] = [0, 1, 5, 37, 300];

fn bytes_of(v: &[u64]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(v))
}

fn u64s(b: &Bytes) -> Vec<u64> {
    bytemuck::pod_collect_to_vec(b)
}

/// Rank r's input: distinct per rank and element.
fn input(r: u32, count: usize) -> Vec<u64> {
    (0..count as u64).map(|i| (r as u64 + 1) * 1_000_003 + i * 7919 + (i * i) % 13).collect()
}

/// A 2x2 matrix of u16 packed in a u64; the product is associative but not commutative.
fn matmul(a: u64, b: u64) -> u64 {
    let m = |x: u64, i: u32| (x >> (16 * i)) as u16;
    let (a0, a1, a2, a3, b0, b1, b2, b3) = (m(a, 0), m(a, 1), m(a, 2), m(a, 3), m(b, 0), m(b, 1), m(b, 2), m(b, 3));
    let e = |x: u16, y: u16, z: u16, w: u16| x.wrapping_mul(y).wrapping_add(z.wrapping_mul(w)) as u64;
    e(a0, b0, a1, b2) | e(a0, b1, a1, b3) << 16 | e(a2, b0, a3, b2) << 32 | e(a2, b1, a3, b3) << 48
}

type Case = (&'static str, ReduceOp<u64>, fn(u64, u64) -> u64);

fn ops_under_test() -> Vec<Case> {
    vec![
        ("sum", ReduceOp::Sum, |a, b| a.wrapping_add(b)),
        ("max", ReduceOp::Max, |a, b| a.max(b)),
        ("bxor", ReduceOp::BitXor, |a, b| a ^ b),
        (
            "matmul",
            ReduceOp::custom(|acc, x| acc.iter_mut().zip(x).for_each(|(a, b)| *a = matmul(*a, *b)), false),
            matmul,
        ),
    ]
}

fn reference(n: u32, count: usize, f: fn(u64, u64) -> u64, ranks: std::ops::Range<u32>) -> Vec<u64> {
    let _ = n;
    let mut acc: Option<Vec<u64>> = None;
    for r in ranks {
        let x = input(r, count);
        acc = Some(match acc {
            None => x,
            Some(a) => a.iter().zip(&x).map(|(a, b)| f(*a, *b)).collect(),
        });
    }
    acc.unwrap_or_default()
}

fn run(machines: Vec<Machine>, seed: u64) -> Outcome {
    sim::run(machines, Network { seed, max_latency: 8 }).expect("simulation completes")
}

fn seed(n: u32, count: usize, alg: Algorithm) -> u64 {
    n as u64 * 1000 + count as u64 * 7 + alg as u64
}

#[test]
fn barrier_all_algorithms() {
    for n in RANKS.into_iter().chain([1024]) {
        for alg in Algorithm::for_operation(Operation::Barrier) {
            let out = run((0..n).map(|r| ops::barrier(r, n, *alg).unwrap()).collect(), n as u64);
            let expect = if *alg == Algorithm::Linear { if n > 1 { 2 } else { 0 } } else { rounds::dissemination(n) };
            assert_eq!(out.rounds, expect, "{alg} n={n}");
        }
    }
}

#[test]
fn bcast_all_algorithms() {
    for n in RANKS {
        for root in [0, n / 2, n - 1] {
            for count in COUNTS {
                for &alg in Algorithm::for_operation(Operation::Bcast) {
                    let data = bytes_of(&input(root, count));
                    if alg == Algorithm::Pipeline {
                        // Needs the length at every rank: its own test below.
                        assert!(ops::bcast(0, n, root, alg, Some(data.clone()), 8).is_err());
                        continue;
                    }
                    let ms = (0..n).map(|r| ops::bcast(r, n, root, alg, (r == root).then(|| data.clone()), 8).unwrap());
                    let out = run(ms.collect(), seed(n, count, alg));
                    for (r, b) in out.blocks.iter().enumerate() {
                        assert_eq!(ops::bcast_result(b, n, alg).unwrap(), data, "{alg} n={n} root={root} rank {r}");
                    }
                }
            }
        }
    }
}

/// The pipelined chain: every rank count, roots at both ends and the middle, sizes from empty to
/// many segments, segment sizes from one element to more than the data, each segment received
/// with the length every rank computes, its receives posted round by round or ahead (none, a few
/// and more rounds than the call has); round counts within the formula's.
#[test]
fn bcast_pipeline_segments() {
    for n in RANKS {
        for root in [0, n / 2, n - 1] {
            for count in COUNTS {
                for (segment, lookahead) in
                    [(8, 0), (8, 3), (24, 0), (24, ops::PIPELINE_LOOKAHEAD), (64, 1), (1 << 20, 2)]
                {
                    let data = bytes_of(&input(root, count));
                    let k = ops::pipeline_segments(data.len(), segment);
                    let ms = (0..n).map(|r| {
                        let m = ops::bcast_pipeline(r, n, root, (r == root).then(|| data.clone()), k, 8).unwrap();
                        m.with_segment_lens(data.len(), k, 8).with_lookahead(lookahead)
                    });
                    let out = run(ms.collect(), seed(n, count, Algorithm::Pipeline) + segment as u64);
                    for (r, b) in out.blocks.iter().enumerate() {
                        let got = ops::bcast_result(b, n, Algorithm::Pipeline).unwrap();
                        assert_eq!(
                            got, data,
                            "pipeline n={n} root={root} count={count} segment={segment} lookahead={lookahead} rank {r}"
                        );
                    }
                    // Lock-step rounds; the causal chain can be shorter (the root sends ahead).
                    assert!(out.rounds <= rounds::pipeline(n, k), "pipeline rounds n={n} segments={k}");
                }
            }
        }
    }
    assert_eq!(ops::pipeline_segments(0, 64 << 10), 1);
    assert_eq!(ops::pipeline_segments(1 << 20, 64 << 10), 16);
    assert_eq!(ops::pipeline_segments(usize::MAX, 1), ops::PIPELINE_MAX_SEGMENTS);
    assert!(ops::bcast_pipeline(0, 4, 0, None, 0, 8).is_err());
}

#[test]
fn reduce_and_allreduce_all_algorithms() {
    for n in RANKS {
        for count in COUNTS {
            for (name, op, f) in ops_under_test() {
                let expect = reference(n, count, f, 0..n);
                for root in [0, n - 1] {
                    for &alg in Algorithm::for_operation(Operation::Reduce) {
                        let ms = (0..n).map(|r| ops::reduce(r, n, root, alg, bytes_of(&input(r, count)), op.erase()));
                        let out = run(ms.map(Result::unwrap).collect(), seed(n, count, alg));
                        assert_eq!(
                            u64s(&out.blocks[root as usize][&0]),
                            expect,
                            "reduce {alg} {name} n={n} root={root}"
                        );
                    }
                }
                for &alg in Algorithm::for_operation(Operation::Allreduce) {
                    if !op.is_commutative() && matches!(alg, Algorithm::Rabenseifner | Algorithm::Ring) {
                        continue;
                    }
                    let ms = (0..n).map(|r| ops::allreduce(r, n, alg, bytes_of(&input(r, count)), op.erase()));
                    let out = run(ms.map(Result::unwrap).collect(), seed(n, count, alg));
                    for (r, b) in out.blocks.iter().enumerate() {
                        let got = u64s(&ops::allreduce_result(b, n, alg).unwrap());
                        assert_eq!(got, expect, "allreduce {alg} {name} n={n} count={count} rank {r}");
                    }
                }
            }
        }
    }
}

/// Per-rank block sizes differ (the v-variants): rank r contributes r % 3 * count elements.
fn varied(r: u32, count: usize) -> Vec<u64> {
    input(r, count * (r as usize % 3))
}

#[test]
fn gather_scatter_allgather_v() {
    for n in RANKS {
        for count in [0, 1, 9] {
            for root in [0, n - 1] {
                for &alg in Algorithm::for_operation(Operation::Gather) {
                    let ms = (0..n).map(|r| ops::gather(r, n, root, alg, bytes_of(&varied(r, count))).unwrap());
                    let out = run(ms.collect(), seed(n, count, alg));
                    let got = ops::gather_result(&out.blocks[root as usize], n, root).unwrap();
                    let want: Vec<Bytes> = (0..n).map(|r| bytes_of(&varied(r, count))).collect();
                    assert_eq!(got, want, "gatherv {alg} n={n} root={root}");

                    let parts = (0..n).map(|r| bytes_of(&varied(r + 100, count))).collect::<Vec<_>>();
                    let ms = (0..n).map(|r| ops::scatter(r, n, root, alg, (r == root).then(|| parts.clone())).unwrap());
                    let out = run(ms.collect(), seed(n, count, alg));
                    for r in 0..n {
                        let got = ops::scatter_result(&out.blocks[r as usize], r, n, root).unwrap();
                        assert_eq!(got, parts[r as usize], "scatterv {alg} n={n} root={root} rank {r}");
                    }
                }
            }
            for &alg in Algorithm::for_operation(Operation::Allgather) {
                if alg == Algorithm::RecursiveDoubling && !n.is_power_of_two() {
                    assert!(ops::allgather(0, n, alg, Bytes::new()).is_err());
                    continue;
                }
                let ms = (0..n).map(|r| ops::allgather(r, n, alg, bytes_of(&varied(r, count))).unwrap());
                let out = run(ms.collect(), seed(n, count, alg));
                let want: Vec<Bytes> = (0..n).map(|r| bytes_of(&varied(r, count))).collect();
                for (r, b) in out.blocks.iter().enumerate() {
                    assert_eq!(ops::allgather_result(b, n).unwrap(), want, "allgatherv {alg} n={n} rank {r}");
                }
            }
        }
    }
}

#[test]
fn alltoall_v_all_algorithms() {
    for n in RANKS {
        for count in [0, 1, 6] {
            // What rank s sends to rank d: (s + 2d) % 3 * count elements.
            let part = |s: u32, d: u32| bytes_of(&input(s * 64 + d, count * ((s + 2 * d) % 3) as usize));
            for &alg in Algorithm::for_operation(Operation::Alltoall) {
                let ms = (0..n).map(|r| ops::alltoall(r, n, alg, (0..n).map(|d| part(r, d)).collect()).unwrap());
                let out = run(ms.collect(), seed(n, count, alg));
                for (r, b) in out.blocks.iter().enumerate() {
                    let want: Vec<Bytes> = (0..n).map(|s| part(s, r as u32)).collect();
                    assert_eq!(ops::alltoall_result(b, r as u32, n).unwrap(), want, "alltoallv {alg} n={n} rank {r}");
                }
                if n > 1 {
                    let expect = match alg {
                        Algorithm::Bruck => rounds::bruck(n),
                        Algorithm::Pairwise => n - 1,
                        _ => 1,
                    };
                    assert_eq!(out.rounds, expect, "{alg} n={n}");
                }
            }
        }
    }
}

#[test]
fn reduce_scatter_and_scan() {
    for n in RANKS {
        for count in [0, 1, 5] {
            for (name, op, f) in ops_under_test() {
                // Rank r's contribution to segment d has (d % 2 + 1) * count elements.
                let seg = |r: u32, d: u32| input(r * 31 + d, count * (d as usize % 2 + 1));
                for &alg in Algorithm::for_operation(Operation::ReduceScatter) {
                    if !op.is_commutative() && alg == Algorithm::Ring {
                        assert!(ops::reduce_scatter(0, n, alg, vec![Bytes::new(); n as usize], op.erase()).is_err());
                        continue;
                    }
                    let ms = (0..n).map(|r| {
                        ops::reduce_scatter(r, n, alg, (0..n).map(|d| bytes_of(&seg(r, d))).collect(), op.erase())
                    });
                    let out = run(ms.map(Result::unwrap).collect(), seed(n, count, alg));
                    for d in 0..n {
                        let want = (0..n)
                            .map(|r| seg(r, d))
                            .reduce(|a, b| a.iter().zip(&b).map(|(x, y)| f(*x, *y)).collect())
                            .unwrap();
                        let got = u64s(&ops::reduce_scatter_result(&out.blocks[d as usize], d).unwrap());
                        assert_eq!(got, want, "reduce_scatter {alg} {name} n={n} rank {d}");
                    }
                }
                for inclusive in [true, false] {
                    let ms = (0..n).map(|r| ops::scan(r, n, bytes_of(&input(r, count)), op.erase(), inclusive));
                    let out = run(ms.collect(), n as u64 + count as u64);
                    for r in 0..n {
                        let end = if inclusive { r + 1 } else { r };
                        let got = ops::scan_result(&out.blocks[r as usize]).map(|b| u64s(&b));
                        let want = (end > 0).then(|| reference(n, count, f, 0..end));
                        assert_eq!(got, want, "scan inclusive={inclusive} {name} n={n} rank {r}");
                    }
                    // Lock-step rounds are ceil(log2 n); the causal chain can be shorter.
                    assert!(out.rounds <= rounds::bruck(n), "scan rounds n={n}");
                }
            }
        }
    }
}

/// 1024 ranks: results and round counts of barrier, broadcast, all-reduce and all-gather.
#[test]
fn thousand_ranks() {
    let n = 1024;
    for (root, alg) in [(0, Algorithm::Binomial), (517, Algorithm::Binomial), (3, Algorithm::ScatterAllgather)] {
        let data = bytes_of(&input(root, 4096));
        let ms = (0..n).map(|r| ops::bcast(r, n, root, alg, (r == root).then(|| data.clone()), 8).unwrap());
        let out = run(ms.collect(), 99);
        assert!(out.blocks.iter().all(|b| ops::bcast_result(b, n, alg).unwrap() == data), "bcast {alg}");
        let expect = if alg == Algorithm::Binomial { rounds::binomial(n) } else { rounds::scatter_allgather(n) };
        assert_eq!(out.rounds, expect, "bcast {alg} rounds");
    }
    for (n, alg, expect) in [
        (1024, Algorithm::RecursiveDoubling, rounds::recursive_doubling_allreduce(1024)),
        (1000, Algorithm::RecursiveDoubling, rounds::recursive_doubling_allreduce(1000)),
        (1024, Algorithm::Rabenseifner, rounds::rabenseifner(1024)),
        (1000, Algorithm::Rabenseifner, rounds::rabenseifner(1000)),
        (1024, Algorithm::Ring, rounds::ring_allreduce(1024)),
    ] {
        let count = 2048;
        let ms = (0..n).map(|r| ops::allreduce(r, n, alg, bytes_of(&input(r, count)), ReduceOp::<u64>::Sum.erase()));
        let out = run(ms.map(Result::unwrap).collect(), 7);
        let want = reference(n, count, |a, b| a.wrapping_add(b), 0..n);
        for b in &out.blocks {
            assert_eq!(u64s(&ops::allreduce_result(b, n, alg).unwrap()), want, "allreduce {alg} n={n}");
        }
        assert_eq!(out.rounds, expect, "allreduce {alg} n={n} rounds");
    }
    for (alg, expect) in [
        (Algorithm::Bruck, rounds::bruck(n)),
        (Algorithm::RecursiveDoubling, rounds::bruck(n)),
        (Algorithm::Ring, rounds::ring(n)),
    ] {
        let ms = (0..n).map(|r| ops::allgather(r, n, alg, bytes_of(&input(r, 2))).unwrap());
        let out = run(ms.collect(), 5);
        let want: Vec<Bytes> = (0..n).map(|r| bytes_of(&input(r, 2))).collect();
        assert!(out.blocks.iter().all(|b| ops::allgather_result(b, n).unwrap() == want), "allgather {alg}");
        assert_eq!(out.rounds, expect, "allgather {alg} rounds");
    }
    let out = run((0..n).map(|r| ops::barrier(r, n, Algorithm::Dissemination).unwrap()).collect(), 3);
    assert_eq!(out.rounds, rounds::dissemination(n));
}

/// Arrival order never changes a floating-point result: receives of a round apply in schedule
/// order, so every seed gives the same bits.
#[test]
fn results_do_not_depend_on_arrival_order() {
    let n = 7;
    let data = |r: u32| Bytes::copy_from_slice(bytemuck::cast_slice(&[0.1f64 * r as f64 + 1e-9, 1e16, -1e16]));
    let mut first = None;
    for seed in 0..20 {
        for alg in [Algorithm::Linear, Algorithm::RecursiveDoubling] {
            let ms = (0..n).map(|r| ops::allreduce(r, n, alg, data(r), ReduceOp::<f64>::Sum.erase()).unwrap());
            let out = sim::run(ms.collect(), Network { seed, max_latency: 50 }).unwrap();
            let got = ops::allreduce_result(&out.blocks[0], n, alg).unwrap();
            assert!(out.blocks.iter().all(|b| ops::allreduce_result(b, n, alg).unwrap() == got));
            first.get_or_insert_with(|| (alg, got.clone()));
            if first.as_ref().unwrap().0 == alg {
                assert_eq!(first.as_ref().unwrap().1, got, "seed {seed}");
            }
        }
    }
}
