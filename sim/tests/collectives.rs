//! The collectives' machines over the unchanged point-to-point engine on the simulated network,
//! at 1,024 and 4,096 ranks, checked against sequential references; under frame loss, jitter and
//! port contention; and reproducible from the seed.

use bytes::Bytes;
use ferrocomm_collectives::{Algorithm, ReduceOp, ops};
use ferrocomm_sim::coll::{CollRank, run_calls};
use ferrocomm_sim::{Link, NetConfig, Report, SimNet};

const LIMIT: u64 = 600_000_000_000;

/// The big runs take a gigabyte or two each: one at a time.
static BIG: std::sync::Mutex<()> = std::sync::Mutex::new(());

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
    let _one = BIG.lock().unwrap_or_else(|e| e.into_inner());
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
    let _one = BIG.lock().unwrap_or_else(|e| e.into_inner());
    for alg in [Algorithm::RecursiveDoubling, Algorithm::Rabenseifner, Algorithm::Ring] {
        allreduce_then_bcast(1024, 100, alg, Link::default(), 2);
    }
    // 128 KiB per rank: recursive doubling's messages go by rendezvous (RTS, CTS, data).
    let (report, _) = allreduce_then_bcast(1024, 16 << 10, Algorithm::RecursiveDoubling, Link::default(), 3);
    assert!(report.stats.frames > 3 * 1024 * 10, "RTS, CTS and data for each of the 10 steps");
}

#[test]
fn collectives_under_frame_loss_and_jitter_on_1024_ranks() {
    // Every frame lost with probability 5% (delivered one RTO later, holding up its link), and
    // up to 20 us of jitter (frames of different links overtake one another).
    let link = Link::default().with_loss(0.05).with_jitter(20_000);
    for alg in [Algorithm::RecursiveDoubling, Algorithm::Rabenseifner] {
        let (lossy, _) = allreduce_then_bcast(1024, 50, alg, link, 5);
        let (clean, _) = allreduce_then_bcast(1024, 50, alg, Link::default(), 5);
        assert!(lossy.stats.retransmissions > 100, "{:?}", lossy.stats);
        assert!(
            lossy.time > clean.time + 200_000,
            "an RTO at least on the critical path: {} vs {}",
            lossy.time,
            clean.time
        );
    }
}

#[test]
fn collectives_on_a_two_level_network() {
    // 16 ranks per node: 200 ns and 100 Gbit/s inside, 5 us and 10 Gbit/s between nodes.
    let links: ferrocomm_transports::sim::Links =
        std::sync::Arc::new(|a, b| if a / 16 == b / 16 { Link::new(200, 100.0) } else { Link::new(5_000, 10.0) });
    let cfg = NetConfig { links: Some(links), ..NetConfig::default() };
    let n = 512;
    let calls = |r: u32| {
        vec![
            ops::allreduce(r, n, Algorithm::RecursiveDoubling, bytes_of(&input(r, 8)), ReduceOp::<u64>::Sum.erase())
                .unwrap(),
        ]
    };
    let (report, ranks) = run_calls(&SimNet::new(n, cfg), calls, LIMIT).unwrap();
    let expect = sum_reference(n, 8);
    for rank in &ranks {
        assert_eq!(u64s(&ops::allreduce_result(&rank.results[0], n, Algorithm::RecursiveDoubling).unwrap()), expect);
    }
    // log2(512) = 9 steps: the first 4 inside a node, the other 5 between nodes.
    let step = |l: Link| l.latency + l.serialize(48 + 64);
    let model = 4 * step(Link::new(200, 100.0)) + 5 * step(Link::new(5_000, 10.0));
    assert_eq!(report.time, model, "no contention in recursive doubling: each step is one link's cost");
}

#[test]
fn the_same_seed_gives_the_same_run() {
    let link = Link::default().with_loss(0.02).with_jitter(10_000);
    let go = |seed| allreduce_then_bcast(256, 40, Algorithm::Rabenseifner, link, seed).0;
    let (a, b, c) = (go(7), go(7), go(8));
    assert_eq!(a, b, "same seed: same trace, same times, same counts");
    assert_ne!(a.trace, c.trace);
}

#[test]
fn a_rank_dying_mid_allreduce_fails_its_partners_and_nothing_is_wrong() {
    let n = 256;
    let victim = 77;
    let net = net(n, 3, Link::default());
    let calls = |r: u32| {
        vec![
            ops::allreduce(r, n, Algorithm::RecursiveDoubling, bytes_of(&input(r, 4)), ReduceOp::<u64>::Sum.erase())
                .unwrap(),
        ]
    };
    let mut ranks: Vec<CollRank> =
        (0..n).map(|r| CollRank::new(ferrocomm_sim::Node::with_defaults(&net, r), calls(r))).collect();
    // At the instant its step-2 message lands (4.1 us): it dies before starting step 3.
    let out = ferrocomm_sim::run(&net, &mut ranks, LIMIT, |now, net| {
        if now > 3_000 && !net.is_dead(victim) {
            net.kill(victim);
        }
    });
    // Its partners in the steps it never took fail, naming it. Ranks that only wait on live
    // partners stay waiting: the run ends as a deadlock naming them, never as a hang.
    for p in (2..8).map(|j| victim ^ (1 << j)) {
        let e = ranks[p as usize].error.as_deref().unwrap_or("");
        assert!(e.contains(&format!("rank {victim} is lost")), "partner {p}: {e:?}");
    }
    for (r, rank) in ranks.iter().enumerate() {
        let e = rank.error.as_deref().unwrap_or(&format!("rank {victim} is lost")).to_string();
        assert!(e.contains(&format!("rank {victim} is lost")), "rank {r} failed for another reason: {e}");
    }
    // Some ranks may still finish: the dead rank's input lives on in the partial sums of the
    // partners of its first two steps. Whatever finished is the full sum.
    let expect = sum_reference(n, 4);
    for (r, rank) in ranks.iter().enumerate().filter(|(_, rank)| !rank.results.is_empty()) {
        let got = u64s(&ops::allreduce_result(&rank.results[0], n, Algorithm::RecursiveDoubling).unwrap());
        assert_eq!(got, expect, "rank {r}");
    }
    let (finished, failed) =
        (ranks.iter().filter(|r| !r.results.is_empty()).count(), ranks.iter().filter(|r| r.error.is_some()).count());
    eprintln!(
        "{finished} ranks finished, {failed} failed naming rank {victim}, outcome {:?}",
        out.as_ref().map(|r| r.time).map_err(|e| e.to_string())
    );
    match out {
        Ok(_) => {}
        Err(ferrocomm_sim::SimError::Deadlock { waiting, .. }) => {
            assert!(waiting.iter().all(|&r| r != victim && ranks[r as usize].error.is_none()))
        }
        Err(e) => panic!("{e}"),
    }
}
