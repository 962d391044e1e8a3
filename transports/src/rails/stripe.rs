//! The sans-IO core of multi-rail striping: which rail carries which part, acknowledgements,
//! bandwidth estimates, moving a failed rail's share, and at the receiver, delivering each part
//! exactly once.
//!
//! Sending: a rendezvous `Data` frame of a large message is cut into parts of [`StripeConfig::part`]
//! bytes (each a `Data` frame of its own, with [`flags::RAIL_PART`] and a per-peer part id in
//! `tag`), which wait in the peer's queue. A rail takes the next part when it is the rail that
//! would finish it first, `(unacknowledged bytes + part) / bandwidth`, and has fewer than
//! [`StripeConfig::window`] bytes unacknowledged: so each rail carries a share in proportion to
//! its bandwidth, the slow rail does not take the last part when the fast one would finish it
//! sooner, and a rail that slows down takes less at once (its acknowledgements come later).
//! The bandwidth of a rail is a running estimate from the pace of its acknowledgements while it
//! is busy.
//!
//! Each connection acknowledges the parts it carried (a `Credit` frame with
//! [`flags::RAIL_ACK`], `seq` = parts received on that connection: TCP keeps them in order, so
//! one count says which). A sender keeps a part (a slice of the message, not a copy) until it is
//! acknowledged. When a rail fails (its connection reports the peer lost, or it is stalled:
//! parts unacknowledged for [`StripeConfig::stall`] while it carries any), its unacknowledged
//! parts go back to the front of the queue and the other rails carry them. Rail 0 is the
//! bootstrap connection: it carries every other frame, in order, and its loss is the peer's.
//!
//! Receiving: a part may arrive twice (on the failed rail, read before the failure, and again on
//! another). Part ids are dense from 0, so delivered ids are a low-water mark and the set above
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

/// Striping parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StripeConfig {
    /// Messages of fewer bytes travel whole on rail 0 (a rendezvous data frame at offset 0 that is
    /// shorter than this is a whole message below it).
    pub threshold: usize,
    /// Size of one part.
    pub part: usize,
    /// Bytes a rail may have unacknowledged.
    pub window: usize,
    /// A rail other than rail 0 whose parts stay unacknowledged this long is dropped.
    pub stall: Duration,
    /// Bandwidth assumed for a rail before its first measurement, bytes per second.
    pub initial_bandwidth: f64,
}

impl Default for StripeConfig {
    fn default() -> Self {
        StripeConfig {
            threshold: 256 * 1024,
            part: 128 * 1024,
            window: 1 << 20,
            stall: Duration::from_secs(2),
            initial_bandwidth: 1e9,
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
    /// Last acknowledgement, or the first part sent to the idle rail.
    last: Instant,
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
            last: now,
            carried: 0,
        }
    }

    /// When this rail would have delivered `len` more bytes, in seconds from now.
    fn finish(&self, len: usize) -> f64 {
        (self.bytes + len) as f64 / self.bandwidth
    }
}

#[derive(Default)]
struct Peer {
    rails: Vec<Option<Rail>>,
    queue: VecDeque<Part>,
    next_id: u64,
    /// Frames (a goodbye, and whatever follows it) waiting for every part to be acknowledged.
    held: VecDeque<(Header, Bytes)>,
    gone: bool,
    moved: u64,
    // Receiving side.
    low: u64,
    above: BTreeSet<u64>,
    landing: Option<u64>,
    received: Vec<u64>,
    acked: Vec<u64>,
}

impl Peer {
    fn busy(&self) -> bool {
        !self.queue.is_empty() || self.rails.iter().flatten().any(|r| !r.inflight.is_empty())
    }

    fn up_rails(&self) -> usize {
        self.rails.iter().flatten().filter(|r| r.up).count()
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
}

/// Striping state for every peer of one rank.
pub struct Stripe {
    cfg: StripeConfig,
    peers: Vec<Peer>,
    /// Frames to write: (rail, peer, header, payload).
    out: VecDeque<(usize, Rank, Header, Bytes)>,
    /// Connections to close: (rail, peer); their loss comes back through [`Stripe::rail_lost`].
    cut: VecDeque<(usize, Rank)>,
    /// Peers that broke the rails' protocol.
    violations: VecDeque<(Rank, WireError)>,
    /// (rail, peer) pairs owing an acknowledgement.
    acks: VecDeque<(usize, Rank)>,
}

impl Stripe {
    /// `links[peer][rail]`: whether there is a connection to `peer` on `rail` (rail 0 is the
    /// bootstrap connection, which every remote peer has).
    pub fn new(cfg: StripeConfig, links: &[Vec<bool>], now: Instant) -> Stripe {
        let cfg = StripeConfig { part: cfg.part.max(1), window: cfg.window.max(1), ..cfg };
        let peers = links
            .iter()
            .map(|l| Peer {
                rails: l.iter().map(|&on| on.then(|| Rail::new(cfg.initial_bandwidth, now))).collect(),
                received: vec![0; l.len()],
                acked: vec![0; l.len()],
                ..Peer::default()
            })
            .collect();
        Stripe {
            cfg,
            peers,
            out: VecDeque::new(),
            cut: VecDeque::new(),
            violations: VecDeque::new(),
            acks: VecDeque::new(),
        }
    }

