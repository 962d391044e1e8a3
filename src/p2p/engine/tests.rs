//! Deterministic tests of the protocol core: engines wired together by an in-memory network.

use super::*;
use proptest::prelude::*;

const EAGER: usize = 64;

fn cfg(max_credit: u32) -> Config {
    Config { eager_limit: EAGER, max_credit, credit_sync: max_credit.div_ceil(2), chunk: 100, max_message: 1 << 20 }
}

/// Frames in flight between engines, in order per (from, to) link.
struct Net {
    engines: Vec<Engine>,
    links: HashMap<(Rank, Rank), VecDeque<(Header, Bytes)>>,
    done: HashMap<(Rank, OpKey), Completion>,
    /// Rank 0's matching-relevant history: posted receives and arrivals of messages.
    log: Vec<Event>,
    sent_count: HashMap<Rank, u64>,
    /// Every other non-`Data` frame is lent (`handle_frame_ref`, as from a shared-memory ring).
    lend: bool,
    /// Data frames delivered per link, and how many of them were dropped by their receiver.
    data_frames: HashMap<(Rank, Rank), (usize, usize)>,
}

#[derive(Clone, Debug)]
enum Event {
    Post { op: OpKey, src: Source, tag: TagMatch },
    Arrive { src: Rank, tag: u64, index: u64 },
}

impl Net {
    fn new(n: u32, c: Config) -> Net {
        Net {
            engines: (0..n).map(|r| Engine::new(r, n, c)).collect(),
            links: HashMap::new(),
            done: HashMap::new(),
            log: Vec::new(),
            sent_count: HashMap::new(),
            lend: false,
            data_frames: HashMap::new(),
        }
    }

    /// The same, with rendezvous data pushed behind its RTS between every pair (as over TCP).
    fn pushing(n: u32, c: Config) -> Net {
        let mut net = Net::new(n, c);
        for e in &mut net.engines {
            for peer in 0..n {
                e.set_push(peer, true);
            }
        }
        net
    }

    /// Delivers every frame now on link `(from, to)`, and none on any other.
    fn drain(&mut self, from: Rank, to: Rank) {
        while self.deliver_one(from, to) {}
    }

    fn pump(&mut self) {
        for r in 0..self.engines.len() as Rank {
            while let Some((to, h, p)) = self.engines[r as usize].poll_transmit() {
                self.links.entry((r, to)).or_default().push_back((h, p));
            }
            while let Some((op, c)) = self.engines[r as usize].poll_event() {
                assert!(self.done.insert((r, op), c).is_none(), "op completed twice");
            }
            assert!(self.engines[r as usize].poll_violation().is_none());
        }
    }

    /// Delivers one frame on link `(from, to)`; false if the link is empty.
    fn deliver_one(&mut self, from: Rank, to: Rank) -> bool {
        self.pump();
        let Some((h, p)) = self.links.get_mut(&(from, to)).and_then(|l| l.pop_front()) else { return false };
        let e = &mut self.engines[to as usize];
        if h.kind == Kind::Data {
            let dest = e.data_dest(from, &h).expect("data for a known receive");
            let count = self.data_frames.entry((from, to)).or_default();
            count.0 += 1;
            match dest {
                Some(d) => d.copy_from_slice(&p),
                None => count.1 += 1,
            }
            e.handle_frame(from, h, Bytes::new());
        } else {
            if to == 0 && matches!(h.kind, Kind::Eager | Kind::Rts) {
                let c = self.sent_count.entry(from).or_default();
                self.log.push(Event::Arrive { src: from, tag: h.tag, index: *c });
                *c += 1;
            }
            self.lend = !self.lend;
            if self.lend {
                e.handle_frame_ref(from, h, &p);
            } else {
                e.handle_frame(from, h, p);
            }
        }
        self.pump();
        true
    }

    fn run(&mut self) {
        loop {
            self.pump();
            let keys: Vec<_> = self.links.iter().filter(|(_, l)| !l.is_empty()).map(|(k, _)| *k).collect();
            if keys.is_empty() {
                return;
            }
            for (f, t) in keys {
                self.deliver_one(f, t);
            }
        }
    }

    fn recv(&mut self, at: Rank, op: OpKey, src: Source, tag: TagMatch, buf: RecvBuf) {
        if at == 0 {
            self.log.push(Event::Post { op, src, tag });
        }
        self.engines[at as usize].post_recv(op, 0, src, tag, buf);
        self.pump();
    }

    fn send(&mut self, from: Rank, op: OpKey, to: Rank, tag: u64, data: Bytes) {
        self.engines[from as usize].post_send(op, to, 0, tag, data);
        self.pump();
    }

    fn take(&mut self, at: Rank, op: OpKey) -> Option<Completion> {
        self.done.remove(&(at, op))
    }

    fn received(&mut self, at: Rank, op: OpKey) -> (Bytes, Status) {
        match self.take(at, op) {
            Some(Completion::Recv(Ok((p, s)))) => (p.into_bytes(), s),
            other => panic!("receive {op} at {at}: {other:?}"),
        }
    }
}

fn data(len: usize, seed: u8) -> Bytes {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<u8>>().into()
}

#[test]
fn eager_and_rendezvous_in_every_order() {
    for len in [0, 1, EAGER, EAGER + 1, 1000] {
        // receive first
        let mut net = Net::new(2, cfg(8));
        net.recv(1, 1, Source::Rank(0), TagMatch::Exact(5), RecvBuf::Alloc);
        net.send(0, 1, 1, 5, data(len, 1));
        net.run();
        let (b, s) = net.received(1, 1);
        assert_eq!((b, s), (data(len, 1), Status { source: 0, tag: 5, len }));
        assert!(matches!(net.take(0, 1), Some(Completion::Send(Ok(())))));
        // send first
        let mut net = Net::new(2, cfg(8));
        net.send(0, 1, 1, 5, data(len, 2));
        net.run();
        net.recv(1, 1, Source::Any, TagMatch::Any, RecvBuf::User(BytesMut::zeroed(2000)));
        net.run();
        assert_eq!(net.received(1, 1).0, data(len, 2));
        // both in flight at once
        let mut net = Net::new(2, cfg(8));
        net.send(0, 1, 1, 5, data(len, 3));
        net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
        net.run();
        assert_eq!(net.received(1, 1).0, data(len, 3));
    }
}

#[test]
fn message_to_self() {
    let mut net = Net::new(1, cfg(8));
    net.send(0, 1, 0, 9, data(500, 4));
    net.recv(0, 2, Source::Rank(0), TagMatch::Exact(9), RecvBuf::Alloc);
    assert_eq!(net.received(0, 2).0, data(500, 4));
}

#[test]
fn lent_eager_frames_land_in_posted_buffers() {
    let mut e = Engine::new(1, 2, cfg(8));
    let frame = |tag: u64, len: usize| Header { src: 0, tag, len: len as u32, ..Header::new(Kind::Eager) };
    let body = data(40, 3);
    // Straight into a posted buffer, truncated to the message.
    e.post_recv(1, 0, Source::Rank(0), TagMatch::Exact(5), RecvBuf::User(BytesMut::zeroed(64)));
    e.handle_frame_ref(0, frame(5, 40), &body);
    // Too small a buffer: a truncation error, and the credit still comes back.
    e.post_recv(2, 0, Source::Any, TagMatch::Any, RecvBuf::User(BytesMut::zeroed(8)));
    e.handle_frame_ref(0, frame(6, 40), &body);
    // Nothing posted: kept (copied) until a receive comes.
    e.handle_frame_ref(0, frame(7, 40), &body);
    e.post_recv(3, 0, Source::Any, TagMatch::Any, RecvBuf::User(BytesMut::zeroed(64)));
    let mut done: HashMap<OpKey, Completion> = std::iter::from_fn(|| e.poll_event()).collect();
    for op in [1, 3] {
        match done.remove(&op) {
            Some(Completion::Recv(Ok((Payload::Owned(b), s)))) => {
                assert_eq!((&b[..], s.len, s.source), (&body[..], 40, 0), "receive {op}");
            }
            other => panic!("receive {op}: {other:?}"),
        }
    }
    assert!(matches!(done.remove(&2), Some(Completion::Recv(Err(Error::Truncated { len: 40, capacity: 8 })))));
    assert_eq!(e.unexpected_from(0), 0, "every credit freed");
}

