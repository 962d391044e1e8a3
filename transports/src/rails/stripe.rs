//! The sans-IO core of multi-rail striping: which rail carries which frame, acknowledgements,
//! bandwidth estimates, moving a failed rail's share, and at the receiver, delivering each frame
//! exactly once and in order.
//!
//! A peer with more than one rail is *tracked*: every frame to it goes through this core, and
//! any rail may fail (rail 0 included) without losing or repeating a frame. A peer with one rail
//! (rail 0 only) is not: its frames go straight to rail 0, whose loss is the peer's.
//!
//! **Parts.** Rendezvous `Data` frames are cut into parts of [`StripeConfig::part`] bytes (a
//! frame below [`StripeConfig::threshold`] stays one part), each a `Data` frame of its own with
//! [`flags::RAIL_PART`] and a per-peer part id in `tag`, which wait in the peer's queue. A rail
//! takes the next part when it is the rail that would finish it first, `(unacknowledged bytes +
//! part) / bandwidth`, and has fewer than [`StripeConfig::window`] bytes unacknowledged: each
//! rail carries a share in proportion to its bandwidth, and the slow rail does not take the last
//! part when the fast one would finish it sooner. The bandwidth of a rail is a running estimate
//! from the pace of its acknowledgements while it is busy. Each connection acknowledges the parts
//! it carried (`seq` = parts received on that connection: TCP keeps them in order, so one count
//! says which); a sender keeps a part (a slice of the message, not a copy) until then.
//!
//! **Re-probing.** A rail that takes no part learns nothing about its bandwidth, so one measured
//! low once (a busy CPU at the receiver) would keep a tiny share for good. A rail whose estimate is
//! stale (no sample while another rail of the peer took samples for [`StripeConfig::reprobe`],
//! or for [`StripeConfig::reprobe_messages`] messages) is scheduled as if it were as fast as the fastest rail until its next sample: it
//! takes at most a window of parts more than its share, and the sample puts its estimate back to
//! what the rail does now.
//!
//! **Control frames.** Every other frame (eager messages, the rendezvous handshake, credits,
//! goodbyes) is a control frame with an index, implicit: the frames on one connection are numbered
//! consecutively from the index its *mark* gives (rail 0 starts at 0 without one). They travel on
//! the peer's control rail, rail 0 until it fails, and the sender keeps each until the receiver
//! acknowledges it (a cumulative count, coalesced: after [`CTRL_ACK_EVERY`] frames or
//! [`StripeConfig::stall`] / 4, at most [`ACK_DELAY_MAX`]). At most
//! [`StripeConfig::control_window`] frames ([`StripeConfig::control_window_bytes`] of payload) are
//! unacknowledged; further ones wait, unsent and in order, until acknowledgements make room: a
//! receiver that does not read holds the sender back rather than growing what it keeps for
//! replay (the receiver acknowledges within [`ACK_DELAY_MAX`] whatever it read, so a full window
//! always empties once it reads). When the control rail fails, the
//! lowest rail still up becomes the control rail: a mark carrying the oldest unacknowledged
//! index, then every unacknowledged control frame again, then new ones. The receiver delivers the
//! frame whose index is the next it expects, discards one below it (a copy it already has) and
//! treats one above it as a protocol violation (a sender never leaves a gap).
//!
//! Acknowledgements, marks and probes are `Credit` frames with [`flags::RAIL_ACK`], told apart by
//! `tag` ([`ACK_PARTS`], [`ACK_CONTROL`], [`MARK`], [`PROBE`]); they are not numbered.
//! Acknowledgements go back on the connection the acknowledged frames came in on; a probe is
//! answered with an [`ACK_PARTS`] on its connection.
//!
//! **Failure.** A rail fails when its connection reports the peer lost (an error, the connection
//! closed, the connection's own keep-alive timeout), or when it is *dead while the peer is alive*:
//! it has parts (or, as the control rail, control frames) waiting for acknowledgement and hears
//! nothing on it, while the peer acknowledges on another rail at least twice [`StripeConfig::stall`]
//! apart, and still nothing on it a grace of `stall` / 8 later (the peer reads every rail in one
//! pass, so a rail's acknowledgement may trail another's by a moment). A peer that reads nothing
//! at all (a slow receiver, a paused process) acknowledges on no rail: that is back-pressure, and
//! no rail is dropped for it; its connections' own timeouts decide whether it is gone. When a
//! rail has waited `stall` / 4 without a word, every rail of the peer that has been silent as long
//! carries a probe (one at a time), so that an idle rail shows whether the peer still reads. The
//! last rail up is never dropped this way. A failed rail's unacknowledged parts go back to the
//! front of the queue, and the other rails carry them. The peer is lost when its last rail is.
//!
//! **Receiving.** A part may arrive twice (on the failed rail, read before the failure, and again
//! on another). Part ids are dense from 0, so delivered ids are a low-water mark and the set above
//! it; an id at or beyond [`MAX_AHEAD`] past the mark is a protocol violation (it bounds that set).
//!
//! An orderly goodbye (`Bye`) to a peer waits until every part to that peer is acknowledged, so
//! it cannot overtake the end of a message on a faster rail.

