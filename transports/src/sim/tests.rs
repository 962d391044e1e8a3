use super::*;

/// Records what a transport hands over; rendezvous payloads land in `dest`.
#[derive(Default)]
struct Rec {
    frames: Vec<(Rank, Header, Bytes)>,
    lost: Vec<(Rank, TransportError)>,
    dest: Vec<u8>,
}

// SAFETY: `dest` is neither moved nor resized while a transport writes into it (the sim copies
// synchronously inside `progress`).
unsafe impl Sink for Rec {
    fn data_dest(&mut self, _peer: Rank, h: &Header) -> Result<Option<&mut [u8]>, WireError> {
        let (at, len) = (h.aux as usize, h.len as usize);
        if self.dest.len() < at + len {
            self.dest.resize(at + len, 0);
        }
        Ok(Some(&mut self.dest[at..at + len]))
    }
    fn frame(&mut self, peer: Rank, h: Header, payload: Bytes) {
        self.frames.push((peer, h, payload));
    }
    fn peer_lost(&mut self, peer: Rank, err: TransportError) {
        self.lost.push((peer, err));
    }
}

fn eager(tag: u64, len: usize) -> (Header, Bytes) {
    (Header { tag, len: len as u32, ..Header::new(Kind::Eager) }, Bytes::from(vec![tag as u8; len]))
}

/// Runs the network dry, collecting rank `r`'s deliveries with their arrival times.
fn drain(net: &SimNet, t: &mut SimTransport) -> Vec<(Time, Rank, Header, Bytes)> {
    let mut out = Vec::new();
    while let Some(now) = net.advance(None) {
        let mut rec = Rec::default();
        t.progress(&mut rec);
        out.extend(rec.frames.into_iter().map(|(p, h, b)| (now, p, h, b)));
    }
    out
}

#[test]
fn a_frame_costs_serialization_and_latency_and_incast_queues() {
    let net = SimNet::new(3, NetConfig::default());
    let (mut a, mut b, mut c) = (net.transport(0), net.transport(1), net.transport(2));
    let (h, p) = eager(1, 1000 - HEADER_LEN);
    a.send(2, h, p.clone());
    b.send(2, h, p);
    let got = drain(&net, &mut c);
    let ser = Link::default().serialize(1000);
    assert_eq!(ser, 800);
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        [ser + 2_000, 2 * ser + 2_000],
        "the second waits at the port"
    );
    assert_eq!(net.stats().frames, 2);
    assert_eq!(net.stats().frame_bytes, 2000);
}

#[test]
fn the_sender_port_serializes_its_frames_one_after_another() {
    let net = SimNet::new(3, NetConfig::default());
    let (mut a, mut b, mut c) = (net.transport(0), net.transport(1), net.transport(2));
    let (h, p) = eager(1, 1000 - HEADER_LEN);
    a.send(1, h, p.clone());
    a.send(2, h, p);
    let (mut rb, mut rc) = (Vec::new(), Vec::new());
    while let Some(now) = net.advance(None) {
        let (mut x, mut y) = (Rec::default(), Rec::default());
        b.progress(&mut x);
        c.progress(&mut y);
        rb.extend(x.frames.iter().map(|_| now));
        rc.extend(y.frames.iter().map(|_| now));
    }
    assert_eq!((rb, rc), (vec![2_800], vec![3_600]));
}

#[test]
fn frames_on_a_link_stay_in_order_under_jitter_and_loss_and_all_arrive() {
    let link = Link::default().with_jitter(5_000).with_loss(0.2);
    let net = SimNet::new(2, NetConfig { seed: 7, link, ..NetConfig::default() });
    let (mut a, mut b) = (net.transport(0), net.transport(1));
    for tag in 0..500 {
        let (h, p) = eager(tag, (tag % 100) as usize);
        a.send(1, h, p);
    }
    let got = drain(&net, &mut b);
    assert_eq!(got.iter().map(|g| g.2.tag).collect::<Vec<_>>(), (0..500).collect::<Vec<_>>());
    assert!(got.iter().all(|(_, _, h, p)| p.len() == h.len as usize && p.iter().all(|&x| x == h.tag as u8)));
    let retx = net.stats().retransmissions;
    assert!((50..200).contains(&retx), "about a fifth of 500 lost once: {retx}");
}

#[test]
fn jitter_reorders_frames_of_different_links() {
    let link = Link::default().with_jitter(10_000);
    let net = SimNet::new(9, NetConfig { seed: 3, link, ..NetConfig::default() });
    let mut ts: Vec<SimTransport> = (0..9).map(|r| net.transport(r)).collect();
    for (r, t) in ts.iter_mut().enumerate().skip(1) {
        let (h, p) = eager(r as u64, 8);
        t.send(0, h, p);
    }
    let got = drain(&net, &mut ts[0]);
    let order: Vec<Rank> = got.iter().map(|g| g.1).collect();
    assert_eq!(order.len(), 8);
    assert_ne!(order, (1..9).collect::<Vec<_>>(), "seed 3 reorders the senders");
}

#[test]
fn rendezvous_payloads_land_in_the_sinks_buffer() {
    let net = SimNet::new(2, NetConfig::default());
    let (mut a, mut b) = (net.transport(0), net.transport(1));
    let data: Vec<u8> = (0..100u8).collect();
    for (i, part) in data.chunks(30).enumerate() {
        let h = Header { aux: (i * 30) as u64, len: part.len() as u32, ..Header::new(Kind::Data) };
        a.send(1, h, Bytes::copy_from_slice(part));
    }
    let mut rec = Rec::default();
    while net.advance(None).is_some() {
        b.progress(&mut rec);
    }
    assert_eq!(rec.dest, data);
    assert!(rec.frames.iter().all(|(_, h, p)| h.kind == Kind::Data && p.is_empty()));
}

