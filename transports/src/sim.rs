//! The simulated network: an in-memory, seeded, deterministic [`Transport`] for tests at scale.
//!
//! One [`SimNet`] carries the traffic of every rank of a job inside one process; each rank gets a
//! [`SimTransport`] (the reliable, in-order frame path that the point-to-point engine runs on)
//! and, for reliable multicast, [`SimDatagrams`] (an unreliable multicast group). Nothing here
//! reads the clock: time is virtual (nanoseconds, [`Time`]) and moves only when the driver of the
//! simulation calls [`SimNet::advance`], to the next arrival it asks for. Every random choice
//! (jitter, loss, duplication) comes from one generator seeded by [`NetConfig::seed`], and events
//! that fall on the same nanosecond are taken in the order they were scheduled, so a run is a
//! pure function of its seed and of what the ranks do: [`SimNet::trace`] fingerprints it.
//!
//! What a frame costs ([`Link`], per directed pair of ranks): the sender's port serializes it
//! (`bytes * byte_ps`, one frame after another: a rank that sends to many pays for each), then it
//! flies for `latency` plus a uniform draw in `0..=jitter`. The receiver's port takes in one frame
//! at a time in the order they reach it: a frame that finds it busy is through one serialization
//! time after the port's previous frame (incast queues there), otherwise at once (cut-through). A
//! frame is its payload plus the 48-byte ferrocomm header; a datagram is its bytes plus 28 (IPv4
//! and UDP headers). Processing time in the ranks (matching, copies, reductions) is not modelled:
//! a rank reacts to an arrival in the same virtual instant.
//!
//! Loss and reordering differ by path, because the two paths promise different things:
//!
//! * The frame path is TCP's contract: every frame arrives, and frames on one link arrive in the
//!   order they were sent ([`Transport::send`] requires it). A lost frame (probability `loss`)
//!   shows as what TCP makes of it: the frame arrives one retransmission timeout
//!   ([`NetConfig::rto`]) later per loss, and the frames behind it on the same link wait for it
//!   (head-of-line blocking). Jitter reorders frames of different links only.
//! * The datagram path is UDP multicast's: one send reaches every other member of the group, each copy
//!   lost with probability `loss`, duplicated with probability `duplicate`, and copies of
//!   different datagrams overtake one another freely (jitter). The sender's port carries one copy;
//!   the switch replicates. The sender does not get its own datagrams back.
//!
//! Failures: [`SimNet::kill`] crashes a rank (everything to and from it is dropped from then on,
//! and every other rank's transport reports it lost [`NetConfig::detect`] later), and
//! [`Transport::disconnect`] closes one connection as TCP would (both ends report it).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;

use crate::wire::{HEADER_LEN, Header, Kind, Rank, WireError};
use crate::{Sink, Transport, TransportError};

/// Virtual time, in nanoseconds since the start of the simulation.
pub type Time = u64;

/// Bytes a datagram carries on the wire beyond its payload (IPv4 and UDP headers).
pub const DATAGRAM_OVERHEAD: usize = 28;

/// What one directed link between two ranks does to what crosses it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Link {
    /// One-way latency in nanoseconds (wire, switch and the software on both ends).
    pub latency: Time,
    /// Serialization time per byte in picoseconds (800 ps/B is 10 Gbit/s).
    pub byte_ps: u64,
    /// Extra delay drawn uniformly from `0..=jitter` nanoseconds for every frame and datagram.
    pub jitter: Time,
    /// Probability that a transmission is lost (on the frame path: retransmitted after the RTO).
    pub loss: f64,
    /// Probability that a datagram copy arrives twice (datagram path only).
    pub duplicate: f64,
}

impl Link {
    /// A clean link: `latency_ns` one way, `gbit_s` gigabits per second, no jitter, no loss.
    pub fn new(latency_ns: Time, gbit_s: f64) -> Link {
        Link { latency: latency_ns, byte_ps: (8000.0 / gbit_s).round() as u64, jitter: 0, loss: 0.0, duplicate: 0.0 }
    }

    pub fn with_jitter(self, jitter: Time) -> Link {
        Link { jitter, ..self }
    }

    pub fn with_loss(self, loss: f64) -> Link {
        Link { loss, ..self }
    }

    pub fn with_duplicate(self, duplicate: f64) -> Link {
        Link { duplicate, ..self }
    }