#[test]
fn messages_on_interleaved_contexts_match_only_their_own() {
    // The context cache switches on every frame here: posted before or after the context exists,
    // lent or not, each receive gets the message of its own context.
    let mut e = Engine::new(1, 2, cfg(32));
    let frame = |context: u32| Header { src: 0, context, tag: 3, len: 1, ..Header::new(Kind::Eager) };
    let contexts = [5u32, 9, 5, 7, 9, 9, 5, 7, 11, 5];
    let mut op = 0;
    let mut want = HashMap::new();
    for (i, &c) in contexts.iter().enumerate() {
        let payload = [i as u8];
        op += 1;
        if i % 2 == 0 {
            e.post_recv(op, c, Source::Rank(0), TagMatch::Exact(3), RecvBuf::User(BytesMut::zeroed(4)));
            e.handle_frame_ref(0, frame(c), &payload);
        } else {
            e.handle_frame(0, frame(c), Bytes::copy_from_slice(&payload));
            e.post_recv(op, c, Source::Rank(0), TagMatch::Exact(3), RecvBuf::Alloc);
        }
        want.insert(op, i as u8);
    }
    // A receive on a context no message came on stays posted.
    e.post_recv(100, 6, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    let mut done: HashMap<OpKey, Completion> = std::iter::from_fn(|| e.poll_event()).collect();
    assert_eq!(done.len(), contexts.len());
    for (op, i) in want {
        match done.remove(&op) {
            Some(Completion::Recv(Ok((p, s)))) => {
                assert_eq!((&p.into_bytes()[..], s.len), (&[i][..], 1), "receive {op}")
            }
            other => panic!("receive {op}: {other:?}"),
        }
    }
    assert_eq!(e.unexpected_from(0), 0);
}

#[test]
fn truncation_is_an_error_on_both_paths() {
    for len in [10, EAGER + 10] {
        let mut net = Net::new(2, cfg(8));
        net.recv(1, 1, Source::Any, TagMatch::Any, RecvBuf::User(BytesMut::zeroed(5)));
        net.send(0, 1, 1, 0, data(len, 0));
        net.run();
        assert!(matches!(net.take(1, 1), Some(Completion::Recv(Err(Error::Truncated { capacity: 5, .. })))));
        let send = net.take(0, 1);
        if len > EAGER {
            assert!(matches!(send, Some(Completion::Send(Err(Error::RemoteTruncated { rank: 1 })))));
        } else {
            assert!(matches!(send, Some(Completion::Send(Ok(())))));
        }
        // The communicator keeps working.
        net.send(0, 2, 1, 0, data(3, 0));
        net.recv(1, 2, Source::Any, TagMatch::Any, RecvBuf::Alloc);
        net.run();
        assert_eq!(net.received(1, 2).0, data(3, 0));
    }
}

#[test]
fn cancelled_receive_lets_the_next_one_match() {
    let mut net = Net::new(2, cfg(8));
    net.recv(1, 1, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.engines[1].cancel_recv(1, 0);
    net.recv(1, 2, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.send(0, 1, 1, 0, data(10, 0));
    net.run();
    assert!(net.take(1, 1).is_none());
    assert_eq!(net.received(1, 2).0, data(10, 0));
}

#[test]
fn cancelled_rendezvous_receive_drains_and_stays_consistent() {
    let mut net = Net::new(2, cfg(8));
    net.recv(1, 1, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.send(0, 1, 1, 0, data(1000, 0));
    // RTS and CTS cross, then the receiver gives up while data is on the way.
    net.deliver_one(0, 1);
    net.deliver_one(1, 0);
    net.engines[1].cancel_recv(1, 0);
    net.run();
    assert!(net.take(1, 1).is_none());
    net.send(0, 2, 1, 0, data(1000, 9));
    net.recv(1, 2, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.run();
    assert_eq!(net.received(1, 2).0, data(1000, 9));
}

#[test]
fn cancelled_send_waiting_for_credit_is_withdrawn() {
    let mut net = Net::new(2, cfg(2));
    for op in 0..3 {
        net.send(0, op, 1, op as u64, data(8, op as u8));
    }
    assert_eq!(net.engines[0].backlog_to(1), 1);
    net.engines[0].cancel_send(2, 1);
    assert_eq!(net.engines[0].backlog_to(1), 0);
    net.run();
    for op in 0..2 {
        net.recv(1, op, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    }
    net.recv(1, 9, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.run();
    assert!(net.take(1, 9).is_none(), "the withdrawn send never arrives");
}

#[test]
fn flood_stays_within_credits() {
    let mut net = Net::new(2, cfg(4));
    for op in 0..100 {
        net.send(0, op, 1, 0, data(EAGER, op as u8));
        net.run();
        assert!(net.engines[1].unexpected_from(0) <= 4);
    }
    assert_eq!(net.engines[0].backlog_to(1), 96);
    for op in 0..100 {
        net.recv(1, op, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
        net.run();
        assert_eq!(net.received(1, op).0, data(EAGER, op as u8), "in order");
    }
    assert_eq!(net.engines[0].backlog_to(1), 0);
}

#[test]
fn sending_beyond_credit_is_a_violation() {
    let mut e = Engine::new(1, 2, cfg(2));
    for _ in 0..3 {
        e.handle_frame(0, Header { len: 1, ..Header::new(Kind::Eager) }, Bytes::from_static(b"x"));
    }
    assert!(e.poll_violation().is_some());
}

#[test]
fn stray_frames_are_violations() {
    let mut e = Engine::new(1, 2, cfg(2));
    e.handle_frame(0, Header { seq: 7, ..Header::new(Kind::Cts) }, Bytes::new());
    assert!(e.poll_violation().is_some());
    assert!(e.data_dest(0, &Header { seq: 3, len: 1, ..Header::new(Kind::Data) }).is_err());
}

#[test]
fn lost_peer_fails_everything_that_involves_it() {
    let mut net = Net::new(3, cfg(2));
    net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
    net.recv(1, 2, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.recv(1, 3, Source::Rank(2), TagMatch::Any, RecvBuf::Alloc);
    net.engines[1].post_send(4, 0, 0, 0, data(1000, 0)); // rendezvous, waits for CTS
    net.engines[1].post_probe(5, 0, Source::Rank(0), TagMatch::Any);
    net.engines[1].peer_lost(0, TransportError::Closed);
    net.pump();
    for op in [1, 2, 4, 5] {
        let c = net.take(1, op).unwrap_or_else(|| panic!("op {op} pending"));
        let failed = match c {
            Completion::Send(r) => matches!(r, Err(Error::PeerLost { rank: 0, .. })),
            Completion::Recv(r) => matches!(r, Err(Error::PeerLost { rank: 0, .. })),
            Completion::Probe(r) => matches!(r, Err(Error::PeerLost { rank: 0, .. })),
        };
        assert!(failed, "op {op}");
    }
    // Context 0 was never registered, so it watches every rank: the loss revokes it, and the
    // receive from a live rank fails too, naming the lost rank.
    assert!(matches!(net.take(1, 3), Some(Completion::Recv(Err(Error::PeerLost { rank: 0, .. })))));
    net.engines[1].post_send(6, 0, 0, 0, data(1, 0));
    net.pump();
    assert!(matches!(net.take(1, 6), Some(Completion::Send(Err(Error::PeerLost { .. })))));
}

#[test]
fn closing_fails_every_operation_in_flight() {
    let mut net = Net::new(3, cfg(1));
    net.recv(1, 1, Source::Rank(2), TagMatch::Any, RecvBuf::Alloc);
    net.recv(1, 2, Source::Any, TagMatch::Exact(9), RecvBuf::User(BytesMut::zeroed(8)));
    net.engines[1].post_send(3, 2, 0, 0, data(1000, 0)); // rendezvous, waits for CTS
    net.engines[1].post_send(4, 2, 0, 0, data(1, 0)); // no credit left: backlogged
    net.engines[1].post_probe(5, 0, Source::Rank(2), TagMatch::Any);
    // A rendezvous receive under way: rank 0 announced 1000 bytes, op 6 matched them, and the
    // CTS is still on its way.
    net.send(0, 1, 1, 7, data(1000, 1));
    assert!(net.deliver_one(0, 1));
    net.recv(1, 6, Source::Rank(0), TagMatch::Exact(7), RecvBuf::Alloc);
    net.engines[1].close();
    net.pump();
    for op in 1..=6 {
        let c = net.take(1, op).unwrap_or_else(|| panic!("op {op} pending"));
        let shut = match c {
            Completion::Send(r) => matches!(r, Err(Error::Shutdown)),
            Completion::Recv(r) => matches!(r, Err(Error::Shutdown)),
            Completion::Probe(r) => matches!(r, Err(Error::Shutdown)),
        };
        assert!(shut, "op {op}");
    }
    // The rendezvous receive keeps its buffer for data still arriving: no violation, no second
    // completion.
    net.run();
    assert!(net.take(1, 6).is_none());
    // Posted after the close (a call racing the shutdown): fails at once.
    net.recv(1, 7, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.send(1, 8, 0, 0, data(1000, 0));
    net.engines[1].post_probe(9, 0, Source::Any, TagMatch::Any);
    net.pump();
    assert!(matches!(net.take(1, 7), Some(Completion::Recv(Err(Error::Shutdown)))));
    assert!(matches!(net.take(1, 8), Some(Completion::Send(Err(Error::Shutdown)))));
    assert!(matches!(net.take(1, 9), Some(Completion::Probe(Err(Error::Shutdown)))));
}

#[test]
fn probe_sees_the_first_match_and_waits_for_one() {
    let mut net = Net::new(2, cfg(8));
    net.engines[1].post_probe(1, 0, Source::Any, TagMatch::Exact(3));
    net.send(0, 1, 1, 2, data(5, 0));
    net.send(0, 2, 1, 3, data(500, 0));
    net.run();
    assert!(matches!(net.take(1, 1), Some(Completion::Probe(Ok(Status { source: 0, tag: 3, len: 500 })))));
    assert_eq!(net.engines[1].iprobe(0, Source::Any, TagMatch::Any).unwrap().tag, 2);
}

/// The reference model of MPI matching: given rank 0's history (posts and arrivals in the order
/// the engine saw them), which message does each receive get?
fn reference(log: &[Event]) -> HashMap<OpKey, (Rank, u64)> {
    let mut posted: Vec<(OpKey, Source, TagMatch)> = Vec::new();
    let mut unexpected: Vec<(Rank, u64, u64)> = Vec::new();
    let mut out = HashMap::new();
    for e in log {
        match *e {
            Event::Post { op, src, tag } => match unexpected.iter().position(|&(s, t, _)| matches(src, tag, s, t)) {
                Some(i) => {
                    let (s, _, idx) = unexpected.remove(i);
                    out.insert(op, (s, idx));
                }
                None => posted.push((op, src, tag)),
            },
            Event::Arrive { src, tag, index } => {
                match posted.iter().position(|&(_, ps, pt)| matches(ps, pt, src, tag)) {
                    Some(i) => {
                        let (op, ..) = posted.remove(i);
                        out.insert(op, (src, index));
                    }
                    None => unexpected.push((src, tag, index)),
                }
            }
        }
    }
    out
}

#[derive(Clone, Debug)]
enum Step {
    Send { from: Rank, tag: u64, big: bool },
    Recv { src: Option<Rank>, tag: Option<u64>, into: bool },
    Deliver { from: Rank, to: Rank },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (1u32..4, 0u64..3, any::<bool>()).prop_map(|(from, tag, big)| Step::Send { from, tag, big }),
        (prop::option::of(1u32..4), prop::option::of(0u64..3), any::<bool>()).prop_map(|(src, tag, into)| Step::Recv {
            src,
            tag,
            into
        }),
        (0u32..4, 0u32..4).prop_map(|(from, to)| Step::Deliver { from, to }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Random interleavings of sends (eager and rendezvous) from three ranks, receives with and
    /// without wildcards at rank 0 (into a buffer or not), and frame deliveries (given or lent): every receive gets exactly the message
    /// the reference model says, messages from one sender are never overtaken, and nothing is lost.
    #[test]
    fn matching_agrees_with_the_reference(steps in prop::collection::vec(step(), 1..120), credit in 1u32..6, push: bool) {
        let mut net = if push { Net::pushing(4, cfg(credit)) } else { Net::new(4, cfg(credit)) };
        let mut next_op = 0;
        let mut counts = [0u64; 4];
        let mut recvs = Vec::new();
        for s in steps {
            match s {
                Step::Send { from, tag, big } => {
                    let idx = counts[from as usize];
                    counts[from as usize] += 1;
                    let mut body = vec![0u8; if big { EAGER * 3 } else { 16 }];
                    body[..4].copy_from_slice(&from.to_le_bytes());
                    body[4..12].copy_from_slice(&idx.to_le_bytes());
                    net.send(from, next_op, 0, tag, body.into());
                    next_op += 1;
                }
                Step::Recv { src, tag, into } => {
                    let src = src.map_or(Source::Any, Source::Rank);
                    let tag = tag.map_or(TagMatch::Any, TagMatch::Exact);
                    // Into a buffer of the largest size sent, or allocated by the engine.
                    let buf = if into { RecvBuf::User(BytesMut::zeroed(EAGER * 3)) } else { RecvBuf::Alloc };
                    net.recv(0, next_op, src, tag, buf);
                    recvs.push(next_op);
                    next_op += 1;
                }
                Step::Deliver { from, to } => {
                    net.deliver_one(from, to);
                }
            }
        }
        net.run();
        // Drain: wildcard receives until every message is matched.
        let total: u64 = counts.iter().sum();
        for _ in 0..=total {
            let completed = recvs.iter().filter(|op| net.done.contains_key(&(0, **op))).count() as u64;
            if completed >= total {
                break;
            }
            net.recv(0, next_op, Source::Any, TagMatch::Any, RecvBuf::Alloc);
            recvs.push(next_op);
            next_op += 1;
            net.run();
        }
        let expected = reference(&net.log);
        let mut got = Vec::new();
        for op in recvs {
            match (net.done.remove(&(0, op)), expected.get(&op)) {
                (Some(Completion::Recv(Ok((p, _)))), Some(&(src, idx))) => {
                    let b = p.into_bytes();
                    let from = u32::from_le_bytes(b[..4].try_into().unwrap());
                    let i = u64::from_le_bytes(b[4..12].try_into().unwrap());
                    prop_assert_eq!((from, i), (src, idx), "receive {}", op);
                    got.push((from, i));
                }
                (None, None) => {}
                (c, e) => prop_assert!(false, "receive {}: engine {:?}, reference {:?}", op, c, e),
            }
        }
        got.sort();
        got.dedup();
        prop_assert_eq!(got.len() as u64, total, "every message delivered exactly once");
    }
}

/// A rendezvous announced (RTS) before its sender left or died, and matched only afterwards, fails
/// with the loss instead of waiting forever for data that cannot come (seen as a rank hanging in an
/// all-reduce after its peers failed and left, in `killed_rank_fails_the_collective`).
#[test]
fn rendezvous_announced_before_the_sender_was_lost_fails_when_matched() {
    for reason in [TransportError::Left, TransportError::Closed] {
        let mut net = Net::new(2, cfg(2));
        net.send(0, 1, 1, 7, data(1000, 3)); // rendezvous: the RTS reaches rank 1 unexpected
        assert!(net.deliver_one(0, 1), "the RTS");
        net.engines[1].peer_lost(0, reason.clone());
        net.recv(1, 2, Source::Rank(0), TagMatch::Exact(7), RecvBuf::Alloc);
        net.recv(1, 3, Source::Any, TagMatch::Any, RecvBuf::Alloc);
        assert!(matches!(net.take(1, 2), Some(Completion::Recv(Err(Error::PeerLost { rank: 0, .. })))), "{reason}");
        // After a goodbye, nothing else was announced; after a loss, the context is revoked.
        match reason {
            TransportError::Left => assert!(net.take(1, 3).is_none()),
            _ => assert!(matches!(net.take(1, 3), Some(Completion::Recv(Err(Error::PeerLost { rank: 0, .. }))))),
        }
    }
}

#[test]
fn orderly_goodbye_fails_only_what_names_the_peer() {
    let mut net = Net::new(3, cfg(2));
    net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
    net.recv(1, 2, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.engines[1].handle_frame(0, Header::new(Kind::Bye), Bytes::new());
    net.pump();
    assert!(matches!(net.take(1, 1), Some(Completion::Recv(Err(Error::PeerLost { rank: 0, .. })))));
    assert!(net.take(1, 2).is_none(), "the wildcard receive still waits for rank 2");
    net.send(2, 1, 1, 0, data(3, 0));
    net.run();
    assert_eq!(net.received(1, 2).0, data(3, 0));
}

#[test]
fn metrics_count_messages_by_peer_and_protocol_both_ways() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let counts = metrics::with_local_recorder(&recorder, || {
        let mut net = Net::new(3, cfg(2));
        for op in 0..5 {
            net.send(0, op, 1, 0, data(8, 0));
        }
        net.send(0, 9, 1, 1, data(EAGER + 1, 0));
        net.send(0, 10, 2, 0, data(3, 0));
        for op in 0..6 {
            net.recv(1, op, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
        }
        net.recv(2, 0, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
        net.run();
        [net.engines[0].traffic(1), net.engines[1].traffic(0), net.engines[0].traffic(2), net.engines[1].traffic(2)]
    });
    let sent = PeerCounts {
        messages_sent: 6,
        bytes_sent: 5 * 8 + EAGER as u64 + 1,
        rendezvous_sent: 1,
        ..PeerCounts::default()
    };
    let received = PeerCounts {
        messages_received: 6,
        bytes_received: sent.bytes_sent,
        rendezvous_received: 1,
        ..PeerCounts::default()
    };
    assert_eq!(
        counts,
        [
            sent,
            received,
            PeerCounts { messages_sent: 1, bytes_sent: 3, ..PeerCounts::default() },
            PeerCounts::default()
        ]
    );
    let mut counters: HashMap<String, u64> = HashMap::new();
    for (key, _, _, v) in snapshotter.snapshot().into_vec() {
        let DebugValue::Counter(c) = v else { continue };
        let mut labels: Vec<String> = key.key().labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        labels.sort();
        *counters.entry(format!("{}{{{}}}", key.key().name(), labels.join(","))).or_default() += c;
    }
    // Every engine's meters are in one recorder: rank 0's send to peer 1 and rank 1's receive
    // from peer 0 carry different labels.
    assert_eq!(counters["ferrocomm_messages_sent{peer=1,protocol=eager}"], 5);
    assert_eq!(counters["ferrocomm_messages_sent{peer=1,protocol=rendezvous}"], 1);
    assert_eq!(counters["ferrocomm_bytes_sent{peer=1,protocol=eager}"], 5 * 8);
    assert_eq!(counters["ferrocomm_bytes_sent{peer=1,protocol=rendezvous}"], EAGER as u64 + 1);
    assert_eq!(counters["ferrocomm_messages_sent{peer=2,protocol=eager}"], 1);
    assert_eq!(counters["ferrocomm_messages_received{peer=0,protocol=eager}"], 5 + 1, "at ranks 1 and 2");
    assert_eq!(counters["ferrocomm_bytes_received{peer=0,protocol=eager}"], 5 * 8 + 3);
    assert_eq!(counters["ferrocomm_messages_received{peer=0,protocol=rendezvous}"], 1);
    assert_eq!(counters["ferrocomm_bytes_received{peer=0,protocol=rendezvous}"], EAGER as u64 + 1);
    assert_eq!(counters["ferrocomm_credit_stalls{}"], 4, "3 eager messages and the RTS wait for credit");
    // A peer's metrics are registered together at its first message either way: a series can
    // be there at zero.
    assert_eq!(counters.get("ferrocomm_messages_sent{peer=0,protocol=eager}"), Some(&0), "{counters:?}");
    let from_2: u64 =
        counters.iter().filter(|(k, _)| k.contains("peer=2") && k.contains("received")).map(|(_, v)| v).sum();
    assert_eq!(from_2, 0, "rank 2 sent nothing: {counters:?}");
}

/// A recorder that counts how often the engine registers a metric: once per metric and engine,
/// never per message (a registration is a lookup in the recorder's registry).
#[test]
fn metrics_are_registered_once_not_per_message() {
    use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};
    use std::sync::atomic::{AtomicUsize, Ordering};
    #[derive(Default)]
    struct Registrations(AtomicUsize);
    impl metrics::Recorder for Registrations {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            self.0.fetch_add(1, Ordering::Relaxed);
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            self.0.fetch_add(1, Ordering::Relaxed);
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            self.0.fetch_add(1, Ordering::Relaxed);
            Histogram::noop()
        }
    }
    let recorder = Registrations::default();
    let made = metrics::with_local_recorder(&recorder, || {
        let mut net = Net::new(2, cfg(2));
        let mut made = recorder.0.load(Ordering::Relaxed);
        for op in 0..100 {
            if op == 1 {
                // The per-peer metrics are registered at the first message with each peer.
                made = recorder.0.load(Ordering::Relaxed);
            }
            // Eager, rendezvous, unexpected and credit-stalled messages all count something.
            let len = if op % 10 == 0 { EAGER + 1 } else { 8 };
            net.send(0, op, 1, 0, data(len, 0));
            net.send(0, 1000 + op, 1, 0, data(8, 1));
            net.recv(1, op, Source::Rank(0), TagMatch::Exact(0), RecvBuf::Alloc);
            net.recv(1, 1000 + op, Source::Rank(0), TagMatch::Exact(0), RecvBuf::Alloc);
            net.run();
        }
        made
    });
    assert!(made > 0, "the engines register their metrics when made");
    assert_eq!(recorder.0.load(Ordering::Relaxed), made, "registered again after the engines were made");
}

#[test]
fn immediate_sends_and_receives_need_no_operation() {
    let mut net = Net::new(2, cfg(2));
    // Eager with credit: done at once, the frame queued; out of credit: the data comes back.
    for i in 0..2 {
        assert!(matches!(net.engines[0].send_now(1, 0, 9, data(8, i)), Ok(Ok(()))));
    }
    let back = net.engines[0].send_now(1, 0, 9, data(8, 2)).expect_err("out of credit");
    assert_eq!(back, data(8, 2));
    // Rendezvous needs an operation: the data comes back.
    assert!(net.engines[0].send_now(1, 0, 9, data(EAGER + 1, 3)).is_err());
    net.run();
    // An eager message already here completes a receive at once, into the caller's buffer...
    let got = net.engines[1].recv_now(0, Source::Rank(0), TagMatch::Exact(9), RecvBuf::User(BytesMut::zeroed(16)));
    let Ok(Ok((p, s))) = got else { panic!("{got:?}") };
    assert_eq!((p.into_bytes(), s.len), (data(8, 0), 8));
    // ... or too small a buffer fails it, the message consumed as post_recv would.
    let got = net.engines[1].recv_now(0, Source::Any, TagMatch::Any, RecvBuf::User(BytesMut::zeroed(4)));
    assert!(matches!(got, Ok(Err(Error::Truncated { len: 8, capacity: 4 }))), "{got:?}");
    // Nothing matching here: the buffer comes back.
    assert!(net.engines[1].recv_now(0, Source::Rank(0), TagMatch::Exact(9), RecvBuf::Alloc).is_err());
    // A rendezvous announcement waits for post_recv (which answers with a CTS).
    net.send(0, 7, 1, 4, data(EAGER + 1, 4));
    net.run();
    assert!(net.engines[1].recv_now(0, Source::Any, TagMatch::Exact(4), RecvBuf::Alloc).is_err());
    net.recv(1, 8, Source::Any, TagMatch::Exact(4), RecvBuf::Alloc);
    net.run();
    assert_eq!(net.received(1, 8).0, data(EAGER + 1, 4));
    // A lost peer: the send fails at once.
    net.engines[0].peer_lost(1, TransportError::Left);
    assert!(matches!(net.engines[0].send_now(1, 0, 9, data(8, 5)), Ok(Err(Error::PeerLost { rank: 1, .. }))));
}

#[test]
fn frames_that_can_go_at_once_skip_the_transmit_queue() {
    let mut net = Net::new(2, cfg(4));
    let mut wire = Vec::new();
    // Nothing waiting: the eager frame goes to the driver's wire at once, stamped with our rank;
    // borrowed data is copied only where it must be kept.
    let payload = data(8, 1);
    let r = net.engines[0].send_now_via(1, 0, 9, &payload[..], |to, h, p: &[u8]| wire.push((to, h, p.to_vec())));
    assert!(matches!(r, Ok(Ok(()))));
    assert_eq!(wire.len(), 1);
    let (to, h, p) = &wire[0];
    assert_eq!((*to, h.kind, h.src, h.tag, h.len, &p[..]), (1, Kind::Eager, 0, 9, 8, &payload[..]));
    assert!(!net.engines[0].has_output());
    // Output already waiting (a credit frame, say): the frame queues behind it, in order.
    net.engines[0].emit(1, Header::new(Kind::Credit), Bytes::new());
    let r = net.engines[0].send_now_via(1, 0, 9, data(8, 2), |_, _, _| panic!("jumped the queue"));
    assert!(matches!(r, Ok(Ok(()))));
    let queued: Vec<_> = std::iter::from_fn(|| net.engines[0].poll_transmit()).map(|(_, h, p)| (h.kind, p)).collect();
    assert_eq!(queued, [(Kind::Credit, Bytes::new()), (Kind::Eager, data(8, 2))]);
    // To ourselves, borrowed: delivered as a copy, no wire.
    let r = net.engines[0].send_now_via(0, 0, 3, &payload[..], |_, _, _| panic!("no wire to ourselves"));
    assert!(matches!(r, Ok(Ok(()))));
    let got = net.engines[0].recv_now(0, Source::Rank(0), TagMatch::Exact(3), RecvBuf::Alloc);
    let Ok(Ok((p, _))) = got else { panic!("{got:?}") };
    assert_eq!(p.into_bytes(), payload);
    // Rendezvous, or out of credit: the borrowed data comes back for the caller to keep.
    let big = data(EAGER + 1, 3);
    assert_eq!(net.engines[0].send_now_via(1, 0, 9, &big[..], |_, _, _| panic!()).unwrap_err(), &big[..]);
    let mut sent = 2; // two credit-consuming frames so far, of 4
    while net.engines[0].send_now_via(1, 0, 9, &payload[..], |_, _, _| ()).is_ok() {
        sent += 1;
        assert!(sent <= 4, "sent beyond the credit");
    }
    assert_eq!(sent, 4);
    let back = net.engines[0].send_now_via(1, 0, 9, &payload[..], |_, _, _| panic!("no credit"));
    assert_eq!(back.unwrap_err(), &payload[..]);
}

// ---- failure knowledge: revocation and its spreading ----

use crate::p2p::failure::{Fate, Watch};

impl Net {
    /// Registers `context`'s watch at every engine.
    fn watch(&mut self, context: u32, w: Watch) {
        for e in &mut self.engines {
            e.watch(context, w.clone());
        }
    }

    fn recv_on(&mut self, at: Rank, op: OpKey, context: u32, src: Source) {
        self.engines[at as usize].post_recv(op, context, src, TagMatch::Any, RecvBuf::Alloc);
        self.pump();
    }

    fn send_on(&mut self, from: Rank, op: OpKey, context: u32, to: Rank, data: Bytes) {
        self.engines[from as usize].post_send(op, to, context, 0, data);
        self.pump();
    }

    /// The `Lost` frames waiting on the links.
    fn notices(&self) -> usize {
        self.links.values().flatten().filter(|(h, _)| h.kind == Kind::Lost).count()
    }
}

fn lost_naming(c: Option<Completion>, rank: Rank) -> bool {
    let e = match c {
        Some(Completion::Send(Err(e))) | Some(Completion::Recv(Err(e))) | Some(Completion::Probe(Err(e))) => e,
        _ => return false,
    };
    matches!(e, Error::PeerLost { rank: r, .. } if r == rank)
}

/// A loss revokes the contexts whose watch holds the lost rank: every operation there fails, also
/// between two survivors, naming the lost rank; a context without it goes on.
#[test]
fn a_loss_revokes_only_the_contexts_that_watch_it() {
    let mut net = Net::new(3, cfg(4));
    net.watch(1, Watch::All);
    net.watch(2, Watch::ranks([1, 2]));
    net.recv_on(1, 1, 1, Source::Rank(2));
    net.recv_on(1, 2, 2, Source::Rank(2));
    net.engines[1].post_probe(3, 1, Source::Any, TagMatch::Any);
    net.send_on(1, 4, 1, 2, data(EAGER + 1, 0)); // rendezvous to a survivor: waits for its CTS
    net.engines[1].peer_lost(0, TransportError::Closed);
    net.pump();
    for op in [1, 3, 4] {
        assert!(lost_naming(net.take(1, op), 0), "op {op}");
    }
    assert!(net.take(1, 2).is_none(), "the communicator without rank 0 goes on");
    // Later operations on the revoked context fail at once, whatever they name.
    assert!(matches!(net.engines[1].send_now(2, 1, 0, data(8, 0)), Ok(Err(Error::PeerLost { rank: 0, .. }))));
    let now = net.engines[1].recv_now(1, Source::Rank(2), TagMatch::Any, RecvBuf::Alloc);
    assert!(matches!(now, Ok(Err(Error::PeerLost { rank: 0, .. }))), "{now:?}");
    net.recv_on(1, 5, 1, Source::Rank(2));
    assert!(lost_naming(net.take(1, 5), 0));
    // Rank 2 hears of it and revokes the same context; the other one still carries messages.
    net.run();
    assert!(matches!(net.engines[2].failures().fate(0), Fate::Lost(TransportError::Reported { by: 1 })));
    net.send_on(2, 1, 2, 1, data(8, 7));
    net.send_on(2, 2, 1, 1, data(8, 8));
    net.run();
    assert_eq!(net.received(1, 2).0, data(8, 7));
    assert!(lost_naming(net.take(2, 2), 0));
    // The rendezvous rank 1 gave up on was answered in order (no violation: `pump` checks).
    assert!(net.engines[1].rndv_sends.is_empty() || net.engines[1].rndv_sends.iter().all(|(_, s)| s.op.is_none()));
}

/// Every live rank hears of a loss from the first rank that saw it, and passes the news on once:
/// no rank tells another twice, and a report of a known loss is not passed on.
#[test]
fn news_of_a_loss_reaches_every_live_rank_once() {
    let mut net = Net::new(5, cfg(4));
    net.watch(1, Watch::All);
    for r in 1..5 {
        net.recv_on(r, 1, 1, Source::Any);
    }
    net.engines[1].peer_lost(0, TransportError::Io(std::io::ErrorKind::TimedOut));
    net.pump();
    assert_eq!(net.notices(), 3, "rank 1 tells ranks 2, 3 and 4");
    let mut sent = 0;
    loop {
        sent += net.notices();
        let keys: Vec<_> = net.links.iter().filter(|(_, l)| !l.is_empty()).map(|(k, _)| *k).collect();
        if keys.is_empty() {
            break;
        }
        for (f, t) in keys {
            while net.deliver_one(f, t) {}
        }
    }
    assert_eq!(sent, 4 * 3, "each of the 4 survivors tells the 3 others once");
    for r in 1..5 {
        assert!(lost_naming(net.take(r, 1), 0), "rank {r}'s wildcard receive");
        assert_eq!(net.engines[r as usize].failures().lost(), &[0]);
    }
    // The ranks told by others cut their own connection to the lost rank; the witness need not.
    assert_eq!(net.engines[1].poll_cut(), None);
    for r in 2..5 {
        assert!(matches!(net.engines[r as usize].poll_cut(), Some((0, TransportError::Reported { .. }))));
    }
}

/// A goodbye fails what names the departed rank and spreads nothing; it refuses no collective up
/// front (the departed rank may have finished its part); its connection closing afterwards is no
/// loss.
#[test]
fn a_departure_is_not_a_loss() {
    let mut net = Net::new(3, cfg(4));
    net.watch(1, Watch::All);
    net.watch(2, Watch::ranks([1, 2]));
    net.recv_on(1, 1, 1, Source::Rank(0));
    net.recv_on(1, 2, 1, Source::Rank(2));
    net.engines[1].handle_frame(0, Header::new(Kind::Bye), Bytes::new());
    net.engines[1].peer_lost(0, TransportError::Closed);
    net.pump();
    assert!(matches!(
        net.take(1, 1),
        Some(Completion::Recv(Err(Error::PeerLost { rank: 0, reason: TransportError::Left })))
    ));
    assert!(net.take(1, 2).is_none());
    assert_eq!(net.notices(), 0);
    let e = &net.engines[1];
    assert_eq!(e.failures().fate(0), &Fate::Departed);
    assert!(e.revoked(1).is_none());
    assert!(e.gate(1).is_none(), "a departure refuses no collective up front");
    assert!(e.gate(2).is_none());
}

/// Messages that arrive, or wait unmatched, on a revoked context are dropped and their credit
/// handed back: traffic between the same two survivors on another communicator is not held up.
/// A rendezvous announcement is refused, and the sender forgets it without a protocol violation.
#[test]
fn a_revoked_context_gives_its_credit_back() {
    let mut net = Net::new(3, cfg(2));
    net.watch(1, Watch::All);
    net.watch(2, Watch::ranks([1, 2]));
    net.send_on(2, 1, 1, 1, data(8, 1));
    net.send_on(2, 2, 1, 1, data(EAGER + 1, 2)); // its RTS takes the last credit
    net.run();
    assert_eq!(net.engines[1].unexpected_from(2), 2);
    net.engines[1].peer_lost(0, TransportError::Closed);
    net.run();
    assert_eq!(net.engines[1].unexpected_from(2), 0);
    assert!(lost_naming(net.take(2, 2), 0), "the rendezvous send fails with the loss");
    assert!(net.engines[2].rndv_sends.is_empty(), "the refusal made the sender forget it");
    for i in 0..4u8 {
        net.send_on(2, 10 + i as usize, 2, 1, data(8, i));
        net.recv_on(1, 10 + i as usize, 2, Source::Rank(2));
        net.run();
        assert_eq!(net.received(1, 10 + i as usize).0, data(8, i));
    }
}

/// A loss learnt from a report (the launcher) fails the receive of a rendezvous under way at once,
/// but its buffer stays until the transport lets go of the connection, which the engine asks it
/// to cut.
#[test]
fn a_reported_loss_keeps_buffers_until_the_transport_lets_go() {
    let mut net = Net::new(2, cfg(4));
    net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
    net.send(0, 1, 1, 0, data(EAGER * 3, 5));
    assert!(net.deliver_one(0, 1), "the RTS");
    assert!(net.deliver_one(1, 0), "the CTS");
    net.engines[1].report_lost(0, TransportError::Launcher);
    net.pump();
    assert!(matches!(
        net.take(1, 1),
        Some(Completion::Recv(Err(Error::PeerLost { rank: 0, reason: TransportError::Launcher })))
    ));
    assert_eq!(net.engines[1].rndv_recvs.len(), 1, "the transport may still write into it");
    assert_eq!(net.engines[1].poll_cut(), Some((0, TransportError::Launcher)));
    let (h, _) = net.links.get_mut(&(0, 1)).and_then(|l| l.pop_front()).expect("a data frame");
    assert_eq!(h.kind, Kind::Data);
    assert!(matches!(net.engines[1].data_dest(0, &h), Ok(Some(_))));
    net.engines[1].peer_lost(0, TransportError::Closed);
    assert!(net.engines[1].rndv_recvs.is_empty());
    assert!(net.engines[1].poll_cut().is_none());
}

/// A `Lost` notice naming a rank outside the job breaks the protocol; one naming its sender is
/// that rank aborting.
#[test]
fn lost_notices_are_checked() {
    let mut e = Engine::new(1, 3, cfg(2));
    e.handle_frame(0, Header { aux: 3, ..Header::new(Kind::Lost) }, Bytes::new());
    assert!(matches!(e.poll_violation(), Some((0, WireError::UnknownRank { rank: 3, size: 3 }))));
    let mut net = Net::new(3, cfg(2));
    net.engines[0].abort();
    net.run();
    assert!(matches!(net.engines[1].failures().fate(0), Fate::Lost(TransportError::Aborted)));
    assert!(matches!(net.engines[2].failures().fate(0), Fate::Lost(TransportError::Aborted)));
}

proptest! {
    /// Losses seen by random ranks at random moments, with the links delivering in random order:
    /// in the end every survivor knows every loss, its operations on the world's context fail
    /// naming its first-learnt loss, and no rank told another of the same loss twice.
    #[test]
    fn losses_reach_every_survivor(n in 3u32..7, seed in any::<u64>(), witnesses in proptest::collection::vec((0u32..7, 0u32..7), 1..3)) {
        let mut net = Net::new(n, cfg(4));
        net.watch(1, Watch::All);
        let mut rng = seed | 1;
        let mut next = move || { rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17; rng };
        // The lost ranks (distinct), and who sees each; at least two ranks survive.
        let mut lost: Vec<(Rank, Rank)> = Vec::new();
        for (l, w) in witnesses {
            let (l, w) = (l % n, w % n);
            if l != w && lost.iter().all(|&(x, _)| x != l && x != w) && lost.len() + 2 < n as usize {
                lost.push((l, w));
            }
        }
        prop_assume!(!lost.is_empty());
        let dead: Vec<Rank> = lost.iter().map(|&(l, _)| l).collect();
        for r in 0..n {
            net.recv_on(r, 1, 1, Source::Any);
        }
        let mut told = HashMap::new();
        let mut pending = lost.clone();
        loop {
            if !pending.is_empty() && next() % 3 == 0 {
                let (l, w) = pending.remove(0);
                net.engines[w as usize].peer_lost(l, TransportError::Closed);
                net.pump();
            }
            let keys: Vec<_> = net.links.iter().filter(|(_, q)| !q.is_empty()).map(|(k, _)| *k).collect();
            if keys.is_empty() && pending.is_empty() {
                break;
            }
            if keys.is_empty() {
                continue;
            }
            let (f, t) = keys[(next() % keys.len() as u64) as usize];
            if let Some((h, _)) = net.links[&(f, t)].front() && h.kind == Kind::Lost {
                *told.entry((f, t, h.aux)).or_insert(0) += 1;
            }
            net.deliver_one(f, t);
        }
        prop_assert!(told.values().all(|&c| c == 1), "told twice: {:?}", told);
        for r in (0..n).filter(|r| !dead.contains(r)) {
            let e = &net.engines[r as usize];
            let mut known = e.failures().lost().to_vec();
            known.sort();
            let mut expect = dead.clone();
            expect.sort();
            prop_assert_eq!(&known, &expect, "rank {}", r);
            let first = e.failures().lost()[0];
            prop_assert!(lost_naming(net.take(r, 1), first), "rank {}", r);
        }
    }
}

/// A context made after the loss that revokes it (a communicator made late) drops what arrived for
/// it meanwhile, credit included; one made after a loss that does not concern it keeps it all.
#[test]
fn a_context_registered_after_a_loss_follows_its_watch() {
    let mut net = Net::new(3, cfg(2));
    net.send_on(2, 1, 5, 1, data(8, 1));
    net.send_on(2, 2, 6, 1, data(8, 2));
    net.run();
    net.engines[1].peer_lost(0, TransportError::Closed);
    net.pump();
    assert_eq!(net.engines[1].unexpected_from(2), 2, "unregistered contexts keep their messages");
    net.engines[1].watch(5, Watch::All);
    net.engines[1].watch(6, Watch::ranks([1, 2]));
    assert_eq!(net.engines[1].unexpected_from(2), 1);
    net.recv_on(1, 1, 6, Source::Rank(2));
    assert_eq!(net.received(1, 1).0, data(8, 2));
    net.recv_on(1, 2, 5, Source::Rank(2));
    assert!(lost_naming(net.take(1, 2), 0));
}

/// A context registered to be interrupted, not revoked (one-sided communication's): a loss fails
/// the receives from any source waiting there, naming it, and nothing else; receives posted
/// afterwards wait, and messages between survivors flow.
#[test]
fn an_interrupted_context_is_not_revoked() {
    let mut net = Net::new(3, cfg(4));
    net.watch(7, Watch::Interrupt);
    net.recv_on(1, 1, 7, Source::Any);
    net.recv_on(1, 2, 7, Source::Rank(2));
    net.engines[1].post_probe(3, 7, Source::Any, TagMatch::Any);
    net.engines[1].peer_lost(0, TransportError::Closed);
    net.pump();
    assert!(lost_naming(net.take(1, 1), 0));
    assert!(lost_naming(net.take(1, 3), 0));
    assert!(net.take(1, 2).is_none());
    net.recv_on(1, 4, 7, Source::Any);
    assert!(net.take(1, 4).is_none(), "posted again, it waits");
    net.send_on(2, 1, 7, 1, data(8, 3));
    net.run();
    assert_eq!(net.received(1, 2).0, data(8, 3));
    net.send_on(2, 2, 7, 1, data(8, 4));
    net.run();
    assert_eq!(net.received(1, 4).0, data(8, 4));
}

/// Sizes around the eager limit, and one of several chunks: below and at the limit the message
/// travels eagerly; above it, a pushed message meets a posted receive without a CTS round trip.
const AROUND_THE_SWITCH: [usize; 6] = [EAGER - 1, EAGER, EAGER + 1, EAGER + 3, 1000, 1001];

#[test]
fn pushed_rendezvous_needs_no_round_trip_when_the_receive_is_posted() {
    for len in AROUND_THE_SWITCH {
        let mut net = Net::pushing(2, cfg(4));
        net.recv(1, 1, Source::Rank(0), TagMatch::Exact(5), RecvBuf::User(BytesMut::zeroed(2000)));
        net.send(0, 1, 1, 5, data(len, 1));
        // Nothing travels from the receiver to the sender before the message is in.
        net.drain(0, 1);
        assert_eq!(net.received(1, 1), (data(len, 1), Status { source: 0, tag: 5, len }), "{len} B");
        assert_eq!(net.data_frames.get(&(0, 1)).map_or(0, |c| c.1), 0, "nothing dropped");
        // The send completes when the receiver says it took the data (or at once, if eager).
        net.run();
        assert!(matches!(net.take(0, 1), Some(Completion::Send(Ok(())))));
        assert_eq!(net.data_frames.get(&(0, 1)).map_or(0, |c| c.0), if len > EAGER { len.div_ceil(100) } else { 0 });
        assert_eq!(net.engines[1].unexpected_from(0), 0);
    }
}

#[test]
fn pushed_rendezvous_arriving_unexpected_is_dropped_and_sent_again() {
    for len in AROUND_THE_SWITCH {
        for alloc in [false, true] {
            let mut net = Net::pushing(2, cfg(4));
            net.send(0, 1, 1, 5, data(len, 2));
            net.drain(0, 1);
            assert_eq!(net.engines[1].unexpected_from(0), 1, "{len} B: held as one unexpected message");
            if len > EAGER {
                assert!(net.take(0, 1).is_none(), "a pushed send waits for the receiver's word");
            } else {
                assert!(matches!(net.take(0, 1), Some(Completion::Send(Ok(())))));
            }
            let buf = if alloc { RecvBuf::Alloc } else { RecvBuf::User(BytesMut::zeroed(len)) };
            net.recv(1, 1, Source::Any, TagMatch::Any, buf);
            net.run();
            assert_eq!(net.received(1, 1).0, data(len, 2), "{len} B");
            if len > EAGER {
                assert!(matches!(net.take(0, 1), Some(Completion::Send(Ok(())))));
                let chunks = len.div_ceil(100);
                assert_eq!(net.data_frames[&(0, 1)], (2 * chunks, chunks), "dropped once, sent again");
            }
        }
    }
}

#[test]
fn pushed_rendezvous_matched_between_rts_and_data_lands_in_place() {
    let mut net = Net::pushing(2, cfg(4));
    net.send(0, 1, 1, 5, data(1000, 3));
    assert!(net.deliver_one(0, 1), "the RTS");
    net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
    net.run();
    assert_eq!(net.received(1, 1).0, data(1000, 3));
    assert_eq!(net.data_frames[&(0, 1)], (10, 0), "every chunk taken in place, none sent again");
    assert!(matches!(net.take(0, 1), Some(Completion::Send(Ok(())))));
}

#[test]
fn pushed_data_awaits_a_receive_only_while_one_can_still_take_it_in_place() {
    // Unmatched, nothing dropped: worth holding back. Once the receive is posted: in place.
    let mut net = Net::pushing(2, cfg(4));
    net.send(0, 1, 1, 5, data(1000, 3));
    assert!(net.deliver_one(0, 1), "the RTS");
    let h = net.links[&(0, 1)].front().unwrap().0;
    assert_eq!((h.kind, h.flags, h.aux, h.len), (Kind::Data, flags::PUSH, 0, 100), "the first pushed chunk");
    assert!(net.engines[1].awaits_receive(0, &h));
    assert!(!net.engines[1].awaits_receive(0, &Header { aux: 100, ..h }), "only the first chunk");
    assert!(!net.engines[1].awaits_receive(0, &Header { seq: h.seq + 1, ..h }), "another message");
    assert!(!net.engines[1].awaits_receive(0, &Header { flags: 0, ..h }), "not pushed");
    net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
    assert!(!net.engines[1].awaits_receive(0, &h), "matched: it has its place");
    net.run();
    assert_eq!(net.received(1, 1).0, data(1000, 3));
    assert_eq!(net.data_frames[&(0, 1)], (10, 0));

    // Matched by a receive too small for it: refused, nothing to wait for.
    let mut net = Net::pushing(2, cfg(4));
    net.send(0, 1, 1, 5, data(1000, 3));
    assert!(net.deliver_one(0, 1), "the RTS");
    let h = net.links[&(0, 1)].front().unwrap().0;
    net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::User(BytesMut::zeroed(999)));
    assert!(!net.engines[1].awaits_receive(0, &h), "refused");
    net.run();
    assert!(matches!(net.take(1, 1), Some(Completion::Recv(Err(Error::Truncated { len: 1000, capacity: 999 })))));

    // Once a chunk has been dropped the message comes again anyway: no waiting either.
    let mut net = Net::pushing(2, cfg(4));
    net.send(0, 1, 1, 5, data(1000, 3));
    assert!(net.deliver_one(0, 1), "the RTS");
    let h = net.links[&(0, 1)].front().unwrap().0;
    assert!(net.engines[1].data_dest(0, &h).unwrap().is_none(), "dropped");
    assert!(!net.engines[1].awaits_receive(0, &h));
}

#[test]
fn pushed_rendezvous_matched_after_a_chunk_was_dropped_is_sent_again() {
    let mut net = Net::pushing(2, cfg(4));
    net.send(0, 1, 1, 5, data(1000, 4));
    assert!(net.deliver_one(0, 1), "the RTS");
    assert!(net.deliver_one(0, 1), "the first chunk, dropped");
    net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
    net.run();
    assert_eq!(net.received(1, 1).0, data(1000, 4));
    assert_eq!(net.data_frames[&(0, 1)], (20, 10));
}

#[test]
fn pushed_and_plain_messages_keep_their_order() {
    let mut net = Net::pushing(2, cfg(8));
    let lens = [10, 1000, EAGER + 3, 5, 300, EAGER];
    for (i, &len) in lens.iter().enumerate() {
        net.send(0, i, 1, 7, data(len, i as u8));
    }
    // The first two find posted receives, the rest arrive unexpected.
    net.recv(1, 0, Source::Any, TagMatch::Any, RecvBuf::Alloc);
    net.recv(1, 1, Source::Any, TagMatch::Any, RecvBuf::User(BytesMut::zeroed(1000)));
    net.run();
    for i in 2..lens.len() {
        net.recv(1, i, Source::Rank(0), TagMatch::Exact(7), RecvBuf::Alloc);
        net.run();
    }
    for (i, &len) in lens.iter().enumerate() {
        assert_eq!(net.received(1, i).0, data(len, i as u8), "message {i}");
        assert!(matches!(net.take(0, i), Some(Completion::Send(Ok(())))), "send {i}");
    }
}

#[test]
fn pushed_rendezvous_stays_within_credits() {
    let mut net = Net::pushing(2, cfg(2));
    for op in 0..5 {
        net.send(0, op, 1, 0, data(1000, op as u8));
    }
    net.run();
    // Two announcements hold the credit; the rest, data included, wait at the sender.
    assert_eq!(net.engines[1].unexpected_from(0), 2);
    assert_eq!(net.engines[0].backlog_to(1), 3);
    assert_eq!(net.data_frames[&(0, 1)], (20, 20), "only the credited messages' data was pushed");
    for op in 0..5 {
        net.recv(1, op, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
        net.run();
        assert_eq!(net.received(1, op).0, data(1000, op as u8), "in order");
        assert!(net.engines[1].unexpected_from(0) <= 2);
    }
    assert_eq!(net.engines[0].backlog_to(1), 0);
}

#[test]
fn pushed_rendezvous_truncation_is_an_error_on_both_sides() {
    for posted_first in [true, false] {
        let mut net = Net::pushing(2, cfg(4));
        if posted_first {
            net.recv(1, 1, Source::Any, TagMatch::Any, RecvBuf::User(BytesMut::zeroed(5)));
        }
        net.send(0, 1, 1, 0, data(EAGER + 3, 0));
        net.run();
        if !posted_first {
            net.recv(1, 1, Source::Any, TagMatch::Any, RecvBuf::User(BytesMut::zeroed(5)));
            net.run();
        }
        assert!(matches!(net.take(1, 1), Some(Completion::Recv(Err(Error::Truncated { capacity: 5, .. })))));
        assert!(matches!(net.take(0, 1), Some(Completion::Send(Err(Error::RemoteTruncated { rank: 1 })))));
        net.send(0, 2, 1, 0, data(1000, 1));
        net.recv(1, 2, Source::Any, TagMatch::Any, RecvBuf::Alloc);
        net.run();
        assert_eq!(net.received(1, 2).0, data(1000, 1));
    }
}

#[test]
fn a_sender_dying_mid_push_fails_the_receive_and_frees_its_state() {
    let mut net = Net::pushing(3, cfg(4));
    net.recv(1, 1, Source::Rank(0), TagMatch::Any, RecvBuf::Alloc);
    net.send(0, 1, 1, 0, data(1000, 5));
    for _ in 0..4 {
        assert!(net.deliver_one(0, 1), "the RTS and three chunks");
    }
    net.links.clear();
    net.engines[1].peer_lost(0, TransportError::Closed);
    net.pump();
    assert!(matches!(net.take(1, 1), Some(Completion::Recv(Err(Error::PeerLost { rank: 0, .. })))));
    // Nothing of the message is kept: no destination for its remaining chunks.
    let rest = Header { seq: 0, aux: 300, len: 100, flags: flags::PUSH, ..Header::new(Kind::Data) };
    assert!(net.engines[1].data_dest(0, &rest).is_err());
    assert_eq!(net.engines[1].unexpected_from(0), 0);
}

#[test]
fn a_receiver_dying_mid_push_fails_the_send() {
    let mut net = Net::pushing(2, cfg(4));
    net.send(0, 1, 1, 0, data(1000, 5));
    net.engines[0].peer_lost(1, TransportError::Closed);
    net.pump();
    assert!(matches!(net.take(0, 1), Some(Completion::Send(Err(Error::PeerLost { rank: 1, .. })))));
}

#[test]
fn malformed_pushes_are_violations() {
    let rts = |seq, len| Header { seq, aux: len, flags: flags::PUSH, ..Header::new(Kind::Rts) };
    let chunk = |seq, off, len| Header { seq, aux: off, len, flags: flags::PUSH, ..Header::new(Kind::Data) };
    // Data with no pushed message in progress.
    let mut e = Engine::new(1, 2, cfg(4));
    assert!(e.data_dest(0, &chunk(3, 0, 10)).is_err());
    e.handle_frame(0, chunk(3, 0, 10), Bytes::new());
    assert!(e.poll_violation().is_some());
    // A second push cutting into the first.
    let mut e = Engine::new(1, 2, cfg(4));
    e.handle_frame(0, rts(1, 200), Bytes::new());
    e.handle_frame(0, rts(2, 200), Bytes::new());
    assert!(e.poll_violation().is_some());
    // Wrong message, a gap, past the end.
    let mut e = Engine::new(1, 2, cfg(4));
    e.handle_frame(0, rts(1, 200), Bytes::new());
    assert!(e.data_dest(0, &chunk(2, 0, 10)).is_err());
    assert!(e.data_dest(0, &chunk(1, 10, 10)).is_err());
    assert!(e.data_dest(0, &chunk(1, 0, 201)).is_err());
    assert!(matches!(e.data_dest(0, &chunk(1, 0, 200)), Ok(None)), "unmatched: dropped");
    e.handle_frame(0, chunk(1, 0, 200), Bytes::new());
    assert!(e.poll_violation().is_none());
    // Done: the next push may start.
    e.handle_frame(0, rts(2, 200), Bytes::new());
    assert!(e.poll_violation().is_none());
}

/// A rank that did its part of a collective and then left never fails that collective at a rank
/// still running it, however the departure interleaves with another rank's loss and with the
/// moment the survivors' context is registered there (a communicator's collective context is
/// registered at a rank's first call): the message sent before the goodbye is delivered, whether
/// the receive was posted before the message came, between it and the goodbye, or after the
/// goodbye and the connection's end; only a receive for something never sent fails, with `Left`.
/// A rank that leaves with sends still waiting for credit, or for the clear-to-send of their
/// rendezvous, fails them with `Shutdown` and sends nothing after its goodbye: the receiver, which
/// has seen the goodbye, would drop what followed while the sender counted it delivered.
#[test]
fn a_leaving_rank_sends_nothing_after_its_goodbye_and_fails_what_it_holds() {
    let mut net = Net::new(2, cfg(2));
    // A rendezvous send whose RTS goes out, an eager one, then one that waits for credit.
    net.send(0, 1, 1, 5, Bytes::from(vec![7u8; EAGER * 3]));
    net.send(0, 2, 1, 5, Bytes::from_static(b"eager"));
    net.send(0, 3, 1, 5, Bytes::from_static(b"queued"));
    assert!(matches!(net.take(0, 2), Some(Completion::Send(Ok(())))));
    assert!(net.take(0, 3).is_none(), "the third send waits for credit");
    // Rank 1 matches the rendezvous: its clear-to-send is on the way back as rank 0 leaves.
    net.drain(0, 1);
    net.recv(1, 1, Source::Rank(0), TagMatch::Exact(5), RecvBuf::Alloc);
    net.engines[0].say_goodbye();
    net.pump();
    for op in [1, 3] {
        assert!(matches!(net.take(0, op), Some(Completion::Send(Err(Error::Shutdown)))), "send {op}");
    }
    net.drain(1, 0);
    let after: Vec<Kind> = net.links.get(&(0, 1)).into_iter().flatten().map(|(h, _)| h.kind).collect();
    assert_eq!(after, [Kind::Bye], "only the goodbye leaves rank 0 once it says it");
    net.run();
    assert!(
        matches!(
            net.take(1, 1),
            Some(Completion::Recv(Err(Error::PeerLost { rank: 0, reason: TransportError::Left })))
        ),
        "the matched receive fails with the departure"
    );
}

#[test]
fn a_departed_ranks_last_message_completes_the_collective() {
    const SURVIVORS: u32 = 7;
    // When rank 0 posts its receive and registers the survivors' context, relative to rank 1's
    // message, its goodbye and its connection's end.
    for post_at in 0..4 {
        for registered_first in [false, true] {
            let mut net = Net::new(4, cfg(4));
            let what = format!("receive posted at step {post_at}, context registered first: {registered_first}");
            // Rank 2 is lost first: the world is revoked, the survivors' context is not.
            for r in [0, 1, 3] {
                net.engines[r as usize].peer_lost(2, TransportError::Closed);
            }
            net.pump();
            net.links.retain(|_, l| l.iter().all(|(h, _)| h.kind != Kind::Lost));
            for r in [1, 3] {
                net.engines[r as usize].watch(SURVIVORS, Watch::ranks([0, 1, 3]));
            }
            if registered_first {
                net.engines[0].watch(SURVIVORS, Watch::ranks([0, 1, 3]));
            }
            let post = |net: &mut Net, step: u32| {
                if step == post_at {
                    net.engines[0].watch(SURVIVORS, Watch::ranks([0, 1, 3]));
                    net.recv_on(0, 1, SURVIVORS, Source::Rank(1));
                    net.recv_on(0, 2, SURVIVORS, Source::Rank(1));
                }
            };
            post(&mut net, 0);
            // Rank 1's last message of the call, then its goodbye.
            net.send_on(1, 1, SURVIVORS, 0, Bytes::from_static(b"result"));
            assert!(matches!(net.take(1, 1), Some(Completion::Send(Ok(())))), "{what}");
            net.engines[1].say_goodbye();
            net.pump();
            net.deliver_one(1, 0);
            post(&mut net, 1);
            net.drain(1, 0);
            post(&mut net, 2);
            net.engines[0].peer_lost(1, TransportError::Closed);
            net.pump();
            post(&mut net, 3);
            let (data, status) = net.received(0, 1);
            assert_eq!((&data[..], status.source), (&b"result"[..], 1), "{what}");
            assert!(
                matches!(
                    net.take(0, 2),
                    Some(Completion::Recv(Err(Error::PeerLost { rank: 1, reason: TransportError::Left })))
                ),
                "{what}: a receive for something rank 1 never sent"
            );
            let e = &net.engines[0];
            assert_eq!(e.failures().fate(1), &Fate::Departed, "{what}");
            assert!(e.gate(SURVIVORS).is_none(), "{what}");
        }
    }
}
