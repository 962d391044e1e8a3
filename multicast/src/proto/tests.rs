//! The protocol against a scripted network: seeded loss, duplication and reordering of datagrams,
//! reliable FIFO point-to-point, ranks that stop reading or die, virtual time.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

use super::*;

#[derive(Clone)]
enum Packet {
    Datagram(Bytes),
    Control { from: Rank, msg: Bytes },
    Lost { rank: Rank },
}

type DropIf = Box<dyn Fn(Rank, &Bytes) -> bool>;

struct Sim {
    t0: Instant,
    now: Duration,
    cores: Vec<McastCore>,
    dead: Vec<bool>,
    heap: BinaryHeap<Reverse<(Duration, u64, usize)>>,
    packets: Vec<Option<(Rank, Packet)>>,
    order: u64,
    rng: u64,
    /// Probability that one receiver misses a datagram, that it gets it twice.
    loss: f64,
    dup: f64,
    /// Datagram latency is `mcast` plus up to `jitter` (reordering); point-to-point is `p2p`, FIFO.
    mcast: Duration,
    jitter: Duration,
    p2p: Duration,
    last_p2p: HashMap<(Rank, Rank), Duration>,
    /// Extra point-to-point latency from one rank to another.
    slow: HashMap<(Rank, Rank), Duration>,
    /// Messages to send, per root.
    outbox: Vec<VecDeque<Bytes>>,
    /// What each rank consumed from each root.
    got: Vec<Vec<Vec<Bytes>>>,
    /// A rank whose application does not read until this time.
    stalled_until: Vec<Duration>,
    events: Vec<Vec<Event>>,
    /// Extra per-datagram filter: (to, datagram) -> drop.
    drop_if: Option<DropIf>,
}

fn cfg(me: Rank, size: u32) -> Config {
    Config {
        job: 42,
        channel: 9,
        datagram: 300,
        window: 16,
        ack_every: 4,
        ack_delay: Duration::from_micros(300),
        rto_initial: Duration::from_millis(5),
        rto_min: Duration::from_millis(1),
        ping_interval: Duration::from_millis(2),
        confirm_timeout: Duration::from_millis(500),
        ..Config::new(me, size)
    }
}

impl Sim {
    fn new(size: u32, f: impl Fn(&mut Config)) -> Sim {
        let t0 = Instant::now();
        let cores = (0..size)
            .map(|r| {
                let mut c = cfg(r, size);
                f(&mut c);
                McastCore::new(c, t0)
            })
            .collect();
        let n = size as usize;
        Sim {
            t0,
            now: Duration::ZERO,
            cores,
            dead: vec![false; n],
            heap: BinaryHeap::new(),
            packets: Vec::new(),
            order: 0,
            rng: 0x2545_f491_4f6c_dd1d,
            loss: 0.0,
            dup: 0.0,
            mcast: Duration::from_micros(20),
            jitter: Duration::ZERO,
            p2p: Duration::from_micros(30),
            last_p2p: HashMap::new(),
            slow: HashMap::new(),
            outbox: vec![VecDeque::new(); n],
            got: vec![vec![Vec::new(); n]; n],
            stalled_until: vec![Duration::ZERO; n],
            events: vec![Vec::new(); n],
            drop_if: None,
        }
    }

