//! The striping core against a model of rails with fixed bandwidths: a sender's and a receiver's
//! cores, the bytes of one message, control frames, and time in steps.

use super::*;

const MIB: usize = 1 << 20;

fn cfg() -> StripeConfig {
    StripeConfig {
        threshold: 256 * 1024,
        part: 64 * 1024,
        window: 256 * 1024,
        stall: Duration::from_millis(50),
        initial_bandwidth: 1e9,
        reprobe: Duration::from_millis(20),
        reprobe_messages: 4,
        control_window: 64,
        control_window_bytes: 64 * 1024,
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
    /// Control frames delivered, in order, and copies discarded.
    control: Vec<(Header, Bytes)>,
    copies: usize,
    /// The receiver reads nothing (a busy or paused process): frames stay on the wire.
    paused: bool,
}

impl Net {
    fn new(rate: &[f64], cfg: StripeConfig) -> Net {
        let now = Instant::now();
        let n = rate.len();
        let links = vec![vec![false; n], vec![true; n]];
        let back = vec![vec![true; n], vec![false; n]];
        Net {
            now,
            tx: Stripe::new(0, cfg, &links, now),
            rx: Stripe::new(1, cfg, &back, now),
            rate: rate.to_vec(),
            wire: vec![VecDeque::new(); n],
            moved_front: vec![0.0; n],
            dest: Vec::new(),
            delivered: 0,
            control: Vec::new(),
            copies: 0,
            paused: false,
        }
    }

    /// The engine emits a rendezvous message of `len` bytes as data frames of 512 KiB.
    fn send_message(&mut self, len: usize) -> Vec<u8> {
        let data: Vec<u8> = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
        self.dest = vec![0; len];
        self.delivered = 0;
        let data = Bytes::from(data.clone());
        let mut off = 0;
        while off < len {
            let end = (off + 512 * 1024).min(len);
            let h = Header { seq: 3, aux: off as u64, len: (end - off) as u32, ..Header::new(Kind::Data) };
            assert!(self.tx.takes(1, &h));
            self.tx.send(1, h, data.slice(off..end), self.now);
            off = end;
        }
        self.pump();
        data.to_vec()
    }

    /// The engine emits a control frame (`seq` tells them apart).
    fn send_control(&mut self, kind: Kind, seq: u64, payload: &'static [u8]) {
        let h = Header { seq, len: payload.len() as u32, ..Header::new(kind) };
        assert!(self.tx.takes(1, &h));
        self.tx.send(1, h, Bytes::from_static(payload), self.now);
        self.pump();
    }

    fn pump(&mut self) {
        while let Some((rail, peer, h, payload)) = self.tx.poll_transmit() {
            assert_eq!(peer, 1);
            self.wire[rail].push_back((h, payload));
        }
    }

    /// Rail `rail`'s link goes down: nothing more crosses it, what was on it is lost (the front
    /// frame possibly half moved), and its connection reports the loss.
    fn kill(&mut self, rail: usize) {
        self.rate[rail] = 0.0;
        self.wire[rail].clear();
        self.moved_front[rail] = 0.0;
        assert!(!self.tx.rail_lost(1, rail, self.now));
        assert!(!self.rx.rail_lost(0, rail, self.now));
        self.pump();
    }

    /// Advances time by `dt`: every link moves what its rate allows; the receiver takes whole
    /// frames and acknowledges what it owes (acknowledgements cross at once, unless their link
    /// is down).
    fn step(&mut self, dt: Duration) {
        self.now += dt;
        let links = if self.paused { 0 } else { self.wire.len() };
        for rail in 0..links {
            let mut budget = self.rate[rail] * dt.as_secs_f64();
            while let Some((h, _)) = self.wire[rail].front() {
                let need = h.len as f64 - self.moved_front[rail];
                if budget < need || self.rate[rail] == 0.0 {
                    self.moved_front[rail] += budget;
                    break;
                }
                budget -= need;
                self.moved_front[rail] = 0.0;
                let (h, payload) = self.wire[rail].pop_front().unwrap();
                self.receive(rail, h, payload);
            }
        }
        if !self.paused {
            self.rx.handle_timeout(self.now);
            while let Some((rail, peer, ack)) = self.rx.poll_ack() {
                assert_eq!(peer, 0);
                if self.rate[rail] > 0.0 {
                    self.tx.on_rail_frame(1, rail, &ack, self.now);
                }
            }
        }
        self.tx.handle_timeout(self.now);
        self.pump();
        assert_eq!(self.tx.poll_violation(), None);
        assert_eq!(self.rx.poll_violation(), None);
    }

    fn receive(&mut self, rail: usize, h: Header, payload: Bytes) {
        if h.kind == Kind::Credit && h.flags & flags::RAIL_ACK != 0 {
            return self.rx.on_rail_frame(0, rail, &h, self.now);
        }
        if h.kind != Kind::Data {
            match self.rx.control(0, rail, self.now) {
                Ok(true) => self.control.push((h, payload)),
                Ok(false) => self.copies += 1,
                Err(e) => panic!("control frame refused: {e}"),
            }
            return;
        }
        assert!(h.flags & flags::RAIL_PART != 0);
        self.rx.check_part(0, h.tag).unwrap();
        if self.rx.arrived(0, rail, h.tag) {
            let at = h.aux as usize;
            self.dest[at..at + payload.len()].copy_from_slice(&payload);
            self.delivered += payload.len();
        }
    }

    fn run_until_whole(&mut self, limit: usize) {
        for _ in 0..limit {
            if self.delivered >= self.dest.len() && !self.tx.busy() && self.tx.peers[1].ctrl.is_empty() {
                return;
            }
            self.step(Duration::from_micros(100));
        }
        panic!("not whole after {limit} steps: {} of {} bytes", self.delivered, self.dest.len());
    }

    fn carried(&self) -> Vec<u64> {
        self.tx.stats(1).iter().map(|s| s.map_or(0, |s| s.carried)).collect()
    }

    fn seqs(&self) -> Vec<u64> {
        self.control.iter().map(|(h, _)| h.seq).collect()
    }

    /// Steps until `n` control frames arrived and the sender keeps none.
    fn run_until_controls(&mut self, n: usize, limit: usize) {
        for _ in 0..limit {
            let p = &self.tx.peers[1];
            if self.control.len() >= n && p.ctrl.is_empty() && p.ctrl_wait.is_empty() {
                return;
            }
            self.step(Duration::from_micros(100));
        }
        panic!("{} of {n} control frames after {limit} steps", self.control.len());
    }

    fn probes_on_the_wire(&self) -> usize {
        self.wire.iter().flatten().filter(|(h, _)| h.flags & flags::RAIL_ACK != 0 && h.tag == PROBE).count()
    }

    fn all_up(&self) -> bool {
        self.tx.stats(1).iter().flatten().all(|s| s.up)
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
fn equal_rails_split_evenly_and_small_frames_travel_whole() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    let data = n.send_message(8 * MIB);
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    let c = n.carried();
    let share = c[0] as f64 / (c[0] + c[1]) as f64;
    assert!((0.4..0.6).contains(&share), "{c:?}");
    // Below the threshold: one data frame at offset 0 is one part; a control frame is one frame.
    let small = Header { len: 100_000, ..Header::new(Kind::Data) };
    assert!(n.tx.takes(1, &small));
    n.tx.send(1, small, Bytes::from(vec![1u8; 100_000]), n.now);
    n.tx.send(1, Header { len: 5, ..Header::new(Kind::Eager) }, Bytes::from_static(b"hello"), n.now);
    let sent: Vec<_> = std::iter::from_fn(|| n.tx.poll_transmit()).collect();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!((sent[0].2.len, sent[0].2.flags & flags::RAIL_PART), (100_000, flags::RAIL_PART));
    assert_eq!((sent[1].0, sent[1].2.kind), (0, Kind::Eager));
    // A proxy's envelope is not taken.
    assert!(!n.tx.takes(1, &Header { flags: flags::RELAY, ..Header::new(Kind::Data) }));
}

#[test]
fn a_rail_that_fails_mid_message_hands_its_parts_to_the_others() {
    let mut n = Net::new(&[1e9, 1e9, 1e9], cfg());
    let data = n.send_message(8 * MIB);
    for _ in 0..20 {
        n.step(Duration::from_micros(100));
    }
    assert!(n.delivered > 0 && n.delivered < data.len());
    n.kill(2);
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    assert!(n.tx.moved(1) > 0);
    assert!(!n.tx.stats(1)[2].unwrap().up);
}

#[test]
fn rail_zero_dies_with_a_header_in_flight() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.send_control(Kind::Rts, 1, b"");
    let data = n.send_message(4 * MIB);
    for _ in 0..5 {
        n.step(Duration::from_micros(100));
    }
    assert_eq!(n.seqs(), [1]);
    // Headers behind the parts on rail 0: written, not yet across when rail 0 dies.
    n.send_control(Kind::Eager, 2, b"two");
    n.send_control(Kind::Rts, 3, b"");
    assert!(n.wire[0].iter().any(|(h, _)| h.kind == Kind::Eager));
    n.kill(0);
    assert!(n.tx.replayed(1) >= 2, "replayed {}", n.tx.replayed(1));
    let s = n.tx.stats(1);
    assert!(!s[0].unwrap().up && !s[0].unwrap().control && s[1].unwrap().control);
    n.send_control(Kind::Eager, 4, b"four");
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    // Every header once, in order, with its payload; nothing left unacknowledged.
    assert_eq!(n.seqs(), [1, 2, 3, 4]);
    assert_eq!(&n.control[1].1[..], b"two");
    assert_eq!(&n.control[3].1[..], b"four");
    assert!(n.tx.peers[1].ctrl.is_empty());
    assert!(n.tx.moved(1) > 0);
}

#[test]
fn a_part_half_sent_when_its_rail_dies_comes_whole_on_another() {
    for dead in [0, 1] {
        let mut n = Net::new(&[1e9, 1e9], cfg());
        let data = n.send_message(2 * MIB);
        // Until the front part on the rail is partly across.
        while n.moved_front[dead] == 0.0 {
            n.step(Duration::from_micros(30));
        }
        assert!(n.moved_front[dead] > 0.0 && n.delivered < data.len());
        n.kill(dead);
        n.run_until_whole(100_000);
        assert_eq!(n.dest, data, "rail {dead} died");
        assert_eq!(n.delivered, data.len(), "every byte delivered once");
        assert!(n.tx.moved(1) > 0);
    }
}

#[test]
fn copies_after_a_replay_are_discarded() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    let data = n.send_message(4 * MIB);
    n.step(Duration::from_micros(100));
    // Rail 0 goes silent with parts and headers on it (no acknowledgement, no loss reported).
    n.send_control(Kind::Rts, 1, b"");
    n.send_control(Kind::Eager, 2, b"x");
    n.rate[0] = 0.0;
    let deadline = n.tx.poll_timeout().expect("a stall deadline");
    assert!(deadline <= n.now + cfg().stall);
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    assert_eq!(n.tx.poll_cut(), Some((0, 1)));
    assert_eq!(n.seqs(), [1, 2]);
    assert_eq!(n.copies, 0);
    // What was stuck on rail 0 arrives after all (the link comes back before the connection is
    // closed): every part and header is a copy, discarded.
    n.rate[0] = 1e9;
    n.dest.iter_mut().for_each(|b| *b = 0);
    n.delivered = 0;
    let stuck: Vec<_> = n.wire[0].drain(..).collect();
    assert!(stuck.iter().any(|(h, _)| h.kind == Kind::Data) && stuck.iter().any(|(h, _)| h.kind == Kind::Eager));
    for (h, payload) in stuck {
        n.receive(0, h, payload);
    }
    assert_eq!(n.delivered, 0, "parts delivered twice");
    assert_eq!(n.seqs(), [1, 2], "headers delivered twice");
    assert_eq!(n.copies, 2);
    // New headers still flow on rail 1.
    n.send_control(Kind::Cts, 3, b"");
    n.step(Duration::from_micros(100));
    assert_eq!(n.seqs(), [1, 2, 3]);
}