use std::collections::{BTreeSet, VecDeque};
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::wire::{Header, Kind, Rank, WireError, flags};

/// How far past its lowest undelivered part id a receiver accepts parts.
pub const MAX_AHEAD: u64 = 1 << 20;

/// `tag` of a [`flags::RAIL_ACK`] frame acknowledging parts: `seq` counts the parts received on
/// the connection it travels back on.
pub const ACK_PARTS: u64 = 0;
/// `tag` of a [`flags::RAIL_ACK`] frame acknowledging control frames: `seq` counts the control
/// frames delivered from the peer, whichever rail they came on.
pub const ACK_CONTROL: u64 = 1;
/// `tag` of a [`flags::RAIL_ACK`] frame marking the start of control frames on a connection:
/// `seq` is the index of the next control frame on it.
pub const MARK: u64 = 2;
/// `tag` of a [`flags::RAIL_ACK`] frame asking for an [`ACK_PARTS`] on the connection it came
/// on: whether the peer still reads that connection.
pub const PROBE: u64 = 3;

/// A receiver acknowledges control frames at once after this many.
pub const CTRL_ACK_EVERY: u64 = 32;
/// The longest a receiver delays acknowledging control frames.
pub const ACK_DELAY_MAX: Duration = Duration::from_millis(5);

/// Striping parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StripeConfig {
    /// A rendezvous data frame at offset 0 shorter than this (a whole message below it) travels
    /// as one part, on whichever rail would finish it first.
    pub threshold: usize,
    /// Size of one part.
    pub part: usize,
    /// Bytes a rail may have unacknowledged.
    pub window: usize,
    /// A rail that waits this long for an acknowledgement, while the peer acknowledges on another
    /// rail, is dropped (see the module docs).
    pub stall: Duration,
    /// Bandwidth assumed for a rail before its first measurement, bytes per second.
    pub initial_bandwidth: f64,
    /// A rail's bandwidth estimate is stale, and the rail re-probed, when another rail of the
    /// peer has a sample this much newer...
    pub reprobe: Duration,
    /// ... or when this many messages were striped to the peer since it was taken.
    pub reprobe_messages: u32,
    /// Control frames a peer may have unacknowledged; more wait, unsent, for acknowledgements.
    pub control_window: usize,
    /// Payload bytes of the control frames a peer may have unacknowledged (a larger frame goes
    /// alone).
    pub control_window_bytes: usize,
}

impl Default for StripeConfig {
    fn default() -> Self {
        StripeConfig {
            threshold: 256 * 1024,
            part: 128 * 1024,
            window: 1 << 20,
            stall: Duration::from_secs(2),
            initial_bandwidth: 1e9,
            reprobe: Duration::from_millis(100),
            reprobe_messages: 16,
            control_window: 256,
            control_window_bytes: 4 << 20,
        }
    }
}

/// Shortest interval a bandwidth sample spans: acknowledgements come in bursts (one progress
/// call reads several parts), so a sample over one ack would be noise.
const SAMPLE_MIN: Duration = Duration::from_millis(2);

struct Part {
    header: Header,
    payload: Bytes,
}

struct Rail {
    up: bool,
    /// Sent, not yet acknowledged, in the order sent.
    inflight: VecDeque<Part>,
    bytes: usize,
    sent: u64,
    acked: u64,
    /// Bytes per second.
    bandwidth: f64,
    measured: bool,
    /// Start of the current bandwidth sample (the rail has been busy since), and its bytes.
    sample_start: Option<Instant>,
    sample_bytes: usize,
    /// When the estimate was last sampled (or the rail set up), and messages striped since.
    sampled_at: Instant,
    messages: u32,
    /// The last acknowledgement (or probe answer) on this rail, or when it last began to wait
    /// for one (see [`Peer::waiting`]): the start of its silence while it waits.
    last: Instant,
    /// While it waits: when the peer first acknowledged on another rail since `last`, and when it
    /// did so again at least a stall time later (see the module docs).
    alive_elsewhere: Option<Instant>,
    confirmed: Option<Instant>,
    /// A probe is out on it, unanswered.
    probed: bool,
    carried: u64,
}