    fn rand(&mut self) -> f64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        (self.rng >> 11) as f64 / (1u64 << 53) as f64
    }

    fn at(&self) -> Instant {
        self.t0 + self.now
    }

    fn schedule(&mut self, when: Duration, to: Rank, p: Packet) {
        self.packets.push(Some((to, p)));
        self.order += 1;
        self.heap.push(Reverse((when, self.order, self.packets.len() - 1)));
    }

    fn kill(&mut self, r: Rank) {
        self.dead[r as usize] = true;
        for o in 0..self.cores.len() as Rank {
            if o != r {
                let when = self.now + self.p2p;
                self.schedule(when, o, Packet::Lost { rank: r });
            }
        }
    }

    /// Moves output into the network and lets applications send and read.
    fn pump(&mut self) {
        let n = self.cores.len() as Rank;
        for r in 0..n {
            if self.dead[r as usize] {
                continue;
            }
            let now = self.at();
            while let Some(m) = self.outbox[r as usize].front().cloned() {
                match self.cores[r as usize].send(now, m) {
                    Ok(_) => {
                        self.outbox[r as usize].pop_front();
                    }
                    Err(SendError::WindowFull) => break,
                    Err(e) => panic!("{e}"),
                }
            }
            if self.now >= self.stalled_until[r as usize] {
                for root in 0..n {
                    while let Ok(Some(m)) = self.cores[r as usize].pop(root, now) {
                        self.got[r as usize][root as usize].push(m);
                    }
                }
            }
            while let Some(t) = self.cores[r as usize].poll_transmit() {
                match t {
                    Transmit::Multicast(d) => {
                        for to in (0..n).filter(|&to| to != r) {
                            if self.rand() < self.loss || self.drop_if.as_ref().is_some_and(|f| f(to, &d)) {
                                continue;
                            }
                            let copies = if self.rand() < self.dup { 2 } else { 1 };
                            for _ in 0..copies {
                                let j = self.jitter.mul_f64(self.rand());
                                let when = self.now + self.mcast + j;
                                self.schedule(when, to, Packet::Datagram(d.clone()));
                            }
                        }
                    }
                    Transmit::Unicast { to, msg } => {
                        let last = self.last_p2p.get(&(r, to)).copied().unwrap_or_default();
                        let extra = self.slow.get(&(r, to)).copied().unwrap_or_default();
                        let when = (self.now + self.p2p + extra).max(last);
                        self.last_p2p.insert((r, to), when);
                        self.schedule(when, to, Packet::Control { from: r, msg });
                    }
                }
            }
            while let Some(e) = self.cores[r as usize].poll_event() {
                self.events[r as usize].push(e);
            }
        }
    }

    /// Runs until `done` holds or `limit` of virtual time has passed; returns whether `done` held.
    fn run(&mut self, limit: Duration, done: impl Fn(&Sim) -> bool) -> bool {
        let end = self.now + limit;
        loop {
            self.pump();
            if done(self) {
                return true;
            }
            let timer = (0..self.cores.len())
                .filter(|&r| !self.dead[r])
                .filter_map(|r| self.cores[r].poll_timeout())
                .min()
                .map(|t| t.saturating_duration_since(self.t0));
            let stall = self.stalled_until.iter().copied().filter(|&s| s > self.now).min();
            let packet = self.heap.peek().map(|Reverse((t, ..))| *t);
            let Some(next) = [timer, packet, stall].into_iter().flatten().min() else { return false };
            if next > end {
                return false;
            }
            self.now = self.now.max(next);
            let now = self.at();
            while let Some(Reverse((t, _, i))) = self.heap.peek().copied() {
                if t > self.now {
                    break;
                }
                self.heap.pop();
                let (to, p) = self.packets[i].take().unwrap();
                if self.dead[to as usize] {
                    continue;
                }
                let c = &mut self.cores[to as usize];
                match p {
                    Packet::Datagram(d) => c.handle_datagram(now, d).unwrap(),
                    // A dead rank's messages already on the wire still arrive.
                    Packet::Control { from, msg } => c.handle_control(now, from, msg).unwrap(),
                    Packet::Lost { rank } => c.peer_lost(now, rank),
                }
            }
            for r in 0..self.cores.len() {
                if !self.dead[r] && self.cores[r].poll_timeout().is_some_and(|t| t <= now) {
                    self.cores[r].handle_timeout(now);
                }
            }
        }
    }

    fn confirm_groups(&mut self) {
        let ok = self.run(Duration::from_secs(1), |s| {
            (0..s.cores.len()).all(|r| s.dead[r] || s.cores[r].confirmed() || s.cores[r].degraded())
        });
        assert!(ok, "group test did not finish");
    }

    fn all_received(&self, root: Rank, count: usize) -> bool {
        (0..self.cores.len()).all(|r| r == root as usize || self.dead[r] || self.got[r][root as usize].len() >= count)
    }
}

fn message(root: Rank, i: usize) -> Bytes {
    // 0 bytes to several datagrams of 300 bytes.
    let len = (i * 97 + root as usize * 13) % 1200;
    (0..len).map(|k| (k as u32 ^ (i as u32).wrapping_mul(31) ^ root) as u8).collect::<Vec<_>>().into()
}

fn check_exactly_once_in_order(s: &Sim, root: Rank, count: usize) {
    let want: Vec<Bytes> = (0..count).map(|i| message(root, i)).collect();
    for r in 0..s.cores.len() {
        if r != root as usize && !s.dead[r] {
            assert_eq!(s.got[r][root as usize].len(), count, "rank {r} from root {root}");
            assert!(s.got[r][root as usize] == want, "rank {r} got root {root}'s messages out of order or altered");
        }
    }
}

