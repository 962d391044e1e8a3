//! The collectives suite: every operation, every algorithm (pinned through the communicator's
//! table) and sizes crossing every switch, each result checked against a sequential reference that
//! every rank computes locally from the deterministic inputs.

#![allow(dead_code)]

use bytes::Bytes;
use ferrocomm::Table;
use ferrocomm::{Algorithm, Comm, Deadline, Error, Operation, ReduceOp};

/// Rank r's input of `count` elements.
pub(crate) fn input(r: u32, count: usize) -> Vec<u64> {
    (0..count as u64).map(|i| (r as u64 + 1).wrapping_mul(0x9e37_79b9) ^ i.wrapping_mul(7919)).collect()
}

fn sum_ref(n: u32, count: usize, ranks: std::ops::Range<u32>) -> Vec<u64> {
    let _ = n;
    let mut acc = vec![0u64; count];
    for r in ranks {
        acc.iter_mut().zip(input(r, count)).for_each(|(a, x)| *a = a.wrapping_add(x));
    }
    acc
}

/// Element counts (u64) for the default-table run: empty, one, and sizes either side of every
/// threshold of the default table and of the 64 KiB eager limit.
pub(crate) const TABLE_COUNTS: [usize; 7] = [0, 1, 31, 2_500, 9_000, 20_000, 300_000];
/// Element counts for runs with a pinned algorithm.
pub(crate) const PINNED_COUNTS: [usize; 4] = [0, 1, 100, 12_000];
/// Element counts for the shared-memory board: up to its capacity per call (64 KiB: 8192 u64 up
/// to 32 ranks) and beyond it, where a call is split into several.
pub(crate) const BOARD_COUNTS: [usize; 6] = [0, 1, 100, 8_192, 8_193, 20_000];
/// `c` with every operation the shared-memory board serves pinned to it ([`BOARD`]).
pub(crate) fn on_board(c: &Comm) -> Comm {
    c.with_collective_table(Table::default().with_overrides(BOARD).unwrap())
}

/// Pins every operation the shared-memory board serves to it.
pub(crate) const BOARD: &str = "barrier=shared-memory,bcast=shared-memory,reduce=shared-memory,allreduce=shared-memory,\
                         gather=shared-memory,scatter=shared-memory,allgather=shared-memory,\
                         alltoall=shared-memory,reduce_scatter=shared-memory,scan=shared-memory";

/// Pins every operation single copy serves to it (the others keep the table).
pub(crate) const SINGLE_COPY: &str = "bcast=single-copy,allreduce=single-copy,reduce=single-copy,gather=single-copy,\
                                       scatter=single-copy,allgather=single-copy,alltoall=single-copy,\
                                       reduce_scatter=single-copy,scan=single-copy";
/// Element counts for single copy: empty, one, fewer elements than ranks, uneven parts, and parts
/// above the 256 KiB piece of the reduction (u64: on up to 4 ranks). A reduce's root combines
/// alone below 1 MiB (9_001) and shares the combining out above it (140_001).
pub(crate) const SINGLE_COPY_COUNTS: [usize; 5] = [0, 1, 5, 9_001, 140_001];
/// `c` with every operation single copy serves pinned to it ([`SINGLE_COPY`]).
pub(crate) fn single_copy(c: &Comm) -> Comm {
    c.with_collective_table(Table::default().with_overrides(SINGLE_COPY).unwrap())
}