impl Rail {
    fn new(bandwidth: f64, now: Instant) -> Rail {
        Rail {
            up: true,
            inflight: VecDeque::new(),
            bytes: 0,
            sent: 0,
            acked: 0,
            bandwidth,
            measured: false,
            sample_start: None,
            sample_bytes: 0,
            sampled_at: now,
            messages: 0,
            last: now,
            alive_elsewhere: None,
            confirmed: None,
            probed: false,
            carried: 0,
        }
    }

    /// Whether the estimate is stale: `newest` is the latest sample of any of the peer's rails, so
    /// time without samples counts only while other rails take them (an idle peer stales none).
    fn stale(&self, cfg: &StripeConfig, newest: Instant) -> bool {
        self.measured
            && (self.messages >= cfg.reprobe_messages
                || newest.saturating_duration_since(self.sampled_at) >= cfg.reprobe)
    }
}

#[derive(Default)]
struct Peer {
    rails: Vec<Option<Rail>>,
    /// More than one rail: every frame goes through the core (see the module docs).
    tracked: bool,
    queue: VecDeque<Part>,
    next_id: u64,
    /// Frames (a goodbye, and whatever follows it) waiting for every part to be acknowledged.
    held: VecDeque<(Header, Bytes)>,
    gone: bool,
    moved: u64,
    /// Control frames sent and not acknowledged, the first with index `ctrl_base`, and their
    /// payload bytes.
    ctrl: VecDeque<(Header, Bytes)>,
    ctrl_bytes: usize,
    ctrl_base: u64,
    ctrl_rail: usize,
    /// Control frames not sent yet: the window of unacknowledged ones was full.
    ctrl_wait: VecDeque<(Header, Bytes)>,
    replayed: u64,
    // Receiving side.
    low: u64,
    above: BTreeSet<u64>,
    received: Vec<u64>,
    acked: Vec<u64>,
    /// Per rail: the index of the next control frame on that connection (`None`: not marked).
    cursor: Vec<Option<u64>>,
    /// Control frames delivered, and the count last acknowledged.
    ctrl_low: u64,
    ctrl_acked: u64,
    /// The connection the last control frame came on, and when the acknowledgement is due.
    ctrl_ack_rail: usize,
    ctrl_ack_due: Option<Instant>,
    ctrl_ack_queued: bool,
}

impl Peer {
    fn busy(&self) -> bool {
        !self.queue.is_empty() || self.rails.iter().flatten().any(|r| !r.inflight.is_empty())
    }

    fn up_rails(&self) -> usize {
        self.rails.iter().flatten().filter(|r| r.up).count()
    }

    /// Whether rail `i` waits for an acknowledgement: it has parts in flight, or it is the control
    /// rail and control frames are unacknowledged.
    fn waiting(&self, i: usize) -> bool {
        let ctrl = i == self.ctrl_rail && !self.ctrl.is_empty();
        self.rails.get(i).and_then(Option::as_ref).is_some_and(|r| r.up && (ctrl || !r.inflight.is_empty()))
    }

    /// Rail `i` is about to get work: if it was not waiting, its silence starts now.
    fn begin_waiting(&mut self, i: usize, now: Instant) {
        if self.waiting(i) {
            return;
        }
        if let Some(r) = self.rails.get_mut(i).and_then(Option::as_mut) {
            r.last = now;
            r.alive_elsewhere = None;
            r.confirmed = None;
        }
    }

    /// The peer acknowledged something on rail `rail` (so it reads that rail): that rail's silence
    /// ends, and for every other rail waiting in silence it is a sign that the peer is alive.
    fn heard(&mut self, rail: usize, now: Instant, stall: Duration) {
        let ctrl_rail = (!self.ctrl.is_empty()).then_some(self.ctrl_rail);
        for (i, r) in self.rails.iter_mut().enumerate() {
            let Some(r) = r.as_mut().filter(|r| r.up) else { continue };
            let waiting = ctrl_rail == Some(i) || !r.inflight.is_empty();
            if i == rail {
                r.last = now;
                r.alive_elsewhere = None;
                r.confirmed = None;
                r.probed = false;
            } else if waiting {
                match r.alive_elsewhere {
                    None => r.alive_elsewhere = Some(now),
                    Some(first) if r.confirmed.is_none() && now >= first + stall => r.confirmed = Some(now),
                    Some(_) => {}
                }
            }
        }
    }

    /// Whether a control frame of `len` payload bytes may be sent now.
    fn control_room(&self, cfg: &StripeConfig, len: usize) -> bool {
        self.ctrl.is_empty()
            || (self.ctrl.len() < cfg.control_window && self.ctrl_bytes + len <= cfg.control_window_bytes)
    }

    fn delivered(&self, id: u64) -> bool {
        id < self.low || self.above.contains(&id)
    }