#[test]
fn lossy_duplicating_reordering_network_delivers_exactly_once_in_order_across_wraparound() {
    for (loss, seed) in [(0.0, 1u64), (0.05, 2), (0.2, 3), (0.4, 4)] {
        // Sequence numbers start 100 below the wrap.
        let mut s = Sim::new(10, |c| c.first_seq = u32::MAX - 100);
        s.rng ^= seed;
        s.loss = loss;
        s.dup = 0.05;
        s.jitter = Duration::from_micros(60);
        s.confirm_groups();
        assert!(s.cores.iter().all(|c| c.confirmed()), "loss {loss}: group confirmed despite loss");
        const N: usize = 300;
        for root in [0, 3] {
            s.outbox[root as usize] = (0..N).map(|i| message(root, i)).collect();
        }
        let ok = s.run(Duration::from_secs(30), |s| s.all_received(0, N) && s.all_received(3, N));
        assert!(ok, "loss {loss}: not everything arrived");
        check_exactly_once_in_order(&s, 0, N);
        check_exactly_once_in_order(&s, 3, N);
        // The stream crossed u32::MAX.
        assert!(s.cores[0].next_seq() < N as u32, "wrapped to {}", s.cores[0].next_seq());
        assert_eq!(s.cores[0].next_seq(), (u32::MAX - 100).wrapping_add(N as u32));
        // Everything ends acknowledged: the window empties.
        let ok = s.run(Duration::from_secs(5), |s| s.cores[0].in_flight() == 0 && s.cores[3].in_flight() == 0);
        assert!(ok, "loss {loss}: window did not drain");
        let total = |f: fn(&Stats) -> u64| s.cores.iter().map(|c| f(c.stats())).sum::<u64>();
        if loss > 0.0 {
            assert!(total(|st| st.retransmissions) > 0 && total(|st| st.nacks_sent) > 0, "loss {loss}");
        }
        assert!(total(|st| st.acks_at_coroot) > 0, "co-roots collected ACKs");
        assert!(total(|st| st.duplicates) > 0, "duplicated datagrams were noticed");
        assert_eq!(total(|st| st.malformed), 0);
        // Memory is back to nothing.
        for r in 0..10 {
            for root in 0..10 {
                assert_eq!(s.cores[r].buffered(root), 0);
            }
        }
    }
}

#[test]
fn delivered_to_all_reports_reach_the_root() {
    let mut s = Sim::new(6, |_| {});
    s.confirm_groups();
    s.outbox[0] = (0..40).map(|i| message(0, i)).collect();
    assert!(s.run(Duration::from_secs(5), |s| s.events[0].contains(&Event::DeliveredToAll { upto: 40 })));
}

#[test]
fn leaf_stalling_longer_than_the_window_blocks_the_root_then_catches_up() {
    let mut s = Sim::new(9, |c| c.window = 8);
    s.loss = 0.1;
    s.confirm_groups();
    let root = 0;
    let layout = s.cores[root].layout().clone();
    let leaf = (1..9).find(|&r| !layout.is_coroot(r) && layout.collector_of(r) != 0).unwrap();
    s.stalled_until[leaf as usize] = s.now + Duration::from_secs(2);
    s.outbox[root] = (0..100).map(|i| message(0, i)).collect();
    // While the leaf sleeps, the root fills its window and stops; nobody buffers beyond it.
    s.run(Duration::from_millis(300), |_| false);
    let retx = |s: &Sim| s.cores.iter().map(|c| c.stats().retransmissions).sum::<u64>();
    let early = retx(&s);
    s.run(Duration::from_millis(1200), |_| false);
    let asleep = retx(&s) - early;
    println!("retransmissions during 1.2 s of a sleeping leaf: {asleep}");
    assert!(asleep <= 40, "back-off keeps retransmissions to a sleeper bounded: {asleep}");
    assert_eq!(s.cores[root].in_flight(), 8, "window full");
    assert!(s.outbox[root].len() >= 100 - 8 - 8, "the root waited");
    assert!(s.cores[root].stats().window_stalls >= 1);
    for r in 1..9 {
        assert!(s.cores[r].buffered(0) <= 8, "rank {r} holds {}", s.cores[r].buffered(0));
    }
    assert!(s.got[leaf as usize][0].is_empty());
    let ok = s.run(Duration::from_secs(30), |s| s.all_received(0, 100));
    assert!(ok);
    check_exactly_once_in_order(&s, 0, 100);
    assert!(s.cores[leaf as usize].stats().false_retransmissions > 0, "the sleeper had what was resent");
}