#[test]
fn a_silent_second_rail_is_dropped_after_the_stall_time() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    let data = n.send_message(4 * MIB);
    n.step(Duration::from_micros(100));
    n.rate[1] = 0.0;
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    assert_eq!(n.tx.poll_cut(), Some((1, 1)));
    assert!(n.tx.moved(1) > 0);
    let before = n.delivered;
    n.dest.iter_mut().for_each(|b| *b = 0);
    let stuck: Vec<_> = n.wire[1].drain(..).collect();
    assert!(!stuck.is_empty());
    for (h, payload) in stuck {
        n.receive(1, h, payload);
    }
    assert_eq!(n.delivered, before, "duplicates delivered");
    // Its late acknowledgement changes nothing.
    n.tx.on_ack(1, 1, n.tx.peers[1].rails[1].as_ref().unwrap().sent, n.now);
    assert_eq!(n.tx.poll_violation(), None);
}

#[test]
fn the_last_rail_is_never_dropped_for_a_stall_and_its_loss_is_the_peers() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.send_message(2 * MIB);
    n.kill(1);
    n.rate[0] = 0.0;
    for _ in 0..2000 {
        n.step(Duration::from_micros(100));
    }
    assert_eq!(n.tx.poll_cut(), None);
    assert!(n.tx.poll_timeout().is_none(), "no deadline with one rail left");
    assert!(n.tx.rail_lost(1, 0, n.now), "the last rail");
    assert!(!n.tx.busy());
    assert!(!n.tx.takes(1, &Header::new(Kind::Eager)));
    assert!(!n.tx.rail_lost(1, 0, n.now), "reported once");
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
    let kinds: Vec<Kind> = n.control.iter().map(|(h, _)| h.kind).collect();
    assert_eq!(kinds, [Kind::Bye, Kind::Lost]);
}

