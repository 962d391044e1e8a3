//! The striping core against a model of rails with fixed bandwidths: a sender's and a receiver's
//! cores, the bytes of one message, and time in steps.

use super::*;

const MIB: usize = 1 << 20;

fn cfg() -> StripeConfig {
    StripeConfig {
        threshold: 256 * 1024,
        part: 64 * 1024,
        window: 256 * 1024,
        stall: Duration::from_millis(50),
        initial_bandwidth: 1e9,
    }
}

/// Rank 0 sends to rank 1 over `rails` rails of the given bandwidths (bytes per second).
struct Net {
    now: Instant,
    tx: Stripe,
    rx: Stripe,
    /// Per rail: bytes per second (0: the link is down), and frames on the wire with the bytes
    /// of the front one already moved.
    rate: Vec<f64>,
    wire: Vec<VecDeque<(Header, Bytes)>>,
    moved_front: Vec<f64>,
    dest: Vec<u8>,
    delivered: usize,
    control: Vec<Header>,
}

impl Net {
    fn new(rate: &[f64], cfg: StripeConfig) -> Net {
        let now = Instant::now();
        let n = rate.len();
        let links = vec![vec![false; n], vec![true; n]];
        let back = vec![vec![true; n], vec![false; n]];
        Net {
            now,
            tx: Stripe::new(cfg, &links, now),
            rx: Stripe::new(cfg, &back, now),
            rate: rate.to_vec(),
            wire: vec![VecDeque::new(); n],
            moved_front: vec![0.0; n],
            dest: Vec::new(),
            delivered: 0,
            control: Vec::new(),
        }
    }

    /// The engine emits a rendezvous message of `len` bytes as data frames of 512 KiB.
    fn send_message(&mut self, len: usize) -> Vec<u8> {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        self.dest = vec![0; len];
        let data = Bytes::from(data.clone());
        let mut off = 0;
        while off < len {
            let end = (off + 512 * 1024).min(len);
            let h = Header { seq: 3, aux: off as u64, len: (end - off) as u32, ..Header::new(Kind::Data) };
            if self.tx.takes(1, &h) {
                self.tx.send(1, h, data.slice(off..end), self.now);
            } else {
                self.wire[0].push_back((h, data.slice(off..end)));
            }
            off = end;
        }
        self.pump();
        data.to_vec()
    }

    fn pump(&mut self) {
        while let Some((rail, peer, h, payload)) = self.tx.poll_transmit() {
            assert_eq!(peer, 1);
            self.wire[rail].push_back((h, payload));
        }
    }

    /// Advances time by `dt`: every link moves what its rate allows; the receiver takes whole
    /// frames and acknowledges at once.
    fn step(&mut self, dt: Duration) {
        self.now += dt;
        for rail in 0..self.wire.len() {
            let mut budget = self.rate[rail] * dt.as_secs_f64();
            while let Some((h, _)) = self.wire[rail].front() {
                let need = h.len as f64 - self.moved_front[rail];
                if budget < need {
                    self.moved_front[rail] += budget;
                    break;
                }
                budget -= need;
                self.moved_front[rail] = 0.0;
                let (h, payload) = self.wire[rail].pop_front().unwrap();
                self.receive(rail, h, payload);
            }
        }
        while let Some((rail, peer, ack)) = self.rx.poll_ack(1) {
            assert_eq!(peer, 0);
            if self.rate[rail] > 0.0 {
                self.tx.on_ack(1, rail, ack.seq, self.now);
            }
        }
        self.tx.handle_timeout(self.now);
        self.pump();
    }

    fn receive(&mut self, rail: usize, h: Header, payload: Bytes) {
        if h.kind != Kind::Data {
            self.control.push(h);
            return;
        }
        let ok = if h.flags & flags::RAIL_PART == 0 {
            true
        } else {
            self.rx.check_part(0, h.tag).unwrap();
            if rail == 0 && !self.rx.land(0, h.tag) {
                assert!(!self.rx.arrived(0, rail, h.tag));
                return;
            }
            self.rx.arrived(0, rail, h.tag)
        };
        if ok {
            let at = h.aux as usize;
            self.dest[at..at + payload.len()].copy_from_slice(&payload);
            self.delivered += payload.len();
        }
    }

    fn run_until_whole(&mut self, limit: usize) {
        for _ in 0..limit {
            if self.delivered >= self.dest.len() && !self.tx.busy() {
                return;
            }
            self.step(Duration::from_micros(100));
        }
        panic!("not whole after {limit} steps: {} of {} bytes", self.delivered, self.dest.len());
    }

    fn carried(&self) -> Vec<u64> {
        self.tx.stats(1).iter().map(|s| s.map_or(0, |s| s.carried)).collect()
    }
}

#[test]
fn unequal_rails_carry_shares_in_proportion_to_their_bandwidth() {
    let mut n = Net::new(&[2e9, 1e9], cfg());
    // Two messages: the second runs with measured bandwidths.
    for _ in 0..2 {
        let data = n.send_message(16 * MIB);
        n.run_until_whole(100_000);
        assert_eq!(n.dest, data);
        assert_eq!(n.delivered, data.len());
        n.delivered = 0;
    }
    let c = n.carried();
    let share = c[0] as f64 / (c[0] + c[1]) as f64;
    assert!((0.6..0.73).contains(&share), "fast rail's share {share:.3} of {c:?}");
    let s = n.tx.stats(1);
    let (fast, slow) = (s[0].unwrap(), s[1].unwrap());
    assert!(fast.measured && slow.measured);
    let ratio = fast.bandwidth / slow.bandwidth;
    assert!((1.5..2.7).contains(&ratio), "estimates {} and {}", fast.bandwidth, slow.bandwidth);
}