    fn deliver(&mut self, id: u64) {
        if id == self.low {
            self.low += 1;
            while self.above.remove(&self.low) {
                self.low += 1;
            }
        } else {
            self.above.insert(id);
        }
    }
}

/// What one rail of one peer has done, for metrics, benchmarks and tests.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RailStats {
    /// The rail still carries parts.
    pub up: bool,
    /// Payload bytes of parts it carried that were acknowledged.
    pub carried: u64,
    /// Its bandwidth estimate, bytes per second (the configured initial one until measured).
    pub bandwidth: f64,
    /// The estimate is a measurement.
    pub measured: bool,
    /// It carries the control frames.
    pub control: bool,
}

/// What to acknowledge: parts on a rail, or control frames.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ack {
    Parts(usize),
    Control,
}

/// Striping state for every peer of one rank.
pub struct Stripe {
    me: Rank,
    cfg: StripeConfig,
    peers: Vec<Peer>,
    /// Frames to write: (rail, peer, header, payload).
    out: VecDeque<(usize, Rank, Header, Bytes)>,
    /// Connections to close: (rail, peer); their loss comes back through [`Stripe::rail_lost`].
    cut: VecDeque<(usize, Rank)>,
    /// Peers that broke the rails' protocol.
    violations: VecDeque<(Rank, WireError)>,
    /// Acknowledgements owed.
    acks: VecDeque<(Rank, Ack)>,
}

impl Stripe {
    /// For rank `me`; `links[peer][rail]`: whether there is a connection to `peer` on `rail`
    /// (rail 0 is the bootstrap connection, which every remote peer has).
    pub fn new(me: Rank, cfg: StripeConfig, links: &[Vec<bool>], now: Instant) -> Stripe {
        let cfg = StripeConfig { part: cfg.part.max(1), window: cfg.window.max(1), ..cfg };
        let peers = links
            .iter()
            .map(|l| Peer {
                rails: l.iter().map(|&on| on.then(|| Rail::new(cfg.initial_bandwidth, now))).collect(),
                tracked: l.iter().filter(|&&on| on).count() > 1,
                received: vec![0; l.len()],
                acked: vec![0; l.len()],
                cursor: (0..l.len()).map(|r| (r == 0).then_some(0)).collect(),
                ..Peer::default()
            })
            .collect();
        Stripe {
            me,
            cfg,
            peers,
            out: VecDeque::new(),
            cut: VecDeque::new(),
            violations: VecDeque::new(),
            acks: VecDeque::new(),
        }
    }

    /// Whether frame `h` to `peer` goes through [`Stripe::send`] rather than straight to rail 0:
    /// every frame to a tracked peer except a proxy's envelope (which travels whole, untracked, on
    /// rail 0).
    pub fn takes(&self, peer: Rank, h: &Header) -> bool {
        let Some(p) = self.peers.get(peer as usize) else { return false };
        p.tracked && !p.gone && !(h.kind == Kind::Data && h.flags & flags::RELAY != 0)
    }

    /// Queues a frame that [`Stripe::takes`].
    pub fn send(&mut self, peer: Rank, h: Header, payload: Bytes, now: Instant) {
        let (part, threshold) = (self.cfg.part, self.cfg.threshold);
        let p = &mut self.peers[peer as usize];
        if p.gone {
            return;
        }
        if !p.held.is_empty() || (h.kind == Kind::Bye && p.busy()) {
            p.held.push_back((h, payload));
        } else if h.kind == Kind::Data {
            if h.aux == 0 {
                for r in p.rails.iter_mut().flatten() {
                    r.messages = r.messages.saturating_add(1);
                }
            }
            let part = if h.aux == 0 && payload.len() < threshold { payload.len().max(1) } else { part };
            let mut off = 0;
            loop {
                let end = (off + part).min(payload.len());
                let header = Header {
                    flags: h.flags | flags::RAIL_PART,
                    tag: p.next_id,
                    aux: h.aux + off as u64,
                    len: (end - off) as u32,
                    ..h
                };
                p.queue.push_back(Part { header, payload: payload.slice(off..end) });
                p.next_id += 1;
                off = end;
                if off >= payload.len() {
                    break;
                }
            }
        } else {
            Self::control_out(&mut self.out, &self.cfg, peer, p, h, payload, now);
        }
        self.schedule(peer, now);
    }

    /// Sends control frame `h` on the peer's control rail, keeping it until acknowledged; or, while
    /// the window of unacknowledged control frames is full (or frames wait already), queues it.
    fn control_out(
        out: &mut VecDeque<(usize, Rank, Header, Bytes)>,
        cfg: &StripeConfig,
        peer: Rank,
        p: &mut Peer,
        h: Header,
        payload: Bytes,
        now: Instant,
    ) {
        if !p.ctrl_wait.is_empty() || !p.control_room(cfg, payload.len()) {
            p.ctrl_wait.push_back((h, payload));
            return;
        }
        p.begin_waiting(p.ctrl_rail, now);
        out.push_back((p.ctrl_rail, peer, h, payload.clone()));
        p.ctrl_bytes += payload.len();
        p.ctrl.push_back((h, payload));
    }

