//! Reliable multicast (the sans-IO core of ferrocomm-multicast, its control messages over the
//! point-to-point engine) on the simulated datagram path: 4,096 and 1,024 ranks, and loss,
//! duplication and reordering of datagrams; every rank must read every message exactly once, in
//! order, intact.

use std::sync::Mutex;
use std::time::Instant;

use bytes::Bytes;
use ferrocomm_sim::mcast::{McastRank, config};
use ferrocomm_sim::{Link, NetConfig, Node, Report, SimNet, run};

/// The big runs take a gigabyte or two each: one at a time.
static BIG: Mutex<()> = Mutex::new(());

/// Message `i` of root `root`: empty up to several datagrams.
fn message(root: u32, i: usize) -> Bytes {
    let len = (i * 1297 + root as usize * 31) % 5000;
    (0..len).map(|k| (k as u32 ^ (i as u32).wrapping_mul(2654435761) ^ root) as u8).collect::<Vec<_>>().into()
}

/// `roots` each send `count` messages to the channel of `n` ranks; returns the report and ranks.
fn broadcast(n: u32, roots: &[u32], count: usize, cfg: NetConfig) -> (Report, Vec<McastRank>) {
    let net = SimNet::new(n, cfg.clone());
    let origin = Instant::now();
    let mcfg = config(n, cfg.max_datagram);
    let mut ranks: Vec<McastRank> = (0..n)
        .map(|r| {
            let outbox = if roots.contains(&r) { (0..count).map(|i| message(r, i)).collect() } else { Vec::new() };
            let expect = count * roots.iter().filter(|&&x| x != r).count();
            McastRank::new(Node::with_defaults(&net, r), &net, origin, mcfg.clone(), outbox, expect)
        })
        .collect();
    let report = run(&net, &mut ranks, 3_600_000_000_000, |_, _| {}).expect("the run finishes");
    for (r, rank) in ranks.iter().enumerate() {
        assert!(rank.errors.is_empty(), "rank {r}: {:?}", &rank.errors[..rank.errors.len().min(3)]);
        for &root in roots.iter().filter(|&&x| x != r as u32) {
            let got: Vec<&Bytes> = rank.got.iter().filter(|(from, _)| *from == root).map(|(_, m)| m).collect();
            assert_eq!(got.len(), count, "rank {r} from {root}");
            for (i, m) in got.into_iter().enumerate() {
                assert_eq!(*m, message(root, i), "rank {r}: message {i} of root {root}");
            }
        }
    }
    (report, ranks)
}

#[test]
fn multicast_to_4096_ranks() {
    let _one = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let (report, ranks) = broadcast(4096, &[0], 40, NetConfig::default());
    assert!(ranks[0].core().confirmed(), "the group test passed: messages went by multicast");
    let s = &report.stats;
    // 40 messages of up to 5000 bytes: at most 4 datagrams each, plus the group test's pings.
    assert!(s.datagrams <= 40 * 4 + 20, "{s:?}");
    assert!(s.datagram_copies >= 4095 * 40, "{s:?}");
    eprintln!("4096 ranks: {} ns virtual, {s:?}", report.time);
}

#[test]
fn multicast_to_1024_ranks_under_loss_duplication_and_reordering() {
    let _one = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let link = Link::default().with_loss(0.02).with_duplicate(0.01).with_jitter(3_000);
    let (report, ranks) = broadcast(1024, &[5], 40, NetConfig { seed: 9, link, ..NetConfig::default() });
    let s = &report.stats;
    assert!(s.datagrams_lost > 0 && s.datagrams_duplicated > 0 && s.retransmissions > 0, "{s:?}");
    let retx: u64 = ranks.iter().map(|r| r.core().stats().retransmissions).sum();
    assert!(retx > 0, "lost datagrams were repaired by retransmission");
}

#[test]
fn several_roots_at_once_on_256_ranks_under_loss() {
    let link = Link::default().with_loss(0.05).with_jitter(2_000);
    broadcast(256, &[0, 17, 255], 30, NetConfig { seed: 4, link, ..NetConfig::default() });
}