#[test]
fn coroot_dying_midstream_its_leaves_still_get_everything() {
    for loss in [0.0, 0.1] {
        let mut s = Sim::new(17, |_| {});
        s.loss = loss;
        s.confirm_groups();
        let layout = s.cores[0].layout().clone();
        assert_eq!(layout.subgroups(), 4);
        let victim = layout.coroots[1];
        let leaves = layout.members_of(victim);
        assert!(!leaves.is_empty());
        s.outbox[0] = (0..200).map(|i| message(0, i)).collect();
        s.run(Duration::from_secs(10), |s| s.got[leaves[0] as usize][0].len() >= 50);
        s.kill(victim);
        let ok = s.run(Duration::from_secs(30), |s| s.all_received(0, 200));
        assert!(ok, "loss {loss}: leaves of the dead co-root stalled");
        check_exactly_once_in_order(&s, 0, 200);
        assert!(s.run(Duration::from_secs(5), |s| s.cores[0].in_flight() == 0), "window drains without the dead");
        assert!(s.events[0].contains(&Event::ReceiverLost { rank: victim }));
    }
}

#[test]
fn root_dying_ends_its_stream_with_an_error() {
    let mut s = Sim::new(5, |_| {});
    s.confirm_groups();
    s.outbox[2] = (0..10).map(|i| message(2, i)).collect();
    assert!(s.run(Duration::from_secs(5), |s| s.all_received(2, 10)));
    s.kill(2);
    s.run(Duration::from_millis(10), |_| false);
    for r in [0, 1, 3, 4] {
        assert!(s.events[r].contains(&Event::RootLost { root: 2 }));
        let now = s.at();
        assert_eq!(s.cores[r].pop(2, now), Err(()));
    }
}

#[test]
fn group_that_never_confirms_degrades_to_point_to_point() {
    let mut s = Sim::new(6, |_| {});
    s.loss = 1.0; // multicast filtered
    s.outbox[0] = (0..50).map(|i| message(0, i)).collect();
    // Point-to-point carries everything while the test runs and after it fails.
    assert!(s.run(Duration::from_secs(5), |s| s.all_received(0, 50)));
    check_exactly_once_in_order(&s, 0, 50);
    s.confirm_groups();
    assert!(s.cores.iter().all(|c| c.degraded()));
    assert!(s.events[0].contains(&Event::GroupDegraded));
    assert_eq!(s.cores[0].stats().groups_degraded, 1);
    s.outbox[0] = (50..80).map(|i| message(0, i)).collect();
    assert!(s.run(Duration::from_secs(5), |s| s.all_received(0, 80)));
}

#[test]
fn one_lost_fragment_of_a_large_message_is_recovered() {
    let mut s = Sim::new(4, |_| {});
    s.confirm_groups();
    // Drop fragment 2 of message 5 on its way to rank 3, once.
    let dropped = std::rc::Rc::new(std::cell::Cell::new(false));
    let d2 = dropped.clone();
    s.drop_if = Some(Box::new(move |to, d| {
        let hit = to == 3 && d[24..28] == 5u32.to_be_bytes() && d[32..34] == 2u16.to_be_bytes() && !d2.get();
        if hit {
            d2.set(true);
        }
        hit
    }));
    s.outbox[0] = (0..12).map(|i| Bytes::from(vec![i as u8; 1000])).collect();
    assert!(s.run(Duration::from_secs(5), |s| s.all_received(0, 12)));
    assert!(dropped.get());
    assert_eq!(s.got[3][0][5], Bytes::from(vec![5u8; 1000]));
    assert!(s.cores[3].stats().nacks_sent >= 1);
}