#[test]
fn datagrams_reach_every_other_member_once_without_loss() {
    let net = SimNet::new(5, NetConfig::default());
    let g: Vec<SimDatagrams> = (0..5).map(|r| net.join(r, 9)).collect();
    assert!(g[2].send(Bytes::from_static(b"hello")));
    assert!(!g[2].send(Bytes::from(vec![0; 1401])), "longer than the datagram limit");
    while net.advance(None).is_some() {}
    for (r, m) in g.iter().enumerate() {
        let got: Vec<Bytes> = std::iter::from_fn(|| m.recv()).collect();
        assert_eq!(got.len(), usize::from(r != 2), "rank {r}");
    }
    let s = net.stats();
    assert_eq!((s.datagrams, s.datagram_copies), (1, 4));
}

#[test]
fn datagrams_are_lost_duplicated_and_reordered_as_configured() {
    let link = Link::default().with_jitter(20_000).with_loss(0.1).with_duplicate(0.05);
    let net = SimNet::new(2, NetConfig { seed: 11, link, ..NetConfig::default() });
    let (a, b) = (net.join(0, 1), net.join(1, 1));
    for i in 0..2000u32 {
        a.send(Bytes::copy_from_slice(&i.to_le_bytes()));
    }
    while net.advance(None).is_some() {}
    let got: Vec<u32> =
        std::iter::from_fn(|| b.recv()).map(|d| u32::from_le_bytes(d[..].try_into().unwrap())).collect();
    let s = net.stats();
    assert_eq!(got.len() as u64, 2000 - s.datagrams_lost + s.datagrams_duplicated);
    assert!((120..280).contains(&s.datagrams_lost), "{s:?}");
    assert!((40..160).contains(&s.datagrams_duplicated), "{s:?}");
    assert!(got.windows(2).any(|w| w[0] > w[1]), "jitter reorders datagrams");
}

#[test]
fn a_killed_rank_is_reported_lost_after_the_detection_delay_and_drops_its_traffic() {
    let net = SimNet::new(3, NetConfig::default());
    let (mut a, mut b) = (net.transport(0), net.transport(1));
    let (h, p) = eager(1, 8);
    a.send(1, h, p.clone());
    net.kill(0);
    a.send(1, h, p);
    let mut rec = Rec::default();
    let mut when = None;
    while let Some(now) = net.advance(None) {
        b.progress(&mut rec);
        if when.is_none() && !rec.lost.is_empty() {
            when = Some(now);
        }
    }
    assert!(rec.frames.is_empty(), "in flight when the sender died: dropped");
    assert_eq!(when, Some(NetConfig::default().detect));
    assert!(matches!(rec.lost[..], [(0, TransportError::Closed)]));
    assert!(net.stats().dropped >= 2);
}

#[test]
fn disconnect_reports_at_once_here_and_after_the_delay_there() {
    let net = SimNet::new(2, NetConfig::default());
    let (mut a, mut b) = (net.transport(0), net.transport(1));
    a.disconnect(1, TransportError::Left);
    let mut ra = Rec::default();
    a.progress(&mut ra);
    assert!(matches!(ra.lost[..], [(1, TransportError::Left)]));
    let (h, p) = eager(1, 8);
    b.send(0, h, p);
    let mut rb = Rec::default();
    while net.advance(None).is_some() {
        a.progress(&mut ra);
        b.progress(&mut rb);
    }
    assert!(matches!(rb.lost[..], [(0, TransportError::Closed)]));
    assert_eq!(ra.frames.len(), 0);
}

#[test]
fn the_same_seed_gives_the_same_trace() {
    let run = |seed| {
        let link = Link::default().with_jitter(3_000).with_loss(0.1).with_duplicate(0.1);
        let net = SimNet::new(4, NetConfig { seed, link, ..NetConfig::default() });
        let mut ts: Vec<SimTransport> = (0..4).map(|r| net.transport(r)).collect();
        let gs: Vec<SimDatagrams> = (0..4).map(|r| net.join(r, 0)).collect();
        for i in 0..200u64 {
            let (h, p) = eager(i, (i % 50) as usize);
            ts[(i % 4) as usize].send(((i + 1) % 4) as Rank, h, p);
            gs[(i % 3) as usize].send(Bytes::from(vec![i as u8; 10]));
        }
        let mut times = Vec::new();
        while let Some(now) = net.advance(None) {
            for t in ts.iter_mut() {
                t.progress(&mut Rec::default());
            }
            times.push(now);
        }
        (net.trace(), times, net.stats())
    };
    assert_eq!(run(5), run(5));
    assert_ne!(run(5).0, run(6).0);
}

#[test]
fn advance_stops_at_the_callers_timer_and_never_goes_back() {
    let net = SimNet::new(2, NetConfig::default());
    let mut a = net.transport(0);
    let (h, p) = eager(1, 8);
    a.send(1, h, p);
    assert_eq!(net.advance(Some(500)), Some(500));
    assert!(net.take_touched().is_empty());
    assert_eq!(net.advance(Some(100)), Some(500));
    let t = net.advance(None).unwrap();
    assert!(t > 2_000);
    assert_eq!(net.take_touched(), [1]);
    assert_eq!(net.advance(None), None);
}