    /// Sends the control frames that wait, as far as the window allows.
    fn release_control(
        out: &mut VecDeque<(usize, Rank, Header, Bytes)>,
        cfg: &StripeConfig,
        peer: Rank,
        p: &mut Peer,
        now: Instant,
    ) {
        while let Some(len) = p.ctrl_wait.front().map(|(_, b)| b.len()) {
            if !p.control_room(cfg, len) {
                break;
            }
            let (h, payload) = p.ctrl_wait.pop_front().expect("a waiting control frame");
            p.begin_waiting(p.ctrl_rail, now);
            out.push_back((p.ctrl_rail, peer, h, payload.clone()));
            p.ctrl_bytes += payload.len();
            p.ctrl.push_back((h, payload));
        }
    }

    /// Hands parts to the rails that should carry them; releases held frames once nothing is on
    /// its way.
    fn schedule(&mut self, peer: Rank, now: Instant) {
        let cfg = self.cfg;
        let p = &mut self.peers[peer as usize];
        // A stale rail counts as fast as the fastest until it is sampled again.
        let fastest = p.rails.iter().flatten().filter(|r| r.up).map(|r| r.bandwidth).fold(0.0, f64::max);
        let newest = p.rails.iter().flatten().filter(|r| r.up).map(|r| r.sampled_at).max().unwrap_or(now);
        while let Some(len) = p.queue.front().map(|x| x.payload.len()) {
            let best = p
                .rails
                .iter()
                .enumerate()
                .filter_map(|(i, r)| {
                    let r = r.as_ref().filter(|r| r.up)?;
                    let bw = if r.stale(&cfg, newest) { fastest } else { r.bandwidth };
                    Some((i, (r.bytes + len) as f64 / bw))
                })
                .min_by(|a, b| a.1.total_cmp(&b.1));
            let Some((i, _)) = best else { break };
            if p.rails[i].as_ref().is_some_and(|r| r.bytes >= cfg.window) {
                // The rail that would finish it first is full: wait for its acknowledgements
                // rather than give the part to a rail that would finish it later.
                break;
            }
            p.begin_waiting(i, now);
            let r = p.rails[i].as_mut().expect("an up rail");
            let part = p.queue.pop_front().expect("a queued part");
            if r.inflight.is_empty() {
                r.sample_start = Some(now);
                r.sample_bytes = 0;
            }
            r.bytes += len;
            r.sent += 1;
            self.out.push_back((i, peer, part.header, part.payload.clone()));
            r.inflight.push_back(part);
        }
        if !p.busy() {
            while let Some((h, payload)) = p.held.pop_front() {
                Self::control_out(&mut self.out, &cfg, peer, p, h, payload, now);
            }
        }
    }

    /// A [`flags::RAIL_ACK`] frame `h` from `peer` on `rail`: an acknowledgement or a mark.
    pub fn on_rail_frame(&mut self, peer: Rank, rail: usize, h: &Header, now: Instant) {
        match h.tag {
            ACK_PARTS => self.on_ack(peer, rail, h.seq, now),
            ACK_CONTROL => self.on_control_ack(peer, rail, h.seq, now),
            MARK => self.on_mark(peer, rail, h.seq),
            PROBE => self.on_probe(peer, rail),
            _ => self.violations.push_back((peer, WireError::Link("unknown rail frame"))),
        }
    }

    /// `peer` acknowledged `count` parts in all on `rail`.
    pub fn on_ack(&mut self, peer: Rank, rail: usize, count: u64, now: Instant) {
        let stall = self.cfg.stall;
        let p = &mut self.peers[peer as usize];
        if p.rails.get(rail).and_then(Option::as_ref).is_some_and(|r| r.up && count >= r.acked && count <= r.sent) {
            p.heard(rail, now, stall);
        }
        let Some(r) = p.rails.get_mut(rail).and_then(|r| r.as_mut()) else {
            return self.violations.push_back((peer, WireError::Link("rail acknowledgement on an unknown rail")));
        };
        if count < r.acked || count > r.sent {
            return self.violations.push_back((peer, WireError::Link("rail acknowledgement beyond the parts sent")));
        }
        if !r.up {
            // Its parts moved to other rails already.
            return;
        }
        let mut bytes = 0;
        while r.acked < count {
            let part = r.inflight.pop_front().expect("an unacknowledged part");
            bytes += part.payload.len();
            r.acked += 1;
        }
        r.bytes -= bytes;
        r.carried += bytes as u64;
        if let Some(start) = r.sample_start {
            r.sample_bytes += bytes;
            let span = now.saturating_duration_since(start);
            if span >= SAMPLE_MIN && r.sample_bytes > 0 {
                let sample = r.sample_bytes as f64 / span.as_secs_f64();
                r.bandwidth = if r.measured { 0.5 * r.bandwidth + 0.5 * sample } else { sample };
                r.measured = true;
                r.sampled_at = now;
                r.messages = 0;
                r.sample_start = Some(now);
                r.sample_bytes = 0;
            }
        }
        if r.inflight.is_empty() {
            r.sample_start = None;
        }
        self.schedule(peer, now);
    }