/// Runs every operation with the communicator's current table on each count.
pub(crate) async fn operations(c: &Comm, counts: &[usize], label: &str) {
    let (r, n) = (c.rank(), c.size());
    for &count in counts {
        let ctx = format!("{label} n={n} count={count} rank {r}");
        // Broadcast from two roots.
        for root in [0, n - 1] {
            let mut buf = if r == root { input(root, count) } else { vec![0; count] };
            c.broadcast(root, &mut buf).await.unwrap();
            assert_eq!(buf, input(root, count), "broadcast root {root} {ctx}");
        }
        // Reductions.
        let mut buf = input(r, count);
        c.allreduce(&mut buf, ReduceOp::Sum).await.unwrap();
        assert_eq!(buf, sum_ref(n, count, 0..n), "allreduce {ctx}");
        let root = n / 2;
        let got = c.reduce(root, &input(r, count), ReduceOp::Sum).await.unwrap();
        assert_eq!(got, (r == root).then(|| sum_ref(n, count, 0..n)), "reduce {ctx}");
        let mut out = if r == root { vec![u64::MAX; count] } else { Vec::new() };
        c.reduce_into(root, &input(r, count), (r == root).then_some(&mut out[..]), ReduceOp::Sum).await.unwrap();
        if r == root {
            assert_eq!(out, sum_ref(n, count, 0..n), "reduce_into {ctx}");
        }
        // Gather / scatter / allgather (uniform).
        let small = count.min(2_000);
        let got = c.gather(root, &input(r, small)).await.unwrap();
        let all: Vec<u64> = (0..n).flat_map(|i| input(i, small)).collect();
        assert_eq!(got, (r == root).then(|| all.clone()), "gather {ctx}");
        let got = c.scatter(root, (r == root).then_some(&all[..])).await.unwrap();
        assert_eq!(got, input(r, small), "scatter {ctx}");
        // Into a buffer of the block's length, which every rank knows: the tiers of one host.
        scatter_into(c, root, count.min(20_000), &ctx).await;
        gather_into(c, root, count.min(20_000), &ctx).await;
        assert_eq!(c.allgather(&input(r, small)).await.unwrap(), all, "allgather {ctx}");
        let mut out = vec![u64::MAX; all.len()];
        c.allgather_into(&input(r, small), &mut out).await.unwrap();
        assert_eq!(out, all, "allgather_into {ctx}");
        // All-to-all: part for rank d is input(r * 100 + d).
        let per = count.min(4_000) / n as usize;
        let mine: Vec<u64> = (0..n).flat_map(|d| input(r * 100 + d, per)).collect();
        let want: Vec<u64> = (0..n).flat_map(|s| input(s * 100 + r, per)).collect();
        assert_eq!(c.alltoall(&mine).await.unwrap(), want, "alltoall {ctx}");
        let mut out = vec![u64::MAX; mine.len()];
        c.alltoall_into(&mine, &mut out).await.unwrap();
        assert_eq!(out, want, "alltoall_into {ctx}");
        let mut short = vec![0u64; mine.len() + 1];
        assert!(matches!(c.alltoall_into(&mine, &mut short).await, Err(Error::Invalid(_))), "alltoall_into {ctx}");
        // Reduce-scatter with uneven counts.
        let counts: Vec<usize> = (0..n as usize).map(|i| (count / n as usize) + (i % 2)).collect();
        let total: usize = counts.iter().sum();
        let got = c.reduce_scatter(&input(r, total), &counts, ReduceOp::Sum).await.unwrap();
        let start: usize = counts[..r as usize].iter().sum();
        assert_eq!(got, sum_ref(n, total, 0..n)[start..start + counts[r as usize]], "reduce_scatter {ctx}");
        // Equal blocks into a buffer (the future borrows the data: in place by single copy).
        let block = count / n as usize;
        let whole = input(r, block * n as usize);
        let mut out = vec![u64::MAX; block];
        c.reduce_scatter_block_into(&whole, &mut out, ReduceOp::Sum).await.unwrap();
        let want = sum_ref(n, block * n as usize, 0..n)[r as usize * block..(r as usize + 1) * block].to_vec();
        let alg = c.collective_algorithm(Operation::ReduceScatter, block * n as usize * 8);
        assert_eq!(out, want, "reduce_scatter_block_into {alg} {ctx}");
        let mut short = vec![0u64; block + 1];
        let e = c.reduce_scatter_block_into(&whole, &mut short, ReduceOp::Sum).await;
        assert!(matches!(e, Err(Error::Invalid(_))), "reduce_scatter_block_into {ctx}: {e:?}");
        // Scans.
        let scan_count = count.min(5_000);
        let mut buf = input(r, scan_count);
        c.scan(&mut buf, ReduceOp::Sum).await.unwrap();
        assert_eq!(buf, sum_ref(n, scan_count, 0..r + 1), "scan {ctx}");
        let got = c.exscan(&input(r, scan_count), ReduceOp::Sum).await.unwrap();
        assert_eq!(got, (r > 0).then(|| sum_ref(n, scan_count, 0..r)), "exscan {ctx}");
        c.barrier().await.unwrap();
    }
    v_variants(c, label).await;
    non_commutative(c, label).await;
}

/// Block counts (u64) of a scatter and a gather either side of each switch of the default table
/// on one host: the board (8 KiB blocks, and for a scatter all blocks within the board's
/// capacity, which 9 ranks exceed at 8 KiB) and single copy (64 KiB blocks).
pub(crate) const ROOTED_COUNTS: [usize; 6] = [1, 1_024, 1_025, 8_191, 8_192, 20_000];