#[test]
fn equal_rails_split_evenly_and_small_messages_stay_on_rail_zero() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    let data = n.send_message(8 * MIB);
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    let c = n.carried();
    let share = c[0] as f64 / (c[0] + c[1]) as f64;
    assert!((0.4..0.6).contains(&share), "{c:?}");
    // Below the threshold: one data frame at offset 0, not taken.
    let small = Header { len: 100_000, ..Header::new(Kind::Data) };
    assert!(!n.tx.takes(1, &small));
    let later = Header { len: 100_000, aux: 512 * 1024, ..Header::new(Kind::Data) };
    assert!(n.tx.takes(1, &later));
    assert!(!n.tx.takes(1, &Header::new(Kind::Eager)));
}

#[test]
fn a_rail_that_fails_mid_message_hands_its_parts_to_the_others() {
    let mut n = Net::new(&[1e9, 1e9, 1e9], cfg());
    let data = n.send_message(8 * MIB);
    for _ in 0..20 {
        n.step(Duration::from_micros(100));
    }
    assert!(n.delivered > 0 && n.delivered < data.len());
    // Rail 2's link goes down: nothing more crosses it, and its connection reports the loss;
    // what it had on the wire is lost with it.
    n.rate[2] = 0.0;
    n.wire[2].clear();
    n.tx.rail_lost(1, 2, n.now);
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    assert!(n.tx.moved(1) > 0);
    assert!(!n.tx.stats(1)[2].unwrap().up);
}

#[test]
fn a_silent_rail_is_dropped_after_the_stall_time_and_duplicates_are_discarded() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    let data = n.send_message(4 * MIB);
    n.step(Duration::from_micros(100));
    // Rail 1 stops moving, with parts on it (no acknowledgement, no loss reported).
    n.rate[1] = 0.0;
    let deadline = n.tx.poll_timeout().expect("a stall deadline");
    assert!(deadline <= n.now + cfg().stall);
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    assert_eq!(n.tx.poll_cut(), Some((1, 1)));
    assert!(n.tx.moved(1) > 0);
    // The parts stuck on rail 1 arrive after all (the link comes back before the connection is
    // closed): every one is a duplicate, discarded, the message unchanged.
    let before = n.delivered;
    n.rate[1] = 1e9;
    n.dest.iter_mut().for_each(|b| *b = 0);
    n.delivered = 0;
    let stuck: Vec<_> = n.wire[1].drain(..).collect();
    assert!(!stuck.is_empty());
    for (h, payload) in stuck {
        n.receive(1, h, payload);
    }
    assert_eq!(n.delivered, 0, "duplicates delivered ({before} before)");
}

#[test]
fn a_goodbye_waits_until_every_part_is_acknowledged() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    let data = n.send_message(2 * MIB);
    let bye = Header::new(Kind::Bye);
    assert!(n.tx.takes(1, &bye));
    n.tx.send(1, bye, Bytes::new(), n.now);
    // Anything after it keeps its place behind it.
    let lost = Header::new(Kind::Lost);
    assert!(n.tx.takes(1, &lost));
    n.tx.send(1, lost, Bytes::new(), n.now);
    n.pump();
    assert!(n.wire[0].iter().all(|(h, _)| h.kind == Kind::Data));
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    n.step(Duration::from_micros(100));
    let kinds: Vec<Kind> = n.control.iter().map(|h| h.kind).collect();
    assert_eq!(kinds, [Kind::Bye, Kind::Lost]);
    assert!(!n.tx.takes(1, &Header::new(Kind::Bye)));
}

#[test]
fn bad_acknowledgements_and_far_part_ids_are_violations() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.tx.on_ack(1, 1, 5, n.now);
    assert!(matches!(n.tx.poll_violation(), Some((1, WireError::Link(_)))));
    n.tx.on_ack(1, 7, 0, n.now);
    assert!(matches!(n.tx.poll_violation(), Some((1, WireError::Link(_)))));
    assert!(n.rx.check_part(0, MAX_AHEAD - 1).is_ok());
    assert!(n.rx.check_part(0, MAX_AHEAD).is_err());
    // Out of order, then filling the gap: the low-water mark catches up.
    assert!(n.rx.arrived(0, 1, 1));
    assert!(!n.rx.arrived(0, 1, 1));
    assert!(n.rx.land(0, 0));
    assert!(!n.rx.arrived(0, 1, 0), "being read on rail 0");
    assert!(n.rx.arrived(0, 0, 0));
    assert_eq!((n.rx.peers[0].low, n.rx.peers[0].above.len()), (2, 0));
    assert!(!n.rx.land(0, 1));
}

#[test]
fn losing_rail_zero_drops_everything_for_the_peer() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.send_message(2 * MIB);
    n.tx.rail_lost(1, 0, n.now);
    assert!(!n.tx.busy());
    let d = Header { len: MIB as u32, ..Header::new(Kind::Data) };
    assert!(!n.tx.takes(1, &d));
}