#[test]
fn bad_acknowledgements_marks_and_far_part_ids_are_violations() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.tx.on_ack(1, 1, 5, n.now);
    assert!(matches!(n.tx.poll_violation(), Some((1, WireError::Link(_)))));
    n.tx.on_ack(1, 7, 0, n.now);
    assert!(matches!(n.tx.poll_violation(), Some((1, WireError::Link(_)))));
    let ack = |tag, seq| Header { flags: flags::RAIL_ACK, tag, seq, ..Header::new(Kind::Credit) };
    n.tx.on_rail_frame(1, 0, &ack(ACK_CONTROL, 1), n.now);
    assert!(matches!(n.tx.poll_violation(), Some((1, WireError::Link(_)))), "acknowledges nothing sent");
    n.tx.on_rail_frame(1, 0, &ack(9, 0), n.now);
    assert!(matches!(n.tx.poll_violation(), Some((1, WireError::Link(_)))));
    // A control frame on a rail before its mark, a mark or a frame past a gap.
    assert!(n.rx.control(0, 1, n.now).is_err());
    n.rx.on_rail_frame(0, 1, &ack(MARK, 1), n.now);
    assert!(matches!(n.rx.poll_violation(), Some((0, WireError::Link(_)))));
    n.rx.on_rail_frame(0, 1, &ack(MARK, 0), n.now);
    assert_eq!(n.rx.poll_violation(), None);
    assert_eq!(n.rx.control(0, 1, n.now), Ok(true));
    assert_eq!(n.rx.control(0, 0, n.now), Ok(false), "index 0 again");
    assert_eq!(n.rx.control(0, 0, n.now), Ok(true), "index 1");
    n.rx.on_rail_frame(0, 1, &ack(MARK, 2), n.now);
    assert_eq!(n.rx.poll_violation(), None);
    n.rx.peers[0].cursor[1] = Some(5);
    assert!(n.rx.control(0, 1, n.now).is_err(), "a gap");
    assert!(n.rx.check_part(0, MAX_AHEAD - 1).is_ok());
    assert!(n.rx.check_part(0, MAX_AHEAD).is_err());
    // Out of order, then filling the gap: the low-water mark catches up.
    assert!(n.rx.arrived(0, 1, 1));
    assert!(!n.rx.arrived(0, 0, 1));
    assert!(n.rx.arrived(0, 0, 0));
    assert_eq!((n.rx.peers[0].low, n.rx.peers[0].above.len()), (2, 0));
}