    /// Whether frame `h` to `peer` goes through [`Stripe::send`] rather than straight to rail 0:
    /// data of a large message while the peer has a second rail, and anything behind a held
    /// goodbye (or a goodbye while parts are on their way).
    pub fn takes(&self, peer: Rank, h: &Header) -> bool {
        let Some(p) = self.peers.get(peer as usize) else { return false };
        if p.gone {
            return false;
        }
        if !p.held.is_empty() {
            return true;
        }
        match h.kind {
            // An envelope for a proxy (crate::relay) travels whole.
            Kind::Data if h.flags & flags::RELAY != 0 => false,
            Kind::Data => (h.aux > 0 || h.len as usize >= self.cfg.threshold) && p.up_rails() > 1,
            Kind::Bye => p.busy(),
            _ => false,
        }
    }

    /// Queues a frame that [`Stripe::takes`].
    pub fn send(&mut self, peer: Rank, h: Header, payload: Bytes, now: Instant) {
        let part = self.cfg.part;
        let p = &mut self.peers[peer as usize];
        if p.gone {
            return;
        }
        if h.kind != Kind::Data || !p.held.is_empty() {
            p.held.push_back((h, payload));
        } else {
            let mut off = 0;
            while off < payload.len() {
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
            }
        }
        self.schedule(peer, now);
    }

    /// Hands parts to the rails that should carry them; releases held frames once nothing is on
    /// its way.
    fn schedule(&mut self, peer: Rank, now: Instant) {
        let p = &mut self.peers[peer as usize];
        while let Some(len) = p.queue.front().map(|x| x.payload.len()) {
            let best = p
                .rails
                .iter()
                .enumerate()
                .filter_map(|(i, r)| r.as_ref().filter(|r| r.up).map(|r| (i, r.finish(len))))
                .min_by(|a, b| a.1.total_cmp(&b.1));
            let Some((i, _)) = best else { break };
            let r = p.rails[i].as_mut().expect("an up rail");
            if r.bytes >= self.cfg.window {
                // The rail that would finish it first is full: wait for its acknowledgements
                // rather than give the part to a rail that would finish it later.
                break;
            }
            let part = p.queue.pop_front().expect("a queued part");
            if r.inflight.is_empty() {
                r.last = now;
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
                self.out.push_back((0, peer, h, payload));
            }
        }
    }

    /// `peer` acknowledged `count` parts in all on `rail`.
    pub fn on_ack(&mut self, peer: Rank, rail: usize, count: u64, now: Instant) {
        let Some(r) = self.peers[peer as usize].rails.get_mut(rail).and_then(|r| r.as_mut()) else {
            return self.violations.push_back((peer, WireError::Link("rail acknowledgement on an unknown rail")));
        };
        if count < r.acked || count > r.sent {
            return self.violations.push_back((peer, WireError::Link("rail acknowledgement beyond the parts sent")));
        }
        let mut bytes = 0;
        while r.acked < count {
            let part = r.inflight.pop_front().expect("an unacknowledged part");
            bytes += part.payload.len();
            r.acked += 1;
        }
        r.bytes -= bytes;
        r.carried += bytes as u64;
        r.last = now;
        if let Some(start) = r.sample_start {
            r.sample_bytes += bytes;
            let span = now.saturating_duration_since(start);
            if span >= SAMPLE_MIN && r.sample_bytes > 0 {
                let sample = r.sample_bytes as f64 / span.as_secs_f64();
                r.bandwidth = if r.measured { 0.5 * r.bandwidth + 0.5 * sample } else { sample };
                r.measured = true;
                r.sample_start = Some(now);
                r.sample_bytes = 0;
            }
        }
        if r.inflight.is_empty() {
            r.sample_start = None;
        }
        self.schedule(peer, now);
    }