/// A scatter from `root` of `count` elements per rank into each rank's buffer, checked against
/// the reference; the root's data is block r = `input(r + 50, count)`.
pub(crate) async fn scatter_into(c: &Comm, root: u32, count: usize, ctx: &str) {
    let (r, n) = (c.rank(), c.size());
    let whole: Vec<u64> = if r == root { (0..n).flat_map(|i| input(i + 50, count)).collect() } else { Vec::new() };
    let mut out = vec![u64::MAX; count];
    c.scatter_into(root, (r == root).then_some(&whole[..]), &mut out).await.unwrap();
    let alg = c.collective_algorithm(Operation::Scatter, count * 8);
    assert_eq!(out, input(r + 50, count), "scatter_into {alg} {ctx}");
}

/// A gather at `root` of `count` elements per rank into the root's buffer, checked against the
/// reference; rank r's data is `input(r + 60, count)`.
pub(crate) async fn gather_into(c: &Comm, root: u32, count: usize, ctx: &str) {
    let (r, n) = (c.rank(), c.size());
    let mut out = if r == root { vec![u64::MAX; count * n as usize] } else { Vec::new() };
    let dst = (r == root).then_some(&mut out[..]);
    c.gather_into(root, &input(r + 60, count), dst).await.unwrap();
    if r == root {
        let all: Vec<u64> = (0..n).flat_map(|i| input(i + 60, count)).collect();
        let alg = c.collective_algorithm(Operation::Gather, count * 8);
        assert_eq!(out, all, "gather_into {alg} {ctx}");
    }
}

/// Single-copy calls that lend two regions a rank (a scan on more than 4 ranks from 256 KiB: the
/// data and a result buffer; a gather's root its result on more than 2 ranks; a reduce on 2 ranks
/// and from 1 MiB), and the plain ones: rank 1 drops its call before its first poll. The others
/// fail promptly with a typed error where they read its memory (and complete or fail so
/// elsewhere), whatever rank 1 does next (nothing on the board until the all-reduce for adaptive
/// ranks, whose barrier goes by messages), and the communicator's next calls work for everyone.
pub(crate) async fn lending_calls_dropped(w: &Comm) {
    let c = single_copy(w);
    let (r, n) = (c.rank(), c.size());
    let ten = std::time::Duration::from_secs(10);
    // Rank 1's withdrawal, or that of a rank that failed first for it.
    let withdrawn = |e: &Result<(), Error>| matches!(e, Err(Error::Collective(ferrocomm::CollError::Withdrawn { .. })));
    // Every rank but rank 1 reads rank 1's memory.
    let must_fail = |e: Result<(), Error>| assert!(withdrawn(&e), "n={n} rank {r}: {e:?}");
    // Rank 0 (the root) reads rank 1's memory; the others may need nothing of it.
    let may_fail = |e: Result<(), Error>| {
        assert!(if r == 0 { withdrawn(&e) } else { e.is_ok() || withdrawn(&e) }, "n={n} rank {r}: {e:?}");
    };
    if n > 4 {
        // 320 KB a rank: the combining shared out by parts.
        let mut v = input(r, 40_000);
        if r == 1 {
            drop(c.scan(&mut v, ReduceOp::Sum));
        } else {
            must_fail(c.scan(&mut v, ReduceOp::Sum).timeout(ten).await);
        }
        let v = input(r, 40_000);
        if r == 1 {
            drop(c.exscan(&v, ReduceOp::Sum));
        } else {
            must_fail(c.exscan(&v, ReduceOp::Sum).timeout(ten).await.map(drop));
        }
    }
    let mine = input(r, 40_000);
    if r == 1 {
        drop(c.gather(0, &mine));
    } else {
        may_fail(c.gather(0, &mine).timeout(ten).await.map(drop));
    }
    // 1 MiB a rank: the combining split between the ranks (on 2, the pair's).
    let mine = input(r, 1 << 17);
    if r == 1 {
        drop(c.reduce(0, &mine, ReduceOp::Sum));
    } else {
        may_fail(c.reduce(0, &mine, ReduceOp::Sum).timeout(ten).await.map(drop));
    }
    c.barrier().timeout(ten).await.unwrap();
    let mut v = vec![r as u64 + 1; 50_000];
    c.allreduce(&mut v, ReduceOp::Sum).timeout(ten).await.unwrap();
    assert_eq!(v, vec![u64::from(n * (n + 1) / 2); 50_000]);
}