#[test]
fn control_acknowledgements_are_coalesced() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    for i in 0..(CTRL_ACK_EVERY - 1) {
        n.send_control(Kind::Eager, i, b"e");
    }
    n.step(Duration::from_micros(10));
    assert_eq!(n.tx.peers[1].ctrl.len() as u64, CTRL_ACK_EVERY - 1, "none acknowledged yet");
    assert!(n.rx.poll_timeout().is_some_and(|t| t <= n.now + ACK_DELAY_MAX));
    n.send_control(Kind::Eager, 99, b"e");
    n.step(Duration::from_micros(10));
    assert!(n.tx.peers[1].ctrl.is_empty(), "acknowledged at {CTRL_ACK_EVERY}");
    n.send_control(Kind::Eager, 100, b"e");
    n.step(Duration::from_micros(10));
    assert_eq!(n.tx.peers[1].ctrl.len(), 1);
    n.step(ACK_DELAY_MAX);
    assert!(n.tx.peers[1].ctrl.is_empty(), "acknowledged when due");
}

/// Rail 1 is slow during the first message (its receiver was busy), then as fast as rail 0: its
/// share over the last messages, and its estimate.
fn slow_then_fast(cfg: StripeConfig) -> (f64, f64) {
    let mut n = Net::new(&[1e9, 1e9], cfg);
    n.rate[1] = 5e7;
    let data = n.send_message(4 * MIB);
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    let low = n.tx.stats(1)[1].unwrap();
    assert!(low.measured && low.bandwidth < 2e8, "measured slow: {low:?}");
    n.rate[1] = 1e9;
    for _ in 0..12 {
        let data = n.send_message(4 * MIB);
        n.run_until_whole(100_000);
        assert_eq!(n.dest, data);
    }
    let before = n.carried();
    for _ in 0..4 {
        let data = n.send_message(4 * MIB);
        n.run_until_whole(100_000);
        assert_eq!(n.dest, data);
    }
    let after = n.carried();
    let (c0, c1) = ((after[0] - before[0]) as f64, (after[1] - before[1]) as f64);
    (c1 / (c0 + c1), n.tx.stats(1)[1].unwrap().bandwidth)
}

