//! Reliable multicast over real UDP multicast on loopback, ranks in one process: exactly-once
//! in-order delivery with injected receive loss, the degraded (point-to-point) path, broadcast,
//! and the token barrier. The multi-process runs across network namespaces are in
//! tests/multicast_netns.rs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use ferrocomm::multicast::{Channel, TokenBarrier, broadcast};
use ferrocomm::{Deadline, Settings};
use parking_lot::Mutex;

const T: Duration = Duration::from_secs(60);

fn payload(root: u32, i: usize) -> Bytes {
    let len = (i * 7919 + root as usize * 131) % 20_000;
    (0..len).map(|k| (k as u32 ^ (i as u32).wrapping_mul(2_654_435_761) ^ root) as u8).collect::<Vec<u8>>().into()
}

/// True if the loopback interface can carry multicast (else the group degrades, loudly).
fn loopback_multicast() -> bool {
    let flags = std::fs::read_to_string("/sys/class/net/lo/flags").unwrap_or_default();
    let flags = u32::from_str_radix(flags.trim().trim_start_matches("0x"), 16).unwrap_or(0);
    let ok = flags & 0x1000 != 0; // IFF_MULTICAST
    if !ok {
        eprintln!(
            "WARNING: lo has no MULTICAST flag (`ip link set lo multicast on`): testing the point-to-point fallback only"
        );
    }
    ok
}

fn settings(drop: f64) -> Settings {
    let mut s = Settings::default();
    s.multicast.test_drop = drop;
    s.multicast.window = 32;
    s
}