    /// The connection to `peer` on `rail` is gone. On rail 0 that is the peer's loss (the caller
    /// reports it); on another rail, its unacknowledged parts move to the others.
    pub fn rail_lost(&mut self, peer: Rank, rail: usize, now: Instant) {
        let p = &mut self.peers[peer as usize];
        if rail == 0 {
            p.gone = true;
            p.queue.clear();
            p.held.clear();
            for r in p.rails.iter_mut().flatten() {
                r.up = false;
                r.inflight.clear();
                r.bytes = 0;
            }
            return;
        }
        let Some(r) = p.rails.get_mut(rail).and_then(|r| r.as_mut()) else { return };
        if !r.up {
            return;
        }
        r.up = false;
        r.bytes = 0;
        let moved = std::mem::take(&mut r.inflight);
        p.moved += moved.len() as u64;
        // Parts leave the queue in id order, so the rail's are older than every queued one.
        for part in moved.into_iter().rev() {
            p.queue.push_front(part);
        }
        tracing::warn!(peer, rail, "rail failed; its parts move to the other rails");
        metrics::counter!("ferrocomm_rail_failures").increment(1);
        self.schedule(peer, now);
    }

    /// Drops stalled rails (see the module docs).
    pub fn handle_timeout(&mut self, now: Instant) {
        for peer in 0..self.peers.len() {
            for rail in 1..self.peers[peer].rails.len() {
                let stalled = self.peers[peer].rails[rail].as_ref().is_some_and(|r| {
                    r.up && !r.inflight.is_empty() && now.saturating_duration_since(r.last) >= self.cfg.stall
                });
                if stalled {
                    self.rail_lost(peer as Rank, rail, now);
                    self.cut.push_back((rail, peer as Rank));
                }
            }
        }
    }

    /// When [`Stripe::handle_timeout`] should next run.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.peers
            .iter()
            .flat_map(|p| p.rails.iter().skip(1).flatten())
            .filter(|r| r.up && !r.inflight.is_empty())
            .map(|r| r.last + self.cfg.stall)
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
    pub fn poll_ack(&mut self, me: Rank) -> Option<(usize, Rank, Header)> {
        let (rail, peer) = self.acks.pop_front()?;
        let p = &mut self.peers[peer as usize];
        p.acked[rail] = p.received[rail];
        let h = Header { src: me, flags: flags::RAIL_ACK, seq: p.received[rail], ..Header::new(Kind::Credit) };
        Some((rail, peer, h))
    }

    /// True while parts or held frames wait for a rail.
    pub fn has_queued(&self) -> bool {
        !self.out.is_empty() || self.peers.iter().any(|p| !p.queue.is_empty() || !p.held.is_empty())
    }

    /// True while any part is unacknowledged or waiting.
    pub fn busy(&self) -> bool {
        self.peers.iter().any(|p| p.busy() || !p.held.is_empty())
    }

    // ---- receiving ----

    /// Checks the id of part `id` from `peer` before anything is read.
    pub fn check_part(&self, peer: Rank, id: u64) -> Result<(), WireError> {
        let p = &self.peers[peer as usize];
        if id >= p.low.saturating_add(MAX_AHEAD) {
            return Err(WireError::Link("rail part id too far ahead"));
        }
        Ok(())
    }

    /// Part `id` is about to be read on rail 0 straight into its destination: false if it is
    /// delivered already (discard it).
    pub fn land(&mut self, peer: Rank, id: u64) -> bool {
        let p = &mut self.peers[peer as usize];
        if p.landing == Some(id) {
            return true;
        }
        if p.delivered(id) {
            return false;
        }
        p.landing = Some(id);
        true
    }

    /// Part `id` from `peer` has been read whole on `rail`; true if it is to be delivered now
    /// (for rail 0, it was read into its destination; for another rail, the copy it staged must
    /// go there). Counts it toward the rail's acknowledgement either way.
    pub fn arrived(&mut self, peer: Rank, rail: usize, id: u64) -> bool {
        let p = &mut self.peers[peer as usize];
        if rail >= p.received.len() {
            return false;
        }
        if p.received[rail] == p.acked[rail] {
            self.acks.push_back((rail, peer));
        }
        p.received[rail] += 1;
        let deliver = if rail == 0 {
            let landed = p.landing == Some(id);
            if landed {
                p.landing = None;
            }
            landed
        } else {
            // Being read on rail 0 right now: that copy is the one delivered.
            !p.delivered(id) && p.landing != Some(id)
        };
        if deliver {
            p.deliver(id);
        }
        deliver
    }

    /// Per-rail figures for `peer`.
    pub fn stats(&self, peer: Rank) -> Vec<Option<RailStats>> {
        self.peers[peer as usize]
            .rails
            .iter()
            .map(|r| {
                r.as_ref().map(|r| RailStats {
                    up: r.up,
                    carried: r.carried,
                    bandwidth: r.bandwidth,
                    measured: r.measured,
                })
            })
            .collect()
    }

    /// Parts to `peer` that moved off a failed rail.
    pub fn moved(&self, peer: Rank) -> u64 {
        self.peers[peer as usize].moved
    }
}

#[cfg(test)]
mod tests;