#[test]
fn a_rail_measured_slow_once_regains_its_share_when_it_is_fast() {
    let (share, estimate) = slow_then_fast(cfg());
    assert!((0.35..0.65).contains(&share), "rail 1's share {share:.3}");
    assert!(estimate > 5e8, "rail 1's estimate {estimate:.3e}");
    // Without re-probing it would starve: the reason for it.
    let never = StripeConfig { reprobe: Duration::MAX, reprobe_messages: u32::MAX, ..cfg() };
    let (share, estimate) = slow_then_fast(never);
    assert!(share < 0.1 && estimate < 2e8, "without re-probing: share {share:.3}, estimate {estimate:.3e}");
}

#[test]
fn an_idle_peer_does_not_make_estimates_stale() {
    let mut n = Net::new(&[2e9, 1e9], cfg());
    let data = n.send_message(8 * MIB);
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    n.step(Duration::from_secs(1));
    let p = &n.tx.peers[1];
    let newest = p.rails.iter().flatten().map(|r| r.sampled_at).max().unwrap();
    assert!(p.rails.iter().flatten().all(|r| !r.stale(&n.tx.cfg, newest)));
}

#[test]
fn marks_and_acknowledgements_carry_the_senders_rank() {
    let now = Instant::now();
    let mut s = Stripe::new(7, cfg(), &[vec![true, true]], now);
    s.send(0, Header { src: 7, ..Header::new(Kind::Rts) }, Bytes::new(), now);
    assert!(!s.rail_lost(0, 0, now));
    let sent: Vec<_> = std::iter::from_fn(|| s.poll_transmit()).collect();
    let kinds: Vec<_> = sent.iter().map(|(rail, _, h, _)| (*rail, h.kind, h.tag, h.src)).collect();
    assert_eq!(kinds, [(0, Kind::Rts, 0, 7), (1, Kind::Credit, MARK, 7), (1, Kind::Rts, 0, 7)]);
    assert_eq!(s.control(0, 1, now), Err(WireError::Link("control frame on a rail before its mark")));
    let mark = Header { flags: flags::RAIL_ACK, tag: MARK, ..Header::new(Kind::Credit) };
    s.on_rail_frame(0, 1, &mark, now);
    assert_eq!(s.control(0, 1, now), Ok(true));
    s.handle_timeout(now + ACK_DELAY_MAX);
    let (rail, peer, ack) = s.poll_ack().expect("an acknowledgement");
    assert_eq!((rail, peer, ack.src, ack.tag, ack.seq), (1, 0, 7, ACK_CONTROL, 1));
}