async fn stream_test(n: u32, count: usize, drop: f64) {
    let lo = loopback_multicast();
    let stats = ferrocomm::testing::run(n, settings(drop), move |w| async move {
        let chan = Channel::new(w.comm()).await.unwrap();
        let confirmed = chan.wait_group(Duration::from_secs(10)).await;
        assert_eq!(confirmed, lo, "rank {}: group state", w.rank());
        let roots = [0u32, 3];
        let me = w.rank();
        let sending = async {
            if roots.contains(&me) {
                for i in 0..count {
                    chan.send(payload(me, i)).timeout(T).await.unwrap();
                }
            }
        };
        let receiving = async {
            for &root in roots.iter().filter(|&&r| r != me) {
                for i in 0..count {
                    let m = chan.recv(root).timeout(T).await.unwrap();
                    assert_eq!(m, payload(root, i), "rank {me}: message {i} of root {root}");
                }
            }
        };
        futures::join!(sending, receiving);
        chan.flush().timeout(T).await.unwrap();
        w.barrier().timeout(T).await.unwrap();
        chan.stats()
    })
    .await
    .unwrap();
    let sum = |f: fn(&ferrocomm::multicast::McastStats) -> u64| stats.iter().map(f).sum::<u64>();
    println!(
        "{n} ranks, drop {drop}: datagrams {}, retransmissions {} (false {}), NACKs {}, ACKs at roots {}, at co-roots {}, stalls {}",
        sum(|s| s.datagrams_sent),
        sum(|s| s.retransmissions),
        sum(|s| s.false_retransmissions),
        sum(|s| s.nacks_sent),
        sum(|s| s.acks_at_root),
        sum(|s| s.acks_at_coroot),
        sum(|s| s.window_stalls),
    );
    if lo {
        assert!(sum(|s| s.datagrams_sent) > 0);
        if drop > 0.0 {
            assert!(sum(|s| s.retransmissions) > 0, "loss was repaired by retransmission");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_nine_ranks_exactly_once_in_order() {
    stream_test(9, 300, 0.0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_nine_ranks_twenty_percent_receive_loss() {
    stream_test(9, 200, 0.2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn group_that_never_confirms_degrades_and_still_delivers() {
    let mut s = settings(1.0); // every datagram dropped: as if multicast were filtered
    s.multicast.confirm_timeout = Duration::from_millis(300);
    let out = ferrocomm::testing::run(4, s, |w| async move {
        let chan = Channel::new(w.comm()).await.unwrap();
        for i in 0..50 {
            let got = broadcast(&chan, 1, (w.rank() == 1).then(|| payload(1, i))).timeout(T).await.unwrap();
            assert_eq!(got, payload(1, i));
        }
        let confirmed = chan.wait_group(Duration::from_secs(5)).await;
        chan.flush().timeout(T).await.unwrap();
        w.barrier().timeout(T).await.unwrap();
        (confirmed, chan.stats().groups_degraded)
    })
    .await
    .unwrap();
    assert!(out.iter().all(|&(c, d)| !c && d == 1), "{out:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multicast_off_is_point_to_point() {
    let mut s = settings(0.0);
    s.multicast.enabled = false;
    ferrocomm::testing::run(3, s, |w| async move {
        let chan = Channel::new(w.comm()).await.unwrap();
        for i in 0..20 {
            let got = broadcast(&chan, 0, (w.rank() == 0).then(|| payload(0, i))).timeout(T).await.unwrap();
            assert_eq!(got, payload(0, i));
        }
        assert!(!chan.confirmed());
        assert_eq!(chan.stats().datagrams_sent, 0);
        chan.flush().timeout(T).await.unwrap();
        w.barrier().timeout(T).await.unwrap();
    })
    .await
    .unwrap();
}

/// (round, rank, entered, left)
type Passage = (u64, u32, Instant, Instant);

/// Nobody leaves a token barrier before the last rank entered, whoever is late; the released
/// ranks leave about one multicast after the last arrival.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_barrier_holds_everyone_until_the_last_arrives() {
    const N: u32 = 10;
    const ROUNDS: u64 = 12;
    let log: Arc<Mutex<Vec<Passage>>> = Default::default();
    let log2 = log.clone();
    ferrocomm::testing::run(N, settings(0.05), move |w| {
        let log = log2.clone();
        async move {
            let b = TokenBarrier::new(w.comm()).await.unwrap();
            b.channel().wait_group(Duration::from_secs(10)).await;
            for round in 0..ROUNDS {
                // A different late rank each round, sometimes nobody.
                let late = (round * 7 % (N as u64 + 2)) as u32;
                if w.rank() == late {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                let entered = Instant::now();
                b.wait().timeout(T).await.unwrap();
                log.lock().push((round, w.rank(), entered, Instant::now()));
            }
            w.barrier().timeout(T).await.unwrap();
        }
    })
    .await
    .unwrap();
    let log = log.lock();
    for round in 0..ROUNDS {
        let entries: Vec<_> = log.iter().filter(|e| e.0 == round).collect();
        assert_eq!(entries.len(), N as usize);
        let last_in = entries.iter().map(|e| e.2).max().unwrap();
        let first_out = entries.iter().map(|e| e.3).min().unwrap();
        assert!(first_out >= last_in, "round {round}: a rank left before the last entered");
    }
}

/// ACK implosion, measured on real sockets: the ACKs the root handles with co-roots, against
/// without them (every receiver acknowledging to the root), for 8 and 16 receivers. The root's
/// share must fall to about 1/(number of sub-groups). Every message is acknowledged (k = 1) so
/// that the counts do not depend on timing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ack_implosion_root_share_falls_to_one_per_subgroup() {
    const M: usize = 100;
    for receivers in [8u32, 16] {
        let mut counts = Vec::new();
        for subgroups in [1usize, 0] {
            let mut s = settings(0.0);
            s.multicast.subgroups = subgroups;
            s.multicast.ack_every = 1;
            let out = ferrocomm::testing::run(receivers + 1, s, |w| async move {
                let chan = Channel::new(w.comm()).await.unwrap();
                chan.wait_group(Duration::from_secs(10)).await;
                w.barrier().timeout(T).await.unwrap();
                let before = chan.stats().acks_at_root;
                for i in 0..M {
                    let got = broadcast(&chan, 0, (w.rank() == 0).then(|| payload(0, i))).timeout(T).await.unwrap();
                    assert_eq!(got, payload(0, i));
                }
                chan.flush().timeout(T).await.unwrap();
                w.barrier().timeout(T).await.unwrap();
                (chan.stats().acks_at_root - before, chan.subgroups())
            })
            .await
            .unwrap();
            counts.push(out[0]);
        }
        let ((flat, one), (tree, g)) = (counts[0], counts[1]);
        assert_eq!(one, 1);
        let share = tree as f64 / flat as f64;
        println!(
            "ACK implosion, {receivers} receivers, {M} messages: root handled {flat} ACKs without co-roots, \
             {tree} with {g} sub-groups: share {share:.3} (1/{g} = {:.3})",
            1.0 / g as f64
        );
        assert!(flat >= (receivers as u64) * M as u64 * 9 / 10, "without co-roots every receiver acks the root");
        assert!(share < 1.4 / g as f64 && share > 0.3 / g as f64, "share {share} vs 1/{g}");
    }
}