    /// Time the link's ports take to serialize `bytes`.
    pub fn serialize(&self, bytes: usize) -> Time {
        (bytes as u64 * self.byte_ps).div_ceil(1000)
    }
}

impl Default for Link {
    /// 2 us one way, 10 Gbit/s: a plain cluster Ethernet.
    fn default() -> Link {
        Link::new(2_000, 10.0)
    }
}

/// The link of each directed pair `(from, to)`, for networks that are not uniform.
pub type Links = Arc<dyn Fn(Rank, Rank) -> Link + Send + Sync>;

/// Parameters of a simulated network.
#[derive(Clone)]
pub struct NetConfig {
    /// Seeds every random choice of the run.
    pub seed: u64,
    /// The link between any two ranks, unless [`NetConfig::links`] says otherwise.
    pub link: Link,
    /// Per-link parameters, overriding `link`.
    pub links: Option<Links>,
    /// Frame path: how much later a lost frame arrives (per loss), as TCP's retransmission timeout.
    pub rto: Time,
    /// How long after a rank dies (or a connection closes) its peers' transports report it.
    pub detect: Time,
    /// The eager limit the transports announce to the engine.
    pub eager_limit: usize,
    /// Largest datagram of the datagram path, headers excluded.
    pub max_datagram: usize,
}

impl Default for NetConfig {
    fn default() -> NetConfig {
        NetConfig {
            seed: 1,
            link: Link::default(),
            links: None,
            rto: 200_000,
            detect: 1_000_000,
            eager_limit: 64 << 10,
            max_datagram: 1400,
        }
    }
}

impl std::fmt::Debug for NetConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NetConfig")
            .field("seed", &self.seed)
            .field("link", &self.link)
            .field("links", &self.links.as_ref().map(|_| "per link"))
            .field("rto", &self.rto)
            .field("detect", &self.detect)
            .field("eager_limit", &self.eager_limit)
            .field("max_datagram", &self.max_datagram)
            .finish()
    }
}

/// What crossed the network so far.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Frames sent on the frame path, and their bytes on the wire (headers included).
    pub frames: u64,
    pub frame_bytes: u64,
    /// Frame-path losses, each repaired by a retransmission.
    pub retransmissions: u64,
    /// Datagrams sent, and their bytes on the wire (one copy each).
    pub datagrams: u64,
    pub datagram_bytes: u64,
    /// Datagram copies delivered, lost, and duplicated.
    pub datagram_copies: u64,
    pub datagrams_lost: u64,
    pub datagrams_duplicated: u64,
    /// Frames and datagrams dropped because a rank died or a connection closed.
    pub dropped: u64,
}

/// splitmix64: small, seedable, and the same on every platform.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// True with probability `p`.
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && ((self.next() >> 11) as f64) < p * (1u64 << 53) as f64
    }

    /// Uniform in `0..=max`.
    fn upto(&mut self, max: Time) -> Time {
        if max == 0 { 0 } else { self.next() % (max + 1) }
    }
}

/// Folds `v` into the trace fingerprint.
fn mix(h: u64, v: u64) -> u64 {
    (h ^ v).wrapping_mul(0x0000_0100_0000_01b3).rotate_left(29)
}

/// A frame or datagram is scheduled twice: when it reaches the receiver's port (`ported` false),
/// and, if the port is busy then, again when the port has taken it in.
enum What {
    Frame {
        src: Rank,
        dst: Rank,
        header: Header,
        payload: Bytes,
        ported: bool,
    },
    Datagram {
        src: Rank,
        dst: Rank,
        group: u32,
        data: Bytes,
        ported: bool,
    },
    /// `at_rank`'s transport learns that `peer` is gone.
    Lost {
        at_rank: Rank,
        peer: Rank,
        reason: TransportError,
    },
}

/// Something in flight, due at `at`; `seq` keeps events of one instant in scheduling order.
struct Flight {
    at: Time,
    seq: u64,
    what: What,
}