#[test]
fn unacknowledged_control_frames_are_bounded_by_the_window_with_one_rail_left() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.kill(1);
    // The receiver reads nothing: the sender keeps and sends a window of frames, and the rest
    // wait unsent (in memory the engine's credits bound, not on the wire nor kept for replay).
    n.paused = true;
    let (w, total) = (cfg().control_window, 1000);
    for i in 0..total as u64 {
        n.send_control(Kind::Eager, i, b"e");
    }
    for _ in 0..2000 {
        n.step(Duration::from_micros(100));
    }
    let p = &n.tx.peers[1];
    assert_eq!((p.ctrl.len(), p.ctrl_wait.len()), (w, total - w));
    assert_eq!(n.wire[0].len(), w, "frames on the wire");
    assert!(n.tx.has_queued() && n.tx.unacknowledged());
    assert_eq!(n.tx.poll_cut(), None);
    // It reads again: acknowledgements open the window, every frame arrives once, in order.
    n.paused = false;
    n.run_until_controls(total, 100_000);
    assert_eq!(n.seqs(), (0..total as u64).collect::<Vec<_>>());
    assert_eq!(n.copies, 0);
    assert!(!n.tx.has_queued() && !n.tx.unacknowledged());
}

#[test]
fn the_control_window_counts_bytes_and_lets_a_larger_frame_go_alone() {
    static LARGE: [u8; 40 * 1024] = [7; 40 * 1024];
    static HUGE: [u8; 100 * 1024] = [9; 100 * 1024];
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.kill(1);
    n.send_control(Kind::Eager, 0, &LARGE);
    n.send_control(Kind::Eager, 1, &LARGE);
    n.send_control(Kind::Eager, 2, &HUGE);
    n.send_control(Kind::Eager, 3, b"small");
    // 40 KiB + 40 KiB exceed the 64 KiB window: one at a time; the 100 KiB frame goes alone.
    let p = &n.tx.peers[1];
    assert_eq!((p.ctrl.len(), p.ctrl_bytes, p.ctrl_wait.len()), (1, LARGE.len(), 3));
    let mut most = 0;
    for _ in 0..1000 {
        most = most.max(n.tx.peers[1].ctrl_bytes.min(HUGE.len()));
        let p = &n.tx.peers[1];
        assert!(p.ctrl.len() == 1 || p.ctrl_bytes <= cfg().control_window_bytes, "{} bytes kept", p.ctrl_bytes);
        n.step(Duration::from_micros(100));
    }
    assert_eq!(n.seqs(), [0, 1, 2, 3]);
    assert_eq!(&n.control[2].1[..], &HUGE[..]);
    assert!(n.tx.peers[1].ctrl.is_empty() && !n.tx.has_queued());
    assert_eq!(most, HUGE.len());
}

#[test]
fn control_frames_waiting_for_the_window_follow_the_replay_when_the_control_rail_fails() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    let (w, total) = (cfg().control_window, 150);
    for i in 0..total as u64 {
        n.send_control(Kind::Eager, i, b"e");
    }
    assert_eq!(n.tx.peers[1].ctrl_wait.len(), total - w);
    n.kill(0);
    assert_eq!(n.tx.replayed(1), w as u64);
    n.run_until_controls(total, 100_000);
    assert_eq!(n.seqs(), (0..total as u64).collect::<Vec<_>>());
    assert_eq!(n.copies, 0);
}