/// Scatters and gathers into buffers at [`ROOTED_COUNTS`] from and to the first and the last
/// rank, then the refusals: a root without data (or buffer), or with one of another length than
/// its ranks' blocks (also a reduce's).
pub(crate) async fn rooted_into_thresholds(c: &Comm, label: &str) {
    let (r, n) = (c.rank(), c.size());
    for count in ROOTED_COUNTS {
        for root in [0, n - 1] {
            let ctx = format!("{label} n={n} count={count} root={root} rank {r}");
            scatter_into(c, root, count, &ctx).await;
            gather_into(c, root, count, &ctx).await;
        }
    }
    if r == 0 {
        let mut out = [0u64; 2];
        assert!(matches!(c.scatter_into(0, None, &mut out).await, Err(Error::Invalid(_))));
        let short = vec![0u64; 2 * n as usize - 1];
        assert!(matches!(c.scatter_into(0, Some(&short[..]), &mut out).await, Err(Error::Invalid(_))));
        assert!(matches!(c.gather_into(0, &out, None).await, Err(Error::Invalid(_))));
        let mut short = vec![0u64; 2 * n as usize - 1];
        assert!(matches!(c.gather_into(0, &out, Some(&mut short[..])).await, Err(Error::Invalid(_))));
        assert!(matches!(c.reduce_into(0, &out, None, ReduceOp::Sum).await, Err(Error::Invalid(_))));
        assert!(matches!(c.reduce_into(0, &out, Some(&mut short[..1]), ReduceOp::Sum).await, Err(Error::Invalid(_))));
    }
    c.barrier().await.unwrap();
}

/// The v-variants, with per-rank lengths that differ.
async fn v_variants(c: &Comm, label: &str) {
    let (r, n) = (c.rank(), c.size());
    let len = |i: u32| (i as usize * 37) % 101;
    let parts: Vec<Vec<u64>> = (0..n).map(|i| input(i, len(i))).collect();
    assert_eq!(c.allgatherv(&input(r, len(r))).await.unwrap(), parts, "allgatherv {label}");
    let got = c.gatherv(0, &input(r, len(r))).await.unwrap();
    assert_eq!(got, (r == 0).then(|| parts.clone()), "gatherv {label}");
    let got = c.scatterv(n - 1, (r == n - 1).then_some(&parts[..])).await.unwrap();
    assert_eq!(got, parts[r as usize], "scatterv {label}");
    let to = |s: u32, d: u32| input(s * 1000 + d, ((s + 3 * d) % 5) as usize);
    let mine: Vec<Vec<u64>> = (0..n).map(|d| to(r, d)).collect();
    let want: Vec<Vec<u64>> = (0..n).map(|s| to(s, r)).collect();
    assert_eq!(c.alltoallv(&mine).await.unwrap(), want, "alltoallv {label}");
    let msg = Bytes::from(format!("hello from {r}"));
    let got = c.broadcast_bytes(n / 2, (r == n / 2).then(|| msg.clone())).await.unwrap();
    assert_eq!(got, format!("hello from {}", n / 2), "broadcast_bytes {label}");
}

/// 2x2 matrices of u16 packed in a u64: associative, not commutative. Rank order must be kept.
fn matmul(a: u64, b: u64) -> u64 {
    let m = |x: u64, i: u32| (x >> (16 * i)) as u16;
    let e = |x: u16, y: u16, z: u16, w: u16| x.wrapping_mul(y).wrapping_add(z.wrapping_mul(w)) as u64;
    let (a0, a1, a2, a3, b0, b1, b2, b3) = (m(a, 0), m(a, 1), m(a, 2), m(a, 3), m(b, 0), m(b, 1), m(b, 2), m(b, 3));
    e(a0, b0, a1, b2) | e(a0, b1, a1, b3) << 16 | e(a2, b0, a3, b2) << 32 | e(a2, b1, a3, b3) << 48
}

/// The product of 2x2 matrices packed in u64s as a reduction operator: associative, not
/// commutative, so results show whether rank order was kept.
fn matmul_op() -> ReduceOp<u64> {
    ReduceOp::custom(|acc: &mut [u64], x: &[u64]| acc.iter_mut().zip(x).for_each(|(a, b)| *a = matmul(*a, *b)), false)
}