    /// `peer` acknowledged `count` control frames in all, on `rail`.
    fn on_control_ack(&mut self, peer: Rank, rail: usize, count: u64, now: Instant) {
        let p = &mut self.peers[peer as usize];
        if count > p.ctrl_base + p.ctrl.len() as u64 {
            return self
                .violations
                .push_back((peer, WireError::Link("control acknowledgement beyond the frames sent")));
        }
        p.heard(rail, now, self.cfg.stall);
        // An older acknowledgement, overtaken on another rail, says nothing new.
        if count > p.ctrl_base {
            for (_, payload) in p.ctrl.drain(..(count - p.ctrl_base) as usize) {
                p.ctrl_bytes -= payload.len();
            }
            p.ctrl_base = count;
            Self::release_control(&mut self.out, &self.cfg, peer, p, now);
        }
    }

    /// `peer` asks whether this rank still reads `rail`: the answer is an acknowledgement of the
    /// parts received on it.
    fn on_probe(&mut self, peer: Rank, rail: usize) {
        let p = &mut self.peers[peer as usize];
        if rail >= p.received.len() {
            return self.violations.push_back((peer, WireError::Link("rail probe on an unknown rail")));
        }
        // Unequal counts: an acknowledgement is queued already.
        if p.received[rail] == p.acked[rail] {
            self.acks.push_back((peer, Ack::Parts(rail)));
        }
    }

    /// Control frames from `peer` on `rail` are numbered from `index` on.
    fn on_mark(&mut self, peer: Rank, rail: usize, index: u64) {
        let p = &mut self.peers[peer as usize];
        if rail >= p.cursor.len() || index > p.ctrl_low {
            return self.violations.push_back((peer, WireError::Link("rail mark beyond the control frames delivered")));
        }
        p.cursor[rail] = Some(index);
    }

    /// The connection to `peer` on `rail` is gone: its unacknowledged parts move to the other
    /// rails, and if it carried the control frames, the lowest rail still up takes them over
    /// (from the oldest unacknowledged). True if that was the peer's last rail: the peer is lost
    /// (the caller reports it).
    pub fn rail_lost(&mut self, peer: Rank, rail: usize, now: Instant) -> bool {
        let Some(p) = self.peers.get_mut(peer as usize) else { return false };
        if p.gone {
            return false;
        }
        if rail < p.cursor.len() {
            p.cursor[rail] = None;
        }
        let Some(r) = p.rails.get_mut(rail).and_then(|r| r.as_mut()) else {
            // A connection outside the table (there is none but rail 0's): as without rails.
            return rail == 0;
        };
        if !r.up {
            return false;
        }
        r.up = false;
        r.bytes = 0;
        let moved = std::mem::take(&mut r.inflight);
        p.moved += moved.len() as u64;
        // Parts leave the queue in id order, so the rail's are older than every queued one.
        for part in moved.into_iter().rev() {
            p.queue.push_front(part);
        }
        let Some(next) = p.rails.iter().position(|r| r.as_ref().is_some_and(|r| r.up)) else {
            p.gone = true;
            p.queue.clear();
            p.held.clear();
            p.ctrl.clear();
            p.ctrl_bytes = 0;
            p.ctrl_wait.clear();
            p.ctrl_ack_due = None;
            return true;
        };
        tracing::warn!(peer, rail, "rail failed; its share moves to the other rails");
        metrics::counter!("ferrocomm_rail_failures").increment(1);
        if rail == p.ctrl_rail {
            if !p.ctrl.is_empty() {
                p.begin_waiting(next, now);
            }
            p.ctrl_rail = next;
            let mark = Header {
                src: self.me,
                flags: flags::RAIL_ACK,
                tag: MARK,
                seq: p.ctrl_base,
                ..Header::new(Kind::Credit)
            };
            self.out.push_back((next, peer, mark, Bytes::new()));
            for (h, payload) in &p.ctrl {
                self.out.push_back((next, peer, *h, payload.clone()));
            }
            p.replayed += p.ctrl.len() as u64;
        }
        self.schedule(peer, now);
        false
    }