/// ACK implosion: with co-roots, the root handles about 1/(number of sub-groups) of the ACKs it
/// handles without them.
#[test]
fn coroots_cut_the_acks_at_the_root_to_one_per_subgroup() {
    for receivers in [8u32, 16] {
        let count = |subgroups: Option<usize>| {
            let mut s = Sim::new(receivers + 1, |c| {
                c.subgroups = subgroups;
                c.ack_every = 1;
            });
            s.confirm_groups();
            let before = s.cores[0].stats().acks_at_root;
            s.outbox[0] = (0..200).map(|i| message(0, i)).collect();
            assert!(s.run(Duration::from_secs(10), |s| s.all_received(0, 200) && s.cores[0].in_flight() == 0));
            (s.cores[0].stats().acks_at_root - before, s.cores[0].layout().subgroups())
        };
        let (flat, g1) = count(Some(1));
        let (tree, g) = count(None);
        assert_eq!(g1, 1);
        let share = tree as f64 / flat as f64;
        println!(
            "{receivers} receivers: root handled {flat} ACKs without co-roots, {tree} with {g} sub-groups: {share:.3} (1/{g} = {:.3})",
            1.0 / g as f64
        );
        assert!(share > 0.6 / g as f64 && share < 1.4 / g as f64, "share {share} vs 1/{g}");
    }
}

#[test]
fn layout_balances_the_collectors() {
    for size in 2..70u32 {
        let l = Layout::new(0, size, None);
        let r = size as usize - 1;
        let loads: Vec<usize> =
            std::iter::once(0).chain(l.coroots.iter().copied()).map(|c| l.members_of(c).len()).collect();
        assert_eq!(loads.iter().sum::<usize>(), r, "size {size}: every receiver has one collector");
        let (lo, hi) = (loads.iter().min().unwrap(), loads.iter().max().unwrap());
        assert!(hi - lo <= 1, "size {size}: loads {loads:?}");
        for m in 1..size {
            let c = l.collector_of(m);
            assert!(c == 0 || l.is_coroot(c));
            if l.is_coroot(m) {
                assert_eq!(c, 0);
            }
        }
    }
    let l = Layout::new(5, 9, Some(3));
    assert_eq!(l.coroots, vec![6, 7]);
}

#[test]
fn garbage_and_foreign_datagrams_are_refused_without_harm() {
    let t0 = Instant::now();
    let mut c = McastCore::new(cfg(1, 4), t0);
    let bad = [
        Bytes::from_static(b"short"),
        Bytes::from(vec![0xAB; 200]),
        wire::encode_ping(43, 9, 0, 1),                      // another job
        wire::encode_data(42, 9, 7, 0, b"x", 300).remove(0), // unknown rank
        Bytes::from(vec![0u8; 301]),                         // oversize
    ];
    for d in bad {
        assert!(c.handle_datagram(t0, d).is_err());
    }
    assert_eq!(c.stats().malformed, 5);
    // Data far beyond the window is dropped, not buffered.
    c.handle_datagram(t0, wire::encode_data(42, 9, 0, 1000, b"x", 300).remove(0)).unwrap();
    assert_eq!(c.buffered(0), 0);
    assert_eq!(c.stats().out_of_window, 1);
    assert!(c.handle_control(t0, 0, Bytes::from_static(b"\x09\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0")).is_err());
    // An ACK for messages never sent.
    assert!(matches!(
        c.handle_control(t0, 2, Control::Ack { root: 1, upto: 5 }.encode()),
        Err(ProtoError::AckBeyondSent { .. }) | Ok(())
    ));
    let _ = c.poll_transmit();
}

/// The root's point-to-point copies to the co-roots are slow (a congested connection): leaves
/// consume (and acknowledge) messages before their co-root has its own copy, and its multicast
/// copies are lost. Those ACKs must not be refused, or the stream stalls.
#[test]
fn leaves_ahead_of_their_coroot_do_not_stall_the_stream() {
    for k in [1, 8] {
        let mut s = Sim::new(9, |c| {
            c.ack_every = k;
            c.subgroups = Some(3);
        });
        s.confirm_groups();
        let coroots = s.cores[0].layout().coroots.clone();
        for &c in &coroots {
            s.slow.insert((0, c), Duration::from_millis(3));
        }
        s.drop_if = Some(Box::new(move |to, _| coroots.contains(&to)));
        s.outbox[0] = (0..200).map(|i| message(0, i)).collect();
        let ok = s.run(Duration::from_secs(20), |s| s.all_received(0, 200) && s.cores[0].in_flight() == 0);
        assert!(ok, "k {k}: stalled; in flight {}", s.cores[0].in_flight());
        check_exactly_once_in_order(&s, 0, 200);
        let malformed: u64 = s.cores.iter().map(|c| c.stats().malformed).sum();
        assert_eq!(malformed, 0, "k {k}: ACKs refused");
    }
}