impl PartialEq for Flight {
    fn eq(&self, o: &Flight) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Flight {}
impl PartialOrd for Flight {
    fn partial_cmp(&self, o: &Flight) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Flight {
    /// Reversed: the heap's top is the earliest.
    fn cmp(&self, o: &Flight) -> Ordering {
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

#[derive(Clone, Copy, Default)]
struct Port {
    tx_free: Time,
    rx_free: Time,
}

#[derive(Default)]
struct Inbox {
    frames: VecDeque<(Rank, Header, Bytes)>,
    lost: VecDeque<(Rank, TransportError)>,
    datagrams: HashMap<u32, VecDeque<Bytes>>,
    waker: Option<Waker>,
    datagram_waker: Option<Waker>,
}

struct State {
    size: u32,
    cfg: NetConfig,
    now: Time,
    rng: Rng,
    seq: u64,
    flights: BinaryHeap<Flight>,
    inbox: Vec<Inbox>,
    ports: Vec<Port>,
    /// Arrival time of the latest frame on each directed link (frames on a link never overtake).
    last: HashMap<(Rank, Rank), Time>,
    /// Closed connections, both directions.
    cut: HashSet<(Rank, Rank)>,
    dead: Vec<bool>,
    /// Members of each multicast group.
    groups: HashMap<u32, Vec<Rank>>,
    /// Ranks that received something since [`SimNet::take_touched`], once each.
    touched: Vec<Rank>,
    touched_flag: Vec<bool>,
    stats: NetStats,
    trace: u64,
}

impl State {
    fn link(&self, from: Rank, to: Rank) -> Link {
        match &self.cfg.links {
            Some(f) => f(from, to),
            None => self.cfg.link,
        }
    }

    fn schedule(&mut self, at: Time, what: What) {
        self.seq += 1;
        self.flights.push(Flight { at, seq: self.seq, what });
    }

    fn touch(&mut self, r: Rank) {
        if !std::mem::replace(&mut self.touched_flag[r as usize], true) {
            self.touched.push(r);
        }
    }

    fn blocked(&self, a: Rank, b: Rank) -> bool {
        self.dead[a as usize] || self.dead[b as usize] || self.cut.contains(&(a, b))
    }

    fn send_frame(&mut self, src: Rank, dst: Rank, header: Header, payload: Bytes) {
        if self.blocked(src, dst) {
            self.stats.dropped += 1;
            return;
        }
        let link = self.link(src, dst);
        let bytes = HEADER_LEN + payload.len();
        let ser = link.serialize(bytes);
        let start = self.now.max(self.ports[src as usize].tx_free);
        self.ports[src as usize].tx_free = start + ser;
        let mut at = start + ser + link.latency + self.rng.upto(link.jitter);
        // Each loss costs a retransmission timeout. Certain loss would be a cut link, which is
        // `disconnect`'s business: it is capped below 1.
        while self.rng.chance(link.loss.min(0.99)) {
            at += self.cfg.rto;
            self.stats.retransmissions += 1;
        }
        // In order on the link: a frame reaches the receiver's port no earlier than the one
        // before it (and, on a tie, after it: same instant, later sequence number).
        let last = self.last.entry((src, dst)).or_insert(0);
        at = at.max(*last);
        *last = at;
        self.stats.frames += 1;
        self.stats.frame_bytes += bytes as u64;
        self.schedule(at, What::Frame { src, dst, header, payload, ported: false });
    }

    fn send_datagram(&mut self, src: Rank, group: u32, data: Bytes) {
        if self.dead[src as usize] {
            self.stats.dropped += 1;
            return;
        }
        let members = self.groups.get(&group).cloned().unwrap_or_default();
        let bytes = data.len() + DATAGRAM_OVERHEAD;
        let own = self.link(src, src);
        let ser = own.serialize(bytes);
        let start = self.now.max(self.ports[src as usize].tx_free);
        self.ports[src as usize].tx_free = start + ser;
        self.stats.datagrams += 1;
        self.stats.datagram_bytes += bytes as u64;
        for dst in members.into_iter().filter(|&d| d != src) {
            let link = self.link(src, dst);
            if self.rng.chance(link.loss) {
                self.stats.datagrams_lost += 1;
                continue;
            }
            let copies = if self.rng.chance(link.duplicate) { 2 } else { 1 };
            self.stats.datagrams_duplicated += copies - 1;
            for _ in 0..copies {
                let at = start + ser + link.latency + self.rng.upto(link.jitter);
                self.schedule(at, What::Datagram { src, dst, group, data: data.clone(), ported: false });
            }
        }
    }

    /// Closes the connection `a`-`b`: `a` learns it now with `reason`, `b` after the detection
    /// delay as a closed connection.
    fn close(&mut self, a: Rank, b: Rank, reason: TransportError) {
        if !self.cut.insert((a, b)) {
            return;
        }
        self.cut.insert((b, a));
        let (now, detect) = (self.now, self.cfg.detect);
        self.schedule(now, What::Lost { at_rank: a, peer: b, reason });
        self.schedule(now + detect, What::Lost { at_rank: b, peer: a, reason: TransportError::Closed });
    }

    /// Moves one due event on: through the receiver's port, then to its rank's inbox.
    fn arrive(&mut self, f: Flight) {
        if let Some(f) = self.through_port(f) {
            self.deliver(f);
        }
    }

    /// A frame or datagram reaching its receiver's port: the port takes in one at a time, in the
    /// order they reach it (incast queues here). Returns it if it is through at once.
    fn through_port(&mut self, f: Flight) -> Option<Flight> {
        let (src, dst, bytes, ported) = match &f.what {
            What::Frame { src, dst, payload, ported, .. } => (*src, *dst, HEADER_LEN + payload.len(), ported),
            What::Datagram { src, dst, data, ported, .. } => (*src, *dst, DATAGRAM_OVERHEAD + data.len(), ported),
            What::Lost { .. } => return Some(f),
        };
        if *ported {
            return Some(f);
        }
        let ser = self.link(src, dst).serialize(bytes);
        let port = &mut self.ports[dst as usize];
        // The last byte has reached the port at `f.at`; a busy port finishes its earlier frames
        // first and then takes this one whole.
        let done = f.at.max(port.rx_free + ser);
        port.rx_free = done;
        if done == f.at {
            return Some(f);
        }
        let what = match f.what {
            What::Frame { src, dst, header, payload, .. } => What::Frame { src, dst, header, payload, ported: true },
            What::Datagram { src, dst, group, data, .. } => What::Datagram { src, dst, group, data, ported: true },
            lost => lost,
        };
        self.schedule(done, what);
        None
    }

    /// Hands a due event to its rank's inbox.
    fn deliver(&mut self, f: Flight) {
        self.trace = mix(self.trace, f.at);
        match f.what {
            What::Frame { src, dst, header, payload, .. } => {
                if self.blocked(src, dst) {
                    self.stats.dropped += 1;
                    return;
                }
                self.trace = mix(self.trace, (u64::from(src) << 32) | u64::from(dst));
                self.trace = mix(self.trace, (header.kind as u64) << 32 | u64::from(header.len));
                self.trace = mix(self.trace, header.tag ^ header.seq.rotate_left(17) ^ header.aux.rotate_left(41));
                let inbox = &mut self.inbox[dst as usize];
                inbox.frames.push_back((src, header, payload));
                if let Some(w) = inbox.waker.take() {
                    w.wake();
                }
                self.touch(dst);
            }
            What::Datagram { src, dst, group, data, .. } => {
                if self.dead[src as usize] || self.dead[dst as usize] {
                    self.stats.dropped += 1;
                    return;
                }
                self.trace = mix(self.trace, (u64::from(src) << 32) | u64::from(dst));
                self.trace = mix(self.trace, data.len() as u64 | u64::from(group) << 32);
                self.stats.datagram_copies += 1;
                let inbox = &mut self.inbox[dst as usize];
                inbox.datagrams.entry(group).or_default().push_back(data);
                if let Some(w) = inbox.datagram_waker.take() {
                    w.wake();
                }
                self.touch(dst);
            }
            What::Lost { at_rank, peer, reason } => {
                if self.dead[at_rank as usize] {
                    return;
                }
                self.trace = mix(self.trace, (u64::from(at_rank) << 32) | u64::from(peer) | 1 << 63);
                let inbox = &mut self.inbox[at_rank as usize];
                inbox.lost.push_back((peer, reason));
                if let Some(w) = inbox.waker.take() {
                    w.wake();
                }
                self.touch(at_rank);
            }
        }
    }
}

/// A simulated network of `size` ranks (a cheap handle: clones share the network).
#[derive(Clone)]
pub struct SimNet {
    state: Arc<Mutex<State>>,
}

impl SimNet {
    pub fn new(size: u32, cfg: NetConfig) -> SimNet {
        let n = size as usize;
        let state = State {
            size,
            rng: Rng(cfg.seed),
            cfg,
            now: 0,
            seq: 0,
            flights: BinaryHeap::new(),
            inbox: (0..n).map(|_| Inbox::default()).collect(),
            ports: vec![Port::default(); n],
            last: HashMap::new(),
            cut: HashSet::new(),
            dead: vec![false; n],
            groups: HashMap::new(),
            touched: Vec::new(),
            touched_flag: vec![false; n],
            stats: NetStats::default(),
            trace: 0xcbf2_9ce4_8422_2325,
        };
        SimNet { state: Arc::new(Mutex::new(state)) }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere while holding the lock leaves the state as it was between two
        // operations (every operation completes its changes before returning).
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn size(&self) -> u32 {
        self.lock().size
    }

    /// The transport of rank `me`.
    pub fn transport(&self, me: Rank) -> SimTransport {
        assert!(me < self.size(), "rank {me} is outside the network");
        let eager_limit = self.lock().cfg.eager_limit;
        SimTransport { me, net: self.clone(), eager_limit }
    }

    /// Rank `me` joins multicast group `group` (any number names a group).
    pub fn join(&self, me: Rank, group: u32) -> SimDatagrams {
        let mut s = self.lock();
        assert!(me < s.size, "rank {me} is outside the network");
        let members = s.groups.entry(group).or_default();
        if !members.contains(&me) {
            members.push(me);
        }
        let max = s.cfg.max_datagram;
        SimDatagrams { me, group, max, net: self.clone() }
    }

    /// The current virtual time.
    pub fn now(&self) -> Time {
        self.lock().now
    }

    /// When the next event is due, if anything is in flight.
    pub fn next_event(&self) -> Option<Time> {
        self.lock().flights.peek().map(|f| f.at)
    }

    /// Moves time forward to the next event, or to `limit` if that comes first (a timer of the
    /// driver), and delivers every event due then. Returns the new time, or `None` when nothing is
    /// in flight and there is no limit. Time never goes back: a `limit` in the past is now.
    pub fn advance(&self, limit: Option<Time>) -> Option<Time> {
        let mut s = self.lock();
        let next = s.flights.peek().map(|f| f.at);
        let to = match (next, limit) {
            (Some(a), Some(b)) => a.min(b),
            (a, b) => a.or(b)?,
        };
        s.now = s.now.max(to);
        while s.flights.peek().is_some_and(|f| f.at <= s.now) {
            let f = s.flights.pop().expect("peeked");
            s.arrive(f);
        }
        Some(s.now)
    }

    /// The ranks that received something (frames, datagrams, loss notices) since the last call,
    /// in the order they first did.
    pub fn take_touched(&self) -> Vec<Rank> {
        let mut s = self.lock();
        let touched = std::mem::take(&mut s.touched);
        for &r in &touched {
            s.touched_flag[r as usize] = false;
        }
        touched
    }

    /// Crashes rank `r` now: what it sends and what is on its way to it is dropped, and every
    /// other live rank's transport reports it lost ([`TransportError::Closed`]) after
    /// [`NetConfig::detect`].
    pub fn kill(&self, r: Rank) {
        let mut s = self.lock();
        if std::mem::replace(&mut s.dead[r as usize], true) {
            return;
        }
        let at = s.now + s.cfg.detect;
        for other in 0..s.size {
            if other != r && !s.dead[other as usize] {
                s.schedule(at, What::Lost { at_rank: other, peer: r, reason: TransportError::Closed });
            }
        }
    }

    pub fn is_dead(&self, r: Rank) -> bool {
        self.lock().dead[r as usize]
    }

    pub fn stats(&self) -> NetStats {
        self.lock().stats.clone()
    }

    /// A fingerprint of everything delivered so far (when, from whom, to whom, which frame):
    /// equal for two runs exactly when they went the same way (up to hash collisions).
    pub fn trace(&self) -> u64 {
        self.lock().trace
    }

    /// The link parameters between `from` and `to`.
    pub fn link(&self, from: Rank, to: Rank) -> Link {
        self.lock().link(from, to)
    }
}

/// One rank's reliable frame path on a [`SimNet`].
pub struct SimTransport {
    me: Rank,
    net: SimNet,
    eager_limit: usize,
}

impl SimTransport {
    pub fn rank(&self) -> Rank {
        self.me
    }

    pub fn net(&self) -> &SimNet {
        &self.net
    }
}

impl Transport for SimTransport {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn eager_limit(&self) -> usize {
        self.eager_limit
    }

    fn send(&mut self, peer: Rank, header: Header, payload: Bytes) {
        self.net.lock().send_frame(self.me, peer, header, payload);
    }

    fn progress(&mut self, sink: &mut dyn Sink) -> usize {
        // Taken out under the lock and handed over without it: the sink may be anything.
        let (frames, lost) = {
            let mut s = self.net.lock();
            let inbox = &mut s.inbox[self.me as usize];
            (std::mem::take(&mut inbox.frames), std::mem::take(&mut inbox.lost))
        };
        let work = frames.len() + lost.len();
        for (peer, h, payload) in frames {
            if self.net.lock().cut.contains(&(self.me, peer)) {
                continue;
            }
            if h.kind == Kind::Data {
                // A rendezvous payload lands in the buffer the engine names, as TCP's does.
                match sink.data_dest(peer, &h) {
                    Ok(Some(dest)) if dest.len() == payload.len() => dest.copy_from_slice(&payload),
                    Ok(Some(dest)) => {
                        let (len, max) = (payload.len() as u64, dest.len() as u64);
                        self.disconnect(peer, TransportError::Wire(WireError::Oversize { kind: Kind::Data, len, max }));
                        continue;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        self.disconnect(peer, TransportError::Wire(e));
                        continue;
                    }
                }
                sink.frame(peer, h, Bytes::new());
            } else {
                sink.frame(peer, h, payload);
            }
        }
        for (peer, reason) in lost {
            sink.peer_lost(peer, reason);
        }
        // Losses reported by `disconnect` above are due now: hand them over in this call.
        let more = std::mem::take(&mut self.net.lock().inbox[self.me as usize].lost);
        for (peer, reason) in more {
            sink.peer_lost(peer, reason);
        }
        work
    }

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        let mut s = self.net.lock();
        let inbox = &mut s.inbox[self.me as usize];
        if !(inbox.frames.is_empty() && inbox.lost.is_empty()) {
            return Poll::Ready(());
        }
        inbox.waker = Some(cx.waker().clone());
        Poll::Pending
    }

    /// Frames go onto the simulated wire when sent; nothing waits in the transport.
    fn has_pending_output(&self) -> bool {
        false
    }

    fn disconnect(&mut self, peer: Rank, reason: TransportError) {
        let mut s = self.net.lock();
        s.close(self.me, peer, reason);
        // This end reports it at once (in the same progress call, when called from one).
        let now = s.now;
        while s.flights.peek().is_some_and(|f| f.at <= now) {
            let f = s.flights.pop().expect("peeked");
            s.arrive(f);
        }
    }
}

/// One rank's membership of a multicast group on a [`SimNet`]: unreliable datagrams.
pub struct SimDatagrams {
    me: Rank,
    group: u32,
    max: usize,
    net: SimNet,
}

impl SimDatagrams {
    pub fn rank(&self) -> Rank {
        self.me
    }

    /// Largest datagram (headers excluded).
    pub fn max_datagram(&self) -> usize {
        self.max
    }

    /// Sends `data` to every other member of the group, maybe. Longer than
    /// [`SimDatagrams::max_datagram`]: refused, as a UDP socket refuses it (`false`).
    pub fn send(&self, data: Bytes) -> bool {
        if data.len() > self.max {
            return false;
        }
        self.net.lock().send_datagram(self.me, self.group, data);
        true
    }

    /// The next datagram that arrived, if any.
    pub fn recv(&self) -> Option<Bytes> {
        self.net.lock().inbox[self.me as usize].datagrams.get_mut(&self.group)?.pop_front()
    }

    /// `Ready` with the next datagram, or registers `cx` to be woken when one arrives.
    pub fn poll_recv(&self, cx: &mut Context<'_>) -> Poll<Bytes> {
        let mut s = self.net.lock();
        let inbox = &mut s.inbox[self.me as usize];
        if let Some(d) = inbox.datagrams.get_mut(&self.group).and_then(VecDeque::pop_front) {
            return Poll::Ready(d);
        }
        inbox.datagram_waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests;
