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
    // The test demands the group: a loaded machine may hold the group test up well beyond the
    // default 2 s, after which the channel would go point-to-point.
    s.multicast.confirm_timeout = Duration::from_secs(30);
    s
}

async fn stream_test(n: u32, count: usize, drop: f64) {
    let lo = loopback_multicast();
    let stats = ferrocomm::testing::run(n, settings(drop), move |w| async move {
        let chan = Channel::new(w.comm()).await.unwrap();
        let confirmed = chan.wait_group(Duration::from_secs(40)).await;
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
            b.channel().wait_group(Duration::from_secs(40)).await;
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
        // Explicit: by default a stream this small has no co-roots (FLAT_RECEIVERS).
        let sqrt = (f64::from(receivers).sqrt().round()) as usize;
        for subgroups in [1usize, sqrt] {
            let mut s = settings(0.0);
            s.multicast.subgroups = subgroups;
            s.multicast.ack_every = 1;
            let out = ferrocomm::testing::run(receivers + 1, s, |w| async move {
                let chan = Channel::new(w.comm()).await.unwrap();
                chan.wait_group(Duration::from_secs(40)).await;
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

/// Only datagrams tagged with the job's key reach the protocol. A spy in the group copies a real
/// datagram of the channel and sends it back untagged, with a flipped bit in its tag, in its header
/// and in its payload, tagged with another job's key, and as bare noise: every rank drops and
/// counts each of these; the unaltered copy passes the tag (a tag says "from this job", not
/// "new"), and the protocol drops it as a duplicate, so every message still arrives exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datagrams_without_the_jobs_tag_are_dropped_and_counted() {
    use ferrocomm_multicast::transport::{MulticastTransport, UdpConfig, UdpMulticast};
    use ferrocomm_transports::auth::{JobSecret, TAG_LEN};
    const FORGED: u64 = 6;
    assert!(loopback_multicast(), "this test needs multicast on lo (`ip link set lo multicast on`)");
    let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let group = std::net::Ipv4Addr::new(239, 255, 201, 7);
    let mut s = settings(0.0);
    s.multicast.group = Some(group);
    s.multicast.port = Some(port);
    let out = ferrocomm::testing::run(3, s, move |w| async move {
        let spy = (w.rank() == 0).then(|| {
            let cfg =
                UdpConfig { group, port, interface: [127, 0, 0, 1].into(), datagram: 1400, ttl: 1, buffer: 1 << 20 };
            UdpMulticast::join(&cfg).unwrap()
        });
        let chan = Channel::new(w.comm()).await.unwrap();
        assert!(chan.wait_group(Duration::from_secs(40)).await, "rank {}: group not confirmed", w.rank());
        w.barrier().timeout(T).await.unwrap();
        if let Some(spy) = &spy {
            chan.send(payload(0, 1)).timeout(T).await.unwrap();
            // A data datagram of rank 0 (the spy also hears the pings of the group test).
            let mut buf = vec![0u8; 65_536];
            let real = 'found: loop {
                let got = tokio::time::timeout(T, std::future::poll_fn(|cx| spy.poll_recv(cx, &mut buf)))
                    .await
                    .unwrap()
                    .unwrap();
                for d in got.datagrams(&buf) {
                    if d.len() > 36 + TAG_LEN && d[5] == 1 && d[20..24] == [0, 0, 0, 0] {
                        break 'found d.to_vec();
                    }
                }
            };
            let flip = |at: usize| {
                let mut d = real.clone();
                d[at] ^= 0x01;
                d
            };
            let untagged = real[..real.len() - TAG_LEN].to_vec();
            let other_job = JobSecret::new([0xa5; 32]).datagram_key().seal(&untagged);
            let forged = [
                untagged.clone(),
                flip(real.len() - 1), // the tag
                flip(27),             // the sequence number
                flip(40),             // the payload
                other_job,
                b"noise".to_vec(),
            ];
            assert_eq!(forged.len() as u64, FORGED);
            for d in forged.iter().chain([&real]) {
                assert!(spy.try_send(d).unwrap());
            }
        }
        // Each rank heard the forgeries (rank 0 too: its socket shares the group). Rank 0 drops
        // those that name it as their root unchecked (its own datagrams, looped back, are never
        // used), so it counts only the noise, which has no header.
        let want = if w.rank() == 0 { 1 } else { FORGED };
        for _ in 0..1000 {
            if chan.stats().unauthenticated >= want {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        if w.rank() == 0 {
            chan.send(payload(0, 2)).timeout(T).await.unwrap();
        } else {
            for i in [1, 2] {
                assert_eq!(chan.recv(0).timeout(T).await.unwrap(), payload(0, i), "rank {}", w.rank());
            }
        }
        chan.flush().timeout(T).await.unwrap();
        w.barrier().timeout(T).await.unwrap();
        // Nothing more arrived: the replayed copy was not delivered again.
        let extra = tokio::time::timeout(Duration::from_millis(200), chan.recv(0)).await;
        assert!(w.rank() == 0 || extra.is_err(), "rank {}: a message delivered twice: {extra:?}", w.rank());
        (chan.stats().unauthenticated, chan.stats().duplicates)
    })
    .await
    .unwrap();
    println!("(dropped for their tag, duplicates) per rank: {out:?}");
    assert_eq!(out[0].0, 1, "rank 0 checks only what does not name it as root: {out:?}");
    assert!(out[1..].iter().all(|&(dropped, _)| dropped == FORGED), "{out:?}");
}

/// The default selection keeps a broadcast on one host off multicast (no network to save there):
/// ranks of one host choose a point-to-point algorithm for every size, with multicast on.
/// (Across hosts it takes multicast: `multicast_netns.rs`, `multiprocess.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broadcast_on_one_host_is_not_selected_as_multicast() {
    let out = ferrocomm::testing::run(4, settings(0.0), |w| async move {
        assert!(w.settings().multicast.enabled);
        [8usize, 1 << 10, 1 << 20]
            .map(|bytes| w.collective_algorithm(ferrocomm::Operation::Bcast, bytes) != ferrocomm::Algorithm::Multicast)
    })
    .await
    .unwrap();
    assert!(out.iter().flatten().all(|&p2p| p2p), "{out:?}");
}