/// What a rank must wait for before leaving (the driver's drain at finalize): a co-root that
/// consumed a message is not settled until its leaf acknowledged it and its own report went out,
/// since the root hears nothing more from it once it left.
#[test]
fn coroot_is_settled_only_once_its_report_covers_its_leaves() {
    let t0 = Instant::now();
    let c = |me| Config { multicast: false, ..cfg(me, 4) };
    let mut root = McastCore::new(c(0), t0);
    let mut coroot = McastCore::new(c(1), t0);
    assert_eq!(root.layout().coroots, [1]);
    let leaf = *root.layout().members_of(1).first().expect("the co-root has a leaf");
    assert!(coroot.settled());
    root.send(t0, message(0, 0)).unwrap();
    while let Some(t) = root.poll_transmit() {
        if let Transmit::Unicast { to: 1, msg } = t {
            coroot.handle_control(t0, 0, msg).unwrap();
        }
    }
    assert!(coroot.settled(), "nothing consumed yet: nothing owed");
    assert_eq!(coroot.pop(0, t0), Ok(Some(message(0, 0))));
    let later = t0 + Duration::from_millis(10);
    coroot.handle_timeout(later);
    assert!(!coroot.settled(), "consumed, but its leaf has not acknowledged");
    let ack = Control::Ack { root: 0, upto: 1 }.encode();
    coroot.handle_control(later, leaf, ack).unwrap();
    assert!(!coroot.settled(), "its report is not out yet");
    coroot.handle_timeout(later + Duration::from_millis(1));
    assert!(coroot.settled());
    let mut events = Vec::new();
    while let Some(e) = coroot.poll_event() {
        events.push(e);
    }
    assert!(events.contains(&Event::Acknowledged { root: 0, upto: 1 }), "{events:?}");
    let report = std::iter::from_fn(|| coroot.poll_transmit()).find_map(|t| match t {
        Transmit::Unicast { to: 0, msg } => Some(msg),
        _ => None,
    });
    root.handle_control(later, 1, report.expect("a report to the root")).unwrap();
    assert_eq!(root.in_flight(), 1, "the root's own leaf has not acknowledged yet");
}

#[test]
fn a_rank_keeps_state_only_for_the_roots_that_send_to_it() {
    let t0 = Instant::now();
    let mut core = McastCore::new(cfg(1, 4096), t0);
    assert!(core.receivers.is_empty(), "nothing per root before anything arrives");
    let d = wire::encode_data(42, 9, 3, 0, b"x", 300).pop().unwrap();
    core.handle_datagram(t0, d).unwrap();
    assert_eq!(core.receivers.keys().copied().collect::<Vec<_>>(), [3]);
    assert_eq!(core.pop(3, t0), Ok(Some(Bytes::from_static(b"x"))));
    core.peer_lost(t0, 7);
    assert!(core.root_lost(7), "a lost root's stream ends even if nothing of it came");
    assert!(
        core.poll_event()
            .into_iter()
            .chain(std::iter::from_fn(|| core.poll_event()))
            .any(|e| e == Event::RootLost { root: 7 })
    );
    assert_eq!(core.receivers.len(), 2);
}

#[test]
fn coroot_dead_before_the_stream_starts_its_leaves_acknowledge_to_the_root() {
    let mut s = Sim::new(17, |_| {});
    s.confirm_groups();
    let layout = s.cores[0].layout().clone();
    let victim = layout.coroots[0];
    let leaves = layout.members_of(victim);
    assert!(!leaves.is_empty());
    s.kill(victim);
    s.run(Duration::from_millis(10), |_| false);
    s.outbox[0] = (0..100).map(|i| message(0, i)).collect();
    assert!(s.run(Duration::from_secs(30), |s| s.all_received(0, 100)), "leaves of the dead co-root stalled");
    check_exactly_once_in_order(&s, 0, 100);
    assert!(s.run(Duration::from_secs(5), |s| s.cores[0].in_flight() == 0), "window drains without the dead");
}