    /// How long a rail waits in silence before the peer's silent rails are probed.
    fn probe_after(&self) -> Duration {
        self.cfg.stall / 4
    }

    /// How long a rail's acknowledgement may trail the peer's on another rail.
    fn grace(&self) -> Duration {
        self.cfg.stall / 8
    }

    /// When the peer's silent rails are to be probed: [`Stripe::probe_after`] into the silence of
    /// the rail that has waited longest, if any waits (and another rail is up).
    fn probe_from(&self, p: &Peer) -> Option<Instant> {
        if p.up_rails() < 2 {
            return None;
        }
        (0..p.rails.len())
            .filter(|&i| p.waiting(i))
            .filter_map(|i| p.rails[i].as_ref())
            .map(|r| r.last + self.probe_after())
            .min()
    }

    /// Drops rails dead while the peer is alive, probes silent rails, and sends acknowledgements
    /// that are due (see the module docs).
    pub fn handle_timeout(&mut self, now: Instant) {
        let grace = self.grace();
        for peer in 0..self.peers.len() {
            loop {
                let p = &self.peers[peer];
                if p.gone || p.up_rails() < 2 {
                    break;
                }
                let dead = (0..p.rails.len()).find(|&i| {
                    p.waiting(i) && p.rails[i].as_ref().and_then(|r| r.confirmed).is_some_and(|t| now >= t + grace)
                });
                let Some(rail) = dead else { break };
                self.rail_lost(peer as Rank, rail, now);
                self.cut.push_back((rail, peer as Rank));
            }
            if self.probe_from(&self.peers[peer]).is_some_and(|t| t <= now) {
                let after = self.probe_after();
                let p = &mut self.peers[peer];
                for (i, r) in p.rails.iter_mut().enumerate() {
                    let Some(r) = r.as_mut().filter(|r| r.up && !r.probed && r.last + after <= now) else { continue };
                    r.probed = true;
                    let probe =
                        Header { src: self.me, flags: flags::RAIL_ACK, tag: PROBE, ..Header::new(Kind::Credit) };
                    self.out.push_back((i, peer as Rank, probe, Bytes::new()));
                }
            }
            let p = &mut self.peers[peer];
            if p.ctrl_ack_due.is_some_and(|t| t <= now) && !p.ctrl_ack_queued {
                p.ctrl_ack_queued = true;
                self.acks.push_back((peer as Rank, Ack::Control));
            }
        }
    }