/// The sequential reference of [`matmul_op`] over the inputs of `ranks`, `count` elements each.
fn matmul_ref(ranks: std::ops::Range<u32>, count: usize) -> Option<Vec<u64>> {
    ranks.map(|i| input(i, count)).reduce(|a, b| a.iter().zip(&b).map(|(x, y)| matmul(*x, *y)).collect())
}

async fn non_commutative(c: &Comm, label: &str) {
    let (r, n) = (c.rank(), c.size());
    let op = matmul_op;
    let reference = |upto: u32| matmul_ref(0..upto, 3);
    let mut buf = input(r, 3);
    c.allreduce(&mut buf, op()).await.unwrap();
    assert_eq!(Some(buf), reference(n), "non-commutative allreduce {label}");
    let got = c.reduce(n - 1, &input(r, 3), op()).await.unwrap();
    assert_eq!(got, if r == n - 1 { reference(n) } else { None }, "non-commutative reduce {label}");
    let mut buf = input(r, 3);
    c.scan(&mut buf, op()).await.unwrap();
    assert_eq!(Some(buf), reference(r + 1), "non-commutative scan {label}");
    // Each rank's segment (uneven: 2 or 3 elements) combined in rank order.
    let counts: Vec<usize> = (0..n as usize).map(|i| 2 + i % 2).collect();
    let (total, start) = (counts.iter().sum::<usize>(), counts[..r as usize].iter().sum::<usize>());
    let got = c.reduce_scatter(&input(r, total), &counts, op()).await.unwrap();
    let whole = matmul_ref(0..n, total).unwrap();
    assert_eq!(got, whole[start..start + counts[r as usize]], "non-commutative reduce_scatter {label}");
    let mut out = vec![0u64; 2];
    c.reduce_scatter_block_into(&input(r, 2 * n as usize), &mut out, op()).await.unwrap();
    let whole = matmul_ref(0..n, 2 * n as usize).unwrap();
    assert_eq!(out, whole[2 * r as usize..2 * r as usize + 2], "non-commutative reduce_scatter_block_into {label}");
    // Floats and typed operators.
    let mut f = vec![r as f64 * 0.5; 4];
    c.allreduce(&mut f, ReduceOp::Max).await.unwrap();
    assert_eq!(f, vec![(n - 1) as f64 * 0.5; 4], "f64 max {label}");
    let mut b = vec![1u8 << (r % 8); 2];
    c.allreduce(&mut b, ReduceOp::BitOr).await.unwrap();
    assert_eq!(b[0], (0..n).fold(0u8, |a, i| a | 1 << (i % 8)), "u8 bitor {label}");
    let mut bad = [1.0f32];
    assert!(c.allreduce(&mut bad, ReduceOp::BitAnd).await.is_err(), "bitwise on floats is refused");
}