#[test]
fn the_same_seed_gives_the_same_multicast_run() {
    let link = Link::default().with_loss(0.05).with_duplicate(0.02).with_jitter(5_000);
    let cfg = |seed| NetConfig { seed, link, ..NetConfig::default() };
    let (a, _) = broadcast(128, &[3], 20, cfg(21));
    let (b, _) = broadcast(128, &[3], 20, cfg(21));
    let (c, _) = broadcast(128, &[3], 20, cfg(22));
    assert_eq!(a, b);
    assert_ne!(a.trace, c.trace);
}

#[test]
fn a_coroot_dying_mid_stream_on_1024_ranks_ends_the_channel_everywhere() {
    let _one = BIG.lock().unwrap_or_else(|e| e.into_inner());
    let n = 1024;
    let net = SimNet::new(n, NetConfig::default());
    let origin = Instant::now();
    let mcfg = config(n, 1400);
    let count = 60;
    let mut ranks: Vec<McastRank> = (0..n)
        .map(|r| {
            let outbox = if r == 0 { (0..count).map(|i| message(0, i)).collect() } else { Vec::new() };
            McastRank::new(
                Node::with_defaults(&net, r),
                &net,
                origin,
                mcfg.clone(),
                outbox,
                if r == 0 { 0 } else { count },
            )
        })
        .collect();
    // A co-root of the root's stream (it collects a sub-group's ACKs) dies once the stream runs.
    let victim = ranks[0].core().layout().coroots[3];
    let mut killed = false;
    let report = run(&net, &mut ranks, 3_600_000_000_000, |now, net| {
        if !killed && now > 300_000 {
            net.kill(victim);
            killed = true;
        }
    })
    .expect("every live rank's channel ends: none is left waiting");
    assert!(killed && report.done_at[victim as usize].is_none());
    // The loss revokes the channel at every live rank (as the facade's communicator), naming the
    // dead rank; what each read before is the stream's beginning, in order and intact.
    for (r, rank) in ranks.iter().enumerate().filter(|&(r, _)| r as u32 != victim) {
        let why = rank.ended.as_deref().unwrap_or("");
        assert!(why.contains(&format!("rank {victim} is lost")), "rank {r}: {why:?}");
        assert!(rank.got.iter().enumerate().all(|(i, (root, m))| *root == 0 && *m == message(0, i)), "rank {r}");
    }
    assert!(ranks.iter().any(|r| !r.got.is_empty()), "the stream was under way");
}

/// The selection table's multicast tier: on the simulated network (the default one of
/// `ferrocomm-bench sim-scale`) a broadcast by reliable multicast loses to a binomial one at
/// `MULTICAST_BCAST_RANKS` ranks and wins above, from 8 B to `MULTICAST_BCAST_MAX`.
#[test]
fn the_selection_tables_crossover_holds_on_the_simulated_network() {
    use ferrocomm_collectives::select::{MULTICAST_BCAST_MAX, MULTICAST_BCAST_RANKS};
    use ferrocomm_sim::model::Op;
    use ferrocomm_sim::scale::measure;
    let cfg = NetConfig { link: Link::new(2_000, 10.0), ..NetConfig::default() };
    let at = MULTICAST_BCAST_RANKS;
    for (bytes, above) in [(8, vec![at + 1, 8, 32]), (MULTICAST_BCAST_MAX, vec![at + 1, 8])] {
        let time = |op, p| measure(op, p, bytes, &cfg).expect("the run finishes").sim_ns;
        let (b, m) = (time(Op::Bcast(ferrocomm::Algorithm::Binomial), at), time(Op::McastBcast, at));
        assert!(m >= b, "{bytes} B on {at} ranks: multicast {m} ns, binomial {b} ns");
        for p in above {
            let (b, m) = (time(Op::Bcast(ferrocomm::Algorithm::Binomial), p), time(Op::McastBcast, p));
            assert!(m < b, "{bytes} B on {p} ranks: multicast {m} ns, binomial {b} ns");
        }
    }
}