    /// When [`Stripe::handle_timeout`] should next run.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let (after, grace) = (self.probe_after(), self.grace());
        self.peers
            .iter()
            .filter(|p| !p.gone)
            .flat_map(|p| {
                let from = self.probe_from(p);
                let several = p.up_rails() > 1;
                let probes = p
                    .rails
                    .iter()
                    .flatten()
                    .filter(move |r| r.up && !r.probed)
                    .filter_map(move |r| from.map(|f| f.max(r.last + after)));
                let cuts = (0..p.rails.len())
                    .filter(move |&i| several && p.waiting(i))
                    .filter_map(move |i| p.rails[i].as_ref().and_then(|r| r.confirmed))
                    .map(move |t| t + grace);
                let ack = p.ctrl_ack_due.filter(|_| !p.ctrl_ack_queued);
                probes.chain(cuts).chain(ack)
            })
            .min()
    }

    /// The next frame to write: (rail, peer, header, payload).
    pub fn poll_transmit(&mut self) -> Option<(usize, Rank, Header, Bytes)> {
        self.out.pop_front()
    }

    /// The next connection to close: (rail, peer).
    pub fn poll_cut(&mut self) -> Option<(usize, Rank)> {
        self.cut.pop_front()
    }

    /// `peer` broke the rails' protocol (found by the caller).
    pub fn violation(&mut self, peer: Rank, e: WireError) {
        self.violations.push_back((peer, e));
    }

    /// The next peer that broke the rails' protocol.
    pub fn poll_violation(&mut self) -> Option<(Rank, WireError)> {
        self.violations.pop_front()
    }

    /// The next acknowledgement to write: (rail, peer, header).
    pub fn poll_ack(&mut self) -> Option<(usize, Rank, Header)> {
        let (peer, what) = self.acks.pop_front()?;
        let p = &mut self.peers[peer as usize];
        let (rail, tag, seq) = match what {
            Ack::Parts(rail) => {
                p.acked[rail] = p.received[rail];
                (rail, ACK_PARTS, p.received[rail])
            }
            Ack::Control => {
                p.ctrl_ack_queued = false;
                p.ctrl_ack_due = None;
                p.ctrl_acked = p.ctrl_low;
                (p.ctrl_ack_rail, ACK_CONTROL, p.ctrl_low)
            }
        };
        let h = Header { src: self.me, flags: flags::RAIL_ACK, tag, seq, ..Header::new(Kind::Credit) };
        Some((rail, peer, h))
    }

    /// True while parts or held frames wait for a rail.
    pub fn has_queued(&self) -> bool {
        !self.out.is_empty()
            || self.peers.iter().any(|p| !p.queue.is_empty() || !p.held.is_empty() || !p.ctrl_wait.is_empty())
    }

    /// True while any part is unacknowledged or waiting.
    pub fn busy(&self) -> bool {
        self.peers.iter().any(|p| p.busy() || !p.held.is_empty())
    }

    /// True while anything to a peer not lost, part or control frame, is unacknowledged or
    /// waiting: it may still have to be sent again on another rail, so the connections must stay.
    pub fn unacknowledged(&self) -> bool {
        self.peers
            .iter()
            .any(|p| !p.gone && (p.busy() || !p.held.is_empty() || !p.ctrl.is_empty() || !p.ctrl_wait.is_empty()))
    }

    // ---- receiving ----

    /// Whether `peer` is tracked (see the module docs): then every frame from it goes through
    /// [`Stripe::control`] or the part functions.
    pub fn tracked(&self, peer: Rank) -> bool {
        self.peers.get(peer as usize).is_some_and(|p| p.tracked)
    }

    /// A control frame (neither a part nor a rail frame) from `peer` came whole on `rail`: true if
    /// it is to be delivered, false if it is a copy of one delivered already.
    pub fn control(&mut self, peer: Rank, rail: usize, now: Instant) -> Result<bool, WireError> {
        let ack_delay = (self.cfg.stall / 4).min(ACK_DELAY_MAX);
        let Some(p) = self.peers.get_mut(peer as usize) else { return Ok(true) };
        if !p.tracked {
            return Ok(true);
        }
        let index = p
            .cursor
            .get_mut(rail)
            .and_then(|c| c.as_mut())
            .ok_or(WireError::Link("control frame on a rail before its mark"))?;
        let i = *index;
        if i > p.ctrl_low {
            return Err(WireError::Link("control frame past a gap"));
        }
        *index += 1;
        p.ctrl_ack_rail = rail;
        if !p.ctrl_ack_queued {
            if p.ctrl_low + 1 - p.ctrl_acked >= CTRL_ACK_EVERY {
                p.ctrl_ack_queued = true;
                self.acks.push_back((peer, Ack::Control));
            } else if p.ctrl_ack_due.is_none() {
                p.ctrl_ack_due = Some(now + ack_delay);
            }
        }
        if i < p.ctrl_low {
            return Ok(false);
        }
        p.ctrl_low += 1;
        Ok(true)
    }

    /// Checks the id of part `id` from `peer` before anything is read.
    pub fn check_part(&self, peer: Rank, id: u64) -> Result<(), WireError> {
        let p = &self.peers[peer as usize];
        if id >= p.low.saturating_add(MAX_AHEAD) {
            return Err(WireError::Link("rail part id too far ahead"));
        }
        Ok(())
    }

    /// Part `id` from `peer` has been read whole (into a staging buffer) on `rail`; true if it is
    /// to be delivered now, false if it was delivered already. Counts it toward the rail's
    /// acknowledgement either way.
    pub fn arrived(&mut self, peer: Rank, rail: usize, id: u64) -> bool {
        let p = &mut self.peers[peer as usize];
        if rail >= p.received.len() {
            return false;
        }
        if p.received[rail] == p.acked[rail] {
            self.acks.push_back((peer, Ack::Parts(rail)));
        }
        p.received[rail] += 1;
        let deliver = !p.delivered(id);
        if deliver {
            p.deliver(id);
        }
        deliver
    }

    /// Per-rail figures for `peer`.
    pub fn stats(&self, peer: Rank) -> Vec<Option<RailStats>> {
        let p = &self.peers[peer as usize];
        p.rails
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.as_ref().map(|r| RailStats {
                    up: r.up,
                    carried: r.carried,
                    bandwidth: r.bandwidth,
                    measured: r.measured,
                    control: p.tracked && !p.gone && i == p.ctrl_rail,
                })
            })
            .collect()
    }

    /// Parts to `peer` that moved off a failed rail.
    pub fn moved(&self, peer: Rank) -> u64 {
        self.peers[peer as usize].moved
    }

    /// Control frames to `peer` sent again after their rail failed.
    pub fn replayed(&self, peer: Rank) -> u64 {
        self.peers[peer as usize].replayed
    }
}

#[cfg(test)]
mod tests;