/// Every algorithm of every operation, pinned in turn.
pub(crate) async fn every_algorithm(c: &Comm) {
    let ops = [
        Operation::Barrier,
        Operation::Bcast,
        Operation::Reduce,
        Operation::Allreduce,
        Operation::Gather,
        Operation::Scatter,
        Operation::Allgather,
        Operation::Alltoall,
        Operation::ReduceScatter,
    ];
    for op in ops {
        for &alg in Algorithm::for_operation(op) {
            let table = Table::default().with_overrides(&format!("{op}={alg}")).unwrap();
            let pinned = c.with_collective_table(table);
            operations(&pinned, &PINNED_COUNTS, &format!("{op}={alg}")).await;
        }
    }
    // The pipelined broadcast in many segments (3 elements each, and the most it cuts into).
    let table = Table { bcast_segment: 24, bcast_chain_segments: u32::MAX, ..Table::default() }
        .with_overrides("bcast=pipeline")
        .unwrap();
    operations(&c.with_collective_table(table), &PINNED_COUNTS, "bcast=pipeline in segments").await;
    // ... and in two segments, each above the 64 KiB eager limit (received into buffers posted
    // ahead).
    let two = Table { bcast_chain_segments: 2, ..Table::default() };
    let chain = c.with_collective_table(two.with_overrides("bcast=pipeline").unwrap());
    let (r, n, count) = (c.rank(), c.size(), 40_000);
    for root in [0, n - 1] {
        let mut buf = if r == root { input(root, count) } else { vec![0u64; count] };
        chain.broadcast(root, &mut buf).await.unwrap();
        assert!(buf == input(root, count), "bcast=pipeline n={n} root={root} count={count} rank {r}");
    }
    // The shared-memory board (where every rank shares this host; elsewhere the table decides).
    operations(&on_board(c), &BOARD_COUNTS, "board").await;
    // An all-gather into a buffer that the board splits into pieces (more than one rank's
    // capacity each), laid out by rank from them.
    let (r, n, count) = (c.rank(), c.size(), 20_000);
    let all: Vec<u64> = (0..n).flat_map(|i| input(i, count)).collect();
    let mut out = vec![u64::MAX; all.len()];
    on_board(c).allgather_into(&input(r, count), &mut out).await.unwrap();
    assert_eq!(out, all, "board allgather_into in pieces");
    // A gather and scans that the board splits into pieces too.
    let root = n - 1;
    let got = on_board(c).gather(root, &input(r, count)).await.unwrap();
    assert_eq!(got, (r == root).then_some(all), "board gather in pieces");
    let mut buf = input(r, count);
    on_board(c).scan(&mut buf, ReduceOp::Sum).await.unwrap();
    assert_eq!(buf, sum_ref(n, count, 0..r + 1), "board scan in pieces");
    let got = on_board(c).exscan(&input(r, count), ReduceOp::Sum).await.unwrap();
    assert_eq!(got, (r > 0).then(|| sum_ref(n, count, 0..r)), "board exscan in pieces");
    // Single copy (likewise), and scans either side of where single copy shares their combining
    // out by parts.
    operations(&single_copy(c), &SINGLE_COPY_COUNTS, "single-copy").await;
    scans(&single_copy(c), &SCAN_COUNTS, "single-copy").await;
    reduces(&single_copy(c), &SINGLE_COPY_COUNTS, "single-copy").await;
}

/// Reduces (owned and into a buffer) to the first and the last rank at each count, with a sum
/// and with a non-commutative operator (rank order must be kept), checked against the sequential
/// reference.
pub(crate) async fn reduces(c: &Comm, counts: &[usize], label: &str) {
    let (r, n) = (c.rank(), c.size());
    let op = matmul_op;
    let product = |count: usize| matmul_ref(0..n, count);
    for &count in counts {
        for root in [0, n - 1] {
            let ctx = format!("{label} n={n} count={count} root={root} rank {r}");
            let got = c.reduce(root, &input(r, count), ReduceOp::Sum).await.unwrap();
            assert_eq!(got, (r == root).then(|| sum_ref(n, count, 0..n)), "reduce {ctx}");
            let mut out = if r == root { vec![u64::MAX; count] } else { Vec::new() };
            let dst = (r == root).then_some(&mut out[..]);
            c.reduce_into(root, &input(r, count), dst, op()).await.unwrap();
            if r == root {
                assert_eq!(Some(out), product(count), "non-commutative reduce_into {ctx}");
            }
        }
    }
}

/// Element counts (u64) of scans by single copy: either side of 256 KiB, where the ranks share
/// the combining out by parts, uneven parts, and parts above the 256 KiB piece of the reduction
/// (on up to 4 ranks).
pub(crate) const SCAN_COUNTS: [usize; 3] = [32_767, 32_769, 140_001];

/// Inclusive and exclusive scans at each count, with a sum and with a non-commutative operator
/// (rank order must be kept), checked against the sequential reference.
pub(crate) async fn scans(c: &Comm, counts: &[usize], label: &str) {
    let (r, n) = (c.rank(), c.size());
    let op = matmul_op;
    let product = |count: usize, upto: u32| matmul_ref(0..upto, count);
    for &count in counts {
        let ctx = format!("{label} n={n} count={count} rank {r}");
        let mut buf = input(r, count);
        c.scan(&mut buf, ReduceOp::Sum).await.unwrap();
        assert_eq!(buf, sum_ref(n, count, 0..r + 1), "scan {ctx}");
        let got = c.exscan(&input(r, count), ReduceOp::Sum).await.unwrap();
        assert_eq!(got, (r > 0).then(|| sum_ref(n, count, 0..r)), "exscan {ctx}");
        let mut buf = input(r, count);
        c.scan(&mut buf, op()).await.unwrap();
        assert_eq!(Some(buf), product(count, r + 1), "non-commutative scan {ctx}");
        let got = c.exscan(&input(r, count), op()).await.unwrap();
        assert_eq!(got, product(count, r), "non-commutative exscan {ctx}");
    }
}