/// Without loss nobody asks for anything, even when every co-root's reliable copy comes long
/// after the multicast of later messages: the copy is on its way, and a NACK would only make the
/// root send the message twice.
#[test]
fn coroots_never_nack_when_their_copies_lag_the_multicast() {
    let mut s = Sim::new(9, |c| c.subgroups = Some(3));
    s.confirm_groups();
    let coroots = s.cores[0].layout().coroots.clone();
    for &c in &coroots {
        s.slow.insert((0, c), Duration::from_millis(2));
    }
    // Each co-root misses some datagrams: only its copies complete those messages.
    let missed = coroots.clone();
    let k = std::cell::Cell::new(0u64);
    s.drop_if = Some(Box::new(move |to, _| {
        k.set(k.get() + 1);
        missed.contains(&to) && k.get().is_multiple_of(3)
    }));
    s.outbox[0] = (0..200).map(|i| message(0, i)).collect();
    let ok = s.run(Duration::from_secs(20), |s| s.all_received(0, 200) && s.cores[0].in_flight() == 0);
    assert!(ok, "stalled; in flight {}", s.cores[0].in_flight());
    check_exactly_once_in_order(&s, 0, 200);
    for &c in &coroots {
        assert_eq!(s.cores[c as usize].stats().nacks_sent, 0, "co-root {c} asked for a copy on its way");
    }
    // The leaves miss nothing either: the root hears no NACK at all.
    assert_eq!(s.cores[0].stats().nacks_received, 0);
}

/// Drops, once, the last datagram of message `seq` of root 0 on its way to `to`.
fn drop_last_fragment(to: Rank, seq: u32) -> (DropIf, std::rc::Rc<std::cell::Cell<bool>>) {
    let dropped = std::rc::Rc::new(std::cell::Cell::new(false));
    let d2 = dropped.clone();
    let f: DropIf = Box::new(move |r, d| {
        let last = d[5] == 1 && u16::from_be_bytes([d[32], d[33]]) + 1 == u16::from_be_bytes([d[6], d[7]]);
        let hit = r == to && d[24..28] == seq.to_be_bytes() && last && !d2.get();
        if hit {
            d2.set(true);
        }
        hit
    });
    (f, dropped)
}

/// Tail loss: nothing later arrives to reveal a lost last datagram, so the root's tail probe
/// (when the window fills, and `ack_delay` after its last send) makes the receiver ask at once;
/// the collector's retransmission timeout never has to fire.
#[test]
fn a_lost_tail_is_asked_for_after_the_tail_probe() {
    // The stream's last message, and the message that fills the window.
    for (count, window) in [(12usize, 16usize), (12, 4)] {
        let mut s = Sim::new(4, |c| c.window = window);
        s.confirm_groups();
        let last = (count.min(window) - 1) as u32;
        let (f, dropped) = drop_last_fragment(2, last);
        s.drop_if = Some(f);
        s.outbox[0] = (0..count).map(|i| Bytes::from(vec![i as u8; 1000])).collect();
        let ok = s.run(Duration::from_secs(5), |s| s.all_received(0, count) && s.cores[0].in_flight() == 0);
        assert!(ok && dropped.get(), "window {window}");
        assert_eq!(s.got[2][0][last as usize], Bytes::from(vec![last as u8; 1000]));
        let (root, leaf) = (s.cores[0].stats(), s.cores[2].stats());
        assert!(root.tail_probes >= 1, "window {window}: {root:?}");
        assert_eq!(leaf.nacks_sent, 1, "window {window}: {leaf:?}");
        assert_eq!(root.retransmissions, 1, "window {window}: one NACK, one retransmission, no timeout");
    }
}