#[test]
fn a_receiver_that_reads_nothing_for_a_while_loses_no_rail() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.send_control(Kind::Rts, 1, b"");
    let data = n.send_message(4 * MIB);
    for _ in 0..5 {
        n.step(Duration::from_micros(100));
    }
    n.send_control(Kind::Eager, 2, b"x");
    // Paused for ten stall times, parts and a control frame unacknowledged on both rails.
    n.paused = true;
    for _ in 0..5000 {
        n.step(Duration::from_micros(100));
    }
    assert_eq!(n.tx.poll_cut(), None);
    assert!(n.all_up(), "{:?}", n.tx.stats(1));
    assert!(n.probes_on_the_wire() <= 2, "one probe per rail at most: {}", n.probes_on_the_wire());
    n.paused = false;
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    assert_eq!(n.seqs(), [1, 2]);
    assert_eq!((n.tx.poll_cut(), n.tx.moved(1)), (None, 0));
    assert!(n.all_up());
    // Paused again, now between messages, then a message while paused: still no rail lost.
    n.paused = true;
    let data = n.send_message(2 * MIB);
    for _ in 0..5000 {
        n.step(Duration::from_micros(100));
    }
    n.paused = false;
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    assert_eq!(n.tx.poll_cut(), None);
    assert!(n.all_up());
}

#[test]
fn a_receiver_that_reads_in_bursts_loses_no_rail() {
    // Parts take several bursts on either rail: each rail's acknowledgements come in bursts
    // stall times apart, sometimes one rail's a burst after the other's.
    let mut n = Net::new(&[3e8, 2e8], cfg());
    let data = n.send_message(2 * MIB);
    let mut bursts = 0;
    while n.delivered < data.len() && bursts < 1000 {
        n.paused = true;
        for _ in 0..1500 {
            n.step(Duration::from_micros(100));
        }
        n.paused = false;
        n.step(Duration::from_micros(100));
        bursts += 1;
    }
    n.run_until_whole(100_000);
    assert_eq!(n.dest, data);
    assert_eq!(n.tx.poll_cut(), None);
    assert!(n.all_up(), "{:?}", n.tx.stats(1));
}

#[test]
fn a_silent_control_rail_is_dropped_when_a_probe_shows_the_peer_alive() {
    // Only control frames, on rail 0, whose link went silent; rail 1 carries nothing but the
    // probes, whose answers show that the peer reads.
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.rate[0] = 0.0;
    n.send_control(Kind::Rts, 1, b"");
    n.send_control(Kind::Eager, 2, b"x");
    n.run_until_controls(2, 100_000);
    assert_eq!(n.seqs(), [1, 2]);
    assert_eq!(n.tx.poll_cut(), Some((0, 1)));
    let s = n.tx.stats(1);
    assert!(!s[0].unwrap().up && s[1].unwrap().control);
    // The same with a receiver that reads nothing: no rail is dropped.
    let mut n = Net::new(&[1e9, 1e9], cfg());
    n.paused = true;
    n.send_control(Kind::Rts, 1, b"");
    for _ in 0..5000 {
        n.step(Duration::from_micros(100));
    }
    assert_eq!(n.tx.poll_cut(), None);
    assert!(n.all_up());
}

#[test]
fn zero_length_data_frames_are_delivered_once() {
    let mut n = Net::new(&[1e9, 1e9], cfg());
    // A data frame of no bytes: one part of no bytes, delivered and acknowledged.
    let h = Header { seq: 5, ..Header::new(Kind::Data) };
    assert!(n.tx.takes(1, &h));
    n.tx.send(1, h, Bytes::new(), n.now);
    let sent: Vec<_> = std::iter::from_fn(|| n.tx.poll_transmit()).collect();
    assert_eq!(sent.len(), 1);
    let (rail, _, part, payload) = sent[0].clone();
    assert_eq!((part.len, part.aux, part.flags & flags::RAIL_PART, payload.len()), (0, 0, flags::RAIL_PART, 0));
    n.wire[rail].push_back((part, payload));
    n.step(Duration::from_micros(100));
    assert_eq!(n.rx.peers[0].low, 1, "delivered");
    assert!(!n.tx.busy(), "acknowledged");
}