/// A tail probe (like any later arrival) makes a leaf ask for every missing run below it at once,
/// each run in a NACK of its own, and not again while the answer may be on its way: one RTO, twice
/// that after a NACK that brought nothing, and so on, back to one RTO once a message completes.
#[test]
fn every_missing_run_below_the_tail_is_asked_for_at_once() {
    let t0 = Instant::now();
    let c = cfg(2, 4);
    let mut leaf = McastCore::new(c.clone(), t0);
    assert_eq!(leaf.receiver(0, t0).target, 0, "rank 2 acknowledges to the root");
    for seq in [0u32, 2, 4] {
        for d in wire::encode_data(c.job, c.channel, 0, seq, &[seq as u8; 10], c.datagram) {
            leaf.handle_datagram(t0, d).unwrap();
        }
    }
    let nacks = |leaf: &mut McastCore| {
        let mut v = Vec::new();
        while let Some(t) = leaf.poll_transmit() {
            if let Transmit::Unicast { to, msg } = t
                && let Ok(Control::Nack { from, to: end, .. }) = Control::decode(msg, 4)
            {
                v.push((to, from, end));
            }
        }
        v
    };
    assert_eq!(nacks(&mut leaf), [(0, 1, 2), (0, 3, 4)]);
    leaf.handle_datagram(t0, wire::encode_tail(c.job, c.channel, 0, 7)).unwrap();
    assert_eq!(nacks(&mut leaf), [(0, 5, 7)], "only what was not asked for yet");
    leaf.handle_datagram(t0, wire::encode_tail(c.job, c.channel, 0, 7)).unwrap();
    assert_eq!(nacks(&mut leaf), [], "the answers may be on their way");
    let later = t0 + c.rto_initial;
    leaf.handle_datagram(later, wire::encode_tail(c.job, c.channel, 0, 7)).unwrap();
    assert_eq!(nacks(&mut leaf), [(0, 1, 2), (0, 3, 4), (0, 5, 7)], "asked again after the initial RTO");
    // Nothing came since: the next NACK of the same gap waits twice as long, then four times.
    leaf.handle_datagram(later + c.rto_initial, wire::encode_tail(c.job, c.channel, 0, 7)).unwrap();
    assert_eq!(nacks(&mut leaf), [], "no progress: the hold has doubled");
    let again = later + 2 * c.rto_initial;
    leaf.handle_datagram(again, wire::encode_tail(c.job, c.channel, 0, 7)).unwrap();
    assert_eq!(nacks(&mut leaf), [(0, 1, 2), (0, 3, 4), (0, 5, 7)], "asked again after twice the RTO");
    leaf.handle_datagram(again + 3 * c.rto_initial, wire::encode_tail(c.job, c.channel, 0, 7)).unwrap();
    assert_eq!(nacks(&mut leaf), [], "and then after four times");
    // A repair that completes the next message resets the back-off.
    for d in wire::encode_data(c.job, c.channel, 0, 1, &[1u8; 10], c.datagram) {
        leaf.handle_datagram(again + 3 * c.rto_initial, d).unwrap();
    }
    let fresh = again + 4 * c.rto_initial;
    leaf.handle_datagram(fresh, wire::encode_tail(c.job, c.channel, 0, 7)).unwrap();
    assert_eq!(nacks(&mut leaf), [(0, 3, 4), (0, 5, 7)], "progress: asked at once for what still lacks");
    leaf.handle_datagram(fresh + c.rto_initial, wire::encode_tail(c.job, c.channel, 0, 7)).unwrap();
    assert_eq!(nacks(&mut leaf), [(0, 3, 4), (0, 5, 7)], "and again after one RTO");
    // A probe with a payload is malformed.
    let mut bad = BytesMut::from(&wire::encode_tail(c.job, c.channel, 0, 7)[..]);
    bad.extend_from_slice(b"x");
    assert!(leaf.handle_datagram(later, bad.freeze()).is_err());
}

/// A co-root asked for messages its own copies have not brought yet retransmits each of them as
/// it comes, and only those.
#[test]
fn a_coroot_serves_a_nack_for_messages_it_gets_later() {
    let t0 = Instant::now();
    let c = cfg(1, 4);
    let mut coroot = McastCore::new(c.clone(), t0);
    assert!(coroot.receiver(0, t0).coroot.is_some());
    let nack = Control::Nack { root: 0, from: 1, to: 3 }.encode();
    coroot.handle_control(t0, 3, nack).unwrap();
    let sent = |core: &mut McastCore| {
        let mut v = Vec::new();
        while let Some(t) = core.poll_transmit() {
            if let Transmit::Unicast { to, msg } = t
                && let Ok(Control::Data { seq, copy: false, .. }) = Control::decode(msg, 4)
            {
                v.push((to, seq));
            }
        }
        v
    };
    assert_eq!(sent(&mut coroot), []);
    for seq in 0..4u32 {
        let copy = Control::Data { root: 0, seq, copy: true, data: Bytes::from(vec![seq as u8; 5]) }.encode();
        coroot.handle_control(t0, 0, copy).unwrap();
    }
    assert_eq!(sent(&mut coroot), [(3, 1), (3, 2)]);
    assert_eq!(coroot.stats().retransmissions, 2);
}
